"""Notebooks executed on small run directories written here, as
`workbench notebook NAME RUN_DIR` executes them (kernels_py.notebooks)."""

import json

import pandas as pd
import pytest

from kernels_py import notebooks

pytest.importorskip("nbclient")


def own_model_run(root):
    """A run of an own_model experiment that mixes this project's methods with a kvpress press, whose row
    has no per-layer error."""
    run = root / "own_model" / "20260101-000000-aaaaaa"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"experiment": "own_model", "jobs": 3}))
    pd.DataFrame({
        "job_id": ["a", "b", "c"], "method": ["full", "h2o", "kvpress"], "status": ["ok"] * 3,
        "param_budget": [None, 0.2, None], "param_press": [None, None, "SnapKVPress"],
        "param_compression_ratio": [None, None, 0.5],
        "metric_token_agreement": [1.0, 0.75, 0.5], "metric_kl_mean": [0.0, 0.1, 0.2],
        "metric_kl_max": [0.0, 0.3, 0.4], "metric_model_cache_bytes": [1000.0, 200.0, 1000.0],
        "metric_prefill_seconds": [0.1, 0.1, 0.1], "metric_decode_seconds": [0.2, 0.2, 0.2],
        "extra_per_layer_rel_err": ["[0, 0]", "[0.1, 0.2]", None],
    }).to_parquet(run / "results.parquet")
    return run


def two_models_and_a_trace_run(root):
    """An own_model run over two models and a replayed trace: the trace's rows have no in-model metrics."""
    run = root / "own_model" / "20260101-000000-bbbbbb"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"experiment": "own_model", "jobs": 5}))
    nan = float("nan")
    pd.DataFrame({
        "job_id": list("abcde"), "method": ["full", "h2o", "full", "h2o", "full"], "status": ["ok"] * 5,
        "workload": ["vlm", "vlm", "vlm", "vlm", "trace"],
        "workload_model": ["/m/llava", "/m/llava", "/m/qwen", "/m/qwen", None],
        "param_budget": [None, 0.2, None, 0.2, None],
        "metric_token_agreement": [1.0, 0.75, 1.0, 0.5, nan], "metric_kl_mean": [0.0, 0.1, 0.0, 0.3, nan],
        "metric_kl_max": [0.0, 0.3, 0.0, 0.6, nan],
        # qwen's h2o holds more bytes than llava's full cache, less than its own (the notebook asserts <= 1).
        "metric_model_cache_bytes": [1000.0, 200.0, 5000.0, 1500.0, nan],
        "metric_prefill_seconds": [0.1] * 4 + [nan], "metric_decode_seconds": [0.2] * 4 + [nan],
        "extra_per_layer_rel_err": ["[0, 0]", "[0.1, 0.2]", "[0, 0]", "[0.2, 0.3]", "[0, 0]"],
    }).to_parquet(run / "results.parquet")
    return run


def outputs(nb) -> str:
    return "\n".join("".join(o.get("text", "")) for c in nb.cells for o in c.get("outputs", []))


def test_own_model_draws_a_run_with_kvpress_rows(tmp_path):
    run = own_model_run(tmp_path)
    nb = notebooks.execute(notebooks.find("own_model"), env=notebooks.run_env([run]))
    assert "no per-layer error (not drawn): kvpress SnapKVPress 0.5" in outputs(nb)
    page = notebooks.write(nb, run / "own_model.ipynb", "own_model")
    text = page.read_text()
    assert (run / "own_model.ipynb").exists() and text.count('<img src="data:image/png;base64,') == 2
    assert "<h1>Methods inside your own model</h1>" in text and "kvpress SnapKVPress 0.5" in text


def test_own_model_compares_each_model_with_its_own_full_cache(tmp_path):
    run = two_models_and_a_trace_run(tmp_path)
    nb = notebooks.execute(notebooks.find("own_model"), env=notebooks.run_env([run]))
    assert "1 rows of replayed workloads (no in-model metrics) left out" in outputs(nb)
    page = notebooks.write(nb, run / "own_model.ipynb", "own_model").read_text()
    assert "llava: h2o 0.2" in page and "qwen: h2o 0.2" in page


def test_find_names_the_notebooks():
    assert notebooks.find("compare").name == "compare.ipynb"
    with pytest.raises(FileNotFoundError, match="notebooks/ has .*own_model"):
        notebooks.find("nosuch")


