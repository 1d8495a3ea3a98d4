"""H2O (Zhang et al., 2023, "Heavy-Hitter Oracle").

Keeps the tokens with the largest accumulated attention (heavy hitters) plus
the most recent ones. Prefill scores are the column sums of the causal
attention over all prompt rows (the attention-statistics op); each decode step
adds the new query's weights, and the lowest-scoring token outside the recent
window is evicted whenever the cache exceeds its budget. Scores are per kv
head, summed over its query heads. The budget is a share of the tokens seen,
as in every budgeted method here (so matched budgets stay matched), so the
cache grows by `budget` tokens a step on average: H2O's generation code
holds a fixed number (heavy_size + recent_size) instead.
"""

from dataclasses import dataclass

from kernels_py.methods.allocators import Uniform
from kernels_py.methods.base import BudgetedSelection, backend_knob, budget_knob, eviction_knob
from kernels_py.methods.caches import recent_count
from kernels_py.methods.prompt import AllRows
from kernels_py.methods.scorers import AttentionMass
from kernels_py.params import knob


@dataclass(frozen=True)
class H2O(BudgetedSelection):
    """H2O: heavy hitters by accumulated attention plus a recent window, evicting while decoding."""

    name = "h2o"
    paper = "Zhang et al., 2023, H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs"

    budget: float = budget_knob()
    recent_fraction: float = knob(
        "float", 0.5, "share of the budget reserved for the most recent tokens (H2O: half)", min=0.0, max=1.0,
        ref="H2O",
    )
    evict_while_decoding: bool = eviction_knob(True, ref="H2O")
    backend: str = backend_knob("prefill statistics")

    protocols = {"vlcache": {"recent_fraction": 0.1}}

    def scorer(self):
        return AttentionMass(AllRows(), accumulate=True, backend=self.backend)

    def allocator(self):
        return Uniform(self.budget)

    def recent(self, capacity):
        return recent_count(self.recent_fraction, capacity)
