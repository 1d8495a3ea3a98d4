"""The attention-statistics kernels (VL-Cache appendix A.5, three kernels
run in order) and their launchers. What they compute is in contract.py.

1. `row_stats`: one program per (block of BLOCK_M selected rows, query head)
   walks the keys each row can see and keeps the running row max and sum of
   exp (online softmax). Writes m, l [H, R] float32.
2. `column_stats`: one program per (split of ROWS_PER_SPLIT rows, block of
   BLOCK_N keys, query head). It loads its key tile once, walks the split's
   rows BLOCK_M at a time, recomputes the probabilities from m and l and
   reduces over the rows: attention sum, count below the ThresholdFilter and
   count of causally visible rows. Each program writes its own partial
   (partials [S, H, N], S = row splits), so nothing is atomic and the result
   is deterministic. The visible count does not depend on the head: only the
   programs of head 0 write it (partial [S, N]).
3. `reduce_stats`: one program per (block of keys, kv head) adds the partials
   over the splits in a fixed order and writes the per-head results [H, N]
   plus their sum over the query heads of each kv group [H_kv, N].

Reference: reference.py beside this file.
"""

import torch
import triton
import triton.language as tl

from kernels_py.ops import common
from kernels_py.ops.attention_stats.contract import (
    AttentionStats, ColumnPartials, ReducedStats, check_inputs, check_partials, check_row_stats, check_threshold,
)

# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@triton.jit
def _load_positions(QPos, offs_m, stride_p, row_mask):
    """Positions of the selected rows; -1 (sees no key) past the last row."""
    return tl.load(QPos + offs_m * stride_p, mask=row_mask, other=-1).to(tl.int32)


@triton.jit
def _load_q(Q_head, offs_m, offs_d, stride_qm, stride_qd, row_mask, d_mask, UPCAST: tl.constexpr):
    q = tl.load(
        Q_head + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def _load_kt(K_head, offs_n, offs_d, stride_kn, stride_kd, n_keys, d_mask, UPCAST: tl.constexpr):
    """A key tile, transposed: [BLOCK_D, BLOCK_N]; zeros past the head_dim and the keys."""
    k = tl.load(
        K_head + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
        mask=(offs_n[None, :] < n_keys) & d_mask[:, None],
        other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)
    return k


@triton.jit
def _scores(q, kt, offs_n, q_pos, n_keys, qk_scale):
    """Scores in log2 units with the causal mask and the ragged tail set to -inf,
    and the mask of visible entries."""
    s = tl.dot(q, kt, input_precision="ieee") * qk_scale
    visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] < n_keys)
    return tl.where(visible, s, float("-inf")), visible