def test_figures_go_beside_the_written_notebook_not_into_the_run(tmp_path):
    """`workbench notebook NAME RUN --out DIR` writes its figures into DIR: a
    shared results folder may be read-only, and the run keeps only what ran."""
    run = own_model_run(tmp_path / "results")
    out = tmp_path / "report"
    out.mkdir()
    assert notebooks.main([str(notebooks.find("own_model")), str(out / "own_model.ipynb"), str(run)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == ["own_model_agreement.png", "own_model_layers.png"]
    assert not list(run.glob("*.png"))


def test_an_unfinished_run_is_told_to_finish_before_its_figures(tmp_path):
    """methods.ipynb draws every method of methods_compare: a run killed before some ran says which and how to
    finish it, rather than failing an assertion."""
    run = tmp_path / "methods_compare" / "20260101-000000-aaaaaa"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"experiment": "methods_compare", "jobs": 65,
                                                   "file": "/src/vlkv/experiments/methods_compare.star"}))
    pd.DataFrame({"job_id": ["a", "b"], "method": ["full", "h2o"], "status": ["ok", "ok"],
                  "param_budget": [None, 0.1], "metric_rel_err_mean": [0.0, 0.2]}).to_parquet(run / "results.parquet")
    with pytest.raises(Exception) as err:
        notebooks.execute(notebooks.find("methods"), env=notebooks.run_env([run]))
    assert f"{run} is unfinished (2 of 65 jobs have rows) and has no row of attentionpack, avl," in str(err.value)
    assert (f"finish it with `workbench run /src/vlkv/experiments/methods_compare.star --out {tmp_path.resolve()} "
            f"--resume`") in str(err.value)


def test_compare_warns_of_runs_of_different_experiments(tmp_path):
    runs = []
    for experiment in ("quickstart", "sweep"):
        run = tmp_path / experiment / "20260101-000000-aaaaaa"
        run.mkdir(parents=True)
        (run / "manifest.json").write_text(json.dumps({"experiment": experiment, "jobs": 1}))
        pd.DataFrame({"job_id": ["a"], "method": ["h2o"], "status": ["ok"], "param_budget": [0.1],
                      "metric_rel_err_mean": [0.2], "metric_compression_ratio": [10.0]}).to_parquet(
            run / "results.parquet")
        runs.append(run)
    nb = notebooks.execute(notebooks.find("compare"), env=notebooks.run_env(runs))
    assert "warning: the runs are of different experiments (quickstart, sweep)" in outputs(nb)


def quickstart_run(root, rows: dict, jobs: int):
    run = root / "sweep" / "20260101-000000-aaaaaa"
    (run / "tensors").mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"experiment": "sweep", "jobs": jobs,
                                                   "file": "/src/my/sweep.star"}))
    pd.DataFrame(rows).to_parquet(run / "results.parquet")
    return run


def test_quickstart_draws_a_run_without_h2o(tmp_path):
    """quickstart.ipynb reads a run of any experiment: one without H2O draws the per-step error of its most
    compressed job instead."""
    import numpy as np

    run = quickstart_run(tmp_path, {
        "job_id": ["a", "b", "c"], "method": ["full", "snapkv", "snapkv"], "status": ["ok"] * 3,
        "param_budget": [None, 0.1, 0.5], "metric_rel_err_mean": [0.0, 0.3, 0.1],
        "metric_compression_ratio": [1.0, 9.0, 2.0],
        "extra_tensor_rel_err": [f"tensors/{j}/rel_err.npy" for j in "abc"]}, jobs=3)
    for j in "abc":
        (run / "tensors" / j).mkdir()
        np.save(run / "tensors" / j / "rel_err.npy", np.zeros((2, 4), dtype=np.float32))
    nb = notebooks.execute(notebooks.find("quickstart"), env=notebooks.run_env([run]))
    page = notebooks.write(nb, run / "quickstart.ipynb", "quickstart").read_text()
    assert "per-step error of job b: snapkv, budget 0.1" in outputs(nb)
    assert page.count('<img src="data:image/png;base64,') == 2


