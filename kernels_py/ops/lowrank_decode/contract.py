"""The low-rank decode op's contract: one decode step of attention over an
AttentionPack cache, its input types, output and checks.

The cache of each sequence has two segments:

- compressed (`CompressedKV`): K ~= uk[:, :r] @ wk[:r], V ~= uv[:, :r] @ wv[:r]
  from one SVD over all kv heads ([T, H_kv * D]), singular values folded into
  U; token t is rebuilt with its own rank prefix r = rank_k[t] / rank_v[t]
  (attention-aware partial decompression: its importance group's rank).
- uncompressed (`DenseKV`): text, recent tokens and the buffer of tokens not
  yet folded in, stored as the model caches them (keys already rotated).

Keys decomposed *before* RoPE (AttentionPack's reference code) are rotated
after rebuilding, at `comp.pos` ("rotate half", kernels_py.attention.apply_rope);
pass rope_base=None when keys were decomposed after RoPE. The kernel turns
pair i by the float32 angle pos * inv_freq[i], as transformers computes it
(inv_freq from exp2 in float32); the reference takes float64 angles. Both
agree to float rounding at small positions, but the float32 angle's own
error grows with the position: at 120K positions the fused kernel's output
is ~3e-3 (relative) from the reference's in float32, about what a model's
float32 RoPE is from exact.

Positions must lie below 2**31 - 1 and the factors and dense keys and
values finite, hidden ones too (ops/splitk.py says why). Of these,
check_inputs checks only that int64 positions (q_pos, and those of the
tokens within each segment's length) fit int32, which the kernels narrow
them to.

Every implementation returns the output, the LSE and each token's attention
mass (DecodeOutput) in one pass.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kernels_py.ops.common import FLOAT_DTYPES, INDEX_DTYPES, check_int32_positions


@dataclass(frozen=True)
class CompressedKV:
    """Compressed segment of a batch of sequences (T = padded token count).

    uk [B, T, Rk], wk [B, Rk, H_kv * D]; uv [B, T, Rv], wv [B, Rv, H_kv * D].
    rank_k, rank_v [B, T] int: rank prefix of each token, 1..Rk / 1..Rv.
    Columns past a token's rank are never used; the absorbed kernel reads
    (and multiplies by zero) those in the rank's last 16-column chunk, so
    they must hold finite values.
    pos [B, T] int: absolute position of each token (RoPE, causality).
    length [B] int: valid tokens per sequence; later ones are padding.
    """

    uk: torch.Tensor
    wk: torch.Tensor
    uv: torch.Tensor
    wv: torch.Tensor
    rank_k: torch.Tensor
    rank_v: torch.Tensor
    pos: torch.Tensor
    length: torch.Tensor


@dataclass(frozen=True)
class DenseKV:
    """Uncompressed segment: k, v [B, H_kv, S, D]; pos [B, S] int; length [B] int."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    length: torch.Tensor


class DecodeOutput(NamedTuple):
    """out [B, Hq, M, D] in q's dtype; lse [B, Hq, M] float32 (natural log of
    the softmax denominator, scaled scores); mass_comp [B, T] and mass_dense
    [B, S] float32: each token's attention weight averaged over the query heads
    and the M query tokens (AttentionPack Eq. 1's per-step term), 0 for padding;
    both None from a call with mass=False."""

    out: torch.Tensor
    lse: torch.Tensor
    mass_comp: torch.Tensor | None
    mass_dense: torch.Tensor | None


