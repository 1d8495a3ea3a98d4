"""The performance estimate from compiled code (kernels_py.ops.sass,
source, estimate, report --estimate, calibration).

Unit tests run here; what needs kernels compiled for a GPU target runs in
child processes without TRITON_INTERPRET (as test_cuda_compile.py's do), one
for the small probe kernels of probe_kernels.py and one for the whole
`report --estimate` at sm_90 with the calibration points. The children start
as soon as this module's tests are collected (conftest.py), so they compile
while the rest of the suite runs.
"""

import atexit
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kernels_py.ops import estimate, sass, splitk
from kernels_py.ops.estimate import A100, H100

ROOT = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 1500
_CHILDREN: dict = {}


def _hi(stall=1, write=None, read=None, wait=0) -> str:
    """The high 64 bits of an instruction with this control word."""
    ctl = stall | (7 if write is None else write) << 5 | (7 if read is None else read) << 8 | wait << 11
    return f"0x{ctl << 41:016x}"


def _listing(name: str, body: list[tuple]) -> str:
    """An nvdisasm-like listing (-c -g -hex) of (text, control) lines."""
    lines = [f"//--------------------- .text.{name}      --------------------------", f"{name}:"]
    for k, (text, ctl) in enumerate(body):
        if text.endswith(":"):
            lines.append(text)
            continue
        lines.append(f"        /*{16 * k:04x}*/                   {text} ;    /* 0x{0:016x} */")
        lines.append(f"                                                    /* {_hi(**ctl)} */")
    return "\n".join(lines) + "\n"


def test_control_words_decode_as_ptxas_wrote_them():
    """Stall cycles, the scoreboards an instruction sets and the ones it waits
    on, from the high half of two sm_90 encodings read off nvdisasm -hex."""
    assert sass._control(0x000E700000000800) == (8, 1, None, 0)  # LDC R1: 8 cycles, sets SB1
    assert sass._control(0x004FCC000F8E0004) == (6, None, None, 0b100)  # waits on SB2
    assert sass._control(int(_hi(stall=3, write=2, read=4, wait=0b101), 16)) == (3, 2, 4, 0b101)


@pytest.mark.parametrize("op,cls,width", [
    ("LDG.E.U16", "ldg_narrow", 2), ("LDG.E.128", "ldg_wide", 16), ("LDG.E", "ldg", 4),
    ("LDG.E.64.CONSTANT", "ldg_wide", 8), ("LDGSTS.E.BYPASS.128", "cp_async", 16), ("STG.E.128", "stg", 16),
    ("LDSM.16.M88.4", "shared", 16), ("STS.U16", "shared", 2), ("LDL", "local", 4), ("HMMA.16816.F32", "mma", 4),
    ("HGMMA.64x32x16.F32", "mma", 4), ("FFMA", "fp", 4), ("HFMA2.MMA", "fp", 4), ("MUFU.EX2", "mufu", 4),
    ("F2FP.F16.F32.PACK_AB", "convert", 4), ("IMAD.WIDE", "int", 4), ("LOP3.LUT", "int", 4),
    ("ULDC.64", "uniform", 8), ("S2R", "uniform", 4), ("BAR.SYNC.DEFER_BLOCKING", "sync", 4),
    ("WARPGROUP.DEPBAR.LE", "sync", 4), ("DEPBAR.LE", "sync", 4), ("SHFL.BFLY", "shuffle", 4),
    ("BRA", "control", 4), ("UTMALDG.2D", "tma", 4),
])
def test_classes_and_widths(op, cls, width):
    assert sass.classify(op) == cls
    assert sass.access_bytes(op) == width


def test_mma_flops_per_warp_instruction():
    """An HMMA is one warp's m16n8k16 (k8 for tf32); an HGMMA a warpgroup's
    64 x N x 16, a quarter of it per warp."""
    assert sass.mma_flops("HMMA.16816.F32", "") == (2 * 16 * 8 * 16, "f16")
    assert sass.mma_flops("HMMA.1688.F32.TF32", "") == (2 * 16 * 8 * 8, "tf32")
    assert sass.mma_flops("HGMMA.64x32x16.F32", "") == (2 * 64 * 32 * 16 / 4, "f16")


@pytest.mark.parametrize("gpu,regs,warps,smem,want", [
    (H100, 255, 8, 49152, (1, "registers")),  # 256 a thread x 256 threads = all 64K
    (H100, 168, 4, 40960, (3, "registers")),  # 5,376 a warp x 4 = 21,504: 3 fit
    (H100, 32, 4, 0, (16, "registers")),  # 16 by registers and by warps alike; registers named
    (H100, 16, 1, 0, (32, "blocks")),  # at most 32 programs an SM
    (H100, 32, 4, 100000, (2, "shared memory")),  # 233,472 // (100,000 + 1,024)
    (H100, 24, 16, 0, (4, "warps")),  # 64 warps an SM
    (A100, 128, 4, 80000, (2, "shared memory")),  # A100: 164 KB
])
def test_ctas_per_sm(gpu, regs, warps, smem, want):
    assert estimate.ctas_per_sm(regs, warps, smem, gpu) == want


def test_waves():
    full, last = estimate.waves(3648, 1)  # fused decode at batch 64: 57 splits of 64 programs
    assert full == pytest.approx(3648 / 132) and last == pytest.approx(3648 / 132 - 27)
    assert estimate.waves(264, 2) == (1.0, 1.0)


def test_dispatch_hands_each_program_to_the_sm_that_frees_first():
    """Launch order: the first wave breadth-first, one program an SM in turn;
    then each program to the SM with the least work so far."""
    one = estimate.dispatch([300], [1.0], 132, 2)
    assert max(h[0] for h in one) == 3 and sum(h[0] for h in one) == 300
    # Two long programs on 124 SMs and one on 8 (256), then 64 short ones:
    # the 8 SMs with room take them all (8 of them in the first wave).
    held = estimate.dispatch([256, 64], [10.0, 1.0], 132, 2)
    assert sorted(set(held)) == [(1, 8), (2, 0)]
    # Launched the other way round, the short ones take an SM each first,
    # and 56 SMs end with two long ones after a short one.
    back = estimate.dispatch([64, 256], [1.0, 10.0], 132, 2)
    assert sorted(set(back)) == [(0, 2), (1, 1), (1, 2)] and back.count((1, 2)) == 56
    # Interleaved classes, a long and a short program in turn: the first wave
    # (two an SM) gives SM i programs i and i + 132, both of one class.
    mixed = estimate.dispatch([132, 132], [10.0, 1.0], 132, 2, interleaved=True)
    assert sorted(set(mixed)) == [(0, 2), (2, 0)]
    # One an SM: the SMs that free first keep taking the next programs.
    assert max(10 * a + b for a, b in estimate.dispatch([132, 132], [10.0, 1.0], 132, 1, interleaved=True)) == 18


def _scale_profiles(monkeypatch):
    """Make each program class's profile `values["n"]` times its kernel's:
    its timeline, instructions and waits."""
    import dataclasses

    real = estimate.profile

    def scaled(kernel, values, levels, gpu=H100):
        prof, notes = real(kernel, values, levels, gpu)
        n = values["n"]
        return dataclasses.replace(prof, cycles=prof.cycles * n, instructions=prof.instructions * n,
                                   waits={k: v * n for k, v in prof.waits.items()}), notes

    monkeypatch.setattr(estimate, "profile", scaled)


