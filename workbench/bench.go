package main

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/vlkv/vlkv/gohost/expt"
	"github.com/vlkv/vlkv/gohost/tensor"
	"github.com/vlkv/vlkv/gohost/worker"
)

func newBenchCmd(a *app, benchmarks benchmarkList) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "bench [NAME]",
		Short: "Benchmarks (timings only; correctness lives in the tests)",
		Long: `bench runs a benchmark and prints its table (or --json). Every kernel
benchmark is a file in kernels_py/benchmarks/ that describes its parameters
(the flags below each one) and its columns; "exchange" measures the host's own
tensor exchange with a worker. On the CPU the kernels run under the Triton
interpreter: a kernel benchmark then shrinks the sizes you did not set to a
tiny case that shows it works (its timings say nothing about kernel speed).`,
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return cmd.Help()
			}
			if benchmarks.err != nil {
				return fmt.Errorf("benchmark %q: the benchmark list is unavailable: %w", args[0], benchmarks.err)
			}
			names := append(benchmarks.schema.BenchmarkNames(), "exchange")
			return &usageError{fmt.Errorf("benchmark %s%s", expt.UnknownName(args[0], names),
				unknownHint(benchmarks.kernels, "benchmark", args[0]))}
		},
	}
	// `bench NAME --flag` for a NAME that is no subcommand parses the flag
	// as bench's own: say the name is unknown (and why), not the flag.
	cmd.SetFlagErrorFunc(func(c *cobra.Command, err error) error {
		if args := c.Flags().Args(); c == cmd && len(args) > 0 {
			return cmd.RunE(c, args)
		}
		return err
	})
	cmd.AddCommand(newBenchExchangeCmd(a))
	if benchmarks.schema != nil {
		for _, name := range benchmarks.schema.BenchmarkNames() {
			cmd.AddCommand(newKernelBenchCmd(a, benchmarks.schema.Benchmarks[name]))
		}
	}
	return cmd
}

