"""Where each modality sits in the prompt, and how its positions were
encoded into the keys."""

from dataclasses import dataclass, field

import torch

from kernels_py.attention.rope import Rope


@dataclass(frozen=True)
class Spans:
    """Modality spans of the prompt as half-open (start, end) token ranges:
    the system prompt, each image's (or video frame's) visual tokens, and the
    post-vision text after the last image; and the RoPE the model rotated
    the prompt's keys with (its kind and theta: what a method that undoes
    the rotation must use). Every workload sets `rope` from its source (the
    synthetic knobs, a trace's header, the model's config). `videos` says
    which of `images` are a video's frames: per video, the half-open range of
    their indices in `images` (methods may ignore it and treat every frame as
    an image)."""

    system: tuple[int, int]
    images: tuple[tuple[int, int], ...]
    text: tuple[int, int]
    rope: Rope = field(default_factory=Rope)
    videos: tuple[tuple[int, int], ...] = ()

    @property
    def prompt_tokens(self) -> int:
        return self.text[1]

    def visual_positions(self) -> torch.Tensor:
        """[n] int64 positions of every visual token, in order."""
        return torch.cat([torch.arange(start, end) for start, end in self.images])
