"""Metrics for KV-cache compression: memory, output error, and how well a
method keeps the tokens attention actually uses.

All functions compute in float32 (float64 where a sum of squares could lose
digits) whatever the inputs' dtype, and run on the inputs' device.
"""

import math

import torch

from kernels_py.attention import expand_kv


def tensor_bytes(*tensors: torch.Tensor) -> int:
    """Bytes held by the tensors' elements: what a KV cache costs in memory
    (K and V of the kept tokens; bookkeeping such as indices is not counted)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def compression_ratio(full_bytes: int, compressed_bytes: int) -> float:
    """full / compressed, so 4.0 means the cache is four times smaller
    (the convention of AttentionPack's "compression ratio")."""
    if compressed_bytes <= 0:
        raise ValueError(f"compressed cache size must be positive, got {compressed_bytes}")
    return full_bytes / compressed_bytes


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    """||o - o_full|| / ||o_full|| (Frobenius over all heads and channels): the
    attention-output error of one layer at one step against the full cache
    (0 where both are zero, inf where only the reference is)."""
    if output.shape != reference.shape:
        raise ValueError(f"output shape {tuple(output.shape)} != reference shape {tuple(reference.shape)}")
    reference = reference.double()
    diff, norm = torch.linalg.vector_norm(output.double() - reference).item(), torch.linalg.vector_norm(reference).item()
    return diff / norm if norm else (0.0 if diff == 0 else float("inf"))


def causal_attention(q: torch.Tensor, k: torch.Tensor, query_start: int | None = None) -> torch.Tensor:
    """Softmax attention probabilities [heads, rows, keys], float32, with the
    causal mask: row i is the query at position query_start + i and sees keys
    0..query_start + i (default: the rows are the last ones). GQA: query head h
    reads kv head h // (heads // kv_heads). q: [heads, rows, d]; k: [kv_heads, keys, d]."""
    heads, rows, head_dim = q.shape
    kv_heads, keys, _ = k.shape
    query_start = keys - rows if query_start is None else query_start
    scores = q.float() @ expand_kv(k.float(), heads).transpose(1, 2) / math.sqrt(head_dim)
    return torch.softmax(scores.masked_fill(_future(rows, keys, query_start, q.device), float("-inf")), dim=-1)


def _future(rows: int, keys: int, query_start: int, device) -> torch.Tensor:
    """[rows, keys] True where the key comes after the query (masked out)."""
    query_pos = torch.arange(query_start, query_start + rows, device=device)[:, None]
    return torch.arange(keys, device=device)[None, :] > query_pos


def layer_sparsity(attention: torch.Tensor, query_start: int | None = None, threshold: float = 0.01) -> torch.Tensor:
    """VL-Cache Eq. 1-2: gamma = fraction of causal entries (i >= j) whose score
    is below threshold * (row max), threshold p = 1% as in the paper.

    attention: [..., rows, keys] probabilities, rows placed as in
    `causal_attention`. Returns gamma per leading index (e.g. per head);
    every head has the same causal count, so their mean is the layer's gamma.
    """
    rows, keys = attention.shape[-2:]
    query_start = keys - rows if query_start is None else query_start
    causal = ~_future(rows, keys, query_start, attention.device)
    row_max = attention.amax(dim=-1, keepdim=True)
    filtered_out = (attention < threshold * row_max) & causal
    return filtered_out.sum(dim=(-2, -1)).float() / causal.sum().float()


# Most attention entries held at once where a whole layer's prefill attention
# would be too big (1 GiB in float32): a 100K-token prompt has heads x 10^10.
WHOLE_ATTENTION_ENTRIES = 2**28


def causal_sparsity(q: torch.Tensor, k: torch.Tensor, query_start: int | None = None, threshold: float = 0.01,
                    max_entries: int | None = None) -> torch.Tensor:
    """`layer_sparsity(causal_attention(q, k, query_start))` per head, holding
    at most about `max_entries` (default WHOLE_ATTENTION_ENTRIES) attention
    entries at a time: rows go in blocks, each against the keys it can see."""
    max_entries = WHOLE_ATTENTION_ENTRIES if max_entries is None else max_entries
    heads, rows, _ = q.shape
    keys = k.shape[1]
    query_start = keys - rows if query_start is None else query_start
    if heads * rows * keys <= max_entries:
        return layer_sparsity(causal_attention(q, k, query_start), query_start, threshold)
    block = max(1, max_entries // (heads * keys))
    filtered = torch.zeros(heads, dtype=torch.float64, device=q.device)
    for first in range(0, rows, block):
        last = min(rows, first + block)
        visible = query_start + last  # keys 0..visible-1 are all any row of the block sees
        attention = causal_attention(q[:, first:last], k[:, :visible], query_start + first)
        causal = ~_future(last - first, visible, query_start + first, q.device)
        filtered += ((attention < threshold * attention.amax(dim=-1, keepdim=True)) & causal).sum(dim=(-2, -1))
    causal_entries = rows * (query_start + 1) + rows * (rows - 1) // 2
    return (filtered / causal_entries).float()


def cache_hit_rate(kept: torch.Tensor, decode_attention: torch.Tensor) -> torch.Tensor:
    """VL-Cache Definition 3.1: |S_psi,k ∩ S_psi*,k| / |S_psi*,k|.

    kept: [..., k] indices of the prompt tokens a method kept (S_psi,k).
    decode_attention: [..., m] the first decoding query's attention over the m
    prompt tokens, A_{m+1} = softmax(Q_{m+1} K_{:m}^T / sqrt(d)) (psi*); its top k
    is the ground truth S_psi*,k. Returns the rate per leading index.
    """
    k = kept.shape[-1]
    truth = decode_attention.topk(k, dim=-1).indices
    return _membership(kept, decode_attention.shape[-1]).gather(-1, truth).sum(-1).float() / k


def ppci(
    reference: torch.Tensor, candidate: torch.Tensor, p: float, candidate_present: torch.Tensor | None = None,
    reference_present: torch.Tensor | None = None,
) -> torch.Tensor:
    """A-VL Eq. 2, the p-percentile concordance index: |T1 ∩ T2| / (p * N), where
    T1, T2 are the top p*N (rounded, at least 1) of N tokens by the two score
    sequences.

    reference, candidate: [..., N] scores (attention, or logits: same ranking).
    candidate_present: [..., N] bool, the tokens the candidate holds at all; an
    evicted token has no score, so T2 is the top p*N of the present tokens (fewer
    if fewer are present) while the denominator stays p * N.
    reference_present: [..., N] bool, where the reference too holds only some
    tokens (a method's own ranking at an earlier step): each row's N is the
    tokens it holds, so T1 and T2 are the top p*N of those and a ranking that
    keeps its tokens scores 1 however few they are; nan where it holds none.
    Returns PPCI per leading index.
    """
    if not 0 < p <= 1:
        raise ValueError(f"p must be in (0, 1], got {p}")
    if candidate_present is None:
        candidate_present = torch.ones_like(candidate, dtype=torch.bool)
    if reference_present is None:
        reference_present = torch.ones_like(reference, dtype=torch.bool)
    held = reference_present.sum(-1)
    count = torch.clamp(torch.floor(p * held.double() + 0.5), min=1).to(held.dtype)
    in_reference = (_ranks(reference.float().masked_fill(~reference_present, float("-inf")))
                    < count[..., None]) & reference_present
    in_candidate = (_ranks(candidate.float().masked_fill(~candidate_present, float("-inf")))
                    < count[..., None]) & candidate_present
    both = (in_reference & in_candidate).sum(-1).float() / count.float()
    return both.masked_fill(held == 0, float("nan"))

def _ranks(scores: torch.Tensor) -> torch.Tensor:
    """[..., N] each score's place in its row, highest first (ties: the earlier token first)."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    return torch.empty_like(order).scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device)
                                            .expand_as(order).contiguous())


def _membership(indices: torch.Tensor, n: int) -> torch.Tensor:
    """[..., k] indices -> [..., n] bool, True at the listed indices."""
    member = torch.zeros(*indices.shape[:-1], n, dtype=torch.bool, device=indices.device)
    return member.scatter(-1, indices, True)


def kept_jaccard(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[list[float]]:
    """Per layer and kv head, |A & B| / |A | B| of two methods' kept token
    positions (per layer [kv_heads, n] each)."""
    out = []
    for x, y in zip(a, b, strict=True):
        row = []
        for hx, hy in zip(x.tolist(), y.tolist(), strict=True):
            sx, sy = set(hx), set(hy)
            row.append(len(sx & sy) / len(sx | sy) if sx | sy else 1.0)  # two empty sets agree
        out.append(row)
    return out
