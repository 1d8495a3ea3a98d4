"""What one decode step over selected rows must move, and the time that sets
on an H100: the roofline the selected-row kernel is designed to (`workbench
kernels report` prints it; measured times come from `workbench bench
gather`). Per listed row and kv head (head_dim 128, fp16): K and V are
2 * 128 * 2 = 512 bytes, plus its index and position (4 bytes each); the
full cache is 512 bytes a row and kv head, all rows. Memory-bound: the
dots are GROUP x D per row on tensor cores."""

from dataclasses import dataclass

from kernels_py.ops.lowrank_decode.model import H100_FP16_FLOPS, H100_HBM_BYTES_PER_S
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
    return max(cost["bytes"] / H100_HBM_BYTES_PER_S, cost["flops"] / H100_FP16_FLOPS) * 1e6


COLUMNS = (
    Column("context", "", "cached tokens per sequence"),
    Column("batch", "", "sequences"),
    Column("variant", "", "implementation"),
    Column("gbytes", "", "HBM gigabytes one step moves", "GB"),
    Column("roofline_us", "", "microseconds: max(bytes / 3.35 TB/s, FLOPs / 989 TFLOP/s)", "roofline µs"),
    Column("speedup_vs_flash", "x", "modeled: flash-over-all time / this time", "vs flash"),
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
    return {"title": f"one decode step over {s.share:.0%} of the rows on an H100, modeled ({s.heads} q / {s.kv_heads} "
                     f"kv heads, head_dim {s.head_dim}, fp16)", **table(COLUMNS, rows)}