def test_short_programs_after_long_ones_are_charged_as_dispatched(monkeypatch):
    """A grid of two classes (the masses' spans, then their dense columns)
    costs the busiest SM's programs, not every SM's mean share rounded up
    to whole programs of each class."""
    _scale_profiles(monkeypatch)
    k = _kernel([("FADD R3, R2, R2", {"stall": 15}), ("EXIT", {"stall": 1})])

    def latency(*classes):
        work = estimate.Work(tuple(estimate.Programs(c, {"n": n}) for c, n in classes), 0.0)
        return estimate.estimate(k, work, warps=4, registers=32, shared=0).latency_us["conservative"]

    per = latency((1, 1))
    slots = estimate.ctas_per_sm(32, 4, 0)[0] * H100.sms
    assert latency((slots, 10)) == pytest.approx(10 * per * slots / H100.sms)
    # Half an SM's worth of short programs after a full grid of long ones:
    # one more short program on half the SMs, not 1.5x of every SM's share.
    assert latency((slots, 10), (H100.sms // 2, 1)) == pytest.approx((10 * slots / H100.sms + 1) * per)


def test_no_sm_is_done_before_its_longest_program(monkeypatch):
    """A long program that waits on memory, beside short ones on its SM:
    sharing its waits with them cannot make the SM finish before the long
    program's own timeline does."""
    _scale_profiles(monkeypatch)
    k = _kernel([("LDG.E R2, desc[UR4][R2.64]", {"stall": 1, "write": 0}),
                 ("FADD R3, R2, R2", {"stall": 4, "wait": 0b1}),
                 ("EXIT", {"stall": 1})])
    work = estimate.Work((estimate.Programs(H100.sms, {"n": 10}), estimate.Programs(H100.sms, {"n": 1})), 0.0)
    est = estimate.estimate(k, work, warps=4, registers=32, shared=0)
    assert est.ctas_per_sm >= 2
    assert est.latency_us["conservative"] == pytest.approx(10 * (H100.latency["hbm"] + 5) / H100.clock_hz * 1e6)
    assert est.optimistic_us <= est.conservative_us


def test_split_helpers_match_the_stage1_kernels():
    """split_ranges rounds splits to whole tiles as the kernels do: 32,832
    tokens in 64 splits of 64-token tiles are 57 splits of 576 tokens and 7
    empty ones; split_count is the launchers' rule."""
    ranges = splitk.split_ranges(32832, 64, 64)
    assert len(ranges) == 64 and ranges[0] == (0, 576) and ranges[56] == (32256, 32832)
    assert sum(1 for lo, hi in ranges if lo == hi) == 7
    from kernels_py.ops.lowrank_decode import kernel as lowrank

    # On a GPU, the count whose waves take least. The absorbed kernel (two
    # programs an SM, 264 of 132 SMs): 8 sequences of 256 tiles fill one
    # wave with 32 splits of 8 tiles (33, the old rule's, left one split
    # empty: 33 of 8 tiles cover 264).
    assert lowrank.split_count(32768, 8, 132, absorbed=True) == 32
    # 64 sequences: one wave of 4 splits of 64 tiles (cost 65) before two
    # waves of 8 of 32 (2 x 33 = 66); 257 tiles split in 4 of 65.
    assert lowrank.split_count(32768, 64, 132, absorbed=True) == 4
    assert lowrank.split_count(32832, 64, 132, absorbed=True) == 4
    # 5 splits of 52 tiles would spill 56 programs into a second wave.
    assert lowrank.split_count(32832, 64, 132, absorbed=True) * 64 <= 264
    # The fused kernel holds one program an SM: one wave of 16 splits of 16
    # tiles (cost 17) before two of 32 splits of 8 (2 x 9 = 18), which pay
    # a split's fixed cost twice; at 64 sequences 2 splits of 128 tiles.
    assert lowrank.split_count(32768, 8, 132, absorbed=False) == 16
    assert lowrank.split_count(32768, 64, 132, absorbed=False) == 2
    for absorbed in (False, True):
        assert lowrank.split_count(32768, 1, 132, absorbed=absorbed) == 128  # one sequence: at most DEFAULT_MAX_SPLITS
        assert lowrank.split_count(1088, 1, 132, absorbed=absorbed) == 9  # never more splits than tiles: 9 of one
        assert lowrank.split_count(0, 8, 132, absorbed=absorbed) == 1
        assert lowrank.split_count(1088, 1, None, absorbed=absorbed) == 2  # the interpreter: cdiv(1088, 1024)
        for t in (100, 1088, 5000, 32768, 32832, 120_000):
            for b in (1, 3, 8, 17, 64, 200):
                n = lowrank.split_count(t, b, 132, absorbed=absorbed)
                assert 1 <= n <= lowrank.DEFAULT_MAX_SPLITS
                assert all(lo < hi for lo, hi in splitk.split_ranges(t, n, lowrank.SPLIT_TILE)), (t, b, n)  # none empty


def test_the_statistics_split_their_keys_for_the_gpu_estimated():
    """The row pass's key splits are the launcher's on the GPU estimated: on
    an A100 (108 SMs) batch 8's 128 row-tile programs take 4 splits, where an
    H100's 132 SMs give 5."""
    from kernels_py.ops.attention_stats import kernel, model

    step = model.Step(batch=8, context=32768)
    for gpu, want in ((H100, 5), (A100, 4)):
        work = model._work(step, "_merge_rows_kernel", {}, gpu)
        assert work.programs[0].values["n_splits"] == want == kernel.key_split_count(32768, 128, 128, gpu.sms)


def _kernel(body, loads=None) -> estimate.Kernel:
    k = estimate.Kernel("probe", b"", {}, {}, listing=_listing("probe", body))
    if loads:
        k.loads.update(loads)
    return k


def test_the_timeline_replays_stalls_and_scoreboards():
    """A load sets scoreboard 0, released after the latency of its memory
    level; the add waits on it; stall cycles separate issues; a barrier costs
    BARRIER cycles; a cp.async group is waited on by DEPBAR."""
    lat = H100.latency
    k = _kernel([("LDG.E R2, desc[UR4][R2.64]", {"stall": 1, "write": 0}),
                 ("FADD R3, R2, R2", {"stall": 4, "wait": 0b1}),
                 ("EXIT", {"stall": 1})])
    prof, _ = estimate.profile(k, {}, {})
    assert prof.cycles == lat["hbm"] + 4 + 1  # issues at 0, the add at hbm, EXIT 4 later, then 1
    assert prof.waits == {"global loads": lat["hbm"] - 1}
    assert prof.instructions == 3 and prof.by_class["ldg"] == 1 and prof.by_class["fp"] == 1
    # An argument the model puts in L2 is served at the L2 latency.
    k = _kernel([("LDG.E R2, desc[UR4][R2.64]", {"stall": 1, "write": 0}),
                 ("FADD R3, R2, R2", {"stall": 1, "wait": 0b1})],
                loads={0: estimate.LoadInfo(frozenset({"W"}), frozenset())})
    assert estimate.profile(k, {}, {"W": "l2"})[0].cycles == lat["l2"] + 1
    k = _kernel([("LDGSTS.E.BYPASS.128 [R5], desc[UR4][R2.64]", {"stall": 2}),
                 ("LDGDEPBAR", {"stall": 1, "write": 0}),
                 ("DEPBAR.LE SB0, 0x0", {"stall": 1}),
                 ("BAR.SYNC.DEFER_BLOCKING 0x0", {"stall": 1}),
                 ("EXIT", {"stall": 1})])
    prof, _ = estimate.profile(k, {}, {})
    assert prof.cycles == lat["hbm"] + lat["barrier"] + 3  # DEPBAR, BAR and EXIT issue a cycle each
    assert prof.waits["cp.async"] == lat["hbm"] - 3 and prof.waits["barriers"] == lat["barrier"]


def test_every_kind_of_warpgroup_mma_is_waited_on():
    """An fp8 or int8 wgmma (QGMMA, IGMMA) takes the tensor cores as long as
    its FLOPs at its kind's rate, and WARPGROUP.DEPBAR waits for its group,
    as for an fp16 one (HGMMA): the fp8 one's 64 x 64 x 32 at twice the fp16
    rate takes as long as the fp16 64 x 64 x 16."""
    lat = H100.latency
    cycles = {}
    for op in ("HGMMA.64x64x16.F32", "QGMMA.64x64x32.F32.E4M3.E4M3", "IGMMA.64x64x32.S32.S8.S8"):
        k = _kernel([(f"{op} R24, gdesc[UR4], RZ, !UPT, gsb0", {"stall": 1}),
                     ("WARPGROUP.DEPBAR.LE gsb0, 0x0", {"stall": 1}),
                     ("EXIT", {"stall": 1})])
        prof, _ = estimate.profile(k, {}, {})
        cycles[op.split(".")[0]] = prof.cycles
        assert prof.waits["wgmma"] > 0, op
    assert cycles["HGMMA"] == 64 / 2 + lat["wgmma"] + 1 + 1
    assert cycles["QGMMA"] == cycles["IGMMA"] == cycles["HGMMA"]
    # An int8 mma.sync holds the tensor pipe like an fp16 one: the second waits.
    k = _kernel([("IMMA.16832.S32.S8.S8 R4, R8, R12, R4", {"stall": 1}),
                 ("IMMA.16832.S32.S8.S8 R16, R8, R12, R16", {"stall": 1}),
                 ("EXIT", {"stall": 1})])
    assert estimate.profile(k, {}, {})[0].waits.get("tensor pipe", 0) > 0


def test_memory_waits_overlap_only_across_programs_an_sm_holds():
    """The conservative end overlaps memory waits across co-resident
    programs: a grid smaller than the GPU has one program per SM, so
    nothing overlaps and the band stays ordered (optimistic <= conservative);
    a full grid overlaps them by the CTAs an SM holds."""
    k = _kernel([("LDG.E R2, desc[UR4][R2.64]", {"stall": 1, "write": 0}),
                 ("FADD R3, R2, R2", {"stall": 4, "wait": 0b1}),
                 ("EXIT", {"stall": 1})])
    one_each = estimate.estimate(k, estimate.Work((estimate.Programs(64, {}),), 0.0), warps=4, registers=32,
                                 shared=0)
    cycles = H100.latency["hbm"] + 5
    assert one_each.latency_us["conservative"] == pytest.approx(cycles / H100.clock_hz * 1e6)
    assert one_each.optimistic_us <= one_each.conservative_us
    per_sm = one_each.ctas_per_sm
    full = estimate.estimate(k, estimate.Work((estimate.Programs(H100.sms * per_sm, {}),), 0.0), warps=4,
                             registers=32, shared=0)
    waited = H100.latency["hbm"] - 1
    assert full.latency_us["conservative"] == pytest.approx(
        per_sm * (cycles - waited + waited / per_sm) / H100.clock_hz * 1e6)


def test_special_functions_have_a_floor_of_their_own():
    """A MUFU issues in one cycle but the SM's special-function units finish
    16 results a clock: a kernel of exp2s is bound by them, not by issue."""
    k = _kernel([("MUFU.EX2 R3, R2", {"stall": 1}), ("MUFU.EX2 R4, R2", {"stall": 1}), ("EXIT", {"stall": 1})])
    assert estimate.count(k, {}).special_cycles == 2 * 32 / H100.special_per_clock
    est = estimate.estimate(k, estimate.Work((estimate.Programs(64 * H100.sms, {}),), 0.0), warps=4, registers=32,
                            shared=0)
    warps_per_sm = 64 * 4
    assert est.floors_us["special"] == pytest.approx(warps_per_sm * 2 * 2 / H100.clock_hz * 1e6)
    # Per warp: 4 special-function cycles against 3 issue slots shared by 4 schedulers.
    assert est.floors_us["special"] == pytest.approx(est.floors_us["issue"] * 4 / (3 / 4))
    assert est.optimistic_bound == "special"


def test_a_loop_runs_its_steady_state_times_its_trips():
    """A loop with no source loop counts once and says so."""
    k = _kernel([(".L_x_0:", {}), ("FADD R3, R2, R2", {"stall": 5}), ("@P0 BRA `(.L_x_0)", {"stall": 1}),
                 ("EXIT", {"stall": 1})])
    assert len(k.sass.loops) == 1
    trips, notes = k.trips({})
    assert list(trips.values()) == [1.0] and "no source loop" in notes[0]


def test_trips_the_model_gives_are_shared_among_the_unrolled_copies():
    """Trips a model gives a loop directly (values["#start"]) are the source
    loop's: a copy unrolled twice runs half of them and its remainder loop
    the odd one, as trips evaluated from the source are; a second version
    of the loop runs none."""
    import ast
    from types import SimpleNamespace

    k = _kernel([(".L_x_0:", {}), ("FADD R3, R2, R2", {"stall": 5}), ("@P0 BRA `(.L_x_0)", {"stall": 1}),
                 ("EXIT", {"stall": 1})])
    source = SimpleNamespace(node=ast.parse("for start in range(lo, hi, 64):\n    pass").body[0])
    (header,) = k.loops
    for copy, want in ((dict(unroll=2), 3), (dict(remainder=2), 1), (dict(version=True), 0), ({}, 7)):
        k.loops[header] = estimate.LoopInfo(k.loops[header].loop, source, **copy)
        assert k.trips({"#start": 7})[0][header] == want, copy


def test_prune_spilling_keeps_the_configs_that_do_not_spill():
    import triton

    from kernels_py.ops import common

    configs = [triton.Config({"BLOCK_N": n}, num_warps=w) for n, w in ((32, 8), (64, 4), (64, 8), (128, 8))]
    spill = {(64, 4): 212, (128, 8): 148}
    prune = common.prune_spilling(None, lambda c, args, consts: spill.get((c.kwargs["BLOCK_N"], c.num_warps), 0))
    assert [(c.kwargs["BLOCK_N"], c.num_warps) for c in prune(configs, {})] == [(32, 8), (64, 8)]
    # If every config spills, the one spilling least is kept.
    prune = common.prune_spilling(None, lambda c, args, consts: c.kwargs["BLOCK_N"])
    assert [c.kwargs["BLOCK_N"] for c in prune(configs, {})] == [32]


def test_prune_spilling_compiles_with_the_keywords_the_autotuner_passes():
    """Triton's autotuner calls the pruner with the launch's keywords, its own
    `grid` and `warmup` among them. The compile that counts spills gets only
    the constexprs and the config: with `grid` twice it failed, every count
    read 0 and no spilling config was ever pruned on a GPU."""
    import triton

    from kernels_py.ops import common

    class Compiled:
        def __init__(self, spills):
            self.n_spills = spills

        def _init_handles(self):
            pass

    class Kernel:
        __name__ = "fake"
        arg_names = ["X", "n", "BLOCK", "GROUP"]

        def __init__(self):
            self.calls = []

        def warmup(self, *args, grid, **kwargs):
            self.calls.append((args, grid, kwargs))
            return Compiled(96 if kwargs["BLOCK"] == 128 else 0)

    kernel = Kernel()
    configs = [triton.Config({"BLOCK": b}, num_warps=4) for b in (64, 128)]
    kept = common.prune_spilling(kernel)(configs, {"X": "x", "n": 7}, grid=(3, 1, 1), warmup=False, GROUP=4)
    assert [c.kwargs["BLOCK"] for c in kept] == [64]
    args, grid, kwargs = kernel.calls[0]
    assert args == ("x", 7) and grid == (1,) and "warmup" not in kwargs and kwargs["GROUP"] == 4

    class Broken(Kernel):
        def warmup(self, *args, grid, **kwargs):
            raise RuntimeError("no driver")

    with pytest.warns(RuntimeWarning, match="fake: a config's spills could not be counted"):
        assert len(common.prune_spilling(Broken())(configs, {"X": "x", "n": 7}, grid=(1,), warmup=False)) == 2


def test_shapes_are_parsed_with_clear_errors():
    from kernels_py.ops import report

    assert report.parse_shape("batch=16, visual=8192") == {"batch": 16, "visual": 8192}
    assert report.parse_shape("hi_share=0.5") == {"hi_share": 0.5}
    assert report.parse_shape("partial=keys,low_share=0.75") == {"partial": "keys", "low_share": 0.75}
    for bad, msg in (("batch", "not KEY=VALUE"), ("batch=2 4", "neither a number nor a word"),
                     ("batch=inf", "must be a finite number"), ("batch=8,batch=16", "batch is set twice")):
        with pytest.raises(ValueError, match=msg):
            report.parse_shape(bad)
    # Checked against the fields before anything compiles: a negative count is refused as 0 is, by its least value.
    for shape, msg in (({"batch": "lots"}, "batch must be a number, got 'lots'"),
                       ({"batch": -1}, "batch must be at least 1, got -1"),
                       ({"low_share": -0.5}, r"low_share is a share of the tokens, in \[0, 1\]"),
                       ({"partial": 1}, "partial must be a word"),
                       ({"partial": "key"}, "partial must be one of values, keys, both, got 'key'"),
                       ({"elem_bytes": 3}, "elem_bytes must be one of 2, 4, got 3")):
        with pytest.raises(ValueError, match=msg):
            report.estimate_report(90, report.parse_shape(",".join(f"{k}={v}" for k, v in shape.items())),
                                   ["lowrank_decode"])
    for shape, msg in (("granularity=channel", "granularity must be one of tensor, head, token, got 'channel'"),
                       ("fmt=e4m4", "fmt must be one of e4m3, e5m2, got 'e4m4'")):
        with pytest.raises(ValueError, match=msg):
            report.estimate_report(90, report.parse_shape(shape), ["fp8_decode"])
    # The quantized cache's widths and groups are the codec's (the field the user set is named, not the codec's).
    for shape, msg in (("hi_bits=3", "--shape: hi_bits must be one of 2, 4, got 3"),
                       ("lo_bits=8", "--shape: lo_bits must be one of 2, 4, got 8"),
                       ("group=48", "--shape: group must be one of 32, 64, 128, got 48")):
        with pytest.raises(ValueError, match=msg):
            report.estimate_report(90, report.parse_shape(shape), ["quant_decode"])
    # A cache no GPU of the target holds is refused before anything is built for it (batch=1e20 ran out of memory).
    with pytest.raises(ValueError, match=r"batch=100000000000000000000 gather_decode's full cache is .* GB, more than "
                                         r"the H100 SXM's 80 GB"):
        report.estimate_report(90, report.parse_shape("batch=1e20"), ["gather_decode"])
    with pytest.raises(ValueError, match=r"context=100000000 attention_stats's full cache"):
        report.estimate_report(90, {"context": 10**8}, ["attention_stats"])


# ----------------------------------------------------------------------------
# Compiled for a GPU target, in child processes
# ----------------------------------------------------------------------------


def _missing_toolchain() -> str | None:
    from triton.backends import backends

    return None if "nvidia" in backends else "the installed Triton has no CUDA backend"


def start_children() -> None:
    """Start the compiling children once (conftest.py calls this after
    collection; the fixtures call it again, which does nothing)."""
    if _CHILDREN or _missing_toolchain():
        return
    tmp = Path(tempfile.mkdtemp(prefix="vlkv-estimate-"))
    env = _child_env()
    jobs = {"probe90": ["-m", "kernels_py.tests.probe_kernels", "--target", "90"],
            "probe80": ["-m", "kernels_py.tests.probe_kernels", "--target", "80"],
            "report": ["-m", "kernels_py.ops.report", "--target", "90", "--estimate"],
            "one_config": ["-m", "kernels_py.ops.report", "--target", "90", "--estimate", "--op", "lowrank_decode",
                           "--shape", "batch=8", "--impl", ONE_IMPL, "--config", ONE_CONFIG]}
    for name, args in jobs.items():
        out = open(tmp / f"{name}.json", "w+")
        err = open(tmp / f"{name}.log", "w+")
        child = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=out, stderr=err,
                                 env=dict(env, TRITON_CACHE_DIR=str(tmp / f"cache-{name}")))
        _CHILDREN[name] = (child, out, err)
    atexit.register(_stop_children, tmp)


def _child_env() -> dict:
    """A compiling child's environment: no interpreter, the checkout importable."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _stop_children(tmp: Path):
    for child, out, err in _CHILDREN.values():
        if child.poll() is None:
            child.kill()
            child.wait()
        out.close()
        err.close()
    # The children's Triton caches hold about 100 MB of compiled kernels.
    shutil.rmtree(tmp, ignore_errors=True)


def _result(name: str) -> dict:
    reason = _missing_toolchain()
    if reason:
        pytest.skip(reason)
    start_children()
    child, out, err = _CHILDREN[name]
    try:
        child.wait(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        pytest.fail(f"{name} took over {CHILD_TIMEOUT_S} s")
    err.seek(0)
    out.seek(0)
    if child.returncode != 0:
        pytest.fail(f"{name} failed (exit {child.returncode}):\n{err.read()[-4000:]}")
    return json.loads(out.read())


@pytest.fixture(scope="module")
def report():
    return _result("report")


ONE_IMPL = "absorbed (latent), no mass"
ONE_CONFIG = "_stage1_absorbed_kernel:BLOCK_N=64 w4 s2"


def test_one_implementation_at_one_config_estimates_as_the_whole_report(report):
    """--impl and --config (the quick loop while editing a kernel) compile
    only that implementation and that config, which is then the pick, and
    leave the calibration out; the config's estimate is the one the whole
    report gives it."""
    got = _result("one_config")
    assert "calibration" not in got
    kernel, config = ONE_CONFIG.split(":")
    for entry in got["estimates"]:
        assert entry["op"] == "lowrank_decode" and entry["shape"]["batch"] == 8
        (impl,) = entry["implementations"]
        assert impl["implementation"] == ONE_IMPL
        (stage1,) = [k for k in impl["kernels"] if k["kernel"] == kernel]
        assert stage1["picked"] == config and [c["config"] for c in stage1["configs"]] == [config]
        (full,) = [i for e in report["estimates"] if e["op"] == "lowrank_decode" and e["shape"]["batch"] == 8
                   for i in e["implementations"] if i["implementation"] == ONE_IMPL]
        (row,) = [c for k in full["kernels"] if k["kernel"] == kernel for c in k["configs"] if c["config"] == config]
        assert stage1["configs"][0]["conservative_us"] == pytest.approx(row["conservative_us"], rel=1e-9)
        assert stage1["configs"][0]["optimistic_us"] == pytest.approx(row["optimistic_us"], rel=1e-9)


def test_implementations_and_configs_are_checked():
    from kernels_py.ops import report as rp

    assert rp.parse_configs(["_k:BLOCK_N=64  w4 s2", "_k:w8 s3"]) == {"_k": {"BLOCK_N=64 w4 s2", "w8 s3"}}
    assert rp.key_label([[("BLOCK_N", 64)], 4, 2]) == "BLOCK_N=64 w4 s2"
    assert rp.key_label([[("TILE", 128)], 4, 1, 168]) == "TILE=128 w4 s1 r168"
    with pytest.raises(ValueError, match="is not KERNEL:CONFIG"):
        rp.parse_configs(["_stage1_kernel"])
    # Checked before anything compiles.
    with pytest.raises(ValueError, match=r"--impl: 'fused' is no implementation .*'fused \(exact\)'"):
        rp.estimate_report(90, {}, ["lowrank_decode"], impls=["fused"])


def test_configs_are_checked_before_compiling():
    """A --config naming a kernel the implementations do not launch, one
    that is not autotuned or a config it does not have is refused from the
    recorded launches, with what there is, before anything compiles."""
    reason = _missing_toolchain()
    if reason:
        pytest.skip(reason)
    env = _child_env()
    for config, msg in (("_stage1_kernel:BLOCK_N=96 w8 s3", "_stage1_kernel has no config 'BLOCK_N=96 w8 s3' "
                         "(did you mean 'BLOCK_N=64 w8 s3'?) (its configs: BLOCK_N=64 w8 s2, "),
                        ("_merge_rank_kernel:w4 s3", "_merge_rank_kernel is not autotuned"),
                        ("_stage1_absorbed_kernel:BLOCK_N=64 w4 s2", "is no kernel the implementations estimated "
                         "launch (did you mean '_stage1_kernel'?)")):
        done = subprocess.run([sys.executable, "-m", "kernels_py.ops.report", "--estimate", "--op", "lowrank_decode",
                               "--impl", "fused (exact)", "--config", config], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and msg in done.stderr and not done.stdout, (config, done.stderr)


def test_a_config_is_checked_in_every_op_that_launches_a_kernel_of_its_name():
    """quant_decode and fp8_decode both launch a _stage1_kernel: fp8's config
    is none of quant's, which had nothing left to estimate and was said not
    to compile. It is refused before compiling, naming the op."""
    reason = _missing_toolchain()
    if reason:
        pytest.skip(reason)
    done = subprocess.run([sys.executable, "-m", "kernels_py.ops.report", "--estimate", "--op", "quant_decode",
                           "--op", "fp8_decode", "--shape", "batch=8", "--config", "_stage1_kernel:BLOCK_N=128 w4 s2"],
                          cwd=ROOT, env=_child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and not done.stdout, done.stderr
    assert "--config: quant_decode's _stage1_kernel has no config 'BLOCK_N=128 w4 s2'" in done.stderr
    assert "fp8_decode and quant_decode each launch a _stage1_kernel: name the op the config is for with --op" \
        in done.stderr


@pytest.mark.parametrize("target", [90, 80])
def test_probe_kernels_count_what_they_issue(target):
    """Known kernels: a loop of 64 iterations issuing one 16-byte load a
    thread each (unrolled 4x by the compiler, its remainder peeled beside
    the loop: still 64), the same over every other element (8 scalar 16-bit
    loads an iteration), a helper inlined at two call sites with other
    bounds (4 and 3 iterations), and a matmul whose tensor-core FLOPs are
    exactly 2 M N K (wgmma on sm_90, mma.sync on sm_80)."""
    from kernels_py.tests import probe_kernels as pk

    got = _result(f"probe{target}")
    trips = pk.N // pk.BLOCK
    wide, strided, two, mma = (got[k] for k in ("_wide_load_kernel", "_strided_load_kernel", "_two_ranges_kernel",
                                                "_mma_kernel"))
    assert wide["by_class"]["ldg_wide"] == trips and wide["by_class"]["ldg_narrow"] == 0
    assert strided["by_class"]["ldg_narrow"] == 8 * trips and strided["by_class"]["ldg_wide"] == 0
    assert two["by_class"]["ldg_wide"] == 4 + 3  # whatever the compiler unrolled and peeled
    assert [lp["occurrence"] for lp in two["loops"]] == [0, 1]
    m = pk.MMA
    assert mma["tensor_flops"] == 2 * m["M"] * m["N"] * m["K"]
    per_warp_mma = m["K"] // 16 if target == 90 else (m["M"] // 16) * (m["N"] // 8) * (m["K"] // 16) // 4
    assert mma["by_class"]["mma"] == per_warp_mma
    assert mma["loads"] == ["A", "B"] and wide["loads"] == ["X"]
    for name, k in got.items():  # a warp's timeline is at least one cycle per instruction
        if name != "compile_error":
            assert k["cycles"] >= k["instructions"] > 0


@pytest.mark.parametrize("target", [90, 80])
def test_a_kernel_that_does_not_compile_is_reported_at_its_line(target):
    """What `kernels report` prints of a compile error (and exits 1 on):
    the kernel's file:line, the compiler's message and the line itself."""
    import inspect

    from kernels_py.tests import probe_kernels as pk

    err = _result(f"probe{target}")["compile_error"]
    lines, first = inspect.getsourcelines(pk._odd_tile_kernel.fn if hasattr(pk._odd_tile_kernel, "fn")
                                          else pk._odd_tile_kernel)
    line = first + next(i for i, text in enumerate(lines) if "tl.arange(0, BLOCK)" in text)
    assert (err["file"], err["line"]) == ("kernels_py/tests/probe_kernels.py", line), err
    assert "power of 2" in err["message"] and "tl.arange(0, BLOCK)" in err["source"], err


_MERGE_SPLITS = """
import json
from kernels_py.ops import OPS, estimate
from kernels_py.ops import compile as cc
out = []
for op in ("fp8_decode", "gather_decode", "quant_decode", "lowrank_decode"):
    model = OPS[op].model
    for impl in model.ESTIMATES:
        for step in model.ESTIMATE_SHAPES:
            for launch in cc.record_launches(lambda: impl.call(step), 90):
                if "n_splits" in launch.kernel.arg_names:
                    name = launch.kernel.fn.__name__
                    given = int(launch.args[launch.kernel.arg_names.index("n_splits")])
                    splits = impl.work(step, name, {}, estimate.H100).programs[0].values["n_splits"]
                    out.append([op, impl.name, step.batch, name, given, splits])
print(json.dumps(out))
"""


def test_the_merges_compile_with_a_loop_over_several_splits():
    """The tiny call that compiles a step's kernels gives the merge one split
    only where the step has one: Triton specializes an int argument of 1 as
    the constant, so a merge compiled with one split has no loop over the
    splits, and the estimate counted one where the step merges 4 to 64."""
    if _missing_toolchain():
        pytest.skip(_missing_toolchain())
    done = subprocess.run([sys.executable, "-c", _MERGE_SPLITS], cwd=ROOT, env=_child_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(done.stdout)
    assert {r[0] for r in rows} == {"fp8_decode", "gather_decode", "quant_decode", "lowrank_decode"}
    for op, impl, batch, kernel, given, splits in rows:
        assert (given == 1) == (splits == 1), (op, impl, batch, kernel, given, splits)
    assert any(r[5] == 1 for r in rows) and any(r[5] > 1 for r in rows)


def test_calibration_bands_contain_the_measured_times(report):
    """For the config the estimate predicts the autotuner chose, each band
    contains the time measured on an H100 (the fbd0532 kernels)."""
    rows = [r for r in report["calibration"] if r["commit"] == "fbd0532"]
    assert len(rows) == 2
    lines = [f"{r['point']}: measured {r['measured_ms']} ms, band {r['optimistic_ms']:.2f}..{r['conservative_ms']:.2f} "
             f"ms, optimistic/measured {r['optimistic_ratio']:.2f}, conservative/measured "
             f"{r['conservative_ratio']:.2f} ({r['picked']})" for r in rows]
    print("\n".join(lines))
    for r, line in zip(rows, lines):
        assert r["inside"] and r["optimistic_ms"] <= r["measured_ms"] <= r["conservative_ms"], line


def test_measured_points_lie_in_their_bands(report):
    """Every point a bench run recorded on a GPU with CUDA-graph timing
    (fixtures/calibration.jsonl), estimated at its shape for the configs the
    autotuner chose there, lies in its band, or misses it by no more than
    the miss calibration.KNOWN_MISSES records (and a recorded miss that now
    lies inside must leave that list). A point whose kernels compile to
    other code than it measured (stale) is listed, not held to today's band."""
    from kernels_py.ops import calibration

    points = calibration.measured()
    rows = [r for r in report["calibration"] if r["commit"] != "fbd0532"]
    assert len(points) >= 9 and len(rows) == len(points)
    assert {r["point"] for r in rows} >= set(calibration.KNOWN_MISSES)
    current = [r["point"] for r in rows if not r["stale"]]
    assert len(current) >= 5, f"only {current} compile to the code they measured (another Triton?)"
    assert not [r for r in rows if r["stale"] and r["point"] in calibration.KNOWN_MISSES], \
        "a known miss whose code changed since: measure it again or drop it from KNOWN_MISSES"
    # The absorbed kernel's 08bf22f+ points measured the code before its
    # loads kept whole 16-column chunks: stale until measured again.
    assert all(r["stale"] for r in rows if r["commit"] == "08bf22f+" and "absorbed" in r["point"])
    # Every low-rank point measured the merge before it loaded W_v ahead of the splits' loop.
    assert all(r["stale"] for r in rows if r["point"].startswith("lowrank_decode"))
    # Every statistics point measured the column pass before it counted on the floats' bits.
    assert all(r["stale"] for r in rows if r["point"].startswith("attention_stats"))
    # The quantized decode's measured the code before codes were packed as
    # channel pairs; the config they measured is no config of today's kernel.
    quant = [r for r in rows if r["commit"] == "08bf22f+" and r["point"].startswith("quant_decode")]
    assert len(quant) == 2 and all(r["stale"] for r in quant)
    lines = []
    for r in rows:
        line = (f"{r['point']}: measured {r['measured_ms']:.3f} ms, band {r['optimistic_ms']:.3f}.."
                f"{r['conservative_ms']:.3f} ms ({r['picked']})")
        lines.append(line + (" (stale: its kernels changed since)" if r["stale"] else ""))
        if r["stale"]:
            continue
        miss = calibration.KNOWN_MISSES.get(r["point"])
        if miss is None:
            assert r["inside"], line
        else:
            assert not r["inside"], f"{line}: inside now, so it leaves KNOWN_MISSES"
            assert r["optimistic_ms"] <= r["measured_ms"] <= miss * 1.02 * r["conservative_ms"], line
    print("\n".join(lines))


def test_eager_points_are_left_out_of_the_check(tmp_path):
    """Eager times hold Python's launches and host syncs: only the timing
    asked for is read."""
    from kernels_py.ops import calibration

    path = tmp_path / "points.jsonl"
    path.write_text('{"timing": "eager", "measured_ms": 1.0}\n\n{"timing": "cuda graph", "measured_ms": 2.0}\n')
    assert [r["measured_ms"] for r in calibration.measured(path)] == [2.0]
    assert [r["measured_ms"] for r in calibration.measured(path, timing="eager")] == [1.0]
    assert calibration.measured(tmp_path / "absent.jsonl") == []
    assert calibration._chosen({"config": "_a BLOCK_N=64 w4 s2; _b w8 s3 r168"}) == {"_a": "BLOCK_N=64 w4 s2",
                                                                                      "_b": "w8 s3 r168"}
    assert calibration._chosen({"config": None}) == {}
    with pytest.raises(ValueError, match="no op model estimates today"):
        calibration.check_measured(records=[{"op": "lowrank_decode", "implementation": "renamed"}])
    with pytest.raises(ValueError, match="without the digest of the code it measured"):
        calibration.check_measured(records=[{"op": "lowrank_decode", "implementation": "absorbed (latent)"}])


def test_pick_breaks_a_tie_by_instructions():
    """Memory-bound configs share one band (the memory floor at both ends):
    the predicted pick is then the one that issues the fewest instructions,
    whichever order the configs come in."""
    from types import SimpleNamespace as C

    tied = [C(optimistic_us=190.0, conservative_us=248.0, instructions=n, config=str(n)) for n in (255, 197, 239)]
    faster = C(optimistic_us=150.0, conservative_us=300.0, instructions=900, config="faster")
    assert estimate.pick(tied).config == "197" and estimate.pick(tied[::-1]).config == "197"
    assert estimate.pick([*tied, faster]).config == "faster"  # sqrt(150 * 300) < sqrt(190 * 248)


def test_memory_floors_read_at_the_sustained_shares():
    """The optimistic end reads HBM at the most streaming kernels sustained,
    the conservative end at the least, and FlashAttention (every speedup's
    yardstick) at the most."""
    high, low = H100.hbm_share
    assert 0 < low < high <= 1
    assert H100.memory_us(3.35e6, "optimistic") == pytest.approx(1.0 / high)
    assert H100.memory_us(3.35e6, "conservative") == pytest.approx(1.0 / low)
    assert estimate.flash_us(3.35e6, H100) == pytest.approx(1.0 / high)
    assert A100.hbm_share == H100.hbm_share


def test_every_op_with_a_model_is_estimated(report):
    """Each implementation of each op model at its benchmark shapes has a
    band (optimistic <= conservative, both above the memory floor), a bound,
    instructions per token, a speedup over FlashAttention and words on what
    limits it."""
    seen = {}
    for res in report["estimates"]:
        for band in res["implementations"]:
            seen.setdefault(res["op"], set()).add(band["implementation"])
            assert 0 < band["optimistic_us"] <= band["conservative_us"]
            assert band["bound"] in ("memory", "tensor", "issue", "load/store", "special", "latency")
            assert band["instructions_per_token"] > 0 and band["flags"]
            assert band["speedup_conservative"] == pytest.approx(res["flash_us"] / band["conservative_us"])
            for k in band["kernels"]:
                for c in k["configs"]:
                    if "error" in c:
                        pytest.fail(f"{k['kernel']} {c['config']}: {c['error']}")
                    assert c["floors_us"]["memory"] <= c["optimistic_us"] <= c["conservative_us"]
                    assert sum(c["by_class_per_token"].values()) == pytest.approx(c["instructions_per_token"])
    assert seen == {"lowrank_decode": {"fused (exact)", "absorbed (latent)", "fused (exact), no mass",
                                       "absorbed (latent), no mass"},
                    "quant_decode": {"quantized (4/2-bit)"}, "gather_decode": {"selected rows"},
                    "attention_stats": {"statistics (two passes)"}, "fp8_decode": {"fp8 (fused)"}}
    assert {(r["op"], r["shape"]["batch"]) for r in report["estimates"]} >= {("lowrank_decode", 8),
                                                                              ("lowrank_decode", 64)}
    assert report["tables"] and all("title" in t for t in report["tables"])


def test_no_config_that_spills_at_the_benchmark_shape_can_be_chosen(report):
    """Every config of an autotuned kernel is compiled at the benchmark
    shape; those that spill are pruned (the autotuner's prune_configs_by
    drops them too) and never picked."""
    from kernels_py.ops.quant_decode import kernel as quant

    tuned = {}
    for res in report["estimates"]:
        for band in res["implementations"]:
            for k in band["kernels"]:
                if not k["autotuned"]:
                    continue
                tuned[res["op"]] = tuned.get(res["op"], 0) + 1
                want = len(quant.STAGE1_CONFIGS) if res["op"] == "quant_decode" else 8
                assert len(k["configs"]) >= want  # every config, not one pinned one
                for c in k["configs"]:
                    assert bool(c["pruned"]) == bool(c["spill_bytes"]), c
                    assert not (c["picked"] and c["spill_bytes"]), c
    # Both low-rank stage-1 kernels (with and without the masses), the quantized one and the fp8 one (two scale
    # granularities), at batch 8 and 64.
    assert tuned == {"lowrank_decode": 8, "quant_decode": 2, "fp8_decode": 4}


def test_the_quantized_decode_unpacks_without_shuffles(report):
    """The quantized decode's tiles unpack in the registers of the threads
    that loaded their words (kv_quant's channel-pair layout, rows in
    tile_slots order) and reach the MMAs through one vectorized store and
    ldmatrix (the keys of the KEY_OPERAND config from registers): at 32K
    tokens it issues under 400 warp-instructions a token (609 when pairs
    were joined, permuted and stored to shared memory 16 bits at a time)
    and under 50 of them shared-memory ones (79 then)."""
    estimates = [r for r in report["estimates"] if r["op"] == "quant_decode"]
    assert len(estimates) == 2
    for res in estimates:
        band = next(b for b in res["implementations"] if b["implementation"] == "quantized (4/2-bit)")
        stage1 = next(k for k in band["kernels"] if k["kernel"] == "_stage1_kernel")
        picked = next(c for c in stage1["configs"] if c["picked"])
        assert picked["instructions_per_token"] < 400, picked["instructions_per_token"]
        assert picked["by_class_per_token"]["shared"] < 50, picked["by_class_per_token"]
        # With its keys as the QK MMA's operand from registers, the 128-slot tile stores and reads no key
        # through shared memory: 19 shared-memory instructions a token where the same tile staging its keys
        # issues 29, and its load/store pipe's floor is a quarter lower.
        configs = {c["config"]: c for c in stage1["configs"]}
        staged, operand = configs["TILE=128 w4 s1"], configs["KEY_OPERAND=True TILE=128 w4 s1"]
        assert operand["by_class_per_token"]["shared"] < 0.75 * staged["by_class_per_token"]["shared"]
        assert operand["floors_us"]["load/store"] < 0.8 * staged["floors_us"]["load/store"]


def test_the_fused_kernel_is_seen_as_its_code_stands(report):
    """At 32K tokens and batch 64 the estimate reads the fused kernel's
    compiled code: U_k loaded 16 bytes wide once a tile (no scalar 16-bit
    loads left), yet about two hundred warp-instructions a token with
    tensor-core instructions a small share (the per-kv-head key rebuild,
    RoPE and scoring), short of the 6x the bytes/FLOPs model promises."""
    res = next(r for r in report["estimates"] if r["op"] == "lowrank_decode" and r["shape"]["batch"] == 64)
    fused = next(b for b in res["implementations"] if b["implementation"] == "fused (exact)")
    stage1 = next(k for k in fused["kernels"] if k["kernel"] == "_stage1_kernel")
    picked = next(c for c in stage1["configs"] if c["picked"])
    assert 100 < picked["instructions_per_token"] < 2000
    assert picked["mma_share"] < 0.2
    assert picked["by_class_per_token"].get("ldg_narrow", 0) < 1
    assert fused["speedup_conservative"] < 3 and fused["ideal_us"] < fused["optimistic_us"]
    assert not any("scalar sub-32-bit global loads" in f for f in fused["flags"] if f.startswith("_stage1_kernel"))


def test_the_merge_waits_for_w_v_under_its_loop_over_the_splits(report):
    """The low-rank calls' merge loads each chunk of W_v before its loop over
    the splits, so those loads' latency passes under the loop's; the fused
    call's merge loads the splits' LSEs before it attends the dense tokens,
    so those waits overlap too. What a warp still waits on is the splits'
    partials in the loop: at batch 8 (16 and 32 splits) 37% of the fused
    merge's time and 59% of the absorbed one's, figures taken with the merge
    compiled for one split (no loop) as under 30%."""
    for res in (r for r in report["estimates"] if r["op"] == "lowrank_decode"):
        for impl in res["implementations"]:
            merge = next(k for k in impl["kernels"] if k["kernel"] == "_merge_rank_kernel")
            (row,) = merge["configs"]
            assert row["waits"].get("global loads", 0) < 0.65, (res["shape"]["batch"], impl["implementation"],
                                                               row["waits"])


def test_the_absorbed_tiles_load_under_one_bound_a_token(report):
    """The absorbed stage 1 loads each U row under one bound of its own (its
    rank rounded up to 16 and capped at the factor's width; rank 0 past the
    segment), not a token mask, a chunk test and a width test a 16-byte
    copy: under 30 warp-instructions a token at the benchmark shapes (30.4
    at batch 8 with the three tests)."""
    for res in (r for r in report["estimates"] if r["op"] == "lowrank_decode"):
        absorbed = next(b for b in res["implementations"] if b["implementation"] == "absorbed (latent), no mass")
        stage1 = next(k for k in absorbed["kernels"] if k["kernel"] == "_stage1_absorbed_kernel")
        picked = next(c for c in stage1["configs"] if c["picked"])
        assert picked["instructions_per_token"] < 30, (res["shape"]["batch"], picked["config"],
                                                       picked["instructions_per_token"])


def test_the_fused_tiles_find_their_positions_and_ranks_in_l2(report):
    """The fused stage 1 asks L2 for a later tile's positions and ranks a
    tile before it loads them. Loaded from HBM, they shared the scoreboard
    ptxas gave the tile's U loads, so the wait for a U tile (from L2) lasted
    until the ranks came: global-load waits were 16.5% of a warp's time at
    batch 8 and 14.6% at 64; under 10% now."""
    for res in (r for r in report["estimates"] if r["op"] == "lowrank_decode"):
        fused = next(b for b in res["implementations"] if b["implementation"] == "fused (exact)")
        stage1 = next(k for k in fused["kernels"] if k["kernel"] == "_stage1_kernel")
        picked = next(c for c in stage1["configs"] if c["picked"])
        assert picked["waits"].get("global loads", 0) < 0.10, (res["shape"]["batch"], picked["config"],
                                                                 picked["waits"])


def test_the_statistics_passes_are_seen_as_their_code_stands(report):
    """The statistics at 32K keys and 50 rows: the row pass split over the
    keys (so its merge runs at batch 8, not at 64, where the row tiles fill
    the GPU alone), the column pass's blocks every row sees whole counted
    apart from the few at the prompt's end; K moved twice, so even the ideal
    is slower than one FlashAttention forward, and the estimate says by how
    much more."""
    for batch, merged in ((8, True), (64, False)):
        res = next(r for r in report["estimates"] if r["op"] == "attention_stats" and r["shape"]["batch"] == batch)
        band = res["implementations"][0]
        kernels = [k["kernel"] for k in band["kernels"]]
        assert kernels == (["_row_stats_kernel", "_merge_rows_kernel", "_column_stats_kernel"] if merged
                           else ["_row_stats_kernel", "_column_stats_kernel"])
        # Two passes over K and the per-head results: more bytes than FlashAttention's (both at the peak).
        assert band["ideal_us"] > res["flash_us"] * H100.hbm_share[0]
        assert band["ideal_us"] < band["optimistic_us"] <= band["conservative_us"]
        assert band["speedup_conservative"] < 1.0
        assert 200 < band["instructions_per_token"] < 5000


def test_calibration_error_is_summarised():
    from kernels_py.ops import calibration

    rows = [{"optimistic_ratio": 0.5, "conservative_ratio": 1.2}, {"optimistic_ratio": 0.8, "conservative_ratio": 2.0}]
    err = calibration.band_error(rows)
    assert err["optimistic"]["geomean"] == pytest.approx(math.sqrt(0.4)) and err["optimistic"]["worst"] == 0.5
    assert err["conservative"]["worst"] == 2.0


def test_a_bench_row_on_the_cpu_has_no_estimate_columns_filled(monkeypatch):
    """estimate_beside fills its columns on a GPU only; on the interpreter
    they stay empty (and no calibration point is written)."""
    from kernels_py import runtime
    from kernels_py.benchmarks.base import estimate_beside
    from kernels_py.ops.gather_decode import model

    monkeypatch.setattr(runtime, "interpreter_mode", lambda: True)  # on a GPU host too

    row = {}
    estimate_beside(row, "gather", model, "selected rows", model.Step(batch=1, context=2048), 1.0)
    assert row == {"gather_config": None, "gather_est_low_ms": None, "gather_est_high_ms": None}


def test_measured_points_go_where_vlkv_calibration_file_says(tmp_path, monkeypatch):
    """gpu-check sends a run's points to its results folder; the tests send none (conftest.py: "off"); a bench
    run without the variable appends to the tracked fixture."""
    from kernels_py.ops import calibration

    assert calibration.destination() is None and calibration.append({"x": 1}) is None  # the tests' default
    target = tmp_path / "calibration.jsonl"
    monkeypatch.setenv(calibration.CALIBRATION_ENV, str(target))
    assert calibration.append({"x": 1}) == target and target.read_text() == '{"x": 1}\n'
    monkeypatch.delenv(calibration.CALIBRATION_ENV)
    assert calibration.destination() == calibration.MEASURED



# Run in a compiling child (see above): the fused low-rank stage 1 with keys
# rebuilt through rank chunks, its loops' sources and trips.
_NESTED_LOOPS = """
import ast, dataclasses, json
from kernels_py.ops import estimate, report
from kernels_py.ops.lowrank_decode import model

step = dataclasses.replace(model.ESTIMATE_SHAPES[0], partial="keys", low_share=0.0, rank_chunk=16)
impl = next(i for i in model.ESTIMATES if i.name == "fused (exact)")
compiled = report.Compiled(impl, step, 90, select=lambda kernel, key: kernel != "_stage1_kernel"
                           or report.key_label(key) == "BLOCK_N=128 w8 s3")
(index,) = [i for i, (entry, binary) in enumerate(compiled.entries)
            if entry["kernel"] == "_stage1_kernel" and binary is not None]
meta = compiled.meta(compiled.entries[index][0])
k = compiled.kernel(index)
trips, _ = k.trips(impl.work(step, "_stage1_kernel", meta, estimate.H100).programs[0].values)
name = lambda info: ast.unparse(info.source.node.target) if info.source is not None else None
inside = lambda lp: [d for c in lp.children for d in [c, *inside(c)]]
print(json.dumps({"one_chunk": meta["ONE_CHUNK"], "kv_heads": step.kv_heads,
                  "nested_copies": [name(info) for info in k.loops.values() for inner in inside(info.loop)
                                    if info.source is not None and k.loops[inner.header].source == info.source],
                  "head_trips": [trips[h] for h, info in k.loops.items() if name(info) == "g"]}))
"""


def test_a_loop_holding_another_is_no_copy_of_its_source_loop():
    """The fused low-rank kernel with keys rebuilt through 16-column rank
    chunks (--shape partial=keys,rank_chunk=16): its head loop (for g in range(KV_HEADS))
    holds the chunk loop, whose first loads, hoisted into the head loop's
    own blocks, outnumber the head loop's own instructions. Attributed by
    that vote alone, the head loop was taken for a second version of the
    chunk loop and run 0 times: the estimate left out every key rebuild
    (70 instructions a token at any low_share). No SASS loop may be a copy
    of the source loop of a loop inside it, and the head loop runs once per
    kv head."""
    reason = _missing_toolchain()
    if reason:
        pytest.skip(reason)
    done = subprocess.run([sys.executable, "-c", _NESTED_LOOPS], cwd=ROOT, env=_child_env(), capture_output=True,
                          text=True, timeout=CHILD_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout)
    assert got["one_chunk"] is False, "the shape no longer rebuilds keys through chunks"
    assert got["nested_copies"] == [], got
    assert got["head_trips"] and all(t == got["kv_heads"] for t in got["head_trips"]), got
