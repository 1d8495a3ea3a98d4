"""The low-rank decode op's compile cases and selftest (see kernels_py.ops)."""

import math
import time
from dataclasses import fields
from functools import partial

import torch

from kernels_py import runtime
from kernels_py.ops import CompileCase, common, splitk
from kernels_py.ops.lowrank_decode import reference
from kernels_py.ops.lowrank_decode.contract import CompressedKV, DenseKV
from kernels_py.ops.lowrank_decode.kernel import lowrank_decode, lowrank_decode_absorbed
from kernels_py.tables import Column, table

DECODE = ("_stage1_kernel", "_merge_rank_kernel", "_mass_kernel")
ABSORBED = ("_query_dense_kernel", "_stage1_absorbed_kernel", "_merge_rank_kernel", "_mass_rank_kernel")


def make_cache(*, batch, heads, kv_heads, head_dim, rank_k, rank_v, tokens, slots, comp_lens, dense_lens, queries,
               dtype, w_dtype=None, seed=0, spread=1.0):
    """q, q_pos, CompressedKV, DenseKV: random factors, a random rank prefix per
    token, compressed tokens first then dense ones, the queries last."""
    g = torch.Generator().manual_seed(seed)
    w_dtype = w_dtype or dtype
    width = kv_heads * head_dim

    def randn(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    def ranks(r):
        return torch.randint(1, r + 1, (batch, tokens), dtype=torch.int32, generator=g)

    comp = CompressedKV(randn(batch, tokens, rank_k), randn(batch, rank_k, width, dt=w_dtype, scale=rank_k ** -0.5),
                        randn(batch, tokens, rank_v), randn(batch, rank_v, width, dt=w_dtype, scale=rank_v ** -0.5),
                        ranks(rank_k), ranks(rank_v), torch.arange(tokens).repeat(batch, 1), torch.tensor(comp_lens))
    dense = DenseKV(randn(batch, kv_heads, slots, head_dim), randn(batch, kv_heads, slots, head_dim),
                    (tokens + torch.arange(slots)).repeat(batch, 1), torch.tensor(dense_lens))
    q = randn(batch, heads, queries, head_dim, scale=spread)
    q_pos = (tokens + slots - queries + torch.arange(queries)).repeat(batch, 1)
    return q, q_pos, comp, dense


def _compile(*, dtype, head_dim, rank_k, rank_v, heads=4, kv_heads=2, queries=1, w_dtype=None, absorbed=False,
             rope_base=None, block_n=None):
    tokens, slots = 40, 8
    q, q_pos, comp, dense = make_cache(batch=2, heads=heads, kv_heads=kv_heads, head_dim=head_dim, rank_k=rank_k,
                                       rank_v=rank_v, tokens=tokens, slots=slots, comp_lens=[tokens, tokens - 7],
                                       dense_lens=[slots, 3], queries=queries, dtype=dtype, w_dtype=w_dtype)
    if absorbed:
        lowrank_decode_absorbed(q, q_pos, comp, dense, block_n=block_n)
    else:
        lowrank_decode(q, q_pos, comp, dense, rope_base=rope_base, block_n=block_n)


f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
# The three autotuned cases of each stage-1 kernel take configs[k::3], k = 0,
# 1, 2: every config is compiled once per target, each case with a mix of
# tiles, warps and stages. float32 inputs take the pinned tile only: their
# large-tile configs take 10-35 s each to compile.
COMPILE_CASES = [
    # Ranks within one 64-rank chunk of the key rebuild or above it
    # (chunked rebuild), for K and V separately.
    CompileCase("decode-fp16-d128-rope-r32-gqa4",
                partial(_compile, dtype=f16, head_dim=128, rank_k=32, rank_v=32, heads=8, rope_base=10000.0),
                DECODE, slice(0, None, 3)),
    # The benchmark's shape (32 query / 8 kv heads, rank 64, RoPE): 32 rows a program.
    CompileCase("decode-fp16-d128-rope-r64-h32kv8",
                partial(_compile, dtype=f16, head_dim=128, rank_k=64, rank_v=64, heads=32, kv_heads=8,
                        rope_base=10000.0, block_n=64), DECODE),
    CompileCase("decode-bf16-d128-r96x160-m2",
                partial(_compile, dtype=bf16, head_dim=128, rank_k=96, rank_v=160, queries=2), DECODE,
                slice(1, None, 3)),
    CompileCase("decode-fp16-d64-rope-r64x96",
                partial(_compile, dtype=f16, head_dim=64, rank_k=64, rank_v=96, rope_base=1e6), DECODE,
                slice(2, None, 3)),
    # Pinned tiles (block_n given: the path the GPU tests take).
    CompileCase("decode-fp32-d80-rope-r16x72-block32",
                partial(_compile, dtype=f32, head_dim=80, rank_k=16, rank_v=72, rope_base=10000.0, block_n=32),
                DECODE),
    # Mixed dtypes: fp16 attention, float32 rebuild (U fp16, W bf16); ranks
    # below tl.dot's minimum K of 16, padded by the launcher.
    CompileCase("decode-fp16-wbf16-d64-rope-r4x8-block32",
                partial(_compile, dtype=f16, w_dtype=bf16, head_dim=64, rank_k=4, rank_v=8, rope_base=10000.0,
                        block_n=32), DECODE),
    CompileCase("absorbed-fp16-d128-r64x96",
                partial(_compile, dtype=f16, head_dim=128, rank_k=64, rank_v=96, absorbed=True), ABSORBED,
                slice(0, None, 3)),
    CompileCase("absorbed-bf16-d64-r256x200-m3",
                partial(_compile, dtype=bf16, head_dim=64, rank_k=256, rank_v=200, queries=3, absorbed=True),
                ABSORBED, slice(1, None, 3)),
    CompileCase("absorbed-fp16-d80-r4x40-gqa4",
                partial(_compile, dtype=f16, head_dim=80, rank_k=4, rank_v=40, heads=8, absorbed=True), ABSORBED,
                slice(2, None, 3)),
    CompileCase("absorbed-fp32-d80-r32-block32",
                partial(_compile, dtype=f32, head_dim=80, rank_k=32, rank_v=32, absorbed=True, block_n=32),
                ABSORBED),
]

# (out, mass) tolerances by dtype: 16-bit inputs round the rebuilt K, V and the
# probabilities to 16 bits as a 16-bit KV cache would (see the op's tests).
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.float16: (4e-3, 5e-4), torch.bfloat16: (2.5e-2, 3e-3)}
COLUMNS = (
    Column("variant", "", "kernel and how its keys were decomposed"),
    Column("splits", "", "splits per (sequence, kv head): the default for the input, or forced to run the merge"),
    Column("out_err", "", "largest |kernel - reference| of the output, relative to 1 + |reference|", "out err"),
    Column("lse_err", "", "largest |kernel - reference| of the log-sum-exp", "lse err"),
    Column("mass_err", "", "largest |kernel - reference| of a token's attention mass", "mass err"),
    Column("seconds", "s", "kernel time, first call (compiles on a GPU)", "kernel"),
    Column("ok", "", "within the tolerances"),
)


