"""KV-cache compression policies and their registry.

`make_policy(name, params)` builds one from a job message; `schema_document()`
describes every policy's and the workload's parameters, and is what
`schema.json` beside this file holds for the Go host. After changing a
parameter, regenerate the file:

    python -c "import json; from kernels_py.policies import schema_document; \\
    open('kernels_py/policies/schema.json', 'w').write(json.dumps(schema_document(), indent=2) + '\\n')"
"""

from typing import Any, Mapping

from kernels_py.policies.attentionpack import AttentionPack
from kernels_py.policies.base import BudgetPolicy, LayerCache, Policy
from kernels_py.policies.full import Full
from kernels_py.policies.h2o import H2O
from kernels_py.policies.snapkv import SnapKV
from kernels_py.policies.streamingllm import StreamingLLM
from kernels_py.policies.vlcache import VLCache
from kernels_py.policies.zipvl import ZipVL
from kernels_py.workloads import SyntheticConfig

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (Full, H2O, StreamingLLM, SnapKV, VLCache, ZipVL, AttentionPack)}


def make_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    """The policy `name` with `params` (unset ones take their defaults);
    unknown names or parameters, wrong types and out-of-range values raise
    ValueError / TypeError naming the culprit."""
    if not isinstance(name, str):
        raise TypeError(f"policy name must be a str, got {type(name).__name__} {name!r}")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name].from_dict({} if params is None else params)


def schema_document() -> dict:
    """Every parameter the host may set, with type, default and bounds."""
    return {
        "methods": {name: {"doc": cls.summary(), "params": cls.schema()} for name, cls in POLICIES.items()},
        "workload": {"params": SyntheticConfig.schema()},
    }


__all__ = ["POLICIES", "BudgetPolicy", "LayerCache", "Policy", "make_policy", "schema_document"]
