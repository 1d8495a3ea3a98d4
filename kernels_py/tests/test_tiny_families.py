"""The tiny models of the newer families (tiny_vlm.BUILDERS) load through the
Auto classes and generate on an image, two images, a video and a left-padded
batch; the expanded prompts hold as many image and video tokens as the
processor's own outputs (image sizes, tiles, grids, frames) call for."""

import math

import numpy as np
import pytest
import torch

from kernels_py.tests import tiny_vlm

pytest.importorskip("av")

FRAMES = 8


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    videos = {side: tiny_vlm.read_video(tiny_vlm.save_video(root / f"clip{side}.mp4", frames=FRAMES, size=side))
              for side in set(tiny_vlm.IMAGE_SIDE.values())}
    return root, videos


@pytest.fixture(scope="module")
def loaded(saved):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    root, _ = saved
    cache = {}

    def load(family):
        if family not in cache:
            directory = tiny_vlm.BUILDERS[family](root / family)
            cache[family] = (AutoProcessor.from_pretrained(directory, local_files_only=True),
                             AutoModelForImageTextToText.from_pretrained(directory, local_files_only=True))
        return cache[family]
    return load


def picture(side, wide=False, seed=0):
    from PIL import Image

    pixels = np.random.RandomState(seed).rand(side, 2 * side if wide else side, 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


def generate(model, inputs):
    out = model.generate(**inputs, do_sample=False, max_new_tokens=4)
    length = inputs["input_ids"].shape[1]
    assert out.shape[0] == inputs["input_ids"].shape[0] and length < out.shape[1] <= length + 4
    assert torch.equal(out[:, :length], inputs["input_ids"])
    return out


def runs(ids, token_id):
    """Lengths of the contiguous runs of token_id in a row of ids."""
    out, current = [], 0
    for value in ids.tolist() + [None]:
        if value == token_id:
            current += 1
        elif current:
            out.append(current)
            current = 0
    return out


def anyres_tokens(height, width, tile=tiny_vlm.IMAGE_SIZE, side=tiny_vlm.IMAGE_SIZE // tiny_vlm.PATCH):
    """LLaVA-NeXT and OneVision: a base view plus the image's tiles as one
    grid with a newline per row (the test images fit their tiles exactly,
    so nothing is unpadded away)."""
    rows, cols = math.ceil(height / tile) * side, math.ceil(width / tile) * side
    return side * side + rows * cols + rows


def image_runs(family, processor, model, inputs):
    """The expected run lengths of image tokens, computed from what the
    processor returned for the images."""
    if family in ("llava_onevision", "llava_next_video"):
        return [anyres_tokens(*size) for size in inputs["image_sizes"].tolist()]
    if family == "video_llava":  # the CLS token is dropped from an image
        return [(inputs["pixel_values_images"].shape[-1] // tiny_vlm.PATCH) ** 2] * len(inputs["pixel_values_images"])
    if family == "qwen3_vl":
        return (inputs["image_grid_thw"].prod(-1) // processor.image_processor.merge_size ** 2).tolist()
    if family == "gemma3":
        return [model.config.mm_tokens_per_image] * len(inputs["pixel_values"])
    raise AssertionError(family)


def image_token_id(model):
    # Gemma 3's processor.image_token_id is the <start_of_image> id; the
    # features land on config.image_token_id (<image_soft_token>).
    return model.config.image_token_id


@pytest.mark.parametrize("family", tiny_vlm.FAMILIES)
def test_image_and_two_images(family, loaded):
    processor, model = loaded(family)
    assert model.config.model_type == family
    image, _ = tiny_vlm.PLACEHOLDERS[family]
    side = tiny_vlm.IMAGE_SIDE[family]
    square, wide = picture(side), picture(side, wide=True, seed=1)
    token = image_token_id(model)

    one = processor(text=f"USER : {image} describe the picture ASSISTANT :", images=[wide], return_tensors="pt")
    two = processor(text=f"USER : {image} {image} describe ASSISTANT :", images=[[square, wide]], return_tensors="pt")
    if family == "internvl":
        # An image is cut into 56-pixel tiles (plus a thumbnail when there are
        # several), each pixel-shuffled to image_seq_length tokens.
        assert runs(one["input_ids"][0], token) == [processor.image_seq_length * len(one["pixel_values"])]
        assert runs(two["input_ids"][0], token) == [processor.image_seq_length, processor.image_seq_length * 3]
        assert len(two["pixel_values"]) == 4 and len(one["pixel_values"]) == 3
        assert runs(two["input_ids"][0], processor.start_image_token_id) == [1, 1]
    elif family == "llava_onevision":
        assert runs(one["input_ids"][0], token) == image_runs(family, processor, model, one) == [200]
        # Each image of a several-image prompt is its base view and one newline.
        assert sum(runs(two["input_ids"][0], token)) == 2 * (processor.num_image_tokens + 1)
    elif family == "video_llava":  # images are center-cropped to one square view
        assert runs(one["input_ids"][0], token) == image_runs(family, processor, model, one) == [64]
        assert sum(runs(two["input_ids"][0], token)) == sum(image_runs(family, processor, model, two)) == 128
    else:
        assert runs(one["input_ids"][0], token) == image_runs(family, processor, model, one)
        expected = image_runs(family, processor, model, two)
        found = runs(two["input_ids"][0], token)
        # LLaVA-NeXT-Video's images are adjacent (nothing between the two
        # placeholders but a space), so their runs join.
        assert found == expected or (family == "llava_next_video" and found == [sum(expected)])
    generate(model, one)
    generate(model, two)


@pytest.mark.parametrize("family", tiny_vlm.VIDEO_FAMILIES)
def test_video(family, loaded, saved):
    processor, model = loaded(family)
    _, videos = saved
    frames = videos[tiny_vlm.IMAGE_SIDE[family]]
    assert frames.shape == (FRAMES, tiny_vlm.IMAGE_SIDE[family], tiny_vlm.IMAGE_SIDE[family], 3)
    _, video = tiny_vlm.PLACEHOLDERS[family]
    options = {}
    if family == "qwen3_vl":
        # Qwen3-VL's video processor samples frames by default (at 2 fps,
        # assuming 24 fps when no metadata comes), and writes each temporal
        # step's timestamp from the metadata's fps and frame indices.
        options = dict(do_sample_frames=False,
                       video_metadata=[{"fps": 4, "total_num_frames": FRAMES, "frames_indices": list(range(FRAMES))}])
    inputs = processor(text=f"USER : {video} describe ASSISTANT :", videos=[frames], return_tensors="pt", **options)
    ids = inputs["input_ids"][0]
    if family == "llava_onevision":  # each frame pooled 2 x 2, one newline after the last frame
        assert inputs["pixel_values_videos"].shape[:2] == (1, FRAMES)
        per_frame = math.ceil(math.sqrt(processor.num_image_tokens) / 2) ** 2
        assert runs(ids, model.config.video_token_id) == [FRAMES * per_frame + 1]
    elif family == "llava_next_video":  # each frame pooled 2 x 2, no newline
        side = inputs["pixel_values_videos"].shape[-1] // tiny_vlm.PATCH
        assert runs(ids, model.config.video_token_id) == [FRAMES * (side // 2) ** 2]
    elif family == "video_llava":  # a frame keeps its CLS token
        side = inputs["pixel_values_videos"].shape[-1] // tiny_vlm.PATCH
        assert runs(ids, model.config.video_token_id) == [FRAMES * (side * side + 1)]
    elif family == "internvl":  # "FrameN: <img>...</img>" per frame, frames merged into pixel_values
        assert len(inputs["pixel_values"]) == FRAMES
        assert runs(ids, model.config.image_token_id) == [processor.image_seq_length] * FRAMES
        assert processor.tokenizer.decode(ids).replace(" ", "").count("Frame8:<img>") == 1
    elif family == "qwen3_vl":  # two frames a temporal step; "<t seconds><|vision_start|>...<|vision_end|>" each
        t, h, w = inputs["video_grid_thw"][0].tolist()
        assert t == FRAMES // processor.video_processor.temporal_patch_size
        merge = processor.video_processor.merge_size ** 2
        assert runs(ids, model.config.video_token_id) == [h * w // merge] * t
        assert runs(ids, model.config.vision_start_token_id) == [1] * t
        assert "< 0 . 1 seconds >" in processor.tokenizer.decode(ids)
    generate(model, inputs)


@pytest.mark.parametrize("family", tiny_vlm.FAMILIES)
def test_left_padded_batch(family, loaded):
    processor, model = loaded(family)
    image, _ = tiny_vlm.PLACEHOLDERS[family]
    side = tiny_vlm.IMAGE_SIDE[family]
    texts = [f"USER : {image} describe the picture . what is in a picture ? ASSISTANT :", f"{image} what ?"]
    inputs = processor(text=texts, images=[[picture(side)], [picture(side, seed=2)]], padding=True,
                       padding_side="left", return_tensors="pt")
    mask = inputs["attention_mask"]
    assert mask[0].all() and not mask[1, 0] and mask[1, -1]
    generate(model, inputs)


def test_gemma3_prompt_exceeds_sliding_window(loaded):
    processor, model = loaded("gemma3")
    text = model.config.text_config
    assert {"sliding_attention", "full_attention"} <= set(text.layer_types)
    assert text.query_pre_attn_scalar != text.head_dim
    inputs = processor(text="USER : <start_of_image> describe ASSISTANT :", images=[picture(56)], return_tensors="pt")
    assert inputs["input_ids"].shape[1] > text.sliding_window
    # Image tokens are marked so that they attend to each other both ways.
    assert inputs["token_type_ids"].sum() == model.config.mm_tokens_per_image


def test_qwen3_vl_keeps_deepstack(loaded):
    _, model = loaded("qwen3_vl")
    deepstack = model.config.vision_config.deepstack_visual_indexes
    assert 0 < len(deepstack) < model.config.text_config.num_hidden_layers
    assert model.config.text_config.rope_parameters["mrope_interleaved"]


def test_video_file_and_frames(tmp_path):
    expected = tiny_vlm.video_frames(FRAMES, 56)
    decoded = tiny_vlm.read_video(tiny_vlm.save_video(tmp_path / "clip.mp4", frames=FRAMES, size=56, fps=4))
    assert decoded.shape == expected.shape and decoded.dtype == np.uint8
    # A faithful decode (MPEG-4 at 4:2:0 on 56 pixels is off by a few levels on
    # average); neighbouring frames alike, yet not equal, and drifting apart.
    assert np.abs(decoded.astype(float) - expected).mean() < 10
    neighbours = np.abs(np.diff(expected.astype(float), axis=0)).mean(axis=(1, 2, 3))
    assert (neighbours > 1).all()
    assert neighbours.max() < np.abs(expected[0].astype(float) - expected[-1]).mean() / 3
    import av
    with av.open(str(tmp_path / "clip.mp4")) as container:
        assert container.streams.video[0].average_rate == 4

    from PIL import Image
    paths = tiny_vlm.save_frames(tmp_path / "frames", frames=FRAMES, size=56)
    assert [p.name for p in paths][:2] == ["frame_000.png", "frame_001.png"] and len(paths) == FRAMES
    assert np.array_equal(np.stack([np.asarray(Image.open(p)) for p in paths]), expected)
