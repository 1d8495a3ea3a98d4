"""What each registered op's Triton kernels compile to on a CUDA target,
without a GPU: one row per compiled (case, kernel, config) with registers per
thread, spills, shared memory and tensor-core instructions
(`workbench kernels report` prints it); with --estimate, what each op's
implementations take at its benchmark shapes, estimated from what their
compiled code issues (kernels_py.ops.estimate), and the calibration points.

    python -m kernels_py.ops.report --target 90 [--case NAME ...]
    python -m kernels_py.ops.report --target 90 --estimate [--shape batch=8,visual=16384] [--op NAME ...]
        [--impl NAME ...] [--config 'KERNEL:BLOCK_N=128 w8 s3' ...]

prints the report as JSON (kernels_py.tables). Like kernels_py.ops.compile,
it must run without TRITON_INTERPRET.
"""

import argparse
import dataclasses
import json
import math
import sys

from kernels_py.ops import sass
from kernels_py.params import closest
from kernels_py.runtime.errors import compile_failure
from kernels_py.tables import Column, table

COLUMNS = (
    Column("case", "", "compile case (kernels_py/ops/<op>/cases.py): the launcher call whose specialization is "
           "compiled"),
    Column("kernel", "", "the @triton.jit kernel"),
    Column("block_n", "", "the autotuned token tile of this config (-: a plain launch)", "tile"),
    Column("num_warps", "", "warps per program", "warps"),
    Column("num_stages", "", "software pipelining stages", "stages"),
    Column("maxnreg", "", "the config's register cap (ptx .maxnreg; -: none)", "cap"),
    Column("registers", "", "registers per thread (255 is the most a thread may have)", "regs"),
    Column("spill_stores", "", "bytes of registers spilled to local memory per thread (ptxas -v)", "spill"),
    Column("stack_bytes", "", "stack frame per thread: spills, or libdevice's sin/cos table", "stack", show=False),
    Column("shared", "bytes", "shared memory per program", "smem"),
    Column("sass_instructions", "", "SASS instructions in the binary (static code size; a loop counts once)", "sass"),
    Column("mma_sync", "", "mma.sync tensor-core instructions in the PTX", "mma"),
    Column("wgmma", "", "wgmma (sm_90 warpgroup) tensor-core instructions in the PTX", "wgmma"),
    Column("tensor_cores", "", "whether its dots lower to tensor-core instructions", "tc"),
    Column("error", "", "why it did not compile", show=False),
)


def report(target: int, names: list[str] | None = None) -> dict:
    """Compile the chosen cases (all when names is empty) for sm_<target>;
    `errors` lists what did not compile, where and why, and `models` each
    op's ideal (its model.py's report()) for the ops of the cases chosen."""
    from kernels_py.ops import OPS

    rows, errors, chosen = [], [], []
    for op in OPS.values():
        for case in op.cases.COMPILE_CASES:
            if names and case.name not in names:
                continue
            if op not in chosen:
                chosen.append(op)
            _compile_rows(case, target, rows, errors)
    return {"title": f"Triton kernels compiled for sm_{target} (no GPU needed)", "target": target,
            **table(COLUMNS, rows), "errors": errors, "models": ideals(chosen)}


def ideals(ops) -> list[dict]:
    """The ideal table of each op whose model.py has a report()."""
    return [op.model.report() for op in ops if op.model is not None and hasattr(op.model, "report")]


def _compile_rows(case, target: int, rows: list, errors: list) -> None:
    from kernels_py.ops import compile as cc

    result = cc.compile_case(case, target)
    if result["error"]:
        rows.append({"case": case.name, "kernel": "", "error": result["error"].splitlines()[-1]})
        errors.append({"case": case.name, "kernel": "", "config": "", **compile_failure(result)})
    for e in result["compiled"]:
        if e.get("error"):
            errors.append({"case": case.name, "kernel": e["kernel"], "config": config_label(e), **compile_failure(e)})
        config = e.get("config")
        rows.append({
            "case": case.name, "kernel": e["kernel"],
            "block_n": dict(config[0]).get("BLOCK_N") if config else None,
            "num_warps": e.get("num_warps"), "num_stages": e.get("num_stages"), "maxnreg": e.get("maxnreg"),
            "registers": e.get("registers"), "spill_stores": e.get("spill_stores"),
            "stack_bytes": e.get("stack_bytes"), "shared": e.get("shared"),
            "sass_instructions": e.get("sass_instructions"),
            "mma_sync": e.get("mma_sync"), "wgmma": e.get("wgmma"),
            "tensor_cores": (e.get("mma_sync") or 0) + (e.get("wgmma") or 0) > 0 if "mma_sync" in e else None,
            "error": (e.get("error") or "").splitlines()[-1] if e.get("error") else None,
        })


