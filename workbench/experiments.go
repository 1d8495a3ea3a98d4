package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/mattn/go-isatty"
	"github.com/spf13/cobra"

	vlkv "github.com/vlkv/vlkv"
	"github.com/vlkv/vlkv/gohost/expt"
	"github.com/vlkv/vlkv/gohost/pyrt"
	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/sched"
	"github.com/vlkv/vlkv/gohost/tensor"
	"github.com/vlkv/vlkv/gohost/worker"
)

// ablationFn is the worker entry point every experiment job calls.
const ablationFn = "kernels_py.ablation:run"

// loadPlan evaluates an experiment script against the schema of the kernels
// root. It starts no Python.
func (a *app) loadPlan(ctx context.Context, file string) (*expt.Plan, pyrt.KernelsRoot, error) {
	kernels, err := a.kernelsRoot()
	if err != nil {
		return nil, kernels, err
	}
	schema, err := expt.LoadSchema(filepath.Join(kernels.Dir, "kernels_py", "policies", "schema.json"))
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
		return nil, kernels, err
	}
	for _, p := range plan.Prints {
		a.log.Info().Msg(p)
	}
	return plan, kernels, nil
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
					Workload       map[string]any `json:"workload"`
					TimeoutSeconds float64        `json:"timeout_seconds"`
				}
				out := struct {
					File string    `json:"file"`
					Hash string    `json:"file_sha256"`
					Jobs []jobJSON `json:"jobs"`
				}{File: plan.File, Hash: plan.Hash, Jobs: []jobJSON{}}
				for _, e := range exps {
					for _, j := range e.Jobs {
						out.Jobs = append(out.Jobs, jobJSON{j.ID, j.Experiment, j.Method, j.Params, j.Workload, j.Timeout.Seconds()})
					}
				}
				enc := json.NewEncoder(a.stdout)
				enc.SetIndent("", "  ")
				return enc.Encode(out)
			}
			for _, e := range exps {
				fmt.Fprintf(a.stdout, "experiment %s: %d jobs (timeout %v each)\n", e.Name, len(e.Jobs), e.Timeout)
				tw := tabwriter.NewWriter(a.stdout, 0, 0, 2, ' ', 0)
				for _, j := range e.Jobs {
					fmt.Fprintf(tw, "  %s\t%s\t%s\n", j.ID, j.Method, formatParams(j.Params))
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

func formatParams(p map[string]any) string {
	keys := make([]string, 0, len(p))
	for k := range p {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s=%v", k, p[k])
	}
	return strings.Join(parts, " ")
}

type runOptions struct {
	experiment  string
	out         string
	workers     int
	resume      bool
	retryFailed bool
}

func newRunCmd(a *app) *cobra.Command {
	var o runOptions
	cmd := &cobra.Command{
		Use:   "run EXPERIMENT_FILE",
		Short: "Run an experiment script's jobs on workers and write results files",
		Long: `run expands an experiment script (as plan does), runs every job on a pool of
workers and writes, per experiment, OUT/<experiment>/<run-id>/ with:
  manifest.json    the script and its hash, git commit and dirty flag, hashes
                   of the kernels_py sources, versions, device, start/end
  journal.jsonl    one line per finished job, fsync'd: the source of truth
  results.parquet  one row per job (params, workload, metrics, status, error)
  tensors/         arrays written by jobs
A worker that crashes is replaced and its job retried once; a job over its
timeout fails. Ctrl-C stops at once: finished jobs stay in the journal, and
--resume continues the newest run of each experiment without redoing them.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if o.workers < 0 {
				return &usageError{fmt.Errorf("--workers must be positive, got %d", o.workers)}
			}
			_, err := a.runExperiments(cmd.Context(), args[0], o)
			return err
		},
	}
	cmd.Flags().StringVar(&o.experiment, "experiment", "", "only this experiment of the file")
	cmd.Flags().StringVar(&o.out, "out", "results", "results root directory")
	cmd.Flags().IntVar(&o.workers, "workers", 0, "worker processes (default: one per GPU, or 1 on CPU)")
	cmd.Flags().BoolVar(&o.resume, "resume", false, "continue the newest run of each experiment, skipping journaled jobs")
	cmd.Flags().BoolVar(&o.retryFailed, "retry-failed", false, "with --resume, run again the jobs that failed")
	return cmd
}

// runExperiments runs the selected experiments and returns their run directories.
func (a *app) runExperiments(ctx context.Context, file string, o runOptions) ([]string, error) {
	plan, _, err := a.loadPlan(ctx, file)
	if err != nil {
		return nil, err
	}
	exps, err := selectExperiments(plan, o.experiment)
	if err != nil {
		return nil, err
	}
	s, err := a.newSession(ctx)
	if err != nil {
		return nil, err
	}
	var dirs []string
	var failed int
	for _, e := range exps {
		dir, nFailed, err := a.runExperiment(ctx, s, plan, e, o)
		if dir != "" {
			dirs = append(dirs, dir)
		}
		if err != nil {
			return dirs, err
		}
		failed += nFailed
	}
	if failed > 0 {
		return dirs, fmt.Errorf("%d jobs failed (see the error column of results.parquet; rerun with --resume --retry-failed)", failed)
	}
	return dirs, nil
}

func (a *app) runExperiment(ctx context.Context, s *session, plan *expt.Plan, e expt.Experiment, o runOptions) (string, int, error) {
	run, done, err := a.openRun(s, plan, e, o)
	if err != nil {
		return "", 0, err
	}
	defer run.Close()
	log := a.log.With().Str("experiment", e.Name).Str("run", run.Dir).Logger()

	var todo []sched.Job
	specs := map[string]expt.Job{}
	for _, j := range e.Jobs {
		if rec, ok := done[j.ID]; ok && !(o.retryFailed && rec.Status == results.StatusFailed) {
			continue
		}
		specs[j.ID] = j
		todo = append(todo, sched.Job{ID: j.ID, Label: j.Method + " " + formatParams(j.Params), Timeout: j.Timeout,
			Spec: worker.Job{Fn: ablationFn, Args: map[string]any{"method": j.Method, "params": j.Params, "workload": j.Workload}}})
	}
	log.Info().Int("jobs", len(e.Jobs)).Int("to_run", len(todo)).Int("already_done", len(e.Jobs)-len(todo)).Msg("running")

	workers := o.workers
	gpus := worker.GPUs("/")
	if workers == 0 {
		workers = 1
		if s.device == worker.CUDA && gpus > 0 {
			workers = gpus
		}
	}
	progress := sched.NewProgress(a.stderr, isTerminal(a.stderr), len(e.Jobs), len(e.Jobs)-len(todo))
	var once sync.Once
	scratch := newScratchArenas()
	defer scratch.Close()
	start := func(ctx context.Context) (*worker.Worker, error) {
		env := workerEnv(s.device, scratch.Slot(), workers, gpus)
		w, err := worker.Start(ctx, worker.Config{Python: s.runtime.Python, KernelsRoot: s.kernels.Dir, Device: s.device, Env: env, Log: a.log})
		if err != nil {
			return nil, err
		}
		once.Do(func() { recordVersions(run, w.Hello()) })
		if err := scratch.Lend(ctx, w); err != nil {
			w.Close()
			return nil, err
		}
		return w, nil
	}
	failed := 0
	err = sched.Run(ctx, todo, sched.Config{Workers: workers, Start: start, Progress: progress, Log: log, Prepare: scratch.Prepare,
		Done: func(out sched.Outcome) error {
			rec := record(specs[out.Job.ID], out)
			if err := saveTensors(run.Dir, &rec, out.Result, scratch); err != nil {
				rec.Status, rec.Error = results.StatusFailed, err.Error()
			}
			if rec.Status == results.StatusFailed {
				failed++
				log.Warn().Str("job", rec.JobID).Str("error", firstLine(rec.Error)).Msg("job failed")
			}
			return run.Append(rec)
		}})
	progress.Close()
	rows, perr := results.BuildParquet(run.Dir)
	if perr != nil {
		log.Error().Err(perr).Msg("results.parquet not written; the journal has every finished job")
	}
	if err != nil {
		if errors.Is(err, context.Canceled) {
			return run.Dir, failed, fmt.Errorf("interrupted: %d of %d jobs are done in %s; continue with --resume", rows, len(e.Jobs), run.Dir)
		}
		return run.Dir, failed, err
	}
	end := time.Now()
	if err := run.UpdateManifest(func(m *results.Manifest) { m.Ended = &end }); err != nil {
		return run.Dir, failed, err
	}
	log.Info().Int("rows", rows).Int("failed", failed).Msg("results written")
	fmt.Fprintf(a.stdout, "%s: %d jobs, %d failed -> %s\n", e.Name, rows, failed, filepath.Join(run.Dir, results.ParquetFile))
	return run.Dir, failed, perr
}

// openRun creates the run directory, or with --resume reopens the newest one.
func (a *app) openRun(s *session, plan *expt.Plan, e expt.Experiment, o runOptions) (*results.Run, map[string]results.Record, error) {
	if o.resume {
		dir, err := results.Latest(o.out, e.Name)
		if err != nil {
			return nil, nil, err
		}
		if dir != "" {
			run, err := results.Open(dir)
			if err != nil {
				return nil, nil, err
			}
			done, err := results.Finished(dir)
			if err != nil {
				run.Close()
				return nil, nil, err
			}
			if m := run.Manifest(); m.FileHash != plan.Hash {
				a.log.Warn().Str("run", dir).Msg("the script changed since this run started; jobs whose ids changed run again")
			}
			err = run.UpdateManifest(func(m *results.Manifest) {
				m.Resumed = append(m.Resumed, time.Now())
				m.Ended = nil
				m.Jobs = len(e.Jobs)
			})
			return run, done, err
		}
		a.log.Info().Str("experiment", e.Name).Msg("nothing to resume: starting a new run")
	}
	m := results.Manifest{
		Experiment: e.Name, RunID: results.NewRunID(time.Now()), File: plan.File, FileHash: plan.Hash,
		Git: gitState(s.kernels.Dir), KernelsHash: kernelsHashes(s.kernels.Dir), Device: string(s.device),
		Jobs: len(e.Jobs), Started: time.Now(),
		Versions: map[string]string{"workbench": version, "go": runtime.Version()},
	}
	run, err := results.Create(o.out, m)
	return run, nil, err
}

func record(j expt.Job, out sched.Outcome) results.Record {
	rec := results.Record{JobID: j.ID, Experiment: j.Experiment, Method: j.Method, Params: j.Params, Workload: j.Workload,
		Status: results.StatusOK, Attempts: out.Attempts, Seconds: out.Duration.Seconds(), Finished: time.Now()}
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
	}
	if err := json.Unmarshal(out.Result, &res); err != nil || res.Metrics == nil {
		rec.Status = results.StatusFailed
		rec.Error = fmt.Sprintf("job returned no metrics: %.200s", out.Result)
		return rec
	}
	rec.Metrics = res.Metrics
	if len(res.PerLayer) > 0 {
		rec.Extra = map[string]any{}
		for k, v := range res.PerLayer {
			rec.Extra["per_layer_"+k] = v
		}
	}
	return rec
}

// scratchArenas gives every worker an arena whose whole extent each of its
// jobs may use for the tensors it returns; the host saves them as .npy before
// the worker takes its next job.
type scratchArenas struct {
	mu       sync.Mutex
	slots    int
	byWorker map[*worker.Worker]*tensor.Arena
	byID     map[uint32]*tensor.Arena
}

const scratchBytes = 16 << 20

func newScratchArenas() *scratchArenas {
	return &scratchArenas{byWorker: map[*worker.Worker]*tensor.Arena{}, byID: map[uint32]*tensor.Arena{}}
}

// Slot numbers worker starts, to spread them over GPUs.
func (s *scratchArenas) Slot() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.slots++
	return s.slots - 1
}

func (s *scratchArenas) Lend(ctx context.Context, w *worker.Worker) error {
	s.mu.Lock()
	id := uint32(len(s.byID) + 1)
	s.mu.Unlock()
	a, err := tensor.NewArena(id, "scratch", scratchBytes)
	if err != nil {
		return err
	}
	if err := w.MapArena(ctx, a); err != nil {
		a.Close()
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.byWorker[w], s.byID[id] = a, a
	return nil
}

func (s *scratchArenas) Prepare(w *worker.Worker, spec *worker.Job) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if a := s.byWorker[w]; a != nil {
		spec.Scratch = &tensor.Region{Arena: a.ID(), Offset: 0, Size: a.Size()}
	}
}

func (s *scratchArenas) Arena(id uint32) *tensor.Arena {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.byID[id]
}

func (s *scratchArenas) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, a := range s.byID {
		a.Close()
	}
}

// saveTensors writes the tensors a job returned by reference to
// tensors/<job id>/<name>.npy and notes their paths in the record.
func saveTensors(runDir string, rec *results.Record, result json.RawMessage, scratch *scratchArenas) error {
	var res struct {
		Tensors map[string]tensor.Ref `json:"tensors"`
	}
	if rec.Status != results.StatusOK || json.Unmarshal(result, &res) != nil || len(res.Tensors) == 0 {
		return nil
	}
	if rec.Extra == nil {
		rec.Extra = map[string]any{}
	}
	for name, ref := range res.Tensors {
		a := scratch.Arena(ref.Desc.Arena)
		if a == nil {
			return fmt.Errorf("tensor %q names arena %d, which was not lent", name, ref.Desc.Arena)
		}
		t, err := a.Tensor(ref.Desc)
		if err != nil {
			return fmt.Errorf("tensor %q: %w", name, err)
		}
		rel := filepath.Join(results.TensorsDir, rec.JobID, npyName(name))
		if err := os.MkdirAll(filepath.Join(runDir, results.TensorsDir, rec.JobID), 0o755); err != nil {
			return err
		}
		if err := tensor.WriteNPY(filepath.Join(runDir, rel), t); err != nil {
			return err
		}
		rec.Extra["tensor_"+name] = rel
	}
	return nil
}

func recordVersions(run *results.Run, h worker.Hello) {
	run.UpdateManifest(func(m *results.Manifest) {
		set := func(k string, v *string) {
			if v != nil {
				m.Versions[k] = *v
			}
		}
		m.Versions["python"] = h.Python.Version
		set("torch", h.Torch.Version)
		set("triton", h.Triton.Version)
		set("numpy", h.Numpy.Version)
		if len(h.Device.Names) > 0 {
			m.Device += " (" + strings.Join(h.Device.Names, ", ") + ")"
		}
	})
}

// workerEnv spreads workers over GPUs, or CPU threads over CPU workers.
func workerEnv(device worker.Device, slot, workers, gpus int) []string {
	env := os.Environ()
	if device == worker.CUDA && gpus > 0 {
		return append(env, fmt.Sprintf("CUDA_VISIBLE_DEVICES=%d", slot%gpus))
	}
	if _, set := os.LookupEnv("OMP_NUM_THREADS"); !set && workers > 1 {
		env = append(env, fmt.Sprintf("OMP_NUM_THREADS=%d", max(1, runtime.NumCPU()/workers)))
	}
	return env
}

func gitState(dir string) results.Git {
	out, err := exec.Command("git", "-C", dir, "rev-parse", "HEAD").Output()
	if err != nil {
		return results.Git{}
	}
	status, _ := exec.Command("git", "-C", dir, "status", "--porcelain").Output()
	return results.Git{Commit: strings.TrimSpace(string(out)), Dirty: len(strings.TrimSpace(string(status))) > 0}
}

// kernelsHashes fingerprints the kernels_py sources a run used.
func kernelsHashes(root string) map[string]string {
	hashes := map[string]string{}
	base := filepath.Join(root, "kernels_py")
	filepath.WalkDir(base, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !(strings.HasSuffix(p, ".py") || strings.HasSuffix(p, ".json")) {
			return nil
		}
		data, err := os.ReadFile(p)
		if err == nil {
			rel, _ := filepath.Rel(base, p)
			sum := sha256.Sum256(data)
			hashes[rel] = hex.EncodeToString(sum[:])
		}
		return nil
	})
	return hashes
}

func isTerminal(w any) bool {
	f, ok := w.(*os.File)
	return ok && isatty.IsTerminal(f.Fd())
}

func firstLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}
