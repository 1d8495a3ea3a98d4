package main

import (
	"bytes"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/parquet-go/parquet-go"

	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/testpy"
)

// The workbench binary, built once for the tests that need a process of
// their own (to kill it, or to give it a closed pipe).
var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if binPath != "" {
		os.RemoveAll(filepath.Dir(binPath))
	}
	os.Exit(code)
}

func workbenchBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "workbench-bin-")
		if err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(dir, "workbench")
		if out, err := exec.Command("go", "build", "-o", binPath, ".").CombinedOutput(); err != nil {
			buildErr = &buildError{err, out}
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binPath
}

type buildError struct {
	err error
	out []byte
}

func (e *buildError) Error() string { return "go build: " + e.err.Error() + "\n" + string(e.out) }

// A reader that goes away (workbench run ... | head) must not kill the
// command silently: it finishes, and says that its output was cut.
func TestClosedStdoutIsSurvived(t *testing.T) {
	bin := workbenchBinary(t)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	r.Close() // every write to w now fails with EPIPE
	cmd := exec.Command(bin, "plan", "../experiments/quickstart.star")
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = w, &stderr
	err = cmd.Run()
	w.Close()
	if err != nil || !strings.Contains(stderr.String(), "stdout was closed (broken pipe)") {
		t.Fatalf("plan into a closed pipe: %v (%v)\n%s", err, cmd.ProcessState, stderr.String())
	}
}

// copyKernels copies kernels_py into a fresh root, so that the processes of
// a test can be told apart from any other by their working directory.
func copyKernels(t *testing.T, dir string) string {
	t.Helper()
	root := filepath.Join(dir, "root")
	os.MkdirAll(root, 0o755)
	if out, err := exec.Command("cp", "-r", "../kernels_py", root).CombinedOutput(); err != nil {
		t.Fatalf("copy: %v %s", err, out)
	}
	return root
}

// workersIn lists the pids of processes running in dir: the workers of a
// kernels root.
func workersIn(dir string) []string {
	var pids []string
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		if cwd, err := os.Readlink(filepath.Join("/proc", e.Name(), "cwd")); err == nil && cwd == dir {
			pids = append(pids, e.Name())
		}
	}
	return pids
}

