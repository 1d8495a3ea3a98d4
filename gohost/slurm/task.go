package slurm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/runner"
	"github.com/vlkv/vlkv/gohost/sched"
	"github.com/vlkv/vlkv/gohost/worker"
)

// ParseShard reads a shard spec, "I" or "I/N" (N must then be the plan's
// shard count), and checks it against the plan's shards.
func ParseShard(spec string, shards int) (int, error) {
	index, total, hasTotal := strings.Cut(strings.TrimSpace(spec), "/")
	i, err := strconv.Atoi(index)
	if err != nil {
		return 0, fmt.Errorf("shard %q: want I or I/N, e.g. 3 or 3/8", spec)
	}
	if hasTotal {
		n, err := strconv.Atoi(total)
		if err != nil {
			return 0, fmt.Errorf("shard %q: want I or I/N, e.g. 3 or 3/8", spec)
		}
		if n != shards {
			return 0, fmt.Errorf("shard %q: the plan has %d shards, not %d", spec, shards, n)
		}
	}
	if i < 0 || i >= shards {
		return 0, fmt.Errorf("shard %d is out of range: the plan has %d shards (0 to %d)", i, shards, shards-1)
	}
	return i, nil
}

// Task is one array task's work on its node.
type Task struct {
	Plan       Plan
	Shard      int
	KernelsDir string          // this node's kernels root
	Executor   runner.Executor // local workers on this node
	Log        zerolog.Logger
}

// CheckSources refuses to run on an experiment script or kernels_py
// sources other than the ones the run's rows come from.
func (t Task) CheckSources() error {
	p := t.Plan
	data, err := os.ReadFile(p.File)
	if err != nil {
		return fmt.Errorf("the experiment script %s cannot be read on this node (%v): keep it on a filesystem the "+
			"nodes share", p.File, err)
	}
	sum := sha256.Sum256(data)
	if got := hex.EncodeToString(sum[:]); got != p.FileHash {
		return fmt.Errorf("the experiment script %s on this node is not the one submitted (sha256 %.12s here, %.12s "+
			"submitted): results of two scripts would mix; resubmit with --resume once every node sees one file",
			p.File, got, p.FileHash)
	}
	digest, hashes := runner.KernelsDigestOf(t.KernelsDir)
	return t.checkKernels(worker.Kernels{Digest: digest, Files: hashes}, "on this node")
}

// checkKernels refuses kernels_py sources other than the submitted ones:
// those under the kernels root, or those a worker reports it imported (a
// file edited after the check above).
func (t Task) checkKernels(k worker.Kernels, where string) error {
	p := t.Plan
	if k.Digest == p.KernelsDigest {
		return nil
	}
	changed := results.ChangedFiles(p.KernelsHash, k.Files)
	return fmt.Errorf("kernels_py under %s %s differs from the submitted sources (digest %.12s, %.12s "+
		"submitted; %d file(s) differ: %s): results of two versions would mix; make every node see the "+
		"same kernels root, unchanged while the run lasts", t.KernelsDir, where, k.Digest, p.KernelsDigest,
		len(changed), strings.Join(changed, ", "))
}

// Run runs the task's shard: its jobs not already in its segment (a task
// Slurm restarted) on the local executor, each recorded in the segment as
// it finishes. It always writes task-<i>.done, with the error if any.
func (t Task) Run(ctx context.Context) error {
	p := t.Plan
	jobs := p.Shards[t.Shard]
	done := taskDone{Jobs: len(jobs)}
	err := t.run(ctx, jobs, &done)
	switch {
	case ctx.Err() != nil:
		done.Error = fmt.Sprintf("stopped by a signal (scancel, its time limit or a preemption) after recording %d "+
			"of its %d jobs", done.Recorded, len(jobs))
	case err != nil:
		done.Error = err.Error()
	}
	if werr := t.writeDone(done); werr != nil && err == nil {
		err = werr
	}
	return err
}

// Failed records, in task-<i>.done, that the task could not start its
// jobs (its node lacks the interpreter, a workload's packages, ...), and
// returns err: without it, the host could only guess why the task ended.
func (t Task) Failed(err error) error {
	done := taskDone{Jobs: len(t.Plan.Shards[t.Shard]), Error: "could not start its jobs: " + err.Error()}
	if werr := t.writeDone(done); werr != nil {
		return fmt.Errorf("%w (and its end could not be recorded: %v)", err, werr)
	}
	return err
}

func (t Task) writeDone(done taskDone) error {
	done.Ended = time.Now()
	data, _ := json.Marshal(done)
	return os.WriteFile(donePath(t.Plan.RunDir, t.Plan.Submission, t.Shard), append(data, '\n'), 0o644)
}

func (t Task) run(ctx context.Context, jobs []runner.Job, done *taskDone) error {
	p := t.Plan
	if err := t.CheckSources(); err != nil {
		return err
	}
	name := results.SegmentName(p.Submission, t.Shard)
	recorded, err := results.ReadSegment(results.SegmentPath(p.RunDir, name))
	if err != nil {
		return err
	}
	have := map[string]bool{}
	for _, rec := range recorded {
		have[rec.JobID] = true
	}
	seg, err := results.CreateSegment(p.RunDir, name)
	if err != nil {
		return err
	}
	defer seg.Close()
	details := map[string]runner.Job{}
	var todo []sched.Job
	for _, j := range jobs {
		details[j.ID] = j
		if !have[j.ID] {
			todo = append(todo, j.Job)
		}
	}
	done.Recorded = len(jobs) - len(todo)
	t.Log.Info().Str("submission", p.Submission).Int("shard", t.Shard).Int("jobs", len(jobs)).
		Int("already_recorded", done.Recorded).Msg("task starting")
	return t.Executor.Run(ctx, runner.Batch{
		Dir: p.RunDir, Jobs: todo, Experiment: p.Experiment, Details: details, KernelsDigest: p.KernelsDigest,
		Log: t.Log,
		CodeDigest: func() (string, error) { // a worker starting mid-task must still see the submitted sources
			return p.KernelsDigest, t.CheckSources()
		},
		CheckCode: func(k worker.Kernels) error { return t.checkKernels(k, "as a worker imported it") },
		Done: func(out runner.Outcome) error {
			if out.Kernels != nil { // a job whose sources changed under it is not recorded: --resume reruns it
				if err := t.checkKernels(*out.Kernels, "as its worker ran job "+out.Job.ID); err != nil {
					return err
				}
			}
			rec := runner.NewRecord(p.Experiment, details[out.Job.ID], out)
			rec.KernelsDigest = p.KernelsDigest
			if rec.Status != results.StatusOK {
				done.Failed++
			}
			done.Recorded++
			return seg.Append(rec)
		},
	})
}