@pytest.mark.parametrize("status, jobs, want", [
    ([], 10, "has no successful job yet (0 of 10 jobs have rows): finish it with "
             "`workbench run /src/my/sweep.star --out {root} --resume`"),
    (["failed", "failed"], 2, "every job of {run} failed (their error column says why): once the cause is fixed, "
                              "`workbench run /src/my/sweep.star --out {root} --resume --retry-failed`"),
])
def test_quickstart_says_what_to_do_with_a_run_without_a_successful_job(tmp_path, status, jobs, want):
    run = quickstart_run(tmp_path, {"job_id": [f"j{i}" for i in range(len(status))],
                                    "method": ["h2o"] * len(status), "status": status}, jobs=jobs)
    with pytest.raises(Exception) as err:
        notebooks.execute(notebooks.find("quickstart"), env=notebooks.run_env([run]))
    assert want.format(root=tmp_path.resolve(), run=run) in str(err.value)


def test_quickstart_before_any_run_says_how_to_make_one(tmp_path):
    """Opened in the lab before the first run (no results/quickstart/ yet): the command to run, not a traceback."""
    env = {"VLKV_RUN_DIR": "", "VLKV_RESULTS": str(tmp_path / "results")}
    with pytest.raises(Exception) as err:
        notebooks.execute(notebooks.find("quickstart"), env=env)
    assert "no runs under" in str(err.value) and "run `workbench run experiments/quickstart.star` first" in str(err.value)
    assert "FileNotFoundError" not in str(err.value)


def table_run(root, experiment, jobs, rows):
    run = root / experiment / "20260101-000000-aaaaaa"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"experiment": experiment, "jobs": jobs,
                                                   "file": f"/src/vlkv/experiments/{experiment}.star"}))
    pd.DataFrame(rows).assign(job_id=[f"j{i}" for i in range(len(rows))], status="ok").to_parquet(
        run / "results.parquet")
    return run


def vlcache_rows():
    """Every method of vlcache_sparsity, killed during the scoring policies' jobs (the script's last)."""
    layers = "[0.1, 0.1]"
    rows = [{"method": "full", "extra_per_layer_sparsity": "[0.2, 0.9]",
             "extra_per_layer_post_vision_sparsity": "[0.5, 0.9]"},
            {"method": "vlcache", "param_budget": 0.1, "param_allocation": "sparsity", "param_scoring": "post_vision",
             "param_recent_fraction": 0.1, "extra_per_layer_layer_budget": layers}]
    rows += [{"method": m, "param_budget": 0.1} for m in ("h2o", "snapkv", "streamingllm")]
    rows += [{"method": "zipvl_evict", "param_tau": 0.9}]
    rows += [{"method": "vlcache", "param_budget": b, "param_allocation": "uniform", "param_scoring": "accumulated",
              "param_recent_fraction": 0.0, "extra_per_layer_cache_hit_rate": "[0.3, 0.4]"} for b in (0.05, 0.1)]
    return [{"metric_rel_err_mean": 0.1, "metric_prefill_kept_fraction": 0.1, **r} for r in rows]


def methods_rows(finished=False):
    """methods_compare killed after LOOK-M's first merge at the last budget, or `finished`: every job of its
    script with the metrics its notebook reads."""
    rows = [{"method": "full"}]
    merges = ("none", "averaged", "pivotal", "weighted")
    for b in (0.05, 0.1, 0.2, 0.4):
        rows += [{"method": m, "param_budget": b} for m in ("h2o", "snapkv", "streamingllm", "vlcache", "pyramidkv")]
        rows += [{"method": "avl", "param_secondary": 100 * b, "metric_stored_fraction": b,
                  "metric_used_fraction": b / 2}, {"method": "fastv", "param_drop": 100 * (1 - b)}]
        rows += [{"method": "lookm", "param_recent_ratio": b / 10, "param_important_ratio": b * 9 / 10,
                  "param_merge": m} for m in (merges if finished or b < 0.4 else merges[:1])]
    rows += [{"method": "zipvl", "param_tau": 0.9}, {"method": "kivi", "param_bits": 2},
             {"method": "attentionpack", "param_rank_k": 64}, {"method": "fp8", "param_kv_dtype": "fp8_e4m3"}]
    if finished:
        rows += [{"method": "zipvl", "param_tau": 0.975}, {"method": "kivi", "param_bits": 4},
                 {"method": "attentionpack", "param_rank_k": 32, "param_low_group": "evict"}]
        rows += [{"method": m, "param_budget": 2 * b, "param_kv_dtype": "fp8_e4m3"}
                 for m in ("snapkv", "h2o") for b in (0.1, 0.4)]
    return [{"param_kv_dtype": "model", "param_fp8_scale": "tensor", "param_low_group": "decompress",
             "metric_compression_ratio": 2.0 if r["method"] == "fp8" else 1 / (r.get("param_budget") or 0.5),
             "metric_rel_err_mean": 0.1, "metric_cache_hit_rate": 0.5, "metric_ppci_steps_50": 0.5, **r}
            for r in rows]