# ----------------------------------------------------------------------------
# Estimates from the compiled code
# ----------------------------------------------------------------------------


def _value(v):
    """A constexpr as describe() prints it, back to a number where it is one."""
    if isinstance(v, str):
        for conv in (int, float):
            try:
                return conv(v)
            except ValueError:
                pass
        return {"True": True, "False": False}.get(v, v)
    return v


def config_label(entry: dict) -> str:
    """A compiled entry's config, e.g. "BLOCK_N=64 w8 s2", or "w4 s1 r168"
    with a register cap of 168."""
    cap = f" r{entry['maxnreg']}" if entry.get("maxnreg") else ""
    if not entry.get("config"):
        return f"w{entry.get('num_warps')} s{entry.get('num_stages')}{cap}"
    kwargs = " ".join(f"{k}={v}" for k, v in entry["config"][0])
    return f"{kwargs} w{entry['num_warps']} s{entry['num_stages']}{cap}".strip()


def key_label(key: list) -> str:
    """An autotune config key (compile.config_key) as config_label prints it."""
    kwargs, warps, stages, *cap = key
    text = " ".join([*(f"{k}={v}" for k, v in kwargs), f"w{warps}", f"s{stages}"])
    return f"{text} r{cap[0]}" if cap else text


def parse_configs(texts: list[str]) -> dict[str, set[str]]:
    """--config KERNEL:LABEL, repeatable, as {kernel: {labels}}."""
    out: dict[str, set[str]] = {}
    for text in texts:
        kernel, colon, label = text.partition(":")
        if not colon or not kernel.strip() or not label.strip():
            raise ValueError(f"--config: {text!r} is not KERNEL:CONFIG (e.g. '_stage1_kernel:BLOCK_N=128 w8 s3', "
                             f"a config as the report's config column prints it)")
        out.setdefault(kernel.strip(), set()).add(" ".join(label.split()))
    return out


class NoUsableConfig(RuntimeError):
    """Every config of a kernel (or every one --config kept) spills or failed
    to compile; `at` is the first failure (compile.failure's, with its kernel
    and config), None when every config spilled."""

    def __init__(self, message: str, at: dict | None = None):
        super().__init__(message)
        self.at = at


def spills(entry: dict) -> bool:
    return bool(entry.get("spill_stores") or entry.get("spill_loads"))


class Compiled:
    """Every launch of an implementation compiled for a target at one
    specialization, each kernel's SASS analysed once."""

    def __init__(self, impl, step, target: int, select=None):
        from kernels_py.ops import compile as cc

        self.launched, self.configs_of, compiled = cc.compile_launches(lambda: impl.call(step), target,
                                                                       select=select)
        self.entries = compiled
        self._kernels: dict[int, object] = {}

    def kernel(self, index: int):
        from kernels_py.ops import estimate

        if index not in self._kernels:
            entry, compiled = self.entries[index]
            meta = self.meta(entry)
            self._kernels[index] = estimate.Kernel(entry["kernel"], compiled.asm["cubin"], meta, entry["signature"])
        return self._kernels[index]

    @staticmethod
    def meta(entry: dict) -> dict:
        meta = {k: _value(v) for k, v in entry.get("constexprs", {}).items()}
        if entry.get("config"):
            meta.update({k: _value(v) for k, v in entry["config"][0]})
        return meta


