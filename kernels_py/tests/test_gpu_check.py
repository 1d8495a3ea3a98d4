"""scripts/gpu-check, the GPU machine's round of benchmarks and compiled
tests: its flags are checked before anything runs, without a GPU it stops at
once, saying so, and its rehearsal on the CPU (--cpu) runs the same round at
the benchmarks' smoke sizes, into five files, within its deadline; what its
benchmarks capture in CUDA graphs never waits for the host."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
FILES = {"summary.txt", "bench.jsonl", "bench.log", "pytest.log", "calibration.jsonl"}
BENCHES = ["quant", "lowrank", "gather", "fp8", "stats", "stats-probe", "sparse-prefill"]


def gpu_check(*args: str, timeout: int = 120, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "WORKBENCH_PYTHON"}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check"), *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


@pytest.mark.parametrize("args, said", [
    (["--bogus"], "unknown flag --bogus"),
    (["--tests-seconds", "5m"], "--tests-seconds must be a whole number, got '5m'"),
    (["--workers", "-2"], "--workers must be a whole number, got '-2'"),
    (["--deadline", "soon"], "--deadline must be a whole number, got 'soon'"),
    ([], "give --python PY, an interpreter with torch and triton"),
])
def test_bad_flags_are_refused_with_the_usage(args, said):
    done = gpu_check(*args)
    assert done.returncode == 2 and said in done.stderr and "usage: scripts/gpu-check" in done.stderr


def test_help_lists_the_flags():
    done = gpu_check("--help")
    assert done.returncode == 0
    flags = ("--python", "--out", "--deadline", "--bench-seconds", "--commit", "--tests-seconds", "--tests",
             "--workers", "--skip-bench", "--skip-tests", "--generate", "--cpu")
    assert all(flag in done.stdout for flag in flags)


def test_an_interpreter_without_torch_is_refused(tmp_path):
    out = tmp_path / "out"
    done = gpu_check("--python", "/bin/true", "--out", str(out))
    assert done.returncode == 2 and "cannot import torch, triton and numpy" in done.stderr and not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU refusal needs a machine without one")
def test_without_a_gpu_it_stops_before_writing_anything(tmp_path):
    out = tmp_path / "out"
    done = gpu_check("--python", sys.executable, "--out", str(out))
    assert done.returncode == 2 and "sees no CUDA GPU" in done.stderr and "--cpu rehearses it" in done.stderr
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU run of the tests has better to do than rehearse")
def test_the_cpu_rehearsal_runs_every_step_into_five_files(tmp_path):
    out = tmp_path / "out"
    done = gpu_check("--python", sys.executable, "--out", str(out), "--cpu", "--tests",
                     "kernels_py/tests/test_protocol.py", "--deadline", "0", timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert {p.name for p in out.iterdir()} == FILES
    lines = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == BENCHES
    assert all(line["exit"] == 0 and line["result"]["interpreter"] and line["result"]["rows"] for line in lines)
    summary = (out / "summary.txt").read_text()
    assert "device: cpu (Triton interpreter: a rehearsal)" in summary and "pytest: " in summary
    assert "workbench bench quant (its smoke sizes) --json" in summary and "FAILED" not in summary


def test_a_benchmark_past_its_time_is_stopped_with_its_rows_kept(tmp_path):
    """--bench-seconds stops a benchmark; its line in bench.jsonl has the rows it measured before, the
    round fails, and the next steps still run. A stand-in interpreter: lowrank measures a row and hangs,
    the others answer at once."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/sh
if [ "$1" = -m ] && [ "$2" = kernels_py.benchmarks ]; then
  if [ "$3" = lowrank ]; then
    echo 'vlkv progress: bench lowrank: row 1 of 2: {{"batch": 8, "fused_ms": 0.2}}' >&2
    exec sleep 60
  fi
  echo 'stray compiler output'
  echo '{{"benchmark": "'$3'", "rows": [{{"batch": 8}}], "notes": []}}'
  exit 0
