"""Every family the adapter drives, on a tiny random model of it and a short
generated video: spans per image and per frame, the full cache reproducing
the model's own generate (batched where the family batches), methods inside
the model holding fewer bytes than the full cache, trace capture -> replay
giving the same tensors, and the refusals (a family without video, RoPE that
cannot be undone from a token's index)."""

import numpy as np
import pytest
import torch

from kernels_py import models
from kernels_py.models import adapter
from kernels_py.methods import make_method
from kernels_py.models.video import load_video
from kernels_py.tests import tiny_vlm

pytest.importorskip("av")  # the fixtures write each family's test video (a base dependency)

# family -> (builder, image size, what it takes)
FAMILIES = {
    "qwen2_vl": (tiny_vlm.save_tiny_qwen2_vl, 112, ("image", "video")),
    "qwen2_5_vl": (lambda d: tiny_vlm.save_tiny_qwen2_vl(d, version="2.5"), 112, ("image", "video")),
    **{name: (tiny_vlm.BUILDERS[name], tiny_vlm.IMAGE_SIDE[name],
              ("image", "video") if name in tiny_vlm.VIDEO_FAMILIES else ("image",)) for name in tiny_vlm.FAMILIES},
}
METHODS = [("h2o", {"budget": 0.5}), ("vlcache", {"budget": 0.5}), ("kivi", {"residual": 4}),
           ("lookm", {}), ("avl", {})]


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    clip = tiny_vlm.save_video(root / "clip.mp4", frames=8, size=112, fps=4)
    return root, clip


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, media):
    build, size, takes = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    vlm = models.load(build(root / "model"))
    image = tiny_vlm.save_image(root / "image.png", size=size)
    return request.param, vlm, image, takes


def _prompt(vlm, images=0, videos=0, words="describe the picture"):
    # A word between placeholders: with nothing between them, two images' tokens would make one run.
    marks = ([vlm.image_placeholder] * images if images else []) + ([vlm.video_placeholder] * videos if videos else [])
    return "USER : " + " a ".join(marks) + f" {words} ASSISTANT :"


def _own_generate(vlm, inputs, steps):
    out = vlm.model.generate(**inputs, max_new_tokens=steps, do_sample=False)
    return out[:, inputs["input_ids"].shape[1]:].tolist()


def test_a_video_is_a_span_per_frame_and_the_full_cache_is_the_models_own(family, media):
    name, vlm, _, takes = family
    if "video" not in takes:
        pytest.skip(f"{name} takes no video")
    _, clip = media
    video = load_video(clip, frames=8)
    inputs = models.prompt_inputs(vlm, [], _prompt(vlm, videos=1), [video])
    spans = models.batch_spans(vlm, inputs)[0]
    # Qwen's towers merge two sampled frames into one temporal step; the others keep every frame.
    frames = 4 if vlm.mrope else 8
    assert inputs.layout == [[("video", frames)]]
    assert len(spans.images) == frames and spans.videos == ((0, frames),)
    ids = inputs["input_ids"][0]
    token = vlm.video_token_id if vlm.video_token_id is not None else vlm.image_token_id  # InternVL: image tokens
    assert sum(e - s for s, e in spans.images) == int((ids == token).sum())
    sizes = {e - s for s, e in spans.images[:-1]}
    assert len(sizes) == 1  # equal frames (LLaVA-OneVision's closing newline joins the last)
    if vlm.spec.video_runs == "one":
        assert all(e == s2 for (_, e), (s2, _) in zip(spans.images, spans.images[1:]))
    full = models.generate(vlm, make_method("full"), inputs, 6)
    assert full.tokens == _own_generate(vlm, inputs, 6)[0]
    for method, params in METHODS:
        got = models.generate(vlm, make_method(method, params), inputs, 6, force_tokens=full.tokens)
        assert got.cache_bytes < full.cache_bytes, method
        assert torch.isfinite(got.logits).all()


def test_images_and_videos_batch_as_they_run_alone(family, media):
    """A left-padded batch decodes as transformers' own batched generate and
    as each prompt alone. Logits are compared, not only tokens: a tiny random
    model's greedy tokens barely depend on positions (a padded sequence's
    decode positions, M-RoPE's offsets) or on a sliding window's attention
    scale, its logits do."""
    name, vlm, image, takes = family
    _, clip = media
    entries = [([image], _prompt(vlm, images=1), []), ([image, image], _prompt(vlm, images=2, words="what"), [])]
    if "video" in takes:
        entries.append(([], _prompt(vlm, videos=1, words="what is in"), [load_video(clip, frames=4)]))
    inputs = models.batch_inputs(vlm, entries)
    assert not bool(inputs["attention_mask"].all())  # some prompt is padded
    batched = models.generate_batch(vlm, make_method("full"), inputs, 4)
    own_tokens, own_logits = tiny_vlm.own_greedy(vlm.model, inputs, 4)
    assert len(batched) == len(entries)
    for b, (entry, got) in enumerate(zip(entries, batched)):
        assert got.tokens == own_tokens[b]
        torch.testing.assert_close(got.logits, own_logits[b], atol=1e-4, rtol=1e-4)
        alone = models.generate(vlm, make_method("full"), models.prompt_inputs(vlm, *entry), 4)
        assert got.tokens == alone.tokens and got.spans == alone.spans
        torch.testing.assert_close(got.logits, alone.logits, atol=1e-4, rtol=1e-4)


