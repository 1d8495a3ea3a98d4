"""The quant benchmark runs and reports every field (its timings are not
checked), and its baselines compute what the kernel computes."""

import pytest
import torch

from kernels_py import benchmarks
from kernels_py.benchmarks import base, quant
from kernels_py.ops import quant_decode as op
from kernels_py.ops.quant_decode import model


def test_smoke_run_reports_every_path():
    sizes = dict(quant.Quant.smoke_sizes(), lengths=[64, 100], batches=[1, 2], repeat=1)
    result = benchmarks.run("quant", sizes)
    assert [c["name"] for c in result["columns"]] == [c.name for c in quant.Quant.columns]
    assert [(r["context"], r["batch"]) for r in result["rows"]] == [(64, 1), (64, 2), (100, 1), (100, 2)]
    for r in result["rows"]:
        for key in ("quant_ms", "dequant_ms", "sdpa_ms", "quantize_ms", "quant_gbps"):
            assert r[key] > 0
        assert 0 <= r["output_err"] < 1e-3  # float32 smoke sizes: rounding; OUTPUT_TOLERANCE warns past 2e-3
        assert r["speedup_vs_sdpa"] == pytest.approx(r["sdpa_ms"] / r["quant_ms"])
        assert r["quant_gbps"] == pytest.approx(r["read_bytes"] / r["quant_ms"] / 1e6)
        # Smoke sizes: float32 inputs, head_dim 64, group 32, 8 dense tokens, a quarter of the tokens in 4 bits.
        n, b, h, d = r["context"], r["batch"], r["kv_heads"], r["head_dim"]
        hi = -(-int(0.25 * n + 0.5) // 32) * 32
        lo = -(-(n - hi) // 32) * 32
        codes = sum(slots * d * bits // 8 * 2 for bits, slots in ((4, hi), (2, lo)))  # K and V
        scales = (hi + lo) // 32 * d * 2 * 2 + (hi + lo) * (d // 32) * 2 * 2  # key and value scale + zero, fp16
        positions = (hi + lo) * 4 + 8 * 4  # int32 slot positions, quantized and dense
        dense = h * 8 * d * 4 * 2  # the 8 newest tokens' K and V in float32
        assert r["read_bytes"] == b * (h * (codes + scales) + positions + dense)
        assert r["full_bytes"] == b * h * (n + 8) * d * 4 * 2


def test_baselines_compute_what_the_kernel_computes(device):
    g = torch.Generator(device=device).manual_seed(3)
    q, q_pos, segs, dense, full_k, full_v, _ = quant._make(2, 100, 6, 4, 2, 64, 0.3, 32, torch.float32, device, g)
    assert [s.bits for s in segs] == [4, 2] and [s.slots for s in segs] == [32, 96]
    want = op.reference.quant_decode(q, q_pos, segs, dense)
    torch.testing.assert_close(op.quant_decode(q, q_pos, segs, dense).out, want.out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(quant._dequantize_then_attend(q, segs, dense, torch.float32), want.out,
                               atol=1e-5, rtol=1e-5)
    # The full-cache baseline sees the same tokens unquantized: close to the quantized answer, not equal.
    full, _ = base.sdpa(q, full_k, full_v)
    assert 0 < (full - want.out).abs().max() < 0.5


@pytest.mark.parametrize("length, hi_share, group, want", [
    (5, 0.25, 32, (32, 0)),      # a share that rounds up to a group past a context shorter than one
    (100, 1.0, 32, (128, 0)),    # every token in 4 bits, the context no whole number of groups
    (100, 0.3, 32, (32, 96)),
    (1, 0.25, 32, (0, 32)),
    (2048, 0.25, 64, (512, 1536)),
])
def test_segments_are_whole_groups_for_any_context_and_share(length, hi_share, group, want):
    step = model.Step(batch=1, context=length, hi_share=hi_share, group=group)
    assert model.segment_slots(step) == want
    g = torch.Generator().manual_seed(0)
    q, q_pos, segs, dense, *_ = quant._make(1, length, 8, 4, 2, 64, hi_share, group, torch.float32, "cpu", g)
    assert [s.slots for s in segs] == [n for n in want if n]
    assert sum(int((s.pos[0] != quant.kv_quant.PAD_POS).sum()) for s in segs) == length
    torch.testing.assert_close(op.quant_decode(q, q_pos, segs, dense).out,
                               op.reference.quant_decode(q, q_pos, segs, dense).out, atol=1e-5, rtol=1e-5)
