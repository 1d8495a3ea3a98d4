package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/mattn/go-isatty"
	"github.com/spf13/cobra"

	"github.com/vlkv/vlkv/gohost/pyrt"
	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/runner"
	"github.com/vlkv/vlkv/gohost/sched"
	"github.com/vlkv/vlkv/gohost/slurm"
	"github.com/vlkv/vlkv/gohost/worker"
)

// slurmFlags are run's options for --executor slurm.
type slurmFlags struct {
	executor     enumFlag
	opts         slurm.Options
	dryRun       bool
	detach       bool
	runtimeCache string
}

func (f *slurmFlags) add(cmd *cobra.Command) {
	f.executor = enumFlag{value: "local", allowed: []string{"local", "slurm"}}
	fl := cmd.Flags()
	fl.Var(&f.executor, "executor", "where jobs run: local (workers on this machine) or slurm (one job array on a Slurm cluster)")
	fl.StringVar(&f.opts.Partition, "partition", "", "slurm: partition (sbatch --partition)")
	fl.StringVar(&f.opts.Account, "account", "", "slurm: account (sbatch --account)")
	fl.StringVar(&f.opts.Time, "time", "", "slurm: time limit per task: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, e.g. 2:00:00 (sbatch --time)")
	fl.StringVar(&f.opts.GRES, "gres", "", "slurm: generic resources per task, e.g. gpu:1 (sbatch --gres)")
	fl.IntVar(&f.opts.CPUsPerTask, "cpus-per-task", 0, "slurm: CPUs per task (sbatch --cpus-per-task); default: the cluster's")
	fl.StringVar(&f.opts.Mem, "mem", "", "slurm: memory per task, a size with an optional K/M/G/T suffix (megabytes without), e.g. 32G, or 0 for all of a node's (sbatch --mem)")
	fl.IntVar(&f.opts.MaxRunning, "max-running", 0, "slurm: array tasks running at once (--array=...%K); 0: no limit")
	fl.IntVar(&f.opts.Shards, "shards", 0, fmt.Sprintf("slurm: array tasks the jobs are split into; 0: one per job, at most %d", slurm.DefaultShards))
	fl.StringArrayVar(&f.opts.Extra, "sbatch-line", nil, "slurm: one more #SBATCH line, e.g. --qos=high (repeat for several)")
	fl.BoolVar(&f.dryRun, "dry-run", false, "slurm: print the batch script and submit nothing")
	fl.BoolVar(&f.detach, "detach", false, "slurm: submit and return at once; then \"workbench status RUN_DIR\" follows the array")
	fl.StringVar(&f.runtimeCache, "runtime-cache", "", "slurm: cache directory the nodes share for the managed Python runtime "+
		"(built once, under a file lock); default: each node's own cache")
}

// check rejects slurm options given without --executor slurm, and values
// or combinations sbatch would refuse or that cannot mean anything.
func (f *slurmFlags) check(cmd *cobra.Command) error {
	if f.executor.value == "slurm" {
		switch {
		case cmd.Flags().Changed("cpus-per-task") && f.opts.CPUsPerTask < 1: // 0 is the unset default
			return &usageError{fmt.Errorf("--cpus-per-task must be at least 1 (leave it out for the cluster's "+
				"default), got %d", f.opts.CPUsPerTask)}
		case f.dryRun && f.detach:
			return &usageError{errors.New("--dry-run submits nothing, so there is nothing to --detach from: give one of them")}
		}
		if err := f.opts.Check(); err != nil {
			return &usageError{err}
		}
		return nil
	}
	for _, name := range []string{"partition", "account", "time", "gres", "cpus-per-task", "mem", "max-running", "shards",
		"sbatch-line", "dry-run", "detach", "runtime-cache"} {
		if cmd.Flags().Changed(name) {
			return &usageError{fmt.Errorf("--%s applies to --executor slurm", name)}
		}
	}
	return nil
}

