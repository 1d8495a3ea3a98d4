"""kvpress presses as a method: inside tiny random VLMs of every supported
family, the no-press baseline equals our full cache, presses run end to end
through the ablation with the same metrics as our methods, bad names and
parameters and incompatible presses get clear errors, and the README's table
of which press runs on which family is what this test measures.

`python -m kernels_py.tests.test_kvpress` prints that table."""

import re
from pathlib import Path

import pytest

pytest.importorskip("kvpress")

from kernels_py import ablation, metrics, models  # noqa: E402
from kernels_py.methods import make_method  # noqa: E402
from kernels_py.models import presses  # noqa: E402
from kernels_py.tests.tiny_vlm import QWEN_PROMPT, save_image, save_tiny_llava, save_tiny_qwen2_vl  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"
LLAVA_PROMPT = "USER : <image> describe the picture ASSISTANT :"
# Long enough for the presses' observation windows (64 tokens) on every family.
LONG = " what is in the picture a red cat or a blue dog ?" * 6
FAMILIES = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl")


def save_family(root: Path, family: str):
    """(model directory, image, prompt) of a tiny model of the family."""
    path = root / family
    if family.startswith("qwen"):
        save_tiny_qwen2_vl(path, version="2" if family == "qwen2_vl" else "2.5")
        return path, save_image(root / f"{family}.png", size=112), QWEN_PROMPT.replace(" ASSISTANT", LONG + " ASSISTANT")
    save_tiny_llava(path, next=family == "llava_next")
    return path, save_image(root / f"{family}.png"), LLAVA_PROMPT.replace(" ASSISTANT", LONG + " ASSISTANT")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvpress")
    return {family: save_family(root, family) for family in FAMILIES}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Presses that fetch checkpoints from the Hub fail at once here, rather than retrying."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_the_no_press_baseline_is_our_full_cache(tiny, family):
    path, image, prompt = tiny[family]
    vlm = models.load(path)
    inputs = models.prompt_inputs(vlm, [image], prompt)
    ours = models.generate(vlm, make_method("full"), inputs, 6)
    baseline = presses.generate(vlm, None, inputs, 6)
    assert baseline.tokens == ours.tokens and baseline.cache_bytes == ours.cache_bytes
    assert make_method("kvpress", {"press": "none"}).make_press() is None


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_decode_positions_survive_the_compression(tiny, family):
    """After a press shrinks the cache, each generated token keeps its real
    RoPE position (the prompt's length plus its step; on M-RoPE the text
    position plus the rope delta), not one taken from the shorter cache."""
    path, image, prompt = tiny[family]
    vlm = models.load(path)
    inputs = models.prompt_inputs(vlm, [image], prompt)
    rotary = vlm.model.model.language_model.rotary_emb

    def positions_with(press):
        seen = []
        handle = rotary.register_forward_hook(lambda m, args, kwargs, out: seen.append(
            (kwargs.get("position_ids") if "position_ids" in kwargs else args[1]).clone()), with_kwargs=True)
        try:
            presses.generate(vlm, press, inputs, 4)
        finally:
            handle.remove()
        return [p.tolist() for p in seen[1:]]  # the decode steps

    plain = positions_with(None)
    assert positions_with(presses.make("SnapKVPress", 0.5, {"window_size": 8})) == plain
    if family == "llava":
        assert [p[0][0] for p in plain] == [inputs["input_ids"].shape[1] + i for i in range(3)]


@pytest.mark.parametrize("press", ["SnapKVPress", "TOVAPress", "KnormPress", "StreamingLLMPress",
                                   "ExpectedAttentionPress", "PyramidKVPress"])
