"""An lmms-eval model backed by the model adapter: a local VLM whose KV cache
is held by a compression method of the registry (or a kvpress press), so
lmms-eval's tasks score the method with their own metrics.

Importing this module registers it in lmms-eval's model registry as "vlkv"
(VLKV(pretrained=DIR, method="h2o", params={"budget": 0.1})); the lmms
workload (kernels_py.workloads.lmms) drives it for each job. It answers `generate_until`, `batch` documents at a time: greedy, for the
task's max_new_tokens, ending at the end-of-sequence token or the first of
the task's stop strings. Tasks scored by log-likelihood (multiple choice by
option probability) are refused: the methods compress the cache a generation
reads, and a log-likelihood pass reads no cache. Importing this module needs
lmms-eval (the lock's `lmms` group).
"""

import json
from dataclasses import dataclass

from lmms_eval.api.model import lmms
from lmms_eval.api.registry import register_model

from kernels_py import models
from kernels_py.methods import make_method

DEFAULT_MAX_NEW_TOKENS = 128  # lmms-eval's own default for tasks that set none is larger; ours is stated


class LmmsError(ValueError):
    """A request the lmms-eval model cannot answer; the message says why."""


@dataclass
class Answer:
    """One document's generation: what the task scores and what it cost."""

    doc_id: int
    text: str  # the reply, cut at the first stop string
    tokens: list[int]
    prompt_tokens: int
    cache_bytes: int  # the method's caches after the last step, all layers
    full_cache_bytes: int  # what the full cache holds for the same tokens
    prefill_seconds: float
    decode_seconds: float
    # Memory above the weights on the model's device (the CUDA allocator's peak, or the resident set's on a CPU):
    # over the generation, and over its decode steps alone (the caches and one step's work).
    peak_bytes: float = float("nan")
    decode_peak_bytes: float = float("nan")


@register_model("vlkv")
class VLKV(lmms):
    """A local VLM (LLaVA-1.5, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL) with a method's KV cache."""

    def __init__(self, pretrained: str = "", method: str = "full", params: str | dict = "", vlm=None,
                 device: str = "cpu", batch: int = 1, **unused) -> None:
        super().__init__()
        if unused:
            raise LmmsError(f"model vlkv takes pretrained=, method=, params= (JSON), device= and batch=, not "
                            f"{sorted(unused)}")
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
            answers = self._answer_batch(chunk) if len(chunk) > 1 else [self.answer(*chunk[0])]
            self.answers.extend(answers)
            replies.extend(a.text for a in answers)
        return replies

    def _ask(self, request) -> tuple:
        """(context, images, gen_kwargs, doc_id) of one lmms-eval request."""
        context, gen_kwargs, doc_to_visual, doc_id, task, split = request.args
        visuals = doc_to_visual(self.task_dict[task][split][doc_id])
        images = [v for v in visuals if not isinstance(v, str)]
        if len(images) != len(visuals) or not images:
            raise LmmsError("the lmms workload runs image tasks: this document has "
                            f"{'no image' if not visuals else 'a video or audio input'}")
        return context, images, dict(gen_kwargs), doc_id

    def answer(self, context: str, images: list, gen_kwargs: dict, doc_id: int = 0) -> Answer:
        """Greedy generation for one document's context and images."""
        until, max_new = _settings(gen_kwargs)
        inputs = models.prompt_inputs(self.vlm, images, prompt_for(self.vlm, context, len(images)))
        stop = stop_tokens(self.vlm)
        if getattr(self.method, "in_model_only", False):  # a kvpress press: transformers' cache, pressed
            from kernels_py.models import presses

            got = presses.generate(self.vlm, self.method.make_press(), inputs, max_new, stop_tokens=stop)
        else:
            got = models.generate(self.vlm, self.method, inputs, max_new, stop_tokens=stop)
        prompt = int(inputs["input_ids"].shape[1])
        return Answer(doc_id, self._text(got.tokens, until), got.tokens, prompt, got.cache_bytes,
                      full_cache_bytes(self.vlm, prompt + len(got.tokens) - 1), got.prefill_seconds,
                      got.decode_seconds, got.peak_bytes, got.decode_peak_bytes)

    def _answer_batch(self, chunk: list[tuple]) -> list[Answer]:
        """Several documents generated together (models.generate_batch): each
        keeps its own method caches; the batch decodes until every document
        has stopped, so one that stopped early holds the tokens of the
        longest (its full-cache bytes count the same tokens). Times are the
        batch's, split evenly."""
        until, max_new = _settings(chunk[0][2])
        prompts = [(images, prompt_for(self.vlm, context, len(images))) for context, images, _, _ in chunk]
        inputs = models.batch_inputs(self.vlm, prompts)
        gens = models.generate_batch(self.vlm, self.method, inputs, max_new, stop_tokens=stop_tokens(self.vlm))
        steps = max(len(g.tokens) for g in gens)
        answers = []
        for (_, _, _, doc_id), got, mask in zip(chunk, gens, inputs["attention_mask"]):
            prompt = int(mask.sum())
            answers.append(Answer(doc_id, self._text(got.tokens, until), got.tokens, prompt, got.cache_bytes,
                                  full_cache_bytes(self.vlm, prompt + steps - 1), got.prefill_seconds / len(chunk),
                                  got.decode_seconds / len(chunk), got.peak_bytes, got.decode_peak_bytes))
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


def _chunks(asks: list[tuple], size: int):
    """Consecutive requests with the same generation settings, `size` at a time."""
    chunk = []
    for ask in asks:
        if chunk and (len(chunk) == size or _settings(ask[2]) != _settings(chunk[0][2])):
            yield chunk
            chunk = []
        chunk.append(ask)
    if chunk:
        yield chunk


def prompt_for(vlm, context: str, images: int) -> str:
    """The model's prompt for a task's context: its chat template when the
    processor has one (the real checkpoints do), else the family's plain
    USER / ASSISTANT form; one image placeholder per image, before the text,
    unless the context places them itself."""
    placed = vlm.image_token in context
    if getattr(vlm.processor, "chat_template", None):
        content = ([] if placed else [{"type": "image"}] * images) + [{"type": "text", "text": context}]
        return vlm.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    placeholder = ("<|vision_start|>" + vlm.image_token + "<|vision_end|>") if vlm.mrope else vlm.image_token
    body = context if placed else " ".join([placeholder] * images) + " " + context
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
    and kv head, in the model's dtype."""
    text = vlm.model.config.text_config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    element = vlm.model.dtype.itemsize
    return 2 * vlm.layers * heads * head_dim * element * tokens
