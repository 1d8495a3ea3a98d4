// Package runner runs the jobs of one experiment into a run directory: it
// creates the run (or resumes the newest one), skips the jobs its journal
// already has, hands the rest to an Executor, journals every outcome as it
// arrives, and rebuilds results.parquet at the end.
//
// The executor decides where jobs run; Local is a pool of Python workers on
// this machine. Everything that makes a run resumable — the journal, the
// manifest, which jobs still need to run — stays here, so every executor
// gets it the same way.
package runner

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/rs/zerolog"

	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/sched"
	"github.com/vlkv/vlkv/gohost/tensor"
	"github.com/vlkv/vlkv/gohost/worker"
)

// Job is one job of an experiment: what the executor runs, and what the
// journal records about it besides the outcome.
type Job struct {
	sched.Job
	Method       string
	Params       map[string]any
	WorkloadName string
	Workload     map[string]any
}

// Outcome is a finished job as an executor reports it.
type Outcome struct {
	sched.Outcome
	// SaveTensors, if set, writes the tensors the job returned by reference
	// to tensors/<job id>/<name>.npy under the run directory and returns
	// their paths relative to it, by tensor name (those written before an
	// error included). The runner calls it only for a job it counts as
	// succeeded, and only before done returns: a local worker's tensors live
	// in its scratch arena, which its next job overwrites.
	SaveTensors func() (map[string]string, error)
	// Kernels is the kernels_py sources the job ran on, as the worker that
	// ran it reported them; nil if unknown.
	Kernels *worker.Kernels
	// Record, if set, is the journal record made where the job ran (a
	// cluster task, with NewRecord); it is journaled as it is.
	Record *results.Record
}

// Batch is the work of one Executor.Run call: the jobs of one run.
type Batch struct {
	Dir  string      // the run directory
	Jobs []sched.Job // to run, in order
	// Experiment and Details (by job id) are what a record of each job
	// holds besides its outcome: for executors whose tasks make the records.
	Experiment string
	Details    map[string]Job
	// KernelsDigest names the kernels_py sources the run's rows come from.
	KernelsDigest string
	// Continue is the command that resumes the run (Options.Continue), for
	// an executor whose messages, or records, say how to go on.
	Continue string
	// Open creates the run directory now, if it does not exist yet: an
	// executor whose tasks write into it calls it before they start.
	Open func() error
	// Discard removes the run directory Open created for this call when
	// it holds nothing but what the runner wrote (no row, no file of the
	// executor's): for an executor whose work was refused once the run was
	// open (sbatch rejecting the array), so no run is left that a later
	// one takes for unfinished. It keeps a resumed run, and says whether it
	// removed the directory.
	Discard func() (bool, error)
	Log     zerolog.Logger
	// Started, if set, is called once, with the hello of the first worker to
	// start, before any job finishes: the manifest records what jobs ran on.
	Started func(worker.Hello)
	// CodeDigest, if set, is called before each worker starts: it returns
	// the digest of the kernels_py sources the worker is about to load, or
	// an error when the run may not use them (they changed, and mixing is
	// not allowed); the executor then starts no worker (sched.Permanent).
	CodeDigest func() (string, error)
	// CheckCode, if set, is called with the sources each worker reports it
	// loaded, once it has started: an error refuses them, and the executor
	// closes that worker as if it had not started (sched.Permanent). The
	// sources a job ran on come with its Outcome.
	CheckCode func(worker.Kernels) error
	// Done is called once per finished job, never concurrently. An error
	// from it (say, the journal cannot be written) stops the batch, and Run
	// returns that error.
	Done func(Outcome) error
}

// Executor runs batches of jobs somewhere: on local workers, on a cluster.
type Executor interface {
	// Run runs b's jobs until all are done, Done fails, or ctx ends. Jobs in
	// flight when ctx ends are abandoned and not reported; Run then returns
	// ctx's error.
	Run(ctx context.Context, b Batch) error
}

// A Guard refuses to let a process write the run in dir while work it does
// not control may still write there (a cluster's tasks), saying how to
// follow or stop that work; it returns nil when none can. locked says
// whether the caller holds the run's lock: only then may the guard record
// what it finds in the run.
type Guard func(ctx context.Context, dir string, locked bool) error

