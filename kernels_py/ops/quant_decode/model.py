"""What one decode step over a mixed-precision quantized cache must move
and compute, and the time that sets on an H100: the roofline the quantized
decode kernel is designed to ("ideal": `workbench kernels report` prints
it; measured times come from `workbench bench quant`), and what each launch
does, for the estimate from the compiled code (`workbench kernels report
--estimate`), which counts the dequantization the kernel really issues.

Per token and kv head (head_dim 128, group 64): 4-bit K and V codes are
2 * 128 / 2 = 128 bytes, 2-bit ones 64; key scales and zeros (per channel,
one pair per group of G tokens) 2 * 2 * 128 / 64 = 8 bytes a token, value
scales and zeros (per token, one pair per G channels) 2 * 2 * 128 / 64 = 8.
With 25% of the tokens in 4 bits that is 96 bytes against the fp16 cache's
512, plus the slot positions (4 bytes a token, shared by the kv heads).

Dequantization is work on the CUDA cores, once per (token, kv head,
channel) for K and V; what it costs is what the compiled code issues for
it, so the ideal leaves it out and the estimate's instruction count has it.
The attention dots run on tensor cores.
"""

from dataclasses import dataclass

from kernels_py.ops import estimate, splitk
from kernels_py.ops.estimate import H100
from kernels_py.ops.kv_quant.contract import BITS, GROUPS
from kernels_py.ops.quant_decode import kernel
from kernels_py.tables import Column, table

# The fields of Step that take only some values, checked as `--shape` sets them (else the codec's own error
# named bits=3 for --shape hi_bits=3).
CHOICES = {"hi_bits": BITS, "lo_bits": BITS, "group": GROUPS}


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
    splits: int = 0  # splits per (sequence, kv head) the step ran with; 0: the launcher's default (kernel.split_count)

    def __post_init__(self):
        if not 0 <= self.splits <= splitk.MAX_SPLITS:
            raise ValueError(f"splits={self.splits} must be in [0, {splitk.MAX_SPLITS}] (0: the default)")


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
        "flash, full cache": {"bytes": b * (t + n) * 2 * hk * d * 2, "flops": b * hq * (t + n) * 4 * d},
        "quantized (4/2-bit)": {"bytes": b * t * per_token_bytes(s)["quantized"] + dense_bytes,
                                "flops": b * hk * group_rows * (t + n) * 4 * d},
    }


def roofline_us(cost: dict) -> tuple[float, str]:
    return estimate.roofline(cost["bytes"], cost["flops"])


COLUMNS = (
    Column("context", "", "quantized tokens per sequence"),
    Column("batch", "", "sequences"),
    Column("variant", "", "implementation"),
    Column("gbytes", "", "HBM gigabytes one step must read", "GB"),
    Column("roofline_us", "", "microseconds: the longer of bytes / 3.35 TB/s and FLOPs / 989 TFLOP/s (the "
           "dequantization the kernel issues is in `kernels report --estimate`)", "ideal µs"),
    Column("bound", "", "what sets the roofline"),
    Column("speedup_vs_flash", "x", "ideal: flash time / this time", "vs flash"),
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
                         "roofline_us": us, "bound": bound,
                         "speedup_vs_flash": flash_us / us})
    s = shapes[0]
    per = per_token_bytes(s)
    return {"title": f"one decode step over a quantized cache on an H100, ideal at the peaks ({s.heads} q / "
                     f"{s.kv_heads} kv heads, head_dim {s.head_dim}, {s.hi_share:.0%} of the tokens in {s.hi_bits} "
                     f"bits, the rest in {s.lo_bits}, group {s.group}; {per['full']} bytes a token in the fp16 cache, "
                     f"{per['quantized']:g} quantized)",
            **table(COLUMNS, rows)}


# ----------------------------------------------------------------------------
# What each launch does, for the estimate from the compiled code
# ----------------------------------------------------------------------------

ESTIMATE_SHAPES = (Step(batch=8, context=32768), Step(batch=64, context=32768))


