"""The KV quantization op's contract: how a segment of quantized keys and
values is laid out in memory, and its checks.

Keys are quantized per channel (the values of one channel over a group of G
consecutive slots share a scale and a zero point) and values per token (G
consecutive channels of one token share them). This is KIVI's choice, and
ZipCache's, the predecessor whose scheme ZipVL builds on (ZipVL publishes no
code): key outliers sit in a few fixed channels, so per-channel ranges keep
them from inflating every token's scale, while a value error spreads over
the whole output row its token is mixed into, so values keep per-token
ranges. Asymmetric min/max: zero = min, scale = (max - min) / (2^b - 1), both
fp16; code = floor((x - zero) / scale + 1/2) clamped to [0, 2^b - 1];
x ~= code * scale + zero. The error of an element is at most scale / 2 plus
the fp16 rounding of scale and zero.

Layout of a segment of T slots (T a multiple of G) for B sequences, H kv
heads, head_dim D, b bits and P = 32 / b codes per int32 word:

  k_codes, v_codes  int32 [B, H, T / P, D]  keys and values packed alike:
           word (w, half * D/2 + j) holds the P/2 slots w*P + half*P/2 + i
           (i < P/2) of the channel pair 2j, 2j + 1; channel 2j's code at
           bits [i*b, (i+1)*b), channel 2j + 1's 16 bits higher
  k_scale, k_zero  fp16 [B, H, T / G, D]  one pair per (group of slots, channel)
  v_scale, v_zero  fp16 [B, H, T, D / G]  one pair per (slot, group of channels)
  pos      int32 [B, T]  the absolute position of each slot's token;
           PAD_POS marks a padding slot (never attended, codes 0);
           quantize takes int32 or int64 positions, which must fit int32
  length   int [B]  slots in use, a multiple of G (appends fill whole groups,
           padding the last one)

A word's two 16-bit halves hold neighbouring channels of one slot, the pair
an fp16 MMA operand register holds, so a decode kernel makes a word's P/2
channel pairs with a mask and an OR each and a shift a run of fields (the
magic-number trick, kv_quant.kernel._scaled_pairs and copy_fields) and never
reorders a code. How codes are packed
is independent of how their ranges are grouped (keys per channel, values
per token). A decode kernel reads a tile of BLOCK_N slots (a multiple of P)
that starts on a key group, or lies inside one, as BLOCK_N / P rows of D
contiguous words for its keys and as many for its values, and a row of key
scales and zeros for each group it covers. Tokens of one bit width live in
one segment, so every tile has one bit width; a mixed-precision cache is
several segments (ZipVL: important tokens in a 4-bit one, the others in a
2-bit one).
"""

from dataclasses import dataclass, fields

import torch

BITS = (2, 4)
GROUPS = (32, 64, 128)
PAD_POS = 2**31 - 1


@dataclass(frozen=True)
class QuantKV:
    """One segment of quantized keys and values (layout above)."""

    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    pos: torch.Tensor
    length: torch.Tensor
    bits: int
    group: int

    @property
    def slots(self) -> int:
        return self.pos.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k_codes.shape[3]

    @property
    def kv_heads(self) -> int:
        return self.k_codes.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held: packed codes, fp16 scales and zeros. Positions are not
        counted, as no method's are (README: what compression_ratio counts)."""
        return sum(t.numel() * t.element_size() for t in (self.k_codes, self.k_scale, self.k_zero, self.v_codes,
                                                          self.v_scale, self.v_zero))

    def to(self, device) -> "QuantKV":
        return QuantKV(*(getattr(self, f.name).to(device) if isinstance(getattr(self, f.name), torch.Tensor)
                         else getattr(self, f.name) for f in fields(self)))


def per_word(bits: int) -> int:
    return 32 // bits


def check_params(bits, group, head_dim: int) -> None:
    """Raise ValueError for a bit width or group size the layout does not take
    (each a Python int: a float or a tensor equal to one would reach the
    kernels as a constexpr of the wrong type)."""
    if type(bits) is not int or bits not in BITS:
        raise ValueError(f"bits={bits!r} is not supported: KV codes are {' or '.join(map(str, BITS))} bits (an int)")
    if type(group) is not int or group not in GROUPS:
        raise ValueError(f"group={group!r} must be one of {list(GROUPS)} (an int)")
    if head_dim < 1:
        raise ValueError(f"head_dim must be at least 1, got {head_dim}")
    if head_dim % group:
        fits = [g for g in GROUPS if head_dim % g == 0]
        hint = f"pick one that divides it: {fits}" if fits else \
            f"no supported group ({list(GROUPS)}) divides {head_dim}, so this head_dim cannot be quantized"
        raise ValueError(f"group={group} does not divide head_dim={head_dim}: values are quantized per token in "
                         f"groups of channels; {hint}")


