package main

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/vlkv/vlkv/gohost/expt"
	"github.com/vlkv/vlkv/gohost/pyrt"
)

// An lmms workload spreads over a job per task and shard, and a run on an
// interpreter without lmms-eval stops before starting anything, saying how
// to get it.
func TestLmmsWorkloadPlansAndNeedsItsGroup(t *testing.T) {
	dir := t.TempDir()
	script := filepath.Join(dir, "acc.star")
	os.WriteFile(script, []byte(`experiment(name = "acc", methods = ["full", "h2o"], grid = {"budget": [0.1]},
    workloads = [workload("lmms", model = "m", tasks = "docvqa_val, chartqa", shards = 2)])
`), 0o644)
	code, stdout, stderr := runCLI(t, "plan", script)
	if code != 0 {
		t.Fatalf("plan: exit %d: %s", code, stderr)
	}
	if !strings.Contains(stdout, "experiment acc: 8 jobs") || strings.Count(stdout, "shard=1 ") != 4 ||
		strings.Count(stdout, "tasks=chartqa)") != 4 {
		t.Errorf("want 2 methods x 2 tasks x 2 shards:\n%s", stdout)
	}

	out := filepath.Join(dir, "results")
	code, _, stderr = runCLI(t, "--python", "/bin/false", "--device", "cpu", "run", "--out", out, script)
	if code != 1 || !strings.Contains(stderr, `workload "lmms" needs lmms_eval, which is not installed in /bin/false`) ||
		!strings.Contains(stderr, "its lmms group") {
		t.Fatalf("exit %d\n%s", code, stderr)
	}
	if entries, _ := os.ReadDir(out); len(entries) != 0 {
		t.Errorf("%s holds %d entries after a run refused before starting", out, len(entries))
	}

	// The papers' protocol plans: ((1 full + 5 methods x 5 budgets) x 2 KV dtypes (the model's, FP8) + 5 taus)
	// x 3 tasks.
	code, stdout, stderr = runCLI(t, "plan", "../experiments/accuracy.star")
	if code != 0 || !strings.Contains(stdout, "experiment accuracy: 171 jobs") {
		t.Errorf("plan accuracy.star: exit %d\n%s%s", code, stderr, firstLines(stdout, 2))
	}

	code, _, stderr = runCLI(t, "python", "--workload", "vlm", "--", "-c", "1")
	if code != 2 || !strings.Contains(stderr, `--workload "vlm": only lmms install dependencies beyond the runtime`) {
		t.Errorf("exit %d\n%s", code, stderr)
	}
}

func firstLines(s string, n int) string {
	lines := strings.SplitN(s, "\n", n+1)
	return strings.Join(lines[:min(n, len(lines))], "\n")
}

// A workload's files and folders that do not exist here are a warning at
// plan time, once each, a relative one looked for in the kernels root
// (where workers run); the jobs keep the paths as written.
func TestMissingWorkloadPathsAreWarnedOfAtPlanTime(t *testing.T) {
	schema, err := expt.LoadSchema("../kernels_py/schema.json")
	if err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	if err := os.WriteFile(filepath.Join(root, "cat.png"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	plan, err := expt.LoadSource("x.star", []byte(`experiment(name = "own", methods = ["full", "h2o"], workloads = [
    workload("vlm", model = "llava", images = "cat.png, /nowhere/dog.png, /nowhere/dog.png", prompt = "<image>"),
    workload("trace", path = "`+filepath.Join(root, "cat.png")+`"),
])`), schema)
	if err != nil {
		t.Fatal(err)
	}
	if got := plan.Experiments[0].Jobs[0].Workload["model"]; got != "llava" {
		t.Errorf("model = %q, want it as written", got)
	}
	got := missingPathWarnings(plan, pyrt.KernelsRoot{Dir: root, Source: "checkout"})
	want := []string{
		`experiment own: workload "vlm": images = "cat.png, /nowhere/dog.png, /nowhere/dog.png": /nowhere/dog.png does not exist here: its jobs will fail`,
		`experiment own: workload "vlm": model = "llava": ` + filepath.Join(root, "llava") + ` does not exist here: its jobs will fail (a relative path is from the kernels root, where workers run)`,
	}
	if !slices.Equal(got, want) {
		t.Errorf("warnings\n%q\nwant\n%q", got, want)
	}
	embedded := missingPathWarnings(plan, pyrt.KernelsRoot{Dir: root, Source: "embedded"})
	if len(embedded) != 2 || !strings.HasSuffix(embedded[1], "outside a checkout, workbench's own copy; write an absolute path)") {
		t.Errorf("outside a checkout: %q", embedded)
	}
}