def video_rows():
    """video killed during the methods without a budget: they ran on the shortest clip only."""
    rows = []
    for frames in (8, 16):
        rows += [{"method": "full", "images": frames}]
        rows += [{"method": m, "param_budget": 0.1, "images": frames}
                 for m in ("h2o", "snapkv", "vlcache", "streamingllm")]
        rows += [{"method": "avl", "param_secondary": 10.0, "images": frames},
                 {"method": "lookm", "param_recent_ratio": 0.01, "param_important_ratio": 0.09,
                  "param_merge": "pivotal", "images": frames}]
    rows += [{"method": "zipvl", "param_tau": 0.9, "images": 8}, {"method": "kivi", "param_bits": 2, "images": 8},
             {"method": "fp8", "images": 8}, {"method": "attentionpack", "param_rank_k": 16, "images": 8}]
    return [{"workload_video": True, "workload_images": r.pop("images"), "workload_frame_correlation": 0.9,
             "workload_system_tokens": 16, "workload_tokens_per_image": 64, "workload_text_tokens": 32,
             "metric_compression_ratio": 1.0 if r["method"] == "full" else 4.0,
             "metric_rel_err_mean": 0.0 if r["method"] == "full" else 0.1, **r} for r in rows]


def attentionpack_rows():
    """attentionpack killed during Figure 2's jobs (the script's first), before the per-head ones."""
    return [{"method": "full"}] + [
        {"method": "attentionpack", "param_groups": "1:1", "param_quant_bits": 0, "param_low_group": "decompress",
         "param_rope": "before", "param_head_mode": "combined", "param_rank_scheme": "fixed", "param_rank_k": r,
         "param_rank_v": r, "metric_explained_variance_k": 0.9} for r in (8, 16)]


def zipvl_rows():
    """zipvl killed before its KIVI and eviction jobs (the script's last)."""
    return [{"method": "full"}, {"method": "zipvl", "param_tau": 0.9},
            {"method": "zipvl_fixed", "param_ratio": 0.1}]


@pytest.mark.parametrize("notebook, experiment, jobs, rows, lacks", [
    ("attentionpack", "attentionpack", 54, attentionpack_rows,
     "lacks Figure 2's per-head ranks, Table 3's rank schemes, Figure 4's partial decompression at ranks 64 and 128, "
     "section 4.5's combinations"),
    ("zipvl", "zipvl", 25, zipvl_rows, "has no row of kivi, zipvl_evict"),
    ("vlcache", "vlcache_sparsity", 57, vlcache_rows,
     "lacks some of the scoring policies' jobs (uniform allocation, no recent window)"),
    ("methods", "methods_compare", 65, methods_rows,
     "has no row of lookm/averaged at 0.4, lookm/pivotal at 0.4, lookm/weighted at 0.4"),
    ("video", "video", 96, video_rows,
     "has attentionpack rank 16, fp8, kivi 2-bit, zipvl tau=0.9 at fewer lengths than [8, 16]"),
])
def test_a_run_killed_midway_is_told_to_finish(tmp_path, notebook, experiment, jobs, rows, lacks):
    """A run killed midway lacks jobs a later cell draws: the notebook says what it lacks and how to finish the run,
    rather than failing an assertion (a bare AssertionError for attentionpack) in that cell."""
    rows = rows()
    run = table_run(tmp_path, experiment, jobs, rows)
    with pytest.raises(Exception) as err:
        notebooks.execute(notebooks.find(notebook), env=notebooks.run_env([run]))
    assert f"{run} is unfinished ({len(rows)} of {jobs} jobs have rows) and {lacks}, which this notebook draws" in str(
        err.value)
    finish = f"`workbench run /src/vlkv/experiments/{experiment}.star --out {tmp_path.resolve()} --resume`"
    assert finish in str(err.value)


