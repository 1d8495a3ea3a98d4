"""Split-K flash-decoding over the rows of a KV cache an index list selects,
loading each row by index inside the kernel (no gathered copy). What is
computed: contract.py.

Stage 1, `_stage1_kernel`: one program per (kv head, sequence, split) owns
every query row of its kv group (GROUP query heads x M query tokens, padded
to a power of two >= 16 for tl.dot; SGLang's grouped decode), so a row is
read once for the group. Its split is a contiguous range of the kv head's
index list; each tile loads BLOCK_N indices, then the rows they name
(D contiguous elements each, so every row is a wide load) and their
positions, and runs the base-2 online softmax. Stage 2 merges the splits
(ops.splitk).

Reference: reference.py beside this file.
"""

import torch
import triton
import triton.language as tl

from kernels_py.ops import common, splitk
from kernels_py.ops.gather_decode.contract import GatherDecodeOutput, check_inputs
from kernels_py.ops.splitk import _attend_tile, _group_queries, _store_split

MAX_ROWS = 128  # query heads per kv head x query tokens, one program's rows
# The widest head: a 16-bit head of 512 channels (a [128, 512] K and V tile,
# three stages) needs 284672 bytes of shared memory on sm_90, more than a
# block may use; 256 needs 145408.
MAX_HEAD_DIM = 256
TOKENS_PER_SPLIT = 512
DEFAULT_MAX_SPLITS = 64
# 128-row tiles on 8 warps, three stages: the pipeliner loads the next
# tiles' indices a stage ahead of the rows they name, so the wait on an
# index list is not exposed each tile (two stages waited on it: the rows'
# addresses come from it). Float32 rows take 32-row tiles (registers).
DEFAULT_BLOCK_N, FLOAT32_BLOCK_N, DEFAULT_WARPS, DEFAULT_STAGES = 128, 32, 4, 3


