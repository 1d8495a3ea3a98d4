"""A-VL (Zhang et al., AAAI 2025, "A-VL: Adaptive Attention for Large
Vision-Language Models"): visual tokens and text tokens managed apart.

Visual tokens (section "Adaptive Text-Aware Vision Attention"), per layer,
ranked by the last prompt token's attention averaged over heads (Eq. 1):
- core: the top C% of the image tokens, the only ones decode attends over;
- secondary: the top S% (S > C, so core is a subset), stored but not used;
- minor: the rest, evicted at prefill.
Every K steps an update step attends over every secondary token and makes
the top C% of them by that step's attention the new core set.
Optional prefill filter (on by default, P = 90 as in Table 3; P = 100 turns
it off): after the second layer only P% of the image tokens (by layer 2's
last-token attention) are kept in the caches of the later layers (FastV's
idea kept to prefill). Only the caches reflect it: the later layers' Q/K/V
are those of the whole prompt (replayed, or the model's own prefill), so
the prefill computation the paper saves is not saved here, and the later
layers' keys and values are those computed with every image token present
(as fastv.py says of FastV).
Text tokens (system prompt, question and generated ones): H2O's accumulated
attention within a window of T% of the text seen; over the window, the most
recent half stays and the older half keeps its highest scorers.

Decoding reads the rows it uses by index from the stored cache with the
selected-row decode op (ops/gather_decode), no gathered copy. The weights
the method keeps statistics of are recomputed in PyTorch from the op's LSE
over a float32 copy of the rows they are read for: the text rows every
step (H2O), every stored row on an update step (the new core). The stored
cache (secondary + text) and the used one (core + text, every update step
all stored) are reported apart, as in A-VL's Table 3.

Where the paper is open: percentages count the image tokens of the prompt
(core and secondary sizes stay fixed through decoding; with P below S, or
below C, the filtered layers store, or attend over, every image token the
filter kept, not S% or C% of those), all images (or
video frames) ranked together: one top C% and one top S% over every image
token, no share per image; H2O's score of a text token is its accumulated
attention from all prompt rows, then from every decode query (mean over
heads, as Eq. 1); T% applies to the text tokens seen so far (prompt text
plus generated), so the window grows with the answer and already trims the
prompt's text at prefill (the paper's window is "T% of the maximum text
token length", which it does not define further).
"""

from dataclasses import dataclass, field

import torch

from kernels_py.attention import expand_kv
from kernels_py.methods.base import Method, backend_knob
from kernels_py.methods.caches import kept_count
from kernels_py.methods.prompt import AllRows, LastRow, Prompt
from kernels_py.metrics import tensor_bytes
from kernels_py.ops import gather_decode
from kernels_py.params import Rule, knob


@dataclass
class AVLCache:
    """One layer: the stored rows (secondary image tokens and held text) in
    position order, which of them are visual and which are core, and the
    text tokens' accumulated attention."""

    keys: torch.Tensor  # [kv_heads, n, d]
    values: torch.Tensor
    positions: torch.Tensor  # [kv_heads, n] int64, the same for every kv head
    visual: torch.Tensor  # [n] bool
    core: torch.Tensor  # [n] bool, a subset of visual
    text_scores: torch.Tensor  # [n] float32, H2O's accumulated attention (text rows)
    seen: int
    text_seen: int  # text tokens seen (prompt text and generated): what T% applies to
    core_count: int
    notes: dict[str, float] = field(default_factory=dict)
    used: list[float] = field(default_factory=list)  # per step: rows attended / tokens seen
    step: int = 0

    @property
    def tokens(self) -> int:
        return self.keys.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.keys.shape[0]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        """K and V of the stored rows."""
        return tensor_bytes(self.keys, self.values)

    def keep(self, mask: torch.Tensor) -> None:
        self.keys, self.values = self.keys[:, mask], self.values[:, mask]
        self.positions = self.positions[:, mask]
        self.visual, self.core, self.text_scores = self.visual[mask], self.core[mask], self.text_scores[mask]

    def append(self, k_t, v_t) -> None:
        self.keys = torch.cat([self.keys, k_t.to(self.keys.dtype)], dim=1)
        self.values = torch.cat([self.values, v_t.to(self.values.dtype)], dim=1)
        position = self.positions.new_full((self.positions.shape[0], 1), self.seen)
        self.positions = torch.cat([self.positions, position], dim=1)
        self.visual = torch.cat([self.visual, self.visual.new_zeros(1)])
        self.core = torch.cat([self.core, self.core.new_zeros(1)])
        self.text_scores = torch.cat([self.text_scores, self.text_scores.new_zeros(1)])
        self.seen += 1
        self.text_seen += 1