def selftest(seed: int = 0, dtype: str = "float32", heads: int = 8, kv_heads: int = 2, head_dim: int = 64,
             rank: int = 32, visual_tokens: int = 96, text_tokens: int = 24) -> dict:
    """One decode step over a synthetic AttentionPack cache (visual tokens as
    rank-`rank` factors, a quarter at full rank and the rest at rank / 4;
    text tokens uncompressed): the fused kernel (keys rotated after rebuild)
    and the rank-space kernel against the reference, each also in
    SELFTEST_SPLITS splits."""
    torch_dtype = common.dtype(dtype)
    device = runtime.device()
    q, q_pos, comp, dense = make_cache(
        batch=1, heads=heads, kv_heads=kv_heads, head_dim=head_dim, rank_k=rank, rank_v=rank, tokens=visual_tokens,
        slots=text_tokens, comp_lens=[visual_tokens], dense_lens=[text_tokens], queries=1, dtype=torch_dtype,
        seed=seed, spread=2.0)
    quarter = torch.rand(1, visual_tokens, generator=torch.Generator().manual_seed(seed)) < 0.25
    grouped = torch.where(quarter, rank, max(1, rank // 4)).to(torch.int32)  # AttentionPack's two groups
    comp = CompressedKV(comp.uk, comp.wk, comp.uv, comp.wv, grouped, grouped, comp.pos, comp.length)
    q, q_pos, comp, dense = _to(device, q, q_pos, comp, dense)
    out_tol, mass_tol = TOLERANCE[torch_dtype]
    rows, worst = [], 0.0
    forced = splitk.SELFTEST_SPLITS
    for variant, rope_base, kernel, splits in (("fused, keys rotated after rebuild", 10000.0, lowrank_decode, None),
                                               ("fused, keys rotated after rebuild", 10000.0, lowrank_decode, forced),
                                               ("fused, keys as cached", None, lowrank_decode, None),
                                               ("absorbed (rank space)", None, lowrank_decode_absorbed, None),
                                               ("absorbed (rank space)", None, lowrank_decode_absorbed, forced)):
        kwargs = {"num_splits": splits} if kernel is lowrank_decode_absorbed else {"rope_base": rope_base,
                                                                                  "num_splits": splits}
        t0 = time.perf_counter()
        got = kernel(q, q_pos, comp, dense, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        want = reference.lowrank_decode(q, q_pos, comp, dense, rope_base=rope_base)
        out_err = ((got.out.float() - want.out.float()).abs() / (1 + want.out.float().abs())).max().item()
        lse_err = (got.lse - want.lse).abs().max().item()
        mass_err = max((got.mass_comp - want.mass_comp).abs().max().item(),
                       (got.mass_dense - want.mass_dense).abs().max().item())
        ok = out_err <= out_tol and lse_err <= out_tol and mass_err <= mass_tol
        ratios = (out_err / out_tol, lse_err / out_tol, mass_err / mass_tol)
        # max() keeps whichever comes first of a NaN and a number: a NaN error must stay the worst.
        worst = math.nan if any(map(math.isnan, ratios)) else max(worst, *ratios)
        rows.append({"variant": variant, "splits": splits or "default", "out_err": out_err, "lse_err": lse_err, "mass_err": mass_err,
                     "seconds": seconds, "ok": ok})
    return {
        "title": f"one decode step over {visual_tokens} compressed (rank {rank}) + {text_tokens} uncompressed tokens "
                 f"({heads} heads, {kv_heads} kv heads, head_dim {head_dim}, {dtype})",
        **table(COLUMNS, rows),
        "notes": [f"tolerances: output and lse {out_tol:g}, mass {mass_tol:g}"],
        "verdict": f"worst error at {worst:.2g} of its tolerance",
        "ok": all(r["ok"] for r in rows),
        "kernel_seconds": sum(r["seconds"] for r in rows),
    }


def _to(device, q, q_pos, comp: CompressedKV, dense: DenseKV):
    def move(segment):
        return type(segment)(*(getattr(segment, f.name).to(device) for f in fields(segment)))

    return q.to(device), q_pos.to(device), move(comp), move(dense)
