// Package worker starts long-lived Python worker processes
// (python -m kernels_py.runtime.worker) and talks to them with length-prefixed JSON
// frames on a pair of dedicated pipes, so nothing the Python side prints can
// corrupt the channel.
package worker

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"

	"github.com/vlkv/vlkv/gohost/tensor"
)

// Job names a function in the kernels_py package and its keyword arguments.
// Arguments may hold *tensor.Tensor values: they travel as descriptors into
// arenas the worker has mapped (see MapArena), never as data.
type Job struct {
	Fn   string         `json:"fn"`
	Args map[string]any `json:"args,omitempty"`
	// Scratch, if set, is where the job may allocate tensors it returns
	// (kernels_py.runtime.arena.empty); they come back as tensor.Ref descriptors.
	Scratch *tensor.Region `json:"scratch,omitempty"`
}

type arenaInfo struct {
	ID   uint32 `json:"id"`
	Size int64  `json:"size"`
}

type message struct {
	Type   string          `json:"type"`
	Blob   int64           `json:"blob,omitempty"` // raw bytes that follow the frame
	ID     uint64          `json:"id,omitempty"`
	Job    *Job            `json:"job,omitempty"`
	Arena  *arenaInfo      `json:"arena,omitempty"`
	Result json.RawMessage `json:"result,omitempty"`
	Error  *JobError       `json:"error,omitempty"`
	// A reply to "run": the digest of the sources the worker ran by the
	// job's end, and their files when the digest changed since it last said.
	KernelsDigest string            `json:"kernels_digest,omitempty"`
	KernelsFiles  map[string]string `json:"kernels_sha256,omitempty"`
}

// DefaultStartTimeout is how long a worker may take to send its hello.
const DefaultStartTimeout = time.Minute

// Config says how to start a worker.
type Config struct {
	Python      string   // interpreter to run
	KernelsRoot string   // directory holding kernels_py/, put first on PYTHONPATH
	Device      Device   // cpu or cuda (already resolved)
	Env         []string // base environment; nil means os.Environ()
	// StartTimeout bounds the wait for the worker's hello (importing torch can
	// take seconds on a cold disk). Zero means DefaultStartTimeout.
	StartTimeout time.Duration
	Log          zerolog.Logger
	// AllowMissingPackages starts a worker whose interpreter cannot import
	// triton or numpy (its hello says why), for a command that reports what
	// the interpreter has; otherwise such a worker is refused, as it could
	// run no job.
	AllowMissingPackages bool
}

// Worker is one running Python worker. Its methods may be called from several
// goroutines; requests are served one at a time.
type Worker struct {
	cmd   *exec.Cmd
	tx    *os.File
	rx    *os.File
	sock  *os.File // arena fds go over this unix socket
	hello Hello
	log   zerolog.Logger
	out   *tail

	mu      sync.Mutex // serialises requests
	nextID  uint64
	kernels *Kernels // as of the last reply that said; guarded by mu

	frames   chan frame // frames read from the worker; holds one, so a reply outlives its sender
	readErr  error      // why the reader stopped; read after readDone closes
	readDone chan struct{}
	exited   chan struct{} // closed once the process has been reaped
	waitErr  error         // cmd.Wait's result; read after exited closes

	closing   chan struct{} // closed by release: nothing reads frames any more
	closeOnce sync.Once
}