def estimate_implementation(impl, step, compiled: Compiled, gpu, flash_us: float) -> dict:
    """The band of one implementation at a step: each launched kernel's
    configs estimated, spilling ones pruned, the predicted pick summed."""
    from kernels_py.ops import estimate

    kernels, picked = [], []
    order = list(dict.fromkeys(compiled.launched))
    for name in order:
        rows, candidates = [], []
        for index, (entry, binary) in enumerate(compiled.entries):
            if entry["kernel"] != name:
                continue
            if entry.get("error") or binary is None:
                rows.append({"kernel": name, "config": config_label(entry), "error": entry.get("error", "")})
                continue
            work = impl.work(step, name, Compiled.meta(entry), gpu)
            est = estimate.estimate(compiled.kernel(index), work, warps=entry["num_warps"],
                                    registers=entry.get("registers") or 0, shared=entry.get("shared") or 0,
                                    spill_bytes=entry.get("spill_stores") or 0, config=config_label(entry), gpu=gpu)
            row = est.row()
            row["pruned"] = "spills" if impl.prunes_spilling and entry.get("autotuned") and spills(entry) else ""
            rows.append(row)
            if not row["pruned"]:
                candidates.append(est)
        if not candidates:
            spilled = [r["config"] for r in rows if r.get("pruned")]
            failed = [r["config"] for r in rows if r.get("error")]
            first = next((entry for entry, binary in compiled.entries if entry["kernel"] == name
                          and (entry.get("error") or binary is None)), None)
            at = None if first is None else {"case": impl.name, "kernel": name, "config": config_label(first),
                                             **compile_failure(first)}
            if not spilled:  # nothing compiled: the compile error is the news, not spills
                raise NoUsableConfig(f"{impl.name}: {name} did not compile at this shape (failed: "
                                     f"{', '.join(failed)})", at=at)
            raise NoUsableConfig(f"{impl.name}: no config of {name} compiled without spills at this shape (spilled, "
                                 f"which the autotuner prunes: {', '.join(spilled)}; failed to compile: "
                                 f"{', '.join(failed) or 'none'})", at=at)
        choice = estimate.pick(candidates)
        for row in rows:
            row["picked"] = row.get("config") == choice.config
        picked.append(choice)
        kernels.append({"kernel": name, "autotuned": name in compiled.configs_of, "picked": choice.config,
                        "configs": rows})
    band = estimate.combine(impl.name, picked, flash_us, gpu)
    band["kernels"] = kernels
    band["flags"] = [f"{p.kernel}: {f}" for p in picked for f in p.flags]
    return band


