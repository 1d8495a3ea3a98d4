"""ablation.run end to end on a small workload, as the scheduler calls it."""

import json
import math

import pytest
import torch

from kernels_py import ablation
from kernels_py.runtime import worker
from kernels_py.workloads import SyntheticConfig

WORKLOAD = dict(layers=3, heads=4, kv_heads=2, head_dim=32, tokens_per_image=144, system_tokens=8,
                text_tokens=24, decode_steps=5, salient_tokens=12, dense_layers=1)
METRICS = {
    "cache_bytes", "full_cache_bytes", "compression_ratio", "prefill_compression_ratio",
    "rel_err_mean", "rel_err_max", "rel_err_last_step", "cache_hit_rate", "ppci_90", "ppci_steps_50",
    "sparsity_mean", "prefill_kept_fraction",
}
PER_LAYER = {"rel_err", "sparsity", "post_vision_sparsity", "cache_hit_rate", "ppci_90", "ppci_steps_50",
             "cache_bytes", "prefill_kept_fraction"}


def test_report_shape_and_json(device):
    result = ablation.run("h2o", {"budget": 0.25}, WORKLOAD)
    assert set(result) == {"metrics", "per_layer"}
    assert set(result["metrics"]) == METRICS
    assert all(type(v) is float and math.isfinite(v) for v in result["metrics"].values())
    assert set(result["per_layer"]) == PER_LAYER
    for values in result["per_layer"].values():
        assert len(values) == WORKLOAD["layers"] and all(type(v) is float for v in values)
    # The worker sends it as is.
    assert json.loads(json.dumps(worker.jsonable(result))) == result


def test_full_is_its_own_reference():
    m = ablation.run("full", {}, WORKLOAD)["metrics"]
    assert m["rel_err_mean"] == m["rel_err_max"] == m["rel_err_last_step"] == 0.0
    assert m["cache_hit_rate"] == m["ppci_90"] == m["compression_ratio"] == 1.0
    # Between steps the ranking drifts a little (the workload's decode queries differ), never entirely.
    assert 0.3 < m["ppci_steps_50"] <= 1.0
    assert m["cache_bytes"] == m["full_cache_bytes"]


@pytest.mark.parametrize("method", ["h2o", "streamingllm", "snapkv"])
def test_compressing_methods_are_scored_sanely(method):
    result = ablation.run(method, {"budget": 0.25}, WORKLOAD)
    m, per_layer = result["metrics"], result["per_layer"]
    prompt = 8 + 144 + 24
    kept = int(prompt * 0.25)
    assert m["prefill_compression_ratio"] == pytest.approx(prompt / kept)
    # Evicting, the share of the tokens seen is held (up to one token's rounding); else generated tokens add up.
    assert 1.0 < m["compression_ratio"] <= m["prefill_compression_ratio"] * (1 + 1 / kept)
    assert m["cache_bytes"] == sum(per_layer["cache_bytes"]) < m["full_cache_bytes"]
    assert 0.0 < m["rel_err_mean"] <= m["rel_err_max"]
    assert m["rel_err_mean"] == pytest.approx(sum(per_layer["rel_err"]) / len(per_layer["rel_err"]))
    assert 0.0 < m["cache_hit_rate"] < 1.0 and 0.0 <= m["ppci_90"] < 1.0
    # ppci_90 can count only what is held: at most the kept share over 90%.
    assert m["ppci_90"] <= (kept + WORKLOAD["decode_steps"]) / (0.9 * 144) + 1e-9
    # Sparsity describes the workload, not the method: dense first layer, sparse rest.
    assert per_layer["sparsity"][0] < min(per_layer["sparsity"][1:])
    assert per_layer["post_vision_sparsity"][0] < min(per_layer["post_vision_sparsity"][1:])
    assert per_layer["prefill_kept_fraction"] == [kept / prompt] * WORKLOAD["layers"]


def test_method_layer_metrics_are_reported_per_layer_and_averaged():
    result = ablation.run("vlcache", {"budget": 0.25}, WORKLOAD)
    budgets = result["per_layer"]["layer_budget"]
    assert len(budgets) == WORKLOAD["layers"] and result["metrics"]["layer_budget"] == pytest.approx(sum(budgets) / 3)
    # vlcache's own estimate of post-vision sparsity (kernel path) is the ablation's reference one.
    assert result["per_layer"]["allocation_sparsity"] == pytest.approx(result["per_layer"]["post_vision_sparsity"],
                                                                       abs=1e-6)


def test_more_budget_less_error():
    errors = [ablation.run("h2o", {"budget": b}, WORKLOAD)["metrics"]["rel_err_mean"] for b in (0.2, 0.5, 1.0)]
    assert errors[0] > errors[1] > errors[2] == 0.0


def test_workload_is_generated_once_per_config():
    cfg = SyntheticConfig.from_dict(WORKLOAD)
    ablation.run("streamingllm", {}, WORKLOAD)
    assert ablation._reference(cfg) is ablation._reference(SyntheticConfig.from_dict(dict(WORKLOAD)))


