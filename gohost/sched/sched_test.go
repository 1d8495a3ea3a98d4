package sched

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/vlkv/vlkv/gohost/testpy"
	"github.com/vlkv/vlkv/gohost/worker"
)

func starter(t *testing.T) (func(context.Context) (*worker.Worker, error), *int) {
	py := testpy.Python(t)
	root, _ := filepath.Abs("../..")
	var mu sync.Mutex
	started := 0
	return func(ctx context.Context) (*worker.Worker, error) {
		mu.Lock()
		started++
		mu.Unlock()
		return worker.Start(ctx, worker.Config{Python: py, KernelsRoot: root, Device: worker.CPU, Log: zerolog.Nop()})
	}, &started
}

func job(id, fn string, args map[string]any, timeout time.Duration) Job {
	return Job{ID: id, Label: fn, Spec: worker.Job{Fn: fn, Args: args}, Timeout: timeout}
}

type collected struct {
	mu  sync.Mutex
	out map[string]Outcome
}

func (c *collected) done(o Outcome) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.out == nil {
		c.out = map[string]Outcome{}
	}
	c.out[o.Job.ID] = o
	return nil
}

func TestRunRetriesTimeoutsAndFailures(t *testing.T) {
	start, started := starter(t)
	marker := filepath.Join(t.TempDir(), "crashed")
	jobs := []Job{
		job("echo1", "kernels_py.runtime.diag:echo", map[string]any{"i": 1}, time.Minute),
		job("once", "kernels_py.runtime.diag:crash_once", map[string]any{"marker": marker}, time.Minute),
		job("always", "kernels_py.runtime.diag:crash", nil, time.Minute),
		job("slow", "kernels_py.runtime.diag:sleep", map[string]any{"seconds": 60}, time.Second),
		job("raises", "kernels_py.runtime.diag:fail", map[string]any{"message": "bad params"}, time.Minute),
		job("echo2", "kernels_py.runtime.diag:echo", map[string]any{"i": 2}, time.Minute),
	}
	var c collected
	var out bytes.Buffer
	err := Run(context.Background(), jobs, Config{Workers: 2, Start: start, Done: c.done,
		Progress: NewProgress(&out, false, len(jobs), 0), Log: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	if len(c.out) != len(jobs) {
		t.Fatalf("%d outcomes for %d jobs", len(c.out), len(jobs))
	}
	tests := []struct {
		id       string
		ok       bool
		attempts int
		errMsg   string
	}{
		{"echo1", true, 1, ""},
		{"once", true, 2, ""},
		{"always", false, 2, "worker died"},
		{"slow", false, 1, "timed out after 1s (worker killed); if the job needs longer, raise the experiment's timeout (seconds) in the script and run it again with --resume --retry-failed"},
		{"raises", false, 1, "ValueError: bad params"},
		{"echo2", true, 1, ""},
	}
	for _, tc := range tests {
		o := c.out[tc.id]
		if (o.Err == nil) != tc.ok || o.Attempts != tc.attempts || (tc.errMsg != "" && !strings.Contains(o.Err.Error(), tc.errMsg)) {
			t.Errorf("%s: err %v, attempts %d; want ok=%v attempts=%d %q", tc.id, o.Err, o.Attempts, tc.ok, tc.attempts, tc.errMsg)
		}
	}
	// 2 initial + 1 after "once" crashed + 2 after "always" crashed twice + 1 after the timeout.
	if *started < 5 {
		t.Errorf("only %d workers started; crashed and timed-out ones must be replaced", *started)
	}
	if lines := strings.Count(out.String(), "\n"); lines != len(jobs) || !strings.Contains(out.String(), "[6/6]") {
		t.Errorf("progress lines:\n%s", out.String())
	}
}

// A job that leaves the worker's GPU unusable (a kernel's illegal address
// breaks the CUDA context for every later call) fails alone: the next job
// runs on a fresh worker, not on the broken one, and is not counted as a
// retry after a crash.
func TestAJobThatBreaksTheGPUFailsAlone(t *testing.T) {
	start, started := starter(t)
	jobs := []Job{
		job("breaks", "kernels_py.runtime.diag:lose_device", nil, time.Minute),
		job("next", "kernels_py.runtime.diag:echo", nil, time.Minute),
	}
	var c collected
	if err := Run(context.Background(), jobs, Config{Workers: 1, Start: start, Done: c.done, Log: zerolog.Nop()}); err != nil {
		t.Fatal(err)
	}
	broke, next := c.out["breaks"], c.out["next"]
	var failed *worker.JobError
	if !errors.As(broke.Err, &failed) || !strings.Contains(failed.WorkerLost, "illegal memory access") || broke.Attempts != 1 ||
		!strings.Contains(broke.Err.Error(), "(the worker's GPU was unusable after it: CUDA error: an illegal memory access was encountered (simulated); the worker exited)") {
		t.Errorf("the breaking job: err %v, attempts %d; want one attempt, its error saying the worker was replaced",
			broke.Err, broke.Attempts)
	}
	if next.Err != nil || next.Attempts != 1 || next.Worker == broke.Worker {
		t.Errorf("the next job: err %v, attempts %d, same worker %v; want it done at once on a fresh worker",
			next.Err, next.Attempts, next.Worker == broke.Worker)
	}
	if *started != 2 {
		t.Errorf("%d workers started, want 2", *started)
	}
}

func TestCancelKeepsFinishedJobs(t *testing.T) {
	start, _ := starter(t)
	jobs := []Job{job("fast", "kernels_py.runtime.diag:echo", nil, 0)}
	for _, id := range []string{"s1", "s2", "s3"} {
		jobs = append(jobs, job(id, "kernels_py.runtime.diag:sleep", map[string]any{"seconds": 60}, 0))
	}
	ctx, cancel := context.WithCancel(context.Background())
	var c collected
	done := func(o Outcome) error {
		c.done(o)
		if o.Job.ID == "fast" {
			go func() { time.Sleep(500 * time.Millisecond); cancel() }()
		}
		return nil
	}
	begin := time.Now()
	err := Run(ctx, jobs, Config{Workers: 2, Start: start, Done: done, Log: zerolog.Nop()})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v, want context.Canceled", err)
	}
	if time.Since(begin) > 30*time.Second {
		t.Errorf("cancel took %v", time.Since(begin))
	}
	if len(c.out) != 1 || c.out["fast"].Err != nil {
		t.Errorf("outcomes after cancel: %v", c.out)
	}
}

func TestDoneErrorStopsTheRun(t *testing.T) {
	start, _ := starter(t)
	jobs := []Job{job("a", "kernels_py.runtime.diag:echo", nil, 0), job("b", "kernels_py.runtime.diag:echo", nil, 0), job("c", "kernels_py.runtime.diag:echo", nil, 0)}
	calls := 0
	err := Run(context.Background(), jobs, Config{Workers: 1, Start: start, Log: zerolog.Nop(),
		Done: func(Outcome) error { calls++; return errors.New("disk full") }})
	if err == nil || !strings.Contains(err.Error(), "disk full") || calls != 1 {
		t.Fatalf("err %v after %d calls", err, calls)
	}
}

// A broken environment: no worker ever starts. Nothing is reported (so
// nothing is recorded) and the error says no worker could start.
func TestNoWorkerEverStarts(t *testing.T) {
	calls := 0
	var c collected
	err := Run(context.Background(), []Job{job("a", "kernels_py.runtime.diag:echo", nil, 0), job("b", "kernels_py.runtime.diag:echo", nil, 0)},
		Config{Workers: 1, Log: zerolog.Nop(), StartBackoff: time.Millisecond, Done: c.done,
			Start: func(context.Context) (*worker.Worker, error) { calls++; return nil, errors.New("no python") }})
	var nw *NoWorkerError
	if !errors.As(err, &nw) || nw.NotRun != 2 || !strings.Contains(err.Error(), "no worker could start (3 tries in a row): no python") {
		t.Fatalf("got %v", err)
	}
	if calls != 3 || len(c.out) != 0 {
		t.Errorf("%d starts, %d outcomes; want 3 tries and nothing reported", calls, len(c.out))
	}
}

// flakyStarter starts real workers, except that the starts numbered in fail
// (1-based) fail the way a worker killed during start-up does.
func flakyStarter(t *testing.T, fail func(n int) bool) (func(context.Context) (*worker.Worker, error), *int) {
	start, _ := starter(t)
	var mu sync.Mutex
	n := 0
	return func(ctx context.Context) (*worker.Worker, error) {
		mu.Lock()
		n++
		bad := fail(n)
		mu.Unlock()
		if bad {
			return nil, errors.New("worker did not start: worker died (signal: killed) and printed nothing")
		}
		return start(ctx)
	}, &n
}

// A worker killed mid-job, then its replacement killed while starting: the
// start is retried and every job still runs.
func TestReplacementThatDiesWhileStartingIsRetried(t *testing.T) {
	start, starts := flakyStarter(t, func(n int) bool { return n == 2 || n == 3 })
	marker := filepath.Join(t.TempDir(), "crashed")
	jobs := []Job{job("once", "kernels_py.runtime.diag:crash_once", map[string]any{"marker": marker}, time.Minute)}
	for _, id := range []string{"e1", "e2", "e3"} {
		jobs = append(jobs, job(id, "kernels_py.runtime.diag:echo", nil, time.Minute))
	}
	var c collected
	err := Run(context.Background(), jobs, Config{Workers: 1, Start: start, Done: c.done, StartBackoff: time.Millisecond, Log: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	for _, j := range jobs {
		if o, ok := c.out[j.ID]; !ok || o.Err != nil {
			t.Errorf("job %s: %+v", j.ID, o)
		}
	}
	if *starts != 4 {
		t.Errorf("%d starts; want 4 (first, two failed replacements, one good)", *starts)
	}
}

// Once workers have started, a slot that cannot start another reports
// nothing more: the job it held (whose worker died, to be retried on a
// fresh one) never ran to its end for a reason outside it, so it is left
// for a resume with the jobs no worker took.
func TestSlotGivesUpAfterRepeatedStartFailures(t *testing.T) {
	start, _ := flakyStarter(t, func(n int) bool { return n > 1 })
	jobs := []Job{
		job("ok", "kernels_py.runtime.diag:echo", nil, time.Minute),
		job("kills", "kernels_py.runtime.diag:crash", nil, time.Minute),
		job("never", "kernels_py.runtime.diag:echo", nil, time.Minute),
	}
	var c collected
	err := Run(context.Background(), jobs, Config{Workers: 1, Start: start, Done: c.done, StartBackoff: time.Millisecond, Log: zerolog.Nop()})
	var nw *NoWorkerError
	if !errors.As(err, &nw) || nw.NotRun != 2 || !strings.Contains(err.Error(), "2 jobs not run") {
		t.Fatalf("got %v; want a NoWorkerError with 2 jobs not run", err)
	}
	if len(c.out) != 1 || c.out["ok"].Err != nil {
		t.Errorf("outcomes %+v; want only ok, done", c.out)
	}
}

// A slot that gives up before any worker has started puts its job back: a
// slot whose worker does start runs it, and the run ends complete.
func TestJobOfASlotThatGivesUpEarlyGoesToAnother(t *testing.T) {
	start, _ := starter(t)
	failed := make(chan struct{})
	var once sync.Once
	var mu sync.Mutex
	calls := 0
	flaky := func(ctx context.Context) (*worker.Worker, error) {
		mu.Lock()
		calls++
		first := calls == 1
		mu.Unlock()
		if first {
			defer once.Do(func() { close(failed) })
			return nil, errors.New("worker died (signal: killed) and printed nothing")
		}
		<-failed
		time.Sleep(100 * time.Millisecond) // the failed slot has retired by now
		return start(ctx)
	}
	jobs := []Job{job("a", "kernels_py.runtime.diag:echo", nil, time.Minute), job("b", "kernels_py.runtime.diag:echo", nil, time.Minute)}
	var c collected
	err := Run(context.Background(), jobs, Config{Workers: 2, Start: flaky, Done: c.done, StartTries: 1, Log: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	if len(c.out) != 2 || c.out["a"].Err != nil || c.out["b"].Err != nil {
		t.Errorf("outcomes %+v", c.out)
	}
}

// A start error that retrying cannot mend retires the slot at once.
func TestPermanentStartErrorIsNotRetried(t *testing.T) {
	calls := 0
	err := Run(context.Background(), []Job{job("a", "kernels_py.runtime.diag:echo", nil, 0)}, Config{Workers: 1, Log: zerolog.Nop(),
		Start: func(context.Context) (*worker.Worker, error) {
			calls++
			return nil, Permanent(errors.New("code changed"))
		},
		Done: func(Outcome) error { return nil }})
	var nw *NoWorkerError
	if !errors.As(err, &nw) || calls != 1 || err.Error() != "no worker could start: code changed; 1 job not run" {
		t.Fatalf("%d starts, %v", calls, err)
	}
}

// Duration is the job's own time (well under a second even on a loaded
// machine); Wall adds the worker start-up and the failed attempt of a
// retried job.
func TestDurationIsComputeTimeAndWallIncludesRetries(t *testing.T) {
	start, _ := starter(t)
	marker := filepath.Join(t.TempDir(), "crashed")
	jobs := []Job{job("once", "kernels_py.runtime.diag:crash_once", map[string]any{"marker": marker}, time.Minute)}
	var c collected
	if err := Run(context.Background(), jobs, Config{Workers: 1, Start: start, Done: c.done, Log: zerolog.Nop()}); err != nil {
		t.Fatal(err)
	}
	o := c.out["once"]
	if o.Attempts != 2 || o.Duration <= 0 || o.Duration > time.Second || o.Wall < o.Duration+100*time.Millisecond {
		t.Errorf("attempts %d, duration %v, wall %v: want a short job time and a wall time with two worker starts", o.Attempts, o.Duration, o.Wall)
	}
}

func TestProgressTerminalBar(t *testing.T) {
	var out bytes.Buffer
	p := NewProgress(&out, true, 4, 1)
	p.Finished(Outcome{Job: Job{ID: "x"}})
	p.Finished(Outcome{Job: Job{ID: "y"}, Err: errors.New("boom\ntraceback")})
	p.Close()
	last := out.String()[strings.LastIndex(out.String(), "\r"):]
	if !strings.Contains(last, "3/4 done, 1 failed") || strings.Contains(out.String(), "traceback") {
		t.Errorf("bar %q", last)
	}
}

// A failed job's progress line says which kernels_py line its error comes
// from, where the worker found one.
func TestProgressLineNamesWhereAJobFailed(t *testing.T) {
	var out bytes.Buffer
	p := NewProgress(&out, false, 2, 0)
	at := &worker.SourceLine{Message: "IndexError: tuple index out of range", File: "kernels_py/methods/mine.py", Line: 21}
	p.Finished(Outcome{Job: Job{ID: "a", Label: "mine"}, Err: fmt.Errorf("attempt 1: %w",
		&worker.JobError{Type: "IndexError", Message: "tuple index out of range", Traceback: "Traceback ...", At: at})})
	p.Finished(Outcome{Job: Job{ID: "b", Label: "full"}, Err: errors.New("worker died")})
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 2 || !strings.Contains(lines[0], "FAILED: attempt 1: IndexError: tuple index out of range (at kernels_py/methods/mine.py:21)") {
		t.Errorf("first line %q", lines[0])
	}
	if len(lines) != 2 || !strings.HasSuffix(lines[1], "FAILED: worker died") {
		t.Errorf("lines %q", lines)
	}
}

// screen plays what was written to a terminal and returns the lines it
// shows: "\r" returns to the line's start, ESC[K erases to its end.
func screen(out string) []string {
	lines := []string{""}
	col := 0
	for i := 0; i < len(out); i++ {
		cur := &lines[len(lines)-1]
		switch {
		case out[i] == '\n':
			lines, col = append(lines, ""), 0
		case out[i] == '\r':
			col = 0
		case strings.HasPrefix(out[i:], "\x1b[K"):
			*cur = (*cur)[:col]
			i += len("\x1b[K") - 1
		default:
			if col < len(*cur) {
				*cur = (*cur)[:col] + string(out[i]) + (*cur)[col+1:]
			} else {
				*cur += string(out[i])
			}
			col++
		}
	}
	return lines
}

// Log lines and the bar share a terminal: each log line appears on a line
// of its own above the bar, which is redrawn below it.
func TestProgressBarAndLogLines(t *testing.T) {
	var out bytes.Buffer
	term := NewTerminal(&out)
	if !IsTerminal(term) || IsTerminal(&out) {
		t.Fatal("IsTerminal: a *Terminal is one, a buffer is not")
	}
	log := zerolog.New(zerolog.ConsoleWriter{Out: term, NoColor: true, PartsExclude: []string{zerolog.TimestampFieldName}})
	p := NewProgress(term, true, 3, 0)
	log.Info().Msg("worker started")
	p.Finished(Outcome{Job: Job{ID: "x"}})
	log.Warn().Str("job", "y").Msg("job failed")
	p.Finished(Outcome{Job: Job{ID: "y"}, Err: errors.New("boom")})
	p.Close()
	log.Info().Msg("after the run")
	got := screen(out.String())
	want := []string{
		"INF worker started",
		"WRN job failed job=y",
		"[====================          ] 2/3 done, 1 failed, ETA ",
		"INF after the run",
		"",
	}
	if len(got) != len(want) {
		t.Fatalf("screen:\n%s\nwant %d lines", strings.Join(got, "\n"), len(want))
	}
	for i := range want {
		if !strings.HasPrefix(got[i], want[i]) || (want[i] != "" && strings.Count(got[i], "INF")+strings.Count(got[i], "WRN")+strings.Count(got[i], "done") != 1) {
			t.Errorf("line %d: %q, want %q...", i, got[i], want[i])
		}
	}
}

// A question asked on the terminal (Ctrl-C: cancel the Slurm array?)
// stays on screen until it is answered: the bar's redraw every second
// cleared its line, and the question went with it.
func TestTerminalAskHoldsTheBarBack(t *testing.T) {
	var out syncBuffer
	term := NewTerminal(&out)
	term.drawBar("[bar 1s]")
	redrawn := make(chan struct{})
	answer := term.Ask("\nCancel? [y/N] ", func() string {
		go func() {
			term.drawBar("[bar 2s]") // the ticker, while the user reads
			close(redrawn)
		}()
		time.Sleep(100 * time.Millisecond)
		if got := screen(out.String()); got[len(got)-1] != "Cancel? [y/N] " {
			t.Errorf("while the question waits, the screen ends with %q", got[len(got)-1])
		}
		return "y\n"
	})
	<-redrawn
	if answer != "y\n" {
		t.Errorf("answer %q", answer)
	}
	if got := screen(out.String()); got[len(got)-1] != "[bar 2s]" {
		t.Errorf("after the answer the screen ends with %q, want the bar", got[len(got)-1])
	}
}

// syncBuffer is a bytes.Buffer that the progress's redraws may write to
// while the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// A job can run for an hour: while none finishes, the bar's elapsed time
// moves on, and a log (no terminal) gets a line now and then saying the
// run is still going; once every job is done, or the progress is closed,
// nothing more is written.
func TestProgressWhileAJobRuns(t *testing.T) {
	defer func(tick, quiet time.Duration) { barTick, quietLine = tick, quiet }(barTick, quietLine)
	barTick, quietLine = time.Millisecond, time.Millisecond
	for _, tc := range []struct {
		name string
		tty  bool
		want string
	}{
		{"terminal", true, "0/2 done, 0 failed, ETA ? (1m0s elapsed)"},
		{"log", false, "[0/2] still running (1m0s elapsed, no job finished in 1m0s), ETA ?\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out syncBuffer
			start := time.Now()
			var mu sync.Mutex
			now := start
			p := NewProgress(&out, tc.tty, 2, 0)
			p.mu.Lock()
			p.started, p.lastLine = start, start
			p.now = func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
			p.mu.Unlock()
			mu.Lock()
			now = start.Add(time.Minute)
			mu.Unlock()
			deadline := time.Now().Add(5 * time.Second)
			for !strings.Contains(out.String(), tc.want) && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond)
			}
			if !strings.Contains(out.String(), tc.want) {
				t.Fatalf("output %q lacks %q", out.String(), tc.want)
			}
			p.Close()
			closed := out.String()
			time.Sleep(20 * time.Millisecond)
			if out.String() != closed {
				t.Errorf("written after Close: %q", strings.TrimPrefix(out.String(), closed))
			}
		})
	}
}

// The first job pays for the workers' start and the kernels' first
// compiles: once a second has finished, the ETA goes by the jobs since.
func TestProgressETALeavesOutTheFirstJobsStart(t *testing.T) {
	var out bytes.Buffer
	p := NewProgress(&out, false, 12, 2) // two done before this resume
	defer p.Close()
	p.mu.Lock()
	now := p.started
	p.now = func() time.Time { return now }
	p.mu.Unlock()
	now = now.Add(20 * time.Second) // start-up and compiles, then the first job
	p.Finished(Outcome{Job: Job{ID: "a"}})
	now = now.Add(2 * time.Second)
	p.Finished(Outcome{Job: Job{ID: "b"}})
	now = now.Add(2 * time.Second)
	p.Finished(Outcome{Job: Job{ID: "c"}})
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	for i, want := range []string{", ETA 3m0s", ", ETA 16s", ", ETA 14s"} { // 9 left at 20 s; 8 at 2 s; 7 at 2 s
		if !strings.HasSuffix(lines[i], want) {
			t.Errorf("line %d: %q, want it to end %q", i, lines[i], want)
		}
	}
}