def test_presses_run_end_to_end_with_our_metrics(tiny, press):
    path, image, prompt = tiny["llava"]
    workload = {"model": str(path), "images": str(image), "prompt": prompt, "decode_steps": 4}
    report = ablation.run("kvpress", {"press": press, "compression_ratio": 0.5}, workload, "vlm")
    m = report["metrics"]
    assert m["kvpress_version"] == presses.version() and m["kvpress_ratio_applied"] == 1.0
    assert m["model_cache_bytes"] < m["full_cache_bytes"] and m["compression_ratio"] > 1.5
    assert 0 <= m["token_agreement"] <= 1 and m["kl_mean"] >= 0 and m["prefill_seconds"] > 0
    assert len(report["per_step"]["tokens"]) == 5
    # SnapKV and StreamingLLM have our method beside them, matched by construction: the same kept tokens.
    if press in presses.MATCHED:
        assert m["pair_jaccard_mean"] == m["pair_jaccard_min"] == 1.0 and m["pair_token_agreement"] == 1.0
        assert report["extra"]["pair_method"] == {"SnapKVPress": "snapkv"}.get(press, "streamingllm")
        assert len(report["per_layer"]["pair_jaccard"]) == 2  # layers of the tiny model, each per kv head
    else:
        assert report["per_layer"] == {} and "pair_jaccard_mean" not in m and report["extra"] == {}


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
# Windows below the press's kept count: with fewer kept than its window, SnapKVPress picks among the window's
# tied scores in torch.topk's order, where snapkv keeps the latest.
@pytest.mark.parametrize("press, args, ratio", [("SnapKVPress", {"window_size": 32}, 0.5),
                                                ("SnapKVPress", {"window_size": 16}, 0.75),
                                                ("StreamingLLMPress", {}, 0.5), ("StreamingLLMPress", {"n_sink": 2}, 0.7)])
def test_our_methods_keep_what_their_presses_keep(tiny, family, press, args, ratio):
    """At matched settings (presses.matched: window, pooling kernel, sinks,
    kvpress's rounding, no eviction while decoding) our snapkv and
    streamingllm keep the very tokens SnapKVPress and StreamingLLMPress keep,
    on every layer and kv head, and generate the same tokens."""
    path, image, prompt = tiny[family]
    vlm = models.load(path)
    inputs = models.prompt_inputs(vlm, [image], prompt)
    made = presses.make(press, ratio, args)
    name, params = presses.matched(made)
    assert params["evict_while_decoding"] is False and params["budget"] == 1 - ratio
    theirs = presses.generate(vlm, made, inputs, 6)
    ours = models.generate(vlm, make_method(name, params), inputs, 6)
    prompt_tokens = inputs["input_ids"].shape[1]
    assert theirs.kept[0].shape[1] == int(prompt_tokens * (1 - ratio)) < prompt_tokens
    assert metrics.kept_jaccard(theirs.kept, ours.kept) == [[1.0] * len(layer) for layer in ours.kept]
    assert theirs.tokens == ours.tokens and theirs.cache_bytes == ours.cache_bytes
    # Left at its own defaults (window 32, not the press's 16), snapkv keeps other tokens.
    if press == "SnapKVPress" and args["window_size"] == 16:
        own = models.generate(vlm, make_method("snapkv", {"budget": 1 - ratio, "evict_while_decoding": False}),
                              inputs, 6)
        assert min(x for layer in metrics.kept_jaccard(theirs.kept, own.kept) for x in layer) < 1.0


def test_a_pair_outside_our_methods_settings_is_reported_not_failed(tiny):
    """A press whose settings our method does not take (a pooling kernel
    above snapkv's 31) still runs, its row saying why it has no pair; a press that
    compresses nothing has no pair to compare."""
    path, image, prompt = tiny["llava"]
    workload = {"model": str(path), "images": str(image), "prompt": prompt, "decode_steps": 2}
    report = ablation.run("kvpress", {"press": "SnapKVPress", "press_args": "kernel_size=33"}, workload, "vlm")
    assert report["extra"]["pair_method"] == "snapkv" and "kernel_size" in report["extra"]["pair_unavailable"]
    assert "pair_jaccard_mean" not in report["metrics"] and report["metrics"]["compression_ratio"] > 1.5
    nothing = ablation.run("kvpress", {"press": "SnapKVPress", "compression_ratio": 0.0}, workload, "vlm")
    assert nothing["extra"] == {} and nothing["metrics"]["compression_ratio"] == 1.0


