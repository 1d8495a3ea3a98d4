"""Typed, bounded, documented parameters ("knobs") for methods, workloads and
benchmarks.

One `ParamSpec` per dataclass field drives what must never drift apart:
validation of what a job message carries (JSON has no types we can trust), the
defaults, the documentation, and the schema the Go host reads to check
experiment scripts and build command-line flags without starting Python
(`kernels_py/schema.json`).
"""

import builtins
import dataclasses
import difflib
import inspect
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Mapping

# "ints" (a list of ints) is for benchmark sizes; job parameters are scalars.
TYPE_NAMES = ("float", "int", "str", "bool", "ints")


@dataclass(frozen=True)
class ParamSpec:
    """What one parameter accepts. Bounds are inclusive; `None` means unbounded
    (and is what str/bool parameters carry); for "ints" they bound each element.
    `ref` says where a paper defines the knob (e.g. "VL-Cache Alg. 1"); empty
    for the workbench's own choices."""

    type: str
    default: Any
    doc: str
    min: float | int | None = None
    max: float | int | None = None
    choices: tuple | None = None
    ref: str = ""
    pattern: str = ""  # str knobs: a regular expression the whole value must match (Go RE2 and Python re alike)
    # At its default the knob is left out of job ids: a knob added after runs existed keeps their jobs' ids.
    id_omits_default: bool = False
    # str knobs: a file or folder, or several comma-separated (a relative one is from the kernels root, where
    # workers run); the Go host warns at plan time of one that does not exist.
    paths: bool = False
    # str knobs: the default ("") is a placeholder a runnable value replaces (a model, a prompt); `workbench plan`
    # refuses an experiment whose workload leaves it empty.
    required: bool = False

    def check(self, owner: str, name: str, value: Any) -> Any:
        """Return `value` in the parameter's Python type, or raise TypeError
        (wrong type) / ValueError (out of range, not a choice)."""
        if self.type == "ints":
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise TypeError(f"{owner}: {name} must be a list of ints, got {type(value).__name__} {value!r}")
            element = dataclasses.replace(self, type="int")
            return tuple(element.check(owner, f"{name}[{i}]", v) for i, v in enumerate(value))
        value = self._coerce(owner, name, value)
        # What the knob means (and where the paper says so), so a bad value explains itself.
        meaning = f" ({name}: {self.doc}{f' [{self.ref}]' if self.ref else ''})"
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{owner}: {name}={value!r} is not one of {list(self.choices)}{meaning}")
        if self.min is not None and value < self.min:
            raise ValueError(f"{owner}: {name}={value!r} is below its minimum {self.min}{meaning}")
        if self.max is not None and value > self.max:
            raise ValueError(f"{owner}: {name}={value!r} is above its maximum {self.max}{meaning}")
        if self.pattern and not re.fullmatch(self.pattern, value):
            raise ValueError(f"{owner}: {name}={value!r} is not well-formed ({name}: {self.doc})")
        return value

    def _coerce(self, owner: str, name: str, value: Any) -> Any:
        # bool is an int subclass in Python; a JSON true must never pass as 1.
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if self.type == "float" and is_number:
            if not math.isfinite(value):
                raise ValueError(f"{owner}: {name} must be finite, got {value!r}")
            return float(value)
        if self.type == "int" and is_number and isinstance(value, int):
            return value
        if self.type == "str" and isinstance(value, str):
            return value
        if self.type == "bool" and isinstance(value, bool):
            return value
        raise TypeError(f"{owner}: {name} must be {self.type}, got {type(value).__name__} {value!r}")

    @property
    def json_default(self) -> Any:
        """The default as JSON holds it (and the Go host sends it back)."""
        return list(self.default) if self.type == "ints" else self.default

    def schema(self) -> dict:
        """The parameter as the Go host reads it."""
        entry = {"type": self.type, "default": self.json_default, "min": self.min, "max": self.max, "doc": self.doc}
        if self.choices is not None:
            entry["choices"] = list(self.choices)
        if self.ref:
            entry["ref"] = self.ref
        if self.pattern:
            entry["pattern"] = self.pattern
        if self.id_omits_default:
            entry["id_omits_default"] = True
        if self.paths:
            entry["paths"] = True
        if self.required:
            entry["required"] = True
        return entry


