package slurm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rs/zerolog"

	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/runner"
	"github.com/vlkv/vlkv/gohost/sched"
	"github.com/vlkv/vlkv/gohost/worker"
)

// reportingExecutor stands in for a node's workers: each job "runs" on the
// sources its worker reports, and the task decides what is recorded.
type reportingExecutor struct {
	kernels  map[string]worker.Kernels // by job id
	checkErr error                     // what the batch's CheckCode said of the first job's sources
}

func (e *reportingExecutor) Run(ctx context.Context, b runner.Batch) error {
	for i, j := range b.Jobs {
		k := e.kernels[j.ID]
		if i == 0 && b.CheckCode != nil {
			e.checkErr = b.CheckCode(k)
		}
		out := runner.Outcome{Outcome: sched.Outcome{Job: j, Result: json.RawMessage(`{"metrics": {}}`)}, Kernels: &k}
		if err := b.Done(out); err != nil {
			return err
		}
	}
	return nil
}

func TestTaskRecordsOnlyRowsOnTheSubmittedSources(t *testing.T) {
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "kernels_py"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "kernels_py", "h2o.py"), []byte("x = 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	script := filepath.Join(root, "e.star")
	if err := os.WriteFile(script, []byte("experiment()\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256([]byte("experiment()\n"))
	digest, hashes := runner.KernelsDigestOf(root)
	edited := map[string]string{}
	for name := range hashes {
		edited[name] = "0000"
	}
	jobs := []runner.Job{{Job: sched.Job{ID: "a"}, Method: "h2o"}, {Job: sched.Job{ID: "b"}, Method: "h2o"}}
	for _, tc := range []struct {
		name     string
		ran      map[string]worker.Kernels
		recorded []string
		err      string
	}{
		{"every job on the submitted sources", map[string]worker.Kernels{
			"a": {Digest: digest, Files: hashes}, "b": {Digest: digest, Files: hashes}}, []string{"a", "b"}, ""},
		{"a file edited before the second job's import", map[string]worker.Kernels{
			"a": {Digest: digest, Files: hashes}, "b": {Digest: "edited", Files: edited}}, []string{"a"},
			"as its worker ran job b differs from the submitted sources"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			plan := Plan{Submission: "1", Experiment: "e", RunDir: t.TempDir(), File: script,
				FileHash: hex.EncodeToString(sum[:]), KernelsDigest: digest, KernelsHash: hashes,
				Shards: [][]runner.Job{jobs}}
			if err := os.MkdirAll(filepath.Join(plan.RunDir, "slurm", "1"), 0o755); err != nil { // as the host submits it
				t.Fatal(err)
			}
			exec := &reportingExecutor{kernels: tc.ran}
			task := Task{Plan: plan, Shard: 0, KernelsDir: root, Executor: exec, Log: zerolog.Nop()}
			err := task.Run(context.Background())
			if tc.err == "" && err != nil || tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)) {
				t.Fatalf("Run: %v, want an error containing %q", err, tc.err)
			}
			if exec.checkErr != nil {
				t.Fatalf("the first worker's sources are the submitted ones, yet CheckCode said %v", exec.checkErr)
			}
			recs, rerr := results.ReadSegment(results.SegmentPath(plan.RunDir, results.SegmentName("1", 0)))
			if rerr != nil {
				t.Fatal(rerr)
			}
			var got []string
			for _, r := range recs {
				got = append(got, r.JobID)
				if r.KernelsDigest != digest {
					t.Errorf("job %s recorded with digest %s, want the submitted %s", r.JobID, r.KernelsDigest, digest)
				}
			}
			if strings.Join(got, ",") != strings.Join(tc.recorded, ",") {
				t.Errorf("recorded %v, want %v", got, tc.recorded)
			}
		})
	}
	t.Run("a worker that imported other sources is refused at start", func(t *testing.T) {
		task := Task{Plan: Plan{KernelsDigest: digest, KernelsHash: hashes}, KernelsDir: root}
		if err := task.checkKernels(worker.Kernels{Digest: "edited", Files: edited}, "as a worker imported it"); err == nil ||
			!strings.Contains(err.Error(), "1 file(s) differ: h2o.py") {
			t.Errorf("checkKernels: %v", err)
		}
	})
}
