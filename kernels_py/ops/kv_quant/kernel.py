"""Triton kernels that quantize and pack a segment of keys and values into
the layout of contract.py, dequantize it back, and the device functions a
decode kernel uses to dequantize a tile in registers.

Dequantization in registers: a code c < 2^23 becomes the float32
2^23 + c by OR-ing it into the mantissa of 2^23 (0x4B000000) and
reinterpreting the bits; subtracting 2^23 leaves c exactly. That is a LOP3
and an FADD per element instead of an integer-to-float conversion (a
quarter-rate instruction), the magic-number trick of BitDecoding and QServe.
Where the dot takes 16-bit operands the same is done in fp16 (0x6400 =
1024.0) or bf16 (0x4300 = 128.0) on both halves of a word at once, and the
multiply-add by scale and zero runs in that dtype, two elements to an
instruction: on a GPU in one PTX block a pair (_scaled_pairs), under the
interpreter by code_pairs. A code whose bits already lie in the 16-bit
mantissa is taken where it is, OR-ed into a smaller power of two (a code at
bit 8 of a half into 4.0), so a word needs one shift in fp16 (bf16: two for
2-bit codes, three for 4-bit) instead of one per field of a half (7 and 3;
copy_fields). The layout (contract.py) puts neighbouring
channels in a word's halves, so each pair comes out where the tile needs
it: nothing is permuted or shuffled between threads.

Reference: reference.py beside this file (identical float operations, so
the packed bytes match exactly).
"""

import torch
import triton
import triton.language as tl

from kernels_py.ops import common
from kernels_py.ops.kv_quant.contract import PAD_POS, QuantKV, check_segment, shapes
from kernels_py.ops.kv_quant.reference import check_kv

# Globals a kernel reads must be constexprs.
MAGIC = tl.constexpr(0x4B000000)  # the bits of 2.0 ** 23
MAGIC_FLOAT = tl.constexpr(8388608.0)
PAD = tl.constexpr(PAD_POS)


@triton.jit
def codes_to_float(codes):
    """int32 codes in [0, 2^23) -> float32, exactly, without I2F."""
    return (codes | MAGIC).to(tl.float32, bitcast=True) - MAGIC_FLOAT


@triton.jit
def split_pairs(shifted, BITS: tl.constexpr):
    """Packed words already shifted right by i * BITS (int32, any shape) ->
    int32 codes [..., 2]: the code at bits [0, BITS) (an even channel) and
    the one at bits [16, 16 + BITS) (the odd channel beside it)."""
    t = shifted & (((1 << BITS) - 1) * 0x10001)
    return tl.join(t & 0xFFFF, t >> 16)


@triton.jit
def pack_pairs(codes, BITS: tl.constexpr):
    """int32 codes [R, H, 2] (H = 16 / BITS; the last axis a channel pair) ->
    words [R]: pair i's even channel at bits [i*BITS, (i+1)*BITS), its odd
    channel 16 bits higher. The fields are disjoint, so summing is OR-ing
    (the top one may set the sign bit: the 32 bits are what matter)."""
    H: tl.constexpr = 16 // BITS
    shifts = tl.arange(0, H)[:, None] * BITS + tl.arange(0, 2)[None, :] * 16
    return tl.sum(tl.sum(codes << shifts[None, :, :], 2), 1)


@triton.jit
def _scale_and_codes(x, valid, axis: tl.constexpr, BITS: tl.constexpr):
    """fp16 scale, zero (reduced along `axis`, padding excluded) and the int32
    codes of x float32: the float operations of reference._ranges / _codes."""
    levels: tl.constexpr = (1 << BITS) - 1
    lo = tl.min(tl.where(valid, x, float("inf")), axis)
    hi = tl.max(tl.where(valid, x, float("-inf")), axis)
    empty = tl.max(valid.to(tl.int32), axis) == 0
    lo = tl.where(empty, 0.0, lo)
    hi = tl.where(empty, 0.0, hi)
    scale = tl.math.div_rn(hi - lo, tl.full(hi.shape, levels, tl.float32)).to(tl.float16)
    zero = lo.to(tl.float16)
    s = tl.expand_dims(scale.to(tl.float32), axis)
    z = tl.expand_dims(zero.to(tl.float32), axis)
    codes = tl.floor(tl.math.div_rn(x - z, tl.where(s > 0, s, 1.0)) + 0.5)
    codes = tl.minimum(tl.maximum(codes, 0.0), levels)
    codes = tl.where(valid & (s > 0), codes, 0.0).to(tl.int32)
    return scale, zero, codes


