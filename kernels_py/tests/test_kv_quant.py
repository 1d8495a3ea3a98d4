"""The KV quantization op: the kernels' packed bytes equal the reference's,
the layout is the documented one, values come back within the quantization
bound, padding neither widens a range nor comes back, and bad inputs get
clear errors."""

import pytest
import torch
import triton
import triton.language as tl

from kernels_py.ops import common, kv_quant
from kernels_py.ops.kv_quant import reference as ref
from kernels_py.ops.kv_quant.cases import error_over_bound, random_kv
from kernels_py.ops.kv_quant.kernel import (
    OPERAND_TILE, _field_masks, _shifted_copies, code_pairs, copy_fields, dequantize_key_operand, dequantize_keys,
    dequantize_values, key_operand_channels, key_operand_slots, load_key_operand, load_tile, load_value_scales,
    load_value_words, operand_value_rows, tile_slots)

FIELDS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "pos", "length")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits", [2, 4])
def test_kernel_packs_the_reference_bytes_and_round_trips(bits, group, dtype, device):
    head_dim = 128 if group == 128 else 64
    k, v, pos, length = (t.to(device) for t in random_kv(batch=2, kv_heads=2, slots=2 * group, head_dim=head_dim,
                                                         lengths=[2 * group, group], dtype=dtype, seed=bits + group))
    pos[0, 3] = kv_quant.PAD_POS  # a padding slot inside a group
    got = kv_quant.quantize(k, v, pos, length, bits=bits, group=group)
    want = ref.quantize(k, v, pos, length, bits=bits, group=group)
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    k_hat, v_hat = kv_quant.dequantize(got)
    ref_k, ref_v = ref.dequantize(want)
    assert torch.equal(k_hat, ref_k) and torch.equal(v_hat, ref_v)
    # Within half a scale (plus fp16 rounding of scale and zero) on real slots; padding comes back 0.
    real = torch.ones(2, 2 * group, dtype=torch.bool, device=device)
    real[0, 3] = False
    real[1, group:] = False
    for x, x_hat, scale, zero, axis in ((k, k_hat, got.k_scale, got.k_zero, 2), (v, v_hat, got.v_scale, got.v_zero, 3)):
        s, z = scale.repeat_interleave(group, axis), zero.repeat_interleave(group, axis)
        mask = real[:, None, :, None]
        assert error_over_bound(x * mask, x_hat * mask, s, z) <= 1.0
        assert (x_hat[~real[:, None, :, None].expand_as(x_hat)] == 0).all()
    assert got.pos[0, 3] == kv_quant.PAD_POS and (got.pos[1, group:] == kv_quant.PAD_POS).all()


def test_layout_on_a_hand_made_example():
    """4-bit, group 32: even channels ramp 0..15 over slots 0..15 then back,
    odd channels the other way, so codes equal the ramps. Word (w, half * 16
    + j) holds slots 8w + 4half + i of channels 2j (bits 4i) and 2j + 1 (16
    + 4i); values per token, channel c's code c % 16, packed alike."""
    slots, dim = 32, 32
    ramp = torch.cat([torch.arange(16.0), torch.arange(15.0, -1.0, -1.0)])
    even = torch.arange(dim) % 2 == 0
    k = torch.where(even[None, :], ramp[:, None], 15.0 - ramp[:, None])[None, None].contiguous()
    v = torch.arange(dim, dtype=torch.float32).remainder(16)[None, None, None, :].expand(1, 1, slots, dim).contiguous()
    pos = torch.arange(slots, dtype=torch.int32)[None]
    seg = ref.quantize(k, v, pos, torch.tensor([slots]), bits=4, group=32)
    assert seg.k_scale[0, 0, 0].eq(1.0).all() and seg.k_zero[0, 0, 0].eq(0.0).all()
    assert seg.k_codes.shape == seg.v_codes.shape == (1, 1, 4, dim)

    def word(lo_codes, hi_codes):
        return sum(int(c) << (4 * i) for i, c in enumerate(lo_codes)) + \
            sum(int(c) << (16 + 4 * i) for i, c in enumerate(hi_codes))

    for w in range(4):
        for half in range(2):
            s = ramp[8 * w + 4 * half:][:4]
            assert seg.k_codes[0, 0, w, half * 16] & 0xFFFFFFFF == word(s, 15 - s), (w, half)
            for j in (0, 1, 9):
                assert seg.v_codes[0, 0, w, half * 16 + j] & 0xFFFFFFFF == \
                    word([2 * j % 16] * 4, [(2 * j + 1) % 16] * 4), (w, half, j)
    assert seg.v_codes[0, 0, 0, 1] & 0xFFFFFFFF == 0x33332222
    assert seg.nbytes == 4 * dim * 4 + 2 * dim * 2 + 4 * dim * 4 + 2 * slots * 2


