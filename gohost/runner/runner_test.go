package runner

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/results/resultstest"
	"github.com/vlkv/vlkv/gohost/sched"
	"github.com/vlkv/vlkv/gohost/testpy"
	"github.com/vlkv/vlkv/gohost/worker"
)

// fakeExecutor runs jobs in order without Python, keeping the contract sched
// keeps for Local: Started before any job, Done once per job, stop at the
// first error from Done, and when ctx ends abandon the rest and return ctx's
// error.
type fakeExecutor struct {
	fail  map[string]error // jobs that fail, by id; the others return metrics
	hello *worker.Hello    // passed to Started when set
	// after, if set, runs after each reported job with their count so far.
	after func(n int)
	ran   []string // ids of the jobs run, over every batch
	dirs  []string // the run directory of every batch
}

func (f *fakeExecutor) Run(ctx context.Context, b Batch) error {
	f.dirs = append(f.dirs, b.Dir)
	if f.hello != nil && b.Started != nil && len(b.Jobs) > 0 {
		b.Started(*f.hello)
	}
	for i, j := range b.Jobs {
		if err := ctx.Err(); err != nil {
			return err
		}
		f.ran = append(f.ran, j.ID)
		out := Outcome{Outcome: sched.Outcome{Job: j, Attempts: 1, Duration: time.Millisecond, Wall: 3 * time.Millisecond}}
		if err := f.fail[j.ID]; err != nil {
			out.Err = err
		} else {
			out.Result = json.RawMessage(fmt.Sprintf(`{"metrics": {"index": %d}}`, i))
		}
		if err := b.Done(out); err != nil {
			return err
		}
		if f.after != nil {
			f.after(i + 1)
		}
	}
	return ctx.Err()
}

func testJobs(ids ...string) []Job {
	jobs := make([]Job, len(ids))
	for i, id := range ids {
		jobs[i] = Job{
			Job:    sched.Job{ID: id, Label: "h2o budget=0." + id},
			Method: "h2o", Params: map[string]any{"budget": 0.5}, Workload: map[string]any{"layers": 2.0},
		}
	}
	return jobs
}

// testOptions runs jobs into a fresh results root, with a kernels root of
// one source file.
func testOptions(t *testing.T, ex Executor, jobs []Job) Options {
	t.Helper()
	kernels := t.TempDir()
	if err := os.MkdirAll(filepath.Join(kernels, "kernels_py"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(kernels, "kernels_py", "method.py"), []byte("x = 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return Options{
		Out: t.TempDir(), Experiment: "exp", File: "exp.star", FileHash: "hash1", Jobs: jobs,
		KernelsDir: kernels, Device: "cpu", Version: "1.2.3",
		Executor: ex, Progress: &bytes.Buffer{}, Log: zerolog.Nop(),
	}
}

func journal(t *testing.T, dir string) []results.Record {
	t.Helper()
	recs, err := results.ReadJournal(dir)
	if err != nil {
		t.Fatal(err)
	}
	return recs
}

func ids(recs []results.Record) []string {
	var out []string
	for _, r := range recs {
		out = append(out, r.JobID+":"+r.Status)
	}
	return out
}

func manifest(t *testing.T, dir string) results.Manifest {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, results.ManifestFile))
	if err != nil {
		t.Fatal(err)
	}
	var m results.Manifest
	if err := json.Unmarshal(data, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

func TestFreshRunJournalsEveryJob(t *testing.T) {
	torch := "2.5.0"
	hello := &worker.Hello{}
	hello.Python.Version = "3.12.1"
	hello.Torch.Version = &torch
	hello.Device.Names = []string{"Fake GPU"}
	ex := &fakeExecutor{hello: hello}
	o := testOptions(t, ex, testJobs("a", "b", "c"))
	progress := o.Progress.(*bytes.Buffer)

	sum, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Dir(sum.Dir) != filepath.Join(o.Out, "exp") || sum.Rows != 3 || sum.Failed != 0 || !sum.Ended {
		t.Errorf("summary %+v", sum)
	}
	if !reflect.DeepEqual(ex.dirs, []string{sum.Dir}) {
		t.Errorf("executor ran in %v, want %s", ex.dirs, sum.Dir)
	}
	recs := journal(t, sum.Dir)
	if got := ids(recs); !reflect.DeepEqual(got, []string{"a:ok", "b:ok", "c:ok"}) {
		t.Fatalf("journal %v", got)
	}
	r := recs[1]
	if r.Experiment != "exp" || r.Method != "h2o" || r.Params["budget"] != 0.5 || r.Workload["layers"] != 2.0 ||
		r.Metrics["index"] != 1.0 || r.Attempts != 1 || r.Seconds != 0.001 || r.WallSeconds != 0.003 || len(r.KernelsDigest) != 64 {
		t.Errorf("record %+v", r)
	}
	if _, err := os.Stat(filepath.Join(sum.Dir, results.ParquetFile)); err != nil {
		t.Error(err)
	}
	m := manifest(t, sum.Dir)
	if m.Experiment != "exp" || m.File != "exp.star" || m.FileHash != "hash1" || m.Jobs != 3 || m.Ended == nil || m.Resumed != nil {
		t.Errorf("manifest %+v", m)
	}
	if m.Device != "cpu (Fake GPU)" || m.Versions["workbench"] != "1.2.3" || m.Versions["go"] == "" ||
		m.Versions["python"] != "3.12.1" || m.Versions["torch"] != "2.5.0" {
		t.Errorf("manifest device %q, versions %v", m.Device, m.Versions)
	}
	if len(m.KernelsHash) != 1 || len(m.KernelsHash["method.py"]) != 64 || m.KernelsDigest != r.KernelsDigest {
		t.Errorf("kernels hashes %v", m.KernelsHash)
	}
	if !strings.Contains(progress.String(), "[3/3] c h2o budget=0.c (1ms) ok\n") {
		t.Errorf("progress:\n%s", progress)
	}

	// A resume's worker names the same device: the manifest says it once.
	o.Jobs, o.Resume = testJobs("a", "b", "c", "d"), true
	if _, err := Run(context.Background(), o); err != nil {
		t.Fatal(err)
	}
	if m := manifest(t, sum.Dir); m.Device != "cpu (Fake GPU)" {
		t.Errorf("manifest device after a resume %q", m.Device)
	}
}

// Resuming reruns what the journal lacks, and with RetryFailed what it
// has as failed; without Resume every job runs again in a new run. A
// failure left from before the resume still counts: the run did not
// succeed.
func TestResume(t *testing.T) {
	tests := []struct {
		name             string
		resume           bool
		retryFailed      bool
		wantRan          []string
		wantJournal      []string
		wantFailed       int
		wantFailedBefore int
	}{
		{"resume", true, false, []string{"d"}, []string{"a:ok", "b:failed", "c:ok", "d:ok"}, 1, 1},
		{"resume and retry failed", true, true, []string{"b", "d"}, []string{"a:ok", "b:failed", "c:ok", "b:ok", "d:ok"}, 0, 0},
		{"new run", false, false, []string{"a", "b", "c", "d"}, []string{"a:ok", "b:ok", "c:ok", "d:ok"}, 0, 0},
		{"retry failed without resume", false, true, []string{"a", "b", "c", "d"}, []string{"a:ok", "b:ok", "c:ok", "d:ok"}, 0, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			first := &fakeExecutor{fail: map[string]error{"b": errors.New("out of memory")}}
			o := testOptions(t, first, testJobs("a", "b", "c"))
			sum1, err := Run(context.Background(), o)
			if err != nil || sum1.Failed != 1 {
				t.Fatalf("first run: %+v, %v", sum1, err)
			}

			second := &fakeExecutor{}
			o.Executor, o.Jobs, o.Resume, o.RetryFailed = second, testJobs("a", "b", "c", "d"), tc.resume, tc.retryFailed
			sum, err := Run(context.Background(), o)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(second.ran, tc.wantRan) {
				t.Errorf("ran %v, want %v", second.ran, tc.wantRan)
			}
			if (sum.Dir == sum1.Dir) != tc.resume {
				t.Errorf("second run in %s, first in %s; resume %v", sum.Dir, sum1.Dir, tc.resume)
			}
			if got := ids(journal(t, sum.Dir)); !reflect.DeepEqual(got, tc.wantJournal) {
				t.Errorf("journal %v, want %v", got, tc.wantJournal)
			}
			if sum.Rows != 4 || sum.Done != 4 || sum.Failed != tc.wantFailed || sum.FailedBefore != tc.wantFailedBefore || !sum.Ended {
				t.Errorf("summary %+v, want %d failed, %d of them before", sum, tc.wantFailed, tc.wantFailedBefore)
			}
			m := manifest(t, sum.Dir)
			if m.Jobs != 4 || m.Ended == nil || (len(m.Resumed) == 1) != tc.resume {
				t.Errorf("manifest: jobs %d, ended %v, resumed %v", m.Jobs, m.Ended, m.Resumed)
			}
		})
	}
}

func TestResumeWarnsWhenTheScriptChanged(t *testing.T) {
	o := testOptions(t, &fakeExecutor{}, testJobs("a"))
	if _, err := Run(context.Background(), o); err != nil {
		t.Fatal(err)
	}
	var log bytes.Buffer
	o.Resume, o.FileHash, o.Log = true, "hash2", zerolog.New(&log)
	if _, err := Run(context.Background(), o); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(log.String(), "the script changed since this run's last start") {
		t.Errorf("log:\n%s", log.String())
	}
}

// A run whose journal is gone but whose table has rows is not resumed:
// that would run its jobs again and rebuild the table without them.
func TestResumeRefusesARunThatLostItsJournal(t *testing.T) {
	o := testOptions(t, &fakeExecutor{}, testJobs("a", "b"))
	sum, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	table := filepath.Join(sum.Dir, results.ParquetFile)
	before, err := os.ReadFile(table)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(sum.Dir, results.JournalFile)); err != nil {
		t.Fatal(err)
	}
	again := &fakeExecutor{}
	o.Executor, o.Resume = again, true
	_, err = Run(context.Background(), o)
	if err == nil || !strings.Contains(err.Error(), "has 2 rows but its journal.jsonl only 0 finished jobs") ||
		!strings.Contains(err.Error(), "start a new run without --resume") {
		t.Fatalf("resume without a journal: %v", err)
	}
	if len(again.ran) != 0 {
		t.Errorf("ran %v", again.ran)
	}
	if after, err := os.ReadFile(table); err != nil || !bytes.Equal(after, before) {
		t.Errorf("the table changed (%v)", err)
	}
	// Nor is a journal left behind: an empty one would hide the table from compare, which reads a run's
	// results.parquet only where it has no journal.
	if _, err := os.Stat(filepath.Join(sum.Dir, results.JournalFile)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the refused resume left a %s (%v)", results.JournalFile, err)
	}
}

