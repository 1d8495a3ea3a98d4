"""ZipVL's token-level sparse prefill (kernels_py.methods.sparse_prefill:
gather each kv head's important tokens, causal FlashAttention among them,
scatter the outputs back, zeros elsewhere) against one causal FlashAttention
prefill over all tokens (SDPA, flash forced where PyTorch has it).

Important tokens: a share `share` of each kv head's tokens, drawn at random
(sorted); what is timed does not depend on which. Choosing them as ZipVL
does (attention statistics over 64 recent and 64 random probe rows, Eq. 7's
normalized scores, the top share per kv head) is timed apart, `select_ms`,
and `total_speedup` charges it: at short prompts the probe rows' attention
is a large part of the sparse work (the paper finds ZipVL's prefill only as
fast as FlashAttention there). Reports both times, the attention part of the
sparse path alone, the speedups and the share of causal attention FLOPs
saved (1 - p(p+1) / (n(n+1)), the probe rows not counted); TFLOP/s on the
causal FLOPs each path computes.
"""

from dataclasses import dataclass

import torch

from kernels_py.attention import Spans
from kernels_py.benchmarks.base import AttentionBenchmark, sdpa, time_median
from kernels_py.methods import make_method
from kernels_py.methods import sparse_prefill as sp
from kernels_py.methods.prompt import Prompt
from kernels_py.params import knob
from kernels_py.tables import Column


@dataclass(frozen=True)
class SparsePrefill(AttentionBenchmark):
    """Token-level sparse prefill (gathered important tokens, FlashAttention) vs full FlashAttention prefill."""

    name = "sparse-prefill"
    length_column = "tokens"
    columns = (
        Column("tokens", "", "prompt tokens", "tokens"),
        Column("batch", "", "sequences (prefilled one after another)"),
        *AttentionBenchmark.SHAPE_COLUMNS,
        Column("share", "", "share of each kv head's tokens that are important", "important"),
        Column("sdpa_backend", "", "SDPA backend of both paths' attention (flash where PyTorch has it for the inputs)",
               show=False),
        Column("full_ms", "ms", "causal FlashAttention over every token, median", "full"),
        Column("sparse_ms", "ms", "gather, causal FlashAttention among the important tokens, scatter, median",
               "sparse"),
        Column("sparse_attention_ms", "ms", "the attention call of the sparse path alone", "sparse attn"),
        Column("select_ms", "ms", "choosing the important tokens as ZipVL does (probe rows' attention statistics, "
               "normalized scores, top share per kv head), median", "select"),
        Column("speedup", "x", "full time / sparse time", "full/sparse"),
        Column("total_speedup", "x", "full time / (select + sparse time): the prefill ZipVL runs", "full/(sel+sparse)"),
        Column("attention_speedup", "x", "full time / the sparse path's attention time", "full/attn"),
        Column("flops_saved", "%", "causal attention FLOPs the sparse prefill does not spend", "FLOPs saved"),
        Column("full_tflops", "", "causal attention FLOPs / full time, in TFLOP/s", show=False),
        Column("sparse_tflops", "", "the sparse path's causal FLOPs / its attention time, in TFLOP/s", show=False),
    )
    smoke = ({"lengths": (64,)}, {"batches": (1,)}, {"heads": 4, "kv_heads": 2, "head_dim": 32},
             {"dtype": "float32"}, {"repeat": 1})

    lengths: tuple = knob("ints", (8192, 16384, 32768, 65536, 131072), "prompt tokens", min=2, max=1 << 22)
    batches: tuple = knob("ints", (1,), "sequences", min=1, max=256)
    percents: tuple = knob("ints", (10, 30, 50), "important tokens, percent of each kv head's (ZipVL keeps 30-50% "
                           "on images)", min=1, max=100, ref="ZipVL Table 1")

    def cases(self):
        return ({self.length_column: n, "batch": b, "share": pct / 100}
                for n in self.lengths for b in self.batches for pct in self.percents)

    def measure(self, case):
        x = self.inputs(case)
        n, b, g, dev, dt = x.tokens, x.batch, x.generator, x.device, x.dtype
        hq, hk, d = self.heads, self.kv_heads, self.head_dim
        p = max(1, round(case["share"] * n))
        q = torch.randn(b, hq, n, d, generator=g, device=dev).to(dt)
        k = torch.randn(b, hk, n, d, generator=g, device=dev).to(dt)
        v = torch.randn_like(k)
        important = torch.stack([torch.randperm(n, generator=g, device=dev)[:p].sort().values for _ in range(hk)])
        per_head = important.repeat_interleave(hq // hk, 0)

        def full():
            for i in range(b):
                sp._sdpa(q[i], k[i], v[i])

        def sparse():
            for i in range(b):
                sp.sparse_prefill(q[i], k[i], v[i], important)

        gathered = [(q[i].gather(1, per_head[..., None].expand(-1, -1, d)),
                     k[i].gather(1, important[..., None].expand(-1, -1, d)),
                     v[i].gather(1, important[..., None].expand(-1, -1, d))) for i in range(b)]

        def attention_only():
            for qq, kk, vv in gathered:
                sp._sdpa(qq, kk, vv)

        selector = make_method("zipvl_fixed", {"ratio": case["share"]})
        spans = Spans(system=(0, 0), images=(), text=(0, n))

        def select():
            for i in range(b):
                selector.important_tokens(Prompt([q[i]], [k[i]], [v[i]], spans), 0)

        # Whether FlashAttention takes these inputs (dtype, head_dim) decides the backend of every call timed below;
        # a few tokens tell, and the runner warns of rows whose "FlashAttention" was another backend.
        backend = sdpa(q[:1, :, :16], k[:1, :, :16], v[:1, :, :16])[1]
        full_s = time_median(full, self.repeat, x.cuda)
        sparse_s = time_median(sparse, self.repeat, x.cuda)
        attn_s = time_median(attention_only, self.repeat, x.cuda)
        select_s = time_median(select, self.repeat, x.cuda)
        causal = lambda t: b * hq * t * (t + 1) / 2 * 4 * d  # noqa: E731  (QK and PV over causal pairs)
        return {**self.shape(), "share": case["share"], "sdpa_backend": backend, "full_ms": full_s * 1e3,
                "sparse_ms": sparse_s * 1e3, "sparse_attention_ms": attn_s * 1e3, "select_ms": select_s * 1e3,
                "speedup": full_s / sparse_s, "total_speedup": full_s / (select_s + sparse_s),
                "attention_speedup": full_s / attn_s,
                "flops_saved": 100 * sp.flops_saved(n, p), "full_tflops": causal(n) / full_s / 1e12,
                "sparse_tflops": causal(p) / attn_s / 1e12}
