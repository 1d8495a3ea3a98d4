"""Compile the Triton kernels of kernels_py.triton for CUDA targets, without a
GPU, with the exact specializations their launchers use.

Run as a script (test_cuda_compile.py does, once per target):

    python -m kernels_py.tests.cuda_compile --target 90 --out results.json [case ...]

It must run in a process where TRITON_INTERPRET is unset, for two reasons:
- `import triton` decorates triton.language's own jit helpers (tl.cdiv, the
  reductions' combine functions) as interpreter functions when it is set, and
  the code generator cannot compile kernels that call those.
- the launchers choose some constexprs by compat.interpreting() (bf16 tl.dot
  operands upcast to float32, the absorbed kernel's tf32 products, fixed tiles
  instead of autotuning). Without the interpreter they choose what a launch on
  a GPU chooses, which is what must compile.
So no kernel runs here, under the interpreter or otherwise: JITFunction.run and
Autotuner.run are replaced by recorders while each case calls its public
launcher on tiny CPU tensors, and each recorded launch is then specialized the
way JITFunction.run does it (its own binder: tensor dtypes, 16-byte alignment,
ints equal to 1 or divisible by 16), for a fixed GPUTarget instead of the
active driver's, and compiled by triton.compile. An autotuned launch is
compiled once per selected autotune config, with its num_warps/num_stages.
"""

import argparse
import contextlib
import json
import math
import sys
import time
import traceback
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction, create_function_from_signature

TARGETS = (80, 90)
# Shared memory one block may use (the opt-in maximum): a kernel needing more
# compiles but fails to load (OutOfResources). A100: 163 KiB, H100: 227 KiB.
MAX_SHARED = {80: 166912, 90: 232448}


@dataclass(frozen=True)
class Case:
    """One representative launcher call. `kernels`: the kernels it must launch
    (so a launcher that stops launching one cannot pass unnoticed). `tune`:
    which of an autotuned kernel's configs to compile."""

    name: str
    call: Callable[[], None]
    kernels: tuple[str, ...]
    tune: slice = slice(None)


@dataclass
class Launch:
    kernel: JITFunction
    args: tuple
    kwargs: dict
    configs: list | None  # the autotuner's configs; None for a plain launch


# ----------------------------------------------------------------------------
# Cases: tiny CPU inputs with the shapes, dtypes and options that decide the
# specialization (head_dim, GQA group, query tokens, ranks, RoPE).
# ----------------------------------------------------------------------------


def _randn(*shape, dtype):
    return torch.randn(*shape).to(dtype)


def _stats(dtype, heads, kv_heads, head_dim):
    from kernels_py.triton.attention_stats import attention_stats

    rows, keys = 20, 40
    q_pos = torch.arange(keys - rows, keys, dtype=torch.int64)
    attention_stats(_randn(heads, rows, head_dim, dtype=dtype), _randn(kv_heads, keys, head_dim, dtype=dtype), q_pos)


def _lowrank(*, dtype, head_dim, rank_k, rank_v, heads=4, kv_heads=2, queries=1, w_dtype=None,
             absorbed=False, rope_base=None, block_n=None):
    from kernels_py.triton import lowrank_decode as lr

    w_dtype = w_dtype or dtype
    batch, tokens, slots = 2, 40, 8
    width = kv_heads * head_dim

    def ranks(r):
        return torch.randint(1, r + 1, (batch, tokens), dtype=torch.int32)

    comp = lr.CompressedKV(
        _randn(batch, tokens, rank_k, dtype=dtype), _randn(batch, rank_k, width, dtype=w_dtype) / math.sqrt(rank_k),
        _randn(batch, tokens, rank_v, dtype=dtype), _randn(batch, rank_v, width, dtype=w_dtype) / math.sqrt(rank_v),
        ranks(rank_k), ranks(rank_v), torch.arange(tokens).repeat(batch, 1), torch.tensor([tokens, tokens - 7]))
    dense = lr.DenseKV(_randn(batch, kv_heads, slots, head_dim, dtype=dtype),
                       _randn(batch, kv_heads, slots, head_dim, dtype=dtype),
                       (tokens + torch.arange(slots)).repeat(batch, 1), torch.tensor([slots, 3]))
    q = _randn(batch, heads, queries, head_dim, dtype=dtype)
    q_pos = (tokens + slots - queries + torch.arange(queries)).repeat(batch, 1)
    if absorbed:
        lr.lowrank_decode_absorbed(q, q_pos, comp, dense, block_n=block_n)
    else:
        lr.lowrank_decode(q, q_pos, comp, dense, rope_base=rope_base, block_n=block_n)


