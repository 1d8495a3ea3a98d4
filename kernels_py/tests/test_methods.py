"""Methods: correct decode attention, real memory savings, budgets honoured,
parameters validated, and the schema the Go host reads in step with the code."""

import dataclasses
import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch

from kernels_py import metrics, schema
from kernels_py.benchmarks import BENCHMARKS
from kernels_py.methods import METHODS, make_method
from kernels_py.methods.base import PROTOCOLS
from kernels_py.methods.caches import KeptTokens, kept_count
from kernels_py.methods.prompt import Prompt
from kernels_py.workloads import WORKLOADS, SyntheticConfig, generate

SMALL = SyntheticConfig(layers=3, heads=4, kv_heads=2, head_dim=32, tokens_per_image=144, system_tokens=8,
                        text_tokens=24, decode_steps=6, salient_tokens=12, dense_layers=1, dtype="float32")
PROMPT = 8 + 144 + 24
COMPRESSING = ["h2o", "streamingllm", "snapkv"]
SCHEMA_FILE = Path(__file__).resolve().parents[1] / "schema.json"
TYPE_OF_ANNOTATION = {float: "float", int: "int", str: "str", bool: "bool", tuple: "ints"}


@pytest.fixture(scope="module")
def workload():
    return generate(SMALL)


def prefill(method, workload, layer):
    return method.prefill(layer, workload.q[layer], workload.k[layer], workload.v[layer], workload.spans)


def run(method, workload, layer=None):
    """Prefill and decode every step; returns (outputs [layer][step], caches)."""
    outputs, caches = [], []
    for l in range(workload.config.layers) if layer is None else [layer]:
        cache = prefill(method, workload, l)
        steps = zip(workload.decode_q[l], workload.decode_k[l], workload.decode_v[l])
        outputs.append([method.decode(l, cache, q_t, k_t, v_t) for q_t, k_t, v_t in steps])
        caches.append(cache)
    return outputs, caches


def mean_error(outputs, reference):
    return sum(
        metrics.relative_error(o, r) for layer, ref in zip(outputs, reference) for o, r in zip(layer, ref)
    ) / sum(len(layer) for layer in outputs)


@pytest.fixture(scope="module")
def full_outputs(workload):
    return run(make_method("full"), workload)[0]


def test_registry_names_match_classes():
    assert set(METHODS) == {"full", "h2o", "streamingllm", "snapkv", "vlcache", "zipvl", "zipvl_evict", "zipvl_fixed",
                            "kivi", "attentionpack", "avl", "lookm", "pyramidkv", "fastv", "kvpress", "fp8"}
    for name, cls in METHODS.items():
        assert cls.name == name and make_method(name).name == name


def test_full_matches_causal_attention_over_prompt_and_generated_tokens(workload, full_outputs):
    """The decode path itself is right: each step equals softmax attention over
    every token up to and including the new one."""
    for layer in range(workload.config.layers):
        keys, values = workload.k[layer], workload.v[layer]
        for step in range(workload.config.decode_steps):
            keys = torch.cat([keys, workload.decode_k[layer][step]], dim=1)
            values = torch.cat([values, workload.decode_v[layer][step]], dim=1)
            weights = metrics.causal_attention(workload.decode_q[layer][step], keys)
            expected = weights @ values.float().repeat_interleave(2, dim=0)
            torch.testing.assert_close(full_outputs[layer][step], expected, atol=1e-5, rtol=1e-5)


# A kvpress press runs only inside a model (tests: test_kvpress.py); the rest run on replayed Q/K/V.
REPLAYED = sorted(name for name, cls in METHODS.items() if not getattr(cls, "in_model_only", False))


@pytest.mark.parametrize("name", REPLAYED)
def test_output_shape_and_dtype(name, workload):
    outputs, _ = run(make_method(name), workload, layer=0)
    for output in outputs[0]:
        assert output.shape == (4, 1, 32) and output.dtype == torch.float32


