"""NVIDIA kvpress presses inside a loaded VLM: the text-LM baselines next to
this project's methods, on the same model, prompt and metrics.

A press compresses transformers' own DynamicCache once the prompt has been
prefilled, from a forward hook on each attention layer of the language
model (kvpress's design). kvpress 0.5.5 drives text LMs (model.model.layers,
or model.model.language_model.layers) and reads the attention layer's
`cache_position`, which transformers 5.x no longer passes: `applied` hooks
the language model of any supported VLM and supplies it. Generation then
runs the model's own attention over the cache the press left, so the bytes
counted are what the cache really holds: a press that only masks entries
(head-wise ones, through kvpress's attention patch) keeps every tensor, and
the bytes say so.
"""

import dataclasses
import inspect
import types
import typing
from contextlib import contextmanager

import torch

from kernels_py.params import closest


class PressError(ValueError):
    """A press name, parameter or model the kvpress path cannot use."""


def kvpress():
    """The kvpress module, or a PressError saying how to get it."""
    try:
        import kvpress as module
    except ImportError as err:
        raise PressError(f"kvpress is not installed in this Python ({err}); the managed runtime has it "
                         f"(uv.lock), or install kvpress==0.5.5 next to --python's interpreter") from None
    return module


def version() -> str:
    from importlib.metadata import version as dist_version

    return dist_version("kvpress")


# press="none": transformers' cache as it is, the baseline the presses are measured against.
NO_PRESS = "none"

# The parameter through which a press wraps others (inner_press names them).
WRAPPING = ("press", "base_press", "presses")


def _wrapping(cls) -> str | None:
    params = inspect.signature(cls).parameters
    return next((p for p in WRAPPING if p in params), None)


def press_classes() -> dict:
    """Every concrete press kvpress exports, by name."""
    module = kvpress()
    out = {}
    for name in getattr(module, "__all__", dir(module)):
        cls = getattr(module, name, None)
        if isinstance(cls, type) and issubclass(cls, module.BasePress) and name not in ("BasePress", "ScorerPress") \
                and not inspect.isabstract(cls):
            out[name] = cls
    return dict(sorted(out.items()))


