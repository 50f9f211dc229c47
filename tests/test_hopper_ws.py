"""The Hopper warp-specialized family (config family 'hopper_ws') without a GPU: what it serves,
its config knobs, its rendering beside the portable forward, the fallback to the portable forward
for calls it cannot serve, and the tuner's space. The kernel itself is compiled for sm90 by
tests/test_sm90_compile.py and run by tests/test_hopper_ws_gpu.py."""

import ast
import types

import pytest
import torch
import triton

import flashgen
from flashgen import AttentionSpec, ConfigError, KernelConfig, default_config
from flashgen.codegen.render import render
from flashgen.runtime import hopper
from flashgen.space import DeviceLimits, forward_space
from flashgen.verify import assert_attention_close

from .helpers import make_qkv

HOPPER = dict(family="hopper_ws", BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2)
H100 = DeviceLimits("NVIDIA H100", 232448.0, hopper=True)


@pytest.mark.parametrize("fields", [
    dict(dtype="bf16", head_dim=128, num_heads=8, num_kv_heads=2, causal=True),
    dict(dtype="fp16", head_dim=64, num_heads=4),
    dict(dtype="bf16", head_dim=128, target="h100"),
    dict(dtype="fp8_e4m3", head_dim=128, num_heads=8, num_kv_heads=2, causal=True),
    dict(dtype="fp8_e4m3", head_dim=256),
    dict(dtype="bf16", head_dim=256, num_heads=8, num_kv_heads=2, causal=True),
    dict(dtype="fp16", head_dim=256),
    # head dims between them, on their padded width's tiles (16-bit, multiples of 8)
    dict(dtype="bf16", head_dim=40, num_heads=8, num_kv_heads=2, causal=True),
    dict(dtype="fp16", head_dim=96),
    dict(dtype="bf16", head_dim=72),
    dict(dtype="bf16", head_dim=160, num_heads=8, num_kv_heads=2, causal=True),
    dict(dtype="bf16", head_dim=248),
])
def test_spec_served(fields):
    assert hopper.spec_unserved(AttentionSpec(**fields)) is None


def test_head_dim_256_is_served_by_the_forward_only():
    # 16-bit hd256: the Gluon forward (64-key blocks), not the Gluon dK/dV (hopper_bwd), by its rule, its config
    # check and the default backward beside the forward's hd256 default
    spec = AttentionSpec(dtype="bf16", head_dim=256, num_heads=8, causal=True)
    assert "head_dim 256" in hopper.spec_unserved(spec, backward=True)
    with pytest.raises(ConfigError, match="'hopper_bwd'.*head_dim 256"):
        KernelConfig(hopper_bwd=True).check_spec(spec)
    got = flashgen.default_config(spec, "h100", 4096)
    assert got.family == "hopper_ws" and not got.hopper_bwd
    # 128-key blocks do not fit two stages beside Q (320 KiB): a ConfigError naming the knobs
    with pytest.raises(ConfigError, match="shared memory"):
        KernelConfig(**HOPPER).check_spec(spec)
    KernelConfig(**dict(HOPPER, BLOCK_N=64)).check_spec(spec)


def test_fp8_is_served_by_the_forward_only():
    # FP8 is forward-only: the Gluon dK/dV (hopper_bwd) refuses it, by its rule, its config check
    # and its default (which an FP8 spec's config would otherwise carry at hd128 causal 4096+)
    spec = AttentionSpec(dtype="fp8_e4m3", head_dim=128, num_heads=16, causal=True)
    assert "forward only" in hopper.spec_unserved(spec, backward=True)
    assert hopper.spec_unserved(AttentionSpec(dtype="bf16", head_dim=128), backward=True) is None
    with pytest.raises(ConfigError, match="'hopper_bwd'.*forward only"):
        KernelConfig(hopper_bwd=True).check_spec(spec)
    assert not flashgen.default_config(spec, "h100", 4096).hopper_bwd


@pytest.mark.parametrize("fields, reason", [
    (dict(dtype="fp32", head_dim=64), "dtype 'fp32'"),
    (dict(dtype="fp8_e5m2", head_dim=128), "dtype 'fp8_e5m2'"),
    (dict(dtype="fp8_e4m3", head_dim=96), "head_dim 96"),  # FP8: the exact head dims only
    (dict(dtype="bf16", head_dim=100), "head_dim 100"),  # not a multiple of 8 (rows of 200 bytes)
    (dict(dtype="bf16", head_dim=32), "head_dim 32"),  # 32-wide tiles: not the family's
    (dict(dtype="bf16", head_dim=24), "head_dim 24"),
    (dict(dtype="bf16", head_dim=128, head_dim_v=64), "head_dim_v 64"),
    (dict(dtype="bf16", head_dim=64, mask={"sink": {"tokens": 4, "window": 128}}), "mask: pattern 'sink'"),
    (dict(dtype="bf16", head_dim=64, score_mod={"softcap": 30.0}), "score modifier"),
    (dict(dtype="bf16", head_dim=64, dropout_p=0.1), "dropout_p 0.1"),
    (dict(dtype="bf16", head_dim=64, target="a100"), "target 'a100'"),
])
def test_spec_unserved_names_the_reason(fields, reason):
    got = hopper.spec_unserved(AttentionSpec(**fields))
    assert got is not None and reason in got
    # the same rule on a module's SPEC dict
    assert hopper.spec_unserved(AttentionSpec(**fields).to_dict() | {"head_dim_v": AttentionSpec(**fields).head_dim_v})


def test_call_unserved():
    q, k, v = make_qkv(1, 4, 2, 40, 40, 64, dtype=torch.float16, device="cpu")
    ok = lambda device: None  # noqa: E731 - as if on an sm90 GPU
    assert hopper.call_unserved(q, k, v, "bhsd", device_check=ok) is None
    assert hopper.call_unserved(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), "bshd",
                                device_check=ok) is None  # any 16-byte strides
    # packed sequences where the module has a packed kernel (unmasked fp16/bf16), else the portable forward
    assert "layout 'thd' (served: bhsd, bshd)" in hopper.call_unserved(q[0], k[0], v[0], "thd", device_check=ok)
    assert hopper.call_unserved(q[0], k[0], v[0], "thd", device_check=ok, packed=True) is None
    assert "dropout_p" in hopper.call_unserved(q, k, v, "bhsd", dropout_p=0.1, device_check=ok)
    assert "q: strides" in hopper.call_unserved(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, "bhsd",
                                                device_check=ok)
    shifted = torch.empty(k.numel() + 1, dtype=k.dtype)[1:].view(k.shape).copy_(k)  # a base 2 bytes off 16
    assert "k: strides" in hopper.call_unserved(q, shifted, v, "bhsd", device_check=ok)
    assert hopper.call_unserved(q, k, v, "bhsd") is not None  # CPU tensors: not an sm90 GPU


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_fp8_call_needs_v_seq_contiguous_with_16_byte_strides(layout):
    # FP8's V is read through a (batch, heads, dim, seq) descriptor: its seq dim contiguous, its
    # other strides multiples of 16 bytes (a seq-contiguous copy: seqlen_k a multiple of 16)
    ok = lambda device: None  # noqa: E731 - as if on an sm90 GPU

    def tensors(seqlen_k):
        q, k, v = (flashgen.quantize_fp8(x, layout=layout, seq_contiguous=i == 2)[0]
                   for i, x in enumerate(make_qkv(1, 4, 2, 40, seqlen_k, 64, dtype=torch.float32, device="cpu",
                                                  layout=layout)))
        return q, k, v

    q, k, v = tensors(48)
    assert hopper.call_unserved(q, k, v, layout, device_check=ok) is None
    dense_v = v.contiguous()  # dim-contiguous: not the K-major operand
    assert "v: strides" in hopper.call_unserved(q, k, dense_v, layout, device_check=ok)
    q, k, v = tensors(40)  # 40 keys: V^T's dim stride is 40 bytes
    assert "(FP8: V is read seq-contiguous)" in hopper.call_unserved(q, k, v, layout, device_check=ok)


def test_config_knobs():
    cfg = KernelConfig(**HOPPER)
    assert cfg.to_dict()["family"] == "hopper_ws" and "hopper_regs" not in cfg.to_dict()  # its default left out
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    assert KernelConfig.from_dict(cfg.replace(hopper_pingpong=True, hopper_regs=232).to_dict()).hopper_pingpong
    assert "hopper_ws" in str(cfg) and "family" in KernelConfig.STRUCTURAL
    # the portable default keeps every stored config, kernel id and golden file byte-identical
    assert not any(name.startswith(("family", "hopper_")) for name in KernelConfig().to_dict())


