"""FP8 attention (issue 17): the spec, the quantization helpers, and the FP8 forward kernels
against FlashAttention-3's accuracy rule, on the CPU interpreter (fp8 dots run there in fp32)
and, marked gpu, on the GPU (sm89+)."""

import re

import pytest
import torch

import flashgen
from flashgen import AttentionSpec, KernelConfig, SpecError
from flashgen.verify import assert_attention_close, check_attention, dequantized

SMALL = KernelConfig(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)


def quantized_inputs(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, *, dtype="fp8_e4m3", device="cpu",
                     outliers=False, seed=0):
    """FP8 q, k, v (bhsd) and their (batch, kv heads) descales from random float32 values; with
    ``outliers`` a few channels of each are 20x larger (what per-tensor scales handle worst)."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(batch, h, s, head_dim, generator=gen) for h, s in
          ((heads, seqlen_q), (kv_heads, seqlen_k), (kv_heads, seqlen_k))]
    if outliers:
        for x in xs:
            x[..., ::17] *= 20.0
    group = heads // kv_heads
    (q, qd), (k, kd), (v, vd) = (flashgen.quantize_fp8(x, dtype=dtype, group=g) for x, g in
                                 zip(xs, (group, 1, 1)))
    return [t.to(device) for t in (q, k, v, qd, kd, vd)]


# ----------------------------------------------------------------------------- spec
@pytest.mark.parametrize("alias,dtype", [("fp8_e4m3", "fp8_e4m3"), ("e4m3", "fp8_e4m3"),
                                         ("float8_e4m3fn", "fp8_e4m3"), ("e5m2", "fp8_e5m2")])
def test_spec_accepts_fp8_dtypes(alias, dtype):
    spec = AttentionSpec(name="f", dtype=alias, head_dim=128, num_heads=4)
    assert spec.dtype == dtype and spec.fp8


def test_fp8_spec_refuses_backward_and_dropout():
    with pytest.raises(SpecError, match="backward.*forward-only"):
        AttentionSpec(name="f", dtype="fp8_e4m3", head_dim=64, num_heads=2, backward=True)
    with pytest.raises(SpecError, match="dropout_p"):
        AttentionSpec(name="f", dtype="fp8_e4m3", head_dim=64, num_heads=2, dropout_p=0.1)


# ----------------------------------------------------------------------------- quantization helpers
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("block", [None, 16])
def test_quantize_roundtrip(layout, block):
    x = torch.randn(2, 4, 37, 24) * 3
    x[0, 1, 5] = 0.0
    if layout == "bshd":
        x = x.transpose(1, 2).contiguous()
    xq, scale = flashgen.quantize_fp8(x, layout=layout, group=2, block=block)
    assert xq.dtype == torch.float8_e4m3fn and xq.shape == x.shape
    assert scale.shape == ((2, 2) if block is None else (2, 2, 3)) and scale.dtype == torch.float32
    back = flashgen.dequantize_fp8(xq, scale, layout=layout, group=2, block=block)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, and the largest magnitude maps to 448
    assert torch.allclose(back, x, rtol=2 ** -4, atol=float(scale.max()) * 2 ** -9)
    assert float(xq.float().abs().max()) == 448.0
    xt, scale_t = flashgen.quantize_fp8(x, layout=layout, group=2, block=block, seq_contiguous=True)
    assert torch.equal(xt.float(), xq.float()) and torch.equal(scale_t, scale)
    assert xt.stride(2 if layout == "bhsd" else 1) == 1


def test_quantize_keeps_subnormal_slices_finite():
    # amax / 448 underflowed to a descale of 0: every value saturated to 448 and an exact 0 became NaN (0 / 0)
    x = torch.tensor([3e-43, 1e-43, -1.5e-43, 0.0]).reshape(1, 1, 1, 4)
    xq, descale = flashgen.quantize_fp8(x)
    back = flashgen.dequantize_fp8(xq, descale)
    assert float(descale) > 0 and torch.isfinite(xq.float()).all()
    assert torch.allclose(back, x, atol=1e-40)


def test_benchmarks_fp8_inputs_are_the_forwards_operands():
    # flashgen.bench.fp8_inputs (the FP8 benchmarks' inputs): q and k as quantize_fp8 gives them, V in its
    # seq-contiguous copy, and their descales in q, k, v order
    from flashgen.bench import fp8_inputs

    q, k, v = (torch.randn(2, 4, 37, 32) * s for s in (1, 2, 3))
    q8, k8, v8, descales = fp8_inputs(q, k, v)
    for t, t8, d in zip((q, k, v), (q8, k8, v8), descales):
        want, want_d = flashgen.quantize_fp8(t)
        assert torch.equal(t8.float(), want.float()) and torch.equal(d, want_d)
    assert v8.stride(2) == 1 and q8.stride(3) == 1


def test_quantize_errors_name_the_argument():
    x = torch.randn(1, 4, 8, 16)
    with pytest.raises(ValueError, match="group"):
        flashgen.quantize_fp8(x, group=3)
    with pytest.raises(ValueError, match="dtype"):
        flashgen.quantize_fp8(x, dtype="int8")
    with pytest.raises(ValueError, match="block"):
        flashgen.quantize_fp8(x, block=0)
    with pytest.raises(ValueError, match="layout"):
        flashgen.quantize_fp8(x, layout="thd")
    for bad, words in ((dict(x=x.int()), "x: expected a 4-d float tensor with data in layout 'bhsd', got shape "
                                         "(1, 4, 8, 16), dtype torch.int32"),
                       (dict(x=torch.empty(1, 4, 8, 16, device="meta")), "device meta"),
                       (dict(x=x, dtype=["fp8_e4m3"]), "dtype: expected 'fp8_e4m3'"),
                       (dict(x=x, seq_contiguous="no"), "seq_contiguous: expected a bool, got 'no'")):
        with pytest.raises(ValueError, match=re.escape(words)):
            flashgen.quantize_fp8(**bad)


@pytest.mark.parametrize("block", [8, 9, 10**6, 2**70])
def test_a_block_past_the_sequence_is_one_block(block):
    # (a block of 2**40 tokens padded the sequence to it: an allocation of 2**48 bytes; 2**70 overflowed torch.pad)
    x = torch.randn(2, 4, 8, 16)
    xq, scales = flashgen.quantize_fp8(x, block=block)
    whole_q, whole = flashgen.quantize_fp8(x)
    assert scales.shape == (2, 4, 1) and torch.equal(scales[..., 0], whole) and torch.equal(xq.float(), whole_q.float())
    assert torch.equal(flashgen.quant.dequantize_fp8(xq, scales, block=block),
                       flashgen.quant.dequantize_fp8(whole_q, whole))


# ----------------------------------------------------------------------------- the kernels
CASES = [
    ("e4m3 gqa", dict(dtype="fp8_e4m3", num_heads=4, num_kv_heads=2), {}),
    ("e4m3 causal", dict(dtype="fp8_e4m3", num_heads=2, causal=True), {}),
    ("e5m2 mha", dict(dtype="fp8_e5m2", num_heads=2), {}),
    ("e4m3 sliding window + softcap", dict(dtype="fp8_e4m3", num_heads=2, mask={"sliding_window": {"left": 20}},
                                            score_mod={"softcap": 20.0}), {}),
    ("e4m3 outlier channels", dict(dtype="fp8_e4m3", num_heads=2, causal=True), dict(outliers=True)),
]


@pytest.mark.parametrize("name,fields,extra", CASES, ids=[c[0] for c in CASES])
def test_fp8_forward_meets_fa3_rule(name, fields, extra, device):
    spec = AttentionSpec(name="f8", head_dim=64, **fields)
    config = SMALL if device == "cpu" else None
    module = flashgen.compile(spec, config).module()
    q, k, v, qd, kd, vd = quantized_inputs(2, spec.num_heads, spec.num_kv_heads, 77, 93, 64, dtype=spec.dtype,
                                           device=device, **extra)
    out, lse = module.forward(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    assert out.dtype == torch.bfloat16 and out.shape == (2, spec.num_heads, 77, 64)
    assert_attention_close(out, lse, q, k, v, causal=spec.causal, mask=fields.get("mask"),
                           score_mod=fields.get("score_mod"), descales=(qd, kd, vd))


def test_fp8_hd256_promotes_its_qk_products_to_fp32(device):
    # Hopper's FP8 tensor cores sum products with fewer bits than fp32: past 128 of them (head dim 256)
    # both FP8 forwards add partial sums in fp32 every FP8_QK_PROMOTE products (the LSE at hd256 causal
    # was 1.02-1.08x its bound on the H100 without); at hd128 the q.k product is one such run, unchanged
    spec = AttentionSpec(name="f8", dtype="fp8_e4m3", head_dim=256, num_heads=2, causal=True)
    gluon = KernelConfig(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2, family="hopper_ws")
    portable, hopper = (flashgen.compile(spec, config).source() for config in (SMALL, gluon))
    assert "FP8_QK_PROMOTE = tl.constexpr(128)" in portable
    assert "tl.dot(q, k, input_precision=DOT_PRECISION, max_num_imprecise_acc=FP8_QK_PROMOTE)" in portable
    assert "q.slice(FP8_QK_PROMOTE, FP8_QK_PROMOTE, dim=1)" in hopper and "return lo + hi" in hopper
    hd128 = flashgen.compile(AttentionSpec(name="f8", dtype="fp8_e4m3", head_dim=128, num_heads=2), gluon).source()
    assert "FP8_QK_PROMOTE" not in hd128
    # and the promoted portable forward meets FlashAttention-3's rule (the interpreter ignores the
    # promotion: it multiplies in fp32; on the GPU, tests/test_hopper_fp8_gpu.py)
    module = flashgen.compile(spec, SMALL if device == "cpu" else None).module()
    q, k, v, qd, kd, vd = quantized_inputs(1, 2, 2, 33, 47, 256, device=device)
    out, lse = module.forward(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    assert_attention_close(out, lse, q, k, v, causal=True, descales=(qd, kd, vd))


def test_fp8_v_in_either_layout_gives_the_same_output(device):
    spec = AttentionSpec(name="f8", dtype="fp8_e4m3", head_dim=32, num_heads=2, causal=True)
    module = flashgen.compile(spec, SMALL if device == "cpu" else None).module()
    q, k, v, qd, kd, vd = quantized_inputs(1, 2, 2, 40, 40, 32, device=device)
    v_t = v.transpose(2, 3).contiguous().transpose(2, 3)  # seq-contiguous: read without a copy
    a, _ = module.forward(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    b, _ = module.forward(q, k, v_t, q_descale=qd, k_descale=kd, v_descale=vd)
    assert torch.equal(a, b)


def test_fp8_descales_scale_the_result(device):
    """Doubling q's descale is the same as doubling the softmax scale; v's scales the output."""
    spec = AttentionSpec(name="f8", dtype="fp8_e4m3", head_dim=32, num_heads=2)
    module = flashgen.compile(spec, SMALL if device == "cpu" else None).module()
    q, k, v, qd, kd, vd = quantized_inputs(1, 2, 2, 33, 33, 32, device=device)
    base, _ = module.forward(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    twice_v, _ = module.forward(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd * 2)
    assert torch.allclose(twice_v.float(), 2 * base.float(), rtol=1e-2, atol=1e-3)
    sharper, lse = module.forward(q, k, v, q_descale=qd * 2, k_descale=kd, v_descale=vd)
    results = check_attention(sharper, lse, q, k, v, causal=False, descales=(qd * 2, kd, vd))
    assert all(r.ok for r in results), results
    assert not torch.equal(sharper, base)


def test_fp8_bad_input_is_refused(device):
    spec = AttentionSpec(name="f8", dtype="fp8_e4m3", head_dim=32, num_heads=2)
    module = flashgen.compile(spec, SMALL if device == "cpu" else None).module()
    q, k, v, qd, kd, vd = quantized_inputs(1, 2, 2, 16, 16, 32, device=device)
    with pytest.raises(ValueError, match="k_descale"):
        module.forward(q, k, v, k_descale=torch.ones(3, 5, device=device))
    with pytest.raises(ValueError, match="q: expected dtype"):
        module.forward(q.float(), k, v)
    with pytest.raises(ValueError, match="forward-only"):
        module.backward(q, q, k, v, q, torch.zeros(1, 2, 16, device=device))
    bf16 = flashgen.compile(AttentionSpec(name="b", dtype="fp16", head_dim=32, num_heads=2), SMALL).module()
    x = torch.randn(1, 2, 16, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="q_descale: descale factors are for FP8"):
        bf16.forward(x, x, x, q_descale=qd)


def test_dequantized_matches_helper():
    q, k, v, qd, kd, vd = quantized_inputs(2, 4, 2, 8, 8, 16)
    assert torch.equal(dequantized(q, qd), flashgen.dequantize_fp8(q, qd, group=2))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_forward_gpu_default_config(head_dim, causal):
    spec = AttentionSpec(name="f8", dtype="fp8_e4m3", head_dim=head_dim, num_heads=8, num_kv_heads=2, causal=causal)
    module = flashgen.compile(spec).module()
    q, k, v, qd, kd, vd = quantized_inputs(2, 8, 2, 1000, 1000, head_dim, device="cuda", outliers=True)
    out, lse = module.forward(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    assert_attention_close(out, lse, q, k, v, causal=causal, descales=(qd, kd, vd))


# ----------------------------------------------------------------------------- entry points
def test_attention_and_compat_take_fp8_with_descales(device):
    q, k, v, qd, kd, vd = quantized_inputs(2, 4, 2, 48, 48, 32, device=device)
    spec = AttentionSpec(name="attention", dtype="fp8_e4m3", head_dim=32, num_heads=4, num_kv_heads=2, causal=True)
    out, lse = flashgen.attention(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True)
    assert out.dtype == torch.bfloat16
    assert_attention_close(out, lse, q, k, v, causal=True, descales=(qd, kd, vd))
    direct, _ = flashgen.compile(spec).module().forward(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    assert torch.equal(out, direct)
    from flashgen.compat import flash_attn_func

    bshd = [t.transpose(1, 2) for t in (q, k, v)]
    out2 = flash_attn_func(*bshd, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    assert torch.equal(out2.transpose(1, 2), out)


def test_fp8_attention_refuses_gradients_and_stray_descales(device):
    q, k, v, qd, kd, vd = quantized_inputs(1, 2, 2, 16, 16, 32, device=device)
    with pytest.raises(ValueError, match="q: FP8 attention is forward-only"):
        flashgen.attention(q.requires_grad_(), k, v)
    x = torch.randn(1, 2, 16, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="k_descale: descale factors are for FP8"):
        flashgen.attention(x, x, x, k_descale=kd)


def test_fp8_attention_compiles_fullgraph(device):
    q, k, v, qd, kd, vd = quantized_inputs(1, 2, 2, 24, 24, 32, device=device)

    def fn(q, k, v, qd, kd, vd):
        return flashgen.attention(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)

    eager = fn(q, k, v, qd, kd, vd)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, qd, kd, vd)
    assert torch.equal(compiled, eager)


@pytest.mark.interpreter
def test_tuner_verifies_and_stores_an_fp8_spec(tmp_path):
    """Each FP8 candidate is checked by FA3's rule before it is timed; only the Q-outer forward is
    searched."""
    from flashgen.db import EnvInfo, ResultStore
    from flashgen.space import DeviceLimits, forward_space
    from flashgen.tuner import InterpretRunner, TuneOptions, tune

    store = ResultStore(f"sqlite:///{tmp_path / 'results.sqlite'}")
    spec = AttentionSpec(name="f8", dtype="fp8_e4m3", head_dim=16, num_heads=2, causal=True,
                         tune={"seqlens": [32], "trials": 2})
    (result,) = tune(spec, InterpretRunner(), store, TuneOptions(trials=2))
    assert result.phase == "fwd" and result.best is not None
    trials = store.trials(EnvInfo.current(interpret=True), spec)
    assert trials and all(t.status == "ok" for t in trials), [t.error for t in trials]
    space = forward_space(spec, DeviceLimits("H100", 232448, hopper=True))
    assert space.params["loop_order"] == ("q_outer",) and 256 in space.params["BLOCK_N"]


@pytest.mark.parametrize("shape, block, scales", [((1, 2, 0, 16), None, (1, 2)), ((1, 2, 0, 16), 4, (1, 2, 0)),
                                                  ((0, 2, 8, 16), None, (0, 2)), ((1, 2, 8, 0), None, (1, 2))])
def test_quantizing_an_empty_tensor_gives_unit_factors(shape, block, scales):
    # (a 0-length sequence had no largest magnitude to reduce: IndexError)
    xq, descale = flashgen.quantize_fp8(torch.randn(shape), block=block)
    assert xq.shape == shape and xq.dtype == torch.float8_e4m3fn
    assert descale.shape == scales and bool((descale == 1).all())


def test_quantize_fp8_compiles_fullgraph():
    # the finite check reads the factors back: skipped while torch.compile traces (nothing to read there)
    x = torch.randn(1, 2, 8, 16)
    compiled = torch.compile(flashgen.quantize_fp8, fullgraph=True, backend="eager")(x)
    eager = flashgen.quantize_fp8(x)
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(compiled, eager))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_quantizing_a_non_finite_value_is_refused(bad):
    # an inf gave its slice an infinite factor: every value there came back 0 or NaN, silently
    x = torch.randn(1, 2, 8, 16)
    x[0, 1, 3, 5] = bad
    for block in (None, 4):
        with pytest.raises(ValueError, match="^x: holds inf or NaN"):
            flashgen.quantize_fp8(x, block=block)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 3e3])
def test_the_e5m2_pairs_reference_operand_is_exact(scale):
    # verify.fp8_matmul multiplies an e5m2 pair as e5m2 x (e4m3 times a power of two): _scaled_mm takes no
    # e5m2 pair. Exact for every value of at least 2^-14 of the largest; the rest within 2^-17 of it.
    from flashgen.verify import _e4m3_scaled

    x = (torch.randn(64, 96, generator=torch.Generator().manual_seed(7)) * scale).to(torch.float8_e5m2)
    y, factor = _e4m3_scaled(x)
    assert y.dtype == torch.float8_e4m3fn and factor.dtype == torch.float32
    back, xf = y.float() * factor, x.float()
    largest = xf.abs().max()
    big = xf.abs() >= largest * 2**-14
    assert torch.equal(back[big], xf[big])
    assert (back - xf).abs().max() <= largest * 2**-17
    assert torch.equal(_e4m3_scaled(torch.zeros(3, 3, dtype=torch.float8_e5m2))[0].float(), torch.zeros(3, 3))


def test_an_e5m2_pair_multiplies_as_its_values():
    # verify.fp8_matmul's e5m2 pair (e5m2 x e4m3 times a power of two): the products are exact, so the
    # result is the float64 matmul's to float32 rounding, whatever the scale direction would get wrong
    from flashgen.verify import fp8_matmul

    gen = torch.Generator().manual_seed(5)
    a = (torch.randn(1, 2, 20, 32, generator=gen) * 300).to(torch.float8_e5m2)
    b = (torch.randn(1, 1, 24, 32, generator=gen) * 0.01).to(torch.float8_e5m2)
    try:
        got = fp8_matmul(a, b)
    except (RuntimeError, NotImplementedError) as err:  # a torch without _scaled_mm on this device
        pytest.skip(f"torch._scaled_mm: {err}")
    want = a.double() @ b.double().transpose(-1, -2)
    assert got.shape == want.shape and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6 * want.abs().max())
