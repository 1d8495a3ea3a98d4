package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/vlkv/vlkv/gohost/worker"
)

// selftestResult mirrors what kernels_py.selftest.run returns.
type selftestResult struct {
	Device      string `json:"device"`
	Interpreter bool   `json:"interpreter"`
	Dtype       string `json:"dtype"`
	Shape       struct {
		Heads     int `json:"heads"`
		KVHeads   int `json:"kv_heads"`
		HeadDim   int `json:"head_dim"`
		QueryRows int `json:"query_rows"`
		Keys      int `json:"keys"`
	} `json:"shape"`
	Segments []struct {
		Segment        string  `json:"segment"`
		Tokens         int     `json:"tokens"`
		KernelShare    float64 `json:"kernel_share"`
		ReferenceShare float64 `json:"reference_share"`
		MaxAbsErr      float64 `json:"max_abs_err"`
	} `json:"segments"`
	SalientTokens   []int   `json:"salient_tokens"`
	TopKernelTokens []int   `json:"top_kernel_tokens"`
	MaxAbsErr       float64 `json:"max_abs_err"`
	Tolerance       float64 `json:"tolerance"`
	OK              bool    `json:"ok"`
	KernelSeconds   float64 `json:"kernel_seconds"`
}

func newSelftestCmd(a *app) *cobra.Command {
	var (
		dtype = enumFlag{value: "float32", allowed: []string{"float32", "float16", "bfloat16"}}
		seed  int
	)
	cmd := &cobra.Command{
		Use:   "selftest",
		Short: "Run the attention-statistics Triton kernels on a synthetic VLM prompt and check them against PyTorch",
		Long: `selftest builds a small synthetic vision-language prompt (system tokens, one
image's visual tokens, then text), runs the attention-statistics Triton kernels
(kernels_py/triton/attention_stats.py, the ones every scoring method uses) over
the post-vision text queries in a worker, checks the attention each key
receives against the PyTorch reference (kernels_py/ref/attention_stats.py), and
prints the share of attention each segment receives. It exits non-zero if the
kernels and the reference disagree. On CPU the kernels run under the Triton
interpreter.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.withWorker(cmd.Context(), func(_ *session, w *worker.Worker) error {
				raw, err := w.Run(cmd.Context(), worker.Job{Fn: "kernels_py.selftest:run", Args: map[string]any{"seed": seed, "dtype": dtype.value}})
				if err != nil {
					var je *worker.JobError
					if errors.As(err, &je) {
						return fmt.Errorf("selftest job failed: %w\n%s", err, je.Traceback)
					}
					return fmt.Errorf("selftest job failed: %w", err)
				}
				var r selftestResult
				if err := json.Unmarshal(raw, &r); err != nil {
					return fmt.Errorf("selftest job returned an unexpected result: %w", err)
				}
				printSelftest(a, r)
				if !r.OK {
					return fmt.Errorf("kernel disagrees with the reference: max abs error %.3g > tolerance %.3g", r.MaxAbsErr, r.Tolerance)
				}
				return nil
			})
		},
	}
	cmd.Flags().Var(&dtype, "dtype", "dtype of Q and K")
	cmd.Flags().IntVar(&seed, "seed", 0, "seed of the synthetic prompt")
	return cmd
}

func printSelftest(a *app, r selftestResult) {
	mode := r.Device
	if r.Interpreter {
		mode += ", Triton interpreter"
	}
	fmt.Fprintf(a.stdout, "attention mass of %d post-vision text queries over %d keys (%d heads, %d kv heads, head_dim %d, %s, %s)\n\n",
		r.Shape.QueryRows, r.Shape.Keys, r.Shape.Heads, r.Shape.KVHeads, r.Shape.HeadDim, r.Dtype, mode)
	tw := tabwriter.NewWriter(a.stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "segment\ttokens\tkernel share\treference share\tmax abs err\t")
	for _, s := range r.Segments {
		fmt.Fprintf(tw, "%s\t%d\t%.4f\t%.4f\t%.2e\t\n", s.Segment, s.Tokens, s.KernelShare, s.ReferenceShare, s.MaxAbsErr)
	}
	tw.Flush()
	fmt.Fprintf(a.stdout, "\nsalient visual tokens %v, kernel's top tokens %v\n", r.SalientTokens, r.TopKernelTokens)
	verdict := "OK"
	if !r.OK {
		verdict = "MISMATCH"
	}
	fmt.Fprintf(a.stdout, "kernel vs reference: max abs error %.2e (tolerance %.0e) %s; kernel took %.3fs\n",
		r.MaxAbsErr, r.Tolerance, verdict, r.KernelSeconds)
}
