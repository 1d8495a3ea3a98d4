"""Real vision-language models: load a Hugging Face VLM from a local
directory, find its prompt's modality spans from the processor's output, and
run prefill and greedy decoding with any compression method in every
language-model layer, through transformers' own interfaces (a Cache
subclass and a registered attention function), not copied modeling files.

families.py  the families the adapter drives: placeholders, inputs (image,
             several images, video), how a video's frames are laid out
adapter.py   loading, spans (one per image and video frame), the method-driven
             cache and attention, greedy generation with per-step logits, the
             comparison with the full cache
video.py     video files and frame directories, sampled into frames
trace.py     attention traces: capture (per-layer Q/K/V of a full-cache run),
             save / read (safetensors + JSON metadata); replayed by the
             "trace" workload, captured live by the "vlm" one
"""

from kernels_py.models.adapter import (
    FAMILIES, TESTED_TRANSFORMERS, Generation, ModelError, VLM, batch_inputs, batch_spans, compare, generate,
    generate_batch, generate_sdpa, load, prompt_inputs, spans_from_ids,
)

__all__ = ["FAMILIES", "TESTED_TRANSFORMERS", "Generation", "ModelError", "VLM", "batch_inputs", "batch_spans",
           "compare", "generate", "generate_batch", "generate_sdpa", "load", "prompt_inputs", "spans_from_ids"]
