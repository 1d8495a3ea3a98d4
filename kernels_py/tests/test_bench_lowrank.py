"""The lowrank benchmark runs and reports every field (its timings are not
checked), and its baselines compute what the kernel computes."""

import pytest
import torch

from kernels_py import benchmarks
from kernels_py.benchmarks import base, lowrank
from kernels_py.ops.lowrank_decode import reference as ref
from kernels_py.ops import lowrank_decode as kernel


def test_smoke_run_reports_every_path():
    sizes = dict(lowrank.Lowrank.smoke_sizes(), lengths=[40, 70], batches=[1, 2], repeat=1)
    result = benchmarks.run("lowrank", sizes)
    assert result["interpreter"] == (result["device"] == "cpu")
    assert [c["name"] for c in result["columns"]] == [c.name for c in lowrank.Lowrank.columns]
    assert [(r["visual_len"], r["batch"]) for r in result["rows"]] == [(40, 1), (40, 2), (70, 1), (70, 2)]
    for r in result["rows"]:
        for key in ("fused_ms", "absorbed_ms", "unfused_ms", "sdpa_ms", "fused_gbps"):
            assert r[key] > 0
        assert 0 <= r["output_err"] < 1e-3  # float32 smoke sizes: rounding; OUTPUT_TOLERANCE warns past 2e-3
        assert r["speedup_vs_unfused"] == pytest.approx(r["unfused_ms"] / r["fused_ms"])
        assert r["speedup_vs_sdpa"] == pytest.approx(r["sdpa_ms"] / r["fused_ms"])
        assert r["absorbed_vs_sdpa"] == pytest.approx(r["sdpa_ms"] / r["absorbed_ms"])
        # The step's modeled bytes: the compressed cache read once (U_v of the
        # 75% low-rank tokens only up to rank / 4), plus the logits written
        # and re-read for the masses (float32 over this float32 cache: 8
        # bytes a head and token).
        elem, rank, b_, h = 4, r["rank_k"], r["batch"], r["heads"]
        read = r["compressed_bytes"] - b_ * r["visual_len"] * 0.75 * (rank - rank // 4) * elem
        assert r["model_bytes"] == pytest.approx(read + b_ * h * (r["visual_len"] + r["dense_len"]) * 8)
        assert r["fused_gbps"] == pytest.approx(r["model_bytes"] / r["fused_ms"] / 1e6)
        assert r["absorbed_gbps"] == pytest.approx(r["absorbed_model_bytes"] / r["absorbed_ms"] / 1e6)
        # The absorbed kernel writes no logits of the compressed tokens; its mass kernel reads U_k again.
        assert r["absorbed_model_bytes"] == pytest.approx(read + b_ * h * r["dense_len"] * 8
                                                          + b_ * r["visual_len"] * rank * elem + b_ * h * rank * 8)
        assert r["fused_tflops"] > 0 and r["absorbed_tflops"] > 0
        # Sizes alone give the bytes: 4-byte floats here (smoke dtype float32).
        n, b, s, rank = r["visual_len"], r["batch"], r["dense_len"], r["rank_k"]
        width = r["kv_heads"] * r["head_dim"]
        packed = b * 4 * 2 * (n * rank + rank * width + s * width)
        assert r["compressed_bytes"] == packed
        assert r["full_bytes"] == b * 4 * 2 * (n + s) * width
        assert r["compression_ratio"] == pytest.approx(r["full_bytes"] / packed)


def test_baselines_compute_what_the_kernels_compute(device):
    g = torch.Generator(device=device).manual_seed(3)
    q, q_pos, comp, dense = lowrank._make(2, 50, 6, 4, 2, 64, 16, torch.float32, device, g)
    # The benchmark's cache: values in two rank groups stored grouped (the
    # full-rank quarter first), keys at full rank, every token visible.
    assert comp.rank_v[:, :13].eq(16).all() and comp.rank_v[:, 13:].eq(4).all() and comp.rank_k.eq(16).all()
    want = ref.lowrank_decode(q, q_pos, comp, dense, rope_base=lowrank.ROPE_BASE)
    fused = kernel.lowrank_decode(q, q_pos, comp, dense, rope_base=lowrank.ROPE_BASE)
    torch.testing.assert_close(fused.out, want.out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lowrank._unfused(q, comp, dense, lowrank.ROPE_BASE), want.out, atol=1e-4, rtol=1e-4)
    no_rope = ref.lowrank_decode(q, q_pos, comp, dense, rope_base=None).out
    torch.testing.assert_close(lowrank._unfused(q, comp, dense, None), no_rope, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kernel.lowrank_decode_absorbed(q, q_pos, comp, dense).out, no_rope,
                               atol=1e-4, rtol=1e-4)
    # Full-cache SDPA is plain attention over whatever K/V it is given.
    ck, cv = ref.decompress(comp, 2, lowrank.ROPE_BASE)
    out, _ = base.sdpa(q, torch.cat([ck, dense.k], 2), torch.cat([cv, dense.v], 2))
    torch.testing.assert_close(out, want.out, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kwargs,match", [
    ({"dtype": "int8"}, "dtype"),
    ({"heads": 6, "kv_heads": 4}, "multiple"),
    ({"ranks": [0]}, "below its minimum 1"),
    ({"ranks": [16, 1000]}, "ranks"),
    ({"dense_len": 0}, "below its minimum 1"),
    ({"lengths": [0]}, "below its minimum 1"),
    ({"rank": 8}, "did you mean 'ranks'"),
    ({"rank_chunk": 24}, "rank_chunk=24 is not one of"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        benchmarks.run("lowrank", dict(lowrank.Lowrank.smoke_sizes(), **kwargs))


def test_partial_keys_group_both_factors(device):
    """partial=both: keys share the value groups, and the fused kernel, which
    rebuilds them in rank chunks up to each tile's rank, still computes the
    reference."""
    g = torch.Generator(device=device).manual_seed(4)
    q, q_pos, comp, dense = lowrank._make(1, 70, 5, 4, 2, 64, 64, torch.float32, device, g, 0.25, "both")
    assert torch.equal(comp.rank_k, comp.rank_v) and set(comp.rank_k.unique().tolist()) == {64, 16}
    want = ref.lowrank_decode(q, q_pos, comp, dense, rope_base=lowrank.ROPE_BASE)
    got = kernel.lowrank_decode(q, q_pos, comp, dense, rope_base=lowrank.ROPE_BASE, rank_chunk=16)
    torch.testing.assert_close(got.out, want.out, atol=1e-4, rtol=1e-4)
    sizes = dict(lowrank.Lowrank.smoke_sizes(), lengths=[40], batches=[1], repeat=1, partial="both")
    (row,) = benchmarks.run("lowrank", sizes)["rows"]
    assert row["partial"] == "both" and row["fused_ms"] > 0


def test_the_rank_chunk_reaches_the_fused_calls(monkeypatch):
    """--rank-chunk is what the fused calls are given (0: none, the kernel's
    one-MMA rebuild, what AttentionPack runs), and the row and the estimate's
    step record it; before, partial keys always took the low group's rank as
    the chunk."""
    seen = []
    real = kernel.lowrank_decode

    def spy(*args, **kwargs):
        seen.append(kwargs.get("rank_chunk"))
        return real(*args, **kwargs)

    monkeypatch.setattr(lowrank.op, "lowrank_decode", spy)
    for chunk, want in ((0, None), (16, 16)):
        seen.clear()
        sizes = dict(lowrank.Lowrank.smoke_sizes(), lengths=[40], batches=[1], repeat=1, partial="keys",
                     rank_chunk=chunk)
        (row,) = benchmarks.run("lowrank", sizes)["rows"]
        assert row["rank_chunk"] == chunk and seen and set(seen) == {want}, (chunk, seen)