def estimate_report(target: int, overrides: dict | None = None, ops: list[str] | None = None,
                    calibrate: bool = True, impls: list[str] | None = None,
                    configs: dict[str, set[str]] | None = None) -> dict:
    """Every registered op model's implementations at its estimate shapes
    (fields of `overrides` replaced), and the calibration points. `impls`:
    only the implementations of these names; `configs`: {kernel: config
    labels}, only these configs of those autotuned kernels are compiled and
    estimated (so the pick is among them). Either one leaves the
    calibration out: it is the quick loop of one change to one kernel."""
    from kernels_py.ops import OPS, estimate

    gpu = estimate.GPUS[target]
    overrides = dict(overrides or {})
    models = [(op, op.model) for op in OPS.values() if (not ops or op.name in ops)
              and op.model is not None and hasattr(op.model, "ESTIMATES")]
    names = [impl.name for _, model in models for impl in model.ESTIMATES]
    for name in impls or ():
        if name not in names:
            raise ValueError(f"--impl: {name!r} is no implementation{closest(name, names)} of the ops estimated "
                             f"(known: {', '.join(repr(n) for n in names)})")
    configs = configs or {}
    select = None
    if configs:
        def select(kernel, key):
            return kernel not in configs or key_label(key) in configs[kernel]
    if impls or configs:
        calibrate = False
    known = sorted({f.name for _, model in models for f in dataclasses.fields(model.ESTIMATE_SHAPES[0])})
    for name in sorted(set(overrides) - set(known)):
        raise ValueError(f"--shape: no op's shape has a field {name!r}{closest(name, known)} (known: "
                         f"{', '.join(known)})")
    steps = []
    for op, model in models:
        for base in model.ESTIMATE_SHAPES:
            mine = {k: v for k, v in overrides.items() if k in {f.name for f in dataclasses.fields(base)}}
            for k, v in mine.items():
                word = isinstance(getattr(base, k), str)
                if word != isinstance(v, str):
                    raise ValueError(f"--shape: {k} must be {'a word' if word else 'a number'}, got {v!r}")
                if not word:
                    _check_number(k, v, getattr(base, k))
                choices = getattr(model, "CHOICES", {}).get(k)
                if choices is not None and v not in choices:
                    names = [str(c) for c in choices]
                    raise ValueError(f"--shape: {k} must be one of {', '.join(names)}, got {v!r}"
                                     f"{closest(str(v), names) if word else ''}")
            step = dataclasses.replace(base, **{k: type(getattr(base, k))(v) for k, v in mine.items()})
            if getattr(step, "heads", 0) % max(getattr(step, "kv_heads", 1), 1):
                raise ValueError(f"--shape: heads={step.heads} must be a multiple of kv_heads={step.kv_heads} "
                                 f"(each kv head serves a group of query heads)")
            cache_bytes = model.flash_bytes(step)  # about the full fp16 cache FlashAttention reads once
            if cache_bytes > gpu.memory_bytes:  # nothing to estimate, and the launchers' models grow with it
                changed = ", ".join(f"{k}={v}" for k, v in mine.items())
                raise ValueError(f"--shape: at {changed} {op.name}'s full cache is {cache_bytes / 1e9:,.0f} GB, more "
                                 f"than the {gpu.name}'s {gpu.memory_bytes / 1e9:.0f} GB: no such step runs on it")
            if (op, model, step) not in steps:  # a field set in every shape can make two shapes one
                steps.append((op, model, step))
    if configs:  # named kernels checked before anything compiles (recording a launcher takes no time)
        from kernels_py.ops import compile as cc

        launched, tuned = set(), {}
        for op, model, step in steps:
            for impl in model.ESTIMATES:
                if not impls or impl.name in impls:
                    for launch in cc.record_launches(lambda: impl.call(step), target):
                        launched.add(launch.kernel.fn.__name__)
                        if launch.configs is not None:  # per op: ops name their kernels alike (_stage1_kernel)
                            tuned.setdefault(launch.kernel.fn.__name__, {})[op.name] = [
                                key_label(cc.config_key(c)) for c in launch.configs]
        _check_configs(configs, sorted(launched), tuned)
    results, cache = [], {}
    for op, model, step in steps:
        flash_us = estimate.flash_us(model.flash_bytes(step), gpu)
        ideal = model.ideal_us(step)
        bands = []
        for impl in model.ESTIMATES:
            if impls and impl.name not in impls:
                continue
            key = (op.name, impl.name, impl.key(step))
            if key not in cache:
                cache[key] = Compiled(impl, step, target, select=select)
            band = estimate_implementation(impl, step, cache[key], gpu, flash_us)
            band["ideal_us"] = ideal.get(impl.name)
            bands.append(band)
        results.append({"op": op.name, "shape": dataclasses.asdict(step), "flash_us": flash_us,
                        "implementations": bands})
    out = {"title": f"estimated on an {gpu.name} from the sm_{target} code (no GPU needed)", "target": target,
           "gpu": {**dataclasses.asdict(gpu), "peak_flops": gpu.peak_flops}, "estimates": results}
    if calibrate and target == 90:  # every point was measured on an sm_90 GPU (H100, H200)
        from kernels_py.ops import calibration

        rows = calibration.check(gpu) if not ops or "lowrank_decode" in ops else []  # fbd0532's lowrank_decode
        rows += calibration.check_measured(gpu, [r for r in calibration.measured() if not ops or r["op"] in ops])
        if rows:
            out["calibration"] = rows
    out["tables"] = _tables(out)
    return out


# Shape fields that may be 0: the uncompressed tail, the default split count, rows taken from the end.
MAY_BE_ZERO = {"dense", "splits", "spread"}


def _check_number(name: str, value, default) -> None:
    """A --shape number: a share lies in [0, 1]; a count is a whole number,
    at least 1 (0 where MAY_BE_ZERO)."""
    if isinstance(default, float):
        if not 0 <= value <= 1:
            raise ValueError(f"--shape: {name} is a share of the tokens, in [0, 1]; got {value}")
        return
    if value != int(value):
        raise ValueError(f"--shape: {name} must be a whole number, got {value}")
    least = 0 if name in MAY_BE_ZERO else 1
    if value < least:
        raise ValueError(f"--shape: {name} must be at least {least}, got {value:g}")


