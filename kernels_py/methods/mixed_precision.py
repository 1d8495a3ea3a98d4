"""Quantized KV as a cache representation: tokens held as 2- or 4-bit codes
(ops.kv_quant layout: keys per channel, values per token, fp16 scales and
zeros) in up to two segments of one bit width each, plus the newest tokens
in the cache dtype until they are quantized. ZipVL keeps its important
tokens in a high-bit segment and the others in a low-bit one; KIVI keeps all
in one segment behind a full-precision window of recent tokens.

Each kv head may hold different tokens in a segment (ZipVL picks its
important tokens per kv head), so the layout's sequence axis is the kv head
(B = kv heads, one kv head each); every kv head holds the same number. A
segment grows by whole groups of G slots: tokens join in batches (a block
reassessed, a window flushed), each padded to whole groups with padding
slots (kv_quant.PAD_POS) that are never attended and cost their codes'
bytes, which `nbytes` counts.

Decoding runs the quantized decode op (ops.quant_decode; its reference,
which dequantizes, on CPU: see the backend knob). Inside a model, a batch's
caches of one layer decode together (QuantBatch: one op call a step for
every sequence) except on the steps that requantize. The keys and values
attention sees are dequantized only when someone asks for them (`keys`,
`values`: metrics and tests).
"""

import math
from abc import abstractmethod
from dataclasses import dataclass, field

import torch

from kernels_py.attention import group_sum
from kernels_py.methods.base import Method, backend_knob
from kernels_py.methods.prompt import ProbeRows, Prompt
from kernels_py.methods.scorers import AttentionMass
from kernels_py.methods.sparse_prefill import flops_saved, flops_saved_net, prefill_error, sparse_prefill
from kernels_py.metrics import tensor_bytes
from kernels_py.ops import kv_quant, quant_decode
from kernels_py.ops.kv_quant import PAD_POS, QuantKV
from kernels_py.params import Rule, knob