def _percent(name: str, default: float, meaning: str, ref: str):
    return knob("float", default, f"{meaning} (A-VL Table 1's {name}%)", min=0.0, max=100.0, ref=ref)


@dataclass(frozen=True)
class AVL(Method):
    """A-VL: image tokens core (attended) / secondary (stored) / minor (evicted), core renewed every K steps."""

    name = "avl"
    paper = "Zhang et al., AAAI 2025, A-VL: Adaptive Attention for Large Vision-Language Models"

    secondary: float = _percent("S", 45.0, "percent of the image tokens stored (secondary; the rest, minor, are "
                                "evicted at prefill)", "A-VL Table 3")
    core: float = _percent("C", 30.0, "percent of the image tokens decode attends over (core, a subset of the "
                           "secondary ones)", "A-VL Table 3")
    update_every: int = knob("int", 3, "K: every K steps one step attends over all secondary tokens and refreshes "
                             "the core set", min=1, max=1 << 20, ref="A-VL Table 3")
    prefill_keep: float = _percent("P", 90.0, "percent of the image tokens kept after the second layer in the "
                                   "prefill filter; 100 = no filter", "A-VL Table 3")
    text_window: float = _percent("T", 50.0, "text cache window, percent of the text tokens seen; 100 = every text "
                                  "token kept", "A-VL Table 3")
    backend: str = backend_knob("selected-row decode attention and prompt statistics")

    RULES = (
        Rule("core < secondary", "core ({core}) must be below secondary ({secondary}): A-VL's C% of core tokens "
             "are a subset of its S% of secondary ones (S > C)"),
        Rule("core > 0", "core ({core}) must be above 0: C% is the share of image tokens decode attends over"),
        Rule("prefill_keep > 0", "prefill_keep ({prefill_keep}) must be above 0: P% is the share of image tokens "
             "the prefill filter keeps"),
        Rule("text_window > 0", "text_window ({text_window}) must be above 0: T% is the share of text tokens kept"),
    )

    def prefill_all(self, q, k, v, spans) -> list[AVLCache]:
        prompt = Prompt(q, k, v, spans)
        device = k[0].device
        visual_pos = spans.visual_positions().to(device)
        is_visual = torch.zeros(prompt.tokens, dtype=torch.bool, device=device)
        is_visual[visual_pos] = True
        n_visual = visual_pos.numel()
        filtered = is_visual
        caches = []
        for layer in range(prompt.layers):
            last = prompt.stats(layer, LastRow(), backend=self.backend).attn_sum.mean(dim=0)  # Eq. 1
            candidates = filtered if layer >= 2 else is_visual
            ranked = torch.where(candidates, last, -torch.inf)
            secondary = self._top(ranked, kept_count(self.secondary / 100, n_visual), candidates)
            core_count = kept_count(self.core / 100, n_visual)
            core = self._top(ranked, core_count, candidates)
            text_scores = prompt.stats(layer, AllRows(), backend=self.backend).attn_sum.mean(dim=0)  # H2O
            kv_heads = k[layer].shape[0]
            positions = torch.arange(prompt.tokens, device=device).expand(kv_heads, -1)
            cache = AVLCache(k[layer], v[layer], positions, is_visual.clone(), core, text_scores, prompt.tokens,
                             prompt.tokens - n_visual, core_count)
            cache.keep(secondary | ~is_visual)
            self._trim_text(cache)
            cache.notes.update(prefill_stored=cache.tokens / prompt.tokens)
            caches.append(cache)
            if layer == 1 and self.prefill_keep < 100:  # the filter after the second layer
                filtered = self._top(torch.where(is_visual, last, -torch.inf),
                                     kept_count(self.prefill_keep / 100, n_visual), is_visual)
        return caches

    @staticmethod
    def _top(scores: torch.Tensor, count: int, allowed: torch.Tensor) -> torch.Tensor:
        """[n] bool: the `count` highest scores among `allowed` (ties: earlier first)."""
        count = min(count, int(allowed.sum()))
        order = torch.argsort(torch.where(allowed, scores, -torch.inf), descending=True, stable=True)
        mask = torch.zeros_like(allowed)
        mask[order[:count]] = True
        return mask

    def _trim_text(self, cache: AVLCache) -> None:
        """Keep the text within T% of the text seen: the most recent half of the
        window always, the older half by accumulated attention."""
        text = ~cache.visual
        held = int(text.sum())
        budget = kept_count(self.text_window / 100, cache.text_seen)
        if held <= budget:
            return
        text_index = text.nonzero()[:, 0]
        recent = budget // 2
        older = text_index[:held - recent] if recent else text_index
        keep_older = older[cache.text_scores[older].topk(budget - recent).indices]
        keep = cache.visual.clone()
        keep[keep_older] = True
        if recent:
            keep[text_index[held - recent:]] = True
        cache.keep(keep)

    def decode(self, layer, cache: AVLCache, q_t, k_t, v_t) -> torch.Tensor:
        if not isinstance(cache, AVLCache):
            raise TypeError(f"{self.owner_name()}: decode needs the cache its prefill built, got "
                            f"{type(cache).__name__}")
        self.check_step(layer, cache, q_t, k_t, v_t)
        cache.append(k_t, v_t)
        cache.step += 1
        update = cache.step % self.update_every == 0
        rows = ((cache.core | ~cache.visual) if not update else torch.ones_like(cache.visual)).nonzero()[:, 0]
        heads, _, head_dim = q_t.shape
        kv_heads = cache.keys.shape[0]
        index = rows.to(torch.int32)[None, None].expand(1, kv_heads, -1)
        count = torch.full((1, kv_heads), rows.numel(), dtype=torch.int32, device=q_t.device)
        q_pos = torch.full((1, 1), cache.seen - 1, dtype=torch.int64, device=q_t.device)
        result = gather_decode.compute(q_t[None], q_pos, cache.keys[None], cache.values[None],
                                       cache.positions[:1], index, count, backend=self.backend)
        # This step's attention (mean over heads, Eq. 1) where it is read: the text rows' H2O scores every step,
        # and every stored row's on an update step, to choose the new core. A core row's weight is read on no
        # other step, so only the text rows are gathered then (in float32, a copy the kernel itself never makes).
        scored = rows if update else rows[~cache.visual[rows]]
        scored_keys = expand_kv(cache.keys[:, scored].float(), heads)
        logits = (scored_keys @ q_t.float().transpose(1, 2))[..., 0] * head_dim ** -0.5
        weights = torch.exp(logits - result.lse[0]).mean(dim=0)  # [scored], of the step's attention over rows
        text = ~cache.visual[scored]
        cache.text_scores[scored[text]] += weights[text]
        if update:
            ranked = torch.full_like(cache.text_scores, -torch.inf)
            ranked[scored] = weights
            cache.core = self._top(ranked, cache.core_count, cache.visual)
        cache.used.append(rows.numel() / cache.seen)
        self._trim_text(cache)
        return result.out[0]

    def layer_metrics(self, layer, cache: AVLCache) -> dict[str, float]:
        """stored_fraction: rows stored / tokens seen (A-VL Table 3's stored
        cache) after the last step; used_fraction: rows attended / tokens seen,
        mean over steps (its used cache); core_tokens, secondary_tokens (image
        rows stored) and text_tokens held now."""
        return {
            "stored_fraction": cache.tokens / cache.seen,
            "used_fraction": sum(cache.used) / len(cache.used) if cache.used else float("nan"),
            "core_tokens": float(cache.core.sum()),
            "secondary_tokens": float(cache.visual.sum()),
            "text_tokens": float((~cache.visual).sum()),
        }
