"""The quantized decode op's compile cases and selftest (see kernels_py.ops)."""

import time
from functools import partial

import torch

from kernels_py import runtime
from kernels_py.ops import CompileCase, common, splitk
from kernels_py.ops.kv_quant.cases import random_kv
from kernels_py.ops.kv_quant.kernel import quantize
from kernels_py.ops.quant_decode import reference
from kernels_py.ops.quant_decode.contract import DenseKV
from kernels_py.ops.quant_decode.kernel import quant_decode
from kernels_py.tables import Column, table

KERNELS = ("_stage1_kernel", "_merge_kernel")


def make_cache(*, batch, heads, kv_heads, head_dim, segments, dense_lens, queries, dtype, seed=0, spread=2.0,
               device=None):
    """q, q_pos, [QuantKV...], DenseKV on `device` (default: the runtime's,
    where kv_quant's kernels quantize the segments; the values are drawn on
    the CPU, so they are the same on every device). segments: (bits, group,
    slots, lengths) per quantized segment, in order; positions run on
    across the segments, then the dense one; the queries come last."""
    device = runtime.device() if device is None else torch.device(device)
    g = torch.Generator().manual_seed(seed + 1000)
    quantized, start = [], 0
    for i, (bits, group, slots, lengths) in enumerate(segments):
        k, v, pos, length = (t.to(device) for t in random_kv(batch=batch, kv_heads=kv_heads, slots=slots,
                                                             head_dim=head_dim, lengths=lengths, dtype=dtype,
                                                             seed=seed + i))
        quantized.append(quantize(k, v, pos + start, length, bits=bits, group=group))
        start += slots
    dense_slots = max(dense_lens) + 3
    dense = DenseKV(*(t.to(device) for t in (
        torch.randn(batch, kv_heads, dense_slots, head_dim, generator=g).to(dtype),
        torch.randn(batch, kv_heads, dense_slots, head_dim, generator=g).to(dtype),
        (start + torch.arange(dense_slots)).repeat(batch, 1), torch.tensor(dense_lens))))
    q = (spread * torch.randn(batch, heads, queries, head_dim, generator=g)).to(dtype)
    q_pos = (start + dense_slots - queries + torch.arange(queries)).repeat(batch, 1)
    return q.to(device), q_pos.to(device), quantized, dense


def _compile(*, dtype, head_dim, heads, kv_heads, segments, queries=1):
    q, q_pos, segs, dense = make_cache(batch=2, heads=heads, kv_heads=kv_heads, head_dim=head_dim, segments=segments,
                                       dense_lens=[5, 2], queries=queries, dtype=dtype, device="cpu")
    quant_decode(q, q_pos, segs, dense)


f16, bf16 = torch.float16, torch.bfloat16
COMPILE_CASES = [
    # ZipVL's shape: 4-bit important tokens, 2-bit others, 32 q / 8 kv heads, one group size (128-slot tiles
    # span two groups).
    CompileCase("quantdecode-fp16-d128-4+2bit-gqa4",
                partial(_compile, dtype=f16, head_dim=128, heads=32, kv_heads=8,
                        segments=[(4, 64, 128, [128, 64]), (2, 64, 256, [256, 128])]), KERNELS),
    # KIVI's shape: one 2-bit segment, group 128.
    # The first case compiles every config; these the 4-warp ones without the cap, one per tile size.
    CompileCase("quantdecode-bf16-d128-2bit-g128",
                partial(_compile, dtype=bf16, head_dim=128, heads=8, kv_heads=8, segments=[(2, 128, 128, [128, 0])]),
                KERNELS, tune=slice(1, 4, 2)),
    CompileCase("quantdecode-fp16-d64-4bit-m2",
                partial(_compile, dtype=f16, head_dim=64, heads=8, kv_heads=2, segments=[(4, 64, 64, [64, 64])],
                        queries=2), KERNELS, tune=slice(1, 4, 2)),
]

# 16-bit inputs: the dequantized tile and the probabilities are rounded to the
# dot dtype, as a 16-bit cache would be; fp32 inputs match to round-off.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
COLUMNS = (
    Column("cache", "", "quantized segments of the cache"),
    Column("splits", "", "splits per (sequence, kv head): the default for the input, or forced to run the merge"),
    Column("out_err", "", "largest |kernel - reference| of the output, relative to 1 + |reference|", "out err"),
    Column("lse_err", "", "largest |kernel - reference| of the log-sum-exp", "lse err"),
    Column("seconds", "s", "kernel time, first call (compiles on a GPU)", "kernel"),
    Column("ok", "", "within the tolerance"),
)


def selftest(seed: int = 0, dtype: str = "float16", heads: int = 8, kv_heads: int = 2, head_dim: int = 128) -> dict:
    """One decode step over a ZipVL-shaped cache (25% of the tokens in 4-bit,
    75% in 2-bit, 32 recent uncompressed in `dtype`; also in SELFTEST_SPLITS splits) and a
    KIVI-shaped one, against the reference over the dequantized cache."""
    torch_dtype = common.dtype(dtype)
    device = runtime.device()
    rows = []
    zipvl = [(4, 32, 64, [64]), (2, 32, 192, [192])]
    for name, segments, splits in (("4-bit 64 + 2-bit 192 slots", zipvl, None),
                                   ("4-bit 64 + 2-bit 192 slots", zipvl, splitk.SELFTEST_SPLITS),
                                   ("2-bit 256 slots (KIVI)", [(2, 128, 256, [256])], None)):
        q, q_pos, segs, dense = make_cache(batch=1, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                           segments=segments, dense_lens=[32], queries=1, dtype=torch_dtype, seed=seed,
                                           device=device)
        t0 = time.perf_counter()
        got = quant_decode(q, q_pos, segs, dense, num_splits=splits)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        want = reference.quant_decode(q, q_pos, segs, dense)
        out_err = ((got.out.float() - want.out.float()).abs() / (1 + want.out.float().abs())).max().item()
        lse_err = (got.lse - want.lse).abs().max().item()
        tol = TOLERANCE[torch_dtype]
        rows.append({"cache": name, "splits": splits or "default", "out_err": out_err, "lse_err": lse_err, "seconds": seconds,
                     "ok": out_err <= tol and lse_err <= tol})
    return {
        "title": f"one decode step over a quantized cache + 32 uncompressed {dtype} tokens ({heads} heads, "
                 f"{kv_heads} kv heads, head_dim {head_dim}, {dtype})",
        **table(COLUMNS, rows),
        "verdict": f"tolerance {TOLERANCE[torch_dtype]:g}",
        "ok": all(r["ok"] for r in rows),
        "kernel_seconds": sum(r["seconds"] for r in rows),
    }
