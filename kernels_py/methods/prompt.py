"""What a method sees at prefill: every layer's prompt Q/K/V, the modality
spans, and attention statistics over chosen query rows, computed once per
(layer, rows, threshold, backend) however many parts of a method ask for them.

Statistics come from the attention-statistics op (kernels_py.ops.
attention_stats), never from a materialised attention matrix on the kernel
path. Query rows are chosen by name, so scorers and allocators that read the
same rows share one computation:

  AllRows()             every prompt row (H2O, LOOK-M)
  RecentRows(window)    the last `window` rows (SnapKV's observation window)
  PostVisionRows()      the rows after the last visual token (VL-Cache)
  ProbeRows(r, n, s)    the r most recent rows + n earlier ones at random, seeded (ZipVL)
  LastRow()             the last prompt token (A-VL, AttentionPack)
"""

from dataclasses import dataclass, field
from typing import Sequence

import torch

from kernels_py.attention import Spans
from kernels_py.ops import attention_stats
from kernels_py.ops.attention_stats import AttentionStats

THRESHOLD = 0.01  # VL-Cache's ThresholdFilter p


class Rows:
    """Which prompt query rows statistics are taken over (a frozen dataclass,
    so it can key the statistics memo)."""

    def positions(self, tokens: int, spans: Spans) -> torch.Tensor:
        """Sorted, distinct int64 row positions in [0, tokens)."""
        raise NotImplementedError


@dataclass(frozen=True)
class AllRows(Rows):
    def positions(self, tokens, spans):
        return attention_stats.all_rows(tokens)


@dataclass(frozen=True)
class RecentRows(Rows):
    window: int

    def positions(self, tokens, spans):
        return attention_stats.recent_rows(tokens, self.window)


@dataclass(frozen=True)
class PostVisionRows(Rows):
    def positions(self, tokens, spans):
        return attention_stats.post_vision_rows(spans, tokens)


@dataclass(frozen=True)
class ProbeRows(Rows):
    recent: int
    random: int
    seed: int

    def positions(self, tokens, spans):
        return attention_stats.probe_rows(tokens, self.recent, self.random, self.seed)


@dataclass(frozen=True)
class LastRow(Rows):
    def positions(self, tokens, spans):
        return attention_stats.last_row(tokens)


def stats(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, p: float = THRESHOLD,
          backend: str = "auto") -> AttentionStats:
    """Statistics of the prompt query rows at positions `rows` of q [H, T, d]
    over the prompt keys k [H_kv, T, d]."""
    # The selectors' rows are on the host: their range goes with them, so the
    # kernel does not wait for the device to read it back.
    pos_range = (int(rows.min()), int(rows.max())) if rows.numel() and rows.device.type == "cpu" else None
    rows = rows.to(q.device)
    return attention_stats.compute(q[:, rows], k, rows, p, backend=backend, pos_range=pos_range)


@dataclass
class Prompt:
    """Every layer's prompt (q[l] [heads, T, d]; k[l], v[l] [kv_heads, T, d]) and its spans."""

    q: Sequence[torch.Tensor]
    k: Sequence[torch.Tensor]
    v: Sequence[torch.Tensor]
    spans: Spans
    layers: int = field(init=False)
    tokens: int = field(init=False)  # prompt tokens
    _stats: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.layers, self.tokens = check_prompt(self.q, self.k, self.v, self.spans)

    def rows(self, rows: Rows) -> torch.Tensor:
        return rows.positions(self.tokens, self.spans)

    def stats(self, layer: int, rows: Rows, p: float = THRESHOLD, backend: str = "auto") -> AttentionStats:
        """Attention statistics of `rows` in `layer`, computed on first use."""
        key = (layer, rows, p, backend)
        if key not in self._stats:
            self._stats[key] = stats(self.q[layer], self.k[layer], self.rows(rows), p, backend)
        return self._stats[key]


def check_prompt(q, k, v, spans: Spans) -> tuple[int, int]:
    """(layers, prompt tokens) of one sequence's prompt given per layer: q[l]
    [heads, T, d], k[l] and v[l] [kv_heads, T, d], heads a multiple of
    kv_heads, the same T in every layer and in the spans. Raise ValueError
    naming the layer and what differs (a model's [batch, heads, T, d] would
    otherwise read as heads tokens of one head)."""
    if any(isinstance(x, torch.Tensor) and x.dim() == 3 for x in (q, k, v)):
        raise ValueError("q, k and v are one tensor per layer: pass lists ([q], [k], [v] for one layer, or "
                         "prefill(layer, q, k, v, spans))")
    if not len(q) == len(k) == len(v) or not len(k):
        raise ValueError(f"q, k and v must hold the same number of layers, at least one; got {len(q)}, {len(k)} "
                         f"and {len(v)}")
    tokens = spans.prompt_tokens
    for layer, (ql, kl, vl) in enumerate(zip(q, k, v)):
        shapes = f"got q {tuple(ql.shape)}, k {tuple(kl.shape)}, v {tuple(vl.shape)}"
        if ql.dim() != 3 or kl.dim() != 3 or kl.shape != vl.shape:
            batch = " (one sequence: a model's [batch, heads, T, d] is q[b])" if ql.dim() == 4 else ""
            raise ValueError(f"layer {layer}: q must be [heads, T, d] and k, v [kv_heads, T, d] alike{batch}; "
                             f"{shapes}")
        if ql.shape[1:] != kl.shape[1:] or ql.shape[0] % kl.shape[0]:
            raise ValueError(f"layer {layer}: q and k disagree on tokens or head_dim, or heads is not a multiple "
                             f"of kv_heads; {shapes}")
        if kl.shape[1] != tokens:
            raise ValueError(f"layer {layer}: the prompt has {kl.shape[1]} tokens but the spans describe {tokens} "
                             f"(spans.text ends the prompt)")
    return len(k), tokens
