package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"

	"github.com/spf13/cobra"

	"github.com/vlkv/vlkv/gohost/worker"
)

func newKernelsCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "kernels",
		Short: "Inspect what the Triton kernels compile to",
	}
	cmd.AddCommand(newKernelsReportCmd(a))
	return cmd
}

func newKernelsReportCmd(a *app) *cobra.Command {
	var (
		arch     enumFlag
		cases    []string
		asJSON   bool
		estimate bool
		shape    string
		ops      []string
		impls    []string
		configs  []string
	)
	arch = enumFlag{value: "sm_90", allowed: []string{"sm_80", "sm_90"}}
	cmd := &cobra.Command{
		Use:   "report",
		Short: "Compile every registered kernel for a GPU target, without a GPU; show its resources, or estimate its time",
		Long: `report compiles each registered op's Triton kernels (the compile cases in
kernels_py/ops/<op>/cases.py, with the specializations their launchers use
and every autotune config) for sm_80 or sm_90 with Triton's own ptxas, on
any machine, and prints one row per compiled kernel and config: registers
per thread, bytes spilled (ptxas -v), shared memory, and the tensor-core
instructions its dots lowered to (mma.sync; wgmma on sm_90). All cases
take about two minutes per target on 2 cores; --case picks some, --op an op's. A kernel
config that does not compile is printed with its file:line, the compiler's
message and the line, and the command exits 1. --json adds each kernel's
stack frame (spills, or libdevice's sin/cos table) and the errors. Then,
for each op shown, the ideal: the bytes and FLOPs one decode step must move
and the time they take at the H100's peaks (kernels_py/ops/<op>/model.py).
The peaks are not reached: the ideal is a bound, never a prediction.

--estimate compiles every config the autotuner may choose at each op's
benchmark shapes (fp16, 32 query / 8 kv heads, head_dim 128, batch 8 and
64; --shape replaces fields, e.g. --shape batch=16,visual=8192, or
--shape partial=keys,low_share=0.75 for lowrank_decode's partial
decompression on keys) and estimates each implementation from what its SASS issues: the loops found in
the machine code and their trips from the op's model, every instruction
classified (tensor-core, FP, MUFU, conversions, global loads by width and
kind, cp.async, shared memory, barriers, integer, uniform), a warp's timeline
replaying the stall cycles and scoreboard waits ptxas encoded (a load waits
the latency of the memory level its argument lives in), occupancy and waves.
It prints per implementation an optimistic time (co-resident programs hide
each other's waits fully) and a conservative one (they overlap only their
waits on memory), the bound that sets each (memory, tensor, issue,
load/store, special functions or latency), % of the HBM peak, the speedup over FlashAttention
over the uncompressed cache, and what limits each kernel in words. HBM is
read at the share of its peak streaming kernels sustained when measured on
an H100: 89% at the optimistic end and for FlashAttention, 68% at the
conservative end. Then every config at the shape (configs that spill are
pruned, as the autotuner prunes them), instructions per token by class,
and the calibration (sm_90): kernels measured on an H100 (those of the ops
shown) and their estimated band, for the configs the autotuner chose where
they were recorded; a point whose kernels now compile to other code than it
measured is marked stale and holds for none of today's band.
Judge kernel work on the conservative end. What it cannot see: cache hit
rates beyond what the op's model states, DRAM page effects, bank conflicts,
clock throttling. About five minutes on a 2-core CPU; --op picks ops.

The quick loop while editing one kernel: --impl NAME keeps one
implementation (the names of the implementation column, e.g. --impl 'fused
(exact)') and --config KERNEL:CONFIG compiles only that config of an
autotuned kernel (as the config column prints it, e.g. --config
'_stage1_kernel:BLOCK_N=128 w8 s3'), so it is the pick; both repeatable.
Either leaves the calibration out. One implementation at one config takes
seconds, e.g.

  workbench kernels report --estimate --op lowrank_decode --shape batch=8 \
    --impl 'fused (exact)' --config '_stage1_kernel:BLOCK_N=128 w8 s3'`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			if !estimate && (shape != "" || len(impls) > 0 || len(configs) > 0) {
				return &usageError{fmt.Errorf("--shape, --impl and --config go with --estimate")}
			}
			if estimate && len(cases) > 0 {
				return &usageError{fmt.Errorf("--case picks compile cases of the resource table; --estimate takes --op")}
			}
			if err := a.checkOps(ops); err != nil {
				return err
			}
			kernels, rt, err := a.resolveRuntime(ctx)
			if err != nil {
				return err
			}
			args := []string{safePath, "-m", "kernels_py.ops.report", "--target", strings.TrimPrefix(arch.value, "sm_")}
			for _, c := range cases {
				args = append(args, "--case", c)
			}
			for _, o := range ops {
				args = append(args, "--op", o)
			}
			if estimate {
				args = append(args, "--estimate", "--shape", shape)
				for _, i := range impls {
					args = append(args, "--impl", i)
				}
				for _, c := range configs {
					args = append(args, "--config", c)
				}
			}
			c := exec.CommandContext(ctx, rt.Python, args...)
			// Compiling for a GPU target needs the code generator, which
			// TRITON_INTERPRET would replace.
			c.Env = withoutEnv(worker.Environment(os.Environ(), kernels.Dir, worker.CPU), "TRITON_INTERPRET")
			var out, errOut bytes.Buffer
			c.Stdout, c.Stderr = &out, &errOut
			what := "compiling the registered kernels (about two minutes on 2 cores for all cases)"
			if estimate {
				what = "compiling every config at the benchmark shapes and estimating (a few minutes)"
				if len(impls) > 0 || len(configs) > 0 {
					what = "compiling the chosen implementations and configs at the benchmark shapes and estimating"
				}
			}
			a.log.Info().Str("arch", arch.value).Msg(what)
			if err := c.Run(); err != nil {
				if ctx.Err() != nil { // Ctrl-C: the compiler was stopped, not broken
					return errors.New("kernels report: interrupted")
				}
				if je := reportFailed(out.Bytes()); je != nil {
					return a.jobFailed("kernels report", je)
				}
				if ue := noUsableConfig(out.Bytes()); ue != nil {
					return ue
				}
				msg := strings.TrimSpace(errOut.String())
				if ee, ok := err.(*exec.ExitError); ok && msg != "" {
					if ee.ExitCode() == 2 {
						return &usageError{fmt.Errorf("kernels report: %s", msg)}
					}
					return fmt.Errorf("kernels report: %s", msg) // the report's own message says it all
				}
				return fmt.Errorf("kernels report: %w\n%s", err, msg)
			}
			a.stderr.Write(errOut.Bytes()) // warnings, if any
			if estimate {
				if asJSON {
					_, err := a.stdout.Write(out.Bytes())
					return err
				}
				return printEstimate(a, out.Bytes())
			}
			var res struct {
				Title string `json:"title"`
				table
				Errors []compileError `json:"errors"`
				Models []struct {
					Title string `json:"title"`
					table
				} `json:"models"`
			}
			if err := json.Unmarshal(out.Bytes(), &res); err != nil {
				return fmt.Errorf("kernels report returned an unexpected result: %w", err)
			}
			if asJSON {
				if _, err := a.stdout.Write(out.Bytes()); err != nil {
					return err
				}
			} else {
				fmt.Fprintln(a.stdout, res.Title)
				if err := res.table.print(a.stdout); err != nil {
					return err
				}
				fmt.Fprintf(a.stdout, "\n%s", res.table.legend())
				for _, m := range res.Models {
					fmt.Fprintf(a.stdout, "\n%s\n", m.Title)
					if err := m.table.print(a.stdout); err != nil {
						return err
					}
				}
			}
			return compileErrors(a.stderr, res.Errors)
		},
	}
	cmd.Flags().Var(&arch, "arch", "GPU target to compile for")
	cmd.Flags().StringSliceVar(&cases, "case", nil, "only these compile cases (comma-separated or repeated; default: all)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the report as JSON")
	cmd.Flags().BoolVar(&estimate, "estimate", false,
		"estimate each op's implementations at its benchmark shapes from what their compiled code issues")
	cmd.Flags().StringVar(&shape, "shape", "", "with --estimate: fields of the ops' shapes, KEY=VALUE,... (e.g. batch=16,visual=8192 or partial=keys)")
	cmd.Flags().StringSliceVar(&ops, "op", nil, "only these ops: their compile cases, or with --estimate their estimates (comma-separated or repeated; default: every op, with --estimate every op with a model)")
	cmd.Flags().StringArrayVar(&impls, "impl", nil, "with --estimate: only this implementation, by its name in the implementation column (repeatable; no calibration)")
	cmd.Flags().StringArrayVar(&configs, "config", nil, "with --estimate: KERNEL:CONFIG, only this config of an autotuned kernel, as the config column prints it (repeatable; no calibration)")
	return cmd
}

