"""The Python side of a compiled kernel, read with ast: the loops and loads
of its @triton.jit functions and the calls between them. SASS carries
each instruction's file and line (not the inline chain), so this is how
estimate.py ties a machine loop to the source loop whose `range(...)`
gives its trip count, and a load to the kernel argument it reads (whose
memory level the op's model knows) and to the loops it re-reads the same
addresses in (which hit L1 after the first iteration).
"""

import ast
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path


@dataclass(frozen=True)
class SourceLoop:
    """One `for` of a jit function."""

    file: str
    func: str
    line: int
    node: ast.For = field(compare=False, hash=False)

    @property
    def header(self) -> str:
        return f"for {ast.unparse(self.node.target)} in {ast.unparse(self.node.iter)}"

    def label(self) -> str:
        return f"{self.func}:{self.line} {self.header}"


class _Function:
    """A jit function's parameters, assignments and parent links."""

    def __init__(self, file: str, node: ast.FunctionDef):
        self.file, self.node, self.name = file, node, node.name
        self.params = [a.arg for a in node.args.args]
        self.parent: dict[ast.AST, ast.AST] = {}
        for n in ast.walk(node):
            for child in ast.iter_child_nodes(n):
                self.parent[child] = n
        self.assigned: dict[str, list[ast.AST]] = {}  # name -> right-hand sides (flow-insensitive)
        for n in ast.walk(node):
            if isinstance(n, ast.Assign):
                for target in n.targets:
                    for name in _target_names(target):
                        self.assigned.setdefault(name, []).append(n.value)
            elif isinstance(n, (ast.AugAssign, ast.AnnAssign)) and n.value is not None:
                for name in _target_names(n.target):
                    rhs = [n.value, n.target] if isinstance(n, ast.AugAssign) else [n.value]
                    self.assigned.setdefault(name, []).extend(rhs)
        self.loops = [n for n in ast.walk(node) if isinstance(n, ast.For)]

    def enclosing(self, node: ast.AST) -> list[ast.AST]:
        out, n = [], self.parent.get(node)
        while n is not None:
            out.append(n)
            n = self.parent.get(n)
        return out

    def deps(self, expr: ast.AST) -> set[str]:
        """Names an expression depends on, through this function's
        assignments (flow-insensitive), down to parameters and loop
        targets; a name that is both assigned and a parameter counts as both."""
        seen, work = set(), list(_names(expr))
        while work:
            name = work.pop()
            if name in seen:
                continue
            seen.add(name)
            for rhs in self.assigned.get(name, ()):
                work.extend(_names(rhs))
        return seen

    def variant(self, loop: ast.For) -> set[str]:
        """Names whose value changes from one iteration of `loop` to the
        next: its target, and what is assigned inside it from those (or
        from itself, an accumulator); an inner loop's target only when its
        range changes."""
        inside: dict[str, list[ast.AST]] = {}
        inner_fors = []
        for n in ast.walk(loop):
            if n is loop:
                continue
            if isinstance(n, ast.Assign):
                for target in n.targets:
                    for name in _target_names(target):
                        inside.setdefault(name, []).append(n.value)
            elif isinstance(n, (ast.AugAssign, ast.AnnAssign)) and n.value is not None:
                for name in _target_names(n.target):
                    inside.setdefault(name, []).extend([n.value, n.target] if isinstance(n, ast.AugAssign)
                                                       else [n.value])
            elif isinstance(n, ast.For):
                inner_fors.append(n)
        variant = set(_target_names(loop.target))
        changed = True
        while changed:
            changed = False
            for name, rhss in inside.items():
                if name in variant:
                    continue
                names = set().union(*(_names(r) for r in rhss))
                if names & variant or name in names:
                    variant.add(name)
                    changed = True
            for inner in inner_fors:
                targets = set(_target_names(inner.target))
                if not targets <= variant and _names(inner.iter) & variant:
                    variant |= targets
                    changed = True
        return variant


