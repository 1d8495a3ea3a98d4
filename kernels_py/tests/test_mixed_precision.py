"""ZipVL as Algorithm 1, its fixed-ratio baseline and KIVI: which tokens go
to which bit width, the bytes held, the reassessment of decode blocks, the
kernel path, and clear errors for bad settings."""

import math

import pytest
import torch

from kernels_py import metrics
from kernels_py.methods import make_method
from kernels_py.methods.allocators import important_count
from kernels_py.methods.mixed_precision import MixedPrecisionCache
from kernels_py.methods.prompt import Prompt
from kernels_py.ops import kv_quant
from kernels_py.ops.attention_stats import probe_rows
from kernels_py.workloads import SyntheticConfig, generate

CFG = SyntheticConfig(layers=2, heads=4, kv_heads=2, head_dim=64, tokens_per_image=64, system_tokens=8,
                      text_tokens=16, decode_steps=7, salient_tokens=8, dtype="float32")  # exact arithmetic
PROMPT = 8 + 64 + 16


@pytest.fixture(scope="module")
def workload():
    return generate(CFG)


def run(method, workload, layers=(0, 1)):
    outputs, caches = [], []
    for layer in layers:
        cache = method.prefill(layer, workload.q[layer], workload.k[layer], workload.v[layer], workload.spans)
        for step in range(CFG.decode_steps):
            q_t, k_t, v_t = (t[layer][step] for t in (workload.decode_q, workload.decode_k, workload.decode_v))
            outputs.append(method.decode(layer, cache, q_t, k_t, v_t))
        caches.append(cache)
    return outputs, caches


def mean_error(outputs, workload):
    full, _ = run(make_method("full"), workload)
    return sum(metrics.relative_error(a, b) for a, b in zip(outputs, full)) / len(outputs)


def bits_of(cache: MixedPrecisionCache) -> dict[int, set]:
    """Per bit width, the (kv head, position) pairs it holds."""
    held = {}
    for bits, seg in cache.segments.items():
        held[bits] = {(h, int(p)) for h in range(seg.pos.shape[0]) for p in seg.pos[h] if p != kv_quant.PAD_POS}
    return held


def test_prefill_puts_the_top_normalized_tokens_in_high_bits(workload):
    method = make_method("zipvl", {"tau": 0.9, "probe_recent": 16, "probe_random": 16, "probe_seed": 3})
    cache = method.prefill(0, workload.q[0], workload.k[0], workload.v[0], workload.spans)
    q, k = workload.q[0].float(), workload.k[0].float()
    rows = probe_rows(PROMPT, 16, 16, 3).to(q.device)
    scores = torch.softmax((q[:, rows] @ k.repeat_interleave(2, 0).transpose(1, 2)) / 8.0
                           + torch.where(torch.arange(PROMPT, device=q.device)[None, :] <= rows[:, None], 0.0,
                                         -torch.inf), -1)
    p = important_count(scores.sum(dim=(0, 1)), 0.9)
    assert cache.notes["important_ratio"] == pytest.approx(p / PROMPT)
    counts = (torch.arange(PROMPT, device=q.device)[None, :] <= rows[:, None]).sum(0).clamp_min(1)
    normalized = scores.sum(1).reshape(2, 2, PROMPT).sum(1) / counts
    held = bits_of(cache)
    for h in range(2):
        high = {pos for head, pos in held[4] if head == h}
        assert len(high) == p and len(high ^ set(normalized[h].topk(p).indices.tolist())) <= 2  # float ties
        assert high | {pos for head, pos in held[2] if head == h} == set(range(PROMPT))
    # Bytes: packed codes plus fp16 scales and zeros of whole groups of 32 slots.
    slots = {bits: math.ceil(n / 32) * 32 for bits, n in ((4, p), (2, PROMPT - p))}
    per_head = sum(s * 64 * bits // 8 * 2 + s // 32 * 64 * 2 * 2 + s * 2 * 2 * 2 for bits, s in slots.items())
    assert method.cache_bytes(cache) == 2 * per_head


def test_tau_sets_the_share_of_high_bit_tokens_and_the_error(workload):
    ratios, errors = [], []
    for tau in (0.5, 0.9, 0.999):
        method = make_method("zipvl", {"tau": tau})
        outputs, caches = run(method, workload)
        ratios.append(method.layer_metrics(0, caches[0])["important_ratio"])
        errors.append(mean_error(outputs, workload))
    assert ratios == sorted(ratios) and ratios[0] < ratios[-1]
    assert errors[0] > errors[-1]
    # Uniform 2-bit (KIVI without a window) is worse than ZipVL's mix; 4-bit everywhere is better.
    kivi2 = mean_error(run(make_method("kivi", {"bits": 2, "residual": 0}), workload)[0], workload)
    kivi4 = mean_error(run(make_method("kivi", {"bits": 4, "residual": 0}), workload)[0], workload)
    assert kivi4 < errors[1] < kivi2


def test_decode_blocks_are_reassessed_every_period(workload):
    method = make_method("zipvl", {"period": 3, "tau": 0.8})
    cache = method.prefill(1, workload.q[1], workload.k[1], workload.v[1], workload.spans)
    before = bits_of(cache)
    for step in range(CFG.decode_steps):
        q_t, k_t, v_t = (t[1][step] for t in (workload.decode_q, workload.decode_k, workload.decode_v))
        method.decode(1, cache, q_t, k_t, v_t)
        assert cache.dense_positions.shape[0] == (step + 1) % 3  # blocks of 3 leave the fp16 tail
    after = bits_of(cache)
    new = {(h, p) for held in after.values() for h, p in held} - {(h, p) for held in before.values() for h, p in held}
    assert new == {(h, PROMPT + s) for h in range(2) for s in range(6)}  # two blocks of 3 steps, both heads
    m = method.layer_metrics(1, cache)
    assert 0 < m["block_important_ratio"] <= 1 and m["dense_tokens"] == 1
    assert m["high_bit_tokens"] + m["low_bit_tokens"] == PROMPT + 6  # tokens a kv head holds
    # The cache attention sees, dequantized, holds every token once per kv head in position order.
    assert torch.equal(cache.positions.cpu(), torch.arange(PROMPT + CFG.decode_steps).expand(2, -1))


def test_fixed_ratio_baseline_and_kivi_window(workload):
    method = make_method("zipvl_fixed", {"ratio": 0.25})
    cache = method.prefill(0, workload.q[0], workload.k[0], workload.v[0], workload.spans)
    assert cache.quantized_tokens == {2: PROMPT - 22, 4: 22}  # ceil(0.25 * 88), per kv head
    kivi = make_method("kivi", {"residual": 20, "group": 32})
    cache = kivi.prefill(0, workload.q[0], workload.k[0], workload.v[0], workload.spans)
    assert cache.quantized_tokens == {2: 64} and cache.dense_positions.tolist() == list(range(64, PROMPT))
    for step in range(CFG.decode_steps):
        q_t, k_t, v_t = (t[0][step] for t in (workload.decode_q, workload.decode_k, workload.decode_v))
        kivi.decode(0, cache, q_t, k_t, v_t)
    assert cache.dense_positions.shape[0] == PROMPT - 64 + CFG.decode_steps  # below residual + group: no flush yet
    assert kivi.layer_metrics(0, cache) == {"quantized_tokens": 64.0, "dense_tokens": 31.0}


@pytest.mark.parametrize("name, params", [("zipvl", {"period": 3}), ("kivi", {"residual": 16, "bits": 4})])
def test_kernel_path_matches_the_reference(workload, name, params):
    outs = {}
    for backend in ("triton", "torch"):
        outs[backend], _ = run(make_method(name, {**params, "backend": backend}), workload, layers=(0,))
    for a, b in zip(outs["triton"], outs["torch"]):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-4, rtol=2e-4)


