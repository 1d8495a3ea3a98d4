package main

import (
	"encoding/json"
	"testing"
)

// experiments/vlcache_sparsity.star draws VL-Cache's error-vs-budget figure
// under the paper's protocol for baselines (section 5): "the recent token
// window size is fixed at 10% of this budget", every method otherwise at
// its defaults. So H2O and VL-Cache keep recent_fraction 0.1 and SnapKV's
// observation window is window = 0 (10% of its budget), not its code's 32
// tokens, which at the small budgets was the whole cache.
func TestVLCacheExperimentGivesEveryRecentWindowTenPercentOfTheBudget(t *testing.T) {
	code, stdout, stderr := runCLI(t, "plan", "--json", "../experiments/vlcache_sparsity.star")
	if code != 0 {
		t.Fatalf("plan: exit %d: %s", code, stderr)
	}
	var p struct {
		Jobs []struct {
			Method string
			Params map[string]any
		}
	}
	if err := json.Unmarshal([]byte(stdout), &p); err != nil {
		t.Fatalf("plan --json: %v", err)
	}
	budgets := map[string]map[float64]bool{}
	for _, j := range p.Jobs {
		budget, _ := j.Params["budget"].(float64)
		switch j.Method {
		case "snapkv":
			if j.Params["window"] != float64(0) {
				t.Errorf("snapkv at budget %v: window %v, want 0 (10%% of the budget)", budget, j.Params["window"])
			}
		case "h2o":
			if j.Params["recent_fraction"] != 0.1 {
				t.Errorf("h2o at budget %v: recent_fraction %v, want 0.1", budget, j.Params["recent_fraction"])
			}
		case "vlcache":
			if j.Params["scoring"] == "post_vision" && j.Params["allocation"] == "sparsity" &&
				j.Params["recent_fraction"] != 0.1 {
				t.Errorf("vlcache at budget %v: recent_fraction %v, want 0.1", budget, j.Params["recent_fraction"])
			}
		default:
			continue
		}
		// The paper's own defaults otherwise: H2O evicts while decoding, VL-Cache and SnapKV compress the prompt once.
		if want := j.Method == "h2o"; j.Params["evict_while_decoding"] != want {
			t.Errorf("%s at budget %v: evict_while_decoding %v, want %v", j.Method, budget,
				j.Params["evict_while_decoding"], want)
		}
		if budgets[j.Method] == nil {
			budgets[j.Method] = map[float64]bool{}
		}
		budgets[j.Method][budget] = true
	}
	for _, method := range []string{"vlcache", "h2o", "snapkv"} {
		if len(budgets[method]) != 9 {
			t.Errorf("%s at %d budgets, want the 9 of BUDGETS", method, len(budgets[method]))
		}
	}
}
