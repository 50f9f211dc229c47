"""torch.compile(fullgraph=True, dynamic=True) of every entry point (issue 13: 2): a module that
calls it compiles without a graph break, its forward and backward match eager, and a second call
with another batch size and sequence length does not recompile (error_on_recompile).

fp32 on the CPU through the interpreter; compiled and eager run the same kernels on the same
inputs, so they agree to the last bit, and we check (dtype fp32, atol 1e-6, rtol 0): any
difference means a different kernel or different arguments."""

import random
import re

import numpy as np
import pytest
import torch
import torch._dynamo

import flashgen
from flashgen import AttentionSpec, KernelConfig, compat
from flashgen.errors import SpecError

BACKENDS = ["aot_eager", "eager"]
# (batch, seqlen): the second call must reuse the first's graph. Sizes are chosen apart from the
# head counts (4, 2; 8 packed) and from 1: dynamo specializes size 1, and sizes equal to a head
# count on the first trace share its symbol (duck sizing), which flashgen specializes.
SHAPES = [(3, 17), (5, 33)]


def _dense(batch, seqlen, layout="bhsd", heads=4, kv_heads=2, dim=16):
    shape = (lambda h: (batch, h, seqlen, dim)) if layout == "bhsd" else (lambda h: (batch, seqlen, h, dim))
    return [torch.randn(shape(h), requires_grad=True) for h in (heads, kv_heads, kv_heads)]


def _packed(batch, seqlen, heads=8, kv_heads=2, dim=16):
    lengths = [seqlen - 3 * i for i in range(batch)]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    total = int(cu[-1])
    qkv = [torch.randn(total, h, dim, requires_grad=True) for h in (heads, kv_heads, kv_heads)]
    return [*qkv, cu, max(lengths)]  # q, k, v, cu_seqlens (for q and k), max_seqlen


def _check(fn, make, backend):
    """Compile fn, run it on each shape from make(batch, seqlen) -> args, compare out and grads with eager."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=backend)
    for i, (batch, seqlen) in enumerate(SHAPES):
        args = make(batch, seqlen)
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = compiled(*args)
        grads = torch.autograd.grad(out.sum(), leaves)
        ref = fn(*args)
        ref_grads = torch.autograd.grad(ref.sum(), leaves)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.interpreter
def test_attention_compiles(backend):
    _check(lambda q, k, v: flashgen.attention(q, k, v, causal=True), _dense, backend)


@pytest.mark.interpreter
def test_attention_with_pattern_mask_scale_and_named_tensor_compiles():
    def fn(q, k, v, bias):
        return flashgen.attention(q, k, v, softmax_scale=0.3, mask={"sliding_window": {"left": 5, "right": 0}},
                                  score_mod="score + bias[h]", bias=bias)

    _check(fn, lambda b, s: [*_dense(b, s), torch.randn(4, requires_grad=True)], "aot_eager")


@pytest.mark.interpreter
def test_attention_bshd_compiles():
    _check(lambda q, k, v: flashgen.attention(q, k, v, causal=True, layout="bshd"),
           lambda b, s: _dense(b, s, "bshd"), "aot_eager")


@pytest.mark.interpreter
def test_attention_varlen_compiles():
    def fn(q, k, v, cu, longest):
        return flashgen.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)

    _check(fn, _packed, "aot_eager")


@pytest.mark.interpreter
def test_compat_functions_compile():
    def dense(q, k, v):
        return compat.flash_attn_func(q, k, v, causal=True, window_size=(4, -1), softcap=5.0)

    _check(dense, lambda b, s: _dense(b, s, "bshd"), "aot_eager")

    def packed(q, k, v, cu, longest):
        return compat.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)

    _check(packed, _packed, "aot_eager")


@pytest.mark.interpreter
def test_sdpa_compiles():
    _check(lambda q, k, v: flashgen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
           _dense, "aot_eager")


@pytest.mark.interpreter
def test_sdpa_3d_compiles_once_over_n():
    # (N, L, E): N was the head count, specialized: a recompile per N
    _check(lambda q, k, v: flashgen.scaled_dot_product_attention(q, k, v, is_causal=True),
           lambda batch, seqlen: [torch.randn(batch, seqlen, 16, requires_grad=True) for _ in range(3)], "aot_eager")


@pytest.mark.interpreter
def test_kernel_object_compiles():
    kernel = flashgen.compile(flashgen.AttentionSpec(head_dim=16, num_heads=4, num_kv_heads=2, causal=True,
                                                     dtype="fp32", backward=True))
    _check(lambda q, k, v: kernel(q, k, v), _dense, "aot_eager")


@pytest.mark.interpreter
def test_one_off_call_binds_once(monkeypatch):
    """After the first call of a key, a call builds no spec (the per-call fast path, issue 13: 1)."""
    from flashgen import api

    monkeypatch.setattr(api, "_BOUND", {})  # keys bound by earlier tests would hide the first bind
    q, k, v = _dense(1, 9)
    flashgen.attention(q, k, v, causal=True)
    built = []
    original = api.spec_for
    api.spec_for = lambda *a, **kw: built.append(1) or original(*a, **kw)
    try:
        flashgen.attention(*_dense(3, 21), causal=True)
        assert not built
        flashgen.attention(q, k, v, causal=False)  # another key: bound once
        flashgen.attention(q, k, v, causal=False)
        assert len(built) == 1
    finally:
        api.spec_for = original


@pytest.mark.interpreter
def test_compiled_call_runs_the_config_of_its_length_bucket():
    """Under torch.compile the length is symbolic: the op resolves the nearest bucket's config on
    each call, so compiled and eager calls run the same kernel (bitwise equal) at any length."""
    from flashgen import ops

    spec = AttentionSpec(name="attention", dtype="fp32", head_dim=16, num_heads=2, causal=True)
    small = KernelConfig(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    large = KernelConfig(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
    kid = ops.bucketed_id(spec, {16: small, 64: large})
    q = torch.randn(1, 2, 20, 16)
    assert ops.resolve(kid, q, q, "bhsd", 0, 0) == ops.kernel_id(spec, small)
    q = torch.randn(1, 2, 60, 16)
    assert ops.resolve(kid, q, q, "bhsd", 0, 0) == ops.kernel_id(spec, large)
    assert ops.kernel_spec(kid) == (spec, small)
    seed = torch.empty(1, dtype=torch.int64)
    out, _ = ops.attn_fwd(q, q, q, seed, [], kid, "bhsd", 0.0, False, None, None, 0, 0)
    ref, _ = flashgen.compile(spec, large).module().forward(q, q, q)
    assert torch.equal(out, ref)


def test_import_leaves_dynamo_unloaded_and_marks_as_torch_does():
    """`import flashgen` does not import torch._dynamo (1.4 s of its import on a CPU host), and the
    mark that stands in for torch.compiler.assume_constant_result is the decorator's own: if a
    torch changes what the decorator sets, this fails before a compiled call traces into
    flashgen's binding."""
    import subprocess
    import sys

    from flashgen import api

    code = "import sys, flashgen; print('torch._dynamo' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"

    def ours():
        pass

    def torchs():
        pass

    assert vars(api._constant_result(ours)) == vars(torch.compiler.assume_constant_result(torchs)) != {}
    assert api._traced_binding._dynamo_marked_constant and api._traced_tensor_names._dynamo_marked_constant


