"""The schema the Go host reads: every method's, workload's and benchmark's
knobs with type, default, bounds, doc and paper reference, the comparison
protocols and the knobs each sets on each method, and the registered ops,
so that `workbench plan` checks scripts (knob rules and kvpress's press
names and constructor parameters included) and applies protocols,
`workbench bench` builds its flags and `workbench selftest` checks its --op
without starting Python.
kernels_py/schema.json holds it (`workbench schema` writes it); a test checks
it is in step with the code.
"""

import json
from pathlib import Path

PATH = Path(__file__).with_name("schema.json")


def document() -> dict:
    from kernels_py.benchmarks import BENCHMARKS
    from kernels_py.methods import METHODS, RENAMED
    from kernels_py.methods.base import PROTOCOLS
    from kernels_py.ops import OPS
    from kernels_py.workloads import DEFAULT_WORKLOAD, WORKLOADS

    return {
        "methods": {name: {"doc": cls.summary(), "paper": cls.paper, "params": cls.schema(),
                           "rules": cls.rules_schema(), **({"notes": cls.notes()} if cls.notes() else {}),
                           **({"presses": cls.presses()} if cls.presses() else {}),
                           **({"in_model_only": True} if getattr(cls, "in_model_only", False) else {}),
                           **_protocols(cls, PROTOCOLS)}
                    for name, cls in METHODS.items()},
        "protocols": PROTOCOLS,
        "renamed_methods": {old: {"now": new, "why": why} for old, (new, why) in RENAMED.items()},
        "workloads": {name: {"doc": cls.summary(), "params": cls.schema(), "rules": cls.rules_schema(),
                             **({"expand": cls.expand} if cls.expand else {}),
                             **({"runs_model": True} if cls.runs_model else {})}
                      for name, cls in WORKLOADS.items()},
        "default_workload": DEFAULT_WORKLOAD,
        "benchmarks": {name: bench.describe() for name, bench in BENCHMARKS.items()},
        "ops": {name: {"doc": op.summary, "benchmark": op.benchmark} for name, op in OPS.items()},
    }


def _protocols(cls, protocols) -> dict:
    """{"protocols": {protocol: the knobs it sets}} for the protocols that set any."""
    sets = {name: knobs for name in protocols if (knobs := cls.protocol_knobs(name))}
    return {"protocols": sets} if sets else {}


def text() -> str:
    """The file's contents."""
    return json.dumps(document(), indent=2) + "\n"
