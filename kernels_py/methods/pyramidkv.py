"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression
based on Pyramidal Information Funneling"): lower layers attend broadly and
keep more, higher layers keep less. Per-layer budgets decrease linearly from
the first layer to the last (allocators.Pyramid, beta = 20 as in its code),
averaging `budget` so the total bytes match a uniform method's; inside a
layer tokens are chosen as SnapKV does (observation-window votes, pooled),
the window 64 as in its code (10% of the budget under VL-Cache's protocol).
Prefill only, unless evict_while_decoding: then each layer is held at its
share of the tokens seen, the window's length of latest tokens kept."""

from dataclasses import dataclass

from kernels_py.methods.allocators import Pyramid
from kernels_py.methods.base import BudgetedSelection, backend_knob, budget_knob
from kernels_py.methods.caches import RECENT_SHARE, recent_count
from kernels_py.methods.scorers import POOLING, WindowVotes
from kernels_py.params import knob


@dataclass(frozen=True)
class PyramidKV(BudgetedSelection):
    """PyramidKV: budgets falling linearly over layers (same total), SnapKV's votes within a layer."""

    name = "pyramidkv"
    paper = "Cai et al., 2024, PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"

    budget: float = budget_knob(0.2, "mean share of the prompt kept over the layers")
    beta: float = knob("float", 20.0, "the last layer keeps budget / beta (PyramidKV: 20)", min=1.0, max=1e6,
                       ref="PyramidKV section 3")
    window: int = knob("int", 64, "observation window (PyramidKV's code: 64); 0 = 10% of the mean budget (VL-Cache's "
                       "protocol)", min=0, max=65536, ref="PyramidKV code (pyramidkv_utils.py)")
    kernel_size: int = knob("int", 5, "width of the pooling over token scores (odd)", min=1, max=31,
                            choices=range(1, 32, 2))
    pooling: str = knob("str", "avg", "pooling of the token scores", choices=tuple(POOLING))
    backend: str = backend_knob("window statistics")

    protocols = {"vlcache": {"window": 0}}

    def scorer(self):
        return WindowVotes(self.window, self.kernel_size, self.pooling, self.backend, self.budget)

    def allocator(self):
        return Pyramid(self.budget, self.beta)

    def recent(self, capacity):
        # Evicting while decoding: the window's length of latest tokens, as SnapKV.
        return min(capacity, self.window or max(1, recent_count(RECENT_SHARE, capacity)))

    def prefill_recent(self, capacity, tokens):
        # The observation window votes +inf for itself: keep exactly it (its latest tokens where a top
        # layer holds fewer), not 10% of each layer's own capacity.
        return min(capacity, self.scorer().size(tokens))

    def check_prompt(self, prompt):
        window = self.scorer().size(prompt.tokens)
        if window >= prompt.tokens:
            raise ValueError(f"{self.owner_name()}: window={window} must be shorter than the prompt "
                             f"({prompt.tokens} tokens)")
