"""The quantized decode op against attention over the dequantized cache:
one or two segments of any bit width and group, ragged batches, GQA,
several query tokens with causality, split counts; clear errors for bad
inputs."""

import pytest
import torch

from kernels_py.ops import kv_quant
from kernels_py.ops import quant_decode as op
from kernels_py.ops.quant_decode import kernel as qkernel
from kernels_py.ops.quant_decode.cases import make_cache

TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in (torch.float16, torch.bfloat16, torch.float32)]

CASES = {
    # ZipVL: 4-bit important tokens, 2-bit others; ragged (sequence 1 has fewer of each)
    "zipvl_gqa4": dict(heads=8, kv_heads=2, head_dim=64, segments=[(4, 32, 64, [64, 32]), (2, 32, 96, [96, 32])],
                       dense_lens=[5, 0]),
    # KIVI: one 2-bit segment, group 128, GQA 1
    "kivi_mha": dict(heads=2, kv_heads=2, head_dim=128, segments=[(2, 128, 128, [128, 0])], dense_lens=[9, 17]),
    # GQA 7, group 64, three query tokens attending causally in the dense segment
    "gqa7_m3": dict(heads=7, kv_heads=1, head_dim=64, segments=[(4, 64, 64, [64, 64]), (2, 64, 64, [0, 64])],
                    dense_lens=[6, 4], queries=3),
    # Groups of 128 then 32: a 128-slot tile spans four of the second's groups
    "groups_128_32": dict(heads=4, kv_heads=2, head_dim=128, segments=[(4, 128, 128, [128, 128]),
                                                                       (2, 32, 96, [96, 32])], dense_lens=[3, 0]),
    # Groups of 32 then 64: the second segment starts 32 slots into a tile, so tiles stay within a group (tile_cap)
    "groups_32_64": dict(heads=4, kv_heads=2, head_dim=64, segments=[(4, 32, 96, [96, 32]), (2, 64, 128, [128, 64])],
                         dense_lens=[0, 7]),
}


def case(device, dtype, name, seed=0):
    spec = dict(CASES[name])
    return make_cache(batch=2, queries=spec.pop("queries", 1), dtype=dtype, seed=seed, device=device, **spec)


