package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vlkv/vlkv/gohost/compare"
	"github.com/vlkv/vlkv/gohost/expt"
	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/testpy"
)

// startProc starts cmd with its stdout and stderr collected.
func startProc(t *testing.T, cmd *exec.Cmd) *testpy.SyncBuffer {
	t.Helper()
	out := &testpy.SyncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return out
}

// waitOutput waits until the output after offset holds every want, and
// returns the offset past what it read.
func waitOutput(t *testing.T, out *testpy.SyncBuffer, from int, limit time.Duration, want ...string) int {
	t.Helper()
	deadline := time.Now().Add(limit)
	for time.Now().Before(deadline) {
		text := out.String()
		if from > len(text) {
			from = len(text)
		}
		all := true
		for _, w := range want {
			all = all && strings.Contains(text[from:], w)
		}
		if all {
			return len(text)
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("waited %v for %q; output:\n%s", limit, want, out.String())
	return 0
}

// The edit-rerun loop on a copy of a kernel: each save reruns the check;
// a compile error shows as its source line and the compiler's message and
// the watch goes on; a wrong result shows as a mismatch with its error; the
// fix recovers; a restarted watch continues the history; Ctrl-C leaves no
// process behind.
func TestWatchAnOpWhileItsKernelIsEdited(t *testing.T) {
	py := testpy.Python(t)
	bin := workbenchBinary(t)
	dir := t.TempDir()
	root := copyKernels(t, dir)
	kernel := filepath.Join(root, "kernels_py", "ops", "gather_decode", "kernel.py")
	original, err := os.ReadFile(kernel)
	if err != nil {
		t.Fatal(err)
	}
	edit := func(old, new string) {
		t.Helper()
		text := string(original)
		if !strings.Contains(text, old) {
			t.Fatalf("kernel.py has no %q", old)
		}
		if err := os.WriteFile(kernel, []byte(strings.Replace(text, old, new, 1)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	start := func(args ...string) (*exec.Cmd, *testpy.SyncBuffer) {
		cmd := exec.Command(bin, append([]string{"--python", py, "--kernels", root, "watch", "gather_decode", "--debounce", "100ms"}, args...)...)
		cmd.Env = append(os.Environ(), "VLKV_CACHE_DIR="+filepath.Join(dir, "cache"))
		cmd.Dir = dir
		return cmd, startProc(t, cmd)
	}
	stop := func(cmd *exec.Cmd, out *testpy.SyncBuffer) {
		t.Helper()
		cmd.Process.Signal(syscall.SIGINT)
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("watch after Ctrl-C: %v\n%s", err, out.String())
			}
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			t.Fatalf("watch did not stop on Ctrl-C:\n%s", out.String())
		}
		time.Sleep(200 * time.Millisecond)
		if left := workersIn(root); len(left) > 0 {
			t.Errorf("processes left running in the kernels root: %v", left)
		}
	}

	cmd, out := start("--reset-history")
	at := waitOutput(t, out, 0, 120*time.Second, "iteration 1 ", "selftest (cpu, Triton interpreter): OK",
		"compile sm_90 (gather-fp16-d128-gqa4): _stage1_kernel", "max error", "OK; watching")

	// A compile error: the source line and the compiler's message, then the watch goes on.
	zeros := "acc = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)\n"
	line := strings.Count(string(original)[:strings.Index(string(original), zeros)], "\n") + 1
	edit(zeros, "acc = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32) + tl.arange(0, 3)\n")
	at = waitOutput(t, out, at, 120*time.Second, "iteration 2 · ", "kernels_py/ops/gather_decode/kernel.py (",
		fmt.Sprintf("ERROR kernels_py/ops/gather_decode/kernel.py:%d\n", line),
		"+ tl.arange(0, 3)\n  arange's range must be a power of 2", "FAILING; watching")
	if strings.Contains(out.String(), "Traceback") {
		t.Errorf("a traceback was shown:\n%s", out.String())
	}

	// A kernel that compiles but computes the wrong thing: a mismatch, with its error against the first iteration.
	edit("_store_split(PartO + part_rows, PartLse + lse_rows, acc,", "_store_split(PartO + part_rows, PartLse + lse_rows, acc * 1.5,")
	at = waitOutput(t, out, at, 120*time.Second, "iteration 3 · ", "selftest (cpu, Triton interpreter): MISMATCH",
		"false", "FAILING; watching")
	screen := out.String()[at-2000:]
	if !strings.Contains(screen, "max error") || !strings.Contains(screen, "failed shapes  3") { // the sorted, the unsorted and the unsorted in 3 splits
		t.Errorf("the mismatch's figures:\n%s", screen)
	}

	// The fix: back to what the first iteration measured.
	os.WriteFile(kernel, original, 0o644)
	at = waitOutput(t, out, at, 120*time.Second, "iteration 4 · ", "selftest (cpu, Triton interpreter): OK", "OK; watching")
	screen = out.String()
	last := screen[strings.LastIndex(screen, "iteration 4 "):]
	if !strings.Contains(last, "failed shapes  0") || !strings.Contains(last, "=") {
		t.Errorf("after the fix:\n%s", last)
	}
	stop(cmd, out)

	// A restarted watch continues the history.
	cmd, out = start("--no-compile")
	waitOutput(t, out, 0, 120*time.Second, "4 earlier iteration(s) of gather_decode", "iteration 1 ", "OK; watching")
	stop(cmd, out)
}

// watch --experiment: a save reruns the jobs computed on the old sources
// and prints the rows whose metrics changed.
func TestWatchAnExperiment(t *testing.T) {
	py := testpy.Python(t)
	bin := workbenchBinary(t)
	dir := t.TempDir()
	root := copyKernels(t, dir)
	script := filepath.Join(dir, "small.star")
	os.WriteFile(script, []byte(`experiment(name = "small", methods = ["full", "h2o", "streamingllm"],
    grid = {"budget": [0.25, 0.5]},
    workloads = [workload(tokens_per_image = 48, system_tokens = 8, text_tokens = 8, decode_steps = 2, layers = 2)])
`), 0o644)
	cmd := exec.Command(bin, "--python", py, "--kernels", root, "watch", "--experiment", script, "--out",
		filepath.Join(dir, "out"), "--debounce", "100ms")
	out := startProc(t, cmd)
	defer cmd.Process.Kill()
	// Each job's progress line as it ends, not silence until the run ends.
	at := waitOutput(t, out, 0, 120*time.Second, "[1/5] ", "[5/5] ", "small: 5 rows (0 failed)", "5 new, 0 rerun", "watching")
	// Halve every recent window: h2o's rows change, the others do not.
	caches := filepath.Join(root, "kernels_py", "methods", "caches.py")
	text, _ := os.ReadFile(caches)
	edited := strings.Replace(string(text), "half_up(fraction * capacity)", "half_up(0.5 * fraction * capacity)", 1)
	if edited == string(text) {
		t.Fatal("caches.py has no recent_count to edit")
	}
	os.WriteFile(caches, []byte(edited), 0o644)
	waitOutput(t, out, at, 120*time.Second, "iteration 2 · ", "kernels_py/methods/caches.py", "[5/5] ", "0 new, 5 rerun",
		"5 rows joined, 2 changed", "budget=0.25 method=h2o [code]", "budget=0.5 method=h2o [code]", "watching")
	cmd.Process.Signal(syscall.SIGINT)
	if err := cmd.Wait(); err != nil {
		t.Errorf("watch after Ctrl-C: %v\n%s", err, out.String())
	}
}

// watch --experiment through a save that breaks an import: the error is
// shown once at its line and no job is rerun, so the run keeps its rows; the
// save that mends it compares with those rows, not with failures.
func TestWatchAnExperimentThroughABrokenImport(t *testing.T) {
	py := testpy.Python(t)
	bin := workbenchBinary(t)
	dir := t.TempDir()
	root := copyKernels(t, dir)
	script := filepath.Join(dir, "small.star")
	os.WriteFile(script, []byte(`experiment(name = "small", methods = ["full", "h2o"],
    grid = {"budget": [0.25, 0.5]},
    workloads = [workload(tokens_per_image = 48, system_tokens = 8, text_tokens = 8, decode_steps = 2, layers = 2)])
`), 0o644)
	out := filepath.Join(dir, "out")
	cmd := exec.Command(bin, "--python", py, "--kernels", root, "watch", "--experiment", script, "--out", out,
		"--debounce", "100ms")
	log := startProc(t, cmd)
	defer cmd.Process.Kill()
	at := waitOutput(t, log, 0, 120*time.Second, "small: 3 rows (0 failed)", "watching")
	journals, _ := filepath.Glob(filepath.Join(out, "small", "*", "journal.jsonl"))
	if len(journals) != 1 {
		t.Fatalf("journals %v, want one", journals)
	}
	good, _ := os.ReadFile(journals[0])

	h2o := filepath.Join(root, "kernels_py", "methods", "h2o.py")
	text, _ := os.ReadFile(h2o)
	os.WriteFile(h2o, append([]byte("def broken(:\n"), text...), 0o644)
	at = waitOutput(t, log, at, 120*time.Second, "iteration 2 · ", "ERROR kernels_py/methods/h2o.py:1\n    def broken(:",
		"no job rerun", "watching")
	if n := strings.Count(log.String(), "ERROR"); n != 1 {
		t.Errorf("the error is shown %d times, want once:\n%s", n, log.String())
	}
	if now, _ := os.ReadFile(journals[0]); !bytes.Equal(now, good) {
		t.Errorf("the broken save wrote to the journal:\n%s", now)
	}

	// Mended, with a comment more: every row is rerun on the new sources and
	// compared with its good row, not a failure.
	os.WriteFile(h2o, append([]byte("# mended\n"), text...), 0o644)
	waitOutput(t, log, at, 120*time.Second, "iteration 3 · ", "small: 3 rows (0 failed)", "0 new, 3 rerun",
		"no metric changed", "watching")
	cmd.Process.Signal(syscall.SIGINT)
	if err := cmd.Wait(); err != nil {
		t.Errorf("watch after Ctrl-C: %v\n%s", err, log.String())
	}
}

func TestWatchFiguresCountFailedShapes(t *testing.T) {
	tests := []struct {
		name       string
		selftest   string
		wantFailed float64
		counted    bool
	}{
		{"a row out of tolerance", `{"ok": false, "rows": [{"out_err": 0.5, "ok": false}, {"out_err": 0, "ok": true}]}`, 1, true},
		{"every row within", `{"ok": true, "rows": [{"out_err": 0, "ok": true}]}`, 0, true},
		// A table whose rows say nothing of tolerance cannot count failures.
		{"rows without ok", `{"ok": false, "rows": [{"max_abs_err": 0.5}, {"max_abs_err": 0}]}`, 0, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var r watchResult
			if err := json.Unmarshal([]byte(`{"selftest": `+tc.selftest+`}`), &r); err != nil {
				t.Fatal(err)
			}
			got, ok := r.figures()["failed shapes"]
			if ok != tc.counted || got != tc.wantFailed {
				t.Errorf("failed shapes = %v (shown %v), want %v (shown %v)", got, ok, tc.wantFailed, tc.counted)
			}
		})
	}
}

// A config the autotuner prunes for its spills is named on the compile line
// and left out of the figures: it never runs.
func TestWatchLeavesAPrunedConfigOutOfTheFigures(t *testing.T) {
	var r watchResult
	raw := `{"compile": {"case": "fp8", "target": 90, "kernels": [
		{"kernel": "_stage1_kernel", "seconds": 1, "config": "BLOCK_N=128 w4 s2", "registers": 128, "spill_bytes": 0},
		{"kernel": "_stage1_kernel", "seconds": 1, "config": "BLOCK_N=128 w4 s2 r64", "registers": 64,
		 "spill_bytes": 352, "pruned": true},
		{"kernel": "_merge_kernel", "seconds": 0.5, "config": null, "registers": 16, "spill_bytes": 0}]}}`
	if err := json.Unmarshal([]byte(raw), &r); err != nil {
		t.Fatal(err)
	}
	f := r.figures()
	if f["spill bytes"] != 0 || f["registers"] != 128 || f["compile s"] != 2.5 {
		t.Errorf("figures %v: want 0 spill bytes, 128 registers, 2.5 compile s", f)
	}
	var out bytes.Buffer
	e := watchEntry{Time: time.Now(), Iteration: 1, OK: true, Figures: f}
	printWatchScreen(&out, "fp8_decode", 1, e, r, nil, nil, time.Second)
	for _, want := range []string{
		"_stage1_kernel (BLOCK_N=128 w4 s2) 1.00 s, 128 registers;",
		"_stage1_kernel (BLOCK_N=128 w4 s2 r64) 1.00 s, 64 registers, 352 B spilled (pruned: the autotuner skips a config that spills);",
		"_merge_kernel 0.50 s, 16 registers\n",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("no %q in\n%s", want, out.String())
		}
	}
}

// A check after which the worker's GPU is unusable says so, and that the
// next check starts a fresh worker (the worker exits once it has replied).
func TestWatchSaysWhenTheGPUIsLost(t *testing.T) {
	var r watchResult
	raw := `{"op": "fp8_decode", "ok": false, "error": {"message": "RuntimeError: CUDA error: an illegal memory access was encountered"},
		"worker_lost": "CUDA error: an illegal memory access was encountered"}`
	if err := json.Unmarshal([]byte(raw), &r); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	printWatchScreen(&out, "fp8_decode", 1, watchEntry{Time: time.Now(), Iteration: 1, Error: r.Error}, r, nil, nil, time.Second)
	want := "the GPU was unusable after it (CUDA error: an illegal memory access was encountered): the next check starts a fresh worker\n"
	if !strings.Contains(out.String(), want) {
		t.Errorf("no %q in\n%s", want, out.String())
	}
}

// A rerun that mends a failed job is compared with the job's last good row,
// not with the failure it replaces.
func TestPrintRerunComparesWithTheLastGoodRow(t *testing.T) {
	at := func(minute int) time.Time { return time.Date(2026, 1, 1, 0, minute, 0, 0, time.UTC) }
	row := func(status string, err float64, minute int) results.Record {
		rec := results.Record{JobID: "j", Method: "h2o", Params: map[string]any{"budget": 0.5}, Status: status,
			Finished: at(minute)}
		if status == results.StatusOK {
			rec.Metrics = map[string]any{"rel_err_mean": err}
		}
		return rec
	}
	good, failed := row(results.StatusOK, 0.25, 1), row(results.StatusFailed, 0, 2)
	for _, tc := range []struct {
		name   string
		good   map[string]results.Record
		want   string
		absent string
	}{
		{"mended, same result", map[string]results.Record{"j": good}, "no metric changed", "[status"},
		{"no good row to compare with", map[string]results.Record{}, "[status failed -> ok]", "no metric changed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			a := &app{stdout: &out}
			a.printRerun("e", &compare.Run{Rows: []results.Record{failed}},
				&compare.Run{Dir: "run", Rows: []results.Record{row(results.StatusOK, 0.25, 3)}}, tc.good)
			if !strings.Contains(out.String(), tc.want) || strings.Contains(out.String(), tc.absent) {
				t.Errorf("want %q and no %q:\n%s", tc.want, tc.absent, out.String())
			}
		})
	}
}

