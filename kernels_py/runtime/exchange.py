"""Jobs over arena tensors: the host's tests and `workbench bench exchange` use them."""

import time

import torch

from kernels_py.runtime import arena


def scale_inplace(tensors, factor: float = 2.0):
    """Multiply every tensor in place through torch.from_dlpack; bool tensors are negated."""
    for t in tensors:
        x = torch.from_dlpack(t)
        if x.dtype == torch.bool:
            x.logical_not_()
        else:
            x.mul_(factor if x.is_floating_point() else int(factor))
    return {"count": len(tensors)}


def double_inplace(x):
    """Double a tensor in place and report how long the doubling itself took."""
    t0 = time.perf_counter()
    t = torch.from_dlpack(x)
    t.mul_(2)
    return {"compute_seconds": time.perf_counter() - t0}


def arange_out(n: int, dtype: str = "float32"):
    """Allocate a result tensor in the job's scratch region and return it by reference."""
    t = arena.empty((n,), getattr(torch, dtype))
    t.copy_(torch.arange(n, dtype=t.dtype))
    return {"values": t, "sum": t.sum().item()}


def describe(x):
    """Echo what the worker sees of a tensor argument."""
    t = torch.from_dlpack(x)
    return {"dtype": str(t.dtype), "shape": list(t.shape), "strides": list(t.stride()),
            "first": t.flatten()[0].item() if t.numel() else None}
