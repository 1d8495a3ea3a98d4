"""Split-K flash-decoding over an FP8 KV cache: the codes are read as they
are stored (one byte per element, half the fp16 cache's bytes) and become
the dot dtype in registers, tile by tile; no dequantized copy is written.
What is computed: contract.py.

Stage 1, `_stage1_kernel`: one program per (kv head, sequence, split) owns
every query row of its kv group (GROUP query heads x M query tokens, padded
to a power of two >= 16 for tl.dot; SGLang's grouped decode), so a tile's
codes are read and converted once for the whole group. Per element the
kernel does only the conversion: on sm_89 and later (and under the
interpreter) Triton's fp8 -> fp16 cast, which sm_90 issues as one cvt per
two elements; on sm_80, which has no e4m3 conversion, the e4m3 bits are
moved into an fp16's (sign, then exponent and mantissa shifted by 7: the
value / 256, folded into the scales) and e5m2 is the top byte of an fp16.
The scales never touch a K or V element: a per-head (or per-tensor) key
scale folds into the softmax scale and the value scale into the split's
output; per-token scales multiply the score columns (keys) and the
probability columns before the PV dot (values: times the format's largest
code, so a probability meets its token's largest value rather than a tiny
scale and keeps its 16-bit precision; the output divides it back out). Stage 2 merges the splits
(ops.splitk).

Reference: reference.py beside this file.
"""

import torch
import triton
import triton.language as tl

from kernels_py.ops import common, splitk
from kernels_py.ops.fp8_decode import codec
from kernels_py.ops.fp8_decode.contract import Fp8DecodeOutput, check_inputs, per_token
from kernels_py.ops.splitk import _group_queries, _online_softmax, _store_split

MAX_ROWS = 128  # query heads per kv head x query tokens, one program's rows
TOKENS_PER_SPLIT = 512
DEFAULT_MAX_SPLITS = 64
DEFAULT_BLOCK_N, DEFAULT_WARPS, DEFAULT_STAGES = 64, 4, 3
NATIVE_E4M3 = 89  # the first compute capability with e4m3 conversions (Ada; Hopper is 90)
E4M3_BITS_UNIT = 256.0  # e4m3 bits moved into an fp16 read as value / 2^(15 - 7)
CONVERSIONS = ("native", "bits")


@triton.jit
def _fp8_to_f16(codes, IS_E4M3: tl.constexpr, NATIVE: tl.constexpr):
    """uint8 fp8 codes -> fp16: the codes' values (NATIVE, or e5m2), or for
    e4m3 by bits their values / E4M3_BITS_UNIT."""
    if NATIVE:
        if IS_E4M3:
            return codes.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        else:
            return codes.to(tl.float8e5, bitcast=True).to(tl.float16)
    else:
        wide = codes.to(tl.uint16)
        if IS_E4M3:
            bits = ((wide & 0x80) << 8) | ((wide & 0x7F) << 7)
        else:
            bits = wide << 8
        return bits.to(tl.float16, bitcast=True)


