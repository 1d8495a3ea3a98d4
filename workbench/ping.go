package main

import (
	"fmt"
	"os"
	"os/exec"
	"sort"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/vlkv/vlkv/gohost/worker"
)

func newPingCmd(a *app) *cobra.Command {
	var count int
	cmd := &cobra.Command{
		Use:   "worker-ping",
		Short: "Start a worker and time its start-up and message round trips",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if count < 1 {
				return &usageError{fmt.Errorf("--count must be at least 1, got %d", count)}
			}
			ctx := cmd.Context()
			s, err := a.newSession(ctx)
			if err != nil {
				return err
			}
			start := time.Now()
			w, err := a.startWorker(ctx, s)
			if err != nil {
				return err
			}
			defer w.Close()
			startup := time.Since(start)
			rtts := make([]time.Duration, count)
			for i := range rtts {
				t0 := time.Now()
				if _, err := w.Run(ctx, worker.Job{Fn: "kernels_py.runtime.diag:echo", Args: map[string]any{"i": i}}); err != nil {
					return fmt.Errorf("ping %d: %w", i, err)
				}
				rtts[i] = time.Since(t0)
			}
			sort.Slice(rtts, func(i, j int) bool { return rtts[i] < rtts[j] })
			h := w.Hello()
			fmt.Fprintf(a.stdout, "worker pid %d (python %s, device %s) started in %v\n", h.Pid, h.Python.Version, h.Device.Kind, startup.Round(time.Millisecond))
			fmt.Fprintf(a.stdout, "%d round trips: min %v  median %v  max %v\n", count, rtts[0], rtts[count/2], rtts[count-1])
			return nil
		},
	}
	cmd.Flags().IntVarP(&count, "count", "n", 20, "number of round trips")
	return cmd
}

func newPythonCmd(a *app) *cobra.Command {
	var workloads []string
	cmd := &cobra.Command{
		Use:   "python [-- ARGS...]",
		Short: "Run the resolved Python with the workers' environment (e.g. workbench python -- -m pytest)",
		Long: `python runs the interpreter workers use, with kernels_py on PYTHONPATH and the
device settings workers get (VLKV_DEVICE, and TRITON_INTERPRET=1 on CPU).
Put its arguments after --, e.g.:

  workbench python -- -m pytest -q
  workbench python -- -c 'import torch; print(torch.__version__)'

--workload lmms first installs what that workload needs beyond the runtime
(lmms-eval, the lock's lmms group; once), as the first run using it would:

  workbench python --workload lmms -- -m pytest -q kernels_py/tests/test_lmms.py`,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			for _, name := range workloads {
				if _, ok := workloadGroups[name]; !ok {
					return &usageError{fmt.Errorf("--workload %q: only %s install dependencies beyond the runtime",
						name, strings.Join(sortedGroupWorkloads(), ", "))}
				}
			}
			s, err := a.newSession(ctx)
			if err != nil {
				return err
			}
			if err := a.ensureWorkloadGroups(ctx, s, workloads); err != nil {
				return err
			}
			c := exec.CommandContext(ctx, s.runtime.Python, args...)
			c.Env = worker.Environment(os.Environ(), s.kernels.Dir, s.device)
			c.Stdin, c.Stdout, c.Stderr = os.Stdin, a.stdout, a.stderr
			if err := c.Run(); err != nil {
				if ee, ok := err.(*exec.ExitError); ok {
					return &exitCodeError{code: ee.ExitCode()}
				}
				return err
			}
			return nil
		},
	}
	cmd.Flags().StringSliceVar(&workloads, "workload", nil, "install what these workloads need first (lmms)")
	return cmd
}

// exitCodeError passes a child's exit code through as the workbench's own.
type exitCodeError struct{ code int }

func (e *exitCodeError) Error() string { return fmt.Sprintf("python exited with status %d", e.code) }
