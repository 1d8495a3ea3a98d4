// Package pyrt finds the Python that runs the workers and the kernels_py code
// they import.
//
// The interpreter comes from --python or WORKBENCH_PYTHON, else from the
// managed runtime: CPython embedded in the binary, extracted to the user cache
// dir, with a virtual environment beside it holding the locked third-party
// dependencies. kernels_py is never installed there; see ResolveKernels.
package pyrt

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// Kind says where the interpreter came from.
type Kind string

const (
	Managed  Kind = "managed"  // embedded CPython + venv built by the workbench
	External Kind = "external" // an interpreter the user named
)

// EnvPython names the environment variable that selects an external interpreter.
const EnvPython = "WORKBENCH_PYTHON"

// Runtime is a resolved Python runtime.
type Runtime struct {
	Kind   Kind   `json:"kind"`
	Source string `json:"source"` // "--python", "WORKBENCH_PYTHON" or "managed"
	Python string `json:"python"` // interpreter that runs workers
	// Managed runtimes only.
	Base    string `json:"base,omitempty"`    // extracted embedded CPython
	Venv    string `json:"venv,omitempty"`    // virtual environment with the locked dependencies
	Headers bool   `json:"headers,omitempty"` // Python.h present for Triton's launcher builds
}

// Options say how to resolve the runtime.
type Options struct {
	PythonFlag string                                  // --python, "" if not given
	LookupEnv  func(string) (string, bool)             // os.LookupEnv outside tests
	Managed    func(context.Context) (*Runtime, error) // builds or reuses the managed runtime
}

// Resolve picks the interpreter: --python, then WORKBENCH_PYTHON, then the
// managed runtime.
func Resolve(ctx context.Context, opts Options) (*Runtime, error) {
	if opts.PythonFlag != "" {
		return external(opts.PythonFlag, "--python")
	}
	lookup := opts.LookupEnv
	if lookup == nil {
		lookup = os.LookupEnv
	}
	if v, ok := lookup(EnvPython); ok && v != "" {
		return external(v, EnvPython)
	}
	if opts.Managed == nil {
		return nil, errors.New("no Python runtime: pass --python PATH or set " + EnvPython)
	}
	return opts.Managed(ctx)
}

// external checks that path names an executable file. A virtualenv's python is
// a symlink, which Stat follows; the path itself is kept so the venv is used.
// No PYTHONHOME is set for it: that would break a virtualenv.
func external(path, source string) (*Runtime, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("python interpreter %q (from %s): %w", path, source, err)
	}
	st, err := os.Stat(abs)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return nil, fmt.Errorf("python interpreter %s (from %s) does not exist; pass the path of a python executable, e.g. /path/to/venv/bin/python", path, source)
	case err != nil:
		return nil, fmt.Errorf("python interpreter %s (from %s): %w", path, source, err)
	case st.IsDir():
		return nil, fmt.Errorf("python interpreter %s (from %s) is a directory; pass the interpreter itself, e.g. %s", path, source, filepath.Join(path, "bin", "python"))
	case st.Mode().Perm()&0o111 == 0:
		return nil, fmt.Errorf("python interpreter %s (from %s) is not executable", path, source)
	}
	return &Runtime{Kind: External, Source: source, Python: abs}, nil
}
