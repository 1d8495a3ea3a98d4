"""Synthetic VLM attention workload: per-layer prompt and decode-step Q/K/V with
the structure the papers measured on LLaVA-class models, deterministic from a seed.

Why synthetic: compression methods react to attention *structure*, and the
structure below is what the papers report, so methods can be compared without
a model on the machine. What is built in, and where it comes from:

- Prompt layout `[system][image 1]...[image n][text]`, then `decode_steps`
  generated tokens (LLaVA-1.5: 576 visual tokens per image).
- Visual K and V are low rank with a power-law singular spectrum, *shared
  across kv heads* (one latent per token, one basis over all heads), so an SVD
  of the heads concatenated (`[T, kv_heads * head_dim]`) compresses well
  (AttentionPack section 3, Figure 2). Keys are low rank before RoPE, which is
  what AttentionPack's reference code decomposes; use `apply_rope(k, -positions)`
  to undo the rotation.
- Heavy hitters: the keys of token 0 and of `sink_tokens - 1` visual tokens are
  a large component in the lowest-frequency RoPE channel pair and nothing else;
  every query matches it, so they draw large attention from every row, as long
  as that pair barely turns over the prompt: the sink's logit goes as
  cos(theta * distance), theta = rope_base ** (-(head_dim - 2) / head_dim). At
  head_dim 128 and base 1e4 that is 0.88 of it at 4K tokens, 0 at 13.6K, and
  negative past it; long prompts need a larger rope_base (1e6, Qwen2's, keeps
  0.99 at 100K).
- Text (post-vision) and decode queries each target `targets_per_query` visual
  tokens drawn from a per-layer pool of salient tokens with Zipf weights, so
  their attention is concentrated; visual queries see only noise, sinks and a
  recency bias, so their attention is broad (VL-Cache section 3, Figure 1b).
  Text and decode queries of a head mostly share their targets and part of
  their random component (`text_query_similarity`): post-vision attention
  predicts decoding attention (VL-Cache Figure 3) and the same tokens recur
  from step to step (A-VL "continuity"); pools differ per layer (A-VL
  "heterogeneity").
- Values of a kv head share a mean vector (`value_mean`), as real value caches
  are anisotropic; without it, flat attention would average to nearly zero.
- Recency: a few high-frequency RoPE channel pairs carry a constant vector in
  queries and keys, so the logit gains a kernel peaked at distance 0.
- Sparsity varies by layer: every logit component is scaled per layer; the first
  `dense_layers` use `dense_scale` (flat attention, low VL-Cache gamma), the rest
  a scale drawn around 1 (VL-Cache Figure 2: two dense layers, then sparse ones
  of varying sparsity).
- Video (`video = True`): the images are the frames of one clip, one span per
  frame. Frames share one K basis and one V basis (one scene), and neighbouring
  frames repeat each other, as consecutive frames do (the redundancy merging,
  LOOK-M and AttentionPack's low rank across frames exploit): at every token
  position, frame f's latent is `frame_correlation * (frame f-1's) +
  sqrt(1 - frame_correlation ** 2) * fresh`, so frames d apart correlate by
  about frame_correlation ** d (the full-rank noise is fresh per frame); and
  a `salient_recurrence` share of a frame's salient tokens are the previous
  frame's moved by at most `salient_motion` positions, their K and V latents
  copied (the same object, moving little). Left at `video = False` the
  images are independent, each with its own basis.

Channels are split so each component moves logits independently: the sink pair,
the recency pairs, and the remaining "content" pairs (visual latent, noise,
targeting). Queries are built in the rotated (post-RoPE) frame, where logits
are dot products; the stored tensors are exactly what a model would cache:
q and k after RoPE at their positions, v without.

Cost is linear in the tokens: nothing here is tokens x tokens, and each layer
is made in float64 and kept in the workload's dtype before the next, so 64
frames of 1600 tokens (102K, 32 heads of 128) peak at about 16 GB of CPU
memory while a layer is made.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch

from kernels_py import runtime
from kernels_py.attention import Rope, Spans, apply_rope
from kernels_py.ops.common import DTYPES
from kernels_py.params import Rule, knob
from kernels_py.workloads.base import Workload, WorkloadConfig
# Ridge added to the visual key covariance, as a fraction of its mean eigenvalue,
# before whitening: keeps targeted queries from blowing up along noise directions.
WHITENING_RIDGE = 0.1
# Extra sinks draw a little less attention than token 0, as in real models.
SECONDARY_SINK_WEIGHT = (0.8, 1.0)


@dataclass(frozen=True)
class SyntheticConfig(WorkloadConfig):
    """Synthetic VLM attention: per-layer Q/K/V with the structure the papers
    measured on LLaVA-class models, deterministic from a seed.

    Defaults are sized for a CPU. Logit-valued knobs are in logits (after the
    1/sqrt(head_dim) scale), before the per-layer scale."""

    name = "synthetic"

    # Model shape
    seed: int = knob("int", 0, "seed; the workload is a pure function of the config", min=0, max=2**31 - 1)
    layers: int = knob("int", 4, "transformer layers", min=1, max=256)
    heads: int = knob("int", 8, "query heads", min=1, max=256)
    kv_heads: int = knob("int", 2, "key/value heads (GQA); must divide heads", min=1, max=256)
    head_dim: int = knob("int", 64, "channels per head; even (RoPE pairs)", min=16, max=512)
    dtype: str = knob("str", "float16", "dtype of the model's tensors and of the uncompressed cache every compression ratio is counted against (float32 for exact arithmetic)", choices=tuple(DTYPES))
    rope_base: float = knob("float", 10000.0, "RoPE base (theta); the sinks' pull fades with distance unless it is "
                            "large for the prompt (at head_dim 128: 1e4 holds to about 4K tokens, 1e6 past 100K)",
                            min=2.0, max=1e9)
    # Sequence layout
    images: int = knob("int", 1, "images in the prompt (video frames, with video = True)", min=1, max=256)
    tokens_per_image: int = knob(
        "int", 576, "visual tokens per image (LLaVA-1.5: 576; a video frame: 256)", min=8, max=65536
    )
    system_tokens: int = knob(
        "int", 32, "system prompt tokens before the images; token 0 is the main sink", min=1, max=65536
    )
    text_tokens: int = knob("int", 64, "post-vision text tokens after the images", min=1, max=65536)
    decode_steps: int = knob("int", 16, "generated tokens", min=1, max=65536)
    # Video: the images are frames with temporal redundancy. Added after runs of independent images
    # existed: at their defaults job ids leave them out, so those runs keep their ids.
    video: bool = knob(
        "bool", False,
        "the images are the frames of one video: one K/V basis for all of them, and the temporal redundancy "
        "frame_correlation and salient_recurrence set; False: independent images, each its own basis",
        id_omits_default=True,
    )
    frame_correlation: float = knob(
        "float", 0.0,
        "video: correlation of each visual token's K/V latent with the same position's in the previous frame "
        "(latent = rho * previous + sqrt(1 - rho^2) * fresh; 1: a still scene)",
        min=0.0, max=1.0, id_omits_default=True,
    )
    salient_recurrence: float = knob(
        "float", 0.0,
        "video: share of a frame's salient tokens that are the previous frame's salient tokens moved a little "
        "(K/V latents copied)",
        min=0.0, max=1.0, id_omits_default=True,
    )
    salient_motion: int = knob(
        "int", 1, "video: most positions (raster order) a recurring salient token moves from one frame to the next",
        min=0, max=65536, id_omits_default=True,
    )
    # Visual K/V spectrum (AttentionPack)
    visual_rank: int = knob(
        "int", 96,
        "rank of the visual K/V latent shared by all kv heads, before noise; capped at the channels it spans "
        "(kv_heads * head_dim for V, a little less for K)",
        min=1, max=65536,
    )
    spectrum_decay: float = knob(
        "float", 0.5, "singular value i of the visual latent is (i + 1) ** -spectrum_decay", min=0.0, max=8.0
    )
    visual_noise: float = knob(
        "float", 0.05, "std of full-rank noise on visual K/V (the signal has unit std)", min=0.0, max=10.0
    )
    value_mean: float = knob(
        "float", 1.0, "per-channel std of a mean vector added to every value of a kv head (anisotropy)",
        min=0.0, max=20.0,
    )
    # Attention structure (VL-Cache, A-VL)
    sink_tokens: int = knob(
        "int", 4, "heavy-hitter sinks: token 0 plus sink_tokens - 1 visual tokens", min=0, max=1024
    )
    sink_strength: float = knob("float", 8.0, "logit every query gives token 0", min=0.0, max=50.0)
    salient_tokens: int = knob(
        "int", 24, "visual tokens per image that text and decode queries target", min=1, max=65536
    )
    targets_per_query: int = knob("int", 4, "salient tokens each text/decode query head targets", min=1, max=1024)
    text_sharpness: float = knob("float", 8.0, "logit a text/decode query gives each target", min=0.0, max=50.0)
    text_query_similarity: float = knob(
        "float", 0.7,
        "how alike a head's text and decode queries are: the share of their random part they have in common, "
        "and the chance that each of their targets is the head's own",
        min=0.0, max=1.0,
    )
    query_noise: float = knob("float", 1.0, "std of the random part of every logit", min=0.0, max=20.0)
    locality: float = knob("float", 2.0, "logit bonus at distance 0 from the recency channels", min=0.0, max=50.0)
    # Sparsity per layer (VL-Cache Figure 2)
    dense_layers: int = knob("int", 2, "first layers with flat (dense) attention (all, if fewer)", min=0, max=256)
    dense_scale: float = knob("float", 0.5, "logit scale of the dense layers", min=0.0, max=1.0)
    layer_scale_spread: float = knob(
        "float", 0.25, "the other layers' logit scale is uniform in 1 +- spread", min=0.0, max=0.9
    )

    RULES = (
        Rule("heads % kv_heads == 0", "heads={heads} must be a multiple of kv_heads={kv_heads}"),
        Rule("head_dim % 2 == 0", "head_dim={head_dim} must be even (RoPE rotates channel pairs)"),
        # The visual sinks are drawn over all the images, so one image may hold every one of them.
        Rule("video or max(sink_tokens - 1, 0) + salient_tokens <= tokens_per_image",
             "every image holds its salient tokens apart from the sinks, and any image may hold every sink: "
             "sink_tokens - 1 + salient_tokens must fit in tokens_per_image (sink_tokens={sink_tokens}, "
             "salient_tokens={salient_tokens}, tokens_per_image={tokens_per_image})"),
        Rule("2 * targets_per_query <= images * salient_tokens",
             "2 * targets_per_query exceeds the salient pool images * salient_tokens: a query's own targets and "
             "the head's must not collide (targets_per_query={targets_per_query}, images={images}, "
             "salient_tokens={salient_tokens})"),
        Rule("video or frame_correlation == 0",
             "frame_correlation={frame_correlation} needs video = True (without it the images are independent)"),
        Rule("video or salient_recurrence == 0",
             "salient_recurrence={salient_recurrence} needs video = True (without it the images are independent)"),
        Rule("not video or max(sink_tokens - 1, 0) + salient_tokens <= tokens_per_image",
             "with video = True every frame holds its salient tokens and may hold every sink: "
             "sink_tokens - 1 + salient_tokens must fit in tokens_per_image (sink_tokens={sink_tokens}, "
             "salient_tokens={salient_tokens}, tokens_per_image={tokens_per_image})"),
    )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def build(self) -> Workload:
        return generate(self)

    def spans(self) -> Spans:
        images_start = self.system_tokens
        images = tuple(
            (images_start + i * self.tokens_per_image, images_start + (i + 1) * self.tokens_per_image)
            for i in range(self.images)
        )
        text_start = images_start + self.images * self.tokens_per_image
        return Spans((0, self.system_tokens), images, (text_start, text_start + self.text_tokens),
                     Rope("default", self.rope_base))


@dataclass(frozen=True)
class ChannelLayout:
    """Which channels of a head carry which logit component. Index sets are
    closed under RoPE pairing (c, c + head_dim / 2), so rotation keeps them apart."""

    sink: int  # first channel of the lowest-frequency pair: barely rotates over a prompt
    locality: torch.Tensor  # first channels of a few high-frequency pairs
    content: torch.Tensor  # both channels of every other pair


def channel_layout(head_dim: int) -> ChannelLayout:
    half = head_dim // 2
    sink_pair = half - 1
    locality_pairs = list(range(0, max(1, head_dim // 4), 3))
    content_pairs = [p for p in range(half) if p != sink_pair and p not in locality_pairs]
    content = torch.tensor(content_pairs + [p + half for p in content_pairs])
    return ChannelLayout(sink_pair, torch.tensor(locality_pairs), content)


def generate(cfg: SyntheticConfig) -> Workload:
    """Build the workload; equal configs give bit-identical tensors."""
    spans = cfg.spans()
    prompt = spans.prompt_tokens
    positions = torch.arange(prompt)
    decode_positions = torch.arange(prompt, prompt + cfg.decode_steps)
    sinks = _choose_sinks(cfg, spans)
    dev, dtype = runtime.device(), cfg.torch_dtype
    # Each layer leaves float64 as it is made: at video lengths (100K tokens) the float64 Q/K/V of
    # every layer at once would take several times the workload's own memory.
    layers = [_generate_layer(cfg, spans, sinks, layer).to(dev, dtype) for layer in range(cfg.layers)]

    def stack(name):
        return tuple(getattr(layer, name) for layer in layers)

    return Workload(
        cfg, spans, positions.to(dev), decode_positions.to(dev), sinks,
        stack("q"), stack("k"), stack("v"), stack("decode_q"), stack("decode_k"), stack("decode_v"),
    )


@dataclass
class _Layer:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    decode_q: torch.Tensor
    decode_k: torch.Tensor
    decode_v: torch.Tensor

    def to(self, device, dtype) -> "_Layer":
        return _Layer(*(t.to(device=device, dtype=dtype) for t in
                        (self.q, self.k, self.v, self.decode_q, self.decode_k, self.decode_v)))


@dataclass
class _Frames:
    """A video's salient tokens, one layer: the pool (absolute positions,
    frame by frame), its Zipf weights, and for each frame the in-frame
    offsets whose latents it copies from the previous frame (source, destination)."""

    pool: torch.Tensor
    weights: torch.Tensor
    moves: list[tuple[list[int], list[int]]]


def _generator(seed: int, *stream: int) -> torch.Generator:
    """Independent, well-mixed random streams per (seed, purpose): changing the
    number of layers leaves the other layers unchanged."""
    state = np.random.SeedSequence([seed, *stream]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def _choose_sinks(cfg: SyntheticConfig, spans: Spans) -> tuple[int, ...]:
    if cfg.sink_tokens == 0:
        return ()
    visual = spans.visual_positions()
    picks = torch.randperm(len(visual), generator=_generator(cfg.seed, 0))[: cfg.sink_tokens - 1]
    return (0, *sorted(visual[picks].tolist()))


def _layer_scale(cfg: SyntheticConfig, layer: int, rng: torch.Generator) -> float:
    if layer < cfg.dense_layers:
        return cfg.dense_scale
    return 1.0 + cfg.layer_scale_spread * (2 * torch.rand((), generator=rng, dtype=torch.float64).item() - 1)


def _generate_layer(cfg: SyntheticConfig, spans: Spans, sinks: tuple[int, ...], layer: int) -> _Layer:
    rng = _generator(cfg.seed, 1, layer)
    chans = channel_layout(cfg.head_dim)
    prompt = spans.prompt_tokens
    scale = _layer_scale(cfg, layer, rng)
    frames = _video_frames(cfg, spans, sinks, layer) if cfg.video else None

    keys_pre = _prompt_keys(cfg, spans, sinks, chans, rng, frames)
    keys = apply_rope(keys_pre, torch.arange(prompt), cfg.rope_base)
    values = _prompt_values(cfg, spans, rng, frames)
    decode_pos = torch.arange(prompt, prompt + cfg.decode_steps)
    decode_keys = apply_rope(_text_keys(cfg, chans, cfg.decode_steps, rng), decode_pos, cfg.rope_base)
    decode_values = torch.randn(cfg.kv_heads, cfg.decode_steps, cfg.head_dim, generator=rng, dtype=torch.float64)
    value_mean = cfg.value_mean * torch.randn(cfg.kv_heads, 1, cfg.head_dim, generator=rng, dtype=torch.float64)

    pool, pool_weights = (frames.pool, frames.weights) if frames is not None else _salient_pool(cfg, spans, sinks, rng)
    directions = _target_directions(keys, spans, sinks, pool, chans)
    # Text rows end the prompt and decode rows follow: one contiguous block from spans.text[0].
    queries = _queries(cfg, torch.cat([torch.arange(prompt), decode_pos]), spans.text[0], chans, scale, rng)
    targeted_rows = prompt + cfg.decode_steps - spans.text[0]
    queries[:, spans.text[0]:, chans.content] += _targeting(cfg, directions, pool_weights, targeted_rows, scale, rng)

    return _Layer(
        q=queries[:, :prompt],
        k=keys,
        v=values + value_mean,
        decode_q=queries[:, prompt:].transpose(0, 1).unsqueeze(2),
        decode_k=decode_keys.transpose(0, 1).unsqueeze(2),
        decode_v=(decode_values + value_mean).transpose(0, 1).unsqueeze(2),
    )


def _text_keys(cfg: SyntheticConfig, chans: ChannelLayout, tokens: int, rng: torch.Generator) -> torch.Tensor:
    """Pre-RoPE keys of non-visual tokens: full-rank content plus the recency channels."""
    keys = torch.zeros(cfg.kv_heads, tokens, cfg.head_dim, dtype=torch.float64)
    keys[..., chans.content] = torch.randn(cfg.kv_heads, tokens, len(chans.content), generator=rng, dtype=torch.float64)
    keys[..., chans.locality] = 1.0
    return keys


def _spectrum_and_basis(cfg: SyntheticConfig, channels: int, rng: torch.Generator):
    """Singular values (a power law, scaled to unit mean variance per channel)
    and an orthonormal basis [kv_heads * channels, rank] shared by all heads."""
    width = cfg.kv_heads * channels
    rank = min(cfg.visual_rank, width)
    spectrum = (torch.arange(rank, dtype=torch.float64) + 1) ** -cfg.spectrum_decay
    spectrum *= math.sqrt(width / spectrum.square().sum())
    basis, _ = torch.linalg.qr(torch.randn(width, rank, generator=rng, dtype=torch.float64))
    return spectrum, basis


def _low_rank(cfg: SyntheticConfig, tokens: int, channels: int, rng: torch.Generator) -> torch.Tensor:
    """[tokens, kv_heads * channels]: one latent per token times one basis shared
    by all heads, singular values decaying as a power law, unit mean variance per
    channel, plus full-rank noise."""
    spectrum, basis = _spectrum_and_basis(cfg, channels, rng)
    latent = torch.randn(tokens, len(spectrum), generator=rng, dtype=torch.float64)
    noise = torch.randn(tokens, basis.shape[0], generator=rng, dtype=torch.float64)
    return latent * spectrum @ basis.T + cfg.visual_noise * noise


def _video_low_rank(cfg: SyntheticConfig, frames: _Frames, channels: int, rng: torch.Generator) -> torch.Tensor:
    """[images * tokens_per_image, kv_heads * channels]: `_low_rank` for the
    frames of one video: one basis, each frame's latents the previous frame's
    times frame_correlation plus fresh ones, moved salient tokens' latents
    copied; the full-rank noise is fresh per frame."""
    spectrum, basis = _spectrum_and_basis(cfg, channels, rng)
    per_frame, rho = cfg.tokens_per_image, cfg.frame_correlation
    latent = torch.empty(cfg.images, per_frame, len(spectrum), dtype=torch.float64)
    latent[0] = torch.randn(per_frame, len(spectrum), generator=rng, dtype=torch.float64)
    for f in range(1, cfg.images):
        fresh = torch.randn(per_frame, len(spectrum), generator=rng, dtype=torch.float64)
        latent[f] = rho * latent[f - 1] + math.sqrt(1 - rho * rho) * fresh
        source, destination = frames.moves[f]
        latent[f, destination] = latent[f - 1, source]
    noise = torch.randn(cfg.images * per_frame, basis.shape[0], generator=rng, dtype=torch.float64)
    return latent.reshape(-1, len(spectrum)) * spectrum @ basis.T + cfg.visual_noise * noise


def _per_head(rows: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[tokens, kv_heads * c] -> [kv_heads, tokens, c]."""
    return rows.reshape(rows.shape[0], kv_heads, -1).transpose(0, 1)


