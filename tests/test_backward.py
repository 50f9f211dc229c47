"""The backward kernels against the reference's gradients (3x rule of ../shared/TESTING.md),
dropout, and the registered custom ops (autograd, torch.compile without graph breaks).

On a machine without a GPU this runs through Triton's interpreter in fp16 and fp32; on a
GPU the same tests run on the device."""

import random

import pytest
import torch

import flashgen
from flashgen import AttentionSpec, KernelConfig
from flashgen.verify import assert_attention_close, assert_gradients_close

from .helpers import half_fractions, make_qkv

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
SEQLENS = [(17, 17), (40, 70), (70, 40), (1, 33), (65, 65), (1, 1)]
HEAD_DIMS = [(16, 16), (40, 40), (64, 48), (96, 96)]
HEADS = [(4, 4), (8, 2), (6, 1)]
BLOCKS = [(16, 32, 32, 16), (32, 16, 16, 32), (16, 16, 16, 16)]  # (M1, N1, M2, N2)


def _cases():
    # Every sequence-length pair with half of (dQ strategy x causal x dtype) (helpers.half_fractions:
    # every two of them meet in all four combinations); the other axes rotate through the cases.
    cases = []
    for n, (m, seqlens, strategy, causal, dtype) in enumerate(
            half_fractions([["separate", "atomic"], [False, True], ["fp16", "fp32"]], SEQLENS)):
        hd, heads, blocks = HEAD_DIMS[(n + m) % len(HEAD_DIMS)], HEADS[n % len(HEADS)], BLOCKS[(n + m) % len(BLOCKS)]
        layout = ["bhsd", "bshd"][(n // 2 + m) % 2]
        cases.append(pytest.param(strategy, causal, dtype, seqlens, hd, heads, layout, blocks,
                                  id=f"{strategy}-{'causal' if causal else 'full'}-{dtype}-sq{seqlens[0]}-"
                                     f"sk{seqlens[1]}-d{hd[0]}-h{heads[0]}kv{heads[1]}-{layout}"))
    return cases


def run_backward_check(device, *, strategy, causal, dtype, seqlens, head_dims, heads, layout, blocks,
                       batch=2, deterministic=False, warps=4, stages=1, **hopper):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    (seqlen_q, seqlen_k), (d, dv), (h, hk) = seqlens, head_dims, heads
    q, k, v = make_qkv(batch, h, hk, seqlen_q, seqlen_k, d, dv, dtype=DTYPES[dtype], device=device, layout=layout,
                       generator=gen)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    m1, n1, m2, n2 = blocks
    config = KernelConfig(BLOCK_M=16, BLOCK_N=16, num_stages=1, BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=m2,
                          BLOCK_N2=n2, bwd_num_warps=warps, bwd_num_stages=stages, dq_strategy=strategy, **hopper)
    out, lse = flashgen.attention(q, k, v, causal=causal, layout=layout, config=config, return_lse=True,
                                  deterministic=deterministic)
    do = torch.randn(out.shape, generator=gen).to(device=device, dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), do)
    try:
        assert_attention_close(out, lse, q, k, v, causal=causal, layout=layout)
        assert_gradients_close(grads, q, k, v, do, causal=causal, layout=layout)
    except AssertionError as err:
        raise AssertionError(f"seed {seed}: {err}") from None
    return grads


@pytest.mark.parametrize("strategy,causal,dtype,seqlens,head_dims,heads,layout,blocks", _cases())
def test_gradients_match_reference(device, strategy, causal, dtype, seqlens, head_dims, heads, layout, blocks):
    run_backward_check(device, strategy=strategy, causal=causal, dtype=dtype, seqlens=seqlens,
                       head_dims=head_dims, heads=heads, layout=layout, blocks=blocks)


@pytest.mark.parametrize("strategy", ["separate", "atomic"])
@pytest.mark.parametrize("causal,seqlens,head_dims,heads,layout", [
    (True, (40, 70), (64, 64), (4, 2), "bshd"),   # ragged tiles, GQA
    (False, (70, 33), (40, 40), (2, 1), "bhsd"),  # padded head dim
])
def test_backward_tensor_descriptors(device, strategy, causal, seqlens, head_dims, heads, layout):
    # bwd_tma: Q/dO tiles of the dK/dV kernel and K/V tiles of the dQ kernel through descriptors.
    run_backward_check(device, strategy=strategy, causal=causal, dtype="fp16", seqlens=seqlens, head_dims=head_dims,
                       heads=heads, layout=layout, blocks=(16, 32, 32, 16), bwd_tma=True)


def test_rows_that_see_no_key_get_zero_gradient(device):
    # seqlen_q > seqlen_k, causal: the first 25 rows see no key; their dq must be exactly 0.
    dq, dk, dv = run_backward_check(device, strategy="atomic", causal=True, dtype="fp32", seqlens=(33, 8),
                                    head_dims=(16, 16), heads=(2, 2), layout="bhsd", blocks=(16, 16, 16, 16))
    assert torch.all(dq[:, :, :25] == 0)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


@pytest.mark.parametrize("knobs", [{}, {"bwd_short": False, "dq_strategy": "separate"},
                                   {"bwd_short": False, "dq_strategy": "atomic"}], ids=["default", "separate", "atomic"])
def test_a_modifier_past_exp_range_on_padding_rows_keeps_gradients_finite(device, knobs):
    # Rows past seqlen_q in the last query block load Q = 0: a modifier that takes their score past exp's range
    # (+100 from a tensor) made P inf there, and inf * dO's 0 NaN dK/dV (a review's catch). A constant shift leaves
    # softmax, so outputs and gradients are plain attention's.
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen).to(device).requires_grad_() for n in (12, 40, 40))
    do = torch.randn(1, 2, 12, 16, generator=gen).to(device)
    spec = AttentionSpec(dtype="fp32", head_dim=16, num_heads=2, score_mod="score + shift[kv_idx]", backward=True)
    kernel = flashgen.compile(spec, KernelConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_M1=16, BLOCK_N1=16, BLOCK_M2=16,
                                                 BLOCK_N2=16, num_stages=1, bwd_num_stages=1, **knobs))
    out = kernel(q, k, v, shift=torch.full((40,), 100.0, device=device))
    got = torch.autograd.grad(out, (q, k, v), do)
    want = torch.autograd.grad(flashgen.attention(q, k, v), (q, k, v), do)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=name)


