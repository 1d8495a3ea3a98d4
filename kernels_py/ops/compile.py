"""Compile the Triton kernels of every registered op (kernels_py.ops) for CUDA
targets, without a GPU, with the exact specializations their launchers use,
and read what each compiled to: registers per thread, stack and local bytes
(spills), shared memory, and its tensor-core instructions.

Run as a script (test_cuda_compile.py does, once per target; `workbench
kernels report` prints the same as a table):

    python -m kernels_py.ops.compile --target 90 --out results.json [case ...]

It must run in a process where TRITON_INTERPRET is unset, for two reasons:
- `import triton` decorates triton.language's own jit helpers (tl.cdiv, the
  reductions' combine functions) as interpreter functions when it is set, and
  the code generator cannot compile kernels that call those.
- the launchers choose some constexprs by runtime.interpreter_mode() (bf16 tl.dot
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
import io
import json
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction, create_function_from_signature

from kernels_py.ops import common
from kernels_py.runtime.errors import locate

TARGETS = (80, 90)
# Shared memory one block may use (the opt-in maximum): a kernel needing more
# compiles but fails to load (OutOfResources). A100: 163 KiB, H100: 227 KiB.
MAX_SHARED = {80: 166912, 90: 232448}


@dataclass
class Launch:
    kernel: JITFunction
    args: tuple
    kwargs: dict
    configs: list | None  # the autotuner's configs; None for a plain launch


def cases():
    """Every registered op's compile cases (kernels_py.ops: cases.COMPILE_CASES)."""
    from kernels_py.ops import OPS

    return [case for op in OPS.values() for case in op.cases.COMPILE_CASES]


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


def config_key(config) -> list:
    """An autotune config as [its kwargs in order, num_warps, num_stages],
    then its register cap (maxnreg) where it has one."""
    key = [sorted(config.kwargs.items()), config.num_warps, config.num_stages]
    return key + [config.maxnreg] if config.maxnreg else key


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
        "maxnreg": options.maxnreg,
    }


def error_text(err: BaseException) -> str:
    """The error and its causes: an error inside a called jit function is
    raised as the caller's CompilationError, with the real one as its cause."""
    parts = []
    while err is not None and len(parts) < 10:
        parts.append(f"{type(err).__name__}: {err}")
        err = err.__cause__ or err.__context__
    return "\n--- caused by ---\n".join(parts)


def record_launches(call, cc: int) -> list[Launch]:
    """The launches call() (a launcher on tiny CPU tensors) makes, recorded
    and not compiled: which kernels it runs, and which are autotuned."""
    with recording() as launches:
        common._compile_target = cc  # launchers that choose code by architecture (common.capability)
        try:
            call()
        finally:
            common._compile_target = None
    return launches


def compile_launches(call, cc: int, tune: slice = slice(None), select=None):
    """Record the launches of call() (a launcher on tiny CPU tensors) and
    compile each for sm_<cc>, once per selected autotune config (`tune`, and
    select(kernel name, config key) if given). Returns
    (the recorded launches' kernel names, {kernel: every config key of an
    autotuned one}, [(entry, compiled or None), ...]): an entry as
    compile_case reports it; compiled, Triton's CompiledKernel (its cubin,
    metadata and source for kernels_py.ops.estimate)."""
    # Compile for real (not from Triton's cache) and keep ptxas's report, which resources() reads; the
    # process's own compiles after this one (a benchmark's next rows) go back to Triton's defaults.
    saved = knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log
    knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = True, True
    try:
        return _compile_launches(call, cc, tune, select)
    finally:
        knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = saved


