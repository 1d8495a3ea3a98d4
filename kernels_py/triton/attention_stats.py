"""Attention column statistics over a chosen subset of query rows, computed
without writing QK^T, the mask or the attention matrix to memory (VL-Cache
appendix A.5, three kernels run in order):

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

Log domain: the kernels work in base 2. `row_max` is max_j s_ij * log2(e),
where s_ij = scale * q_i . k_j; `row_sumexp` is sum_j 2^(s_ij log2 e - row_max)
= sum_j exp(s_ij - max_j s_ij), which is the same number in either base.
`AttentionStats.row_lse()` gives the natural-log log-sum-exp.

Causality: the selected rows are absolute positions q_pos (any order,
duplicates allowed); row i sees key j iff j <= q_pos[i].

ThresholdFilter (VL-Cache Eq. 1): entry (i, j) is "below" when
A_ij < p * max_j A_ij. With e_ij = 2^(s_ij log2 e - row_max) = A_ij * l_i and
max_j A_ij = 1 / l_i this is e_ij < p, which is what the kernel tests.

Row selectors for the query subsets of the methods built on this kernel
(post_vision_rows, probe_rows, recent_rows, last_row, all_rows) are at the end.
Reference: kernels_py.ref.attention_stats.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels_py.triton import compat

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
POSITION_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256

__all__ = [
    "AttentionStats", "ColumnPartials", "ReducedStats",
    "attention_stats", "row_stats", "column_stats", "reduce_stats", "reduce",
    "post_vision_rows", "probe_rows", "recent_rows", "last_row", "all_rows",
]


@dataclass(frozen=True)
class AttentionStats:
    """Statistics of causal softmax(scale * q k^T) over the selected rows.

    row_max     [H, R] float32, log2 units: max over visible keys of s_ij * log2(e).
    row_sumexp  [H, R] float32: sum over visible keys of exp(s_ij - max_j s_ij).
    attn_sum    [H, N] float32: sum over the selected rows of A_ij.
    below       [H, N] int32: selected rows that see key j with A_ij < p * max_j A_ij.
    nonzero     [H, N] int32: selected rows that see key j (same for every head).
    attn_sum_kv [H_kv, N] float32: attn_sum summed over each kv group's query heads.
    p           the ThresholdFilter's relative threshold.
    """

    row_max: torch.Tensor
    row_sumexp: torch.Tensor
    attn_sum: torch.Tensor
    below: torch.Tensor
    nonzero: torch.Tensor
    attn_sum_kv: torch.Tensor
    p: float

    def row_lse(self) -> torch.Tensor:
        """Natural-log log-sum-exp of the scaled scores of each row, [H, R]."""
        return self.row_max * LN2 + torch.log(self.row_sumexp)

    def normalized(self) -> torch.Tensor:
        """attn_sum / nonzero (ZipCache/ZipVL normalized score); 0 where no row sees the key."""
        return self.attn_sum / self.nonzero.clamp_min(1).to(self.attn_sum.dtype)

    def sparsity(self, per_head: bool = True) -> torch.Tensor:
        """VL-Cache's gamma over the selected rows: the share of causal entries
        the ThresholdFilter zeroes, 1 - (entries >= p * rowmax) / (causal entries)
        = below / causal entries. Per query head [H] float32, or (per_head=False)
        their mean, as Algorithm 1 averages heads. NaN when no row was selected."""
        below = self.below.sum(dim=1, dtype=torch.int64).double()
        causal = self.nonzero.sum(dim=1, dtype=torch.int64).double()
        gamma = (below / causal).float()
        return gamma if per_head else gamma.mean()


class ColumnPartials(NamedTuple):
    """Per-row-split partial results of `column_stats`: attn_sum and below are
    [S, H, N], nonzero is [S, N] (it does not depend on the head)."""

    attn_sum: torch.Tensor
    below: torch.Tensor
    nonzero: torch.Tensor


class ReducedStats(NamedTuple):
    attn_sum: torch.Tensor
    below: torch.Tensor
    nonzero: torch.Tensor
    attn_sum_kv: torch.Tensor


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
                    scale: float | None = None, *, block_m: int = 16, block_n: int = 64,
                    rows_per_split: int = 64) -> AttentionStats:
    """Attention statistics of the selected query rows, without the attention matrix.

    q: [heads, rows, head_dim], the selected query rows (gathered by the caller).
    k: [kv_heads, keys, head_dim]; heads must be a multiple of kv_heads (GQA).
    q_pos: [rows] int32/int64, the absolute position of each row; row i sees
        keys 0 .. q_pos[i]. Any order, duplicates allowed, each in [0, keys).
    p: ThresholdFilter threshold in [0, 1] (VL-Cache: 0.01).
    scale: softmax scale, default head_dim ** -0.5.
    fp16/bf16/fp32 inputs, fp32 accumulation; strided inputs are fine.
    """
    m, l = row_stats(q, k, q_pos, scale, block_m=block_m, block_n=block_n)
    partials = column_stats(q, k, q_pos, m, l, p, scale, block_m=block_m, block_n=block_n,
                            rows_per_split=rows_per_split)
    reduced = reduce_stats(partials, k.shape[0], block_n=block_n)
    return AttentionStats(m, l, reduced.attn_sum, reduced.below, reduced.nonzero, reduced.attn_sum_kv, float(p))


def row_stats(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, scale: float | None = None, *,
              block_m: int = 16, block_n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel 1: row max (log2 units, see the module doc) and sum of exp of the
    causal scores of each selected row, each float32 [heads, rows]."""
    _check_inputs(q, k, q_pos)
    _check_blocks(block_m, block_n)
    heads, n_rows, head_dim = q.shape
    kv_heads, n_keys, _ = k.shape
    qk_scale = compat.softmax_scale(scale, head_dim) * LOG2E
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
        BLOCK_D=_block_d(head_dim),
        UPCAST=compat.upcast_for_dot(q.dtype),
    )
    return m, l


