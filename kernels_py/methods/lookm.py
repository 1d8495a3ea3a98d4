"""LOOK-M (Wan et al., 2024, "LOOK-M: Look-Once Optimization in KV Cache for
Efficient Multimodal Long-Context Inference"): once, at prefill, each layer
keeps a recent window of alpha_1 of the prompt and the alpha_2 of it with
the highest text-prior scores (Eq. 4-8: accumulated prompt attention, text
tokens raised by the maximum so image tokens are evicted first), and merges
every evicted token's key and value into its most similar kept token
(methods/merging.py: averaged, pivotal or weighted, Eq. 9-12). Decoding
appends and evicts nothing, as in the paper, unless evict_while_decoding
(what VL-Cache's protocol sets, so budgets count generated tokens too):
then after each step a layer is held at its prefill share of the tokens
seen, the same recent share kept, and each token evicted merged in as at
prefill. A generated token's score is +inf, so it ranks above every prompt
token, prompt text included: image tokens go first, then prompt text, and a
generated token only once every prompt token outside the recent window is
gone (without the text prior too). With text_prior false the prompt ranks by
its accumulated attention alone (Eq. 4; Table 1's A-, W- and P-Merge rows
without TR), text and image tokens alike. A kept token merged into again takes the new one as if it were the
first (the counts of earlier merges are not kept).

Where the paper is open: scores and merges are per kv head (each kv head
keeps its own tokens, as the other eviction methods here do). The recent
window M is int(alpha_1 * prompt tokens) (at least one token when alpha_1
> 0), section 4.3's alpha_1 x input_length rounded down as every share of
the prompt is, not the half-up share of the budget the other methods'
windows use (kept_count vs recent_count: the two can differ by a token);
while decoding it is recent_count of alpha_1 / (alpha_1 + alpha_2) of the
capacity, as theirs.

Where the paper contradicts itself, a choice: when the text outside the
recent window alone exceeds N (small budgets, long system prompts), the
top N are text tokens and the rest of the text is evicted (and merged) too,
so the cache holds S = N + M, section 4.3's memory of alpha_1 + alpha_2 of
the prompt, and matched budgets stay matched. Section 3.2's I, "the union
of textual token indices T and the Top N tokens", would keep every text
token and hold more than S then; so does LOOK-M's public code (text scores
left positive, image scores pushed negative, every non-negative score
kept). The two agree whenever the text fits in N (MileBench's prompts at
the paper's 10%); evicted_text says how much text a run evicted.
"""

from dataclasses import dataclass

import torch

from kernels_py.methods.base import Method, backend_knob, eviction_knob
from kernels_py.methods.caches import KeptTokens, kept_count, recent_count, top_and_recent
from kernels_py.methods.merging import MERGES, merge
from kernels_py.methods.prompt import AllRows, Prompt
from kernels_py.methods.scorers import AttentionMass, TextPrior
from kernels_py.params import Rule, knob


