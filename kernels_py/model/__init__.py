"""Model concepts that methods, workloads and ops share: where each modality
sits in the prompt, rotary position embedding, and how query heads map onto
key/value heads (GQA).

GQA convention everywhere: query head h reads kv head h // (heads // kv_heads).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Spans:
    """Modality spans of the prompt as half-open (start, end) token ranges:
    the system prompt, each image's (or video frame's) visual tokens, and the
    post-vision text after the last image."""

    system: tuple[int, int]
    images: tuple[tuple[int, int], ...]
    text: tuple[int, int]

    @property
    def prompt_tokens(self) -> int:
        return self.text[1]

    def visual_positions(self) -> torch.Tensor:
        """[n] int64 positions of every visual token, in order."""
        return torch.cat([torch.arange(start, end) for start, end in self.images])


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding, "rotate half" convention (Llama/LLaVA): channel pair
    (i, i + d/2) turns by positions * base ** (-2i / d). x: [..., T, d]; negative
    positions undo the rotation."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2 / x.shape[-1])
    angles = positions.to(device=x.device, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(x.dtype)
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated_half * sin


def expand_kv(x: torch.Tensor, heads: int, dim: int = 0) -> torch.Tensor:
    """Repeat each kv head's slice of x along `dim` for the query heads that
    read it: [kv_heads, ...] -> [heads, ...]."""
    return x.repeat_interleave(heads // x.shape[dim], dim=dim)


def group_sum(per_query_head: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[heads, n] -> [kv_heads, n]: sum over the query heads sharing each kv head."""
    heads, n = per_query_head.shape
    return per_query_head.reshape(kv_heads, heads // kv_heads, n).sum(dim=1)


__all__ = ["Spans", "apply_rope", "expand_kv", "group_sum"]
