"""Grouped-query attention: query head h reads kv head h // (heads // kv_heads)."""

import torch


def expand_kv(x: torch.Tensor, heads: int, dim: int = 0) -> torch.Tensor:
    """Repeat each kv head's slice of x along `dim` for the query heads that
    read it: [kv_heads, ...] -> [heads, ...]."""
    return x.repeat_interleave(heads // x.shape[dim], dim=dim)


def group_sum(per_query_head: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[heads, n] -> [kv_heads, n]: sum over the query heads sharing each kv head."""
    heads, n = per_query_head.shape
    return per_query_head.reshape(kv_heads, heads // kv_heads, n).sum(dim=1)
