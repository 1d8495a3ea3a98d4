"""What one decode step over an FP8 KV cache must move, and the time that
sets on an H100: the roofline the FP8 decode kernel is designed to
("ideal": `workbench kernels report` prints it; measured times come from
`workbench bench fp8`), and what each launch does, for the estimate from
the compiled code (`workbench kernels report --estimate`).

Per token and kv head (head_dim 128): the fp16 cache's K and V are
2 * 128 * 2 = 512 bytes, the fp8 codes 256, per-token scales 2 * 4 = 8 more
(per-head and per-tensor scales are a few bytes per layer), plus the slot
positions (4 bytes a token, shared by the kv heads). So the bytes allow
2x over FlashAttention on the fp16 cache (1.94x with per-token scales).
Dequantizing first (the unfused path) reads the codes, writes an fp16 copy
and reads it again: 2.5x FlashAttention's bytes.

The conversion is work on the CUDA cores, once per (token, kv head,
channel) for K and V; what it costs is what the compiled code issues for
it, so the ideal leaves it out and the estimate's instruction count has it.
The attention dots run on tensor cores.
"""

from dataclasses import dataclass

from kernels_py.ops import estimate, splitk
from kernels_py.ops.estimate import H100
from kernels_py.ops.fp8_decode import codec, kernel
from kernels_py.tables import Column, table

# The word-valued fields of Step (`--shape granularity=token,fmt=e5m2`).
CHOICES = {"granularity": codec.GRANULARITIES, "fmt": tuple(codec.FORMATS)}


@dataclass(frozen=True)
class Step:
    """One decode step (one query token per sequence)."""

    batch: int
    context: int  # cached tokens per sequence
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    granularity: str = "tensor"  # scales: tensor, head or token
    fmt: str = "e4m3"


def per_token_bytes(s: Step) -> dict:
    """Bytes per cached token over all kv heads: the fp16 cache's K and V,
    and the fp8 cache's codes, per-token scales and position."""
    scales = 2 * 4 if s.granularity == "token" else 0
    return {"full": 2 * s.kv_heads * s.head_dim * 2, "fp8": s.kv_heads * (2 * s.head_dim + scales) + 4}