def knob(type: str, default: Any, doc: str, *, min=None, max=None, choices=None, ref: str = "", pattern: str = "",
         id_omits_default: bool = False, paths: bool = False, required: bool = False):
    """A dataclass field whose default, documentation, paper reference and
    bounds live in one place. `id_omits_default`: the job id leaves the knob
    out while it holds its default, so adding it to a workload or method that
    runs already existed for keeps those runs' job ids (and their resumes).
    `paths`: the value is a file or folder, or comma-separated ones, which
    `workbench plan` checks exist. `required`: a str knob whose default ("")
    only holds its place, which `workbench plan` refuses to run with."""
    if type not in TYPE_NAMES:
        raise ValueError(f"parameter type {type!r} is not one of {TYPE_NAMES}")
    if pattern and type != "str":
        raise ValueError("only str parameters take a pattern")
    if paths and type != "str":
        raise ValueError("only str parameters hold paths")
    if required and (type != "str" or default != ""):
        raise ValueError("only str parameters with the default \"\" are required")
    if id_omits_default and type == "ints":
        raise ValueError("a list knob cannot leave job ids at its default")
    if type == "ints":
        default = tuple(default)
    spec = ParamSpec(type, default, doc, min, max, None if choices is None else tuple(choices), ref, pattern,
                     id_omits_default, paths, required)
    return dataclasses.field(default=default, metadata={"spec": spec})


def where(path) -> str:
    """A path knob's value in an error: as given and, for a relative one, where
    it was looked for (a worker runs in the kernels root, not where the
    script is)."""
    p = Path(path)
    return str(p) if p.is_absolute() else f"{p} (looked for at {p.absolute()})"


@dataclass(frozen=True)
class Rule:
    """A constraint between knobs (or on one knob beyond its bounds), checked
    on construction here and by `workbench plan` before anything runs.

    `check` is an expression over the knob names in the common subset of
    Python and Starlark: arithmetic, comparisons (not chained), and/or/not,
    list comprehensions, indexing and slicing, str methods, and the
    functions in RULE_FUNCTIONS. `message` is formatted with the knob values
    (`{name}`, `{name!r}`; no format specs), and says what to change."""

    check: str
    message: str

    def holds(self, values: Mapping[str, Any]) -> bool:
        scope = {"__builtins__": RULE_FUNCTIONS, **values}  # globals: comprehensions see them
        return bool(eval(self.check, scope))  # noqa: S307 - the team's own expressions, never user input

    def schema(self) -> dict:
        return {"check": self.check, "message": self.message}


# What a rule may call: the built-ins both languages have, plus sum (which
# the Go host supplies to Starlark).
RULE_FUNCTIONS = {name: getattr(builtins, name)
                  for name in ("abs", "all", "any", "bool", "float", "int", "len", "max", "min", "range", "sorted",
                               "str", "sum", "zip")}


class BadKnobs(ValueError):
    """Values given for knobs that cannot work together (or at all): the
    caller's mistake, which the host reports as a usage error, without a
    traceback."""


class StaleSchema(BadKnobs):
    """A job planned from a kernels_py/schema.json whose knobs are no longer
    the sources' (a default changed, a knob added or removed, and no
    `workbench schema` since): it would run with values nobody chose."""


def stale_message(cls, changes: list[str]) -> str:
    """StaleSchema's words: the class, its file, what changed, what to do."""
    source = inspect.getsourcefile(cls) or cls.__module__
    try:
        source = Path(source).resolve().relative_to(Path(__file__).resolve().parents[1]).as_posix()
    except ValueError:
        pass
    return (f"kernels_py/schema.json is out of date for {cls.owner_name()} ({source}: {'; '.join(changes)}), and the "
            f"job was planned from it: run `workbench schema`, then plan or run the experiment again")


def same_value(a: Any, b: Any) -> bool:
    """JSON values equal as knob values: 2 and 2.0 are, True and 1 are not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


def first_paragraph(doc: str | None) -> str:
    """A docstring's first paragraph on one line: what the schema and listings show."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def closest(name: str, known) -> str:
    """" (did you mean 'x'?)" when a known name is close to `name`, else ""."""
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