def test_padding_does_not_widen_ranges(device):
    k, v, pos, length = (t.to(device) for t in random_kv(batch=1, kv_heads=1, slots=32, head_dim=32, lengths=[32],
                                                         dtype=torch.float32))
    padded_k, padded_v = k.clone(), v.clone()
    padded_k[0, 0, 5] = padded_v[0, 0, 5] = 1000.0
    pos = pos.clone()
    pos[0, 5] = kv_quant.PAD_POS
    a = kv_quant.quantize(k, v, pos, length, bits=2, group=32)
    b = kv_quant.quantize(padded_k, padded_v, pos, length, bits=2, group=32)
    for name in FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    # Padding may hold anything, NaN too (an empty() buffer), inside the length or past it; the slots in use not.
    padded_k[0, 0, 5] = padded_v[0, 0, 5] = float("nan")
    for quantize in (kv_quant.quantize, kv_quant.reference.quantize):
        c = quantize(padded_k, padded_v, pos, length, bits=2, group=32)
        assert all(torch.equal(getattr(a, name), getattr(c, name)) for name in FIELDS)
    short = torch.tensor([0], device=device)  # every slot past the length
    assert (quantize(padded_k, padded_v, pos, short, bits=2, group=32).pos == kv_quant.PAD_POS).all()
    padded_k[0, 0, 6] = float("nan")
    with pytest.raises(ValueError, match="finite .* in the slots in use"):
        kv_quant.quantize(padded_k, padded_v, pos, length, bits=2, group=32)


def test_bad_inputs_get_clear_errors(device):
    k, v, pos, length = (t.to(device) for t in random_kv(batch=1, kv_heads=1, slots=64, head_dim=64, lengths=[64],
                                                         dtype=torch.float16))
    with pytest.raises(ValueError, match="bits=3 is not supported: KV codes are 2 or 4 bits"):
        kv_quant.quantize(k, v, pos, length, bits=3, group=32)
    with pytest.raises(ValueError, match="group=48 must be one of"):
        kv_quant.quantize(k, v, pos, length, bits=4, group=48)
    k80, v80, _, _ = (t.to(device) for t in random_kv(batch=1, kv_heads=1, slots=64, head_dim=80, lengths=[64],
                                                      dtype=torch.float16))
    with pytest.raises(ValueError, match="group=32 does not divide head_dim=80"):
        kv_quant.quantize(k80, v80, pos, length, bits=4, group=32)
    with pytest.raises(ValueError, match="40 slots is not a multiple of the group size 32"):
        kv_quant.quantize(k[:, :, :40], v[:, :, :40], pos[:, :40], torch.tensor([32], device=device), bits=4, group=32)
    with pytest.raises(ValueError, match="length must be whole groups of 32"):
        kv_quant.quantize(k, v, pos, torch.tensor([40], device=device), bits=4, group=32)
    with pytest.raises(TypeError, match="k has dtype torch.int32"):
        kv_quant.quantize(k.int(), v, pos, length, bits=4, group=32)
    seg = kv_quant.quantize(k, v, pos, length, bits=4, group=32)
    bad = kv_quant.QuantKV(**{**seg.__dict__, "k_scale": seg.k_scale[:, :, :1]})
    with pytest.raises(ValueError, match=r"segment.k_scale must have shape \(1, 1, 2, 64\)"):
        kv_quant.dequantize(bad)
    bad = kv_quant.QuantKV(**{**seg.__dict__, "v_zero": seg.v_zero.float()})
    with pytest.raises(TypeError, match="segment.v_zero must be torch.float16"):
        kv_quant.dequantize(bad)