def _compiles_once(fn, lengths, heads=(4, 2, 2)):
    """fn compiled (dynamic, fullgraph) runs every length after the first without a recompile, as eager."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for i, seqlen in enumerate(lengths):
        q, k, v = (torch.randn(3, h, seqlen, 16) for h in heads)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = compiled(q, k, v)
        torch.testing.assert_close(out, fn(q, k, v), atol=1e-6, rtol=0)


@pytest.mark.interpreter
def test_a_kernel_with_bucket_configs_compiles_once_over_its_buckets():
    # what flashgen.load returns from tuned results: choosing the bucket while tracing guarded the graph on the
    # length (q.size()[2] * q.size()[2] <= 1024): a recompile per bucket
    from flashgen.api import AttentionKernel

    spec = AttentionSpec(head_dim=16, num_heads=4, num_kv_heads=2, causal=True, dtype="fp32")
    kernel = AttentionKernel(spec, bucket_configs={16: KernelConfig(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1),
                                                   64: KernelConfig(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)})
    _compiles_once(lambda q, k, v: kernel(q, k, v), (13, 19, 50))


@pytest.mark.interpreter
def test_the_transformers_attention_compiles_once_across_the_decode_length():
    # the decode route's length test ran before its is_compiling() one: a guard 2 <= S <= 16, a recompile past 16
    pytest.importorskip("transformers")
    from flashgen.integrations.transformers import attention_forward

    layer = torch.nn.Module()
    _compiles_once(lambda q, k, v: attention_forward(layer, q, k, v, None, is_causal=True)[0], (13, 19, 23))


@pytest.mark.parametrize("entry", ["attention", "flash_attn_func", "sdpa"])
@pytest.mark.interpreter
def test_a_scale_held_in_a_module_attribute_compiles_dynamic(entry):
    # dynamic=True makes a module's float attribute symbolic (transformers' self.scaling): tracing refused it
    # ("assume_constant_result argument conversion failed", math.isfinite on a symbolic float); the usual
    # value, head_dim ** -0.5, is specialized by a guard now
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scaling = 16 ** -0.5

        def forward(self, q, k, v):
            if entry == "attention":
                return flashgen.attention(q, k, v, causal=True, softmax_scale=self.scaling)
            if entry == "flash_attn_func":
                return compat.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                              softmax_scale=self.scaling)
            return flashgen.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling, enable_gqa=True)

    layer = Layer()
    _compiles_once(layer, (13, 19))


FLOAT_ATTRIBUTE_CALLS = {
    # a float held in a module attribute that is not a usual value (dynamic=True makes it symbolic)
    "attention scale": lambda layer, q, k, v: flashgen.attention(q, k, v, causal=True, softmax_scale=layer.value),
    "flash_attn_func softcap": lambda layer, q, k, v: compat.flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, softcap=layer.value),
    "sdpa scale": lambda layer, q, k, v: flashgen.scaled_dot_product_attention(q, k, v, scale=layer.value,
                                                                              enable_gqa=True),
    "sdpa negative scale": lambda layer, q, k, v: flashgen.scaled_dot_product_attention(q, k, v, scale=-layer.value,
                                                                                       enable_gqa=True),
    "transformers softcap": lambda layer, q, k, v: _transformers_forward(layer, q, k, v, softcap=layer.value,
                                                                         scaling=layer.value / 100),
    "attention dropout": lambda layer, q, k, v: flashgen.attention(q, k, v, dropout_p=layer.value / 100),
}


def _transformers_forward(layer, q, k, v, **kwargs):
    from flashgen.integrations.transformers import attention_forward

    return attention_forward(layer, q, k, v, None, is_causal=True, **kwargs)[0]


@pytest.mark.parametrize("call", FLOAT_ATTRIBUTE_CALLS.values(), ids=FLOAT_ATTRIBUTE_CALLS.keys())
@pytest.mark.interpreter
def test_a_float_attribute_of_any_value_compiles_dynamic(call):
    # a scale, softcap or dropout rate other than the usual values stayed symbolic and tracing refused it
    # ("assume_constant_result argument conversion failed"); now it is specialized by guards, so one graph serves
    # every length, and a new value compiles anew
    class Layer(torch.nn.Module):
        value = 30.3

        def forward(self, q, k, v):
            return call(self, q, k, v)

    layer = Layer()
    if call is FLOAT_ATTRIBUTE_CALLS["attention dropout"]:  # (random: the graph is checked, not the values)
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
        for i, seqlen in enumerate((13, 19)):
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                assert compiled(*(torch.randn(3, h, seqlen, 16) for h in (4, 2, 2))).shape == (3, 4, seqlen, 16)
        return
    _compiles_once(layer, (13, 19))
    layer.value = 7.1  # another value: its own graph, its own kernel
    q, k, v = (torch.randn(3, h, 13, 16) for h in (4, 2, 2))
    torch.testing.assert_close(torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")(q, k, v),
                               layer(q, k, v), atol=1e-6, rtol=0)


def _keeps_one_in_three(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx) % 3 != 1


@pytest.mark.parametrize("mask", [flashgen.mask("kv_idx <= q_idx") & flashgen.mask(sliding_window={"left": 4,
                                                                                                  "right": 0}),
                                  flashgen.mask(_keeps_one_in_three)], ids=["expression-and-pattern", "function"])
@pytest.mark.interpreter
def test_mask_and_score_mod_objects_built_outside_compile(mask):
    # a Mask / ScoreMod object was not a plain key: the call built its spec while traced and broke the graph
    score_mod = flashgen.score_mod("score * 0.5")
    _check(lambda q, k, v: flashgen.attention(q, k, v, mask=mask, score_mod=score_mod), _dense, "aot_eager")


def _seq_major(batch, seqlen, heads=4, kv_heads=2, dim=16):
    """Model code's bhsd views of (batch, seq, heads, dim) memory: x.view(B, L, H, D).transpose(1, 2)."""
    return [torch.randn(batch, seqlen, h, dim).transpose(1, 2).requires_grad_() for h in (heads, kv_heads, kv_heads)]


