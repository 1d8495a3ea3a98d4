"""DLPack export of arena tensors, in-process: an arena here is a temporary
file mapped the way the worker maps the host's memfd."""

import gc
import os
import tempfile

import numpy as np
import pytest
import torch

from kernels_py.runtime import arena

ARENA_ID = 41
SIZE = 1 << 16


@pytest.fixture
def mapped():
    with tempfile.TemporaryFile() as f:
        f.truncate(SIZE)
        arena.map_arena(ARENA_ID, os.dup(f.fileno()), SIZE)
        try:
            yield f
        finally:
            gc.collect()
            arena.unmap_arena(ARENA_ID)


def desc(dt=(2, 32, 1), shape=(2, 3), strides=None, offset=128, **extra):
    if strides is None:
        strides = [shape[1], 1] if len(shape) == 2 else [1] * len(shape)
    d = {"arena": ARENA_ID, "offset": offset, "byte_offset": 0,
         "dtype": dict(zip(("code", "bits", "lanes"), dt)), "shape": list(shape),
         "strides": list(strides), "device": {"type": 1, "id": 0}}
    d.update(extra)
    return d


@pytest.mark.parametrize("dtype,torch_dtype", [
    ((2, 32, 1), torch.float32), ((2, 16, 1), torch.float16), ((4, 16, 1), torch.bfloat16),
    ((0, 8, 1), torch.int8), ((1, 8, 1), torch.uint8), ((0, 32, 1), torch.int32), ((0, 64, 1), torch.int64),
])
def test_torch_from_dlpack_is_a_writable_shared_view(mapped, dtype, torch_dtype):
    x = arena.ArenaTensor(desc(dtype))
    t = torch.from_dlpack(x)
    assert t.dtype == torch_dtype and t.shape == (2, 3) and t.device.type == "cpu"
    t.fill_(5)
    # A second import sees the write: both are the arena's memory, not copies.
    again = torch.from_dlpack(arena.ArenaTensor(desc(dtype)))
    assert again.data_ptr() == t.data_ptr()
    assert torch.all(again == 5)
    assert arena.describe(t)["offset"] == 128


def test_strided_view(mapped):
    base = torch.from_dlpack(arena.ArenaTensor(desc(shape=(4, 6), strides=(6, 1), offset=0)))
    base.copy_(torch.arange(24, dtype=torch.float32).reshape(4, 6))
    view = torch.from_dlpack(arena.ArenaTensor(desc(shape=(6, 4), strides=(1, 6), offset=0)))
    assert torch.equal(view, base.T)


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_unconsumed_capsules_release_their_tensor(mapped, max_version):
    x = arena.ArenaTensor(desc())
    before = len(arena._live)
    capsule = x.__dlpack__(max_version=max_version)
    assert len(arena._live) == before + 1
    del capsule
    assert len(arena._live) == before


def test_consumer_releases_on_free(mapped):
    before = len(arena._live)
    t = torch.from_dlpack(arena.ArenaTensor(desc()))
    assert len(arena._live) == before + 1
    del t
    gc.collect()
    assert len(arena._live) == before


def test_numpy_import_is_writable_and_shared(mapped):
    x = arena.ArenaTensor(desc())
    a = np.from_dlpack(x)
    a[...] = 7
    assert torch.all(torch.from_dlpack(x) == 7)


def test_dlpack_refuses_copies_and_devices(mapped):
    x = arena.ArenaTensor(desc())
    assert x.__dlpack_device__() == (1, 0)
    with pytest.raises(BufferError):
        x.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        x.__dlpack__(dl_device=(2, 0))


@pytest.mark.parametrize("change,match", [
    ({"offset": SIZE - 8}, "outside arena"),
    ({"arena": 7}, "not mapped"),
    ({"dtype": {"code": 2, "bits": 8, "lanes": 1}}, "unsupported dtype"),
    ({"shape": [-1, 3]}, "negative"),
    ({"strides": [3]}, "strides for 2 dimensions"),
    ({"device": {"type": 2, "id": 0}}, "not the CPU"),
    ({"byte_offset": 1}, "not aligned"),
    ({"offset": True}, "must be an integer"),
    ({"shape": [1 << 62, 1 << 62]}, "outside arena"),
    # In bounds as checked, but cut to 2 and 5 on the way into DLPack's int64s.
    ({"shape": [(1 << 64) + 2, 3], "strides": [0, 1]}, "beyond int64"),
    ({"shape": [1, 3], "strides": [(1 << 64) + 5, 1]}, "beyond int64"),
    ({"shape": [1 << 32, 1 << 32], "strides": [0, 0]}, "element count"),
])
def test_bad_descriptors(mapped, change, match):
    with pytest.raises(arena.DescriptorError, match=match):
        arena.ArenaTensor(desc(**change))


