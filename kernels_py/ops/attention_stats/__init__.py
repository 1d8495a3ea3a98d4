"""Attention column statistics over a chosen subset of query rows (VL-Cache
appendix A.5): per selected row its softmax max and sum, per key the attention
it receives, how many rows see it and how many of those give it less than
p * row max. Every method that ranks prompt tokens by attention reads these.

contract.py   what is computed, the result types, input checks, row selectors
kernel.py     the Triton kernels of the two passes and their launchers
reference.py  the same contract in plain PyTorch
cases.py      compile cases (sm_80 / sm_90) and the selftest
"""

import torch

from kernels_py.ops.attention_stats import reference
from kernels_py.ops.attention_stats.contract import (
    AttentionStats, ReducedStats, all_rows, last_row, post_vision_rows, probe_rows, recent_rows,
)
from kernels_py.ops.attention_stats.kernel import attention_stats, column_stats, row_stats
from kernels_py.ops.common import use_triton


def compute(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, p: float = 0.01, *,
            backend: str = "auto", pos_range: tuple[int, int] | None = None) -> AttentionStats:
    """Statistics of the query rows q [H, R, d] at positions q_pos [R] over the
    keys k [H_kv, N, d], from the kernel or the reference as `backend` says
    (ops.common.BACKENDS); pos_range as kernel.attention_stats takes it."""
    if use_triton(backend, q.device):
        return attention_stats(q, k, q_pos, p, pos_range=pos_range)
    return reference.attention_stats(q, k, q_pos, p, pos_range=pos_range)


__all__ = [
    "AttentionStats", "ReducedStats", "compute", "reference",
    "attention_stats", "row_stats", "column_stats",
    "post_vision_rows", "probe_rows", "recent_rows", "last_row", "all_rows",
]
