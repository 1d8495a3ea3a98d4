package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/testpy"
)

func TestPlanIsStable(t *testing.T) {
	ids := func() string {
		code, stdout, stderr := runCLI(t, "plan", "--json", "../experiments/quickstart.star")
		if code != 0 {
			t.Fatalf("plan: exit %d: %s", code, stderr)
		}
		var p struct{ Jobs []struct{ ID, Method string } }
		if err := json.Unmarshal([]byte(stdout), &p); err != nil || len(p.Jobs) != 10 {
			t.Fatalf("plan --json: %v, %d jobs\n%s", err, len(p.Jobs), stdout)
		}
		var out []string
		for _, j := range p.Jobs {
			out = append(out, j.ID)
		}
		return strings.Join(out, ",")
	}
	if a, b := ids(), ids(); a != b {
		t.Fatalf("ids changed between two plans:\n%s\n%s", a, b)
	}
}

// Bad scripts fail before any job starts, naming the place.
func TestBadScriptsFailBeforeRunning(t *testing.T) {
	dir := t.TempDir()
	scripts := []struct {
		name, src, want string
	}{
		{"syntax", "experiment(name = \"x\", methods = [\"full\"]\n", "syntax.star:2:1"},
		{"method", "experiment(\n    name = \"x\",\n    methods = [\"full\", \"h2oo\"],\n)\n", `method.star:3:24: experiment "x": method "h2oo" is unknown`},
		{"type", "experiment(name = \"x\", methods = [\"h2o\"], grid = {\"budget\": [\"a lot\"]})\n", "type.star:1:"},
		{"workload", "experiment(name = \"x\", methods = [\"full\"], workloads = [workload(layers = 2.5)])\n", `param "layers": want int`},
		// What the script printed before it failed is shown with the error.
		{"printed", "B = [0.5, 2.0]\nprint(\"budgets\", B)\nexperiment(name = \"x\", methods = [\"h2o\"], grid = {\"budget\": B})\n", "printed.star:2:1: budgets [0.5, 2.0]"},
	}
	for _, s := range scripts {
		t.Run(s.name, func(t *testing.T) {
			path := filepath.Join(dir, s.name+".star")
			os.WriteFile(path, []byte(s.src), 0o644)
			for _, cmd := range [][]string{{"plan", path}, {"--python", "/nonexistent", "run", "--out", filepath.Join(dir, "out"), path}} {
				code, _, stderr := runCLI(t, cmd...)
				if code != 1 || !strings.Contains(stderr, s.want) {
					t.Errorf("%v: exit %d, stderr %q; want %q", cmd, code, stderr, s.want)
				}
			}
			if _, err := os.Stat(filepath.Join(dir, "out")); err == nil {
				t.Error("a bad script created a run directory")
			}
		})
	}
}

