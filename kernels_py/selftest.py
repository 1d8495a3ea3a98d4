"""`workbench selftest`: every registered op's kernels against their PyTorch
reference on a small VLM-shaped input (kernels_py.ops: each op's
cases.selftest), so a kernel edit that breaks correctness shows at once."""

from kernels_py import runtime
from kernels_py.ops import OPS
from kernels_py.params import BadKnobs, closest


def run(seed: int = 0, dtype: str = "float32", ops: list[str] | None = None) -> dict:
    """{"device", "interpreter", "ok", "ops": [one selftest per op]}; `ops`
    picks some of the registered ops (default all)."""
    chosen = list(OPS) if not ops else ops
    unknown = sorted(set(chosen) - set(OPS))
    if unknown:
        raise BadKnobs(f"unknown op(s) {unknown}{closest(unknown[0], OPS)}; known: {sorted(OPS)}")
    results = [{"op": name, **_checked(name, OPS[name].cases.selftest(seed=seed, dtype=dtype))} for name in chosen]
    return {"device": runtime.device().type, "interpreter": runtime.interpreter_mode(),
            "ok": all(r["ok"] for r in results), "ops": results}


# What each op's cases.selftest returns: a table (kernels_py.tables.table: columns and rows, one of them "ok")
# with a title, whether every row is within tolerance, the tolerance in words and the kernels' time.
RESULT_KEYS = ("title", "columns", "rows", "ok", "verdict", "kernel_seconds")


def _checked(op: str, result) -> dict:
    """An op's selftest result, or a TypeError saying what it lacks."""
    missing = [k for k in RESULT_KEYS if not isinstance(result, dict) or k not in result]
    if missing:
        raise TypeError(f"kernels_py/ops/{op}/cases.py: selftest() returned a result without {missing}: it returns "
                        f"{{'title': str, **tables.table(COLUMNS, rows), 'ok': bool, 'verdict': str, "
                        f"'kernel_seconds': float}} (see kernels_py/ops/gather_decode/cases.py)")
    return result
