"""What one decode step over an AttentionPack cache must move and compute,
per implementation, and the time that sets on an H100: the roofline the
kernels are designed to (`workbench kernels report` prints it; measured
times come from `workbench bench lowrank`).

Per token of the compressed segment (fp16, 8 kv heads, head_dim 128, rank
64): the full cache is 2 * 8 * 128 * 2 = 4096 bytes, U_k + U_v are
2 * 64 * 2 = 256 bytes. One SVD covers all kv heads ([T, H_kv * D]), so U is
shared by every head, and both kernels' programs hold every query head of a
sequence: each U tile is read once for all heads, 256 bytes a token.

FLOPs are those the kernels execute on tensor cores, padding included.
Both kernels map out of rank space once per sequence, in their merge, on
CUDA cores (not counted); the absorbed kernel maps into rank space once
per sequence (a small pre-kernel, tf32 products counted at the fp16 rate).
The dense segment is grouped decode, each kv head's rows (padded to 16).
The
fused kernel rebuilds each kv head's keys (2 * R_k * D a token and kv head,
at the tile's rank) and scores them with all H_q rows of its program (each
row keeps its own head's scores: H_kv times the useful QK work, the price of
reading U once); values stay in rank space (2 * R_v per row and token). The
absorbed kernel scores and sums in rank space: 2 * (R_k + R_v) per row and
token.

For the per-token attention mass (AttentionPack Eq. 1) the fused kernel
writes each (query head, token) logit and reads it back, 4 bytes per head
and token over an fp16 cache (float16 logits; 8 in float32, as at
fbd0532); the absorbed kernel does so for the dense tokens only
and recomputes the compressed tokens' scores in rank space, reading U_k
again (2 * rank_k bytes a token). Counted apart, as "mass" bytes.

Partial decompression (`low_share` of the tokens at rank / 4 in the factors
`partial` names): stored grouped by rank, tiles are rank-uniform, so U bytes
and the key rebuild scale with the mean rank.
"""

from dataclasses import dataclass

from kernels_py.ops import estimate, splitk
from kernels_py.ops.estimate import H100
from kernels_py.ops.lowrank_decode import kernel
from kernels_py.tables import Column, table

# The fields of Step that take only some values (`--shape partial=keys`, elem_bytes=4 for float32).
CHOICES = {"partial": ("values", "keys", "both"), "elem_bytes": (2, 4), "rank_chunk": (0, 16, 32, 64)}


