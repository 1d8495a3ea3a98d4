"""`workbench bench lowrank`: one decode step of attention over an
AttentionPack cache (kernels_py.triton.lowrank_decode) against

(i)   scaled_dot_product_attention over the full, uncompressed cache of the
      same length (FlashAttention where PyTorch has it for these shapes), and
(ii)  the unfused path: rebuild K and V from U and W with batched matmuls in
      the cache dtype, rotate the keys, concatenate the dense segment, SDPA.

The absorbed variant (rank-space attention, keys decomposed after RoPE) is
timed too, as an ablation. Cache: `length` visual tokens compressed to rank
`rank` for keys and values (keys decomposed before RoPE, rotated on rebuild),
values split into two importance groups as in the paper's setup (25% of the
tokens at full rank, 75% at rank / 4), then `dense_len` uncompressed text
tokens; one new query token that sees every cached token (so no mask is
needed by the baselines). Every sequence of a batch has the full length.

Bytes the fused kernel reads (for GB/s): U_k, U_v, W_k, W_v and the dense
K/V (the per-token ranks and positions, 12 bytes a token, are left out).
Compression ratio: full K/V cache bytes / (U + W + dense K/V bytes).
"""

import torch
import torch.nn.functional as F

from kernels_py import runtime
from kernels_py.benchmarks.stats import _peak, _time
from kernels_py.triton import lowrank_decode as kernel
from kernels_py.workloads.synthetic import apply_rope

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
ROPE_BASE = 10000.0
FULL_RANK_SHARE = 0.25  # values: share of tokens decompressed at full rank, the rest at rank // 4


