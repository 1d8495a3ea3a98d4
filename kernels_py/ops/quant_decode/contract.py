"""The quantized decode op's contract: one decode step of attention over a
cache held as one or two quantized segments (ops.kv_quant.QuantKV; e.g.
ZipVL's important tokens in 4 bits and the others in 2, or KIVI's one bit
width) followed by an uncompressed segment (the newest tokens, not yet
quantized, as the model caches them).

Every token is visible to a query iff its position is at most the query's
(padding slots carry kv_quant.PAD_POS and are never visible). The op
returns the output and the natural-log LSE of each query row.

Positions must lie below 2**31 - 1 and the keys and values a kernel reads
must be finite, hidden ones too (ops/splitk.py says why; neither is checked).
"""

from typing import NamedTuple

import torch

from kernels_py.ops.common import FLOAT_DTYPES, INDEX_DTYPES
from kernels_py.ops.kv_quant import QuantKV, check_segment
from kernels_py.ops.lowrank_decode.contract import DenseKV

MAX_SEGMENTS = 2


class QuantDecodeOutput(NamedTuple):
    """out [B, Hq, M, D] in q's dtype; lse [B, Hq, M] float32 (natural log of
    the softmax denominator of the scaled scores; -inf for a row that sees
    nothing)."""

    out: torch.Tensor
    lse: torch.Tensor


def check_inputs(q: torch.Tensor, q_pos: torch.Tensor, segments, dense: DenseKV, check_values: bool = True) -> None:
    """Raise ValueError / TypeError naming the offending input. check_values=False
    skips the checks that read tensor values (lengths), which wait for the device."""
    if q.dim() != 4:
        raise ValueError(f"q must be [batch, heads, queries, head_dim], got shape {tuple(q.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; supported: fp16, bf16, fp32")
    batch, heads, queries, head_dim = q.shape
    if isinstance(segments, QuantKV):
        raise TypeError("segments must be a list of QuantKV (one per bit width), got one QuantKV: pass [segment]")
    if not isinstance(segments, (list, tuple)) or not 1 <= len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"segments must be a list of 1 to {MAX_SEGMENTS} QuantKV, got {segments!r:.80}")
    for i, seg in enumerate(segments):
        name = f"segments[{i}]"
        check_segment(seg, name, check_values=False)
        if seg.k_codes.shape[0] != batch or seg.head_dim != head_dim:
            raise ValueError(f"{name} holds {seg.k_codes.shape[0]} sequences of head_dim {seg.head_dim}; q "
                             f"{tuple(q.shape)} needs {batch} of head_dim {head_dim}")
        if seg.pos.device != q.device:
            raise ValueError(f"{name} is on {seg.pos.device}, q on {q.device}")
        if check_values:  # its lengths, read once the segment is known to be where q is
            check_segment(seg, name)
    if not isinstance(dense, DenseKV):
        raise TypeError(f"dense must be a DenseKV, got {type(dense).__name__}")
    kv_heads = segments[0].kv_heads
    if any(seg.kv_heads != kv_heads for seg in segments):
        raise ValueError(f"the segments disagree on kv heads: {[seg.kv_heads for seg in segments]}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if dense.k.dim() != 4 or dense.k.shape != dense.v.shape:
        raise ValueError(f"dense k and v must both be [batch, kv_heads, slots, head_dim], got {tuple(dense.k.shape)} "
                         f"and {tuple(dense.v.shape)}")
    if (dense.k.shape[0], dense.k.shape[1], dense.k.shape[3]) != (batch, kv_heads, head_dim):
        raise ValueError(f"dense k {tuple(dense.k.shape)} must be [batch={batch}, kv_heads={kv_heads}, slots, "
                         f"head_dim={head_dim}]")
    slots = dense.k.shape[2]
    for name, t in (("dense.k", dense.k), ("dense.v", dense.v)):
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: fp16, bf16, fp32")
    for name, t, shape in (("q_pos", q_pos, (batch, queries)), ("dense.pos", dense.pos, (batch, slots)),
                           ("dense.length", dense.length, (batch,))):
        if t.dtype not in INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    for name, t in (("q_pos", q_pos), ("dense.k", dense.k), ("dense.v", dense.v), ("dense.pos", dense.pos),
                    ("dense.length", dense.length)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if check_values and batch and ((dense.length < 0) | (dense.length > slots)).any():
        raise ValueError(f"dense.length must lie in [0, {slots}], got {dense.length.tolist()}")


__all__ = ["DenseKV", "MAX_SEGMENTS", "QuantDecodeOutput", "QuantKV", "check_inputs"]
