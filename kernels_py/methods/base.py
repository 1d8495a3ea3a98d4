"""The method interface: how a compression method builds and maintains one
layer's KV cache, and TokenSelection, the composition most methods are.

A method is a small frozen dataclass of knobs (`knob` fields, validated on
construction, documented in the schema) with two entry points, in the spirit
of NVIDIA kvpress presses:

- `prefill_all(q, k, v, spans) -> [cache per layer]` once the whole prompt has
  been seen (`prefill(layer, ...)` for one layer alone);
- `decode(layer, cache, q_t, k_t, v_t) -> output`: one generation step: the new
  token joins the cache, attention runs over what is held, and the method
  updates its statistics and trims the cache if it must.

Most methods keep a subset of tokens and are three parts (TokenSelection): a
scorer (which tokens matter, methods/scorers.py), an allocator (how many each
layer keeps, methods/allocators.py) and the kept-tokens cache
(methods/caches.py), held as it is or as fp8 codes (methods/float8.py:
the kv_dtype and fp8_scale knobs every such method has). A method that stores something else (low-rank factors,
quantized codes) implements prefill_all and decode itself, from the same parts
where they fit.

Shapes: q [heads, T, d]; k, v [kv_heads, T, d]; q_t [heads, 1, d];
k_t, v_t [kv_heads, 1, d]. GQA: query head h reads kv head h // (heads // kv_heads),
and per-token statistics are kept per kv head, summed over its query heads.
Prompt tokens sit at positions 0..T-1 and step s at position T + s.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Mapping

import torch

from kernels_py.attention import Spans
from kernels_py.methods.allocators import Allocator
from kernels_py.methods.caches import KeptBatch, KeptTokens, kept_count
from kernels_py.methods.float8 import KV_DTYPES, Float8Tokens, fp8_scale_knob, kv_dtype_knob
from kernels_py.methods.prompt import Prompt
from kernels_py.methods.scorers import Scorer
from kernels_py.ops.common import BACKENDS
from kernels_py.params import Knobs, StaleSchema, closest, knob, same_value, stale_message


# Comparison protocols: the knobs an experiment that names one
# (experiment(protocol=...)) sets on each of its jobs before the job's own
# values. A method lists what each protocol sets on it in `protocols`.
PROTOCOLS = {
    "paper": "every method at its own defaults, those of its paper (no knob is set)",
    "vlcache": "VL-Cache's protocol for its baselines (section 5): a recent window of 10% of the budget where a "
               "method keeps one (H2O's recent_fraction, SnapKV's and PyramidKV's observation window; VL-Cache's "
               "own default); and, this workbench's addition, not the paper's (whose budgets are a share of the "
               "prompt, every method at its own default otherwise, VL-Cache itself compressing the prompt once), "
               "every budgeted method and LOOK-M evicts while decoding, so budgets count prompt and generated "
               "tokens and matched budgets stay matched",
}


def budget_knob(default: float = 0.2, doc: str = "share of the tokens the cache keeps: of the prompt, and with "
                "evict_while_decoding of every token seen", ref: str = ""):
    """The share-of-tokens knob every budgeted method has."""
    return knob("float", default, doc, min=0.001, max=1.0, ref=ref)


def eviction_knob(default: bool, ref: str = ""):
    """Whether a token-keeping method trims its cache back to its share of
    the tokens seen after every decode step (what a protocol may set)."""
    return knob("bool", default, "trim the cache back to its budget's share of the tokens seen (prompt and "
                "generated) after every decode step; False: compress the prompt once and keep every generated "
                "token", ref=ref)


def backend_knob(what: str = "statistics"):
    """Which implementation runs the method's hot path (ops.common.BACKENDS)."""
    return knob("str", "auto", f"{what}: Triton kernel (on CUDA when auto) or PyTorch reference", choices=BACKENDS)


