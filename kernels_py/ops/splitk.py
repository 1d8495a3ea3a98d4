"""Split-K flash-decoding parts every decode op shares: the base-2 online
softmax of a tile, a split's normalised partial output, and the merge of
the splits of each query row (stage 2, FlashDecoding's reduction).

A stage-1 program keeps a running max m_i (log2 units, starting at a finite
floor), sum l_i and weighted values per query row, and stores its split's
o = acc / l_i and log2-sum-exp m_i + log2(l_i) (-inf for a row that saw no
token). `merge` turns them into the output and the natural-log LSE.

What every decode op built on it asks of its inputs, unchecked: positions
below 2**31 - 1 (int64 ones are narrowed to int32; checking would read them
back on the host), and finite keys and values wherever a tile reads them,
those a query does not see too: a hidden key's score is computed before its
mask (with one query token, an infinite or NaN key makes the row NaN), and a
hidden value is weighted by 0 (0 * NaN is NaN).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _group_queries(Q, QPos, kv_head, b, stride_qb, stride_qh, stride_qm, stride_qd, stride_pb, stride_pm, head_dim,
                   GROUP: tl.constexpr, N_QUERIES: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                   QK_DT: tl.constexpr, row0=0):
    """The query rows of one kv head's program (grouped decode): row r is query
    token r % M of query head kv_head * GROUP + r // M, padded to BLOCK_ROWS;
    a program taking a block of the rows starts at row0. Returns head,
    query, row_mask, each row's position, the channel offsets and mask, and
    q [BLOCK_ROWS, BLOCK_D] in the dot dtype."""
    offs_row = row0 + tl.arange(0, BLOCK_ROWS)
    row_mask = offs_row < GROUP * N_QUERIES
    head = kv_head * GROUP + offs_row // N_QUERIES
    query = offs_row % N_QUERIES
    q_pos = tl.load(QPos + b * stride_pb + query * stride_pm, mask=row_mask, other=-1).to(tl.int32)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q_rows = Q + b * stride_qb + head[:, None] * stride_qh + query[:, None] * stride_qm
    q = tl.load(q_rows + offs_d[None, :] * stride_qd, mask=row_mask[:, None] & d_mask[None, :], other=0.0).to(QK_DT)
    return head, query, row_mask, q_pos, offs_d, d_mask, q


@triton.jit
def _attend_tile(q, k, v, pos, tok_mask, q_pos, row_mask, m_i, l_i, acc, qk_scale, QK_DT: tl.constexpr,
                 q_pos0=0, ONE_QUERY: tl.constexpr = False, K_TRANSPOSED: tl.constexpr = False):
    """One tile of grouped decode: the rows q [ROWS, D] score the tile's keys
    k [N, D] (a token is visible to a row at or after its position), and the
    online softmax takes in the values v [N, D]. Returns m_i, l_i, acc.

    ONE_QUERY: every row is the one query token at position q_pos0 (a
    decode step), so which tokens the rows see is one column mask, added to
    the scaled scores (an FMA a score instead of a compare, a select and a
    multiply); rows past the real ones keep finite scores that
    _store_split never stores. A hidden key's score is added to -inf rather
    than replaced, so keys must be finite (dequantized codes and cached rows
    are). K_TRANSPOSED: k is given as [D, N], the MMA's operand as it is
    (no transpose, which Triton would fold into a shared-memory copy)."""
    if K_TRANSPOSED:
        s = tl.dot(q, k.to(QK_DT), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(QK_DT)), input_precision="ieee")
    if ONE_QUERY:
        s = s * qk_scale + tl.where((pos <= q_pos0) & tok_mask, 0.0, float("-inf"))[None, :]
    else:
        visible = (pos[None, :] <= q_pos[:, None]) & tok_mask[None, :] & row_mask[:, None]
        s = tl.where(visible, s * qk_scale, float("-inf"))
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(QK_DT), v.to(QK_DT), input_precision="ieee")
    return m_i, l_i, acc


@triton.jit
def _online_softmax(s, m_i, l_i, AXIS: tl.constexpr = 1):
    """One tile of the base-2 online softmax: the tile's unnormalised
    probabilities, the factor rescaling what was accumulated, new max and sum.
    The tile's tokens lie along AXIS of s (1: rows x tokens; 0: a transposed
    tile). m_i starts at a finite floor, so a row that sees nothing yet gets
    p = 0 and alpha = 1 instead of inf - inf."""
    m_new = tl.maximum(m_i, tl.max(s, AXIS))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - tl.expand_dims(m_new, AXIS))
    l_new = l_i * alpha + tl.sum(p, AXIS)
    return p, alpha, m_new, l_new


@triton.jit
def _split_partial(acc, m_i, l_i):
    """A split's normalised output and log2-sum-exp (-inf, output 0 when the
    row saw no token in this split)."""
    seen = l_i > 0
    safe_l = tl.where(seen, l_i, 1.0)
    return acc / safe_l[:, None], tl.where(seen, m_i + tl.log2(safe_l), float("-inf"))


@triton.jit
def _store_split(PartO_rows, PartLse_rows, acc, m_i, l_i, offs_d, d_mask, row_mask, stride_od):
    """The split's partial (_split_partial) stored."""
    o, lse2 = _split_partial(acc, m_i, l_i)
    tl.store(PartO_rows + offs_d[None, :] * stride_od, o, mask=row_mask[:, None] & d_mask[None, :])
    tl.store(PartLse_rows, lse2, mask=row_mask)


