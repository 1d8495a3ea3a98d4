"""Triton kernels that quantize and pack a segment of keys and values into
the layout of contract.py, dequantize it back, and the device functions a
decode kernel uses to dequantize a tile in registers.

Dequantization in registers: a code c < 2^23 becomes the float32
2^23 + c by OR-ing it into the mantissa of 2^23 (0x4B000000) and
reinterpreting the bits; subtracting 2^23 leaves c exactly. That is a LOP3
and an FADD per element instead of an integer-to-float conversion (a
quarter-rate instruction), the magic-number trick of BitDecoding and QServe.
Where the dot takes 16-bit operands, code_pairs does the same in fp16
(0x6400 = 1024.0) or bf16 (0x4300 = 128.0), two codes of a word at a time,
and the multiply-add by scale and zero runs in that dtype, two elements to
an instruction.

Reference: reference.py beside this file (identical float operations, so
the packed bytes match exactly).
"""

import torch
import triton
import triton.language as tl

from kernels_py.ops.kv_quant.contract import PAD_POS, QuantKV, check_segment, per_word, shapes
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
def unpack_key_tile(words, BITS: tl.constexpr, WORDS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Key words [WORDS, BLOCK_D] (each holds 32 / BITS consecutive slots of a
    channel) -> codes [WORDS * 32 / BITS, BLOCK_D], slot-major."""
    P: tl.constexpr = 32 // BITS
    shifts = tl.arange(0, P) * BITS
    codes = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
    return tl.reshape(codes, [WORDS * P, BLOCK_D])


@triton.jit
def unpack_value_tile(words, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """Value words [BLOCK_N, BLOCK_W] (each holds 32 / BITS consecutive
    channels of a slot) -> codes [BLOCK_N, BLOCK_W * 32 / BITS]."""
    P: tl.constexpr = 32 // BITS
    shifts = tl.arange(0, P) * BITS
    codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(codes, [BLOCK_N, BLOCK_W * P])


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
    ranges over the group, codes packed 32 / BITS slots to a word."""
    P: tl.constexpr = 32 // BITS
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
    shifts = tl.arange(0, P) * BITS
    words = tl.sum(tl.reshape(codes, [GROUP // P, P, BLOCK_D]) << shifts[None, :, None], 1)
    offs_w = g * (GROUP // P) + tl.arange(0, GROUP // P)
    tl.store(Codes + b * stride_cb + h * stride_ch + offs_w[:, None] * stride_cw + offs_d[None, :] * stride_cd,
             words, mask=d_mask[None, :])
    row = b * stride_sb + h * stride_sh + g * stride_sg + offs_d * stride_sd
    tl.store(Scale + row, scale, mask=d_mask)
    tl.store(Zero + row, zero, mask=d_mask)


@triton.jit
def _quantize_values_kernel(
    V, Pos, Len, Codes, Scale, Zero,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_pb, stride_pn, stride_lb,
    stride_cb, stride_ch, stride_cn, stride_cw,
    stride_sb, stride_sh, stride_sn, stride_sg,
    heads, slots,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (sequence x kv head, block of BLOCK_N slots, group of
    GROUP channels): per-token ranges over the group, codes packed 32 / BITS
    channels to a word."""
    P: tl.constexpr = 32 // BITS
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
    shifts = tl.arange(0, P) * BITS
    words = tl.sum(tl.reshape(codes, [BLOCK_N, GROUP // P, P]) << shifts[None, None, :], 2)
    offs_w = g * (GROUP // P) + tl.arange(0, GROUP // P)
    tl.store(Codes + b * stride_cb + h * stride_ch + offs_n[:, None] * stride_cn + offs_w[None, :] * stride_cw,
             words, mask=in_range[:, None])
    row = b * stride_sb + h * stride_sh + offs_n * stride_sn + g * stride_sg
    tl.store(Scale + row, scale, mask=in_range)
    tl.store(Zero + row, zero, mask=in_range)


@triton.jit
def _dequantize_kernel(
    KCodes, KScale, KZero, VCodes, VScale, VZero, Pos, Len, KOut, VOut,
    stride_kcb, stride_kch, stride_kcw, stride_kcd,
    stride_ksb, stride_ksh, stride_ksg, stride_ksd,
    stride_vcb, stride_vch, stride_vcn, stride_vcw,
    stride_vsb, stride_vsh, stride_vsn, stride_vsg,
    stride_pb, stride_pn, stride_lb,
    stride_ob, stride_oh, stride_on, stride_od,
    heads, head_dim,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """One program per (sequence x kv head, tile of BLOCK_N slots inside one
    key group): the tile dequantized in registers as a decode kernel does it,
    written out as float32 (the dequantize-then-attend baseline, and tests)."""
    bh = tl.program_id(0)
    b = (bh // heads).to(tl.int64)
    h = bh % heads
    start = tl.program_id(1) * BLOCK_N
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    length = tl.load(Len + b * stride_lb)
    pos = tl.load(Pos + b * stride_pb + offs_n * stride_pn)
    valid = (offs_n < length) & (pos != PAD)
    words = load_tile(KCodes + b * stride_kcb + h * stride_kch, VCodes + b * stride_vcb + h * stride_vch,
                      VScale + b * stride_vsb + h * stride_vsh, VZero + b * stride_vsb + h * stride_vsh,
                      start, True, offs_n, offs_d, d_mask, stride_kcw, stride_kcd, stride_vcn, stride_vcw,
                      stride_vsn, stride_vsg, head_dim, BITS, GROUP, BLOCK_N, BLOCK_D, BLOCK_W, False)
    k_scale, k_zero = key_scales(KScale + b * stride_ksb + h * stride_ksh, KZero + b * stride_ksb + h * stride_ksh,
                                 start, offs_d, d_mask, stride_ksg, stride_ksd, GROUP)
    k_words, v_words, v_scale, v_zero = words
    k = dequantize_keys(k_words, k_scale, k_zero, BITS, BLOCK_N, BLOCK_D, tl.float32)
    v = dequantize_values(v_words, v_scale, v_zero, BITS, GROUP, BLOCK_N, BLOCK_D, BLOCK_W, tl.float32, False)
    out = b * stride_ob + h * stride_oh + offs_n[:, None] * stride_on + offs_d[None, :] * stride_od
    keep = valid[:, None] & d_mask[None, :]
    tl.store(KOut + out, tl.where(keep, k, 0.0), mask=d_mask[None, :])
    tl.store(VOut + out, tl.where(keep, v, 0.0), mask=d_mask[None, :])


@triton.jit
def load_tile(KC, VC, VS, VZ, start, live, offs_n, offs_d, d_mask, stride_kcw, stride_kcd, stride_vcn, stride_vcw,
              stride_vsn, stride_vsg, head_dim, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr, SCALE_PER_WORD: tl.constexpr):
    """The packed words and value scales of the tile of slots [start, start +
    BLOCK_N) of one (sequence, kv head): key words [BLOCK_N / P, BLOCK_D],
    value words [BLOCK_N, BLOCK_W], and the value scales and zeros, one per
    slot and channel group: [BLOCK_N, BLOCK_D / GROUP], or with
    SCALE_PER_WORD the group's pair loaded for each word, [BLOCK_N, BLOCK_W]
    (more loads, no broadcast in registers: which costs fewer registers
    depends on the shape, so the autotuner picks). Those past head_dim are 0.
    Nothing is read unless `live` (0s instead). A tuple, so a loop can issue
    the next tile's loads before it works on this one (dequantize_keys,
    _values); the key scales are a row per group, loaded by key_scales where
    they are used."""
    P: tl.constexpr = 32 // BITS
    offs_kw = start // P + tl.arange(0, BLOCK_N // P)
    k_words = tl.load(KC + offs_kw[:, None] * stride_kcw + offs_d[None, :] * stride_kcd,
                      mask=d_mask[None, :] & live, other=0)
    offs_w = tl.arange(0, BLOCK_W)
    v_words = tl.load(VC + offs_n[:, None] * stride_vcn + offs_w[None, :] * stride_vcw,
                      mask=(offs_w[None, :] < head_dim // P) & live, other=0)
    if SCALE_PER_WORD:
        v_at = offs_n[:, None] * stride_vsn + ((offs_w * P) // GROUP)[None, :] * stride_vsg  # each word's group
        s_mask = (offs_w[None, :] < head_dim // P) & live
    else:
        offs_g = tl.arange(0, BLOCK_D // GROUP)
        v_at = offs_n[:, None] * stride_vsn + offs_g[None, :] * stride_vsg
        s_mask = (offs_g[None, :] < head_dim // GROUP) & live
    v_scale = tl.load(VS + v_at, mask=s_mask, other=0.0)
    v_zero = tl.load(VZ + v_at, mask=s_mask, other=0.0)
    return k_words, v_words, v_scale, v_zero


@triton.jit
def key_scales(KS, KZ, start, offs_d, d_mask, stride_ksg, stride_ksd, GROUP: tl.constexpr):
    """The key scale and zero [BLOCK_D] of the group holding slot `start`."""
    k_row = (start // GROUP) * stride_ksg + offs_d * stride_ksd
    return tl.load(KS + k_row, mask=d_mask, other=0.0), tl.load(KZ + k_row, mask=d_mask, other=0.0)


@triton.jit
def code_pairs(shifted, BITS: tl.constexpr, DT: tl.constexpr):
    """Packed words already shifted right by i * BITS (int32, any shape) ->
    [..., 2] DT (fp16 or bf16): the codes at bits [0, BITS) and [16, 16 +
    BITS) of each, exactly. A mask and an OR put both codes in the mantissas
    of two 16-bit 1024.0s (fp16 0x6400; bf16 128.0, 0x4300) at once and one
    packed subtract takes the offsets off: two codes a shift, two LOP3s and
    an HADD2, where a code at a time costs a conversion each. Triton cannot
    reinterpret the word as two halves in place, so the halves are split and
    joined; ptxas spends about a PRMT a pair on it."""
    lanes: tl.constexpr = ((1 << BITS) - 1) * 0x10001
    if DT == tl.float16:
        t = (shifted & lanes) | 0x64006400
        pair = tl.join(t.to(tl.int16).to(tl.float16, bitcast=True),
                       (t >> 16).to(tl.int16).to(tl.float16, bitcast=True))
        return pair - 1024.0
    else:
        t = (shifted & lanes) | 0x43004300
        pair = tl.join(t.to(tl.int16).to(tl.bfloat16, bitcast=True),
                       (t >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True))
        return pair - 128.0


@triton.jit
def dequantize_keys(k_words, k_scale, k_zero, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    DT: tl.constexpr):
    """Keys [BLOCK_N, BLOCK_D] in DT from load_tile's key words and
    key_scales' row: codes unpacked and converted in registers, then one
    multiply-add by scale and zero in DT (float32: exactly
    reference.dequantize's operations; fp16/bf16: code_pairs, then a single
    rounding of the same product and sum, two elements to an instruction).
    Padding slots come out as whatever their zero codes give; callers mask
    them."""
    P: tl.constexpr = 32 // BITS
    if DT == tl.float32:
        codes = unpack_key_tile(k_words, BITS, BLOCK_N // P, BLOCK_D)
        return codes_to_float(codes) * k_scale.to(tl.float32)[None, :] + k_zero.to(tl.float32)[None, :]
    else:
        H: tl.constexpr = P // 2
        shifts = tl.arange(0, H) * BITS
        pair = code_pairs(k_words[:, None, :] >> shifts[None, :, None], BITS, DT)  # [W, H, D, 2]: slots i, i + H
        k = pair * k_scale.to(DT)[None, None, :, None] + k_zero.to(DT)[None, None, :, None]
        return tl.reshape(tl.permute(k, (0, 3, 1, 2)), [BLOCK_N, BLOCK_D])


@triton.jit
def dequantize_values(v_words, v_scale, v_zero, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr, DT: tl.constexpr, SCALE_PER_WORD: tl.constexpr):
    """Values [BLOCK_N, BLOCK_D] in DT from load_tile's value words and
    scales, as dequantize_keys, each slot's scales broadcast over their
    channel group (a word's channels lie in one group: GROUP >= 32 / BITS)."""
    P: tl.constexpr = 32 // BITS
    NG: tl.constexpr = BLOCK_D // GROUP
    if DT == tl.float32:
        codes = codes_to_float(unpack_value_tile(v_words, BITS, BLOCK_N, BLOCK_W))
        # Channels grouped as the scales are: by word, or by channel group.
        codes = tl.reshape(codes, [BLOCK_N, BLOCK_W, P] if SCALE_PER_WORD else [BLOCK_N, NG, GROUP])
        v = codes * v_scale.to(tl.float32)[:, :, None] + v_zero.to(tl.float32)[:, :, None]
        return tl.reshape(v, [BLOCK_N, BLOCK_D])
    elif SCALE_PER_WORD:
        H: tl.constexpr = P // 2
        shifts = tl.arange(0, H) * BITS
        pair = code_pairs(v_words[:, :, None] >> shifts[None, None, :], BITS, DT)  # [N, W, H, 2]: channels i, i + H
        v = pair * v_scale.to(DT)[:, :, None, None] + v_zero.to(DT)[:, :, None, None]
        return tl.reshape(tl.permute(v, (0, 1, 3, 2)), [BLOCK_N, BLOCK_D])
    else:
        H: tl.constexpr = P // 2
        WG: tl.constexpr = GROUP // P  # words per channel group
        shifts = tl.arange(0, H) * BITS
        words = tl.reshape(v_words, [BLOCK_N, NG, WG])
        pair = code_pairs(words[:, :, :, None] >> shifts[None, None, None, :], BITS, DT)  # channels i, i + H
        v = pair * v_scale.to(DT)[:, :, None, None, None] + v_zero.to(DT)[:, :, None, None, None]
        return tl.reshape(tl.permute(v, (0, 1, 2, 4, 3)), [BLOCK_N, BLOCK_D])


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
            heads, slots, BITS=bits, GROUP=group, BLOCK_N=VALUE_BLOCK_N)
    return QuantKV(**out, pos=pos, length=length, bits=bits, group=group)


def dequantize(seg: QuantKV) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [B, H, T, D] float32 of a segment (0 in padding slots), by the
    in-register dequantization a decode kernel uses."""
    check_segment(seg, check_values=False)
    batch, heads, _, dim = seg.k_codes.shape
    slots = seg.slots
    k = torch.empty((batch, heads, slots, dim), dtype=torch.float32, device=seg.pos.device)
    v = torch.empty_like(k)
    if batch and heads and slots:
        _dequantize_kernel[(batch * heads, slots // DEQUANT_BLOCK_N)](
            seg.k_codes, seg.k_scale, seg.k_zero, seg.v_codes, seg.v_scale, seg.v_zero, seg.pos, seg.length, k, v,
            *seg.k_codes.stride(), *seg.k_scale.stride(), *seg.v_codes.stride(), *seg.v_scale.stride(),
            *seg.pos.stride(), *seg.length.stride(), *k.stride(), heads, dim,
            BITS=seg.bits, GROUP=seg.group, BLOCK_N=DEQUANT_BLOCK_N, BLOCK_D=triton.next_power_of_2(dim),
            BLOCK_W=triton.next_power_of_2(dim // per_word(seg.bits)))
    return k, v
