"""Metrics on tiny cases worked out by hand."""

import math

import pytest
import torch

from kernels_py import metrics


def test_tensor_bytes_counts_elements_times_width():
    assert metrics.tensor_bytes(torch.zeros(2, 3, 4, dtype=torch.float16)) == 48
    assert metrics.tensor_bytes(torch.zeros(2, 3, 4), torch.zeros(5, dtype=torch.bfloat16)) == 96 + 10
    # A gathered subset costs only what it holds.
    assert metrics.tensor_bytes(torch.zeros(2, 10, 4)[:, [1, 5]].contiguous()) == 64


def test_compression_ratio_is_full_over_compressed():
    assert metrics.compression_ratio(1000, 250) == 4.0
    assert metrics.compression_ratio(1000, 1000) == 1.0
    with pytest.raises(ValueError, match="positive"):
        metrics.compression_ratio(1000, 0)


def test_relative_error_hand_case():
    reference = torch.tensor([3.0, 4.0])  # norm 5
    assert metrics.relative_error(torch.tensor([3.0, 0.0]), reference) == pytest.approx(4 / 5)
    assert metrics.relative_error(reference.half(), reference) == 0.0
    # Frobenius over every head and channel at once.
    assert metrics.relative_error(torch.zeros(2, 1, 2), torch.ones(2, 1, 2)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="shape"):
        metrics.relative_error(torch.zeros(2), torch.zeros(3))


def test_causal_attention_masks_the_future_and_groups_heads():
    # Zero queries: uniform over the keys each row may see.
    q = torch.zeros(2, 3, 4)
    k = torch.randn(1, 3, 4)
    attention = metrics.causal_attention(q, k)
    expected = torch.tensor([[1.0, 0, 0], [1 / 2, 1 / 2, 0], [1 / 3, 1 / 3, 1 / 3]])
    torch.testing.assert_close(attention, expected.expand(2, 3, 3))
    # Rows placed later: a single query at position 3 sees all 4 keys.
    assert metrics.causal_attention(torch.zeros(1, 1, 4), torch.randn(1, 4, 4)).tolist() == [[[0.25] * 4]]
    # GQA: query heads 0, 1 read kv head 0 and heads 2, 3 read kv head 1.
    q = torch.tensor([[[1.0, 0.0]]]).expand(4, 1, 2)
    k = torch.tensor([[[2.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [2.0, 0.0]]])  # [kv_heads=2, keys=2, d=2]
    attention = metrics.causal_attention(q, k, query_start=1)[:, 0]
    first = 1 / (1 + math.exp(-2 / math.sqrt(2)))
    torch.testing.assert_close(attention[:2], torch.tensor([[first, 1 - first]] * 2))
    torch.testing.assert_close(attention[2:], torch.tensor([[1 - first, first]] * 2))


def test_layer_sparsity_vl_cache_eq2_hand_case():
    attention = torch.tensor(
        [
            [1.0, 0.0, 0.0],
            [0.5, 0.5, 0.0],
            [0.995, 0.004, 0.001],  # row max 0.995: 0.004 and 0.001 are below 1% of it
        ]
    )
    # 2 of the 6 causal entries are filtered; the zeros above the diagonal do not count.
    assert metrics.layer_sparsity(attention).item() == pytest.approx(2 / 6)
    # Per leading index (head): a flat head has no filtered entry.
    flat = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    assert metrics.layer_sparsity(torch.stack([attention, flat])).tolist() == pytest.approx([2 / 6, 0.0])
    # One query row at position 2 over 3 keys: 0.005 < 0.01 * 0.9.
    assert metrics.layer_sparsity(torch.tensor([[0.9, 0.005, 0.095]])).item() == pytest.approx(1 / 3)
    # The threshold is a parameter (p in Eq. 1).
    assert metrics.layer_sparsity(attention, threshold=0.002).item() == pytest.approx(1 / 6)


def test_cache_hit_rate_definition_3_1_hand_case():
    decode_attention = torch.tensor([0.1, 0.4, 0.2, 0.3])  # true top-2: tokens 1 and 3
    assert metrics.cache_hit_rate(torch.tensor([1, 2]), decode_attention).item() == 0.5
    assert metrics.cache_hit_rate(torch.tensor([3, 1]), decode_attention).item() == 1.0
    assert metrics.cache_hit_rate(torch.tensor([0, 2]), decode_attention).item() == 0.0
    # Top-3 is {1, 3, 2}; keeping {0, 1, 3} hits two of them.
    assert metrics.cache_hit_rate(torch.tensor([0, 1, 3]), decode_attention).item() == pytest.approx(2 / 3)
    # Batched over heads.
    kept = torch.tensor([[1, 3], [0, 1]])
    assert metrics.cache_hit_rate(kept, decode_attention.expand(2, 4)).tolist() == [1.0, 0.5]


def test_ppci_a_vl_eq2_hand_case():
    reference = torch.arange(10.0, 0.0, -1.0)  # top 50%: tokens 0..4
    assert metrics.ppci(reference, reference, 0.5).item() == 1.0
    assert metrics.ppci(reference, -reference, 0.5).item() == 0.0  # top 50% is tokens 5..9
    shifted = torch.tensor([0.0, 9, 8, 7, 6, 5, 4, 3, 2, 1])  # top 50%: tokens 1..5
    assert metrics.ppci(reference, shifted, 0.5).item() == pytest.approx(4 / 5)
    # p * N is rounded: 30% of 10 is 3 tokens, {0, 1, 2} vs {1, 2, 3}.
    assert metrics.ppci(reference, shifted, 0.3).item() == pytest.approx(2 / 3)


def test_ppci_counts_only_present_tokens_of_the_candidate():
    reference = torch.arange(10.0, 0.0, -1.0)  # top 50%: tokens 0..4
    present = torch.zeros(10, dtype=torch.bool)
    present[[0, 3, 8]] = True
    # T2 = the 3 present tokens; two of them are in T1, and the denominator stays p * N = 5.
    assert metrics.ppci(reference, reference, 0.5, present).item() == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="p must be"):
        metrics.ppci(reference, reference, 0.0)


