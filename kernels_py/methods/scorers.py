"""Scorers: which tokens matter. A scorer turns a layer's prompt (through the
attention statistics of methods.prompt) into one score per prompt token and
kv head, may update the scores as decoding goes, and says how to rank the held
tokens when a cache must shrink. Higher is kept first.

VL-Cache section 3.2's scoring policies are one scorer each (`vlcache_scorer`):

  accumulated     all rows, column sums (H2O)
  normalized      all rows, column sums / causal count (ZipCache)
  sliding_window  the last `window` rows, column sums (SnapKV, PyramidKV)
  post_vision     the rows after the last visual token, column sums (VL-Cache)

Scores are per kv head: summed over the query heads that share it.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels_py.attention import group_sum
from kernels_py.methods.caches import RECENT_SHARE, kept_count, recent_count
from kernels_py.methods.prompt import THRESHOLD, AllRows, LastRow, PostVisionRows, Prompt, RecentRows, Rows

SCORINGS = ("accumulated", "normalized", "sliding_window", "post_vision")
POOLING = {"avg": F.avg_pool1d, "max": F.max_pool1d}


class Scorer:
    """Base: no scores; held tokens rank by what the cache's scores say."""

    def prefill(self, prompt: Prompt, layer: int) -> torch.Tensor | None:
        """[kv_heads, T] float32 scores of the prompt tokens, or None."""
        return None

    needs_weights = False  # whether decode reads the step's attention weights

    def decode(self, cache, weights: torch.Tensor | None) -> None:
        """Update cache.scores after a decode step with attention `weights`
        [heads, n] over the held tokens (None unless needs_weights); default:
        scores do not change."""

    def held(self, cache) -> torch.Tensor:
        """[kv_heads, n] scores ranking the held tokens of `cache`."""
        return cache.scores


@dataclass(frozen=True)
class AttentionMass(Scorer):
    """Attention a token receives from `rows`: the column sum (`sum`), or the
    column sum over the rows that can see it (`normalized`, ZipCache's causal
    normalisation). With `accumulate`, each decode step adds the new query's
    attention (H2O's running total)."""

    rows: Rows
    normalize: bool = False
    accumulate: bool = False
    p: float = THRESHOLD
    backend: str = "auto"

    def prefill(self, prompt, layer):
        s = prompt.stats(layer, self.rows, self.p, self.backend)
        if self.normalize:
            return s.attn_sum_kv / s.nonzero[: s.attn_sum_kv.shape[0]].clamp_min(1).float()
        return s.attn_sum_kv

    @property
    def needs_weights(self) -> bool:
        return self.accumulate

    def decode(self, cache, weights):
        if self.accumulate:
            # kv_heads, not keys.shape: an fp8 cache's keys are its whole dequantized copy
            cache.scores = cache.scores + group_sum(weights, cache.kv_heads)


@dataclass(frozen=True)
class WindowVotes(Scorer):
    """SnapKV: the last `window` prompt queries vote for the earlier tokens;
    votes (column sums over the window) are smoothed by a 1-D pooling of width
    `kernel_size` and averaged over the query heads of each kv head. The
    window's own tokens score +inf (always kept). window = 0: the recent
    window of VL-Cache's protocol, RECENT_SHARE of the cache a `budget`
    share of the prompt holds."""

    window: int
    kernel_size: int
    pooling: str
    backend: str = "auto"
    budget: float = 0.0

    def size(self, tokens: int) -> int:
        """The observation window for a prompt of `tokens`."""
        if self.window:
            return self.window
        return max(1, recent_count(RECENT_SHARE, kept_count(self.budget, tokens)))

    def prefill(self, prompt, layer):
        heads, kv_heads = prompt.q[layer].shape[0], prompt.k[layer].shape[0]
        window = self.size(prompt.tokens)
        prefix = prompt.tokens - window
        votes = prompt.stats(layer, RecentRows(window), backend=self.backend).attn_sum[:, :prefix]
        pooled = POOLING[self.pooling](votes[:, None], self.kernel_size, stride=1, padding=self.kernel_size // 2)[:, 0]
        per_kv_head = pooled.reshape(kv_heads, heads // kv_heads, prefix).mean(dim=1)
        return torch.cat([per_kv_head, per_kv_head.new_full((kv_heads, window), float("inf"))], dim=-1)

    def decode(self, cache, weights):
        # A generated token has no votes: it ranks below every prompt token (votes are >= 0) and after the tokens
        # generated before it, -1 / (tokens seen), so that beyond the recent window the oldest goes first and
        # generated text is held as a sliding window (at a score of 0 each, topk's ties dropped any of them).
        cache.scores[:, -1] = -1.0 / cache.seen


@dataclass(frozen=True)
class Earliest(Scorer):
    """Position only: earlier tokens rank higher (StreamingLLM's attention
    sinks are the first ones); no attention statistics at all."""

    def held(self, cache):
        return -cache.positions.float()


@dataclass(frozen=True)
class LastRowImportance(Scorer):
    """One importance per token shared by all kv heads: the last prompt
    query's attention averaged over the query heads (AttentionPack's first
    importance, A-VL's ranking), then an exponential moving average of each
    decode step's attention (AttentionPack Eq. 1)."""

    alpha: float
    backend: str = "auto"

    def prefill(self, prompt, layer):
        """[T] float32 importance of the prompt tokens."""
        return prompt.stats(layer, LastRow(), backend=self.backend).attn_sum.mean(dim=0)

    def update(self, importance: torch.Tensor, mass: torch.Tensor, new_tokens: int = 1) -> torch.Tensor:
        """Eq. 1: I <- alpha^Tq I + (1 - alpha^Tq) A, where A [T] is each token's
        attention averaged over heads and over the Tq new query tokens."""
        return ema_update(importance, mass, self.alpha, new_tokens)


def ema_update(importance: torch.Tensor, mass: torch.Tensor, alpha: float, new_tokens: int = 1) -> torch.Tensor:
    """AttentionPack Eq. 1 (see LastRowImportance.update)."""
    decay = alpha ** new_tokens
    return decay * importance + (1.0 - decay) * mass.float()


def vlcache_scorer(scoring: str, window: int, p: float = THRESHOLD, backend: str = "auto") -> AttentionMass:
    """The scorer of one of VL-Cache's section 3.2 scoring policies."""
    rows = {"accumulated": AllRows(), "normalized": AllRows(), "sliding_window": RecentRows(window),
            "post_vision": PostVisionRows()}
    if scoring not in rows:
        raise ValueError(f"unknown scoring {scoring!r}; known: {list(SCORINGS)}")
    return AttentionMass(rows[scoring], normalize=scoring == "normalized", p=p, backend=backend)


@dataclass(frozen=True)
class TextPrior(Scorer):
    """LOOK-M Eq. 4-5: attention accumulated over all prompt rows (per kv
    head), text tokens raised by the largest score so they rank above every
    image token (only image tokens are evicted while any is left)."""

    backend: str = "auto"

    def prefill(self, prompt, layer):
        scores = prompt.stats(layer, AllRows(), backend=self.backend).attn_sum_kv.clone()
        text = torch.ones(prompt.tokens, dtype=torch.bool, device=scores.device)
        text[prompt.spans.visual_positions().to(scores.device)] = False
        scores[:, text] += scores.max(dim=-1, keepdim=True).values
        return scores
