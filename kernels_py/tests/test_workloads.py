"""The synthetic workload has the shapes it documents and the attention
structure the papers measured."""

import pytest
import torch

from kernels_py import metrics
from kernels_py.attention import Spans, apply_rope
from kernels_py.workloads import SyntheticConfig, generate

SMALL = dict(layers=2, heads=4, kv_heads=2, head_dim=32, tokens_per_image=64, system_tokens=8,
             text_tokens=16, decode_steps=3, salient_tokens=8)


@pytest.fixture(scope="module")
def default():
    """The default workload (the one the papers' numbers are checked on)."""
    return generate(SyntheticConfig())


def sparse_layers(workload):
    return range(workload.config.dense_layers, workload.config.layers)


def explained_variance(rows: torch.Tensor, rank: int) -> float:
    """Share of the (uncentered) energy in the top `rank` singular directions."""
    energy = torch.linalg.svdvals(rows.double()).square()
    return (energy[:rank].sum() / energy.sum()).item()


def heads_side_by_side(per_head: torch.Tensor) -> torch.Tensor:
    """[kv_heads, T, d] -> [T, kv_heads * d]: AttentionPack's multi-head layout."""
    return per_head.transpose(0, 1).reshape(per_head.shape[1], -1)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_shapes_dtypes_and_device(dtype, device):
    cfg = SyntheticConfig(dtype=dtype, **SMALL)
    wl = generate(cfg)
    prompt = 8 + 64 + 16
    assert len(wl.q) == len(wl.k) == len(wl.v) == len(wl.decode_q) == len(wl.decode_k) == len(wl.decode_v) == 2
    for layer in range(2):
        assert wl.q[layer].shape == (4, prompt, 32)
        assert wl.k[layer].shape == wl.v[layer].shape == (2, prompt, 32)
        assert wl.decode_q[layer].shape == (3, 4, 1, 32)
        assert wl.decode_k[layer].shape == wl.decode_v[layer].shape == (3, 2, 1, 32)
        for t in (wl.q[layer], wl.k[layer], wl.v[layer], wl.decode_q[layer], wl.decode_k[layer], wl.decode_v[layer]):
            assert t.dtype == cfg.torch_dtype and t.device.type == device.type
            assert torch.isfinite(t.float()).all()
    assert wl.positions.tolist() == list(range(prompt))
    assert wl.decode_positions.tolist() == [prompt, prompt + 1, prompt + 2]


def test_spans_cover_the_prompt_in_order():
    spans = SyntheticConfig(images=3, tokens_per_image=256, system_tokens=5, text_tokens=7).spans()
    assert spans.system == (0, 5)
    assert spans.images == ((5, 261), (261, 517), (517, 773))
    assert spans.text == (773, 780)
    assert spans.prompt_tokens == 780
    assert spans.visual_positions().tolist() == list(range(5, 773))


def test_spans_built_by_hand_are_checked_and_made_tuples():
    """Spans a script writes itself: lists become tuples (so they hash, as
    the workloads' do); one image given as a bare pair, a float bound or
    images out of order are refused naming the field, where they failed
    inside a method ("cannot unpack non-iterable int object") or ran."""
    spans, same = Spans(system=[0, 8], images=[[8, 152]], text=[152, 176]), Spans((0, 8), ((8, 152),), (152, 176))
    assert spans == same and hash(spans) == hash(same)
    with pytest.raises(TypeError, match=r"spans.images must be a sequence of \(start, end\) pairs, one per image, got "
                                        r"\(8, 152\): for one image, images=\(\(8, 152\),\)"):
        Spans((0, 8), (8, 152), (152, 176))
    with pytest.raises(TypeError, match=r"spans.images\[0\] must be a \(start, end\) pair of ints, got \(8.0, 152\)"):
        Spans((0, 8), ((8.0, 152),), (152, 176))
    with pytest.raises(ValueError, match=r"spans.text must be a \(start, end\) range with 0 <= start <= end"):
        Spans((0, 8), ((8, 152),), (176, 152))
    with pytest.raises(ValueError, match="the images in order and without overlap"):
        Spans((0, 8), ((8, 100), (90, 152)), (152, 176))


