"""Run directories as pandas DataFrames, for notebooks: one run, the newest
run of an experiment, or several runs in one frame with a `run` column; and
the join of `workbench compare`, so a notebook pairs exactly the rows the
CLI pairs.

    from kernels_py.runs import compare_frame, compare_runs, read_runs
    df = read_runs([run_a, run_b])          # one row per job and run
    cmp = compare_runs(run_a, run_b)        # what `workbench compare A B --json` holds
    compare_frame(cmp)                      # B - A per joined row and metric
"""

import json
import math
import os
import re
from pathlib import Path


def find_run(experiment: str, root: str | os.PathLike | None = None) -> Path:
    """$VLKV_RUN_DIR if set, else the newest run of `experiment` under root
    (default $VLKV_RESULTS, else ../results)."""
    if os.environ.get("VLKV_RUN_DIR"):
        return Path(os.environ["VLKV_RUN_DIR"])
    return newest_runs(experiment, 1, root)[0]


def newest_runs(experiment: str, count: int, root: str | os.PathLike | None = None) -> list[Path]:
    """The `count` newest runs of an experiment, oldest first, by when each
    started (as `workbench run --resume` picks the newest): a run copied or
    renamed to a name of its own ("baseline") is not taken for the newest."""
    base = Path(root or os.environ.get("VLKV_RESULTS", "../results")) / experiment
    runs = [p for p in base.iterdir() if (p / "manifest.json").exists()] if base.is_dir() else []
    runs.sort(key=lambda run: (_run_started(run), run.name))
    if len(runs) < count:
        raise FileNotFoundError(f"{len(runs)} run(s) of {experiment} under {base}, {count} wanted: "
                                f"run `workbench run` on its script first")
    return runs[-count:]


# A time as Go's encoding/json writes it: nanoseconds at most, "Z" or an offset.
_GO_TIME = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)")


def _run_started(run: Path):
    """When a run started, as gohost/results.runStarted says: the time its
    name names as a run id does (YYYYMMDD-HHMMSS-..., UTC), else its
    manifest's `started`, else the earliest time."""
    from datetime import datetime, timezone

    try:
        return datetime.strptime(run.name[:15], "%Y%m%d-%H%M%S").replace(tzinfo=timezone.utc)
    except ValueError:
        pass
    try:
        started = str(json.loads((run / "manifest.json").read_text()).get("started", ""))
    except (OSError, ValueError, AttributeError):
        started = ""
    found = _GO_TIME.fullmatch(started)
    if not found:
        return datetime.min.replace(tzinfo=timezone.utc)
    stamp, fraction, zone = found.groups()
    # fromisoformat takes microseconds, and "Z" only from Python 3.11.
    return datetime.fromisoformat(f"{stamp}.{(fraction or '')[:6].ljust(6, '0')}{'+00:00' if zone == 'Z' else zone}")


def read_run(run: str | os.PathLike):
    """results.parquet of a run, with its manifest in df.attrs["manifest"].
    A run stopped before it rebuilt its table (killed, or still running)
    has jobs in its journal that the table lacks: a warning says how many
    (`workbench notebook` rebuilds the table before a notebook reads it)."""
    import pandas as pd

    run = Path(run)
    journaled = len({r["job_id"] for r in _journal_records(run / "journal.jsonl")})
    if not (run / "results.parquet").exists():
        if (run / "journal.jsonl").exists():  # a run killed before it wrote its table: the journal has its jobs
            raise FileNotFoundError(f"{run} has no results.parquet yet (its journal holds {journaled} jobs: a run "
                                    f"that was killed, or is still running): `workbench status {run}` builds it "
                                    f"from the journal")
        raise FileNotFoundError(f"{run} has no results.parquet: not a run directory (give OUT/<experiment>/<run-id>)")
    df = pd.read_parquet(run / "results.parquet")
    if journaled > len(df):
        import warnings

        warnings.warn(f"{run}: its journal holds {journaled} jobs, its results.parquet {len(df)} rows (the run "
                      f"stopped before it rebuilt the table): the rest are left out; `workbench notebook NOTEBOOK "
                      f"{run}` rebuilds it first", stacklevel=2)
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


# The join of `workbench compare` (gohost/compare), for notebooks: the same
# keys, the same rows joined, the same deltas, so a notebook never pairs
# rows the CLI would not. compare_test.go's TestCompareJoinsAsThePythonSide
# holds the two to the same answer.

