"""The attention-statistics kernels (kernels_py.ops.attention_stats) against
(i) PyTorch materialising softmax(QK^T) for the same rows and reducing it (a
few heads at a time, so the default sizes fit an 80 GB GPU), and (ii) one
FlashAttention forward over the same rows (the flash backend of SDPA,
forced; without the causal mask, which FlashAttention cannot take for rows
that end the prompt: it would spare under rows / keys of the work).

Batch is folded into the heads (head b*H + h reads kv head b*H_kv + h // group),
so one launch covers the batch. Rows are the last `rows` prompt positions (the
post-vision span of a VL-Cache prompt), or with `spread` that many of them drawn
from the positions before the others instead (ZipVL's random probe rows).
"""

from dataclasses import dataclass

import torch

from kernels_py.benchmarks.base import (
    ESTIMATE_ERROR, OUTPUT_ERROR, AttentionBenchmark, estimate_beside, estimate_columns, hbm_peak_gbps, nbytes,
    peak_bytes, output_error, percent_of, sdpa, time_median,
)
from kernels_py.attention import expand_kv
from kernels_py.ops.attention_stats import attention_stats, model, probe_rows
from kernels_py.params import Rule, knob
from kernels_py.tables import Column


MATERIALIZE_CHUNK_BYTES = 2 << 30  # float32 scores of the heads materialised at once