@pytest.mark.parametrize("knobs, knob", [
    (dict(family="flash3"), "'family'"),
    (dict(HOPPER, BLOCK_M=32), "'BLOCK_M'"),
    (dict(HOPPER, BLOCK_N=32), "'BLOCK_N'"),
    (dict(HOPPER, num_stages=1), "'num_stages'"),
    (dict(HOPPER, hopper_regs=250), "'hopper_regs'"),
    (dict(HOPPER, hopper_overlap=1), "'hopper_overlap'"),
    (dict(HOPPER, BLOCK_M=64, hopper_pingpong=True), "'hopper_pingpong'"),
    (dict(HOPPER, hopper_pingpong=True, hopper_overlap=True), "'hopper_pingpong'"),
    (dict(HOPPER, loop_order="kv_outer"), "'family'"),
    (dict(hopper_persistent=True), "'hopper_persistent'"),  # the portable family
    (dict(HOPPER, hopper_persistent=1), "'hopper_persistent'"),
    (dict(hopper_tma_store=True), "'hopper_tma_store'"),  # the portable family
    (dict(HOPPER, hopper_tma_store="yes"), "'hopper_tma_store'"),
])
def test_bad_knobs_are_config_errors(knobs, knob):
    with pytest.raises(ConfigError, match=knob):
        KernelConfig(**knobs)


def test_256_key_blocks_are_for_fp8_only():
    # a 64 x 256 float32 S fits a consumer's registers beside P only when P is FP8
    with pytest.raises(ConfigError, match="'BLOCK_N'.*FP8 specs only.*'bf16'"):
        KernelConfig(**dict(HOPPER, BLOCK_N=256)).check_spec(AttentionSpec(dtype="bf16", head_dim=128))
    KernelConfig(**dict(HOPPER, BLOCK_N=256)).check_spec(AttentionSpec(dtype="fp8_e4m3", head_dim=128))


def test_tiles_past_shared_memory_are_config_errors():
    # hd128 bf16, 128 x 128, 3 stages: 229376 bytes of Q and the K/V ring (+ 1024 for the barriers) fit an sm90
    # block's 232448, the O tiles of a TMA store (32768 more) do not: a ConfigError naming the knobs, not
    # Triton's OutOfResources at launch (which this config met on the H100: 262648 bytes)
    spec = AttentionSpec(dtype="bf16", head_dim=128)
    fits = KernelConfig(**dict(HOPPER, num_stages=3))
    assert fits.check_spec(spec) is fits
    with pytest.raises(ConfigError, match=r"'BLOCK_M'.*'num_stages'.*'hopper_tma_store'.*263168 bytes.*232448"):
        fits.replace(hopper_tma_store=True).check_spec(spec)
    with pytest.raises(ConfigError, match="BLOCK_N=256 num_stages=4 .* 558080 bytes"):
        KernelConfig(**dict(HOPPER, BLOCK_N=256, num_stages=4)).check_spec(AttentionSpec(dtype="fp8_e4m3",
                                                                                         head_dim=256))
    # the tuner's space rejects the same points by the same rule, and says so
    space = forward_space(spec, H100)
    assert not space.violations(fits.to_dict())
    violations = space.violations(dict(fits.to_dict(), hopper_tma_store=True))
    assert violations and all("hopper_tma_store*2*BLOCK_M" in v for v in violations), violations


def test_unserved_spec_is_a_config_error_naming_the_family():
    spec = AttentionSpec(dtype="bf16", head_dim=64, mask={"sink": {"tokens": 4, "window": 128}})
    with pytest.raises(ConfigError, match="'family'.*mask"):
        render(spec, KernelConfig(**HOPPER))
    render(spec, KernelConfig(**dict(HOPPER, family="portable")))  # the portable family serves it


def test_render_keeps_the_portable_forward_beside_it():
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=8, num_kv_heads=2, causal=True, backward=True)
    source = render(spec, KernelConfig(**HOPPER), standalone=False)
    assert "def _attn_fwd_hopper_ws(" in source and "def _attn_fwd(" in source
    assert ("_LAUNCHER.hopper_forward = HopperForward(_attn_fwd_hopper_ws, SPEC, CONFIG, "
            "packed=_attn_fwd_hopper_ws_packed, fallback={") in source
    portable = render(spec, KernelConfig(**dict(HOPPER, family="portable")), standalone=False)
    # (its Gluon is the FP8-cache decode's alone, after the launcher: templates/decode/fp8_cache.j2)
    before_decode, decode = portable.split("\nfrom flashgen.runtime.hopper import async_load")
    assert "gluon" not in before_decode and "hopper_forward" not in portable and "_HW_" not in decode


