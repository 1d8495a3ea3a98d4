"""A benchmark as a workload: lmms-eval's tasks (DocVQA, ChartQA, TextVQA,
MMMU, ...; video tasks such as Video-MME, each video sampled to `frames`
frames, or one every 1/`fps` seconds up to `frames`) scored with their own
metrics on a local VLM whose KV cache a method holds
(kernels_py.models.lmms).

A job is one method with its knobs on one task, over the first `limit`
documents or one shard of them: the plan spreads workload("lmms",
tasks="docvqa_val,chartqa", shards=2) over a job per task and shard, and
`task_scores` (used by the notebook) merges a task's shards back into one
score. Everything is offline: datasets come from `data` (a directory holding
each hub dataset at DATA/<hub id>, where `hf download ... --local-dir`
puts it) or from the local Hugging Face cache. lmms-eval comes from the lock's
`lmms` group, which the workbench installs on the first run that uses this
workload.
"""

import functools
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kernels_py.params import Rule, closest, knob
from kernels_py.workloads.base import Workload, WorkloadConfig, loaded_model

# Metrics that write a file for a test server instead of scoring (TextVQA's, OK-VQA's): not aggregated.
SUBMISSIONS = frozenset({"submission"})
BOOTSTRAP_ITERS = 100000  # lmms-eval's default, for the aggregations it bootstraps (mean has a closed form)


class TaskError(ValueError):
    """A task, dataset or input the lmms workload cannot run; the message says what to do."""


@dataclass(frozen=True)
class LmmsConfig(WorkloadConfig):
    """lmms-eval tasks scored on a local VLM (any family of README "Use your own model"), the method holding its KV
    cache."""

    name = "lmms"
    runs_model = True
    # One job per task of `tasks` and per shard of `shards` (the plan spreads them; `shard` is set there).
    expand: ClassVar[dict[str, str]] = {"tasks": "each", "shards": "index:shard"}
    RULES = (Rule("shard < shards", "shard {shard} is not below shards {shards}: the plan numbers the shards "
                  "0..shards-1 itself, leave shard out"),
             Rule("shards <= limit", "shards {shards} is more than limit {limit}: document i of the first {limit} "
                  "goes to shard i mod shards, so the shards from {limit} on would hold none; use at most {limit} "
                  "shards"),)

    model: str = knob("str", "", "local model directory (config.json, weights, processor files; nothing is "
                      "downloaded)", paths=True, required=True)
    tasks: str = knob("str", "", "lmms-eval task names, comma-separated (one job per task), e.g. "
                      "\"docvqa_val,chartqa\"; tasks scored by log-likelihood are refused", required=True)
    limit: int = knob("int", 200, "score the first `limit` documents of each task's evaluation split", min=1,
                      max=10_000_000)
    shards: int = knob("int", 1, "split each task's documents over this many jobs (document i goes to shard "
                       "i mod shards, as lmms-eval splits ranks); task_scores merges them into one score", min=1,
                       max=4096)
    shard: int = knob("int", 0, "this job's shard, 0..shards-1: set by the plan from shards", min=0, max=4095)
    batch: int = knob("int", 1, "documents generated together (each keeps its own method caches; the batch "
                      "decodes until its longest answer ends); kvpress presses run one at a time", min=1, max=256)
    include_path: str = knob("str", "", "a directory of extra task YAML files (lmms-eval's --include_path)",
                             paths=True)
    data: str = knob("str", "", "directory of downloaded datasets, each at DATA/<hub id> (e.g. "
                     "DATA/lmms-lab-encoder/DocVQA); empty: the local Hugging Face cache", paths=True)
    frames: int = knob("int", 8, "frames sampled from each video of a video task (at most, with fps): spread "
                       "uniformly over the whole video, first and last included", min=1, max=4096,
                       id_omits_default=True)
    fps: float = knob("float", 0.0, "video frames sampled per second (one every 1/fps seconds, `frames` of them "
                      "spread uniformly where there are more; a frame directory is read as fps frames a second); 0: "
                      "`frames` frames over the whole video", min=0.0,
                      max=1000.0, id_omits_default=True)

    def build(self) -> Workload:
        raise TaskError("workload 'lmms' scores a task inside the model: it has no attention trace to replay")

    def evaluate(self, method) -> dict:
        """Score `method` on this job's task and shard: the ablation's report."""
        return evaluate(self, method)