// A run of another experiment in this one's folder (copied or moved there)
// is not resumed: its rows and this experiment's would mix in one run.
func TestResumeRefusesARunOfAnotherExperiment(t *testing.T) {
	o := testOptions(t, &fakeExecutor{}, testJobs("a", "b"))
	o.Experiment = "other"
	sum, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	folder := filepath.Join(o.Out, "mine")
	if err := os.MkdirAll(folder, 0o755); err != nil {
		t.Fatal(err)
	}
	moved := filepath.Join(folder, filepath.Base(sum.Dir))
	if err := os.Rename(sum.Dir, moved); err != nil {
		t.Fatal(err)
	}
	before := resultstest.Snapshot(t, moved)
	again := &fakeExecutor{}
	o.Experiment, o.Executor, o.Resume, o.Jobs = "mine", again, true, testJobs("c")
	_, err = Run(context.Background(), o)
	if err == nil || !strings.Contains(err.Error(), "it is a run of experiment other, not mine") {
		t.Fatalf("resume of another experiment's run: %v", err)
	}
	if len(again.ran) != 0 {
		t.Errorf("ran %v", again.ran)
	}
	if after := resultstest.Snapshot(t, moved); !maps.Equal(after, before) {
		t.Errorf("the refused resume changed the run")
	}
}

func TestResumeWithoutRunStartsOne(t *testing.T) {
	ex := &fakeExecutor{}
	o := testOptions(t, ex, testJobs("a", "b"))
	o.Resume = true
	sum, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	if len(ex.ran) != 2 || sum.Rows != 2 || manifest(t, sum.Dir).Resumed != nil {
		t.Errorf("ran %v, summary %+v", ex.ran, sum)
	}
}

// A failed job is journaled as failed and counted; the run goes on and ends
// without an error (saying jobs failed is the caller's business).
func TestFailedJobCountsAndRunGoesOn(t *testing.T) {
	ex := &fakeExecutor{fail: map[string]error{"b": &worker.JobError{Type: "ValueError", Message: "bad budget", Traceback: "Traceback ...\nValueError: bad budget"}}}
	var log bytes.Buffer
	o := testOptions(t, ex, testJobs("a", "b", "c"))
	o.Log = zerolog.New(&log)
	sum, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	if sum.Failed != 1 || sum.Rows != 3 || !sum.Ended {
		t.Errorf("summary %+v", sum)
	}
	recs := journal(t, sum.Dir)
	if got := ids(recs); !reflect.DeepEqual(got, []string{"a:ok", "b:failed", "c:ok"}) {
		t.Fatalf("journal %v", got)
	}
	if recs[1].Error != "ValueError: bad budget" || recs[1].Extra["traceback"] != "Traceback ...\nValueError: bad budget" {
		t.Errorf("failed record: error %q, extra %v", recs[1].Error, recs[1].Extra)
	}
	if !strings.Contains(log.String(), `"job":"b","error":"ValueError: bad budget","message":"job failed"`) {
		t.Errorf("log:\n%s", log.String())
	}
	if !strings.Contains(o.Progress.(*bytes.Buffer).String(), "[2/3] b h2o budget=0.b (1ms) FAILED: ValueError: bad budget") {
		t.Errorf("progress:\n%s", o.Progress)
	}
}

