package slurm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/runner"
)

// Executor runs a batch as one Slurm job array (see the package doc).
type Executor struct {
	Options Options
	// Workbench is the binary every task runs; the nodes must see it at
	// this path. TaskArgs are its global flags there (--kernels, --python,
	// --device), Env the variables the batch script exports.
	Workbench string
	TaskArgs  []string
	Env       []string
	// File and FileHash are the experiment script; KernelsDir holds the
	// kernels_py the tasks must see too.
	File, FileHash string
	KernelsDir     string
	// DryRun prints the batch script to Out and submits nothing (Run then
	// returns ErrDryRun). Detach submits and returns a *DetachedError
	// without following the array.
	DryRun, Detach bool
	Out            io.Writer
	// Interrupt is asked, when the context ends while the array runs,
	// whether to cancel it (true) or detach and leave it running (false).
	// Nil: cancel.
	Interrupt func(arrayJob string) bool
	Poll      time.Duration // how often squeue and the segments are read; 0: 2 s

	// probed is the results root a probe job passed for: the experiments of
	// one script share it, and the next one's probe would only wait in the
	// queue behind the array just submitted.
	probed string
}

var _ runner.Executor = (*Executor)(nil)

// ErrDryRun is what Run returns after printing the script of a dry run.
var ErrDryRun = errors.New("dry run: nothing submitted")

// DetachedError is a host that stopped following an array that goes on.
type DetachedError struct {
	Dir      string
	ArrayJob string
}

func (e *DetachedError) Error() string {
	return fmt.Sprintf("detached from Slurm array %s, which goes on: `workbench status %s` follows it and journals "+
		"its jobs (scancel %s stops it)", e.ArrayJob, e.Dir, e.ArrayJob)
}

// Run submits b's jobs as one array and follows it until every job is
// recorded or every task has ended.
func (e *Executor) Run(ctx context.Context, b runner.Batch) error {
	if len(b.Jobs) == 0 {
		if e.DryRun { // returning nil would have the runner record a resume that ran nothing
			fmt.Fprintf(e.Out, "# every job of experiment %s has a row in %s: nothing to submit\n", b.Experiment, b.Dir)
			return ErrDryRun
		}
		return nil
	}
	if err := e.Options.Check(); err != nil {
		return err
	}
	if err := CheckOutPath(b.Dir); err != nil {
		return err
	}
	if !e.DryRun {
		if err := Installed(); err != nil {
			return err
		}
		// An earlier array of a resumed run still queued was refused when
		// the runner opened it (its Guard, CheckNoneActive).
		if err := CheckPartition(ctx, e.Options.Partition); err != nil {
			return err
		}
	} else if Installed() == nil && e.Options.Partition != "" {
		// A dry run also works where Slurm is not installed; where it is, a
		// partition the cluster lacks is refused as the submission would be.
		if names, err := Partitions(ctx); err == nil {
			if err := partitionIn(names, e.Options.Partition); err != nil {
				return err
			}
		}
	}
	jobs := make([]runner.Job, len(b.Jobs))
	for i, j := range b.Jobs {
		jobs[i] = b.Details[j.ID]
		jobs[i].Job = j
	}
	shards := e.Options.Shards
	if shards == 0 {
		shards = DefaultShards
	}
	digest, hashes := runner.KernelsDigestOf(e.KernelsDir)
	plan := Plan{Submission: newSubmissionID(time.Now()), Experiment: b.Experiment, RunDir: b.Dir, File: e.File,
		FileHash: e.FileHash, KernelsDigest: digest, KernelsHash: hashes, Shards: shard(jobs, shards)}
	script := e.script(plan)
	if e.DryRun {
		fmt.Fprint(e.Out, script)
		return ErrDryRun
	}
	// The probe writes beside the run, which exists only once the probe passed: a run that cannot start
	// leaves nothing for --resume to mistake for one.
	if root := filepath.Dir(filepath.Dir(b.Dir)); e.probed != root {
		if err := e.probe(ctx, filepath.Dir(b.Dir), plan.Submission, b.Log); err != nil {
			return err
		}
		e.probed = root
	}
	if b.Open != nil {
		if err := b.Open(); err != nil {
			return err
		}
	}
	id, err := e.submit(ctx, b, plan, script)
	if err != nil {
		return err
	}
	sub := Submission{ID: plan.Submission, ArrayJob: id, Tasks: len(plan.Shards), Jobs: len(jobs), Submitted: time.Now(),
		Resume: b.Continue}
	if err := appendSubmission(b.Dir, sub); err != nil {
		return fmt.Errorf("submitted array %s but could not record it (%w): scancel %s, then run again", id, err, id)
	}
	b.Log.Info().Str("array", id).Int("tasks", sub.Tasks).Int("jobs", sub.Jobs).Str("script", filepath.Join(b.Dir, Dir, plan.Submission, scriptFile)).
		Msg("submitted to Slurm")
	if e.Detach {
		return &DetachedError{Dir: b.Dir, ArrayJob: id}
	}
	pending := map[string]bool{}
	for _, j := range jobs {
		pending[j.ID] = true
	}
	f := &Follow{RunDir: b.Dir, Submission: sub, Plan: plan, Pending: pending, Log: b.Log, Poll: e.Poll,
		Interrupt: e.Interrupt,
		Deliver: func(rec results.Record) error {
			return b.Done(runner.Outcome{Record: &rec})
		}}
	return f.Run(ctx)
}

