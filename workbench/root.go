package main

import (
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"time"

	"github.com/rs/zerolog"
	"github.com/spf13/cobra"

	"github.com/vlkv/vlkv/gohost/sched"
	"github.com/vlkv/vlkv/gohost/worker"
)

// version is set at release time with -ldflags "-X main.version=...".
var version = "0.1.0-dev"

// usageError marks errors in how the command was called (exit code 2).
type usageError struct{ err error }

func (e *usageError) Error() string { return e.err.Error() }
func (e *usageError) Unwrap() error { return e.err }

// isCobraUsageError recognises cobra's own argument and command errors, which
// it returns as plain errors.
func isCobraUsageError(err error) bool {
	msg := err.Error()
	for _, p := range []string{"unknown command", "unknown flag", "unknown shorthand flag", "accepts ", "requires at least", "requires at most", "invalid argument", "flag needs an argument"} {
		if strings.Contains(msg, p) {
			return true
		}
	}
	return false
}

// globalFlags are the flags every command shares.
type globalFlags struct {
	python    string
	kernels   string
	device    deviceFlag
	logFormat enumFlag
	verbose   bool
	// startTimeout bounds each worker's start (its hello).
	startTimeout time.Duration
}

type app struct {
	// prog is how messages name this program in commands to run.
	prog   string
	flags  globalFlags
	stdout io.Writer
	stderr io.Writer
	// console is stderr for log lines and progress bars: on a terminal a
	// *sched.Terminal, so a log line never lands on a bar's line.
	console io.Writer
	log     zerolog.Logger
	// cancelArray is asked, on Ctrl-C while a Slurm array is followed,
	// whether to cancel it (true) or leave it running.
	cancelArray func(arrayJob string) bool
}

// newRootCmd builds the command tree for the command line args (the
// benchmarks `bench` offers depend on the kernels root they name).
func newRootCmd(stdout, stderr io.Writer, args []string) *cobra.Command {
	a := &app{prog: progName(os.Args[0]), stdout: stdout, stderr: stderr, console: stderr}
	if sched.IsTerminal(stderr) {
		a.console = sched.NewTerminal(stderr)
	}
	a.cancelArray = a.askCancel
	a.flags.device = deviceFlag{value: worker.Auto}
	a.flags.logFormat = enumFlag{value: "auto", allowed: []string{"auto", "console", "json"}}

	root := &cobra.Command{
		Use:   "workbench",
		Short: "Run and benchmark KV-cache compression kernels for vision-language models",
		Long: `workbench runs Triton kernels and KV-cache compression methods for
vision-language models in long-lived Python workers, and collects the results.

Python comes from --python (or WORKBENCH_PYTHON); otherwise workbench uses its
managed runtime: the CPython embedded in this binary plus a virtual environment
with the locked dependencies (torch, triton, numpy, safetensors), built in the
user cache dir on first use. Kernel code comes from --kernels, else from the
checkout the command runs in, else from the copy embedded in this binary.`,
		Version:       fmt.Sprintf("%s (%s, %s/%s)", version, runtime.Version(), runtime.GOOS, runtime.GOARCH),
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(cmd *cobra.Command, args []string) error {
			a.log = newLogger(a.console, a.flags.logFormat.value, a.flags.verbose)
			if a.flags.startTimeout <= 0 {
				return &usageError{fmt.Errorf("--start-timeout %v: want a positive duration, e.g. 1m or 5m", a.flags.startTimeout)}
			}
			if c, ok := a.stdout.(*closedPipeWriter); ok && (cmd.Name() == "run" || cmd.Name() == "demo") {
				c.announce.Store(true) // `plan | head` is normal; a run cut from its reader goes on, and says so
			}
			return nil
		},
	}
	root.SetOut(stdout)
	root.SetErr(stderr)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return &usageError{err} })
	root.SetVersionTemplate("workbench {{.Version}}\n")

	pf := root.PersistentFlags()
	pf.StringVar(&a.flags.python, "python", "", "Python interpreter to run workers (default: $WORKBENCH_PYTHON, else the managed runtime)")
	pf.StringVar(&a.flags.kernels, "kernels", "", "directory holding kernels_py/ (default: the current checkout, else the embedded copy)")
	pf.Var(&a.flags.device, "device", "where kernels run: cpu (Triton interpreter), cuda, or auto")
	pf.Var(&a.flags.logFormat, "log-format", "log format: auto (colored on a terminal), console or json")
	pf.BoolVarP(&a.flags.verbose, "verbose", "v", false, "debug logging, including what workers print")
	pf.DurationVar(&a.flags.startTimeout, "start-timeout", worker.DefaultStartTimeout,
		"how long a worker may take to start (import torch, triton and kernels_py) before it counts as failed; raise it on a slow or cold disk")

	var benchmarks benchmarkList
	if slices.Contains(args, "bench") { // the only command that needs the schema to exist at all
		benchmarks = benchmarksFor(args)
	}
	root.AddCommand(newEnvCmd(a), newDemoCmd(a), newSelftestCmd(a), newPingCmd(a), newPythonCmd(a), newBenchCmd(a, benchmarks),
		newTensorsCmd(a), newPlanCmd(a), newRunCmd(a), newMethodsCmd(a), newSchemaCmd(a), newKernelsCmd(a),
		newTraceCmd(a), newShardCmd(a), newStatusCmd(a), newCompareCmd(a), newWatchCmd(a), newNotebookCmd(a), newLabCmd(a))
	return root
}

// progName is how to run this binary again from here: as it was started,
// unless that was a build's temporary file (go run, go test).
func progName(arg0 string) string {
	if arg0 == "" || strings.Contains(arg0, "go-build") {
		return "workbench"
	}
	return arg0
}

func newLogger(w io.Writer, format string, verbose bool) zerolog.Logger {
	level := zerolog.InfoLevel
	if verbose {
		level = zerolog.DebugLevel
	}
	var out io.Writer = w
	if format != "json" {
		out = zerolog.ConsoleWriter{Out: w, NoColor: !sched.IsTerminal(w), TimeFormat: time.TimeOnly}
	}
	return zerolog.New(out).Level(level).With().Timestamp().Logger()
}

// buildInfo reports the module version control revision when the binary has one.
func buildRevision() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return ""
	}
	for _, s := range info.Settings {
		if s.Key == "vcs.revision" {
			return s.Value
		}
	}
	return ""
}

// deviceFlag is a pflag.Value accepting cpu, cuda or auto.
type deviceFlag struct{ value worker.Device }

func (d *deviceFlag) String() string { return string(d.value) }
func (d *deviceFlag) Type() string   { return "cpu|cuda|auto" }
func (d *deviceFlag) Set(s string) error {
	v, err := worker.ParseDevice(s)
	if err != nil {
		return err
	}
	d.value = v
	return nil
}

// distinct is names in their first order, each once: a list flag or the
// arguments naming something twice (--op a,a) mean it once.
func distinct(names []string) []string {
	seen := make(map[string]bool, len(names))
	var out []string
	for _, n := range names {
		if !seen[n] {
			seen[n] = true
			out = append(out, n)
		}
	}
	return out
}

// enumFlag is a pflag.Value accepting one of a fixed set of words.
type enumFlag struct {
	value   string
	allowed []string
}

func (e *enumFlag) String() string { return e.value }
func (e *enumFlag) Type() string   { return strings.Join(e.allowed, "|") }
func (e *enumFlag) Set(s string) error {
	for _, a := range e.allowed {
		if s == a {
			e.value = s
			return nil
		}
	}
	return fmt.Errorf("must be one of %s", strings.Join(e.allowed, ", "))
}