@triton.jit
def _merge_weights(e_max, e_sum, lse_s):
    """One split's step of the merge: with the running max e_max and sum
    e_sum of 2^lse (log2 units), a split of log2-sum-exp lse_s rescales
    what was merged by old_scale and enters with weight w. Returns
    old_scale, w and the new max and sum."""
    new_max = tl.maximum(e_max, lse_s)
    ref_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # empty so far: no inf - inf
    old_scale = tl.exp2(e_max - ref_max)
    w = tl.exp2(lse_s - ref_max)
    return old_scale, w, new_max, e_sum * old_scale + w


@triton.jit
def _merged_lse(e_max, e_sum):
    """The natural-log LSE of merged splits (-inf when none saw a token)."""
    seen = e_sum > 0
    return tl.where(seen, (e_max + tl.log2(tl.where(seen, e_sum, 1.0))) * 0.6931471805599453, float("-inf"))


@triton.jit
def _merge_kernel(
    PartO, PartLse, Out, Lse,
    stride_ob, stride_oh, stride_om, stride_os, stride_od,
    stride_sb, stride_sh, stride_sm, stride_ss,
    stride_yb, stride_yh, stride_ym, stride_yd,
    stride_lb, stride_lh, stride_lm,
    n_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merge one query row's splits: out = sum_s w_s o_s / sum_s w_s with
    w_s = 2^(lse_s - max); lse = log of the summed softmax denominators."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    query = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    part_o = PartO + b * stride_ob + head * stride_oh + query * stride_om
    part_lse = PartLse + b * stride_sb + head * stride_sh + query * stride_sm

    e_max = float("-inf")
    e_sum = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s in range(0, n_splits):
        lse_s = tl.load(part_lse + s * stride_ss)
        o_s = tl.load(part_o + s * stride_os + offs_d * stride_od, mask=d_mask, other=0.0)
        old_scale, w, e_max, e_sum = _merge_weights(e_max, e_sum, lse_s)
        acc = acc * old_scale + w * o_s
    out = acc / tl.where(e_sum > 0, e_sum, 1.0)
    lse = _merged_lse(e_max, e_sum)
    tl.store(Out + b * stride_yb + head * stride_yh + query * stride_ym + offs_d * stride_yd,
             out.to(Out.dtype.element_ty), mask=d_mask)
    tl.store(Lse + b * stride_lb + head * stride_lh + query * stride_lm, lse)


def merge(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """part_o [B, H, M, splits, D] and part_lse [B, H, M, splits] float32 ->
    out [B, H, M, D] (its own dtype) and lse [B, H, M] float32, in place."""
    batch, heads, queries, splits, head_dim = part_o.shape
    if batch and heads and queries:
        _merge_kernel[(batch, heads, queries)](
            part_o, part_lse, out, lse,
            *part_o.stride(), *part_lse.stride(), *out.stride(), *lse.stride(),
            splits, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim))


MAX_SPLITS = 256
# Splits a selftest forces on one of its cases: the interpreter's default count for a selftest's
# few tokens is one split, which would leave the splits' bounds and the merge untested.
SELFTEST_SPLITS = 3


def split_count(longest: int, programs: int, *, per_split: int, min_split: int, max_splits: int,
                sms: int | None) -> int:
    """Splits per sequence (FlashDecoding's rule): about `per_split` tokens
    each for the longest sequence, at most `max_splits`; on a GPU of `sms`
    SMs, more (down to `min_split` tokens each) while the `programs` a split
    multiplies would not fill two waves of SMs. The launchers and the ops'
    performance models both ask here."""
    splits = -(-longest // per_split)
    if sms:
        splits = max(splits, min(-(-2 * sms // max(programs, 1)), -(-longest // min_split)))
    return max(1, min(splits, max_splits))


def wave_split_count(longest: int, programs: int, *, tile: int, programs_per_sm: int, cost_tiles: float,
                     max_splits: int, interpreter_split: int, sms: int | None) -> int:
    """Splits per sequence on a GPU of `sms` SMs (None, the interpreter:
    about `interpreter_split` tokens each, at most `max_splits`): the count
    whose grid takes the least time by waves. `programs` programs run per
    split (sequences x kv heads), `programs_per_sm` of them at once on an
    SM; a wave takes as
    long as its longest split, in `tile`-token tiles, plus a split's fixed
    cost (its first tile's loads waited at HBM latency, its partial written
    and merged) of `cost_tiles` tiles. Splits hold whole tiles and none is
    empty; a grid's time is a whole number of waves, so a count that spills
    a few programs into another wave is never chosen, and ties keep the
    fewer splits (fewer partials to merge)."""
    if not sms:
        return split_count(longest, programs, per_split=interpreter_split, min_split=tile, max_splits=max_splits,
                           sms=None)
    tiles = max(1, -(-longest // tile))
    slots = programs_per_sm * sms
    best, best_cost = 1, None
    for asked in range(1, min(max_splits, tiles) + 1):
        per_split = -(-tiles // asked)
        splits = -(-tiles // per_split)  # the splits that hold tiles
        cost = -(-max(programs, 1) * splits // slots) * (per_split + cost_tiles)
        if best_cost is None or cost < best_cost:
            best, best_cost = splits, cost
    return best


def tune_buckets(programs: int, slots: int, splits: int) -> tuple[int, int]:
    """Autotuning buckets of a split-K decode launch: the power-of-two class
    of its stage-1 programs and of the slots each split walks (of the cache's
    capacity, which needs no host sync). The best tile and warp count follow
    both, so a launcher passes these as two kernel arguments its kernel never
    reads, named in the autotuner's key: a process that decodes at batch 8
    and then at 64 tunes each, and a decode loop whose context grows retunes
    only when a class changes. Both are at least 16, so Triton specializes
    every bucket alike (a multiple of 16, never 1) and they share one
    compiled kernel per config."""
    return (max(16, triton.next_power_of_2(programs)),
            max(16, triton.next_power_of_2(-(-slots // max(splits, 1)))))


def sm_count(device) -> int | None:
    """SMs of a CUDA device a launch will run on; None on the CPU interpreter."""
    from kernels_py.runtime import interpreter_mode

    if torch.device(device).type != "cuda" or interpreter_mode():
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_ranges(total: int, n_splits: int, block_n: int) -> list[tuple[int, int]]:
    """[lo, hi) of each split of `total` tokens, split sizes rounded up to
    whole tiles as the stage-1 kernels round them (trailing splits may be
    empty)."""
    per_split = -(-(-(-total // n_splits)) // block_n) * block_n
    out = []
    for split in range(n_splits):
        lo = min(split * per_split, total)
        out.append((lo, min(lo + per_split, total)))
    return out


@dataclass(frozen=True)
class Workspace:
    """Each split's partial output [B, Hq, M, splits, D] and log2-sum-exp
    [B, Hq, M, splits], float32: the scratch of a split-K decode call, made
    once (make_workspace) and reused by every step of a decode loop while
    the shapes stay."""

    part_o: torch.Tensor
    part_lse: torch.Tensor

    @property
    def splits(self) -> int:
        return self.part_o.shape[3]


def check_splits(num_splits) -> int:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    return num_splits


def make_workspace(q: torch.Tensor, num_splits: int) -> Workspace:
    """A workspace for calls with queries shaped like q [B, Hq, M, D] and num_splits splits."""
    check_splits(num_splits)
    batch, heads, queries, head_dim = q.shape
    return Workspace(torch.empty((batch, heads, queries, num_splits, head_dim), dtype=torch.float32, device=q.device),
                     torch.empty((batch, heads, queries, num_splits), dtype=torch.float32, device=q.device))


def workspace_for(q: torch.Tensor, workspace: "Workspace | None", num_splits: int | None, default_splits) -> Workspace:
    """The caller's workspace after checking it fits q (and num_splits, if
    given), or a new one with num_splits, else default_splits() splits."""
    if workspace is None:
        return make_workspace(q, default_splits() if num_splits is None else check_splits(num_splits))
    if not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a Workspace (make_workspace), got {type(workspace).__name__}")
    want = (*q.shape[:3], workspace.splits, q.shape[3])
    # The kernels store float32 partials and read them back as float32: another dtype rounds or
    # truncates them (an int32 part_lse gave a wrong LSE), another device fails inside the launch.
    for name, t, shape in (("part_o", workspace.part_o, want), ("part_lse", workspace.part_lse, want[:4])):
        if tuple(t.shape) != shape or t.dtype != torch.float32 or t.device != q.device:
            raise ValueError(f"workspace.{name} is {tuple(t.shape)} {t.dtype} on {t.device}; this call needs "
                             f"{shape} float32 on {q.device}: make_workspace(q, {workspace.splits})")
    if num_splits is not None and num_splits != workspace.splits:
        raise ValueError(f"num_splits={num_splits} but the workspace was made for {workspace.splits} splits")
    return workspace