@pytest.mark.parametrize("name", REPLAYED)
def test_a_prompt_of_another_shape_is_refused_naming_the_layer(name, workload):
    """Every method's prefill takes one sequence's [heads, T, d] per layer
    and spans of T tokens: a model's batched [1, heads, T, d], spans of
    another length or a single tensor instead of a list are refused as such
    (they failed deep inside a scorer, or ran on spans past the prompt)."""
    method = make_method(name)
    q, k, v, spans = workload.q, workload.k, workload.v, workload.spans
    batched = r"layer 0: q must be \[heads, T, d\].*a model's \[batch, heads, T, d\] is q\[b\]"
    with pytest.raises(ValueError, match=batched):
        method.prefill_all([x[None] for x in q], [x[None] for x in k], [x[None] for x in v], spans)
    longer = dataclasses.replace(spans, text=(spans.text[0], PROMPT + 10))
    with pytest.raises(ValueError, match=f"the prompt has {PROMPT} tokens but the spans describe {PROMPT + 10}"):
        method.prefill_all(q, k, v, longer)
    with pytest.raises(ValueError, match="layer 1: q and k disagree on tokens"):
        method.prefill_all(q, [k[0], k[1][:, :-1], k[2]], [v[0], v[1][:, :-1], v[2]], spans)
    with pytest.raises(ValueError, match=r"one tensor per layer: pass lists"):
        method.prefill_all(q[0], k[0], v[0], spans)


@pytest.mark.parametrize("name", REPLAYED)
def test_a_step_of_other_than_one_token_is_refused(name, workload):
    """decode takes one token a step, [heads, 1, d] and [kv_heads, 1, d]: two
    tokens were appended at one position, each seeing the other, without
    an error; a batched or squeezed step failed inside torch.cat."""
    method = make_method(name)
    cache = prefill(method, workload, 0)
    q_t, k_t, v_t = workload.decode_q[0][0], workload.decode_k[0][0], workload.decode_v[0][0]
    two = [torch.cat([x, x], dim=1) for x in (q_t, k_t, v_t)]
    for step in (two, [q_t[None], k_t[None], v_t[None]], [q_t[:, 0], k_t[:, 0], v_t[:, 0]]):
        with pytest.raises(ValueError, match=r"layer 0: expected q_t \[heads, 1, 32\] with heads a multiple of 2 and "
                                             r"k_t, v_t \[2, 1, 32\] \(one token a step\)"):
            method.decode(0, cache, *step)
    assert method.decode(0, cache, q_t, k_t, v_t).shape == (4, 1, 32)  # the refusals left the cache as it was


@pytest.mark.parametrize("name", COMPRESSING)
def test_budget_one_equals_full(name, workload, full_outputs):
    outputs, caches = run(make_method(name, {"budget": 1.0}), workload)
    assert mean_error(outputs, full_outputs) == 0.0
    assert all(cache.tokens == PROMPT + SMALL.decode_steps for cache in caches)


@pytest.mark.parametrize("name", COMPRESSING)
def test_error_falls_as_budget_grows(name, workload, full_outputs):
    errors = [mean_error(run(make_method(name, {"budget": b}), workload)[0], full_outputs) for b in (0.25, 0.5, 0.8)]
    assert errors[0] > errors[1] > errors[2] > 0.0


@pytest.mark.parametrize("name", COMPRESSING)
def test_cache_really_shrinks_and_holds_the_original_tokens(name, workload):
    sizes = []
    for budget in (0.25, 0.5):
        method = make_method(name, {"budget": budget})
        cache = prefill(method, workload, 0)
        assert cache.keys.shape == cache.values.shape == (2, kept_count(budget, PROMPT), 32)
        assert method.cache_bytes(cache) == cache.keys.nbytes + cache.values.nbytes
        sizes.append(method.cache_bytes(cache))
        # Gathered, not masked: each held row is the token's own K/V, in position order.
        for head in range(2):
            positions = cache.positions[head]
            assert torch.all(positions[1:] > positions[:-1])
            assert torch.equal(cache.keys[head], workload.k[0][head, positions])
            assert torch.equal(cache.values[head], workload.v[0][head, positions])
    assert sizes[0] < sizes[1] < metrics.tensor_bytes(workload.k[0], workload.v[0])


@pytest.mark.parametrize("name", COMPRESSING)
def test_budget_holds_while_decoding(name, workload):
    budget = 0.3
    _, caches = run(make_method(name, {"budget": budget}), workload)
    seen = PROMPT + SMALL.decode_steps
    # h2o and streamingllm evict to the ratio; snapkv compresses the prompt once and keeps every generated token.
    expected = kept_count(budget, PROMPT) + SMALL.decode_steps if name == "snapkv" else kept_count(budget, seen)
    for cache in caches:
        assert cache.tokens == expected and cache.seen == seen
        assert cache.positions[:, -1].tolist() == [seen - 1] * 2  # the newest token is always held


