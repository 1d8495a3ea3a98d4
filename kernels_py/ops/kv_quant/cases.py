"""The KV quantization op's compile cases and selftest (see kernels_py.ops)."""

import math
import time
from functools import partial

import torch

from kernels_py import runtime
from kernels_py.ops import CompileCase, common
from kernels_py.ops.kv_quant import reference
from kernels_py.ops.kv_quant.kernel import dequantize, quantize
from kernels_py.tables import Column, table

KERNELS = ("_quantize_keys_kernel", "_quantize_values_kernel", "_dequantize_kernel")


def random_kv(*, batch, kv_heads, slots, head_dim, lengths, dtype, seed=0, outlier_channels=2):
    """k, v [B, H, T, D], pos, length: keys with a few outlier channels (as
    real keys have), positions 0..T-1."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, kv_heads, slots, head_dim, generator=g)
    k[..., :outlier_channels] *= 8.0
    v = torch.randn(batch, kv_heads, slots, head_dim, generator=g)
    pos = torch.arange(slots, dtype=torch.int32).repeat(batch, 1)
    return k.to(dtype), v.to(dtype), pos, torch.tensor(lengths, dtype=torch.int32)


def _compile(*, dtype, bits, group, head_dim):
    k, v, pos, length = random_kv(batch=2, kv_heads=2, slots=2 * group, head_dim=head_dim,
                                  lengths=[2 * group, group], dtype=dtype)
    dequantize(quantize(k, v, pos, length, bits=bits, group=group))


f16, bf16 = torch.float16, torch.bfloat16
COMPILE_CASES = [
    CompileCase("kvquant-fp16-4bit-g32-d128", partial(_compile, dtype=f16, bits=4, group=32, head_dim=128), KERNELS),
    CompileCase("kvquant-bf16-2bit-g64-d64", partial(_compile, dtype=bf16, bits=2, group=64, head_dim=64), KERNELS),
    CompileCase("kvquant-fp16-2bit-g128-d128", partial(_compile, dtype=f16, bits=2, group=128, head_dim=128),
                KERNELS),
]

COLUMNS = (
    Column("bits", "", "bits per code"),
    Column("group", "", "elements sharing a scale and zero point"),
    Column("bytes_equal", "", "the kernel's packed codes, scales and zeros equal the reference's, byte for byte",
           "bytes equal"),
    Column("k_err", "", "largest |dequantized - original| key error / its bound (half a scale + fp16 rounding)",
           "K err/bound"),
    Column("v_err", "", "the same for values", "V err/bound"),
    Column("ratio", "x", "fp16 K/V bytes / packed bytes (codes, scales, zeros)", "vs fp16"),
    Column("seconds", "s", "quantize + dequantize, first call (compiles on a GPU)", "kernel"),
    Column("ok", "", "bytes equal, errors within their bound"),
)


def error_over_bound(x: torch.Tensor, x_hat: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> float:
    """max |x - x_hat| / (scale / 2 + fp16 rounding of scale * levels and zero),
    scale and zero broadcast to x; below 1 when every element is within its bound."""
    bound = scale.float() / 2 + 1e-3 * (scale.float() * 15 + zero.float().abs()) + 1e-6
    return ((x.float() - x_hat) .abs() / bound).max().item()


def selftest(seed: int = 0, dtype: str = "float16", kv_heads: int = 2, head_dim: int = 128, slots: int = 256) -> dict:
    """Quantize and dequantize a segment with the kernels at each bit width and
    group size: packed bytes against the reference, errors against their bound."""
    torch_dtype = common.dtype(dtype)
    device = runtime.device()
    rows, start = [], time.perf_counter()
    for bits in (4, 2):
        for group in (32, 64, 128):
            k, v, pos, length = (t.to(device) for t in random_kv(batch=1, kv_heads=kv_heads, slots=slots,
                                                                 head_dim=head_dim, lengths=[slots], dtype=torch_dtype,
                                                                 seed=seed))
            t0 = time.perf_counter()
            got = quantize(k, v, pos, length, bits=bits, group=group)
            k_hat, v_hat = dequantize(got)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            want = reference.quantize(k, v, pos, length, bits=bits, group=group)
            equal = all(torch.equal(getattr(got, f), getattr(want, f))
                        for f in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"))
            k_err = error_over_bound(k, k_hat, got.k_scale.repeat_interleave(group, 2),
                                     got.k_zero.repeat_interleave(group, 2))
            v_err = error_over_bound(v, v_hat, got.v_scale.repeat_interleave(group, 3),
                                     got.v_zero.repeat_interleave(group, 3))
            rows.append({"bits": bits, "group": group, "bytes_equal": equal, "k_err": k_err, "v_err": v_err,
                         "ratio": 2 * k.numel() * 2 / got.nbytes, "seconds": seconds,
                         "ok": equal and k_err <= 1 and v_err <= 1})
    ok = all(r["ok"] for r in rows)
    errors = [r[e] for r in rows for e in ("k_err", "v_err")]
    worst = math.nan if any(map(math.isnan, errors)) else max(errors)
    equal = "equal" if all(r["bytes_equal"] for r in rows) else "differ from"
    return {
        "title": f"quantize and dequantize {slots} slots ({kv_heads} kv heads, head_dim {head_dim}, {dtype}): keys per "
                 f"channel, values per token",
        **table(COLUMNS, rows),
        # Says what failed: `workbench selftest` adds OK or MISMATCH after it.
        "verdict": f"packed bytes {equal} the reference's, worst error at {worst:.2g} of its bound",
        "ok": ok,
        "kernel_seconds": time.perf_counter() - start,
    }