// Cancelling keeps the jobs journaled so far and says how to go on; a
// resume then runs only the rest.
func TestCancelKeepsFinishedJobs(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ex := &fakeExecutor{after: func(n int) {
		if n == 2 {
			cancel()
		}
	}}
	o := testOptions(t, ex, testJobs("a", "b", "c", "d"))
	o.Continue = "workbench run exp.star --out " + o.Out + " --resume"
	sum, err := Run(ctx, o)
	want := fmt.Sprintf("interrupted: 2 of 4 jobs are done in %s; continue with: workbench run exp.star --out %s --resume", sum.Dir, o.Out)
	if err == nil || err.Error() != want {
		t.Fatalf("got %v, want %q", err, want)
	}
	if !errors.Is(err, context.Canceled) {
		t.Error("the error does not unwrap to context.Canceled")
	}
	if sum.Rows != 2 || sum.Ended {
		t.Errorf("summary %+v", sum)
	}
	if got := ids(journal(t, sum.Dir)); !reflect.DeepEqual(got, []string{"a:ok", "b:ok"}) {
		t.Errorf("journal %v", got)
	}
	if _, err := os.Stat(filepath.Join(sum.Dir, results.ParquetFile)); err != nil {
		t.Errorf("no results.parquet for the finished jobs: %v", err)
	}
	if m := manifest(t, sum.Dir); m.Ended != nil {
		t.Errorf("an interrupted run's manifest has an end: %v", m.Ended)
	}

	rest := &fakeExecutor{}
	o.Executor, o.Resume = rest, true
	sum2, err := Run(context.Background(), o)
	if err != nil || sum2.Dir != sum.Dir || sum2.Rows != 4 || !reflect.DeepEqual(rest.ran, []string{"c", "d"}) {
		t.Errorf("resume: %+v, %v, ran %v", sum2, err, rest.ran)
	}
}

// An error from done (the journal cannot be written) stops the run with that
// error, not as an interruption, and the run has no end.
func TestJournalErrorStopsRun(t *testing.T) {
	jobs := testJobs("a", "b", "c")
	jobs[1].Params = map[string]any{"budget": math.NaN()} // no JSON for it
	ex := &fakeExecutor{}
	o := testOptions(t, ex, jobs)
	sum, err := Run(context.Background(), o)
	if err == nil || !strings.HasPrefix(err.Error(), "journal job b: ") || strings.Contains(err.Error(), "interrupted") {
		t.Fatalf("got %v, want the journal's error", err)
	}
	if !reflect.DeepEqual(ex.ran, []string{"a", "b"}) {
		t.Errorf("ran %v: the run went on after the journal failed", ex.ran)
	}
	if got := ids(journal(t, sum.Dir)); !reflect.DeepEqual(got, []string{"a:ok"}) {
		t.Errorf("journal %v", got)
	}
	if sum.Ended || manifest(t, sum.Dir).Ended != nil {
		t.Errorf("a run stopped by an error has an end: %+v", sum)
	}
}

// An executor error is returned as it is.
func TestExecutorErrorIsReturned(t *testing.T) {
	boom := errors.New("journal disk gone")
	o := testOptions(t, executorFunc(func(context.Context, Batch) error { return boom }), testJobs("a"))
	sum, err := Run(context.Background(), o)
	if err != boom || sum.Ended {
		t.Errorf("got %+v, %v", sum, err)
	}
}

// A run where no worker ever starts (a Python without torch, no GPU) leaves
// no run directory behind for notebooks or --resume to pick up.
func TestNoWorkerLeavesNoRunDirectory(t *testing.T) {
	noWorker := &sched.NoWorkerError{Tries: 3, NotRun: 1, Err: errors.New("worker died and printed nothing")}
	o := testOptions(t, executorFunc(func(context.Context, Batch) error { return noWorker }), testJobs("a"))
	sum, err := Run(context.Background(), o)
	if !errors.Is(err, noWorker) || !strings.Contains(err.Error(), "No run directory was created") || sum.Dir != "" {
		t.Fatalf("got %v", err)
	}
	if entries, _ := os.ReadDir(o.Out); len(entries) != 0 {
		t.Errorf("%s holds %d entries after a run that never started", o.Out, len(entries))
	}
}

// When workers stop starting midway, the message says how far the run got
// and how to go on.
func TestNoWorkerMidRunSaysHowToResume(t *testing.T) {
	ex := executorFunc(func(ctx context.Context, b Batch) error {
		b.Done(Outcome{Outcome: sched.Outcome{Job: b.Jobs[0], Attempts: 1, Result: json.RawMessage(`{"metrics": {"x": 1}}`)}})
		return &sched.NoWorkerError{Tries: 3, NotRun: 2, Err: errors.New("killed")}
	})
	o := testOptions(t, ex, testJobs("a", "b", "c"))
	o.Continue = "workbench run exp.star --out results --resume"
	sum, err := Run(context.Background(), o)
	if err == nil || !strings.Contains(err.Error(), "1 of 3 jobs are done in "+sum.Dir) || !strings.Contains(err.Error(), "continue with: "+o.Continue) {
		t.Fatalf("got %v", err)
	}
	if got := ids(journal(t, sum.Dir)); !reflect.DeepEqual(got, []string{"a:ok"}) {
		t.Errorf("journal %v", got)
	}
}

// A run whose files cannot be written (a full disk) stops, saying how far it
// got and the command that continues it once the cause is fixed; an error of
// another kind is returned as it is.
func TestWriteErrorSaysHowToResume(t *testing.T) {
	tests := []struct {
		name     string
		err      func(dir string) error
		wantHint bool
	}{
		{"disk full", func(dir string) error {
			return fmt.Errorf("journal job b: %w", &fs.PathError{Op: "write", Path: filepath.Join(dir, results.JournalFile), Err: syscall.ENOSPC})
		}, true},
		{"read-only file system", func(dir string) error {
			return fmt.Errorf("journal job b: %w", &fs.PathError{Op: "open", Path: filepath.Join(dir, results.JournalFile), Err: syscall.EROFS})
		}, true},
		{"a missing file (no write could cure it)", func(dir string) error {
			return fmt.Errorf("journal job b: %w", &fs.PathError{Op: "open", Path: filepath.Join(dir, "gone"), Err: syscall.ENOENT})
		}, false},
		{"another error", func(string) error { return errors.New("journal job b: json: unsupported value: NaN") }, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var want error
			ex := executorFunc(func(ctx context.Context, b Batch) error {
				if err := b.Done(Outcome{Outcome: sched.Outcome{Job: b.Jobs[0], Attempts: 1, Result: json.RawMessage(`{"metrics": {"x": 1}}`)}}); err != nil {
					return err
				}
				want = tc.err(b.Dir)
				return want
			})
			o := testOptions(t, ex, testJobs("a", "b", "c"))
			o.Continue = "workbench run exp.star --out results --resume"
			sum, err := Run(context.Background(), o)
			if !errors.Is(err, want) || !strings.HasPrefix(err.Error(), "journal job b: ") {
				t.Fatalf("got %v, want it to wrap %v", err, want)
			}
			hint := "1 of 3 jobs are done in " + sum.Dir + "; once " + filepath.Join(sum.Dir, results.JournalFile) +
				" can be written again (free space, permissions), continue with: " + o.Continue
			if got := strings.Contains(err.Error(), hint); got != tc.wantHint {
				t.Fatalf("hint %v, want %v: %v", got, tc.wantHint, err)
			}
			if got := ids(journal(t, sum.Dir)); !reflect.DeepEqual(got, []string{"a:ok"}) {
				t.Errorf("journal %v", got)
			}
		})
	}
}

