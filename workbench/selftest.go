package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"github.com/vlkv/vlkv/gohost/expt"
	"github.com/vlkv/vlkv/gohost/worker"
)

// selftestResult is what kernels_py.selftest.run returns: one self-describing
// table per op (kernels_py/ops/<op>/cases.py).
type selftestResult struct {
	Device      string `json:"device"`
	Interpreter bool   `json:"interpreter"`
	Ops         []struct {
		table
		Op            string   `json:"op"`
		Title         string   `json:"title"`
		Notes         []string `json:"notes"`
		Verdict       string   `json:"verdict"`
		OK            bool     `json:"ok"`
		KernelSeconds float64  `json:"kernel_seconds"`
	} `json:"ops"`
}

func newSelftestCmd(a *app) *cobra.Command {
	var (
		dtype = enumFlag{value: "float32", allowed: []string{"float32", "float16", "bfloat16"}}
		seed  int
		ops   []string
	)
	cmd := &cobra.Command{
		Use:   "selftest",
		Short: "Run every op's Triton kernels on a small VLM-shaped input and check them against their PyTorch references",
		Long: `selftest runs, in a worker, the selftest of every registered op
(kernels_py/ops/<op>/cases.py; --op picks some): its Triton kernels on a small
synthetic vision-language input, checked against the op's PyTorch reference.
For the attention statistics (the kernels every scoring method uses) that is
the post-vision text queries of a prompt [system | image | text], with the
share of attention each segment receives; for the low-rank decode, one decode
step over an AttentionPack cache with every kernel variant. It exits non-zero
if a kernel and its reference disagree. On CPU the kernels run under the
Triton interpreter.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ops = distinct(ops)
			if err := a.checkOps(ops); err != nil {
				return err
			}
			return a.withWorker(cmd.Context(), func(_ *session, w *worker.Worker) error {
				args := map[string]any{"seed": seed, "dtype": dtype.value}
				if len(ops) > 0 {
					args["ops"] = ops
				}
				raw, err := w.Run(cmd.Context(), worker.Job{Fn: "kernels_py.selftest:run", Args: args})
				if err != nil {
					if cmd.Context().Err() != nil { // Ctrl-C: the worker was stopped, not broken
						return errors.New("selftest: interrupted")
					}
					return a.jobFailed("selftest job", err)
				}
				var r selftestResult
				if err := json.Unmarshal(raw, &r); err != nil {
					return fmt.Errorf("selftest job returned an unexpected result: %w", err)
				}
				printSelftest(a, r)
				var bad []string
				for _, op := range r.Ops {
					if !op.OK {
						bad = append(bad, op.Op)
					}
				}
				if len(bad) > 0 {
					return fmt.Errorf("kernel disagrees with the reference: %s", strings.Join(bad, ", "))
				}
				return nil
			})
		},
	}
	cmd.Flags().Var(&dtype, "dtype", "dtype of the inputs")
	cmd.Flags().IntVar(&seed, "seed", 0, "seed of the synthetic inputs")
	cmd.Flags().StringSliceVar(&ops, "op", nil, "only these ops (default: every registered op)")
	return cmd
}

func printSelftest(a *app, r selftestResult) {
	mode := r.Device
	if r.Interpreter {
		mode += ", Triton interpreter"
	}
	for i, op := range r.Ops {
		if i > 0 {
			fmt.Fprintln(a.stdout)
		}
		fmt.Fprintf(a.stdout, "%s: %s (%s)\n\n", op.Op, op.Title, mode)
		op.table.print(a.stdout)
		fmt.Fprintln(a.stdout)
		for _, n := range op.Notes {
			fmt.Fprintln(a.stdout, n)
		}
		verdict := "OK"
		if !op.OK {
			verdict = "MISMATCH"
		}
		fmt.Fprintf(a.stdout, "kernel vs reference: %s %s; kernel took %.3fs\n", op.Verdict, verdict, op.KernelSeconds)
	}
}

// checkOps refuses op names the schema does not know, before any Python starts.
func (a *app) checkOps(ops []string) error {
	if len(ops) == 0 {
		return nil
	}
	s, kernels, err := a.schema()
	if err != nil {
		return err
	}
	names := s.OpNames()
	for _, op := range ops {
		if _, ok := s.Ops[op]; !ok {
			return &usageError{fmt.Errorf("--op: %s%s", expt.UnknownName(op, names), unknownHint(kernels, "op", op))}
		}
	}
	return nil
}