// Options says what to run, where its results go and how to report.
type Options struct {
	Out        string // results root: a run is Out/<Experiment>/<run id>/
	Experiment string
	Protocol   string // the experiment's comparison protocol, for the manifest
	File       string // the experiment script, for the manifest
	FileHash   string // its sha256: a resumed run warns when it changed
	Jobs       []Job  // every job of the experiment, done or not

	KernelsDir string // holds kernels_py/; its git state and source hashes go in the manifest
	Device     string // for the manifest, e.g. "cuda"
	Version    string // the workbench's version, for the manifest

	// Resume continues the newest run of the experiment (a new one when it
	// has none), skipping the jobs its journal has; with RetryFailed, the
	// ones journaled as failed run again. A resume whose kernels_py sources
	// differ from the run's is refused (*CodeChangedError) unless
	// AllowCodeChange, which records the change in the manifest.
	Resume          bool
	RetryFailed     bool
	AllowCodeChange bool
	// RerunStale, with Resume and AllowCodeChange, runs again the jobs whose
	// rows were computed on other kernels_py sources than today's (what
	// `workbench watch --experiment` does after an edit).
	RerunStale bool
	// StartIfNone, with Resume, expects that there may be no run to resume
	// yet (watch's first iteration): the new run is not warned of.
	StartIfNone bool

	// Continue is the command line that resumes this run, for the
	// messages that say how to go on; "" says only "--resume".
	Continue string

	Executor Executor // runs the jobs; required
	// Guard is checked by every resume once it holds the run's lock and
	// before it writes anything, and by the warning of a new run beside an
	// unfinished one: work another executor left running (slurm's
	// CheckNoneActive: an array still queued) must not run the same jobs
	// as this one, whichever executor this is. nil: nothing to check.
	Guard    Guard
	Progress io.Writer // progress lines, a redrawn bar on a terminal; nil: none
	Log      zerolog.Logger
}

// guard is o.Guard's word on dir: nil without one.
func (o Options) guard(ctx context.Context, dir string, locked bool) error {
	if o.Guard == nil {
		return nil
	}
	return o.Guard(ctx, dir, locked)
}

// continueCommand is how the messages of o's run say to resume it.
func (o Options) continueCommand() string {
	if o.Continue == "" {
		return "--resume"
	}
	return o.Continue
}

// Summary is how far a run got.
type Summary struct {
	Dir  string // the run directory; "" when none was opened
	Rows int    // rows of results.parquet: the jobs the journal has
	// Tally counts the rows against this plan; its Failed counts the
	// plan's failed rows, whichever call ran them: a resume that leaves an
	// earlier failure in place has not succeeded either.
	results.Tally
	// Ended is set when every job has run and the manifest records the end
	// time (results.parquet may still have failed to build).
	Ended bool
}