def _prompt_keys(cfg, spans, sinks, chans, rng, frames) -> torch.Tensor:
    keys = _text_keys(cfg, chans, spans.prompt_tokens, rng)
    if frames is not None:  # the frames are contiguous
        visual = _per_head(_video_low_rank(cfg, frames, len(chans.content), rng), cfg.kv_heads)
        keys[:, spans.images[0][0]:spans.images[-1][1], chans.content] = visual
    else:
        for start, end in spans.images:
            visual = _per_head(_low_rank(cfg, end - start, len(chans.content), rng), cfg.kv_heads)
            keys[:, start:end, chans.content] = visual
    if sinks:
        # A sink's key is its sink channel alone, so no query's content part moves its logit;
        # the value sqrt(head_dim) turns a query coefficient into that many logits.
        keys[:, list(sinks)] = 0.0
        weights = torch.empty(len(sinks), dtype=torch.float64).uniform_(*SECONDARY_SINK_WEIGHT, generator=rng)
        weights[0] = 1.0
        keys[:, list(sinks), chans.sink] = math.sqrt(cfg.head_dim) * weights
    return keys


def _prompt_values(cfg, spans, rng, frames) -> torch.Tensor:
    values = torch.randn(cfg.kv_heads, spans.prompt_tokens, cfg.head_dim, generator=rng, dtype=torch.float64)
    if frames is not None:
        visual = _video_low_rank(cfg, frames, cfg.head_dim, rng)
        values[:, spans.images[0][0]:spans.images[-1][1]] = _per_head(visual, cfg.kv_heads)
    else:
        for start, end in spans.images:
            values[:, start:end] = _per_head(_low_rank(cfg, end - start, cfg.head_dim, rng), cfg.kv_heads)
    return values


