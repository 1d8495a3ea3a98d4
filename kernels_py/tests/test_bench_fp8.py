"""The fp8 benchmark runs and reports every field (its timings are not
checked), and its baselines compute what the kernel computes."""

import pytest
import torch

from kernels_py import benchmarks
from kernels_py.benchmarks import base, fp8
from kernels_py.ops import fp8_decode as op


@pytest.mark.parametrize("scale", ["tensor", "token"])
def test_smoke_run_reports_every_path(scale):
    sizes = dict(fp8.FP8.smoke_sizes(), lengths=[64, 100], scale=scale, repeat=1)
    result = benchmarks.run("fp8", sizes)
    assert [c["name"] for c in result["columns"]] == [c.name for c in fp8.FP8.columns]
    assert [r["context"] for r in result["rows"]] == [64, 100]
    for r in result["rows"]:
        for key in ("fp8_ms", "dequant_ms", "sdpa_ms", "fp8_gbps"):
            assert r[key] > 0
        assert 0 <= r["output_err"] < 1e-3  # float32 smoke sizes: rounding; OUTPUT_TOLERANCE warns past 2e-3
        n, h, d = r["context"], r["kv_heads"], r["head_dim"]
        scales = 8 * h * n if scale == "token" else 8
        assert r["read_bytes"] == 2 * h * n * d + scales + 4 * n  # codes, scales, positions
        # vs float32, over what the cache holds (positions too, as quant and lowrank count them)
        assert r["compression_ratio"] == pytest.approx(2 * h * n * d * 4 / (2 * h * n * d + scales + 4 * n))
        assert r["speedup_vs_sdpa"] == pytest.approx(r["sdpa_ms"] / r["fp8_ms"])


def test_baselines_compute_what_the_kernel_computes(device):
    g = torch.Generator(device=device).manual_seed(5)
    q, q_pos, k, v, ks, vs, pos, full_k, full_v = fp8._make(2, 90, 4, 2, 64, "e4m3", "head", torch.float32, device, g)
    want = op.reference.fp8_decode(q, q_pos, k, v, ks, vs, pos)
    torch.testing.assert_close(op.fp8_decode(q, q_pos, k, v, ks, vs, pos).out, want.out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fp8._dequantize_then_attend(q, k, v, ks, vs, torch.float32), want.out,
                               atol=1e-5, rtol=1e-5)
    exact = base.sdpa(q, full_k, full_v)[0]
    assert 1e-4 < (exact - want.out).abs().max() < 0.1  # the 16-bit cache: close, not the same