def test_ppci_over_the_tokens_the_reference_holds():
    """A method's ranking against its own at an earlier step: N is what it
    held then, so a method keeping 3 of 10 tokens in one order scores 1."""
    held = torch.zeros(10, dtype=torch.bool)
    held[[0, 3, 8]] = True
    scores = torch.arange(10.0, 0.0, -1.0).masked_fill(~held, float("-inf"))
    assert metrics.ppci(scores, scores, 0.5, held, held).item() == 1.0  # top round(1.5) = 2 of the 3: {0, 3}
    assert metrics.ppci(scores, scores, 0.5, held).item() == pytest.approx(3 / 5)  # without: capped at 3 of p * 10
    swapped = scores.clone()
    swapped[3], swapped[8] = scores[8], scores[3]  # now {0, 8} lead
    assert metrics.ppci(scores, swapped, 0.5, held, held).item() == 0.5
    evicted = held.clone()
    evicted[0] = False  # token 0 gone: the top 2 of what is left, {3, 8}, share one with {0, 3}
    assert metrics.ppci(scores, scores.masked_fill(~evicted, float("-inf")), 0.5, evicted, held).item() == 0.5
    rows = torch.stack([scores, torch.full((10,), float("-inf"))])  # the second row held nothing: nan
    got = metrics.ppci(rows, rows, 0.5, rows > float("-inf"), rows > float("-inf"))
    assert got[0].item() == 1.0 and got[1].isnan()


def test_degenerate_inputs_give_defined_values():
    zero = torch.zeros(2, 3)
    assert metrics.relative_error(zero, zero) == 0.0  # was 0 / 0
    assert metrics.relative_error(torch.ones(2, 3), zero) == float("inf")
    empty = torch.zeros(1, 0, dtype=torch.int64)
    assert metrics.kept_jaccard([empty], [empty]) == [[1.0]]  # was a ZeroDivisionError