def _check_configs(configs: dict[str, set[str]], launched: list[str], tuned: dict[str, dict[str, list[str]]]) -> None:
    """Each --config names a config of an autotuned kernel the
    implementations launch (tuned: each such kernel's config labels, per op
    that launches it). A kernel of one name in several ops must have the
    config in each: where one lacks it, nothing of that kernel would be
    estimated for that op."""
    for kernel, labels in sorted(configs.items()):
        if kernel in tuned:
            for op, have in sorted(tuned[kernel].items()):
                where, pick = (kernel, "") if len(tuned[kernel]) == 1 else (
                    f"{op}'s {kernel}", f"; {' and '.join(sorted(tuned[kernel]))} each launch a {kernel}: name the "
                                        f"op the config is for with --op")
                for label in sorted(labels - set(have)):
                    raise ValueError(f"--config: {where} has no config {label!r}{closest(label, have)} "
                                     f"(its configs: {', '.join(have)}){pick}")
        elif kernel in launched:
            raise ValueError(f"--config: {kernel} is not autotuned: its one launch config is always estimated "
                             f"(autotuned: {', '.join(sorted(tuned)) or 'none'})")
        else:
            raise ValueError(f"--config: {kernel!r} is no kernel the implementations estimated launch"
                             f"{closest(kernel, launched)} (launched: {', '.join(launched)}; autotuned: "
                             f"{', '.join(sorted(tuned)) or 'none'})")


ESTIMATE_COLUMNS = (
    Column("op", "", "the op (kernels_py/ops/<op>)"),
    Column("implementation", "", "the launches of one call, in order", "implementation"),
    Column("batch", "", "sequences"),
    Column("tokens", "", "cached tokens per sequence"),
    Column("optimistic_ms", "ms", "co-resident programs hide each other's waits fully", "optimistic"),
    Column("conservative_ms", "ms", "their exposed waits serialize (targets are judged here)", "conservative"),
    Column("bound", "", "what sets the conservative end: memory, tensor, issue, load/store, special or latency"),
    Column("hbm_pct", "%", "bytes the call moves / conservative time, as a share of the HBM peak", "% HBM"),
    Column("speedup_conservative", "x", "FlashAttention decode over the uncompressed cache (its bytes at the most "
           "of the HBM peak a streaming kernel sustained) / conservative time", "vs FA (cons.)"),
    Column("speedup_optimistic", "x", "the same at the optimistic time", "vs FA (opt.)"),
    Column("ideal_ms", "ms", "the bytes/FLOPs roofline (model.py): what the peaks would allow", "ideal"),
    Column("instructions_per_token", "", "warp-instructions issued per cached token, all launches", "instr/token"),
    Column("picked", "", "the configs the autotuner is predicted to choose (smallest band); \"not autotuned\" "
           "where every kernel has one config", "configs"),
)
CONFIG_COLUMNS = (
    Column("kernel", "", "the @triton.jit kernel"),
    Column("config", "", "tile, warps, stages"),
    Column("registers", "", "registers per thread", "regs"),
    Column("spill_bytes", "", "bytes spilled per thread (ptxas -v)", "spill"),
    Column("ctas_per_sm", "", "resident programs per SM", "CTA/SM"),
    Column("waves", "", "programs / (SMs x CTAs per SM)"),
    Column("instructions_per_token", "", "warp-instructions per cached token", "instr/tok"),
    Column("mma_pct", "%", "tensor-core instructions among those issued", "MMA %"),
    Column("memory_ms", "ms", "floor: HBM bytes at the peak (the ends read at the sustained shares)", "memory"),
    Column("tensor_ms", "ms", "floor: tensor-core FLOPs at the MMA peak", "tensor"),
    Column("issue_ms", "ms", "floor: warp-instructions at 4 a clock per SM", "issue"),
    Column("lsu_ms", "ms", "floor: load/store pipe at 128 bytes a clock per SM", "ld/st"),
    Column("special_ms", "ms", "floor: special-function units (MUFU: exp2, rcp, sin) at 16 results a clock per SM",
           "sfu"),
    Column("optimistic_ms", "ms", "latency with full overlap, or a floor", "optimistic"),
    Column("conservative_ms", "ms", "latency with serialized waits, or a floor", "conservative"),
    Column("bound", "", "what sets the conservative end"),
    Column("status", "", "picked: the predicted choice; pruned: spills, so the autotuner never tries it"),
)
CLASS_COLUMNS = (
    Column("kernel", "", "the @triton.jit kernel, at its picked config"),
    *(Column(name, "", doc) for name, doc in sass.CLASSES),
)
CALIBRATION_COLUMNS = (
    Column("point", "", "a kernel measured on a GPU (kernels_py/ops/calibration.py)"),
    Column("gpu", "", "where it was measured"),
    Column("commit", "", "the kernels' commit"),
    Column("picked", "", "the configs the estimate predicts the autotuner chose"),
    Column("measured_ms", "ms", "measured time of the call", "measured"),
    Column("optimistic_ms", "ms", "the estimate's optimistic end", "optimistic"),
    Column("conservative_ms", "ms", "the estimate's conservative end", "conservative"),
    Column("optimistic_ratio", "x", "optimistic / measured", "opt/meas"),
    Column("conservative_ratio", "x", "conservative / measured", "cons/meas"),
    Column("inside", "", "whether the band contains the measured time"),
    Column("known_miss", "x", "a miss recorded in calibration.KNOWN_MISSES: measured / conservative then",
           "known miss"),
    Column("stale", "", "the kernels compile to other code than the one measured: the point holds for none of "
           "today's band (re-measure with `workbench bench`)"),
)


