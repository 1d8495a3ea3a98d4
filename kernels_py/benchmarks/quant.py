"""One decode step of attention over a mixed-precision quantized KV cache
(kernels_py.ops.quant_decode: ZipVL's important tokens in 4 bits, the others
in 2, the newest `dense_len` tokens in the cache dtype) against

(i)   scaled_dot_product_attention over the full fp16 cache of the same
      length (FlashAttention forced where PyTorch has it for these shapes), and
(ii)  dequantize-then-attend: the segments dequantized to the cache dtype
      (kv_quant's dequantize kernel), concatenated with the dense segment, SDPA.

It also times kv_quant's quantize kernels on the whole cache (what ZipVL's
prefill pays once, and every reassessment pays for its block).

Cache: `length` tokens per sequence, a share `hi_share` of them in the 4-bit
segment and the rest in the 2-bit one (keys per channel, values per token,
groups of `group`), then `dense_len` tokens in the cache dtype; one query
token that sees every token. Bytes for GB/s and % of the HBM peak are those
the step must read: packed codes, fp16 scales and zeros, slot positions
(4 bytes a slot, for causality) and the dense K/V; the full cache's K/V for
SDPA. A size that does not fit the GPU is recorded as skipped; a
dequantize-then-attend path that alone does not fit leaves its columns empty.
On a GPU each row also gives the estimate's band (kernels_py.ops.estimate)
beside the measured time and appends it as a calibration point.
"""

from dataclasses import dataclass

import torch

from kernels_py.benchmarks.base import (
    ESTIMATE_ERROR, OUTPUT_ERROR, AttentionBenchmark, estimate_beside, estimate_columns, hbm_peak_gbps, nbytes,
    output_error, percent_of, sdpa, time_median,
)
from kernels_py.ops import kv_quant, quant_decode as op
from kernels_py.ops.quant_decode import model
from kernels_py.params import Rule, knob
from kernels_py.tables import Column


def _make(batch, length, dense_len, heads, kv_heads, head_dim, hi_share, group, dtype, device, g):
    """q, q_pos, [4-bit QuantKV, 2-bit QuantKV], DenseKV, the full K/V, and a
    function that quantizes the segments again (for timing)."""
    hi, lo = model.segment_slots(model.Step(batch=batch, context=length, hi_share=hi_share, group=group))
    k = torch.randn(batch, kv_heads, length + dense_len, head_dim, generator=g, device=device).to(dtype)
    v = torch.randn_like(k)
    segments, inputs, start = [], [], 0
    for bits, slots in ((4, hi), (2, lo)):
        used = min(slots, length - start)
        pad = slots - used
        ks, vs = k[:, :, start:start + used], v[:, :, start:start + used]  # views: no copy of the cache
        if pad:
            ks, vs = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (ks, vs))
        pos = torch.arange(start, start + slots, dtype=torch.int32, device=device).expand(batch, slots).contiguous()
        pos = torch.where(pos < start + used, pos, kv_quant.PAD_POS)
        length_t = torch.full((batch,), slots, dtype=torch.int32, device=device)
        segments.append(kv_quant.quantize(ks, vs, pos, length_t, bits=bits, group=group))
        inputs.append((ks, vs, pos, length_t, bits))
        start += used
    dense_pos = (length + torch.arange(dense_len, dtype=torch.int32, device=device)).expand(batch, dense_len)
    dense = op.DenseKV(k[:, :, length:].contiguous(), v[:, :, length:].contiguous(), dense_pos.contiguous(),
                       torch.full((batch,), dense_len, dtype=torch.int32, device=device))
    q = torch.randn(batch, heads, 1, head_dim, generator=g, device=device).to(dtype)
    q_pos = torch.full((batch, 1), length + dense_len, dtype=torch.int32, device=device)

    def requantize():
        for ks, vs, pos, length_t, bits in inputs:
            kv_quant.quantize(ks, vs, pos, length_t, bits=bits, group=group)

    return q, q_pos, [s for s in segments if s.slots], dense, k, v, requantize


def _dequantize_then_attend(q, segments, dense, dtype):
    """Every sequence of the benchmark's cache has the same padding slots
    (the tail of a segment's last group): drop them, then attend unmasked."""
    parts_k, parts_v = [], []
    for seg in segments:
        k, v = kv_quant.dequantize(seg)
        real = (seg.pos[0] != kv_quant.PAD_POS).nonzero()[:, 0]
        parts_k.append(k.index_select(2, real).to(dtype))
        parts_v.append(v.index_select(2, real).to(dtype))
    return sdpa(q, torch.cat(parts_k + [dense.k], 2), torch.cat(parts_v + [dense.v], 2))[0]


