"""ZipVL's token-level sparse prefill (section 4.2, Algorithm 1): attention
computed only among each layer's important tokens, by a stock fast attention
kernel over gathered Q', K', V' (causal among themselves, so no custom mask:
the flash backend of SDPA on a GPU), and the other tokens' attention outputs
padded with zeros (the paper pads them "to maintain the number of tokens";
their residual stream carries them to the next layer).

Important tokens are chosen per kv head (ZipVL Eq. 7), the same number for
every kv head, so the query heads of a kv head gather that head's tokens and
one GQA call covers all heads.
"""

import torch
import torch.nn.functional as F

from kernels_py.metrics import relative_error


def _sdpa(q, k, v):
    """Causal attention, q [H, n, d], k, v [H_kv, n, d]; FlashAttention where it takes the inputs."""
    gqa = q.shape[0] != k.shape[0]
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=gqa)[0]
        except RuntimeError:  # no FlashAttention for these shapes or dtype
            pass
    return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=gqa)[0]


def sparse_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, important: torch.Tensor) -> torch.Tensor:
    """Prefill attention output [H, T, d] where the tokens important[g] ([H_kv, p]
    indices, ascending) of kv head g attend causally among themselves only, and
    every other token's output is 0. q [H, T, d]; k, v [H_kv, T, d];
    `important` may sit on another device (a host-side selection)."""
    heads, tokens, dim = q.shape
    important = important.to(q.device)
    kv_heads, count = important.shape
    if kv_heads != k.shape[0] or heads % kv_heads:
        raise ValueError(f"important must be [kv_heads={k.shape[0]}, p], got {tuple(important.shape)}")
    if count and not bool((important[:, 1:] > important[:, :-1]).all()):
        raise ValueError("important indices must be strictly ascending per kv head (causal order)")
    per_head = important.repeat_interleave(heads // kv_heads, 0)  # [H, p]
    gathered = _sdpa(q.gather(1, per_head[..., None].expand(-1, -1, dim)),
                     k.gather(1, important[..., None].expand(-1, -1, dim)),
                     v.gather(1, important[..., None].expand(-1, -1, dim)))
    out = q.new_zeros(heads, tokens, dim)
    return out.scatter(1, per_head[..., None].expand(-1, -1, dim), gathered.to(q.dtype))


def flops_saved(tokens: int, important: int) -> float:
    """Share of causal attention's FLOPs (query-key pairs) a prefill among
    `important` of `tokens` tokens does not spend."""
    return 1.0 - important * (important + 1) / (tokens * (tokens + 1)) if tokens else 0.0


def prefill_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, important: torch.Tensor) -> tuple[float, float]:
    """Relative error of the sparse prefill's outputs against full causal
    attention: over every row (the zeroed ones count: what the next layer
    reads), and at the important rows only (0 when none is important)."""
    heads = q.shape[0]
    important = important.to(q.device)
    full = _sdpa(q.float(), k.float(), v.float())
    sparse = sparse_prefill(q.float(), k.float(), v.float(), important)
    if important.shape[1] == 0:
        return relative_error(sparse, full), 0.0
    rows = important.repeat_interleave(heads // important.shape[0], 0)[..., None].expand(-1, -1, q.shape[-1])
    return relative_error(sparse, full), relative_error(sparse.gather(1, rows), full.gather(1, rows))