def test_a_video_trace_replays_the_same_tensors(family, media, tmp_path):
    from kernels_py.models import trace
    from kernels_py.workloads import make_workload

    name, vlm, image, takes = family
    _, clip = media
    videos = [load_video(clip, frames=4)] if "video" in takes else []
    prompt = _prompt(vlm, images=1, videos=len(videos))
    tensors, meta = trace.capture(vlm, [image], prompt, decode_steps=3, videos=videos)
    path = tmp_path / "trace.safetensors"
    trace.save(path, tensors, meta)
    workload = make_workload("trace", {"path": str(path)}).build()
    assert workload.layers == len(vlm.method_layers) == meta["model"]["layers"]
    for layer in range(workload.layers):
        assert torch.equal(workload.k[layer].cpu(), tensors[f"layer.{layer}.k"])
        assert torch.equal(workload.decode_q[layer].cpu(), tensors[f"layer.{layer}.decode_q"])
    assert workload.spans == trace.spans_of(meta)
    if videos:
        assert meta["videos"][0]["sampling"]["sampled"] == 4 and len(meta["spans"]["videos"]) == 1


def test_a_family_without_video_refuses_one(tmp_path, media):
    _, clip = media
    vlm = models.load(tiny_vlm.save_tiny_llava(tmp_path / "llava"))
    with pytest.raises(models.ModelError, match="llava takes no video .*qwen2_vl"):
        models.prompt_inputs(vlm, [], "USER : <video> what ASSISTANT :", [load_video(clip, frames=2)])


def test_placeholders_must_match_the_videos(tmp_path, media):
    _, clip = media
    vlm = models.load(tiny_vlm.save_tiny_qwen2_vl(tmp_path / "qwen"))
    video = load_video(clip, frames=2)
    with pytest.raises(models.ModelError, match=r"holds 1 video placeholder\(s\) .* for 2 video\(s\)"):
        models.prompt_inputs(vlm, [], _prompt(vlm, videos=1), [video, video])
    with pytest.raises(models.ModelError, match="at least one image or video"):
        models.prompt_inputs(vlm, [], "USER : what ASSISTANT :")


def test_spans_cut_a_video_run_into_frames():
    ids = torch.tensor([5, 9, 9, 9, 9, 9, 9, 9, 6, 3, 3, 7])  # 9: video tokens, 3: image tokens
    one = models.spans_from_ids(ids, 3, video_token_id=9, layout=[("video", 3), ("image", 1)])
    # Seven video tokens in three frames: two each, the remainder (a closing newline token) joins the last.
    assert one.images == ((1, 3), (3, 5), (5, 8), (9, 11)) and one.videos == ((0, 3),)
    assert one.system == (0, 1) and one.text == (11, 12)
    # A frame a run (Qwen3-VL, InternVL: text between frames), the frames in the image token (InternVL).
    per_frame = torch.tensor([5, 3, 6, 3, 3, 6, 3, 3, 7])
    two = models.spans_from_ids(per_frame, 3, layout=[("image", 1), ("video", 2)], video_runs="per_frame")
    assert two.images == ((1, 2), (3, 5), (6, 8)) and two.videos == ((1, 3),)
    # Without a layout every run is a span.
    assert models.spans_from_ids(per_frame, 3).images == two.images
    with pytest.raises(models.ModelError, match="fewer than one a frame"):
        models.spans_from_ids(torch.tensor([5, 9, 9, 7]), 3, video_token_id=9, layout=[("video", 3)])
    with pytest.raises(models.ModelError, match="hold 3 runs of image or video tokens where its placeholders "
                                                r"\(image, video\) make 2"):
        models.spans_from_ids(per_frame, 3, layout=[("image", 1), ("video", 1)], video_runs="per_frame")


