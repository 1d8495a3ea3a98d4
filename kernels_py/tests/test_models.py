"""The model adapter on tiny random LLaVA-style models saved to a temporary
directory: spans from the processor's output, the full cache reproducing the
model's own generate tokens, methods running inside the model with their
caches replacing the full one, and clear errors for what is not supported."""

import json

import pytest
import torch

from kernels_py import models
from kernels_py.attention import Rope
from kernels_py.methods import METHODS, make_method
from kernels_py.tests.tiny_vlm import QWEN_PROMPT, own_greedy, save_image, save_tiny_llava, save_tiny_qwen2_vl

PROMPT = "USER : <image> describe the picture ASSISTANT :"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    path = save_tiny_llava(root / "llava")
    image = save_image(root / "image.png")
    return models.load(path), image, root


def test_spans_come_from_the_processor_output(tiny):
    vlm, image, _ = tiny
    inputs = models.prompt_inputs(vlm, [image], PROMPT)
    spans = models.spans_from_ids(inputs["input_ids"][0], vlm.image_token_id)
    # "USER :" then 64 image tokens (56 / 7 squared), then the question.
    assert spans.system == (0, 2) and spans.images == ((2, 66),) and spans.text == (66, 71)
    two = models.spans_from_ids(torch.tensor([5, 3, 3, 6, 3, 3, 3, 7]), 3)
    assert two.system == (0, 1) and two.images == ((1, 3), (4, 7)) and two.text == (7, 8)


def test_full_cache_reproduces_the_models_own_generate(tiny):
    vlm, image, _ = tiny
    inputs = models.prompt_inputs(vlm, [image], PROMPT)
    reference = vlm.model.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    got = models.generate(vlm, make_method("full"), inputs, 8)
    assert got.tokens == reference.tolist()
    assert got.logits.shape == (8, 64) and got.spans.prompt_tokens == 71
    # The language model's attention is SDPA again afterwards.
    assert vlm.model.model.language_model.config._attn_implementation != models.adapter.ATTENTION


@pytest.mark.parametrize("name, params", [
    ("h2o", {"budget": 0.5}), ("snapkv", {"budget": 0.5, "window": 2}), ("vlcache", {"budget": 0.5}),
    ("zipvl", {"period": 3, "group": 32, "sparse_prefill": False}), ("kivi", {"residual": 4}),
    ("attentionpack", {"rank_k": 8, "rank_v": 8, "rope_base": 10000.0}), ("avl", {}), ("lookm", {}),
])
def test_every_kind_of_method_runs_inside_the_model(tiny, name, params):
    vlm, image, _ = tiny
    inputs = models.prompt_inputs(vlm, [image], PROMPT)
    full = models.generate(vlm, make_method("full"), inputs, 6)
    got = models.generate(vlm, make_method(name, params), inputs, 6, force_tokens=full.tokens)
    assert len(got.tokens) == 6 and torch.isfinite(got.logits).all()
    # The method's cache replaced the full one: it holds fewer bytes (eviction, quantization or factors).
    assert got.cache_bytes < full.cache_bytes
    scores = models.compare(full, got)
    assert 0 <= scores["token_agreement"] <= 1 and len(scores["kl_per_step"]) == 6
    assert scores["kl_mean"] >= 0 and all(kl >= -1e-6 for kl in scores["kl_per_step"])


def test_zipvl_sparse_prefill_runs_inside_the_model(tiny):
    """With sparse_prefill, ZipVL's prefill inside the model is sparse: each
    layer's important tokens attend among themselves and the others' outputs
    are zeros, so layer 0's keys are the model's (no attention comes before
    them) and every later layer's differ from a dense prefill's; the cache is
    built from them. The error is reported over every row of the layers'
    outputs, above what the important rows alone show."""
    vlm, image, _ = tiny
    inputs = models.prompt_inputs(vlm, [image], PROMPT)

    class Recording:
        def __init__(self, method):
            self.method, self.keys = method, None

        def __getattr__(self, name):
            return getattr(self.method, name)

        def prefill_all(self, q, k, v, spans):
            self.keys = [x.clone() for x in k]
            return self.method.prefill_all(q, k, v, spans)

    runs = {}
    for sparse in (False, True):
        runs[sparse] = Recording(make_method("zipvl", {"group": 32, "tau": 0.5, "sparse_prefill": sparse}))
        models.generate(vlm, runs[sparse], inputs, 3)
    assert torch.equal(runs[False].keys[0], runs[True].keys[0])
    assert not torch.allclose(runs[False].keys[1], runs[True].keys[1], atol=1e-3)
    from kernels_py import ablation

    report = ablation.run("zipvl", {"group": 32, "tau": 0.5}, {"model": str(vlm.path), "images": str(image),
                                                                "prompt": PROMPT, "decode_steps": 2}, "vlm")
    m = report["metrics"]
    # The tiny model's random attention is near uniform, so each layer's important tokens (the highest mean
    # attention over the rows that see them) are the prompt's first ones: among a causal prefix the sparse
    # prefill is exact, and at those rows the error is rounding only (0.0 on a GPU, ~1e-7 on the CPU).
    assert 0 <= m["sparse_prefill_error_important"] < 1e-5 < m["sparse_prefill_error"] <= 1
    assert 0 < m["sparse_prefill_flops_saved"] < 1


