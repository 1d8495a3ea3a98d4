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
	"unsafe"

	"github.com/parquet-go/parquet-go"

	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/runner"
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

// The host killed with SIGKILL at seeded moments of every stage of a run,
// resumed each time: no finished job is lost or run twice, no worker
// outlives its host, no temporary file of an interrupted write survives a
// resume, and the results equal those of a run never interrupted. The
// moments are chosen by measured stage, so that every stage is hit whatever
// the machine's speed: a seeded share of the time the first worker took to
// be ready (start-up), a random time into a job (once after killing a
// worker first, so the job is retried), and the moment the host creates the
// temporary file of a manifest or results.parquet rewrite (watched with
// inotify), mid-run and at the end. One iteration also tries a second
// writer, which must be refused. Last, a kernel edited while the worker
// starts: every row names the sources it ran.
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
	runDir := func() string {
		d, _ := results.Latest(out, "crash")
		return d
	}
	journal := func() []results.Record {
		recs, _ := results.ReadJournal(runDir())
		return recs
	}
	journalLines := func() int {
		if runDir() == "" {
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

	// The stages, in an order that reaches each: a rewrite's kill needs the
	// run directory, and the last ones a run whose jobs are all done.
	type kill struct {
		stage string
		file  string // a rewrite's stage: the file rewritten
		nth   int    // and which of the host's rewrites of it
	}
	plan := []kill{
		{stage: "start-up"},
		{stage: "mid-job"},
		{stage: "manifest write", file: results.ManifestFile, nth: 1}, // the resume's own record
		{stage: "worker killed, then mid-job"},                        // one worker
		{stage: "mid-job, second writer refused"},
		{stage: "start-up"},
		{stage: "manifest write", file: results.ManifestFile, nth: 2},       // the versions of the first worker
		{stage: "results.parquet write", file: results.ParquetFile, nth: 1}, // at the end of the last jobs
		{stage: "manifest write", file: results.ManifestFile, nth: 2},       // the end, after results.parquet
		{stage: "results.parquet write", file: results.ParquetFile, nth: 1}, // a resume of the finished run
	}
	rng := rand.New(rand.NewPCG(20261123, 13))
	var journaled []results.Record
	landed := map[string]int{}
	tempsLeft := 0
	for i, k := range plan {
		n := i + 1
		cmd := exec.Command(bin, args(out)...)
		if k.stage == "worker killed, then mid-job" {
			// One worker: killing it stops the run until its replacement
			// retries the job, so the run is not over meanwhile.
			cmd = exec.Command(bin, argsWith(out, "1")...)
		}
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		var watch *createWatch
		if k.file != "" {
			if runDir() == "" {
				t.Fatalf("kill %d (%s): no run directory to watch", n, k.stage)
			}
			watch = watchCreate(t, runDir(), k.file+".tmp-", k.nth)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		exited := make(chan struct{})
		go func() { cmd.Wait(); close(exited) }()
		done := len(journaled)
		hit := true
		switch k.stage {
		case "start-up":
			// Once a worker process exists, its hello is at least its
			// imports away (over a second here; a share of the reference's
			// start-up, which was cold, on a faster machine).
			hit = waitUntil(exited, func() bool { return len(workersIn(root)) > 0 })
			time.Sleep(time.Duration(rng.Float64() * float64(min(ready, time.Second)) / 2))
		case "manifest write", "results.parquet write":
			hit = watch.kill(cmd.Process.Pid, exited)
		default:
			target := done + 1
			if k.stage == "worker killed, then mid-job" {
				// A job finished in this iteration: the workers are past
				// start-up (killing one during start-up is a failed start).
				waitUntil(exited, func() bool { return journalLines() > done })
				time.Sleep(time.Duration(rng.Float64() * jobSeconds * float64(time.Second)))
				if pids := workersIn(root); len(pids) > 0 {
					syscall.Kill(atoi(pids[0]), syscall.SIGKILL)
				}
				waitUntil(exited, retried)
				target = len(journal()) + 1
			}
			if k.stage == "mid-job, second writer refused" {
				// A second writer while this one runs is refused, by PID.
				waitUntil(exited, func() bool { return lockHolder(out) == cmd.Process.Pid })
				second := exec.Command(bin, args(out)...)
				output, _ := second.CombinedOutput()
				if !strings.Contains(string(output), fmt.Sprintf("is being written by workbench process %d", cmd.Process.Pid)) {
					t.Errorf("second writer during kill %d: %s", n, output)
				}
			}
			hit = waitUntil(exited, func() bool { return journalLines() >= target })
			time.Sleep(time.Duration(rng.Float64() * jobSeconds / 2 * float64(time.Second)))
		}
		cmd.Process.Signal(syscall.SIGKILL)
		<-exited
		if watch != nil {
			watch.close()
		}
		if k.stage == "start-up" && journalLines() > done {
			hit = false // a job finished: the start-up was over
		}
		if hit {
			landed[k.stage]++
		} else {
			t.Logf("kill %d (%s): the host ended first\n%s", n, k.stage, stderr.String())
		}

		deadline := time.Now().Add(5 * time.Second)
		for len(workersIn(root)) > 0 && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if left := workersIn(root); len(left) > 0 {
			t.Fatalf("kill %d: workers %v outlived their host", n, left)
		}
		rd := runDir()
		if rd == "" {
			if len(journaled) > 0 {
				t.Fatalf("kill %d: the run directory is gone", n)
			}
			t.Logf("kill %d (%s): no run directory yet", n, k.stage)
			continue // killed before any worker was ready: nothing was created
		}
		recs, err := results.ReadJournal(rd)
		if err != nil {
			t.Fatalf("kill %d: %v", n, err)
		}
		if len(recs) < len(journaled) || (len(journaled) > 0 && !reflect.DeepEqual(recs[:len(journaled)], journaled)) {
			t.Fatalf("kill %d: journaled jobs changed or were lost: %d before, %d now", n, len(journaled), len(recs))
		}
		journaled = recs
		// Rewrites are atomic: what readers open is whole.
		var m results.Manifest
		if data, err := os.ReadFile(filepath.Join(rd, results.ManifestFile)); err != nil || json.Unmarshal(data, &m) != nil {
			t.Fatalf("kill %d: manifest.json unreadable (%v): %.200s", n, err, data)
		}
		if _, err := os.Stat(filepath.Join(rd, results.ParquetFile)); err == nil {
			parquetRows(t, filepath.Join(rd, results.ParquetFile))
		}
		temps := tempFiles(rd)
		tempsLeft += len(temps)
		t.Logf("kill %d (%s): %d jobs journaled; temporary files left %v", n, k.stage, len(recs), temps)
	}
	for _, k := range plan {
		if landed[k.stage] == 0 {
			t.Errorf("no kill landed in stage %q (%v)", k.stage, landed)
		}
	}
	if tempsLeft == 0 {
		t.Error("no kill left a rewrite's temporary file: the kills at rewrites came too late to test their clean-up")
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
	var dirs []string
	for _, e := range runs {
		if e.IsDir() {
			dirs = append(dirs, e.Name())
		}
	}
	if len(dirs) != 1 {
		t.Errorf("run directories %v; every resume must continue the one run", dirs)
	}
	rd := runDir()
	if left := tempFiles(rd); len(left) > 0 {
		t.Errorf("temporary files %v survived the resumes", left)
	}
	recs, err := results.ReadJournal(rd)
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
	t.Logf("stages %v; %d jobs retried after their worker was killed; %d temporary files left by kills", landed, twice, tempsLeft)
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
	got := parquetRows(t, filepath.Join(rd, results.ParquetFile))
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

	editDuringStartUp(t, bin, py, dir)
}

// editDuringStartUp edits a method while the only worker starts: whether
// the edit lands before or after the worker reads the method, each row
// names the sources it ran (the edited ones for a row that failed with the
// edit's error), and the manifest the sources of its rows.
func editDuringStartUp(t *testing.T, bin, py, dir string) {
	root := copyKernels(t, filepath.Join(dir, "edit"))
	before, _ := runner.KernelsDigestOf(root)
	script := filepath.Join(dir, "edit.star")
	os.WriteFile(script, []byte(`experiment(
    name = "edit",
    methods = ["full", "streamingllm"],
    grid = {"budget": [0.5]},
    workloads = [workload(layers = 2, tokens_per_image = 32, text_tokens = 16, decode_steps = 4)],
)
`), 0o644)
	out := filepath.Join(dir, "edit-results")
	cmd := exec.Command(bin, "--python", py, "--kernels", root, "--device", "cpu", "run", "--workers", "1", "--out", out, script)
	var output bytes.Buffer
	cmd.Stdout, cmd.Stderr = &output, &output
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(time.Minute); len(workersIn(root)) == 0 && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	method := filepath.Join(root, "kernels_py", "methods", "streamingllm.py")
	f, err := os.OpenFile(method, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintln(f, "\nraise RuntimeError('streamingllm edited during start-up')")
	f.Close()
	edited, _ := runner.KernelsDigestOf(root)
	cmd.Wait() // jobs that fail make the command fail
	runDir, _ := results.Latest(out, "edit")
	recs, err := results.ReadJournal(runDir)
	if err != nil || len(recs) == 0 {
		t.Fatalf("edit during start-up: %d rows, %v\n%s", len(recs), err, output.String())
	}
	for _, r := range recs {
		wantDigest := before
		if strings.Contains(r.Error, "edited during start-up") {
			wantDigest = edited
		}
		if r.KernelsDigest != wantDigest {
			t.Errorf("edit during start-up: job %s (%s %.60q) names kernels %.12s; it ran %.12s (before the edit %.12s, after %.12s)",
				r.JobID, r.Status, r.Error, r.KernelsDigest, wantDigest, before, edited)
		}
	}
	data, _ := os.ReadFile(filepath.Join(runDir, results.ManifestFile))
	var m results.Manifest
	json.Unmarshal(data, &m)
	if current, _ := m.CurrentKernels(); current != recs[len(recs)-1].KernelsDigest {
		t.Errorf("edit during start-up: the manifest names kernels %.12s; its last row %.12s", current, recs[len(recs)-1].KernelsDigest)
	}
	t.Logf("edit during start-up: rows %s; manifest digest %.12s, %d code changes", ids(recs), m.KernelsDigest, len(m.CodeChanges))
}

func ids(recs []results.Record) string {
	var s []string
	for _, r := range recs {
		s = append(s, r.JobID+":"+r.Status+":"+r.KernelsDigest[:min(12, len(r.KernelsDigest))])
	}
	return strings.Join(s, " ")
}

// tempFiles lists what interrupted rewrites of the manifest or the table
// left in a run directory.
func tempFiles(dir string) []string {
	var temps []string
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		for _, base := range []string{results.ManifestFile, results.ParquetFile} {
			if strings.Contains(e.Name(), base+".tmp-") {
				temps = append(temps, e.Name())
			}
		}
	}
	return temps
}

// createWatch watches a directory for the creation of files whose name
// contains part (inotify), to kill a process the moment it creates the
// nth: mid-write, before its rename.
type createWatch struct {
	f    *os.File
	part string
	nth  int
}

func watchCreate(t *testing.T, dir, part string, nth int) *createWatch {
	t.Helper()
	fd, err := syscall.InotifyInit1(syscall.IN_NONBLOCK | syscall.IN_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := syscall.InotifyAddWatch(fd, dir, syscall.IN_CREATE); err != nil {
		syscall.Close(fd)
		t.Fatal(err)
	}
	return &createWatch{f: os.NewFile(uintptr(fd), "inotify"), part: part, nth: nth}
}

// kill sends SIGKILL to pid once the nth file is created; false if the
// process exited first.
func (w *createWatch) kill(pid int, exited <-chan struct{}) bool {
	hit := make(chan bool, 1)
	go func() {
		buf := make([]byte, 64<<10)
		seen := 0
		for {
			n, err := w.f.Read(buf)
			if err != nil {
				hit <- false
				return
			}
			for off := 0; off+syscall.SizeofInotifyEvent <= n; {
				ev := (*syscall.InotifyEvent)(unsafe.Pointer(&buf[off]))
				name := strings.TrimRight(string(buf[off+syscall.SizeofInotifyEvent:off+syscall.SizeofInotifyEvent+int(ev.Len)]), "\x00")
				off += syscall.SizeofInotifyEvent + int(ev.Len)
				if strings.Contains(name, w.part) {
					if seen++; seen == w.nth {
						syscall.Kill(pid, syscall.SIGKILL)
						hit <- true
						return
					}
				}
			}
		}
	}()
	select {
	case ok := <-hit:
		return ok
	case <-exited:
		select {
		case ok := <-hit: // killed it: the exit is the kill's
			return ok
		default:
			return false
		}
	}
}

func (w *createWatch) close() { w.f.Close() }
