"""The sparse-prefill benchmark runs and reports every field (its timings are
not checked)."""

from types import SimpleNamespace

import pytest

from kernels_py import benchmarks, runtime
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


def test_a_row_whose_attention_was_not_flashattention_is_said_so(monkeypatch):
    """Both paths are FlashAttention only where it takes the inputs: a float32 run on a GPU fell back to another
    backend while its speedups read as against FlashAttention. Each row says which backend ran, and the run warns
    (as here, where the CPU's SDPA is no FlashAttention and the interpreter's own note is left out)."""
    monkeypatch.setattr(benchmarks, "runtime", SimpleNamespace(interpreter_mode=lambda: False, device=runtime.device,
                                                               progress=runtime.progress))
    sizes = dict(sparse_prefill.SparsePrefill.smoke_sizes(), lengths=[40], percents=[50], repeat=1)
    result = benchmarks.run("sparse-prefill", sizes)
    assert [r["sdpa_backend"] for r in result["rows"]] == ["default"]
    assert any(n.startswith("SDPA's FlashAttention backend does not take these inputs (float32)") and
               "(default, column sdpa_backend)" in n for n in result["notes"]), result["notes"]
