"""Job entry point for ablations: one method on one registered workload,
scored against the full cache.

The scheduler calls `run(method, params, workload, workload_name)` (job fn
`kernels_py.ablation:run`). The workload and the full-cache reference depend
only on the workload config, so they are cached per config in the worker
process: a grid of methods over one workload generates it once.
"""

import functools
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from kernels_py import metrics
from kernels_py.attention import expand_kv
from kernels_py.methods import METHODS, Method, make_method
from kernels_py.methods.prompt import PostVisionRows
from kernels_py.runtime import arena
from kernels_py.workloads import DEFAULT_WORKLOAD, WORKLOADS, Workload, WorkloadConfig, make_workload

REFERENCE_METHOD = "full"
PPCI_P = 0.9
PPCI_STEPS_P = 0.5  # A-VL Figure 5's continuity across steps
CACHED_WORKLOADS = 4


@dataclass
class Trace:
    """What one method did on one workload."""

    outputs: list[list[torch.Tensor]]  # [layer][step] attention output [heads, 1, d]
    prefill_bytes: list[int]  # per layer, right after prefill
    final_bytes: list[int]  # per layer, after the last step
    prefill_kept: list[torch.Tensor]  # per layer [kv_heads, k] prompt positions kept by prefill
    ppci: list[list[float]]  # [layer][step]
    ppci_steps: list[list[float]]  # [layer][step >= 1]: the held ranking at each step against the first step's
    layer_metrics: list[dict[str, float]]  # per layer, Method.layer_metrics after the last step


@dataclass
class Reference:
    """The workload and everything about it that does not depend on the method."""

    workload: Workload
    trace: Trace  # of the full cache
    first_step_attention: list[torch.Tensor]  # per layer [heads, T]: A_{m+1} of VL-Cache Def. 3.1
    sparsity: list[float]  # per layer, VL-Cache gamma of the prefill attention
    post_vision_sparsity: list[float]  # per layer, gamma over the post-vision rows only (Algorithm 1's estimate)


def run(method: str, params: Mapping[str, Any], workload: Mapping[str, Any],
        workload_name: str = DEFAULT_WORKLOAD, planned_defaults: Mapping[str, Mapping] | None = None) -> dict:
    """Run `method` with `params` over the registered workload `workload_name`
    with knobs `workload` and score it against the full cache.
    planned_defaults ({"method": {knob: default}, "workload": {...},
    "protocol": {"name": P, "sets": {knob: value}}}, from the host's
    schema.json, which filled in the knobs a script left unset): a job
    planned from a stale schema.json is refused (StaleSchema).

    Returns {"metrics": {name: float}, "per_layer": {name: [float per layer]}},
    plus {"tensors": {"rel_err": [layers, steps] float32}} in the job's scratch
    region when the host lent one:
      cache_bytes, full_cache_bytes  K/V bytes held after the last step, all layers
      compression_ratio              full_cache_bytes / cache_bytes (prefill_...: right after prefill)
      rel_err_mean, rel_err_max      ||o - o_full|| / ||o_full|| over layers and decode steps
      rel_err_last_step              its mean over layers at the last step
      cache_hit_rate                 VL-Cache Def. 3.1 for the prompt tokens kept at prefill, k = tokens kept,
                                     against the first decode query; mean over layers and query heads
      ppci_90                        A-VL 90% PPCI over the image tokens between the full-cache ranking and
                                     the ranking of the tokens held, each step; mean over layers, steps, heads
      ppci_steps_50                  A-VL 50% PPCI between steps (Figure 5): of the image tokens the method
                                     held at the first step, its top 50% then against its top 50% of them at
                                     each later step (tokens it no longer holds rank last); mean over layers,
                                     steps, heads holding any (nan where none does: StreamingLLM's window past
                                     the image)
      sparsity_mean                  VL-Cache gamma (p = 1%) of the prefill attention, mean over layers
      prefill_kept_fraction          prompt tokens kept by prefill / prompt tokens, mean over layers
      <method metrics>               what Method.layer_metrics reports (e.g. vlcache's layer_budget), layer mean
      token_agreement, kl_mean, kl_max, model_cache_bytes, model_compression_ratio, prefill_seconds, decode_seconds,
      peak_gpu_bytes, peak_cpu_bytes, decode_peak_bytes
                                     on a "vlm" workload only: the method run inside the model (see _in_model)
    per_layer: rel_err (mean over steps), sparsity, post_vision_sparsity (gamma over the rows after the
    last visual token), cache_hit_rate, ppci_90, cache_bytes, prefill_kept_fraction, and the method's metrics.
    per_step (a "vlm" workload only): tokens (the method's greedy token each step, fed the full cache's),
    reference_tokens (the full cache's), kl.
    On an "lmms" workload (a benchmark) the method is scored on an lmms-eval task instead: the
    task's own metrics, bytes held and times, and per-document answers and scores under "extra"
    (kernels_py.workloads.lmms.evaluate).
    Raises ValueError / TypeError on unknown or invalid methods, workloads and parameters.
    """
    if planned_defaults:
        _check_planned_defaults(method, params, workload_name, workload, planned_defaults)
    chosen = make_method(method, params)
    config = make_workload(workload_name, workload)
    if hasattr(config, "evaluate"):  # a benchmark (workload "lmms"): the task's own metrics, in the model
        return config.evaluate(chosen)
    if getattr(chosen, "in_model_only", False):  # a kvpress press: only inside the model
        if not hasattr(config, "image_list"):
            raise ValueError(f"method {method!r} runs inside a model: give it workload(\"vlm\", model=..., images=..., "
                             f"prompt=...), not {workload_name!r}")
        metrics, per_step, pair = _in_model(config, chosen)
        return {"metrics": metrics, "per_layer": pair.pop("per_layer", {}), "per_step": per_step, "extra": pair}
    reference = _reference(config)
    trace = _trace(chosen, reference.workload)
    report = _report(trace, reference)
    if hasattr(config, "image_list"):  # a live model: the method also runs inside it
        metrics, report["per_step"], _ = _in_model(config, chosen)
        report["metrics"].update(metrics)
    return report


