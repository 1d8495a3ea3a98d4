"""What one decode step over a mixed-precision quantized cache must move and
compute, and the time that sets on an H100: the roofline the quantized decode
kernel is designed to (`workbench kernels report` prints it; measured times
come from `workbench bench quant`).

Per token and kv head (head_dim 128, group 64): 4-bit K and V codes are
2 * 128 / 2 = 128 bytes, 2-bit ones 64; key scales and zeros (per channel,
one pair per group of G tokens) 2 * 2 * 128 / 64 = 8 bytes a token, value
scales and zeros (per token, one pair per G channels) 2 * 2 * 128 / 64 = 8.
With 25% of the tokens in 4 bits that is 96 bytes against the fp16 cache's
512, plus the slot positions (4 bytes a token, shared by the kv heads).

Dequantization is work on the CUDA cores, once per (token, kv head, channel)
for K and V (the query heads of a kv head share the tile): shift, mask, OR
with the magic exponent, subtract, multiply-add: about 5 instructions an
element, counted against the H100's 67 TFLOP/s of fp32 (an upper bound on
the integer rate as well). The attention dots run on tensor cores.
"""

from dataclasses import dataclass

from kernels_py.ops.lowrank_decode.model import H100_FP16_FLOPS, H100_HBM_BYTES_PER_S
from kernels_py.tables import Column, table

H100_FP32_OPS = 67e12  # non-tensor fp32 (and roughly int32) operations per second
DEQUANT_OPS_PER_ELEMENT = 5


@dataclass(frozen=True)
class Step:
    """One decode step (one query token per sequence)."""

    batch: int
    context: int  # quantized tokens per sequence
    dense: int = 64  # fp16 tokens per sequence
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    hi_share: float = 0.25
    hi_bits: int = 4
    lo_bits: int = 2
    group: int = 64


def per_token_bytes(s: Step) -> dict:
    """Bytes per quantized token: the fp16 cache's K and V, and the quantized
    one's codes, scales and zeros over all kv heads plus its position."""
    bits = s.hi_share * s.hi_bits + (1 - s.hi_share) * s.lo_bits
    codes = 2 * s.head_dim * bits / 8
    scales = 2 * 2 * s.head_dim / s.group + 2 * 2 * s.head_dim / s.group  # key and value (scale, zero) pairs
    return {"full": 2 * s.kv_heads * s.head_dim * 2, "quantized": s.kv_heads * (codes + scales) + 4}


def costs(s: Step) -> dict[str, dict]:
    b, t, n, hq, hk, d = s.batch, s.context, s.dense, s.heads, s.kv_heads, s.head_dim
    dense_bytes = b * n * 2 * hk * d * 2
    group_rows = max(16, hq // hk)  # a program's rows: the query heads of a kv head, padded for tl.dot
    return {
        "flash, full cache": {"bytes": b * (t + n) * 2 * hk * d * 2, "flops": b * hq * (t + n) * 4 * d, "alu": 0},
        "quantized (4/2-bit)": {"bytes": b * t * per_token_bytes(s)["quantized"] + dense_bytes,
                                "flops": b * hk * group_rows * (t + n) * 4 * d,
                                "alu": b * t * hk * 2 * d * DEQUANT_OPS_PER_ELEMENT},
    }


def roofline_us(cost: dict) -> tuple[float, str]:
    """The longest of the step's bytes at the HBM peak, its tensor-core FLOPs
    and its dequantization work on the CUDA cores, and which it is."""
    times = {"memory": cost["bytes"] / H100_HBM_BYTES_PER_S, "tensor cores": cost["flops"] / H100_FP16_FLOPS,
             "dequantization": cost["alu"] / H100_FP32_OPS}
    bound = max(times, key=times.get)
    return times[bound] * 1e6, bound


COLUMNS = (
    Column("context", "", "quantized tokens per sequence"),
    Column("batch", "", "sequences"),
    Column("variant", "", "implementation"),
    Column("gbytes", "", "HBM gigabytes one step must read", "GB"),
    Column("dequant_gops", "", "giga-operations of in-register dequantization", "dequant Gop"),
    Column("roofline_us", "", "microseconds: the longest of bytes / 3.35 TB/s, FLOPs / 989 TFLOP/s and "
           "dequantization / 67 Top/s", "roofline µs"),
    Column("bound", "", "what sets the roofline"),
    Column("speedup_vs_flash", "x", "modeled: flash time / this time", "vs flash"),
)

SHAPES = (Step(batch=1, context=2048), Step(batch=8, context=32768), Step(batch=64, context=32768))


def report(shapes=SHAPES) -> dict:
    rows = []
    for s in shapes:
        c = costs(s)
        flash_us, _ = roofline_us(c["flash, full cache"])
        for variant, cost in c.items():
            us, bound = roofline_us(cost)
            rows.append({"context": s.context, "batch": s.batch, "variant": variant, "gbytes": cost["bytes"] / 1e9,
                         "dequant_gops": cost["alu"] / 1e9, "roofline_us": us, "bound": bound,
                         "speedup_vs_flash": flash_us / us})
    s = shapes[0]
    per = per_token_bytes(s)
    return {"title": f"one decode step over a quantized cache on an H100, modeled ({s.heads} q / {s.kv_heads} kv "
                     f"heads, "
                     f"head_dim {s.head_dim}, {s.hi_share:.0%} of the tokens in {s.hi_bits} bits, the rest in "
                     f"{s.lo_bits}, group {s.group}; {per['full']} bytes a token in the fp16 cache, "
                     f"{per['quantized']:g} quantized)",
            **table(COLUMNS, rows)}
