"""FP8 KV-cache decode attention (the cache serving engines ship: vLLM's
kv_cache_dtype="fp8", FlashInfer's fp8 KV): one decode step over keys and
values stored as float8 codes (e4m3 or e5m2) with float32 scales per
tensor, per kv head or per token, converted in registers; output and LSE.

codec.py      the codes and scales (quantize, encode, decode), as the
              method's cache stores them
contract.py   the inputs, the output and the checks
kernel.py     split-K stage 1 (grouped query heads per program; fp8 -> fp16
              natively on sm_89+, by bits on sm_80), launcher; the merge
              is ops.splitk's
reference.py  the same in plain PyTorch (dequantize, then attend)
cases.py      compile cases (sm_80 / sm_90) and the selftest
model.py      bytes, the ideal and the estimate's launches
"""

from kernels_py.ops.common import use_triton
from kernels_py.ops.fp8_decode import codec, reference
from kernels_py.ops.fp8_decode.contract import Fp8DecodeOutput, check_inputs
from kernels_py.ops.fp8_decode.kernel import default_num_splits, fp8_decode
from kernels_py.ops.splitk import Workspace, make_workspace


def compute(q, q_pos, k, v, k_scale, v_scale, pos, *, backend: str = "auto") -> Fp8DecodeOutput:
    """One decode step from the kernel or the reference as `backend` says (ops.common.BACKENDS)."""
    if use_triton(backend, q.device):
        return fp8_decode(q, q_pos, k, v, k_scale, v_scale, pos)
    return reference.fp8_decode(q, q_pos, k, v, k_scale, v_scale, pos)


__all__ = ["Fp8DecodeOutput", "Workspace", "check_inputs", "codec", "compute", "default_num_splits", "fp8_decode",
           "make_workspace", "reference"]
