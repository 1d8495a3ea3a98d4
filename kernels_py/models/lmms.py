"""An lmms-eval model backed by the model adapter: a local VLM whose KV cache
is held by a compression method of the registry (or a kvpress press), so
lmms-eval's tasks score the method with their own metrics.

Importing this module registers it in lmms-eval's model registry as "vlkv"
(VLKV(pretrained=DIR, method="h2o", params={"budget": 0.1})); the lmms
workload (kernels_py.workloads.lmms) drives it for each job. It answers `generate_until`, `batch` documents at a time: greedy, for the
task's max_new_tokens, ending at the end-of-sequence token or once the reply
holds one of the task's stop strings (checked each step on the decoded tail,
so the tokens, times and bytes of an answer stop there too). Tasks scored by
log-likelihood (multiple choice by option probability) are refused: the methods compress the cache a generation
reads, and a log-likelihood pass reads no cache. A document's visuals are
images (PIL, as image tasks give them) or videos (paths to a video file or a
frame directory, as video tasks such as Video-MME give them), sampled by
models.video.load_video to `frames` frames, or one every 1/`fps` seconds up
to `frames`. Importing this module needs lmms-eval (the lock's `lmms` group).
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from lmms_eval.api.model import lmms
from lmms_eval.api.registry import register_model

from kernels_py import models
from kernels_py.methods import make_method
from kernels_py.models.video import Video, load_video

DEFAULT_MAX_NEW_TOKENS = 128  # lmms-eval's own default for tasks that set none is larger; ours is stated


class LmmsError(ValueError):
    """A request the lmms-eval model cannot answer; the message says why."""


@dataclass
class Answer:
    """One document's generation: what the task scores and what it cost."""

    doc_id: int
    text: str  # the reply, cut at the first stop string
    tokens: list[int]  # up to and with the end-of-sequence token, or the token that completed a stop string
    prompt_tokens: int
    cache_bytes: int  # the method's caches after the last step, all layers
    full_cache_bytes: int  # what the full cache holds for the same tokens
    prefill_seconds: float
    decode_seconds: float
    # Memory above the weights on the model's device (the CUDA allocator's peak, or the resident set's on a CPU):
    # over the generation, and over its decode steps alone (the caches and one step's work).
    peak_bytes: float = float("nan")
    decode_peak_bytes: float = float("nan")
    videos: list[dict] = field(default_factory=list)  # each video's source and sampling (Video.sampling)


@dataclass
class _Ask:
    """One lmms-eval request: its videos stay paths until it is answered (a
    task's worth of sampled frames would not fit in memory)."""

    context: str
    images: list
    videos: list
    gen_kwargs: dict
    doc_id: int


