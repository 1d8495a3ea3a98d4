"""The KV quantization op: the kernels' packed bytes equal the reference's,
the layout is the documented one, values come back within the quantization
bound, padding neither widens a range nor comes back, and bad inputs get
clear errors."""

import pytest
import torch

from kernels_py.ops import kv_quant
from kernels_py.ops.kv_quant import reference as ref
from kernels_py.ops.kv_quant.cases import error_over_bound, random_kv

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
    """4-bit, group 32, one channel ramping 0..15 over slots 0..15 then 15..0:
    codes equal the ramp, packed 8 slots to a word, slot 8w + i at bits 4i;
    values per token: token t's channels ramp too."""
    slots, dim = 32, 32
    ramp = torch.cat([torch.arange(16.0), torch.arange(15.0, -1.0, -1.0)])
    k = ramp[None, None, :, None].expand(1, 1, slots, dim).contiguous()
    v = torch.arange(dim, dtype=torch.float32).remainder(16)[None, None, None, :].expand(1, 1, slots, dim).contiguous()
    pos = torch.arange(slots, dtype=torch.int32)[None]
    seg = ref.quantize(k, v, pos, torch.tensor([slots]), bits=4, group=32)
    assert seg.k_scale[0, 0, 0, 0] == 1.0 and seg.k_zero[0, 0, 0, 0] == 0.0
    words = seg.k_codes[0, 0, :, 0].tolist()  # 4 words of 8 slots
    expected = [sum(int(ramp[8 * w + i]) << (4 * i) for i in range(8)) for w in range(4)]
    assert [w & 0xFFFFFFFF for w in words] == expected
    assert seg.k_codes.shape == (1, 1, 4, dim) and seg.v_codes.shape == (1, 1, slots, dim // 8)
    assert [w & 0xFFFFFFFF for w in seg.v_codes[0, 0, 0].tolist()] == [0x76543210, 0xFEDCBA98] * 2
    assert seg.nbytes == 4 * dim * 4 + 2 * dim * 2 + slots * (dim // 8) * 4 + 2 * slots * 2


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


def test_bad_inputs_get_clear_errors():
    k, v, pos, length = random_kv(batch=1, kv_heads=1, slots=64, head_dim=64, lengths=[64], dtype=torch.float16)
    with pytest.raises(ValueError, match="bits=3 is not supported: KV codes are 2 or 4 bits"):
        kv_quant.quantize(k, v, pos, length, bits=3, group=32)
    with pytest.raises(ValueError, match="group=48 must be one of"):
        kv_quant.quantize(k, v, pos, length, bits=4, group=48)
    k80, v80, _, _ = random_kv(batch=1, kv_heads=1, slots=64, head_dim=80, lengths=[64], dtype=torch.float16)
    with pytest.raises(ValueError, match="group=32 does not divide head_dim=80"):
        kv_quant.quantize(k80, v80, pos, length, bits=4, group=32)
    with pytest.raises(ValueError, match="40 slots is not a multiple of the group size 32"):
        kv_quant.quantize(k[:, :, :40], v[:, :, :40], pos[:, :40], torch.tensor([32]), bits=4, group=32)
    with pytest.raises(ValueError, match="length must be whole groups of 32"):
        kv_quant.quantize(k, v, pos, torch.tensor([40]), bits=4, group=32)
    with pytest.raises(TypeError, match="k has dtype torch.int32"):
        kv_quant.quantize(k.int(), v, pos, length, bits=4, group=32)
    seg = kv_quant.quantize(k, v, pos, length, bits=4, group=32)
    bad = kv_quant.QuantKV(**{**seg.__dict__, "k_scale": seg.k_scale[:, :, :1]})
    with pytest.raises(ValueError, match=r"segment.k_scale must have shape \(1, 1, 2, 64\)"):
        kv_quant.dequantize(bad)
    bad = kv_quant.QuantKV(**{**seg.__dict__, "v_zero": seg.v_zero.float()})
    with pytest.raises(TypeError, match="segment.v_zero must be torch.float16"):
        kv_quant.dequantize(bad)


def test_concat_needs_a_full_first_segment():
    k, v, pos, length = random_kv(batch=1, kv_heads=1, slots=64, head_dim=32, lengths=[32], dtype=torch.float16)
    half = kv_quant.quantize(k, v, pos, length, bits=2, group=32)
    full = kv_quant.quantize(k, v, pos, torch.tensor([64]), bits=2, group=32)
    assert kv_quant.concat(full, half).length.tolist() == [96]
    with pytest.raises(ValueError, match="not all in use"):
        kv_quant.concat(half, full)
