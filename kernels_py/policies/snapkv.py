"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for
Before Generation").

The last `window` prompt queries (the observation window) vote for the earlier
tokens: their causal attention is summed over the window rows, smoothed with a
1-D pooling of width `kernel_size` (neighbouring tokens carry context), and
averaged over the query heads of each kv head. The top-scoring earlier tokens
are kept together with the window itself. Compression happens once, at
prefill; generated tokens are all kept, as in the paper and its code
(defaults from FasterDecoding/SnapKV: window 32, kernel 5, average pooling).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels_py.backend import BACKENDS
from kernels_py.params import knob
from kernels_py.policies import scoring
from kernels_py.policies.base import BudgetPolicy, LayerCache

POOLING = {"avg": F.avg_pool1d, "max": F.max_pool1d}


@dataclass(frozen=True)
class SnapKV(BudgetPolicy):
    """SnapKV: prompt tokens voted for by an observation window of the last prompt queries, pooled; prefill only."""

    name = "snapkv"

    window: int = knob("int", 32, "observation window: the last prompt tokens whose queries vote", min=1, max=65536)
    kernel_size: int = knob(
        "int", 5, "width of the pooling over token scores (odd, so scores stay aligned)",
        min=1, max=31, choices=range(1, 32, 2),
    )
    pooling: str = knob("str", "avg", "pooling of the token scores", choices=tuple(POOLING))
    backend: str = knob("str", "auto", "window statistics: Triton kernel (on CUDA when auto) or PyTorch reference",
                        choices=BACKENDS)

    def prefill(self, layer, q, k, v, spans) -> LayerCache:
        prompt = k.shape[1]
        if self.window >= prompt:
            raise ValueError(
                f"{self.owner_name()}: window={self.window} must be shorter than the prompt ({prompt} tokens)"
            )
        cache = LayerCache.from_prompt(k, v, self._prefix_scores(q, k))
        self.enforce_budget(cache)
        cache.scores = None  # nothing to maintain while decoding
        return cache

    def evict(self, layer, cache) -> None:
        """Generated tokens are never evicted."""

    def survivors(self, cache: LayerCache, capacity: int) -> torch.Tensor:
        prefix = cache.tokens - self.window
        window = min(self.window, capacity)
        voted = cache.scores[:, :prefix].topk(capacity - window, dim=-1).indices
        recent = torch.arange(cache.tokens - window, cache.tokens, device=voted.device).expand(voted.shape[0], -1)
        return torch.cat([voted, recent], dim=-1)

    def _prefix_scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """[kv_heads, T] scores; the window's own entries are padding (always kept)."""
        heads, prompt, _ = q.shape
        kv_heads = k.shape[0]
        prefix = prompt - self.window
        rows = scoring.recent_rows(prompt, self.window)
        votes = scoring.stats(q, k, rows, backend=self.backend).attn_sum[:, :prefix]
        pooled = POOLING[self.pooling](votes[:, None], self.kernel_size, stride=1, padding=self.kernel_size // 2)[:, 0]
        per_kv_head = pooled.reshape(kv_heads, heads // kv_heads, prefix).mean(dim=1)
        return torch.cat([per_kv_head, per_kv_head.new_full((kv_heads, self.window), float("inf"))], dim=-1)
