"""How long a compiled kernel takes on a GPU, estimated without one from
what its SASS issues (kernels_py.ops.sass) and what the op's model says a
launch does at a shape (programs, loop bounds, HBM bytes, which arguments
stay in L2).

Per program class (programs with the same loop trip counts):
- counts: every instruction of the executed path (guarded library slow
  paths excluded) times the trips of the loops around it: warp-instructions
  by class, load/store-pipe cycles, tensor-core cycles, local-memory bytes;
- a warp's timeline: the instructions in order, each issued after the stall
  cycles ptxas encoded before it and after the scoreboards it waits on are
  released; a scoreboard is released a latency after its producer issues
  (a global load: the latency of the memory level its argument lives in, L1
  on a re-read of the same addresses; shared memory; a special function;
  ...), cp.async groups and wgmma groups after their own latencies, a
  barrier costs latency["barrier"]. Loops run their first iterations and then
  their steady-state iteration times the remaining trips.

Per launch, on the SMs: the first wave of programs goes out
breadth-first, one an SM in turn, and each later one to the SM with the
least work so far (the one that frees a slot first with one program an
SM; close to it with more), so short programs after long ones fill the
room the long ones leave. Each term is taken on the SM where it is
largest, and no SM is done before its longest program's own timeline:
floors (HBM bytes at the peak, tensor FLOPs at the MMA peak, instruction
issue at 4 a clock, the load/store pipe at 128 bytes a clock, the
special-function units (MUFU: exp2, rcp, sin, ...) at 16 results a clock)
and a latency term from the timeline. Co-resident programs hide some of
each other's waits, and how much is the largest unknown, so the estimate
is a band:
optimistic: they overlap fully (every program's timeline divided among
the CTAs an SM holds); conservative: they overlap only their waits on
memory (their requests are in flight together), while everything they do
inside the SM (issue, the pipeline stalls ptxas scheduled, barrier, wgmma
and tensor-pipe waits) serializes, a CTA's sibling warps on one scheduler
adding their issue. Each end is the largest of the floors and its latency
term; the bound names which. HBM is read at a sustained share of its peak,
the most (optimistic end) or the least (conservative end) that streaming
kernels reached when measured (GPU.hbm_share).

One constant set (GPUS) for every kernel: published figures, and the HBM
shares fitted once on measured kernels; nothing fitted per kernel. What
the model cannot see: cache hit rates beyond the levels the op's model
states, DRAM page and bank effects, clock throttling, shared-memory bank
conflicts, the tensor cores' own operand bandwidth, and scheduling across
kernels.
"""

import ast
import heapq
import math
import re
from dataclasses import dataclass, field
from typing import Callable

from kernels_py.ops import sass as sass_mod
from kernels_py.ops.source import SourceLoop, Sources


@dataclass(frozen=True)
class GPU:
    """Published figures of one GPU (per SM unless said)."""

    name: str
    arch: int
    sms: int
    clock_hz: float  # the clock behind the tensor-core peak
    hbm_bytes_per_s: float
    tensor_flops_per_clock: float  # dense fp16/bf16 tensor-core FLOPs per clock per SM
    mma_sync_share: float  # share of that peak mma.sync (HMMA) reaches; wgmma reaches all of it
    regs: int = 65536
    shared_bytes: int = 233472  # shared memory per SM
    shared_reserved: int = 1024  # per block, by the system
    max_warps: int = 64
    max_blocks: int = 32
    issue_per_clock: int = 4  # warp-instructions, one per scheduler
    l1_bytes_per_clock: int = 128  # the load/store pipe (L1 and shared memory)
    special_per_clock: int = 16  # special-function (MUFU) results, sm_80 and sm_90 alike
    latency: dict = field(default_factory=dict)  # cycles, by kind (see H100)
    launch_us: float = 2.0  # between two dependent launches in one stream
    l2_bytes: int = 50 * 2**20
    memory_bytes: float = 80e9  # HBM capacity: a step whose full cache exceeds it runs on no such GPU
    # Shares of hbm_bytes_per_s that streaming kernels sustain: the most and
    # the least any reached in the measurements (HBM_SHARE). The optimistic
    # end reads at the first, the conservative end at the second, and
    # FlashAttention, the yardstick of every speedup, at the first.
    hbm_share: tuple = (1.0, 1.0)

    def memory_us(self, hbm_bytes: float, end: str = "optimistic") -> float:
        """Microseconds `hbm_bytes` take at the share of the peak one end of
        the band assumes."""
        share = self.hbm_share[{"optimistic": 0, "conservative": 1}[end]]
        return hbm_bytes / (self.hbm_bytes_per_s * share) * 1e6

    @property
    def peak_flops(self) -> float:
        """Dense fp16/bf16 tensor-core FLOP/s."""
        return self.tensor_flops_per_clock * self.sms * self.clock_hz


# Measured on an H100 at 08bf22f (kernels_py/tests/fixtures/calibration.jsonl,
# CUDA-graph replays at 32K tokens, batch 8 and 64): FlashAttention over the
# full cache read at 74-89% of the peak; gather_decode at 68% (batch 8) and
# 83%, and fp8_decode at 75% and 80%. Fitted once for every kernel, not per
# kernel; the A100 and H200 take the same shares (on the H200 at ac7c521 the
# streaming kernels, gather_decode and fp8_decode, lie in the bands they give
# but gather_decode at batch 8, 5% above).
HBM_SHARE = (0.89, 0.68)