@dataclass
class MixedPrecisionCache:
    segments: dict[int, QuantKV]  # by bit width (at most two)
    dense_k: torch.Tensor  # [kv_heads, S, d] as the model caches them
    dense_v: torch.Tensor
    dense_positions: torch.Tensor  # [S] int64
    seen: int
    prompt_tokens: int
    group: int
    backend: str
    notes: dict[str, float] = field(default_factory=dict)
    _view: tuple | None = field(default=None, repr=False)

    @classmethod
    def empty(cls, k: torch.Tensor, v: torch.Tensor, group: int, backend: str) -> "MixedPrecisionCache":
        """A cache after a prompt of k, v [kv_heads, T, d] with nothing in it yet."""
        kv_heads, tokens, head_dim = k.shape
        kv_quant.check_params(2, group, head_dim)
        none = torch.zeros(0, dtype=torch.int64, device=k.device)
        # Empty tensors of their own: an empty view (k[:, :0]) would keep the whole prompt's K and V alive
        # while nbytes counts nothing for them.
        return cls({}, k.new_empty(kv_heads, 0, head_dim), v.new_empty(kv_heads, 0, head_dim), none, tokens, tokens,
                   group, backend)

    @property
    def kv_heads(self) -> int:
        return self.dense_k.shape[0]

    @property
    def head_dim(self) -> int:
        return self.dense_k.shape[2]

    @property
    def quantized_tokens(self) -> dict[int, int]:
        """Tokens each kv head holds per bit width (padding not counted)."""
        return {bits: int((seg.pos[0] != PAD_POS).sum()) for bits, seg in sorted(self.segments.items())}

    @property
    def tokens(self) -> int:
        return sum(self.quantized_tokens.values()) + self.dense_positions.shape[0]

    @property
    def nbytes(self) -> int:
        """Packed codes, fp16 scales and zeros of every segment (padding slots
        included) and the unquantized K/V; positions are not counted, as for
        the other caches."""
        return sum(seg.nbytes for seg in self.segments.values()) + tensor_bytes(self.dense_k, self.dense_v)

    # --- what changes ------------------------------------------------------------------------------

    def add(self, bits: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Quantize tokens into the `bits` segment: k, v [kv_heads, n, d],
        positions [kv_heads, n] int (each kv head its own tokens, as many)."""
        kv_heads, n, head_dim = k.shape
        if n == 0:
            return
        slots = -(-n // self.group) * self.group
        pad = slots - n
        k = torch.nn.functional.pad(k, (0, 0, 0, pad))[:, None]  # [kv_heads (as sequences), 1, slots, d]
        v = torch.nn.functional.pad(v, (0, 0, 0, pad))[:, None]
        pos = torch.nn.functional.pad(positions.to(torch.int64), (0, pad), value=PAD_POS).to(torch.int32)
        length = torch.full((kv_heads,), slots, dtype=torch.int32, device=k.device)
        seg = kv_quant.compute_quantize(k, v, pos, length, bits=bits, group=self.group, backend=self.backend)
        self.segments[bits] = kv_quant.concat(self.segments[bits], seg) if bits in self.segments else seg
        self._view = None

    def append(self, k_t: torch.Tensor, v_t: torch.Tensor) -> None:
        """The generated token ([kv_heads, 1, d]) joins the unquantized tokens at position `seen`."""
        self.dense_k = torch.cat([self.dense_k, k_t.to(self.dense_k.dtype)], dim=1)
        self.dense_v = torch.cat([self.dense_v, v_t.to(self.dense_v.dtype)], dim=1)
        position = torch.tensor([self.seen], dtype=torch.int64, device=self.dense_positions.device)
        self.dense_positions = torch.cat([self.dense_positions, position])
        self.seen += 1
        self._view = None

    def take_dense(self, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Remove the `count` oldest unquantized tokens; returns their k, v
        [kv_heads, count, d] and positions [count]. The tokens left are
        copied into tensors of their own, so the removed ones' memory is
        freed (a view of the rest would hold all of it)."""
        k, v, pos = self.dense_k[:, :count], self.dense_v[:, :count], self.dense_positions[:count]
        self.dense_k, self.dense_v = self.dense_k[:, count:].clone(), self.dense_v[:, count:].clone()
        self.dense_positions = self.dense_positions[count:].clone()
        self._view = None
        return k, v, pos

    # --- attention ---------------------------------------------------------------------------------

    def attend(self, q_t: torch.Tensor) -> quant_decode.QuantDecodeOutput:
        """The decode op for one query token q_t [heads, 1, d]: out [heads, 1, d]
        and lse [heads, 1] (each kv head is a sequence of the op)."""
        heads, _, head_dim = q_t.shape
        kv = self.kv_heads
        q = q_t.reshape(kv, heads // kv, 1, head_dim)
        q_pos = torch.full((kv, 1), self.seen - 1, dtype=torch.int64, device=q_t.device)
        slots = self.dense_positions.shape[0]
        dense = quant_decode.DenseKV(self.dense_k[:, None], self.dense_v[:, None],
                                     self.dense_positions.expand(kv, slots),
                                     torch.full((kv,), slots, dtype=torch.int64, device=q_t.device))
        segments = [self.segments[bits] for bits in sorted(self.segments, reverse=True)]
        if not segments:  # nothing quantized yet: an empty segment keeps the op's contract
            segments = [_empty(kv, self.head_dim, 2, self.group, self.group, q_t.device)]
        result = quant_decode.compute(q, q_pos, segments, dense, backend=self.backend)
        return quant_decode.QuantDecodeOutput(result.out.reshape(heads, 1, head_dim), result.lse.reshape(heads, 1))

    # --- reconstruction, for metrics ---------------------------------------------------------------

    def _effective(self):
        """K, V [kv_heads, n, d] float32 dequantized, positions [kv_heads, n], in position order."""
        if self._view is None:
            keys, values, positions = [], [], []
            for seg in self.segments.values():
                k, v = kv_quant.reference.dequantize(seg)  # [kv_heads, 1, slots, d]
                real = seg.pos[0] != PAD_POS  # every kv head pads the same slots
                keys.append(k[:, 0, real])
                values.append(v[:, 0, real])
                positions.append(seg.pos[:, real].to(torch.int64))
            keys.append(self.dense_k.float())
            values.append(self.dense_v.float())
            positions.append(self.dense_positions.expand(self.kv_heads, -1))
            k, v, pos = torch.cat(keys, 1), torch.cat(values, 1), torch.cat(positions, 1)
            order = pos.argsort(dim=1)
            gather = order[..., None].expand(-1, -1, k.shape[-1])
            self._view = k.gather(1, gather), v.gather(1, gather), pos.gather(1, order)
        return self._view

    @property
    def keys(self) -> torch.Tensor:
        return self._effective()[0]

    @property
    def values(self) -> torch.Tensor:
        return self._effective()[1]

    @property
    def positions(self) -> torch.Tensor:
        return self._effective()[2]


GROWTH = 128  # waiting slots a QuantBatch grows by at least, once out of room


def _empty(kv_heads: int, head_dim: int, bits: int, group: int, slots: int, device) -> QuantKV:
    """A segment of kv_heads sequences holding nothing: `slots` padding slots, length 0."""
    want = kv_quant.shapes(kv_heads, 1, slots, head_dim, bits, group)
    made = {name: torch.zeros(shape, dtype=torch.int32 if name.endswith("codes") else torch.float16, device=device)
            for name, shape in want.items() if name not in ("pos", "length")}
    return QuantKV(**made, pos=torch.full(want["pos"], PAD_POS, dtype=torch.int32, device=device),
                   length=torch.zeros(kv_heads, dtype=torch.int32, device=device), bits=bits, group=group)


def _sequence_views(seg: QuantKV, lo: int, hi: int, slots: int) -> QuantKV:
    """Sequences [lo, hi) of a segment and their first `slots` slots, as views."""
    p, g = kv_quant.contract.per_word(seg.bits), seg.group
    return QuantKV(seg.k_codes[lo:hi, :, :slots // p], seg.k_scale[lo:hi, :, :slots // g],
                   seg.k_zero[lo:hi, :, :slots // g], seg.v_codes[lo:hi, :, :slots // p],
                   seg.v_scale[lo:hi, :, :slots], seg.v_zero[lo:hi, :, :slots], seg.pos[lo:hi, :slots],
                   seg.length[lo:hi], seg.bits, seg.group)


def _compact(seg: QuantKV) -> QuantKV:
    """A segment in tensors of its own (contiguous copies of views)."""
    return QuantKV(*(getattr(seg, f).clone(memory_format=torch.contiguous_format)
                     for f in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "pos", "length")),
                   seg.bits, seg.group)


@dataclass
class QuantBatch:
    """One layer's MixedPrecisionCache of every sequence of a batch, decoded
    together (Method.decode_batch): each bit width's segments stacked into
    one segment of B x kv_heads sequences (kv_quant.stack, padded to the
    longest; a sequence without that width holds nothing there) and the
    waiting tokens in one padded tensor with room for the steps to come, so
    that a step writes the batch's new tokens in place (three scatters) and
    runs the quantized decode op once, where each sequence alone would
    concatenate its waiting tokens and call it (a dozen launches a sequence
    and layer).

    Only for steps that append and attend: a step after which a sequence
    would hold `requantize_at` waiting tokens requantizes some of them (the
    method's own decode: ZipVL's period, KIVI's window and group), so decode
    then writes every cache back and returns None, and that step runs
    sequence by sequence. Nothing is stacked before the first step that
    decodes together. While it decodes, each cache holds views of the
    stacked segments and of its waiting tokens (no second copy of either);
    write_back leaves every one as its own decode would have."""

    caches: list[MixedPrecisionCache]
    requantize_at: int
    room: int

    def __post_init__(self):
        self.kv_heads = self.caches[0].kv_heads
        self.waiting = [c.dense_positions.shape[0] for c in self.caches]
        self._longest = max(self.waiting)
        self.steps = 0
        self.segments, self.keys, self.values, self.positions = [], None, None, None

    @staticmethod
    def holds(caches: list) -> bool:
        """Whether these caches (one per sequence) can decode together:
        MixedPrecisionCache of one layout (kv heads, head_dim, group, dtype,
        device, backend)."""
        first = caches[0]
        return all(type(c) is MixedPrecisionCache and c.kv_heads == first.kv_heads and c.head_dim == first.head_dim
                   and c.group == first.group and c.backend == first.backend and c.dense_k.dtype == first.dense_k.dtype
                   and c.dense_k.device == first.dense_k.device for c in caches)

    def _stack(self) -> None:
        """The stacked segments, the padded waiting tokens and the device
        counters a step moves."""
        first = self.caches[0]
        kv, d, device = self.kv_heads, first.head_dim, first.dense_k.device
        widths = sorted({bits for c in self.caches for bits in c.segments}, reverse=True)
        for bits in widths:  # the order MixedPrecisionCache.attend calls the op in
            held = [c.segments.get(bits) or _empty(kv, d, bits, c.group, 0, device) for c in self.caches]
            stacked = kv_quant.stack(held)
            for b, (cache, seg) in enumerate(zip(self.caches, held)):
                if bits in cache.segments:  # its own copy can go
                    cache.segments[bits] = _sequence_views(stacked, b * kv, (b + 1) * kv, seg.slots)
            self.segments.append(stacked)
        if not self.segments:  # nothing quantized yet: an empty segment keeps the op's contract
            self.segments = [_empty(kv * len(self.caches), d, 2, first.group, first.group, device)]
        # No more room than the steps before one requantizes.
        longest = self._longest
        self._make_dense(longest + max(1, min(self.room, self.requantize_at - 1 - longest)))
        self._slot = torch.tensor(self.waiting, device=device).repeat_interleave(kv)[:, None]  # [B x kv, 1]
        self._q_pos = torch.tensor([c.seen for c in self.caches], device=device).repeat_interleave(kv)[:, None]
        self._length = self._slot[:, 0].clone()

    def _make_dense(self, capacity: int) -> None:
        """The waiting tokens [B x kv_heads, 1, capacity, d] and their
        positions: each cache's own copied in (then held as views), or on
        growing, the batch's."""
        first = self.caches[0]
        kv, d = self.kv_heads, first.head_dim
        rows = kv * len(self.caches)
        keys = first.dense_k.new_zeros(rows, 1, capacity, d)
        values = torch.zeros_like(keys)
        positions = torch.zeros(rows, capacity, dtype=torch.int64, device=keys.device)
        if self.keys is not None:
            held = self.capacity
            keys[:, :, :held], values[:, :, :held], positions[:, :held] = self.keys, self.values, self.positions
        else:
            for b, (cache, n) in enumerate(zip(self.caches, self.waiting)):
                keys[b * kv:(b + 1) * kv, 0, :n] = cache.dense_k
                values[b * kv:(b + 1) * kv, 0, :n] = cache.dense_v
                positions[b * kv:(b + 1) * kv, :n] = cache.dense_positions
        self.keys, self.values, self.positions = keys, values, positions
        self._point_caches()

    def _point_caches(self) -> None:
        """Each cache's waiting tokens as views of the batch's (those it held
        when the batch was made), so that no other copy stays alive."""
        kv = self.kv_heads
        for b, (cache, n) in enumerate(zip(self.caches, self.waiting)):
            cache.dense_k, cache.dense_v = self.keys[b * kv:(b + 1) * kv, 0, :n], self.values[b * kv:(b + 1) * kv, 0, :n]
            cache.dense_positions = self.positions[b * kv, :n]

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def decode(self, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor) -> torch.Tensor | None:
        """One step: q_t [B, heads, 1, d], k_t and v_t [B, kv_heads, 1, d] ->
        the outputs [B, heads, 1, d], or None (every cache written back) if
        the step requantizes some sequence's waiting tokens."""
        if self._longest + self.steps + 1 >= self.requantize_at:
            self.write_back()
            return None
        if self.keys is None:
            self._stack()
        elif self._longest + self.steps >= self.capacity:
            self._make_dense(self.capacity + max(self.capacity // 8, GROWTH))
        batch, heads, _, head_dim = q_t.shape
        rows = batch * self.kv_heads
        slot = self._slot[:, :, None, None].expand(rows, 1, 1, head_dim)
        self.keys.scatter_(2, slot, k_t.reshape(rows, 1, 1, head_dim).to(self.keys.dtype))
        self.values.scatter_(2, slot, v_t.reshape(rows, 1, 1, head_dim).to(self.values.dtype))
        self.positions.scatter_(1, self._slot, self._q_pos)
        self._length += 1
        dense = quant_decode.DenseKV(self.keys, self.values, self.positions, self._length)
        q = q_t.reshape(rows, heads // self.kv_heads, 1, head_dim)
        out = quant_decode.compute(q, self._q_pos, self.segments, dense, backend=self.caches[0].backend).out
        self._slot += 1
        self._q_pos += 1
        self.steps += 1
        return out.reshape(batch, heads, 1, head_dim)

    def write_back(self) -> None:
        """Leave every cache as its own decode of each step would have, in
        tensors of its own. Ends the batch."""
        kv = self.kv_heads
        for b, cache in enumerate(self.caches if self.keys is not None else ()):
            n = self.waiting[b] + self.steps
            cache.dense_k = self.keys[b * kv:(b + 1) * kv, 0, :n].clone()
            cache.dense_v = self.values[b * kv:(b + 1) * kv, 0, :n].clone()
            cache.dense_positions = self.positions[b * kv, :n].clone()
            cache.segments = {bits: _compact(seg) for bits, seg in cache.segments.items()}
            cache.seen += self.steps
            cache._view = None
        self.caches, self.segments, self.keys, self.values, self.positions = [], [], None, None, None


def split_by_importance(scores: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per kv head, the indices of the `count` highest of scores [kv_heads, n]
    and of the others, each in index order: ([kv_heads, count], [kv_heads, n - count])."""
    n = scores.shape[1]
    order = scores.argsort(dim=1, descending=True, stable=True)
    top = order[:, :count].sort(dim=1).values
    rest = order[:, count:].sort(dim=1).values
    assert top.shape[1] + rest.shape[1] == n
    return top, rest


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [kv_heads, n, d], index [kv_heads, m] -> [kv_heads, m, d]."""
    return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))



# --- methods that keep important tokens at more bits (ZipVL, its fixed-ratio baseline) --------------


def bits_knob(default: int, which: str):
    return knob("int", default, f"bits of the {which} tokens' keys and values", choices=kv_quant.BITS,
                ref="ZipVL section 5.1")


def group_knob(default: int = 32):
    return knob("int", default, "quantization group: slots sharing a key scale (per channel), channels sharing a "
                "value scale (per token); must divide head_dim", choices=kv_quant.GROUPS)


@dataclass(frozen=True)
class ImportanceQuantized(Method):
    """Prefill: per layer, the important tokens (how many: `important_count`;
    which: per kv head, the highest normalized attention from the probe rows,
    Eq. 7) are quantized to high_bits, the others to low_bits. Decode: new
    tokens wait in the cache dtype; every `period` steps the block of them is
    scored by the last query's attention (its softmax over the whole cache),
    split the same way and quantized (Algorithm 1)."""

    probe_recent: int = knob("int", 64, "probe rows: the most recent prompt queries", min=0, max=65536,
                             ref="ZipVL appendix A")
    probe_random: int = knob("int", 64, "probe rows: prompt queries drawn at random before them", min=0, max=65536,
                             ref="ZipVL appendix A")
    probe_seed: int = knob("int", 0, "seed of the random probe rows", min=0, max=2**31 - 1)
    high_bits: int = bits_knob(4, "important")
    low_bits: int = bits_knob(2, "other")
    group: int = group_knob()
    period: int = knob("int", 100, "generated tokens that wait in the cache dtype before they are scored and "
                       "quantized", min=1, max=1 << 20, ref="ZipVL section 4.2, Algorithm 1")
    sparse_prefill: bool = knob(
        "bool", True, "token-level sparse prefill (attention among each layer's important tokens only, the others' "
        "outputs zeros): inside a live model (the vlm workload) the prefill runs so, and later layers' K/V and "
        "the cache come from it; on a replayed workload (synthetic, trace) the Q/K/V are given, so it is measured "
        "only. Either way its attention FLOPs saved and output errors per layer (sparse_prefill_metrics)",
        ref="ZipVL section 4.2")
    sparse_prefill_metrics: bool = knob(
        "bool", True, "with sparse_prefill, measure it per layer after the prefill: FLOPs saved, and output errors "
        "against full attention on the same Q/K/V (two float32 attentions a layer); false when timing",
        id_omits_default=True)
    backend: str = backend_knob("quantization and decode attention")

    RULES = (Rule("probe_recent + probe_random >= 1", "probe_recent + probe_random must be at least 1"),
             Rule("high_bits >= low_bits", "high_bits ({high_bits}) must be at least low_bits ({low_bits})"))

    @abstractmethod
    def important_count(self, accumulated: torch.Tensor) -> int:
        """How many of n tokens are important, from their accumulated
        attention [n] (summed over query heads and rows)."""

    @property
    def _rows(self) -> ProbeRows:
        return ProbeRows(self.probe_recent, self.probe_random, self.probe_seed)

    def prefill_all(self, q, k, v, spans) -> list[MixedPrecisionCache]:
        prompt = Prompt(q, k, v, spans)
        caches = []
        for layer in range(prompt.layers):
            count, scores = self._importance(prompt, layer)
            cache = MixedPrecisionCache.empty(k[layer], v[layer], self.group, self.backend)
            positions = torch.arange(prompt.tokens, device=k[layer].device).expand(cache.kv_heads, -1)
            top = self._quantize_split(cache, k[layer], v[layer], positions, scores, count)
            cache.notes.update(important_ratio=count / prompt.tokens,
                               probe_rows=float(prompt.rows(self._rows).numel()))
            if self.sparse_prefill and self.sparse_prefill_metrics:
                error = prefill_error(q[layer], k[layer], v[layer], top)
                cache.notes.update(
                    sparse_prefill_flops_saved=flops_saved(prompt.tokens, count),
                    sparse_prefill_flops_saved_net=flops_saved_net(prompt.tokens, count, prompt.rows(self._rows)),
                    sparse_prefill_error=error.every, sparse_prefill_error_important=error.important,
                    sparse_prefill_error_last=error.last)
            caches.append(cache)
        return caches

    def prefill_attention(self, layer, q, k, v, spans):
        """With sparse_prefill, inside a model: the layer's important tokens
        (chosen from its own probe rows, as prefill_all chooses them) attend
        among themselves and the others' outputs are zeros (ZipVL section 4.2)."""
        if not self.sparse_prefill:
            return None
        return sparse_prefill(q, k, v, self.important_tokens(Prompt([q], [k], [v], spans), 0))

    def important_tokens(self, prompt: Prompt, layer: int) -> torch.Tensor:
        """The layer's important tokens per kv head, [kv_heads, count] in index
        order: the count of Eq. 6, the highest scores of Eq. 7."""
        count, scores = self._importance(prompt, layer)
        return split_by_importance(scores, count)[0]

    def _importance(self, prompt: Prompt, layer: int) -> tuple[int, torch.Tensor]:
        """How many tokens of the layer are important (Eq. 6) and every token's
        score per kv head (Eq. 7: normalized probe attention)."""
        stats = prompt.stats(layer, self._rows, backend=self.backend)
        scorer = AttentionMass(self._rows, normalize=True, backend=self.backend)
        return self.important_count(stats.attn_sum.sum(dim=0)), scorer.prefill(prompt, layer)

    def decode(self, layer, cache: MixedPrecisionCache, q_t, k_t, v_t) -> torch.Tensor:
        if not isinstance(cache, MixedPrecisionCache):
            raise TypeError(f"{self.owner_name()}: decode needs the cache its prefill built, got "
                            f"{type(cache).__name__}")
        self.check_step(layer, cache, q_t, k_t, v_t)
        cache.append(k_t, v_t)
        result = cache.attend(q_t)
        waiting = cache.dense_positions.shape[0]
        if waiting >= self.period:
            heads, kv = q_t.shape[0], cache.kv_heads
            k_block = cache.dense_k.float().repeat_interleave(heads // kv, dim=0)  # [heads, n, d]
            logits = (k_block @ q_t.float().transpose(1, 2))[..., 0] * cache.head_dim ** -0.5  # [heads, n]
            weights = torch.exp(logits - result.lse)  # this step's softmax over the whole cache
            count = self.important_count(weights.sum(dim=0))
            k, v, pos = cache.take_dense(waiting)
            # One query row: Eq. 7's normalisation by the count of rows that see a token is 1.
            self._quantize_split(cache, k, v, pos.expand(kv, -1), group_sum(weights, kv), count)
            ratios = cache.notes.get("block_ratios_sum", 0.0) + count / waiting
            cache.notes.update(block_ratios_sum=ratios, blocks=cache.notes.get("blocks", 0.0) + 1)
        return result.out

    def decode_batch(self, caches, room, scratch):
        """QuantBatch where the caches allow it and a step can append without
        requantizing (period above 1); not for a subclass's own decode,
        which may do more than QuantBatch knows."""
        if type(self).decode is not ImportanceQuantized.decode or self.period < 2 or not QuantBatch.holds(caches):
            return None
        return QuantBatch(caches, self.period, room)

    def _quantize_split(self, cache, k, v, positions, scores, count) -> torch.Tensor:
        """Quantize the top `count` tokens of each kv head by `scores` to high_bits,
        the rest to low_bits; returns the top indices [kv_heads, count]."""
        top, rest = split_by_importance(scores, count)
        for bits, index in ((self.high_bits, top), (self.low_bits, rest)):
            cache.add(bits, gather_tokens(k, index), gather_tokens(v, index), positions.gather(1, index))
        return top

    def layer_metrics(self, layer, cache: MixedPrecisionCache) -> dict[str, float]:
        """important_ratio: the prefill's share of important tokens (Eq. 6);
        block_important_ratio: the same for the decode blocks reassessed (mean;
        0 if none was); high_bit_tokens / low_bit_tokens / dense_tokens a kv
        head holds; padding_slots: slots that pad its segments to whole
        groups; with sparse_prefill (and its metrics),
        sparse_prefill_flops_saved (and _net, less the probe rows' attention;
        sparse_prefill.py says how they are counted), sparse_prefill_error
        (relative, over every row of the layer's output, the zeroed ones
        included, against full prefill attention on the same Q/K/V),
        sparse_prefill_error_important (at the important rows only) and
        sparse_prefill_error_last (at the last prompt row, which predicts the
        first generated token: 1 where no kv head keeps it as important)."""
        held = cache.quantized_tokens
        slots = sum(seg.slots for seg in cache.segments.values())
        blocks = cache.notes.get("blocks", 0.0)
        return {
            "important_ratio": cache.notes["important_ratio"],
            "probe_rows": cache.notes["probe_rows"],
            "block_important_ratio": cache.notes.get("block_ratios_sum", 0.0) / blocks if blocks else 0.0,
            "high_bit_tokens": float(held.get(self.high_bits, 0) if self.high_bits != self.low_bits
                                     else sum(held.values())),
            "low_bit_tokens": float(held.get(self.low_bits, 0) if self.high_bits != self.low_bits else 0),
            "dense_tokens": float(cache.dense_positions.shape[0]),
            "padding_slots": float(slots - sum(held.values())),
            **{name: cache.notes[name] for name in ("sparse_prefill_flops_saved", "sparse_prefill_flops_saved_net",
                                                    "sparse_prefill_error", "sparse_prefill_error_important",
                                                    "sparse_prefill_error_last") if name in cache.notes},
        }


def fixed_count(share: float, tokens: int) -> int:
    """ceil(share * tokens), within [0, tokens]."""
    return min(tokens, max(0, math.ceil(round(share * tokens, 9))))