def test_compare_reads_runs_without_attention_error(tmp_path):
    """Two runs of an lmms experiment (task scores, no replayed attention): the error-against-compression figure
    is left out, saying why, and every metric's change per job still follows."""
    runs = []
    for name, score in (("20260101-000000-aaaaaa", 0.5), ("20260102-000000-bbbbbb", 0.4)):
        run = tmp_path / "accuracy" / name
        run.mkdir(parents=True)
        (run / "manifest.json").write_text(json.dumps({"experiment": "accuracy", "jobs": 2}))
        pd.DataFrame({"job_id": ["a", "b"], "method": ["full", "h2o"], "status": ["ok", "ok"],
                      "param_budget": [None, 0.1], "metric_relaxed_overall": [0.6, score],
                      "metric_kv_fraction": [1.0, 0.1]}).to_parquet(run / "results.parquet")
        runs.append(run)
    nb = notebooks.execute(notebooks.find("compare"), env=notebooks.run_env(runs))
    assert "no attention-output error or compression ratio in these runs" in outputs(nb)
    assert "metrics that changed: ['relaxed_overall']" in outputs(nb)


def kvpress_run(root, pairs: bool):
    """A kvpress_compare run: the full cache, four of our methods and six presses at two ratios, fp8, and, with
    `pairs`, the presses run beside their matched method."""
    run = root / "kvpress_compare" / "20260101-000000-aaaaaa"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"experiment": "kvpress_compare", "jobs": 23}))
    rows = [{"method": "full", "metric_model_cache_bytes": 1000.0}]
    for ratio in (0.75, 0.5):
        rows += [{"method": m, "param_budget": 1 - ratio} for m in ("h2o", "snapkv", "streamingllm", "vlcache")]
        rows += [{"method": "kvpress", "param_press": p, "param_compression_ratio": ratio}
                 for p in ("TOVAPress", "KnormPress", "ExpectedAttentionPress", "PyramidKVPress", "SnapKVPress",
                           "StreamingLLMPress")]
    rows += [{"method": "fp8"}]
    for i, row in enumerate(rows):
        row.setdefault("metric_model_cache_bytes", 1000.0 * (1 - row.get("param_compression_ratio", 0.5)))
        row |= {"job_id": f"j{i}", "status": "ok", "metric_token_agreement": 0.5, "metric_kl_mean": 0.01}
        if pairs and row.get("param_press") == "SnapKVPress":
            row |= {"extra_pair_method": "snapkv", "metric_pair_jaccard_mean": 1.0, "metric_pair_jaccard_min": 1.0,
                    "metric_pair_token_agreement": 1.0}
    pd.DataFrame(rows).to_parquet(run / "results.parquet")
    return run


def execute_with_cell(tmp_path, name, code, env):
    """The notebook with one more cell at its end, executed; that cell's printed output."""
    import nbformat

    nb = nbformat.read(notebooks.find(name), as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(code))
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(nb, path)
    out = notebooks.execute(path, env=env)
    return "".join(o.get("text", "") for o in out.cells[-1].get("outputs", []))


def test_kvpress_compare_draws_each_series_apart(tmp_path):
    """11 series (four of our methods, six presses and fp8): no two share a colour and a style, as the 11th
    and the 1st did on matplotlib's 10-colour cycle (in the shipped experiment streamingllm drew as fp8,
    vlcache as h2o)."""
    run = kvpress_run(tmp_path, pairs=True)
    printed = execute_with_cell(tmp_path, "kvpress_compare", (
        "lines = [l for l in axes[0].get_lines() if not l.get_label().startswith('_')]\n"
        "print(len(lines), 'series', len({(str(l.get_color()), l.get_marker(), l.get_linestyle()) for l in lines}), "
        "'styles')"), notebooks.run_env([run]))
    assert printed.strip() == "11 series 11 styles"


def test_kvpress_compare_reads_a_run_without_matched_pairs(tmp_path):
    """A run whose presses have no method matched setting for setting (no SnapKVPress or StreamingLLMPress
    beside snapkv or streamingllm) has no pair columns: the last section says so instead of a KeyError."""
    run = kvpress_run(tmp_path, pairs=False)
    nb = notebooks.execute(notebooks.find("kvpress_compare"), env=notebooks.run_env([run]))
    assert "0 press jobs with a matched method" in outputs(nb)


