"""One decode step over the rows of a KV cache an index list selects
(kernels_py.ops.gather_decode: A-VL's core tokens, read by index in the
kernel) against

(i)   slice-then-SDPA: gather the listed rows into a new K/V (the copy A-VL
      found slower than attending over everything), then SDPA, and
(ii)  SDPA over all rows of the cache (FlashAttention forced where PyTorch
      has it for these shapes).

Cache: `context` tokens per sequence; each kv head lists `percent`% of them
(distinct, at random, sorted); one query token that sees every row. Bytes
for GB/s and % of the HBM peak: the listed rows' K and V, their indices and
positions (4 bytes each); the whole cache's K/V for SDPA. On a GPU each row
also gives the estimate's band (kernels_py.ops.estimate) beside the measured
time and appends it as a calibration point.
"""

from dataclasses import dataclass

import torch

from kernels_py.benchmarks.base import (
    ESTIMATE_ERROR, OUTPUT_ERROR, AttentionBenchmark, estimate_beside, estimate_columns, hbm_peak_gbps, nbytes,
    output_error, percent_of, sdpa, time_median,
)
from kernels_py.ops import gather_decode as op
from kernels_py.ops.gather_decode import model
from kernels_py.params import knob
from kernels_py.tables import Column


def _make(batch, context, heads, kv_heads, head_dim, share, dtype, device, g):
    k = torch.randn(batch, kv_heads, context, head_dim, generator=g, device=device).to(dtype)
    v = torch.randn_like(k)
    pos = torch.arange(context, dtype=torch.int32, device=device).expand(batch, context).contiguous()
    rows = max(1, round(share * context))
    index = torch.stack([torch.stack([torch.randperm(context, generator=g, device=device)[:rows].sort().values
                                      for _ in range(kv_heads)]) for _ in range(batch)]).to(torch.int32)
    count = torch.full((batch, kv_heads), rows, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, 1, head_dim, generator=g, device=device).to(dtype)
    q_pos = torch.full((batch, 1), context, dtype=torch.int32, device=device)
    return q, q_pos, k, v, pos, index, count


def _slice_then_attend(q, k, v, index):
    rows = index.long()[..., None].expand(-1, -1, -1, k.shape[-1])
    return sdpa(q, k.gather(2, rows), v.gather(2, rows))[0]


@dataclass(frozen=True)
class Gather(AttentionBenchmark):
    """Selected-row decode attention (A-VL's core rows, read by index) vs slice-then-SDPA and vs SDPA over all rows."""

    name = "gather"
    length_column = "context"
    columns = (
        Column("context", "", "cached tokens per sequence", "context"),
        Column("batch", "", "sequences"),
        *AttentionBenchmark.SHAPE_COLUMNS,
        Column("percent", "%", "share of the rows each kv head lists (A-VL's core share)", "core %"),
        Column("num_splits", "", "split-K splits per (sequence, kv head)", show=False),
        Column("sdpa_backend", "", "SDPA backend of the baselines", show=False),
        Column("gather_ms", "ms", "the selected-row kernel, median", "gather"),
        Column("gather_gbps", "GB/s", "bytes the kernel reads / its time", "GB/s"),
        Column("gather_hbm_pct", "%", "gather_gbps as a share of the GPU's HBM bandwidth", "% HBM"),
        Column("slice_ms", "ms", "gather the rows into a copy, then SDPA", "slice+SDPA"),
        Column("sdpa_ms", "ms", "SDPA over every row of the cache", "SDPA all"),
        Column("sdpa_hbm_pct", "%", "the whole cache's K/V bytes / SDPA-over-all time, as a share of the HBM "
               "bandwidth", show=False),
        Column("speedup_vs_slice", "x", "slice-then-SDPA time / kernel time", "slice/gather"),
        Column("speedup_vs_sdpa", "x", "SDPA-over-all time / kernel time", "SDPA/gather"),
        Column("read_bytes", "bytes", "bytes the kernel reads", show=False),
        *estimate_columns("gather", "the selected-row call"),
        ESTIMATE_ERROR,
        OUTPUT_ERROR,
    )
    smoke = ({"lengths": (96,)}, {"batches": (1,)}, {"heads": 4, "kv_heads": 2, "head_dim": 64},
             {"dtype": "float32"}, {"repeat": 1}, {"percents": (30,)})

    lengths: tuple = knob("ints", (2048, 8192, 16384, 65536), "cached tokens per sequence", min=1, max=1 << 24)
    batches: tuple = knob("ints", (1, 8, 32, 64), "batch sizes", min=1, max=4096)
    percents: tuple = knob("ints", (10, 20, 30, 50), "rows each kv head lists, percent of the context (A-VL: core "
                           "30% of the image tokens)", min=1, max=100, ref="A-VL Table 3")

    def cases(self):
        return ({self.length_column: n, "batch": b, "percent": pct}
                for n in self.lengths for b in self.batches for pct in self.percents)

    def measure(self, case):
        x = self.inputs(case)
        n, b, cuda = x.tokens, x.batch, x.cuda
        q, q_pos, k, v, pos, index, count = _make(b, n, self.heads, self.kv_heads, self.head_dim,
                                                  case["percent"] / 100, x.dtype, x.device, x.generator)
        op.check_inputs(q, q_pos, k, v, pos, index, count)  # once: the timed calls skip the value checks
        splits = op.default_num_splits(count)
        ws = op.make_workspace(q, splits)
        gather = lambda: op.gather_decode(q, q_pos, k, v, pos, index, count, workspace=ws,  # noqa: E731
                                          check_values=False)
        full = lambda: sdpa(q, k, v)  # noqa: E731
        rows = int(count.sum())
        read = rows * 2 * self.head_dim * x.dtype.itemsize + rows * 4 * 2
        row = {**self.shape(), "percent": case["percent"], "num_splits": splits, "sdpa_backend": full()[1],
               "gather_ms": time_median(gather, self.repeat, cuda, graph=True) * 1e3,
               "slice_ms": time_median(lambda: _slice_then_attend(q, k, v, index), self.repeat, cuda) * 1e3,
               "sdpa_ms": time_median(full, self.repeat, cuda, graph=True) * 1e3, "read_bytes": read}
        peak = hbm_peak_gbps(x.device)
        row["output_err"] = output_error(gather().out, _slice_then_attend(q, k, v, index))
        row["gather_gbps"] = read / (row["gather_ms"] / 1e3) / 1e9
        row["gather_hbm_pct"] = percent_of(row["gather_gbps"], peak)
        row["sdpa_hbm_pct"] = percent_of(nbytes(k, v) / (row["sdpa_ms"] / 1e3) / 1e9, peak)
        row["speedup_vs_slice"] = row["slice_ms"] / row["gather_ms"]
        row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["gather_ms"]
        step = model.Step(batch=b, context=n, share=case["percent"] / 100, heads=self.heads, kv_heads=self.kv_heads,
                          head_dim=self.head_dim)
        estimate_beside(row, "gather", model, "selected rows", step, row["gather_ms"], dtype=self.dtype)
        return row