// A second writer on a run directory is refused, naming the holder's PID.
func TestSecondWriterIsRefused(t *testing.T) {
	var second error
	o := testOptions(t, nil, testJobs("a", "b"))
	o.Executor = executorFunc(func(ctx context.Context, b Batch) error {
		if err := b.Done(Outcome{Outcome: sched.Outcome{Job: b.Jobs[0], Attempts: 1, Result: json.RawMessage(`{"metrics": {"x": 1}}`)}}); err != nil {
			return err
		}
		other := o
		other.Resume, other.Executor = true, &fakeExecutor{}
		_, second = Run(ctx, other)
		return b.Done(Outcome{Outcome: sched.Outcome{Job: b.Jobs[1], Attempts: 1, Result: json.RawMessage(`{"metrics": {"x": 2}}`)}})
	})
	sum, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	var le *results.LockedError
	if !errors.As(second, &le) || le.Holder.PID != os.Getpid() || !strings.Contains(second.Error(), fmt.Sprint(os.Getpid())) {
		t.Fatalf("second writer: %v", second)
	}
	if got := ids(journal(t, sum.Dir)); !reflect.DeepEqual(got, []string{"a:ok", "b:ok"}) {
		t.Errorf("journal %v", got)
	}
}

// Resuming after an edit under kernels_py/ is refused with both digests and
// the changed file, unless allowed; then rows carry their own digest and the
// manifest records the change.
func TestResumeAfterKernelEdit(t *testing.T) {
	o := testOptions(t, &fakeExecutor{}, testJobs("a"))
	sum1, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	before := manifest(t, sum1.Dir).KernelsDigest
	os.WriteFile(filepath.Join(o.KernelsDir, "kernels_py", "method.py"), []byte("x = 2\n"), 0o644)
	os.MkdirAll(filepath.Join(o.KernelsDir, "kernels_py", "tests"), 0o755)
	os.WriteFile(filepath.Join(o.KernelsDir, "kernels_py", "tests", "test_x.py"), []byte("y = 1\n"), 0o644)

	ex := &fakeExecutor{}
	o.Executor, o.Jobs, o.Resume = ex, testJobs("a", "b"), true
	_, err = Run(context.Background(), o)
	var ce *CodeChangedError
	if !errors.As(err, &ce) || ce.Recorded != before || ce.Now == before || !reflect.DeepEqual(ce.Changed, []string{"method.py"}) ||
		!strings.Contains(err.Error(), before[:12]) || !strings.Contains(err.Error(), ce.Now[:12]) || !strings.Contains(err.Error(), "--allow-code-change") {
		t.Fatalf("got %v", err)
	}
	if len(ex.ran) != 0 || len(journal(t, sum1.Dir)) != 1 {
		t.Fatalf("a refused resume ran %v", ex.ran)
	}
	if m := manifest(t, sum1.Dir); m.Ended == nil || m.Jobs != 1 || m.Resumed != nil {
		t.Fatalf("a refused resume changed the manifest: ended %v, jobs %d, resumed %v", m.Ended, m.Jobs, m.Resumed)
	}

	o.AllowCodeChange = true
	if _, err := Run(context.Background(), o); err != nil {
		t.Fatal(err)
	}
	recs := journal(t, sum1.Dir)
	m := manifest(t, sum1.Dir)
	if len(recs) != 2 || recs[0].KernelsDigest != before || recs[1].KernelsDigest != ce.Now {
		t.Errorf("rows' digests %q, %q", recs[0].KernelsDigest, recs[1].KernelsDigest)
	}
	if m.KernelsDigest != before || len(m.CodeChanges) != 1 || m.CodeChanges[0].KernelsDigest != ce.Now ||
		!reflect.DeepEqual(m.CodeChanges[0].Changed, []string{"method.py"}) {
		t.Errorf("manifest digest %q, changes %+v", m.KernelsDigest, m.CodeChanges)
	}

	// The new digest is now the run's: resuming again on it needs no flag.
	o.AllowCodeChange, o.Jobs = false, testJobs("a", "b", "c")
	if _, err := Run(context.Background(), o); err != nil {
		t.Fatal(err)
	}
}

type executorFunc func(context.Context, Batch) error

func (f executorFunc) Run(ctx context.Context, b Batch) error { return f(ctx, b) }

func TestRecord(t *testing.T) {
	saved := func(paths map[string]string, err error) func() (map[string]string, error) {
		return func() (map[string]string, error) { return paths, err }
	}
	tests := []struct {
		name   string
		out    Outcome
		status string
		err    string
		extra  map[string]any
	}{
		{"metrics", Outcome{Outcome: sched.Outcome{Result: json.RawMessage(`{"metrics": {"x": 1}}`)}}, "ok", "", nil},
		{"per layer", Outcome{Outcome: sched.Outcome{Result: json.RawMessage(`{"metrics": {"x": 1}, "per_layer": {"err": [1, 2]}}`)}},
			"ok", "", map[string]any{"per_layer_err": []any{1.0, 2.0}}},
		{"per step", Outcome{Outcome: sched.Outcome{Result: json.RawMessage(
			`{"metrics": {"x": 1}, "per_layer": {"err": [1]}, "per_step": {"tokens": [7, 9], "kl": [0, 0.5]}}`)}},
			"ok", "", map[string]any{"per_layer_err": []any{1.0}, "per_step_tokens": []any{7.0, 9.0},
				"per_step_kl": []any{0.0, 0.5}}},
		{"job error", Outcome{Outcome: sched.Outcome{Err: &worker.JobError{Type: "KeyError", Message: "'k'", Traceback: "tb"}}},
			"failed", "KeyError: 'k'", map[string]any{"traceback": "tb"}},
		{"timeout", Outcome{Outcome: sched.Outcome{Err: errors.New("timed out after 1s: context deadline exceeded")}},
			"failed", "timed out after 1s: context deadline exceeded", nil},
		{"no metrics", Outcome{Outcome: sched.Outcome{Result: json.RawMessage(`{"other": 1}`)}}, "failed", `job returned no metrics: {"other": 1}`, nil},
		{"not json", Outcome{Outcome: sched.Outcome{Result: json.RawMessage(`nope`)}}, "failed", "job returned no metrics: nope", nil},
		{"tensors", Outcome{Outcome: sched.Outcome{Result: json.RawMessage(`{"metrics": {"x": 1}}`)},
			SaveTensors: saved(map[string]string{"rel_err": "tensors/j/rel_err.npy"}, nil)},
			"ok", "", map[string]any{"tensor_rel_err": "tensors/j/rel_err.npy"}},
		{"tensors not saved", Outcome{Outcome: sched.Outcome{Result: json.RawMessage(`{"metrics": {"x": 1}, "per_layer": {"e": 1}}`)},
			SaveTensors: saved(map[string]string{"a": "tensors/j/a.npy"}, errors.New(`tensor "b": disk full`))},
			"failed", `tensor "b": disk full`, map[string]any{"per_layer_e": 1.0, "tensor_a": "tensors/j/a.npy"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.out.Attempts, tc.out.Duration = 2, 1500*time.Millisecond
			rec := NewRecord("exp", testJobs("j")[0], tc.out)
			if rec.JobID != "j" || rec.Experiment != "exp" || rec.Method != "h2o" || rec.Attempts != 2 || rec.Seconds != 1.5 || rec.Finished.IsZero() {
				t.Errorf("record %+v", rec)
			}
			if rec.Status != tc.status || rec.Error != tc.err {
				t.Errorf("status %q, error %q; want %q, %q", rec.Status, rec.Error, tc.status, tc.err)
			}
			if !reflect.DeepEqual(rec.Extra, tc.extra) {
				t.Errorf("extra %v, want %v", rec.Extra, tc.extra)
			}
		})
	}
}

