"""The FP8 decode op in plain PyTorch (the contract in contract.py):
dequantize the whole cache (a copy, which the kernel avoids), then attend.
Also the unfused path of the benchmark."""

import torch

from kernels_py.ops.common import softmax_scale
from kernels_py.ops.fp8_decode import codec
from kernels_py.ops.fp8_decode.contract import Fp8DecodeOutput, check_inputs, per_token


def dequantize(k, v, k_scale, v_scale, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's keys and values [B, H_kv, S, D] in `dtype`."""
    if not per_token(k_scale):
        k_scale, v_scale = k_scale[..., None], v_scale[..., None]
    return codec.decode(k, k_scale, dtype), codec.decode(v, v_scale, dtype)


def fp8_decode(q, q_pos, k, v, k_scale, v_scale, pos, *, sm_scale: float | None = None) -> Fp8DecodeOutput:
    """Same contract as kernel.fp8_decode, in float32."""
    check_inputs(q, q_pos, k, v, k_scale, v_scale, pos)
    heads, head_dim = q.shape[1], q.shape[3]
    group = heads // k.shape[1]
    scale = softmax_scale(sm_scale, head_dim, "sm_scale")
    keys, values = (t.repeat_interleave(group, 1) for t in dequantize(k, v, k_scale, v_scale))
    visible = pos.to(torch.int64)[:, None, None, :] <= q_pos.to(torch.int64)[:, None, :, None]  # [B, 1, M, S]
    scores = torch.einsum("bhmd,bhnd->bhmn", q.float(), keys) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhmn,bhnd->bhmd", probs, values)
    return Fp8DecodeOutput(out.to(q.dtype), lse)
