"""The lmms workload: lmms-eval's task machinery scoring methods inside a
tiny random VLM, on the tiny local task of fixtures/lmms_tasks (no hub, no
real weights). Needs lmms-eval (the lock's lmms group):
`workbench python --workload lmms -- -m pytest kernels_py/tests/test_lmms.py`
installs it into the managed runtime first. Without it these tests skip,
unless VLKV_REQUIRE_LMMS=1 (scripts/test sets it) makes that a failure."""

import json
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

try:
    import lmms_eval  # noqa: F401
except ImportError:
    if os.environ.get("VLKV_REQUIRE_LMMS") == "1":
        raise
    pytest.skip("lmms-eval is not installed: run through `workbench python --workload lmms`",
                allow_module_level=True)

from kernels_py import ablation
from kernels_py.models.lmms import VLKV, LmmsError, prompt_for, stop_tokens
from kernels_py.models.video import Video, VideoError
from kernels_py.tests.tiny_task import HUB_ID, TASKS, VIDEO_RATE, save_tiny_shapes, save_tiny_videos
from kernels_py.tests.tiny_vlm import save_tiny_llava, save_tiny_llava_onevision, save_tiny_qwen2_vl
from kernels_py.workloads import make_workload
from kernels_py.workloads.lmms import TaskError, load_task, merge_shards

LIMIT = 8


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("lmms")
    save_tiny_llava(root / "llava")
    save_tiny_shapes(root / "data")
    return root


def knobs(root, **more):
    return {"model": str(root / "llava"), "tasks": "tiny_shapes", "limit": LIMIT, "include_path": str(TASKS),
            "data": str(root / "data"), **more}


def by_hand(replies: list[str], answers: list[str]) -> dict[str, float]:
    """The tiny task's metrics, written out again from its definition."""
    exact = [float(r.strip().lower() == a) for r, a in zip(replies, answers)]
    words = [float(len(r.split())) for r in replies]
    mean = sum(words) / len(words)
    stderr = math.sqrt(sum((w - mean) ** 2 for w in words) / (len(words) - 1) / len(words))
    return {"exact_match": sum(exact) / len(exact), "reply_words": mean, "reply_words_stderr": stderr}


def transformers_replies(path, task, docs) -> list[str]:
    """transformers' own greedy generate on each document's prompt, cut as the task says, on the device the
    workload runs its model on (a tiny random model's near-ties could break differently on another)."""
    from kernels_py import models, runtime

    vlm = models.load(path, device=runtime.device())
    gen = task.config.generation_kwargs
    replies = []
    for doc_id in docs:
        doc = task.test_docs()[doc_id]
        images = task.doc_to_visual(doc)
        inputs = models.prompt_inputs(vlm, images, prompt_for(vlm, task.doc_to_text(doc), len(images)))
        out = vlm.model.generate(**inputs, max_new_tokens=gen["max_new_tokens"], do_sample=False,
                                 eos_token_id=sorted(stop_tokens(vlm)))
        text = vlm.processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        replies.append(text.split(gen["until"][0])[0])
    return replies


@pytest.mark.parametrize("family", ["llava", "llava_next", "qwen2_vl"])
def test_full_cache_answers_as_transformers_generate_and_scores_as_by_hand(root, family):
    path = root / family
    # Seeds whose replies differ between documents (a random tiny model often ends at once).
    if family == "qwen2_vl" and not path.exists():
        save_tiny_qwen2_vl(path, seed=2)
    if family == "llava_next" and not path.exists():
        save_tiny_llava(path, next=True, seed=2)
    report = ablation.run("full", {}, knobs(root, model=str(path)), "lmms")
    extra, metrics = report["extra"], report["metrics"]
    assert extra["doc_id"] == list(range(LIMIT)) and metrics["documents"] == LIMIT
    task = load_task("tiny_shapes", str(TASKS), str(root / "data"))
    assert extra["doc_reply"] == transformers_replies(path, task, extra["doc_id"])
    assert len(set(extra["doc_reply"])) > 1
    answers = [task.test_docs()[i]["answer"] for i in extra["doc_id"]]
    hand = by_hand(extra["doc_reply"], answers)
    for name, value in hand.items():
        assert metrics[name] == pytest.approx(value), name
    assert extra["doc_reply_words"] == [float(len(r.split())) for r in extra["doc_reply"]]
    # An aggregation taking lmms-eval's args gets them; a submission file is not written, nor scored.
    assert metrics["longest_reply"] == max(float(len(r.split())) for r in extra["doc_reply"])
    assert "submission" not in metrics and "submission" not in extra["metric_names"]
    # The full cache holds what it would: every token's K and V.
    assert metrics["kv_fraction"] == 1.0 and metrics["kv_bytes_mean"] == metrics["full_kv_bytes_mean"] > 0
    assert metrics["prefill_seconds"] > 0 and extra["aggregation"]["reply_words"] == "mean"
    assert metrics["peak_memory_bytes"] > 0 and metrics["peak_memory_bytes"] >= metrics["decode_peak_memory_bytes"] >= 0


