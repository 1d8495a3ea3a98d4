"""Tensors in shared-memory arenas that the Go host owns.

The host allocates an arena (memfd + mmap), hands its file descriptor to the
worker, and refers to tensors in job messages by DLPack-style descriptors:
{"__tensor__": {"arena", "offset", "byte_offset", "dtype": {"code", "bits",
"lanes"}, "shape", "strides" (elements), "device"}}. The worker maps each arena
once; `ArenaTensor` exposes a descriptor through `__dlpack__` /
`__dlpack_device__`, so `torch.from_dlpack(x)` is a writable CPU tensor over
the host's memory, with no copy. `to_device(x, "cuda")` is the one explicit
copy to a GPU.

Job code may also create result tensors with `empty(shape, dtype)`: they are
bump-allocated from the scratch region the host reserved for the job and go
back to the host by reference.
"""

import contextlib
import contextvars
import ctypes
import mmap
import os

import torch

MAX_DIMS = 16
_INT64_MAX = 2**63 - 1
ALIGNMENT = 64
KDL_CPU = 1

# (code, bits, lanes) -> torch dtype; codes are DLPack's DLDataTypeCode.
_DTYPES = {
    (2, 64, 1): torch.float64, (2, 32, 1): torch.float32, (2, 16, 1): torch.float16,
    (4, 16, 1): torch.bfloat16,
    (0, 8, 1): torch.int8, (0, 16, 1): torch.int16, (0, 32, 1): torch.int32, (0, 64, 1): torch.int64,
    (1, 8, 1): torch.uint8, (6, 8, 1): torch.bool,
}
_CODES = {v: k for k, v in _DTYPES.items()}


class DescriptorError(ValueError):
    """A tensor descriptor that does not describe valid memory of a mapped arena."""


# --- DLPack ABI (dlpack.h), as ctypes structures ------------------------------

class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CapsuleDestructor]
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

_incref = ctypes.pythonapi.Py_IncRef
_incref.restype = None
_incref.argtypes = [ctypes.py_object]
_decref = ctypes.pythonapi.Py_DecRef
_decref.restype = None
_decref.argtypes = [ctypes.py_object]

# Capsule names must outlive the capsules: module-level constants.
_LEGACY = b"dltensor"
_VERSIONED = b"dltensor_versioned"

# Managed tensors handed out and not yet released, by address: the structure,
# its shape/strides arrays and the ArenaTensor (which keeps the mapping alive).
# Each also holds a reference of its own, dropped only by its deleter: a
# tensor that outlives this module (one alive when the interpreter exits,
# whose module globals go first) must still find its structure and mapping,
# or its deleter reads freed memory and the process dies of a segfault.
_live = {}


def _release_address(address, _pop=_live.pop, _decref=_decref):
    # Everything it uses is bound here: it may run while the interpreter
    # exits, after the module's globals are cleared.
    held = _pop(address, None)
    if held is not None:
        _decref(held)


@_Deleter
def _release(address, _release_address=_release_address):
    _release_address(address)


@_CapsuleDestructor
def _destroy_capsule(capsule, _names=(_LEGACY, _VERSIONED), _is_valid=_capsule_is_valid,
                     _pointer=_capsule_pointer, _release_address=_release_address):
    # A capsule nobody consumed still owns its managed tensor; a consumed one
    # was renamed "used_..." and its consumer calls the deleter instead.
    for name in _names:
        if _is_valid(capsule, name):
            _release_address(_pointer(capsule, name))
            return


# Consumers and capsules hold raw pointers to these: they must never be freed.
for _immortal in (_release, _destroy_capsule, _LEGACY, _VERSIONED):
    _incref(_immortal)
del _immortal


class Arena:
    """One host arena, mapped once into this process."""

    def __init__(self, arena_id: int, fd: int, size: int):
        self.id = arena_id
        self.size = size
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        # A ctypes view pins the mapping (no close while exported) and gives its address.
        self._anchor = (ctypes.c_char * size).from_buffer(self.mm)
        self.address = ctypes.addressof(self._anchor)


_arenas = {}


def map_arena(arena_id: int, fd: int, size: int) -> None:
    """Map an arena from a file descriptor the host sent; the descriptor is
    closed here (the mapping keeps its own reference)."""
    try:
        if arena_id in _arenas:
            raise ValueError(f"arena {arena_id} is already mapped")
        st = os.fstat(fd)
        if st.st_size < size:
            raise ValueError(f"arena {arena_id}: file holds {st.st_size} bytes, host announced {size}")
        _arenas[arena_id] = Arena(arena_id, fd, size)
    finally:
        os.close(fd)


