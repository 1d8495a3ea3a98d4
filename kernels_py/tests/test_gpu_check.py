"""scripts/gpu-check, the GPU machine's round of benchmarks and compiled
tests: its flags are checked before anything runs, and without a GPU it
stops at once, saying so."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WORKBENCH = ROOT / "bin" / "workbench"


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, WORKBENCH=str(WORKBENCH))
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check"), *args], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args, said", [
    (["--bogus"], "unknown flag --bogus"),
    (["--tests-seconds", "5m"], "--tests-seconds must be a whole number, got '5m'"),
    (["--workers", "-2"], "--workers must be a whole number, got '-2'"),
])
def test_bad_flags_are_refused_with_the_usage(args, said):
    done = gpu_check(*args)
    assert done.returncode == 2 and said in done.stderr and "usage: scripts/gpu-check" in done.stderr


def test_help_lists_the_flags():
    done = gpu_check("--help")
    assert done.returncode == 0
    flags = ("--python", "--out", "--tests-seconds", "--tests", "--workers", "--skip-bench", "--skip-tests",
             "--generate")
    assert all(flag in done.stdout for flag in flags)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU refusal needs a machine without one")
@pytest.mark.skipif(not WORKBENCH.is_file(), reason="bin/workbench is not built (scripts/test builds it)")
def test_without_a_gpu_it_stops_before_writing_anything(tmp_path):
    out = tmp_path / "out"
    done = gpu_check("--python", sys.executable, "--out", str(out))
    assert done.returncode == 2 and "sees no CUDA GPU" in done.stderr
    assert not out.exists()
