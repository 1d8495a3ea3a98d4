"""Ops: one operation per folder, its contract, Triton kernels and PyTorch
reference side by side (see any op's __init__.py), and this registry.

The compile test, `workbench selftest` and `workbench bench` find ops here:
each entry names its folder (kernels_py/ops/<name>/: contract.py, kernel.py,
reference.py, cases.py) and the benchmark that measures it. Adding a kernel is
one folder and one line in OPS.

cases.py of an op holds COMPILE_CASES (representative launcher calls the
compile test specializes for sm_80 and sm_90, tiny CPU inputs) and
selftest(seed, dtype) (the kernel against its reference on a small
VLM-shaped input, as a table).
"""

import ast
import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

from kernels_py.params import first_paragraph

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class CompileCase:
    """One representative launcher call. `kernels`: the kernels it must launch
    (so a launcher that stops launching one cannot pass unnoticed). `tune`:
    which of an autotuned kernel's configs to compile."""

    name: str
    call: Callable[[], None]
    kernels: tuple[str, ...]
    tune: slice = slice(None)


@dataclass(frozen=True)
class Op:
    name: str
    benchmark: str | None  # kernels_py.benchmarks name

    @property
    def module(self) -> ModuleType:
        return importlib.import_module(f"{__name__}.{self.name}")

    @property
    def reference(self) -> ModuleType:
        return importlib.import_module(f"{__name__}.{self.name}.reference")

    @property
    def cases(self) -> ModuleType:
        return importlib.import_module(f"{__name__}.{self.name}.cases")

    @property
    def model(self) -> ModuleType | None:
        """model.py of the op (what a step moves, and what its launches do
        for the estimate), if it has one."""
        if not (HERE / self.name / "model.py").exists():
            return None
        return importlib.import_module(f"{__name__}.{self.name}.model")

    @property
    def summary(self) -> str:
        """First paragraph of the op's docstring, on one line."""
        return first_paragraph(self.module.__doc__)

    def kernels(self) -> set[str]:
        """The op's @triton.jit functions named *_kernel (the others are device
        functions they call, compiled with them), found in its source."""
        found = set()
        for path in (HERE / self.name).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                        ast.unparse(d) == "triton.jit" for d in node.decorator_list):
                    found.add(node.name)
        return found


OPS: dict[str, Op] = {op.name: op for op in (
    Op("attention_stats", benchmark="stats"),
    Op("lowrank_decode", benchmark="lowrank"),
    Op("kv_quant", benchmark="quant"),
    Op("quant_decode", benchmark="quant"),
    Op("gather_decode", benchmark="gather"),
    Op("fp8_decode", benchmark="fp8"),
)}


def folders() -> set[str]:
    """Every op folder on disk, registered or not (the tests check they agree)."""
    return {p.parent.name for p in HERE.glob("*/__init__.py")}


__all__ = ["OPS", "CompileCase", "Op", "folders"]
