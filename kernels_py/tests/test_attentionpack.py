"""AttentionPack: exact at full rank, storage as the paper counts it, periodic
folding, Eq. 1 importance, decompression groups, rank schemes, quantization
and eviction, and clear errors for bad settings."""

import math

import pytest
import torch

from kernels_py import ablation, metrics
from kernels_py.methods import METHODS, make_method
from kernels_py.methods.allocators import group_ranks, group_sizes, parse_groups
from kernels_py.methods.attentionpack import AttentionPack, paper_compression_ratio
from kernels_py.methods.scorers import ema_update
from kernels_py.workloads import SyntheticConfig, generate

SMALL = SyntheticConfig(layers=2, heads=4, kv_heads=2, head_dim=32, tokens_per_image=64, system_tokens=8,
                        text_tokens=16, decode_steps=6, salient_tokens=8, dtype="float32")  # exact arithmetic
VISUAL, TEXT, WIDTH = 64, 24, 2 * 32  # visual tokens, system + text tokens, kv_heads * head_dim
PAPER_GROUPS = "0.25:1,0.75:0.25"


# The mechanisms below are tested one at a time: without attention-aware
# decompression and with generated tokens folded every 64 steps, unless a
# test says otherwise (the method's defaults are the paper's setting, see
# test_defaults_are_the_papers_setting).
def pack(**settings) -> AttentionPack:
    return AttentionPack(**{"groups": "1:1", "period": 64, **settings})


@pytest.fixture(scope="module")
def workload():
    return generate(SMALL)


@pytest.fixture(scope="module")
def full_outputs(workload):
    return run(make_method("full"), workload)[0]


def prefill(method, workload, layer=0):
    return method.prefill(layer, workload.q[layer], workload.k[layer], workload.v[layer], workload.spans)


def run(method, workload, layers=None, after_step=None):
    """Prefill and decode every step; returns (outputs [layer][step], caches)."""
    outputs, caches = [], []
    for layer in range(workload.config.layers) if layers is None else layers:
        cache = prefill(method, workload, layer)
        steps = []
        for step in range(workload.config.decode_steps):
            q_t, k_t, v_t = (t[layer][step] for t in (workload.decode_q, workload.decode_k, workload.decode_v))
            steps.append(method.decode(layer, cache, q_t, k_t, v_t))
            if after_step is not None:
                after_step(step, cache)
        outputs.append(steps)
        caches.append(cache)
    return outputs, caches


def mean_error(outputs, reference):
    errors = [metrics.relative_error(o, r) for mine, ref in zip(outputs, reference) for o, r in zip(mine, ref)]
    return sum(errors) / len(errors)


def factor_bytes(cache):
    return sum(s.k.nbytes + s.v.nbytes for s in cache.segments)


# --- exactness and error -------------------------------------------------------------------------

@pytest.mark.parametrize("settings", [
    dict(rank_k=WIDTH, rank_v=WIDTH),
    dict(rank_k=WIDTH, rank_v=WIDTH, rope="after"),
    dict(rank_k=WIDTH, rank_v=WIDTH, rope="after", absorbed=True),
    dict(rank_k=32, rank_v=32, head_mode="per_head"),  # full rank of a head: min(T, D) = 32
    dict(rank_k=WIDTH, rank_v=WIDTH, compress_text=True, text_rank=TEXT),
], ids=["rope_before", "rope_after", "absorbed", "per_head", "text_segment"])
def test_full_rank_reproduces_full_attention(workload, full_outputs, settings):
    method = pack(factor_dtype="float32", backend="torch", **settings)
    outputs, caches = run(method, workload)
    for mine, ref in zip(outputs, full_outputs):
        for o, r in zip(mine, ref):
            torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4)
    # The keys attention sees (what the ablation's PPCI reads) are the cached, rotated ones.
    layer, cache = 1, caches[1]
    expected = torch.cat([workload.k[layer]] + list(workload.decode_k[layer]), dim=1)
    torch.testing.assert_close(cache.keys, expected, atol=1e-4, rtol=1e-4)
    assert cache.positions[0].tolist() == list(range(cache.seen))


def test_fp16_factors_stay_close_at_full_rank(workload, full_outputs):
    outputs, _ = run(pack(rank_k=WIDTH, rank_v=WIDTH, backend="torch"), workload)
    assert mean_error(outputs, full_outputs) < 2e-3


def test_error_decreases_as_rank_increases(workload, full_outputs):
    errors = [mean_error(run(pack(rank_k=r, rank_v=r, backend="torch"), workload)[0], full_outputs)
              for r in (4, 16, 48)]
    assert errors[0] > errors[1] > errors[2] > 0


def test_combined_heads_capture_more_variance_than_per_head_at_equal_storage():
    """Figure 2's claim on a workload whose visual K/V share one latent across heads:
    combined rank 26 stores 26 * (T + H*D) = 2 * 17 * (T + D) values, per-head rank 17."""
    cfg = SyntheticConfig(layers=1, heads=4, kv_heads=2, head_dim=64, tokens_per_image=144, system_tokens=8,
                          text_tokens=16, decode_steps=1, salient_tokens=12)
    wl = generate(cfg)
    combined = pack(rank_k=26, rank_v=26)
    per_head = pack(rank_k=17, rank_v=17, head_mode="per_head")
    c_cache, p_cache = prefill(combined, wl), prefill(per_head, wl)
    assert factor_bytes(c_cache) == factor_bytes(p_cache) == 2 * 2 * 26 * (144 + 128)
    c_metrics, p_metrics = combined.layer_metrics(0, c_cache), per_head.layer_metrics(0, p_cache)
    for which in ("explained_variance_k", "explained_variance_v"):
        assert c_metrics[which] > p_metrics[which] + 0.01


