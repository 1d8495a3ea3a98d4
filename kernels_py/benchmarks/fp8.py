"""One decode step of attention over an FP8 KV cache (kernels_py.ops.fp8_decode:
codes converted in registers) against

(i)   scaled_dot_product_attention over the same cache in the 16-bit dtype
      (FlashAttention forced where PyTorch has it for these shapes): what an
      engine runs without fp8, and
(ii)  dequantize-then-attend: the codes dequantized to the 16-bit dtype,
      then SDPA (the unfused path: what an engine without a fused fp8
      kernel does).

Cache: `context` tokens per sequence quantized by ops.fp8_decode.codec
(`fmt`, scales per `scale`: tensor, head or token), the value codes
token-contiguous (the layout the kernel reads); one query token that sees
every token. Bytes for GB/s and % of the HBM peak are those the step must
read: codes, scales and slot positions (4 bytes a slot); the 16-bit K/V for
SDPA. A size that does not fit the GPU is recorded as skipped; a
dequantize-then-attend path that alone does not fit leaves its columns
empty. On a GPU each row also gives the estimate's band beside the measured
time and appends it as a calibration point.
"""

from dataclasses import dataclass

import torch

from kernels_py.benchmarks.base import (
    ESTIMATE_ERROR, OUTPUT_ERROR, AttentionBenchmark, estimate_beside, estimate_columns, hbm_peak_gbps, nbytes,
    output_error, percent_of, sdpa, time_median,
)
from kernels_py.ops import fp8_decode as op
from kernels_py.ops.fp8_decode import codec, model
from kernels_py.params import knob
from kernels_py.tables import Column


def _make(batch, context, heads, kv_heads, head_dim, fmt, granularity, dtype, device, g):
    """q, q_pos, codes and scales as the op takes them, pos, and the 16-bit K/V."""
    k = torch.randn(batch, kv_heads, context, head_dim, generator=g, device=device).to(dtype)
    v = torch.randn(batch, kv_heads, context, head_dim, generator=g, device=device).to(dtype)
    k_codes, k_scale = codec.quantize(k, granularity, fmt)
    v_codes, v_scale = codec.quantize(v, granularity, fmt)
    v_codes = codec.values_layout(v_codes)
    if granularity != "token":  # [B, H_kv] (per head), or [B, 1] expanded (per tensor)
        k_scale, v_scale = (s[..., 0].expand(batch, kv_heads) for s in (k_scale, v_scale))
    pos = torch.arange(context, dtype=torch.int32, device=device).expand(batch, context).contiguous()
    q = torch.randn(batch, heads, 1, head_dim, generator=g, device=device).to(dtype)
    q_pos = torch.full((batch, 1), context, dtype=torch.int32, device=device)
    return q, q_pos, k_codes, v_codes, k_scale, v_scale, pos, k, v


def _dequantize_then_attend(q, k_codes, v_codes, k_scale, v_scale, dtype):
    keys, values = op.reference.dequantize(k_codes, v_codes, k_scale, v_scale, dtype)
    return sdpa(q, keys, values)[0]