// submit writes the plan and batch script of an array into the run and
// submits it. Where that fails before anything was submitted, what it
// wrote goes again, and so does a run this call created and nothing ran
// in (Batch.Discard): a run that never got an array holds nothing a
// later run should take for an unfinished one.
func (e *Executor) submit(ctx context.Context, b runner.Batch, plan Plan, script string) (string, error) {
	subDir := filepath.Join(b.Dir, Dir, plan.Submission)
	undo := func(err error) (string, error) {
		os.RemoveAll(subDir)
		os.Remove(filepath.Join(b.Dir, Dir)) // unless an earlier submission's files are in it
		if b.Discard != nil {
			if removed, derr := b.Discard(); derr != nil {
				return "", errors.Join(err, derr)
			} else if removed {
				return "", fmt.Errorf("%w: nothing was submitted, and the run directory %s was removed "+
					"(--dry-run prints the batch script)", err, b.Dir)
			}
		}
		return "", fmt.Errorf("%w: nothing was submitted (--dry-run prints the batch script)", err)
	}
	path, err := writePlan(plan)
	if err != nil {
		return undo(fmt.Errorf("write the plan: %w", err))
	}
	scriptPath := filepath.Join(filepath.Dir(path), scriptFile)
	if err := os.WriteFile(scriptPath, []byte(script), 0o755); err != nil {
		return undo(fmt.Errorf("write the batch script: %w", err))
	}
	id, err := Submit(ctx, scriptPath)
	switch {
	case err == nil:
		return id, nil
	case ctx.Err() != nil, errors.Is(err, errNoJobID):
		// sbatch may have queued the array before it was stopped, or said
		// nothing of it: its tasks would need the plan. Unrecorded, it is
		// not seen by a resume, which would run its jobs too.
		name := jobName(plan)
		return "", fmt.Errorf("%w: the array may be queued without its id recorded (squeue --name=%s shows it): "+
			"a --resume finds it by that name and records it, and is refused while it runs (workbench status "+
			"follows it then; scancel stops it); its plan is kept in %s", err, name, subDir)
	}
	return undo(fmt.Errorf("sbatch refused the array: %w", err))
}

