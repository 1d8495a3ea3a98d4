"""Low-rank decode attention (AttentionPack): one decode step over a cache
whose compressed segment is U @ W factors with a rank prefix per token, plus an
uncompressed segment; output, LSE and each token's attention mass in one pass.

contract.py   the cache segments, the output and the input checks
kernel.py     the fused kernel (keys rebuilt, values in rank space), the
              absorbed kernel (all in rank space, all heads per program), and
              their launchers
model.py      bytes and FLOPs of one step per implementation, H100 roofline
reference.py  the same contract in plain PyTorch (also the unfused path)
cases.py      compile cases (sm_80 / sm_90) and the selftest
"""

from kernels_py.ops.common import check_block, use_triton
from kernels_py.ops.lowrank_decode import reference
from kernels_py.ops.lowrank_decode.contract import CompressedKV, DecodeOutput, DenseKV, check_inputs
from kernels_py.ops.lowrank_decode.kernel import (
    Workspace, default_num_splits, lowrank_decode, lowrank_decode_absorbed, make_workspace,
)


def compute(q, q_pos, comp: CompressedKV, dense: DenseKV, *, rope_base: float | None, absorbed: bool = False,
            backend: str = "auto", rank_chunk: int | None = None, mass: bool = True) -> DecodeOutput:
    """One decode step from the kernel or the reference as `backend` says
    (ops.common.BACKENDS). absorbed=True picks the rank-space kernel, which
    needs keys decomposed after RoPE (rope_base None); the reference computes
    the same attention either way. rank_chunk, mass: see
    kernel.lowrank_decode (the reference computes the masses anyway and
    drops them)."""
    if absorbed and rope_base is not None:
        raise ValueError("the absorbed (rank-space) kernel needs keys decomposed after RoPE: rope_base must be None")
    if rank_chunk is not None:  # on every backend, so a knob's value fails on the CPU as it would on a GPU
        check_block("rank_chunk", rank_chunk)
    if not use_triton(backend, q.device):
        out = reference.lowrank_decode(q, q_pos, comp, dense, rope_base=rope_base)
        return out if kernel.check_mass(mass) else out._replace(mass_comp=None, mass_dense=None)
    if absorbed:
        return lowrank_decode_absorbed(q, q_pos, comp, dense, mass=mass)
    return lowrank_decode(q, q_pos, comp, dense, rope_base=rope_base, rank_chunk=rank_chunk, mass=mass)


__all__ = ["CompressedKV", "DecodeOutput", "DenseKV", "Workspace", "check_inputs", "compute", "default_num_splits",
           "lowrank_decode", "lowrank_decode_absorbed", "make_workspace", "reference"]
