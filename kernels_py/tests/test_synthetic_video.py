"""The synthetic workload's video frames: neighbouring frames alike by
frame_correlation, salient tokens recurring, one span per frame, knobs that
cannot work together refused; and the ablation's prefill sparsity at video
lengths, summed over row blocks."""

import pytest
import torch

from kernels_py import ablation, metrics
from kernels_py.attention import apply_rope
from kernels_py.params import knob
from kernels_py.workloads import SyntheticConfig, generate
from kernels_py.workloads.synthetic import _video_frames, channel_layout

FRAMES = {"layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 32, "images": 12, "tokens_per_image": 64,
          "system_tokens": 8, "text_tokens": 16, "decode_steps": 3, "salient_tokens": 8, "dtype": "float32"}


def frame_keys(wl, layer=1) -> torch.Tensor:
    """[frames, tokens, kv_heads * content]: each frame's visual keys before RoPE, content channels only."""
    cfg = wl.config
    keys = apply_rope(wl.k[layer].double(), -wl.positions, cfg.rope_base)[..., channel_layout(cfg.head_dim).content]
    frames = torch.stack([keys[:, start:end] for start, end in wl.spans.images])  # [F, kv, T, c]
    return frames.transpose(1, 2).flatten(2)


def frame_values(wl, layer=1) -> torch.Tensor:
    frames = torch.stack([wl.v[layer][:, start:end].double() for start, end in wl.spans.images])
    return frames.transpose(1, 2).flatten(2)


def correlation(frames: torch.Tensor, distance: int, keep: torch.Tensor) -> float:
    """Pearson correlation between frame f and frame f + distance at the same token positions
    (positions where `keep` is False, sinks, are left out), each channel centred."""
    a, b = frames[:-distance][:, keep], frames[distance:][:, keep]
    a, b = a - a.mean(dim=(0, 1)), b - b.mean(dim=(0, 1))
    return ((a * b).sum() / (a.norm() * b.norm())).item()


def not_sinks(wl) -> torch.Tensor:
    """[tokens_per_image] False at an offset that holds a sink in any frame."""
    keep = torch.ones(wl.config.tokens_per_image, dtype=torch.bool)
    for start, end in wl.spans.images:
        keep[[p - start for p in wl.sinks if start <= p < end]] = False
    return keep


def test_neighbouring_frames_correlate_by_rho_and_distant_ones_much_less():
    rho = 0.9
    wl = generate(SyntheticConfig(video=True, frame_correlation=rho, **FRAMES))
    keep = not_sinks(wl)
    for frames in (frame_keys(wl), frame_values(wl)):
        near, far = correlation(frames, 1, keep), correlation(frames, 8, keep)
        assert abs(near - rho) < 0.05, near
        assert abs(far - rho ** 8) < 0.15 and far < near - 0.3, (near, far)
    independent = generate(SyntheticConfig(video=True, **FRAMES))
    assert abs(correlation(frame_keys(independent), 1, not_sinks(independent))) < 0.05


def test_a_still_scene_repeats_every_frame_up_to_the_noise():
    wl = generate(SyntheticConfig(video=True, frame_correlation=1.0, **FRAMES))
    assert correlation(frame_keys(wl), 11, not_sinks(wl)) > 0.99


def test_salient_tokens_recur_moved_a_little_with_their_latents():
    cfg = SyntheticConfig(video=True, salient_recurrence=1.0, salient_motion=2, **FRAMES)
    wl = generate(cfg)
    frames = _video_frames(cfg, wl.spans, wl.sinks, 1)
    pool = frames.pool.reshape(cfg.images, cfg.salient_tokens) - torch.tensor([s for s, _ in wl.spans.images])[:, None]
    keys, recurring = frame_keys(wl), 0
    for f in range(1, cfg.images):
        source, destination = frames.moves[f]
        assert set(destination) <= set(pool[f].tolist()) and set(source) <= set(pool[f - 1].tolist())
        assert all(abs(d - s) <= 2 for s, d in zip(source, destination))
        # frame_correlation 0: only the copy makes a recurring token's key its source's
        alike = torch.cosine_similarity(keys[f, destination], keys[f - 1, source], dim=-1)
        assert (alike > 0.95).all(), alike
        recurring += len(source)
    # Nearly every salient token recurs (a few collide with a sink or each other, or leave the frame).
    assert recurring >= 0.8 * (cfg.images - 1) * cfg.salient_tokens, recurring
    assert not any(_video_frames(SyntheticConfig(video=True, **FRAMES), wl.spans, wl.sinks, 1).moves[f][0]
                   for f in range(cfg.images))