@pytest.mark.parametrize(
    "method,params,workload,error,match",
    [
        ("lookn", {}, WORKLOAD, ValueError, "unknown method 'lookn'"),
        ("h2o", {"budget": 2.0}, WORKLOAD, ValueError, "above its maximum"),
        ("h2o", {"budget": "half"}, WORKLOAD, TypeError, "budget must be float"),
        ("h2o", {}, {**WORKLOAD, "frames": 2}, ValueError, "unknown parameter.*'frames'"),
        ("h2o", {}, {**WORKLOAD, "layers": "3"}, TypeError, "layers must be int"),
        ("h2o", {}, None, TypeError, "must be a mapping"),
    ],
)
def test_invalid_arguments_raise_clear_errors(method, params, workload, error, match):
    with pytest.raises(error, match=match):
        ablation.run(method, params, workload)


def test_runs_as_a_worker_job():
    job = {"fn": "kernels_py.ablation:run", "args": {"method": "snapkv", "params": {"window": 8}, "workload": WORKLOAD}}
    assert worker.run_job(job) == ablation.run("snapkv", {"window": 8}, WORKLOAD)


def test_returns_per_step_errors_by_reference_when_lent_scratch(tmp_path):
    import os

    import torch

    from kernels_py.runtime import arena

    size = 1 << 16
    with open(tmp_path / "arena", "w+b") as f:
        f.truncate(size)
        arena.map_arena(99, os.dup(f.fileno()), size)
    try:
        with arena.scratch({"arena": 99, "offset": 0, "size": size}):
            report = ablation.run("h2o", {"budget": 0.3}, WORKLOAD)
            encoded = worker.jsonable(report)
        desc = encoded["tensors"]["rel_err"]["__tensor__"]
        steps = SyntheticConfig.from_dict(WORKLOAD).decode_steps
        assert desc["arena"] == 99 and desc["shape"] == [WORKLOAD["layers"], steps]
        values = torch.from_dlpack(arena.ArenaTensor(desc))
        assert math.isclose(values.double().mean().item(), report["metrics"]["rel_err_mean"], rel_tol=1e-5)
        # Without a scratch region the report carries no tensors.
        assert "tensors" not in ablation.run("h2o", {"budget": 0.3}, WORKLOAD)
    finally:
        import gc

        del report, values
        gc.collect()
        arena.unmap_arena(99)


def test_workloads_are_picked_by_name():
    assert ablation.run("full", {}, WORKLOAD, "synthetic") == ablation.run("full", {}, WORKLOAD)
    with pytest.raises(ValueError, match="unknown workload 'synthetc' \\(did you mean 'synthetic'\\?\\)"):
        ablation.run("full", {}, WORKLOAD, "synthetc")


def test_ppci_between_steps_follows_a_eq2_by_hand():
    """ppci_steps_50: the method's ranking of the visual tokens at each step
    against the first step's, 50% PPCI (A-VL Eq. 2, Figure 5)."""
    from kernels_py import metrics

    first = torch.tensor([[4.0, 3.0, 2.0, 1.0]])  # top 2: tokens 0, 1
    later = torch.tensor([[4.0, 1.0, 3.0, 2.0]])  # top 2: tokens 0, 2 -> shares one of two
    assert metrics.ppci(first, later, 0.5, later > float("-inf")).item() == 0.5
    evicted = torch.tensor([[float("-inf"), 3.0, 2.0, 1.0]])  # token 0 no longer held: top 2 of the rest 1, 2
    assert metrics.ppci(first, evicted, 0.5, evicted > float("-inf")).item() == 0.5
    # StreamingLLM's sinks and recent window hold no image token: nothing to rank, nan.
    result = ablation.run("streamingllm", {"budget": 0.1}, WORKLOAD)
    assert math.isnan(result["metrics"]["ppci_steps_50"])
    assert len(result["per_layer"]["ppci_steps_50"]) == WORKLOAD["layers"]
    # Scored over the image tokens held at the first step: SnapKV holds its prompt tokens to the end (prefill only),
    # so its ranking of them is what moves, not how many it holds (at 10% it held under half and read at most 0.2).
    snap = ablation.run("snapkv", {"budget": 0.1, "window": 8}, WORKLOAD)["metrics"]["ppci_steps_50"]
    assert 0.5 < snap <= 1.0


def test_a_prompt_that_ends_in_an_image_has_no_post_vision_rows_and_still_runs():
    """A trace whose prompt ends in a visual token (or has no image) has no
    post-vision rows: its post_vision_sparsity is nan, and the job runs."""
    import dataclasses

    base = SyntheticConfig(**WORKLOAD)

    @dataclasses.dataclass(frozen=True)
    class EndsInAnImage:
        def build(self):
            w = base.build()
            spans = w.spans
            ends = dataclasses.replace(spans, images=(*spans.images[:-1], (spans.images[-1][0], spans.text[1])),
                                       text=(spans.text[1], spans.text[1]))
            return dataclasses.replace(w, spans=ends)

    reference = ablation._reference(EndsInAnImage())
    assert all(math.isnan(s) for s in reference.post_vision_sparsity)
    assert all(0 < s < 1 for s in reference.sparsity)