_PARSED: dict[tuple, list] = {}


def _parse(file: str) -> list[_Function]:
    """The jit functions of a file, parsed once per version of it."""
    try:
        key = (file, Path(file).stat().st_mtime_ns)
    except OSError:
        return []
    if key not in _PARSED:
        try:
            tree = ast.parse(Path(file).read_text(), file)
        except (OSError, SyntaxError, ValueError):
            tree = ast.Module(body=[], type_ignores=[])
        _PARSED[key] = [_Function(file, n) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and _is_jit(n)]
    return _PARSED[key]


def _names(expr: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}


def _target_names(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in _target_names(elt)]
    return []


def _is_jit(node: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).split("(")[0].endswith("jit") for d in node.decorator_list)


def _callee(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


class Sources:
    """The jit functions of the files a kernel's SASS names, on demand."""

    def __init__(self, files=()):
        self._functions: dict[str, list[_Function]] = {}  # file -> functions
        self._sites: dict = {}
        for f in files:
            self._file(f)

    def _file(self, file: str) -> list[_Function]:
        if file not in self._functions:
            self._functions[file] = _parse(file)
        return self._functions[file]

    @cached_property
    def _by_name(self) -> dict[str, list[_Function]]:
        out: dict[str, list[_Function]] = {}
        for funcs in self._functions.values():
            for fn in funcs:
                out.setdefault(fn.name, []).append(fn)
        return out

    def add(self, file: str) -> None:
        if file not in self._functions:
            self._file(file)
            self.__dict__.pop("_by_name", None)

    def function(self, name: str) -> _Function | None:
        found = self._by_name.get(name)
        return found[0] if found else None

    def function_at(self, file: str, line: int) -> _Function | None:
        best = None
        for fn in self._file(file):
            if fn.node.lineno <= line <= (fn.node.end_lineno or fn.node.lineno):
                if best is None or fn.node.lineno > best.node.lineno:
                    best = fn
        return best

    def loop_at(self, file: str | None, line: int | None) -> SourceLoop | None:
        """The innermost `for` of a jit function that holds this line."""
        if not file or not line:
            return None
        fn = self.function_at(file, line)
        if fn is None:
            return None
        best = None
        for loop in fn.loops:
            if loop.lineno <= line <= (loop.end_lineno or loop.lineno):
                if best is None or loop.lineno > best.lineno:
                    best = loop
        return None if best is None else SourceLoop(file, fn.name, best.lineno, best)

    # ------------------------------------------------------------------
    # Call chains from the kernel down to a function
    # ------------------------------------------------------------------

    def chains(self, kernel: str, target: str, constexprs: dict, limit: int = 64) -> list[list[tuple]]:
        """Every chain of calls from `kernel` to `target`, in source order:
        [(function, call node), ...] ending at a call of `target`. Calls
        under an `if` whose constexpr condition is false are left out (they
        were never compiled)."""
        out: list[list[tuple]] = []

        def walk(fn: _Function, path: list[tuple]):
            if len(out) >= limit or len(path) > 12:
                return
            calls = sorted((n for n in ast.walk(fn.node) if isinstance(n, ast.Call)),
                           key=lambda n: (n.lineno, n.col_offset))
            for call in calls:
                name = _callee(call)
                if name is None or not self._live(fn, call, constexprs if not path else {}):
                    continue
                if name == target:
                    out.append(path + [(fn, call)])
                elif name in self._by_name and name != fn.name:
                    walk(self._by_name[name][0], path + [(fn, call)])

        root = self.function(kernel)
        if root is not None:
            walk(root, [])
        return out

    def _live(self, fn: _Function, node: ast.AST, constexprs: dict) -> bool:
        child = node
        for parent in fn.enclosing(node):
            if isinstance(parent, ast.If):
                value = evaluate(parent.test, lambda name: constexprs[name])
                if value is not None:
                    in_body = any(child is s or _contains(s, child) for s in parent.body)
                    if bool(value) != in_body:
                        return False
            child = parent
        return True

    # ------------------------------------------------------------------
    # Trip counts
    # ------------------------------------------------------------------

    def trips(self, kernel: str, loop: SourceLoop, occurrence: int, lookup) -> float:
        """Iterations of one entry of `loop` (its k-th compiled copy when the
        function holding it is inlined at several call sites): its range()
        evaluated with call-site arguments substituted for the function's
        parameters and `lookup(name)` for the kernel's own names."""
        it = loop.node.iter
        if not (isinstance(it, ast.Call) and _callee(it) in ("range", "static_range")):
            raise ValueError(f"{loop.label()}: only range(...) loops have a trip count here")
        fn = self._by_name[loop.func][0] if loop.func in self._by_name else None
        chain: list[tuple] = []
        if fn is not None and loop.func != kernel:
            chains = self.chains(kernel, loop.func, _Constexprs(lookup))
            if chains:
                chain = chains[min(occurrence, len(chains) - 1)]
        args = [self._eval_in(a, fn, chain, lookup, loop) for a in it.args]
        if len(args) == 1:
            lo, hi, step = 0.0, args[0], 1.0
        else:
            lo, hi = args[0], args[1]
            step = args[2] if len(args) > 2 else 1.0
        if step <= 0:
            raise ValueError(f"{loop.label()}: step {step} is not positive")
        return max(0.0, math.ceil((hi - lo) / step - 1e-9))

    def _eval_in(self, expr, fn, chain, lookup, loop):
        def resolve(name):
            if fn is not None and chain and name in fn.params:
                caller, call = chain[-1]
                arg = _argument(call, fn.params, name)
                if arg is None:
                    raise KeyError(name)
                return self._eval_in(arg, caller, chain[:-1], lookup, loop)
            if fn is not None and chain:
                for key in (f"{fn.name}.{name}", name):
                    try:
                        return lookup(key)
                    except KeyError:
                        pass
                raise KeyError(f"{fn.name}.{name}")
            return lookup(name)

        try:
            value = evaluate(expr, resolve, strict=True)
        except KeyError as err:
            raise KeyError(f"{loop.label()} needs a value for {err.args[0]!r}") from None
        if value is None:
            raise ValueError(f"{loop.label()}: cannot evaluate {ast.unparse(expr)!r}")
        return float(value)

    # ------------------------------------------------------------------
    # Loads
    # ------------------------------------------------------------------

    def load_site(self, kernel: str, file: str | None, line: int | None, pointers: set[str],
                  within: list[SourceLoop], constexprs: dict) -> "LoadSite | None":
        """The kernel arguments a load at this line reads (among `pointers`,
        the kernel's pointer parameters) and the source loops it re-reads
        the same addresses in. `within`: the source loops of the SASS loops
        around the instruction (innermost first), to choose among call sites."""
        if not file or not line:
            return None
        key = (kernel, file, line, tuple(sorted(pointers)), tuple(id(lp.node) for lp in within))
        if key not in self._sites:
            self._sites[key] = self._load_site(kernel, file, line, pointers, within, constexprs)
        return self._sites[key]

    def _load_site(self, kernel, file, line, pointers, within, constexprs):
        fn = self.function_at(file, line)
        if fn is None:
            return None
        loads = [n for n in ast.walk(fn.node) if isinstance(n, ast.Call) and _callee(n) == "load"
                 and n.lineno <= line <= (n.end_lineno or n.lineno)]
        if not loads:
            return None
        load = loads[0]
        ptr = load.args[0] if load.args else next((k.value for k in load.keywords if k.arg == "pointer"), None)
        if ptr is None:
            return None
        if fn.name == kernel:
            chain = []
        else:
            chains = self.chains(kernel, fn.name, constexprs)
            if not chains:
                return None
            nodes = {id(lp.node) for lp in within}

            def score(ch):
                return sum(1 for caller, call in ch for p in caller.enclosing(call)
                           if isinstance(p, ast.For) and id(p) in nodes)
            chain = max(chains, key=score)
        levels = chain + [(fn, load)]
        deps = fn.deps(ptr)
        invariant: set[int] = set()
        for depth in range(len(levels) - 1, -1, -1):
            owner, node = levels[depth]
            for parent in owner.enclosing(node):
                if isinstance(parent, ast.For) and not (deps & owner.variant(parent)):
                    invariant.add(id(parent))
            if depth == 0:
                break
            caller, call = levels[depth - 1]
            deps = set().union(*(caller.deps(a) for p in deps if p in owner.params
                                 for a in [_argument(call, owner.params, p)] if a is not None), set())
        return LoadSite(frozenset(deps & pointers), frozenset(invariant))


@dataclass(frozen=True)
class LoadSite:
    pointers: frozenset  # kernel pointer arguments the address is built from
    invariant_in: frozenset  # ids of ast.For nodes whose iterations re-read the same addresses


class _Constexprs(dict):
    """constexprs for chains(): looked up lazily through a lookup function."""

    def __init__(self, lookup):
        super().__init__()
        self._lookup = lookup

    def __getitem__(self, key):
        return self._lookup(key)


def _argument(call: ast.Call, params: list[str], name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    index = params.index(name)
    return call.args[index] if index < len(call.args) else None


def _contains(tree: ast.AST, node: ast.AST) -> bool:
    return any(n is node for n in ast.walk(tree))


_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.FloorDiv: lambda a, b: a // b, ast.Div: lambda a, b: a / b, ast.Mod: lambda a, b: a % b,
           ast.Pow: lambda a, b: a ** b, ast.BitAnd: lambda a, b: a & b, ast.BitOr: lambda a, b: a | b,
           ast.LShift: lambda a, b: a << b, ast.RShift: lambda a, b: a >> b}
_CMPOPS = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
           ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b}
