"""What every workload provides, however it is made (synthetic today,
captured traces next): per-layer prompt and decode-step Q/K/V with the
prompt's modality spans."""

import functools
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
    position T + s, whose query sees the prompt, earlier decode tokens and itself
    (at least one step: the ablation scores every method on its decode steps).
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

    def __post_init__(self):
        problem = self._shape_problem()
        if problem:
            raise ValueError(f"{self.config.owner_name()} built a Workload whose {problem} (kernels_py/workloads/base.py"
                             f": q[l] [heads, T, head_dim], k[l] and v[l] [kv_heads, T, head_dim], decode_q[l] "
                             f"[steps, heads, 1, head_dim], decode_k[l] and decode_v[l] [steps, kv_heads, 1, head_dim], "
                             f"heads a multiple of kv_heads, steps at least 1, spans over the T prompt tokens)")

    def _shape_problem(self) -> str | None:
        """What makes the tensors disagree with each other or the spans, or None."""
        names = ("q", "k", "v", "decode_q", "decode_k", "decode_v")
        counts = {name: len(getattr(self, name)) for name in names}
        if not counts["q"] or len(set(counts.values())) > 1:
            return "layer counts differ or are zero: " + ", ".join(f"{n} {c}" for n, c in counts.items())
        q, k, dq = self.q[0], self.k[0], self.decode_q[0]
        if q.dim() != 3 or k.dim() != 3 or dq.dim() != 4:
            return f"q[0] is {list(q.shape)}, k[0] {list(k.shape)}, decode_q[0] {list(dq.shape)}"
        (heads, tokens, head_dim), kv_heads, steps = q.shape, k.shape[0], dq.shape[0]
        want = {"q": [heads, tokens, head_dim], "k": [kv_heads, tokens, head_dim], "v": [kv_heads, tokens, head_dim],
                "decode_q": [steps, heads, 1, head_dim], "decode_k": [steps, kv_heads, 1, head_dim],
                "decode_v": [steps, kv_heads, 1, head_dim]}
        for name in names:
            for layer, t in enumerate(getattr(self, name)):
                if list(t.shape) != want[name]:
                    return f"{name}[{layer}] is {list(t.shape)}, not {want[name]} (from q[0] {list(q.shape)}, k[0] " \
                           f"{list(k.shape)}, decode_q[0] {list(dq.shape)})"
        if steps < 1:  # the ablation scores a method on its decode steps (and VL-Cache's hit rate on the first)
            return f"decode_q[0] is {list(dq.shape)}: no decode step, where every method is scored on at least one"
        if kv_heads < 1 or heads % kv_heads:
            return f"{heads} query heads are not a multiple of its {kv_heads} kv heads"
        if self.spans.prompt_tokens != tokens:
            return f"spans end at token {self.spans.prompt_tokens} (spans.text[1]) but its prompt has {tokens} tokens"
        return None

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


LOADED_MODELS = 2  # models a worker keeps loaded between its jobs


@functools.lru_cache(maxsize=LOADED_MODELS)
def loaded_model(path: str):
    """The VLM in the local directory `path` on the worker's device (a GPU
    where it has one), loaded once for all the jobs on it: the workloads that
    run a model (vlm, lmms) share these LOADED_MODELS models, so a worker
    never holds one directory twice. What a job derives from a model is kept
    on it (VLM.derived), so nothing outlives the model this cache lets go."""
    from kernels_py import runtime
    from kernels_py.models import load

    return load(path, device=runtime.device())
