"""Fused decompress + split-K flash-decoding over a low-rank KV cache
(AttentionPack), and its launchers. What is computed is in contract.py.

`lowrank_decode` rebuilds key tiles from U_k and W_k in SRAM (rotating them
when rope_base is set) and attends with split-K flash-decoding; values are
never rebuilt: each split's sum_t p_t U_v[t] stays in rank space and the
merge maps it by W_v once per sequence, which is exact. `lowrank_decode_absorbed` attends
entirely in rank space (q~ = q W_k^T against U_k), which is only exact for
keys decomposed after RoPE; its programs hold every query head of a sequence,
so U is read once for all heads. What each compiles to on sm_80/sm_90:
`workbench kernels report`; the bytes and FLOPs a step must move: model.py;
why the fused kernel was slow on sm_90, line by line:
notes/lowrank-decode-sm90.md in the design notes.

Reference: reference.py beside this file.
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels_py.ops import common, splitk
from kernels_py.ops.splitk import _merge_weights, _merged_lse, _online_softmax, _store_split
from kernels_py.runtime import interpreter_mode
from kernels_py.ops.lowrank_decode.contract import CompressedKV, DecodeOutput, DenseKV, check_inputs

# ----------------------------------------------------------------------------
# Triton kernels: split-K flash-decoding over the two segments
# ----------------------------------------------------------------------------
#
# Stage 1, the compressed segment: one program per (sequence, split), owning
# every query row of the sequence: H_q query heads times M query tokens,
# folded into BLOCK_ROWS rows (padded to a power of two >= 16 for tl.dot),
# FlashMLA's all-heads-as-MMA-rows. U is shared by all kv heads, so each U
# tile is read once for all of them, 16 bytes wide (masked by token and by
# rank rounded up to 16 columns). `_stage1_kernel` applies each token's own
# rank prefix in registers; `_stage1_absorbed_kernel` feeds its tiles to the
# MMAs as loaded and takes the tokens that leaves inexact in a second loop
# (_whole_chunks). `_stage1_kernel` rebuilds each kv head's
# keys of a tile from U_k (exact, RoPE after the rebuild) and writes the
# scaled logits (log2 units, -inf where masked) for the masses;
# `_stage1_absorbed_kernel` scores in rank space against q~, which
# `_rank_query` makes once per sequence (in `_query_dense_kernel`, with the
# dense segment, launched first). A split is a contiguous
# range of the compressed tokens; an online softmax (base 2) keeps the
# running max, sum and sum_t p_t U_v[t] (rank space), stored normalised
# with the split's log2-sum-exp.
# The dense segment: `_dense_attend`, grouped decode per (sequence, kv
# head), its logits stored for the masses; the absorbed call attends it in
# `_query_dense_kernel` (after making q~) and stores its partial in one more
# slot, the fused call in its merge's programs (one launch fewer). Apart
# from stage 1, so the compressed segment's kernels keep their registers (a
# dense loop inside them put both at 255 and one CTA per SM).
# Stage 2: `_merge_rank_kernel` merges the partials of each query row, maps
# the rank-space sum by the row's W_v once and writes the output and the
# natural-log LSE; `_mass_kernel` turns the stored logits into each token's
# attention weight exp(logit - lse), averaged over heads and queries, and
# `_mass_rank_kernel` recomputes the absorbed kernel's compressed tokens'
# scores in rank space instead (stage 1 stores no logit of theirs) and
# takes its dense tokens' stored logits in the same launch.
#
# Dot operand dtypes: the loads are cast to constexpr dtypes chosen by the
# launcher (QK_DT for q against keys and p against values, UW_DT for U
# against W), each the inputs' 16-bit dtype where they agree, else float32;
# accumulation is always float32. Rebuilt keys/values are float32 and are
# rounded to QK_DT only as tl.dot operands, as a 16-bit KV cache would be.

MAX_HEAD_DIM = 256
MAX_ROWS = 128  # query heads x query tokens, one program's rows
MAX_SPLITS = 256
# Splits whose partials a merge program loads at once (_splits_lse): one
# split at a time, the rank-space merge waited on each split's loads in turn
# (at batch 8 by the estimate, 10.6 and 12.7 us against 8.1 and 7.5 for the
# fused and absorbed calls' merges; 4 spilled). Float32 factors keep the
# loop a split at a time: loading two, their merge spilled beside a float32
# cache's dense segment.
MERGE_SPLITS = 2
# Default split size (num_splits=None) on the interpreter; on a GPU the count
# is chosen by waves (split_count). A split's fixed cost (its first tile's
# loads waited at HBM latency, its rank-space partial) is paid once per
# split, so splits are long while the grid still fills the GPU.
TOKENS_PER_SPLIT = 1024
DEFAULT_MAX_SPLITS = 128
# On a GPU the split count is chosen by waves (split_count): tiles of the
# largest BLOCK_N, stage-1 programs an SM as the kernel's picked configs
# hold them (the absorbed kernel's two, the fused kernel's one: two waves of
# one pay a split's fixed cost twice, where one wave of splits twice as long
# pays it once), and a split's fixed cost of about a tile.
SPLIT_TILE = 128
SPLIT_PROGRAMS_PER_SM = {"fused": 1, "absorbed": 2}
SPLIT_COST_TILES = 1
MAX_BLOCK_R = 64  # default rank chunk of the key rebuild; larger ranks loop over chunks
# Values stay in rank space, so a program holds a whole U_v row (and in the
# absorbed kernel a whole U_k row): ranks up to this.
MAX_RANK_SPACE = 256
# The absorbed kernel's W_k tile [rank, head_dim] of float32 factors fits a
# block's shared memory up to 256 x 128 (139264 bytes with the rest, sm_80
# and sm_90); 256 x 256 needs 278528.
MAX_FLOAT32_WK_TILE = 256 * 128
INTERPRET_BLOCK_N = 32  # fixed tile under the interpreter (no autotuning there)
DENSE_BLOCK_N = 32  # tokens per tile of the dense segment (both calls)
# The dense segment over a 16-bit cache (both calls): 64 tokens a tile on 4
# warps (148 registers at head_dim 128 in _query_dense_kernel, 115 when it
# stores no logits; the fused call's merge takes the same tile), so a
# window of 64 recent tokens is one tile and one wait on HBM, not two.
DENSE_TILE = dict(BLOCK_N=64, num_warps=4, num_stages=3)
MERGE_ROWS = 32  # query rows of one kv head a merge program takes at most (their sums and outputs in registers)
MERGE_RANK_CHUNK = 64  # columns of the rank-space sums the merge maps by W_v at a time,
MERGE_RANK_CHUNK_F32 = 32  # with float32 factors, both calls (64 spilled beside a float32 cache's dense segment)
# The fused call's masses: columns of stored logits per program, read for
# MASS_BLOCK_R rows at a time (16-bit logits; float32 ones take half as many
# rows, the same bytes in flight): 16 KB a load keeps the kernel near its
# memory floor (at 256 columns the programs' fixed work set the time; 1,024
# spilled where a token's rows are not 16-byte aligned and load one by one).
MASS_BLOCK_T = 512
MASS_BLOCK_R = 16
# The absorbed call's dense columns in _mass_rank_kernel (a 64-token window
# is one program a sequence; wider blocks would only raise its registers).
MASS_DENSE_BLOCK_T = 256
MASS_DENSE_BLOCK_R = 16
MASS_SPAN = 512  # compressed columns per rank-space mass program at least (mass_span), in mass_rank_tile's tiles
MASS_PROGRAMS_PER_SM = 2  # rank-space mass programs an SM holds (216 registers on 4 warps)


@triton.jit
def _all_query_rows(N_QUERIES: tl.constexpr, GROUP: tl.constexpr, N_ROWS: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Rows of a program that holds every query head: row r is query token
    r % M of query head r // M, which reads kv head (r // M) // GROUP."""
    offs_row = tl.arange(0, BLOCK_ROWS)
    row_mask = offs_row < N_ROWS
    head = offs_row // N_QUERIES
    return head, offs_row % N_QUERIES, head // GROUP, row_mask


@triton.jit
def _split_range(c_len, d_len, split, n_splits, BLOCK_N: tl.constexpr):
    """This split's slice of [compressed tokens, dense tokens], as a compressed
    range [c_lo, c_hi) and a dense range [d_lo, d_hi). Split sizes are rounded
    up to whole tiles so compressed tiles start aligned."""
    total = c_len + d_len
    per_split = tl.cdiv(tl.cdiv(total, n_splits), BLOCK_N) * BLOCK_N
    lo = tl.minimum(split * per_split, total)
    hi = tl.minimum(lo + per_split, total)
    c_lo = tl.minimum(lo, c_len)
    c_hi = tl.minimum(hi, c_len)
    d_lo = tl.maximum(lo, c_len) - c_len
    d_hi = tl.maximum(hi, c_len) - c_len
    return c_lo, c_hi, d_lo, d_hi


@triton.jit
def _mask(s, tok_pos, tok_mask, q_pos, row_mask):
    """Set entries a row may not see (padding, or a token after the query's
    position) to -inf."""
    visible = (tok_pos[None, :] <= q_pos[:, None]) & tok_mask[None, :] & row_mask[:, None]
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _mask_and_store(s, Logits_rows, offs_col, stride_ln, tok_pos, tok_mask, q_pos, row_mask):
    """_mask, and write the tile's logits for the masses."""
    s = _mask(s, tok_pos, tok_mask, q_pos, row_mask)
    tl.store(Logits_rows + offs_col[None, :] * stride_ln, s, mask=row_mask[:, None] & tok_mask[None, :])
    return s


@triton.jit
def _load_u(UK_b, offs_n, rank, r0, stride_un, stride_ur, BLOCK_R: tl.constexpr, UW_DT: tl.constexpr):
    """U columns [r0, r0 + BLOCK_R) of a tile: [BLOCK_N, BLOCK_R]. Token t
    keeps the columns < rank[t] (its rank prefix); padding has rank 0."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    return tl.load(UK_b + offs_n[:, None] * stride_un + offs_r[None, :] * stride_ur,
                   mask=offs_r[None, :] < rank[:, None], other=0.0).to(UW_DT)


@triton.jit
def _load_wk(WK_col, r0, offs_h, h_mask, n_rank, stride_wr, stride_wc,
             HALF: tl.constexpr, BLOCK_R: tl.constexpr, UW_DT: tl.constexpr):
    """Rows [r0, r0 + BLOCK_R) of this kv head's W_k in RoPE's two halves
    (channels [0, D/2) and [D/2, D)): two [BLOCK_R, BLOCK_HALF]."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    ptrs = WK_col + offs_r[:, None] * stride_wr + offs_h[None, :] * stride_wc
    mask = (offs_r[:, None] < n_rank) & h_mask[None, :]
    w_lo = tl.load(ptrs, mask=mask, other=0.0).to(UW_DT)
    w_hi = tl.load(ptrs + HALF * stride_wc, mask=mask, other=0.0).to(UW_DT)
    return w_lo, w_hi


@triton.jit
def _sin_half_pi(x):
    """sin(x) for |x| <= pi / 2: the Taylor polynomial to x^11 (error below
    6e-8 there), FMAs only."""
    x2 = x * x
    p = 1.0 - x2 * (1.0 / 110.0)
    p = 1.0 - x2 * (1.0 / 72.0) * p
    p = 1.0 - x2 * (1.0 / 42.0) * p
    p = 1.0 - x2 * (1.0 / 20.0) * p
    p = 1.0 - x2 * (1.0 / 6.0) * p
    return x * p


@triton.jit
def _sincos(angle, ON_GPU: tl.constexpr):
    """sin and cos of angles already reduced to [-pi, pi]. On a GPU, the
    special-function unit (sin.approx / cos.approx, absolute error below
    1e-6 on [-pi, pi], two instructions each); else polynomials, which is
    what the interpreter runs (it has no libdevice). tl.sin / tl.cos lower
    to libdevice's accurate sinf / cosf instead: about 20 instructions each,
    and a reduction for large inputs (a table on the stack) that never runs
    here but is compiled in all the same."""
    if ON_GPU:
        return libdevice.fast_sinf(angle), libdevice.fast_cosf(angle)
    else:
        half_pi = 1.5707963267948966
        pi = 3.141592653589793
        # sin(a) = sin(pi - a): fold [-pi, pi] into [-pi/2, pi/2].
        s_arg = tl.where(angle > half_pi, pi - angle, tl.where(angle < -half_pi, -pi - angle, angle))
        # cos(a) = sin(pi/2 - |a|), and pi/2 - |a| lies in [-pi/2, pi/2].
        c_arg = half_pi - tl.abs(angle)
        return _sin_half_pi(s_arg), _sin_half_pi(c_arg)


# 2 pi in three parts (Cody-Waite): the first two have few significant bits,
# so k * part is exact in float32 for k < 2^15 turns (angles up to ~2e5
# radians) and the reduction adds about 1e-7 radians, where one float32 2 pi
# added k * 1.7e-7.
TWO_PI_1 = tl.constexpr(6.28125)
TWO_PI_2 = tl.constexpr(0.001934051513671875)
TWO_PI_3 = tl.constexpr(1.2556658930407139e-06)


