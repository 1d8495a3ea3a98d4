import os

import pytest
import torch

# Without a GPU, kernels run under Triton's CPU interpreter; it must be chosen
# before any kernel module is imported (triton.jit reads it at decoration).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("VLKV_DEVICE", "cpu")


@pytest.fixture
def device():
    from kernels_py import runtime

    return runtime.device()