@pytest.mark.interpreter
def test_calls_it_cannot_serve_run_the_portable_forward():
    # under the interpreter (CPU tensors) every call falls back; the result is the portable forward's
    spec = AttentionSpec(dtype="fp16", head_dim=64, num_heads=4, num_kv_heads=2, causal=True, backward=True)
    module = flashgen.compile(spec, KernelConfig(**dict(HOPPER, BLOCK_M=64, BLOCK_N=64))).module()
    q, k, v = make_qkv(1, 4, 2, 45, 61, 64, dtype=torch.float16, device="cpu")
    out, lse = module.forward(q, k, v)
    assert not any(isinstance(p, hopper.HopperPlan) for p in module._LAUNCHER.plans.values())
    # fp16 (the interpreter's bf16 dot is wrong): TESTING.md's 2x rule
    assert_attention_close(out, lse, q, k, v, causal=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("head_dim, knobs, seqlens", [(96, {}, (45, 61)), (160, dict(BLOCK_N=64), (45, 61)),
                                                      (64, dict(BLOCK_M=192, hopper_regs=160), (45, 61)),
                                                      (64, {}, (30, 4100))])
def test_a_declined_call_runs_the_portable_forward_on_that_family_s_default(head_dim, knobs, seqlens):
    # the Gluon family's tiles are its consumers' (4 warps each) and a producer's: a call it cannot serve (packed
    # sequences, strides the copy engine cannot read, no sm90 GPU) runs the portable forward on the portable
    # default's knobs for its length (the longer side's, as a kernel's bucket is picked: 4100 keys take the 4096
    # bucket's 128 x 64 tiles on 8 warps, 30 queries would take 64 x 64), off sm90 without descriptors or warp
    # specialization; the output checked
    spec = AttentionSpec(dtype="fp16", head_dim=head_dim, num_heads=2, causal=True)
    module = flashgen.compile(spec, KernelConfig(**dict(HOPPER, **knobs))).module()
    q, k, v = make_qkv(1, 2, 2, *seqlens, head_dim, dtype=torch.float16, device="cpu")
    out, lse = module.forward(q, k, v)
    (plan,) = module._LAUNCHER.plans.values()
    assert not isinstance(plan, hopper.HopperPlan)
    portable = default_config(spec, "h100", max(seqlens), hopper_ws=False)
    assert {k: plan.launch.constexprs[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "WARP_SPECIALIZE", "TMA")} \
        == dict(BLOCK_M=portable.BLOCK_M, BLOCK_N=portable.BLOCK_N, num_warps=portable.num_warps,
                WARP_SPECIALIZE=False, TMA=False)  # (a CPU tensor: not an sm90 device)
    assert_attention_close(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("head_dim, causal", [(64, False), (96, True), (128, True), (256, False)])
def test_the_fallback_knobs_are_the_portable_default_of_the_nearest_bucket(head_dim, causal):
    from flashgen.config import DEFAULT_BUCKETS
    from flashgen.runtime.host import nearest_bucket

    spec = AttentionSpec(dtype="bf16", head_dim=head_dim, num_heads=16, causal=causal)
    module = flashgen.compile(spec, default_config(spec, "h100", 4096)).module()
    lengths = sorted({1, 2, 77, 300, 511, 512, 513, 724, 725, 3000, 70000}
                     | {b + d for b in DEFAULT_BUCKETS for d in (-1, 0, 1)})
    for n in lengths:
        portable = default_config(spec, "h100", nearest_bucket(n, DEFAULT_BUCKETS), hopper_ws=False)
        assert module._LAUNCHER.hopper_forward.fallback_knobs(n) == {
            k: getattr(portable, k) for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "warp_specialize",
                                              "tma")}, n


@pytest.mark.interpreter
def test_three_consumers_are_head_dim_64_and_a_declined_call_runs_the_portable_forward():
    # BLOCK_M 192 (three 64-row consumers, FA3's hd64 tiles): the family's only, at 160 registers each, head
    # dim 64; a call the family cannot serve runs the portable forward on its default's tiles (192 is no Triton
    # tile)
    three = dict(HOPPER, BLOCK_M=192, hopper_regs=160)
    with pytest.raises(ConfigError, match="'BLOCK_M'.*got 192"):
        KernelConfig(BLOCK_M=192)
    with pytest.raises(ConfigError, match="'hopper_regs'.*three consumers.*BLOCK_M=192 hopper_regs=232"):
        KernelConfig(**dict(three, hopper_regs=232))
    with pytest.raises(ConfigError, match="'hopper_regs'.*BLOCK_M=128 hopper_regs=160"):
        KernelConfig(**dict(three, BLOCK_M=128))  # (160 starves one or two consumers)
    with pytest.raises(ConfigError, match="'hopper_pingpong'"):
        KernelConfig(**dict(three, hopper_pingpong=True))
    with pytest.raises(ConfigError, match="'BLOCK_N'.*got BLOCK_N=256"):
        KernelConfig(**dict(three, BLOCK_N=256))
    with pytest.raises(ConfigError, match="'BLOCK_M'.*head dims up to 64 only.*got head dim 128"):
        KernelConfig(**three).check_spec(AttentionSpec(dtype="bf16", head_dim=128))
    with pytest.raises(ConfigError, match="'BLOCK_M'.*fp16/bf16.*'fp8_e4m3'"):
        KernelConfig(**three).check_spec(AttentionSpec(dtype="fp8_e4m3", head_dim=64, backward=False))
    assert KernelConfig.from_dict(KernelConfig(**three).to_dict()).BLOCK_M == 192
    spec = AttentionSpec(dtype="fp16", head_dim=64, num_heads=4, num_kv_heads=2, causal=True, backward=True)
    source = render(spec, KernelConfig(**three), standalone=False)
    assert "elif CONSUMERS == 3:" in source and "], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])" in source
    assert "elif CONSUMERS == 3:" not in render(spec, KernelConfig(**HOPPER), standalone=False)
    module = flashgen.compile(spec, KernelConfig(**three)).module()
    q, k, v = make_qkv(1, 4, 2, 45, 61, 64, dtype=torch.float16, device="cpu")
    out, lse = module.forward(q, k, v)
    assert not any(isinstance(p, hopper.HopperPlan) for p in module._LAUNCHER.plans.values())
    assert_attention_close(out, lse, q, k, v, causal=True)
    # a call's knob override cannot ask a module for partitions it was not built with (three consumers of a
    # two-consumer module's kernel would wait forever for the third's releases), nor more registers than fit
    two = flashgen.compile(spec, KernelConfig(**HOPPER)).module()
    with pytest.raises(ValueError, match="BLOCK_M: 192 .*built with BLOCK_M=128"):
        two.forward(q, k, v, BLOCK_M=192)
    with pytest.raises(ValueError, match="BLOCK_M: 192 .*hopper_regs=240"):
        module.forward(q, k, v, hopper_regs=240)
    out, lse = module.forward(q, k, v, BLOCK_M=128, hopper_regs=240)  # (two consumers: rendered too)
    assert_attention_close(out, lse, q, k, v, causal=True)


@pytest.mark.interpreter
def test_a_call_it_serves_gets_its_plan(monkeypatch):
    # the plan is made on the host once per call key; nothing runs here (the kernel runs on an sm90
    # GPU only): its launch and its Gluon descriptors are recorded
    spec = AttentionSpec(dtype="fp16", head_dim=64, num_heads=4, num_kv_heads=2, causal=True)
    module = flashgen.compile(spec, KernelConfig(**HOPPER)).module()
    module._LAUNCHER.hopper_forward.device_unserved = lambda device: None
    made, launched = [], []

    class Descriptor:
        def __init__(self, t, layout, rows, cols):
            made.append(1)
            self.base, self.block = t, (rows, cols)

    class Launch:
        def __init__(self, kernel, grid, constexprs):
            self.grid, self.constexprs = grid, constexprs

        def __call__(self, *args):
            launched.append((self, args))

    monkeypatch.setattr(hopper, "BoundLaunch", Launch)
    monkeypatch.setattr(module._LAUNCHER.hopper_forward, "descriptor", Descriptor)
    q, k, v = make_qkv(2, 4, 2, 45, 61, 64, dtype=torch.float16, device="cpu")
    out, lse = module.forward(q, k, v)
    assert out.shape == q.shape and lse.shape == (2, 4, 45)
    ((launch, (qd, kd, vd, o, l, *scalars)),) = launched
    assert all(a is b for a, b in zip((qd.base, kd.base, vd.base, o, l), (q, k, v, out, lse)))
    assert (qd.block, kd.block, vd.block) == ((64, 64), (HOPPER["BLOCK_N"], 64), (HOPPER["BLOCK_N"], 64))
    assert scalars == [*q.stride()[:3], 4 * 45, 45, 45, 61, 2, pytest.approx(64 ** -0.5 * 1.4426950408889634)]
    assert launch.grid == (triton.cdiv(45, HOPPER["BLOCK_M"]), 4, 2)
    assert launch.constexprs["CONSUMERS"] == HOPPER["BLOCK_M"] // 64 and launch.constexprs["CONSUMER_REGS"] == 240
    q2, k2, v2 = make_qkv(2, 4, 2, 45, 61, 64, dtype=torch.float16, device="cpu")
    out2, lse2 = module.forward(q2, k2, v2, dropout_p=0.0, layout="bhsd")  # the same key: the cached plan
    (launch2, (qd, kd, vd, o, l, *_)) = launched[1]
    assert launch2 is launch and len(made) == 3  # one BoundLaunch; descriptors copied, not made again
    assert all(a is b for a, b in zip((qd.base, kd.base, vd.base, o, l), (q2, k2, v2, out2, lse2)))
    assert qd.block == (64, 64)


@pytest.mark.interpreter
def test_an_fp8_call_gets_v_transposed_and_the_descales(monkeypatch):
    # FP8: V through the transposed descriptor (tiles of (head dim, BLOCK_N) of V^T), the (batch, KV
    # head) descales and their strides after the scalars; q_descale * k_descale join qk_scale in the kernel
    spec = AttentionSpec(dtype="fp8_e4m3", head_dim=64, num_heads=4, num_kv_heads=2, causal=True)
    module = flashgen.compile(spec, KernelConfig(**HOPPER)).module()
    forward = module._LAUNCHER.hopper_forward
    forward.device_unserved = lambda device: None
    made, launched = [], []

    def maker(kind):
        def make(t, layout, rows, cols):
            made.append((kind, t.stride(), rows, cols))
            return types.SimpleNamespace(kind=kind)
        return make

    monkeypatch.setattr(hopper, "BoundLaunch", lambda kernel, grid, constexprs: lambda *args: launched.append(args))
    monkeypatch.setattr(forward, "descriptor", maker("plain"))
    monkeypatch.setattr(forward, "transposed_descriptor", maker("transposed"))
    x = make_qkv(2, 4, 2, 45, 64, 64, dtype=torch.float32, device="cpu")
    (q, qd), (k, kd), (v, vd) = (flashgen.quantize_fp8(t, group=g) for t, g in zip(x, (2, 1, 1)))
    out, lse = module.forward(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    assert out.dtype == torch.bfloat16 and lse.shape == (2, 4, 45)
    assert [m[0] for m in made] == ["plain", "plain", "transposed"]
    assert made[2][1][2] == 1 and made[2][2:] == (HOPPER["BLOCK_N"], 64)  # the seq-contiguous copy of V
    ((*_, qd_arg, kd_arg, vd_arg, stride_b, stride_h),) = launched
    assert all(torch.equal(a, b) for a, b in ((qd_arg, qd), (kd_arg, kd), (vd_arg, vd)))
    assert (stride_b, stride_h) == (2, 1)  # (batch, KV heads) descales: kv_heads, 1


def test_fp8_render_keeps_the_bf16_kernel_text():
    # the FP8 branches render only for FP8 specs: a bf16 module's Gluon forward has none of them
    def kernels(dtype):
        spec = AttentionSpec(dtype=dtype, head_dim=128, num_heads=8, num_kv_heads=2, causal=True)
        source = render(spec, KernelConfig(**HOPPER), standalone=False)
        return source[source.index("_HW_ROWS = gl.constexpr"):]

    fp8, bf16 = kernels("fp8_e4m3"), kernels("bf16")
    assert "V_DESCALE" in fp8 and "_HW_P_SCALE_LOG2" in fp8 and "k_width=4" in fp8 and ".permute((1, 0)), acc" in fp8
    assert not any(word in bf16 for word in ("DESCALE", "descale", "P_SCALE", "k_width=4"))


def test_space_offers_the_family_only_where_it_serves():
    served = forward_space(AttentionSpec(dtype="bf16", head_dim=128, num_heads=16, causal=True), H100)
    points = list(served.points())
    hw = [p for p in points if p["family"] == "hopper_ws"]
    assert hw and all(KernelConfig(**p) for p in points)
    assert all(p["BLOCK_M"] in (64, 128) and p["BLOCK_N"] in (64, 128) and p["num_warps"] == 4 for p in hw)
    assert all(not (p["hopper_overlap"] or p["hopper_pingpong"]) and p["hopper_regs"] == 240
               for p in points if p["family"] == "portable")
    assert any(p["hopper_pingpong"] for p in hw) and not any(p["hopper_pingpong"] and p["BLOCK_M"] == 64 for p in hw)
    # the persistent grid: with the family only; overlapped, ping-ponged or neither
    assert any(p["hopper_persistent"] and p["hopper_overlap"] for p in hw)
    assert any(p["hopper_persistent"] and p["hopper_pingpong"] for p in hw)
    assert not any(p["hopper_persistent"] for p in points if p["family"] == "portable")
    # O by a TMA store: with the family only, where its O tiles fit beside Q and the K/V ring (two
    # 64 x 128 bf16 tiles: 3 stages of 128-key blocks leave no room at 128 rows, at 64 rows they do)
    assert any(p["hopper_tma_store"] and p["hopper_persistent"] for p in hw)
    assert not any(p["hopper_tma_store"] for p in points if p["family"] == "portable")
    wide = [p for p in hw if p["BLOCK_M"] == 128 and p["BLOCK_N"] == 128 and p["num_stages"] == 3]
    assert wide and not any(p["hopper_tma_store"] for p in wide)
    assert any(p["BLOCK_M"] == 64 and p["BLOCK_N"] == 128 and p["num_stages"] == 3 and p["hopper_tma_store"]
               for p in hw)
    masked = forward_space(AttentionSpec(dtype="bf16", head_dim=128, mask={"prefix_lm": 64}), H100)
    assert "family" in masked.params and masked.params["hopper_persistent"] == (False, True)
    fp8 = forward_space(AttentionSpec(dtype="fp8_e4m3", head_dim=128, backward=False), H100)
    assert fp8.params["hopper_persistent"] == (False, True)
    for spec in (AttentionSpec(dtype="bf16", head_dim=100), AttentionSpec(dtype="fp32", head_dim=64)):
        assert "family" not in forward_space(spec, H100).params
    # a padded head dim (hd96 on 128-wide tiles) is searched on the family too
    assert "family" in forward_space(AttentionSpec(dtype="bf16", head_dim=96), H100).params
    assert "family" not in forward_space(AttentionSpec(dtype="bf16", head_dim=128),
                                         DeviceLimits("NVIDIA A100", 166912.0)).params


def test_sm90_defaults_take_the_family_where_it_measured_faster():
    def family(d, causal, seqlen, **fields):
        spec = AttentionSpec(dtype=fields.pop("dtype", "bf16"), head_dim=d, num_heads=16, causal=causal, **fields)
        return flashgen.default_config(spec, "h100", seqlen)

    # H100 wins (benchmarks/results/2026-11-22-h100-hopper-ws-variants.md, -persistent-run2.md, -persistent-
    # overlap*.md; since the TMA store, 2026-11-27-h100-forward-variants{,-2,-3}.md): hd128 from 1024 tokens,
    # causal or not, take all three (persistent grid, FA3's overlap, O by a TMA store); hd64 (plain from 1024,
    # causal from 4096: 2026-11-27-h100-forward-variants-m192{,-2}.md) three 64-row consumers with the TMA
    # store, on the persistent grid but for plain calls from 8192 tokens
    def knobs(got):
        return got.family, got.BLOCK_M, got.num_stages, got.hopper_persistent, got.hopper_overlap, \
            got.hopper_tma_store, got.hopper_pingpong

    all_three = ("hopper_ws", 128, 2, True, True, True, False)
    for d, causal, seqlen in [(128, c, s) for c in (False, True) for s in (1024, 2048, 4096, 8192, 16384, 65536)]:
        assert knobs(family(d, causal, seqlen)) == all_three, (d, causal, seqlen)
    for causal, seqlen in ((False, 1024), (False, 2048), (False, 4096), (True, 4096), (True, 8192), (True, 16384),
                           (True, 65536)):
        got = family(64, causal, seqlen)
        assert knobs(got) == ("hopper_ws", 192, 2, True, False, True, False) and got.hopper_regs == 160, (causal,
                                                                                                          seqlen)
    for seqlen in (8192, 16384, 65536):
        assert knobs(family(64, False, seqlen)) == knobs(family(64, False, seqlen, dtype="fp16")) == \
            ("hopper_ws", 192, 2, False, False, True, False), seqlen
    # hd256 (16-bit; session 35, an H200: results/2026-11-29-h200-forward-variants-hd256.md): from 1024 tokens,
    # causal or not, 64-key blocks on the persistent grid with the overlap, no TMA store (no room beside Q)
    for causal in (False, True):
        for seqlen in (1024, 2048, 4096, 16384, 65536):
            got = family(256, causal, seqlen)
            assert knobs(got) == ("hopper_ws", 128, 2, True, True, False, False) and got.BLOCK_N == 64, \
                (causal, seqlen)
            assert got == family(256, causal, seqlen, dtype="fp16")
        assert family(256, causal, 512).family == "portable"
    # (masks: tests/test_hopper_masks.py)
    # losses, unmeasured short calls, and what the family does not serve: the portable defaults
    for d, causal, seqlen in ((64, False, 512), (64, True, 1024), (64, True, 2048), (128, False, 256),
                              (128, True, 512)):
        assert family(d, causal, seqlen).family == "portable", (d, causal, seqlen)
    assert family(128, False, 4096, mask={"sliding_window": {"left": 100}}).family == "portable"
    assert family(128, False, 4096, dtype="fp32").family == "portable"
    assert family(100, False, 4096).family == "portable"
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=16)
    assert flashgen.default_config(spec, "a100", 4096).family == "portable"


def test_fp8_defaults_take_the_family_where_it_measured_faster():
    # H100 FP8 e4m3 (benchmarks/results/2026-11-23-h100-fp8-hopper-ws-probe.md): hd128 at 4096+ tokens
    # (256-key blocks), hd64 at 16384+, hd256 at 4096+ with 64-key blocks (where its promoted q.k sums
    # fit without spilling; config._hopper_ws_fp8_default); no ping-pong; the rest (unmeasured, or
    # slower) the portable FP8 forward. The persistent grid (2026-11-26-h100-fp8-persistent.md): hd128
    # at 4096 tokens, hd64 and hd256 causal at 4096+; hd128 causal at 4096+ since the one-compare causal
    # mask (2026-11-27-h100-fp8-causal-mask.md)
    def config(d, causal, seqlen, dtype="fp8_e4m3", target="h100"):
        spec = AttentionSpec(dtype=dtype, head_dim=d, num_heads=16, causal=causal)
        got = flashgen.default_config(spec, target, seqlen)
        return (got.family, got.BLOCK_M, got.BLOCK_N, got.num_stages, got.hopper_pingpong, got.hopper_persistent)

    gluon = ("hopper_ws", 128)
    # hd128 writes O by a TMA store (session 18: +2-6% at 4096 and 16384 tokens, causal or not)
    fp8 = AttentionSpec(dtype="fp8_e4m3", head_dim=128, num_heads=16)
    assert all(flashgen.default_config(fp8.replace(causal=causal), "h100", seqlen).hopper_tma_store
               for causal in (False, True) for seqlen in (4096, 8192, 16384))
    assert not flashgen.default_config(fp8.replace(head_dim=64, head_dim_v=64), "h100", 16384).hopper_tma_store
    assert config(128, False, 16384) == config(128, False, 8192) == (*gluon, 256, 2, False, False)
    assert config(128, False, 4096) == config(128, True, 4096) == config(128, True, 8192) == \
        config(128, True, 16384) == (*gluon, 256, 2, False, True)
    assert config(64, False, 16384) == config(64, False, 4096) == (*gluon, 128, 2, False, False)
    assert config(64, True, 4096) == config(64, True, 32768) == (*gluon, 128, 2, False, True)
    assert config(256, False, 16384) == config(256, False, 4096) == (*gluon, 64, 2, False, False)
    assert config(256, True, 4096) == (*gluon, 64, 2, False, True)
    assert config(256, True, 16384) == (*gluon, 64, 3, False, True)
    for d, causal, seqlen in ((128, False, 1024), (64, False, 2048), (256, False, 2048)):
        assert config(d, causal, seqlen)[0] == "portable", (d, causal, seqlen)
    assert config(128, False, 16384, dtype="fp8_e5m2")[0] == config(128, False, 16384, target="a100")[0] == "portable"


def standalone_module(spec, config, path):
    """The standalone module `flashgen generate` writes for (spec, config), written to path and imported;
    it must import nothing from flashgen."""
    import importlib.util
    import re

    source = render(spec, config)
    assert not re.search(r"^\s*(from|import) flashgen", source, re.M) and "class HopperForward" in source
    path.write_text(source)
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tma_store", [False, True])
@pytest.mark.interpreter
def test_standalone_module_carries_the_family_host_side(tmp_path, tma_store):
    # `flashgen generate` files need only torch and triton: runtime/hopper.py is pasted in, and its
    # names leave host.py's (LAYOUTS, ...) and the kernels' constants (RCP_LN2, ...) as they were
    # (with the TMA store: its shims, tma_store, tma_store_wait, warps_barrier, come from the paste too)
    spec = AttentionSpec(dtype="fp16", head_dim=64, num_heads=4, num_kv_heads=2, causal=True, backward=True)
    module = standalone_module(spec, KernelConfig(**dict(HOPPER, BLOCK_M=64, BLOCK_N=64, hopper_tma_store=tma_store)),
                               tmp_path / "standalone_hopper_ws.py")
    source = (tmp_path / "standalone_hopper_ws.py").read_text()
    assert ("tma_store(O, [off_b.to(gl.int32)" in source) == tma_store and "from flashgen." not in source
    assert module.LAYOUTS == ("bhsd", "bshd", "thd") and isinstance(module._LAUNCHER.hopper_forward,
                                                                     module.HopperForward)
    q, k, v = make_qkv(1, 4, 2, 33, 47, 64, dtype=torch.float16, device="cpu")
    out, lse = module.forward(q, k, v)  # CPU: the portable forward
    assert_attention_close(out, lse, q, k, v, causal=True)


# --------------------------------------------------------------- the persistent grid (hopper_persistent)
PERSISTENT = dict(HOPPER, hopper_persistent=True)


def test_persistent_grid_serves_masks_and_fp8():
    # a mask: each tile's key blocks from the pattern (documents': from the block-range table the launch
    # fills per tile), the producer loading key block first_block + j at ring position it + j; tiles paired
    # heavy with light where the mask is causal-shaped (the launcher's CAUSAL on this grid)
    for mask, paired, ranged in (({"prefix_lm": 64}, True, False), ({"document": {"ids": "doc"}}, True, True),
                                 ({"document": {"ids": "doc", "causal": False}}, False, True),
                                 ({"sliding_window": {"left": 40, "right": 30}}, False, False)):
        source = render(AttentionSpec(dtype="bf16", head_dim=128, mask=mask), KernelConfig(**PERSISTENT))
        producer = source.split("def _hw_producer_persistent")[1].split("@gluon.jit")[0]
        assert "first_block, n_blocks = _hw_tile_key_blocks(" in producer
        assert "tma_load(KD, [off_b, off_hk, (first_block + j) * BLOCK_N, 0]" in producer
        assert f", paired={paired}, fallback={{" in source
        assert ("ranges=_hw_fwd_ranges" in source) == ranged
        assert ("gl.load(RANGES" in source or "RANGES +" in source) == ranged
    # FP8: per tile, the descales of its (batch, KV head) and V^T tiles
    fp8 = render(AttentionSpec(dtype="fp8_e4m3", head_dim=128, num_heads=8, num_kv_heads=2, causal=True,
                               backward=False), KernelConfig(**PERSISTENT))
    assert "tile_scale = qk_scale * gl.load(Q_DESCALE + descale)" in fp8
    assert "tma_load(VD, [off_b, off_hk, 0, j * BLOCK_N]" in fp8.split("def _hw_producer_persistent")[1]


def test_persistent_knob_keeps_the_one_tile_kernel_text():
    # off, the knob leaves the config's dict (stored and shipped configs keep their ids) and the
    # kernels' text; on, the persistent partitions are rendered and the one-tile ones are not
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=8, num_kv_heads=2, causal=True)
    assert "hopper_persistent" not in KernelConfig(**HOPPER).to_dict()
    assert KernelConfig.from_dict(KernelConfig(**PERSISTENT).to_dict()).hopper_persistent
    assert "hopper_persistent" in KernelConfig.STRUCTURAL and "persistent" in str(KernelConfig(**PERSISTENT))
    one, many = render(spec, KernelConfig(**HOPPER)), render(spec, KernelConfig(**PERSISTENT))
    assert "_hw_consumer_persistent" not in one and "q_empty" not in one
    assert "gl.warp_specialize([\n            (_hw_consumer_persistent" in many