STATS = ("_row_stats_kernel", "_column_stats_kernel", "_reduce_kernel")
DECODE = ("_stage1_kernel", "_merge_kernel", "_mass_kernel")
ABSORBED = ("_stage1_absorbed_kernel", "_merge_kernel", "_mass_kernel")
f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32

# The three autotuned cases of each stage-1 kernel take configs[k::3], k = 0,
# 1, 2: every config is compiled once per target, each case with a mix of
# tiles, warps and stages. float32 inputs take the pinned tile only: their
# large-tile configs take 10-35 s each to compile.
CASES = [
    Case("stats-fp16-d128-gqa2", partial(_stats, f16, 4, 2, 128), STATS),
    Case("stats-bf16-d64", partial(_stats, bf16, 2, 2, 64), STATS),
    Case("stats-fp32-d80-gqa2", partial(_stats, f32, 2, 1, 80), STATS),
    # Ranks within one 64-rank chunk (W loaded once per program) or above it
    # (chunked rebuild), for K and V separately.
    Case("decode-fp16-d128-rope-r32-gqa4",
         partial(_lowrank, dtype=f16, head_dim=128, rank_k=32, rank_v=32, heads=8, rope_base=10000.0),
         DECODE, slice(0, None, 3)),
    Case("decode-bf16-d128-r96x160-m2", partial(_lowrank, dtype=bf16, head_dim=128, rank_k=96, rank_v=160, queries=2),
         DECODE, slice(1, None, 3)),
    Case("decode-fp16-d64-rope-r64x96", partial(_lowrank, dtype=f16, head_dim=64, rank_k=64, rank_v=96, rope_base=1e6),
         DECODE, slice(2, None, 3)),
    # Pinned tiles (block_n given: the path the GPU tests take).
    Case("decode-fp32-d80-rope-r16x72-block32",
         partial(_lowrank, dtype=f32, head_dim=80, rank_k=16, rank_v=72, rope_base=10000.0, block_n=32), DECODE),
    # Mixed dtypes: fp16 attention, float32 rebuild (U fp16, W bf16); ranks
    # below tl.dot's minimum K of 16, padded by the launcher.
    Case("decode-fp16-wbf16-d64-rope-r4x8-block32",
         partial(_lowrank, dtype=f16, w_dtype=bf16, head_dim=64, rank_k=4, rank_v=8, rope_base=10000.0, block_n=32),
         DECODE),
    Case("absorbed-fp16-d128-r64x96", partial(_lowrank, dtype=f16, head_dim=128, rank_k=64, rank_v=96, absorbed=True),
         ABSORBED, slice(0, None, 3)),
    Case("absorbed-bf16-d64-r256x200-m3",
         partial(_lowrank, dtype=bf16, head_dim=64, rank_k=256, rank_v=200, queries=3, absorbed=True),
         ABSORBED, slice(1, None, 3)),
    Case("absorbed-fp16-d80-r4x40-gqa4",
         partial(_lowrank, dtype=f16, head_dim=80, rank_k=4, rank_v=40, heads=8, absorbed=True),
         ABSORBED, slice(2, None, 3)),
    Case("absorbed-fp32-d80-r32-block32",
         partial(_lowrank, dtype=f32, head_dim=80, rank_k=32, rank_v=32, absorbed=True, block_n=32), ABSORBED),
]


