package main

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/vlkv/vlkv/gohost/tensor"
	"github.com/vlkv/vlkv/gohost/worker"
)

func newBenchCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Benchmarks (timings only; correctness lives in the tests)",
	}
	cmd.AddCommand(newBenchExchangeCmd(a), newBenchStatsCmd(a), newBenchLowrankCmd(a))
	return cmd
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
			return a.withWorker(cmd.Context(), func(_ *session, w *worker.Worker) error {
				rows, err := benchExchange(cmd.Context(), a, w, minBytes, maxBytes, repeat)
				if err != nil {
					return err
				}
				if asJSON {
					enc := json.NewEncoder(a.stdout)
					enc.SetIndent("", "  ")
					return enc.Encode(map[string]any{"benchmark": "exchange", "repeat": repeat, "rows": rows})
				}
				tw := tabwriter.NewWriter(a.stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
				fmt.Fprintln(tw, "bytes\tarena\tarena GB/s\tpipe\tpipe GB/s\tpipe/arena\tdoubling\t")
				for _, r := range rows {
					fmt.Fprintf(tw, "%s\t%s\t%.1f\t%s\t%.2f\t%.0fx\t%s\t\n", humanBytes(r.Bytes), secs(r.ShmSeconds), r.ShmGBps,
						secs(r.PipeSeconds), r.PipeGBps, r.Speedup, secs(r.ComputeSeconds))
				}
				return tw.Flush()
			})
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON rows (bytes, shm_seconds, pipe_seconds, ...)")
	cmd.Flags().Int64Var(&minBytes, "min-bytes", 4<<10, "smallest tensor")
	cmd.Flags().Int64Var(&maxBytes, "max-bytes", 1<<30, "largest tensor")
	cmd.Flags().IntVar(&repeat, "repeat", 5, "timed round trips per size and path, after one warm-up (the median is reported)")
	return cmd
}