def test_concat_needs_a_full_first_segment(device):
    k, v, pos, length = (t.to(device) for t in random_kv(batch=1, kv_heads=1, slots=64, head_dim=32, lengths=[32],
                                                         dtype=torch.float16))
    half = kv_quant.quantize(k, v, pos, length, bits=2, group=32)
    full = kv_quant.quantize(k, v, pos, torch.tensor([64], device=device), bits=2, group=32)
    assert kv_quant.concat(full, half).length.tolist() == [96]
    with pytest.raises(ValueError, match="not all in use"):
        kv_quant.concat(half, full)



def _other_layout(t):
    """The same values as t [B, H, rows, cols], laid out cols-major (a view)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize("scale, zero", [("k_scale", "k_zero"), ("v_scale", "v_zero")])
@pytest.mark.parametrize("moved", ["scale", "zero"])
def test_a_zero_laid_out_unlike_its_scale_is_refused(scale, zero, moved, device):
    # The kernels address a zero with its scale's strides: a zero laid out
    # otherwise was read at the wrong places and dequantized silently wrong.
    k, v, pos, length = (t.to(device) for t in random_kv(batch=2, kv_heads=2, slots=64, head_dim=64, lengths=[64, 32],
                                                         dtype=torch.float16))
    seg = kv_quant.quantize(k, v, pos, length, bits=4, group=32)
    name = scale if moved == "scale" else zero
    bad = kv_quant.QuantKV(**{**seg.__dict__, name: _other_layout(getattr(seg, name))})
    for impl in (kv_quant.dequantize, ref.dequantize):
        with pytest.raises(ValueError, match=f"segment.{zero} has strides .* kernels read both with the scale's"):
            impl(bad)
    # Laid out alike, any layout is read as the reference reads it.
    alike = kv_quant.QuantKV(**{**seg.__dict__, scale: _other_layout(getattr(seg, scale)),
                                zero: _other_layout(getattr(seg, zero))})
    for got, want in zip(kv_quant.dequantize(alike), ref.dequantize(seg)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("bits, group", [(4.0, 32), (4, 32.0), (torch.tensor(4), 32), (4, torch.tensor(32))],
                         ids=["bits-float", "group-float", "bits-tensor", "group-tensor"])
def test_bits_and_group_must_be_ints(bits, group, device):
    # 4.0 or a tensor equal to 4 passed the membership test and failed inside
    # torch.empty or the kernel (an interpreter error, a compile error on a GPU).
    k, v, pos, length = (t.to(device) for t in random_kv(batch=1, kv_heads=1, slots=64, head_dim=64, lengths=[64],
                                                         dtype=torch.float16))
    for impl in (kv_quant.quantize, ref.quantize):
        with pytest.raises(ValueError, match=r"(bits|group)=.* \(an int\)"):
            impl(k, v, pos, length, bits=bits, group=group)
    seg = kv_quant.quantize(k, v, pos, length, bits=4, group=32)
    bad = kv_quant.QuantKV(**{**seg.__dict__, "bits": bits, "group": group})
    for impl in (kv_quant.dequantize, ref.dequantize):
        with pytest.raises(ValueError, match=r"\(an int\)"):
            impl(bad)


def test_an_empty_head_dim_is_refused(device):
    # 0 % group == 0 let head_dim 0 through to a kernel that cannot take it.
    k, v, pos, length = (t.to(device) for t in random_kv(batch=1, kv_heads=1, slots=64, head_dim=64, lengths=[64],
                                                         dtype=torch.float16))
    for impl in (kv_quant.quantize, ref.quantize):
        with pytest.raises(ValueError, match="head_dim must be at least 1, got 0"):
            impl(k[..., :0], v[..., :0], pos, length, bits=4, group=32)


@pytest.mark.parametrize("shift", [2**31, 2**32, -2**31 - 1 - 63], ids=["past-int32", "wraps-to-itself", "below"])
def test_positions_must_fit_int32(shift, device):
    # Positions are stored as int32: wider ones wrapped silently (2**32 + p
    # came back as p; the kernel and the reference also disagreed on one that
    # wrapped onto PAD_POS).
    k, v, pos, length = (t.to(device) for t in random_kv(batch=1, kv_heads=1, slots=64, head_dim=64, lengths=[64],
                                                         dtype=torch.float16))
    for impl in (kv_quant.quantize, ref.quantize):
        with pytest.raises(ValueError, match=r"pos must lie in \[-2\*\*31, 2147483647\]"):
            impl(k, v, pos.long() + shift, length, bits=2, group=32)
    edge = pos.long()
    edge[0, 0], edge[0, 1] = -2**31, kv_quant.PAD_POS  # the extremes fit
    got, want = kv_quant.quantize(k, v, edge, length, bits=2, group=32), ref.quantize(k, v, edge, length, bits=2,
                                                                                     group=32)
    for name in FIELDS:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=0, rtol=0)

@triton.jit
def _code_pairs_kernel(Words, Out, BITS: tl.constexpr, N: tl.constexpr, DT: tl.constexpr):
    H: tl.constexpr = 16 // BITS
    copies = tl.reshape(_shifted_copies(tl.load(Words + tl.arange(0, N))[:, None], BITS, DT), [N, H])
    pair = code_pairs(copies, BITS, DT)  # [N, H, 2]
    slot = tl.arange(0, H)[None, :, None] + tl.arange(0, 2)[None, None, :] * H  # a pair: bit fields i, H + i
    tl.store(Out + tl.arange(0, N)[:, None, None] * (2 * H) + slot, pair.to(tl.float32))


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [
    torch.float16,
    # The interpreter's bitcasts to bf16 give wrong values; it never reaches
    # this branch either (bf16 dots run in float32 there: common.upcast_for_dot).
    # test_field_masks_make_each_field_its_code checks bf16's masks and powers on the CPU.
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(common.interpreter_mode(),
                                                          reason="bf16 bitcasts need a GPU")),
])
def test_code_pairs_unpack_every_code_exactly(bits, dtype, device):
    """The two-codes-at-once conversion the decode kernels feed their dots
    with: every code of every word, sign bit set or not, comes out as
    itself, in fp16 and in bf16."""
    g = torch.Generator().manual_seed(3)
    words = torch.randint(-2**31, 2**31, (16,), generator=g, dtype=torch.int64).to(torch.int32)
    words[0], words[1] = -1, 0
    out = torch.empty(16, 32 // bits, dtype=torch.float32, device=device)
    _code_pairs_kernel[(1,)](words.to(device), out, BITS=bits, N=16,
                             DT=tl.float16 if dtype == torch.float16 else tl.bfloat16)
    shifts = torch.arange(32 // bits) * bits
    want = ((words.to(torch.int64)[:, None] & 0xFFFFFFFF) >> shifts) & ((1 << bits) - 1)
    assert torch.equal(out.cpu(), want.float())


@triton.jit
def _copy_fields_kernel(Shift, At, BITS: tl.constexpr, DT: tl.constexpr):
    shift, at = copy_fields(BITS, DT)
    tl.store(Shift + tl.arange(0, 16 // BITS), shift)
    tl.store(At + tl.arange(0, 16 // BITS), at)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype,mantissa,shifts", [
    # fp16: one shift a word (2-bit fields 0..4 fit the 10-bit mantissa in place, 5..7 after a shift by 10;
    # 4-bit fields 0, 1 in place, 2, 3 after a shift by 8); bf16's 7 bits take two (2-bit) or three
    (torch.float16, 10, {2: 1, 4: 1}), (torch.bfloat16, 7, {2: 2, 4: 3}), (torch.float32, None, {2: 7, 4: 3})])
def test_copy_fields_unpack_codes_with_few_shifts(bits, dtype, mantissa, shifts, device):
    """Where each of a word's copies takes its code from: shifted right so
    its field lands in the 16-bit half's mantissa (float32: at bit 0), with
    as few distinct shifts as the mantissa allows."""
    h = 16 // bits
    shift = torch.empty(h, dtype=torch.int32, device=device)
    at = torch.empty_like(shift)
    dt = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]
    _copy_fields_kernel[(1,)](shift, at, BITS=bits, DT=dt)
    shift, at = shift.cpu(), at.cpu()
    assert torch.equal(shift + at, torch.arange(h, dtype=torch.int32) * bits)  # copy i reads field i
    assert (at + bits <= (mantissa or bits)).all()
    assert len(set(shift.tolist()) - {0}) == shifts[bits]


@triton.jit
def _field_masks_kernel(Shift, Lanes, Magic, BITS: tl.constexpr, DT: tl.constexpr):
    shift, _ = copy_fields(BITS, DT)
    lanes, magic = _field_masks(BITS, DT)
    offs = tl.arange(0, 16 // BITS)
    tl.store(Shift + offs, shift)
    tl.store(Lanes + offs, lanes)
    tl.store(Magic + offs, magic)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_field_masks_make_each_field_its_code(bits, dtype, device):
    """The masks and powers of two the GPU's PTX block takes (and
    code_pairs), replayed in torch for every copy of words with every sign
    and code: (word >> shift & mask) | power, each half read as a 16-bit
    float, less the power, is the field's code exactly (bf16 too, which the
    interpreter cannot run through code_pairs)."""
    h = 16 // bits
    shift, lanes, magic = (torch.empty(h, dtype=torch.int32, device=device) for _ in range(3))
    _field_masks_kernel[(1,)](shift, lanes, magic, BITS=bits, DT=tl.float16 if dtype == torch.float16 else tl.bfloat16)
    shift, lanes, magic = (t.cpu().to(torch.int64) for t in (shift, lanes, magic))
    g = torch.Generator().manual_seed(5)
    words = torch.randint(0, 2**32, (64,), generator=g, dtype=torch.int64)
    words[0], words[1] = 2**32 - 1, 0
    signed = torch.where(words >= 2**31, words - 2**32, words)  # int32 words shift in their sign, as on a GPU
    t = (((signed[:, None] >> shift) & lanes) | magic) & 0xFFFFFFFF  # [words, copies]

    def as_float(x):  # 16-bit halves (0..65535) read as floats of dtype
        return torch.where(x >= 2**15, x - 2**16, x).to(torch.int16).view(dtype).float()

    got = torch.stack([as_float(t & 0xFFFF) - as_float(magic & 0xFFFF), as_float(t >> 16) - as_float(magic >> 16)],
                      -1)
    fields = torch.arange(h) * bits
    want = torch.stack([(words[:, None] >> fields) & ((1 << bits) - 1),
                        (words[:, None] >> (16 + fields)) & ((1 << bits) - 1)], -1)
    assert torch.equal(got, want.float())


@triton.jit
def _decode_tile_kernel(KC, KS, KZ, VC, VS, VZ, KOut, VOut,
                        stride_kcw, stride_kcd, stride_ksg, stride_ksd, stride_vcw, stride_vcd, stride_vsn,
                        stride_vsg, head_dim, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr, DT: tl.constexpr, ON_GPU: tl.constexpr):
    """A decode kernel's view of one sequence's tiles: load_tile,
    dequantize_keys/_values, each row stored as float32 at its slot
    (tile_slots) of [slots, BLOCK_D]."""
    start = tl.program_id(0) * BLOCK_N
    k_words, k_scale, k_zero, v_words, v_scale, v_zero = load_tile(
        KC, KS, KZ, VC, VS, VZ, start, start + BLOCK_N, stride_kcw, stride_kcd, stride_ksg, stride_ksd, stride_vcw,
        stride_vcd, stride_vsn, stride_vsg, head_dim, BITS, GROUP, BLOCK_N, BLOCK_D)
    k = dequantize_keys(k_words, k_scale, k_zero, BITS, GROUP, BLOCK_N, BLOCK_D, DT, ON_GPU)
    v = dequantize_values(v_words, v_scale, v_zero, BITS, GROUP, BLOCK_N, BLOCK_D, DT, ON_GPU)
    out = (start + tile_slots(BITS, BLOCK_N))[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
    tl.store(KOut + out, k.to(tl.float32))
    tl.store(VOut + out, v.to(tl.float32))


@triton.jit
def _key_operand_kernel(KC, KS, KZ, VC, VS, VZ, KOut, VOut,
                        stride_kcw, stride_kcd, stride_ksg, stride_ksd, stride_vcw, stride_vcd, stride_vsn,
                        stride_vsg, head_dim, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr,
                        DT: tl.constexpr, ON_GPU: tl.constexpr):
    """The same for quant_decode's KEY_OPERAND tiles (128 slots):
    load_key_operand and dequantize_key_operand's keys [k, columns] stored
    at (slot, channel) (key_operand_slots, key_operand_channels), and the
    value rows in operand_value_rows' order at their slots."""
    start = tl.program_id(0) * 128
    end = start + 128
    k_words, k_scale, k_zero = load_key_operand(KC, KS, KZ, start, end, stride_kcw, stride_kcd, stride_ksg,
                                                stride_ksd, head_dim, BITS, GROUP, BLOCK_D)
    kt = dequantize_key_operand(k_words, k_scale, k_zero, BITS, BLOCK_D, DT, ON_GPU)
    v_words = load_value_words(VC, start, end, stride_vcw, stride_vcd, head_dim, BITS, 128, BLOCK_D)
    v_scale, v_zero = load_value_scales(VS, VZ, start, end, stride_vsn, stride_vsg, head_dim, BITS, GROUP, 128,
                                        BLOCK_D)
    v = operand_value_rows(dequantize_values(v_words, v_scale, v_zero, BITS, GROUP, 128, BLOCK_D, DT, ON_GPU),
                           BITS, BLOCK_D)
    slot = start + key_operand_slots(BITS)
    tl.store(KOut + slot[None, :] * BLOCK_D + key_operand_channels(BLOCK_D)[:, None], kt.to(tl.float32))
    tl.store(VOut + slot[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :], v.to(tl.float32))