def _check_planned_defaults(method: str, params: Mapping[str, Any], workload_name: str,
                            workload: Mapping[str, Any], planned: Mapping[str, Mapping]) -> None:
    """The host's defaults for the job's method and workload are the sources'
    where the job holds them (Knobs.check_planned_defaults); unknown names
    are make_method's and make_workload's to report."""
    for cls, key, values in ((METHODS.get(method), "method", params),
                             (WORKLOADS.get(workload_name), "workload", workload)):
        if cls is not None and key in planned:
            cls.check_planned_defaults(planned[key], values if isinstance(values, Mapping) else None)
    protocol = planned.get("protocol")
    if method in METHODS and isinstance(protocol, Mapping) and isinstance(params, Mapping):
        METHODS[method].check_planned_protocol(protocol.get("name", ""), protocol.get("sets") or {}, params)


def _full_generation(config):
    """The model, its inputs and the full cache's generation, once per
    workload (the last CACHED_WORKLOADS of a model). They are kept on the
    model (VLM.derived), not here: they go when the worker's loader lets the
    model go, and never keep a model alive that it let go."""
    from kernels_py import models

    vlm = config.load()
    held = vlm.derived.setdefault("full_generation", {})
    if config not in held:
        while len(held) >= CACHED_WORKLOADS:
            del held[next(iter(held))]  # the oldest
        inputs = models.prompt_inputs(vlm, config.image_list(), config.prompt, config.video_list())
        held[config] = inputs, models.generate(vlm, make_method(REFERENCE_METHOD, {}), inputs,
                                               config.decode_steps + 1)
    inputs, full = held[config]
    return vlm, inputs, full


