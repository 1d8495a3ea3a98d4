"""Kernel benchmarks, run by `workbench bench NAME`: timings only; correctness
lives in the tests. One file per benchmark in this package (a Benchmark
subclass, see base.py); the registry below finds them, so adding a benchmark
is one file. Go prints any of them from the columns they describe.
"""

import gc
import importlib
import json
import pkgutil
import re

import torch

from kernels_py import runtime
from kernels_py.benchmarks.base import OUTPUT_TOLERANCE, Benchmark
from kernels_py.params import BadKnobs
from kernels_py.tables import Column, table

SKIPPED = Column("skipped", "", "why the row has no timings (e.g. out of memory)")


def _discover() -> dict[str, type[Benchmark]]:
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name == "base" or info.name.startswith("_"):  # shared parts, not benchmarks
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        before = len(found)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, Benchmark) and value.__module__ == module.__name__ \
                    and "name" in vars(value):  # an intermediate base class has none
                if value.name in found:
                    raise ValueError(f"two benchmarks are named {value.name!r}")
                found[value.name] = value
        if len(found) == before:  # else `workbench bench` would silently not know the file
            raise ImportError(f"kernels_py/benchmarks/{info.name}.py defines no Benchmark subclass with a name of its "
                              f"own (name = \"...\", what `workbench bench NAME` runs); a module of shared parts "
                              f"is named _{info.name}.py")
    return found


BENCHMARKS: dict[str, type[Benchmark]] = _discover()


def run(name: str, params: dict | None = None) -> dict:
    """Run benchmark `name` with `params` (the knobs the user set; the rest
    take their defaults, or on the CPU interpreter the benchmark's smoke
    sizes). Returns the table: columns, rows, and notes for the user."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {sorted(BENCHMARKS)}")
    cls = BENCHMARKS[name]
    params = dict(params or {})
    notes = []
    shrunk = {}
    interpreter = runtime.interpreter_mode()
    if interpreter:
        shrunk = {k: v for group in cls.smoke if not set(group) & set(params) for k, v in group.items()}
        params.update(shrunk)
        sizes = f"tiny sizes for {', '.join(sorted(shrunk))} show the benchmark works; " if shrunk else ""
        notes.append(f"CPU interpreter: {sizes}its timings are the interpreter's, not kernel speed, and its speedups "
                     f"mean nothing (time it on a GPU)")
    try:
        bench = cls.from_dict(params)
    except (TypeError, ValueError) as err:
        raise BadKnobs(f"{err}{_shrunk_hint(cls, str(err), shrunk)}") from None
    device = runtime.device()
    rows = []
    cases = list(bench.cases())
    for i, case in enumerate(cases, 1):
        try:
            rows.append({**case, **bench.measure(case)})
        except torch.cuda.OutOfMemoryError as err:  # a size too large for this GPU: say so, keep the table
            rows.append({**case, "skipped": f"out of memory: {str(err).splitlines()[0]}"})
        finally:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        # Each row as it is measured: a long run shows where it is, and a killed one leaves its rows in the log.
        runtime.progress(f"bench {name}: row {i} of {len(cases)}: {json.dumps(rows[-1], default=str)}")
    notes += bench.run_notes()
    fallback = sorted({str(r["sdpa_backend"]) for r in rows if r.get("sdpa_backend") not in (None, "flash")})
    if fallback and not interpreter:
        notes.append(f"SDPA's FlashAttention backend does not take these inputs ({getattr(bench, 'dtype', '?')}): "
                     f"its rows' SDPA baseline ran on the backend PyTorch chose ({', '.join(fallback)}, column "
                     f"sdpa_backend), so their speedups vs SDPA are not against FlashAttention")
    tolerance = OUTPUT_TOLERANCE.get(getattr(bench, "dtype", None))
    for i, row in enumerate(rows, 1):
        err = row.get("output_err")
        if tolerance is not None and err is not None and not err <= tolerance:
            notes.append(f"row {i}: the kernel's output is {err:.3g} from its unfused baseline's (tolerance "
                         f"{tolerance:g} in {bench.dtype}): its times are of a wrong result (workbench selftest "
                         f"checks the kernels against their references)")
    filled = {key for r in rows for key in r}
    columns = cls.columns + tuple(c for c in cls.optional_columns if c.name in filled) + \
        ((SKIPPED,) if "skipped" in filled else ())
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"benchmark": name, "device": device.type, "gpu": gpu, "interpreter": interpreter,
            "params": {k: list(v) if isinstance(v, tuple) else v for k, v in bench.to_dict().items()},
            **table(columns, rows), "notes": notes}


def _shrunk_hint(cls: type[Benchmark], message: str, shrunk: dict) -> str:
    """What to add to a refusal that names a knob the CPU interpreter shrank:
    the user never set it, and with its default (what --help lists) their
    values may well hold."""
    named = [k for k in sorted(shrunk) if re.search(rf"\b{k}\b", message)]
    if not named:
        return ""
    defaults = {k: spec.json_default for k, spec in cls.param_specs().items()}
    said = "; ".join(f"{k}={_knob_text(shrunk[k])} is the CPU interpreter's tiny size, not the default "
                     f"{_knob_text(defaults[k])}" for k in named)
    # A smoke group shrinks only as a whole: setting one of its knobs leaves the others at their defaults.
    companions = sorted({k for group in cls.smoke if set(group) & set(named) for k in group} - set(named))
    also = (f", and {_flags(companions)}, which {'shrinks' if len(companions) == 1 else 'shrink'} only along with "
            f"{'it' if len(named) == 1 else 'them'}") if companions else ""
    return f" ({said}: set {_flags(named)} as well{also})"


def _flags(knobs: list[str]) -> str:
    return " and ".join(f"--{k.replace('_', '-')}" for k in knobs)


def _knob_text(value) -> str:
    return json.dumps(list(value) if isinstance(value, tuple) else value)


__all__ = ["BENCHMARKS", "Benchmark", "run"]