@dataclass(frozen=True)
class LookM(Method):
    """LOOK-M: text-prior eviction at prefill, each evicted token's K/V merged into its nearest kept token."""

    name = "lookm"
    paper = ("Wan et al., 2024, LOOK-M: Look-Once Optimization in KV Cache for Efficient Multimodal Long-Context "
             "Inference")

    recent_ratio: float = knob("float", 0.1, "alpha_1: the recent window, share of the prompt", min=0.0, max=1.0,
                               ref="LOOK-M section 4.3")
    important_ratio: float = knob("float", 0.1, "alpha_2: tokens kept by score (text-prior, or accumulated attention "
                                  "with text_prior false), share of the prompt", min=0.0, max=1.0,
                                  ref="LOOK-M section 4.3")
    merge: str = knob("str", "pivotal", "how evicted tokens join their nearest kept token: none, averaged (Eq. 10), "
                      "pivotal (Eq. 11, the paper's best) or weighted (Eq. 12)", choices=("none",) + MERGES,
                      ref="LOOK-M section 3.3")
    text_prior: bool = knob("bool", True, "rank text above every image token (Eq. 5); false ranks by the "
                            "accumulated attention alone (Eq. 4), Table 1's merges without TR", ref="LOOK-M Table 1",
                            id_omits_default=True)
    evict_while_decoding: bool = eviction_knob(False)
    backend: str = backend_knob()

    protocols = {"vlcache": {"evict_while_decoding": True}}

    RULES = (
        Rule("recent_ratio + important_ratio <= 1", "recent_ratio + important_ratio ({recent_ratio} + "
             "{important_ratio}) must be at most 1: LOOK-M keeps alpha_1 + alpha_2 of the prompt"),
        Rule("recent_ratio + important_ratio > 0", "recent_ratio + important_ratio must be above 0: LOOK-M keeps "
             "alpha_1 + alpha_2 of the prompt"),
    )

    def prefill_all(self, q, k, v, spans) -> list[KeptTokens]:
        prompt = Prompt(q, k, v, spans)
        scorer = TextPrior(self.backend) if self.text_prior else AttentionMass(AllRows(), backend=self.backend)
        tokens = prompt.tokens
        # alpha_1 + alpha_2 of the prompt, rounded once (as every budget), alpha_1 of it the recent window
        capacity = min(tokens, kept_count(self.recent_ratio + self.important_ratio, tokens))
        recent = min(capacity, kept_count(self.recent_ratio, tokens)) if self.recent_ratio else 0
        caches = []
        for layer in range(prompt.layers):
            cache = KeptTokens.from_prompt(k[layer], v[layer], scorer.prefill(prompt, layer))
            evicted = self._evict(cache, capacity, recent)
            cache.own()  # having evicted nothing, it would still hold the prompt's K and V as given (a batch's view)
            cache.notes.update(evicted_tokens=float(evicted.shape[1]),
                               evicted_text=float(_text_count(evicted[0], spans, tokens)))
            if self.evict_while_decoding:
                cache.share = capacity / tokens
            else:
                cache.scores = None
            caches.append(cache)
        return caches

    def decode(self, layer, cache: KeptTokens, q_t, k_t, v_t) -> torch.Tensor:
        self.check_step(layer, cache, q_t, k_t, v_t)
        cache.append(k_t, v_t)
        output = cache.attend(q_t)[0]
        if cache.share is not None:
            cache.scores[:, -1] = float("inf")  # a generated token ranks above every prompt token, text included
            capacity = kept_count(cache.share, cache.seen)
            recent_share = self.recent_ratio / (self.recent_ratio + self.important_ratio)
            self._evict(cache, capacity, max(1, recent_count(recent_share, capacity)))
        return output

    def _evict(self, cache: KeptTokens, capacity: int, recent: int) -> torch.Tensor:
        """Hold `capacity` tokens of the cache: the `recent` latest and the
        highest-scoring others; the rest are merged into their nearest kept
        token. Returns the evicted ones' indices into what was held."""
        held = cache.tokens
        if held <= capacity:
            return torch.empty(cache.keys.shape[0], 0, dtype=torch.long, device=cache.keys.device)
        kept = top_and_recent(cache.scores, capacity, recent).sort(dim=-1).values  # [kv_heads, capacity]
        evicted = _complement(kept, held)
        rows = evicted[..., None].expand(-1, -1, cache.keys.shape[-1])
        evicted_k, evicted_v = cache.keys.gather(1, rows), cache.values.gather(1, rows)
        cache.keep(kept)
        if self.merge != "none":
            cache.keys, cache.values = merge(cache.keys, cache.values, evicted_k, evicted_v, self.merge)
        return evicted

    def layer_metrics(self, layer, cache):
        """evicted_tokens: prompt tokens evicted at prefill (merged in unless
        merge=none), and evicted_text: text tokens among them (kv head 0),
        with the text prior 0 unless the text outside the recent window
        exceeds alpha_2 of the prompt. Both count prefill only: what
        evict_while_decoding evicts later is not added."""
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