@triton.jit
def _quantize_keys_kernel(
    K, Pos, Len, Codes, Scale, Zero,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_pb, stride_pn, stride_lb,
    stride_cb, stride_ch, stride_cw, stride_cd,
    stride_sb, stride_sh, stride_sg, stride_sd,
    heads, head_dim,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (sequence x kv head, group of GROUP slots): per-channel
    ranges over the group, codes packed 16 / BITS slots of a channel pair to
    a word (contract.py)."""
    H: tl.constexpr = 16 // BITS
    HALF_D: tl.constexpr = BLOCK_D // 2
    bh = tl.program_id(0)
    b = (bh // heads).to(tl.int64)
    h = bh % heads
    g = tl.program_id(1)
    offs_n = g * GROUP + tl.arange(0, GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    length = tl.load(Len + b * stride_lb)
    pos = tl.load(Pos + b * stride_pb + offs_n * stride_pn)
    valid = (offs_n < length) & (pos != PAD)
    x = tl.load(K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=valid[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    scale, zero, codes = _scale_and_codes(x, valid[:, None] & d_mask[None, :], 0, BITS)
    # [slot row, slot in row, channel pair, channel in pair] -> rows of pairs
    pairs = tl.permute(tl.reshape(codes, [GROUP // H, H, HALF_D, 2]), (0, 2, 1, 3))
    words = tl.reshape(pack_pairs(tl.reshape(pairs, [GROUP // H * HALF_D, H, 2]), BITS), [GROUP // H, HALF_D])
    row = g * (GROUP // H) + tl.arange(0, GROUP // H)
    offs_j = tl.arange(0, HALF_D)
    tl.store(Codes + b * stride_cb + h * stride_ch + word_offsets(row, offs_j, head_dim, stride_cw, stride_cd),
             words, mask=offs_j[None, :] < head_dim // 2)
    row = b * stride_sb + h * stride_sh + g * stride_sg + offs_d * stride_sd
    tl.store(Scale + row, scale, mask=d_mask)
    tl.store(Zero + row, zero, mask=d_mask)


@triton.jit
def _quantize_values_kernel(
    V, Pos, Len, Codes, Scale, Zero,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_pb, stride_pn, stride_lb,
    stride_cb, stride_ch, stride_cw, stride_cd,
    stride_sb, stride_sh, stride_sn, stride_sg,
    heads, slots, head_dim,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (sequence x kv head, block of BLOCK_N slots, group of
    GROUP channels): per-token ranges over the group, codes packed as the
    keys' are, 16 / BITS slots of a channel pair to a word (contract.py)."""
    H: tl.constexpr = 16 // BITS
    R: tl.constexpr = BLOCK_N // H
    bh = tl.program_id(0)
    b = (bh // heads).to(tl.int64)
    h = bh % heads
    g = tl.program_id(2)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_range = offs_n < slots
    offs_d = g * GROUP + tl.arange(0, GROUP)
    length = tl.load(Len + b * stride_lb)
    pos = tl.load(Pos + b * stride_pb + offs_n * stride_pn, mask=in_range, other=PAD)
    valid = (offs_n < length) & (pos != PAD)
    x = tl.load(V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=valid[:, None], other=0.0).to(tl.float32)
    scale, zero, codes = _scale_and_codes(x, valid[:, None] & (offs_d[None, :] >= 0), 1, BITS)
    # [slot row, slot in row, channel pair, channel in pair] -> rows of pairs
    pairs = tl.permute(tl.reshape(codes, [R, H, GROUP // 2, 2]), (0, 2, 1, 3))
    words = tl.reshape(pack_pairs(tl.reshape(pairs, [R * GROUP // 2, H, 2]), BITS), [R, GROUP // 2])
    row = tl.program_id(1) * R + tl.arange(0, R)
    offs_j = g * (GROUP // 2) + tl.arange(0, GROUP // 2)
    tl.store(Codes + b * stride_cb + h * stride_ch + word_offsets(row, offs_j, head_dim, stride_cw, stride_cd),
             words, mask=(row * H < slots)[:, None])
    row = b * stride_sb + h * stride_sh + offs_n * stride_sn + g * stride_sg
    tl.store(Scale + row, scale, mask=in_range)
    tl.store(Zero + row, zero, mask=in_range)


@triton.jit
def _dequantize_kernel(
    KCodes, KScale, KZero, VCodes, VScale, VZero, Pos, Len, KOut, VOut,
    stride_kcb, stride_kch, stride_kcw, stride_kcd,
    stride_ksb, stride_ksh, stride_ksg, stride_ksd,
    stride_vcb, stride_vch, stride_vcw, stride_vcd,
    stride_vsb, stride_vsh, stride_vsn, stride_vsg,
    stride_pb, stride_pn, stride_lb,
    stride_ob, stride_oh, stride_on, stride_od,
    heads, head_dim,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (sequence x kv head, tile of BLOCK_N slots inside one
    key group): the tile loaded and unpacked as a decode kernel does it (in
    float32, so without its 16-bit PTX), written out (the
    dequantize-then-attend baseline, and tests)."""
    bh = tl.program_id(0)
    b = (bh // heads).to(tl.int64)
    h = bh % heads
    start = tl.program_id(1) * BLOCK_N
    offs_n = start + tile_slots(BITS, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    length = tl.load(Len + b * stride_lb)
    pos = tl.load(Pos + b * stride_pb + offs_n * stride_pn)
    valid = (offs_n < length) & (pos != PAD)
    k_words, k_scale, k_zero, v_words, v_scale, v_zero = load_tile(
        KCodes + b * stride_kcb + h * stride_kch, KScale + b * stride_ksb + h * stride_ksh,
        KZero + b * stride_ksb + h * stride_ksh, VCodes + b * stride_vcb + h * stride_vch,
        VScale + b * stride_vsb + h * stride_vsh, VZero + b * stride_vsb + h * stride_vsh, start, start + BLOCK_N,
        stride_kcw, stride_kcd, stride_ksg, stride_ksd, stride_vcw, stride_vcd, stride_vsn, stride_vsg, head_dim,
        BITS, GROUP, BLOCK_N, BLOCK_D)
    k = dequantize_keys(k_words, k_scale, k_zero, BITS, GROUP, BLOCK_N, BLOCK_D, tl.float32, False)
    v = dequantize_values(v_words, v_scale, v_zero, BITS, GROUP, BLOCK_N, BLOCK_D, tl.float32, False)
    out = b * stride_ob + h * stride_oh + offs_n[:, None] * stride_on + offs_d[None, :] * stride_od
    keep = valid[:, None] & d_mask[None, :]
    tl.store(KOut + out, tl.where(keep, k, 0.0), mask=d_mask[None, :])
    tl.store(VOut + out, tl.where(keep, v, 0.0), mask=d_mask[None, :])


@triton.jit
def word_offsets(row, offs_j, head_dim, stride_w, stride_d):
    """Offsets [rows, pairs] of code words: the word of row r (16 / BITS
    slots) and channel pair j is (r // 2, r % 2 * head_dim / 2 + j) of
    k_codes or v_codes [.., T / P, D] (contract.py)."""
    return (row // 2)[:, None] * stride_w + ((row % 2) * (head_dim // 2))[:, None] * stride_d \
        + offs_j[None, :] * stride_d


@triton.jit
def tile_slots(BITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The slot (from the tile's first) of each row of a dequantized tile:
    row h * R + r holds slot r * H + h (H = 16 / BITS slots to a word, R =
    BLOCK_N / H words down a channel pair). A word's H slots unpack in the
    registers of the thread that loaded it; ordering the rows this way makes
    them a thread's rows of the tile as Triton lays it out, where slot order
    would spread them over lanes and shuffle. Attention is the same in any
    slot order, so callers only load positions in this order."""
    H: tl.constexpr = 16 // BITS
    R: tl.constexpr = BLOCK_N // H
    t = tl.arange(0, BLOCK_N)
    return (t % R) * H + t // R


@triton.jit
def load_tile(KC, KS, KZ, VC, VS, VZ, start, end, stride_kcw, stride_kcd, stride_ksg, stride_ksd, stride_vcw,
              stride_vcd, stride_vsn, stride_vsg, head_dim, BITS: tl.constexpr, GROUP: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Everything the tile of slots [start, start + BLOCK_N) of one
    (sequence, kv head) reads (start a multiple of GROUP or of BLOCK_N,
    whichever is smaller): key words, the key scales and zeros of the KG =
    ceil(BLOCK_N / GROUP) groups it spans as channel pairs [KG, BLOCK_D / 2,
    2], value words (words [BLOCK_N / H, BLOCK_D / 2], each H = 16 / BITS
    slots of a channel pair), and the value scales and zeros [BLOCK_N / H,
    BLOCK_D / GROUP, H], one per slot and channel group. Slots at or past
    `end` and channels past head_dim are not read (0s instead). A tuple, so
    a loop can issue the next tile's loads before it works on this one
    (dequantize_keys, _values)."""
    H: tl.constexpr = 16 // BITS
    R: tl.constexpr = BLOCK_N // H
    KG: tl.constexpr = (BLOCK_N + GROUP - 1) // GROUP
    row = start // H + tl.arange(0, R)
    offs_j = tl.arange(0, BLOCK_D // 2)
    j_mask = (offs_j[None, :] < head_dim // 2) & (row * H < end)[:, None]
    k_words = tl.load(KC + word_offsets(row, offs_j, head_dim, stride_kcw, stride_kcd), mask=j_mask, other=0)
    v_words = load_value_words(VC, start, end, stride_vcw, stride_vcd, head_dim, BITS, BLOCK_N, BLOCK_D)
    offs_d = offs_j[:, None] * 2 + tl.arange(0, 2)[None, :]
    k_group = start // GROUP + tl.arange(0, KG)
    k_at = k_group[:, None, None] * stride_ksg + offs_d[None, :, :] * stride_ksd
    d_mask = (offs_d < head_dim)[None, :, :] & (k_group * GROUP < end)[:, None, None]
    k_scale = tl.load(KS + k_at, mask=d_mask, other=0.0)
    k_zero = tl.load(KZ + k_at, mask=d_mask, other=0.0)
    v_scale, v_zero = load_value_scales(VS, VZ, start, end, stride_vsn, stride_vsg, head_dim, BITS, GROUP, BLOCK_N,
                                        BLOCK_D)
    return k_words, k_scale, k_zero, v_words, v_scale, v_zero


@triton.jit
def load_value_words(VC, start, end, stride_vcw, stride_vcd, head_dim, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """load_tile's value words [BLOCK_N / H, BLOCK_D / 2]."""
    H: tl.constexpr = 16 // BITS
    R: tl.constexpr = BLOCK_N // H
    row = start // H + tl.arange(0, R)
    offs_j = tl.arange(0, BLOCK_D // 2)
    j_mask = (offs_j[None, :] < head_dim // 2) & (row * H < end)[:, None]
    return tl.load(VC + word_offsets(row, offs_j, head_dim, stride_vcw, stride_vcd), mask=j_mask, other=0)


@triton.jit
def load_value_scales(VS, VZ, start, end, stride_vsn, stride_vsg, head_dim, BITS: tl.constexpr, GROUP: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """load_tile's value scales and zeros [BLOCK_N / H, BLOCK_D / GROUP, H]."""
    H: tl.constexpr = 16 // BITS
    R: tl.constexpr = BLOCK_N // H
    slot = start + tl.arange(0, R)[:, None] * H + tl.arange(0, H)[None, :]
    offs_g = tl.arange(0, BLOCK_D // GROUP)
    v_at = slot[:, None, :] * stride_vsn + offs_g[None, :, None] * stride_vsg
    s_mask = (offs_g[None, :, None] < head_dim // GROUP) & (slot < end)[:, None, :]
    return tl.load(VS + v_at, mask=s_mask, other=0.0), tl.load(VZ + v_at, mask=s_mask, other=0.0)


@triton.jit
def copy_fields(BITS: tl.constexpr, DT: tl.constexpr, COPIES: tl.constexpr = 0):
    """Each of a word's H = 16 / BITS copies (copy h unpacks bit field h of
    both halves, tile_slots' slot h of a word) for a tile in DT: how far it
    is shifted right and the bit where its field then starts, [H] each.
    Fields that lie in the mantissa of a 16-bit half (its low FIT bits: 10
    in fp16, 7 in bf16) stay where they are, the others move down in runs
    of F = FIT // BITS fields, so a word takes ceil(H / F) - 1 shifts (fp16:
    one, where a shift per field took H - 1: 7 for 2-bit codes, 3 for 4-bit
    ones). float32 moves every field to bit 0. COPIES: the first COPIES
    fields only (default all H; the key operand takes 4 of a 2-bit word's)."""
    FIT: tl.constexpr = 10 if DT == tl.float16 else (7 if DT == tl.bfloat16 else BITS)
    F: tl.constexpr = FIT // BITS
    h = tl.arange(0, COPIES if COPIES else 16 // BITS)
    return (h // F) * (F * BITS), (h % F) * BITS


@triton.jit
def _field_masks(BITS: tl.constexpr, DT: tl.constexpr, COPIES: tl.constexpr = 0):
    """Per copy h [H]: the mask of its field in both halves of a shifted
    word, and the 16-bit float 2^(M - at) (M mantissa bits, `at` where the
    field starts) in both halves, whose mantissa the field fills: OR-ed in,
    the half reads 2^(M - at) + code exactly."""
    _, at = copy_fields(BITS, DT, COPIES)
    lanes = (tl.full(at.shape, (1 << BITS) - 1, tl.int32) << at) * 0x10001
    if DT == tl.float16:
        magic = ((15 + 10 - at) << 10) * 0x10001  # fp16: exponent bias 15, 10 mantissa bits
    else:
        magic = ((127 + 7 - at) << 7) * 0x10001  # bf16: exponent bias 127, 7 mantissa bits
    return lanes, magic


@triton.jit
def code_pairs(shifted, BITS: tl.constexpr, DT: tl.constexpr, COPIES: tl.constexpr = 0):
    """Copies of packed words [..., H] (_shifted_copies, last axis the copy)
    -> [..., H, 2] DT (fp16 or bf16): the codes of each copy's field in the
    low and the high half, exactly. A mask and an OR put both codes in the
    mantissas of two 16-bit powers of two at once (fp16 1024.0 for a field
    at bit 0, 0x6400; bf16 128.0, 0x4300; a field at bit `at` in that of
    2^(M - at), so it needs no shift to bit 0) and one packed subtract takes
    the powers off: two codes a LOP3 and an HADD2, plus the copy's shift,
    shared by the copies of a run (copy_fields), where a code at a time
    costs a conversion each. The layout keeps two neighbouring channels in
    a word's halves, so the pairs come out in the order the tile needs:
    nothing is permuted afterwards."""
    lanes, magic = _field_masks(BITS, DT, COPIES)
    t = (shifted & lanes) | magic
    powers = tl.join(magic & 0xFFFF, magic & 0xFFFF).to(tl.int16).to(DT, bitcast=True)  # [H, 2]
    pair = tl.join(t.to(tl.int16).to(DT, bitcast=True), (t >> 16).to(tl.int16).to(DT, bitcast=True))
    return pair - powers


@triton.jit
def _pairs(shifted, BITS: tl.constexpr, DT: tl.constexpr, COPIES: tl.constexpr = 0):
    """The channel pairs of shifted words in DT: float32 exactly as
    reference.dequantize converts codes, 16-bit by code_pairs."""
    if DT == tl.float32:
        return codes_to_float(split_pairs(shifted, BITS))
    else:
        return code_pairs(shifted, BITS, DT, COPIES)


@triton.jit
def _shifted_copies(words, BITS: tl.constexpr, DT: tl.constexpr):
    """Words [R, J] -> [R, J, H] (H = 16 / BITS), copy h shifted right as
    copy_fields says for DT (float32: by h * BITS, field h at bits 0 and
    16). The copies are joins, which add a dimension held in the registers
    of the thread that loaded the word; a broadcast would get a layout of
    its own and move data."""
    H: tl.constexpr = 16 // BITS
    x = tl.join(tl.join(words, words), tl.join(words, words))  # 4 copies
    if H == 8:
        x = tl.join(x, x)
    x = tl.reshape(x, [words.shape[0], words.shape[1], H])
    shift, _ = copy_fields(BITS, DT)
    return x >> shift[None, None, :]


@triton.jit
def _scaled_pairs(shifted, scale, zero, BITS: tl.constexpr, DT: tl.constexpr, ON_GPU: tl.constexpr,
                  COPIES: tl.constexpr = 0):
    """Copies of words [..., H] (_shifted_copies, last axis the copy) and
    the scales and zeros of their channel pairs [..., H, 2] (broadcastable)
    -> code * scale + zero [..., H, 2] in DT (float32: exactly
    reference.dequantize's operations; fp16/bf16, two elements to an
    instruction: one rounding of product and sum on a GPU, a fused
    multiply-add; one each under the interpreter).

    On a GPU a 16-bit pair is one opaque PTX block: what code_pairs and the
    multiply-add issue, less the repacking of halves Triton adds around a
    join. Being opaque (not pure) it also ends the compiler's search for the
    width the MMA operand was loaded at: Triton sizes an operand's
    per-thread k-width from the narrowest type it finds loaded upstream,
    halved at every join, so the codes' joins would give the fp16 tile the
    k-width of 8-bit data, read from shared memory with LDS.64 and register
    moves instead of ldmatrix."""
    if ON_GPU and DT != tl.float32:
        words = tl.join(shifted, shifted)
        lanes, magic = _field_masks(BITS, DT, COPIES)
        args = [words, tl.broadcast_to(scale.to(DT), words.shape), tl.broadcast_to(zero.to(DT), words.shape),
                tl.zeros(words.shape, tl.int32) + lanes[:, None], tl.zeros(words.shape, tl.int32) + magic[:, None]]
        # Two elements a call: $1 and $2 are the same shifted word, $3 and
        # $4 the pair's scales and zeros, $5 (= $6) the mask of the copy's
        # two codes, $7 (= $8) its power of two in both halves (constants:
        # immediates once inlined). t = (word & mask) | power in each half
        # (one LOP3), t - power, then t * scale + zero. bf16 takes the
        # power off by an FMA with its negation (sm_80 has no bf16x2
        # subtract).
        if DT == tl.float16:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t; lop3.b32 t, $1, $5, $7, 0xea; sub.f16x2 t, t, $7; "
                "fma.rn.f16x2 $0, t, $3, $4; }", "=r,r,r,r,r,r,r,r,r", args, dtype=tl.float16, is_pure=False,
                pack=2)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t, one, off; mov.b32 one, 0x3f803f80; or.b32 off, $7, 0x80008000; "
                "lop3.b32 t, $1, $5, $7, 0xea; fma.rn.bf16x2 t, t, one, off; "
                "fma.rn.bf16x2 $0, t, $3, $4; }", "=r,r,r,r,r,r,r,r,r", args, dtype=tl.bfloat16, is_pure=False,
                pack=2)
    else:
        return _pairs(shifted, BITS, DT, COPIES) * scale.to(DT) + zero.to(DT)


@triton.jit
def dequantize_keys(k_words, k_scale, k_zero, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, DT: tl.constexpr, ON_GPU: tl.constexpr):
    """Keys [BLOCK_N, BLOCK_D] in DT, rows in tile_slots' order, from
    load_tile's key words, scales and zeros (_scaled_pairs; a word's slots
    lie in one key group, so the rows of words split into the KG groups).
    Padding slots come out as whatever their zero codes give; callers mask
    them."""
    H: tl.constexpr = 16 // BITS
    R: tl.constexpr = BLOCK_N // H
    KG: tl.constexpr = (BLOCK_N + GROUP - 1) // GROUP
    shifted = tl.reshape(_shifted_copies(k_words, BITS, DT), [KG, R // KG, BLOCK_D // 2, H])
    k = _scaled_pairs(shifted, k_scale[:, None, :, None, :], k_zero[:, None, :, None, :], BITS, DT, ON_GPU)
    k = tl.reshape(k, [R, BLOCK_D // 2, H, 2])
    return tl.reshape(tl.permute(k, (2, 0, 1, 3)), [BLOCK_N, BLOCK_D])


@triton.jit
def dequantize_values(v_words, v_scale, v_zero, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, DT: tl.constexpr, ON_GPU: tl.constexpr):
    """Values [BLOCK_N, BLOCK_D] in DT, rows in tile_slots' order, from
    load_tile's value words and scales, as dequantize_keys, each slot's
    scale and zero applied over its channel group."""
    H: tl.constexpr = 16 // BITS
    R: tl.constexpr = BLOCK_N // H
    NG: tl.constexpr = BLOCK_D // GROUP
    shifted = tl.reshape(_shifted_copies(v_words, BITS, DT), [R, NG, GROUP // 2, H])
    v = _scaled_pairs(shifted, v_scale[:, :, None, :, None], v_zero[:, :, None, :, None], BITS, DT, ON_GPU)
    v = tl.reshape(v, [R, BLOCK_D // 2, H, 2])
    return tl.reshape(tl.permute(v, (2, 0, 1, 3)), [BLOCK_N, BLOCK_D])


# The key tile as the QK MMA's operand, straight from registers. Triton keeps
# a dot operand in registers when the tile's layout is the operand's up to a
# permutation of each thread's registers; otherwise it stages the tile in
# shared memory (a store and an ldmatrix read of every element). The B
# operand of mma.sync for 16-bit types, at the k-width Triton gives them
# here (2: a register holds two neighbouring k of one column), with one
# 16-row MMA tile and 4 warps side by side, is the keys transposed [k,
# slots], the thread of warp w and lane l holding the columns 32i + 8w +
# l // 4 (i < 4) and the k 8m + 2 (l % 4) + c (c < 2, m < BLOCK_D / 8). k
# need not be the channel: attention is the same under any permutation of
# the channels applied to queries and keys alike, so k 8m + 2 (l % 4) + c
# is channel (BLOCK_D / 4) (l % 4) + 2m + c (key_operand_channels), and a
# thread's channels are one contiguous run: its words (channel pairs) and
# key scales load 16 bytes at a time. Its columns are the slots of one row
# of words: all 4 of a 4-bit word's, 4 of a 2-bit word's 8 (fields
# 4 (w // 2) + i; warps w and w + 2 load the same words). The tile holds
# OPERAND_N slots and its dot runs on OPERAND_WARPS warps (others work,
# staged through shared memory).
OPERAND_TILE = 128
OPERAND_N = tl.constexpr(OPERAND_TILE)  # the same, for the kernels
OPERAND_WARPS = 4


@triton.jit
def _operand_rows(BITS: tl.constexpr):
    """The key operand's word row (in the tile) of each thread, [1, 8 (l //
    4), 4 (w), 1, 1], and the first of the thread's 4 fields in it [1, 1, 4,
    1, 1] (load_key_operand's dims)."""
    lh = tl.arange(0, 8)[None, :, None, None, None]
    w = tl.arange(0, 4)[None, None, :, None, None]
    if BITS == 4:
        return 8 * w + lh, w * 0
    else:
        return 8 * (w % 2) + lh, 4 * (w // 2)


@triton.jit
def key_operand_slots(BITS: tl.constexpr):
    """The slot (from the tile's first) of each column of the key operand
    (dequantize_key_operand): column 32i + 8w + l//4 is field i of its
    thread's word row. Positions, and the value tile's rows, are loaded in
    this order (attention does not depend on slot order); for 4-bit codes
    it is tile_slots'."""
    H: tl.constexpr = 16 // BITS
    n = tl.arange(0, OPERAND_N)
    w = (n // 8) % 4
    lh = n % 8
    i = n // 32
    if BITS == 4:
        return H * (8 * w + lh) + i
    else:
        return H * (8 * (w % 2) + lh) + 4 * (w // 2) + i


@triton.jit
def key_operand_channels(BLOCK_D: tl.constexpr):
    """The channel of each k (row) of the key operand [BLOCK_D]: k 8m + 2a + c
    is channel (BLOCK_D / 4) a + 2m + c. The queries are loaded so."""
    k = tl.arange(0, BLOCK_D)
    return (BLOCK_D // 4) * ((k // 2) % 4) + 2 * (k // 8) + k % 2


@triton.jit
def load_key_operand(KC, KS, KZ, start, end, stride_kcw, stride_kcd, stride_ksg, stride_ksd, head_dim,
                     BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr):
    """The key words, scales and zeros of the OPERAND_N-slot tile at `start`
    (a multiple of OPERAND_N, or of GROUP where that is smaller), each
    thread's own (see OPERAND_N): words [4 (l % 4), 8 (l // 4), 4 (w), MH, 4]
    int32, channel pairs (BLOCK_D / 8) (l % 4) + 4 mh + ml (MH = BLOCK_D /
    32), and the scales and zeros of their channels [4, 8, 4, MH, 4, 2];
    slots at or past `end` and channels past head_dim are not read. In this
    order of dims Triton's coalescing gives each thread 4 contiguous words
    (scales: 8 halves) a load, the lanes over (l % 4, l // 4) and the warps
    over w."""
    H: tl.constexpr = 16 // BITS
    MH: tl.constexpr = BLOCK_D // 32
    rows, _ = _operand_rows(BITS)
    row = start // H + rows
    ll = tl.arange(0, 4)[:, None, None, None, None]
    pair = (BLOCK_D // 8) * ll + 4 * tl.arange(0, MH)[None, None, None, :, None] + tl.arange(0, 4)
    mask = (pair < head_dim // 2) & (row * H < end)
    at = (row // 2) * stride_kcw + ((row % 2) * (head_dim // 2) + pair) * stride_kcd
    # Masked-off words are left unread: their scales and zeros are 0, so they
    # dequantize to 0 whatever they hold (and no register is zeroed first).
    words = tl.load(KC + at, mask=mask)
    group = row * H // GROUP  # a word's slots lie in one group
    channel = 2 * ((BLOCK_D // 8) * ll + 4 * tl.arange(0, MH)[None, None, None, :, None]) + tl.arange(0, 8)
    s_at = group * stride_ksg + channel * stride_ksd
    s_mask = (channel < head_dim) & (group * GROUP < end)
    scale = tl.reshape(tl.load(KS + s_at, mask=s_mask, other=0.0), [4, 8, 4, MH, 4, 2])
    zero = tl.reshape(tl.load(KZ + s_at, mask=s_mask, other=0.0), [4, 8, 4, MH, 4, 2])
    return words, _pack_halves(scale), _pack_halves(zero)


@triton.jit
def _pack_halves(x):
    """16-bit pairs [..., 2] -> int32 [...] holding them (low half first): a
    prefetched tile's scales cross the loop as whole registers, not as
    halves the compiler repacks every iteration."""
    lo, hi = tl.split(x)
    return (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _unpack_halves(x, DT: tl.constexpr):
    """_pack_halves undone: int32 [...] -> [..., 2] in DT (a 16-bit float)."""
    lo = (x & 0xFFFF).to(tl.int16).to(DT, bitcast=True)
    hi = (x >> 16).to(tl.int16).to(DT, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def dequantize_key_operand(words, scale, zero, BITS: tl.constexpr, BLOCK_D: tl.constexpr, DT: tl.constexpr,
                           ON_GPU: tl.constexpr):
    """Keys transposed [BLOCK_D, OPERAND_N] in DT, rows in
    key_operand_channels' order and columns in key_operand_slots', from
    load_key_operand's words, scales and zeros: each thread unpacks its
    words' 4 fields of its own slots in place (_scaled_pairs), and the dims
    are only relabelled into [k, slots], so on 4 warps the tile is the QK
    MMA's B operand as it lies in the registers."""
    MH: tl.constexpr = BLOCK_D // 32
    _, first = _operand_rows(BITS)
    x = tl.join(tl.join(words, words), tl.join(words, words))
    x = tl.reshape(x, [4, 8, 4, MH, 4, 4]) >> (BITS * first)[:, :, :, :, :, None]
    shift, _ = copy_fields(BITS, DT, 4)
    scale = _unpack_halves(scale, tl.float16)[:, :, :, :, :, None, :]
    zero = _unpack_halves(zero, tl.float16)[:, :, :, :, :, None, :]
    k = _scaled_pairs(x >> shift, scale, zero, BITS, DT, ON_GPU, 4)  # [l % 4, l // 4, w, mh, ml, i, c]
    # k 8 (4 mh + ml) + 2 (l % 4) + c, slots 32i + 8w + l // 4
    return tl.reshape(tl.permute(k, (3, 4, 0, 6, 5, 2, 1)), [BLOCK_D, OPERAND_N])


@triton.jit
def operand_value_rows(v, BITS: tl.constexpr, BLOCK_D: tl.constexpr):
    """A value tile of OPERAND_N rows in tile_slots' order (dequantize_values)
    reordered to key_operand_slots' (the same for 4-bit codes)."""
    if BITS == 4:
        return v
    else:
        # tile_slots row 16h + r holds slot 8r + h; column 32i + 8w + l//4 holds
        # slot 8r + h with r = 8 (w % 2) + l // 4, h = 4 (w // 2) + i.
        v = tl.reshape(v, [2, 4, 2, 8, BLOCK_D])  # [w // 2, i, w % 2, l // 4]
        return tl.reshape(tl.permute(v, (1, 0, 2, 3, 4)), [OPERAND_N, BLOCK_D])


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------

VALUE_BLOCK_N = 16  # slots per program of the value quantizer
DEQUANT_BLOCK_N = 32  # slots per program of the dequantizer (divides every group size)


def quantize(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, length: torch.Tensor, *, bits: int,
             group: int) -> QuantKV:
    """k, v [B, H, T, D] fp16/bf16/fp32 (T a multiple of group; any strides)
    -> QuantKV in the layout of contract.py, on k's device. Slots at or past
    length[b], and slots whose pos is PAD_POS, are padding (code 0, pos
    PAD_POS). Same result, byte for byte, as reference.quantize."""
    check_kv(k, v, pos, length, bits, group)
    common.check_launchable(k, "k")
    batch, heads, slots, dim = k.shape
    want = shapes(batch, heads, slots, dim, bits, group)
    dev = k.device
    out = {name: torch.empty(want[name], dtype=torch.int32 if name.endswith("codes") else torch.float16, device=dev)
           for name in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")}
    slot = torch.arange(slots, device=dev)
    valid = (slot[None, :] < length[:, None].to(torch.int64)) & (pos != PAD_POS)
    pos = torch.where(valid, pos.to(torch.int32), PAD_POS).contiguous()
    length = length.clone()
    if batch and heads and slots:
        _quantize_keys_kernel[(batch * heads, slots // group)](
            k, pos, length, out["k_codes"], out["k_scale"], out["k_zero"],
            *k.stride(), *pos.stride(), *length.stride(), *out["k_codes"].stride(), *out["k_scale"].stride(),
            heads, dim, BITS=bits, GROUP=group, BLOCK_D=triton.next_power_of_2(dim))
        _quantize_values_kernel[(batch * heads, triton.cdiv(slots, VALUE_BLOCK_N), dim // group)](
            v, pos, length, out["v_codes"], out["v_scale"], out["v_zero"],
            *v.stride(), *pos.stride(), *length.stride(), *out["v_codes"].stride(), *out["v_scale"].stride(),
            heads, slots, dim, BITS=bits, GROUP=group, BLOCK_N=VALUE_BLOCK_N)
    return QuantKV(**out, pos=pos, length=length, bits=bits, group=group)


def dequantize(seg: QuantKV) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [B, H, T, D] float32 of a segment (0 in padding slots), loaded
    and unpacked as a decode kernel does it, in float32."""
    check_segment(seg, check_values=False)
    common.check_launchable(seg.pos, "seg")
    batch, heads, _, dim = seg.k_codes.shape
    slots = seg.slots
    k = torch.empty((batch, heads, slots, dim), dtype=torch.float32, device=seg.pos.device)
    v = torch.empty_like(k)
    if batch and heads and slots:
        _dequantize_kernel[(batch * heads, slots // DEQUANT_BLOCK_N)](
            seg.k_codes, seg.k_scale, seg.k_zero, seg.v_codes, seg.v_scale, seg.v_zero, seg.pos, seg.length, k, v,
            *seg.k_codes.stride(), *seg.k_scale.stride(), *seg.v_codes.stride(), *seg.v_scale.stride(),
            *seg.pos.stride(), *seg.length.stride(), *k.stride(), heads, dim,
            BITS=seg.bits, GROUP=seg.group, BLOCK_N=DEQUANT_BLOCK_N, BLOCK_D=triton.next_power_of_2(dim))
    return k, v
