"""The backward on a real GPU: real sizes in every dtype, both dQ strategies, bitwise
determinism, a training step captured in a CUDA graph, torch.compile with inductor, and
memory that stays linear in the sequence length."""

import random

import pytest
import torch

import flashgen
from flashgen import AttentionSpec, default_config
from flashgen.verify import assert_attention_close, assert_gradients_close

from .helpers import make_qkv

pytestmark = pytest.mark.gpu
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _check(dtype, causal, strategy, seqlens, head_dim, heads=(8, 2), layout="bhsd", deterministic=False, config=None,
           **knobs):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    spec = AttentionSpec(dtype=dtype, head_dim=head_dim, num_heads=heads[0], num_kv_heads=heads[1], causal=causal,
                         backward=True)
    kernel = flashgen.compile(spec, (config or default_config(spec)).replace(dq_strategy=strategy, **knobs))
    q, k, v = (t.requires_grad_() for t in make_qkv(2, heads[0], heads[1], *seqlens, head_dim, dtype=DTYPES[dtype],
                                                     device="cuda", layout=layout, generator=gen))
    out, lse = kernel(q, k, v, layout=layout, return_lse=True, deterministic=deterministic)
    do = torch.randn(out.shape, generator=gen).to(device="cuda", dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), do)
    try:
        assert_attention_close(out, lse, q, k, v, causal=causal, layout=layout)
        assert_gradients_close(grads, q, k, v, do, causal=causal, layout=layout)
    except AssertionError as err:
        raise AssertionError(f"seed {seed}: {err}") from None
    return kernel, (q, k, v, do), grads


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("strategy", ["separate", "atomic"])
@pytest.mark.parametrize("seqlens,head_dim", [((1024, 1024), 64), ((777, 1500), 128), ((1500, 777), 80),
                                              ((1, 2049), 96), ((513, 513), 256)])
def test_gradients_real_sizes(dtype, causal, strategy, seqlens, head_dim):
    # hd256's default dK/dV tiles (64 x 64) adding dQ take 263168 bytes of shared memory at its 2 stages, past
    # sm90's 232448 (compiled for sm90 through tests/sm90_compile.py's driver): one stage there (131072)
    knobs = dict(bwd_num_stages=1) if head_dim == 256 and strategy == "atomic" and dtype != "fp32" else {}
    _check(dtype, causal, strategy, seqlens, head_dim, layout="bshd" if head_dim == 80 else "bhsd", **knobs)


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("strategy", ["separate", "atomic"])
@pytest.mark.parametrize("bwd_tma", [False, True])
@pytest.mark.parametrize("seqlens,head_dim,layout", [((777, 1500), 128, "bshd"), ((1500, 777), 64, "bhsd")])
def test_gradients_tensor_descriptors(dtype, causal, strategy, bwd_tma, seqlens, head_dim, layout):
    # Both settings of the Hopper knobs whatever the defaults are: forward tma, backward bwd_tma.
    _check(dtype, causal, strategy, seqlens, head_dim, layout=layout, tma=bwd_tma, bwd_tma=bwd_tma)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bwd_tma", [False, True])
@pytest.mark.parametrize("seqlens,head_dim,heads,layout", [((777, 1500), 256, (8, 2), "bshd"),
                                                           ((1500, 777), 192, (4, 4), "bhsd"),
                                                           ((2048, 2048), 256, (4, 1), "bhsd"),
                                                           ((100, 300), 160, (4, 2), "bshd")])
def test_head_dims_past_128_on_their_default_backward(dtype, causal, bwd_tma, seqlens, head_dim, heads, layout):
    # the sm90 default past head dim 128 (dK/dV 64 x 64 on 8 warps, dQ 128 x 32; config._backward_defaults),
    # with and without descriptors (calls of up to SMALL_CALL tokens take it without), ragged tiles, GQA
    _check(dtype, causal, "separate", seqlens, head_dim, heads=heads, layout=layout, bwd_tma=bwd_tma)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs an sm90 GPU (H100/H200): the descriptors' default is sm90's")
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens,head_dim,heads,layout", [((1024, 1024), 40, (8, 2), "bshd"),
                                                           ((2048, 2048), 40, (4, 1), "bhsd"),
                                                           ((777, 1500), 80, (4, 4), "bhsd"),
                                                           ((1500, 777), 96, (6, 2), "bshd")])