def _materialize(q, k, q_pos, p):
    """The unfused baseline: the [heads, rows, keys] probability matrix,
    materialised for whole kv groups of heads at a time (about
    MATERIALIZE_CHUNK_BYTES of scores each), and reduced."""
    heads, rows, _ = q.shape
    group, n = heads // k.shape[0], k.shape[1]
    per_head = rows * n * 4
    chunk = max(1, MATERIALIZE_CHUNK_BYTES // (per_head * group)) * group
    visible = torch.arange(n, device=q.device)[None, :] <= q_pos[:, None]
    sums, below = [], []
    for h0 in range(0, heads, chunk):
        qh = q[h0:h0 + chunk].float()
        kh = expand_kv(k[h0 // group:(h0 + qh.shape[0]) // group].float(), qh.shape[0])
        scores = (qh @ kh.transpose(1, 2)) * q.shape[-1] ** -0.5
        attn = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        below.append(((attn < p * attn.amax(-1, keepdim=True)) & visible).sum(1))
        sums.append(attn.sum(1))
    return torch.cat(sums), torch.cat(below)


@dataclass(frozen=True)
class Stats(AttentionBenchmark):
    """Attention-statistics kernels vs materialised softmax and vs one SDPA forward over the same rows."""

    name = "stats"
    length_column = "prompt_len"
    columns = (
        Column("prompt_len", "", "keys (prompt tokens)", "prompt"),
        Column("batch", "", "sequences, folded into the heads"),
        Column("rows", "", "selected query rows", show=False),
        Column("spread", "", "of the rows, how many are drawn from before the last ones", show=False),
        *AttentionBenchmark.SHAPE_COLUMNS,
        Column("stats_seconds", "s", "the statistics call (row pass, merge where split, column pass), median", "stats"),
        Column("stats_gbps", "GB/s", "K bytes the pipeline must read (twice) / time", "GB/s"),
        Column("stats_hbm_pct", "%", "stats_gbps as a share of the GPU's HBM bandwidth", "% HBM"),
        Column("materialize_seconds", "s", "softmax(QK^T) materialised and reduced in PyTorch", "materialise"),
        Column("sdpa_seconds", "s", "one FlashAttention forward (SDPA, flash forced) over the rows", "SDPA"),
        Column("sdpa_backend", "", "the SDPA backend that ran (flash where PyTorch has it for the inputs)",
               show=False),
        Column("stats_vs_sdpa", "x", "stats time / SDPA time", "stats/SDPA"),
        Column("materialize_vs_stats", "x", "materialised time / stats time", "materialise/stats"),
        Column("stats_peak_bytes", "bytes", "extra device memory of the kernels at their peak", "peak stats"),
        Column("materialize_peak_bytes", "bytes", "extra device memory of the materialised path",
               "peak materialise"),
        Column("sdpa_peak_bytes", "bytes", "extra device memory of SDPA", show=False),
        *estimate_columns("stats", "the statistics call (float16 only: the model's dtype)"),
        ESTIMATE_ERROR,
        OUTPUT_ERROR,
    )
    smoke = ({"lengths": (256,), "rows": 16}, {"batches": (1,)}, {"heads": 4, "kv_heads": 2, "head_dim": 64},
             {"dtype": "float32"}, {"repeat": 2})

    lengths: tuple = knob("ints", (1024, 4096, 16384, 65536, 131072), "prompt lengths (keys)", min=1,
                          max=1 << 24)
    batches: tuple = knob("ints", (1, 4, 16), "batch sizes", min=1, max=4096)
    rows: int = knob("int", 50, "selected query rows (the last ones of the prompt)", min=1, max=1 << 20)
    spread: int = knob("int", 0, "of the rows, how many are drawn at random (seed 0) from the positions before the "
                       "others (ZipVL's random probe rows; 0: the last rows only)", min=0, max=1 << 20,
                       ref="ZipVL appendix A")
    p: float = knob("float", 0.01, "ThresholdFilter threshold", min=0.0, max=1.0, ref="VL-Cache Eq. 1")

    RULES = (Rule("rows <= min(lengths)", "rows ({rows}) exceed the shortest prompt length in lengths={lengths}"),
             Rule("spread <= rows", "spread ({spread}) exceeds rows ({rows}): it is how many of the rows are drawn "
                                    "from before the last ones"))

    def measure(self, case):
        x = self.inputs(case)
        n, b, device, cuda = x.tokens, x.batch, x.device, x.cuda
        q_pos = probe_rows(n, recent=self.rows - self.spread, random=self.spread)
        q = torch.randn(b * self.heads, self.rows, self.head_dim, generator=x.generator, device=device).to(x.dtype)
        k = torch.randn(b * self.kv_heads, n, self.head_dim, generator=x.generator, device=device).to(x.dtype)
        v = torch.randn_like(k)
        # The rows are chosen here: their range is known, so the call never waits for the host.
        known = (int(q_pos.min()), int(q_pos.max()))
        q_pos = q_pos.to(device)
        stats = lambda: attention_stats(q, k, q_pos, self.p, pos_range=known)  # noqa: E731
        mat = lambda: _materialize(q, k, q_pos, self.p)  # noqa: E731
        full = lambda: sdpa(q[None], k[None], v[None])  # noqa: E731
        row = {"rows": self.rows, "spread": self.spread, **self.shape(), "sdpa_backend": full()[1],
               "stats_seconds": time_median(stats, self.repeat, cuda, graph=True),
               "materialize_seconds": time_median(mat, self.repeat, cuda),
               "sdpa_seconds": time_median(full, self.repeat, cuda, graph=True),
               "stats_peak_bytes": peak_bytes(stats, cuda),
               "materialize_peak_bytes": peak_bytes(mat, cuda),
               "sdpa_peak_bytes": peak_bytes(full, cuda)}
        # K is read twice (row stats, column stats): the bytes the pipeline must move.
        # What the kernels compute that the materialised matrix gives: each key's attention over the rows.
        row["output_err"] = output_error(stats().attn_sum, mat()[0])
        row["stats_gbps"] = 2 * nbytes(k) / row["stats_seconds"] / 1e9
        row["stats_hbm_pct"] = percent_of(row["stats_gbps"], hbm_peak_gbps(device))
        row["stats_vs_sdpa"] = row["stats_seconds"] / row["sdpa_seconds"]
        row["materialize_vs_stats"] = row["materialize_seconds"] / row["stats_seconds"]
        step = model.Step(batch=b, context=n, rows=self.rows, spread=self.spread, heads=self.heads,
                          kv_heads=self.kv_heads, head_dim=self.head_dim)
        estimate_beside(row, "stats", model, "statistics (two passes)", step, row["stats_seconds"] * 1e3,
                        dtype=self.dtype)
        return row