// Killing the host mid-run loses only jobs in flight; --resume finishes the
// run without redoing journaled jobs.
func TestKilledRunResumes(t *testing.T) {
	py := testpy.Python(t)
	dir := t.TempDir()
	bin := workbenchBinary(t)
	// A kernels root whose jobs take a while, so the kill lands mid-run.
	root := filepath.Join(dir, "root")
	os.MkdirAll(root, 0o755)
	if out, err := exec.Command("cp", "-r", "../kernels_py", root).CombinedOutput(); err != nil {
		t.Fatalf("copy: %v %s", err, out)
	}
	ablation := filepath.Join(root, "kernels_py", "ablation.py")
	f, _ := os.OpenFile(ablation, os.O_APPEND|os.O_WRONLY, 0)
	f.WriteString("\n_unslowed_run = run\n\ndef run(**kw):\n    import time\n    time.sleep(0.7)\n    return _unslowed_run(**kw)\n")
	f.Close()
	script := filepath.Join(dir, "slow.star")
	os.WriteFile(script, []byte(`experiment(
    name = "slow",
    methods = ["h2o", "streamingllm"],
    grid = {"budget": [0.1, 0.2, 0.3, 0.4, 0.5]},
    workloads = [workload(layers = 2, tokens_per_image = 64, text_tokens = 16, decode_steps = 4)],
)
`), 0o644)
	out := filepath.Join(dir, "results")
	args := []string{"--python", py, "--kernels", root, "--device", "cpu", "run", "--out", out, script}

	// waitFor starts the command and returns once the journal has n lines.
	journal := ""
	waitFor := func(cmd *exec.Cmd, n int) {
		t.Helper()
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(2 * time.Minute)
		for {
			if journal == "" {
				if d, _ := results.Latest(out, "slow"); d != "" {
					journal = filepath.Join(d, results.JournalFile)
				}
			}
			if data, _ := os.ReadFile(journal); strings.Count(string(data), "\n") >= n {
				return
			}
			if time.Now().After(deadline) {
				cmd.Process.Kill()
				t.Fatalf("the run never journaled %d jobs", n)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}

	// Ctrl-C: in-flight jobs are dropped, finished ones kept, and the user is told how to go on.
	first := exec.Command(bin, args...)
	var stderr strings.Builder
	first.Stderr = &stderr
	waitFor(first, 2)
	first.Process.Signal(os.Interrupt)
	err := first.Wait()
	if code := first.ProcessState.ExitCode(); code != 130 || !strings.Contains(stderr.String(), "interrupted") || !strings.Contains(stderr.String(), "--resume") {
		t.Fatalf("after Ctrl-C: %v, exit %d\n%s", err, code, stderr.String())
	}

	// A kill at any moment: resume, then kill the resumed run midway.
	resumeArgs := append(append([]string(nil), args[:len(args)-1]...), "--resume", script)
	second := exec.Command(bin, resumeArgs...)
	waitFor(second, 4)
	// While it runs, a second writer on the same run is refused, by PID.
	third := exec.Command(bin, resumeArgs...)
	output, _ := third.CombinedOutput()
	if code := third.ProcessState.ExitCode(); code != 1 || !strings.Contains(string(output), fmt.Sprintf("is being written by workbench process %d", second.Process.Pid)) {
		t.Fatalf("second writer: exit %d\n%s", code, output)
	}
	second.Process.Signal(syscall.SIGKILL)
	second.Wait()
	runDir := filepath.Dir(journal)
	before, err := results.ReadJournal(runDir)
	if err != nil {
		t.Fatal(err)
	}
	if len(before) < 4 || len(before) >= 10 {
		t.Fatalf("%d jobs journaled at the kill; want a run stopped midway", len(before))
	}

	resume := exec.Command(bin, resumeArgs...)
	if output, err := resume.CombinedOutput(); err != nil {
		t.Fatalf("resume: %v\n%s", err, output)
	}
	after, err := results.ReadJournal(runDir)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]int{}
	for _, r := range after {
		seen[r.JobID]++
		if r.Status != results.StatusOK {
			t.Errorf("job %s: %s %s", r.JobID, r.Status, r.Error)
		}
	}
	if len(seen) != 10 || len(after) != 10 {
		t.Fatalf("after resume: %d records for %d distinct jobs; want 10 and 10 (none redone)", len(after), len(seen))
	}
	for i, r := range before {
		if after[i].JobID != r.JobID || !after[i].Finished.Equal(r.Finished) {
			t.Errorf("journal line %d changed across the resume", i+1)
		}
	}
	if _, err := os.Stat(filepath.Join(runDir, results.ParquetFile)); err != nil {
		t.Error(err)
	}
	// Each job returned its per-step errors by reference; the host saved them.
	if npys, _ := filepath.Glob(filepath.Join(runDir, results.TensorsDir, "*", "rel_err.npy")); len(npys) != 10 {
		t.Errorf("%d rel_err.npy files, want one per job", len(npys))
	}
	for _, r := range after {
		if r.Extra["tensor_rel_err"] != filepath.Join(results.TensorsDir, r.JobID, "rel_err.npy") {
			t.Errorf("job %s: tensor path %v", r.JobID, r.Extra["tensor_rel_err"])
		}
	}
	m, _ := os.ReadFile(filepath.Join(runDir, results.ManifestFile))
	if !strings.Contains(string(m), `"resumed"`) || !strings.Contains(string(m), `"ended"`) {
		t.Errorf("manifest after resume:\n%s", m)
	}
}

// A run that cannot start a single worker leaves no run directory behind
// (notebooks and --resume would take it for the newest run) and says why.
func TestRunThatCannotStartLeavesNothing(t *testing.T) {
	out := filepath.Join(t.TempDir(), "results")
	code, _, stderr := runCLI(t, "--python", "/bin/true", "--device", "cpu", "run", "--out", out, "../experiments/quickstart.star")
	if code != 1 || !strings.Contains(stderr, "no worker could start (3 tries in a row): worker did not start: worker died") ||
		!strings.Contains(stderr, "No run directory was created") {
		t.Fatalf("exit %d\n%s", code, stderr)
	}
	if entries, _ := os.ReadDir(out); len(entries) != 0 { // the results root itself is checked (made) first
		t.Errorf("%s holds %d entries after a run that never started", out, len(entries))
	}
}

// plan says which workload the jobs run on: per job when they differ, once
// in the header when they share one that is not the default.
func TestPlanShowsWorkloads(t *testing.T) {
	script := filepath.Join(t.TempDir(), "w.star")
	os.WriteFile(script, []byte(`experiment(name = "x", methods = ["h2o"], workloads = [workload(seed = 1), workload(seed = 2)])
experiment(name = "y", methods = ["h2o"], workloads = [workload(seed = 3)])
`), 0o644)
	code, stdout, stderr := runCLI(t, "plan", script)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	for _, want := range []string{"@synthetic(seed=1)\n", "@synthetic(seed=2)\n", "experiment y: 1 job (timeout 10m0s each) on @synthetic(seed=3)\n"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("plan output lacks %q:\n%s", want, stdout)
		}
	}
	// Where the header names the workload, the jobs' lines end at their knobs.
	for _, line := range strings.Split(stdout, "\n") {
		if strings.HasSuffix(line, " ") {
			t.Errorf("line ends in spaces: %q", line)
		}
	}
}

