package runner

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/rs/zerolog"

	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/sched"
	"github.com/vlkv/vlkv/gohost/tensor"
	"github.com/vlkv/vlkv/gohost/testpy"
	"github.com/vlkv/vlkv/gohost/worker"
)

func TestWorkerEnv(t *testing.T) {
	base := []string{"PATH=/bin"}
	omp := fmt.Sprintf("OMP_NUM_THREADS=%d", max(1, runtime.NumCPU()/2))
	two := []string{"0", "1"}
	tests := []struct {
		name          string
		base          []string
		device        worker.Device
		slot, workers int
		gpus          []string
		want          []string
	}{
		{"first gpu", base, worker.CUDA, 0, 2, two, []string{"PATH=/bin", "CUDA_VISIBLE_DEVICES=0"}},
		{"gpus taken in turn", base, worker.CUDA, 3, 2, two, []string{"PATH=/bin", "CUDA_VISIBLE_DEVICES=1"}},
		{"the gpus CUDA_VISIBLE_DEVICES lists", []string{"CUDA_VISIBLE_DEVICES=3,5"}, worker.CUDA, 1, 2, []string{"3", "5"},
			[]string{"CUDA_VISIBLE_DEVICES=3,5", "CUDA_VISIBLE_DEVICES=5"}},
		{"cuda without gpus splits the cores", base, worker.CUDA, 0, 2, nil, []string{"PATH=/bin", omp}},
		{"cpu workers split the cores", base, worker.CPU, 1, 2, []string{"0", "1", "2", "3"}, []string{"PATH=/bin", omp}},
		{"one cpu worker takes all", base, worker.CPU, 0, 1, nil, []string{"PATH=/bin"}},
		{"the user's OMP_NUM_THREADS wins", []string{"OMP_NUM_THREADS=3"}, worker.CPU, 0, 2, nil, []string{"OMP_NUM_THREADS=3"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := workerEnv(tc.base, tc.device, tc.slot, tc.workers, tc.gpus)
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("got %v, want %v", got, tc.want)
			}
		})
	}
}

