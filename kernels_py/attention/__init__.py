"""The attention concepts methods, workloads, model adapters and ops share:
where each modality sits in the prompt (spans.py), how positions rotate
keys and queries (rope.py: the kind, theta and the rotation), and how query
heads map onto key/value heads (gqa.py).

GQA convention everywhere: query head h reads kv head h // (heads // kv_heads).
"""

from kernels_py.attention.gqa import expand_kv, group_sum
from kernels_py.attention.rope import ROPE_KINDS, Rope, apply_rope
from kernels_py.attention.spans import Spans

__all__ = ["ROPE_KINDS", "Rope", "Spans", "apply_rope", "expand_kv", "group_sum"]
