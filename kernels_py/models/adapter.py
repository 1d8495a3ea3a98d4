"""A Hugging Face VLM driven by a compression method (see the package doc).

How a method gets into the model: the language model's attention layers
call a registered attention function, "vlkv", instead of SDPA, and the model
is given a `MethodCache` as its past key values. During prefill the function
computes causal attention as usual and keeps each layer's Q/K/V; once the
last layer has run, the method builds every layer's cache from them
(`prefill_all`, so methods that weigh layers against each other work). At
each decode step the function hands the new token's Q/K/V to the method's
`decode`, whose output is the layer's attention output: the method's own
cache is the only one. `MethodCache` stores no key or value; it counts
tokens so the model's positions and masks stay right. The vision tower keeps
its own attention.

Keys reach the methods as the model caches them, after RoPE. The methods
see sequence indices 0..T-1 for the prompt and T + s for step s, which order
tokens as the model does; Qwen2-VL's multimodal RoPE (M-RoPE) rotates by
3-D positions instead, so a method that undoes and redoes RoPE itself
(AttentionPack's rope="before") is refused there.
"""

import contextvars
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels_py.attention import Rope, Spans
from kernels_py.methods.caches import KeptTokens

ATTENTION = "vlkv"
# model_type in config.json -> the family the adapter knows how to drive.
FAMILIES = {
    "llava": "LLaVA-1.5 style (CLIP vision tower, Llama-family language model, <image> placeholder)",
    "llava_next": "LLaVA-NeXT / LLaVA-1.6 (as LLaVA-1.5, with anyres tiling: a base view, the tiles and a newline "
                  "token per row)",
    "qwen2_vl": "Qwen2-VL (its vision tower, GQA language model with M-RoPE, "
                "<|vision_start|><|image_pad|><|vision_end|> placeholder)",
    "qwen2_5_vl": "Qwen2.5-VL (as Qwen2-VL, with a windowed vision tower)",
}
MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
TESTED_TRANSFORMERS = "5.23.0"


class ModelError(ValueError):
    """A model directory, image or prompt the adapter cannot use; the message says what it supports."""


@dataclass
class VLM:
    """A loaded model and its processor."""

    model: torch.nn.Module
    processor: object
    family: str
    path: Path

    @property
    def image_token_id(self) -> int:
        return int(self.model.config.image_token_id)

    @property
    def mrope(self) -> bool:
        return self.family in MROPE_FAMILIES

    @property
    def rope(self) -> Rope:
        """The language model's RoPE, from its config: what a method undoing it must use."""
        return Rope("mrope" if self.mrope else "default", rope_theta(self.model.config.text_config))

    @property
    def image_token(self) -> str:
        return self.processor.image_token

    @property
    def layers(self) -> int:
        return int(self.model.config.text_config.num_hidden_layers)


def load(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> VLM:
    """Load a VLM and its processor from a local directory (nothing is downloaded)."""
    path = Path(path)
    config_file = path / "config.json"
    if not path.is_dir():
        raise ModelError(f"model directory {path} does not exist: give a local directory holding config.json, the "
                         f"weights and the processor files (save_pretrained writes them)")
    if not config_file.is_file():
        raise ModelError(f"{path} has no config.json: it is not a saved transformers model")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type", "?")
    except (ValueError, AttributeError) as err:
        raise ModelError(f"{config_file} is not a JSON object ({err}): save the model again "
                         f"(save_pretrained)") from None
    if model_type not in FAMILIES:
        supported = "; ".join(f"{name}: {what}" for name, what in FAMILIES.items())
        kind = "a text-only model (no vision tower)" if "vision_config" not in config_file.read_text() else \
            "a model type the adapter does not know"
        raise ModelError(f"{path}: model_type {model_type!r} is {kind}; supported: {supported}")
    from transformers import AutoModelForImageTextToText, AutoProcessor

    # transformers and safetensors raise their own types (OSError for a
    # missing file, SafetensorError for a truncated one, ...), with
    # tracebacks dozens of lines deep: the first line of the message is
    # what says which file is at fault.
    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True, dtype=dtype)
    except Exception as err:  # noqa: BLE001 - any failure to read the saved files
        reason = (str(err).strip().splitlines() or [""])[0]
        raise ModelError(f"{path}: the model does not load ({type(err).__name__}: {reason}): are its weights or "
                         f"processor files missing, truncated or garbled? save it again (save_pretrained)") from None
    return VLM(model.to(device).eval(), processor, model_type, path)


