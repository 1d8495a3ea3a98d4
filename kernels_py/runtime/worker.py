"""Long-lived worker process driven by the Go host (gohost/worker).

Run as `python -m kernels_py.runtime.worker`. The host passes two pipe file descriptors
and a unix socket in VLKV_WORKER_FDS ("READ,WRITE,SOCKET"); frames
(kernels_py.runtime.protocol) travel only on the pipes, arena file descriptors
(SCM_RIGHTS) on the socket, so anything user code prints to stdout or stderr cannot corrupt the
channel. The host keeps the tail of stdout/stderr to explain a crash.

Messages from the host:   {"type": "run", "id": N, "job": {"fn": "kernels_py.mod:func", "args": {...},
                                                          "scratch": {"arena", "offset", "size"}?}}
                          {"type": "map_arena", "id": N, "arena": {"id", "size"}}, its fd on the socket
                          {"type": "unmap_arena", "id": N, "arena": {"id"}}
                          {"type": "reload", "id": N}
                          {"type": "shutdown", "id": N}
Replies:                  {"type": "result", "id": N, "result": ...}
                          {"type": "error", "id": N, "error": {"type", "message", "traceback", "at"}}
The worker speaks first with {"type": "hello", ...} once it is ready; the hello's "kernels" holds the
digest and per-file hashes of the kernels_py sources it runs (kernels_py.runtime.sources). Replies to
"run" carry "kernels_digest", the digest as of that job's end, and "kernels_sha256" when it differs
from the digest last sent: a module the job imported may have been edited since the hello.
"""

import hashlib
import importlib
import linecache
import math
import os
import platform
import socket
import sys
import sysconfig
import time
import traceback

from kernels_py.runtime import protocol, sources

PACKAGE = "kernels_py"
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The worker's own plumbing (the running loop, the arenas it has mapped) stays
# loaded across a reload; research code is what gets edited.
_PINNED_PREFIX = f"{PACKAGE}.runtime"


class JobError(Exception):
    """A job message that cannot be run as written."""


def source_digests(root: str = PACKAGE_DIR) -> dict:
    """Content hash of every .py file under the package, keyed by relative path."""
    digests = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path, "rb") as f:
                    digests[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return digests


def _version(module_name: str):
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a missing or broken install is reported, not fatal
        return {"version": None, "error": f"{type(e).__name__}: {e}"}
    return {"version": getattr(module, "__version__", None)}


def _triton_cache_dir():
    try:
        from triton import knobs

        return knobs.cache.dir
    except Exception:
        return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def python_headers() -> dict:
    """Triton compiles a small CPython extension (its kernel launcher) before the
    first GPU launch; that needs Python.h where sysconfig says it is."""
    include = sysconfig.get_paths(scheme=sysconfig.get_default_scheme())["include"]
    return {"include": include, "present": os.path.isfile(os.path.join(include, "Python.h"))}


def hello(tracker=None) -> dict:
    from kernels_py import runtime

    info = {
        "type": "hello",
        "pid": os.getpid(),
        "python": {
            "version": platform.python_version(),
            "executable": sys.executable,
            "prefix": sys.prefix,
            "headers": python_headers(),
        },
        "torch": _version("torch"),
        "triton": _version("triton"),
        "numpy": _version("numpy"),
        "kernels_root": os.path.dirname(PACKAGE_DIR),
        "interpreter": runtime.interpreter_mode(),
        "triton_cache_dir": _triton_cache_dir(),
    }
    import torch

    kind = runtime.device_kind()
    cuda_ok = torch.cuda.is_available()
    device = {"kind": kind, "cuda_available": cuda_ok, "torch_cuda": torch.version.cuda, "names": []}
    if cuda_ok:
        device["names"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if unusable := runtime.unusable_device():
        info["error"] = unusable
    info["device"] = device
    if tracker is not None:
        tracker.rescan()  # as late as can be: what no import has read yet is hashed as it is now
        info["kernels"] = {"digest": tracker.digest(), "sha256": tracker.hashes()}
    return info


def jsonable(value):
    """Turn a job's return value into JSON: tensors in a mapped arena become
    {"__tensor__": descriptor} references, other tensors and arrays become
    lists, non-finite floats become None (JSON has no NaN)."""
    from kernels_py.runtime import arena

    if isinstance(value, arena.ArenaTensor):
        return {"__tensor__": value.desc}
    desc = arena.describe(value)
    if desc is not None:
        return {"__tensor__": desc}
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "tolist"):  # torch.Tensor, numpy arrays and scalars
        return jsonable(value.tolist())
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"job returned a {type(value).__name__}, which has no JSON form")


