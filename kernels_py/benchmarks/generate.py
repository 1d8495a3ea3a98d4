"""End to end: a VLM at a published model's sizes with random weights
(kernels_py.models.sized: LLaVA-1.5-7B or Qwen2-VL-7B; nothing is
downloaded) prefills batches of prompts of a chosen number of visual tokens
and generates `new_tokens` tokens greedily, once with the full cache as
transformers runs it (DynamicCache and SDPA, FlashAttention on a GPU; the
row "full cache, SDPA"), the baseline, and once with each method holding
every layer's cache through the vlkv adapter. On a GPU a method decodes with
its op: the quantized decode for ZipVL, the low-rank decode for
AttentionPack, SDPA over the kept tokens for evictions (attention="sdpa";
H2O's running totals need each step's weights, from a float32 attention).
Per row: prefill time, time per decode step and for the whole generation,
their speedups over the baseline, the cache bytes and the peak memory (of
the generation, and of its decode steps alone).

What the numbers are and are not:
- The weights' values do not change the work of the model's own layers, but
  they do change what adaptive methods keep: random weights attend almost
  uniformly, so ZipVL marks nearly every token important and VL-Cache's
  sparsity-based layer budgets are not the real model's. cache_share says
  what each method really kept.
- The adapter calls each method once per (prompt, layer) and holds every
  layer's prompt Q/K/V until the last layer has run (what methods that
  weigh layers against each other need), so a method's peak memory is above
  the baseline's, and batches above 1 time a Python loop over the prompts
  at every decode step too, except where a method's prompts decode
  together, padded to one length: VL-Cache (its decode only appends and
  attends) and ZipVL (except on a step that requantizes its waiting
  tokens, which runs prompt by prompt); AttentionPack loops.
- The baseline appends with torch.cat every step, as DynamicCache does; a
  serving stack's paged or static cache would make it faster.
- ZipVL runs its sparse prefill (the prefill's time includes choosing the
  important tokens from the probe rows) without measuring it afterwards
  (two extra float32 attentions per layer that only report an error,
  `sparse_prefill_metrics`). It chooses them twice a layer: in the model's
  prefill and again when its caches are built from the same Q/K (probe
  rows of 64 + 64 score 0.6% of a 33K-token prompt's causal pairs, 26% of a
  672-token one's). AttentionPack runs with
  rope="after" on M-RoPE models. With ZipVL's period (100), a generation of
  100 tokens never re-quantizes while timed.

Each (method, shape) first runs untimed (a prefill and 4 steps: kernels
compile, the allocator warms), then once timed. With `profile_steps`, two
more runs under PyTorch's profiler (the prefill alone, and the prefill and
that many steps) give, by their difference, what one decode step asks of
the host and the GPU: PyTorch ops, kernel launches, explicit waits on the
GPU, the SDPA backends the step ran (step_attention: which kernel the
baseline's attention was; none under graphs, whose replays show the
profiler no ops), and the GPU's busy time against the step's (below 100%:
the GPU idles part of the step, waiting for launches or for the host, so
GPU work alone does not set the step's time). A shape whose baseline runs
out of memory is skipped for every method; other rows that run out of
memory are kept saying so. A full default grid takes tens of minutes on an
H100. On the CPU a tiny model of the same architecture shows the benchmark
works; its times are not the kernels'.
"""

import collections
import functools
import warnings
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from kernels_py import runtime
from kernels_py.benchmarks.base import Benchmark
from kernels_py.methods import METHODS, make_method
from kernels_py.models import ModelError, generate_batch, generate_sdpa, sized
from kernels_py.ops import common
from kernels_py.params import BadKnobs, Rule, closest, knob
from kernels_py.tables import Column

_MODELS: dict = {}  # (size, dtype, device) -> the model, built once per process
BASELINE = "full cache, SDPA"
GRAPHED_BASELINE = "full cache, CUDA graph"  # the baseline with graphs: the full cache held as the methods are