@dataclass(frozen=True)
class FP8(AttentionBenchmark):
    """FP8 KV-cache decode attention vs SDPA (FlashAttention) on the 16-bit cache and vs dequantize-then-SDPA."""

    name = "fp8"
    length_column = "context"
    columns = (
        Column("context", "", "cached tokens per sequence", "context"),
        Column("batch", "", "sequences"),
        *AttentionBenchmark.SHAPE_COLUMNS,
        Column("fmt", "", "fp8 format of the codes", show=False),
        Column("scale", "", "granularity of the scales", "scales"),
        Column("num_splits", "", "split-K splits per (sequence, kv head)", show=False),
        Column("sdpa_backend", "", "SDPA backend of the baselines", show=False),
        Column("fp8_ms", "ms", "the fp8 decode kernel (converts in registers), median", "fp8"),
        Column("fp8_gbps", "GB/s", "bytes the step reads / fp8 time", "GB/s"),
        Column("fp8_hbm_pct", "%", "fp8_gbps as a share of the GPU's HBM bandwidth", "% HBM"),
        Column("dequant_ms", "ms", "dequantize to the inputs' dtype, then SDPA", "dequant+SDPA"),
        Column("sdpa_ms", "ms", "SDPA over the cache in the inputs' dtype (fp16 by default)", "SDPA"),
        Column("sdpa_hbm_pct", "%", "full K/V bytes / SDPA time, as a share of the HBM bandwidth", "SDPA % HBM"),
        Column("speedup_vs_sdpa", "x", "SDPA time / fp8 time (above 1: the fp8 kernel is faster; the bytes allow 2)",
               "SDPA/fp8"),
        Column("speedup_vs_dequant", "x", "dequantize-then-attend time / fp8 time", "dequant/fp8"),
        Column("read_bytes", "bytes", "bytes the fp8 step reads", show=False),
        Column("full_bytes", "bytes", "bytes of the cache in the inputs' dtype", show=False),
        Column("compression_ratio", "x", "K/V bytes in the inputs' dtype / the fp8 cache's bytes (codes, scales and "
               "slot positions, as the quant and lowrank benchmarks count theirs)", "compression"),
        *estimate_columns("fp8", "the fp8 decode call"),
        ESTIMATE_ERROR,
        OUTPUT_ERROR,
    )
    smoke = ({"lengths": (96,)}, {"batches": (1,)}, {"heads": 4, "kv_heads": 2, "head_dim": 64},
             {"dtype": "float32"}, {"repeat": 1})

    lengths: tuple = knob("ints", (2048, 8192, 32768, 131072), "cached tokens per sequence", min=1, max=1 << 24)
    batches: tuple = knob("ints", (1, 8, 32, 64), "batch sizes", min=1, max=4096)
    fmt: str = knob("str", "e4m3", "fp8 format of the codes (e4m3: vLLM's fp8_e4m3 and FlashInfer's default)",
                    choices=tuple(codec.FORMATS), ref="vLLM kv_cache_dtype")
    scale: str = knob("str", "tensor", "granularity of the scales: tensor (vLLM's k_scale/v_scale), head or token",
                      choices=codec.GRANULARITIES, ref="vLLM quantized KV cache")

    def measure(self, case):
        x = self.inputs(case)
        n, b, cuda, dt = x.tokens, x.batch, x.cuda, x.dtype
        q, q_pos, k_codes, v_codes, k_scale, v_scale, pos, full_k, full_v = _make(
            b, n, self.heads, self.kv_heads, self.head_dim, self.fmt, self.scale, dt, x.device, x.generator)
        op.check_inputs(q, q_pos, k_codes, v_codes, k_scale, v_scale, pos)
        splits = op.default_num_splits(k_codes)
        ws = op.make_workspace(q, splits)
        fp8 = lambda: op.fp8_decode(q, q_pos, k_codes, v_codes, k_scale, v_scale, pos, workspace=ws)  # noqa: E731
        full = lambda: sdpa(q, full_k, full_v)  # noqa: E731
        scales = nbytes(k_scale, v_scale) if self.scale == "token" else 2 * 4 * (b if self.scale == "tensor"
                                                                                 else b * self.kv_heads)
        read = nbytes(k_codes, v_codes, pos) + scales
        row = {**self.shape(), "fmt": self.fmt, "scale": self.scale, "num_splits": splits,
               "sdpa_backend": full()[1],
               "fp8_ms": time_median(fp8, self.repeat, cuda, graph=True) * 1e3,
               "sdpa_ms": time_median(full, self.repeat, cuda, graph=True) * 1e3,
               "read_bytes": read, "full_bytes": nbytes(full_k, full_v)}
        del full_k, full_v  # room for the dequantized copy
        try:
            dequant = lambda: _dequantize_then_attend(q, k_codes, v_codes, k_scale, v_scale, dt)  # noqa: E731
            row["output_err"] = output_error(fp8().out, dequant())
            row["dequant_ms"] = time_median(dequant, self.repeat, cuda) * 1e3
            row["speedup_vs_dequant"] = row["dequant_ms"] / row["fp8_ms"]
        except torch.cuda.OutOfMemoryError:  # the baseline's dequantized copy alone does not fit
            row["dequant_ms"] = row["speedup_vs_dequant"] = None
        peak = hbm_peak_gbps(x.device)
        row["fp8_gbps"] = read / (row["fp8_ms"] / 1e3) / 1e9
        row["fp8_hbm_pct"] = percent_of(row["fp8_gbps"], peak)
        row["sdpa_hbm_pct"] = percent_of(row["full_bytes"] / (row["sdpa_ms"] / 1e3) / 1e9, peak)
        row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["fp8_ms"]
        row["compression_ratio"] = row["full_bytes"] / read
        step = model.Step(batch=b, context=n, heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
                          granularity=self.scale, fmt=self.fmt)
        estimate_beside(row, "fp8", model, "fp8 (fused)", step, row["fp8_ms"], (op.kernel._stage1_tuned,),
                        dtype=self.dtype)
        return row