def accuracy_run(root, shards=1, lacking=None):
    """An accuracy run on one task of two documents a shard: the full cache and fp8, five methods at two budgets
    over the model's cache and an fp8 one, and ZipVL at two taus: 13 series; the job numbered `lacking` without
    its last shard."""
    run = root / "accuracy" / "20260101-000000-aaaaaa"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"experiment": "accuracy", "jobs": 24}))
    jobs = [{"method": "full", "param_kv_dtype": kv} for kv in ("model", "fp8_e4m3")]
    jobs += [{"method": m, "param_budget": b, "param_kv_dtype": kv} for m in ("vlcache", "h2o", "snapkv",
             "streamingllm", "pyramidkv") for b in (0.1, 0.2) for kv in ("model", "fp8_e4m3")]
    jobs += [{"method": "zipvl", "param_tau": tau, "param_kv_dtype": "model"} for tau in (0.9, 0.99)]
    rows = []
    for i, job in enumerate(jobs):
        held = 0.5 * job.get("param_budget", 1.0) * (0.5 if job["param_kv_dtype"] != "model" else 1)
        for shard in range(shards - (i == lacking)):
            rows.append({**job, "job_id": f"j{i}-{shard}", "status": "ok", "workload": "lmms",
                         "workload_tasks": "shapes", "workload_shard": shard, "workload_shards": shards,
                         "extra_metric_names": '["exact_match"]', "extra_aggregation": '{"exact_match": "mean"}',
                         "extra_doc_id": f"[{2 * shard}, {2 * shard + 1}]",
                         "extra_doc_reply": json.dumps(["red", "blue" if i % 2 else "red"]),
                         "extra_doc_target": '["red", "blue"]', "extra_doc_exact_match": f"[1, {i % 2}]",
                         "metric_documents": 2, "metric_exact_match": (1 + i % 2) / 2, "metric_prefill_seconds": 0.1,
                         "metric_decode_seconds": 0.1, "metric_kv_bytes_peak": 1000 * held,
                         "metric_full_kv_bytes_peak": 1000.0, "metric_peak_memory_bytes": 1.0,
                         "metric_decode_peak_memory_bytes": 1.0, "metric_kv_bytes_mean": 1000 * held,
                         "metric_full_kv_bytes_mean": 1000.0, "metric_generated_tokens_mean": 4.0,
                         "metric_prompt_tokens_mean": 70.0, "metric_kv_fraction": held})
    pd.DataFrame(rows).to_parquet(run / "results.parquet")
    return run


def test_accuracy_draws_each_series_apart(tmp_path):
    """The agreement with the full cache draws 12 series (13 with the full cache, against the bytes held): no two
    share a colour and a style, as on matplotlib's 10-colour cycle, where the 11th and 12th took the 1st's and
    2nd's (ZipVL's line was H2O's)."""
    run = accuracy_run(tmp_path)
    printed = execute_with_cell(tmp_path, "accuracy", (
        "lines = [l for l in axes[0][0].get_lines() if not l.get_label().startswith('_')]  # the agreement's\n"
        "print(len(lines), 'series', len({(str(l.get_color()), l.get_marker(), l.get_linestyle()) for l in lines}), "
        "'styles')"), notebooks.run_env([run]))
    assert printed.strip() == "12 series 12 styles"


def test_methods_draws_each_line_apart(tmp_path):
    """Error against the bytes held draws 17 lines of methods beside FP8's black ones: no two share a colour and
    a style, as on matplotlib's 10-colour cycle, where the 11th took the 1st's."""
    rows = methods_rows(finished=True)
    run = table_run(tmp_path, "methods_compare", len(rows), rows)
    printed = execute_with_cell(tmp_path, "methods", (
        "lines = [l for l in ax.get_lines() if not l.get_label().startswith('_') and l.get_color() != 'k']\n"
        "print(len(lines), 'lines', len({(str(l.get_color()), l.get_marker(), l.get_linestyle()) for l in lines}), "
        "'styles')"), notebooks.run_env([run]))
    assert printed.strip() == "17 lines 17 styles"


def test_accuracy_leaves_out_a_job_scored_on_some_of_its_shards(tmp_path):
    """A run stopped midway holds a job with one of its two shards: scored on half the documents, it was drawn
    beside jobs scored on all of them. It is left out, saying so, until its other shard has a row."""
    run = accuracy_run(tmp_path, shards=2, lacking=22)  # zipvl at tau 0.9
    printed = execute_with_cell(tmp_path, "accuracy", "print(sorted(scores.label), scores.metric_documents.min())",
                                notebooks.run_env([run]))
    assert "'zipvl tau=0.9'" not in printed and "'zipvl tau=0.99'" in printed and printed.strip().endswith(" 4.0")
    nb = notebooks.execute(notebooks.find("accuracy"), env=notebooks.run_env([run]))
    assert "left out, scored on some of their shards only" in outputs(nb)
    assert "shapes zipvl tau=0.9 (1 of 2 shards)" in outputs(nb)
