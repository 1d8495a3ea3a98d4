"""Split-K flash-decoding over a quantized KV cache: up to two quantized
segments of one bit width each (ops.kv_quant layout), then an uncompressed
segment; dequantization happens in registers, tile by tile, and no
dequantized copy is ever written. What is computed: contract.py.

Stage 1, `_stage1_kernel`: one program per (kv head, sequence, split) owns
every query row of its kv group (GROUP query heads x M query tokens, padded
to a power of two >= 16 for tl.dot; SGLang's grouped decode), so a tile's
codes are read and dequantized once for the whole group. Its split is a
contiguous range of [segment 0 | segment 1 | dense] slots, rounded to whole
tiles; a tile of BLOCK_N slots (64 or 128, the autotuner's choice, less
where tile_cap says) has one bit width and the key scales of the groups it
spans. Keys and values
both come as BLOCK_N / P rows of D contiguous words (P codes per int32
word, two channels of P/2 slots each); each loop loads the next tile's
words, scales and positions into registers before it works on this one
(one pipeline stage: no shared-memory ring, so 3 programs fit an SM).

Dequantizing a tile costs a LOP3, an HADD2 and an HFMA2 per pair of fp16
elements and one shift a word (bf16: two FMAs, and two or three shifts a
word; kv_quant.kernel: the magic-number trick on a word's two halves, which
hold neighbouring channels, each code taken where it lies in the
mantissa), all in the
registers of the thread that loaded the word. The tile's rows are its
slots in a fixed permutation (kv_quant.kernel.tile_slots) so those
registers are already the rows Triton lays the tile out in; positions load
in the same order, and attention does not depend on slot order. The fp16
tile then goes to the MMAs through one vectorized shared-memory store and
ldmatrix; or, in the KEY_OPERAND config (128-slot tiles on 4 warps), the
keys go to the QK MMA from registers, each thread having loaded exactly
the words, key scales and zeros of its part of the operand, channels
permuted in the queries and keys alike (kv_quant.kernel's
load_key_operand). With one query token (decode) which slots the rows see
is one column mask added to the scores (splitk._attend_tile's ONE_QUERY).
Stage 2 merges the splits (ops.splitk).

Reference: reference.py beside this file.
"""

import torch
import triton
import triton.language as tl

from kernels_py.ops import common, splitk
from kernels_py.ops.kv_quant.kernel import (
    OPERAND_N, OPERAND_TILE, OPERAND_WARPS, PAD, dequantize_key_operand, dequantize_keys, dequantize_values,
    key_operand_channels, key_operand_slots, load_key_operand, load_tile, load_value_scales, load_value_words,
    operand_value_rows, tile_slots)
from kernels_py.ops.quant_decode.contract import DenseKV, QuantDecodeOutput, check_inputs
from kernels_py.ops.splitk import _attend_tile, _group_queries, _store_split

MAX_ROWS = 128  # query heads per kv head x query tokens, one program's rows
TOKENS_PER_SPLIT = 512  # default split size under the interpreter
DEFAULT_MAX_SPLITS = 64
# On a GPU the split count is chosen by waves (split_count): 128-slot tiles
# (the picked configs' TILE), two stage-1 programs an SM (the 4-warp config
# without a register cap holds two; any whole number of waves of two is at
# most as many of three), and a split's fixed cost of about a tile (its
# queries, its first tile's loads waited at HBM latency, its partial).
SPLIT_TILE = 128
SPLIT_PROGRAMS_PER_SM = 2
SPLIT_COST_TILES = 1
TILES = (64, 128)  # slots per tile the autotuner tries (the launcher may cap them: tile_cap)
DEFAULT_WARPS, DEFAULT_STAGES = 4, 1  # one stage: the loops prefetch the next tile into registers themselves
WIDE_ROWS = 64  # more rows than this (e.g. 32 query heads per kv head x 4 tokens) run on 8 warps: 4 spill


@triton.jit
def _segment_range(lo, hi, seg_start, seg_len):
    """[lo, hi) of the concatenated slots, as a range of one segment's own slots."""
    a = tl.minimum(tl.maximum(lo - seg_start, 0), seg_len)
    b = tl.minimum(tl.maximum(hi - seg_start, 0), seg_len)
    return a, b