// Run runs the jobs of o.Experiment that its run has not done yet. A failed
// job is journaled as failed and the run goes on; Summary.Failed counts
// the plan's failed rows, this call's and earlier ones'. When ctx ends, the
// jobs journaled so far stay done and the error says how to continue (it
// unwraps to ctx's error).
//
// A new run's directory is created only once a worker is ready (or a job
// has finished): a run that cannot start leaves nothing behind for
// notebooks or --resume to mistake for a run. The kernels_py sources every
// worker reports it loaded (at its start, and by each job's end) are
// checked: the run's rows come from one version of the code unless
// AllowCodeChange, and each row names the sources its worker ran.
func Run(ctx context.Context, o Options) (Summary, error) {
	if o.Executor == nil {
		return Summary{}, fmt.Errorf("run %s: no executor", o.Experiment)
	}
	if err := checkOut(o.Out); err != nil {
		return Summary{}, err
	}
	kernels := kernelsHashes(o.KernelsDir)
	digest := results.KernelsDigest(kernels)
	run, done, err := openRun(ctx, o, kernels, digest)
	if err != nil {
		return Summary{}, err
	}
	defer run.close()
	log := o.Log.With().Str("experiment", o.Experiment).Logger()
	if run.exists() {
		log = log.With().Str("run", run.dir).Logger()
	}

	var todo []sched.Job
	jobs := map[string]Job{}
	planned := make(map[string]bool, len(o.Jobs))
	ranNow := map[string]bool{} // jobs journaled by this call
	for _, j := range o.Jobs {
		planned[j.ID] = true
		if rec, ok := done[j.ID]; ok && !(o.RetryFailed && rec.Status == results.StatusFailed) &&
			!(o.RerunStale && rec.KernelsDigest != digest) {
			continue
		}
		jobs[j.ID] = j
		todo = append(todo, j.Job)
	}
	if run.exists() && len(todo) > 0 {
		if err := run.checkCode(o, log, kernels, digest); err != nil {
			return Summary{}, err
		}
	}
	sum := Summary{}
	log.Info().Int("jobs", len(o.Jobs)).Int("to_run", len(todo)).Int("already_done", len(o.Jobs)-len(todo)).Msg("running")

	out := o.Progress
	if out == nil {
		out = io.Discard
	}
	progress := sched.NewProgress(out, sched.IsTerminal(out), len(o.Jobs), len(o.Jobs)-len(todo))
	current, _ := run.current()
	err = o.Executor.Run(ctx, Batch{
		Dir:           run.dir,
		Jobs:          todo,
		Experiment:    o.Experiment,
		Details:       jobs,
		KernelsDigest: current,
		Continue:      o.continueCommand(),
		Open: func() error {
			_, err := run.get(log)
			return err
		},
		Discard: func() (bool, error) { return run.discard(log) },
		Log:     log,
		Started: func(h worker.Hello) {
			if r, err := run.get(log); err == nil {
				recordVersions(r, h)
			}
		},
		CheckCode: func(k worker.Kernels) error {
			return run.checkCode(o, log, k.Files, k.Digest)
		},
		Done: func(out Outcome) error {
			// A job may import a module edited after its worker said hello:
			// its row names what it ran, which the run must allow.
			var kernels *worker.Kernels
			if out.Record == nil {
				kernels = out.Kernels
			}
			rec, err := run.journal(o, log, kernels, func() results.Record {
				if out.Record != nil {
					return *out.Record
				}
				rec := NewRecord(o.Experiment, jobs[out.Job.ID], out)
				if out.Kernels != nil {
					rec.KernelsDigest = out.Kernels.Digest
				}
				return rec
			})
			var changed *CodeChangedError
			if errors.As(err, &changed) {
				return fmt.Errorf("job %s not journaled: %w", out.Job.ID, err)
			}
			if err != nil {
				return err
			}
			ranNow[rec.JobID] = true
			finished := out.Outcome
			if out.Record != nil {
				finished = outcomeOf(rec, jobs[rec.JobID])
			}
			if rec.Status == results.StatusFailed {
				log.Warn().Str("job", rec.JobID).Str("error", firstLine(rec.Error)).Msg("job failed")
				if finished.Err == nil { // no metrics, or its tensors could not be saved
					finished.Err = errors.New(rec.Error)
				}
			}
			progress.Finished(finished)
			return nil
		},
	})
	progress.Close()
	if err == nil {
		if _, err := run.get(log); err != nil { // nothing ran: the run still exists, complete
			return sum, err
		}
	}
	if run.untouched() {
		// A resume whose executor wrote nothing (a dry run, a refused
		// submission, a stop before any job): the run stays as it was.
		sum.Dir = run.dir
		sum.Tally = results.Count(done, planned, ranNow)
		sum.Rows = len(done)
		if errors.Is(err, context.Canceled) {
			return sum, &interruptedError{done: sum.Done, total: len(o.Jobs), dir: run.dir, resume: o.continueCommand(), err: err}
		}
		return sum, err
	}
	if !run.exists() {
		var nw *sched.NoWorkerError
		if errors.As(err, &nw) {
			return sum, fmt.Errorf("%w. No run directory was created; check the interpreter and device (workbench env), then run again", err)
		}
		if errors.Is(err, context.Canceled) {
			return sum, &interruptedError{total: len(o.Jobs), err: err}
		}
		return sum, err
	}
	sum.Dir = run.dir
	rows, perr := results.BuildParquet(run.dir)
	sum.Rows = rows
	if perr != nil {
		log.Error().Err(perr).Msg("results.parquet not written; the journal has every finished job")
	}
	last, terr := results.Finished(run.dir)
	if terr != nil && err == nil {
		err = terr
	}
	sum.Tally = results.Count(last, planned, ranNow)
	if err != nil {
		var nw *sched.NoWorkerError
		var pathErr *fs.PathError
		switch {
		case errors.Is(err, context.Canceled):
			return sum, &interruptedError{done: sum.Done, total: len(o.Jobs), dir: run.dir, resume: o.continueCommand(), err: err}
		case errors.As(err, &nw):
			return sum, fmt.Errorf("%w. %d of %d jobs are done in %s; fix the cause and continue with: %s",
				err, sum.Done, len(o.Jobs), run.dir, o.continueCommand())
		case errors.As(err, &pathErr) && cannotWrite(pathErr):
			// The run's files could not be written (a full disk, say): the
			// journal keeps what finished, and the run goes on from there.
			return sum, fmt.Errorf("%w. %d of %d jobs are done in %s; once %s can be written again (free space, permissions), continue with: %s",
				err, sum.Done, len(o.Jobs), run.dir, pathErr.Path, o.continueCommand())
		}
		return sum, err
	}
	end := time.Now()
	if err := run.run.UpdateManifest(func(m *results.Manifest) { m.Ended = &end }); err != nil {
		return sum, err
	}
	sum.Ended = true
	log.Info().Int("rows", rows).Int("failed", sum.Failed).Str("run", run.dir).Msg("results written")
	return sum, perr
}

