import os

import pytest
import torch

# Without a GPU, kernels run under Triton's CPU interpreter; it must be chosen
# before any kernel module is imported (triton.jit reads it at decoration).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("VLKV_DEVICE", "cpu")
# The benchmarks the tests run on a GPU time tiny shapes: no calibration points.
os.environ.setdefault("VLKV_CALIBRATION_FILE", "off")


@pytest.fixture
def device():
    from kernels_py import runtime

    return runtime.device()


def pytest_collection_modifyitems(session, config, items):
    """Start test_estimate's compiling children as soon as its tests are
    collected: they compile for a GPU target while the other tests run.
    Under pytest-xdist every worker collects every test, so there the
    fixtures start them in the one worker that runs test_estimate (with
    `--dist loadfile`; see README "Tests on a GPU")."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if any(item.nodeid.split("::")[0].endswith("test_estimate.py") for item in items):
        from kernels_py.tests import test_estimate

        test_estimate.start_children()
