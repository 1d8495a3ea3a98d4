"""Quantized decode attention (ZipVL's mixed precision, KIVI): one decode
step over a cache of one or two quantized segments (2- or 4-bit codes in
the kv_quant layout) and an uncompressed segment, dequantizing in
registers; output and LSE.

contract.py   the inputs, the output and the input checks
kernel.py     split-K stage 1 (grouped query heads per program) and its
              launcher; the merge is ops.splitk's
reference.py  the same contract in plain PyTorch (dequantize, then attend)
cases.py      compile cases (sm_80 / sm_90) and the selftest
"""

from kernels_py.ops.common import use_triton
from kernels_py.ops.splitk import Workspace, make_workspace
from kernels_py.ops.quant_decode import reference
from kernels_py.ops.quant_decode.contract import DenseKV, QuantDecodeOutput, check_inputs
from kernels_py.ops.quant_decode.kernel import default_num_splits, quant_decode


def compute(q, q_pos, segments, dense: DenseKV, *, backend: str = "auto") -> QuantDecodeOutput:
    """One decode step from the kernel or the reference as `backend` says (ops.common.BACKENDS)."""
    if use_triton(backend, q.device):
        return quant_decode(q, q_pos, segments, dense)
    return reference.quant_decode(q, q_pos, segments, dense)


__all__ = ["DenseKV", "QuantDecodeOutput", "Workspace", "check_inputs", "compute", "default_num_splits",
           "make_workspace", "quant_decode", "reference"]
