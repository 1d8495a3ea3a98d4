"""The end-to-end generation benchmark: the models are the published sizes,
the synthetic prompts are what the models take, and a run on the CPU
reports every method against the full cache (its timings are not checked)."""

import pytest
import torch

from kernels_py import benchmarks, runtime
from kernels_py.benchmarks import generate
from kernels_py.models import sized, spans_from_ids


@pytest.mark.parametrize("name,params", [("llava-1.5-7b", 7.063e9), ("qwen2-vl-7b", 8.291e9)])
def test_the_sizes_are_the_published_models(name, params):
    """Built without memory (meta device): the parameter count of the public
    checkpoints (LLaVA-1.5-7B 7.06B, Qwen2-VL-7B 8.29B), so the weights that
    every step moves are the real model's."""
    vlm = sized.build(name, 4096, device=torch.device("meta"), dtype=torch.float16)
    count = sum(p.numel() for p in vlm.model.parameters())
    assert count == pytest.approx(params, rel=0.005)
    assert next(vlm.model.parameters()).dtype == torch.float16
    # Random text stays below every special id (LLaVA's image token 32000, Qwen2's 151643 and up).
    assert sized.text_ids(vlm.model.config) == (sized.FIRST_TEXT_ID, {"llava-1.5-7b": 32000,
                                                                       "qwen2-vl-7b": 151643}[name])