@pytest.mark.parametrize("name", ["h2o", "streamingllm", "snapkv", "pyramidkv", "vlcache", "zipvl_evict"])
@pytest.mark.parametrize("evict", [False, True])
def test_eviction_while_decoding_is_a_knob(name, evict, workload):
    """Evicting, every layer holds its prefill share of the tokens seen after
    each step; not evicting, the prompt's kept tokens plus every generated one."""
    method = make_method(name, {"evict_while_decoding": evict})
    first = [prefill(method, workload, layer).tokens for layer in range(SMALL.layers)]
    _, caches = run(method, workload)
    seen = PROMPT + SMALL.decode_steps
    for layer, (kept, cache) in enumerate(zip(first, caches)):
        alone = Prompt([workload.q[layer]], [workload.k[layer]], [workload.v[layer]], workload.spans)  # as run() does
        share = method.allocator().prefill(alone)[0].share
        assert cache.seen == seen and cache.positions[:, -1].tolist() == [seen - 1] * 2
        assert cache.tokens == (kept_count(share, seen) if evict else kept + SMALL.decode_steps)


def test_vlcache_protocol_keeps_matched_budgets_matched(workload):
    """Under VL-Cache's protocol the token-keeping baselines (and LOOK-M with
    alpha_1 + alpha_2 = the budget) at one nominal budget hold the same bytes
    after the last step (within 10%; PyramidKV and VL-Cache spread it over
    layers), where their own defaults drift apart as the prefill-only ones
    keep every generated token."""
    def held(name, protocol, budget=None):
        knobs = METHODS[name].protocol_knobs(protocol)
        _, caches = run(make_method(name, {**(budget or {"budget": 0.1}), **knobs}), workload)
        return sum(cache.nbytes for cache in caches)

    names = ["h2o", "snapkv", "streamingllm", "pyramidkv", "vlcache"]
    matched = [held(name, "vlcache") for name in names]
    matched.append(held("lookm", "vlcache", {"recent_ratio": 0.01, "important_ratio": 0.09}))  # as methods_compare
    assert max(matched) <= 1.1 * min(matched)
    assert METHODS["h2o"].protocol_knobs("vlcache") == {"evict_while_decoding": True, "recent_fraction": 0.1}
    assert METHODS["snapkv"].protocol_knobs("paper") == {}
    own = {name: held(name, "paper") for name in ("h2o", "snapkv")}
    assert own["snapkv"] > own["h2o"]  # snapkv keeps the 6 generated tokens on top of its 10%


def test_a_method_naming_no_protocol_is_refused_by_the_schema():
    """A misspelt protocol in a method's `protocols` would set nothing under
    any protocol, and the schema would list it as setting nothing: it is
    refused, naming the closest protocol."""
    @dataclasses.dataclass(frozen=True)
    class Misspelt(METHODS["h2o"]):
        protocols = {"vlcach": {"recent_fraction": 0.2}}

    with pytest.raises(ValueError, match=r"Misspelt.protocols names 'vlcach', which is not a protocol \(did you "
                                         r"mean 'vlcache'\?\); known: paper, vlcache"):
        schema._protocols(Misspelt, PROTOCOLS)


def test_half_precision_cache_costs_half(workload):
    half = generate(dataclasses.replace(SMALL, dtype="float16"))
    method = make_method("h2o", {"budget": 0.5})
    half_cache = prefill(method, half, 0)
    assert method.cache_bytes(half_cache) * 2 == method.cache_bytes(prefill(method, workload, 0))
    output = method.decode(0, half_cache, half.decode_q[0][0], half.decode_k[0][0], half.decode_v[0][0])
    assert output.dtype == torch.float16


def test_streamingllm_keeps_sinks_and_the_latest_tokens(workload):
    method = make_method("streamingllm", {"budget": 0.25, "sink_tokens": 4})
    cache = prefill(method, workload, 0)
    window = kept_count(0.25, PROMPT) - 4
    expected = list(range(4)) + list(range(PROMPT - window, PROMPT))
    assert cache.positions.tolist() == [expected, expected]


def test_h2o_keeps_heavy_hitters_and_a_recent_window(workload):
    method = make_method("h2o", {"budget": 0.1, "recent_fraction": 0.5})
    recent = math.floor(0.5 * kept_count(0.1, PROMPT) + 0.5)
    _, caches = run(method, workload)
    seen = PROMPT + SMALL.decode_steps
    for layer, cache in enumerate(caches):
        for head in range(2):
            held = set(cache.positions[head].tolist())
            assert set(range(seen - recent, seen)) <= held
            if layer >= SMALL.dense_layers:
                assert set(workload.sinks) <= held  # built to be heavy hitters