@dataclass(frozen=True)
class Quant(AttentionBenchmark):
    """Mixed-precision (4/2-bit) quantized decode attention vs SDPA on the fp16 cache and vs dequantize-then-SDPA."""

    name = "quant"
    length_column = "context"
    columns = (
        Column("context", "", "quantized tokens per sequence", "context"),
        Column("batch", "", "sequences"),
        *AttentionBenchmark.SHAPE_COLUMNS,
        Column("hi_share", "", "share of the tokens in 4 bits (the rest in 2)", "4-bit share"),
        Column("group", "", "quantization group size", show=False),
        Column("dense_len", "", "newest tokens in the cache dtype", show=False),
        Column("num_splits", "", "split-K splits per (sequence, kv head)", show=False),
        Column("sdpa_backend", "", "SDPA backend of the baselines", show=False),
        Column("quant_ms", "ms", "the quantized decode kernel (dequantizes in registers), median", "quant"),
        Column("quant_gbps", "GB/s", "bytes the step reads / quant time", "GB/s"),
        Column("quant_hbm_pct", "%", "quant_gbps as a share of the GPU's HBM bandwidth", "% HBM"),
        Column("dequant_ms", "ms", "dequantize to the cache dtype, then SDPA", "dequant+SDPA"),
        Column("quantize_ms", "ms", "quantize and pack the whole cache (both segments), kv_quant's kernels",
               "quantize"),
        Column("sdpa_ms", "ms", "SDPA over the full cache in the cache dtype", "SDPA"),
        Column("sdpa_hbm_pct", "%", "full K/V bytes / SDPA time, as a share of the HBM bandwidth", show=False),
        Column("speedup_vs_sdpa", "x", "SDPA time / quant time (above 1: the quantized kernel is faster)",
               "SDPA/quant"),
        Column("speedup_vs_dequant", "x", "dequantize-then-attend time / quant time", "dequant/quant"),
        Column("read_bytes", "bytes", "bytes the quantized step reads", show=False),
        Column("full_bytes", "bytes", "bytes of the full cache", show=False),
        Column("compression_ratio", "x", "full K/V bytes / quantized cache bytes", "compression"),
        *estimate_columns("quant", "the quantized decode call"),
        ESTIMATE_ERROR,
        OUTPUT_ERROR,
    )
    smoke = ({"lengths": (96,)}, {"batches": (1,)}, {"heads": 4, "kv_heads": 2, "head_dim": 64},
             {"group": 32}, {"dense_len": 8}, {"dtype": "float32"}, {"repeat": 1})

    lengths: tuple = knob("ints", (2048, 8192, 32768, 131072), "quantized tokens per sequence", min=1, max=1 << 24)
    batches: tuple = knob("ints", (1, 8, 32, 64), "batch sizes", min=1, max=4096)
    hi_share: float = knob("float", 0.25, "share of the tokens in 4 bits, the rest in 2 (ZipVL's important tokens; "
                           "sweep 0.1..0.5)", min=0.0, max=1.0, ref="ZipVL section 4.2")
    group: int = knob("int", 64, "quantization group size: slots per key scale, channels per value scale",
                      choices=kv_quant.GROUPS)
    dense_len: int = knob("int", 64, "newest tokens kept in the cache dtype (ZipVL quantizes every 100)", min=1,
                          max=1 << 20)

    RULES = AttentionBenchmark.RULES + (
        Rule("head_dim % group == 0", "group ({group}) must divide head_dim ({head_dim}): values are quantized per "
             "token in groups of channels"),
    )

    def measure(self, case):
        x = self.inputs(case)
        n, b, cuda, dt = x.tokens, x.batch, x.cuda, x.dtype
        q, q_pos, segments, dense, full_k, full_v, requantize = _make(b, n, self.dense_len, self.heads, self.kv_heads,
                                                          self.head_dim, self.hi_share, self.group, dt, x.device,
                                                          x.generator)
        op.check_inputs(q, q_pos, segments, dense)  # once: the timed calls skip the value checks
        splits = op.default_num_splits(segments, dense)
        ws = op.make_workspace(q, splits)
        quant = lambda: op.quant_decode(q, q_pos, segments, dense, workspace=ws, check_values=False)  # noqa: E731
        full = lambda: sdpa(q, full_k, full_v)  # noqa: E731
        read = sum(s.nbytes + nbytes(s.pos) for s in segments) + nbytes(dense.k, dense.v, dense.pos)
        row = {"dense_len": self.dense_len, **self.shape(), "hi_share": self.hi_share, "group": self.group,
               "num_splits": splits, "sdpa_backend": full()[1],
               "quant_ms": time_median(quant, self.repeat, cuda, graph=True) * 1e3,
               "sdpa_ms": time_median(full, self.repeat, cuda, graph=True) * 1e3,
               "quantize_ms": time_median(requantize, self.repeat, cuda) * 1e3,
               "read_bytes": read, "full_bytes": nbytes(full_k, full_v)}
        try:
            dequant = lambda: _dequantize_then_attend(q, segments, dense, dt)  # noqa: E731
            row["output_err"] = output_error(quant().out, dequant())
            row["dequant_ms"] = time_median(dequant, self.repeat, cuda) * 1e3
            row["speedup_vs_dequant"] = row["dequant_ms"] / row["quant_ms"]
        except torch.cuda.OutOfMemoryError:  # the baseline's dequantized copy alone does not fit
            row["dequant_ms"] = row["speedup_vs_dequant"] = None
        peak = hbm_peak_gbps(x.device)
        row["quant_gbps"] = read / (row["quant_ms"] / 1e3) / 1e9
        row["quant_hbm_pct"] = percent_of(row["quant_gbps"], peak)
        row["sdpa_hbm_pct"] = percent_of(row["full_bytes"] / (row["sdpa_ms"] / 1e3) / 1e9, peak)
        row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["quant_ms"]
        row["compression_ratio"] = row["full_bytes"] / read
        step = model.Step(batch=b, context=n, dense=self.dense_len, heads=self.heads, kv_heads=self.kv_heads,
                          head_dim=self.head_dim, hi_share=self.hi_share, group=self.group, splits=splits)
        estimate_beside(row, "quant", model, "quantized (4/2-bit)", step, row["quant_ms"],
                        (op.kernel._stage1_tuned,), dtype=self.dtype)
        return row
