"""The uncompressed cache: the reference every policy is measured against."""

from dataclasses import dataclass

from kernels_py.policies.base import LayerCache, Policy


@dataclass(frozen=True)
class Full(Policy):
    """Full KV cache: keeps every prompt and generated token (the reference)."""

    name = "full"

    def prefill(self, layer, q, k, v, spans) -> LayerCache:
        return LayerCache.from_prompt(k, v)