def test_same_seed_same_tensors_different_seed_different():
    a, b = generate(SyntheticConfig(**SMALL)), generate(SyntheticConfig(**SMALL))
    c = generate(SyntheticConfig(seed=1, **SMALL))
    for name in ("q", "k", "v", "decode_q", "decode_k", "decode_v"):
        for layer in range(2):
            assert torch.equal(getattr(a, name)[layer], getattr(b, name)[layer])
            assert not torch.equal(getattr(a, name)[layer], getattr(c, name)[layer])
    assert a.sinks == b.sinks


def test_layers_do_not_depend_on_the_layer_count():
    two = generate(SyntheticConfig(**SMALL))
    three = generate(SyntheticConfig(**{**SMALL, "layers": 3}))
    for layer in range(2):
        assert torch.equal(two.k[layer], three.k[layer]) and torch.equal(two.q[layer], three.q[layer])


def test_apply_rope_is_a_relative_rotation():
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    positions = torch.arange(10, 15)
    rotated = apply_rope(x, positions, 10000.0)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(apply_rope(rotated, -positions, 10000.0), x)
    # q.k after RoPE depends on the distance only: shifting both changes nothing.
    q, k = x[:, :1], x[:, 1:2]
    near = (apply_rope(q, torch.tensor([7]), 500.0) * apply_rope(k, torch.tensor([3]), 500.0)).sum()
    far = (apply_rope(q, torch.tensor([107]), 500.0) * apply_rope(k, torch.tensor([103]), 500.0)).sum()
    torch.testing.assert_close(near, far)


def test_visual_keys_and_values_are_low_rank_across_heads(default):
    """AttentionPack Figure 2: visual K/V concatenated over heads keep most of
    their energy at rank 64; keys are decomposed before RoPE, as its code does."""
    visual = default.spans.visual_positions()
    keys = apply_rope(default.k[0].double(), -default.positions, default.config.rope_base)[:, visual]
    values = default.v[0][:, visual]
    assert explained_variance(heads_side_by_side(keys), 64) > 0.9
    assert explained_variance(heads_side_by_side(values), 64) > 0.9
    # The structure is shared across heads: at the same per-token storage, one
    # rank-2r SVD over both heads keeps more than a rank-r SVD per head.
    energy = keys.square().sum(dim=(1, 2))
    for rank in (16, 32):
        per_head = sum(explained_variance(keys[h], rank) * energy[h] for h in range(2)) / energy.sum()
        assert explained_variance(heads_side_by_side(keys), 2 * rank) > per_head + 0.02
    # RoPE was applied to the stored keys: rotated, they are less compressible.
    assert explained_variance(heads_side_by_side(default.k[0][:, visual]), 64) < explained_variance(
        heads_side_by_side(keys), 64
    ) - 0.05


def test_dense_first_layers_then_sparse(default):
    """VL-Cache Figure 2 / Eq. 2: the first two layers are much denser."""
    gamma = [metrics.layer_sparsity(metrics.causal_attention(q, k)).mean().item() for q, k in zip(default.q, default.k)]
    dense, sparse = gamma[: default.config.dense_layers], gamma[default.config.dense_layers:]
    assert max(dense) < 0.6 and min(sparse) > 0.9
    assert max(dense) < min(sparse)


def test_sinks_draw_heavy_attention(default):
    visual = default.spans.visual_positions()
    for layer in sparse_layers(default):
        received = metrics.causal_attention(default.q[layer], default.k[layer]).mean(dim=(0, 1))  # per key
        assert received.argmax().item() == 0
        typical_visual = received[visual].median()
        for sink in default.sinks:
            assert received[sink] > 20 * typical_visual


def top_share(attention: torch.Tensor, columns: torch.Tensor, top: int) -> float:
    """Mean share of the attention over `columns` that the top `top` of them take."""
    among = attention[..., columns]
    return (among.topk(top, dim=-1).values.sum(-1) / among.sum(-1)).mean().item()


