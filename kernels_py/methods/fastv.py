"""FastV (Chen et al., 2024, "An Image is Worth 1/2 Tokens After Layer 2")
with a KV cache, as the A-VL paper runs it to show its weakness: after layer
K, a share R of the image tokens, those the last prompt token attends to
least at layer K (mean over heads), is dropped from the caches of every
later layer; layers up to K keep everything. That ranking is FastV's code's
(the last token's row of layer K's attention, pkunlp-icler/FastV); the
paper's text words it as the mean attention a token receives from every
token. Text tokens are all kept, and so are generated ones. FastV itself
prunes during prefill computation; in this teacher-forced workload only the
caches reflect the pruning."""

from dataclasses import dataclass

import torch

from kernels_py.methods.base import Method, backend_knob
from kernels_py.methods.caches import KeptTokens
from kernels_py.methods.prompt import LastRow, Prompt
from kernels_py.params import knob


@dataclass(frozen=True)
class FastV(Method):
    """FastV with a KV cache: after layer K, the R% of image tokens least attended by the last token are dropped."""

    name = "fastv"
    paper = "Chen et al., 2024, An Image is Worth 1/2 Tokens After Layer 2 (FastV)"

    layer: int = knob("int", 2, "K: the layers after this one lose the image tokens the last prompt token attends "
                      "to least at layer K (FastV: 2); 0: every layer, ranked by the first layer's own attention "
                      "(FastV's code has no attention to rank by there); K >= the layers: none", min=0, max=4096,
                      ref="FastV")
    drop: float = knob("float", 50.0, "R: percent of the image tokens dropped (FastV: 50)", min=0.0, max=100.0,
                       ref="FastV")
    backend: str = backend_knob()

    def prefill_all(self, q, k, v, spans) -> list[KeptTokens]:
        prompt = Prompt(q, k, v, spans)
        caches = [KeptTokens.from_prompt(k[i], v[i]) for i in range(prompt.layers)]
        if self.layer < prompt.layers and self.drop > 0:
            self._prune(prompt, caches)
        for cache in caches:
            cache.own()  # the layers that keep every token hold the prompt's K and V as they were given them
        return caches

    def _prune(self, prompt: Prompt, caches: list[KeptTokens]) -> None:
        k, spans = prompt.k, prompt.spans
        visual = spans.visual_positions().to(k[0].device)
        ranking_layer = max(self.layer - 1, 0)  # the attention at layer K decides (0-based: layer K - 1 computed it)
        last = prompt.stats(ranking_layer, LastRow(), backend=self.backend).attn_sum.mean(dim=0)
        # The image keeps int(n * (1 - drop)), every budget's rule (kept_count) without its floor of one token:
        # drop = 100 drops them all.
        kept = int(visual.numel() * (1 - self.drop / 100))
        dropped = visual[last[visual].argsort()[:visual.numel() - kept]]
        keep = torch.ones(prompt.tokens, dtype=torch.bool, device=k[0].device)
        keep[dropped] = False
        index = keep.nonzero()[:, 0]
        for cache in caches[self.layer:]:
            cache.keep(index.expand(cache.keys.shape[0], -1))

    def decode(self, layer, cache: KeptTokens, q_t, k_t, v_t) -> torch.Tensor:
        self.check_step(layer, cache, q_t, k_t, v_t)
        cache.append(k_t, v_t)
        return cache.attend(q_t)[0]
