"""Tiny LLaVA-style models made from configs with random weights, saved to a
directory with a word-level tokenizer and a CLIP image processor, as a
user's model directory would be (no model hub is reachable here)."""

from pathlib import Path

import numpy as np
import torch

WORDS = "USER ASSISTANT : describe the picture what is in a cat dog red blue . ?"
IMAGE_SIZE, PATCH = 56, 7  # 64 image tokens per image


def save_tiny_llava(directory: Path, *, seed: int = 0, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    next: bool = False, head_dim: int | None = None, image_size: int = IMAGE_SIZE,
                    rope_theta: float = 10000.0, rope_scaling: dict | None = None) -> Path:
    """LLaVA-1.5, or with next=True LLaVA-NeXT: anyres tiling on a grid of
    56-pixel tiles (1x1, 1x2, 2x1, 2x2), so an image is a base view plus its
    tiles, unpadded, with a newline token per row. The image is (image_size /
    7)^2 tokens; head_dim widens the attention without widening the model;
    rope_theta is the language model's RoPE base, rope_scaling its scaling
    (rope_parameters' rope_type and factor, e.g. {"rope_type": "linear",
    "factor": 4.0}; none by default)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration,
        LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextImageProcessor, LlavaNextProcessor,
        LlavaProcessor, PreTrainedTokenizerFast,
    )

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<image>": 3}
    for word in WORDS.split():
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<unk>")
    fast.add_tokens(["<image>"], special_tokens=True)
    sizes = dict(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})
    grid = [[image_size * h, image_size * w] for h, w in ((1, 1), (1, 2), (2, 1), (2, 2))]
    images = LlavaNextImageProcessor(image_grid_pinpoints=grid, **sizes) if next else CLIPImageProcessor(**sizes)
    text = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                       max_position_embeddings=4096,
                       rope_parameters={"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})})
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=image_size, patch_size=PATCH, projection_dim=32)
    common = dict(text_config=text, vision_config=vision, image_token_index=3,
                  vision_feature_select_strategy="default", vision_feature_layer=-1)
    config = LlavaNextConfig(image_grid_pinpoints=grid, **common) if next else LlavaConfig(**common)
    torch.manual_seed(seed)
    model = (LlavaNextForConditionalGeneration if next else LlavaForConditionalGeneration)(config).eval()
    processor = (LlavaNextProcessor if next else LlavaProcessor)(
        image_processor=images, tokenizer=fast, patch_size=PATCH, vision_feature_select_strategy="default",
        image_token="<image>", num_additional_image_tokens=1)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def own_greedy(model, inputs: dict, steps: int) -> tuple[list[list[int]], torch.Tensor]:
    """transformers' own greedy generate of `steps` tokens, all of them (no
    end-of-sequence token ends it early, as none ends the adapter's without
    stop_tokens): the tokens [B][steps] and the logits each was chosen from,
    [B, steps, vocab] float32."""
    out = model.generate(**inputs, max_new_tokens=steps, do_sample=False, eos_token_id=None, output_logits=True,
                         return_dict_in_generate=True)
    return out.sequences[:, inputs["input_ids"].shape[1]:].tolist(), torch.stack(out.logits, dim=1).float()


def save_image(path: Path, seed: int = 0, size: int = 40) -> Path:
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8")
    Image.fromarray(pixels).save(path)
    return path


QWEN_PROMPT = "USER : <|vision_start|><|image_pad|><|vision_end|> describe the picture ASSISTANT :"


def save_tiny_qwen2_vl(directory: Path, *, seed: int = 0, layers: int = 2, version: str = "2") -> Path:
    """A Qwen2-VL (version "2") or Qwen2.5-VL ("2.5"), M-RoPE and GQA: a 112 x
    112 image is 8 x 8 patches, merged 2 x 2 into 16 image tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
        Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor, Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    specials = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|endoftext|>"]
    vocab = {"<unk>": 0}
    for word in specials + WORDS.split():
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.add_tokens(specials, special_tokens=True)
    images = Qwen2VLImageProcessor(min_pixels=112 * 112, max_pixels=112 * 112, patch_size=14, merge_size=2,
                                   temporal_patch_size=2)
    text = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512,
                rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}, bos_token_id=None,
                eos_token_id=vocab["<|endoftext|>"])
    tokens = dict(image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
                  vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"])
    if version == "2":
        vision = dict(depth=1, embed_dim=32, hidden_size=128, num_heads=2, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, in_chans=3)
        config_class, model_class, processor_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    else:
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, in_chans=3, out_hidden_size=128, window_size=56, fullatt_block_indexes=[1])
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        processor_class = Qwen2_5_VLProcessor
    config = config_class(text_config=text, vision_config=vision, **tokens)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    # A frame as small as an image (16 tokens a temporal step), not the default's hundreds.
    frames = Qwen2VLVideoProcessor(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112}, patch_size=14,
                                   merge_size=2, temporal_patch_size=2)
    processor = processor_class(image_processor=images, tokenizer=fast, video_processor=frames)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


