"""PyramidKV's and FastV's caches, and the protocol every eviction baseline
shares: SnapKV's window at 10% of the budget, one rounding of recent windows,
VL-Cache's optional redistribution of clipped budget."""

import math

import pytest

from kernels_py import ablation
from kernels_py.methods import METHODS, make_method
from kernels_py.methods.allocators import allocate_budgets
from kernels_py.methods.caches import recent_count
from kernels_py.workloads import SyntheticConfig, generate

CFG = dict(layers=4, heads=4, kv_heads=2, head_dim=32, tokens_per_image=64, system_tokens=8, text_tokens=16,
           decode_steps=4, salient_tokens=8)
PROMPT = 88


@pytest.fixture(scope="module")
def workload():
    return generate(SyntheticConfig(**CFG))


def test_pyramid_budgets_fall_linearly_and_keep_the_total(workload):
    """Every layer keeps the window and a share of the rest of the mean
    budget falling linearly over layers (the authors' code), so the top
    layer still keeps tokens the window voted for."""
    method = make_method("pyramidkv", {"budget": 0.2, "beta": 4})
    assert (method.window, method.kernel_size, method.pooling) == (8, 7, "max")  # the authors' experiments
    caches = method.prefill_all(workload.q, workload.k, workload.v, workload.spans)
    shares = [c.notes["layer_budget"] for c in caches]
    # The mean 17.6 tokens leave 9.6 of the 80 outside the window (0.12): the last layer 0.12 / 4 of them,
    # the first 0.24 - 0.03.
    assert [s * PROMPT for s in shares] == pytest.approx([8 + 80 * r for r in (0.21, 0.15, 0.09, 0.03)])
    assert [c.tokens for c in caches] == [int(PROMPT * s) for s in shares] == [24, 20, 15, 10]
    assert sum(shares) / 4 == pytest.approx(0.2)
    window = set(range(PROMPT - 8, PROMPT))
    for cache in caches:
        held = set(cache.positions[0].tolist())
        assert window <= held and len(held - window) == cache.tokens - 8
    # Without a window the schedule covers the whole budget: last = 0.2 / 4, first = 0.4 - 0.05.
    from kernels_py.methods.allocators import Pyramid
    assert Pyramid(0.2, 4).shares(PROMPT, 4) == pytest.approx([0.35, 0.25, 0.15, 0.05])
    # A mean budget within the window: every layer keeps the mean (kvpress's fallback to SnapKV).
    assert Pyramid(0.05, 4, lambda tokens: 8).shares(PROMPT, 4) == [0.05] * 4
    # Same total as SnapKV at the same budget, give or take rounding.
    snap = make_method("snapkv", {"budget": 0.2}).prefill_all(workload.q, workload.k, workload.v, workload.spans)
    assert abs(sum(c.tokens for c in caches) - sum(c.tokens for c in snap)) <= 4


def test_fastv_drops_image_tokens_after_layer_k(workload):
    method = make_method("fastv", {"layer": 2, "drop": 50})
    caches = method.prefill_all(workload.q, workload.k, workload.v, workload.spans)
    assert [c.tokens for c in caches] == [PROMPT, PROMPT, PROMPT - 32, PROMPT - 32]
    held = set(caches[3].positions[0].tolist())
    assert set(range(8)) | set(range(72, PROMPT)) <= held  # every text token stays
    assert held == set(caches[2].positions[0].tolist())  # one decision for all later layers


def test_snapkv_window_is_ten_percent_of_the_budget_and_rounding_is_shared(workload):
    method = make_method("snapkv", {"budget": 0.25, "window": 0})  # VL-Cache's protocol
    assert METHODS["snapkv"].protocol_knobs("vlcache")["window"] == 0
    capacity = int(PROMPT * 0.25)  # 22
    assert method.scorer().size(PROMPT) == recent_count(0.1, capacity) == 2  # 2.2 -> 2
    assert make_method("snapkv", {"budget": 0.25}).scorer().size(PROMPT) == 32  # SnapKV's own
    cache = method.prefill(0, workload.q[0], workload.k[0], workload.v[0], workload.spans)
    assert set(range(PROMPT - 2, PROMPT)) <= set(cache.positions[0].tolist())
    # One rounding, half up, in every method: 2.5 -> 3 for vlcache as for h2o.
    assert recent_count(0.5, 5) == 3
    assert make_method("vlcache", {"recent_fraction": 0.5}).recent(5) == make_method(
        "h2o", {"recent_fraction": 0.5}).recent(5) == 3


def test_vlcache_can_redistribute_what_the_clip_removes():
    sparsity = [0.0, 0.0, 0.9, 0.9]  # two dense layers ask for more than everything at alpha 0.6
    clipped = allocate_budgets(sparsity, 0.6)
    assert clipped[:2] == [1.0, 1.0] and sum(clipped) / 4 < 0.6
    shared = allocate_budgets(sparsity, 0.6, redistribute=True)
    assert shared[:2] == [1.0, 1.0] and sum(shared) / 4 == pytest.approx(0.6)
    assert shared[2] == shared[3] > clipped[2]
    result = ablation.run("vlcache", {"budget": 0.5, "redistribute": True}, dict(CFG, layers=2))
    assert result["metrics"]["layer_budget"] <= 0.5 + 1e-9


