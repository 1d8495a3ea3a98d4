"""ZipVL's token selection with the less important tokens evicted: an
ablation of ZipVL (He et al., 2024, "ZipVL: Efficient Large Vision-Language
Models with Dynamic Token Sparsification"), which keeps them in 2 bits
(`zipvl`); this one compares its selection with the eviction methods at
their budgets.

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

The less important tokens are evicted here (ZipVL keeps them at a low bit
width: method `zipvl`). Generated tokens are all kept, unless
evict_while_decoding (the `vlcache` protocol sets it): then each layer is
held at its share of the tokens seen, and a generated token, which the
prompt's probe rows give no score (its score is 0), is evicted before any
prompt token once it is not the newest.
"""

from dataclasses import dataclass

from kernels_py.methods.allocators import AdaptiveTau
from kernels_py.methods.base import BudgetedSelection, backend_knob
from kernels_py.methods.prompt import ProbeRows
from kernels_py.methods.scorers import AttentionMass
from kernels_py.params import Rule, knob


@dataclass(frozen=True)
class ZipVLEvict(BudgetedSelection):
    """ZipVL's selection (Eq. 6-7: an adaptive count per layer, by normalized probe attention), the rest evicted."""

    name = "zipvl_evict"
    paper = "He et al., 2024, ZipVL: Efficient Large Vision-Language Models with Dynamic Token Sparsification"

    tau: float = knob("float", 0.975, "share of the probe attention the important tokens must hold",
                      min=0.01, max=1.0, ref="ZipVL Eq. 6")
    probe_recent: int = knob("int", 64, "probe rows: the most recent prompt queries", min=0, max=65536,
                             ref="ZipVL appendix A")
    probe_random: int = knob("int", 64, "probe rows: prompt queries drawn at random before them", min=0, max=65536,
                             ref="ZipVL appendix A")
    probe_seed: int = knob("int", 0, "seed of the random probe rows", min=0, max=2**31 - 1)
    backend: str = backend_knob()

    RULES = (Rule("probe_recent + probe_random >= 1", "probe_recent + probe_random must be at least 1"),)

    def scorer(self):
        return AttentionMass(self._rows, normalize=True, backend=self.backend)

    def allocator(self):
        return AdaptiveTau(self.tau, self._rows, self.backend)

    @property
    def _rows(self) -> ProbeRows:
        return ProbeRows(self.probe_recent, self.probe_random, self.probe_seed)