def _tables(report: dict) -> list[dict]:
    out = []
    for res in report["estimates"]:
        s = res["shape"]
        rows, configs, classes, notes = [], [], [], []
        tokens = s.get("visual", s.get("context", 0)) + s.get("dense", 0)
        for band in res["implementations"]:
            rows.append({"op": res["op"], "implementation": band["implementation"], "batch": s.get("batch"),
                         "tokens": tokens, "optimistic_ms": band["optimistic_us"] / 1e3,
                         "conservative_ms": band["conservative_us"] / 1e3, "bound": band["bound"],
                         "hbm_pct": 100 * band["hbm_share_conservative"],
                         "speedup_conservative": band["speedup_conservative"],
                         "speedup_optimistic": band["speedup_optimistic"],
                         "ideal_ms": band["ideal_us"] / 1e3 if band.get("ideal_us") else None,
                         "instructions_per_token": band["instructions_per_token"],
                         "picked": "; ".join(f"{k['kernel']} {k['picked']}" for k in band["kernels"]
                                             if k["autotuned"]) or "not autotuned"})
            for k in band["kernels"]:
                for c in k["configs"]:
                    if "error" in c:
                        configs.append({"kernel": k["kernel"], "config": c["config"], "status": "error"})
                        continue
                    configs.append({
                        "kernel": k["kernel"], "config": c["config"], "registers": c["registers"],
                        "spill_bytes": c["spill_bytes"], "ctas_per_sm": c["ctas_per_sm"], "waves": c["waves"],
                        "instructions_per_token": c["instructions_per_token"], "mma_pct": 100 * c["mma_share"],
                        "memory_ms": c["floors_us"]["memory"] / 1e3, "tensor_ms": c["floors_us"]["tensor"] / 1e3,
                        "issue_ms": c["floors_us"]["issue"] / 1e3, "lsu_ms": c["floors_us"]["load/store"] / 1e3,
                        "special_ms": c["floors_us"]["special"] / 1e3,
                        "optimistic_ms": c["optimistic_us"] / 1e3, "conservative_ms": c["conservative_us"] / 1e3,
                        "bound": c["conservative_bound"],
                        "status": "pruned" if c.get("pruned") else "picked" if c.get("picked") else ""})
                    if c.get("picked"):
                        per = c["by_class_per_token"]
                        classes.append({"kernel": f"{band['implementation']}: {k['kernel']}",
                                        **{n: round(per.get(n, 0.0), 1) for n in sass.CLASS_NAMES}})
            notes += [f"{band['implementation']}: {f}" for f in band["flags"]]
        shape = ", ".join(f"{k} {v}" for k, v in s.items())
        share = report["gpu"]["hbm_share"]
        out.append({"title": f"{res['op']} ({shape}); FlashAttention over the full cache at {share[0]:.0%} of the "
                             f"HBM peak: {res['flash_us'] / 1e3:.3g} ms (the ends read HBM at {share[0]:.0%} and "
                             f"{share[1]:.0%})", **table(ESTIMATE_COLUMNS, rows), "notes": notes})
        out.append({"title": f"{res['op']}: every config at this shape", **table(CONFIG_COLUMNS, configs)})
        out.append({"title": f"{res['op']}: warp-instructions per token by class, picked configs",
                    **table(CLASS_COLUMNS, classes)})
    if report.get("calibration"):
        out.append({"title": "calibration: estimates of kernels measured on a GPU",
                    **table(CALIBRATION_COLUMNS, report["calibration"])})
    return out


