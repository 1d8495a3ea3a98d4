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


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _assert_same_cache(mine: MixedPrecisionCache, theirs: MixedPrecisionCache, batches: dict):
    """mine (decoded in batches) holds what theirs (decoded alone) does, in
    tensors of its own: none shares memory with a batch's (`batches`: the
    batches' tensors by storage, kept alive so no address is reused)."""
    assert mine.seen == theirs.seen and sorted(mine.segments) == sorted(theirs.segments)
    for bits, seg in mine.segments.items():
        for name in SEGMENT_FIELDS:
            got, want = getattr(seg, name), getattr(theirs.segments[bits], name)
            assert _storage(got) not in batches, (bits, name)
            assert torch.equal(got, want), (bits, name)
    for name in ("dense_k", "dense_v", "dense_positions"):
        assert _storage(getattr(mine, name)) not in batches, name
        assert torch.equal(getattr(mine, name), getattr(theirs, name)), name
    assert mine.nbytes == theirs.nbytes


def _step(g, batch, heads, kv_heads, device):
    q = torch.randn(batch, heads, 1, 64, generator=g).to(device)
    return q, *(torch.randn(batch, kv_heads, 1, 64, generator=g).to(device) for _ in range(2))


def _run(method, together, alone, steps, g, room, device):
    """steps decode steps of the caches `together` as the model adapter runs
    them (a batch, written back where it cannot take a step, made again the
    step after) against `alone` decoded one by one; returns how many steps
    ran together, how many batches wrote back and whether one grew."""
    batch, together_steps, written_back, grew, batches = None, 0, 0, False, {}
    for _ in range(steps):
        q, k, v = _step(g, len(together), 4, 2, device)
        if batch is None:
            batch = method.decode_batch(together, room, {})
            assert isinstance(batch, QuantBatch)
        before = batch.capacity
        out = batch.decode(q, k, v)
        grew |= out is not None and 0 < before < batch.capacity
        if out is None:  # written back: this step sequence by sequence
            batch, written_back = None, written_back + 1
            out = torch.stack([method.decode(0, c, q[b], k[b], v[b]) for b, c in enumerate(together)])
        else:
            together_steps += 1
            held = [batch.keys, batch.values, batch.positions]
            batches.update((_storage(t), t) for t in held + [getattr(seg, f) for seg in batch.segments
                                                           for f in SEGMENT_FIELDS])
        want = torch.stack([method.decode(0, c, q[b], k[b], v[b]) for b, c in enumerate(alone)])
        torch.testing.assert_close(out, want, atol=TOL[device.type], rtol=TOL[device.type])
    if batch is not None:
        batch.write_back()
        assert batch.keys is None and not batch.segments  # the padded copies are let go
    for mine, theirs in zip(together, alone):
        _assert_same_cache(mine, theirs, batches)
    return together_steps, written_back, grew


def test_a_batch_decodes_as_each_sequence_alone(device):
    """Prompts of three lengths (so their segments hold different slot
    counts), period 3: the batch runs two steps, the third requantizes
    sequence by sequence, then a new batch takes over."""
    prompts = _prompts([16, 40, 3])
    steps = 9
    method = make_method("zipvl", {"period": 3, "group": 32, "sparse_prefill": False})
    together = [method.prefill(0, p.q[0].to(device), p.k[0].to(device), p.v[0].to(device), p.spans)
                for p in prompts]
    alone = copy.deepcopy(together)
    assert len({tuple(seg.slots for seg in c.segments.values()) for c in together}) > 1  # ragged
    together_steps, written_back, _ = _run(method, together, alone, steps, torch.Generator().manual_seed(1), 8,
                                           device)
    assert together_steps == steps - steps // 3 and written_back == steps // 3  # every third step requantizes
    assert alone[0].notes.get("blocks") == steps // 3  # and it did


