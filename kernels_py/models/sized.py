"""VLMs at a published model's sizes with random weights, and synthetic
prompts of a chosen number of visual tokens: what end-to-end speed needs
(it does not depend on the weights' values), with nothing downloaded.

The sizes are those of the models' public config.json files:
- llava-1.5-7b: Llama-2-7B language model (32 layers, 4096 wide, 32 heads,
  no GQA) behind a CLIP ViT-L/14 at 336 pixels, 576 image tokens an image;
- qwen2-vl-7b: Qwen2 language model (28 layers, 3584 wide, 28 query / 4 kv
  heads, M-RoPE) behind its own 32-layer ViT, one image of h x w patches
  merged 2 x 2 into h * w / 4 tokens.
The tiny-* entries are the same architectures a few hundred kilobytes big,
for the CPU.
"""

import math

import torch

from kernels_py.models.adapter import VLM, ModelError

SIZES = {
    "llava-1.5-7b": ("llava", dict(
        text=dict(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5),
        vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                    image_size=336, patch_size=14, projection_dim=768),
        image_token=32000, feature_layer=-2)),
    "qwen2-vl-7b": ("qwen2_vl", dict(
        text=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                  num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1e6,
                  rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
        vision=dict(depth=32, embed_dim=1280, hidden_size=3584, num_heads=16, mlp_ratio=4, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2, in_chans=3),
        tokens=dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                    vision_end_token_id=151653))),
    "tiny-llava": ("llava", dict(
        text=dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    image_size=56, patch_size=7, projection_dim=32),
        image_token=3, feature_layer=-1)),
    "tiny-qwen2-vl": ("qwen2_vl", dict(
        text=dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]},
                  bos_token_id=None, eos_token_id=None),
        vision=dict(depth=1, embed_dim=32, hidden_size=128, num_heads=2, patch_size=14, spatial_merge_size=2,
                    temporal_patch_size=2, in_chans=3),
        tokens=dict(image_token_id=3, video_token_id=4, vision_start_token_id=1, vision_end_token_id=2))),
}
FIRST_TEXT_ID = 8  # text tokens are drawn above every special id of the tiny vocabularies...
SPECIAL_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "bos_token_id",
               "eos_token_id", "pad_token_id")  # ...and below every one of the real ones


def build(name: str, positions: int, *, device: torch.device, dtype: torch.dtype, seed: int = 0) -> VLM:
    """The model `name` (a key of SIZES) with random weights, made directly
    on `device` in `dtype`, for prompts of up to `positions` tokens."""
    if name not in SIZES:
        raise ModelError(f"unknown model size {name!r}; known: {', '.join(SIZES)}")
    family, spec = SIZES[name]
    if family == "llava":
        from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

        text = LlamaConfig(**spec["text"], max_position_embeddings=max(4096, positions))
        config = LlavaConfig(text_config=text, vision_config=CLIPVisionConfig(**spec["vision"]),
                             image_token_index=spec["image_token"], vision_feature_select_strategy="default",
                             vision_feature_layer=spec["feature_layer"])
        model_class = LlavaForConditionalGeneration
    else:
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        text = dict(spec["text"], max_position_embeddings=max(32768, positions))
        config = Qwen2VLConfig(text_config=text, vision_config=spec["vision"], **spec["tokens"])
        model_class = Qwen2VLForConditionalGeneration
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in the final dtype: a 7B model never exists in float32
    try:
        with torch.device(device):
            model = model_class(config).eval()
    finally:
        torch.set_default_dtype(default)
    return VLM(model, None, family, f"{name} (random weights)")


def text_ids(config) -> tuple[int, int]:
    """[low, high) of the ids random text is drawn from: above the tiny
    vocabularies' special ids and below the real ones' (an image id among
    the text would not match the image's features)."""
    specials = [getattr(c, name, None) for c in (config, config.text_config) for name in SPECIAL_IDS]
    return FIRST_TEXT_ID, min([config.text_config.vocab_size] + [i for i in specials
                                                                 if isinstance(i, int) and i >= FIRST_TEXT_ID])


def image_tokens(vlm: VLM) -> int:
    """Tokens one LLaVA image becomes ((image_size / patch)^2, the CLS token dropped)."""
    vision = vlm.model.config.vision_config
    return (vision.image_size // vision.patch_size) ** 2


def prompt(vlm: VLM, batch: int, visual: int, text: int, generator: torch.Generator) -> dict:
    """Model inputs of `batch` identical-length prompts: one token of system
    prompt (LLaVA) or the vision start (Qwen2-VL), `visual` image tokens with
    random pixels (LLaVA: whole images of image_tokens(vlm), so `visual` is
    rounded up to them; Qwen2-VL: one image of a patch grid holding exactly
    `visual` tokens) and `text` random text tokens."""
    device, dtype = vlm.model.device, vlm.model.dtype
    cfg = vlm.model.config
    words = torch.randint(*text_ids(cfg), (batch, text), generator=generator).to(device)
    # Pixels straight on the device in the model's dtype (a 32K-token batch is tens of GB in float32).
    noise = torch.Generator(device).manual_seed(int(torch.randint(1 << 62, (1,), generator=generator)))
    image_id = vlm.image_token_id
    if vlm.family == "llava":
        per = image_tokens(vlm)
        count = -(-visual // per)
        size = vlm.model.config.vision_config.image_size
        ids = torch.cat([torch.full((batch, 1), FIRST_TEXT_ID, device=device),
                         torch.full((batch, count * per), image_id, device=device), words], dim=1)
        pixels = torch.randn(batch * count, 3, size, size, generator=noise, device=device, dtype=dtype)
        return {"input_ids": ids, "pixel_values": pixels}
    vision = cfg.vision_config
    rows = max(d for d in range(1, math.isqrt(visual) + 1) if visual % d == 0)  # merged tokens: rows x cols
    grid = torch.tensor([[1, 2 * rows, 2 * (visual // rows)]] * batch, device=device)
    patches = 4 * visual
    width = vision.in_chans * vision.temporal_patch_size * vision.patch_size ** 2
    ids = torch.cat([torch.full((batch, 1), cfg.vision_start_token_id, device=device),
                     torch.full((batch, visual), image_id, device=device),
                     torch.full((batch, 1), cfg.vision_end_token_id, device=device), words], dim=1)
    pixels = torch.randn(batch * patches, width, generator=noise, device=device, dtype=dtype)
    return {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid,
            "mm_token_type_ids": (ids == image_id).int()}
