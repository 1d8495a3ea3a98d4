"""Every Triton kernel of kernels_py.triton compiles for sm_80 and sm_90, with
the specializations its launcher uses, on a machine without a GPU.

The other kernel tests run under TRITON_INTERPRET=1, which never compiles:
tl.dot shape and dtype rules, codegen type errors, constexpr mistakes and
resource limits only show on the compiled path. The compiling is done by
kernels_py.tests.cuda_compile in one child process per target (run in
parallel), without TRITON_INTERPRET: see its docstring for why it cannot run
in this process and how launches are recorded and specialized. Each child
gets an empty Triton cache, so every run really compiles.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels_py.tests import cuda_compile as cc

ROOT = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 600


def _missing_toolchain() -> str | None:
    from triton import knobs
    from triton.backends import backends

    if "nvidia" not in backends:
        return "the installed Triton has no CUDA backend"
    try:
        knobs.nvidia.ptxas  # resolves (and runs --version) or raises
    except RuntimeError as err:
        return f"Triton's CUDA backend has no usable ptxas: {err}"
    return None


_MISSING = _missing_toolchain()
if _MISSING:
    pytest.skip(_MISSING, allow_module_level=True)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{(case name, target): that case's result} from one child per target."""
    tmp = tmp_path_factory.mktemp("cuda_compile")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    children = {}
    try:
        for target in cc.TARGETS:
            out = tmp / f"sm{target}.json"
            child_env = dict(env, TRITON_CACHE_DIR=str(tmp / f"cache{target}"))
            cmd = [sys.executable, "-m", "kernels_py.tests.cuda_compile", "--target", str(target), "--out", str(out)]
            children[target] = out, subprocess.Popen(cmd, cwd=ROOT, env=child_env, stdout=subprocess.PIPE,
                                                     stderr=subprocess.STDOUT, text=True)
        results = {}
        for target, (out, child) in children.items():
            try:
                log, _ = child.communicate(timeout=CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"compiling for sm_{target} took over {CHILD_TIMEOUT_S} s")
            if child.returncode != 0 or not out.exists():
                pytest.fail(f"the sm_{target} compile process failed (exit {child.returncode}):\n{log[-4000:]}")
            for result in json.loads(out.read_text()):
                results[result["case"], target] = result
    finally:
        for _, child in children.values():  # the other target's, after a failure
            if child.poll() is None:
                child.kill()
                child.communicate()
    return results


def _spec(entry: dict) -> str:
    """The specialization of one compiled launch, for failure messages."""
    if "constexprs" not in entry:  # specializing itself failed
        return "(not specialized)"
    consts = ", ".join(f"{k}={v}" for k, v in entry["constexprs"].items())
    args = ", ".join(f"{k}: {v}" for k, v in entry["signature"].items())
    return (f"[{consts}] num_warps={entry['num_warps']} num_stages={entry['num_stages']}\n"
            f"  args: {args}\n  ints specialized to 1: {', '.join(entry['ones']) or 'none'}")


@pytest.mark.parametrize("target", cc.TARGETS, ids=lambda t: f"sm{t}")
@pytest.mark.parametrize("case", cc.CASES, ids=lambda c: c.name)
def test_compiles(case, target, compiled):
    result = compiled[case.name, target]
    assert result["error"] is None, result["error"]
    missing = set(case.kernels) - set(result["launched"])
    assert not missing, f"{case.name} no longer launches {sorted(missing)}; it launched {result['launched']}"
    assert {e["kernel"] for e in result["compiled"]} == set(result["launched"])

    problems = []
    fits = {}  # autotuned kernel -> whether any compiled config fits in shared memory
    for entry in result["compiled"]:
        where = f"{entry['kernel']} for sm_{target} {_spec(entry)}"
        if entry.get("error"):
            problems.append(f"{where}\n  error: {entry['error']}")
            continue
        if not entry["cubin_bytes"] > 0:
            problems.append(f"{where}: empty cubin")
        # A plain launch needing more shared memory than a block may use fails
        # to load; the autotuner instead skips such a config, so an autotuned
        # launch needs only one config that fits.
        fit = entry["shared"] <= cc.MAX_SHARED[target]
        if entry["autotuned"]:
            fits[entry["kernel"]] = fits.get(entry["kernel"], False) or fit
        elif not fit:
            problems.append(f"{where}\n  needs {entry['shared']} bytes of shared memory, "
                            f"at most {cc.MAX_SHARED[target]} on sm_{target}")
    problems += [f"{kernel} for sm_{target}: no compiled autotune config fits in shared memory"
                 for kernel, fit in fits.items() if not fit]
    if problems:
        pytest.fail(f"{case.name}: {len(problems)} failure(s)\n\n" + "\n\n".join(problems))