// compileError is one kernel config (or one case's launcher) that did not
// compile: where in kernels_py and why.
type compileError struct {
	Case   string `json:"case"`
	Kernel string `json:"kernel"`
	Config string `json:"config"`
	worker.SourceLine
}

// what names the config (or the case's launcher) that failed.
func (e compileError) what() string {
	what := e.Case
	if e.Kernel != "" {
		what += " " + e.Kernel
	}
	if e.Config != "" {
		what += " (" + e.Config + ")"
	}
	return what
}

// compileErrors prints each compile error at its file:line and makes them
// the command's error: a kernel that does not compile must not pass for a
// row of empty columns.
func compileErrors(w io.Writer, errs []compileError) error {
	if len(errs) == 0 {
		return nil
	}
	for _, e := range errs {
		fmt.Fprintln(w, e.Describe(e.what()+" failed to compile"))
	}
	return fmt.Errorf("kernels report: %s (above)", plural(len(errs), "compile error"))
}

// reportFailed is the report's error raised from a kernels_py line (a
// kernel source that does not import, say), to be shown at that line as a
// job's is; nil for any other output.
func reportFailed(raw []byte) *worker.JobError {
	var res struct {
		Failed *worker.JobError `json:"failed"`
	}
	if json.Unmarshal(raw, &res) != nil || res.Failed == nil || res.Failed.At == nil || res.Failed.At.File == "" {
		return nil
	}
	return res.Failed
}

