"""The attention-statistics op's compile cases and selftest (see kernels_py.ops)."""

import time
from functools import partial

import torch

from kernels_py import runtime
from kernels_py.ops import CompileCase, common
from kernels_py.ops.attention_stats import reference
from kernels_py.ops.attention_stats.contract import post_vision_rows
from kernels_py.ops.attention_stats.kernel import attention_stats
from kernels_py.tables import Column, table

KERNELS = ("_row_stats_kernel", "_merge_rows_kernel", "_column_stats_kernel")


def _compile(dtype, heads, kv_heads, head_dim):
    rows, keys = 20, 40
    q_pos = torch.arange(keys - rows, keys, dtype=torch.int64)
    attention_stats(torch.randn(heads, rows, head_dim).to(dtype), torch.randn(kv_heads, keys, head_dim).to(dtype),
                    q_pos, key_splits=2)  # two splits, so the merge compiles too


COMPILE_CASES = [
    CompileCase("stats-fp16-d128-gqa2", partial(_compile, torch.float16, 4, 2, 128), KERNELS),
    CompileCase("stats-bf16-d64", partial(_compile, torch.bfloat16, 2, 2, 64), KERNELS),
    CompileCase("stats-fp32-d80-gqa2", partial(_compile, torch.float32, 2, 1, 80), KERNELS),
    # The widest head the kernels take, where the default tiles are narrowed to fit shared memory.
    CompileCase("stats-bf16-d256-gqa2", partial(_compile, torch.bfloat16, 4, 2, 256), KERNELS),
]

# fp32 inputs still accumulate in a different order than the reference.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}
COLUMNS = (
    Column("segment", "", "prompt segment"),
    Column("tokens", "", "tokens in the segment"),
    Column("kernel_share", "", "share of the text queries' attention the segment receives, kernel",
           "kernel share"),
    Column("reference_share", "", "the same from the PyTorch reference", "reference share"),
    Column("max_abs_err", "", "largest |kernel - reference| of a key's attention sum", "max abs err"),
    Column("ok", "", "within the tolerance"),
)


def synthetic_qk(seed: int, heads: int, kv_heads: int, head_dim: int, system_tokens: int,
                 visual_tokens: int, text_tokens: int, salient: int = 4):
    """Q/K with the shape of a VLM prompt: visual keys of low rank plus a few
    salient visual tokens that text queries single out."""
    g = torch.Generator().manual_seed(seed)
    n = system_tokens + visual_tokens + text_tokens
    k = torch.randn(kv_heads, n, head_dim, generator=g)
    basis = torch.randn(kv_heads, 8, head_dim, generator=g)
    coeff = torch.randn(kv_heads, visual_tokens, 8, generator=g)
    vis = slice(system_tokens, system_tokens + visual_tokens)
    k[:, vis] = coeff @ basis / 8 ** 0.5 + 0.1 * torch.randn(kv_heads, visual_tokens, head_dim, generator=g)
    hot = system_tokens + torch.randperm(visual_tokens, generator=g)[:salient]
    direction = torch.randn(head_dim, generator=g)
    k[:, hot] += direction
    q = torch.randn(heads, n, head_dim, generator=g)
    q[:, system_tokens + visual_tokens:] += 0.5 * direction
    return q, k, hot


def selftest(seed: int = 0, dtype: str = "float32", heads: int = 8, kv_heads: int = 2, head_dim: int = 64,
             system_tokens: int = 16, visual_tokens: int = 256, text_tokens: int = 48) -> dict:
    """The kernels over the post-vision text queries of a synthetic prompt
    [system | image | text]: the attention each key receives against the
    reference, summed per segment."""
    torch_dtype = common.dtype(dtype)
    device = runtime.device()
    q, k, hot = synthetic_qk(seed, heads, kv_heads, head_dim, system_tokens, visual_tokens, text_tokens)
    q_start = system_tokens + visual_tokens
    q = q[:, q_start:].to(device=device, dtype=torch_dtype).contiguous()
    k = k.to(device=device, dtype=torch_dtype).contiguous()

    post_vision = post_vision_rows(q_start, q_start + text_tokens, device=device)
    t0 = time.perf_counter()
    got = attention_stats(q, k, post_vision).attn_sum
    if device.type == "cuda":
        torch.cuda.synchronize()
    kernel_s = time.perf_counter() - t0
    want = reference.attention_stats(q, k, post_vision).attn_sum
    err = (got - want).abs().max().item()
    tol = TOLERANCE[torch_dtype]

    rows = heads * text_tokens
    segments = []
    for name, lo, hi in (("system", 0, system_tokens), ("visual", system_tokens, q_start),
                         ("text", q_start, q_start + text_tokens)):
        segments.append({
            "segment": name,
            "tokens": hi - lo,
            "kernel_share": got[:, lo:hi].sum().item() / rows,
            "reference_share": want[:, lo:hi].sum().item() / rows,
            "max_abs_err": (got[:, lo:hi] - want[:, lo:hi]).abs().max().item(),
        })
        segments[-1]["ok"] = segments[-1]["max_abs_err"] <= tol
    top = got.sum(0).topk(len(hot)).indices.sort().values
    return {
        "title": f"attention mass of {text_tokens} post-vision text queries over {q_start + text_tokens} keys "
                 f"({heads} heads, {kv_heads} kv heads, head_dim {head_dim}, {dtype})",
        **table(COLUMNS, segments),
        "notes": [f"salient visual tokens {sorted(hot.tolist())}, kernel's top tokens {top.tolist()}"],
        "salient_tokens": sorted(hot.tolist()),
        "top_kernel_tokens": top.tolist(),
        "max_abs_err": err,
        "tolerance": tol,
        "verdict": f"max abs error {err:.2e} (tolerance {tol:g})",
        "ok": err <= tol,
        "kernel_seconds": kernel_s,
    }
