"""The attention-statistics kernels (VL-Cache appendix A.5: a row pass, then a
column pass over the keys) and their launchers. What they compute is in
contract.py.

Both passes hold a kv head's whole query group as the rows of one MMA tile
(GQA heads stacked, FlashMLA-style): tile row r is query head g = r // ROWS
of the group and selected row i = r % ROWS of the tile, so a key tile is
loaded once for every head that reads it, and the tile has block_m rows
(ROWS = block_m // the group padded to a power of two).

1. `row_stats`: one program per (row tile, split of the keys, kv head) walks
   its split's keys with the online softmax (on sm_90 each tile's scores
   issued before the previous tile's softmax, so the two overlap) and writes
   its rows' max and sum of exp; `_merge_rows_kernel` merges the splits
   (FlashDecoding's split-K: a few row tiles alone would not fill the GPU).
   Writes m, l [H, R] float32.
2. `column_stats`: one program per (a few consecutive blocks of BLOCK_N keys,
   kv head; column_blocks_per_program) loads each block's key tile once,
   the next one while this one's rows run, walks the selected rows a tile
   at a time (`_block_rows`: the rows before the first that sees the block
   are skipped, and the rows after the last that sees only part of it run
   unmasked, so rows spread over the prompt in position order, ZipVL's
   probe rows, cost what they see), recomputes the probabilities from m and
   1 / l (divided once per call) and reduces them over each head's rows:
   attention sum and count below the ThresholdFilter per head, their sum
   over the group (attn_sum_kv), and the count of rows that see each key
   (written once, by kv head 0: it depends on the positions only). Each key
   is owned by one program that adds the rows in a fixed order, so the
   result is deterministic without a reduction pass.

Reference: reference.py beside this file.
"""

import torch
import triton
import triton.language as tl

from kernels_py.ops import common, splitk
from kernels_py.ops.attention_stats.contract import (
    AttentionStats, ReducedStats, check_inputs, check_row_stats, check_threshold,
)

# Tiles of each pass, 16-bit inputs: (MMA rows, keys, warps); float32 tiles
# are smaller (a float32 key block twice as wide spills on sm_90).
ROW_TILE = {2: (128, 128, 8), 4: (32, 32, 4)}
COLUMN_TILE = {2: (64, 128, 8), 4: (32, 32, 8)}
MAX_TILE_ELEMENTS = 128 * 128  # keys x head_dim of a default key tile (registers)
COLUMN_BLOCKS_PER_PROGRAM = 8  # consecutive key blocks a column-pass program walks, at most
MIN_SPLIT_BLOCKS = 8  # a row-pass key split walks at least this many key tiles
MAX_SPLITS = 64
BOUND_ROWS = 128  # row positions a column-pass program scans at once for a block's bounds
# The most rows whose counts the column pass sums two keys to an int32 (16
# bits each, signed), for 16-bit inputs.
PACKED_COUNTS_MAX = 32767
PROGRAMS_PER_SM = 4  # programs to aim for on each SM (waits on HBM overlap across them)

# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@triton.jit
def _group_rows(QPos, first_row, kv_head, n_rows, stride_p,
                GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr):
    """The tile's rows: query head of each (kv_head * GROUP + g), selected row,
    whether it is real, and its position (-1, which sees no key, when not)."""
    offs_r = tl.arange(0, BLOCK_M)
    g = offs_r // ROWS
    row = first_row + offs_r % ROWS
    real = (g < GROUP) & (row < n_rows)
    q_pos = tl.load(QPos + row * stride_p, mask=real, other=-1).to(tl.int32)
    return kv_head * GROUP + g, row, real, q_pos


