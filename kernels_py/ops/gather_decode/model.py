"""What one decode step over selected rows must move, and the time that sets
on an H100: the roofline the selected-row kernel is designed to (`workbench
kernels report` prints it; measured times come from `workbench bench
gather`), and what each launch does, for the estimate from the compiled
code (`workbench kernels report --estimate`). Per listed row and kv head (head_dim 128, fp16): K and V are
2 * 128 * 2 = 512 bytes, plus its index and position (4 bytes each); the
full cache is 512 bytes a row and kv head, all rows. Memory-bound: the
dots are GROUP x D per row on tensor cores."""

from dataclasses import dataclass

from kernels_py.ops import estimate, splitk
from kernels_py.ops.estimate import H100
from kernels_py.ops.gather_decode import kernel
from kernels_py.tables import Column, table


@dataclass(frozen=True)
class Step:
    batch: int
    context: int
    share: float = 0.2  # rows each kv head lists
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128


def costs(s: Step) -> dict[str, dict]:
    row = 2 * s.head_dim * 2  # K and V of one row and kv head, fp16
    rows = round(s.share * s.context)
    group_rows = max(16, s.heads // s.kv_heads)
    return {
        "flash, all rows": {"bytes": s.batch * s.kv_heads * s.context * row,
                            "flops": s.batch * s.heads * s.context * 4 * s.head_dim},
        "selected rows": {"bytes": s.batch * s.kv_heads * rows * (row + 8),
                          "flops": s.batch * s.kv_heads * group_rows * rows * 4 * s.head_dim},
        "slice, then flash": {"bytes": s.batch * s.kv_heads * rows * (3 * row + 8),  # read, write the copy, read it
                              "flops": s.batch * s.heads * rows * 4 * s.head_dim},
    }


def roofline_us(cost: dict) -> float:
    return estimate.roofline(cost["bytes"], cost["flops"])[0]


COLUMNS = (
    Column("context", "", "cached tokens per sequence"),
    Column("batch", "", "sequences"),
    Column("variant", "", "implementation"),
    Column("gbytes", "", "HBM gigabytes one step moves", "GB"),
    Column("roofline_us", "", "microseconds: max(bytes / 3.35 TB/s, FLOPs / 989 TFLOP/s)", "ideal µs"),
    Column("speedup_vs_flash", "x", "ideal: flash-over-all time / this time", "vs flash"),
)

SHAPES = (Step(batch=1, context=2048), Step(batch=8, context=16384), Step(batch=64, context=16384))


def report(shapes=SHAPES) -> dict:
    rows = []
    for s in shapes:
        c = costs(s)
        flash = roofline_us(c["flash, all rows"])
        for variant, cost in c.items():
            us = roofline_us(cost)
            rows.append({"context": s.context, "batch": s.batch, "variant": variant, "gbytes": cost["bytes"] / 1e9,
                         "roofline_us": us, "speedup_vs_flash": flash / us})
    s = shapes[0]
    return {"title": f"one decode step over {s.share:.0%} of the rows on an H100, ideal at the peaks ({s.heads} q / "
                     f"{s.kv_heads} kv heads, head_dim {s.head_dim}, fp16)", **table(COLUMNS, rows)}


# ----------------------------------------------------------------------------
# What each launch does, for the estimate from the compiled code
# ----------------------------------------------------------------------------

ESTIMATE_SHAPES = (Step(batch=8, context=32768), Step(batch=64, context=32768))


def _call(s: Step):
    """gather_decode on tiny CPU tensors with the step's specialization."""
    import torch

    batch, slots = 2, 64
    k = torch.zeros(batch, s.kv_heads, slots, s.head_dim, dtype=torch.float16)
    index = torch.arange(32, dtype=torch.int32).repeat(batch, s.kv_heads, 1)
    count = torch.full((batch, s.kv_heads), 32, dtype=torch.int32)
    # Two splits where the step has several: with the tiny cache's one, the
    # merge's split count compiles as the constant 1 and its loop over the
    # splits is gone.
    kernel.gather_decode(torch.zeros(batch, s.heads, 1, s.head_dim, dtype=torch.float16),
                         torch.full((batch, 1), slots, dtype=torch.int32), k, torch.zeros_like(k),
                         torch.arange(slots, dtype=torch.int32).repeat(batch, 1), index, count, check_values=False,
                         num_splits=min(2, _splits(s, H100)))


def _splits(s: Step, gpu) -> int:
    """Splits per (sequence, kv head) of the step's call on `gpu`, as the launcher counts them."""
    return kernel.split_count(round(s.share * s.context), s.batch * s.kv_heads, gpu.sms)


def _work(s: Step, kernel_name: str, meta: dict, gpu) -> estimate.Work:
    b, hq, hk, d = s.batch, s.heads, s.kv_heads, s.head_dim
    rows = round(s.share * s.context)
    splits = _splits(s, gpu)
    part_bytes = b * hq * splits * (d + 1) * 4
    tokens = b * s.context
    if kernel_name == "_stage1_kernel":
        classes: dict = {}
        for lo, hi in splitk.split_ranges(rows, splits, int(meta["BLOCK_N"])):
            classes[hi - lo] = classes.get(hi - lo, 0) + 1  # splits with the same rows
        programs = tuple(estimate.Programs(n * b * hk, {"lo": 0, "hi": rows_}) for rows_, n in classes.items())
        read = costs(s)["selected rows"]["bytes"]
        return estimate.Work(programs, read + part_bytes, {"Q": "l2", "QPos": "l2", "Count": "l2"},
                             b * hq * rows * 4 * d, tokens)
    if kernel_name == "_merge_kernel":
        small = "l2" if part_bytes < gpu.l2_bytes / 2 else "hbm"
        return estimate.Work((estimate.Programs(b * hq, {"n_splits": splits}),), part_bytes + b * hq * (d * 2 + 4),
                             {"PartO": small, "PartLse": small}, 0.0, tokens)
    raise KeyError(f"the gather_decode model knows no kernel {kernel_name!r}")


ESTIMATES = (estimate.Implementation("selected rows", _call, _work, lambda s: (s.heads, s.kv_heads, s.head_dim,
                                                                                _splits(s, H100) > 1)),)


def flash_bytes(s: Step) -> float:
    return costs(s)["flash, all rows"]["bytes"]


def ideal_us(s: Step) -> dict:
    return {name: roofline_us(cost) for name, cost in costs(s).items()}