@triton.jit
def _load_operand_tile(KC, KS, KZ, VC, VS, VZ, start, end, stride_kcw, stride_kcd, stride_ksg, stride_ksd,
                       stride_vcw, stride_vcd, stride_vsn, stride_vsg, head_dim, BITS: tl.constexpr,
                       GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """load_tile's tuple for a tile whose keys are the MMA operand:
    load_key_operand's key words, scales and zeros, then the value ones."""
    k_words, k_scale, k_zero = load_key_operand(KC, KS, KZ, start, end, stride_kcw, stride_kcd, stride_ksg,
                                                stride_ksd, head_dim, BITS, GROUP, BLOCK_D)
    v_words = load_value_words(VC, start, end, stride_vcw, stride_vcd, head_dim, BITS, BLOCK_N, BLOCK_D)
    v_scale, v_zero = load_value_scales(VS, VZ, start, end, stride_vsn, stride_vsg, head_dim, BITS, GROUP, BLOCK_N,
                                        BLOCK_D)
    return k_words, k_scale, k_zero, v_words, v_scale, v_zero


@triton.jit
def _attend_quantized(q, q_pos, q_pos0, row_mask, m_i, l_i, acc, lo, hi,
                      KC, KS, KZ, VC, VS, VZ, Pos,
                      stride_kcw, stride_kcd, stride_ksg, stride_ksd, stride_vcw, stride_vcd, stride_vsn,
                      stride_vsg, stride_pn, qk_scale, head_dim,
                      BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      QK_DT: tl.constexpr, ON_GPU: tl.constexpr, ONE_QUERY: tl.constexpr,
                      KEY_OPERAND: tl.constexpr):
    """Online softmax over the slots [lo, hi) of one quantized segment (of one
    kv head of one sequence); lo starts a key group or is a multiple of
    BLOCK_N (tile_cap), and hi is a multiple of 16 / BITS. The next tile's
    words are loaded before this tile is unpacked, so their latency hides
    behind this tile's work (registers, not shared memory: a few words a
    thread). KEY_OPERAND (128-slot tiles): the keys are the QK MMA's operand
    straight from registers (kv_quant's load_key_operand), q's channels in
    key_operand_channels' order, the columns, the value tile's rows and the
    positions in key_operand_slots'; otherwise keys and values unpack alike,
    rows in tile_slots' order."""
    if KEY_OPERAND:
        offs_t = key_operand_slots(BITS)
        nxt = _load_operand_tile(KC, KS, KZ, VC, VS, VZ, lo, hi, stride_kcw, stride_kcd, stride_ksg, stride_ksd,
                                 stride_vcw, stride_vcd, stride_vsn, stride_vsg, head_dim, BITS, GROUP, BLOCK_N,
                                 BLOCK_D)
    else:
        offs_t = tile_slots(BITS, BLOCK_N)
        nxt = load_tile(KC, KS, KZ, VC, VS, VZ, lo, hi, stride_kcw, stride_kcd, stride_ksg, stride_ksd, stride_vcw,
                        stride_vcd, stride_vsn, stride_vsg, head_dim, BITS, GROUP, BLOCK_N, BLOCK_D)
    pos_nxt = tl.load(Pos + (lo + offs_t) * stride_pn, mask=lo + offs_t < hi, other=PAD)
    for start in range(lo, hi, BLOCK_N):
        k_words, k_scale, k_zero, v_words, v_scale, v_zero = nxt
        pos = pos_nxt
        tok_mask = start + offs_t < hi
        ahead = start + BLOCK_N
        pos_nxt = tl.load(Pos + (ahead + offs_t) * stride_pn, mask=ahead + offs_t < hi, other=PAD)
        if KEY_OPERAND:
            nxt = _load_operand_tile(KC, KS, KZ, VC, VS, VZ, ahead, hi, stride_kcw, stride_kcd, stride_ksg,
                                     stride_ksd, stride_vcw, stride_vcd, stride_vsn, stride_vsg, head_dim, BITS,
                                     GROUP, BLOCK_N, BLOCK_D)
            k = dequantize_key_operand(k_words, k_scale, k_zero, BITS, BLOCK_D, QK_DT, ON_GPU)
            v = operand_value_rows(dequantize_values(v_words, v_scale, v_zero, BITS, GROUP, BLOCK_N, BLOCK_D, QK_DT,
                                                     ON_GPU), BITS, BLOCK_D)
        else:
            nxt = load_tile(KC, KS, KZ, VC, VS, VZ, ahead, hi, stride_kcw, stride_kcd, stride_ksg, stride_ksd,
                            stride_vcw, stride_vcd, stride_vsn, stride_vsg, head_dim, BITS, GROUP, BLOCK_N, BLOCK_D)
            k = dequantize_keys(k_words, k_scale, k_zero, BITS, GROUP, BLOCK_N, BLOCK_D, QK_DT, ON_GPU)
            v = dequantize_values(v_words, v_scale, v_zero, BITS, GROUP, BLOCK_N, BLOCK_D, QK_DT, ON_GPU)
        m_i, l_i, acc = _attend_tile(q, k, v, pos, tok_mask, q_pos, row_mask, m_i, l_i, acc, qk_scale, QK_DT,
                                     q_pos0, ONE_QUERY, KEY_OPERAND)
    return m_i, l_i, acc


@triton.jit
def _stage1_kernel(
    Q, QPos,
    AKC, AKS, AKZ, AVC, AVS, AVZ, APos, ALen,
    BKC, BKS, BKZ, BVC, BVS, BVZ, BPos, BLen,
    DK, DV, DPos, DLen, PartO, PartLse,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_pb, stride_pm,
    sa_kcb, sa_kch, sa_kcw, sa_kcd, sa_ksb, sa_ksh, sa_ksg, sa_ksd,
    sa_vcb, sa_vch, sa_vcw, sa_vcd, sa_vsb, sa_vsh, sa_vsn, sa_vsg, sa_pb, sa_pn, sa_lb,
    sb_kcb, sb_kch, sb_kcw, sb_kcd, sb_ksb, sb_ksh, sb_ksg, sb_ksd,
    sb_vcb, sb_vch, sb_vcw, sb_vcd, sb_vsb, sb_vsh, sb_vsn, sb_vsg, sb_pb, sb_pn, sb_lb,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_dpb, stride_dpn, stride_dlb,
    stride_ob, stride_oh, stride_om, stride_os, stride_od,
    stride_sb, stride_sh, stride_sm, stride_ss,
    qk_scale, head_dim, tune_programs, tune_span,
    GROUP: tl.constexpr, N_QUERIES: tl.constexpr, TWO_SEGMENTS: tl.constexpr,
    BITS_A: tl.constexpr, GROUP_A: tl.constexpr, BITS_B: tl.constexpr, GROUP_B: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, QK_DT: tl.constexpr, TILE: tl.constexpr,
    TILE_MAX: tl.constexpr, ON_GPU: tl.constexpr, KEY_OPERAND: tl.constexpr = False,
):
    kv_head = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    n_splits = tl.num_programs(2)
    BLOCK_N: tl.constexpr = TILE_MAX if TILE > TILE_MAX else TILE
    ONE_QUERY: tl.constexpr = N_QUERIES == 1

    head, query, row_mask, q_pos, offs_d, d_mask, q = _group_queries(
        Q, QPos, kv_head, b, stride_qb, stride_qh, stride_qm, stride_qd, stride_pb, stride_pm, head_dim,
        GROUP, N_QUERIES, BLOCK_ROWS, BLOCK_D, QK_DT)

    # KEY_OPERAND: 128-slot tiles take their keys as the QK MMA's operand from
    # registers, channels permuted (kv_quant's key_operand_channels): the
    # queries too.
    OPERAND: tl.constexpr = KEY_OPERAND and BLOCK_N == OPERAND_N and BLOCK_D >= 32
    if OPERAND:
        q_channel = key_operand_channels(BLOCK_D)
        q_key = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + query[:, None] * stride_qm
                        + q_channel[None, :] * stride_qd, mask=row_mask[:, None] & (q_channel < head_dim)[None, :],
                        other=0.0).to(QK_DT)
    else:
        q_key = q
    q_pos0 = tl.load(QPos + b * stride_pb).to(tl.int32)  # the query's position when ONE_QUERY
    a_len = tl.load(ALen + b * sa_lb).to(tl.int32)
    b_len = 0
    if TWO_SEGMENTS:
        b_len = tl.load(BLen + b * sb_lb).to(tl.int32)
    d_len = tl.load(DLen + b * stride_dlb).to(tl.int32)
    total = a_len + b_len + d_len
    per_split = tl.cdiv(tl.cdiv(total, n_splits), BLOCK_N) * BLOCK_N
    lo = tl.minimum(split * per_split, total)
    hi = tl.minimum(lo + per_split, total)

    m_i = tl.full([BLOCK_ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    acc = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)

    a_lo, a_hi = _segment_range(lo, hi, 0, a_len)
    m_i, l_i, acc = _attend_quantized(
        q_key, q_pos, q_pos0, row_mask, m_i, l_i, acc, a_lo, a_hi,
        AKC + b * sa_kcb + kv_head * sa_kch, AKS + b * sa_ksb + kv_head * sa_ksh, AKZ + b * sa_ksb + kv_head * sa_ksh,
        AVC + b * sa_vcb + kv_head * sa_vch, AVS + b * sa_vsb + kv_head * sa_vsh, AVZ + b * sa_vsb + kv_head * sa_vsh,
        APos + b * sa_pb, sa_kcw, sa_kcd, sa_ksg, sa_ksd, sa_vcw, sa_vcd, sa_vsn, sa_vsg, sa_pn,
        qk_scale, head_dim, BITS_A, GROUP_A, BLOCK_N, BLOCK_D, QK_DT, ON_GPU, ONE_QUERY, OPERAND)
    if TWO_SEGMENTS:
        b_lo, b_hi = _segment_range(lo, hi, a_len, b_len)
        m_i, l_i, acc = _attend_quantized(
            q_key, q_pos, q_pos0, row_mask, m_i, l_i, acc, b_lo, b_hi,
            BKC + b * sb_kcb + kv_head * sb_kch, BKS + b * sb_ksb + kv_head * sb_ksh,
            BKZ + b * sb_ksb + kv_head * sb_ksh, BVC + b * sb_vcb + kv_head * sb_vch,
            BVS + b * sb_vsb + kv_head * sb_vsh, BVZ + b * sb_vsb + kv_head * sb_vsh,
            BPos + b * sb_pb, sb_kcw, sb_kcd, sb_ksg, sb_ksd, sb_vcw, sb_vcd, sb_vsn, sb_vsg, sb_pn,
            qk_scale, head_dim, BITS_B, GROUP_B, BLOCK_N, BLOCK_D, QK_DT, ON_GPU, ONE_QUERY, OPERAND)

    d_lo, d_hi = _segment_range(lo, hi, a_len + b_len, d_len)
    DK_h = DK + b * stride_dkb + kv_head * stride_dkh
    DV_h = DV + b * stride_dvb + kv_head * stride_dvh
    for start in range(d_lo, d_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        tok_mask = offs_n < d_hi
        pos = tl.load(DPos + b * stride_dpb + offs_n * stride_dpn, mask=tok_mask, other=0).to(tl.int32)
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        k = tl.load(DK_h + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd, mask=kv_mask, other=0.0)
        v = tl.load(DV_h + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd, mask=kv_mask, other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, pos, tok_mask, q_pos, row_mask, m_i, l_i, acc, qk_scale, QK_DT,
                                     q_pos0, ONE_QUERY)

    part_rows = b * stride_ob + head[:, None] * stride_oh + query[:, None] * stride_om + split * stride_os
    lse_rows = b * stride_sb + head * stride_sh + query * stride_sm + split * stride_ss
    _store_split(PartO + part_rows, PartLse + lse_rows, acc, m_i, l_i, offs_d, d_mask, row_mask, stride_od)


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------


# The configs the autotuner times (configs that spill at the shape being
# tuned are pruned first): 64- or 128-slot tiles (a 128-slot tile pays the
# grouped attention's per-tile work, its softmax, barriers and the
# probabilities' trip through shared memory, once for twice the slots, for
# about 90 more registers), on 4 warps with or without a 168-register cap
# (3 programs an SM), or on 8 warps, which the rows 4 cannot hold need (32
# query heads per kv head x 4 tokens). One stage: the loops prefetch the
# next tile into registers themselves. And the 128-slot tile on 4 warps with
# its keys as the QK MMA's operand from registers (KEY_OPERAND: no trip
# through shared memory, but each thread's own key scales and twice the
# 2-bit words loaded; by the estimate, fewer load/store cycles and barriers
# for more instructions, so the GPU decides). Under the interpreter the
# launcher runs a pinned config (every config would run in Python).
STAGE1_CONFIGS = [triton.Config({"TILE": tile}, num_warps=DEFAULT_WARPS, num_stages=DEFAULT_STAGES, maxnreg=cap)
                  for tile in TILES for cap in (168, None)]
STAGE1_CONFIGS += [triton.Config({"TILE": tile}, num_warps=2 * DEFAULT_WARPS, num_stages=DEFAULT_STAGES)
                   for tile in TILES]
STAGE1_CONFIGS += [triton.Config({"TILE": TILES[-1], "KEY_OPERAND": True}, num_warps=OPERAND_WARPS,
                                 num_stages=DEFAULT_STAGES)]
_prune_spilling = common.prune_spilling(_stage1_kernel)


def distinct_configs(configs, tile_max: int) -> list:
    """The configs that compile to different kernels under a launch capping
    the tile at tile_max (TILE > TILE_MAX runs the capped tile, the same
    kernel as another config's; KEY_OPERAND asks for nothing on smaller
    tiles): the first of each."""
    seen, kept = set(), []
    for c in configs:
        tile = min(c.kwargs["TILE"], tile_max)
        operand = bool(c.kwargs.get("KEY_OPERAND")) and tile == OPERAND_TILE
        key = (tile, operand, c.num_warps, c.num_stages, c.maxnreg)
        if key not in seen:
            seen.add(key)
            kept.append(c)
    return kept


def _prune_stage1(configs, named_args, **launch):
    """The autotuner's early prune: one config per distinct kernel, then
    none that spills."""
    return _prune_spilling(distinct_configs(configs, launch.get("TILE_MAX", TILES[-1])), named_args, **launch)


# No QK_DT in the key: it follows from the inputs' dtypes, which the autotuner
# adds to every key itself, and a tl.dtype cannot be written to its disk cache.
_stage1_tuned = triton.autotune(
    configs=STAGE1_CONFIGS, cache_results=True,
    key=["tune_programs", "tune_span", "GROUP", "N_QUERIES", "TWO_SEGMENTS", "BITS_A", "GROUP_A", "BITS_B",
         "GROUP_B", "BLOCK_ROWS", "BLOCK_D", "TILE_MAX"],
    prune_configs_by={"early_config_prune": _prune_stage1})(_stage1_kernel)


def default_num_splits(segments, dense: DenseKV) -> int:
    """Splits per (sequence, kv head) for the longest sequence's slots
    (split_count). One host sync."""
    lengths = dense.length.to(torch.int64) + sum(seg.length.to(torch.int64) for seg in segments)
    longest = int(lengths.max()) if lengths.numel() else 0
    return split_count(longest, lengths.numel() * segments[0].kv_heads, splitk.sm_count(dense.length.device))


def split_count(longest: int, programs_per_split: int, sms: int | None) -> int:
    """The default split count for the longest sequence's slots, with
    `programs_per_split` programs per split (kv heads x sequences) on `sms`
    SMs. Under the interpreter (sms None) about TOKENS_PER_SPLIT slots each,
    at most DEFAULT_MAX_SPLITS; on a GPU splitk.wave_split_count's, the
    fewest waves of SPLIT_PROGRAMS_PER_SM programs an SM times the longest
    split (SPLIT_TILE-slot tiles plus SPLIT_COST_TILES): at 32K slots, 8
    kv heads and 8 sequences 4 splits in one wave, where 64 of 512 slots
    took 15.5 waves."""
    return splitk.wave_split_count(longest, programs_per_split, tile=SPLIT_TILE,
                                   programs_per_sm=SPLIT_PROGRAMS_PER_SM, cost_tiles=SPLIT_COST_TILES,
                                   max_splits=DEFAULT_MAX_SPLITS, interpreter_split=TOKENS_PER_SPLIT, sms=sms)


def tile_cap(segments) -> int:
    """The largest tile the segments allow. A tile spanning several key
    groups must start on a group's first slot: the second segment's tiles
    start at the first one's length, a whole number of its groups, which is
    a whole number of the second's only when those are no larger. Otherwise
    a tile is the first segment's group (smaller than the second's, so at
    most 64), inside one group of each."""
    if len(segments) == 2 and segments[1].group > segments[0].group:
        return segments[0].group
    return TILES[-1]


def quant_decode(q: torch.Tensor, q_pos: torch.Tensor, segments, dense: DenseKV, *, sm_scale: float | None = None,
                 num_splits: int | None = None, workspace: splitk.Workspace | None = None,
                 check_values: bool = True, tile: int | None = None,
                 key_operand: bool | None = None) -> QuantDecodeOutput:
    """One decode step over [segments[0] | segments[1] | dense].

    q: [B, Hq, M, D] fp16/bf16/fp32, M new query tokens per sequence;
    q_pos: [B, M] int, their positions (a token is visible iff its position
    is at most the query's). segments: one or two kv_quant.QuantKV (any bit
    widths and group sizes, the same kv heads and head_dim); dense: the
    uncompressed segment (DenseKV, keys as cached). sm_scale: default
    D ** -0.5. num_splits: splits per (sequence, kv head), default
    default_num_splits (one host sync). workspace: make_workspace's scratch,
    reused across calls (no allocation; its split count is used).
    check_values=False skips the checks that wait for the device. tile pins
    the slots per tile (64 or 128, TILES; tile_cap may lower it) and then
    runs without the autotuner: 4 warps (8 for more than WIDE_ROWS rows), no
    register cap, no spill pruning. Default: the autotuner's pick on a GPU,
    128 under the interpreter. key_operand, with a pinned tile: 128-slot
    tiles on 4 warps take their keys as the QK MMA's operand from registers
    (the KEY_OPERAND config; default True there, False elsewhere, where it
    does nothing).
    Returns QuantDecodeOutput(out [B, Hq, M, D] q.dtype, lse [B, Hq, M] float32).
    """
    check_inputs(q, q_pos, segments, dense, check_values)
    common.check_launchable(q)
    batch, heads, queries, head_dim = q.shape
    kv_heads = segments[0].kv_heads
    group = heads // kv_heads
    # An int: 64.0 equals 64 but reached the kernel as a float constexpr, which failed to compile.
    if tile is not None and (type(tile) is not int or tile not in TILES):
        raise ValueError(f"tile={tile!r}: tile must be one of {list(TILES)} (an int; the kernel may use fewer "
                         f"slots, tile_cap)")
    if group * queries > MAX_ROWS:
        raise ValueError(f"query heads per kv head x query tokens = {group * queries} exceeds {MAX_ROWS}, the rows "
                         f"one program holds")
    scale = common.softmax_scale(sm_scale, head_dim, "sm_scale")
    dev = q.device
    out = torch.empty((batch, heads, queries, head_dim), dtype=q.dtype, device=dev)
    lse = torch.empty((batch, heads, queries), dtype=torch.float32, device=dev)
    if batch == 0 or heads == 0 or queries == 0:
        return QuantDecodeOutput(out, lse)
    workspace = splitk.workspace_for(q, workspace, num_splits, lambda: default_num_splits(segments, dense))
    splits = workspace.splits
    a = segments[0]
    b = segments[1] if len(segments) == 2 else a
    seg_args, seg_strides = [], []
    for seg in (a, b):
        seg_args += [seg.k_codes, seg.k_scale, seg.k_zero, seg.v_codes, seg.v_scale, seg.v_zero, seg.pos, seg.length]
        seg_strides += [*seg.k_codes.stride(), *seg.k_scale.stride(), *seg.v_codes.stride(), *seg.v_scale.stride(),
                        *seg.pos.stride(), *seg.length.stride()]
    args = [q, q_pos, *seg_args, dense.k, dense.v, dense.pos, dense.length, workspace.part_o, workspace.part_lse,
            *q.stride(), *q_pos.stride(), *seg_strides,
            *dense.k.stride(), *dense.v.stride(), *dense.pos.stride(), *dense.length.stride(),
            *workspace.part_o.stride(), *workspace.part_lse.stride(), scale * common.LOG2E, head_dim,
            *splitk.tune_buckets(batch * kv_heads * splits, sum(seg.slots for seg in segments) + dense.k.shape[2], splits)]
    meta = dict(GROUP=group, N_QUERIES=queries, TWO_SEGMENTS=len(segments) == 2,
                BITS_A=a.bits, GROUP_A=a.group, BITS_B=b.bits, GROUP_B=b.group,
                BLOCK_ROWS=common.block(group * queries), BLOCK_D=common.block(head_dim),
                QK_DT=common.dot_dtype(q.dtype, dense.k.dtype, dense.v.dtype),
                TILE_MAX=tile_cap(segments), ON_GPU=not common.interpreter_mode())
    grid = (kv_heads, batch, splits)
    if tile is not None or common.interpreter_mode():
        wide = group * queries > WIDE_ROWS
        _stage1_kernel[grid](*args, **meta, TILE=tile or TILES[-1],
                             KEY_OPERAND=not wide if key_operand is None else bool(key_operand),
                             num_warps=2 * DEFAULT_WARPS if wide else DEFAULT_WARPS, num_stages=DEFAULT_STAGES)
    else:
        _stage1_tuned[grid](*args, **meta)
    splitk.merge(workspace.part_o, workspace.part_lse, out, lse)
    return QuantDecodeOutput(out, lse)
