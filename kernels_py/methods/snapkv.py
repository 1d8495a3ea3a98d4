"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for
Before Generation").

The last `window` prompt queries (the observation window) vote for the earlier
tokens: their causal attention is summed over the window rows, smoothed with a
1-D pooling of width `kernel_size` (neighbouring tokens carry context), and
averaged over the query heads of each kv head. The top-scoring earlier tokens
are kept together with the window itself. Compression happens once, at
prefill; generated tokens are all kept, as in the paper and its code
(window 32, kernel 5 and average pooling: init_snapkv's defaults in
FasterDecoding/SnapKV, whose example configuration runs kernel_size=7,
pooling="max"), unless evict_while_decoding. VL-Cache's protocol (protocol="vlcache") sets the
window to 10% of the budget, the recent window its experiments give every
baseline (window=0), and evicts while decoding (the workbench's addition:
the paper runs its baselines at their defaults, SnapKV prefill only). Then
generated tokens score 0 and the observation window keeps its +inf votes:
a generated token past the latest `window` tokens goes before any prompt
token, so generated text is held as a sliding window.
"""

from dataclasses import dataclass

from kernels_py.methods.allocators import Uniform
from kernels_py.methods.base import BudgetedSelection, backend_knob, budget_knob
from kernels_py.methods.caches import RECENT_SHARE, recent_count
from kernels_py.methods.scorers import POOLING, WindowVotes
from kernels_py.params import knob


@dataclass(frozen=True)
class SnapKV(BudgetedSelection):
    """SnapKV: prompt tokens voted for by an observation window of the last prompt queries, pooled; prefill only."""

    name = "snapkv"
    paper = "Li et al., 2024, SnapKV: LLM Knows What You are Looking for Before Generation"

    budget: float = budget_knob()
    window: int = knob("int", 32, "observation window: the last prompt tokens whose queries vote (SnapKV's code: "
                       "32); 0 = 10% of the budget (VL-Cache's protocol for its baselines)", min=0, max=65536,
                       ref="SnapKV code (FasterDecoding/SnapKV); VL-Cache section 5")
    kernel_size: int = knob(
        "int", 5, "width of the pooling over token scores (odd, so scores stay aligned)",
        min=1, max=31, choices=range(1, 32, 2), ref="SnapKV code (FasterDecoding/SnapKV)",
    )
    pooling: str = knob("str", "avg", "pooling of the token scores", choices=tuple(POOLING),
                        ref="SnapKV code (FasterDecoding/SnapKV)")
    backend: str = backend_knob("window statistics")

    protocols = {"vlcache": {"window": 0}}

    def scorer(self):
        return WindowVotes(self.window, self.kernel_size, self.pooling, self.backend, self.budget)

    def allocator(self):
        return Uniform(self.budget)

    def recent(self, capacity):
        # the window itself (its votes are +inf), as much of it as fits
        return self.window or max(1, recent_count(RECENT_SHARE, capacity))

    def check_prompt(self, prompt):
        window = self.scorer().size(prompt.tokens)
        if window >= prompt.tokens:
            raise ValueError(
                f"{self.owner_name()}: window={window} must be shorter than the prompt ({prompt.tokens} tokens)"
            )
