// Command workbench drives Triton kernels and KV-cache compression experiments
// for vision-language models. It resolves a Python runtime, starts kernel
// workers and collects their results; see the README.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"

	"github.com/rs/zerolog"
)

func main() {
	// Without this, a write to a closed stdout (workbench run ... | head)
	// kills the process with SIGPIPE, mid-run and without a word; with it,
	// the write fails with EPIPE and closedPipeWriter drops the rest.
	signal.Notify(make(chan os.Signal, 1), syscall.SIGPIPE)
	stdout := &closedPipeWriter{w: os.Stdout, notice: os.Stderr}
	os.Exit(run(os.Args[1:], stdout, os.Stderr))
}

// closedPipeWriter passes writes on until the reader goes away (EPIPE); it
// then drops what follows, so the command still finishes its work (a run
// keeps journaling its jobs), and, for commands that work on after their
// output stops mattering (announce), says so once.
type closedPipeWriter struct {
	w        io.Writer
	notice   io.Writer
	announce atomic.Bool
	closed   atomic.Bool
}

func (c *closedPipeWriter) Write(p []byte) (int, error) {
	if c.closed.Load() {
		return len(p), nil
	}
	n, err := c.w.Write(p)
	if errors.Is(err, syscall.EPIPE) {
		if !c.closed.Swap(true) && c.announce.Load() {
			fmt.Fprintln(c.notice, "workbench: stdout was closed (broken pipe); its output is dropped from here, the command goes on")
		}
		return len(p), nil
	}
	return n, err
}

// run executes the CLI and returns the process exit code: 0 success, 1 a
// failed command, 2 bad usage, 130 (143) a command that SIGINT (SIGTERM)
// stopped short.
func run(args []string, stdout, stderr io.Writer) int {
	stdout, stderr = serialized(stdout), serialized(stderr)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	signals := make(chan os.Signal, 2)
	signal.Notify(signals, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(signals)
	caught := onSignals(signals, cancel, stderr, os.Exit)
	root := newRootCmd(stdout, stderr, args)
	root.SetArgs(args)
	cmd, err := root.ExecuteContextC(ctx)
	if err == nil {
		return 0 // watch ends so on Ctrl-C
	}
	var ce *exitCodeError
	if errors.As(err, &ce) {
		return ce.code
	}
	var ue *usageError
	if errors.As(err, &ue) || isCobraUsageError(err) {
		fmt.Fprintf(stderr, "workbench: %v\n\n%s", err, cmd.UsageString())
		return 2
	}
	fmt.Fprintf(stderr, "workbench: %v\n", err)
	if sig := caught(); sig != nil { // stopped by a signal: 128 + its number, as shells report it
		return signalExitCode(sig)
	}
	return 1
}

// onSignals serves SIGINT and SIGTERM: the first cancels the command's
// context, so it stops its workers and says what it kept; a second, while it
// is still stopping (a busy worker is given seconds to exit, a Slurm prompt
// waits for an answer), ends the process at once, through exit. Finished
// jobs are already journaled, and the workers die with the process
// (Pdeathsig), so nothing kept is lost. It returns the first signal caught,
// nil while there is none.
func onSignals(signals <-chan os.Signal, cancel func(), stderr io.Writer, exit func(int)) (first func() os.Signal) {
	var caught atomic.Value
	go func() {
		sig, ok := <-signals
		if !ok {
			return
		}
		caught.Store(&sig)
		cancel()
		again, ok := <-signals
		if !ok {
			return
		}
		fmt.Fprintf(stderr, "\nworkbench: %v again: exiting now, without waiting for workers to stop "+
			"(finished jobs are kept; a submitted Slurm array keeps running)\n", again)
		exit(signalExitCode(again))
	}()
	return func() os.Signal {
		if p, ok := caught.Load().(*os.Signal); ok {
			return *p
		}
		return nil
	}
}

// signalExitCode is 128 + the signal's number, as shells report a process a
// signal stopped.
func signalExitCode(sig os.Signal) int {
	if n, ok := sig.(syscall.Signal); ok {
		return 128 + int(n)
	}
	return 1
}

// serialized makes w safe for the goroutines that write to it at once (the
// logger, a worker's relayed output, progress lines): a file already is, and
// so is main's closedPipeWriter over one (which the root command looks for by
// type); a buffer (a test's, an embedding program's) is not.
func serialized(w io.Writer) io.Writer {
	switch w.(type) {
	case *os.File, *closedPipeWriter:
		return w
	}
	return zerolog.SyncWriter(w)
}

// isStdout reports whether w writes to this process's stdout, as main passes
// it (in a closedPipeWriter).
func isStdout(w io.Writer) bool {
	if c, ok := w.(*closedPipeWriter); ok {
		w = c.w
	}
	return w == os.Stdout
}