// An unknown name that the kernels_py sources hold but schema.json lacks
// (a method added in Python, the schema not regenerated): plan says how to
// fix it. The hint goes by content: after a checkout, file times say
// nothing, and a misspelt name gets no hint.
func TestUnknownNameHintsAtStaleSchema(t *testing.T) {
	tests := []struct {
		name   string
		method string
		added  string // a Python source that names the method
		age    time.Duration
		hint   bool
	}{
		{"schema older than the sources", "mine", "", -time.Hour, false},
		{"schema newer than the sources", "mine", "", time.Hour, false},
		{"method added in Python", "mine", `NAME = "mine"` + "\n", time.Hour, true},
		{"method added in Python, older schema", "mine", "NAME = 'mine'\n", -time.Hour, true},
		{"misspelt method", "h2oo", "", -time.Hour, false},
		{"knob added in Python", "full", "class Mine:\n    newknob: int = 2\n", time.Hour, true},
		{"misspelt knob", "full", "", time.Hour, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			if out, err := exec.Command("cp", "-r", "../kernels_py", root).CombinedOutput(); err != nil {
				t.Fatalf("copy kernels_py: %v: %s", err, out)
			}
			if tc.added != "" {
				os.WriteFile(filepath.Join(root, "kernels_py", "methods", "mine.py"), []byte(tc.added), 0o644)
			}
			script := filepath.Join(root, "x.star")
			unknown := `method "` + tc.method + `" is unknown`
			if tc.method == "full" { // a knob of the full cache, "newknob"
				os.WriteFile(script, []byte(`experiment(name = "x", methods = ["full"], extra = [{"method": "full", "newknob": 2}])`+"\n"), 0o644)
				unknown = `param "newknob" is unknown for method "full"`
			} else {
				os.WriteFile(script, []byte(`experiment(name = "x", methods = ["`+tc.method+`"])`+"\n"), 0o644)
			}
			when := time.Now().Add(tc.age)
			if err := os.Chtimes(filepath.Join(root, "kernels_py", "schema.json"), when, when); err != nil {
				t.Fatal(err)
			}
			code, _, stderr := runCLI(t, "--kernels", root, "plan", script)
			if code != 1 || !strings.Contains(stderr, unknown) || strings.Contains(stderr, "run `workbench schema`") != tc.hint {
				t.Errorf("exit %d, hint wanted %v:\n%s", code, tc.hint, stderr)
			}
		})
	}
}

