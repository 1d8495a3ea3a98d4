"""Knob rules: constraints between knobs that Python checks on construction
and the Go host checks when it plans (the same expression text)."""

from dataclasses import dataclass

import pytest

from kernels_py.benchmarks import BENCHMARKS
from kernels_py.methods import METHODS
from kernels_py.params import Knobs, Rule, knob
from kernels_py.workloads import WORKLOADS


@dataclass(frozen=True)
class Base(Knobs):
    heads: int = knob("int", 8, "query heads", min=1)
    kv_heads: int = knob("int", 2, "kv heads", min=1)

    RULES = (Rule("heads % kv_heads == 0", "heads={heads} must be a multiple of kv_heads={kv_heads}"),)


@dataclass(frozen=True)
class Child(Base):
    sizes: tuple = knob("ints", (4, 8), "sizes", min=1)
    shape: str = knob("str", "1x2", "a shape", pattern=r"\d+x\d+")

    RULES = (Rule("sum([s for s in sizes]) >= heads", "sizes={sizes} must add up to at least heads={heads}"),)


def test_rules_are_inherited_and_checked_in_order():
    assert [r.check for r in Child.rules()] == ["heads % kv_heads == 0", "sum([s for s in sizes]) >= heads"]
    Child()
    with pytest.raises(ValueError, match="heads=6 must be a multiple of kv_heads=4"):
        Child(heads=6, kv_heads=4)
    with pytest.raises(ValueError, match=r"sizes=\[1, 2\] must add up to at least heads=8"):
        Child(sizes=(1, 2))


def test_pattern_checks_the_whole_value():
    with pytest.raises(ValueError, match="shape='1x2x3' is not well-formed"):
        Child(shape="1x2x3")
    with pytest.raises(ValueError, match="only str parameters take a pattern"):
        knob("int", 1, "n", pattern=r"\d+")


def test_path_knobs_say_so_in_the_schema():
    """The Go host warns at plan time of a missing file or folder in these
    knobs; it learns which knobs hold paths here."""
    from kernels_py.workloads import WORKLOADS

    with pytest.raises(ValueError, match="only str parameters hold paths"):
        knob("int", 1, "n", paths=True)
    holding = {(w, name) for w, cls in WORKLOADS.items() for name, entry in cls.schema().items() if entry.get("paths")}
    assert holding == {("vlm", "model"), ("vlm", "images"), ("vlm", "videos"), ("trace", "path"),
                       ("lmms", "model"), ("lmms", "include_path"), ("lmms", "data")}


def test_required_knobs_say_so_in_the_schema():
    """The Go host refuses an experiment whose workload leaves these empty."""
    from kernels_py.workloads import WORKLOADS

    for bad in (dict(type="int", default=0), dict(type="str", default="x")):
        with pytest.raises(ValueError, match="only str parameters with the default"):
            knob(bad["type"], bad["default"], "n", required=True)
    required = {(w, name) for w, cls in WORKLOADS.items() for name, entry in cls.schema().items()
                if entry.get("required")}
    assert required == {("vlm", "model"), ("vlm", "prompt"), ("trace", "path"), ("lmms", "model"), ("lmms", "tasks")}


def test_rules_use_only_what_both_languages_have():
    with pytest.raises(NameError):
        Rule("__import__('os') is None", "no").holds({})


@pytest.mark.parametrize("cls", [*METHODS.values(), *WORKLOADS.values(), *BENCHMARKS.values()],
                         ids=lambda c: c.__name__)
def test_every_registered_rule_holds_on_the_defaults_and_is_in_the_schema(cls):
    cls()  # the defaults pass every rule
    assert cls.rules_schema() == [{"check": r.check, "message": r.message} for r in cls.rules()]


def test_a_field_that_is_not_a_knob_is_named():
    @dataclass(frozen=True)
    class Plain(Base):
        seed: int = 0

    with pytest.raises(TypeError, match=r"Plain.seed is a field but not a knob: declare it as seed: \.\.\. = knob\("):
        Plain()


def test_knobs_on_a_class_without_dataclass_are_refused():
    """Without @dataclass its knobs would silently be no parameters at all
    ("unknown parameter(s) ['edge']" for the knob just declared)."""
    class Undecorated(Base):
        edge: int = knob("int", 2, "tokens at each end", min=0)

    with pytest.raises(TypeError, match=r"Undecorated declares the knob\(s\) \['edge'\] but is not a dataclass: "
                                        r"decorate it with @dataclass\(frozen=True\)"):
        Undecorated.from_dict({"edge": 3})