// script is the array's batch script: one task per shard, each running
// `workbench shard PLAN --shard $SLURM_ARRAY_TASK_ID`.
func (e *Executor) script(p Plan) string {
	var s strings.Builder
	dir := filepath.Join(p.RunDir, Dir, p.Submission)
	array := fmt.Sprintf("0-%d", len(p.Shards)-1)
	if e.Options.MaxRunning > 0 {
		array += fmt.Sprintf("%%%d", e.Options.MaxRunning)
	}
	fmt.Fprintln(&s, "#!/bin/bash")
	fmt.Fprintf(&s, "#SBATCH --job-name=%s\n", jobName(p))
	fmt.Fprintf(&s, "#SBATCH --array=%s\n", array)
	fmt.Fprintf(&s, "#SBATCH --output=%s\n", filepath.Join(dir, "task-%a.log"))
	fmt.Fprintln(&s, "#SBATCH --open-mode=append") // a requeued task's log keeps its first attempt's output
	for _, line := range e.Options.directives() {
		fmt.Fprintln(&s, line)
	}
	jobs := 0
	for _, sh := range p.Shards {
		jobs += len(sh)
	}
	fmt.Fprintf(&s, "# %d jobs of experiment %s in %d shards; each task runs one shard of\n# %s\n",
		jobs, p.Experiment, len(p.Shards), PlanPath(p.RunDir, p.Submission))
	fmt.Fprintln(&s, "set -euo pipefail")
	for _, env := range e.Env {
		name, value, _ := strings.Cut(env, "=")
		fmt.Fprintf(&s, "export %s=%s\n", name, quote(value))
	}
	args := []string{quote(e.Workbench)}
	for _, a := range e.TaskArgs {
		args = append(args, quote(a))
	}
	args = append(args, "shard", quote(PlanPath(p.RunDir, p.Submission)), "--shard", `"$SLURM_ARRAY_TASK_ID"`)
	fmt.Fprintf(&s, "exec %s\n", strings.Join(args, " "))
	return s.String()
}

// quote makes s one word for bash.
func quote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// CheckOutPath refuses a results path that the array's batch script could
// not name its tasks' logs under: sbatch's --output takes no space, and
// reads % as a pattern.
func CheckOutPath(path string) error {
	if strings.ContainsAny(path, " \t%") {
		return fmt.Errorf("%s holds a space or a %%, which sbatch's --output cannot take: give --out a path "+
			"without them", path)
	}
	return nil
}

// probe runs one small job that checks, on a node, that the workbench
// binary is there and the run directory is writable (the host then sees
// what it wrote): tasks that cannot see either would fail one by one.
//
// It is a batch script with the array's #SBATCH lines (less the CPUs and
// memory it does not need), so sbatch reads the extra lines as it reads
// the array's. Interrupted, it cancels the job, which would otherwise
// stay queued and, run later, leave its mark beside the run.
func (e *Executor) probe(ctx context.Context, dir, submission string, log zerolog.Logger) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	mark := filepath.Join(dir, ".vlkv-probe-"+submission)
	defer os.Remove(mark)
	name := "vlkv-probe." + submission // a dot: no array's name (jobName) can be it
	var script strings.Builder
	fmt.Fprintln(&script, "#!/bin/bash")
	fmt.Fprintf(&script, "#SBATCH --job-name=%s\n#SBATCH --output=/dev/null\n", name)
	for _, line := range e.probeOptions() {
		fmt.Fprintln(&script, line)
	}
	fmt.Fprintf(&script, "[ -x %s ] || exit 3\ntouch %s || exit 4\n", quote(e.Workbench), quote(mark))
	log.Info().Str("dir", dir).Msg("checking that the nodes see the results directory: a probe job, which waits " +
		"in the queue like any job")
	if err := checkConf("sbatch"); err != nil {
		return err
	}
	var stdout lockedBuffer
	var stderr bytes.Buffer
	var cancelErr error
	cancelled := false // by its id, while sbatch waited
	c := exec.CommandContext(ctx, "sbatch", "--parsable", "--wait")
	c.Stdin = strings.NewReader(script.String())
	c.Stdout, c.Stderr = &stdout, &stderr
	// sbatch --wait prints the job id as it submits: cancel the job, and let sbatch return as it ends.
	c.Cancel = func() error {
		id := jobID(stdout.String())
		if id == "" { // not submitted yet, or its id not printed: cancelled by name below
			return c.Process.Kill()
		}
		cctx, cancel := context.WithTimeout(context.Background(), endedGrace)
		defer cancel()
		cancelErr, cancelled = Cancel(cctx, id), true
		return cancelErr
	}
	c.WaitDelay = endedGrace
	err := c.Run()
	out := strings.TrimSpace(stderr.String())
	var exit *exec.ExitError
	switch {
	case ctx.Err() != nil:
		id := jobID(stdout.String())
		if !cancelled { // its id came too late for Cancel, or never: by id if printed now, else by name
			cctx, cancel := context.WithTimeout(context.Background(), endedGrace)
			defer cancel()
			if id != "" {
				cancelErr = Cancel(cctx, id)
			} else {
				_, cancelErr = command(cctx, "scancel", "--name="+name)
				id = "--name=" + name
			}
		}
		if cancelErr != nil {
			return fmt.Errorf("interrupted, and cancelling the probe job failed (%w): stop it with scancel %s",
				cancelErr, id)
		}
		log.Warn().Str("job", id).Msg("cancelled the probe job")
		return ctx.Err()
	case errors.As(err, &exit) && exit.ExitCode() == 3:
		return fmt.Errorf("the nodes do not see the workbench binary %s: put it on a filesystem they share (the "+
			"tasks run this binary)", e.Workbench)
	case errors.As(err, &exit) && exit.ExitCode() == 4:
		return notShared(dir)
	case err != nil:
		if nc := notConfigured("sbatch", out); nc != nil {
			return nc
		}
		if out == "" {
			out = err.Error()
		}
		return fmt.Errorf("the probe job failed: %s", out)
	}
	if _, err := os.Stat(mark); err != nil {
		return notShared(dir)
	}
	return nil
}