class Method(Knobs, ABC):
    """A KV-cache compression method; subclasses are frozen dataclasses of knobs."""

    name: ClassVar[str]
    paper: ClassVar[str] = ""  # where the method comes from, for the schema and `workbench methods`
    protocols: ClassVar[dict[str, dict]] = {}  # protocol -> the knob values it sets (a subclass adds to its bases')

    @classmethod
    def protocol_knobs(cls, protocol: str) -> dict:
        """The knob values `protocol` (a PROTOCOLS name) sets on this method."""
        if protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {protocol!r} (known: {', '.join(PROTOCOLS)})")
        out = {}
        for klass in reversed(cls.__mro__):
            declared = vars(klass).get("protocols", {})
            # A misspelt protocol would otherwise set nothing, and the schema would say so without a word.
            for name in declared:
                if name not in PROTOCOLS:
                    raise ValueError(f"{klass.__module__}.{klass.__name__}.protocols names {name!r}, which is not a "
                                     f"protocol{closest(name, PROTOCOLS)}; known: {', '.join(PROTOCOLS)} "
                                     f"(PROTOCOLS in kernels_py/methods/base.py)")
            out.update(declared.get(protocol, {}))
        return out

    @classmethod
    def check_planned_protocol(cls, protocol: str, planned: Mapping[str, Any], values: Mapping[str, Any]) -> None:
        """Raise StaleSchema where `planned` (the knob values schema.json said
        `protocol` sets, which the host set on the job) is not what this
        class's protocols set, and the job (`values`) holds the planned
        value: another was the script's own choice."""
        ours = cls.protocol_knobs(protocol) if protocol in PROTOCOLS else {}
        changes = []
        for name in sorted(set(ours) | set(planned)):
            if name in planned and name in ours and same_value(planned[name], ours[name]):
                continue
            if name in planned and name in values and not same_value(values[name], planned[name]):
                continue  # the grid or an extra set it after the protocol
            if name not in planned and name in values and same_value(values[name], ours[name]):
                continue  # the job holds what the protocol now sets
            now = f"sets {name} to {ours[name]!r}" if name in ours else f"leaves {name} alone"
            was = f"{planned[name]!r}" if name in planned else "nothing"
            changes.append(f"protocol {protocol!r} {now}, not {was}")
        if changes:
            raise StaleSchema(stale_message(cls, changes))

    @classmethod
    def owner_name(cls) -> str:
        return f"method {cls.name!r}"

    @classmethod
    def notes(cls) -> list[str]:
        """More to know than the knobs, one line each (`workbench methods NAME` prints them)."""
        return []

    @classmethod
    def presses(cls) -> dict:
        """The kvpress presses the method's press knob may name, with their
        constructors (models.presses.schema); empty for other methods."""
        return {}

    @abstractmethod
    def prefill_all(self, q: list[torch.Tensor], k: list[torch.Tensor], v: list[torch.Tensor], spans: Spans) -> list:
        """Build every layer's cache once the whole prompt has been seen (lists
        indexed by layer)."""

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: Spans):
        """Build one layer's cache as if it were the only layer."""
        return self.prefill_all([q], [k], [v], spans)[0]

    @abstractmethod
    def decode(self, layer: int, cache, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor) -> torch.Tensor:
        """One decode step; updates `cache` in place and returns the attention output [heads, 1, d]."""

    def check_step(self, layer: int, cache, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor) -> None:
        """Raise ValueError unless q_t is [heads, 1, d] (heads a multiple of
        the cache's kv heads) and k_t, v_t [kv_heads, 1, d] for the cache's
        kv_heads and head_dim: one token a step (a cache places a step's
        token at one position, so a second one would share it and see the
        first's future)."""
        want = (cache.kv_heads, 1, cache.head_dim)
        if tuple(k_t.shape) != want or tuple(v_t.shape) != want or q_t.dim() != 3 \
                or tuple(q_t.shape[1:]) != want[1:] or q_t.shape[0] % want[0]:
            raise ValueError(f"{self.owner_name()}: layer {layer}: expected q_t [heads, 1, {want[2]}] with heads a "
                             f"multiple of {want[0]} and k_t, v_t {list(want)} (one token a step); got "
                             f"{tuple(q_t.shape)}, {tuple(k_t.shape)}, {tuple(v_t.shape)}")

    @property
    def decodes_together(self) -> bool:
        """Whether every decode step of a model's batch may run this method's
        caches together as a KeptBatch (one write and one attention a layer
        for all sequences) where the caches allow it, so that a step can be
        replayed from a CUDA graph: only a decode that appends and attends
        and nothing else. Default: no (decode_batch may still batch some
        steps, as ZipVL's does)."""
        return False

    def decode_batch(self, caches: list, room: int, scratch: dict):
        """One layer's caches of every sequence of a model's batch (one per
        sequence) as one object that decodes them together, or None: decode
        runs sequence by sequence. The object's `decode(q, k, v)` ([B, heads
        or kv_heads, 1, d]) returns the outputs [B, heads, 1, d], or None for
        a step it cannot take together, having written every cache back
        (the caller then decodes that step sequence by sequence and asks
        again next step); `write_back()` leaves every cache as its own decode
        would have. room: steps to come (what to reserve); scratch:
        workspaces the layers' batches share. Default: KeptBatch where the
        method decodes together (decodes_together) and the caches allow it."""
        return KeptBatch.of(caches, room, scratch) if self.decodes_together and KeptBatch.holds(caches) else None

    def prefill_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          spans: Spans) -> torch.Tensor | None:
        """Inside a live model, the prefill attention output [heads, T, d] of
        one layer, which the next layer reads (a method that changes the
        prefill itself, e.g. ZipVL's sparse prefill); None: ordinary causal
        attention. Replayed workloads have no next layer to feed."""
        return None

    def cache_bytes(self, cache) -> int:
        """Bytes the cache holds, as its representation counts them."""
        return cache.nbytes

    def layer_metrics(self, layer: int, cache) -> dict[str, float]:
        """Method-specific numbers about one layer after the last step (e.g. the
        budget it was given); reported per layer and averaged. Default: the
        cache's notes."""
        return dict(cache.notes)


