package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/vlkv/vlkv/gohost/pyrt"
	"github.com/vlkv/vlkv/gohost/testpy"
	"github.com/vlkv/vlkv/gohost/worker"
)

func runCLI(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := run(args, &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

func TestUsageErrors(t *testing.T) {
	tests := []struct {
		name     string
		args     []string
		wantCode int
		wantMsg  string
	}{
		{"unknown flag", []string{"--bogus"}, 2, "unknown flag: --bogus"},
		{"bad device", []string{"--device", "gpu", "env"}, 2, `unknown device "gpu"`},
		{"bad log format", []string{"--log-format", "xml", "env"}, 2, "must be one of auto, console, json"},
		{"extra argument", []string{"env", "extra"}, 2, "unknown command \"extra\""},
		{"bad dtype", []string{"selftest", "--dtype", "int8"}, 2, "must be one of float32, float16, bfloat16"},
		{"bad count", []string{"worker-ping", "--count", "0"}, 2, "--count must be at least 1"},
		{"not a number", []string{"worker-ping", "--count", "x"}, 2, "invalid argument"},
		{"zero start timeout", []string{"--start-timeout", "0", "env"}, 2, "--start-timeout 0s: want a positive duration"},
		{"start timeout without unit", []string{"--start-timeout", "90", "env"}, 2, "invalid argument"},
		{"unknown command", []string{"frobnicate"}, 2, "unknown command"},
		{"missing python", []string{"--python", "/nonexistent", "env"}, 1, "/nonexistent (from --python) does not exist"},
		{"missing kernels", []string{"--kernels", "/nonexistent", "env"}, 1, "--kernels /nonexistent: no such directory; give the directory that holds kernels_py/"},
		{"negative workers", []string{"run", "--workers", "-1", "../experiments/quickstart.star"}, 2, "--workers must be 0 (one per GPU, or 1 on CPU) or more, got -1"},
		{"empty out", []string{"run", "--out", "", "../experiments/quickstart.star"}, 2, "--out must name a directory"},
		{"empty out of demo", []string{"demo", "--out", " "}, 2, "--out must name a directory"},
		{"retry without resume", []string{"run", "--retry-failed", "../experiments/quickstart.star"}, 2, "--retry-failed only applies to a resumed run: add --resume"},
		{"missing script of watch", []string{"watch", "--experiment", "/nonexistent.star"}, 1, "--experiment /nonexistent.star: no such file or directory"},
		{"out is a file", []string{"run", "--out", "../go.mod", "../experiments/quickstart.star"}, 2, "--out ../go.mod is a file: give the results root, a directory"},
		{"out through a file", []string{"demo", "--out", "../go.mod/results"}, 2, "--out ../go.mod/results: part of that path is a file"},
		{"out of watch is a file", []string{"watch", "--experiment", "../experiments/quickstart.star", "--out", "../go.mod"}, 2, "--out ../go.mod is a file"},
		{"missing script", []string{"run", "/nonexistent.star"}, 1, "script /nonexistent.star does not exist"},
		{"missing script of plan", []string{"plan", "/nonexistent.star"}, 1, "script /nonexistent.star does not exist"},
		{"script is a directory", []string{"plan", "../experiments"}, 1, "script ../experiments is a directory: give one of its scripts: ../experiments/accuracy.star, "},
		{"script is an empty directory", []string{"run", "../gohost"}, 1, "script ../gohost is a directory: give an experiment script, a .star file"},
		{"code change without resume", []string{"run", "--allow-code-change", "../experiments/quickstart.star"}, 2, "--allow-code-change only applies to a resumed run"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			code, _, stderr := runCLI(t, tc.args...)
			if code != tc.wantCode {
				t.Errorf("exit code %d, want %d; stderr:\n%s", code, tc.wantCode, stderr)
			}
			first := strings.SplitN(stderr, "\n", 2)[0]
			if !strings.HasPrefix(first, "workbench: ") || !strings.Contains(first, tc.wantMsg) {
				t.Errorf("first stderr line %q does not give the reason %q", first, tc.wantMsg)
			}
			if hasUsage := strings.Contains(stderr, "Usage:"); hasUsage != (tc.wantCode == 2) {
				t.Errorf("usage shown: %v, want %v", hasUsage, tc.wantCode == 2)
			}
		})
	}
}

// A run's own folder, or its experiment's, given as --out (to resume it,
// say) is refused: a run there would nest inside it.
func TestOutIsARunDirectory(t *testing.T) {
	root := t.TempDir()
	experiment := filepath.Join(root, "quickstart")
	run := filepath.Join(experiment, "20260101-000000-aaaaaa")
	if err := os.MkdirAll(run, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(run, "manifest.json"), []byte(`{"experiment": "quickstart"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		out  string
		want string
	}{
		{"run directory", run, "--out " + run + " is a run directory (it holds manifest.json): give the results root, which holds " +
			"<experiment>/<run id> (for this run " + root + ")"},
		{"experiment's folder", experiment, "--out " + experiment + " is an experiment's folder (it holds runs, the newest " + run +
			"): give the results root, which holds <experiment>/<run id> (for these runs " + root + ")"},
	}
	for _, tc := range tests {
		for _, args := range [][]string{{"run", "--out", tc.out, "../experiments/quickstart.star"},
			{"run", "--resume", "--out", tc.out, "../experiments/quickstart.star"}, {"demo", "--out", tc.out}} {
			t.Run(tc.name+"/"+strings.Join(args[:len(args)-2], " "), func(t *testing.T) {
				code, _, stderr := runCLI(t, args...)
				if code != 2 || !strings.Contains(stderr, tc.want) {
					t.Errorf("%v: exit %d\n%s\nwant %q", args, code, stderr, tc.want)
				}
				if entries, _ := os.ReadDir(experiment); len(entries) != 1 {
					t.Errorf("%v: the experiment's folder holds %d entries, want only its run", args, len(entries))
				}
				if entries, _ := os.ReadDir(run); len(entries) != 1 {
					t.Errorf("%v: the run directory holds %d entries, want only its manifest", args, len(entries))
				}
			})
		}
	}
}

func TestVersion(t *testing.T) {
	code, stdout, _ := runCLI(t, "--version")
	if code != 0 || !strings.HasPrefix(stdout, "workbench "+version) {
		t.Fatalf("code %d, output %q", code, stdout)
	}
}

func TestEnvJSON(t *testing.T) {
	py := testpy.Python(t)
	code, stdout, stderr := runCLI(t, "--python", py, "--device", "cpu", "--log-format", "json", "env", "--json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var r struct {
		Python      struct{ Version string }
		Torch       struct{ Version string }
		Triton      struct{ Version string }
		Numpy       struct{ Version string }
		Device      struct{ Kind string }
		Runtime     struct{ Kind, Source, Python string }
		Kernels     struct{ Dir, Source string }
		Interpreter bool
		Go          struct{ Version string }
	}
	if err := json.Unmarshal([]byte(stdout), &r); err != nil {
		t.Fatalf("env --json is not JSON: %v\n%s", err, stdout)
	}
	if r.Python.Version == "" || r.Torch.Version == "" || r.Triton.Version == "" || r.Numpy.Version == "" || r.Go.Version == "" {
		t.Errorf("missing versions: %+v", r)
	}
	if r.Device.Kind != "cpu" || !r.Interpreter {
		t.Errorf("device %q, interpreter %v; want cpu under the interpreter", r.Device.Kind, r.Interpreter)
	}
	if r.Runtime.Kind != "external" || r.Runtime.Source != "--python" || r.Kernels.Source != "checkout" {
		t.Errorf("runtime %+v, kernels %+v", r.Runtime, r.Kernels)
	}
	// Logs are JSON lines on stderr, never on stdout.
	for _, line := range strings.Split(strings.TrimSpace(stderr), "\n") {
		if line != "" && !json.Valid([]byte(line)) {
			t.Errorf("log line is not JSON: %q", line)
		}
	}
}

// Editing a kernel's source and rerunning selftest runs the edited kernel.
func TestSelftestPicksUpKernelEdits(t *testing.T) {
	py := testpy.Python(t)
	root := t.TempDir()
	if out, err := exec.Command("cp", "-r", "../kernels_py", root).CombinedOutput(); err != nil {
		t.Fatalf("copy kernels_py: %v: %s", err, out)
	}
	kernel := filepath.Join(root, "kernels_py", "ops", "attention_stats", "kernel.py")
	orig, err := os.ReadFile(kernel)
	if err != nil {
		t.Fatal(err)
	}
	demo := func() (int, string) {
		code, stdout, stderr := runCLI(t, "--python", py, "--kernels", root, "--device", "cpu", "selftest", "--op", "attention_stats")
		return code, stdout + stderr
	}

	// An op named twice runs once.
	code, stdout, stderr := runCLI(t, "--python", py, "--kernels", root, "--device", "cpu", "selftest", "--op", "attention_stats,attention_stats")
	if n := strings.Count(stdout, "attention_stats: attention mass of"); code != 0 || n != 1 {
		t.Fatalf("selftest --op attention_stats,attention_stats: exit %d, %d tables, want one\n%s%s", code, n, stdout, stderr)
	}

	code, out := demo()
	if code != 0 || !strings.Contains(out, "OK") {
		t.Fatalf("unedited selftest: exit %d\n%s", code, out)
	}

	const line = "return attn + e * inv_l[:, None], below"
	if !bytes.Contains(orig, []byte(line)) {
		t.Fatalf("kernel source no longer contains %q; update this test", line)
	}
	broken := bytes.Replace(orig, []byte(line), []byte("return attn + 2.0 * e * inv_l[:, None], below"), 1)
	if err := os.WriteFile(kernel, broken, 0o644); err != nil {
		t.Fatal(err)
	}
	code, out = demo()
	if code != 1 || !strings.Contains(out, "MISMATCH") || !strings.Contains(out, "kernel disagrees with the reference: attention_stats") {
		t.Fatalf("edited selftest: exit %d, want 1 with a mismatch\n%s", code, out)
	}

	// A kernel the interpreter rejects: shown at its line, without Triton's traceback.
	const tile = "offs_n = start_n + tl.arange(0, BLOCK_N)"
	at := bytes.Index(orig, []byte(tile))
	if at < 0 {
		t.Fatalf("kernel source no longer contains %q; update this test", tile)
	}
	lineNo := bytes.Count(orig[:at], []byte("\n")) + 1
	if err := os.WriteFile(kernel, bytes.Replace(orig, []byte(tile), []byte("offs_n = start_n + tl.arange(0, 3)"), 1), 0o644); err != nil {
		t.Fatal(err)
	}
	code, out = demo()
	want := fmt.Sprintf("selftest job failed at kernels_py/ops/attention_stats/kernel.py:%d\n    offs_n = start_n + tl.arange(0, 3)\n", lineNo)
	if code != 1 || !strings.Contains(out, want) || !strings.Contains(out, "power of 2") || strings.Contains(out, "Traceback") {
		t.Fatalf("selftest of a kernel that does not interpret: exit %d, want 1 with %q\n%s", code, want, out)
	}

	if err := os.WriteFile(kernel, orig, 0o644); err != nil {
		t.Fatal(err)
	}
	if code, out = demo(); code != 0 {
		t.Fatalf("restored selftest: exit %d\n%s", code, out)
	}
}

func TestWorkerPing(t *testing.T) {
	py := testpy.Python(t)
	code, stdout, stderr := runCLI(t, "--python", py, "--device", "cpu", "worker-ping", "-n", "5")
	if code != 0 || !strings.Contains(stdout, "5 round trips") {
		t.Fatalf("exit %d\n%s%s", code, stdout, stderr)
	}
}

// --start-timeout bounds the worker's start in a command that starts one
// itself and in a run's pool, where before the wait was one minute, fixed.
func TestStartTimeoutReachesTheWorkers(t *testing.T) {
	py := testpy.Python(t)
	out := t.TempDir()
	for _, args := range [][]string{
		{"worker-ping", "-n", "1"},
		{"run", "../experiments/quickstart.star", "--out", out},
	} {
		// No interpreter imports torch in a millisecond.
		code, stdout, stderr := runCLI(t, append([]string{"--python", py, "--device", "cpu", "--start-timeout", "1ms"}, args...)...)
		if code != 1 || !strings.Contains(stderr, "no hello within 1ms") || !strings.Contains(stderr, "--start-timeout gives it longer") {
			t.Errorf("%s with --start-timeout 1ms: exit %d, want 1 and the timeout named\n%s%s", args[0], code, stdout, stderr)
		}
	}
}

func TestBenchCommandsRun(t *testing.T) {
	py := testpy.Python(t)
	code, stdout, stderr := runCLI(t, "--python", py, "--device", "cpu", "bench", "exchange", "--json", "--max-bytes", "65536", "--repeat", "1")
	var ex struct {
		Rows []struct {
			Bytes                   int64
			ShmSeconds, PipeSeconds float64
		} `json:"rows"`
	}
	if code != 0 || json.Unmarshal([]byte(stdout), &ex) != nil || len(ex.Rows) != 3 || ex.Rows[2].Bytes != 65536 {
		t.Fatalf("bench exchange: exit %d, %s\n%s", code, stdout, stderr)
	}
	code, stdout, stderr = runCLI(t, "--python", py, "--device", "cpu", "bench", "stats")
	if code != 0 || !strings.Contains(stdout, "stats/SDPA") || !strings.Contains(stderr, "not kernel speed") {
		t.Fatalf("bench stats: exit %d\n%s%s", code, stdout, stderr)
	}
}

func TestBenchLowrankRuns(t *testing.T) {
	py := testpy.Python(t)
	code, stdout, stderr := runCLI(t, "--python", py, "--device", "cpu", "bench", "lowrank")
	if code != 0 || !strings.Contains(stdout, "SDPA/fused") || !strings.Contains(stderr, "not kernel speed") {
		t.Fatalf("bench lowrank: exit %d\n%s%s", code, stdout, stderr)
	}
	code, stdout, stderr = runCLI(t, "--python", py, "--device", "cpu", "bench", "lowrank", "--json", "--lengths", "48,80", "--heads", "2", "--kv-heads", "1", "--head-dim", "64", "--ranks", "16")
	var res struct {
		Interpreter bool             `json:"interpreter"`
		Params      map[string]any   `json:"params"`
		Columns     []map[string]any `json:"columns"`
		Rows        []map[string]any `json:"rows"`
	}
	if code != 0 || json.Unmarshal([]byte(stdout), &res) != nil || !res.Interpreter || len(res.Rows) != 2 {
		t.Fatalf("bench lowrank --json: exit %d, %s\n%s", code, stdout, stderr)
	}
	if res.Params["kv_heads"] != 1.0 || fmt.Sprint(res.Params["lengths"]) != "[48 80]" {
		t.Errorf("params used: %v", res.Params)
	}
	for i, r := range res.Rows {
		positive := func(k string) bool { f, ok := r[k].(float64); return ok && f > 0 }
		if r["visual_len"] != []float64{48, 80}[i] || r["kv_heads"] != 1.0 || !positive("fused_ms") || !positive("unfused_ms") ||
			!positive("sdpa_ms") || r["compression_ratio"].(float64) <= 1 || r["fused_peak_bytes"] != nil {
			t.Errorf("bench lowrank --json row %d: %+v", i, r)
		}
	}
}

// Bad benchmark flags fail before any Python starts, quoting the parameter.
func TestBenchFlagsAreChecked(t *testing.T) {
	tests := []struct {
		args []string
		want string
	}{
		{[]string{"bench", "lowrank", "--ranks", "16,0"}, "--ranks: 0 is below the minimum 1 (ints in [1, 65536], default [64]: compression ranks of keys and values"},
		{[]string{"bench", "stats", "--dtype", "int8"}, `--dtype: "int8" is not one of "float16", "bfloat16", "float32"`},
		{[]string{"bench", "stats", "--lengths", "0,8"}, "--lengths: 0 is below the minimum 1"},
		{[]string{"bench", "lowrnak"}, `benchmark "lowrnak" is unknown (did you mean "lowrank"?) (known: fp8, gather, generate, lowrank, quant, sparse-prefill, stats, exchange)`},
		{[]string{"--python", "/nonexistent", "bench", "stats", "--bogus"}, "unknown flag: --bogus"},
		{[]string{"selftest", "--op", "atention_stats"}, `--op: "atention_stats" is unknown (did you mean "attention_stats"?)`},
		// Refused before any Python starts (this interpreter does not exist).
		{[]string{"--python", "/nonexistent", "kernels", "report", "--estimate", "--op", "gather_decod"},
			`--op: "gather_decod" is unknown (did you mean "gather_decode"?) (known: attention_stats, fp8_decode, gather_decode, kv_quant, lowrank_decode, quant_decode)`},
	}
	for _, tc := range tests {
		code, _, stderr := runCLI(t, tc.args...)
		if code != 2 || !strings.Contains(stderr, tc.want) {
			t.Errorf("%v: exit %d, stderr %q; want 2 and %q", tc.args, code, stderr, tc.want)
		}
	}
	// Knobs that cannot work together are a usage error too, found by Python: no traceback.
	if py := os.Getenv("VLKV_TEST_PYTHON"); py != "" {
		code, _, stderr := runCLI(t, "--python", py, "--device", "cpu", "bench", "lowrank", "--kv-heads", "3")
		if code != 2 || !strings.Contains(stderr, "heads (32) must be a multiple of kv_heads (3)") || strings.Contains(stderr, "Traceback") {
			t.Errorf("bench lowrank --kv-heads 3: exit %d, %s", code, stderr)
		}
	}
	code, stdout, _ := runCLI(t, "bench", "lowrank", "--help")
	if code != 0 || !strings.Contains(stdout, "--kv-heads") || !strings.Contains(stdout, `speedup_vs_sdpa [x] ("SDPA/fused" in the table): SDPA time / fused time`) {
		t.Errorf("bench lowrank --help: exit %d\n%s", code, stdout)
	}
}

// A method named twice is listed once.
func TestMethodsNamedTwiceAreListedOnce(t *testing.T) {
	code, stdout, stderr := runCLI(t, "methods", "h2o", "h2o")
	if n := strings.Count(stdout, "h2o: "); code != 0 || n != 1 {
		t.Fatalf("methods h2o h2o: exit %d, h2o listed %d times, want once\n%s%s", code, n, stdout, stderr)
	}
	code, stdout, stderr = runCLI(t, "methods", "--json", "h2o", "h2o")
	var res struct{ Methods []struct{ Name string } }
	if err := json.Unmarshal([]byte(stdout), &res); code != 0 || err != nil || len(res.Methods) != 1 {
		t.Fatalf("methods --json h2o h2o: exit %d, %v, %d methods, want one\n%s%s", code, err, len(res.Methods), stdout, stderr)
	}
}

func TestMethodsListsKnobs(t *testing.T) {
	code, stdout, stderr := runCLI(t, "methods")
	if code != 0 || !strings.Contains(stdout, "attentionpack: AttentionPack") ||
		!strings.Contains(stdout, "budget                float in [0.001, 1], default 0.2: share of the tokens the cache keeps: of the prompt, and with evict_while_decoding of every token seen") ||
		!strings.Contains(stdout, "protocol vlcache: sets evict_while_decoding=true, recent_fraction=0.1") ||
		!strings.Contains(stdout, `workload "synthetic" (the default)`) ||
		// A knob a script must set says so, not that its placeholder "" is a default.
		!strings.Contains(stdout, "  path  str, required: the trace file (.safetensors) to replay") ||
		!strings.Contains(stdout, "  model         str, required: local model directory") {
		t.Fatalf("methods: exit %d\n%s%s", code, stdout, stderr)
	}
	code, stdout, _ = runCLI(t, "methods", "--json", "zipvl")
	var res struct {
		Methods []struct {
			Name   string
			Params []struct{ Name, Doc, Ref string }
		}
	}
	if code != 0 || json.Unmarshal([]byte(stdout), &res) != nil || len(res.Methods) != 1 || res.Methods[0].Name != "zipvl" {
		t.Fatalf("methods --json zipvl: exit %d\n%s", code, stdout)
	}
	tau := false
	for _, p := range res.Methods[0].Params {
		if p.Name == "tau" {
			tau = true
			if p.Ref != "ZipVL Eq. 6" || p.Doc == "" {
				t.Errorf("tau: %+v", p)
			}
		}
	}
	if !tau {
		t.Errorf("methods --json zipvl lists no tau: %+v", res.Methods[0].Params)
	}
	// JSON says what the text says of a knob a script must set, and of one that names files.
	code, stdout, _ = runCLI(t, "methods", "--json")
	var all struct {
		Workloads []struct {
			Name   string
			Params []struct {
				Name            string
				Required, Paths bool
			}
		}
	}
	if code != 0 || json.Unmarshal([]byte(stdout), &all) != nil {
		t.Fatalf("methods --json: exit %d\n%s", code, stdout)
	}
	knobs := map[string][2]bool{}
	for _, w := range all.Workloads {
		for _, p := range w.Params {
			knobs[w.Name+"."+p.Name] = [2]bool{p.Required, p.Paths}
		}
	}
	for name, want := range map[string][2]bool{"trace.path": {true, true}, "vlm.model": {true, true}, "vlm.prompt": {true, false}, "synthetic.seed": {false, false}} {
		if got, ok := knobs[name]; !ok || got != want {
			t.Errorf("methods --json: %s: required, paths = %v (listed: %t), want %v", name, got, ok, want)
		}
	}
	// kvpress lists its presses with their parameters (from the schema, no Python).
	code, stdout, _ = runCLI(t, "methods", "kvpress")
	if code != 0 || !strings.Contains(stdout, "press_args") ||
		!strings.Contains(stdout, "    SnapKVPress(compression_ratio=0.0, window_size=64, kernel_size=5)\n") {
		t.Errorf("methods kvpress: exit %d\n%s", code, stdout)
	}
	if code, _, stderr := runCLI(t, "methods", "h2oo"); code != 2 || !strings.Contains(stderr, `method "h2oo" is unknown (did you mean "h2o"?)`) {
		t.Errorf("methods h2oo: exit %d, %s", code, stderr)
	}
}

// kernels report compiles for a GPU target on a machine without one and
// reads back what the kernels became.
func TestKernelsReport(t *testing.T) {
	py := os.Getenv("VLKV_TEST_PYTHON")
	if py == "" {
		t.Skip("needs VLKV_TEST_PYTHON")
	}
	code, stdout, stderr := runCLI(t, "--python", py, "kernels", "report", "--arch", "sm_90", "--json", "--case", "absorbed-fp16-d128-r64x96")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var res struct {
		Title  string
		Rows   []map[string]any
		Models []struct{ Title string }
	}
	if err := json.Unmarshal([]byte(stdout), &res); err != nil || !strings.Contains(res.Title, "sm_90") {
		t.Fatalf("%v\n%s", err, stdout)
	}
	// The ideal of the case's op only.
	if len(res.Models) != 1 || !strings.Contains(res.Models[0].Title, "U_k + U_v") {
		t.Errorf("models: %+v", res.Models)
	}
	stage1 := 0
	for _, r := range res.Rows {
		if r["kernel"] != "_stage1_absorbed_kernel" {
			continue
		}
		stage1++
		if r["tensor_cores"] != true || r["registers"].(float64) <= 0 || r["registers"].(float64) > 255 {
			t.Errorf("row %v", r)
		}
		if r["block_n"] == 32.0 && r["num_warps"] == 4.0 && r["spill_stores"] != 0.0 {
			t.Errorf("the default config spills: %v", r)
		}
	}
	if stage1 == 0 {
		t.Fatalf("no stage-1 rows in %v", res.Rows)
	}
	code, _, stderr = runCLI(t, "--python", py, "kernels", "report", "--case", "no-such-case")
	if code != 2 || !strings.Contains(stderr, `--case: 'no-such-case' is unknown`) {
		t.Errorf("unknown case: exit %d, %s", code, stderr)
	}
	// --op without --estimate: that op's compile cases, and only its ideal.
	code, stdout, stderr = runCLI(t, "--python", py, "kernels", "report", "--arch", "sm_90", "--json", "--op", "gather_decode")
	res.Rows, res.Models = nil, nil
	if code != 0 || json.Unmarshal([]byte(stdout), &res) != nil {
		t.Fatalf("--op gather_decode: exit %d, %s", code, stderr)
	}
	cases := map[string]bool{}
	for _, r := range res.Rows {
		name, _ := r["case"].(string)
		cases[name] = true
		if !strings.HasPrefix(name, "gather-") {
			t.Errorf("--op gather_decode compiled another op's case %q", name)
		}
	}
	if len(cases) < 2 || !cases["gather-fp16-d128-gqa4"] || len(res.Models) != 1 {
		t.Errorf("--op gather_decode: cases %v, %d models", cases, len(res.Models))
	}
}

// A kernel source that does not import is shown at its line by kernels
// report, as selftest shows it, not as Python's traceback; and the other
// ops are still estimated.
func TestKernelsReportShowsASourceThatDoesNotImportAtItsLine(t *testing.T) {
	py := testpy.Python(t)
	root := copyKernels(t, t.TempDir())
	kernel := filepath.Join(root, "kernels_py", "ops", "gather_decode", "kernel.py")
	orig, err := os.ReadFile(kernel)
	if err != nil {
		t.Fatal(err)
	}
	const line = "tok_mask = offs_n < hi\n"
	at := bytes.Index(orig, []byte(line))
	if at < 0 {
		t.Fatalf("kernel source no longer contains %q; update this test", line)
	}
	lineNo := bytes.Count(orig[:at], []byte("\n")) + 1
	broken := bytes.Replace(orig, []byte(line), []byte("tok_mask = (offs_n < hi\n"), 1)
	if err := os.WriteFile(kernel, broken, 0o644); err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("kernels report failed at kernels_py/ops/gather_decode/kernel.py:%d\n    tok_mask = (offs_n < hi\n"+
		"  SyntaxError: '(' was never closed\n(the traceback: add -v)", lineNo)
	// From the checkout's root, whose kernels_py is whole: --kernels is the one read.
	t.Chdir("..")
	for _, args := range [][]string{
		{"--case", "gather-fp16-d128-gqa4"},
		{"--estimate", "--op", "gather_decode", "--json"},
	} {
		full := append([]string{"--python", py, "--kernels", root, "kernels", "report", "--arch", "sm_80"}, args...)
		code, stdout, stderr := runCLI(t, full...)
		if code != 1 || !strings.Contains(stderr, want) || strings.Contains(stderr+stdout, "Traceback") {
			t.Errorf("%v: exit %d, want 1 with %q\nstdout: %s\nstderr: %s", args, code, want, stdout, stderr)
		}
	}
	// Another op's estimate does not import gather_decode.
	code, stdout, stderr := runCLI(t, "--python", py, "--kernels", root, "kernels", "report", "--arch", "sm_80",
		"--estimate", "--op", "fp8_decode", "--shape", "batch=8,granularity=tensor", "--impl", "fp8 (fused)",
		"--config", "_stage1_kernel:BLOCK_N=64 w4 s2", "--json")
	if code != 0 || !strings.Contains(stdout, `"implementation": "fp8 (fused)"`) {
		t.Errorf("fp8_decode beside a broken gather_decode: exit %d\nstdout: %s\nstderr: %s", code, stdout, stderr)
	}
}

// kernels report --estimate estimates an op from its compiled code and
// prints the band, every config and what limits each kernel; bad shapes
// and ops are usage errors. (sm_80 has no calibration points, so this stays
// quick; test_estimate.py covers sm_90 and the calibration.)
func TestKernelsReportEstimate(t *testing.T) {
	py := os.Getenv("VLKV_TEST_PYTHON")
	if py == "" {
		t.Skip("needs VLKV_TEST_PYTHON")
	}
	code, stdout, stderr := runCLI(t, "--python", py, "kernels", "report", "--estimate", "--arch", "sm_80",
		"--op", "gather_decode", "--shape", "batch=16", "--json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var res struct {
		Estimates []struct {
			Op              string
			Shape           map[string]any
			Implementations []struct {
				Implementation string
				OptimisticUs   float64 `json:"optimistic_us"`
				ConservativeUs float64 `json:"conservative_us"`
				Bound          string
			}
		}
	}
	// batch=16 makes the two benchmark shapes (batch 8 and 64) one: estimated once.
	if err := json.Unmarshal([]byte(stdout), &res); err != nil || len(res.Estimates) != 1 {
		t.Fatalf("%v\n%s", err, stdout)
	}
	for _, e := range res.Estimates {
		b := e.Implementations[0]
		if e.Op != "gather_decode" || e.Shape["batch"] != 16.0 || b.OptimisticUs <= 0 ||
			b.ConservativeUs < b.OptimisticUs || b.Bound == "" {
			t.Errorf("estimate %+v", e)
		}
	}
	// The text form is printed from the same JSON.
	var text bytes.Buffer
	if err := printEstimate(&app{stdout: &text}, []byte(stdout)); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"estimated on an A100", "gather_decode (batch 16, context 32768",
		"selected rows", "conservative", "every config at this shape", "warp-instructions per token by class",
		"  - selected rows: _stage1_kernel: "} {
		if !strings.Contains(text.String(), want) {
			t.Errorf("no %q in\n%s", want, text.String())
		}
	}
	// One implementation, and a config that is not autotuned's error; the
	// quick loop's flags go with --estimate.
	code, stdout, stderr = runCLI(t, "--python", py, "kernels", "report", "--estimate", "--arch", "sm_80",
		"--op", "gather_decode", "--shape", "batch=16", "--impl", "selected rows", "--json")
	if code != 0 || !strings.Contains(stdout, `"implementation": "selected rows"`) || strings.Contains(stdout, "calibration") {
		t.Errorf("--impl: exit %d, %s\n%s", code, stderr, stdout)
	}
	for _, bad := range [][]string{
		{"--estimate", "--op", "gather_decode", "--impl", "selected", "selected rows"},
		{"--estimate", "--op", "gather_decode", "--config", "_stage1_kernel:w8 s3", "is not autotuned"},
		{"--impl", "selected rows", "--impl and --config go with --estimate"},
	} {
		args := append([]string{"--python", py, "kernels", "report", "--arch", "sm_80"}, bad[:len(bad)-1]...)
		if code, _, stderr := runCLI(t, args...); code != 2 || !strings.Contains(stderr, bad[len(bad)-1]) {
			t.Errorf("%v: exit %d, %s", bad, code, stderr)
		}
	}
	for _, bad := range []struct{ args, msg string }{
		{"--estimate --shape bach=8", `no op's shape has a field 'bach' (did you mean 'batch'?)`},
		{"--estimate --shape batch", `'batch' is not KEY=VALUE`},
		{"--estimate --shape batch=2.5", "batch must be a whole number"},
		{"--estimate --shape batch=0", "batch must be at least 1, got 0"},
		{"--estimate --op gather_decode --shape share=1.5", "share is a share of the tokens, in [0, 1]; got 1.5"},
		{"--estimate --op gather_decode --shape heads=30", "heads=30 must be a multiple of kv_heads=8"},
		{"--estimate --op nope", `--op: "nope" is unknown`},
		{"--estimate --op kv_quant", `--op: 'kv_quant' has no estimate: kernels_py/ops/kv_quant/model.py defines no ESTIMATES`},
		{"--shape batch=8", "--shape, --impl and --config go with --estimate"},
		{"--estimate --case decode-fp16-d128-rope-r64-h32kv8", "--estimate takes --op"},
	} {
		args := append([]string{"--python", py, "kernels", "report", "--arch", "sm_80"}, strings.Fields(bad.args)...)
		if code, _, stderr := runCLI(t, args...); code != 2 || !strings.Contains(stderr, bad.msg) {
			t.Errorf("%s: exit %d, %s", bad.args, code, stderr)
		}
	}
}

// The logger, a worker's relayed output and progress lines write at once: an
// output that is not a file is serialized (go test -race sees the difference),
// and what the commands look for by type still reaches them.
func TestOutputsAreSerializedUnlessSafe(t *testing.T) {
	var buf bytes.Buffer
	locked := serialized(&buf)
	if locked == io.Writer(&buf) {
		t.Fatalf("a buffer was not serialized")
	}
	pipe := &closedPipeWriter{w: os.Stdout, notice: io.Discard}
	for _, w := range []io.Writer{os.Stderr, pipe} {
		if serialized(w) != w {
			t.Errorf("serialized(%T) wrapped it: the commands find it by type", w)
		}
	}
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := 0; j < 100; j++ {
				fmt.Fprintf(locked, "line %d\n", j)
			}
		}()
	}
	wg.Wait()
	if n := strings.Count(buf.String(), "\n"); n != 800 {
		t.Errorf("%d lines written, want 800", n)
	}
	if !isStdout(pipe) || isStdout(&buf) || isStdout(os.Stderr) {
		t.Error("isStdout: main's stdout is a closedPipeWriter over os.Stdout, and nothing else is stdout")
	}
}