def test_a_tenth_of_the_cache_changes_answers_and_holds_fewer_bytes(root):
    full = ablation.run("full", {}, knobs(root), "lmms")
    h2o = ablation.run("h2o", {"budget": 0.1}, knobs(root), "lmms")
    assert h2o["extra"]["doc_reply"] != full["extra"]["doc_reply"]
    task = load_task("tiny_shapes", str(TASKS), str(root / "data"))
    answers = [task.test_docs()[i]["answer"] for i in h2o["extra"]["doc_id"]]
    assert h2o["metrics"]["reply_words"] == pytest.approx(by_hand(h2o["extra"]["doc_reply"], answers)["reply_words"])
    assert h2o["metrics"]["kv_bytes_peak"] < 0.2 * h2o["metrics"]["full_kv_bytes_peak"]
    assert h2o["metrics"]["kv_fraction"] < 0.2
    assert all(b < f for b, f in zip(h2o["extra"]["doc_cache_bytes"], h2o["extra"]["doc_full_cache_bytes"]))


@pytest.mark.parametrize("method, params", [("full", {}), ("h2o", {"budget": 0.1})])
def test_a_batch_of_documents_answers_as_one_at_a_time(root, method, params):
    """Documents generated together (left-padded, each with its own method
    caches) give the answers and scores they give alone."""
    alone = ablation.run(method, params, knobs(root), "lmms")
    batched = ablation.run(method, params, knobs(root, batch=3), "lmms")
    assert batched["extra"]["doc_reply"] == alone["extra"]["doc_reply"]
    for name in ("exact_match", "reply_words", "documents"):
        assert batched["metrics"][name] == alone["metrics"][name]
    # A batch decodes until its longest answer ends: a document that stopped earlier holds more tokens.
    assert all(b >= a for b, a in zip(batched["extra"]["doc_full_cache_bytes"], alone["extra"]["doc_full_cache_bytes"]))
    assert batched["metrics"]["kv_fraction"] == pytest.approx(alone["metrics"]["kv_fraction"], rel=0.2)


def test_a_kvpress_press_is_scored_in_the_model(root):
    """A press compresses transformers' own cache inside the same model: scored, and the bytes it left."""
    report = ablation.run("kvpress", {"press": "SnapKVPress", "compression_ratio": 0.5,
                                      "press_args": "window_size=8"}, knobs(root), "lmms")
    metrics = report["metrics"]
    assert metrics["documents"] == LIMIT and "exact_match" in metrics and "reply_words" in metrics
    assert 0.4 < metrics["kv_fraction"] < 0.7 and metrics["kv_bytes_peak"] < metrics["full_kv_bytes_peak"]


