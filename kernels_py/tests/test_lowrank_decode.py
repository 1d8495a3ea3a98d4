"""kernels_py.ops.lowrank_decode (fused decompress + split-K flash-decoding,
and the rank-space "absorbed" variant) against its reference.

The reference rebuilds K and V in float32. The kernels accumulate in float32
but feed tl.dot 16-bit operands when the inputs are 16-bit: rebuilt keys and
values, and the probabilities, are rounded to the input dtype as a 16-bit KV
cache would be; hence the fp16 / bf16 tolerances. Shapes are tiny so the file
runs quickly under the CPU interpreter; tiles are pinned to BLOCK_N (32)
tokens, so lengths such as 37 and 21 end mid-tile.
"""

import math

import pytest
import torch
import triton
import triton.language as tl

from kernels_py.ops.lowrank_decode import reference as ref
from kernels_py.ops.lowrank_decode import kernel
from kernels_py.ops import lowrank_decode
from kernels_py.ops.lowrank_decode import CompressedKV, DenseKV

SPREAD = 2.0  # query scale: peaked attention, so errors in the scores show
# (out, lse, mass) tolerances by the dtype of q and the cache.
# Measured worst cases over these shapes (with bf16 rounding of K, V and p as
# a GPU does it, emulated): fp16 out 9e-4, lse 1.4e-4, mass 9e-5; bf16 out
# 7e-3, lse 2e-3, mass 7e-4 (relative to 1 + |value|; mass absolute).
TOL = {torch.float32: (1e-4, 1e-4, 1e-5), torch.float16: (4e-3, 1e-3, 5e-4), torch.bfloat16: (2.5e-2, 1e-2, 3e-3)}
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in (torch.float16, torch.bfloat16, torch.float32)]
# A pinned token tile: on a GPU, autotuning every test shape would take long
# (test_rope_is_applied runs the default, autotuned path).
BLOCK_N = 32


def decode(*args, **kwargs):
    return kernel.lowrank_decode(*args, **{"block_n": BLOCK_N, **kwargs})


def decode_absorbed(*args, **kwargs):
    return kernel.lowrank_decode_absorbed(*args, **{"block_n": BLOCK_N, **kwargs})


