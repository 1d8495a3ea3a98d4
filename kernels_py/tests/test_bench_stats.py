"""The stats benchmark runs and reports every field (its timings are not checked)."""

import pytest

from kernels_py import benchmarks
from kernels_py.benchmarks import stats
from kernels_py.params import BadKnobs


def test_smoke_run_reports_every_path():
    sizes = dict(stats.Stats.smoke_sizes(), lengths=[64, 100], batches=[1, 2], repeat=1)
    result = benchmarks.run("stats", sizes)
    assert [(r["prompt_len"], r["batch"]) for r in result["rows"]] == [(64, 1), (64, 2), (100, 1), (100, 2)]
    for r in result["rows"]:
        for key in ("stats_seconds", "materialize_seconds", "sdpa_seconds", "stats_gbps"):
            assert r[key] > 0
        assert 0 <= r["output_err"] < 1e-3  # float32 smoke sizes: rounding; OUTPUT_TOLERANCE warns past 2e-3
        assert r["stats_vs_sdpa"] == pytest.approx(r["stats_seconds"] / r["sdpa_seconds"])


@pytest.mark.parametrize("chunk_bytes", [None, 1], ids=["all heads at once", "one kv group at a time"])
def test_baselines_compute_what_the_kernels_compute(device, chunk_bytes, monkeypatch):
    import torch

    from kernels_py.ops.attention_stats import attention_stats, recent_rows

    if chunk_bytes:  # the materialised baseline in kv-group chunks, as at sizes that would not fit at once
        monkeypatch.setattr(stats, "MATERIALIZE_CHUNK_BYTES", chunk_bytes)
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
    ({"rows": 8, "spread": 9}, r"spread \(9\) exceeds rows \(8\)"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        benchmarks.run("stats", dict(stats.Stats.smoke_sizes(), **kwargs))


def test_the_interpreter_shrinks_only_what_the_user_left_unset(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    result = benchmarks.run("stats", {"lengths": [48], "rows": 8, "repeat": 1})
    assert result["params"]["lengths"] == [48] and result["params"]["repeat"] == 1
    assert result["params"]["heads"] == stats.Stats.smoke_sizes()["heads"]
    assert len(result["rows"]) == 1 and "not kernel speed" in result["notes"][0]
    # Knobs that must agree shrink together or not at all: kv_heads set alone keeps the default heads.
    params = benchmarks.run("stats", {"kv_heads": 8, "lengths": [32], "rows": 4, "repeat": 1})["params"]
    assert (params["heads"], params["kv_heads"], params["head_dim"]) == (32, 8, 128)
    # A user's lengths do not take the smoke rows with them: rows must fit the length the user chose.
    with pytest.raises(ValueError, match=r"rows \(50\) exceed the shortest prompt length in lengths=\[8\]"):
        benchmarks.run("stats", {"lengths": [8]})


@pytest.mark.parametrize("name,params,says", [
    # spread 20 holds with the default 50 rows, not with the 16 the interpreter shrank them to
    ("stats", {"spread": 20}, "rows=16 is the CPU interpreter's tiny size, not the default 50: set --rows as well, "
                              "and --lengths, which shrinks only along with it"),
    # group 128 divides the default head_dim, not the 64 of the interpreter's tiny heads
    ("quant", {"group": 128}, "head_dim=64 is the CPU interpreter's tiny size, not the default 128: set --head-dim "
                              "as well, and --heads and --kv-heads, which shrink only along with it"),
])
def test_a_refusal_names_the_knobs_the_interpreter_shrank(monkeypatch, name, params, says):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(BadKnobs) as refused:
        benchmarks.run(name, params)
    assert says in str(refused.value)


def test_a_refusal_of_the_users_own_values_adds_nothing(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(BadKnobs) as refused:
        benchmarks.run("stats", {"heads": 6, "kv_heads": 4})
    assert str(refused.value) == "benchmark 'stats': heads (6) must be a multiple of kv_heads (4)"


def test_spread_rows_are_zipvl_probe_rows(monkeypatch):
    """--spread draws that many of the rows from before the others (ZipVL's
    random probe rows, seed 0): the kernels get them with their range, and
    the op's model (the estimate beside the time on a GPU) takes the same rows."""
    from kernels_py.ops.attention_stats import model, probe_rows

    seen = []
    real = stats.attention_stats

    def record(q, k, q_pos, p, pos_range=None):
        seen.append((q_pos.tolist(), pos_range))
        return real(q, k, q_pos, p, pos_range=pos_range)

    monkeypatch.setattr(stats, "attention_stats", record)
    sizes = dict(stats.Stats.smoke_sizes(), lengths=[200], rows=12, spread=8, repeat=1)
    result = benchmarks.run("stats", sizes)
    want = probe_rows(200, recent=4, random=8).tolist()
    assert seen and all(pos == want and rng == (min(want), max(want)) for pos, rng in seen)
    assert want[:8] != list(range(188, 196)) and want[-4:] == [196, 197, 198, 199]
    assert result["rows"][0]["spread"] == 8 and result["rows"][0]["rows"] == 12
    assert model.positions(model.Step(batch=1, context=200, rows=12, spread=8)) == tuple(want)


def test_every_row_has_every_column():
    result = benchmarks.run("stats", dict(stats.Stats.smoke_sizes(), repeat=1))
    names = [c["name"] for c in result["columns"]]
    assert all(list(row) == names for row in result["rows"])
    assert {c["unit"] for c in result["columns"]} <= {"", "ms", "s", "bytes", "GB/s", "%", "x"}