def test_two_shards_score_as_one(root):
    one = ablation.run("h2o", {"budget": 0.1}, knobs(root), "lmms")
    rows = []
    for shard in range(2):
        part = ablation.run("h2o", {"budget": 0.1}, knobs(root, shards=2, shard=shard), "lmms")
        assert part["metrics"]["documents"] == LIMIT / 2
        rows.append({"workload_shard": shard, **{f"metric_{k}": v for k, v in part["metrics"].items()},
                     **{f"extra_{k}": v for k, v in part["extra"].items()}})
    docs = sorted(d for r in rows for d in r["extra_doc_id"])
    assert docs == one["extra"]["doc_id"]
    replies = dict(zip(one["extra"]["doc_id"], one["extra"]["doc_reply"]))
    assert all(replies[d] == r for row in rows for d, r in zip(row["extra_doc_id"], row["extra_doc_reply"]))
    merged = merge_shards(rows)
    for name in ("exact_match", "answer_mentioned", "reply_words", "reply_words_stderr", "documents",
                 "kv_bytes_mean", "kv_bytes_peak", "full_kv_bytes_mean", "kv_fraction"):
        assert merged[name] == pytest.approx(one["metrics"][name]), name


def test_bad_input_is_one_line_error(root, tmp_path, monkeypatch):
    for key in ("OPENAI_API_KEY", "OPENAI_ADMIN_KEY"):  # the LLM judge's task must find no credentials
        monkeypatch.delenv(key, raising=False)
    cases = [
        (knobs(root, tasks="tiny_shape"), "unknown lmms-eval task 'tiny_shape' (did you mean 'tiny_shapes'?)"),
        # Offline, with no local copy: the task, its hub id and how to fetch it.
        (knobs(root, data=""), f"task tiny_shapes: dataset {HUB_ID} is not in the local Hugging Face cache"),
        (knobs(root, data=str(tmp_path)), f"hf download {HUB_ID} --repo-type dataset --local-dir "
                                          f"{tmp_path / HUB_ID}"),
        (knobs(root, tasks="tiny_shapes_choice"), "scored by multiple_choice (one forward pass"),
        (knobs(root, tasks="tiny_group"), "is a group of lmms-eval tasks: name its tasks in tasks= (one job each), "
                                          "e.g. tiny_shapes"),
        (knobs(root, model=str(tmp_path / "nowhere")), "model directory"),
        (knobs(root, model=str(root / "llava" / "config.json")), "is a file, not a directory"),
        # lmms-eval pads an empty rank with document 0, which must not be scored again (the task has fewer
        # documents than limit, which the plan cannot know).
        (knobs(root, limit=100, shards=16, shard=13), "shard 13 of 16 holds none of the first 100 documents"),
        (knobs(root, tasks="tiny_shapes_missing_module"), "imports the module 'vlkv_tests_no_such_module', which "
                                                          "this Python lacks"),
        (knobs(root, tasks="tiny_shapes_llm_judge"), "task tiny_shapes_llm_judge is scored by an LLM judge"),
        (knobs(root, include_path=str(tmp_path / "nowhere")), "include_path"),
    ]
    for workload, message in cases:
        with pytest.raises(TaskError) as err:
            ablation.run("full", {}, workload, "lmms")
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(ValueError, match="limit"):
        make_workload("lmms", knobs(root, limit=0))
    with pytest.raises(TaskError, match="needs tasks="):
        ablation.run("full", {}, knobs(root, tasks=""), "lmms")
    with pytest.raises(ValueError, match="no compressed cache is read"):
        VLKV(vlm=object()).loglikelihood([])


def test_a_damaged_dataset_fails_naming_the_readers_error(root, tmp_path, monkeypatch):
    """A local dataset whose file cannot be read fails in one line with the reader's own error, not the
    RetryError of lmms-eval's retries around the load, which names no cause."""
    from lmms_eval.api.task import ConfigurableTask
    from tenacity import wait_none

    monkeypatch.setattr(ConfigurableTask.download.retry, "wait", wait_none())  # its retries without their pauses
    files = tmp_path / HUB_ID / "data"
    files.mkdir(parents=True)
    (files / "test-00000-of-00001.parquet").write_bytes(b"not a parquet file")
    with pytest.raises(TaskError) as err:
        ablation.run("full", {}, knobs(root, data=str(tmp_path)), "lmms")
    message = str(err.value)
    assert "(ArrowInvalid: " in message and "RetryError" not in message and "\n" not in message, message