// Start launches a worker and waits for its hello.
func Start(ctx context.Context, cfg Config) (*Worker, error) {
	if cfg.Python == "" {
		return nil, errors.New("start worker: no Python interpreter given")
	}
	// Host -> worker and worker -> host pipes, handed over as fds 3 and 4.
	workerRx, hostTx, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("start worker: %w", err)
	}
	hostRx, workerTx, err := os.Pipe()
	if err != nil {
		workerRx.Close()
		hostTx.Close()
		return nil, fmt.Errorf("start worker: %w", err)
	}

	// A unix socket for handing over arena file descriptors (SCM_RIGHTS).
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		workerRx.Close()
		hostTx.Close()
		hostRx.Close()
		workerTx.Close()
		return nil, fmt.Errorf("start worker: socketpair: %w", err)
	}
	hostSock, workerSock := os.NewFile(uintptr(pair[0]), "fd-host"), os.NewFile(uintptr(pair[1]), "fd-worker")

	out := newTail(64 << 10)
	cmd := exec.Command(cfg.Python, "-m", "kernels_py.runtime.worker")
	cmd.Dir = cfg.KernelsRoot
	base := cfg.Env
	if base == nil {
		base = os.Environ()
	}
	cmd.Env = append(Environment(base, cfg.KernelsRoot, cfg.Device), "VLKV_WORKER_FDS=3,4,5")
	if !HasEnv(base, "PYTHONFAULTHANDLER") {
		// A job that crashes in native code (a kernel, an extension) then
		// prints the Python stack it crashed in, which its ExitError quotes.
		cmd.Env = append(cmd.Env, "PYTHONFAULTHANDLER=1")
	}
	cmd.ExtraFiles = []*os.File{workerRx, workerTx, workerSock}
	cmd.Stdout = io.MultiWriter(out, lineLogger(cfg.Log, "stdout"))
	cmd.Stderr = io.MultiWriter(out, lineLogger(cfg.Log, "stderr"))
	// Own process group: a Ctrl-C at the terminal reaches the host, which
	// decides what happens to its workers, and kill reaches the processes a
	// job started too. Pdeathsig: no orphans if the host dies.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	// A process the worker started that left its group, and so outlives
	// it, keeps its stdout open: stop copying output soon after the worker
	// exits, so that waiting for the worker cannot hang on it.
	cmd.WaitDelay = outputGrace

	startErr := cmd.Start()
	workerRx.Close()
	workerTx.Close()
	workerSock.Close()
	if startErr != nil {
		hostRx.Close()
		hostTx.Close()
		hostSock.Close()
		return nil, fmt.Errorf("start worker %s: %w", cfg.Python, startErr)
	}

	w := &Worker{
		cmd: cmd, tx: hostTx, rx: hostRx, sock: hostSock, out: out,
		log:      cfg.Log.With().Int("worker_pid", cmd.Process.Pid).Logger(),
		frames:   make(chan frame, 1),
		readDone: make(chan struct{}),
		exited:   make(chan struct{}),
		closing:  make(chan struct{}),
	}
	go w.readLoop()
	go func() {
		// What the worker's jobs started and left running ends with it: its
		// group is killed once it has exited and before it is reaped, while
		// its pid (the group's id) cannot be anyone else's, and before
		// Wait waits for the output those processes may hold open.
		pid := cmd.Process.Pid
		var info unix.Siginfo
		for {
			if err := unix.Waitid(unix.P_PID, pid, &info, unix.WEXITED|unix.WNOWAIT, nil); err != unix.EINTR {
				break
			}
		}
		_ = syscall.Kill(-pid, syscall.SIGKILL)
		w.waitErr = cmd.Wait()
		close(w.exited)
	}()

	timeout := cfg.StartTimeout
	if timeout == 0 {
		timeout = DefaultStartTimeout
	}
	helloCtx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	first, err := w.receive(helloCtx)
	if err != nil {
		w.abort()
		if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
			// Its own wait, not the caller's: say what was waited for.
			said := " and printed nothing"
			if out := strings.TrimSpace(w.out.String()); out != "" {
				said = "; its last output:\n" + indent(lastLines(out, 20))
			}
			return nil, fmt.Errorf("worker did not start: it sent no hello within %v (importing torch, triton and "+
				"kernels_py took longer, or it hung; --start-timeout gives it longer)%s", timeout, said)
		}
		var exit *ExitError
		if errors.As(err, &exit) {
			if mod := missingDependency(exit.Output); mod != "" {
				// Starting it again cannot install the module: say so now
				// rather than after every retry.
				return nil, &RefusedError{Reason: missingPackage(cfg.Python, mod, "No module named '"+mod+"'")}
			}
		}
		return nil, fmt.Errorf("worker did not start: %w", err)
	}
	body := first.body
	if err := json.Unmarshal(body, &w.hello); err != nil || w.hello.Type != "hello" {
		w.abort()
		return nil, fmt.Errorf("worker did not start: first frame is not a hello: %.200s", body)
	}
	if w.hello.Error != "" {
		w.abort()
		return nil, &RefusedError{Reason: w.hello.Error}
	}
	if name, why := w.hello.MissingPackage(); name != "" && !cfg.AllowMissingPackages {
		w.abort()
		return nil, &RefusedError{Reason: missingPackage(cfg.Python, name, why)}
	}
	w.kernels = w.hello.Kernels
	w.log.Debug().Str("python", w.hello.Python.Version).Str("device", w.hello.Device.Kind).Msg("worker ready")
	return w, nil
}

// missingModule finds the module of a Python ModuleNotFoundError.
var missingModule = regexp.MustCompile(`ModuleNotFoundError: No module named '([^']+)'`)