@pytest.mark.parametrize("backend", ["torch", "triton"])  # the op's reference, or its kernel
def test_sequences_of_other_widths_and_waiting_tokens(backend, device):
    """One sequence holds only 4-bit tokens, one only 2-bit ones, one both
    (a stacked segment holds nothing for some sequences); they wait with 0,
    2 and 5 tokens when the batch is made, and the batch has room for one
    step, so it grows."""
    prompts = _prompts([16, 40, 3])
    caches = []
    for p, ratio in zip(prompts, (1.0, 0.0, 0.5)):
        one = make_method("zipvl_fixed", {"ratio": ratio, "period": 40, "group": 32, "backend": backend})
        caches.append(one.prefill(0, p.q[0].to(device), p.k[0].to(device), p.v[0].to(device), p.spans))
    assert [sorted(c.segments) for c in caches] == [[4], [2], [2, 4]]
    method = make_method("zipvl_fixed", {"period": 40, "group": 32, "backend": backend})
    g = torch.Generator().manual_seed(5)
    for b, waits in enumerate((0, 2, 5)):
        for _ in range(waits):
            q, k, v = _step(g, 1, 4, 2, device)
            method.decode(0, caches[b], q[0], k[0], v[0])
    alone = copy.deepcopy(caches)
    steps = 2 if backend == "triton" else 8
    assert _run(method, caches, alone, steps, g, 1, device) == (steps, 0, True)


@pytest.mark.parametrize("residual", [4, 200])  # 200: nothing is quantized, the window holds every token
def test_kivi_batches_between_its_window_flushes(residual, device):
    prompts = _prompts([16, 40, 3])
    method = make_method("kivi", {"residual": residual, "group": 32})
    together = [method.prefill(0, p.q[0].to(device), p.k[0].to(device), p.v[0].to(device), p.spans)
                for p in prompts]
    alone = copy.deepcopy(together)
    waiting = [c.dense_positions.shape[0] for c in together]
    assert (residual == 200) == (not any(c.segments for c in together))
    # With residual 4 the window flushes once 36 tokens wait: the first prompt's 24 get there at step 12.
    assert waiting == ([24, 16, 11] if residual == 4 else [88, 112, 75])
    ran = _run(method, together, alone, 12, torch.Generator().manual_seed(7), 8, device)
    assert ran == ((11, 1, True) if residual == 4 else (12, 0, True))  # room for 8 steps: both grow


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
    the same distributions and hold as many bytes; the step that
    requantizes (period 3) runs sequence by sequence."""
    vlm = sized.build("tiny-llava", 256, device=device, dtype=torch.float32)
    inputs = sized.prompt(vlm, 3, 64, 12, torch.Generator().manual_seed(3))
    ids, mask = inputs["input_ids"], torch.ones_like(inputs["input_ids"])
    for b, pad in enumerate((0, 4, 9)):
        ids[b] = torch.cat([ids.new_zeros(pad), ids[b, :ids.shape[1] - pad]])
        mask[b, :pad] = 0
    inputs["attention_mask"] = mask
    method = make_method("zipvl", {"period": 3, "group": 32})
    calls, caches = [], {}
    decode = QuantBatch.decode

    def spy(self, q, k, v):
        sequences = len(self.caches)
        out = decode(self, q, k, v)
        calls.append((sequences, out is None))
        return out

    monkeypatch.setattr(QuantBatch, "decode", spy)
    together = generate_batch(vlm, method, inputs, 6)
    layers = vlm.model.config.text_config.num_hidden_layers
    # 5 steps a layer: 1 and 2 together, 3 writes back (requantizes alone), 4 and 5 together
    assert calls == [(3, False)] * (layers * 2) + [(3, True)] * layers + [(3, False)] * (layers * 2)
    monkeypatch.setattr(type(method), "decode_batch", lambda self, caches, room, scratch: None)
    alone = generate_batch(vlm, method, inputs, 6)
    assert len(together) == len(alone) == 3
    for a, b in zip(together, alone):
        assert a.tokens == b.tokens and a.cache_bytes == b.cache_bytes
        torch.testing.assert_close(a.logits, b.logits, atol=10 * TOL[device.type], rtol=10 * TOL[device.type])