@triton.jit
def _row_stats_kernel(
    Q, K, QPos, M, L,
    stride_qh, stride_qm, stride_qd,
    stride_kh, stride_kn, stride_kd,
    stride_p,
    stride_mh, stride_mr,
    stride_lh, stride_lr,
    n_rows, n_keys, qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = offs_m < n_rows
    d_mask = offs_d < HEAD_DIM
    q_pos = _load_positions(QPos, offs_m, stride_p, row_mask)
    q = _load_q(Q + head * stride_qh, offs_m, offs_d, stride_qm, stride_qd, row_mask, d_mask, UPCAST)
    K_head = K + kv_head * stride_kh
    # No row of this block sees a key past its largest position.
    key_end = tl.minimum(tl.max(q_pos, 0) + 1, n_keys)

    # A finite floor instead of -inf keeps rows past n_rows (all scores -inf)
    # free of inf - inf; every real row sees key 0 in the first block, so its
    # max is a real score from then on.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(0, key_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = _load_kt(K_head, offs_n, offs_d, stride_kn, stride_kd, n_keys, d_mask, UPCAST)
        s, _ = _scores(q, kt, offs_n, q_pos, n_keys, qk_scale)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new

    tl.store(M + head * stride_mh + offs_m * stride_mr, m_i, mask=row_mask)
    tl.store(L + head * stride_lh + offs_m * stride_lr, l_i, mask=row_mask)


@triton.jit
def _column_stats_kernel(
    Q, K, QPos, M, L, PAttn, PBelow, PNonzero,
    stride_qh, stride_qm, stride_qd,
    stride_kh, stride_kn, stride_kd,
    stride_p,
    stride_mh, stride_mr,
    stride_lh, stride_lr,
    stride_as, stride_ah, stride_an,
    stride_bs, stride_bh, stride_bn,
    stride_zs, stride_zn,
    n_rows, n_keys, qk_scale, threshold,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROWS_PER_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    split = tl.program_id(0)
    pid_n = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    first_key = pid_n * BLOCK_N
    offs_n = first_key + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    key_mask = offs_n < n_keys
    d_mask = offs_d < HEAD_DIM
    kt = _load_kt(K + kv_head * stride_kh, offs_n, offs_d, stride_kn, stride_kd, n_keys, d_mask, UPCAST)
    Q_head = Q + head * stride_qh

    attn = tl.zeros([BLOCK_N], dtype=tl.float32)
    below = tl.zeros([BLOCK_N], dtype=tl.int32)
    nonzero = tl.zeros([BLOCK_N], dtype=tl.int32)
    row_lo = split * ROWS_PER_SPLIT
    row_hi = tl.minimum(row_lo + ROWS_PER_SPLIT, n_rows)
    for start_m in range(row_lo, row_hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_mask = offs_m < row_hi
        q_pos = _load_positions(QPos, offs_m, stride_p, row_mask)
        # Skip the matmul when no row of this tile sees any key of this block.
        if tl.max(q_pos, 0) >= first_key:
            q = _load_q(Q_head, offs_m, offs_d, stride_qm, stride_qd, row_mask, d_mask, UPCAST)
            m_i = tl.load(M + head * stride_mh + offs_m * stride_mr, mask=row_mask, other=0.0)
            l_i = tl.load(L + head * stride_lh + offs_m * stride_lr, mask=row_mask, other=1.0)
            s, visible = _scores(q, kt, offs_n, q_pos, n_keys, qk_scale)
            e = tl.exp2(s - m_i[:, None])  # A_ij * l_i; 1 at the row max, 0 where masked
            attn += tl.sum(e * (1.0 / l_i)[:, None], 0)
            below += tl.sum((visible & (e < threshold)).to(tl.int32), 0)
            nonzero += tl.sum(visible.to(tl.int32), 0)

    tl.store(PAttn + split * stride_as + head * stride_ah + offs_n * stride_an, attn, mask=key_mask)
    tl.store(PBelow + split * stride_bs + head * stride_bh + offs_n * stride_bn, below, mask=key_mask)
    tl.store(PNonzero + split * stride_zs + offs_n * stride_zn, nonzero, mask=key_mask & (head == 0))


@triton.jit
def _reduce_kernel(
    PAttn, PBelow, PNonzero, Attn, Below, Nonzero, AttnKV,
    stride_as, stride_ah, stride_an,
    stride_bs, stride_bh, stride_bn,
    stride_zs, stride_zn,
    stride_oah, stride_oan,
    stride_obh, stride_obn,
    stride_ozh, stride_ozn,
    stride_kvh, stride_kvn,
    n_splits, n_keys,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    key_mask = offs_n < n_keys

    nonzero = tl.zeros([BLOCK_N], dtype=tl.int32)
    for s in range(0, n_splits):
        nonzero += tl.load(PNonzero + s * stride_zs + offs_n * stride_zn, mask=key_mask, other=0)

    attn_kv = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g in tl.static_range(GROUP):
        head = kv_head * GROUP + g
        attn = tl.zeros([BLOCK_N], dtype=tl.float32)
        below = tl.zeros([BLOCK_N], dtype=tl.int32)
        for s in range(0, n_splits):
            attn += tl.load(PAttn + s * stride_as + head * stride_ah + offs_n * stride_an, mask=key_mask, other=0.0)
            below += tl.load(PBelow + s * stride_bs + head * stride_bh + offs_n * stride_bn, mask=key_mask, other=0)
        tl.store(Attn + head * stride_oah + offs_n * stride_oan, attn, mask=key_mask)
        tl.store(Below + head * stride_obh + offs_n * stride_obn, below, mask=key_mask)
        tl.store(Nonzero + head * stride_ozh + offs_n * stride_ozn, nonzero, mask=key_mask)
        attn_kv += attn
    tl.store(AttnKV + kv_head * stride_kvh + offs_n * stride_kvn, attn_kv, mask=key_mask)


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------


def attention_stats(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, p: float = 0.01,
                    scale: float | None = None, *, block_m: int = 16, block_n: int | None = None,
                    rows_per_split: int = 64) -> AttentionStats:
    """Attention statistics of the selected query rows, without the attention matrix.

    q: [heads, rows, head_dim], the selected query rows (gathered by the caller).
    k: [kv_heads, keys, head_dim]; heads must be a multiple of kv_heads (GQA).
    q_pos: [rows] int32/int64, the absolute position of each row; row i sees
        keys 0 .. q_pos[i]. Any order, duplicates allowed, each in [0, keys).
    p: ThresholdFilter threshold in [0, 1] (VL-Cache: 0.01).
    scale: softmax scale, default head_dim ** -0.5.
    fp16/bf16/fp32 inputs, fp32 accumulation; strided inputs are fine.
    block_m, block_n: row and key tiles (block_n default: 64, and
    column_block_n(k) for the column kernel).
    """
    m, l = row_stats(q, k, q_pos, scale, block_m=block_m, block_n=block_n or 64)
    partials = column_stats(q, k, q_pos, m, l, p, scale, block_m=block_m, block_n=block_n,
                            rows_per_split=rows_per_split)
    reduced = reduce_stats(partials, k.shape[0], block_n=block_n or 64)
    return AttentionStats(m, l, reduced.attn_sum, reduced.below, reduced.nonzero, reduced.attn_sum_kv, float(p))


def row_stats(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, scale: float | None = None, *,
              block_m: int = 16, block_n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel 1: row max (log2 units, see the module doc) and sum of exp of the
    causal scores of each selected row, each float32 [heads, rows]."""
    check_inputs(q, k, q_pos)
    common.check_block("block_m", block_m)
    common.check_block("block_n", block_n)
    heads, n_rows, head_dim = q.shape
    kv_heads, n_keys, _ = k.shape
    qk_scale = common.softmax_scale(scale, head_dim) * common.LOG2E
    m = torch.empty((heads, n_rows), dtype=torch.float32, device=q.device)
    l = torch.empty((heads, n_rows), dtype=torch.float32, device=q.device)
    if n_rows == 0:
        return m, l
    grid = (triton.cdiv(n_rows, block_m), heads)
    _row_stats_kernel[grid](
        q, k, q_pos, m, l,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        q_pos.stride(0),
        m.stride(0), m.stride(1),
        l.stride(0), l.stride(1),
        n_rows, n_keys, qk_scale,
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=common.block(head_dim),
        UPCAST=common.upcast_for_dot(q.dtype),
    )
    return m, l


def column_stats(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, row_max: torch.Tensor,
                 row_sumexp: torch.Tensor, p: float = 0.01, scale: float | None = None, *,
                 block_m: int = 16, block_n: int | None = None, rows_per_split: int = 64) -> ColumnPartials:
    """Kernel 2: recompute the probabilities from `row_stats` and reduce them over
    the rows of each split of `rows_per_split` rows (a multiple of block_m).
    Returns one partial per split: attn_sum and below [S, heads, keys], nonzero
    [S, keys], S = ceil(rows / rows_per_split). block_n: keys per program,
    default column_block_n(k)."""
    check_inputs(q, k, q_pos)
    block_n = column_block_n(k) if block_n is None else block_n
    common.check_block("block_m", block_m)
    common.check_block("block_n", block_n)
    if rows_per_split < block_m or rows_per_split % block_m:
        raise ValueError(f"rows_per_split ({rows_per_split}) must be a positive multiple of block_m ({block_m})")
    p = check_threshold(p)
    check_row_stats(q, row_max, row_sumexp)
    heads, n_rows, head_dim = q.shape
    kv_heads, n_keys, _ = k.shape
    qk_scale = common.softmax_scale(scale, head_dim) * common.LOG2E
    n_splits = triton.cdiv(n_rows, rows_per_split)
    dev = q.device
    attn = torch.empty((n_splits, heads, n_keys), dtype=torch.float32, device=dev)
    below = torch.empty((n_splits, heads, n_keys), dtype=torch.int32, device=dev)
    nonzero = torch.empty((n_splits, n_keys), dtype=torch.int32, device=dev)
    if n_rows == 0 or n_keys == 0:
        return ColumnPartials(attn, below, nonzero)
    grid = (n_splits, triton.cdiv(n_keys, block_n), heads)
    _column_stats_kernel[grid](
        q, k, q_pos, row_max, row_sumexp, attn, below, nonzero,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        q_pos.stride(0),
        row_max.stride(0), row_max.stride(1),
        row_sumexp.stride(0), row_sumexp.stride(1),
        attn.stride(0), attn.stride(1), attn.stride(2),
        below.stride(0), below.stride(1), below.stride(2),
        nonzero.stride(0), nonzero.stride(1),
        n_rows, n_keys, qk_scale, p,
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        ROWS_PER_SPLIT=rows_per_split,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=common.block(head_dim),
        UPCAST=common.upcast_for_dot(q.dtype),
    )
    return ColumnPartials(attn, below, nonzero)


def column_block_n(k: torch.Tensor) -> int:
    """The key block of a column-statistics program when the caller gives
    none: each program holds its [head_dim, block_n] keys in registers for
    every row tile, so keys wider than 16 bits take 32 (a float32 block of
    64 spilled on sm_90, at 255 registers a thread even on 8 warps)."""
    return 64 if k.element_size() <= 2 else 32


def reduce_stats(partials: ColumnPartials, kv_heads: int, *, block_n: int = 64) -> ReducedStats:
    """Kernel 3: sum the partials of `column_stats` over the row splits, in a
    fixed order. Returns attn_sum, below, nonzero [heads, keys] and attn_sum_kv
    [kv_heads, keys] (attn_sum summed over the query heads of each kv head)."""
    check_partials(partials, kv_heads)
    common.check_block("block_n", block_n)
    attn_p, below_p, nonzero_p = partials
    n_splits, heads, n_keys = attn_p.shape
    dev = attn_p.device
    attn = torch.zeros((heads, n_keys), dtype=torch.float32, device=dev)
    below = torch.zeros((heads, n_keys), dtype=torch.int32, device=dev)
    nonzero = torch.zeros((heads, n_keys), dtype=torch.int32, device=dev)
    attn_kv = torch.zeros((kv_heads, n_keys), dtype=torch.float32, device=dev)
    if n_splits == 0 or n_keys == 0 or heads == 0:
        return ReducedStats(attn, below, nonzero, attn_kv)
    grid = (triton.cdiv(n_keys, block_n), kv_heads)
    _reduce_kernel[grid](
        attn_p, below_p, nonzero_p, attn, below, nonzero, attn_kv,
        attn_p.stride(0), attn_p.stride(1), attn_p.stride(2),
        below_p.stride(0), below_p.stride(1), below_p.stride(2),
        nonzero_p.stride(0), nonzero_p.stride(1),
        attn.stride(0), attn.stride(1),
        below.stride(0), below.stride(1),
        nonzero.stride(0), nonzero.stride(1),
        attn_kv.stride(0), attn_kv.stride(1),
        n_splits, n_keys,
        GROUP=heads // kv_heads,
        BLOCK_N=block_n,
    )
    return ReducedStats(attn, below, nonzero, attn_kv)


reduce = reduce_stats  # the name VL-Cache A.5 gives the third kernel
