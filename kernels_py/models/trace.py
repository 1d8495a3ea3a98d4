"""Attention traces of a real model: every language-model layer's Q/K/V
(after RoPE, as the model caches keys) for the prompt and for each decode
step of a greedy full-cache generation, with positions and modality spans,
saved as one safetensors file whose metadata holds the rest as JSON. A trace
is a workload (workloads/trace.py), so every experiment runs on real
attention.

    python -m kernels_py.models.trace --model DIR (--image FILE | --video FILE)... --prompt TEXT --out FILE
        [--decode-steps N] [--frames N] [--fps F]   (`workbench trace capture` runs this)

Tensors: layer.{l}.q [heads, T, d], layer.{l}.k / .v [kv_heads, T, d],
layer.{l}.k_pre [kv_heads, T, d] (the keys before RoPE, as k_proj gave
them), layer.{l}.decode_q [steps, heads, 1, d], layer.{l}.decode_k /
.decode_k_pre / .decode_v [steps, kv_heads, 1, d]; positions [T] and
decode_positions [steps] (RoPE positions; [3, T] and [3, steps] on M-RoPE
models, whose image tokens are rotated by temporal, height and width).
Metadata key "vlkv": JSON with format, model (directory, model_type, layers,
heads, kv_heads, head_dim, rope_theta, rope "default" or "mrope",
rope_scaling {"type": the config's rope_type, "factor"} (a header without it,
from before it was recorded, means no scaling), dtype, and where the model
has sliding-window layers, which the trace leaves out, model_layers and
sliding_layers), spans (videos: each video's frames as a
range of indices into images), videos (source, timestamps and sampling of
each), prompt_tokens, decode_steps, prompt, tokens (generated ids). Layer l
of a trace is the model's method layer l (VLM.method_layers): every layer
but the sliding-window ones.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from kernels_py.attention import Rope, Spans
from kernels_py.params import where

FORMAT = "vlkv-trace/1"


class _Recorder:
    """A method that is the full cache and keeps what it is given."""

    def __init__(self):
        from kernels_py.methods import make_method

        self.full = make_method("full")
        self.prompt = None
        self.steps: dict[int, list] = {}

    def prefill_all(self, q, k, v, spans):
        self.prompt = [[t.detach().clone() for t in ts] for ts in (q, k, v)]
        return self.full.prefill_all(q, k, v, spans)

    def prefill_attention(self, layer, q, k, v, spans):
        return None  # the model's own prefill

    def decode(self, layer, cache, q_t, k_t, v_t):
        self.steps.setdefault(layer, []).append((q_t.detach().clone(), k_t.detach().clone(), v_t.detach().clone()))
        return self.full.decode(layer, cache, q_t, k_t, v_t)

    def cache_bytes(self, cache):
        return self.full.cache_bytes(cache)


def capture(vlm, images: list, prompt: str, decode_steps: int, videos: list = ()) -> tuple[dict, dict]:
    """Run the model with the full cache for decode_steps + 1 new tokens and
    return (tensors, metadata) of the trace (videos: models.video.Video)."""
    from kernels_py.models.adapter import generate, prompt_inputs

    if decode_steps < 1:
        raise ValueError(f"decode_steps must be at least 1, got {decode_steps}")
    inputs = prompt_inputs(vlm, images, prompt, videos)
    recorder = _Recorder()
    with _PreRope(vlm) as pre:
        result = generate(vlm, recorder, inputs, decode_steps + 1)
    tensors = {}
    q, k, v = recorder.prompt
    for layer, model_layer in enumerate(vlm.method_layers):
        for name, per_layer in (("q", q), ("k", k), ("v", v)):
            tensors[f"layer.{layer}.{name}"] = per_layer[layer]
        steps = recorder.steps[layer]
        for i, name in enumerate(("decode_q", "decode_k", "decode_v")):
            tensors[f"layer.{layer}.{name}"] = torch.stack([s[i] for s in steps])
        keys = pre.keys[model_layer]  # the prompt's, then one per step; the last step's token is never fed back
        tensors[f"layer.{layer}.k_pre"] = keys[0]
        tensors[f"layer.{layer}.decode_k_pre"] = torch.stack(keys[1:decode_steps + 1])
    positions = pre.positions
    tensors["positions"] = positions[0]
    tensors["decode_positions"] = torch.cat(positions[1:decode_steps + 1], dim=-1)
    text = vlm.model.config.text_config
    spans = result.spans
    meta = {
        "format": FORMAT,
        "model": {"directory": str(Path(vlm.path).absolute()), "model_type": vlm.family, "layers": len(vlm.method_layers),
                  "heads": int(text.num_attention_heads), "kv_heads": int(text.num_key_value_heads),
                  "head_dim": int(q[0].shape[-1]), "rope_theta": vlm.rope.theta,
                  "rope": vlm.rope.kind, "rope_scaling": {"type": vlm.rope.scaling, "factor": vlm.rope.factor},
                  "dtype": str(q[0].dtype).removeprefix("torch.")},
        "spans": {"system": list(spans.system), "images": [list(s) for s in spans.images], "text": list(spans.text),
                  "videos": [list(v) for v in spans.videos]},
        "videos": [{"source": str(Path(v.source).absolute()), "timestamps": list(v.timestamps), "sampling": dict(v.sampling)}
                   for v in videos],
        "prompt_tokens": spans.prompt_tokens,
        "decode_steps": decode_steps,
        "prompt": prompt,
        "tokens": result.tokens,
    }
    if vlm.sliding_layers:
        meta["model"].update(model_layers=vlm.layers, sliding_layers=list(vlm.sliding_layers))
    return {name: t.contiguous().cpu() for name, t in tensors.items()}, meta


class _PreRope:
    """Forward hooks that keep what RoPE is applied to: each layer's k_proj
    output as [kv_heads, T, d], and the position ids the rotary embedding
    is called with, one entry per forward pass of the language model."""

    def __init__(self, vlm):
        text = vlm.model.config.text_config
        self.language = vlm.model.model.language_model
        self.kv_heads = int(text.num_key_value_heads)
        self.keys: dict[int, list] = {}
        self.positions: list[torch.Tensor] = []
        self.handles = []

    def __enter__(self):
        for layer, block in enumerate(self.language.layers):
            self.handles.append(block.self_attn.k_proj.register_forward_hook(self._keep_keys(layer, block.self_attn)))
        self.handles.append(self.language.rotary_emb.register_forward_hook(self._keep_positions, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def _keep_keys(self, layer, attention):
        # RoPE turns what the layer's k_norm gives where it has one (Qwen3, Gemma 3): a norm over each head's
        # channels, which gives the same whatever order the layer lays heads and tokens out in.
        norm = getattr(attention, "k_norm", None)

        def hook(module, args, out):
            batch, tokens, _ = out.shape
            keys = out.detach().view(batch, tokens, self.kv_heads, -1)
            if isinstance(norm, torch.nn.Module):
                keys = norm(keys)
            keys = keys.transpose(1, 2)
            self.keys.setdefault(layer, []).append(keys[0].clone())
        return hook

    def _keep_positions(self, module, args, kwargs, out):
        kind = kwargs.get("layer_type", args[2] if len(args) > 2 else None)
        if kind not in (None, "full_attention"):  # Gemma 3 calls it once per layer type: keep the global layers'
            return
        ids = kwargs["position_ids"] if "position_ids" in kwargs else args[1]  # [B, T], or [3, B, T] for M-RoPE
        self.positions.append((ids[:, 0] if ids.dim() == 3 else ids[0]).detach().clone())


def save(path: str | Path, tensors: dict, meta: dict) -> None:
    import os

    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"vlkv": json.dumps(meta)})
    # safetensors creates the file readable by its owner alone; a trace is shared as any file is (the umask's mode).
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def read(path: str | Path) -> tuple[dict, dict]:
    """(tensors, metadata) of a trace file, with clear errors for what is not one."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        raise ValueError(f"trace {where(path)} is a directory, not a trace file: give the .safetensors file "
                         f"`workbench trace capture --out` wrote")
    if not path.is_file():
        raise ValueError(f"trace {where(path)} does not exist: capture one with `workbench trace capture`")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:  # safetensors raises its own error types
        raise ValueError(f"{path} is not a safetensors file: {err}") from None
    if "vlkv" not in metadata:
        raise ValueError(f"{path} is a safetensors file but not a vlkv trace (no 'vlkv' metadata)")
    try:
        meta = json.loads(metadata["vlkv"])
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: its trace metadata is not JSON ({err}): capture the trace again") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: its trace metadata is a JSON {type(meta).__name__}, not an object: capture the "
                         f"trace again")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: trace format {meta.get('format')!r}; this version reads {FORMAT!r}")
    _check_tensors(path, tensors, meta)
    _check_spans(path, meta)
    return tensors, meta


