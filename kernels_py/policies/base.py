"""The policy interface: how a compression method builds and maintains one
layer's KV cache.

A policy is a small frozen dataclass of parameters (`knob` fields, validated on
construction) with two entry points, in the spirit of NVIDIA kvpress presses:

- `prefill(layer, q, k, v, spans) -> LayerCache`: score the prompt and keep a
  subset of its tokens. The cache holds *gathered* tensors, so memory really shrinks.
- `decode(layer, cache, q_t, k_t, v_t) -> output`: one generation step: append
  the new token, attend over what is held, let the policy update its statistics
  (`observe`), then drop tokens if it is over budget (`evict`).

Shapes: q [heads, T, d]; k, v [kv_heads, T, d]; q_t [heads, 1, d];
k_t, v_t [kv_heads, 1, d]. GQA: query head h reads kv head h // (heads // kv_heads),
and per-token statistics are kept per kv head, summed over its query heads.
Prompt tokens sit at positions 0..T-1 and step s at position T + s.
"""

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kernels_py.metrics import tensor_bytes
from kernels_py.params import Knobs, knob
from kernels_py.workloads import Spans


@dataclass
class LayerCache:
    """What a policy holds for one layer. Tokens are in position order per kv head;
    kv heads may hold different tokens but always the same number."""

    keys: torch.Tensor  # [kv_heads, n, d]
    values: torch.Tensor  # [kv_heads, n, d]
    positions: torch.Tensor  # [kv_heads, n] int64, where each held token sits in the sequence
    scores: torch.Tensor | None  # [kv_heads, n] float32 per-token statistics, if the policy keeps any
    seen: int  # tokens this layer has processed: prompt plus generated
    notes: dict[str, float] = field(default_factory=dict)  # per-layer facts a policy reports (layer_metrics)

    @classmethod
    def from_prompt(cls, k: torch.Tensor, v: torch.Tensor, scores: torch.Tensor | None = None) -> "LayerCache":
        kv_heads, tokens, _ = k.shape
        positions = torch.arange(tokens, device=k.device).expand(kv_heads, -1)
        return cls(k, v, positions, scores, tokens)

    @property
    def tokens(self) -> int:
        return self.keys.shape[1]

    def keep(self, indices: torch.Tensor) -> None:
        """Keep only the tokens at `indices` ([kv_heads, n'] into the held tokens),
        as new, smaller tensors."""
        indices = indices.sort(dim=-1).values
        channels = indices[..., None].expand(-1, -1, self.keys.shape[-1])
        self.keys = self.keys.gather(1, channels)
        self.values = self.values.gather(1, channels)
        self.positions = self.positions.gather(1, indices)
        if self.scores is not None:
            self.scores = self.scores.gather(1, indices)

    def append(self, k_t: torch.Tensor, v_t: torch.Tensor) -> None:
        """Add the token being generated ([kv_heads, 1, d]) at the next position."""
        kv_heads = self.keys.shape[0]
        self.keys = torch.cat([self.keys, k_t.to(self.keys.dtype)], dim=1)
        self.values = torch.cat([self.values, v_t.to(self.values.dtype)], dim=1)
        position = torch.full((kv_heads, 1), self.seen, dtype=self.positions.dtype, device=self.positions.device)
        self.positions = torch.cat([self.positions, position], dim=1)
        if self.scores is not None:
            self.scores = torch.cat([self.scores, self.scores.new_zeros(kv_heads, 1)], dim=1)
        self.seen += 1