def unmap_arena(arena_id: int) -> None:
    """Forget an arena. Its pages stay mapped while tensors still point into it."""
    if _arenas.pop(arena_id, None) is None:
        raise ValueError(f"arena {arena_id} is not mapped")


def mapped() -> list:
    return sorted(_arenas)


def _int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DescriptorError(f"{what} must be an integer, got {value!r}")
    return value


class ArenaTensor:
    """A tensor of a mapped arena, consumable through DLPack."""

    def __init__(self, desc: dict):
        if not isinstance(desc, dict):
            raise DescriptorError(f"tensor descriptor must be an object, got {type(desc).__name__}")
        arena_id = _int(desc.get("arena"), "arena")
        self.arena = _arenas.get(arena_id)
        if self.arena is None:
            raise DescriptorError(f"arena {arena_id} is not mapped in this worker (mapped: {mapped()})")
        dtype = desc.get("dtype") or {}
        key = tuple(_int(dtype.get(k), f"dtype.{k}") for k in ("code", "bits", "lanes")) if isinstance(dtype, dict) else None
        if key not in _DTYPES:
            raise DescriptorError(f"unsupported dtype {dtype!r}")
        device = desc.get("device") or {}
        if not isinstance(device, dict) or (device.get("type"), device.get("id", 0)) != (KDL_CPU, 0):
            raise DescriptorError(f"device {device!r} is not the CPU; arenas live in host memory")
        shape, strides = desc.get("shape"), desc.get("strides")
        if not isinstance(shape, list) or not isinstance(strides, list):
            raise DescriptorError("shape and strides must be lists")
        if len(shape) > MAX_DIMS or len(strides) != len(shape):
            raise DescriptorError(f"{len(strides)} strides for {len(shape)} dimensions (at most {MAX_DIMS})")
        shape = [_int(s, "shape") for s in shape]
        strides = [_int(s, "strides") for s in strides]
        offset = _int(desc.get("offset"), "offset")
        byte_offset = _int(desc.get("byte_offset", 0), "byte_offset")
        if offset < 0 or byte_offset < 0 or any(s < 0 for s in shape) or any(s < 0 for s in strides):
            raise DescriptorError(f"negative offset, size or stride in {desc!r}")
        # DLPack's fields are int64: a larger value would be cut to its low
        # 64 bits on the way out, naming other memory than was checked.
        if max([offset, byte_offset, *shape, *strides]) > _INT64_MAX:
            raise DescriptorError(f"offset, size or stride beyond int64 in {desc!r}")
        itemsize = key[1] // 8 * key[2]
        start = offset + byte_offset
        if start % itemsize:
            raise DescriptorError(f"data at byte {start} is not aligned to its {itemsize}-byte elements")
        end = start
        if all(shape):
            end = start + (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * itemsize
        if end > self.arena.size or start > self.arena.size:
            raise DescriptorError(f"bytes [{start}, {end}) fall outside arena {arena_id} of {self.arena.size} bytes")
        # Zero strides let a shape name more elements than its bytes; their
        # count must still be an int64, as the host checks it.
        count = 1
        for n in shape:
            count *= n
        if count > _INT64_MAX:
            raise DescriptorError(f"shape {shape}: element count {count} overflows int64")
        self.desc = dict(desc)
        self.dtype_key = key
        self.dtype = _DTYPES[key]
        self.shape = shape
        self.strides = strides
        self.offset = offset
        self.byte_offset = byte_offset

    def __dlpack_device__(self):
        return (KDL_CPU, 0)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if dl_device is not None and tuple(dl_device) != (KDL_CPU, 0):
            raise BufferError("arena tensors live in host memory; copy them to a device after import")
        if copy:
            raise BufferError("arena tensors are shared, not copied; import them and call .clone()")
        versioned = max_version is not None and max_version[0] >= 1
        ndim = len(self.shape)
        shape = (ctypes.c_int64 * max(ndim, 1))(*self.shape)
        strides = (ctypes.c_int64 * max(ndim, 1))(*self.strides)
        managed = (DLManagedTensorVersioned if versioned else DLManagedTensor)()
        t = managed.dl_tensor
        t.data = self.arena.address + self.offset
        t.device = DLDevice(KDL_CPU, 0)
        t.ndim = ndim
        t.dtype = DLDataType(*self.dtype_key)
        t.shape = shape
        t.strides = strides
        t.byte_offset = self.byte_offset
        managed.deleter = _release
        if versioned:
            managed.version = DLPackVersion(1, 0)
            managed.flags = 0  # writable, not a copy
        address = ctypes.addressof(managed)
        held = (managed, shape, strides, self)
        _live[address] = held
        _incref(held)
        return _capsule_new(address, _VERSIONED if versioned else _LEGACY, _destroy_capsule)

    def torch(self) -> torch.Tensor:
        return torch.from_dlpack(self)

    def __repr__(self):
        return f"ArenaTensor(arena={self.arena.id}, offset={self.offset}, dtype={self.dtype}, shape={self.shape})"


def describe(t: torch.Tensor):
    """The descriptor of a CPU tensor whose memory lies in a mapped arena, or None."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype not in _CODES:
        return None
    ptr = t.data_ptr()
    for arena in _arenas.values():
        if arena.address <= ptr < arena.address + arena.size:
            code, bits, lanes = _CODES[t.dtype]
            offset = ptr - arena.address
            return {"arena": arena.id, "offset": offset, "byte_offset": 0,
                    "dtype": {"code": code, "bits": bits, "lanes": lanes},
                    "shape": list(t.shape), "strides": list(t.stride()), "device": {"type": KDL_CPU, "id": 0}}
    return None


# --- per-job scratch allocation ------------------------------------------------

class _Scratch:
    def __init__(self, arena: Arena, offset: int, size: int):
        self.arena, self.start, self.end, self.next = arena, offset, offset + size, offset


_scratch = contextvars.ContextVar("vlkv_scratch", default=None)


@contextlib.contextmanager
def scratch(region):
    """Make `region` ({"arena", "offset", "size"}, or None) the job's scratch space."""
    if region is None:
        yield
        return
    arena = _arenas.get(_int(region.get("arena"), "scratch.arena"))
    if arena is None:
        raise DescriptorError(f"scratch arena {region.get('arena')} is not mapped in this worker")
    offset, size = _int(region.get("offset"), "scratch.offset"), _int(region.get("size"), "scratch.size")
    if offset < 0 or size < 0 or offset + size > arena.size:
        raise DescriptorError(f"scratch [{offset}, {offset + size}) falls outside arena {arena.id} of {arena.size} bytes")
    token = _scratch.set(_Scratch(arena, offset, size))
    try:
        yield
    finally:
        _scratch.reset(token)


def has_scratch() -> bool:
    """Whether the running job may return tensors by reference (empty() works)."""
    return _scratch.get() is not None


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous tensor in the job's scratch region; returned to the host by reference."""
    s = _scratch.get()
    if s is None:
        raise RuntimeError("this job has no scratch region: the host must reserve one to receive tensors")
    if dtype not in _CODES:
        raise TypeError(f"dtype {dtype} cannot live in an arena")
    shape = [int(n) for n in ((shape,) if isinstance(shape, int) else shape)]
    if any(n < 0 for n in shape):
        # Checked before the region moves: a negative size would move it
        # back over tensors already handed out.
        raise ValueError(f"empty({shape}): sizes must be non-negative")
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    start = (s.next + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    if start + nbytes > s.end:
        raise MemoryError(f"scratch region of {s.end - s.start} bytes has no room for {nbytes} more")
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    code, bits, lanes = _CODES[dtype]
    t = ArenaTensor({"arena": s.arena.id, "offset": start, "byte_offset": 0,
                     "dtype": {"code": code, "bits": bits, "lanes": lanes}, "shape": shape,
                     "strides": strides, "device": {"type": KDL_CPU, "id": 0}})
    s.next = start + nbytes  # only once the tensor is valid
    return t.torch()


def to_device(x, device) -> torch.Tensor:
    """Import an arena tensor and copy it to `device` once, through pinned
    memory when the device is a GPU."""
    t = x.torch() if isinstance(x, ArenaTensor) else x
    device = torch.device(device)
    if device.type == "cpu":
        return t
    staged = t.pin_memory() if torch.cuda.is_available() else t
    return staged.to(device, non_blocking=True)


def decode_args(value):
    """Replace {"__tensor__": descriptor} objects in job arguments with ArenaTensors."""
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return ArenaTensor(value["__tensor__"])
        return {k: decode_args(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_args(v) for v in value]
    return value
