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
                    rope_theta: float = 10000.0) -> Path:
    """LLaVA-1.5, or with next=True LLaVA-NeXT: anyres tiling on a grid of
    56-pixel tiles (1x1, 1x2, 2x1, 2x2), so an image is a base view plus its
    tiles, unpadded, with a newline token per row. The image is (image_size /
    7)^2 tokens; head_dim widens the attention without widening the model;
    rope_theta is the language model's RoPE base."""
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
                       rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
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
    processor = processor_class(image_processor=images, tokenizer=fast, video_processor=Qwen2VLVideoProcessor())
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def main(argv=None) -> int:
    """Write a tiny random model and a test image (cat.png) into a directory:
    a stand-in for a real model where none can be downloaded."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__.split(":")[0])
    parser.add_argument("out", help="directory to write the model into")
    parser.add_argument("--family", default="llava", choices=["llava", "llava_next", "qwen2_vl", "qwen2_5_vl"])
    opts = parser.parse_args(argv)
    out = Path(opts.out)
    if opts.family.startswith("qwen"):
        save_tiny_qwen2_vl(out, version="2" if opts.family == "qwen2_vl" else "2.5")
        save_image(out / "cat.png", size=112)
    else:
        save_tiny_llava(out, next=opts.family == "llava_next")
        save_image(out / "cat.png")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