def costs(s: Step) -> dict[str, dict]:
    b, t, hq, hk, d = s.batch, s.context, s.heads, s.kv_heads, s.head_dim
    group_rows = max(16, hq // hk)  # a program's rows: the query heads of a kv head, padded for tl.dot
    per = per_token_bytes(s)
    return {
        "flash, fp16 cache": {"bytes": b * t * per["full"], "flops": b * hq * t * 4 * d},
        "fp8 (fused)": {"bytes": b * t * per["fp8"], "flops": b * hk * group_rows * t * 4 * d},
        "dequantize, then flash": {"bytes": b * t * (per["fp8"] + 2 * per["full"]), "flops": b * hq * t * 4 * d},
    }


def roofline_us(cost: dict) -> tuple[float, str]:
    return estimate.roofline(cost["bytes"], cost["flops"])


COLUMNS = (
    Column("context", "", "cached tokens per sequence"),
    Column("batch", "", "sequences"),
    Column("variant", "", "implementation"),
    Column("gbytes", "", "HBM gigabytes one step moves", "GB"),
    Column("roofline_us", "", "microseconds: the longer of bytes / 3.35 TB/s and FLOPs / 989 TFLOP/s (the "
           "conversion the kernel issues is in `kernels report --estimate`)", "ideal µs"),
    Column("bound", "", "what sets the roofline"),
    Column("speedup_vs_flash", "x", "ideal: flash time / this time", "vs flash"),
)

SHAPES = (Step(batch=1, context=2048), Step(batch=8, context=32768), Step(batch=64, context=32768))


def report(shapes=SHAPES) -> dict:
    rows = []
    for s in shapes:
        c = costs(s)
        flash_us, _ = roofline_us(c["flash, fp16 cache"])
        for variant, cost in c.items():
            us, bound = roofline_us(cost)
            rows.append({"context": s.context, "batch": s.batch, "variant": variant, "gbytes": cost["bytes"] / 1e9,
                         "roofline_us": us, "bound": bound, "speedup_vs_flash": flash_us / us})
    s = shapes[0]
    per = per_token_bytes(s)
    return {"title": f"one decode step over an fp8 ({s.fmt}, per-{s.granularity} scales) cache on an H100, ideal at "
                     f"the peaks ({s.heads} q / {s.kv_heads} kv heads, head_dim {s.head_dim}; {per['full']} bytes "
                     f"a token in the fp16 cache, {per['fp8']} in fp8)",
            **table(COLUMNS, rows)}


# ----------------------------------------------------------------------------
# What each launch does, for the estimate from the compiled code
# ----------------------------------------------------------------------------

ESTIMATE_SHAPES = (Step(batch=8, context=32768), Step(batch=64, context=32768),
                   Step(batch=8, context=32768, granularity="token"), Step(batch=64, context=32768,
                                                                           granularity="token"))


def _call(s: Step):
    """fp8_decode on tiny CPU tensors with the step's specialization."""
    import torch

    from kernels_py.ops.fp8_decode import codec

    batch, slots = 2, 128 if s.context % 128 == 0 else 64  # whole tiles where the step's length has them
    k = torch.zeros(batch, s.kv_heads, slots, s.head_dim, dtype=codec.code_dtype(s.fmt))
    v = codec.values_layout(torch.zeros_like(k))
    shape = (batch, s.kv_heads, slots) if s.granularity == "token" else (batch, s.kv_heads)
    scale = torch.ones(shape, dtype=torch.float32)
    # Two splits where the step has several: with the tiny cache's one, the
    # merge's split count compiles as the constant 1 and its loop over the
    # splits is gone.
    kernel.fp8_decode(torch.zeros(batch, s.heads, 1, s.head_dim, dtype=torch.float16),
                      torch.full((batch, 1), slots, dtype=torch.int32), k, v, scale, scale,
                      torch.arange(slots, dtype=torch.int32).repeat(batch, 1), num_splits=min(2, _splits(s, H100)))


def _splits(s: Step, gpu) -> int:
    """Splits per (sequence, kv head) of the step's call on `gpu`, as the launcher counts them."""
    return kernel.split_count(s.context, s.batch * s.kv_heads, gpu.sms)


def _work(s: Step, kernel_name: str, meta: dict, gpu) -> estimate.Work:
    b, hq, hk, d = s.batch, s.heads, s.kv_heads, s.head_dim
    splits = _splits(s, gpu)
    part_bytes = b * hq * splits * (d + 1) * 4
    tokens = b * s.context
    if kernel_name == "_stage1_kernel":
        classes: dict = {}
        for lo, hi in splitk.split_ranges(s.context, splits, int(meta["BLOCK_N"])):
            classes[hi - lo] = classes.get(hi - lo, 0) + 1  # splits with the same slots
        programs = tuple(estimate.Programs(n * b * hk, {"lo": 0, "hi": slots}) for slots, n in classes.items())
        read = costs(s)["fp8 (fused)"]["bytes"]
        levels = {"Q": "l2", "QPos": "l2", "Pos": "l2"}  # positions: shared by the kv heads' programs
        if s.granularity != "token":
            levels.update(KS="l2", VS="l2")
        return estimate.Work(programs, read + part_bytes, levels, b * hq * s.context * 4 * d, tokens)
    if kernel_name == "_merge_kernel":
        small = "l2" if part_bytes < gpu.l2_bytes / 2 else "hbm"
        return estimate.Work((estimate.Programs(b * hq, {"n_splits": splits}),), part_bytes + b * hq * (d * 2 + 4),
                             {"PartO": small, "PartLse": small}, 0.0, tokens)
    raise KeyError(f"the fp8_decode model knows no kernel {kernel_name!r}")



ESTIMATES = (estimate.Implementation("fp8 (fused)", _call, _work,
                                     lambda s: (s.heads, s.kv_heads, s.head_dim, s.granularity, s.fmt,
                                                _splits(s, H100) > 1)),)


def flash_bytes(s: Step) -> float:
    return costs(s)["flash, fp16 cache"]["bytes"]


def ideal_us(s: Step) -> dict:
    return {name: roofline_us(cost)[0] for name, cost in costs(s).items()}
