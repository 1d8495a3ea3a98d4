package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/vlkv/vlkv/gohost/compare"
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
	if code, _, stderr = runCLI(t, "compare", a, again, "--metrics", "rel_err_meen"); code != 2 ||
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

// writeRun writes a run directory holding recs, as a run's journal does.
func writeRun(t *testing.T, dir string, recs ...results.Record) string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	manifest, _ := json.Marshal(results.Manifest{Experiment: "sweep"})
	var journal []byte
	for _, rec := range recs {
		rec.Experiment = "sweep"
		if rec.Status == "" {
			rec.Status = results.StatusOK
		}
		line, _ := json.Marshal(rec)
		journal = append(append(journal, line...), '\n')
	}
	if err := os.WriteFile(filepath.Join(dir, results.ManifestFile), manifest, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, results.JournalFile), journal, 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestCompareFlags(t *testing.T) {
	dir := t.TempDir()
	job := func(budget float64, metrics map[string]any) results.Record {
		return results.Record{JobID: fmt.Sprint(budget), Method: "h2o", Params: map[string]any{"budget": budget},
			Workload: map[string]any{"seed": 0.0}, Metrics: metrics}
	}
	a := writeRun(t, filepath.Join(dir, "a"),
		job(0.25, map[string]any{"err": 1.0, "bytes": 10.0, "ratio": 2.0, "prefill_seconds": 1.0}),
		job(0.5, map[string]any{"err": 1.0, "bytes": 10.0, "ratio": 2.0, "prefill_seconds": 1.0}))
	b := writeRun(t, filepath.Join(dir, "b"),
		job(0.25, map[string]any{"err": 2.0, "bytes": 20.0, "ratio": 3.0, "prefill_seconds": 2.0}),
		job(0.5, map[string]any{"err": 1.0, "bytes": 10.0, "ratio": 2.0, "prefill_seconds": 1.0}))

	for _, tc := range []struct {
		name string
		args []string
		msg  string
	}{
		{"unknown metric", []string{"--metrics", "nosuch"}, `unknown metric "nosuch": the runs share`},
		{"unknown key", []string{"--by", "nosuch"}, "--by nosuch: not a parameter of both runs"},
		{"a table's column as a key", []string{"--by", "method,param_budget"}, "--by param_budget: not a parameter of both runs (keys go by the knobs' names: budget, not results.parquet's column param_budget)"},
		{"a table's workload column as a key", []string{"--by", "workload_seed"}, "--by workload_seed: not a parameter of both runs (keys go by the knobs' names: workload.seed, not results.parquet's column workload_seed)"},
		{"unknown guarded metric", []string{"--fail-if", "nosuch>1"}, `metric "nosuch" is not compared`},
		{"a table's column name", []string{"--metrics", "metric_err"}, `unknown metric "metric_err" (metrics go by their own names: err, not results.parquet's column metric_err)`},
		{"a table's column guarded", []string{"--fail-if", "metric_err>1"}, `(metrics go by their own names: err, not results.parquet's column metric_err)`},
		{"NaN threshold", []string{"--fail-if", "err>nan"}, "the threshold must be a finite number"},
		{"infinite threshold", []string{"--fail-if", "err<-Inf%"}, "the threshold must be a finite number"},
		{"negative max metrics", []string{"--max-metrics", "-1"}, "--max-metrics must be 0 (all) or more"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, _, stderr := runCLI(t, append([]string{"compare", a, b}, tc.args...)...)
			if code != 2 || !strings.Contains(stderr, tc.msg) {
				t.Errorf("exit %d, want 2 with %q; stderr:\n%s", code, tc.msg, stderr)
			}
		})
	}

	// Metrics past --max-metrics are counted, and the flag that shows them named.
	code, stdout, stderr := runCLI(t, "compare", a, b, "--max-metrics", "1")
	if code != 0 || !strings.Contains(stdout, "  ... 3 more (--max-metrics 0 shows all)\n") {
		t.Errorf("--max-metrics 1: exit %d\n%s%s", code, stdout, stderr)
	}

	// JSON rows carry their parameters as an object; every key is snake_case.
	code, stdout, stderr = runCLI(t, "compare", a, b, "--json")
	var report struct {
		Rows []struct {
			Key    string         `json:"key"`
			Params map[string]any `json:"params"`
			Deltas []map[string]any
		} `json:"rows"`
	}
	if err := json.Unmarshal([]byte(stdout), &report); code != 0 || err != nil || len(report.Rows) != 2 {
		t.Fatalf("--json: exit %d, %v\n%s%s", code, err, stdout, stderr)
	}
	if got := report.Rows[0].Params; len(got) != 2 || got["method"] != "h2o" || got["budget"] != 0.25 {
		t.Errorf("row %q params %v, want method h2o, budget 0.25", report.Rows[0].Key, got)
	}
	for _, key := range regexp.MustCompile(`"([A-Za-z_.]+)":`).FindAllStringSubmatch(stdout, -1) {
		if strings.ToLower(key[1]) != key[1] {
			t.Errorf("JSON key %q is not snake_case", key[1])
		}
	}
}