@dataclass(frozen=True)
class Generate(Benchmark):
    """Prefill, decode step and 100-token generation of a 7B VLM per method vs the full cache."""

    name = "generate"
    columns = (
        Column("model", "", "model sizes (kernels_py.models.sized), random weights"),
        Column("visual", "", "visual tokens asked per prompt (LLaVA rounds up to whole images: see prompt_tokens)"),
        Column("batch", "", "prompts decoded together"),
        Column("method", "", f"what holds the KV cache ({BASELINE!r}: transformers' own, the baseline; with graphs "
               f"{GRAPHED_BASELINE!r}: method full's, decoded as the methods are)"),
        Column("prompt_tokens", "", "tokens per prompt: visual, text and the few around them", "prompt"),
        Column("prefill_s", "s", "prefill of the batch, the method's compression included", "prefill"),
        Column("decode_step_ms", "ms", "one decode step of the batch, the mean over the generation (with graphs, "
               "over the steps replayed from the graph: the first three run eagerly or capture it)", "step"),
        Column("generate_s", "s", "prefill and every decode step of the generation (with --graphs, the graph's "
               "capture too: one a generation)", "generate"),
        Column("decode_speedup", "x", "the baseline's decode step / this one", "step vs full"),
        Column("generate_speedup", "x", "the baseline's generation / this one", "generate vs full"),
        Column("cache_bytes", "bytes", "the method's caches after the last step, every layer and prompt", "cache"),
        Column("cache_share", "", "cache_bytes / the baseline's", "cache share"),
        Column("peak_bytes", "bytes", "device memory above what was allocated when the generation started (the "
               "model and the inputs), at its peak", "peak"),
        Column("decode_peak_bytes", "bytes", "the same over the decode steps alone: the caches held after prefill "
               "and one step's work (peak_bytes is mostly the prefill's, where a method holds every layer's prompt "
               "Q/K/V)", "decode peak"),
        Column("memory_kind", "", "what peak_bytes counts: cuda (allocator) or cpu-rss", show=False),
    )
    optional_columns = (
        Column("step_ops", "", "PyTorch ops the host runs a decode step, nested calls included (profile_steps)",
               "ops/step"),
        Column("step_launches", "", "kernel launches a decode step (profile_steps; 0 on the CPU)", "launches/step"),
        Column("step_syncs", "", "explicit waits for the GPU a decode step (synchronize calls, blocking copies; "
               "profile_steps)", "syncs/step"),
        Column("step_attention", "", "the SDPA kernels a decode step ran, as PyTorch's profiler names their ops: "
               "flash, efficient, cudnn, math, flash (cpu); none where the method attends with kernels of its own, "
               "and with graphs, whose replayed steps show the profiler no ops (profile_steps)", "SDPA/step"),
        Column("step_gpu_ms", "ms", "the GPU's busy time a decode step: kernels, copies and fills, summed "
               "(profile_steps; GPU only)", "GPU/step"),
        Column("gpu_busy", "%", "step_gpu_ms / decode_step_ms: below 100% the GPU idles part of the step",
               "GPU busy"),
        Column("gpu_step_speedup", "x", "the baseline's step_gpu_ms / this one: the decode speedup in GPU time, "
               "the host left out, as VL-Cache's speed benchmark measures it (appendix A.6)", "GPU step vs full"),
    )
    RULES = (Rule("not graphs or new_tokens >= 4",
                  "--graphs replays decode steps from the third on (the first two run eagerly): new_tokens "
                  "({new_tokens}) must be at least 4 for a step to be replayed, else decode_step_ms is the eager "
                  "steps'"),)
    smoke = ({"model": "tiny-llava"}, {"visual": (64,), "text": 16}, {"batches": (1, 2)}, {"new_tokens": 4},
             {"dtype": "float32"})

    model: str = knob("str", "llava-1.5-7b", "model sizes", choices=tuple(sized.SIZES))
    methods: str = knob("str", "vlcache,zipvl,attentionpack", "methods compared with the full cache, comma-separated "
                        "(kernels_py/methods); each takes its defaults, and the budget where it has one",
                        pattern=r"^[a-z0-9_]+(,[a-z0-9_]+)*$")
    budget: float = knob("float", 0.1, "share of the prompt a method with a budget keeps", min=0.001, max=1.0,
                         ref="VL-Cache: decoding 7.08x faster at 10% of the cache")
    visual: tuple = knob("ints", (2048, 8192, 32768), "visual tokens per prompt (LLaVA: rounded up to whole "
                         "images of 576)", min=1, max=1 << 20)
    text: int = knob("int", 64, "text tokens after the image", min=1, max=1 << 16)
    batches: tuple = knob("ints", (1, 8), "batch sizes (LLaVA-1.5-7B's full cache is 512 KiB a token: 32K tokens "
                          "x 8 prompts is 128 GiB)", min=1, max=4096)
    new_tokens: int = knob("int", 100, "tokens generated per prompt", min=2, max=1 << 16)
    dtype: str = knob("str", "float16", "dtype of the weights and activations",
                      choices=("float16", "bfloat16", "float32"))
    seed: int = knob("int", 0, "seed of the weights and the prompts", min=0, max=2**31 - 1)
    graphs: bool = knob("bool", False, "decode steps from the third on replayed from a CUDA graph of one step "
                        "(models.generate_batch(graphs=True)), so that the host launches one graph a step and the "
                        "GPU's work sets the step's time; the baseline becomes the full cache held and decoded as the "
                        "methods are (method full, attention=sdpa: gather_decode over one padded cache a layer); a "
                        "method whose prompts cannot decode together is skipped, saying why; without CUDA the same "
                        "steps run eagerly")
    profile_steps: int = knob("int", 0, "decode steps to profile after the timed run (0: none): per step, the ops, "
                              "launches and waits the host issues, the SDPA backends it ran and the GPU's busy time",
                              min=0, max=1000)

    def method_names(self) -> list[str]:
        names = self.methods.split(",")
        usable = sorted(n for n, m in METHODS.items() if not getattr(m, "in_model_only", False))
        for name in names:
            if name not in METHODS:
                raise BadKnobs(f"--methods: unknown method {name!r}{closest(name, usable)}; known here: "
                               f"{', '.join(usable)}")
            if getattr(METHODS[name], "in_model_only", False):  # a kvpress press: no adapter decode to time
                raise BadKnobs(f"--methods: {name!r} compresses transformers' own cache as a press (a \"vlm\" "
                               f"workload's generation), not through the method adapter this benchmark times; "
                               f"usable here: {', '.join(usable)}")
        return [self.baseline] + list(dict.fromkeys(names))

    @property
    def baseline(self) -> str:
        return GRAPHED_BASELINE if self.graphs else BASELINE

    def cases(self):
        names = self.method_names()
        self._check_weights_fit()
        _FULL.clear()  # baselines of an earlier run (another dtype, seed or length) must not be compared with
        return ({"model": self.model, "visual": v, "batch": b, "method": m}
                for v in self.visual for b in self.batches for m in names)

    def run_notes(self) -> list[str]:
        notes = []
        cuda = runtime.device().type == "cuda"
        if self.graphs and not cuda:
            notes.append(f"--graphs without CUDA: no graph was captured or replayed; every decode step ran eagerly "
                         f"(the {GRAPHED_BASELINE!r} row is method full's cache, decoded eagerly as the methods are)")
        if cuda and self.dtype == "float32":
            # FlashAttention takes 16-bit inputs only: SDPA falls back (models.adapter._decode_sdpa).
            notes.append("--dtype float32: the full cache's attention ran another SDPA kernel (memory-efficient or "
                         "math), not FlashAttention, which takes float16 and bfloat16 only; the speedups are not "
                         "against FlashAttention")
        return notes

    def _check_weights_fit(self) -> None:
        """BadKnobs where the model's weights alone exceed the memory free on
        the device (a 7B model in float32 on a CPU): building it would only
        end in an out-of-memory kill."""
        device = runtime.device()
        dtype = common.dtype(self.dtype)
        need = weights_bytes(self.model, dtype)
        free = available_bytes(device)
        if free is None:
            return
        free += sum(weights_bytes(key[0], common.dtype(key[1])) for key in _MODELS)  # freed before the build
        if need > free:
            hint = (f"; on the CPU --model {' or '.join(n for n in sized.SIZES if n.startswith('tiny-'))} shows the "
                    f"benchmark works" if device.type != "cuda" else "")
            raise BadKnobs(f"--model {self.model}: its weights take {need / 1e9:.1f} GB in {self.dtype}, more than "
                           f"the {free / 1e9:.1f} GB free on the {device.type}{hint}")

    def _vlm(self):
        device = runtime.device()
        longest = max(self.visual) + 576 + self.text + max(self.new_tokens, self.profile_steps + 4) + 2
        key = (self.model, self.dtype, str(device), self.seed, longest)
        if key not in _MODELS:
            _MODELS.clear()  # one model at a time: two 7B models need not fit together
            _MODELS[key] = sized.build(self.model, longest, device=device, dtype=common.dtype(self.dtype),
                                       seed=self.seed)
        return _MODELS[key]

    def _method(self, name: str, mrope: bool):
        """The method with the budget where it has one, and what end-to-end
        timing needs (see the module doc)."""
        knobs = {f.name for f in fields(METHODS[name])}
        wanted = {"budget": self.budget, "attention": "sdpa", "sparse_prefill_metrics": False}
        if mrope:
            wanted["rope"] = "after"
        return make_method(name, {k: v for k, v in wanted.items() if k in knobs})

    def measure(self, case):
        shape = (case["model"], case["visual"], case["batch"])
        baseline = case["method"] == self.baseline
        if not baseline and shape not in _FULL:
            return {"skipped": "the baseline did not run at this shape (out of memory, or skipped): not run"}
        vlm = self._vlm()
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + case["visual"] * 131 + case["batch"])
        inputs = sized.prompt(vlm, case["batch"], case["visual"], self.text, g)
        if baseline and not self.graphs:
            def run(tokens):
                return generate_sdpa(vlm, inputs, tokens)
        else:
            method = self._method("full" if baseline else case["method"], vlm.mrope)

            def run(tokens):
                return generate_batch(vlm, method, inputs, tokens, graphs=self.graphs)
        try:
            run(min(5, self.new_tokens))  # compiles the kernels, warms the allocator
        except ModelError as err:  # graphs with a method whose steps do not all decode together
            return {"skipped": str(err)}
        out = run(self.new_tokens)
        first = out[0]
        steps = self.new_tokens - 1
        step_ms = (first.replayed_seconds / first.replayed_steps if first.replayed_steps
                   else first.decode_seconds / steps) * 1e3
        row = {"prompt_tokens": int(inputs["input_ids"].shape[1]), "prefill_s": first.prefill_seconds,
               "decode_step_ms": step_ms,
               "generate_s": first.prefill_seconds + first.decode_seconds,
               "cache_bytes": sum(g.cache_bytes for g in out), "peak_bytes": first.peak_bytes,
               "decode_peak_bytes": first.decode_peak_bytes,
               "memory_kind": first.memory_kind}
        if self.profile_steps:
            # With graphs both profiled runs hold the three steps before the replays, which the difference cancels.
            row.update(step_profile(run, self.profile_steps, vlm.model.device, before=4 if self.graphs else 1))
            if "step_gpu_ms" in row:
                row["gpu_busy"] = 100 * row["step_gpu_ms"] / row["decode_step_ms"]
        if baseline:
            _FULL[shape] = row
        full = _FULL.get(shape)
        if full:
            row["decode_speedup"] = full["decode_step_ms"] / row["decode_step_ms"]
            row["generate_speedup"] = full["generate_s"] / row["generate_s"]
            row["cache_share"] = row["cache_bytes"] / full["cache_bytes"]
            if "step_gpu_ms" in row and "step_gpu_ms" in full:
                row["gpu_step_speedup"] = full["step_gpu_ms"] / row["step_gpu_ms"]
        return row