def _salient_pool(cfg, spans, sinks, rng) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer salient visual positions (never sinks) and Zipf weights over them."""
    pool = []
    for start, end in spans.images:
        candidates = torch.tensor([p for p in range(start, end) if p not in sinks])
        pool.append(candidates[torch.randperm(len(candidates), generator=rng)[: cfg.salient_tokens]])
    pool = torch.cat(pool)
    ranks = torch.randperm(len(pool), generator=rng).to(torch.float64)
    return pool, 1.0 / (ranks + 1.0)


def _video_frames(cfg, spans, sinks, layer) -> _Frames:
    """Per-layer salient tokens of a video, from their own random stream:
    frame 0's drawn at random; each of frame f-1's recurs in frame f with
    probability salient_recurrence, moved by up to salient_motion positions
    (kept in the frame; not onto a sink or another salient token); fresh
    random picks fill the rest. Zipf weights over the pool, as for images."""
    rng = _generator(cfg.seed, 2, layer)
    per_frame, pool, moves, previous = cfg.tokens_per_image, [], [], []
    for start, end in spans.images:
        blocked = {p - start for p in sinks if start <= p < end}
        chosen, source = [], []
        recurs = torch.rand(len(previous), generator=rng, dtype=torch.float64) < cfg.salient_recurrence
        shifts = torch.randint(-cfg.salient_motion, cfg.salient_motion + 1, (len(previous),), generator=rng)
        for offset, recur, shift in zip(previous, recurs.tolist(), shifts.tolist()):
            moved = min(max(offset + shift, 0), per_frame - 1)
            if recur and moved not in blocked:
                blocked.add(moved)
                chosen.append(moved)
                source.append(offset)
        moves.append((source, list(chosen)))
        fresh = (o for o in torch.randperm(per_frame, generator=rng).tolist() if o not in blocked)
        chosen += [next(fresh) for _ in range(cfg.salient_tokens - len(chosen))]
        pool += [start + o for o in chosen]
        previous = chosen
    ranks = torch.randperm(len(pool), generator=rng).to(torch.float64)
    return _Frames(torch.tensor(pool), 1.0 / (ranks + 1.0), moves)


def _target_directions(keys, spans, sinks, pool, chans) -> torch.Tensor:
    """[kv_heads, pool, content]: for each salient token, the content-channel
    query direction giving logit 1 on it (after the 1/sqrt(d) scale) and little
    on other visual tokens: its key whitened by the (ridged) visual key covariance."""
    visual = [p for p in spans.visual_positions().tolist() if p not in sinks]
    content = keys[:, visual][..., chans.content]
    cov = content.transpose(1, 2) @ content / len(visual)
    ridge = WHITENING_RIDGE * cov.diagonal(dim1=1, dim2=2).mean(-1)
    cov = cov + ridge[:, None, None] * torch.eye(cov.shape[-1], dtype=cov.dtype)
    targets = keys[:, pool][..., chans.content]
    whitened = torch.linalg.solve(cov, targets.transpose(1, 2)).transpose(1, 2)
    self_logit = (whitened * targets).sum(-1, keepdim=True)
    return whitened / self_logit * math.sqrt(keys.shape[-1])


def _queries(cfg, positions, first_text_row, chans, scale, rng) -> torch.Tensor:
    """[heads, rows, d] post-RoPE queries with the parts every row has: the sink
    and recency channels (constant before RoPE) and random content, which from
    `first_text_row` on shares a per-head component (the question being asked)."""
    bias = torch.zeros(cfg.head_dim, dtype=torch.float64)
    bias[chans.sink] = scale * cfg.sink_strength
    bias[chans.locality] = scale * cfg.locality * math.sqrt(cfg.head_dim) / len(chans.locality)
    rows = len(positions)
    queries = apply_rope(bias.expand(cfg.heads, rows, -1), positions, cfg.rope_base)
    # Content keys have unit variance per channel: this std gives logits of std scale * query_noise.
    std = scale * cfg.query_noise * math.sqrt(cfg.head_dim / len(chans.content))
    noise = torch.randn(cfg.heads, rows, len(chans.content), generator=rng, dtype=torch.float64)
    shared = torch.randn(cfg.heads, 1, len(chans.content), generator=rng, dtype=torch.float64)
    similarity = cfg.text_query_similarity
    noise[:, first_text_row:] = math.sqrt(similarity) * shared + math.sqrt(1 - similarity) * noise[:, first_text_row:]
    queries[..., chans.content] += std * noise
    return queries


def _targeting(cfg, directions, pool_weights, rows, scale, rng) -> torch.Tensor:
    """[heads, rows, content]: the content part that makes each (row, head) attend
    to its targets, each at logit about scale * text_sharpness.

    Every head has its own targets (what the question is about); each target slot
    of a row keeps the head's target with probability text_query_similarity and
    otherwise takes another pool token, drawn by weight, so the same tokens recur
    across rows and decode steps while attention drifts a little."""
    group = cfg.heads // cfg.kv_heads
    count = cfg.targets_per_query
    head_targets = torch.multinomial(pool_weights.expand(cfg.heads, -1), count, generator=rng)  # [heads, count]
    others = pool_weights.expand(cfg.heads, -1).scatter(1, head_targets, 0.0).repeat_interleave(rows, dim=0)
    drawn = torch.multinomial(others, count, generator=rng).reshape(cfg.heads, rows, count)
    keep = torch.rand(cfg.heads, rows, count, generator=rng, dtype=torch.float64) < cfg.text_query_similarity
    picks = torch.where(keep, head_targets[:, None, :], drawn)
    head_directions = directions.repeat_interleave(group, dim=0)  # [heads, pool, content]
    chosen = torch.stack([head_directions[h][picks[h]] for h in range(cfg.heads)])  # [heads, rows, t, content]
    return scale * cfg.text_sharpness * chosen.sum(2)
