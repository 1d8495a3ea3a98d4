"""`workbench selftest` runs every registered op's selftest; each passes its
own check on its small input."""

import dataclasses
import re

import pytest
import torch

from kernels_py import selftest
from kernels_py.ops import OPS, folders


def test_attention_stats_selftest_finds_the_salient_tokens():
    result = OPS["attention_stats"].cases.selftest(heads=4, kv_heads=2, visual_tokens=64, text_tokens=16)
    assert result["ok"], result
    assert result["top_kernel_tokens"] == result["salient_tokens"]
    # Each post-vision row is a distribution over the keys it sees.
    assert abs(sum(s["kernel_share"] for s in result["rows"]) - 1.0) < 1e-4, result["rows"]


def test_lowrank_decode_selftest_checks_every_kernel():
    result = OPS["lowrank_decode"].cases.selftest(heads=4, kv_heads=2, rank=16, visual_tokens=40, text_tokens=8)
    assert result["ok"], result
    assert [(r["variant"], r["splits"]) for r in result["rows"]] == [
        ("fused, keys rotated after rebuild", "default"), ("fused, keys rotated after rebuild", 3),
        ("fused, keys as cached", "default"), ("absorbed (rank space)", "default"), ("absorbed (rank space)", 3)]
    assert all(r["out_err"] < 1e-4 for r in result["rows"])


def test_lowrank_decode_selftest_verdict_names_a_nan_error(monkeypatch):
    # max() dropped a NaN error that came after a number: a kernel giving NaN
    # was reported "worst error at 0.0095 of its tolerance" (and MISMATCH).
    from kernels_py.ops.lowrank_decode import cases

    absorbed = cases.lowrank_decode_absorbed

    def nan_output(*args, **kwargs):
        got = absorbed(*args, **kwargs)
        return got._replace(out=torch.full_like(got.out, float("nan")))

    monkeypatch.setattr(cases, "lowrank_decode_absorbed", nan_output)
    result = cases.selftest(heads=4, kv_heads=2, rank=16, visual_tokens=40, text_tokens=8)
    assert not result["ok"] and [r["ok"] for r in result["rows"]] == [True, True, True, False, False]
    assert result["verdict"] == "worst error at nan of its tolerance", result["verdict"]


def test_kv_quant_selftest_verdict_says_what_failed(monkeypatch):
    # Its verdict was "MISMATCH" on a failure, printed as "kernel vs reference:
    # MISMATCH MISMATCH" with nothing on whether bytes or errors were off.
    from kernels_py.ops.kv_quant import cases

    quantize = cases.quantize

    def flipped(*args, **kwargs):
        seg = quantize(*args, **kwargs)
        return dataclasses.replace(seg, v_codes=seg.v_codes ^ 1)

    good = cases.selftest(kv_heads=1, slots=128)
    assert good["ok"] and good["verdict"].startswith("packed bytes equal the reference's, worst error at 0."), good
    monkeypatch.setattr(cases, "quantize", flipped)
    bad = cases.selftest(kv_heads=1, slots=128)
    assert not bad["ok"] and bad["verdict"].startswith("packed bytes differ from the reference's"), bad["verdict"]


@pytest.mark.parametrize("op", ["gather_decode", "fp8_decode", "quant_decode", "lowrank_decode"])
def test_split_k_selftests_catch_a_merge_that_keeps_one_split(op, monkeypatch):
    """The interpreter's default for a selftest's few tokens is one split, so
    each split-K op forces SELFTEST_SPLITS on a case: a merge that reads only
    the first split passes the default rows and fails those."""
    from kernels_py.ops import splitk
    from kernels_py.ops.lowrank_decode import kernel as lowrank

    merge, lowrank_merge = splitk.merge, lowrank._merge

    def first_split(part_o, part_lse, out, lse):
        merge(part_o[:, :, :, :1], part_lse[:, :, :, :1], out, lse)

    def first_split_lowrank(q, q_pos, comp, dense, dense_logits, part_o, part_rank, part_lse, *rest, **kw):
        part_lse[:, :, :, 1:-1] = float("-inf")  # [B, H, M, splits + 1]: the splits after the first as if empty
        lowrank_merge(q, q_pos, comp, dense, dense_logits, part_o, part_rank, part_lse, *rest, **kw)

    monkeypatch.setattr(splitk, "merge", first_split)
    monkeypatch.setattr(lowrank, "_merge", first_split_lowrank)
    small = dict(heads=4, kv_heads=2, rank=16, visual_tokens=64, text_tokens=8) if op == "lowrank_decode" else \
        dict(heads=4, kv_heads=2, head_dim=128 if op == "quant_decode" else 32)  # KIVI's rows: groups of 128
    rows = OPS[op].cases.selftest(**small)["rows"]
    assert [r["splits"] == splitk.SELFTEST_SPLITS for r in rows] == [not r["ok"] for r in rows], rows
    assert any(not r["ok"] for r in rows)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quant_decode_selftest_names_the_dtype_of_its_uncompressed_tokens(dtype, monkeypatch):
    # Its title said "32 fp16 tokens" whatever dtype the uncompressed segment had (--dtype's).
    from kernels_py.ops.quant_decode import cases

    made = []
    make_cache = cases.make_cache
    monkeypatch.setattr(cases, "make_cache", lambda **kw: made.append(make_cache(**kw)) or made[-1])
    result = cases.selftest(dtype=dtype, heads=2, kv_heads=1)
    assert {str(dense.k.dtype).removeprefix("torch.") for *_, dense in made} == {dtype}
    assert f"32 uncompressed {dtype} tokens" in result["title"], result["title"]


