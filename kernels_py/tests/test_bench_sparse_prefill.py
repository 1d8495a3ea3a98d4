"""The sparse-prefill benchmark runs and reports every field (its timings are
not checked)."""

import pytest

from kernels_py import benchmarks
from kernels_py.benchmarks import sparse_prefill
from kernels_py.methods.sparse_prefill import flops_saved


def test_smoke_run_reports_every_path():
    sizes = dict(sparse_prefill.SparsePrefill.smoke_sizes(), lengths=[40, 64], percents=[25, 50], repeat=1)
    result = benchmarks.run("sparse-prefill", sizes)
    assert [c["name"] for c in result["columns"]] == [c.name for c in sparse_prefill.SparsePrefill.columns]
    assert [(r["tokens"], r["share"]) for r in result["rows"]] == [(40, 0.25), (40, 0.5), (64, 0.25), (64, 0.5)]
    for r in result["rows"]:
        for key in ("full_ms", "sparse_ms", "sparse_attention_ms", "select_ms", "full_tflops", "sparse_tflops"):
            assert r[key] > 0
        assert r["speedup"] == pytest.approx(r["full_ms"] / r["sparse_ms"])
        assert r["total_speedup"] == pytest.approx(r["full_ms"] / (r["select_ms"] + r["sparse_ms"]))
        assert r["flops_saved"] == pytest.approx(100 * flops_saved(r["tokens"], round(r["share"] * r["tokens"])))