def column_stats(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, row_max: torch.Tensor,
                 row_sumexp: torch.Tensor, p: float = 0.01, scale: float | None = None, *,
                 block_m: int = 16, block_n: int = 64, rows_per_split: int = 64) -> ColumnPartials:
    """Kernel 2: recompute the probabilities from `row_stats` and reduce them over
    the rows of each split of `rows_per_split` rows (a multiple of block_m).
    Returns one partial per split: attn_sum and below [S, heads, keys], nonzero
    [S, keys], S = ceil(rows / rows_per_split)."""
    _check_inputs(q, k, q_pos)
    _check_blocks(block_m, block_n)
    if rows_per_split < block_m or rows_per_split % block_m:
        raise ValueError(f"rows_per_split ({rows_per_split}) must be a positive multiple of block_m ({block_m})")
    p = _check_threshold(p)
    heads, n_rows, head_dim = q.shape
    kv_heads, n_keys, _ = k.shape
    for name, t in (("row_max", row_max), ("row_sumexp", row_sumexp)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (heads, n_rows):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be float32 [{heads}, {n_rows}] as row_stats returns it, got {got}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    qk_scale = compat.softmax_scale(scale, head_dim) * LOG2E
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
        BLOCK_D=_block_d(head_dim),
        UPCAST=compat.upcast_for_dot(q.dtype),
    )
    return ColumnPartials(attn, below, nonzero)


def reduce_stats(partials: ColumnPartials, kv_heads: int, *, block_n: int = 64) -> ReducedStats:
    """Kernel 3: sum the partials of `column_stats` over the row splits, in a
    fixed order. Returns attn_sum, below, nonzero [heads, keys] and attn_sum_kv
    [kv_heads, keys] (attn_sum summed over the query heads of each kv head)."""
    attn_p, below_p, nonzero_p = partials
    if attn_p.dim() != 3 or attn_p.dtype != torch.float32:
        raise ValueError(f"partial attn_sum must be float32 [splits, heads, keys], got {attn_p.dtype} {tuple(attn_p.shape)}")
    n_splits, heads, n_keys = attn_p.shape
    if below_p.dtype != torch.int32 or tuple(below_p.shape) != (n_splits, heads, n_keys):
        raise ValueError(f"partial below must be int32 {[n_splits, heads, n_keys]}, got {below_p.dtype} {tuple(below_p.shape)}")
    if nonzero_p.dtype != torch.int32 or tuple(nonzero_p.shape) != (n_splits, n_keys):
        raise ValueError(f"partial nonzero must be int32 {[n_splits, n_keys]}, got {nonzero_p.dtype} {tuple(nonzero_p.shape)}")
    if not (below_p.device == nonzero_p.device == attn_p.device):
        raise ValueError("the partials must be on one device")
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
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


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _check_blocks(block_m: int, block_n: int) -> None:
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(b, int) or b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's minimum), got {b}")


def _check_threshold(p) -> float:
    p = float(p)
    if not (0.0 <= p <= 1.0):
        raise ValueError(f"p must lie in [0, 1], got {p}")
    return p


