"""python -m kernels_py.benchmarks NAME [PARAMS_JSON]: one benchmark, as
`workbench bench NAME --json` runs it, without the Go host (a GPU machine
with Python but not the workbench binary: scripts/gpu-check), its result
printed as one JSON line on stdout and its progress and notes on stderr.
PARAMS_JSON sets its knobs by their names, e.g. '{"lengths": [32768],
"batches": [8, 64]}' for `--lengths 32768 --batches 8,64`; the rest keep
their defaults. Set VLKV_DEVICE=cuda to insist on the GPU; without one,
TRITON_INTERPRET=1 runs the kernels under Triton's interpreter at tiny sizes
(as `workbench bench` does), and without that the benchmark is refused.
Exit 2: an unknown benchmark or knob, or no device to run it on."""

import contextlib
import json
import os
import sys

from kernels_py import runtime
from kernels_py.benchmarks import BENCHMARKS, run
from kernels_py.params import BadKnobs, closest
from kernels_py.runtime.worker import jsonable


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not 1 <= len(argv) <= 2 or argv[0] in ("-h", "--help"):
        print(__doc__ + f"\nBenchmarks: {', '.join(sorted(BENCHMARKS))}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    name = argv[0]
    if name not in BENCHMARKS:
        print(f"benchmark {name!r} is unknown{closest(name, sorted(BENCHMARKS))}; known: {', '.join(sorted(BENCHMARKS))}",
              file=sys.stderr)
        return 2
    try:
        params = json.loads(argv[1]) if len(argv) > 1 else {}
    except json.JSONDecodeError as err:
        print(f"benchmark {name}: PARAMS_JSON is not JSON ({err})", file=sys.stderr)
        return 2
    if not isinstance(params, dict):
        print(f"benchmark {name}: PARAMS_JSON must be an object of knobs, got {type(params).__name__}",
              file=sys.stderr)
        return 2
    if why := runtime.unusable_device():
        print(f"benchmark {name}: {why}", file=sys.stderr)
        return 2
    if runtime.device().type == "cpu" and not runtime.interpreter_mode():  # every row would fail at its first kernel
        print(f"benchmark {name}: no CUDA device, and on the CPU the Triton kernels run only under Triton's "
              f"interpreter: set TRITON_INTERPRET=1 (tiny sizes that show the benchmark works; `workbench bench "
              f"{name}` sets it) or run on a GPU", file=sys.stderr)
        return 2
    # stdout carries the result alone: whatever the run prints (a compiler's report) goes to stderr.
    sys.stdout.flush()
    stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # Python's prints; the fd, a compiler's
            result = run(name, params)
    except BadKnobs as err:  # a knob's value; any other error is the benchmark's, with its traceback
        print(f"benchmark {name}: {err}", file=sys.stderr)
        return 2
    finally:
        sys.stdout.flush()
        os.dup2(stdout, 1)
        os.close(stdout)
    for note in result["notes"]:
        print(f"note: {note}", file=sys.stderr)
    # As the worker sends it to `workbench bench --json`: a non-finite number (a broken kernel's NaN error) as
    # null, since NaN is no JSON and the line must parse anywhere.
    print(json.dumps(jsonable(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