def _check_tensors(path: Path, tensors: dict, meta: dict) -> None:
    """Refuse a trace whose tensors are not the ones its header describes (a
    tensor missing, of another shape, or Q/K/V not floating point), naming
    the tensor: replaying it would fail deep inside a method, or score wrong."""
    try:
        model = meta["model"]
        layers, heads, kv_heads, dim = (int(model[k]) for k in ("layers", "heads", "kv_heads", "head_dim"))
        prompt, steps = int(meta["prompt_tokens"]), int(meta["decode_steps"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: its trace metadata has no usable {err} (model shape, prompt_tokens, "
                         f"decode_steps): capture the trace again") from None
    rope = (3,) if model.get("rope") == "mrope" else ()  # M-RoPE positions are temporal, height, width
    want = {"positions": (*rope, prompt), "decode_positions": (*rope, steps)}
    for layer in range(layers):
        want[f"layer.{layer}.q"] = (heads, prompt, dim)
        want[f"layer.{layer}.decode_q"] = (steps, heads, 1, dim)
        for name in ("k", "v", "k_pre"):
            want[f"layer.{layer}.{name}"] = (kv_heads, prompt, dim)
            want[f"layer.{layer}.decode_{name}"] = (steps, kv_heads, 1, dim)
    shape = (f"{layers} layers, {heads} heads, {kv_heads} kv heads, head_dim {dim}, {prompt} prompt tokens, "
             f"{steps} decode steps")
    for name, dims in want.items():
        if name not in tensors:
            if name.endswith("k_pre"):  # traces written before pre-RoPE keys were recorded replay without them
                continue
            raise ValueError(f"{path}: tensor {name!r} is missing (its header gives {shape}): the file is not a "
                             f"whole trace; capture it again")
        got = tensors[name]
        if tuple(got.shape) != dims:
            raise ValueError(f"{path}: tensor {name!r} has shape {list(got.shape)}, not the {list(dims)} its header "
                             f"gives ({shape}): capture the trace again")
        if name.startswith("layer.") and not got.is_floating_point():
            raise ValueError(f"{path}: tensor {name!r} is {str(got.dtype).removeprefix('torch.')}, not floating "
                             f"point as Q/K/V are: capture the trace again")


def _check_spans(path: Path, meta: dict) -> None:
    """Refuse spans a replay cannot use (missing, not ranges, out of order,
    or not ending at the last prompt token), naming the file: a method would
    otherwise fail on them with no word of which trace, or score the wrong
    tokens as images."""
    try:
        spans = spans_of(meta)
    except KeyError as err:
        raise ValueError(f"{path}: its trace metadata has no {err} (spans and RoPE): capture the trace again") from None
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: its trace metadata's spans or RoPE are unusable ({err}): capture the trace "
                         f"again") from None
    if spans.prompt_tokens != int(meta["prompt_tokens"]):
        raise ValueError(f"{path}: its spans end at token {spans.prompt_tokens}, not at the {meta['prompt_tokens']} "
                         f"prompt tokens its header gives: capture the trace again")


def spans_of(meta: dict) -> Spans:
    """The trace's spans, with the RoPE (kind, theta and scaling) its header
    names; a header from before the scaling was recorded means none."""
    s, model = meta["spans"], meta["model"]
    scaling = model.get("rope_scaling") or {}
    rope = Rope(model["rope"], float(model["rope_theta"]), str(scaling.get("type", "default")),
                float(scaling.get("factor", 1.0)))
    return Spans(tuple(s["system"]), tuple(tuple(i) for i in s["images"]), tuple(s["text"]), rope,
                 tuple(tuple(v) for v in s.get("videos", [])))


def main(argv=None) -> int:
    from kernels_py.models.adapter import ModelError, load

    parser = argparse.ArgumentParser(description="Capture an attention trace of a local VLM")
    parser.add_argument("--model", required=True, help="local model directory")
    parser.add_argument("--image", action="append", default=[], help="image file (repeat for several)")
    parser.add_argument("--video", action="append", default=[],
                        help="video file or directory of frame images (repeat for several)")
    parser.add_argument("--frames", type=int, default=8, help="frames sampled from each video (default 8)")
    parser.add_argument("--fps", type=float, default=None,
                        help="sample videos at this rate, at most --frames (default: --frames spread evenly)")
    parser.add_argument("--prompt", required=True, help="prompt with one placeholder per image and per video")
    parser.add_argument("--out", required=True, help="trace file to write (.safetensors)")
    parser.add_argument("--decode-steps", type=int, default=16, help="generated tokens recorded (default 16)")
    parser.add_argument("--progress", action="store_true",
                        help="say each stage on stderr as it starts, as 'progress: ...' lines (workbench logs them)")
    opts = parser.parse_args(argv)

    def progress(message: str) -> None:
        if opts.progress:
            print(f"progress: {message}", file=sys.stderr, flush=True)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # no progress bars or backend notes between the user and the answer
    hf_logging.disable_progress_bar()
    from kernels_py import runtime

    if unusable := runtime.unusable_device():  # before the model loads, which takes a while
        print(f"trace capture: {unusable}", file=sys.stderr)
        return 2
    try:
        from kernels_py.models.video import load_video

        if not opts.image and not opts.video:
            raise ModelError("give at least one --image or --video")
        if opts.video:
            progress(f"sampling {len(opts.video)} video(s), {opts.frames} frames each at most")
        videos = [load_video(v, opts.frames, opts.fps) for v in opts.video]
        progress(f"loading the model from {opts.model} on {runtime.device()}")
        vlm = load(opts.model, device=runtime.device())
        progress(f"running the prompt and {opts.decode_steps + 1} greedy tokens with the full cache")
        tensors, meta = capture(vlm, opts.image, opts.prompt, opts.decode_steps, videos)
    except (ModelError, ValueError) as err:
        print(f"trace capture: {err}", file=sys.stderr)
        return 2
    progress(f"writing {opts.out}")
    try:
        save(opts.out, tensors, meta)
    except Exception as err:  # noqa: BLE001 - OSError, or safetensors' own error for an I/O failure
        print(f"trace capture: cannot write {opts.out}: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"out": opts.out, "layers": meta["model"]["layers"], "prompt_tokens": meta["prompt_tokens"],
                      "decode_steps": meta["decode_steps"], "videos": meta["videos"],
                      "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
