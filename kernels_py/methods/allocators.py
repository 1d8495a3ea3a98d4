"""Allocators: how many tokens each layer keeps. An allocator sees the whole
prompt (every layer, through methods.prompt's statistics) and gives each
layer its share of the tokens and the count that share keeps of the prompt,
with the per-layer facts it decided on (reported as layer metrics). A method
that evicts while decoding holds the same share of the tokens seen after
every step (methods.base.TokenSelection).

  Uniform          int(budget * tokens) in every layer (H2O, SnapKV, StreamingLLM)
  SparsityGuided   VL-Cache Algorithm 1: layer budgets from post-vision sparsity
  AdaptiveTau      ZipVL Eq. 6: the fewest tokens holding tau of the probe attention

Rank groups (how many ranks each token of a low-rank cache is rebuilt with,
AttentionPack section 3.2) are an allocation of ranks rather than tokens and
live here too.
"""

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels_py.methods.caches import kept_count
from kernels_py.methods.prompt import THRESHOLD, PostVisionRows, ProbeRows, Prompt
from kernels_py.params import Rule

BUDGET_CLIP = (0.01, 1.0)  # VL-Cache Algorithm 1, line 12


@dataclass
class Allocation:
    """What one layer keeps after prefill, and why: `count` tokens of the
    prompt, its `share` of the tokens (count = kept_count(share, T))."""

    count: int
    share: float
    notes: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, share: float, tokens: int, notes: dict[str, float] | None = None) -> "Allocation":
        return cls(kept_count(share, tokens), share, notes or {})


class Allocator:
    def prefill(self, prompt: Prompt) -> list[Allocation]:
        raise NotImplementedError


@dataclass(frozen=True)
class Uniform(Allocator):
    """A fraction `budget` of the tokens in every layer: int(budget * T);
    budget = 1 never evicts."""

    budget: float

    def prefill(self, prompt):
        return [Allocation.of(self.budget, prompt.tokens) for _ in range(prompt.layers)]


@dataclass(frozen=True)
class SparsityGuided(Allocator):
    """VL-Cache Algorithm 1: layer l keeps a share beta_l = clip((1 - gamma_l) /
    sum_l'(1 - gamma_l') * alpha * L, 0.01, 1) of the prompt, gamma_l being its
    sparsity over the post-vision rows (Eq. 1-2, averaged over heads). With
    weigh=False every layer gets alpha (the paper's uniform ablation); the
    sparsity is still measured and reported."""

    budget: float
    threshold: float = THRESHOLD
    weigh: bool = True
    backend: str = "auto"
    redistribute: bool = False

    def prefill(self, prompt):
        sparsity = [prompt.stats(layer, PostVisionRows(), self.threshold, self.backend).sparsity(per_head=False).item()
                    for layer in range(prompt.layers)]
        budgets = allocate_budgets(sparsity, self.budget, self.redistribute) if self.weigh \
            else [self.budget] * prompt.layers
        return [Allocation.of(beta, prompt.tokens, {"layer_budget": beta, "allocation_sparsity": gamma})
                for gamma, beta in zip(sparsity, budgets)]


def allocate_budgets(sparsity: list[float], alpha: float, redistribute: bool = False) -> list[float]:
    """Algorithm 1 lines 9-12: per-layer budgets from head-averaged sparsities.
    The clip to [0.01, 1] can leave the mean budget off alpha; with
    `redistribute` the budget clipped away (or added) is shared among the
    layers the clip did not touch, in proportion to their dense share, until
    the mean is alpha or every layer is at a bound (water-filling)."""
    dense_share = [1.0 - g for g in sparsity]
    total = sum(dense_share)
    layers = len(sparsity)
    lo, hi = BUDGET_CLIP
    if total <= 0:  # every layer fully sparse: nothing to weigh by
        return [min(max(alpha, lo), hi)] * layers
    budgets = [min(max(d / total * alpha * layers, lo), hi) for d in dense_share]
    if not redistribute:
        return budgets
    free = [lo < b < hi for b in budgets]
    for _ in range(layers):
        missing = alpha * layers - sum(budgets)
        weight = sum(d for d, f in zip(dense_share, free) if f)
        if abs(missing) < 1e-12 or weight <= 0:
            break
        budgets = [min(max(b + missing * d / weight, lo), hi) if f else b
                   for b, d, f in zip(budgets, dense_share, free)]
        free = [f and lo < b < hi for b, f in zip(budgets, free)]
    return budgets


