"""runtime.errors.locate: the kernels_py line an error comes from."""

import importlib.util

import pytest

from kernels_py.runtime import errors


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    root = tmp_path / "kernels_py"
    root.mkdir()
    monkeypatch.setattr(errors, "KERNELS", root)
    monkeypatch.setattr(errors, "_PLUMBING", (root / "runtime",))
    return root


def load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_raising_line_of_an_interpreted_kernel(kernels):
    (kernels / "kern.py").write_text("def helper(x):\n    return x + 1\n\n\ndef kernel(n):\n    if n > 2:\n"
                                     "        raise ValueError('arange must be a power of 2')\n    return helper(n)\n")
    module = load(kernels / "kern.py")
    try:
        try:
            module.kernel(3)
        except ValueError as inner:  # the interpreter wraps the kernel's error, as InterpreterError does
            raise RuntimeError(repr(inner)) from inner
    except RuntimeError as err:
        where = errors.locate(err)
    assert where["file"].endswith("kernels_py/kern.py") and where["line"] == 7
    assert where["source"] == "raise ValueError('arange must be a power of 2')"
    assert where["message"] == "ValueError: arange must be a power of 2"


def test_a_syntax_error(kernels):
    (kernels / "broken.py").write_text("x = 1\ny = (2 +\n")
    with pytest.raises(SyntaxError) as info:
        load(kernels / "broken.py")
    where = errors.locate(info.value)
    assert where["line"] == 2 and where["source"] == "y = (2 +" and where["message"].startswith("SyntaxError:")


def test_a_compilation_error_maps_to_its_file(kernels):
    source = "def kernel(X):\n    a = 1\n    b = bad(a)\n"
    (kernels / "ops.py").write_text("import math\n\n\n" + source)

    class CompilationError(Exception):  # Triton's: the jit function's source from its def, and a node in it
        def __init__(self, src, node, error_message):
            self.src, self.node, self.error_message = src, node, error_message

    class Node:
        lineno, col_offset = 3, 8

    where = errors.locate(CompilationError(source, Node(), "name 'bad' is not defined"))
    assert where["line"] == 6 and where["source"] == "    b = bad(a)" and where["message"] == "name 'bad' is not defined"


def test_nothing_of_kernels_py(kernels):
    try:
        int("x")
    except ValueError as err:
        assert errors.locate(err) is None


def test_an_error_raised_from_none_is_the_one_located(kernels):
    """`raise ... from None` hides the error it replaces: the new one, with
    the words its author chose, is what the user is shown."""
    (kernels / "parse.py").write_text("def parse(text):\n    try:\n        return float(text)\n    except ValueError:\n"
                                      "        raise ValueError(f'{text!r} is neither a number nor a word') from None\n")
    module = load(kernels / "parse.py")
    with pytest.raises(ValueError) as info:
        module.parse("#x")
    where = errors.locate(info.value)
    assert where["line"] == 5 and where["message"] == "ValueError: '#x' is neither a number nor a word", where


def test_bad_knobs_blame_no_line(kernels):
    """A BadKnobs (the caller's values, StaleSchema among them) names what is
    wrong in its message; the line that raised it would only mislead."""
    from kernels_py.params import StaleSchema

    (kernels / "check.py").write_text("def check(x):\n    if x < 0:\n        raise ValueError(f'x={x} < 0')\n")
    module = load(kernels / "check.py")
    try:
        try:
            module.check(-1)
        except ValueError as err:
            raise StaleSchema("kernels_py/schema.json is out of date") from err
    except StaleSchema as err:
        assert errors.locate(err) is None
    with pytest.raises(ValueError) as info:
        module.check(-1)
    assert errors.locate(info.value)["line"] == 3  # the same error, not a BadKnobs, is located


def test_a_bug_while_handling_bad_knobs_is_located(kernels):
    """Only a BadKnobs the caller gets, or one it was raised from, blames
    values: a bug hit while handling one (its __context__) is still a line
    of the sources to fix."""
    from kernels_py.params import BadKnobs

    (kernels / "pick.py").write_text("from kernels_py.params import BadKnobs\n\n\ndef pick(x):\n    try:\n"
                                     "        raise BadKnobs(f'bad {x}')\n    except BadKnobs:\n"
                                     "        return fallback_for(x)\n")
    module = load(kernels / "pick.py")
    with pytest.raises(NameError) as info:
        module.pick(1)
    where = errors.locate(info.value)
    assert where is not None and where["line"] == 8 and "fallback_for" in where["message"], where
    with pytest.raises(ValueError) as wrapped:
        try:
            module.pick(1)
        except NameError:
            raise BadKnobs("a value is wrong") from None
    assert errors.locate(wrapped.value) is None
