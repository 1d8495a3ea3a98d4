"""Workloads the policies run on: per-layer prompt and decode-step Q/K/V with
modality spans. `synthetic` builds them from a seed."""

from kernels_py.workloads.synthetic import Spans, SyntheticConfig, Workload, apply_rope, generate

__all__ = ["Spans", "SyntheticConfig", "Workload", "apply_rope", "generate"]
