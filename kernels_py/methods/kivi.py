"""KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization
for KV Cache"): every token's keys quantized per channel and values per
token at one bit width, in groups of `group`, behind a full-precision
window of the `residual` most recent tokens; once `group` more tokens than
the window have accumulated, the oldest `group` are quantized. The uniform
baseline of ZipVL's mixed precision, on the same kernels.

Where this departs from KIVI: KIVI keeps keys and values apart, l mod R keys
in full precision (quantized R at a time) and exactly the R newest values
(one quantized a step). Here a token's key and value live in the same
segment, as the quantized decode kernel reads them, so both keep R to
R + G - 1 full-precision tokens: the values' R, and more keys than KIVI's.
At 672 prompt + 16 generated tokens (head_dim 128, 2 bits, G 32, R 128) that
holds 2.80x less than the fp16 cache where KIVI as published would hold
3.43x less."""

from dataclasses import dataclass

import torch

from kernels_py.methods.base import Method, backend_knob
from kernels_py.methods.mixed_precision import MixedPrecisionCache, QuantBatch, group_knob
from kernels_py.methods.prompt import check_prompt
from kernels_py.ops import kv_quant
from kernels_py.params import knob


@dataclass(frozen=True)
class KIVI(Method):
    """KIVI: keys per channel, values per token, 2 (or 4) bits, a full-precision window of recent tokens."""

    name = "kivi"
    paper = "Liu et al., 2024, KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"

    bits: int = knob("int", 2, "bits of every quantized key and value", choices=kv_quant.BITS, ref="KIVI")
    group: int = group_knob()
    residual: int = knob("int", 128, "most recent tokens kept in the cache dtype, keys and values alike, and up "
                         "to group - 1 more (KIVI's R: there exactly R values and l mod R keys)", min=0,
                         max=1 << 20, ref="KIVI section 3")
    backend: str = backend_knob("quantization and decode attention")

    def prefill_all(self, q, k, v, spans) -> list[MixedPrecisionCache]:
        check_prompt(q, k, v, spans)
        caches = []
        for layer in range(len(k)):
            cache = MixedPrecisionCache.empty(k[layer], v[layer], self.group, self.backend)
            tokens = k[layer].shape[1]
            old = max(0, (tokens - self.residual) // self.group * self.group)
            positions = torch.arange(tokens, device=k[layer].device).expand(cache.kv_heads, -1)
            cache.add(self.bits, k[layer][:, :old], v[layer][:, :old], positions[:, :old])
            # Copies of their own: views would keep the whole prompt's K and V (a model batch's, even) alive.
            cache.dense_k, cache.dense_v = k[layer][:, old:].clone(), v[layer][:, old:].clone()
            cache.dense_positions = positions[0, old:].clone()
            caches.append(cache)
        return caches

    def decode(self, layer, cache: MixedPrecisionCache, q_t, k_t, v_t) -> torch.Tensor:
        if not isinstance(cache, MixedPrecisionCache):
            raise TypeError(f"{self.owner_name()}: decode needs the cache its prefill built, got "
                            f"{type(cache).__name__}")
        self.check_step(layer, cache, q_t, k_t, v_t)
        cache.append(k_t, v_t)
        out = cache.attend(q_t).out
        if cache.dense_positions.shape[0] >= self.residual + self.group:
            k, v, pos = cache.take_dense(self.group)
            cache.add(self.bits, k, v, pos.expand(cache.kv_heads, -1))
        return out

    def decode_batch(self, caches, room, scratch):
        """QuantBatch where the caches allow it: a step requantizes once a
        sequence waits with residual + group tokens (not for a subclass's
        own decode)."""
        if type(self).decode is not KIVI.decode or not QuantBatch.holds(caches):
            return None
        return QuantBatch(caches, self.residual + self.group, room)

    def layer_metrics(self, layer, cache: MixedPrecisionCache) -> dict[str, float]:
        """quantized_tokens and dense_tokens held now."""
        return {"quantized_tokens": float(sum(cache.quantized_tokens.values())),
                "dense_tokens": float(cache.dense_positions.shape[0])}