def _in_model(config, method) -> tuple[dict[str, float], dict[str, list]]:
    """The method inside the model, fed the full cache's tokens: token_agreement
    (share of steps whose greedy token is the full cache's), kl_mean / kl_max of
    the next-token distributions, model_cache_bytes (all layers after the last
    step) and model_compression_ratio (the full cache's bytes in the model
    over it), prefill_seconds, decode_seconds; memory above what was in use
    before the generation (the weights): peak_gpu_bytes (the CUDA allocator's peak
    over the generation; nan on a CPU), peak_cpu_bytes (the resident set's
    peak, Linux; nan on a GPU), decode_peak_bytes (the same over the decode
    steps alone: the caches and one step's work, which falls when a method
    evicts; the prefill peak holds every layer's Q/K/V for any method). Per
    step: the method's greedy tokens, the full cache's, and the KL. A press
    that one of our methods matches by construction (presses.matched) runs
    beside it: pair_jaccard_mean / _min (the kept prompt positions' overlap
    over layers and kv heads; per layer and head in per_layer), and
    pair_token_agreement (share of steps both pick the same token); the third
    value names the pair ({"pair_method", "pair_params"}; "pair_unavailable"
    says why when the press's settings are outside our method's; empty
    when no method matches or the press compresses nothing)."""
    from kernels_py import models

    vlm, inputs, full = _full_generation(config)
    extra, pair = {}, {}
    if getattr(method, "in_model_only", False):  # a press: transformers' own cache, compressed by the press
        from kernels_py.models import presses

        press = method.make_press()
        got = presses.generate(vlm, press, inputs, config.decode_steps + 1, force_tokens=full.tokens)
        extra, pair = _paired(vlm, inputs, press, got, full.tokens, config.decode_steps + 1)
        # What the press left in the cache against what the full cache holds: a press that masks frees nothing.
        extra |= {"full_cache_bytes": float(full.cache_bytes), "compression_ratio": full.cache_bytes / got.cache_bytes,
                 "kvpress_version": presses.version(),
                 # a press without a compression_ratio (ThinK, DuoAttention, ...) ignores the knob: say so
                 "kvpress_ratio_applied": float(presses.takes_ratio(method.press, method.inner_press))}
    else:
        got = models.generate(vlm, method, inputs, config.decode_steps + 1, force_tokens=full.tokens)
    scores = models.compare(full, got)
    nan = float("nan")
    return {**extra, "token_agreement": scores["token_agreement"], "kl_mean": scores["kl_mean"],
            "kl_max": max(scores["kl_per_step"]), "model_cache_bytes": float(got.cache_bytes),
            # The whole cache's ratio as the model holds it: compression_ratio of a method row is the replayed
            # layers' (on Gemma 3 the global ones, without the sliding windows).
            "model_compression_ratio": metrics.compression_ratio(full.cache_bytes, got.cache_bytes),
            "prefill_seconds": got.prefill_seconds, "decode_seconds": got.decode_seconds,
            "peak_gpu_bytes": got.peak_bytes if got.memory_kind == "cuda" else nan,
            "peak_cpu_bytes": got.peak_bytes if got.memory_kind == "cpu-rss" else nan,
            "decode_peak_bytes": got.decode_peak_bytes}, \
        {"tokens": got.tokens, "reference_tokens": full.tokens, "kl": scores["kl_per_step"]}, pair


def _paired(vlm, inputs, press, got, force_tokens, steps) -> tuple[dict, dict]:
    """The press's matched method (presses.matched) run the same way, and how
    alike the two are: metrics, and the pair's name, params and per-layer
    Jaccard. Nothing for a press no method matches."""
    from kernels_py import models
    from kernels_py.models import presses

    match = presses.matched(press)
    if match is None or press.compression_ratio == 0:  # no pair, or nothing compressed to compare
        return {}, {}
    name, params = match
    try:
        method = make_method(name, params)
    except (ValueError, TypeError) as err:  # the press's settings are outside our method's (an even kernel_size)
        return {}, {"pair_method": name, "pair_unavailable": str(err)}
    ours = models.generate(vlm, method, inputs, steps, force_tokens=force_tokens)
    if got.kept is None or ours.kept is None:
        raise RuntimeError(f"{type(press).__name__} and {name} should both report the prompt tokens they keep")
    overlap = metrics.kept_jaccard(got.kept, ours.kept)
    flat = [x for layer in overlap for x in layer]
    same = sum(a == b for a, b in zip(got.tokens, ours.tokens)) / len(got.tokens)
    return ({"pair_jaccard_mean": sum(flat) / len(flat), "pair_jaccard_min": min(flat), "pair_token_agreement": same},
            {"pair_method": name, "pair_params": params, "per_layer": {"pair_jaccard": overlap}})


