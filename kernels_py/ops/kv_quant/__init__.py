"""KV quantization: pack a segment of keys and values into 2- or 4-bit codes
(keys per channel, values per token, groups of 32/64/128, fp16 scales and
zero points) in a layout a decode kernel reads with wide loads, and
dequantize it back in registers.

contract.py   the packed layout (QuantKV) and its checks
kernel.py     Triton quantize / dequantize kernels, the in-register
              dequantization device functions, their launchers
reference.py  the same in plain PyTorch, byte for byte
cases.py      compile cases (sm_80 / sm_90) and the selftest
"""

from kernels_py.ops.common import use_triton
from kernels_py.ops.kv_quant import reference
from kernels_py.ops.kv_quant.contract import (BITS, GROUPS, PAD_POS, QuantKV, check_params, check_segment, concat,
                                             shapes, stack)
from kernels_py.ops.kv_quant.kernel import dequantize, quantize


def compute_quantize(k, v, pos, length, *, bits: int, group: int, backend: str = "auto") -> QuantKV:
    """quantize from the kernel or the reference as `backend` says (ops.common.BACKENDS)."""
    if use_triton(backend, k.device):
        return quantize(k, v, pos, length, bits=bits, group=group)
    return reference.quantize(k, v, pos, length, bits=bits, group=group)


__all__ = ["BITS", "GROUPS", "PAD_POS", "QuantKV", "check_params", "check_segment", "compute_quantize", "concat",
           "dequantize", "quantize", "reference", "shapes", "stack"]