TIMING_SUFFIXES = ("_seconds", "_ms", "_us", "_time")


def journal_rows(run: str | os.PathLike) -> list[dict]:
    """The run's rows as compare reads them: the last journal record of each
    job; where the journal lacks jobs its results.parquet has (none: a run
    copied as its table; or one lost and left empty), the table's rows. A
    torn last line (a crash mid-write) is left out; any other line that is not
    JSON raises ValueError, as `workbench compare` refuses the run."""
    run = Path(run)
    path, table = run / "journal.jsonl", run / "results.parquet"
    if not path.exists() and not table.exists():
        raise FileNotFoundError(f"{run} has no journal.jsonl or results.parquet: not a run directory")
    records = _journal_records(path)
    last = {r["job_id"]: i for i, r in enumerate(records)}
    if table.exists():
        import pyarrow.parquet as pq

        if pq.ParquetFile(table).metadata.num_rows > len(last):
            return _table_rows(table)
    return [r for i, r in enumerate(records) if last[r["job_id"]] == i]


def _journal_records(path: Path) -> list[dict]:
    """The journal's records in order (none where there is no journal), as
    results.ReadJournal reads them: a torn last line is left out, any other
    line that is not JSON raises ValueError."""
    records = []
    lines = path.read_text().split("\n") if path.exists() else []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                if number == len(lines):  # a torn last line, no newline after it: the job did not finish
                    break
                # as results.ReadJournal: the records after it are not dropped unseen
                raise ValueError(f"{path} line {number}: {err}") from None
    return records


# results.parquet's columns that hold a record's fields (gohost/results: flatten).
_TABLE_FIELDS = {"job_id": "job_id", "experiment": "experiment", "method": "method", "status": "status",
                 "error": "error", "attempts": "attempts", "duration_seconds": "duration_seconds",
                 "wall_seconds": "wall_seconds", "kernels_digest": "kernels_digest", "workload": "workload_name",
                 "finished": "finished"}


def _table_rows(table: Path) -> list[dict]:
    """results.parquet's rows as journal records, as compare reads a table
    (gohost/results.ReadParquet): param_, workload_ and metric_ columns back
    into their maps, nulls left out of params and workload knobs, a null
    metric None; JSON text columns (lists) stay text."""
    import pyarrow.parquet as pq

    rows = []
    for row in pq.read_table(table).to_pylist():
        rec = {"params": {}, "workload": {}, "metrics": {}}
        for name, value in row.items():
            if name in _TABLE_FIELDS:
                rec[_TABLE_FIELDS[name]] = value
            elif name.startswith("param_") and value is not None:
                rec["params"][name[len("param_"):]] = value
            elif name.startswith("workload_") and value is not None:
                rec["workload"][name[len("workload_"):]] = value
            elif name.startswith("metric_"):
                rec["metrics"][name[len("metric_"):]] = value
        rows.append(rec)
    return rows


def _go_float(x: float) -> str:
    """x as Go's strconv.FormatFloat(x, 'g', -1, 64) writes it: the join keys are text."""
    if x != x:
        return "NaN"
    if x in (float("inf"), float("-inf")):
        return "+Inf" if x > 0 else "-Inf"
    if x == 0:
        return "-0" if str(x).startswith("-") else "0"
    from decimal import Decimal

    sign, digits, exponent = Decimal(repr(abs(x))).normalize().as_tuple()
    digits = "".join(map(str, digits))
    point = len(digits) + exponent  # digits before the decimal point
    neg = "-" if x < 0 else ""
    exp = point - 1
    if exp < -4 or exp >= 6:  # Go's shortest %g switches to %e here
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{neg}{mantissa}e{'+' if exp >= 0 else '-'}{abs(exp):02d}"
    if point <= 0:
        return f"{neg}0.{'0' * -point}{digits}"
    if point >= len(digits):
        return neg + digits + "0" * (point - len(digits))
    return f"{neg}{digits[:point]}.{digits[point:]}"


