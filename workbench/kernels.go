package main

import (
	"bytes"
	"encoding/json"
	"fmt"
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
		arch   enumFlag
		cases  []string
		asJSON bool
	)
	arch = enumFlag{value: "sm_90", allowed: []string{"sm_80", "sm_90"}}
	cmd := &cobra.Command{
		Use:   "report",
		Short: "Compile every registered kernel for a GPU target, without a GPU, and show its resources",
		Long: `report compiles each registered op's Triton kernels (the compile cases in
kernels_py/ops/<op>/cases.py, with the specializations their launchers use
and every autotune config) for sm_80 or sm_90 with Triton's own ptxas, on
any machine, and prints one row per compiled kernel and config: registers
per thread, bytes spilled (ptxas -v), shared memory, and the tensor-core
instructions its dots lowered to (mma.sync; wgmma on sm_90). All cases take
about a minute per target; --case picks some. --json adds each kernel's
stack frame (spills, or libdevice's sin/cos table) and compile errors.

Then tables model one decode step on an H100 against FlashAttention over
the full cache: the two AttentionPack kernels (bytes, FLOPs and the roofline
time they set: kernels_py/ops/lowrank_decode/model.py) and the quantized
4/2-bit kernel (bytes, tensor-core FLOPs and in-register dequantization:
kernels_py/ops/quant_decode/model.py) and the selected-row kernel
(kernels_py/ops/gather_decode/model.py); measured times come from
"workbench bench lowrank", "bench quant" and "bench gather".`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			kernels, rt, err := a.resolveRuntime(ctx)
			if err != nil {
				return err
			}
			args := []string{"-m", "kernels_py.ops.report", "--target", strings.TrimPrefix(arch.value, "sm_")}
			for _, c := range cases {
				args = append(args, "--case", c)
			}
			c := exec.CommandContext(ctx, rt.Python, args...)
			// Compiling for a GPU target needs the code generator, which
			// TRITON_INTERPRET would replace.
			c.Env = withoutEnv(worker.Environment(os.Environ(), kernels.Dir, worker.CPU), "TRITON_INTERPRET")
			var out, errOut bytes.Buffer
			c.Stdout, c.Stderr = &out, &errOut
			a.log.Info().Str("arch", arch.value).Msg("compiling the registered kernels (about a minute for all cases)")
			if err := c.Run(); err != nil {
				msg := strings.TrimSpace(errOut.String())
				if ee, ok := err.(*exec.ExitError); ok && ee.ExitCode() == 2 {
					return &usageError{fmt.Errorf("kernels report: %s", msg)}
				}
				return fmt.Errorf("kernels report: %w\n%s", err, msg)
			}
			a.stderr.Write(errOut.Bytes()) // warnings, if any
			if asJSON {
				_, err := a.stdout.Write(out.Bytes())
				return err
			}
			var res struct {
				Title string `json:"title"`
				table
				Models []struct {
					Title string `json:"title"`
					table
				} `json:"models"`
			}
			if err := json.Unmarshal(out.Bytes(), &res); err != nil {
				return fmt.Errorf("kernels report returned an unexpected result: %w", err)
			}
			fmt.Fprintln(a.stdout, res.Title)
			if err := res.table.print(a.stdout); err != nil {
				return err
			}
			for _, m := range res.Models {
				fmt.Fprintf(a.stdout, "\n%s\n", m.Title)
				if err := m.table.print(a.stdout); err != nil {
					return err
				}
			}
			return nil
		},
	}
	cmd.Flags().Var(&arch, "arch", "GPU target to compile for")
	cmd.Flags().StringArrayVar(&cases, "case", nil, "only this compile case (repeatable; default: all)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the table as JSON")
	return cmd
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