// checkOut makes sure runs can be written under out before any worker
// starts: a bad --out should not cost a worker start-up to find.
func checkOut(out string) error {
	if err := os.MkdirAll(out, 0o755); err != nil {
		return fmt.Errorf("results directory %s: %w", out, err)
	}
	f, err := os.CreateTemp(out, ".write-check-*")
	if err != nil {
		return fmt.Errorf("results directory %s is not writable: %w", out, err)
	}
	f.Close()
	return os.Remove(f.Name())
}

// interruptedError is a run stopped by its context: it tells the user how
// far the run got and how to go on, and unwraps to the context's error.
type interruptedError struct {
	done, total int
	dir         string // "" when the run was stopped before it was created
	resume      string // the command that continues the run
	err         error
}

func (e *interruptedError) Error() string {
	if e.dir == "" { // the cause, a cancelled context, is what the user did: not said again
		return "interrupted before any job finished; no run directory was created"
	}
	return fmt.Sprintf("interrupted: %d of %d jobs are done in %s; continue with: %s", e.done, e.total, e.dir, e.resume)
}

func (e *interruptedError) Unwrap() error { return e.err }

// cannotWrite is a file error that writing can meet and fixing the
// machine (space, quota, permissions, a read-only mount) cures.
func cannotWrite(err *fs.PathError) bool {
	for _, errno := range []syscall.Errno{syscall.ENOSPC, syscall.EDQUOT, syscall.EROFS, syscall.EACCES, syscall.EPERM} {
		if errors.Is(err, errno) {
			return true
		}
	}
	return false
}

// CodeChangedError refuses kernels_py sources other than the ones the run's
// rows were computed with: at a resume, or when a worker starts mid-run
// after an edit.
type CodeChangedError struct {
	Dir              string
	Recorded, Now    string   // kernels digests
	Changed          []string // files, when the run recorded its per-file hashes
	RecordedFilesSet bool
}

func (e *CodeChangedError) Error() string {
	files := "which files is unknown (the run recorded no per-file hashes)"
	if e.RecordedFilesSet {
		files = fmt.Sprintf("%d file(s) changed: %s", len(e.Changed), strings.Join(e.Changed, ", "))
	}
	return fmt.Sprintf("kernels_py changed since %s computed its rows (kernels digest %s then, %s now; %s): "+
		"rows from two versions of the code would mix. Start a new run (without --resume), undo the change, "+
		"or resume with --allow-code-change (every row records the digest of the code it ran on)",
		e.Dir, short(e.Recorded), short(e.Now), files)
}

func short(digest string) string {
	if len(digest) > 12 {
		return digest[:12]
	}
	return digest
}

// lazyRun is the run directory of one Run call: an existing run (resumed)
// or a new one, created on first use.
type lazyRun struct {
	dir  string
	root string
	// pending is a new run's manifest until the run is created: the
	// sources it names may still change (see checkCode).
	pending results.Manifest
	// unlockNew lets go of the experiment's new-run lock (see
	// results.LockNewRun) once the run exists; nil when not held.
	unlockNew func()

	// jobs are the ids of the plan this call runs, which the run records.
	jobs []string

	// opts are the options of the call, which a resume records.
	opts Options

	mu        sync.Mutex
	run       *results.Run
	err       error
	resumed   bool // the run existed before this call
	journaled int  // rows the run had before this call
	rows      int  // rows this call journaled
	// marked says a resumed run records this resume. Until its executor
	// uses the run (Batch.Open, a job's row) the resume writes nothing: a
	// dry run, or a resume refused before it ran anything, leaves the run
	// as it was. changes are the code changes it records then.
	marked  bool
	changes []results.CodeChange
	// before is the run's record of its plan as the resume found it, which
	// discard puts back when the resume ran nothing after all.
	before results.PlanRecord
}

func (l *lazyRun) get(log zerolog.Logger) (*results.Run, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.getLocked(log)
}

func (l *lazyRun) getLocked(log zerolog.Logger) (*results.Run, error) {
	if l.run == nil && l.err == nil {
		if l.run, l.err = results.Create(l.root, l.pending); l.err == nil {
			log.Info().Str("run", l.dir).Msg("run directory created")
			l.releaseNew()
			l.err = l.run.WriteJobs(l.jobs)
		}
	}
	if l.err == nil && l.resumed && !l.marked {
		l.marked = true
		l.err = l.markResumed(log)
	}
	return l.run, l.err
}