def _offline() -> None:
    """No network: datasets and models come from local files only."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets.config
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True


@functools.lru_cache(maxsize=1)
def _lmms_eval():
    """Import lmms-eval quietly (its logger talks at DEBUG by default)."""
    _offline()
    try:
        from loguru import logger

        import lmms_eval  # noqa: F401
    except ImportError as err:
        raise TaskError(f"lmms-eval is not installed in this Python ({err}): the workbench installs the lock's "
                        f"lmms group into its managed runtime on the first lmms run; with --python, install the "
                        f"lmms-eval version uv.lock pins there") from None
    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    from lmms_eval.tasks import TaskManager

    return TaskManager


@functools.lru_cache(maxsize=4)
def _task_manager(include_path: str):
    if include_path and not Path(include_path).is_dir():
        raise TaskError(f"include_path {include_path} is not a directory: give the directory of your task YAML files")
    return _lmms_eval()("WARNING", include_path=include_path or None)


@functools.lru_cache(maxsize=8)
def load_task(name: str, include_path: str = "", data: str = ""):
    """lmms-eval's task object with its dataset loaded from local files."""
    try:
        return _load_task(name, include_path, data)
    except ModuleNotFoundError as err:  # a task's own code may import what lmms-eval does not require
        raise TaskError(f"task {name}: its lmms-eval code imports the module {err.name!r}, which this Python lacks "
                        f"(lmms-eval's requirements leave it out): add its package to the lmms group of "
                        f"pyproject.toml and run `uv lock`, or give --python an environment that has it") from None
    except Exception as err:
        if not type(err).__module__.startswith("openai"):
            raise
        # MathVista's code, say, sets up lmms-eval's LLM judge (an OpenAI client) as it loads.
        raise TaskError(f"task {name} is scored by an LLM judge: its lmms-eval code sets up an OpenAI client as it "
                        f"loads ({_first_line(err)}); set OPENAI_API_KEY, and give the workers the network, to "
                        f"score it") from None


def _load_task(name: str, include_path: str, data: str):
    manager = _task_manager(include_path)
    if not name:
        raise TaskError("workload 'lmms' needs tasks=: lmms-eval task names, e.g. tasks=\"docvqa_val\"")
    if name not in manager.all_tasks:
        raise TaskError(f"unknown lmms-eval task {name!r}{closest(name, manager.all_tasks)}; "
                        f"`python -m lmms_eval --tasks list` lists them")
    config = dict(manager._get_config(name))
    if "include" in config:  # a task built on a template YAML (docvqa_val on _default_template_docvqa_yaml)
        from lmms_eval import utils

        template = utils.load_yaml_config(yaml_path=None, yaml_config={"include": config.pop("include")}, mode="full")
        config = {**template, **config}
    if manager._name_is_group(name) or "dataset_path" not in config:
        members = config.get("task") if isinstance(config.get("task"), list) else []
        listed = ", ".join(m if isinstance(m, str) else str(m.get("task", m)) for m in members[:8])
        raise TaskError(f"{name!r} is a group of lmms-eval tasks: name its tasks in tasks= (one job each)"
                        + (f", e.g. {listed}" if listed else ""))
    hub_id = config["dataset_path"]
    update = {"task": name}
    if data:
        local = Path(data) / hub_id
        if not local.is_dir():
            raise TaskError(f"task {name}: its dataset {hub_id} is not under {data} (want {local}); on a connected "
                            f"machine: {fetch_command(hub_id, local)}")
        update["dataset_path"] = str(local)
    else:
        _check_cached(name, hub_id, config.get("dataset_name"))
    from lmms_eval.tasks import get_task_dict

    try:
        task = get_task_dict([update], manager)[name]
    except ModuleNotFoundError:
        raise
    except Exception as err:  # noqa: BLE001 - datasets raises many types for files it cannot read
        raise TaskError(f"task {name}: dataset {hub_id} cannot be read {'under ' + data if data else 'offline'} "
                        f"({_first_line(err)}); on a connected machine: "
                        f"{fetch_command(hub_id, Path(data or 'DATA') / hub_id)}, then give data=DIR") from None
    if task.OUTPUT_TYPE != "generate_until":
        raise TaskError(f"task {name} is scored by {task.OUTPUT_TYPE} (one forward pass over prompt and answer, "
                        f"in which no compressed cache is read): the lmms workload runs generate_until tasks")
    return task


