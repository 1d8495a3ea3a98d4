import pytest
import torch

from kernels_py.ref import attention_mass as ref
from kernels_py.triton import attention_mass as kernel

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def make(heads, kv_heads, rows, keys, head_dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, rows, head_dim, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(kv_heads, keys, head_dim, generator=g).to(device=device, dtype=dtype)
    return q, k


@pytest.mark.parametrize(
    "heads,kv_heads,rows,keys,head_dim,q_start",
    [
        (2, 2, 16, 64, 64, 48),    # aligned, MHA
        (4, 1, 7, 100, 64, 93),    # ragged keys and rows, GQA 4
        (7, 1, 1, 37, 128, 36),    # single row, GQA 7
        (2, 2, 40, 40, 80, 0),     # all rows (prefill), head_dim not a power of two
        (3, 3, 5, 200, 96, 120),   # rows that do not end at the last key
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_reference(heads, kv_heads, rows, keys, head_dim, q_start, dtype, device):
    q, k = make(heads, kv_heads, rows, keys, head_dim, dtype, device)
    got = kernel.attention_mass(q, k, q_start)
    want = ref.attention_mass(q, k, q_start)
    assert got.shape == (heads, keys) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    # Every query row is a distribution over the keys it sees.
    torch.testing.assert_close(got.sum(1), torch.full((heads,), float(rows), device=device), atol=1e-3, rtol=1e-4)
    # Causality: nothing lands on keys after the last query's position.
    assert torch.all(got[:, q_start + rows:] == 0)


def test_strided_inputs(device):
    q, k = make(4, 2, 24, 64, 64, torch.float32, device)
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    assert not q_t.is_contiguous()
    torch.testing.assert_close(kernel.attention_mass(q_t, k, 40), ref.attention_mass(q, k, 40), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "q_shape,k_shape,q_dtype,k_dtype,q_start,error,match",
    [
        ((2, 4, 64), (2, 8), torch.float32, torch.float32, 0, ValueError, "3-D"),
        ((2, 4, 64), (2, 8, 64), torch.int32, torch.int32, 0, TypeError, "dtype"),
        ((2, 4, 64), (2, 8, 64), torch.float32, torch.float16, 0, TypeError, "must match"),
        ((2, 4, 64), (2, 8, 32), torch.float32, torch.float32, 0, ValueError, "head_dim"),
        ((3, 4, 64), (2, 8, 64), torch.float32, torch.float32, 0, ValueError, "multiple"),
        ((2, 4, 64), (2, 8, 64), torch.float32, torch.float32, 6, ValueError, "outside"),
    ],
)
def test_bad_inputs(q_shape, k_shape, q_dtype, k_dtype, q_start, error, match, device):
    q = torch.zeros(q_shape, dtype=q_dtype, device=device)
    k = torch.zeros(k_shape, dtype=k_dtype, device=device)
    with pytest.raises(error, match=match):
        kernel.attention_mass(q, k, q_start)


def test_selftest_passes_its_own_check():
    from kernels_py import selftest

    result = selftest.run(heads=4, kv_heads=2, visual_tokens=64, text_tokens=16)
    assert result["ok"], result
    assert result["top_kernel_tokens"] == result["salient_tokens"]
    shares = sum(s["kernel_share"] for s in result["segments"])
    assert shares == pytest.approx(1.0, abs=1e-3)