// The same script run twice computes the same numbers, bit for bit: every
// metric, per-layer list and tensor; and each run's manifest names the
// protocol its jobs were set up by and the dtype every ratio is counted
// against.
func TestRunIsReproducible(t *testing.T) {
	py := testpy.Python(t)
	dir := t.TempDir()
	bin := workbenchBinary(t)
	script := filepath.Join(dir, "twice.star")
	os.WriteFile(script, []byte(`experiment(
    name = "twice",
    protocol = "vlcache",
    methods = ["h2o", "snapkv", "vlcache"],
    grid = {"budget": [0.2]},
    workloads = [workload(layers = 2, heads = 4, tokens_per_image = 64, text_tokens = 16, decode_steps = 4)],
    extra = [
        {"method": "zipvl", "probe_random": 8},
        {"method": "kivi", "bits": 2},
        {"method": "attentionpack", "rank_k": 16, "rank_v": 16},
    ],
)
`), 0o644)
	type run struct {
		rows     map[string]results.Record
		tensors  map[string][]byte
		manifest results.Manifest
	}
	runOnce := func(out string) run {
		t.Helper()
		cmd := exec.Command(bin, "--python", py, "--kernels", "..", "--device", "cpu", "run", "--out", out, script)
		if output, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("run: %v\n%s", err, output)
		}
		d, err := results.Latest(out, "twice")
		if err != nil || d == "" {
			t.Fatalf("no run directory under %s: %v", out, err)
		}
		recs, err := results.ReadJournal(d)
		if err != nil {
			t.Fatal(err)
		}
		r := run{rows: map[string]results.Record{}, tensors: map[string][]byte{}}
		for _, rec := range recs {
			if rec.Status != results.StatusOK {
				t.Fatalf("job %s (%s): %s", rec.JobID, rec.Method, rec.Error)
			}
			r.rows[rec.JobID] = rec
		}
		npys, _ := filepath.Glob(filepath.Join(d, results.TensorsDir, "*", "*.npy"))
		for _, f := range npys {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			rel, _ := filepath.Rel(d, f)
			r.tensors[rel] = data
		}
		m, err := os.ReadFile(filepath.Join(d, results.ManifestFile))
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(m, &r.manifest); err != nil {
			t.Fatal(err)
		}
		return r
	}
	a, b := runOnce(filepath.Join(dir, "a")), runOnce(filepath.Join(dir, "b"))
	if len(a.rows) != 6 || len(b.rows) != 6 {
		t.Fatalf("%d and %d jobs ran; want 6 each", len(a.rows), len(b.rows))
	}
	for id, ra := range a.rows {
		rb, ok := b.rows[id]
		if !ok {
			t.Errorf("job %s (%s) is missing from the second run", id, ra.Method)
			continue
		}
		if len(ra.Metrics) == 0 {
			t.Errorf("job %s (%s) reported no metrics", id, ra.Method)
		}
		if !reflect.DeepEqual(ra.Metrics, rb.Metrics) {
			t.Errorf("job %s (%s): metrics differ between runs:\n%v\n%v", id, ra.Method, ra.Metrics, rb.Metrics)
		}
		if !reflect.DeepEqual(ra.Extra, rb.Extra) {
			t.Errorf("job %s (%s): per-layer results differ between runs", id, ra.Method)
		}
	}
	if len(a.tensors) != 6 {
		t.Errorf("%d tensors saved; want a rel_err per job", len(a.tensors))
	}
	for name, data := range a.tensors {
		if !bytes.Equal(data, b.tensors[name]) {
			t.Errorf("tensor %s differs between runs", name)
		}
	}
	for _, m := range []results.Manifest{a.manifest, b.manifest} {
		if m.Protocol != "vlcache" || !slices.Equal(m.Dtypes, []string{"float16"}) {
			t.Errorf("manifest names protocol %q and dtypes %v; want vlcache and [float16]", m.Protocol, m.Dtypes)
		}
	}
}