// missingDependency is the package every worker imports first (torch, or
// triton or numpy where a worker imports them before its hello) that a dead
// worker's output says its interpreter lacks; "" for any other failure (a
// kernels_py module is the sources' doing, and a missing submodule of a
// package that is there, such as torch._C, a broken or mismatched install,
// which the output shows).
func missingDependency(output string) string {
	found := missingModule.FindAllStringSubmatch(output, -1)
	if len(found) == 0 {
		return ""
	}
	switch mod := found[len(found)-1][1]; mod {
	case "torch", "triton", "numpy":
		return mod
	}
	return ""
}

// missingPackage says that python lacks package (why: what importing it
// raised) and what to do.
func missingPackage(python, pkg, why string) string {
	return fmt.Sprintf("the interpreter %s cannot import %s (%s), which workers need: install torch, triton and "+
		"numpy into its environment, or leave out --python and WORKBENCH_PYTHON to use the managed runtime",
		python, pkg, why)
}

// RefusedError is a worker that started and said why it cannot work (no
// CUDA device, say), or one whose interpreter cannot import torch, triton or
// numpy: starting another will not help.
type RefusedError struct{ Reason string }

func (e *RefusedError) Error() string { return "worker refused to start: " + e.Reason }

// Environment is the environment a worker (or any Python the host runs for
// the user) gets: kernelsRoot first on PYTHONPATH, the device choice in
// VLKV_DEVICE, and TRITON_INTERPRET=1 on CPU. base is usually os.Environ().
func Environment(base []string, kernelsRoot string, device Device) []string {
	env := make([]string, 0, len(base)+5)
	var pythonPath string
	for _, kv := range base {
		switch {
		case strings.HasPrefix(kv, "PYTHONPATH="):
			pythonPath = strings.TrimPrefix(kv, "PYTHONPATH=")
		case strings.HasPrefix(kv, "TRITON_INTERPRET="), strings.HasPrefix(kv, "VLKV_DEVICE="),
			strings.HasPrefix(kv, "VLKV_WORKER_FDS="):
			// decided by the host below
		default:
			env = append(env, kv)
		}
	}
	if pythonPath != "" {
		pythonPath = kernelsRoot + string(os.PathListSeparator) + pythonPath
	} else {
		pythonPath = kernelsRoot
	}
	env = append(env, "PYTHONPATH="+pythonPath, "PYTHONUNBUFFERED=1", "VLKV_DEVICE="+string(device))
	if device == CPU {
		env = append(env, "TRITON_INTERPRET=1")
	}
	return env
}

// HasEnv says whether env (KEY=VALUE entries) sets key.
func HasEnv(env []string, key string) bool {
	for _, kv := range env {
		if strings.HasPrefix(kv, key+"=") {
			return true
		}
	}
	return false
}

// frame is one message from the worker and the raw bytes that followed it,
// if it announced any ("blob": n).
type frame struct {
	body []byte
	blob []byte
}

// MaxBlobBytes caps the raw bytes one message may carry after its frame.
const MaxBlobBytes = 4 << 30

func (w *Worker) readLoop() {
	defer close(w.readDone)
	for {
		body, err := ReadFrame(w.rx)
		if err != nil {
			w.readErr = err
			return
		}
		f := frame{body: body}
		if bytes.Contains(body, []byte(`"blob"`)) {
			var hdr struct {
				Blob int64 `json:"blob"`
			}
			if err := json.Unmarshal(body, &hdr); err != nil || hdr.Blob < 0 || hdr.Blob > MaxBlobBytes {
				w.readErr = fmt.Errorf("frame announces a blob of %d bytes", hdr.Blob)
				return
			}
			f.blob = make([]byte, hdr.Blob)
			if _, err := io.ReadFull(w.rx, f.blob); err != nil {
				w.readErr = fmt.Errorf("truncated blob: %w", err)
				return
			}
		}
		// A frame read is delivered even when the worker has exited since
		// it sent it: a reply written just before the worker died is still
		// the job's result. Only a host that stopped reading drops it.
		select {
		case w.frames <- f:
		case <-w.closing:
			w.readErr = errors.New("worker closed")
			return
		}
	}
}

// receive waits for the next frame, the worker's death, or ctx.
func (w *Worker) receive(ctx context.Context) (frame, error) {
	select {
	case f := <-w.frames:
		return f, nil
	case <-w.readDone:
		return w.lastFrame()
	case <-w.exited:
		// What the worker wrote before it exited is in the pipe: take it if
		// it comes. A process that inherited the channel may keep it open,
		// so its closing is not waited for.
		select {
		case f := <-w.frames:
			return f, nil
		case <-w.readDone:
			return w.lastFrame()
		case <-time.After(outputGrace):
			return frame{}, w.deathError()
		}
	case <-ctx.Done():
		return frame{}, ctx.Err()
	}
}

