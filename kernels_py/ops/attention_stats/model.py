"""What the attention statistics of a prompt's selected rows must move and
compute, and the time that sets on an H100: the roofline of the two passes
(`workbench kernels report` prints it; measured times come from `workbench
bench stats`), and what each launch does, for the estimate from the
compiled code (`workbench kernels report --estimate`).

The baseline is one FlashAttention forward over the same rows (what `bench
stats` times): it reads K and V once. The statistics read K twice, once
for the row max and sum and once for the column sums (a column's sum needs
every row's final max and sum, so there is no single pass), and write
per-head results: attention sum and ThresholdFilter count (4 + 4 bytes a
key and query head), the group's sum (4 bytes a key and kv head) and the
visible-row count (4 bytes a key). Per key and kv head at 32 query / 8 kv
heads, head_dim 128, fp16: 2 * 256 = 512 bytes of K against
FlashAttention's 512 of K and V, plus 4 * 8 + 4 (+ 4 / kv heads) of
results, so even at the same share of the HBM peak the statistics take
about 7% longer than FlashAttention's forward.
"""

import bisect
import functools
from dataclasses import dataclass

from kernels_py.ops import estimate, splitk
from kernels_py.ops.attention_stats import kernel
from kernels_py.ops.attention_stats.contract import probe_rows
from kernels_py.ops.estimate import H100
from kernels_py.tables import Column, table


@dataclass(frozen=True)
class Step:
    """Statistics of `rows` rows of a prompt of `context` tokens, batch
    folded into the heads as `bench stats` folds it: the last rows (the
    post-vision rows of a VL-Cache prompt), of which `spread` are drawn
    from the positions before the others instead (ZipVL's random probe
    rows, `probe_rows` with seed 0)."""

    batch: int
    context: int
    rows: int = 50
    spread: int = 0
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128


@functools.lru_cache(maxsize=16)
def positions(s: Step) -> tuple:
    """The step's row positions, sorted, as `bench stats` selects them."""
    if not 0 <= s.spread <= s.rows <= s.context:
        raise ValueError(f"the statistics' shape needs 0 <= spread <= rows <= context, got spread={s.spread}, "
                         f"rows={s.rows}, context={s.context}")
    return tuple(probe_rows(s.context, s.rows - s.spread, s.spread).tolist())


def costs(s: Step) -> dict[str, dict]:
    b, hq, hk, d, n, r = s.batch, s.heads, s.kv_heads, s.head_dim, s.context, s.rows
    k_bytes = b * hk * n * d * 2
    q_bytes = b * hq * r * d * 2
    results = b * n * (hq * 8 + hk * 4) + n * 4 + b * hq * r * 8
    return {
        "flash forward over the rows": {"bytes": 2 * k_bytes + 2 * q_bytes, "flops": 4 * b * hq * r * n * d},
        "statistics (two passes)": {"bytes": 2 * k_bytes + 2 * q_bytes + results, "flops": 4 * b * hq * r * n * d},
    }


def roofline_us(cost: dict) -> float:
    return estimate.roofline(cost["bytes"], cost["flops"])[0]


COLUMNS = (
    Column("context", "", "prompt tokens (keys)"),
    Column("batch", "", "sequences"),
    Column("variant", "", "implementation"),
    Column("gbytes", "", "HBM gigabytes the call moves", "GB"),
    Column("roofline_us", "", "microseconds: max(bytes / 3.35 TB/s, FLOPs / 989 TFLOP/s)", "ideal µs"),
    Column("vs_flash", "x", "ideal: this time / the FlashAttention forward's", "time vs flash"),
)

SHAPES = (Step(batch=1, context=4096), Step(batch=8, context=32768), Step(batch=64, context=32768))


def report(shapes=SHAPES) -> dict:
    rows = []
    for s in shapes:
        c = costs(s)
        flash = roofline_us(c["flash forward over the rows"])
        for variant, cost in c.items():
            us = roofline_us(cost)
            rows.append({"context": s.context, "batch": s.batch, "variant": variant, "gbytes": cost["bytes"] / 1e9,
                         "roofline_us": us, "vs_flash": us / flash})
    s = shapes[0]
    return {"title": f"attention statistics of the last {s.rows} rows on an H100, ideal at the peaks ({s.heads} q / "
                     f"{s.kv_heads} kv heads, head_dim {s.head_dim}, fp16)", **table(COLUMNS, rows)}


# ----------------------------------------------------------------------------
# What each launch does, for the estimate from the compiled code
# ----------------------------------------------------------------------------

ESTIMATE_SHAPES = (Step(batch=8, context=32768), Step(batch=64, context=32768))