def parse_shape(text: str) -> dict:
    """--shape K=V,... as a dict of numbers, or of words for the fields that
    take one (e.g. partial=keys; estimate_report checks which do)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--shape: {part!r} is not KEY=VALUE")
        if key.strip() in out:  # the later one would silently win
            raise ValueError(f"--shape: {key.strip()} is set twice")
        value = value.strip()
        try:
            number = float(value)
        except ValueError:
            if not value.isidentifier():
                raise ValueError(f"--shape: {key.strip()}={value!r} is neither a number nor a word") from None
            out[key.strip()] = value
            continue
        if not math.isfinite(number):  # the range is the field's (estimate_report checks it)
            raise ValueError(f"--shape: {key.strip()}={value!r} must be a finite number")
        out[key.strip()] = int(number) if number == int(number) else number
    return out


def _has_estimates(op) -> bool:
    return op.model is not None and hasattr(op.model, "ESTIMATES")


def _imports_with_estimates(op) -> bool:
    """_has_estimates, False for an op whose sources do not import (listing
    the others must not fail on it)."""
    try:
        return _has_estimates(op)
    except Exception:  # noqa: BLE001 - an op being edited may not import
        return False


def main(argv=None) -> int:
    from kernels_py.ops import compile as cc

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=int, choices=cc.TARGETS, default=90, help="compute capability (default 90)")
    parser.add_argument("--case", action="append", default=[], help="only this compile case (repeatable)")
    parser.add_argument("--estimate", action="store_true", help="estimate each op's implementations instead")
    parser.add_argument("--shape", default="", help="with --estimate: fields of the ops' shapes, K=V,...")
    parser.add_argument("--op", action="append", default=[],
                        help="only this op: its estimate, or without --estimate its compile cases (repeatable)")
    parser.add_argument("--impl", action="append", default=[],
                        help="with --estimate: only this implementation (repeatable; no calibration)")
    parser.add_argument("--config", action="append", default=[],
                        help="with --estimate: KERNEL:CONFIG, only this config of an autotuned kernel (repeatable; "
                             "no calibration)")
    opts = parser.parse_args(argv)
    try:
        return _run(opts)
    except Exception as err:  # one at a kernels_py line is shown at it, as the workers' are
        from kernels_py.runtime.worker import error_payload

        payload = error_payload(err)
        if not payload.get("at"):
            raise
        json.dump({"failed": payload}, sys.stdout)
        sys.stdout.write("\n")
        return 1


def _run(opts) -> int:
    from kernels_py.ops import compile as cc
    from kernels_py.runtime import interpreter_mode
    from triton import knobs

    if knobs.runtime.interpret or interpreter_mode():
        print("TRITON_INTERPRET is set: unset it to compile for a GPU target", file=sys.stderr)
        return 2
    if opts.estimate:
        from kernels_py.ops import OPS

        for name in opts.op:
            if name not in OPS:
                print(f"--op: {name!r} is unknown{closest(name, OPS)} (known: {', '.join(OPS)})", file=sys.stderr)
                return 2
        for name in opts.op:  # only the ops asked for are imported: another op's broken source is no matter here
            if not _has_estimates(OPS[name]):
                modelled = [op.name for op in OPS.values() if _imports_with_estimates(op)]
                print(f"--op: {name!r} has no estimate: kernels_py/ops/{name}/model.py defines no ESTIMATES "
                      f"(ops with one: {', '.join(modelled)}); kernels report --op {name} without --estimate "
                      f"compiles its kernels", file=sys.stderr)
                return 2
        try:
            result = estimate_report(opts.target, parse_shape(opts.shape), opts.op, impls=opts.impl,
                                     configs=parse_configs(opts.config))
        except ValueError as err:
            print(str(err), file=sys.stderr)
            return 2
        except NoUsableConfig as err:  # the host prints it, the failure at its line as a compile error's
            json.dump({"error": str(err), "at": err.at}, sys.stdout)
            sys.stdout.write("\n")
            return 1
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
        return 0
    known = [c.name for c in cc.cases()]
    for name in opts.case:
        if name not in known:
            print(f"--case: {name!r} is unknown{closest(name, known)} (known: {', '.join(known)})", file=sys.stderr)
            return 2
    from kernels_py.ops import OPS

    # --op NAME: the op's compile cases, beside any --case names.
    names = opts.case + [c.name for name in opts.op for c in OPS[name].cases.COMPILE_CASES if c.name not in opts.case]
    json.dump(report(opts.target, names), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
