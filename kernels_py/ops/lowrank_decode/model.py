"""What one decode step over an AttentionPack cache must move and compute,
per implementation, and the time that sets on an H100: the roofline the
kernels are designed to (`workbench kernels report` prints it; measured
times come from `workbench bench lowrank`).

Per token of the compressed segment (fp16, 8 kv heads, head_dim 128, rank
64): the full cache is 2 * 8 * 128 * 2 = 4096 bytes, U_k + U_v are
2 * 64 * 2 = 256 bytes. One SVD covers all kv heads ([T, H_kv * D]), so U is
shared by every head, and both kernels' programs hold every query head of a
sequence: each U tile is read once for all heads, 256 bytes a token.

FLOPs are those the kernels execute on tensor cores, padding included. The
fused kernel rebuilds each kv head's keys (2 * R_k * D a token and kv head,
at the tile's rank) and scores them with all H_q rows of its program (each
row keeps its own head's scores: H_kv times the useful QK work, the price of
reading U once); values stay in rank space (2 * R_v per row and token). The
absorbed kernel scores and sums in rank space: 2 * (R_k + R_v) per row and
token.

For the per-token attention mass (AttentionPack Eq. 1) the fused kernel
writes each (query head, token) logit in float32 and reads it back, 8 bytes
per head and token; the absorbed kernel does so for the dense tokens only
and recomputes the compressed tokens' scores in rank space, reading U_k
again (2 * rank_k bytes a token). Counted apart, as "mass" bytes.

Partial decompression (`low_share` of the tokens at rank / 4 in the factors
`partial` names): stored grouped by rank, tiles are rank-uniform, so U bytes
and the key rebuild scale with the mean rank.
"""

from dataclasses import dataclass

from kernels_py.tables import Column, table

H100_HBM_BYTES_PER_S = 3.35e12  # H100 SXM, HBM3
H100_FP16_FLOPS = 989e12  # dense fp16/bf16 tensor-core peak


@dataclass(frozen=True)
class Step:
    """One decode step (one query token per sequence)."""

    batch: int
    visual: int  # compressed tokens per sequence
    dense: int = 64  # uncompressed tokens per sequence
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    rank_k: int = 64
    rank_v: int = 64
    elem_bytes: int = 2  # fp16/bf16 cache and factors
    low_share: float = 0.0  # share of the tokens decompressed at rank / 4
    partial: str = "values"  # which factors the low rank applies to: values, keys or both

    def mean_ranks(self) -> tuple[float, float]:
        """(R_k, R_v) averaged over the tokens."""
        def mean(rank, applies):
            return rank - self.low_share * (rank - max(1, rank // 4)) if applies else rank
        return (mean(self.rank_k, self.partial in ("keys", "both")),
                mean(self.rank_v, self.partial in ("values", "both")))


def per_token_bytes(s: Step) -> dict:
    """Bytes per compressed token: the full cache's K and V, and U_k + U_v at
    the tokens' mean ranks."""
    return {"full": 2 * s.kv_heads * s.head_dim * s.elem_bytes, "factors": sum(s.mean_ranks()) * s.elem_bytes}


def costs(s: Step) -> dict[str, dict]:
    """HBM bytes and executed tensor-core FLOPs of one step, by implementation."""
    b, t, n, hq, hk, d, rk, rv, e = (s.batch, s.visual, s.dense, s.heads, s.kv_heads, s.head_dim, s.rank_k, s.rank_v,
                                     s.elem_bytes)
    mk, mv = s.mean_ranks()
    dense_bytes = b * n * 2 * hk * d * e
    dense_flops = b * hk * hq * n * 4 * d  # every row scores and sums each kv head's dense tokens
    factors = b * t * per_token_bytes(s)["factors"] + b * (rk + rv) * hk * d * e  # U once, W once
    logits = b * hq * (t + n) * 4 * 2  # float32, written then read for the masses
    rank_space_mass = b * hq * n * 4 * 2 + b * t * mk * e + b * hq * rk * 4 * 2  # dense logits, U_k again, q~
    maps = b * hq * 2 * d * (rk + rv)  # into and out of rank space (once per split; counted once)
    return {
        "flash, full cache": {"bytes": b * (t + n) * 2 * hk * d * e, "flops": b * hq * (t + n) * 4 * d},
        "absorbed (latent)": {"bytes": factors + dense_bytes, "mass_bytes": rank_space_mass,
                              "flops": b * hq * t * 2 * (rk + rv) + maps + b * hq * t * 2 * rk + dense_flops},
        "fused (exact)": {"bytes": factors + dense_bytes, "mass_bytes": logits,
                          "flops": b * t * hk * 2 * mk * d + b * t * hk * hq * 2 * d + b * hq * t * 2 * rv
                          + maps + dense_flops},
    }


COLUMNS = (
    Column("visual", "", "compressed tokens per sequence"),
    Column("batch", "", "sequences"),
    Column("variant", "", "implementation"),
    Column("gbytes", "", "HBM gigabytes one step must read (the factors once, W, the dense segment)", "GB"),
    Column("mass_gbytes", "", "gigabytes more for the per-token masses: float32 logits written and re-read (the "
           "absorbed kernel: of the dense tokens, plus U_k read again)", "+mass GB"),
    Column("tflop", "", "tensor-core teraFLOPs of one step", "TFLOP"),
    Column("roofline_us", "", "microseconds: max(bytes / 3.35 TB/s, FLOPs / 989 TFLOP/s), masses included",
           "roofline µs"),
    Column("bound", "", "what sets the roofline: memory or compute"),
    Column("speedup_vs_flash", "x", "modeled: flash time / this time", "vs flash"),
)

SHAPES = (Step(batch=1, visual=1024), Step(batch=8, visual=32768), Step(batch=64, visual=32768))


def roofline_us(cost: dict) -> tuple[float, str]:
    """The time the bytes or the FLOPs of a step take at the H100's peaks,
    whichever is longer, and which it is."""
    memory = (cost["bytes"] + cost.get("mass_bytes", 0)) / H100_HBM_BYTES_PER_S
    compute = cost["flops"] / H100_FP16_FLOPS
    return max(memory, compute) * 1e6, "memory" if memory >= compute else "compute"


def report(shapes=SHAPES) -> dict:
    rows = []
    for s in shapes:
        c = costs(s)
        flash_us, _ = roofline_us(c["flash, full cache"])
        for variant, cost in c.items():
            us, bound = roofline_us(cost)
            rows.append({"visual": s.visual, "batch": s.batch, "variant": variant, "gbytes": cost["bytes"] / 1e9,
                         "mass_gbytes": cost.get("mass_bytes", 0) / 1e9, "tflop": cost["flops"] / 1e12,
                         "roofline_us": us, "bound": bound, "speedup_vs_flash": flash_us / us})
    s = shapes[0]
    return {"title": f"one decode step on an H100, modeled ({s.heads} q / {s.kv_heads} kv heads, head_dim "
                     f"{s.head_dim}, rank {s.rank_k}, fp16; {per_token_bytes(s)['full']} bytes a token in the full "
                     f"cache, {per_token_bytes(s)['factors']:g} in U_k + U_v)",
            **table(COLUMNS, rows)}
