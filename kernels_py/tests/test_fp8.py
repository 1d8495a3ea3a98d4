"""FP8 KV cache: the codes and scales against torch's own float8 casts, the
sm_80 bit conversion against torch for every code, the decode op against
its reference under the interpreter (both conversions, every scale
granularity, both formats), the method's exact bytes, and FP8 composed with
token selection as one setting."""

import pytest
import torch
import triton
import triton.language as tl

from kernels_py import ablation
from kernels_py.methods import make_method
from kernels_py.methods.float8 import Float8Tokens
from kernels_py.ops import fp8_decode as op
from kernels_py.ops.fp8_decode import codec, kernel
from kernels_py.ops.fp8_decode.cases import make_case
from kernels_py.ops.fp8_decode.kernel import _fp8_to_f16
from kernels_py.workloads import SyntheticConfig, generate

FORMATS = sorted(codec.FORMATS)
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


# ----------------------------------------------------------------------------
# Codes and scales
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("granularity", codec.GRANULARITIES)
def test_round_trip_is_torchs_float8_cast_with_the_scale(fmt, granularity):
    code = codec.FORMATS[fmt]
    x = torch.randn(2, 3, 40, 16) * torch.exp(torch.randn(2, 3, 40, 1))
    codes, scale = codec.quantize(x, granularity, fmt)
    assert codes.dtype == code and scale.dtype == torch.float32
    want_shape = {"tensor": (2, 1, 1), "head": (2, 3, 1), "token": (2, 3, 40)}[granularity]
    assert tuple(scale.shape) == want_shape
    torch.testing.assert_close(codes.float(), (x / scale[..., None]).to(code).float(), atol=0, rtol=0)
    # the largest magnitude each scale covers lands on the format's largest code
    dims = {"tensor": (-2, -1), "head": (-1,), "token": ()}[granularity]
    got, want = codec.decode(codes, scale).abs().amax(-1), x.abs().amax(-1)
    if dims:
        got, want = got.amax(dims), want.amax(dims)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    err = (codec.decode(codes, scale) - x).abs() / x.abs().amax()
    assert err.max() < {"e4m3": 0.07, "e5m2": 0.13}[fmt]  # 3 and 2 mantissa bits: half an ulp at the top


@pytest.mark.parametrize("fmt", FORMATS)
def test_values_beyond_a_fixed_scale_saturate_instead_of_nan(fmt):
    code = codec.FORMATS[fmt]
    scale = torch.ones(1, 1)
    codes = codec.encode(torch.tensor([[[1e6, -1e6, 3.0]]]), scale, code)
    assert not codes.float().isnan().any()
    assert codes.float()[0, 0, :2].tolist() == [codec.format_max(code), -codec.format_max(code)]
    # What the codec saves them from: a plain cast gives NaN in e4m3 (no infinity) and infinity in e5m2.
    plain = torch.tensor([1e6]).to(code).float()
    assert (plain.isinf() if fmt == "e5m2" else plain.isnan()).all()