// Tensors of a failed job are not saved: its outputs are not trusted.
func TestRecordSavesNoTensorsOfFailedJobs(t *testing.T) {
	for _, result := range []string{`{"tensors": {}}`, `{"metrics": null}`} {
		called := false
		out := Outcome{Outcome: sched.Outcome{Result: json.RawMessage(result)},
			SaveTensors: func() (map[string]string, error) { called = true; return nil, nil }}
		if rec := NewRecord("exp", testJobs("j")[0], out); rec.Status != results.StatusFailed || called {
			t.Errorf("%s: status %s, tensors saved %v", result, rec.Status, called)
		}
	}
}

// Untracked files alone (a results directory in the checkout) do not make
// a checkout dirty; they are reported apart.
func TestGitStateSeparatesUntrackedFromModified(t *testing.T) {
	if _, err := exec.LookPath("git"); err != nil {
		t.Skip("no git")
	}
	dir := t.TempDir()
	git := func(args ...string) {
		t.Helper()
		cmd := exec.Command("git", append([]string{"-C", dir, "-c", "user.name=t", "-c", "user.email=t@t"}, args...)...)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
	}
	git("init", "-q")
	os.WriteFile(filepath.Join(dir, "a.py"), []byte("x = 1\n"), 0o644)
	git("add", "a.py")
	git("commit", "-q", "-m", "a")
	if g := gitState(dir); g.Commit == "" || g.Dirty || g.Untracked {
		t.Errorf("clean checkout: %+v", g)
	}
	os.WriteFile(filepath.Join(dir, "new.txt"), []byte("y\n"), 0o644)
	if g := gitState(dir); g.Dirty || !g.Untracked {
		t.Errorf("untracked file only: %+v; want untracked, not dirty", g)
	}
	os.WriteFile(filepath.Join(dir, "a.py"), []byte("x = 2\n"), 0o644)
	if g := gitState(dir); !g.Dirty || !g.Untracked {
		t.Errorf("modified and untracked: %+v", g)
	}
}

// A run whose manifest.json was lost is resumed, not started over: the
// manifest is rebuilt from the journal and only the missing jobs run.
func TestResumeWithoutManifestRebuildsIt(t *testing.T) {
	o := testOptions(t, &fakeExecutor{}, testJobs("a", "b"))
	sum1, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	os.Remove(filepath.Join(sum1.Dir, results.ManifestFile))
	var log bytes.Buffer
	ex := &fakeExecutor{}
	o.Executor, o.Jobs, o.Resume, o.Log = ex, testJobs("a", "b", "c"), true, zerolog.New(&log)
	sum, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	if sum.Dir != sum1.Dir || !reflect.DeepEqual(ex.ran, []string{"c"}) {
		t.Fatalf("resumed in %s (first run %s), ran %v; want only c in the same run", sum.Dir, sum1.Dir, ex.ran)
	}
	m := manifest(t, sum.Dir)
	if m.Rebuilt == nil || m.Experiment != "exp" || m.Git != nil || m.Ended == nil || len(m.Resumed) != 1 {
		t.Errorf("rebuilt manifest %+v", m)
	}
	// What the resume ran is known: the script, the device, the versions.
	if m.File != "exp.star" || m.FileHash != "hash1" || m.Device != "cpu" || m.Versions["workbench"] != "1.2.3" {
		t.Errorf("rebuilt manifest: file %q (%q), device %q, versions %v", m.File, m.FileHash, m.Device, m.Versions)
	}
	if !strings.Contains(log.String(), "manifest.json was missing: rebuilt from the journal") || strings.Contains(log.String(), "the script changed") {
		t.Errorf("log:\n%s", log.String())
	}
}

// perWorkerExecutor starts a "worker" before every job, as a pool that
// loses its workers would: it reports the sources under root as the
// worker's. edit runs before the job with the given index.
func perWorkerExecutor(root string, edit map[int]func()) executorFunc {
	return func(ctx context.Context, b Batch) error {
		for i, j := range b.Jobs {
			if f := edit[i]; f != nil {
				f()
			}
			k := loaded(root)
			if err := b.CheckCode(k); err != nil {
				return &sched.NoWorkerError{Tries: 1, NotRun: len(b.Jobs) - i, Err: sched.Permanent(err)}
			}
			out := Outcome{Outcome: sched.Outcome{Job: j, Attempts: 1, Result: json.RawMessage(`{"metrics": {"x": 1}}`)}, Kernels: &k}
			if err := b.Done(out); err != nil {
				return err
			}
		}
		return nil
	}
}

// loaded is what a worker starting now under root would report.
func loaded(root string) worker.Kernels {
	digest, files := KernelsDigestOf(root)
	return worker.Kernels{Digest: digest, Files: files}
}