@triton.jit
def _stage1_kernel(
    Q, QPos, K, V, KS, VS, Pos, PartO, PartLse,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_pb, stride_pm,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vsb, stride_vsh, stride_vsn,
    stride_rb, stride_rn,
    stride_ob, stride_oh, stride_om, stride_os, stride_od,
    stride_sb, stride_sh, stride_sm, stride_ss,
    qk_scale, v_prescale, v_unit, slots, tune_programs, tune_span,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, N_QUERIES: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr, QK_DT: tl.constexpr, BLOCK_N: tl.constexpr, PER_TOKEN: tl.constexpr,
    IS_E4M3: tl.constexpr, NATIVE: tl.constexpr, EVEN_N: tl.constexpr,
):
    kv_head = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    n_splits = tl.num_programs(2)

    head, query, row_mask, q_pos, offs_d, d_mask, q = _group_queries(
        Q, QPos, kv_head, b, stride_qb, stride_qh, stride_qm, stride_qd, stride_pb, stride_pm, HEAD_DIM,
        GROUP, N_QUERIES, BLOCK_ROWS, BLOCK_D, QK_DT)

    per_split = tl.cdiv(tl.cdiv(slots, n_splits), BLOCK_N) * BLOCK_N
    lo = tl.minimum(split * per_split, slots)
    hi = tl.minimum(lo + per_split, slots)

    K_h = K + b * stride_kb + kv_head * stride_kh
    V_h = V + b * stride_vb + kv_head * stride_vh
    KS_h = KS + b * stride_ksb + kv_head * stride_ksh
    VS_h = VS + b * stride_vsb + kv_head * stride_vsh
    Pos_b = Pos + b * stride_rb
    score_scale = qk_scale
    if not PER_TOKEN:
        score_scale = qk_scale * tl.load(KS_h)  # one key scale for the kv head: fold it into the softmax's

    m_i = tl.full([BLOCK_ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    acc = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        tok_mask = offs_n < hi
        k_ptrs = K_h + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = V_h + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
        if EVEN_N and HEAD_DIM == BLOCK_D:  # whole tiles: no masks to compute for the copies
            pos = tl.load(Pos_b + offs_n * stride_rn).to(tl.int32)
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            pos = tl.load(Pos_b + offs_n * stride_rn, mask=tok_mask, other=0).to(tl.int32)
            kv_mask = tok_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptrs, mask=kv_mask, other=0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0)
        k = _fp8_to_f16(k, IS_E4M3, NATIVE).to(QK_DT)
        v = _fp8_to_f16(v, IS_E4M3, NATIVE).to(QK_DT)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        if PER_TOKEN:
            k_scale = tl.load(KS_h + offs_n * stride_ksn, mask=tok_mask, other=0.0)  # masked: 0 keeps scores finite
            s = s * (k_scale * qk_scale)[None, :]  # a score column per token: D times fewer products than keys
        else:
            s = s * score_scale
        visible = (pos[None, :] <= q_pos[:, None]) & tok_mask[None, :] & row_mask[:, None]
        p, alpha, m_i, l_i = _online_softmax(tl.where(visible, s, float("-inf")), m_i, l_i)
        if PER_TOKEN:
            # p times the token's largest value (scale x the format's largest code): in [0, amax], where a
            # 16-bit probability keeps its precision; v_unit takes the format's largest code back out.
            v_scale = tl.load(VS_h + offs_n * stride_vsn, mask=tok_mask, other=0.0) * v_prescale
            acc = acc * alpha[:, None] + tl.dot((p * v_scale[None, :]).to(QK_DT), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(QK_DT), v, input_precision="ieee")
    if not PER_TOKEN:
        acc = acc * tl.load(VS_h)
    acc = acc * v_unit

    part_rows = b * stride_ob + head[:, None] * stride_oh + query[:, None] * stride_om + split * stride_os
    lse_rows = b * stride_sb + head * stride_sh + query * stride_sm + split * stride_ss
    _store_split(PartO + part_rows, PartLse + lse_rows, acc, m_i, l_i, offs_d, d_mask, row_mask, stride_od)


# The configs the autotuner times (those that spill at the shape being tuned
# are pruned first): 64- or 128-token tiles, 4 or 8 warps, 2 or 3 stages of
# cp.async prefetch (the codes need no work before they land in shared
# memory). Keyed on the specialization and on the classes of the grid and
# of a split's slots (splitk.tune_buckets), never the length itself. Under
# the interpreter the launcher runs the default config.
STAGE1_CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st)
                  for n in (64, 128) for w in (4, 8) for st in (2, 3)]
# No QK_DT in the key: it follows from q's dtype, which the autotuner adds to
# every key itself, and a tl.dtype cannot be written to its disk cache.
_stage1_tuned = triton.autotune(
    configs=STAGE1_CONFIGS, cache_results=True,
    key=["tune_programs", "tune_span", "HEAD_DIM", "GROUP", "N_QUERIES", "BLOCK_ROWS", "BLOCK_D", "PER_TOKEN",
         "IS_E4M3", "NATIVE", "EVEN_N"],
    prune_configs_by={"early_config_prune": common.prune_spilling(_stage1_kernel)})(_stage1_kernel)
LARGEST_TILE = max(c.kwargs["BLOCK_N"] for c in STAGE1_CONFIGS)  # a length it divides is whole tiles in every config


def split_count(longest: int, programs_per_split: int, sms: int | None) -> int:
    """The default split count for `longest` slots, with `programs_per_split`
    programs per split (kv heads x sequences) on `sms` SMs (None: the
    interpreter)."""
    return splitk.split_count(longest, programs_per_split, per_split=TOKENS_PER_SPLIT, min_split=128,
                              max_splits=DEFAULT_MAX_SPLITS, sms=sms)


def default_num_splits(k: torch.Tensor) -> int:
    """Splits per (sequence, kv head) for the codes k [B, H_kv, S, D]: about
    TOKENS_PER_SPLIT slots each, at most DEFAULT_MAX_SPLITS; on a GPU more
    (down to 128 slots each) while the grid would not fill two waves of SMs.
    No host sync (the lengths are the shape's)."""
    return split_count(k.shape[2], k.shape[0] * k.shape[1], splitk.sm_count(k.device))


def default_conversion(code_dtype: torch.dtype, device) -> str:
    """How the kernel turns codes into fp16 on `device`: "native" (Triton's
    fp8 cast) where the target converts e4m3 (sm_89+) and for e5m2 on any
    GPU; "bits" for e4m3 on sm_80 (common.capability), and for e5m2 under
    the interpreter, whose cast flushes e5m2 subnormals to zero."""
    cc = common.capability(device)
    if code_dtype == torch.float8_e4m3fn and cc is not None and cc < NATIVE_E4M3:
        return "bits"
    if code_dtype == torch.float8_e5m2 and cc is None:  # the interpreter's e5m2 cast flushes subnormals
        return "bits"
    return "native"