// The commands that take an op, a benchmark or a method by name say what
// to do about one the sources define but schema.json or OPS lacks: an op
// folder without its OPS line, an op, benchmark or method added without
// `workbench schema`. A misspelt name gets neither hint.
func TestUnknownOpBenchmarkOrMethodHints(t *testing.T) {
	root := t.TempDir()
	if out, err := exec.Command("cp", "-r", "../kernels_py", root).CombinedOutput(); err != nil {
		t.Fatalf("copy kernels_py: %v: %s", err, out)
	}
	ops := filepath.Join(root, "kernels_py", "ops")
	os.MkdirAll(filepath.Join(ops, "toy_op"), 0o755)
	os.WriteFile(filepath.Join(ops, "toy_op", "__init__.py"), []byte(`"""A toy op."""`+"\n"), 0o644)
	os.WriteFile(filepath.Join(root, "kernels_py", "benchmarks", "toy.py"), []byte(`name = "toy_bench"`+"\n"), 0o644)
	os.WriteFile(filepath.Join(root, "kernels_py", "methods", "toy.py"), []byte(`name = "toy_method"`+"\n"), 0o644)
	noOPSLine := `kernels_py/ops/toy_op/ has no line in OPS (kernels_py/ops/__init__.py): add Op("toy_op", benchmark="<its benchmark>"), then run ` + "`workbench schema`"
	stale := func(name string) string {
		return `kernels_py names "` + name + `" but kernels_py/schema.json does not`
	}
	tests := []struct {
		name string
		args []string
		want string // "" for no hint
	}{
		{"selftest, op folder without OPS line", []string{"selftest", "--op", "toy_op"}, noOPSLine},
		{"watch, op folder without OPS line", []string{"watch", "toy_op"}, noOPSLine},
		{"selftest, misspelt op", []string{"selftest", "--op", "gather_decod"}, ""},
		{"bench, benchmark added without schema", []string{"bench", "toy_bench"}, stale("toy_bench")},
		{"bench, misspelt benchmark", []string{"bench", "gatherr"}, ""},
		{"bench, benchmark added without schema, with its flags", []string{"bench", "toy_bench", "--sizes", "8"}, stale("toy_bench")},
		{"bench, misspelt benchmark with a flag", []string{"bench", "gatherr", "--batches=8"}, ""},
		{"methods, method added without schema", []string{"methods", "toy_method"}, stale("toy_method")},
		{"methods, misspelt method", []string{"methods", "h2oo"}, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			code, _, stderr := runCLI(t, append([]string{"--kernels", root}, tc.args...)...)
			if code != 2 || !strings.Contains(stderr, "is unknown") {
				t.Fatalf("exit %d, want 2 and an unknown name:\n%s", code, stderr)
			}
			if tc.want == "" && (strings.Contains(stderr, "workbench schema") || strings.Contains(stderr, "OPS")) {
				t.Errorf("a misspelt name got a hint:\n%s", stderr)
			}
			if tc.want != "" && !strings.Contains(stderr, tc.want) {
				t.Errorf("want %q in:\n%s", tc.want, stderr)
			}
		})
	}

	// With its OPS line the op is a name the sources hold and the schema lacks.
	registry := filepath.Join(ops, "__init__.py")
	src, _ := os.ReadFile(registry)
	os.WriteFile(registry, bytes.Replace(src, []byte(`    Op("fp8_decode", benchmark="fp8"),`),
		[]byte(`    Op("fp8_decode", benchmark="fp8"),`+"\n"+`    Op("toy_op", benchmark="fp8"),`), 1), 0o644)
	code, _, stderr := runCLI(t, "--kernels", root, "selftest", "--op", "toy_op")
	if code != 2 || !strings.Contains(stderr, stale("toy_op")) || strings.Contains(stderr, "has no line in OPS") {
		t.Errorf("exit %d, want the stale-schema hint:\n%s", code, stderr)
	}
}

