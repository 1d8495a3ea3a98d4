"""kernels_py.ops.attention_stats: the kernels against their reference.

How the ThresholdFilter counts (`below`) are compared. The count is a step
function of the score: entry (i, j) is below when s_ij - max_j s_ij < log p.
Kernel and reference read the same inputs and both turn fp16/bf16 values into
float32 exactly (and the product of two 16-bit values is exact in float32), so
the probabilities are float32 on both sides for every input dtype; there is no
"16-bit probability" to redo the count in. What differs is only the order (and,
on tensor cores, the internal precision) of the float32 accumulation of q . k,
a relative error of about 1e-6 in the scores, up to about 1e-5 on a GPU. So a
count may differ from the reference only by the number of entries whose
log-distance to the cut, |s_ij - max_j s_ij - log p| (ref.threshold_distance),
is within BAND of it, checked per (head, key). For float32 the test data are
also required to have no entry in that band, and the counts must then match
exactly. Scores are spread (queries scaled by SPREAD) so that a good share of
the entries fall below the cut and the counts are not trivially zero.
"""

import math

import pytest
import torch
import triton
import triton.language as tl

from kernels_py.attention import Spans
from kernels_py.ops import attention_stats as kernel
from kernels_py.ops.attention_stats import kernel as stats_kernel
from kernels_py.ops.attention_stats import reference as ref

SPREAD = 2.5
# Tolerance on float results (row statistics and attention sums).
TOL = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-3}
# Entries this close (natural-log units) to the ThresholdFilter's cut may be
# counted on either side of it.
BAND = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-3}


