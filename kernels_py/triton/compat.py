"""Differences between compiled Triton and its CPU interpreter that kernels
must work around. One place, so every kernel handles them the same way."""

import math
import os

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def upcast_for_dot(dtype: torch.dtype) -> bool:
    """The interpreter (Triton 3.6) computes tl.dot on bfloat16 operands as if
    they were raw 16-bit integers; kernels take this as a constexpr and cast
    such operands to float32 before tl.dot. Compiled kernels keep bf16."""
    return dtype == torch.bfloat16 and interpreting()


def softmax_scale(scale, head_dim: int, name: str = "scale") -> float:
    """The softmax scale a launcher uses: head_dim ** -0.5 unless given; a
    given one must be finite and positive."""
    if scale is None:
        return head_dim ** -0.5
    value = float(scale)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite positive number, got {scale}")
    return value
