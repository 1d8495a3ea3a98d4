"""KV-cache compression methods and their registry: one file per method
(kernels_py/methods/<name>.py), one line per method in METHODS.

`make_method(name, params)` builds one from a job message. A method is a
frozen dataclass of knobs (kernels_py.params) built from shared parts:
scorers.py (which tokens matter), allocators.py (how many per layer),
caches.py / lowrank.py / quantized.py (what the cache holds); base.py says
how they fit. Their knobs, docs and bounds reach the Go host through
kernels_py/schema.json (`workbench schema` regenerates it).
"""

from typing import Any, Mapping

from kernels_py import registry
from kernels_py.methods.base import Method, TokenSelection
from kernels_py.params import closest

# One line per method: the file kernels_py/methods/<name>.py defines it.
METHODS: dict[str, type[Method]] = registry.load(__name__, (
    "full",
    "h2o",
    "streamingllm",
    "snapkv",
    "vlcache",
    "zipvl",
    "zipvl_evict",
    "zipvl_fixed",
    "kivi",
    "attentionpack",
    "avl",
    "lookm",
    "pyramidkv",
    "fastv",
    "kvpress",
    "fp8",
), Method)


# Old method names, each with what it is now and why it changed (the schema carries them, so plan says so too).
RENAMED: dict[str, tuple[str, str]] = {
    "zipcache": ("zipvl_fixed", "it is ZipVL's fixed-ratio baseline (Table 3), not ZipCache's own saliency and "
                                "channel-separable quantization"),
}


def make_method(name: str, params: Mapping[str, Any] | None = None) -> Method:
    """The method `name` with `params` (unset ones take their defaults);
    unknown names or parameters, wrong types and out-of-range values raise
    ValueError / TypeError naming the culprit."""
    if not isinstance(name, str):
        raise TypeError(f"method name must be a str, got {type(name).__name__} {name!r}")
    if name in RENAMED:
        raise ValueError(f"method {name!r} is now {RENAMED[name][0]!r}: {RENAMED[name][1]}")
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}{closest(name, METHODS)}; known: {sorted(METHODS)}")
    return METHODS[name].from_dict({} if params is None else params)


__all__ = ["METHODS", "Method", "TokenSelection", "make_method"]