def _units_on_cpu(module):
    """The module's work-unit helpers as Python functions (gl's max/min on ints)."""
    scope = {"gl": types.SimpleNamespace(maximum=max, minimum=min)}
    for name in ("_hw_unit_tiles", "_hw_tile", "_hw_tile_blocks"):
        fn = getattr(module, name).fn
        scope[name] = types.FunctionType(fn.__code__, scope, name)
    return types.SimpleNamespace(**scope)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch, heads, seqlen_q, seqlen_k, block_m", [(2, 3, 1000, 1000, 128), (1, 2, 17, 4097, 64),
                                                                       (3, 1, 777, 301, 128), (1, 1, 1280, 1280, 128)])
def test_persistent_units_cover_every_tile_once_with_even_work(causal, batch, heads, seqlen_q, seqlen_k, block_m):
    spec = AttentionSpec(dtype="fp16", head_dim=64, num_heads=heads, causal=causal)
    hw = _units_on_cpu(flashgen.compile(spec, KernelConfig(**dict(PERSISTENT, BLOCK_M=block_m))).module())
    tiles_m = -(-seqlen_q // block_m)
    units = batch * heads * ((tiles_m + 1) // 2 if causal else tiles_m)  # as HopperPlan counts them
    seen, work = [], []
    for u in range(units):
        tiles = [hw._hw_tile(u, half, heads, tiles_m, block_m, causal) for half in range(hw._hw_unit_tiles(u, tiles_m,
                                                                                                           causal))]
        seen += tiles
        work.append(sum(hw._hw_tile_blocks(m, seqlen_q, seqlen_k, block_m, 128, causal) for _, _, m in tiles))
        if len(tiles) == 2:  # the heavier tile of a pair first
            assert tiles[0][2] > tiles[1][2]
        # head-major: a unit's tiles read one head, and units of one head are consecutive
        assert len({(b, h) for b, h, _ in tiles}) == 1
    assert sorted(seen) == [(b, h, m * block_m) for b in range(batch) for h in range(heads) for m in range(tiles_m)]
    if causal and tiles_m > 2:  # every pair (but an odd count's middle tile) the same number of key blocks, +-1
        pairs = [w for u, w in enumerate(work) if hw._hw_unit_tiles(u, tiles_m, causal) == 2]
        assert max(pairs) - min(pairs) <= 1, pairs
    if not causal:
        assert len(set(work)) == 1


def test_persistent_plan_launches_one_program_per_sm_at_most(monkeypatch):
    from flashgen.runtime import host

    spec = AttentionSpec(dtype="fp16", head_dim=64, num_heads=4, causal=True)
    module = flashgen.compile(spec, KernelConfig(**PERSISTENT)).module()
    monkeypatch.setattr(hopper, "sm_count", lambda device: 132)
    q, k, v = make_qkv(2, 4, 4, 1000, 1000, 64, dtype=torch.float16, device="cpu")
    base = types.SimpleNamespace(o_shape=q.shape, lse_shape=(2, 4, 1000))
    plan = hopper.HopperPlan(module._LAUNCHER.hopper_forward, base, q, k, "bhsd", None, 0.125,
                             {**hopper.HopperForward.KNOB_DEFAULTS, **module.CONFIG})
    units = 2 * 4 * 4  # 8 query tiles of 128 rows: 4 causal pairs per (batch, head)
    assert plan.launch.grid == (units,) and plan.args[-3:] == (4, 8, units)
    monkeypatch.setattr(hopper, "sm_count", lambda device: 20)
    plan = hopper.HopperPlan(module._LAUNCHER.hopper_forward, base, q, k, "bhsd", None, 0.125,
                             {**hopper.HopperForward.KNOB_DEFAULTS, **module.CONFIG})
    assert plan.launch.grid == (20,)
    assert host.sm_count(torch.device("cpu")) == 1
    # a mask: tiles paired (CAUSAL on this grid) where the mask is causal-shaped, whatever the spec's causal
    monkeypatch.setattr(hopper, "sm_count", lambda device: 132)
    for mask, paired in (({"prefix_lm": 64}, True), ({"sliding_window": {"left": 40, "right": 30}}, False)):
        spec = AttentionSpec(dtype="fp16", head_dim=64, num_heads=4, mask=mask)
        module = flashgen.compile(spec, KernelConfig(**PERSISTENT)).module()
        plan = hopper.HopperPlan(module._LAUNCHER.hopper_forward, base, q, k, "bhsd", None, 0.125,
                                 {**hopper.HopperForward.KNOB_DEFAULTS, **module.CONFIG})
        units = 2 * 4 * (4 if paired else 8)
        assert plan.launch.grid == (units,) and plan.args[-3:] == (4, 8, units)
        assert plan.launch.constexprs["CAUSAL"] is paired


FORWARD_KNOBS = ("family", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "hopper_regs", "hopper_overlap",
                 "hopper_pingpong", "hopper_persistent", "hopper_tma_store")


@pytest.mark.parametrize("target", ["h100", "h200"])
@pytest.mark.parametrize("head_dim, width", [(40, 64), (56, 64), (72, 128), (80, 128), (96, 128), (112, 128),
                                             (160, 256), (192, 256), (224, 256)])
def test_padded_head_dims_take_their_widths_defaults(head_dim, width, target):
    # a head dim between the family's 64, 128 and 256 runs its padded width's forward (results/2026-11-29-h200-
    # padded-head-dims-s37.md: 1.13-3.07x the portable default); where that width keeps the portable family
    # (hd64 causal up to 2048 tokens off an H200, calls under 1024), the portable forward reads through descriptors
    # (zero-filled padding, not loads masked along the head dim: hd40 causal S=1024 1.83x), but for host-bound
    # calls (up to SMALL_CALL tokens), which build none
    from flashgen.config import SMALL_CALL

    for causal in (False, True):
        for seqlen in (256, 512, 1024, 2048, 4096, 16384, 65536):
            got = flashgen.default_config(AttentionSpec(dtype="bf16", head_dim=head_dim, num_heads=8, causal=causal),
                                          target, seqlen)
            wide = flashgen.default_config(AttentionSpec(dtype="bf16", head_dim=width, num_heads=8, causal=causal),
                                           target, seqlen)
            forward = wide
            if target == "h200" and width == 64 and causal and seqlen == 1024:
                # but on an H200, causal at 1024 tokens: hd128's Gluon knobs (config._hopper_ws_default's last
                # paragraph; hd64 itself keeps the portable forward at 1024)
                forward = flashgen.default_config(AttentionSpec(dtype="bf16", head_dim=128, num_heads=8, causal=True),
                                                  target, seqlen)
                assert got.family == "hopper_ws"
            if forward.family == "hopper_ws":
                assert [getattr(got, k) for k in FORWARD_KNOBS] == [getattr(forward, k) for k in FORWARD_KNOBS], \
                    (causal, seqlen)
            else:
                assert got.family == "portable" and got.tma == (seqlen > SMALL_CALL), (causal, seqlen, got)
            # the backward reads through descriptors too; the Gluon dK/dV (64- and 128-wide tiles) as at its width
            assert got.bwd_tma == (seqlen > SMALL_CALL), (causal, seqlen)
            assert (got.hopper_bwd, got.dq_strategy) == ((wide.hopper_bwd, wide.dq_strategy) if width <= 128 else
                                                         (False, "separate")), (causal, seqlen)
    # FP8 keeps the exact head dims (portable forward); fp32 and other GPUs are unchanged (no descriptors)
    for dtype, tgt in (("fp8_e4m3", target), ("fp32", target), ("bf16", "a100")):
        got = flashgen.default_config(AttentionSpec(dtype=dtype, head_dim=head_dim, num_heads=8), tgt, 4096)
        assert got.family == "portable", (dtype, tgt)
        if dtype != "fp8_e4m3":
            assert not got.tma and not got.bwd_tma, (dtype, tgt)


def test_padded_head_dims_are_served_up_to_the_widths_each_kernel_has():
    spec = AttentionSpec(dtype="bf16", head_dim=96, num_heads=8, causal=True)
    assert hopper.spec_unserved(spec) is None and hopper.spec_unserved(spec, backward=True) is None
    KernelConfig(hopper_bwd=True).check_spec(spec)
    # the Gluon dK/dV has no 256-wide tiles: 160 and 192 only forward
    wide = AttentionSpec(dtype="bf16", head_dim=192, num_heads=8)
    assert hopper.spec_unserved(wide) is None and "head_dim 192" in hopper.spec_unserved(wide, backward=True)
    with pytest.raises(ConfigError, match="'hopper_bwd'.*head_dim 192"):
        KernelConfig(hopper_bwd=True).check_spec(wide)
    # unequal head dims stay out, padded or not; so do mask patterns at padded head dims (neither measured nor
    # tested there), which the exact head dims take
    assert "head_dim_v 64" in hopper.spec_unserved(AttentionSpec(dtype="bf16", head_dim=96, head_dim_v=64))
    window = {"sliding_window": {"left": 512}}
    assert "head_dim 96" in hopper.spec_unserved(AttentionSpec(dtype="bf16", head_dim=96, mask=window))
    assert hopper.spec_unserved(AttentionSpec(dtype="bf16", head_dim=128, mask=window)) is None
    # a head dim the copy engine cannot read in 16-bit rows (not a multiple of 8) keeps the portable defaults whole
    odd = flashgen.default_config(AttentionSpec(dtype="bf16", head_dim=100, num_heads=8), "h100", 4096)
    assert odd.family == "portable" and odd == flashgen.default_config(
        AttentionSpec(dtype="bf16", head_dim=100, num_heads=8), "h100", 4096, hopper_ws=False)


def test_a_padded_head_dim_masks_the_pointer_store_only():
    # the columns past the head dim are left out of O's pointer store; the exact head dims' kernel text (and the
    # stored results' kernel hashes) keep their store; a TMA store is clipped by the copy engine, unmasked
    from flashgen.codegen.render import timed_source

    def spec(d):
        return AttentionSpec(dtype="bf16", head_dim=d, num_heads=8, num_kv_heads=2, causal=True)

    for knobs in (HOPPER, PERSISTENT):
        padded = timed_source(render(spec(96), KernelConfig(**knobs), standalone=False), "fwd")
        assert "mask=(o_rows < seqlen_q)[:, None] & (o_cols < 96)[None, :])" in padded
        exact = timed_source(render(spec(128), KernelConfig(**knobs), standalone=False), "fwd")
        assert "o_cols <" not in exact and "gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(o_rows < seqlen_q)" \
            "[:, None])" in exact
        # (the dense kernels': the packed kernels beside them store a sequence's last rows by pointers, masked past
        # the head dim)
        stored = timed_source(render(spec(96), KernelConfig(**knobs, hopper_tma_store=True)), "fwd")
        assert "o_cols <" not in stored and "tma_store(O," in stored


def test_a_padded_head_dim_masks_the_gluon_dkdv_stores():
    # dK's and dV's columns past the head dim are left out of their stores; the exact head dims' kernel text keeps
    # its stores (and the stored results' kernel hashes)
    from flashgen.codegen.render import timed_source

    def source(d):
        spec = AttentionSpec(dtype="bf16", head_dim=d, num_heads=8, num_kv_heads=2, causal=True)
        return timed_source(render(spec, KernelConfig(**HOPPER, hopper_bwd=True, dq_strategy="atomic"),
                                   standalone=False), "bwd")

    assert "ok = (out_keys < seqlen_k)[:, None] & (out_cols < 80)[None, :]" in source(80)
    exact = source(128)
    assert "out_cols <" not in exact and "ok = (out_keys < seqlen_k)[:, None]\n" in exact


@pytest.mark.interpreter
def test_a_padded_call_reads_its_widths_tiles(monkeypatch):
    # hd96: Q, K, V (and O's TMA store) through descriptors of 128-wide tiles over 96-wide rows (the copy engine
    # zero-fills the rest); the softmax scale is the head dim's own
    spec = AttentionSpec(dtype="fp16", head_dim=96, num_heads=4, num_kv_heads=2)
    module = flashgen.compile(spec, KernelConfig(**HOPPER, hopper_tma_store=True)).module()
    module._LAUNCHER.hopper_forward.device_unserved = lambda device: None
    made, launched = [], []

    class Descriptor:
        def __init__(self, t, layout, rows, cols):
            made.append((t.shape[-1], rows, cols))

    monkeypatch.setattr(hopper, "BoundLaunch", lambda kernel, grid, constexprs: lambda *args: launched.append(args))
    monkeypatch.setattr(module._LAUNCHER.hopper_forward, "descriptor", Descriptor)
    q, k, v = make_qkv(2, 4, 2, 45, 61, 96, dtype=torch.float16, device="cpu")
    module.forward(q, k, v)
    assert made == [(96, 64, 128), (96, HOPPER["BLOCK_N"], 128), (96, HOPPER["BLOCK_N"], 128), (96, 64, 128)]
    (args,) = launched
    assert args[-1] == pytest.approx(96 ** -0.5 * 1.4426950408889634)


def test_tma_store_knob_keeps_the_register_store_text_and_renders_the_copy():
    # off, the knob leaves the config's dict and every kernel's text (stored configs keep their ids);
    # on, O leaves through o_smem and a TMA store whose descriptor takes O's place, the previous store
    # waited before o_smem is written again and before the program ends (one-tile and persistent)
    from flashgen.codegen.render import timed_source

    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=8, num_kv_heads=2, causal=True)
    assert "hopper_tma_store" not in KernelConfig(**HOPPER).to_dict()
    on = KernelConfig(**HOPPER, hopper_tma_store=True)
    assert KernelConfig.from_dict(on.to_dict()).hopper_tma_store and "tma_store" in str(on)
    for knobs in (HOPPER, PERSISTENT):
        plain, stored = render(spec, KernelConfig(**knobs)), render(spec, KernelConfig(**knobs, hopper_tma_store=True))
        assert "o_smem" not in plain and "gl.store(o_ptrs" in plain
        # (the dense kernels store by TMA; the packed kernels beside them a sequence's last rows by pointers)
        assert "gl.store(o_ptrs" not in timed_source(stored, "fwd") and "gl.store(o_ptrs" in stored
        assert "def _attn_fwd_hopper_ws(QD, KD, VD, OD, O, LSE," in stored
        assert ("o_smem = gl.allocate_shared_memory(OD.dtype, [CONSUMERS, 1, 1, _HW_ROWS, HEAD_DIM], OD.layout)"
                in stored)
        epilogue = stored[stored.index("tma_store_wait(0)\n    warps_barrier()"):]
        order = [epilogue.index(text) for text in ("o_smem.reshape", "fence_async_shared()", "tma_store(O,")]
        assert order == sorted(order)
        consumer = stored[stored.index("def _hw_consumer" + ("_persistent" if knobs is PERSISTENT else "")):]
        consumer = consumer[:consumer.index("\n@gluon.jit")] if "\n@gluon.jit" in consumer else consumer
        last = ("the last tile's O has left shared memory before the program ends" if knobs is PERSISTENT else
                "O has left shared memory before the program ends")
        assert consumer.rstrip().endswith("tma_store_wait(0)  # " + last)


@pytest.mark.interpreter
def test_a_tma_store_call_passes_an_o_descriptor(monkeypatch):
    # the plan makes a fourth descriptor, of this call's out, in consumer rows; a caller's out that
    # the copy engine cannot take (a 16-byte rule) runs the portable forward
    spec = AttentionSpec(dtype="fp16", head_dim=64, num_heads=4, num_kv_heads=2, causal=True)
    module = flashgen.compile(spec, KernelConfig(**HOPPER, hopper_tma_store=True)).module()
    module._LAUNCHER.hopper_forward.device_unserved = lambda device: None
    launched = []

    class Descriptor:
        def __init__(self, t, layout, rows, cols):
            self.base, self.block = t, (rows, cols)

    monkeypatch.setattr(hopper, "BoundLaunch", lambda kernel, grid, constexprs: lambda *args: launched.append(args))
    monkeypatch.setattr(module._LAUNCHER.hopper_forward, "descriptor", Descriptor)
    q, k, v = make_qkv(2, 4, 2, 45, 61, 64, dtype=torch.float16, device="cpu")
    out, lse = module.forward(q, k, v)
    ((qd, kd, vd, od, o, l, *_),) = launched
    assert od.base is out and o is out and l is lse and od.block == (64, 64)
    assert (qd.base, kd.base, vd.base) == (q, k, v)
    odd = torch.empty(2, 4, 45, 68, dtype=torch.float16)[..., :64]  # 136-byte rows: not a 16-byte multiple
    plan = module._LAUNCHER.hopper_forward.plan
    assert plan(None, q, k, v, "bhsd", odd, 0.125, 0.0, module.CONFIG) is None


@pytest.mark.interpreter
@pytest.mark.parametrize("persistent", [False, True])
def test_a_packed_tma_store_call_passes_an_o_descriptor_over_every_token(monkeypatch, persistent):
    # a packed call on a TMA-store module: out's descriptor (its base out, (1, heads, tokens, dim), consumer rows
    # per store) beside the pointer (the sequences' last rows); a caller's out the copy engine cannot take runs the
    # portable forward
    monkeypatch.setattr(hopper.HopperForward, "PACKED_CAUSAL_MEAN", 0)
    monkeypatch.setattr(hopper.HopperForward, "PACKED_CAUSAL_MEAN_HD64", 0)
    spec = AttentionSpec(dtype="fp16", head_dim=64, num_heads=4, num_kv_heads=2, causal=True)
    module = flashgen.compile(spec, KernelConfig(**HOPPER, hopper_persistent=persistent,
                                                 hopper_tma_store=True)).module()
    module._LAUNCHER.hopper_forward.device_unserved = lambda device: None
    launched = []

    class Descriptor:
        def __init__(self, t, layout, rows, cols):
            self.base, self.layout, self.block = t, layout, (rows, cols)

    monkeypatch.setattr(hopper, "BoundLaunch", lambda kernel, grid, constexprs: (
        lambda *args: launched.append((kernel, args))))
    monkeypatch.setattr(module._LAUNCHER.hopper_forward, "descriptor", Descriptor)
    lengths = [100, 100] if persistent else [100, 37]  # (one length: the persistent packed kernel)
    q = torch.randn(sum(lengths), 4, 64, dtype=torch.float16)
    k, v = (torch.randn(sum(lengths), 2, 64, dtype=torch.float16) for _ in range(2))
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    out = torch.empty_like(q)
    module.forward(q, k, v, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=100, max_seqlen_k=100,
                   out=out)
    ((kernel, (qd, kd, vd, od, o, *_)),) = launched
    forward = module._LAUNCHER.hopper_forward
    assert kernel is (forward.packed_persistent if persistent else forward.packed)
    assert od.base is out and o is out and od.layout == "thd" and od.block == (64, 64)
    assert (qd.base, kd.base, vd.base) == (q, k, v)
    odd = torch.empty(sum(lengths), 4, 68, dtype=torch.float16)[..., :64]  # 136-byte rows: not a 16-byte multiple
    assert forward.plan(None, q, k, v, "thd", odd, 0.125, 0.0, module.CONFIG, varlen=(2, 100, 100)) is None


@pytest.mark.interpreter
@pytest.mark.parametrize("lengths, kernel", [([100, 37], "packed"), ([100, 100], "packed_persistent")])
def test_packed_sequences_of_unequal_length_take_the_one_tile_packed_kernel(monkeypatch, lengths, kernel):
    # on a persistent config: sequences of one length the persistent packed kernel, the rest the one-tile one (it
    # served no call in sessions 61-62, while it faulted on a GPU shared with other processes: see the next test)
    spec = AttentionSpec(dtype="fp16", head_dim=64, num_heads=4, num_kv_heads=2)
    module = flashgen.compile(spec, KernelConfig(**HOPPER, hopper_persistent=True, hopper_tma_store=True)).module()
    module._LAUNCHER.plans.clear()  # (the module is the other cases', with their call plans)
    forward = module._LAUNCHER.hopper_forward
    monkeypatch.setattr(forward, "device_unserved", lambda device: None)
    launched = []
    monkeypatch.setattr(hopper, "BoundLaunch", lambda kernel, grid, constexprs: (
        lambda *args: launched.append(kernel)))
    monkeypatch.setattr(forward, "descriptor", lambda t, layout, rows, cols: t)
    q = torch.randn(sum(lengths), 4, 64).half()
    k, v = (torch.randn(sum(lengths), 2, 64).half() for _ in range(2))
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    module.forward(q, k, v, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=100, max_seqlen_k=100)
    assert launched == [getattr(forward, kernel)]


def loaded_captures(source: str, kernel: str) -> set[str]:
    """The names in `kernel`'s gl.warp_specialize calls whose values its own body loaded from memory (a .load, or a
    call of a function of the module that loads), directly or through what was computed from them. Triton hands
    such values to the worker partitions through shared memory; kernel arguments and program ids it recomputes in
    each partition."""
    tree = ast.parse(source)
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}

    def loads(node, seen=()) -> bool:
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            if isinstance(call.func, ast.Attribute) and call.func.attr == "load":
                return True
            name = getattr(call.func, "id", None)
            if name in functions and name not in seen and loads(functions[name], (*seen, name)):
                return True
        return False

    loaded: set[str] = set()
    assignments = [n for n in ast.walk(functions[kernel]) if isinstance(n, (ast.Assign, ast.AugAssign))]
    while True:
        before = len(loaded)
        for node in assignments:
            if loads(node.value) or any(isinstance(n, ast.Name) and n.id in loaded for n in ast.walk(node.value)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    loaded |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        if len(loaded) == before:
            break
    return {n.id for call in ast.walk(functions[kernel]) if isinstance(call, ast.Call)
            and getattr(call.func, "attr", None) == "warp_specialize" for n in ast.walk(call.args[0])
            if isinstance(n, ast.Name) and n.id in loaded}


@pytest.mark.parametrize("knobs", [dict(hopper_overlap=True, hopper_tma_store=True), dict(hopper_pingpong=True),
                                   dict(BLOCK_M=192, hopper_regs=160, hopper_tma_store=True),
                                   dict(hopper_persistent=True, hopper_overlap=True, hopper_tma_store=True)])
@pytest.mark.parametrize("causal", [False, True])
def test_the_packed_kernels_partitions_read_their_sequence_bounds_themselves(knobs, causal):
    # The one-tile packed kernel's partitions took q_start, the bounds, the key blocks and O's and the LSE's offset
    # pointers from its default partition, which Triton (3.6 and 3.9) passes through a shared buffer, placed over the
    # initialized ping-pong barriers: on an H200 shared with other processes the kernel raised illegal memory
    # accesses in 3 of 3 processes, with each partition reading the bounds itself in 0 of 7
    # (results/2026-12-03-h200-packed-fault-s63.md). tests/sm90_compile.py checks the stores over barriers in the
    # compiled kernels; this, on the CPU in every run, that the packed and dense bf16 kernels hand no loaded value to
    # their partitions (the FP8 and masked one-tile kernels do: their descales and key ranges).
    spec = AttentionSpec(dtype="bf16", head_dim=64 if knobs.get("BLOCK_M") == 192 else 128, num_heads=4,
                         causal=causal)
    source = render(spec, KernelConfig(**{**HOPPER, **knobs}))
    kernels = ["_attn_fwd_hopper_ws_packed", "_attn_fwd_hopper_ws"] + (
        ["_attn_fwd_hopper_ws_packed_persistent"] if knobs.get("hopper_persistent") else [])
    assert {kernel: loaded_captures(source, kernel) for kernel in kernels} == {kernel: set() for kernel in kernels}
    # (the check itself: a value the kernel's body loads and hands to its partitions is found)
    mark = "    # (the sequence's bounds decide here"
    handed = source.replace(mark, "    O += gl.load(CU_SEQLENS_Q)\n" + mark, 1)
    assert loaded_captures(handed, "_attn_fwd_hopper_ws_packed") == {"O"}


@pytest.mark.parametrize("fields, packed", [(dict(dtype="bf16", head_dim=128, causal=True), True),
                                           (dict(dtype="fp16", head_dim=96), True),
                                           (dict(dtype="bf16", head_dim=256), False),
                                           (dict(dtype="bf16", head_dim=160), False),
                                           (dict(dtype="bf16", head_dim=128, mask={"sliding_window": {"left": 100}}),
                                            False),
                                           (dict(dtype="fp8_e4m3", head_dim=128, backward=False), False)])
@pytest.mark.parametrize("knobs", [{}, dict(hopper_persistent=True, hopper_overlap=True, hopper_tma_store=True)])
def test_the_packed_kernel_is_rendered_beside_the_dense_one_and_left_out_of_its_hash(fields, packed, knobs):
    # unmasked fp16/bf16 modules on 64- or 128-wide tiles carry _attn_fwd_hopper_ws_packed (packed sequences, one
    # tile per program, V's rows past a sequence zeroed at a consumer's last block:
    # _hw_consumer_packed), persistent ones _attn_fwd_hopper_ws_packed_persistent too; masks, FP8 and the
    # 256-wide tiles (hd160-256) keep the portable forward for packed calls. The tuner times dense calls: the packed
    # kernel is not in the forward's timed source, whose text is the dense kernels' alone
    from flashgen.codegen.render import timed_source

    spec = AttentionSpec(num_heads=4, **fields)
    # (hd256's 16-bit tiles: 64-key blocks, O's TMA store tiles beside one consumer only)
    tiles = dict(BLOCK_N=64, BLOCK_M=64 if knobs else 128) if spec.head_dim > 128 else {}
    source = render(spec, KernelConfig(**{**HOPPER, **knobs, **tiles}), standalone=False)
    assert ("packed=_attn_fwd_hopper_ws_packed" in source) == packed
    assert ("def _hw_consumer_packed(" in source) == packed and ("def _hw_pv_packed(" in source) == packed
    # a persistent module's: the persistent packed kernel too (sequences of one length)
    assert ("packed_persistent=_attn_fwd_hopper_ws_packed_persistent" in source) == (packed and bool(knobs))
    assert ("def _hw_consumer_persistent_packed(" in source) == (packed and bool(knobs))
    timed = timed_source(source, "fwd")
    assert "_attn_fwd_hopper_ws(" in timed and "_packed" not in timed
    assert "_hw_seq_bounds" not in timed


@pytest.mark.parametrize("persistent", [False, True])
def test_the_packed_kernels_store_whole_tiles_by_tma_and_a_sequences_last_rows_by_pointers(persistent):
    # with hopper_tma_store, a packed consumer's 64 rows leave through o_smem and the TMA store when they all lie in
    # its sequence (at the sequence's row q_start + row0 of the descriptor over every token), by masked pointer
    # stores when they reach past it (the rest are the next sequence's rows); without it, by pointers alone
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=4, causal=True)
    name = "_hw_consumer_persistent_packed(" if persistent else "_hw_consumer_packed("
    for tma_store in (False, True):
        source = render(spec, KernelConfig(**HOPPER, hopper_persistent=persistent, hopper_tma_store=tma_store),
                        standalone=False)
        consumer = source[source.index("def " + name):]
        consumer = consumer[:consumer.index("\n\n\n")]
        kernel = "_attn_fwd_hopper_ws_packed" + ("_persistent" if persistent else "")
        assert (f"def {kernel}(QD, KD, VD, OD, O, LSE," in source) == tma_store
        assert "gl.store(o_ptrs, out.to(" in consumer and ("mask=(o_rows < seqlen_q)[:, None])" in consumer)
        if not tma_store:
            assert "tma_store(" not in consumer and "o_smem" not in consumer
            continue
        branch = consumer[consumer.index("if row0 + _HW_ROWS <= seqlen_q:"):]
        order = [branch.index(text) for text in (
            "tma_store_wait(0)", "o_smem.reshape", "fence_async_shared()",
            "tma_store(OD, [0, off_h.to(gl.int32), (q_start + row0).to(gl.int32), 0], o_smem)", "else:",
            "gl.store(o_ptrs")]
        assert order == sorted(order)
        assert consumer.rstrip().endswith("before the program ends")  # the last store waited for


