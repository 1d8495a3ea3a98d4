"""The selected-row decode op's contract: one decode step of attention over
rows of a KV cache chosen by an index list per (sequence, kv head), read in
place (A-VL's "specialized operator", section 3.3: compute with the core
rows of a cache that also stores the secondary ones, with no gathered copy).

Inputs: q [B, Hq, M, D]; q_pos [B, M] int; the cache k, v [B, H_kv, S, D]
and pos [B, S] int (each row's absolute position: a row is visible to a
query iff its position is at most the query's); index [B, H_kv, N] int32 or
int64, the rows each kv head attends over, and count [B, H_kv] int, how many
of its N entries are in use (the rest are ignored).

Index lists may be unsorted (attention does not depend on the order; sorted
lists make the loads more contiguous). Duplicates are rejected: a row listed
twice would count twice in the softmax; check_inputs finds them (it sorts
each list, so it waits for the device; check_values=False skips it). An empty
list (count 0) is allowed: that kv head's query rows see nothing, their
output is 0 and their LSE -inf. Entries outside [0, S) are rejected.

Positions must lie below 2**31 - 1 and the listed rows' keys and values must
be finite, hidden ones too (ops/splitk.py says why). Of these, check_inputs
checks only that int64 positions (q_pos, and pos of the listed rows) fit
int32, which the kernel narrows them to. Rows not listed are never read.
"""

from typing import NamedTuple

import torch

from kernels_py.ops.common import FLOAT_DTYPES, INDEX_DTYPES, check_int32_positions


class GatherDecodeOutput(NamedTuple):
    """out [B, Hq, M, D] in q's dtype; lse [B, Hq, M] float32 (natural log,
    -inf for a row that sees nothing)."""

    out: torch.Tensor
    lse: torch.Tensor


def check_inputs(q, q_pos, k, v, pos, index, count, check_values: bool = True) -> None:
    """Raise ValueError / TypeError naming the offending input."""
    for name, t in (("q", q), ("q_pos", q_pos), ("k", k), ("v", v), ("pos", pos), ("index", index), ("count", count)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must be [batch, heads, queries, head_dim], got shape {tuple(q.shape)}")
    batch, heads, queries, head_dim = q.shape
    if head_dim < 1:
        raise ValueError(f"head_dim must be at least 1, got q of shape {tuple(q.shape)}")
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [batch, kv_heads, slots, head_dim], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    _, kv_heads, slots, _ = k.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} (batch, head_dim)")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: fp16, bf16, fp32")
    if index.dim() != 3 or index.shape[:2] != (batch, kv_heads):
        raise ValueError(f"index must be [batch={batch}, kv_heads={kv_heads}, entries], got {tuple(index.shape)}")
    for name, t, shape in (("q_pos", q_pos, (batch, queries)), ("pos", pos, (batch, slots)),
                           ("index", index, tuple(index.shape)), ("count", count, (batch, kv_heads))):
        if t.dtype not in INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    for name, t in (("q_pos", q_pos), ("k", k), ("v", v), ("pos", pos), ("index", index), ("count", count)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if not check_values:
        return
    entries = index.shape[2]
    if count.numel() and ((count < 0) | (count > entries)).any():
        raise ValueError(f"count must lie in [0, {entries}] (the entries of index), got {count.tolist()}")
    check_int32_positions("q_pos", q_pos)
    if not index.numel():
        return
    used = torch.arange(entries, device=index.device) < count[..., None]
    if ((index < 0) | (index >= slots))[used].any():
        raise ValueError(f"index entries in use must lie in [0, {slots}) (the cache's slots)")
    if pos.dtype == torch.int64 and slots:
        listed = torch.where(used, index.to(torch.int64), 0).flatten(1)  # [B, H_kv * N]
        check_int32_positions("pos (of the listed rows)", pos.gather(1, listed), used.flatten(1))
    ordered = torch.where(used, index.to(torch.int64), -1 - torch.arange(entries, device=index.device)).sort(-1).values
    if (ordered[..., 1:] == ordered[..., :-1]).any():
        raise ValueError("an index list holds a row twice: each row may be listed once per kv head (a duplicate "
                         "would count twice in the softmax)")