H100 = GPU(
    "H100 SXM", 90, 132, 1.83e9, 3.35e12, 4096.0, 2.0 / 3.0, hbm_share=HBM_SHARE,
    latency={
        "hbm": 1830,  # a global load that misses L2, under load: ~1 us
        "l2": 300,  # an L2 hit
        "l1": 35,  # an L1 hit (a re-read of the same addresses)
        "masked": 8,  # a load every lane of which is masked off: no memory access
        "shared": 30,  # LDS / LDSM
        "constant": 20,  # LDC
        "mufu": 20,  # MUFU.EX2 / RCP
        "shuffle": 25,  # SHFL, REDUX
        "convert": 15,  # conversions through the XU pipe
        "special": 20,  # S2R, S2UR, CS2R
        "other": 20,  # any other variable-latency producer
        "read": 16,  # until a memory instruction has read its source registers
        "wgmma": 32,  # a wgmma group's fixed latency beyond its N/2 cycles a k16 step
        "barrier": 24,  # BAR.SYNC when every warp arrives together
    },
)
A100 = GPU(
    "A100 SXM 80GB", 80, 108, 1.41e9, 2.039e12, 2048.0, 1.0, shared_bytes=167936, l2_bytes=40 * 2**20,
    latency={**H100.latency, "hbm": 1410, "l2": 250}, hbm_share=HBM_SHARE,
)
H200 = GPU("H200 SXM", 90, 132, 1.83e9, 4.8e12, 4096.0, 2.0 / 3.0, latency=H100.latency, hbm_share=HBM_SHARE,
           memory_bytes=141e9)
GPUS = {90: H100, 80: A100}


def roofline(hbm_bytes: float, flops: float, gpu: GPU = H100) -> tuple[float, str]:
    """The ideal of an op's model: microseconds its bytes take at the HBM
    peak or its FLOPs at the tensor-core peak, whichever is longer, and which
    ("memory" or "tensor cores"). A bound, never a prediction."""
    times = {"memory": hbm_bytes / gpu.hbm_bytes_per_s, "tensor cores": flops / gpu.peak_flops}
    bound = max(times, key=times.get)
    return times[bound] * 1e6, bound


def flash_us(hbm_bytes: float, gpu: GPU = H100) -> float:
    """FlashAttention's decode over the uncompressed cache, the yardstick of
    every speedup: its bytes at the most a streaming kernel sustained
    (gpu.hbm_share[0]). It reached 74-89% of the H100's peak, so a speedup
    against this time is at most the one against FlashAttention measured."""
    return gpu.memory_us(hbm_bytes, "optimistic")


def gpu_for(name: str, capability: int) -> GPU:
    """The constants of a device by its name (torch.cuda.get_device_name),
    else those of its compute capability's reference GPU."""
    for key, gpu in (("H200", H200), ("H100", H100), ("A100", A100)):
        if key in name:
            return gpu
    return GPUS.get(capability, H100)


# Waits on the memory system: co-resident programs have their requests in
# flight together, so even the conservative end overlaps these.
MEMORY_WAITS = ("global loads", "cp.async", "local memory")
MMA_RATE = {"f16": 1.0, "tf32": 0.5, "fp8": 2.0, "int8": 2.0, "f64": 1.0 / 16}  # vs the fp16 peak


# ----------------------------------------------------------------------------
# What an op's model says about a launch
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Programs:
    """`count` programs whose loops run the same trips: `values` gives the
    kernel's runtime names its loop bounds (and its callees') need."""

    count: int
    values: dict


@dataclass(frozen=True)
class Work:
    """One launch of a kernel at a shape, as the op's model sees it."""

    programs: tuple  # Programs, their counts summing to the grid
    hbm_bytes: float  # bytes the launch must move to and from HBM (each once)
    # Pointer argument -> where its loads are served: "hbm", "l2", "masked" (every lane off),
    # a mix {"hbm": share, "l2": share}, or (optimistic, conservative) when it is not known.
    levels: dict = field(default_factory=dict)
    useful_flops: float = 0.0  # tensor-core FLOPs the math needs (0: not stated)
    tokens: int = 0  # cached tokens of the step (for per-token figures)
    notes: tuple = ()  # what the model knows about this launch, in words
    # Launch order of the classes: one after another as listed (a grid whose
    # slowest dimension picks the class, e.g. the split), or spread through
    # the grid in proportion (the class is picked by a faster dimension).
    interleaved: bool = False


@dataclass(frozen=True)
class Implementation:
    """One implementation an op's model estimates. call(step) runs its
    launcher on tiny CPU tensors that compile to the step's specialization;
    work(step, kernel, meta, gpu) says what each launch does at the step's
    real size (meta: the launch's constexprs and autotune config); key(step)
    the fields of a step its compiled code depends on."""

    name: str
    call: Callable
    work: Callable
    key: Callable
    prunes_spilling: bool = True  # its autotuner drops configs that spill (common.prune_spilling)


# ----------------------------------------------------------------------------
# Occupancy
# ----------------------------------------------------------------------------