def test_padded_head_dims_on_their_default_backward(dtype, causal, seqlens, head_dim, heads, layout):
    # head dims under their tiles' width read through descriptors in the backward too (config._padded_16_bit),
    # after the Gluon forward at their padded width's knobs (or the portable one with descriptors)
    spec = AttentionSpec(dtype=dtype, head_dim=head_dim, num_heads=heads[0], num_kv_heads=heads[1], causal=causal)
    config = default_config(spec, None, seqlens[0])  # what a call of this length gets
    assert config.bwd_tma, config
    _check(dtype, causal, "separate", seqlens, head_dim, heads=heads, layout=layout, config=config)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_deterministic_gradients_are_bitwise_equal(dtype):
    kernel, (q, k, v, do), grads = _check(dtype, True, "atomic", (2048, 2048), 128, deterministic=True)
    for _ in range(3):
        again = torch.autograd.grad(kernel(q, k, v, deterministic=True), (q, k, v), do)
        assert all(torch.equal(a, b) for a, b in zip(grads, again))


def test_training_step_in_a_cuda_graph():
    spec = AttentionSpec(dtype="bf16", head_dim=64, num_heads=8, num_kv_heads=2, causal=True, backward=True)
    kernel = flashgen.compile(spec)
    torch.manual_seed(random.randrange(2**31))
    proj = torch.nn.Linear(64, 64 * 3, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 8, 512, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        qkv = proj(x)
        q, k, v = qkv[..., :64], qkv[:, :2, :, 64:128], qkv[:, :2, :, 128:]
        loss = kernel(q, k, v).float().square().mean()
        loss.backward()
        return loss

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up: compile the kernels outside the capture
            proj.zero_grad(set_to_none=False)
            step()
    torch.cuda.current_stream().wait_stream(stream)
    proj.zero_grad(set_to_none=False)
    eager_loss = step().item()
    eager_grad = proj.weight.grad.clone()
    graph = torch.cuda.CUDAGraph()
    proj.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        static_loss = step()
    proj.zero_grad(set_to_none=False)
    graph.replay()
    torch.cuda.synchronize()
    assert static_loss.item() == pytest.approx(eager_loss, rel=1e-3)
    assert torch.allclose(proj.weight.grad.float(), eager_grad.float(), rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("mask", [None, "bool"])
def test_a_captured_call_outlives_its_evicted_plan(mask):
    # A no-grad call captured after eager calls of its metadata (api's fast path: the plan they made) writes an
    # LSE nothing reads (the graph's own) and a small masked call reads an all-partial block map (kept for good per
    # shape), so a replay after the plans were evicted and their memory freed and taken by other tensors writes
    # none of it and gives the eager answer.
    from flashgen import api, ops

    torch.manual_seed(random.randrange(2**31))
    q, k, v = (torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    keep = torch.rand(256, 256, device="cuda") < 0.7 if mask else None
    keep = keep | torch.eye(256, dtype=torch.bool, device="cuda") if mask else None

    def call():
        if mask:
            return flashgen.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return flashgen.attention(q, k, v, causal=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(2):  # compile, then the fast path's entry
            expected = call().clone()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = call()
    api._FAST.clear()
    for module in ops._MODULES.values():
        module._LAUNCHER.plans.clear()
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    # memory the plans held, taken again: tensors of the LSE buffer's size and smaller (the allocator's small pool,
    # where the freed buffer and maps were) and large ones
    taken = [torch.full((n,), 7.0, device="cuda") for n in (4096, 1024, 256, 64) for _ in range(512)]
    taken += [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(16)]
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    assert all(bool((t == 7.0).all()) for t in taken), "a replay wrote into memory it does not own"


def test_torch_compile_inductor_model():
    spec = AttentionSpec(dtype="bf16", head_dim=64, num_heads=4, causal=True, backward=True)
    kernel = flashgen.compile(spec)
    lin = torch.nn.Linear(64, 64, device="cuda", dtype=torch.bfloat16)

    def f(x):
        return lin(kernel(lin(x), x, x)).float().sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    x = torch.randn(2, 4, 1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    (g1,) = torch.autograd.grad(compiled(x), x)
    (g2,) = torch.autograd.grad(f(x), x)
    assert torch.allclose(g1.float(), g2.float(), rtol=2e-2, atol=2e-2)


def test_memory_is_linear_in_sequence_length():
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=8, causal=True, backward=True)
    kernel = flashgen.compile(spec)

    def peak(seqlen):
        q, k, v = (t.requires_grad_() for t in make_qkv(1, 8, 8, seqlen, seqlen, 128, dtype=torch.bfloat16,
                                                         device="cuda"))
        kernel(q, k, v).sum().backward()  # compile outside the measurement
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        kernel(q, k, v).sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    small, large = peak(4096), peak(16384)
    assert large <= 4.5 * small, (small, large)  # 4x the tokens: about 4x the bytes, never 16x