def window_votes(workload, layer, window):
    """[kv_heads, prefix] attention of the last `window` prompt queries on the
    earlier tokens, summed over the window and over each kv head's query heads."""
    attention = metrics.causal_attention(workload.q[layer][:, -window:], workload.k[layer])
    return attention[..., : PROMPT - window].sum(dim=1).reshape(2, 2, -1).sum(dim=1)


def test_snapkv_keeps_the_window_and_the_tokens_it_votes_for(workload):
    method = make_method("snapkv", {"budget": 0.25, "window": 16, "kernel_size": 1})
    voted = kept_count(0.25, PROMPT) - 16
    for layer in range(SMALL.layers):
        cache = prefill(method, workload, layer)
        votes = window_votes(workload, layer, 16)
        for head in range(2):
            expected = set(votes[head].topk(voted).indices.tolist()) | set(range(PROMPT - 16, PROMPT))
            assert set(cache.positions[head].tolist()) == expected


def test_snapkv_max_pooling_keeps_the_neighbours_of_a_voted_token(workload):
    method = make_method("snapkv", {"budget": 0.25, "window": 16, "kernel_size": 5, "pooling": "max"})
    cache = prefill(method, workload, 2)
    votes = window_votes(workload, 2, 16)
    for head in range(2):
        best = votes[head].argmax().item()
        neighbours = set(range(max(best - 2, 0), min(best + 3, PROMPT - 16)))
        assert neighbours <= set(cache.positions[head].tolist())


def test_snapkv_below_its_window_keeps_the_latest_tokens(workload):
    method = make_method("snapkv", {"budget": 0.05, "window": 32})
    cache = prefill(method, workload, 0)
    count = kept_count(0.05, PROMPT)
    assert count < 32 and cache.positions.tolist() == [list(range(PROMPT - count, PROMPT))] * 2


def test_snapkv_window_must_fit_in_the_prompt(workload):
    with pytest.raises(ValueError, match="shorter than the prompt"):
        prefill(make_method("snapkv", {"window": PROMPT}), workload, 0)


def test_layer_cache_append_and_keep():
    keys = torch.arange(12.0).reshape(1, 3, 4)
    cache = KeptTokens.from_prompt(keys, -keys, torch.tensor([[0.5, 0.25, 0.75]]))
    cache.append(torch.full((1, 1, 4), 7.0), torch.full((1, 1, 4), -7.0))
    assert cache.tokens == 4 and cache.seen == 4 and cache.positions.tolist() == [[0, 1, 2, 3]]
    assert cache.scores.tolist() == [[0.5, 0.25, 0.75, 0.0]]
    cache.keep(torch.tensor([[3, 0]]))  # any order in, position order out
    assert cache.positions.tolist() == [[0, 3]] and cache.scores.tolist() == [[0.5, 0.0]]
    assert cache.keys[0, :, 0].tolist() == [0.0, 7.0] and cache.values[0, :, 0].tolist() == [-0.0, -7.0]


@pytest.mark.parametrize(
    "name,params,error,match",
    [
        ("h2o2", {}, ValueError, "unknown method 'h2o2' \\(did you mean 'h2o'\\?\\)"),
        ("zipcache", {}, ValueError, "method 'zipcache' is now 'zipvl_fixed': it is ZipVL's fixed-ratio baseline"),
        (None, {}, TypeError, "method name must be a str"),
        ("full", {"budget": 0.5}, ValueError, "unknown parameter.*'budget'"),
        ("h2o", {"window": 4}, ValueError,
         "unknown parameter.*known: \\['attention', 'backend', 'budget', 'evict_while_decoding', 'fp8_scale', "
         "'kv_dtype', 'recent_fraction'\\]"),
        ("h2o", {"budgett": 0.5}, ValueError, "did you mean 'budget'"),
        ("h2o", {"budget": "0.5"}, TypeError, "budget must be float"),
        ("h2o", {"budget": 0.0}, ValueError, "below its minimum"),
        ("h2o", {"budget": 1.5}, ValueError, "above its maximum"),
        ("h2o", {"recent_fraction": -0.1}, ValueError, "below its minimum"),
        ("streamingllm", {"sink_tokens": 2.5}, TypeError, "sink_tokens must be int"),
        ("streamingllm", {"sink_tokens": True}, TypeError, "sink_tokens must be int"),
        ("snapkv", {"kernel_size": 4}, ValueError, "kernel_size=4 is not one of"),
        ("snapkv", {"pooling": "median"}, ValueError, "pooling='median' is not one of"),
        ("snapkv", [("budget", 0.5)], TypeError, "must be a mapping"),
    ],
)
def test_bad_parameters_are_rejected(name, params, error, match):
    with pytest.raises(error, match=match):
        make_method(name, params)