// slurmExecutor is the executor of `run --executor slurm`: tasks run this
// binary with the kernels root, interpreter and device this run resolved.
func (a *app) slurmExecutor(f slurmFlags, kernels pyrt.KernelsRoot, file, fileHash string, workers int) (*slurm.Executor, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find the workbench binary the tasks run: %w", err)
	}
	var args, env []string
	if workers > 0 {
		env = append(env, "VLKV_SHARD_WORKERS="+strconv.Itoa(workers))
	}
	if kernels.Source != "embedded" { // an embedded root is unpacked by each node from the binary itself
		args = append(args, "--kernels", kernels.Dir)
	}
	if a.flags.python != "" {
		python := a.flags.python
		if strings.ContainsRune(python, filepath.Separator) { // a path, not a name on the nodes' PATH
			if python, err = filepath.Abs(python); err != nil {
				return nil, err
			}
		}
		args = append(args, "--python", python)
	}
	if a.flags.device.value != worker.Auto {
		args = append(args, "--device", string(a.flags.device.value))
	}
	if a.flags.startTimeout != worker.DefaultStartTimeout { // a node's cold disk is why one would raise it
		args = append(args, "--start-timeout", a.flags.startTimeout.String())
	}
	if f.runtimeCache != "" {
		dir, err := filepath.Abs(f.runtimeCache)
		if err != nil {
			return nil, err
		}
		env = append(env, pyrt.CacheDirEnv+"="+dir)
	}
	abs, err := filepath.Abs(file)
	if err != nil {
		return nil, err
	}
	return &slurm.Executor{Options: f.opts, Workbench: self, TaskArgs: args, Env: env, File: abs, FileHash: fileHash,
		KernelsDir: kernels.Dir, DryRun: f.dryRun, Detach: f.detach, Out: a.stdout, Interrupt: a.cancelArray}, nil
}

// askCancel asks, on a terminal, whether Ctrl-C should cancel the array;
// without one it cancels.
func (a *app) askCancel(arrayJob string) bool {
	if !isatty.IsTerminal(os.Stdin.Fd()) {
		return true
	}
	question := fmt.Sprintf("\nCancel Slurm array %s? Its running tasks stop; the jobs they finished are kept. "+
		"No leaves it running (`workbench status RUN_DIR` follows it). [y/N] ", arrayJob)
	read := func() string {
		line, _ := bufio.NewReader(os.Stdin).ReadString('\n')
		return line
	}
	var line string
	if term, ok := a.console.(*sched.Terminal); ok { // the progress bar must not redraw over the question
		line = term.Ask(question, read)
	} else {
		fmt.Fprint(a.stderr, question)
		line = read()
	}
	answer := strings.ToLower(strings.TrimSpace(line))
	return answer == "y" || answer == "yes"
}

func newShardCmd(a *app) *cobra.Command {
	var spec string
	var workers int
	cmd := &cobra.Command{
		Use:   "shard PLAN.json [--shard I[/N]]",
		Short: "Run one shard of a submitted Slurm plan (what each array task runs)",
		Long: `shard runs the jobs of one shard of a plan that run --executor slurm wrote
(RUN_DIR/slurm/<submission>/plan.json) on workers of this node, and records
each finished job in its own journal segment (RUN_DIR/segments/), which
the host merges into the run's journal. It first checks that this node sees
the experiment script and the kernels_py sources that were submitted.
--shard defaults to $SLURM_ARRAY_TASK_ID.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			plan, err := slurm.ReadPlan(args[0])
			if err != nil {
				return err
			}
			if spec == "" {
				spec = os.Getenv("SLURM_ARRAY_TASK_ID")
			}
			if spec == "" {
				return &usageError{errors.New("give --shard I (or run as a Slurm array task, which sets SLURM_ARRAY_TASK_ID)")}
			}
			index, err := slurm.ParseShard(spec, len(plan.Shards))
			if err != nil {
				return &usageError{err}
			}
			if workers == 0 { // run --executor slurm --workers N passes N to its tasks this way
				workers, _ = strconv.Atoi(os.Getenv("VLKV_SHARD_WORKERS"))
			}
			task := slurm.Task{Plan: plan, Shard: index, Log: a.log}
			s, err := a.newSession(cmd.Context())
			if err != nil {
				return task.Failed(err)
			}
			var workloads []string
			for _, j := range plan.Shards[index] {
				workloads = append(workloads, j.WorkloadName)
			}
			if err := a.ensureWorkloadGroups(cmd.Context(), s, workloads); err != nil {
				return task.Failed(err)
			}
			task.KernelsDir = s.kernels.Dir
			task.Executor = &runner.Local{Python: s.runtime.Python, KernelsRoot: s.kernels.Dir, Device: s.device,
				StartTimeout: a.flags.startTimeout,
				Workers:      workers, Log: a.log}
			return task.Run(cmd.Context())
		},
	}
	cmd.Flags().StringVar(&spec, "shard", "", "the shard to run: I, or I/N to check the plan has N shards")
	cmd.Flags().IntVar(&workers, "workers", 0, "worker processes on this node; 0: one per GPU, or 1 on CPU")
	return cmd
}

func newStatusCmd(a *app) *cobra.Command {
	var noFollow bool
	cmd := &cobra.Command{
		Use:   "status RUN_DIR",
		Short: "How far a run got; rebuild its results.parquet; follow its Slurm array if it still runs",
		Long: `status reports a run directory: jobs done and failed out of the plan of its
newest run or resume, and the rows of jobs only an earlier script planned.
It rebuilds results.parquet from the journal (which a killed run leaves
ahead of the table), for a local run as for one on Slurm. For a run on
Slurm it also shows the tasks of its newest array, journals what the tasks
recorded in their segments, and, while the array still runs, follows it
until it ends (Ctrl-C asks whether to cancel it). With --no-follow it does
not follow the array; while another workbench writes the run, it only
reports. Given an experiment's folder instead of a run, it names the
folder's runs to choose from, and given the results root, the newest run of
each experiment; either way it exits 1, having reported no run.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.status(cmd.Context(), args[0], !noFollow)
		},
	}
	cmd.Flags().BoolVar(&noFollow, "no-follow", false, "report and return, even while the array runs")
	return cmd
}

