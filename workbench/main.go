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
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	caught := make(chan os.Signal, 1) // which signal, for the exit code
	signal.Notify(caught, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(caught)
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
	select {
	case sig := <-caught: // stopped by a signal: 128 + its number, as shells report it
		if n, ok := sig.(syscall.Signal); ok {
			return 128 + int(n)
		}
	default:
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
