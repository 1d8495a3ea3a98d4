"""The quantized decode op in plain PyTorch (the contract in contract.py):
dequantize every segment in full (float32), concatenate the uncompressed
segment and attend. Also the dequantize-then-attend path of the benchmark."""

import torch

from kernels_py.ops.common import softmax_scale
from kernels_py.ops.kv_quant import PAD_POS, reference as kv_reference
from kernels_py.ops.quant_decode.contract import DenseKV, QuantDecodeOutput, check_inputs


def quant_decode(q: torch.Tensor, q_pos: torch.Tensor, segments, dense: DenseKV, *,
                 sm_scale: float | None = None) -> QuantDecodeOutput:
    """Same contract as kernel.quant_decode."""
    check_inputs(q, q_pos, segments, dense)
    _, heads, _, head_dim = q.shape
    kv_heads = dense.k.shape[1]
    scale = softmax_scale(sm_scale, head_dim, "sm_scale")
    keys, values, visible = [], [], []
    for seg in segments:
        k, v = kv_reference.dequantize(seg)
        keys.append(k)
        values.append(v)
        slot = torch.arange(seg.slots, device=q.device)
        real = (slot[None, :] < seg.length[:, None].to(torch.int64)) & (seg.pos != PAD_POS)
        visible.append(real[:, None, :] & (seg.pos.to(torch.int64)[:, None, :] <= q_pos.to(torch.int64)[:, :, None]))
    slot = torch.arange(dense.k.shape[2], device=q.device)
    real = slot[None, :] < dense.length[:, None].to(torch.int64)
    keys.append(dense.k.float())
    values.append(dense.v.float())
    visible.append(real[:, None, :] & (dense.pos.to(torch.int64)[:, None, :] <= q_pos.to(torch.int64)[:, :, None]))
    group = heads // kv_heads
    k = torch.cat(keys, 2).repeat_interleave(group, 1)
    v = torch.cat(values, 2).repeat_interleave(group, 1)
    seen = torch.cat(visible, 2)  # [B, M, N]
    scores = torch.einsum("bhmd,bhnd->bhmn", q.float(), k) * scale
    scores = scores.masked_fill(~seen[:, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhmn,bhnd->bhmd", probs, v)
    return QuantDecodeOutput(out.to(q.dtype), lse)
