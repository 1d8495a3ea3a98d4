"""Fixed-ratio ZipVL: the fixed-ratio mixed-precision baseline of ZipVL's
Table 3. The same probe-row importance (normalized attention, Eq. 7) and
the same 4/2-bit quantization as `zipvl`, but a fixed share of the tokens
is important in every layer instead of ZipVL's adaptive Eq. 6. At equal
bytes it isolates what the adaptive ratio buys.

It is not ZipCache (He et al., 2024b) as published, whose saliency metric
and channel-separable token-wise quantization differ; this method was called
`zipcache` before, and that name is refused with a pointer here."""

from dataclasses import dataclass

from kernels_py.methods.mixed_precision import ImportanceQuantized, fixed_count
from kernels_py.params import knob


@dataclass(frozen=True)
class ZipVLFixed(ImportanceQuantized):
    """Fixed-ratio ZipVL (Table 3's baseline): a fixed share of tokens (by normalized probe attention) in 4 bits, the rest in 2; not ZipCache as published."""

    name = "zipvl_fixed"
    paper = "He et al., 2024, ZipVL: Efficient Large Vision-Language Models with Dynamic Token Sparsification, Table 3"

    ratio: float = knob("float", 0.7, "share of the tokens quantized to high_bits in every layer (ZipVL Table 3's "
                        "fixed baseline: 70%)", min=0.0, max=1.0, ref="ZipVL Table 3")

    def important_count(self, accumulated):
        return fixed_count(self.ratio, accumulated.shape[0])
