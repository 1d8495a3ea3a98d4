"""The attention-statistics op in plain PyTorch (the contract in contract.py):
materialise the causal softmax of the selected rows in float32 and reduce it."""

import torch

from kernels_py.ops.attention_stats.contract import AttentionStats, check_inputs, check_threshold
from kernels_py.ops.common import LOG2E, softmax_scale


def causal_scores(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, scale: float | None = None):
    """Scaled scores [H, R, N] in float32 (natural-log units), -inf where row i
    does not see key j, and the visibility mask [R, N]."""
    heads, _, head_dim = q.shape
    kv_heads, n_keys, _ = k.shape
    scale = softmax_scale(scale, head_dim)
    k = k.float().repeat_interleave(heads // kv_heads, dim=0)
    scores = torch.einsum("hmd,hnd->hmn", q.float(), k) * scale
    visible = torch.arange(n_keys, device=q.device)[None, :] <= q_pos.to(q.device, torch.int64)[:, None]
    return scores.masked_fill(~visible, float("-inf")), visible


def attention_stats(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, p: float = 0.01,
                    scale: float | None = None, pos_range: tuple[int, int] | None = None) -> AttentionStats:
    """Same contract as kernel.attention_stats, and the same input checks but
    the kernels' widest head (MAX_HEAD_DIM): the reference takes any.
    pos_range as the kernel takes it: the positions' range, checked without
    reading q_pos on the host."""
    check_inputs(q, k, q_pos, pos_range, max_head_dim=None)
    p = check_threshold(p)
    heads, n_rows, _ = q.shape
    kv_heads, n_keys, _ = k.shape
    if not n_rows:  # nothing selected (the reductions below cannot take a segment with no keys either)
        zeros = torch.zeros((heads, n_keys), dtype=torch.float32, device=q.device)
        empty = torch.empty((heads, 0), dtype=torch.float32, device=q.device)
        counts = torch.zeros((heads, n_keys), dtype=torch.int32, device=q.device)
        return AttentionStats(empty, empty.clone(), zeros, counts, counts.clone(), zeros[:kv_heads].clone(), float(p))
    scores, visible = causal_scores(q, k, q_pos, scale)
    row_max = scores.amax(dim=-1)
    row_sumexp = torch.exp(scores - row_max[..., None]).sum(dim=-1)
    probs = torch.softmax(scores, dim=-1)
    kept = probs >= p * probs.amax(dim=-1, keepdim=True)
    below = (visible & ~kept).sum(dim=1, dtype=torch.int32)
    nonzero = visible.sum(dim=0, dtype=torch.int32).expand(heads, n_keys).contiguous()
    attn_sum = probs.sum(dim=1)
    attn_sum_kv = attn_sum.view(kv_heads, heads // kv_heads, n_keys).sum(dim=1)
    return AttentionStats(row_max * LOG2E, row_sumexp, attn_sum, below, nonzero, attn_sum_kv, float(p))


def threshold_distance(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, p: float = 0.01,
                       scale: float | None = None) -> torch.Tensor:
    """|log A_ij - log(p * max_j A_ij)| = |s_ij - max_j s_ij - log p| for each
    visible entry, inf elsewhere, [H, R, N]: how far an entry sits from the
    ThresholdFilter's cut, in natural-log units. Entries closer than the score
    error of an implementation can fall on either side of it."""
    scores, visible = causal_scores(q, k, q_pos, scale)
    dist = (scores - scores.amax(dim=-1, keepdim=True) - torch.log(torch.tensor(float(p)))).abs()
    return dist.masked_fill(~visible, float("inf"))
