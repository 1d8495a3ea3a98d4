"""KV merging (LOOK-M section 3.3): each evicted token joins the kept token
whose key is most similar (cosine, Eq. 9), per kv head, and the kept keys
and values absorb what joined them; the similarity found on the keys also
weighs the values.

For a kept token c with the set sim(c) of L evicted tokens that chose it:

  averaged (Eq. 10)  k_c <- (k_c + sum_i k_i) / (L + 1)
  pivotal  (Eq. 11)  k_c <- (k_c + 1/2 sum_i (k_i + k_c)) / (L + 1)
                     (each evicted token is first averaged with its closest
                     kept token, the "pivotal" token, then merged in)
  weighted (Eq. 12)  k_c <- (k_c + sum_i S_ic k_i) / (L + 1)

and the same for v with the keys' similarities. A kept token nobody chose is
unchanged (L = 0). These are the paper's equations; LOOK-M's public code
pairs indices wrongly in averaged merging and leaves weighted merging
unnormalised, which is not reproduced here.

The nearest-kept-token search is blocked: at most one tile of `block` x
`block` similarities exists at a time, so 32K evicted against 32K kept
tokens never needs a 32K x 32K matrix.
"""

import torch
import torch.nn.functional as F

MERGES = ("averaged", "pivotal", "weighted")
BLOCK = 1024


def nearest(evicted: torch.Tensor, kept: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per kv head, the kept key most similar to each evicted one (Eq. 9):
    evicted [H, E, d], kept [H, C, d] -> (index [H, E] into kept, cosine
    similarity [H, E]). Ties go to the earlier kept token."""
    heads, n_evicted, _ = evicted.shape
    n_kept = kept.shape[1]
    if n_kept == 0:
        raise ValueError("nothing is kept to merge into")
    e = F.normalize(evicted.float(), dim=-1)
    c = F.normalize(kept.float(), dim=-1)
    best = torch.full((heads, n_evicted), -torch.inf, device=evicted.device)
    where = torch.zeros((heads, n_evicted), dtype=torch.int64, device=evicted.device)
    for e0 in range(0, n_evicted, block):
        e_tile = e[:, e0:e0 + block]
        for c0 in range(0, n_kept, block):
            sims = e_tile @ c[:, c0:c0 + block].transpose(1, 2)  # one tile [H, <=block, <=block]
            value, index = sims.max(dim=-1)
            better = value > best[:, e0:e0 + block]
            best[:, e0:e0 + block] = torch.where(better, value, best[:, e0:e0 + block])
            where[:, e0:e0 + block] = torch.where(better, index + c0, where[:, e0:e0 + block])
    return where, best


def merge(kept_k: torch.Tensor, kept_v: torch.Tensor, evicted_k: torch.Tensor, evicted_v: torch.Tensor, mode: str,
          block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged keys and values of the kept tokens ([H, C, d], kept's dtype)
    after the evicted ones ([H, E, d]) join their nearest kept token."""
    if mode not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {mode!r}")
    if evicted_k.shape[1] == 0:
        return kept_k, kept_v
    target, sim = nearest(evicted_k, kept_k, block)
    heads, n_kept, dim = kept_k.shape
    counts = torch.zeros((heads, n_kept), device=kept_k.device).scatter_add_(1, target, torch.ones_like(sim))
    into = target[..., None].expand(-1, -1, dim)
    merged = []
    for kept, evicted in ((kept_k.float(), evicted_k.float()), (kept_v.float(), evicted_v.float())):
        if mode == "weighted":
            contribution = evicted * sim[..., None]
        elif mode == "pivotal":  # (k_i + k_c) / 2 for each evicted token i and its target c
            contribution = (evicted + kept.gather(1, into)) / 2
        else:
            contribution = evicted
        total = kept + torch.zeros_like(kept).scatter_add_(1, into, contribution)
        merged.append((total / (counts[..., None] + 1)).to(kept_k.dtype))
    return merged[0], merged[1]