func (a *app) status(ctx context.Context, dir string, follow bool) error {
	if err := checkRunPath(dir); err != nil {
		return err
	}
	run, err := results.Open(dir)
	var locked *results.LockedError
	if errors.As(err, &locked) {
		fmt.Fprintln(a.stdout, beingWritten(dir, locked))
		return a.report(ctx, dir, nil)
	}
	if err != nil {
		return err
	}
	defer run.Close()
	if err := mergeSegments(run); err != nil {
		return err
	}
	subs, err := slurm.Submissions(dir)
	if err != nil {
		return err
	}
	var interrupted error
	if follow && len(subs) > 0 {
		sub := subs[len(subs)-1]
		err := a.followArray(ctx, run, sub)
		if merr := mergeSegments(run); err == nil { // what the tasks recorded while they stopped
			err = merr
		}
		var (
			missing      *slurm.NotInstalledError
			unconfigured *slurm.NotConfiguredError
			detached     *slurm.DetachedError
		)
		switch {
		case errors.As(err, &missing), errors.As(err, &unconfigured):
			err = nil // Slurm cannot be asked from here: the report says why, after what the run directory holds
		case errors.As(err, &detached): // the user chose to leave the array running: not a failure
			fmt.Fprintln(a.stdout, detached.Error())
			ctx, err = context.WithoutCancel(ctx), nil // the report still asks squeue after Ctrl-C
		case errors.Is(err, context.Canceled) && ctx.Err() != nil: // cancelled on Ctrl-C: report, then say so
			interrupted = fmt.Errorf("interrupted: Slurm array %s is cancelled; the jobs its tasks finished are kept; "+
				"to submit the rest: %s", sub.ArrayJob, sub.ResumeCommand())
			ctx, err = context.WithoutCancel(ctx), nil
		}
		if err != nil {
			results.BuildParquet(dir)
			return err
		}
	}
	if _, err := syncRun(run, a.log); err != nil {
		return err
	}
	if err := a.report(ctx, dir, run); err != nil {
		return err
	}
	return interrupted
}

// mergeSegments journals what the tasks recorded in their segments and the
// journal lacks. Each call reads the journal afresh: a follow in between
// journals records itself, and must not see them merged twice.
func mergeSegments(run *results.Run) error {
	merger, err := run.NewMerger()
	if err != nil {
		return err
	}
	_, err = merger.Merge()
	return err
}