def _check_inputs(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor) -> None:
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        raise TypeError("q and k must be torch tensors")
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be 3-D [heads, tokens, head_dim], got q{tuple(q.shape)} k{tuple(k.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; supported: {', '.join(map(str, SUPPORTED_DTYPES))}")
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {k.dtype} but q has {q.dtype}; they must match")
    if q.device != k.device:
        raise ValueError(f"q is on {q.device} but k is on {k.device}")
    heads, n_rows, head_dim = q.shape
    kv_heads, n_keys, k_dim = k.shape
    if k_dim != head_dim:
        raise ValueError(f"head_dim differs: q has {head_dim}, k has {k_dim}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must lie in 1..{MAX_HEAD_DIM}, got {head_dim}")
    if heads == 0 or kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a positive multiple of kv heads ({kv_heads})")
    if not isinstance(q_pos, torch.Tensor):
        raise TypeError(f"q_pos must be a tensor of positions, got {type(q_pos).__name__}")
    if q_pos.dtype not in POSITION_DTYPES:
        raise TypeError(f"q_pos has dtype {q_pos.dtype}; it must be torch.int32 or torch.int64")
    if tuple(q_pos.shape) != (n_rows,):
        raise ValueError(f"q_pos must be 1-D with one position per query row ({n_rows}), got shape {tuple(q_pos.shape)}")
    if q_pos.device != q.device:
        raise ValueError(f"q_pos is on {q_pos.device} but q is on {q.device}")
    if n_rows:
        lo, hi = (int(v) for v in torch.aminmax(q_pos))  # one host sync
        if lo < 0 or hi >= n_keys:
            raise ValueError(f"q_pos must lie in [0, {n_keys}) (the keys), got values in [{lo}, {hi}]")


# ----------------------------------------------------------------------------
# Row selectors: which query rows each method takes statistics over. Each
# returns sorted, distinct int64 positions in [0, n).
# ----------------------------------------------------------------------------


def post_vision_rows(spans, n: int, device=None) -> torch.Tensor:
    """VL-Cache's post-vision rows: the prompt positions after the last visual
    token, last_visual_end .. n-1. `spans` is that end (an int, exclusive), a
    sequence of half-open (start, end) visual spans, or an object with an
    `images` attribute holding them (kernels_py.workloads.synthetic.Spans)."""
    n = _check_n(n)
    if isinstance(spans, int) and not isinstance(spans, bool):
        end = spans
    else:
        images = getattr(spans, "images", spans)
        try:
            ends = [int(e) for _, e in images]
        except (TypeError, ValueError) as err:
            raise TypeError("spans must be an int (last visual end), (start, end) pairs or an object with .images") from err
        if not ends:
            raise ValueError("no visual spans given")
        end = max(ends)
    if not 0 <= end < n:
        raise ValueError(f"the last visual token ends at {end}: no post-vision rows in a prompt of {n} tokens")
    return torch.arange(end, n, dtype=torch.int64, device=device)


def probe_rows(n: int, recent: int = 64, random: int = 64, seed: int = 0, device=None) -> torch.Tensor:
    """ZipVL's probe rows: the `recent` most recent positions plus `random`
    positions drawn without replacement from the earlier ones (fewer if there
    are fewer), from a generator seeded with `seed`; sorted and distinct."""
    n = _check_n(n)
    for name, v in (("recent", recent), ("random", random), ("seed", seed)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    start = max(0, n - recent)
    g = torch.Generator().manual_seed(seed)
    earlier = torch.randperm(start, generator=g)[: min(random, start)]
    rows = torch.unique(torch.cat([earlier, torch.arange(start, n)]))  # sorted
    return rows.to(dtype=torch.int64, device=device)


def recent_rows(n: int, window: int, device=None) -> torch.Tensor:
    """SnapKV's observation window: the last `window` positions (all if fewer)."""
    n = _check_n(n)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    return torch.arange(max(0, n - window), n, dtype=torch.int64, device=device)


def last_row(n: int, device=None) -> torch.Tensor:
    """A-VL: the last prompt token."""
    n = _check_n(n)
    return torch.tensor([n - 1], dtype=torch.int64, device=device)


def all_rows(n: int, device=None) -> torch.Tensor:
    """H2O, LOOK-M: every prompt row."""
    n = _check_n(n)
    return torch.arange(n, dtype=torch.int64, device=device)


def _check_n(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (prompt tokens) must be a positive int, got {n!r}")
    return n