def test_a_document_the_task_cannot_score_names_its_error(root, tmp_path, monkeypatch):
    """A local dataset whose documents lack a field the task's process_results reads fails in one line naming
    the document and the missing field, not the RetryError of lmms-eval's retries around the scoring."""
    from datasets import Dataset, Image
    from lmms_eval.api.task import ConfigurableTask
    from tenacity import wait_none

    from kernels_py.tests.tiny_task import picture

    monkeypatch.setattr(ConfigurableTask.process_results.retry, "wait", wait_none())  # without their pauses
    files = tmp_path / HUB_ID / "data"
    files.mkdir(parents=True)
    rows = {"question_id": [0], "image": [{"bytes": picture("red", 0), "path": None}], "question": ["what ?"],
            "label": ["red"]}  # "answer" renamed
    Dataset.from_dict(rows).cast_column("image", Image()).to_parquet(str(files / "test-00000-of-00001.parquet"))
    with pytest.raises(TaskError) as err:
        ablation.run("full", {}, knobs(root, data=str(tmp_path), limit=1), "lmms")
    message = str(err.value)
    assert "task tiny_shapes: its process_results failed on document 0" in message and "(KeyError: 'answer')" in message, message
    assert "\n" not in message


def test_stop_tokens_end_generation_early(root):
    """An end-of-sequence token ends decoding: the tokens stop at it and a
    stopped generation decodes no further (its cache stops growing)."""
    from kernels_py import models
    from kernels_py.methods import make_method

    vlm = models.load(root / "llava")
    task = load_task("tiny_shapes", str(TASKS), str(root / "data"))
    doc = task.test_docs()[0]
    inputs = models.prompt_inputs(vlm, task.doc_to_visual(doc), prompt_for(vlm, doc["question"], 1))
    free = models.generate(vlm, make_method("full"), inputs, 6)
    stop = frozenset({free.tokens[1]})
    stopped = models.generate(vlm, make_method("full"), inputs, 6, stop_tokens=stop)
    assert stopped.tokens == free.tokens[:free.tokens.index(free.tokens[1]) + 1]
    assert stopped.cache_bytes < free.cache_bytes and torch.equal(stopped.logits, free.logits[:len(stopped.tokens)])


def test_stop_strings_end_generation_where_the_reply_holds_one(root):
    """A task's `until` strings end decoding as an end-of-sequence token
    does: an answer's tokens, and the bytes counted for them, stop at the
    token that completed one, alone and in a batch, and its text is cut."""
    from kernels_py import models
    from kernels_py.models.lmms import _Ask

    vlm = models.load(root / "llava")  # a tokenizer of its own: this one gets words
    tokenizer = vlm.processor.tokenizer
    # The tiny tokenizer has words for a third of the model's ids: a word for each other id, so every token shows.
    tokenizer.add_tokens([f"w{i}" for i in range(len(tokenizer), vlm.model.config.text_config.vocab_size)])
    task = load_task("tiny_shapes", str(TASKS), str(root / "data"))
    docs = [task.test_docs()[i] for i in range(2)]
    model = VLKV(vlm=vlm, batch=2)
    asks = [_Ask(doc["question"], task.doc_to_visual(doc), [], {"max_new_tokens": 8}, i) for i, doc in enumerate(docs)]
    free = model.answer(asks[0].context, asks[0].images, asks[0].gen_kwargs)
    stop = tokenizer.decode(free.tokens[1:2], skip_special_tokens=True)
    end = next(n for n in range(1, 9) if stop in tokenizer.decode(free.tokens[:n], skip_special_tokens=True))
    assert stop and end < len(free.tokens)
    until = {"max_new_tokens": 8, "until": [stop]}
    stopped = model.answer(asks[0].context, asks[0].images, until)
    assert stopped.tokens == free.tokens[:end] and stop not in stopped.text
    assert stopped.full_cache_bytes < free.full_cache_bytes and stopped.cache_bytes < free.cache_bytes
    batch = model._answer_batch([_Ask(a.context, a.images, [], until, a.doc_id) for a in asks])
    assert batch[0].tokens == stopped.tokens and batch[0].text == stopped.text