// Ctrl-C while a command's worker starts says the command was
// interrupted: it said "worker did not start: context canceled (python:
// ..., kernels: ...)", as if the interpreter had failed.
func TestWorkerStartInterruptedSaysSo(t *testing.T) {
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	s := &session{runtime: &pyrt.Runtime{Python: testpy.Python(t)}, kernels: pyrt.KernelsRoot{Dir: root}, device: worker.CPU}
	a := &app{log: zerolog.Nop()}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	w, err := a.startWorker(ctx, s)
	if w != nil {
		w.Close()
	}
	if !errors.Is(err, context.Canceled) || err.Error() != "interrupted while the worker was starting" {
		t.Errorf("got %v, want it to say the start was interrupted", err)
	}
}

// Ctrl-C during a benchmark says it was interrupted, with the exit code of
// SIGINT, not that the benchmark failed with "context canceled".
func TestBenchInterruptedSaysSo(t *testing.T) {
	py := testpy.Python(t)
	bin := workbenchBinary(t)
	cmd := exec.Command(bin, "--python", py, "--device", "cpu", "--log-format", "console", "-v", "bench", "gather", "--repeat", "10000")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string)
	go func() {
		defer close(lines)
		buf := make([]byte, 4096)
		for {
			n, err := stderr.Read(buf)
			if n > 0 {
				lines <- string(buf[:n])
			}
			if err != nil {
				return
			}
		}
	}()
	var out strings.Builder
	for !strings.Contains(out.String(), "worker ready") { // the worker is up and the job started (a loaded machine starts it in seconds)
		s, ok := <-lines
		if !ok {
			t.Fatalf("bench gather ended before its worker started:\n%s", out.String())
		}
		out.WriteString(s)
	}
	time.Sleep(2 * time.Second) // inside the timed loop
	cmd.Process.Signal(os.Interrupt)
	for s := range lines {
		out.WriteString(s)
	}
	cmd.Wait()
	if code := cmd.ProcessState.ExitCode(); code != 130 || !strings.Contains(out.String(), "bench gather: interrupted") ||
		strings.Contains(out.String(), "context canceled") {
		t.Fatalf("bench gather after Ctrl-C: exit %d\n%s", code, out.String())
	}
}