// noUsableConfig is the estimate's error where every config of a kernel
// spilled or failed to compile: the report's message, and the first
// failure at its line as a compile error's.
func noUsableConfig(raw []byte) error {
	var res struct {
		Error string        `json:"error"`
		At    *compileError `json:"at"`
	}
	if json.Unmarshal(raw, &res) != nil || res.Error == "" {
		return nil
	}
	if res.At == nil {
		return fmt.Errorf("kernels report: %s", res.Error)
	}
	return fmt.Errorf("kernels report: %s\n%s", res.Error, res.At.Describe(res.At.what()+" failed to compile"))
}

// printEstimate prints the tables of kernels report --estimate, each with
// its title and the notes that say what limits a kernel.
func printEstimate(a *app, raw []byte) error {
	var res struct {
		Title  string `json:"title"`
		Tables []struct {
			Title string   `json:"title"`
			Notes []string `json:"notes"`
			table
		} `json:"tables"`
	}
	if err := json.Unmarshal(raw, &res); err != nil {
		return fmt.Errorf("kernels report --estimate returned an unexpected result: %w", err)
	}
	fmt.Fprintln(a.stdout, res.Title)
	for _, t := range res.Tables {
		fmt.Fprintf(a.stdout, "\n%s\n", t.Title)
		if err := t.table.print(a.stdout); err != nil {
			return err
		}
		for _, n := range t.Notes {
			fmt.Fprintf(a.stdout, "  - %s\n", n)
		}
	}
	return nil
}

// withoutEnv drops key from an environment list.
func withoutEnv(env []string, key string) []string {
	out := env[:0:0]
	for _, kv := range env {
		if !strings.HasPrefix(kv, key+"=") {
			out = append(out, kv)
		}
	}
	return out
}
