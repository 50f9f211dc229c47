"""The one-launch backward (config knob bwd_short, templates/backward/short.j2): program i of each
(batch, KV head) computes dK/dV of key block i and dQ of query block i, delta from O and dO.

Gradients are checked against the reference (3x rule of ../shared/TESTING.md) for a mask with
segments, causal GQA with unequal lengths that are not multiples of the tile, fp16 and fp32; packed
sequences, dropout and a score modifier's tensor gradient against the portable kernels; and that a
step is one launch, with the portable kernels kept where the short one cannot serve a call.
"""

import random

import pytest
import torch

import flashgen
from flashgen import AttentionSpec, ConfigError, KernelConfig
from flashgen.codegen import render
from flashgen.config import default_config
from flashgen.space import DeviceLimits, backward_space
from flashgen.verify import assert_gradients_close

from .test_masks import SMALL, check_variant

SHORT = SMALL.replace(bwd_short=True)
H100 = DeviceLimits("H100", 232448, hopper=True)


# (id, fields, sq, sk, dtype, (heads, kv heads))
CASES = [
    ("causal-gqa", {"causal": True}, 21, 35, "fp16", (4, 2)),  # more key blocks than query blocks
    ("full-mqa", {}, 33, 17, "fp32", (3, 1)),  # more query blocks than key blocks
    ("window-rows-see-nothing", {"mask": {"sliding_window": {"left": 9, "right": 2}}}, 40, 17, "fp16", (2, 1)),
]


@pytest.mark.parametrize("name,fields,sq,sk,dtype,heads", CASES, ids=[c[0] for c in CASES])
def test_short_backward_matches_reference(device, name, fields, sq, sk, dtype, heads):
    check_variant(device, **fields, sq=sq, sk=sk, dtype=dtype, heads=heads, config=SHORT)


# (id, mask, tensors, sq, sk, heads): custom expressions (a block map, read both ways by the short kernel)
CUSTOM_CASES = [
    ("strided", "(q_idx - kv_idx) % 3 == 0", None, 37, 29, (4, 2)),
    ("causal-documents-over-a-tensor", "(doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)",
     {"doc": torch.tensor([0] * 9 + [1] * 20 + [2] * 4, dtype=torch.int32)}, 33, 33, (2, 1)),
    ("rows-see-nothing", "(kv_idx < 11) & (q_idx % 5 != 1)", None, 21, 40, (2, 2)),
]


@pytest.mark.parametrize("name,mask,tensors,sq,sk,heads", CUSTOM_CASES, ids=[c[0] for c in CUSTOM_CASES])
def test_short_backward_of_custom_expressions_matches_reference(device, name, mask, tensors, sq, sk, heads):
    check_variant(device, mask=mask, tensors=tensors, sq=sq, sk=sk, dtype="fp16", heads=heads, config=SHORT)


def test_short_backward_of_a_float_bias_and_its_gradient(device):
    # a score modifier over a (Sq, Sk) float tensor, its gradient from the one launch, and a mask beside it
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    bias = torch.randn(26, 19, generator=gen)
    check_variant(device, mask="q_idx + 3 >= kv_idx", score_mod="score + bias[q_idx, kv_idx]",
                  tensors={"bias": bias}, sq=26, sk=19, dtype="fp32", heads=(2, 1), config=SHORT,
                  grad_tensors=("bias",))


def _launches(module):
    """Record (kernel attribute, grid) of each of the module's backward launches."""
    launcher, launched = module._LAUNCHER, []
    for attr in ("preprocess_kernel", "dkdv_kernel", "dq_kernel", "short_kernel"):
        kernel = getattr(launcher, attr)
        if kernel is None:  # (a module without the short kernel)
            continue

        class Recorder:
            def __getitem__(self, grid, kernel=kernel, attr=attr):
                launched.append((attr, grid))
                return kernel[grid]

        setattr(launcher, attr, Recorder())
    launcher.plans.clear()  # call plans keep the kernels they were made with
    return launched