_CALLS = {"cdiv": lambda a, b: -(-a // b), "minimum": min, "maximum": max, "min": min, "max": max,
          "next_power_of_2": lambda a: 1 << (int(a) - 1).bit_length(), "abs": abs}


def evaluate(expr: ast.AST, resolve, strict: bool = False):
    """The value of a small arithmetic expression (names through resolve,
    which raises KeyError for an unknown one). None when it cannot be
    evaluated; with strict, a KeyError propagates."""
    def ev(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float, bool)):
            return n.value
        if isinstance(n, ast.Name):
            value = resolve(n.id)
            if hasattr(value, "value"):  # tl.constexpr
                value = value.value
            if isinstance(value, str):
                try:
                    value = int(value)
                except ValueError:
                    value = {"True": True, "False": False}.get(value, value)
            return value
        if isinstance(n, ast.BinOp) and type(n.op) in _BINOPS:
            return _BINOPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp):
            v = ev(n.operand)
            return -v if isinstance(n.op, ast.USub) else (not v) if isinstance(n.op, ast.Not) else v
        if isinstance(n, ast.BoolOp):
            vals = [ev(v) for v in n.values]
            return all(vals) if isinstance(n.op, ast.And) else any(vals)
        if isinstance(n, ast.Compare) and len(n.ops) == 1 and type(n.ops[0]) in _CMPOPS:
            return _CMPOPS[type(n.ops[0])](ev(n.left), ev(n.comparators[0]))
        if isinstance(n, ast.Call) and _callee(n) in _CALLS and not n.keywords:
            return _CALLS[_callee(n)](*(ev(a) for a in n.args))
        raise ValueError(ast.unparse(n))

    try:
        value = ev(expr)
    except KeyError:
        if strict:
            raise
        return None
    except (ValueError, TypeError, ZeroDivisionError):
        return None
    return value if isinstance(value, (int, float, bool)) else None
