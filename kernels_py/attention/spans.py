"""Where each modality sits in the prompt, and how its positions were
encoded into the keys."""

import operator
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

    def __post_init__(self):
        # Spans built by hand: lists become tuples (hashable, as every workload's are), and what is not a span,
        # such as images=(8, 152) for one image, is named here instead of where a method unpacks it.
        for name in ("system", "text"):
            object.__setattr__(self, name, _pair(name, getattr(self, name)))
        for name in ("images", "videos"):
            value, one = getattr(self, name), name[:-1]
            if not isinstance(value, (tuple, list)) or any(not isinstance(v, (tuple, list)) for v in value):
                hint = f": for one {one}, {name}=({tuple(value)!r},)" if isinstance(value, (tuple, list)) \
                    and len(value) == 2 else ""
                raise TypeError(f"spans.{name} must be a sequence of (start, end) pairs, one per {one}, got "
                                f"{value!r}{hint}")
            object.__setattr__(self, name, tuple(_pair(f"{name}[{i}]", v) for i, v in enumerate(value)))
        bounds = [self.system[1], *(x for span in self.images for x in span), self.text[0]]
        if bounds != sorted(bounds):
            raise ValueError(f"spans must follow each other: the system prompt, the images in order and without "
                             f"overlap, then the text; got system {self.system}, images {self.images}, text "
                             f"{self.text}")

    @property
    def prompt_tokens(self) -> int:
        return self.text[1]

    def visual_positions(self) -> torch.Tensor:
        """[n] int64 positions of every visual token, in order; empty for a
        prompt without images (a text-only request)."""
        if not self.images:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([torch.arange(start, end) for start, end in self.images])


def _pair(name: str, value) -> tuple[int, int]:
    """A half-open (start, end) token range as a tuple of two ints, 0 <= start <= end."""
    try:
        start, end = (operator.index(x) for x in value)
    except (TypeError, ValueError):
        raise TypeError(f"spans.{name} must be a (start, end) pair of ints, got {value!r}") from None
    if not 0 <= start <= end:
        raise ValueError(f"spans.{name} must be a (start, end) range with 0 <= start <= end, got {value!r}")
    return start, end
