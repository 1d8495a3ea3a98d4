"""FP8 KV cache, as serving engines ship it: every token kept, K and V
stored as float8 codes (e4m3 by default, e5m2 as a knob) with float32
scales per tensor (vLLM's k_scale/v_scale, the default), per kv head or per
token; decoding converts the codes in registers (ops.fp8_decode). Half the
bytes of the 16-bit cache plus the scales: the baseline a compression
method must beat at equal bytes. Every token-keeping method takes the same
two knobs (kv_dtype, fp8_scale), so "SnapKV at 50% + FP8" is, in a
script's extra, {"method": "snapkv", "budget": 0.5, "kv_dtype": "fp8_e4m3"}."""

from dataclasses import dataclass

from kernels_py.methods.allocators import Uniform
from kernels_py.methods.base import TokenSelection
from kernels_py.methods.float8 import kv_dtype_knob
from kernels_py.methods.scorers import Scorer


@dataclass(frozen=True)
class FP8(TokenSelection):
    """FP8 KV cache (vLLM / FlashInfer): every token, K and V as float8 codes with float32 scales."""

    name = "fp8"
    paper = "vLLM quantized KV cache (kv_cache_dtype fp8_e4m3, per-tensor k_scale/v_scale); FlashInfer fp8 KV decode"

    kv_dtype: str = kv_dtype_knob("fp8_e4m3", choices=("fp8_e4m3", "fp8_e5m2"))

    def scorer(self):
        return Scorer()

    def allocator(self):
        return Uniform(1.0)

    @classmethod
    def notes(cls) -> list[str]:
        return ["bytes: one byte per K and V element plus the float32 scales (8 bytes a layer per tensor, 8 per kv "
                "head, or 8 per kv head and token), against the workload dtype's cache: 2x less than fp16 at "
                "per-tensor scales, 1.94x at per-token scales with head_dim 128",
                "a per-tensor or per-head scale is fixed from the prompt (amax / the format's largest value); "
                "generated tokens beyond it saturate, as with an engine's static scale",
                "combine with any token-keeping method, e.g. in a script's extra: {\"method\": \"snapkv\", \"budget\": 0.5, "
                "\"kv_dtype\": \"fp8_e4m3\"}",
                "attention=\"sdpa\" decodes with the fused fp8 kernel (ops/fp8_decode) on a GPU; float32 (default) "
                "attends over the dequantized cache in float32"]
