"""VL-Cache (Tu et al., 2024, "VL-Cache: Sparsity and Modality-Aware KV Cache
Compression for Vision-Language Model Inference Acceleration").

After prefill, for each layer: the attention of the post-vision rows (the text
after the last visual token) gives (1) the layer's sparsity gamma, the share of
causal entries below p * row max (Eq. 1-2, p = 1%, averaged over heads), and
(2) the token scores, column sums over those rows (section 4.2). Algorithm 1
then splits the overall budget alpha across the L layers by their non-sparse
share: beta_l = clip((1 - gamma_l) / sum_l'(1 - gamma_l') * alpha * L, 0.01, 1).
Each layer keeps its most recent tokens (10% of its budget, as in the paper's
experiments) and the top-scoring rest. Only the prompt is compressed; generated
tokens are all kept (the paper compresses prefill only).

Both halves can be swapped for the ablations of section 3.2: `scoring` picks
the token scores (accumulated / normalized / sliding window instead of
post-vision) and `allocation="uniform"` gives every layer alpha. The clip can
leave the layers' budgets summing to less (or more) than alpha * L; the
realised budget of each layer is reported as `layer_budget`.
"""

from dataclasses import dataclass

from kernels_py.backend import BACKENDS
from kernels_py.params import knob
from kernels_py.policies import scoring
from kernels_py.policies.base import LayerCache, Policy, keep_top_and_recent, kept_count

BUDGET_CLIP = (0.01, 1.0)  # Algorithm 1, line 12


def allocate_budgets(sparsity: list[float], alpha: float) -> list[float]:
    """Algorithm 1 lines 9-12: per-layer budgets from head-averaged sparsities."""
    dense_share = [1.0 - g for g in sparsity]
    total = sum(dense_share)
    layers = len(sparsity)
    if total <= 0:  # every layer fully sparse: nothing to weigh by
        return [min(max(alpha, BUDGET_CLIP[0]), BUDGET_CLIP[1])] * layers
    return [min(max(d / total * alpha * layers, BUDGET_CLIP[0]), BUDGET_CLIP[1]) for d in dense_share]


@dataclass(frozen=True)
class VLCache(Policy):
    """VL-Cache: sparsity-aware layer budgets and post-vision attention scores, prefill only."""

    name = "vlcache"

    budget: float = knob("float", 0.2, "overall budget alpha: the share of the prompt kept, over all layers",
                         min=0.001, max=1.0)
    threshold: float = knob("float", 0.01, "ThresholdFilter p: entries below p * row max count as sparse",
                            min=1e-6, max=1.0)
    recent_fraction: float = knob("float", 0.1, "share of each layer's budget kept for the most recent tokens",
                                  min=0.0, max=1.0)
    allocation: str = knob("str", "sparsity", "layer budgets: Algorithm 1 (sparsity) or alpha everywhere (uniform)",
                           choices=("sparsity", "uniform"))
    scoring: str = knob("str", "post_vision", "token scores (VL-Cache section 3.2)", choices=scoring.SCORINGS)
    window: int = knob("int", 32, "query rows of the sliding_window scoring", min=1, max=65536)
    backend: str = knob("str", "auto", "statistics: Triton kernel (on CUDA when auto) or PyTorch reference",
                        choices=BACKENDS)

    def prefill(self, layer, q, k, v, spans) -> LayerCache:
        return self.prefill_all([q], [k], [v], spans)[0]

    def prefill_all(self, q, k, v, spans) -> list[LayerCache]:
        tokens = k[0].shape[1]
        post_vision = scoring.post_vision_rows(spans, tokens)
        rows = scoring.scoring_rows(self.scoring, spans, tokens, self.window)
        sparsity, scores = [], []
        for q_l, k_l in zip(q, k):
            post = scoring.stats(q_l, k_l, post_vision, self.threshold, self.backend)
            sparsity.append(post.sparsity(per_head=False).item())
            same_rows = rows.shape == post_vision.shape and bool((rows == post_vision).all())
            s = post if same_rows else scoring.stats(q_l, k_l, rows, self.threshold, self.backend)
            scores.append(scoring.token_scores(self.scoring, s))
        budgets = allocate_budgets(sparsity, self.budget) if self.allocation == "sparsity" else [self.budget] * len(k)
        caches = []
        for k_l, v_l, scores_l, gamma, beta in zip(k, v, scores, sparsity, budgets):
            cache = LayerCache.from_prompt(k_l, v_l)
            capacity = kept_count(beta, tokens)
            recent = round(self.recent_fraction * capacity)
            cache.keep(keep_top_and_recent(scores_l, capacity, recent))
            cache.notes.update(layer_budget=beta, allocation_sparsity=gamma)
            caches.append(cache)
        return caches
