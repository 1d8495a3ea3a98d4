"""What a compiled kernel issues, read from its SASS: every instruction
with its source line and the scheduling ptxas encoded beside it, the
basic blocks, the loops (back edges), the guarded library slow paths that
never run, and each instruction's class. kernels_py.ops.estimate turns
this into instructions per token, floors and a time band.

The machine code comes from nvdisasm (shipped with Triton beside its
ptxas) run on the cubin with line info (`-g`, which Triton's ptxas call
emits) and the raw encodings (`-hex`). On Volta and later each instruction
is 128 bits; its top 23 bits are the control word ptxas scheduled with:
stall cycles before the warp's next instruction, the scoreboard the
instruction sets when its variable-latency result is written (or its
source registers read), and the scoreboards it waits on. The warp
timeline of estimate.py replays exactly those.
"""

import functools
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

# Instruction classes, in the order reports print them: (key, what it holds).
CLASSES = (
    ("mma", "tensor-core MMA: HMMA (mma.sync), HGMMA (wgmma)"),
    ("fp", "FP32/FP16 arithmetic: FFMA, FMUL, FADD, FMNMX, FSEL, FSETP, FRND, HFMA2, HADD2"),
    ("mufu", "special functions: MUFU.EX2, MUFU.RCP"),
    ("convert", "conversions: F2F, F2FP, F2I, I2F, I2FP"),
    ("ldg_narrow", "global loads narrower than 32 bits a thread (scalar LDG.U16, LDG.U8)"),
    ("ldg", "global loads of 32 bits a thread"),
    ("ldg_wide", "global loads of 64 or 128 bits a thread"),
    ("cp_async", "asynchronous global-to-shared copies (LDGSTS: cp.async)"),
    ("tma", "tensor-memory-accelerator copies (UTMALDG, UBLKCP)"),
    ("stg", "global stores, reductions and atomics (STG, RED, ATOM)"),
    ("shared", "shared memory: LDS, STS, LDSM, STSM"),
    ("local", "local memory: register spills and stack (LDL, STL)"),
    ("sync", "barriers and waits: BAR, DEPBAR, LDGDEPBAR, WARPGROUP.ARRIVE/DEPBAR, MEMBAR, FENCE"),
    ("int", "integer and address arithmetic: IMAD, IADD3, LEA, SHF, LOP3, ISETP, PRMT, SEL, MOV"),
    ("uniform", "uniform datapath and special registers: U*, S2R, S2UR, R2UR, CS2R, LDC"),
    ("shuffle", "warp shuffles, votes, reductions: SHFL, VOTE, REDUX, MATCH"),
    ("control", "branches, convergence and NOPs: BRA, BSSY, BSYNC, EXIT, NOP"),
    ("other", "anything else"),
)
CLASS_NAMES = tuple(name for name, _ in CLASSES)
# Classes that go through the SM's load/store (MIO) pipe and its 128 B/clock L1.
MEMORY_CLASSES = ("ldg_narrow", "ldg", "ldg_wide", "cp_async", "tma", "stg", "shared", "local")

_BY_BASE = {
    "mma": ("HMMA", "HGMMA", "IMMA", "IGMMA", "QGMMA", "BMMA", "DMMA", "HMMA2"),
    "fp": ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FSET", "FRND", "FCHK", "FSWZADD", "FMUL32I",
           "FFMA32I", "FADD32I", "HFMA2", "HADD2", "HMUL2", "HMNMX2", "HSETP2", "HSET2", "DADD", "DMUL", "DFMA",
           "DSETP", "DMNMX", "FMNMX3", "FADD2", "FFMA2", "FMUL2"),
    "mufu": ("MUFU",),
    "convert": ("F2F", "F2FP", "F2I", "I2F", "I2FP", "I2I", "F2IP", "I2IP"),
    "cp_async": ("LDGSTS",),
    "tma": ("UTMALDG", "UTMASTG", "UTMAPF", "UBLKCP", "UBLKPF", "UBLKRED", "UTMAREDG"),
    "stg": ("STG", "ST", "RED", "REDG", "ATOM", "ATOMG"),
    "shared": ("LDS", "STS", "LDSM", "STSM", "ATOMS", "LDSLK"),
    "local": ("LDL", "STL"),
    "sync": ("BAR", "DEPBAR", "LDGDEPBAR", "WARPGROUP", "MEMBAR", "FENCE", "SYNCS", "ERRBAR", "CCTL", "ARRIVES",
             "CGAERRBAR", "ACQBULK", "USETMAXREG"),
    "uniform": ("S2R", "S2UR", "R2UR", "CS2R", "LDC", "ULDC", "R2UR", "UPLOP3", "VOTEU"),
    "shuffle": ("SHFL", "VOTE", "REDUX", "MATCH"),
    "control": ("BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BSSY", "BSYNC", "NOP", "YIELD", "BPT", "KILL",
                "BREAK", "WARPSYNC", "BMOV", "ELECT", "ENDCOLLECTIVE", "NANOSLEEP"),
}
_CLASS_OF_BASE = {base: cls for cls, bases in _BY_BASE.items() for base in bases}
_INT_PREFIXES = ("I", "V", "LEA", "SHF", "LOP", "PRMT", "SEL", "MOV", "SGXT", "POPC", "FLO", "BMSK", "BREV", "PLOP3",
                 "P2R", "R2P", "SHL", "SHR", "LOP3")