def prompt_inputs(vlm: VLM, images: list, prompt: str) -> dict:
    """The processor's tensors for `prompt` with `images` (file paths or PIL
    images), one image placeholder per image in the prompt."""
    from PIL import Image, UnidentifiedImageError

    if not images:
        raise ModelError("give at least one image: the methods compress the KV cache of a vision-language prompt")
    count = prompt.count(vlm.image_token)
    if count != len(images):
        raise ModelError(f"the prompt holds {count} image placeholder(s) {vlm.image_token!r} for {len(images)} "
                         f"image(s): put one {vlm.image_token!r} where each image goes")
    loaded = []
    for image in images:
        if isinstance(image, (str, Path)):
            try:
                with Image.open(image) as im:
                    image = im.convert("RGB")
            except (OSError, UnidentifiedImageError) as err:
                raise ModelError(f"image {image} cannot be decoded ({err}); give a PNG, JPEG or another format "
                                 f"Pillow reads") from None
        loaded.append(image)
    inputs = vlm.processor(images=loaded, text=prompt, return_tensors="pt")
    return {k: v.to(vlm.model.device) for k, v in inputs.items()}


def spans_from_ids(ids: torch.Tensor, image_token_id: int, rope: Rope | None = None) -> Spans:
    """Modality spans of a prompt from its token ids: every run of image
    tokens is an image, what precedes the first is the system prompt, what
    follows the last is the post-vision text; `rope` is the model's
    (VLM.rope; the default RoPE when not given)."""
    positions = (ids == image_token_id).nonzero()[:, 0].tolist()
    if not positions:
        raise ModelError("the prompt's tokens hold no image token: the processor did not expand an image "
                         "placeholder")
    runs, start = [], positions[0]
    for here, after in zip(positions, positions[1:] + [None]):
        if after != here + 1:
            runs.append((start, here + 1))
            start = after
    return Spans(system=(0, runs[0][0]), images=tuple(runs), text=(runs[-1][1], int(ids.shape[0])),
                 rope=rope or Rope())


def rope_theta(text_config) -> float:
    """The RoPE base of a text config (transformers 5.x keeps it in rope_parameters)."""
    params = getattr(text_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(text_config, "rope_theta", 10000.0)))


# --- the method inside the model ----------------------------------------------------------------

def _counting_layer_class():
    from transformers.cache_utils import DynamicLayer

    class CountingLayer(DynamicLayer):
        """Holds no key or value (the method's cache does); counts the tokens
        seen so the model's positions and masks stay right."""

        def lazy_initialization(self, key_states, value_states):
            self.dtype, self.device = key_states.dtype, key_states.device
            self.count = 0
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.count += key_states.shape[-2]
            return key_states, value_states

        def get_seq_length(self):
            return self.count if self.is_initialized else 0

    return CountingLayer


def method_cache():
    """A transformers Cache whose layers count tokens and hold nothing."""
    from transformers.cache_utils import Cache

    return Cache(layer_class_to_replicate=_counting_layer_class())


@dataclass
class _Session:
    """One generation: per sequence of the batch its spans, its left padding
    and (after prefill) its method caches, one per layer."""

    method: object
    spans: list[Spans]
    pads: list[int]
    layers: int
    prompt: dict = field(default_factory=dict)  # layer -> (q, k, v) [B, heads, T, d] until prefill ends
    caches: list[list] | None = None