def test_the_lmms_and_vlm_workloads_share_one_loaded_model(root, monkeypatch):
    """A worker that runs both workloads on one model directory loads it once."""
    from kernels_py import models
    from kernels_py.tests.tiny_vlm import save_image
    from kernels_py.workloads import base

    loads, load = [], models.load
    monkeypatch.setattr(models, "load", lambda path, **kwargs: loads.append(path) or load(path, **kwargs))
    base.loaded_model.cache_clear()
    ablation.run("full", {}, knobs(root, limit=1), "lmms")
    image = save_image(root / "image.png")
    ablation.run("full", {}, {"model": str(root / "llava"), "images": str(image),
                              "prompt": "USER : <image> describe ASSISTANT :", "decode_steps": 1}, "vlm")
    assert loads == [str(root / "llava")]


def test_shards_of_a_metric_not_aggregated_by_a_mean_are_aggregated_by_the_task():
    """A task's own aggregation (here a median over per-document records) runs again over all shards'
    documents; one shard is its own score."""
    class Task:
        @staticmethod
        def aggregation():
            return {"score": lambda items: float(sorted(i["v"] for i in items)[len(items) // 2])}

    def row(shard, values):
        return {"workload_shard": shard, "metric_documents": float(len(values)), "metric_score": -1.0,
                "extra_aggregation": '{"score": "<lambda>"}',
                "extra_doc_score": json.dumps([json.dumps({"v": v}) for v in values]),
                **{f"metric_{k}": 1.0 for k in ("prefill_seconds", "decode_seconds", "kv_bytes_peak",
                                                "full_kv_bytes_peak", "kv_bytes_mean", "full_kv_bytes_mean",
                                                "generated_tokens_mean", "prompt_tokens_mean",
                                                "peak_memory_bytes", "decode_peak_memory_bytes")}}

    merged = merge_shards([row(0, [1, 9, 8]), row(1, [2, 7])], task=Task())
    assert merged["score"] == 7.0 and merged["documents"] == 5
    assert merge_shards([row(0, [1, 9, 8])])["score"] == -1.0  # the job's own value
    # A NaN stderr (a custom aggregation has none) comes back from the table as None.
    assert math.isnan(merge_shards([row(0, [1, 9, 8]) | {"metric_score_stderr": None}])["score_stderr"])


VIDEO = "<video>"


@pytest.fixture
def video_shim(root, monkeypatch):
    """A tiny LLaVA-OneVision (a family that takes videos, "<video>" its
    placeholder) and prompt_inputs / batch_inputs that record (images,
    prompt, videos) as the model gets them."""
    from kernels_py import models

    if not (root / "onevision").exists():
        save_tiny_llava_onevision(root / "onevision")
    seen = []
    real_prompt, real_batch = models.prompt_inputs, models.batch_inputs

    def prompt_inputs(vlm, images, prompt, videos=()):
        seen.append((list(images), prompt, list(videos)))
        return real_prompt(vlm, images, prompt, videos)

    def batch_inputs(vlm, prompts):
        seen.extend((list(p[0]), p[1], list(p[2])) for p in prompts)
        return real_batch(vlm, prompts)

    monkeypatch.setattr(models, "prompt_inputs", prompt_inputs)
    monkeypatch.setattr(models, "batch_inputs", batch_inputs)
    return seen


def test_video_documents_reach_the_model_as_videos_sampled_by_frames_and_fps(root, video_shim):
    """A video task's documents give paths (an MP4, a frame directory): each
    is sampled with the workload's frames and fps, one video placeholder per
    video in the prompt, and the sampling is saved per document."""
    if not (root / "data" / "vlkv-tests" / "tiny-videos").exists():
        save_tiny_videos(root / "data")
    videos = knobs(root, model=str(root / "onevision"), tasks="tiny_videos", limit=4, frames=3, fps=2.0)
    assert make_workload("lmms", videos).frames == 3
    report = ablation.run("full", {}, videos, "lmms")
    task = load_task("tiny_videos", str(TASKS), str(root / "data"))
    docs = [task.test_docs()[i] for i in range(4)]
    assert [v.source for _, _, vids in video_shim for v in vids] == [d["video"] for d in docs]
    for (images, prompt, (got,)), doc in zip(video_shim, docs):
        assert images == [] and prompt.count(VIDEO) == 1 and "<image>" not in prompt
        assert isinstance(got, Video) and got.sampling["frames"] == 3 and got.sampling["fps"] == 2.0
        if doc["video"].endswith(".mp4"):
            # 12 frames at 6 a second: a frame every 0.5 s is frames 0, 3, 6, 9; three of them spread: 0, 3, 9.
            indices, rate = [0, 3, 9], VIDEO_RATE
        else:
            # A frame directory at fps 2 holds 6 s, a frame every 0.5 s is each of its 12; three spread: 0, 5, 11.
            indices, rate = [0, 5, 11], 2.0
            from PIL import Image

            written = [np.asarray(Image.open(f"{doc['video']}/{i:03d}.png").convert("RGB")) for i in indices]
            assert np.array_equal(got.frames, np.stack(written))
        assert got.sampling["indices"] == indices and got.timestamps == pytest.approx([i / rate for i in indices])
        red, blue = got.frames[..., 0].astype(int), got.frames[..., 2].astype(int)
        assert ((red - blue).mean() > 0) == (doc["answer"] == "red")  # the document's own video
    saved = [json.loads(d) for d in report["extra"]["doc_videos"]]
    assert [[v["source"] for v in d] for d in saved] == [[d["video"]] for d in docs]
    assert all(v["sampled"] == 3 and v["frames"] == 3 and v["fps"] == 2.0 for d in saved for v in d)
    assert report["metrics"]["documents"] == 4 and "exact_match" in report["metrics"]

    # Documents batched together take the same videos and give the same answers.
    video_shim.clear()
    batched = ablation.run("full", {}, {**videos, "batch": 2}, "lmms")
    assert batched["extra"]["doc_reply"] == report["extra"]["doc_reply"]
    assert [v.source for _, _, vids in video_shim for v in vids] == [d["video"] for d in docs]
    # Fewer frames, a shorter prompt: the frames reach the model.
    fewer = ablation.run("full", {}, {**videos, "frames": 2}, "lmms")
    assert fewer["metrics"]["prompt_tokens_mean"] < report["metrics"]["prompt_tokens_mean"]


def test_prompt_for_places_images_then_videos():
    class Processor:
        chat_template = "a template"

        @staticmethod
        def apply_chat_template(messages, add_generation_prompt):
            return messages

    vlm = SimpleNamespace(processor=Processor(), image_placeholder="<image>", video_placeholder=VIDEO)
    content = prompt_for(vlm, "which?", 1, 2)[0]["content"]
    assert [c["type"] for c in content] == ["image", "video", "video", "text"] and content[-1]["text"] == "which?"
    vlm.processor = SimpleNamespace()  # no chat template: the plain form
    assert prompt_for(vlm, "which?", 1, 2) == "USER : <image> <video> <video> which? ASSISTANT :"
    assert prompt_for(vlm, "in <video>, which?", 0, 1) == "USER : in <video>, which? ASSISTANT :"  # placed by the task


def test_a_missing_video_is_one_line_error(tmp_path):
    with pytest.raises(VideoError) as err:
        VLKV(vlm=object(), frames=4).load_videos([str(tmp_path / "nowhere.mp4")])
    assert "does not exist" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="fps must be > 0"):
        VLKV(vlm=object(), fps="0").load_videos([str(tmp_path)])
    # A video task's doc_to_visual that exits where its video is missing, as Video-MME's does.
    model = VLKV(vlm=object())
    model.task_dict = {"videos": {"test": [{"videoID": "abc"}]}}

    def exits(doc):
        raise SystemExit(f"video path:/cache/videomme/data/{doc['videoID']}.mp4 does not exist, please check")

    with pytest.raises(LmmsError) as err:
        model._ask(SimpleNamespace(args=("which?", {}, exits, 0, "videos", "test")))
    assert "task videos, document 0: its video is missing (video path:/cache/videomme/data/abc.mp4" in str(err.value)
