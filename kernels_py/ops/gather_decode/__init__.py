"""Selected-row decode attention (A-VL's core-token operator): one decode
step over the rows of a KV cache that an index list per (sequence, kv head)
selects, loading them by index inside the kernel with no gathered copy;
output and LSE.

contract.py   the inputs (index lists: unsorted allowed, duplicates
              rejected, empty allowed), the output and the checks
kernel.py     split-K stage 1 (grouped query heads per program), launcher;
              the merge is ops.splitk's
reference.py  the same in plain PyTorch (gather, then attend)
cases.py      compile cases (sm_80 / sm_90) and the selftest
"""

from kernels_py.ops.common import use_triton
from kernels_py.ops.splitk import Workspace, make_workspace
from kernels_py.ops.gather_decode import reference
from kernels_py.ops.gather_decode.contract import GatherDecodeOutput, check_inputs
from kernels_py.ops.gather_decode.kernel import default_num_splits, gather_decode


def compute(q, q_pos, k, v, pos, index, count, *, backend: str = "auto") -> GatherDecodeOutput:
    """One decode step from the kernel or the reference as `backend` says (ops.common.BACKENDS)."""
    if use_triton(backend, q.device):
        return gather_decode(q, q_pos, k, v, pos, index, count)
    return reference.gather_decode(q, q_pos, k, v, pos, index, count)


__all__ = ["GatherDecodeOutput", "Workspace", "check_inputs", "compute", "default_num_splits", "gather_decode",
           "make_workspace", "reference"]