SMALL_SELFTESTS = {
    "attention_stats": dict(heads=4, kv_heads=2, visual_tokens=64, text_tokens=16),
    "lowrank_decode": dict(heads=4, kv_heads=2, rank=16, visual_tokens=40, text_tokens=8),
    "quant_decode": dict(heads=2, kv_heads=1),
    "gather_decode": dict(heads=2, kv_heads=1, head_dim=32, slots=64),
    "fp8_decode": dict(heads=2, kv_heads=1, head_dim=32, slots=64),
}


@pytest.mark.parametrize("op", sorted(SMALL_SELFTESTS))
def test_selftests_print_the_tolerances_they_check_against(op):
    # Printed with one digit, bfloat16's 2.5e-2 read "tolerance 3e-02": an
    # error of 0.026 failed under a tolerance that said it passed.
    result = OPS[op].cases.selftest(dtype="bfloat16", **SMALL_SELFTESTS[op])
    tolerance = OPS[op].cases.TOLERANCE[torch.bfloat16]
    text = " ".join([result["verdict"], *result.get("notes", [])])
    printed = {float(m) for m in re.findall(r"(?:tolerance|lse|mass) ([0-9][0-9.e+-]*)", text)}
    assert set(tolerance if isinstance(tolerance, tuple) else [tolerance]) <= printed, text


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


def test_launchers_given_cpu_tensors_without_the_interpreter_say_what_to_do(monkeypatch):
    """Triton alone fails such a launch with "0 active drivers"; the
    launchers name the tensor and the two ways to run (common.check_launchable)."""
    import torch

    from kernels_py.ops.attention_stats import row_stats
    from kernels_py.ops.gather_decode import cases as gather_cases
    from kernels_py.ops.gather_decode import gather_decode
    from kernels_py.ops.kv_quant import quantize
    from kernels_py.ops.kv_quant.cases import random_kv

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    calls = {
        "gather_decode": lambda: gather_decode(*gather_cases.make_case(batch=1, heads=4, kv_heads=2, head_dim=32,
                                                                        slots=64, counts=[[16, 16]])),
        "row_stats": lambda: row_stats(torch.randn(4, 3, 32), torch.randn(2, 10, 32), torch.arange(3)),
        "quantize": lambda: quantize(*random_kv(batch=1, kv_heads=2, slots=64, head_dim=32, lengths=[64],
                                                dtype=torch.float32), bits=4, group=32),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=r"is on cpu: the Triton kernels run on a CUDA device, or on the CPU "
                                             r"under Triton's interpreter \(TRITON_INTERPRET=1"):
            call()


def test_a_selftest_without_the_result_keys_says_what_it_returns(monkeypatch):
    """A new op's selftest that returns only its table is told the keys
    `workbench selftest` and `watch` read, not a KeyError."""
    from kernels_py.tables import Column, table

    cases = OPS["gather_decode"].cases
    monkeypatch.setattr(cases, "selftest", lambda seed, dtype: table((Column("ok", "", "within"),), [{"ok": True}]))
    with pytest.raises(TypeError, match=r"kernels_py/ops/gather_decode/cases.py: selftest\(\) returned a result "
                                        r"without \['title', 'ok', 'verdict', 'kernel_seconds'\]"):
        selftest.run(ops=["gather_decode"])


# What makes an op visible to the compile test, selftest, watch and bench; checked here, where no GPU toolchain is
# needed (the compile test skips without one).
def test_every_kernel_has_a_case():
    for name, op in OPS.items():
        kernels = op.kernels()
        assert kernels, f"found no @triton.jit *_kernel functions in kernels_py/ops/{name}"
        cased = {k for case in op.cases.COMPILE_CASES for k in case.kernels}
        missing = kernels - cased
        assert not missing, f"no compile case launches {sorted(missing)}: add one to kernels_py/ops/{name}/cases.py"


def test_every_op_folder_is_registered():
    assert folders() == set(OPS), "each folder of kernels_py/ops needs its line in OPS (kernels_py/ops/__init__.py)"