@functools.lru_cache(maxsize=4096)
def classify(op: str) -> str:
    """The class (CLASSES) of an opcode with its modifiers, e.g. LDG.E.U16."""
    parts = op.split(".")
    base = parts[0]
    if base in ("LDG", "LD"):
        mods = set(parts[1:])
        if mods & {"U8", "S8", "U16", "S16"}:
            return "ldg_narrow"
        if mods & {"64", "128"}:
            return "ldg_wide"
        return "ldg"
    cls = _CLASS_OF_BASE.get(base)
    if cls:
        return cls
    if base.startswith("U"):
        return "uniform"
    if base.startswith(_INT_PREFIXES):
        return "int"
    return "other"


@functools.lru_cache(maxsize=4096)
def access_bytes(op: str) -> int:
    """Bytes one thread moves with a memory instruction (by its width
    modifier; 4 without one). ldmatrix/stmatrix: 16 bytes per 8x8 matrix
    a thread's row address serves (.x4 -> 16, .x2 -> 8, .x1 -> 4 per thread)."""
    parts = op.split(".")
    if parts[0] in ("LDSM", "STSM"):
        count = next((int(p) for p in parts[1:] if p in ("1", "2", "4")), 1)
        return 4 * count
    mods = set(parts[1:])
    for mod, size in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
        if mod in mods:
            return size
    return 4


@functools.lru_cache(maxsize=4096)
def mma_flops(op: str, operands: str = "") -> tuple[float, str]:
    """(FLOPs, operand kind) of one warp's tensor-core instruction: an HMMA
    is one warp's m x n x k; an HGMMA is a warpgroup's (4 warps issue it), so
    a quarter of its 64 x N x K is counted per warp. The kind ("f16", "tf32",
    "int8", "fp8", "f64") sets the rate."""
    parts = op.split(".")
    base = parts[0]
    kind = "f16"
    if "TF32" in parts:
        kind = "tf32"
    elif any(p in ("E4M3", "E5M2") for p in parts) or base == "QGMMA":
        kind = "fp8"
    elif base in ("IMMA", "IGMMA"):
        kind = "int8"
    elif base == "DMMA":
        kind = "f64"
    if base in ("HGMMA", "QGMMA", "IGMMA"):
        m = re.match(r"(\d+)x(\d+)x(\d+)", parts[1] if len(parts) > 1 else "")
        if not m:
            return 0.0, kind
        mm, nn, kk = (int(g) for g in m.groups())
        return 2.0 * mm * nn * kk / 4, kind
    shape = parts[1] if len(parts) > 1 else ""
    dims = {"16816": (16, 8, 16), "1688": (16, 8, 8), "884": (8, 8, 4), "16832": (16, 8, 32), "8816": (8, 8, 16),
            "16864": (16, 8, 64), "1684": (16, 8, 4), "16816S": (16, 8, 16)}.get(shape)
    if dims is None:
        return 0.0, kind
    mm, nn, kk = dims
    return 2.0 * mm * nn * kk, kind


@dataclass
class Instr:
    """One SASS instruction, with its source line and control word."""

    addr: int
    op: str  # opcode with modifiers, e.g. LDG.E.U16
    operands: str
    pred: str  # guard predicate ("@!P1"), or ""
    file: str | None
    line: int | None
    stall: int  # cycles before the warp may issue its next instruction
    write_sb: int | None  # scoreboard set when the result is written (variable latency)
    read_sb: int | None  # scoreboard set when the source registers have been read
    wait: int  # mask of scoreboards waited on before issue
    target: int | None = None  # branch or call target address

    @property
    def base(self) -> str:
        return self.op.split(".")[0]

    @property
    def cls(self) -> str:
        return classify(self.op)

    @property
    def never(self) -> bool:
        """Guarded by the always-false predicate (@!PT): issued, never executed."""
        return self.pred == "@!PT"

    def text(self) -> str:
        return f"{self.pred + ' ' if self.pred else ''}{self.op} {self.operands}".strip()


@dataclass
class Block:
    index: int
    start: int  # first instruction (index into Sass.instrs)
    end: int  # one past the last
    succs: list[int] = field(default_factory=list)
    preds: list[int] = field(default_factory=list)