@triton.jit
def _rope_sincos(tok_pos, inv_freq, ON_GPU: tl.constexpr, HOLD_DT: tl.constexpr):
    """sin and cos of the RoPE angles of a tile [BLOCK_N, BLOCK_HALF]: pair
    (i, i + D/2) of token t turns by pos_t * inv_freq[i] (the float32 angle
    is what transformers computes), reduced to [-pi, pi]. The same for every
    kv head, so they are held across the head loop, in HOLD_DT (see _rotate)."""
    angle = tok_pos[:, None].to(tl.float32) * inv_freq[None, :]
    turns = tl.floor(angle * 0.15915494309189535 + 0.5)
    angle = ((angle - turns * TWO_PI_1) - turns * TWO_PI_2) - turns * TWO_PI_3
    sn, cs = _sincos(angle, ON_GPU)
    return sn.to(HOLD_DT), cs.to(HOLD_DT)


@triton.jit
def _rotate(k_lo, k_hi, sin, cos, QK_DT: tl.constexpr, ON_GPU: tl.constexpr):
    """RoPE on a tile's rebuilt keys (float32, in their two halves), returned
    in the dot dtype QK_DT (fp16 keys may come in fp16, from an
    fp16-accumulating rebuild). The sines and cosines are held across the head
    loop as fp16 for 16-bit dots (their error, below 2.5e-4, is under the
    keys' own rounding to 16 bits): half the registers of float32, which
    is what lets the large tiles run without spilling. fp16 keys rotate
    after their rounding, two elements an instruction (one rounding more
    than rotating in float32, within the same tolerance); bf16 and float32
    keys rotate in float32."""
    if QK_DT == tl.float16:
        if k_lo.dtype != tl.float16:
            k_lo = _to_f16(k_lo, ON_GPU)
            k_hi = _to_f16(k_hi, ON_GPU)
        return k_lo * cos - k_hi * sin, k_hi * cos + k_lo * sin
    else:
        c32 = _widen(cos, ON_GPU)
        s32 = _widen(sin, ON_GPU)
        return (k_lo * c32 - k_hi * s32).to(QK_DT), (k_hi * c32 + k_lo * s32).to(QK_DT)


@triton.jit
def _to_f16(x, ON_GPU: tl.constexpr):
    """float32 to fp16, two elements an instruction on a GPU (PTX's
    cvt.rn.f16x2.f32). Triton converts one element at a time and then packs
    the pairs for the fp16x2 arithmetic: three instructions a pair where
    one does."""
    if ON_GPU:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=tl.float16,
                                         is_pure=True, pack=2)
    else:
        return x.to(tl.float16)


@triton.jit
def _widen(x, ON_GPU: tl.constexpr):
    """Held sines or cosines as float32, converted where each kv head uses
    them: a plain conversion is the same for every head, so the compiler
    hoists it out of the head loop and holds float32 copies after all (and
    spills). On a GPU the conversion is therefore an opaque (non-pure) PTX
    cvt it cannot hoist; the interpreter converts plainly."""
    if x.dtype == tl.float32:
        return x
    elif ON_GPU:
        return tl.inline_asm_elementwise("cvt.f32.f16 $0, $1;", "=r,h", [x], dtype=tl.float32, is_pure=False,
                                         pack=1)
    else:
        return x.to(tl.float32)