@pytest.mark.interpreter
def test_seq_major_views_compile_with_eagers_output_layout():
    # eager gives out as a bhsd view of bshd memory (as SDPA's): the caller's out.transpose(1, 2).view(B, L, H * D)
    # is a view. Compiled, the op returned contiguous bhsd and that view failed ("Cannot view a tensor ...")
    def layer(q, k, v):
        out = flashgen.attention(q, k, v, causal=True)
        batch, heads, seqlen, dim = out.shape
        return out.transpose(1, 2).view(batch, seqlen, heads * dim)

    _check(layer, _seq_major, "aot_eager")


@pytest.mark.interpreter
def test_the_ops_fake_layouts_are_their_real_ones_for_seq_major_views():
    # inductor asserts the real outputs' strides against the fake ones: the backward's fake gave dq, dk, dv q's, k's
    # and v's strides (empty_like) where the kernels allocate them contiguous (an AssertionError on model code's
    # transposed views); the forward's fake is a bhsd view of bshd memory where the op runs them so
    from flashgen import ops

    kid = flashgen.compile(AttentionSpec(dtype="fp32", head_dim=16, num_heads=4, num_kv_heads=2, causal=True))._id
    q, k, v = (t.detach() for t in _seq_major(3, 17))
    seed = torch.zeros(1, dtype=torch.int64)
    fwd = (q, k, v, seed, [], kid, "bhsd", 0.0, False, None, None, 0, 0)
    out, lse = ops.attn_fwd(*fwd)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = ops._attn_fwd_fake(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in fwd])
    assert fake[0].stride() == out.stride() == out.transpose(1, 2).contiguous().transpose(1, 2).stride()
    do = torch.randn_like(out)
    bwd = (do, q, k, v, out, lse, seed, [], kid, "bhsd", 0.0, False, 0, None, None, 0, 0)
    real = ops.attn_bwd(*bwd)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = ops._attn_bwd_fake(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in bwd])
    assert [f.stride() for f in fake[:3]] == [r.stride() for r in real[:3]]


_DECODE_SPEC = AttentionSpec(dtype="fp32", head_dim=16, num_heads=4, num_kv_heads=2, causal=True, backward=False)


def _decode_inputs(batch, capacity, paged, append, tensor_lengths, gen):
    """q (batch, 1, 4, 16), the caches (contiguous, or pages of 8 in a shuffled block table), new keys and values
    where appending, and cache_seqlens (a tensor, or an int)."""
    q = torch.randn(batch, 1, 4, 16, generator=gen)
    if paged:
        per_seq = capacity // 8
        caches = [torch.randn(batch * per_seq + 3, 8, 2, 16, generator=gen) for _ in range(2)]
        block_table = torch.randperm(batch * per_seq + 3, generator=gen)[: batch * per_seq].view(batch, per_seq)
        block_table = block_table.to(torch.int32)
    else:
        caches = [torch.randn(batch, capacity, 2, 16, generator=gen) for _ in range(2)]
        block_table = None
    new = [torch.randn(batch, 1, 2, 16, generator=gen) for _ in range(2)] if append else [None, None]
    if tensor_lengths:
        lengths = torch.randint(0, capacity - 1, (batch,), generator=gen, dtype=torch.int32)
    else:
        lengths = capacity - 7
    return q, *caches, *new, lengths, block_table


DECODE_ENTRIES = {
    "flash_attn_with_kvcache": lambda q, kc, vc, k, v, n, bt: compat.flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=n, block_table=bt, causal=True, return_softmax_lse=True),
    "flash_attn_with_kvcache window softcap": lambda q, kc, vc, k, v, n, bt: compat.flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=n, block_table=bt, window_size=(20, 0), softcap=30.0),
    "flashgen.decode": lambda q, kc, vc, k, v, n, bt: flashgen.decode(
        _DECODE_KERNEL, q, kc, vc, n, k=k, v=v, block_table=bt, return_lse=True),
}
_DECODE_KERNEL = flashgen.compile(_DECODE_SPEC)


@pytest.mark.parametrize("entry", DECODE_ENTRIES.values(), ids=DECODE_ENTRIES.keys())
@pytest.mark.parametrize("paged, append, tensor_lengths", [(False, False, True), (False, True, True),
                                                           (True, True, True), (False, False, False)],
                         ids=["read", "append", "paged append", "int length"])
