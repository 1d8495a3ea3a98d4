"""What every kernel benchmark shares: knobs as parameters, columns that
describe its rows, sizes small enough for the CPU interpreter, rows that run
out of memory skipped with the reason, and the timing helpers.

A benchmark is a frozen dataclass of knobs (its parameters, which become
`workbench bench NAME` flags) with `columns`, `cases()` (one per row: the
sizes) and `measure(case)` (the rest of the row). The runner
(kernels_py.benchmarks.run) does the rest.
"""

import statistics
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar, Iterable

import torch
import torch.nn.functional as F

from kernels_py import runtime
from kernels_py.ops import common
from kernels_py.params import Knobs, Rule, knob
from kernels_py.tables import Column

# HBM bandwidth of the GPUs the project runs on, GB/s (vendor figures), by a
# substring of torch's device name; the first match wins.
# Matched by substring, first match: the longer names first (an H100 NVL is no H100 SXM, an L40 no L4).
HBM_PEAK_GBPS = (("GH200", 4000.0), ("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
                 ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0), ("L40S", 864.0),
                 ("L40", 864.0), ("L4", 300.0))


class Benchmark(Knobs):
    """Base of every benchmark; subclasses are frozen dataclasses of knobs."""

    name: ClassVar[str]
    columns: ClassVar[tuple[Column, ...]]
    # On the CPU interpreter, tiny values that show the benchmark works (its
    # timings are not kernel speed), in groups of knobs that must agree: a
    # group applies only when the user set none of its knobs.
    smoke: ClassVar[tuple[dict[str, Any], ...]] = ()
    # Columns a run fills only when asked (a knob turns them on): in the table only if some row has them.
    optional_columns: ClassVar[tuple[Column, ...]] = ()

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

    def run_notes(self) -> list[str]:
        """What the user should know about this run's numbers, beyond its rows
        (printed after the table)."""
        return []

    @classmethod
    def describe(cls) -> dict:
        """The benchmark as the schema carries it: `long` is its module's docstring."""
        return {"doc": cls.summary(), "long": sys.modules[cls.__module__].__doc__ or "", "params": cls.schema(),
                "rules": cls.rules_schema(),
                "columns": [c.describe() for c in cls.columns + cls.optional_columns]}


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


def time_median(fn, repeat: int, cuda: bool, graph: bool = False) -> float:
    """Median seconds of fn() after one warm-up call (which also compiles and
    autotunes). With `graph` on a GPU, fn is captured once in a CUDA graph
    and the graph is replayed, as a serving engine replays its decode step:
    the time is the GPU's, not Python's launch overhead (which at batch 8
    exceeds a decode kernel's whole time). Only a call that never waits for
    the host can be captured (the decode kernels with caller-owned
    workspaces, SDPA); one that cannot raises, since a failed capture leaves
    the CUDA context unusable for the rows after it. The unfused PyTorch
    paths are timed eagerly."""
    fn()
    run = _captured(fn) if cuda and graph else fn
    times = []
    for _ in range(repeat):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _captured(fn):
    """The replay of fn captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # libraries set up their workspaces outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as err:  # noqa: BLE001 - any capture failure: say which call and why
        raise RuntimeError(f"a timed call could not be captured in a CUDA graph (does it wait for the host?): "
                           f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from err
    return graph.replay


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


# ----------------------------------------------------------------------------
# The estimate beside each measured time (on a GPU)
# ----------------------------------------------------------------------------


def estimate_columns(prefix: str, what: str) -> tuple[Column, ...]:
    """The columns estimate_beside fills for one implementation."""
    return (
        Column(f"{prefix}_config", "", f"the config of {what} the autotuner chose (GPU only)", show=False),
        Column(f"{prefix}_est_low_ms", "ms", f"{what}: the optimistic end of the estimate from its compiled code "
               f"(`kernels report --estimate`) for that config and this row's shape (GPU only)", f"{prefix} est. low"),
        Column(f"{prefix}_est_high_ms", "ms", f"{what}: the conservative end of that estimate (GPU only)",
               f"{prefix} est. high"),
    )


ESTIMATE_ERROR = Column("estimate_error", "", "why a row has no estimate beside its time", show=False)

# How far a kernel's output may lie from its unfused baseline's, relative to
# the baseline's largest value, before the run says its times are of a wrong
# result: the two round differently in the compute dtype, and a bug is off
# by far more. (Relative to the largest value, not to 1 + |value|: decode
# outputs and column sums at long contexts are small, and a result twice too
# large must still stand out.)
OUTPUT_TOLERANCE = {"float32": 2e-3, "float16": 1e-2, "bfloat16": 4e-2}
OUTPUT_ERROR = Column("output_err", "", "largest |kernel - unfused baseline| of the output, relative to the "
                      "baseline's largest |value|, from one call (above OUTPUT_TOLERANCE the run warns: a wrong "
                      "result's time)", show=False)


def output_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The kernel's output against its unfused baseline's, as OUTPUT_ERROR says."""
    got, want = got.float(), want.float()
    if not want.numel():
        return 0.0
    return ((got - want).abs().max() / want.abs().max().clamp_min(torch.finfo(torch.float32).tiny)).item()