// An edit under kernels_py/ during a run is caught when the next worker
// starts: refused (the jobs left wait for a resume), or with
// AllowCodeChange recorded, each row keeping the digest of its worker.
func TestKernelEditMidRun(t *testing.T) {
	for _, allow := range []bool{false, true} {
		t.Run(fmt.Sprintf("allow=%v", allow), func(t *testing.T) {
			o := testOptions(t, nil, testJobs("a", "b", "c"))
			o.AllowCodeChange = allow
			edit := func() { os.WriteFile(filepath.Join(o.KernelsDir, "kernels_py", "method.py"), []byte("x = 3\n"), 0o644) }
			o.Executor = perWorkerExecutor(o.KernelsDir, map[int]func(){1: edit})
			sum, err := Run(context.Background(), o)
			recs := journal(t, sum.Dir)
			var ce *CodeChangedError
			if !allow {
				if !errors.As(err, &ce) || !strings.Contains(err.Error(), "1 of 3 jobs are done") || len(recs) != 1 {
					t.Fatalf("got %v, %d rows", err, len(recs))
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			m := manifest(t, sum.Dir)
			if len(recs) != 3 || recs[0].KernelsDigest != m.KernelsDigest || recs[1].KernelsDigest == m.KernelsDigest ||
				recs[2].KernelsDigest != recs[1].KernelsDigest || len(m.CodeChanges) != 1 || m.CodeChanges[0].KernelsDigest != recs[1].KernelsDigest {
				t.Errorf("rows %v, manifest digest %s, changes %+v", recs, m.KernelsDigest, m.CodeChanges)
			}
		})
	}
}

// A resume on edited sources, allowed, records the change once however
// many workers report those sources before its first row.
func TestResumeRecordsACodeChangeOnce(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	o := testOptions(t, &fakeExecutor{after: func(int) { cancel() }}, testJobs("a", "b"))
	sum, _ := Run(ctx, o) // stopped after job a
	os.WriteFile(filepath.Join(o.KernelsDir, "kernels_py", "method.py"), []byte("x = 2\n"), 0o644)
	o.Resume, o.AllowCodeChange = true, true
	o.Executor = executorFunc(func(ctx context.Context, b Batch) error {
		for range 3 { // three workers start
			if err := b.CheckCode(loaded(o.KernelsDir)); err != nil {
				return err
			}
		}
		for _, j := range b.Jobs {
			k := loaded(o.KernelsDir)
			out := Outcome{Outcome: sched.Outcome{Job: j, Attempts: 1, Result: json.RawMessage(`{"metrics": {"x": 1}}`)}, Kernels: &k}
			if err := b.Done(out); err != nil {
				return err
			}
		}
		return nil
	})
	if _, err := Run(context.Background(), o); err != nil {
		t.Fatal(err)
	}
	if m := manifest(t, sum.Dir); len(m.CodeChanges) != 1 || m.CodeChanges[0].KernelsDigest != loaded(o.KernelsDir).Digest {
		t.Errorf("code changes %+v, want the one edit", m.CodeChanges)
	}
}

// A results root that cannot hold runs is reported before any worker starts.
func TestBadOutFailsBeforeWorkers(t *testing.T) {
	ex := &fakeExecutor{}
	o := testOptions(t, ex, testJobs("a"))
	o.Out = filepath.Join(t.TempDir(), "file")
	os.WriteFile(o.Out, []byte("x"), 0o644)
	if _, err := Run(context.Background(), o); err == nil || !strings.Contains(err.Error(), "results directory") || len(ex.dirs) != 0 {
		t.Fatalf("got %v; executor ran %d batches", err, len(ex.dirs))
	}
}

// A kernel edited while the run starts: the rows name the sources the
// workers ran, as they report them, not those this process hashed first.
// Before the first row the run simply takes the workers' sources; after it,
// a change is refused (or recorded, with AllowCodeChange).
func TestKernelEditWhileStarting(t *testing.T) {
	tests := []struct {
		name string
		// editAt: before the worker's hello ("hello"), before the first
		// job's end ("job a"), or before the second's ("job b").
		editAt  string
		allow   bool
		wantErr bool
	}{
		{"edited before the hello", "hello", false, false},
		{"edited before a job imported it", "job a", false, false},
		{"edited after the first row", "job b", false, true},
		{"edited after the first row, allowed", "job b", true, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			o := testOptions(t, nil, testJobs("a", "b"))
			o.AllowCodeChange = tc.allow
			before := loaded(o.KernelsDir)
			edit := func(at string) {
				if at == tc.editAt {
					os.WriteFile(filepath.Join(o.KernelsDir, "kernels_py", "method.py"), []byte("raise RuntimeError('edited')\n"), 0o644)
				}
			}
			o.Executor = executorFunc(func(ctx context.Context, b Batch) error {
				edit("hello")
				if err := b.CheckCode(loaded(o.KernelsDir)); err != nil {
					return err
				}
				for _, j := range b.Jobs {
					edit("job " + j.ID)
					k := loaded(o.KernelsDir)
					out := Outcome{Outcome: sched.Outcome{Job: j, Attempts: 1, Result: json.RawMessage(`{"metrics": {"x": 1}}`)}, Kernels: &k}
					if err := b.Done(out); err != nil {
						return err
					}
				}
				return nil
			})
			sum, err := Run(context.Background(), o)
			after := loaded(o.KernelsDir)
			recs := journal(t, sum.Dir)
			m := manifest(t, sum.Dir)
			var ce *CodeChangedError
			if tc.wantErr {
				if !errors.As(err, &ce) || !strings.Contains(err.Error(), "job b not journaled") || len(recs) != 1 || recs[0].KernelsDigest != before.Digest {
					t.Fatalf("got %v, rows %v", err, recs)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(recs) != 2 {
				t.Fatalf("%d rows", len(recs))
			}
			switch {
			case tc.allow:
				if recs[0].KernelsDigest != before.Digest || recs[1].KernelsDigest != after.Digest || m.KernelsDigest != before.Digest ||
					len(m.CodeChanges) != 1 || m.CodeChanges[0].KernelsDigest != after.Digest {
					t.Errorf("rows %s, %s; manifest %s, changes %+v", recs[0].KernelsDigest, recs[1].KernelsDigest, m.KernelsDigest, m.CodeChanges)
				}
			default:
				if recs[0].KernelsDigest != after.Digest || recs[1].KernelsDigest != after.Digest || m.KernelsDigest != after.Digest ||
					!reflect.DeepEqual(m.KernelsHash, after.Files) || len(m.CodeChanges) != 0 {
					t.Errorf("rows %s, %s; manifest %s, changes %+v; want every one %s", recs[0].KernelsDigest, recs[1].KernelsDigest,
						m.KernelsDigest, m.CodeChanges, after.Digest)
				}
			}
		})
	}
}

// A resume on changed sources records the checkout's state then: the
// manifest's own git state is the first run's.
func TestCodeChangeRecordsGitState(t *testing.T) {
	if _, err := exec.LookPath("git"); err != nil {
		t.Skip("no git")
	}
	o := testOptions(t, &fakeExecutor{}, testJobs("a"))
	for _, args := range [][]string{{"init", "-q"}, {"add", "."}, {"commit", "-q", "-m", "a"}} {
		cmd := exec.Command("git", append([]string{"-C", o.KernelsDir, "-c", "user.name=t", "-c", "user.email=t@t"}, args...)...)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
	}
	sum, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(o.KernelsDir, "kernels_py", "method.py"), []byte("x = 2\n"), 0o644)
	o.Jobs, o.Resume, o.AllowCodeChange = testJobs("a", "b"), true, true
	if _, err := Run(context.Background(), o); err != nil {
		t.Fatal(err)
	}
	m := manifest(t, sum.Dir)
	if m.Git == nil || m.Git.Dirty || len(m.CodeChanges) != 1 {
		t.Fatalf("manifest git %+v, changes %+v", m.Git, m.CodeChanges)
	}
	if g := m.CodeChanges[0].Git; g == nil || !g.Dirty || g.Commit != m.Git.Commit {
		t.Errorf("code change git %+v; want the first run's commit, dirty", g)
	}
}

// Two resumes started together with no run to resume start one run: the
// second waits while the first starts it, then finds it.
func TestConcurrentResumesStartOneRun(t *testing.T) {
	o := testOptions(t, nil, testJobs("a"))
	o.Resume = true
	var secondLog testpy.SyncBuffer
	var second error
	secondDone := make(chan struct{})
	o.Executor = executorFunc(func(ctx context.Context, b Batch) error {
		other := o
		other.Executor, other.Log = &fakeExecutor{}, zerolog.New(&secondLog)
		go func() {
			defer close(secondDone)
			_, second = Run(ctx, other)
		}()
		// The second resume is under way before this one's run exists.
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline) &&
			!strings.Contains(secondLog.String(), "another resume of this experiment is starting its run"); {
			time.Sleep(5 * time.Millisecond)
		}
		return b.Done(Outcome{Outcome: sched.Outcome{Job: b.Jobs[0], Attempts: 1, Result: json.RawMessage(`{"metrics": {"x": 1}}`)}})
	})
	sum, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	<-secondDone
	var le *results.LockedError
	if second != nil && !errors.As(second, &le) {
		t.Errorf("second resume: %v", second)
	}
	runs, _ := os.ReadDir(filepath.Join(o.Out, "exp"))
	var dirs []string
	for _, e := range runs {
		if e.IsDir() {
			dirs = append(dirs, e.Name())
		}
	}
	if len(dirs) != 1 || dirs[0] != filepath.Base(sum.Dir) {
		t.Errorf("run directories %v; want only %s", dirs, filepath.Base(sum.Dir))
	}
}

// A resume with another script, or an edited one: the manifest records each
// script, the run its plan's job ids, and the summary counts the rows of
// jobs the new plan lacks apart from the plan's.
func TestResumeWithAnotherScript(t *testing.T) {
	tests := []struct {
		name          string
		file, hash    string
		jobs          []string
		wantDone      int
		wantUnplanned int
		wantUnplFail  int
	}{
		{"same script", "exp.star", "hash1", []string{"a", "b", "c"}, 3, 0, 0},
		{"edited script", "exp.star", "hash2", []string{"a", "d"}, 2, 2, 1},
		{"another script", "other.star", "hash3", []string{"d", "e"}, 2, 3, 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			o := testOptions(t, &fakeExecutor{fail: map[string]error{"b": errors.New("boom")}}, testJobs("a", "b", "c"))
			first, err := Run(context.Background(), o)
			if err != nil {
				t.Fatal(err)
			}
			o.Executor, o.Resume, o.File, o.FileHash, o.Jobs = &fakeExecutor{}, true, tc.file, tc.hash, testJobs(tc.jobs...)
			sum, err := Run(context.Background(), o)
			if err != nil || sum.Dir != first.Dir {
				t.Fatalf("resume: %+v, %v", sum, err)
			}
			if sum.Done != tc.wantDone || sum.Unplanned != tc.wantUnplanned || sum.UnplannedFailed != tc.wantUnplFail ||
				sum.Rows != tc.wantDone+tc.wantUnplanned {
				t.Errorf("summary %+v, want %d done, %d unplanned (%d failed)", sum, tc.wantDone, tc.wantUnplanned, tc.wantUnplFail)
			}
			m := manifest(t, sum.Dir)
			if len(m.Scripts) != 2 || m.Scripts[0].File != "exp.star" || m.Scripts[0].FileHash != "hash1" || m.Scripts[0].Jobs != 3 ||
				m.Scripts[1].File != tc.file || m.Scripts[1].FileHash != tc.hash || m.Scripts[1].Jobs != len(tc.jobs) ||
				m.File != "exp.star" || m.FileHash != "hash1" {
				t.Errorf("manifest file %s %s, scripts %+v", m.File, m.FileHash, m.Scripts)
			}
			planned, err := results.ReadJobs(sum.Dir)
			if err != nil || len(planned) != len(tc.jobs) {
				t.Fatalf("jobs.json %v, %v", planned, err)
			}
			for _, id := range tc.jobs {
				if !planned[id] {
					t.Errorf("jobs.json lacks %s: %v", id, planned)
				}
			}
		})
	}
}

