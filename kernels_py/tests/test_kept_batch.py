"""Kept tokens of a batch decoded together (caches.KeptBatch, what the
model adapter runs for methods whose decode only appends and attends): each
sequence's output and, after write_back, its cache are what decoding it
alone gives."""

import pytest
import torch

from kernels_py.methods import make_method
from kernels_py.methods.caches import KeptBatch, KeptTokens
from kernels_py.methods.float8 import Float8Tokens
from kernels_py.models import generate_batch, sized

# float32 throughout: the kernels' and SDPA's float32 paths agree to rounding (looser on a GPU: other kernels).
TOL = {"cpu": 1e-5, "cuda": 1e-4}


def _caches(counts, kv_heads, head_dim, seen, generator, device="cpu"):
    """Kept tokens of a prompt of `seen` tokens: `counts[b]` of them, at scattered positions."""
    caches = []
    for n in counts:
        k = torch.randn(kv_heads, seen, head_dim, generator=generator).to(device)
        cache = KeptTokens.from_prompt(k, torch.randn(kv_heads, seen, head_dim, generator=generator).to(device))
        cache.keep(torch.stack([torch.randperm(seen, generator=generator)[:n] for _ in range(kv_heads)]).to(device))
        caches.append(cache)
    return caches


def _copy(cache: KeptTokens) -> KeptTokens:
    return KeptTokens(cache.keys.clone(), cache.values.clone(), cache.positions.clone(), None, cache.seen)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("room", [6, 0])  # 0: the batch outgrows its room and grows
@pytest.mark.parametrize("backend", ["torch", "triton"])  # SDPA under a mask, or gather_decode (a GPU's default)
def test_a_batch_decodes_as_each_sequence_alone(heads, kv_heads, room, backend, device):
    g = torch.Generator().manual_seed(heads * 10 + room)
    head_dim, steps = 16, 6
    together = _caches([7, 12, 3], kv_heads, head_dim, 20, g, device)
    alone = [_copy(c) for c in together]
    batch = KeptBatch.of(together, room)
    initial = batch.capacity
    for _ in range(steps):
        q = torch.randn(3, heads, 1, head_dim, generator=g).to(device)
        k, v = (torch.randn(3, kv_heads, 1, head_dim, generator=g).to(device) for _ in range(2))
        batch.append(k, v)
        out = batch.attend(q, backend)
        for b, cache in enumerate(alone):
            cache.append(k[b], v[b])
            want, _ = cache.attend(q[b], weights=False)
            torch.testing.assert_close(out[b], want, atol=TOL[device.type], rtol=TOL[device.type])
    assert (batch.capacity > initial) == (room == 0)  # with no room it grew, with room for every step it did not
    padded = batch.keys.untyped_storage().data_ptr()
    batch.write_back()
    assert batch.keys is None and batch.values is None  # the padded cache is let go
    for mine, theirs in zip(together, alone):
        assert mine.seen == theirs.seen == 20 + steps and mine.tokens == theirs.tokens
        torch.testing.assert_close(mine.keys, theirs.keys, atol=0, rtol=0)
        torch.testing.assert_close(mine.values, theirs.values, atol=0, rtol=0)
        assert torch.equal(mine.positions, theirs.positions)
        assert mine.keys.is_contiguous() and mine.nbytes == theirs.nbytes
        assert mine.keys.untyped_storage().data_ptr() != padded  # its own copy


def test_only_plain_kept_tokens_decode_together():
    g = torch.Generator().manual_seed(0)
    plain = _caches([4, 5], 2, 8, 10, g)
    assert KeptBatch.holds(plain)
    scored = _caches([4], 2, 8, 10, g)[0]
    scored.scores = torch.zeros(2, 4)  # statistics a decode must keep up to date
    evicting = _caches([4], 2, 8, 10, g)[0]
    evicting.share = 0.5
    other_heads = _caches([4], 4, 8, 10, g)[0]
    fp8 = Float8Tokens(_caches([4], 2, 8, 10, g)[0], "e4m3", "tensor")
    for odd in (scored, evicting, other_heads, fp8):
        assert not KeptBatch.holds([plain[0], odd])


@pytest.mark.parametrize("knobs,together", [
    ({"attention": "sdpa"}, True),
    ({"attention": "float32"}, False),  # the float32 attention comparisons use
    ({"attention": "sdpa", "evict_while_decoding": True}, False),
    ({"attention": "sdpa", "kv_dtype": "fp8_e4m3"}, False),  # fp8 codes: the fused fp8 decode op's
])
def test_which_methods_decode_together(knobs, together):
    assert make_method("vlcache", knobs).decodes_together is together


def test_methods_with_their_own_decode_do_not():
    for name in ("lookm", "fastv", "kivi"):  # LOOK-M merges what it evicts; the others hold other caches or rules
        assert not make_method(name).decodes_together
    vlcache = type(make_method("vlcache"))

    class Annotating(vlcache):  # a selection whose decode does more than append and attend
        def decode(self, layer, cache, q_t, k_t, v_t):
            cache.notes["steps"] = cache.notes.get("steps", 0) + 1
            return super().decode(layer, cache, q_t, k_t, v_t)

    assert not Annotating(attention="sdpa").decodes_together


def test_a_models_batch_generates_as_sequence_by_sequence(monkeypatch, device):
    """Inside the model: VL-Cache's sequences hold different counts a layer,
    decoded together or one by one they choose the same tokens from the
    same distributions and end with the same caches."""
    vlm = sized.build("tiny-llava", 256, device=device, dtype=torch.float32)
    inputs = sized.prompt(vlm, 3, 64, 12, torch.Generator().manual_seed(3))
    ids, mask = inputs["input_ids"], torch.ones_like(inputs["input_ids"])
    for b, pad in enumerate((0, 4, 9)):  # left padding: prompts of three lengths, so VL-Cache keeps three counts
        ids[b] = torch.cat([ids.new_zeros(pad), ids[b, :ids.shape[1] - pad]])
        mask[b, :pad] = 0
    inputs["attention_mask"] = mask
    method = make_method("vlcache", {"attention": "sdpa", "budget": 0.3})
    calls = []
    attend = KeptBatch.attend
    monkeypatch.setattr(KeptBatch, "attend", lambda self, q_t: calls.append(len(self.caches)) or attend(self, q_t))
    together = generate_batch(vlm, method, inputs, 6)
    layers = vlm.model.config.text_config.num_hidden_layers
    assert calls == [3] * (layers * 5)  # every layer's 5 steps, the 3 sequences at once
    monkeypatch.setattr(type(method), "decodes_together", property(lambda self: False))
    alone = generate_batch(vlm, method, inputs, 6)
    assert len(calls) == layers * 5
    counts = {tuple(kept.shape[1] for kept in g.kept) for g in together}
    assert len(counts) > 1, counts  # the sequences hold different counts: ragged
    assert len(together) == len(alone) == 3
    for a, b in zip(together, alone):
        assert a.tokens == b.tokens and a.cache_bytes == b.cache_bytes
        torch.testing.assert_close(a.logits, b.logits, atol=10 * TOL[device.type], rtol=10 * TOL[device.type])