def test_empty_allocates_in_scratch(mapped):
    with pytest.raises(RuntimeError, match="no scratch region"):
        arena.empty((4,), torch.float32)
    with arena.scratch({"arena": ARENA_ID, "offset": 1024, "size": 512}):
        a = arena.empty((10,), torch.float32)
        b = arena.empty((3, 4), torch.int64)
        da, db = arena.describe(a), arena.describe(b)
        assert da["offset"] == 1024 and db["offset"] % arena.ALIGNMENT == 0 and db["offset"] >= 1064
        assert db["strides"] == [4, 1]
        with pytest.raises(MemoryError, match="no room"):
            arena.empty((1000,), torch.float32)
    with pytest.raises(arena.DescriptorError, match="outside arena"):
        with arena.scratch({"arena": ARENA_ID, "offset": SIZE - 8, "size": 64}):
            pass


def test_empty_refuses_negative_sizes_without_moving_the_region(mapped):
    with arena.scratch({"arena": ARENA_ID, "offset": 0, "size": 4096}):
        a = arena.empty((64,), torch.float32)
        a.fill_(1)
        for shape in [(-1, 64), (-64,), (2, -3)]:
            with pytest.raises(ValueError, match="non-negative"):
                arena.empty(shape, torch.float32)
        # The next tensor comes after the first, not over its last bytes.
        b = arena.empty(16, torch.float32)
        b.fill_(2)
        assert arena.describe(b)["offset"] >= 256 and b.shape == (16,)
        assert torch.all(a == 1)


_EXIT_SCRIPT = """
import os, sys, tempfile
from kernels_py.runtime import arena
import torch
f = tempfile.TemporaryFile()
f.truncate(1 << 16)
arena.map_arena(1, os.dup(f.fileno()), 1 << 16)
d = {"arena": 1, "offset": 0, "byte_offset": 0, "dtype": {"code": 2, "bits": 32, "lanes": 1},
     "shape": [4], "strides": [1], "device": {"type": 1, "id": 0}}
kept = torch.from_dlpack(arena.ArenaTensor(d))
capsule = arena.ArenaTensor(d).__dlpack__()
if sys.argv[1] == "unmapped":
    arena.unmap_arena(1)
kept.fill_(1)
"""


@pytest.mark.parametrize("case", ["mapped", "unmapped"])
def test_tensors_alive_at_exit_do_not_crash_the_interpreter(case):
    # A job may keep an imported tensor (a cache, a traceback's frames) until
    # the worker exits; module globals are cleared before such a tensor is
    # freed, and its deleter read freed memory (SIGSEGV on every exit).
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, case], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_describe_ignores_foreign_tensors(mapped):
    assert arena.describe(torch.zeros(3)) is None
    assert arena.describe("not a tensor") is None


def test_to_device_cpu_is_the_shared_view(mapped):
    x = arena.ArenaTensor(desc())
    t = arena.to_device(x, "cpu")
    assert t.data_ptr() == torch.from_dlpack(x).data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_to_device_cuda_is_one_copy(mapped):
    x = arena.ArenaTensor(desc())
    torch.from_dlpack(x).fill_(3)
    g = arena.to_device(x, "cuda")
    torch.cuda.synchronize()
    assert g.device.type == "cuda" and torch.all(g.cpu() == 3)


def test_map_checks_size_and_duplicates(mapped):
    with pytest.raises(ValueError, match="already mapped"):
        arena.map_arena(ARENA_ID, os.dup(mapped.fileno()), SIZE)
    with pytest.raises(ValueError, match="host announced"):
        arena.map_arena(ARENA_ID + 1, os.dup(mapped.fileno()), SIZE * 2)
    with pytest.raises(ValueError, match="not mapped"):
        arena.unmap_arena(12345)
