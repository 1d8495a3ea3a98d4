"""H2O (Zhang et al., 2023, "Heavy-Hitter Oracle").

Keeps the tokens with the largest accumulated attention (heavy hitters) plus
the most recent ones. Prefill scores are the column sums of the causal
attention over all prompt rows; each decode step adds the new query's weights,
and the lowest-scoring token outside the recent window is evicted whenever the
cache exceeds its budget. Scores are per kv head, summed over its query heads.
"""

import math
from dataclasses import dataclass

import torch

from kernels_py.params import knob
from kernels_py.policies.base import BudgetPolicy, LayerCache, group_sum
from kernels_py.ref.attention_mass import attention_mass


@dataclass(frozen=True)
class H2O(BudgetPolicy):
    """H2O: heavy hitters by accumulated attention plus a recent window, evicting while decoding."""

    name = "h2o"

    recent_fraction: float = knob(
        "float", 0.5, "share of the budget reserved for the most recent tokens (H2O: half)", min=0.0, max=1.0
    )

    def prefill(self, layer, q, k, v, spans) -> LayerCache:
        accumulated = group_sum(attention_mass(q, k, q_start=0), k.shape[0])
        cache = LayerCache.from_prompt(k, v, accumulated)
        self.enforce_budget(cache)
        return cache

    def observe(self, layer, cache, weights) -> None:
        cache.scores = cache.scores + group_sum(weights, cache.keys.shape[0])

    def survivors(self, cache: LayerCache, capacity: int) -> torch.Tensor:
        recent = math.floor(self.recent_fraction * capacity + 0.5)  # rounded half up
        older = cache.tokens - recent
        heavy = cache.scores[:, :older].topk(capacity - recent, dim=-1).indices
        recent_window = torch.arange(older, cache.tokens, device=heavy.device).expand(heavy.shape[0], -1)
        return torch.cat([heavy, recent_window], dim=-1)
