"""The worker process as the host sees it: frames on two pipes, nothing else."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from kernels_py.runtime import protocol

KERNELS_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Worker:
    def __init__(self, root=KERNELS_ROOT):
        host_r, worker_w = os.pipe()
        worker_r, host_w = os.pipe()
        env = dict(os.environ, PYTHONPATH=root, VLKV_WORKER_FDS=f"{worker_r},{worker_w}")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kernels_py.runtime.worker"],
            env=env, pass_fds=(worker_r, worker_w), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=root,
        )
        os.close(worker_r)
        os.close(worker_w)
        self.rx = os.fdopen(host_r, "rb", buffering=0)
        self.tx = os.fdopen(host_w, "wb", buffering=0)
        self.next_id = 0
        self.hello = protocol.read_frame(self.rx)

    def call(self, msg_type, **fields):
        self.next_id += 1
        protocol.write_frame(self.tx, {"type": msg_type, "id": self.next_id, **fields})
        reply = protocol.read_frame(self.rx)
        assert reply["id"] == self.next_id
        return reply

    def close(self):
        self.tx.close()
        self.rx.close()
        out, err = self.proc.communicate(timeout=30)
        return self.proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def _stop(w):
    if w.proc.poll() is None:
        w.proc.kill()
        w.proc.wait()


@pytest.fixture
def worker():
    w = Worker()
    yield w
    _stop(w)


@pytest.fixture(scope="module")
def shared_worker():
    """One worker for tests that leave it usable: each start imports torch."""
    w = Worker()
    yield w
    _stop(w)


def test_hello_reports_versions(worker):
    h = worker.hello
    assert h["type"] == "hello" and h["pid"] == worker.proc.pid
    assert h["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    import numpy, torch, triton

    assert h["torch"]["version"] == torch.__version__
    assert h["triton"]["version"] == triton.__version__
    assert h["numpy"]["version"] == numpy.__version__
    assert h["device"]["kind"] in ("cpu", "cuda")
    assert h["kernels_root"] == KERNELS_ROOT


def test_run_echo_and_stdout_noise(worker):
    reply = worker.call("run", job={"fn": "kernels_py.runtime.diag:noisy_echo", "args": {"lines": 50, "x": [1, 2.5, "s"]}})
    assert reply["type"] == "result"
    assert reply["result"]["echo"] == {"x": [1, 2.5, "s"]}
    assert worker.call("run", job={"fn": "kernels_py.runtime.diag:echo", "args": {"n": 3}})["result"]["echo"] == {"n": 3}
    code, out, err = worker.close()
    assert code == 0
    assert "noise line 49" in out and "err line 49" in err


@pytest.mark.parametrize(
    "job,error_type,match",
    [
        ({"fn": "kernels_py.runtime.diag:fail", "args": {"message": "boom"}}, "ValueError", "boom"),
        ({"fn": "os:system", "args": {"command": "true"}}, "kernels_py.runtime.worker.JobError", "outside"),
        ({"fn": "kernels_py.runtime.diag:nope"}, "kernels_py.runtime.worker.JobError", "no attribute"),
        ({"fn": "kernels_py.nonexistent:f"}, "ModuleNotFoundError", "nonexistent"),
        ({"fn": "kernels_py.runtime.diag:echo", "args": [1]}, "kernels_py.runtime.worker.JobError", "args must be an object"),
        ({"fn": "kernels_py.runtime.diag:sleep", "args": {"bogus": 1}}, "TypeError", "bogus"),
        ("not a job", "kernels_py.runtime.worker.JobError", "must be an object"),
    ],
)
def test_structured_errors(shared_worker, job, error_type, match):
    worker = shared_worker
    reply = worker.call("run", job=job)
    assert reply["type"] == "error"
    assert reply["error"]["type"].endswith(error_type)
    assert match in reply["error"]["message"]
    assert "Traceback" in reply["error"]["traceback"]
    # The worker carries on after a failed job.
    assert worker.call("run", job={"fn": "kernels_py.runtime.diag:echo"})["type"] == "result"


def test_an_error_from_kernels_py_code_names_its_line(shared_worker):
    """The host shows a job's error at the kernels_py line it comes from (an
    edited kernel, a method), not at the worker's own frames."""
    reply = shared_worker.call("run", job={"fn": "kernels_py.ops.attention_stats:compute",
                                           "args": {"q": 1, "k": 2, "q_pos": 3}})
    at = reply["error"]["at"]
    assert at["file"] == "kernels_py/ops/attention_stats/__init__.py" and "q.device" in at["source"], at
    assert at["line"] > 0 and "AttributeError" in at["message"]
    # The worker's own frames (plumbing) are no such line.
    reply = shared_worker.call("run", job={"fn": "kernels_py.runtime.diag:fail", "args": {"message": "boom"}})
    assert reply["error"]["at"] is None


def test_unknown_message_type(shared_worker):
    reply = shared_worker.call("frobnicate")
    assert reply["type"] == "error" and "unknown message type" in reply["error"]["message"]


def test_garbage_frame_ends_worker_with_reason(worker):
    worker.tx.write(b"\x00\x00\x00\x05hello")
    worker.tx.flush()
    code, _, err = worker.close()
    assert code == 2
    assert "not valid JSON" in err


def test_truncated_frame_ends_worker_with_reason(worker):
    worker.tx.write(b"\x00\x00\x01\x00{\"type\"")
    code, _, err = worker.close()
    assert code == 2
    assert "truncated frame body" in err


def test_a_job_that_finds_the_gpu_unusable_is_answered_then_the_worker_exits(worker):
    reply = worker.call("run", job={"fn": "kernels_py.runtime.diag:report_lost_device", "args": {"reason": "x"}})
    assert reply["type"] == "result" and reply["result"] == {"worker_lost": "x"}
    code, _, err = worker.close()
    assert code == 4 and "the GPU is unusable (x); exiting" in err


