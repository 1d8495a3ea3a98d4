"""ZipVL's quantized caches of a batch decoded together (mixed_precision.
QuantBatch, what the model adapter runs for them): each sequence's output
and, after write_back, its cache are what decoding it alone gives, the
steps that requantize included (they run sequence by sequence)."""

import copy

import pytest
import torch

from kernels_py.methods import make_method
from kernels_py.methods.mixed_precision import MixedPrecisionCache, QuantBatch
from kernels_py.models import generate_batch, sized
from kernels_py.ops import kv_quant
from kernels_py.workloads import SyntheticConfig, generate

TOL = {"cpu": 1e-5, "cuda": 1e-3}  # float32 on the CPU; the kernel's fp16 MMAs on a GPU

SEGMENT_FIELDS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "pos", "length")


def _prompts(texts):
    """Synthetic prompts of 8 + 64 + text tokens (float32), one per entry of texts."""
    out = []
    for i, text in enumerate(texts):
        cfg = SyntheticConfig(layers=1, heads=4, kv_heads=2, head_dim=64, tokens_per_image=64, system_tokens=8,
                              text_tokens=text, decode_steps=1, salient_tokens=8, dtype="float32", seed=i)
        out.append(generate(cfg))
    return out


def _assert_same_cache(mine: MixedPrecisionCache, theirs: MixedPrecisionCache):
    assert mine.seen == theirs.seen and sorted(mine.segments) == sorted(theirs.segments)
    for bits, seg in mine.segments.items():
        for name in SEGMENT_FIELDS:
            got, want = getattr(seg, name), getattr(theirs.segments[bits], name)
            assert got.is_contiguous(), (bits, name)  # its own tensors, not views of the batch's
            assert torch.equal(got, want), (bits, name)
    assert torch.equal(mine.dense_k, theirs.dense_k) and torch.equal(mine.dense_v, theirs.dense_v)
    assert torch.equal(mine.dense_positions, theirs.dense_positions)
    assert mine.nbytes == theirs.nbytes


@pytest.mark.parametrize("backend,steps", [("torch", 9), ("triton", 4)])
def test_a_batch_decodes_as_each_sequence_alone(backend, steps, device):
    """Prompts of three lengths (so their segments hold different slot
    counts), period 3: the batch runs two steps, the third requantizes
    sequence by sequence, then a new batch takes over."""
    prompts = _prompts([16, 40, 3])
    method = make_method("zipvl", {"period": 3, "group": 32, "sparse_prefill": False, "backend": backend})
    together = [method.prefill(0, p.q[0].to(device), p.k[0].to(device), p.v[0].to(device), p.spans)
                for p in prompts]
    alone = copy.deepcopy(together)
    assert len({tuple(seg.slots for seg in c.segments.values()) for c in together}) > 1  # ragged
    g = torch.Generator().manual_seed(1)
    batch, batched_steps = None, 0
    for step in range(steps):
        q = torch.randn(3, 4, 1, 64, generator=g).to(device)
        k, v = (torch.randn(3, 2, 1, 64, generator=g).to(device) for _ in range(2))
        if batch is None:
            batch = method.decode_batch(together, 8, {})
            assert isinstance(batch, QuantBatch)
        out = batch.decode(q, k, v)
        if out is None:  # written back: this step sequence by sequence
            batch = None
            out = torch.stack([method.decode(0, c, q[b], k[b], v[b]) for b, c in enumerate(together)])
        else:
            batched_steps += 1
        want = torch.stack([method.decode(0, c, q[b], k[b], v[b]) for b, c in enumerate(alone)])
        torch.testing.assert_close(out, want, atol=TOL[device.type], rtol=TOL[device.type])
    assert batched_steps == steps - steps // 3  # every third step requantizes
    assert alone[0].notes.get("blocks") == steps // 3  # and it did
    if batch is not None:
        batch.write_back()
        assert batch.keys is None and not batch.segments  # the padded copies are let go
    for mine, theirs in zip(together, alone):
        _assert_same_cache(mine, theirs)


def test_the_batch_grows_past_its_room():
    prompts = _prompts([16, 5])
    method = make_method("zipvl", {"period": 50, "group": 32, "sparse_prefill": False})
    together = [method.prefill(0, p.q[0], p.k[0], p.v[0], p.spans) for p in prompts]
    alone = copy.deepcopy(together)
    batch = method.decode_batch(together, 1, {})
    initial = batch.capacity
    g = torch.Generator().manual_seed(2)
    for _ in range(initial + 2):
        q = torch.randn(2, 4, 1, 64, generator=g)
        k, v = torch.randn(2, 2, 1, 64, generator=g), torch.randn(2, 2, 1, 64, generator=g)
        out = batch.decode(q, k, v)
        want = torch.stack([method.decode(0, c, q[b], k[b], v[b]) for b, c in enumerate(alone)])
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert batch.capacity > initial
    batch.write_back()
    for mine, theirs in zip(together, alone):
        _assert_same_cache(mine, theirs)