def _check_cached(name: str, hub_id: str, config_name) -> None:
    """Fail at once when the local Hugging Face cache lacks the dataset
    (lmms-eval retries a failed load for up to a minute)."""
    import datasets

    try:
        datasets.load_dataset_builder(hub_id, config_name)
    except Exception as err:  # noqa: BLE001 - offline, a missing dataset raises ConnectionError, FileNotFoundError, ...
        raise TaskError(f"task {name}: dataset {hub_id} is not in the local Hugging Face cache and runs are offline "
                        f"({_first_line(err)}); on a connected machine: {fetch_command(hub_id, Path('DATA') / hub_id)}, "
                        f"then give data=DATA (or copy the machine's Hugging Face cache here)") from None


def _first_line(err: Exception) -> str:
    # lmms-eval retries a dataset's load: the retries' RetryError names only the last attempt's exception type.
    last = getattr(err, "last_attempt", None)
    if last is not None and last.failed and last.exception() is not None:
        err = last.exception()
    return f"{type(err).__name__}: " + (str(err).strip().splitlines() or [""])[0][:160]


def fetch_command(hub_id: str, local: Path) -> str:
    return f"hf download {hub_id} --repo-type dataset --local-dir {local}"


def evaluate(config: LmmsConfig, method) -> dict:
    """Run the task's documents of this shard through the model with
    `method`, then score them as lmms-eval does (its filters,
    process_results, aggregation and stderr)."""
    if not config.model:
        raise TaskError("workload 'lmms' needs model=: a local model directory")
    from kernels_py.models.adapter import ModelError, model_dir

    try:
        model_dir(config.model)  # before the task's dataset loads
    except ModelError as err:
        raise TaskError(str(err)) from None
    task = load_task(config.tasks, config.include_path, config.data)
    if config.shard >= config.shards:
        raise TaskError(f"shard {config.shard} is not below shards {config.shards}")
    from kernels_py.models.lmms import VLKV

    vlm = loaded_model(config.model)  # the vlm workload's too: one copy a worker
    model = VLKV(vlm=vlm, method=method, batch=config.batch, frames=config.frames, fps=config.fps or None)
    model.task_dict = {config.tasks: task.dataset}
    task.build_all_requests(limit=config.limit, rank=config.shard, world_size=config.shards)
    # lmms-eval pads a rank without documents with document 0 again (for its distributed gather), which a
    # shard here must not score twice.
    requests = [r for r in task.instances if not r.metadata.get("__padding_only__")]
    if not requests:
        raise TaskError(f"task {config.tasks}: shard {config.shard} of {config.shards} holds none of the first "
                        f"{config.limit} documents: use fewer shards")
    for request, reply in zip(requests, model.generate_until(requests)):
        request.resps.append(reply)
    task.apply_filters()
    return _score(task, config, requests, model.answers)


