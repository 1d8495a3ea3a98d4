"""The selected-row decode op in plain PyTorch (the contract in contract.py):
gather the listed rows (a copy, which the kernel avoids), then attend.
Also the slice-then-attend path of the benchmark."""

import torch

from kernels_py.ops.common import softmax_scale
from kernels_py.ops.gather_decode.contract import GatherDecodeOutput, check_inputs


def gather_decode(q, q_pos, k, v, pos, index, count, *, sm_scale: float | None = None) -> GatherDecodeOutput:
    """Same contract as kernel.gather_decode."""
    check_inputs(q, q_pos, k, v, pos, index, count)
    _, heads, _, head_dim = q.shape
    kv_heads = k.shape[1]
    scale = softmax_scale(sm_scale, head_dim, "sm_scale")
    entries = index.shape[2]
    used = torch.arange(entries, device=q.device) < count[..., None]  # [B, H_kv, N]
    if not k.shape[2]:  # no slots (so every count is 0): one never listed, for the gathers below
        k, v, pos = (torch.cat([t, t.new_zeros((*t.shape[:-2], 1, t.shape[-1]))], -2) for t in (k, v, pos[..., None]))
        pos = pos[..., 0]
    safe = torch.where(used, index.to(torch.int64), 0)
    rows = safe[..., None].expand(-1, -1, -1, head_dim)
    keys = k.float().gather(2, rows).repeat_interleave(heads // kv_heads, 1)  # [B, Hq, N, D]
    # Entries past a count point at row 0: zero their values, or a NaN there would leak through 0 * NaN.
    values = torch.where(used[..., None], v.float().gather(2, rows), 0.0).repeat_interleave(heads // kv_heads, 1)
    row_pos = pos.to(torch.int64)[:, None, :].expand(-1, kv_heads, -1).gather(2, safe)  # [B, H_kv, N]
    visible = used[:, :, None, :] & (row_pos[:, :, None, :] <= q_pos.to(torch.int64)[:, None, :, None])
    visible = visible.repeat_interleave(heads // kv_heads, 1)  # [B, Hq, M, N]
    scores = torch.einsum("bhmd,bhnd->bhmn", q.float(), keys) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhmn,bhnd->bhmd", probs, values)
    return GatherDecodeOutput(out.to(q.dtype), lse)