// followArray follows a run's array while it runs, journaling its jobs.
func (a *app) followArray(ctx context.Context, run *results.Run, sub slurm.Submission) error {
	tasks, err := slurm.Tasks(ctx, sub.ArrayJob)
	if err != nil {
		return err
	}
	active := false
	for _, t := range tasks {
		active = active || !t.Terminal()
	}
	if !active {
		return nil
	}
	plan, err := slurm.ReadPlan(slurm.PlanPath(run.Dir, sub.ID))
	if err != nil {
		return err
	}
	done, err := results.Finished(run.Dir)
	if err != nil {
		return err
	}
	pending := arrayPending(plan, sub, done)
	m := run.Manifest()
	// Counted from what is left: a job retried after failing has a record
	// already, and must not count twice.
	progress := sched.NewProgress(a.console, sched.IsTerminal(a.console), m.Jobs, max(0, m.Jobs-len(pending)))
	defer progress.Close()
	f := &slurm.Follow{RunDir: run.Dir, Submission: sub, Plan: plan, Pending: pending, Log: a.log, Interrupt: a.cancelArray,
		Deliver: func(rec results.Record) error {
			out := sched.Outcome{Job: sched.Job{ID: rec.JobID, Label: rec.Method + " " + formatParams(rec.Params)},
				Attempts: rec.Attempts, Duration: time.Duration(rec.Seconds * float64(time.Second))}
			if rec.Status != results.StatusOK {
				out.Err = errors.New(rec.Error)
			}
			progress.Finished(out)
			return run.Append(rec)
		}}
	a.log.Info().Str("array", sub.ArrayJob).Int("jobs_left", len(pending)).Msg("following the Slurm array")
	return f.Run(ctx)
}

// report prints what a run has done, and its arrays' tasks.
func (a *app) report(ctx context.Context, dir string, run *results.Run) error {
	recs, err := results.ReadJournal(dir)
	if err != nil {
		return err
	}
	last := map[string]results.Record{}
	for _, rec := range recs {
		last[rec.JobID] = rec
	}
	unmerged := 0
	if run == nil { // another process merges: count what the segments hold beyond the journal
		segs, _ := results.NewSegmentReader(dir).Read()
		for _, rec := range segs {
			if _, ok := last[rec.JobID]; !ok {
				unmerged++
				last[rec.JobID] = rec
			}
		}
	}
	fmt.Fprint(a.stdout, describeRows(dir, last))
	if unmerged > 0 {
		fmt.Fprintf(a.stdout, " (%d recorded by tasks, not journaled yet)", unmerged)
	}
	fmt.Fprintln(a.stdout)
	subs, err := slurm.Submissions(dir)
	if err == nil && len(subs) == 0 && run != nil {
		if hint := a.localResumeHint(dir, last); hint != "" {
			fmt.Fprintln(a.stdout, hint)
		}
	}
	if err != nil || len(subs) == 0 {
		return err
	}
	sub := subs[len(subs)-1]
	fmt.Fprintf(a.stdout, "slurm array %s (submitted %s, %s, %s): ", sub.ArrayJob,
		sub.Submitted.Local().Format("2006-01-02 15:04:05"), plural(sub.Tasks, "task"), plural(sub.Jobs, "job"))
	tasks, err := slurm.Tasks(ctx, sub.ArrayJob)
	switch {
	case err != nil:
		fmt.Fprintf(a.stdout, "its tasks cannot be read: %v\n", err)
	case len(tasks) == 0: // Slurm forgets an array soon after it ends: the tasks' own word remains
		fmt.Fprintf(a.stdout, "no longer in the queue; %s\n", slurm.DescribeEnded(dir, sub))
	default:
		fmt.Fprintln(a.stdout, slurm.Describe(tasks))
		for _, msg := range slurm.Stuck(sub.ArrayJob, tasks) {
			fmt.Fprintln(a.stdout, msg)
		}
	}
	ended := err == nil
	for _, t := range tasks {
		ended = ended && t.Terminal()
	}
	if plan, err := slurm.ReadPlan(slurm.PlanPath(dir, sub.ID)); ended && err == nil && len(arrayPending(plan, sub, last)) > 0 {
		fmt.Fprintf(a.stdout, "the array has ended short; to submit the rest: %s\n", sub.ResumeCommand())
	}
	return nil
}

// arrayPending are the jobs of sub's plan without a record since it was
// submitted (a retried job has an older, failed one).
func arrayPending(plan slurm.Plan, sub slurm.Submission, records map[string]results.Record) map[string]bool {
	pending := map[string]bool{}
	for _, shard := range plan.Shards {
		for _, j := range shard {
			if rec, ok := records[j.ID]; !ok || rec.Finished.Before(sub.Submitted) {
				pending[j.ID] = true
			}
		}
	}
	return pending
}