def _make(batch: int, length: int, dense_len: int, heads: int, kv_heads: int, head_dim: int, rank: int,
          dtype: torch.dtype, device: torch.device, g: torch.Generator):
    """q [B, H, 1, D], q_pos, CompressedKV, DenseKV for one size."""
    width = kv_heads * head_dim

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    rank_k = torch.full((batch, length), rank, dtype=torch.int32, device=device)
    full = torch.rand(batch, length, generator=g, device=device) < FULL_RANK_SHARE
    rank_v = torch.where(full, rank, max(1, rank // 4)).to(torch.int32)
    pos = torch.arange(length, dtype=torch.int32, device=device).expand(batch, length)
    comp = kernel.CompressedKV(randn(batch, length, rank), randn(batch, rank, width, scale=rank ** -0.5),
                               randn(batch, length, rank), randn(batch, rank, width, scale=rank ** -0.5),
                               rank_k, rank_v, pos, torch.full((batch,), length, dtype=torch.int32, device=device))
    dense_pos = (length + torch.arange(dense_len, dtype=torch.int32, device=device)).expand(batch, dense_len)
    dense = kernel.DenseKV(randn(batch, kv_heads, dense_len, head_dim), randn(batch, kv_heads, dense_len, head_dim),
                           dense_pos, torch.full((batch,), dense_len, dtype=torch.int32, device=device))
    q = randn(batch, heads, 1, head_dim)
    q_pos = torch.full((batch, 1), length + dense_len, dtype=torch.int32, device=device)
    return q, q_pos, comp, dense


def _sdpa(q, k, v):
    """SDPA with GQA, FlashAttention first; returns (out, backend name)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = q.shape[1] != k.shape[1]
    if q.is_cuda:
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa), "flash"
        except RuntimeError:  # no FlashAttention for these shapes/dtype: let PyTorch choose
            pass
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa), "default"


def _unfused(q, comp, dense, rope_base):
    """Decompress-then-attend in the cache dtype: batched matmuls U[:, :r_t] W
    for the whole segment, RoPE on the rebuilt keys, concatenation with the
    dense segment, SDPA. Every token is visible and every sequence full (the
    benchmark's cache), and all sequences share positions."""
    batch, _, _, head_dim = q.shape
    kv_heads, tokens = dense.k.shape[1], comp.uk.shape[1]

    def rebuild(u, w, rank):
        keep = torch.arange(u.shape[-1], device=u.device) < rank[..., None]
        return torch.bmm(u * keep, w).view(batch, tokens, kv_heads, head_dim).transpose(1, 2)

    k = rebuild(comp.uk, comp.wk, comp.rank_k)
    if rope_base is not None:
        k = apply_rope(k, comp.pos[0], rope_base)
    v = rebuild(comp.uv, comp.wv, comp.rank_v)
    return _sdpa(q, torch.cat([k, dense.k], 2), torch.cat([v, dense.v], 2))[0]


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def run(lengths=(1024, 4096, 16384, 32768), batches=(1, 8, 32, 64), heads: int = 32, kv_heads: int = 8,
        head_dim: int = 128, rank: int = 64, dense_len: int = 64, dtype: str = "float16", repeat: int = 10,
        seed: int = 0) -> dict:
    """Time the fused, absorbed, unfused and full-SDPA paths for every
    (visual length, batch); returns {"device", "interpreter", "rows": [...]}."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if not 1 <= rank <= kv_heads * head_dim:
        raise ValueError(f"rank must lie in [1, kv_heads * head_dim = {kv_heads * head_dim}], got {rank}")
    if dense_len < 1 or repeat < 1 or min(lengths, default=1) < 1 or min(batches, default=1) < 1:
        raise ValueError("lengths, batches, dense_len and repeat must be at least 1")
    device = runtime.device()
    cuda = device.type == "cuda"
    torch_dtype = DTYPES[dtype]
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for n in lengths:
        for b in batches:
            q, q_pos, comp, dense = _make(b, n, dense_len, heads, kv_heads, head_dim, rank, torch_dtype, device, g)
            kernel.check_inputs(q, q_pos, comp, dense, ROPE_BASE)  # once: the timed calls skip the value checks
            splits = kernel.default_num_splits(comp, dense, kv_heads)
            full_k = torch.randn(b, kv_heads, n + dense_len, head_dim, generator=g, device=device).to(torch_dtype)
            full_v = torch.randn_like(full_k)
            fused = lambda: kernel.lowrank_decode(q, q_pos, comp, dense, rope_base=ROPE_BASE,  # noqa: E731
                                                  num_splits=splits, check_values=False)
            absorbed = lambda: kernel.lowrank_decode_absorbed(q, q_pos, comp, dense, num_splits=splits,  # noqa: E731
                                                              check_values=False)
            unfused = lambda: _unfused(q, comp, dense, ROPE_BASE)  # noqa: E731
            sdpa = lambda: _sdpa(q, full_k, full_v)  # noqa: E731
            read = _nbytes(comp.uk, comp.uv, comp.wk, comp.wv, dense.k, dense.v)
            full = _nbytes(full_k, full_v)
            row = {"visual_len": n, "batch": b, "dense_len": dense_len, "heads": heads, "kv_heads": kv_heads,
                   "head_dim": head_dim, "rank_k": rank, "rank_v": rank, "rank_v_low": max(1, rank // 4),
                   "dtype": dtype, "num_splits": splits, "sdpa_backend": sdpa()[1],
                   "fused_ms": _time(fused, repeat, cuda) * 1e3,
                   "absorbed_ms": _time(absorbed, repeat, cuda) * 1e3,
                   "unfused_ms": _time(unfused, repeat, cuda) * 1e3,
                   "sdpa_ms": _time(sdpa, repeat, cuda) * 1e3,
                   "fused_peak_bytes": _peak(fused, cuda),
                   "unfused_peak_bytes": _peak(unfused, cuda),
                   "sdpa_peak_bytes": _peak(sdpa, cuda),
                   "compressed_bytes": read, "full_bytes": full}
            row["fused_gbps"] = read / (row["fused_ms"] / 1e3) / 1e9
            row["speedup_vs_unfused"] = row["unfused_ms"] / row["fused_ms"]
            row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["fused_ms"]
            row["compression_ratio"] = full / read
            out.append(row)
            del q, q_pos, comp, dense, full_k, full_v, fused, absorbed, unfused, sdpa
            if cuda:
                torch.cuda.empty_cache()
    return {"device": device.type, "interpreter": runtime.interpreter_mode(), "rows": out}


def smoke_sizes() -> dict:
    """Sizes small enough for the CPU interpreter: proves the benchmark runs."""
    return {"lengths": [96], "batches": [1], "heads": 4, "kv_heads": 2, "head_dim": 64, "rank": 16,
            "dense_len": 8, "dtype": "float32", "repeat": 1}

