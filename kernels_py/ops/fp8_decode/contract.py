"""The FP8 decode op's contract: one decode step of attention over a KV
cache stored as fp8 codes with float32 scales (codec.py), dequantized
where the kernel reads them.

Inputs: q [B, Hq, M, D] fp16/bf16/fp32; q_pos [B, M] int; the codes
k, v [B, H_kv, S, D], float8_e4m3fn or float8_e5m2 (both the same); their
scales k_scale, v_scale float32, either [B, H_kv, S] (one per kv head and
token) or [B, H_kv] (one per kv head; a per-tensor scale is that expanded,
stride 0); pos [B, S] int, each slot's absolute position (a slot is
visible to a query iff its position is at most the query's). The key of
slot n of kv head g is k[b, g, n] * k_scale[b, g(, n)], its value likewise.

Positions must lie below 2**31 - 1 and the keys and values a kernel reads
must be finite, hidden ones too (ops/splitk.py says why; neither is checked).
"""

from typing import NamedTuple

import torch

from kernels_py.ops.common import FLOAT_DTYPES, INDEX_DTYPES
from kernels_py.ops.fp8_decode.codec import CODE_DTYPES, SCALE_DTYPE


class Fp8DecodeOutput(NamedTuple):
    """out [B, Hq, M, D] in q's dtype; lse [B, Hq, M] float32 (natural log,
    -inf for a row that sees nothing)."""

    out: torch.Tensor
    lse: torch.Tensor


def per_token(k_scale: torch.Tensor) -> bool:
    """Whether the scales are one per (kv head, token) rather than per kv head."""
    return k_scale.dim() == 3


def check_inputs(q, q_pos, k, v, k_scale, v_scale, pos) -> None:
    """Raise ValueError / TypeError naming the offending input."""
    for name, t in (("q", q), ("q_pos", q_pos), ("k", k), ("v", v), ("k_scale", k_scale), ("v_scale", v_scale),
                    ("pos", pos)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must be [batch, heads, queries, head_dim], got shape {tuple(q.shape)}")
    batch, heads, queries, head_dim = q.shape
    if head_dim < 1:  # the default softmax scale, head_dim ** -0.5, divided by zero
        raise ValueError(f"head_dim must be at least 1, got q of shape {tuple(q.shape)}")
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [batch, kv_heads, slots, head_dim], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    _, kv_heads, slots, _ = k.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} (batch, head_dim)")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; supported: fp16, bf16, fp32")
    if k.dtype not in CODE_DTYPES or v.dtype != k.dtype:
        raise TypeError(f"k and v must both be float8_e4m3fn or float8_e5m2 codes, got {k.dtype} and {v.dtype} "
                        f"(codec.quantize makes them)")
    scale_shape = (batch, kv_heads, slots) if k_scale.dim() == 3 else (batch, kv_heads)
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t.dtype != SCALE_DTYPE:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if tuple(t.shape) != scale_shape:
            # codec.quantize keeps a per-head or per-tensor scale's token axis: [batch, kv_heads or 1, 1]
            kept = t.dim() == 3 and t.shape[0] == batch and t.shape[1] in (1, kv_heads) and t.shape[2] == 1
            hint = (f" (codec.quantize's per-head or per-tensor scales, [batch, kv_heads or 1, 1], go in as "
                    f"scale[..., 0].expand({batch}, {kv_heads}))") if kept else ""
            raise ValueError(f"{name} must be [batch={batch}, kv_heads={kv_heads}, slots={slots}] (per token) or "
                             f"[batch, kv_heads] (per head; a per-tensor scale expanded), both alike; got "
                             f"k_scale {tuple(k_scale.shape)}, v_scale {tuple(v_scale.shape)}{hint}")
    for name, t, shape in (("q_pos", q_pos, (batch, queries)), ("pos", pos, (batch, slots))):
        if t.dtype not in INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    for name, t in (("q_pos", q_pos), ("k", k), ("v", v), ("k_scale", k_scale), ("v_scale", v_scale), ("pos", pos)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
