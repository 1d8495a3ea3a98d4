"""The schema the Go host reads: every method's, workload's and benchmark's
knobs with type, default, bounds, doc and paper reference, so that
`workbench plan` checks scripts and `workbench bench` builds its flags without
starting Python. kernels_py/schema.json holds it; a test checks it is in step
with the code. After adding or changing a knob, regenerate it:

    workbench schema            (or: python -m kernels_py.schema)
"""

import json
import sys
from pathlib import Path

PATH = Path(__file__).with_name("schema.json")


def document() -> dict:
    from kernels_py.benchmarks import BENCHMARKS
    from kernels_py.methods import METHODS
    from kernels_py.ops import OPS
    from kernels_py.workloads import DEFAULT_WORKLOAD, WORKLOADS

    measured = {op.benchmark: op.name for op in OPS.values() if op.benchmark}

    return {
        "methods": {name: {"doc": cls.summary(), "paper": cls.paper, "params": cls.schema()}
                    for name, cls in METHODS.items()},
        "workloads": {name: {"doc": cls.summary(), "params": cls.schema()} for name, cls in WORKLOADS.items()},
        "default_workload": DEFAULT_WORKLOAD,
        "benchmarks": {name: {**bench.describe(), "op": measured.get(name)} for name, bench in BENCHMARKS.items()},
    }


def text() -> str:
    return json.dumps(document(), indent=2) + "\n"


def write(path: Path = PATH) -> bool:
    """Write the schema; returns whether the file changed."""
    new = text()
    if path.exists() and path.read_text() == new:
        return False
    path.write_text(new)
    return True


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--check"]:
        if PATH.read_text() != text():
            print(f"{PATH} is out of date: run `workbench schema`", file=sys.stderr)
            return 1
        return 0
    if args:
        print("usage: python -m kernels_py.schema [--check]", file=sys.stderr)
        return 2
    print(f"{PATH}: {'written' if write() else 'already up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