def test_press_parameters_pass_through_and_are_checked(tiny):
    method = make_method("kvpress", {"press": "SnapKVPress", "compression_ratio": 0.25,
                                     "press_args": "window_size=16,kernel_size=3"})
    press = method.make_press()
    assert (press.window_size, press.kernel_size, press.compression_ratio) == (16, 3, 0.25)
    wrapped = make_method("kvpress", {"press": "KeyRerotationPress", "inner_press": "KnormPress"}).make_press()
    assert type(wrapped.press).__name__ == "KnormPress" and wrapped.press.compression_ratio == 0.5
    with pytest.raises(presses.PressError, match=r"unknown press 'SnapKvPress' \(did you mean 'SnapKVPress'\?\)"):
        make_method("kvpress", {"press": "SnapKvPress"}).make_press()
    with pytest.raises(presses.PressError, match=r"SnapKVPress takes no parameter 'window'; it takes: "
                                                 r"compression_ratio, window_size, kernel_size"):
        make_method("kvpress", {"press_args": "window=3"}).make_press()
    assert presses.parse_args("compression_ratios=0.5;0.25,flag=true,name=x") == \
        {"compression_ratios": [0.5, 0.25], "flag": True, "name": "x"}
    assert presses.takes_ratio("SnapKVPress") and not presses.takes_ratio("ThinKPress")
    assert presses.takes_ratio("KeyRerotationPress", "KnormPress") and not presses.takes_ratio("none")
    with pytest.raises(presses.PressError, match="want name=value pairs"):
        make_method("kvpress", {"press_args": "window_size"}).make_press()
    with pytest.raises(presses.PressError, match="KeyRerotationPress wraps another press: name it with inner_press"):
        make_method("kvpress", {"press": "KeyRerotationPress"}).make_press()
    with pytest.raises(presses.PressError, match="SnapKVPress wraps no press"):
        make_method("kvpress", {"inner_press": "KnormPress"}).make_press()


@pytest.mark.parametrize("press, args, inner, match", [
    ("SnapKVPress", "compression_ratio=0.9", "",
     r"set compression_ratio with the kvpress method's compression_ratio knob \(compression_ratio=0.9\), not in"),
    ("LUKVPress", "compression_ratio=0.3", "SnapKVPress", r"set compression_ratio with the kvpress method's"),
    ("SnapKVPress", "window_size=32,window_size=64", "",
     r"press_args 'window_size=32,window_size=64' sets window_size twice: keep one"),
    ("AdaKVPress", "press=TOVAPress", "SnapKVPress",
     r"AdaKVPress's press is the press it wraps: name it with inner_press \(e.g. inner_press='SnapKVPress'\)"),
    ("KeyRerotationPress", "press=KnormPress", "", r"KeyRerotationPress's press is the press it wraps"),
    ("DecodingPress", "base_press=KnormPress", "SnapKVPress", r"DecodingPress's base_press is the press it wraps"),
    ("ComposedPress", "presses=KnormPress", "SnapKVPress", r"ComposedPress's presses are the presses it wraps: name them with inner_press"),
])
def test_press_args_may_not_replace_the_knobs(press, args, inner, match):
    """press_args that would silently override compression_ratio or the
    inner press (while the results record the knobs), or that set a name
    twice (the last would win), are refused, as `workbench plan` refuses
    them."""
    method = make_method("kvpress", {"press": press, "press_args": args, "inner_press": inner})
    with pytest.raises(presses.PressError, match=match):
        method.make_press()


def test_the_schema_says_what_make_refuses():
    """schema.json's presses are what `workbench plan` checks press,
    press_args and inner_press against: for every press, a job that sets
    nothing fails in make() exactly when the schema says something is
    missing (the press it wraps, or a parameter without a default)."""
    from kernels_py import schema

    published = schema.document()["methods"]["kvpress"]["presses"]
    assert published == presses.schema() and set(published) == set(presses.press_classes())
    assert published["SnapKVPress"] == {"params": ["compression_ratio", "window_size", "kernel_size"],
                                        "required": [], "wraps": "",
                                        "types": {"compression_ratio": "float", "window_size": "int",
                                                  "kernel_size": "int"}, "nullable": []}
    # Only the types plan can check a value against: lists of one, Optional; not presses or Literals.
    assert published["PerLayerCompressionPress"]["types"] == {"compression_ratios": "floats"}
    assert (published["RandomPress"]["types"], published["RandomPress"]["nullable"]) == \
        ({"compression_ratio": "float", "seed": "int"}, ["seed"])
    assert published["FinchPress"]["nullable"] == ["chunk_length"]  # int, None by default
    assert "model_type" not in published["KVzapPress"]["types"] and published["ComposedPress"]["types"] == {}
    for name, entry in published.items():
        missing = [r for r in entry["required"] if r != "compression_ratio"]
        try:
            presses.make(name, 0.5, {})
            refused = ""
        except presses.PressError as err:
            refused = str(err)
        if entry["wraps"] in missing:
            assert "wraps another press" in refused, name
        elif missing:
            assert f"needs {', '.join(missing)}" in refused, name
        else:
            assert "wraps another press" not in refused and " needs " not in refused, (name, refused)