_ACTIVE: contextvars.ContextVar[_Session] = contextvars.ContextVar("vlkv_session")


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The registered attention function of the language model's layers
    (query [B, H, T, d], key/value [B, H_kv, T, d], as the layer computed them)."""
    session = _ACTIVE.get(None)
    if session is None:
        raise RuntimeError("the vlkv attention runs only inside kernels_py.models.generate")
    layer = module.layer_idx
    gqa = query.shape[1] != key.shape[1]
    if session.caches is None:  # prefill: the method sees every layer's Q/K/V
        # A method's own prefill attention (ZipVL's sparse one) where it gives one, else ordinary causal attention,
        # computed only if some sequence needs it (so a sparse prefill's time is its own).
        own = [session.method.prefill_attention(layer, query[b, :, pad:], key[b, :, pad:], value[b, :, pad:], spans)
               for b, (pad, spans) in enumerate(zip(session.pads, session.spans))]
        if all(o is not None for o in own):
            out = query.new_zeros(query.shape)  # a padding row's output is never read
        elif not any(session.pads):
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:  # left padding: transformers builds no mask for a registered function, so build it here
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=_padded_causal(session.pads, query),
                                                 scale=scaling, enable_gqa=gqa)
        for b, (pad, o) in enumerate(zip(session.pads, own)):
            if o is not None:
                out[b, :, pad:] = o.to(out.dtype)
        session.prompt[layer] = (query, key, value)
        if len(session.prompt) == session.layers:
            session.caches = []
            for b, (pad, spans) in enumerate(zip(session.pads, session.spans)):
                q, k, v = ([session.prompt[i][j][b, :, pad:] for i in range(session.layers)] for j in range(3))
                session.caches.append(session.method.prefill_all(q, k, v, spans))
            session.prompt = {}
        return out.transpose(1, 2), None
    out = torch.stack([session.method.decode(layer, caches[layer], query[b], key[b], value[b])
                       for b, caches in enumerate(session.caches)])
    return out.to(query.dtype).transpose(1, 2), None


def _padded_causal(pads: list[int], query: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool: token i of sequence b sees tokens pad_b..i; a padding
    row sees only itself (its output is never used, and no row is empty)."""
    tokens = query.shape[2]
    i = torch.arange(tokens, device=query.device)[:, None]
    j = torch.arange(tokens, device=query.device)[None, :]
    pad = torch.tensor(pads, device=query.device)[:, None, None]
    return (((j <= i) & (j >= pad)) | ((i < pad) & (j == i)))[:, None]


def _register():
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


@dataclass
class Generation:
    """What one greedy generation produced."""

    tokens: list[int]  # generated token ids
    logits: torch.Tensor  # [steps, vocab] float32, the distribution each token was chosen from
    cache_bytes: int  # the method's caches after the last step, all layers
    prefill_seconds: float
    decode_seconds: float
    spans: Spans
    # Memory above what was in use before the generation, on the model's device (memory_kind): its peak over the
    # whole generation, and over the decode steps alone (the caches plus one step's work; nan where not measurable).
    peak_bytes: float = float("nan")
    decode_peak_bytes: float = float("nan")
    memory_kind: str = ""
    # Per layer, the prompt positions held right after prefill ([kv_heads, n], ascending): what a token-keeping
    # method or a scoring press kept. None where the cache is not a subset of the prompt's tokens.
    kept: list[torch.Tensor] | None = None


class _Memory:
    """Peak memory of a phase above a baseline taken at the start: the CUDA
    allocator's counters on a GPU; on a CPU the process's resident set
    (Linux: VmHWM, whose peak /proc/self/clear_refs resets), which counts
    what the allocator holds from the system, so it is coarser."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.kind = "cuda" if self.cuda else "cpu-rss"
        self.base = self._now()

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return float(torch.cuda.memory_allocated())
        _trim_heap()
        return _proc_status("VmRSS")

    def reset(self) -> None:
        """Start a new phase: its peak counts from now (the baseline stays)."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return
        _trim_heap()
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.base = float("nan")

    def peak(self) -> float:
        """The phase's peak above the baseline."""
        if self.cuda:
            torch.cuda.synchronize()
            return float(torch.cuda.max_memory_allocated()) - self.base
        return _proc_status("VmHWM") - self.base