def _score(task, config: LmmsConfig, requests, answers) -> dict:
    docs = task.test_docs() if task.has_test_docs() else task.validation_docs()
    by_doc: dict[int, list] = {}
    for r in requests:
        by_doc.setdefault(r.doc_id, []).append(r)
    key = next(iter(requests[0].filtered_resps))  # the first filter: "none" unless the task sets its own
    per_doc: dict[str, list] = {}
    samples: dict[str, list] = {}
    for doc_id in sorted(by_doc):
        doc = docs[doc_id]
        reqs = sorted(by_doc[doc_id], key=lambda r: r.idx)
        try:
            scores = task.process_results(doc, [r.filtered_resps[key] for r in reqs])
        except Exception as err:
            if getattr(err, "last_attempt", None) is None:  # not lmms-eval's retries giving up
                raise
            raise TaskError(f"task {config.tasks}: its process_results failed on document {doc_id} after "
                            f"lmms-eval's retries ({_first_line(err)}); a missing key is a field the documents of "
                            f"the dataset{' under ' + config.data if config.data else ''} lack") from None
        for metric, value in scores.items():
            samples.setdefault(metric, []).append(value)
            per_doc.setdefault(f"doc_{metric}", []).append(value if isinstance(value, (int, float)) else
                                                           json.dumps(value, default=str))
        per_doc.setdefault("doc_id", []).append(doc_id)
        per_doc.setdefault("doc_reply", []).append(reqs[0].resps[0])
        per_doc.setdefault("doc_filtered", []).append(str(reqs[0].filtered_resps[key]))
        per_doc.setdefault("doc_target", []).append(json.dumps(task.doc_to_target(doc), default=str))
    from lmms_eval.api.metrics import stderr_for_metric

    metrics: dict[str, float] = {}
    aggregations = task.aggregation()
    for metric, items in samples.items():
        if metric not in aggregations or metric in SUBMISSIONS:
            continue
        value = _aggregate(task, metric, items)
        if isinstance(value, (int, float)):
            metrics[metric] = float(value)
            stderr = stderr_for_metric(aggregations[metric], BOOTSTRAP_ITERS)
            metrics[f"{metric}_stderr"] = float(stderr(items)) if stderr and len(items) > 1 else math.nan
    held = [a.cache_bytes for a in answers]
    full = [a.full_cache_bytes for a in answers]
    ours = {
        "documents": float(len(by_doc)),
        "kv_bytes_mean": sum(held) / len(held), "kv_bytes_peak": float(max(held)),
        "full_kv_bytes_mean": sum(full) / len(full), "full_kv_bytes_peak": float(max(full)),
        "kv_fraction": sum(held) / sum(full),
        "prefill_seconds": sum(a.prefill_seconds for a in answers),
        "decode_seconds": sum(a.decode_seconds for a in answers),
        "generated_tokens_mean": sum(len(a.tokens) for a in answers) / len(answers),
        "prompt_tokens_mean": sum(a.prompt_tokens for a in answers) / len(answers),
        # the batch's memory, above the weights, on the model's device (nan where not measurable)
        "peak_memory_bytes": max(a.peak_bytes for a in answers),
        "decode_peak_memory_bytes": max(a.decode_peak_bytes for a in answers),
    }
    clash = sorted(set(ours) & set(metrics))
    if clash:
        raise TaskError(f"task {config.tasks} reports metrics named like the workload's own ({clash})")
    per_doc |= {"doc_cache_bytes": held, "doc_full_cache_bytes": full,
                "doc_prefill_seconds": [a.prefill_seconds for a in answers],
                "doc_decode_seconds": [a.decode_seconds for a in answers]}
    if any(a.videos for a in answers):  # each document's videos: source and sampling (Video.sampling)
        per_doc["doc_videos"] = [json.dumps(a.videos) for a in answers]
    how = {m: getattr(aggregations[m], "__name__", "?") for m in samples if m in aggregations and m not in SUBMISSIONS}
    # metric_names keeps the task's order (the first is its headline metric); the dict's keys come back sorted.
    return {"metrics": metrics | ours, "extra": per_doc | {"task": config.tasks, "filter": key, "aggregation": how,
                                                          "metric_names": list(how),
                                                          "higher_is_better": task.higher_is_better()}}


def _aggregate(task, metric: str, items: list):
    """The task's aggregation of a metric, as lmms-eval calls it; one that
    takes lmms-eval's command-line args gets an output_path in a temporary
    directory (never the kernels root, the workers' working directory)."""
    import argparse
    import inspect
    import tempfile

    aggregate = task.aggregation()[metric]
    if "args" in inspect.signature(aggregate).parameters:
        with tempfile.TemporaryDirectory(prefix="vlkv-lmms-") as out:
            return aggregate(items, args=argparse.Namespace(output_path=out))
    return aggregate(items)