func compact(t *testing.T, s string) string {
	t.Helper()
	var b bytes.Buffer
	if err := json.Compact(&b, []byte(s)); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

// The notebooks join runs with kernels_py.runs.compare_runs: on the same
// pair of runs it must join the rows compare joins, with the same deltas,
// where the grids only partly overlap, where a knob changed, and --by.
func TestCompareJoinsAsThePythonSide(t *testing.T) {
	py := testpy.Python(t)
	dir := t.TempDir()
	var a, b []results.Record
	add := func(to *[]results.Record, method string, params map[string]any, err float64) {
		*to = append(*to, results.Record{JobID: fmt.Sprint(len(*to)), Method: method, Params: params,
			Workload:      map[string]any{"seed": 0.0, "layers": 2.0, "spans": []any{1.0, 2.5}, "causal": true},
			KernelsDigest: "k1", Metrics: map[string]any{"rel_err_mean": err, "compression_ratio": 4.0,
				"prefill_seconds": err / 10, "cache_bytes": 1e6}})
	}
	for i, budget := range []float64{0.1, 0.2, 0.3, 0.4, 0.5} { // A's grid
		add(&a, "h2o", map[string]any{"budget": budget, "recent_fraction": 0.5}, 0.1*float64(i))
		add(&a, "snapkv", map[string]any{"budget": budget, "window": 8.0}, 0.2*float64(i))
	}
	for i, budget := range []float64{0.3, 0.4, 0.5, 1e-5, 1234567} { // B's overlaps it in three budgets
		add(&b, "h2o", map[string]any{"budget": budget, "recent_fraction": 0.25}, 0.1*float64(i+2)+0.01)
		add(&b, "snapkv", map[string]any{"budget": budget, "window": 8.0}, 0.2*float64(i+2))
	}
	add(&a, "full", nil, 0)
	add(&b, "full", nil, 0)
	add(&a, "kivi", map[string]any{"bits": 2.0}, 0.3) // a method only A ran, told apart by its knob
	add(&a, "kivi", map[string]any{"bits": 4.0}, 0.1)
	b[0].Params["sink"] = 4.0 // a knob B's version gave h2o
	b[2].Params["sink"] = 4.0
	b[len(b)-1].Params = map[string]any{"budget": 1.0} // and full: the others' sweeps over budget still join
	b[len(b)-1].Status, b[len(b)-1].KernelsDigest, b[len(b)-1].Error = results.StatusFailed, "k2", "RuntimeError: boom\nTraceback ..."
	b[1].Metrics["rel_err_mean"] = nil // snapkv at 0.3 lost it (a NaN, written as null)
	runA, runB := writeRun(t, filepath.Join(dir, "a"), a...), writeRun(t, filepath.Join(dir, "b"), b...)
	empty := writeRun(t, filepath.Join(dir, "empty")) // stopped before its first job
	// B as its table alone, and with the empty journal status leaves in such a run: both read the table.
	if _, err := results.BuildParquet(runB); err != nil {
		t.Fatal(err)
	}
	tableB, tableEmptyJournal := filepath.Join(dir, "b-table"), filepath.Join(dir, "b-table-empty-journal")
	for _, d := range []string{tableB, tableEmptyJournal} {
		data, err := os.ReadFile(filepath.Join(runB, results.ParquetFile))
		if err == nil {
			os.MkdirAll(d, 0o755)
			err = os.WriteFile(filepath.Join(d, results.ParquetFile), data, 0o644)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(tableEmptyJournal, results.JournalFile), nil, 0o644); err != nil {
		t.Fatal(err)
	}

	type delta struct {
		Metric            string
		A                 float64
		B, Abs, Rel       any
		Changed, IsTiming bool
	}
	type report struct {
		Keys, Varied, OnlyA, OnlyB []string
		OnlyAStatus, OnlyBStatus   []string
		OnlyAParams, OnlyBParams   []map[string]any
		Changed                    int
		Rows                       []struct {
			Key                    string
			Params                 map[string]any
			StatusA, StatusB       string
			ErrorA, ErrorB         string
			Changed, KernelsDiffer bool
			Deltas                 []delta
		}
	}
	// Field names differ from the JSON's only by underscores.
	decode := func(data []byte) report {
		var raw any
		if err := json.Unmarshal(data, &raw); err != nil {
			t.Fatalf("%v\n%s", err, data)
		}
		var strip func(any) any
		strip = func(v any) any {
			switch x := v.(type) {
			case map[string]any:
				out := map[string]any{}
				for k, v := range x {
					if k != "params" {
						k = strings.ReplaceAll(k, "_", "")
					}
					out[k] = strip(v)
				}
				if p, ok := x["params"]; ok {
					out["params"] = p
				}
				return out
			case []any:
				for i := range x {
					x[i] = strip(x[i])
				}
			}
			return v
		}
		data, _ = json.Marshal(strip(raw))
		var r report
		if err := json.Unmarshal(data, &r); err != nil {
			t.Fatal(err)
		}
		return r
	}
	for _, tc := range []struct {
		by   []string
		runB string
	}{{nil, runB}, {[]string{"method", "budget"}, runB}, {[]string{"workload.spans", "method"}, runB}, {nil, empty},
		{nil, tableB}, {[]string{"workload.spans", "method"}, tableEmptyJournal}} {
		by, runB := tc.by, tc.runB
		t.Run(fmt.Sprint(by, filepath.Base(runB)), func(t *testing.T) {
			args := []string{"compare", runA, runB, "--json"}
			if by != nil {
				args = append(args, "--by", strings.Join(by, ","))
			}
			code, stdout, stderr := runCLI(t, args...)
			if code != 0 {
				t.Fatalf("compare: exit %d\n%s", code, stderr)
			}
			byJSON, _ := json.Marshal(by)
			cmd := exec.Command(py, "-c", `import json, sys
from kernels_py.runs import compare_runs
print(json.dumps(compare_runs(sys.argv[1], sys.argv[2], by=json.loads(sys.argv[3]))))`, runA, runB, string(byJSON))
			cmd.Dir = ".."
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("compare_runs: %v\n%s", err, out)
			}
			goSide, pySide := decode([]byte(stdout)), decode(out)
			switch {
			case runB == empty && (len(goSide.Rows) != 0 || len(goSide.OnlyA) != len(a)):
				t.Fatalf("against a run without rows, each of A's should be its own missing row:\n%s", stdout)
			case runB != empty && (len(goSide.Rows) == 0 || (by == nil && (len(goSide.OnlyA) == 0 || len(goSide.Varied) == 0))):
				t.Fatalf("the runs should join some rows, leave some out and vary a knob:\n%s", stdout)
			case runB != empty && by == nil && !strings.Contains(compact(t, stdout), `"metric":"rel_err_mean","a":0.4,"changed":true,"is_timing":false,"b":null,"abs":null,"rel":null`):
				t.Fatalf("snapkv's lost rel_err_mean should be a change to null:\n%s", stdout)
			}
			if g, p := fmt.Sprintf("%+v", goSide), fmt.Sprintf("%+v", pySide); g != p {
				t.Errorf("compare and compare_runs differ:\ngo %s\npy %s", g, p)
			}
		})
	}
}

// A row whose job failed says why, and a status change alone prints no
// empty table of metrics.
func TestComparisonShowsWhyAJobFailed(t *testing.T) {
	r := &compare.Report{RunA: "a", RunB: "b", Keys: []string{"method"}, Changed: 1, Rows: []compare.Row{{
		Key: "method=h2o", Changed: true, StatusA: results.StatusOK, StatusB: results.StatusFailed,
		ErrorB: "RuntimeError: boom\nTraceback (most recent call last): ...", Deltas: []compare.Delta{}}}}
	var out bytes.Buffer
	printComparison(&out, r, false, 8)
	text := out.String()
	if !strings.Contains(text, "method=h2o [status ok -> failed]\n  B failed: RuntimeError: boom\n") ||
		strings.Contains(text, "Traceback") || strings.Contains(text, "metric") {
		t.Errorf("got:\n%s", text)
	}
}

// A run copied as its table alone (no manifest, no journal) is compared as
// the run it was; an experiment's folder lists its runs to pick from.
func TestCompareReadsARunThatIsOnlyItsTable(t *testing.T) {
	dir := t.TempDir()
	rec := results.Record{JobID: "a", Method: "h2o", Params: map[string]any{"budget": 0.5}, Metrics: map[string]any{"err": 1.0}}
	run := writeRun(t, filepath.Join(dir, "exp", "run"), rec)
	if _, err := results.BuildParquet(run); err != nil {
		t.Fatal(err)
	}
	table := filepath.Join(dir, "table")
	data, _ := os.ReadFile(filepath.Join(run, results.ParquetFile))
	os.MkdirAll(table, 0o755)
	if err := os.WriteFile(filepath.Join(table, results.ParquetFile), data, 0o644); err != nil {
		t.Fatal(err)
	}
	if code, stdout, stderr := runCLI(t, "compare", run, table); code != 0 || !strings.Contains(stdout, "1 rows joined, 0 changed") {
		t.Errorf("compare with a table-only run: exit %d\n%s%s", code, stdout, stderr)
	}
	// status opens such a run, which leaves it an empty journal: the table still counts.
	if err := os.WriteFile(filepath.Join(table, results.JournalFile), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if code, stdout, stderr := runCLI(t, "compare", run, table); code != 0 || !strings.Contains(stdout, "1 rows joined, 0 changed") {
		t.Errorf("compare with a table-only run and an empty journal: exit %d\n%s%s", code, stdout, stderr)
	}
	if code, _, stderr := runCLI(t, "compare", filepath.Join(dir, "exp"), run); code != 1 ||
		!strings.Contains(stderr, "an experiment's folder: give one of its runs") {
		t.Errorf("compare of an experiment's folder: exit %d\n%s", code, stderr)
	}
}

// A metric B lost (NaN) is the largest change of its row: shown first, never
// left among the ones --max-metrics cuts, and the others still ordered by
// their change.
func TestComparisonShowsALostMetricFirst(t *testing.T) {
	nan := math.NaN()
	r := &compare.Report{RunA: "a", RunB: "b", Keys: []string{"method"}, Changed: 1, Rows: []compare.Row{{
		Key: "method=h2o", Changed: true, StatusA: results.StatusOK, StatusB: results.StatusOK, Deltas: []compare.Delta{
			{Metric: "a_small", A: 1, B: 1.01, Abs: 0.01, Rel: 0.01, Changed: true},
			{Metric: "b_lost", A: 1, B: nan, Abs: nan, Rel: nan, Changed: true},
			{Metric: "c_large", A: 1, B: 2, Abs: 1, Rel: 1, Changed: true},
		}}}}
	var out bytes.Buffer
	printComparison(&out, r, false, 2)
	text := out.String()
	lost, large := strings.Index(text, "b_lost"), strings.Index(text, "c_large")
	if lost < 0 || large < lost || strings.Contains(text, "a_small") || !strings.Contains(text, "... 1 more") {
		t.Errorf("want the lost metric, then the largest change, the smallest cut:\n%s", text)
	}
}