@pytest.mark.interpreter
def test_decode_calls_compile(entry, paged, append, tensor_lengths):
    # issue 13 (compat.* under torch.compile(fullgraph=True)): a decode call traced is one custom op, the cache
    # written in place where the call appends; one graph over two batch sizes and cache lengths, against eager on
    # copies of the same inputs (the same kernels: equal to the bit, the caches too)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    torch._dynamo.reset()
    compiled = torch.compile(entry, fullgraph=True, dynamic=True, backend="aot_eager")
    for i, (batch, capacity) in enumerate(((3, 40), (5, 56))):
        args = _decode_inputs(batch, capacity, paged, append, tensor_lengths, gen)
        copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(*args)
        want = entry(*copies)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        torch.testing.assert_close(args[1:3], copies[1:3], atol=0, rtol=0)  # the caches, appended alike
        if append:  # (and written where they belong: each element's new key and value at its length)
            lengths, block_table = args[5], args[6]
            for b in range(batch):
                n = int(lengths[b])
                page, slot = (int(block_table[b, n // 8]), n % 8) if paged else (b, n)
                torch.testing.assert_close(args[1][page, slot], args[3][b, 0], atol=0, rtol=0)
                torch.testing.assert_close(args[2][page, slot], args[4][b, 0], atol=0, rtol=0)


BAD_TRACED_DECODE_CALLS = {
    "a spec, not a kernel object": (lambda q, c, n: flashgen.decode(_DECODE_SPEC, q, c, c, n), "spec_or_kernel"),
    "a float length": (lambda q, c, n: flashgen.decode(_DECODE_KERNEL, q, c, c, 9.0), "cache_seqlens"),
    "k without v": (lambda q, c, n: compat.flash_attn_with_kvcache(q, c, c, c[:, :1], cache_seqlens=n), "v"),
    "a meta block table": (lambda q, c, n: compat.flash_attn_with_kvcache(
        q, c, c, cache_seqlens=n, block_table=torch.zeros(2, 5, dtype=torch.int32, device="meta")), "block_table"),
    "an unknown named tensor": (lambda q, c, n: flashgen.decode(_DECODE_KERNEL, q, c, c, n, bias=c), "bias"),
    "k_cache's heads": (lambda q, c, n: compat.flash_attn_with_kvcache(q, c[:, :, :1].expand(2, 40, 3, 16), c,
                                                                       cache_seqlens=n), "k_cache"),
    "an out buffer": (lambda q, c, n: flashgen.decode(_DECODE_KERNEL, q, c, c, n, out=torch.empty_like(q)), "out"),
    "an lse buffer": (lambda q, c, n: flashgen.decode(_DECODE_KERNEL, q, c, c, n, lse=torch.empty(2, 4, 1)), "lse"),
    "a bool scale": (lambda q, c, n: flashgen.decode(_DECODE_KERNEL, q, c, c, n, softmax_scale=True), "softmax_scale"),
    "a numpy scale": (lambda q, c, n: compat.flash_attn_with_kvcache(q, c, c, cache_seqlens=n,
                                                                     softmax_scale=np.float32(0.25)), "softmax_scale"),
    "a bool split count": (lambda q, c, n: flashgen.decode(_DECODE_KERNEL, q, c, c, n, num_splits=True), "num_splits"),
    "an int prefetch": (lambda q, c, n: flashgen.decode(_DECODE_KERNEL, q, c, c, n, page_prefetch=1), "page_prefetch"),
    "no check": (lambda q, c, n: flashgen.decode(_DECODE_KERNEL, q, c, c, n, check=None), "check"),
    "a 2-d q": (lambda q, c, n: flashgen.decode(_DECODE_KERNEL, q[:, 0, 0], c, c, n), "q"),
}


@pytest.mark.parametrize("case", BAD_TRACED_DECODE_CALLS.values(), ids=BAD_TRACED_DECODE_CALLS.keys())
@pytest.mark.interpreter
def test_bad_decode_input_traced_names_the_argument(case):
    call, name = case
    q, cache = torch.randn(2, 1, 4, 16), torch.randn(2, 40, 2, 16)
    n = torch.full((2,), 9, dtype=torch.int32)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=rf"{re.escape(name)}'?:"):
        torch.compile(call, fullgraph=True, backend="eager")(q, cache, n)


@pytest.mark.interpreter
def test_a_traced_decode_call_records_no_gradient():
    # decode is forward-only: eager's output requires no grad, and the compiled one must not claim one (a backward
    # through it ran and left q.grad None)
    q = torch.randn(2, 1, 4, 16, requires_grad=True)
    cache = torch.randn(2, 40, 2, 16)
    call = lambda q, c: flashgen.decode(_DECODE_KERNEL, q, c, c, 9)  # noqa: E731
    torch._dynamo.reset()
    got = torch.compile(call, fullgraph=True, backend="aot_eager")(q, cache)
    assert not got.requires_grad and not call(q, cache).requires_grad


def test_an_fp8_q_traced_takes_the_bf16_spec_its_eager_call_takes():
    # flash-attn 3's all-FP8 call computes and outputs in bf16: traced, the kernel id was an FP8 spec's (whose
    # decode launcher refused it when the compiled call ran) and the fake's output FP8
    from flashgen import kvcache, ops

    q8 = torch.randn(2, 1, 4, 16).to(torch.float8_e4m3fn)
    cache = torch.randn(2, 40, 2, 16).to(torch.float8_e4m3fn)
    kernel_id = kvcache.traced_compat_id(q8, cache, cache, True, None, None, None)
    assert ops.kernel_spec(kernel_id)[0].dtype == "bf16"
    assert kvcache.compat_launcher(q8, cache, cache, True, (-1, -1), 0.0, None, None) is kvcache._launcher(kernel_id)
    args = (q8, cache, cache, None, None, None, 30, None, None, [], kernel_id, None, True, 0, None, None, None, None,
            None, "async", None, None, None)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        out, lse = kvcache.decode_read_op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


@pytest.mark.interpreter
def test_the_decode_ops_fake_is_their_real_output():
    from flashgen import kvcache

    q, k_cache, v_cache = torch.randn(3, 2, 4, 16), torch.randn(3, 40, 2, 16), torch.randn(3, 40, 2, 8)
    spec = _DECODE_SPEC.replace(head_dim_v=8)
    kernel_id = flashgen.compile(spec).kernel_id()
    for return_lse in (True, False):
        args = (q, k_cache, v_cache, None, None, None, 30, None, None, [], kernel_id, None, return_lse, 0, None, None,
                None, None, None, "async", None, None, None)
        real = kvcache.decode_read_op(*args)
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fake = kvcache.decode_read_op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
        assert [(f.shape, f.stride(), f.dtype) for f in fake] == [(r.shape, r.stride(), r.dtype) for r in real]
    # called directly with a meta tensor among real ones, the dispatcher runs the fake: refused, named as the
    # argument it is (the fake's check named the caches k and v, the new keys k_new)
    for i, name in ((1, "k_cache"), (2, "v_cache")):
        meta = list(args)
        meta[i] = meta[i].to("meta")
        with pytest.raises(ValueError, match=f"^{name}: expected a tensor with data, got a meta tensor"):
            kvcache.decode_read_op(*meta)


@pytest.mark.interpreter
def test_padding_free_transformers_calls_compile_once_across_their_max_lengths():
    # max_length_q/k went through operator.index, which specialized the traced length: a recompile per batch
    from flashgen.integrations.transformers import attention_forward

    def call(q, k, v, cu, longest):
        return attention_forward(torch.nn.Module(), q, k, v, None, is_causal=True, cu_seq_lens_q=cu,
                                 cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)[0]

    def make(batch, seqlen):
        q, k, v, cu, longest = _packed(batch, seqlen)
        return [t.detach()[None].transpose(1, 2).requires_grad_() for t in (q, k, v)] + [cu, longest]

    _check(call, make, "aot_eager")


@pytest.mark.interpreter
def test_flash_attn_func_returning_its_lse_compiles():
    # return_attn_probs=True (flash-attn's way to get the LSE) built a spec for the dense probabilities while traced:
    # a graph break. Compiled, the probabilities are None (as varlen's) and the LSE is the kernel's
    torch._dynamo.reset()

    def lse_of(q, k, v):
        out, lse, probs = compat.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        assert probs is None
        return out, lse

    compiled = torch.compile(lse_of, fullgraph=True, dynamic=True, backend="aot_eager")
    for i, (batch, seqlen) in enumerate(SHAPES):
        q, k, v = (t.detach() for t in _dense(batch, seqlen, layout="bshd"))
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out, lse = compiled(q, k, v)
        ref_out, ref_lse, probs = compat.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        assert probs is not None  # eager: the dense probabilities, as before
        torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=0)
        torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=0)