@register_model("vlkv")
class VLKV(lmms):
    """A local VLM (any family of kernels_py.models.families) with a method's KV cache."""

    def __init__(self, pretrained: str = "", method: str = "full", params: str | dict = "", vlm=None,
                 device: str = "cpu", batch: int = 1, frames: int = 8, fps: float | None = None,
                 **unused) -> None:
        super().__init__()
        if unused:
            raise LmmsError(f"model vlkv takes pretrained=, method=, params= (JSON), device=, batch=, frames= and "
                            f"fps=, not {sorted(unused)}")
        self.frames = int(frames)  # lmms-eval's model_args arrive as strings
        self.fps = float(fps) if fps not in (None, "") else None
        self.vlm = vlm if vlm is not None else models.load(pretrained, device=device)
        if isinstance(params, str):
            params = json.loads(params) if params else {}
        self.method = method if not isinstance(method, str) else make_method(method, params)
        # A kvpress press compresses transformers' own cache one prompt at a time.
        self.batch = 1 if getattr(self.method, "in_model_only", False) else max(1, int(batch))
        self.answers: list[Answer] = []

    def loglikelihood(self, requests):
        raise LmmsError("this task scores answers by log-likelihood, one forward pass over prompt and answer in "
                        "which no compressed cache is read: the lmms workload runs generate_until tasks")

    def generate_until_multi_round(self, requests):
        raise LmmsError("multi-round generation is not supported: the lmms workload runs single-turn "
                        "generate_until tasks")

    def generate_until(self, requests) -> list[str]:
        asks = [self._ask(request) for request in requests]
        replies = []
        for chunk in _chunks(asks, self.batch):
            if len(chunk) > 1:
                answers = self._answer_batch(chunk)
            else:
                ask = chunk[0]
                answers = [self.answer(ask.context, ask.images, ask.gen_kwargs, ask.doc_id, ask.videos)]
            self.answers.extend(answers)
            replies.extend(a.text for a in answers)
        return replies

    def _ask(self, request) -> _Ask:
        """One lmms-eval request: its context, images (PIL), video paths, settings and document."""
        from PIL import Image

        context, gen_kwargs, doc_to_visual, doc_id, task, split = request.args
        try:
            visuals = doc_to_visual(self.task_dict[task][split][doc_id])
        except SystemExit as err:  # lmms-eval's video tasks exit where a video is missing (Video-MME does)
            reason = (str(err.code).strip().splitlines() or [""])[0][:200]
            raise LmmsError(f"task {task}, document {doc_id}: its video is missing ({reason}): put the task's "
                            f"videos where its doc_to_visual looks (Video-MME: $HF_HOME/videomme/data/<videoID>.mp4)"
                            ) from None
        images = [v for v in visuals if isinstance(v, Image.Image)]
        videos = [v for v in visuals if isinstance(v, (str, Path))]
        if len(images) + len(videos) != len(visuals) or not visuals:
            raise LmmsError("the lmms workload runs image and video tasks: this document has "
                            f"{'no image or video' if not visuals else 'an audio or other input'}")
        return _Ask(context, images, videos, dict(gen_kwargs), doc_id)

    def load_videos(self, videos: list) -> list[Video]:
        """Videos given as paths (a video file or a frame directory) sampled
        with this model's frames and fps; Videos as they are."""
        return [v if isinstance(v, Video) else load_video(v, self.frames, self.fps) for v in videos]

    def answer(self, context: str, images: list, gen_kwargs: dict, doc_id: int = 0, videos: list = ()) -> Answer:
        """Greedy generation for one document's context, images and videos
        (paths or Videos)."""
        until, max_new = _settings(gen_kwargs)
        videos = self.load_videos(videos)
        inputs = models.prompt_inputs(self.vlm, images, prompt_for(self.vlm, context, len(images), len(videos)),
                                      videos)
        stop = stop_tokens(self.vlm)
        if getattr(self.method, "in_model_only", False):  # a kvpress press: transformers' cache, pressed
            from kernels_py.models import presses

            got = presses.generate(self.vlm, self.method.make_press(), inputs, max_new, stop_tokens=stop,
                                   stop_strings=tuple(until))
        else:
            got = models.generate(self.vlm, self.method, inputs, max_new, stop_tokens=stop, stop_strings=tuple(until))
        prompt = int(inputs["input_ids"].shape[1])
        return Answer(doc_id, self._text(got.tokens, until), got.tokens, prompt, got.cache_bytes,
                      full_cache_bytes(self.vlm, prompt + len(got.tokens) - 1), got.prefill_seconds,
                      got.decode_seconds, got.peak_bytes, got.decode_peak_bytes, _sampling(videos))

    def _answer_batch(self, chunk: list[_Ask]) -> list[Answer]:
        """Several documents generated together (models.generate_batch): each
        keeps its own method caches; the batch decodes until every document
        has stopped, so one that stopped early holds the tokens of the
        longest (its full-cache bytes count the same tokens). Times are the
        batch's, split evenly."""
        until, max_new = _settings(chunk[0].gen_kwargs)
        videos = [self.load_videos(ask.videos) for ask in chunk]
        prompts = [(ask.images, prompt_for(self.vlm, ask.context, len(ask.images), len(vids)), vids)
                   for ask, vids in zip(chunk, videos)]
        inputs = models.batch_inputs(self.vlm, prompts)
        gens = models.generate_batch(self.vlm, self.method, inputs, max_new, stop_tokens=stop_tokens(self.vlm),
                                     stop_strings=tuple(until))
        steps = max(len(g.tokens) for g in gens)
        answers = []
        for ask, vids, got, mask in zip(chunk, videos, gens, inputs["attention_mask"]):
            prompt = int(mask.sum())
            answers.append(Answer(ask.doc_id, self._text(got.tokens, until), got.tokens, prompt, got.cache_bytes,
                                  full_cache_bytes(self.vlm, prompt + steps - 1), got.prefill_seconds / len(chunk),
                                  got.decode_seconds / len(chunk), got.peak_bytes, got.decode_peak_bytes,
                                  _sampling(vids)))
        return answers

    def _text(self, tokens: list[int], until: list[str]) -> str:
        """The reply: the tokens decoded, cut before the first stop string."""
        text = self.vlm.processor.tokenizer.decode(tokens, skip_special_tokens=True)
        for s in until:
            if s and s in text:
                text = text[:text.index(s)]
        return text


def _settings(gen_kwargs: dict) -> tuple[list[str], int]:
    """The task's stop strings and max_new_tokens (greedy whatever it asks)."""
    until = gen_kwargs.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    return until, int(gen_kwargs.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS)


def _sampling(videos: list[Video]) -> list[dict]:
    return [{"source": v.source, **v.sampling} for v in videos]


def _chunks(asks: list[_Ask], size: int):
    """Consecutive requests with the same generation settings, `size` at a time."""
    chunk = []
    for ask in asks:
        if chunk and (len(chunk) == size or _settings(ask.gen_kwargs) != _settings(chunk[0].gen_kwargs)):
            yield chunk
            chunk = []
        chunk.append(ask)
    if chunk:
        yield chunk


def prompt_for(vlm, context: str, images: int, videos: int = 0) -> str:
    """The model's prompt for a task's context: its chat template when the
    processor has one (the real checkpoints do), else the family's plain
    USER / ASSISTANT form; one placeholder per image, then one per video
    (vlm.video_placeholder, which refuses a family that takes no video),
    before the text, unless the context places them itself."""
    video = vlm.video_placeholder if videos else ""
    image = vlm.image_placeholder if images else ""
    if image and image in context:
        images = 0
    if video and video in context:
        videos = 0
    if getattr(vlm.processor, "chat_template", None):
        content = [{"type": "image"}] * images + [{"type": "video"}] * videos + [{"type": "text", "text": context}]
        return vlm.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    body = " ".join([image] * images + [video] * videos + [context])
    return f"USER : {body} ASSISTANT :"


def stop_tokens(vlm) -> frozenset[int]:
    """The ids that end a generation: the model's end-of-sequence token(s)."""
    ids = set()
    for source in (vlm.model.generation_config, vlm.model.config, vlm.processor.tokenizer):
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return frozenset(int(i) for i in ids)


def full_cache_bytes(vlm, tokens: int) -> int:
    """Bytes the full cache holds for `tokens` tokens: K and V of every layer
    and kv head, in the model's dtype; a sliding-window layer (Gemma 3) holds
    at most its window less one token, as the model keeps it."""
    text = vlm.model.config.text_config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    element = vlm.model.dtype.itemsize
    window = getattr(text, "sliding_window", None) or tokens + 1
    held = len(vlm.method_layers) * tokens + len(vlm.sliding_layers) * min(tokens, window - 1)
    return 2 * heads * head_dim * element * held
