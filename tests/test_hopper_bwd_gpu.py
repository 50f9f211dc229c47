"""The Gluon dK/dV kernel (config knob hopper_bwd) on an sm90 GPU: dQ, dK, dV against the reference
on fresh random inputs (TESTING.md's 3x rule for gradients), lengths that are not multiples of
the tiles, seqlen_q != seqlen_k both ways, GQA, both dense layouts, causal or not, under the
portable forward and under the Gluon forward (family hopper_ws), through module.backward and
through flashgen.attention's autograd; and each of the kernel's tiles per head dim. Each with dQ
from the separate kernel and (dq_strategy 'atomic') added from this one."""

import pytest
import torch

import flashgen
from flashgen import AttentionSpec, KernelConfig, default_config
from flashgen.runtime.hopper_bwd import HopperBackward, HopperDkdv
from flashgen.runtime.launch import BackwardPlan
from flashgen.verify import assert_gradients_close

from .helpers import make_qkv, portable_config, sm90

pytestmark = pytest.mark.gpu

SHAPES = [  # batch, heads, kv heads, seqlen_q, seqlen_k, head dim, layout
    (2, 8, 2, 1000, 1000, 128, "bhsd"),
    (1, 4, 4, 333, 777, 64, "bshd"),
    (2, 6, 2, 777, 301, 128, "bshd"),
    (1, 8, 1, 17, 4097, 64, "bhsd"),
    (2, 4, 2, 4097, 129, 64, "bshd"),
]


@pytest.fixture(autouse=True)
def short_keys_served(monkeypatch):
    """The kernel on every call shape here, short keys included (HopperBackward.short_keys declines calls of
    fewer keys than queries whose programs leave SMs idle: these tests' small batches)."""
    monkeypatch.setattr(HopperBackward, "min_programs", staticmethod(lambda device: 0))


def took_gluon_dkdv(module, atomic=False) -> bool:
    """A backward plan of module ran the Gluon dK/dV kernel (atomic: and it added dQ: no dQ kernel)."""
    return any(isinstance(plan, BackwardPlan) and isinstance(plan.dkdv, HopperDkdv)
               and plan.atomic == atomic and (plan.dq is None) == atomic
               for plan in module._LAUNCHER.plans.values())


def check_backward(dtype, shape, causal, config_knobs, *, autograd=False):
    batch, heads, kv_heads, sq, sk, d, layout = shape
    spec = AttentionSpec(dtype=dtype, head_dim=d, num_heads=heads, num_kv_heads=kv_heads, causal=causal,
                         backward=True)
    # bwd_short (the one-launch backward, the default for calls of up to 512 tokens) would take the whole
    # backward and leave the Gluon dK/dV kernel nothing to do: off here, where that kernel is under test
    # (family "portable" starts from the portable family's forward default: the Gluon one's knobs are its own)
    base = default_config(spec, "h100", sq, hopper_ws=config_knobs.get("family") != "portable")
    config = base.replace(bwd_short=False, **config_knobs)
    module = flashgen.compile(spec, config).module()
    q, k, v = make_qkv(batch, heads, kv_heads, sq, sk, d, dtype=spec.torch_dtype, device="cuda", layout=layout)
    out, lse = module.forward(q, k, v, layout=layout)
    do = torch.randn_like(out)
    grads = module.backward(do, q, k, v, out, lse, layout=layout)[:3]
    assert took_gluon_dkdv(module, atomic=config.dq_strategy == "atomic")
    # gradients: 3x the same-precision reference's error + its rounding (TESTING.md)
    assert_gradients_close(grads, q, k, v, do, causal=causal, layout=layout)
    if autograd:  # flashgen.attention's autograd op: training_forward, then training_backward on its plan
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        flashgen.attention(*leaves, causal=causal, layout=layout, config=config).backward(do)
        assert_gradients_close(tuple(t.grad for t in leaves), q, k, v, do, causal=causal, layout=layout)


@sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_gradients(dtype, shape, causal):
    check_backward(dtype, shape, causal, dict(family="portable", tma=False, warp_specialize=False, hopper_bwd=True))


@sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_gradients_atomic_dq(shape, causal):
    # dQ added from the Gluon dK/dV kernel (each consumer's share of the columns per MMA, its float32
    # tile added by the copy engine)
    check_backward("bf16", shape, causal, dict(family="portable", tma=False, warp_specialize=False, hopper_bwd=True,
                                               dq_strategy="atomic"))


