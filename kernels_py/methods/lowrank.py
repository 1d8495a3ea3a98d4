"""Low-rank factors as a cache representation (AttentionPack section 3.1).

A segment of tokens stores its keys and values each as X [T, H*D] ~= U [T, R]
@ W [R, H*D] (one randomized SVD over all kv heads side by side, singular
values folded into U), or per head (U [H, T, R], W [H, R, D]); U may be held
quantized (methods/quantized.py). Every token is rebuilt inside attention with
its own rank prefix. Tokens not (yet) factorized stay in an uncompressed
segment, as the model caches them.

The cache keeps its compressed segments in the layout the decode op reads
(ops.lowrank_decode.CompressedKV, B = 1), built when the segments change
(prefill, a fold, an eviction) rather than at every decode step; unquantized
factors are then views of that layout, so one copy of them is held. A segment's
tokens sit in slots, not in position order: a method that gives tokens ranks
by group (AttentionPack) keeps each group in a run of slots, so the kernel's
tiles have one rank, and moves only the tokens that change group
(`regroup`), in the segment and in the kernel layout alike. The keys and
values attention sees are reconstructed only when someone asks for them
(`keys`, `values`: metrics and tests), never on the decode path.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from kernels_py.methods.quantized import Quantized, dequantize, quantize
from kernels_py.metrics import tensor_bytes
from kernels_py.ops import lowrank_decode
from kernels_py.ops.lowrank_decode import CompressedKV, DecodeOutput, DenseKV

SVD_NITER = 2  # power iterations of AttentionPack's reference code's torch.svd_lowrank


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
    u may be held quantized (per token row, runs along the rank), and so may
    w (per rank row, runs along the channels, with scales of its own)."""

    u: torch.Tensor | Quantized
    w: torch.Tensor | Quantized
    rank: int
    explained: float | None  # share of ||X||_F^2 the rank captured when factorized, if it was asked for

    def dense_u(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.u).to(dtype) if isinstance(self.u, Quantized) else self.u

    def dense_w(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.w).to(dtype) if isinstance(self.w, Quantized) else self.w

    @property
    def quantized(self) -> bool:
        return isinstance(self.u, Quantized) or isinstance(self.w, Quantized)

    @property
    def token_axis(self) -> int:
        """Where U's token rows lie: 0 combined, 1 per head."""
        return len(self.w.shape) - 2

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes if isinstance(t, Quantized) else tensor_bytes(t) for t in (self.u, self.w))

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """In place: token row src[i] of U goes to row dst[i] (a permutation of
        the rows in dst; W is shared). Copies the moved rows only."""
        _move(self.u_tensors(), self.token_axis, dst, src)

    def u_tensors(self) -> list[torch.Tensor]:
        """The tensors holding U, token rows along the same axis."""
        q = self.u
        return [q.data, q.scale, q.zero] if isinstance(q, Quantized) else [q]

    def select(self, index: torch.Tensor) -> "Factor":
        """Keep the tokens at `index` (rows of U; W is shared)."""
        axis = self.token_axis
        if not isinstance(self.u, Quantized):
            return replace(self, u=self.u.index_select(axis, index))
        q = self.u  # runs lie along the rank axis, so rows can be picked without requantizing
        shape = list(q.shape)
        shape[axis] = index.numel()
        return replace(self, u=replace(q, data=q.data.index_select(axis, index),
                                       scale=q.scale.index_select(axis, index),
                                       zero=q.zero.index_select(axis, index), shape=tuple(shape)))


def _move(tensors, axis: int, dst: torch.Tensor, src: torch.Tensor) -> None:
    for t in tensors:
        t.index_copy_(axis, dst, t.index_select(axis, src))