def test_planned_defaults_that_are_not_the_sources_are_refused():
    """A job carries the defaults schema.json filled in; a knob whose default
    changed, a knob added or one removed since makes the job stale."""
    from kernels_py.params import StaleSchema

    @dataclass(frozen=True)
    class Owner(Knobs):
        a: float = knob("float", 0.5, "a")
        n: int = knob("int", 2, "n")
        flag: bool = knob("bool", True, "flag")
        sizes: tuple = knob("ints", (1, 2), "sizes")

    Owner.check_planned_defaults({"a": 0.5, "n": 2.0, "flag": True, "sizes": [1, 2]})  # JSON's numbers are numbers
    # A job whose script set the knob to another value than the old default holds no default to go stale.
    Owner.check_planned_defaults({"a": 0.4, "n": 2, "flag": True, "sizes": [1, 2]}, {"a": 0.7})
    with pytest.raises(StaleSchema, match="a defaults to 0.5, not 0.4"):  # the old default, as planned
        Owner.check_planned_defaults({"a": 0.4, "n": 2, "flag": True, "sizes": [1, 2]}, {"a": 0.4})
    for planned, says in [
        ({"a": 0.4, "n": 2, "flag": True, "sizes": [1, 2]}, "a defaults to 0.5, not 0.4"),
        ({"a": 0.5, "n": 2, "flag": 1, "sizes": [1, 2]}, "flag defaults to True, not 1"),
        ({"a": 0.5, "n": 2, "flag": True, "sizes": [1]}, "sizes defaults to [1, 2], not [1]"),
        ({"a": 0.5, "flag": True, "sizes": [1, 2]}, "n is new (default 2)"),
        ({"a": 0.5, "n": 2, "flag": True, "sizes": [1, 2], "old": 3}, "old is gone"),
    ]:
        with pytest.raises(StaleSchema) as info:
            Owner.check_planned_defaults(planned)
        assert says in str(info.value) and "run `workbench schema`" in str(info.value), str(info.value)


def test_a_job_planned_from_a_stale_schema_is_refused_before_it_runs():
    """ablation.run checks the planned defaults of the job's method and
    workload first; the registered classes agree with today's schema.json."""
    import json

    from kernels_py import ablation, schema
    from kernels_py.params import StaleSchema

    doc = json.loads(schema.PATH.read_text())
    planned = {"method": {k: p["default"] for k, p in doc["methods"]["h2o"]["params"].items()},
               "workload": {k: p["default"] for k, p in doc["workloads"]["synthetic"]["params"].items()}}
    for key, cls in (("method", METHODS["h2o"]), ("workload", WORKLOADS["synthetic"])):
        cls.check_planned_defaults(planned[key])
    stale = {**planned, "method": {**planned["method"], "recent_fraction": 0.25}}
    with pytest.raises(StaleSchema, match=r"method 'h2o' \(kernels_py/methods/h2o.py: recent_fraction defaults to "
                                          r"0.5, not 0.25\)"):
        ablation.run("h2o", {"recent_fraction": 0.25}, {}, "synthetic", planned_defaults=stale)


def test_planned_protocol_values_that_are_not_the_sources_are_refused():
    """A job carries the values its protocol set as schema.json had them; a
    protocol that now sets another value, or sets or leaves a knob it did
    not, makes the job stale where the job holds the planned value."""
    from kernels_py.params import StaleSchema

    h2o = METHODS["h2o"]
    sets = h2o.protocol_knobs("vlcache")
    assert sets == {"evict_while_decoding": True, "recent_fraction": 0.1}  # what this test edits
    job = {**h2o().to_dict(), **sets}
    h2o.check_planned_protocol("vlcache", sets, job)
    for planned, holds, says in [
        ({**sets, "recent_fraction": 0.2}, {"recent_fraction": 0.2},
         "protocol 'vlcache' sets recent_fraction to 0.1, not 0.2"),
        ({"evict_while_decoding": True}, {"recent_fraction": 0.5},
         "protocol 'vlcache' sets recent_fraction to 0.1, not nothing"),
        ({**sets, "window": 4}, {"window": 4}, "protocol 'vlcache' leaves window alone, not 4"),
    ]:
        with pytest.raises(StaleSchema, match=says):
            h2o.check_planned_protocol("vlcache", planned, {**job, **holds})
    # The grid set recent_fraction after the protocol: the job holds no protocol value to go stale.
    h2o.check_planned_protocol("vlcache", {**sets, "recent_fraction": 0.2}, {**job, "recent_fraction": 0.3})
