"""Rotary position embedding: how a model rotated its keys and queries."""

from dataclasses import dataclass

import torch

ROPE_KINDS = ("default", "mrope")


@dataclass(frozen=True)
class Rope:
    """A model's RoPE: `default` rotates channel pair (i, i + d/2) by one
    position per token (Llama, LLaVA, Mistral); `mrope` (Qwen2-VL) by three,
    temporal, height and width, each over its own section of the channels,
    so an image token's rotation is not a function of its sequence index.
    `theta` is the base of the frequencies."""

    kind: str = "default"
    theta: float = 10000.0

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"RoPE kind {self.kind!r} is not one of {ROPE_KINDS}")
        if not self.theta > 1:
            raise ValueError(f"RoPE theta must be above 1, got {self.theta}")

    @property
    def invertible_from_index(self) -> bool:
        """Whether a token's rotation follows from its sequence index alone
        (what a method that undoes and redoes RoPE at token positions needs)."""
        return self.kind == "default"

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., T, d] rotated at 1-D `positions` [T] (negative: undone)."""
        if not self.invertible_from_index:
            raise ValueError(f"{self.kind} rotates by 3-D positions (temporal, height, width): it cannot be "
                             f"applied or undone from a token's sequence index")
        return apply_rope(x, positions, self.theta)


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
