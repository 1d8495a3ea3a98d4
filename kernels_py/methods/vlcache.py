"""VL-Cache (Tu et al., 2024, "VL-Cache: Sparsity and Modality-Aware KV Cache
Compression for Vision-Language Model Inference Acceleration").

After prefill, for each layer: the attention of the post-vision rows (the text
after the last visual token) gives (1) the layer's sparsity gamma, the share of
causal entries below p * row max (Eq. 1-2, p = 1%, averaged over heads), and
(2) the token scores, column sums over those rows (section 4.2). Algorithm 1
then splits the overall budget alpha across the L layers by their non-sparse
share: beta_l = clip((1 - gamma_l) / sum_l'(1 - gamma_l') * alpha * L, 0.01, 1).
Each layer keeps its most recent tokens (10% of its budget, as in the paper's
experiments: section 5 fixes "the recent token window size ... at 10% of this
budget", the overall one; with Algorithm 1's per-layer budgets this takes it
as 10% of each layer's, since 10% of alpha could exceed the whole budget of a
layer clipped to 1%) and the top-scoring rest. Only the prompt is compressed;
generated tokens are all kept (the paper compresses prefill only), unless
evict_while_decoding, which holds each layer at its share of the tokens seen
(the `vlcache` protocol turns it on: the workbench's addition, not the
paper's). The post-vision rows give a generated token no score (0), so under
that eviction a generated token is kept while it is in the recent window and
evicted before any prompt token once it leaves it. Tokens are chosen per kv
head (scores summed over its query heads), every kv head keeping the layer's
count; the paper, written for one head, leaves this open.

Both halves can be swapped for the ablations of section 3.2: `scoring` picks
the token scores (accumulated / normalized / sliding window instead of
post-vision) and `allocation="uniform"` gives every layer alpha. The clip can
leave the layers' budgets summing to less (or more) than alpha * L; the
realised budget of each layer is reported as `layer_budget`. A prompt
without post-vision rows (no image, or nothing after the last one) is
refused: the sparsity of Algorithm 1 is measured over them.
"""

from dataclasses import dataclass

from kernels_py.methods.allocators import SparsityGuided
from kernels_py.methods.base import BudgetedSelection, backend_knob, budget_knob
from kernels_py.methods.caches import recent_count
from kernels_py.methods.scorers import SCORINGS, vlcache_scorer
from kernels_py.params import knob


@dataclass(frozen=True)
class VLCache(BudgetedSelection):
    """VL-Cache: sparsity-aware layer budgets and post-vision attention scores, prefill only."""

    name = "vlcache"
    paper = "Tu et al., 2024, VL-Cache: Sparsity and Modality-Aware KV Cache Compression for VLM Inference"

    budget: float = budget_knob(0.2, "overall budget alpha: the share of the prompt kept, over all layers",
                                ref="VL-Cache Algorithm 1")
    threshold: float = knob("float", 0.01, "ThresholdFilter p: entries below p * row max count as sparse",
                            min=1e-6, max=1.0, ref="VL-Cache Eq. 1")
    recent_fraction: float = knob("float", 0.1, "share of each layer's budget kept for the most recent tokens",
                                  min=0.0, max=1.0, ref="VL-Cache section 5")
    allocation: str = knob("str", "sparsity", "layer budgets: Algorithm 1 (sparsity) or alpha everywhere (uniform)",
                           choices=("sparsity", "uniform"), ref="VL-Cache Algorithm 1")
    scoring: str = knob("str", "post_vision", "token scores: which query rows vote and how", choices=SCORINGS,
                        ref="VL-Cache section 3.2")
    window: int = knob("int", 32, "query rows of the sliding_window scoring", min=1, max=65536)
    redistribute: bool = knob(
        "bool", False, "give the budget Algorithm 1's clip to [0.01, 1] removes (or adds) back to the unclipped "
        "layers, so the layers average alpha (the paper does not: False)", ref="VL-Cache Algorithm 1")
    backend: str = backend_knob()

    def scorer(self):
        return vlcache_scorer(self.scoring, self.window, self.threshold, self.backend)

    def allocator(self):
        return SparsityGuided(self.budget, self.threshold, self.allocation == "sparsity", self.backend,
                              self.redistribute)

    def recent(self, capacity):
        return recent_count(self.recent_fraction, capacity)

    def check_prompt(self, prompt):
        # Algorithm 1 measures every layer's sparsity over the post-vision rows whatever the knobs (the uniform
        # allocation still reports it), so a prompt without them has nothing to measure.
        ends = [end for _, end in prompt.spans.images]
        if not ends:
            raise ValueError(f"{self.owner_name()}: the prompt has no visual tokens, so no post-vision rows (the text "
                             f"after the last image), which Algorithm 1's layer sparsity is measured over")
        if max(ends) >= prompt.tokens:
            raise ValueError(f"{self.owner_name()}: the prompt ends with its last image (token {max(ends)} of "
                             f"{prompt.tokens}), so it has no post-vision rows (the text after the last image), which "
                             f"Algorithm 1's layer sparsity is measured over")
