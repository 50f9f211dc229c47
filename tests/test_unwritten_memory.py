"""No kernel reads memory that nothing wrote. Every buffer torch.empty / torch.empty_like makes during a call
(outputs, LSE, dQ accumulators, delta, partial results, tables) is filled once with garbage (NaN, or a large
integer) and once with zeros; a call's outputs and gradients must be bitwise equal between the two. A kernel
that reads an element it should not (a row past its sequence, a split's unwritten partials, a table entry no
launch filled) gives a different result, a NaN, or a fault. Call plans are forgotten before each run, so a buffer
a plan keeps is made, and filled, afresh.

On the CPU the interpreter runs the portable kernels; on a GPU the calls take that GPU's defaults (on sm90 the
Gluon forward, its one-tile and persistent packed kernels, and the Gluon backward) and the portable family beside them."""

import random

import pytest
import torch

import flashgen
from flashgen import AttentionSpec, compat

from .helpers import FreshBuffers, cu_seqlens, forget_plans, gluon_configs, make_qkv, portable_config, sm90


@pytest.fixture(params=[pytest.param("cpu", marks=pytest.mark.interpreter), pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Each test on the CPU through the interpreter, and on a GPU (`pytest -m gpu`)."""
    return request.param


@pytest.fixture
def poisoned(monkeypatch):
    """run(call) -> call()'s tensors from two runs, the first with every fresh buffer garbage, the second zeros."""
    buffers = FreshBuffers(monkeypatch)

    def run(call):
        results = []
        for garbage in (True, False):
            forget_plans()
            buffers.garbage, buffers.count = garbage, 0
            try:
                results.append([t.detach().clone() for t in call()])
            finally:
                buffers.garbage = None
            assert buffers.count, "no buffer was made through torch.empty or torch.empty_like: nothing was checked"
        return results

    yield run
    forget_plans()


def assert_same(runs, names, seed):
    """The two runs' tensors bitwise equal; on a GPU, where fp32 atomics (dQ added by the dK/dV programs) sum in
    any order, equal but for that order: the same NaNs (none) and within 1% of the largest magnitude."""
    garbage, zeros = runs
    for name, a, b in zip(names, garbage, zeros, strict=True):
        if a.is_cuda:
            scale = b.float().abs().nan_to_num(0.0).max().item()
            same = torch.equal(a.isnan(), b.isnan()) and not a.isnan().any() and \
                (a.float() - b.float()).abs().max().item() <= 1e-2 * scale
        else:
            same = torch.equal(a, b)  # (a NaN anywhere fails too: these calls have none)
        if not same:
            diff = (a.float() - b.float()).abs().nan_to_num(float("inf")).reshape(-1, a.shape[-1])
            row, col = divmod(int(diff.argmax()), a.shape[-1])
            raise AssertionError(f"seed {seed}: {name}: differs where flashgen's fresh buffers held garbage (max |diff| "
                                 f"{diff.max().item():.3g} at row {row}, column {col} of its rows; {int(a.isnan().sum())} "
                                 "NaN): a kernel read memory nothing wrote")


def with_gradients(call, *inputs, seed):
    """call's output and the gradients of its inputs, for a fixed upstream gradient."""
    def run():
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = call(*leaves)
        do = fresh(*out.shape, dtype=out.dtype, device=out.device, gen=torch.Generator().manual_seed(seed))
        return [out, *torch.autograd.grad(out, leaves, do)]
    return run


def fresh(*shape, dtype, device, gen):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def dtype_on(device):
    """bf16 on a GPU; fp16 on the CPU (the interpreter's bf16 dot is wrong)."""
    return torch.bfloat16 if device == "cuda" else torch.float16


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dense_training_step(poisoned, device, causal):
    seed = random.randrange(2**31)
    d, seqlen = (128, 1000) if device == "cuda" else (64, 70)
    q, k, v = make_qkv(2, 4, 2, seqlen, seqlen + 17, d, dtype=dtype_on(device), device=device,
                       generator=torch.Generator().manual_seed(seed))
    runs = poisoned(with_gradients(lambda q, k, v: flashgen.attention(q, k, v, causal=causal), q, k, v, seed=seed))
    assert_same(runs, ["out", "dq", "dk", "dv"], seed)


@pytest.mark.parametrize("causal, extra", [(False, 0), (True, 0), (False, 24)],
                         ids=["full", "causal", "max_seqlen past the longest"])
def test_packed_training_step(poisoned, device, causal, extra):
    # an empty sequence, one of one token, and 5 tokens after the last sequence (whose rows are not written:
    # sliced off, as the docstring of attention_varlen says)
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    dtype = dtype_on(device)
    lengths, d = ([300, 0, 1000, 1, 511], 128) if device == "cuda" else ([17, 0, 64, 1, 33], 64)
    longest, total = max(lengths) + extra, sum(lengths)
    cu = cu_seqlens(lengths, device)
    q = fresh(total + 5, 4, d, dtype=dtype, device=device, gen=gen)
    k, v = (fresh(total + 5, 2, d, dtype=dtype, device=device, gen=gen) for _ in range(2))

    def step():
        out, *grads = with_gradients(lambda q, k, v: flashgen.attention_varlen(q, k, v, cu, cu, longest, longest,
                                                                                causal=causal), q, k, v, seed=seed)()
        return [t[:total] for t in (out, *grads)]

    assert_same(poisoned(step), ["out", "dq", "dk", "dv"], seed)


def test_portable_backward_knobs(poisoned, device):
    # the multi-launch backward (dQ separate or added by atomics, a persistent dK/dV grid) besides the default
    seed = random.randrange(2**31)
    dtype = dtype_on(device)
    d, seqlen = (128, 700) if device == "cuda" else (64, 130)
    spec = AttentionSpec(dtype="bf16" if dtype == torch.bfloat16 else "fp16", head_dim=d, num_heads=2, causal=True,
                         backward=True)
    q, k, v = make_qkv(1, 2, 2, seqlen, seqlen, d, dtype=dtype, device=device,
                       generator=torch.Generator().manual_seed(seed))
    for knobs in ({}, {"dq_strategy": "atomic"}, {"bwd_persistent": 1}):
        kernel = flashgen.compile(spec, portable_config(spec, seqlen, **knobs))
        runs = poisoned(with_gradients(lambda q, k, v: kernel(q, k, v), q, k, v, seed=seed))
        assert_same(runs, [f"{name} ({knobs or 'separate dQ'})" for name in ("out", "dq", "dk", "dv")], seed)


def test_decode_with_splits_and_pages(poisoned, device):
    # flash_attn_with_kvcache over a paged cache, one split and three (the split partials and their merge)
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    dtype = dtype_on(device)
    pages, page = (64, 64) if device == "cuda" else (12, 16)
    k_cache, v_cache = (fresh(pages, page, 2, 64, dtype=dtype, device=device, gen=gen) for _ in range(2))
    table = torch.randperm(pages, generator=gen).reshape(4, -1).to(device=device, dtype=torch.int32)
    capacity = table.shape[1] * page
    seqlens = torch.tensor([5, capacity, capacity // 2 + 3, 0], dtype=torch.int32, device=device)
    q = fresh(4, 1, 4, 64, dtype=dtype, device=device, gen=gen)

    def call():
        return [compat.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                               causal=True, num_splits=n) for n in (1, 3)]

    assert_same(poisoned(call), ["out, one split", "out, three splits"], seed)


def test_sdpa_float_mask(poisoned, device):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = make_qkv(2, 2, 2, 50, 70, 64, dtype=dtype, device=device, generator=gen)
    bias = fresh(2, 2, 50, 70, dtype=dtype, device=device, gen=gen)
    bias[:, :, 7] = float("-inf")  # a row masked whole
    runs = poisoned(with_gradients(lambda q, k, v: flashgen.scaled_dot_product_attention(q, k, v, attn_mask=bias),
                                   q, k, v, seed=seed))
    assert_same(runs, ["out", "dq", "dk", "dv"], seed)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("name", ["gluon forward", "gluon dK/dV", "gluon dK/dV adding dQ"])
def test_gpu_gluon_kernels(poisoned, name):
    from flashgen.runtime.hopper import HopperPlan
    from flashgen.runtime.hopper_bwd import HopperDkdv

    seed = random.randrange(2**31)
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=4, num_kv_heads=2, causal=True, backward=True)
    config = gluon_configs(spec, 1024)[name]
    kernel = flashgen.compile(spec, config)
    q, k, v = make_qkv(2, 4, 2, 1100, 1100, 128, dtype=torch.bfloat16, device="cuda",
                       generator=torch.Generator().manual_seed(seed))
    runs = poisoned(with_gradients(lambda q, k, v: kernel(q, k, v), q, k, v, seed=seed))
    assert_same(runs, [f"{n} ({name})" for n in ("out", "dq", "dk", "dv")], seed)
    # the Gluon kernel ran (a call it turns down at run time takes the portable one, which this case is not about)
    plans = list(kernel.module(config)._LAUNCHER.plans.values())
    if name == "gluon forward":
        assert any(isinstance(plan, HopperPlan) for plan in plans), plans
    else:
        backward = [*plans, *(b for plan in plans for b in getattr(plan, "backward_plans", {}).values())]
        assert any(isinstance(getattr(plan, "dkdv", None), HopperDkdv) for plan in backward), backward


def test_poison_catches_a_read_of_an_unwritten_buffer(poisoned, device):
    # the check itself: a call that reads a fresh buffer it never wrote must fail it
    def careless():
        buffer = torch.empty(8, device=device)
        return [buffer * 0 + 1]

    with pytest.raises(AssertionError, match="a kernel read memory nothing wrote"):
        assert_same(poisoned(careless), ["buffer"], 0)
    with pytest.raises(AssertionError, match="nothing was checked"):  # a call that makes no buffer checks nothing
        poisoned(lambda: [torch.ones(3, device=device)])
