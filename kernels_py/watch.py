"""One iteration of `workbench watch OP`: the op's selftest (its kernels
against the PyTorch reference on the op's test shapes), a real compile of
its first compile case when there is no GPU to compile on (the interpreter
compiles nothing), and on a GPU its benchmark. An error anywhere comes back
as the kernels_py source line it comes from (runtime.errors.locate), not a
traceback, so the watch can show it and go on.

This module imports no op at load time: after an edit that breaks an
import, the worker can still load it and report where.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from kernels_py.runtime.errors import compile_failure, locate


def check(op: str, dtype: str = "float32", seed: int = 0, compile_target: int | None = None,
          bench: dict | None = None) -> dict:
    """{"op", "ok", "device", "interpreter", "selftest", "compile", "bench",
    "error"}: selftest is the op's table (or None when it raised), compile
    the compiled kernels of the op's first compile case for sm_<target>
    (None unless asked), bench the benchmark's table (None unless asked);
    error the first error's location and message; and "worker_lost", why,
    where the GPU is unusable after the error (the worker then exits once it
    has replied, and the next check starts a fresh one)."""
    from kernels_py import runtime

    out = {"op": op, "ok": False, "device": runtime.device().type, "interpreter": runtime.interpreter_mode(),
           "selftest": None, "compile": None, "bench": None, "error": None}
    try:
        from kernels_py import selftest

        start = time.perf_counter()
        result = selftest.run(seed=seed, dtype=dtype, ops=[op])["ops"][0]
        result["wall_seconds"] = time.perf_counter() - start
        out["selftest"] = result
        out["ok"] = bool(result["ok"])
    except Exception as err:  # a kernel that does not import, interpret or compile: say where, go on
        out["error"] = _error(err)
    if compile_target:
        try:
            out["compile"] = compile_op(op, compile_target)
        except Exception as err:  # the op does not even import
            out["compile"] = {"case": None, "seconds": 0.0, "kernels": [], "error": _error(err)}
        if out["compile"].get("error"):  # the compiler's own message, where the interpreter's may differ
            out["error"] = out["compile"]["error"]
        out["ok"] = out["ok"] and not out["compile"].get("error")
    if bench is not None and out["ok"]:
        try:
            from kernels_py.benchmarks import run

            name = bench.get("name") or benchmark_of(op)
            if name is None:
                raise ValueError(f"no registered benchmark times {op} (kernels_py/benchmarks/)")
            out["bench"] = run(name, bench.get("params") or {})
        except Exception as err:
            out["error"] = _error(err)
            out["ok"] = False
    if out["error"] is not None:
        from kernels_py.runtime.worker import device_lost

        if lost := device_lost():  # the worker replies, exits, and the next check starts a fresh one
            out["worker_lost"] = lost
    return out


def import_sources() -> dict | None:
    """The first error of the sources a job runs on, as check's "error", or
    None: every kernels_py file compiles (its tests aside) and the job's
    entry point imports (which imports every method and workload). Called in
    a fresh worker before `workbench watch --experiment` reruns jobs, so a
    save that breaks an import is shown once, at its line, instead of
    failing every job and replacing its good row."""
    from pathlib import Path

    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        if "tests" in path.relative_to(root).parts:
            continue
        try:
            compile(path.read_bytes(), str(path), "exec")
        except SyntaxError as err:
            return _error(err)
    try:
        import kernels_py.ablation  # noqa: F401
    except Exception as err:
        return _error(err)
    return None


def _error(err: BaseException) -> dict:
    where = locate(err) or {}
    return {"message": where.get("message") or f"{type(err).__name__}: {err}", "file": where.get("file"),
            "line": where.get("line"), "source": where.get("source"), "kind": where.get("kind", type(err).__name__)}


def compile_op(op: str, target: int) -> dict:
    """Compile the op's first compile case for sm_<target> with Triton's own
    compiler (no GPU needed), in a process of its own without the
    interpreter (kernels_py.ops.compile says why). {"case", "seconds",
    "kernels": [{"kernel", "seconds", "config", "registers", "spill_bytes",
    "pruned"}], "error"}: spill_bytes are ptxas's spill stores, as kernels
    report's spill column; config is an autotuned kernel's (None for a plain
    launch), pruned where the autotuner would prune it for its spills."""
    from kernels_py.ops import OPS

    cases = OPS[op].cases.COMPILE_CASES
    if not cases:
        return {"case": None, "seconds": 0.0, "kernels": [], "error": None}
    case = cases[0].name
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "compile.json")
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "kernels_py.ops.compile", "--target", str(target), "--out", path,
                               case], env=env, capture_output=True, text=True, timeout=600,
                              preexec_fn=_die_with_parent)
        seconds = time.perf_counter() - start
        if proc.returncode != 0 or not os.path.exists(path):
            return {"case": case, "seconds": seconds, "kernels": [],
                    "error": {"message": (proc.stderr.strip().splitlines() or ["the compile process failed"])[-1]}}
        with open(path) as f:
            result = json.load(f)[0]
    error = compile_failure(result) if result.get("error") else None
    for entry in result["compiled"]:
        if entry.get("error") and error is None:
            error = compile_failure(entry)
    kernels = compiled_kernels(result["compiled"])
    return {"case": case, "target": target, "seconds": seconds, "kernels": kernels, "error": error}


def compiled_kernels(entries: list[dict]) -> list[dict]:
    """compile_op's "kernels" from kernels_py.ops.compile's entries of a case.
    The autotuner prunes a config that spills where another config of its
    kernel does not (common.prune_spilling), so such a config is marked
    pruned."""
    from kernels_py.ops.report import config_label, spills

    unspilled = {e["kernel"] for e in entries if e.get("autotuned") and not e.get("error") and not spills(e)}
    return [{"kernel": e["kernel"], "seconds": e.get("seconds"),
             "config": config_label(e) if e.get("autotuned") else None,
             "registers": e.get("registers"), "spill_bytes": e.get("spill_stores") or 0,
             "pruned": bool(e.get("autotuned") and spills(e) and e["kernel"] in unspilled)} for e in entries]


def _die_with_parent():
    """The compile process ends with the worker (Linux): a stopped watch leaves nothing running."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def benchmark_of(op: str) -> str | None:
    """The registered benchmark that times this op (its module imports the op)."""
    import inspect

    from kernels_py.benchmarks import BENCHMARKS

    for name, cls in sorted(BENCHMARKS.items()):
        module = inspect.getmodule(cls)
        if any(getattr(v, "__name__", None) == f"kernels_py.ops.{op}" for v in vars(module).values()):
            return name
    return None