def test_teacher_forcing_and_the_comparison(tiny):
    """The full cache compared with itself agrees everywhere at zero KL; a
    harsh eviction, fed the full cache's tokens, moves the distributions."""
    vlm, image, _ = tiny
    inputs = models.prompt_inputs(vlm, [image], PROMPT)
    full = models.generate(vlm, make_method("full"), inputs, 5)
    again = models.generate(vlm, make_method("full"), inputs, 5, force_tokens=full.tokens)
    assert models.compare(full, again) == {"token_agreement": 1.0, "kl_mean": 0.0, "kl_per_step": [0.0] * 5}
    harsh = models.generate(vlm, make_method("streamingllm", {"budget": 0.05}), inputs, 5, force_tokens=full.tokens)
    assert models.compare(full, harsh)["kl_mean"] > 0
    with pytest.raises(ValueError, match=r"force_tokens holds \[2\] tokens for 1 sequences; 5 steps feed 4"):
        models.generate(vlm, make_method("full"), inputs, 5, force_tokens=[1, 2])
    # A method's name or class, not a method: said so (it failed inside the attention with an AttributeError).
    for method in ("h2o", METHODS["h2o"]):
        with pytest.raises(TypeError, match=r"method must be a method object, got .*pass make_method\('h2o', "):
            models.generate(vlm, method, inputs, 5)
    # A kvpress press compresses transformers' own cache: the call that runs it is named, not a workload.
    press = make_method("kvpress", {"press": "SnapKVPress"})
    with pytest.raises(ValueError, match=r"'kvpress' compresses transformers' own cache, which models.generate "
                                         r"replaces .*: generate with kernels_py.models.presses.generate\(vlm, "):
        models.generate(vlm, press, inputs, 5)


def test_unsupported_inputs_get_clear_errors(tiny, tmp_path):
    vlm, image, root = tiny
    with pytest.raises(models.ModelError, match="does not exist"):
        models.load(tmp_path / "nowhere")
    # A relative path says where it was looked for: a worker runs in the kernels root, not where the script is.
    with pytest.raises(models.ModelError, match=r"model directory no/llava \(looked for at /.+/no/llava\) does not"):
        models.load("no/llava")
    text_only = tmp_path / "llama"
    text_only.mkdir()
    (text_only / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(models.ModelError, match="'llama' is a text-only model .*supported: llava"):
        models.load(text_only)
    unknown = tmp_path / "other"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "blip", "vision_config": {}}))
    with pytest.raises(models.ModelError, match="'blip' is a model type the adapter does not know"):
        models.load(unknown)
    # A vision-language model without a vision_config (Fuyu feeds patches straight to its language model) is
    # no text-only model; neither is one transformers does not know (its own code), nor a config without a type.
    (unknown / "config.json").write_text(json.dumps({"model_type": "fuyu"}))
    with pytest.raises(models.ModelError, match="'fuyu' is a model type the adapter does not know"):
        models.load(unknown)
    # Nor one whose vision tower sits in a sub-model's config (Qwen2.5-Omni's thinker).
    (unknown / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni",
                                                     "thinker_config": {"vision_config": {"depth": 2}}}))
    with pytest.raises(models.ModelError, match="'qwen2_5_omni' is a model type the adapter does not know"):
        models.load(unknown)
    (unknown / "config.json").write_text(json.dumps({"model_type": "my_vlm", "architectures": ["MyVLM"]}))
    with pytest.raises(models.ModelError, match="'my_vlm' is not a model type transformers .* knows .*supported: llava"):
        models.load(unknown)
    (unknown / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(models.ModelError, match="config.json names no model_type.*supported: llava"):
        models.load(unknown)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    with pytest.raises(models.ModelError, match="cannot be decoded"):
        models.prompt_inputs(vlm, [broken], PROMPT)
    with pytest.raises(models.ModelError, match="nocat.png does not exist: give the path of a PNG"):
        models.prompt_inputs(vlm, [tmp_path / "nocat.png"], PROMPT)
    with pytest.raises(models.ModelError, match="is a directory, not an image file"):
        models.prompt_inputs(vlm, [tmp_path], PROMPT)
    with pytest.raises(models.ModelError, match="0 image placeholder"):
        models.prompt_inputs(vlm, [image], "USER : describe the picture ASSISTANT :")


@pytest.mark.parametrize("dtype", [torch.int8, "fp16"])
def test_a_dtype_that_is_not_floating_point_is_refused_as_such(tiny, dtype):
    """A dtype the model cannot take is named as the fault, before loading:
    the loader's own error for it read as damaged files."""
    _, _, root = tiny
    with pytest.raises(models.ModelError, match=r"dtype .* is not a floating-point torch dtype") as err:
        models.load(root / "llava", dtype=dtype)
    assert "save it again" not in str(err.value)
    assert models.load(root / "llava", dtype="bfloat16").model.dtype == torch.bfloat16


def test_a_prompt_that_writes_its_bos_gets_no_second_one(tiny):
    """A chat template that writes the beginning-of-sequence token itself
    (Gemma 3's) and a tokenizer that adds one too (Gemma 3's): the prompt the
    template renders gets the ids transformers' own
    apply_chat_template(tokenize=True) gives, one BOS; a prompt without it
    still gets the tokenizer's; a batch whose prompts disagree is refused."""
    from tokenizers import processors

    _, image, root = tiny
    vlm = models.load(root / "llava")  # a processor of its own: this one is changed
    tokenizer = vlm.processor.tokenizer
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, bos)])
    vlm.processor.chat_template = ("{{ bos_token }} USER : {% for c in messages[0]['content'] %}{% if c['type'] == "
                                   "'image' %}<image> {% else %}{{ c['text'] }}{% endif %}{% endfor %} ASSISTANT :")
    messages = [{"role": "user", "content": [{"type": "image", "image": str(image)},
                                             {"type": "text", "text": "describe the picture"}]}]
    prompt = vlm.processor.apply_chat_template(messages, add_generation_prompt=True)  # as lmms.prompt_for renders it
    ids = models.prompt_inputs(vlm, [image], prompt)["input_ids"][0].tolist()
    own = vlm.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ids == torch.as_tensor(own["input_ids"])[0].tolist() and ids[0] == bos != ids[1]
    plain = models.prompt_inputs(vlm, [image], PROMPT)["input_ids"][0].tolist()
    assert plain[0] == bos != plain[1]
    with pytest.raises(models.ModelError, match="1 of the batch's 2 prompts begin with the beginning-of-sequence "
                                                "token '<s>' and the others do not"):
        models.batch_inputs(vlm, [([image], prompt), ([image], PROMPT)])