# The newer families. Each builder writes a tiny random model and the family's
# own processor classes; a 56-pixel image cut into 7-pixel patches is 64
# patches (14-pixel patches on 112 pixels for Qwen3-VL), so an image is tens
# of tokens and a saved model is a few hundred kilobytes.
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, max_position_embeddings=4096)
VIDEO_FAMILIES = ("llava_onevision", "llava_next_video", "video_llava", "internvl", "qwen3_vl")
FAMILIES = VIDEO_FAMILIES + ("gemma3",)
# The image and video placeholders a user writes in a prompt, per family.
PLACEHOLDERS = {
    "llava_onevision": ("<image>", "<video>"),
    "llava_next_video": ("<image>", "<video>"),
    "video_llava": ("<image>", "<video>"),
    "internvl": ("<IMG_CONTEXT>", "<video>"),
    # Qwen3-VL's processor writes <|vision_start|> and <|vision_end|> around each
    # frame itself: wrapping <|video_pad|> in them (as the checkpoints' chat
    # template does) doubles the markers.
    "qwen3_vl": ("<|vision_start|><|image_pad|><|vision_end|>", "<|video_pad|>"),
    "gemma3": ("<start_of_image>", None),
}


def _word_tokenizer(specials: list[str], *, named: dict | None = None, words: str = WORDS, **tokens):
    """A word-level tokenizer over WORDS, digits and the family's special
    tokens, splitting punctuation and digits off words so that the text a
    processor writes ("Frame3:", "<1.5 seconds>") is words, not <unk>; named
    maps attribute names (image_token, boi_token...) to special tokens, which
    the family's processor reads from the tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0}
    for word in specials + words.split() + list("0123456789<>") + ["seconds", "Frame"]:
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(), pre_tokenizers.Digits(individual_digits=True)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", extra_special_tokens=named or {},
                                   **tokens)
    fast.add_tokens(specials, special_tokens=True)
    return fast, vocab


def _siglip(image_size: int = IMAGE_SIZE):
    from transformers import SiglipVisionConfig

    return SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=image_size, patch_size=PATCH, vision_use_head=False)


def _clip(image_size: int = IMAGE_SIZE):
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            image_size=image_size, patch_size=PATCH, projection_dim=32)


def _save(model_class, config, processor, directory: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model = model_class(config).eval()
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def save_tiny_llava_onevision(directory: Path, *, seed: int = 0, layers: int = 2) -> Path:
    """LLaVA-OneVision: SigLIP (no CLS) and a Qwen2 language model. A single
    image is anyres (a 56-pixel base view of 64 tokens plus 56-pixel tiles,
    unpadded, a newline token per row); each image of a several-image prompt
    is its base view and one newline (65 tokens); a video frame is pooled 2 x 2
    to 16 tokens, with one newline after the last frame."""
    from transformers import (
        LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor, Qwen2Config,
    )

    fast, vocab = _word_tokenizer(["<image>", "<video>", "<|im_end|>"], eos_token="<|im_end|>", pad_token="<unk>")
    grid = [[IMAGE_SIZE * h, IMAGE_SIZE * w] for h, w in ((1, 1), (1, 2), (2, 1), (2, 2))]
    size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    text = Qwen2Config(num_hidden_layers=layers, eos_token_id=vocab["<|im_end|>"], **TEXT)
    config = LlavaOnevisionConfig(text_config=text, vision_config=_siglip(), image_token_index=vocab["<image>"],
                                  video_token_index=vocab["<video>"], image_grid_pinpoints=grid,
                                  vision_feature_select_strategy="full", vision_feature_layer=-1)
    processor = LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(image_grid_pinpoints=grid, size=size),
        video_processor=LlavaOnevisionVideoProcessor(size=size), tokenizer=fast,
        num_image_tokens=(IMAGE_SIZE // PATCH) ** 2, vision_feature_select_strategy="full")
    return _save(LlavaOnevisionForConditionalGeneration, config, processor, directory, seed)


def save_tiny_llava_next_video(directory: Path, *, seed: int = 0, layers: int = 2) -> Path:
    """LLaVA-NeXT-Video: CLIP and a Llama language model; images as LLaVA-NeXT
    (anyres tiles, newline per row), video frames pooled 2 x 2 (16 tokens a
    frame, no newline)."""
    from transformers import (
        LlamaConfig, LlavaNextImageProcessor, LlavaNextVideoConfig, LlavaNextVideoForConditionalGeneration,
        LlavaNextVideoProcessor, LlavaNextVideoVideoProcessor,
    )

    fast, vocab = _word_tokenizer(["<image>", "<video>", "<s>", "</s>"], bos_token="<s>", eos_token="</s>",
                                  pad_token="<unk>")
    grid = [[IMAGE_SIZE * h, IMAGE_SIZE * w] for h, w in ((1, 1), (1, 2), (2, 1), (2, 2))]
    sizes = dict(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    text = LlamaConfig(num_hidden_layers=layers, bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], **TEXT)
    patches = (IMAGE_SIZE // PATCH) ** 2
    config = LlavaNextVideoConfig(text_config=text, vision_config=_clip(), image_token_index=vocab["<image>"],
                                  video_token_index=vocab["<video>"], image_grid_pinpoints=grid,
                                  vision_feature_select_strategy="default", vision_feature_layer=-1,
                                  image_seq_length=patches, video_seq_length=patches // 4)
    processor = LlavaNextVideoProcessor(
        image_processor=LlavaNextImageProcessor(image_grid_pinpoints=grid, **sizes),
        video_processor=LlavaNextVideoVideoProcessor(**sizes), tokenizer=fast, patch_size=PATCH,
        vision_feature_select_strategy="default", num_additional_image_tokens=1)
    return _save(LlavaNextVideoForConditionalGeneration, config, processor, directory, seed)


def save_tiny_video_llava(directory: Path, *, seed: int = 0, layers: int = 2) -> Path:
    """Video-LLaVA: one CLIP tower for images and frames and a Llama language
    model; an image is 64 tokens (CLS dropped), a frame 65 (CLS kept)."""
    from transformers import (
        LlamaConfig, VideoLlavaConfig, VideoLlavaForConditionalGeneration, VideoLlavaImageProcessor,
        VideoLlavaProcessor, VideoLlavaVideoProcessor,
    )

    fast, vocab = _word_tokenizer(["<image>", "<video>", "<s>", "</s>"], bos_token="<s>", eos_token="</s>",
                                  pad_token="<unk>")
    sizes = dict(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    text = LlamaConfig(num_hidden_layers=layers, bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], **TEXT)
    patches = (IMAGE_SIZE // PATCH) ** 2
    config = VideoLlavaConfig(text_config=text, vision_config=_clip(), image_token_index=vocab["<image>"],
                              video_token_index=vocab["<video>"], vision_feature_select_strategy="default",
                              vision_feature_layer=-1, image_seq_length=patches, video_seq_length=8 * (patches + 1))
    processor = VideoLlavaProcessor(
        image_processor=VideoLlavaImageProcessor(**sizes), video_processor=VideoLlavaVideoProcessor(**sizes),
        tokenizer=fast, patch_size=PATCH, vision_feature_select_strategy="default", num_additional_image_tokens=1)
    return _save(VideoLlavaForConditionalGeneration, config, processor, directory, seed)


def save_tiny_internvl(directory: Path, *, seed: int = 0, layers: int = 2, max_patches: int = 4) -> Path:
    """InternVL (HF-native, a Qwen2 language model as InternVL2.5/3): an image is
    cut into up to max_patches 56-pixel tiles plus a thumbnail, each tile 64
    patches pixel-shuffled to 16 tokens between <img> and </img>; a video frame
    is one tile, written "FrameN: <img>...</img>"."""
    from transformers import (
        GotOcr2ImageProcessor, InternVLConfig, InternVLForConditionalGeneration, InternVLProcessor,
        InternVLVideoProcessor, InternVLVisionConfig, Qwen2Config,
    )

    named = dict(start_image_token="<img>", end_image_token="</img>", context_image_token="<IMG_CONTEXT>",
                 video_token="<video>")
    fast, vocab = _word_tokenizer(["<img>", "</img>", "<IMG_CONTEXT>", "<video>", "<|im_end|>"], named=named,
                                  eos_token="<|im_end|>", pad_token="<unk>")
    size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    text = Qwen2Config(num_hidden_layers=layers, eos_token_id=vocab["<|im_end|>"], **TEXT)
    vision = InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=[IMAGE_SIZE, IMAGE_SIZE], patch_size=[PATCH, PATCH])
    tokens = (IMAGE_SIZE // PATCH // 2) ** 2
    config = InternVLConfig(text_config=text, vision_config=vision, image_token_id=vocab["<IMG_CONTEXT>"],
                            image_seq_length=tokens, downsample_ratio=0.5, vision_feature_layer=-1)
    processor = InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(size=size, crop_to_patches=True, max_patches=max_patches),
        video_processor=InternVLVideoProcessor(size=size), tokenizer=fast, image_seq_length=tokens)
    return _save(InternVLForConditionalGeneration, config, processor, directory, seed)


def save_tiny_qwen3_vl(directory: Path, *, seed: int = 0, layers: int = 3) -> Path:
    """Qwen3-VL: interleaved M-RoPE and DeepStack (the two vision layers'
    features are added to the first two language layers' hidden states at the
    visual positions). A 112 x 112 image is 8 x 8 patches of 14 pixels, merged
    2 x 2 into 16 tokens; two frames make one temporal step."""
    from transformers import (
        Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    specials = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|im_end|>"]
    fast, vocab = _word_tokenizer(specials, eos_token="<|im_end|>", pad_token="<unk>")
    pixels = dict(patch_size=14, merge_size=2, temporal_patch_size=2)
    area = {"shortest_edge": 112 * 112, "longest_edge": 112 * 112}
    # A video's pixel budget is over all its frames: up to 64 frames of 112 x 112.
    clip = {"shortest_edge": 2 * 56 * 56, "longest_edge": 64 * 112 * 112}
    text = dict(TEXT, num_hidden_layers=layers, eos_token_id=vocab["<|im_end|>"],
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [6, 5, 5],
                                 "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TEXT["hidden_size"],
                  num_position_embeddings=64, deepstack_visual_indexes=[0, 1], **pixels)
    config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=vocab["<|image_pad|>"],
                           video_token_id=vocab["<|video_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
                           vision_end_token_id=vocab["<|vision_end|>"])
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(size=area, **pixels),
                                 video_processor=Qwen3VLVideoProcessor(size=clip, **pixels), tokenizer=fast)
    return _save(Qwen3VLForConditionalGeneration, config, processor, directory, seed)


def save_tiny_gemma3(directory: Path, *, seed: int = 0, layers: int = 3, sliding_window: int = 16) -> Path:
    """Gemma 3: SigLIP pooled to 16 tokens an image (between <start_of_image>
    and <end_of_image>) and a language model whose layers alternate sliding
    (window of sliding_window tokens, so an image prompt exceeds it) and global
    attention; query_pre_attn_scalar (24) differs from head_dim (32), so a
    wrong attention scale shows."""
    from transformers import (
        Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor, Gemma3Processor, Gemma3TextConfig,
    )

    named = dict(boi_token="<start_of_image>", eoi_token="<end_of_image>", image_token="<image_soft_token>")
    specials = ["<pad>", "<eos>", "<bos>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    fast, vocab = _word_tokenizer(specials, named=named, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    kinds = ["sliding_attention", "full_attention"]
    text = Gemma3TextConfig(num_hidden_layers=layers, layer_types=[kinds[i % 2] for i in range(layers)],
                            sliding_window=sliding_window, query_pre_attn_scalar=24, pad_token_id=vocab["<pad>"],
                            bos_token_id=vocab["<bos>"], eos_token_id=vocab["<eos>"], **TEXT)
    tokens = 16
    config = Gemma3Config(text_config=text, vision_config=_siglip(), mm_tokens_per_image=tokens,
                          boi_token_index=vocab["<start_of_image>"], eoi_token_index=vocab["<end_of_image>"],
                          image_token_index=vocab["<image_soft_token>"])
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
                                tokenizer=fast, image_seq_length=tokens)
    return _save(Gemma3ForConditionalGeneration, config, processor, directory, seed)


BUILDERS = {
    "llava_onevision": save_tiny_llava_onevision, "llava_next_video": save_tiny_llava_next_video,
    "video_llava": save_tiny_video_llava, "internvl": save_tiny_internvl, "qwen3_vl": save_tiny_qwen3_vl,
    "gemma3": save_tiny_gemma3,
}
# The image side each family's tiny model is built for.
IMAGE_SIDE = {family: IMAGE_SIZE for family in FAMILIES} | {"qwen3_vl": 112}


def video_frames(frames: int = 8, size: int = IMAGE_SIZE, seed: int = 0) -> np.ndarray:
    """[frames, size, size, 3] uint8: smooth random waves drifting a pixel a
    frame under a bright square moving two pixels a frame, so neighbouring
    frames are alike (temporal redundancy) but not equal."""
    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    freq, phase = rng.uniform(0.5, 2.0, (3, 2)), rng.uniform(0, 2 * np.pi, (3, 2))
    box = max(size // 4, 2)
    out = np.empty((frames, size, size, 3), np.uint8)
    for i in range(frames):
        drift = i / size
        for c in range(3):
            wave = np.sin(2 * np.pi * freq[c, 0] * (x + drift) + phase[c, 0])
            wave = wave * np.cos(2 * np.pi * freq[c, 1] * y + phase[c, 1])
            out[i, :, :, c] = (110 + 90 * wave).astype(np.uint8)
        left = (2 * i) % (size - box)
        out[i, size // 3:size // 3 + box, left:left + box] = 255
    return out


def save_video(path: Path, frames: int = 8, size: int = IMAGE_SIZE, fps: int = 4, seed: int = 0) -> Path:
    """video_frames written as an MPEG-4 Part 2 file (the codec every FFmpeg
    build carries) at fps frames a second; size must be even."""
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.options = {"qscale": "2"}  # near-lossless, so decoded frames stay close to video_frames
        for pixels in video_frames(frames, size, seed):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return path


def read_video(path: Path) -> np.ndarray:
    """Every frame of a video file as [frames, height, width, 3] uint8."""
    import av

    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def save_frames(directory: Path, frames: int = 8, size: int = IMAGE_SIZE, seed: int = 0) -> list[Path]:
    """video_frames as frame_000.png, frame_001.png, ... in directory."""
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, pixels in enumerate(video_frames(frames, size, seed)):
        paths.append(directory / f"frame_{i:03d}.png")
        Image.fromarray(pixels).save(paths[-1])
    return paths


def main(argv=None) -> int:
    """Write a tiny random model and a test image (cat.png), and for a family
    that takes video a test clip (clip.mp4), into a directory: a stand-in for a
    real model where none can be downloaded."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__.split(":")[0])
    parser.add_argument("out", help="directory to write the model into")
    parser.add_argument("--family", default="llava",
                        choices=["llava", "llava_next", "qwen2_vl", "qwen2_5_vl", *FAMILIES])
    opts = parser.parse_args(argv)
    out = Path(opts.out)
    if out.exists() and not out.is_dir():
        parser.error(f"{out} is a file: give a directory to write the model into (made if missing)")
    if opts.family in BUILDERS:
        BUILDERS[opts.family](out)
        save_image(out / "cat.png", size=IMAGE_SIDE[opts.family])
        if opts.family in VIDEO_FAMILIES:
            save_video(out / "clip.mp4", size=IMAGE_SIDE[opts.family])
    elif opts.family.startswith("qwen"):
        save_tiny_qwen2_vl(out, version="2" if opts.family == "qwen2_vl" else "2.5")
        save_image(out / "cat.png", size=112)
        save_video(out / "clip.mp4", size=112)
    else:
        save_tiny_llava(out, next=opts.family == "llava_next")
        save_image(out / "cat.png")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