def test_a_clip_shares_one_basis_so_its_tokens_are_low_rank_across_frames():
    def explained(wl):
        start, end = wl.spans.images[0][0], wl.spans.images[-1][1]
        rows = wl.v[1][:, start:end].transpose(0, 1).flatten(1).double()
        rows = rows - rows.mean(0)
        energy = torch.linalg.svdvals(rows).square()
        return (energy[:wl.config.visual_rank].sum() / energy.sum()).item()

    shape = dict(FRAMES, visual_rank=16)
    assert explained(generate(SyntheticConfig(video=True, **shape))) > 0.95
    assert explained(generate(SyntheticConfig(**shape))) < 0.6


def test_one_span_per_frame_and_sixty_four_frames_generate():
    cfg = SyntheticConfig(**dict(FRAMES, images=64, layers=1, video=True, frame_correlation=0.9,
                                 salient_recurrence=0.5))
    wl = generate(cfg)
    assert wl.spans.images == tuple((8 + 64 * f, 8 + 64 * (f + 1)) for f in range(64))
    assert wl.k[0].shape == (2, 8 + 64 * 64 + 16, 32) and torch.isfinite(wl.q[0]).all()


def test_without_video_the_knobs_are_todays_workload():
    """Defaults stay the independent images (test_golden.py pins their results)."""
    plain = generate(SyntheticConfig(**FRAMES))
    spelt = generate(SyntheticConfig(video=False, frame_correlation=0.0, salient_recurrence=0.0, **FRAMES))
    for name in ("q", "k", "v", "decode_q", "decode_k", "decode_v"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(plain, name), getattr(spelt, name)))
    video = generate(SyntheticConfig(video=True, **FRAMES))
    assert not torch.equal(plain.k[0], video.k[0])


@pytest.mark.parametrize("values,match", [
    ({"frame_correlation": 0.5}, "frame_correlation=0.5 needs video = True"),
    ({"salient_recurrence": 0.5}, "salient_recurrence=0.5 needs video = True"),
    ({"video": True, "frame_correlation": 1.5}, "frame_correlation=1.5 is above its maximum 1.0"),
    ({"video": True, "salient_motion": -1}, "salient_motion=-1 is below its minimum 0"),
    ({"video": True, "images": 4, "tokens_per_image": 16, "salient_tokens": 14},
     "every frame holds its salient tokens .*salient_tokens=14, tokens_per_image=16"),
])
def test_bad_video_knobs_are_refused(values, match):
    with pytest.raises(ValueError, match=match):
        SyntheticConfig.from_dict(values)


def test_causal_sparsity_in_row_blocks_equals_the_whole_matrix():
    g = torch.Generator().manual_seed(0)
    q, k = 2 * torch.randn(4, 96, 16, generator=g), 2 * torch.randn(2, 96, 16, generator=g)
    whole = metrics.layer_sparsity(metrics.causal_attention(q, k))
    assert torch.allclose(metrics.causal_sparsity(q, k, max_entries=4 * 96 * 5), whole)
    rows = torch.arange(80, 96)
    tail = metrics.layer_sparsity(metrics.causal_attention(q, k)[:, rows], query_start=80)
    assert torch.allclose(metrics.causal_sparsity(q[:, rows], k, 80, max_entries=100), tail)


def test_the_ablation_never_holds_a_video_prompts_whole_attention(monkeypatch):
    wl = dict(FRAMES, images=4, video=True, frame_correlation=0.9)
    whole = ablation.run("full", {}, wl)
    ablation._reference.cache_clear()
    monkeypatch.setattr(metrics, "WHOLE_ATTENTION_ENTRIES", 1000)
    calls = []
    monkeypatch.setattr(metrics, "causal_attention", lambda q, k, *args, **kwargs: calls.append(
        q.shape[0] * q.shape[1] * k.shape[1]) or CAUSAL_ATTENTION(q, k, *args, **kwargs))
    blocked = ablation.run("full", {}, wl)
    ablation._reference.cache_clear()
    prompt = 8 + 4 * 64 + 16
    assert max(calls) <= 2000 < 4 * prompt * prompt, max(calls)  # blocks, never the whole [heads, T, T]
    for name in ("sparsity", "post_vision_sparsity"):
        assert blocked["per_layer"][name] == pytest.approx(whole["per_layer"][name], abs=1e-6), name


CAUSAL_ATTENTION = metrics.causal_attention


def test_the_video_knobs_leave_job_ids_at_their_defaults():
    """Runs planned before the video knobs keep their job ids (Go's plan drops these knobs from the id at
    their defaults; gohost/expt tests that side)."""
    marked = {name for name, spec in SyntheticConfig.param_specs().items() if spec.id_omits_default}
    assert marked == {"video", "frame_correlation", "salient_recurrence", "salient_motion"}
    schema = SyntheticConfig.schema()
    assert schema["video"]["id_omits_default"] is True and "id_omits_default" not in schema["images"]
    with pytest.raises(ValueError, match="list knob"):
        knob("ints", [1], "sizes", id_omits_default=True)