def test_review_edge_cases():
    """Found in review: FastV at K = the last layer, PyramidKV's capped
    shares, its window at each layer, and an empty sparse prefill."""
    from kernels_py.methods.allocators import pyramid_shares
    from kernels_py.methods.sparse_prefill import prefill_error

    w = generate(SyntheticConfig(**CFG))
    caches = make_method("fastv", {"layer": 3, "drop": 50}).prefill_all(w.q, w.k, w.v, w.spans)
    assert [c.tokens for c in caches] == [PROMPT, PROMPT, PROMPT, PROMPT - 32]
    shares = pyramid_shares(0.9, 20.0, 32)
    assert max(shares) <= 1.0 and sum(shares) / 32 == pytest.approx(0.9)
    assert shares == sorted(shares, reverse=True)
    pyramid = make_method("pyramidkv", {"budget": 0.2, "window": 0})  # 10% of the budget: below 40
    window = pyramid.scorer().size(PROMPT)
    assert [pyramid.recent_at(c, PROMPT) for c in (40, window, 1)] == [window, window, 1]
    q, k, v = w.q[0], w.k[0], w.v[0]
    import torch
    # Nothing important: every output row is zero (error 1 over all rows), none is wrong among the important.
    assert prefill_error(q, k, v, torch.zeros(2, 0, dtype=torch.int64)) == (pytest.approx(1.0), 0.0, pytest.approx(1.0))


def held_bytes(cache) -> int:
    """Bytes of the storages behind the cache's K and V: what it really keeps alive, views included."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (cache.keys, cache.values)}
               .values())


@pytest.mark.parametrize("name, params", [("full", {}), ("fastv", {}), ("snapkv", {"budget": 1.0}),
                                          ("pyramidkv", {"budget": 1.0}), ("h2o", {"budget": 1.0}),
                                          ("streamingllm", {"budget": 1.0}),
                                          ("lookm", {"recent_ratio": 0.5, "important_ratio": 0.5}),
                                          ("vlcache", {"budget": 1.0, "allocation": "uniform"})])
def test_a_cache_that_evicts_nothing_holds_no_more_than_it_reports(workload, name, params):
    """Inside a model each sequence's prompt K and V are views of the batch's, padding included
    (models.adapter: key[b, :, pad:]): a layer that keeps every token held the view, so the whole
    batch's K and V, while reporting its own tokens' bytes."""
    import torch

    method = make_method(name, params)
    k = [torch.stack([x, x])[1] for x in workload.k]  # views of a batch of two, as key[b]
    v = [torch.stack([x, x])[1] for x in workload.v]
    caches = method.prefill_all(workload.q, k, v, workload.spans)
    assert caches[0].tokens == PROMPT
    for layer, cache in enumerate(caches):
        assert held_bytes(cache) == method.cache_bytes(cache), layer
        method.decode(layer, cache, workload.q[layer][:, -1:], workload.k[layer][:, -1:], workload.v[layer][:, -1:])
        assert held_bytes(cache) == method.cache_bytes(cache), layer
    # A prompt whose tensors are its own is held as it is, not copied.
    own = method.prefill_all(workload.q, workload.k, workload.v, workload.spans)
    assert own[0].keys.data_ptr() == workload.k[0].data_ptr()


def test_pyramidkv_at_budget_one_keeps_every_token():
    """The schedule's water-filling left the last layer a share of 1 - 2e-16 at budget 1, one token short."""
    from kernels_py.methods.allocators import Pyramid, pyramid_shares

    for layers in (2, 4, 32):
        assert pyramid_shares(1.0, 20.0, layers) == [1.0] * layers
        assert Pyramid(1.0, 20.0, lambda tokens: 8).shares(PROMPT, layers) == [1.0] * layers
    w = generate(SyntheticConfig(**CFG))
    caches = make_method("pyramidkv", {"budget": 1.0}).prefill_all(w.q, w.k, w.v, w.spans)
    assert [c.tokens for c in caches] == [PROMPT] * 4


def test_pyramidkv_holds_its_window_while_decoding(workload, monkeypatch):
    """Evicting while decoding, every layer keeps the window's length of latest tokens, the window being 10% of
    the mean budget at window = 0 (VL-Cache's protocol), as at prefill: it kept 10% of each layer's own
    capacity, 3 tokens in the first layer and 1 in the last."""
    from kernels_py.methods.caches import KeptTokens

    method = make_method("pyramidkv", {"budget": 0.2, "window": 0, "evict_while_decoding": True})
    caches = method.prefill_all(workload.q, workload.k, workload.v, workload.spans)
    recents = []
    keep_top = KeptTokens.keep_top
    monkeypatch.setattr(KeptTokens, "keep_top", lambda self, scores, capacity, recent: (
        recents.append((capacity, recent)), keep_top(self, scores, capacity, recent))[1])
    for step in range(3):
        for layer, cache in enumerate(caches):
            method.decode(layer, cache, workload.q[layer][:, -1:], workload.k[layer][:, -1:],
                          workload.v[layer][:, -1:])
    window = method.scorer().size(PROMPT + 3)
    assert window == method.scorer().size(PROMPT) == 2
    assert len(recents) == 12 and recents[0][0] > 10 and recents[-1][0] < 10
    assert all(recent == min(capacity, window) for capacity, recent in recents)


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv"])
def test_window_votes_hold_generated_text_as_a_sliding_window(workload, name):
    """Evicting while decoding, generated tokens (no votes) go before any prompt token and the oldest first, as
    snapkv.py says: each scored 0, so topk's ties dropped any of them."""
    method = make_method(name, {"budget": 0.2, "window": 0, "evict_while_decoding": True})
    caches = method.prefill_all(workload.q, workload.k, workload.v, workload.spans)
    for step in range(40):
        for layer, cache in enumerate(caches):
            method.decode(layer, cache, workload.q[layer][:, -1:], workload.k[layer][:, -1:],
                          workload.v[layer][:, -1:])
    for cache in caches:
        for head in cache.positions.tolist():
            generated = [p for p in head if p >= PROMPT]
            assert generated == list(range(cache.seen - len(generated), cache.seen)), head
