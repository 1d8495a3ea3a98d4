"""Which implementation a method's hot path runs: the Triton kernel or its
plain-PyTorch reference (same contract, kernels_py/ref/).

"auto" picks the kernel on CUDA tensors and the reference on CPU tensors: on a
machine without a GPU the kernels run under the Triton interpreter, which is
right for testing them (kernels_py/tests) but hundreds of times too slow for
experiment grids. "triton" forces the kernel (interpreted on CPU), "torch" the
reference; policies expose the choice as a `backend` knob so it is recorded
with every result.
"""

import torch

BACKENDS = ("auto", "triton", "torch")


def use_triton(backend: str, device: torch.device | str) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return torch.device(device).type == "cuda"
    return backend == "triton"
