"""`workbench selftest` runs every registered op's selftest; each passes its
own check on its small input."""

import pytest

from kernels_py import selftest
from kernels_py.ops import OPS


def test_attention_stats_selftest_finds_the_salient_tokens():
    result = OPS["attention_stats"].cases.selftest(heads=4, kv_heads=2, visual_tokens=64, text_tokens=16)
    assert result["ok"], result
    assert result["top_kernel_tokens"] == result["salient_tokens"]
    # Each post-vision row is a distribution over the keys it sees.
    assert abs(sum(s["kernel_share"] for s in result["rows"]) - 1.0) < 1e-4, result["rows"]


def test_lowrank_decode_selftest_checks_every_kernel():
    result = OPS["lowrank_decode"].cases.selftest(heads=4, kv_heads=2, rank=16, visual_tokens=40, text_tokens=8)
    assert result["ok"], result
    assert [r["variant"] for r in result["rows"]] == ["fused, keys rotated after rebuild", "fused, keys as cached",
                                                      "absorbed (rank space)"]
    assert all(r["out_err"] < 1e-4 for r in result["rows"])


def test_run_covers_the_registry_and_rejects_unknown_ops():
    result = selftest.run(ops=["attention_stats"])
    assert result["ok"] and [r["op"] for r in result["ops"]] == ["attention_stats"]
    with pytest.raises(ValueError, match="unknown op"):
        selftest.run(ops=["nope"])


def test_every_op_names_a_registered_benchmark():
    from kernels_py.benchmarks import BENCHMARKS

    for name, op in OPS.items():
        assert op.benchmark in BENCHMARKS, f"op {name} names benchmark {op.benchmark!r}, which is not registered"
        assert op.summary, f"op {name} has no docstring"
        assert op.reference.__doc__, f"op {name} has no reference module with a docstring"


def test_every_op_says_per_row_whether_it_is_within_tolerance():
    # `workbench watch OP` counts the failed rows of the op's table.
    for name, op in OPS.items():
        assert "ok" in [c.name for c in op.cases.COLUMNS], f"op {name}'s selftest table has no ok column"
    result = OPS["attention_stats"].cases.selftest(heads=4, kv_heads=2, visual_tokens=64, text_tokens=16)
    assert [r["ok"] for r in result["rows"]] == [True, True, True]