def fp8_decode(q, q_pos, k, v, k_scale, v_scale, pos, *, sm_scale: float | None = None,
               num_splits: int | None = None, workspace: splitk.Workspace | None = None,
               conversion: str | None = None, block_n: int | None = None) -> Fp8DecodeOutput:
    """One decode step over the FP8 cache (k, v [B, H_kv, S, D] codes, any
    strides; k_scale, v_scale [B, H_kv, S] or [B, H_kv] float32; contract.py).

    q: [B, Hq, M, D] fp16/bf16/fp32; q_pos [B, M] and pos [B, S] int (causal
    visibility by position). sm_scale: default D ** -0.5. num_splits: splits
    per (sequence, kv head), default default_num_splits. workspace:
    make_workspace's scratch, reused across calls (its split count is used).
    conversion: "native" or "bits" (default_conversion: what the target
    supports; both run under the interpreter). block_n: the token tile
    (power of two >= 16); given, it runs that tile untuned.
    Returns Fp8DecodeOutput(out [B, Hq, M, D] q.dtype, lse [B, Hq, M] float32).
    """
    check_inputs(q, q_pos, k, v, k_scale, v_scale, pos)
    common.check_launchable(q)
    batch, heads, queries, head_dim = q.shape
    kv_heads, slots = k.shape[1], k.shape[2]
    group = heads // kv_heads
    if group * queries > MAX_ROWS:
        raise ValueError(f"query heads per kv head x query tokens = {group * queries} exceeds {MAX_ROWS}, the rows "
                         f"one program holds")
    conversion = default_conversion(k.dtype, q.device) if conversion is None else conversion
    if conversion not in CONVERSIONS:
        raise ValueError(f"conversion must be one of {CONVERSIONS}, got {conversion!r}")
    if block_n is not None:
        common.check_block("block_n", block_n)
    scale = common.softmax_scale(sm_scale, head_dim, "sm_scale")
    is_e4m3 = k.dtype == torch.float8_e4m3fn
    unit = E4M3_BITS_UNIT if is_e4m3 and conversion == "bits" else 1.0
    prescale = codec.format_max(k.dtype) if per_token(k_scale) else 1.0
    dev = q.device
    out = torch.empty((batch, heads, queries, head_dim), dtype=q.dtype, device=dev)
    lse = torch.empty((batch, heads, queries), dtype=torch.float32, device=dev)
    if batch == 0 or heads == 0 or queries == 0:  # nothing to compute (and N_QUERIES=0 would divide by 0)
        return Fp8DecodeOutput(out, lse)
    workspace = splitk.workspace_for(q, workspace, num_splits, lambda: default_num_splits(k))
    tokenwise = per_token(k_scale)
    ks_strides = k_scale.stride() if tokenwise else (*k_scale.stride(), 0)
    vs_strides = v_scale.stride() if tokenwise else (*v_scale.stride(), 0)
    # Codes go in as bytes: the kernel reinterprets them (sm_80 has no e4m3 pointer type to take).
    args = [q, q_pos, k.view(torch.uint8), v.view(torch.uint8), k_scale, v_scale, pos,
            workspace.part_o, workspace.part_lse,
            *q.stride(), *q_pos.stride(), *k.stride(), *v.stride(), *ks_strides, *vs_strides, *pos.stride(),
            *workspace.part_o.stride(), *workspace.part_lse.stride(),
            scale * common.LOG2E * unit, prescale, unit / prescale, slots,
            *splitk.tune_buckets(batch * kv_heads * workspace.splits, slots, workspace.splits)]
    meta = dict(HEAD_DIM=head_dim, GROUP=group, N_QUERIES=queries, BLOCK_ROWS=common.block(group * queries),
                BLOCK_D=common.block(head_dim), QK_DT=common.dot_dtype(q.dtype),
                PER_TOKEN=tokenwise, IS_E4M3=is_e4m3, NATIVE=conversion == "native")
    grid = (kv_heads, batch, workspace.splits)
    if block_n is not None or common.interpreter_mode():
        block_n = block_n or DEFAULT_BLOCK_N
        _stage1_kernel[grid](*args, **meta, BLOCK_N=block_n, EVEN_N=slots % block_n == 0, num_warps=DEFAULT_WARPS,
                             num_stages=DEFAULT_STAGES)
    else:
        _stage1_tuned[grid](*args, **meta, EVEN_N=slots % LARGEST_TILE == 0)
    splitk.merge(workspace.part_o, workspace.part_lse, out, lse)
    return Fp8DecodeOutput(out, lse)
