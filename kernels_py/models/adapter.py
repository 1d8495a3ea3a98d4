"""A Hugging Face VLM driven by a compression method (see the package doc).

How a method gets into the model: the language model's attention layers
call a registered attention function, "vlkv", instead of SDPA, and the model
is given a `MethodCache` as its past key values. During prefill the function
computes causal attention as usual and keeps each layer's Q/K/V; once the
last layer has run, the method builds every layer's cache from them
(`prefill_all`, so methods that weigh layers against each other work). At
each decode step the function hands the new token's Q/K/V to the method's
`decode`, whose output is the layer's attention output: the method's own
cache is the only one. Where a method can (Method.decode_batch), a batch's
sequences decode together instead: one padded cache a layer, one write and
one attention a step, each sequence's cache written back when the
generation ends (methods.caches.KeptBatch; ZipVL's methods.mixed_precision.
QuantBatch, whose steps that requantize run sequence by sequence); a
generation whose every step decodes together (Method.decodes_together) can
replay its steps from a CUDA graph (generate_batch's graphs).
`MethodCache` stores no key or value; it counts tokens so the model's
positions and masks stay right. The vision tower keeps
its own attention.

Keys reach the methods as the model caches them, after RoPE. The methods
see sequence indices 0..T-1 for the prompt and T + s for step s, which order
tokens as the model does; the Qwen families' multimodal RoPE (M-RoPE)
rotates by 3-D positions instead, so a method that undoes and redoes RoPE
itself (AttentionPack's rope="before") is refused there.

Prefill attention is the model's own (SDPA under the masks transformers
builds for it: padding, sliding windows, Gemma 3's bidirectional images).
A sliding-window layer (Gemma 3) keeps its window as the model does, outside
the method, which holds the other layers. Videos arrive as sampled frames
(models.video); every frame is a span of its own.
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
from kernels_py.models.families import FAMILIES, Family, supported
from kernels_py.params import where

ATTENTION = "vlkv"
EAGER_ROOM = 128  # tokens a batch reserves per sequence beyond its longest when steps run eagerly
TESTED_TRANSFORMERS = "5.23.0"
# transformers before this rounds Qwen2.5-VL's seconds per temporal step down to whole seconds
# (get_rope_index's int(second_per_grid_ts)), so frames under a second apart share their positions.
WHOLE_SECOND_STEPS_BEFORE = "5.18.0"


class ModelError(ValueError):
    """A model directory, image or prompt the adapter cannot use; the message says what it supports."""


@dataclass
class VLM:
    """A loaded model and its processor."""

    model: torch.nn.Module
    processor: object
    family: str
    path: Path
    # What jobs computed from this model and reuse (ablation's full-cache generations), kept as long as the
    # model is: whoever holds the model (a worker's loader cache) decides how long that is.
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def spec(self) -> Family:
        return FAMILIES[self.family]

    @property
    def image_token_id(self) -> int:
        return int(self.model.config.image_token_id)

    @property
    def video_token_id(self) -> int | None:
        """The token a video's frames expand into (None: the family has none,
        or its frames use the image token)."""
        token = getattr(self.model.config, "video_token_id", None)
        return None if token is None else int(token)

    @property
    def mrope(self) -> bool:
        return self.spec.mrope

    @property
    def rope(self) -> Rope:
        """The language model's RoPE, from its config (base and scaling of the
        layers a method holds): what a method undoing it must use."""
        text = self.model.config.text_config
        return Rope("mrope" if self.mrope else "default", rope_theta(text), *rope_scaling(text))

    @property
    def image_placeholder(self) -> str:
        """What a prompt holds where an image goes."""
        return self.spec.image_placeholder

    @property
    def video_placeholder(self) -> str:
        """What a prompt holds where a video goes."""
        if self.spec.video_placeholder is None:
            takes = [f.model_type for f in FAMILIES.values() if f.video_placeholder]
            raise ModelError(f"{self.family} takes no video (it was not trained on any, and its processor has no "
                             f"video processor); the families that do: {', '.join(takes)}")
        return self.spec.video_placeholder

    @property
    def layers(self) -> int:
        return int(self.model.config.text_config.num_hidden_layers)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """The language model's sliding-window layers (Gemma 3 interleaves them
        with global ones): their cache is bounded by the window, as the model
        keeps it, and the methods compress only the other layers."""
        types = getattr(self.model.config.text_config, "layer_types", None) or []
        return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")

    @property
    def method_layers(self) -> tuple[int, ...]:
        """The layers whose cache a method holds, in order: a method's layer i is the model's method_layers[i]."""
        sliding = set(self.sliding_layers)
        return tuple(i for i in range(self.layers) if i not in sliding)


def model_dir(path: str | Path) -> Path:
    """The model directory, or a ModelError saying what the path is instead."""
    path = Path(path)
    if not path.is_dir():
        what = "is a file, not a directory" if path.exists() else "does not exist"
        raise ModelError(f"model directory {where(path)} {what}: give a local directory holding config.json, the "
                         f"weights and the processor files (save_pretrained writes them)")
    return path


def _unsupported_kind(model_type: str, config: dict) -> str:
    """What a model type the adapter does not drive is: a vision-language
    model of another family, one transformers does not know (a model with
    its own code, or newer than the installed transformers), or a text model."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if _holds_vision_config(config) or model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return "a model type the adapter does not know"
    if model_type not in CONFIG_MAPPING_NAMES:
        return (f"not a model type transformers {transformers.__version__} knows (a model with its own code, "
                f"loaded with trust_remote_code, or one newer than this transformers)")
    return "a text-only model (no vision tower)"


