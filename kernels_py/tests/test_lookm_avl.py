"""LOOK-M's merges checked against Eq. 10-12 by hand, its text-prior
eviction, A-VL's core / secondary / minor tokens, update steps, text window
and stored vs used cache, and clear errors for their parameters."""

import math

import pytest
import torch

from kernels_py import ablation
from kernels_py.methods import make_method
from kernels_py.methods.merging import merge, nearest
from kernels_py.workloads import SyntheticConfig, generate

CFG = dict(layers=4, heads=4, kv_heads=2, head_dim=32, tokens_per_image=64, system_tokens=8, text_tokens=16,
           decode_steps=7, salient_tokens=8, dtype="float32")  # exact arithmetic
PROMPT = 8 + 64 + 16


@pytest.fixture(scope="module")
def workload():
    return generate(SyntheticConfig(**CFG))


# --- merging, by hand ----------------------------------------------------------------------------

KEPT_K = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # two kept tokens, one kv head
KEPT_V = torch.tensor([[[10.0, 0.0], [0.0, 10.0]]])
EVICTED_K = torch.tensor([[[2.0, 0.0], [3.0, 4.0], [0.0, -1.0]]])  # cos to kept: (1, 0), (0.6, 0.8), (0, -1)
EVICTED_V = torch.tensor([[[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]])


def test_nearest_kept_token_by_cosine_and_blocked():
    index, sim = nearest(EVICTED_K, KEPT_K)
    # Evicted 0 -> kept 0 (cos 1); evicted 1 -> kept 1 (0.8 > 0.6); evicted 2 -> kept 0 (0 > -1).
    assert index.tolist() == [[0, 1, 0]]
    torch.testing.assert_close(sim, torch.tensor([[1.0, 0.8, 0.0]]))
    g = torch.Generator().manual_seed(0)
    e, c = torch.randn(2, 50, 8, generator=g), torch.randn(2, 37, 8, generator=g)
    whole = nearest(e, c, block=1 << 20)
    tiled = nearest(e, c, block=16)  # several tiles each way
    assert torch.equal(whole[0], tiled[0]) and torch.allclose(whole[1], tiled[1])


def test_averaged_merge_is_eq_10():
    k, v = merge(KEPT_K, KEPT_V, EVICTED_K, EVICTED_V, "averaged")
    # kept 0 takes evicted 0 and 2 (L = 2), kept 1 takes evicted 1 (L = 1).
    torch.testing.assert_close(k, torch.tensor([[[(1 + 2 + 0) / 3, (0 + 0 - 1) / 3], [(0 + 3) / 2, (1 + 4) / 2]]]))
    torch.testing.assert_close(v, torch.tensor([[[(10 + 1 + 3) / 3, (0 + 1 + 3) / 3], [(0 + 2) / 2, (10 + 2) / 2]]]))


def test_pivotal_merge_is_eq_11():
    k, v = merge(KEPT_K, KEPT_V, EVICTED_K, EVICTED_V, "pivotal")
    # k_c <- (k_c + 1/2 sum_i (k_i + k_c)) / (L + 1)
    k0 = (torch.tensor([1.0, 0.0]) + 0.5 * ((torch.tensor([2.0, 0.0]) + torch.tensor([1.0, 0.0]))
                                            + (torch.tensor([0.0, -1.0]) + torch.tensor([1.0, 0.0])))) / 3
    k1 = (torch.tensor([0.0, 1.0]) + 0.5 * (torch.tensor([3.0, 4.0]) + torch.tensor([0.0, 1.0]))) / 2
    v0 = (torch.tensor([10.0, 0.0]) + 0.5 * ((torch.tensor([1.0, 1.0]) + torch.tensor([10.0, 0.0]))
                                             + (torch.tensor([3.0, 3.0]) + torch.tensor([10.0, 0.0])))) / 3
    torch.testing.assert_close(k[0], torch.stack([k0, k1]))
    torch.testing.assert_close(v[0, 0], v0)


def test_weighted_merge_is_eq_12_with_the_keys_similarity_on_values():
    k, v = merge(KEPT_K, KEPT_V, EVICTED_K, EVICTED_V, "weighted")
    # weights: evicted 0 -> 1.0, evicted 1 -> 0.8, evicted 2 -> 0.0; normalised by L + 1 (Eq. 12)
    torch.testing.assert_close(k[0], torch.tensor([[(1 + 2 * 1.0) / 3, 0.0], [3 * 0.8 / 2, (1 + 4 * 0.8) / 2]]))
    torch.testing.assert_close(v[0], torch.tensor([[(10 + 1.0) / 3, 1.0 / 3], [2 * 0.8 / 2, (10 + 2 * 0.8) / 2]]))


# --- LOOK-M ---------------------------------------------------------------------------------------

def test_lookm_keeps_the_recent_window_and_text_first(workload):
    method = make_method("lookm", {"recent_ratio": 0.1, "important_ratio": 0.3, "merge": "none"})
    cache = method.prefill(0, workload.q[0], workload.k[0], workload.v[0], workload.spans)
    recent, capacity = int(PROMPT * 0.1), int(PROMPT * (0.1 + 0.3))  # alpha_1 + alpha_2 rounded once
    assert cache.tokens == capacity
    text = set(range(8)) | set(range(72, PROMPT))
    for h in range(2):
        held = set(cache.positions[h].tolist())
        assert set(range(PROMPT - recent, PROMPT)) <= held  # the recent window
        assert text <= held  # text ranks above every image token (Eq. 5) and fits in alpha_2
    assert method.layer_metrics(0, cache)["evicted_text"] == 0
    # Merging changes the kept rows, not which rows are kept.
    merged = make_method("lookm", {"recent_ratio": 0.1, "important_ratio": 0.3, "merge": "pivotal"})
    m_cache = merged.prefill(0, workload.q[0], workload.k[0], workload.v[0], workload.spans)
    assert torch.equal(m_cache.positions, cache.positions) and not torch.equal(m_cache.keys, cache.keys)


def test_lookm_without_the_text_prior_ranks_by_accumulated_attention(workload):
    """text_prior=False (Table 1's merges without TR): the top alpha_2 by
    the attention the prompt's rows give each token (Eq. 4), text ranked as
    image tokens are; the default raises text above them (Eq. 5)."""
    from kernels_py.methods.prompt import AllRows, Prompt
    from kernels_py.methods.scorers import AttentionMass

    params = {"recent_ratio": 0.05, "important_ratio": 0.1, "merge": "none"}
    plain = make_method("lookm", dict(params, text_prior=False))
    cache = plain.prefill(0, workload.q[0], workload.k[0], workload.v[0], workload.spans)
    scores = AttentionMass(AllRows()).prefill(Prompt([workload.q[0]], [workload.k[0]], [workload.v[0]],
                                                     workload.spans), 0)
    recent, capacity = int(PROMPT * 0.05), int(PROMPT * 0.15)
    for h in range(2):
        held = set(cache.positions[h].tolist())
        older = scores[h, :PROMPT - recent].topk(capacity - recent).indices.tolist()
        assert held == set(older) | set(range(PROMPT - recent, PROMPT))
    assert plain.layer_metrics(0, cache)["evicted_text"] > 0  # 24 text tokens do not all fit in 13
    prior = make_method("lookm", params).prefill(0, workload.q[0], workload.k[0], workload.v[0], workload.spans)
    assert not torch.equal(prior.positions, cache.positions)


@pytest.mark.parametrize("merge_mode", ["none", "pivotal"])
def test_lookm_evicting_while_decoding_holds_its_share_and_keeps_generated_text(workload, merge_mode):
    params = {"recent_ratio": 0.05, "important_ratio": 0.15, "merge": merge_mode}
    keeping = make_method("lookm", params)
    evicting = make_method("lookm", {**params, "evict_while_decoding": True})
    caches = [m.prefill(0, workload.q[0], workload.k[0], workload.v[0], workload.spans) for m in (keeping, evicting)]
    if caches[0].keys.is_cuda:  # a GPU's atomic adds (the merges' scatter_add_) round in a varying order
        torch.testing.assert_close(caches[0].keys, caches[1].keys)
    else:
        assert torch.equal(caches[0].keys, caches[1].keys)  # prefill is the same
    before_keys, before_pos = caches[1].keys[0].clone(), caches[1].positions[0].tolist()
    share = caches[1].tokens / PROMPT
    for step in range(CFG["decode_steps"]):
        for method, cache in zip((keeping, evicting), caches):
            method.decode(0, cache, workload.decode_q[0][step], workload.decode_k[0][step], workload.decode_v[0][step])
    seen = PROMPT + CFG["decode_steps"]
    assert caches[0].tokens == int(PROMPT * (0.05 + 0.15)) + CFG["decode_steps"]
    assert caches[1].tokens == int(seen * share) < caches[0].tokens
    for h in range(2):
        assert set(range(PROMPT, seen)) <= set(caches[1].positions[h].tolist())  # generated text ranks first
    # The prompt tokens evicted while decoding were merged into the kept ones (dropped with merge=none).
    after_pos = caches[1].positions[0].tolist()
    still = [(after_pos.index(p), before_pos.index(p)) for p in after_pos if p < PROMPT]
    assert len(still) < len(before_pos)
    same = torch.equal(caches[1].keys[0, [a for a, _ in still]], before_keys[[b for _, b in still]])
    assert same == (merge_mode == "none")


def test_lookm_evicting_while_decoding_evicts_prompt_text_before_generated_tokens(workload):
    """Generated tokens score +inf: image tokens go first, then prompt text,
    and no generated token while a prompt token outside the recent window is
    left (the text alone exceeds alpha_2 here, so prompt text goes too)."""
    method = make_method("lookm", {"recent_ratio": 0.05, "important_ratio": 0.15, "merge": "none",
                                   "evict_while_decoding": True})
    cache = method.prefill(0, workload.q[0], workload.k[0], workload.v[0], workload.spans)
    assert method.layer_metrics(0, cache)["evicted_text"] > 0  # 24 text tokens, alpha_1 + alpha_2 keeps 17
    visual = set(range(8, 72))
    prompt_text = [len(set(cache.positions[h].tolist()) - visual) for h in range(2)]
    for step in range(CFG["decode_steps"]):
        method.decode(0, cache, workload.decode_q[0][step], workload.decode_k[0][step], workload.decode_v[0][step])
        for h in range(2):
            held = set(cache.positions[h].tolist())
            assert not held & visual
            assert set(range(PROMPT, PROMPT + step + 1)) <= held
    assert all(len(set(cache.positions[h].tolist()) & set(range(PROMPT))) < prompt_text[h] for h in range(2))


def test_lookm_merges_change_the_error_and_errors_name_alpha():
    errors = {m: ablation.run("lookm", {"merge": m}, CFG)["metrics"]["rel_err_mean"]
              for m in ("none", "averaged", "pivotal", "weighted")}
    assert len(set(errors.values())) == 4  # each merge is a different cache
    with pytest.raises(ValueError, match=r"recent_ratio \+ important_ratio .* must be at most 1: LOOK-M keeps "
                                         r"alpha_1 \+ alpha_2"):
        make_method("lookm", {"recent_ratio": 0.6, "important_ratio": 0.5})
    with pytest.raises(ValueError, match="merge"):
        make_method("lookm", {"merge": "max"})


# --- A-VL ----------------------------------------------------------------------------------------

def _ranked_by_last_token(q, k):
    """The 64 image tokens (positions 8..71) ranked by A-VL's Eq. 1: the last
    prompt token's attention, averaged over the heads."""
    q, k = q.float(), k.float()
    logits = (q[:, -1:] @ k.repeat_interleave(2, 0).transpose(1, 2))[:, 0] / math.sqrt(32)
    last = torch.softmax(logits, -1).mean(0)
    visual = torch.arange(8, 72, device=q.device)
    return visual[last[visual].argsort(descending=True)]


def test_avl_prefill_sets_core_secondary_and_minor(workload):
    method = make_method("avl", {"secondary": 40, "core": 20, "prefill_keep": 100, "text_window": 100})
    cache = method.prefill(2, workload.q[2], workload.k[2], workload.v[2], workload.spans)
    ranked = _ranked_by_last_token(workload.q[2], workload.k[2])
    stored = set(cache.positions[0][cache.visual].tolist())
    core = set(cache.positions[0][cache.core].tolist())
    assert len(stored) == int(64 * 0.4) and len(core) == int(64 * 0.2) and core < stored
    assert len(stored ^ set(ranked[:25].tolist())) <= 2 and len(core ^ set(ranked[:12].tolist())) <= 2  # float ties
    assert int((~cache.visual).sum()) == 24  # every text token (T = 100%)


def test_avl_ranks_every_images_tokens_together():
    """Two images: one top S% and one top C% over all 64 image tokens by the
    last prompt token's attention, no share per image (an image may hold
    more or fewer than S% of its own tokens)."""
    two = generate(SyntheticConfig(**dict(CFG, tokens_per_image=32, images=2)))
    method = make_method("avl", {"secondary": 40, "core": 20, "prefill_keep": 100, "text_window": 100})
    per_image = []
    for layer in range(CFG["layers"]):
        cache = method.prefill(layer, two.q[layer], two.k[layer], two.v[layer], two.spans)
        ranked = _ranked_by_last_token(two.q[layer], two.k[layer])
        stored = set(cache.positions[0][cache.visual].tolist())
        core = set(cache.positions[0][cache.core].tolist())
        assert len(stored) == int(64 * 0.4) and len(core) == int(64 * 0.2)
        assert len(stored ^ set(ranked[:25].tolist())) <= 2 and len(core ^ set(ranked[:12].tolist())) <= 2  # ties
        per_image.append(sum(p < 40 for p in stored))
    assert any(abs(n - 25 / 2) > 1 for n in per_image)  # the images' shares follow the attention


def test_avl_update_steps_use_all_secondary_tokens_and_report_used_cache(workload):
    method = make_method("avl", {"secondary": 40, "core": 20, "update_every": 3, "text_window": 100})
    cache = method.prefill(2, workload.q[2], workload.k[2], workload.v[2], workload.spans)
    used = []
    for step in range(CFG["decode_steps"]):
        q_t, k_t, v_t = (t[2][step] for t in (workload.decode_q, workload.decode_k, workload.decode_v))
        method.decode(2, cache, q_t, k_t, v_t)
        used.append(round(cache.used[-1] * cache.seen))
    text = 24 + 1  # prompt text plus this step's token
    assert used == [12 + text, 12 + text + 1, 25 + text + 2, 12 + text + 3, 12 + text + 4, 25 + text + 5,
                    12 + text + 6]
    m = method.layer_metrics(2, cache)
    assert m["core_tokens"] == 12 and m["secondary_tokens"] == 25
    assert m["stored_fraction"] == pytest.approx((25 + 24 + 7) / (PROMPT + 7))
    assert m["used_fraction"] < m["stored_fraction"]


def test_avl_text_window_and_prefill_filter(workload):
    method = make_method("avl", {"text_window": 50, "prefill_keep": 50, "secondary": 60, "core": 30})
    caches = method.prefill_all(workload.q, workload.k, workload.v, workload.spans)
    assert int((~caches[0].visual).sum()) == 12  # 50% of 24 text tokens
    # After the second layer only 50% of the image tokens (layer 2's choice) are candidates: 60% becomes 32.
    assert [int(c.visual.sum()) for c in caches] == [int(64 * 0.6)] * 2 + [32] * 2
    stored = [set(c.positions[0][c.visual].tolist()) for c in caches[2:]]
    assert stored[0] == stored[1]
    result = ablation.run("avl", {}, CFG)
    assert 0 < result["metrics"]["used_fraction"] < result["metrics"]["stored_fraction"] < 1


@pytest.mark.parametrize("params, message", [
    ({"core": 50, "secondary": 40}, r"core \(50.0\) must be below secondary \(40.0\): A-VL's C%"),
    ({"update_every": 0}, "update_every=0 is below its minimum 1"),
    ({"secondary": 120}, "secondary=120"),
    ({"text_window": 0}, r"text_window \(0.0\) must be above 0: T%"),
])
def test_avl_parameters_out_of_range_get_clear_errors(params, message):
    with pytest.raises(ValueError, match=message):
        make_method("avl", params)


def test_avl_kernel_path_matches_the_reference(workload):
    outs = {}
    for backend in ("triton", "torch"):
        method = make_method("avl", {"backend": backend, "update_every": 2})
        cache = method.prefill(1, workload.q[1], workload.k[1], workload.v[1], workload.spans)
        outs[backend] = [method.decode(1, cache, *(t[1][s] for t in (workload.decode_q, workload.decode_k,
                                                                        workload.decode_v))) for s in range(4)]
    for a, b in zip(outs["triton"], outs["torch"]):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-4, rtol=1e-4)


