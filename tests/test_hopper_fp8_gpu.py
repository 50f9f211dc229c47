"""The Hopper warp-specialized forward (config family hopper_ws) on FP8 e4m3 inputs, on an sm90 GPU:
FlashAttention-3's accuracy rule (tests/test_fp8.py's reference: float32 on the dequantized inputs,
the same-precision reference with FP8 P and the tensor cores' FP8 products) on fresh random inputs
and on outlier channels, causal and not, GQA, both layouts, lengths that are not multiples of the
tiles, seqlen_q != seqlen_k both ways; the portable FP8 forward for calls it cannot serve; and the
default path where the family is the FP8 default."""

import pytest
import torch

import flashgen
from flashgen import AttentionSpec, KernelConfig, default_config
from flashgen.runtime.hopper import HopperPlan
from flashgen.verify import assert_attention_close

from .helpers import sm90
from .test_fp8 import quantized_inputs

pytestmark = pytest.mark.gpu

BASE = dict(family="hopper_ws", BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2)
SHAPES = [  # batch, heads, kv heads, seqlen_q, seqlen_k (a multiple of 16: V^T's strides), head dim, layout
    (2, 8, 2, 1000, 1008, 128, "bhsd"),
    (2, 6, 2, 333, 784, 128, "bshd"),
    (1, 8, 1, 17, 4096, 64, "bhsd"),
    (1, 4, 4, 1111, 400, 64, "bshd"),
    (2, 4, 2, 777, 1008, 256, "bhsd"),
]
TILES = {64: {}, 128: dict(BLOCK_N=256), 256: dict(BLOCK_N=64)}  # the FP8 defaults' key blocks at 16384 tokens (config.py)


def took_hopper_path(module) -> bool:
    return any(isinstance(plan, HopperPlan) for plan in module._LAUNCHER.plans.values())


def inputs(shape, *, outliers=False, seed=0):
    """FP8 q, k, v in the shape's layout (V as a user passes it: dim-contiguous; the launcher makes
    the seq-contiguous copy) and their (batch, KV head) descales."""
    batch, heads, kv_heads, sq, sk, d, layout = shape
    q, k, v, qd, kd, vd = quantized_inputs(batch, heads, kv_heads, sq, sk, d, device="cuda", outliers=outliers,
                                           seed=seed)
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return q, k, v, qd, kd, vd


def check(shape, causal, knobs, *, served=True, outliers=False):
    batch, heads, kv_heads, sq, sk, d, layout = shape
    spec = AttentionSpec(dtype="fp8_e4m3", head_dim=d, num_heads=heads, num_kv_heads=kv_heads, causal=causal)
    module = flashgen.compile(spec, KernelConfig(**{**BASE, **TILES[d], **knobs})).module()
    module._LAUNCHER.plans.clear()  # a persistent plan made by another case fixed its grid with its program count
    q, k, v, qd, kd, vd = inputs(shape, outliers=outliers)
    o_shape = (batch, heads, sq, d) if layout == "bhsd" else (batch, sq, heads, d)
    out = torch.full(o_shape, float("nan"), dtype=torch.bfloat16, device="cuda")  # poisoned: every element written
    lse = torch.full((batch, heads, sq), float("nan"), device="cuda")
    module.forward(q, k, v, layout=layout, out=out, lse=lse, q_descale=qd, k_descale=kd, v_descale=vd)
    assert took_hopper_path(module) == served
    # FlashAttention-3's rule: out within 2x the same-precision reference's error, LSE within 3x
    assert_attention_close(out, lse, q, k, v, causal=causal, layout=layout, descales=(qd, kd, vd))
    # deterministic: the same call gives the same bits
    again, lse2 = module.forward(q, k, v, layout=layout, q_descale=qd, k_descale=kd, v_descale=vd)
    assert torch.equal(again, out) and torch.equal(lse2, lse)


@sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}/{s[2]}x{s[3]}x{s[4]}xd{s[5]}{s[6]}")
def test_forward(shape, causal):
    check(shape, causal, {})


@sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[4]], ids=["hd128", "hd256"])
def test_outlier_channels(shape, causal):
    check(shape, causal, {}, outliers=True)


@sm90
@pytest.mark.parametrize("knobs", [dict(BLOCK_N=128), dict(hopper_pingpong=True), dict(BLOCK_N=128, num_stages=3),
                                   dict(BLOCK_N=64, num_stages=4), dict(BLOCK_M=64, num_stages=3),
                                   dict(hopper_persistent=True), dict(BLOCK_M=64, num_stages=3, hopper_persistent=True),
                                   dict(hopper_overlap=True), dict(BLOCK_N=128, hopper_persistent=True, hopper_overlap=True),
                                   dict(BLOCK_N=128, hopper_persistent=True, hopper_pingpong=True),
                                   dict(hopper_tma_store=True), dict(hopper_persistent=True, hopper_tma_store=True)],
                         ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_each_technique(knobs, causal):
    check(SHAPES[1], causal, knobs)


@sm90
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("programs", [1, 7, 1000])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[4]], ids=["hd128-gqa", "hd64-gqa", "hd256"])
def test_persistent_programs_walk_many_units(monkeypatch, shape, causal, programs, overlap):
    # hopper_persistent on FP8 with the grid cut to `programs` programs: each walks many work units
    # (1000: more programs than units), and each tile takes its own (batch, KV head) descales
    from flashgen.runtime import hopper

    monkeypatch.setattr(hopper, "sm_count", lambda device: programs)
    check(shape, causal, dict(hopper_persistent=True, hopper_overlap=overlap))


@sm90
def test_keys_not_a_multiple_of_16_run_the_portable_fp8_forward():
    # V^T's dim stride is seqlen_k bytes: 1000 keys break the copy engine's 16-byte rule
    check((1, 4, 2, 500, 1000, 128, "bhsd"), True, {}, served=False)


@sm90
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", [4096, 16384])
def test_default_path(head_dim, causal, seqlen):
    # flashgen.attention with no config: the bucket's default, the family where it is the FP8 default;
    # one head: the float32 references of a 16384-token call are 1 GiB each (run 2 with -n 8 ran out of memory)
    spec = AttentionSpec(dtype="fp8_e4m3", head_dim=head_dim, num_heads=1, causal=causal)
    config = default_config(spec, "h100", seqlen)
    kernel = flashgen.compile(spec)
    assert kernel.config_for(seqlen) == config
    q, k, v, qd, kd, vd = quantized_inputs(1, 1, 1, seqlen, seqlen, head_dim, device="cuda", seed=1)
    module = kernel.module(config)
    out, lse = module.forward(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    assert took_hopper_path(module) == (config.family == "hopper_ws")
    assert_attention_close(out, lse, q, k, v, causal=causal, descales=(qd, kd, vd))
    user = flashgen.attention(q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    assert torch.equal(user, out)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs an sm89+ GPU (FP8)")
@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_e5m2_runs_the_portable_forward(head_dim, causal, outliers):
    # e5m2 keeps the portable FP8 forward (runtime/hopper.py): the default call, FlashAttention-3's rule
    # against a same-precision reference on the tensor cores (verify.fp8_matmul: _scaled_mm takes no
    # e5m2 pair, so b goes to e4m3 times a power of two)
    spec = AttentionSpec(dtype="fp8_e5m2", head_dim=head_dim, num_heads=4, num_kv_heads=2, causal=causal)
    kernel = flashgen.compile(spec)
    q, k, v, qd, kd, vd = quantized_inputs(2, 4, 2, 333, 784, head_dim, dtype="fp8_e5m2", device="cuda",
                                           outliers=outliers, seed=3)
    assert q.dtype == torch.float8_e5m2
    module = kernel.module(kernel.config_for(784))
    out, lse = module.forward(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    assert not took_hopper_path(module)
    assert_attention_close(out, lse, q, k, v, causal=causal, descales=(qd, kd, vd))
    user = flashgen.attention(q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    assert torch.equal(user, out)