@triton.jit
def _convert_kernel(X, Y, IS_E4M3: tl.constexpr, NATIVE: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(Y + offs, _fp8_to_f16(tl.load(X + offs), IS_E4M3, NATIVE))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("native", [True, False], ids=["native", "bits"])
def test_every_code_converts_as_torch_casts_it(fmt, native, device):
    """The kernel's conversion of all 256 codes (NaNs aside) against torch's
    cast; the bit path (sm_80's e4m3) gives value / 256, folded into the scales."""
    code = codec.FORMATS[fmt]
    x = torch.arange(256, dtype=torch.uint8, device=device)
    y = torch.empty(256, dtype=torch.float16, device=device)
    _convert_kernel[(1,)](x, y, IS_E4M3=fmt == "e4m3", NATIVE=native)
    want = x.view(code).float()
    unit = 256.0 if fmt == "e4m3" and not native else 1.0
    finite = want.isfinite()
    if native and fmt == "e5m2" and device.type == "cpu":  # the interpreter flushes e5m2 subnormals to zero
        finite &= (x & 0x7C) != 0
    torch.testing.assert_close(y.float()[finite] * unit, want[finite], atol=0, rtol=0)


# ----------------------------------------------------------------------------
# The decode op
# ----------------------------------------------------------------------------

SHAPES = {
    "gqa4": dict(heads=8, kv_heads=2, head_dim=64, slots=160),
    "gqa4_m2_whole_tiles": dict(heads=8, kv_heads=2, head_dim=64, slots=128, queries=2),
    "mha_d80": dict(heads=2, kv_heads=2, head_dim=80, slots=70),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("granularity", codec.GRANULARITIES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_matches_reference(shape, granularity, fmt, device):
    args = [t.to(device) for t in make_case(batch=2, granularity=granularity, fmt=fmt, **SHAPES[shape])]
    want = op.reference.fp8_decode(*args)
    for conversion, splits, block_n in (("native", 1, None), ("bits", 3, 32), ("native", 2, 64)):
        got = op.fp8_decode(*args, conversion=conversion, num_splits=splits, block_n=block_n)
        torch.testing.assert_close(got.out.float(), want.out.float(), atol=TOL[torch.float16], rtol=TOL[torch.float16])
        torch.testing.assert_close(got.lse, want.lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_other_query_dtypes(dtype, device):
    args = [t.to(device) for t in make_case(batch=1, dtype=dtype, granularity="token", **SHAPES["gqa4"])]
    want = op.reference.fp8_decode(*args)
    got = op.fp8_decode(*args, conversion="bits")
    assert got.out.dtype == dtype
    torch.testing.assert_close(got.out.float(), want.out.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_fp8_attention_is_close_to_the_16_bit_cache(device):
    """What the format costs: the decode output over e4m3 codes is within a
    few percent of attention over the values they encode."""
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 1, 2, 256, 64, generator=g).to(device)
    q = torch.randn(1, 4, 1, 64, generator=g).to(device)
    exact = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    k_codes, k_scale = codec.quantize(k, "tensor")
    v_codes, v_scale = codec.quantize(v, "tensor")
    scale = (k_scale.reshape(1, 1).expand(1, 2), v_scale.reshape(1, 1).expand(1, 2))
    out = op.fp8_decode(q, torch.full((1, 1), 256, device=device), k_codes, codec.values_layout(v_codes), *scale,
                        torch.arange(256, device=device)[None]).out
    rel = ((out - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel < 0.05


def test_no_query_tokens_give_an_empty_output(device, monkeypatch):
    """M = 0: an empty output, as the reference gives, without a launch (the
    kernel read every code of the cache for no row, dividing by N_QUERIES = 0)."""
    q, q_pos, *cache = [t.to(device) for t in make_case(batch=2, granularity="token", **SHAPES["gqa4"])]

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("a kernel launched for no query token")

    monkeypatch.setattr(kernel, "_stage1_kernel", NoLaunch())
    monkeypatch.setattr(kernel, "_stage1_tuned", NoLaunch())
    none_q, none_pos = q[:, :, :0], q_pos[:, :0]
    got, want = op.fp8_decode(none_q, none_pos, *cache), op.reference.fp8_decode(none_q, none_pos, *cache)
    assert got.out.shape == want.out.shape == (2, 8, 0, 64) and got.lse.shape == want.lse.shape == (2, 8, 0)


def test_bad_inputs_name_the_culprit(device):
    args = [t.to(device) for t in make_case(batch=1, **SHAPES["gqa4"])]
    q, q_pos, k, v, ks, vs, pos = args
    with pytest.raises(TypeError, match="float8_e4m3fn or float8_e5m2"):
        op.fp8_decode(q, q_pos, k.float(), v, ks, vs, pos)
    with pytest.raises(ValueError, match="k_scale"):
        op.fp8_decode(q, q_pos, k, v, ks[:, :1], vs, pos)
    with pytest.raises(TypeError, match="float32"):
        op.fp8_decode(q, q_pos, k, v, ks.half(), vs, pos)
    with pytest.raises(ValueError, match="conversion"):
        op.fp8_decode(q, q_pos, k, v, ks, vs, pos, conversion="fast")


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_no_channels_and_non_tensors_get_clear_errors(impl, device):
    # head_dim 0 raised ZeroDivisionError from the default softmax scale, and
    # a list for a tensor "'list' object has no attribute 'dim'".
    run = op.fp8_decode if impl == "kernel" else op.reference.fp8_decode
    q, q_pos, k, v, ks, vs, pos = [t.to(device) for t in make_case(batch=1, **SHAPES["gqa4"])]
    with pytest.raises(ValueError, match=r"head_dim must be at least 1, got q of shape \(1, 8, 1, 0\)"):
        run(q[..., :0], q_pos, k[..., :0], v[..., :0], ks, vs, pos)
    with pytest.raises(TypeError, match="q_pos must be a torch.Tensor, got list"):
        run(q, q_pos.tolist(), k, v, ks, vs, pos)


@pytest.mark.parametrize("granularity", ["head", "tensor"])
def test_codec_scales_of_a_head_or_the_tensor_are_told_how_to_go_in(granularity, device):
    """codec.quantize's per-head and per-tensor scales keep a token axis of
    one ([batch, kv_heads or 1, 1]), which the op does not take: its error
    says how they go in, and that way the op runs."""
    g = torch.Generator().manual_seed(5)
    batch, kv_heads, slots = 2, 2, 40
    k, v = torch.randn(2, batch, kv_heads, slots, 64, generator=g).to(device)
    q = torch.randn(batch, 4, 1, 64, generator=g).to(device)
    q_pos, pos = torch.full((batch, 1), slots, device=device), torch.arange(slots, device=device).expand(batch, -1)
    k_codes, k_scale = codec.quantize(k, granularity)
    v_codes, v_scale = codec.quantize(v, granularity)
    with pytest.raises(ValueError, match=rf"go in as scale\[\.\.\., 0\]\.expand\({batch}, {kv_heads}\)"):
        op.reference.fp8_decode(q, q_pos, k_codes, v_codes, k_scale, v_scale, pos)
    scales = [s[..., 0].expand(batch, kv_heads) for s in (k_scale, v_scale)]
    assert op.reference.fp8_decode(q, q_pos, k_codes, v_codes, *scales, pos).out.isfinite().all()


# ----------------------------------------------------------------------------
# The method, and FP8 under token selection
# ----------------------------------------------------------------------------

SMALL = SyntheticConfig(layers=2, heads=4, kv_heads=2, head_dim=32, tokens_per_image=64, system_tokens=8,
                        text_tokens=16, decode_steps=4, salient_tokens=8, dense_layers=1, dtype="float16")
WORKLOAD = {"layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 32, "tokens_per_image": 64, "system_tokens": 8,
            "text_tokens": 16, "decode_steps": 4, "salient_tokens": 8, "dense_layers": 1, "dtype": "float16"}


@pytest.fixture(scope="module")
def workload():
    return generate(SMALL)


def _prefill(method, workload, layer=0):
    return method.prefill(layer, workload.q[layer], workload.k[layer], workload.v[layer], workload.spans)


@pytest.mark.parametrize("granularity,scale_bytes", [("tensor", lambda h, n: 8), ("head", lambda h, n: 8 * h),
                                                      ("token", lambda h, n: 8 * h * n)])
def test_bytes_are_codes_plus_scales_exactly(granularity, scale_bytes, workload):
    method = make_method("fp8", {"fp8_scale": granularity})
    cache = _prefill(method, workload)
    assert isinstance(cache, Float8Tokens)
    heads, n, d = workload.k[0].shape
    assert method.cache_bytes(cache) == 2 * heads * n * d + scale_bytes(heads, n)
    method.decode(0, cache, workload.decode_q[0][0], workload.decode_k[0][0], workload.decode_v[0][0])
    assert method.cache_bytes(cache) == 2 * heads * (n + 1) * d + scale_bytes(heads, n + 1)


def test_fp8_composes_with_snapkv_as_one_setting(workload):
    plain = make_method("snapkv", {"budget": 0.5})
    fp8 = make_method("snapkv", {"budget": 0.5, "kv_dtype": "fp8_e4m3"})
    a, b = _prefill(plain, workload), _prefill(fp8, workload)
    assert torch.equal(a.positions, b.positions)  # the same tokens kept
    assert plain.cache_bytes(a) == 2 * (fp8.cache_bytes(b) - 8)  # half the bytes, plus one pair of scales
    torch.testing.assert_close(b.keys, a.keys.float(), atol=0.07 * a.keys.abs().max().item(), rtol=0)


def test_evicting_over_fp8_holds_the_budget(workload):
    method = make_method("h2o", {"budget": 0.4, "kv_dtype": "fp8_e5m2", "evict_while_decoding": True})
    cache = _prefill(method, workload)
    for q_t, k_t, v_t in zip(workload.decode_q[0], workload.decode_k[0], workload.decode_v[0]):
        method.decode(0, cache, q_t, k_t, v_t)
        assert cache.tokens == max(1, int(0.4 * cache.seen))
        assert cache.k_codes.shape[1] == cache.v_codes_t.shape[2] == cache.positions.shape[1]
        assert cache.positions[:, -1].eq(cache.seen - 1).all()  # the newest token is held


def test_evicting_over_fp8_dequantizes_the_cache_once_a_step(workload, monkeypatch):
    """H2O's step reads the attention weights over the dequantized keys and
    values, and nothing more: its scorer asked for the whole dequantized keys
    a second time only to count their kv heads."""
    method = make_method("h2o", {"budget": 0.4, "kv_dtype": "fp8_e4m3"})
    cache = _prefill(method, workload)
    decoded, decode = [], codec.decode
    monkeypatch.setattr(codec, "decode", lambda codes, *rest: decoded.append(codes.shape) or decode(codes, *rest))
    method.decode(0, cache, workload.decode_q[0][0], workload.decode_k[0][0], workload.decode_v[0][0])
    assert len(decoded) == 2  # keys and values, once each


def test_fused_decode_matches_the_float32_path(workload):
    outs = {}
    for attention in ("float32", "sdpa"):
        method = make_method("fp8", {"attention": attention, "fp8_scale": "token"})
        cache = _prefill(method, workload)
        outs[attention] = method.decode(0, cache, workload.decode_q[0][0], workload.decode_k[0][0],
                                        workload.decode_v[0][0])
    torch.testing.assert_close(outs["sdpa"].float(), outs["float32"].float(), atol=2e-3, rtol=2e-3)


def test_a_generated_token_beyond_a_static_scale_saturates(workload):
    method = make_method("fp8", {"fp8_scale": "tensor"})
    cache = _prefill(method, workload)
    k_t = workload.decode_k[0][0] * 1000
    method.decode(0, cache, workload.decode_q[0][0], k_t, workload.decode_v[0][0])
    top = cache.keys[:, -1].abs().max().item()
    assert torch.isfinite(cache.keys).all() and top == pytest.approx(cache.keys[:, :-1].abs().max().item())


def test_scores_put_fp8_at_half_the_bytes_with_a_small_error():
    rows = {label: ablation.run(name, params, WORKLOAD)["metrics"] for label, name, params in
            (("e4m3", "fp8", {}), ("e5m2", "fp8", {"kv_dtype": "fp8_e5m2"}),
             ("kivi", "kivi", {"residual": 16, "group": 32}))}
    assert rows["e4m3"]["compression_ratio"] == pytest.approx(2.0, rel=1e-3)
    assert 0 < rows["e4m3"]["rel_err_mean"] < rows["e5m2"]["rel_err_mean"] < 0.1  # 3 mantissa bits beat 2
    assert rows["e5m2"]["rel_err_mean"] < rows["kivi"]["rel_err_mean"]  # 8 bits beat 2


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
def test_per_token_values_keep_their_precision_at_any_magnitude(magnitude, device):
    """The per-token value scales enter the PV dot as probability x the
    token's largest value, so tiny or large values lose no 16-bit precision."""
    q, q_pos, k, v, ks, vs, pos = [t.to(device) for t in make_case(batch=1, granularity="token", **SHAPES["gqa4"])]
    vs = vs * magnitude
    want = op.reference.fp8_decode(q, q_pos, k, v, ks, vs, pos).out.float()
    got = op.fp8_decode(q, q_pos, k, v, ks, vs, pos).out.float()
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-3


def test_the_autotuner_keys_on_the_grid_and_the_splits_length(monkeypatch):
    """As quant_decode's: batch 8's config is not reused at batch 64."""
    from kernels_py.ops.fp8_decode import kernel as fkernel
    from kernels_py.tests.autotune_spy import spy_on

    spy = spy_on(monkeypatch, fkernel)
    for batch, splits in ((1, 1), (32, 1), (8, 4)):
        q, q_pos, k, v, k_scale, v_scale, pos = make_case(batch=batch, heads=4, kv_heads=2, head_dim=32, slots=300)
        op.fp8_decode(q, q_pos, k, v, k_scale, v_scale, pos, num_splits=splits)
    # 2, 64 and 64 programs; 300 slots in one split, 75 in each of four
    assert [(key["tune_programs"], key["tune_span"]) for key in spy.keys] == [(16, 512), (64, 512), (64, 128)]
