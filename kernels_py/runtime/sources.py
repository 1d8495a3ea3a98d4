"""The kernels_py sources a worker runs, as the digest its results carry.

The host cannot hash them for the worker: a file edited between the host's
hash and the worker's import would run under the old digest. So the worker
hashes every kernels_py module as it imports it (the very bytes it compiles)
and the package's other files when asked (at its hello). A module imported
later, or imported afresh after a reload, replaces its file's hash with that
of what it compiled, so a result's digest names the code that computed it.

The rules are the host's (gohost/runner kernelsHashes, results.KernelsDigest):
.py and .json files under kernels_py/, directories named tests or __pycache__
left out; a sha256 per file by its path relative to kernels_py/; one sha256
over "path\\0hash\\n" lines in path order.
"""

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import marshal
import os
import sys

PACKAGE = "kernels_py"
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIPPED_DIRS = ("tests", "__pycache__")


def relative(path: str, root: str = PACKAGE_DIR):
    """path relative to the package, or None when no digest counts it."""
    rel = os.path.relpath(os.path.abspath(path), root)
    parts = rel.split(os.sep)
    if parts[0] == os.pardir or any(p in _SKIPPED_DIRS for p in parts[:-1]):
        return None
    if not rel.endswith((".py", ".json")):
        return None
    return rel


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def scan(root: str = PACKAGE_DIR) -> dict:
    """Hashes of the files the digest counts, as they are on disk now."""
    hashes = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        for name in filenames:
            rel = relative(os.path.join(dirpath, name), root)
            if rel is None:
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    hashes[rel] = sha256(f.read())
            except OSError:  # removed while we looked: it is not part of the package
                pass
    return hashes


def digest(hashes: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(hashes):
        h.update(f"{name}\x00{hashes[name]}\n".encode())
    return h.hexdigest()


class Tracker:
    """What this process compiled of the package, by file."""

    def __init__(self, root: str = PACKAGE_DIR):
        self.root = root
        self.imported = {}
        self.disk = {}

    def record(self, path: str, data: bytes) -> None:
        rel = relative(path, self.root)
        if rel is not None:
            self.imported[rel] = sha256(data)

    def rescan(self) -> None:
        """Hashes the files no import has read yet, as they are now."""
        self.disk = scan(self.root)

    def hashes(self) -> dict:
        return {**self.disk, **self.imported}

    def digest(self) -> str:
        return digest(self.hashes())


class _HashingLoader(importlib.machinery.SourceFileLoader):
    """Runs a module from the bytes it hashes. Its bytecode cache is keyed by
    those bytes (a checked hash-based .pyc, PEP 552, under a tag of its own),
    not by the mtime and size the usual cache checks, which could pair old
    bytecode with a source edited in the same second."""

    tracker = None

    def get_code(self, fullname):
        path = self.get_filename(fullname)
        data = self.get_data(path)
        self.tracker.record(path, data)
        key = importlib.util.source_hash(data)
        header = importlib.util.MAGIC_NUMBER + _CHECKED_HASH_PYC + key
        cache = importlib.util.cache_from_source(path, optimization=_CACHE_TAG)
        try:
            with open(cache, "rb") as f:
                pyc = f.read()
            if pyc[:len(header)] == header:
                return marshal.loads(pyc[len(header):])
        except (OSError, ValueError, EOFError, TypeError):
            pass  # no usable cache: compile
        code = self.source_to_code(data, path)
        if not sys.dont_write_bytecode:
            try:
                self.set_data(cache, header + marshal.dumps(code))
            except OSError:
                pass  # a read-only tree runs all the same
        return code


_CACHE_TAG = "vlkvsrc"
_CHECKED_HASH_PYC = (0b11).to_bytes(4, "little")  # hash-based, checked


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, tracker):
        self.tracker = tracker

    def find_spec(self, fullname, path, target=None):
        if fullname != PACKAGE and not fullname.startswith(PACKAGE + "."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or type(spec.loader) is not importlib.machinery.SourceFileLoader:
            return spec
        loader = _HashingLoader(spec.loader.name, spec.loader.path)
        loader.tracker = self.tracker
        spec.loader = loader
        return spec


def track(root: str = PACKAGE_DIR) -> Tracker:
    """Hashes every kernels_py module this process imports from now on. The
    modules imported before (the worker's own plumbing, loaded to get here)
    are hashed from disk now."""
    tracker = Tracker(root)
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        path = getattr(module, "__file__", None)
        if path and (name == PACKAGE or name.startswith(PACKAGE + ".")):
            try:
                with open(path, "rb") as f:
                    tracker.record(path, f.read())
            except OSError:
                pass
    sys.meta_path.insert(0, _Finder(tracker))
    return tracker
