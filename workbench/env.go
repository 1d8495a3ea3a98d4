package main

import (
	"encoding/json"
	"fmt"
	"runtime"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/vlkv/vlkv/gohost/pyrt"
	"github.com/vlkv/vlkv/gohost/worker"
)

// envReport is the stable JSON of `workbench env --json`.
type envReport struct {
	Workbench struct {
		Version  string `json:"version"`
		Revision string `json:"revision,omitempty"`
	} `json:"workbench"`
	Go struct {
		Version string `json:"version"`
	} `json:"go"`
	Runtime *pyrt.Runtime    `json:"runtime"`
	Kernels pyrt.KernelsRoot `json:"kernels"`
	Python  struct {
		Version    string `json:"version"`
		Executable string `json:"executable"`
		Headers    bool   `json:"headers"`
	} `json:"python"`
	Torch  versionInfo `json:"torch"`
	Triton versionInfo `json:"triton"`
	Numpy  versionInfo `json:"numpy"`
	Device struct {
		Kind      string   `json:"kind"`
		Requested string   `json:"requested"`
		Names     []string `json:"names"`
		TorchCUDA *string  `json:"torch_cuda"`
	} `json:"device"`
	Interpreter    bool   `json:"interpreter"`
	TritonCacheDir string `json:"triton_cache_dir"`
}

type versionInfo struct {
	Version *string `json:"version"`
	Error   string  `json:"error,omitempty"`
}

func newEnvCmd(a *app) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "env",
		Short: "Show the Python runtime, package versions and device the workers use",
		Long: `env resolves the Python runtime (building the managed one on first use),
starts one worker and reports what it runs on. --json prints a stable object
with .python.version, .torch.version, .triton.version, .device.kind and more.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			// A worker that cannot import triton or numpy still says what it has.
			return a.withWorkerOf(cmd.Context(), true, func(s *session, w *worker.Worker) error {
				r := buildEnvReport(s, w.Hello(), string(a.flags.device.value))
				if asJSON {
					enc := json.NewEncoder(a.stdout)
					enc.SetIndent("", "  ")
					return enc.Encode(r)
				}
				printEnv(a, r)
				return nil
			})
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func buildEnvReport(s *session, h worker.Hello, requested string) envReport {
	var r envReport
	r.Workbench.Version = version
	r.Workbench.Revision = buildRevision()
	r.Go.Version = runtime.Version()
	r.Runtime = s.runtime
	r.Kernels = s.kernels
	r.Python.Version = h.Python.Version
	r.Python.Executable = h.Python.Executable
	r.Python.Headers = h.Python.Headers.Present
	r.Torch = versionInfo(h.Torch)
	r.Triton = versionInfo(h.Triton)
	r.Numpy = versionInfo(h.Numpy)
	r.Device.Kind = h.Device.Kind
	r.Device.Requested = requested
	r.Device.Names = h.Device.Names
	if r.Device.Names == nil {
		r.Device.Names = []string{}
	}
	r.Device.TorchCUDA = h.Device.TorchCUDA
	r.Interpreter = h.Interpreter
	r.TritonCacheDir = h.TritonCacheDir
	return r
}

func printEnv(a *app, r envReport) {
	tw := tabwriter.NewWriter(a.stdout, 0, 0, 2, ' ', 0)
	row := func(k string, v any) { fmt.Fprintf(tw, "%s\t%v\n", k, v) }
	ver := func(v versionInfo) string {
		if v.Version == nil {
			return "missing (" + v.Error + ")"
		}
		return *v.Version
	}
	row("workbench", r.Workbench.Version)
	row("go", r.Go.Version)
	row("runtime", fmt.Sprintf("%s (from %s)", r.Runtime.Kind, r.Runtime.Source))
	row("python", fmt.Sprintf("%s  %s", r.Python.Version, r.Python.Executable))
	if r.Runtime.Venv != "" {
		row("venv", r.Runtime.Venv)
	}
	row("python headers", map[bool]string{true: "present (Triton can build its GPU launcher)", false: "missing"}[r.Python.Headers])
	row("kernels", fmt.Sprintf("%s (from %s)", r.Kernels.Dir, r.Kernels.Source))
	row("torch", ver(r.Torch))
	row("triton", ver(r.Triton))
	row("numpy", ver(r.Numpy))
	dev := r.Device.Kind
	if len(r.Device.Names) > 0 {
		dev += fmt.Sprintf(" %v", r.Device.Names)
	}
	row("device", fmt.Sprintf("%s (requested %s)", dev, r.Device.Requested))
	row("triton interpreter", r.Interpreter)
	row("triton cache", r.TritonCacheDir)
	tw.Flush()
}