// The first Ctrl-C (or SIGTERM) cancels the command, which then stops its
// workers; a second one while it stops ends the process at once, with the
// second signal's exit code, where before it was ignored.
func TestASecondSignalExitsAtOnce(t *testing.T) {
	signals := make(chan os.Signal, 2)
	cancelled := make(chan struct{})
	exited := make(chan int, 1)
	var stderr testpy.SyncBuffer
	first := onSignals(signals, func() { close(cancelled) }, &stderr, func(code int) { exited <- code })
	if sig := first(); sig != nil {
		t.Fatalf("first() = %v before any signal", sig)
	}
	signals <- os.Interrupt
	select {
	case <-cancelled:
	case <-time.After(5 * time.Second):
		t.Fatal("the first signal did not cancel the command")
	}
	if sig := first(); sig != os.Interrupt {
		t.Errorf("first() = %v, want %v", sig, os.Interrupt)
	}
	select {
	case code := <-exited:
		t.Fatalf("one signal ended the process (exit %d): it must only cancel", code)
	case <-time.After(100 * time.Millisecond):
	}
	signals <- syscall.SIGTERM
	select {
	case code := <-exited:
		if code != 143 {
			t.Errorf("exit code %d after SIGTERM, want 143", code)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a second signal did not end the process")
	}
	if msg := stderr.String(); !strings.Contains(msg, "again: exiting now") || !strings.Contains(msg, "finished jobs are kept") {
		t.Errorf("stderr %q does not say the process exits at once and keeps finished jobs", msg)
	}
	if sig := first(); sig != os.Interrupt {
		t.Errorf("first() = %v after the second signal, want the first, %v", sig, os.Interrupt)
	}
}