_COMPILED: dict = {}


def picked(tuner):
    """An autotuned kernel's choice as of now (its `fn` and `best_config`),
    for estimate_beside."""
    return SimpleNamespace(fn=tuner.fn, best_config=getattr(tuner, "best_config", None))


def estimate_beside(row: dict, prefix: str, model, implementation: str, step, measured_ms: float,
                    tuned=(), timing: str = "cuda graph", dtype: str = "float16") -> None:
    """On a GPU: the config each autotuned kernel in `tuned` chose for this
    row (Triton's best_config: pass picked(tuner) taken right after the
    timing, as the next call of the same kernel overwrites it), the
    estimate's band for the implementation at the row's shape with those
    configs, beside its measured time; and one calibration point appended
    where kernels_py.ops.calibration.destination() says, with how it was
    timed (`timing`). The estimates model float16 inputs: a row of another
    `dtype` gets neither. On the CPU interpreter the columns stay empty."""
    for key in ("config", "est_low_ms", "est_high_ms"):
        row[f"{prefix}_{key}"] = None
    device = runtime.device()
    if device.type != "cuda" or runtime.interpreter_mode() or dtype != "float16":
        return
    import triton

    from kernels_py.ops import calibration, estimate, report
    from kernels_py.ops import compile as cc

    try:
        impl = next(i for i in model.ESTIMATES if i.name == implementation)
        chosen = {t.fn.__name__: cc.config_key(t.best_config) for t in tuned if getattr(t, "best_config", None)}
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        gpu = estimate.gpu_for(name, 10 * major + minor)
        key = (implementation, impl.key(step), repr(sorted(chosen.items())), gpu.arch)
        if key not in _COMPILED:
            _COMPILED[key] = report.Compiled(impl, step, gpu.arch,
                                             select=lambda kernel, config: chosen.get(kernel, config) == config)
        band = report.estimate_implementation(impl, step, _COMPILED[key], gpu,
                                              estimate.flash_us(model.flash_bytes(step), gpu))
        code = calibration.code_digest(_COMPILED[key], band)
    except Exception as err:  # the timing stands without its estimate
        row["estimate_error"] = f"{type(err).__name__}: {err}"
        return
    configs = "; ".join(f"{k['kernel']} {k['picked']}" for k in band["kernels"] if k["autotuned"])
    row[f"{prefix}_config"] = configs or None
    row[f"{prefix}_est_low_ms"] = band["optimistic_us"] / 1e3
    row[f"{prefix}_est_high_ms"] = band["conservative_us"] / 1e3
    calibration.append({"gpu": name, "commit": _commit(), "op": model.__name__.split(".")[-2],
                        "implementation": implementation, "config": configs, "shape": _shape(step),
                        "measured_ms": measured_ms, "optimistic_ms": row[f"{prefix}_est_low_ms"],
                        "conservative_ms": row[f"{prefix}_est_high_ms"], "date": time.strftime("%Y-%m-%d"),
                        "timing": timing, "code": code, "triton": triton.__version__, "dtype": dtype})


def _shape(step) -> dict:
    from dataclasses import asdict

    return asdict(step)


def _commit() -> str:
    """The commit VLKV_COMMIT names (a checkout copied without .git: scripts/gpu-check --commit), else the
    kernels root's git commit (with + when it has local changes), or "unknown"."""
    import os
    import subprocess
    from pathlib import Path

    if named := os.environ.get("VLKV_COMMIT", "").strip():
        return named

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        # The calibration points themselves are appended under kernels_py: not a change of the code.
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "kernels_py",
                                ":!kernels_py/tests/fixtures/calibration.jsonl"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+" if dirty else "")