def _clock(device: torch.device) -> float:
    """Seconds on a monotonic clock once the device's queued work is done
    (CUDA launches return before their kernels run)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc), so the resident
    set counts live memory rather than what earlier work freed."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _proc_status(field: str) -> float:
    """A size in bytes from /proc/self/status (nan where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("nan")


def generate(vlm: VLM, method, inputs: dict, max_new_tokens: int,
             force_tokens: list[int] | None = None, stop_tokens: frozenset[int] = frozenset()) -> Generation:
    """Greedy decoding of `max_new_tokens` tokens with `method` holding every
    language-model layer's KV cache, for one prompt (prompt_inputs).
    force_tokens: feed these tokens back instead of the greedy ones (teacher
    forcing, so two methods' distributions are compared on the same
    history); `tokens` still holds what this method would have chosen.
    stop_tokens: end early once the chosen token is one of these (an
    end-of-sequence token), which is kept as the last of `tokens`."""
    if inputs["input_ids"].shape[0] != 1:
        raise ModelError(f"generate takes one prompt; for {inputs['input_ids'].shape[0]} use generate_batch")
    return generate_batch(vlm, method, inputs, max_new_tokens,
                          None if force_tokens is None else [force_tokens], stop_tokens)[0]


def batch_inputs(vlm: VLM, prompts: list[tuple[list, str]]) -> dict:
    """The processor's tensors for several (images, prompt) pairs of
    different lengths in one batch, left-padded."""
    tokenizer = vlm.processor.tokenizer
    if tokenizer.pad_token is None:
        raise ModelError(f"{vlm.path}'s tokenizer has no padding token, which a batch of prompts of different "
                         f"lengths needs: run them one at a time, or save the tokenizer with a pad_token")
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        single = [prompt_inputs(vlm, images, prompt) for images, prompt in prompts]  # checks each pair
        del single
        images = [image for imgs, _ in prompts for image in _open_images(imgs)]
        inputs = vlm.processor(images=images, text=[p for _, p in prompts], padding=True, return_tensors="pt")
    finally:
        tokenizer.padding_side = side
    return {k: v.to(vlm.model.device) for k, v in inputs.items()}


def _open_images(images):
    from PIL import Image

    return [Image.open(i).convert("RGB") if isinstance(i, (str, Path)) else i for i in images]


def generate_batch(vlm: VLM, method, inputs: dict, max_new_tokens: int,
                   force_tokens: list[list[int]] | None = None,
                   stop_tokens: frozenset[int] = frozenset()) -> list[Generation]:
    """generate for a batch (batch_inputs): every sequence keeps its own
    method caches (ragged: each holds what its own prompt and method give),
    the model runs the batch together. Positions follow the attention mask,
    as transformers' generate computes them, so a left-padded sequence sees
    the positions it would alone. With stop_tokens, decoding ends once every
    sequence has chosen one; each sequence's tokens end at its first."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    ids = inputs["input_ids"]
    batch = ids.shape[0]
    if force_tokens is not None and (len(force_tokens) != batch
                                     or any(len(f) < max_new_tokens - 1 for f in force_tokens)):
        raise ValueError(f"force_tokens holds {[len(f) for f in force_tokens]} tokens for {batch} sequences; "
                         f"{max_new_tokens} steps feed {max_new_tokens - 1} to each")
    mask = inputs.get("attention_mask")
    pads = [0] * batch if mask is None else [int((row == 0).sum()) for row in mask]
    if mask is not None and any(int(row[pad:].min()) == 0 for row, pad in zip(mask, pads)):
        raise ModelError("only left padding is supported (batch_inputs pads on the left)")
    spans = [spans_from_ids(ids[b, pads[b]:], vlm.image_token_id, vlm.rope) for b in range(batch)]
    _register()
    model = vlm.model
    language = model.model.language_model
    session = _Session(method, spans, pads, vlm.layers)
    token = _ACTIVE.set(session)
    before = language.config._attn_implementation
    language.set_attn_implementation(ATTENTION)
    padded = any(pads)
    try:
        with torch.inference_mode():
            memory = _Memory(model.device)
            memory.reset()
            cache = method_cache()
            extra, deltas = {}, 0
            if padded:  # positions skip the padding, as they would alone
                positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
                extra["position_ids"] = positions
                if vlm.mrope:
                    extra["position_ids"], deltas = _mrope_positions(model, inputs)
            start = _clock(model.device)
            out = model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1, **extra)
            prefill = _clock(model.device) - start
            kept = [_kept_positions(caches) for caches in session.caches]
            logits = [out.logits[:, -1].float()]
            tokens = [logits[-1].argmax(-1)]
            del out  # its logits over the whole prompt are not the decode steps' memory
            peak = memory.peak()
            memory.reset()
            start = _clock(model.device)
            stopped = _stopped(tokens[-1], stop_tokens)
            for i in range(max_new_tokens - 1):
                if bool(stopped.all()):
                    break
                fed = tokens[-1] if force_tokens is None else torch.tensor([f[i] for f in force_tokens],
                                                                           device=model.device)
                step = {"input_ids": fed[:, None].to(model.device)}
                if padded:
                    mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
                    positions = positions[:, -1:] + 1
                    step.update(attention_mask=mask, position_ids=positions + deltas)
                out = model(**step, past_key_values=cache, use_cache=True)
                logits.append(out.logits[:, -1].float())
                tokens.append(logits[-1].argmax(-1))
                stopped |= _stopped(tokens[-1], stop_tokens)
            decode = _clock(model.device) - start
            decode_peak = memory.peak()
    finally:
        language.set_attn_implementation(before)
        _ACTIVE.reset(token)
    stacked, chosen = torch.stack(logits, dim=1), torch.stack(tokens, dim=1)
    ends = [_until_stop(chosen[b].tolist(), stop_tokens) for b in range(batch)]
    return [Generation(chosen[b, :ends[b]].tolist(), stacked[b, :ends[b]],
                       sum(method.cache_bytes(c) for c in session.caches[b]),
                       prefill, decode, spans[b], max(peak, decode_peak), decode_peak, memory.kind, kept[b])
            for b in range(batch)]


def _stopped(chosen: torch.Tensor, stop_tokens: frozenset[int]) -> torch.Tensor:
    """[batch] bool: which sequences chose a stop token this step."""
    stops = torch.tensor(sorted(stop_tokens), dtype=chosen.dtype, device=chosen.device)
    return torch.isin(chosen, stops)


def _until_stop(tokens: list[int], stop_tokens: frozenset[int]) -> int:
    """How many of `tokens` a sequence generated: up to and with its first stop token."""
    for i, t in enumerate(tokens):
        if t in stop_tokens:
            return i + 1
    return len(tokens)


def _kept_positions(caches: list) -> list[torch.Tensor] | None:
    """Each layer's held prompt positions, if every layer holds a subset of tokens (KeptTokens)."""
    if not all(isinstance(c, KeptTokens) for c in caches):
        return None
    return [c.positions.sort(dim=-1).values.cpu() for c in caches]


def generate_sdpa(vlm: VLM, inputs: dict, max_new_tokens: int) -> list[Generation]:
    """Greedy decoding of a batch of prompts of one length (no padding) with
    transformers' own cache (DynamicCache, which appends with torch.cat) and
    attention (SDPA: FlashAttention on a GPU): the full cache as transformers
    runs it, the baseline of end-to-end timings. cache_bytes: the batch's
    cache split evenly over its prompts."""
    from transformers import DynamicCache

    from kernels_py.models.presses import cache_bytes

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    mask = inputs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ModelError("generate_sdpa takes prompts of one length: no padding")
    ids = inputs["input_ids"]
    batch = ids.shape[0]
    spans = [spans_from_ids(ids[b], vlm.image_token_id, vlm.rope) for b in range(batch)]
    model = vlm.model
    language = model.model.language_model
    before = language.config._attn_implementation
    language.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            memory = _Memory(model.device)
            memory.reset()
            cache = DynamicCache(config=model.config)
            start = _clock(model.device)
            out = model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
            prefill = _clock(model.device) - start
            logits = [out.logits[:, -1].float()]
            tokens = [logits[-1].argmax(-1)]
            del out
            peak = memory.peak()
            memory.reset()
            start = _clock(model.device)
            for _ in range(max_new_tokens - 1):
                out = model(input_ids=tokens[-1][:, None], past_key_values=cache, use_cache=True)
                logits.append(out.logits[:, -1].float())
                tokens.append(logits[-1].argmax(-1))
            decode = _clock(model.device) - start
            decode_peak = memory.peak()
    finally:
        language.set_attn_implementation(before if before != ATTENTION else "sdpa")
    stacked, chosen = torch.stack(logits, dim=1), torch.stack(tokens, dim=1)
    held = cache_bytes(cache) // batch
    return [Generation(chosen[b].tolist(), stacked[b], held, prefill, decode, spans[b], max(peak, decode_peak),
                       decode_peak, memory.kind) for b in range(batch)]


def _mrope_positions(model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE's 3-D prompt positions for a left-padded batch, and each
    sequence's offset of text positions after the prompt (the model's own
    get_rope_index, which skips the padding)."""
    grids = {k: inputs[k] for k in ("mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")
             if k in inputs}
    positions, deltas = model.model.get_rope_index(inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                                   **grids)
    return positions, deltas


def compare(reference: Generation, other: Generation) -> dict:
    """How a method's generation (teacher-forced on the reference's tokens)
    follows the full cache's: token_agreement, the share of steps whose greedy
    token is the reference's; kl_per_step, KL(reference || other) of the
    next-token distributions, and its mean."""
    steps = min(len(reference.tokens), len(other.tokens))
    p = torch.log_softmax(reference.logits[:steps], dim=-1)
    q = torch.log_softmax(other.logits[:steps], dim=-1)
    kl = (p.exp() * (p - q)).sum(dim=-1)
    agree = sum(a == b for a, b in zip(reference.tokens[:steps], other.tokens[:steps])) / steps
    return {"token_agreement": agree, "kl_mean": kl.mean().item(), "kl_per_step": kl.tolist()}
