package runner

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/vlkv/vlkv/gohost/sched"
	"github.com/vlkv/vlkv/gohost/tensor"
	"github.com/vlkv/vlkv/gohost/worker"
)

// Local runs batches on a pool of Python workers on this machine (see
// package sched): one per GPU, or CPU workers sharing the cores.
type Local struct {
	Python      string        // interpreter the workers run
	KernelsRoot string        // directory holding kernels_py/
	Device      worker.Device // cpu or cuda, already resolved
	// Workers is the pool size; zero means one per GPU on CUDA, else one.
	Workers int
	// StartTimeout bounds each worker's start (worker.Config.StartTimeout).
	StartTimeout time.Duration
	Log          zerolog.Logger // for the workers themselves (what they print, with -v)
}

var _ Executor = (*Local)(nil)

// scratchBytes is the arena each worker gets for the tensors a job returns.
const scratchBytes = 16 << 20

// Run runs b's jobs on a fresh pool; its workers and their arenas are gone
// when it returns.
func (l *Local) Run(ctx context.Context, b Batch) error {
	gpus := visibleGPUs(os.LookupEnv, "/")
	workers := l.Workers
	if workers == 0 {
		workers = 1
		if l.Device == worker.CUDA && len(gpus) > 0 {
			workers = len(gpus)
		}
	}
	scratch := newScratchArenas()
	defer scratch.Close()
	shares := newGPUShares(len(gpus))
	var once sync.Once
	start := func(ctx context.Context) (*worker.Worker, error) {
		if b.CodeDigest != nil {
			if _, err := b.CodeDigest(); err != nil {
				return nil, sched.Permanent(err)
			}
		}
		gpu := shares.take()
		env := workerEnv(os.Environ(), l.Device, gpu, workers, gpus)
		w, err := worker.Start(ctx, worker.Config{Python: l.Python, KernelsRoot: l.KernelsRoot, Device: l.Device, Env: env,
			StartTimeout: l.StartTimeout, Log: l.Log})
		if err != nil {
			shares.put(gpu)
			return nil, err
		}
		if b.CheckCode != nil {
			if err := b.CheckCode(l.kernels(w)); err != nil {
				w.Close()
				shares.put(gpu)
				return nil, sched.Permanent(err)
			}
		}
		if b.Started != nil {
			once.Do(func() { b.Started(w.Hello()) })
		}
		if err := scratch.Lend(ctx, w); err != nil {
			w.Close()
			shares.put(gpu)
			return nil, err
		}
		shares.bind(w, gpu)
		return w, nil
	}
	stopped := func(w *worker.Worker) {
		scratch.Release(w)
		shares.release(w)
	}
	return sched.Run(ctx, b.Jobs, sched.Config{Workers: workers, Start: start, Log: b.Log, Prepare: scratch.Prepare,
		Stopped: stopped,
		Done: func(out sched.Outcome) error {
			// Called before the worker takes its next job, so its scratch
			// arena still holds what this one returned.
			var kernels *worker.Kernels
			if out.Worker != nil {
				k := l.kernels(out.Worker)
				kernels = &k
			}
			return b.Done(Outcome{Outcome: out, Kernels: kernels, SaveTensors: func() (map[string]string, error) {
				return saveTensors(b.Dir, out.Job.ID, out.Result, scratch)
			}})
		}})
}

// kernels is the sources w has run, as it reports them; for a worker that
// does not, those under the kernels root now.
func (l *Local) kernels(w *worker.Worker) worker.Kernels {
	if k := w.Kernels(); k != nil {
		return *k
	}
	digest, files := KernelsDigestOf(l.KernelsRoot)
	return worker.Kernels{Digest: digest, Files: files}
}

// visibleGPUs are the GPUs workers may take, as CUDA_VISIBLE_DEVICES names
// them: those it lists where it is set (by the user, or by Slurm for a
// task's allocated GPUs), else every NVIDIA device node under devRoot.
// lookupEnv is os.LookupEnv outside tests.
func visibleGPUs(lookupEnv func(string) (string, bool), devRoot string) []string {
	if v, ok := lookupEnv("CUDA_VISIBLE_DEVICES"); ok {
		var gpus []string
		for _, id := range strings.Split(v, ",") {
			if id = strings.TrimSpace(id); id != "" && id != "-1" {
				gpus = append(gpus, id)
			}
		}
		return gpus
	}
	gpus := make([]string, worker.GPUs(devRoot))
	for i := range gpus {
		gpus[i] = strconv.Itoa(i)
	}
	return gpus
}