def check_inputs(q: torch.Tensor, q_pos: torch.Tensor, comp: CompressedKV, dense: DenseKV,
                 rope_base: float | None, check_values: bool = True) -> None:
    """Raise ValueError / TypeError naming the offending input. check_values=False
    skips the checks that read tensor values (lengths and ranks in range),
    which wait for the device."""
    for name, seg, kind in (("comp", comp, CompressedKV), ("dense", dense, DenseKV)):
        if not isinstance(seg, kind):
            raise TypeError(f"{name} must be a {kind.__name__}, got {type(seg).__name__}")
    for name, t in (("q", q), ("q_pos", q_pos), *((f"comp.{f}", getattr(comp, f)) for f in comp.__dataclass_fields__),
                    *((f"dense.{f}", getattr(dense, f)) for f in dense.__dataclass_fields__)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must be [batch, heads, queries, head_dim], got shape {tuple(q.shape)}")
    batch, heads, queries, head_dim = q.shape
    if head_dim < 1 or queries < 1:
        # No query token would leave each token's mass an average over no rows (NaN).
        raise ValueError(f"q must have at least one query token and one channel, got shape {tuple(q.shape)}")
    if dense.k.dim() != 4 or dense.k.shape != dense.v.shape:
        raise ValueError(f"dense k and v must both be [batch, kv_heads, slots, head_dim], "
                         f"got {tuple(dense.k.shape)} and {tuple(dense.v.shape)}")
    _, kv_heads, slots, _ = dense.k.shape
    if dense.k.shape[0] != batch or dense.k.shape[3] != head_dim:
        raise ValueError(f"dense k {tuple(dense.k.shape)} does not match q {tuple(q.shape)} (batch, head_dim)")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    for name, t in (("q", q), ("dense.k", dense.k), ("dense.v", dense.v), ("uk", comp.uk), ("wk", comp.wk),
                    ("uv", comp.uv), ("wv", comp.wv)):
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: fp16, bf16, fp32")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if comp.uk.dim() != 3 or comp.uv.dim() != 3 or comp.uk.shape[:2] != comp.uv.shape[:2] \
            or comp.uk.shape[0] != batch:
        raise ValueError(f"uk and uv must be [batch={batch}, tokens, rank], got {tuple(comp.uk.shape)} "
                         f"and {tuple(comp.uv.shape)}")
    tokens = comp.uk.shape[1]
    for name, u, w in (("k", comp.uk, comp.wk), ("v", comp.uv, comp.wv)):
        if u.shape[2] < 1:  # before the shape of w, which would otherwise be blamed
            raise ValueError(f"u{name} has rank 0")
        want = (batch, u.shape[2], kv_heads * head_dim)
        if tuple(w.shape) != want:
            raise ValueError(f"w{name} must be [batch, rank, kv_heads * head_dim] = {want}, got {tuple(w.shape)}")
    for name, t, shape in (("q_pos", q_pos, (batch, queries)), ("comp.rank_k", comp.rank_k, (batch, tokens)),
                           ("comp.rank_v", comp.rank_v, (batch, tokens)), ("comp.pos", comp.pos, (batch, tokens)),
                           ("comp.length", comp.length, (batch,)), ("dense.pos", dense.pos, (batch, slots)),
                           ("dense.length", dense.length, (batch,))):
        if t.dtype not in INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if rope_base is not None and (isinstance(rope_base, bool) or not hasattr(rope_base, "__float__")):
        raise TypeError(f"rope_base must be a number or None, got {type(rope_base).__name__}")
    if rope_base is not None and (head_dim % 2 or not 1 < rope_base < math.inf):  # NaN too: it compares false
        raise ValueError(f"RoPE needs an even head_dim and a finite rope_base > 1, got {head_dim} and {rope_base}")
    if not check_values:
        return
    if ((comp.length < 0) | (comp.length > tokens)).any() or ((dense.length < 0) | (dense.length > slots)).any():
        raise ValueError("segment lengths must lie in [0, padded size]")
    for name, rank, r_max in (("rank_k", comp.rank_k, comp.uk.shape[2]), ("rank_v", comp.rank_v, comp.uv.shape[2])):
        if tokens and ((rank < 1) | (rank > r_max)).any():
            raise ValueError(f"{name} entries must lie in [1, {r_max}]")
    check_int32_positions("q_pos", q_pos)
    for name, seg, size in (("comp.pos", comp, tokens), ("dense.pos", dense, slots)):
        within = torch.arange(size, device=q.device)[None, :] < seg.length[:, None].to(torch.int64)
        check_int32_positions(f"{name} (of the tokens within length)", seg.pos, within)