def test_an_incompatible_press_and_a_workload_without_a_model(tiny):
    path, image, prompt = tiny["llava"]
    workload = {"model": str(path), "images": str(image), "prompt": prompt, "decode_steps": 2}
    with pytest.raises(presses.PressError, match=r"ObservedAttentionPress cannot run on llava \(AssertionError: "
                                                 r"Set attn_implementation=\"eager\""):
        ablation.run("kvpress", {"press": "ObservedAttentionPress"}, workload, "vlm")
    with pytest.raises(ValueError, match=r"method 'kvpress' runs inside a model: give it workload\(\"vlm\""):
        ablation.run("kvpress", {}, {}, "synthetic")


# --- which press runs on which family -------------------------------------------------------------

def outcome(vlm, inputs, name: str, baseline_bytes: int) -> tuple[str, str]:
    """("evicts" | "frees nothing" | "fails", reason) of one press on one model: evicts when the cache it
    leaves holds fewer bytes than the no-press cache; frees nothing when it runs but every tensor keeps its
    size (entries masked or zeroed, or compression only past this short generation)."""
    wrapping = presses._wrapping(presses.press_classes()[name])
    inner = "SnapKVPress,KnormPress" if wrapping == "presses" else "SnapKVPress" if wrapping else ""
    try:
        got = presses.generate(vlm, presses.make(name, 0.5, {}, inner), inputs, 3)
    except Exception as err:  # noqa: BLE001 - the outcome is what is measured
        return "fails", " ".join(str(err).split())
    return ("evicts" if got.cache_bytes < baseline_bytes else "frees nothing"), ""


def measure(tiny) -> dict[str, dict[str, tuple[str, str]]]:
    table = {name: {} for name in presses.press_classes()}
    for family in FAMILIES:
        path, image, prompt = tiny[family]
        vlm = models.load(path)
        inputs = models.prompt_inputs(vlm, [image], prompt)
        baseline = presses.generate(vlm, None, inputs, 3).cache_bytes
        for name in table:
            table[name][family] = outcome(vlm, inputs, name, baseline)
    return table


def markdown(table) -> str:
    lines = ["| press | " + " | ".join(FAMILIES) + " | why it fails |", "| --- |" + " --- |" * (len(FAMILIES) + 1)]
    for name, row in table.items():
        reasons = sorted({why for _, why in row.values() if why})
        why = re.sub(r"^\w+ cannot run on \w+ ", "", reasons[0]) if reasons else ""
        why = re.sub(r"'?/tmp/[^' ]*'?", "<model dir>", why)[:140].strip("() ")
        lines.append(f"| {name} | " + " | ".join(row[f][0] for f in FAMILIES) + f" | {why.replace('|', '/')} |")
    return "\n".join(lines)


def readme_table() -> dict[str, list[str]]:
    text = README.read_text()
    block = text.split("<!-- kvpress-support:start -->")[1].split("<!-- kvpress-support:end -->")[0]
    rows = {}
    for line in block.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:1 + len(FAMILIES)]
    return rows


def test_the_readme_says_which_press_runs_on_which_family(tiny):
    table = measure(tiny)
    measured = {name: [row[f][0] for f in FAMILIES] for name, row in table.items()}
    assert sum(cells.count("evicts") >= 1 for cells in measured.values()) >= 5
    assert readme_table() == measured, "README's kvpress table differs from what runs; replace it with:\n" + \
        markdown(table)


if __name__ == "__main__":
    import tempfile

    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True
    with tempfile.TemporaryDirectory() as tmp:
        print(markdown(measure({f: save_family(Path(tmp), f) for f in FAMILIES})))
