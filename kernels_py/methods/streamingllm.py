"""StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with
Attention Sinks").

Keeps the first `sink_tokens` tokens (attention sinks) and a sliding window
of the most recent ones; no attention statistics at all. The window is what
the budget leaves after the sinks, and the oldest token in it is evicted when
a decode step takes the cache over budget; the budget being a share of the
tokens seen (every budgeted method's), the window grows by `budget` tokens
a step on average, where the paper's cache has a fixed size (start_size +
recent_size in its code). Kept keys keep the rotation of
their original positions: the paper re-assigns positions within the cache,
which needs keys cached before RoPE (kvpress's StreamingLLMPress does not
either; its KeyRerotationPress does).
"""

from dataclasses import dataclass

from kernels_py.methods.allocators import Uniform
from kernels_py.methods.base import BudgetedSelection, budget_knob, eviction_knob
from kernels_py.methods.scorers import Earliest
from kernels_py.params import knob


@dataclass(frozen=True)
class StreamingLLM(BudgetedSelection):
    """StreamingLLM: the first tokens (attention sinks) plus a window of the most recent ones."""

    name = "streamingllm"
    paper = "Xiao et al., 2024, Efficient Streaming Language Models with Attention Sinks"

    sink_tokens: int = knob("int", 4, "initial tokens always kept (the paper uses 4)", min=0, max=1024,
                            ref="StreamingLLM")
    budget: float = budget_knob()
    evict_while_decoding: bool = eviction_knob(True, ref="StreamingLLM")

    def scorer(self):
        return Earliest()

    def allocator(self):
        return Uniform(self.budget)

    def recent(self, capacity):
        return capacity - min(self.sink_tokens, capacity)