_PACKED_CU = torch.tensor([0, 10, 17], dtype=torch.int32)
BAD_TRACED_CALLS = {
    # (call, the argument its error names): a spec field, a scalar without a call key, a named tensor's name,
    # packed lengths' type
    "scale": (lambda q, k, v: flashgen.attention(q, k, v, softmax_scale=-1.0), "softmax_scale"),
    "scale True": (lambda q, k, v: flashgen.attention(q, k, v, softmax_scale=True), "softmax_scale"),
    "causal": (lambda q, k, v: flashgen.attention(q, k, v, causal="yes"), "causal"),
    "mask": (lambda q, k, v: flashgen.attention(q, k, v, mask="q_idx <<= kv_idx"), "mask.expr"),
    "heads": (lambda q, k, v: flashgen.attention(q, k[:, :3], v[:, :3]), "k"),
    "dtype": (lambda q, k, v: flashgen.attention(q.double(), k.double(), v.double()), "q"),
    "causal 1": (lambda q, k, v: flashgen.attention(q, k, v, causal=1), "causal"),
    # calls without a key (their spec is built untraced): the tensors and layout named first
    "q 3-d": (lambda q, k, v: flashgen.attention(q[0], k, v), "q"),
    "layout": (lambda q, k, v: flashgen.attention(q, k, v, layout="xyz"), "layout"),
    "sdpa scale True": (lambda q, k, v: flashgen.scaled_dot_product_attention(q, k, v, scale=True), "scale"),
    "sdpa mask shape": (lambda q, k, v: flashgen.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.ones(3, 17, 17, dtype=torch.bool)), "attn_mask"),  # (4 heads: 3 does not broadcast)
    "misspelled tensor": (lambda q, k, v: flashgen.attention(q, k, v, score_mod="score + bias[kv_idx]",
                                                             bais=torch.zeros(17)), "bais"),
    "extra tensor": (lambda q, k, v: flashgen.attention(q, k, v, bias=torch.zeros(17)), "bias"),
    "varlen dropout": (lambda q, k, v: flashgen.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                                                 v[0].transpose(0, 1), _PACKED_CU, _PACKED_CU, 10,
                                                                 10, dropout_p=2.0), "dropout_p"),
    "float max_seqlen": (lambda q, k, v: flashgen.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                                                   v[0].transpose(0, 1), _PACKED_CU, _PACKED_CU,
                                                                   10.0, 10), "max_seqlen_q"),
    # a review's (session 57): a string or tensor scalar failed inside the float specialization or a tensor's
    # repr, or reached the untraced spec build; offsets as lists failed in the op's fake
    "scale str": (lambda q, k, v: flashgen.attention(q, k, v, softmax_scale="0.1"), "softmax_scale"),
    "scale tensor": (lambda q, k, v: flashgen.attention(q, k, v, softmax_scale=torch.tensor(0.1)), "softmax_scale"),
    "dropout tensor": (lambda q, k, v: flashgen.attention(q, k, v, dropout_p=torch.tensor(0.1)), "dropout_p"),
    "causal tensor": (lambda q, k, v: flashgen.attention(q, k, v, causal=torch.tensor(True)), "causal"),
    "sdpa scale tensor": (lambda q, k, v: flashgen.scaled_dot_product_attention(q, k, v, scale=torch.tensor(0.1)),
                          "scale"),
    "varlen lists": (lambda q, k, v: flashgen.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                                               v[0].transpose(0, 1), [0, 10, 17], [0, 10, 17], 10, 10),
                     "cu_seqlens_q"),
    # a meta tensor among real ones ran the op's fake (its Meta kernel): memory nothing wrote, returned silently
    "meta k": (lambda q, k, v: flashgen.attention(q, k.to("meta"), v), "k"),
    "meta named tensor": (lambda q, k, v: flashgen.attention(q, k, v, score_mod="score + bias[h]",
                                                             bias=torch.zeros(4, device="meta")), "bias"),
    "meta offsets": (lambda q, k, v: flashgen.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                                               v[0].transpose(0, 1), _PACKED_CU.to("meta"),
                                                               _PACKED_CU, 10, 10), "cu_seqlens_q"),
    "config dict": (lambda q, k, v: flashgen.attention(q, k, v, config={"BLOCK_M": 16}), "config"),
    "FP8 descale list": (lambda q, k, v: flashgen.attention(*(t.to(torch.float8_e4m3fn) for t in (q, k, v)),
                                                            q_descale=[1.0] * 4), "q_descale"),
    "FP8 descale meta": (lambda q, k, v: flashgen.attention(*(t.to(torch.float8_e4m3fn) for t in (q, k, v)),
                                                            k_descale=torch.ones(1, 4, device="meta")), "k_descale"),
}