// discard removes a new run that holds nothing this call did not write
// itself (see Batch.Discard); the call then goes on as if it had created
// none. A resume that journaled nothing puts back the run's record of its
// plan instead (the segment rows it merged were the run's already).
func (l *lazyRun) discard(log zerolog.Logger) (bool, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.run == nil || l.rows > 0 {
		return false, nil
	}
	if l.resumed {
		if !l.marked {
			return false, nil
		}
		l.marked = false
		return false, l.run.RestorePlanRecord(l.before)
	}
	removed, err := l.run.RemoveEmpty()
	if !removed {
		return false, err
	}
	log.Info().Str("run", l.dir).Msg("run directory removed: nothing ran in it")
	l.run = nil
	l.err = errors.New("the run directory was removed")
	return true, err
}

// untouched says whether this call resumed a run and wrote nothing to it.
func (l *lazyRun) untouched() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.resumed && !l.marked
}

// recordChangeLocked records a code change in the manifest: at once, or,
// for a resume that has not written the run yet, when it does.
func (l *lazyRun) recordChangeLocked(c results.CodeChange) error {
	if l.resumed && !l.marked {
		l.changes = append(l.changes, c)
		return nil
	}
	return l.run.UpdateManifest(func(m *results.Manifest) { m.CodeChanges = append(m.CodeChanges, c) })
}

func (l *lazyRun) releaseNew() {
	if l.unlockNew != nil {
		l.unlockNew()
		l.unlockNew = nil
	}
}

func (l *lazyRun) exists() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.run != nil
}

func (l *lazyRun) close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.run != nil {
		l.run.Close()
	}
	l.releaseNew()
}

// current is the digest and per-file hashes of the sources the run's
// newest rows come from.
func (l *lazyRun) current() (string, map[string]string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.currentLocked()
}

func (l *lazyRun) currentLocked() (string, map[string]string) {
	if n := len(l.changes); n > 0 && !l.marked { // a resume's change, recorded once it writes the run
		return l.changes[n-1].KernelsDigest, l.changes[n-1].KernelsHash
	}
	if l.run == nil {
		return l.pending.CurrentKernels()
	}
	return l.run.Manifest().CurrentKernels()
}

// markResumed records that a resume goes on with the call's plan: it
// journals what the run's tasks recorded in their segments and no writer
// merged yet, then records when, from which script, its jobs and the code
// changes it found.
func (l *lazyRun) markResumed(log zerolog.Logger) error {
	o := l.opts
	var err error
	if l.before, err = l.run.PlanRecord(); err != nil {
		return err
	}
	if err := mergeSegments(l.run, log); err != nil {
		return err
	}
	// The plan's ids first: stopped between the two writes, the run then
	// holds the new plan's ids beside the old job count, which is judged
	// by the ids (a complete run is one with a row for each).
	if err := l.run.WriteJobs(l.jobs); err != nil {
		return err
	}
	var now results.Manifest
	if m := l.run.Manifest(); m.Rebuilt != nil && m.File == "" {
		// What this resume runs is known; the rebuilt manifest says so.
		now = newManifest(o, m.Started, nil, "")
	}
	at := time.Now()
	return l.run.UpdateManifest(func(m *results.Manifest) {
		if now.File != "" {
			m.File, m.FileHash, m.Device, m.Protocol, m.Dtypes = now.File, now.FileHash, now.Device, now.Protocol, now.Dtypes
			if m.Versions == nil {
				m.Versions = map[string]string{}
			}
			maps.Copy(m.Versions, now.Versions)
		}
		if len(m.Scripts) == 0 && m.File != "" && m.Rebuilt == nil { // a run from before scripts were recorded: its first one
			m.Scripts = append(m.Scripts, m.CurrentScript())
		}
		m.Resumed = append(m.Resumed, at)
		m.Scripts = append(m.Scripts, results.Script{At: at, File: o.File, FileHash: o.FileHash, Jobs: len(o.Jobs)})
		m.CodeChanges = append(m.CodeChanges, l.changes...)
		m.Ended = nil
		m.Jobs = len(o.Jobs)
	})
}

// checkCode refuses kernels_py sources other than those of the run's
// newest rows, unless allowed; then the manifest records the change.
func (l *lazyRun) checkCode(o Options, log zerolog.Logger, kernels map[string]string, digest string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.checkCodeLocked(o, log, kernels, digest)
}

