// Package expt turns experiment scripts into job plans.
//
// An experiment script is a Starlark file (Python syntax, deterministic,
// no I/O) that calls the predeclared workload() and experiment() built-ins.
// Load evaluates it, checks every method and parameter against the Schema
// the Python side publishes, and expands each experiment into a
// deterministic list of Jobs whose ids are hashes of their complete
// contents. Everything that can be wrong with a script is reported here,
// as a *ScriptError with a file:line:col position, before any job runs.
package expt

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"go.starlark.net/starlark"
	"go.starlark.net/syntax"
)

// Limits on what a script may cost. A script is trusted not to be hostile
// but may well have a bug: these, and DefaultMaxMemory, turn a runaway
// loop or an accidental ten-way product into an error rather than a hung
// or swapping CLI.
const (
	DefaultTimeout = 600 * time.Second // per job, when experiment() gives none
	MaxSteps       = 10_000_000        // Starlark execution steps per script
	MaxJobs        = 100_000           // jobs per plan, counted before de-duplication
)

// Job is one unit of work: one method with complete parameters on one
// complete workload.
type Job struct {
	ID           string // first 16 hex digits of sha256(CanonicalJSON())
	Experiment   string
	Method       string
	Params       map[string]any // every method param, defaults filled in
	WorkloadName string         // the registered workload
	Workload     map[string]any // every param of that workload, defaults filled in
	Timeout      time.Duration  // not part of the id
	// OutOfID names the params ("params.K") and workload knobs
	// ("workload.K") at a default whose schema entry says the id omits it
	// (Param.IDOmitsDefault): CanonicalJSON leaves them out.
	OutOfID []string
}

// Experiment is one experiment() call, expanded.
type Experiment struct {
	Name    string
	Doc     string
	Pos     string // file:line:col of the experiment() call
	Jobs    []Job
	Timeout time.Duration
	// Protocol is the comparison protocol whose params every job starts
	// from (before the grid's and extra's own); "" for none.
	Protocol string
}

// DefaultProtocol is the protocol of an experiment that names none: every
// method at its own defaults.
const DefaultProtocol = "paper"

// Plan is everything one script declares.
type Plan struct {
	File        string // as given to Load or LoadSource
	Hash        string // hex sha256 of the script bytes
	Experiments []Experiment
	Prints      []string // output of print() in the script, each "file:line:col: text"
	Warnings    []string // what still works but should change (an old word), each "file:line:col: text"
	Schema      *Schema  // what the script was checked against
}

// fileOptions are the Starlark dialect scripts are written in. Top-level
// loops, while and reassignment let a script read like a Python notebook
// cell; MaxSteps bounds what while can do. Recursion stays off, as in
// standard Starlark: deep recursion would exhaust the Go stack, which no
// step count catches.
var fileOptions = &syntax.FileOptions{
	Set:             true,
	While:           true,
	TopLevelControl: true,
	GlobalReassign:  true,
}

// Load reads and evaluates the script at path. Positions in errors name
// the file as path is written.
func Load(ctx context.Context, path string, schema *Schema) (*Plan, error) {
	src, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, &missingScriptError{path: path, err: err}
	}
	if info, serr := os.Stat(path); err != nil && serr == nil && info.IsDir() {
		// Read's own words, "read X: is a directory", name the call, not what to give.
		scripts, _ := filepath.Glob(filepath.Join(path, "*.star"))
		if len(scripts) == 0 {
			return nil, fmt.Errorf("script %s is a directory: give an experiment script, a .star file", path)
		}
		return nil, fmt.Errorf("script %s is a directory: give one of its scripts: %s", path, strings.Join(scripts, ", "))
	}
	if err != nil {
		return nil, fmt.Errorf("read script %s: %w", path, err)
	}
	return load(ctx, path, src, schema)
}

// missingScriptError is a script path with nothing there: said plainly,
// and still an fs.ErrNotExist to errors.Is.
type missingScriptError struct {
	path string
	err  error
}

func (e *missingScriptError) Error() string { return "script " + e.path + " does not exist" }
func (e *missingScriptError) Unwrap() error { return e.err }