// A default (or a protocol's value) changed in Python without `workbench
// schema` does not run as if the script had chosen the old one: each job
// carries what its plan filled in, and the worker refuses it, naming the
// knob and the fix; a job whose script set the knob itself runs.
func TestRunRefusesJobsPlannedFromAStaleSchema(t *testing.T) {
	py := testpy.Python(t)
	root := t.TempDir()
	if out, err := exec.Command("cp", "-r", "../kernels_py", root).CombinedOutput(); err != nil {
		t.Fatalf("copy kernels_py: %v: %s", err, out)
	}
	h2o := filepath.Join(root, "kernels_py", "methods", "h2o.py")
	src, _ := os.ReadFile(h2o)
	const (
		workload = `workloads = [workload(layers = 1, decode_steps = 1)]`
		stale    = "kernels_py/schema.json is out of date for method 'h2o' (kernels_py/methods/h2o.py: "
	)
	tests := []struct {
		name, from, to, script, want string // want "": the run succeeds
	}{
		{"a default", `"float", 0.5, "share of the budget reserved`, `"float", 0.4, "share of the budget reserved`,
			`experiment(name = "x", methods = ["h2o"], grid = {"budget": [0.5]}, ` + workload + `)`,
			stale + "recent_fraction defaults to 0.4, not 0.5)"},
		{"a protocol's value", `protocols = {"vlcache": {"recent_fraction": 0.1}}`, `protocols = {"vlcache": {"recent_fraction": 0.15}}`,
			`experiment(name = "x", protocol = "vlcache", methods = ["h2o"], grid = {"budget": [0.5]}, ` + workload + `)`,
			stale + "protocol 'vlcache' sets recent_fraction to 0.15, not 0.1)"},
		{"a default the script sets", `"float", 0.5, "share of the budget reserved`, `"float", 0.4, "share of the budget reserved`,
			`experiment(name = "x", methods = ["h2o"], grid = {"budget": [0.5], "recent_fraction": [0.25]}, ` + workload + `)`, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			edited := bytes.Replace(src, []byte(tc.from), []byte(tc.to), 1)
			if bytes.Equal(edited, src) {
				t.Fatalf("h2o.py no longer holds %q, which this test edits", tc.from)
			}
			os.WriteFile(h2o, edited, 0o644)
			script := filepath.Join(t.TempDir(), "x.star")
			os.WriteFile(script, []byte(tc.script+"\n"), 0o644)
			code, stdout, stderr := runCLI(t, "--python", py, "--device", "cpu", "--kernels", root, "run", "--out", t.TempDir(), script)
			switch {
			case tc.want == "" && (code != 0 || strings.Contains(stdout+stderr, "out of date")):
				t.Errorf("exit %d, want the job to run:\n%s\n%s", code, stdout, stderr)
			case tc.want != "" && (code != 1 || !strings.Contains(stdout+stderr, tc.want) || !strings.Contains(stdout+stderr, "run `workbench schema`")):
				t.Errorf("exit %d, want the job refused with %q:\n%s\n%s", code, tc.want, stdout, stderr)
			}
		})
	}
}