// workerEnv is the environment of a worker that takes GPU slot of gpus
// (see gpuShares), or, on CPU, of one of workers that split the cores
// between them unless the user set OMP_NUM_THREADS.
func workerEnv(base []string, device worker.Device, slot, workers int, gpus []string) []string {
	env := base
	if device == worker.CUDA && len(gpus) > 0 {
		return append(env, "CUDA_VISIBLE_DEVICES="+gpus[slot%len(gpus)])
	}
	if !worker.HasEnv(base, "OMP_NUM_THREADS") && workers > 1 {
		env = append(env, fmt.Sprintf("OMP_NUM_THREADS=%d", max(1, runtime.NumCPU()/workers)))
	}
	return env
}

// gpuShares hands each worker that starts the GPU the fewest live workers
// use, the lowest of a tie: workers take the GPUs in turn, and one that
// replaces a stopped worker (a crash, a timeout) takes the GPU it left,
// not the next in turn, which another worker may still hold.
type gpuShares struct {
	mu       sync.Mutex
	users    []int // live workers, by GPU
	byWorker map[*worker.Worker]int
}

func newGPUShares(gpus int) *gpuShares {
	return &gpuShares{users: make([]int, gpus), byWorker: map[*worker.Worker]int{}}
}

// take is the GPU of a worker about to start (0 without GPUs); put gives
// it back if the worker does not start, bind ties it to one that did.
func (g *gpuShares) take() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.users) == 0 {
		return 0
	}
	gpu := 0
	for i, n := range g.users {
		if n < g.users[gpu] {
			gpu = i
		}
	}
	g.users[gpu]++
	return gpu
}

func (g *gpuShares) put(gpu int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if gpu < len(g.users) {
		g.users[gpu]--
	}
}

func (g *gpuShares) bind(w *worker.Worker, gpu int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.byWorker[w] = gpu
}

// release gives back the GPU of w, a worker that is gone.
func (g *gpuShares) release(w *worker.Worker) {
	g.mu.Lock()
	gpu, ok := g.byWorker[w]
	delete(g.byWorker, w)
	g.mu.Unlock()
	if ok {
		g.put(gpu)
	}
}

// scratchArenas gives every worker an arena whose whole extent each of its
// jobs may use for the tensors it returns; the host saves them as .npy before
// the worker takes its next job.
type scratchArenas struct {
	mu       sync.Mutex
	lastID   uint32 // ids are taken under mu, so workers starting together never share one
	byWorker map[*worker.Worker]*tensor.Arena
	byID     map[uint32]*tensor.Arena
}

func newScratchArenas() *scratchArenas {
	return &scratchArenas{byWorker: map[*worker.Worker]*tensor.Arena{}, byID: map[uint32]*tensor.Arena{}}
}

// nextID is a fresh arena id.
func (s *scratchArenas) nextID() uint32 {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lastID++
	return s.lastID
}

// Lend maps a new arena into w.
func (s *scratchArenas) Lend(ctx context.Context, w *worker.Worker) error {
	id := s.nextID()
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

// Prepare lends the job the whole arena of the worker about to run it.
func (s *scratchArenas) Prepare(w *worker.Worker, spec *worker.Job) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if a := s.byWorker[w]; a != nil {
		spec.Scratch = &tensor.Region{Arena: a.ID(), Offset: 0, Size: a.Size()}
	}
}

// Release closes the arena lent to w, a worker that is gone: a run that
// restarts workers (crashes, timeouts) would otherwise keep a descriptor and
// the pages its jobs wrote for every worker it ever started.
func (s *scratchArenas) Release(w *worker.Worker) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if a := s.byWorker[w]; a != nil {
		delete(s.byWorker, w)
		delete(s.byID, a.ID())
		a.Close()
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
// tensors/<job id>/<name>.npy under runDir and returns their paths relative
// to it, by name.
func saveTensors(runDir, jobID string, result json.RawMessage, scratch *scratchArenas) (map[string]string, error) {
	// An earlier attempt at this job killed mid-write left its temporary
	// files (a tensor's size each); only the job's own run writes here.
	if err := tensor.RemoveTemps(filepath.Join(runDir, tensorDir(jobID))); err != nil {
		return nil, err
	}
	var res struct {
		Tensors map[string]tensor.Ref `json:"tensors"`
	}
	if json.Unmarshal(result, &res) != nil || len(res.Tensors) == 0 {
		return nil, nil
	}
	paths := map[string]string{}
	for name, ref := range res.Tensors {
		a := scratch.Arena(ref.Desc.Arena)
		if a == nil {
			return paths, fmt.Errorf("tensor %q names arena %d, which was not lent", name, ref.Desc.Arena)
		}
		t, err := a.Tensor(ref.Desc)
		if err != nil {
			return paths, fmt.Errorf("tensor %q: %w", name, err)
		}
		rel := tensorPath(jobID, name)
		if err := os.MkdirAll(filepath.Dir(filepath.Join(runDir, rel)), 0o755); err != nil {
			return paths, err
		}
		if err := tensor.WriteNPYWidened(filepath.Join(runDir, rel), t); err != nil { // bfloat16 as float32
			return paths, err
		}
		paths[name] = rel
	}
	return paths, nil
}