def _tiles(s: Step, gpu=H100) -> tuple[int, int]:
    """(row tiles, key splits) of the row pass at the step, on `gpu`."""
    block_m, block_n, _ = kernel.default_tile(kernel.ROW_TILE, 2, s.head_dim)
    _, rows = kernel.group_tile(s.heads, s.kv_heads, block_m)
    row_tiles = -(-s.rows // rows)
    return row_tiles, kernel.key_split_count(s.context, row_tiles * s.batch * s.kv_heads, block_n, gpu.sms)


def _call(s: Step):
    """attention_stats on tiny CPU tensors with the step's specialization
    (two key splits when the step has more than one, so the merge runs)."""
    import torch

    keys, rows = 96, 8
    q = torch.zeros(s.heads, rows, s.head_dim, dtype=torch.float16)
    k = torch.zeros(s.kv_heads, keys, s.head_dim, dtype=torch.float16)
    kernel.attention_stats(q, k, torch.arange(keys - rows, keys), key_splits=2 if _tiles(s)[1] > 1 else 1)


def _column_trips(pos: tuple, n: int, block_n: int, per_tile: int) -> list[tuple]:
    """Each key block's loops in the column pass, as `_block_rows` bounds
    them: (unmasked row tiles, masked row tiles, scans of the positions),
    for rows at the sorted positions `pos`."""
    r, least, most = len(pos), pos[0], pos[-1]
    scans = -(-r // kernel.BOUND_ROWS)
    out = []
    for first_key in range(0, n, block_n):
        last_key = min(first_key + block_n, n) - 1
        if last_key <= least:
            seen, partial_end, scanned = 0, 0, 0
        elif first_key > most:
            seen, partial_end, scanned = r, r, 0
        else:
            seen = bisect.bisect_left(pos, first_key)  # the first row that sees the block
            partial_end = max(seen, bisect.bisect_left(pos, last_key))  # past the last that does not see it whole
            scanned = scans
        whole = seen + -(-(partial_end - seen) // per_tile) * per_tile
        out.append((-(-max(0, r - whole) // per_tile), (whole - seen) // per_tile, scanned))
    return out


def _work(s: Step, kernel_name: str, meta: dict, gpu) -> estimate.Work:
    b, hq, hk, d, n, r = s.batch, s.heads, s.kv_heads, s.head_dim, s.context, s.rows
    row_tiles, splits = _tiles(s, gpu)
    k_bytes = b * hk * n * d * 2
    tokens = b * n
    flops = 2 * b * hq * r * n * d
    part_bytes = 2 * splits * b * hq * r * 4
    if kernel_name == "_row_stats_kernel":
        block_n, per_tile = int(meta["BLOCK_N"]), int(meta["ROWS"])
        pos = positions(s)
        classes: dict = {}
        for lo, hi in splitk.split_ranges(n, splits, block_n):
            for t in range(0, r, per_tile):
                # As the kernel bounds a split: up to the tile's largest
                # position, unmasked up to the last whole tile its smallest sees.
                top = min(hi, pos[min(t + per_tile, r) - 1] + 1)
                whole = max(min(top, (pos[t] + 1) // block_n * block_n), lo)
                key = (-(-max(0, whole - lo) // block_n), -(-max(0, top - whole) // block_n))
                classes[key] = classes.get(key, 0) + 1  # programs with the same unmasked and masked tiles
        # The whole tiles' loops: sm_90's pairs after an odd count's first
        # tile (kernel.overlap_mma), or sm_80's one tile an iteration.
        programs = tuple(estimate.Programs(count * b * hk, {"#start_odd": full % 2, "#start_pair": full // 2,
                                                            "#start_n": full, "#start_edge": edge})
                         for (full, edge), count in classes.items())
        # The row tiles of a kv head are the grid's fastest dimension: they run
        # together, and all but the first read each key tile from L2.
        levels = {"K": {"hbm": 1 / row_tiles, "l2": 1 - 1 / row_tiles}, "Q": "l2", "QPos": "l2"}
        # A kv head's splits follow each other in the grid (its fastest dimension the row tiles).
        return estimate.Work(programs, k_bytes + b * hq * r * d * 2 + part_bytes, levels, flops, tokens,
                             interleaved=True)
    if kernel_name == "_merge_rows_kernel":
        block_r = min(256, 1 << (r - 1).bit_length())
        return estimate.Work((estimate.Programs(b * hq * -(-r // block_r), {"n_splits": splits}),),
                             part_bytes + b * hq * r * 8, {"PartM": "l2", "PartL": "l2"}, 0.0, tokens)
    if kernel_name == "_column_stats_kernel":
        block_n = int(meta["BLOCK_N"])
        blocks = -(-n // block_n)
        per = kernel.column_blocks_per_program(blocks, b * hk, gpu.sms)
        trips = _column_trips(positions(s), n, block_n, int(meta["ROWS"]))
        classes: dict = {}
        for first in range(0, blocks, per):
            mine = min(per, blocks - first)
            key = (mine, *(sum(t[i] for t in trips[first:first + mine]) / mine for i in range(3)))
            classes[key] = classes.get(key, 0) + 1  # programs whose blocks run the same loops
        programs = tuple(estimate.Programs(count * b * hk, {"#block": mine, "#first_row": whole, "#first_edge": edge,
                                                            "#first_scan": scan})
                         for (mine, whole, edge, scan), count in classes.items())
        results = b * n * (hq * 8 + hk * 4) + n * 4
        # Every block of a program re-reads the same rows. The row loops'
        # starts move with the block, so the source does not show the
        # re-reads, and they are taken from L2: measured, these kernels ran
        # 34-37% past the conservative end (ac7c521), nothing to say L1 serves them.
        levels = {"Q": "l2", "QPos": "l2", "M": "l2", "InvL": "l2"}
        # A kv head's programs, each class of them among them, follow each other in the grid.
        return estimate.Work(programs, k_bytes + results, levels, flops, tokens, interleaved=True)
    raise KeyError(f"the attention_stats model knows no kernel {kernel_name!r}")


ESTIMATES = (estimate.Implementation("statistics (two passes)", _call, _work,
                                     lambda s: (s.heads, s.kv_heads, s.head_dim, _tiles(s)[1] > 1),
                                     prunes_spilling=False),)


def flash_bytes(s: Step) -> float:
    return costs(s)["flash forward over the rows"]["bytes"]


def ideal_us(s: Step) -> dict:
    return {name: roofline_us(cost) for name, cost in costs(s).items()}