func benchExchange(ctx context.Context, a *app, w *worker.Worker, minBytes, maxBytes int64, repeat int) ([]exchangeRow, error) {
	var rows []exchangeRow
	for size := minBytes / 4 * 4; size <= maxBytes; size *= 4 {
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
		raw, err := w.Run(ctx, worker.Job{Fn: "kernels_py.exchange:double_inplace", Args: map[string]any{"x": x}})
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

// statsRow mirrors a row of kernels_py.benchmarks.stats.run.
type statsRow struct {
	PromptLen          int      `json:"prompt_len"`
	Batch              int      `json:"batch"`
	Rows               int      `json:"rows"`
	StatsSeconds       float64  `json:"stats_seconds"`
	MaterializeSeconds float64  `json:"materialize_seconds"`
	SDPASeconds        float64  `json:"sdpa_seconds"`
	StatsPeak          *float64 `json:"stats_peak_bytes"`
	MaterializePeak    *float64 `json:"materialize_peak_bytes"`
	SDPAPeak           *float64 `json:"sdpa_peak_bytes"`
	StatsGBps          float64  `json:"stats_gbps"`
	StatsVsSDPA        float64  `json:"stats_vs_sdpa"`
	MaterializeVsStats float64  `json:"materialize_vs_stats"`
}

func newBenchStatsCmd(a *app) *cobra.Command {
	var (
		asJSON  bool
		lengths []int
		batches []int
		rows    int
		repeat  int
		dtype   = enumFlag{value: "float16", allowed: []string{"float16", "bfloat16", "float32"}}
	)
	cmd := &cobra.Command{
		Use:   "stats",
		Short: "Attention-statistics kernels vs materialised softmax and vs one SDPA forward over the same rows",
		Long: `stats times the three-kernel attention-statistics pipeline
(kernels_py/triton/attention_stats.py: row stats, column stats, reduction) for
--rows selected query rows (the last ones of the prompt) against PyTorch
materialising softmax(QK^T) for those rows and against one
scaled_dot_product_attention forward over the same rows, for each prompt
length and batch (32 query heads, 8 kv heads, head_dim 128). Reports median
times, the pipeline's achieved GB/s on K, the ratios, and on a GPU the peak
extra memory of each path. On the CPU the kernels run under the Triton
interpreter: the command then runs one tiny size to prove the benchmark works
(its timings say nothing about kernel speed).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if rows < 1 || repeat < 1 {
				return &usageError{fmt.Errorf("--rows and --repeat must be at least 1")}
			}
			args := map[string]any{"rows": rows, "repeat": repeat, "dtype": dtype.value}
			if len(lengths) > 0 {
				args["lengths"] = lengths
			}
			if len(batches) > 0 {
				args["batches"] = batches
			}
			return a.runKernelBench(cmd, "kernels_py.benchmarks.stats", args, asJSON, func(raw []byte) error {
				var res struct {
					Device      string     `json:"device"`
					Interpreter bool       `json:"interpreter"`
					Rows        []statsRow `json:"rows"`
				}
				if err := json.Unmarshal(raw, &res); err != nil {
					return err
				}
				tw := tabwriter.NewWriter(a.stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
				fmt.Fprintln(tw, "prompt\tbatch\tstats\tGB/s\tmaterialise\tSDPA\tstats/SDPA\tmaterialise/stats\tpeak stats\tpeak materialise\t")
				for _, r := range res.Rows {
					fmt.Fprintf(tw, "%d\t%d\t%s\t%.0f\t%s\t%s\t%.2fx\t%.1fx\t%s\t%s\t\n", r.PromptLen, r.Batch, secs(r.StatsSeconds),
						r.StatsGBps, secs(r.MaterializeSeconds), secs(r.SDPASeconds), r.StatsVsSDPA, r.MaterializeVsStats,
						peak(r.StatsPeak), peak(r.MaterializePeak))
				}
				return tw.Flush()
			})
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the rows as JSON")
	cmd.Flags().IntSliceVar(&lengths, "lengths", nil, "prompt lengths (default 1024,4096,16384,65536,131072)")
	cmd.Flags().IntSliceVar(&batches, "batches", nil, "batch sizes (default 1,4,16)")
	cmd.Flags().IntVar(&rows, "rows", 50, "selected query rows")
	cmd.Flags().IntVar(&repeat, "repeat", 10, "timed runs per path (median reported)")
	cmd.Flags().Var(&dtype, "dtype", "dtype of Q and K")
	return cmd
}

func peak(b *float64) string {
	if b == nil {
		return "-"
	}
	return humanBytes(int64(*b))
}

// lowrankRow mirrors a row of kernels_py.benchmarks.lowrank.run.
type lowrankRow struct {
	VisualLen        int      `json:"visual_len"`
	Batch            int      `json:"batch"`
	DenseLen         int      `json:"dense_len"`
	RankK            int      `json:"rank_k"`
	RankV            int      `json:"rank_v"`
	NumSplits        int      `json:"num_splits"`
	SDPABackend      string   `json:"sdpa_backend"`
	FusedMs          float64  `json:"fused_ms"`
	AbsorbedMs       float64  `json:"absorbed_ms"`
	UnfusedMs        float64  `json:"unfused_ms"`
	SDPAMs           float64  `json:"sdpa_ms"`
	FusedPeak        *float64 `json:"fused_peak_bytes"`
	UnfusedPeak      *float64 `json:"unfused_peak_bytes"`
	SDPAPeak         *float64 `json:"sdpa_peak_bytes"`
	CompressedBytes  int64    `json:"compressed_bytes"`
	FullBytes        int64    `json:"full_bytes"`
	FusedGBps        float64  `json:"fused_gbps"`
	SpeedupVsUnfused float64  `json:"speedup_vs_unfused"`
	SpeedupVsSDPA    float64  `json:"speedup_vs_sdpa"`
	CompressionRatio float64  `json:"compression_ratio"`
}

func newBenchLowrankCmd(a *app) *cobra.Command {
	var (
		asJSON  bool
		lengths []int
		batches []int
		rank    int
		repeat  int
		dtype   = enumFlag{value: "float16", allowed: []string{"float16", "bfloat16", "float32"}}
	)
	cmd := &cobra.Command{
		Use:   "lowrank",
		Short: "Fused low-rank decode attention (AttentionPack) vs decompress-then-SDPA and vs SDPA on the full cache",
		Long: `lowrank times one decode step of attention over an AttentionPack cache: the
fused Triton kernel (kernels_py/triton/lowrank_decode.py: rebuild K and V from
U and W in SRAM, split-K flash-decoding, per-token attention mass), against
the unfused path (batched matmuls rebuild the whole cache, RoPE, then
scaled_dot_product_attention) and against scaled_dot_product_attention over a
full uncompressed cache of the same length; the rank-space (absorbed) variant
is timed as well. For each visual length and batch: 32 query heads, 8 kv
heads, head_dim 128, keys and values at --rank (values in two importance
groups: 25% of the tokens at full rank, 75% at a quarter), 64 dense text
tokens, one new query token. Reports median times, the fused kernel's GB/s
on the compressed cache (U, W, dense K/V), the time ratios unfused/fused and
SDPA/fused (above 1: the fused kernel is faster), the cache's compression
ratio, and on a GPU the peak extra memory of each path. On the
CPU the kernels run under the Triton interpreter: the command then runs one
tiny size to prove the benchmark works (its timings say nothing about kernel
speed).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if rank < 1 || repeat < 1 {
				return &usageError{fmt.Errorf("--rank and --repeat must be at least 1")}
			}
			args := map[string]any{"rank": rank, "repeat": repeat, "dtype": dtype.value}
			if len(lengths) > 0 {
				args["lengths"] = lengths
			}
			if len(batches) > 0 {
				args["batches"] = batches
			}
			return a.runKernelBench(cmd, "kernels_py.benchmarks.lowrank", args, asJSON, func(raw []byte) error {
				var res struct {
					Device      string       `json:"device"`
					Interpreter bool         `json:"interpreter"`
					Rows        []lowrankRow `json:"rows"`
				}
				if err := json.Unmarshal(raw, &res); err != nil {
					return err
				}
				tw := tabwriter.NewWriter(a.stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
				fmt.Fprintln(tw, "visual\tbatch\tfused\tGB/s\tabsorbed\tunfused\tSDPA\tunfused/fused\tSDPA/fused\tcompression\tpeak fused\tpeak unfused\t")
				for _, r := range res.Rows {
					fmt.Fprintf(tw, "%d\t%d\t%s\t%.0f\t%s\t%s\t%s\t%.2fx\t%.2fx\t%.1fx\t%s\t%s\t\n", r.VisualLen, r.Batch,
						ms(r.FusedMs), r.FusedGBps, ms(r.AbsorbedMs), ms(r.UnfusedMs), ms(r.SDPAMs), r.SpeedupVsUnfused,
						r.SpeedupVsSDPA, r.CompressionRatio, peak(r.FusedPeak), peak(r.UnfusedPeak))
				}
				return tw.Flush()
			})
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the rows as JSON")
	cmd.Flags().IntSliceVar(&lengths, "lengths", nil, "visual (compressed) token counts (default 1024,4096,16384,32768)")
	cmd.Flags().IntSliceVar(&batches, "batches", nil, "batch sizes (default 1,8,32,64)")
	cmd.Flags().IntVar(&rank, "rank", 64, "compression rank of keys and values")
	cmd.Flags().IntVar(&repeat, "repeat", 10, "timed runs per path (median reported)")
	cmd.Flags().Var(&dtype, "dtype", "dtype of q, U, W and the dense K/V")
	return cmd
}

// ms prints milliseconds the way secs prints seconds.
func ms(m float64) string {
	return secs(m / 1e3)
}

// runKernelBench runs module:run with args on a worker and prints its JSON
// (--json) or hands it to render. On the CPU, unless --lengths was given, it
// swaps args for module:smoke_sizes: interpreted kernels only prove the
// benchmark works.
func (a *app) runKernelBench(cmd *cobra.Command, module string, args map[string]any, asJSON bool, render func(raw []byte) error) error {
	return a.withWorker(cmd.Context(), func(s *session, w *worker.Worker) error {
		if s.device == worker.CPU && !cmd.Flags().Changed("lengths") {
			a.log.Warn().Msg("CPU interpreter: running one tiny size to show the benchmark works; its timings are not kernel speed")
			raw, err := w.Run(cmd.Context(), worker.Job{Fn: module + ":smoke_sizes"})
			if err != nil {
				return err
			}
			args = map[string]any{}
			if err := json.Unmarshal(raw, &args); err != nil {
				return err
			}
		}
		raw, err := w.Run(cmd.Context(), worker.Job{Fn: module + ":run", Args: args})
		if err != nil {
			return err
		}
		if asJSON {
			_, err := a.stdout.Write(append(raw, '\n'))
			return err
		}
		return render(raw)
	})
}
