"""AttentionPack (Ilhan et al., "Attention-aware Inference Optimizations for
Large Vision-Language Models with Memory-efficient Decoding").

Compression (section 3.1): the visual keys and values of a layer are each
factorized with one randomized SVD over all kv heads side by side,
X [T, H*D] ~= U [T, R] @ W [R, H*D] (`torch.svd_lowrank(x.float(), q=R,
niter=2)` as in the reference code, singular values folded into U), stored in
fp16. Text and system tokens stay uncompressed by default (the paper's VLM
runs); `compress_text` gives them a segment of their own. Keys are decomposed
with RoPE undone and rebuilt keys are rotated at their positions (the
reference code), or decomposed as cached, after RoPE (`rope`), which allows
attending in rank space (`absorbed`).

Decoding (Algorithm 1): each step appends the new token to the uncompressed
segment and runs the low-rank decode op (kernels_py.ops.lowrank_decode; its
reference on CPU, see the backend knob), which rebuilds every compressed
token with its own rank prefix inside the attention and returns each token's
attention mass averaged over query heads; that mass feeds the importance EMA
of Eq. 1. Tokens are split into groups by importance (`groups`, re-derived
every step, or every `importance_every` steps, which then skip the masses):
the most important group is rebuilt at full rank, the others at
a fraction of it (section 3.2), or evicted (`low_group`, Table 4's "(E)").
The cache stores each group in its own run of slots, so the kernel's tiles
have one rank and rebuild keys only up to it; a step moves only the tokens
whose group changed (`regrouped_per_step`).

Where the decode op departs from the paper's description: attention runs
in the cache's dtype on tensor cores with float32 accumulation (section
7.1.1 computes attention in full precision), and the fused kernel keeps
values in rank space, applying W_v once to the attention-weighted U_v, so
the lower value ranks of section 3.2 save U_v reads, not a rebuild's FLOPs
(`decompression_flops_ratio` is the paper's count). The kernels hold at most
256 rank-space columns of values (keys too when absorbed): a per-head cache
needs rank x kv_heads of them, and more is refused on the kernel path.

Where the paper is open, this implementation decides:
- Importance before the first step is the last prompt query's attention,
  averaged over heads (the reference code's first score; Eq. 1's T_q > 1
  form, for a user's input of several tokens, would average the prompt's
  question rows instead); a generated token starts at 0 and enters the EMA
  with its first step's mass.
- Periodic compression (lines 14-17): generated tokens wait in the
  uncompressed segment; when `period` of them are there they are folded into
  a textual segment: the text segment when `compress_text`, else one of
  generated tokens alone, made at the first fold at `text_rank` (the prompt's
  text stays uncompressed, as in the paper's VLM runs). Never into the visual
  one: section 3.1 compresses the modalities apart, and compressing them
  together cost about 20% accuracy (section 8.2). A fold is a new SVD of the
  segment's tokens rebuilt at full compression rank plus the new ones, at
  the same rank. Line 15 factors K~, the cache as retrieved; rebuilding at
  full rank keeps the low group's rank cut a per-step saving rather than a
  permanent loss. The reference code re-factors only the image span and
  never compresses generated tokens; `period=0` does that.
- Ranks are chosen at prefill (the generated segment's is text_rank) and
  kept when folding (clipped to the tokens held, which loses nothing). At
  prefill a rank above min(T, H*D) of its segment is refused, so an image
  of fewer tokens than rank_k is an error rather than stored at a rank
  that saves nothing; a prompt without visual tokens has an empty visual
  segment (rank 0) and keeps every token uncompressed.
- Eviction ("evict") keeps the first group's share of the tokens ever
  admitted to a segment, by importance, after prefill and after every step:
  a budget, so the cache does not shrink geometrically step after step.
- 4-bit (or 2-bit) quantization (section 4.5, "following KVQuant"): U per
  token row in runs of `quant_group` rank channels (`quant_bits`), W per rank
  row in runs of `quant_group` channels with its own scales (`quant_w_bits`),
  uniform min-max codes with an fp16 scale and zero a run; not KVQuant's
  non-uniform levels and outlier handling. The paper does not say which
  factors it quantizes, but its 4-bit row holds exactly a quarter of the fp16
  row's bytes (Table 4: 64.5 -> 16.1 MB), which counts W, and the
  uncompressed text, at 4 bits too: `quant_bits=4, quant_w_bits=4` is the
  nearest setting (text stays fp16 here). At an image's length W dominates
  (LLaVA-1.5: 88% of the factors), so 4-bit U alone gains little. Quantized
  factors are dequantized once per decode step for the decode op, and that
  copy is dropped after the step: the cache holds the packed codes.
- Eviction (Table 4's "(E)") evicts the groups after the first (three
  quarters of the visual tokens with the default groups), as section 4.5's
  text says; the table's bytes (2.4 MB less, half of U's) fit half, which
  groups "0.5:1,0.5:0.25" give.
"""

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from kernels_py.methods.allocators import (
    GROUPS_PATTERN, GROUPS_RULES, group_rank, group_sizes, importance_groups, parse_groups,
)
from kernels_py.attention import apply_rope
from kernels_py.methods.base import Method, backend_knob
from kernels_py.methods.caches import kept_count
from kernels_py.methods.lowrank import Factor, LowRankCache, Segment, factorize
from kernels_py.methods.prompt import Prompt
from kernels_py.methods.scorers import LastRowImportance
from kernels_py.ops.common import DTYPES, use_triton
from kernels_py.ops.lowrank_decode.kernel import MAX_RANK_SPACE
from kernels_py.params import Rule, knob


