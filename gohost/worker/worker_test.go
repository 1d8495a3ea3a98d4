package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/vlkv/vlkv/gohost/testpy"
)

func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	return root
}

func startWorker(t *testing.T, kernelsRoot string) *Worker {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	w, err := Start(ctx, Config{Python: testpy.Python(t), KernelsRoot: kernelsRoot, Device: CPU, Log: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	return w
}

func run(t *testing.T, w *Worker, fn string, args map[string]any, timeout time.Duration) (json.RawMessage, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return w.Run(ctx, Job{Fn: fn, Args: args})
}

func TestWorkerLifecycle(t *testing.T) {
	w := startWorker(t, repoRoot(t))
	h := w.Hello()
	if h.Pid != w.Pid() || h.Torch.Version == nil || h.Triton.Version == nil || h.Device.Kind != "cpu" || !h.Interpreter {
		t.Fatalf("unexpected hello: %+v", h)
	}

	t.Run("echo through stdout noise", func(t *testing.T) {
		raw, err := run(t, w, "kernels_py.runtime.diag:noisy_echo", map[string]any{"lines": 200, "x": "y"}, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		var got struct{ Echo map[string]string }
		if err := json.Unmarshal(raw, &got); err != nil || got.Echo["x"] != "y" {
			t.Fatalf("reply %s, err %v", raw, err)
		}
		// The output is copied from its own pipe, so it may trail the reply a little.
		deadline := time.Now().Add(10 * time.Second)
		for !strings.Contains(w.Output(), "noise line 199") {
			if time.Now().After(deadline) {
				t.Fatal("the worker's stdout was not captured")
			}
			time.Sleep(10 * time.Millisecond)
		}
	})

	t.Run("python exception", func(t *testing.T) {
		_, err := run(t, w, "kernels_py.runtime.diag:fail", map[string]any{"message": "kaboom"}, time.Minute)
		var je *JobError
		if !errors.As(err, &je) {
			t.Fatalf("got %v, want a *JobError", err)
		}
		if je.Type != "ValueError" || je.Message != "kaboom" || !strings.Contains(je.Traceback, "diag.py") {
			t.Errorf("unexpected job error %+v", je)
		}
		if !w.Alive() {
			t.Error("a failed job killed the worker")
		}
	})
}

func TestWorkerCrashMidJob(t *testing.T) {
	w := startWorker(t, repoRoot(t))
	_, err := run(t, w, "kernels_py.runtime.diag:crash", map[string]any{"message": "segfault in my kernel"}, time.Minute)
	var ee *ExitError
	if !errors.As(err, &ee) {
		t.Fatalf("got %v, want an *ExitError", err)
	}
	if !strings.Contains(ee.State, "killed") || !strings.Contains(err.Error(), "segfault in my kernel") {
		t.Errorf("error does not say how the worker died and what it printed: %v", err)
	}
	if w.Alive() {
		t.Error("worker still reported alive")
	}
	// Later calls on the dead worker fail the same way instead of hanging.
	if _, err := run(t, w, "kernels_py.runtime.diag:echo", nil, 10*time.Second); !errors.As(err, &ee) {
		t.Errorf("call on a dead worker: got %v", err)
	}
	// A fresh worker takes the next job.
	w2 := startWorker(t, repoRoot(t))
	if _, err := run(t, w2, "kernels_py.runtime.diag:echo", nil, time.Minute); err != nil {
		t.Fatalf("fresh worker: %v", err)
	}
}

// A worker killed from outside while it runs a job fails that job with a
// readable error, as a kernel that takes the process down would.
func TestWorkerKilledFromOutsideMidJob(t *testing.T) {
	w := startWorker(t, repoRoot(t))
	go func() {
		time.Sleep(500 * time.Millisecond)
		syscall.Kill(w.Pid(), syscall.SIGKILL)
	}()
	_, err := run(t, w, "kernels_py.runtime.diag:sleep", map[string]any{"seconds": 60}, time.Minute)
	var ee *ExitError
	if !errors.As(err, &ee) || !strings.Contains(err.Error(), "signal: killed") {
		t.Fatalf("got %v, want a killed-worker error", err)
	}
	w2 := startWorker(t, repoRoot(t))
	if _, err := run(t, w2, "kernels_py.runtime.diag:echo", nil, time.Minute); err != nil {
		t.Fatalf("fresh worker after the kill: %v", err)
	}
}

func TestWorkerExitCodeMidJob(t *testing.T) {
	w := startWorker(t, repoRoot(t))
	_, err := run(t, w, "kernels_py.runtime.diag:crash", map[string]any{"message": "bye", "code": 7}, time.Minute)
	var ee *ExitError
	if !errors.As(err, &ee) || !strings.Contains(ee.State, "exit status 7") {
		t.Fatalf("got %v, want exit status 7", err)
	}
}

func TestWorkerTimeoutKillsWorker(t *testing.T) {
	w := startWorker(t, repoRoot(t))
	start := time.Now()
	_, err := run(t, w, "kernels_py.runtime.diag:sleep", map[string]any{"seconds": 30}, 500*time.Millisecond)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v, want a deadline error", err)
	}
	if elapsed := time.Since(start); elapsed > 10*time.Second {
		t.Errorf("timeout took %v", elapsed)
	}
	if w.Alive() {
		t.Error("worker still running after its job timed out")
	}
}

// A job that takes the process down in native code (a segfault in a
// kernel or an extension) fails with the Python stack it crashed in, not
// with a bare "segmentation fault".
func TestWorkerSegfaultMidJobSaysWhere(t *testing.T) {
	root := t.TempDir()
	if out, err := exec.Command("cp", "-r", filepath.Join(repoRoot(t), "kernels_py"), root).CombinedOutput(); err != nil {
		t.Fatalf("copy kernels_py: %v: %s", err, out)
	}
	mod := filepath.Join(root, "kernels_py", "scratch.py")
	src := "import ctypes\n\n\ndef launch_my_kernel():\n    return ctypes.string_at(8)\n\n\ndef run():\n    return launch_my_kernel()\n"
	if err := os.WriteFile(mod, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	w := startWorker(t, root)
	_, err := run(t, w, "kernels_py.scratch:run", nil, time.Minute)
	var ee *ExitError
	if !errors.As(err, &ee) || !strings.Contains(ee.State, "segmentation fault") {
		t.Fatalf("got %v, want an *ExitError for a segfault", err)
	}
	if first, _, _ := strings.Cut(err.Error(), "\n"); !strings.Contains(first, "at kernels_py/scratch.py:5 in launch_my_kernel") {
		t.Errorf("the error's first line does not say where the job crashed:\n%v", err)
	}
}

func TestWorkerReloadPicksUpEdits(t *testing.T) {
	root := t.TempDir()
	if out, err := exec.Command("cp", "-r", filepath.Join(repoRoot(t), "kernels_py"), root).CombinedOutput(); err != nil {
		t.Fatalf("copy kernels_py: %v: %s", err, out)
	}
	mod := filepath.Join(root, "kernels_py", "scratch.py")
	write := func(v string) {
		if err := os.WriteFile(mod, []byte("def value():\n    return "+v+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("'before'")
	w := startWorker(t, root)
	value := func() string {
		raw, err := run(t, w, "kernels_py.scratch:value", nil, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		return string(raw)
	}
	if got := value(); got != `"before"` {
		t.Fatalf("got %s", got)
	}
	write("'after'")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := w.Reload(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Changed) != 1 || res.Changed[0] != "scratch.py" {
		t.Errorf("reload reported changes %v", res.Changed)
	}
	if got := value(); got != `"after"` {
		t.Fatalf("after reload got %s", got)
	}
}

func TestWorkerStartFailures(t *testing.T) {
	py := testpy.Python(t)
	tests := []struct {
		name    string
		cfg     Config
		wantMsg string
	}{
		{"no interpreter", Config{}, "no Python interpreter"},
		{"missing interpreter", Config{Python: "/nonexistent/python3"}, "no such file"},
		{"kernels root without kernels_py", Config{Python: py, KernelsRoot: t.TempDir(), Device: CPU}, "No module named"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.Log = zerolog.Nop()
			_, err := Start(context.Background(), tc.cfg)
			if err == nil || !strings.Contains(err.Error(), tc.wantMsg) {
				t.Fatalf("got %v, want an error mentioning %q", err, tc.wantMsg)
			}
		})
	}
}

// An interpreter without a package every worker imports cannot start a
// worker however often it is tried: Start refuses at once, naming the
// interpreter and the module; other early deaths stay retryable.
func TestWorkerStartRefusesAnInterpreterWithoutItsDependencies(t *testing.T) {
	fake := func(t *testing.T, stderr string, code int) string {
		t.Helper()
		path := filepath.Join(t.TempDir(), "python")
		script := "#!/bin/sh\ncat >&2 <<'EOF'\n" + stderr + "\nEOF\nexit " + strconv.Itoa(code) + "\n"
		if err := os.WriteFile(path, []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
		return path
	}
	traceback := "Traceback (most recent call last):\n  File \"/k/kernels_py/runtime/__init__.py\", line 15, in <module>\n    import %s\n" +
		"ModuleNotFoundError: No module named '%s'"
	tests := []struct {
		name        string
		stderr      string
		wantRefused bool
		wantMsg     string
	}{
		{"no torch", fmt.Sprintf(traceback, "torch", "torch"), true, `cannot import torch (No module named 'torch'), which workers need`},
		{"a torch submodule (a broken install)", fmt.Sprintf(traceback, "torch._C", "torch._C"), false, "worker did not start"},
		{"no numpy", fmt.Sprintf(traceback, "numpy", "numpy"), true, `cannot import numpy (No module named 'numpy'), which workers need`},
		{"a kernels_py module", fmt.Sprintf(traceback, "kernels_py.gone", "kernels_py.gone"), false, "worker did not start"},
		{"another package", fmt.Sprintf(traceback, "scipy", "scipy"), false, "worker did not start"},
		{"a crash", "Segmentation fault", false, "worker did not start"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			py := fake(t, tc.stderr, 1)
			_, err := Start(context.Background(), Config{Python: py, KernelsRoot: t.TempDir(), Device: CPU, Log: zerolog.Nop()})
			var refused *RefusedError
			if errors.As(err, &refused) != tc.wantRefused {
				t.Fatalf("refused %v, want %v: %v", !tc.wantRefused, tc.wantRefused, err)
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantMsg) {
				t.Fatalf("got %v, want %q", err, tc.wantMsg)
			}
			if tc.wantRefused && !strings.Contains(err.Error(), py) {
				t.Errorf("%v does not name the interpreter %s", err, py)
			}
		})
	}
}

// A worker that says hello but could not import triton (or numpy) could
// run no job: Start refuses it, naming the interpreter and the import's
// error, unless the command only reports what the interpreter has.
func TestWorkerStartRefusesAHelloWithoutTriton(t *testing.T) {
	py := testpy.Python(t)
	shadow := t.TempDir() // a triton package that fails to import, ahead of the real one
	os.MkdirAll(filepath.Join(shadow, "triton"), 0o755)
	os.WriteFile(filepath.Join(shadow, "triton", "__init__.py"), []byte("raise ModuleNotFoundError(\"No module named 'triton'\")\n"), 0o644)
	env := append(os.Environ(), "PYTHONPATH="+shadow)
	_, err := Start(context.Background(), Config{Python: py, KernelsRoot: repoRoot(t), Device: CPU, Env: env, Log: zerolog.Nop()})
	var refused *RefusedError
	want := "cannot import triton (ModuleNotFoundError: No module named 'triton'), which workers need"
	if !errors.As(err, &refused) || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), py) {
		t.Fatalf("got %v, want a refusal saying %q", err, want)
	}
	w, err := Start(context.Background(), Config{Python: py, KernelsRoot: repoRoot(t), Device: CPU, Env: env, Log: zerolog.Nop(),
		AllowMissingPackages: true})
	if err != nil {
		t.Fatalf("with AllowMissingPackages: %v", err)
	}
	defer w.Close()
	if name, why := w.Hello().MissingPackage(); name != "triton" || !strings.Contains(why, "No module named 'triton'") {
		t.Errorf("MissingPackage() = %q, %q", name, why)
	}
}
