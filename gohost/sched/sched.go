// Package sched runs jobs on a pool of workers: per-job timeouts, a crashed
// worker replaced and its job retried once, cancellation that keeps what
// finished, and progress.
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
	Duration time.Duration
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
	Log     zerolog.Logger
}

// Run runs jobs until all finished or ctx ends. Jobs in flight when ctx ends
// are abandoned (their workers killed) and not reported; everything reported
// through Done before stays done. It returns ctx's error when cancelled.
func Run(ctx context.Context, jobs []Job, cfg Config) error {
	if cfg.Workers < 1 {
		return fmt.Errorf("need at least one worker, got %d", cfg.Workers)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	queue := make(chan Job)
	var (
		mu       sync.Mutex
		firstErr error
	)
	fail := func(err error) {
		mu.Lock()
		if firstErr == nil {
			firstErr = err
		}
		mu.Unlock()
		cancel()
	}
	report := func(o Outcome) {
		mu.Lock()
		defer mu.Unlock()
		if firstErr != nil {
			return
		}
		if cfg.Progress != nil {
			cfg.Progress.Finished(o)
		}
		if err := cfg.Done(o); err != nil {
			firstErr = err
			cancel()
		}
	}

	var wg sync.WaitGroup
	for i := 0; i < min(cfg.Workers, len(jobs)); i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := serve(ctx, queue, cfg, report); err != nil {
				fail(err)
			}
		}()
	}
feed:
	for _, j := range jobs {
		select {
		case queue <- j:
		case <-ctx.Done():
			break feed
		}
	}
	close(queue)
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}
	return ctx.Err()
}

// serve is one pool slot: it owns at most one worker at a time.
func serve(ctx context.Context, queue <-chan Job, cfg Config, report func(Outcome)) error {
	var w *worker.Worker
	defer func() {
		if w != nil {
			w.Close()
		}
	}()
	for job := range queue {
		start := time.Now()
		for attempt := 1; ; attempt++ {
			if w == nil {
				var err error
				if w, err = cfg.Start(ctx); err != nil {
					if ctx.Err() != nil {
						return nil
					}
					return fmt.Errorf("start a worker: %w", err)
				}
			}
			if cfg.Prepare != nil {
				cfg.Prepare(w, &job.Spec)
			}
			result, err := runOne(ctx, w, job)
			if ctx.Err() != nil {
				return nil // cancelled: the job is in flight, not done
			}
			var died *worker.ExitError
			if errors.As(err, &died) || errors.Is(err, context.DeadlineExceeded) || (err != nil && !w.Alive()) {
				w.Close()
				w = nil // killed or dead: the next attempt or job gets a fresh one
			}
			if errors.As(err, &died) && attempt < 2 {
				cfg.Log.Warn().Str("job", job.ID).Err(err).Msg("worker died; retrying the job once on a fresh worker")
				continue
			}
			report(Outcome{Job: job, Result: result, Err: err, Attempts: attempt, Duration: time.Since(start)})
			break
		}
	}
	return nil
}

func runOne(ctx context.Context, w *worker.Worker, job Job) (json.RawMessage, error) {
	if job.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, job.Timeout)
		defer cancel()
	}
	result, err := w.Run(ctx, job.Spec)
	if errors.Is(err, context.DeadlineExceeded) {
		return nil, fmt.Errorf("timed out after %v: %w", job.Timeout, err)
	}
	return result, err
}