def test_every_method_runs_inside_each_family_or_says_why_not(family):
    """Every registered method inside the model, 3 steps on an image prompt:
    fewer bytes than the full cache (the full cache and FP8 at most as many:
    FP8's bytes halve only for 16-bit models), or a one-line refusal naming
    the family's limit (AttentionPack's rope="before" on M-RoPE)."""
    from kernels_py.methods import METHODS

    name, vlm, image, _ = family
    inputs = models.prompt_inputs(vlm, [image], _prompt(vlm, images=1))
    full = models.generate(vlm, make_method("full"), inputs, 3)
    refused = {}
    for method in sorted(set(METHODS) - {"full", "kvpress"}):
        params = {"attentionpack": {"rank_k": 8, "rank_v": 8}, "snapkv": {"window": 4},
                  "pyramidkv": {"window": 4}}.get(method, {})
        try:
            got = models.generate(vlm, make_method(method, params), inputs, 3, force_tokens=full.tokens)
        except (models.ModelError, ValueError) as err:
            refused[method] = str(err)
            continue
        assert torch.isfinite(got.logits).all(), method
        assert got.cache_bytes <= full.cache_bytes, method
    # AttentionPack's rope="before" cannot undo M-RoPE; ZipVL's causal sparse prefill is not Gemma 3's attention.
    assert set(refused) == ({"attentionpack"} if vlm.mrope else set()) | \
        ({"zipvl", "zipvl_fixed"} if vlm.spec.bidirectional_images else set()), refused
    if vlm.mrope:
        assert "3-D positions" in refused["attentionpack"]
    if vlm.spec.bidirectional_images:
        assert "run it with sparse_prefill = False" in refused["zipvl"]


def test_qwen_video_tokens_take_temporal_positions_from_the_sampling(tmp_path, media):
    """M-RoPE's temporal position of a video frame: Qwen2.5-VL counts absolute
    time (tokens_per_second of the sampled rate), so frames sampled half as
    often stand twice as far apart; every token of a frame shares it."""
    from kernels_py.models import trace

    _, clip = media  # 8 frames at 4 a second
    vlm = models.load(tiny_vlm.save_tiny_qwen2_vl(tmp_path / "qwen2.5", version="2.5"))
    if not _places_fractional_steps():  # 8 frames make half-second steps, which it would round to 0
        with pytest.raises(models.ModelError, match="rounds a video's seconds per temporal step"):
            trace.capture(vlm, [], _prompt(vlm, videos=1), decode_steps=1, videos=[load_video(clip, frames=8)])
        return
    steps = []
    for frames in (8, 4):
        video = load_video(clip, frames=frames)
        tensors, meta = trace.capture(vlm, [], _prompt(vlm, videos=1), decode_steps=1, videos=[video])
        spans = trace.spans_of(meta)
        temporal = [tensors["positions"][0, s:e] for s, e in spans.images]
        assert all(bool((t == t[0]).all()) for t in temporal)
        starts = [int(t[0]) for t in temporal]
        assert len(set(b - a for a, b in zip(starts, starts[1:]))) == 1
        steps.append(starts[1] - starts[0])
    assert steps[1] == 2 * steps[0] > 0


def _places_fractional_steps() -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version(adapter.WHOLE_SECOND_STEPS_BEFORE)


@pytest.mark.parametrize("version, seconds, refused", [
    ("5.17.0", [0.5, 0.5], True),
    ("5.17.0", [1.0, 2.0], False),
    ("5.18.0", [0.5], False),
    ("5.23.0", [0.25], False),
])
def test_transformers_that_round_temporal_steps_are_refused_only_where_it_matters(version, seconds, refused):
    """transformers before 5.18 turns Qwen2.5-VL's seconds per temporal step
    into an int: half-second steps would give a video's frames one position."""
    if refused:
        with pytest.raises(models.ModelError, match=f"transformers {version} rounds .* 0.5 s"):
            adapter._check_temporal_steps(torch.tensor(seconds), version)
    else:
        adapter._check_temporal_steps(torch.tensor(seconds), version)
    adapter._check_temporal_steps(None, version)  # no video, nothing to check


def test_kvpress_presses_run_on_the_families_without_sliding_layers(family):
    """A kvpress press inside each family: the no-press baseline is our full
    cache, SnapKV keeps half of it; on Gemma 3's sliding layers kvpress would
    break, so it is refused in one line."""
    from kernels_py.models import presses

    name, vlm, image, _ = family
    question = "what is in the picture a red cat or a blue dog ?" * 8  # longer than SnapKV's window of 64
    inputs = models.prompt_inputs(vlm, [image], _prompt(vlm, images=1, words=question))
    press = make_method("kvpress", {"press": "SnapKVPress", "compression_ratio": 0.5}).make_press()
    if vlm.sliding_layers:
        with pytest.raises(presses.PressError, match="SnapKVPress cannot run on gemma3: kvpress compresses every "
                                                     r"layer as a global one, and this model's layers \[0, 2\]"):
            presses.generate(vlm, press, inputs, 3)
        return
    ours = models.generate(vlm, make_method("full"), inputs, 3)
    baseline = presses.generate(vlm, None, inputs, 3)
    assert baseline.tokens == ours.tokens and baseline.cache_bytes == ours.cache_bytes
    pressed = presses.generate(vlm, press, inputs, 3)
    assert pressed.cache_bytes < 0.6 * baseline.cache_bytes