@triton.jit
def _stage1_kernel(
    Q, QPos, UK, WK, UV, RankK, RankV, CPos, CLen, Logits, PartRank, PartLse,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_pb, stride_pm,
    stride_ukb, stride_ukn, stride_ukr,
    stride_wkb, stride_wkr, stride_wkc,
    stride_uvb, stride_uvn, stride_uvr,
    stride_rkb, stride_rkn,
    stride_rvb, stride_rvn,
    stride_cpb, stride_cpn,
    stride_clb,
    stride_lb, stride_lh, stride_lm, stride_ln,
    stride_zb, stride_zh, stride_zm, stride_zs, stride_zr,
    stride_sb, stride_sh, stride_sm, stride_ss,
    rank_k_max, rank_v_max, qk_scale, rope_log2_step, tune_programs, tune_span,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    N_QUERIES: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_RV: tl.constexpr,
    QK_DT: tl.constexpr,
    UW_DT: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    ON_GPU: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
):
    """Exact attention over keys rebuilt per tile, computed transposed
    (tokens are the MMA rows, query rows the columns). One program per
    (sequence, split) holds every query head, so each U tile is read from
    memory once for all kv heads (U is shared by them) and the RoPE angles
    of a tile are computed once. Per kv head g, the tile's keys are rebuilt
    as U_k W_k,g [BLOCK_N, D] in BLOCK_R-rank chunks up to the tile's
    largest rank prefix (tiles of low-rank tokens do less work), rotated,
    and scored against every row's query (q^T stays in shared memory),
    each row keeping its own head's scores. The keys come out of their MMA
    in the layout of the next MMA's left operand, so they reach the scores
    in registers, with no trip through shared memory. Values are never
    rebuilt: sum_t p_t U_v[t, :r_t] stays in rank space, one MMA for all
    rows, and the split stores it normalised; the merge maps it by each
    row's W_v,g once per sequence, which is exact (o = (sum_t p_t U_v[t])
    W_v). The splits cover the compressed segment; the merge attends the
    dense one.

    With fp16 factors and queries the rebuild's MMAs accumulate in fp16
    (REBUILD_DT), so the keys come out in the QK MMA's dtype with no
    float32-to-fp16 conversion (16 of 192 instructions a token at the
    benchmark shape): a rounding per 16 rank columns at least, where float32
    sums were rounded once; at most twice the keys' error, which
    test_keys_rebuilt_with_fp16_accumulation_stay_within_the_fp16_tolerance
    bounds. Under the interpreter the sums are float32 (numpy), so the
    kernel's own tests see one rounding."""
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    # The keys' MMA accumulator: fp16 where the keys go on in fp16 (see above).
    REBUILD_DT: tl.constexpr = tl.float16 if (QK_DT == tl.float16 and UW_DT == tl.float16) else tl.float32

    head, query, row_kv, row_mask = _all_query_rows(N_QUERIES, GROUP, KV_HEADS * GROUP * N_QUERIES, BLOCK_ROWS)
    q_pos = tl.load(QPos + b * stride_pb + query * stride_pm, mask=row_mask, other=-1).to(tl.int32)
    offs_h = tl.arange(0, BLOCK_HALF)
    h_mask = offs_h < HALF
    offs_rv = tl.arange(0, BLOCK_RV)
    # The queries transposed, [BLOCK_HALF, BLOCK_ROWS] per RoPE half.
    q_cols = Q + b * stride_qb + head[None, :] * stride_qh + query[None, :] * stride_qm
    q_mask = h_mask[:, None] & row_mask[None, :]
    qt_lo = tl.load(q_cols + offs_h[:, None] * stride_qd, mask=q_mask, other=0.0).to(QK_DT)
    qt_hi = tl.load(q_cols + (HALF + offs_h[:, None]) * stride_qd, mask=q_mask, other=0.0).to(QK_DT)
    # 32-bit offsets from the sequence's base: 64-bit pointers per row,
    # hoisted out of the tile loop, cost registers.
    Logits_b = Logits + b * stride_lb
    row_off = head * stride_lh + query * stride_lm
    # RoPE frequencies base ** (-2i / D) = 2 ** (i * rope_log2_step), float32.
    inv_freq = tl.exp2(offs_h.to(tl.float32) * rope_log2_step)

    c_len = tl.load(CLen + b * stride_clb).to(tl.int32)
    c_lo, c_hi, _, _ = _split_range(c_len, 0, split, n_splits, BLOCK_N)

    m_i = tl.full([BLOCK_ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_RV, BLOCK_ROWS], dtype=tl.float32)  # (sum_t p_t U_v[t, :r_t])^T

    UK_b = UK + b * stride_ukb
    UV_b = UV + b * stride_uvb
    WK_b = WK + b * stride_wkb
    # Triton pipelines innermost loops only, and the head loop is inside this
    # one, so the tile loop prefetches by hand: the next tile's positions
    # are loaded a tile ahead, its ranks two (they mask the prefetch), each
    # asked of L2 a tile before its load (_prefetch_per_token), and its U_k
    # and U_v rows are requested into L2 without waiting. Holding
    # the next tile's U in registers instead would spill at 128 tokens on 8
    # warps.
    offs_rk = tl.arange(0, BLOCK_R)
    CPos_b, RankK_b, RankV_b = CPos + b * stride_cpb, RankK + b * stride_rkb, RankV + b * stride_rvb
    offs_n = c_lo + tl.arange(0, BLOCK_N)
    tok_pos_nx = _load_per_token(CPos_b, offs_n, offs_n < c_hi, stride_cpn)
    rank_k_nx = _load_per_token(RankK_b, offs_n, offs_n < c_hi, stride_rkn)
    rank_v_nx = _load_per_token(RankV_b, offs_n, offs_n < c_hi, stride_rvn)
    rank_k_nx2 = _load_per_token(RankK_b, offs_n + BLOCK_N, offs_n + BLOCK_N < c_hi, stride_rkn)
    rank_v_nx2 = _load_per_token(RankV_b, offs_n + BLOCK_N, offs_n + BLOCK_N < c_hi, stride_rvn)
    _prefetch_per_token(CPos_b, offs_n + BLOCK_N, offs_n + BLOCK_N < c_hi, stride_cpn, ON_GPU)
    _prefetch_per_token(RankK_b, offs_n + 2 * BLOCK_N, offs_n + 2 * BLOCK_N < c_hi, stride_rkn, ON_GPU)
    _prefetch_per_token(RankV_b, offs_n + 2 * BLOCK_N, offs_n + 2 * BLOCK_N < c_hi, stride_rvn, ON_GPU)
    for start in range(c_lo, c_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        tok_mask = offs_n < c_hi
        tok_pos, rank_k, rank_v = tok_pos_nx, rank_k_nx, rank_v_nx
        if ONE_CHUNK:  # the whole rank in one chunk: the tile's U_k is loaded once for every kv head
            u = _load_rank_tile(UK_b, offs_n, tok_mask, rank_k, offs_rk, rank_k_max, stride_ukn, stride_ukr)
        offs_nx = offs_n + BLOCK_N
        rank_k_nx, rank_v_nx = rank_k_nx2, rank_v_nx2
        _prefetch_rank_rows(UK_b, offs_nx, offs_nx < c_hi, rank_k_nx, stride_ukn, stride_ukr, BLOCK_R, ON_GPU)
        _prefetch_rank_rows(UV_b, offs_nx, offs_nx < c_hi, rank_v_nx, stride_uvn, stride_uvr, BLOCK_RV, ON_GPU)
        tok_pos_nx = _load_per_token(CPos_b, offs_nx, offs_nx < c_hi, stride_cpn)
        rank_k_nx2 = _load_per_token(RankK_b, offs_nx + BLOCK_N, offs_nx + BLOCK_N < c_hi, stride_rkn)
        rank_v_nx2 = _load_per_token(RankV_b, offs_nx + BLOCK_N, offs_nx + BLOCK_N < c_hi, stride_rvn)
        _prefetch_per_token(CPos_b, offs_nx + BLOCK_N, offs_nx + BLOCK_N < c_hi, stride_cpn, ON_GPU)
        _prefetch_per_token(RankK_b, offs_nx + 2 * BLOCK_N, offs_nx + 2 * BLOCK_N < c_hi, stride_rkn, ON_GPU)
        _prefetch_per_token(RankV_b, offs_nx + 2 * BLOCK_N, offs_nx + 2 * BLOCK_N < c_hi, stride_rvn, ON_GPU)
        tile_rank = tl.max(rank_k, 0)
        if ROPE:
            sin, cos = _rope_sincos(tok_pos, inv_freq, ON_GPU, tl.float32 if QK_DT == tl.float32 else tl.float16)
        if ONE_CHUNK:
            u = _keep_rank_prefix(u, offs_rk, rank_k, UW_DT)
        s_t = tl.zeros([BLOCK_N, BLOCK_ROWS], dtype=tl.float32)
        for g in range(KV_HEADS):
            # This kv head's keys of the tile, in RoPE's two halves.
            if ONE_CHUNK:
                w_lo, w_hi = _load_wk(WK_b + g * HEAD_DIM * stride_wkc, 0, offs_h, h_mask, rank_k_max,
                                      stride_wkr, stride_wkc, HALF, BLOCK_R, UW_DT)
                k_lo = tl.dot(u, w_lo, input_precision="ieee", out_dtype=REBUILD_DT)
                k_hi = tl.dot(u, w_hi, input_precision="ieee", out_dtype=REBUILD_DT)
            else:
                k_lo = tl.zeros([BLOCK_N, BLOCK_HALF], dtype=tl.float32)
                k_hi = tl.zeros([BLOCK_N, BLOCK_HALF], dtype=tl.float32)
                for r0 in range(0, tile_rank, BLOCK_R):  # chunks past the tile's largest rank are skipped
                    u_r = _load_u(UK_b, offs_n, rank_k, r0, stride_ukn, stride_ukr, BLOCK_R, UW_DT)  # L1 after g = 0
                    w_lo, w_hi = _load_wk(WK_b + g * HEAD_DIM * stride_wkc, r0, offs_h, h_mask, rank_k_max,
                                          stride_wkr, stride_wkc, HALF, BLOCK_R, UW_DT)
                    k_lo += tl.dot(u_r, w_lo, input_precision="ieee")
                    k_hi += tl.dot(u_r, w_hi, input_precision="ieee")
            if ROPE:
                k_lo, k_hi = _rotate(k_lo, k_hi, sin, cos, QK_DT, ON_GPU)
            else:
                k_lo, k_hi = k_lo.to(QK_DT), k_hi.to(QK_DT)
            s_g = tl.dot(k_lo, qt_lo, input_precision="ieee")
            s_g += tl.dot(k_hi, qt_hi, input_precision="ieee")
            s_t = tl.where((row_kv == g)[None, :], s_g, s_t)
        visible = (tok_pos[:, None] <= q_pos[None, :]) & tok_mask[:, None] & row_mask[None, :]
        s_t = tl.where(visible, s_t * qk_scale, float("-inf"))
        if STORE_LOGITS:
            tl.store(Logits_b + (row_off[None, :] + offs_n[:, None] * stride_ln), s_t,
                     mask=tok_mask[:, None] & row_mask[None, :])
        p_t, alpha, m_i, l_i = _online_softmax(s_t, m_i, l_i, 0)
        uv_t = tl.trans(_load_rank_rows(UV_b, offs_n, tok_mask, rank_v, offs_rv, rank_v_max, stride_uvn, stride_uvr,
                                        UW_DT))
        acc_t = acc_t * alpha[None, :] + tl.dot(uv_t, p_t.to(UW_DT), input_precision="ieee")

    rank_rows = b * stride_zb + head[:, None] * stride_zh + query[:, None] * stride_zm + split * stride_zs
    lse_rows = b * stride_sb + head * stride_sh + query * stride_sm + split * stride_ss
    _store_split(PartRank + rank_rows, PartLse + lse_rows, tl.trans(acc_t), m_i, l_i, offs_rv, offs_rv < rank_v_max,
                 row_mask, stride_zr)


@triton.jit
def _rank_query(Q, WK, QRank, b, g,
                stride_qb, stride_qh, stride_qm, stride_qd,
                stride_wkb, stride_wkr, stride_wkc,
                stride_xb, stride_xr, stride_xk,
                rank_k_max, head_dim,
                GROUP: tl.constexpr, N_QUERIES: tl.constexpr, BLOCK_G: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_RK: tl.constexpr, UW_DT: tl.constexpr, RANK_PREC: tl.constexpr):
    """The rank-space queries of one (sequence, kv head): q~_r = q_r W_k,g^T
    for the GROUP x M rows of kv head g, rounded to the dot dtype of U (as
    stage 1 and the mass kernel use them) and stored float32. Once per
    sequence, not once per split: W_k is read once."""
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP * N_QUERIES
    row = g * GROUP * N_QUERIES + offs_g  # row = head * M + query
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    offs_rk = tl.arange(0, BLOCK_RK)
    q = tl.load(Q + b * stride_qb + (row // N_QUERIES)[:, None] * stride_qh + (row % N_QUERIES)[:, None] * stride_qm
                + offs_d[None, :] * stride_qd, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    wk_t = tl.load(WK + b * stride_wkb + offs_rk[None, :] * stride_wkr + (g * head_dim + offs_d[:, None]) * stride_wkc,
                   mask=(offs_rk[None, :] < rank_k_max) & d_mask[:, None], other=0.0)
    q_rank = tl.dot(q.to(tl.float32), wk_t.to(tl.float32), input_precision=RANK_PREC).to(UW_DT)
    tl.store(QRank + b * stride_xb + row[:, None] * stride_xr + offs_rk[None, :] * stride_xk, q_rank.to(tl.float32),
             mask=g_mask[:, None] & (offs_rk[None, :] < rank_k_max))


@triton.jit
def _load_rank_rows(U_b, offs_n, tok_mask, rank, offs_r, rank_max, stride_un, stride_ur, UW_DT: tl.constexpr):
    """A tile's U rows [BLOCK_N, BLOCK_R], token t keeping its columns <
    rank[t]."""
    u = _load_rank_tile(U_b, offs_n, tok_mask, rank, offs_r, rank_max, stride_un, stride_ur)
    return _keep_rank_prefix(u, offs_r, rank, UW_DT)


@triton.jit
def _load_rank_tile(U_b, offs_n, tok_mask, rank, offs_r, rank_max, stride_un, stride_ur):
    """A tile's U rows [BLOCK_N, BLOCK_R] as stored. The load is masked by
    token and by each token's rank rounded up to 16 columns (capped at the
    factor's width) only, so it vectorises to 16-byte accesses and low-rank
    tokens read only their chunks, with no reduction over the tile (its
    largest rank, as before, cost an exchange between warps a tile); each
    token's own rank prefix is applied in registers (_keep_rank_prefix),
    where the loaded values are first used."""
    return tl.load(U_b + offs_n[:, None] * stride_un + offs_r[None, :] * stride_ur,
                   mask=tok_mask[:, None] & (offs_r[None, :] < tl.minimum(_chunk_ceil(rank), rank_max)[:, None]),
                   other=0.0)


@triton.jit
def _chunk_ceil(rank):
    """rank rounded up to a whole number of 16-column chunks (non-negative
    ranks: a mask, where // 16 * 16 costs a signed division's fix-ups)."""
    return tl.multiple_of((rank + 15) & -16, 16)


@triton.jit
def _load_rank_chunks(U_b, offs_n, tok_mask, rank, offs_r, rank_max, stride_un, stride_ur):
    """A tile's U rows [BLOCK_N, BLOCK_R], each token's columns up to its
    rank rounded up to 16 (and below rank_max), zeros past, for the tokens
    of tok_mask; with tok_mask None, for the tokens of nonzero rank (the
    caller gives a token it does not want rank 0), each 16-byte copy then
    testing one per-token bound. Rows U_b + offs_n: the absorbed kernels
    pass the tile's first row and offsets 0..BLOCK_N-1, the same every
    tile, so the compiler keeps the per-copy address arithmetic out of the
    loop (the absorbed stage 1 from 216 to 209 µs at batch 64). The mask
    holds for 16 columns at a time, so the loads are 16 bytes wide (with
    the row stride and rank_max multiples of 8 elements) and the tile goes
    from shared memory to the MMA as loaded: no select in registers and no
    second trip through shared memory (_whole_chunks says for which tokens
    that is exact). The rows are
    _load_rank_tile's either way; the masses' kernel passes tok_mask and
    keeps three tests a copy because one bound (as _load_rank_tile) was
    scheduled 2 us slower there at batch 64."""
    if tok_mask is None:
        mask = offs_r[None, :] < tl.minimum(_chunk_ceil(rank), rank_max)[:, None]
    else:
        mask = tok_mask[:, None] & (offs_r[None, :] < _chunk_ceil(rank)[:, None]) & (offs_r[None, :] < rank_max)
    return tl.load(U_b + offs_n[:, None] * stride_un + offs_r[None, :] * stride_ur, mask=mask, other=0.0)


@triton.jit
def _max_pair(a0, a1, b0, b1):
    """Both maxima of a pair of vectors in one reduction (tl.reduce): one
    exchange across the warps a tile for the top ranks of U_k and U_v, not
    two (209 to 207 µs at batch 64)."""
    return tl.maximum(a0, b0), tl.maximum(a1, b1)


@triton.jit
def _whole_chunks(rank, top, rank_max):
    """Tokens whose _load_rank_chunks row is their rank prefix once the
    columns at or past the tile's top rank are dropped: a rank that is a
    multiple of 16, the factor's full width, or the top itself. AttentionPack's
    grouped layout gives tiles of one rank, so only a tile where two groups
    meet can hold other tokens."""
    return ((rank & 15) == 0) | (rank >= rank_max) | (rank == top)


@triton.jit
def _note_refused(ragged_lo, ragged_hi, refused, offs_n, c_lo, c_hi):
    """ragged_lo / ragged_hi [BLOCK_N] widened by a tile's tokens
    _whole_chunks refused (they start at c_hi / c_lo: none yet)."""
    return (tl.minimum(ragged_lo, tl.where(refused, offs_n, c_hi)),
            tl.maximum(ragged_hi, tl.where(refused, offs_n + 1, c_lo)))


@triton.jit
def _ragged_range(ragged_lo, ragged_hi, c_lo, BLOCK_N: tl.constexpr):
    """The tiles from the first to the last that held a token _whole_chunks
    refused ([lo, hi): empty when there was none), tile-aligned from c_lo."""
    lo = tl.min(ragged_lo, 0)
    hi = tl.max(ragged_hi, 0)
    return c_lo + (lo - c_lo) // BLOCK_N * BLOCK_N, hi


@triton.jit
def _keep_rank_prefix(u, offs_r, rank, UW_DT: tl.constexpr):
    """_load_rank_tile's rows with each token's columns at or past its rank zeroed, in UW_DT."""
    return tl.where(offs_r[None, :] < rank[:, None], u, 0.0).to(UW_DT)


@triton.jit
def _prefetch_rank_rows(U_b, offs_n, tok_mask, rank, stride_un, stride_ur, BLOCK_R: tl.constexpr,
                        ON_GPU: tl.constexpr):
    """Ask L2 for the lines of a tile's U rows up to each token's rank
    (prefetch.global.L2: nothing waits for it), so the tile's loads a tile
    later find them there. A no-op under the interpreter."""
    if ON_GPU:
        LINE: tl.constexpr = 128 // (U_b.dtype.element_ty.primitive_bitwidth // 8)  # elements of a 128-byte line
        LINES: tl.constexpr = (BLOCK_R + LINE - 1) // LINE
        offs_l = tl.arange(0, LINES) * LINE
        ptrs = U_b + offs_n[:, None] * stride_un + offs_l[None, :] * stride_ur
        _prefetch_l2(ptrs, tok_mask[:, None] & (offs_l[None, :] < rank[:, None]))


@triton.jit
def _prefetch_per_token(X_b, offs_n, tok_mask, stride_xn, ON_GPU: tl.constexpr):
    """Ask L2 for a later tile's per-token integers (positions, ranks), so
    that their loads a tile later hit L2. Loaded from HBM, they hold the
    scoreboard ptxas gives them and the tile's U loads alike, and a wait on
    the U tile then lasts until the positions arrive. A no-op under the
    interpreter."""
    if ON_GPU:
        _prefetch_l2(X_b + offs_n * stride_xn, tok_mask)


@triton.jit
def _prefetch_l2(ptrs, wanted):
    """prefetch.global.L2 of each pointer where `wanted` holds (GPU only:
    inline PTX). Nothing waits for it and it writes no register the kernel
    reads."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
                              "=r,l,r", [ptrs, wanted.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _load_per_token(X_b, offs_n, tok_mask, stride_xn):
    """A tile's per-token integers (positions, ranks) as int32; 0 past the segment."""
    return tl.load(X_b + offs_n * stride_xn, mask=tok_mask, other=0).to(tl.int32)


@triton.jit
def _absorbed_tile(q_rank, q_pos, q_pos0, row_mask, UK_b, UV_b, CPos_b, RankK_b, RankV_b, start, offs_n, c_hi, offs_rk,
                   offs_rv, rank_k_max, rank_v_max, qk_scale, m_i, l_i, acc_rank, stride_cpn, stride_rkn, stride_rvn,
                   stride_ukn, stride_ukr, stride_uvn, stride_uvr, UW_DT: tl.constexpr, ONE_QUERY: tl.constexpr,
                   RAGGED: tl.constexpr):
    """One tile of _stage1_absorbed_kernel's rank-space attention, for the
    tokens _whole_chunks accepts (RAGGED=False: U tiles to the MMAs as
    loaded, the columns past the tile's top rank dropped from q~ and from
    the sum) or for the others (RAGGED=True: each token's columns past its
    rank zeroed in registers). Returns the online softmax's state and the
    tile's tokens _whole_chunks refused. With one query token (ONE_QUERY)
    every row has its position q_pos0, so which tokens a row sees is one
    column mask, added to the scores with their scale (one FMA an entry, no
    select); rows past the real ones then keep finite scores nobody stores."""
    tok_mask = offs_n < c_hi
    # The tile's U rows from the tile's first row: offsets that do not change from tile to tile.
    rows, UK_t, UV_t = tl.arange(0, offs_n.shape[0]), UK_b + start * stride_ukn, UV_b + start * stride_uvn
    tok_pos = _load_per_token(CPos_b, offs_n, tok_mask, stride_cpn)
    rank_k = _load_per_token(RankK_b, offs_n, tok_mask, stride_rkn)
    rank_v = _load_per_token(RankV_b, offs_n, tok_mask, stride_rvn)
    top_k, top_v = tl.reduce((rank_k, rank_v), 0, _max_pair)
    whole = _whole_chunks(rank_k, top_k, rank_k_max) & _whole_chunks(rank_v, top_v, rank_v_max)
    if RAGGED:
        mine = tok_mask & ~whole
        uk = _load_rank_rows(UK_t, rows, mine, rank_k, offs_rk, rank_k_max, stride_ukn, stride_ukr, UW_DT)
        uv = _load_rank_rows(UV_t, rows, mine, rank_v, offs_rv, rank_v_max, stride_uvn, stride_uvr, UW_DT)
        s = tl.dot(q_rank, tl.trans(uk), input_precision="ieee")
    else:
        mine = tok_mask & whole
        # Tokens past the segment have rank 0 (_load_per_token): they load nothing.
        uk = _load_rank_chunks(UK_t, rows, None, rank_k, offs_rk, rank_k_max, stride_ukn, stride_ukr).to(UW_DT)
        uv = _load_rank_chunks(UV_t, rows, None, rank_v, offs_rv, rank_v_max, stride_uvn, stride_uvr).to(UW_DT)
        s = tl.dot(tl.where(offs_rk[None, :] < top_k, q_rank, 0.0), tl.trans(uk), input_precision="ieee")
    if ONE_QUERY:
        s = s * qk_scale + tl.where((tok_pos <= q_pos0) & mine, 0.0, float("-inf"))[None, :]
    else:
        s = _mask(s * qk_scale, tok_pos, mine, q_pos, row_mask)
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)
    pv = tl.dot(p.to(UW_DT), uv, input_precision="ieee")
    if not RAGGED:
        pv = tl.where(offs_rv[None, :] < top_v, pv, 0.0)
    return m_i, l_i, acc_rank * alpha[:, None] + pv, tok_mask & ~whole


@triton.jit
def _stage1_absorbed_kernel(
    QPos, UK, UV, RankK, RankV, CPos, CLen, PartRank, PartLse, QRank,
    stride_pb, stride_pm,
    stride_ukb, stride_ukn, stride_ukr,
    stride_uvb, stride_uvn, stride_uvr,
    stride_rkb, stride_rkn,
    stride_rvb, stride_rvn,
    stride_cpb, stride_cpn,
    stride_clb,
    stride_zb, stride_zh, stride_zm, stride_zs, stride_zr,
    stride_sb, stride_sh, stride_sm, stride_ss,
    stride_xb, stride_xr, stride_xk,
    rank_k_max, rank_v_max, qk_scale, tune_programs, tune_span,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    N_QUERIES: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_RK: tl.constexpr,
    BLOCK_RV: tl.constexpr,
    UW_DT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Rank-space attention over the compressed segment for keys decomposed
    after RoPE, like MLA decode: one program per (sequence, split) holds
    every query head of the sequence as a row of its MMAs, so each U tile
    is read once for all heads (U is shared by every kv head). Row r scores
    q~_r . U_k[t, :r_t] (q~ from _rank_query) and accumulates
    sum_t p_t U_v[t, :r_t]; both U tiles of a tile are loaded together, 16
    bytes wide. The tiles go to the MMAs as loaded (zeroing each token's
    columns past its rank in registers cost a third of the loop): the first
    loop takes the tokens whose rank that is exact for (_whole_chunks), a
    second loop the others, over the tiles that held any (none in
    AttentionPack's groups of ranks that are multiples of 16). The split
    stores that sum normalised, in rank space: the merge maps it by W_v
    once per sequence. The dense segment is _query_dense_kernel's, which
    keeps this kernel's registers low."""
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)

    head, query, row_kv, row_mask = _all_query_rows(N_QUERIES, GROUP, KV_HEADS * GROUP * N_QUERIES, BLOCK_ROWS)
    q_pos = tl.load(QPos + b * stride_pb + query * stride_pm, mask=row_mask, other=-1).to(tl.int32)
    q_pos0 = tl.load(QPos + b * stride_pb).to(tl.int32)  # every row's, with one query token
    offs_rk = tl.arange(0, BLOCK_RK)
    offs_rv = tl.arange(0, BLOCK_RV)
    offs_row = tl.arange(0, BLOCK_ROWS)
    q_rank = tl.load(QRank + b * stride_xb + offs_row[:, None] * stride_xr + offs_rk[None, :] * stride_xk,
                     mask=row_mask[:, None] & (offs_rk[None, :] < rank_k_max), other=0.0).to(UW_DT)

    c_len = tl.load(CLen + b * stride_clb).to(tl.int32)
    c_lo, c_hi, _, _ = _split_range(c_len, 0, split, n_splits, BLOCK_N)

    m_i = tl.full([BLOCK_ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    acc_rank = tl.zeros([BLOCK_ROWS, BLOCK_RV], dtype=tl.float32)  # sum_t p_t U_v[t, :r_t]

    UK_b = UK + b * stride_ukb
    UV_b = UV + b * stride_uvb
    CPos_b = CPos + b * stride_cpb
    RankK_b = RankK + b * stride_rkb
    RankV_b = RankV + b * stride_rvb
    # Where tokens _whole_chunks refused lie (none: lo = c_hi, hi = c_lo); a second loop takes them.
    ragged_lo = tl.zeros([BLOCK_N], dtype=tl.int32) + c_hi
    ragged_hi = tl.zeros([BLOCK_N], dtype=tl.int32) + c_lo
    for start in range(c_lo, c_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        m_i, l_i, acc_rank, ragged = _absorbed_tile(
            q_rank, q_pos, q_pos0, row_mask, UK_b, UV_b, CPos_b, RankK_b, RankV_b, start, offs_n, c_hi, offs_rk,
            offs_rv, rank_k_max, rank_v_max, qk_scale, m_i, l_i, acc_rank, stride_cpn, stride_rkn, stride_rvn,
            stride_ukn, stride_ukr, stride_uvn, stride_uvr, UW_DT, N_QUERIES == 1, False)
        ragged_lo, ragged_hi = _note_refused(ragged_lo, ragged_hi, ragged, offs_n, c_lo, c_hi)
    r_lo, r_hi = _ragged_range(ragged_lo, ragged_hi, c_lo, BLOCK_N)
    for ragged_start in tl.range(r_lo, r_hi, BLOCK_N, num_stages=1):  # rare: not worth shared memory
        offs_n = ragged_start + tl.arange(0, BLOCK_N)
        m_i, l_i, acc_rank, refused = _absorbed_tile(
            q_rank, q_pos, q_pos0, row_mask, UK_b, UV_b, CPos_b, RankK_b, RankV_b, ragged_start, offs_n, c_hi,
            offs_rk, offs_rv, rank_k_max, rank_v_max, qk_scale, m_i, l_i, acc_rank, stride_cpn, stride_rkn,
            stride_rvn, stride_ukn, stride_ukr, stride_uvn, stride_uvr, UW_DT, N_QUERIES == 1, True)

    rank_rows = b * stride_zb + head[:, None] * stride_zh + query[:, None] * stride_zm + split * stride_zs
    lse_rows = b * stride_sb + head * stride_sh + query * stride_sm + split * stride_ss
    _store_split(PartRank + rank_rows, PartLse + lse_rows, acc_rank, m_i, l_i, offs_rv, offs_rv < rank_v_max,
                 row_mask, stride_zr)


@triton.jit
def _dense_attend(Q, QPos, DK, DV, DPos, DLen, Logits, b, g, row0,
                  stride_qb, stride_qh, stride_qm, stride_qd,
                  stride_pb, stride_pm,
                  stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                  stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                  stride_dpb, stride_dpn,
                  stride_dlb,
                  stride_lb, stride_lh, stride_lm, stride_ln,
                  head_dim, qk_scale,
                  GROUP: tl.constexpr, N_QUERIES: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                  QK_DT: tl.constexpr, BLOCK_N: tl.constexpr, STORE_LOGITS: tl.constexpr):
    """The dense segment of both calls: grouped decode of BLOCK_G of one
    (sequence, kv head)'s query rows, from row0, over its uncompressed
    tokens, storing their logits for the masses (STORE_LOGITS). Returns the
    rows' head, query, mask, the channel offsets and mask, and the online
    softmax's acc, m_i and l_i."""
    head, query, row_mask, q_pos, offs_d, d_mask, q = splitk._group_queries(
        Q, QPos, g, b, stride_qb, stride_qh, stride_qm, stride_qd, stride_pb, stride_pm, head_dim,
        GROUP, N_QUERIES, BLOCK_G, BLOCK_D, QK_DT, row0)
    d_len = tl.load(DLen + b * stride_dlb).to(tl.int32)
    logit_rows = Logits + b * stride_lb + head[:, None] * stride_lh + query[:, None] * stride_lm
    DK_g = DK + b * stride_dkb + g * stride_dkh
    DV_g = DV + b * stride_dvb + g * stride_dvh
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(0, d_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        tok_mask = offs_n < d_len
        tok_pos = tl.load(DPos + b * stride_dpb + offs_n * stride_dpn, mask=tok_mask, other=0).to(tl.int32)
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        k = tl.load(DK_g + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd, mask=kv_mask, other=0.0)
        v = tl.load(DV_g + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(QK_DT)), input_precision="ieee")
        if STORE_LOGITS:
            s = _mask_and_store(s * qk_scale, logit_rows, offs_n, stride_ln, tok_pos, tok_mask, q_pos, row_mask)
        else:
            s = _mask(s * qk_scale, tok_pos, tok_mask, q_pos, row_mask)
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(QK_DT), v.to(QK_DT), input_precision="ieee")
    return head, query, row_mask, offs_d, d_mask, acc, m_i, l_i


@triton.jit
def _query_dense_kernel(
    Q, QPos, DK, DV, DPos, DLen, Logits, PartO, PartLse, WK, QRank,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_pb, stride_pm,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_dpb, stride_dpn,
    stride_dlb,
    stride_lb, stride_lh, stride_lm, stride_ln,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_sb, stride_sh, stride_sm, stride_ss,
    stride_wkb, stride_wkr, stride_wkc,
    stride_xb, stride_xr, stride_xk,
    head_dim, dense_slot, qk_scale, rank_k_max,
    GROUP: tl.constexpr,
    N_QUERIES: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QK_DT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
    BLOCK_RK: tl.constexpr,
    UW_DT: tl.constexpr,
    RANK_PREC: tl.constexpr,
):
    """The absorbed kernel's first launch, one program per (sequence, kv
    head): its rows' rank-space queries (_rank_query), which stage 1 needs,
    then the dense segment (_dense_attend), its partial in the slot
    dense_slot after the splits'. One launch for both."""
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    _rank_query(Q, WK, QRank, b, g, stride_qb, stride_qh, stride_qm, stride_qd, stride_wkb, stride_wkr, stride_wkc,
                stride_xb, stride_xr, stride_xk, rank_k_max, head_dim, GROUP, N_QUERIES, BLOCK_G, BLOCK_D, BLOCK_RK,
                UW_DT, RANK_PREC)
    head, query, row_mask, offs_d, d_mask, acc, m_i, l_i = _dense_attend(
        Q, QPos, DK, DV, DPos, DLen, Logits, b, g, 0,
        stride_qb, stride_qh, stride_qm, stride_qd, stride_pb, stride_pm,
        stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd,
        stride_dpb, stride_dpn, stride_dlb, stride_lb, stride_lh, stride_lm, stride_ln,
        head_dim, qk_scale, GROUP, N_QUERIES, BLOCK_G, BLOCK_D, QK_DT, BLOCK_N, STORE_LOGITS)
    part_rows = b * stride_ob + head[:, None] * stride_oh + query[:, None] * stride_om
    lse_rows = b * stride_sb + head * stride_sh + query * stride_sm + dense_slot * stride_ss
    _store_split(PartO + part_rows, PartLse + lse_rows, acc, m_i, l_i, offs_d, d_mask, row_mask, stride_od)


@triton.jit
def _splits_lse(part_lse, s0, n_splits, stride_ss, row_mask, SPLITS: tl.constexpr):
    """The log2-sum-exp of splits s0 .. s0 + SPLITS of each row, [rows, SPLITS]
    (-inf past the last split): loaded together, so a merge waits once for
    SPLITS splits' partials, not once a split."""
    offs_s = s0 + tl.arange(0, SPLITS)
    return tl.load(part_lse[:, None] + offs_s[None, :] * stride_ss,
                   mask=row_mask[:, None] & (offs_s < n_splits)[None, :], other=float("-inf"))


@triton.jit
def _merge_rank_kernel(
    PartO, PartRank, PartLse, WV, Out, Lse,
    Q, QPos, DK, DV, DPos, DLen, Logits,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_zb, stride_zh, stride_zm, stride_zs, stride_zr,
    stride_sb, stride_sh, stride_sm, stride_ss,
    stride_wvb, stride_wvr, stride_wvc,
    stride_yb, stride_yh, stride_ym, stride_yd,
    stride_lb, stride_lh, stride_lm,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_pb, stride_pm,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_dpb, stride_dpn,
    stride_dlb,
    stride_gb, stride_gh, stride_gm, stride_gn,
    n_splits, rank_v_max, qk_scale,
    GROUP: tl.constexpr,
    N_QUERIES: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_RV: tl.constexpr,
    BLOCK_G: tl.constexpr,
    UW_DT: tl.constexpr,
    DENSE: tl.constexpr,
    QK_DT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Merge the partials of BLOCK_G of one (sequence, kv head)'s GROUP x M
    query rows (as splitk's merge): the compressed splits' rank-space sums
    and the dense segment's sum (slot n_splits), mapping the merged
    rank-space sums by the kv head's W_v,g once per sequence: o = o_dense +
    (sum_t p_t U_v[t]) W_v,g, normalised. W_v,g is read once for the rows
    (where a program per row read it once each: 11.7 to 7.3 µs at batch 64),
    and the product is one MMA for them (the rows padded to BLOCK_G >= 16):
    with 16-bit factors (UW_DT) the float32 sums enter as their 16-bit
    rounding and the 16-bit rest, two MMAs whose float32 sum keeps 22 of the
    sums' bits in fp16 (16 in bf16); float32 factors take a float32 dot.

    DENSE (the fused call): the program first attends its rows over the
    dense segment itself (_dense_attend: one launch fewer, the dense
    partial never stored); otherwise (the absorbed call, whose first launch
    attends it) that partial is read from PartO and slot n_splits."""
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    row0 = tl.program_id(2) * BLOCK_G
    offs_row = row0 + tl.arange(0, BLOCK_G)
    row_mask = offs_row < GROUP * N_QUERIES
    head = g * GROUP + offs_row // N_QUERIES
    query = offs_row % N_QUERIES
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    rows_d = row_mask[:, None] & d_mask[None, :]
    part_rank = PartRank + b * stride_zb + head[:, None] * stride_zh + query[:, None] * stride_zm
    part_lse = PartLse + b * stride_sb + head * stride_sh + query * stride_sm

    # The splits' largest LSE and sum of 2^lse (a few bytes a split) come
    # first: they need no dense result, so their waits and the dense
    # segment's overlap.
    s_max = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    s_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    if SPLITS == 1:
        for split in range(0, n_splits):
            lse_s = tl.load(part_lse + split * stride_ss, mask=row_mask, other=float("-inf"))
            _, _, s_max, s_sum = _merge_weights(s_max, s_sum, lse_s)
    else:
        for s0 in range(0, n_splits, SPLITS):
            lse_s = _splits_lse(part_lse, s0, n_splits, stride_ss, row_mask, SPLITS)
            new_max = tl.maximum(s_max, tl.max(lse_s, axis=1))
            ref_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # empty so far: no inf - inf
            s_sum = s_sum * tl.exp2(s_max - ref_max) + tl.sum(tl.exp2(lse_s - ref_max[:, None]), axis=1)
            s_max = new_max
    if DENSE:
        _, _, _, _, _, acc_d, m_d, l_d = _dense_attend(
            Q, QPos, DK, DV, DPos, DLen, Logits, b, g, row0,
            stride_qb, stride_qh, stride_qm, stride_qd, stride_pb, stride_pm,
            stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd,
            stride_dpb, stride_dpn, stride_dlb, stride_gb, stride_gh, stride_gm, stride_gn,
            HEAD_DIM, qk_scale, GROUP, N_QUERIES, BLOCK_G, BLOCK_D, QK_DT, BLOCK_N, STORE_LOGITS)
        o_d, lse_d = splitk._split_partial(acc_d, m_d, l_d)
    else:
        o_d = tl.load(PartO + b * stride_ob + head[:, None] * stride_oh + query[:, None] * stride_om
                      + offs_d[None, :] * stride_od, mask=rows_d, other=0.0)
        lse_d = tl.load(part_lse + n_splits * stride_ss, mask=row_mask, other=float("-inf"))
    _, w_d, e_max, e_sum = _merge_weights(s_max, s_sum, lse_d)
    ref = tl.where(e_max == float("-inf"), 0.0, e_max)  # a row that saw nothing: no inf - inf
    # Weights normalised before the sums: each sum is then a convex mix of
    # U_v's rows, so its 16-bit rounding below cannot overflow.
    inv = 1.0 / tl.where(e_sum > 0, e_sum, 1.0)
    mapped = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for r0 in range(0, rank_v_max, BLOCK_RV):
        offs_rv = r0 + tl.arange(0, BLOCK_RV)
        rv_mask = offs_rv < rank_v_max
        # W_v,g BLOCK_RV rows at a time: a float32 W_v,g of rank 72, whole, spilled.
        wv = tl.load(WV + b * stride_wvb + offs_rv[:, None] * stride_wvr
                     + (g * HEAD_DIM + offs_d[None, :]) * stride_wvc, mask=rv_mask[:, None] & d_mask[None, :],
                     other=0.0)
        acc_rank = tl.zeros([BLOCK_G, BLOCK_RV], dtype=tl.float32)
        if SPLITS == 1:
            for split in range(0, n_splits):
                w = tl.exp2(tl.load(part_lse + split * stride_ss, mask=row_mask, other=float("-inf")) - ref) * inv
                r_s = tl.load(part_rank + split * stride_zs + offs_rv[None, :] * stride_zr,
                              mask=row_mask[:, None] & rv_mask[None, :], other=0.0)
                acc_rank += w[:, None] * r_s
        else:
            for s0 in range(0, n_splits, SPLITS):
                offs_s = s0 + tl.arange(0, SPLITS)
                w = tl.exp2(_splits_lse(part_lse, s0, n_splits, stride_ss, row_mask, SPLITS) - ref[:, None])
                r_s = tl.load(part_rank[:, :, None] + offs_s[None, :, None] * stride_zs
                              + offs_rv[None, None, :] * stride_zr,
                              mask=row_mask[:, None, None] & (offs_s < n_splits)[None, :, None] & rv_mask[None, None, :],
                              other=0.0)
                acc_rank += tl.sum((w * inv[:, None])[:, :, None] * r_s, axis=1)
        if UW_DT == tl.float32:
            mapped = tl.dot(acc_rank, wv.to(tl.float32), mapped, input_precision="ieee")
        else:
            wv = wv.to(UW_DT)
            hi = acc_rank.to(UW_DT)
            lo = (acc_rank - hi.to(tl.float32)).to(UW_DT)
            mapped = tl.dot(hi, wv, tl.dot(lo, wv, mapped))
    out = mapped + (w_d * inv)[:, None] * o_d
    lse = _merged_lse(e_max, e_sum)
    tl.store(Out + b * stride_yb + head[:, None] * stride_yh + query[:, None] * stride_ym + offs_d[None, :] * stride_yd,
             out.to(Out.dtype.element_ty), mask=rows_d)
    tl.store(Lse + b * stride_lb + head * stride_lh + query * stride_lm, lse, mask=row_mask)


@triton.jit
def _mass_kernel(
    Logits, Lse, MassC, MassD, CLen, DLen,
    stride_lb, stride_lr, stride_ln,
    stride_sb, stride_sh, stride_sm,
    stride_cb, stride_cn,
    stride_db, stride_dn,
    stride_clb, stride_dlb,
    n_comp, n_cols, n_rows, row_width, inv_rows,
    N_QUERIES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Per-token attention weight exp(logit - lse), averaged over the n_rows =
    heads x queries rows, for a block of columns of [compressed | dense],
    from the logits the fused call's _stage1_kernel and merge stored
    (_stored_masses)."""
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    _stored_masses(Logits, Lse, MassC, MassD, CLen, DLen, b, cols, cols,
                   stride_lb, stride_lr, stride_ln, stride_sb, stride_sh, stride_sm,
                   stride_cb, stride_cn, stride_db, stride_dn, stride_clb, stride_dlb,
                   n_comp, n_cols, n_rows, row_width, inv_rows, N_QUERIES, BLOCK_R)


@triton.jit
def _stored_masses(Logits, Lse, MassC, MassD, CLen, DLen, b, cols, logit_cols,
                   stride_lb, stride_lr, stride_ln, stride_sb, stride_sh, stride_sm,
                   stride_cb, stride_cn, stride_db, stride_dn, stride_clb, stride_dlb,
                   n_comp, n_cols, n_rows, row_width, inv_rows, N_QUERIES: tl.constexpr, BLOCK_R: tl.constexpr):
    """The masses of columns `cols` of [compressed | dense] of sequence b
    from stored logits (at `logit_cols` of Logits: the absorbed kernel's
    hold the dense columns only; float16 or float32; row r = head * M +
    query at r * stride_lr, the first row_width >= n_rows of them in
    bounds), BLOCK_R rows' loads in flight at once."""
    c_len = tl.load(CLen + b * stride_clb).to(tl.int32)
    d_len = tl.load(DLen + b * stride_dlb).to(tl.int32)
    valid_c = cols < c_len
    valid_d = (cols >= n_comp) & (cols - n_comp < d_len)
    # Only real tokens' columns of real rows were written (by stage 1 and the merge).
    valid = valid_c | valid_d
    total = tl.zeros(cols.shape, dtype=tl.float32)
    for r0 in range(0, n_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_mask = rows < n_rows
        head = rows // N_QUERIES
        query = rows % N_QUERIES
        lse2 = tl.load(Lse + b * stride_sb + head * stride_sh + query * stride_sm, mask=row_mask,
                       other=0.0) * 1.4426950408889634
        lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)  # a row that saw nothing has only -inf logits
        # Loaded under the buffer's extent, not under `valid` and row_mask
        # (lengths not known to be multiples of 16): those masks would keep
        # token-major loads scalar. What padding rows and columns hold is set
        # aside here, before any arithmetic. A logit is at most its row's LSE
        # (only a float16 rounding puts it above, or past float16's range at
        # +inf, where the weight is 1).
        logit = tl.load(Logits + b * stride_lb + rows[:, None] * stride_lr + logit_cols[None, :] * stride_ln,
                        mask=(rows < row_width)[:, None] & (cols < n_cols)[None, :], other=float("-inf"))
        logit = tl.where(row_mask[:, None] & valid[None, :], tl.minimum(logit.to(tl.float32), lse2[:, None]),
                         float("-inf"))
        total += tl.sum(tl.exp2(logit - lse2[:, None]), 0)
    mass = tl.where(valid, total * inv_rows, 0.0)
    tl.store(MassC + b * stride_cb + cols * stride_cn, mass, mask=cols < n_comp)
    tl.store(MassD + b * stride_db + (cols - n_comp) * stride_dn, mass, mask=(cols >= n_comp) & (cols < n_cols))


@triton.jit
def _mass_rank_tile(q_rank, lse2, q_pos, q_pos0, row_mask, UK_b, RankK_b, tok_pos, start, cols, valid, offs_rk,
                    rank_k_max, qk_scale, inv_rows, stride_ukn, stride_ukr, stride_rkn, UW_DT: tl.constexpr,
                    ONE_QUERY: tl.constexpr, RAGGED: tl.constexpr):
    """The masses of one tile's tokens, as _absorbed_tile scores them: the
    tokens _whole_chunks accepts from the U_k tile as loaded (RAGGED=False),
    or the others, each token's columns past its rank zeroed (RAGGED=True).
    Returns the masses (0 for the tokens this pass does not take) and the
    tokens _whole_chunks refused. With one query token every row sees the
    same columns, so the causal mask is applied once a column, after the
    sum over rows (rows past the real ones have an LSE of +inf and weigh
    nothing): one FMA and one exp2 an entry."""
    rank = _load_per_token(RankK_b, cols, valid, stride_rkn)
    top = tl.max(rank, 0)
    whole = _whole_chunks(rank, top, rank_k_max)
    rows, UK_t = tl.arange(0, cols.shape[0]), UK_b + start * stride_ukn  # offsets from the tile's first row
    if RAGGED:
        mine = valid & ~whole
        uk = _load_rank_rows(UK_t, rows, mine, rank, offs_rk, rank_k_max, stride_ukn, stride_ukr, UW_DT)
        s = tl.dot(q_rank, tl.trans(uk), input_precision="ieee")
    else:
        mine = valid & whole  # the refused tokens' rows load as zeros: no score of theirs to overflow
        uk = _load_rank_chunks(UK_t, rows, mine, rank, offs_rk, rank_k_max, stride_ukn, stride_ukr).to(UW_DT)
        s = tl.dot(tl.where(offs_rk[None, :] < top, q_rank, 0.0), tl.trans(uk), input_precision="ieee")
    if ONE_QUERY:
        mass = tl.sum(tl.exp2(s * qk_scale - lse2[:, None]), 0)
        mass = tl.where(mine & (tok_pos <= q_pos0), mass * inv_rows, 0.0)
    else:
        s = _mask(s * qk_scale, tok_pos, mine, q_pos, row_mask)
        mass = tl.sum(tl.exp2(s - lse2[:, None]), 0) * inv_rows
    return mass, valid & ~whole


@triton.jit
def _mass_rank_kernel(
    Lse, MassC, CLen, QRank, UK, RankK, CPos, QPos, Logits, MassD, DLen,
    stride_sb, stride_sh, stride_sm,
    stride_cb, stride_cn,
    stride_clb,
    stride_xb, stride_xr, stride_xk,
    stride_ukb, stride_ukn, stride_ukr,
    stride_rkb, stride_rkn,
    stride_cpb, stride_cpn,
    stride_pb, stride_pm,
    stride_lb, stride_lr, stride_ln,
    stride_db, stride_dn,
    stride_dlb,
    n_comp, n_cols, n_rows, row_width, inv_rows, qk_scale, rank_k_max,
    N_QUERIES: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_RK: tl.constexpr,
    UW_DT: tl.constexpr,
    DENSE_BLOCK_T: tl.constexpr,
    DENSE_BLOCK_R: tl.constexpr,
):
    """The absorbed kernel's masses in one launch: programs (b, i) for i
    below the compressed segment's spans recompute its tokens' masses in
    rank space (_rank_masses); the programs after them take the dense
    tokens, DENSE_BLOCK_T columns each, from the logits _query_dense_kernel
    stored (_stored_masses): a launch of their own cost a kernel's start
    and its waits on memory for a few columns."""
    b = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    n_spans = tl.cdiv(n_comp, SPAN)
    if block < n_spans:
        _rank_masses(Lse, MassC, CLen, QRank, UK, RankK, CPos, QPos, b, block * SPAN,
                     stride_sb, stride_sh, stride_sm, stride_cb, stride_cn, stride_clb, stride_xb, stride_xr,
                     stride_xk, stride_ukb, stride_ukn, stride_ukr, stride_rkb, stride_rkn, stride_cpb, stride_cpn,
                     stride_pb, stride_pm, n_comp, n_rows, inv_rows, qk_scale, rank_k_max,
                     N_QUERIES, SPAN, BLOCK_T, BLOCK_ROWS, BLOCK_RK, UW_DT)
    else:
        cols = n_comp + (block - n_spans) * DENSE_BLOCK_T + tl.arange(0, DENSE_BLOCK_T)
        _stored_masses(Logits, Lse, MassC, MassD, CLen, DLen, b, cols, cols - n_comp,
                       stride_lb, stride_lr, stride_ln, stride_sb, stride_sh, stride_sm,
                       stride_cb, stride_cn, stride_db, stride_dn, stride_clb, stride_dlb,
                       n_comp, n_cols, n_rows, row_width, inv_rows, N_QUERIES, DENSE_BLOCK_R)


@triton.jit
def _rank_masses(Lse, MassC, CLen, QRank, UK, RankK, CPos, QPos, b, lo,
                 stride_sb, stride_sh, stride_sm, stride_cb, stride_cn, stride_clb, stride_xb, stride_xr, stride_xk,
                 stride_ukb, stride_ukn, stride_ukr, stride_rkb, stride_rkn, stride_cpb, stride_cpn, stride_pb,
                 stride_pm, n_comp, n_rows, inv_rows, qk_scale, rank_k_max,
                 N_QUERIES: tl.constexpr, SPAN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                 BLOCK_RK: tl.constexpr, UW_DT: tl.constexpr):
    """The masses of compressed columns [lo, min(lo + SPAN, n_comp)) of sequence b,
    recomputed in rank space: row r's weight of token t is exp(q~_r .
    U_k[t, :r_t] * scale - lse_r), averaged over the rows, in tiles of
    BLOCK_T (q~ and the LSEs loaded once, U_k tiles 16 bytes wide and
    pipelined): cheaper than storing a float32 logit per row and token in
    stage 1 and reading it back. Like _stage1_absorbed_kernel, a first loop
    takes the tiles as loaded and a second the tokens that leaves inexact
    (none in AttentionPack's groups of ranks that are multiples of 16); the
    two store disjoint columns. The tiles are masked by the sequence's
    length, not the span's end: SPAN is a multiple of BLOCK_T (mass_span),
    so no tile crosses into the next span."""
    hi = tl.minimum(lo + SPAN, n_comp)
    c_len = tl.load(CLen + b * stride_clb).to(tl.int32)
    offs_row = tl.arange(0, BLOCK_ROWS)
    row_mask = offs_row < n_rows
    head_r = offs_row // N_QUERIES
    query_r = offs_row % N_QUERIES
    lse2 = tl.load(Lse + b * stride_sb + head_r * stride_sh + query_r * stride_sm, mask=row_mask,
                   other=0.0) * 1.4426950408889634
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)  # a row that saw nothing: the causal mask zeroes its entries
    lse2 = tl.where(row_mask, lse2, float("inf"))
    q_pos = tl.load(QPos + b * stride_pb + query_r * stride_pm, mask=row_mask, other=-1).to(tl.int32)
    q_pos0 = tl.load(QPos + b * stride_pb).to(tl.int32)  # every row's, with one query token
    offs_rk = tl.arange(0, BLOCK_RK)
    q_rank = tl.load(QRank + b * stride_xb + offs_row[:, None] * stride_xr + offs_rk[None, :] * stride_xk,
                     mask=row_mask[:, None] & (offs_rk[None, :] < rank_k_max), other=0.0).to(UW_DT)
    UK_b = UK + b * stride_ukb
    RankK_b = RankK + b * stride_rkb
    CPos_b = CPos + b * stride_cpb
    MassC_b = MassC + b * stride_cb
    ragged_lo = tl.zeros([BLOCK_T], dtype=tl.int32) + hi
    ragged_hi = tl.zeros([BLOCK_T], dtype=tl.int32) + lo
    # The positions are loaded a tile ahead, by hand: the compiler pipelines
    # only the loads the MMAs' operands depend on, and a tile waited a
    # memory latency for its positions.
    next_cols = lo + tl.arange(0, BLOCK_T)
    next_pos = _load_per_token(CPos_b, next_cols, next_cols < c_len, stride_cpn)
    for start in range(lo, hi, BLOCK_T):
        cols = start + tl.arange(0, BLOCK_T)
        tok_pos = next_pos
        next_pos = _load_per_token(CPos_b, cols + BLOCK_T, cols + BLOCK_T < tl.minimum(c_len, hi), stride_cpn)
        mass, refused = _mass_rank_tile(
            q_rank, lse2, q_pos, q_pos0, row_mask, UK_b, RankK_b, tok_pos, start, cols, cols < c_len, offs_rk,
            rank_k_max, qk_scale, inv_rows, stride_ukn, stride_ukr, stride_rkn, UW_DT, N_QUERIES == 1, False)
        tl.store(MassC_b + cols * stride_cn, mass, mask=(cols < hi) & ~refused)
        ragged_lo, ragged_hi = _note_refused(ragged_lo, ragged_hi, refused, cols, lo, hi)
    r_lo, r_hi = _ragged_range(ragged_lo, ragged_hi, lo, BLOCK_T)
    for ragged_start in tl.range(r_lo, r_hi, BLOCK_T, num_stages=1):  # rare: not worth shared memory
        cols = ragged_start + tl.arange(0, BLOCK_T)
        tok_pos = _load_per_token(CPos_b, cols, cols < c_len, stride_cpn)
        mass, refused = _mass_rank_tile(
            q_rank, lse2, q_pos, q_pos0, row_mask, UK_b, RankK_b, tok_pos, ragged_start, cols, cols < c_len,
            offs_rk, rank_k_max, qk_scale, inv_rows, stride_ukn, stride_ukr, stride_rkn, UW_DT, N_QUERIES == 1, True)
        tl.store(MassC_b + cols * stride_cn, mass, mask=(cols < hi) & refused)


# The autotuner's first config, by kernel (a pinned launch, block_n given
# or the interpreter's, takes its warps and stages): tests assert it
# compiles to tensor-core MMAs without spills. The fused kernel's tokens
# are its MMA rows: 64 of them make one wgmma on sm_90 (32 lower to
# mma.sync at twice the instructions a token, and sit at the 255-register
# limit on 4 warps or 8).
DEFAULT_BLOCK_N = {"_stage1_kernel": 64, "_stage1_absorbed_kernel": INTERPRET_BLOCK_N}
DEFAULT_WARPS = {"_stage1_kernel": 8, "_stage1_absorbed_kernel": 4}
DEFAULT_STAGES = 2


def _stage1_configs(kernel: str):
    # The fused kernel's 128-token tiles on 4 warps spill (the key rebuild
    # holds two [128, head_dim / 2] float32 halves), so they are not tried;
    # the absorbed kernel's fit (254 registers at 32 rows, rank 64 on sm_90).
    first = (DEFAULT_BLOCK_N[kernel], DEFAULT_WARPS[kernel], DEFAULT_STAGES)
    rest = [(n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3)
            if not (n == 128 and w == 4 and kernel == "_stage1_kernel") and (n, w, s) != first]
    return [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in [first, *rest]]


# Autotuned on a GPU only: under the interpreter every config would run the
# whole kernel in Python, so the launchers use INTERPRET_BLOCK_N there. The
# timings are cached on disk (in Triton's cache dir), so a shape is tuned once
# per machine and code version, not once per process.
_STAGE1_KEY = ["tune_programs", "tune_span", "KV_HEADS", "GROUP", "N_QUERIES", "HEAD_DIM", "BLOCK_ROWS", "BLOCK_D"]
# Configs that spill at the shape being tuned are pruned before timing (the
# fused kernel's 32- and 64-token tiles on 4 warps sit at the register limit
# and spill at some shapes).
_stage1_tuned = triton.autotune(configs=_stage1_configs("_stage1_kernel"), cache_results=True,
                                key=_STAGE1_KEY + ["BLOCK_R", "BLOCK_RV", "ROPE", "ONE_CHUNK", "STORE_LOGITS"],
                                prune_configs_by={"early_config_prune": common.prune_spilling(_stage1_kernel)})(
    _stage1_kernel)
_stage1_absorbed_tuned = triton.autotune(
    configs=_stage1_configs("_stage1_absorbed_kernel"), cache_results=True,
    key=_STAGE1_KEY + ["BLOCK_RK", "BLOCK_RV"],
    prune_configs_by={"early_config_prune": common.prune_spilling(_stage1_absorbed_kernel)})(_stage1_absorbed_kernel)


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------


def lowrank_decode(q: torch.Tensor, q_pos: torch.Tensor, comp: CompressedKV, dense: DenseKV, *,
                   rope_base: float | None, sm_scale: float | None = None,
                   num_splits: int | None = None, check_values: bool = True,
                   block_n: int | None = None, workspace: "Workspace | None" = None,
                   rank_chunk: int | None = None, mass: bool = True) -> DecodeOutput:
    """Fused decompress + split-K flash-decoding over [compressed | dense].

    q: [B, Hq, M, D] fp16/bf16/fp32, the M new query tokens of each sequence
    (M small, usually 1); q_pos: [B, M] int, their absolute positions. A token
    is visible to a query iff its pos <= the query's q_pos (so M > 1 new
    tokens attend causally among themselves when they are in `dense`).
    comp, dense: the cache segments (see CompressedKV, DenseKV); U/W and the
    dense K/V may have other float dtypes than q; any strides.
    rope_base: keys were decomposed before RoPE: rebuilt keys are rotated at
    comp.pos with this base. None: keys were decomposed after RoPE.
    sm_scale: softmax scale, default D ** -0.5.
    num_splits: sequence splits per (sequence, kv head); default from the
    longest sequence and the batch (split_count: on a GPU the fewest waves
    of the longest splits, at most DEFAULT_MAX_SPLITS).
    check_values=False skips the input checks that wait for the device
    (lengths and ranks in range; see check_inputs); with num_splits given the
    call then never synchronises, e.g. in a timing loop over checked inputs.
    block_n: a fixed token tile (power of two >= 16) instead of the autotuned
    one (the interpreter uses INTERPRET_BLOCK_N unless given); tests on a GPU
    pin it to avoid autotuning every shape.
    workspace: the scratch of the call (make_workspace), owned by the caller
    and reused across the steps of a decode loop: no allocation per call,
    and its split count stands in for num_splits (no host sync either).
    rank_chunk: ranks per step of the key rebuild (a power of two >= 16,
    default MAX_BLOCK_R). A tile rebuilds up to its largest rank prefix in
    whole chunks, so tokens stored grouped by rank (AttentionPack's
    importance groups) save rebuild work in proportion to their rank when
    the chunk is no larger than the low groups' rank.
    mass=False skips the per-token attention masses: no logits are written
    or read back (128 bytes a token at 32 query heads over an fp16 cache,
    half as much as U; 256 in float32)
    and the mass kernel does not run; for the steps that do not update
    AttentionPack's importance (its `importance_every` knob).
    Returns DecodeOutput(out [B, Hq, M, D] q.dtype, lse [B, Hq, M] float32,
    mass_comp [B, T] float32, mass_dense [B, S] float32; both masses None
    with mass=False).
    """
    check_inputs(q, q_pos, comp, dense, rope_base, check_values)
    common.check_launchable(q)
    if rank_chunk is not None:
        common.check_block("rank_chunk", rank_chunk)
    if comp.uv.shape[2] > MAX_RANK_SPACE:
        raise ValueError(f"uv has rank {comp.uv.shape[2]}; the kernel keeps values in rank space and supports up to "
                         f"{MAX_RANK_SPACE}")
    return _decode(q, q_pos, comp, dense, rope_base, sm_scale, num_splits, block_n, workspace, absorbed=False,
                   rank_chunk=rank_chunk, mass=check_mass(mass))


def lowrank_decode_absorbed(q: torch.Tensor, q_pos: torch.Tensor, comp: CompressedKV, dense: DenseKV, *,
                            sm_scale: float | None = None, num_splits: int | None = None,
                            check_values: bool = True, block_n: int | None = None,
                            workspace: "Workspace | None" = None, mass: bool = True) -> DecodeOutput:
    """The same attention computed in rank space (like MLA decode), for keys
    decomposed after RoPE (there is no rope_base: rank-space scores cannot be
    rotated per token). Per query head h of kv head g: q~ = q W_k[:, g]^T [Rk]
    is scored against U_k[t, :rank_k[t]], and sum_t p_t U_v[t, :rank_v[t]] is
    mapped back by W_v[:, g] once per sequence, in the merge. Ranks up to MAX_RANK_SPACE.
    A token's columns past its rank are never used, but those in the same
    16-column chunk are read (and multiplied by zero): they must be finite.
    Shapes, outputs and the other arguments as lowrank_decode."""
    check_inputs(q, q_pos, comp, dense, None, check_values)
    common.check_launchable(q)
    for name, u in (("uk", comp.uk), ("uv", comp.uv)):
        if u.shape[2] > MAX_RANK_SPACE:
            raise ValueError(f"{name} has rank {u.shape[2]}; the absorbed kernel supports up to {MAX_RANK_SPACE}")
    factors = {t.dtype for t in (comp.uk, comp.wk, comp.uv, comp.wv)}
    wide = common.block(comp.uk.shape[2]) * common.block(q.shape[3])
    if (factors & {torch.float32} or len(factors) > 1) and wide > MAX_FLOAT32_WK_TILE:
        # The float32 W_k tile of the rank-space queries: 278528 bytes of shared memory at rank 256 x
        # head_dim 256 (compiled for sm_80 and sm_90), more than a block may use; the launch would fail.
        raise ValueError(f"the absorbed kernel holds W_k as one [rank, head_dim] tile, in float32 for factors of "
                         f"{'mixed dtypes' if len(factors) > 1 else 'float32'}: rank {comp.uk.shape[2]} x head_dim "
                         f"{q.shape[3]} needs more shared memory than a GPU block has; give uk, wk, uv and wv one "
                         f"16-bit dtype, or keep rank x head_dim (each rounded up to a power of two) within "
                         f"{MAX_FLOAT32_WK_TILE}")
    return _decode(q, q_pos, comp, dense, None, sm_scale, num_splits, block_n, workspace, absorbed=True,
                   mass=check_mass(mass))


def check_mass(mass) -> bool:
    if not isinstance(mass, bool):
        raise TypeError(f"mass must be True or False, got {mass!r}")
    return mass


@dataclass(frozen=True)
class Workspace:
    """What one call writes and reads besides its outputs: the scaled
    logits of every (query row, token) for the masses [B, Hq, M, T + S]
    (float16 and stored token-major where the keys are rebuilt in fp16,
    see logits_dtype; the absorbed kernel: float32, of the dense
    tokens only, [B, Hq, M, S]) and, float32, each
    split's rank-space partial sum [B, Hq, M, splits, Rv] and the
    log2-sum-exp of each split and of the dense segment [B, Hq, M, splits +
    1], the dense segment's sum [B, Hq, M, 1, D] and the rank-space queries
    [B, Hq * M, Rk] (the absorbed kernel's; the fused kernel's merge attends
    the dense segment itself: its part_o and q_rank are empty, and the last
    LSE slot unused).
    Made once by make_workspace for a kernel, a cache's shapes and a split
    count; the same one serves every step while the shapes stay."""

    logits: torch.Tensor
    part_o: torch.Tensor
    part_lse: torch.Tensor
    q_rank: torch.Tensor
    part_rank: torch.Tensor

    @property
    def splits(self) -> int:
        return self.part_rank.shape[3]


def make_workspace(q: torch.Tensor, comp: CompressedKV, dense: DenseKV, num_splits: int, *,
                   absorbed: bool = False) -> Workspace:
    """A workspace for calls of lowrank_decode (or, with absorbed=True,
    lowrank_decode_absorbed) with these shapes and num_splits splits (see
    default_num_splits), on q's device."""
    num_splits = _num_splits(num_splits, comp, dense, comp.length.shape[0], q.device, absorbed)
    return _new_workspace(_workspace_shapes(q, comp, dense, num_splits, absorbed), q, dense, absorbed)


def logits_dtype(q: torch.Tensor, dense: DenseKV, absorbed: bool) -> torch.dtype:
    """The dtype the masses' logits are stored in: float16 where the fused
    kernel scores keys rounded to float16 (q and the dense cache in fp16,
    QK_DT), float32 otherwise (a bf16 cache's values may pass float16's
    range) and for the absorbed kernel's few dense logits. The keys'
    rounding may already move a logit s by up to 2^-11 sum_i |q_i k_i|;
    storing s in float16 moves it by at most 2^-11 |s| more (a weight by
    ln 2 times that, relative; test_float16_logits_move_each_mass_within_
    their_rounding), and halves the bytes written and read back for the
    masses. Past float16's range a logit stores as an infinity: the mass
    kernels take +inf as the row's LSE (weight 1).
    """
    if absorbed or common.dot_dtype(q.dtype, dense.k.dtype, dense.v.dtype) != tl.float16:
        return torch.float32
    return torch.float16


def _new_workspace(shapes, q: torch.Tensor, dense: DenseKV, absorbed: bool) -> Workspace:
    (batch, heads, queries, cols), *rest = shapes
    logits_dt, dev = logits_dtype(q, dense, absorbed), q.device
    if logits_dt == torch.float16:  # token-major: a token's rows side by side, as stage 1's
        # transposed score tile holds them, so the mass kernel sums a token's rows from 16-byte loads;
        # each token's rows padded to 16, so every token starts 32-byte aligned
        rows = heads * queries
        padded = torch.empty((batch, cols, -(-rows // 16) * 16), dtype=logits_dt, device=dev)
        logits = padded[..., :rows].unflatten(2, (heads, queries)).permute(0, 2, 3, 1)
    else:  # float32 (a float32 cache, or the absorbed call's dense logits): row-major, where the
        # fused merge's float32 dense segment does not spill
        logits = torch.empty((batch, heads, queries, cols), dtype=logits_dt, device=dev)
    return Workspace(logits, *(torch.empty(shape, dtype=torch.float32, device=dev) for shape in rest))


def _workspace_shapes(q, comp, dense, splits: int, absorbed: bool):
    batch, heads, queries, head_dim = q.shape
    cols = dense.k.shape[2] + (0 if absorbed else comp.uk.shape[1])
    # The compressed splits' rank-space partials, then one slot for the dense
    # segment (the fused call's merge keeps its sum in registers).
    return ((batch, heads, queries, cols), (batch, heads, queries, int(absorbed), head_dim),
            (batch, heads, queries, splits + 1),
            (batch, heads * queries, comp.uk.shape[2] if absorbed else 0), (batch, heads, queries, splits,
                                                                             comp.uv.shape[2]))


def _logit_row_stride(logits: torch.Tensor) -> int:
    """The stride of row h * M + m of logits [B, H, M, cols] (its heads and
    queries one run of rows, as _new_workspace makes them: _check_workspace)."""
    return logits.stride(2) if logits.shape[2] > 1 else logits.stride(1)


def _logit_row_width(logits: torch.Tensor) -> int:
    """How many rows of a token the mass kernels may load: token-major
    logits are padded to whole 16-row runs, which loads of 16 rows need to
    stay vectorized; other layouts give their rows only."""
    rows = logits.shape[1] * logits.shape[2]
    if logits.shape[3] and _logit_row_stride(logits) == 1 and logits.stride(3) >= rows:
        return logits.stride(3)
    return rows


def _check_workspace(ws: Workspace, q, comp, dense, num_splits, absorbed: bool) -> int:
    """The workspace's split count, after checking it fits this call."""
    if not isinstance(ws, Workspace):
        raise TypeError(f"workspace must be a Workspace (make_workspace), got {type(ws).__name__}")
    if num_splits is not None and num_splits != ws.splits:
        raise ValueError(f"num_splits={num_splits} but the workspace was made for {ws.splits} splits")
    dtypes = (logits_dtype(q, dense, absorbed),) + (torch.float32,) * 4
    for name, t, shape, dt in zip(("logits", "part_o", "part_lse", "q_rank", "part_rank"),
                                  (ws.logits, ws.part_o, ws.part_lse, ws.q_rank, ws.part_rank),
                                  _workspace_shapes(q, comp, dense, ws.splits, absorbed), dtypes):
        if tuple(t.shape) != shape or t.dtype != dt or t.device != q.device:
            dt_name = str(dt).removeprefix("torch.")
            raise ValueError(f"workspace.{name} is {t.dtype} {tuple(t.shape)} on {t.device}; this call needs "
                             f"{dt_name} {shape} on {q.device}: make it with make_workspace(q, comp, dense, "
                             f"num_splits={ws.splits}, absorbed={absorbed}) for these shapes and this kernel")
    _, heads, queries, _ = ws.logits.shape
    if heads > 1 and queries > 1 and ws.logits.stride(1) != queries * ws.logits.stride(2):
        raise ValueError(f"workspace.logits has strides {ws.logits.stride()}: its heads and queries must be one run of "
                         f"rows (stride(1) == M * stride(2)), as make_workspace makes them")
    return ws.splits


def _decode(q, q_pos, comp, dense, rope_base, sm_scale, num_splits, block_n, workspace, *,
            absorbed: bool, rank_chunk: int | None = None, mass: bool = True) -> DecodeOutput:
    batch, heads, queries, head_dim = q.shape
    kv_heads, slots = dense.k.shape[1], dense.k.shape[2]
    tokens = comp.uk.shape[1]
    group = heads // kv_heads
    if not 1 <= head_dim <= MAX_HEAD_DIM or (head_dim % 2 and not absorbed):
        raise ValueError(f"head_dim must be even (keys are handled in RoPE's halves) and at most {MAX_HEAD_DIM}, "
                         f"got {head_dim}")
    if queries < 1:
        raise ValueError("q has no query tokens (M = 0)")
    rows = heads * queries  # a program holds every query head of its sequence
    if rows > MAX_ROWS:
        raise ValueError(f"query heads x query tokens = {heads} x {queries} = {rows} exceeds {MAX_ROWS}, the rows "
                         f"one program holds; decode fewer query tokens per call")
    scale = common.softmax_scale(sm_scale, head_dim, "sm_scale")
    if block_n is not None:
        common.check_block("block_n", block_n)
    dev = q.device
    out = torch.empty((batch, heads, queries, head_dim), dtype=q.dtype, device=dev)
    lse = torch.empty((batch, heads, queries), dtype=torch.float32, device=dev)
    mass_comp = torch.empty((batch, tokens), dtype=torch.float32, device=dev) if mass else None
    mass_dense = torch.empty((batch, slots), dtype=torch.float32, device=dev) if mass else None
    if batch == 0 or heads == 0:
        return DecodeOutput(out, lse, mass_comp, mass_dense)
    if workspace is not None:
        splits = _check_workspace(workspace, q, comp, dense, num_splits, absorbed)
    else:
        splits = _num_splits(num_splits, comp, dense, batch, dev, absorbed)
        shapes = list(_workspace_shapes(q, comp, dense, splits, absorbed))
        if not mass:  # no logits are written: no [B, Hq, M, T + S] buffer either
            shapes[0] = (batch, heads, queries, 0)
        workspace = _new_workspace(shapes, q, dense, absorbed)
    # Scaled logits (log2 units) of every (row, token) for the masses; columns
    # [0, T) are the compressed tokens, [T, T + S) the dense ones (the
    # absorbed kernel: the dense ones only). Only real tokens' columns are
    # written; the mass kernels load whole runs and set the padding aside.
    logits, part_o, part_lse, q_rank = workspace.logits, workspace.part_o, workspace.part_lse, workspace.q_rank
    part_rank = workspace.part_rank

    block_d = common.block(head_dim)
    shared = dict(KV_HEADS=kv_heads, GROUP=group, N_QUERIES=queries, HEAD_DIM=head_dim, BLOCK_ROWS=common.block(rows),
                  BLOCK_D=block_d, QK_DT=common.dot_dtype(q.dtype, dense.k.dtype, dense.v.dtype),
                  UW_DT=common.dot_dtype(comp.uk.dtype, comp.wk.dtype, comp.uv.dtype, comp.wv.dtype))
    tune = splitk.tune_buckets(batch * splits, tokens, splits)  # unused by the kernels: the autotuner's key
    grid = (batch, splits)
    # The dense tokens' logits: columns [T, T + S) of the fused kernel's, all of the absorbed kernel's.
    dense_logits = logits if absorbed else logits[..., tokens:]
    if absorbed:  # the dense segment first: its launch makes q~ for stage 1
        _query_dense(q, q_pos, comp, dense, dense_logits, part_o, part_lse, q_rank, shared, scale, store_logits=mass)
        _absorbed_stage1(q_pos, comp, part_rank, part_lse, q_rank, shared, scale, tune, grid, block_n)
    else:
        rope_step = 0.0 if rope_base is None else -2.0 * math.log2(rope_base) / head_dim
        block_r = min(common.block(comp.uk.shape[2]), rank_chunk or MAX_BLOCK_R)
        args = [q, q_pos, comp.uk, comp.wk, comp.uv, comp.rank_k, comp.rank_v, comp.pos, comp.length, logits,
                part_rank, part_lse,
                *q.stride(), *q_pos.stride(), *comp.uk.stride(), *comp.wk.stride(), *comp.uv.stride(),
                *comp.rank_k.stride(), *comp.rank_v.stride(), *comp.pos.stride(), *comp.length.stride(),
                *logits.stride(), *part_rank.stride(), *part_lse.stride(),
                comp.uk.shape[2], comp.uv.shape[2], scale * common.LOG2E, rope_step, *tune]
        meta = dict(shared, HALF=head_dim // 2, ROPE=rope_base is not None, BLOCK_HALF=common.block(head_dim // 2),
                    BLOCK_R=block_r, BLOCK_RV=common.block(comp.uv.shape[2]), ONE_CHUNK=block_r >= comp.uk.shape[2],
                    ON_GPU=not interpreter_mode(), STORE_LOGITS=mass)
        if block_n is not None or interpreter_mode():
            _stage1_kernel[grid](*args, **meta, BLOCK_N=block_n or INTERPRET_BLOCK_N,
                                 num_warps=DEFAULT_WARPS["_stage1_kernel"], num_stages=DEFAULT_STAGES)
        else:
            _stage1_tuned[grid](*args, **meta)
    # The fused call's merge attends the dense segment itself (one launch fewer).
    _merge(q, q_pos, comp, dense, dense_logits, part_o, part_rank, part_lse, out, lse, shared, scale,
           dense_in_merge=not absorbed, store_logits=mass)
    if mass and absorbed:
        _rank_space_masses(q_pos, comp, logits, lse, mass_comp, mass_dense, dense.length, q_rank, heads * queries,
                           queries, scale, shared["UW_DT"])
    elif mass and tokens + slots:
        _mass_kernel[(batch, triton.cdiv(tokens + slots, MASS_BLOCK_T))](
            logits, lse, mass_comp, mass_dense, comp.length, dense.length,
            logits.stride(0), _logit_row_stride(logits), logits.stride(3), *lse.stride(), *mass_comp.stride(),
            *mass_dense.stride(), *comp.length.stride(), *dense.length.stride(),
            tokens, tokens + slots, heads * queries, _logit_row_width(logits), 1.0 / (heads * queries),
            N_QUERIES=queries, BLOCK_R=MASS_BLOCK_R * 2 // logits.element_size(), BLOCK_T=MASS_BLOCK_T)
    return DecodeOutput(out, lse, mass_comp, mass_dense)


def _absorbed_stage1(q_pos, comp, part_rank, part_lse, q_rank, shared, scale, tune, grid, block_n) -> None:
    """The absorbed kernel's compressed segment: the splits in rank space
    (q~ made by _query_dense_kernel, launched first)."""
    kv_heads, group, queries = shared["KV_HEADS"], shared["GROUP"], shared["N_QUERIES"]
    rank_k, rank_v = comp.uk.shape[2], comp.uv.shape[2]
    args = [q_pos, comp.uk, comp.uv, comp.rank_k, comp.rank_v, comp.pos, comp.length, part_rank, part_lse, q_rank,
            *q_pos.stride(), *comp.uk.stride(), *comp.uv.stride(), *comp.rank_k.stride(), *comp.rank_v.stride(),
            *comp.pos.stride(), *comp.length.stride(), *part_rank.stride(), *part_lse.stride(), *q_rank.stride(),
            rank_k, rank_v, scale * common.LOG2E, *tune]
    meta = dict(KV_HEADS=kv_heads, GROUP=group, N_QUERIES=queries, BLOCK_ROWS=shared["BLOCK_ROWS"],
                BLOCK_RK=common.block(rank_k), BLOCK_RV=common.block(rank_v), UW_DT=shared["UW_DT"])
    if block_n is not None or interpreter_mode():
        _stage1_absorbed_kernel[grid](*args, **meta, BLOCK_N=block_n or INTERPRET_BLOCK_N,
                                      num_warps=DEFAULT_WARPS["_stage1_absorbed_kernel"], num_stages=DEFAULT_STAGES)
    else:
        _stage1_absorbed_tuned[grid](*args, **meta)


def _dense_meta(dense: DenseKV, shared: dict, store_logits: bool) -> dict:
    """The dense segment's constexprs and launch shape, in either call's launch."""
    meta = dict(QK_DT=shared["QK_DT"], BLOCK_N=DENSE_BLOCK_N, STORE_LOGITS=store_logits,
                num_warps=dense_warps(dense.k.element_size(), shared["BLOCK_D"]), num_stages=2)
    if dense.k.element_size() == 2 and shared["BLOCK_D"] <= 128:
        meta.update(DENSE_TILE)
    return meta


def _query_dense(q, q_pos, comp, dense, dense_logits, part_o, part_lse, q_rank, shared, scale, *,
                 store_logits: bool) -> None:
    """The absorbed call's first launch: the rank-space queries, then the
    dense segment (its partial in the last slot; its logits for the masses
    when store_logits)."""
    batch, heads, queries, head_dim = q.shape
    splits = part_lse.shape[3] - 1
    part_dense = part_o[:, :, :, 0]
    # The float32 products into rank space may use tf32 tensor cores when q
    # and W_k are 16-bit: such values are exact in tf32, so only the
    # accumulated rank-space values get rounded (like fp16).
    exact = all(t.dtype != torch.float32 for t in (q, comp.wk)) and not interpreter_mode()
    _query_dense_kernel[(batch, shared["KV_HEADS"])](
        q, q_pos, dense.k, dense.v, dense.pos, dense.length, dense_logits, part_dense, part_lse, comp.wk, q_rank,
        *q.stride(), *q_pos.stride(), *dense.k.stride(), *dense.v.stride(), *dense.pos.stride(),
        *dense.length.stride(), *dense_logits.stride(), *part_dense.stride(), *part_lse.stride(),
        *comp.wk.stride(), *q_rank.stride(), head_dim, splits, scale * common.LOG2E, comp.uk.shape[2],
        GROUP=shared["GROUP"], N_QUERIES=queries, BLOCK_G=common.block(shared["GROUP"] * queries),
        BLOCK_D=shared["BLOCK_D"], **_dense_meta(dense, shared, store_logits),
        BLOCK_RK=common.block(comp.uk.shape[2]), UW_DT=shared["UW_DT"], RANK_PREC="tf32" if exact else "ieee")


def _merge(q, q_pos, comp, dense, dense_logits, part_o, part_rank, part_lse, out, lse, shared, scale, *,
           dense_in_merge: bool, store_logits: bool) -> None:
    """Every partial merged, W_v applied once per sequence; with
    dense_in_merge (the fused call) the dense segment attended in the same
    programs, its logits stored for the masses when store_logits."""
    batch, heads, queries, head_dim = out.shape
    splits = part_rank.shape[3]
    part_dense = out if dense_in_merge else part_o[:, :, :, 0]  # not read with dense_in_merge
    block_g, row_blocks = merge_row_blocks(shared["GROUP"] * queries)
    launch = _dense_meta(dense, shared, store_logits) if dense_in_merge else \
        dict(QK_DT=shared["QK_DT"], BLOCK_N=DENSE_BLOCK_N, STORE_LOGITS=False)
    _merge_rank_kernel[(batch, shared["KV_HEADS"], row_blocks)](
        part_dense, part_rank, part_lse, comp.wv, out, lse,
        q, q_pos, dense.k, dense.v, dense.pos, dense.length, dense_logits,
        *part_dense.stride(), *part_rank.stride(), *part_lse.stride(), *comp.wv.stride(), *out.stride(),
        *lse.stride(), *q.stride(), *q_pos.stride(), *dense.k.stride(), *dense.v.stride(), *dense.pos.stride(),
        *dense.length.stride(), *dense_logits.stride(), splits, comp.uv.shape[2], scale * common.LOG2E,
        GROUP=shared["GROUP"], N_QUERIES=queries, HEAD_DIM=head_dim, BLOCK_D=shared["BLOCK_D"],
        BLOCK_RV=min(MERGE_RANK_CHUNK_F32 if shared["UW_DT"] == tl.float32 else MERGE_RANK_CHUNK,
                     common.block(comp.uv.shape[2])), BLOCK_G=block_g,
        UW_DT=shared["UW_DT"], DENSE=dense_in_merge, SPLITS=1 if shared["UW_DT"] == tl.float32 else MERGE_SPLITS, **launch)


def merge_row_blocks(group_rows: int) -> tuple[int, int]:
    """Rows a merge program takes (a power of two, at least tl.dot's 16, at
    most MERGE_ROWS) and the programs per (sequence, kv head) for a kv
    head's group_rows query rows. The launcher and the op's model both ask
    here."""
    block_g = min(MERGE_ROWS, common.block(group_rows))
    return block_g, -(-group_rows // block_g)


def dense_warps(elem_bytes: int, block_d: int) -> int:
    """Warps of a program attending the dense segment: its K and V tiles
    [DENSE_BLOCK_N, block_d] live in registers, so tiles wider than a 16-bit
    [32, 128] pair get 8 (float32 rows of head_dim 80 spill on 4)."""
    return 8 if elem_bytes * block_d * DENSE_BLOCK_N > 2 * 128 * 32 else 4


def _rank_space_masses(q_pos, comp, logits, lse, mass_comp, mass_dense, dense_length, q_rank, rows, queries, scale,
                       uw_dt) -> None:
    """The absorbed kernel's masses, one launch: compressed tokens
    recomputed in rank space, dense tokens from their stored logits."""
    batch, tokens = mass_comp.shape
    slots = mass_dense.shape[1]
    block_t, warps = mass_rank_tile(common.block(rows), common.block(comp.uk.shape[2]), uw_dt)
    span = mass_span(tokens, batch, splitk.sm_count(q_pos.device))
    blocks = triton.cdiv(tokens, span) + triton.cdiv(slots, MASS_DENSE_BLOCK_T)
    if not batch or not blocks:
        return
    _mass_rank_kernel[(batch, blocks)](
        lse, mass_comp, comp.length, q_rank, comp.uk, comp.rank_k, comp.pos, q_pos, logits, mass_dense, dense_length,
        *lse.stride(), *mass_comp.stride(), *comp.length.stride(), *q_rank.stride(), *comp.uk.stride(),
        *comp.rank_k.stride(), *comp.pos.stride(), *q_pos.stride(), logits.stride(0), _logit_row_stride(logits),
        logits.stride(3), *mass_dense.stride(), *dense_length.stride(),
        tokens, tokens + slots, rows, _logit_row_width(logits), 1.0 / rows, scale * common.LOG2E, comp.uk.shape[2],
        N_QUERIES=queries, SPAN=span, BLOCK_T=block_t, BLOCK_ROWS=common.block(rows),
        BLOCK_RK=common.block(comp.uk.shape[2]), UW_DT=uw_dt, DENSE_BLOCK_T=MASS_DENSE_BLOCK_T,
        DENSE_BLOCK_R=MASS_DENSE_BLOCK_R,
        num_warps=warps, num_stages=3)


def mass_span(tokens: int, batch: int, sms: int | None) -> int:
    """Compressed columns per _mass_rank_kernel program: the fewest, from
    MASS_SPAN up by powers of two, that keep the grid within one wave of
    MASS_PROGRAMS_PER_SM programs an SM; each program loads its rows' q~
    and LSEs once, so longer spans pay that less often. MASS_SPAN on the
    interpreter (sms None). The launcher and the op's model both ask here."""
    span = MASS_SPAN
    while sms and batch * -(-tokens // span) > MASS_PROGRAMS_PER_SM * sms and span < tokens:
        span *= 2
    return span


def mass_rank_tile(block_rows: int, block_rk: int, uw_dt) -> tuple[int, int]:
    """Tokens per U_k tile and warps of _mass_rank_kernel: 256 tokens on 4
    warps for 16-bit factors (32 KB a pipeline stage and a [32, 256] float32
    score tile at rank 64 and 32 rows), fewer for wider ranks or more rows;
    float32 factors take dots without tensor cores, whose operands need 8
    warps for 128 tokens (4 warps spill)."""
    if uw_dt == tl.float32:
        block_t, warps, budget = 128, 8, 128 * 64
    else:
        block_t, warps, budget = 256, 4, 256 * 64
    while block_t > 32 and (block_t * block_rk > budget or block_t * block_rows > budget // 2):
        block_t //= 2
    return block_t, warps


def default_num_splits(comp: CompressedKV, dense: DenseKV, *, absorbed: bool = False) -> int:
    """The num_splits a call of lowrank_decode (absorbed=True:
    lowrank_decode_absorbed) with num_splits=None uses (one host sync); pass
    it explicitly to keep repeated calls free of synchronisation. Both
    kernels run one program per (sequence, split); an SM holds two of the
    absorbed kernel's and one of the fused kernel's, so their defaults may
    differ."""
    return _num_splits(None, comp, dense, comp.length.shape[0], comp.length.device, absorbed)


def _num_splits(num_splits, comp: CompressedKV, dense: DenseKV, programs_per_split: int, device,
                absorbed: bool) -> int:
    """Splits per sequence: num_splits checked, else split_count's default for
    the longest sequence."""
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
        return num_splits
    lengths = comp.length  # the splits cover the compressed segment (the dense one has its own programs)
    longest = int(lengths.max()) if lengths.numel() else 0  # one host sync
    return split_count(longest, programs_per_split, splitk.sm_count(device), absorbed=absorbed)


def split_count(longest: int, programs_per_split: int, sms: int | None, *, absorbed: bool) -> int:
    """The default split count for the longest sequence's compressed tokens, with
    `programs_per_split` programs per split (the batch) on `sms` SMs (None:
    the interpreter: about TOKENS_PER_SPLIT tokens each, at most
    DEFAULT_MAX_SPLITS). On a GPU, splitk.wave_split_count's: the fewest
    waves of the kernel's SPLIT_PROGRAMS_PER_SM programs an SM (absorbed or
    fused) times the longest split, in SPLIT_TILE-token tiles plus
    SPLIT_COST_TILES."""
    per_sm = SPLIT_PROGRAMS_PER_SM["absorbed" if absorbed else "fused"]
    return splitk.wave_split_count(longest, programs_per_split, tile=SPLIT_TILE,
                                   programs_per_sm=per_sm, cost_tiles=SPLIT_COST_TILES,
                                   max_splits=DEFAULT_MAX_SPLITS, interpreter_split=TOKENS_PER_SPLIT, sms=sms)