def test_short_backward_is_one_launch_and_falls_back_for_atomic_dq(device):
    # 21 queries, 35 keys in 16-row tiles: max(3 key blocks, 2 query blocks) programs per (KV head, batch).
    spec = AttentionSpec(dtype="fp32", head_dim=16, num_heads=4, num_kv_heads=2, causal=True, backward=True)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    q, k, v, do = (torch.randn(2, h, s, 16, generator=gen).to(device) for h, s in ((4, 21), (2, 35), (2, 35), (4, 21)))
    module = render.build_module(spec, SHORT)
    launched = _launches(module)
    out, lse = module.forward(q, k, v)
    short = module.backward(do, q, k, v, out, lse)[:3]
    assert launched == [("short_kernel", (3, 2, 2))]
    # module.backward's results do not alias one another (the custom op's rule; one allocation each)
    assert len({g.untyped_storage().data_ptr() for g in short}) == 3
    # a call's atomic dQ has no short kernel: the portable ones run, and agree
    launched.clear()
    atomic = module.backward(do, q, k, v, out, lse, dq_strategy="atomic")[:3]
    assert [attr for attr, _ in launched] == ["preprocess_kernel", "dkdv_kernel"]
    for a, b in zip(short, atomic):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # fp32; dQ summed in another order (atomics)


