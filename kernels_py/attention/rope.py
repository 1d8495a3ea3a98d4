"""Rotary position embedding: how a model rotated its keys and queries."""

from dataclasses import dataclass

import torch

ROPE_KINDS = ("default", "mrope")
# transformers' rope_type values that rotate(): "default" (none) and "linear" (positions divided by the factor).
# The others (dynamic, yarn, llama3, longrope, ...) reshape the frequencies or scale cos/sin, which is not redone here.
ROTATED_SCALINGS = ("default", "linear")


@dataclass(frozen=True)
class Rope:
    """A model's RoPE: `default` rotates channel pair (i, i + d/2) by one
    position per token (Llama, LLaVA, Mistral); `mrope` (Qwen2-VL) by three,
    temporal, height and width, each over its own section of the channels,
    so an image token's rotation is not a function of its sequence index.
    `theta` is the base of the frequencies. `scaling` is the config's
    rope_type (transformers' name for a context-extension scheme) and
    `factor` its factor: "linear" (Gemma 3's global layers, 4B and up)
    rotates a token at position p by p / factor; "default" means none."""

    kind: str = "default"
    theta: float = 10000.0
    scaling: str = "default"
    factor: float = 1.0

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"RoPE kind {self.kind!r} is not one of {ROPE_KINDS}")
        if not self.theta > 1:
            raise ValueError(f"RoPE theta must be above 1, got {self.theta}")
        if not isinstance(self.scaling, str) or not self.scaling:
            raise ValueError(f"RoPE scaling must name a rope_type (\"default\" for none), got {self.scaling!r}")
        if not self.factor > 0:
            raise ValueError(f"RoPE scaling factor must be above 0, got {self.factor}")

    @property
    def not_invertible_because(self) -> str | None:
        """Why rotate() cannot apply or undo this RoPE from a token's sequence
        index, or None where it can."""
        if self.kind != "default":
            return (f"{self.kind} rotates by 3-D positions (temporal, height, width): it cannot be applied or undone "
                    f"from a token's sequence index")
        if self.scaling not in ROTATED_SCALINGS:
            return (f"RoPE scaling {self.scaling!r} (factor {self.factor:g}) changes the rotation's frequencies in a "
                    f"way not redone here (only {' and '.join(ROTATED_SCALINGS)} RoPE are): it cannot be applied or "
                    f"undone from a token's sequence index")
        return None

    @property
    def invertible_from_index(self) -> bool:
        """Whether a token's rotation follows from its sequence index alone
        (what a method that undoes and redoes RoPE at token positions needs)."""
        return self.not_invertible_because is None

    @property
    def scaled(self) -> bool:
        """Whether positions are scaled before they rotate (any rope_type but "default")."""
        return self.scaling != "default"

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., T, d] rotated at 1-D `positions` [T] (negative: undone), scaled as the model scales them."""
        if self.not_invertible_because:
            raise ValueError(self.not_invertible_because)
        if self.scaling == "linear":
            positions = positions.to(torch.float64) / self.factor
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