// lastFrame is the frame the reader delivered before it stopped, if any;
// else how the worker died.
func (w *Worker) lastFrame() (frame, error) {
	select {
	case f := <-w.frames:
		return f, nil
	default:
		return frame{}, w.deathError()
	}
}

// deathError waits briefly for the process to be reaped and describes how it
// ended, with the tail of what it printed.
func (w *Worker) deathError() error {
	select {
	case <-w.exited:
	case <-time.After(5 * time.Second):
		w.kill()
	}
	state := "closed its channel"
	if w.cmd.ProcessState != nil {
		state = w.cmd.ProcessState.String()
	}
	// The reader stops once the channel's last writer is gone; readErr is
	// its to write until then.
	select {
	case <-w.readDone:
		if w.readErr != nil && !errors.Is(w.readErr, io.EOF) {
			state += "; channel error: " + w.readErr.Error()
		}
	case <-time.After(outputGrace):
	}
	return &ExitError{State: state, Output: w.out.String()}
}

// Hello is what the worker reported when it started.
func (w *Worker) Hello() Hello { return w.hello }

// Kernels is the kernels_py sources the worker has run, as of its last
// reply (a job may import a module edited since its hello); nil if it never
// said.
func (w *Worker) Kernels() *Kernels {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.kernels
}

// Pid is the worker's process id.
func (w *Worker) Pid() int { return w.cmd.Process.Pid }

// Alive reports whether the worker process is still running.
func (w *Worker) Alive() bool {
	select {
	case <-w.exited:
		return false
	default:
		return true
	}
}

// Output returns the tail of what the worker printed on stdout and stderr.
func (w *Worker) Output() string { return w.out.String() }

// call sends one request and waits for its reply. If ctx ends first the worker
// is killed: a Python job cannot be interrupted safely, and a half-finished
// kernel leaves the process in an unknown state.
func (w *Worker) call(ctx context.Context, msg message, afterWrite func() error) (json.RawMessage, error) {
	result, _, err := w.callBlob(ctx, msg, afterWrite)
	return result, err
}

// callBlob is call that also returns the raw bytes that followed the reply.
func (w *Worker) callBlob(ctx context.Context, msg message, afterWrite func() error) (json.RawMessage, []byte, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.Alive() {
		return nil, nil, w.deathError()
	}
	msgType := msg.Type
	w.nextID++
	id := w.nextID
	msg.ID = id
	if err := WriteFrame(w.tx, msg); err != nil {
		if !w.Alive() || errors.Is(err, syscall.EPIPE) {
			return nil, nil, w.deathError()
		}
		return nil, nil, err
	}
	if afterWrite != nil {
		if err := afterWrite(); err != nil {
			// The worker now waits for something that will not come.
			w.kill()
			return nil, nil, fmt.Errorf("%s: %w; worker killed", msgType, err)
		}
	}
	f, err := w.receive(ctx)
	if err != nil {
		if ctx.Err() != nil {
			w.kill()
			return nil, nil, fmt.Errorf("%s stopped, worker %d killed: %w", msgType, w.Pid(), ctx.Err())
		}
		return nil, nil, err
	}
	var reply message
	if err := json.Unmarshal(f.body, &reply); err != nil {
		w.kill()
		return nil, nil, fmt.Errorf("worker sent an unreadable reply (%v); worker killed", err)
	}
	if reply.ID != id {
		w.kill()
		return nil, nil, fmt.Errorf("worker answered request %d while %d was pending; worker killed", reply.ID, id)
	}
	if reply.KernelsDigest != "" && (w.kernels == nil || reply.KernelsDigest != w.kernels.Digest) {
		files := reply.KernelsFiles
		if files == nil && w.kernels != nil {
			files = w.kernels.Files // a worker sends files only with a new digest; keep the last ones
		}
		w.kernels = &Kernels{Digest: reply.KernelsDigest, Files: files}
	}
	switch reply.Type {
	case "result":
		return reply.Result, f.blob, nil
	case "error":
		if reply.Error == nil {
			return nil, nil, errors.New("worker reported an error without details")
		}
		return nil, nil, reply.Error
	default:
		return nil, nil, fmt.Errorf("worker sent a reply of unknown type %q", reply.Type)
	}
}

