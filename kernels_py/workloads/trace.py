"""A captured attention trace of a real model as a workload
(kernels_py.models.trace): every method and metric runs on the model's own
Q/K/V instead of the synthetic ones."""

from dataclasses import dataclass

import torch

from kernels_py import runtime
from kernels_py.params import knob
from kernels_py.workloads.base import Workload, WorkloadConfig


@dataclass(frozen=True)
class TraceConfig(WorkloadConfig):
    """A trace file written by `workbench trace capture` (a real VLM's per-layer Q/K/V, spans and positions)."""

    name = "trace"

    path: str = knob("str", "", "the trace file (.safetensors) to replay")

    def build(self) -> Workload:
        from kernels_py.models.trace import read, spans_of

        if not self.path:
            raise ValueError("workload 'trace' needs path=: the file `workbench trace capture` wrote")
        tensors, meta = read(self.path)
        return from_tensors(self, tensors, meta, spans_of(meta))


def from_tensors(config: WorkloadConfig, tensors: dict, meta: dict, spans) -> Workload:
    """The Workload of a trace's tensors (kernels_py.models.trace's names)."""
    layers = meta["model"]["layers"]
    dev = runtime.device()

    def per_layer(name):
        return tuple(tensors[f"layer.{layer}.{name}"].to(dev) for layer in range(layers))

    # The positions the model rotated with: [T] and [steps], or [3, T] and [3, steps] under M-RoPE (spans.rope).
    return Workload(config, spans, tensors["positions"].to(dev), tensors["decode_positions"].to(dev),
                    (), per_layer("q"), per_layer("k"), per_layer("v"),
                    per_layer("decode_q"), per_layer("decode_k"), per_layer("decode_v"))