def test_lookm_merging_helps_flat_attention_and_hurts_sharp_attention_at_large_budgets(tmp_path):
    """Why merging can raise LOOK-M's error at larger budgets (the synthetic
    workload at 40%: no merge 0.09, averaged 0.31): a merged token keeps the
    attention weight of the kept token it joins, so the evicted tokens'
    values enter at the kept token's weight, not their own. Where attention
    is flat, the evicted tokens carry mass and merging brings some back;
    where it is sharp, the kept tokens carry it and merging dilutes their
    values. A trace of a tiny LLaVA shows both: as built (flat, max weight
    about 0.01) merging lowers the error at 40%, with q and k scaled up
    (sharp, about 0.74) it raises it, as on the synthetic workload. The
    merges are Eq. 10-12 (checked by hand above): the workload's attention
    sets the direction, not the code."""
    from kernels_py.models import load, trace
    from kernels_py.tests.tiny_vlm import save_image, save_tiny_llava

    vlm = load(save_tiny_llava(tmp_path / "llava"))
    image = save_image(tmp_path / "image.png")
    prompt = "USER : <image> describe the picture" + " what is in the picture a red cat or a blue dog ?" * 2 + \
        " ASSISTANT :"
    errors = {}
    for sharpness in (1.0, 12.0):
        with torch.no_grad():
            for layer in vlm.model.model.language_model.layers:
                layer.self_attn.q_proj.weight.mul_(sharpness)
                layer.self_attn.k_proj.weight.mul_(sharpness)
        path = tmp_path / f"trace-{sharpness}.safetensors"
        trace.save(path, *trace.capture(vlm, [image], prompt, decode_steps=8))
        errors[sharpness] = {m: ablation.run("lookm", {"recent_ratio": 0.2, "important_ratio": 0.2, "merge": m},
                                             {"path": str(path)}, "trace")["metrics"]["rel_err_mean"]
                             for m in ("none", "averaged")}
    assert errors[1.0]["averaged"] < 0.8 * errors[1.0]["none"]
    assert errors[12.0]["averaged"] > 1.03 * errors[12.0]["none"]
    synthetic = {m: ablation.run("lookm", {"recent_ratio": 0.2, "important_ratio": 0.2, "merge": m},
                                 dict(CFG, dtype="float16"))["metrics"]["rel_err_mean"] for m in ("none", "averaged")}
    assert synthetic["averaged"] > 2 * synthetic["none"]


