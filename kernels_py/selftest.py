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
    results = [{"op": name, **OPS[name].cases.selftest(seed=seed, dtype=dtype)} for name in chosen]
    return {"device": runtime.device().type, "interpreter": runtime.interpreter_mode(),
            "ok": all(r["ok"] for r in results), "ops": results}