@pytest.mark.parametrize("case", BAD_TRACED_CALLS.values(), ids=BAD_TRACED_CALLS.keys())
@pytest.mark.interpreter
def test_bad_input_traced_names_the_argument(case):
    # a refused spec field was raised inside a constant-result function: dynamo reported an internal error of its
    # own, even without fullgraph, where it runs the call eagerly instead (whose error names the argument); a
    # misspelled or extra named tensor and a float max_seqlen were taken (no error) or failed in the op's fake.
    # Now fullgraph's error carries flashgen's (dynamo reports every exception raised in traced code as an
    # "Observed exception" holding it), and without fullgraph the call's own error is raised
    call, name = case
    q, k, v = (torch.randn(1, 4, 17, 16) for _ in range(3))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=rf"raised exception \w+Error\(.*[('\"]{re.escape(name)}'?:") as err:
        torch.compile(call, fullgraph=True, backend="eager")(q, k, v)
    assert "Internal" not in type(err.value).__name__
    try:
        call(q, k, v)
    except (TypeError, ValueError) as eager_error:
        eager = eager_error
    torch._dynamo.reset()
    with pytest.raises(SpecError if isinstance(eager, SpecError) else type(eager)) as err:
        torch.compile(call, backend="eager")(q, k, v)
    assert str(err.value) == str(eager)  # the eager call's error, of its type (a spec's: a SpecError)


@pytest.mark.interpreter
def test_a_call_given_a_config_compiles_on_a_cold_process(monkeypatch):
    # config= inside the compiled function took the eager binding (spec_for: a graph break) unless an eager call
    # had bound its key first; now the traced binding takes the config as it takes the tuned one
    from flashgen import api

    monkeypatch.setattr(api, "_BOUND", {})  # a cold process: no key bound
    config = KernelConfig(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)
    _check(lambda q, k, v: flashgen.attention(q, k, v, causal=True, config=config), _dense, "aot_eager")
    bound = [kernel.config for kernel in api._BOUND.values() if kernel.config == config]
    assert bound
    # an equal config made per call keeps the graph (a KernelConfig passed as is was guarded by its identity)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, config: flashgen.attention(q, k, v, causal=True, config=config),
                             fullgraph=True, dynamic=True, backend="eager")
    for i, (batch, seqlen) in enumerate(SHAPES):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            compiled(*_dense(batch, seqlen), KernelConfig(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1))


@pytest.mark.parametrize("kind", ["numpy int32", "numpy int64", "tensor", "None"])
@pytest.mark.interpreter
def test_a_max_seqlen_traced_is_a_python_int(kind):
    # eager takes any integer (numbers.Integral); traced, dynamo reads a numpy integer as an array the op cannot
    # take (an int32 failed in the op's fake, an int64 passed), and a tensor was taken where eager refuses it: a
    # traced call takes a Python int and names max_seqlen_q for anything else
    np = pytest.importorskip("numpy")
    q, k, v, cu, longest = _packed(3, 17)
    bad = {"numpy int32": np.int32, "numpy int64": np.int64, "tensor": torch.tensor, "None": lambda n: None}[kind]
    torch._dynamo.reset()
    with pytest.raises(Exception, match="max_seqlen_q: expected a non-negative int"):
        torch.compile(lambda q, k, v: flashgen.attention_varlen(q, k, v, cu, cu, bad(longest), longest),
                      fullgraph=True, dynamic=True, backend="eager")(q, k, v)


def _packed_from(q, k, v):
    """(B, H, S, D) q, k, v as packed sequences of S, S - 7, ... tokens (each batch row's first), their offsets and
    the longest length: attention_varlen's arguments, made outside the compiled function (as a data loader would)."""
    batch, seqlen = q.shape[0], q.shape[2]
    lengths = [seqlen - 7 * i for i in range(batch)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
    packed = [torch.cat([t[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)]) for t in (q, k, v)]
    return (*packed, cu, max(lengths))


INDUCTOR_CALLS = {  # name: (call(layer, *args), the args from q, k, v (B, H, S, D))
    "attention": (lambda layer, q, k, v: flashgen.attention(q, k, v, causal=True), None),
    "attention on seq-major views": (lambda layer, q, k, v: flashgen.attention(q, k, v, causal=True).transpose(
        1, 2).reshape(q.shape[0], q.shape[2], -1), lambda *qkv: [t.transpose(1, 2).contiguous().transpose(1, 2)
                                                                 for t in qkv]),
    "attention config": (lambda layer, q, k, v: flashgen.attention(q, k, v, causal=True, config=layer.config), None),
    "attention_varlen": (lambda layer, q, k, v, cu, n: flashgen.attention_varlen(q, k, v, cu, cu, n, n, causal=True),
                         _packed_from),
    "flash_attn_func softcap window": (lambda layer, q, k, v: compat.flash_attn_func(
        q, k, v, causal=True, softcap=layer.value, window_size=(100, 0)),
        lambda *qkv: [t.transpose(1, 2) for t in qkv]),
    "sdpa float mask": (lambda layer, q, k, v: flashgen.scaled_dot_product_attention(
        q, k, v, attn_mask=layer.bias[: q.shape[2], : q.shape[2]], scale=layer.value / 100, enable_gqa=True), None),
    "transformers softcap window": (lambda layer, q, k, v: _transformers_forward(layer, q, k, v, softcap=layer.value,
                                                                                sliding_window=64), None),
}


class _InductorLayer(torch.nn.Module):
    """An INDUCTOR_CALLS call as a module: its scalar, config and bias tensor are attributes."""
    value = 30.3
    config = KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)

    def __init__(self, call):
        super().__init__()
        self.call = call
        self.bias = torch.randn(512, 512, device="cuda")

    def forward(self, *args):
        return self.call(self, *args)


