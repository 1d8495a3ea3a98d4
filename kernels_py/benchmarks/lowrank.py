"""One decode step of attention over an AttentionPack cache
(kernels_py.ops.lowrank_decode) against

(i)   scaled_dot_product_attention over the full, uncompressed cache of the
      same length (FlashAttention forced where PyTorch has it for these shapes), and
(ii)  the unfused path: rebuild K and V from U and W with batched matmuls in
      the cache dtype, rotate the keys, concatenate the dense segment, SDPA.

The absorbed variant (rank-space attention, keys decomposed after RoPE) is
timed too, as an ablation, and both calls again without the per-token
masses (mass=False: the steps between AttentionPack's importance updates,
its importance_every knob). Cache: `length` visual tokens compressed to rank
`rank` for keys and values (keys decomposed before RoPE, rotated on rebuild),
split into two importance groups as in the paper's setup (25% of the tokens
at full rank, 75% at rank / 4, in the factors `partial` names: values by
default), stored grouped by rank as the AttentionPack cache stores them (the
full-rank group first), then `dense_len` uncompressed text tokens; one new
query token that sees every cached token (so no mask is needed by the
baselines). Every sequence of a batch has the full length.

Bytes and FLOPs (for GB/s, % of the HBM peak and TFLOP/s) are those the
step must move and compute, from kernels_py/ops/lowrank_decode/model.py:
U_k, U_v, W_k, W_v and the dense K/V read once, plus the logits each kernel
writes and re-reads for the per-token masses (float16 over an fp16 cache,
float32 otherwise; the absorbed kernel's: float32, of the dense
tokens, and U_k read again) (the per-token ranks and
positions, 12 bytes a token, are left out); the full cache's K/V for SDPA.
Compression ratio: full K/V cache bytes / (U + W + dense K/V bytes). On a
GPU each row also gives the config the autotuner chose and the estimate's
band for it (kernels_py.ops.estimate) beside the measured time, and appends
that calibration point to kernels_py/tests/fixtures/calibration.jsonl.
"""

import dataclasses
from dataclasses import dataclass

import torch

from kernels_py.benchmarks.base import (
    ESTIMATE_ERROR, OUTPUT_ERROR, AttentionBenchmark, estimate_beside, estimate_columns, hbm_peak_gbps, nbytes,
    peak_bytes, output_error, percent_of, picked, sdpa, time_median,
)
from kernels_py.attention import apply_rope
from kernels_py.ops import lowrank_decode as op
from kernels_py.ops.lowrank_decode import model
from kernels_py.params import Rule, knob
from kernels_py.tables import Column

ROPE_BASE = 10000.0


