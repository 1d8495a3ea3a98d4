// Package sched runs jobs on a pool of workers: per-job timeouts, a crashed
// worker replaced and its job retried once, a worker that fails to start
// retried with backoff, cancellation that keeps what finished, and progress.
package sched

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/vlkv/vlkv/gohost/worker"
)

// Job is one unit of work for a worker.
type Job struct {
	ID      string
	Label   string // for progress lines, e.g. "h2o budget=0.25"
	Spec    worker.Job
	Timeout time.Duration // zero: no limit
}

// Outcome is a finished job: a result, or the error that ended it.
type Outcome struct {
	Job      Job
	Result   json.RawMessage
	Err      error
	Attempts int
	// Duration is the job's own time on its worker, in its last attempt:
	// what the job costs, without worker start-up or failed attempts.
	Duration time.Duration
	// Wall is the time from taking the job to its outcome: start-ups,
	// failed attempts and backoff included.
	Wall time.Duration
	// Worker ran the last attempt. It is still alive when Done is called
	// only if it will take more jobs.
	Worker *worker.Worker
}

// NoWorkerError says that the pool ran out of workers: every slot failed to
// start one StartTries times in a row (or met a start error that retrying
// cannot mend). The jobs not reported were not run.
type NoWorkerError struct {
	Tries  int   // failed starts in a row that retired the last slot
	NotRun int   // jobs never reported
	Err    error // the last start error
}

func (e *NoWorkerError) Error() string {
	tries := ""
	if e.Tries > 1 {
		tries = fmt.Sprintf(" (%d tries in a row)", e.Tries)
	}
	jobs := "jobs"
	if e.NotRun == 1 {
		jobs = "job"
	}
	return fmt.Sprintf("no worker could start%s: %v; %d %s not run", tries, e.Err, e.NotRun, jobs)
}

func (e *NoWorkerError) Unwrap() error { return e.Err }

// Permanent marks a start error that starting again cannot mend (the worker
// refused, the code changed under the run): the slot gives up at once.
func Permanent(err error) error { return &permanentError{err} }

type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

func isPermanent(err error) bool {
	var p *permanentError
	var refused *worker.RefusedError
	return errors.As(err, &p) || errors.As(err, &refused)
}

// Config says how to run.
type Config struct {
	Workers int                                           // pool size (at least 1)
	Start   func(context.Context) (*worker.Worker, error) // starts a fresh worker
	// Done is called once per finished job, never concurrently; an error from
	// it (say, the journal cannot be written) stops the run.
	Done     func(Outcome) error
	Progress *Progress // may be nil
	// Prepare, if set, adjusts a job for the worker about to run it (say, to
	// lend it a scratch region of that worker's arena).
	Prepare func(w *worker.Worker, spec *worker.Job)
	// Stopped, if set, is called once for every worker the pool started,
	// after it is closed and after Done returned for the last job it ran
	// (say, to free what was lent to it). Slots call it concurrently.
	Stopped func(w *worker.Worker)
	// StartTries is how many failed starts in a row retire a pool slot
	// (zero: 3). The waits between them double from StartBackoff (zero:
	// half a second).
	StartTries   int
	StartBackoff time.Duration
	Log          zerolog.Logger
}

func (c Config) startTries() int {
	if c.StartTries > 0 {
		return c.StartTries
	}
	return 3
}

func (c Config) startBackoff() time.Duration {
	if c.StartBackoff > 0 {
		return c.StartBackoff
	}
	return 500 * time.Millisecond
}