def paper_compression_ratio(tokens: int, kv_heads: int, head_dim: int, rank_k: int, rank_v: int,
                            per_head: bool = False, held: int | None = None) -> float:
    """Section 3.1's C = T*H*D / (T*R + R*H*D), over K and V together; per head
    each of the H factorizations stores T*R + R*D. With eviction the cache
    holds `held` of the T tokens it was given: the full cache it stands for
    is still T tokens', its factors only `held` rows."""
    held = tokens if held is None else held
    if tokens == 0:  # nothing to compress (a prompt without visual tokens): nothing is saved either
        return 1.0
    full = 2 * tokens * kv_heads * head_dim
    if per_head:
        return full / sum(kv_heads * (held * r + r * head_dim) for r in (rank_k, rank_v))
    return full / sum(held * r + r * kv_heads * head_dim for r in (rank_k, rank_v))


@dataclass(frozen=True)
class AttentionPack(Method):
    """AttentionPack: visual K/V factorized by one SVD over all kv heads and
    rebuilt inside decode attention at ranks set by attention importance.

    Knob defaults are the paper's setting: visual tokens compressed, text and
    generated tokens left uncompressed (period 0, as its VLM runs leave
    them), attention-aware decompression as in its
    experiments (groups "0.25:1,0.75:0.25" on values: F = 2, r_1 = 0.25,
    R^(2) = R/4; keys at full rank).
    """

    name = "attentionpack"
    paper = ("Ilhan et al., Attention-aware Inference Optimizations for Large Vision-Language Models with "
             "Memory-efficient Decoding")

    rank_k: int = knob(
        "int", 64, "key rank R_k of the visual segment (the cap under rank_scheme=variance, the last layer's under "
        "linear); paper: 32 or 64 for images, 128 for video", min=1, max=65536, ref="AttentionPack section 4.3",
    )
    rank_v: int = knob("int", 64, "value rank R_v, as rank_k", min=1, max=65536, ref="AttentionPack section 4.3")
    rank_scheme: str = knob(
        "str", "fixed",
        "per-layer ranks (Table 3): fixed = rank_k/rank_v everywhere; linear = rising linearly from rank_min_k/_v "
        "at the first layer to rank_k/rank_v at the last (paper: 16 -> 128); variance = the smallest rank whose "
        "explained variance reaches variance_target, at most rank_k/rank_v (paper: 90%, cap 64)",
        choices=("fixed", "linear", "variance"), ref="AttentionPack Table 3",
    )
    rank_min_k: int = knob("int", 16, "first layer's key rank under rank_scheme=linear (paper: 16)", min=1,
                           max=65536, ref="AttentionPack Table 3")
    rank_min_v: int = knob("int", 16, "first layer's value rank under rank_scheme=linear (paper: 16 or 32)", min=1,
                           max=65536, ref="AttentionPack Table 3")
    variance_target: float = knob("float", 0.9, "explained variance the variance scheme aims for (paper: 0.9)",
                                  min=0.001, max=1.0, ref="AttentionPack Table 3")
    num_layers: int = knob(
        "int", 0, "layers the linear scheme spans; 0 = the number of layers prefill_all is given", min=0, max=4096
    )
    head_mode: str = knob(
        "str", "combined",
        "combined = one SVD of the kv heads side by side [T, H*D] (the paper); per_head = one SVD per kv head at "
        "the same rank (Figure 2's baseline; stores H times U and as much W, though the decode op's layout holds "
        "W block-diagonal, H times its bytes, which the cache's bytes leave out)",
        choices=("combined", "per_head"), ref="AttentionPack section 3.1, Figure 2",
    )
    rope: str = knob(
        "str", "before",
        "before = decompose keys with RoPE undone and rotate rebuilt keys at their positions (the reference "
        "code); after = decompose keys as cached, rotated",
        choices=("before", "after"), ref="AttentionPack reference code",
    )
    rope_base: float = knob(
        "float", 0.0, "RoPE base used to undo and redo the rotation under rope=before; 0 = the workload's (the "
        "synthetic rope_base, a trace's header, the model's config); another value must equal it", min=0.0,
        max=1e9,
    )
    absorbed: bool = knob(
        "bool", False, "attend in rank space (q W^T against U, the lowrank_decode_absorbed kernel); needs "
        "rope=after",
    )
    compress_text: bool = knob(
        "bool", False, "also factorize the text and system tokens, as a segment of their own at text_rank "
        "(the paper's VLM runs keep them uncompressed)",
    )
    text_rank: int = knob("int", 16, "rank of the text segment's keys and values when compress_text, and of the "
                          "segment generated tokens fold into without it (period > 0)", min=1, max=65536)
    period: int = knob(
        "int", 0, "compression period T_p: once this many generated tokens wait uncompressed they are folded "
        "by a new SVD into the text segment (compress_text) or one of generated tokens at text_rank, never the "
        "visual one (Algorithm 1, lines 14-17; the paper gives no value); 0 = never (the default: the paper's "
        "VLM runs leave generated text uncompressed)", min=0, max=1 << 20,
        ref="AttentionPack Algorithm 1",
    )
    groups: str = knob(
        "str", "0.25:1,0.75:0.25",
        "attention-aware decompression groups, most important first, as 'token_fraction:rank_fraction,...' "
        "(fractions sum to 1; group 1 at full rank); '1:1' = none; paper: '0.25:1,0.75:0.25'",
        ref="AttentionPack section 3.2", pattern=GROUPS_PATTERN,
    )
    partial: str = knob(
        "str", "values", "which factors the lower-ranked groups apply to (paper: values)",
        choices=("values", "keys", "both"), ref="AttentionPack section 4.1",
    )
    alpha: float = knob("float", 0.25, "EMA weight alpha of Eq. 1 (paper: 0.25)", min=0.0, max=0.999,
                        ref="AttentionPack Eq. 1")
    importance_every: int = knob(
        "int", 1, "update Eq. 1's importance and regroup on decode steps 1, N+1, 2N+1, ... and on every fold; "
        "the steps between attend without the per-token attention masses, which the kernel then neither "
        "writes nor reads back (the reference backend computes them anyway). 1 = every step, as the paper "
        "does; larger is this implementation's option", min=1, max=1 << 20, ref="AttentionPack Eq. 1",
        id_omits_default=True,  # runs planned before the knob keep their job ids
    )
    low_group: str = knob(
        "str", "decompress", "what happens to the groups after the first: decompress at their lower rank, or "
        "evict (Table 4's '(E)': the cache keeps the first group's share of the tokens, by importance)",
        choices=("decompress", "evict"), ref="AttentionPack section 4.5, Table 4",
    )
    quant_bits: int = knob(
        "int", 0, "bits of U's quantization (section 4.5 uses 4; its bytes count W at 4 bits too, see "
        "quant_w_bits); 0 = none. At LLaVA-1.5 shapes (576 visual tokens, width 4096, rank 64) W is 88% of the "
        "factors: 4-bit U alone shrinks the factors about 1.1x, with quant_w_bits=4 3.2x (the "
        "compression_ratio metric is measured, not assumed)",
        choices=(0, 2, 4), min=0, max=4,
        ref="AttentionPack section 4.5",
    )
    quant_w_bits: int = knob(
        "int", 0, "bits of W's quantization, per rank row in runs of quant_group channels with scales and zeros "
        "of its own; 0 = none (fp16 W). Section 4.5's 4-bit row holds a quarter of its fp16 row's bytes, so W "
        "at 4 bits with quant_bits=4 is the nearest setting", choices=(0, 2, 4), min=0, max=4,
        ref="AttentionPack section 4.5, Table 4",
    )
    quant_group: int = knob(
        "int", 32, "elements per quantization run: rank channels of a token's U row, output channels of a W row "
        "(one fp16 scale and zero each)",
        min=4, max=65536,
    )
    factor_dtype: str = knob(
        "str", "float16", "storage dtype of U and W (the paper: fp16)", choices=tuple(DTYPES),
        ref="AttentionPack section 3.1",
    )
    seed: int = knob("int", 0, "seed of the randomized SVD's test matrices", min=0, max=2**31 - 1)
    backend: str = backend_knob("decode attention and prefill statistics")

    RULES = GROUPS_RULES + (
        Rule("rope_base == 0 or rope_base >= 2", "rope_base={rope_base} is not a RoPE base: 0 (the workload's) or "
             "at least 2"),
        Rule('not absorbed or rope == "after"', "absorbed=True attends in rank space, which needs keys decomposed "
             "after RoPE: set rope='after' (rope={rope!r})"),
        Rule("quant_bits == 0 or quant_group % (8 // quant_bits) == 0",
             "quant_group={quant_group} must be a multiple of 8 // quant_bits for {quant_bits}-bit codes "
             "(whole bytes per run)"),
        Rule("quant_w_bits == 0 or quant_group % (8 // quant_w_bits) == 0",
             "quant_group={quant_group} must be a multiple of 8 // quant_w_bits for {quant_w_bits}-bit codes "
             "(whole bytes per run)"),
        Rule('rank_scheme != "linear" or (rank_min_k <= rank_k and rank_min_v <= rank_v)',
             "the linear scheme rises from rank_min to rank: got rank_min_k={rank_min_k}, rank_k={rank_k}, "
             "rank_min_v={rank_min_v}, rank_v={rank_v}"),
    )

    @cached_property
    def _groups(self) -> tuple[tuple[float, float], ...]:
        return parse_groups(self.groups)

    # --- prefill -----------------------------------------------------------------------------------

    def prefill(self, layer, q, k, v, spans) -> LowRankCache:
        return self._prefill(Prompt([q], [k], [v], spans), 0, layer, self.num_layers)

    def prefill_all(self, q, k, v, spans) -> list[LowRankCache]:
        prompt = Prompt(q, k, v, spans)
        layers = self.num_layers or prompt.layers
        return [self._prefill(prompt, layer, layer, layers) for layer in range(prompt.layers)]

    def layer_ranks(self, layer: int, num_layers: int) -> tuple[int, int]:
        """(R_k, R_v) of the visual segment; the cap under rank_scheme=variance."""
        if self.rank_scheme != "linear":
            return self.rank_k, self.rank_v
        if num_layers < 1:
            raise ValueError(f"{self.owner_name()}: rank_scheme='linear' needs the layer count: set num_layers "
                             f"or build the caches with prefill_all")
        if not 0 <= layer < num_layers:
            raise ValueError(f"{self.owner_name()}: layer {layer} is outside the {num_layers} layers of num_layers")
        t = layer / (num_layers - 1) if num_layers > 1 else 1.0
        return tuple(math.floor(low + (high - low) * t + 0.5)
                     for low, high in ((self.rank_min_k, self.rank_k), (self.rank_min_v, self.rank_v)))

    def _prefill(self, prompt: Prompt, index: int, layer: int, num_layers: int) -> LowRankCache:
        """The cache of prompt layer `index`, which is model layer `layer` (seeds, linear ranks)."""
        q, k, v, spans = prompt.q[index], prompt.k[index], prompt.v[index], prompt.spans
        self._check_prompt(layer, q, k, v, spans)
        tokens = k.shape[1]
        visual = spans.visual_positions().to(k.device)
        is_visual = torch.zeros(tokens, dtype=torch.bool, device=k.device)
        is_visual[visual] = True
        text = (~is_visual).nonzero()[:, 0]
        importance = self._importance.prefill(prompt, index)
        theta = self._theta(spans, layer)
        frame = self._decomposition_frame(k, torch.arange(tokens, device=k.device), theta)

        rank_k, rank_v = self.layer_ranks(layer, num_layers)
        variance = self.variance_target if self.rank_scheme == "variance" else None
        segments = [self._segment(layer, "visual", 0, frame[:, visual], v[:, visual], visual, importance[visual],
                                  rank_k, rank_v, variance)]
        if self.compress_text:
            segments.append(self._segment(layer, "text", 1, frame[:, text], v[:, text], text, importance[text],
                                          self.text_rank, self.text_rank, None))
            text = text[:0]
        cache = LowRankCache(
            segments, k[:, text], v[:, text], text, importance[text], tokens, tokens,
            self.head_mode == "per_head", theta,
            DTYPES[self.factor_dtype], 1 if self.compress_text else None,
        )
        cache.notes.update(explained_variance_k=segments[0].k.explained, explained_variance_v=segments[0].v.explained)
        self._settle(cache)
        cache.regrouped = 0  # prefill's grouping is the layout, not a change of group
        if use_triton(self.backend, k.device):
            self._check_rank_space(layer, cache)
        return cache

    @property
    def _importance(self) -> LastRowImportance:
        """Importance before the first step: the last prompt query's attention,
        averaged over heads; then Eq. 1's moving average."""
        return LastRowImportance(self.alpha, self.backend)

    def _check_prompt(self, layer, q, k, v, spans) -> None:
        # Shapes and spans are Prompt's checks (methods.prompt.check_prompt).
        if self.rope == "before" and k.shape[2] % 2:
            raise ValueError(f"{self.owner_name()}: layer {layer}: rope='before' needs an even head_dim, got "
                             f"{k.shape[2]}")

    def _theta(self, spans, layer) -> float | None:
        """The RoPE base keys are unrotated and rotated with under rope=before
        (None under rope=after): the workload's, which rope_base may only
        confirm. A model whose rotation does not follow from token positions
        (M-RoPE), or whose RoPE is scaled (the decode kernels redo plain
        RoPE from a base alone), is refused."""
        if self.rope != "before":
            return None
        where = f"{self.owner_name()}: layer {layer}"
        if spans.rope.kind != "default":
            raise ValueError(f"{where}: the workload's keys are rotated with {spans.rope.kind} (3-D positions): "
                             f"rope='before' cannot undo that from token positions; use rope='after'")
        if spans.rope.scaled:
            raise ValueError(f"{where}: the workload's keys are rotated with {spans.rope.scaling} RoPE scaling "
                             f"(factor {spans.rope.factor:g}), and rope='before' rotates rebuilt keys with plain "
                             f"RoPE of base theta (the lowrank decode kernels take no scaling), at the wrong "
                             f"angles: use rope='after'")
        if self.rope_base and self.rope_base != spans.rope.theta:
            raise ValueError(f"{where}: rope_base={self.rope_base:g} but the workload's keys were rotated with "
                             f"theta {spans.rope.theta:g}: leave rope_base at 0 to use it")
        return spans.rope.theta

    def _decomposition_frame(self, k: torch.Tensor, positions: torch.Tensor, theta: float | None) -> torch.Tensor:
        """Keys [kv_heads, n, d] float32 as they are decomposed: RoPE undone (base theta) under rope=before."""
        k = k.float()
        return apply_rope(k, -positions, theta) if theta is not None else k

    def _segment(self, layer, name, index, k_frame, v, positions, importance, rank_k, rank_v, variance) -> Segment:
        kv_heads, tokens, head_dim = v.shape
        width = head_dim if self.head_mode == "per_head" else kv_heads * head_dim
        if tokens == 0:  # a prompt without visual tokens: nothing to compress, every token stays uncompressed
            return Segment(name, self._empty_factor(kv_heads, head_dim, v), self._empty_factor(kv_heads, head_dim, v),
                           positions, importance.float(), 0, rank_k, rank_v)
        bound = min(tokens, width)
        for which, rank in (("rank_k", rank_k), ("rank_v", rank_v)):
            if rank > bound:
                shape = "T, D" if self.head_mode == "per_head" else "T, H*D"
                raise ValueError(f"{self.owner_name()}: layer {layer}: {which}={rank} of the {name} segment exceeds "
                                 f"min({shape}) = min({tokens}, {width}) = {bound}")
        seed = self._seed(layer, index, 0)
        k_factor = self._factorize(k_frame, rank_k, seed, variance, explained=True)
        v_factor = self._factorize(v, rank_v, seed + 1, variance, explained=True)
        return Segment(name, k_factor, v_factor, positions, importance.float(), tokens, k_factor.rank, v_factor.rank)

    def _empty_factor(self, kv_heads: int, head_dim: int, like: torch.Tensor) -> Factor:
        """Rank-0 factors of no tokens (nothing lost: explained 1)."""
        dtype = DTYPES[self.factor_dtype]
        if self.head_mode == "per_head":
            u, w = like.new_zeros(kv_heads, 0, 0, dtype=dtype), like.new_zeros(kv_heads, 0, head_dim, dtype=dtype)
        else:
            u, w = like.new_zeros(0, 0, dtype=dtype), like.new_zeros(0, kv_heads * head_dim, dtype=dtype)
        return Factor(u, w, 0, 1.0)

    def _seed(self, layer: int, segment: int, folds: int) -> int:
        return (self.seed * 1_000_003 + layer * 7919 + segment * 104_729 + folds * 2) % (2**62)

    def _factorize(self, x, rank, seed, variance_target=None, explained=False):
        return factorize(x, rank, per_head=self.head_mode == "per_head", dtype=DTYPES[self.factor_dtype], seed=seed,
                         variance_target=variance_target, quant_bits=self.quant_bits, quant_group=self.quant_group,
                         w_bits=self.quant_w_bits,
                         explained=explained)

    # --- decode ------------------------------------------------------------------------------------

    def decode(self, layer, cache, q_t, k_t, v_t) -> torch.Tensor:
        """One step of Algorithm 1 (lines 4-17); returns the output [heads, 1, d]."""
        if not isinstance(cache, LowRankCache):
            raise TypeError(f"{self.owner_name()}: decode needs the cache its prefill built, "
                            f"got {type(cache).__name__}")
        self.check_step(layer, cache, q_t, k_t, v_t)
        if use_triton(self.backend, q_t.device):
            self._check_rank_space(layer, cache)
        cache.append(k_t, v_t)
        cache.flops_ratios.append(self._flops_ratio(cache))
        step = len(cache.flops_ratios)  # one ratio per decode step
        folded = bool(self.period and cache.buffer >= self.period)
        # A fold scores its step: the tokens it admits must not enter the groups (or eviction) unscored.
        scored = folded or (step - 1) % self.importance_every == 0
        result = cache.attend(q_t, absorbed=self.absorbed, backend=self.backend, mass=scored)
        if scored:
            importance = self._importance
            masses = result.mass_comp[0].split([s.tokens for s in cache.segments])
            for seg, mass in zip(cache.segments, masses):
                seg.importance = importance.update(seg.importance, mass)
            cache.dense_importance = importance.update(cache.dense_importance, result.mass_dense[0])
        if folded:
            self._fold(layer, cache)
        if scored or folded:  # the groups follow the importance, which only these steps change
            self._settle(cache)
        return result.out[0]

    def _check_rank_space(self, layer: int, cache: LowRankCache) -> None:
        """The decode kernels keep values (the absorbed one keys too) in rank
        space, MAX_RANK_SPACE columns at most: every segment's rank side by
        side, times the kv heads per head, counting what folds will add (the
        generated segment at text_rank, a fold target up to its rank), so a
        cache is refused at prefill rather than at its first fold."""
        unit = cache.kv_heads if cache.per_head else 1
        width = cache.head_dim if cache.per_head else cache.kv_heads * cache.head_dim
        for name, knob_name, needed in (("values", "rank_v", True), ("keys", "rank_k", self.absorbed)):
            ranks = []
            for i, s in enumerate(cache.segments):
                rank = (s.v if name == "values" else s.k).rank
                if self.period and i == cache.fold_target:
                    rank = max(rank, min(s.target_v if name == "values" else s.target_k, width))
                ranks.append((s.name, rank))
            if self.period and cache.fold_target is None:
                ranks.append(("generated", min(self.text_rank, width)))
            columns = sum(r for _, r in ranks) * unit
            if needed and columns > MAX_RANK_SPACE:
                per = f" x {unit} kv heads (head_mode=per_head)" if cache.per_head else ""
                raise ValueError(
                    f"{self.owner_name()}: layer {layer}: the decode kernel holds {name} in rank space, at most "
                    f"{MAX_RANK_SPACE} columns, and this cache needs {columns} "
                    f"({' + '.join(f'{n} {r}' for n, r in ranks)}{per}): lower {knob_name} or text_rank"
                    + (", use head_mode=combined" if cache.per_head else "")
                    + ", or run backend=torch (the reference, slower)")

    def _settle(self, cache: LowRankCache) -> None:
        """Evict (low_group=evict), or keep each importance group in its own run
        of slots (the most important first), each slot with its group's rank:
        the decode kernel's tiles then have one rank and rebuild only up to
        it. Only the tokens whose group changed move."""
        fractions = [f for f, _ in self._groups]
        for index, seg in enumerate(cache.segments):
            if self.low_group == "evict":
                budget = kept_count(fractions[0], seg.admitted)
                if seg.tokens > budget:
                    keep = seg.importance.topk(budget).indices.sort().values
                    seg.k, seg.v = seg.k.select(keep), seg.v.select(keep)
                    seg.positions, seg.importance = seg.positions[keep], seg.importance[keep]
                    cache.segments_changed()
                self._set_ranks(cache, seg, torch.full_like(seg.positions, seg.k.rank),
                                torch.full_like(seg.positions, seg.v.rank))
                continue
            sizes = group_sizes(seg.tokens, fractions)
            device = seg.positions.device
            slot_group = torch.repeat_interleave(torch.arange(len(sizes), device=device),
                                                 torch.tensor(sizes, device=device))
            wanted = importance_groups(seg.importance, sizes, seg.positions)
            misplaced = wanted != slot_group
            if misplaced.any():
                # Group g's vacated slots take the tokens coming into g (as many: sizes are fixed).
                dst = torch.cat([(misplaced & (slot_group == g)).nonzero()[:, 0] for g in range(len(sizes))])
                src = torch.cat([(misplaced & (wanted == g)).nonzero()[:, 0] for g in range(len(sizes))])
                cache.regroup(index, dst, src)
            ranks = {}
            for name, factor in (("keys", seg.k), ("values", seg.v)):
                by_group = torch.tensor([group_rank(share, factor.rank) for _, share in self._groups], device=device)
                partial = self.partial in (name, "both")
                ranks[name] = by_group[slot_group] if partial else torch.full_like(seg.positions, factor.rank)
            self._set_ranks(cache, seg, ranks["keys"], ranks["values"])

    @staticmethod
    def _set_ranks(cache: LowRankCache, seg: Segment, ranks_k: torch.Tensor, ranks_v: torch.Tensor) -> None:
        if seg.ranks_k is None or not (torch.equal(seg.ranks_k, ranks_k) and torch.equal(seg.ranks_v, ranks_v)):
            seg.ranks_k, seg.ranks_v = ranks_k, ranks_v
            cache.ranks_changed()

    def _flops_ratio(self, cache: LowRankCache) -> float:
        """Section 3.2: decompression FLOPs 2*H*D*sum_t R(t) against 2*H*D*T*R
        at full rank, K and V together; T counts evicted tokens too."""
        spent = sum(int(s.ranks_k.sum()) + int(s.ranks_v.sum()) for s in cache.segments)
        full = sum(s.admitted * (s.k.rank + s.v.rank) for s in cache.segments)
        return spent / full if full else 1.0

    def _fold(self, layer: int, cache: LowRankCache) -> None:
        """Lines 14-17: the buffer of generated tokens joins the textual
        segment, which is factorized again from its tokens rebuilt at full
        rank plus the new ones; without one, the first fold makes it."""
        waiting = cache.dense_positions >= cache.prompt_tokens
        new_k = self._decomposition_frame(cache.dense_k[:, waiting], cache.dense_positions[waiting], cache.rope_base)
        new_v = cache.dense_v[:, waiting].float()
        new_positions, new_importance = cache.dense_positions[waiting], cache.dense_importance[waiting]
        if cache.fold_target is None:
            target, name, target_k, target_v = len(cache.segments), "generated", self.text_rank, self.text_rank
            k_frame, values, positions, importance = new_k, new_v, new_positions, new_importance
            admitted = int(waiting.sum())
        else:
            target, seg = cache.fold_target, cache.segments[cache.fold_target]
            name, target_k, target_v = seg.name, seg.target_k, seg.target_v
            k_frame = torch.cat([self._rebuild(cache, seg.k), new_k], dim=1)
            values = torch.cat([self._rebuild(cache, seg.v), new_v], dim=1)
            positions = torch.cat([seg.positions, new_positions])
            importance = torch.cat([seg.importance, new_importance])
            admitted = seg.admitted + int(waiting.sum())
        if self.low_group == "evict":  # drop before factorizing: the basis should serve what is kept
            keep = importance.topk(min(kept_count(self._groups[0][0], admitted), importance.numel())).indices
            keep = keep.sort().values
            k_frame, values = k_frame[:, keep], values[:, keep]
            positions, importance = positions[keep], importance[keep]
        cache.folds += 1
        width = cache.head_dim if cache.per_head else cache.kv_heads * cache.head_dim
        seed = self._seed(layer, target, cache.folds)
        # A rank above the tokens held would be padding: the factors are exact at min(rank, T).
        rank_k, rank_v = (min(rank, positions.numel(), width) for rank in (target_k, target_v))
        folded = Segment(name, self._factorize(k_frame, rank_k, seed), self._factorize(values, rank_v, seed + 1),
                         positions, importance, admitted, target_k, target_v)
        if target == len(cache.segments):
            cache.segments.append(folded)
            cache.fold_target = target
        else:
            cache.segments[target] = folded
        cache.dense_k, cache.dense_v = cache.dense_k[:, ~waiting], cache.dense_v[:, ~waiting]
        cache.dense_positions = cache.dense_positions[~waiting]
        cache.dense_importance = cache.dense_importance[~waiting]
        cache.segments_changed()

    def _rebuild(self, cache: LowRankCache, f) -> torch.Tensor:
        """[kv_heads, T, d] float32 at full rank, in the decomposition frame."""
        product = f.dense_u(cache.factor_dtype).float() @ f.dense_w(cache.factor_dtype).float()
        if cache.per_head:
            return product
        return product.view(product.shape[0], cache.kv_heads, cache.head_dim).transpose(0, 1)

    # --- accounting --------------------------------------------------------------------------------

    def layer_metrics(self, layer, cache) -> dict[str, float]:
        """rank_k / rank_v of the visual segment; explained_variance_k / _v of
        its prefill SVD at that rank; formula_compression_ratio: the paper's C
        for the visual tokens admitted, as stored now (evicted ones cost
        nothing); decompression_flops_ratio: section
        3.2's ratio averaged over the decode steps (the paper's count: on
        values the fused kernel reads fewer U_v columns rather than
        rebuilding fewer); regrouped_per_step: tokens
        that changed importance group (and slots) per decode step; token counts."""
        visual = cache.segments[0]
        ratios = cache.flops_ratios or [self._flops_ratio(cache)]
        return {
            "rank_k": float(visual.k.rank),
            "rank_v": float(visual.v.rank),
            "explained_variance_k": cache.notes["explained_variance_k"],
            "explained_variance_v": cache.notes["explained_variance_v"],
            "formula_compression_ratio": paper_compression_ratio(
                visual.admitted, cache.kv_heads, cache.head_dim, visual.k.rank, visual.v.rank, cache.per_head,
                held=visual.tokens),
            "decompression_flops_ratio": sum(ratios) / len(ratios),
            "regrouped_per_step": cache.regrouped / max(1, len(cache.flops_ratios)),
            "compressed_tokens": float(cache.compressed_tokens),
            "dense_tokens": float(cache.dense_positions.shape[0]),
            "evicted_tokens": float(sum(s.admitted - s.tokens for s in cache.segments)),
            "folds": float(cache.folds),
        }