def attend(q_t: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One query token over held K/V. Returns the output [heads, 1, d] in q's dtype
    and the attention weights [heads, n] in float32 (for policy statistics)."""
    heads, _, head_dim = q_t.shape
    group = heads // keys.shape[0]
    keys = keys.float().repeat_interleave(group, dim=0)
    values = values.float().repeat_interleave(group, dim=0)
    weights = torch.softmax(q_t.float() @ keys.transpose(1, 2) / math.sqrt(head_dim), dim=-1)
    return (weights @ values).to(q_t.dtype), weights[:, 0]


def group_sum(per_query_head: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[heads, n] -> [kv_heads, n]: sum over the query heads sharing each kv head."""
    heads, n = per_query_head.shape
    return per_query_head.reshape(kv_heads, heads // kv_heads, n).sum(dim=1)


def keep_top_and_recent(scores: torch.Tensor, capacity: int, recent: int) -> torch.Tensor:
    """[kv_heads, capacity] indices: the `recent` last tokens plus the
    `capacity - recent` highest-scoring earlier ones. scores: [kv_heads, n]."""
    tokens = scores.shape[1]
    recent = min(recent, capacity)
    older = tokens - recent
    top = scores[:, :older].topk(capacity - recent, dim=-1).indices
    window = torch.arange(older, tokens, device=scores.device).expand(scores.shape[0], -1)
    return torch.cat([top, window], dim=-1)


def kept_count(fraction: float, tokens: int) -> int:
    """ceil(fraction * tokens), at least 1. The product is rounded first so that
    e.g. 0.3 * 10 = 3.0000000000000004 keeps 3, not 4."""
    return max(1, math.ceil(round(fraction * tokens, 9)))


class Policy(Knobs, ABC):
    """A KV-cache compression method; subclasses are frozen dataclasses of knobs."""

    name: ClassVar[str]

    @classmethod
    def owner_name(cls) -> str:
        return f"policy {cls.name!r}"

    @classmethod
    def summary(cls) -> str:
        """First paragraph of the class docstring, on one line (the schema's doc)."""
        return " ".join(cls.__doc__.strip().split("\n\n")[0].split())

    @abstractmethod
    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: Spans) -> LayerCache:
        """Build the layer's cache from the prompt."""

    def prefill_all(self, q: list[torch.Tensor], k: list[torch.Tensor], v: list[torch.Tensor],
                    spans: Spans) -> list[LayerCache]:
        """Build every layer's cache once the whole prompt has been seen (lists
        indexed by layer). Methods that compare layers (VL-Cache's budget
        allocation) override this; the default prefills layer by layer."""
        return [self.prefill(layer, *qkv, spans) for layer, qkv in enumerate(zip(q, k, v))]

    def decode(
        self, layer: int, cache: LayerCache, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor
    ) -> torch.Tensor:
        """One decode step; updates `cache` in place and returns the attention output [heads, 1, d]."""
        cache.append(k_t, v_t)
        output, weights = attend(q_t, cache.keys, cache.values)
        self.observe(layer, cache, weights)
        self.evict(layer, cache)
        return output

    def observe(self, layer: int, cache: LayerCache, weights: torch.Tensor) -> None:
        """Update per-token statistics from this step's weights [heads, n]; default: none."""

    def evict(self, layer: int, cache: LayerCache) -> None:
        """Drop tokens after a step if over budget; default: keep everything."""

    def cache_bytes(self, cache: LayerCache) -> int:
        """Bytes of K and V held."""
        return tensor_bytes(cache.keys, cache.values)

    def layer_metrics(self, layer: int, cache: LayerCache) -> dict[str, float]:
        """Method-specific numbers about one layer after the last step (e.g. the
        budget it was given); reported per layer and averaged. Default: the
        cache's notes."""
        return dict(cache.notes)


@dataclass(frozen=True)
class BudgetPolicy(Policy):
    """A policy that holds a fraction `budget` of the tokens seen so far.

    After prefill it keeps ceil(budget * T) of the T prompt tokens. Policies that
    evict while decoding hold ceil(budget * seen) tokens after each step, so the
    ratio stays constant and budget = 1.0 never evicts (equals the full cache).
    """

    budget: float = knob("float", 0.2, "fraction of the tokens seen that the cache keeps", min=0.001, max=1.0)

    def capacity(self, seen: int) -> int:
        return kept_count(self.budget, seen)

    def enforce_budget(self, cache: LayerCache) -> None:
        capacity = self.capacity(cache.seen)
        if cache.tokens > capacity:
            cache.keep(self.survivors(cache, capacity))

    def evict(self, layer: int, cache: LayerCache) -> None:
        self.enforce_budget(cache)

    @abstractmethod
    def survivors(self, cache: LayerCache, capacity: int) -> torch.Tensor:
        """[kv_heads, capacity] indices of the held tokens to keep."""