def test_which_caches_decode_together():
    prompts = _prompts([16, 5])
    method = make_method("zipvl", {"group": 32, "sparse_prefill": False})
    caches = [method.prefill(0, p.q[0], p.k[0], p.v[0], p.spans) for p in prompts]
    assert QuantBatch.holds(caches)
    other_group = make_method("zipvl", {"group": 64, "sparse_prefill": False})
    odd = other_group.prefill(0, prompts[0].q[0], prompts[0].k[0], prompts[0].v[0], prompts[0].spans)
    assert not QuantBatch.holds([caches[0], odd])
    # period 1 requantizes every step: nothing to take together
    assert make_method("zipvl", {"period": 1}).decode_batch(caches, 8, {}) is None
    assert not make_method("zipvl").decodes_together  # so no CUDA graph: its steps are not all alike
    fixed = make_method("zipvl_fixed", {"group": 32}).decode_batch(caches, 8, {})  # the same decode
    assert isinstance(fixed, QuantBatch)
    fixed.write_back()

    class Annotating(type(method)):  # a decode that does more than QuantBatch knows
        def decode(self, layer, cache, q_t, k_t, v_t):
            cache.notes["steps"] = cache.notes.get("steps", 0) + 1
            return super().decode(layer, cache, q_t, k_t, v_t)

    assert Annotating(group=32).decode_batch(caches, 8, {}) is None
    assert make_method("kivi", {"group": 32}).decode_batch(caches, 8, {}) is None  # its own window rule


def test_stack_pads_each_sequence_to_the_longest():
    g = torch.Generator().manual_seed(0)
    segs = []
    for slots, length in ((64, 64), (32, 32), (96, 64)):
        x = torch.randn(1, 2, slots, 32, generator=g)
        pos = torch.arange(slots, dtype=torch.int32)[None].clone()
        segs.append(kv_quant.reference.quantize(x, x, pos, torch.tensor([length]), bits=4, group=32))
    stacked = kv_quant.stack(segs)
    assert stacked.slots == 96 and stacked.length.tolist() == [64, 32, 64]
    for b, seg in enumerate(segs):
        for name in SEGMENT_FIELDS[:-1]:
            got, want = getattr(stacked, name)[b], getattr(seg, name)[0]
            dim = want.dim() - (1 if name == "pos" else 2)
            assert torch.equal(got.narrow(dim, 0, want.shape[dim]), want), name
        assert (stacked.pos[b, seg.slots:] == kv_quant.PAD_POS).all()
    with pytest.raises(ValueError, match="cannot stack a 2-bit"):
        x = torch.zeros(1, 2, 32, 32)
        two = kv_quant.reference.quantize(x, x, torch.zeros(1, 32, dtype=torch.int32), torch.tensor([32]), bits=2,
                                          group=32)
        kv_quant.stack([segs[0], two])


def test_a_models_batch_generates_as_sequence_by_sequence(monkeypatch, device):
    """Inside the model: ZipVL's sequences, of three prompt lengths (left
    padding), decoded together or one by one choose the same tokens from
    the same distributions and end with the same caches; the step that
    requantizes (period 3) runs sequence by sequence."""
    vlm = sized.build("tiny-llava", 256, device=device, dtype=torch.float32)
    inputs = sized.prompt(vlm, 3, 64, 12, torch.Generator().manual_seed(3))
    ids, mask = inputs["input_ids"], torch.ones_like(inputs["input_ids"])
    for b, pad in enumerate((0, 4, 9)):
        ids[b] = torch.cat([ids.new_zeros(pad), ids[b, :ids.shape[1] - pad]])
        mask[b, :pad] = 0
    inputs["attention_mask"] = mask
    method = make_method("zipvl", {"period": 3, "group": 32})
    calls = []
    decode = QuantBatch.decode
    monkeypatch.setattr(QuantBatch, "decode", lambda self, q, k, v: calls.append(len(self.caches)) or decode(
        self, q, k, v))
    together = generate_batch(vlm, method, inputs, 6)
    layers = vlm.model.config.text_config.num_hidden_layers
    # 5 steps a layer: 1 and 2 together, 3 writes back (requantizes alone), 4 and 5 together
    assert calls == [3] * (layers * 5)
    monkeypatch.setattr(type(method), "decode_batch", lambda self, caches, room, scratch: None)
    alone = generate_batch(vlm, method, inputs, 6)
    for a, b in zip(together, alone):
        assert a.tokens == b.tokens and a.cache_bytes == b.cache_bytes
        torch.testing.assert_close(a.logits, b.logits, atol=10 * TOL[device.type], rtol=10 * TOL[device.type])