@pytest.mark.parametrize("damage", ["truncated", "garbled", "missing", "config", "partial", "reshaped", "bigger"])
def test_a_damaged_saved_model_is_one_clear_error(tiny, tmp_path, damage):
    """Weights cut short, overwritten or gone, or a config.json that is not
    JSON: a ModelError naming the directory and the cause in one line, not
    the loader's traceback. Weights that lack a layer's tensors, or hold one
    of another shape than the config, are refused too: transformers would
    fill them with random values and only log it; so are weights of a bigger
    model (a third layer where config.json gives two), which it would leave
    out, running a model cut short."""
    from safetensors.torch import load_file, save_file

    import shutil

    _, _, root = tiny
    path = tmp_path / "llava"
    shutil.copytree(root / "llava", path)
    weights = path / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "garbled":
        weights.write_bytes(bytes(range(256)) * 64)
    elif damage == "missing":
        weights.unlink()
    elif damage == "partial":  # the second language layer's tensors left out
        saved = load_file(weights)
        save_file({k: v for k, v in saved.items() if "model.layers.1." not in k}, weights, metadata={"format": "pt"})
    elif damage == "reshaped":
        saved = load_file(weights)
        down = "language_model.model.layers.0.mlp.down_proj.weight"
        save_file({**saved, down: saved[down][:, :100].contiguous()}, weights, metadata={"format": "pt"})
    elif damage == "bigger":  # layer 1's tensors again as a layer 2 that config.json does not have
        saved = load_file(weights)
        extra = {k.replace("layers.1.", "layers.2."): v.clone() for k, v in saved.items() if "language_model" in k and
                 "layers.1." in k}
        save_file({**saved, **extra}, weights, metadata={"format": "pt"})
    else:
        (path / "config.json").write_text("{not json")
    with pytest.raises(models.ModelError) as err:
        models.load(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    want = {"truncated": "SafetensorError", "garbled": "SafetensorError", "missing": "no file named model.safetensors",
            "config": "config.json is not a JSON object",
            "partial": "its weight files lack 9 of the model's tensors (model.language_model.layers.1.input_layernorm"
                       ".weight, model.language_model.layers.1.mlp.down_proj.weight, model.language_model.layers.1.mlp"
                       ".gate_proj.weight, ...), which would run with random",
            "reshaped": "1 of its weights have another shape than config.json gives (model.language_model.layers.0.mlp"
                        ".down_proj.weight: saved [128, 100], config.json makes [128, 256])",
            "bigger": "its weight files hold 9 tensors the model config.json describes has no place for (model"
                      ".language_model.layers.2.input_layernorm.weight, model.language_model.layers.2.mlp.down_proj"
                      ".weight, model.language_model.layers.2.mlp.gate_proj.weight, ...), which would be left out: "
                      "are the weights of a bigger or other model"}[damage]
    assert want in str(err.value)


def test_trace_capture_says_why_it_cannot_write(tiny, tmp_path, capsys):
    from kernels_py.models import trace

    _, image, root = tiny
    out = tmp_path / "missing" / "t.safetensors"
    assert trace.main(["--model", str(root / "llava"), "--image", str(image), "--prompt", PROMPT, "--out", str(out),
                       "--decode-steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"trace capture: cannot write {out}: ") and "\n" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_trace_capture_on_a_missing_gpu_says_so_before_loading(tiny, tmp_path, capsys, monkeypatch):
    from kernels_py.models import trace

    _, image, root = tiny
    monkeypatch.setenv("VLKV_DEVICE", "cuda")
    assert trace.main(["--model", str(root / "llava"), "--image", str(image), "--prompt", PROMPT, "--out",
                       str(tmp_path / "t.safetensors")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trace capture: device cuda was requested but torch sees no CUDA device")
    assert err.endswith("or run with --device cpu") and not (tmp_path / "t.safetensors").exists()


def test_a_trace_replays_as_a_workload(tiny, tmp_path):
    """capture -> file -> the 'trace' workload gives the tensors back; the
    ablation runs on it; what is not a trace is refused."""
    from kernels_py import ablation
    from kernels_py.models import trace
    from kernels_py.workloads import make_workload

    vlm, image, _ = tiny
    tensors, meta = trace.capture(vlm, [image], PROMPT, decode_steps=4)
    path = tmp_path / "trace.safetensors"
    trace.save(path, tensors, meta)
    workload = make_workload("trace", {"path": str(path)}).build()
    assert workload.layers == 2 and workload.decode_steps == 4 and workload.spans.images == ((2, 66),)
    assert workload.q[0].shape == (4, 71, 32) and workload.k[1].shape == (2, 71, 32)
    assert workload.decode_q[0].shape == (4, 4, 1, 32)
    assert torch.equal(workload.k[1].cpu(), tensors["layer.1.k"])
    # Keys before RoPE and the positions: rotating the one by the other gives the cached keys back.
    from kernels_py.attention import apply_rope

    assert torch.equal(tensors["positions"], torch.arange(71)) and tensors["decode_positions"].tolist() == [71, 72, 73, 74]
    theta = meta["model"]["rope_theta"]
    assert torch.allclose(apply_rope(tensors["layer.1.k_pre"], tensors["positions"], theta), tensors["layer.1.k"],
                          atol=1e-5)
    step_keys = tensors["layer.0.decode_k_pre"][:, :, 0].transpose(0, 1)  # [kv_heads, steps, d]
    assert torch.allclose(apply_rope(step_keys, tensors["decode_positions"], theta),
                          tensors["layer.0.decode_k"][:, :, 0].transpose(0, 1), atol=1e-5)
    assert not torch.allclose(tensors["layer.1.k_pre"], tensors["layer.1.k"])
    assert meta["tokens"][:4] == models.generate(vlm, make_method("full"), models.prompt_inputs(vlm, [image], PROMPT),
                                                 4).tokens
    # The replayed full cache is exact, a compressing method is scored on the real attention.
    assert ablation.run("full", {}, {"path": str(path)}, "trace")["metrics"]["rel_err_mean"] == 0.0
    m = ablation.run("h2o", {"budget": 0.3}, {"path": str(path)}, "trace")["metrics"]
    assert m["compression_ratio"] > 1 and m["rel_err_mean"] > 0
    from safetensors.torch import save_file

    not_a_trace = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(2)}, str(not_a_trace))
    with pytest.raises(ValueError, match="not a vlkv trace"):
        make_workload("trace", {"path": str(not_a_trace)}).build()
    with pytest.raises(ValueError, match="does not exist"):
        make_workload("trace", {"path": str(tmp_path / "none.safetensors")}).build()


def test_a_trace_names_its_model_by_an_absolute_path(tiny, monkeypatch):
    """A model given relative to where capture ran is recorded absolute: the
    trace is read later, from elsewhere (trace inspect, a notebook)."""
    from kernels_py.models import trace

    _, image, root = tiny
    monkeypatch.chdir(root)
    _, meta = trace.capture(models.load("llava"), [image], PROMPT, decode_steps=1)
    assert meta["model"]["directory"] == str(root / "llava")


def test_a_trace_file_takes_the_umasks_mode(tmp_path):
    """safetensors writes its files 0600: a trace is readable as any file
    its writer makes (0644 under umask 022), so others can replay it."""
    import os
    import stat

    from kernels_py.models import trace

    old = os.umask(0o022)
    try:
        trace.save(tmp_path / "t.safetensors", {"positions": torch.arange(3)}, {"format": trace.FORMAT})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "t.safetensors").stat().st_mode) == 0o644


def test_a_damaged_trace_names_the_tensor_at_fault(tiny, tmp_path):
    """A trace whose tensors are not those its header describes (one
    missing, cut short, of an integer dtype), or a directory given as the
    trace, is one error naming what is wrong, not a KeyError or an
    AttributeError from inside a method."""
    from kernels_py.models import trace
    from kernels_py.workloads import make_workload

    vlm, image, _ = tiny
    tensors, meta = trace.capture(vlm, [image], PROMPT, decode_steps=2)

    def build(name, changed):
        path = tmp_path / f"{name}.safetensors"
        trace.save(path, changed, meta)
        return make_workload("trace", {"path": str(path)}).build()

    assert build("whole", tensors).k[1].shape == (2, 71, 32)
    missing = {k: v for k, v in tensors.items() if k != "layer.1.q"}
    with pytest.raises(ValueError, match=r"tensor 'layer.1.q' is missing \(its header gives 2 layers, 4 heads"):
        build("missing", missing)
    cut = {**tensors, "layer.0.k": tensors["layer.0.k"][:, :50].contiguous()}
    with pytest.raises(ValueError, match=r"tensor 'layer.0.k' has shape \[2, 50, 32\], not the \[2, 71, 32\]"):
        build("cut", cut)
    ints = {**tensors, "layer.1.v": tensors["layer.1.v"].to(torch.int32)}
    with pytest.raises(ValueError, match="tensor 'layer.1.v' is int32, not floating point"):
        build("ints", ints)
    older = {k: v for k, v in tensors.items() if "k_pre" not in k}  # traces from before pre-RoPE keys still replay
    assert build("older", older).decode_steps == 2
    with pytest.raises(ValueError, match="is a directory, not a trace file"):
        make_workload("trace", {"path": str(tmp_path)}).build()


def _hand_trace(prompt: int = 6, steps: int = 2) -> tuple[dict, dict]:
    """A whole trace of 1 layer, 2 heads, 1 kv head, head_dim 4, with one
    3-token image after a 1-token system prompt, written by hand."""
    from kernels_py.models import trace

    tensors = {"positions": torch.arange(prompt), "decode_positions": torch.arange(prompt, prompt + steps),
               "layer.0.q": torch.randn(2, prompt, 4), "layer.0.decode_q": torch.randn(steps, 2, 1, 4)}
    for name in ("k", "v", "k_pre"):
        tensors[f"layer.0.{name}"] = torch.randn(1, prompt, 4)
        tensors[f"layer.0.decode_{name}"] = torch.randn(steps, 1, 1, 4)
    meta = {"format": trace.FORMAT, "prompt_tokens": prompt, "decode_steps": steps,
            "model": {"layers": 1, "heads": 2, "kv_heads": 1, "head_dim": 4, "rope": "default", "rope_theta": 1e4},
            "spans": {"system": [0, 1], "images": [[1, 4]], "text": [4, prompt]}}
    return tensors, meta


def _edited(change):
    """The metadata JSON of _hand_trace after change(meta) edits it in place."""
    def metadata(meta):
        change(meta)
        return json.dumps(meta)
    return metadata


@pytest.mark.parametrize("metadata, message", [
    (lambda meta: '{"format": ', r"its trace metadata is not JSON \(Expecting value"),
    (lambda meta: "[1, 2]", "its trace metadata is a JSON list, not an object"),
    (_edited(lambda meta: meta.pop("spans")), r"its trace metadata has no 'spans' \(spans and RoPE\)"),
    (_edited(lambda meta: meta["model"].pop("rope")), "its trace metadata has no 'rope'"),
    (_edited(lambda meta: meta["spans"].update(images=[[1, 40]])),
     r"its trace metadata's spans or RoPE are unusable \(spans must follow each other"),
    (_edited(lambda meta: meta["spans"].update(text=[4, 5])),
     "its spans end at token 5, not at the 6 prompt tokens its header gives"),
    (_edited(lambda meta: meta["model"].update(rope="xrope")),
     r"its trace metadata's spans or RoPE are unusable \(RoPE kind 'xrope'"),
])
def test_a_trace_with_damaged_metadata_is_refused_naming_the_file(tmp_path, metadata, message):
    """Metadata that is not a JSON object, or whose spans are missing, out of
    order or end before the prompt does, is one error naming the trace: it
    was a JSONDecodeError, an AttributeError or a KeyError, or a Spans error
    that did not say which file, from inside the job."""
    import re

    from safetensors.torch import save_file

    from kernels_py.models import trace
    from kernels_py.workloads import make_workload

    tensors, meta = _hand_trace()
    good = tmp_path / "good.safetensors"
    trace.save(good, tensors, meta)
    assert make_workload("trace", {"path": str(good)}).build().spans.images == ((1, 4),)
    path = tmp_path / "damaged.safetensors"
    save_file(tensors, str(path), metadata={"vlkv": metadata(meta)})
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: {message}"):
        make_workload("trace", {"path": str(path)}).build()


def test_a_trace_replays_with_its_own_rope(tmp_path):
    """The trace header's RoPE (kind, theta) and positions reach the methods:
    a Llama-style model with theta 1e6 has its keys unrotated with 1e6 (the
    captured pre-RoPE keys come back), AttentionPack takes that theta and
    refuses another; a Qwen2-VL trace replays its 3-D M-RoPE positions and
    AttentionPack's rope='before' is refused on it."""
    from kernels_py import ablation
    from kernels_py.models import trace
    from kernels_py.workloads import make_workload

    def replay(vlm, image, prompt, name):
        tensors, meta = trace.capture(vlm, [image], prompt, decode_steps=2)
        path = tmp_path / f"{name}.safetensors"
        trace.save(path, tensors, meta)
        return tensors, str(path), make_workload("trace", {"path": str(path)}).build()

    image = save_image(tmp_path / "image.png")
    llama = models.load(save_tiny_llava(tmp_path / "llama", rope_theta=1e6))
    tensors, path, workload = replay(llama, image, PROMPT, "llama")
    assert workload.spans.rope == Rope("default", 1e6) and torch.equal(workload.positions.cpu(), torch.arange(71))
    for layer in range(2):
        unrotated = workload.spans.rope.rotate(workload.k[layer].float(), -workload.positions)
        torch.testing.assert_close(unrotated.cpu(), tensors[f"layer.{layer}.k_pre"].float(), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(Rope("default", 10000.0).rotate(workload.k[layer].float(), -workload.positions).cpu(),
                                  tensors[f"layer.{layer}.k_pre"].float(), atol=1e-3)
    shifted = tmp_path / "shifted.safetensors"  # positions other than the methods' 0..T-1 are refused
    trace.save(shifted, {**tensors, "positions": tensors["positions"] + 1}, trace.read(path)[1])
    with pytest.raises(ValueError, match="trace positions are not 0..70 then 71..72"):
        make_workload("trace", {"path": str(shifted)}).build()
    pack = {"rank_k": 16, "rank_v": 16}
    assert ablation.run("attentionpack", pack, {"path": path}, "trace")["metrics"]["rel_err_mean"] < 1
    with pytest.raises(ValueError, match="rope_base=10000 but the workload's keys were rotated with theta 1e"):
        ablation.run("attentionpack", {**pack, "rope_base": 10000.0}, {"path": path}, "trace")

    qwen = models.load(save_tiny_qwen2_vl(tmp_path / "qwen"))
    _, path, workload = replay(qwen, save_image(tmp_path / "small.png", size=112), QWEN_PROMPT, "qwen")
    assert workload.spans.rope.kind == "mrope" and workload.positions.shape == (3, 25)
    with pytest.raises(ValueError, match="rotated with mrope .* use rope='after'"):
        ablation.run("attentionpack", pack, {"path": path}, "trace")
    after = ablation.run("attentionpack", {**pack, "rope": "after"}, {"path": path}, "trace")["metrics"]
    assert 0 < after["rel_err_mean"] < 1


def test_scaled_rope_reaches_the_spans_and_the_trace(tmp_path):
    """A model whose config scales RoPE linearly (Gemma 3 4B and up scale
    their global layers by 8): the adapter's Rope carries the scaling, and so
    does the trace header, so the replayed keys unrotate, at positions /
    factor, to the captured pre-RoPE keys. AttentionPack's rope='before',
    whose decode kernels redo plain RoPE, is refused, live and replayed. A
    header from before the scaling was recorded reads as unscaled; a scaling
    that reshapes the frequencies (yarn) is refused by name."""
    from transformers import Gemma3TextConfig

    from kernels_py import ablation
    from kernels_py.models import adapter, trace
    from kernels_py.workloads import make_workload

    vlm = models.load(save_tiny_llava(tmp_path / "linear", rope_scaling={"rope_type": "linear", "factor": 4.0}))
    image = save_image(tmp_path / "image.png")
    assert vlm.rope == Rope("default", 10000.0, "linear", 4.0)
    tensors, meta = trace.capture(vlm, [image], PROMPT, decode_steps=2)
    assert meta["model"]["rope_scaling"] == {"type": "linear", "factor": 4.0}
    path = tmp_path / "linear.safetensors"
    trace.save(path, tensors, meta)
    workload = make_workload("trace", {"path": str(path)}).build()
    assert workload.spans.rope == vlm.rope
    for layer in range(2):
        rotated = workload.spans.rope.rotate(tensors[f"layer.{layer}.k_pre"].float(), workload.positions.cpu())
        torch.testing.assert_close(rotated, tensors[f"layer.{layer}.k"].float(), atol=1e-5, rtol=1e-5)
    pack = {"rank_k": 8, "rank_v": 8}
    refusal = r"rotated with linear RoPE scaling \(factor 4\).* use rope='after'"
    with pytest.raises(ValueError, match=refusal):
        ablation.run("attentionpack", pack, {"path": str(path)}, "trace")
    with pytest.raises(ValueError, match=refusal):
        models.generate(vlm, make_method("attentionpack", pack), models.prompt_inputs(vlm, [image], PROMPT), 2)
    after = ablation.run("attentionpack", {**pack, "rope": "after"}, {"path": str(path)}, "trace")["metrics"]
    assert 0 < after["rel_err_mean"] < 1
    older = {**meta, "model": {k: v for k, v in meta["model"].items() if k != "rope_scaling"}}
    assert trace.spans_of(older).rope == Rope("default", 10000.0)
    yarn = Rope("default", 10000.0, "yarn", 4.0)
    assert not yarn.invertible_from_index
    with pytest.raises(ValueError, match=r"RoPE scaling 'yarn' \(factor 4\) changes the rotation's frequencies"):
        yarn.rotate(tensors["layer.0.k_pre"], workload.positions.cpu())
    # Gemma 3 scales its global layers only, which are the ones the methods hold.
    gemma = Gemma3TextConfig(rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert adapter.rope_scaling(gemma) == ("linear", 8.0) and adapter.rope_theta(gemma) == 1e6


def test_stop_strings_end_generation_once_the_text_holds_one(tiny):
    """Decoding ends once the reply's text holds a stop string (what an
    lmms-eval task's `until` asks), at the token that completed it: the
    tokens and the cache stop there, alone, in a batch (each sequence at its
    own) and on the kvpress path."""
    from kernels_py.models import presses

    _, image, root = tiny
    vlm = models.load(root / "llava")  # a tokenizer of its own: this one gets words
    tokenizer = vlm.processor.tokenizer
    # The tiny tokenizer has words for a third of the model's ids: a word for each other id, so every token shows.
    tokenizer.add_tokens([f"w{i}" for i in range(len(tokenizer), vlm.model.config.text_config.vocab_size)])
    inputs = models.prompt_inputs(vlm, [image], PROMPT)
    full = make_method("full")
    free = models.generate(vlm, full, inputs, 8)

    def text(tokens):
        return tokenizer.decode(tokens, skip_special_tokens=True)

    stop = text(free.tokens[1:2])
    end = next(n for n in range(1, 9) if stop in text(free.tokens[:n]))
    assert stop and end < len(free.tokens)
    stopped = models.generate(vlm, full, inputs, 8, stop_strings=(stop,))
    assert stopped.tokens == free.tokens[:end] and stopped.cache_bytes < free.cache_bytes
    assert torch.equal(stopped.logits, free.logits[:end])
    assert models.generate(vlm, full, inputs, 8, stop_strings=("no such text",)).tokens == free.tokens
    pairs = [([image], PROMPT), ([image], "USER : <image> what is in a red cat ? ASSISTANT :")]
    batch = models.generate_batch(vlm, full, models.batch_inputs(vlm, pairs), 8, stop_strings=(stop,))
    for (images, prompt), got in zip(pairs, batch):
        alone = models.generate(vlm, full, models.prompt_inputs(vlm, images, prompt), 8, stop_strings=(stop,))
        assert got.tokens == alone.tokens
    assert batch[0].tokens == free.tokens[:end]
    assert presses.generate(vlm, None, inputs, 8, stop_strings=(stop,)).tokens == free.tokens[:end]


def test_a_worker_holds_no_more_models_than_its_loader(tiny, tmp_path):
    """The vlm workload's jobs keep what they derive from a model (the full
    cache's generation) on the model: once more model directories have run
    than the loader holds (LOADED_MODELS), the first model is gone from
    memory, and those the loader holds are not."""
    import gc
    import shutil
    import weakref

    from kernels_py import ablation
    from kernels_py.workloads import base

    _, image, root = tiny
    base.loaded_model.cache_clear()
    held = []
    for i in range(base.LOADED_MODELS + 1):
        path = shutil.copytree(root / "llava", tmp_path / f"llava{i}")
        ablation.run("full", {}, {"model": str(path), "images": str(image), "prompt": PROMPT, "decode_steps": 1},
                     "vlm")
        held.append(weakref.ref(base.loaded_model(str(path))))
    gc.collect()
    assert held[0]() is None and all(model() is not None for model in held[1:])


def test_a_live_model_workload_scores_methods_inside_the_model(tiny):
    """workload("vlm", ...): the ablation's metrics on the model's attention
    plus the method run inside the model against the full cache."""
    from kernels_py import ablation

    _, image, root = tiny
    workload = {"model": str(root / "llava"), "images": str(image), "prompt": PROMPT, "decode_steps": 4}
    full = ablation.run("full", {}, workload, "vlm")["metrics"]
    assert full["token_agreement"] == 1.0 and full["kl_mean"] == 0.0 and full["rel_err_mean"] == 0.0
    h2o = ablation.run("h2o", {"budget": 0.2}, workload, "vlm")["metrics"]
    assert h2o["model_cache_bytes"] < full["model_cache_bytes"] and h2o["kl_mean"] > 0
    assert full["model_compression_ratio"] == 1.0
    assert h2o["model_compression_ratio"] == pytest.approx(full["model_cache_bytes"] / h2o["model_cache_bytes"])
    assert 0 <= h2o["token_agreement"] <= 1 and h2o["prefill_seconds"] > 0
    # Measured on the device the model is on (a CPU here): the resident set's figures, no GPU figure.
    assert h2o["peak_gpu_bytes"] != h2o["peak_gpu_bytes"] and h2o["peak_cpu_bytes"] > 0
    assert h2o["peak_cpu_bytes"] >= h2o["decode_peak_bytes"]
    report = ablation.run("h2o", {"budget": 0.2}, workload, "vlm")
    steps = report["per_step"]
    assert len(steps["tokens"]) == len(steps["reference_tokens"]) == len(steps["kl"]) == 5
    agreed = sum(a == b for a, b in zip(steps["tokens"], steps["reference_tokens"]))
    assert report["metrics"]["token_agreement"] == agreed / 5
    with pytest.raises(ValueError, match="needs images= or videos="):
        ablation.run("full", {}, {"model": str(root / "llava")}, "vlm")


@pytest.mark.parametrize("version, family", [("2", "qwen2_vl"), ("2.5", "qwen2_5_vl")])
def test_qwen_vl_with_m_rope(tmp_path, version, family):
    """Qwen2-VL and Qwen2.5-VL: spans from their <|image_pad|> tokens, the
    full cache reproduces their generate, methods run inside them, and a
    method that undoes RoPE itself is refused (M-RoPE rotates by 3-D positions)."""
    vlm = models.load(save_tiny_qwen2_vl(tmp_path / family, version=version))
    image = save_image(tmp_path / "image.png", size=112)
    assert vlm.family == family and vlm.mrope
    inputs = models.prompt_inputs(vlm, [image], QWEN_PROMPT)
    spans = models.spans_from_ids(inputs["input_ids"][0], vlm.image_token_id)
    # "USER : <|vision_start|>", 16 image tokens, then "<|vision_end|>" and the question as text.
    assert spans.system == (0, 3) and spans.images == ((3, 19),) and spans.text == (19, 25)
    reference = vlm.model.generate(**inputs, max_new_tokens=6, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    full = models.generate(vlm, make_method("full"), inputs, 6)
    assert full.tokens == reference.tolist()
    for name, params in (("h2o", {"budget": 0.5}), ("zipvl", {"group": 32, "sparse_prefill": False}),
                         ("attentionpack", {"rank_k": 8, "rank_v": 8, "rope": "after"})):
        got = models.generate(vlm, make_method(name, params), inputs, 6, force_tokens=full.tokens)
        assert got.cache_bytes < full.cache_bytes and 0 <= models.compare(full, got)["token_agreement"] <= 1
    # The trace keeps M-RoPE's 3-D positions: the image's 16 tokens share a temporal position and walk a 4 x 4 grid.
    from kernels_py.models import trace

    tensors, meta = trace.capture(vlm, [image], QWEN_PROMPT, decode_steps=2)
    positions = tensors["positions"]
    assert meta["model"]["rope"] == "mrope" and positions.shape == (3, 25) and tensors["layer.0.k_pre"].shape[1] == 25
    assert positions[0, 3:19].unique().tolist() == [3] and positions[1, 3:19].tolist() == [3, 3, 3, 3, 4, 4, 4, 4,
                                                                                            5, 5, 5, 5, 6, 6, 6, 6]
    assert tensors["decode_positions"].tolist() == [[13, 14]] * 3  # text after the image continues from max + 1
    # The spans carry the model's RoPE, and a method that undoes RoPE itself refuses M-RoPE from them.
    assert models.spans_from_ids(inputs["input_ids"][0], vlm.image_token_id, vlm.rope).rope == Rope("mrope", 1e6)
    with pytest.raises(ValueError, match="rotated with mrope .* use rope='after'"):
        models.generate(vlm, make_method("attentionpack", {"rank_k": 8, "rank_v": 8}), inputs, 2)


def test_a_batch_of_prompts_of_different_lengths(tiny, tmp_path):
    """Two prompts, left-padded into one batch: each sequence keeps its own
    method caches; with the full cache each generates what it generates
    alone, and what the model's own batched generate gives, logits and all
    (the tokens of a tiny random model hardly depend on positions)."""
    vlm, image, _ = tiny
    other = save_image(tmp_path / "other.png", seed=5)
    long_prompt = "USER : <image> describe the picture what is in a red cat ? ASSISTANT :"
    pairs = [([image], PROMPT), ([other], long_prompt)]
    inputs = models.batch_inputs(vlm, pairs)
    assert inputs["input_ids"].shape == (2, 71 + 7) and int(inputs["attention_mask"][0].sum()) == 71
    full = models.generate_batch(vlm, make_method("full"), inputs, 6)
    tokens, logits = own_greedy(vlm.model, inputs, 6)
    assert [g.tokens for g in full] == tokens
    for (images, prompt), got, own in zip(pairs, full, logits):
        torch.testing.assert_close(got.logits, own, atol=1e-4, rtol=1e-4)
        alone = models.generate(vlm, make_method("full"), models.prompt_inputs(vlm, images, prompt), 6)
        assert got.tokens == alone.tokens and got.spans == alone.spans
    # A method's caches are per sequence (ragged: each holds its own prompt's share).
    h2o = models.generate_batch(vlm, make_method("h2o", {"budget": 0.3}), inputs, 6,
                                force_tokens=[g.tokens for g in full])
    assert h2o[0].cache_bytes < h2o[1].cache_bytes < full[1].cache_bytes
    with pytest.raises(models.ModelError, match="generate takes one prompt"):
        models.generate(vlm, make_method("full"), inputs, 2)


def test_qwen_batch_keeps_each_sequences_m_rope_positions(tmp_path):
    """A left-padded Qwen2-VL batch: the 3-D positions skip the padding, so
    each sequence generates what it does alone and what the model's own
    batched generate gives."""
    vlm = models.load(save_tiny_qwen2_vl(tmp_path / "qwen", seed=1))
    image = save_image(tmp_path / "image.png", size=112)
    longer = QWEN_PROMPT.replace("describe the picture", "what is in the picture a red cat or a blue dog ?")
    pairs = [([image], QWEN_PROMPT), ([image], longer)]
    inputs = models.batch_inputs(vlm, pairs)
    assert int(inputs["attention_mask"][0].sum()) < inputs["input_ids"].shape[1]  # the first is padded
    full = models.generate_batch(vlm, make_method("full"), inputs, 6)
    reference = vlm.model.generate(**inputs, max_new_tokens=6, do_sample=False)[:, inputs["input_ids"].shape[1]:]
    assert [g.tokens for g in full] == reference.tolist()
    for (images, prompt), got in zip(pairs, full):
        alone = models.generate(vlm, make_method("full"), models.prompt_inputs(vlm, images, prompt), 6)
        assert got.tokens == alone.tokens and torch.allclose(got.logits, alone.logits, atol=1e-4)


def test_llava_next_anyres_tiles(tmp_path):
    """LLaVA-NeXT: an image is a base view plus tiles chosen by its aspect, so
    a wide image has more image tokens; the spans follow the processor's
    expansion, the full cache reproduces the model's generate (alone and in
    a batch of two images of different shapes), and methods run inside."""
    from PIL import Image

    vlm = models.load(save_tiny_llava(tmp_path / "next", next=True))
    square = save_image(tmp_path / "square.png", size=40)
    wide = tmp_path / "wide.png"
    Image.open(save_image(tmp_path / "w.png", seed=3, size=100)).crop((0, 0, 100, 50)).save(wide)
    assert vlm.family == "llava_next"
    counts = []
    for image in (square, wide):
        inputs = models.prompt_inputs(vlm, [image], PROMPT)
        spans = models.spans_from_ids(inputs["input_ids"][0], vlm.image_token_id)
        assert spans.system == (0, 2) and spans.text[1] - spans.text[0] == 5
        counts.append(spans.images[0][1] - spans.images[0][0])
        reference = vlm.model.generate(**inputs, max_new_tokens=6, do_sample=False)[0, inputs["input_ids"].shape[1]:]
        full = models.generate(vlm, make_method("full"), inputs, 6)
        assert full.tokens == reference.tolist()
        got = models.generate(vlm, make_method("vlcache", {"budget": 0.3}), inputs, 6, force_tokens=full.tokens)
        assert got.cache_bytes < full.cache_bytes
    # The base view is 8 x 8 = 64 tokens; the square image adds one tile (8 rows of 8, a newline each: 72), the
    # 2:1 image two side by side (8 rows of 16 plus newlines: 136).
    assert counts == [64 + 72, 64 + 136]
    inputs = models.batch_inputs(vlm, [([square], PROMPT), ([wide], PROMPT)])
    batch = models.generate_batch(vlm, make_method("full"), inputs, 4)
    tokens, logits = own_greedy(vlm.model, inputs, 4)
    assert [g.tokens for g in batch] == tokens
    for got, own in zip(batch, logits):
        torch.testing.assert_close(got.logits, own, atol=1e-4, rtol=1e-4)


def test_memory_falls_when_a_method_evicts(tmp_path):
    """Memory measured on the device while decoding (a CPU here: the resident
    set) follows the cache the method holds: the full cache's 31 MB show, an
    eviction to a fifth of the tokens holds far less. A model whose attention
    is wide (head_dim 512) so the cache dwarfs the rest."""
    vlm = models.load(save_tiny_llava(tmp_path / "wide", layers=4, kv_heads=4, head_dim=512, image_size=154))
    inputs = models.prompt_inputs(vlm, [save_image(tmp_path / "image.png")], PROMPT)
    full = models.generate(vlm, make_method("full"), inputs, 4)
    h2o = models.generate(vlm, make_method("h2o", {"budget": 0.2}), inputs, 4, force_tokens=full.tokens)
    if full.memory_kind == "cpu-rss" and full.decode_peak_bytes != full.decode_peak_bytes:
        pytest.skip("no /proc/self/status: the resident set cannot be read here")
    assert full.cache_bytes > 30 * 2**20 and h2o.cache_bytes < full.cache_bytes / 4
    assert full.decode_peak_bytes > 0.8 * full.cache_bytes
    assert h2o.decode_peak_bytes < full.decode_peak_bytes / 2
    assert full.peak_bytes >= full.decode_peak_bytes
