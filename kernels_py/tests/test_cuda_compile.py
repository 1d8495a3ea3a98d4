"""Every Triton kernel of every registered op (kernels_py.ops) compiles for
sm_80 and sm_90, with the specializations its launcher uses, on a machine
without a GPU.

The other kernel tests run under TRITON_INTERPRET=1, which never compiles:
tl.dot shape and dtype rules, codegen type errors, constexpr mistakes and
resource limits only show on the compiled path. The compiling is done by
kernels_py.ops.compile in one child process per target (run in
parallel), without TRITON_INTERPRET: see its docstring for why it cannot run
in this process and how launches are recorded and specialized. Each child
gets an empty Triton cache, so every run really compiles.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels_py.ops import compile as cc

CASES = cc.cases()

ROOT = Path(__file__).resolve().parents[2]
# About six minutes on 2 cores beside the Go tests; more on a busier
# machine. The limit is there to catch a hang, not to time the compile.
CHILD_TIMEOUT_S = 1500


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


def selected_cases(items) -> list[str]:
    """The compile cases this file's selected tests of compiled results ask
    for by their `case` parameter, so `-k NAME` compiles those alone; []
    (every case) when a selected one reads them all."""
    names = set()
    for item in items:
        if Path(item.path).resolve() != Path(__file__).resolve() or "compiled" not in item.fixturenames:
            continue
        case = getattr(item, "callspec", None) and item.callspec.params.get("case")
        if case is None:
            return []
        names.add(case if isinstance(case, str) else case.name)
    return sorted(names)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, request):
    """{(case name, target): that case's result} from one child per target."""
    tmp = tmp_path_factory.mktemp("cuda_compile")
    chosen = selected_cases(request.session.items)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    children = {}
    try:
        for target in cc.TARGETS:
            out = tmp / f"sm{target}.json"
            child_env = dict(env, TRITON_CACHE_DIR=str(tmp / f"cache{target}"))
            cmd = [sys.executable, "-m", "kernels_py.ops.compile", "--target", str(target), "--out", str(out),
                   *chosen]
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
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
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


@pytest.mark.parametrize("target", cc.TARGETS, ids=lambda t: f"sm{t}")
@pytest.mark.parametrize("case,kernel", [("decode-fp16-d128-rope-r32-gqa4", "_stage1_kernel"),
                                         ("decode-fp16-d128-rope-r64-h32kv8", "_stage1_kernel"),
                                         ("absorbed-fp16-d128-r64x96", "_stage1_absorbed_kernel")])
def test_decode_kernels_use_tensor_cores_without_spills(case, kernel, target, compiled):
    """Both low-rank decode kernels, 16-bit inputs, at the default config
    (the autotuner's first, DEFAULT_BLOCK_N, or a launch pinned to it), the fused
    one also at the benchmark's 32 query / 8 kv heads: their dots
    lower to tensor-core MMAs (mma.sync, and wgmma on sm_90 where Triton
    chooses it) and ptxas spills no register; with RoPE, sines and cosines
    are the GPU's approximate ones (the interpreter's polynomials are
    checked against float64 in test_lowrank_decode)."""
    from kernels_py.ops.lowrank_decode import kernel as lowrank

    warps = lowrank.DEFAULT_WARPS[kernel]
    tile = lowrank.DEFAULT_BLOCK_N[kernel]
    default = [[["BLOCK_N", tile]], warps, lowrank.DEFAULT_STAGES]

    def at_default(e):  # an autotuned case's default config, or a pinned launch at the default tile
        if e.get("config") is not None:
            return e["config"] == default
        return (e.get("constexprs", {}).get("BLOCK_N") == str(tile)
                and e.get("num_warps") == warps)

    entries = [e for e in compiled[case, target]["compiled"] if e["kernel"] == kernel and at_default(e)]
    assert entries, f"{case} did not compile {kernel} at its default config {default}"
    for e in entries:
        assert e["mma_sync"] + e["wgmma"] > 0, f"{kernel} ({case}, sm_{target}) has no tensor-core instruction"
        assert e["spill_stores"] == 0 and e["spill_loads"] == 0, \
            f"{kernel} ({case}, sm_{target}) spills: {e['spill_stores']} B stored, {e['spill_loads']} B loaded"
        if "rope" in case:  # RoPE's sines and cosines on the special-function unit, no libdevice table
            assert e["sincos_approx"] > 0 and not e.get("stack_bytes"), \
                f"{kernel} ({case}, sm_{target}): {e['sincos_approx']} sin/cos.approx, {e.get('stack_bytes')} B stack"
        # On fp16 factors the fused kernel rebuilds its keys in fp16 accumulators (no conversion after);
        # the absorbed kernel's sums stay float32.
        fp16_rebuild = kernel == "_stage1_kernel" and "fp16" in case
        assert (e["mma_f16_accumulate"] > 0) == fp16_rebuild, \
            f"{kernel} ({case}, sm_{target}): {e['mma_f16_accumulate']} fp16-accumulating MMAs"


@pytest.mark.parametrize("target", cc.TARGETS, ids=lambda t: f"sm{t}")
@pytest.mark.parametrize("case", ["quantdecode-fp16-d128-4+2bit-gqa4", "quantdecode-bf16-d128-2bit-g128",
                                  "gather-fp16-d128-gqa4", "fp8-e4m3-tensor-fp16-d128-gqa4",
                                  "fp8-e4m3-token-fp16-d128-gqa4"])
def test_quant_and_gather_decode_use_tensor_cores_without_spills(case, target, compiled):
    """The quantized decode kernel dequantizes in registers and still feeds
    tensor cores, at ZipVL's and KIVI's shapes, and the selected-row kernel
    does so on rows loaded by index, in every config; neither spills in the
    configs the autotuner keeps (the register-capped quant config spills on
    sm_80 and is pruned there, so another must not)."""
    entries = [e for e in compiled[case, target]["compiled"] if e["kernel"] == "_stage1_kernel"]
    assert entries, f"{case} did not compile its decode kernel"
    for e in entries:
        assert e["mma_sync"] + e["wgmma"] > 0, f"{case} (sm_{target}) has no tensor-core instruction"
    clean = [e for e in entries if e["spill_stores"] == 0 and e["spill_loads"] == 0]
    assert clean, f"{case} (sm_{target}) spills in every config"
    if not any(e.get("autotuned") for e in entries):
        assert clean == entries, f"{case} (sm_{target}) spills"


@pytest.mark.parametrize("target", cc.TARGETS, ids=lambda t: f"sm{t}")
def test_no_plain_launch_spills(target, compiled):
    """A launch with a fixed config spills no register in any case; an
    autotuned config may, and the autotuner prunes it at the shape it tunes
    (common.prune_spilling)."""
    problems = [f"{case.name}: {e['kernel']} spills {e['spill_stores']} B stored, {e['spill_loads']} B loaded"
                for case in CASES for e in compiled[case.name, target]["compiled"]
                if not e.get("autotuned") and (e.get("spill_stores") or e.get("spill_loads"))]
    assert not problems, "\n".join(problems)


def _constexprs(compiled, case, kernel):
    entries = [e for e in compiled[case, cc.TARGETS[0]]["compiled"] if e["kernel"] == kernel and "constexprs" in e]
    assert entries, f"{case} compiled no {kernel}"
    return entries[0]["constexprs"]


@pytest.mark.parametrize("target,native", [(80, "False"), (90, "True")])
def test_fp8_conversion_follows_the_target(target, native, compiled):
    """e4m3 codes are converted by Triton's fp8 cast on sm_90 and by moving
    their bits into an fp16 on sm_80, which has no e4m3 conversion: the
    launcher asks which target it compiles for (common.capability)."""
    entries = [e for e in compiled["fp8-e4m3-tensor-fp16-d128-gqa4", target]["compiled"]
               if e["kernel"] == "_stage1_kernel"]
    assert entries and all(e["constexprs"]["NATIVE"] == native and e["constexprs"]["EVEN_N"] == "True"
                           for e in entries), [e.get("constexprs") for e in entries]


def test_specializations_are_the_gpu_ones(compiled):
    """The recorded constexprs are what a launch on a GPU uses, not what the
    interpreter would (ops.common.upcast_for_dot, the absorbed kernel's tf32)."""
    assert _constexprs(compiled, "stats-bf16-d64", "_row_stats_kernel")["UPCAST"] == "False"
    decode = _constexprs(compiled, "decode-bf16-d128-r96x160-m2", "_stage1_kernel")
    assert (decode["QK_DT"], decode["UW_DT"]) == ("bf16", "bf16")
    assert (decode["BLOCK_R"], decode["BLOCK_RV"], decode["ROPE"]) == ("64", "256", "False")
    assert decode["ONE_CHUNK"] == "False"  # rank 96 takes two chunks of 64
    mixed = _constexprs(compiled, "decode-fp16-wbf16-d64-rope-r4x8-block32", "_stage1_kernel")
    assert (mixed["QK_DT"], mixed["UW_DT"], mixed["ROPE"]) == ("fp16", "fp32", "True")
    assert _constexprs(compiled, "absorbed-bf16-d64-r256x200-m3", "_query_dense_kernel")["RANK_PREC"] == "tf32"
    assert _constexprs(compiled, "absorbed-fp32-d80-r32-block32", "_query_dense_kernel")["RANK_PREC"] == "ieee"
    # Both calls' dense segments take a 16-bit cache 64 tokens a tile (the benchmark's window in one wait).
    # The fused call's merge attends it (DENSE); the absorbed call's merge reads its partial.
    fused_merge = _constexprs(compiled, "decode-fp16-d128-rope-r64-h32kv8", "_merge_rank_kernel")
    assert (fused_merge["BLOCK_N"], fused_merge["DENSE"]) == ("64", "True")
    fp32_merge = _constexprs(compiled, "decode-fp32-d80-rope-r16x72-block32", "_merge_rank_kernel")
    assert (fp32_merge["BLOCK_N"], fp32_merge["BLOCK_RV"]) == ("32", "32")  # float32 factors: 32 rank columns a dot
    assert fused_merge["BLOCK_RV"] == "64"
    assert _constexprs(compiled, "absorbed-bf16-d64-r256x200-m3", "_merge_rank_kernel")["DENSE"] == "False"


@pytest.mark.parametrize("target", cc.TARGETS, ids=lambda t: f"sm{t}")
def test_every_autotune_config_is_compiled(target, compiled):
    """Each autotuned kernel has every config its autotuner may pick compiled
    by some case (the cases split the configs between them)."""
    want, got = {}, {}
    for case in CASES:
        result = compiled[case.name, target]
        for kernel, configs in result["configs"].items():
            want.setdefault(kernel, set()).update(json.dumps(c) for c in configs)
        for e in result["compiled"]:
            if e["autotuned"] and "constexprs" in e:
                got.setdefault(e["kernel"], set()).add(json.dumps(e["config"]))
    assert want, "no case launches an autotuned kernel"
    for kernel, configs in want.items():
        missing = configs - got.get(kernel, set())
        assert not missing, f"autotune configs of {kernel} not compiled for sm_{target}: {sorted(missing)}"