// parquetRows reads a results.parquet as rows by job id, without the
// columns that measure time.
func parquetRows(t *testing.T, path string) map[string]map[string]any {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	f, err := parquet.OpenFile(bytes.NewReader(data), int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	reader := parquet.NewReader(bytes.NewReader(data))
	defer reader.Close()
	rows := map[string]map[string]any{}
	for i := int64(0); i < f.NumRows(); i++ {
		row := map[string]any{}
		if err := reader.Read(&row); err != nil {
			t.Fatal(err)
		}
		for _, timing := range []string{"duration_seconds", "wall_seconds", "finished"} {
			delete(row, timing)
		}
		rows[row["job_id"].(string)] = row
	}
	return rows
}

// The host killed with SIGKILL at 20 seeded random moments, resumed each
// time: no finished job is lost or run twice, no worker outlives its host,
// and the results equal those of a run never interrupted.
func TestCrashInjection(t *testing.T) {
	py := testpy.Python(t)
	bin := workbenchBinary(t)
	dir := t.TempDir()
	root := copyKernels(t, dir)
	// Jobs that take a while, so that kills land inside them too.
	ablation := filepath.Join(root, "kernels_py", "ablation.py")
	f, _ := os.OpenFile(ablation, os.O_APPEND|os.O_WRONLY, 0)
	f.WriteString("\n_unslowed_run = run\n\ndef run(**kw):\n    import time\n    time.sleep(0.3)\n    return _unslowed_run(**kw)\n")
	f.Close()
	script := filepath.Join(dir, "crash.star")
	os.WriteFile(script, []byte(`experiment(
    name = "crash",
    methods = ["full", "h2o", "streamingllm", "snapkv"],
    grid = {"budget": [0.2, 0.5, 0.8]},
    workloads = [workload(layers = 2, tokens_per_image = 32, text_tokens = 16, decode_steps = 4)],
)
`), 0o644)
	args := func(out string) []string {
		return []string{"--python", py, "--kernels", root, "--device", "cpu", "--log-format", "json", "run", "--workers", "2", "--out", out, "--resume", script}
	}

	// The reference: one run, never interrupted.
	begin := time.Now()
	if out, err := exec.Command(bin, args(filepath.Join(dir, "reference"))...).CombinedOutput(); err != nil {
		t.Fatalf("uninterrupted run: %v\n%s", err, out)
	}
	whole := time.Since(begin)
	refDir, _ := results.Latest(filepath.Join(dir, "reference"), "crash")
	want := parquetRows(t, filepath.Join(refDir, results.ParquetFile))
	if len(want) != 10 {
		t.Fatalf("reference run: %d rows, want 10", len(want))
	}

	out := filepath.Join(dir, "results")
	rng := rand.New(rand.NewPCG(20261123, 13))
	var journaled []results.Record
	for kill := 1; kill <= 20; kill++ {
		cmd := exec.Command(bin, args(out)...)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		// Anywhere from before the plan is read to well into the jobs: most
		// kills land before the run would end, so the run advances by a few
		// jobs at a time and is killed at every stage.
		time.Sleep(time.Duration(rng.Float64() * 0.8 * float64(whole)))
		cmd.Process.Signal(syscall.SIGKILL)
		cmd.Wait()

		deadline := time.Now().Add(5 * time.Second)
		for len(workersIn(root)) > 0 && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if left := workersIn(root); len(left) > 0 {
			t.Fatalf("kill %d: workers %v outlived their host", kill, left)
		}
		runDir, _ := results.Latest(out, "crash")
		if runDir == "" {
			if len(journaled) > 0 {
				t.Fatalf("kill %d: the run directory is gone", kill)
			}
			continue // killed before any worker was ready: nothing was created
		}
		recs, err := results.ReadJournal(runDir)
		if err != nil {
			t.Fatalf("kill %d: %v", kill, err)
		}
		if len(recs) < len(journaled) || (len(journaled) > 0 && !reflect.DeepEqual(recs[:len(journaled)], journaled)) {
			t.Fatalf("kill %d: journaled jobs changed or were lost: %d before, %d now", kill, len(journaled), len(recs))
		}
		journaled = recs
		t.Logf("kill %d: %d jobs journaled", kill, len(recs))
	}

	final := exec.Command(bin, args(out)...)
	if output, err := final.CombinedOutput(); err != nil {
		t.Fatalf("final resume: %v\n%s", err, output)
	}
	runs, _ := os.ReadDir(filepath.Join(out, "crash"))
	if len(runs) != 1 {
		t.Errorf("%d run directories; every resume must continue the one run", len(runs))
	}
	runDir, _ := results.Latest(out, "crash")
	recs, err := results.ReadJournal(runDir)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]int{}
	for _, r := range recs {
		seen[r.JobID]++
	}
	var dups []string
	for id, n := range seen {
		if n > 1 {
			dups = append(dups, id)
		}
	}
	sort.Strings(dups)
	if len(recs) != 10 || len(seen) != 10 || len(dups) > 0 {
		t.Fatalf("%d journal lines for %d jobs (run twice: %v); want 10 and 10", len(recs), len(seen), dups)
	}
	got := parquetRows(t, filepath.Join(runDir, results.ParquetFile))
	if !reflect.DeepEqual(got, want) {
		for id := range want {
			if !reflect.DeepEqual(got[id], want[id]) {
				t.Errorf("job %s:\n got %v\nwant %v", id, got[id], want[id])
			}
		}
		t.Fatal("the resumed run's results differ from the uninterrupted run's")
	}
}
