"""FP8 codes of a KV cache and their scales, the way serving engines store
them: x is kept as fp8(x / scale), clamped to the format's largest finite
value (vLLM's scaled_fp8_quant saturates the same way; a plain cast would
give NaN), with one float32 scale per tensor, per kv head or per (kv head,
token).

The scale of a granularity is amax / FORMAT_MAX over what it covers, so the
largest value maps to the largest code. A static scale (per tensor, per
head) is computed once from the prompt and reused for every generated
token, which then saturates if it exceeds the prompt's range (vLLM's
calculate_kv_scales likewise fixes k_scale/v_scale from the first batch).
"""

import torch

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
CODE_DTYPES = tuple(FORMATS.values())
GRANULARITIES = ("tensor", "head", "token")
SCALE_DTYPE = torch.float32


def format_max(code_dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 dtype (448 for e4m3, 57344 for e5m2)."""
    return float(torch.finfo(code_dtype).max)


def code_dtype(fmt: str) -> torch.dtype:
    if fmt not in FORMATS:
        raise ValueError(f"fp8 format must be one of {sorted(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt]


def scales(x: torch.Tensor, granularity: str, code: torch.dtype) -> torch.Tensor:
    """float32 scales of x [..., kv_heads, tokens, d]: shape [..., 1, 1]
    (tensor), [..., kv_heads, 1] (head) or [..., kv_heads, tokens] (token);
    an all-zero span gets scale 1."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"fp8 scale granularity must be one of {GRANULARITIES}, got {granularity!r}")
    amax = x.detach().abs().to(SCALE_DTYPE).amax(-1)  # [..., kv_heads, tokens]
    if granularity == "head":
        amax = amax.amax(-1, keepdim=True)
    elif granularity == "tensor":
        amax = amax.amax((-2, -1), keepdim=True)
    scale = amax / format_max(code)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def encode(x: torch.Tensor, scale: torch.Tensor, code: torch.dtype) -> torch.Tensor:
    """fp8 codes of x [..., kv_heads, tokens, d] with scales broadcastable to
    [..., kv_heads, tokens] (scales' output), saturating at the format's range."""
    limit = format_max(code)
    return (x.to(SCALE_DTYPE) / scale[..., None]).clamp(-limit, limit).to(code)


def decode(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes * scale in `dtype` (computed in float32)."""
    return (codes.to(SCALE_DTYPE) * scale[..., None]).to(dtype)


def values_layout(codes: torch.Tensor) -> torch.Tensor:
    """The value codes [..., tokens, d] stored token-contiguous (each channel's
    tokens side by side, as a transposed view): the layout the decode kernel
    reads fastest. The PV dot takes two consecutive tokens of a channel per
    16-bit operand register, which byte codes stored channel-contiguous can
    only reach one byte load at a time (no 8-bit transposing ldmatrix before
    sm_100); keys are the QK dot's channel-consecutive operand and stay as
    they are."""
    return codes.transpose(-1, -2).contiguous().transpose(-1, -2)


def quantize(x: torch.Tensor, granularity: str = "tensor", fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of x [..., kv_heads, tokens, d]."""
    code = code_dtype(fmt)
    scale = scales(x, granularity, code)
    return encode(x, scale, code), scale
