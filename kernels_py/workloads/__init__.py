"""Registered workloads the methods run on: per-layer prompt and decode-step
Q/K/V with modality spans (workloads.base.Workload). A script picks one by
name, workload("synthetic", seed=1), and its knobs come from the schema.

Add a workload: a WorkloadConfig subclass in kernels_py/workloads/<name>.py,
and its name in WORKLOADS below.
"""

from typing import Any, Mapping

from kernels_py import registry
from kernels_py.params import closest
from kernels_py.workloads.base import Workload, WorkloadConfig
from kernels_py.workloads.synthetic import SyntheticConfig, generate

# One line per workload; the first is the default of workload() and of
# experiments that name none.
WORKLOADS: dict[str, type[WorkloadConfig]] = registry.load(__name__, (
    "synthetic",
    "trace",
    "vlm",
    "lmms",
), WorkloadConfig)
DEFAULT_WORKLOAD = next(iter(WORKLOADS))


def make_workload(name: str, params: Mapping[str, Any]) -> WorkloadConfig:
    """The config of workload `name` with `params` (unset ones take their
    defaults); unknown names or knobs, wrong types and out-of-range values
    raise ValueError / TypeError naming the culprit."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}{closest(name, WORKLOADS)}; known: {sorted(WORKLOADS)}")
    return WORKLOADS[name].from_dict(params)


__all__ = ["DEFAULT_WORKLOAD", "WORKLOADS", "SyntheticConfig", "Workload", "WorkloadConfig", "generate",
           "make_workload"]