class Knobs:
    """Mixin for frozen dataclasses whose fields are all `knob`s: validates on
    construction (each knob, then the class's `RULES` and its bases') and
    builds instances from untyped mappings (job messages)."""

    RULES: ClassVar[tuple[Rule, ...]] = ()

    @classmethod
    def rules(cls) -> tuple[Rule, ...]:
        """The rules of the class and its bases, the bases' first."""
        out: list[Rule] = []
        for klass in reversed(cls.__mro__):
            out += [r for r in vars(klass).get("RULES", ()) if r not in out]
        return tuple(out)

    @classmethod
    def param_specs(cls) -> dict[str, ParamSpec]:
        for klass in cls.__mro__:
            # A knob on a class without @dataclass stays a bare Field: it would be silently no parameter at all.
            loose = [name for name, v in vars(klass).items() if isinstance(v, dataclasses.Field)]
            if loose:
                raise TypeError(f"{klass.__module__}.{klass.__name__} declares the knob(s) {loose} but is not a "
                                f"dataclass: decorate it with @dataclass(frozen=True)")
        specs = {}
        for f in dataclasses.fields(cls):
            if "spec" not in f.metadata:
                raise TypeError(f"{cls.__module__}.{cls.__name__}.{f.name} is a field but not a knob: declare it as "
                                f"{f.name}: ... = knob(type, default, doc, ...) (kernels_py.params.knob)")
            specs[f.name] = f.metadata["spec"]
        return specs

    @classmethod
    def owner_name(cls) -> str:
        """How error messages name what is being configured."""
        return cls.__name__

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]):
        """Build from a mapping, rejecting keys that are not parameters."""
        if not isinstance(values, Mapping):
            raise TypeError(f"{cls.owner_name()}: parameters must be a mapping, got {type(values).__name__}")
        specs = cls.param_specs()
        unknown = sorted(set(values) - set(specs))
        if unknown:
            raise ValueError(f"{cls.owner_name()}: unknown parameter(s) {unknown}{closest(unknown[0], specs)}; "
                             f"known: {sorted(specs)}")
        return cls(**values)

    def __post_init__(self):
        for name, spec in self.param_specs().items():
            # Frozen dataclasses forbid plain assignment; coercion (int -> float) needs it.
            object.__setattr__(self, name, spec.check(self.owner_name(), name, getattr(self, name)))
        values = {name: list(v) if isinstance(v, tuple) else v for name, v in self.to_dict().items()}
        for rule in self.rules():
            if not rule.holds(values):
                raise ValueError(f"{self.owner_name()}: {rule.message.format(**values)}")

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.param_specs()}

    @classmethod
    def schema(cls) -> dict:
        return {name: spec.schema() for name, spec in cls.param_specs().items()}

    @classmethod
    def check_planned_defaults(cls, planned: Mapping[str, Any], values: Mapping[str, Any] | None = None) -> None:
        """Raise StaleSchema unless `planned` ({knob: default}, what the host's
        schema.json said when it filled in a job's unset knobs) holds this
        class's knobs and defaults. A knob whose default changed matters
        only where the job holds the old one (`values`, the job's knobs:
        one set to another value was the script's choice, not a default)."""
        ours = {name: spec.json_default for name, spec in cls.param_specs().items()}
        values = values or {}
        changes = []
        for name in sorted(set(ours) | set(planned)):
            if name not in planned:
                changes.append(f"{name} is new (default {ours[name]!r})")
            elif name not in ours:
                changes.append(f"{name} is gone")
            elif not same_value(planned[name], ours[name]) and \
                    (name not in values or same_value(values[name], planned[name])):
                changes.append(f"{name} defaults to {ours[name]!r}, not {planned[name]!r}")
        if changes:
            raise StaleSchema(stale_message(cls, changes))

    @classmethod
    def rules_schema(cls) -> list[dict]:
        return [r.schema() for r in cls.rules()]

    @classmethod
    def summary(cls) -> str:
        """First paragraph of the class docstring, on one line (the schema's doc)."""
        return first_paragraph(cls.__doc__)