def test_integers_are_accepted_for_floats():
    method = make_method("h2o", {"budget": 1})
    assert method.budget == 1.0 and isinstance(method.budget, float)


def test_schema_file_is_up_to_date():
    """schema.json is what schema.document() produces; regenerate it with
    `workbench schema` after changing a knob. The kvpress presses are read
    from kvpress itself, so a Python without it (a `--python` of one's own)
    compares the rest."""
    want, got = json.loads(SCHEMA_FILE.read_text()), schema.document()
    if importlib.util.find_spec("kvpress") is None:
        for doc in (want, got):
            for method in doc["methods"].values():
                method.pop("presses", None)
    assert want == got


def check_params(schema_params: dict, dataclass_type) -> None:
    fields = {f.name: f for f in dataclasses.fields(dataclass_type)}
    assert list(schema_params) == list(fields)
    for name, entry in schema_params.items():
        field = fields[name]
        assert entry["type"] == TYPE_OF_ANNOTATION[field.type]
        if entry["type"] == "ints":
            assert entry["default"] == list(field.default) and all(type(v) is int for v in entry["default"])
        else:
            assert entry["default"] == field.default and type(entry["default"]) is field.type
        assert {"type", "default", "min", "max", "doc"} <= set(entry) <= {"type", "default", "min", "max", "doc",
                                                                          "choices", "ref", "pattern",
                                                                          "id_omits_default", "paths", "required"}
        assert entry.get("id_omits_default", True) is True  # written only where set
        assert entry.get("paths", True) is True and ("paths" not in entry or entry["type"] == "str")
        assert entry.get("required", True) is True and ("required" not in entry or entry["default"] == "")
        if "pattern" in entry:
            assert entry["type"] == "str" and re.fullmatch(entry["pattern"], entry["default"])
        assert entry["doc"], f"{name} has no doc"
        if "choices" in entry:
            assert entry["default"] in entry["choices"]
        for bound in ("min", "max"):
            if entry[bound] is not None:
                assert entry["type"] in ("int", "float", "ints")
        values = entry["default"] if entry["type"] == "ints" else [entry["default"]]
        if entry["min"] is not None:
            assert min(values) >= entry["min"]
        if entry["max"] is not None:
            assert max(values) <= entry["max"]


def test_schema_matches_the_registries():
    document = json.loads(SCHEMA_FILE.read_text())
    assert set(document) == {"methods", "workloads", "default_workload", "benchmarks", "ops", "protocols",
                             "renamed_methods"}
    assert all(entry["now"] in METHODS and old not in METHODS for old, entry in document["renamed_methods"].items())
    assert list(document["protocols"]) == list(PROTOCOLS)
    assert list(document["methods"]) == list(METHODS)
    for name, cls in METHODS.items():
        assert document["methods"][name]["doc"]
        assert document["methods"][name].get("in_model_only", False) is getattr(cls, "in_model_only", False)
        check_params(document["methods"][name]["params"], cls)
        defaults = {p: e["default"] for p, e in document["methods"][name]["params"].items()}
        make_method(name, defaults)
        # What a protocol sets is a valid job: known knobs, values the method accepts.
        for protocol, knobs in document["methods"][name].get("protocols", {}).items():
            assert protocol in PROTOCOLS and knobs == cls.protocol_knobs(protocol)
            make_method(name, {**defaults, **knobs})
    assert list(document["workloads"]) == list(WORKLOADS)
    for name, cls in WORKLOADS.items():
        check_params(document["workloads"][name]["params"], cls)
        # plan pairs a method that runs only inside a model with workloads that run one, as ablation.run does
        assert document["workloads"][name].get("runs_model", False) is cls.runs_model
        assert cls.runs_model is (hasattr(cls, "image_list") or hasattr(cls, "evaluate")), name
    defaults = {p: e["default"] for p, e in document["workloads"]["synthetic"]["params"].items()}
    assert SyntheticConfig.from_dict(defaults) == SyntheticConfig()
    assert list(document["benchmarks"]) == list(BENCHMARKS)
    for name, cls in BENCHMARKS.items():
        check_params(document["benchmarks"][name]["params"], cls)
        columns = cls.columns + cls.optional_columns
        assert [c["name"] for c in document["benchmarks"][name]["columns"]] == [c.name for c in columns]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_attending_without_weights_gives_the_same_output(heads, kv_heads):
    """The path a GPU decode step takes when the method's scores ignore the
    step's attention (SDPA over the held tokens, no float32 copy) gives what
    the float32 path gives, and no weights."""
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(kv_heads, 37, 16, generator=g), torch.randn(kv_heads, 37, 16, generator=g)
    cache = KeptTokens.from_prompt(keys, values, None)
    q = torch.randn(heads, 1, 16, generator=g)
    want, weights = cache.attend(q)
    got, none = cache.attend(q, weights=False)
    assert none is None and weights.shape == (heads, 37)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_only_scores_that_accumulate_need_the_steps_weights():
    assert make_method("h2o")._parts[0].needs_weights
    assert not make_method("vlcache")._parts[0].needs_weights
    assert not make_method("snapkv")._parts[0].needs_weights