def parameters(cls) -> dict[str, object]:
    """A press's constructor parameters and their defaults (required ones: inspect.Parameter.empty)."""
    return {name: p.default for name, p in inspect.signature(cls).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def describe() -> str:
    """One line per press: its name and parameters with defaults (for `workbench methods kvpress`)."""
    lines = []
    for name, cls in press_classes().items():
        params = ", ".join(f"{k}" if v is inspect.Parameter.empty else f"{k}={v!r}"
                           for k, v in parameters(cls).items())
        lines.append(f"{name}({params})")
    return "; ".join(lines)


# The annotations press_args can give a value of (parse_args reads each), by the schema's type names.
_SCALARS = {int: "int", float: "float", bool: "bool", str: "str"}


def _type(hint) -> tuple[str, bool]:
    """(the schema's name of a parameter's annotation, whether it takes None): "int", "float", "bool", "str",
    or "ints", "floats", ... for a list of one of them; "" for any other (a press, a Literal, a union of
    several), which plan leaves unchecked."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (_type(rest[0])[0] if len(rest) == 1 else ""), True
    if hint in _SCALARS:
        return _SCALARS[hint], False
    if typing.get_origin(hint) is list and len(args) == 1 and args[0] in _SCALARS:
        return _SCALARS[args[0]] + "s", False
    return "", False


def types_of(cls) -> tuple[dict[str, str], list[str]]:
    """({parameter: its type} for the parameters whose type plan checks (_type), those of them that take
    None: Optional, or None by default)."""
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: nothing to check against
        return {}, []
    kinds, nullable = {}, []
    for name, default in parameters(cls).items():
        kind, takes_none = _type(hints.get(name))
        if kind:
            kinds[name] = kind
            if takes_none or default is None:
                nullable.append(name)
    return kinds, nullable


def schema() -> dict:
    """Every press's constructor for the schema the Go host reads, so that
    `workbench plan` refuses a press, press_args or inner_press that make()
    would, and a press_args value of the wrong type: {name: {"params":
    accepted names, "required": those without a default, "wraps": the
    parameter it wraps other presses through, or "", "types": {parameter:
    int, float, bool, str, ints, floats, bools or strs} for those whose
    annotation is one of them, "nullable": those of them that take none}}."""
    out = {}
    for name, cls in press_classes().items():
        accepted = parameters(cls)
        kinds, nullable = types_of(cls)
        out[name] = {"params": list(accepted),
                     "required": [k for k, v in accepted.items() if v is inspect.Parameter.empty],
                     "wraps": _wrapping(cls) or "", "types": kinds, "nullable": nullable}
    return out


def _value(raw: str) -> object:
    raw = raw.strip()
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    if raw.lower() == "none":
        return None
    for convert in (int, float):
        try:
            return convert(raw)
        except ValueError:
            pass
    return raw


def parse_args(text: str) -> dict:
    """press_args "a=1,b=x,c=true,d=0.5;0.25" as {"a": 1, "b": "x", "c": True, "d": [0.5, 0.25]}:
    pairs separated by commas, a list's items by semicolons. A name set twice
    is an error (one would silently win)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, raw = part.partition("=")
        if not eq or not key.strip():
            raise PressError(f"press_args {text!r}: want name=value pairs separated by commas, e.g. window_size=32 "
                             f"(a list: items separated by semicolons, e.g. compression_ratios=0.5;0.25)")
        if key.strip() in out:
            raise PressError(f"press_args {text!r} sets {key.strip()} twice: keep one")
        out[key.strip()] = [_value(v) for v in raw.split(";")] if ";" in raw else _value(raw)
    return out


def takes_ratio(name: str, inner: str = "") -> bool:
    """Whether compression_ratio reaches the press (or the presses it wraps)."""
    if name == NO_PRESS:
        return False
    classes = press_classes()
    cls = classes.get(name)
    if cls is None:
        return False
    if "compression_ratio" in parameters(cls):
        return True
    return bool(inner) and any(takes_ratio(n.strip()) for n in inner.split(",") if n.strip())


def make(name: str, compression_ratio: float, args: dict, inner: str = ""):
    """Build press `name` with its own parameters, checked against its
    constructor: an unknown press or parameter is a PressError naming what
    is accepted. compression_ratio goes to the press that takes it (the
    inner one of a wrapper press); args may not set it, nor the press a
    wrapper wraps (inner names it), since either would silently replace
    what the caller's knobs say (and the results record)."""
    if name == NO_PRESS:
        return None
    classes = press_classes()
    if name not in classes:
        raise PressError(f"unknown press {name!r}{closest(name, classes)}; kvpress {version()} has: "
                         f"{', '.join(classes)}")
    cls = classes[name]
    accepted = parameters(cls)
    unknown = sorted(set(args) - set(accepted))
    if unknown:
        raise PressError(f"{name} takes no parameter {unknown[0]!r}; it takes: "
                         f"{', '.join(accepted) or 'nothing'}")
    if "compression_ratio" in args:
        raise PressError(f"press_args: set compression_ratio with the kvpress method's compression_ratio knob "
                         f"(compression_ratio={args['compression_ratio']!r}), not in press_args")
    wrapping = _wrapping(cls)
    if wrapping == "presses" and wrapping in args:
        raise PressError(f"press_args: {name}'s presses are the presses it wraps: name them with inner_press (e.g. "
                         f"inner_press='SnapKVPress, KnormPress'), not in press_args")
    if wrapping in args:
        raise PressError(f"press_args: {name}'s {wrapping} is the press it wraps: name it with inner_press (e.g. "
                         f"inner_press='SnapKVPress'), not in press_args")
    kwargs = dict(args)
    if wrapping and inner:
        inner_presses = [make(n.strip(), compression_ratio, {}) for n in inner.split(",") if n.strip()]
        kwargs[wrapping] = inner_presses if wrapping == "presses" else inner_presses[0]
    elif wrapping and accepted[wrapping] is inspect.Parameter.empty:
        raise PressError(f"{name} wraps another press: name it with inner_press (e.g. inner_press='SnapKVPress'"
                         f"{'; several, comma-separated' if wrapping == 'presses' else ''})")
    elif inner and not wrapping:
        raise PressError(f"{name} wraps no press: inner_press={inner!r} does not apply")
    if "compression_ratio" in accepted and "compression_ratio" not in kwargs:
        kwargs["compression_ratio"] = compression_ratio
    missing = [k for k, v in accepted.items() if v is inspect.Parameter.empty and k not in kwargs]
    if missing:
        raise PressError(f"{name} needs {', '.join(missing)}: set them in press_args (a list: items separated by "
                         f"semicolons)")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError, AssertionError) as err:
        raise PressError(f"{name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}): {err}") from None


