"""ZipVL (He et al., 2024, "ZipVL: Efficient Large Vision-Language Models with
Dynamic Token Sparsification"), token selection.

Probe rows (the 64 most recent prompt queries plus 64 at random, seeded;
appendix A) stand in for the full attention. For each layer:

- Eq. 6: the number of important tokens p is the fewest tokens whose
  accumulated probe attention (column sums, over all query heads) reaches
  tau times the total (each probe row sums to 1, so the total is heads * rows).
  A layer whose attention is spread out gets a larger p: the ratio adapts per
  layer and per prompt.
- Eq. 7: tokens are ranked by normalized attention, the column sum over the
  probe rows divided by how many of them see the token (its causal count),
  summed over the query heads of each kv head; the top p are important.

The less important tokens are evicted here; ZipVL keeps them at a low bit
width, which is a later step (mixed-precision quantization). Generated tokens
are all kept (ZipVL re-assesses them only every 100 steps, for quantization).
"""

from dataclasses import dataclass

import torch

from kernels_py.backend import BACKENDS
from kernels_py.params import knob
from kernels_py.policies import scoring
from kernels_py.policies.base import LayerCache, Policy


def important_count(accumulated: torch.Tensor, tau: float) -> int:
    """Eq. 6: min p such that the p largest of `accumulated` ([n], summed over
    heads and probe rows) sum to at least tau times their total."""
    ranked = accumulated.double().sort(descending=True).values
    reach = ranked.cumsum(0) >= tau * ranked.sum() * (1 - 1e-12)  # rounding must not push tau = 1 past n
    return int(reach.nonzero()[0].item()) + 1


@dataclass(frozen=True)
class ZipVL(Policy):
    """ZipVL: a per-layer adaptive number of important tokens (Eq. 6) chosen by normalized probe attention (Eq. 7)."""

    name = "zipvl"

    tau: float = knob("float", 0.975, "share of the probe attention the important tokens must hold (Eq. 6)",
                      min=0.01, max=1.0)
    probe_recent: int = knob("int", 64, "probe rows: the most recent prompt queries", min=0, max=65536)
    probe_random: int = knob("int", 64, "probe rows: prompt queries drawn at random before them", min=0, max=65536)
    probe_seed: int = knob("int", 0, "seed of the random probe rows", min=0, max=2**31 - 1)
    backend: str = knob("str", "auto", "statistics: Triton kernel (on CUDA when auto) or PyTorch reference",
                        choices=BACKENDS)

    def __post_init__(self):
        super().__post_init__()
        if self.probe_recent + self.probe_random == 0:
            raise ValueError(f"{self.owner_name()}: probe_recent + probe_random must be at least 1")

    def prefill(self, layer, q, k, v, spans) -> LayerCache:
        tokens = k.shape[1]
        rows = scoring.probe_rows(tokens, self.probe_recent, self.probe_random, self.probe_seed)
        s = scoring.stats(q, k, rows, backend=self.backend)
        important = important_count(s.attn_sum.sum(dim=0), self.tau)
        normalized = scoring.token_scores("normalized", s)
        cache = LayerCache.from_prompt(k, v)
        cache.keep(normalized.topk(important, dim=-1).indices)
        cache.notes.update(important_ratio=important / tokens, probe_rows=float(rows.numel()))
        return cache