@dataclass
class Loop:
    """A natural loop: a back edge's target (header) and every block that
    reaches the back edge without passing the header."""

    header: int  # block index
    blocks: set[int]
    parent: "Loop | None" = None
    children: list["Loop"] = field(default_factory=list)
    depth: int = 0

    def own_blocks(self) -> set[int]:
        """Blocks of this loop that no inner loop holds."""
        inner = set().union(*(c.blocks for c in self.children)) if self.children else set()
        return self.blocks - inner


@dataclass
class Sass:
    """A kernel's machine code as blocks and loops. `cold` holds blocks of
    guarded library slow paths (a conditionally entered region holding a
    loop that is no loop of the kernel's source, e.g. libdevice's
    Payne-Hanek reduction in sinf): never run for the kernel's inputs, so
    not counted; `reachable` excludes code after the last EXIT (trap loops)."""

    name: str
    instrs: list[Instr]
    blocks: list[Block]
    loops: list[Loop]  # outermost first, then nested (every loop once)
    reachable: set[int]
    cold: set[int] = field(default_factory=set)

    def top_loops(self) -> list[Loop]:
        return [lp for lp in self.loops if lp.parent is None]

    def block_instrs(self, b: int) -> list[Instr]:
        blk = self.blocks[b]
        return self.instrs[blk.start:blk.end]

    def loop_of_block(self) -> dict[int, Loop]:
        """Each block's innermost loop."""
        out = {}
        for lp in sorted(self.loops, key=lambda lp: lp.depth):
            for b in lp.blocks:
                out[b] = lp
        return out


_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$")
_HI = re.compile(r"^\s+/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$")
_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
_LABEL = re.compile(r"^(\.L_x_\d+|[A-Za-z_$][\w$.]*):\s*$")
_TARGET = re.compile(r"`\(([^)]+)\)")
_FUNC = re.compile(r"^//-+ \.text\.(\S+)\s+-+")