def _compile_launches(call, cc: int, tune: slice, select):
    target = GPUTarget("cuda", cc, 32)
    launches = record_launches(call, cc)
    configs_of, out = {}, []
    for launch in launches:
        if launch.configs is not None:  # every config the autotuner could pick, whichever is compiled here
            configs_of[launch.kernel.fn.__name__] = [config_key(c) for c in launch.configs]
        configs = [None] if launch.configs is None else launch.configs[tune]
        if select is not None and launch.configs is not None:
            configs = [c for c in configs if select(launch.kernel.fn.__name__, config_key(c))]
        for config in configs:
            kwargs = launch.kwargs if config is None else {**launch.kwargs, **config.all_kwargs()}
            entry = {"kernel": launch.kernel.fn.__name__, "autotuned": config is not None,
                     "config": None if config is None else config_key(config)}
            compiled = None
            try:
                src, options = specialize(launch.kernel, launch.args, kwargs, target)
                entry.update(describe(launch.kernel, src, options))
                start = time.perf_counter()
                ptxas_log = io.StringIO()  # ptxas -v, printed by Triton with knobs.nvidia.dump_ptxas_log
                with contextlib.redirect_stdout(ptxas_log):
                    compiled = triton.compile(src, target=target, options=options.__dict__)
                entry["seconds"] = round(time.perf_counter() - start, 2)
                entry["cubin_bytes"] = len(compiled.asm.get("cubin", b""))
                entry["shared"] = compiled.metadata.shared
                entry.update(resources(compiled, ptxas_log.getvalue()))
            except Exception as err:
                entry["error"] = error_text(err)
                entry["error_at"] = locate(err)
            out.append((entry, compiled))
    return [launch.kernel.fn.__name__ for launch in launches], configs_of, out


def compile_case(case, cc: int) -> dict:
    result = {"case": case.name, "target": cc, "launched": [], "compiled": [], "error": None, "configs": {}}
    try:
        launched, configs_of, compiled = compile_launches(case.call, cc, case.tune)
    except Exception as err:
        result["error"] = "launcher failed while recording:\n" + traceback.format_exc()
        result["error_at"] = locate(err)
        return result
    result["launched"], result["configs"] = launched, configs_of
    result["compiled"] = [entry for entry, _ in compiled]
    return result


# Tensor-core instructions in PTX: mma.sync (sm_80 and later) and the
# asynchronous warpgroup MMA of sm_90.
MMA_OPCODES = {"mma_sync": "mma.sync.aligned", "wgmma": "wgmma.mma_async"}
# Those of them that accumulate in fp16: the result type, first of the
# types (wgmma's .dtype.atype.btype, mma.sync's .dtype.atype.btype.ctype
# after its layouts).
F16_ACCUMULATING_MMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.f16\."
                                  r"|mma\.sync\.aligned\.m\d+n\d+k\d+\.row\.col\.f16\.")


def resources(compiled, ptxas_log: str = "") -> dict:
    """Registers per thread and stack bytes per thread, from the cubin's
    resource usage (cuobjdump), and its SASS instruction count (static, the
    code size: loops count once); bytes of register spill stores and loads, from
    ptxas -v (a stack frame alone is not a spill: libdevice's sin/cos keep a
    table there); counts of tensor-core instructions and of approximate
    sines and cosines, from the PTX."""
    ptx = compiled.asm.get("ptx", "")
    out = {name: ptx.count(opcode) for name, opcode in MMA_OPCODES.items()}
    out["mma_f16_accumulate"] = len(F16_ACCUMULATING_MMA.findall(ptx))
    out["sincos_approx"] = ptx.count("sin.approx") + ptx.count("cos.approx")  # the special-function unit's
    for kind in ("stores", "loads"):
        found = re.findall(rf"(\d+) bytes spill {kind}", ptxas_log)
        out[f"spill_{kind}"] = sum(int(n) for n in found) if found else None
    cubin = compiled.asm.get("cubin")
    if not cubin:
        return out
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    out["sass_instructions"] = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, flags=re.MULTILINE))
    for key, name in (("REG", "registers"), ("STACK", "stack_bytes"), ("LOCAL", "local_bytes")):
        match = re.search(rf"\b{key}:(\d+)", usage)
        if match:
            out[name] = int(match.group(1))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=int, choices=TARGETS, required=True, help="compute capability, e.g. 90")
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    opts = parser.parse_args(argv)

    from kernels_py.runtime import interpreter_mode

    if knobs.runtime.interpret or interpreter_mode():
        print("TRITON_INTERPRET is set: launchers would choose the interpreter's constexprs", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    chosen = [c for c in cases() if not opts.cases or c.name in opts.cases]
    results = [compile_case(case, opts.target) for case in chosen]
    with open(opts.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
