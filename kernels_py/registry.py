"""Registries by name: each entry is a module of a package named for what it
registers (kernels_py/methods/h2o.py holds the method "h2o"), so adding one is
one file and its name in the list."""

import importlib


def load(package: str, names: tuple[str, ...], base: type) -> dict[str, type]:
    """{name: the subclass of `base` whose `name` is that, from package.name}, in order."""
    found = {}
    for name in names:
        module = importlib.import_module(f"{package}.{name}")
        matches = [v for v in vars(module).values()
                   if isinstance(v, type) and issubclass(v, base) and v.__module__ == module.__name__
                   and getattr(v, "name", None) == name]
        if len(matches) != 1:
            raise ImportError(f"{module.__name__} must define one {base.__name__} subclass with name = {name!r}, "
                              f"found {len(matches)}")
        found[name] = matches[0]
    return found