def test_only_packed_sequences_of_one_length_take_the_persistent_packed_kernel():
    # (measured: benchmarks/results/2026-11-30-h200-packed-s40-persistent.md) the persistent grid's static walk gave
    # unequal lengths 0.68-0.92x the one-tile grid: their tokens are not sequences x the longest lengths
    equal = hopper.HopperForward.equal_lengths
    assert equal((4, 1024, 1024), 4096, 4096)
    assert equal((2, 300, 513), 600, 1026)  # keys longer than queries, one length each
    assert not equal((4, 1024, 1024), 4000, 4096)  # a shorter query sequence
    assert not equal((4, 1024, 1024), 4096, 4095)
    assert not equal((4, 1024, 2048), 4096, 4096)  # max_seqlen_k past every key sequence


def test_packed_calls_the_portable_forward_serves_faster_are_declined():
    # (measured: benchmarks/results/2026-11-29-h200-packed-s39-rule.md) three consumers over sequences averaging
    # under 2048 tokens; causal sequences averaging under 1024 tokens, under 2048 at head dim 64 itself (-s46.md)
    two, three = dict(BLOCK_M=128), dict(BLOCK_M=192)
    causal = hopper.HopperForward(None, dict(causal=True, dtype="bf16", head_dim=128, head_dim_v=128, mask=None,
                                             score_mod=None, dropout_p=0.0, target="auto"), {})
    plain = hopper.HopperForward(None, dict(causal=False, dtype="bf16", head_dim=64, head_dim_v=64, mask=None,
                                            score_mod=None, dropout_p=0.0, target="auto"), {})
    assert plain.packed_declines(three, (16, 1024, 1024), 16384)
    assert plain.packed_declines(three, (13, 2048, 2048), 16384)  # 1260 tokens on average
    assert not plain.packed_declines(three, (8, 2048, 2048), 16384)
    assert not plain.packed_declines(three, (4, 4096, 4096), 16384)
    assert not plain.packed_declines(two, (26, 1024, 1024), 16384)
    assert causal.packed_declines(two, (26, 1024, 1024), 16384)  # 630 tokens on average
    assert not causal.packed_declines(two, (16, 1024, 1024), 16384)
    assert not causal.packed_declines(two, (8, 4096, 4096), 16384)
    for d, declined in ((64, True), (40, False), (128, False)):  # 1260 tokens on average
        spec = dict(causal=True, dtype="bf16", head_dim=d, head_dim_v=d, mask=None, score_mod=None, dropout_p=0.0,
                    target="auto")
        assert hopper.HopperForward(None, spec, {}).packed_declines(two, (13, 2048, 2048), 16384) == declined, d
    hd64 = hopper.HopperForward(None, dict(causal=True, dtype="bf16", head_dim=64, head_dim_v=64, mask=None,
                                           score_mod=None, dropout_p=0.0, target="auto"), {})
    assert not hd64.packed_declines(two, (8, 2048, 2048), 16384)  # sequences of 2048 tokens