def check(got, want, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(got.out.float(), want.out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.lse, want.lse, atol=tol, rtol=tol)


# The groups_* cases test where tiles start and which key groups they read:
# in float32, where any slip shows (16-bit roundings are the other cases').
MATCH = [pytest.param(name, d.values[0], id=f"{d.id}-{name}") for name in sorted(CASES) for d in DTYPES
         if not name.startswith("groups_") or d.values[0] == torch.float32]


@pytest.mark.parametrize("name,dtype", MATCH)
def test_matches_attention_over_the_dequantized_cache(name, dtype, device):
    """The autotuner's pick on a GPU (None) and every tile it may pick
    (tile_cap lowers them to 32 slots in groups_32_64; 128-slot tiles with
    their keys as the MMA operand from registers or not), one split or
    three (splits that start inside a segment, and segments whose last tile
    is partial)."""
    q, q_pos, segs, dense = case(device, dtype, name)
    want = op.reference.quant_decode(q, q_pos, segs, dense)
    for splits in (1, 3):
        for tile, key_operand in ((None, None), (64, None), (128, True), (128, False)):
            check(op.quant_decode(q, q_pos, segs, dense, num_splits=splits, tile=tile, key_operand=key_operand),
                  want, dtype)


def test_tiles_span_key_groups_only_from_a_group_start():
    """A tile may cover several key groups when every tile of each segment
    starts on a group: not when the second segment's groups are larger than
    the first's (its tiles start at the first's length)."""
    def seg(group):
        return kv_quant.reference.quantize(*(torch.zeros(1, 1, 128, 128) for _ in range(2)),
                                           torch.arange(128)[None], torch.tensor([128]), bits=2, group=group)

    assert qkernel.tile_cap([seg(32)]) == 128
    assert qkernel.tile_cap([seg(128), seg(32)]) == 128
    assert qkernel.tile_cap([seg(64), seg(64)]) == 128
    assert qkernel.tile_cap([seg(32), seg(64)]) == 32
    assert qkernel.tile_cap([seg(64), seg(128)]) == 64
    # Capped, the 128-slot configs compile to their 64-slot twins: the autotuner times one of each.
    configs = qkernel.STAGE1_CONFIGS
    assert qkernel.distinct_configs(configs, 128) == configs
    capped = qkernel.distinct_configs(configs, 32)
    assert capped == [c for c in configs if c.kwargs["TILE"] == 64]
    q, q_pos, segs, dense = case("cpu", torch.float32, "zipvl_gqa4")
    with pytest.raises(ValueError, match=r"tile=96: tile must be one of \[64, 128\]"):
        op.quant_decode(q, q_pos, segs, dense, tile=96)
    # 64.0 == 64, but a float tile reached the kernel as a float constexpr, which failed to compile.
    with pytest.raises(ValueError, match=r"tile=64.0: tile must be one of \[64, 128\] \(an int"):
        op.quant_decode(q, q_pos, segs, dense, tile=64.0)


def test_padding_slots_and_causality(device):
    """A padding slot (PAD_POS) inside a group gets no weight, whatever its
    codes; a quantized token after the query's position is not seen, one at
    it is."""
    q, q_pos, segs, dense = case(device, torch.float32, "zipvl_gqa4")
    before = op.quant_decode(q, q_pos, segs, dense)
    late = segs[0]
    pos = late.pos.clone()
    pos[:, 1] = q_pos.max() + 10  # a token the query may not see yet
    hidden = kv_quant.QuantKV(**{**late.__dict__, "pos": pos})
    after = op.quant_decode(q, q_pos, [hidden, segs[1]], dense)
    check(after, op.reference.quant_decode(q, q_pos, [hidden, segs[1]], dense), torch.float32)
    assert (after.out - before.out).abs().max() > 1e-4  # the hidden token had weight before
    padded = kv_quant.QuantKV(**{**late.__dict__, "pos": torch.where(pos > q_pos.max(), kv_quant.PAD_POS, pos)})
    torch.testing.assert_close(op.quant_decode(q, q_pos, [padded, segs[1]], dense).out, after.out)
    # A token at exactly the query's position is seen (its own key, before it is moved to the cache).
    at = late.pos.clone()
    at[:, 1] = q_pos[:, 0]
    own = kv_quant.QuantKV(**{**late.__dict__, "pos": at})
    seen = op.quant_decode(q, q_pos, [own, segs[1]], dense)
    check(seen, op.reference.quant_decode(q, q_pos, [own, segs[1]], dense), torch.float32)
    assert (seen.out - after.out).abs().max() > 1e-4  # it has weight, where one past the query had none


def test_no_query_tokens_give_an_empty_output(device):
    """M = 0: an empty output, as the reference gives (the kernel read a query
    position that is not there)."""
    q, q_pos, segs, dense = case(device, torch.float32, "zipvl_gqa4")
    none_q, none_pos = q[:, :, :0], q_pos[:, :0]
    got, want = op.quant_decode(none_q, none_pos, segs, dense), op.reference.quant_decode(none_q, none_pos, segs, dense)
    assert got.out.shape == want.out.shape == (2, 8, 0, 64) and got.lse.shape == want.lse.shape == (2, 8, 0)


def test_workspace_is_reused_and_checked(device):
    q, q_pos, segs, dense = case(device, torch.float32, "kivi_mha")
    ws = op.make_workspace(q, 2)
    first = op.quant_decode(q, q_pos, segs, dense, workspace=ws)
    again = op.quant_decode(q, q_pos, segs, dense, workspace=ws, check_values=False)
    torch.testing.assert_close(first.out, again.out, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"this call needs \(2, 2, 2, 2, 128\)"):
        op.quant_decode(torch.cat([q, q], 2), q_pos.repeat(1, 2), segs, dense, workspace=ws)
    with pytest.raises(ValueError, match="num_splits=3 but the workspace was made for 2 splits"):
        op.quant_decode(q, q_pos, segs, dense, workspace=ws, num_splits=3)
    with pytest.raises(ValueError, match="num_splits must be an int in"):
        op.make_workspace(q, 0)


def test_bad_inputs_get_clear_errors(device):
    q, q_pos, segs, dense = case(device, torch.float16, "zipvl_gqa4")
    with pytest.raises(ValueError, match="segments must be a list of 1 to 2 QuantKV"):
        op.quant_decode(q, q_pos, segs * 2, dense)
    with pytest.raises(TypeError, match=r"got one QuantKV: pass \[segment\]"):
        op.quant_decode(q, q_pos, segs[0], dense)
    with pytest.raises(ValueError, match=r"q must be \[batch, heads, queries, head_dim\]"):
        op.quant_decode(q[0], q_pos, segs, dense)
    with pytest.raises(ValueError, match=r"segments\[0\] holds 2 sequences of head_dim 64"):
        op.quant_decode(torch.cat([q, q], -1), q_pos, segs, dense)
    bad = kv_quant.QuantKV(**{**segs[1].__dict__, "v_scale": segs[1].v_scale[..., :1, :]})
    with pytest.raises(ValueError, match=r"segments\[1\].v_scale must have shape"):
        op.quant_decode(q, q_pos, [segs[0], bad], dense)
    with pytest.raises(ValueError, match=r"query heads \(8\) must be a multiple of kv heads \(2\)|dense k"):
        op.quant_decode(q, q_pos, segs, op.DenseKV(dense.k[:, :1], dense.v[:, :1], dense.pos, dense.length))
    with pytest.raises(ValueError, match="query heads per kv head x query tokens = 160 exceeds 128"):
        big = q[:, :1].expand(2, 2 * 80, 2, 64).contiguous()
        op.quant_decode(big, q_pos.repeat(1, 2), segs, dense)


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_a_segment_on_another_device_or_a_dense_tuple_gets_a_clear_error(impl, device):
    # A segment on another device had its lengths read there first (meta:
    # "Tensor.item() cannot be called on meta tensors"); a DenseKV given as a
    # tuple failed with "'tuple' object has no attribute 'k'".
    run = op.quant_decode if impl == "kernel" else op.reference.quant_decode
    q, q_pos, segs, dense = case(device, torch.float16, "zipvl_gqa4")
    with pytest.raises(ValueError, match=rf"segments\[1\] is on meta, q on {q.device}"):
        run(q, q_pos, [segs[0], segs[1].to("meta")], dense)
    with pytest.raises(TypeError, match="dense must be a DenseKV, got tuple"):
        run(q, q_pos, segs, (dense.k, dense.v, dense.pos, dense.length))


def test_roofline_model_counts_the_bytes_of_the_layout():
    """32 q / 8 kv heads, head_dim 128, group 64, 25% of the tokens in 4 bits:
    per kv head 0.25 * 128 + 0.75 * 64 = 80 bytes of codes and 16 of scales and
    zeros, 768 over the kv heads plus a 4-byte position, against 4096 in fp16."""
    from kernels_py.ops.quant_decode import model

    step = model.Step(batch=64, context=32768)
    assert model.per_token_bytes(step) == {"full": 4096, "quantized": 772}
    c = model.costs(step)
    assert c["quantized (4/2-bit)"]["bytes"] == 64 * 32768 * 772 + 64 * 64 * 4096
    us, bound = model.roofline_us(c["quantized (4/2-bit)"])
    assert bound == "memory" and us == pytest.approx(c["quantized (4/2-bit)"]["bytes"] / 3.35e12 * 1e6)
    # The kernel's own layout agrees: a segment's nbytes over its tokens and kv heads.
    q, q_pos, segs, dense = make_cache(batch=1, heads=4, kv_heads=2, head_dim=128, segments=[(4, 64, 64, [64])],
                                       dense_lens=[1], queries=1, dtype=torch.float16)
    per_token_kv_head = segs[0].nbytes / (64 * 2)
    assert per_token_kv_head == model.per_token_bytes(model.Step(1, 1, kv_heads=1, hi_share=1.0))["quantized"] - 4


def test_split_count_fills_whole_waves_on_a_gpu():
    """On a GPU the default split count is the one whose grid (two programs
    an SM, 264 on 132 SMs) takes the fewest waves times the longest split,
    in whole 128-slot tiles with none empty; under the interpreter about
    TOKENS_PER_SPLIT slots a split."""
    from kernels_py.ops import splitk

    # 32,768 quantized + 64 dense slots are 257 tiles. 8 sequences x 8 kv
    # heads: 4 splits of 65 tiles are one wave of 256 programs (5 of 52
    # would spill 56 programs into a second wave); the old rule's 64 splits
    # of 512 slots took 15.5 waves.
    assert qkernel.split_count(32832, 64, 132) == 4
    # 64 x 8 programs: one split is two waves of 258 tiles' work (cost
    # 2 x 258), two splits four waves of 130 (4 x 130).
    assert qkernel.split_count(32832, 512, 132) == 1
    # One program a split: at most DEFAULT_MAX_SPLITS, of whole tiles: 257 tiles in 52 splits of 5.
    assert qkernel.split_count(32832, 1, 132) == 52
    assert qkernel.split_count(0, 64, 132) == 1
    assert qkernel.split_count(32832, 64, None) == 64  # the interpreter: cdiv(32832, 512), capped
    assert qkernel.split_count(1000, 2, None) == 2
    for slots in (100, 1088, 5000, 32832, 120_000):
        for programs in (1, 8, 24, 64, 512):
            n = qkernel.split_count(slots, programs, 132)
            assert 1 <= n <= qkernel.DEFAULT_MAX_SPLITS
            for tile in qkernel.TILES:  # the kernel rounds splits to its own tile: none empty either way
                assert all(lo < hi for lo, hi in splitk.split_ranges(slots, n, tile)), (slots, programs, n, tile)


def test_the_model_takes_the_split_count_a_point_ran_with():
    """A measured point's shape records the split count its launch used (the
    rule may change since); 0 is today's default, split_count's."""
    from kernels_py.ops import estimate
    from kernels_py.ops.quant_decode import model

    def merge_trips(step):
        return model._work(step, "_merge_kernel", {}, estimate.H100).programs[0].values["n_splits"]

    hi, lo = model.segment_slots(model.Step(batch=8, context=32768))
    assert merge_trips(model.Step(batch=8, context=32768)) == qkernel.split_count(hi + lo + 64, 64, 132) == 4
    assert merge_trips(model.Step(batch=8, context=32768, splits=64)) == 64
    with pytest.raises(ValueError, match="splits=300"):
        model.Step(batch=8, context=32768, splits=300)


def test_the_autotuner_keys_on_the_grid_and_the_splits_length(monkeypatch):
    """A process that decodes at batch 8 and then at 64 tunes each (the
    config of one was reused for the other): the launch keys on the classes
    of its programs and of the slots a split walks (splitk.tune_buckets),
    never on the lengths themselves, which change every step."""
    from kernels_py.ops import splitk
    from kernels_py.tests.autotune_spy import spy_on

    spy = spy_on(monkeypatch, qkernel)
    q, q_pos, segs, dense = case("cpu", torch.float16, "zipvl_gqa4")
    capacity = sum(seg.slots for seg in segs) + dense.k.shape[2]
    for splits in (1, 1, 16):
        op.quant_decode(q, q_pos, segs, dense, num_splits=splits)
    one, again, many = spy.keys
    assert one == again
    assert (one["tune_programs"], one["tune_span"]) == splitk.tune_buckets(2 * 2, capacity, 1) == (16, 256)
    assert (many["tune_programs"], many["tune_span"]) == (64, 16)
    assert {k: v for k, v in one.items() if not k.startswith("tune_")} == \
        {k: v for k, v in many.items() if not k.startswith("tune_")}