@dataclass(frozen=True)
class Step:
    """One decode step (one query token per sequence)."""

    batch: int
    visual: int  # compressed tokens per sequence
    dense: int = 64  # uncompressed tokens per sequence
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    rank_k: int = 64
    rank_v: int = 64
    elem_bytes: int = 2  # fp16/bf16 cache and factors
    low_share: float = 0.0  # share of the tokens decompressed at rank / 4
    partial: str = "values"  # which factors the low rank applies to: values, keys or both
    splits: int = 0  # splits per sequence of today's kernels; 0: the launchers' default (kernel.split_count)
    rank_chunk: int = 0  # rank columns per step of the fused key rebuild; 0: the launcher's default (one MMA)

    def __post_init__(self):
        for name in ("partial", "rank_chunk"):
            if getattr(self, name) not in CHOICES[name]:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of "
                                 f"{', '.join(str(c) for c in CHOICES[name])}")
        if not 0 <= self.splits <= kernel.MAX_SPLITS:
            raise ValueError(f"splits={self.splits} must be in [0, {kernel.MAX_SPLITS}] (0: the default)")
        width = self.kv_heads * self.head_dim  # what a factor rebuilds: every kv head's channels of a token
        for name, rank in (("rank_k", self.rank_k), ("rank_v", self.rank_v)):
            if not 1 <= rank <= width:  # as bench lowrank refuses its ranks: no such cache exists
                raise ValueError(f"{name}={rank} must be in [1, kv_heads * head_dim] = [1, {width}]")

    @staticmethod
    def low_rank(rank: int) -> int:
        """The low group's rank (rank / 4) for a factor of this rank."""
        return max(1, rank // 4)

    def full_tokens(self) -> int:
        """Tokens at full rank: the first ones (tokens are stored grouped by rank)."""
        return self.visual - round(self.low_share * self.visual)

    def mean_ranks(self) -> tuple[float, float]:
        """(R_k, R_v) averaged over the tokens."""
        def mean(rank, applies):
            return rank - self.low_share * (rank - self.low_rank(rank)) if applies else rank
        return (mean(self.rank_k, self.partial in ("keys", "both")),
                mean(self.rank_v, self.partial in ("values", "both")))


def per_token_bytes(s: Step) -> dict:
    """Bytes per compressed token: the full cache's K and V, and U_k + U_v at
    the tokens' mean ranks."""
    return {"full": 2 * s.kv_heads * s.head_dim * s.elem_bytes, "factors": sum(s.mean_ranks()) * s.elem_bytes}


def costs(s: Step) -> dict[str, dict]:
    """HBM bytes and executed tensor-core FLOPs of one step, by implementation."""
    b, t, n, hq, hk, d, rk, rv, e = (s.batch, s.visual, s.dense, s.heads, s.kv_heads, s.head_dim, s.rank_k, s.rank_v,
                                     s.elem_bytes)
    mk, mv = s.mean_ranks()
    dense_bytes = b * n * 2 * hk * d * e
    dense_flops = b * hk * max(16, hq // hk) * n * 4 * d  # each kv head's rows, padded to 16
    factors = b * t * per_token_bytes(s)["factors"] + b * (rk + rv) * hk * d * e  # U once, W once
    logits = b * hq * (t + n) * _logit_bytes(s) * 2  # written, then read for the masses
    rank_space_mass = b * hq * n * 4 * 2 + b * t * mk * e + b * hq * rk * 4 * 2  # dense logits, U_k again, q~
    absorbed_flops = b * hq * t * 2 * (rk + rv) + b * hq * 2 * d * rk + dense_flops
    fused_flops = b * t * hk * 2 * mk * d + b * t * hk * hq * 2 * d + b * hq * t * 2 * rv + dense_flops
    return {
        "flash, full cache": {"bytes": b * (t + n) * 2 * hk * d * e, "flops": b * hq * (t + n) * 4 * d},
        "absorbed (latent)": {"bytes": factors + dense_bytes, "mass_bytes": rank_space_mass,
                              "flops": absorbed_flops + b * hq * t * 2 * rk},  # the masses score U_k again
        "fused (exact)": {"bytes": factors + dense_bytes, "mass_bytes": logits, "flops": fused_flops},
        # mass=False: a step that does not update the importance (AttentionPack's importance_every)
        "absorbed (latent), no mass": {"bytes": factors + dense_bytes, "mass_bytes": 0, "flops": absorbed_flops},
        "fused (exact), no mass": {"bytes": factors + dense_bytes, "mass_bytes": 0, "flops": fused_flops},
    }


COLUMNS = (
    Column("visual", "", "compressed tokens per sequence"),
    Column("batch", "", "sequences"),
    Column("variant", "", "implementation"),
    Column("gbytes", "", "HBM gigabytes one step must read (the factors once, W, the dense segment)", "GB"),
    Column("mass_gbytes", "", "gigabytes more for the per-token masses: logits written and re-read (float16 "
           "over an fp16 cache; the "
           "absorbed kernel: of the dense tokens, plus U_k read again)", "+mass GB"),
    Column("tflop", "", "tensor-core teraFLOPs of one step", "TFLOP"),
    Column("roofline_us", "", "microseconds: max(bytes / 3.35 TB/s, FLOPs / 989 TFLOP/s), masses included",
           "ideal µs"),
    Column("bound", "", "what sets the roofline: memory or compute"),
    Column("speedup_vs_flash", "x", "ideal: flash time / this time", "vs flash"),
)

SHAPES = (Step(batch=1, visual=1024), Step(batch=8, visual=32768), Step(batch=64, visual=32768))


def roofline_us(cost: dict) -> tuple[float, str]:
    """The time the bytes or the FLOPs of a step take at the H100's peaks,
    whichever is longer, and which it is."""
    memory = (cost["bytes"] + cost.get("mass_bytes", 0)) / H100.hbm_bytes_per_s
    compute = cost["flops"] / H100.peak_flops
    return max(memory, compute) * 1e6, "memory" if memory >= compute else "compute"


def report(shapes=SHAPES) -> dict:
    rows = []
    for s in shapes:
        c = costs(s)
        flash_us, _ = roofline_us(c["flash, full cache"])
        for variant, cost in c.items():
            us, bound = roofline_us(cost)
            rows.append({"visual": s.visual, "batch": s.batch, "variant": variant, "gbytes": cost["bytes"] / 1e9,
                         "mass_gbytes": cost.get("mass_bytes", 0) / 1e9, "tflop": cost["flops"] / 1e12,
                         "roofline_us": us, "bound": bound, "speedup_vs_flash": flash_us / us})
    s = shapes[0]
    return {"title": f"one decode step on an H100, ideal at the peaks ({s.heads} q / {s.kv_heads} kv heads, head_dim "
                     f"{s.head_dim}, rank {s.rank_k}, fp16; {per_token_bytes(s)['full']} bytes a token in the full "
                     f"cache, {per_token_bytes(s)['factors']:g} in U_k + U_v)",
            **table(COLUMNS, rows)}


# ----------------------------------------------------------------------------
# What each launch does, for the estimate from the compiled code
# (kernels_py.ops.estimate; `workbench kernels report --estimate`)
# ----------------------------------------------------------------------------

FBD0532_TOKENS_PER_SPLIT = 256  # the calibration kernels' default split size,
FBD0532_MAX_SPLITS = 64  # and their most splits
# Arguments every program of a sequence re-reads (L2 after the first): the
# queries, W (one SVD per sequence, read by each of its splits), the lengths.
_SHARED = {"Q": "l2", "QPos": "l2", "WK": "l2", "WV": "l2", "CLen": "l2", "DLen": "l2"}
ESTIMATE_SHAPES = (Step(batch=8, visual=32768, low_share=0.75), Step(batch=64, visual=32768, low_share=0.75))


def _dtype(s: Step):
    import torch

    return {2: torch.float16, 4: torch.float32}[s.elem_bytes]


def _call(s: Step, *, absorbed: bool, kernels=None, mass: bool = True):
    """The launcher on tiny CPU tensors that compile to the step's
    specialization (heads, head_dim, ranks, dtype; lengths and strides
    divisible by 16 like the step's)."""
    from kernels_py.ops.lowrank_decode.cases import make_cache

    kernels = kernels or kernel
    q, q_pos, comp, dense = make_cache(batch=2, heads=s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim,
                                       rank_k=s.rank_k, rank_v=s.rank_v, tokens=64, slots=64, comp_lens=[64, 64],
                                       dense_lens=[64, 64], queries=1, dtype=_dtype(s))
    if kernels is not kernel:  # an older kernel file with its own segment classes
        comp = kernels.CompressedKV(comp.uk, comp.wk, comp.uv, comp.wv, comp.rank_k, comp.rank_v, comp.pos,
                                    comp.length)
        dense = kernels.DenseKV(dense.k, dense.v, dense.pos, dense.length)
    options = {} if mass else {"mass": False}  # an older kernel file has no such option
    # Two splits where the step has several: with the tiny cache's one, the
    # merge's split count compiles as the constant 1 and its loop over the
    # splits is gone.
    options["num_splits"] = min(2, _splits(s, H100, absorbed=absorbed, per_kv_head=kernels is not kernel))
    if absorbed:
        kernels.lowrank_decode_absorbed(q, q_pos, comp, dense, **options)
    else:
        chunk = {"rank_chunk": _rank_chunk(s)} if _rank_chunk(s) else {}
        kernels.lowrank_decode(q, q_pos, comp, dense, rope_base=10000.0, **chunk, **options)


def _splits(s: Step, gpu, *, absorbed: bool, per_kv_head: bool = False) -> int:
    """Splits per sequence of a step's call on `gpu`, as the launcher counts
    them (per_kv_head: the fbd0532 kernels' rule over [compressed | dense])."""
    if not per_kv_head:
        return s.splits or kernel.split_count(s.visual, s.batch, gpu.sms, absorbed=absorbed)
    return splitk.split_count(s.visual + s.dense, s.batch * s.kv_heads, per_split=FBD0532_TOKENS_PER_SPLIT,
                              min_split=64, max_splits=FBD0532_MAX_SPLITS, sms=gpu.sms)


def _rank_chunk(s: Step) -> int | None:
    """The rank chunk the fused call is given (`bench lowrank --rank-chunk`):
    None, the launcher's default, for 0."""
    return s.rank_chunk or None


def split_classes(s: Step, splits: int, block_n: int, *, dense_apart: bool = False) -> dict:
    """Splits with the same ranges, as {(c_lo, c_hi, d_lo, d_hi, full):
    splits}: the ranges _split_range gives every split of [compressed |
    dense] (dense_apart: of the compressed tokens only, as the absorbed
    kernel splits them), and `full`, how many of the first compressed tokens
    keep the full key rank (tokens are stored grouped by rank, that group
    first)."""
    full = s.full_tokens() if s.partial in ("keys", "both") else s.visual
    out: dict = {}
    for lo, hi in splitk.split_ranges(s.visual + (0 if dense_apart else s.dense), splits, block_n):
        c_lo, c_hi = min(lo, s.visual), min(hi, s.visual)
        key = (c_lo, c_hi, max(lo, s.visual) - s.visual, max(hi, s.visual) - s.visual)
        out[key] = out.get(key, 0) + 1
    return {k + (full,): v for k, v in out.items()}


def _tile_chunks(c_lo, c_hi, full, block_n, rank_k, low_rank, block_r) -> float:
    """Mean rank chunks the key rebuild runs per compressed tile of a split."""
    tiles = [(t, min(t + block_n, c_hi)) for t in range(c_lo, c_hi, block_n)]
    if not tiles:
        return 0.0
    chunks = [-(-(rank_k if t < full else low_rank) // block_r) for t, _ in tiles]
    return sum(chunks) / len(chunks)


def _ragged_tiles(s: Step, c_lo: int, c_hi: int, block_n: int, factors: tuple = ("keys", "values")) -> int:
    """Tiles of [c_lo, c_hi) the absorbed kernel takes a second time, token
    by token (kernel._whole_chunks): the one where the full-rank group (the
    first tokens) meets the low one, when a low rank of `factors` (the
    rank-space mass kernel: keys only) is no multiple of 16."""
    lows = [s.low_rank(r) for r, f in ((s.rank_k, "keys"), (s.rank_v, "values"))
            if f in factors and s.partial in (f, "both")]
    full = s.full_tokens()
    meets = 0 < full < s.visual and full % block_n != 0 and c_lo <= full < c_hi
    return int(meets and any(low % 16 for low in lows))


def _work(s: Step, kernel_name: str, meta: dict, gpu, *, absorbed: bool, per_kv_head: bool = False) -> estimate.Work:
    """What one launch of a kernel of `lowrank_decode` (or `_absorbed`) does
    at step s. per_kv_head: the grid of the kernels at commit fbd0532, one
    program per (kv head, sequence, split), each reading U for its kv head."""
    b, t, n, hq, hk, d, e = s.batch, s.visual, s.dense, s.heads, s.kv_heads, s.head_dim, s.elem_bytes
    mk, mv = s.mean_ranks()
    programs_per_split = b * hk if per_kv_head else b
    # Today's kernels split the compressed tokens only (the dense segment is
    # attended in the merge's launch, or with q~ in the absorbed call's
    # first), keep their partials in rank space and apply W_v in the merge;
    # the absorbed one makes q~ once per sequence. The fbd0532 kernels split
    # [compressed | dense].
    rank_space_parts = not per_kv_head
    splits = _splits(s, gpu, absorbed=absorbed, per_kv_head=per_kv_head)  # fbd0532's: about 256 tokens a split
    tokens = b * (t + n)
    w_bytes = b * (s.rank_k + s.rank_v) * hk * d * e
    # W in stage 1: both at fbd0532, W_k in today's fused kernel (W_v is the merge's).
    stage1_w = w_bytes if not rank_space_parts else 0 if absorbed else b * s.rank_k * hk * d * e
    u_bytes = b * t * (mk + mv) * e + stage1_w
    dense_bytes = b * n * 2 * hk * d * e
    index_bytes = b * t * 12 + b * n * 4  # positions and both ranks per compressed token, dense positions
    if rank_space_parts:
        part_bytes = b * hq * (splits * (s.rank_v + 1) + d + 1) * 4
    else:
        part_bytes = b * hq * splits * (d + 1) * 4
    small = "l2" if part_bytes < gpu.l2_bytes / 2 else "hbm"
    # The dense segment: its K, V and positions read, its logits written for
    # the masses; in the absorbed call's first launch, which also makes q~
    # (W_k read once, q~ written) and stores the dense partial, or in the
    # fused call's merge.
    dense_read = dense_bytes + b * n * 4 + b * hq * n * (4 if absorbed else _logit_bytes(s)) * _stores_logits(meta)
    dense_flops = b * hq * n * 4 * d
    dense_levels = {"Q": "l2", "QPos": "l2", "DLen": "l2"}
    if kernel_name == "_merge_rank_kernel":  # a program per (sequence, kv head, block of its rows)
        # The fused call's merge attends the dense segment and reads no dense
        # partial. Where a kv head's rows take more than one block, each block
        # reads the dense K and V again, from L2 after the first: counted once.
        dense_in_merge = not absorbed
        values = {"n_splits": splits, "rank_v_max": s.rank_v}
        if dense_in_merge:
            values["d_len"] = n
        return estimate.Work((estimate.Programs(b * hk * kernel.merge_row_blocks(hq // hk)[1], values),),
                             part_bytes - (b * hq * (d + 1) * 4 if dense_in_merge else 0) + b * s.rank_v * hk * d * e
                             + b * hq * (d * e + 4) + (dense_read if dense_in_merge else 0),
                             {"PartO": small, "PartRank": small, "PartLse": small, "WV": "l2",
                              **(dense_levels if dense_in_merge else {})},
                             dense_flops if dense_in_merge else 0.0, tokens)
    if kernel_name == "_query_dense_kernel":
        return estimate.Work((estimate.Programs(b * hk, {"d_len": n}),),
                             dense_read + b * hq * (d + 1) * 4 + b * s.rank_k * hk * d * e + b * hq * s.rank_k * 4,
                             {**dense_levels, "WK": "hbm"}, dense_flops + b * hq * 2 * d * s.rank_k, tokens)
    if kernel_name in ("_stage1_kernel", "_stage1_absorbed_kernel"):
        block_n = int(meta["BLOCK_N"])
        low_rank = s.low_rank(s.rank_k) if s.partial in ("keys", "both") else s.rank_k
        classes: dict = {}  # splits with the same trips: (compressed tokens, dense tokens, chunks per tile)
        for (c_lo, c_hi, d_lo, d_hi, full), count in split_classes(s, splits, block_n,
                                                                    dense_apart=rank_space_parts).items():
            chunks = 0.0
            if "BLOCK_R" in meta and not per_kv_head:
                chunks = _tile_chunks(c_lo, c_hi, full, block_n, s.rank_k, low_rank, int(meta["BLOCK_R"]))
            ragged = _ragged_tiles(s, c_lo, c_hi, block_n) if absorbed and rank_space_parts else 0
            key = (c_hi - c_lo, d_hi - d_lo, round(chunks, 3), ragged)
            classes[key] = classes.get(key, 0) + count
        programs = []
        for (c_len, d_len, chunks, ragged), count in classes.items():
            values = {"c_lo": 0, "c_hi": c_len, "d_lo": 0, "d_hi": d_len}
            if "BLOCK_R" in meta and not per_kv_head:
                values["#r0"] = chunks
            if absorbed and rank_space_parts:
                values["#ragged_start"] = ragged
            programs.append(estimate.Programs(count * programs_per_split, values))
        logits = b * hq * (t + n) * 4  # fbd0532: every column
        q_rank = b * hq * s.rank_k * 4 if absorbed and per_kv_head else 0  # today's: read from L2
        levels = dict(_SHARED, QRank="l2")
        if rank_space_parts:  # the dense segment is another launch's
            dense_bytes, index_bytes = 0, b * t * 12
            part_bytes = b * hq * splits * (s.rank_v + 1) * 4
            logits = 0 if absorbed else b * hq * t * _logit_bytes(s) * _stores_logits(meta)
        if kernel_name == "_stage1_kernel" and not per_kv_head:
            # The fused kernel asks L2 for the next tile's U rows a tile ahead
            # (prefetch.global.L2, nothing waits for it): only a program's
            # first tile reads U from HBM with its loads. Its positions and
            # ranks are asked for a tile before their loads, which run one
            # and two tiles ahead: the loads before the loop and the first
            # iteration's read HBM.
            tiles = sum(p.count * -(-p.values["c_hi"] // block_n) for p in programs)
            first = sum(p.count for p in programs if p.values["c_hi"] > 0) / max(1, tiles)
            for names, hbm in ((("UK", "UV"), first), (("CPos", "RankK", "RankV"), min(1.0, 2 * first))):
                for name in names:
                    levels[name] = {"hbm": hbm, "l2": 1 - hbm}
        if per_kv_head:
            # The kv heads' programs of a (sequence, split) are neighbours in
            # the grid and read the same U tiles at about the same time: at
            # best one misses and the others hit L2; at worst they all wait
            # for the line to come from HBM.
            for name in ("UK", "UV", "RankK", "RankV", "CPos"):
                levels[name] = ({"hbm": 1 / hk, "l2": 1 - 1 / hk}, "hbm")
        useful = (b * hq * t * 2 * (s.rank_k + mv) if absorbed
                  else b * t * hk * 2 * mk * d + b * hq * t * 2 * (d + mv)) + (0 if rank_space_parts
                                                                               else b * hq * n * 4 * d)
        notes = []
        empty = sum(1 for lo, hi in splitk.split_ranges(t if rank_space_parts else t + n, splits, block_n)
                    if lo == hi)
        if empty:
            notes.append(f"{empty} of {splits} splits per sequence are empty (whole tiles of "
                         f"{block_n}); they still run the per-program prologue and epilogue")
        return estimate.Work(tuple(programs), u_bytes + dense_bytes + index_bytes + logits + q_rank + part_bytes,
                             levels, useful, tokens, tuple(notes))
    if kernel_name == "_merge_kernel":
        return estimate.Work((estimate.Programs(b * hq, {"n_splits": splits}),),
                             part_bytes + b * hq * (d * e + 4), {"PartO": small, "PartLse": small}, 0.0, tokens)
    if kernel_name == "_mass_kernel":
        # From stored logits: every column (the fused kernel, and both
        # fbd0532 kernels), or the absorbed kernel's dense columns only
        # (before _mass_rank_kernel took them).
        cols = n if absorbed and rank_space_parts else t + n
        grid = b * -(-cols // kernel.MASS_BLOCK_T)
        levels = {"Lse": "l2", "CLen": "l2", "DLen": "l2"}
        logit_bytes = _logit_bytes(s) if rank_space_parts and not absorbed else 4  # fbd0532's: float32
        return estimate.Work((estimate.Programs(grid, {"n_rows": hq}),),
                             b * hq * cols * logit_bytes + b * cols * 4 + b * hq * 4, levels, 0.0, tokens)
    if kernel_name == "_mass_rank_kernel":
        span = kernel.mass_span(t, b, gpu.sms)
        block_t = int(meta["BLOCK_T"])
        classes: dict = {}  # programs with the same trips: (columns, second-pass tiles)
        for lo in range(0, t, span):
            key = (min(span, t - lo), _ragged_tiles(s, lo, min(lo + span, t), block_t, ("keys",)))
            classes[key] = classes.get(key, 0) + 1
        # Both branches' loops are in the code every program runs through:
        # each class gives the other's loops no trips.
        programs = tuple(estimate.Programs(b * count, {"block": 0, "_rank_masses.hi": cols, "#ragged_start": ragged,
                                                        "#r0": 0})
                         for (cols, ragged), count in classes.items())
        dense_blocks = -(-n // kernel.MASS_DENSE_BLOCK_T)
        if dense_blocks:  # the dense columns' programs: their stored logits read, their masses written
            programs += (estimate.Programs(b * dense_blocks, {"#start": 0, "#ragged_start": 0, "n_rows": hq}),)
        stored = b * hq * n * 4 + b * n * 4
        levels = {"Lse": "l2", "QRank": "l2", "QPos": "l2", "CLen": "l2", "DLen": "l2"}
        return estimate.Work(programs, b * t * (mk * e + 8) + b * t * 4 + b * hq * s.rank_k * 4 + stored, levels,
                             b * t * hq * 2 * s.rank_k, tokens)
    raise KeyError(f"the lowrank_decode model knows no kernel {kernel_name!r}")


def _key(s: Step, absorbed: bool) -> tuple:
    """The fields of a step its compiled code depends on (one split or several: _call)."""
    return (s.heads, s.kv_heads, s.head_dim, s.rank_k, s.rank_v, s.elem_bytes, _rank_chunk(s),
            _splits(s, H100, absorbed=absorbed) > 1)


def _logit_bytes(s: Step) -> int:
    """Bytes of one logit the fused call stores for the masses
    (kernel.logits_dtype: float16 over an fp16 cache, the model's 2-byte one)."""
    return 2 if s.elem_bytes == 2 else 4


def _stores_logits(meta: dict) -> int:
    """1 when a launch writes the logits for the masses (mass=True), else 0."""
    return int(meta.get("STORE_LOGITS", True) not in (False, "False"))


ESTIMATES = (
    estimate.Implementation("fused (exact)", lambda s: _call(s, absorbed=False),
                            lambda s, k, m, gpu: _work(s, k, m, gpu, absorbed=False),
                            lambda s: _key(s, absorbed=False)),
    estimate.Implementation("absorbed (latent)", lambda s: _call(s, absorbed=True),
                            lambda s, k, m, gpu: _work(s, k, m, gpu, absorbed=True),
                            lambda s: _key(s, absorbed=True)),
    # A step without the per-token masses (mass=False: AttentionPack's steps between importance updates).
    estimate.Implementation("fused (exact), no mass", lambda s: _call(s, absorbed=False, mass=False),
                            lambda s, k, m, gpu: _work(s, k, m, gpu, absorbed=False),
                            lambda s: _key(s, absorbed=False)),
    estimate.Implementation("absorbed (latent), no mass", lambda s: _call(s, absorbed=True, mass=False),
                            lambda s, k, m, gpu: _work(s, k, m, gpu, absorbed=True),
                            lambda s: _key(s, absorbed=True)),
)


def flash_bytes(s: Step) -> float:
    """What FlashAttention decode must read over the uncompressed cache."""
    return costs(s)["flash, full cache"]["bytes"]


def ideal_us(s: Step) -> dict:
    """The bytes/FLOPs roofline of each implementation ("ideal")."""
    return {name: roofline_us(cost)[0] for name, cost in costs(s).items()}
