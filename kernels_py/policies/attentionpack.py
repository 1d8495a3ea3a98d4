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
segment and runs the low-rank decode kernel (kernels_py.triton.lowrank_decode;
its reference on CPU, see kernels_py.backend), which rebuilds every compressed
token with its own rank prefix inside the attention and returns each token's
attention mass averaged over query heads; that mass feeds the importance EMA
of Eq. 1. Tokens are split into groups by importance (`groups`, re-derived
every step): the most important group is rebuilt at full rank, the others at
a fraction of it (section 3.2), or evicted (`low_group`, Table 4's "(E)").

Where the paper is open, this implementation decides:
- Importance before the first step is the last prompt query's attention,
  averaged over heads (the reference code's first score); a generated token
  starts at 0 and enters the EMA with its first step's mass.
- Periodic compression (lines 14-17): generated tokens wait in the
  uncompressed segment; when `period` of them are there they are folded into
  the compressed segment (the text segment when `compress_text`, else the
  visual one, the only compressed segment) by a new SVD of that segment's
  tokens rebuilt at full compression rank plus the new ones, at the same rank.
  Line 15 factors K~, the cache as retrieved; rebuilding at full rank keeps
  the low group's rank cut a per-step saving rather than a permanent loss.
  The reference code re-factors only the image span and never compresses
  generated tokens; `period=0` does that.
- Ranks are chosen at prefill and kept when folding (clipped to the tokens
  held, which loses nothing).
- Eviction ("evict") keeps the first group's share of the tokens ever
  admitted to a segment, by importance, after prefill and after every step:
  a budget, so the cache does not shrink geometrically step after step.
- 4-bit (or 2-bit) quantization (section 4.5) applies to U, per token row in
  runs of `quant_group` rank channels; W stays fp16 (it is shared by all
  tokens and small next to U for long contexts).
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from kernels_py.backend import BACKENDS, use_triton
from kernels_py.metrics import tensor_bytes
from kernels_py.params import knob
from kernels_py.policies import scoring
from kernels_py.policies.base import LayerCache, Policy, kept_count
from kernels_py.quantize import Quantized, check_params, dequantize, quantize
from kernels_py.ref import lowrank_decode as reference
from kernels_py.triton.lowrank_decode import CompressedKV, DenseKV
from kernels_py.workloads import Spans, apply_rope

FACTOR_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
SVD_NITER = 2  # power iterations of the reference code's torch.svd_lowrank
SUM_TOLERANCE = 1e-6


def parse_groups(text: str) -> tuple[tuple[float, float], ...]:
    """"0.25:1,0.75:0.25" -> ((0.25, 1.0), (0.75, 0.25)): per group, most
    important first, (share r_f of the compressed tokens, share of the rank R
    it is rebuilt with). Shares of tokens must sum to 1; rank shares lie in
    (0, 1], start at 1 (group 1 is rebuilt at the compression rank) and never grow."""
    groups = []
    for item in text.split(","):
        parts = item.split(":")
        try:
            fraction, rank_share = (float(p) for p in parts)
        except ValueError:
            raise ValueError(f"groups={text!r}: {item!r} is not 'token_fraction:rank_fraction'") from None
        if not (0.0 < fraction <= 1.0 and 0.0 < rank_share <= 1.0):
            raise ValueError(f"groups={text!r}: {item!r} needs a token fraction and a rank fraction in (0, 1]")
        groups.append((fraction, rank_share))
    total = sum(f for f, _ in groups)
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise ValueError(f"groups={text!r}: token fractions sum to {total:g}, not 1")
    shares = [s for _, s in groups]
    if shares[0] != 1.0 or any(b > a for a, b in zip(shares, shares[1:])):
        raise ValueError(f"groups={text!r}: rank fractions must start at 1 (full rank for the most important "
                         f"group) and never increase")
    return tuple(groups)


def group_sizes(tokens: int, fractions: list[float]) -> list[int]:
    """Tokens per group: group f ends at ceil(tokens * (r_1 + ... + r_f))."""
    bounds, cumulative = [], 0.0
    for fraction in fractions:
        cumulative += fraction
        bounds.append(min(tokens, math.ceil(round(cumulative * tokens, 9))))
    bounds[-1] = tokens
    return [b - a for a, b in zip([0] + bounds[:-1], bounds)]


def group_rank(rank_share: float, rank: int) -> int:
    """R^(f) = ceil(share * R), at least 1 (the paper's R/4: 64 -> 16)."""
    return max(1, math.ceil(round(rank_share * rank, 9)))


def group_ranks(importance: torch.Tensor, groups: tuple[tuple[float, float], ...], rank: int) -> torch.Tensor:
    """[T] int64 rank prefix of each token: tokens sorted by importance [T]
    (ties: earlier first) fill the groups in order."""
    order = torch.argsort(importance, descending=True, stable=True)
    ranks = torch.empty(importance.shape[0], dtype=torch.int64, device=importance.device)
    start = 0
    for size, (_, share) in zip(group_sizes(importance.shape[0], [f for f, _ in groups]), groups):
        ranks[order[start:start + size]] = group_rank(share, rank)
        start += size
    return ranks


def ema_update(importance: torch.Tensor, mass: torch.Tensor, alpha: float, new_tokens: int = 1) -> torch.Tensor:
    """Eq. 1: I <- alpha^Tq I + (1 - alpha^Tq) A, where A [T] is each token's
    attention averaged over heads and over the Tq new query tokens."""
    decay = alpha ** new_tokens
    return decay * importance + (1.0 - decay) * mass.float()


def paper_compression_ratio(tokens: int, kv_heads: int, head_dim: int, rank_k: int, rank_v: int,
                            per_head: bool = False) -> float:
    """Section 3.1's C = T*H*D / (T*R + R*H*D), over K and V together; per head
    each of the H factorizations stores T*R + R*D."""
    full = 2 * tokens * kv_heads * head_dim
    if per_head:
        return full / sum(kv_heads * (tokens * r + r * head_dim) for r in (rank_k, rank_v))
    return full / sum(tokens * r + r * kv_heads * head_dim for r in (rank_k, rank_v))


@contextmanager
def _seeded(seed: int, device: torch.device):
    """svd_lowrank draws its test matrix from the global generator: fork it so
    a job's result depends on its parameters only."""
    devices = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


@dataclass
class Factor:
    """One factorized matrix X ~= U @ W (keys or values of a segment).
    combined: u [T, R], w [R, H*D]; per head: u [H, T, R], w [H, R, D].
    u may be held quantized (per token row)."""

    u: torch.Tensor | Quantized
    w: torch.Tensor
    rank: int
    explained: float  # share of ||X||_F^2 the rank captured when factorized

    def dense_u(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.u).to(dtype) if isinstance(self.u, Quantized) else self.u

    @property
    def nbytes(self) -> int:
        u_bytes = self.u.nbytes if isinstance(self.u, Quantized) else tensor_bytes(self.u)
        return u_bytes + tensor_bytes(self.w)

    def select(self, index: torch.Tensor) -> "Factor":
        """Keep the tokens at `index` (rows of U; W is shared)."""
        axis = self.w.dim() - 2  # token axis of u: 0 combined, 1 per head
        if not isinstance(self.u, Quantized):
            return replace(self, u=self.u.index_select(axis, index))
        q = self.u  # runs lie along the rank axis, so rows can be picked without requantizing
        shape = list(q.shape)
        shape[axis] = index.numel()
        return replace(self, u=replace(q, data=q.data.index_select(axis, index),
                                       scale=q.scale.index_select(axis, index),
                                       zero=q.zero.index_select(axis, index), shape=tuple(shape)))


@dataclass
class Segment:
    """A run of compressed tokens (the visual ones; the text ones with compress_text)."""

    name: str
    k: Factor
    v: Factor
    positions: torch.Tensor  # [T] int64, ascending
    importance: torch.Tensor  # [T] float32, Eq. 1
    admitted: int  # tokens ever put in (the eviction budget's base)
    target_k: int  # the ranks the layer chose at prefill; folds clip them to what the tokens allow
    target_v: int
    ranks_k: torch.Tensor | None = None  # [T] int64 rank prefix each token gets at the next step
    ranks_v: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.positions.shape[0]


@dataclass
class PackedCache:
    """One layer's AttentionPack cache: compressed segments plus the
    uncompressed segment (text / system tokens unless compressed, and the
    buffer of generated tokens not yet folded). It reads like a LayerCache:
    `keys` / `values` are the effective (rebuilt, rotated) K/V [kv_heads, n, d]
    in position order, as attention sees them at the next step."""

    segments: list[Segment]
    dense_k: torch.Tensor  # [kv_heads, S, d], rotated, as the model caches it
    dense_v: torch.Tensor  # [kv_heads, S, d]
    dense_positions: torch.Tensor  # [S] int64, ascending
    dense_importance: torch.Tensor  # [S] float32
    seen: int
    prompt_tokens: int
    per_head: bool
    rope_base: float | None  # None when keys were decomposed after RoPE
    factor_dtype: torch.dtype
    fold_target: int  # index into segments
    folds: int = 0
    flops_ratios: list[float] = field(default_factory=list)  # per decode step, section 3.2
    notes: dict[str, float] = field(default_factory=dict)
    _view: tuple | None = field(default=None, repr=False)  # _effective()'s result until the cache changes

    @property
    def kv_heads(self) -> int:
        return self.dense_k.shape[0]

    @property
    def head_dim(self) -> int:
        return self.dense_k.shape[2]

    @property
    def buffer(self) -> int:
        """Generated tokens waiting uncompressed."""
        return int((self.dense_positions >= self.prompt_tokens).sum())

    @property
    def compressed_tokens(self) -> int:
        return sum(s.tokens for s in self.segments)

    @property
    def tokens(self) -> int:
        return self.compressed_tokens + self.dense_positions.shape[0]

    def kernel_factors(self, f: Factor) -> tuple[torch.Tensor, torch.Tensor]:
        """U [T, C], W [C, H*D] in the kernel's shared-basis layout. Per head,
        the H bases become one block-diagonal W whose columns interleave heads
        (column r*H + h = rank r of head h), so a rank prefix r*H rebuilds
        every head at rank r."""
        u = f.dense_u(self.factor_dtype)
        if not self.per_head:
            return u, f.w
        heads, tokens, rank = u.shape
        head_dim = f.w.shape[-1]
        blocks = f.w.new_zeros(rank, heads, heads, head_dim)
        diagonal = torch.arange(heads, device=f.w.device)
        blocks[:, diagonal, diagonal] = f.w.transpose(0, 1)
        return u.permute(1, 2, 0).reshape(tokens, rank * heads), blocks.reshape(rank * heads, heads * head_dim)

    def compressed_kv(self) -> CompressedKV:
        """Every compressed segment as one B = 1 CompressedKV: segments are
        blocks of a block-diagonal U over stacked W, a token's rank prefix
        skipping the (zero) columns of the segments before its own."""
        unit = self.kv_heads if self.per_head else 1
        parts = {"k": [], "v": []}
        for seg in self.segments:
            for name, f, ranks in (("k", seg.k, seg.ranks_k), ("v", seg.v, seg.ranks_v)):
                u, w = self.kernel_factors(f)
                parts[name].append((u, w, ranks * unit))
        built = {}
        for name, items in parts.items():
            offsets = torch.tensor([0] + [u.shape[1] for u, _, _ in items[:-1]]).cumsum(0).tolist()
            built[name] = (torch.block_diag(*[u for u, _, _ in items]), torch.cat([w for _, w, _ in items]),
                           torch.cat([r + o for (_, _, r), o in zip(items, offsets)]))
        (uk, wk, rank_k), (uv, wv, rank_v) = built["k"], built["v"]
        pos = torch.cat([s.positions for s in self.segments])
        length = torch.tensor([pos.shape[0]], device=pos.device)
        return CompressedKV(uk[None], wk[None], uv[None], wv[None], rank_k[None], rank_v[None], pos[None], length)

    def dense_kv(self) -> DenseKV:
        length = torch.tensor([self.dense_positions.shape[0]], device=self.dense_positions.device)
        return DenseKV(self.dense_k[None], self.dense_v[None], self.dense_positions[None], length)

    def _effective(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V [kv_heads, n, d] float32, positions [n], importance [n], in position order."""
        if self._view is None:
            self._view = self._rebuild_view()
        return self._view

    def changed(self) -> None:
        """Forget the effective K/V: call after changing tokens, ranks or importance."""
        self._view = None

    def _rebuild_view(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ck, cv = reference.decompress(self.compressed_kv(), self.kv_heads, self.rope_base)
        keys = torch.cat([ck[0], self.dense_k.float()], dim=1)
        values = torch.cat([cv[0], self.dense_v.float()], dim=1)
        positions = torch.cat([s.positions for s in self.segments] + [self.dense_positions])
        importance = torch.cat([s.importance for s in self.segments] + [self.dense_importance])
        order = positions.argsort()
        return keys[:, order], values[:, order], positions[order], importance[order]

    @property
    def keys(self) -> torch.Tensor:
        return self._effective()[0]

    @property
    def values(self) -> torch.Tensor:
        return self._effective()[1]

    @property
    def positions(self) -> torch.Tensor:
        """[kv_heads, n] int64: every kv head holds the same tokens."""
        return self._effective()[2].expand(self.kv_heads, -1)

    @property
    def scores(self) -> torch.Tensor:
        """[kv_heads, n] float32 importance (Eq. 1), shared by the kv heads."""
        return self._effective()[3].expand(self.kv_heads, -1)

    def append(self, k_t: torch.Tensor, v_t: torch.Tensor) -> None:
        """The generated token ([kv_heads, 1, d]) joins the uncompressed segment at position `seen`."""
        self.dense_k = torch.cat([self.dense_k, k_t.to(self.dense_k.dtype)], dim=1)
        self.dense_v = torch.cat([self.dense_v, v_t.to(self.dense_v.dtype)], dim=1)
        position = torch.tensor([self.seen], dtype=torch.int64, device=self.dense_positions.device)
        self.dense_positions = torch.cat([self.dense_positions, position])
        self.dense_importance = torch.cat([self.dense_importance, self.dense_importance.new_zeros(1)])
        self.seen += 1
        self.changed()


@dataclass(frozen=True)
class AttentionPack(Policy):
    """AttentionPack: visual K/V factorized by one SVD over all kv heads and
    rebuilt inside decode attention at ranks set by attention importance.

    Knob defaults are the paper's image-QA setting without attention-aware
    decompression (groups "1:1"); its experiments use groups
    "0.25:1,0.75:0.25" on values (F = 2, r_1 = 0.25, R^(2) = R/4).
    """

    name = "attentionpack"

    rank_k: int = knob(
        "int", 64, "key rank R_k of the visual segment (the cap under rank_scheme=variance, the last layer's under "
        "linear); paper: 32 or 64 for images, 128 for video", min=1, max=65536,
    )
    rank_v: int = knob("int", 64, "value rank R_v, as rank_k", min=1, max=65536)
    rank_scheme: str = knob(
        "str", "fixed",
        "per-layer ranks (Table 3): fixed = rank_k/rank_v everywhere; linear = rising linearly from rank_min_k/_v "
        "at the first layer to rank_k/rank_v at the last (paper: 16 -> 128); variance = the smallest rank whose "
        "explained variance reaches variance_target, at most rank_k/rank_v (paper: 90%, cap 64)",
        choices=("fixed", "linear", "variance"),
    )
    rank_min_k: int = knob("int", 16, "first layer's key rank under rank_scheme=linear (paper: 16)", min=1, max=65536)
    rank_min_v: int = knob(
        "int", 16, "first layer's value rank under rank_scheme=linear (paper: 16 or 32)", min=1, max=65536
    )
    variance_target: float = knob(
        "float", 0.9, "explained variance the variance scheme aims for (paper: 0.9)", min=0.001, max=1.0
    )
    num_layers: int = knob(
        "int", 0, "layers the linear scheme spans; 0 = the number of layers prefill_all is given", min=0, max=4096
    )
    head_mode: str = knob(
        "str", "combined",
        "combined = one SVD of the kv heads side by side [T, H*D] (the paper); per_head = one SVD per kv head at "
        "the same rank (Figure 2's baseline; stores H times the factors)",
        choices=("combined", "per_head"),
    )
    rope: str = knob(
        "str", "before",
        "before = decompose keys with RoPE undone and rotate rebuilt keys at their positions (the reference "
        "code); after = decompose keys as cached, rotated",
        choices=("before", "after"),
    )
    rope_base: float = knob(
        "float", 10000.0, "RoPE base used to undo and redo the rotation under rope=before; must match the model "
        "(the workload's rope_base)", min=2.0, max=1e9,
    )
    absorbed: bool = knob(
        "bool", False, "attend in rank space (q W^T against U, the lowrank_decode_absorbed kernel); needs "
        "rope=after",
    )
    compress_text: bool = knob(
        "bool", False, "also factorize the text and system tokens, as a segment of their own at text_rank "
        "(the paper's VLM runs keep them uncompressed)",
    )
    text_rank: int = knob("int", 16, "rank of the text segment's keys and values when compress_text", min=1,
                          max=65536)
    period: int = knob(
        "int", 64, "compression period T_p: once this many generated tokens wait uncompressed they are folded "
        "into the compressed segment by a new SVD (Algorithm 1, lines 14-17; the paper gives no value); "
        "0 = never", min=0, max=1 << 20,
    )
    groups: str = knob(
        "str", "1:1",
        "attention-aware decompression groups, most important first, as 'token_fraction:rank_fraction,...' "
        "(fractions sum to 1; group 1 at full rank); '1:1' = none; paper: '0.25:1,0.75:0.25'",
    )
    partial: str = knob(
        "str", "values", "which factors the lower-ranked groups apply to (paper: values)",
        choices=("values", "keys", "both"),
    )
    alpha: float = knob("float", 0.25, "EMA weight alpha of Eq. 1 (paper: 0.25)", min=0.0, max=0.999)
    low_group: str = knob(
        "str", "decompress", "what happens to the groups after the first: decompress at their lower rank, or "
        "evict (Table 4's '(E)': the cache keeps the first group's share of the tokens, by importance)",
        choices=("decompress", "evict"),
    )
    quant_bits: int = knob(
        "int", 0, "bits of U's quantization (section 4.5 uses 4); 0 = none", choices=(0, 2, 4), min=0, max=4,
    )
    quant_group: int = knob(
        "int", 32, "rank channels per quantization run of a token's U row (one fp16 scale and zero each)",
        min=4, max=65536,
    )
    factor_dtype: str = knob(
        "str", "float16", "storage dtype of U and W (the paper: fp16)", choices=tuple(FACTOR_DTYPES),
    )
    seed: int = knob("int", 0, "seed of the randomized SVD's test matrices", min=0, max=2**31 - 1)
    backend: str = knob(
        "str", "auto", "decode implementation: auto = Triton kernel on CUDA, reference on CPU", choices=BACKENDS,
    )

    def __post_init__(self):
        super().__post_init__()
        try:
            parse_groups(self.groups)
        except ValueError as err:
            raise ValueError(f"{self.owner_name()}: {err}") from None
        if self.absorbed and self.rope != "after":
            raise ValueError(f"{self.owner_name()}: absorbed=True attends in rank space, which needs keys "
                             f"decomposed after RoPE: set rope='after' (rope={self.rope!r})")
        if self.quant_bits:
            try:
                check_params(self.quant_bits, self.quant_group)
            except ValueError as err:
                raise ValueError(f"{self.owner_name()}: {err}") from None
        if self.rank_scheme == "linear" and (self.rank_min_k > self.rank_k or self.rank_min_v > self.rank_v):
            raise ValueError(f"{self.owner_name()}: the linear scheme rises from rank_min to rank: got "
                             f"rank_min_k={self.rank_min_k}, rank_k={self.rank_k}, rank_min_v={self.rank_min_v}, "
                             f"rank_v={self.rank_v}")

    @property
    def _groups(self) -> tuple[tuple[float, float], ...]:
        return parse_groups(self.groups)

    # --- prefill -----------------------------------------------------------------------------------

    def prefill(self, layer, q, k, v, spans) -> PackedCache:
        return self._prefill(layer, q, k, v, spans, self.num_layers)

    def prefill_all(self, q, k, v, spans) -> list[PackedCache]:
        layers = self.num_layers or len(q)
        return [self._prefill(layer, *qkv, spans, layers) for layer, qkv in enumerate(zip(q, k, v))]

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

    def _prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: Spans,
                 num_layers: int) -> PackedCache:
        self._check_prompt(layer, q, k, v, spans)
        prompt = k.shape[1]
        visual = spans.visual_positions().to(k.device)
        is_visual = torch.zeros(prompt, dtype=torch.bool, device=k.device)
        is_visual[visual] = True
        text = (~is_visual).nonzero()[:, 0]
        # Importance before the first step: the last prompt query's attention, averaged over heads.
        importance = scoring.stats(q, k, scoring.last_row(prompt), backend=self.backend).attn_sum.mean(dim=0)
        frame = self._decomposition_frame(k, torch.arange(prompt, device=k.device))

        rank_k, rank_v = self.layer_ranks(layer, num_layers)
        variance = self.rank_scheme == "variance"
        segments = [self._segment(layer, "visual", 0, frame[:, visual], v[:, visual], visual, importance[visual],
                                  rank_k, rank_v, variance)]
        if self.compress_text:
            segments.append(self._segment(layer, "text", 1, frame[:, text], v[:, text], text, importance[text],
                                          self.text_rank, self.text_rank, False))
            text = text[:0]
        cache = PackedCache(
            segments, k[:, text], v[:, text], text, importance[text], prompt, prompt,
            self.head_mode == "per_head", self.rope_base if self.rope == "before" else None,
            FACTOR_DTYPES[self.factor_dtype], len(segments) - 1,
        )
        cache.notes.update(explained_variance_k=segments[0].k.explained, explained_variance_v=segments[0].v.explained)
        self._settle(cache)
        return cache

    def _check_prompt(self, layer, q, k, v, spans) -> None:
        where = f"{self.owner_name()}: layer {layer}"
        if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
            raise ValueError(f"{where}: q must be [heads, T, d] and k, v [kv_heads, T, d] alike; got q "
                             f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        if q.shape[1:] != k.shape[1:] or q.shape[0] % k.shape[0]:
            raise ValueError(f"{where}: q {tuple(q.shape)} and k {tuple(k.shape)} disagree on tokens or head_dim, "
                             f"or heads is not a multiple of kv_heads")
        if k.shape[1] != spans.prompt_tokens:
            raise ValueError(f"{where}: the prompt has {k.shape[1]} tokens but the spans describe "
                             f"{spans.prompt_tokens}")
        if self.rope == "before" and k.shape[2] % 2:
            raise ValueError(f"{where}: rope='before' needs an even head_dim, got {k.shape[2]}")

    def _decomposition_frame(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Keys [kv_heads, n, d] float32 as they are decomposed: RoPE undone under rope=before."""
        k = k.float()
        return apply_rope(k, -positions, self.rope_base) if self.rope == "before" else k

    def _segment(self, layer, name, index, k_frame, v, positions, importance, rank_k, rank_v, variance) -> Segment:
        kv_heads, tokens, head_dim = v.shape
        width = head_dim if self.head_mode == "per_head" else kv_heads * head_dim
        bound = min(tokens, width)
        for which, rank in (("rank_k", rank_k), ("rank_v", rank_v)):
            if rank > bound:
                shape = "T, D" if self.head_mode == "per_head" else "T, H*D"
                raise ValueError(f"{self.owner_name()}: layer {layer}: {which}={rank} of the {name} segment exceeds "
                                 f"min({shape}) = min({tokens}, {width}) = {bound}")
        seed = self._seed(layer, index, 0)
        k_factor = self._factorize(k_frame, rank_k, variance, seed)
        v_factor = self._factorize(v, rank_v, variance, seed + 1)
        return Segment(name, k_factor, v_factor, positions, importance.float(), tokens, k_factor.rank, v_factor.rank)

    def _seed(self, layer: int, segment: int, folds: int) -> int:
        return (self.seed * 1_000_003 + layer * 7919 + segment * 104_729 + folds * 2) % (2**62)

    def _factorize(self, x: torch.Tensor, rank: int, variance: bool, seed: int) -> Factor:
        """x [kv_heads, T, d] -> Factor at `rank` (under variance: the smallest
        rank reaching variance_target, at most `rank`)."""
        rows = x.float() if self.head_mode == "per_head" else x.float().transpose(0, 1).reshape(x.shape[1], -1)
        with _seeded(seed, x.device):
            u, s, vecs = torch.svd_lowrank(rows, q=rank, niter=SVD_NITER)
        energy = s.square()
        if energy.dim() == 2:  # per head: one rank for all heads, so pool their energy
            energy = energy.sum(dim=0)
        captured = energy.cumsum(0) / rows.square().sum().clamp_min(torch.finfo(torch.float32).tiny)
        if variance:
            reached = (captured >= self.variance_target).nonzero()
            rank = int(reached[0, 0]) + 1 if reached.numel() else rank
        dtype = FACTOR_DTYPES[self.factor_dtype]
        u = (u[..., :rank] * s[..., None, :rank]).to(dtype)
        w = vecs[..., :rank].transpose(-1, -2).contiguous().to(dtype)
        if self.quant_bits:
            u = quantize(u, self.quant_bits, self.quant_group, dim=-1)
        return Factor(u, w, rank, float(captured[rank - 1]))

    # --- decode ------------------------------------------------------------------------------------

    def decode(self, layer, cache, q_t, k_t, v_t) -> torch.Tensor:
        """One step of Algorithm 1 (lines 4-17); returns the output [heads, 1, d]."""
        if not isinstance(cache, PackedCache):
            raise TypeError(f"{self.owner_name()}: decode needs the cache its prefill built, "
                            f"got {type(cache).__name__}")
        want = (cache.kv_heads, 1, cache.head_dim)
        if tuple(k_t.shape) != want or tuple(v_t.shape) != want or q_t.dim() != 3 or q_t.shape[1:] != (1, want[2]) \
                or q_t.shape[0] % want[0]:
            raise ValueError(f"{self.owner_name()}: layer {layer}: expected q_t [heads, 1, {want[2]}] with heads a "
                             f"multiple of {want[0]} and k_t, v_t {list(want)}; got {tuple(q_t.shape)}, "
                             f"{tuple(k_t.shape)}, {tuple(v_t.shape)}")
        cache.append(k_t, v_t)
        cache.flops_ratios.append(self._flops_ratio(cache))
        q_pos = torch.tensor([[cache.seen - 1]], device=q_t.device)
        result = self._attend(q_t[None], q_pos, cache.compressed_kv(), cache.dense_kv())
        masses = result.mass_comp[0].split([s.tokens for s in cache.segments])
        for seg, mass in zip(cache.segments, masses):
            seg.importance = ema_update(seg.importance, mass, self.alpha)
        cache.dense_importance = ema_update(cache.dense_importance, result.mass_dense[0], self.alpha)
        if self.period and cache.buffer >= self.period:
            self._fold(layer, cache)
        self._settle(cache)
        return result.out[0]

    def _attend(self, q: torch.Tensor, q_pos: torch.Tensor, comp: CompressedKV, dense: DenseKV):
        """The decode kernel for this backend -> DecodeOutput (B = 1)."""
        rope_base = self.rope_base if self.rope == "before" else None
        if not use_triton(self.backend, q.device):
            # The absorbed kernel computes the same attention: one reference serves both.
            return reference.lowrank_decode(q, q_pos, comp, dense, rope_base=rope_base)
        from kernels_py.triton import lowrank_decode as kernels  # imported when a kernel is wanted

        if self.absorbed:  # keys decomposed after RoPE: the absorbed kernel takes no rope_base
            return kernels.lowrank_decode_absorbed(q, q_pos, comp, dense)
        return kernels.lowrank_decode(q, q_pos, comp, dense, rope_base=rope_base)

    def _settle(self, cache: PackedCache) -> None:
        """Evict (low_group=evict) and re-derive each token's rank for the next step."""
        cache.changed()
        fractions_first = self._groups[0][0]
        for seg in cache.segments:
            if self.low_group == "evict":
                budget = kept_count(fractions_first, seg.admitted)
                if seg.tokens > budget:
                    keep = seg.importance.topk(budget).indices.sort().values
                    seg.k, seg.v = seg.k.select(keep), seg.v.select(keep)
                    seg.positions, seg.importance = seg.positions[keep], seg.importance[keep]
                full_k = torch.full_like(seg.positions, seg.k.rank)
                seg.ranks_k, seg.ranks_v = full_k, torch.full_like(seg.positions, seg.v.rank)
                continue
            grouped_k = group_ranks(seg.importance, self._groups, seg.k.rank)
            grouped_v = group_ranks(seg.importance, self._groups, seg.v.rank)
            seg.ranks_k = grouped_k if self.partial in ("keys", "both") else torch.full_like(grouped_k, seg.k.rank)
            seg.ranks_v = grouped_v if self.partial in ("values", "both") else torch.full_like(grouped_v, seg.v.rank)

    def _flops_ratio(self, cache: PackedCache) -> float:
        """Section 3.2: decompression FLOPs 2*H*D*sum_t R(t) against 2*H*D*T*R
        at full rank, K and V together; T counts evicted tokens too."""
        spent = sum(int(s.ranks_k.sum()) + int(s.ranks_v.sum()) for s in cache.segments)
        full = sum(s.admitted * (s.k.rank + s.v.rank) for s in cache.segments)
        return spent / full if full else 1.0

    def _fold(self, layer: int, cache: PackedCache) -> None:
        """Lines 14-17: the buffer of generated tokens joins the target segment,
        which is factorized again from its tokens rebuilt at full rank plus the new ones."""
        seg = cache.segments[cache.fold_target]
        waiting = cache.dense_positions >= cache.prompt_tokens
        new_k = self._decomposition_frame(cache.dense_k[:, waiting], cache.dense_positions[waiting])
        k_frame = torch.cat([self._rebuild(cache, seg.k), new_k], dim=1)
        values = torch.cat([self._rebuild(cache, seg.v), cache.dense_v[:, waiting].float()], dim=1)
        positions = torch.cat([seg.positions, cache.dense_positions[waiting]])
        importance = torch.cat([seg.importance, cache.dense_importance[waiting]])
        admitted = seg.admitted + int(waiting.sum())
        if self.low_group == "evict":  # drop before factorizing: the basis should serve what is kept
            keep = importance.topk(min(kept_count(self._groups[0][0], admitted), importance.numel())).indices
            keep = keep.sort().values
            k_frame, values = k_frame[:, keep], values[:, keep]
            positions, importance = positions[keep], importance[keep]
        cache.folds += 1
        width = cache.head_dim if cache.per_head else cache.kv_heads * cache.head_dim
        seed = self._seed(layer, cache.fold_target, cache.folds)
        # A rank above the tokens held would be padding: the factors are exact at min(rank, T).
        rank_k, rank_v = (min(target, positions.numel(), width) for target in (seg.target_k, seg.target_v))
        cache.segments[cache.fold_target] = Segment(
            seg.name, self._factorize(k_frame, rank_k, False, seed), self._factorize(values, rank_v, False, seed + 1),
            positions, importance, admitted, seg.target_k, seg.target_v,
        )
        cache.dense_k, cache.dense_v = cache.dense_k[:, ~waiting], cache.dense_v[:, ~waiting]
        cache.dense_positions = cache.dense_positions[~waiting]
        cache.dense_importance = cache.dense_importance[~waiting]

    def _rebuild(self, cache: PackedCache, f: Factor) -> torch.Tensor:
        """[kv_heads, T, d] float32 at full rank, in the decomposition frame."""
        product = f.dense_u(cache.factor_dtype).float() @ f.w.float()
        if cache.per_head:
            return product
        return product.view(product.shape[0], cache.kv_heads, cache.head_dim).transpose(0, 1)

    # --- accounting --------------------------------------------------------------------------------

    def cache_bytes(self, cache: LayerCache) -> int:
        """Bytes of the tensors held: U (packed codes + scales and zeros when
        quantized) and W of every segment, and the uncompressed K/V."""
        return sum(s.k.nbytes + s.v.nbytes for s in cache.segments) + tensor_bytes(cache.dense_k, cache.dense_v)

    def layer_metrics(self, layer, cache) -> dict[str, float]:
        """rank_k / rank_v of the visual segment; explained_variance_k / _v of
        its prefill SVD at that rank; formula_compression_ratio: the paper's C
        for the visual tokens held now; decompression_flops_ratio: section
        3.2's ratio averaged over the decode steps; token counts."""
        visual = cache.segments[0]
        ratios = cache.flops_ratios or [self._flops_ratio(cache)]
        return {
            "rank_k": float(visual.k.rank),
            "rank_v": float(visual.v.rank),
            "explained_variance_k": cache.notes["explained_variance_k"],
            "explained_variance_v": cache.notes["explained_variance_v"],
            "formula_compression_ratio": paper_compression_ratio(
                visual.tokens, cache.kv_heads, cache.head_dim, visual.k.rank, visual.v.rank, cache.per_head),
            "decompression_flops_ratio": sum(ratios) / len(ratios),
            "compressed_tokens": float(cache.compressed_tokens),
            "dense_tokens": float(cache.dense_positions.shape[0]),
            "evicted_tokens": float(sum(s.admitted - s.tokens for s in cache.segments)),
            "folds": float(cache.folds),
        }
