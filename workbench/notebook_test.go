package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/testpy"
)

func TestNotebookArguments(t *testing.T) {
	dir := t.TempDir()
	run := writeRun(t, filepath.Join(dir, "run"), results.Record{JobID: "a", Method: "full"})
	if _, err := results.BuildParquet(run); err != nil {
		t.Fatal(err)
	}
	// Killed runs: one before its table was first written, one after it
	// (the journal has a row more than the table).
	unfinished := writeRun(t, filepath.Join(dir, "unfinished"), results.Record{JobID: "a", Method: "full"})
	stale := writeRun(t, filepath.Join(dir, "exp", "stale"), results.Record{JobID: "a", Method: "full"})
	if _, err := results.BuildParquet(stale); err != nil {
		t.Fatal(err)
	}
	writeRun(t, stale, results.Record{JobID: "a", Method: "full"}, results.Record{JobID: "b", Method: "full"})
	written := writeRun(t, filepath.Join(dir, "written"), results.Record{JobID: "a", Method: "full"})
	hold, err := results.Open(written)
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Close()
	noPython := []string{"--python", "/nonexistent"} // fails once the runs are checked, before any Python
	for _, tc := range []struct {
		name      string
		global    []string
		args      []string
		code      int
		msg       string
		table     string // a run whose results.parquet must then have rows rows
		tableRows int
	}{
		{"no notebook", nil, nil, 2, "give a notebook (accuracy, attentionpack, compare,", "", 0},
		{"unknown notebook", nil, []string{"nosuch", run}, 2, `no notebook "nosuch": notebooks/ has accuracy, attentionpack, compare,`, "", 0},
		{"no run", nil, []string{"quickstart"}, 2, "notebook quickstart reads 1 run directory, got 0", "", 0},
		{"one run for compare", nil, []string{"compare", run}, 2, "notebook compare reads 2 run directories, got 1", "", 0},
		{"missing run", nil, []string{"quickstart", filepath.Join(dir, "nowhere")}, 1, "nowhere does not exist", "", 0},
		{"run of another experiment", nil, []string{"methods", run}, 2, "notebook methods reads a run of experiment methods_compare; " + run + " is a run of sweep", "", 0},
		{"experiment folder", nil, []string{"quickstart", filepath.Join(dir, "exp")}, 1, "an experiment's folder: give one of its runs", "", 0},
		{"killed run without a table", noPython, []string{"quickstart", unfinished}, 1, "/nonexistent (from --python) does not exist", unfinished, 1},
		{"killed run with a stale table", noPython, []string{"quickstart", stale}, 1, "/nonexistent (from --python) does not exist", stale, 2},
		{"run being written, no table", nil, []string{"quickstart", written}, 1, "is being written by workbench process", "", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, _, stderr := runCLI(t, append(append(tc.global, "notebook"), tc.args...)...)
			if code != tc.code || !strings.Contains(stderr, tc.msg) {
				t.Errorf("exit %d, want %d with %q; stderr:\n%s", code, tc.code, tc.msg, stderr)
			}
			if tc.table != "" {
				if rows := parquetRows(t, filepath.Join(tc.table, results.ParquetFile)); len(rows) != tc.tableRows {
					t.Errorf("results.parquet has %d rows, want %d", len(rows), tc.tableRows)
				}
			}
		})
	}
}

// workbench notebook executes a notebook on runs and writes it, and its
// HTML copy with the plots, beside the last run.
func TestNotebookWritesBesideTheRun(t *testing.T) {
	py := testpy.Python(t)
	dir := t.TempDir()
	var a, b []results.Record
	for i, budget := range []float64{0.25, 0.5} {
		for _, to := range []*[]results.Record{&a, &b} {
			err := 0.1 * float64(i+1)
			if to == &b {
				err *= 2
			}
			*to = append(*to, results.Record{JobID: string(rune('a' + i)), Method: "h2o",
				Params:  map[string]any{"budget": budget},
				Metrics: map[string]any{"rel_err_mean": err, "compression_ratio": 1 / budget}})
		}
	}
	runA, runB := writeRun(t, filepath.Join(dir, "a"), a...), writeRun(t, filepath.Join(dir, "b"), b...)
	for _, run := range []string{runA, runB} {
		if _, err := results.BuildParquet(run); err != nil {
			t.Fatal(err)
		}
	}
	code, stdout, stderr := runCLI(t, "--python", py, "--device", "cpu", "notebook", "compare", runA, runB)
	if code != 0 {
		t.Fatalf("exit %d\n%s%s", code, stdout, stderr)
	}
	if _, err := os.Stat(filepath.Join(runB, "compare.ipynb")); err != nil {
		t.Error(err)
	}
	page, err := os.ReadFile(filepath.Join(runB, "compare.html"))
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(page), `<img src="data:image/png;base64,`); n != 2 ||
		!strings.Contains(string(page), "2 rows joined, 2 changed") {
		t.Errorf("compare.html has %d plots, want 2, and the join's summary:\n%.2000s", n, page)
	}
}

// lab on an interpreter of the user's own that lacks JupyterLab says how to
// get it, rather than installing into it.
func TestLabWithoutJupyterLab(t *testing.T) {
	py := testpy.Python(t)
	if exec.Command(py, "-c", "import jupyterlab").Run() == nil {
		t.Skip("this interpreter has jupyterlab")
	}
	code, _, stderr := runCLI(t, "--python", py, "--device", "cpu", "lab")
	if code != 1 || !strings.Contains(stderr, "jupyterlab is not installed in "+py+" (from --python)") {
		t.Errorf("exit %d, want 1 with how to install it; stderr:\n%s", code, stderr)
	}
}

// A notebook is named bare, with .ipynb, or by its path in notebooks/ as a
// shell completes it; a notebook elsewhere is refused, naming the folder.
func TestNotebookName(t *testing.T) {
	root := t.TempDir()
	abs := filepath.Join(root, "notebooks", "vlcache.ipynb")
	t.Chdir(root)
	tests := []struct{ arg, want, wantErr string }{
		{"vlcache", "vlcache", ""},
		{"vlcache.ipynb", "vlcache", ""},
		{"notebooks/vlcache.ipynb", "vlcache", ""},
		{"./notebooks/vlcache", "vlcache", ""},
		{abs, "vlcache", ""},
		{"/tmp/mine.ipynb", "", "/tmp/mine.ipynb: a notebook is named from " + filepath.Join(root, "notebooks")},
	}
	for _, tc := range tests {
		got, err := notebookName(root, tc.arg)
		if tc.wantErr != "" {
			if err == nil || err.Error() != tc.wantErr {
				t.Errorf("%s: err %v, want %q", tc.arg, err, tc.wantErr)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%s: %q, %v; want %q", tc.arg, got, err, tc.want)
		}
	}
}