@functools.lru_cache(maxsize=CACHED_WORKLOADS)
def _reference(cfg: WorkloadConfig) -> Reference:
    workload = cfg.build()
    first_step_attention, sparsity, post_vision_sparsity = [], [], []
    spans = workload.spans
    # A diagnostic: a prompt with no image, or one ending in a visual token, has no post-vision rows (nan).
    post_vision = PostVisionRows().positions(spans.prompt_tokens, spans) \
        if spans.images and max(end for _, end in spans.images) < spans.prompt_tokens else None
    for layer in range(workload.layers):
        q, k = workload.q[layer], workload.k[layer]
        first_q = workload.decode_q[layer][0]
        first_step_attention.append(metrics.causal_attention(first_q, k, query_start=k.shape[1])[:, 0])
        if q.shape[0] * q.shape[1] * k.shape[1] > metrics.WHOLE_ATTENTION_ENTRIES:  # a video-length prompt
            sparsity.append(metrics.causal_sparsity(q, k).mean().item())
            post_vision_sparsity.append(float("nan") if post_vision is None else metrics.causal_sparsity(
                q[:, post_vision.to(q.device)], k, int(post_vision[0])).mean().item())
            continue
        attention = metrics.causal_attention(q, k)
        sparsity.append(metrics.layer_sparsity(attention).mean().item())
        post_vision_sparsity.append(float("nan") if post_vision is None else metrics.layer_sparsity(
            attention[:, post_vision], query_start=int(post_vision[0])).mean().item())
    return Reference(workload, _trace(make_method(REFERENCE_METHOD), workload), first_step_attention, sparsity,
                     post_vision_sparsity)


def _trace(method: Method, workload: Workload) -> Trace:
    trace = Trace([], [], [], [], [], [], [])
    visual = workload.spans.visual_positions().to(workload.positions.device)
    caches = method.prefill_all(workload.q, workload.k, workload.v, workload.spans)
    for layer, cache in enumerate(caches):
        trace.prefill_bytes.append(method.cache_bytes(cache))
        trace.prefill_kept.append(cache.positions.clone())
        outputs, ppci, ppci_steps, first = [], [], [], None
        for step in range(workload.decode_steps):
            q_t = workload.decode_q[layer][step]
            held = _held_visual_logits(q_t, cache, visual)
            ppci.append(_visual_ppci(q_t, held, workload.k[layer], visual))
            if first is None:
                first = held
            else:
                # Over the image tokens held at the first step (a method holding few is scored on those few);
                # heads holding none are left out.
                ppci_steps.append(metrics.ppci(first, held, PPCI_STEPS_P, held > float("-inf"),
                                               first > float("-inf")).nanmean().item())
            k_t, v_t = workload.decode_k[layer][step], workload.decode_v[layer][step]
            outputs.append(method.decode(layer, cache, q_t, k_t, v_t))
        trace.outputs.append(outputs)
        trace.ppci.append(ppci)
        trace.ppci_steps.append(ppci_steps)
        trace.final_bytes.append(method.cache_bytes(cache))
        trace.layer_metrics.append(method.layer_metrics(layer, cache))
    return trace


def _held_visual_logits(q_t: torch.Tensor, cache, visual: torch.Tensor) -> torch.Tensor:
    """[heads, visual tokens]: the decode query's logits over the visual
    tokens the method holds when the step starts, -inf for the others. Logits
    stand in for attention scores: softmax keeps each row's ranking. A
    compressed cache reconstructs the keys it holds for this (its `keys`)."""
    heads = q_t.shape[0]
    by_position = torch.full((heads, cache.seen), float("-inf"), device=q_t.device)
    by_position.scatter_(1, expand_kv(cache.positions, heads), _logits(q_t, cache.keys))
    return by_position[:, visual]