def merge_shards(rows, task=None) -> dict[str, float]:
    """One score from a task's shards (the result rows, as dicts, of one
    method, knobs and task with shard 0..shards-1): each task metric
    aggregated over the documents of all shards from their per-document
    scores, as lmms-eval would over one shard holding them all; the cost
    columns summed (seconds), maxed (peaks) or document-weighted (means).
    Metrics the task aggregates other than by a mean are re-aggregated by
    the task itself: `task`, else load_task of the rows' task (which needs
    lmms-eval and the dataset the run read); where neither can be had they
    are left out. One shard is its own score."""
    rows = sorted(rows, key=lambda r: r.get("workload_shard", 0))
    counts = [float(r["metric_documents"]) for r in rows]
    out: dict[str, float] = {"documents": sum(counts)}
    aggregations = _list_or_dict(rows[0].get("extra_aggregation"))
    for metric, how in aggregations.items():
        values = [v for r in rows for v in _list_or_dict(r.get(f"extra_doc_{metric}"))]
        if how == "mean" and all(isinstance(v, (int, float)) for v in values):
            n = len(values)
            mean = sum(values) / n
            out[metric] = mean
            # lmms-eval's mean_stderr: the sample standard deviation over sqrt(n)
            out[f"{metric}_stderr"] = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 \
                else math.nan
        elif len(rows) == 1 and f"metric_{metric}" in rows[0]:
            out[metric] = float(rows[0][f"metric_{metric}"])
            out[f"{metric}_stderr"] = _float(rows[0].get(f"metric_{metric}_stderr"))
        else:
            task = task if task is not None else _task_of(rows[0])
            if task is not None:
                decoded = [json.loads(v) if isinstance(v, str) else v for v in values]
                out[metric] = float(_aggregate(task, metric, decoded))
    for name in ("prefill_seconds", "decode_seconds"):
        out[name] = sum(float(r[f"metric_{name}"]) for r in rows)
    for name in ("kv_bytes_peak", "full_kv_bytes_peak", "peak_memory_bytes", "decode_peak_memory_bytes"):
        out[name] = max(float(r[f"metric_{name}"]) for r in rows)
    for name in ("kv_bytes_mean", "full_kv_bytes_mean", "generated_tokens_mean", "prompt_tokens_mean"):
        out[name] = sum(c * float(r[f"metric_{name}"]) for c, r in zip(counts, rows)) / out["documents"]
    out["kv_fraction"] = out["kv_bytes_mean"] / out["full_kv_bytes_mean"]
    return out


def _float(value) -> float:
    """A metric as a float: a table reads a NaN metric (a custom
    aggregation's stderr, say) back as None."""
    return math.nan if value is None else float(value)


def _task_of(row):
    """The task a result row scored, loaded again (None where it cannot be)."""
    try:
        return load_task(row["workload_tasks"], row.get("workload_include_path") or "", row.get("workload_data") or "")
    except (TaskError, ImportError, KeyError):
        return None


def _list_or_dict(value):
    if value is None:
        return []
    return json.loads(value) if isinstance(value, str) else value


def task_scores(frame):
    """A run's results (pandas, one row per job) with each task's shards
    merged (merge_shards): one row per method, knobs and task, its
    metric_* columns over all the task's documents scored, and
    extra_doc_id / extra_doc_reply / extra_doc_<metric> holding every
    document in order. Rows of other workloads and failed rows are left out."""
    import pandas as pd

    rows = frame[(frame.get("workload") == "lmms") & (frame.status == "ok")] if "workload" in frame else frame
    keys = [c for c in rows.columns if c == "method" or c.startswith("param_") or
            (c.startswith("workload_") and c != "workload_shard")]
    merged = []
    for _, group in rows.groupby(keys, dropna=False, sort=False):
        records = group.to_dict("records")
        first = {k: v for k, v in records[0].items() if k in keys}
        docs = {}
        for r in records:
            columns = [c for c in r if c.startswith("extra_doc_")]
            lists = {c: _list_or_dict(r[c]) for c in columns}
            for i, doc_id in enumerate(lists["extra_doc_id"]):
                docs[doc_id] = {c: values[i] for c, values in lists.items()}
        order = sorted(docs)
        by_doc = {c: [docs[d][c] for d in order] for c in docs[order[0]]} if order else {}
        scores = {f"metric_{k}": v for k, v in merge_shards(records).items()}
        merged.append({**first, "shards_merged": len(records), **scores, **by_doc})
    return pd.DataFrame(merged)