def test_deterministic_flag_overrides_atomic(device):
    # deterministic=True must use the separate dQ kernel even when the config says atomic:
    # the same inputs then give bitwise-equal gradients.
    torch.manual_seed(random.randrange(2**31))
    spec = AttentionSpec(dtype="fp32", head_dim=32, num_heads=2, causal=True, backward=True)
    kernel = flashgen.compile(spec, KernelConfig(BLOCK_M=16, BLOCK_N=16, num_stages=1, BLOCK_M1=16, BLOCK_N1=16,
                                                 BLOCK_M2=16, BLOCK_N2=16, bwd_num_stages=1, dq_strategy="atomic"))
    q, k, v = (torch.randn(1, 2, 37, 32, device=device, requires_grad=True) for _ in range(3))
    do = torch.randn(1, 2, 37, 32, device=device)
    runs = [torch.autograd.grad(kernel(q, k, v, deterministic=True), (q, k, v), do) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# ---------------------------------------------------------------------------- dropout
def _dropout_kernel(device, p=0.3, causal=False):
    spec = AttentionSpec(dtype="fp32", head_dim=32, num_heads=4, num_kv_heads=2, causal=causal, dropout_p=p,
                         backward=True)
    return flashgen.compile(spec, KernelConfig(BLOCK_M=16, BLOCK_N=32, num_stages=1, BLOCK_M1=16, BLOCK_N1=32,
                                               BLOCK_M2=32, BLOCK_N2=16, bwd_num_stages=1))


def test_dropout_keep_rate_and_seeds(device):
    kernel = _dropout_kernel(device, p=0.3)
    mod = kernel.module()
    seed = torch.tensor([random.randrange(2**62)], dtype=torch.int64, device=device)
    keep = mod.dropout_keep_mask(2, 96, 130, seed, 0.3)
    assert keep.shape == (2, 4, 96, 130)
    rate = keep.float().mean().item()
    assert abs(rate - 0.7) < 0.01, rate  # ~100k draws: std 0.0014
    assert torch.equal(keep, mod.dropout_keep_mask(2, 96, 130, seed.clone(), 0.3))
    other = mod.dropout_keep_mask(2, 96, 130, seed + 1, 0.3)
    assert not torch.equal(keep, other)
    assert (keep != other).float().mean() > 0.3  # independent streams, not a shifted copy
    assert not torch.equal(keep[0, 0], keep[0, 1])  # heads (and batches) differ


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_forward_and_backward_match_masked_reference(device, causal):
    kernel, p = _dropout_kernel(device, p=0.25, causal=causal), 0.25
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    q, k, v = make_qkv(2, 4, 2, 45, 77, 32, dtype=torch.float32, device=device, generator=gen)
    seed = torch.tensor([random.randrange(2**62)], dtype=torch.int64, device=device)
    out, lse = kernel.forward(q, k, v, dropout_p=p, seed=seed)
    keep = kernel.module().dropout_keep_mask(2, 45, 77, seed, p)
    kw = dict(causal=causal, dropout_mask=keep, dropout_p=p)
    from flashgen.verify import reference_attention

    ref, ref_lse = reference_attention(q.double(), k.double(), v.double(), compute_dtype=torch.float64, **kw)
    assert ((out.double() - ref).norm() / ref.norm()) < 1e-5
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)
    do = torch.randn(out.shape, generator=gen).to(device)
    grads = kernel.backward(do, q, k, v, out, lse, dropout_p=p, seed=seed)
    assert_gradients_close(grads, q, k, v, do, **kw)


