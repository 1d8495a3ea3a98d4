"""What every kernel benchmark shares: knobs as parameters, columns that
describe its rows, sizes small enough for the CPU interpreter, rows that run
out of memory skipped with the reason, and the timing helpers.

A benchmark is a frozen dataclass of knobs (its parameters, which become
`workbench bench NAME` flags) with `columns`, `cases()` (one per row: the
sizes) and `measure(case)` (the rest of the row). The runner
(kernels_py.benchmarks.run) does the rest.
"""

import sys
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable

import torch
import torch.nn.functional as F

from kernels_py.params import Knobs, knob
from kernels_py.tables import Column

# HBM bandwidth of the GPUs the project runs on, GB/s (vendor figures), by a
# substring of torch's device name; the first match wins.
HBM_PEAK_GBPS = (("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("A100-SXM4-80GB", 2039.0),
                 ("A100 80GB PCIe", 1935.0), ("A100", 1555.0), ("L40S", 864.0), ("L4", 300.0))


class Benchmark(Knobs):
    """Base of every benchmark; subclasses are frozen dataclasses of knobs."""

    name: ClassVar[str]
    columns: ClassVar[tuple[Column, ...]]
    # On the CPU interpreter, values for the knobs the user did not set: a size
    # that shows the benchmark works (its timings are not kernel speed).
    smoke: ClassVar[dict[str, Any]] = {}

    @classmethod
    def owner_name(cls) -> str:
        return f"benchmark {cls.name!r}"

    def cases(self) -> Iterable[dict]:
        """One dict per row: the values that say which size it is."""
        raise NotImplementedError

    def measure(self, case: dict) -> dict:
        """The rest of the row for one case."""
        raise NotImplementedError

    @classmethod
    def describe(cls) -> dict:
        """The benchmark as the schema carries it: `long` is its module's docstring."""
        return {"doc": cls.summary(), "long": sys.modules[cls.__module__].__doc__ or "", "params": cls.schema(),
                "columns": [c.describe() for c in cls.columns]}


@dataclass(frozen=True)
class AttentionBenchmark(Benchmark):
    """Base of the benchmarks over attention inputs of one shape (GQA heads,
    head_dim, dtype), timed `repeat` times from seeded random inputs."""

    heads: int = knob("int", 32, "query heads", min=1, max=1024)
    kv_heads: int = knob("int", 8, "key/value heads; must divide heads", min=1, max=1024)
    head_dim: int = knob("int", 128, "channels per head", min=2, max=256)
    dtype: str = knob("str", "float16", "dtype of the inputs", choices=("float16", "bfloat16", "float32"))
    repeat: int = knob("int", 10, "timed runs per path after one warm-up (the median is reported)", min=1, max=10000)
    seed: int = knob("int", 0, "seed of the random inputs", min=0, max=2**31 - 1)

    # Every row says the shape it measured (hidden in the text table).
    SHAPE_COLUMNS: ClassVar[tuple[Column, ...]] = (
        Column("heads", "", "query heads", show=False),
        Column("kv_heads", "", "key/value heads", show=False),
        Column("head_dim", "", "channels per head", show=False),
        Column("dtype", "", "dtype of the inputs", show=False),
    )

    def __post_init__(self):
        super().__post_init__()
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.owner_name()}: heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads})")

    def shape(self) -> dict:
        """The SHAPE_COLUMNS of a row."""
        return {"heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim, "dtype": self.dtype}


def generator(seed: int, *case: int, device="cpu") -> torch.Generator:
    """A generator for one case, independent of the cases run before it."""
    return torch.Generator(device=device).manual_seed(hash((seed, *case)) % (2**62))


def time_median(fn, repeat: int, cuda: bool) -> float:
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


def peak_bytes(fn, cuda: bool):
    """Extra device memory fn allocates at its peak (bytes), on CUDA; else None."""
    if not cuda:
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def hbm_peak_gbps(device: torch.device) -> float | None:
    """The HBM bandwidth of the device, if it is a GPU the table knows."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((gbps for key, gbps in HBM_PEAK_GBPS if key in name), None)


def percent_of(gbps: float, peak: float | None) -> float | None:
    return None if peak is None else 100.0 * gbps / peak


def sdpa(q, k, v, attn_mask=None):
    """scaled_dot_product_attention with GQA, the FlashAttention backend forced
    where it supports the inputs; returns (out, backend name)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = q.shape[-3] != k.shape[-3]
    if q.is_cuda and attn_mask is None:
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa), "flash"
        except RuntimeError:  # no FlashAttention for these shapes/dtype: let PyTorch choose
            pass
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa), "default"


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