def make(heads, kv_heads, keys, rows, head_dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (SPREAD * torch.randn(heads, rows, head_dim, generator=g)).to(device=device, dtype=dtype)
    k = torch.randn(kv_heads, keys, head_dim, generator=g).to(device=device, dtype=dtype)
    return q, k


def positions(kind, n, r, seed=0):
    """Selected rows of each kind; r is their count."""
    if kind == "last":
        return kernel.last_row(n)
    if kind == "recent":
        return kernel.recent_rows(n, r)
    if kind == "probe":  # non-contiguous: the r // 2 most recent plus random earlier ones
        return kernel.probe_rows(n, recent=r // 2, random=r - r // 2, seed=seed)
    if kind == "start":  # rows at the very start, position 0 included
        return torch.arange(r, dtype=torch.int64)
    if kind == "post":
        return kernel.post_vision_rows(n - r, n)
    if kind == "scattered":  # unsorted, with a duplicate, int32
        return torch.tensor([n // 2, 3, n - 1, 0, n // 2][:r], dtype=torch.int32)
    if kind.startswith("at"):
        return torch.tensor([int(kind[2:])], dtype=torch.int64)
    raise ValueError(kind)


def check_against_reference(got, want, q, k, q_pos, p, dtype, scale=None):
    heads, rows, _ = q.shape
    kv_heads, keys, _ = k.shape
    tol = TOL[dtype]
    assert got.row_max.shape == got.row_sumexp.shape == (heads, rows)
    assert got.attn_sum.shape == got.below.shape == got.nonzero.shape == (heads, keys)
    assert got.attn_sum_kv.shape == (kv_heads, keys)
    assert got.row_max.dtype == got.row_sumexp.dtype == got.attn_sum.dtype == torch.float32
    assert got.below.dtype == got.nonzero.dtype == torch.int32
    assert got.p == p

    torch.testing.assert_close(got.row_max, want.row_max, atol=tol, rtol=tol)
    torch.testing.assert_close(got.row_sumexp, want.row_sumexp, atol=tol, rtol=tol)
    scores, visible = ref.causal_scores(q, k, q_pos, scale)
    torch.testing.assert_close(got.row_lse(), torch.logsumexp(scores, dim=-1), atol=tol, rtol=tol)
    torch.testing.assert_close(got.attn_sum, want.attn_sum, atol=tol, rtol=tol)
    torch.testing.assert_close(got.attn_sum_kv, want.attn_sum_kv, atol=tol, rtol=tol)
    assert torch.equal(got.nonzero, want.nonzero)

    # The ThresholdFilter counts (see the module docstring).
    near_cut = (ref.threshold_distance(q, k, q_pos, p, scale) < BAND[dtype]).sum(dim=1)
    diff = (got.below - want.below).abs()
    assert torch.all(diff <= near_cut), f"{int((diff > near_cut).sum())} counts differ away from the cut"
    if dtype == torch.float32:
        assert int(near_cut.sum()) == 0, "fp32 test data put an entry on the cut: pick another seed"
        assert torch.equal(got.below, want.below)
    # A head's sparsity is its below count over its causal entries: it may differ by its near-cut entries' share.
    share_near_cut = near_cut.sum(dim=1).double() / want.nonzero.sum(dim=1).double()
    sparsity_diff = (got.sparsity().double() - want.sparsity().double()).abs()
    assert torch.all(sparsity_diff <= share_near_cut + 1e-6), (sparsity_diff, share_near_cut)

    # Invariants that do not lean on the reference.
    causal = int(visible.sum())
    assert torch.equal(got.nonzero[0].sum(), torch.tensor(causal, dtype=torch.int64, device=q.device))
    assert torch.all(got.below <= got.nonzero)
    torch.testing.assert_close(got.attn_sum.sum(1), torch.full((heads,), float(rows), device=q.device),
                               atol=1e-3, rtol=1e-4)  # each row is a distribution
    last = int(q_pos.max())
    assert torch.all(got.attn_sum[:, last + 1:] == 0) and torch.all(got.nonzero[:, last + 1:] == 0)
    torch.testing.assert_close(got.attn_sum_kv, got.attn_sum.view(kv_heads, heads // kv_heads, keys).sum(1),
                               atol=1e-6, rtol=1e-6)
    if causal >= 64 and 0 < p < 1:  # enough entries for the data to exercise the cut
        assert 0 < int(want.below.sum()) < heads * causal


CASES = [
    # heads, kv_heads, keys, rows kind, rows, head_dim, dtype, key_splits, seed
    # (fp32 seeds chosen so that no entry sits within BAND of the cut)
    pytest.param(2, 2, 37, "last", 1, 64, torch.float32, 1, 1, id="mha-N37-last-d64-fp32"),
    pytest.param(4, 1, 100, "recent", 5, 80, torch.float32, 1, 0, id="gqa4-N100-recent5-d80-fp32"),
    pytest.param(7, 1, 257, "probe", 33, 96, torch.float32, 3, 2, id="gqa7-N257-probe33-d96-fp32-3keysplits"),
    pytest.param(2, 2, 100, "start", 5, 128, torch.float32, 1, 0, id="mha-N100-start5-d128-fp32"),
    pytest.param(1, 1, 257, "at0", 1, 128, torch.float32, 1, 0, id="N257-row-at-0-d128-fp32"),
    pytest.param(14, 2, 100, "scattered", 5, 80, torch.float32, 3, 0, id="gqa7x2-N100-scattered-d80-fp32"),
    pytest.param(4, 2, 257, "post", 33, 64, torch.float32, 2, 2, id="gqa2-N257-post33-d64-fp32-2keysplits"),
    pytest.param(4, 4, 100, "probe", 33, 128, torch.float16, 1, 0, id="mha-N100-probe33-d128-fp16"),
    pytest.param(4, 1, 257, "post", 33, 96, torch.float16, 3, 0, id="gqa4-N257-post33-d96-fp16-3keysplits"),
    pytest.param(7, 1, 100, "scattered", 5, 64, torch.float16, 1, 0, id="gqa7-N100-scattered-d64-fp16"),
    pytest.param(2, 2, 37, "start", 33, 80, torch.float16, 3, 0, id="mha-N37-start33-d80-fp16"),
    pytest.param(7, 1, 37, "start", 5, 64, torch.bfloat16, 1, 0, id="gqa7-N37-start5-d64-bf16"),
    pytest.param(8, 2, 257, "at200", 1, 80, torch.bfloat16, 1, 0, id="gqa4-N257-row-at-200-d80-bf16"),
    pytest.param(2, 2, 37, "recent", 33, 128, torch.bfloat16, 3, 0, id="mha-N37-recent33-d128-bf16"),
    pytest.param(4, 4, 257, "probe", 33, 96, torch.bfloat16, 2, 0, id="mha-N257-probe33-d96-bf16"),
]


@pytest.mark.parametrize("heads,kv_heads,keys,kind,rows,head_dim,dtype,key_splits,seed", CASES)
def test_matches_reference(heads, kv_heads, keys, kind, rows, head_dim, dtype, key_splits, seed, device):
    q_pos = positions(kind, keys, rows).to(device)
    assert q_pos.shape == (rows,)
    q, k = make(heads, kv_heads, keys, rows, head_dim, dtype, device, seed)
    got = kernel.attention_stats(q, k, q_pos, key_splits=key_splits)
    want = ref.attention_stats(q, k, q_pos)
    check_against_reference(got, want, q, k, q_pos, 0.01, dtype)


@pytest.mark.parametrize("p", [0.01, 0.0, -0.0])
def test_threshold_over_blocks_every_row_sees_whole(p, device):
    """The key blocks every selected row sees whole count the entries below
    the cut on the floats' bits (kernel._count_below), the others with a
    float compare: both agree with the reference, and -0.0 counts nothing,
    as 0.0 does (compared on its bits it would count every entry; the
    launcher passes 0.0. Triton's interpreter hands a kernel -0.0 as 0.0
    anyway, so only a GPU run tests that)."""
    q, k = make(4, 2, 100, 8, 64, torch.float32, device, seed=2)
    q_pos = torch.arange(92, 100, device=device)  # blocks of 32 keys (fp32): keys 0..63 seen whole by every row
    got = kernel.attention_stats(q, k, q_pos, p=p)
    check_against_reference(got, ref.attention_stats(q, k, q_pos, p=p), q, k, q_pos, p, torch.float32)
    if p == 0.0:
        assert int(got.below.sum()) == 0
    else:
        assert int(got.below[:, :64].sum()) > 0  # the whole blocks hold entries below the cut


@triton.jit
def _count_below_each(E, Out, p, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Out + offs, stats_kernel._count_below(tl.zeros([N], tl.int32), tl.load(E + offs), p))


def test_count_below_on_the_bits_is_a_float_compare(device):
    """_count_below's integer compare of the floats' bits against a float
    compare, for every threshold the launcher passes on its edges (0, the
    smallest denormal, the smallest normal, 1) and probabilities around
    each: zero, denormals, one ulp either side of p, 1 (the value of rows
    that are not real, never below even at p = 1), past 1 and +inf."""
    ps = [0.0, 1e-45, 1e-40, 1.17549435e-38, 0.01, 0.5, 0.99999994, 1.0]
    for p in ps:
        pt = torch.tensor(p, dtype=torch.float32)
        near = [torch.nextafter(pt, torch.tensor(-1.0)), pt, torch.nextafter(pt, torch.tensor(2.0))]
        e = torch.tensor([0.0, 1e-45, 1e-40, 1.1754942e-38, 1e-30, 0.99999994, 1.0, 1.0000001, 3e38,
                          float("inf")] + [float(x) for x in near], dtype=torch.float32)
        e = e[e >= 0]
        e = torch.cat([e, torch.zeros(32 - e.numel())]).to(device)
        out = torch.empty(32, dtype=torch.int32, device=device)
        _count_below_each[(1,)](e, out, float(pt), N=32)
        assert torch.equal(out.cpu(), (e.cpu() < pt).to(torch.int32)), f"p={p}"


def test_column_pass_passes_a_negative_zero_threshold_as_zero(device, monkeypatch):
    """The kernel compares the threshold's bits, and -0.0's would count
    every entry: the launcher passes +0.0 (Triton's interpreter turns a
    kernel's -0.0 into 0.0 itself, so the kernel's own result cannot show
    this off a GPU)."""
    names = stats_kernel._column_stats_kernel.arg_names
    passed = {}

    class Launch:
        def __getitem__(self, grid):
            def run(*args, **meta):
                passed.update(zip(names, args))
            return run

    monkeypatch.setattr(stats_kernel, "_column_stats_kernel", Launch())
    q, k = make(2, 1, 40, 3, 64, torch.float32, device)
    q_pos = torch.arange(37, 40, device=device)
    row_max, row_sumexp = torch.zeros(2, 3, device=device), torch.ones(2, 3, device=device)
    stats_kernel.column_stats(q, k, q_pos, row_max, row_sumexp, -0.0)
    assert passed["threshold"] == 0.0 and math.copysign(1.0, passed["threshold"]) == 1.0


@triton.jit
def _block_rows_each(QPos, Out, n_rows, n_keys, min_pos, max_pos, BLOCK_N: tl.constexpr,
                     BOUND_ROWS: tl.constexpr):
    first_key = tl.program_id(0) * BLOCK_N
    seen, partial_end = stats_kernel._block_rows(QPos, 1, n_rows, first_key,
                                                 tl.minimum(first_key + BLOCK_N, n_keys) - 1, min_pos, max_pos,
                                                 BOUND_ROWS)
    tl.store(Out + 2 * tl.program_id(0), seen)
    tl.store(Out + 2 * tl.program_id(0) + 1, partial_end)


def spread_rows(order, n, r, seed=0):
    """r rows spread over a prompt of n keys (ZipVL's probe rows: a few
    recent, the rest drawn from before them), in position order, reversed,
    or shuffled with some repeated; "middle": in position order within the
    middle half of the prompt (key blocks before and after every row)."""
    if order == "middle":
        return n // 4 + kernel.probe_rows(n // 2, recent=r // 8, random=r - r // 8, seed=seed)
    pos = kernel.probe_rows(n, recent=r // 8, random=r - r // 8, seed=seed)
    if order == "reversed":
        return pos.flip(0)
    if order == "shuffled":
        g = torch.Generator().manual_seed(seed)
        pos = pos[torch.randperm(r, generator=g)]
        pos[: r // 10] = pos[r // 2: r // 2 + r // 10]  # duplicates
        return pos
    return pos


@pytest.mark.parametrize("order", ["sorted", "reversed", "shuffled", "middle"])
def test_block_rows_bound_each_key_block(order, device):
    """_block_rows over more rows than one scan holds (BOUND_ROWS): the rows
    before `seen` see no key of the block and those from `partial_end` on
    see all of it, the longest such prefix and suffix in any order; in
    position order the rows between are exactly those whose positions fall
    inside the block (the rest are skipped or run unmasked)."""
    n, r, block_n, bound = 400, 150, 16, 64
    pos = spread_rows(order, n, r, seed=3)
    blocks = -(-n // block_n)
    out = torch.empty(2 * blocks, dtype=torch.int32, device=device)
    _block_rows_each[(blocks,)](pos.to(device), out, r, n, int(pos.min()), int(pos.max()), BLOCK_N=block_n,
                                BOUND_ROWS=bound)
    bounds = out.view(blocks, 2).cpu().tolist()
    rows = pos.tolist()
    for b, (seen, partial_end) in enumerate(bounds):
        first, last = b * block_n, min((b + 1) * block_n, n) - 1
        assert all(p < first for p in rows[:seen]) and all(p >= last for p in rows[partial_end:]), b
        # the longest such prefix and suffix (all rows whole before the
        # smallest position, none after the largest: no scan)
        want_seen = 0 if last <= min(rows) else next((i for i, p in enumerate(rows) if p >= first), r)
        want_end = max(want_seen, max((i + 1 for i, p in enumerate(rows) if p < last), default=0))
        if first > max(rows):
            want_end = want_seen = r
        assert (seen, partial_end) == (want_seen, want_end), b
        if order in ("sorted", "middle"):
            assert list(range(seen, partial_end)) == [i for i, p in enumerate(rows) if first <= p < last], b
    if order != "reversed":
        assert sum(seen for seen, _ in bounds) > 0 and sum(r - end for _, end in bounds) > 0
    if order == "middle":  # blocks before every row and after every row take no scan
        assert bounds[0] == [0, 0] and bounds[-1] == [r, r]


def test_model_counts_the_row_tiles_the_column_pass_runs(device):
    """The op's model (what the estimate charges each key block: unmasked
    and masked row tiles, scans of the positions) against the bounds the
    kernel computes, over rows spread as ZipVL's probe rows are. The tiles
    follow from the bounds as the kernel's loops take them (the masked rows
    rounded up to whole tiles); that step is the model's formula restated."""
    from kernels_py.ops.attention_stats import model

    n, r, block_n, per_tile = 400, 150, 16, 8
    pos = kernel.probe_rows(n, recent=20, random=r - 20, seed=3)
    blocks = -(-n // block_n)
    out = torch.empty(2 * blocks, dtype=torch.int32, device=device)
    _block_rows_each[(blocks,)](pos.to(device), out, r, n, int(pos.min()), int(pos.max()), BLOCK_N=block_n,
                                BOUND_ROWS=stats_kernel.BOUND_ROWS)
    want = []
    for seen, partial_end in out.view(blocks, 2).cpu().tolist():
        whole = seen + -(-(partial_end - seen) // per_tile) * per_tile
        scans = 0 if (seen, partial_end) in ((0, 0), (r, r)) else -(-r // stats_kernel.BOUND_ROWS)
        want.append((-(-max(0, r - whole) // per_tile), (whole - seen) // per_tile, scans))
    got = model._column_trips(tuple(pos.tolist()), n, block_n, per_tile)
    assert got == want
    # a block masks the tiles its own rows fall in (about 5 rows a block here), and skips the rows before them
    assert max(t[1] for t in got) <= 2
    assert sum(t[0] + t[1] for t in got) < 0.7 * blocks * -(-r // per_tile)


@pytest.mark.parametrize("order", ["sorted", "reversed", "shuffled", "middle"])
def test_column_pass_over_spread_rows(order, device, monkeypatch):
    """Rows spread over the prompt, more than one bounds scan, with small
    tiles: key blocks skip the rows before any that sees them and run
    unmasked after the last that sees only part of them, in position order
    or not, and agree with the reference. The outputs start as garbage
    (the launcher does not fill them), so a key left unwritten shows."""
    empty = torch.empty

    def garbage(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan") if t.dtype.is_floating_point else -7)

    q_pos = spread_rows(order, 300, 140, seed=1).to(device)
    q, k = make(4, 2, 300, 140, 16, torch.float16, device, seed=1)
    monkeypatch.setattr(torch, "empty", garbage)
    got = kernel.attention_stats(q, k, q_pos, block_m=16, block_n=16, key_splits=2)
    monkeypatch.undo()
    check_against_reference(got, ref.attention_stats(q, k, q_pos), q, k, q_pos, 0.01, torch.float16)


def test_column_pass_counts_packed_or_not(device, monkeypatch):
    """Up to PACKED_COUNTS_MAX rows of 16-bit inputs the column pass sums
    two keys' counts in one int32 word, past it one each: the same counts
    either way (both halves holding sums of many rows), and the
    reference's."""
    q_pos = spread_rows("sorted", 300, 140, seed=3).to(device)
    q, k = make(4, 2, 300, 140, 16, torch.float16, device, seed=3)
    packed = kernel.attention_stats(q, k, q_pos, block_m=16, block_n=16)
    monkeypatch.setattr(stats_kernel, "PACKED_COUNTS_MAX", 0)
    plain = kernel.attention_stats(q, k, q_pos, block_m=16, block_n=16)
    assert torch.equal(packed.below, plain.below)
    assert int(packed.below[:, 0::2].max()) > 1 and int(packed.below[:, 1::2].max()) > 1
    check_against_reference(packed, ref.attention_stats(q, k, q_pos), q, k, q_pos, 0.01, torch.float16)


@pytest.mark.parametrize("p,scale", [(0.1, None), (0.002, 0.05), (0.0, None)])
def test_threshold_and_scale(p, scale, device):
    q, k = make(4, 2, 100, 9, 64, torch.float32, device, seed=1)
    q_pos = kernel.probe_rows(100, recent=4, random=5, seed=1).to(device)
    got = kernel.attention_stats(q, k, q_pos, p=p, scale=scale)
    check_against_reference(got, ref.attention_stats(q, k, q_pos, p=p, scale=scale), q, k, q_pos, p,
                            torch.float32, scale)
    if p == 0.0:
        assert int(got.below.sum()) == 0  # nothing is below zero


@pytest.mark.parametrize("first", [70, 88], ids=["4 whole tiles", "5 whole tiles"])
def test_row_pass_with_and_without_the_mma_overlap(first, device, monkeypatch):
    """The row pass issuing each tile's scores before the previous tile's
    softmax (16-bit inputs on sm_90, and the interpreter's default) and not
    (sm_80; float32 inputs, which the other tests run) takes the
    same steps in the same order, so the same m and l bit for bit, over even
    and odd counts of whole tiles, split or not, and both equal the
    reference's."""
    from kernels_py.ops import common

    if torch.device(device).type == "cuda":
        pytest.skip("a GPU takes the path of its own architecture")
    q, k = make(4, 2, 100, 12, 32, torch.float16, device, seed=6)
    q_pos = torch.arange(first, first + 12, device=device)
    want = ref.attention_stats(q, k, q_pos)
    for splits in (1, 2):
        assert stats_kernel.overlap_mma(device, q.dtype) and not stats_kernel.overlap_mma(device, torch.float32)
        m, l = kernel.row_stats(q, k, q_pos, block_n=16, key_splits=splits)
        monkeypatch.setattr(common, "_compile_target", 80)
        assert not stats_kernel.overlap_mma(device, q.dtype)
        m80, l80 = kernel.row_stats(q, k, q_pos, block_n=16, key_splits=splits)
        monkeypatch.undo()
        assert torch.equal(m, m80) and torch.equal(l, l80)
        torch.testing.assert_close(m, want.row_max, atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(l, want.row_sumexp, atol=1e-3, rtol=1e-3)


def test_stages_compose(device):
    """The two passes by hand: the row pass split over the keys (merged) equals
    it unsplit, and the column pass on its output is the whole call."""
    q, k = make(4, 1, 100, 20, 64, torch.float16, device, seed=2)
    q_pos = kernel.probe_rows(100, recent=10, random=10, seed=2).to(device)
    want = ref.attention_stats(q, k, q_pos)
    m, l = kernel.row_stats(q, k, q_pos, key_splits=1)
    for splits in (2, 3, 7):  # 7 splits of 16 keys: the last ones see no key
        m_s, l_s = kernel.row_stats(q, k, q_pos, block_n=16, key_splits=splits)
        torch.testing.assert_close(m_s, m, atol=1e-5, rtol=1e-6)  # a max of the same scores
        torch.testing.assert_close(l_s, l, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m, want.row_max, atol=1e-3, rtol=1e-3)
    cols = kernel.column_stats(q, k, q_pos, m, l, 0.01)
    assert cols.attn_sum.shape == cols.below.shape == cols.nonzero.shape == (4, 100)
    assert cols.attn_sum_kv.shape == (1, 100)
    torch.testing.assert_close(cols.attn_sum, want.attn_sum, atol=1e-3, rtol=1e-3)
    assert torch.equal(cols.nonzero, want.nonzero)
    whole = kernel.attention_stats(q, k, q_pos, key_splits=1)
    assert torch.equal(whole.row_max, m) and torch.equal(whole.row_sumexp, l)
    assert torch.equal(whole.attn_sum, cols.attn_sum) and torch.equal(whole.below, cols.below)


def test_column_pass_on_a_prefills_lse_gives_the_sums_not_the_counts(device):
    """A prefill's log-sum-exp as the row maximum (sums of 1) gives each key's attention sums, which need only
    the normalizer; the ThresholdFilter's counts need the row's true maximum, which FlashAttention does not
    return (ops README, attention_stats)."""
    q, k = make(4, 2, 100, 20, 64, torch.float16, device, seed=3)
    q_pos = torch.arange(80, 100, device=device)
    want = ref.attention_stats(q, k, q_pos, 0.05)
    lse = want.row_lse()
    cols = kernel.column_stats(q, k, q_pos, lse * math.log2(math.e), torch.ones_like(lse), 0.05)
    torch.testing.assert_close(cols.attn_sum, want.attn_sum, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(cols.attn_sum_kv, want.attn_sum_kv, atol=1e-3, rtol=1e-3)
    assert torch.equal(cols.nonzero, want.nonzero)
    assert (cols.below >= want.below).all() and (cols.below > want.below).any()  # a cut below p, not p * max


@pytest.mark.parametrize("heads,kv_heads,block_m", [(4, 1, 16), (8, 1, 16), (32, 1, 16), (6, 2, 64)])
def test_group_wider_than_the_tile(heads, kv_heads, block_m, device):
    """A group padded past block_m (one row per tile, the tile as wide as the
    group), or a group that is not a power of two."""
    q, k = make(heads, kv_heads, 40, 6, 16, torch.float32, device, seed=5)
    q_pos = kernel.recent_rows(40, 6).to(device)
    got = kernel.attention_stats(q, k, q_pos, block_m=block_m, key_splits=2)
    check_against_reference(got, ref.attention_stats(q, k, q_pos), q, k, q_pos, 0.01, torch.float32)


def test_deterministic_and_split_independent_counts(device):
    q, k = make(4, 2, 100, 33, 80, torch.float32, device, seed=3)
    q_pos = kernel.recent_rows(100, 33).to(device)
    a = kernel.attention_stats(q, k, q_pos)
    b = kernel.attention_stats(q, k, q_pos)
    for name in ("row_max", "row_sumexp", "attn_sum", "below", "nonzero", "attn_sum_kv"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name  # no atomics: bitwise repeatable
    c = kernel.attention_stats(q, k, q_pos, block_n=32, block_m=16, key_splits=2)
    assert torch.equal(a.below, c.below) and torch.equal(a.nonzero, c.nonzero)
    torch.testing.assert_close(a.attn_sum, c.attn_sum, atol=1e-6, rtol=1e-5)


def test_strided_inputs(device):
    """Non-contiguous q, k and q_pos go through their strides."""
    q, k = make(4, 2, 100, 9, 64, torch.float32, device, seed=4)
    q_pos = kernel.probe_rows(100, recent=4, random=5, seed=4).to(device)
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)
    k_wide = torch.zeros(2, 100, 128, device=device)
    k_wide[..., :64] = k
    k_s = k_wide[..., :64]
    pos_s = torch.stack([q_pos, torch.zeros_like(q_pos)], dim=1)[:, 0]
    assert not (q_t.is_contiguous() or k_s.is_contiguous() or pos_s.is_contiguous())
    got = kernel.attention_stats(q_t, k_s, pos_s)
    want = kernel.attention_stats(q, k, q_pos)
    for name in ("row_max", "row_sumexp", "attn_sum", "below", "nonzero", "attn_sum_kv"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-6, rtol=1e-6)
    check_against_reference(got, ref.attention_stats(q, k, q_pos), q, k, q_pos, 0.01, torch.float32)


def _hand_case(device):
    """Head 0: every row has the same query and key j scores log w_j with
    w = (1, 1, 0.001, 0.5); head 1: all scores 0 (uniform rows). Rows 0..3."""
    w = torch.tensor([1.0, 1.0, 0.001, 0.5])
    k = torch.zeros(1, 4, 16)
    k[0, :, 0] = torch.log(w)
    q = torch.zeros(2, 4, 16)
    q[0, :, 0] = 1.0
    return q.to(device), k.to(device), torch.arange(4, device=device), w


@pytest.mark.parametrize("impl", ["kernel", "ref"])
def test_sparsity_hand_computed(impl, device):
    q, k, q_pos, w = _hand_case(device)
    stats = (kernel if impl == "kernel" else ref).attention_stats(q, k, q_pos, p=0.01, scale=1.0)
    # Head 0: row 2 sees (1, 1, .001) and row 3 sees (1, 1, .001, .5); .001 < 0.01 * 1 in
    # both, nothing else is below. Causal entries: 1 + 2 + 3 + 4 = 10. Head 1 is uniform.
    assert stats.below.tolist() == [[0, 0, 2, 0], [0, 0, 0, 0]]
    assert stats.nonzero.tolist() == [[4, 3, 2, 1], [4, 3, 2, 1]]
    assert stats.sparsity().tolist() == pytest.approx([0.2, 0.0])
    assert float(stats.sparsity(per_head=False)) == pytest.approx(0.1)
    want0 = torch.zeros(4)
    for row in range(4):
        want0[: row + 1] += w[: row + 1] / w[: row + 1].sum()
    want1 = torch.tensor([1 + 1 / 2 + 1 / 3 + 1 / 4, 1 / 2 + 1 / 3 + 1 / 4, 1 / 3 + 1 / 4, 1 / 4])
    torch.testing.assert_close(stats.attn_sum.cpu(), torch.stack([want0, want1]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.attn_sum_kv.cpu(), (want0 + want1)[None], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.normalized().cpu(), torch.stack([want0, want1]) / torch.tensor([4.0, 3, 2, 1]))
    # Row max in log2 units: head 0's max score is log 1 = 0; row sums of exp are sum(w).
    torch.testing.assert_close(stats.row_max.cpu(), torch.zeros(2, 4), atol=1e-6, rtol=0)
    sums = torch.stack([torch.cumsum(w, 0), torch.arange(1.0, 5.0)])
    torch.testing.assert_close(stats.row_sumexp.cpu(), sums, atol=1e-5, rtol=1e-5)


def test_sparsity_helper_alone():
    z = torch.zeros(2, 3)
    stats = kernel.AttentionStats(
        row_max=z, row_sumexp=z, attn_sum=torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]]),
        below=torch.tensor([[2, 1, 0], [0, 0, 0]], dtype=torch.int32),
        nonzero=torch.tensor([[3, 2, 0], [3, 2, 0]], dtype=torch.int32),
        attn_sum_kv=z[:1], p=0.01)
    # Head 0: 3 of 5 causal entries below the cut; head 1: none.
    assert stats.sparsity().tolist() == pytest.approx([0.6, 0.0])
    assert float(stats.sparsity(per_head=False)) == pytest.approx(0.3)
    # A key no row sees normalizes to 0, not NaN.
    torch.testing.assert_close(stats.normalized(), torch.tensor([[1 / 3, 1.0, 0.0], [0.0, 0.0, 0.0]]))


# ---------------------------------------------------------------------------
# Row selectors
# ---------------------------------------------------------------------------


def _well_formed(rows, n):
    assert rows.dtype == torch.int64 and rows.dim() == 1
    assert torch.all(rows[1:] > rows[:-1])  # sorted, no duplicates
    assert int(rows.min()) >= 0 and int(rows.max()) < n


def test_probe_rows():
    rows = kernel.probe_rows(1000, seed=3)
    _well_formed(rows, 1000)
    assert rows.numel() == 128
    assert torch.equal(rows[-64:], torch.arange(936, 1000))  # the 64 most recent
    assert int(rows[:64].max()) < 936  # and 64 earlier ones
    assert torch.equal(rows, kernel.probe_rows(1000, seed=3))  # the seed fixes them
    assert not torch.equal(rows, kernel.probe_rows(1000, seed=4))
    assert torch.equal(kernel.probe_rows(100), torch.arange(100))  # 64 recent + all 36 earlier
    assert torch.equal(kernel.probe_rows(10), torch.arange(10))  # clipped to n
    few = kernel.probe_rows(200, recent=0, random=5, seed=1)
    _well_formed(few, 200)
    assert few.numel() == 5
    assert torch.equal(kernel.probe_rows(50, recent=3, random=0), torch.tensor([47, 48, 49]))


def test_other_selectors():
    assert kernel.recent_rows(10, 4).tolist() == [6, 7, 8, 9]
    assert kernel.recent_rows(3, 8).tolist() == [0, 1, 2]
    assert kernel.last_row(7).tolist() == [6]
    assert kernel.all_rows(5).tolist() == [0, 1, 2, 3, 4]
    assert kernel.post_vision_rows(12, 15).tolist() == [12, 13, 14]
    assert kernel.post_vision_rows([(2, 5), (8, 12)], 15).tolist() == [12, 13, 14]
    spans = Spans((0, 4), ((4, 10), (10, 16)), (16, 20))
    assert kernel.post_vision_rows(spans, spans.prompt_tokens).tolist() == [16, 17, 18, 19]
    for rows in (kernel.recent_rows(10, 4), kernel.last_row(7), kernel.all_rows(5), kernel.post_vision_rows(spans, 20)):
        assert rows.dtype == torch.int64


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: kernel.all_rows(0), "positive int"),
        (lambda: kernel.last_row(-1), "positive int"),
        (lambda: kernel.recent_rows(10, 0), "window"),
        (lambda: kernel.probe_rows(10, recent=-1), "recent"),
        (lambda: kernel.post_vision_rows(15, 15), "no post-vision rows"),
        (lambda: kernel.post_vision_rows([(2, 20)], 15), "no post-vision rows"),
        (lambda: kernel.post_vision_rows([], 15), "no visual spans"),
    ],
)
def test_selector_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------


def _good(device):
    q = torch.zeros(2, 4, 64, device=device)
    k = torch.zeros(2, 8, 64, device=device)
    return q, k, torch.arange(4, 8, device=device)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda q, k, pos: (q[0], k, pos), ValueError, "3-D"),
        (lambda q, k, pos: (q.int(), k.int(), pos), TypeError, "dtype"),
        (lambda q, k, pos: (q, k.half(), pos), TypeError, "must match"),
        (lambda q, k, pos: (q, k[..., :32], pos), ValueError, "head_dim differs"),
        (lambda q, k, pos: (torch.zeros(2, 4, 512), torch.zeros(2, 8, 512), pos.cpu()), ValueError, "head_dim must"),
        (lambda q, k, pos: (torch.cat([q, q[:1]]), k, pos), ValueError, "multiple"),
        (lambda q, k, pos: (q, k, pos.tolist()), TypeError, "tensor of positions"),
        (lambda q, k, pos: (q, k, pos.float()), TypeError, "int32 or torch.int64"),
        (lambda q, k, pos: (q, k, pos[:3]), ValueError, "one position per query row"),
        (lambda q, k, pos: (q, k, pos[None]), ValueError, "one position per query row"),
        (lambda q, k, pos: (q, k, pos + 1), ValueError, r"\[0, 8\)"),
        (lambda q, k, pos: (q, k, pos - 5), ValueError, r"\[0, 8\)"),
    ],
)
@pytest.mark.parametrize("impl", ["kernel", "ref"])
def test_bad_inputs(change, error, match, impl, device):
    """The reference checks what the kernel checks: compute(backend='auto')
    runs it on CPU tensors, where a position past the keys or a k of
    another dtype would otherwise give statistics without an error."""
    q, k, pos = change(*_good(device))
    if impl == "ref" and match == "head_dim must":  # the kernels' widest head; the reference takes any
        assert ref.attention_stats(q, k, pos).attn_sum.shape == (2, 8)
        return
    with pytest.raises(error, match=match):
        (kernel if impl == "kernel" else ref).attention_stats(q, k, pos)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"p": 1.5}, "p must lie"),
        ({"p": math.nan}, "p must lie"),
        ({"scale": -1.0}, "scale"),
        ({"block_m": 8}, "power of two"),
        ({"block_n": 48}, "power of two"),
        ({"key_splits": 0}, "key_splits must be a positive int"),
        ({"key_splits": 2.0}, "key_splits must be a positive int"),
    ],
)
def test_bad_options(kwargs, match, device):
    q, k, pos = _good(device)
    with pytest.raises(ValueError, match=match):
        kernel.attention_stats(q, k, pos, **kwargs)
    if not {"block_m", "block_n", "key_splits"} & set(kwargs):  # the reference has no tiles
        with pytest.raises(ValueError, match=match):
            ref.attention_stats(q, k, pos, **kwargs)


def test_known_positions_skip_the_host_sync(device, monkeypatch):
    """pos_range (the caller's smallest and largest position) gives the
    same statistics without reading q_pos on the host; a range outside the
    keys or not a pair of ints is refused."""
    q, k = make(4, 2, 100, 20, 64, torch.float32, device, seed=4)
    q_pos = kernel.recent_rows(100, 20).to(device)
    want = kernel.attention_stats(q, k, q_pos, key_splits=2)
    monkeypatch.setattr(torch, "aminmax", lambda *a, **kw: pytest.fail("q_pos read on the host"))
    got = kernel.attention_stats(q, k, q_pos, key_splits=2, pos_range=(80, 99))
    for name in ("row_max", "row_sumexp", "attn_sum", "below", "nonzero", "attn_sum_kv"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    with pytest.raises(ValueError, match=r"pos_range must lie in \[0, 100\)"):
        kernel.attention_stats(q, k, q_pos, pos_range=(80, 100))
    with pytest.raises(TypeError, match="pos_range must be a"):
        kernel.attention_stats(q, k, q_pos, pos_range=[80, 99])
    # The reference takes it too: compute(backend="torch") on a GPU, as Prompt.stats calls it, reads no positions.
    got = kernel.compute(q, k, q_pos, backend="torch", pos_range=(80, 99))
    assert torch.allclose(got.attn_sum, want.attn_sum, atol=1e-5) and torch.equal(got.nonzero, want.nonzero)


def test_bad_stage_inputs(device):
    q, k, pos = _good(device)
    m, l = kernel.row_stats(q, k, pos)
    with pytest.raises(ValueError, match="row_max must be float32"):
        kernel.column_stats(q, k, pos, m[:, :3], l)
    with pytest.raises(ValueError, match="row_sumexp must be float32"):
        kernel.column_stats(q, k, pos, m, l.double())


@pytest.mark.parametrize("keys", [8, 0])
@pytest.mark.parametrize("impl", ["kernel", "ref"])
def test_no_rows(impl, keys, device):
    # With no keys either, the reference's row max failed (amax over an empty dimension).
    q, k, _ = _good(device)
    stats = (kernel if impl == "kernel" else ref).attention_stats(q[:, :0], k[:, :keys],
                                                                 torch.zeros(0, dtype=torch.int64, device=device))
    assert stats.row_max.shape == stats.row_sumexp.shape == (2, 0)
    for name in ("attn_sum", "below", "nonzero", "attn_sum_kv"):
        assert getattr(stats, name).shape == (2, keys) and not getattr(stats, name).any(), name