def _go_value(v) -> str:
    """A parameter's value as a join key's text (gohost/compare format)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return _go_float(float(v))
    if isinstance(v, str):
        return v
    return json.dumps(_integral(v), separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def _integral(v):
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, list):
        return [_integral(x) for x in v]
    if isinstance(v, dict):
        return {k: _integral(x) for k, x in v.items()}
    return v


def _fields(row: dict) -> tuple[dict, dict]:
    """({key: text}, {key: value}) of a row: method, workload, its knobs, its workload's knobs."""
    values = {"method": row.get("method"), "workload": row.get("workload_name") or "synthetic"}
    values.update(row.get("params") or {})
    values.update({f"workload.{k}": v for k, v in (row.get("workload") or {}).items()})
    return {k: _go_value(v) for k, v in values.items()}, values


def _kind(f: dict) -> str:
    """A row's kind: its method on its workload."""
    return f"{f['method']} on {f['workload']}"


def _knobs_of_kinds(fs) -> dict:
    """{kind: the fields its rows have}."""
    out = {}
    for f, _ in fs:
        out.setdefault(_kind(f), set()).update(f)
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def compare_runs(run_a, run_b, by: list[str] | None = None, metrics: list[str] | None = None,
                 tolerance: float = 1e-9) -> dict:
    """Join two runs exactly as `workbench compare RUN_A RUN_B` does and
    return what its --json holds: {"keys", "varied", "metrics", "rows":
    [{"key", "params", "status_a", "status_b", "changed", "kernels_differ",
    "error_a"/"error_b" (the first error of a side that failed, where one did),
    "deltas": [{"metric", "a", "b", "abs", "rel", "changed", "is_timing"}]}],
    "only_a", "only_b" (with "only_*_params" and "only_*_status"), "changed"}.
    Rows are joined on every parameter except a knob that holds one value in
    each run and differs between them (named in "varied"); `by` joins on the
    keys given instead (rows sharing a key are averaged). A metric a job ok
    in both runs lost in B (null) is a change with b, abs and rel None. A run
    without rows joins on the other's parameters. `compare_frame` turns it
    into a DataFrame."""
    a, b = journal_rows(run_a), journal_rows(run_b)
    fa, fb = [_fields(r) for r in a], [_fields(r) for r in b]
    in_a = {k for f, _ in fa for k in f}
    in_b = {k for f, _ in fb for k in f}
    shared_keys = in_b if not fa else in_a if not fb else in_a & in_b  # a run without rows joins on the other's
    # Rows join on every knob they have (the rows of a method one run lacks
    # are told apart by their own knobs), but a kind of row (a method on a
    # workload) that has a knob in one run and not in the other joins without
    # it (other kinds still join on it).
    kinds_a, kinds_b = _knobs_of_kinds(fa), _knobs_of_kinds(fb)
    common = in_a | in_b
    skip = {kind: kinds_a[kind] ^ kinds_b[kind] for kind in kinds_a.keys() & kinds_b.keys()}
    varied = []
    if by:
        keys = []
        for k in by:
            if k not in shared_keys:
                raise ValueError(f"--by {k}: not a parameter of both runs; they share: {', '.join(sorted(shared_keys))}")
            if k not in keys:
                keys.append(k)
    else:
        keys = []
        for k in sorted(common):
            change = None if k == "method" else _varied(k, fa, fb)
            if change:
                varied.append(change)
            else:
                keys.append(k)
        every = fa + fb
        keys = [k for k in keys if k == "method" or len({f[k] for f, _ in every if k in f}) > 1]
    metrics_a = {m for r in a for m in (r.get("metrics") or {})}
    metrics_b = {m for r in b for m in (r.get("metrics") or {})}
    shared = sorted(metrics_b if not a else metrics_a if not b else metrics_a & metrics_b)
    if metrics:
        for m in metrics:
            if m not in shared:
                raise ValueError(f"unknown metric {m!r}: the runs share {', '.join(shared)}")
    chosen = list(metrics) if metrics else shared
    asked = set(metrics or [])

    def group(rows, fs):
        out = {}
        for row, (f, values) in zip(rows, fs):
            skipped = set() if by else skip.get(_kind(f), set())
            parts = [f"{k}={f[k]}" if k in f else f"{k}=-" for k in keys if (k in f or by) and k not in skipped]
            out.setdefault(" ".join(parts), []).append((row, values))
        return out

    ga, gb = group(a, fa), group(b, fb)
    out = {"keys": keys, "varied": varied, "metrics": chosen, "rows": [], "only_a": [], "only_b": [],
           "only_a_params": [], "only_b_params": [], "only_a_status": [], "only_b_status": [], "changed": 0}
    for key in sorted(set(ga) | set(gb), key=lambda k: k.encode()):
        ra, rb = ga.get(key, []), gb.get(key, [])
        if not ra or not rb:
            side, rows = ("b", rb) if not ra else ("a", ra)
            out[f"only_{side}"].append(key)
            out[f"only_{side}_params"].append({k: rows[0][1].get(k) for k in keys})
            out[f"only_{side}_status"].append(_status(rows))
            continue
        row = {"key": key, "params": {k: ra[0][1].get(k) for k in keys}, "status_a": _status(ra),
               "status_b": _status(rb), "kernels_differ": _digests(ra) != _digests(rb), "deltas": []}
        for side, rows in (("a", ra), ("b", rb)):
            if error := next((r.get("error", "") for r, _ in rows if r.get("status") != "ok"), ""):
                row[f"error_{side}"] = error
        changed = row["status_a"] != row["status_b"]
        for m in chosen:
            va, vb = _mean(ra, m), _mean(rb, m)
            timing = m.endswith(TIMING_SUFFIXES) and m not in asked
            if va is not None and vb is None and row["status_a"] == row["status_b"] == "ok":
                # lost in B (a worker writes NaN as null): a change, never a blank a guard would pass
                changed = changed or not timing
                row["deltas"].append({"metric": m, "a": va, "b": None, "abs": None, "rel": None,
                                      "changed": True, "is_timing": timing})
                continue
            if va is None or vb is None:
                continue
            differs = not _equal(va, vb, tolerance)
            changed = changed or (differs and not timing)
            rel = _relative(va, vb)
            row["deltas"].append({"metric": m, "a": va, "b": vb, "abs": vb - va,
                                  "rel": rel if math.isfinite(rel) else None,
                                  "changed": differs, "is_timing": timing})
        row["changed"] = changed
        out["changed"] += changed
        out["rows"].append(row)
    return out


