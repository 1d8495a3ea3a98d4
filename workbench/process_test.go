package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"sort"
	"strconv"
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
	stopCluster()
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

// A reader that goes away (workbench plan ... | head) must not kill the
// command: it finishes quietly, as Unix tools do. (A run also says that its
// output was cut: see the final resume of TestCrashInjection.)
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
	if err != nil || stderr.Len() != 0 {
		t.Fatalf("plan into a closed pipe: %v (%v)\n%s", err, cmd.ProcessState, stderr.String())
	}
}

// copyKernels copies kernels_py into a fresh root, so that the processes of
// a test can be told apart from any other by their working directory.
// lockHolder is the PID that run.lock of the newest run names, if any.
func lockHolder(out string) int {
	runDir, _ := results.Latest(out, "crash")
	data, err := os.ReadFile(filepath.Join(runDir, results.LockFile))
	if err != nil {
		return 0
	}
	var h results.Holder
	json.Unmarshal(data, &h)
	return h.PID
}

func atoi(s string) int {
	n, _ := strconv.Atoi(s)
	return n
}

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
// and the results equal those of a run never interrupted. The moments are
// chosen by stage, so that every stage is hit whatever the machine's speed:
// before the first worker is ready, a random time into a job (some after
// killing a worker first, so the job is retried), and after the last job
// (while results.parquet and the manifest are written). One iteration also
// tries a second writer, which must be refused.
func TestCrashInjection(t *testing.T) {
	py := testpy.Python(t)
	bin := workbenchBinary(t)
	dir := t.TempDir()
	root := copyKernels(t, dir)
	// Jobs that take a while, so that kills land inside them too.
	const jobSeconds = 0.3
	ablation := filepath.Join(root, "kernels_py", "ablation.py")
	f, _ := os.OpenFile(ablation, os.O_APPEND|os.O_WRONLY, 0)
	fmt.Fprintf(f, "\n_unslowed_run = run\n\ndef run(**kw):\n    import time\n    time.sleep(%g)\n    return _unslowed_run(**kw)\n", jobSeconds)
	f.Close()
	script := filepath.Join(dir, "crash.star")
	os.WriteFile(script, []byte(`experiment(
    name = "crash",
    methods = ["full", "h2o", "streamingllm", "snapkv"],
    grid = {"budget": [0.2, 0.35, 0.5, 0.65, 0.8]},
    workloads = [workload(layers = 2, tokens_per_image = 32, text_tokens = 16, decode_steps = 4)],
)
`), 0o644)
	const jobs = 16
	argsWith := func(out, workers string) []string {
		return []string{"--python", py, "--kernels", root, "--device", "cpu", "--log-format", "json", "run", "--workers", workers, "--out", out, "--resume", script}
	}
	args := func(out string) []string { return argsWith(out, "2") }
	out := filepath.Join(dir, "results")
	journal := func() []results.Record {
		runDir, _ := results.Latest(out, "crash")
		recs, _ := results.ReadJournal(runDir)
		return recs
	}
	journalLines := func() int {
		if runDir, _ := results.Latest(out, "crash"); runDir == "" {
			return -1 // no run directory yet
		}
		return len(journal())
	}
	retried := func() bool {
		for _, r := range journal() {
			if r.Attempts > 1 {
				return true
			}
		}
		return false
	}
	// waitUntil polls cond until it holds or the host exits; false if it exited.
	waitUntil := func(exited <-chan struct{}, cond func() bool) bool {
		for !cond() {
			select {
			case <-exited:
				return false
			case <-time.After(10 * time.Millisecond):
			}
		}
		return true
	}

	// The reference: one run, never interrupted, timed to the first worker.
	ref := exec.Command(bin, args(filepath.Join(dir, "reference"))...)
	var refOut bytes.Buffer
	ref.Stdout, ref.Stderr = &refOut, &refOut
	begin := time.Now()
	if err := ref.Start(); err != nil {
		t.Fatal(err)
	}
	var ready time.Duration
	for ready == 0 && time.Since(begin) < 2*time.Minute {
		if d, _ := results.Latest(filepath.Join(dir, "reference"), "crash"); d != "" {
			ready = time.Since(begin)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := ref.Wait(); err != nil {
		t.Fatalf("uninterrupted run: %v\n%s", err, refOut.String())
	}
	refDir, _ := results.Latest(filepath.Join(dir, "reference"), "crash")
	want := parquetRows(t, filepath.Join(refDir, results.ParquetFile))
	if len(want) != jobs {
		t.Fatalf("reference run: %d rows, want %d", len(want), jobs)
	}

	rng := rand.New(rand.NewPCG(20261123, 13))
	var journaled []results.Record
	stages := map[string]int{}
	for kill := 1; kill <= 20; kill++ {
		cmd := exec.Command(bin, args(out)...)
		if kill == 3 {
			// One worker: killing it stops the run until its replacement
			// retries the job, so the run is not over meanwhile.
			cmd = exec.Command(bin, argsWith(out, "1")...)
		}
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		exited := make(chan struct{})
		go func() { cmd.Wait(); close(exited) }()
		done := len(journaled)
		stage := "start-up"
		switch u := rng.Float64(); {
		case done == jobs || kill == 20:
			// The jobs are done (or this is the last chance): kill while the
			// results are written.
			stage = "results"
			waitUntil(exited, func() bool { return journalLines() == jobs })
			time.Sleep(time.Duration(rng.Float64() * 50 * float64(time.Millisecond)))
		case u < 0.2 && kill != 3 && kill != 5:
			time.Sleep(time.Duration(rng.Float64() * float64(ready)))
		default:
			stage = "mid-job"
			target := done + 1
			if kill == 3 {
				// Kill a worker first: its job is retried on a fresh one, and
				// journaled with two attempts.
				stage = "worker killed, then mid-job"
				// A job finished in this iteration: the workers are past
				// start-up (killing one during start-up is a failed start).
				waitUntil(exited, func() bool { return journalLines() > done })
				time.Sleep(time.Duration(rng.Float64() * jobSeconds * float64(time.Second)))
				if pids := workersIn(root); len(pids) > 0 {
					syscall.Kill(atoi(pids[0]), syscall.SIGKILL)
				}
				waitUntil(exited, retried)
				target = len(journal()) + 1
				if pids := workersIn(root); len(pids) == 0 {
					t.Logf("kill %d: no worker to kill", kill)
				}
			}
			if kill == 5 {
				// A second writer while this one runs is refused, by PID.
				waitUntil(exited, func() bool { return lockHolder(out) == cmd.Process.Pid })
				second := exec.Command(bin, args(out)...)
				output, _ := second.CombinedOutput()
				if !strings.Contains(string(output), fmt.Sprintf("is being written by workbench process %d", cmd.Process.Pid)) {
					t.Errorf("second writer during kill %d: %s", kill, output)
				}
			}
			waitUntil(exited, func() bool { return journalLines() >= target })
			time.Sleep(time.Duration(rng.Float64() * jobSeconds / 2 * float64(time.Second)))
		}
		stages[stage]++
		cmd.Process.Signal(syscall.SIGKILL)
		<-exited

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
		t.Logf("kill %d (%s): %d jobs journaled", kill, stage, len(recs))
	}
	for _, stage := range []string{"start-up", "mid-job", "worker killed, then mid-job", "results"} {
		if stages[stage] == 0 {
			t.Errorf("no kill landed in stage %q (%v)", stage, stages)
		}
	}

	// The last resume prints into a closed pipe (run ... | head): it finishes
	// the run all the same, and says its output was cut.
	final := exec.Command(bin, args(out)...)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	var finalErr bytes.Buffer
	final.Stdout, final.Stderr = w, &finalErr
	err = final.Run()
	w.Close()
	if err != nil || !strings.Contains(finalErr.String(), "stdout was closed (broken pipe)") {
		t.Fatalf("final resume into a closed pipe: %v\n%s", err, finalErr.String())
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
	twice := 0
	for _, r := range recs {
		if r.Attempts > 1 {
			twice++
		}
	}
	if twice == 0 {
		t.Error("no job was journaled as retried after its worker was killed")
	}
	t.Logf("stages %v; %d jobs retried after their worker was killed", stages, twice)
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
	if len(recs) != jobs || len(seen) != jobs || len(dups) > 0 {
		t.Fatalf("%d journal lines for %d jobs (run twice: %v); want %d and %d", len(recs), len(seen), dups, jobs, jobs)
	}
	got := parquetRows(t, filepath.Join(runDir, results.ParquetFile))
	for _, rows := range []map[string]map[string]any{got, want} {
		for _, row := range rows {
			delete(row, "attempts") // a job whose worker was killed ran twice: same result
		}
	}
	if !reflect.DeepEqual(got, want) {
		for id := range want {
			if !reflect.DeepEqual(got[id], want[id]) {
				t.Errorf("job %s:\n got %v\nwant %v", id, got[id], want[id])
			}
		}
		t.Fatal("the resumed run's results differ from the uninterrupted run's")
	}
}