def test_text_queries_sharp_visual_queries_broad(default):
    """VL-Cache section 3 / Figure 1b: post-vision text queries concentrate on a
    few visual tokens; visual queries spread over many."""
    spans = default.spans
    non_sink_visual = torch.tensor([p for p in spans.visual_positions().tolist() if p not in default.sinks])
    late_visual_rows = torch.arange(spans.images[0][0] + 288, spans.images[0][1])  # rows that see many visual keys
    for layer in range(default.config.layers):
        attention = metrics.causal_attention(default.q[layer], default.k[layer])
        text = top_share(attention[:, spans.text[0]: spans.text[1]], non_sink_visual, 8)
        visual = top_share(attention[:, late_visual_rows], non_sink_visual, 8)
        assert text > 2 * visual
        if layer >= default.config.dense_layers:
            assert text > 0.6 and visual < 0.3


def test_post_vision_attention_predicts_decoding(default):
    """VL-Cache Figure 3: ranking tokens by post-vision attention keeps more of the
    first decoding query's top tokens than ranking by accumulated attention."""
    spans = default.spans
    keep = spans.prompt_tokens // 10
    post_vision, accumulated = [], []
    for layer in range(default.config.layers):
        attention = metrics.causal_attention(default.q[layer], default.k[layer])
        truth = metrics.causal_attention(default.decode_q[layer][0], default.k[layer], spans.prompt_tokens)[:, 0]
        for scores, out in ((attention[:, spans.text[0]:].sum(1), post_vision), (attention.sum(1), accumulated)):
            out.append(metrics.cache_hit_rate(scores.topk(keep).indices, truth).mean().item())
    assert sum(post_vision) > sum(accumulated) + 0.1 * len(post_vision)


def test_decode_attention_is_continuous_across_steps(default):
    """A-VL Figure 5: the top half of the image tokens stays largely the same
    from one decoding step to the next."""
    visual = default.spans.visual_positions()
    for layer in sparse_layers(default):
        keys = default.k[layer].repeat_interleave(4, dim=0).transpose(1, 2)  # 8 query heads on 2 kv heads
        first, later = ((default.decode_q[layer][s] @ keys)[:, 0, visual] for s in (0, 1))
        assert metrics.ppci(first, later, 0.5).mean().item() > 0.6


def test_from_dict_accepts_json_values():
    cfg = SyntheticConfig.from_dict({"rope_base": 500, "layers": 3, "dtype": "float16"})
    assert cfg.rope_base == 500.0 and isinstance(cfg.rope_base, float)
    assert cfg.layers == 3 and cfg.torch_dtype == torch.float16
    assert SyntheticConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "values,error,match",
    [
        ({"layer": 3}, ValueError, "unknown parameter.*'layer'"),
        ({"layers": 2.0}, TypeError, "layers must be int"),
        ({"layers": True}, TypeError, "layers must be int"),
        ({"layers": "4"}, TypeError, "layers must be int"),
        ({"rope_base": "1e4"}, TypeError, "rope_base must be float"),
        ({"rope_base": float("nan")}, ValueError, "finite"),
        ({"dtype": "int8"}, ValueError, "dtype='int8' is not one of"),
        ({"layers": 0}, ValueError, "below its minimum"),
        ({"heads": 6, "kv_heads": 4}, ValueError, "multiple of kv_heads"),
        ({"tokens_per_image": 16}, ValueError, "must fit in tokens_per_image .*tokens_per_image=16"),
        # 4 - 1 + 2 * 8 fits in the two images' 20 visual tokens, but all three visual sinks may land in one of
        # them, which then has 7 tokens for its 8 salient ones.
        ({"images": 2, "tokens_per_image": 10, "salient_tokens": 8, "targets_per_query": 2}, ValueError,
         "any image may hold every sink.*salient_tokens=8, tokens_per_image=10"),
    ],
)
def test_from_dict_rejects_bad_values(values, error, match):
    with pytest.raises(error, match=match):
        SyntheticConfig.from_dict(values)


