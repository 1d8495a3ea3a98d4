"""Group-wise quantization: error within half a step, codes really packed,
both KV conventions (keys per channel, values per token) expressible."""

import math

import pytest
import torch

from kernels_py.methods.quantized import dequantize, quantize


def runs_of(x: torch.Tensor, group: int, dim: int) -> torch.Tensor:
    """[*rest, runs, group] view of x cut along `dim`, tail padded with its last element."""
    moved = x.movedim(dim, -1)
    length = moved.shape[-1]
    padded = math.ceil(length / group) * group
    tail = moved[..., -1:].expand(*moved.shape[:-1], padded - length)
    return torch.cat([moved, tail], dim=-1).reshape(*moved.shape[:-1], padded // group, group)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape, group, dim", [((3, 37, 20), 8, -1), ((3, 37, 20), 16, -2), ((50,), 4, 0)])
def test_round_trip_error_is_at_most_half_a_step(bits, shape, group, dim):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(bits)) * 3 + 1
    q = quantize(x, bits, group, dim)
    back = dequantize(q)
    assert back.shape == x.shape and back.dtype == x.dtype
    runs = runs_of(x, group, dim)
    step = (runs.amax(-1) - runs.amin(-1)) / (2 ** bits - 1)  # [*rest, runs]
    err = runs_of((back - x).abs(), group, dim)
    # fp16 scale and zero add a relative error of about 2^-11 of the run's range.
    bound = step[..., None] / 2 + 1e-3 * (runs.amax(-1) - runs.amin(-1) + runs.abs().amax(-1))[..., None]
    assert (err <= bound).all()
    assert err.max() > 0  # lossy: the comparison has teeth


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_packed_byte_counts(bits):
    rows, length, group = 5, 40, 16  # 40 pads to 48: three runs per row
    q = quantize(torch.randn(rows, length), bits, group, dim=-1)
    assert q.data.dtype == torch.uint8
    assert q.data.shape == (rows, 48 * bits // 8)
    assert q.scale.shape == q.zero.shape == (rows, 3)
    assert q.scale.dtype == q.zero.dtype == torch.float16
    assert q.nbytes == rows * 48 * bits // 8 + 2 * rows * 3 * 2


def test_four_bit_codes_share_a_byte_low_nibble_first():
    x = torch.tensor([0.0, 1.0, 1.0, 0.0])  # one run: zero 0, scale 1/15
    q = quantize(x, 4, 4)
    assert q.data.tolist() == [0 | 15 << 4, 15 | 0 << 4]
    assert q.zero.item() == 0.0 and q.scale.item() == pytest.approx(1 / 15, rel=1e-3)
    two = quantize(torch.tensor([0.0, 1.0, 2.0, 3.0]), 2, 4)  # codes 0, 1, 2, 3 in one byte
    assert two.data.tolist() == [0 | 1 << 2 | 2 << 4 | 3 << 6]
    torch.testing.assert_close(dequantize(two), torch.tensor([0.0, 1.0, 2.0, 3.0]))


def test_keys_per_channel_and_values_per_token():
    """Runs along tokens (dim=-2) give each channel its own scales; a channel
    with a large outlier range then only coarsens itself."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 32, 8, generator=gen)
    keys[..., 3] *= 100  # an outlier channel, as real key caches have
    per_channel = quantize(keys, 4, 16, dim=-2)
    per_token = quantize(keys, 4, 8, dim=-1)
    assert per_channel.scale.shape == (2, 8, 2)  # [heads, channels, token runs]
    assert per_token.scale.shape == (2, 32, 1)  # [heads, tokens, channel runs]
    quiet = [c for c in range(8) if c != 3]
    err_channel = (dequantize(per_channel) - keys)[..., quiet].abs().mean()
    err_token = (dequantize(per_token) - keys)[..., quiet].abs().mean()
    assert err_channel * 10 < err_token


def test_constant_runs_are_exact_and_dtype_is_kept():
    x = torch.full((4, 8), 0.5, dtype=torch.float16)
    back = dequantize(quantize(x, 4, 8))
    assert back.dtype == torch.float16
    torch.testing.assert_close(back, x, atol=0, rtol=0)


def test_bad_arguments_are_refused():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="bits=3"):
        quantize(x, 3, 8)
    with pytest.raises(ValueError, match="multiple of 2"):
        quantize(x, 4, 3)
    with pytest.raises(ValueError, match="dim=2"):
        quantize(x, 4, 8, dim=2)
    with pytest.raises(TypeError, match="floating"):
        quantize(torch.ones(4, 8, dtype=torch.int32), 4, 8)
    with pytest.raises(ValueError, match="fp16 range"):
        quantize(x * 1e6, 4, 8)
    with pytest.raises(ValueError, match="empty"):
        quantize(torch.randn(4, 0), 4, 8)