@dataclass(frozen=True)
class Pyramid(Allocator):
    """PyramidKV: per-layer budgets decreasing linearly from the first layer to
    the last, averaging `budget`: the last layer keeps budget / beta, the
    first 2 * budget - budget / beta (PyramidKV's k^{L-1} = K / (beta L),
    k^0 = 2K / L - k^{L-1} for a total K), so the total matches a uniform
    budget's. A layer's share is capped at 1.

    With `window` (the observation window's length for a prompt of T tokens)
    the schedule covers what the mean budget leaves after the window, and
    every layer keeps the window besides, as the authors' code does; a mean
    budget no larger than the window gives every layer the mean (kvpress's
    fallback to SnapKV)."""

    budget: float
    beta: float = 20.0
    window: Callable[[int], int] | None = None

    def prefill(self, prompt):
        return [Allocation.of(share, prompt.tokens, {"layer_budget": share})
                for share in self.shares(prompt.tokens, prompt.layers)]

    def shares(self, tokens: int, layers: int) -> list[float]:
        window = min(self.window(tokens), tokens) if self.window else 0
        mean = self.budget * tokens  # tokens a layer keeps on average
        if not window:
            return pyramid_shares(self.budget, self.beta, layers)
        if mean <= window:
            return [self.budget] * layers
        # The schedule over the tokens outside the window, as shares of them (capped at all of them).
        rest = pyramid_shares((mean - window) / (tokens - window), self.beta, layers)
        return [(window + r * (tokens - window)) / tokens for r in rest]


def pyramid_shares(budget: float, beta: float, layers: int) -> list[float]:
    """PyramidKV's linear schedule averaging `budget`; shares above 1 (lower
    layers at budgets above about one half) are capped and what the cap
    removes goes to the other layers in proportion to their share, so the
    mean stays `budget` (up to every layer at 1)."""
    last = budget / beta
    first = 2 * budget - last
    shares = [first + (last - first) * (i / (layers - 1) if layers > 1 else 0.5) for i in range(layers)]
    for _ in range(layers):
        shares = [min(s, 1.0) for s in shares]
        missing = budget * layers - sum(shares)
        free = sum(s for s in shares if s < 1.0)
        if missing <= 1e-12 or free <= 0:
            break
        shares = [s + missing * s / free if s < 1.0 else s for s in shares]
    # What rounding leaves a hair below 1 is the whole prompt: at budget 1 the water-filling left the last layer
    # 1 - 2e-16, which kept_count truncates to a token fewer (the authors' code keeps every token of a prompt
    # within the budget, pyramidkv_utils.py: q_len < max_capacity_prompt).
    return [1.0 if s > 1.0 - 1e-9 else s for s in shares]


@dataclass(frozen=True)
class AdaptiveTau(Allocator):
    """ZipVL Eq. 6: per layer, the fewest tokens whose accumulated attention
    from the probe rows (column sums over all query heads) reaches tau times
    the total. A layer whose attention is spread out keeps more: the ratio
    adapts per layer and per prompt."""

    tau: float
    rows: ProbeRows
    backend: str = "auto"

    def prefill(self, prompt):
        out = []
        for layer in range(prompt.layers):
            s = prompt.stats(layer, self.rows, backend=self.backend)
            count = important_count(s.attn_sum.sum(dim=0), self.tau)
            out.append(Allocation(count, count / prompt.tokens, {"important_ratio": count / prompt.tokens,
                                                                 "probe_rows": float(prompt.rows(self.rows).numel())}))
        return out