# ----------------------------------------------------------------------------
# Recording and compiling
# ----------------------------------------------------------------------------


@contextlib.contextmanager
def recording():
    """Replace kernel launches by recorders (there is no GPU to launch on)."""
    launches: list[Launch] = []

    def jit_run(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs, None))

    def tuned_run(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self.fn, args, kwargs, list(self.configs)))

    saved = JITFunction.run, Autotuner.run
    JITFunction.run, Autotuner.run = jit_run, tuned_run
    try:
        yield launches
    finally:
        JITFunction.run, Autotuner.run = saved


def specialize(kernel: JITFunction, args: tuple, kwargs: dict, target: GPUTarget):
    """The ASTSource and options JITFunction.run would compile for this call on
    `target` (the steps of JITFunction.run and create_binder, with the target
    given instead of read from the driver)."""
    backend = make_backend(target)
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return ASTSource(kernel, signature, constexprs, attrs), options


def describe(kernel: JITFunction, src: ASTSource, options) -> dict:
    """The specialization in readable parts: the kernel's constexpr parameters,
    the int arguments specialized as the constant 1, the other arguments' types."""
    names = kernel.arg_names
    declared = {p.name for p in kernel.params if p.is_constexpr}
    consts = {names[path[0]]: v for path, v in sorted(src.constants.items())}
    return {
        "kernel": kernel.fn.__name__,
        "constexprs": {k: str(v) for k, v in consts.items() if k in declared},
        "ones": [k for k in consts if k not in declared],
        "signature": {k: v for k, v in src.signature.items() if v != "constexpr"},
        "num_warps": options.num_warps,
        "num_stages": options.num_stages,
    }


def error_text(err: BaseException) -> str:
    """The error and its causes: an error inside a called jit function is
    raised as the caller's CompilationError, with the real one as its cause."""
    parts = []
    while err is not None and len(parts) < 10:
        parts.append(f"{type(err).__name__}: {err}")
        err = err.__cause__ or err.__context__
    return "\n--- caused by ---\n".join(parts)


def compile_case(case: Case, cc: int) -> dict:
    target = GPUTarget("cuda", cc, 32)
    result = {"case": case.name, "target": cc, "launched": [], "compiled": [], "error": None}
    try:
        with recording() as launches:
            case.call()
    except Exception:
        result["error"] = "launcher failed while recording:\n" + traceback.format_exc()
        return result
    result["launched"] = [launch.kernel.fn.__name__ for launch in launches]
    for launch in launches:
        configs = [None] if launch.configs is None else launch.configs[case.tune]
        for config in configs:
            kwargs = launch.kwargs if config is None else {**launch.kwargs, **config.all_kwargs()}
            entry = {"kernel": launch.kernel.fn.__name__, "autotuned": config is not None}
            try:
                src, options = specialize(launch.kernel, launch.args, kwargs, target)
                entry.update(describe(launch.kernel, src, options))
                start = time.perf_counter()
                compiled = triton.compile(src, target=target, options=options.__dict__)
                entry["seconds"] = round(time.perf_counter() - start, 2)
                entry["cubin_bytes"] = len(compiled.asm.get("cubin", b""))
                entry["shared"] = compiled.metadata.shared
            except Exception as err:
                entry["error"] = error_text(err)
            result["compiled"].append(entry)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=int, choices=TARGETS, required=True, help="compute capability, e.g. 90")
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    opts = parser.parse_args(argv)

    from kernels_py.triton import compat

    if knobs.runtime.interpret or compat.interpreting():
        print("TRITON_INTERPRET is set: launchers would choose the interpreter's constexprs", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    chosen = [c for c in CASES if not opts.cases or c.name in opts.cases]
    results = [compile_case(case, opts.target) for case in chosen]
    with open(opts.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