def resolve_function(fn: str):
    if not isinstance(fn, str) or ":" not in fn:
        raise JobError(f"job fn must look like 'kernels_py.module:function', got {fn!r}")
    module_name, _, attr = fn.partition(":")
    if module_name != PACKAGE and not module_name.startswith(PACKAGE + "."):
        raise JobError(f"job fn {fn!r} is outside the {PACKAGE} package")
    module = importlib.import_module(module_name)
    target = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise JobError(f"module {module_name} has no attribute {attr!r}") from None
    if not callable(target):
        raise JobError(f"{fn} is not callable")
    return target


def run_job(job) -> object:
    from kernels_py.runtime import arena

    if not isinstance(job, dict):
        raise JobError(f"job must be an object, got {type(job).__name__}")
    args = job.get("args") or {}
    if not isinstance(args, dict):
        raise JobError(f"job args must be an object, got {type(args).__name__}")
    fn = resolve_function(job.get("fn"))
    with arena.scratch(job.get("scratch")):
        return jsonable(fn(**arena.decode_args(args)))


def map_arena(sock, info) -> dict:
    from kernels_py.runtime import arena

    if not isinstance(info, dict):
        raise JobError("map_arena needs an arena object")
    _, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise JobError(f"map_arena: expected one file descriptor on the socket, got {len(fds)}")
    arena.map_arena(info.get("id"), fds[0], info.get("size"))
    return {"mapped": arena.mapped()}


def pipe_double(rx, nbytes):
    """The baseline of `workbench bench exchange`: the tensor's bytes come
    through the pipe, are doubled as float32 and go back the same way."""
    import time

    import torch

    if not isinstance(nbytes, int) or nbytes < 0 or nbytes % 4:
        raise protocol.ProtocolError(f"pipe_double needs a whole number of float32s, got {nbytes!r} bytes")
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        n = rx.readinto(view[got:])
        if not n:
            raise protocol.ProtocolError(f"truncated blob: {got} of {nbytes} bytes")
        got += n
    t0 = time.perf_counter()
    if nbytes:
        torch.frombuffer(buf, dtype=torch.float32).mul_(2)
    return {"compute_seconds": time.perf_counter() - t0}, buf


def unmap_arena(info) -> dict:
    import gc

    from kernels_py.runtime import arena

    arena.unmap_arena((info or {}).get("id"))
    gc.collect()  # drop tensors of finished jobs, so the pages go with them
    return {"mapped": arena.mapped()}


class Reloader:
    """Tracks kernels_py sources; on reload, forgets every package module so the
    next job imports the edited code (and everything that imports it) afresh."""

    def __init__(self):
        self.digests = source_digests()

    def reload(self) -> dict:
        current = source_digests()
        changed = sorted(p for p in current.keys() | self.digests.keys() if current.get(p) != self.digests.get(p))
        purged = []
        if changed:
            for name in sorted(sys.modules):
                pinned = name == _PINNED_PREFIX or name.startswith(_PINNED_PREFIX + ".")
                if (name == PACKAGE or name.startswith(PACKAGE + ".")) and not pinned:
                    del sys.modules[name]
                    purged.append(name)
            importlib.invalidate_caches()
            linecache.checkcache()
        self.digests = current
        return {"changed": changed, "purged": purged}


def error_payload(exc: BaseException) -> dict:
    cls = type(exc)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    try:  # the kernels_py line it comes from (an interpreted kernel's own line, not Triton's frames)
        from kernels_py.runtime.errors import locate

        at = locate(exc)
    except Exception:  # noqa: BLE001 - a report that fails must not hide the error it reports
        at = None
    return {
        "type": name,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(cls, exc, exc.__traceback__)),
        "at": at,
    }


DEVICE_CHECK_SECONDS = 10.0  # how long a failed job's queued GPU work may take to finish


