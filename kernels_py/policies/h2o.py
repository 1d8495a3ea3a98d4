"""H2O (Zhang et al., 2023, "Heavy-Hitter Oracle").

Keeps the tokens with the largest accumulated attention (heavy hitters) plus
the most recent ones. Prefill scores are the column sums of the causal
attention over all prompt rows (the attention-statistics kernel, see
kernels_py.policies.scoring); each decode step adds the new query's weights,
and the lowest-scoring token outside the recent window is evicted whenever the
cache exceeds its budget. Scores are per kv head, summed over its query heads.
"""

import math
from dataclasses import dataclass

import torch

from kernels_py.backend import BACKENDS
from kernels_py.params import knob
from kernels_py.policies import scoring
from kernels_py.policies.base import BudgetPolicy, LayerCache, group_sum, keep_top_and_recent


@dataclass(frozen=True)
class H2O(BudgetPolicy):
    """H2O: heavy hitters by accumulated attention plus a recent window, evicting while decoding."""

    name = "h2o"

    recent_fraction: float = knob(
        "float", 0.5, "share of the budget reserved for the most recent tokens (H2O: half)", min=0.0, max=1.0
    )

    backend: str = knob("str", "auto", "prefill statistics: Triton kernel (on CUDA when auto) or PyTorch reference",
                        choices=BACKENDS)

    def prefill(self, layer, q, k, v, spans) -> LayerCache:
        rows = scoring.all_rows(k.shape[1])
        accumulated = scoring.stats(q, k, rows, backend=self.backend).attn_sum_kv
        cache = LayerCache.from_prompt(k, v, accumulated)
        self.enforce_budget(cache)
        return cache

    def observe(self, layer, cache, weights) -> None:
        cache.scores = cache.scores + group_sum(weights, cache.keys.shape[0])

    def survivors(self, cache: LayerCache, capacity: int) -> torch.Tensor:
        recent = math.floor(self.recent_fraction * capacity + 0.5)  # rounded half up
        return keep_top_and_recent(cache.scores, capacity, recent)