_FULL: dict = {}  # the baseline's row of each shape, which the methods' rows compare with


@functools.lru_cache(maxsize=None)
def weights_bytes(model: str, dtype: torch.dtype) -> int:
    """Bytes of the model's weights (sized.SIZES) in `dtype`, from a build on
    the meta device, which holds no memory (once per model and dtype: the
    build takes seconds at 7B)."""
    vlm = sized.build(model, 4096, device=torch.device("meta"), dtype=dtype)
    return sum(p.numel() for p in vlm.model.parameters()) * dtype.itemsize


def available_bytes(device: torch.device) -> float | None:
    """Memory free for new tensors: on a GPU what the driver has free plus
    what PyTorch's allocator holds unused; on a CPU the system's MemAvailable
    (None where it cannot be read)."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return float(torch.cuda.mem_get_info(device)[0] + cached)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# The CUDA runtime calls that start a kernel, and the ones in which the host waits for the GPU.
_LAUNCHES = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                       "cudaLaunchCooperativeKernel", "cudaGraphLaunch"})
_SYNCS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"})


def tally(events) -> dict:
    """Counts of a profile's events (torch.profiler FunctionEvents): PyTorch
    ops, kernel launches and host waits (host events), and the microseconds
    of GPU work (device events: kernels, copies, fills)."""
    from torch.autograd import DeviceType

    out = {"ops": 0, "launches": 0, "syncs": 0, "gpu_us": 0.0}
    for e in events:
        if e.device_type == DeviceType.CPU:
            out["ops"] += e.name.startswith("aten::")
            out["launches"] += e.name in _LAUNCHES
            out["syncs"] += e.name in _SYNCS
        elif e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            out["gpu_us"] += e.time_range.elapsed_us()  # annotations span kernels counted already
    return out


# SDPA's backends, by the op PyTorch dispatches scaled_dot_product_attention to.
_SDPA_OPS = {"aten::_scaled_dot_product_flash_attention": "flash",
             "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
             "aten::_scaled_dot_product_efficient_attention": "efficient",
             "aten::_scaled_dot_product_cudnn_attention": "cudnn",
             "aten::_scaled_dot_product_attention_math": "math"}


def sdpa_calls(events) -> collections.Counter:
    """How often a profile's host events called each SDPA backend (_SDPA_OPS)."""
    return collections.Counter(_SDPA_OPS[e.name] for e in events if e.name in _SDPA_OPS)


def step_profile(run, steps: int, device: torch.device, before: int = 1) -> dict:
    """What one decode step of run(tokens) asks of the host and the GPU: the
    difference of a profiled run of before + steps tokens and one of
    `before` (the same prefill and first steps), per step. Counts are exact;
    the GPU time is the profiler's, and only on a GPU."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    counts, sdpa = [], []
    for tokens in (before, before + steps):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the profiler's notes on its own cycles
            with profile(activities=activities) as prof:
                run(tokens)
            events = prof.events()
            counts.append(tally(events))
            sdpa.append(sdpa_calls(events))
    per = {k: (counts[1][k] - counts[0][k]) / steps for k in counts[0]}
    out = {"step_ops": per["ops"], "step_launches": per["launches"], "step_syncs": per["syncs"],
           "step_attention": ", ".join(sorted(sdpa[1] - sdpa[0])) or "none"}
    if cuda:
        out["step_gpu_ms"] = per["gpu_us"] / 1e3
    return out