@contextmanager
def applied(press, model):
    """The press's hooks on every attention layer of model's language model,
    as kvpress's own context manager sets them, with the cache positions
    transformers 5.x no longer passes to the attention layer."""
    language = model.model.language_model if hasattr(model.model, "language_model") else model.model
    press.post_init_from_model(model)
    hooks = []

    def hook(module, args, kwargs, output):
        if "cache_position" not in kwargs:
            cache = kwargs["past_key_values"]
            tokens = kwargs["hidden_states"].shape[1]
            seen = cache.layers[module.layer_idx].get_seq_length()  # the new tokens included
            kwargs = {**kwargs, "cache_position": torch.arange(seen - tokens, seen, device=output[0].device)}
        return press.forward_hook(module, args, kwargs, output)

    try:
        for layer in language.layers:
            layer.self_attn.rotary_emb = language.rotary_emb
            hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
        yield
    finally:
        for h in hooks:
            h.remove()


# Our method equal by construction to a press, and its knobs from the press's settings: the same scores,
# window, pooling kernel and sinks, kept_count's rounding (kvpress's), and like every press it compresses the
# prompt once and keeps every generated token.
MATCHED = {
    "SnapKVPress": lambda budget, p: ("snapkv", {"budget": budget, "window": p["window_size"],
                                                 "kernel_size": p["kernel_size"], "pooling": "avg",
                                                 "evict_while_decoding": False}),
    "StreamingLLMPress": lambda budget, p: ("streamingllm", {"budget": budget, "sink_tokens": p["n_sink"],
                                                             "evict_while_decoding": False}),
}


def matched(press) -> tuple[str, dict] | None:
    """(method, params) of our method that keeps what `press` keeps, or None."""
    make = MATCHED.get(type(press).__name__)
    if make is None:
        return None
    settings = {f.name: getattr(press, f.name) for f in dataclasses.fields(press)}
    return make(1 - press.compression_ratio, settings)


@contextmanager
def recording_kept(press, kept: dict):
    """Fill kept[layer] with the prompt positions a scoring press keeps
    ([kv_heads, n], ascending): the top n_kept of its scores, as
    ScorerPress.compress picks them. Presses that pick otherwise (their own
    compress, e.g. PyramidKV's layer budgets, or wrappers) record nothing."""
    from kvpress.presses.scorer_press import ScorerPress
    from kvpress.utils import compute_n_kept

    if not isinstance(press, ScorerPress) or type(press).compress is not ScorerPress.compress:
        yield
        return
    score = press.score

    def recorded(module, hidden_states, keys, *args, **kwargs):
        scores = score(module, hidden_states, keys, *args, **kwargs)
        if press.compression_ratio > 0:
            n_kept = compute_n_kept(keys.shape[2], press.compression_ratio)
            kept[module.layer_idx] = scores[0].topk(n_kept, dim=-1).indices.sort(dim=-1).values.cpu()
        return scores

    press.score = recorded
    try:
        yield
    finally:
        del press.score  # the class's method again