// A run that holds no row yet (its first start stopped before any job
// finished) resumes on edited kernels_py without --allow-code-change: no
// rows can mix. The change is recorded all the same. With a row, the
// resume is refused.
func TestResumeWithoutRowsAllowsCodeChange(t *testing.T) {
	tests := []struct {
		name    string
		rows    int
		refused bool
	}{
		{"no rows", 0, false},
		{"one row", 1, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			start := executorFunc(func(ctx context.Context, b Batch) error {
				if err := b.Open(); err != nil {
					return err
				}
				for _, j := range b.Jobs[:tc.rows] {
					b.Done(Outcome{Outcome: sched.Outcome{Job: j, Attempts: 1, Result: json.RawMessage(`{"metrics": {"x": 1}}`)}})
				}
				cancel()
				return ctx.Err()
			})
			o := testOptions(t, start, testJobs("a", "b"))
			first, err := Run(ctx, o)
			if !errors.Is(err, context.Canceled) || first.Dir == "" || first.Rows != tc.rows {
				t.Fatalf("first start: %+v, %v", first, err)
			}
			os.WriteFile(filepath.Join(o.KernelsDir, "kernels_py", "method.py"), []byte("x = 2\n"), 0o644)
			ex := &fakeExecutor{}
			o.Executor, o.Resume = ex, true
			sum, err := Run(context.Background(), o)
			var ce *CodeChangedError
			if errors.As(err, &ce) != tc.refused {
				t.Fatalf("resume: %v, want refused %v", err, tc.refused)
			}
			if tc.refused {
				return
			}
			if err != nil || sum.Dir != first.Dir || len(ex.ran) != 2 {
				t.Fatalf("resume: %+v, %v, ran %v", sum, err, ex.ran)
			}
			m := manifest(t, sum.Dir)
			now, _ := KernelsDigestOf(o.KernelsDir)
			if len(m.CodeChanges) != 1 || m.CodeChanges[0].KernelsDigest != now ||
				!reflect.DeepEqual(m.CodeChanges[0].Changed, []string{"method.py"}) {
				t.Errorf("code changes %+v", m.CodeChanges)
			}
			for _, rec := range journal(t, sum.Dir) {
				if rec.KernelsDigest != now {
					t.Errorf("row %s on %s, want %s", rec.JobID, rec.KernelsDigest, now)
				}
			}
		})
	}
}