@triton.jit
def _stage1_kernel(
    Q, QPos, K, V, Pos, Index, Count, PartO, PartLse,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_pb, stride_pm,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_rb, stride_rn,
    stride_ib, stride_ih, stride_in,
    stride_cb, stride_ch,
    stride_ob, stride_oh, stride_om, stride_os, stride_od,
    stride_sb, stride_sh, stride_sm, stride_ss,
    qk_scale, head_dim,
    GROUP: tl.constexpr, N_QUERIES: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    QK_DT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    kv_head = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    n_splits = tl.num_programs(2)

    head, query, row_mask, q_pos, offs_d, d_mask, q = _group_queries(
        Q, QPos, kv_head, b, stride_qb, stride_qh, stride_qm, stride_qd, stride_pb, stride_pm, head_dim,
        GROUP, N_QUERIES, BLOCK_ROWS, BLOCK_D, QK_DT)

    count = tl.load(Count + b * stride_cb + kv_head * stride_ch).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(count, n_splits), BLOCK_N) * BLOCK_N
    lo = tl.minimum(split * per_split, count)
    hi = tl.minimum(lo + per_split, count)

    m_i = tl.full([BLOCK_ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    acc = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
    Idx = Index + b * stride_ib + kv_head * stride_ih
    K_h = K + b * stride_kb + kv_head * stride_kh
    V_h = V + b * stride_vb + kv_head * stride_vh
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        tok_mask = offs_n < hi
        rows = tl.load(Idx + offs_n * stride_in, mask=tok_mask, other=0).to(tl.int64)
        pos = tl.load(Pos + b * stride_rb + rows * stride_rn, mask=tok_mask, other=0).to(tl.int32)
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        k = tl.load(K_h + rows[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(V_h + rows[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, pos, tok_mask, q_pos, row_mask, m_i, l_i, acc, qk_scale, QK_DT)

    part_rows = b * stride_ob + head[:, None] * stride_oh + query[:, None] * stride_om + split * stride_os
    lse_rows = b * stride_sb + head * stride_sh + query * stride_sm + split * stride_ss
    _store_split(PartO + part_rows, PartLse + lse_rows, acc, m_i, l_i, offs_d, d_mask, row_mask, stride_od)


def default_num_splits(count: torch.Tensor) -> int:
    """Splits per (sequence, kv head): about TOKENS_PER_SPLIT rows each for the
    longest list, at most DEFAULT_MAX_SPLITS; on a GPU more (down to 128 rows
    each) while the grid would not fill two waves of SMs. One host sync."""
    longest = int(count.max()) if count.numel() else 0
    return split_count(longest, count.numel(), splitk.sm_count(count.device))


def default_block_n(elem_bytes: int) -> int:
    """The index tile of a call with block_n=None, by the cache's element size."""
    return FLOAT32_BLOCK_N if elem_bytes > 2 else DEFAULT_BLOCK_N


def stage1_warps(elem_bytes: int, block_d: int, block_n: int) -> int:
    """Warps of a stage-1 program: its K and V tiles [block_n, block_d] live
    in registers, so tiles wider than a 16-bit [32, 128] pair get 8 warps
    (float32 rows of head_dim 80 spilled on sm_80 on 4)."""
    return 2 * DEFAULT_WARPS if elem_bytes * block_d * block_n > 2 * 128 * 32 else DEFAULT_WARPS


def split_count(longest: int, programs_per_split: int, sms: int | None) -> int:
    """The default split count for the longest index list, with
    `programs_per_split` programs per split (kv heads x sequences) on `sms`
    SMs (None: the interpreter)."""
    return splitk.split_count(longest, programs_per_split, per_split=TOKENS_PER_SPLIT, min_split=128,
                              max_splits=DEFAULT_MAX_SPLITS, sms=sms)


def gather_decode(q, q_pos, k, v, pos, index, count, *, sm_scale: float | None = None,
                  num_splits: int | None = None, workspace: splitk.Workspace | None = None, check_values: bool = True,
                  block_n: int | None = None) -> GatherDecodeOutput:
    """One decode step over the rows index[b, g, :count[b, g]] of kv head g's
    cache (k, v [B, H_kv, S, D], any strides), read in place.

    q: [B, Hq, M, D] fp16/bf16/fp32; q_pos [B, M] and pos [B, S] int (causal
    visibility by position). sm_scale: default D ** -0.5. num_splits: splits
    per (sequence, kv head), default default_num_splits (one host sync).
    workspace: make_workspace's scratch, reused across calls (its split
    count is used). check_values=False skips the checks that read values
    (counts, index ranges, duplicates), which wait for the device. block_n:
    the index tile (power of two >= 16), default default_block_n.
    Returns GatherDecodeOutput(out [B, Hq, M, D] q.dtype, lse [B, Hq, M] float32).
    """
    check_inputs(q, q_pos, k, v, pos, index, count, check_values)
    common.check_launchable(q)
    batch, heads, queries, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is wider than the kernel's widest head, {MAX_HEAD_DIM} (its tiles of "
                         f"wider rows need more shared memory than a GPU block has); the reference takes any")
    if group * queries > MAX_ROWS:
        raise ValueError(f"query heads per kv head x query tokens = {group * queries} exceeds {MAX_ROWS}, the rows "
                         f"one program holds")
    scale = common.softmax_scale(sm_scale, head_dim, "sm_scale")
    block_n = common.check_block("block_n", block_n) if block_n is not None else default_block_n(k.element_size())
    dev = q.device
    out = torch.empty((batch, heads, queries, head_dim), dtype=q.dtype, device=dev)
    lse = torch.empty((batch, heads, queries), dtype=torch.float32, device=dev)
    if batch == 0 or heads == 0 or queries == 0:  # nothing to compute (and N_QUERIES=0 would divide by 0)
        return GatherDecodeOutput(out, lse)
    workspace = splitk.workspace_for(q, workspace, num_splits, lambda: default_num_splits(count))
    _stage1_kernel[(kv_heads, batch, workspace.splits)](
        q, q_pos, k, v, pos, index, count, workspace.part_o, workspace.part_lse,
        *q.stride(), *q_pos.stride(), *k.stride(), *v.stride(), *pos.stride(), *index.stride(), *count.stride(),
        *workspace.part_o.stride(), *workspace.part_lse.stride(),
        scale * common.LOG2E, head_dim,
        GROUP=group, N_QUERIES=queries, BLOCK_ROWS=common.block(group * queries), BLOCK_D=common.block(head_dim),
        QK_DT=common.dot_dtype(q.dtype, k.dtype, v.dtype), BLOCK_N=block_n,
        num_warps=stage1_warps(k.element_size(), common.block(head_dim), block_n), num_stages=DEFAULT_STAGES)
    splitk.merge(workspace.part_o, workspace.part_lse, out, lse)
    return GatherDecodeOutput(out, lse)