@dataclass(frozen=True)
class TokenSelection(Method):
    """A method that keeps a subset of tokens: after prefill each layer holds
    the allocator's count of tokens, the `recent` latest plus the ones its
    scorer ranks highest. A method that evicts while decoding (a
    BudgetedSelection with evict_while_decoding) holds the same share of the
    tokens seen (prompt and generated) after every step, trimmed the same
    way; otherwise every generated token is kept."""

    attention: str = knob(
        "str", "float32", "decode attention over the kept tokens: float32 (PyTorch, the precision comparisons use) "
        "or sdpa (the cache's dtype, FlashAttention on a GPU: for end-to-end speed; inside a model a batch's "
        "sequences decode together over one padded cache: the gather_decode op on a GPU, SDPA under a mask on the "
        "CPU; over an fp8 cache the fused fp8 decode op, its kernel on a GPU); scores that read every step's "
        "attention (H2O's, evicting while decoding) keep float32", choices=("float32", "sdpa"))
    kv_dtype: str = kv_dtype_knob()
    fp8_scale: str = fp8_scale_knob()

    @property
    def evicts_while_decoding(self) -> bool:
        return False

    @property
    def decodes_together(self) -> bool:
        # decode below, without eviction and over SDPA, only appends and attends, over plain tensors (no fp8 codes);
        # a subclass's own decode may do more.
        return (not self.evicts_while_decoding and self.attention == "sdpa" and KV_DTYPES[self.kv_dtype] is None
                and type(self).decode is TokenSelection.decode)

    @abstractmethod
    def scorer(self) -> Scorer:
        """Which tokens matter."""

    @abstractmethod
    def allocator(self) -> Allocator:
        """How many tokens each layer keeps."""

    def recent(self, capacity: int) -> int:
        """How many of `capacity` kept tokens are the latest ones; default none."""
        return 0

    def recent_at(self, capacity: int, seen: int) -> int:
        """recent() where the tokens seen so far are known too (the prompt's
        at prefill)."""
        return self.recent(capacity)

    @cached_property
    def _parts(self) -> tuple[Scorer, Allocator]:
        return self.scorer(), self.allocator()

    def prefill_all(self, q, k, v, spans) -> list[KeptTokens]:
        scorer, allocator = self._parts
        prompt = Prompt(q, k, v, spans)
        self.check_prompt(prompt)
        caches = []
        for layer, allocation in enumerate(allocator.prefill(prompt)):
            cache = KeptTokens.from_prompt(k[layer], v[layer], self._prefill_scores(scorer, prompt, layer))
            cache.keep_top(scorer.held(cache), allocation.count, self.recent_at(allocation.count, prompt.tokens))
            cache.notes.update(allocation.notes)
            if self.evicts_while_decoding:
                cache.share = allocation.share
            else:
                cache.scores = None  # nothing to maintain while decoding
            caches.append(self.store(cache))
        return caches

    def _prefill_scores(self, scorer: Scorer, prompt: Prompt, layer: int) -> torch.Tensor | None:
        """The scorer's prefill scores, checked to be one per kv head and prompt token."""
        scores = scorer.prefill(prompt, layer)
        want = (prompt.k[layer].shape[0], prompt.tokens)
        if scores is not None and (not isinstance(scores, torch.Tensor) or tuple(scores.shape) != want):
            got = list(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise ValueError(f"{self.owner_name()}: {type(scorer).__name__}.prefill returned {got} for layer {layer}; "
                             f"a scorer's prefill returns [kv_heads, T] = {list(want)} (a score per kv head and prompt "
                             f"token) or None (see methods/scorers.py)")
        return scores

    def store(self, cache: KeptTokens) -> KeptTokens:
        """The kept tokens as the cache holds them: as they are, or fp8 codes
        and scales (kv_dtype, fp8_scale)."""
        fmt = KV_DTYPES[self.kv_dtype]
        if fmt is None:
            cache.own()  # a cache that evicted nothing still holds the prompt's K and V as it was given them
            return cache
        return Float8Tokens(cache, fmt, self.fp8_scale)

    def decode(self, layer, cache: KeptTokens, q_t, k_t, v_t) -> torch.Tensor:
        scorer, _ = self._parts
        self.check_step(layer, cache, q_t, k_t, v_t)
        cache.append(k_t, v_t)
        evicting = cache.share is not None
        output, weights = cache.attend(q_t, weights=(evicting and scorer.needs_weights) or self.attention == "float32")
        if evicting:
            scorer.decode(cache, weights)
            capacity = kept_count(cache.share, cache.seen)
            # The token just generated is always held: dropping it at once would undo the step.
            cache.keep_top(scorer.held(cache), capacity, max(1, self.recent_at(capacity, cache.seen)))
        return output

    def check_prompt(self, prompt: Prompt) -> None:
        """Reject a prompt the method cannot work on, with a reason; default: any."""


@dataclass(frozen=True)
class BudgetedSelection(TokenSelection):
    """A TokenSelection with a budget: it may evict while decoding
    (evict_while_decoding, each method's default its paper's), which the
    `vlcache` protocol turns on so that budgets count generated tokens (the
    workbench's addition to VL-Cache's section 5 protocol, which sets the
    recent window only: there budgets are a share of the prompt and
    VL-Cache compresses the prompt once)."""

    evict_while_decoding: bool = eviction_knob(False)

    protocols = {"vlcache": {"evict_while_decoding": True}}

    @property
    def evicts_while_decoding(self) -> bool:
        return self.evict_while_decoding