def test_watch_check_says_when_the_gpu_is_unusable_after_its_error(monkeypatch):
    from kernels_py import watch
    from kernels_py.runtime import worker as runtime_worker

    assert "worker_lost" not in watch.check("no_such_op")  # no GPU here: nothing to lose
    monkeypatch.setattr(runtime_worker, "device_lost", lambda: "CUDA error: an illegal memory access")
    out = watch.check("no_such_op")
    assert out["error"] is not None and out["worker_lost"] == "CUDA error: an illegal memory access"


def test_shutdown(worker):
    assert worker.call("shutdown")["result"] == {"bye": True}
    assert worker.proc.wait(timeout=30) == 0


def test_reload_picks_up_edited_module(tmp_path):
    root = tmp_path / "root"
    shutil.copytree(os.path.join(KERNELS_ROOT, "kernels_py"), root / "kernels_py",
                    ignore=shutil.ignore_patterns("__pycache__", "tests"))
    mod = root / "kernels_py" / "scratch.py"
    mod.write_text("def value():\n    return 1\n")
    w = Worker(str(root))
    try:
        assert w.call("run", job={"fn": "kernels_py.scratch:value"})["result"] == 1
        mod.write_text(textwrap.dedent("""\
            def value():
                return 2
        """))
        # Without a reload the worker keeps the module it imported.
        assert w.call("run", job={"fn": "kernels_py.scratch:value"})["result"] == 1
        reloaded = w.call("reload")["result"]
        assert reloaded["changed"] == ["scratch.py"]
        assert "kernels_py.scratch" in reloaded["purged"]
        # The worker's own plumbing (and the arenas it mapped) stays loaded.
        assert not [name for name in reloaded["purged"] if name.startswith("kernels_py.runtime")]
        assert w.call("run", job={"fn": "kernels_py.scratch:value"})["result"] == 2
        assert w.call("reload")["result"] == {"changed": [], "purged": []}
    finally:
        w.close()


@pytest.mark.parametrize(
    "value,expected",
    [
        (float("nan"), None),
        ({"a": (1, 2.0)}, {"a": [1, 2.0]}),
    ],
)
def test_jsonable(value, expected):
    from kernels_py.runtime.worker import jsonable

    assert jsonable(value) == expected


def test_jsonable_tensor_and_rejects_objects():
    import torch

    from kernels_py.runtime.worker import jsonable

    assert jsonable(torch.tensor([1.0, float("inf")])) == [1.0, None]
    with pytest.raises(TypeError, match="no JSON form"):
        jsonable(object())


def test_kernels_digest_names_the_sources_a_job_imported(tmp_path):
    """A module edited after the hello but before a job imports it: the reply
    names the edited sources; an edit after the import changes nothing the
    worker runs, nor the digest."""
    import hashlib

    from kernels_py.runtime import sources

    root = tmp_path / "root"
    shutil.copytree(os.path.join(KERNELS_ROOT, "kernels_py"), root / "kernels_py",
                    ignore=shutil.ignore_patterns("__pycache__", "tests"))
    package = str(root / "kernels_py")
    mod = root / "kernels_py" / "scratch.py"
    mod.write_text("def value():\n    return 1\n")
    w = Worker(str(root))
    try:
        hello = w.hello["kernels"]
        assert hello["digest"] == sources.digest(sources.scan(package))
        assert hello["sha256"]["scratch.py"] == hashlib.sha256(mod.read_bytes()).hexdigest()

        mod.write_text("def value():\n    raise RuntimeError('edited')\n")
        reply = w.call("run", job={"fn": "kernels_py.scratch:value"})
        assert reply["type"] == "error" and "edited" in reply["error"]["message"]
        assert reply["kernels_digest"] == sources.digest(sources.scan(package)) != hello["digest"]
        assert reply["kernels_sha256"]["scratch.py"] == hashlib.sha256(mod.read_bytes()).hexdigest()

        imported = reply["kernels_digest"]
        mod.write_text("def value():\n    return 3\n")
        reply = w.call("run", job={"fn": "kernels_py.scratch:value"})
        assert reply["type"] == "error"  # the module it imported
        assert reply["kernels_digest"] == imported and "kernels_sha256" not in reply
    finally:
        w.close()


def test_tracked_imports_cache_bytecode_by_content(tmp_path):
    """The worker's bytecode cache is keyed by the source's bytes: an edit
    that keeps the file's size and mtime (which the usual cache checks) is
    still the code that runs, and the hash names it."""
    root = tmp_path / "root"
    shutil.copytree(os.path.join(KERNELS_ROOT, "kernels_py"), root / "kernels_py",
                    ignore=shutil.ignore_patterns("__pycache__", "tests"))
    mod = root / "kernels_py" / "scratch.py"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = str(root)
    script = textwrap.dedent("""\
        from kernels_py.runtime import sources
        tracker = sources.track()
        import kernels_py.scratch
        print(kernels_py.scratch.VALUE, tracker.imported["scratch.py"])
    """)

    def run():
        out = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True, check=True)
        return out.stdout.split()

    import hashlib

    mod.write_text("VALUE = 1\n")
    stat = mod.stat()
    assert run() == ["1", hashlib.sha256(b"VALUE = 1\n").hexdigest()]
    cached = list((root / "kernels_py" / "__pycache__").glob("scratch.*.pyc"))
    assert cached, "no bytecode cached"
    assert run()[0] == "1"  # from the cache
    mod.write_text("VALUE = 2\n")
    os.utime(mod, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert run() == ["2", hashlib.sha256(b"VALUE = 2\n").hexdigest()]
