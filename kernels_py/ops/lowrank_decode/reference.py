"""The low-rank decode op in plain PyTorch (the contract in contract.py):
rebuild the compressed keys and values in full (float32), rotate the rebuilt
keys when they were decomposed before RoPE, concatenate the uncompressed
segment and attend."""

import torch

from kernels_py.attention import apply_rope
from kernels_py.ops.common import softmax_scale
from kernels_py.ops.lowrank_decode.contract import CompressedKV, DecodeOutput, DenseKV, check_inputs


def decompress(comp: CompressedKV, kv_heads: int, rope_base: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [B, H_kv, T, D] float32 of the compressed segment, each token with
    its own rank prefix; padding tokens (t >= comp.length[b]) are zero."""
    batch, tokens, _ = comp.uk.shape
    width = comp.wk.shape[-1]
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1 or width % kv_heads:
        raise ValueError(f"kv_heads must be a positive int dividing wk's {width} columns (kv_heads * head_dim), "
                         f"got {kv_heads!r}")
    head_dim = width // kv_heads
    valid = torch.arange(tokens, device=comp.uk.device)[None, :] < comp.length[:, None].to(torch.int64)

    def rebuild(u, w, rank):
        # Columns past a token's rank, and padding tokens, are never used: selected away (not multiplied by 0,
        # which would carry a NaN there into the token's key or value).
        keep = torch.arange(u.shape[-1], device=u.device)[None, None, :] < rank[..., None].to(torch.int64)
        full = torch.where(keep & valid[..., None], u.float(), 0.0) @ w.float()  # [B, T, H_kv * D]
        return full.view(batch, tokens, kv_heads, head_dim).transpose(1, 2)

    k = rebuild(comp.uk, comp.wk, comp.rank_k)
    if rope_base is not None and batch:  # (torch.stack needs at least one sequence)
        k = torch.stack([apply_rope(k[b], comp.pos[b], rope_base) for b in range(batch)])
    return k, rebuild(comp.uv, comp.wv, comp.rank_v)


def lowrank_decode(q: torch.Tensor, q_pos: torch.Tensor, comp: CompressedKV, dense: DenseKV, *,
                   rope_base: float | None, sm_scale: float | None = None) -> DecodeOutput:
    """Same contract as kernel.lowrank_decode (and lowrank_decode_absorbed, which
    computes the same attention)."""
    check_inputs(q, q_pos, comp, dense, rope_base)
    batch, heads, _, head_dim = q.shape
    kv_heads = dense.k.shape[1]
    scale = softmax_scale(sm_scale, head_dim, "sm_scale")
    ck, cv = decompress(comp, kv_heads, rope_base)
    tokens, slots = comp.uk.shape[1], dense.k.shape[2]
    ar_c = torch.arange(tokens, device=q.device)[None, :]
    ar_d = torch.arange(slots, device=q.device)[None, :]
    dense_valid = ar_d < dense.length[:, None].to(torch.int64)
    # Padding is never used, as in the kernels: zeroed (a NaN there would leak through 0 * NaN).
    dk, dv = (torch.where(dense_valid[:, None, :, None], t.float(), 0.0) for t in (dense.k, dense.v))
    keys = torch.cat([ck, dk], dim=2).repeat_interleave(heads // kv_heads, dim=1)
    values = torch.cat([cv, dv], dim=2).repeat_interleave(heads // kv_heads, dim=1)
    valid = torch.cat([ar_c < comp.length[:, None].to(torch.int64), dense_valid], 1)
    pos = torch.cat([comp.pos.to(torch.int64), dense.pos.to(torch.int64)], dim=1)  # [B, T + S]
    visible = valid[:, None, :] & (pos[:, None, :] <= q_pos.to(torch.int64)[:, :, None])  # [B, M, T + S]
    scores = torch.einsum("bhmd,bhnd->bhmn", q.float(), keys) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhmn,bhnd->bhmd", probs, values)
    mass = probs.mean(dim=(1, 2))  # over heads and query tokens: Eq. 1's per-step average
    return DecodeOutput(out.to(q.dtype), lse, mass[:, :tokens].contiguous(), mass[:, tokens:].contiguous())