@sm90
def test_gradients_atomic_dq_fp16():
    check_backward("fp16", SHAPES[0], True, dict(family="portable", tma=False, warp_specialize=False,
                                                 hopper_bwd=True, dq_strategy="atomic"))


PADDED_SHAPES = [  # head dims under their tiles' width (40 -> 64, 80 and 96 -> 128): ragged, GQA, both layouts
    (2, 8, 2, 1000, 1000, 96, "bhsd"),
    (1, 4, 4, 333, 777, 40, "bshd"),
    (2, 6, 2, 777, 301, 80, "bshd"),
    (1, 4, 1, 4097, 129, 40, "bhsd"),
]


@sm90
@pytest.mark.parametrize("dq_strategy", ["separate", "atomic"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", PADDED_SHAPES)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_padded_head_dims(dtype, shape, causal, dq_strategy):
    # Q, K, V and dO zero-filled past the head dim by the copy engine, dK and dV stored without those columns,
    # dQ's tiles past them dropped by its reduce (atomic): each gradient checked whole, under the Gluon forward
    # at its padded width (and flashgen.attention's autograd) and under the portable one
    family = dict(family="hopper_ws", BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2) if shape[0] == 2 else \
        dict(family="portable")
    check_backward(dtype, shape, causal, dict(family, tma=False, warp_specialize=False, hopper_bwd=True,
                                              dq_strategy=dq_strategy), autograd=shape[0] == 2)


@sm90
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(100, 333), (333, 200)])
@pytest.mark.parametrize("causal", [False, True])
def test_atomic_dq_padding_keys_add_nothing(causal, seqlen_q, seqlen_k):
    # Keys past seqlen_k (the last key block's, zero-filled) have S = 0 where every real score is very
    # negative: P there is exp(-LSE), far past fp16's range. Their dS must not reach dQ (inf x K's 0 = NaN).
    # (Non-causal: masked by their own test; causal: by the diagonal's.)
    spec = AttentionSpec(dtype="fp16", head_dim=64, num_heads=2, causal=causal, backward=True)
    config = portable_config(spec, 333, hopper_bwd=True, dq_strategy="atomic")
    module = flashgen.compile(spec, config).module()
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = (1 + 0.1 * torch.randn(1, 2, seqlen_k, 64, device="cuda", generator=gen)).half()  # every q.k about -256
    q = (-4 + 0.1 * torch.randn(1, 2, seqlen_q, 64, device="cuda", generator=gen)).half()
    v = torch.randn(1, 2, seqlen_k, 64, device="cuda", generator=gen).half()
    out, lse = module.forward(q, k, v)
    assert float(lse[lse > float("-inf")].max()) < -11  # exp(-LSE) overflows fp16 (rows that see no key: -inf)
    do = torch.randn_like(out)
    grads = module.backward(do, q, k, v, out, lse)[:3]
    assert took_gluon_dkdv(module, atomic=True)
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    assert_gradients_close(grads, q, k, v, do, causal=causal)