def segment_slots(s: Step) -> tuple[int, int]:
    """Slots of the 4-bit and the 2-bit segment, whole groups (as `bench
    quant` lays the cache out)."""
    whole = lambda n: -(-n // s.group) * s.group  # noqa: E731 (n rounded up to whole groups)
    # Capped at the context in whole groups, not at the context itself: a
    # share that rounds up past a context of no whole number of groups
    # (5 tokens, groups of 32) pads the last group instead.
    hi = min(whole(s.context), whole(int(s.hi_share * s.context + 0.5)))
    lo = whole(max(0, s.context - hi))
    return hi, lo


def _call(s: Step):
    """quant_decode on tiny CPU segments with the step's specialization
    (built as zeros of the layout's shapes: no quantize launch)."""
    import torch

    from kernels_py.ops.kv_quant.contract import QuantKV, shapes
    from kernels_py.ops.quant_decode.contract import DenseKV

    batch, slots = 2, 2 * s.group
    segments = []
    for i, bits in enumerate((s.hi_bits, s.lo_bits)):
        shp = shapes(batch, s.kv_heads, slots, s.head_dim, bits, s.group)
        tensors = {name: torch.zeros(shape, dtype=torch.int32 if name in ("k_codes", "v_codes", "pos", "length")
                                     else torch.float16) for name, shape in shp.items()}
        tensors["pos"] = (i * slots + torch.arange(slots, dtype=torch.int32)).repeat(batch, 1)
        tensors["length"] = torch.full((batch,), slots, dtype=torch.int32)
        segments.append(QuantKV(**tensors, bits=bits, group=s.group))
    dense = DenseKV(torch.zeros(batch, s.kv_heads, s.dense, s.head_dim, dtype=torch.float16),
                    torch.zeros(batch, s.kv_heads, s.dense, s.head_dim, dtype=torch.float16),
                    (2 * slots + torch.arange(s.dense, dtype=torch.int32)).repeat(batch, 1),
                    torch.full((batch,), s.dense, dtype=torch.int32))
    q = torch.zeros(batch, s.heads, 1, s.head_dim, dtype=torch.float16)
    q_pos = torch.full((batch, 1), 2 * slots + s.dense, dtype=torch.int32)
    # Two splits where the step has several: with the tiny cache's one, the
    # merge's split count compiles as the constant 1 and its loop over the
    # splits is gone.
    kernel.quant_decode(q, q_pos, segments, dense, check_values=False, num_splits=min(2, _splits(s, H100)))


def _splits(s: Step, gpu) -> int:
    """Splits per (sequence, kv head) of the step's call on `gpu`, as the launcher counts them."""
    return s.splits or kernel.split_count(sum(segment_slots(s)) + s.dense, s.batch * s.kv_heads, gpu.sms)


def _work(s: Step, kernel_name: str, meta: dict, gpu) -> estimate.Work:
    b, hq, hk, d = s.batch, s.heads, s.kv_heads, s.head_dim
    hi, lo = segment_slots(s)
    total = hi + lo + s.dense
    splits = _splits(s, gpu)
    tokens = b * (s.context + s.dense)
    part_bytes = b * hq * splits * (d + 1) * 4
    if kernel_name == "_stage1_kernel":
        block_n = min(int(meta["TILE"]), int(meta["TILE_MAX"]))
        classes: dict = {}
        for lo_, hi_ in splitk.split_ranges(total, splits, block_n):
            def seg(start, length):
                return (min(max(lo_ - start, 0), length), min(max(hi_ - start, 0), length))
            key = tuple(hi_ - lo_ for lo_, hi_ in (seg(0, hi), seg(hi, lo), seg(hi + lo, s.dense)))
            classes[key] = classes.get(key, 0) + 1  # splits with the same slots of each segment
        programs = tuple(estimate.Programs(n * b * hk, {"a_lo": 0, "a_hi": k[0], "b_lo": 0, "b_hi": k[1],
                                                        "d_lo": 0, "d_hi": k[2], "BLOCK_N": block_n})
                         for k, n in classes.items())  # BLOCK_N: the kernel derives it from TILE, TILE_MAX
        read = b * s.context * per_token_bytes(s)["quantized"] + b * s.dense * (2 * hk * d * 2 + 4)
        levels = {"Q": "l2", "QPos": "l2", "ALen": "l2", "BLen": "l2", "DLen": "l2"}
        return estimate.Work(programs, read + part_bytes, levels, b * hq * (s.context + s.dense) * 4 * d, tokens)
    if kernel_name == "_merge_kernel":
        small = "l2" if part_bytes < gpu.l2_bytes / 2 else "hbm"
        return estimate.Work((estimate.Programs(b * hq, {"n_splits": splits}),), part_bytes + b * hq * (d * 2 + 4),
                             {"PartO": small, "PartLse": small}, 0.0, tokens)
    raise KeyError(f"the quant_decode model knows no kernel {kernel_name!r}")


ESTIMATES = (estimate.Implementation("quantized (4/2-bit)", _call, _work,
                                     lambda s: (s.heads, s.kv_heads, s.head_dim, s.hi_bits, s.lo_bits, s.group,
                                                s.dense, _splits(s, H100) > 1)),)


def flash_bytes(s: Step) -> float:
    return costs(s)["flash, full cache"]["bytes"]


def ideal_us(s: Step) -> dict:
    return {name: roofline_us(cost)[0] for name, cost in costs(s).items()}
