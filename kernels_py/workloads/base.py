"""What every workload provides, however it is made (synthetic today,
captured traces next): per-layer prompt and decode-step Q/K/V with the
prompt's modality spans."""

from dataclasses import dataclass
from typing import ClassVar

import torch

from kernels_py.attention import Spans
from kernels_py.params import Knobs


@dataclass(frozen=True)
class Workload:
    """Per-layer tensors, on `runtime.device()`, in the config's dtype.

    q[l]: [heads, T, head_dim]; k[l], v[l]: [kv_heads, T, head_dim] for the T
    prompt tokens (q and k after RoPE). decode_q[l]: [steps, heads, 1, head_dim];
    decode_k[l], decode_v[l]: [steps, kv_heads, 1, head_dim]; step s is the token at
    position T + s, whose query sees the prompt, earlier decode tokens and itself.
    Query head h reads kv head h // (heads // kv_heads).
    """

    config: "WorkloadConfig"
    spans: Spans
    positions: torch.Tensor  # [T] int64 RoPE positions ([3, T] under M-RoPE: spans.rope.kind)
    decode_positions: torch.Tensor  # [steps] int64 ([3, steps] under M-RoPE)
    sinks: tuple[int, ...]  # positions built to be heavy hitters
    q: tuple[torch.Tensor, ...]
    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    decode_q: tuple[torch.Tensor, ...]
    decode_k: tuple[torch.Tensor, ...]
    decode_v: tuple[torch.Tensor, ...]

    @property
    def layers(self) -> int:
        return len(self.q)

    @property
    def decode_steps(self) -> int:
        return self.decode_q[0].shape[0]


class WorkloadConfig(Knobs):
    """A registered workload: a frozen dataclass of knobs (documented, bounded,
    in the schema) that builds its Workload. `name` is what scripts pass to
    workload(...)."""

    name: ClassVar[str]
    # Knobs one workload value spreads over several jobs (the plan expands them): "each" splits a
    # comma-separated str into one job per item; "index:KNOB" makes an int N into N jobs, KNOB = 0..N-1.
    expand: ClassVar[dict[str, str]] = {}
    # A model runs in it, so methods that run only inside a model (Method.in_model_only) can run on it.
    runs_model: ClassVar[bool] = False

    @classmethod
    def owner_name(cls) -> str:
        return f"workload {cls.name!r}"

    def build(self) -> Workload:
        raise NotImplementedError
