package main

import (
	"context"
	"fmt"
	"os"

	vlkv "github.com/vlkv/vlkv"
	"github.com/vlkv/vlkv/gohost/pyrt"
	"github.com/vlkv/vlkv/gohost/worker"
)

// session is what every command that runs Python resolves first.
type session struct {
	runtime *pyrt.Runtime
	kernels pyrt.KernelsRoot
	device  worker.Device
}

func (a *app) newSession(ctx context.Context) (*session, error) {
	kernels, rt, err := a.resolveRuntime(ctx)
	if err != nil {
		return nil, err
	}
	cacheDir, err := pyrt.CacheDir()
	if err != nil {
		return nil, err
	}
	device := worker.ResolveDevice(a.flags.device.value, os.LookupEnv, "/")
	if device == worker.CPU {
		a.log.Info().Msg("no CUDA device in use: Triton kernels run on the CPU under the interpreter (TRITON_INTERPRET=1)")
	}
	if device == worker.CUDA && rt.Kind == pyrt.Managed && !rt.Headers {
		if err := pyrt.EnsureHeaders(ctx, rt, pyrt.ManagedConfig{CacheDir: cacheDir, Log: a.log}); err != nil {
			return nil, fmt.Errorf("the managed runtime has no Python headers, so Triton cannot build its GPU launcher (%v); "+
				"pass --python with an interpreter that has them (a virtualenv python works), or run with --device cpu", err)
		}
	}
	a.log.Debug().Str("python", rt.Python).Str("runtime", string(rt.Kind)).Str("kernels", kernels.Dir).
		Str("kernels_source", kernels.Source).Str("device", string(device)).Msg("session")
	return &session{runtime: rt, kernels: kernels, device: device}, nil
}

// withWorker resolves a session, starts one worker, runs fn with it and shuts
// the worker down.
func (a *app) withWorker(ctx context.Context, fn func(*session, *worker.Worker) error) error {
	return a.withWorkerOf(ctx, false, fn)
}

// withWorkerOf is withWorker; allowMissing starts a worker whose interpreter
// cannot import triton or numpy too (worker.Config.AllowMissingPackages),
// for a command that reports what it has.
func (a *app) withWorkerOf(ctx context.Context, allowMissing bool, fn func(*session, *worker.Worker) error) error {
	s, err := a.newSession(ctx)
	if err != nil {
		return err
	}
	w, err := a.startWorkerOf(ctx, s, allowMissing)
	if err != nil {
		return err
	}
	defer w.Close()
	return fn(s, w)
}

func (a *app) startWorker(ctx context.Context, s *session) (*worker.Worker, error) {
	return a.startWorkerOf(ctx, s, false)
}

func (a *app) startWorkerOf(ctx context.Context, s *session, allowMissing bool) (*worker.Worker, error) {
	w, err := worker.Start(ctx, worker.Config{
		Python:               s.runtime.Python,
		KernelsRoot:          s.kernels.Dir,
		Device:               s.device,
		StartTimeout:         a.flags.startTimeout,
		Log:                  a.log,
		AllowMissingPackages: allowMissing,
	})
	if err != nil {
		if ctx.Err() != nil { // Ctrl-C: the start was stopped, the interpreter is not at fault
			return nil, &interruptedStart{ctx.Err()}
		}
		return nil, fmt.Errorf("%w (python: %s, kernels: %s)", err, s.runtime.Python, s.kernels.Dir)
	}
	return w, nil
}

// interruptedStart is a worker start that the command's context (Ctrl-C)
// stopped.
type interruptedStart struct{ err error }

func (e *interruptedStart) Error() string { return "interrupted while the worker was starting" }
func (e *interruptedStart) Unwrap() error { return e.err }

// resolveRuntime finds the kernels root and the Python runtime, without
// choosing a device (for commands that compile rather than run kernels).
func (a *app) resolveRuntime(ctx context.Context) (pyrt.KernelsRoot, *pyrt.Runtime, error) {
	cacheDir, err := pyrt.CacheDir()
	if err != nil {
		return pyrt.KernelsRoot{}, nil, err
	}
	kernels, err := a.kernelsRoot()
	if err != nil {
		return pyrt.KernelsRoot{}, nil, err
	}
	rt, err := pyrt.Resolve(ctx, pyrt.Options{
		PythonFlag: a.flags.python,
		Managed: func(ctx context.Context) (*pyrt.Runtime, error) {
			project, err := pyrt.ProjectFor(kernels, vlkv.Assets)
			if err != nil {
				return nil, err
			}
			return pyrt.EnsureManaged(ctx, pyrt.ManagedConfig{CacheDir: cacheDir, Project: project, Log: a.log, Progress: a.stderr})
		},
	})
	return kernels, rt, err
}

// safePath is Python's -P: `python -m` would put the current directory
// first on sys.path, so a checkout the command runs in would shadow the
// kernels root (--kernels) that PYTHONPATH names.
const safePath = "-P"