def make_case(device, *, batch=2, heads=4, kv_heads=2, queries=1, head_dim=64, comp_lens=(37, 20), dense_lens=(9, 0),
              rank_k=16, rank_v=16, full_share=0.25, dtype=torch.float16, uw_dtype=None, interleave=False,
              pad=3, seed=0):
    """q, q_pos, CompressedKV, DenseKV for one test.

    Token ranks follow AttentionPack's grouping: a share `full_share` of each
    sequence's tokens keeps the full rank, the rest rank R // 4. Positions: the
    compressed tokens first, then the dense ones; the M queries are the last M
    dense tokens (so they attend causally among themselves), or follow the
    dense segment when it is shorter. interleave=True instead scatters the
    positions of both segments at random and puts the queries inside the
    sequence, so causality cuts both segments. `pad` padding tokens follow the
    longest sequence of each segment."""
    g = torch.Generator().manual_seed(seed)
    uw_dtype = uw_dtype or dtype
    tokens, slots = max(comp_lens) + pad, max(dense_lens) + pad
    width = kv_heads * head_dim

    def ranks(r):
        full = torch.rand(batch, tokens, generator=g) < full_share
        return torch.where(full, r, max(1, r // 4)).to(torch.int32)

    q = SPREAD * torch.randn(batch, heads, queries, head_dim, generator=g)
    uk = torch.randn(batch, tokens, rank_k, generator=g)
    wk = torch.randn(batch, rank_k, width, generator=g) / math.sqrt(rank_k)
    uv = torch.randn(batch, tokens, rank_v, generator=g)
    wv = torch.randn(batch, rank_v, width, generator=g) / math.sqrt(rank_v)
    dk = torch.randn(batch, kv_heads, slots, head_dim, generator=g)
    dv = torch.randn(batch, kv_heads, slots, head_dim, generator=g)
    clen = torch.tensor(comp_lens, dtype=torch.int64)
    dlen = torch.tensor(dense_lens, dtype=torch.int64)
    cpos = torch.zeros(batch, tokens, dtype=torch.int64)
    dpos = torch.zeros(batch, slots, dtype=torch.int64)
    q_pos = torch.zeros(batch, queries, dtype=torch.int64)
    start = 5  # a prompt prefix before the cache: positions do not start at 0
    for b, (c, d) in enumerate(zip(comp_lens, dense_lens)):
        order = torch.randperm(c + d, generator=g) if interleave else torch.arange(c + d)
        cpos[b, :c] = start + order[:c]
        dpos[b, :d] = start + order[c:]
        if interleave:
            q_pos[b] = start + torch.linspace(0.3 * (c + d), c + d - 1, queries).long()
        elif d >= queries:
            q_pos[b] = dpos[b, d - queries:d]
        else:
            q_pos[b] = start + c + d + torch.arange(queries)
    comp = CompressedKV(uk.to(device, uw_dtype), wk.to(device, uw_dtype), uv.to(device, uw_dtype),
                        wv.to(device, uw_dtype), ranks(rank_k).to(device), ranks(rank_v).to(device),
                        cpos.to(device), clen.to(device))
    dense = DenseKV(dk.to(device, dtype), dv.to(device, dtype), dpos.to(device), dlen.to(device))
    return q.to(device, dtype), q_pos.to(device), comp, dense


def logit_rounding(want, q, comp, dense) -> float:
    """How far float16 logits (kernel.logits_dtype, the fused call over
    an fp16 cache) may move a row's weights' sum: each logit s (log2 units)
    within 2^-11 |s| of itself, so a weight within ln 2 2^-11 |s| of itself
    (relative), and sum_t p_t |s_t| <= |lse| + log2(tokens) (log2 units)."""
    if kernel.logits_dtype(q, dense, absorbed=False) != torch.float16:
        return 0.0
    lse2 = (want.lse[want.lse > float("-inf")] * math.log2(math.e)).abs()
    top = float(lse2.max()) if lse2.numel() else 0.0
    return math.log(2) * 2.0 ** -11 * (top + math.log2(comp.uk.shape[1] + dense.k.shape[2]))


def check(got, want, q, comp, dense, dtype):
    batch, heads, queries, head_dim = q.shape
    atol_o, atol_l, atol_m = TOL[dtype]
    assert got.out.shape == (batch, heads, queries, head_dim) and got.out.dtype == q.dtype
    assert got.lse.shape == (batch, heads, queries) and got.lse.dtype == torch.float32
    assert got.mass_comp.shape == comp.uk.shape[:2] and got.mass_comp.dtype == torch.float32
    assert got.mass_dense.shape == dense.pos.shape and got.mass_dense.dtype == torch.float32
    torch.testing.assert_close(got.out.float(), want.out.float(), atol=atol_o, rtol=atol_o)
    torch.testing.assert_close(got.lse, want.lse, atol=atol_l, rtol=atol_l)
    torch.testing.assert_close(got.mass_comp, want.mass_comp, atol=atol_m, rtol=1e-2)
    torch.testing.assert_close(got.mass_dense, want.mass_dense, atol=atol_m, rtol=1e-2)
    # Each query row's weights sum to 1 over the tokens it sees; padding gets none.
    seen = (want.lse > float("-inf")).float().mean(dim=(1, 2))
    total = got.mass_comp.sum(1) + got.mass_dense.sum(1)
    torch.testing.assert_close(total, seen, atol=2e-5 + logit_rounding(want, q, comp, dense), rtol=0)
    ar_c = torch.arange(comp.uk.shape[1], device=q.device)[None, :]
    ar_d = torch.arange(dense.pos.shape[1], device=q.device)[None, :]
    assert torch.all(got.mass_comp[ar_c >= comp.length[:, None]] == 0)
    assert torch.all(got.mass_dense[ar_d >= dense.length[:, None]] == 0)


CASES = {
    # ragged batch of 3: a 0-length dense segment, lengths ending mid-tile, GQA 4
    "ragged": dict(batch=3, heads=4, kv_heads=1, comp_lens=(37, 64, 5), dense_lens=(0, 21, 13), rank_k=8, rank_v=8),
    "mha_rank24": dict(heads=2, kv_heads=2, rank_k=24, rank_v=24),
    "gqa7_rank64": dict(heads=7, kv_heads=1, comp_lens=(70, 33), dense_lens=(4, 11), rank_k=64, rank_v=64),
    "mixed_ranks_m3": dict(queries=3, rank_k=24, rank_v=8, full_share=0.5),
    "head_dim80": dict(head_dim=80, queries=3, dense_lens=(9, 2)),
    "head_dim128_gqa4": dict(heads=8, kv_heads=2, head_dim=128, comp_lens=(40, 90), dense_lens=(6, 3)),
    "interleaved": dict(queries=3, interleave=True, comp_lens=(50, 29), dense_lens=(12, 30)),
    # one query token amid the cache: the absorbed kernel's one-query path
    # masks the tokens after it by a column mask alone
    "interleaved_m1": dict(queries=1, interleave=True, comp_lens=(50, 29), dense_lens=(12, 30)),
    "no_compressed": dict(comp_lens=(0, 11), dense_lens=(17, 5)),
    # dense segments of several tiles (64-token tiles over 16-bit caches in
    # the absorbed call, 32 otherwise), the last one ragged
    "long_dense": dict(comp_lens=(20, 9), dense_lens=(150, 70)),
    # ranks above one 64-rank chunk: the rebuild loops over chunks and skips
    # those past a tile's largest rank prefix (most tokens here have rank 25 / 18)
    "rank100_chunked": dict(rank_k=100, rank_v=72, full_share=0.1, comp_lens=(60, 45)),
    "rank1": dict(rank_k=1, rank_v=2, comp_lens=(33, 8)),
    # four kv heads with 7 query heads each: the absorbed kernel's programs
    # hold all 28 rows and pick each row's kv head (W_k, W_v, dense K/V)
    "kv4_gqa7": dict(heads=28, kv_heads=4, rank_k=16, rank_v=8, comp_lens=(45, 20), dense_lens=(7, 3)),
}


@pytest.mark.parametrize("rope_base", [None, 10000.0])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(case, dtype, rope_base, device):
    q, q_pos, comp, dense = make_case(device, dtype=dtype, **CASES[case])
    got = decode(q, q_pos, comp, dense, rope_base=rope_base, num_splits=2)
    want = ref.lowrank_decode(q, q_pos, comp, dense, rope_base=rope_base)
    check(got, want, q, comp, dense, dtype)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_absorbed_matches_reference(case, dtype, device):
    q, q_pos, comp, dense = make_case(device, dtype=dtype, **CASES[case])
    got = decode_absorbed(q, q_pos, comp, dense, num_splits=3)
    want = ref.lowrank_decode(q, q_pos, comp, dense, rope_base=None)
    check(got, want, q, comp, dense, dtype)


@pytest.mark.parametrize("absorbed", [False, True])
def test_rank_256(absorbed, device):
    q, q_pos, comp, dense = make_case(device, dtype=torch.float16, rank_k=256, rank_v=256, comp_lens=(20, 9),
                                      dense_lens=(3, 4))
    rope_base = None if absorbed else 10000.0
    got = (decode_absorbed if absorbed else decode)(q, q_pos, comp, dense, **({} if absorbed else {"rope_base": rope_base}))
    check(got, ref.lowrank_decode(q, q_pos, comp, dense, rope_base=rope_base), q, comp, dense, torch.float16)


def test_rope_is_applied(device):
    """Rotating the rebuilt keys changes the result, and the kernel follows the
    reference in both settings (guards against a kernel that skips RoPE)."""
    q, q_pos, comp, dense = make_case(device, dtype=torch.float32)
    rot = kernel.lowrank_decode(q, q_pos, comp, dense, rope_base=10000.0)
    plain = kernel.lowrank_decode(q, q_pos, comp, dense, rope_base=None)
    assert (rot.out - plain.out).abs().max() > 0.05
    torch.testing.assert_close(rot.out, ref.lowrank_decode(q, q_pos, comp, dense, rope_base=10000.0).out,
                               atol=1e-4, rtol=1e-4)


@triton.jit
def _rope_sincos_probe(Pos, InvFreq, Sin, Cos, N: tl.constexpr, HALF: tl.constexpr, ON_GPU: tl.constexpr):
    offs_h, offs_n = tl.arange(0, HALF), tl.arange(0, N)
    sin, cos = kernel._rope_sincos(tl.load(Pos + offs_n), tl.load(InvFreq + offs_h), ON_GPU, tl.float32)
    sin, cos = tl.trans(sin), tl.trans(cos)
    tl.store(Sin + offs_h[:, None] * N + offs_n[None, :], sin)
    tl.store(Cos + offs_h[:, None] * N + offs_n[None, :], cos)


def test_rope_angles_stay_exact_at_large_positions(device):
    """The fused kernel's sines and cosines of pos * inv_freq (float32, as
    transformers computes the angle) at positions up to 2e5: within 1e-6 of
    float64 sin/cos of that float32 angle (2e-6 with the GPU's approximate
    sin/cos). The angle is reduced by 2 pi in three parts; one float32 2 pi
    was off by up to 5e-3 radians here."""
    half, n = 16, 64
    inv_freq = (10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)).float()
    inv_freq[0] = 1.0  # the fastest pair turns once per 2 pi positions
    pos = torch.cat([torch.arange(8), torch.randint(0, 200_000, (n - 8,), generator=torch.Generator().manual_seed(1))])
    pos = pos.to(torch.int32)
    sin = torch.empty(half, n, device=device)
    cos = torch.empty(half, n, device=device)
    on_gpu = not kernel.interpreter_mode()
    _rope_sincos_probe[(1,)](pos.to(device), inv_freq.to(device), sin, cos, N=n, HALF=half, ON_GPU=on_gpu)
    angle = (inv_freq[:, None] * pos[None, :].float()).double()  # the float32 angle, exactly
    tol = 2e-6 if on_gpu else 1e-6
    torch.testing.assert_close(sin.cpu().double(), torch.sin(angle), atol=tol, rtol=0)
    torch.testing.assert_close(cos.cpu().double(), torch.cos(angle), atol=tol, rtol=0)


@pytest.mark.parametrize("absorbed", [False, True])
def test_splits_and_tiles_do_not_change_the_result(absorbed, device):
    q, q_pos, comp, dense = make_case(device, dtype=torch.float32, comp_lens=(90, 41), dense_lens=(20, 7))
    run = decode_absorbed if absorbed else (lambda *a, **k: decode(*a, rope_base=500.0, **k))
    one = run(q, q_pos, comp, dense, num_splits=1)
    # 7 splits of 32-token tiles leave some splits empty; 16- and 64-token
    # tiles move the split and tile boundaries.
    for kwargs in ({"num_splits": 3}, {"num_splits": 7}, {"num_splits": 4, "block_n": 16},
                   {"num_splits": 2, "block_n": 64}):
        many = run(q, q_pos, comp, dense, **kwargs)
        for a, b in zip(one, many):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("absorbed", [False, True])
def test_a_step_without_masses_attends_the_same(absorbed, device):
    """mass=False writes no logits and runs no mass kernel: the same output
    and LSE, no masses; a mass that is not a bool is refused."""
    q, q_pos, comp, dense = make_case(device, dtype=torch.float32, comp_lens=(90, 41), dense_lens=(20, 7))
    run = decode_absorbed if absorbed else (lambda *a, **k: decode(*a, rope_base=None, **k))
    ws = kernel.make_workspace(q, comp, dense, 3, absorbed=absorbed)
    ws.logits.fill_(7.0)
    with_mass = run(q, q_pos, comp, dense, num_splits=3)
    without = run(q, q_pos, comp, dense, workspace=ws, mass=False)
    assert without.mass_comp is None and without.mass_dense is None
    torch.testing.assert_close(without.out, with_mass.out, atol=1e-6, rtol=1e-6)  # other code, same arithmetic
    torch.testing.assert_close(without.lse, with_mass.lse, atol=1e-6, rtol=1e-6)
    assert bool((ws.logits == 7.0).all())  # nothing written for the masses
    bare = run(q, q_pos, comp, dense, num_splits=3, mass=False)  # its own workspace: no logits columns at all
    torch.testing.assert_close(bare.out, with_mass.out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(bare.lse, with_mass.lse, atol=1e-6, rtol=1e-6)
    with pytest.raises(TypeError, match="mass must be True or False"):
        run(q, q_pos, comp, dense, mass=1)
    via = lowrank_decode.compute(q, q_pos, comp, dense, rope_base=None, absorbed=absorbed, backend="torch",
                                 mass=False)
    assert via.mass_comp is None and torch.allclose(via.out.float(), with_mass.out.float(), atol=1e-4)
    with pytest.raises(TypeError, match="mass must be True or False"):
        lowrank_decode.compute(q, q_pos, comp, dense, rope_base=None, absorbed=absorbed, backend="torch", mass="no")


def test_rank_chunks_do_not_change_the_result(device):
    """Tokens stored grouped by rank (AttentionPack's layout: the full-rank
    group first, then rank R // 4): the key rebuild goes chunk by chunk up to
    each tile's largest rank, and every chunk size gives the reference."""
    q, q_pos, comp, dense = make_case(device, dtype=torch.float32, rank_k=64, rank_v=32, comp_lens=(90, 61),
                                      dense_lens=(5, 9))
    grouped = comp.rank_k.sort(dim=1, descending=True).values
    comp = CompressedKV(comp.uk, comp.wk, comp.uv, comp.wv, grouped, comp.rank_v, comp.pos, comp.length)
    want = ref.lowrank_decode(q, q_pos, comp, dense, rope_base=10000.0)
    for chunk in (16, 32, 64, 128):
        got = decode(q, q_pos, comp, dense, rope_base=10000.0, rank_chunk=chunk, num_splits=2)
        check(got, want, q, comp, dense, torch.float32)
    with pytest.raises(ValueError, match="rank_chunk must be a power of two >= 16"):
        decode(q, q_pos, comp, dense, rope_base=10000.0, rank_chunk=24)


def test_causality_among_new_tokens(device):
    """With M = 3 new tokens at the end of the dense segment, query m must not
    see tokens m+1.. : changing the newest token's key and value leaves the
    first two queries untouched and changes the last one."""
    q, q_pos, comp, dense = make_case(device, queries=3, dtype=torch.float32, dense_lens=(9, 4))
    before = decode(q, q_pos, comp, dense, rope_base=None)
    k, v = dense.k.clone(), dense.v.clone()
    for b, d in enumerate(dense.length.tolist()):
        k[b, :, d - 1] += 3.0
        v[b, :, d - 1] -= 5.0
    after = decode(q, q_pos, comp, DenseKV(k, v, dense.pos, dense.length), rope_base=None)
    torch.testing.assert_close(after.out[:, :, :2], before.out[:, :, :2], atol=0, rtol=0)
    assert (after.out[:, :, 2] - before.out[:, :, 2]).abs().amax(-1).amin() > 1e-3  # every (sequence, head)
    # Query 0 gives no weight to the two tokens after it.
    assert torch.all(before.mass_dense[0, 7:9] > 0) and torch.all(before.mass_dense[1, 2:4] > 0)
    assert torch.all(decode(q[:, :, :1], q_pos[:, :1], comp, dense, rope_base=None)
                     .mass_dense[0, 7:9] == 0)


def test_ignores_padding_and_columns_past_each_rank(device):
    """The kernels never use padding tokens or U columns past a token's rank
    prefix: filling them with NaN changes nothing for the fused kernel, and
    for the absorbed one, which reads a token's whole last 16-column chunk
    and drops its tail by a zero in q~ or a column mask (which a NaN would
    survive), large values in that chunk and NaN past it change nothing.
    Nor for the reference, which selects them away (it multiplied them by
    zero, and a NaN there made its LSE NaN)."""
    q, q_pos, comp, dense = make_case(device, dtype=torch.float32, rank_k=40, rank_v=24, interleave=True)
    want = ref.lowrank_decode(q, q_pos, comp, dense, rope_base=10000.0)
    nan = float("nan")
    dk, dv = dense.k.clone(), dense.v.clone()
    poisoned = {}
    for kernel_name, chunk in (("fused", None), ("absorbed", 1e4)):
        c = _poison_rank_tails(comp, chunk)
        for b in range(q.shape[0]):
            c.uk[b, comp.length[b]:] = nan
            c.uv[b, comp.length[b]:] = nan
        poisoned[kernel_name] = c
    for b in range(q.shape[0]):
        dk[b, :, dense.length[b]:] = nan
        dv[b, :, dense.length[b]:] = nan
    poisoned_d = DenseKV(dk, dv, dense.pos, dense.length)
    got = decode(q, q_pos, poisoned["fused"], poisoned_d, rope_base=10000.0)
    check(got, want, q, comp, dense, torch.float32)
    check(ref.lowrank_decode(q, q_pos, poisoned["fused"], poisoned_d, rope_base=10000.0), want, q, comp, dense,
          torch.float32)
    absorbed = decode_absorbed(q, q_pos, poisoned["absorbed"], poisoned_d)
    check(absorbed, ref.lowrank_decode(q, q_pos, comp, dense, rope_base=None), q, comp, dense, torch.float32)


def _poison_rank_tails(comp: CompressedKV, chunk: float | None = 1e4) -> CompressedKV:
    """comp with NaN in each token's columns past its rank, or `chunk` in
    those of its last 16-column chunk and NaN past that chunk (see
    test_ignores_padding_and_columns_past_each_rank)."""
    us = []
    for u, rank in ((comp.uk.clone(), comp.rank_k), (comp.uv.clone(), comp.rank_v)):
        cols = torch.arange(u.shape[2], device=u.device)[None, None, :]
        u[cols >= rank[..., None]] = float("nan") if chunk is None else chunk
        u[cols >= (rank[..., None] + 15) // 16 * 16] = float("nan")
        us.append(u)
    return CompressedKV(us[0], comp.wk, us[1], comp.wv, comp.rank_k, comp.rank_v, comp.pos, comp.length)


@pytest.mark.parametrize("layout", ["whole_chunks", "one_rank", "groups_meet", "random"])
def test_absorbed_kernels_by_rank_layout(layout, device):
    """The absorbed kernel feeds a tile's U to the MMAs as loaded when each
    token's rank is a whole number of 16-column chunks, the factor's width
    or the tile's top rank (whose tail past the rank q~ and a column mask
    drop), and take the other tokens in a second pass that zeroes each
    one's columns past its rank: AttentionPack's groups of ranks 64 / 16
    (first pass only), one rank of 37 / 21 (the top's tail dropped), groups
    of 64 / 13 meeting in a tile (second pass there) and random ranks all
    give the reference's output, LSE and masses."""
    q, q_pos, comp, dense = make_case(device, dtype=torch.float32, rank_k=64, rank_v=48, comp_lens=(90, 61),
                                      dense_lens=(5, 3))
    shape = comp.rank_k.shape
    first = torch.arange(shape[1], device=device).expand(shape) < 40
    g = torch.Generator().manual_seed(3)
    rank_k, rank_v = {
        "whole_chunks": (torch.where(first, 64, 16), torch.where(first, 48, 32)),
        "one_rank": (torch.full(shape, 37), torch.full(shape, 21)),
        "groups_meet": (torch.where(first, 64, 13), torch.where(first, 48, 11)),
        "random": (torch.randint(1, 65, shape, generator=g), torch.randint(1, 49, shape, generator=g)),
    }[layout]
    comp = CompressedKV(comp.uk, comp.wk, comp.uv, comp.wv, rank_k.to(device, torch.int32),
                        rank_v.to(device, torch.int32), comp.pos, comp.length)
    want = ref.lowrank_decode(q, q_pos, comp, dense, rope_base=None)
    got = decode_absorbed(q, q_pos, _poison_rank_tails(comp), dense, num_splits=2)
    check(got, want, q, comp, dense, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["float16", "float32"])
@pytest.mark.parametrize("absorbed", [False, True], ids=["fused", "absorbed"])
def test_merge_takes_a_kv_heads_rows_in_blocks(absorbed, dtype, device, monkeypatch):
    """The merge maps a kv head's query rows by its W_v,g in one program,
    at most MERGE_ROWS of them: with 16 a program, 8 heads of one kv head x
    3 query tokens are two programs, the second one half empty; every row
    equals the reference (an output left unwritten or mapped by another
    head's W_v would not). The fp16 factors take the split fp16 MMAs, the
    float32 ones a float32 dot."""
    monkeypatch.setattr(kernel, "MERGE_ROWS", 16)
    q, q_pos, comp, dense = make_case(device, dtype=dtype, heads=8, kv_heads=1, queries=3, comp_lens=(70, 33),
                                      dense_lens=(9, 4))
    assert kernel.merge_row_blocks(q.shape[1] * q.shape[2]) == (16, 2)
    run = decode_absorbed if absorbed else (lambda *a, **k: decode(*a, rope_base=None, **k))
    check(run(q, q_pos, comp, dense, num_splits=3), ref.lowrank_decode(q, q_pos, comp, dense, rope_base=None),
          q, comp, dense, dtype)


@pytest.mark.parametrize("interleave", [False, True], ids=["recent", "interleaved"])
def test_fused_merge_attends_the_dense_segment_in_each_row_block(interleave, device):
    """The fused call's merge attends the dense tokens for its block of rows
    itself: 40 query heads of one kv head are two programs at the real
    MERGE_ROWS (32 rows and 8), one sequence has no dense token, and with
    interleaved positions some rows see only some of them; every row and
    every mass equals the reference."""
    q, q_pos, comp, dense = make_case(device, heads=40, kv_heads=1, comp_lens=(50, 29), dense_lens=(11, 0),
                                      interleave=interleave)
    assert kernel.merge_row_blocks(q.shape[1] * q.shape[2]) == (32, 2)
    check(decode(q, q_pos, comp, dense, rope_base=None, num_splits=2),
          ref.lowrank_decode(q, q_pos, comp, dense, rope_base=None), q, comp, dense, q.dtype)


@pytest.mark.parametrize("absorbed", [False, True], ids=["fused", "absorbed"])
def test_merge_maps_sums_near_the_fp16_limit(absorbed, device):
    """U_v rows of 20,000 (fp16 holds up to 65,504), attention spread evenly
    over 4 splits: the merge weighs the rank-space sums by each split's
    share of the softmax, not by its share of the largest split's (which
    sum to about 4 x 20,000 and overflow fp16 before the split MMAs), so
    the output is finite and equals the reference."""
    q, q_pos, comp, dense = make_case(device, dtype=torch.float16, comp_lens=(120, 90), dense_lens=(9, 4))
    q = torch.zeros_like(q)  # every visible token weighs the same
    comp = CompressedKV(comp.uk, comp.wk, torch.full_like(comp.uv, 20000.0), (comp.wv.float() / 20000.0).half(),
                        comp.rank_k, comp.rank_v, comp.pos, comp.length)
    run = decode_absorbed if absorbed else (lambda *a, **k: decode(*a, rope_base=None, **k))
    got = run(q, q_pos, comp, dense, num_splits=4)
    want = ref.lowrank_decode(q, q_pos, comp, dense, rope_base=None)
    assert torch.isfinite(got.out).all()
    torch.testing.assert_close(got.out.float(), want.out.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("queries,interleave", [(1, False), (1, True), (3, True)])
def test_absorbed_masses_over_many_tiles_spans_and_dense_programs(queries, interleave, device, monkeypatch):
    """The interpreter's sizes (1,024-column spans, 128- or 256-column tiles)
    make every other test's masses one tile of one span and one dense
    program. With 32-column tiles, 64-column spans and 32-column dense
    programs: several tiles a span (each one's positions loaded by the one
    before, which queries among the tokens would show), several spans a
    sequence, several dense programs, and groups of 64 / 13 meeting in a
    later span's second tile (a second pass starting past the span's first
    column). The masses start as NaN, so a column left unwritten shows."""
    monkeypatch.setattr(kernel, "MASS_SPAN", 64)
    monkeypatch.setattr(kernel, "MASS_DENSE_BLOCK_T", 32)
    tile = kernel.mass_rank_tile
    monkeypatch.setattr(kernel, "mass_rank_tile", lambda rows, rk, dt: (32, tile(rows, rk, dt)[1]))
    launch = kernel._rank_space_masses

    def poisoned(q_pos, comp, logits, lse, mass_comp, mass_dense, *rest):
        mass_comp.fill_(float("nan"))
        mass_dense.fill_(float("nan"))
        launch(q_pos, comp, logits, lse, mass_comp, mass_dense, *rest)

    monkeypatch.setattr(kernel, "_rank_space_masses", poisoned)
    q, q_pos, comp, dense = make_case(device, dtype=torch.float32, batch=3, queries=queries, interleave=interleave,
                                      rank_k=64, rank_v=48, comp_lens=(200, 61, 0), dense_lens=(70, 0, 45))
    shape = comp.rank_k.shape
    first = torch.arange(shape[1], device=device).expand(shape) < 100  # 100 = span 1, tile 2, column 4
    comp = CompressedKV(comp.uk, comp.wk, comp.uv, comp.wv, torch.where(first, 64, 13).to(torch.int32),
                        torch.where(first, 48, 16).to(torch.int32), comp.pos, comp.length)
    want = ref.lowrank_decode(q, q_pos, comp, dense, rope_base=None)
    check(decode_absorbed(q, q_pos, comp, dense, num_splits=2), want, q, comp, dense, torch.float32)


def test_the_model_counts_a_second_pass_where_groups_meet_off_chunk():
    """The estimate's absorbed stage 1 takes the tile where AttentionPack's
    full-rank group meets the low one a second time only when the low rank
    (rank / 4) is no multiple of 16, and only in the split holding it."""
    from kernels_py.ops.lowrank_decode import model

    bench = model.Step(batch=8, visual=32768, low_share=0.75)  # values at 64 and 16: whole chunks
    odd = model.Step(batch=8, visual=32768, low_share=0.75, rank_v=40)  # values at 40 and 10
    assert model._ragged_tiles(bench, 0, 32768, 128) == 0
    assert (32768 - round(0.75 * 32768)) % 128 == 0  # the groups meet between two tiles
    assert model._ragged_tiles(odd, 0, 32768, 128) == 0
    shifted = model.Step(batch=8, visual=32768 + 64, low_share=0.75, rank_v=40)
    meet = shifted.visual - round(0.75 * shifted.visual)  # inside a tile
    assert meet % 128 and model._ragged_tiles(shifted, 0, shifted.visual, 128) == 1
    after = (meet // 128 + 1) * 128  # a split starting at the next tile
    assert model._ragged_tiles(shifted, after, shifted.visual, 128) == 0
    assert model._ragged_tiles(shifted, 0, after, 128) == 1


def test_the_model_takes_the_split_count_a_point_ran_with():
    """A measured point's shape records the split count its launch used
    (the rule may change since); 0 is today's default, split_count's."""
    from kernels_py.ops import estimate
    from kernels_py.ops.lowrank_decode import model

    def merge_trips(step):
        work = model._work(step, "_merge_rank_kernel", {}, estimate.H100, absorbed=True)
        return work.programs[0].values["n_splits"]

    assert merge_trips(model.Step(batch=64, visual=32768)) == kernel.split_count(32768, 64, estimate.H100.sms, absorbed=True) == 4
    assert merge_trips(model.Step(batch=64, visual=32768, splits=32)) == 32
    # The fused call's merge also attends the dense segment: its tokens'
    # trips, K, V and positions read, logits written; no dense partial read.
    step = model.Step(batch=8, visual=32768, splits=16)  # the same splits for both
    fused = model._work(step, "_merge_rank_kernel", {}, estimate.H100, absorbed=False)
    absorbed = model._work(step, "_merge_rank_kernel", {}, estimate.H100, absorbed=True)
    assert fused.programs[0].values["d_len"] == step.dense and "d_len" not in absorbed.programs[0].values
    b, n, hq, hk, d = step.batch, step.dense, step.heads, step.kv_heads, step.head_dim
    dense_read = b * n * 2 * hk * d * step.elem_bytes + b * n * 4 + b * hq * n * 2  # K, V, positions, fp16 logits
    partial = b * hq * (d + 1) * 4  # the dense sum and LSE the absorbed merge reads
    assert fused.hbm_bytes == pytest.approx(absorbed.hbm_bytes - partial + dense_read)
    with pytest.raises(ValueError, match="splits=300"):
        model.Step(batch=8, visual=32768, splits=300)


@pytest.mark.parametrize("fields,says", [
    ({"rank_k": 100000}, r"rank_k=100000 must be in \[1, kv_heads \* head_dim\] = \[1, 1024\]"),
    ({"rank_v": 0}, r"rank_v=0 must be in \[1, kv_heads \* head_dim\] = \[1, 1024\]"),
    ({"kv_heads": 1, "head_dim": 32}, r"rank_k=64 must be in \[1, kv_heads \* head_dim\] = \[1, 32\]"),
])
def test_the_model_refuses_a_rank_no_cache_has(fields, says):
    """A factor's rank is at most the width it rebuilds, as bench lowrank
    holds its ranks to: else the estimate (--shape rank_k=100000) times a
    step no cache holds."""
    from kernels_py.ops.lowrank_decode import model

    with pytest.raises(ValueError, match=says):
        model.Step(batch=8, visual=32768, **fields)
    assert model.Step(batch=8, visual=32768, rank_k=1024, rank_v=1).rank_k == 1024


def test_the_model_gives_the_fused_call_the_rank_chunk_its_step_names():
    """The estimate's step passes its rank_chunk to the fused call (0: none,
    the one-MMA rebuild, at partial keys too), and refuses a chunk the kernel
    does not take."""
    from kernels_py.ops.lowrank_decode import model

    assert model._rank_chunk(model.Step(batch=8, visual=32768, partial="keys", low_share=0.75)) is None
    assert model._rank_chunk(model.Step(batch=8, visual=32768, partial="keys", rank_chunk=16)) == 16
    with pytest.raises(ValueError, match="rank_chunk=24 must be one of 0, 16, 32, 64"):
        model.Step(batch=8, visual=32768, rank_chunk=24)


def test_mass_programs_fill_one_wave():
    """The rank-space mass kernel's span: the shortest, from MASS_SPAN up by
    powers of two, whose grid fits one wave of MASS_PROGRAMS_PER_SM
    programs an SM (132 SMs: 264 programs); MASS_SPAN on the interpreter."""
    assert kernel.MASS_PROGRAMS_PER_SM == 2
    assert kernel.MASS_SPAN == 512
    assert kernel.mass_span(32768, 1, 132) == 512  # one sequence: 64 programs at the shortest span
    assert kernel.mass_span(32768, 8, 132) == 1024  # 256 programs
    assert kernel.mass_span(32768, 64, 132) == 8192  # 2048 at 1024 columns, 256 at 8192
    assert kernel.mass_span(32768, 64, None) == kernel.MASS_SPAN
    assert kernel.mass_span(100, 512, 132) == kernel.MASS_SPAN  # never past the tokens
    assert kernel.mass_span(0, 8, 132) == kernel.MASS_SPAN


@triton.jit
def _whole_chunks_probe(Rank, Whole, Range, n, c_lo, rank_max, BLOCK_N: tl.constexpr):
    """The absorbed kernel's split of each tile of [c_lo, n) (kernel._whole_chunks:
    Whole) and the range its second loop walks (kernel._note_refused and
    kernel._ragged_range: Range)."""
    ragged_lo = tl.zeros([BLOCK_N], dtype=tl.int32) + n
    ragged_hi = tl.zeros([BLOCK_N], dtype=tl.int32) + c_lo
    for start in range(c_lo, n, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        tok_mask = offs_n < n
        rank = tl.load(Rank + offs_n, mask=tok_mask, other=0)
        whole = kernel._whole_chunks(rank, tl.max(rank, 0), rank_max)
        tl.store(Whole + offs_n, whole.to(tl.int32), mask=tok_mask)
        ragged_lo, ragged_hi = kernel._note_refused(ragged_lo, ragged_hi, tok_mask & ~whole, offs_n, c_lo, n)
    lo, hi = kernel._ragged_range(ragged_lo, ragged_hi, c_lo, BLOCK_N)
    tl.store(Range + tl.arange(0, 2), tl.where(tl.arange(0, 2) == 0, lo, hi))


@pytest.mark.parametrize("ranks,rank_max,refused,walked", [
    # AttentionPack's groups at ranks that are whole chunks: one pass
    ([64] * 40 + [16] * 50, 64, [], []),
    # one rank in a tile: its tail is dropped by the tile's top rank
    ([37] * 90, 64, [], []),
    # the factor's width need not be a whole chunk
    ([40] * 20 + [16] * 70, 40, [], []),
    # groups of 64 and 13 meet in the second tile: its 13s take the second pass
    ([64] * 40 + [13] * 50, 64, list(range(40, 64)), [32, 64]),
    # a lone odd rank under a larger one, in the last tile
    ([16] * 70 + [5] + [32] * 19, 64, [70], [64, 71]),
])
def test_which_tokens_take_the_second_pass(ranks, rank_max, refused, walked):
    """Which tokens the absorbed kernel's first loop takes and which tiles
    its second loop walks (32-token tiles), by rank layout."""
    rank = torch.tensor(ranks, dtype=torch.int32)
    whole = torch.zeros_like(rank)
    span = torch.zeros(2, dtype=torch.int32)
    _whole_chunks_probe[(1,)](rank, whole, span, rank.numel(), 0, rank_max, BLOCK_N=32)
    assert (whole == 0).nonzero()[:, 0].tolist() == refused
    lo, hi = span.tolist()
    assert list(range(lo, hi, 32)) == list(range(*walked, 32) if walked else [])


def test_strided_inputs_and_int32_indices(device):
    q, q_pos, comp, dense = make_case(device, dtype=torch.float32, heads=4, kv_heads=2, queries=2)
    want = ref.lowrank_decode(q, q_pos, comp, dense, rope_base=10000.0)
    want_abs = ref.lowrank_decode(q, q_pos, comp, dense, rope_base=None)

    def restride(t):  # same values, other memory order
        return t.transpose(0, -1).contiguous().transpose(0, -1)

    def widen(t):  # a view into a larger buffer: last dim not at stride 1 from a packed tensor
        big = torch.zeros(*t.shape[:-1], t.shape[-1] + 5, dtype=t.dtype, device=t.device)
        big[..., 2:2 + t.shape[-1]] = t
        return big[..., 2:2 + t.shape[-1]]

    comp_s = CompressedKV(widen(comp.uk), restride(comp.wk), restride(comp.uv), widen(comp.wv),
                          comp.rank_k.to(torch.int32).t().contiguous().t(), comp.rank_v.to(torch.int32),
                          comp.pos.to(torch.int32), comp.length.to(torch.int32))
    dense_s = DenseKV(dense.k.transpose(1, 2).contiguous().transpose(1, 2), restride(dense.v),
                      dense.pos.to(torch.int32), dense.length.to(torch.int32))
    q_s = restride(q)
    assert not (q_s.is_contiguous() or comp_s.uk.is_contiguous() or dense_s.k.is_contiguous())
    check(decode(q_s, q_pos.to(torch.int32), comp_s, dense_s, rope_base=10000.0), want, q, comp,
          dense, torch.float32)
    check(decode_absorbed(q_s, q_pos.to(torch.int32), comp_s, dense_s), want_abs, q, comp, dense,
          torch.float32)


@pytest.mark.parametrize("q_dtype,uw_dtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.float16)])
def test_mixed_dtypes(q_dtype, uw_dtype, device):
    """U/W in another float dtype than q and the dense segment."""
    q, q_pos, comp, dense = make_case(device, dtype=q_dtype, uw_dtype=uw_dtype, rank_k=24, rank_v=16)
    for absorbed in (False, True):
        if absorbed:
            got = decode_absorbed(q, q_pos, comp, dense)
        else:
            got = decode(q, q_pos, comp, dense, rope_base=10000.0)
        check(got, ref.lowrank_decode(q, q_pos, comp, dense, rope_base=None if absorbed else 10000.0),
              q, comp, dense, q_dtype)


def test_sm_scale(device):
    q, q_pos, comp, dense = make_case(device, dtype=torch.float32)
    got = decode(q, q_pos, comp, dense, rope_base=None, sm_scale=0.3)
    check(got, ref.lowrank_decode(q, q_pos, comp, dense, rope_base=None, sm_scale=0.3), q, comp, dense, torch.float32)
    default = decode(q, q_pos, comp, dense, rope_base=None)
    assert (got.lse - default.lse).abs().max() > 0.1


def test_rows_that_see_nothing(device):
    """A query before every cached token: lse -inf, output 0, no mass; the
    other sequence is unaffected. Also a sequence with no tokens at all."""
    q, q_pos, comp, dense = make_case(device, dtype=torch.float32, batch=3, comp_lens=(20, 30, 0),
                                      dense_lens=(5, 7, 0))
    q_pos = q_pos.clone()
    q_pos[0] = 0  # positions start at 5
    want = ref.lowrank_decode(q, q_pos, comp, dense, rope_base=10000.0)
    for got in (decode(q, q_pos, comp, dense, rope_base=10000.0),
                decode_absorbed(q, q_pos, comp, dense)):
        assert torch.all(got.lse[0] == float("-inf")) and torch.all(got.lse[2] == float("-inf"))
        assert torch.all(got.out[0] == 0) and torch.all(got.out[2] == 0)
        assert torch.all(got.mass_comp[0] == 0) and torch.all(got.mass_dense[0] == 0)
        assert not got.out.isnan().any()
    check(decode(q, q_pos, comp, dense, rope_base=10000.0), want, q, comp, dense, torch.float32)
    check(decode_absorbed(q, q_pos, comp, dense), ref.lowrank_decode(q, q_pos, comp, dense, rope_base=None), q, comp,
          dense, torch.float32)
    # Three query tokens, one of them before every token of its sequence.
    q, q_pos, comp, dense = make_case(device, dtype=torch.float32, batch=3, queries=3, comp_lens=(20, 30, 0),
                                      dense_lens=(5, 7, 0))
    q_pos = q_pos.clone()
    q_pos[0] = 0
    q_pos[1, 0] = 0
    for run, rope_base in ((lambda *a: decode(*a, rope_base=10000.0), 10000.0), (decode_absorbed, None)):
        got = run(q, q_pos, comp, dense)
        assert torch.all(got.lse[1, :, 0] == float("-inf")) and torch.all(got.lse[1, :, 1:] > float("-inf"))
        check(got, ref.lowrank_decode(q, q_pos, comp, dense, rope_base=rope_base), q, comp, dense, torch.float32)


def test_empty_segments(device):
    """No compressed slots at all (T = 0), no dense slots at all (S = 0), and neither."""
    q, q_pos, comp, dense = make_case(device, dtype=torch.float32, comp_lens=(0, 0), dense_lens=(6, 3), pad=0)
    assert comp.uk.shape[1] == 0
    check(decode(q, q_pos, comp, dense, rope_base=10000.0),
          ref.lowrank_decode(q, q_pos, comp, dense, rope_base=10000.0), q, comp, dense, torch.float32)
    check(decode_absorbed(q, q_pos, comp, dense),
          ref.lowrank_decode(q, q_pos, comp, dense, rope_base=None), q, comp, dense, torch.float32)
    q, q_pos, comp, dense = make_case(device, dtype=torch.float32, comp_lens=(0, 0), dense_lens=(0, 0), pad=0)
    for got in (decode(q, q_pos, comp, dense, rope_base=10000.0), decode_absorbed(q, q_pos, comp, dense)):
        assert got.mass_comp.shape == (2, 0) and got.mass_dense.shape == (2, 0)
        assert torch.all(got.lse == float("-inf")) and torch.all(got.out == 0)
    q, q_pos, comp, dense = make_case(device, dtype=torch.float32, comp_lens=(12, 40), dense_lens=(0, 0), pad=0)
    assert dense.k.shape[2] == 0
    check(decode(q, q_pos, comp, dense, rope_base=10000.0),
          ref.lowrank_decode(q, q_pos, comp, dense, rope_base=10000.0), q, comp, dense, torch.float32)
    check(decode_absorbed(q, q_pos, comp, dense),
          ref.lowrank_decode(q, q_pos, comp, dense, rope_base=None), q, comp, dense, torch.float32)


def test_empty_batch(device):
    q, q_pos, comp, dense = make_case(device, dtype=torch.float32)
    q, q_pos = q[:0], q_pos[:0]
    comp = CompressedKV(*(getattr(comp, f)[:0] for f in comp.__dataclass_fields__))
    dense = DenseKV(*(getattr(dense, f)[:0] for f in dense.__dataclass_fields__))
    for got in (decode(q, q_pos, comp, dense, rope_base=10000.0), decode_absorbed(q, q_pos, comp, dense),
                ref.lowrank_decode(q, q_pos, comp, dense, rope_base=10000.0)):
        assert got.out.shape == (0, 4, 1, 64) and got.lse.shape == (0, 4, 1)
        assert got.mass_comp.shape == (0, comp.uk.shape[1]) and got.mass_dense.shape == (0, dense.k.shape[2])


def test_default_num_splits():
    def lengths(c, d):
        return (CompressedKV(*[None] * 7, torch.tensor(c)), DenseKV(None, None, None, torch.tensor(d)))

    cpu = torch.device("cpu")
    # The splits cover the compressed tokens (the dense segment has programs of its own).
    # About 1,024 tokens each.
    assert kernel._num_splits(None, *lengths([100, 2100], [20, 64]), 8, cpu, False) == 3  # ceil(2100 / 1024)
    assert kernel._num_splits(None, *lengths([0], [0]), 8, cpu, False) == 1
    assert kernel._num_splits(None, *lengths([0], [70]), 8, cpu, False) == 1
    assert kernel._num_splits(None, *lengths([200_000], [64]), 8, cpu, False) == kernel.DEFAULT_MAX_SPLITS
    assert kernel._num_splits(5, *lengths([10], [0]), 8, cpu, False) == 5
    assert kernel.default_num_splits(*lengths([3000, 10], [5000, 0])) == 3  # ceil(3000 / 1024)
    assert kernel.default_num_splits(*lengths([3000, 10], [5000, 0]), absorbed=True) == 3


def test_workspace_holds_rank_space_partials(device):
    """Both kernels' workspaces: a rank-space partial per split and one more
    LSE slot (the dense segment's); only the absorbed kernel's has a dense
    partial and rank-space queries (the fused kernel's merge attends the
    dense segment itself). A workspace made for the other kernel is refused
    with the call that makes the right one."""
    q, q_pos, comp, dense = make_case(device, rank_k=16, rank_v=8)
    ws = kernel.make_workspace(q, comp, dense, 3, absorbed=True)
    assert ws.splits == 3
    assert ws.part_rank.shape == (2, 4, 1, 3, 8) and ws.part_o.shape == (2, 4, 1, 1, q.shape[3])
    assert ws.part_lse.shape == (2, 4, 1, 4) and ws.q_rank.shape == (2, 4, 16)
    fused = kernel.make_workspace(q, comp, dense, 3)
    assert fused.splits == 3 and fused.q_rank.numel() == 0 and fused.part_rank.shape == ws.part_rank.shape
    assert fused.part_o.numel() == 0  # its merge attends the dense segment itself
    assert fused.logits.shape[3] == comp.uk.shape[1] + dense.k.shape[2]  # every column: the masses read them
    check(decode_absorbed(q, q_pos, comp, dense, workspace=ws), ref.lowrank_decode(q, q_pos, comp, dense,
                                                                                   rope_base=None),
          q, comp, dense, q.dtype)
    with pytest.raises(ValueError, match="absorbed=True"):
        decode_absorbed(q, q_pos, comp, dense, workspace=fused)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["float16", "float32"])
def test_fused_masses_ignore_what_padding_columns_hold(dtype, device, monkeypatch):
    """The mass kernel loads whole columns of the logits buffer, padding
    included (a mask by each sequence's lengths would keep its loads
    scalar), and drops the padding's sums: a buffer filled with NaN and
    infinities before the call, 32-column mass programs (several a
    sequence, some all padding), ragged lengths."""
    monkeypatch.setattr(kernel, "MASS_BLOCK_T", 32)
    q, q_pos, comp, dense = make_case(device, dtype=dtype, **CASES["ragged"])
    ws = kernel.make_workspace(q, comp, dense, 2)
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.0e4], device=device)
    ws.logits.copy_(garbage[torch.arange(ws.logits.numel(), device=device) % 4].view(ws.logits.shape))
    got = decode(q, q_pos, comp, dense, rope_base=10000.0, workspace=ws)
    check(got, ref.lowrank_decode(q, q_pos, comp, dense, rope_base=10000.0), q, comp, dense, dtype)


@pytest.mark.parametrize("heads,queries", [(4, 1), (7, 3)])
def test_fused_logits_are_float16_and_token_major_over_an_fp16_cache(heads, queries, device):
    """The fused call stores the masses' logits in float16 over an fp16
    cache (float32 over a bf16 or float32 one), a token's rows side by side
    and padded to 16 of them; the absorbed call's dense logits stay float32.
    A workspace whose logits have the other dtype is refused with the call
    that makes the right one."""
    case = dict(heads=heads, kv_heads=1, queries=queries)
    q, q_pos, comp, dense = make_case(device, dtype=torch.float16, **case)
    ws = kernel.make_workspace(q, comp, dense, 3)
    cols = comp.uk.shape[1] + dense.k.shape[2]
    assert ws.logits.dtype == torch.float16 and ws.logits.shape == (q.shape[0], heads, queries, cols)
    assert ws.logits.stride()[1:] == (queries, 1, -(-heads * queries // 16) * 16)  # token-major, rows padded to 16
    assert kernel.make_workspace(q, comp, dense, 3, absorbed=True).logits.dtype == torch.float32
    assert kernel.logits_dtype(q.bfloat16(), DenseKV(dense.k.bfloat16(), dense.v.bfloat16(), dense.pos, dense.length),
                               absorbed=False) == torch.float32
    q32, pos32, comp32, dense32 = make_case(device, dtype=torch.float32, **case)
    ws32 = kernel.make_workspace(q32, comp32, dense32, 3)
    assert ws32.logits.dtype == torch.float32 and ws32.logits.shape == ws.logits.shape
    with pytest.raises(ValueError, match=r"workspace.logits is torch.float32 .* needs float16 .*make_workspace"):
        decode(q, q_pos, comp, dense, rope_base=None, workspace=ws32)
    check(decode(q, q_pos, comp, dense, rope_base=None, workspace=ws),
          ref.lowrank_decode(q, q_pos, comp, dense, rope_base=None), q, comp, dense, torch.float16)
    if queries > 1:  # the mass kernels address row h * M + m with one stride
        apart = torch.empty((q.shape[0], queries, heads, cols), dtype=torch.float16, device=device).transpose(1, 2)
        with pytest.raises(ValueError, match=r"heads and queries must be one run of rows"):
            decode(q, q_pos, comp, dense, rope_base=None,
                   workspace=kernel.Workspace(apart, ws.part_o, ws.part_lse, ws.q_rank, ws.part_rank))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the interpreter's, storing it
def test_fused_masses_take_a_logit_past_float16s_range_as_its_rows_lse(device):
    """A dense key of kv head 0 along its query, scaled so that the logit
    (log2 units) passes 65504, float16's largest: stored as +inf, its
    weight is 1 (the row's LSE), as the reference has it. (Finite logits
    that large would keep nothing of their weights: a float16 logit is
    within 2^-11 |s| of itself, 16 at |s| = 32768.)"""
    q, q_pos, comp, dense = make_case(device, dtype=torch.float16, heads=2, kv_heads=2, dense_lens=(9, 3))
    k = dense.k.clone()
    k[:, 0, 0, :] = q[:, 0, 0, :].float() * 6000.0
    dense = DenseKV(k, dense.v, dense.pos, dense.length)
    got = decode(q, q_pos, comp, dense, rope_base=None)
    want = ref.lowrank_decode(q, q_pos, comp, dense, rope_base=None)
    assert float(want.lse[:, 0, 0].min()) * math.log2(math.e) > 65504  # past float16's range
    assert torch.isfinite(got.mass_dense).all() and torch.isfinite(got.mass_comp).all()
    torch.testing.assert_close(got.mass_dense, want.mass_dense, atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(got.mass_comp, want.mass_comp, atol=1e-3, rtol=1e-2)


def test_float16_logits_move_each_mass_within_their_rounding(device, monkeypatch):
    """Float16 logits change the fused call's masses only by their
    rounding: each weight 2^(s - lse) within ln 2 * 2^-11 |s| of itself
    (relative), so each token's mass within the mean over rows of that,
    taken from the same call with float32 logits. Logits up to about 46
    (log2 units; q scaled by 4), where the rounding is coarsest."""
    q, q_pos, comp, dense = make_case(device, dtype=torch.float16, heads=8, kv_heads=2, comp_lens=(120, 77),
                                      dense_lens=(9, 4), rank_k=32, rank_v=32)
    q = (q.float() * 4).to(torch.float16)
    got = decode(q, q_pos, comp, dense, rope_base=10000.0, num_splits=3)
    monkeypatch.setattr(kernel, "logits_dtype", lambda *args, **kw: torch.float32)
    ws = kernel.make_workspace(q, comp, dense, 3)
    exact = decode(q, q_pos, comp, dense, rope_base=10000.0, workspace=ws)
    assert torch.equal(got.out, exact.out) and torch.equal(got.lse, exact.lse)  # the logits feed the masses only
    s = ws.logits.float()  # [B, H, M, T + S], log2 units, -inf where not seen
    assert float(s[s > float("-inf")].abs().max()) > 32  # the rounding's step is 2^-5 or coarser there
    lse2 = exact.lse[..., None] * math.log2(math.e)
    weight = torch.exp2(s - lse2).nan_to_num(0.0)
    bound = (weight * s.abs().nan_to_num(0.0, posinf=0.0)).mean(dim=(1, 2)) * math.log(2) * 2.0 ** -11 * 1.01
    tokens = comp.uk.shape[1]
    valid = torch.cat([torch.arange(tokens, device=device)[None, :] < comp.length[:, None],
                       torch.arange(dense.k.shape[2], device=device)[None, :] < dense.length[:, None]], 1)
    for part, (a, b) in enumerate(((got.mass_comp, exact.mass_comp), (got.mass_dense, exact.mass_dense))):
        cols = slice(0, tokens) if part == 0 else slice(tokens, None)
        err = (a - b).abs()[valid[:, cols]]
        assert bool((err <= bound[:, cols][valid[:, cols]] + 1e-9).all())
    assert float((got.mass_comp - exact.mass_comp).abs().max()) > 0  # the rounding is there to bound


def test_default_workspace_takes_each_kernels_split_count(device, monkeypatch):
    """make_workspace with num_splits=None makes the split count a call
    without a workspace would use: the batch's programs on the GPU's SMs,
    one fused program an SM and two absorbed ones (here a 132-SM GPU, as
    split_count sees it; the launches are not run)."""
    from kernels_py.ops import splitk

    # 3 sequences of 32K tokens: 43 fused splits of 6 tiles (one wave of
    # 129 programs) and 86 absorbed ones of 3 (258 programs, two an SM),
    # where counting one sequence gave 128 (DEFAULT_MAX_SPLITS).
    q, q_pos, comp, dense = make_case(device, batch=3, head_dim=16, comp_lens=(32768, 100, 5), dense_lens=(4, 0, 2),
                                      rank_k=4, rank_v=4, pad=0)
    monkeypatch.setattr(splitk, "sm_count", lambda _device: 132)
    counts = {}
    for absorbed in (False, True):
        want = kernel.split_count(32768, 3, 132, absorbed=absorbed)
        assert kernel.default_num_splits(comp, dense, absorbed=absorbed) == want
        assert kernel.make_workspace(q, comp, dense, None, absorbed=absorbed).splits == want
        counts[absorbed] = want
    assert counts == {False: 43, True: 86}


def _replace(case, **changes):
    q, q_pos, comp, dense = case
    fields = {**comp.__dict__, **{k: v for k, v in changes.items() if k in comp.__dict__}}
    dfields = {**dense.__dict__, **{k[6:]: v for k, v in changes.items() if k.startswith("dense_")}}
    return changes.get("q", q), changes.get("q_pos", q_pos), CompressedKV(**fields), DenseKV(**dfields)


@pytest.mark.parametrize("change,error,match", [
    (lambda c: dict(q=c[0].to(torch.int32)), TypeError, "q has dtype"),
    (lambda c: dict(uk=c[2].uk.to(torch.int8)), TypeError, "uk has dtype"),
    (lambda c: dict(rank_k=c[2].rank_k.float()), TypeError, "comp.rank_k must be int32 or int64"),
    (lambda c: dict(uk=c[2].uk[..., :0], wk=c[2].wk[:, :0]), ValueError, "uk has rank 0"),
    (lambda c: dict(uk=c[2].uk[..., :0]), ValueError, "uk has rank 0"),
    (lambda c: dict(wv=c[2].wv[:, :, :-1]), ValueError, "wv must be"),
    (lambda c: dict(wk=c[2].wk[:, :-1]), ValueError, "wk must be"),
    (lambda c: dict(q=c[0][0]), ValueError, "q must be"),
    (lambda c: dict(uv=c[2].uv[0]), ValueError, "uk and uv must be"),
    (lambda c: dict(dense_k=c[3].k[:, :, :, :32]), ValueError, "dense k and v"),
    (lambda c: dict(uv=c[2].uv.to("meta")), ValueError, "uv is on meta"),
    (lambda c: dict(q_pos=c[1].to("meta")), ValueError, "q_pos is on meta"),
    (lambda c: dict(rank_v=c[2].rank_v * 0), ValueError, "rank_v entries"),
    (lambda c: dict(rank_k=c[2].rank_k + 16), ValueError, "rank_k entries"),
    (lambda c: dict(length=c[2].length + 100), ValueError, "lengths"),
    (lambda c: dict(pos=c[2].pos[:, :-1]), ValueError, "comp.pos must have shape"),
])
def test_bad_inputs(change, error, match, device):
    case = make_case(device, dtype=torch.float16, rank_k=16, rank_v=16)
    bad = _replace(case, **change(case))
    with pytest.raises(error, match=match):
        kernel.lowrank_decode(*bad, rope_base=10000.0)
    with pytest.raises(error, match=match):
        kernel.lowrank_decode_absorbed(*bad)


IMPLEMENTATIONS = {
    "fused": lambda *a: kernel.lowrank_decode(*a, rope_base=None),
    "absorbed": lambda *a: kernel.lowrank_decode_absorbed(*a),
    "reference": lambda *a: ref.lowrank_decode(*a, rope_base=None),
}


@pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))
def test_positions_outside_int32_are_refused(impl, device):
    # The kernels narrow positions to int32: a query at 2**31 + p wrapped to
    # a negative position and saw nothing, where the reference saw every token.
    run = IMPLEMENTATIONS[impl]
    q, q_pos, comp, dense = make_case(device, dtype=torch.float32)
    with pytest.raises(ValueError, match="q_pos holds positions outside int32"):
        run(q, q_pos.long() + 2**31, comp, dense)
    far = comp.pos.long().clone()
    far[0, 0] = -2**31 - 1
    with pytest.raises(ValueError, match=r"comp.pos \(of the tokens within length\) holds positions outside int32"):
        run(q, q_pos, CompressedKV(**{**comp.__dict__, "pos": far}), dense)
    far = dense.pos.long().clone()
    far[0, 0] = 2**32
    with pytest.raises(ValueError, match=r"dense.pos \(of the tokens within length\) holds positions outside int32"):
        run(q, q_pos, comp, DenseKV(**{**dense.__dict__, "pos": far}))
    # Padding tokens' positions are never read: anything goes there.
    padded = comp.pos.long().clone()
    padded[1, comp.length[1]:] = 2**40
    torch.testing.assert_close(run(q, q_pos, CompressedKV(**{**comp.__dict__, "pos": padded}), dense).out,
                               ref.lowrank_decode(q, q_pos, comp, dense, rope_base=None).out, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))
def test_no_query_tokens_or_channels_are_refused_by_every_implementation(impl, device):
    # The kernels refused M = 0 while the reference returned NaN masses (an
    # average over no rows); head_dim 0 failed in the reference's softmax
    # scale (ZeroDivisionError).
    run = IMPLEMENTATIONS[impl]
    q, q_pos, comp, dense = make_case(device, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"at least one query token and one channel, got shape \(2, 4, 0, 64\)"):
        run(q[:, :, :0], q_pos[:, :0], comp, dense)
    no_channels = DenseKV(dense.k[..., :0], dense.v[..., :0], dense.pos, dense.length)
    no_w = CompressedKV(**{**comp.__dict__, "wk": comp.wk[..., :0], "wv": comp.wv[..., :0]})
    with pytest.raises(ValueError, match=r"at least one query token and one channel, got shape \(2, 4, 1, 0\)"):
        run(q[..., :0], q_pos, no_w, no_channels)


def test_arguments_of_the_wrong_kind_get_type_errors(device):
    q, q_pos, comp, dense = make_case(device, dtype=torch.float32)
    for run in IMPLEMENTATIONS.values():
        with pytest.raises(TypeError, match="comp must be a CompressedKV, got tuple"):  # an AttributeError
            run(q, q_pos, tuple(comp.__dict__.values()), dense)
        with pytest.raises(TypeError, match="dense.length must be a torch.Tensor, got list"):
            run(q, q_pos, comp, DenseKV(**{**dense.__dict__, "length": dense.length.tolist()}))
    for run in (kernel.lowrank_decode, ref.lowrank_decode):  # '<' between an int and a str
        with pytest.raises(TypeError, match="rope_base must be a number or None, got str"):
            run(q, q_pos, comp, dense, rope_base="10000")
    with pytest.raises(ValueError, match="kv_heads must be a positive int dividing wk's 128 columns"):
        ref.decompress(comp, 3, None)  # a view error naming no argument


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compute_checks_rank_chunk_on_every_backend(backend, device):
    # backend="torch" (what "auto" picks on CPU tensors) ignored a rank_chunk the kernel refuses.
    q, q_pos, comp, dense = make_case(device, dtype=torch.float32)
    with pytest.raises(ValueError, match="rank_chunk must be a power of two >= 16"):
        lowrank_decode.compute(q, q_pos, comp, dense, rope_base=None, backend=backend, rank_chunk=24)


def test_bad_options(device):
    q, q_pos, comp, dense = make_case(device, dtype=torch.float16)
    for kwargs, match in (({"num_splits": 0}, "num_splits"), ({"num_splits": 2.0}, "num_splits"),
                          ({"sm_scale": float("nan")}, "sm_scale"), ({"sm_scale": -1.0}, "sm_scale"),
                          ({"block_n": 8}, "block_n"), ({"block_n": 48}, "block_n")):
        with pytest.raises(ValueError, match=match):
            kernel.lowrank_decode(q, q_pos, comp, dense, rope_base=None, **kwargs)
    for rope_base in (1.0, float("nan"), float("inf")):  # NaN passed as a base: the kernel gave NaN, the reference not
        with pytest.raises(ValueError, match="finite rope_base > 1"):
            kernel.lowrank_decode(q, q_pos, comp, dense, rope_base=rope_base)
        with pytest.raises(ValueError, match="finite rope_base > 1"):
            ref.lowrank_decode(q, q_pos, comp, dense, rope_base=rope_base)
    # head_dim must be even for the fused kernel, which handles keys in RoPE's
    # two halves; the absorbed one does not split them.
    odd = make_case(device, dtype=torch.float32, head_dim=63)
    with pytest.raises(ValueError, match="even"):
        kernel.lowrank_decode(*odd, rope_base=None)
    check(decode_absorbed(*odd), ref.lowrank_decode(*odd, rope_base=None), *odd[:1], *odd[2:], torch.float32)
    # 64 query heads per kv head x 3 queries is more rows than one program holds.
    many = torch.zeros(2, 64, 3, 64, dtype=torch.float16, device=device)
    dense1 = DenseKV(dense.k[:, :1], dense.v[:, :1], dense.pos, dense.length)
    comp1 = CompressedKV(comp.uk, comp.wk[..., :64], comp.uv, comp.wv[..., :64], comp.rank_k, comp.rank_v,
                         comp.pos, comp.length)
    with pytest.raises(ValueError, match="exceeds"):
        kernel.lowrank_decode(many, q_pos[:, :1].repeat(1, 3), comp1, dense1, rope_base=None)


def test_rank_limits(device):
    q, q_pos, comp, dense = make_case(device, dtype=torch.float16, rank_k=300, rank_v=16, comp_lens=(3, 2),
                                      dense_lens=(1, 1))
    with pytest.raises(ValueError, match="absorbed kernel supports up to 256"):
        kernel.lowrank_decode_absorbed(q, q_pos, comp, dense)
    # The fused kernel rebuilds keys in chunks (any rank), but keeps values in rank space.
    q, q_pos, comp, dense = make_case(device, dtype=torch.float16, rank_k=16, rank_v=300, comp_lens=(3, 2),
                                      dense_lens=(1, 1))
    with pytest.raises(ValueError, match="uv has rank 300; the kernel keeps values in rank space and supports up to 256"):
        kernel.lowrank_decode(q, q_pos, comp, dense, rope_base=None)


@pytest.mark.parametrize("dtype,uw_dtype", [(torch.float32, None), (torch.float16, torch.float32),
                                            (torch.bfloat16, torch.float16)], ids=["float32", "fp16-q", "mixed"])
def test_absorbed_float32_factors_of_rank_256_over_head_dim_256_are_refused(dtype, uw_dtype, device):
    # Their W_k tile needs 278528 bytes of shared memory (compiled for sm_80
    # and sm_90): the launch failed on a GPU with Triton's out-of-resources error.
    q, q_pos, comp, dense = make_case(device, dtype=dtype, uw_dtype=uw_dtype, head_dim=256, rank_k=256, rank_v=16,
                                      comp_lens=(3, 2), dense_lens=(1, 1))
    if dtype == torch.bfloat16:  # fp16 factors but a bf16 W_k: mixed, multiplied in float32
        comp = CompressedKV(**{**comp.__dict__, "wk": comp.wk.to(torch.bfloat16)})
    with pytest.raises(ValueError, match=r"holds W_k as one \[rank, head_dim\] tile, in float32 .* rank 256 x "
                                         r"head_dim 256"):
        kernel.lowrank_decode_absorbed(q, q_pos, comp, dense)


def test_roofline_model_counts_the_bytes_of_the_issue():
    """fp16, 8 kv heads, head_dim 128, rank 64: 4096 bytes a token in the full
    cache, 256 in U_k + U_v, read once for all heads."""
    from kernels_py.ops.lowrank_decode import model

    step = model.Step(batch=64, visual=32768, dense=64)
    assert model.per_token_bytes(step) == {"full": 4096, "factors": 256}
    c = model.costs(step)
    assert c["flash, full cache"]["bytes"] == 64 * (32768 + 64) * 4096
    w_bytes = 64 * (64 + 64) * 8 * 128 * 2
    dense_bytes = 64 * 64 * 4096
    assert c["absorbed (latent)"]["bytes"] == 64 * 32768 * 256 + w_bytes + dense_bytes
    assert c["fused (exact)"]["mass_bytes"] == 64 * 32 * (32768 + 64) * 4  # float16 logits, out and back
    f32 = model.costs(model.Step(batch=64, visual=32768, dense=64, elem_bytes=4))
    assert f32["fused (exact)"]["mass_bytes"] == 64 * 32 * (32768 + 64) * 8  # float32 over a float32 cache
    # The absorbed kernel's masses: dense logits out and back, U_k read again, q~ out and back.
    assert c["absorbed (latent)"]["mass_bytes"] == 64 * 32 * 64 * 8 + 64 * 32768 * 128 + 64 * 32 * 64 * 8
    flash_us, bound = model.roofline_us(c["flash, full cache"])
    assert bound == "memory" and abs(flash_us - 8.6e9 / 3.35e12 * 1e6) / flash_us < 0.01
    # Executed FLOPs of the fused kernel per token: the rebuild (8 kv heads x
    # 2 * 64 * 128), all 32 rows scoring each kv head's keys, values in rank
    # space (W_v's map is the merge's, on CUDA cores); the dense tokens, each
    # kv head's 4 rows padded to 16.
    per_token = 8 * 2 * 64 * 128 + 8 * 32 * 2 * 128 + 32 * 2 * 64
    assert c["fused (exact)"]["flops"] == 64 * 32768 * per_token + 64 * 8 * 16 * 64 * 4 * 128
    rows = model.report()["rows"]
    assert {r["variant"] for r in rows} == {"flash, full cache", "absorbed (latent)", "fused (exact)",
                                            "absorbed (latent), no mass", "fused (exact), no mass"}
    # 75% of the tokens at rank 16 in keys and values, stored grouped: U bytes
    # and the key rebuild at the mean rank 28.
    low = model.Step(batch=64, visual=32768, dense=64, low_share=0.75, partial="both")
    assert low.mean_ranks() == (28.0, 28.0) and model.per_token_bytes(low)["factors"] == 112
    assert model.costs(low)["fused (exact)"]["bytes"] == 64 * 32768 * 112 + w_bytes + dense_bytes


def test_caller_owned_workspace(device):
    """A workspace per kernel serves every step of a loop: results equal those
    of calls that allocate their own; a workspace of other shapes, splits or
    kernel is refused with what to do."""
    q, q_pos, comp, dense = make_case(device, dtype=torch.float32, **CASES["mixed_ranks_m3"])
    fused_ws = kernel.make_workspace(q, comp, dense, num_splits=3)
    absorbed_ws = kernel.make_workspace(q, comp, dense, num_splits=3, absorbed=True)
    assert fused_ws.splits == 3 and fused_ws.logits.shape == (*q.shape[:3], comp.uk.shape[1] + dense.k.shape[2])
    # The absorbed kernel keeps logits of the dense tokens only (the mass kernel recomputes the others).
    assert absorbed_ws.logits.shape == (*q.shape[:3], dense.k.shape[2])
    for step in range(2):
        q_step = q * (1 + step)
        for run, ws in ((lambda **kw: decode(q_step, q_pos, comp, dense, rope_base=10000.0, **kw), fused_ws),
                        (lambda **kw: decode_absorbed(q_step, q_pos, comp, dense, **kw), absorbed_ws)):
            got, want = run(workspace=ws), run(num_splits=3)
            for a, b in zip(got, want):
                assert torch.equal(a, b)
    with pytest.raises(ValueError, match="num_splits=2 but the workspace was made for 3 splits"):
        decode(q, q_pos, comp, dense, rope_base=None, num_splits=2, workspace=fused_ws)
    with pytest.raises(ValueError, match=r"workspace.logits .* make_workspace\(q, comp, dense, num_splits=3, absorbed=True\)"):
        decode_absorbed(q, q_pos, comp, dense, workspace=fused_ws)
    other_q, other_pos, other_comp, other_dense = make_case(device, dtype=torch.float32, **CASES["ragged"])
    with pytest.raises(ValueError, match=r"workspace.logits is torch.float32 .* this call needs float32 .*make_workspace"):
        decode(other_q, other_pos, other_comp, other_dense, rope_base=None, workspace=fused_ws)
    with pytest.raises(TypeError, match="workspace must be a Workspace"):
        decode(q, q_pos, comp, dense, rope_base=None, workspace=(fused_ws.logits, fused_ws.part_o, fused_ws.part_lse))


def _rebuild_accumulating_in_fp16(u, w, rank):
    """U W with every partial sum rounded to fp16, one rank column at a time:
    the most roundings an fp16-accumulating MMA can make (the fused kernel's
    key rebuild on fp16 factors rounds at least once per 16 columns)."""
    keep = torch.arange(u.shape[-1])[None, None, :] < rank[..., None].to(torch.int64)
    u = torch.where(keep, u.float(), 0.0)
    acc = torch.zeros(u.shape[0], u.shape[1], w.shape[-1], dtype=torch.float16)
    for j in range(u.shape[-1]):
        acc = (acc.float() + u[:, :, j, None] * w[:, None, j, :].float()).half()
    return acc


def test_keys_rebuilt_with_fp16_accumulation_stay_within_the_fp16_tolerance():
    """On fp16 factors and queries the fused kernel's key rebuild accumulates
    in fp16 (its MMAs' out_dtype; the interpreter sums in float32, so this is
    checked here on the reference): keys rebuilt with a rounding after every
    rank column, fed to the reference as factors it rebuilds exactly (U = the
    keys, W = I), keep the output within the fp16 tolerance the kernel is
    held to, at ranks 16 and 64."""
    for rank in (16, 64):
        q, q_pos, comp, dense = make_case("cpu", rank_k=rank, rank_v=16, dtype=torch.float16)
        want = ref.lowrank_decode(q, q_pos, comp, dense, rope_base=10000.0)
        keys = _rebuild_accumulating_in_fp16(comp.uk, comp.wk, comp.rank_k)
        width = keys.shape[-1]
        eye = torch.eye(width, dtype=torch.float16).expand(comp.wk.shape[0], width, width).contiguous()
        full = torch.full_like(comp.rank_k, width)
        rounded = CompressedKV(keys, eye, comp.uv, comp.wv, full, comp.rank_v, comp.pos, comp.length)
        got = ref.lowrank_decode(q, q_pos, rounded, dense, rope_base=10000.0)
        err = ((got.out.float() - want.out.float()).abs() / (1 + want.out.float().abs())).max().item()
        assert 0 < err, f"rank {rank}: the fp16 accumulation changed nothing, so this checks nothing"
        atol_o, atol_l, _ = TOL[torch.float16]
        # The kernel's own roundings (keys, probabilities) come on top: half the tolerance is left for them.
        assert err < atol_o / 2, f"rank {rank}: fp16 accumulation alone moves the output by {err:.2e}"
        torch.testing.assert_close(got.lse, want.lse, atol=atol_l / 2, rtol=atol_l / 2)
