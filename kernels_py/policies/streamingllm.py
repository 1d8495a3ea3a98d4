"""StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with
Attention Sinks").

Keeps the first `sink_tokens` tokens (attention sinks) and a sliding window
of the most recent ones; no attention statistics at all. The window is what
the budget leaves after the sinks, and the oldest token in it is evicted when
a decode step takes the cache over budget.
"""

from dataclasses import dataclass

import torch

from kernels_py.params import knob
from kernels_py.policies.base import BudgetPolicy, LayerCache


@dataclass(frozen=True)
class StreamingLLM(BudgetPolicy):
    """StreamingLLM: the first tokens (attention sinks) plus a window of the most recent ones."""

    name = "streamingllm"

    sink_tokens: int = knob("int", 4, "initial tokens always kept (the paper uses 4)", min=0, max=1024)

    def prefill(self, layer, q, k, v, spans) -> LayerCache:
        cache = LayerCache.from_prompt(k, v)
        self.enforce_budget(cache)
        return cache

    def survivors(self, cache: LayerCache, capacity: int) -> torch.Tensor:
        sinks = min(self.sink_tokens, capacity)
        window = capacity - sinks
        device = cache.keys.device
        # Held tokens are in position order, so the first ones are the sinks.
        first = torch.arange(sinks, device=device)
        latest = torch.arange(cache.tokens - window, cache.tokens, device=device)
        keep = torch.cat([first, latest])
        return keep.expand(cache.keys.shape[0], -1)
