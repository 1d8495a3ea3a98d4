package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"unicode"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	vlkv "github.com/vlkv/vlkv"
	"github.com/vlkv/vlkv/gohost/expt"
	"github.com/vlkv/vlkv/gohost/pyrt"
	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/runner"
	"github.com/vlkv/vlkv/gohost/sched"
	"github.com/vlkv/vlkv/gohost/slurm"
	"github.com/vlkv/vlkv/gohost/worker"
)

// ablationFn is the worker entry point every experiment job calls.
const ablationFn = "kernels_py.ablation:run"

// loadPlan evaluates an experiment script against the schema of the kernels
// root. It starts no Python.
func (a *app) loadPlan(ctx context.Context, file string) (*expt.Plan, pyrt.KernelsRoot, error) {
	schema, kernels, err := a.schema()
	if err != nil {
		return nil, kernels, err
	}
	var plan *expt.Plan
	if strings.HasPrefix(file, "embedded:") {
		src, err := fs.ReadFile(vlkv.Assets, strings.TrimPrefix(file, "embedded:"))
		if err != nil {
			return nil, kernels, err
		}
		plan, err = expt.LoadSource(file, src, schema)
		if err != nil {
			return nil, kernels, err
		}
	} else if plan, err = expt.Load(ctx, file, schema); err != nil {
		var se *expt.ScriptError
		if errors.As(err, &se) {
			for _, p := range se.Prints {
				a.log.Info().Msg(p)
			}
			if strings.Contains(se.Msg, "is unknown") {
				se.Msg += staleSchemaHint(kernels, se.Msg)
			}
		}
		return nil, kernels, err
	}
	for _, p := range plan.Prints {
		a.log.Info().Msg(p)
	}
	for _, w := range plan.Warnings {
		a.log.Warn().Msg(w)
	}
	for _, w := range missingPathWarnings(plan, kernels) {
		a.log.Warn().Msg(w)
	}
	return plan, kernels, nil
}

// missingPathWarnings says, once each, which files and folders the plan's
// workloads name (their Paths knobs) do not exist here, relative ones looked
// for in the kernels root, where workers run. Warnings, not errors: jobs on
// a cluster may see files the planning machine does not.
func missingPathWarnings(plan *expt.Plan, kernels pyrt.KernelsRoot) []string {
	relative := " (a relative path is from the kernels root, where workers run)"
	if kernels.Source == "embedded" {
		relative = " (a relative path is from the kernels root, where workers run: outside a checkout, workbench's own copy; write an absolute path)"
	}
	var warnings []string
	checked := make(map[string]bool) // experiment, workload, knob and value: jobs share their workloads
	for _, e := range plan.Experiments {
		for _, j := range e.Jobs {
			params := plan.Schema.Workloads[j.WorkloadName].Params
			for _, name := range params.Names() {
				v, ok := j.Workload[name].(string)
				key := strings.Join([]string{e.Name, j.WorkloadName, name, v}, "\x00")
				if !params[name].Paths || !ok || checked[key] {
					continue
				}
				checked[key] = true
				said := map[string]bool{} // an image given twice is one missing file
				for _, part := range strings.Split(v, ",") {
					p, note := strings.TrimSpace(part), ""
					if p == "" || said[p] {
						continue
					}
					said[p] = true
					if !filepath.IsAbs(p) {
						p, note = filepath.Join(kernels.Dir, p), relative
					}
					if _, err := os.Stat(p); errors.Is(err, fs.ErrNotExist) {
						warnings = append(warnings, fmt.Sprintf("experiment %s: workload %q: %s = %q: %s does not exist here: its jobs will fail%s", e.Name, j.WorkloadName, name, v, p, note))
					}
				}
			}
		}
	}
	return warnings
}

func (a *app) kernelsRoot() (pyrt.KernelsRoot, error) {
	cacheDir, err := pyrt.CacheDir()
	if err != nil {
		return pyrt.KernelsRoot{}, err
	}
	cwd, err := os.Getwd()
	if err != nil {
		return pyrt.KernelsRoot{}, err
	}
	return pyrt.ResolveKernels(a.flags.kernels, cwd, vlkv.Assets, cacheDir)
}

func selectExperiments(plan *expt.Plan, name string) ([]expt.Experiment, error) {
	if name == "" {
		return plan.Experiments, nil
	}
	var names []string
	for _, e := range plan.Experiments {
		if e.Name == name {
			return []expt.Experiment{e}, nil
		}
		names = append(names, e.Name)
	}
	return nil, &usageError{fmt.Errorf("%s has no experiment %q (it has: %s)", plan.File, name, strings.Join(names, ", "))}
}

