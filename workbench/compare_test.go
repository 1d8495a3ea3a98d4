package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/testpy"
)

// compare on real runs: a rerun changes nothing (exit 0); a changed knob
// shows exactly the rows it changed; runs of another experiment are joined
// with a warning; a missing run and an unknown metric are errors; --fail-if
// turns a change into exit 1.
func TestCompareRuns(t *testing.T) {
	py := testpy.Python(t)
	dir := t.TempDir()
	sweep := func(name, extraGrid string) string {
		path := filepath.Join(dir, name+".star")
		if extraGrid != "" {
			path = filepath.Join(dir, name+"_changed.star")
		}
		os.WriteFile(path, []byte(`experiment(name = "`+name+`", methods = ["full", "h2o", "streamingllm"],
    grid = {"budget": [0.25, 0.5]`+extraGrid+`},
    workloads = [workload(tokens_per_image = 48, system_tokens = 8, text_tokens = 8, decode_steps = 2, layers = 2)])
`), 0o644)
		return path
	}
	runTo := func(script, out string) string {
		t.Helper()
		code, stdout, stderr := runCLI(t, "--python", py, "--kernels", "..", "run", script, "--out", out)
		if code != 0 {
			t.Fatalf("run %s: exit %d\n%s\n%s", script, code, stdout, stderr)
		}
		runs, _ := filepath.Glob(filepath.Join(out, "*", "*"))
		return runs[0]
	}
	a := runTo(sweep("sweep", ""), filepath.Join(dir, "a"))
	again := runTo(sweep("sweep", ""), filepath.Join(dir, "again"))
	changed := runTo(sweep("sweep", `, "recent_fraction": [0.25]`), filepath.Join(dir, "changed"))
	other := runTo(sweep("other", ""), filepath.Join(dir, "other"))

	code, stdout, stderr := runCLI(t, "compare", a, again)
	if code != 0 || !strings.Contains(stdout, "5 rows joined, 0 changed; 0 only in A, 0 only in B") {
		t.Errorf("identical runs: exit %d\n%s%s", code, stdout, stderr)
	}
	code, stdout, _ = runCLI(t, "compare", a, changed)
	if code != 0 || !strings.Contains(stdout, "varied: recent_fraction: 0.5 -> 0.25 (h2o)") ||
		!strings.Contains(stdout, "5 rows joined, 2 changed") ||
		strings.Count(stdout, "\nbudget=") != 2 || strings.Count(stdout, "method=h2o\n") != 2 {
		t.Errorf("one knob changed: exit %d\n%s", code, stdout)
	}
	code, stdout, _ = runCLI(t, "compare", a, changed, "--fail-if", "rel_err_mean>0", "--fail-if", "rel_err_mean<0")
	if code != 1 || !strings.Contains(stdout, "FAIL rel_err_mean<0: budget=") {
		t.Errorf("--fail-if: exit %d\n%s", code, stdout)
	}
	code, stdout, stderr = runCLI(t, "compare", a, other)
	if code != 0 || !strings.Contains(stderr, "different experiments (sweep, other)") || !strings.Contains(stdout, "5 rows joined, 0 changed") {
		t.Errorf("other experiment: exit %d\n%s%s", code, stdout, stderr)
	}
	if code, _, stderr = runCLI(t, "compare", a, filepath.Join(dir, "nowhere")); code != 1 || !strings.Contains(stderr, "does not exist") {
		t.Errorf("missing run: exit %d %s", code, stderr)
	}
	if code, _, stderr = runCLI(t, "compare", a, again, "--metrics", "rel_err_meen"); code != 1 ||
		!strings.Contains(stderr, `unknown metric "rel_err_meen": the runs share`) {
		t.Errorf("unknown metric: exit %d %s", code, stderr)
	}
	if code, _, stderr = runCLI(t, "compare", a, again, "--fail-if", "rel_err_mean"); code != 2 {
		t.Errorf("bad --fail-if: exit %d %s", code, stderr)
	}
	if _, err := os.Stat(filepath.Join(a, results.ParquetFile)); err != nil {
		t.Error(err)
	}
}