// Where a resume finds nothing, or a new run starts beside an unfinished
// one, the log says where it looked and how to resume instead.
func TestStartWarnings(t *testing.T) {
	tests := []struct {
		name      string
		unfinish  bool // the earlier run is interrupted
		earlier   bool // there is an earlier run
		resume    bool
		want      string
		wantNoLog string
	}{
		{"resume finds no run", false, false, true, "nothing to resume: %OUT%/exp holds no run of exp", ""},
		{"new run beside an unfinished one", true, true, false, "is unfinished (1 of 2 jobs done); this starts a new run beside it. To continue that one instead, stop and run: workbench run exp.star --resume", ""},
		{"new run beside a finished one", false, true, false, "", "unfinished"},
		{"new run beside one being written", true, true, false, fmt.Sprintf("is being written by workbench process %d on ", os.Getpid()) +
			"%HOST%; this starts a new run beside it", "unfinished"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			o := testOptions(t, &fakeExecutor{}, testJobs("a", "b"))
			o.Continue = "workbench run exp.star --resume"
			if tc.earlier {
				ctx, cancel := context.WithCancel(context.Background())
				o.Executor = &fakeExecutor{after: func(int) {
					if tc.unfinish {
						cancel()
					}
				}}
				sum, _ := Run(ctx, o)
				cancel()
				if strings.Contains(tc.name, "being written") { // another writer holds it while the new run starts
					run, err := results.Open(sum.Dir)
					if err != nil {
						t.Fatal(err)
					}
					defer run.Close()
				}
			}
			var log bytes.Buffer
			o.Executor, o.Resume, o.Log = &fakeExecutor{}, tc.resume, zerolog.New(&log)
			if _, err := Run(context.Background(), o); err != nil {
				t.Fatal(err)
			}
			host, _ := os.Hostname()
			want := strings.NewReplacer("%OUT%", o.Out, "%HOST%", host).Replace(tc.want)
			if !strings.Contains(log.String(), want) || (tc.wantNoLog != "" && strings.Contains(log.String(), tc.wantNoLog)) {
				t.Errorf("log lacks %q (or has %q):\n%s", want, tc.wantNoLog, log.String())
			}
		})
	}
}

// A resume whose executor writes nothing (a dry run that prints its
// script, a submission refused, a stop before any job) leaves the run as
// it was: no resume recorded, no new plan, its tasks' segments not merged,
// results.parquet not rebuilt. The jobs it would run are those without a
// row in the journal or a segment.
func TestResumeThatWritesNothingLeavesTheRun(t *testing.T) {
	dryRun := errors.New("dry run: nothing submitted")
	refused := errors.New("sbatch: error: Memory specification can not be satisfied")
	tests := []struct {
		name string
		run  func(ctx context.Context, cancel func(), b Batch) error
		want error
	}{
		{"dry run", func(context.Context, func(), Batch) error { return dryRun }, dryRun},
		{"refused", func(context.Context, func(), Batch) error { return refused }, refused},
		{"interrupted", func(ctx context.Context, cancel func(), _ Batch) error { cancel(); return ctx.Err() }, context.Canceled},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			o := testOptions(t, &fakeExecutor{}, testJobs("a", "b"))
			first, err := Run(context.Background(), o)
			if err != nil {
				t.Fatal(err)
			}
			// A task recorded a job of the run in its segment, which no host merged.
			seg, err := results.CreateSegment(first.Dir, results.SegmentName("sub", 0))
			if err != nil {
				t.Fatal(err)
			}
			if err := seg.Append(results.Record{JobID: "c", Experiment: "exp", Status: results.StatusOK, Finished: time.Now()}); err != nil {
				t.Fatal(err)
			}
			seg.Close()
			before := resultstest.Snapshot(t, first.Dir)

			var todo []string
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			o.Jobs, o.Resume, o.FileHash = testJobs("a", "b", "c", "d"), true, "hash2" // the script gained jobs
			o.Executor = executorFunc(func(ctx context.Context, b Batch) error {
				for _, j := range b.Jobs {
					todo = append(todo, j.ID)
				}
				return tc.run(ctx, cancel, b)
			})
			sum, err := Run(ctx, o)
			if !errors.Is(err, tc.want) {
				t.Fatalf("resume: %v, want %v", err, tc.want)
			}
			if !reflect.DeepEqual(todo, []string{"d"}) {
				t.Errorf("the resume would run %v, want [d]", todo)
			}
			if sum.Dir != first.Dir || sum.Done != 3 {
				t.Errorf("summary %+v: want 3 jobs done in %s", sum, first.Dir)
			}
			if after := resultstest.Snapshot(t, first.Dir); !reflect.DeepEqual(after, before) {
				for path, data := range after {
					if before[path] != data {
						t.Errorf("%s changed:\n%s\nwas:\n%s", path, data, before[path])
					}
				}
				for path := range before {
					if _, ok := after[path]; !ok {
						t.Errorf("%s removed", path)
					}
				}
			}
		})
	}
}

// The warning of a new run beside an unfinished one counts the rows its
// tasks recorded in segments not merged yet, and where the run's work
// still goes on (a guard refuses it) says so instead of suggesting a
// resume that would be refused.
func TestUnfinishedWarningCountsSegmentsAndActiveWork(t *testing.T) {
	tests := []struct {
		name   string
		guard  error // what a registered guard says of the earlier run
		want   string
		wantNo string
	}{
		{"idle", nil, "is unfinished (2 of 3 jobs done); this starts a new run beside it. To continue that one instead, " +
			"stop and run: workbench run exp.star --resume", ""},
		{"array queued", errors.New("Slurm array 42 is still in the queue: follow it with `workbench status`"),
			"is unfinished (2 of 3 jobs done) and may still be under way; this starts a new run beside it. " +
				"Slurm array 42 is still in the queue: follow it with `workbench status`", "--resume"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			o := testOptions(t, &fakeExecutor{after: func(int) { cancel() }}, testJobs("a", "b", "c"))
			o.Guard = func(_ context.Context, _ string, locked bool) error {
				if locked {
					t.Error("the warning's guard was told it holds the run's lock")
				}
				return tc.guard
			}
			o.Continue = "workbench run exp.star --resume"
			first, _ := Run(ctx, o) // stopped after job a
			seg, err := results.CreateSegment(first.Dir, results.SegmentName("sub", 0))
			if err != nil {
				t.Fatal(err)
			}
			if err := seg.Append(results.Record{JobID: "b", Experiment: "exp", Status: results.StatusOK, Finished: time.Now()}); err != nil {
				t.Fatal(err)
			}
			seg.Close()

			var log bytes.Buffer
			o.Executor, o.Log = &fakeExecutor{}, zerolog.New(&log)
			if _, err := Run(context.Background(), o); err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(log.String(), tc.want) || (tc.wantNo != "" && strings.Contains(log.String(), tc.wantNo)) {
				t.Errorf("log lacks %q (or has %q):\n%s", tc.want, tc.wantNo, log.String())
			}
		})
	}
}

// A run stopped before its first worker was ready says so, and only so:
// the cancelled context behind it is the user's Ctrl-C, not news to them.
func TestInterruptedBeforeTheRunExists(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	o := testOptions(t, executorFunc(func(ctx context.Context, _ Batch) error { cancel(); return ctx.Err() }), testJobs("a"))
	sum, err := Run(ctx, o)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v, want context.Canceled", err)
	}
	if want := "interrupted before any job finished; no run directory was created"; err.Error() != want {
		t.Errorf("message %q, want %q", err, want)
	}
	if sum.Dir != "" {
		t.Errorf("summary names run %s", sum.Dir)
	}
	if entries, _ := os.ReadDir(filepath.Join(o.Out, "exp")); len(entries) > 0 {
		t.Errorf("%d entries under the experiment's folder", len(entries))
	}
}
