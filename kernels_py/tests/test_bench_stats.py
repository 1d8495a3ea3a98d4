"""The stats benchmark runs and reports every field (its timings are not checked)."""

import pytest

from kernels_py.benchmarks import stats


def test_smoke_run_reports_every_path():
    sizes = dict(stats.smoke_sizes(), lengths=[64, 100], batches=[1, 2], repeat=1)
    result = stats.run(**sizes)
    assert [(r["prompt_len"], r["batch"]) for r in result["rows"]] == [(64, 1), (64, 2), (100, 1), (100, 2)]
    for r in result["rows"]:
        for key in ("stats_seconds", "materialize_seconds", "sdpa_seconds", "stats_gbps"):
            assert r[key] > 0
        assert r["stats_vs_sdpa"] == pytest.approx(r["stats_seconds"] / r["sdpa_seconds"])


def test_baselines_compute_what_the_kernels_compute(device):
    import torch

    from kernels_py.triton.attention_stats import attention_stats, recent_rows

    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 8, 64, generator=g).to(device)
    k = torch.randn(2, 40, 64, generator=g).to(device)
    q_pos = recent_rows(40, 8, device=device)
    attn_sum, below = stats._materialize(q, k, q_pos, 0.01)
    s = attention_stats(q, k, q_pos, 0.01)
    torch.testing.assert_close(attn_sum, s.attn_sum, atol=1e-4, rtol=1e-4)
    assert torch.equal(below.to(s.below.dtype), s.below)


@pytest.mark.parametrize("kwargs,match", [
    ({"dtype": "int8"}, "dtype"),
    ({"heads": 6, "kv_heads": 4}, "multiple"),
    ({"lengths": [8], "rows": 16}, "exceed"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        stats.run(**dict(stats.smoke_sizes(), **kwargs))