def test_bad_settings_get_clear_errors(workload):
    with pytest.raises(ValueError, match="period"):
        make_method("zipvl", {"period": 0})
    with pytest.raises(ValueError, match="high_bits"):
        make_method("zipvl", {"high_bits": 3})
    with pytest.raises(ValueError, match=r"high_bits \(2\) must be at least low_bits \(4\)"):
        make_method("zipvl", {"high_bits": 2, "low_bits": 4})
    with pytest.raises(ValueError, match="group"):
        make_method("kivi", {"group": 16})
    wide = make_method("zipvl", {"group": 128})
    with pytest.raises(ValueError, match="group=128 does not divide head_dim=64"):
        wide.prefill(0, workload.q[0], workload.k[0], workload.v[0], workload.spans)


def test_sparse_prefill_attends_among_important_tokens_only(workload):
    from kernels_py.methods.sparse_prefill import flops_saved, prefill_error, sparse_prefill

    q, k, v = (t[0].float() for t in (workload.q, workload.k, workload.v))
    important = torch.tensor([[0, 3, 5, 40], [1, 2, 3, 87]], device=q.device)
    out = sparse_prefill(q, k, v, important)
    for head in range(4):
        idx = important[head // 2]
        scores = q[head, idx] @ k[head // 2, idx].T / 8.0
        scores = scores.masked_fill(torch.ones(4, 4, dtype=torch.bool, device=q.device).triu(1), -torch.inf)
        torch.testing.assert_close(out[head, idx], scores.softmax(-1) @ v[head // 2, idx], atol=1e-5, rtol=1e-5)
        others = torch.ones(PROMPT, dtype=torch.bool, device=q.device)
        others[idx] = False
        assert (out[head, others] == 0).all()
    assert flops_saved(88, 88) == 0.0 and flops_saved(88, 44) == pytest.approx(1 - 44 * 45 / (88 * 89))
    # At the important rows the error is what they lose of the keys they see in full (row 3 of kv head 0 sees
    # 0 and 3, not 1 and 2); a causal prefix loses none, so there it is rounding only (0 on a GPU).
    every, at_important, last = prefill_error(q, k, v, important)
    assert 1e-2 < at_important < every and 1e-2 < last < 1  # the last row (87): zeros from kv head 0's heads
    prefix = prefill_error(q, k, v, torch.arange(4, device=q.device).expand(2, -1))
    assert prefix.important < 1e-6 and prefix.last == pytest.approx(1.0)  # row 87 zeroed in every head
    assert prefill_error(q, k, v, torch.arange(PROMPT, device=q.device).expand(2, -1)).last < 1e-6
    with pytest.raises(ValueError, match="strictly ascending"):
        sparse_prefill(q, k, v, important.flip(1))
    method = make_method("zipvl", {"tau": 0.9})
    m = method.layer_metrics(0, method.prefill(0, workload.q[0], workload.k[0], workload.v[0], workload.spans))
    p = round(m["important_ratio"] * PROMPT)
    assert m["sparse_prefill_flops_saved"] == pytest.approx(flops_saved(PROMPT, p))
    assert 0 <= m["sparse_prefill_error_important"] < m["sparse_prefill_error"] < 1
    # Net of the probe rows' attention, which chose the tokens: row r scores r + 1 keys.
    probes = sum(r + 1 for r in probe_rows(PROMPT, 64, 64, 0).tolist())
    assert m["sparse_prefill_flops_saved_net"] == pytest.approx(1 - (p * (p + 1) / 2 + probes) / (PROMPT * (PROMPT + 1) / 2))
    assert m["sparse_prefill_flops_saved_net"] < m["sparse_prefill_flops_saved"]
    top = method.important_tokens(Prompt([workload.q[0]], [workload.k[0]], [workload.v[0]], workload.spans), 0)
    assert (m["sparse_prefill_error_last"] == pytest.approx(1.0)) == bool((top[:, -1] != PROMPT - 1).all())
    # Timing runs the sparse prefill without measuring it.
    quiet = make_method("zipvl", {"tau": 0.9, "sparse_prefill_metrics": False})
    assert "sparse_prefill_error" not in quiet.layer_metrics(
        0, quiet.prefill(0, workload.q[0], workload.k[0], workload.v[0], workload.spans))


def test_float32_prefill_attention_leaves_grouped_heads_to_kernels_that_take_them(workload, monkeypatch):
    """prefill_error's full attention runs in float32, which FlashAttention refuses; SDPA's enable_gqa then
    leaves only the math backend, which builds every head's T x T scores. Its kv heads are repeated instead."""
    import torch.nn.functional as F

    from kernels_py.methods import sparse_prefill as sp

    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append((q.shape[1], k.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(sp.F, "scaled_dot_product_attention", spy)
    q, k, v = (t[0].float() for t in (workload.q, workload.k, workload.v))
    assert q.shape[0] == 2 * k.shape[0]
    out = sp._sdpa(q, k, v)
    assert calls[-1] == (q.shape[0], q.shape[0], False)
    scores = (q @ k.repeat_interleave(2, 0).transpose(1, 2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(PROMPT, PROMPT, dtype=torch.bool, device=q.device).triu(1), -torch.inf)
    torch.testing.assert_close(out, scores.softmax(-1) @ v.repeat_interleave(2, 0), atol=1e-5, rtol=1e-5)


def held_bytes(cache: MixedPrecisionCache) -> int:
    """Bytes of the storages behind what nbytes counts (codes, scales and zeros of each segment; the waiting
    K and V): what the cache really keeps alive, views included."""
    tensors = [getattr(seg, f) for seg in cache.segments.values()
               for f in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors + [cache.dense_k,
                                                                                                  cache.dense_v]}
    return sum(storages.values())


@pytest.mark.parametrize("name", ["zipvl", "zipvl_fixed"])
def test_the_cache_holds_no_more_memory_than_it_reports(workload, name):
    """After prefill the prompt's full-precision K and V are gone (the empty waiting tokens were views of
    them), and a quantized block's waiting tokens go with it."""
    method = make_method(name, {"period": 3})
    k, v = workload.k[0].clone(), workload.v[0].clone()
    cache = method.prefill(0, workload.q[0], k, v, workload.spans)
    assert held_bytes(cache) == method.cache_bytes(cache)
    for step in range(4):  # a block of 3 quantized, one token waiting
        q_t, k_t, v_t = (t[0][step] for t in (workload.decode_q, workload.decode_k, workload.decode_v))
        method.decode(0, cache, q_t, k_t, v_t)
        assert held_bytes(cache) == method.cache_bytes(cache), step
    assert cache.dense_positions.tolist() == [PROMPT + 3]


def test_kivi_holds_no_more_memory_than_it_reports(workload):
    """KIVI's residual tokens after prefill are copies: views of the prompt held all of its K and V."""
    method = make_method("kivi", {"residual": 16, "group": 32})
    k, v = workload.k[0].clone(), workload.v[0].clone()
    cache = method.prefill(0, workload.q[0], k, v, workload.spans)
    assert cache.dense_positions.shape[0] == PROMPT - (PROMPT - 16) // 32 * 32  # 24 residual tokens
    assert held_bytes(cache) == method.cache_bytes(cache)