def _check_inductor_calls(case, shapes, **compile_kw):
    """The case's layer compiled (fullgraph, compile_kw) and called at each (batch, seqlen) on fresh bf16 inputs,
    forward and backward against eager on the same inputs (the same kernels run, with inductor's code around them);
    from the second call on, a recompile fails."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    call, prepare = case
    layer = _InductorLayer(call)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, **compile_kw)
    for i, (batch, seqlen) in enumerate(shapes):
        q, k, v = (torch.randn(batch, h, seqlen, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for h in (8, 2, 2))
        args = (prepare or (lambda *qkv: qkv))(q, k, v)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = compiled(*args)
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
        ref = layer(*args)
        ref_grads = torch.autograd.grad(ref, (q, k, v), do)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("case", INDUCTOR_CALLS.values(), ids=INDUCTOR_CALLS.keys())
def test_gpu_every_entry_point_compiles_with_inductor(case):
    # issue 13: torch.compile(fullgraph=True, dynamic=True) with inductor on the GPU, forward and backward, one graph
    # over two batch sizes and lengths (apart from the head counts)
    _check_inductor_calls(case, ((3, 200), (5, 333)), dynamic=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", INDUCTOR_CALLS.values(), ids=INDUCTOR_CALLS.keys())
def test_gpu_every_entry_point_runs_in_cuda_graph_trees(case):
    # torch.compile(mode="reduce-overhead"): inductor's CUDA graph trees run a graph's first calls uncaptured with
    # every allocation in the graphs' pool, then capture it, and fail a call after which a tensor of that pool
    # outlives it (flashgen's plans, block maps and one-element arguments, kept per shape, were; transformers'
    # compiled generation runs so). A shape no other test runs, so that these calls make their plans inside the
    # trees; three calls (warmup, capture, replay).
    _check_inductor_calls(case, ((3, 211),) * 3, mode="reduce-overhead")


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpu_decode_compiles_with_inductor_writing_the_cache_in_place(paged):
    # flash_attn_with_kvcache appending a token, then flashgen.decode reading the cache, in one compiled step
    # (inductor, fullgraph, dynamic), against eager on copies: the same kernels, so the outputs and caches are
    # equal to the bit. The cache is written in place: inductor runs the appending op on the cache itself (a copy
    # of a 64 MiB cache per step would show in the peak memory)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    kernel = flashgen.compile(AttentionSpec(dtype="bf16", head_dim=128, num_heads=32, num_kv_heads=8, causal=True,
                                            backward=False))

    def step(q, k_cache, v_cache, k, v, lengths, block_table):
        out = compat.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                             block_table=block_table, causal=True)
        again = flashgen.decode(kernel, q, k_cache, v_cache, lengths + 1, block_table=block_table)
        return out, again

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(2**31))

    def fresh(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    for i, (batch, capacity) in enumerate(((4, 4096), (6, 2048))):
        q, k, v = fresh(batch, 1, 32, 128), fresh(batch, 1, 8, 128), fresh(batch, 1, 8, 128)
        if paged:
            pages = batch * capacity // 256
            k_cache, v_cache = fresh(pages, 256, 8, 128), fresh(pages, 256, 8, 128)
            block_table = torch.randperm(pages, device="cuda", generator=gen).view(batch, -1).to(torch.int32)
        else:
            k_cache, v_cache, block_table = fresh(batch, capacity, 8, 128), fresh(batch, capacity, 8, 128), None
        lengths = torch.randint(1, capacity - 1, (batch,), device="cuda", dtype=torch.int32, generator=gen)
        caches = (k_cache.clone(), v_cache.clone())
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            compiled(q, k_cache, v_cache, k, v, lengths, block_table)  # (compiles; the measured call is the next)
            k_cache.copy_(caches[0]), v_cache.copy_(caches[1])
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            got = compiled(q, k_cache, v_cache, k, v, lengths, block_table)
            torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - before < k_cache.nbytes // 4, "the compiled step copied the cache"
        want = step(q, *caches, k, v, lengths, block_table)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        torch.testing.assert_close((k_cache, v_cache), caches, atol=0, rtol=0)


@pytest.mark.gpu
def test_gpu_decode_runs_in_cuda_graph_trees():
    # flash_attn_with_kvcache reading a cache and flashgen.decode over it under mode="reduce-overhead" (CUDA graph
    # trees: warmup, capture, replays): a length and a batch no other test runs (their split buffers, tickets and
    # length tables are made inside the trees and must not be kept), against eager on the same inputs
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    kernel = flashgen.compile(AttentionSpec(dtype="bf16", head_dim=128, num_heads=16, num_kv_heads=4, causal=True,
                                            backward=False))

    def step(q, k_cache, v_cache, lengths):
        out = compat.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True)
        return out, flashgen.decode(kernel, q, k_cache, v_cache, lengths)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(2**31))
    for _ in range(4):
        q = torch.randn(7, 1, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        k_cache, v_cache = (torch.randn(7, 3001, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                            for _ in range(2))
        lengths = torch.randint(1, 3001, (7,), device="cuda", dtype=torch.int32, generator=gen)
        got = [t.clone() for t in compiled(q, k_cache, v_cache, lengths)]
        torch.testing.assert_close(got, list(step(q, k_cache, v_cache, lengths)), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_q", [False, True], ids=["bf16 q", "FP8 q"])
def test_gpu_fp8_cache_decode_compiles(fp8_q):
    # an FP8 cache (sm90: the Gluon FP8-cache kernel) under inductor, with a bf16 q or an FP8 one (flash-attn 3's
    # all-FP8 call: out in bf16): new keys quantized into the cache on write, out and LSE equal to eager's on
    # copies, the caches' bytes too
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 (sm89+)")
    gen = torch.Generator(device="cuda").manual_seed(random.randrange(2**31))
    q = torch.randn(8, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    q_descale = None
    if fp8_q:
        q, q_descale = q.to(torch.float8_e4m3fn), torch.rand(8, 8, device="cuda", generator=gen) + 0.5
    k_cache, v_cache = (torch.randn(8, 4096, 8, 128, device="cuda", generator=gen).to(torch.float8_e4m3fn)
                        for _ in range(2))
    k_descale, v_descale = (torch.rand(8, 8, device="cuda", generator=gen) + 0.5 for _ in range(2))
    k, v = (torch.randn(8, 1, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    lengths = torch.randint(1, 4000, (8,), device="cuda", dtype=torch.int32, generator=gen)

    def call(q, k_cache, v_cache, k, v, lengths, k_descale, v_descale):
        return compat.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True,
                                             q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                             return_softmax_lse=True)

    torch._dynamo.reset()
    copies = (k_cache.clone(), v_cache.clone())
    got = torch.compile(call, fullgraph=True, dynamic=True)(q, k_cache, v_cache, k, v, lengths, k_descale, v_descale)
    want = call(q, *copies, k, v, lengths, k_descale, v_descale)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert got[0].dtype == torch.bfloat16
    for a, b in zip((k_cache, v_cache), copies):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_traced_size_past_the_search_limit_is_not_capped():
    # _static_int's binary search ran below its limit (4096): a traced head count past it read as the limit
    from flashgen import api

    torch._dynamo.reset()
    sized = torch.compile(lambda x: x.new_zeros(api._static_int(x.shape[1], 8)), fullgraph=True, dynamic=True,
                          backend="eager")
    assert sized(torch.zeros(2, 20)).shape == (20,)
    assert sized(torch.zeros(2, 8)).shape == (8,)


@pytest.mark.interpreter
def test_a_kernel_object_given_a_config_it_has_not_run_compiles():
    # kernel(q, k, v, config=...) worked traced only once an eager call had run that config: its id serializes the
    # config (json), which dynamo cannot trace
    spec = AttentionSpec(dtype="fp32", head_dim=16, num_heads=4, num_kv_heads=2, causal=True)
    kernel = flashgen.compile(spec)
    config = KernelConfig(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)
    _check(lambda q, k, v: kernel(q, k, v, config=config), _dense, "aot_eager")
    refused = KernelConfig(BLOCK_M=128, BLOCK_N=128, family="hopper_ws")  # (fp32 is not the family's)
    for fullgraph in (True, False):
        torch._dynamo.reset()
        with pytest.raises(Exception, match="config knob 'family': 'hopper_ws' cannot serve"):
            torch.compile(lambda q, k, v: kernel(q, k, v, config=refused), fullgraph=fullgraph,
                          backend="eager")(*_dense(3, 17))


@pytest.mark.interpreter
def test_a_kernel_object_traced_names_a_meta_tensor_and_a_config_that_is_not_one():
    # traced, a meta tensor among real ones returned the op's fake output (memory nothing wrote), and a config
    # given as a dict failed in dynamo (its values were read before its type was checked)
    spec = AttentionSpec(dtype="fp32", head_dim=16, num_heads=4, num_kv_heads=2, score_mod="score + bias[h]")
    kernel = flashgen.compile(spec)
    q, k, v = (torch.randn(1, h, 17, 16) for h in (4, 2, 2))
    bias = torch.zeros(4)
    calls = {
        "k": lambda q, k, v: kernel(q, k.to("meta"), v, bias=bias),
        "bias": lambda q, k, v: kernel(q, k, v, bias=bias.to("meta")),
        "cu_seqlens_k": lambda q, k, v: kernel.varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                                      _PACKED_CU, _PACKED_CU.to("meta"), 10, 10, bias=bias),
        "config": lambda q, k, v: kernel(q, k, v, config={"BLOCK_M": 16}, bias=bias),
    }
    for name, call in calls.items():
        with pytest.raises((TypeError, ValueError)) as eager:
            call(q, k, v)
        assert str(eager.value).startswith(f"{name}:")
        torch._dynamo.reset()
        with pytest.raises(Exception, match=rf"raised exception \w+Error\(.*[('\"]{name}:"):
            torch.compile(call, fullgraph=True, backend="aot_eager")(q, k, v)
    # the op itself, called with a meta tensor among real ones (its fake is the Meta kernel the dispatcher picks)
    from flashgen import ops

    seed = torch.empty(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="^k: expected a tensor with data, got a meta tensor"):
        ops.attn_fwd(q, k.to("meta"), v, seed, [bias], kernel.kernel_id(), "bhsd", 0.0, False, None, None, 0, 0)
    meta = [t.to("meta") for t in (q, k, v, seed, bias)]  # all on meta: shapes only, as before
    out, lse = ops.attn_fwd(*meta[:4], [meta[4]], kernel.kernel_id(), "bhsd", 0.0, False, None, None, 0, 0)
    assert out.device.type == "meta" and out.shape == (1, 4, 17, 16) and lse.shape == (1, 4, 17)


@pytest.mark.interpreter
def test_sdpa_with_a_numpy_scale_compiles_without_fullgraph():
    # numpy scalars are SDPA's scales too; traced, dynamo reads one as an array, which the float specialization
    # must still take (a review caught a change that refused it by type)
    import numpy as np

    q, k, v = (torch.randn(1, 2, 17, 16) for _ in range(3))
    for scale in (1 / np.sqrt(16), np.float32(0.3)):
        def call(q, k, v):
            return flashgen.scaled_dot_product_attention(q, k, v, scale=scale)

        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(call, backend="eager")(q, k, v), call(q, k, v), atol=1e-6, rtol=0)