def shapes(batch: int, kv_heads: int, slots: int, head_dim: int, bits: int, group: int) -> dict[str, tuple]:
    """The shape of every tensor of a segment."""
    p = per_word(bits)
    return {"k_codes": (batch, kv_heads, slots // p, head_dim), "k_scale": (batch, kv_heads, slots // group, head_dim),
            "k_zero": (batch, kv_heads, slots // group, head_dim), "v_codes": (batch, kv_heads, slots // p, head_dim),
            "v_scale": (batch, kv_heads, slots, head_dim // group),
            "v_zero": (batch, kv_heads, slots, head_dim // group),
            "pos": (batch, slots), "length": (batch,)}


def check_segment(seg: QuantKV, name: str = "segment", check_values: bool = True) -> None:
    """Raise ValueError / TypeError naming what is wrong with a segment."""
    if not isinstance(seg, QuantKV):
        raise TypeError(f"{name} must be a QuantKV, got {type(seg).__name__}")
    if seg.k_codes.dim() != 4:
        raise ValueError(f"{name}.k_codes must be [batch, kv_heads, slots / codes per word, head_dim], got shape "
                         f"{tuple(seg.k_codes.shape)}")
    check_params(seg.bits, seg.group, seg.head_dim)
    batch, kv_heads, _, head_dim = seg.k_codes.shape
    if seg.pos.dim() != 2 or seg.pos.shape[0] != batch:
        raise ValueError(f"{name}.pos must be [batch={batch}, slots], got {tuple(seg.pos.shape)}")
    slots = seg.pos.shape[1]
    if slots % seg.group:
        raise ValueError(f"{name} has {slots} slots, not a multiple of its group size {seg.group}")
    want = shapes(batch, kv_heads, slots, head_dim, seg.bits, seg.group)
    for field, dtypes in (("k_codes", (torch.int32,)), ("k_scale", (torch.float16,)), ("k_zero", (torch.float16,)),
                          ("v_codes", (torch.int32,)), ("v_scale", (torch.float16,)), ("v_zero", (torch.float16,)),
                          ("pos", (torch.int32,)), ("length", (torch.int32, torch.int64))):
        t = getattr(seg, field)
        if tuple(t.shape) != want[field]:
            raise ValueError(f"{name}.{field} must have shape {want[field]} for {slots} slots of {seg.bits}-bit codes "
                             f"in groups of {seg.group}, got {tuple(t.shape)}")
        if t.dtype not in dtypes:
            raise TypeError(f"{name}.{field} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
        if t.device != seg.pos.device:
            raise ValueError(f"{name}.{field} is on {t.device}, {name}.pos on {seg.pos.device}")
    for scale, zero in (("k_scale", "k_zero"), ("v_scale", "v_zero")):
        # The kernels address a zero with its scale's strides (one set of strides for the pair).
        s, z = getattr(seg, scale), getattr(seg, zero)
        if s.numel() and any(a != b for a, b, n in zip(s.stride(), z.stride(), s.shape) if n > 1):
            raise ValueError(f"{name}.{zero} has strides {z.stride()} and {name}.{scale} {s.stride()}: the kernels read "
                             f"both with the scale's strides, so they must be laid out alike (make both "
                             f".contiguous())")
    if check_values and batch and (((seg.length < 0) | (seg.length > slots) | (seg.length % seg.group != 0)).any()):
        raise ValueError(f"{name}.length must be whole groups of {seg.group} slots within [0, {slots}], "
                         f"got {seg.length.tolist()}")


def concat(a: QuantKV, b: QuantKV) -> QuantKV:
    """The slots of a then b as one segment (the same bits, group, sequences
    and kv heads): whole groups append without requantizing anything. Each
    sequence's slots in use must be all of a's, so length adds up."""
    if (a.bits, a.group, a.kv_heads, a.head_dim, a.pos.shape[0]) != (b.bits, b.group, b.kv_heads, b.head_dim,
                                                                     b.pos.shape[0]):
        raise ValueError(f"cannot concatenate a {a.bits}-bit segment in groups of {a.group} with a {b.bits}-bit one "
                         f"in groups of {b.group} (or their sequences, kv heads or head_dim differ)")
    if (a.length != a.slots).any():
        raise ValueError(f"cannot append to a segment whose slots are not all in use (length {a.length.tolist()} of "
                         f"{a.slots} slots): b's tokens would land past its length")
    return QuantKV(torch.cat([a.k_codes, b.k_codes], 2), torch.cat([a.k_scale, b.k_scale], 2),
                   torch.cat([a.k_zero, b.k_zero], 2), torch.cat([a.v_codes, b.v_codes], 2),
                   torch.cat([a.v_scale, b.v_scale], 2), torch.cat([a.v_zero, b.v_zero], 2),
                   torch.cat([a.pos, b.pos], 1), a.length + b.length, a.bits, a.group)


def stack(segments: list[QuantKV]) -> QuantKV:
    """The sequences of several segments (the same bits, group, kv heads and
    head_dim) as one segment, in order: each padded to the most slots with
    padding slots (codes, scales and zeros 0, position PAD_POS), its length
    kept, so that sequences of different lengths attend in one call."""
    first = segments[0]
    for seg in segments:
        if (seg.bits, seg.group, seg.kv_heads, seg.head_dim) != (first.bits, first.group, first.kv_heads,
                                                                 first.head_dim):
            raise ValueError(f"cannot stack a {seg.bits}-bit segment in groups of {seg.group} with a {first.bits}-bit "
                             f"one in groups of {first.group} (or their kv heads or head_dim differ)")
    slots = max(seg.slots for seg in segments)
    per = {"k_codes": per_word(first.bits), "k_scale": first.group, "k_zero": first.group,
           "v_codes": per_word(first.bits), "v_scale": 1, "v_zero": 1}

    def padded(t: torch.Tensor, dim: int, size: int, fill) -> torch.Tensor:
        if t.shape[dim] == size:
            return t
        out = t.new_full((*t.shape[:dim], size, *t.shape[dim + 1:]), fill)
        out.narrow(dim, 0, t.shape[dim]).copy_(t)
        return out

    fields_ = {name: torch.cat([padded(getattr(seg, name), 2, slots // p, 0) for seg in segments])
               for name, p in per.items()}
    pos = torch.cat([padded(seg.pos, 1, slots, PAD_POS) for seg in segments])
    return QuantKV(**fields_, pos=pos, length=torch.cat([seg.length for seg in segments]), bits=first.bits,
                   group=first.group)