// LoadSource evaluates src as if read from filename.
func LoadSource(filename string, src []byte, schema *Schema) (*Plan, error) {
	return load(context.Background(), filename, src, schema)
}

func load(ctx context.Context, filename string, src []byte, schema *Schema) (*Plan, error) {
	if schema == nil {
		return nil, errors.New("expt: no schema")
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("expt: %s: %w", filename, err)
	}
	sum := sha256.Sum256(src)
	plan := &Plan{File: filename, Hash: hex.EncodeToString(sum[:]), Schema: schema}
	// Python reads past the byte order mark some editors put first (Windows
	// Notepad's UTF-8); Starlark's scanner refuses it as an unexpected character.
	src = bytes.TrimPrefix(src, []byte("\ufeff"))

	// Parse first ourselves, rather than ExecFile, to keep the syntax tree:
	// errors point at arguments and literal values through it.
	f, err := fileOptions.Parse(filename, src, 0)
	if err != nil {
		se := asScriptError(err, filename, nil)
		var syn syntax.Error
		if errors.As(err, &syn) {
			se.Msg += pythonHint(syn, src)
		}
		return nil, se
	}
	l := &loader{
		schema: schema,
		pos:    indexCalls(f),
		plan:   plan,
		names:  make(map[string]string),
	}
	predeclared := l.builtins()
	prog, err := starlark.FileProgram(f, predeclared.Has)
	if err != nil {
		return nil, asScriptError(err, filename, l.pos)
	}
	if prog.NumLoads() > 0 {
		_, pos := prog.Load(0)
		return nil, &ScriptError{Pos: pos.String(), Msg: "load is not allowed: an experiment script must be self-contained"}
	}

	var overSteps bool
	thread := &starlark.Thread{
		Name: "expt:" + filename,
		Print: func(t *starlark.Thread, msg string) {
			plan.Prints = append(plan.Prints, l.pos.locate(l.pos.callPos(t), nil).String()+": "+msg)
		},
		Load: func(*starlark.Thread, string) (starlark.StringDict, error) {
			return nil, errors.New("load is not allowed") // unreachable: refused above
		},
		OnMaxSteps: func(t *starlark.Thread) {
			overSteps = true
			t.Cancel("too many steps")
		},
	}
	thread.SetMaxExecutionSteps(MaxSteps)
	stop := context.AfterFunc(ctx, func() { thread.Cancel(ctx.Err().Error()) })
	defer stop()
	limit, err := maxMemory()
	if err != nil {
		return nil, err
	}
	mem := watchMemory(thread, limit)
	_, err = prog.Init(thread, predeclared)
	mem.Stop()
	if err != nil {
		se := asScriptError(err, filename, l.pos)
		switch {
		case overSteps:
			se.Msg = fmt.Sprintf("script ran for more than %d steps (an endless loop?)", MaxSteps)
		case mem.Exceeded():
			se.Msg = mem.message()
		case ctx.Err() != nil:
			se.Msg = "evaluation cancelled: " + ctx.Err().Error()
			se.err = ctx.Err()
		}
		se.Prints = plan.Prints
		return nil, se
	}
	if len(plan.Experiments) == 0 {
		return nil, &ScriptError{Pos: filename + ":1:1", Msg: "the script declares no experiment (call experiment(name=..., methods=[...]))",
			Prints: plan.Prints}
	}
	return plan, nil
}

// loader is the state of one script evaluation, shared by the built-ins.
type loader struct {
	schema *Schema
	pos    *positions
	plan   *Plan
	names  map[string]string // experiment name -> position of its declaration
	jobs   int               // jobs expanded so far, for MaxJobs
}

func (l *loader) builtins() starlark.StringDict {
	return starlark.StringDict{
		"workload":   starlark.NewBuiltin("workload", l.workload),
		"experiment": starlark.NewBuiltin("experiment", l.experiment),
		"grid":       starlark.NewBuiltin("grid", l.grid),
		"product":    starlark.NewBuiltin("product", l.product),
	}
}