@triton.jit
def _load_group_q(Q, head, row, real, offs_d, stride_qh, stride_qm, stride_qd, d_mask, UPCAST: tl.constexpr):
    q = tl.load(Q + head[:, None] * stride_qh + row[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=real[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def _load_kt(K_head, offs_n, offs_d, stride_kn, stride_kd, n_keys, d_mask, UPCAST: tl.constexpr):
    """A key tile, transposed: [BLOCK_D, BLOCK_N]; zeros past the head_dim and the keys."""
    k = tl.load(
        K_head + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
        mask=(offs_n[None, :] < n_keys) & d_mask[:, None],
        other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)
    return k


@triton.jit
def _scores(q, kt, offs_n, q_pos, n_keys, qk_scale):
    """Scores in log2 units with the causal mask and the ragged tail set to -inf,
    and the mask of visible entries."""
    s = tl.dot(q, kt, input_precision="ieee") * qk_scale
    visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] < n_keys)
    return tl.where(visible, s, float("-inf")), visible


@triton.jit
def _per_head(x, GROUP_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] tile rows summed over each head's rows: [GROUP_PAD, BLOCK_N]."""
    return tl.sum(tl.reshape(x, (GROUP_PAD, ROWS, BLOCK_N)), 1)


@triton.jit
def _softmax_step(s, m_i, l_i, qk_scale):
    """One key tile's raw scores folded into the online softmax, m_i in raw
    score units (the scale folds into each score's exponent FMA)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_scaled = m_new * qk_scale
    # The rescale subtracts before it scales: as m_i * qk_scale - m_scaled the
    # compiler fuses an FMA whose rounding residue at the -1e30 floor (a row
    # that has seen no key yet) is ~1e22, exp2 of which is inf and 0 * inf NaN.
    l_i = l_i * tl.exp2((m_i - m_new) * qk_scale) + tl.sum(tl.exp2(s * qk_scale - m_scaled[:, None]), 1)
    return m_new, l_i


@triton.jit
def _masked_row_tile(q, kt, m_i, l_i, qk_scale, offs_n, q_pos, n_keys):
    """A key tile some real rows see only part of: the causal mask, then the step."""
    s = tl.dot(q, kt, input_precision="ieee")
    s = tl.where((offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] < n_keys), s, float("-inf"))
    return _softmax_step(s, m_i, l_i, qk_scale)


@triton.jit
def _row_stats_kernel(
    Q, K, QPos, PartM, PartL,
    stride_qh, stride_qm, stride_qd,
    stride_kh, stride_kn, stride_kd,
    stride_p,
    stride_ms, stride_mh, stride_mr,
    stride_ls, stride_lh, stride_lr,
    n_rows, n_keys, keys_per_split, qk_scale,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    OVERLAP_MMA: tl.constexpr,
):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    kv_head = tl.program_id(2)
    BLOCK_M: tl.constexpr = GROUP_PAD * ROWS

    head, row, real, q_pos = _group_rows(QPos, pid_m * ROWS, kv_head, n_rows, stride_p, GROUP, ROWS, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = _load_group_q(Q, head, row, real, offs_d, stride_qh, stride_qm, stride_qd, d_mask, UPCAST)
    K_head = K + kv_head * stride_kh
    # No row of this tile sees a key past its largest position, and every real
    # row sees the whole tiles that end at or before its smallest one.
    lo = split * keys_per_split
    hi = tl.minimum(tl.minimum(lo + keys_per_split, tl.max(q_pos, 0) + 1), n_keys)
    whole = tl.maximum(tl.minimum(hi, (tl.min(tl.where(real, q_pos, n_keys), 0) + 1) // BLOCK_N * BLOCK_N), lo)

    # A finite floor instead of -inf: a row that sees nothing in this split
    # keeps l = 0 and weighs nothing in the merge, with no inf - inf.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if OVERLAP_MMA:
        # Tiles every real row sees whole, software-pipelined: each tile's
        # scores are issued (an asynchronous wgmma) before the previous
        # tile's softmax, so the tensor cores work under its exponentials,
        # two tiles an iteration so the carried scores need no copies at the
        # back edge (an odd count's first tile alone, before them). The
        # first step folds in a tile of -inf, which changes nothing.
        s = tl.full([BLOCK_M, BLOCK_N], float("-inf"), dtype=tl.float32)
        pairs_start = lo + (whole - lo) // BLOCK_N % 2 * BLOCK_N
        for start_odd in range(lo, pairs_start, BLOCK_N):
            offs_n = start_odd + tl.arange(0, BLOCK_N)
            s = tl.dot(q, _load_kt(K_head, offs_n, offs_d, stride_kn, stride_kd, n_keys, d_mask, UPCAST),
                       input_precision="ieee")
        for start_pair in range(pairs_start, whole, 2 * BLOCK_N):
            offs_n = start_pair + tl.arange(0, BLOCK_N)
            kt = _load_kt(K_head, offs_n, offs_d, stride_kn, stride_kd, n_keys, d_mask, UPCAST)
            s_first = tl.dot(q, kt, input_precision="ieee")
            m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
            kt = _load_kt(K_head, offs_n + BLOCK_N, offs_d, stride_kn, stride_kd, n_keys, d_mask, UPCAST)
            s = tl.dot(q, kt, input_precision="ieee")
            m_i, l_i = _softmax_step(s_first, m_i, l_i, qk_scale)
        m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
    else:
        for start_n in range(lo, whole, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            kt = _load_kt(K_head, offs_n, offs_d, stride_kn, stride_kd, n_keys, d_mask, UPCAST)
            m_i, l_i = _softmax_step(tl.dot(q, kt, input_precision="ieee"), m_i, l_i, qk_scale)
    for start_edge in range(whole, hi, BLOCK_N):
        offs_n = start_edge + tl.arange(0, BLOCK_N)
        kt = _load_kt(K_head, offs_n, offs_d, stride_kn, stride_kd, n_keys, d_mask, UPCAST)
        m_i, l_i = _masked_row_tile(q, kt, m_i, l_i, qk_scale, offs_n, q_pos, n_keys)

    tl.store(PartM + split * stride_ms + head * stride_mh + row * stride_mr, m_i * qk_scale, mask=real)
    tl.store(PartL + split * stride_ls + head * stride_lh + row * stride_lr, l_i, mask=real)


@triton.jit
def _merge_rows_kernel(
    PartM, PartL, M, L,
    stride_ms, stride_mh, stride_mr,
    stride_ls, stride_lh, stride_lr,
    stride_oh, stride_or,
    n_rows, n_splits,
    BLOCK_R: tl.constexpr,
):
    """The key splits of one head's rows merged: max over the splits, sums
    rescaled to it (a split a row saw nothing of has l = 0)."""
    head = tl.program_id(0)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = offs_r < n_rows
    m = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)
    l = tl.zeros([BLOCK_R], dtype=tl.float32)
    for s in range(0, n_splits):
        m_s = tl.load(PartM + s * stride_ms + head * stride_mh + offs_r * stride_mr, mask=mask, other=-1.0e30)
        l_s = tl.load(PartL + s * stride_ls + head * stride_lh + offs_r * stride_lr, mask=mask, other=0.0)
        m_new = tl.maximum(m, m_s)
        l = l * tl.exp2(m - m_new) + l_s * tl.exp2(m_s - m_new)
        m = m_new
    tl.store(M + head * stride_oh + offs_r * stride_or, m, mask=mask)
    tl.store(L + head * stride_oh + offs_r * stride_or, l, mask=mask)


@triton.jit
def _count_below(below, e, threshold):
    """below + (e < threshold), int32, for e >= 0 and threshold >= 0 (a
    probability and VL-Cache's p; the launcher turns a threshold of -0.0
    into 0.0). The comparison is on the floats' bits, which order
    non-negative floats as integers do: the sign bit of bits(e) -
    bits(threshold) is added to the count, a VIADD and a LEA.HI a
    probability on sm_90, where a float compare compiles to three (an
    FSETP, the add and a predicated move back; a PTX set, to an FSETP, a
    SEL of all ones and the subtraction). A NaN e (from inf or NaN
    inputs) counts as a float compare would only with its sign bit clear,
    as the GPU's arithmetic makes it; numpy's, under the interpreter, may
    set it."""
    # The cast: the interpreter types a Python float below 2^-126 as a
    # float64, whose bits are no int32.
    diff = e.to(tl.int32, bitcast=True) - tl.cast(threshold, tl.float32).to(tl.int32, bitcast=True)
    return below + (diff.to(tl.uint32, bitcast=True) >> 31).to(tl.int32, bitcast=True)


@triton.jit
def _column_tile(q, kt, m_i, inv_l, qk_scale, threshold, attn, below, offs_n, q_pos, n_keys, MASKED: tl.constexpr):
    """One row tile of a key block: its probabilities (A_ij * l_i, 1 at the
    row max) added to the per-row sums and counts. Tiles whose rows all see
    the block whole skip the causal mask (MASKED=False)."""
    e = tl.exp2(tl.dot(q, kt, input_precision="ieee") * qk_scale - m_i[:, None])
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] < n_keys)
        e = tl.where(visible, e, 0.0)
        below += (visible & (e < threshold)).to(tl.int32)
    else:
        below = _count_below(below, e, threshold)  # rows that are not real have e = 1: never below
    return attn + e * inv_l[:, None], below


@triton.jit
def _column_rows(Q, M, InvL, QPos, first_row, kv_head, n_rows, offs_d, d_mask,
                 stride_qh, stride_qm, stride_qd, stride_mh, stride_mr, stride_ih, stride_ir, stride_p,
                 GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, UPCAST: tl.constexpr):
    """A row tile's queries, row max, 1 / row sum (0 for rows that are not
    real, so they weigh nothing), positions, and which rows count once
    (real, the group's first head)."""
    head, row, real, q_pos = _group_rows(QPos, first_row, kv_head, n_rows, stride_p, GROUP, ROWS, BLOCK_M)
    q = _load_group_q(Q, head, row, real, offs_d, stride_qh, stride_qm, stride_qd, d_mask, UPCAST)
    m_i = tl.load(M + head * stride_mh + row * stride_mr, mask=real, other=0.0)
    inv_l = tl.load(InvL + head * stride_ih + row * stride_ir, mask=real, other=0.0)
    return q, m_i, inv_l, q_pos, real & (head == kv_head * GROUP)


@triton.jit
def _block_rows(QPos, stride_p, n_rows, first_key, last_key, min_pos, max_pos, BOUND_ROWS: tl.constexpr):
    """(seen, partial_end) for the key block [first_key, last_key]: rows
    before `seen` see none of its keys and rows from `partial_end` on see
    all of them, in any row order (rows in position order, as the
    selectors give them, leave between the two only those whose positions
    fall inside the block). The rows are scanned only for a block inside
    [min_pos, max_pos]; every row sees a block before it whole, none a block
    after it."""
    all_see = last_key <= min_pos
    seen = tl.where(all_see, 0, n_rows)
    partial_end = seen * 0
    for first_scan in range(0, tl.where(all_see | (first_key > max_pos), 0, n_rows), BOUND_ROWS):
        offs = first_scan + tl.arange(0, BOUND_ROWS)
        real = offs < n_rows
        pos = tl.load(QPos + offs * stride_p, mask=real, other=-1).to(tl.int32)
        seen = tl.minimum(seen, tl.min(tl.where(pos >= first_key, offs, n_rows), 0))
        partial_end = tl.maximum(partial_end, tl.max(tl.where(real & (pos < last_key), offs + 1, 0), 0))
    return seen, tl.maximum(partial_end, seen)


@triton.jit
def _column_stats_kernel(
    Q, K, QPos, M, InvL, Attn, Below, Nonzero, AttnKV,
    stride_qh, stride_qm, stride_qd,
    stride_kh, stride_kn, stride_kd,
    stride_p,
    stride_mh, stride_mr,
    stride_ih, stride_ir,
    stride_ah, stride_an,
    stride_bh, stride_bn,
    stride_zn,
    stride_kvh, stride_kvn,
    n_rows, n_keys, min_pos, max_pos, qk_scale, threshold, blocks_per_program,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    BOUND_ROWS: tl.constexpr,
    PACK_COUNTS: tl.constexpr,
):
    kv_head = tl.program_id(1)
    BLOCK_M: tl.constexpr = GROUP_PAD * ROWS
    first_block = tl.program_id(0) * blocks_per_program
    end_block = tl.minimum(first_block + blocks_per_program, tl.cdiv(n_keys, BLOCK_N))
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + offs_g
    K_head = K + kv_head * stride_kh

    # The next block's keys are loaded while this block's rows run: each
    # program walks a few consecutive blocks, so the HBM wait is exposed once.
    kt_next = _load_kt(K_head, first_block * BLOCK_N + tl.arange(0, BLOCK_N), offs_d, stride_kn, stride_kd, n_keys,
                       d_mask, UPCAST)
    for block in range(first_block, end_block):
        first_key = block * BLOCK_N
        offs_n = first_key + tl.arange(0, BLOCK_N)
        key_mask = offs_n < n_keys
        kt = kt_next
        kt_next = _load_kt(K_head, offs_n + BLOCK_N, offs_d, stride_kn, stride_kd,
                           tl.minimum(n_keys, end_block * BLOCK_N), d_mask, UPCAST)
        # Rows before `seen` see no key of this block and rows from `whole`
        # on see all of it (no mask); the tiles between them are masked.
        seen, partial_end = _block_rows(QPos, stride_p, n_rows, first_key, tl.minimum(first_key + BLOCK_N, n_keys) - 1,
                                        min_pos, max_pos, BOUND_ROWS)
        whole = seen + tl.cdiv(partial_end - seen, ROWS) * ROWS

        # Sums over the rows stay per tile row until the block ends: one
        # cross-thread reduction per block instead of one per row tile.
        attn = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        below = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        nonzero = tl.zeros([BLOCK_N], dtype=tl.int32) + tl.maximum(n_rows - whole, 0)
        for first_row in range(whole, n_rows, ROWS):
            q, m_i, inv_l, q_pos, counted = _column_rows(
                Q, M, InvL, QPos, first_row, kv_head, n_rows, offs_d, d_mask, stride_qh, stride_qm, stride_qd,
                stride_mh, stride_mr, stride_ih, stride_ir, stride_p, GROUP, ROWS, BLOCK_M, UPCAST)
            attn, below = _column_tile(q, kt, m_i, inv_l, qk_scale, threshold, attn, below, offs_n, q_pos, n_keys,
                                       False)
        for first_edge in range(seen, whole, ROWS):
            q, m_i, inv_l, q_pos, counted = _column_rows(
                Q, M, InvL, QPos, first_edge, kv_head, n_rows, offs_d, d_mask, stride_qh, stride_qm, stride_qd,
                stride_mh, stride_mr, stride_ih, stride_ir, stride_p, GROUP, ROWS, BLOCK_M, UPCAST)
            attn, below = _column_tile(q, kt, m_i, inv_l, qk_scale, threshold, attn, below, offs_n, q_pos, n_keys,
                                       True)
            nonzero += tl.sum(((offs_n[None, :] <= q_pos[:, None]) & counted[:, None]).to(tl.int32), 0)

        attn_g = _per_head(attn, GROUP_PAD, ROWS, BLOCK_N)
        out_mask = (offs_g < GROUP)[:, None] & key_mask[None, :]
        tl.store(Attn + heads[:, None] * stride_ah + offs_n[None, :] * stride_an, attn_g, mask=out_mask)
        if PACK_COUNTS:
            # Two keys' counts to an int32 (each at most n_rows), so the sum
            # over the rows moves half the words across threads.
            lo, hi = tl.split(tl.reshape(below, (BLOCK_M, BLOCK_N // 2, 2)))
            packed = _per_head(lo + (hi << 16), GROUP_PAD, ROWS, BLOCK_N // 2)
            below_g = tl.reshape(tl.join(packed & 0xFFFF, packed >> 16), (GROUP_PAD, BLOCK_N))
        else:
            below_g = _per_head(below, GROUP_PAD, ROWS, BLOCK_N)
        tl.store(Below + heads[:, None] * stride_bh + offs_n[None, :] * stride_bn, below_g, mask=out_mask)
        tl.store(AttnKV + kv_head * stride_kvh + offs_n * stride_kvn, tl.sum(attn_g, 0), mask=key_mask)
        tl.store(Nonzero + offs_n * stride_zn, nonzero, mask=key_mask & (kv_head == 0))


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------


def overlap_mma(device, dtype: torch.dtype) -> bool:
    """Whether the row pass overlaps each tile's scores with the previous
    tile's softmax: for 16-bit inputs on sm_90's asynchronous wgmma (and in
    the interpreter, so the tests run that code), not on sm_80's mma.sync
    nor for float32's FMA products, which gain nothing from it and spill
    for their second tile of scores."""
    cc = common.capability(device)
    return (cc is None or cc >= 90) and dtype.itemsize == 2


def group_tile(heads: int, kv_heads: int, block_m: int) -> tuple[int, int]:
    """(GROUP_PAD, ROWS): the group padded to a power of two and the selected
    rows of a tile of block_m MMA rows (at least one row: a group wider than
    block_m makes the tile as wide as the group)."""
    group_pad = triton.next_power_of_2(heads // kv_heads)
    return group_pad, max(1, block_m // group_pad)


def key_split_count(n_keys: int, programs: int, block_n: int, sms: int | None) -> int:
    """Key splits of the row pass: one on the CPU; on a GPU of `sms` SMs enough
    that the row tiles x kv heads (`programs`) times the splits give about
    PROGRAMS_PER_SM programs an SM, each split at least MIN_SPLIT_BLOCKS tiles.
    The launcher and the op's model both ask here."""
    if not sms:
        return 1
    most = max(1, -(-n_keys // (MIN_SPLIT_BLOCKS * block_n)))
    return max(1, min(-(-PROGRAMS_PER_SM * sms // max(programs, 1)), most, MAX_SPLITS))


def column_blocks_per_program(blocks: int, kv_heads: int, sms: int | None) -> int:
    """Consecutive key blocks a column-pass program walks: COLUMN_BLOCKS_PER_PROGRAM,
    fewer where that would leave less than PROGRAMS_PER_SM programs an SM
    (short prompts, few kv heads). The launcher and the op's model both ask here."""
    if not sms:
        return COLUMN_BLOCKS_PER_PROGRAM
    return max(1, min(COLUMN_BLOCKS_PER_PROGRAM, blocks * kv_heads // (PROGRAMS_PER_SM * sms)))


def attention_stats(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, p: float = 0.01,
                    scale: float | None = None, *, block_m: int | None = None, block_n: int | None = None,
                    key_splits: int | None = None, pos_range: tuple[int, int] | None = None) -> AttentionStats:
    """Attention statistics of the selected query rows, without the attention matrix.

    q: [heads, rows, head_dim], the selected query rows (gathered by the caller).
    k: [kv_heads, keys, head_dim]; heads must be a multiple of kv_heads (GQA).
    q_pos: [rows] int32/int64, the absolute position of each row; row i sees
        keys 0 .. q_pos[i]. Any order, duplicates allowed, each in [0, keys).
    p: ThresholdFilter threshold in [0, 1] (VL-Cache: 0.01).
    scale: softmax scale, default head_dim ** -0.5.
    fp16/bf16/fp32 inputs, fp32 accumulation; strided inputs are fine.
    block_m: MMA rows of a tile (a kv group's heads x selected rows) and
    block_n: keys of a tile, in both passes (default: ROW_TILE and
    COLUMN_TILE for the dtype); key_splits: splits of the row pass
    (default key_split_count). `nonzero` is one row of counts expanded over
    the heads.
    pos_range: (smallest, largest) of q_pos, where the caller knows them (it
    chose the rows): the call then never waits for the device (the check
    reads them otherwise) and can be captured in a CUDA graph. They are
    checked against the keys, not against q_pos: a range wider than the
    rows' costs only time, a narrower one gives wrong statistics.
    """
    m, l = row_stats(q, k, q_pos, scale, block_m=block_m, block_n=block_n, key_splits=key_splits,
                     pos_range=pos_range)
    cols = column_stats(q, k, q_pos, m, l, p, scale, block_m=block_m, block_n=block_n, pos_range=pos_range)
    return AttentionStats(m, l, cols.attn_sum, cols.below, cols.nonzero, cols.attn_sum_kv, float(p))


def row_stats(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, scale: float | None = None, *,
              block_m: int | None = None, block_n: int | None = None,
              key_splits: int | None = None, pos_range: tuple[int, int] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1: row max (log2 units, see contract.py) and sum of exp of the
    causal scores of each selected row, each float32 [heads, rows]. Tiles
    default to ROW_TILE for the dtype; pos_range as attention_stats."""
    check_inputs(q, k, q_pos, pos_range)
    common.check_launchable(q)
    block_m, block_n, warps = _tile(ROW_TILE, q, block_m, block_n)
    common.check_block("block_m", block_m)
    common.check_block("block_n", block_n)
    heads, n_rows, head_dim = q.shape
    kv_heads, n_keys, _ = k.shape
    qk_scale = common.softmax_scale(scale, head_dim) * common.LOG2E
    group_pad, rows = group_tile(heads, kv_heads, block_m)
    row_tiles = triton.cdiv(n_rows, rows)
    if key_splits is None:
        key_splits = key_split_count(n_keys, row_tiles * kv_heads, block_n, splitk.sm_count(q.device))
    elif isinstance(key_splits, bool) or not isinstance(key_splits, int) or key_splits < 1:
        raise ValueError(f"key_splits must be a positive int, got {key_splits!r}")
    keys_per_split = triton.cdiv(triton.cdiv(max(n_keys, 1), key_splits), block_n) * block_n
    dev = q.device
    part_m = torch.empty((key_splits, heads, n_rows), dtype=torch.float32, device=dev)
    part_l = torch.empty((key_splits, heads, n_rows), dtype=torch.float32, device=dev)
    if n_rows == 0:
        return part_m[0], part_l[0]
    _row_stats_kernel[(row_tiles, key_splits, kv_heads)](
        q, k, q_pos, part_m, part_l,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        q_pos.stride(0),
        part_m.stride(0), part_m.stride(1), part_m.stride(2),
        part_l.stride(0), part_l.stride(1), part_l.stride(2),
        n_rows, n_keys, keys_per_split, qk_scale,
        GROUP=heads // kv_heads,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        ROWS=rows,
        BLOCK_N=block_n,
        BLOCK_D=common.block(head_dim),
        UPCAST=common.upcast_for_dot(q.dtype),
        OVERLAP_MMA=overlap_mma(q.device, q.dtype),
        num_warps=warps,
    )
    if key_splits == 1:
        return part_m[0], part_l[0]
    m = torch.empty((heads, n_rows), dtype=torch.float32, device=dev)
    l = torch.empty_like(m)
    block_r = min(256, triton.next_power_of_2(n_rows))
    _merge_rows_kernel[(heads, triton.cdiv(n_rows, block_r))](
        part_m, part_l, m, l,
        part_m.stride(0), part_m.stride(1), part_m.stride(2),
        part_l.stride(0), part_l.stride(1), part_l.stride(2),
        m.stride(0), m.stride(1),
        n_rows, key_splits,
        BLOCK_R=block_r,
    )
    return m, l


def column_stats(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, row_max: torch.Tensor,
                 row_sumexp: torch.Tensor, p: float = 0.01, scale: float | None = None, *,
                 block_m: int | None = None, block_n: int | None = None,
                 pos_range: tuple[int, int] | None = None) -> ReducedStats:
    """Pass 2: recompute the probabilities from `row_stats` and reduce them
    over the selected rows: attn_sum, below [heads, keys], nonzero [heads,
    keys] (one row of counts expanded over the heads) and attn_sum_kv
    [kv_heads, keys]. Tiles default to COLUMN_TILE for the dtype;
    pos_range as attention_stats."""
    min_pos, max_pos = check_inputs(q, k, q_pos, pos_range)
    common.check_launchable(q)
    block_m, block_n, warps = _tile(COLUMN_TILE, q, block_m, block_n)
    common.check_block("block_m", block_m)
    common.check_block("block_n", block_n)
    p = check_threshold(p) + 0.0  # -0.0 as 0.0: the kernel compares the threshold's bits (_count_below)
    check_row_stats(q, row_max, row_sumexp)
    heads, n_rows, head_dim = q.shape
    kv_heads, n_keys, _ = k.shape
    qk_scale = common.softmax_scale(scale, head_dim) * common.LOG2E
    group_pad, rows = group_tile(heads, kv_heads, block_m)
    dev = q.device
    run = n_rows > 0 and n_keys > 0
    alloc = torch.empty if run else torch.zeros  # the kernel writes every key (no fill to launch)
    attn = alloc((heads, n_keys), dtype=torch.float32, device=dev)
    below = alloc((heads, n_keys), dtype=torch.int32, device=dev)
    nonzero = alloc((n_keys,), dtype=torch.int32, device=dev)
    attn_kv = alloc((kv_heads, n_keys), dtype=torch.float32, device=dev)
    if run:
        blocks = triton.cdiv(n_keys, block_n)
        inv_l = 1.0 / row_sumexp  # once per call, so no row tile of a key block divides
        per_program = column_blocks_per_program(blocks, kv_heads, splitk.sm_count(dev))
        _column_stats_kernel[(triton.cdiv(blocks, per_program), kv_heads)](
            q, k, q_pos, row_max, inv_l, attn, below, nonzero, attn_kv,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            q_pos.stride(0),
            row_max.stride(0), row_max.stride(1),
            inv_l.stride(0), inv_l.stride(1),
            attn.stride(0), attn.stride(1),
            below.stride(0), below.stride(1),
            nonzero.stride(0),
            attn_kv.stride(0), attn_kv.stride(1),
            n_rows, n_keys, min_pos, max_pos, qk_scale, p, per_program,
            GROUP=heads // kv_heads,
            GROUP_PAD=group_pad,
            HEAD_DIM=head_dim,
            ROWS=rows,
            BLOCK_N=block_n,
            BLOCK_D=common.block(head_dim),
            UPCAST=common.upcast_for_dot(q.dtype),
            BOUND_ROWS=BOUND_ROWS,
            PACK_COUNTS=n_rows <= PACKED_COUNTS_MAX and q.element_size() < 4,  # float32's spilled (28 bytes, sm_90)
            num_warps=warps,
        )
    return ReducedStats(attn, below, nonzero.expand(heads, n_keys), attn_kv)


def default_tile(tiles: dict, elem_bytes: int, head_dim: int) -> tuple[int, int, int]:
    """A pass's default (block_m, block_n, warps) for inputs of this width
    and head_dim (ROW_TILE or COLUMN_TILE); the launchers and the op's model
    both ask here."""
    default_m, default_n, warps = tiles[min(elem_bytes, 4)]
    widest = max(16, MAX_TILE_ELEMENTS // common.block(head_dim))
    # Wide heads: fewer keys, and fewer rows (the 16-bit row pass's [128, 256] query tile and its key
    # tiles needed 256 KiB of shared memory on sm_90, more than a block may use: it failed to launch).
    return min(default_m, widest), min(default_n, widest), warps


def _tile(tiles: dict, q: torch.Tensor, block_m: int | None, block_n: int | None) -> tuple[int, int, int]:
    """A pass's (block_m, block_n, warps): the caller's sizes where given,
    else the pass's defaults for the dtype's width."""
    default_m, default_n, warps = default_tile(tiles, q.element_size(), q.shape[-1])
    return default_m if block_m is None else block_m, default_n if block_n is None else block_n, warps
