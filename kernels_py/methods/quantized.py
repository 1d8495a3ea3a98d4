"""Group-wise asymmetric integer quantization with real bit packing (plain PyTorch).

`quantize(x, bits, group, dim)` cuts axis `dim` of x into runs of `group`
consecutive elements and quantizes each run on its own: zero = min,
scale = (max - min) / (2**bits - 1), both stored in fp16, codes
round((x - zero) / scale) in [0, 2**bits - 1] packed 8 // bits to a byte.
`dequantize` returns codes * scale + zero in x's dtype and shape.

The KV-cache conventions of KIVI / ZipCache are both a choice of `dim`: keys
per channel = runs along the token axis (e.g. dim=-2 of [heads, T, d]),
values per token = runs along the channel axis (dim=-1).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels_py.metrics import tensor_bytes

BITS = (2, 4, 8)
FP16_MAX = 65504.0


@dataclass(frozen=True)
class Quantized:
    """A quantized tensor. With L = the length of axis `dim` rounded up to a
    multiple of `group` (the tail is padded with copies of the last element,
    which leaves that run's range unchanged):

    data  uint8 [*rest, L * bits / 8]: axis `dim` moved last, codes packed
          little end first (code i of a byte sits at bits [i*bits, (i+1)*bits)).
    scale, zero  float16 [*rest, L / group]: one pair per run.
    `rest` are the other axes of the original tensor, in order.
    """

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group: int
    dim: int  # non-negative axis of the original tensor
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held: packed codes plus fp16 scales and zeros."""
        return tensor_bytes(self.data, self.scale, self.zero)


def check_params(bits: int, group: int) -> None:
    """Raise ValueError unless `bits` is supported and `group` fills whole bytes."""
    if bits not in BITS:
        raise ValueError(f"bits={bits!r} is not one of {list(BITS)}")
    per_byte = 8 // bits
    if not isinstance(group, int) or group < 1 or group % per_byte:
        raise ValueError(f"group={group!r} must be a positive multiple of {per_byte} for {bits}-bit codes "
                         f"(whole bytes per run)")


def quantize(x: torch.Tensor, bits: int, group: int, dim: int = -1) -> Quantized:
    """Quantize x (any floating dtype, any shape with a non-empty axis `dim`)
    in runs of `group` along `dim`. The error of each element is at most half
    its run's scale, plus fp16 rounding of scale and zero."""
    check_params(bits, group)
    if not x.is_floating_point():
        raise TypeError(f"quantize needs a floating tensor, got {x.dtype}")
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is not an axis of a tensor of shape {tuple(x.shape)}")
    dim = dim % x.dim()
    length = x.shape[dim]
    if length == 0:
        raise ValueError(f"axis {dim} of shape {tuple(x.shape)} is empty")
    if not torch.isfinite(x).all() or x.abs().max().item() > FP16_MAX:
        raise ValueError("quantize: values must be finite and within the fp16 range (scales and zeros are fp16)")
    moved = x.detach().float().movedim(dim, -1)
    rest = moved.shape[:-1]
    padded = math.ceil(length / group) * group
    if padded > length:
        moved = F.pad(moved.reshape(-1, 1, length), (0, padded - length), mode="replicate").reshape(*rest, padded)
    runs = moved.reshape(*rest, padded // group, group)
    levels = 2 ** bits - 1
    low, high = runs.amin(dim=-1), runs.amax(dim=-1)
    # Codes are computed from the fp16 scale and zero that dequantize will read.
    zero = low.half()
    scale = ((high - zero.float()).clamp_min(0) / levels).half()
    step = scale.float().clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    codes = ((runs - zero.float()[..., None]) / step).round().clamp(0, levels).to(torch.uint8)
    per_byte = 8 // bits
    codes = codes.reshape(*rest, padded // per_byte, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=x.device)
    data = (codes << shifts).sum(dim=-1, dtype=torch.uint8) if per_byte > 1 else codes[..., 0]
    return Quantized(data.contiguous(), scale.contiguous(), zero.contiguous(), bits, group, dim, tuple(x.shape),
                     x.dtype)


def dequantize(q: Quantized) -> torch.Tensor:
    """The tensor q stands for, in its original shape and dtype."""
    shifts = torch.arange(0, 8, q.bits, dtype=torch.uint8, device=q.data.device)
    mask = (1 << q.bits) - 1
    codes = (q.data[..., None] >> shifts) & mask  # [*rest, L / per_byte, per_byte]
    rest = q.data.shape[:-1]
    runs = codes.reshape(*rest, q.scale.shape[-1], q.group).float()
    values = runs * q.scale.float()[..., None] + q.zero.float()[..., None]
    length = q.shape[q.dim]
    return values.reshape(*rest, -1)[..., :length].movedim(-1, q.dim).to(q.dtype)


__all__ = ["BITS", "Quantized", "check_params", "dequantize", "quantize"]