def test_lmms_shards_past_its_limit_are_refused():
    """Document i of the first `limit` goes to shard i mod shards: more shards than documents would plan jobs
    that hold none, which the workload refuses on construction (and `workbench plan` before anything runs)."""
    from kernels_py.workloads import make_workload

    knobs = {"model": "m", "tasks": "t", "limit": 2}
    assert make_workload("lmms", {**knobs, "shards": 2, "shard": 1}).shards == 2
    with pytest.raises(ValueError, match="shards 4 is more than limit 2: .* use at most 2 shards"):
        make_workload("lmms", {**knobs, "shards": 4})


def test_a_vlm_workload_without_images_or_videos_is_refused():
    """The model runs a prompt with its images or videos: one with neither fails every job, so the workload
    refuses it on construction (and `workbench plan` before anything runs)."""
    from kernels_py.workloads import make_workload

    knobs = {"model": "m", "prompt": "USER: <image> hi"}
    assert make_workload("vlm", {**knobs, "images": "a.png"}).image_list() == ["a.png"]
    assert make_workload("vlm", {**knobs, "videos": "a.mp4"}).videos == "a.mp4"
    for images in ("", " , "):
        with pytest.raises(ValueError, match="needs images= or videos="):
            make_workload("vlm", {**knobs, "images": images})
    # The video knobs sample videos: without one they would only change the job's id.
    for video_knobs in ({"frames": 16}, {"fps": 2.0}):
        with pytest.raises(ValueError, match="frames= and fps= sample videos, and no videos= is given"):
            make_workload("vlm", {**knobs, "images": "a.png", **video_knobs})
        assert make_workload("vlm", {**knobs, "videos": "a.mp4", **video_knobs}).video_list


def test_from_dict_rejects_a_non_mapping():
    with pytest.raises(TypeError, match="mapping"):
        SyntheticConfig.from_dict([("layers", 2)])


@pytest.mark.parametrize("change, message", [
    (lambda w: {"k": tuple(t[:1] for t in w.k), "v": tuple(t[:1] for t in w.v),
                "decode_k": tuple(t[:, :1] for t in w.decode_k), "decode_v": tuple(t[:, :1] for t in w.decode_v)},
     None),  # one kv head for four query heads: fine
    (lambda w: {"k": tuple(torch.cat([t, t[:1]]) for t in w.k), "v": tuple(torch.cat([t, t[:1]]) for t in w.v),
                "decode_k": tuple(torch.cat([t, t[:, :1]], 1) for t in w.decode_k),
                "decode_v": tuple(torch.cat([t, t[:, :1]], 1) for t in w.decode_v)},
     "4 query heads are not a multiple of its 3 kv heads"),
    (lambda w: {"v": (w.v[0][:, :-1],) + w.v[1:]}, r"v\[0\] is \[2, 87, 32\], not \[2, 88, 32\]"),
    (lambda w: {"decode_q": tuple(t[:, :, 0] for t in w.decode_q)}, r"q\[0\] is \[4, 88, 32\], k\[0\] \[2, 88, 32\], decode_q\[0\] \[3, 4, 32\]"),
    (lambda w: {"q": w.q[:1]}, "layer counts differ or are zero: q 1, k 2"),
    (lambda w: {name: tuple(t[:0] for t in getattr(w, name)) for name in ("decode_q", "decode_k", "decode_v")},
     r"decode_q\[0\] is \[0, 4, 1, 32\]: no decode step"),
    (lambda w: {"q": tuple(t[:, :-1] for t in w.q), "k": tuple(t[:, :-1] for t in w.k),
                "v": tuple(t[:, :-1] for t in w.v)}, r"spans end at token 88 \(spans.text\[1\]\) but its prompt has 87"),
])
def test_a_workload_with_tensors_that_disagree_says_which(change, message):
    """A workload being written that builds tensors of the wrong shapes is
    told so where it builds them, not by a broadcasting error in a method."""
    import dataclasses

    w = generate(SyntheticConfig(**SMALL, dtype="float32"))
    if message is None:
        dataclasses.replace(w, **change(w))
        return
    with pytest.raises(ValueError, match=f"workload 'synthetic' built a Workload whose {message}"):
        dataclasses.replace(w, **change(w))