@sm90
@pytest.mark.parametrize("dq_strategy", ["separate", "atomic"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_under_the_gluon_forward_and_autograd(shape, causal, dq_strategy):
    check_backward("bf16", shape, causal, dict(family="hopper_ws", BLOCK_M=128, BLOCK_N=128, num_warps=4,
                                               num_stages=2, tma=False, warp_specialize=False, hopper_bwd=True,
                                               dq_strategy=dq_strategy),
                   autograd=True)


@sm90
@pytest.mark.parametrize("shape, tiles", [
    (SHAPES[1], (64, 2, 3)), (SHAPES[1], (64, 1, 2)), (SHAPES[1], (128, 2, 2)), (SHAPES[2], (64, 2, 3)),
])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dq_strategy", ["separate", "atomic"])
def test_each_tile(monkeypatch, shape, tiles, causal, dq_strategy):
    # the kernel's tiles are class data (HopperBackward.TILES, per head dim): each choice stays exact
    monkeypatch.setitem(HopperBackward.TILES, shape[5], tiles)
    check_backward("bf16", shape, causal, dict(family="portable", tma=False, warp_specialize=False, hopper_bwd=True,
                                               dq_strategy=dq_strategy))


@sm90
def test_unserved_calls_run_the_portable_dkdv():
    spec = AttentionSpec(dtype="bf16", head_dim=64, num_heads=4, causal=True, backward=True)
    module = flashgen.compile(spec, KernelConfig(hopper_bwd=True)).module()
    q, k, v = make_qkv(1, 4, 4, 300, 300, 64, dtype=torch.bfloat16, device="cuda")
    out, lse = module.forward(q, k, v)
    do = torch.randn_like(out)
    grads = module.backward(do, q, k, v, out, lse, dq_strategy="atomic")[:3]  # atomic dQ: not served
    assert not took_gluon_dkdv(module) and not took_gluon_dkdv(module, atomic=True)
    assert_gradients_close(grads, q, k, v, do, causal=True)
    # and the other way: a kernel rendered to add dQ, called deterministic (separate dQ kernel)
    module = flashgen.compile(spec, KernelConfig(hopper_bwd=True, dq_strategy="atomic")).module()
    out, lse = module.forward(q, k, v)
    grads = module.backward(do, q, k, v, out, lse, deterministic=True)[:3]
    assert not took_gluon_dkdv(module) and not took_gluon_dkdv(module, atomic=True)
    assert_gradients_close(grads, q, k, v, do, causal=True)


@sm90
@pytest.mark.parametrize("head_dim, dq_strategy, mask", [(128, "atomic", None), (64, "atomic", None),
                                                         (128, "atomic", {"prefix_lm": 512})])
def test_default_takes_it_where_it_is_the_default(head_dim, dq_strategy, mask):
    # at 16384 tokens (config._hopper_bwd_default): causal hd128 and hd64 and prefix-LM hd128 adding dQ
    # from it; two heads: the float32 reference fits
    spec = AttentionSpec(dtype="bf16", head_dim=head_dim, num_heads=2, causal=mask is None, mask=mask, backward=True)
    kernel = flashgen.compile(spec)
    config = kernel.config_for(16384)
    assert config == default_config(spec, "h100", 16384) and config.hopper_bwd
    assert config.dq_strategy == dq_strategy
    module = kernel.module(config)
    q, k, v = make_qkv(1, 2, 2, 16384, 16384, head_dim, dtype=torch.bfloat16, device="cuda")
    out, lse = module.forward(q, k, v)
    do = torch.randn_like(out)
    grads = module.backward(do, q, k, v, out, lse)[:3]
    assert took_gluon_dkdv(module, atomic=dq_strategy == "atomic")
    assert_gradients_close(grads, q, k, v, do, causal=mask is None, mask=mask)


@sm90
@pytest.mark.parametrize("head_dim", [40, 64, 128])
def test_cross_attention_over_short_keys_takes_the_portable_kernels(monkeypatch, head_dim):
    # diffusion's cross-attention (4096 latents over 77 text tokens, 8 heads, batch 8): 64 programs of the Gluon
    # kernel, each walking every query block; the default's atomic dQ there runs the portable kernels with the
    # separate dQ kernel instead, and a call with as many keys as queries still takes the Gluon kernel
    from flashgen.runtime.host import sm_count

    monkeypatch.setattr(HopperBackward, "min_programs", staticmethod(sm_count))
    spec = AttentionSpec(dtype="bf16", head_dim=head_dim, num_heads=8, backward=True)
    config = default_config(spec, None, 4096)
    assert config.hopper_bwd and config.dq_strategy == "atomic", config
    module = flashgen.compile(spec, config).module()
    for seqlen_k, served in ((77, False), (4096, True)):
        q, k, v = make_qkv(2 if served else 8, 8, 8, 4096, seqlen_k, head_dim, dtype=torch.bfloat16, device="cuda")
        module._LAUNCHER.plans.clear()
        out, lse = module.forward(q, k, v)
        do = torch.randn_like(out)
        grads = module.backward(do, q, k, v, out, lse)[:3]
        assert took_gluon_dkdv(module, atomic=True) is served
        assert served or any(isinstance(p, BackwardPlan) and not p.atomic and p.dq is not None
                             for p in module._LAUNCHER.plans.values())
        if not served:  # (the float32 reference of the 4096-key call is large: its kernel is the tests' above)
            assert_gradients_close(grads, q, k, v, do, causal=False)