def important_count(accumulated: torch.Tensor, tau: float) -> int:
    """Eq. 6: min p such that the p largest of `accumulated` ([n], summed over
    heads and probe rows) sum to at least tau times their total."""
    ranked = accumulated.double().sort(descending=True).values
    reach = ranked.cumsum(0) >= tau * ranked.sum() * (1 - 1e-12)  # rounding must not push tau = 1 past n
    return int(reach.nonzero()[0].item()) + 1


# --- ranks of a low-rank cache (AttentionPack section 3.2) -------------------------------------------

_FRACTION = r"(?:\d+(?:\.\d*)?|\.\d+)"
# 'token_fraction:rank_fraction,...': the form of AttentionPack's `groups` knob.
GROUPS_PATTERN = rf"{_FRACTION}:{_FRACTION}(?:,{_FRACTION}:{_FRACTION})*"
# What makes a well-formed groups string a valid one. Rules, so that
# `workbench plan` rejects a bad one before anything runs.
GROUPS_RULES = (
    Rule('all([0 < float(g.split(":")[0]) and float(g.split(":")[0]) <= 1 and 0 < float(g.split(":")[1]) and '
         'float(g.split(":")[1]) <= 1 for g in groups.split(",")])',
         "groups={groups!r}: every token fraction and rank fraction must lie in (0, 1]"),
    Rule('abs(sum([float(g.split(":")[0]) for g in groups.split(",")]) - 1) <= 1e-6',
         "groups={groups!r}: the token fractions must sum to 1"),
    Rule('float(groups.split(",")[0].split(":")[1]) == 1 and all([float(a.split(":")[1]) >= float(b.split(":")[1]) '
         'for a, b in zip(groups.split(",")[:-1], groups.split(",")[1:])])',
         "groups={groups!r}: rank fractions must start at 1 (full rank for the most important group) and never "
         "increase"),
)


def parse_groups(text: str) -> tuple[tuple[float, float], ...]:
    """"0.25:1,0.75:0.25" -> ((0.25, 1.0), (0.75, 0.25)): per group, most
    important first, (share r_f of the compressed tokens, share of the rank R
    it is rebuilt with). Shares of tokens must sum to 1; rank shares lie in
    (0, 1], start at 1 (group 1 is rebuilt at the compression rank) and never
    grow (GROUPS_PATTERN and GROUPS_RULES)."""
    if not re.fullmatch(GROUPS_PATTERN, text):
        raise ValueError(f"groups={text!r} is not 'token_fraction:rank_fraction,...'")
    for rule in GROUPS_RULES:
        if not rule.holds({"groups": text}):
            raise ValueError(rule.message.format(groups=text))
    return tuple((float(f), float(r)) for f, r in (item.split(":") for item in text.split(",")))


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


def importance_groups(importance: torch.Tensor, sizes: list[int],
                      positions: torch.Tensor | None = None) -> torch.Tensor:
    """[T] int64 group index of each token: tokens sorted by importance fill
    groups of `sizes` in order; ties go to the earlier position (positions
    [T], default the index)."""
    if positions is None:
        order = torch.argsort(importance, descending=True, stable=True)
    else:
        by_position = torch.argsort(positions, stable=True)
        order = by_position[torch.argsort(importance[by_position], descending=True, stable=True)]
    group = torch.empty(importance.shape[0], dtype=torch.int64, device=importance.device)
    start = 0
    for index, size in enumerate(sizes):
        group[order[start:start + size]] = index
        start += size
    return group


def group_ranks(importance: torch.Tensor, groups: tuple[tuple[float, float], ...], rank: int) -> torch.Tensor:
    """[T] int64 rank prefix of each token: tokens sorted by importance [T]
    (ties: earlier first) fill the groups in order."""
    sizes = group_sizes(importance.shape[0], [f for f, _ in groups])
    ranks = torch.tensor([group_rank(share, rank) for _, share in groups], device=importance.device)
    return ranks[importance_groups(importance, sizes)]