// Workers go to the GPUs CUDA_VISIBLE_DEVICES leaves them (a user's choice,
// or a Slurm task's allocation), one per GPU by default: they went to
// every GPU of the machine, as many as it has, each told to use its own
// by index, overriding the choice.
func TestVisibleGPUs(t *testing.T) {
	root := t.TempDir()
	os.MkdirAll(filepath.Join(root, "dev"), 0o755)
	for _, name := range []string{"nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl"} {
		os.WriteFile(filepath.Join(root, "dev", name), nil, 0o644)
	}
	tests := []struct {
		name string
		env  map[string]string
		want []string
	}{
		{"every device node", nil, []string{"0", "1", "2", "3"}},
		{"the ones listed", map[string]string{"CUDA_VISIBLE_DEVICES": "2"}, []string{"2"}},
		{"listed by uuid", map[string]string{"CUDA_VISIBLE_DEVICES": "GPU-a1, GPU-b2"}, []string{"GPU-a1", "GPU-b2"}},
		{"none", map[string]string{"CUDA_VISIBLE_DEVICES": ""}, nil},
		{"hidden", map[string]string{"CUDA_VISIBLE_DEVICES": "-1"}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			lookup := func(k string) (string, bool) { v, ok := tc.env[k]; return v, ok }
			if got := visibleGPUs(lookup, root); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}
}

// Workers take the GPUs in turn, and one that replaces a stopped worker
// takes the GPU it left: a restart took the next GPU in turn, so a crash
// on the second of two GPUs put two workers on the first and none on the
// second.
func TestGPUSharesOfRestartedWorkers(t *testing.T) {
	w := []*worker.Worker{{}, {}, {}, {}}
	type step struct {
		stop    int // a worker stops first (-1: none)
		wantGPU int // the GPU the next worker to start takes
	}
	tests := []struct {
		name  string
		gpus  int
		steps []step
	}{
		{"in turn", 2, []step{{-1, 0}, {-1, 1}, {-1, 0}, {-1, 1}}},
		{"the second gpu's worker restarted", 2, []step{{-1, 0}, {-1, 1}, {1, 1}}},
		{"the first gpu's worker restarted", 2, []step{{-1, 0}, {-1, 1}, {0, 0}}},
		{"no gpus", 0, []step{{-1, 0}, {-1, 0}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			g := newGPUShares(tc.gpus)
			started := 0
			for i, st := range tc.steps {
				if st.stop >= 0 {
					g.release(w[st.stop])
				}
				gpu := g.take()
				if gpu != st.wantGPU {
					t.Fatalf("step %d: the worker starting took GPU %d, want %d", i, gpu, st.wantGPU)
				}
				g.bind(w[started], gpu)
				started++
			}
		})
	}
}

// float32s reads a little-endian float32 .npy file's values.
func float32s(t *testing.T, path string) []float32 {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	descr, shape, err := tensor.ReadNPYHeader(f)
	if err != nil || descr != "<f4" || len(shape) != 1 {
		t.Fatalf("%s: %s %v %v", path, descr, shape, err)
	}
	v := make([]float32, shape[0])
	if err := binary.Read(f, binary.LittleEndian, v); err != nil {
		t.Fatal(err)
	}
	return v
}

func TestSaveTensors(t *testing.T) {
	scratch := newScratchArenas()
	defer scratch.Close()
	a, err := tensor.NewArena(1, "scratch", 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	scratch.byID[1] = a
	x, err := a.NewTensor(tensor.Float32, 3)
	if err != nil {
		t.Fatal(err)
	}
	if err := x.SetFloat64s([]float64{1, 2, 3}); err != nil {
		t.Fatal(err)
	}
	y, err := a.NewTensor(tensor.BFloat16, 3) // numpy has none: saved widened to float32
	if err == nil {
		err = y.SetFloat64s([]float64{1, 2, 3})
	}
	if err != nil {
		t.Fatal(err)
	}
	ref := func(v any) string {
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	bad := x.Desc()
	bad.Arena = 7

	dir := t.TempDir()
	tests := []struct {
		name   string
		result string
		want   map[string]string
		err    string
	}{
		{"none", `{"metrics": {}}`, nil, ""},
		{"not json", `nope`, nil, ""},
		{"saved", `{"tensors": {"rel/err": ` + ref(x) + `}}`, map[string]string{"rel/err": filepath.Join("tensors", "job1", "rel%2Ferr.npy")}, ""},
		{"bfloat16", `{"tensors": {"y": ` + ref(y) + `}}`, map[string]string{"y": filepath.Join("tensors", "job1", "y.npy")}, ""},
		{"arena not lent", `{"tensors": {"x": {"__tensor__": ` + ref(bad) + `}}}`, map[string]string{}, `tensor "x" names arena 7, which was not lent`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			// What an attempt killed mid-write left goes, whatever this one returns.
			leftover := filepath.Join(dir, "tensors", "job1", "big.npy.tmp-4242")
			if err := os.MkdirAll(filepath.Dir(leftover), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(leftover, []byte("partial"), 0o600); err != nil {
				t.Fatal(err)
			}
			got, err := saveTensors(dir, "job1", json.RawMessage(tc.result), scratch)
			if _, serr := os.Stat(leftover); serr == nil {
				t.Error("the temporary file of an interrupted write is still there")
			}
			if (err == nil) != (tc.err == "") || err != nil && err.Error() != tc.err {
				t.Fatalf("error %v, want %q", err, tc.err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("paths %v, want %v", got, tc.want)
			}
			for _, p := range got {
				if v := float32s(t, filepath.Join(dir, p)); !reflect.DeepEqual(v, []float32{1, 2, 3}) {
					t.Errorf("%s holds %v", p, v)
				}
			}
		})
	}
}

// Local runs a batch on real workers: versions come from the first worker's
// hello, every job is reported, and each job's tensors are saved from the
// worker's arena before its next job reuses it.
func TestLocalRunsOnWorkers(t *testing.T) {
	py := testpy.Python(t)
	root := t.TempDir()
	if out, err := exec.Command("cp", "-r", "../../kernels_py", root).CombinedOutput(); err != nil {
		t.Fatalf("copy kernels_py: %v: %s", err, out)
	}
	mod := `import torch
from kernels_py.runtime import arena

def ramp(n):
    t = arena.empty((n,), torch.float32)
    t.copy_(torch.arange(n, dtype=torch.float32))
    return {"metrics": {"n": n}, "tensors": {"ramp": t}}
`
	if err := os.WriteFile(filepath.Join(root, "kernels_py", "runnertest.py"), []byte(mod), 0o644); err != nil {
		t.Fatal(err)
	}
	var jobs []Job
	for _, n := range []int{3, 5} {
		jobs = append(jobs, Job{Job: sched.Job{ID: fmt.Sprintf("ramp%d", n), Spec: worker.Job{Fn: "kernels_py.runnertest:ramp", Args: map[string]any{"n": n}}}})
	}
	jobs = append(jobs, Job{Job: sched.Job{ID: "fails", Spec: worker.Job{Fn: "kernels_py.runtime.diag:fail", Args: map[string]any{"message": "bad params"}}}})

	o := Options{Out: t.TempDir(), Experiment: "local", Jobs: jobs, KernelsDir: root, Device: "cpu",
		Executor: &Local{Python: py, KernelsRoot: root, Device: worker.CPU, Workers: 1, Log: zerolog.Nop()},
		Progress: &bytes.Buffer{}, Log: zerolog.Nop()}
	sum, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	if sum.Rows != 3 || sum.Failed != 1 || !sum.Ended {
		t.Errorf("summary %+v", sum)
	}
	recs, err := results.ReadJournal(sum.Dir)
	if err != nil || len(recs) != 3 {
		t.Fatalf("journal: %d records, %v", len(recs), err)
	}
	for _, r := range recs[:2] {
		want := filepath.Join(results.TensorsDir, r.JobID, "ramp.npy")
		if r.Status != results.StatusOK || r.Extra["tensor_ramp"] != want {
			t.Fatalf("job %s: %s %s, extra %v", r.JobID, r.Status, r.Error, r.Extra)
		}
		n := int(r.Metrics["n"].(float64))
		if v := float32s(t, filepath.Join(sum.Dir, want)); len(v) != n || v[n-1] != float32(n-1) {
			t.Errorf("job %s saved %v", r.JobID, v)
		}
	}
	if f := recs[2]; f.Status != results.StatusFailed || !strings.Contains(f.Error, "bad params") || f.Extra["traceback"] == nil {
		t.Errorf("failing job: %+v", f)
	}
	m := manifest(t, sum.Dir)
	if !strings.HasPrefix(m.Versions["python"], "3.") || m.Versions["torch"] == "" {
		t.Errorf("versions %v", m.Versions)
	}
	// The worker hashes what it imports by the host's rules: the same
	// sources give the same digest on both sides.
	digest, files := KernelsDigestOf(root)
	for _, r := range recs {
		if r.KernelsDigest != digest {
			t.Errorf("job %s ran on kernels %.12s; the host hashes %.12s", r.JobID, r.KernelsDigest, digest)
		}
	}
	if m.KernelsDigest != digest || !reflect.DeepEqual(m.KernelsHash, files) || len(m.CodeChanges) != 0 {
		t.Errorf("manifest kernels %.12s, %d files, changes %v; want %.12s, %d files", m.KernelsDigest, len(m.KernelsHash), m.CodeChanges, digest, len(files))
	}
}

// Workers that start together each get an arena of their own.
func TestScratchArenaIDsAreDistinct(t *testing.T) {
	s := newScratchArenas()
	ids := make(chan uint32, 64)
	var wg sync.WaitGroup
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ids <- s.nextID()
		}()
	}
	wg.Wait()
	close(ids)
	seen := map[uint32]bool{}
	for id := range ids {
		if seen[id] || id == 0 {
			t.Fatalf("arena id %d handed out twice (or zero)", id)
		}
		seen[id] = true
	}
}

// scratchFDs counts this process's descriptors of scratch arenas.
func scratchFDs(t *testing.T) int {
	t.Helper()
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range entries {
		if target, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); err == nil && strings.Contains(target, "vlkv-scratch") {
			n++
		}
	}
	return n
}

// A worker that is gone takes its scratch arena with it: jobs that crash
// their workers (each crash retried once on a fresh one) leave no arena
// behind, where every worker started kept one until the batch ended.
func TestLocalReleasesScratchOfStoppedWorkers(t *testing.T) {
	py := testpy.Python(t)
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	before := scratchFDs(t)
	var jobs []sched.Job
	for i := range 3 {
		jobs = append(jobs, sched.Job{ID: fmt.Sprintf("crash%d", i), Spec: worker.Job{Fn: "kernels_py.runtime.diag:crash"}})
	}
	jobs = append(jobs, sched.Job{ID: "echo", Spec: worker.Job{Fn: "kernels_py.runtime.diag:echo"}})
	var held []int
	l := &Local{Python: py, KernelsRoot: root, Device: worker.CPU, Workers: 1, Log: zerolog.Nop()}
	err = l.Run(context.Background(), Batch{Jobs: jobs, Log: zerolog.Nop(), Done: func(o Outcome) error {
		held = append(held, scratchFDs(t)-before)
		return nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	// At each report only the arena of the worker that ran the job is
	// left (Done may still read it): the first worker of each crashed job,
	// and that of every job before, are released.
	if !reflect.DeepEqual(held, []int{1, 1, 1, 1}) {
		t.Errorf("scratch arenas held at each report: %v, want [1 1 1 1]", held)
	}
	if got := scratchFDs(t) - before; got != 0 {
		t.Errorf("%d scratch arenas left after the run", got)
	}
}
