"""The selected-row decode op against attention over the gathered rows:
GQA 1/4/7, ragged and per-head index lists, unsorted and empty lists,
several query tokens with causality; duplicates and out-of-range rows get
clear errors."""

import pytest
import torch

from kernels_py.ops import gather_decode as op
from kernels_py.ops.gather_decode.cases import make_case

TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in (torch.float16, torch.bfloat16, torch.float32)]
CASES = {
    "mha": dict(heads=2, kv_heads=2, head_dim=64, slots=80, counts=[[30, 7], [0, 50]]),
    "gqa4_m3": dict(heads=8, kv_heads=2, head_dim=128, slots=64, counts=[[20, 33], [64, 1]], queries=3),
    "gqa7": dict(heads=7, kv_heads=1, head_dim=80, slots=100, counts=[[45], [12]]),
}


def case(device, dtype, name, **extra):
    return [t.to(device) for t in make_case(batch=2, dtype=dtype, **{**CASES[name], **extra})]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_attention_over_the_gathered_rows(name, dtype, device):
    args = case(device, dtype, name)
    want = op.reference.gather_decode(*args)
    for splits in (1, 3):
        got = op.gather_decode(*args, num_splits=splits, block_n=16)
        tol = TOL[dtype]
        torch.testing.assert_close(got.out.float(), want.out.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(got.lse, want.lse, atol=tol, rtol=tol)


def _token_major(t):
    """The same values as t [B, H, S, D], laid out [B, S, H, D] (a view):
    each stride but the channels' differs from a contiguous tensor's."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("layout", ["k_token_major", "v_token_major"])
def test_k_and_v_are_read_with_their_own_strides(layout, device):
    # K and V in different layouts, so a kernel that reads one with the
    # other's strides (or assumes a contiguous cache) reads the wrong rows.
    q, q_pos, k, v, pos, index, count = case(device, torch.float32, "gqa4_m3")
    want = op.reference.gather_decode(q, q_pos, k, v, pos, index, count)
    if layout == "k_token_major":
        k = _token_major(k)
    else:
        v = _token_major(v)
    assert k.stride() != v.stride()
    for splits in (1, 3):
        got = op.gather_decode(q, q_pos, k, v, pos, index, count, num_splits=splits, block_n=16)
        torch.testing.assert_close(got.out, want.out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.lse, want.lse, atol=1e-5, rtol=1e-5)


def test_order_does_not_matter_and_empty_lists_see_nothing(device):
    q, q_pos, k, v, pos, index, count = case(device, torch.float32, "mha")
    shuffled = index.clone()
    shuffled[0, 0, :30] = index[0, 0, :30].flip(0)
    a = op.gather_decode(q, q_pos, k, v, pos, index, count)
    b = op.gather_decode(q, q_pos, k, v, pos, shuffled, count)
    torch.testing.assert_close(a.out, b.out, atol=1e-6, rtol=1e-6)
    # Sequence 1's kv head 0 has an empty list: output 0, LSE -inf.
    assert (a.out[1, 0] == 0).all() and torch.isinf(a.lse[1, 0]).all()
    # The rows not listed do not matter: change them and nothing moves.
    listed = torch.zeros(2, 2, 80, dtype=torch.bool)
    for b_ in range(2):
        for h in range(2):
            listed[b_, h, index[b_, h, :count[b_, h]].long().cpu()] = True
    k2 = torch.where(listed.to(device)[..., None], k, k + 5.0)
    torch.testing.assert_close(op.gather_decode(q, q_pos, k2, v, pos, index, count).out, a.out)
    # Not even NaN there, in the kernel or the reference (whose unused entries point at row 0).
    v_nan = torch.where(listed.to(device)[..., None], v, float("nan"))
    for impl in (op.gather_decode, op.reference.gather_decode):
        torch.testing.assert_close(impl(q, q_pos, k, v_nan, pos, index, count).out, a.out, atol=1e-6, rtol=1e-6)


def test_bad_index_lists_get_clear_errors(device):
    q, q_pos, k, v, pos, index, count = case(device, torch.float16, "mha")
    dup = index.clone()
    dup[0, 0, 1] = dup[0, 0, 0]
    with pytest.raises(ValueError, match="holds a row twice"):
        op.gather_decode(q, q_pos, k, v, pos, dup, count)
    far = index.clone()
    far[0, 1, 0] = 80
    with pytest.raises(ValueError, match=r"must lie in \[0, 80\)"):
        op.gather_decode(q, q_pos, k, v, pos, far, count)
    with pytest.raises(ValueError, match="count must lie in"):
        op.gather_decode(q, q_pos, k, v, pos, index, count + 60)
    with pytest.raises(ValueError, match=r"index must be \[batch=2, kv_heads=2, entries\]"):
        op.gather_decode(q, q_pos, k, v, pos, index[:, :1], count)
    with pytest.raises(TypeError, match="index must be int32 or int64"):
        op.gather_decode(q, q_pos, k, v, pos, index.float(), count)
    # A duplicate past count is outside the list: allowed.
    tail = index.clone()
    tail[0, 1, 7:] = index[0, 1, 0]
    op.gather_decode(q, q_pos, k, v, pos, tail, count)


def test_workspace_is_reused_and_checked(device):
    args = case(device, torch.float32, "gqa7")
    ws = op.make_workspace(args[0], 2)
    first = op.gather_decode(*args, workspace=ws)
    torch.testing.assert_close(op.gather_decode(*args, workspace=ws, check_values=False).out, first.out, atol=0,
                               rtol=0)
    with pytest.raises(ValueError, match="num_splits=4 but the workspace was made for 2 splits"):
        op.gather_decode(*args, workspace=ws, num_splits=4)


@pytest.mark.parametrize("field,bad,match", [
    ("part_lse", lambda t: t.to(torch.int32), r"workspace.part_lse is \(2, 7, 1, 2\) torch.int32 on cpu; this call "
                                              r"needs \(2, 7, 1, 2\) float32"),
    ("part_o", lambda t: t.to(torch.float16), r"workspace.part_o is .* torch.float16 .* float32"),
    ("part_lse", lambda t: t.to("meta"), r"workspace.part_lse is .* on meta; this call needs .* on cpu"),
], ids=["int32-lse", "float16-o", "lse-on-meta"])
def test_a_workspace_of_another_dtype_or_device_is_refused(field, bad, match, device):
    # An int32 part_lse truncated each split's LSE (a wrong lse, silently); a
    # part_lse on another device failed inside the launch.
    args = case(device, torch.float32, "gqa7")
    ws = op.make_workspace(args[0], 2)
    ws = op.Workspace(**{**ws.__dict__, field: bad(getattr(ws, field))})
    with pytest.raises(ValueError, match=match.replace("cpu", str(args[0].device))):
        op.gather_decode(*args, workspace=ws)


def test_an_empty_index_tensor_with_a_count_is_rejected(device):
    """count above the entries an index holds is an error even when it holds none."""
    q, q_pos, k, v, pos, index, count = case(device, torch.float32, "mha")
    with pytest.raises(ValueError, match=r"count must lie in \[0, 0\]"):
        op.gather_decode(q, q_pos, k, v, pos, index[..., :0], torch.ones_like(count))
    empty = op.gather_decode(q, q_pos, k, v, pos, index[..., :0], torch.zeros_like(count))
    assert (empty.out == 0).all() and torch.isinf(empty.lse).all()


def test_positions_outside_int32_are_refused(device):
    # The kernel narrows positions to int32: a query at 2**31 + 5 wrapped to a
    # negative position and saw nothing, where the reference saw every row.
    q, q_pos, k, v, pos, index, count = case(device, torch.float32, "mha")
    far = q_pos.long() + 2**31
    for impl in (op.gather_decode, op.reference.gather_decode):
        with pytest.raises(ValueError, match=r"q_pos holds positions outside int32, in \[2147483727, 2147483727\]"):
            impl(q, far, k, v, pos, index, count)
    listed = pos.long().clone()
    listed[0, index[0, 0, 0]] = -2**31 - 1
    for impl in (op.gather_decode, op.reference.gather_decode):
        with pytest.raises(ValueError, match=r"pos \(of the listed rows\) holds positions outside int32"):
            impl(q, q_pos, k, v, listed, index, count)
    # A row no list names may hold any position (it is never read); the extremes of int32 fit.
    unlisted = pos.long().clone()
    unlisted[1, :] = 2**40
    unlisted[1, index[1, 1, :50].long()] = torch.arange(50, device=device) - 2**31
    edge = q_pos.long().clone()
    edge[1] = 2**31 - 1
    got = op.gather_decode(q, edge, k, v, unlisted, index, count, block_n=16)
    want = op.reference.gather_decode(q, edge, k, v, unlisted, index, count)
    torch.testing.assert_close(got.out, want.out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.lse, want.lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("empty", ["queries", "slots"])
def test_no_query_tokens_or_no_slots_agree_with_the_reference(empty, device):
    # M = 0 launched stage 1 with N_QUERIES=0 (a division by zero in the
    # kernel); S = 0 made the reference gather from an empty cache (IndexError).
    import warnings

    q, q_pos, k, v, pos, index, count = case(device, torch.float32, "mha")
    if empty == "queries":
        q, q_pos = q[:, :, :0], q_pos[:, :0]
    else:
        k, v, pos, count = k[:, :, :0], v[:, :, :0], pos[:, :0], torch.zeros_like(count)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the interpreter's division by zero
        got = op.gather_decode(q, q_pos, k, v, pos, index, count)
    want = op.reference.gather_decode(q, q_pos, k, v, pos, index, count)
    torch.testing.assert_close(got.out, want.out)
    torch.testing.assert_close(got.lse, want.lse)
    assert got.out.shape == q.shape and (got.out == 0).all() and torch.isinf(got.lse).all()


def test_no_channels_and_non_tensors_get_clear_errors(device):
    q, q_pos, k, v, pos, index, count = case(device, torch.float32, "mha")
    for impl in (op.gather_decode, op.reference.gather_decode):
        # head_dim 0 failed in the softmax scale (ZeroDivisionError), a list in q.dim() (AttributeError).
        with pytest.raises(ValueError, match=r"head_dim must be at least 1, got q of shape \(2, 2, 1, 0\)"):
            impl(q[..., :0], q_pos, k[..., :0], v[..., :0], pos, index, count)
        with pytest.raises(TypeError, match="count must be a torch.Tensor, got list"):
            impl(q, q_pos, k, v, pos, index, count.tolist())


def test_heads_wider_than_256_are_refused_by_the_kernel(device):
    # A 16-bit head of 512 channels needs 284672 bytes of shared memory on
    # sm_90 (compiled): the launch failed on a GPU with Triton's
    # out-of-resources error. The reference takes any.
    args = case(device, torch.float16, "mha", head_dim=320)
    with pytest.raises(ValueError, match="head_dim 320 is wider than the kernel's widest head, 256"):
        op.gather_decode(*args)
    assert op.reference.gather_decode(*args).out.shape == (2, 2, 1, 320)
