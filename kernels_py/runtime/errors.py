"""Where in the kernels_py sources an error comes from, as one source line:
what `workbench watch` shows instead of a traceback. Knows Triton's
CompilationError (a node in a jit function's source), the interpreter's
errors (raised from the kernel's own frame) and SyntaxError."""

import linecache
import traceback
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1]  # kernels_py/
# Frames here are plumbing, never the line a researcher edited.
_PLUMBING = (KERNELS / "runtime", KERNELS / "watch.py", KERNELS / "selftest.py")


def _chain(err: BaseException) -> list[BaseException]:
    out = []
    while err is not None and err not in out and len(out) < 20:
        out.append(err)
        # `raise ... from None` hides the context: the error meant is the new one
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    return out


def _summary(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _relative(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(KERNELS.parent))
    except ValueError:
        return path


def _compilation(err) -> dict | None:
    """The file and line of a CompilationError's node: its source is a jit
    function's, from its `def` line; find the file that holds it."""
    src, node = getattr(err, "src", None), getattr(err, "node", None)
    if not src or not hasattr(node, "lineno"):
        return None
    for path in sorted(KERNELS.rglob("*.py")):
        text = path.read_text(errors="replace")
        at = text.find(src)
        if at < 0:
            continue
        line = text.count("\n", 0, at) + node.lineno
        message = err.error_message
        for cause in _chain(err)[1:]:  # none of its own: the error it wraps says what went wrong
            if message:
                break
            message = getattr(cause, "error_message", None) if hasattr(cause, "src") else _summary(cause)
        return {"file": _relative(str(path)), "line": line, "column": getattr(node, "col_offset", 0),
                "source": linecache.getline(str(path), line).rstrip(), "message": (message or "").strip(),
                "kind": type(err).__name__}
    return None


def locate(err: BaseException) -> dict | None:
    """{"file", "line", "column", "source", "message", "kind"} of the kernels_py
    line an error comes from, or None when no frame of kernels_py is involved.
    The deepest CompilationError wins (the called function's, not the
    caller's), then a SyntaxError, then the deepest kernels_py frame of any
    error in the chain (an interpreted kernel raises from its own line);
    None for a BadKnobs, or an error raised from one, which blames values,
    not a line."""
    from kernels_py.params import BadKnobs

    if _raised_from(err, BadKnobs):  # the caller's values: the message says what, no line is to blame
        return None
    # A BadKnobs this error was raised while handling (its context) blames no line either: the error's own does.
    chain = [e for e in _chain(err) if not isinstance(e, BadKnobs)]
    for e in reversed(chain):
        if hasattr(e, "src") and hasattr(e, "node"):
            found = _compilation(e)
            if found:
                return found
    for e in chain:
        if isinstance(e, SyntaxError) and e.filename and Path(e.filename).resolve().is_relative_to(KERNELS):
            return {"file": _relative(e.filename), "line": e.lineno or 0, "column": (e.offset or 1) - 1,
                    "source": (e.text or "").rstrip("\n"), "message": f"{type(e).__name__}: {e.msg}",
                    "kind": type(e).__name__}
    for e in reversed(chain):  # the innermost error first: the interpreter's is the cause of its wrapper
        frames = [f for f in traceback.extract_tb(e.__traceback__) if _ours(f.filename)]
        if frames:
            f = frames[-1]
            return {"file": _relative(f.filename), "line": f.lineno, "column": 0, "source": (f.line or "").rstrip(),
                    "message": _summary(e), "kind": type(e).__name__}
    return None


def _raised_from(err: BaseException, kind: type) -> bool:
    """Whether err is a `kind` or was raised from one (`raise ... from`,
    not an error hit while handling one)."""
    seen = []
    while err is not None and err not in seen:
        if isinstance(err, kind):
            return True
        seen.append(err)
        err = err.__cause__
    return False


def _ours(filename: str) -> bool:
    path = Path(filename).resolve()
    return path.is_relative_to(KERNELS) and not any(path == p or path.is_relative_to(p) for p in _PLUMBING)


def compile_failure(entry: dict) -> dict:
    """Where and why an entry of kernels_py.ops.compile (a compiled config,
    or a case whose launcher failed) did not compile, in locate's shape:
    "file" is "" and "line" 0 where no kernels_py line is known."""
    at = entry.get("error_at") or {}
    lines = [line for line in (entry.get("error") or "").splitlines() if line.strip()]
    return {"file": at.get("file") or "", "line": at.get("line") or 0, "source": at.get("source") or "",
            "message": at.get("message") or (lines[-1] if lines else "unknown error"),
            "kind": at.get("kind") or "CompilationError"}
