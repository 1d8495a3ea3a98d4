"""Attention mass per key: for each query head, the sum over a block of query
rows of softmax(q k^T * scale) under a causal mask, computed without writing the
scores or the attention matrix to memory.

Each program owns BLOCK_M query rows of one head and walks the keys twice:
pass 1 keeps the running row max and sum of exp (online softmax), pass 2
recomputes the probabilities with those and adds their column sums into the
output. Reference: kernels_py.ref.attention_mass.
"""

import torch
import triton
import triton.language as tl

from kernels_py.triton import compat

LOG2E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _scores(q, k_ptrs, offs_n, q_pos, n_keys, qk_scale, d_mask, UPCAST: tl.constexpr):
    """Scores of a query block against one key block, in log2 units, with the
    causal mask and the ragged tail set to -inf."""
    k = tl.load(k_ptrs, mask=(offs_n[None, :] < n_keys) & d_mask[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision="ieee") * qk_scale
    visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] < n_keys)
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _attention_mass_kernel(
    Q, K, Out,
    stride_qh, stride_qm, stride_qd,
    stride_kh, stride_kn, stride_kd,
    stride_oh, stride_on,
    n_rows, n_keys, q_start, qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = offs_m < n_rows
    d_mask = offs_d < HEAD_DIM
    q_pos = q_start + offs_m

    q = tl.load(
        Q + head * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + kv_head * stride_kh + offs_d[:, None] * stride_kd
    # Keys past the last row's position are masked for every row of this block.
    key_end = tl.minimum(q_start + (pid_m + 1) * BLOCK_M, n_keys)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(0, key_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s = _scores(q, k_base + offs_n[None, :] * stride_kn, offs_n, q_pos, n_keys, qk_scale, d_mask, UPCAST)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new

    # Rows past n_rows saw only -inf; give them a harmless max and an infinite
    # sum so their probabilities come out as zeros.
    m_i = tl.where(row_mask, m_i, 0.0)
    inv_l = tl.where(row_mask, 1.0 / l_i, 0.0)
    for start_n in range(0, key_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s = _scores(q, k_base + offs_n[None, :] * stride_kn, offs_n, q_pos, n_keys, qk_scale, d_mask, UPCAST)
        p = tl.exp2(s - m_i[:, None]) * inv_l[:, None]
        mass = tl.sum(p, 0)
        tl.atomic_add(Out + head * stride_oh + offs_n * stride_on, mass, mask=offs_n < key_end)


def attention_mass(q: torch.Tensor, k: torch.Tensor, q_start: int, scale: float | None = None,
                   block_m: int = 16, block_n: int = 32) -> torch.Tensor:
    """Sum over query rows of causal softmax attention, per query head and key.

    q: [heads, rows, head_dim], the queries at positions q_start .. q_start+rows-1.
    k: [kv_heads, keys, head_dim]; heads must be a multiple of kv_heads (GQA).
    Returns float32 [heads, keys]. Row i sees keys 0 .. q_start+i.
    """
    _check_inputs(q, k, q_start)
    heads, n_rows, head_dim = q.shape
    kv_heads, n_keys, _ = k.shape
    scale = head_dim ** -0.5 if scale is None else float(scale)
    out = torch.zeros((heads, n_keys), dtype=torch.float32, device=q.device)
    if n_rows == 0:
        return out
    grid = (triton.cdiv(n_rows, block_m), heads)
    _attention_mass_kernel[grid](
        q, k, out,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        out.stride(0), out.stride(1),
        n_rows, n_keys, q_start, scale * LOG2E,
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        UPCAST=compat.upcast_for_dot(q.dtype),
    )
    return out


def _check_inputs(q: torch.Tensor, k: torch.Tensor, q_start: int) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be 3-D [heads, tokens, head_dim], got q{tuple(q.shape)} k{tuple(k.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; supported: {', '.join(map(str, SUPPORTED_DTYPES))}")
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {k.dtype} but q has {q.dtype}; they must match")
    if q.device != k.device:
        raise ValueError(f"q is on {q.device} but k is on {k.device}")
    heads, n_rows, head_dim = q.shape
    kv_heads, n_keys, k_dim = k.shape
    if k_dim != head_dim:
        raise ValueError(f"head_dim differs: q has {head_dim}, k has {k_dim}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if q_start < 0 or q_start + n_rows > n_keys:
        raise ValueError(f"query rows {q_start}..{q_start + n_rows - 1} fall outside the {n_keys} keys")
