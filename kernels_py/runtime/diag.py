"""Jobs that exercise the worker itself: `workbench worker-ping` and the
host's tests use them to check round trips, errors, crashes and timeouts."""

import os
import signal
import sys
import time


def echo(**payload):
    """Return the job's arguments unchanged, with the worker's pid."""
    return {"echo": payload, "pid": os.getpid()}


def noisy_echo(lines: int = 100, **payload):
    """Print to stdout and stderr before answering: output of user code must not
    corrupt the host channel."""
    for i in range(lines):
        print(f"noise line {i} \x00\xff {{not a frame}}")
        print(f"err line {i}", file=sys.stderr)
    sys.stdout.flush()
    return echo(**payload)


def sleep(seconds: float = 1.0):
    time.sleep(seconds)
    return {"slept": seconds}


def fail(message: str = "requested failure"):
    raise ValueError(message)


def crash(message: str = "worker crashing on request", code: int = 0):
    """Die mid-job the way a segfaulting kernel would: no reply, no cleanup."""
    print(message, file=sys.stderr, flush=True)
    if code:
        os._exit(code)
    os.kill(os.getpid(), signal.SIGKILL)


def crash_once(marker: str):
    """Crash the first time (leaving a marker file), succeed afterwards: a job
    that a retry on a fresh worker rescues."""
    if not os.path.exists(marker):
        with open(marker, "w"):
            pass
        crash("crashing once")
    return {"second_try": True}


def lose_device():
    """Fail as a kernel that broke the CUDA context does (an illegal address):
    the job raises, and every later CUDA call in this process raises too.
    Simulated on any machine by replacing torch.cuda's calls in this worker."""
    import torch

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")

    class BrokenStream:
        query = synchronize = staticmethod(broken)

    torch.cuda.is_available = lambda: True
    torch.cuda.is_initialized = lambda: True
    torch.cuda.synchronize = broken
    torch.cuda.current_stream = lambda *args, **kwargs: BrokenStream()
    broken()


def report_lost_device(reason: str = "simulated"):
    """Return as a job that caught its own failure and found the GPU unusable
    does (watch's check): the worker replies, then exits."""
    return {"worker_lost": reason}
