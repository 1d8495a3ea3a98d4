"""Small kernels whose instruction counts are known, for the tests of the
SASS classifier and the estimate (test_estimate.py). Run as a script, it
compiles each for a target without a GPU and prints what the estimate reads
from its SASS as JSON (it needs TRITON_INTERPRET unset, like
kernels_py.ops.compile):

    python -m kernels_py.tests.probe_kernels --target 90
"""

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

BLOCK = 1024  # fp16 elements a program loads per iteration: 8 a thread on 4 warps, one 16-byte load
N = 64 * BLOCK  # elements a program walks


@triton.jit
def _wide_load_kernel(X, Y, n, BLOCK: tl.constexpr):
    """Sums n fp16 elements, BLOCK at a time: one 128-bit load a thread an iteration."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        acc += tl.load(X + start + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(Y + tl.arange(0, BLOCK), acc)


@triton.jit
def _strided_load_kernel(X, Y, n, BLOCK: tl.constexpr):
    """The same over every other element: scalar 16-bit loads, 8 a thread an iteration."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        acc += tl.load(X + 2 * (start + tl.arange(0, BLOCK))).to(tl.float32)
    tl.store(Y + tl.arange(0, BLOCK), acc)


@triton.jit
def _sum_range(X, lo, hi, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(lo, hi, BLOCK):
        acc += tl.load(X + start + tl.arange(0, BLOCK)).to(tl.float32)
    return acc


@triton.jit
def _two_ranges_kernel(X, Y, a, b, BLOCK: tl.constexpr):
    """One helper inlined at two call sites with other bounds: [0, a) and [a, a + b)."""
    acc = _sum_range(X, 0, a, BLOCK) + _sum_range(X, a, a + b, BLOCK)
    tl.store(Y + tl.arange(0, BLOCK), acc)


@triton.jit
def _mma_kernel(A, B, C, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C [M, N] = A [M, K] @ B [K, N], one program, K walked BLOCK_K at a time."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(A + offs_m[:, None] * K + (k0 + offs_k)[None, :])
        b = tl.load(B + (k0 + offs_k)[:, None] * BLOCK_N + offs_n[None, :])
        acc += tl.dot(a, b)
    tl.store(C + offs_m[:, None] * BLOCK_N + offs_n[None, :], acc)


MMA = {"M": 64, "N": 64, "K": 1024, "BLOCK_K": 32}


@triton.jit
def _odd_tile_kernel(X, BLOCK: tl.constexpr):
    """Does not compile for BLOCK=3 (tl.arange needs a power of two): what a
    compile error is reported as."""
    tl.store(X + tl.arange(0, BLOCK), 1.0)


def _launch_odd_tile():
    _odd_tile_kernel[(1,)](torch.zeros(4), BLOCK=3)


def _launch_loads():
    x, y = torch.zeros(2 * N, dtype=torch.float16), torch.zeros(BLOCK, dtype=torch.float32)
    _wide_load_kernel[(1,)](x, y, N, BLOCK=BLOCK, num_warps=4)
    _strided_load_kernel[(1,)](x, y, N, BLOCK=BLOCK, num_warps=4)
    _two_ranges_kernel[(1,)](x, y, N, N, BLOCK=BLOCK, num_warps=4)


def _launch_mma():
    a = torch.zeros(MMA["M"], MMA["K"], dtype=torch.float16)
    b = torch.zeros(MMA["K"], MMA["N"], dtype=torch.float16)
    c = torch.zeros(MMA["M"], MMA["N"], dtype=torch.float32)
    _mma_kernel[(1,)](a, b, c, MMA["K"], BLOCK_M=MMA["M"], BLOCK_N=MMA["N"], BLOCK_K=MMA["BLOCK_K"], num_warps=4)


# What the estimate is told each kernel's loops run over (their runtime names).
VALUES = {"_wide_load_kernel": {"n": N}, "_strided_load_kernel": {"n": N},
          "_two_ranges_kernel": {"a": 4 * BLOCK, "b": 3 * BLOCK}, "_mma_kernel": {"K": MMA["K"]}}


def probe(target: int) -> dict:
    """Per kernel: the instructions per warp by class, tensor FLOPs per
    program, the loops (source line, trips, unroll) and the warp timeline;
    and "compile_error", what runtime.errors.compile_failure says of a
    kernel that does not compile."""
    from kernels_py.ops import compile as cc
    from kernels_py.ops import estimate, report
    from kernels_py.runtime.errors import compile_failure

    gpu = estimate.GPUS[target]
    out = {}
    for call in (_launch_loads, _launch_mma):
        _, _, compiled = cc.compile_launches(call, target)
        for entry, binary in compiled:
            if entry.get("error"):
                raise RuntimeError(f"{entry['kernel']}: {entry['error']}")
            name = entry["kernel"]
            kernel = estimate.Kernel(name, binary.asm["cubin"], report.Compiled.meta(entry), entry["signature"])
            trips, _ = kernel.trips(VALUES[name])
            prof, _ = estimate.profile(kernel, VALUES[name], {}, gpu)
            out[name] = {
                "warps": entry["num_warps"], "by_class": prof.by_class, "instructions": prof.instructions,
                "tensor_flops": prof.tensor_flops * entry["num_warps"], "cycles": prof.cycles, "waits": prof.waits,
                "loops": [{"line": info.source.line if info.source else None, "occurrence": info.occurrence,
                           "unroll": info.unroll, "remainder": info.remainder, "trips": trips[header]}
                          for header, info in kernel.loops.items()],
                "loads": sorted({p for site in kernel.loads.values() for p in site.pointers}),
            }
    _, _, (failed,) = cc.compile_launches(_launch_odd_tile, target)
    out["compile_error"] = compile_failure(failed[0])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=int, default=90)
    opts = parser.parse_args(argv)
    json.dump(probe(opts.target), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
