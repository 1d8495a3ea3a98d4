"""The KV quantization op in plain PyTorch (the layout in contract.py): the
same float operations as the kernels, so the packed bytes agree exactly."""

import torch

from kernels_py.ops.common import FLOAT_DTYPES, INDEX_DTYPES
from kernels_py.ops.kv_quant.contract import PAD_POS, QuantKV, check_params, check_segment, per_word


def _ranges(x: torch.Tensor, valid: torch.Tensor, dim: int, bits: int):
    """fp16 scale and zero of runs reduced along `dim`, padding excluded (a run
    with no real element gets scale 0, zero 0)."""
    lo = torch.where(valid, x, torch.inf).amin(dim, keepdim=True)
    hi = torch.where(valid, x, -torch.inf).amax(dim, keepdim=True)
    empty = ~valid.any(dim, keepdim=True)
    lo, hi = torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi)
    scale = ((hi - lo) / float(2**bits - 1)).half()
    return scale, lo.half()


def _codes(x, scale, zero, valid, bits):
    s, z = scale.float(), zero.float()
    codes = torch.floor((x - z) / torch.where(s > 0, s, 1.0) + 0.5).clamp(0, 2**bits - 1)
    return torch.where(valid & (s > 0), codes, 0.0).to(torch.int32)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes int32 [..., T, D] (T a multiple of P) -> words int32 [..., T / P,
    D] in the layout of contract.py: word (w, half * D / 2 + j) holds slots
    w * P + half * H + i (i < H = P / 2) of channels 2j (bits [i*b, (i+1)*b))
    and 2j + 1 (16 bits higher)."""
    p = per_word(bits)
    *lead, slots, dim = codes.shape
    c = codes.reshape(*lead, slots // p, 2, p // 2, dim // 2, 2)  # [.., w, half, i, j, channel of pair]
    c = c.movedim(-3, -1).reshape(*lead, slots // p, dim, p)  # [.., w, (half, j), (channel of pair, i)]
    shifts = torch.arange(p, dtype=torch.int64, device=codes.device) * bits
    words = (c.to(torch.int64) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed


def _unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """words int32 [..., T / P, D] -> codes int32 [..., T, D] (_pack undone)."""
    p = per_word(bits)
    *lead, rows, dim = words.shape
    shifts = torch.arange(p, dtype=torch.int32, device=words.device) * bits
    c = ((words[..., None] >> shifts) & (2**bits - 1)).reshape(*lead, rows, 2, dim // 2, 2, p // 2)
    return c.movedim(-1, -3).reshape(*lead, rows * p, dim)


def quantize(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, length: torch.Tensor, *, bits: int,
             group: int) -> QuantKV:
    """k, v [B, H, T, D] float (T a multiple of group) -> QuantKV. Slots at or
    past length[b], and slots whose pos is PAD_POS, are padding: they do not
    widen any range and get code 0 (their pos is set to PAD_POS)."""
    check_kv(k, v, pos, length, bits, group)
    batch, heads, slots, dim = k.shape
    slot = torch.arange(slots, device=k.device)
    valid = (slot[None, :] < length[:, None].to(torch.int64)) & (pos != PAD_POS)  # [B, T]
    pos = torch.where(valid, pos.to(torch.int32), PAD_POS).contiguous()

    # Keys per channel: runs of `group` slots.
    kg = k.float().reshape(batch, heads, slots // group, group, dim)
    kvalid = valid.reshape(batch, 1, slots // group, group, 1)
    k_scale, k_zero = _ranges(kg, kvalid, 3, bits)
    k_words = _pack(_codes(kg, k_scale, k_zero, kvalid, bits).reshape(batch, heads, slots, dim), bits)

    # Values per token: runs of `group` channels.
    vg = v.float().reshape(batch, heads, slots, dim // group, group)
    vvalid = valid.reshape(batch, 1, slots, 1, 1)
    v_scale, v_zero = _ranges(vg, vvalid, 4, bits)
    v_words = _pack(_codes(vg, v_scale, v_zero, vvalid, bits).reshape(batch, heads, slots, dim), bits)
    return QuantKV(k_words, k_scale.squeeze(3), k_zero.squeeze(3), v_words, v_scale.squeeze(4), v_zero.squeeze(4),
                   pos, length.clone(), bits, group)


def dequantize(seg: QuantKV) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [B, H, T, D] float32: code * scale + zero, 0 in padding slots."""
    check_segment(seg, check_values=False)
    slots, group = seg.slots, seg.group
    k_codes = _unpack(seg.k_codes, seg.bits)
    k_scale, k_zero = (t.float().repeat_interleave(group, 2) for t in (seg.k_scale, seg.k_zero))
    k = k_codes.float() * k_scale + k_zero
    v_codes = _unpack(seg.v_codes, seg.bits)
    v_scale, v_zero = (t.float().repeat_interleave(group, 3) for t in (seg.v_scale, seg.v_zero))
    v = v_codes.float() * v_scale + v_zero
    slot = torch.arange(slots, device=seg.pos.device)
    valid = ((slot[None, :] < seg.length[:, None].to(torch.int64)) & (seg.pos != PAD_POS))[:, None, :, None]
    return torch.where(valid, k, 0.0), torch.where(valid, v, 0.0)


def check_kv(k, v, pos, length, bits, group) -> None:
    """The inputs of quantize: raise naming what is wrong."""
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [batch, kv_heads, slots, head_dim], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: fp16, bf16, fp32")
    check_params(bits, group, k.shape[3])
    batch, _, slots, _ = k.shape
    if slots % group:
        raise ValueError(f"{slots} slots is not a multiple of the group size {group}: pad the segment to whole groups "
                         f"(pos = PAD_POS marks padding)")
    for name, t, shape in (("pos", pos, (batch, slots)), ("length", length, (batch,))):
        if t.dtype not in INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    for name, t in (("v", v), ("pos", pos), ("length", length)):
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device}, k on {k.device}")
    if batch and ((length < 0) | (length > slots) | (length % group != 0)).any():
        raise ValueError(f"length must be whole groups of {group} slots within [0, {slots}], got {length.tolist()}")
    if pos.dtype == torch.int64 and pos.numel() and ((pos < -2**31) | (pos > PAD_POS)).any():
        # Stored as int32: a wider position would wrap (onto PAD_POS, too) rather than fail.
        raise ValueError(f"pos must lie in [-2**31, {PAD_POS}] (positions are stored as int32; {PAD_POS} marks "
                         f"padding), got values in [{int(pos.min())}, {int(pos.max())}]")
    if k.numel():
        # Only the slots in use: padding (past length, or pos = PAD_POS) may hold anything, as an empty() buffer does.
        slot = torch.arange(slots, device=k.device)
        used = ((slot[None, :] < length[:, None].to(torch.int64)) & (pos != PAD_POS))[:, None, :, None]
        if any(not torch.isfinite(t).all() or t.abs().max() > 65504 for t in (torch.where(used, x, 0) for x in (k, v))):
            raise ValueError("k and v must be finite and within the fp16 range (scales and zeros are fp16) in the "
                             "slots in use")