def ctas_per_sm(registers: int, warps: int, shared: int, gpu: GPU = H100) -> tuple[int, str]:
    """Resident programs per SM and the resource that limits them.
    Registers are allocated per warp in units of 256 (a thread's count
    rounded up to 8); shared memory per block plus the system's reservation."""
    per_thread = max(8, -(-max(registers, 1) // 8) * 8)
    per_warp = -(-per_thread * 32 // 256) * 256
    limits = {
        "registers": gpu.regs // (per_warp * warps) if per_warp * warps else gpu.max_blocks,
        "warps": gpu.max_warps // warps,
        "blocks": gpu.max_blocks,
        "shared memory": gpu.shared_bytes // (shared + gpu.shared_reserved) if shared else gpu.max_blocks,
    }
    name = min(limits, key=lambda k: (limits[k], k != "registers"))
    return max(0, limits[name]), name


def waves(programs: int, per_sm: int, gpu: GPU = H100) -> tuple[float, float]:
    """(waves, fill of the last wave) of a grid over every SM's slots."""
    slots = max(1, per_sm) * gpu.sms
    full = programs / slots
    last = full - math.floor(full) if full != math.floor(full) else 1.0
    return full, last


def dispatch(counts: list[int], costs: list[float], sms: int, per_sm: int = 1,
             interleaved: bool = False) -> list[tuple]:
    """Programs of each class on each SM. In launch order, the first wave
    goes breadth-first (program i of the first sms * per_sm to SM i mod
    sms), and each later program to the SM with the least work so far, the
    one that frees a slot first (exactly so with one program an SM; costs:
    one program's work, per class). One class: ceil or floor of its share
    on every SM."""
    if len([c for c in counts if c > 0]) <= 1:
        total = sum(counts)
        return [tuple(c and (total // sms + (i < total % sms)) for c in counts) for i in range(sms)]
    if interleaved:
        order = [c for _, c in sorted(((k + 0.5) / n, c) for c, n in enumerate(counts) for k in range(n))]
    else:
        order = [c for c, n in enumerate(counts) for _ in range(n)]
    held = [[0] * len(counts) for _ in range(sms)]
    load = [0.0] * sms
    first = min(len(order), sms * max(1, per_sm))
    for j, c in enumerate(order[:first]):
        held[j % sms][c] += 1
        load[j % sms] += costs[c]
    heap = [(w, i) for i, w in enumerate(load)]
    heapq.heapify(heap)
    for c in order[first:]:
        w, i = heapq.heappop(heap)
        held[i][c] += 1
        heapq.heappush(heap, (w + costs[c], i))
    return [tuple(h) for h in held]


# ----------------------------------------------------------------------------
# Static analysis of one compiled kernel
# ----------------------------------------------------------------------------


# Instructions an iteration's work issues (never hoisted out of the loop as
# loop-invariant address arithmetic is): what unrolled copies are counted by.
_WORK = ("ldg_narrow", "ldg", "ldg_wide", "cp_async", "tma", "stg", "shared", "mma", "mufu")


@dataclass
class LoopInfo:
    loop: sass_mod.Loop
    source: SourceLoop | None
    occurrence: int = 0  # which call site's copy of its source loop (a function inlined at several)
    unroll: int = 1  # the compiler unrolled it this many times: it runs trips // unroll
    peeled: frozenset = frozenset()  # blocks of its remainder, peeled beside it: they run trips % unroll copies
    remainder: int = 0  # the remainder loop of a loop unrolled this many times: trips % remainder
    version: bool = False  # a second version of a loop (only one of which runs): not counted


@dataclass
class LoadInfo:
    pointers: frozenset
    invariant: frozenset  # SASS loops (by header block) whose iterations re-read the same addresses


class Kernel:
    """A compiled kernel's SASS tied to its source: loops with their source
    loops, loads with the arguments they read."""

    def __init__(self, name: str, cubin: bytes, meta: dict, signature: dict, listing: str | None = None):
        self.name, self.meta = name, meta
        funcs = sass_mod.parse(listing if listing is not None else sass_mod.disassemble(cubin))
        if name not in funcs:
            name = next(iter(funcs))
        instrs = funcs[name]
        self.sources = Sources(sorted({i.file for i in instrs if i.file}))
        self.sass = sass_mod.build(name, instrs, source_loop=self._is_source_loop)
        self.pointers = {k for k, v in signature.items() if str(v).startswith("*")}
        self.loops = self._map_loops()
        self.loads = self._map_loads()

    def _is_source_loop(self, instrs) -> bool:
        return any(self.sources.loop_at(i.file, i.line) is not None for i in instrs)

    def _map_loops(self) -> dict[int, LoopInfo]:
        """SASS loop (by header block) -> its source loop, by a vote of its
        own instructions' lines (each line's innermost source loop). A source
        loop compiled to more SASS loops than its function has call sites
        was unrolled (the largest copy runs trips // U times, a remainder
        loop the rest, U from how many times each source line repeats) or
        versioned (copies of one size: one of them runs)."""
        out, by_source = {}, {}
        # Inner loops first: a SASS loop holding one of a source loop is no
        # copy of that source loop (none holds itself), however its own
        # instructions vote (an inner loop's first loads, hoisted into the
        # outer one's blocks, can outvote the outer body: the head loop
        # around the fused kernel's rank-chunk loop).
        live = [lp for lp in self.sass.loops if lp.header not in self.sass.cold]
        for lp in sorted(live, key=lambda lp: -lp.depth):
            votes: dict[SourceLoop, int] = {}
            for b in lp.own_blocks():
                for ins in self.sass.block_instrs(b):
                    src = self.sources.loop_at(ins.file, ins.line)
                    if src is not None:
                        votes[src] = votes.get(src, 0) + 1
            for inner in self._descendants(lp):
                if inner.header in out:
                    votes.pop(out[inner.header].source, None)
            out[lp.header] = LoopInfo(lp, max(votes, key=votes.get) if votes else None)
        out = {lp.header: out[lp.header] for lp in sorted(live, key=lambda lp: self.sass.blocks[lp.header].start)}
        for info in out.values():
            if info.source is not None:
                by_source.setdefault(info.source, []).append(info)
        for src, infos in by_source.items():
            sites = 1 if src.func == self.name else max(1, len(self.sources.chains(self.name, src.func, self.meta)))
            if len(infos) <= sites:
                for k, info in enumerate(infos):
                    info.occurrence = k
                continue
            if sites > 1:  # several call sites and extra copies: counted as call sites, in order
                for k, info in enumerate(infos):
                    info.occurrence = min(k, sites - 1)
                continue
            lines = [self._line_counts(info.loop, src) for info in infos]
            main = max(range(len(infos)), key=lambda k: sum(lines[k].values()))
            for k, info in enumerate(infos):
                if k == main:
                    continue
                ratios = sorted(lines[main][ln] / n for ln, n in lines[k].items() if n and lines[main].get(ln))
                ratio = ratios[len(ratios) // 2] if ratios else 1.0
                if ratio >= 1.5:
                    infos[main].unroll = max(infos[main].unroll, round(ratio))
                    info.remainder = round(ratio)
                else:
                    info.version = True
        for infos in by_source.values():
            for info in infos:
                if info.unroll == 1 and not info.remainder and not info.version:
                    info.unroll, info.peeled = self._peeled_unroll(info)
        return out

    @staticmethod
    def _descendants(lp: sass_mod.Loop) -> list[sass_mod.Loop]:
        """Every loop nested in lp, at any depth."""
        out, todo = [], list(lp.children)
        while todo:
            c = todo.pop()
            out.append(c)
            todo.extend(c.children)
        return out

    def _peeled_unroll(self, info: LoopInfo) -> tuple[int, frozenset]:
        """The unroll factor U of a loop whose remainder the compiler peeled
        into straight-line copies beside it (U - 1 of them, e.g. 2 + 1 for
        U = 4), and the blocks holding them: each line of the source loop's
        body appears U times in the loop and U - 1 times beside it. (1, {})
        when it was not unrolled."""
        lp, src = info.loop, info.source
        inner = self.sass.loop_of_block()
        # The peeled copies sit between this loop and the next one at its level.
        start = min(self.sass.blocks[b].start for b in lp.blocks)
        end = max(self.sass.blocks[b].end for b in lp.blocks)
        siblings = [c for c in (lp.parent.children if lp.parent else self.sass.top_loops()) if c is not lp]
        stop = min((self.sass.blocks[c.header].start for c in siblings if self.sass.blocks[c.header].start >= end),
                   default=len(self.sass.instrs))
        beside = [b for b in self.sass.reachable - self.sass.cold - lp.blocks
                  if inner.get(b) is lp.parent and end <= self.sass.blocks[b].start < stop]
        within = self._line_counts(lp, src)
        outside: dict[int, int] = {}
        holding = set()
        lo, hi = src.node.lineno, src.node.end_lineno or src.node.lineno
        for b in beside:
            for ins in self.sass.block_instrs(b):
                if ins.file == src.file and ins.line and lo < ins.line <= hi and ins.cls in _WORK:
                    outside[ins.line] = outside.get(ins.line, 0) + 1
                    holding.add(b)
        assert start < end
        ratios = sorted(n / (n - outside[ln]) for ln, n in within.items() if 0 < outside.get(ln, 0) < n)
        if len(ratios) * 2 < len(within) or not ratios:
            return 1, frozenset()
        ratio = ratios[len(ratios) // 2]
        return (round(ratio), frozenset(holding)) if ratio >= 1.5 else (1, frozenset())

    def _line_counts(self, loop: sass_mod.Loop, src: SourceLoop) -> dict[int, int]:
        """Instructions of a SASS loop's own blocks per line of its source loop's body."""
        counts: dict[int, int] = {}
        lo, hi = src.node.lineno, src.node.end_lineno or src.node.lineno
        for b in loop.own_blocks():
            for ins in self.sass.block_instrs(b):
                if ins.file == src.file and ins.line and lo < ins.line <= hi and ins.cls in _WORK:
                    counts[ins.line] = counts.get(ins.line, 0) + 1
        return counts

    def enclosing(self) -> dict[int, list[sass_mod.Loop]]:
        """Each block's loops, innermost first."""
        inner = self.sass.loop_of_block()
        out = {}
        for b in self.sass.reachable:
            chain, lp = [], inner.get(b)
            while lp is not None:
                chain.append(lp)
                lp = lp.parent
            out[b] = chain
        return out

    def _map_loads(self) -> dict[int, LoadInfo]:
        """Global loads (by instruction address) -> arguments read and the
        loops they re-read the same addresses in."""
        out = {}
        around = self.enclosing()
        constexprs = self.meta
        for b in self.sass.reachable - self.sass.cold:
            loops = around[b]
            within = [self.loops[lp.header].source for lp in loops
                      if lp.header in self.loops and self.loops[lp.header].source]
            for ins in self.sass.block_instrs(b):
                if ins.cls not in ("ldg_narrow", "ldg", "ldg_wide", "cp_async", "tma"):
                    continue
                site = self.sources.load_site(self.sass.name, ins.file, ins.line, self.pointers, within,
                                              constexprs)
                if site is None:
                    continue
                invariant = frozenset(lp.header for lp in loops if lp.header in self.loops
                                      and self.loops[lp.header].source is not None
                                      and id(self.loops[lp.header].source.node) in site.invariant_in)
                out[ins.addr] = LoadInfo(site.pointers, invariant)
        return out

    def trips(self, values: dict) -> tuple[dict, list[str]]:
        """Trips per entry of each SASS loop for one program class, and notes
        on loops without a source loop (counted once)."""
        def lookup(name):
            if name in values:
                return values[name]
            if name in self.meta:
                return self.meta[name]
            raise KeyError(name)

        out, notes = {}, []
        for header, info in self.loops.items():
            given = f"#{ast.unparse(info.source.node.target)}" if info.source is not None else None
            if info.source is None:
                out[header] = 1.0
                notes.append(f"a loop at 0x{self.sass.instrs[self.sass.blocks[header].start].addr:x} has no "
                             f"source loop: counted once")
                continue
            if given in values:  # the model gives the source loop's mean trips directly
                trips = float(values[given])
            else:
                trips = self.sources.trips(self.sass.name, info.source, info.occurrence, lookup)
            # Its SASS copies: unrolled, remainder, versioned.
            if info.version:
                trips = 0.0
            elif info.unroll > 1:
                rest = trips - info.unroll * math.floor(trips / info.unroll + 1e-9)
                for b in info.peeled:  # each peeled copy runs for part of the remainder
                    out[("peeled", b)] = rest / (info.unroll - 1)
                trips = math.floor(trips / info.unroll + 1e-9)
            elif info.remainder > 1:
                trips = trips - info.remainder * math.floor(trips / info.remainder + 1e-9)
            out[header] = trips
        return out, notes


# ----------------------------------------------------------------------------
# Counting and the warp timeline
# ----------------------------------------------------------------------------


@dataclass
class Profile:
    """One program class of one kernel: per warp, what it issues and how
    long its timeline takes alone."""

    instructions: float = 0.0
    by_class: dict = field(default_factory=dict)
    lsu_cycles: float = 0.0  # load/store pipe cycles (bytes / 128 a clock, at least 1 an instruction)
    tensor_flops: float = 0.0  # executed, this warp's share
    tensor_cycles: float = 0.0  # SM tensor-core cycles at the peak for the kind (HMMA at mma_sync_share)
    special_cycles: float = 0.0  # SM special-function-unit cycles (32 results a MUFU)
    local_bytes: float = 0.0
    outside_loops: float = 0.0  # instructions executed once per program (prologue and epilogue)
    cycles: float = 0.0  # the warp's timeline
    waits: dict = field(default_factory=dict)  # cycles waiting, by what was waited on
    narrow_waited: float = 0.0  # scalar global loads whose result the same iteration waits on


def _loop_multipliers(kernel: Kernel, trips: dict) -> dict[int, float]:
    """Executions of each block per program: the trips of its loops (a peeled
    remainder block: its share of the remainder)."""
    mult = {}
    around = kernel.enclosing()
    for b in kernel.sass.reachable - kernel.sass.cold:
        m = trips.get(("peeled", b), 1.0)
        for lp in around[b]:
            m *= trips.get(lp.header, 1.0)
        mult[b] = m
    return mult


def count(kernel: Kernel, trips: dict[int, float], gpu: GPU = H100) -> Profile:
    prof = Profile(by_class={c: 0.0 for c in sass_mod.CLASS_NAMES})
    mult = _loop_multipliers(kernel, trips)
    in_loop = {b for lp in kernel.sass.loops for b in lp.blocks}
    for b, m in mult.items():
        for ins in kernel.sass.block_instrs(b):
            cls = "control" if ins.never else ins.cls
            prof.instructions += m
            prof.by_class[cls] += m
            if b not in in_loop:
                prof.outside_loops += m
            if cls in sass_mod.MEMORY_CLASSES:
                warp_bytes = 32 * sass_mod.access_bytes(ins.op)
                prof.lsu_cycles += m * max(1.0, warp_bytes / gpu.l1_bytes_per_clock)
                if cls == "local":
                    prof.local_bytes += m * warp_bytes
            if cls == "mufu":
                prof.special_cycles += m * 32 / gpu.special_per_clock
            if cls == "mma":
                flops, kind = sass_mod.mma_flops(ins.op, ins.operands)
                share = 1.0 if ins.base.endswith("GMMA") else gpu.mma_sync_share
                prof.tensor_flops += m * flops
                prof.tensor_cycles += m * flops / (gpu.tensor_flops_per_clock * MMA_RATE.get(kind, 1.0) * share)
    return prof


class _Timeline:
    """One warp issuing a kernel's instructions in order (see the module doc)."""

    def __init__(self, kernel: Kernel, trips: dict[int, float], levels: dict, gpu: GPU):
        self.k, self.trips, self.levels, self.gpu = kernel, trips, levels, gpu
        self.lat = gpu.latency
        self.t = 0.0
        self.sb: list[list[tuple[float, str]]] = [[] for _ in range(6)]
        self.wg_groups: list[float] = []
        self.wg_open = 0.0
        self.tensor_free = 0.0
        self.hmma_free = 0.0
        self.cp_open: float | None = None
        self.iteration: dict[int, int] = {}
        self.waits: dict[str, float] = {}
        self.narrow_waited = 0.0
        self._producer_of: dict[int, tuple[int, str]] = {}

    # -- the program as items: blocks and loops in address order --
    def items(self, loop: sass_mod.Loop | None):
        s = self.k.sass
        if loop is None:
            blocks = [b for b in s.reachable - s.cold if not any(b in lp.blocks for lp in s.top_loops())]
            loops = [lp for lp in s.top_loops() if lp.header not in s.cold]
        else:
            blocks = [b for b in loop.own_blocks() if b in s.reachable and b not in s.cold]
            loops = [c for c in loop.children if c.header not in s.cold]
        items = [(s.blocks[b].start, "block", b) for b in blocks]
        items += [(s.blocks[lp.header].start, "loop", lp) for lp in loops]
        return [(kind, x) for _, kind, x in sorted(items, key=lambda it: it[0])]

    def run(self) -> float:
        self._region(None)
        pending = [c for lst in self.sb for c, _ in lst] + self.wg_groups
        return max([self.t, *pending]) if pending else self.t

    def _region(self, loop):
        for kind, x in self.items(loop):
            if kind == "block":
                if self.trips.get(("peeled", x), 1.0) < 0.5:  # a remainder copy that does not run
                    continue
                for ins in self.k.sass.block_instrs(x):
                    self._issue(ins)
            else:
                self._loop(x)

    def _loop(self, lp: sass_mod.Loop):
        trips = self.trips.get(lp.header, 1.0)
        if trips <= 0:
            return
        runs = min(math.ceil(trips), 3)
        last, last_waits = 0.0, {}
        for i in range(runs):
            self.iteration[lp.header] = i
            before, waits_before = self.t, dict(self.waits)
            self._region(lp)
            last = self.t - before
            last_waits = {k: v - waits_before.get(k, 0.0) for k, v in self.waits.items()}
        self.iteration.pop(lp.header, None)
        # The remaining iterations take as long as the last one run (the steady state).
        extra = trips - runs
        if extra:
            self._shift(extra * last)
            for k, v in last_waits.items():
                self.waits[k] = self.waits.get(k, 0.0) + extra * v

    def _shift(self, dt: float):
        self.t += dt
        self.sb = [[(c + dt, w) for c, w in lst] for lst in self.sb]
        self.wg_groups = [c + dt for c in self.wg_groups]
        self.wg_open = self.wg_open + dt if self.wg_open else 0.0
        self.tensor_free += dt
        self.hmma_free += dt
        if self.cp_open is not None:
            self.cp_open += dt

    def _wait_until(self, when: float, what: str, issue: float) -> float:
        if when > issue:
            self.waits[what] = self.waits.get(what, 0.0) + (when - issue)
            return when
        return issue

    def _load_latency(self, ins: sass_mod.Instr) -> float:
        info = self.k.loads.get(ins.addr)
        bypass = "BYPASS" in ins.op
        if info is not None and any(self.iteration.get(h, 0) > 0 for h in info.invariant):
            return self.lat["l2"] if bypass else self.lat["l1"]
        level = "hbm"
        if info is not None and info.pointers:
            shares: dict[str, float] = {}
            for p in info.pointers:
                lv = self.levels.get(p, "hbm")
                mix = lv if isinstance(lv, dict) else {lv: 1.0}
                for k, v in mix.items():
                    shares[k] = shares.get(k, 0.0) + v / len(info.pointers)
            return sum(self.lat[k] * v for k, v in shares.items())
        return self.lat[level]

    def _latency(self, ins: sass_mod.Instr) -> tuple[float, str]:
        cls = ins.cls
        if cls in ("ldg_narrow", "ldg", "ldg_wide", "tma"):
            return self._load_latency(ins), "global loads"
        if cls == "shared":
            return self.lat["shared"], "shared memory"
        if cls == "local":
            return self.lat["l1"], "local memory"
        if ins.base in ("LDC", "ULDC"):
            return self.lat["constant"], "other"
        if cls == "mufu":
            return self.lat["mufu"], "special functions"
        if cls == "shuffle":
            return self.lat["shuffle"], "shuffles"
        if cls == "convert":
            return self.lat["convert"], "other"
        if ins.base in ("S2R", "S2UR", "CS2R"):
            return self.lat["special"], "other"
        return self.lat["other"], "other"

    def _issue(self, ins: sass_mod.Instr):
        issue = self.t
        for b in range(6):
            if ins.wait >> b & 1 and self.sb[b]:
                when, what = max(self.sb[b])
                if what == "global loads (scalar)" and when > issue:
                    self.narrow_waited += 1
                issue = self._wait_until(when, what.replace(" (scalar)", ""), issue)
                self.sb[b] = []
        base = ins.base
        if base == "DEPBAR":
            m = re.search(r"SB(\d),\s*(0x[0-9a-f]+|\d+)", ins.operands)
            if m:
                b, keep = int(m.group(1)), int(m.group(2), 0)
                pending = sorted(self.sb[b])
                if len(pending) > keep:
                    done = pending[:len(pending) - keep]
                    issue = self._wait_until(max(c for c, _ in done), done[-1][1].replace(" (scalar)", ""), issue)
                    self.sb[b] = pending[len(pending) - keep:]
        elif ins.op.startswith("WARPGROUP.DEPBAR"):
            m = re.search(r"gsb0,\s*(0x[0-9a-f]+|\d+)", ins.operands)
            keep = int(m.group(1), 0) if m else 0
            if len(self.wg_groups) > keep:
                done = self.wg_groups[:len(self.wg_groups) - keep]
                issue = self._wait_until(max(done), "wgmma", issue)
                self.wg_groups = self.wg_groups[len(self.wg_groups) - keep:]
        elif base == "BAR" and not ins.never:
            issue = self._wait_until(issue + self.lat["barrier"], "barriers", issue)
        elif base in ("HGMMA", "QGMMA", "IGMMA") and not ins.never:  # wgmma: fp16/bf16/tf32, fp8, int8
            flops, kind = sass_mod.mma_flops(ins.op, ins.operands)
            group_flops = 4 * flops  # the warpgroup's m64 x N x K
            dur = group_flops / (self.gpu.tensor_flops_per_clock * MMA_RATE.get(kind, 1.0))
            start = max(issue, self.tensor_free)
            self.tensor_free = start + dur
            self.wg_open = max(self.wg_open, start + dur + self.lat["wgmma"])
            if "gsb0" in ins.operands:
                self.wg_groups.append(self.wg_open)
                self.wg_open = 0.0
        elif base in ("HMMA", "IMMA") and not ins.never:  # mma.sync: fp16/bf16/tf32, int8
            flops, kind = sass_mod.mma_flops(ins.op, ins.operands)
            issue = self._wait_until(self.hmma_free, "tensor pipe", issue)
            per_smsp = self.gpu.tensor_flops_per_clock / 4 * MMA_RATE.get(kind, 1.0) * self.gpu.mma_sync_share
            self.hmma_free = issue + flops / per_smsp
        if ins.cls == "cp_async" and not ins.never:
            done = issue + self._load_latency(ins)
            self.cp_open = done if self.cp_open is None else max(self.cp_open, done)
        if ins.write_sb is not None and not ins.never:
            if base == "LDGDEPBAR":
                done, what = (self.cp_open if self.cp_open is not None else issue + 1), "cp.async"
                self.cp_open = None
            else:
                lat, what = self._latency(ins)
                if ins.cls == "ldg_narrow":
                    what = "global loads (scalar)"
                done = issue + lat
            self.sb[ins.write_sb].append((done, what))
        if ins.read_sb is not None and not ins.never:
            self.sb[ins.read_sb].append((issue + self.lat["read"], "register reads"))
        self.t = issue + max(1, ins.stall)


def profile(kernel: Kernel, values: dict, levels: dict, gpu: GPU = H100) -> tuple[Profile, list[str]]:
    """Counts and the warp timeline of one program class."""
    trips, notes = kernel.trips(values)
    prof = count(kernel, trips, gpu)
    line = _Timeline(kernel, trips, levels, gpu)
    prof.cycles = line.run()
    prof.waits = line.waits
    prof.narrow_waited = line.narrow_waited
    return prof, notes


# ----------------------------------------------------------------------------
# A launch: floors, the band, the bound
# ----------------------------------------------------------------------------


@dataclass
class Estimate:
    kernel: str
    config: str
    warps: int
    registers: int
    spill_bytes: int
    shared: int
    ctas_per_sm: int
    occupancy_limit: str
    programs: int
    waves: float
    last_wave: float
    instructions: float  # warp-instructions, all programs
    by_class: dict
    tensor_flops: float
    floors_us: dict  # memory, tensor, issue, load/store, special
    latency_us: dict  # optimistic, conservative
    optimistic_us: float
    conservative_us: float
    optimistic_bound: str
    conservative_bound: str
    hbm_bytes: float
    tokens: int
    flags: list
    waits: dict  # share of a warp's timeline spent waiting, by what (programs weighted)

    def row(self) -> dict:
        per = max(self.tokens, 1)
        return {
            "kernel": self.kernel, "config": self.config, "warps": self.warps, "registers": self.registers,
            "spill_bytes": self.spill_bytes, "shared": self.shared, "ctas_per_sm": self.ctas_per_sm,
            "occupancy_limit": self.occupancy_limit, "programs": self.programs, "waves": self.waves,
            "last_wave": self.last_wave, "instructions_per_token": self.instructions / per,
            "by_class_per_token": {k: v / per for k, v in self.by_class.items() if v},
            "mma_share": self.by_class.get("mma", 0.0) / self.instructions if self.instructions else 0.0,
            "floors_us": self.floors_us, "latency_us": self.latency_us,
            "optimistic_us": self.optimistic_us, "conservative_us": self.conservative_us,
            "optimistic_bound": self.optimistic_bound, "conservative_bound": self.conservative_bound,
            "hbm_bytes": self.hbm_bytes, "flags": self.flags, "waits": self.waits,
        }


def estimate(kernel: Kernel, work: Work, *, warps: int, registers: int, shared: int, spill_bytes: int = 0,
             config: str = "", gpu: GPU = H100) -> Estimate:
    per_sm, limit = ctas_per_sm(registers, warps, shared, gpu)
    if per_sm < 1:
        raise ValueError(f"{kernel.name} [{config}]: {limit} admit no program on an SM ({registers} registers, "
                         f"{warps} warps, {shared} bytes of shared memory)")
    programs = sum(p.count for p in work.programs)
    if programs < 1:
        raise ValueError(f"{kernel.name}: the model gives no program")
    n_waves, last = waves(programs, per_sm, gpu)
    clock = gpu.clock_hz
    resident = max(1, min(per_sm, math.ceil(programs / gpu.sms)))
    instructions = tensor_flops = local = outside = narrow = 0.0
    longest = longest_cons = 0.0
    by_class: dict[str, float] = {}
    waits: dict[str, float] = {}
    cycles_total = 0.0
    notes: list[str] = []
    ends = {end: {p: (lv[i] if isinstance(lv, tuple) else lv) for p, lv in work.levels.items()}
            for i, end in enumerate(("optimistic", "conservative"))}
    # Per class, what one program adds to its SM's terms (cycles).
    terms: list[dict] = []
    counts: list[int] = []
    for group in work.programs:
        if group.count <= 0:
            continue
        prof, loop_notes = profile(kernel, group.values, ends["optimistic"], gpu)
        cons = prof
        if ends["conservative"] != ends["optimistic"]:
            cons, _ = profile(kernel, group.values, ends["conservative"], gpu)
        notes += [n for n in loop_notes if n not in notes]
        siblings = max(0.0, warps / 4 - 1) * cons.instructions
        memory_wait = sum(cons.waits.get(k, 0.0) for k in MEMORY_WAITS)
        terms.append({
            "issue": warps * prof.instructions / gpu.issue_per_clock, "tensor": warps * prof.tensor_cycles,
            "load/store": warps * prof.lsu_cycles, "special": warps * prof.special_cycles,
            "conservative": cons.cycles - memory_wait + siblings + memory_wait / resident,
            "optimistic": prof.cycles / per_sm,
        })
        counts.append(group.count)
        longest = max(longest, prof.cycles)
        longest_cons = max(longest_cons, cons.cycles + siblings)  # one program alone on its SM
        instructions += group.count * warps * prof.instructions
        tensor_flops += group.count * warps * prof.tensor_flops
        local += group.count * warps * prof.local_bytes
        outside += group.count * warps * prof.outside_loops
        narrow += group.count * warps * prof.narrow_waited
        for k, v in prof.by_class.items():
            by_class[k] = by_class.get(k, 0.0) + group.count * warps * v
        for k, v in cons.waits.items():
            waits[k] = waits.get(k, 0.0) + group.count * v
        cycles_total += group.count * cons.cycles
    held = set(dispatch(counts, [t["conservative"] for t in terms], gpu.sms, per_sm, work.interleaved))
    busiest = {k: max(sum(n * t[k] for n, t in zip(h, terms)) for h in held) for k in terms[0]}
    issue, tensor, lsu, special = (busiest[k] for k in ("issue", "tensor", "load/store", "special"))
    # No SM is done before its longest program, whose own timeline the
    # programs beside it can only lengthen (an SM may hold one long program
    # among short ones, and then its waits overlap little).
    lat_cons, lat_opt_sum = max(longest_cons, busiest["conservative"]), busiest["optimistic"]
    lat_opt = max(longest, lat_opt_sum)
    floors = {
        "memory": work.hbm_bytes / gpu.hbm_bytes_per_s * 1e6,
        "tensor": tensor / clock * 1e6,
        "issue": issue / clock * 1e6,
        "load/store": lsu / clock * 1e6,
        "special": special / clock * 1e6,
    }
    latency = {"optimistic": lat_opt / clock * 1e6, "conservative": lat_cons / clock * 1e6}
    # The memory floor is at the peak; each end reads at the share it assumes.
    opt_terms = {**floors, "memory": gpu.memory_us(work.hbm_bytes, "optimistic"), "latency": latency["optimistic"]}
    cons_terms = {**floors, "memory": gpu.memory_us(work.hbm_bytes, "conservative"),
                  "latency": latency["conservative"]}
    opt_bound = max(opt_terms, key=opt_terms.get)
    cons_bound = max(cons_terms, key=cons_terms.get)
    wait_share = {k: v / cycles_total for k, v in sorted(waits.items(), key=lambda kv: -kv[1])} \
        if cycles_total else {}
    est = Estimate(
        kernel=kernel.name, config=config, warps=warps, registers=registers, spill_bytes=spill_bytes, shared=shared,
        ctas_per_sm=per_sm, occupancy_limit=limit, programs=programs, waves=n_waves, last_wave=last,
        instructions=instructions, by_class=by_class, tensor_flops=tensor_flops, floors_us=floors,
        latency_us=latency, optimistic_us=opt_terms[opt_bound] + gpu.launch_us,
        conservative_us=cons_terms[cons_bound] + gpu.launch_us, optimistic_bound=opt_bound,
        conservative_bound=cons_bound, hbm_bytes=work.hbm_bytes, tokens=work.tokens, flags=[], waits=wait_share)
    est.flags = _flags(est, work, outside, narrow, local, per_sm, notes)
    return est


def _flags(est: Estimate, work: Work, outside: float, narrow_waited: float, local: float, per_sm: int,
           notes: list[str]) -> list[str]:
    """What limits the kernel, in words, from the counts and the timeline."""
    flags = []
    total = est.instructions or 1.0
    per_token = est.tokens or 1
    narrow = est.by_class.get("ldg_narrow", 0.0)
    if narrow / per_token >= 1:
        how = ", waited on in the iteration that issues them (not pipelined)" if narrow_waited else ""
        flags.append(f"scalar sub-32-bit global loads: {narrow / per_token:.1f} per token{how}")
    mma = est.by_class.get("mma", 0.0)
    if mma and mma / total < 0.1:
        flags.append(f"tensor-core instructions are {mma / total:.0%} of those issued: "
                     f"the other {1 - mma / total:.0%} set the pace")
    if work.useful_flops and est.tensor_flops > 1.25 * work.useful_flops:
        flags.append(f"tensor cores execute {est.tensor_flops / work.useful_flops:.1f}x the FLOPs the math needs "
                     f"(padded rows, replicated or masked-away work)")
    if outside / total > 0.25:
        flags.append(f"per-program prologue and epilogue (outside every loop): {outside / total:.0%} of the "
                     f"instructions")
    if est.spill_bytes or local:
        flags.append(f"spills: {est.spill_bytes} bytes a thread, {local / per_token:.0f} bytes of local-memory "
                     f"traffic per token")
    for what, share in est.waits.items():
        if share >= 0.2:
            flags.append(f"{share:.0%} of a warp's time waits on {what}")
    if per_sm == 1:
        flags.append(f"1 program per SM ({est.warps} warps, limited by {est.occupancy_limit}): little to hide "
                     f"latency with")
    if est.waves < 4 and est.last_wave < 0.5:
        flags.append(f"{est.waves:.2f} waves: the last one {est.last_wave:.0%} full")
    flags += list(work.notes) + notes
    return flags


def combine(name: str, parts: list[Estimate], flash_us: float, gpu: GPU = H100) -> dict:
    """An implementation (its launches one after another) as one band."""
    opt = sum(p.optimistic_us for p in parts)
    cons = sum(p.conservative_us for p in parts)
    hbm = sum(p.hbm_bytes for p in parts)
    tokens = max((p.tokens for p in parts), default=0)
    instructions = sum(p.instructions for p in parts)
    # flash_us: estimate.flash_us, FlashAttention at the share the optimistic end assumes.
    return {
        "implementation": name, "optimistic_us": opt, "conservative_us": cons,
        "bound": max(parts, key=lambda p: p.conservative_us).conservative_bound if parts else "",
        "hbm_bytes": hbm, "instructions_per_token": instructions / tokens if tokens else None,
        "hbm_share_optimistic": hbm / (opt * 1e-6) / gpu.hbm_bytes_per_s if opt else None,
        "hbm_share_conservative": hbm / (cons * 1e-6) / gpu.hbm_bytes_per_s if cons else None,
        "speedup_optimistic": flash_us / opt if opt else None,
        "speedup_conservative": flash_us / cons if cons else None,
    }


def pick(estimates: list[Estimate]) -> Estimate:
    """The config an autotuner is predicted to choose: the smallest geometric
    mean of the band; among equal bands (memory-bound configs all take the
    memory floor), the one that issues the fewest instructions."""
    return min(estimates, key=lambda e: (round(math.sqrt(e.optimistic_us * e.conservative_us), 6), e.instructions))