def test_a_scorer_of_the_wrong_shape_is_named(workload):
    """A new method whose scorer returns one score per token (not per kv head
    and token) is told what its scorer must return, not an IndexError."""
    from kernels_py.methods.allocators import Uniform
    from kernels_py.methods.base import BudgetedSelection
    from kernels_py.methods.scorers import Scorer

    class PerToken(Scorer):
        def prefill(self, prompt, layer):
            return torch.rand(prompt.tokens)

    @dataclasses.dataclass(frozen=True)
    class Mine(BudgetedSelection):
        name = "mine"

        def scorer(self):
            return PerToken()

        def allocator(self):
            return Uniform(0.2)

    with pytest.raises(ValueError, match=re.escape(f"method 'mine': PerToken.prefill returned [{PROMPT}] for layer 0; "
                                                   f"a scorer's prefill returns [kv_heads, T] = [2, {PROMPT}]")):
        prefill(Mine(), workload, 0)


def test_registry_names_a_missing_file_and_a_misnamed_method(tmp_path, monkeypatch):
    """A typo in a registry list, or a method whose `name` is not its file's,
    says which and what is there instead."""
    from kernels_py import registry
    from kernels_py.methods.base import Method

    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "span_edges.py").write_text(
        "from kernels_py.methods.streamingllm import StreamingLLM\n\n"
        "class SpanEdges(StreamingLLM):\n    name = 'spanedges'\n")
    (package / "broken.py").write_text("import no_such_module_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=re.escape("the list in mypkg/__init__.py names 'span_egdes', but there is "
                                                    "no mypkg/span_egdes.py (did you mean 'span_edges'?)")):
        registry.load("mypkg", ("span_egdes",), Method)
    with pytest.raises(ImportError, match=re.escape("found 0; SpanEdges has name = 'spanedges'")):
        registry.load("mypkg", ("span_edges",), Method)
    with pytest.raises(ModuleNotFoundError, match="no_such_module_here"):  # its own import, not the registry's
        registry.load("mypkg", ("broken",), Method)


def test_a_benchmark_file_without_a_named_benchmark_is_refused(tmp_path, monkeypatch):
    """A benchmark class that forgot its `name` would leave `workbench bench`
    without it, silently; a module of shared parts starts with "_"."""
    import sys

    from kernels_py import benchmarks

    (tmp_path / "mine.py").write_text(
        "from dataclasses import dataclass\n\nfrom kernels_py.benchmarks.base import Benchmark\n\n\n"
        "@dataclass(frozen=True)\nclass Mine(Benchmark):\n    columns = ()\n")
    (tmp_path / "_parts.py").write_text("X = 1\n")
    monkeypatch.setattr(benchmarks, "__path__", [*benchmarks.__path__, str(tmp_path)])
    try:
        with pytest.raises(ImportError, match=re.escape("kernels_py/benchmarks/mine.py defines no Benchmark "
                                                        "subclass with a name of its own")):
            benchmarks._discover()
        (tmp_path / "mine.py").write_text((tmp_path / "mine.py").read_text() + '    name = "mine"\n')
        sys.modules.pop("kernels_py.benchmarks.mine")
        assert set(benchmarks._discover()) == {*BENCHMARKS, "mine"}
        assert "kernels_py.benchmarks._parts" not in sys.modules
    finally:
        sys.modules.pop("kernels_py.benchmarks.mine", None)