func newPlanCmd(a *app) *cobra.Command {
	var (
		asJSON     bool
		experiment string
	)
	cmd := &cobra.Command{
		Use:   "plan EXPERIMENT_FILE",
		Short: "Expand an experiment script into its jobs, without running anything",
		Long: `plan evaluates a Starlark experiment script (see experiments/quickstart.star)
and lists the jobs it declares, each with its stable id (a hash of the job's
canonical JSON: the same script gives the same ids every time). Errors in the
script are reported as file:line:col. No Python is started.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			plan, _, err := a.loadPlan(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			exps, err := selectExperiments(plan, experiment)
			if err != nil {
				return err
			}
			if asJSON {
				type jobJSON struct {
					ID             string         `json:"id"`
					Experiment     string         `json:"experiment"`
					Method         string         `json:"method"`
					Params         map[string]any `json:"params"`
					WorkloadName   string         `json:"workload_name"`
					Workload       map[string]any `json:"workload"`
					TimeoutSeconds float64        `json:"timeout_seconds"`
					Protocol       string         `json:"protocol,omitempty"`
				}
				out := struct {
					File string    `json:"file"`
					Hash string    `json:"file_sha256"`
					Jobs []jobJSON `json:"jobs"`
				}{File: plan.File, Hash: plan.Hash, Jobs: []jobJSON{}}
				for _, e := range exps {
					for _, j := range e.Jobs {
						out.Jobs = append(out.Jobs, jobJSON{j.ID, j.Experiment, j.Method, j.Params, j.WorkloadName, j.Workload, j.Timeout.Seconds(), e.Protocol})
					}
				}
				enc := json.NewEncoder(a.stdout)
				enc.SetIndent("", "  ")
				return enc.Encode(out)
			}
			for _, e := range exps {
				workloads, shared := describeWorkloads(plan.Schema, e.Jobs)
				protocol := ""
				if e.Protocol != "" && e.Protocol != expt.DefaultProtocol {
					protocol = ", protocol " + e.Protocol
				}
				fmt.Fprintf(a.stdout, "experiment %s: %s (timeout %v each%s)%s\n", e.Name, plural(len(e.Jobs), "job"), e.Timeout, protocol, shared)
				tw := tabwriter.NewWriter(a.stdout, 0, 0, 2, ' ', 0)
				for _, j := range e.Jobs {
					line := "  " + j.ID + "\t" + j.Method + "\t" + formatParams(j.Params)
					if w := workloads[j.ID]; w != "" { // a cell left empty would pad the knobs with spaces to the line's end
						line += "\t" + w
					}
					fmt.Fprintln(tw, line)
				}
				tw.Flush()
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the jobs as JSON")
	cmd.Flags().StringVar(&experiment, "experiment", "", "only this experiment of the file")
	return cmd
}

// describeWorkloads says which workload each job of an experiment runs on:
// its name and the knobs it sets away from their defaults. When every job
// runs on the same one, it is said once, for the header, instead.
func describeWorkloads(s *expt.Schema, jobs []expt.Job) (perJob map[string]string, shared string) {
	perJob = map[string]string{}
	distinct := map[string]bool{}
	for _, j := range jobs {
		w := s.Workloads[j.WorkloadName]
		changed := map[string]any{}
		for k, v := range j.Workload {
			if p := w.Params[k]; p == nil || fmt.Sprint(p.Default) != fmt.Sprint(v) {
				changed[k] = v
			}
		}
		perJob[j.ID] = "@" + j.WorkloadName
		if len(changed) > 0 {
			perJob[j.ID] += "(" + formatParams(changed) + ")"
		}
		distinct[perJob[j.ID]] = true
	}
	if len(distinct) == 1 {
		for d := range distinct {
			shared = " on " + d
		}
		return map[string]string{}, shared
	}
	return perJob, ""
}

// workloadLabels tells apart the workloads of an experiment's jobs in their
// progress lines: "@NAME(knob=value ...)" with only the knobs whose values
// differ between its jobs (an lmms workload's task and shard, say); none
// when every job runs on one workload.
func workloadLabels(jobs []expt.Job) map[string]string {
	names := map[string]bool{}
	values := map[string]map[string]bool{}
	for _, j := range jobs {
		names[j.WorkloadName] = true
		for k, v := range j.Workload {
			if values[k] == nil {
				values[k] = map[string]bool{}
			}
			values[k][fmt.Sprint(v)] = true
		}
	}
	labels := map[string]string{}
	for _, j := range jobs {
		varying := map[string]any{}
		for k, v := range j.Workload {
			if len(values[k]) > 1 {
				varying[k] = v
			}
		}
		switch {
		case len(varying) > 0:
			labels[j.ID] = "@" + j.WorkloadName + "(" + formatParams(varying) + ")"
		case len(names) > 1:
			labels[j.ID] = "@" + j.WorkloadName
		}
	}
	return labels
}

func formatParams(p map[string]any) string {
	keys := make([]string, 0, len(p))
	for k := range p {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		if s, ok := p[k].(string); ok && strings.ContainsFunc(s, func(r rune) bool {
			return unicode.IsSpace(r) || !unicode.IsPrint(r) || r == '"'
		}) {
			// A prompt's spaces and newlines would run into the next knob
			// and break the job's line: quoted, it is one value on one line.
			parts[i] = k + "=" + strconv.Quote(s)
			continue
		}
		parts[i] = fmt.Sprintf("%s=%v", k, p[k])
	}
	return strings.Join(parts, " ")
}

type runOptions struct {
	experiment      string
	out             string
	workers         int
	resume          bool
	retryFailed     bool
	allowCodeChange bool
	slurm           slurmFlags // run only
	// rerun is the command line that runs the same again, without the
	// flags that say how this call resumes: messages append them.
	rerun string
}

// continueCommand is what continues this call where it stopped: rerun with
// --resume, and the flags this call was given to retry failed jobs or to
// accept changed code, which the jobs it did not reach still need.
func (o runOptions) continueCommand() string {
	c := o.rerun + " --resume"
	if o.retryFailed {
		c += " --retry-failed"
	}
	if o.allowCodeChange {
		c += " --allow-code-change"
	}
	return c
}

// addRunFlags registers the flags run and demo share.
func (o *runOptions) addRunFlags(cmd *cobra.Command) {
	cmd.Flags().StringVar(&o.out, "out", "results", "results root directory")
	cmd.Flags().IntVar(&o.workers, "workers", 0, "worker processes; 0: one per GPU, or 1 on CPU")
	cmd.Flags().BoolVar(&o.resume, "resume", false, "continue the newest run of each experiment, skipping journaled jobs")
	cmd.Flags().BoolVar(&o.retryFailed, "retry-failed", false, "with --resume, run again the jobs that failed")
	cmd.Flags().BoolVar(&o.allowCodeChange, "allow-code-change", false,
		"with --resume, continue a run although kernels_py changed since its rows were computed (each row records its code's digest)")
}

// check rejects flag values and combinations that cannot mean what the
// user wants.
func (o *runOptions) check() error {
	switch {
	case o.workers < 0:
		return &usageError{fmt.Errorf("--workers must be 0 (one per GPU, or 1 on CPU) or more, got %d", o.workers)}
	case strings.TrimSpace(o.out) == "":
		return &usageError{errors.New("--out must name a directory (default: results)")}
	case o.retryFailed && !o.resume:
		return &usageError{errors.New("--retry-failed only applies to a resumed run: add --resume")}
	case o.allowCodeChange && !o.resume:
		return &usageError{errors.New("--allow-code-change only applies to a resumed run: add --resume")}
	}
	return checkOutDir(o.out)
}

// checkOutDir refuses an --out that no run can be written under: a file,
// a path through one, a run directory or an experiment's folder (runs go
// under ROOT/<experiment>/, and a run's own folder, or the folder of its
// experiment, given as ROOT, say to resume it, would get a new run nested
// inside it).
func checkOutDir(out string) error {
	info, err := os.Stat(out)
	switch {
	case err == nil && !info.IsDir():
		return &usageError{fmt.Errorf("--out %s is a file: give the results root, a directory (default: results)", out)}
	case errors.Is(err, syscall.ENOTDIR):
		return &usageError{fmt.Errorf("--out %s: part of that path is a file: give the results root, a directory (default: results)", out)}
	}
	for _, name := range []string{results.ManifestFile, results.JournalFile} {
		if _, err := os.Stat(filepath.Join(out, name)); err == nil {
			return &usageError{fmt.Errorf("--out %s is a run directory (it holds %s): give the results root, which holds "+
				"<experiment>/<run id> (for this run %s); --resume continues the newest run of the script's experiment "+
				"there", out, name, filepath.Dir(filepath.Dir(filepath.Clean(out))))}
		}
	}
	if runs, err := results.Runs(out); err == nil && len(runs) > 0 {
		return &usageError{fmt.Errorf("--out %s is an experiment's folder (it holds runs, the newest %s): give the results "+
			"root, which holds <experiment>/<run id> (for these runs %s); --resume continues the newest run of the "+
			"script's experiment there", out, runs[len(runs)-1], filepath.Dir(filepath.Clean(out)))}
	}
	return nil
}

// recordedScript is how a run's manifest names its script: an absolute
// path, so that the resume command status prints from it works in any
// directory (an embedded script keeps its name).
func recordedScript(file string) string {
	if strings.HasPrefix(file, "embedded:") {
		return file
	}
	if abs, err := filepath.Abs(file); err == nil {
		return abs
	}
	return file
}

// plural is n and noun, in the plural unless n is 1.
func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// rerunCommand is the command line of cmd with args and the flags given,
// --out always (it says where the run is), less the flags that say how
// this call resumes or submits and those that only change logging: what a
// message tells the user to run, with --resume and the like appended.
func (a *app) rerunCommand(cmd *cobra.Command, args []string, out string) string {
	words := append([]string{a.prog}, strings.Fields(strings.TrimPrefix(cmd.CommandPath(), cmd.Root().Name()))...)
	words = append(words, args...)
	words = append(words, "--out", out)
	skip := map[string]bool{"out": true, "resume": true, "retry-failed": true, "allow-code-change": true,
		"dry-run": true, "detach": true, "log-format": true, "verbose": true}
	cmd.Flags().Visit(func(f *pflag.Flag) {
		if skip[f.Name] {
			return
		}
		values := []string{f.Value.String()}
		if sv, ok := f.Value.(pflag.SliceValue); ok {
			values = sv.GetSlice()
		}
		for _, v := range values {
			if f.Value.Type() == "bool" && v == "true" {
				words = append(words, "--"+f.Name)
				continue
			}
			words = append(words, "--"+f.Name, v)
		}
	})
	for i, w := range words {
		words[i] = shellQuote(w)
	}
	return strings.Join(words, " ")
}

// shellQuote quotes w for a POSIX shell when it needs it.
func shellQuote(w string) string {
	if w != "" && strings.Trim(w, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./:=@%+,") == "" {
		return w
	}
	return "'" + strings.ReplaceAll(w, "'", `'\''`) + "'"
}

func newRunCmd(a *app) *cobra.Command {
	var o runOptions
	cmd := &cobra.Command{
		Use:   "run EXPERIMENT_FILE",
		Short: "Run an experiment script's jobs on workers and write results files",
		Long: `run expands an experiment script (as plan does), runs every job on a pool of
workers and writes, per experiment, OUT/<experiment>/<run-id>/ with:
  manifest.json    the script and its hash (each resume's too), git commit (modified,
                   untracked), hashes of the kernels_py sources, versions, device,
                   start/end
  jobs.json        the job ids of the newest run's or resume's plan
  journal.jsonl    one line per finished job, fsync'd: the source of truth
  results.parquet  one row per job: params, workload, metrics, status, error,
                   duration_seconds (the job's own time), wall_seconds
                   (worker start-ups and retries included), kernels_digest
  tensors/         arrays written by jobs
  run.lock         held by the one workbench writing the run
The run directory appears once the first worker is ready. A worker that
crashes is replaced and its job retried once. A worker that fails to start is
started again with backoff; after 3 failures in a row its slot gives up and
the job it held goes back to the other slots. With no slot left (always so
with one worker) the run stops, and --resume runs every job it did not finish. A job over its timeout fails; the run goes on.
Ctrl-C stops at once: finished jobs stay in the journal, and --resume
continues the newest run of each experiment without redoing them (the
message gives the command). A resume is refused while another workbench
writes the run, and when kernels_py changed since the run's rows were
computed (unless --allow-code-change; a run without rows resumes on them), and
when its results.parquet holds rows its journal lost (it would run them again); a
worker that would start on edited kernels_py mid-run is refused the same way.
The command exits 1 while a job of the plan has a failed row, one left by an
earlier run or resume too; --resume --retry-failed runs them again.

--executor slurm runs the jobs as one Slurm job array instead (sbatch
--array, one task per shard, each running "workbench shard" on its node) and
follows it: progress from the tasks' journal segments, which are merged into
the run's journal, and their states from squeue. The run directory is the
same, plus slurm/ (plan, batch script, task logs) and segments/. Ctrl-C asks
whether to cancel the array or leave it running ("workbench status RUN_DIR"
follows it again); --detach returns once it is submitted; --dry-run prints
the batch script. --out must be on a filesystem the nodes share (a probe job
checks).`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := o.check(); err != nil {
				return err
			}
			if err := o.slurm.check(cmd); err != nil {
				return err
			}
			o.rerun = a.rerunCommand(cmd, args, o.out)
			_, err := a.runExperiments(cmd.Context(), args[0], o)
			return err
		},
	}
	cmd.Flags().StringVar(&o.experiment, "experiment", "", "only this experiment of the file")
	o.addRunFlags(cmd)
	o.slurm.add(cmd)
	return cmd
}

// runExperiments runs the selected experiments, one run each, on local
// workers, and returns their run directories.
func (a *app) runExperiments(ctx context.Context, file string, o runOptions) ([]string, error) {
	plan, _, err := a.loadPlan(ctx, file)
	if err != nil {
		return nil, err
	}
	exps, err := selectExperiments(plan, o.experiment)
	if err != nil {
		return nil, err
	}
	var executor runner.Executor
	var kernels pyrt.KernelsRoot
	var device string
	if o.slurm.executor.value == "slurm" { // the nodes resolve their own interpreter and device
		if kernels, err = a.kernelsRoot(); err != nil {
			return nil, err
		}
		if o.out, err = filepath.Abs(o.out); err != nil {
			return nil, err
		}
		if err := slurm.CheckOutPath(o.out); err != nil { // before anything is created under it
			return nil, &usageError{fmt.Errorf("--out %w", err)}
		}
		if executor, err = a.slurmExecutor(o.slurm, kernels, plan.File, plan.Hash, o.workers); err != nil {
			return nil, err
		}
		device = "slurm"
	} else {
		s, err := a.newSession(ctx)
		if err != nil {
			return nil, err
		}
		kernels, device = s.kernels, string(s.device)
		if err := a.ensureWorkloadGroups(ctx, s, planWorkloads(exps)); err != nil {
			return nil, err
		}
		executor = &runner.Local{Python: s.runtime.Python, KernelsRoot: s.kernels.Dir, Device: s.device, Workers: o.workers,
			StartTimeout: a.flags.startTimeout, Log: a.log}
		most := 0 // workers start up to an experiment's jobs
		for _, e := range exps {
			most = max(most, len(e.Jobs))
		}
		if warning := tooManyWorkers(o.workers, min(o.workers, most), s.device, runtime.NumCPU()); warning != "" {
			a.log.Warn().Msg(warning)
		}
	}
	var dirs []string
	var failed int
	for i, e := range exps {
		sum, err := runner.Run(ctx, runner.Options{
			Out: o.out, Experiment: e.Name, Protocol: e.Protocol, File: recordedScript(plan.File), FileHash: plan.Hash, Jobs: runnerJobs(plan.Schema, e),
			KernelsDir: kernels.Dir, Device: device, Version: version,
			Resume: o.resume, RetryFailed: o.retryFailed, AllowCodeChange: o.allowCodeChange,
			Continue: o.continueCommand(), Executor: executor, Guard: slurm.CheckNoneActive, Progress: a.console, Log: a.log,
		})
		if sum.Dir != "" {
			dirs = append(dirs, sum.Dir)
		}
		if sum.Ended {
			fmt.Fprintf(a.stdout, "%s: %s -> %s\n", e.Name, describeSummary(sum), filepath.Join(sum.Dir, results.ParquetFile))
		}
		// A dry run printed this experiment's script, a detached one submitted its array: on to the next.
		var detached *slurm.DetachedError
		switch {
		case errors.Is(err, slurm.ErrDryRun):
			continue
		case errors.As(err, &detached):
			fmt.Fprintf(a.stdout, "%s: %s\n", e.Name, detached.Error())
			if ctx.Err() != nil && i < len(exps)-1 { // Ctrl-C, answered by leaving the array running: stop here
				var rest []string
				for _, later := range exps[i+1:] {
					rest = append(rest, later.Name)
				}
				return dirs, fmt.Errorf("interrupted: experiments %s of %s were not started; to run one: %s --experiment NAME",
					strings.Join(rest, ", "), file, o.rerun)
			}
			continue
		case err != nil:
			return dirs, err
		}
		failed += sum.Failed
	}
	if failed > 0 {
		return dirs, fmt.Errorf("%s failed (see the error column of results.parquet); to run the failed jobs again, "+
			"once their cause is fixed (a bad knob fails the same way again): %s --resume --retry-failed",
			plural(failed, "job"), o.rerun)
	}
	return dirs, nil
}

// describeSummary says how a run stands after a run or resume: its plan's
// jobs and failures (those left from before this resume too, which make
// the command fail as well), and the rows of jobs its plan lacks.
func describeSummary(sum runner.Summary) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s, %d failed", plural(sum.Done, "job"), sum.Failed)
	if sum.FailedBefore > 0 {
		fmt.Fprintf(&b, " (%d before this resume)", sum.FailedBefore)
	}
	b.WriteString(unplannedRows(sum.Rows, sum.Tally, "this script's plan"))
	return b.String()
}

// unplannedRows is what a run's rows of jobs its plan lacks add to a line
// on it (a resume with an edited or another script keeps them): "" when
// there are none.
func unplannedRows(rows int, t results.Tally, plan string) string {
	if t.Unplanned == 0 {
		return ""
	}
	note := fmt.Sprintf("; the run holds %d rows, %d not in %s", rows, t.Unplanned, plan)
	if t.UnplannedFailed > 0 {
		note += fmt.Sprintf(" (%d of them failed)", t.UnplannedFailed)
	}
	return note
}

// planWorkloads names the workloads the experiments' jobs use.
func planWorkloads(exps []expt.Experiment) []string {
	var names []string
	for _, e := range exps {
		for _, j := range e.Jobs {
			names = append(names, j.WorkloadName)
		}
	}
	return names
}

// runnerJobs turns an experiment's jobs into calls of the ablation entry
// point. Each call carries the defaults the schema filled in for its method
// and workload: the worker refuses a job planned from a schema.json the
// sources have moved on from (a changed default would otherwise run as if
// the script had chosen it).
func runnerJobs(s *expt.Schema, e expt.Experiment) []runner.Job {
	jobs := make([]runner.Job, len(e.Jobs))
	workloads := workloadLabels(e.Jobs)
	planned := map[[2]string]map[string]any{} // one per method and workload, shared by their jobs
	for i, j := range e.Jobs {
		label := strings.TrimSpace(j.Method + " " + formatParams(j.Params) + " " + workloads[j.ID])
		args := map[string]any{"method": j.Method, "params": j.Params, "workload_name": j.WorkloadName,
			"workload": j.Workload}
		key := [2]string{j.Method, j.WorkloadName}
		if _, ok := planned[key]; !ok {
			planned[key] = plannedDefaults(s, e.Protocol, j)
		}
		if len(planned[key]) > 0 {
			args["planned_defaults"] = planned[key]
		}
		jobs[i] = runner.Job{
			Job: sched.Job{ID: j.ID, Label: label, Timeout: j.Timeout,
				Spec: worker.Job{Fn: ablationFn, Args: args}},
			Method: j.Method, Params: j.Params, WorkloadName: j.WorkloadName, Workload: j.Workload,
		}
	}
	return jobs
}

// plannedDefaults is {"method": {knob: default}, "workload": {...},
// "protocol": {"name": P, "sets": {knob: value}}} from the schema a job was
// planned with (kernels_py.ablation.run's planned_defaults); "protocol"
// where the experiment names one.
func plannedDefaults(s *expt.Schema, protocol string, j expt.Job) map[string]any {
	out := map[string]any{}
	if s == nil {
		return out
	}
	if m := s.Methods[j.Method]; m != nil {
		out["method"] = m.Params.Defaults()
		if protocol != "" {
			out["protocol"] = map[string]any{"name": protocol, "sets": m.ProtocolParams(protocol)}
		}
	}
	if w := s.Workloads[j.WorkloadName]; w != nil {
		out["workload"] = w.Params.Defaults()
	}
	return out
}

// tooManyWorkers says why asking for `asked` workers on the CPU, of which
// `starting` start (no more than the jobs), will be slow: they share `cpus`
// CPUs; "" when they do not outnumber them. (On CUDA workers spread over the
// GPUs, and more than one a GPU can pay where jobs spend time in Python.)
func tooManyWorkers(asked, starting int, device worker.Device, cpus int) string {
	if asked == 0 || device == worker.CUDA || starting <= cpus {
		return ""
	}
	return fmt.Sprintf("--workers %d: %d workers (each a Python process with torch) will share %d CPUs, so each "+
		"job runs slower; --workers %d or fewer keeps a CPU each", asked, starting, cpus, cpus)
}