def _holds_vision_config(config: dict) -> bool:
    """Whether a config, or one nested in it, has a vision_config: a model
    with a vision tower, even where it sits in a sub-model (Qwen2.5-Omni's
    thinker_config)."""
    return "vision_config" in config or any(isinstance(v, dict) and _holds_vision_config(v) for v in config.values())


def load(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> VLM:
    """Load a VLM and its processor from a local directory (nothing is downloaded).
    dtype: a floating-point torch dtype or its name; None (or "auto") for the one the weights were saved in."""
    dtype = _load_dtype(dtype)
    path = model_dir(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{path} has no config.json: it is not a saved transformers model")
    try:
        config = json.loads(config_file.read_text())
        model_type = config.get("model_type")
    except (ValueError, AttributeError) as err:
        raise ModelError(f"{config_file} is not a JSON object ({err}): save the model again "
                         f"(save_pretrained)") from None
    if model_type is None:
        raise ModelError(f"{config_file} names no model_type: it is not a config save_pretrained wrote; "
                         f"supported: {supported()}")
    if model_type not in FAMILIES:
        raise ModelError(f"{path}: model_type {model_type!r} is {_unsupported_kind(model_type, config)}; "
                         f"supported: {supported()}")
    from transformers import AutoModelForImageTextToText, AutoProcessor

    # transformers and safetensors raise their own types (OSError for a
    # missing file, SafetensorError for a truncated one, ...), with
    # tracebacks dozens of lines deep: the first line of the message is
    # what says which file is at fault.
    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        # Mismatched shapes are loaded as random values, not raised, so that they are reported below with
        # their names (the loader's own error points at a report it logs, which a capture does not show).
        model, info = AutoModelForImageTextToText.from_pretrained(
            path, local_files_only=True, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True)
    except Exception as err:  # noqa: BLE001 - any failure to read the saved files
        reason = (str(err).strip().splitlines() or [""])[0]
        raise ModelError(f"{path}: the model does not load ({type(err).__name__}: {reason}): are its weights or "
                         f"processor files missing, truncated or garbled? save it again (save_pretrained)") from None
    _check_weights(path, info)
    return VLM(model.to(device).eval(), processor, model_type, path)


def _load_dtype(dtype) -> torch.dtype | None:
    """The dtype to load in, or a ModelError: checked before loading, since the
    loader's own error for it would be taken for damaged files."""
    if dtype is None or dtype == "auto":
        return None
    wanted = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if isinstance(wanted, torch.dtype) and wanted.is_floating_point:
        return wanted
    raise ModelError(f"dtype {dtype!r} is not a floating-point torch dtype: give torch.float16, torch.bfloat16 or "
                     f"torch.float32 (or its name), or None for the dtype the weights were saved in")


def _check_weights(path: Path, info: dict) -> None:
    """Refuse a model whose weights do not cover it, or are of another
    model: transformers fills a tensor the files lack, or one of another
    shape, with random values, and leaves out tensors the model has no
    place for (a bigger model's layers), and only logs it, so the model would
    run, and be measured, half random or cut short."""
    mismatched = sorted(info.get("mismatched_keys") or [], key=str)
    if mismatched:
        name, *shapes = mismatched[0] if isinstance(mismatched[0], tuple) else (mismatched[0],)
        shown = f" saved {list(shapes[0])}, config.json makes {list(shapes[1])}" if len(shapes) == 2 else ""
        raise ModelError(f"{path}: {len(mismatched)} of its weights have another shape than config.json gives "
                         f"({name}:{shown}): the weights and config.json are of different models; save them "
                         f"together (save_pretrained)")
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        names = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise ModelError(f"{path}: its weight files lack {len(missing)} of the model's tensors ({names}), which "
                         f"would run with random values: is a weight file (a shard) missing, or are the weights of "
                         f"another model than config.json? save it again (save_pretrained)")
    unexpected = sorted(info.get("unexpected_keys") or [])
    if unexpected:
        names = ", ".join(unexpected[:3]) + (", ..." if len(unexpected) > 3 else "")
        raise ModelError(f"{path}: its weight files hold {len(unexpected)} tensors the model config.json describes "
                         f"has no place for ({names}), which would be left out: are the weights of a bigger or "
                         f"other model (more layers than config.json's num_hidden_layers)? save the weights and "
                         f"config.json together (save_pretrained)")


def prompt_inputs(vlm: VLM, images: list, prompt: str, videos: list = ()) -> "Inputs":
    """The processor's tensors for `prompt` with `images` (file paths or PIL
    images) and `videos` (kernels_py.models.video.Video, frames already
    sampled), one placeholder per image and per video in the prompt, in order."""
    return _processed(vlm, [(list(images), prompt, list(videos))])


def batch_inputs(vlm: VLM, prompts: list[tuple]) -> "Inputs":
    """The processor's tensors for several (images, prompt) or (images,
    prompt, videos) entries of different lengths in one batch, left-padded."""
    tokenizer = vlm.processor.tokenizer
    if tokenizer.pad_token is None:
        raise ModelError(f"{vlm.path}'s tokenizer has no padding token, which a batch of prompts of different "
                         f"lengths needs: run them one at a time, or save the tokenizer with a pad_token")
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        return _processed(vlm, [(list(p[0]), p[1], list(p[2]) if len(p) > 2 else []) for p in prompts])
    finally:
        tokenizer.padding_side = side


class Inputs(dict):
    """The processor's tensors (what the model takes, as keyword arguments),
    and per prompt what its placeholders became, in prompt order: ("image", 1)
    or ("video", frames as the processor made them; Qwen merges two sampled
    frames into one temporal step). The layout cuts a prompt's visual tokens
    into spans."""

    def __init__(self, tensors: dict, layout: list[list[tuple[str, int]]]):
        super().__init__(tensors)
        self.layout = layout


def _processed(vlm: VLM, entries: list[tuple[list, str, list]]) -> Inputs:
    """Check every entry's placeholders against its images and videos, then run the processor on all of them."""
    for images, prompt, videos in entries:
        _check_placeholders(vlm, prompt, len(images), len(videos))
    per_prompt = [_open_images(entry[0]) for entry in entries]
    videos = [video for entry in entries for video in entry[2]]
    texts = [prompt for _, prompt, _ in entries]
    kwargs = {}
    if any(per_prompt):  # images per prompt: LLaVA-OneVision tiles an image only when it is its prompt's one
        kwargs["images"] = per_prompt
    if videos:
        kwargs.update(videos=[v.frames for v in videos], video_metadata=[_metadata(v) for v in videos],
                      do_sample_frames=False)
    if _writes_bos(vlm, texts):
        kwargs["add_special_tokens"] = False
    processed = vlm.processor(text=texts if len(texts) > 1 else texts[0], padding=len(texts) > 1,
                              return_tensors="pt", **kwargs)
    tensors = {k: v.to(vlm.model.device) if isinstance(v, torch.Tensor) else v for k, v in processed.items()}
    _check_temporal_steps(processed.get("second_per_grid_ts"))  # as the processor made it, on the host
    frames = _frames_per_video(tensors) or [int(v.frames.shape[0]) for v in videos]
    layout = []
    for _, prompt, _ in entries:
        order = sorted([(i, "image") for i in _occurrences(prompt, vlm.spec.image_placeholder)]
                       + [(i, "video") for i in _occurrences(prompt, vlm.spec.video_placeholder)])
        layout.append([(kind, 1 if kind == "image" else frames.pop(0)) for _, kind in order])
    return Inputs(tensors, layout)


def _writes_bos(vlm: VLM, texts: list[str]) -> bool:
    """Whether the prompts write the tokenizer's beginning-of-sequence token
    themselves (a chat template that does, as Gemma 3's): then the tokenizer
    must not add another, as transformers' apply_chat_template(tokenize=True)
    decides. The prompts of one batch must agree."""
    bos = getattr(vlm.processor.tokenizer, "bos_token", None)
    if not bos:
        return False
    written = [text.startswith(bos) for text in texts]
    if any(written) and not all(written):
        raise ModelError(f"{sum(written)} of the batch's {len(texts)} prompts begin with the beginning-of-sequence "
                         f"token {bos!r} and the others do not; one batch tokenizes them alike: begin all of them "
                         f"with it (as the model's chat template does) or none")
    return all(written)


def _check_temporal_steps(seconds_per_step, version: str | None = None) -> None:
    """Refuse a video whose temporal steps the installed transformers would
    misplace (WHOLE_SECOND_STEPS_BEFORE): a wrong position, not an error,
    is what the model would otherwise get."""
    if seconds_per_step is None:
        return
    from packaging.version import Version
    import transformers

    version = version or transformers.__version__
    if Version(version) >= Version(WHOLE_SECOND_STEPS_BEFORE):
        return
    steps = [float(s) for s in torch.as_tensor(seconds_per_step).flatten().tolist()]
    if all(s == int(s) for s in steps):
        return
    raise ModelError(f"transformers {version} rounds a video's seconds per temporal step (here "
                     f"{', '.join(f'{s:g}' for s in sorted(set(steps)))} s) down to whole seconds, so its "
                     f"frames would take wrong M-RoPE positions; install transformers >= "
                     f"{WHOLE_SECOND_STEPS_BEFORE} (tested: {TESTED_TRANSFORMERS}) in the runtime's Python, "
                     f"or sample the video so that a step is whole seconds (each step is two frames: fps 2 or 1)")


def _occurrences(text: str, placeholder: str | None) -> list[int]:
    """Where placeholder occurs in text."""
    found, at = [], text.find(placeholder) if placeholder else -1
    while at >= 0:
        found.append(at)
        at = text.find(placeholder, at + len(placeholder))
    return found


def _check_placeholders(vlm: VLM, prompt: str, images: int, videos: int) -> None:
    if not images and not videos:
        raise ModelError("give at least one image or video: the methods compress the KV cache of a "
                         "vision-language prompt")
    for kind, count in (("image", images), ("video", videos)):
        if not count and getattr(vlm.spec, f"{kind}_placeholder") is None:
            continue  # a family without video: nothing to count
        placeholder = getattr(vlm, f"{kind}_placeholder")  # refuses a video where the family takes none
        found = prompt.count(placeholder)
        if found != count:
            raise ModelError(f"the prompt holds {found} {kind} placeholder(s) {placeholder!r} for {count} {kind}(s): "
                             f"put one {placeholder!r} where each {kind} goes")


def _open_images(images):
    from PIL import Image, UnidentifiedImageError

    loaded = []
    for image in images:
        if isinstance(image, (str, Path)):
            if not Path(image).is_file():
                what = "is a directory, not an image file" if Path(image).is_dir() else "does not exist"
                raise ModelError(f"image {where(image)} {what}: give the path of a PNG, JPEG or another image file "
                                 f"Pillow reads")
            try:
                with Image.open(image) as im:
                    image = im.convert("RGB")
            except (OSError, UnidentifiedImageError) as err:
                raise ModelError(f"image {image} cannot be decoded ({err}); give a PNG, JPEG or another format "
                                 f"Pillow reads") from None
        loaded.append(image)
    return loaded


def _metadata(video) -> dict:
    """transformers' video metadata for frames sampled already: the source's
    rate and the sampled frames' indices in it (what Qwen's processors turn
    into temporal positions and timestamps)."""
    fps = float(video.source_fps)
    indices = [int(i) for i in video.sampling["indices"]]
    total = max(int(video.sampling["source_frames"]), indices[-1] + 1)
    return {"total_num_frames": total, "fps": fps, "frames_indices": indices,
            "duration": total / fps, "width": int(video.frames.shape[2]), "height": int(video.frames.shape[1])}


def _frames_per_video(inputs: dict) -> list[int]:
    """How many frames the processor made of each video of a batch, in order
    (Qwen merges two sampled frames into one temporal step): what cuts a
    video's tokens into per-frame spans. Empty where the inputs do not say
    (each video run is then one span)."""
    grid = inputs.get("video_grid_thw")
    if grid is not None:  # Qwen: temporal steps of the vision tower's grid
        return [int(t) for t in grid[:, 0].tolist()]
    pixels = inputs.get("pixel_values_videos")
    if pixels is not None and pixels.dim() == 5:  # [videos, frames, channels, height, width]
        return [int(pixels.shape[1])] * int(pixels.shape[0])
    return []


def spans_from_ids(ids: torch.Tensor, image_token_id: int, rope: Rope | None = None, *,
                   video_token_id: int | None = None, layout: list[tuple[str, int]] | None = None,
                   video_runs: str = "one") -> Spans:
    """Modality spans of a prompt from its token ids: every run of image
    tokens is an image and every video frame a span of its own (so methods
    treat frames as images); what precedes the first is the system prompt,
    what follows the last is the post-vision text; `rope` is the model's
    (VLM.rope; the default RoPE when not given). layout: what the prompt's
    placeholders became, in order (Inputs.layout); without it every run of
    visual tokens is a span. video_runs: how the processor lays a video out
    (families.Family.video_runs)."""
    visual = ids == image_token_id
    if video_token_id is not None:
        visual |= ids == video_token_id
    positions = visual.nonzero()[:, 0].tolist()
    tokens = ids.tolist()  # one copy to the host, not two waits on the GPU a visual token
    if not positions:
        raise ModelError("the prompt's tokens hold no image or video token: the processor did not expand a "
                         "placeholder")
    runs, start = [], positions[0]
    for here, after in zip(positions, positions[1:] + [None]):
        if after is None or after != here + 1 or tokens[after] != tokens[here]:
            runs.append((start, here + 1))
            start = after
    if layout is None:
        layout = [("image", 1)] * len(runs)
    taken = sum(count if kind == "video" and video_runs == "per_frame" else 1 for kind, count in layout)
    if taken != len(runs):
        raise ModelError(f"the prompt's tokens hold {len(runs)} runs of image or video tokens where its placeholders "
                         f"({', '.join(kind for kind, _ in layout)}) make {taken}: are two placeholders side by side, "
                         f"so that their tokens merged? put text (a word, a newline) between them")
    spans, videos, runs = [], [], iter(runs)
    for kind, count in layout:
        if kind == "image":
            spans.append(next(runs))
            continue
        first = len(spans)
        if video_runs == "per_frame":
            spans.extend(next(runs) for _ in range(count))
        else:
            start, end = next(runs)
            size = (end - start) // count
            if size < 1:
                raise ModelError(f"a video of {count} frames expanded into {end - start} tokens: fewer than one "
                                 f"a frame")
            spans.extend((start + i * size, start + (i + 1) * size if i < count - 1 else end) for i in range(count))
        videos.append((first, len(spans)))
    return Spans(system=(0, spans[0][0]), images=tuple(spans), text=(spans[-1][1], int(ids.shape[0])),
                 rope=rope or Rope(), videos=tuple(videos))


def batch_spans(vlm: VLM, inputs: dict, pads: list[int] | None = None) -> list[Spans]:
    """The spans of every prompt of processed inputs (prompt_inputs or
    batch_inputs), each without its left padding (`pads`)."""
    ids = inputs["input_ids"]
    pads = pads or [0] * ids.shape[0]
    layouts = getattr(inputs, "layout", None) or [None] * ids.shape[0]
    return [spans_from_ids(row[pad:], vlm.image_token_id, vlm.rope, video_token_id=vlm.video_token_id,
                           layout=layout, video_runs=vlm.spec.video_runs)
            for row, pad, layout in zip(ids, pads, layouts)]


def _rope_parameters(text_config) -> dict:
    """A text config's RoPE parameters (transformers 5.x keeps them in
    rope_parameters; per layer type where layers differ, as Gemma 3's sliding
    layers do: the global layers' then, which are the ones methods hold)."""
    params = getattr(text_config, "rope_parameters", None) or {}
    return params.get("full_attention", params)


def rope_theta(text_config) -> float:
    """The RoPE base of a text config (of its global layers, _rope_parameters)."""
    return float(_rope_parameters(text_config).get("rope_theta", getattr(text_config, "rope_theta", 10000.0)))


def rope_scaling(text_config) -> tuple[str, float]:
    """The RoPE scaling of a text config's global layers: its rope_type
    ("default": none; Gemma 3 4B and up: "linear", factor 8) and factor."""
    params = _rope_parameters(text_config)
    kind = str(params.get("rope_type") or params.get("type") or "default")
    if kind in ("default", "mrope"):  # older Qwen2-VL configs name M-RoPE here: Rope.kind, not a scaling
        return "default", 1.0
    return kind, float(params.get("factor") or 1.0)


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
    and (after prefill) its method caches, one per method layer; sliding-window
    layers (Gemma 3) keep their window as the model does, outside the method."""

    method: object
    spans: list[Spans]
    pads: list[int]
    method_layers: tuple[int, ...]  # the model layer of each method layer
    prompt: dict = field(default_factory=dict)  # method layer -> (q, k, v) [B, heads, T, d] until prefill ends
    caches: list[list] | None = None
    windows: dict = field(default_factory=dict)  # sliding model layer -> per sequence [k, v] [kv_heads, <W, d]
    bidirectional_images: bool = False
    room: int = 0  # decode steps to come: what a batch reserves
    batches: dict = field(default_factory=dict)  # method layer -> its batch (Method.decode_batch), or None
    scratch: dict = field(default_factory=dict)  # what the batches' attention reuses, shared by the layers

    def __post_init__(self):
        self.index = {layer: i for i, layer in enumerate(self.method_layers)}

    def batch(self, layer: int):
        """The layer's caches decoding together, from its first decode step
        (and again after a step that could not), where the method and its
        caches allow it (Method.decode_batch); None: sequence by sequence."""
        if layer not in self.batches:
            caches = [per_sequence[layer] for per_sequence in self.caches]
            decode_batch = getattr(self.method, "decode_batch", None)
            self.batches[layer] = decode_batch(caches, self.room, self.scratch) if decode_batch else None
        return self.batches[layer]

    def write_back(self) -> None:
        """Every batch's caches as the method's own decode would have left them."""
        while self.batches:  # one at a time, each padded cache freed before the next is written back
            batch = self.batches.popitem()[1]
            if batch is not None:
                batch.write_back()

    def window_bytes(self, b: int) -> int:
        """Bytes sequence b's sliding-window layers hold."""
        return sum(t.numel() * t.element_size() for windows in self.windows.values() for t in windows[b])


_ACTIVE: contextvars.ContextVar[_Session] = contextvars.ContextVar("vlkv_session")


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The registered attention function of the language model's layers
    (query [B, H, T, d], key/value [B, H_kv, T, d], as the layer computed them;
    attention_mask as SDPA gets it, from the mask function registered with
    it: causal, padding, sliding windows, Gemma 3's bidirectional images)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    session = _ACTIVE.get(None)
    if session is None:
        raise RuntimeError("the vlkv attention runs only inside kernels_py.models.generate")
    window = kwargs.pop("sliding_window", None)
    if window is not None:
        return _sliding(session, module, int(window), query, key, value, attention_mask, scaling, kwargs)
    # The methods score and attend with 1/sqrt(d); a model scaling otherwise (Gemma 3's query_pre_attn_scalar) has
    # its factor folded into the queries they see.
    head_dim = query.shape[-1]
    if scaling is not None and abs(scaling * head_dim ** 0.5 - 1) > 1e-6:
        query = query * (scaling * head_dim ** 0.5)
    layer = session.index[module.layer_idx]
    if session.caches is None:  # prefill: the method sees every method layer's Q/K/V
        # A method's own prefill attention (ZipVL's sparse one) where it gives one, else the model's own (SDPA under
        # the model's mask), computed only if some sequence needs it (so a sparse prefill's time is its own).
        own = [session.method.prefill_attention(layer, query[b, :, pad:], key[b, :, pad:], value[b, :, pad:], spans)
               for b, (pad, spans) in enumerate(zip(session.pads, session.spans))]
        if session.bidirectional_images and any(o is not None for o in own):
            raise ModelError("this method computes its own causal prefill attention (ZipVL's sparse_prefill), but "
                             "the model's image tokens attend to each other both ways in prefill (Gemma 3): run it "
                             "with sparse_prefill = False")
        if all(o is not None for o in own):
            out = query.new_zeros(query.shape)  # a padding row's output is never read
        else:
            out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                         scaling=head_dim ** -0.5, **kwargs)[0].transpose(1, 2)
        for b, (pad, o) in enumerate(zip(session.pads, own)):
            if o is not None:
                out[b, :, pad:] = o.to(out.dtype)
        session.prompt[layer] = (query, key, value)
        if len(session.prompt) == len(session.method_layers):
            session.caches = []
            layers = range(len(session.method_layers))
            for b, (pad, spans) in enumerate(zip(session.pads, session.spans)):
                q, k, v = ([session.prompt[i][j][b, :, pad:] for i in layers] for j in range(3))
                session.caches.append(session.method.prefill_all(q, k, v, spans))
            session.prompt = {}
        return out.transpose(1, 2), None
    batch = session.batch(layer)
    out = None if batch is None else batch.decode(query, key, value)
    if batch is not None and out is None:  # a step it cannot take together: it wrote the caches back
        del session.batches[layer]
    if out is None:
        out = torch.stack([session.method.decode(layer, caches[layer], query[b], key[b], value[b])
                           for b, caches in enumerate(session.caches)])
    return out.to(query.dtype).transpose(1, 2), None


def _sliding(session: _Session, module, window: int, query, key, value, attention_mask, scaling, kwargs):
    """A sliding-window layer, held as the model holds it: the prompt through
    SDPA under the model's mask, then each sequence's last window - 1 tokens,
    over which every decode step attends with its own token."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer, keep = module.layer_idx, window - 1
    if layer not in session.windows:  # prefill
        session.windows[layer] = [[key[b, :, pad:][:, -keep:].clone(), value[b, :, pad:][:, -keep:].clone()]
                                  for b, pad in enumerate(session.pads)]
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    outs = []
    for b, held in enumerate(session.windows[layer]):
        k, v = torch.cat([held[0], key[b]], dim=1), torch.cat([held[1], value[b]], dim=1)
        outs.append(F.scaled_dot_product_attention(query[b:b + 1], k[None], v[None], scale=scaling,
                                                   enable_gqa=query.shape[1] != k.shape[0])[0])
        held[0], held[1] = k[:, -keep:], v[:, -keep:]
    return torch.stack(outs).transpose(1, 2), None


def _register():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _attention)
    # The masks SDPA would get (padding, sliding windows, Gemma 3's bidirectional image blocks), not none.
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


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
    # Of decode_seconds, the steps replayed from a CUDA graph (generate_batch's graphs) and their seconds.
    replayed_steps: int = 0
    replayed_seconds: float = 0.0


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
             force_tokens: list[int] | None = None, stop_tokens: frozenset[int] = frozenset(),
             stop_strings: tuple[str, ...] = ()) -> Generation:
    """Greedy decoding of `max_new_tokens` tokens with `method` holding every
    language-model layer's KV cache, for one prompt (prompt_inputs).
    force_tokens: feed these tokens back instead of the greedy ones (teacher
    forcing, so two methods' distributions are compared on the same
    history); `tokens` still holds what this method would have chosen.
    stop_tokens: end early once the chosen token is one of these (an
    end-of-sequence token), which is kept as the last of `tokens`.
    stop_strings: end early once the tokens decode (without special tokens)
    to text holding one of these; the token that completed it is the last."""
    if inputs["input_ids"].shape[0] != 1:
        raise ModelError(f"generate takes one prompt; for {inputs['input_ids'].shape[0]} use generate_batch")
    return generate_batch(vlm, method, inputs, max_new_tokens, None if force_tokens is None else [force_tokens],
                          stop_tokens, stop_strings=stop_strings)[0]


class StopStrings:
    """Which sequences of a batch have decoded to text holding one of the
    stop strings: `seen` takes each step's chosen tokens; `ends[b]` is how
    many tokens sequence b keeps (up to and with the one that completed a
    stop string), None until then. The text is decoded as a reply is, without
    special tokens, but only its tail, so a step costs the same however
    long the reply has grown."""

    def __init__(self, tokenizer, strings, batch: int):
        self.tokenizer = tokenizer
        self.strings = [s for s in strings if s]
        # Tokens enough to hold the longest stop string even in byte-level pieces (up to 4 a character).
        self.tail = 4 * max((len(s) for s in self.strings), default=0) + 4
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.ends: list[int | None] = [None] * batch

    def seen(self, chosen: torch.Tensor) -> torch.Tensor:
        """Take a step's chosen tokens [B]; bool [B] on their device: whether each sequence has met a stop string."""
        for b, token in enumerate(chosen.tolist()):
            if self.ends[b] is None:
                self.tokens[b].append(token)
                text = self.tokenizer.decode(self.tokens[b][-self.tail:], skip_special_tokens=True)
                if any(s in text for s in self.strings):
                    self.ends[b] = len(self.tokens[b])
        return torch.tensor([end is not None for end in self.ends], device=chosen.device)


def generate_batch(vlm: VLM, method, inputs: dict, max_new_tokens: int,
                   force_tokens: list[list[int]] | None = None,
                   stop_tokens: frozenset[int] = frozenset(), graphs: bool = False,
                   stop_strings: tuple[str, ...] = ()) -> list[Generation]:
    """generate for a batch (batch_inputs): every sequence keeps its own
    method caches (ragged: each holds what its own prompt and method give),
    the model runs the batch together. Positions follow the attention mask,
    as transformers' generate computes them, so a left-padded sequence sees
    the positions it would alone. With stop_tokens or stop_strings, decoding
    ends once every sequence has met one; each sequence's tokens end at its
    first.

    graphs: decode steps from the third on replay a CUDA graph of one step
    (_GraphedStep), so the host launches one graph a step instead of every
    kernel; for prompts without padding, a model without sliding-window
    layers and a method whose batch decodes together (ModelError otherwise).
    Without CUDA the same static steps run eagerly."""
    if isinstance(method, (str, type)):
        name = method if isinstance(method, str) else getattr(method, "name", method.__name__)
        raise TypeError(f"method must be a method object, got the {type(method).__name__} {method!r}: pass "
                        f"make_method({name!r}, {{...}}) (kernels_py.methods)")
    if getattr(method, "in_model_only", False):  # a kvpress press: it compresses transformers' own cache
        raise ValueError(f"method {getattr(method, 'name', method)!r} compresses transformers' own cache, which "
                         f"models.generate replaces with the method's: generate with "
                         f"kernels_py.models.presses.generate(vlm, method.make_press(), inputs, max_new_tokens)")
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
    spans = batch_spans(vlm, inputs, pads)
    padded = any(pads)
    if graphs:
        _check_graphs(vlm, method, padded)
    _register()
    model = vlm.model
    language = model.model.language_model
    # A captured step cannot grow a batch's padded cache: room for every step; eager steps grow it as they go.
    room = max_new_tokens if graphs else min(max_new_tokens, EAGER_ROOM)
    session = _Session(method, spans, pads, vlm.method_layers, bidirectional_images=vlm.spec.bidirectional_images,
                       room=room)
    token = _ACTIVE.set(session)
    before = language.config._attn_implementation
    language.set_attn_implementation(ATTENTION)
    try:
        with torch.inference_mode(), _decode_sdpa():
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
            graphed = _GraphedStep(model, cache, session, _step_offsets(vlm, inputs)) if graphs else None
            start = _clock(model.device)
            # Asking whether every sequence stopped waits for the GPU: only when there is something to stop at.
            stops = torch.tensor(sorted(stop_tokens), dtype=tokens[-1].dtype, device=tokens[-1].device)
            strings = StopStrings(vlm.processor.tokenizer, stop_strings, batch) if any(stop_strings) else None

            def stopped_now(chosen: torch.Tensor) -> torch.Tensor:
                """Which sequences' chosen tokens [B] end them: a stop token, or a stop string completed."""
                met = torch.isin(chosen, stops)
                return met if strings is None else met | strings.seen(chosen)

            stopping = bool(stop_tokens) or strings is not None
            stopped = stopped_now(tokens[-1])
            for i in range(max_new_tokens - 1):
                if stopping and bool(stopped.all()):
                    break
                fed = tokens[-1] if force_tokens is None else torch.tensor([f[i] for f in force_tokens],
                                                                           device=model.device)
                if graphed is not None:
                    logits.append(graphed(fed, int(ids.shape[1]) + i))
                    tokens.append(logits[-1].argmax(-1))
                    if stopping:
                        stopped |= stopped_now(tokens[-1])
                    continue
                step = {"input_ids": fed[:, None].to(model.device)}
                if padded:
                    mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
                    positions = positions[:, -1:] + 1
                    step.update(attention_mask=mask, position_ids=positions + deltas)
                out = model(**step, past_key_values=cache, use_cache=True)
                logits.append(out.logits[:, -1].float())
                tokens.append(logits[-1].argmax(-1))
                if stopping:
                    stopped |= stopped_now(tokens[-1])
            end = _clock(model.device)
            decode = end - start
            replays = (graphed.replays, end - graphed.replay_start) if graphed and graphed.replays else (0, 0.0)
            decode_peak = memory.peak()
            session.write_back()
    finally:
        language.set_attn_implementation(before)
        _ACTIVE.reset(token)
    stacked, chosen = torch.stack(logits, dim=1), torch.stack(tokens, dim=1)
    ends = [_until_stop(chosen[b].tolist(), stop_tokens) for b in range(batch)]
    if strings is not None:  # a stop string completed before any stop token ends the sequence there
        ends = [min(end, met or end) for end, met in zip(ends, strings.ends)]
    return [Generation(chosen[b, :ends[b]].tolist(), stacked[b, :ends[b]],
                       sum(method.cache_bytes(c) for c in session.caches[b]) + session.window_bytes(b),
                       prefill, decode, spans[b], max(peak, decode_peak), decode_peak, memory.kind, kept[b], *replays)
            for b in range(batch)]


def _step_offsets(vlm: VLM, inputs: dict) -> torch.Tensor:
    """[B, 1] int64: what each sequence adds to a decode step's index (its
    prompt's length plus the steps before) to make its position: 0, or
    under M-RoPE the offset of text positions after the prompt's images."""
    ids = inputs["input_ids"]
    if not vlm.mrope:
        return torch.zeros((ids.shape[0], 1), dtype=torch.long, device=vlm.model.device)
    _, deltas = _mrope_positions(vlm.model, {**inputs, "attention_mask": torch.ones_like(ids)})
    return deltas.to(device=vlm.model.device, dtype=torch.long).reshape(ids.shape[0], 1)


def _check_graphs(vlm: VLM, method, padded: bool) -> None:
    """Why generate_batch(graphs=True) cannot run, as a ModelError, if it cannot."""
    if padded:
        raise ModelError("decoding from a CUDA graph needs prompts of one length (no padding): the mask grows every "
                         "step")
    if vlm.sliding_layers:
        raise ModelError("decoding from a CUDA graph needs a model without sliding-window layers (their window "
                         "moves by concatenation)")
    if not getattr(method, "decodes_together", False):
        raise ModelError(f"decoding from a CUDA graph needs a method whose batch decodes together at every step (a "
                         f"token-keeping method with attention=sdpa that does not evict while decoding); "
                         f"{getattr(method, 'name', method)!r} does not")


class _GraphedStep:
    """Decode steps of generate_batch(graphs=True): each takes the fed
    tokens and the step's position and returns the last logits [B, vocab]
    in float32. The first step runs eagerly (it makes each layer's
    KeptBatch, which must exist before a capture), the second too, on a side
    stream (what CUDA graphs ask before a capture: lazy initialisations out
    of the way), and the third is captured and replayed, as is every later
    one: the inputs are copied into the static tensors the graph reads, and
    what the graph moves on the device (each batch's slots and step count)
    the replays do not move in Python, so the Python counters (each batch's
    steps, the counting cache's tokens) are advanced here. Without CUDA the
    steps from the second run eagerly on the same static inputs."""

    def __init__(self, model, cache, session: "_Session", offsets: torch.Tensor):
        self.model, self.cache, self.session, self.offsets = model, cache, session, offsets
        self.ids = torch.zeros_like(offsets)
        self.positions = torch.zeros_like(offsets)
        device = offsets.device
        self.cuda = device.type == "cuda"
        self.graph, self.logits, self.steps = None, None, 0
        self.replays, self.replay_start = 0, 0.0  # replayed steps, and the clock when the first began

    def _forward(self) -> torch.Tensor:
        out = self.model(input_ids=self.ids, position_ids=self.positions, past_key_values=self.cache, use_cache=True)
        return out.logits[:, -1].float()

    def _advance(self, steps: int) -> None:
        for batch in self.session.batches.values():
            batch.replayed(steps)
        for layer in self.cache.layers:
            layer.count += steps

    def __call__(self, fed: torch.Tensor, position: int) -> torch.Tensor:
        self.steps += 1
        self.ids.copy_(fed[:, None])
        torch.add(self.offsets, position, out=self.positions)
        if self.steps == 1 or not self.cuda:
            logits = self._forward()
            if self.steps == 1 and not all(b is not None for b in self.session.batches.values()):
                raise ModelError("decoding from a CUDA graph needs every layer's caches to decode together "
                                 "(methods.caches.KeptBatch.holds): some layer's do not")
            return logits
        device = self.ids.device
        if self.steps == 2:
            side = torch.cuda.Stream(device=device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                logits = self._forward()
            torch.cuda.current_stream(device).wait_stream(side)
            logits.record_stream(torch.cuda.current_stream(device))  # made on the side stream, read on this one
            return logits
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.device(device), torch.cuda.graph(self.graph):
                self.logits = self._forward()
            self._advance(-1)  # the capture ran the Python of a step whose kernels it only recorded
        if not self.replays:
            self.replay_start = _clock(device)
        self._advance(1)  # first: it refuses a step the batches have no room for, before the graph writes there
        self.graph.replay()
        self.replays += 1
        return self.logits.clone()  # the graph writes its next logits over these


def _decode_sdpa():
    """The SDPA backends a generation may use: FlashAttention, then the
    memory-efficient kernel, then the math one; not cuDNN's attention, which
    PyTorch prefers on Hopper but which builds an execution plan for every
    new shape: a decode step's keys are one longer than the last step's, and
    a method's layers hold different counts, so it would build one each
    layer and step (several milliseconds each, on the host)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


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
    spans = batch_spans(vlm, inputs)
    model = vlm.model
    language = model.model.language_model
    before = language.config._attn_implementation
    language.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode(), _decode_sdpa():
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