def _visual_ppci(q_t: torch.Tensor, held_logits: torch.Tensor, prompt_keys: torch.Tensor,
                 visual: torch.Tensor) -> float:
    """A-VL 90% PPCI over the image tokens, mean over query heads: the decode
    query's ranking of visual tokens under the full cache against its ranking
    of the visual tokens the method holds (held_logits)."""
    full_logits = _logits(q_t, prompt_keys)[:, visual]
    return metrics.ppci(full_logits, held_logits, PPCI_P, held_logits > float("-inf")).mean().item()


def _logits(q_t: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[heads, n] unscaled logits of one query token over held keys (GQA)."""
    return (q_t.float() @ expand_kv(keys.float(), q_t.shape[0]).transpose(1, 2))[:, 0]


def _report(trace: Trace, reference: Reference) -> dict:
    full = reference.trace
    errors = torch.tensor(
        [[metrics.relative_error(o, r) for o, r in zip(mine, ref)] for mine, ref in zip(trace.outputs, full.outputs)],
        dtype=torch.float64,
    )  # [layers, steps]
    hit_rates = [_hit_rate(kept, truth) for kept, truth in zip(trace.prefill_kept, reference.first_step_attention)]
    ppci = torch.tensor(trace.ppci, dtype=torch.float64)
    # One decode step has no second step to compare: nan, as the column says.
    ppci_steps = torch.tensor(trace.ppci_steps, dtype=torch.float64) if trace.ppci_steps[0] else \
        torch.full((len(trace.ppci_steps), 1), float("nan"), dtype=torch.float64)
    prompt = reference.workload.spans.prompt_tokens
    per_layer = {
        "rel_err": errors.mean(dim=1).tolist(),
        "sparsity": list(reference.sparsity),
        "post_vision_sparsity": list(reference.post_vision_sparsity),
        "cache_hit_rate": hit_rates,
        "ppci_90": ppci.mean(dim=1).tolist(),
        "ppci_steps_50": ppci_steps.nanmean(dim=1).tolist(),
        "cache_bytes": [float(b) for b in trace.final_bytes],
        "prefill_kept_fraction": [kept.shape[1] / prompt for kept in trace.prefill_kept],
    }
    method_metrics = sorted({name for layer in trace.layer_metrics for name in layer})
    cache_bytes, full_bytes = sum(trace.final_bytes), sum(full.final_bytes)
    scalars = {
        "cache_bytes": float(cache_bytes),
        "full_cache_bytes": float(full_bytes),
        "compression_ratio": metrics.compression_ratio(full_bytes, cache_bytes),
        "prefill_compression_ratio": metrics.compression_ratio(sum(full.prefill_bytes), sum(trace.prefill_bytes)),
        "rel_err_mean": errors.mean().item(),
        "rel_err_max": errors.max().item(),
        "rel_err_last_step": errors[:, -1].mean().item(),
        "cache_hit_rate": sum(hit_rates) / len(hit_rates),
        "ppci_90": ppci.mean().item(),
        "ppci_steps_50": ppci_steps.nanmean().item(),
        "sparsity_mean": sum(reference.sparsity) / len(reference.sparsity),
        "prefill_kept_fraction": sum(per_layer["prefill_kept_fraction"]) / len(trace.prefill_kept),
    }
    for name in method_metrics:
        if name in per_layer or name in scalars:
            raise ValueError(f"method layer metric {name!r} clashes with a metric the ablation reports")
        per_layer[name] = [float(layer.get(name, float("nan"))) for layer in trace.layer_metrics]
        scalars[name] = sum(per_layer[name]) / len(per_layer[name])
    report = {"metrics": scalars, "per_layer": per_layer}
    if arena.has_scratch():  # the host saves these as tensors/<job>/<name>.npy
        rel_err = arena.empty(errors.shape, torch.float32)
        rel_err.copy_(errors)
        report["tensors"] = {"rel_err": rel_err}
    return report


def _hit_rate(kept: torch.Tensor, first_step_attention: torch.Tensor) -> float:
    """VL-Cache CacheHitRate of the tokens kept at prefill, mean over query heads."""
    return metrics.cache_hit_rate(expand_kv(kept, first_step_attention.shape[0]), first_step_attention).mean().item()
