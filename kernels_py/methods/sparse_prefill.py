"""ZipVL's token-level sparse prefill (section 4.2, Algorithm 1): attention
computed only among each layer's important tokens, by a stock fast attention
kernel over gathered Q', K', V' (causal among themselves, so no custom mask:
the flash backend of SDPA on a GPU), and the other tokens' attention outputs
padded with zeros (the paper pads them "to maintain the number of tokens";
their residual stream carries them to the next layer).

Important tokens are chosen per kv head (Eq. 7's normalized scores, which the
paper writes for one head), the same number for every kv head, so the query
heads of a kv head gather that head's tokens and one GQA call covers all
heads. The paper partitions each layer's tokens once, into one important set
for all heads; per kv head a token may get attention outputs from some heads
and zeros from the others.

How the savings are counted: `flops_saved` is the share of causal query-key
pairs the important tokens' attention does not spend, averaged over layers
as 1 - r^2 with r = p / n; the paper's Attn FLOPs Reduction squares the mean
ratio (1 - mean(r)^2), a few points higher. `flops_saved_net` also charges
the probe rows' attention (Algorithm 1's A' = Softmax(Q'K^T)), which the
paper calls negligible for long contexts: 64 recent and 64 random rows
score 26% of a 672-token prompt's causal pairs, 0.6% of a 33K-token one's.
"""

from typing import NamedTuple


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
        except RuntimeError:  # no FlashAttention for these shapes or dtype (float32, as prefill_error asks)
            pass
    if gqa:  # enable_gqa leaves only the math backend, which builds the T x T scores (float32: ~4 GB a head at 32K)
        k, v = (t.repeat_interleave(q.shape[0] // k.shape[0], 0) for t in (k, v))
    return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]


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
    return out.scatter_(1, per_head[..., None].expand(-1, -1, dim), gathered.to(q.dtype))


def flops_saved(tokens: int, important: int) -> float:
    """Share of causal attention's FLOPs (query-key pairs) a prefill among
    `important` of `tokens` tokens does not spend."""
    return 1.0 - important * (important + 1) / (tokens * (tokens + 1)) if tokens else 0.0


def flops_saved_net(tokens: int, important: int, probe_rows: torch.Tensor) -> float:
    """flops_saved less the probe rows' attention, which chooses the important
    tokens: row r scores r + 1 keys (causal pairs, as the prefill's)."""
    if not tokens:
        return 0.0
    probes = int((probe_rows.to(torch.int64) + 1).sum())
    return 1.0 - (important * (important + 1) / 2 + probes) / (tokens * (tokens + 1) / 2)


class PrefillError(NamedTuple):
    """Relative errors of the sparse prefill's outputs against full causal
    attention on the same Q/K/V."""

    every: float  # over every row (the zeroed ones count: what the next layer reads)
    important: float  # at the important rows only (0 when none is important)
    last: float  # at the last row, which the first generated token is predicted from (1 where it is zeroed)


def prefill_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, important: torch.Tensor) -> PrefillError:
    """The sparse prefill's errors (PrefillError) for q [H, T, d], k, v [H_kv, T, d]."""
    heads = q.shape[0]
    important = important.to(q.device)
    full = _sdpa(q.float(), k.float(), v.float())
    sparse = sparse_prefill(q.float(), k.float(), v.float(), important)
    every, last = relative_error(sparse, full), relative_error(sparse[:, -1], full[:, -1])
    if important.shape[1] == 0:
        return PrefillError(every, 0.0, last)
    rows = important.repeat_interleave(heads // important.shape[0], 0)[..., None].expand(-1, -1, q.shape[-1])
    return PrefillError(every, relative_error(sparse.gather(1, rows), full.gather(1, rows)), last)