@pytest.mark.parametrize("name,visual,want", [("tiny-llava", 100, 128), ("tiny-qwen2-vl", 96, 96)])
def test_synthetic_prompts_hold_the_visual_tokens_asked(name, visual, want):
    """LLaVA rounds up to whole images (64 tokens at the tiny size); Qwen2-VL
    takes one image whose patch grid merges into exactly the tokens asked.
    The model runs them, and the spans a method sees are the image."""
    vlm = sized.build(name, 512, device=torch.device("cpu"), dtype=torch.float32)
    inputs = sized.prompt(vlm, 2, visual, 5, torch.Generator().manual_seed(0))
    ids = inputs["input_ids"]
    assert all(int((row == vlm.image_token_id).sum()) == want for row in ids)
    spans = spans_from_ids(ids[1], vlm.image_token_id)
    assert spans.images == ((1, 1 + want),) and spans.text[1] == ids.shape[1]
    if name == "tiny-qwen2-vl":
        t, h, w = inputs["image_grid_thw"][0].tolist()
        assert (t, h * w // 4) == (1, want) and inputs["pixel_values"].shape[0] == 2 * h * w
    with torch.inference_mode():
        logits = vlm.model(**inputs).logits
    assert logits.shape[:2] == ids.shape and torch.isfinite(logits).all()


def test_smoke_run_compares_every_method_with_the_full_cache():
    result = benchmarks.run("generate", dict(generate.Generate.smoke_sizes(), methods="full,vlcache,zipvl"))
    rows = result["rows"]
    names = (generate.BASELINE, "full", "vlcache", "zipvl")
    assert [(r["batch"], r["method"]) for r in rows] == [(b, m) for b in (1, 2) for m in names]
    for r in rows:
        assert r["prefill_s"] > 0 and r["decode_step_ms"] > 0
        assert r["generate_s"] == pytest.approx(r["prefill_s"] + r["decode_step_ms"] / 1e3 * 3)
        full = next(f for f in rows if f["batch"] == r["batch"] and f["method"] == generate.BASELINE)
        assert r["decode_speedup"] == pytest.approx(full["decode_step_ms"] / r["decode_step_ms"])
        assert r["cache_share"] == pytest.approx(r["cache_bytes"] / full["cache_bytes"])
        # What decoding alone holds, which a method's prefill (every layer's Q/K/V at once) hides in peak_bytes.
        assert "decode_peak_bytes" in r and not r["decode_peak_bytes"] > r["peak_bytes"]
    vlcache = [r for r in rows if r["method"] == "vlcache"]
    assert all(0 < r["cache_share"] < 0.25 for r in vlcache)  # a 10% budget, plus the generated tokens
    # The method path's full cache holds what transformers' does; two prompts hold twice one's.
    assert [r["cache_share"] for r in rows if r["method"] == "full"] == [1.0, 1.0]
    assert rows[4]["cache_bytes"] == 2 * rows[0]["cache_bytes"]


def test_graphs_compare_methods_held_the_same_way():
    """With graphs the baseline is the full cache held as the methods are;
    a method whose prompts cannot decode together is skipped, saying why
    (on the CPU the steps run eagerly: no graph, the same inputs)."""
    result = benchmarks.run("generate", dict(generate.Generate.smoke_sizes(), methods="vlcache,zipvl", graphs=True,
                                             batches=[2]))
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == [generate.GRAPHED_BASELINE, "vlcache", "zipvl"]
    assert rows[generate.GRAPHED_BASELINE]["cache_share"] == 1.0 and 0 < rows["vlcache"]["cache_share"] < 0.25
    assert rows["vlcache"]["decode_speedup"] > 0
    assert "decodes together at every step" in rows["zipvl"]["skipped"] and rows["zipvl"]["decode_step_ms"] is None


def test_graphs_refuse_what_they_cannot_replay():
    from kernels_py.methods import make_method
    from kernels_py.models import ModelError, generate_batch

    vlm = sized.build("tiny-llava", 256, device=torch.device("cpu"), dtype=torch.float32)
    inputs = sized.prompt(vlm, 2, 64, 6, torch.Generator().manual_seed(4))
    with pytest.raises(ModelError, match="decodes together at every step"):
        generate_batch(vlm, make_method("vlcache"), inputs, 3, graphs=True)  # float32 attention, prompt by prompt
    language = vlm.model.model.language_model
    before = language.config._attn_implementation
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    inputs["attention_mask"][0, 0] = 0
    with pytest.raises(ModelError, match="no padding"):
        generate_batch(vlm, make_method("vlcache", {"attention": "sdpa"}), inputs, 3, graphs=True)
    assert language.config._attn_implementation == before != "vlkv"  # a refusal leaves the model as it was


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_graphed_steps_decode_as_eager_ones(name, device):
    """The static inputs a captured step reads (the fed tokens, positions
    from the prompt's length and M-RoPE's offsets) give what the eager loop
    gives; on a GPU the steps from the third on are a CUDA graph's replays."""
    from kernels_py.methods import make_method
    from kernels_py.models import generate_batch

    vlm = sized.build(name, 256, device=device, dtype=torch.float32)
    inputs = sized.prompt(vlm, 2, 64, 8, torch.Generator().manual_seed(3))
    method = make_method("vlcache", {"attention": "sdpa", "budget": 0.3})
    eagers, graphs = generate_batch(vlm, method, inputs, 7), generate_batch(vlm, method, inputs, 7, graphs=True)
    assert len(eagers) == len(graphs) == 2
    for eager, graphed in zip(eagers, graphs):
        assert eager.tokens == graphed.tokens and eager.cache_bytes == graphed.cache_bytes
        torch.testing.assert_close(eager.logits, graphed.logits, atol=1e-5, rtol=1e-5)
        assert graphed.replayed_steps == (3 if device.type == "cuda" else 0)


def test_qwen2_vl_runs_every_default_method():
    """M-RoPE: AttentionPack runs with rope="after" (its default would be
    refused), ZipVL with its sparse prefill but not its measurement; each row has its figures."""
    sizes = dict(generate.Generate.smoke_sizes(), model="tiny-qwen2-vl", batches=[1])
    rows = benchmarks.run("generate", sizes)["rows"]
    assert [r["method"] for r in rows] == [generate.BASELINE, "vlcache", "zipvl", "attentionpack"]
    assert all(r["decode_step_ms"] > 0 and r["cache_bytes"] > 0 and "skipped" not in r for r in rows)
    bench = generate.Generate.from_dict(sizes)
    assert bench._method("attentionpack", True).rope == "after"
    zipvl = bench._method("zipvl", False)
    assert zipvl.sparse_prefill is True and zipvl.sparse_prefill_metrics is False
    assert bench._method("vlcache", False).attention == "sdpa" and bench._method("vlcache", False).budget == 0.1


@pytest.mark.parametrize("kwargs,match", [
    ({"methods": "vlcache,zipv"}, "unknown method 'zipv'"),
    ({"methods": "kvpres"}, r"unknown method 'kvpres'; known here: (?!.*kvpress)"),  # no press is offered
    ({"methods": "VL Cache"}, "methods"),
    ({"model": "llava-13b"}, "model"),
    ({"new_tokens": 1}, "new_tokens"),
    ({"graphs": True, "new_tokens": 3}, r"new_tokens \(3\) must be at least 4"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        benchmarks.run("generate", dict(generate.Generate.smoke_sizes(), **kwargs))


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_the_baseline_is_the_full_cache(name):
    """transformers' own cache and attention (the baseline) and the full
    cache through the method adapter choose the same tokens from the same
    distributions (M-RoPE positions included)."""
    from kernels_py.methods import make_method
    from kernels_py.models import generate_batch, generate_sdpa

    vlm = sized.build(name, 512, device=torch.device("cpu"), dtype=torch.float32)
    inputs = sized.prompt(vlm, 2, 64, 6, torch.Generator().manual_seed(1))
    base = generate_sdpa(vlm, inputs, 5)
    ours = generate_batch(vlm, make_method("full"), inputs, 5)
    assert len(base) == len(ours) == 2
    for a, b in zip(base, ours):
        assert a.tokens == b.tokens and a.cache_bytes == b.cache_bytes
        torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=1e-4)


def test_generations_keep_attention_off_cudnn(monkeypatch):
    """Every SDPA call of a generation (the baseline's, and a method's decode
    over its kept tokens) runs with cuDNN's attention off and FlashAttention
    on: cuDNN's builds a plan for every new key length, which made each
    method's decode step several times the baseline's on Hopper GPUs."""
    import torch.nn.functional as F

    from kernels_py.methods import make_method
    from kernels_py.models import generate_batch, generate_sdpa

    seen = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()))
        return real(*args, **kwargs)

    vlm = sized.build("tiny-llava", 256, device=torch.device("cpu"), dtype=torch.float32)
    inputs = sized.prompt(vlm, 1, 64, 4, torch.Generator().manual_seed(2))
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    generate_sdpa(vlm, inputs, 3)
    baseline = len(seen)
    generate_batch(vlm, make_method("vlcache", {"attention": "sdpa"}), inputs, 3)
    assert baseline > 0 and len(seen) > baseline  # both generations attended through SDPA
    assert all(flash and not cudnn for cudnn, flash in seen), seen
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored afterwards


def test_profile_steps_count_what_a_decode_step_asks_of_the_host():
    """With profile_steps each row says what one decode step runs on the
    host (the difference of two profiled runs, so the prefill cancels); on
    the CPU no kernel is launched and nothing waits for a GPU, and the GPU
    columns stay out of the table; on a GPU a step launches kernels and
    the GPU columns follow. Without it, no profile column at all."""
    sizes = dict(generate.Generate.smoke_sizes(), methods="vlcache", batches=[1])
    plain = benchmarks.run("generate", sizes)
    assert not {c["name"] for c in plain["columns"]} & {c.name for c in generate.Generate.optional_columns}
    result = benchmarks.run("generate", dict(sizes, profile_steps=2))
    names = [c["name"] for c in result["columns"]]
    on_gpu = runtime.device().type == "cuda"
    profiled = ["step_ops", "step_launches", "step_syncs", "step_attention"]
    profiled += ["step_gpu_ms", "gpu_busy", "gpu_step_speedup"] if on_gpu else []
    assert names[-len(profiled):] == profiled
    for r in result["rows"]:
        # A step of a 2-layer model runs dozens of ops: the layers' projections, norms, attention, the head.
        assert r["step_ops"] > 20 and r["step_ops"] == int(r["step_ops"])
        if on_gpu:
            assert r["step_launches"] > 0 and r["step_gpu_ms"] > 0 and r["gpu_busy"] > 0
        else:
            assert r["step_launches"] == 0 and r["step_syncs"] == 0
    # The baseline's decode attends through SDPA, and the row names the backend that ran.
    base = next(r for r in result["rows"] if r["method"] == generate.BASELINE)
    assert set(base["step_attention"].split(", ")) <= set(generate._SDPA_OPS.values())
    if not on_gpu:
        assert base["step_attention"] == "flash (cpu)"
    described = {c["name"] for c in generate.Generate.describe()["columns"]}
    assert {"step_gpu_ms", "gpu_busy", "step_attention"} <= described  # --help lists them


def test_sdpa_calls_name_the_backends_a_profile_ran():
    """SDPA's backend ops counted by their short names; the public op that
    dispatches to them and other ops are not."""
    from types import SimpleNamespace

    names = ["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention",
             "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
             "aten::_scaled_dot_product_attention_math", "aten::mm"]
    calls = generate.sdpa_calls([SimpleNamespace(name=n) for n in names])
    assert calls == {"flash": 2, "efficient": 1, "math": 1}


def test_tally_counts_launches_waits_and_gpu_time():
    """The host's runtime calls that launch a kernel or wait for the GPU,
    PyTorch ops, and the device events' time, as a GPU profile has them."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, device=DeviceType.CPU, us=0.0):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = [event("aten::mm"), event("aten::cat"), event("cudaLaunchKernel"), event("cuLaunchKernelEx"),
              event("cudaStreamSynchronize"), event("cudaMemcpyAsync"), event("ampere_gemm", DeviceType.CUDA, 12.5),
              event("Memcpy DtoH", DeviceType.CUDA, 2.0), event("python function")]
    assert generate.tally(events) == {"ops": 2, "launches": 2, "syncs": 1, "gpu_us": 14.5}


def test_a_press_is_refused_before_any_row(monkeypatch):
    """kvpress runs as a press on transformers' own cache, not through the
    adapter this benchmark times: refused as a usage error up front, rather
    than failing the whole run at its first row."""
    from kernels_py.params import BadKnobs

    measured = []
    monkeypatch.setattr(generate.Generate, "measure", lambda self, case: measured.append(case) or {})
    with pytest.raises(BadKnobs, match="'kvpress' compresses transformers' own cache as a press"):
        benchmarks.run("generate", dict(generate.Generate.smoke_sizes(), methods="vlcache,kvpress"))
    assert measured == []


def test_weights_that_cannot_fit_are_refused_before_the_build(monkeypatch):
    """A full-size model whose weights exceed the device's free memory (a 7B
    model on a small CPU machine) is a usage error naming the bytes, before
    any weight is made; the tiny models pass."""
    from kernels_py.params import BadKnobs

    assert generate.weights_bytes("llava-1.5-7b", torch.float16) == 7_063_427_072 * 2
    assert generate.weights_bytes("qwen2-vl-7b", torch.float32) == 8_291_375_616 * 4
    monkeypatch.setattr(generate, "available_bytes", lambda device: 2e9)
    built, real = [], sized.build
    monkeypatch.setattr(sized, "build", lambda name, *a, device, **k: built.append((name, device.type)) or
                        real(name, *a, device=device, **k))
    sizes = dict(generate.Generate.smoke_sizes(), model="llava-1.5-7b", dtype="float16", methods="vlcache")
    with pytest.raises(BadKnobs, match=r"--model llava-1.5-7b: its weights take 14.1 GB in float16, more than the "
                                       r"2.0 GB free"):
        benchmarks.run("generate", sizes)
    assert all(device == "meta" for _, device in built)
    rows = benchmarks.run("generate", dict(generate.Generate.smoke_sizes(), methods="vlcache", batches=[1]))["rows"]
    assert len(rows) == 2 and all("skipped" not in r for r in rows)


def test_graphs_without_cuda_say_the_steps_ran_eagerly():
    """--graphs on the CPU captures nothing: the run says so, and a run on a
    GPU does not."""
    result = benchmarks.run("generate", dict(generate.Generate.smoke_sizes(), methods="vlcache", graphs=True,
                                             batches=[1]))
    said = [n for n in result["notes"] if n.startswith("--graphs without CUDA")]
    assert len(said) == (0 if runtime.device().type == "cuda" else 1)
    plain = benchmarks.run("generate", dict(generate.Generate.smoke_sizes(), methods="vlcache", batches=[1]))
    assert not any(n.startswith("--graphs") for n in plain["notes"])


def test_float32_on_cuda_says_the_baseline_is_not_flash_attention(monkeypatch):
    """FlashAttention takes 16-bit inputs: a float32 run on a GPU says its
    baseline ran another SDPA kernel; a 16-bit one, or any on the CPU, does not."""
    def notes(device, dtype):
        monkeypatch.setattr(generate.runtime, "device", lambda: torch.device(device))
        return [n for n in generate.Generate(dtype=dtype).run_notes() if n.startswith("--dtype")]

    assert len(notes("cuda", "float32")) == 1 and "not FlashAttention" in notes("cuda", "float32")[0]
    assert notes("cuda", "float16") == [] and notes("cuda", "bfloat16") == [] and notes("cpu", "float32") == []


def test_zipvl_times_its_sparse_prefill_without_measuring_it(monkeypatch):
    """The prefill bench generate times is ZipVL's own, sparse (the paper's
    prefill speedup), and no layer runs the two float32 attentions that only
    report its error."""
    from kernels_py.methods import mixed_precision

    calls = {"sparse_prefill": 0, "prefill_error": 0}
    for name in calls:
        def counted(*args, _name=name, _real=getattr(mixed_precision, name), **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(mixed_precision, name, counted)
    sizes = dict(generate.Generate.smoke_sizes(), methods="zipvl", batches=[1])
    rows = benchmarks.run("generate", sizes)["rows"]
    assert [r["method"] for r in rows] == [generate.BASELINE, "zipvl"] and rows[1]["prefill_s"] > 0
    layers = generate.Generate.from_dict(sizes)._vlm().model.config.text_config.num_hidden_layers
    assert calls["sparse_prefill"] >= 2 * layers  # the untimed run and the timed one, every layer
    assert calls["prefill_error"] == 0

