"""The FP8 cache representation: a layer's kept tokens stored as float8
codes with float32 scales, the way serving engines store an fp8 KV cache
(vLLM's kv_cache_dtype="fp8_e4m3"/"fp8_e5m2" with per-tensor k_scale and
v_scale, or per attention head from calibration; FlashInfer's decode takes
the same scalar scales; per token is finer than either ships), and the
knobs every token-keeping method gets for it (TokenSelection's kv_dtype and
fp8_scale), so an eviction method over an FP8 cache is one setting, in
a script's extra: {"method": "snapkv", "budget": 0.5, "kv_dtype": "fp8_e4m3"}.

Codes and scales come from ops.fp8_decode.codec: the scale is amax / the
format's largest value over what it covers; a per-tensor or per-head scale
is fixed from the prompt's kept tokens, and a generated token beyond it
saturates, as with an engine's static scale; a per-token scale is each
token's own. Decoding runs the fused fp8 decode op (kernel on CUDA) or,
where a method needs the attention weights or float32 precision, the
dequantized cache in float32.
"""

import torch

from kernels_py.attention import expand_kv
from kernels_py.methods.caches import KeptTokens
from kernels_py.metrics import tensor_bytes
from kernels_py.ops import fp8_decode
from kernels_py.ops.fp8_decode import codec
from kernels_py.params import knob

# kv_dtype values: the model's own 16-bit cache, or fp8 in vLLM's spelling of kv_cache_dtype.
KV_DTYPES = {"model": None, "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}


def kv_dtype_knob(default: str = "model", choices=tuple(KV_DTYPES)):
    model = "model (the workload's dtype, uncompressed) or " if "model" in choices else ""
    return knob("str", default, f"how the kept tokens' K and V are stored: {model}fp8 codes with float32 scales, "
                "e4m3 (vLLM's and FlashInfer's default) or e5m2", choices=choices,
                ref="vLLM kv_cache_dtype; FlashInfer fp8 KV decode")


def fp8_scale_knob():
    return knob("str", "tensor", "granularity of the fp8 scales (with an fp8 kv_dtype): tensor (one per layer and "
                "sequence, vLLM's k_scale/v_scale), head (one per kv head) or token (one per kv head and token, "
                "8 bytes a token and kv head)", choices=codec.GRANULARITIES,
                ref="vLLM quantized KV cache (per-tensor, per-attention-head scales)")


class Float8Tokens(KeptTokens):
    """A layer's kept tokens as fp8 codes: k_codes [kv_heads, n, d]; the
    value codes stored token-contiguous (v_codes_t [kv_heads, d, n], the
    layout the decode kernel reads: codec.values_layout); scales float32
    [1, 1] (tensor), [kv_heads, 1] (head) or [kv_heads, n] (token).
    `keys` and `values` dequantize (float32) for whatever reads them."""

    def __init__(self, kept: KeptTokens, fmt: str, granularity: str):
        code = codec.code_dtype(fmt)
        self.fmt, self.granularity, self.dtype = fmt, granularity, kept.keys.dtype
        self.k_codes, self.k_scale = codec.quantize(kept.keys, granularity, fmt)
        v_codes, self.v_scale = codec.quantize(kept.values, granularity, fmt)
        self.v_codes_t = v_codes.transpose(1, 2).contiguous()
        if granularity == "tensor":
            self.k_scale, self.v_scale = self.k_scale.reshape(1, 1), self.v_scale.reshape(1, 1)
        self.code = code
        self.positions, self.scores, self.seen = kept.positions, kept.scores, kept.seen
        self.notes, self.share = kept.notes, kept.share

    @property
    def keys(self) -> torch.Tensor:
        return codec.decode(self.k_codes, self.k_scale)

    @property
    def values(self) -> torch.Tensor:
        return codec.decode(self.v_codes, self.v_scale)

    @property
    def v_codes(self) -> torch.Tensor:
        return self.v_codes_t.transpose(1, 2)

    @property
    def tokens(self) -> int:
        return self.k_codes.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k_codes.shape[2]

    @property
    def nbytes(self) -> int:
        """Codes and scales, exactly (positions are bookkeeping, as for KeptTokens)."""
        return tensor_bytes(self.k_codes, self.v_codes_t, self.k_scale, self.v_scale)

    def _keep_kv(self, indices: torch.Tensor) -> None:
        d = self.k_codes.shape[-1]
        # torch has no gather for float8 on the CPU: gather the bytes.
        self.k_codes = self.k_codes.view(torch.uint8).gather(1, indices[..., None].expand(-1, -1, d)).view(self.code)
        self.v_codes_t = self.v_codes_t.view(torch.uint8).gather(2, indices[:, None, :].expand(-1, d, -1)) \
            .view(self.code)
        if self.granularity == "token":
            self.k_scale, self.v_scale = self.k_scale.gather(1, indices), self.v_scale.gather(1, indices)

    def _append_kv(self, k_t: torch.Tensor, v_t: torch.Tensor) -> None:
        """The generated token's codes: with its own scales (per token), or
        the layer's fixed ones, saturating beyond them."""
        if self.granularity == "token":
            k_scale, v_scale = codec.scales(k_t, "token", self.code), codec.scales(v_t, "token", self.code)
            self.k_scale = torch.cat([self.k_scale, k_scale], dim=1)
            self.v_scale = torch.cat([self.v_scale, v_scale], dim=1)
        else:
            k_scale, v_scale = self.k_scale, self.v_scale
        self.k_codes = torch.cat([self.k_codes, codec.encode(k_t, k_scale, self.code)], dim=1)
        self.v_codes_t = torch.cat([self.v_codes_t, codec.encode(v_t, v_scale, self.code).transpose(1, 2)], dim=2)

    def attend(self, q_t: torch.Tensor, weights: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As KeptTokens.attend. weights=True: over the dequantized cache in
        float32 (the precision comparisons use). weights=False: the fused fp8
        decode op (ops.fp8_decode: the kernel on CUDA, its reference on the
        CPU), every held token visible."""
        if weights:
            heads, _, head_dim = q_t.shape
            keys, values = expand_kv(self.keys, heads), expand_kv(self.values, heads)
            w = torch.softmax(q_t.float() @ keys.transpose(1, 2) / head_dim ** 0.5, dim=-1)
            return (w @ values).to(q_t.dtype), w[:, 0]
        kv_heads, n = self.k_codes.shape[:2]
        if self.granularity == "token":
            k_scale, v_scale = self.k_scale[None], self.v_scale[None]
        else:
            k_scale, v_scale = (s.reshape(-1)[None].expand(1, kv_heads) for s in (self.k_scale, self.v_scale))
        pos = torch.zeros(1, n, dtype=torch.int32, device=q_t.device)  # held tokens all precede the query
        q_pos = torch.zeros(1, 1, dtype=torch.int32, device=q_t.device)
        result = fp8_decode.compute(q_t[None], q_pos, self.k_codes[None], self.v_codes[None], k_scale, v_scale, pos)
        return result.out[0], None