def factorize(x: torch.Tensor, rank: int, *, per_head: bool, dtype: torch.dtype, seed: int,
              variance_target: float | None = None, quant_bits: int = 0, quant_group: int = 32,
              w_bits: int = 0, explained: bool = False) -> Factor:
    """x [kv_heads, T, d] -> Factor at `rank`, by a seeded randomized SVD. With
    variance_target: the smallest rank whose explained variance reaches it, at
    most `rank`. `explained` records the explained variance (a reconstruction
    metric) in the Factor; the variance scheme computes it anyway. Explained
    variance here is uncentred, the share of ||X||_F^2 the leading singular
    values capture (no mean is removed, unlike PCA's), and comes from the
    randomized SVD's values, which read slightly low near q = rank (0.860
    against 0.867 exact in one test at rank 64). quant_bits
    quantizes U per token row, w_bits W per rank row, both in runs of
    quant_group."""
    rows = x.float() if per_head else x.float().transpose(0, 1).reshape(x.shape[1], -1)
    with _seeded(seed, x.device):
        u, s, vecs = torch.svd_lowrank(rows, q=rank, niter=SVD_NITER)
    captured = None
    if explained or variance_target is not None:
        energy = s.square()
        if energy.dim() == 2:  # per head: one rank for all heads, so pool their energy
            energy = energy.sum(dim=0)
        captured = energy.cumsum(0) / rows.square().sum().clamp_min(torch.finfo(torch.float32).tiny)
    if variance_target is not None:
        reached = (captured >= variance_target).nonzero()
        rank = int(reached[0, 0]) + 1 if reached.numel() else rank
    u = (u[..., :rank] * s[..., None, :rank]).to(dtype)
    w = vecs[..., :rank].transpose(-1, -2).contiguous().to(dtype)
    if quant_bits:
        u = quantize(u, quant_bits, quant_group, dim=-1)
    if w_bits:
        w = quantize(w, w_bits, quant_group, dim=-1)
    return Factor(u, w, rank, float(captured[rank - 1]) if explained else None)


@dataclass
class Segment:
    """A run of compressed tokens: the visual ones; the text ones with compress_text;
    without it, generated tokens folded under a period."""

    name: str
    k: Factor
    v: Factor
    positions: torch.Tensor  # [T] int64, each slot's token (slots need not follow positions)
    importance: torch.Tensor  # [T] float32, Eq. 1
    admitted: int  # tokens ever put in (the eviction budget's base)
    target_k: int  # the ranks the layer chose at prefill; folds clip them to what the tokens allow
    target_v: int
    ranks_k: torch.Tensor | None = None  # [T] int64 rank prefix of each slot at the next step
    ranks_v: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.positions.shape[0]


@dataclass
class _Layout:
    """The compressed segments as the decode op reads them, minus the ranks."""

    uk: torch.Tensor  # [1, T, C_k]
    wk: torch.Tensor  # [1, C_k, H*D]
    uv: torch.Tensor
    wv: torch.Tensor
    pos: torch.Tensor  # [1, T]
    length: torch.Tensor  # [1]
    offsets_k: list[int]  # first column of each segment's block of U
    offsets_v: list[int]
    rows: list[int]  # first row (token slot) of each segment
    shared: bool  # the segments' U and W are views of uk, wk, uv, wv (unquantized factors): one copy is held
    ranks: tuple[torch.Tensor, torch.Tensor] | None = None  # rank_k, rank_v [1, T], until the ranks change