func (l *lazyRun) checkCodeLocked(o Options, log zerolog.Logger, kernels map[string]string, digest string) error {
	recorded, files := l.currentLocked()
	if recorded == digest {
		return nil
	}
	var changed []string
	if len(files) > 0 {
		changed = results.ChangedFiles(files, kernels)
	}
	if l.resumed && l.journaled == 0 && l.rows == 0 {
		// No row yet, so nothing computed on the earlier sources can mix
		// with what this resume computes: go on, and record the change.
		log.Info().Str("run", l.dir).Str("was", short(recorded)).Str("now", short(digest)).Strs("changed", changed).
			Msg("kernels_py changed since this run started, but it has no rows yet: going on with today's sources")
		return l.recordChangeLocked(results.CodeChange{At: time.Now(), KernelsDigest: digest,
			Changed: changed, KernelsHash: kernels, Git: gitState(o.KernelsDir)})
	}
	if !l.resumed && l.rows == 0 {
		// No row yet: the run is on the sources its workers loaded, which
		// were edited after this process hashed them.
		log.Info().Str("was", short(recorded)).Str("now", short(digest)).Strs("changed", changed).
			Msg("kernels_py changed while the run was starting; the run records the sources its workers loaded")
		use := func(m *results.Manifest) {
			m.KernelsDigest, m.KernelsHash, m.Git = digest, kernels, gitState(o.KernelsDir)
		}
		if l.run == nil {
			use(&l.pending)
			return nil
		}
		return l.run.UpdateManifest(use)
	}
	if recorded == "" {
		log.Warn().Str("run", l.dir).Msg("this run recorded no kernels digest: rows from before this resume cannot be told apart by code version")
		return l.recordChangeLocked(results.CodeChange{At: time.Now(), KernelsDigest: digest,
			KernelsHash: kernels, Git: gitState(o.KernelsDir)})
	}
	e := &CodeChangedError{Dir: l.dir, Recorded: recorded, Now: digest, RecordedFilesSet: len(files) > 0, Changed: changed}
	if !o.AllowCodeChange {
		return e
	}
	log.Warn().Str("run", l.dir).Str("was", short(recorded)).Str("now", short(digest)).Strs("changed", e.Changed).
		Msg("kernels_py changed since this run's rows were computed; going on as --allow-code-change says (rows carry kernels_digest)")
	return l.recordChangeLocked(results.CodeChange{At: time.Now(), KernelsDigest: digest,
		Changed: e.Changed, KernelsHash: kernels, Git: gitState(o.KernelsDir)})
}

// journal journals the record rec makes of a finished job that ran on
// kernels (nil: unknown, or checked where it ran), once checkCode allows
// them. One step under the run's lock: no worker starting meanwhile can
// change the sources the run records between the check and the row.
func (l *lazyRun) journal(o Options, log zerolog.Logger, kernels *worker.Kernels, rec func() results.Record) (results.Record, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if kernels != nil {
		if err := l.checkCodeLocked(o, log, kernels.Files, kernels.Digest); err != nil {
			return results.Record{}, err
		}
	}
	run, err := l.getLocked(log)
	if err != nil {
		return results.Record{}, err
	}
	r := rec()
	if r.KernelsDigest == "" {
		r.KernelsDigest, _ = l.currentLocked()
	}
	if err := run.Append(r); err != nil {
		return r, err
	}
	l.rows++
	return r, nil
}

// openRun, with Resume, opens and locks the newest run and returns what its
// journal has done; otherwise (or with no run to resume) it names a new run
// directory, created when first used.
func openRun(ctx context.Context, o Options, kernels map[string]string, digest string) (*lazyRun, map[string]results.Record, error) {
	var unlockNew func()
	if o.Resume {
		// Resumes started together that find no run must not each start
		// one: the first holds this lock until its run exists, and the
		// others then find that run (locked while it is written).
		var err error
		unlockNew, err = results.LockNewRun(ctx, o.Out, o.Experiment, func() {
			o.Log.Info().Str("experiment", o.Experiment).Msg("another resume of this experiment is starting its run: waiting for it")
		})
		if err != nil {
			return nil, nil, err
		}
		dir, err := results.Latest(o.Out, o.Experiment)
		if err != nil || dir != "" {
			unlockNew()
		}
		if err != nil {
			return nil, nil, err
		}
		if dir != "" {
			return openExisting(ctx, o, dir)
		}
		// Most often a mistake (another --out, a renamed experiment): say where.
		if !o.StartIfNone {
			o.Log.Warn().Str("experiment", o.Experiment).Msgf("nothing to resume: %s holds no run of %s; starting a new run there "+
				"(if the run to resume is elsewhere, stop and give its results root with --out)", absPath(filepath.Join(o.Out, o.Experiment)), o.Experiment)
		}
	} else {
		warnUnfinished(ctx, o)
	}
	m := newManifest(o, time.Now(), kernels, digest)
	dir, err := results.RunDir(o.Out, m)
	if err != nil {
		if unlockNew != nil {
			unlockNew()
		}
		return nil, nil, err
	}
	return &lazyRun{dir: dir, root: o.Out, pending: m, unlockNew: unlockNew, jobs: jobIDs(o.Jobs)}, nil, nil
}