def disassemble(cubin: bytes) -> str:
    """nvdisasm's listing of a cubin's code with line info and encodings."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([knobs.nvidia.nvdisasm.path, "-c", "-g", "-hex", f.name], capture_output=True,
                              text=True, check=True).stdout


def _control(hi: int) -> tuple[int, int | None, int | None, int]:
    """(stall, write scoreboard, read scoreboard, wait mask) from the high
    64 bits of an instruction: its control word is bits 105..127 (bits
    41..63 of the high half): stall 4 bits, yield 1, write barrier 3, read
    barrier 3 (7 = none), wait mask 6, reuse 4."""
    ctl = (hi >> 41) & 0x7FFFFF
    write_sb, read_sb = (ctl >> 5) & 7, (ctl >> 8) & 7
    return ctl & 0xF, None if write_sb == 7 else write_sb, None if read_sb == 7 else read_sb, (ctl >> 11) & 0x3F


def parse(listing: str) -> dict[str, list[Instr]]:
    """Instructions of each function in an nvdisasm listing (-c -g -hex),
    with branch targets resolved to addresses."""
    funcs: dict[str, list[Instr]] = {}
    labels: dict[str, dict[str, int]] = {}
    pending_targets = []
    current = None
    file = line = None
    lines = listing.splitlines()
    i = 0
    while i < len(lines):
        text = lines[i]
        m = _FUNC.match(text)
        if m:
            current = m.group(1)
            funcs[current], labels[current] = [], {}
            file = line = None
            i += 1
            continue
        m = _LINE.search(text)
        if m:
            file, line = m.group(1), int(m.group(2))
            i += 1
            continue
        if current is None:
            i += 1
            continue
        m = _LABEL.match(text.strip()) if not text.startswith("\t.") else None
        if m and not text.strip().startswith("/*"):
            labels[current][m.group(1)] = len(funcs[current])  # the next instruction's index
            i += 1
            continue
        m = _INSTR.match(text)
        if m and i + 1 < len(lines) and _HI.match(lines[i + 1]):
            hi = int(_HI.match(lines[i + 1]).group(1), 16)
            body = m.group(2).strip()
            pred = ""
            if body.startswith("@"):
                pred, body = body.split(None, 1)
            op, _, operands = body.partition(" ")
            stall, write_sb, read_sb, wait = _control(hi)
            ins = Instr(int(m.group(1), 16), op, operands.strip(), pred, file, line, stall, write_sb, read_sb, wait)
            target = _TARGET.search(operands)
            if target and ins.base in ("BRA", "CALL", "JMP", "BRX"):
                pending_targets.append((current, ins, target.group(1)))
            funcs[current].append(ins)
            i += 2
            continue
        i += 1
    for name, ins, label in pending_targets:
        index = labels[name].get(label)
        if index is not None and index < len(funcs[name]):
            ins.target = funcs[name][index].addr
    return funcs


def build(name: str, instrs: list[Instr], source_loop=None) -> Sass:
    """Blocks, reachability, loops and cold regions of one function.
    source_loop(instrs) -> whether a loop's own instructions come from a
    loop of the kernel's source (None: every loop counts as one)."""
    addr_index = {ins.addr: k for k, ins in enumerate(instrs)}
    starts = {0}
    for k, ins in enumerate(instrs):
        if ins.target is not None and ins.target in addr_index:
            starts.add(addr_index[ins.target])
        if ins.base in ("BRA", "EXIT", "RET", "BRX", "JMP", "CALL") and k + 1 < len(instrs):
            starts.add(k + 1)
    starts = sorted(s for s in starts if s < len(instrs))
    blocks = [Block(n, s, starts[n + 1] if n + 1 < len(starts) else len(instrs)) for n, s in enumerate(starts)]
    block_at = {b.start: b.index for b in blocks}
    for b in blocks:
        last = instrs[b.end - 1]
        falls = True
        if last.base in ("BRA", "JMP", "BRX") and not last.pred:
            falls = False
        if last.base in ("EXIT", "RET") and not last.pred:
            falls = False
        if last.target is not None and last.target in addr_index and last.base in ("BRA", "JMP", "CALL"):
            b.succs.append(block_at[addr_index[last.target]])
        if falls and b.index + 1 < len(blocks):
            b.succs.append(b.index + 1)
        for s in b.succs:
            blocks[s].preds.append(b.index)

    reachable, stack = set(), [0]
    while stack:
        n = stack.pop()
        if n not in reachable:
            reachable.add(n)
            stack.extend(blocks[n].succs)
    dom = _dominators(blocks, reachable)

    loops_by_header: dict[int, set[int]] = {}
    for b in sorted(reachable):
        for h in blocks[b].succs:
            if h in dom[b]:  # back edge b -> h
                body, work = {h, b}, ([b] if b != h else [])
                while work:
                    n = work.pop()
                    for p in blocks[n].preds:
                        if p in reachable and p not in body:
                            body.add(p)
                            work.append(p)
                loops_by_header.setdefault(h, set()).update(body)
    loops = [Loop(h, body) for h, body in loops_by_header.items()]
    loops.sort(key=lambda lp: (len(lp.blocks), -lp.header))
    for k, lp in enumerate(loops):  # the smallest strictly enclosing loop is the parent
        for outer in loops[k + 1:]:
            if lp.blocks < outer.blocks:
                lp.parent = outer
                outer.children.append(lp)
                break
    for lp in loops:
        depth, p = 0, lp.parent
        while p is not None:
            depth, p = depth + 1, p.parent
        lp.depth = depth
    loops.sort(key=lambda lp: (lp.depth, blocks[lp.header].start))
    for lp in loops:
        lp.children.sort(key=lambda c: blocks[c.header].start)
    sass = Sass(name, instrs, blocks, loops, reachable)
    if source_loop is not None:
        sass.cold = _cold_regions(sass, dom, source_loop)
    return sass


def _dominators(blocks: list[Block], reachable: set[int]) -> dict[int, set[int]]:
    order = sorted(reachable)
    dom = {n: set(order) for n in order}
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for n in order[1:]:
            preds = [p for p in blocks[n].preds if p in reachable]
            new = set.intersection(*(dom[p] for p in preds)) if preds else set()
            new = new | {n}
            if new != dom[n]:
                dom[n], changed = new, True
    return dom


def _cold_regions(sass: Sass, dom: dict[int, set[int]], source_loop) -> set[int]:
    """Blocks of conditionally entered regions that hold a loop the kernel's
    source does not have: a library's slow path (libdevice's sinf/cosf
    argument reduction for huge angles, a division's denormal path)."""
    foreign = [lp for lp in sass.loops
               if not source_loop([i for b in lp.own_blocks() for i in sass.block_instrs(b)])]
    own_headers = {lp.header for lp in sass.loops if lp not in foreign}
    cold: set[int] = set()
    for lp in foreign:
        if lp.header in cold:
            continue
        # Walk out from the loop through the blocks dominating it; the region
        # is the outermost conditionally entered one that still holds no loop
        # of the source and no back edge of an enclosing loop.
        best = None
        for n in sorted(dom[lp.header], key=lambda n: -len(dom[n])):
            if n == 0:
                break
            region = {m for m in sass.reachable if n in dom[m]}
            if region & own_headers or any(s in dom[n] and s != n for m in region for s in sass.blocks[m].succs):
                break
            entries = [p for p in sass.blocks[n].preds if p in sass.reachable and p not in region]
            if any(len(sass.blocks[p].succs) > 1 for p in entries):
                best = region
        if best:
            cold |= best
    return cold
