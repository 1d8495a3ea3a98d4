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
	"syscall"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run executes the CLI and returns the process exit code: 0 success, 1 a
// failed command, 2 bad usage.
func run(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	root := newRootCmd(stdout, stderr, args)
	root.SetArgs(args)
	cmd, err := root.ExecuteContextC(ctx)
	if err == nil {
		return 0
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
	return 1
}