fi
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    out = tmp_path / "out"
    done = gpu_check("--python", str(fake), "--out", str(out), "--cpu", "--skip-tests", "--bench-seconds", "11",
                     "--deadline", "0", timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = {line["step"]: line for line in map(json.loads, (out / "bench.jsonl").read_text().splitlines())}
    assert lines["lowrank"]["exit"] == 124 and lines["lowrank"]["result"] is None
    assert lines["lowrank"]["partial_rows"] == [{"batch": 8, "fused_ms": 0.2}]
    assert lines["gather"]["exit"] == 0 and lines["gather"]["result"]["rows"] == [{"batch": 8}]  # the last line
    summary = (out / "summary.txt").read_text()
    assert "lowrank" in summary and "stopped at its time limit (exit 124)" in summary and "FAILED: lowrank" in summary


@pytest.mark.skipif(torch.cuda.is_available(), reason="the script's own mechanics: a GPU run has better to do")
def test_a_round_killed_from_outside_leaves_the_rows_so_far_and_the_five_files(tmp_path):
    """Killed during a benchmark (the machine's own time limit), the round
    has left its five files, and bench.log the rows that benchmark had
    measured: its progress goes to --out as it is printed."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/sh
if [ "$1" = -m ] && [ "$2" = kernels_py.benchmarks ]; then
  echo $$ >{tmp_path / "bench.pid"}
  echo 'vlkv progress: bench quant: row 1 of 2: {{"batch": 8, "quant_ms": 0.1}}' >&2
  exec sleep 60
fi
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "WORKBENCH_PYTHON"}
    round_ = subprocess.Popen(["bash", str(ROOT / "scripts" / "gpu-check"), "--python", str(fake), "--out", str(out),
                               "--cpu", "--deadline", "0"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "row 1 of 2" not in _text(out / "bench.log"):
            time.sleep(0.5)
    finally:
        os.killpg(round_.pid, signal.SIGKILL)  # the script; then the benchmark, in timeout's own process group
        round_.wait()
        if (tmp_path / "bench.pid").exists():
            os.kill(int((tmp_path / "bench.pid").read_text()), signal.SIGKILL)
    assert 'bench quant: row 1 of 2: {"batch": 8, "quant_ms": 0.1}' in _text(out / "bench.log")
    assert {p.name for p in out.iterdir()} == FILES


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_every_file_is_written_when_steps_are_skipped(tmp_path):
    out = tmp_path / "out"
    done = gpu_check("--python", sys.executable, "--out", str(out), "--cpu", "--skip-bench", "--skip-tests")
    assert done.returncode == 0, done.stdout + done.stderr
    assert {p.name for p in out.iterdir()} == FILES


def test_by_default_the_kernels_tests_run_first_and_every_file_once(tmp_path):
    """pytest collects a folder's files by name; the round lists them, the kernels' and their benchmarks' first,
    so that a time limit cuts the others."""
    out = tmp_path / "out"
    done = gpu_check("--python", sys.executable, "--out", str(out), "--cpu", "--skip-bench", "--tests-seconds", "3")
    line = next(x for x in (out / "summary.txt").read_text().splitlines() if x.startswith("pytest"))
    files = [w for w in line.split() if w.startswith("kernels_py/tests/")]
    assert files[:2] == ["kernels_py/tests/test_gather_decode.py", "kernels_py/tests/test_kv_quant.py"], line
    assert sorted(files) == sorted(str(p.relative_to(ROOT)) for p in (ROOT / "kernels_py/tests").glob("test_*.py"))
    assert files.index("kernels_py/tests/test_bench_generate.py") < files.index("kernels_py/tests/test_ablation.py")
    assert done.returncode == 1  # pytest stopped at its limit


def test_test_paths_are_the_callers_as_the_other_paths_are(tmp_path):
    out = tmp_path / "out"
    done = gpu_check("--python", sys.executable, "--out", str(out), "--cpu", "--skip-bench", "--tests",
                     "tests/test_protocol.py", cwd=ROOT / "kernels_py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{ROOT}/kernels_py/tests/test_protocol.py" in (out / "summary.txt").read_text()
    assert " passed" in (out / "pytest.log").read_text()


def test_steps_past_the_deadline_are_skipped_and_fail_the_round(tmp_path):
    out = tmp_path / "out"
    done = gpu_check("--python", sys.executable, "--out", str(out), "--cpu", "--deadline", "1")
    assert done.returncode == 1
    summary = (out / "summary.txt").read_text()
    assert "quant                  -    skipped: the deadline has passed" in summary
    assert "pytest                 -    skipped: the deadline has passed" in summary
    assert "FAILED: quant lowrank gather fp8 stats stats-probe sparse-prefill pytest" in summary


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU run captures them for real (test_bench_*.py)")
@pytest.mark.parametrize("name", ["quant", "lowrank", "gather", "fp8", "stats"])
def test_what_a_benchmark_times_in_a_cuda_graph_never_waits_for_the_host(name, monkeypatch):
    """time_median(graph=True) captures its call in a CUDA graph on a GPU,
    where reading a value back (.item(), bool(), int() of a tensor, nonzero)
    fails the capture and leaves the CUDA context unusable for every later
    row. Here, each such call of the round's benchmarks is run once more
    with every PyTorch op it dispatches watched."""
    import importlib

    from torch.utils._python_dispatch import TorchDispatchMode

    from kernels_py import benchmarks

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name.split("::")[-1] in ("_local_scalar_dense", "nonzero", "is_nonzero", "equal"):
                self.ops.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    module = importlib.import_module(f"kernels_py.benchmarks.{name}")
    timed, time_median = [], module.time_median

    def watched(fn, repeat, cuda, graph=False):
        if graph:
            fn()  # the warm-up, as time_median's own: its first call may read values (an autotuner's)
            with Reads() as reads:
                fn()
            timed.append(reads.ops)
        return time_median(fn, repeat, cuda, graph)

    monkeypatch.setattr(module, "time_median", watched)
    benchmarks.run(name, dict(benchmarks.BENCHMARKS[name].smoke_sizes(), repeat=1))
    assert timed and all(ops == [] for ops in timed), timed


def test_the_benchmark_entry_prints_its_result_alone_on_stdout(monkeypatch, capfd):
    """Whatever a benchmark's run prints (a compiler's report) goes to stderr: stdout is its JSON line."""
    import kernels_py.benchmarks.__main__ as entry

    def noisy(name, params):
        print("ptxas info : a report on stdout")
        return {"benchmark": name, "params": params, "rows": [], "notes": ["a note"]}

    monkeypatch.setattr(entry, "run", noisy)
    assert entry.main(["gather", '{"batches": [8]}']) == 0
    out, err = capfd.readouterr()
    assert json.loads(out) == {"benchmark": "gather", "params": {"batches": [8]}, "rows": [], "notes": ["a note"]}
    assert "ptxas info" in err and "note: a note" in err
    assert entry.main(["gather", "[8]"]) == 2 and "must be an object of knobs" in capfd.readouterr().err


def test_the_benchmark_entrys_line_is_json_with_a_non_finite_number_in_it(monkeypatch, capfd):
    """A kernel that returns NaN gives its row a NaN output_err (and its run a note): the line is still JSON,
    with null for it, as `workbench bench --json` prints it."""
    import kernels_py.benchmarks.__main__ as entry

    def broken(name, params):
        return {"benchmark": name, "rows": [{"output_err": float("nan"), "speedup": float("inf"), "ms": 1.5}],
                "notes": ["row 1: the kernel's output is nan from its unfused baseline's"]}

    monkeypatch.setattr(entry, "run", broken)
    assert entry.main(["gather"]) == 0
    out = capfd.readouterr().out

    def no_constants(name):
        raise ValueError(f"{name} is not JSON")

    assert json.loads(out, parse_constant=no_constants)["rows"] == [{"output_err": None, "speedup": None, "ms": 1.5}]


def test_compiling_for_the_estimate_leaves_tritons_settings_as_it_found_them(monkeypatch):
    """The estimate compiles with Triton's cache off and ptxas's log printed; a benchmark's later compiles in the
    same process must not (the log went to stdout, and every compile skipped the cache)."""
    from triton import knobs

    from kernels_py.ops import compile as cc

    before = knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log
    seen = []
    monkeypatch.setattr(cc, "_compile_launches", lambda *a: seen.append(
        (knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log)) or ([], {}, []))
    cc.compile_launches(lambda: None, 90)
    assert seen == [(True, True)] and (knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log) == before


def test_the_benchmark_entry_refuses_what_cannot_run_and_keeps_a_benchmarks_own_errors(monkeypatch, capfd):
    """An unknown name, or a CPU without Triton's interpreter (where every row fails at its first kernel), is
    refused before the run (exit 2); a ValueError raised inside a run is the benchmark's, not a bad knob."""
    import kernels_py.benchmarks.__main__ as entry

    ran = []
    monkeypatch.setattr(entry, "run", lambda name, params: ran.append(name) or {"notes": []})
    assert entry.main(["gahter"]) == 2
    assert "'gahter' is unknown (did you mean 'gather'?)" in capfd.readouterr().err
    monkeypatch.setenv("VLKV_DEVICE", "cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert entry.main(["gather"]) == 2 and "set TRITON_INTERPRET=1" in capfd.readouterr().err and ran == []
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def broken(name, params):
        raise ValueError("a launcher's own check")

    monkeypatch.setattr(entry, "run", broken)
    with pytest.raises(ValueError, match="a launcher's own check"):
        entry.main(["gather"])
