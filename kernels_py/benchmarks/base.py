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

from kernels_py import runtime
from kernels_py.ops import common
from kernels_py.params import Knobs, Rule, knob
from kernels_py.tables import Column

# HBM bandwidth of the GPUs the project runs on, GB/s (vendor figures), by a
# substring of torch's device name; the first match wins.
HBM_PEAK_GBPS = (("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("A100-SXM4-80GB", 2039.0),
                 ("A100 80GB PCIe", 1935.0), ("A100", 1555.0), ("L40S", 864.0), ("L4", 300.0))


class Benchmark(Knobs):
    """Base of every benchmark; subclasses are frozen dataclasses of knobs."""

    name: ClassVar[str]
    columns: ClassVar[tuple[Column, ...]]
    # On the CPU interpreter, tiny values that show the benchmark works (its
    # timings are not kernel speed), in groups of knobs that must agree: a
    # group applies only when the user set none of its knobs.
    smoke: ClassVar[tuple[dict[str, Any], ...]] = ()

    @classmethod
    def owner_name(cls) -> str:
        return f"benchmark {cls.name!r}"

    @classmethod
    def smoke_sizes(cls) -> dict[str, Any]:
        """Every smoke value at once: the tiny case."""
        return {k: v for group in cls.smoke for k, v in group.items()}

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
                "rules": cls.rules_schema(), "columns": [c.describe() for c in cls.columns]}


@dataclass(frozen=True)
class Inputs:
    """What one case of an AttentionBenchmark measures on."""

    tokens: int  # the case's length
    batch: int
    device: torch.device
    cuda: bool
    dtype: torch.dtype
    generator: torch.Generator  # on device, seeded for this case alone


@dataclass(frozen=True)
class AttentionBenchmark(Benchmark):
    """Base of the benchmarks over attention inputs of one shape (GQA heads,
    head_dim, dtype), timed `repeat` times from seeded random inputs, one row
    per (length, batch): subclasses have `lengths` and `batches` knobs and
    name the row key of a length (`length_column`)."""

    length_column: ClassVar[str]

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

    RULES = (Rule("heads % kv_heads == 0", "heads ({heads}) must be a multiple of kv_heads ({kv_heads})"),)

    def shape(self) -> dict:
        """The SHAPE_COLUMNS of a row."""
        return {"heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim, "dtype": self.dtype}

    def cases(self):
        return ({self.length_column: n, "batch": b} for n in self.lengths for b in self.batches)

    def inputs(self, case: dict) -> Inputs:
        device = runtime.device()
        n, b = case[self.length_column], case["batch"]
        g = torch.Generator(device=device).manual_seed(hash((self.seed, n, b)) % (2**62))
        return Inputs(n, b, device, device.type == "cuda", common.dtype(self.dtype), g)


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