@pytest.mark.parametrize("name, params", [("lookm", {}), ("lookm", {"evict_while_decoding": True}), ("avl", {})])
def test_a_prompt_without_images_keeps_its_text_budget(name, params):
    """A text-only prompt (no image span): LOOK-M's text prior raises every
    token alike, so it ranks by accumulated attention (Eq. 4); A-VL has no
    core or secondary tokens and keeps its text window. Both failed at
    prefill, on the empty list of visual positions."""
    from kernels_py.attention import Spans

    g = torch.Generator().manual_seed(0)
    spans = Spans((0, 4), (), (4, 40))
    q, k, v = torch.randn(4, 40, 16, generator=g), torch.randn(2, 40, 16, generator=g), torch.randn(2, 40, 16,
                                                                                                    generator=g)
    method = make_method(name, params)
    cache = method.prefill(0, q, k, v, spans)
    assert cache.tokens == (int(40 * 0.2) if name == "lookm" else int(40 * 0.5))
    for _ in range(3):
        out = method.decode(0, cache, torch.randn(4, 1, 16, generator=g), torch.randn(2, 1, 16, generator=g),
                            torch.randn(2, 1, 16, generator=g))
        assert out.shape == (4, 1, 16) and torch.isfinite(out).all()
    metrics = method.layer_metrics(0, cache)
    if name == "avl":
        assert metrics["core_tokens"] == metrics["secondary_tokens"] == 0
    else:
        assert metrics["evicted_text"] == 40 - int(40 * 0.2)


def test_avl_decode_gathers_the_core_rows_only_on_update_steps(workload, monkeypatch):
    """The selected-row op attends over core + text without a gathered copy;
    the step's weights are then needed for the text rows (H2O) and, on an
    update step, for every stored row (the new core). A copy of the core
    rows on the other steps undid what the op saves (A-VL Figure 8)."""
    from kernels_py.methods import avl

    gathered = []
    monkeypatch.setattr(avl, "expand_kv", lambda x, heads: gathered.append(x.shape[1]) or
                        x.repeat_interleave(heads // x.shape[0], 0))
    method = make_method("avl", {"secondary": 40, "core": 20, "update_every": 3, "text_window": 100})
    cache = method.prefill(2, workload.q[2], workload.k[2], workload.v[2], workload.spans)
    for step in range(4):
        method.decode(2, cache, *(t[2][step] for t in (workload.decode_q, workload.decode_k, workload.decode_v)))
    text = 24 + 1  # prompt text plus the step's token
    assert gathered == [text, text + 1, 25 + text + 2, text + 3]
