"""`workbench selftest`: the attention-statistics kernels (the ones every
scoring method runs) on a small synthetic VLM-shaped prompt, checked against
their PyTorch reference.

The prompt is [system | image | text]; the selected query rows are the text
after the image (VL-Cache's post-vision rows). The kernels report how much
attention each key receives (`attn_sum`); the selftest sums it per segment and
compares it with the reference.
"""

import time

import torch

from kernels_py import runtime
from kernels_py.ref import attention_stats as ref
from kernels_py.triton import attention_stats as kernel

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# fp32 inputs still accumulate in a different order than the reference.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


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


def run(seed: int = 0, heads: int = 8, kv_heads: int = 2, head_dim: int = 64, system_tokens: int = 16,
        visual_tokens: int = 256, text_tokens: int = 48, dtype: str = "float32") -> dict:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    device = runtime.device()
    q, k, hot = synthetic_qk(seed, heads, kv_heads, head_dim, system_tokens, visual_tokens, text_tokens)
    q_start = system_tokens + visual_tokens
    q = q[:, q_start:].to(device=device, dtype=torch_dtype).contiguous()
    k = k.to(device=device, dtype=torch_dtype).contiguous()

    post_vision = kernel.post_vision_rows(q_start, q_start + text_tokens, device=device)
    t0 = time.perf_counter()
    got = kernel.attention_stats(q, k, post_vision).attn_sum
    if device.type == "cuda":
        torch.cuda.synchronize()
    kernel_s = time.perf_counter() - t0
    want = ref.attention_stats(q, k, post_vision).attn_sum
    err = (got - want).abs().max().item()
    tol = TOLERANCE[torch_dtype]

    segments = []
    bounds = [("system", 0, system_tokens), ("visual", system_tokens, q_start),
              ("text", q_start, q_start + text_tokens)]
    rows = heads * text_tokens
    for name, lo, hi in bounds:
        segments.append({
            "segment": name,
            "tokens": hi - lo,
            "kernel_share": got[:, lo:hi].sum().item() / rows,
            "reference_share": want[:, lo:hi].sum().item() / rows,
            "max_abs_err": (got[:, lo:hi] - want[:, lo:hi]).abs().max().item(),
        })
    top = got.sum(0).topk(len(hot)).indices.sort().values
    return {
        "device": device.type,
        "interpreter": runtime.interpreter_mode(),
        "dtype": dtype,
        "shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "query_rows": text_tokens,
                  "keys": q_start + text_tokens},
        "segments": segments,
        "salient_tokens": sorted(hot.tolist()),
        "top_kernel_tokens": top.tolist(),
        "max_abs_err": err,
        "tolerance": tol,
        "ok": err <= tol,
        "kernel_seconds": kernel_s,
    }
