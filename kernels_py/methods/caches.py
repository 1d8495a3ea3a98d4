"""Cache representations a method can hold a layer's KV cache in, and the
selection rule the token-keeping methods share. Each representation knows its
exact byte count and how to attend over what it holds.

Here: kept tokens (a subset of the full K/V, gathered, so memory really
shrinks). Low-rank factors are in methods/lowrank.py; the quantized codes
of KIVI and ZipVL (ops/kv_quant's layout) in methods/mixed_precision.py,
and the PyTorch quantization the low-rank factors may use in
methods/quantized.py.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels_py.attention import expand_kv
from kernels_py.metrics import tensor_bytes
from kernels_py.ops import gather_decode, splitk
from kernels_py.ops.common import use_triton
from kernels_py.ops.gather_decode.kernel import split_count


@dataclass
class KeptTokens:
    """A layer's cache as a subset of its tokens. Tokens are in position order
    per kv head; kv heads may hold different tokens but always the same number."""

    keys: torch.Tensor  # [kv_heads, n, d]
    values: torch.Tensor  # [kv_heads, n, d]
    positions: torch.Tensor  # [kv_heads, n] int64, where each held token sits in the sequence
    scores: torch.Tensor | None  # [kv_heads, n] float32 per-token statistics, if the method keeps any
    seen: int  # tokens this layer has processed: prompt plus generated
    notes: dict[str, float] = field(default_factory=dict)  # per-layer facts a method reports (layer_metrics)
    share: float | None = None  # of the tokens seen, what decoding trims back to; None: nothing is evicted

    @classmethod
    def from_prompt(cls, k: torch.Tensor, v: torch.Tensor, scores: torch.Tensor | None = None) -> "KeptTokens":
        kv_heads, tokens, _ = k.shape
        positions = torch.arange(tokens, device=k.device).expand(kv_heads, -1)
        return cls(k, v, positions, scores, tokens)

    @property
    def tokens(self) -> int:
        return self.keys.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.positions.shape[0]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of K and V held (bookkeeping such as positions is not counted)."""
        return tensor_bytes(self.keys, self.values)

    def own(self) -> None:
        """Hold K and V in storage of their own (owned): a cache that kept
        every prompt token still holds the tensors it was given, which may
        be views of more (a model batch's K and V, its padding included)."""
        self.keys, self.values = owned(self.keys), owned(self.values)

    def keep(self, indices: torch.Tensor) -> None:
        """Keep only the tokens at `indices` ([kv_heads, n'] into the held tokens),
        as new, smaller tensors."""
        indices = indices.sort(dim=-1).values
        self._keep_kv(indices)
        self.positions = self.positions.gather(1, indices)
        if self.scores is not None:
            self.scores = self.scores.gather(1, indices)

    def _keep_kv(self, indices: torch.Tensor) -> None:
        """keep's K and V part (indices sorted): what a representation of
        the tokens' K and V other than plain tensors overrides."""
        channels = indices[..., None].expand(-1, -1, self.keys.shape[-1])
        self.keys = self.keys.gather(1, channels)
        self.values = self.values.gather(1, channels)

    def keep_top(self, scores: torch.Tensor, capacity: int, recent: int) -> None:
        """Hold at most `capacity` tokens: the `recent` latest plus the
        highest-scoring earlier ones (scores [kv_heads, n] of the held tokens)."""
        if self.tokens > capacity:
            self.keep(top_and_recent(scores, capacity, recent))

    def append(self, k_t: torch.Tensor, v_t: torch.Tensor) -> None:
        """Add the token being generated ([kv_heads, 1, d]) at the next position."""
        kv_heads = k_t.shape[0]
        self._append_kv(k_t, v_t)
        position = torch.full((kv_heads, 1), self.seen, dtype=self.positions.dtype, device=self.positions.device)
        self.positions = torch.cat([self.positions, position], dim=1)
        if self.scores is not None:
            self.scores = torch.cat([self.scores, self.scores.new_zeros(kv_heads, 1)], dim=1)
        self.seen += 1

    def _append_kv(self, k_t: torch.Tensor, v_t: torch.Tensor) -> None:
        """append's K and V part, as _keep_kv."""
        self.keys = torch.cat([self.keys, k_t.to(self.keys.dtype)], dim=1)
        self.values = torch.cat([self.values, v_t.to(self.values.dtype)], dim=1)

    def attend(self, q_t: torch.Tensor, weights: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One query token q_t [heads, 1, d] over the held K/V. Returns the output
        [heads, 1, d] in q's dtype and the attention weights [heads, n] in
        float32 (for the method's statistics). weights=False: no weights
        (None), the output from SDPA in the cache's dtype (FlashAttention on
        a GPU), without the float32 copy of every held K/V."""
        heads, _, head_dim = q_t.shape
        if not weights:
            out = F.scaled_dot_product_attention(q_t[None].to(self.keys.dtype), self.keys[None], self.values[None],
                                                 enable_gqa=heads != self.keys.shape[0])
            return out[0].to(q_t.dtype), None
        keys = expand_kv(self.keys.float(), heads)
        values = expand_kv(self.values.float(), heads)
        weights = torch.softmax(q_t.float() @ keys.transpose(1, 2) / math.sqrt(head_dim), dim=-1)
        return (weights @ values).to(q_t.dtype), weights[:, 0]


def owned(t: torch.Tensor) -> torch.Tensor:
    """t where its storage holds its elements alone, else a compact copy:
    a view keeps all of the storage behind it alive, while a cache counts
    the view's bytes (tensor_bytes)."""
    if t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def top_and_recent(scores: torch.Tensor, capacity: int, recent: int) -> torch.Tensor:
    """[kv_heads, capacity] indices: the `recent` last tokens plus the
    `capacity - recent` highest-scoring earlier ones. scores: [kv_heads, n]."""
    tokens = scores.shape[1]
    recent = min(recent, capacity)
    older = tokens - recent
    top = scores[:, :older].topk(capacity - recent, dim=-1).indices
    window = torch.arange(older, tokens, device=scores.device).expand(scores.shape[0], -1)
    return torch.cat([top, window], dim=-1)


def kept_count(fraction: float, tokens: int) -> int:
    """How many of `tokens` a share `fraction` keeps: int(tokens * fraction),
    at least 1. This is kvpress's rule (compute_n_kept, with fraction = 1 -
    compression_ratio), the same float expression, so a method and its press
    keep the same count on every length; floating point decides exact ties as
    it does there (0.3 * 10 keeps 3, 0.29 * 100 keeps 28)."""
    return max(1, int(tokens * fraction))


def half_up(x: float) -> int:
    """x rounded half up (2.5 -> 3), unlike round()'s half to even."""
    return math.floor(x + 0.5)


# The recent window of VL-Cache's experiments, for its method and every baseline: 10% of the budget.
RECENT_SHARE = 0.1


def recent_count(fraction: float, capacity: int) -> int:
    """The recent tokens of a cache of `capacity`: fraction * capacity rounded
    half up, the one rounding every method uses (so equal budgets and shares
    hold equal counts)."""
    return min(capacity, half_up(fraction * capacity))


# Memory-efficient attention wants its mask's rows aligned to 16 elements (else PyTorch pads a copy each call).
_MASK_ALIGN = 16
GROWTH = 128  # tokens a KeptBatch grows by at least, once out of room


def _aligned(capacity: int) -> int:
    return -(-capacity // _MASK_ALIGN) * _MASK_ALIGN


@dataclass
class KeptBatch:
    """One layer's KeptTokens of every sequence of a batch, decoded together:
    their keys and values padded into one [B, kv_heads, capacity, d] tensor
    with room for the steps to come, so that a step writes the batch's new
    tokens in place and attends once, where each sequence alone would
    concatenate its whole cache and attend (a dozen launches a sequence
    and layer, which left the GPU idle most of a batched decode step). A
    mask keeps each sequence's attention to the tokens it holds.

    While it decodes, each KeptTokens holds views of the padded tensors of
    the tokens it held when the batch was made; write_back leaves every one
    as appending each step's token to it alone would have (compact tensors,
    positions, seen). Only for what decode would append and attend plainly:
    no scores, no eviction, no fp8 codes (holds)."""

    caches: list[KeptTokens]
    keys: torch.Tensor  # [B, kv_heads, capacity, d]
    values: torch.Tensor  # [B, kv_heads, capacity, d]
    counts: list[int]  # tokens each sequence held when the batch was made
    steps: int = 0  # tokens appended to each since
    scratch: dict = field(default_factory=dict)  # reusable attention workspaces, shareable between layers

    def __post_init__(self):
        self._longest = max(self.counts)
        self._gather = None  # gather_decode's fixed inputs, made at its first call
        self._index()

    @staticmethod
    def holds(caches: list) -> bool:
        """Whether these caches (one per sequence) can decode together: plain
        KeptTokens of one layout that keep no scores and evict nothing."""
        first = caches[0]
        return all(type(c) is KeptTokens and c.scores is None and c.share is None
                   and c.keys.shape[0] == first.keys.shape[0] and c.keys.shape[2] == first.keys.shape[2]
                   and c.keys.dtype == first.keys.dtype and c.keys.device == first.keys.device for c in caches)

    @classmethod
    def of(cls, caches: list[KeptTokens], room: int, scratch: dict | None = None) -> "KeptBatch":
        """The batch of `caches` (holds(caches)), with room for `room` more
        tokens each before it has to grow; scratch: workspaces to share with
        other batches attending one after another (a model's layers)."""
        counts = [c.tokens for c in caches]
        first = caches[0].keys
        kv_heads, _, head_dim = first.shape
        capacity = _aligned(max(counts) + max(room, 1))
        keys = first.new_zeros(len(caches), kv_heads, capacity, head_dim)
        values = torch.zeros_like(keys)
        for b, (cache, n) in enumerate(zip(caches, counts)):
            keys[b, :, :n], values[b, :, :n] = cache.keys, cache.values
            cache.keys, cache.values = keys[b, :, :n], values[b, :, :n]  # its own copy can go at once
        return cls(caches, keys, values, counts, scratch=scratch if scratch is not None else {})

    def _index(self) -> None:
        """Each sequence's next slot, which is also the count it holds, on
        the device (as scatter_ takes it, [B, kv_heads, 1, d]), so that a
        step replayed from a CUDA graph (no Python runs) still moves it; and
        the column numbers a mask compares it with."""
        batch, kv_heads, capacity, head_dim = self.keys.shape
        counts = torch.tensor(self.counts, device=self.keys.device)
        self._next = counts.view(batch, 1, 1, 1).expand(batch, kv_heads, 1, head_dim) + self.steps
        self._columns = torch.arange(capacity, device=self.keys.device).view(1, 1, 1, capacity)

    def _point_caches(self) -> None:
        """Each cache's K and V as views of the padded tensors, so that no
        other copy of its tokens stays alive."""
        for b, (cache, n) in enumerate(zip(self.caches, self.counts)):
            cache.keys, cache.values = self.keys[b, :, :n], self.values[b, :, :n]

    def _grow(self) -> None:
        """An eighth more capacity (at least GROWTH tokens), the held tokens
        copied over: a few copies for a long generation, little memory held
        unused for a large cache."""
        capacity = _aligned(self.capacity + max(self.capacity // 8, GROWTH))
        keys = self.keys.new_zeros(*self.keys.shape[:2], capacity, self.keys.shape[3])
        values = torch.zeros_like(keys)
        keys[:, :, :self.capacity], values[:, :, :self.capacity] = self.keys, self.values
        self.keys, self.values = keys, values
        self._gather = None
        self._index()
        self._point_caches()

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def append(self, k_t: torch.Tensor, v_t: torch.Tensor) -> None:
        """Each sequence's new token, k_t and v_t [B, kv_heads, 1, d], after its held ones."""
        if self._longest + self.steps >= self.capacity:
            self._grow()
        self.keys.scatter_(2, self._next, k_t if k_t.dtype == self.keys.dtype else k_t.to(self.keys.dtype))
        self.values.scatter_(2, self._next, v_t if v_t.dtype == self.values.dtype else v_t.to(self.values.dtype))
        self._next += 1
        self.steps += 1

    def decode(self, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor) -> torch.Tensor:
        """One step (Method.decode_batch): append, then attend."""
        self.append(k_t, v_t)
        return self.attend(q_t)

    def attend(self, q_t: torch.Tensor, backend: str = "auto") -> torch.Tensor:
        """Each sequence's query q_t [B, heads, 1, d] over its held tokens:
        [B, heads, 1, d] in q's dtype. With the Triton kernel (ops.common.
        use_triton: on CUDA by default) gather_decode reads each sequence's
        held rows in place, split over the keys (the capacity sets the
        split count, so a step's launch is the same every step); else SDPA
        under a mask, a kv head's query heads as the rows of one query
        (heads h of group g are consecutive), so GQA reads each key once
        and copies nothing."""
        if use_triton(backend, self.keys.device):
            return self._gather_decode(q_t)
        batch, heads, _, head_dim = q_t.shape
        rows = q_t.reshape(batch, self.keys.shape[1], heads // self.keys.shape[1], head_dim)
        if rows.dtype != self.keys.dtype:
            rows = rows.to(self.keys.dtype)
        held = self._columns < self._next[:, :1, :, :1]  # [B, 1, 1, capacity]
        out = F.scaled_dot_product_attention(rows, self.keys, self.values, attn_mask=held)
        out = out.reshape(batch, heads, 1, head_dim)
        return out if out.dtype == q_t.dtype else out.to(q_t.dtype)

    def _gather_decode(self, q_t: torch.Tensor) -> torch.Tensor:
        batch, kv_heads, capacity, _ = self.keys.shape
        if self._gather is None:
            device = self.keys.device
            splits = split_count(capacity, batch * kv_heads, splitk.sm_count(device))
            key = ("gather_decode", tuple(q_t.shape), q_t.device, splits)
            if key not in self.scratch:
                self.scratch[key] = gather_decode.make_workspace(q_t, splits)
            # Every row is visible (position 0 against query position 0); the count says how many are held.
            self._gather = (torch.zeros((batch, 1), dtype=torch.int32, device=device),
                            torch.zeros((batch, capacity), dtype=torch.int32, device=device),
                            torch.arange(capacity, dtype=torch.int32, device=device).expand(batch, kv_heads, -1),
                            splits, self.scratch[key])
        q_pos, pos, index, splits, workspace = self._gather
        held = self._next[:, :, 0, 0]  # [B, kv_heads]: the next slot is the count held
        return gather_decode.gather_decode(q_t, q_pos, self.keys, self.values, pos, index, held, num_splits=splits,
                                           workspace=workspace, check_values=False).out

    def replayed(self, steps: int) -> None:
        """Count `steps` steps that ran without this object's Python (replays
        of a captured step: the device's counters moved, steps did not), or
        with a negative count, one that ran only in Python (a capture)."""
        self.steps += steps
        if self._longest + self.steps > self.capacity:
            raise RuntimeError(f"{self.steps} steps overran the batch's capacity of {self.capacity} tokens: a "
                               f"captured step cannot grow it (reserve room for every step)")

    def write_back(self) -> None:
        """Leave every cache as appending each step's token to it alone
        would have, in compact tensors of its own. Ends the batch: a later
        step makes a new one."""
        for b, cache in enumerate(self.caches):
            n = self.counts[b] + self.steps
            cache.keys, cache.values = self.keys[b, :, :n].clone(), self.values[b, :, :n].clone()
            kv_heads = cache.positions.shape[0]
            steps = torch.arange(cache.seen, cache.seen + self.steps, dtype=cache.positions.dtype,
                                 device=cache.positions.device)
            cache.positions = torch.cat([cache.positions, steps.expand(kv_heads, -1)], dim=1)
            cache.seen += self.steps
        self.caches, self.keys, self.values, self._gather = [], None, None, None
