"""LOOK-M (Wan et al., 2024, "LOOK-M: Look-Once Optimization in KV Cache for
Efficient Multimodal Long-Context Inference"): once, at prefill, each layer
keeps a recent window of alpha_1 of the prompt and the alpha_2 of it with
the highest text-prior scores (Eq. 4-8: accumulated prompt attention, text
tokens raised by the maximum so image tokens are evicted first), and merges
every evicted token's key and value into its most similar kept token
(methods/merging.py: averaged, pivotal or weighted, Eq. 9-12). Decoding
appends and evicts nothing.

Where the paper is open: scores and merges are per kv head (each kv head
keeps its own tokens, as the other eviction methods here do); when the text
alone exceeds alpha_2 of the prompt, the top alpha_2 are text tokens and
some text is evicted too (the cache size S = N + M holds).
"""

from dataclasses import dataclass

import torch

from kernels_py.methods.base import Method, backend_knob
from kernels_py.methods.caches import KeptTokens, kept_count, top_and_recent
from kernels_py.methods.merging import MERGES, merge
from kernels_py.methods.prompt import Prompt
from kernels_py.methods.scorers import TextPrior
from kernels_py.params import Rule, knob


@dataclass(frozen=True)
class LookM(Method):
    """LOOK-M: text-prior eviction at prefill, each evicted token's K/V merged into its nearest kept token."""

    name = "lookm"
    paper = ("Wan et al., 2024, LOOK-M: Look-Once Optimization in KV Cache for Efficient Multimodal Long-Context "
             "Inference")

    recent_ratio: float = knob("float", 0.1, "alpha_1: the recent window, share of the prompt", min=0.0, max=1.0,
                               ref="LOOK-M section 4.3")
    important_ratio: float = knob("float", 0.1, "alpha_2: tokens kept by text-prior score, share of the prompt",
                                  min=0.0, max=1.0, ref="LOOK-M section 4.3")
    merge: str = knob("str", "pivotal", "how evicted tokens join their nearest kept token: none, averaged (Eq. 10), "
                      "pivotal (Eq. 11, the paper's best) or weighted (Eq. 12)", choices=("none",) + MERGES,
                      ref="LOOK-M section 3.3")
    backend: str = backend_knob()

    RULES = (
        Rule("recent_ratio + important_ratio <= 1", "recent_ratio + important_ratio ({recent_ratio} + "
             "{important_ratio}) must be at most 1: LOOK-M keeps alpha_1 + alpha_2 of the prompt"),
        Rule("recent_ratio + important_ratio > 0", "recent_ratio + important_ratio must be above 0: LOOK-M keeps "
             "alpha_1 + alpha_2 of the prompt"),
    )

    def prefill_all(self, q, k, v, spans) -> list[KeptTokens]:
        prompt = Prompt(q, k, v, spans)
        scorer = TextPrior(self.backend)
        tokens = prompt.tokens
        recent = kept_count(self.recent_ratio, tokens) if self.recent_ratio else 0
        capacity = min(tokens, recent + (kept_count(self.important_ratio, tokens) if self.important_ratio else 0))
        caches = []
        for layer in range(prompt.layers):
            scores = scorer.prefill(prompt, layer)
            cache = KeptTokens.from_prompt(k[layer], v[layer])
            kept = top_and_recent(scores, capacity, recent).sort(dim=-1).values  # [kv_heads, capacity]
            evicted = _complement(kept, tokens)
            cache.keep(kept)
            if self.merge != "none" and evicted.shape[1]:
                rows = evicted[..., None].expand(-1, -1, k[layer].shape[-1])
                cache.keys, cache.values = merge(cache.keys, cache.values, k[layer].gather(1, rows),
                                                 v[layer].gather(1, rows), self.merge)
            cache.notes.update(evicted_tokens=float(evicted.shape[1]),
                               evicted_text=float(_text_count(evicted[0], spans, tokens)))
            caches.append(cache)
        return caches

    def decode(self, layer, cache: KeptTokens, q_t, k_t, v_t) -> torch.Tensor:
        cache.append(k_t, v_t)
        return cache.attend(q_t)[0]

    def layer_metrics(self, layer, cache):
        """evicted_tokens (merged in unless merge=none) and evicted_text: text
        tokens among them (kv head 0), 0 unless the text exceeds alpha_2."""
        return dict(cache.notes)


def _complement(kept: torch.Tensor, tokens: int) -> torch.Tensor:
    """[kv_heads, tokens - k] the indices not in kept [kv_heads, k], ascending."""
    mask = torch.ones(kept.shape[0], tokens, dtype=torch.bool, device=kept.device)
    mask.scatter_(1, kept, False)
    return mask.nonzero()[:, 1].reshape(kept.shape[0], -1)


def _text_count(indices: torch.Tensor, spans, tokens: int) -> int:
    visual = torch.zeros(tokens, dtype=torch.bool, device=indices.device)
    visual[spans.visual_positions().to(indices.device)] = True
    return int((~visual[indices]).sum())