// watch --bench --size speaks the benchmark's own knobs, checked as
// `workbench bench NAME` checks its flags, lists included.
func TestWatchBenchSizeIsCheckedAgainstTheBenchmark(t *testing.T) {
	schema, err := expt.LoadSchema("../kernels_py/schema.json")
	if err != nil {
		t.Fatal(err)
	}
	got, err := watchBenchParams(schema, "gather_decode", []string{"batches=8,lengths=4096,16384", "dtype=bfloat16", "kv-heads=4"})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]any{"batches": []int64{8}, "lengths": []int64{4096, 16384}, "dtype": "bfloat16", "kv_heads": int64(4)}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
	for _, tc := range []struct {
		size []string
		want string
	}{
		{[]string{"batch=8,context=4096"}, `benchmark gather (which times gather_decode): knob "batch" is unknown (known: batches,`},
		{[]string{"lengths=abc"}, `--size lengths: "abc" is not a whole number (ints in [1,`},
		{[]string{"lengths=0"}, "--size lengths:"},
		{[]string{"batches=8", "batches=4"}, "--size: batches is given twice"},
		{[]string{"8"}, `--size "8": want KNOB=VALUE,..., e.g. --size batches=1,lengths=2048`},
		{[]string{"repeat=3,4"}, "--size repeat: takes one value, got 2"},
		{[]string{"dtype=float64"}, "--size dtype:"},
	} {
		if _, err := watchBenchParams(schema, "gather_decode", tc.size); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want %q", tc.size, err, tc.want)
		}
	}
}