// newKernelBenchCmd is `workbench bench NAME` for a benchmark the schema
// describes: one flag per parameter (kv_heads is --kv-heads), checked against
// its bounds before any Python starts.
func newKernelBenchCmd(a *app, b *expt.Benchmark) *cobra.Command {
	var asJSON bool
	flags := map[string]func() any{} // param name -> its flag's value
	cmd := &cobra.Command{
		Use:   b.Name,
		Short: strings.TrimSuffix(b.Doc, "."),
		Long:  strings.TrimSpace(b.Doc+"\n\n"+b.Long) + "\n\nColumns (--json has them all; the table shows the main ones):\n" + columnDocs(b.Columns),
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			params := map[string]any{}
			for _, name := range b.Params.Names() {
				flag := flagName(name)
				if !cmd.Flags().Changed(flag) {
					continue
				}
				v, err := b.Params[name].Check(flags[name]())
				if err != nil {
					return &usageError{fmt.Errorf("--%s: %v (%s)", flag, err, b.Params[name].Describe())}
				}
				params[name] = v
			}
			return a.withWorker(cmd.Context(), func(_ *session, w *worker.Worker) error {
				raw, err := w.Run(cmd.Context(), worker.Job{Fn: "kernels_py.benchmarks:run", Args: map[string]any{"name": b.Name, "params": params}})
				if err != nil {
					if cmd.Context().Err() != nil { // Ctrl-C: the worker was stopped, not broken
						return fmt.Errorf("bench %s: interrupted (the rows measured so far are logged above)", b.Name)
					}
					return a.jobFailed("benchmark "+b.Name, err)
				}
				var res struct {
					table
					Notes []string `json:"notes"`
				}
				if err := json.Unmarshal(raw, &res); err != nil {
					return fmt.Errorf("benchmark %s returned an unexpected result: %w", b.Name, err)
				}
				for _, n := range res.Notes {
					a.log.Warn().Msg(n)
				}
				if asJSON {
					_, err := a.stdout.Write(append(raw, '\n'))
					return err
				}
				return res.table.print(a.stdout)
			})
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the result as JSON (every column, the parameters used, device)")
	for _, name := range b.Params.Names() {
		flags[name] = addParamFlag(cmd, b.Params[name])
	}
	return cmd
}

// flagName is a parameter's command-line spelling: kv_heads -> kv-heads.
func flagName(param string) string {
	return strings.ReplaceAll(param, "_", "-")
}

// addParamFlag declares a flag for p and returns how to read its value in
// the form Param.Check takes.
func addParamFlag(cmd *cobra.Command, p *expt.Param) func() any {
	name, usage := flagName(p.Name), p.Usage()
	fs := cmd.Flags()
	switch p.Type {
	case expt.TypeInt:
		v := fs.Int64(name, p.Default.(int64), usage)
		return func() any { return *v }
	case expt.TypeFloat:
		v := fs.Float64(name, p.Default.(float64), usage)
		return func() any { return *v }
	case expt.TypeBool:
		v := fs.Bool(name, p.Default.(bool), usage)
		return func() any { return *v }
	case expt.TypeInts:
		def := p.Default.([]int64)
		ints := make([]int, len(def))
		for i, x := range def {
			ints[i] = int(x)
		}
		v := fs.IntSlice(name, ints, usage)
		return func() any {
			out := make([]int64, len(*v))
			for i, x := range *v {
				out[i] = int64(x)
			}
			return out
		}
	}
	v := fs.String(name, p.Default.(string), usage)
	return func() any { return *v }
}

// exchangeRow is one size of `bench exchange`; seconds are medians.
type exchangeRow struct {
	Bytes          int64   `json:"bytes"`
	ShmSeconds     float64 `json:"shm_seconds"`  // round trip through an arena, doubling excluded
	PipeSeconds    float64 `json:"pipe_seconds"` // the same bytes through the pipe, doubling excluded
	ComputeSeconds float64 `json:"compute_seconds"`
	ShmGBps        float64 `json:"shm_gbps"`
	PipeGBps       float64 `json:"pipe_gbps"`
	Speedup        float64 `json:"speedup"`
}

func newBenchExchangeCmd(a *app) *cobra.Command {
	var (
		asJSON   bool
		minBytes int64
		maxBytes int64
		repeat   int
	)
	cmd := &cobra.Command{
		Use:   "exchange",
		Short: "Round-trip a tensor to a worker through a shared-memory arena vs through the pipe",
		Long: `exchange measures handing a float32 tensor to a worker that doubles it in
place with torch and hands it back, for sizes from --min-bytes to --max-bytes
(x4 steps): once by reference into a shared-memory arena (DLPack descriptor
over memfd), once with the same bytes sent through the worker's pipe and back.
The doubling time, measured inside the worker, is subtracted from both.
Columns: median latency, bytes/latency in GB/s, and pipe/arena ratio.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if minBytes < 4 || maxBytes < minBytes || repeat < 1 {
				return &usageError{fmt.Errorf("need 4 <= --min-bytes <= --max-bytes and --repeat >= 1")}
			}
			sizes := exchangeSizes(minBytes, maxBytes)
			if len(sizes) == 0 {
				return &usageError{fmt.Errorf("no float32 tensor has from %d to %d bytes (a whole number of 4-byte elements)", minBytes, maxBytes)}
			}
			return a.withWorker(cmd.Context(), func(_ *session, w *worker.Worker) error {
				rows, err := benchExchange(cmd.Context(), a, w, sizes, repeat)
				if err != nil {
					return err
				}
				if asJSON {
					enc := json.NewEncoder(a.stdout)
					enc.SetIndent("", "  ")
					return enc.Encode(map[string]any{"benchmark": "exchange", "repeat": repeat, "rows": rows})
				}
				return exchangeTable(rows).print(a.stdout)
			})
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON rows (bytes, shm_seconds, pipe_seconds, ...)")
	cmd.Flags().Int64Var(&minBytes, "min-bytes", 4<<10, "smallest tensor")
	cmd.Flags().Int64Var(&maxBytes, "max-bytes", 1<<30, "largest tensor")
	cmd.Flags().IntVar(&repeat, "repeat", 5, "timed round trips per size and path, after one warm-up (the median is reported)")
	return cmd
}

// exchangeColumns describe exchangeRow for the table printer.
var exchangeColumns = []expt.Column{
	{Name: "bytes", Unit: "bytes", Doc: "tensor size", Show: true},
	{Name: "shm_seconds", Unit: "s", Doc: "round trip through an arena, doubling excluded", Label: "arena", Show: true},
	{Name: "shm_gbps", Unit: "GB/s", Doc: "bytes / arena round trip", Label: "arena GB/s", Show: true},
	{Name: "pipe_seconds", Unit: "s", Doc: "the same bytes through the pipe and back, doubling excluded", Label: "pipe", Show: true},
	{Name: "pipe_gbps", Unit: "GB/s", Doc: "bytes / pipe round trip", Label: "pipe GB/s", Show: true},
	{Name: "speedup", Unit: "x", Doc: "pipe time / arena time", Label: "pipe/arena", Show: true},
	{Name: "compute_seconds", Unit: "s", Doc: "the doubling itself, inside the worker", Label: "doubling", Show: true},
}

func exchangeTable(rows []exchangeRow) table {
	t := table{Columns: exchangeColumns}
	for _, r := range rows {
		t.Rows = append(t.Rows, map[string]any{"bytes": float64(r.Bytes), "shm_seconds": r.ShmSeconds, "shm_gbps": r.ShmGBps,
			"pipe_seconds": r.PipeSeconds, "pipe_gbps": r.PipeGBps, "speedup": r.Speedup, "compute_seconds": r.ComputeSeconds})
	}
	return t
}

// exchangeSizes are the tensor sizes of `bench exchange`: from minBytes,
// rounded up to whole float32 elements (not down: --min-bytes 5 would
// measure 4 bytes, below the range asked for), in x4 steps up to maxBytes.
func exchangeSizes(minBytes, maxBytes int64) []int64 {
	first := minBytes / 4 * 4
	if first < minBytes {
		if first > maxBytes-4 {
			return nil
		}
		first += 4
	}
	var sizes []int64
	for size := first; size <= maxBytes; size *= 4 {
		sizes = append(sizes, size)
		if size > maxBytes/4 { // the next step is past maxBytes, or past int64
			break
		}
	}
	return sizes
}

func benchExchange(ctx context.Context, a *app, w *worker.Worker, sizes []int64, repeat int) ([]exchangeRow, error) {
	var rows []exchangeRow
	for _, size := range sizes {
		ar, err := tensor.NewArena(1000, "bench", size)
		if err != nil {
			return nil, err
		}
		row, err := benchSize(ctx, w, ar, size, repeat)
		ar.Close()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", humanBytes(size), err)
		}
		a.log.Info().Str("bytes", humanBytes(size)).Str("arena", secs(row.ShmSeconds)).Str("pipe", secs(row.PipeSeconds)).Msg("measured")
		rows = append(rows, row)
	}
	return rows, nil
}

func benchSize(ctx context.Context, w *worker.Worker, ar *tensor.Arena, size int64, repeat int) (exchangeRow, error) {
	if err := w.MapArena(ctx, ar); err != nil {
		return exchangeRow{}, err
	}
	defer w.UnmapArena(ctx, ar.ID())
	x, err := ar.NewTensor(tensor.Float32, size/4)
	if err != nil {
		return exchangeRow{}, err
	}
	// One path at a time, each after a warm-up round trip: the pipe path
	// allocates and frees the size twice per trip, and that cleanup must not
	// land inside arena timings.
	var shm, pipe, compute []float64
	for i := 0; i <= repeat; i++ {
		t0 := time.Now()
		raw, err := w.Run(ctx, worker.Job{Fn: "kernels_py.runtime.exchange:double_inplace", Args: map[string]any{"x": x}})
		total := time.Since(t0).Seconds()
		if err != nil {
			return exchangeRow{}, err
		}
		var res struct {
			ComputeSeconds float64 `json:"compute_seconds"`
		}
		if err := json.Unmarshal(raw, &res); err != nil {
			return exchangeRow{}, err
		}
		if i > 0 {
			shm = append(shm, total-res.ComputeSeconds)
			compute = append(compute, res.ComputeSeconds)
		}
	}
	data := make([]byte, size)
	for i := 0; i <= repeat; i++ {
		t0 := time.Now()
		out, c, err := w.PipeRoundTrip(ctx, data)
		total := time.Since(t0).Seconds()
		if err != nil {
			return exchangeRow{}, err
		}
		if int64(len(out)) != size {
			return exchangeRow{}, fmt.Errorf("pipe returned %d bytes, sent %d", len(out), size)
		}
		if i > 0 {
			pipe = append(pipe, total-c)
		}
	}
	r := exchangeRow{Bytes: size, ShmSeconds: median(shm), PipeSeconds: median(pipe), ComputeSeconds: median(compute)}
	r.ShmGBps = float64(size) / r.ShmSeconds / 1e9
	r.PipeGBps = float64(size) / r.PipeSeconds / 1e9
	r.Speedup = r.PipeSeconds / r.ShmSeconds
	return r, nil
}

func median(xs []float64) float64 {
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	return s[len(s)/2]
}

func secs(s float64) string {
	return time.Duration(s * float64(time.Second)).Round(time.Microsecond).String()
}

// humanBytes prints sizes in binary units: exact ones as "4 KiB", others as "1.5 MiB".
func humanBytes(n int64) string {
	for _, u := range []struct {
		unit string
		size int64
	}{{"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if n >= u.size {
			if n%u.size == 0 {
				return fmt.Sprintf("%d %s", n/u.size, u.unit)
			}
			return fmt.Sprintf("%.1f %s", float64(n)/float64(u.size), u.unit)
		}
	}
	return fmt.Sprintf("%d B", n)
}
