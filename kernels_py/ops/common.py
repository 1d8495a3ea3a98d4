"""What the launchers of every op share, in one place: dtype tables, block
sizes, the softmax-scale check, the differences between compiled Triton and
its CPU interpreter, and the choice between a kernel and its reference."""

import math
import warnings

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from kernels_py.runtime import interpreter_mode

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Names as knobs, flags and job messages spell them.
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
FLOAT_DTYPES = tuple(DTYPES.values())
INDEX_DTYPES = (torch.int32, torch.int64)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}

# Which implementation a method's hot path runs. "auto" picks the kernel on
# CUDA tensors and the reference on CPU tensors: without a GPU the kernels run
# under the Triton interpreter, which is right for testing them but hundreds of
# times too slow for experiment grids. Methods expose the choice as a `backend`
# knob so it is recorded with every result.
BACKENDS = ("auto", "triton", "torch")


# The compute capability (e.g. 80) the launches being recorded are compiled
# for: ops.compile sets it while a case's launcher runs on CPU tensors, so a
# launcher choosing code by architecture chooses what that target gets.
_compile_target: int | None = None


def capability(device) -> int | None:
    """The compute capability a launch on `device` compiles for: the CUDA
    device's (e.g. 90), the target ops.compile is compiling for, or None
    (the interpreter)."""
    if torch.device(device).type == "cuda" and not interpreter_mode():
        major, minor = torch.cuda.get_device_capability(device)
        return 10 * major + minor
    return _compile_target


def check_launchable(t: torch.Tensor, name: str = "q") -> None:
    """Triton runs the kernels on a CUDA device, and on the CPU only under
    its interpreter (or while ops.compile records launches): say so, where
    Triton would fail with "0 active drivers"."""
    if t.device.type == "cuda" or interpreter_mode() or _compile_target is not None:
        return
    raise ValueError(f"{name} is on {t.device}: the Triton kernels run on a CUDA device, or on the CPU under "
                     f"Triton's interpreter (TRITON_INTERPRET=1, set before kernels_py is imported; `workbench "
                     f"python` sets it where there is no GPU); the op's compute(..., backend='auto') runs its "
                     f"PyTorch reference on CPU tensors instead")


def check_int32_positions(name: str, positions: torch.Tensor, used: torch.Tensor | None = None) -> None:
    """Raise ValueError where an int64 tensor of positions holds one that
    int32 cannot (the kernels narrow positions to int32, so it would wrap and
    change what a query sees); `used`: a mask of the entries that count (the
    others may hold anything). Reads values: one host sync."""
    if positions.dtype != torch.int64 or not positions.numel():
        return
    outside = (positions < -2**31) | (positions > 2**31 - 1)
    if used is not None:
        outside &= used
    if outside.any():
        bad = positions[outside]
        raise ValueError(f"{name} holds positions outside int32, in [{int(bad.min())}, {int(bad.max())}]: the kernels "
                         f"narrow positions to int32, where they would wrap")


def dtype(name: str) -> torch.dtype:
    """The torch dtype a name in DTYPES stands for."""
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def use_triton(backend: str, device: torch.device | str) -> bool:
    """Whether `backend` means the Triton kernel for tensors on `device`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return torch.device(device).type == "cuda"
    return backend == "triton"


def upcast_for_dot(dt: torch.dtype) -> bool:
    """The interpreter (Triton 3.6) computes tl.dot on bfloat16 operands as if
    they were raw 16-bit integers; kernels take this as a constexpr and cast
    such operands to float32 before tl.dot. Compiled kernels keep bf16."""
    return dt == torch.bfloat16 and interpreter_mode()


def dot_dtype(*dtypes: torch.dtype):
    """tl.dot operand dtype for inputs of these dtypes: their common 16-bit
    dtype, else float32 (mixed or float32 inputs, or bf16 under the
    interpreter, whose bf16 tl.dot is wrong: see upcast_for_dot)."""
    first = dtypes[0]
    if first != torch.float32 and all(d == first for d in dtypes) and not upcast_for_dot(first):
        return _TL_DTYPES[first]
    return tl.float32


def softmax_scale(scale, head_dim: int, name: str = "scale") -> float:
    """The softmax scale a launcher uses: head_dim ** -0.5 unless given; a
    given one must be finite and positive."""
    if scale is None:
        return head_dim ** -0.5
    value = float(scale)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite positive number, got {scale}")
    return value


def block(n: int) -> int:
    """Block size for a dimension of n: a power of two, at least tl.dot's 16."""
    return max(16, triton.next_power_of_2(n))


def check_block(name: str, value) -> int:
    """A tile size given by a caller: a power of two >= 16 (tl.dot's minimum)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's minimum), got {value!r}")
    return value


def prune_spilling(kernel, spill_bytes=None):
    """An `early_config_prune` for triton.autotune: drop the configs that
    spill registers with the arguments being tuned (spills cost local-memory
    traffic a timing run on one shape may not show, and the kernel report
    lists them as never chosen). spill_bytes(config, args, constexprs) ->
    bytes spilled per thread; default: compile the config for the GPU in use
    (what autotuning does anyway) and read the driver's count. If every
    config spills, the one spilling least is kept."""
    measure = spill_bytes or (lambda config, args, constexprs: _compiled_spills(kernel, config, args, constexprs))
    launch_keywords = ("grid", "warmup")  # Triton's own, among the launch's keywords it passes on

    def prune(configs, named_args, **launch):
        # Only the kernel's constexprs go to the compile: a second `grid` made
        # it fail, every count read 0 and nothing was pruned on a GPU.
        constexprs = {k: v for k, v in launch.items() if k not in launch_keywords}
        spilled = [(measure(c, named_args, constexprs), c) for c in configs]
        kept = [c for n, c in spilled if not n]
        return kept or [min(spilled, key=lambda nc: nc[0])[1]]

    return prune


def _compiled_spills(kernel, config, named_args: dict, constexprs: dict) -> int:
    """Spilled bytes of one config on the GPU in use; 0 when it cannot be
    told (the config is then timed like any other rather than failing the
    launch), with a warning: a silent 0 would keep every spilling config in
    the race."""
    args = [named_args[name] for name in kernel.arg_names if name in named_args]
    try:
        compiled = kernel.warmup(*args, grid=(1,), **{**constexprs, **config.all_kwargs()})
        compiled._init_handles()
    except OutOfResources:  # the timing run reports it as it always did
        return 0
    except Exception as err:  # noqa: BLE001 - anything else is a pruner that does not prune: say so
        name = getattr(kernel, "__name__", repr(kernel))
        warnings.warn(f"{name}: a config's spills could not be counted, so it is timed unpruned "
                      f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})", RuntimeWarning)
        return 0
    return int(compiled.n_spills or 0)
