"""The uncompressed cache: the reference every method is measured against."""

from dataclasses import dataclass

from kernels_py.methods.allocators import Uniform
from kernels_py.methods.base import TokenSelection
from kernels_py.methods.scorers import Scorer


@dataclass(frozen=True)
class Full(TokenSelection):
    """Full KV cache: keeps every prompt and generated token (the reference)."""

    name = "full"

    def scorer(self):
        return Scorer()

    def allocator(self):
        return Uniform(1.0)