# --- storage -------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_mode, rank_k, rank_v", [("combined", 8, 24), ("combined", 40, 40), ("per_head", 8, 4)])
def test_compression_ratio_formula_equals_actual_bytes(workload, head_mode, rank_k, rank_v):
    method = pack(rank_k=rank_k, rank_v=rank_v, head_mode=head_mode)
    cache = prefill(method, workload)
    fp16_visual = 2 * VISUAL * WIDTH * 2  # K and V of the visual tokens at 2 bytes
    reported = method.layer_metrics(0, cache)["formula_compression_ratio"]
    assert reported == pytest.approx(fp16_visual / factor_bytes(cache), rel=1e-12)
    heads = 2 if head_mode == "per_head" else 1
    per_matrix = lambda r: VISUAL * WIDTH / (heads * (VISUAL * r + r * WIDTH // heads))  # noqa: E731
    assert reported == pytest.approx(2 / (1 / per_matrix(rank_k) + 1 / per_matrix(rank_v)))
    dense = 2 * TEXT * WIDTH * 4  # text K/V stay float32, as the workload caches them
    assert method.cache_bytes(cache) == factor_bytes(cache) + dense


def test_paper_numerical_example():
    """Section 3.1: T = 1000, H = 40, D = 128, R = 64 is "around 13x" smaller."""
    assert paper_compression_ratio(1000, 40, 128, 64, 64) == pytest.approx(13.07, abs=0.01)


def test_quantized_factors_count_packed_bytes_and_stay_accurate(workload, full_outputs):
    rank, group = 24, 8
    plain = pack(rank_k=rank, rank_v=rank, backend="torch")
    packed = pack(rank_k=rank, rank_v=rank, quant_bits=4, quant_group=group, backend="torch")
    p_out, p_caches = run(plain, workload)
    q_out, q_caches = run(packed, workload)
    runs = math.ceil(rank / group)
    u_bytes = VISUAL * runs * group // 2 + 2 * VISUAL * runs * 2  # packed codes + fp16 scale and zero
    w_bytes = rank * WIDTH * 2
    dense = (TEXT + SMALL.decode_steps) * WIDTH * 4 * 2
    assert packed.cache_bytes(q_caches[0]) == 2 * (u_bytes + w_bytes) + dense
    assert packed.cache_bytes(q_caches[0]) < plain.cache_bytes(p_caches[0])
    # Same seed, same SVD: the 4-bit U is the fp16 one within half a quantization step.
    plain_u = p_caches[0].segments[0].v.u.float()
    packed_u = q_caches[0].segments[0].v.dense_u(torch.float16).float()
    runs_u = plain_u.reshape(VISUAL, runs, group)
    half_step = (runs_u.amax(-1) - runs_u.amin(-1)) / 15 / 2
    assert ((packed_u - plain_u).abs().reshape(VISUAL, runs, group) <= half_step[..., None] * 1.01 + 1e-3).all()
    drift = mean_error(q_out, p_out)
    assert 0 < drift < 0.05


def test_quantized_w_counts_its_packed_bytes_and_frees_the_dequantized_copy(workload, full_outputs):
    rank, group = 24, 8
    plain = pack(rank_k=rank, rank_v=rank, quant_bits=4, quant_group=group, backend="torch")
    both = pack(rank_k=rank, rank_v=rank, quant_bits=4, quant_w_bits=4, quant_group=group, backend="torch")
    p_out, p_caches = run(plain, workload)
    q_out, q_caches = run(both, workload)
    fp16_w = rank * WIDTH * 2
    packed_w = rank * WIDTH // 2 + 2 * rank * (WIDTH // group) * 2  # codes + an fp16 scale and zero per run
    assert both.cache_bytes(q_caches[0]) == plain.cache_bytes(p_caches[0]) - 2 * (fp16_w - packed_w)
    # Same SVD: W's codes hold it within half a step of its run, and the outputs barely move.
    plain_w = p_caches[0].segments[0].k.w.float()
    packed_w = q_caches[0].segments[0].k.dense_w(torch.float16).float()
    runs_w = plain_w.reshape(rank, WIDTH // group, group)
    half_step = (runs_w.amax(-1) - runs_w.amin(-1)) / 15 / 2
    assert ((packed_w - plain_w).abs().reshape(rank, -1, group) <= half_step[..., None] * 1.01 + 1e-3).all()
    assert 0 < mean_error(q_out, p_out) < 0.05
    # Between steps the cache holds the packed codes only: the op's dequantized layout lives for a step.
    assert all(c._layout is None for c in q_caches) and all(c._layout is not None for c in run(pack(
        rank_k=rank, rank_v=rank, backend="torch"), workload)[1])


def test_four_bit_factors_at_llava_shapes_hold_four_times_less_than_fp16():
    """LLaVA-1.5-7B's shapes (32 heads of 128, MHA, one 576-token image, 75
    text tokens) at rank 64: 4-bit U and W hold over 4x less than the fp16
    cache, text and generated tokens included (6.2x; fp16 factors 4.2x, 4-bit
    U alone 4.4x: W is most of the factors)."""
    llava = dict(layers=1, heads=32, kv_heads=32, head_dim=128, tokens_per_image=576, system_tokens=35,
                 text_tokens=40, decode_steps=4)
    ratios = {}
    for name, bits in (("fp16", {}), ("u", {"quant_bits": 4}), ("uw", {"quant_bits": 4, "quant_w_bits": 4})):
        m = ablation.run("attentionpack", {"rank_k": 64, "rank_v": 64, **bits}, llava)["metrics"]
        ratios[name] = m["compression_ratio"]
        assert m["rel_err_mean"] < 0.12
    assert ratios["uw"] >= 4 and ratios["uw"] > 1.3 * ratios["u"] > 1.3 * ratios["fp16"]


# --- periodic compression ------------------------------------------------------------------------

def test_periodic_compression_folds_the_buffer_at_the_period(workload, full_outputs):
    period = 2
    seen = []

    def check(step, cache):
        assert cache.buffer < period
        folded = (step + 1) // period * period
        seen.append(cache.compressed_tokens)
        assert cache.compressed_tokens == VISUAL + folded
        assert cache.dense_positions.shape[0] == TEXT + (step + 1 - folded)

    # Full rank stays full rank after a fold, so the outputs stay exact: the
    # generated keys were moved into the decomposition frame correctly.
    method = pack(rank_k=WIDTH, rank_v=WIDTH, period=period, factor_dtype="float32", backend="torch")
    outputs, caches = run(method, workload, layers=[0], after_step=check)
    assert seen == [64, 66, 66, 68, 68, 70]
    assert caches[0].folds == 3
    visual, generated = caches[0].segments
    assert generated.name == "generated"
    assert generated.positions.tolist() == list(range(VISUAL + TEXT, VISUAL + TEXT + 6))
    assert visual.positions.tolist() == workload.spans.visual_positions().tolist()
    for o, r in zip(outputs[0], full_outputs[0]):
        torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4)


def test_generated_tokens_never_fold_into_the_visual_segment(workload):
    """Section 3.1 compresses visual and textual tokens apart (together cost
    about 20% accuracy): without a text segment, folded tokens get one of
    their own at text_rank, and the visual factors stay as prefill made them."""
    method = pack(rank_k=16, rank_v=16, text_rank=4, period=4, backend="torch")
    prefilled = prefill(method, workload)
    visual_u = prefilled.segments[0].k.u.clone()
    _, caches = run(method, workload, layers=[0])
    cache = caches[0]
    assert cache.folds == 1 and [s.name for s in cache.segments] == ["visual", "generated"]
    visual, generated = cache.segments
    assert (visual.positions < workload.spans.prompt_tokens).all() and visual.tokens == VISUAL
    torch.testing.assert_close(visual.k.u, visual_u, atol=0, rtol=0)
    assert generated.positions.tolist() == list(range(VISUAL + TEXT, VISUAL + TEXT + 4))
    assert generated.k.rank == generated.v.rank == 4 and generated.target_k == 4
    # The prompt's text and the two generated tokens since the fold stay uncompressed.
    assert cache.dense_positions.numel() == TEXT + SMALL.decode_steps - 4


def test_generated_tokens_fold_into_the_text_segment_when_text_is_compressed(workload):
    method = pack(rank_k=16, rank_v=16, compress_text=True, text_rank=8, period=3, backend="torch")
    _, caches = run(method, workload, layers=[0])
    visual, text = caches[0].segments
    assert visual.tokens == VISUAL and text.tokens == TEXT + SMALL.decode_steps
    assert caches[0].dense_positions.numel() == 0 and caches[0].folds == 2


def test_period_zero_never_folds(workload):
    _, caches = run(pack(rank_k=16, rank_v=16, period=0, backend="torch"), workload, layers=[0])
    assert caches[0].compressed_tokens == VISUAL and caches[0].buffer == SMALL.decode_steps


# --- importance and groups -----------------------------------------------------------------------

def test_ema_update_matches_eq1_on_a_hand_made_example():
    importance = torch.tensor([0.5, 0.1, 0.0])
    mass = torch.tensor([0.2, 0.6, 0.2])
    torch.testing.assert_close(ema_update(importance, mass, 0.25), torch.tensor([0.275, 0.475, 0.15]))
    # Two new query tokens: alpha^2 = 0.0625 weighs the past.
    torch.testing.assert_close(ema_update(importance, mass, 0.25, new_tokens=2),
                               torch.tensor([0.5 * 0.0625 + 0.2 * 0.9375, 0.1 * 0.0625 + 0.6 * 0.9375, 0.1875]))


def test_importance_follows_eq1_through_decode(workload):
    """Prefill importance = the last prompt query's attention averaged over
    heads; one step later I = alpha I + (1 - alpha) A_t, A_t from the decode
    kernel's mass (exact at full rank), the new token starting from 0."""
    alpha, layer = 0.4, 1
    method = pack(rank_k=WIDTH, rank_v=WIDTH, alpha=alpha, factor_dtype="float32", backend="torch")
    cache = prefill(method, workload, layer)
    q, k = workload.q[layer], workload.k[layer]
    initial = metrics.causal_attention(q[:, -1:], k)[:, 0].mean(dim=0)
    torch.testing.assert_close(cache.scores[0], initial, atol=1e-6, rtol=1e-5)
    q_t, k_t, v_t = workload.decode_q[layer][0], workload.decode_k[layer][0], workload.decode_v[layer][0]
    method.decode(layer, cache, q_t, k_t, v_t)
    step_mass = metrics.causal_attention(q_t, torch.cat([k, k_t], dim=1))[:, 0].mean(dim=0)
    expected = alpha * torch.cat([initial, initial.new_zeros(1)]) + (1 - alpha) * step_mass
    torch.testing.assert_close(cache.scores[0], expected, atol=1e-6, rtol=1e-4)


def test_importance_every_n_steps_updates_on_those_steps_only(workload, full_outputs):
    """importance_every=3: steps 1, 4, 7... update Eq. 1 and regroup; the
    steps between attend without masses and leave the importance and the
    groups as they were, at an error near the every-step one."""
    layer = 1
    method = pack(rank_k=16, rank_v=16, groups=PAPER_GROUPS, importance_every=3)
    cache = prefill(method, workload, layer)
    seen = []
    for step in range(6):
        q_t, k_t, v_t = (t[layer][step] for t in (workload.decode_q, workload.decode_k, workload.decode_v))
        method.decode(layer, cache, q_t, k_t, v_t)
        seen.append((cache.segments[0].importance.clone(), cache.regrouped))
    assert torch.equal(seen[1][0], seen[0][0]) and torch.equal(seen[2][0], seen[0][0])
    assert seen[1][1] == seen[0][1] == seen[2][1]  # no regroup between the scored steps
    assert not torch.equal(seen[3][0], seen[2][0])  # step 4 scores again
    every = mean_error(run(pack(rank_k=16, rank_v=16, groups=PAPER_GROUPS), workload)[0], full_outputs)
    third = mean_error(run(pack(rank_k=16, rank_v=16, groups=PAPER_GROUPS, importance_every=3), workload)[0],
                       full_outputs)
    assert third == pytest.approx(every, rel=0.02)


def test_group_sizes_and_ranks_on_a_hand_made_example():
    importance = torch.tensor([0.1, 0.9, 0.3, 0.05, 0.7, 0.2, 0.0, 0.6, 0.4, 0.8])
    ranks = group_ranks(importance, parse_groups("0.3:1,0.7:0.25"), 16)
    assert ranks.tolist() == [4, 16, 4, 4, 16, 4, 4, 4, 4, 16]  # top 3: 0.9, 0.7, 0.8 at full rank, the rest R/4
    assert group_sizes(10, [0.5, 0.3, 0.2]) == [5, 3, 2]
    assert group_sizes(64, [0.25, 0.75]) == [16, 48]
    three = group_ranks(importance, parse_groups("0.5:1,0.3:0.5,0.2:0.25"), 64)
    assert three[importance.argsort(descending=True)].tolist() == [64] * 5 + [32] * 3 + [16] * 2


@pytest.mark.parametrize("partial", ["values", "keys", "both"])
def test_most_important_tokens_get_full_rank(workload, partial):
    rank = 16
    method = pack(rank_k=rank, rank_v=rank, groups=PAPER_GROUPS, partial=partial, backend="torch")
    cache = prefill(method, workload)
    visual = cache.segments[0]
    top = set(visual.importance.topk(16).indices.tolist())  # ceil(0.25 * 64)
    for which, ranks in (("keys", visual.ranks_k), ("values", visual.ranks_v)):
        if partial in (which, "both"):
            assert set(torch.nonzero(ranks == rank)[:, 0].tolist()) == top
            assert (ranks == rank // 4).sum() == 48
        else:
            assert (ranks == rank).all()
    # Groups are re-derived from the updated importance at every step.
    q_t, k_t, v_t = workload.decode_q[0][0], workload.decode_k[0][0], workload.decode_v[0][0]
    method.decode(0, cache, q_t, k_t, v_t)
    ranks = visual.ranks_v if partial != "keys" else visual.ranks_k
    assert set(torch.nonzero(ranks == rank)[:, 0].tolist()) == set(visual.importance.topk(16).indices.tolist())
    # Section 3.2: (r_1 R + r_2 R / 4) / R on the partial factors, 1 on the others.
    ratio = method.layer_metrics(0, cache)["decompression_flops_ratio"]
    partial_ratio = (16 * rank + 48 * rank // 4) / (64 * rank)
    assert ratio == pytest.approx(partial_ratio if partial == "both" else (1 + partial_ratio) / 2)


@pytest.mark.parametrize("settings", [dict(), dict(head_mode="per_head", rank_k=8, rank_v=8),
                                      dict(compress_text=True, text_rank=8), dict(quant_bits=4)],
                         ids=["combined", "per_head", "text_segment", "quantized"])
def test_groups_live_in_runs_of_slots_and_only_changes_move(workload, settings):
    """The cache stores each importance group in a run of slots (the most
    important first) with that group's rank, so the kernel's tiles have one
    rank; a step moves exactly the tokens whose group changed, in the
    segment and in the kernel layout, and attention is unchanged by where
    a token sits."""
    method = pack(**{"rank_k": 16, "rank_v": 16, "groups": "0.25:1,0.5:0.5,0.25:0.25", "partial": "both",
                     "backend": "torch", **settings})
    cache = prefill(method, workload)
    assert cache.regrouped == 0
    moved_total = 0
    for step in range(workload.config.decode_steps):
        before = [seg.positions.clone() for seg in cache.segments]
        ranks = [seg.ranks_v.clone() for seg in cache.segments]
        q_t, k_t, v_t = (t[0][step] for t in (workload.decode_q, workload.decode_k, workload.decode_v))
        # What attention over this cache must give, from the keys and values as metrics see them.
        keys = torch.cat([cache.keys, k_t.float()], dim=1)
        values = torch.cat([cache.values, v_t.float()], dim=1)
        scores = q_t.float().view(2, 2, 1, -1) @ keys[:, None].transpose(-1, -2) / math.sqrt(keys.shape[-1])
        want = (scores.softmax(-1) @ values[:, None]).view_as(q_t)
        out = method.decode(0, cache, q_t, k_t, v_t)
        torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=2e-3)
        for seg, positions, slot_ranks in zip(cache.segments, before, ranks):
            bounds = [0] + torch.tensor(group_sizes(seg.tokens, [0.25, 0.5, 0.25])).cumsum(0).tolist()
            runs = [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:])]
            # Each run of slots holds a group: no token of a later run is more important.
            for this, later in zip(runs, runs[1:]):
                assert seg.importance[this].min() >= seg.importance[later.start:].max()
            assert torch.equal(seg.ranks_v, slot_ranks)  # slots keep their ranks
            assert seg.ranks_v[runs[0]].eq(seg.v.rank).all()
            assert seg.ranks_k[runs[-1]].eq(math.ceil(seg.k.rank / 4)).all()
            # Exactly the tokens that changed group moved; the others kept their slot.
            group_then = {int(p): g for g, run in enumerate(runs) for p in positions[run]}
            group_now = {int(p): g for g, run in enumerate(runs) for p in seg.positions[run]}
            changed = {p for p, g in group_now.items() if group_then[p] != g}
            moved_total += len(changed)
            stayed = [i for i in range(seg.tokens) if int(seg.positions[i]) not in changed]
            assert torch.equal(seg.positions[stayed], positions[stayed])
        assert cache.regrouped == moved_total
        # The kernel layout moved with the segments: it equals one built afresh.
        kv = cache.compressed_kv()
        cache.segments_changed()
        fresh = cache.compressed_kv()
        for name in ("uk", "uv", "pos", "rank_k", "rank_v"):
            assert torch.equal(getattr(kv, name), getattr(fresh, name)), name
    assert moved_total > 0  # the workload's importance does move tokens across groups
    assert method.layer_metrics(0, cache)["regrouped_per_step"] == moved_total / workload.config.decode_steps


def test_partial_decompression_changes_the_output_but_not_storage(workload, full_outputs):
    full_rank = pack(rank_k=32, rank_v=32, backend="torch")
    partial = pack(rank_k=32, rank_v=32, groups=PAPER_GROUPS, backend="torch")
    f_out, f_caches = run(full_rank, workload, layers=[0])
    p_out, p_caches = run(partial, workload, layers=[0])
    assert full_rank.cache_bytes(f_caches[0]) == partial.cache_bytes(p_caches[0])
    assert mean_error(p_out, full_outputs[:1]) > mean_error(f_out, full_outputs[:1])


# --- rank schemes --------------------------------------------------------------------------------

def test_linear_scheme_rises_from_rank_min_to_rank(workload):
    method = pack(rank_scheme="linear", rank_min_k=4, rank_k=20, rank_min_v=8, rank_v=32)
    assert [method.layer_ranks(layer, 5) for layer in range(5)] == [(4, 8), (8, 14), (12, 20), (16, 26), (20, 32)]
    caches = method.prefill_all(list(workload.q), list(workload.k), list(workload.v), workload.spans)
    assert [(c.segments[0].k.rank, c.segments[0].v.rank) for c in caches] == [(4, 8), (20, 32)]
    with pytest.raises(ValueError, match="num_layers"):
        prefill(method, workload)
    spanning = pack(rank_scheme="linear", rank_min_k=4, rank_k=20, rank_min_v=8, rank_v=32, num_layers=5)
    metrics_1 = spanning.layer_metrics(1, prefill(spanning, workload, 1))
    assert (metrics_1["rank_k"], metrics_1["rank_v"]) == (8, 14)


def test_variance_scheme_picks_the_smallest_rank_reaching_the_target(workload):
    vis = workload.spans.visual_positions()
    rows = workload.v[0][:, vis].transpose(0, 1).reshape(VISUAL, WIDTH).double()
    energy = torch.linalg.svdvals(rows).square()
    captured = (energy.cumsum(0) / energy.sum()).tolist()
    target = (captured[7] + captured[8]) / 2  # rank 8 falls short, rank 9 reaches it
    method = pack(rank_scheme="variance", variance_target=target, rank_k=32, rank_v=32)
    m = method.layer_metrics(0, prefill(method, workload))
    assert m["rank_v"] == 9
    assert m["explained_variance_v"] == pytest.approx(captured[8], abs=1e-4)
    capped = pack(rank_scheme="variance", variance_target=1.0, rank_k=20, rank_v=12)
    m = capped.layer_metrics(0, prefill(capped, workload))
    assert (m["rank_k"], m["rank_v"]) == (20, 12) and m["explained_variance_v"] < 1.0


# --- eviction ------------------------------------------------------------------------------------

def test_eviction_keeps_the_first_group_and_shrinks_bytes(workload):
    decompress = pack(rank_k=16, rank_v=16, groups=PAPER_GROUPS, backend="torch")
    evict = pack(rank_k=16, rank_v=16, groups=PAPER_GROUPS, low_group="evict", backend="torch")
    d_cache, e_cache = prefill(decompress, workload), prefill(evict, workload)
    kept = e_cache.segments[0].positions
    assert kept.numel() == 16
    initial = metrics.causal_attention(workload.q[0][:, -1:], workload.k[0])[:, 0].mean(dim=0)
    vis = workload.spans.visual_positions().to(initial.device)  # the workload may live on a GPU
    assert set(kept.tolist()) == set(vis[initial[vis].topk(16).indices].tolist())
    # U loses 48 of its 64 rows (K and V, fp16); W is shared and stays.
    assert decompress.cache_bytes(d_cache) - evict.cache_bytes(e_cache) == 2 * 48 * 16 * 2
    _, caches = run(evict, workload, layers=[0])
    m = evict.layer_metrics(0, caches[0])
    assert m["compressed_tokens"] == 16 and m["evicted_tokens"] == 48
    assert m["decompression_flops_ratio"] == pytest.approx(0.25)
    # The formula stands for the 64 tokens admitted, stored as 16 rows: eviction raises it.
    kv, d = caches[0].kv_heads, caches[0].head_dim
    assert m["formula_compression_ratio"] == pytest.approx(paper_compression_ratio(64, kv, d, 16, 16, held=16))
    assert m["formula_compression_ratio"] > 3 * paper_compression_ratio(16, kv, d, 16, 16)
    # With folding each segment's budget follows the tokens it admitted: the visual one keeps int(64 * 0.25),
    # the generated one max(1, int(6 * 0.25)).
    _, caches = run(pack(rank_k=16, rank_v=16, groups=PAPER_GROUPS, low_group="evict", period=3,
                                  backend="torch"), workload, layers=[0])
    assert [s.tokens for s in caches[0].segments] == [16, 1] and caches[0].buffer == 0
    assert caches[0].segments[1].admitted == 6
    # Tokens held can drop below the rank; a fold factorizes at what they allow (1 token: rank 1).
    _, caches = run(pack(rank_k=32, rank_v=32, text_rank=8, groups=PAPER_GROUPS, low_group="evict", period=3,
                                  backend="torch"), workload, layers=[0])
    visual, generated = caches[0].segments
    assert visual.k.rank == visual.v.rank == 32 and generated.k.rank == generated.v.rank == 1


# --- validation ----------------------------------------------------------------------------------

def test_bad_settings_get_clear_errors(workload):
    with pytest.raises(ValueError, match="rank_k=0 is below its minimum"):
        AttentionPack.from_dict({"rank_k": 0})
    with pytest.raises(ValueError, match=r"layer 0: rank_k=65 of the visual segment exceeds min\(T, H\*D\) = "
                                         r"min\(64, 64\) = 64"):
        prefill(pack(rank_k=65), workload)
    with pytest.raises(ValueError, match=r"layer 1: rank_v=33 .* min\(T, D\) = min\(64, 32\)"):
        prefill(pack(rank_k=8, rank_v=33, head_mode="per_head"), workload, 1)
    with pytest.raises(ValueError, match="text segment exceeds"):
        prefill(pack(compress_text=True, text_rank=25), workload)
    with pytest.raises(ValueError, match="token fractions must sum to 1"):
        pack(groups="0.5:1,0.4:0.25")
    with pytest.raises(ValueError, match="must start at 1"):
        pack(groups="0.5:0.5,0.5:1")
    with pytest.raises(ValueError, match="is not well-formed"):
        pack(groups="0.5,0.5")
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        pack(groups="1:1.5")
    with pytest.raises(ValueError, match="absorbed=True .* rope='after'"):
        pack(absorbed=True)
    with pytest.raises(ValueError, match="quant_group=5 must be a multiple of 8 // quant_bits for 4-bit"):
        pack(quant_bits=4, quant_group=5)
    with pytest.raises(ValueError, match="rises from rank_min"):
        pack(rank_scheme="linear", rank_min_k=80)
    with pytest.raises(ValueError, match="quant_bits=3"):
        pack(quant_bits=3)


def test_mismatched_shapes_get_clear_errors(workload):
    method = pack(rank_k=8, rank_v=8, backend="torch")
    q, k, v = workload.q[0], workload.k[0], workload.v[0]
    with pytest.raises(ValueError, match="layer 0: q must be"):
        method.prefill(0, q, k, v[:, :-1], workload.spans)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        method.prefill(0, q[:3], k, v, workload.spans)
    with pytest.raises(ValueError, match="spans describe 88"):
        method.prefill(0, q[:, :-1], k[:, :-1], v[:, :-1], workload.spans)
    cache = prefill(method, workload)
    q_t, k_t, v_t = workload.decode_q[0][0], workload.decode_k[0][0], workload.decode_v[0][0]
    with pytest.raises(ValueError, match=r"k_t, v_t \[2, 1, 32\]"):
        method.decode(0, cache, q_t, k_t[:1], v_t)
    with pytest.raises(ValueError, match="expected q_t"):
        method.decode(0, cache, q_t[..., :16], k_t, v_t)
    with pytest.raises(TypeError, match="the cache its prefill built"):
        method.decode(0, make_method("full").prefill(0, q, k, v, workload.spans), q_t, k_t, v_t)


# --- determinism, drivers, kernel ----------------------------------------------------------------

def test_same_seed_same_result_and_seed_matters(workload):
    a = run(pack(rank_k=8, rank_v=8, backend="torch"), workload, layers=[0])[0][0]
    b = run(pack(rank_k=8, rank_v=8, backend="torch"), workload, layers=[0])[0][0]
    c = run(pack(rank_k=8, rank_v=8, seed=1, backend="torch"), workload, layers=[0])[0][0]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_runs_through_the_ablation_driver(monkeypatch):
    monkeypatch.setitem(METHODS, "attentionpack", AttentionPack)
    workload = SMALL.to_dict()
    exact = ablation.run("attentionpack", {"rank_k": 64, "rank_v": 64, "factor_dtype": "float32", "groups": "1:1",
                                           "backend": "torch"}, workload)
    assert exact["metrics"]["rel_err_max"] < 1e-4
    assert exact["metrics"]["ppci_90"] == pytest.approx(1.0)
    small = ablation.run("attentionpack", {"rank_k": 8, "rank_v": 8, "groups": PAPER_GROUPS, "backend": "torch"},
                         workload)
    assert small["metrics"]["compression_ratio"] > 2.0
    assert 0 < small["metrics"]["rel_err_mean"] < 1.0


@pytest.mark.parametrize("settings", [dict(rope="before"), dict(rope="after", absorbed=True)],
                         ids=["rope_before", "absorbed"])
def test_triton_kernel_matches_the_reference(settings, monkeypatch):
    from kernels_py.ops import lowrank_decode as kernels

    calls = []
    for name in ("lowrank_decode", "lowrank_decode_absorbed"):
        def counted(*args, _kernel=getattr(kernels, name), _name=name, **kwargs):
            calls.append(_name)
            return _kernel(*args, **kwargs)
        monkeypatch.setattr(kernels, name, counted)
    cfg = SyntheticConfig(layers=1, heads=2, kv_heads=1, head_dim=16, tokens_per_image=16, system_tokens=4,
                          text_tokens=4, decode_steps=3, salient_tokens=4, targets_per_query=2)
    wl = generate(cfg)
    # The third step attends over the segment the first fold (after step 2) made.
    common = dict(rank_k=8, rank_v=8, groups="0.5:1,0.5:0.5", partial="both", period=2, **settings)
    t_out, t_caches = run(pack(backend="triton", **common), wl)
    expected = "lowrank_decode_absorbed" if settings.get("absorbed") else "lowrank_decode"
    assert calls == [expected] * cfg.decode_steps
    r_out, r_caches = run(pack(backend="torch", **common), wl)
    assert len(calls) == cfg.decode_steps  # the reference path never reaches the kernels
    for o, r in zip(t_out[0], r_out[0]):
        torch.testing.assert_close(o, r, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(t_caches[0].scores, r_caches[0].scores, atol=1e-4, rtol=1e-3)



def test_defaults_are_the_papers_setting(workload):
    """Visual tokens compressed, text and generated tokens not (period 0),
    values decompressed in two groups (25% at full rank, 75% at R/4), keys at
    full rank."""
    method = AttentionPack(backend="torch")
    assert (method.groups, method.partial, method.period) == ("0.25:1,0.75:0.25", "values", 0)
    _, caches = run(AttentionPack(rank_k=16, rank_v=16, backend="torch"), workload, layers=[0])
    cache = caches[0]
    assert cache.folds == 0 and len(cache.segments) == 1
    assert cache.dense_positions.shape[0] == workload.spans.prompt_tokens - workload.spans.visual_positions().numel() \
        + workload.decode_q[0].shape[0]  # text, then every generated token, uncompressed
    m = AttentionPack(rank_k=16, rank_v=16, backend="torch").layer_metrics(0, cache)
    assert m["decompression_flops_ratio"] < 1.0


def test_a_cache_wider_than_the_kernels_rank_space_is_refused_before_the_kernel():
    """Per head, W is block-diagonal: rank x kv_heads columns of values, past
    the 256 the decode kernel holds in rank space. The method says which
    settings to change, before the kernel's own check."""
    cfg = SyntheticConfig(layers=1, heads=16, kv_heads=16, head_dim=32, tokens_per_image=32, system_tokens=4,
                          text_tokens=4, decode_steps=1, salient_tokens=4, targets_per_query=2, dtype="float32")
    wl = generate(cfg)
    q_t, k_t, v_t = (t[0][0] for t in (wl.decode_q, wl.decode_k, wl.decode_v))
    wide = pack(rank_k=17, rank_v=17, head_mode="per_head", period=0, backend="triton")
    with pytest.raises(ValueError, match=r"holds values in rank space, at most 256 columns, and this cache needs 272 "
                                         r"\(visual 17 x 16 kv heads .*head_mode=combined.*backend=torch"):
        wide.prefill(0, wl.q[0], wl.k[0], wl.v[0], wl.spans)
    # What folds will add counts at prefill: 16 columns a head fit, the generated segment's 2 more would not.
    with pytest.raises(ValueError, match=r"needs 288 \(visual 16 \+ generated 2 x 16 kv heads"):
        pack(rank_k=16, rank_v=16, head_mode="per_head", period=2, text_rank=2, backend="triton").prefill(
            0, wl.q[0], wl.k[0], wl.v[0], wl.spans)
    # A cache built on the reference is checked again before the kernel attends.
    reference = pack(rank_k=17, rank_v=17, head_mode="per_head", period=0, backend="torch")
    cache = reference.prefill(0, wl.q[0], wl.k[0], wl.v[0], wl.spans)
    with pytest.raises(ValueError, match="this cache needs 272"):
        wide.decode(0, cache, q_t, k_t, v_t)
    # The reference has no such limit, and 16 columns a head fit the kernel.
    for method in (pack(rank_k=17, rank_v=17, head_mode="per_head", period=0, backend="torch"),
                   pack(rank_k=16, rank_v=16, head_mode="per_head", period=0, backend="triton")):
        cache = method.prefill(0, wl.q[0], wl.k[0], wl.v[0], wl.spans)
        assert method.decode(0, cache, q_t, k_t, v_t).shape == (16, 1, 32)


# --- what the cache really holds, and prompts without images ------------------------------------

def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind the tensors (views of one storage count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _held_factor_tensors(cache):
    held = [t for s in cache.segments for f in (s.k, s.v) for t in (f.u, f.w)]
    if cache._layout is not None:
        held += [cache._layout.uk, cache._layout.wk, cache._layout.uv, cache._layout.wv]
    return held


@pytest.mark.parametrize("settings", [dict(), dict(compress_text=True, text_rank=8), dict(period=3),
                                      dict(period=3, compress_text=True, text_rank=8, low_group="evict",
                                           groups=PAPER_GROUPS)],
                         ids=["visual", "text_segment", "folded", "folded_evicted"])
def test_factors_are_held_once_after_decode_steps(workload, settings):
    """The decode op's layout of the factors was a second copy of them, kept
    between steps, so the cache held twice the factor bytes it reported;
    the segments' factors are now views of that layout, and get their own
    copies when the segments change (a fold, an eviction), which frees it."""
    method = pack(rank_k=16, rank_v=16, backend="torch", **settings)
    _, (cache,) = run(method, workload, layers=[0])
    if cache._layout is None:  # a fold on the last step dropped it
        assert _storage_bytes(_held_factor_tensors(cache)) == factor_bytes(cache)
    cache.compressed_kv()  # the layout the next step reads
    # One segment: exactly the factors' bytes. Several: the block-diagonal U's zero blocks besides.
    zeros = 0
    if len(cache.segments) > 1:
        total = sum(s.tokens for s in cache.segments)
        zeros = sum((total - s.tokens) * (s.k.rank + s.v.rank) * 2 for s in cache.segments)  # fp16
    assert _storage_bytes(_held_factor_tensors(cache)) == factor_bytes(cache) + zeros


def test_factor_views_follow_regrouping(workload):
    """Regrouping moves the layout's U rows once; the segments' views show the move."""
    method = pack(rank_k=16, rank_v=16, groups=PAPER_GROUPS, backend="torch")
    _, (cache,) = run(method, workload, layers=[0])
    assert cache.regrouped > 0
    seg, lay = cache.segments[0], cache._layout
    assert torch.equal(seg.v.u, lay.uv[0]) and torch.equal(seg.positions, lay.pos[0])
    rebuilt = seg.v.u.float() @ seg.v.w.float()
    fresh = prefill(method, workload)  # same factors, slots in prefill's order
    order = fresh.segments[0].positions.argsort()
    expect = (fresh.segments[0].v.u.float() @ fresh.segments[0].v.w.float())[order]
    torch.testing.assert_close(rebuilt[seg.positions.argsort()], expect)


@pytest.mark.parametrize("settings", [dict(), dict(compress_text=True, text_rank=8), dict(period=3),
                                      dict(head_mode="per_head"), dict(backend="triton")],
                         ids=["default", "text_segment", "folded", "per_head", "triton"])
def test_a_prompt_without_visual_tokens_keeps_its_tokens_uncompressed(workload, settings, monkeypatch):
    """Section 3.1 compresses the visual tokens: a text-only prompt has none,
    so nothing is factorized (the method refused it, saying rank_k exceeds
    min(0, H*D)) and attention is exact."""
    from kernels_py.attention import Spans
    tokens = 24
    spans = Spans((0, 8), (), (8, tokens), workload.spans.rope)
    method = pack(rank_k=16, rank_v=16, **{"backend": "torch", **settings})
    full = make_method("full")
    cache = method.prefill(0, *(t[0][:, :tokens] for t in (workload.q, workload.k, workload.v)), spans)
    reference = full.prefill(0, *(t[0][:, :tokens] for t in (workload.q, workload.k, workload.v)), spans)
    assert cache.segments[0].tokens == 0 and cache.segments[0].k.rank == 0
    for step in range(4):
        q_t, k_t, v_t = (t[0][step] for t in (workload.decode_q, workload.decode_k, workload.decode_v))
        out, want = method.decode(0, cache, q_t, k_t, v_t), full.decode(0, reference, q_t, k_t, v_t)
        if not settings.get("compress_text") and not settings.get("period"):
            torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        assert torch.isfinite(out).all()
    found = method.layer_metrics(0, cache)
    assert found["rank_k"] == 0 and found["formula_compression_ratio"] == 1.0 and found["explained_variance_k"] == 1