// Run runs one job and returns its JSON result. A Python exception comes back
// as *JobError; a worker that dies mid-job as *ExitError.
func (w *Worker) Run(ctx context.Context, job Job) (json.RawMessage, error) {
	return w.call(ctx, message{Type: "run", Job: &job}, nil)
}

// ReloadResult lists the kernels_py sources that changed since the last
// reload and the modules the worker dropped so they are imported afresh.
type ReloadResult struct {
	Changed []string `json:"changed"`
	Purged  []string `json:"purged"`
}

// Reload makes the worker pick up edited kernels_py sources.
func (w *Worker) Reload(ctx context.Context) (ReloadResult, error) {
	var res ReloadResult
	raw, err := w.call(ctx, message{Type: "reload"}, nil)
	if err != nil {
		return res, err
	}
	return res, json.Unmarshal(raw, &res)
}

// Close asks the worker to exit, and kills it if it does not within a few
// seconds. It is safe to call on a dead worker.
func (w *Worker) Close() error {
	if w.Alive() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := w.call(ctx, message{Type: "shutdown"}, nil)
		cancel()
		if err != nil {
			w.kill()
		}
	}
	select {
	case <-w.exited:
	case <-time.After(5 * time.Second):
		w.kill()
	}
	w.release()
	return nil
}

// abort kills a worker that failed to start and releases what it held.
func (w *Worker) abort() {
	w.kill()
	w.release()
}

// release closes the host's ends of the channel and stops the reader.
func (w *Worker) release() {
	w.closeOnce.Do(func() {
		close(w.closing)
		w.tx.Close()
		w.rx.Close()
		w.sock.Close()
	})
}

// MapArena hands the arena's file descriptor to the worker, which maps it
// once; afterwards jobs may refer to its tensors. The arena stays the host's:
// it outlives the worker and must be closed by its owner.
func (w *Worker) MapArena(ctx context.Context, a *tensor.Arena) error {
	if a.Closed() {
		// Its descriptor is gone: the worker would wait for one that never
		// comes, and be killed for it.
		return fmt.Errorf("map arena %d in worker %d: %w", a.ID(), w.Pid(), tensor.ErrClosed)
	}
	_, err := w.call(ctx, message{Type: "map_arena", Arena: &arenaInfo{ID: a.ID(), Size: a.Size()}}, func() error {
		rights := unix.UnixRights(int(a.File().Fd()))
		return unix.Sendmsg(int(w.sock.Fd()), []byte{0}, rights, nil, 0)
	})
	if err != nil {
		return fmt.Errorf("map arena %d in worker %d: %w", a.ID(), w.Pid(), err)
	}
	return nil
}

// UnmapArena tells the worker to drop its mapping of arena id.
func (w *Worker) UnmapArena(ctx context.Context, id uint32) error {
	if _, err := w.call(ctx, message{Type: "unmap_arena", Arena: &arenaInfo{ID: id}}, nil); err != nil {
		return fmt.Errorf("unmap arena %d in worker %d: %w", id, w.Pid(), err)
	}
	return nil
}

// kill kills the worker and every process of its group (what its jobs
// started: compilers, data loaders), and waits until it is reaped.
func (w *Worker) kill() {
	if w.Alive() {
		if err := syscall.Kill(-w.cmd.Process.Pid, syscall.SIGKILL); err != nil { // the group: see Start
			_ = w.cmd.Process.Kill()
		}
	}
	<-w.exited
}

// outputGrace is how long the host waits, once the worker is gone, for the
// last of its output and of its channel.
const outputGrace = 2 * time.Second

// PipeRoundTrip sends data through the pipe itself (not an arena): the worker
// reads it, doubles it as float32 in place and sends it back. It is the
// baseline `workbench bench exchange` compares arenas against; compute is the
// time the worker spent doubling.
func (w *Worker) PipeRoundTrip(ctx context.Context, data []byte) (out []byte, compute float64, err error) {
	if len(data)%4 != 0 {
		return nil, 0, fmt.Errorf("pipe round trip: %d bytes is not a whole number of float32s", len(data))
	}
	raw, blob, err := w.callBlob(ctx, message{Type: "pipe_double", Blob: int64(len(data))}, func() error {
		_, err := w.tx.Write(data)
		return err
	})
	if err != nil {
		return nil, 0, err
	}
	var res struct {
		ComputeSeconds float64 `json:"compute_seconds"`
	}
	if err := json.Unmarshal(raw, &res); err != nil {
		return nil, 0, err
	}
	return blob, res.ComputeSeconds, nil
}