// probeOptions are the probe's #SBATCH lines: the array's, but for the CPUs
// and memory a task asks for, and 5 minutes (it needs seconds, and a
// shorter limit waits less in the queue).
func (e *Executor) probeOptions() []string {
	probe := e.Options
	probe.Time = "5:00"
	probe.CPUsPerTask, probe.Mem = 0, ""
	return probe.directives()
}

// jobID is the job id sbatch --parsable printed ("id" or "id;cluster").
func jobID(out string) string {
	line, _, _ := strings.Cut(strings.TrimSpace(out), "\n")
	id, _, _ := strings.Cut(line, ";")
	return strings.TrimSpace(id)
}

// lockedBuffer is a command's output read while the command runs.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func notShared(runDir string) error {
	return fmt.Errorf("the nodes cannot see the results directory %s (a probe job could not write there, or what it "+
		"wrote did not appear here): give --out a directory on a filesystem the nodes share", runDir)
}

// CheckNoneActive refuses to write a run while an earlier array of it is
// still queued or running: its tasks would run the same jobs as the
// writer, locally or in another array. It asks squeue about every array
// the run submitted; where it cannot, it refuses too, saying why.
// It is the runner's Guard of every run (runner.Options.Guard).
func CheckNoneActive(ctx context.Context, runDir string, locked bool) error {
	found, err := unrecorded(ctx, runDir)
	if err != nil {
		return err
	}
	if locked { // followed and guarded from now on as any other
		for _, sub := range found {
			if err := appendSubmission(runDir, sub); err != nil {
				return fmt.Errorf("record Slurm array %s of %s, found queued without its id recorded: %w",
					sub.ArrayJob, runDir, err)
			}
		}
	}
	subs, err := Submissions(runDir)
	if err != nil {
		return err
	}
	if !locked {
		subs = append(subs, found...)
	}
	for _, sub := range subs {
		tasks, err := Tasks(ctx, sub.ArrayJob)
		if err != nil {
			return &UnknownStateError{Dir: runDir, ArrayJob: sub.ArrayJob, Err: err}
		}
		for _, t := range tasks {
			if !t.Terminal() {
				return &ActiveError{Dir: runDir, ArrayJob: sub.ArrayJob, Tasks: tasks}
			}
		}
	}
	return nil
}

// ActiveError is a run whose Slurm array is still queued or running.
type ActiveError struct {
	Dir      string
	ArrayJob string
	Tasks    []TaskState
}

func (e *ActiveError) Error() string {
	return fmt.Sprintf("Slurm array %s of %s is still in the queue (%s): its tasks run the jobs it holds. Follow it "+
		"with `workbench status %s`, or stop it (scancel %s) before running them again", e.ArrayJob, e.Dir,
		summarize(e.Tasks), e.Dir, e.ArrayJob)
}