def _constexprs(compiled, case, kernel):
    entries = [e for e in compiled[case, cc.TARGETS[0]]["compiled"] if e["kernel"] == kernel and "constexprs" in e]
    assert entries, f"{case} compiled no {kernel}"
    return entries[0]["constexprs"]


def test_specializations_are_the_gpu_ones(compiled):
    """The recorded constexprs are what a launch on a GPU uses, not what the
    interpreter would (compat.upcast_for_dot, the absorbed kernel's tf32)."""
    assert _constexprs(compiled, "stats-bf16-d64", "_row_stats_kernel")["UPCAST"] == "False"
    decode = _constexprs(compiled, "decode-bf16-d128-r96x160-m2", "_stage1_kernel")
    assert (decode["QK_DT"], decode["UW_DT"]) == ("bf16", "bf16")
    assert (decode["ONE_CHUNK_K"], decode["ONE_CHUNK_V"], decode["ROPE"]) == ("False", "False", "False")
    mixed = _constexprs(compiled, "decode-fp16-wbf16-d64-rope-r4x8-block32", "_stage1_kernel")
    assert (mixed["QK_DT"], mixed["UW_DT"], mixed["ROPE"]) == ("fp16", "fp32", "True")
    assert _constexprs(compiled, "absorbed-bf16-d64-r256x200-m3", "_stage1_absorbed_kernel")["RANK_PREC"] == "tf32"
    assert _constexprs(compiled, "absorbed-fp32-d80-r32-block32", "_stage1_absorbed_kernel")["RANK_PREC"] == "ieee"


@pytest.mark.parametrize("target", cc.TARGETS, ids=lambda t: f"sm{t}")
@pytest.mark.parametrize("kernel", ["_stage1_kernel", "_stage1_absorbed_kernel"])
def test_every_autotune_config_is_compiled(kernel, target, compiled):
    from kernels_py.triton.lowrank_decode import _stage1_configs

    want = {(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in _stage1_configs()}
    got = {(int(e["constexprs"]["BLOCK_N"]), e["num_warps"], e["num_stages"])
           for case in cc.CASES for e in compiled[case.name, target]["compiled"]
           if e["kernel"] == kernel and e["autotuned"] and "constexprs" in e}
    assert got == want, f"autotune configs of {kernel} not compiled for sm_{target}: {sorted(want - got)}"


def _launched_kernels() -> set[str]:
    """The kernels of kernels_py/triton: @triton.jit functions named *_kernel
    (the others are device functions they call, compiled with them)."""
    found = set()
    for path in (ROOT / "kernels_py" / "triton").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                    ast.unparse(d) == "triton.jit" for d in node.decorator_list):
                found.add(node.name)
    return found


def test_every_kernel_has_a_case():
    kernels = _launched_kernels()
    assert kernels, "found no @triton.jit *_kernel functions under kernels_py/triton"
    missing = kernels - {k for case in cc.CASES for k in case.kernels}
    assert not missing, f"no compile case launches {sorted(missing)}: add one to kernels_py/tests/cuda_compile.py CASES"