@dataclass
class LowRankCache:
    """One layer's cache: compressed segments plus the uncompressed segment
    (text / system tokens unless compressed, and the buffer of generated
    tokens not yet folded). For metrics it reads like KeptTokens: `keys` /
    `values` are the effective (rebuilt, rotated) K/V [kv_heads, n, d] in
    position order, as attention sees them at the next step."""

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
    fold_target: int | None  # the segment generated tokens fold into; None: made at the first fold
    folds: int = 0
    regrouped: int = 0  # tokens moved between groups' slots since prefill (regroup)
    flops_ratios: list[float] = field(default_factory=list)  # per decode step, section 3.2
    notes: dict[str, float] = field(default_factory=dict)
    # The op's layout, until the segments change; with quantized factors it holds their dequantized copies for
    # one decode step only, so the cache holds the packed codes (nbytes) between steps.
    _layout: _Layout | None = field(default=None, repr=False)
    _view: tuple | None = field(default=None, repr=False)  # the reconstructed K/V until anything changes

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

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors held: U (packed codes + scales and zeros when
        quantized) and W of every segment, and the uncompressed K/V (the
        paper's count). Not counted: the zeros the decode op's layout adds
        around the factors it shares storage with: with several segments,
        U's off-diagonal blocks (each segment's tokens x the others' ranks);
        per head, the block-diagonal W (kv_heads times W's bytes); nor, with
        quantized factors, their dequantized layout, which lives for one
        decode step."""
        return sum(s.k.nbytes + s.v.nbytes for s in self.segments) + tensor_bytes(self.dense_k, self.dense_v)

    # --- what changes ------------------------------------------------------------------------------

    def segments_changed(self) -> None:
        """Call after changing a segment's tokens or factors: the kernel layout
        is rebuilt on next use. Factors still viewing the old layout get
        copies of their own, so it is freed now rather than at the next step."""
        lay = self._layout
        if lay is not None and lay.shared:
            storages = {t.untyped_storage().data_ptr() for t in (lay.uk, lay.wk, lay.uv, lay.wv)}
            for f in (f for seg in self.segments for f in (seg.k, seg.v)):
                for name in ("u", "w"):
                    t = getattr(f, name)
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in storages:
                        setattr(f, name, t.clone(memory_format=torch.contiguous_format))
        self._layout = None
        self._view = None

    def ranks_changed(self) -> None:
        """Call after changing a segment's ranks_k / ranks_v."""
        self._view = None
        if self._layout is not None:
            self._layout.ranks = None

    def regroup(self, index: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Move the tokens of segment `index` in slots src[i] to slots dst[i]
        (dst a permutation of src): U_k and U_v rows, positions and importance,
        in the segment and in the kernel layout. The slots' ranks stay, so
        moved tokens take the rank of their new slots. Copies only the moved
        rows: a decode step costs what changed group, not the cache."""
        if dst.numel() == 0:
            return
        seg = self.segments[index]
        # positions and importance may be shared with the caller: replaced, not written in place
        seg.positions = seg.positions.index_copy(0, dst, seg.positions.index_select(0, src))
        seg.importance = seg.importance.index_copy(0, dst, seg.importance.index_select(0, src))
        lay = self._layout
        if lay is None or not lay.shared:  # shared: the segment's U rows are the layout's, moved below
            seg.k.move_rows(dst, src)
            seg.v.move_rows(dst, src)
        if lay is not None:
            shift = lay.rows[index]
            _move([lay.uk, lay.uv, lay.pos], 1, dst + shift, src + shift)
        self.regrouped += dst.numel()
        self._view = None

    def append(self, k_t: torch.Tensor, v_t: torch.Tensor) -> None:
        """The generated token ([kv_heads, 1, d]) joins the uncompressed segment at position `seen`."""
        self.dense_k = torch.cat([self.dense_k, k_t.to(self.dense_k.dtype)], dim=1)
        self.dense_v = torch.cat([self.dense_v, v_t.to(self.dense_v.dtype)], dim=1)
        position = torch.tensor([self.seen], dtype=torch.int64, device=self.dense_positions.device)
        self.dense_positions = torch.cat([self.dense_positions, position])
        self.dense_importance = torch.cat([self.dense_importance, self.dense_importance.new_zeros(1)])
        self.seen += 1
        self._view = None

    # --- the decode op's inputs --------------------------------------------------------------------

    def kernel_factors(self, f: Factor) -> tuple[torch.Tensor, torch.Tensor]:
        """U [T, C], W [C, H*D] in the op's shared-basis layout. Per head,
        the H bases become one block-diagonal W whose columns interleave heads
        (column r*H + h = rank r of head h), so a rank prefix r*H rebuilds
        every head at rank r."""
        u, w = f.dense_u(self.factor_dtype), f.dense_w(self.factor_dtype)
        if not self.per_head:
            return u, w
        heads, tokens, rank = u.shape
        head_dim = w.shape[-1]
        blocks = w.new_zeros(rank, heads, heads, head_dim)
        diagonal = torch.arange(heads, device=w.device)
        blocks[:, diagonal, diagonal] = w.transpose(0, 1)
        return u.permute(1, 2, 0).reshape(tokens, rank * heads), blocks.reshape(rank * heads, heads * head_dim)

    def _build_layout(self) -> _Layout:
        """Every compressed segment as one sequence: segments are blocks of a
        block-diagonal U over stacked W, a token's rank prefix skipping the
        (zero) columns of the segments before its own. Unquantized factors
        then become views of the layout (`_share`), so the cache holds one
        copy of them, not the segments' and the layout's side by side."""
        built = {}
        for name in ("k", "v"):
            parts = [self.kernel_factors(getattr(seg, name)) for seg in self.segments]
            offsets = torch.tensor([0] + [u.shape[1] for u, _ in parts[:-1]]).cumsum(0).tolist()
            u, w = torch.block_diag(*[u for u, _ in parts]), torch.cat([w for _, w in parts])
            if u.shape[1] == 0:  # nothing compressed (a prompt without visual tokens): the op wants a column
                u, w = u.new_zeros(u.shape[0], 1), w.new_zeros(1, w.shape[1])
            built[name] = (u, w, offsets)
        (uk, wk, off_k), (uv, wv, off_v) = built["k"], built["v"]
        pos = torch.cat([s.positions for s in self.segments])
        length = torch.tensor([pos.shape[0]], device=pos.device)
        rows = torch.tensor([0] + [s.tokens for s in self.segments[:-1]]).cumsum(0).tolist()
        lay = _Layout(uk[None], wk[None], uv[None], wv[None], pos[None], length, off_k, off_v, rows,
                      shared=not self.quantized)
        if lay.shared:
            self._share(lay)
        return lay

    def _share(self, lay: _Layout) -> None:
        """Point every segment's U and W at its block of the layout (views,
        no copy), freeing the tensors they held. Per head, U [H, T, R] is
        the block's columns r*H + h and W [H, R, D] the diagonal blocks of
        the block-diagonal W (kernel_factors)."""
        heads, head_dim = self.kv_heads, self.head_dim
        for i, (seg, row) in enumerate(zip(self.segments, lay.rows)):
            for name, u_all, w_all, offsets in (("k", lay.uk[0], lay.wk[0], lay.offsets_k),
                                                ("v", lay.uv[0], lay.wv[0], lay.offsets_v)):
                f = getattr(seg, name)
                offset = offsets[i]
                columns = f.rank * heads if self.per_head else f.rank
                u = u_all[row:row + seg.tokens, offset:offset + columns]
                w = w_all[offset:offset + columns]
                if self.per_head:
                    u = u.view(seg.tokens, f.rank, heads).permute(2, 0, 1)
                    w = w.view(f.rank, heads, heads, head_dim).diagonal(dim1=1, dim2=2).permute(2, 0, 1)
                f.u, f.w = u, w

    def compressed_kv(self) -> CompressedKV:
        """The compressed segments with this step's ranks (B = 1)."""
        if self._layout is None:
            self._layout = self._build_layout()
        lay = self._layout
        if lay.ranks is None:
            unit = self.kv_heads if self.per_head else 1
            lay.ranks = tuple(torch.cat([getattr(s, name) * unit + o for s, o in zip(self.segments, offsets)])[None]
                              for name, offsets in (("ranks_k", lay.offsets_k), ("ranks_v", lay.offsets_v)))
        return CompressedKV(lay.uk, lay.wk, lay.uv, lay.wv, *lay.ranks, lay.pos, lay.length)

    def dense_kv(self) -> DenseKV:
        length = torch.tensor([self.dense_positions.shape[0]], device=self.dense_positions.device)
        return DenseKV(self.dense_k[None], self.dense_v[None], self.dense_positions[None], length)

    def attend(self, q_t: torch.Tensor, *, absorbed: bool, backend: str, mass: bool = True) -> DecodeOutput:
        """The decode op over this cache for one query token q_t [heads, 1, d]
        (B = 1); mass=False skips the per-token masses (None in the result)."""
        q_pos = torch.tensor([[self.seen - 1]], device=q_t.device)
        out = lowrank_decode.compute(q_t[None], q_pos, self.compressed_kv(), self.dense_kv(),
                                     rope_base=self.rope_base, absorbed=absorbed, backend=backend, mass=mass)
        if self.quantized:
            self._layout = None  # the dequantized factors live for one step: what is held is the packed codes
        return out

    @property
    def quantized(self) -> bool:
        """Whether any factor is held quantized (U or W)."""
        return any(f.quantized for s in self.segments for f in (s.k, s.v))

    # --- reconstruction, for metrics ---------------------------------------------------------------

    def _effective(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V [kv_heads, n, d] float32, positions [n], importance [n], in position order."""
        if self._view is None:
            ck, cv = lowrank_decode.reference.decompress(self.compressed_kv(), self.kv_heads, self.rope_base)
            keys = torch.cat([ck[0], self.dense_k.float()], dim=1)
            values = torch.cat([cv[0], self.dense_v.float()], dim=1)
            positions = torch.cat([s.positions for s in self.segments] + [self.dense_positions])
            importance = torch.cat([s.importance for s in self.segments] + [self.dense_importance])
            order = positions.argsort()
            self._view = keys[:, order], values[:, order], positions[order], importance[order]
        return self._view

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
