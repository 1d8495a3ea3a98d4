"""Reference for kernels_py.triton.attention_mass: materialise the causal
softmax in float32 and sum it over the query rows."""

import torch


def attention_mass(q: torch.Tensor, k: torch.Tensor, q_start: int, scale: float | None = None) -> torch.Tensor:
    heads, n_rows, head_dim = q.shape
    kv_heads, n_keys, _ = k.shape
    scale = head_dim ** -0.5 if scale is None else float(scale)
    k = k.float().repeat_interleave(heads // kv_heads, dim=0)
    scores = torch.einsum("hmd,hnd->hmn", q.float(), k) * scale
    q_pos = torch.arange(q_start, q_start + n_rows, device=q.device)[:, None]
    k_pos = torch.arange(n_keys, device=q.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    return torch.softmax(scores, dim=-1).sum(dim=1)
