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

    path: str = knob("str", "", "the trace file (.safetensors) to replay", paths=True, required=True)

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
    positions, decode_positions = tensors["positions"], tensors["decode_positions"]
    prompt, steps = meta["prompt_tokens"], meta["decode_steps"]
    if spans.rope.kind == "default" and not (torch.equal(positions, torch.arange(prompt)) and torch.equal(
            decode_positions, torch.arange(prompt, prompt + steps))):
        # Methods place prompt token i at position i and step s at T + s (methods.base); a trace that does
        # not (a padded or offset capture) would be unrotated at the wrong angles.
        raise ValueError(f"trace positions are not 0..{prompt - 1} then {prompt}..{prompt + steps - 1}: this "
                         f"version replays only traces of one unpadded prompt")
    return Workload(config, spans, positions.to(dev), decode_positions.to(dev),
                    (), per_layer("q"), per_layer("k"), per_layer("v"),
                    per_layer("decode_q"), per_layer("decode_k"), per_layer("decode_v"))
