"""Real vision-language models: load a Hugging Face VLM from a local
directory, find its prompt's modality spans from the processor's output, and
run prefill and greedy decoding with any compression method in every
language-model layer, through transformers' own interfaces (a Cache
subclass and a registered attention function), not copied modeling files.

adapter.py   loading, spans, the method-driven cache and attention, greedy
             generation with per-step logits
"""

from kernels_py.models.adapter import (
    FAMILIES, TESTED_TRANSFORMERS, Generation, ModelError, VLM, compare, generate, load, prompt_inputs,
    spans_from_ids,
)

__all__ = ["FAMILIES", "TESTED_TRANSFORMERS", "Generation", "ModelError", "VLM", "compare", "generate", "load",
           "prompt_inputs", "spans_from_ids"]
