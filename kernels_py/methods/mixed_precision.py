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
which dequantizes, on CPU: see the backend knob). The keys and values
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
from kernels_py.methods.sparse_prefill import flops_saved, prefill_error, sparse_prefill
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
        return cls({}, k[:, :0], v[:, :0], none, tokens, tokens, group, backend)

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
        [kv_heads, count, d] and positions [count]."""
        k, v, pos = self.dense_k[:, :count], self.dense_v[:, :count], self.dense_positions[:count]
        self.dense_k, self.dense_v = self.dense_k[:, count:], self.dense_v[:, count:]
        self.dense_positions = self.dense_positions[count:]
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
            segments = [self._empty_segment(q_t.device)]
        result = quant_decode.compute(q, q_pos, segments, dense, backend=self.backend)
        return quant_decode.QuantDecodeOutput(result.out.reshape(heads, 1, head_dim), result.lse.reshape(heads, 1))

    def _empty_segment(self, device) -> QuantKV:
        kv, d, g = self.kv_heads, self.head_dim, self.group
        z = torch.zeros((kv, 1, g, d), dtype=torch.float16, device=device)
        pos = torch.full((kv, g), PAD_POS, dtype=torch.int32, device=device)
        return kv_quant.reference.quantize(z, z, pos, torch.zeros(kv, dtype=torch.int32, device=device), bits=2,
                                           group=g)

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
        "only. Either way its attention FLOPs saved and output error per layer", ref="ZipVL section 4.2")
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
            if self.sparse_prefill:
                every, important = prefill_error(q[layer], k[layer], v[layer], top)
                cache.notes.update(sparse_prefill_flops_saved=flops_saved(prompt.tokens, count),
                                   sparse_prefill_error=every, sparse_prefill_error_important=important)
            caches.append(cache)
        return caches

    def prefill_attention(self, layer, q, k, v, spans):
        """With sparse_prefill, inside a model: the layer's important tokens
        (chosen from its own probe rows, as prefill_all chooses them) attend
        among themselves and the others' outputs are zeros (ZipVL section 4.2)."""
        if not self.sparse_prefill:
            return None
        prompt = Prompt([q], [k], [v], spans)
        count, scores = self._importance(prompt, 0)
        top, _ = split_by_importance(scores, count)
        return sparse_prefill(q, k, v, top)

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
        groups; with sparse_prefill, sparse_prefill_flops_saved,
        sparse_prefill_error (relative, over every row of the layer's output,
        the zeroed ones included, against full prefill attention on the same
        Q/K/V) and sparse_prefill_error_important (at the important rows
        only)."""
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
            **{name: cache.notes[name] for name in ("sparse_prefill_flops_saved", "sparse_prefill_error",
                                                    "sparse_prefill_error_important") if name in cache.notes},
        }


def fixed_count(share: float, tokens: int) -> int:
    """ceil(share * tokens), within [0, tokens]."""
    return min(tokens, max(0, math.ceil(round(share * tokens, 9))))
