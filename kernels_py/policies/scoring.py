"""Token scores from attention statistics over a subset of prompt query rows,
one place for every method that ranks prompt tokens by attention.

The statistics come from the attention-statistics kernels
(kernels_py.triton.attention_stats; the reference on CPU unless told
otherwise, see kernels_py.backend), never from a materialised attention
matrix on the kernel path. The scoring policies of VL-Cache section 3.2, each a
choice of query rows and of a reduction over them:

  accumulated     all rows, column sums (H2O)
  normalized      all rows, column sums / causal count (ZipCache)
  sliding_window  the last `window` rows, column sums (SnapKV, PyramidKV)
  post_vision     the rows after the last visual token, column sums (VL-Cache)

Scores are per kv head: summed over the query heads that share it.
"""

import torch

from kernels_py.backend import use_triton
from kernels_py.ref import attention_stats as reference
from kernels_py.triton import attention_stats as kernel
from kernels_py.triton.attention_stats import (
    AttentionStats, all_rows, last_row, post_vision_rows, probe_rows, recent_rows,
)

SCORINGS = ("accumulated", "normalized", "sliding_window", "post_vision")
THRESHOLD = 0.01  # VL-Cache's ThresholdFilter p


def stats(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, p: float = THRESHOLD,
          backend: str = "auto") -> AttentionStats:
    """Statistics of the prompt query rows at positions `rows` of q [H, T, d]
    over the prompt keys k [H_kv, T, d]."""
    rows = rows.to(q.device)
    impl = kernel.attention_stats if use_triton(backend, q.device) else reference.attention_stats
    return impl(q[:, rows], k, rows, p)


def scoring_rows(scoring: str, spans, tokens: int, window: int, device=None) -> torch.Tensor:
    """The query rows `scoring` reads."""
    if scoring in ("accumulated", "normalized"):
        return all_rows(tokens, device)
    if scoring == "sliding_window":
        return recent_rows(tokens, window, device)
    if scoring == "post_vision":
        return post_vision_rows(spans, tokens, device)
    raise ValueError(f"unknown scoring {scoring!r}; known: {list(SCORINGS)}")


def token_scores(scoring: str, s: AttentionStats) -> torch.Tensor:
    """[H_kv, T] float32 scores of the prompt tokens under `scoring`, from the
    statistics of the rows `scoring_rows` chose."""
    if scoring == "normalized":
        return s.attn_sum_kv / s.nonzero[: s.attn_sum_kv.shape[0]].clamp_min(1).float()
    if scoring in SCORINGS:
        return s.attn_sum_kv
    raise ValueError(f"unknown scoring {scoring!r}; known: {list(SCORINGS)}")


__all__ = ["SCORINGS", "THRESHOLD", "stats", "scoring_rows", "token_scores",
           "all_rows", "last_row", "post_vision_rows", "probe_rows", "recent_rows"]