def device_lost() -> str | None:
    """Why this process can run no more work on its GPU, after a job failed;
    None if it can. A kernel that reads out of bounds (an illegal address), a
    failed launch or a device-side assert leave the CUDA context broken, and
    every later CUDA call fails with the same error; a kernel that never ends
    holds the GPU: either way the worker must go, or each job after it fails
    for what an earlier one did. Polls the stream (a synchronize would wait
    forever on a kernel that never ends)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    deadline = time.monotonic() + DEVICE_CHECK_SECONDS
    try:
        while not torch.cuda.current_stream().query():  # raises a broken context's error
            if time.monotonic() > deadline:
                return (f"the GPU had not finished the failed job's work {DEVICE_CHECK_SECONDS:g} s after the job "
                        f"failed (a kernel that never ends?)")
            time.sleep(0.005)
    except Exception as e:  # noqa: BLE001 - any failure here means the context is gone
        return (str(e).strip().splitlines() or [type(e).__name__])[0]
    return None


def serve(rx, tx, sock=None) -> int:
    tracker = sources.track()
    reloader = Reloader()
    info = hello(tracker)
    protocol.write_frame(tx, info)
    if "error" in info:
        return 3
    sent = info["kernels"]["digest"]
    while True:
        try:
            msg = protocol.read_frame(rx)
        except protocol.ProtocolError as e:
            print(f"vlkv worker: {e}; exiting", file=sys.stderr, flush=True)
            return 2
        if msg is None:  # host went away
            return 0
        kind, msg_id = msg.get("type"), msg.get("id")
        code = {}  # a run's reply says what code ran it, whatever the job's end
        lost = None  # why the GPU is unusable after this job: reply, then exit
        try:
            if kind == "run":
                try:
                    result = run_job(msg.get("job"))
                finally:
                    code = {"kernels_digest": tracker.digest()}
                    if code["kernels_digest"] != sent:
                        code["kernels_sha256"] = tracker.hashes()
                        sent = code["kernels_digest"]
                reply = {"type": "result", "id": msg_id, "result": result, **code}
                if isinstance(result, dict):  # a job that caught its failure itself (watch's check) says so
                    lost = result.get("worker_lost")
            elif kind == "pipe_double":
                result, blob = pipe_double(rx, msg.get("blob", 0))
                encoded = protocol.encode_frame({"type": "result", "id": msg_id, "result": result, "blob": len(blob)})
                tx.write(encoded)
                tx.write(blob)
                tx.flush()
                continue
            elif kind == "map_arena":
                reply = {"type": "result", "id": msg_id, "result": map_arena(sock, msg.get("arena"))}
            elif kind == "unmap_arena":
                reply = {"type": "result", "id": msg_id, "result": unmap_arena(msg.get("arena"))}
            elif kind == "reload":
                reply = {"type": "result", "id": msg_id, "result": reloader.reload()}
            elif kind == "shutdown":
                protocol.write_frame(tx, {"type": "result", "id": msg_id, "result": {"bye": True}})
                return 0
            else:
                raise JobError(f"unknown message type {kind!r}")
            encoded = protocol.encode_frame(reply)
        except protocol.ProtocolError as e:  # the byte stream is out of step: stop
            print(f"vlkv worker: {e}; exiting", file=sys.stderr, flush=True)
            return 2
        except Exception as e:  # every failure of a job becomes a structured error
            error = error_payload(e)
            if lost := device_lost():
                error["worker_lost"] = lost
            encoded = protocol.encode_frame({"type": "error", "id": msg_id, "error": error, **code})
        tx.write(encoded)
        tx.flush()
        if lost:  # the host starts a fresh worker for the next job
            print(f"vlkv worker: the GPU is unusable ({lost}); exiting", file=sys.stderr, flush=True)
            return 4


def main() -> int:
    fds = os.environ.get("VLKV_WORKER_FDS", "")
    try:
        read_fd, write_fd, *rest = (int(x) for x in fds.split(","))
    except ValueError:
        print("kernels_py.runtime.worker is started by the workbench host (VLKV_WORKER_FDS is not set)", file=sys.stderr)
        return 2
    sock = socket.socket(fileno=rest[0]) if rest else None
    with os.fdopen(read_fd, "rb", buffering=0) as rx, os.fdopen(write_fd, "wb", buffering=0) as tx:
        return serve(rx, tx, sock)


if __name__ == "__main__":
    # Run the imported module rather than __main__, so names (JobError in error
    # types, the pinned module set) are the same as everywhere else.
    from kernels_py.runtime.worker import main as _main

    sys.exit(_main())
