"""What each registered op's Triton kernels compile to on a CUDA target,
without a GPU: one row per compiled (case, kernel, config) with registers per
thread, spills, shared memory and tensor-core instructions
(`workbench kernels report` prints it).

    python -m kernels_py.ops.report --target 90 [--case NAME ...]

prints the table as JSON (kernels_py.tables). Like kernels_py.ops.compile, it
must run without TRITON_INTERPRET.
"""

import argparse
import json
import sys

from kernels_py.params import closest
from kernels_py.tables import Column, table

COLUMNS = (
    Column("case", "", "compile case (kernels_py/ops/<op>/cases.py): the launcher call whose specialization is compiled"),
    Column("kernel", "", "the @triton.jit kernel"),
    Column("block_n", "", "the autotuned token tile of this config (empty: a plain launch)", "tile"),
    Column("num_warps", "", "warps per program", "warps"),
    Column("num_stages", "", "software pipelining stages", "stages"),
    Column("registers", "", "registers per thread (255 is the most a thread may have)", "regs"),
    Column("spill_stores", "", "bytes of registers spilled to local memory per thread (ptxas -v)", "spill"),
    Column("stack_bytes", "", "stack frame per thread: spills, or libdevice's sin/cos table", "stack", show=False),
    Column("shared", "bytes", "shared memory per program", "smem"),
    Column("sass_instructions", "", "SASS instructions in the binary (static code size; a loop counts once)", "sass"),
    Column("mma_sync", "", "mma.sync tensor-core instructions in the PTX", "mma"),
    Column("wgmma", "", "wgmma (sm_90 warpgroup) tensor-core instructions in the PTX", "wgmma"),
    Column("tensor_cores", "", "whether its dots lower to tensor-core instructions", "tc"),
    Column("error", "", "why it did not compile", show=False),
)


def report(target: int, names: list[str] | None = None) -> dict:
    """Compile the chosen cases (all when names is empty) for sm_<target>."""
    from kernels_py.ops import compile as cc

    rows = []
    for case in cc.cases():
        if names and case.name not in names:
            continue
        result = cc.compile_case(case, target)
        if result["error"]:
            rows.append({"case": case.name, "kernel": "", "error": result["error"].splitlines()[-1]})
        for e in result["compiled"]:
            config = e.get("config")
            rows.append({
                "case": case.name, "kernel": e["kernel"],
                "block_n": dict(config[0]).get("BLOCK_N") if config else None,
                "num_warps": e.get("num_warps"), "num_stages": e.get("num_stages"),
                "registers": e.get("registers"), "spill_stores": e.get("spill_stores"),
                "stack_bytes": e.get("stack_bytes"), "shared": e.get("shared"),
                "sass_instructions": e.get("sass_instructions"),
                "mma_sync": e.get("mma_sync"), "wgmma": e.get("wgmma"),
                "tensor_cores": (e.get("mma_sync") or 0) + (e.get("wgmma") or 0) > 0 if "mma_sync" in e else None,
                "error": (e.get("error") or "").splitlines()[-1] if e.get("error") else None,
            })
    from kernels_py.ops.gather_decode import model as gather_model
    from kernels_py.ops.lowrank_decode import model as lowrank_model
    from kernels_py.ops.quant_decode import model as quant_model

    return {"title": f"Triton kernels compiled for sm_{target} (no GPU needed)", "target": target,
            **table(COLUMNS, rows), "models": [lowrank_model.report(), quant_model.report(), gather_model.report()]}


def main(argv=None) -> int:
    from kernels_py.ops import compile as cc

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=int, choices=cc.TARGETS, default=90, help="compute capability (default 90)")
    parser.add_argument("--case", action="append", default=[], help="only this compile case (repeatable)")
    opts = parser.parse_args(argv)
    from kernels_py.runtime import interpreter_mode
    from triton import knobs

    if knobs.runtime.interpret or interpreter_mode():
        print("TRITON_INTERPRET is set: unset it to compile for a GPU target", file=sys.stderr)
        return 2
    known = [c.name for c in cc.cases()]
    for name in opts.case:
        if name not in known:
            print(f"--case: {name!r} is unknown{closest(name, known)} (known: {', '.join(known)})", file=sys.stderr)
            return 2
    json.dump(report(opts.target, opts.case), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