// warnUnfinished warns, before a new run starts, when the newest run of
// the experiment did not finish: resuming it was most likely meant. Only a
// warning: a fresh start is a choice too. It counts what the run holds,
// its tasks' segments included, and where the run's work still goes on
// (a guard refuses it: a Slurm array in the queue) says so, not to resume.
func warnUnfinished(ctx context.Context, o Options) {
	dir, err := results.Latest(o.Out, o.Experiment)
	if err != nil || dir == "" {
		return
	}
	if h, writing := results.Writer(dir); writing { // not unfinished: under way elsewhere
		o.Log.Warn().Str("experiment", o.Experiment).Msgf("the newest run of %s, %s, is being written by %s; "+
			"this starts a new run beside it", o.Experiment, dir, h.Name())
		return
	}
	m, err := results.ReadManifest(dir)
	if err == nil && m.Ended != nil {
		return
	}
	done, _ := results.Recorded(dir)
	progress := fmt.Sprintf("%d of %d jobs done", len(done), m.Jobs)
	if m.Jobs == 0 { // no manifest: the plan's size is unknown
		progress = fmt.Sprintf("%d jobs done", len(done))
	}
	if err := o.guard(ctx, dir, false); err != nil { // without its lock: the guard only looks
		o.Log.Warn().Str("experiment", o.Experiment).Msgf("the newest run of %s, %s, is unfinished (%s) and may "+
			"still be under way; this starts a new run beside it. %v", o.Experiment, dir, progress, err)
		return
	}
	o.Log.Warn().Str("experiment", o.Experiment).Msgf("the newest run of %s, %s, is unfinished (%s); "+
		"this starts a new run beside it. To continue that one instead, stop and run: %s",
		o.Experiment, dir, progress, o.continueCommand())
}

func jobIDs(jobs []Job) []string {
	ids := make([]string, len(jobs))
	for i, j := range jobs {
		ids[i] = j.ID
	}
	return ids
}

// absPath is p made absolute where it can be, for messages.
func absPath(p string) string {
	if abs, err := filepath.Abs(p); err == nil {
		return abs
	}
	return p
}

// openExisting opens the run in dir to resume it.
func openExisting(ctx context.Context, o Options, dir string) (*lazyRun, map[string]results.Record, error) {
	journal := filepath.Join(dir, results.JournalFile)
	_, statErr := os.Stat(journal)
	hadJournal := !errors.Is(statErr, fs.ErrNotExist)
	run, err := results.Open(dir)
	if err != nil {
		return nil, nil, err
	}
	fail := func(err error) (*lazyRun, map[string]results.Record, error) {
		// A refused resume leaves the run as it found it: Open creates the journal it appends to, and an
		// empty one where there was none would hide the run's results.parquet from compare, which reads
		// the table only of a run without a journal.
		if info, serr := os.Stat(journal); !hadJournal && serr == nil && info.Size() == 0 {
			os.Remove(journal)
		}
		run.Close()
		return nil, nil, err
	}
	m := run.Manifest()
	if m.Experiment != "" && m.Experiment != o.Experiment {
		// A run copied or moved into another experiment's folder: resuming
		// it would put this experiment's rows into that one's run.
		return fail(fmt.Errorf("resume %s: it is a run of experiment %s, not %s (it lies in %s's folder): move it back "+
			"to %s, or start a new run of %s without --resume", dir, m.Experiment, o.Experiment, o.Experiment,
			filepath.Join(o.Out, m.Experiment), o.Experiment))
	}
	// Under the run's lock, so no other resume submits work in between.
	if err := o.guard(ctx, dir, true); err != nil {
		return fail(err)
	}
	if m.Rebuilt != nil {
		o.Log.Warn().Str("run", dir).Msg("manifest.json was missing: rebuilt from the journal (the git state and source hashes of the earlier jobs are unknown)")
	}
	// What the run holds, its tasks' segments included: the resume merges
	// them into the journal once it writes the run.
	done, err := results.Recorded(dir)
	if err != nil {
		return fail(err)
	}
	// A table ahead of its journal lost the journal (deleted, or cut short in
	// a copy): resuming would run those jobs again and rebuild the table
	// without the rows it holds.
	if rows, ahead := results.TableAhead(dir, len(done)); ahead {
		return fail(fmt.Errorf("resume %s: its %s has %d rows but its %s only %d finished jobs: the journal, which a "+
			"resume goes by, was lost or cut short, and resuming would run those jobs again and rebuild the table "+
			"without their rows. Restore %s (from a backup or the copy it came from), or start a new run without "+
			"--resume (this run keeps its table)", dir, results.ParquetFile, rows, results.JournalFile, len(done),
			results.JournalFile))
	}
	if prev := m.CurrentScript(); prev.FileHash != "" && prev.FileHash != o.FileHash {
		o.Log.Warn().Str("run", dir).Str("was", prev.File).Str("now", o.File).
			Msg("the script changed since this run's last start; jobs whose ids changed run again, and rows of jobs not in this plan stay in the run")
	}
	return &lazyRun{dir: dir, root: o.Out, run: run, resumed: true, journaled: len(done), jobs: jobIDs(o.Jobs), opts: o}, done, nil
}

