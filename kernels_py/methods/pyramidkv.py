"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression
based on Pyramidal Information Funneling"): lower layers attend broadly and
keep more, higher layers keep less. Every layer keeps the observation window
(the last prompt tokens, whose queries vote) and a share of the rest that
decreases linearly from the first layer to the last (allocators.Pyramid,
beta = 20), the mean over layers being `budget`, so the total bytes match a
uniform method's: the authors' code (KVCache-Factory, pyramidkv_utils.py)
schedules the budget left after the window and adds the window to every
layer; where the mean budget holds no more than the window every layer keeps
the mean (kvpress's PyramidKVPress falls back to SnapKV too, more often: it
schedules the whole budget, window included). Inside a layer
tokens are chosen as SnapKV does (window votes, pooled). The defaults are
what the authors' experiments run (run_longbench.py: window 8, kernel 7,
max pooling; the class defaults there are 64, 5 and average); VL-Cache's
protocol sets the window to 10% of the mean budget. Prefill only, unless
evict_while_decoding: then each layer is held at its share of the tokens
seen, the window's length of latest tokens kept (window = 0: 10% of the
mean budget of the tokens seen, as at prefill; generated tokens score 0,
so beyond that window they go first, as SnapKV's)."""

from dataclasses import dataclass

from kernels_py.methods.allocators import Pyramid
from kernels_py.methods.base import BudgetedSelection, backend_knob, budget_knob
from kernels_py.methods.scorers import POOLING, WindowVotes
from kernels_py.params import knob


@dataclass(frozen=True)
class PyramidKV(BudgetedSelection):
    """PyramidKV: budgets falling linearly over layers (same total), SnapKV's votes within a layer."""

    name = "pyramidkv"
    paper = "Cai et al., 2024, PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"

    budget: float = budget_knob(0.2, "mean share of the prompt kept over the layers")
    beta: float = knob("float", 20.0, "the last layer keeps 1 / beta of what the mean budget leaves after the "
                       "window, besides the window (PyramidKV: 20)", min=1.0, max=1e6,
                       ref="PyramidKV section 3")
    window: int = knob("int", 8, "observation window, kept in every layer besides its scheduled share (PyramidKV's "
                       "experiments: 8); 0 = 10% of the mean budget (VL-Cache's protocol)", min=0, max=65536,
                       ref="PyramidKV code (KVCache-Factory run_longbench.py, pyramidkv_utils.py)")
    kernel_size: int = knob("int", 7, "width of the pooling over token scores (odd; PyramidKV's experiments: 7)",
                            min=1, max=31, choices=range(1, 32, 2), ref="PyramidKV code (run_longbench.py)")
    pooling: str = knob("str", "max", "pooling of the token scores (PyramidKV's experiments: max)",
                        choices=tuple(POOLING), ref="PyramidKV code (run_longbench.py)")
    backend: str = backend_knob("window statistics")

    protocols = {"vlcache": {"window": 0}}

    def scorer(self):
        return WindowVotes(self.window, self.kernel_size, self.pooling, self.backend, self.budget)

    def allocator(self):
        return Pyramid(self.budget, self.beta, self.scorer().size)

    def recent_at(self, capacity, seen):
        # The observation window votes +inf for itself: keep exactly it (its latest tokens where a layer holds
        # fewer: every layer at a mean budget below the window), at prefill and, evicting while decoding, as SnapKV
        # holds it; window = 0 is 10% of the mean budget of the tokens seen, not of each layer's own capacity.
        return min(capacity, self.scorer().size(seen))

    def check_prompt(self, prompt):
        window = self.scorer().size(prompt.tokens)
        if window >= prompt.tokens:
            raise ValueError(f"{self.owner_name()}: window={window} must be shorter than the prompt "
                             f"({prompt.tokens} tokens)")
