"""kernels_py.runs: runs read into one DataFrame with a run column."""

import json

import pandas as pd
import pytest

from kernels_py.runs import find_run, journal_rows, newest_runs, read_run, read_runs


def make_run(root, experiment, run_id, errors):
    run = root / experiment / run_id
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"experiment": experiment, "run_id": run_id}))
    pd.DataFrame({"job_id": [f"j{i}" for i in range(len(errors))], "metric_rel_err_mean": errors}).to_parquet(
        run / "results.parquet")
    return run


@pytest.mark.parametrize("runs, newest", [
    # run directory name: its manifest's "started" (None: none recorded) -> the newest two, oldest first
    ({"20260101-000000-aaaaaa": "2026-01-01T00:00:00.5Z", "20260102-000000-bbbbbb": "2026-01-02T00:00:00Z"},
     ["20260101-000000-aaaaaa", "20260102-000000-bbbbbb"]),
    # a copy of the older run, named by hand: not the newest
    ({"20260101-000000-aaaaaa": "2026-01-01T00:00:00.123456789Z", "baseline": "2026-01-01T00:00:00.123456789Z",
      "20260102-000000-bbbbbb": "2026-01-02T00:00:00Z"}, ["baseline", "20260102-000000-bbbbbb"]),
    # started in another zone, later than it reads
    ({"20260101-100000-aaaaaa": "2026-01-01T10:00:00Z", "mine": "2026-01-01T09:00:00.25-02:00"},
     ["20260101-100000-aaaaaa", "mine"]),
    # a run id dates its run, before its manifest (rebuilt from the journal, it holds the first row's time)
    ({"20260103-000000-cccccc": None, "old": "2026-01-02T00:00:00Z", "20260101-000000-aaaaaa": "2026-01-04T00:00:00Z"},
     ["old", "20260103-000000-cccccc"]),
    # no start anywhere: the oldest
    ({"20260101-000000-aaaaaa": None, "20260102-000000-bbbbbb": None, "zzz": "0001-01-01T00:00:00Z"},
     ["20260101-000000-aaaaaa", "20260102-000000-bbbbbb"]),
])
def test_newest_runs_go_by_when_each_started(tmp_path, runs, newest):
    for name, started in runs.items():
        run = tmp_path / "e" / name
        run.mkdir(parents=True)
        manifest = {"experiment": "e", "run_id": name}
        if started is not None:
            manifest["started"] = started
        (run / "manifest.json").write_text(json.dumps(manifest))
    assert [run.name for run in newest_runs("e", 2, tmp_path)] == newest


def test_read_runs_adds_a_run_column(tmp_path, monkeypatch):
    a = make_run(tmp_path, "e", "20260101-000000-aaaaaa", [0.1, 0.2])
    b = make_run(tmp_path, "e", "20260102-000000-bbbbbb", [0.1, 0.3])
    df = read_runs([a, b])
    assert list(df.run) == [a.name, a.name, b.name, b.name] and len(df) == 4
    assert read_run(a).attrs["manifest"]["run_id"] == a.name
    wide = df.pivot_table(index="job_id", columns="run", values="metric_rel_err_mean")
    assert (wide[b.name] - wide[a.name]).round(6).tolist() == [0.0, 0.1]
    assert newest_runs("e", 2, tmp_path) == [a, b]
    monkeypatch.delenv("VLKV_RUN_DIR", raising=False)
    assert find_run("e", tmp_path) == b
    other = make_run(tmp_path, "f", a.name, [0.5])
    assert set(read_runs([a, other]).run) == {f"e/{a.name}", f"f/{a.name}"}
    with pytest.raises(FileNotFoundError, match="2 wanted"):
        newest_runs("f", 2, tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no results.parquet: not a run directory \(give OUT/<experiment>/<run-id>\)"):
        read_run(tmp_path / "e")
    # A run killed before it wrote its table has a journal: status builds the table from it.
    killed = tmp_path / "e" / "20260103-000000-cccccc"
    killed.mkdir()
    (killed / "journal.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match=f"no results.parquet yet .its journal holds 0 jobs.*`workbench status {killed}` builds it"):
        read_run(killed)


def test_compare_frame_of_runs_sharing_no_job_keeps_its_columns():
    """The compare notebook selects delta[delta.changed]: runs that share no job give an empty frame with it."""
    from kernels_py.runs import compare_frame

    delta = compare_frame({"rows": []})
    assert delta[delta.changed].empty and delta.index.name == "key"
    row = {"key": "budget=0.1", "params": {"budget": 0.1}, "changed": True,
           "deltas": [{"metric": "rel_err_mean", "abs": 0.2, "rel": 1.0, "a": 0.2, "b": 0.4}]}
    assert compare_frame({"rows": [row]}).loc["budget=0.1", "rel_err_mean"] == 0.2


def test_journal_rows_refuse_a_bad_line_before_the_last(tmp_path):
    """As gohost/results.ReadJournal: only a torn last line is left out; a bad line before it is an error,
    never the silent loss of every record after it."""
    first, second = ({"job_id": j, "method": "h2o", "status": "ok", "metrics": {"rel_err_mean": 0.1}} for j in "ab")
    (tmp_path / "journal.jsonl").write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n" + '{"job_id": "c", "met')
    assert [r["job_id"] for r in journal_rows(tmp_path)] == ["a", "b"]
    (tmp_path / "journal.jsonl").write_text(json.dumps(first) + "\n" + '{"job_id": "c", "met' + "\n" + json.dumps(second) + "\n")
    with pytest.raises(ValueError, match="journal.jsonl line 2"):
        journal_rows(tmp_path)
    (tmp_path / "journal.jsonl").write_text(json.dumps(first) + "\n" + '{"job_id": "c", "met' + "\n")
    with pytest.raises(ValueError, match="journal.jsonl line 2"):  # a newline after it: not torn (Go refuses it too)
        journal_rows(tmp_path)


def test_read_run_warns_of_jobs_its_journal_holds_and_its_table_lacks(tmp_path):
    """A run killed before it rebuilt its table: a notebook opened on it in Jupyter reads fewer rows than the
    run has, and is told so."""
    run = make_run(tmp_path, "e", "20260101-000000-aaaaaa", [0.1])
    records = [{"job_id": j, "method": "h2o", "status": "ok", "metrics": {"rel_err_mean": 0.1}} for j in ("j0", "j1")]
    (run / "journal.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.warns(UserWarning, match="journal holds 2 jobs, its results.parquet 1 rows"):
        assert len(read_run(run)) == 1
    (run / "results.parquet").unlink()
    with pytest.raises(FileNotFoundError, match="no results.parquet yet .its journal holds 2 jobs"):
        read_run(run)