def _make(batch: int, length: int, dense_len: int, heads: int, kv_heads: int, head_dim: int, rank: int,
          dtype: torch.dtype, device: torch.device, g: torch.Generator, full_rank_share: float = 0.25,
          partial: str = "values"):
    """q [B, H, 1, D], q_pos, CompressedKV, DenseKV for one size."""
    width = kv_heads * head_dim

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    # Grouped by rank: the first slots hold the full-rank group.
    full = (torch.arange(length, device=device) < int(full_rank_share * length + 0.5)).expand(batch, length)
    grouped = torch.where(full, rank, max(1, rank // 4)).to(torch.int32)
    flat = torch.full((batch, length), rank, dtype=torch.int32, device=device)
    rank_k = grouped if partial in ("keys", "both") else flat
    rank_v = grouped if partial in ("values", "both") else flat
    pos = torch.arange(length, dtype=torch.int32, device=device).expand(batch, length)
    comp = op.CompressedKV(randn(batch, length, rank), randn(batch, rank, width, scale=rank ** -0.5),
                           randn(batch, length, rank), randn(batch, rank, width, scale=rank ** -0.5),
                           rank_k, rank_v, pos, torch.full((batch,), length, dtype=torch.int32, device=device))
    dense_pos = (length + torch.arange(dense_len, dtype=torch.int32, device=device)).expand(batch, dense_len)
    dense = op.DenseKV(randn(batch, kv_heads, dense_len, head_dim), randn(batch, kv_heads, dense_len, head_dim),
                       dense_pos, torch.full((batch,), dense_len, dtype=torch.int32, device=device))
    q = randn(batch, heads, 1, head_dim)
    q_pos = torch.full((batch, 1), length + dense_len, dtype=torch.int32, device=device)
    return q, q_pos, comp, dense


def _unfused(q, comp, dense, rope_base):
    """Decompress-then-attend in the cache dtype: batched matmuls U[:, :r_t] W
    for the whole segment, RoPE on the rebuilt keys, concatenation with the
    dense segment, SDPA. Every token is visible and every sequence full (the
    benchmark's cache), and all sequences share positions."""
    batch, _, _, head_dim = q.shape
    kv_heads, tokens = dense.k.shape[1], comp.uk.shape[1]

    def rebuild(u, w, rank):
        keep = torch.arange(u.shape[-1], device=u.device) < rank[..., None]
        return torch.bmm(u * keep, w).view(batch, tokens, kv_heads, head_dim).transpose(1, 2)

    k = rebuild(comp.uk, comp.wk, comp.rank_k)
    if rope_base is not None:
        k = apply_rope(k, comp.pos[0], rope_base)
    v = rebuild(comp.uv, comp.wv, comp.rank_v)
    return sdpa(q, torch.cat([k, dense.k], 2), torch.cat([v, dense.v], 2))[0]


@dataclass(frozen=True)
class Lowrank(AttentionBenchmark):
    """Fused low-rank decode attention (AttentionPack) vs decompress-then-SDPA and vs SDPA on the full cache."""

    name = "lowrank"
    length_column = "visual_len"
    columns = (
        Column("visual_len", "", "compressed (visual) tokens per sequence", "visual"),
        Column("batch", "", "sequences"),
        Column("dense_len", "", "uncompressed text tokens per sequence", show=False),
        *AttentionBenchmark.SHAPE_COLUMNS,
        Column("rank_k", "", "key rank, and the value rank of the full-rank group (the ranks knob)", "rank"),
        Column("rank_v", "", "value rank of the full-rank group", show=False),
        Column("rank_v_low", "", "the lower rank of the other tokens", show=False),
        Column("num_splits", "", "split-K splits per sequence of the fused kernel", show=False),
        Column("absorbed_num_splits", "", "split-K splits per sequence of the absorbed kernel", show=False),
        Column("sdpa_backend", "", "SDPA backend of the baselines (flash where PyTorch has it)", show=False),
        Column("fused_ms", "ms", "the fused kernel (keys rebuilt and rotated, values in rank space), median", "fused"),
        Column("fused_gbps", "GB/s", "modeled bytes of the step (factors, dense, mass logits) / fused time", "GB/s"),
        Column("fused_hbm_pct", "%", "fused_gbps as a share of the GPU's HBM bandwidth", "% HBM"),
        Column("fused_tflops", "", "modeled FLOPs of the fused kernel / its time, in TFLOP/s", show=False),
        Column("absorbed_ms", "ms", "the rank-space (absorbed, latent) kernel, all heads per program", "absorbed"),
        Column("absorbed_gbps", "GB/s", "modeled bytes of the step / absorbed time", show=False),
        Column("absorbed_hbm_pct", "%", "absorbed_gbps as a share of the GPU's HBM bandwidth", "% HBM abs."),
        Column("absorbed_tflops", "", "modeled FLOPs of the absorbed kernel / its time, in TFLOP/s", show=False),
        Column("absorbed_vs_sdpa", "x", "SDPA time / absorbed time (above 1: absorbed is faster)", "SDPA/abs."),
        Column("fused_no_mass_ms", "ms", "the fused call with mass=False: a step that does not update "
               "AttentionPack's importance (importance_every), no logits written or read back", "fused, no mass"),
        Column("absorbed_no_mass_ms", "ms", "the absorbed call with mass=False", "abs., no mass"),
        Column("fused_no_mass_vs_sdpa", "x", "SDPA time / fused time without the masses", "SDPA/fused no mass"),
        Column("absorbed_no_mass_vs_sdpa", "x", "SDPA time / absorbed time without the masses", show=False),
        Column("unfused_ms", "ms", "rebuild K and V with batched matmuls, RoPE, then SDPA", "unfused"),
        Column("sdpa_ms", "ms", "SDPA over a full uncompressed cache of the same length", "SDPA"),
        Column("sdpa_hbm_pct", "%", "full K/V bytes / SDPA time, as a share of the HBM bandwidth", show=False),
        Column("model_bytes", "bytes", "bytes a step of the fused kernel must move (model.py)", show=False),
        Column("absorbed_model_bytes", "bytes", "bytes a step of the absorbed kernel must move (model.py)",
               show=False),
        Column("full_rank_share", "", "share of the tokens that keep the full rank", show=False),
        Column("partial", "", "factors the lower rank applies to", show=False),
        Column("rank_chunk", "", "rank columns per step of the fused kernel's key rebuild (0: one MMA)",
               show=False),
        Column("speedup_vs_unfused", "x", "unfused time / fused time (above 1: fused is faster)", "unfused/fused"),
        Column("speedup_vs_sdpa", "x", "SDPA time / fused time (above 1: fused is faster)", "SDPA/fused"),
        Column("compression_ratio", "x", "full K/V bytes / compressed cache bytes", "compression"),
        Column("fused_peak_bytes", "bytes",
               "extra device memory of the fused kernel at its peak, its workspace included", "peak fused"),
        Column("unfused_peak_bytes", "bytes", "extra device memory of the unfused path", "peak unfused"),
        Column("sdpa_peak_bytes", "bytes", "extra device memory of SDPA on the full cache", show=False),
        Column("compressed_bytes", "bytes", "U, W and dense K/V bytes the fused kernel reads", show=False),
        Column("full_bytes", "bytes", "bytes of the uncompressed cache", show=False),
        *estimate_columns("fused", "the fused call"),
        *estimate_columns("absorbed", "the absorbed call"),
        *estimate_columns("fused_no_mass", "the fused call without masses"),
        *estimate_columns("absorbed_no_mass", "the absorbed call without masses"),
        ESTIMATE_ERROR,
        OUTPUT_ERROR,
    )
    smoke = ({"lengths": (96,)}, {"batches": (1,)}, {"heads": 4, "kv_heads": 2, "head_dim": 64, "ranks": (16,)},
             {"dense_len": 8}, {"dtype": "float32"}, {"repeat": 1})

    lengths: tuple = knob("ints", (1024, 4096, 16384, 32768), "visual (compressed) token counts", min=1,
                          max=1 << 24)
    batches: tuple = knob("ints", (1, 8, 32, 64), "batch sizes", min=1, max=4096)
    ranks: tuple = knob("ints", (64,), "compression ranks of keys and values, a row each (paper: 32 or 64 for "
                        "images; sweep e.g. 16,32,64,128)", min=1, max=65536, ref="AttentionPack section 4.3")
    full_rank_share: float = knob("float", 0.25, "share of the tokens that keep the full rank; the rest are "
                                  "decompressed at rank / 4 (paper: 0.25)", min=0.0, max=1.0,
                                  ref="AttentionPack section 3.2")
    partial: str = knob("str", "values", "which factors the lower rank applies to (paper: values; keys or both "
                        "show the saving of the key rebuild)", choices=("values", "keys", "both"),
                        ref="AttentionPack section 4.1")
    dense_len: int = knob("int", 64, "uncompressed text tokens after the visual ones", min=1, max=1 << 20)
    rank_chunk: int = knob("int", 0, "rank columns per step of the fused kernel's key rebuild: 0 rebuilds a "
                           "tile's keys in one MMA (up to rank 64, the default, what AttentionPack runs), 16-64 "
                           "in a loop of chunks that stops at each tile's largest rank (partial keys' FLOPs "
                           "saving, slower by the estimate)", choices=(0, 16, 32, 64), ref="AttentionPack section 3.2")

    RULES = (
        Rule("head_dim % 2 == 0", "head_dim ({head_dim}) must be even (RoPE rotates pairs)"),
        Rule("max(ranks) <= kv_heads * head_dim", "ranks ({ranks}) must lie in [1, kv_heads * head_dim]"),
    )

    def cases(self):
        return ({self.length_column: n, "batch": b, "rank_k": r}
                for n in self.lengths for b in self.batches for r in self.ranks)

    def measure(self, case):
        x = self.inputs(case)
        n, b, device, cuda, dt, g = x.tokens, x.batch, x.device, x.cuda, x.dtype, x.generator
        rank = case["rank_k"]
        q, q_pos, comp, dense = _make(b, n, self.dense_len, self.heads, self.kv_heads, self.head_dim, rank, dt,
                                      device, g, self.full_rank_share, self.partial)
        chunk = self.rank_chunk or None  # 0: the kernel's default, one chunk
        op.check_inputs(q, q_pos, comp, dense, ROPE_BASE)  # once: the timed calls skip the value checks
        # Each kernel's default: an SM holds one fused program and two absorbed ones.
        splits, absorbed_splits = op.default_num_splits(comp, dense), op.default_num_splits(comp, dense, absorbed=True)
        full_k = torch.randn(b, self.kv_heads, n + self.dense_len, self.head_dim, generator=g, device=device).to(dt)
        full_v = torch.randn_like(full_k)
        # Caller-owned workspaces: the timed calls allocate nothing and never wait for the host.
        fused_ws = op.make_workspace(q, comp, dense, splits)
        absorbed_ws = op.make_workspace(q, comp, dense, absorbed_splits, absorbed=True)
        fused = lambda: op.lowrank_decode(q, q_pos, comp, dense, rope_base=ROPE_BASE,  # noqa: E731
                                          workspace=fused_ws, check_values=False, rank_chunk=chunk)
        absorbed = lambda: op.lowrank_decode_absorbed(q, q_pos, comp, dense, workspace=absorbed_ws,  # noqa: E731
                                                      check_values=False)
        fused_no_mass = lambda: op.lowrank_decode(q, q_pos, comp, dense, rope_base=ROPE_BASE,  # noqa: E731
                                                  workspace=fused_ws, check_values=False, rank_chunk=chunk,
                                                  mass=False)
        absorbed_no_mass = lambda: op.lowrank_decode_absorbed(q, q_pos, comp, dense,  # noqa: E731
                                                              workspace=absorbed_ws, check_values=False, mass=False)
        unfused = lambda: _unfused(q, comp, dense, ROPE_BASE)  # noqa: E731
        full = lambda: sdpa(q, full_k, full_v)  # noqa: E731
        read = nbytes(comp.uk, comp.uv, comp.wk, comp.wv, dense.k, dense.v)
        # Each call's autotuned pick, taken as it is timed (the calls with and without masses share kernels).
        timed, picks = {}, {}
        for name, call, tuner in (("fused", fused, op.kernel._stage1_tuned),
                                  ("absorbed", absorbed, op.kernel._stage1_absorbed_tuned),
                                  ("fused_no_mass", fused_no_mass, op.kernel._stage1_tuned),
                                  ("absorbed_no_mass", absorbed_no_mass, op.kernel._stage1_absorbed_tuned)):
            timed[f"{name}_ms"] = time_median(call, self.repeat, cuda, graph=True) * 1e3
            picks[name] = picked(tuner)
        row = {"dense_len": self.dense_len, **self.shape(), "rank_v": rank,
               "rank_v_low": max(1, rank // 4), "num_splits": splits, "absorbed_num_splits": absorbed_splits,
               "sdpa_backend": full()[1], **timed,
               "unfused_ms": time_median(unfused, self.repeat, cuda) * 1e3,
               "sdpa_ms": time_median(full, self.repeat, cuda, graph=True) * 1e3,
               "fused_peak_bytes": peak_bytes(fused, cuda),
               "unfused_peak_bytes": peak_bytes(unfused, cuda),
               "sdpa_peak_bytes": peak_bytes(full, cuda),
               "compressed_bytes": read, "full_bytes": nbytes(full_k, full_v),
               # the fused call rebuilds and rotates keys as the unfused path does (the absorbed one attends
               # in rank space, keys as cached: another computation)
               "output_err": output_error(fused().out, unfused())}
        step = model.Step(batch=b, visual=n, dense=self.dense_len, heads=self.heads, kv_heads=self.kv_heads,
                          head_dim=self.head_dim, rank_k=rank, rank_v=rank, elem_bytes=dt.itemsize,
                          low_share=1.0 - self.full_rank_share, partial=self.partial, splits=splits,
                          rank_chunk=self.rank_chunk)
        absorbed_step = dataclasses.replace(step, splits=absorbed_splits)
        costs = model.costs(step)
        peak = hbm_peak_gbps(device)
        for name, variant in (("fused", "fused (exact)"), ("absorbed", "absorbed (latent)")):
            cost, seconds = costs[variant], row[f"{name}_ms"] / 1e3
            row[f"{name}_gbps"] = (cost["bytes"] + cost["mass_bytes"]) / seconds / 1e9
            row[f"{name}_hbm_pct"] = percent_of(row[f"{name}_gbps"], peak)
            row[f"{name}_tflops"] = cost["flops"] / seconds / 1e12
        if row["fused_peak_bytes"] is not None:  # the workspace is made ahead, but the kernel needs it all the same
            row["fused_peak_bytes"] += nbytes(fused_ws.logits, fused_ws.part_o, fused_ws.part_lse,
                                              fused_ws.part_rank)
        row["model_bytes"] = costs["fused (exact)"]["bytes"] + costs["fused (exact)"]["mass_bytes"]
        row["absorbed_model_bytes"] = costs["absorbed (latent)"]["bytes"] + costs["absorbed (latent)"]["mass_bytes"]
        row["full_rank_share"] = self.full_rank_share
        row["partial"] = self.partial
        row["rank_chunk"] = self.rank_chunk
        row["sdpa_hbm_pct"] = percent_of(row["full_bytes"] / (row["sdpa_ms"] / 1e3) / 1e9, peak)
        row["absorbed_vs_sdpa"] = row["sdpa_ms"] / row["absorbed_ms"]
        row["speedup_vs_unfused"] = row["unfused_ms"] / row["fused_ms"]
        row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["fused_ms"]
        row["fused_no_mass_vs_sdpa"] = row["sdpa_ms"] / row["fused_no_mass_ms"]
        row["absorbed_no_mass_vs_sdpa"] = row["sdpa_ms"] / row["absorbed_no_mass_ms"]
        row["compression_ratio"] = row["full_bytes"] / read
        for name, implementation in (("fused", "fused (exact)"), ("absorbed", "absorbed (latent)"),
                                     ("fused_no_mass", "fused (exact), no mass"),
                                     ("absorbed_no_mass", "absorbed (latent), no mass")):
            estimate_beside(row, name, model, implementation, absorbed_step if name.startswith("absorbed") else step,
                            row[f"{name}_ms"], (picks[name],), dtype=self.dtype)
        return row