// A save under kernels_py (a .py) and of an extra file (the experiment
// script, schema.json) is a change; other files under kernels_py are not.
func TestWatchSourcesSeesSourcesAndExtraFiles(t *testing.T) {
	root := filepath.Join(t.TempDir(), "kernels_py")
	os.MkdirAll(root, 0o755)
	schema := filepath.Join(root, "schema.json")
	os.WriteFile(schema, []byte("{}"), 0o644)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	changes, stop, err := watchSources(ctx, root, []string{schema}, 20*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	for _, tc := range []struct{ file, want string }{
		{"notes.txt", ""}, // not a source: no change, so the next save is the first seen
		{"schema.json", "kernels_py/schema.json"},
		{"mine.py", "kernels_py/mine.py"},
	} {
		os.WriteFile(filepath.Join(root, tc.file), []byte("x = 1\n"), 0o644)
		select {
		case got := <-changes:
			if tc.want == "" || len(got) != 1 || got[0] != tc.want {
				t.Fatalf("saving %s: changes %v, want [%s]", tc.file, got, tc.want)
			}
		case <-time.After(2 * time.Second):
			if tc.want != "" {
				t.Fatalf("saving %s: no change seen", tc.file)
			}
		}
	}
}

// The selftest's time is the kernels' on a GPU and the interpreter's on the
// CPU, and is named for which it is.
func TestWatchNamesTheInterpretersTimeSo(t *testing.T) {
	for _, tc := range []struct {
		interpreter bool
		key, not    string
	}{{false, "kernel s", "interpreter s"}, {true, "interpreter s", "kernel s"}} {
		var r watchResult
		raw := fmt.Sprintf(`{"interpreter": %v, "selftest": {"columns": [], "rows": [{"err": 0.5, "ok": true}], "kernel_seconds": 2}}`, tc.interpreter)
		if err := json.Unmarshal([]byte(raw), &r); err != nil {
			t.Fatal(err)
		}
		f := r.figures()
		if _, found := f[tc.not]; f[tc.key] != 2 || found || f["max error"] != 0.5 {
			t.Errorf("interpreter %v: figures %v, want %q = 2 and no %q", tc.interpreter, f, tc.key, tc.not)
		}
	}
}

// A restarted watch compares its figures only with iterations measured with
// the same --dtype, --seed, --target and --size: float16's error against
// float32's, or one benchmark size's time against another's, is no change of
// the kernel's.
func TestWatchComparesOnlyIterationsOfTheSameSettings(t *testing.T) {
	t.Setenv("VLKV_CACHE_DIR", t.TempDir())
	f32 := watchFlags{dtype: enumFlag{value: "float32"}, target: 90}
	f16 := watchFlags{dtype: enumFlag{value: "float16"}, target: 90}
	s32, s16 := watchSettings(f32, nil), watchSettings(f16, nil)
	if s32 == s16 || s32 != watchSettings(f32, map[string]any{}) ||
		s32 == watchSettings(f32, map[string]any{"batches": []int64{8}}) {
		t.Fatalf("settings: %s, %s", s32, s16)
	}
	h, err := openWatchHistory("/kernels", "gather_decode", true)
	if err != nil {
		t.Fatal(err)
	}
	for i, e := range []watchEntry{{Settings: s32, Figures: map[string]float64{"max error": 1e-7}},
		{Settings: s16, Figures: map[string]float64{"max error": 1e-3}},
		{Settings: s16, Figures: map[string]float64{"max error": 2e-3}}} {
		e.Iteration = i + 1
		if err := h.add(e); err != nil {
			t.Fatal(err)
		}
	}
	h, err = openWatchHistory("/kernels", "gather_decode", false)
	if err != nil {
		t.Fatal(err)
	}
	if p, f := h.previous(s32), h.first(s32); p == nil || p.Iteration != 1 || f == nil || f.Iteration != 1 {
		t.Errorf("float32: previous %+v, first %+v; want iteration 1", p, f)
	}
	if p, f := h.previous(s16), h.first(s16); p == nil || p.Iteration != 3 || f == nil || f.Iteration != 2 {
		t.Errorf("float16: previous %+v, first %+v; want iterations 3 and 2", p, f)
	}
}
