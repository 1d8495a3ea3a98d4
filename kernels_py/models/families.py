"""The VLM families the adapter drives, and what it needs to know of each:
what a prompt writes where an image or a video goes, which inputs it
takes, how its processor lays a video out in the prompt's tokens, and its
RoPE. Everything else (token ids, layer shapes, sliding windows, attention
scale) is read from the model's own config and processor.

How a video is laid out decides its per-frame spans: `video_runs` "one"
means the processor expands a video into one run of video tokens, which
the adapter cuts into `frames` equal spans (a remainder, such as
LLaVA-OneVision's closing newline token, joins the last); "per_frame" means
every frame is a run of its own, separated by text (timestamps, frame
labels), so each run is a frame. A "frame" is what the processor makes one:
Qwen's vision towers merge two sampled frames into one temporal step.
"""

from dataclasses import dataclass

@dataclass(frozen=True)
class Family:
    model_type: str
    description: str
    image_placeholder: str  # what a prompt holds where an image goes (every family takes one or several)
    video_placeholder: str | None  # likewise for a video; None: the family takes no video
    mrope: bool = False  # RoPE by 3-D (temporal, height, width) positions: not invertible from a token's index
    video_runs: str = "one"  # "one" or "per_frame" (module doc)
    # An image's tokens attend to each other both ways in prefill (Gemma 3): a method's own causal prefill attention
    # (ZipVL's sparse prefill) would compute another model's.
    bidirectional_images: bool = False

    @property
    def inputs(self) -> tuple[str, ...]:
        return ("image", "multi-image") + (("video",) if self.video_placeholder else ())


_QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
_QWEN_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llava", "LLaVA-1.5 style (CLIP vision tower, Llama-family language model, <image> placeholder)",
           "<image>", None),
    Family("llava_next", "LLaVA-NeXT / LLaVA-1.6 (as LLaVA-1.5, with anyres tiling: a base view, the tiles and a "
           "newline token per row)", "<image>", None),
    Family("qwen2_vl", "Qwen2-VL (its vision tower, GQA language model with M-RoPE, "
           "<|vision_start|><|image_pad|><|vision_end|> placeholder)",
           _QWEN_IMAGE, _QWEN_VIDEO, mrope=True),
    Family("qwen2_5_vl", "Qwen2.5-VL (as Qwen2-VL, with a windowed vision tower and absolute-time M-RoPE for video)",
           _QWEN_IMAGE, _QWEN_VIDEO, mrope=True),
    Family("llava_onevision", "LLaVA-OneVision (SigLIP, Qwen2 language model; a single image anyres, several images "
           "a base view each, video frames pooled 2 x 2 with one newline token after the last frame)",
           "<image>", "<video>"),
    Family("llava_next_video", "LLaVA-NeXT-Video (as LLaVA-NeXT for images; video frames pooled 2 x 2)",
           "<image>", "<video>"),
    Family("video_llava", "Video-LLaVA (one CLIP tower for images and frames, Llama language model; a frame keeps "
           "its CLS token)", "<image>", "<video>"),
    Family("internvl", "InternVL, HF-native (InternVL2.5/3: InternViT, pixel shuffle, Qwen2 language model; an "
           "image is tiles plus a thumbnail between <img> and </img>, a video frame one tile after \"FrameN:\")",
           "<IMG_CONTEXT>", "<video>", video_runs="per_frame"),
    Family("qwen3_vl", "Qwen3-VL (interleaved M-RoPE; DeepStack adds visual features to the first language layers' "
           "hidden states; each video frame between its own vision markers after a timestamp)",
           _QWEN_IMAGE, "<|video_pad|>", mrope=True, video_runs="per_frame"),
    Family("gemma3", "Gemma 3 (SigLIP tower, a fixed 256 tokens an image; sliding-window layers interleaved with "
           "global ones: methods hold the global layers, a sliding layer keeps its window as the model does)",
           "<start_of_image>", None, bidirectional_images=True),
)}


def supported() -> str:
    """The families and what each takes, for error messages."""
    return "; ".join(f"{name} ({', '.join(f.inputs)})" for name, f in FAMILIES.items())
