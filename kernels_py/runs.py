"""Run directories as pandas DataFrames, for notebooks: one run, the newest
run of an experiment, or several runs in one frame with a `run` column (the
notebook side of `workbench compare`).

    from kernels_py.runs import find_run, read_run, read_runs
    df = read_runs([run_a, run_b])          # one row per job and run
    df.pivot_table(index=["method", "param_budget"], columns="run", values="metric_rel_err_mean")
"""

import json
import os
from pathlib import Path


def find_run(experiment: str, root: str | os.PathLike | None = None) -> Path:
    """$VLKV_RUN_DIR if set, else the newest run of `experiment` under root
    (default $VLKV_RESULTS, else ../results)."""
    if os.environ.get("VLKV_RUN_DIR"):
        return Path(os.environ["VLKV_RUN_DIR"])
    return newest_runs(experiment, 1, root)[0]


def newest_runs(experiment: str, count: int, root: str | os.PathLike | None = None) -> list[Path]:
    """The `count` newest runs of an experiment, oldest first."""
    base = Path(root or os.environ.get("VLKV_RESULTS", "../results")) / experiment
    runs = sorted(p for p in base.iterdir() if (p / "manifest.json").exists()) if base.is_dir() else []
    if len(runs) < count:
        raise FileNotFoundError(f"{len(runs)} run(s) of {experiment} under {base}, {count} wanted: "
                                f"run `workbench run` on its script first")
    return runs[-count:]


def read_run(run: str | os.PathLike):
    """results.parquet of a run, with its manifest in df.attrs["manifest"]."""
    import pandas as pd

    run = Path(run)
    if not (run / "results.parquet").exists():
        raise FileNotFoundError(f"{run} has no results.parquet: not a finished run directory")
    df = pd.read_parquet(run / "results.parquet")
    manifest = run / "manifest.json"
    df.attrs["manifest"] = json.loads(manifest.read_text()) if manifest.exists() else {}
    return df


def read_runs(runs, names: list[str] | None = None):
    """Several runs in one DataFrame, a `run` column naming each row's run:
    `names`, else each run's directory name (its id), prefixed by the
    experiment when two runs share an id."""
    import pandas as pd

    runs = [Path(r) for r in runs]
    if names is None:
        names = [r.name for r in runs]
        if len(set(names)) < len(names):
            names = [f"{r.parent.name}/{r.name}" for r in runs]
    if len(names) != len(runs):
        raise ValueError(f"{len(names)} names for {len(runs)} runs")
    frames = []
    for run, name in zip(runs, names):
        df = read_run(run)
        df.insert(0, "run", name)
        frames.append(df)
    return pd.concat(frames, ignore_index=True, sort=False)
