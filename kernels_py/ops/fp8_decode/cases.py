"""The FP8 decode op's compile cases and selftest (see kernels_py.ops)."""

import time
from functools import partial

import torch

from kernels_py import runtime
from kernels_py.ops import CompileCase, common, splitk
from kernels_py.ops.fp8_decode import codec, reference
from kernels_py.ops.fp8_decode.kernel import fp8_decode
from kernels_py.tables import Column, table

KERNELS = ("_stage1_kernel", "_merge_kernel")


def make_case(*, batch, heads, kv_heads, head_dim, slots, queries=1, dtype=torch.float16, granularity="tensor",
              fmt="e4m3", seed=0, spread=2.0):
    """q, q_pos, k, v, k_scale, v_scale, pos: a random cache quantized by
    codec (scales [B, H_kv, S] per token, else [B, H_kv]: a per-tensor one,
    one per sequence's cache, expanded over the kv heads), its values spread
    over a range of magnitudes per token, the value codes token-contiguous
    (codec.values_layout); the queries come last."""
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.exp(torch.randn(batch, kv_heads, slots, 1, generator=g))  # tokens of different scales
    keys = (torch.randn(batch, kv_heads, slots, head_dim, generator=g) * magnitude).to(dtype)
    values = (torch.randn(batch, kv_heads, slots, head_dim, generator=g) * magnitude).to(dtype)
    k, k_scale = codec.quantize(keys, granularity, fmt)
    v, v_scale = codec.quantize(values, granularity, fmt)
    v = codec.values_layout(v)
    if granularity == "token":
        shape = (batch, kv_heads, slots)
    else:
        shape = (batch, kv_heads)
        k_scale, v_scale = k_scale[..., 0], v_scale[..., 0]
    pos = torch.arange(slots).repeat(batch, 1)
    q = (spread * torch.randn(batch, heads, queries, head_dim, generator=g) / magnitude.mean()).to(dtype)
    q_pos = (slots - queries + torch.arange(queries)).repeat(batch, 1)
    return q, q_pos, k, v, k_scale.expand(shape), v_scale.expand(shape), pos


def _compile(*, dtype, heads, kv_heads, head_dim, granularity, fmt, queries=1, slots=64):
    fp8_decode(*make_case(batch=2, heads=heads, kv_heads=kv_heads, head_dim=head_dim, slots=slots, queries=queries,
                          dtype=dtype, granularity=granularity, fmt=fmt))


f16, bf16 = torch.float16, torch.bfloat16
# e4m3 compiles natively on sm_90 and by bits on sm_80 (kernel.default_conversion).
# The benchmark's shape in whole tiles (unmasked loads), every config; per-token
# scales with a partial tile at the 128-token configs; e5m2 with bf16 queries.
COMPILE_CASES = [
    CompileCase("fp8-e4m3-tensor-fp16-d128-gqa4",
                partial(_compile, dtype=f16, heads=32, kv_heads=8, head_dim=128, granularity="tensor", fmt="e4m3",
                        slots=256), KERNELS),
    CompileCase("fp8-e4m3-token-fp16-d128-gqa4",
                partial(_compile, dtype=f16, heads=32, kv_heads=8, head_dim=128, granularity="token", fmt="e4m3"),
                KERNELS, tune=slice(4, 6)),
    CompileCase("fp8-e5m2-head-bf16-d64-m2",
                partial(_compile, dtype=bf16, heads=4, kv_heads=2, head_dim=64, granularity="head", fmt="e5m2",
                        queries=2), KERNELS, tune=slice(0, 2)),
]

TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
COLUMNS = (
    Column("cache", "", "fp8 format and scale granularity"),
    Column("conversion", "", "how the kernel turns codes into 16-bit values"),
    Column("splits", "", "splits per (sequence, kv head): the default for the input, or forced to run the merge"),
    Column("out_err", "", "largest |kernel - reference| of the output, relative to 1 + |reference|", "out err"),
    Column("lse_err", "", "largest |kernel - reference| of the log-sum-exp", "lse err"),
    Column("seconds", "s", "kernel time, first call (compiles on a GPU)", "kernel"),
    Column("ok", "", "within the tolerance"),
)


def selftest(seed: int = 0, dtype: str = "float16", heads: int = 8, kv_heads: int = 2, head_dim: int = 128,
             slots: int = 512) -> dict:
    """One decode step over an fp8 cache per format and scale granularity,
    the kernel against the reference over the same codes (each conversion
    the device runs; per-token scales also in SELFTEST_SPLITS splits)."""
    torch_dtype = common.dtype(dtype)
    device = runtime.device()
    rows = []
    for fmt, granularity, splits in (("e4m3", "tensor", None), ("e4m3", "head", None), ("e4m3", "token", None),
                                     ("e4m3", "token", splitk.SELFTEST_SPLITS), ("e5m2", "tensor", None)):
        case = [t.to(device) for t in make_case(batch=1, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                                 slots=slots, dtype=torch_dtype, granularity=granularity, fmt=fmt,
                                                 seed=seed)]
        want = reference.fp8_decode(*case)
        conversions = ["native", "bits"] if device.type != "cuda" or common.capability(device) >= 89 else ["bits"]
        if fmt == "e5m2" and device.type == "cuda":
            conversions = ["native"]
        for conversion in conversions:
            t0 = time.perf_counter()
            got = fp8_decode(*case, conversion=conversion, num_splits=splits)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            out_err = ((got.out.float() - want.out.float()).abs() / (1 + want.out.float().abs())).max().item()
            lse_err = (got.lse - want.lse).abs().max().item()
            tol = TOLERANCE[torch_dtype]
            rows.append({"cache": f"{fmt}, per {granularity}", "splits": splits or "default", "conversion": conversion,
                         "out_err": out_err,
                         "lse_err": lse_err, "seconds": seconds,
                         "ok": out_err <= tol and lse_err <= tol})
    return {
        "title": f"one decode step over an fp8 cache ({heads} heads, {kv_heads} kv heads, head_dim {head_dim}, "
                 f"{slots} slots, {dtype} queries)",
        **table(COLUMNS, rows),
        "verdict": f"tolerance {TOLERANCE[torch_dtype]:g}",
        "ok": all(r["ok"] for r in rows),
        "kernel_seconds": sum(r["seconds"] for r in rows),
    }
