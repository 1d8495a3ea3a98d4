"""The gather benchmark runs and reports every field (its timings are not
checked), and its baselines compute what the kernel computes."""

import pytest
import torch

from kernels_py import benchmarks
from kernels_py.benchmarks import base, gather
from kernels_py.ops import gather_decode as op


def test_smoke_run_reports_every_path():
    sizes = dict(gather.Gather.smoke_sizes(), lengths=[64, 100], percents=[20, 50], repeat=1)
    result = benchmarks.run("gather", sizes)
    assert [c["name"] for c in result["columns"]] == [c.name for c in gather.Gather.columns]
    assert [(r["context"], r["percent"]) for r in result["rows"]] == [(64, 20), (64, 50), (100, 20), (100, 50)]
    for r in result["rows"]:
        for key in ("gather_ms", "slice_ms", "sdpa_ms", "gather_gbps"):
            assert r[key] > 0
        assert 0 <= r["output_err"] < 1e-3  # float32 smoke sizes: rounding; OUTPUT_TOLERANCE warns past 2e-3
        rows = r["batch"] * r["kv_heads"] * round(r["percent"] / 100 * r["context"])
        assert r["read_bytes"] == rows * (2 * r["head_dim"] * 4 + 8)  # float32 K and V, index and position
        assert r["speedup_vs_slice"] == pytest.approx(r["slice_ms"] / r["gather_ms"])
    # Every size set here, none shrunk: the interpreter's timings are still said to be no kernel speed.
    if result["interpreter"]:
        assert len(result["notes"]) == 1 and "not kernel speed" in result["notes"][0], result["notes"]
        assert "tiny sizes" not in result["notes"][0]
    else:
        assert result["notes"] == []


def test_hbm_shares_are_of_the_bytes_each_path_reads(monkeypatch):
    """The kernel's share of the HBM peak is of the listed rows it reads;
    SDPA's, as the module's doc counts it, of the whole cache."""
    monkeypatch.setattr(gather, "hbm_peak_gbps", lambda device: 1000.0)  # a GPU of 1 TB/s
    result = benchmarks.run("gather", dict(gather.Gather.smoke_sizes(), lengths=[64], percents=[50], repeat=1))
    (r,) = result["rows"]
    whole = r["batch"] * r["kv_heads"] * r["context"] * r["head_dim"] * 4 * 2  # float32 K and V, every row
    assert r["sdpa_hbm_pct"] == pytest.approx(100 * whole / (r["sdpa_ms"] / 1e3) / 1e9 / 1000.0)
    assert r["gather_hbm_pct"] == pytest.approx(100 * r["read_bytes"] / (r["gather_ms"] / 1e3) / 1e9 / 1000.0)


def test_a_kernel_off_its_baseline_is_said_to_time_a_wrong_result(monkeypatch):
    """A kernel edited into a wrong result still times: the run says so."""
    right = op.gather_decode

    def wrong(*args, **kwargs):
        got = right(*args, **kwargs)
        return type(got)(got.out * 1.5, got.lse)

    monkeypatch.setattr(op, "gather_decode", wrong)
    result = benchmarks.run("gather", dict(gather.Gather.smoke_sizes(), lengths=[64], percents=[50], repeat=1))
    (row,) = result["rows"]
    assert row["output_err"] > 0.1
    assert any(n.startswith("row 1: the kernel's output is ") and "its times are of a wrong result" in n
               for n in result["notes"]), result["notes"]


def test_baselines_compute_what_the_kernel_computes(device):
    g = torch.Generator(device=device).manual_seed(5)
    q, q_pos, k, v, pos, index, count = gather._make(2, 90, 4, 2, 64, 0.3, torch.float32, device, g)
    want = op.reference.gather_decode(q, q_pos, k, v, pos, index, count)
    torch.testing.assert_close(op.gather_decode(q, q_pos, k, v, pos, index, count).out, want.out,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gather._slice_then_attend(q, k, v, index), want.out, atol=1e-5, rtol=1e-5)
    assert (base.sdpa(q, k, v)[0] - want.out).abs().max() > 1e-3  # all rows: a different answer


def test_time_median_is_the_median_of_an_even_number_of_runs(monkeypatch):
    """With an even --repeat the time is the mean of the two middle runs,
    where it was the upper one (of 1, 2, 3 and 10 ms: 3 ms, not 2.5)."""
    from kernels_py.benchmarks import base

    clock = iter([0.0, 0.001, 1.0, 1.002, 2.0, 2.003, 3.0, 3.010])  # each run's start and end
    monkeypatch.setattr(base.time, "perf_counter", lambda: next(clock))
    calls = []
    assert base.time_median(lambda: calls.append(1), 4, cuda=False) == pytest.approx(0.0025)
    assert len(calls) == 5  # the warm-up and 4 timed runs