# bf16 on a GPU only: the interpreter cannot build bf16 constants, and its
# dots upcast bf16 to float32 (common.upcast_for_dot), so no bf16 tile is
# ever made there.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16]
                         + ([] if common.interpreter_mode() else [torch.bfloat16]), ids=str)
@pytest.mark.parametrize("tile", ["in-group", 128, "operand"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits", [2, 4])
def test_decode_tiles_dequantize_as_the_reference(bits, group, tile, dtype, device):
    """The device functions quant_decode builds its tiles with (on a GPU its
    16-bit PTX), on tiles inside one key group (64 slots where the group
    allows), on 128-slot tiles spanning groups and on KEY_OPERAND tiles
    (keys transposed, channels permuted): the reference's float32 values
    exactly, every slot and channel where the tile's order puts it, or
    within the 16-bit roundings of the product and the sum."""
    head_dim = 96 if group == 32 else 128
    block_n = {"in-group": min(64, group), "operand": OPERAND_TILE}.get(tile, tile)
    slots = 2 * max(group, block_n)
    k, v, pos, length = random_kv(batch=1, kv_heads=1, slots=slots, head_dim=head_dim, lengths=[slots],
                                  dtype=torch.float32, seed=bits * group)
    seg = kv_quant.quantize(k.to(device), v.to(device), pos.to(device), length.to(device), bits=bits, group=group)
    want_k, want_v = (t[0, 0].cpu() for t in ref.dequantize(seg.to("cpu")))
    block_d = triton.next_power_of_2(head_dim)
    got_k = torch.full((slots, block_d), float("nan"), device=device)
    got_v = torch.full_like(got_k, float("nan"))
    first = lambda t: t[0, 0]  # noqa: E731
    dt = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]
    args = (first(seg.k_codes), first(seg.k_scale), first(seg.k_zero), first(seg.v_codes), first(seg.v_scale),
            first(seg.v_zero), got_k, got_v, *first(seg.k_codes).stride(), *first(seg.k_scale).stride(),
            *first(seg.v_codes).stride(), *first(seg.v_scale).stride(), head_dim)
    if tile == "operand":
        _key_operand_kernel[(slots // block_n,)](*args, BITS=bits, GROUP=group, BLOCK_D=block_d, DT=dt,
                                                 ON_GPU=got_k.is_cuda)
    else:
        _decode_tile_kernel[(slots // block_n,)](*args, BITS=bits, GROUP=group, BLOCK_N=block_n, BLOCK_D=block_d,
                                                 DT=dt, ON_GPU=got_k.is_cuda)
    zeros = (first(seg.k_zero).float().cpu().repeat_interleave(group, 0),
             first(seg.v_zero).float().cpu().repeat_interleave(group, 1))
    for got, want, zero in ((got_k, want_k, zeros[0]), (got_v, want_v, zeros[1])):
        got = got[:, :head_dim].cpu()
        if dtype == torch.float32:
            assert torch.equal(got, want)
        else:  # code * scale and + zero each round to 16 bits (unit roundoff u): u |code * scale| <= u (|x| +
            # |zero|), and u |x|
            u = 2.0**-11 if dtype == torch.float16 else 2.0**-8
            assert ((got - want).abs() <= 2 * u * (want.abs() + zero.abs())).all()
