"""Registries by name: each entry is a module of a package named for what it
registers (kernels_py/methods/h2o.py holds the method "h2o"), so adding one is
one file and its name in the list."""

import importlib
import importlib.util
from pathlib import Path

from kernels_py.params import closest


def load(package: str, names: tuple[str, ...], base: type) -> dict[str, type]:
    """{name: the subclass of `base` whose `name` is that, from package.name}, in order."""
    found = {}
    for name in names:
        try:
            module = importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{package}.{name}":  # the module exists; something it imports does not
                raise
            raise ImportError(f"{_registry(package)} names {name!r}, but there is no {_file(package, name)}"
                              f"{closest(name, _modules(package))}") from None
        classes = [v for v in vars(module).values()
                   if isinstance(v, type) and issubclass(v, base) and v.__module__ == module.__name__]
        matches = [v for v in classes if getattr(v, "name", None) == name]
        if len(matches) != 1:
            named = "".join(f"; {v.__name__} has name = {getattr(v, 'name', None)!r}" for v in classes)
            raise ImportError(f"{module.__name__} must define one {base.__name__} subclass with name = {name!r} "
                              f"(its file's name, as {_registry(package)} has it), found {len(matches)}{named}")
        found[name] = matches[0]
    return found


def _file(package: str, name: str) -> str:
    return "/".join(package.split(".")) + f"/{name}.py"


def _registry(package: str) -> str:
    """Where a package's list of names is, as a researcher finds it."""
    return f"the list in {'/'.join(package.split('.'))}/__init__.py"


def _modules(package: str) -> list[str]:
    """The modules beside the registry (the names a typo may be close to)."""
    spec = importlib.util.find_spec(package)
    folders = spec.submodule_search_locations if spec else []
    return sorted(p.stem for folder in folders for p in Path(folder).glob("*.py") if p.stem != "__init__")
