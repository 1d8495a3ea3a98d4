"""A stand-in for an autotuned kernel that records the key the autotuner
would look its config up by, for each launch: on the CPU the launchers run
a pinned config, so this is how a test sees what a GPU's launch keys on."""

import pytest


class AutotuneSpy:
    def __init__(self, tuned):
        self.tuned = tuned
        self.keys = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = dict(zip(self.tuned.arg_names, args), **kwargs)
            self.keys.append({name: named[name] for name in self.tuned.keys})
        return launch


def spy_on(monkeypatch: pytest.MonkeyPatch, kernel_module, name: str = "_stage1_tuned") -> AutotuneSpy:
    """Replace kernel_module's autotuned kernel by a spy and make its launcher
    take the GPU's path (the autotuner) on CPU tensors, launching nothing."""
    spy = AutotuneSpy(getattr(kernel_module, name))
    monkeypatch.setattr(kernel_module, name, spy)
    monkeypatch.setattr(kernel_module.common, "interpreter_mode", lambda: False)
    monkeypatch.setattr(kernel_module.common, "check_launchable", lambda *a, **k: None)
    monkeypatch.setattr(kernel_module.splitk, "merge", lambda *a, **k: None)  # no partials were written to merge
    return spy