// Run runs jobs until all finished or ctx ends. Jobs in flight when ctx ends
// are abandoned (their workers killed) and not reported; everything reported
// through Done before stays done. It returns ctx's error when cancelled.
//
// A worker that fails to start is started again after a backoff. After
// StartTries failures in a row (or one permanent failure) its slot retires,
// and the job it held goes back to the queue for the other slots: a start
// failure is never the job's doing, so it is not reported, and a resume runs
// it. When every slot has retired, Run returns a *NoWorkerError counting the
// jobs not reported.
func Run(ctx context.Context, jobs []Job, cfg Config) error {
	if cfg.Workers < 1 {
		return fmt.Errorf("need at least one worker, got %d", cfg.Workers)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// Room for every job, so a retiring slot can put its job back.
	queue := make(chan Job, len(jobs))
	for _, j := range jobs {
		queue <- j
	}
	slots := min(cfg.Workers, len(jobs))
	p := &pool{cfg: cfg, cancel: cancel, queue: queue, pending: len(jobs), allDone: make(chan struct{})}
	if len(jobs) == 0 {
		return nil
	}
	var wg sync.WaitGroup
	for range slots {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.serve(ctx)
		}()
	}
	wg.Wait()
	if p.firstErr != nil {
		return p.firstErr
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if p.pending > 0 {
		return &NoWorkerError{Tries: p.startTries, NotRun: p.pending, Err: p.startErr}
	}
	return nil
}

// pool is what the slots of one Run share.
type pool struct {
	cfg    Config
	cancel context.CancelFunc
	queue  chan Job

	mu         sync.Mutex
	firstErr   error         // from Done: stops the run
	pending    int           // jobs not reported yet
	startErr   error         // the last failed start
	startTries int           // and how many tries in a row it ended
	allDone    chan struct{} // closed when every job is reported
}

// next is the next job for a slot; false when there is none to come. A
// slot never waits for nothing: a job is either reported, in a slot's hands
// (and comes back to the queue if that slot retires) or in the queue.
func (p *pool) next(ctx context.Context) (Job, bool) {
	select {
	case job := <-p.queue:
		return job, true
	case <-p.allDone:
	case <-ctx.Done():
	}
	return Job{}, false
}

func (p *pool) report(o Outcome) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.firstErr != nil {
		return
	}
	p.pending--
	if p.pending == 0 {
		close(p.allDone)
	}
	if p.cfg.Progress != nil {
		p.cfg.Progress.Finished(o)
	}
	if err := p.cfg.Done(o); err != nil {
		p.firstErr = err
		p.cancel()
	}
}

// start starts a worker, retrying with backoff. It returns nil when ctx
// ended, after StartTries failures in a row, or at once on a permanent
// failure.
func (p *pool) start(ctx context.Context, job Job) *worker.Worker {
	wait := p.cfg.startBackoff()
	for try := 1; ; try++ {
		w, err := p.cfg.Start(ctx)
		if err == nil || ctx.Err() != nil {
			return w
		}
		p.mu.Lock()
		p.startErr, p.startTries = err, try
		p.mu.Unlock()
		if try >= p.cfg.startTries() || isPermanent(err) {
			p.cfg.Log.Error().Err(err).Str("job", job.ID).Int("tries", try).Msg("worker did not start; this pool slot gives up")
			return nil
		}
		p.cfg.Log.Warn().Err(err).Str("job", job.ID).Dur("retry_in", wait).Msg("worker did not start; trying again")
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return nil
		}
		wait *= 2
	}
}

// serve is one pool slot: it owns at most one worker at a time.
func (p *pool) serve(ctx context.Context) {
	var w *worker.Worker
	defer func() {
		if w != nil {
			w.Close()
			p.stopped(w)
		}
	}()
	for {
		job, ok := p.next(ctx)
		if !ok {
			return
		}
		begin := time.Now()
		for attempt := 1; ; attempt++ {
			if w == nil {
				if w = p.start(ctx, job); w == nil {
					if ctx.Err() == nil {
						p.queue <- job // for a slot whose worker does start; never blocks (room for every job)
					}
					return // this slot retires
				}
			}
			if p.cfg.Prepare != nil {
				p.cfg.Prepare(w, &job.Spec)
			}
			began := time.Now()
			result, err := runOne(ctx, w, job)
			took := time.Since(began)
			if ctx.Err() != nil {
				return // cancelled: the job is in flight, not done
			}
			ran := w
			var died *worker.ExitError
			var failed *worker.JobError
			lost := errors.As(err, &failed) && failed.WorkerLost != "" // it exits after its reply
			if errors.As(err, &died) || errors.Is(err, context.DeadlineExceeded) || lost || (err != nil && !w.Alive()) {
				w.Close()
				w = nil // killed or dead: the next attempt or job gets a fresh one
			}
			if errors.As(err, &died) && attempt < 2 {
				p.stopped(ran)
				p.cfg.Log.Warn().Str("job", job.ID).Err(err).Msg("worker died; retrying the job once on a fresh worker")
				continue
			}
			p.report(Outcome{Job: job, Result: result, Err: err, Attempts: attempt, Duration: took, Wall: time.Since(begin), Worker: ran})
			if w == nil {
				p.stopped(ran)
			}
			break
		}
	}
}

func (p *pool) stopped(w *worker.Worker) {
	if p.cfg.Stopped != nil {
		p.cfg.Stopped(w)
	}
}

func runOne(ctx context.Context, w *worker.Worker, job Job) (json.RawMessage, error) {
	if job.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, job.Timeout)
		defer cancel()
	}
	result, err := w.Run(ctx, job.Spec)
	if errors.Is(err, context.DeadlineExceeded) {
		// The job's id leaves its timeout out: a larger one in the script
		// runs it again on --resume --retry-failed.
		return nil, fmt.Errorf("timed out after %v (worker killed); if the job needs longer, raise the experiment's "+
			"timeout (seconds) in the script and run it again with --resume --retry-failed: %w", job.Timeout, context.DeadlineExceeded)
	}
	return result, err
}
