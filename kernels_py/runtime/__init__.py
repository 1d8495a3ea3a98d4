"""The worker's plumbing: the worker loop and its wire protocol (worker.py,
protocol.py), tensors by reference over shared-memory arenas (arena.py), the
exchange benchmark's jobs (exchange.py) and diagnostics jobs (diag.py).

Research code (ops, methods, workloads, benchmarks) imports nothing from here
except the device helpers below (what the host decided about this worker's
device) and progress. (The ablation job, the glue between experiments and methods, also
hands results back through arena.empty.) The host sets VLKV_DEVICE (cpu or cuda) and, for cpu,
TRITON_INTERPRET=1 before the worker starts, so Triton kernels run under the
interpreter on CPU tensors.
"""

import os

import torch


def device_kind() -> str:
    kind = os.environ.get("VLKV_DEVICE", "").strip().lower()
    if kind in ("cpu", "cuda"):
        return kind
    return "cuda" if torch.cuda.is_available() else "cpu"


def device() -> torch.device:
    return torch.device(device_kind())


def unusable_device() -> str:
    """Why the device asked for cannot be used ("" when it can): cuda where torch sees no GPU."""
    if device_kind() == "cuda" and not torch.cuda.is_available():
        return ("device cuda was requested but torch sees no CUDA device "
                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
                "check the driver and CUDA_VISIBLE_DEVICES, or run with --device cpu")
    return ""


def interpreter_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# A line a job writes to stderr starting with this reaches the host's log at the info level, as it happens;
# other output is logged only with -v. Go's worker package knows the same prefix.
PROGRESS_PREFIX = "vlkv progress: "


def progress(text: str) -> None:
    """Tell the user how a long job is going (one line, shown as it is
    written; what it says also survives the run being killed)."""
    import sys

    print(PROGRESS_PREFIX + " ".join(text.splitlines()), file=sys.stderr, flush=True)