def _varied(k, fa, fb) -> str | None:
    """"k: a -> b (methods)" when every method holds one value of k per run and some differ."""
    def by_method(fs):
        out = {}
        for f, _ in fs:
            if k in f:
                out.setdefault(f["method"], set()).add(f[k])
        return out

    va, vb = by_method(fa), by_method(fb)
    changes = {}
    for method in sorted(va):
        if method not in vb:
            continue
        if len(va[method]) != 1 or len(vb[method]) != 1:
            return None
        x, y = next(iter(va[method])), next(iter(vb[method]))
        if x != y:
            changes.setdefault(f"{x} -> {y}", []).append(method)
    if not changes:
        return None
    return "; ".join(f"{k}: {change} ({', '.join(methods)})" for change, methods in sorted(changes.items()))


def _mean(rows, metric):
    values = [r["metrics"][metric] for r, _ in rows if _number((r.get("metrics") or {}).get(metric))]
    if not values:
        return None
    total = 0.0
    for v in values:  # in order, as compare does (sum() compensates, so it can differ in the last bit)
        total += v
    return total / len(values)


def _status(rows) -> str:
    return next((r["status"] for r, _ in rows if r.get("status") != "ok"), "ok")


def _digests(rows) -> list[str]:
    return sorted(r.get("kernels_digest", "") for r, _ in rows)


def _relative(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if a == 0:
        return float("inf") if b > 0 else float("-inf")
    return (b - a) / abs(a)


def _equal(a: float, b: float, tol: float) -> bool:
    if a == b or (a != a and b != b):
        return True
    return abs(b - a) <= tol * max(abs(a), abs(b))


def compare_frame(comparison: dict, value: str = "abs"):
    """compare_runs' joined rows as a DataFrame: one row per joined key
    (indexed by its text key, its parameters as columns), one column per
    metric holding `value` ("abs": B - A, "rel", "a" or "b"), a `changed`
    column."""
    import pandas as pd

    records = []
    for row in comparison["rows"]:
        rec = {"key": row["key"], **{f"param_{k}": v for k, v in row["params"].items()}, "changed": row["changed"]}
        rec.update({d["metric"]: d[value] for d in row["deltas"]})
        records.append(rec)
    if not records:  # no job in both runs: the frame still has its columns, for code that selects on them
        return pd.DataFrame({"changed": pd.Series(dtype=bool)}, index=pd.Index([], name="key"))
    return pd.DataFrame.from_records(records, index="key")