def cache_bytes(cache) -> int:
    """Bytes the DynamicCache's tensors hold, every layer."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def generate(vlm, press, inputs: dict, max_new_tokens: int, force_tokens: list[int] | None = None,
             stop_tokens: frozenset[int] = frozenset(), stop_strings: tuple[str, ...] = ()):
    """Greedy decoding of one prompt with transformers' DynamicCache and the
    model's own attention, the press (None: none) compressing the cache after
    prefill: kernels_py.models.Generation, with the cache's bytes measured.
    stop_tokens: end once one is chosen (kept as the last token);
    stop_strings: end once the tokens decode to text holding one (as
    models.generate does)."""
    from transformers import DynamicCache

    from kernels_py.models.adapter import (
        ATTENTION, Generation, ModelError, StopStrings, _Memory, _clock, batch_spans,
    )

    if inputs["input_ids"].shape[0] != 1:
        raise ModelError("the kvpress path generates one prompt at a time")
    if press is not None and vlm.sliding_layers:
        # kvpress 0.5.5 prunes every layer's cache as if all were global: a sliding window's cache, already cut
        # to the window, breaks its shapes, and its scorers call a rotary embedding without the layer type.
        raise PressError(f"{type(press).__name__} cannot run on {vlm.family}: kvpress compresses every layer as a "
                         f"global one, and this model's layers {list(vlm.sliding_layers)} are sliding-window ones; "
                         f"use our methods, which hold the global layers only")
    model = vlm.model
    language = model.model.language_model
    if language.config._attn_implementation == ATTENTION:  # left by an interrupted vlkv generation
        language.set_attn_implementation("sdpa")
    spans = batch_spans(vlm, inputs)[0]
    kept = {}
    with torch.inference_mode():
        memory = _Memory(model.device)
        memory.reset()
        cache = DynamicCache(config=model.config)
        start = _clock(model.device)
        try:
            if press is None:
                out = model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
            else:
                with applied(press, model), recording_kept(press, kept):
                    out = model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
        except Exception as err:  # a press written for other models: whatever it raises, say which and go on
            reason = " ".join(str(err).split())[:300]
            raise PressError(f"{type(press).__name__} cannot run on {vlm.family} ({type(err).__name__}: {reason})") \
                from err
        prefill = _clock(model.device) - start
        logits = [out.logits[:, -1].float()]
        tokens = [logits[-1].argmax(-1)]
        del out
        peak = memory.peak()
        memory.reset()
        # A press shrinks the cache, and transformers would take the next position from its length: give the
        # positions the tokens really have (M-RoPE: the text position plus the prompt's rope delta).
        prompt = inputs["input_ids"].shape[1]
        deltas = getattr(model.model, "rope_deltas", None) if vlm.mrope else None
        strings = StopStrings(vlm.processor.tokenizer, stop_strings, 1) if any(stop_strings) else None
        start = _clock(model.device)
        for i in range(max_new_tokens - 1):
            if int(tokens[-1][0]) in stop_tokens or (strings is not None and bool(strings.seen(tokens[-1]).all())):
                break
            fed = tokens[-1] if force_tokens is None else torch.tensor([force_tokens[i]], device=model.device)
            position = torch.tensor([[prompt + i]], device=model.device)
            if deltas is not None:
                position = position + deltas.to(model.device)
            out = model(input_ids=fed[:, None].to(model.device), past_key_values=cache, use_cache=True,
                        position_ids=position)
            logits.append(out.logits[:, -1].float())
            tokens.append(logits[-1].argmax(-1))
        decode = _clock(model.device) - start
        decode_peak = memory.peak()
    layers = len(cache.layers)
    return Generation(torch.stack(tokens, dim=1)[0].tolist(), torch.stack(logits, dim=1)[0], cache_bytes(cache),
                      prefill, decode, spans, max(peak, decode_peak), decode_peak, memory.kind,
                      [kept[i] for i in range(layers)] if len(kept) == layers else None)


def press_dict(press) -> dict:
    """A press's settings, for the result rows."""
    if dataclasses.is_dataclass(press):
        return {f.name: repr(getattr(press, f.name)) for f in dataclasses.fields(press)}
    return {}
