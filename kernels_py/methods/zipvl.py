"""ZipVL (He et al., 2024, "ZipVL: Efficient Large Vision-Language Models with
Dynamic Token Sparsification"), Algorithm 1: mixed-precision KV with an
adaptive ratio of important tokens per layer.

Probe rows (the 64 most recent prompt queries plus 64 at random, seeded;
appendix A) stand in for the full attention. Per layer:

- Eq. 6: the number of important tokens p is the fewest tokens whose
  accumulated probe attention (column sums over all query heads) reaches tau
  times the total: a layer whose attention is spread out gets a larger p.
- Eq. 7: tokens are ranked per kv head by normalized attention (the column
  sum over the probe rows divided by how many of them see the token, summed
  over the query heads of the kv head); the top p are important.
- The important tokens' keys and values are quantized to high_bits (4), the
  others to low_bits (2): keys per channel, values per token
  (methods/mixed_precision.py, ops/kv_quant).
- Decoding attends over the quantized cache with the in-register
  dequantizing kernel (ops/quant_decode). Generated tokens wait in the cache
  dtype; every `period` (100) of them are scored by the last token's
  attention, split by Eq. 6-7 and quantized the same way.

Where the paper is open: Eq. 6 on a decode block compares the block's top
tokens with tau times the block's own attention total (its tokens' share of
the last token's softmax; the paper's total n only holds for a full
attention matrix). The eviction variant of the selection is `zipvl_evict`.
"""

from dataclasses import dataclass

from kernels_py.methods.allocators import important_count
from kernels_py.methods.mixed_precision import ImportanceQuantized
from kernels_py.params import knob


@dataclass(frozen=True)
class ZipVL(ImportanceQuantized):
    """ZipVL: the important tokens of each layer (adaptive count, Eq. 6-7) in 4 bits, the rest in 2."""

    name = "zipvl"
    paper = "He et al., 2024, ZipVL: Efficient Large Vision-Language Models with Dynamic Token Sparsification"

    tau: float = knob("float", 0.975, "share of the probe attention the important tokens must hold (paper: "
                      "0.96-0.975)", min=0.01, max=1.0, ref="ZipVL Eq. 6")

    def important_count(self, accumulated):
        return important_count(accumulated, self.tau)
