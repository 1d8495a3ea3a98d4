"""The attention-statistics op's contract: what the two passes compute,
the types they return, the checks every implementation applies to its inputs,
and the row selectors that say which query rows each method takes statistics
over.

Statistics of causal softmax(scale * q k^T) over a chosen subset of query rows
(VL-Cache appendix A.5), without writing QK^T, the mask or the attention matrix
to memory (see kernel.py for how).

Log domain: the kernels work in base 2. `row_max` is max_j s_ij * log2(e),
where s_ij = scale * q_i . k_j; `row_sumexp` is sum_j 2^(s_ij log2 e - row_max)
= sum_j exp(s_ij - max_j s_ij), which is the same number in either base.
`AttentionStats.row_lse()` gives the natural-log log-sum-exp.

Causality: the selected rows are absolute positions q_pos (any order,
duplicates allowed); row i sees key j iff j <= q_pos[i].

ThresholdFilter (VL-Cache Eq. 1): entry (i, j) is "below" when
A_ij < p * max_j A_ij. With e_ij = 2^(s_ij log2 e - row_max) = A_ij * l_i and
max_j A_ij = 1 / l_i this is e_ij < p, which is what the kernel tests.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kernels_py.ops.common import FLOAT_DTYPES, INDEX_DTYPES, LN2

MAX_HEAD_DIM = 256


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


class ReducedStats(NamedTuple):
    """What the column pass returns: attn_sum, below, nonzero [H, N] and
    attn_sum_kv [H_kv, N], as in AttentionStats."""

    attn_sum: torch.Tensor
    below: torch.Tensor
    nonzero: torch.Tensor
    attn_sum_kv: torch.Tensor


def check_threshold(p) -> float:
    p = float(p)
    if not (0.0 <= p <= 1.0):
        raise ValueError(f"p must lie in [0, 1], got {p}")
    return p


def check_inputs(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor,
                 pos_range: tuple[int, int] | None = None, max_head_dim: int | None = MAX_HEAD_DIM) -> tuple[int, int]:
    """Checks the inputs; returns the smallest and largest position ((0, -1)
    when no row is selected): `pos_range` where the caller gives them (no
    host sync), else read from q_pos. max_head_dim: the kernels' widest
    head (None: any, as the reference takes)."""
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        raise TypeError("q and k must be torch tensors")
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be 3-D [heads, tokens, head_dim], got q{tuple(q.shape)} k{tuple(k.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; supported: {', '.join(map(str, FLOAT_DTYPES))}")
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {k.dtype} but q has {q.dtype}; they must match")
    if q.device != k.device:
        raise ValueError(f"q is on {q.device} but k is on {k.device}")
    heads, n_rows, head_dim = q.shape
    kv_heads, n_keys, k_dim = k.shape
    if k_dim != head_dim:
        raise ValueError(f"head_dim differs: q has {head_dim}, k has {k_dim}")
    if head_dim < 1 or (max_head_dim is not None and head_dim > max_head_dim):
        bounds = "be at least 1" if max_head_dim is None else f"lie in 1..{max_head_dim}"
        raise ValueError(f"head_dim must {bounds}, got {head_dim}")
    if heads == 0 or kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a positive multiple of kv heads ({kv_heads})")
    if not isinstance(q_pos, torch.Tensor):
        raise TypeError(f"q_pos must be a tensor of positions, got {type(q_pos).__name__}")
    if q_pos.dtype not in INDEX_DTYPES:
        raise TypeError(f"q_pos has dtype {q_pos.dtype}; it must be torch.int32 or torch.int64")
    if tuple(q_pos.shape) != (n_rows,):
        raise ValueError(f"q_pos must be 1-D with one position per query row ({n_rows}), got shape {tuple(q_pos.shape)}")
    if q_pos.device != q.device:
        raise ValueError(f"q_pos is on {q_pos.device} but q is on {q.device}")
    if n_rows and pos_range is not None:
        if not (isinstance(pos_range, tuple) and len(pos_range) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in pos_range)):
            raise TypeError(f"pos_range must be a (smallest, largest) pair of ints, got {pos_range!r}")
        lo, hi = pos_range
        if not 0 <= lo <= hi < n_keys:
            raise ValueError(f"pos_range must lie in [0, {n_keys}) (the keys) with smallest <= largest, got "
                             f"{pos_range}")
        return lo, hi
    if n_rows:
        lo, hi = (int(v) for v in torch.aminmax(q_pos))  # one host sync
        if lo < 0 or hi >= n_keys:
            raise ValueError(f"q_pos must lie in [0, {n_keys}) (the keys), got values in [{lo}, {hi}]")
        return lo, hi
    return 0, -1


def check_row_stats(q: torch.Tensor, row_max, row_sumexp) -> None:
    """row_max and row_sumexp as row_stats returns them for q."""
    heads, n_rows, _ = q.shape
    for name, t in (("row_max", row_max), ("row_sumexp", row_sumexp)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (heads, n_rows):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be float32 [{heads}, {n_rows}] as row_stats returns it, got {got}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


# ----------------------------------------------------------------------------
# Row selectors: which query rows each method takes statistics over. Each
# returns sorted, distinct int64 positions in [0, n).
# ----------------------------------------------------------------------------


def post_vision_rows(spans, n: int, device=None) -> torch.Tensor:
    """VL-Cache's post-vision rows: the prompt positions after the last visual
    token, last_visual_end .. n-1. `spans` is that end (an int, exclusive), a
    sequence of half-open (start, end) visual spans, or an object with an
    `images` attribute holding them (kernels_py.attention.Spans)."""
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
