"""The selected-row decode op's compile cases and selftest (see kernels_py.ops)."""

import time
from functools import partial

import torch

from kernels_py import runtime
from kernels_py.ops import CompileCase, common, splitk
from kernels_py.ops.gather_decode import reference
from kernels_py.ops.gather_decode.kernel import gather_decode
from kernels_py.tables import Column, table

KERNELS = ("_stage1_kernel", "_merge_kernel")


def make_case(*, batch, heads, kv_heads, head_dim, slots, counts, queries=1, dtype=torch.float16, seed=0,
              sort=False, spread=2.0):
    """q, q_pos, k, v, pos, index, count: a random cache, and per (sequence,
    kv head) a random list of distinct rows (`counts[b][g]` of them, the
    index tensor padded to the longest with garbage the count excludes)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, kv_heads, slots, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, slots, head_dim, generator=g).to(dtype)
    pos = torch.arange(slots).repeat(batch, 1)
    entries = max(max(c) for c in counts) + 2
    index = torch.randint(0, slots, (batch, kv_heads, entries), generator=g, dtype=torch.int32)
    for b in range(batch):
        for h in range(kv_heads):
            rows = torch.randperm(slots, generator=g)[:counts[b][h]]
            index[b, h, :counts[b][h]] = (rows.sort().values if sort else rows).to(torch.int32)
    count = torch.tensor(counts, dtype=torch.int32)
    q = (spread * torch.randn(batch, heads, queries, head_dim, generator=g)).to(dtype)
    q_pos = (slots - queries + torch.arange(queries)).repeat(batch, 1)
    return q, q_pos, k, v, pos, index, count


def _compile(*, dtype, heads, kv_heads, head_dim, queries=1):
    case = make_case(batch=2, heads=heads, kv_heads=kv_heads, head_dim=head_dim, slots=64,
                     counts=[[20] * kv_heads, [5] * kv_heads], queries=queries, dtype=dtype)
    gather_decode(*case)


COMPILE_CASES = [
    CompileCase("gather-fp16-d128-gqa4", partial(_compile, dtype=torch.float16, heads=32, kv_heads=8, head_dim=128),
                KERNELS),
    CompileCase("gather-bf16-d64-m2", partial(_compile, dtype=torch.bfloat16, heads=4, kv_heads=2, head_dim=64,
                                              queries=2), KERNELS),
    CompileCase("gather-fp32-d80", partial(_compile, dtype=torch.float32, heads=2, kv_heads=2, head_dim=80), KERNELS),
]

TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
COLUMNS = (
    Column("lists", "", "index lists"),
    Column("splits", "", "splits per (sequence, kv head): the default for the input, or forced to run the merge"),
    Column("out_err", "", "largest |kernel - reference| of the output, relative to 1 + |reference|", "out err"),
    Column("lse_err", "", "largest |kernel - reference| of the log-sum-exp", "lse err"),
    Column("seconds", "s", "kernel time, first call (compiles on a GPU)", "kernel"),
    Column("ok", "", "within the tolerance"),
)


def selftest(seed: int = 0, dtype: str = "float16", heads: int = 8, kv_heads: int = 2, head_dim: int = 128,
             slots: int = 512) -> dict:
    """One decode step over 30% of a cache's rows (A-VL's core share), sorted
    and unsorted lists (the unsorted also in SELFTEST_SPLITS splits), against
    the reference over the gathered rows."""
    torch_dtype = common.dtype(dtype)
    device = runtime.device()
    rows = []
    for name, sort, splits in (("sorted", True, None), ("unsorted", False, None),
                               ("unsorted", False, splitk.SELFTEST_SPLITS)):
        case = [t.to(device) for t in make_case(batch=1, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                                 slots=slots, counts=[[int(0.3 * slots)] * kv_heads],
                                                 dtype=torch_dtype, seed=seed, sort=sort)]
        t0 = time.perf_counter()
        got = gather_decode(*case, num_splits=splits)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        want = reference.gather_decode(*case)
        out_err = ((got.out.float() - want.out.float()).abs() / (1 + want.out.float().abs())).max().item()
        lse_err = (got.lse - want.lse).abs().max().item()
        tol = TOLERANCE[torch_dtype]
        rows.append({"lists": f"30% of {slots} rows, {name}", "splits": splits or "default", "out_err": out_err, "lse_err": lse_err,
                     "seconds": seconds, "ok": out_err <= tol and lse_err <= tol})
    return {
        "title": f"one decode step over selected rows ({heads} heads, {kv_heads} kv heads, head_dim {head_dim}, "
                 f"{dtype})",
        **table(COLUMNS, rows),
        "verdict": f"tolerance {TOLERANCE[torch_dtype]:g}",
        "ok": all(r["ok"] for r in rows),
        "kernel_seconds": sum(r["seconds"] for r in rows),
    }