// UnknownStateError is a run with a Slurm array that squeue cannot be asked
// about here (no Slurm commands, no configuration): it may still run.
type UnknownStateError struct {
	Dir      string
	ArrayJob string
	Err      error
}

func (e *UnknownStateError) Error() string {
	why := e.Err.Error()
	var missing *NotInstalledError
	if errors.As(e.Err, &missing) { // its own text suggests the local executor, which is refused as well
		why = "no " + missing.Command + " on PATH"
	}
	return fmt.Sprintf("%s ran as Slurm array %s, and whether that still runs cannot be told here (%s): resume it on "+
		"a machine of the cluster (a login node), where squeue can say", e.Dir, e.ArrayJob, why)
}

func (e *UnknownStateError) Unwrap() error { return e.Err }

// jobName is the Slurm job name of a submission's array: its experiment
// and its submission, by which squeue finds an array whose id the host
// never recorded.
func jobName(p Plan) string { return "vlkv-" + p.Experiment + "-" + p.Submission }

// unrecorded asks squeue for the array of every submission whose plan was
// written but whose id was never recorded (the host was killed while sbatch
// ran, or sbatch queued it and said no id) and returns those it finds.
func unrecorded(ctx context.Context, runDir string) ([]Submission, error) {
	entries, err := os.ReadDir(filepath.Join(runDir, Dir))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	subs, err := Submissions(runDir)
	if err != nil {
		return nil, err
	}
	var found []Submission
	recorded := map[string]bool{}
	for _, sub := range subs {
		recorded[sub.ID] = true
	}
	for _, e := range entries {
		if !e.IsDir() || recorded[e.Name()] {
			continue
		}
		path := PlanPath(runDir, e.Name())
		info, err := os.Stat(path)
		if err != nil { // a folder of the run's without a plan
			continue
		}
		plan, err := ReadPlan(path)
		if err != nil { // cut short by a kill while it was written: sbatch, which comes after, never ran
			continue
		}
		id, err := arrayOf(ctx, plan)
		var ambiguous *ambiguousArrayError
		if errors.As(err, &ambiguous) {
			return nil, fmt.Errorf("%s: %w: stop the ones that are not this run's (scancel ID) before running it "+
				"again", runDir, err)
		}
		if err != nil {
			return nil, &UnknownStateError{Dir: runDir, ArrayJob: "of submission " + plan.Submission, Err: err}
		}
		if id == "" { // never queued, or ended and aged out of squeue
			continue
		}
		jobs := 0
		for _, sh := range plan.Shards {
			jobs += len(sh)
		}
		found = append(found, Submission{ID: plan.Submission, ArrayJob: id, Tasks: len(plan.Shards), Jobs: jobs,
			Submitted: info.ModTime()})
	}
	return found, nil
}

// ambiguousArrayError is a submission's job name that squeue gives more
// than one job (someone else's jobs named so).
type ambiguousArrayError struct {
	Name string
	IDs  []string
}

func (e *ambiguousArrayError) Error() string {
	return fmt.Sprintf("squeue lists %d jobs named %s (%s), where one array was submitted", len(e.IDs), e.Name,
		strings.Join(e.IDs, ", "))
}

// arrayOf is the id of the array squeue knows by plan's submission; "" if
// none. Every partition is asked (-a: hidden ones too).
func arrayOf(ctx context.Context, plan Plan) (string, error) {
	out, err := command(ctx, "squeue", "-a", "-h", "-t", "all", "--name="+jobName(plan), "-o", "%F")
	if err != nil {
		return "", err
	}
	ids := map[string]bool{} // running tasks are listed apart, each with the array's id
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if id := strings.TrimSpace(line); id != "" {
			ids[id] = true
		}
	}
	if len(ids) > 1 {
		return "", &ambiguousArrayError{Name: jobName(plan), IDs: slices.Sorted(maps.Keys(ids))}
	}
	for id := range ids {
		return id, nil
	}
	return "", nil
}