@pytest.mark.parametrize("per_call_maps", [False, True], ids=["map-kept", "maps-per-call"])
def test_a_custom_expressions_short_backward_is_one_launch_over_its_block_maps(device, monkeypatch, per_call_maps):
    # a mask over no tensor (its map made once per shape) and one over a tensor (its maps all-partial for a small
    # call, or made on every call: STATIC_PAIRS patched to 0): one launch, the three launches' gradients
    from flashgen.runtime.host import TensorBlockMap

    if per_call_maps:
        monkeypatch.setattr(TensorBlockMap, "STATIC_PAIRS", 0)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    keep = torch.rand(40, 37, generator=gen) > 0.4
    for mask, tensors in (("(q_idx >= kv_idx) & (kv_idx % 4 != 3)", {}),
                          ("(keep[q_idx, kv_idx] != 0) & (q_idx + 5 >= kv_idx)", {"keep": keep.to(device)})):
        spec = AttentionSpec(dtype="fp32", head_dim=16, num_heads=4, num_kv_heads=2, mask=mask, backward=True)
        q, do = (torch.randn(2, 4, 40, 16, generator=gen).to(device) for _ in range(2))
        k, v = (torch.randn(2, 2, 37, 16, generator=gen).to(device) for _ in range(2))
        grads = []
        for config, kernels in ((SHORT, ["short_kernel"]), (SMALL, ["preprocess_kernel", "dkdv_kernel", "dq_kernel"])):
            module = render.build_module(spec, config)
            launched = _launches(module)
            out, lse = module.forward(q, k, v, tensors=tensors)
            for _ in range(2):  # the plan made, then kept
                launched.clear()
                grads.append(module.backward(do, q, k, v, out, lse, tensors=tensors)[:3])
                assert [attr for attr, _ in launched] == kernels, (mask, config)
        for a, b in zip(grads[0], grads[2]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert_gradients_close(grads[1], q, k, v, do, causal=False, mask=mask, tensors=tensors)


def test_short_backward_over_packed_sequences_dropout_and_tensor_gradients(device):
    # Packed sequences (lengths 1, 20, 0, 9: each program bounds itself to its own sequence), dropout's
    # keep mask and the ALiBi slopes' gradient, against the portable kernels (fp32).
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    spec = AttentionSpec(dtype="fp32", head_dim=16, num_heads=2, causal=True, dropout_p=0.2,
                         score_mod={"alibi": {}}, backward=True)
    cu = torch.tensor([0, 1, 21, 21, 30], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(30, 2, 16, generator=gen).to(device) for _ in range(3))
    slopes = torch.rand(2, generator=gen).to(device)
    seed = torch.tensor([random.randrange(2**62)], dtype=torch.int64, device=device)
    call = dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=20, max_seqlen_k=20, dropout_p=0.2,
                seed=seed, tensors={"alibi_slopes": slopes})
    grads = []
    for config in (SMALL, SHORT):
        module = render.build_module(spec, config)
        out, lse = module.forward(q, k, v, **call)
        dq, dk, dv, t = module.backward(torch.ones_like(out), q, k, v, out, lse, tensor_grads=["alibi_slopes"],
                                        **call)
        grads.append((dq, dk, dv, t["alibi_slopes"]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # fp32: the same tiles, delta summed per tile


def test_short_backward_under_autograd(device):
    # flashgen.attention's training path (the backward plan hung off the forward's), bshd.
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    q, k, v = (torch.randn(1, 29, h, 16, generator=gen).to(device, torch.float16).requires_grad_() for h in (2, 1, 1))
    do = torch.randn(1, 29, 2, 16, generator=gen).to(device, torch.float16)
    grads = [torch.autograd.grad(flashgen.attention(q, k, v, causal=True, layout="bshd", config=config),
                                 (q, k, v), do) for config in (SMALL, SHORT)]
    # dq, dk, dv: contiguous, each its own allocation (BackwardPlan.gradient_buffers)
    assert all(g.is_contiguous() and g._base is None for g in grads[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)  # fp16 outputs of the same fp32 sums


@pytest.mark.interpreter
def test_short_knob_is_checked_rendered_behind_itself_and_left_out_when_off():
    with pytest.raises(ConfigError, match="config knob 'bwd_short'.*dq_strategy='atomic'"):
        KernelConfig(bwd_short=True, dq_strategy="atomic")
    with pytest.raises(ConfigError, match="config knob 'bwd_short'.*got 1"):
        KernelConfig(bwd_short=1)
    assert "bwd_short" not in KernelConfig().to_dict()  # stored configs keep their ids
    assert KernelConfig.from_dict(SHORT.to_dict()) == SHORT and "short" in SHORT.describe_backward()
    spec = AttentionSpec(dtype="fp16", head_dim=32, num_heads=2, causal=True, backward=True)
    off, on = (render.render(spec, config, standalone=False) for config in (SMALL, SHORT))
    assert "_attn_bwd_short" not in off and "short_kernel=_attn_bwd_short" in on
    assert render.kernel_hash(spec, SMALL, "bwd") != render.kernel_hash(spec, SHORT, "bwd")
    # a custom expression's short kernel reads its block map both ways (per key block, per query block)
    custom = AttentionSpec(dtype="fp16", head_dim=32, num_heads=2, mask="(q_idx - kv_idx) % 4 == 0", backward=True)
    source = render.render(custom, SHORT, standalone=False)
    short = source[source.index("def _attn_bwd_short("):source.index("\n\n\n", source.index("def _attn_bwd_short("))]
    assert "short_kernel=_attn_bwd_short" in source and "KV_MAP_COUNTS" in short and "Q_MAP_COUNTS" in short
    # structural: a call cannot switch it
    module = render.build_module(spec, SMALL)
    x = torch.randn(1, 2, 8, 32, dtype=torch.float16)
    with pytest.raises(TypeError, match="unexpected knob 'bwd_short'"):
        module.backward(x, x, x, x, x, torch.zeros(1, 2, 8), bwd_short=True)


def test_short_backward_default_and_search_space():
    causal = AttentionSpec(dtype="bf16", head_dim=128, num_heads=16, causal=True, backward=True)
    assert default_config(causal, "h100", 256).bwd_short and default_config(causal, "h100", 512).bwd_short
    assert not default_config(causal, "h100", 1024).bwd_short
    assert not default_config(causal, "a100", 256).bwd_short and not default_config(causal, "cpu", 256).bwd_short
    documents = AttentionSpec(dtype="bf16", head_dim=128, num_heads=4, mask={"document": {}}, backward=True)
    assert default_config(documents, "h100", 256).bwd_short  # instead of its fused delta
    custom = AttentionSpec(dtype="bf16", head_dim=128, num_heads=4, mask="(q_idx - kv_idx) % 4 == 0", backward=True)
    assert default_config(custom, "h100", 256).bwd_short and not default_config(custom, "h100", 1024).bwd_short
    assert backward_space(custom, H100).params["bwd_short"] == (False, True)
    space = backward_space(causal, H100)
    assert space.params["bwd_short"] == (False, True)
    point = dict(BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=32, BLOCK_N2=64, bwd_num_warps=4, bwd_num_stages=2,
                 dq_strategy="separate", bwd_tma=True, bwd_persistent=0, bwd_fused_delta=False, bwd_short=True)
    assert space.violations(point) == []  # knobs it does not read are free
    assert any("bwd_short" in v for v in space.violations(dict(point, dq_strategy="atomic")))


@pytest.mark.gpu
@pytest.mark.parametrize("fields,sq,sk,heads", [({"causal": True}, 128, 128, (16, 16)),
                                               ({"causal": True}, 509, 509, (8, 2)),
                                               ({}, 333, 129, (8, 1)),
                                               ({"mask": {"sliding_window": {"left": 100, "right": 0}}}, 512, 512,
                                                (4, 4)),
                                               ({"mask": "(q_idx >= kv_idx) & ((q_idx - kv_idx) % 7 != 3)"}, 300, 300,
                                                (8, 2))],
                         ids=["causal-128", "causal-509-gqa", "full-333x129-mqa", "window-512", "custom-300-gqa"])
def test_gpu_short_backward_bf16(fields, sq, sk, heads):
    # the H100 default's tiles (64x64, 4 warps, 2 stages) with the short backward, hd128 and hd64
    for d in (128, 64):
        check_variant("cuda", **fields, sq=sq, sk=sk, dtype="bf16", heads=heads, d=d,
                      config=KernelConfig(BLOCK_M=64, BLOCK_N=64, num_stages=3, BLOCK_M1=64, BLOCK_N1=64,
                                          BLOCK_M2=64, BLOCK_N2=64, bwd_short=True))


@pytest.mark.gpu
def test_gpu_default_small_call_is_one_backward_launch():
    # flashgen.attention's default at S=128 on an H100: the short backward, one launch, exact
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=16, causal=True, backward=True)
    config = default_config(spec, None, 128)
    if not config.bwd_short:
        pytest.skip("the default has no short backward on this GPU")
    launched = _launches(flashgen.compile(spec).module(config))
    q, k, v = (torch.randn(1, 16, 128, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = flashgen.attention(q, k, v, causal=True)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert [attr for attr, _ in launched] == ["short_kernel"]
    assert_gradients_close(grads, q.detach(), k.detach(), v.detach(), do, causal=True)


@pytest.mark.gpu
def test_gpu_default_small_step_bound_is_bitwise_tritons(monkeypatch):
    # the default S=128 training step through its dense plan (one flat key, five saved tensors, the direct
    # forward launch, the one-launch backward): every bound launch checked against Triton's binder, and
    # out and the gradients bitwise those of Triton's launch path
    from flashgen.runtime.launch import BoundLaunch

    monkeypatch.setattr(BoundLaunch, "verify", True)
    q, k, v = (torch.randn(1, 16, 128, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)

    def step():
        out = flashgen.attention(q, k, v, causal=True)
        assert len(out.grad_fn.saved_tensors) == 5
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    results = [step() for _ in range(3)]  # Triton's path, then bound twice
    monkeypatch.setattr(BoundLaunch, "enabled", False)
    results.append(step())
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], r))
    assert_gradients_close(results[0][1:], q.detach(), k.detach(), v.detach(), do, causal=True)
