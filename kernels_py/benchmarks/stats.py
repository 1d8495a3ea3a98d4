"""`workbench bench stats`: the attention-statistics pipeline (three Triton
kernels, kernels_py.triton.attention_stats) against (i) PyTorch materialising
softmax(QK^T) for the same rows and reducing it, and (ii) one
scaled_dot_product_attention forward over the same rows.

Batch is folded into the heads (head b*H + h reads kv head b*H_kv + h // group),
so one launch covers the batch. Rows are the last `rows` prompt positions (the
post-vision span of a VL-Cache prompt).
"""

import time

import torch
import torch.nn.functional as F

from kernels_py import runtime
from kernels_py.triton.attention_stats import attention_stats, recent_rows

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _materialize(q, k, q_pos, p):
    """The unfused baseline: the whole [heads, rows, keys] probability matrix."""
    group = q.shape[0] // k.shape[0]
    scores = (q.float() @ k.float().repeat_interleave(group, dim=0).transpose(1, 2)) * q.shape[-1] ** -0.5
    visible = torch.arange(k.shape[1], device=q.device)[None, :] <= q_pos[:, None]
    attn = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    below = ((attn < p * attn.amax(-1, keepdim=True)) & visible).sum(1)
    return attn.sum(1), below


def _sdpa(q, k, v, q_pos):
    group = q.shape[0] // k.shape[0]
    visible = torch.arange(k.shape[1], device=q.device)[None, :] <= q_pos[:, None]
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=visible, enable_gqa=group > 1)


def _time(fn, repeat: int, cuda: bool) -> float:
    """Median seconds of fn() after one warm-up call (which also compiles)."""
    fn()
    times = []
    for _ in range(repeat):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _peak(fn, cuda: bool):
    """Extra device memory fn allocates at its peak (bytes), on CUDA; else None."""
    if not cuda:
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def run(lengths=(1024, 4096, 16384, 65536, 131072), batches=(1, 4, 16), rows: int = 50, heads: int = 32,
        kv_heads: int = 8, head_dim: int = 128, dtype: str = "float16", repeat: int = 10, p: float = 0.01,
        seed: int = 0) -> dict:
    """Time the three paths for every (prompt length, batch); returns {"rows": [...]}."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    device = runtime.device()
    cuda = device.type == "cuda"
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for n in lengths:
        if rows > n:
            raise ValueError(f"rows ({rows}) exceed the prompt length {n}")
        q_pos = recent_rows(n, rows, device=device)
        for b in batches:
            q = torch.randn(b * heads, rows, head_dim, generator=g).to(device, DTYPES[dtype])
            k = torch.randn(b * kv_heads, n, head_dim, generator=g).to(device, DTYPES[dtype])
            v = torch.randn_like(k)
            stats = lambda: attention_stats(q, k, q_pos, p)  # noqa: E731
            mat = lambda: _materialize(q, k, q_pos, p)  # noqa: E731
            sdpa = lambda: _sdpa(q, k, v, q_pos)  # noqa: E731
            row = {"prompt_len": n, "batch": b, "rows": rows, "heads": heads, "kv_heads": kv_heads,
                   "head_dim": head_dim, "dtype": dtype,
                   "stats_seconds": _time(stats, repeat, cuda),
                   "materialize_seconds": _time(mat, repeat, cuda),
                   "sdpa_seconds": _time(sdpa, repeat, cuda),
                   "stats_peak_bytes": _peak(stats, cuda),
                   "materialize_peak_bytes": _peak(mat, cuda),
                   "sdpa_peak_bytes": _peak(sdpa, cuda)}
            # K is read twice (row stats, column stats): the bytes the pipeline must move.
            row["stats_gbps"] = 2 * k.numel() * k.element_size() / row["stats_seconds"] / 1e9
            row["stats_vs_sdpa"] = row["stats_seconds"] / row["sdpa_seconds"]
            row["materialize_vs_stats"] = row["materialize_seconds"] / row["stats_seconds"]
            out.append(row)
            del q, k, v
            if cuda:
                torch.cuda.empty_cache()
    return {"device": device.type, "interpreter": runtime.interpreter_mode(), "rows": out}


def smoke_sizes() -> dict:
    """Sizes small enough for the CPU interpreter: proves the benchmark runs."""
    return {"lengths": [256], "batches": [1], "rows": 16, "heads": 4, "kv_heads": 2, "head_dim": 64,
            "dtype": "float32", "repeat": 2}