// mergeSegments journals what tasks of the run recorded in their segments
// and no writer merged yet (a host that stopped following them).
func mergeSegments(run *results.Run, log zerolog.Logger) error {
	merger, err := run.NewMerger()
	if err != nil {
		return err
	}
	merged, err := merger.Merge()
	if len(merged) > 0 {
		log.Info().Str("run", run.Dir).Int("jobs", len(merged)).Msg("journaled the jobs tasks recorded in their segments")
	}
	return err
}

// outcomeOf is what progress reports of a job recorded elsewhere.
func outcomeOf(rec results.Record, j Job) sched.Outcome {
	out := sched.Outcome{Job: j.Job, Attempts: rec.Attempts, Duration: time.Duration(rec.Seconds * float64(time.Second))}
	if out.Job.ID == "" {
		out.Job.ID = rec.JobID
	}
	if rec.Status != results.StatusOK {
		out.Err = errors.New(rec.Error)
	}
	return out
}

// NewRecord is the journal line of a finished job. A job succeeded when it
// returned metrics; only then are its tensors saved, and failing to save
// them fails the job.
func NewRecord(experiment string, j Job, out Outcome) results.Record {
	rec := results.Record{JobID: j.ID, Experiment: experiment, Method: j.Method, Params: j.Params,
		WorkloadName: j.WorkloadName, Workload: j.Workload,
		Status: results.StatusOK, Attempts: out.Attempts, Seconds: out.Duration.Seconds(), WallSeconds: out.Wall.Seconds(),
		Finished: time.Now()}
	if out.Err != nil {
		rec.Status = results.StatusFailed
		rec.Error = out.Err.Error()
		var je *worker.JobError
		if errors.As(out.Err, &je) {
			rec.Extra = map[string]any{"traceback": je.Traceback}
		}
		return rec
	}
	var res struct {
		Metrics  map[string]any `json:"metrics"`
		PerLayer map[string]any `json:"per_layer"`
		PerStep  map[string]any `json:"per_step"` // a job that generates: its tokens, KL per step
		Extra    map[string]any `json:"extra"`    // anything else a job reports (e.g. the method it was paired with)
	}
	if err := json.Unmarshal(out.Result, &res); err != nil || res.Metrics == nil {
		rec.Status = results.StatusFailed
		rec.Error = fmt.Sprintf("job returned no metrics: %.200s", out.Result)
		return rec
	}
	rec.Metrics = res.Metrics
	for prefix, lists := range map[string]map[string]any{"per_layer_": res.PerLayer, "per_step_": res.PerStep, "": res.Extra} {
		for k, v := range lists {
			if rec.Extra == nil {
				rec.Extra = map[string]any{}
			}
			rec.Extra[prefix+k] = v
		}
	}
	if out.SaveTensors == nil {
		return rec
	}
	paths, err := out.SaveTensors()
	if len(paths) > 0 && rec.Extra == nil {
		rec.Extra = map[string]any{}
	}
	for name, p := range paths {
		rec.Extra["tensor_"+name] = p
	}
	if err != nil {
		rec.Status, rec.Error = results.StatusFailed, err.Error()
	}
	return rec
}

func firstLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}

// tensorPath is where a run keeps a job's tensor, relative to the run directory.
func tensorPath(jobID, name string) string {
	return filepath.Join(tensorDir(jobID), tensor.NPYName(name))
}

// tensorDir is the folder of a job's tensors, relative to the run directory.
func tensorDir(jobID string) string { return filepath.Join(results.TensorsDir, jobID) }
