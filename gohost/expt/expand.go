package expt

import (
	"fmt"
	"maps"
	"strings"
)

// checkExpand checks a workload's expand declaration against its knobs.
func checkExpand(expand map[string]string, ps Params) error {
	for knob, how := range expand {
		p, ok := ps[knob]
		if !ok {
			return fmt.Errorf("expand names %q, which is not one of its params", knob)
		}
		switch {
		case how == "each":
			if p.Type != TypeStr {
				return fmt.Errorf("expand %q: each needs a str param, %q is %s", knob, knob, p.Type)
			}
		case strings.HasPrefix(how, "index:"):
			into, ok := ps[strings.TrimPrefix(how, "index:")]
			if p.Type != TypeInt || !ok || into.Type != TypeInt {
				return fmt.Errorf("expand %q: %s needs int params on both sides", knob, how)
			}
		default:
			return fmt.Errorf("expand %q: %q is neither each nor index:KNOB", knob, how)
		}
	}
	return nil
}

// expand spreads one workload value over the jobs its expand knobs ask for:
// one per item of an "each" knob, times one per index of an "index:" one.
// A workload without expand knobs is itself.
func (s *Schema) expand(w *workloadValue) []*workloadValue {
	expand := s.Workloads[w.name].Expand
	out := []map[string]any{w.values()}
	for _, knob := range sortedKeys(expand) {
		how := expand[knob]
		var next []map[string]any
		for _, vals := range out {
			switch {
			case how == "each":
				seen := map[string]bool{}
				for _, item := range strings.Split(vals[knob].(string), ",") {
					item = strings.TrimSpace(item)
					if item == "" || seen[item] {
						continue
					}
					seen[item] = true
					v := maps.Clone(vals)
					v[knob] = item
					next = append(next, v)
				}
				if len(seen) == 0 {
					next = append(next, vals) // nothing to spread: the workload says what is missing when it runs
				}
			default:
				into := strings.TrimPrefix(how, "index:")
				n, _ := vals[knob].(int64)
				for i := int64(0); i < max(n, 1); i++ {
					v := maps.Clone(vals)
					v[into] = i
					next = append(next, v)
				}
			}
		}
		out = next
	}
	values := make([]*workloadValue, len(out))
	for i, vals := range out {
		values[i] = newWorkloadValue(w.name, vals)
	}
	return values
}