def test_dropout_through_autograd(device):
    kernel = _dropout_kernel(device, p=0.2)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 4, 2, 33, 33, 32, dtype=torch.float32, device=device,
                                                     generator=gen))
    state = random.randrange(2**31)
    torch.manual_seed(state)
    out = kernel(q, k, v)
    torch.manual_seed(state)  # replay the seed draw the call made
    seed = torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64)
    keep = kernel.module().dropout_keep_mask(1, 33, 33, seed, 0.2)
    do = torch.randn(out.shape, generator=gen).to(device)
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert_gradients_close(grads, q, k, v, do, causal=False, dropout_mask=keep, dropout_p=0.2)
    assert not torch.equal(kernel(q, k, v), out)  # a new seed each call
    eval_out = kernel(q, k, v, dropout_p=0.0)  # eval: no dropout
    assert_attention_close(eval_out, None, q.detach(), k.detach(), v.detach(), causal=False)


# ---------------------------------------------------------------------------- custom ops
def test_custom_op_passes_opcheck(device):
    kernel = flashgen.compile(AttentionSpec(dtype="fp32", head_dim=16, num_heads=2, backward=True),
                              KernelConfig(BLOCK_M=16, BLOCK_N=16, num_stages=1, BLOCK_M1=16, BLOCK_N1=16,
                                           BLOCK_M2=16, BLOCK_N2=16, bwd_num_stages=1))
    q, k, v = (torch.randn(1, 2, 9, 16, device=device, requires_grad=True) for _ in range(3))
    seed = torch.empty(1, dtype=torch.int64, device=device)
    torch.library.opcheck(torch.ops.flashgen.attn_fwd.default,
                          (q, k, v, seed, [], kernel._id, "bhsd", 0.0, False, None, None, 0, 0),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    # with a named tensor the gradient flows into, and packed sequences
    masked = flashgen.compile(AttentionSpec(dtype="fp32", head_dim=16, num_heads=2, backward=True, causal=True,
                                            score_mod={"alibi": {}}),
                              KernelConfig(BLOCK_M=16, BLOCK_N=16, num_stages=1, BLOCK_M1=16, BLOCK_N1=16,
                                           BLOCK_M2=16, BLOCK_N2=16, bwd_num_stages=1))
    slopes = torch.rand(2, device=device, requires_grad=True)
    qt, kt, vt = (torch.randn(9, 2, 16, device=device, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.flashgen.attn_fwd.default,
                          (qt, kt, vt, seed, [slopes], masked._id, "thd", 0.0, False, cu, cu, 5, 5),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_torch_compile_fullgraph_forward_and_backward(device):
    spec = AttentionSpec(dtype="fp32", head_dim=16, num_heads=4, num_kv_heads=2, causal=True, backward=True)
    kernel = flashgen.compile(spec, KernelConfig(BLOCK_M=16, BLOCK_N=16, num_stages=1, BLOCK_M1=16, BLOCK_N1=16,
                                                 BLOCK_M2=16, BLOCK_N2=16, bwd_num_stages=1))
    proj = torch.nn.Linear(16, 16).to(device)

    def block(x):  # q from a projection; k and v strided views of x (2 KV heads each)
        return kernel(proj(x), x[:, ::2], x[:, 1::2])

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    x = torch.randn(2, 4, 21, 16, device=device, requires_grad=True)
    out = compiled(x)
    (gx,) = torch.autograd.grad(out.square().sum(), x)
    x2 = x.detach().clone().requires_grad_()
    ref = block(x2)
    (gref,) = torch.autograd.grad(ref.square().sum(), x2)
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(gx, gref, atol=1e-4)


def test_fp16_dq_dk_yardstick_is_shared_and_still_catches_one_missing_key():
    """dQ and dK are held to at least each other's relative error in the fp16 reference (verify.check_gradients:
    both carry dS's rounding): a correct kernel (the float32 reference's gradients rounded to fp16) passes with
    room, and one (query, key) pair's term missing from one element of dQ or of dK still fails it."""
    from flashgen.verify import check_gradients, reference_attention

    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = make_qkv(2, 4, 4, 17, 17, 16, dtype=torch.float16, device="cpu", generator=gen)
    do = torch.randn(q.shape, generator=gen).half()
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    scores = []
    out, _ = reference_attention(*leaves, causal=False, compute_dtype=torch.float32, score_hook=scores.append)
    dq, dk, dv, ds = torch.autograd.grad(out, leaves + scores, do.float())
    grads = [g.half() for g in (dq, dk, dv)]
    results = check_gradients(grads, q, k, v, do, causal=False)
    assert all(r.ok and r.max_err < r.bound / 2 for r in results), f"seed={seed}: {results}"
    scale = q.shape[-1] ** -0.5
    # the pair whose term goes missing (the head's largest |dS|): dQ[i] loses dS[i, j] K[j], dK[j] loses dS[i, j] Q[i]
    b, h = 1, 2
    i, j = divmod(int(ds[b, h].abs().argmax()), ds.shape[-1])
    # (each in the element its own term weighs most in: dK's taken from K's row left it a small term, which passed,
    # seed 242166132)
    for which, other in ((0, k[b, h, j]), (1, q[b, h, i])):
        d = int(other.float().abs().argmax())
        term = ds[b, h, i, j] * other[d].float()
        wrong = [g.clone() for g in grads]
        wrong[which][b, h, i if which == 0 else j, d] -= (term * scale).half()
        bad = check_gradients(wrong, q, k, v, do, causal=False)[which]
        assert not bad.ok, f"seed={seed}: one pair's term missing from {bad.name} passed: {bad}"
