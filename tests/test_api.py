"""flashgen.attention / flashgen.compile: argument errors name the argument."""

import os
import re

import pytest
import torch

import flashgen
from flashgen import AttentionSpec
from flashgen.verify import reference_attention


DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") else "cpu"


def t(*shape, dtype=torch.float16):
    return torch.randn(*shape).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("q,k,v,layout,words", [
    (t(1, 2, 8, 16), t(1, 2, 8, 16), t(1, 2, 8, 16), "bsdh", "layout: expected 'bhsd', 'bshd' or 'thd'"),
    (t(2, 8, 16), t(1, 2, 8, 16), t(1, 2, 8, 16), "bhsd", "q: expected a 4-d tensor"),
    (t(1, 2, 8, 16), t(1, 2, 8, 16), [1, 2], "bhsd", "v: expected a torch.Tensor"),
    (t(1, 2, 8, 16, dtype=torch.int32), t(1, 2, 8, 16), t(1, 2, 8, 16), "bhsd", "q: expected dtype"),
    (t(1, 2, 8, 16), t(1, 2, 8, 16, dtype=torch.float32), t(1, 2, 8, 16), "bhsd", "k: expected dtype torch.float16"),
    (t(1, 4, 8, 16), t(1, 3, 8, 16), t(1, 3, 8, 16), "bhsd", "k: expected a number of heads that divides q's 4"),
    (t(1, 2, 8, 16), t(1, 2, 8, 32), t(1, 2, 8, 16), "bhsd", "k: expected (batch, heads, head_dim) = (1, 2, 16)"),
    (t(1, 2, 8, 16), t(2, 2, 8, 16), t(1, 2, 8, 16), "bhsd", "k: expected (batch, heads, head_dim) = (1, 2, 16)"),
    (t(1, 2, 8, 16), t(1, 2, 8, 16), t(1, 2, 9, 16), "bhsd", "v: expected seqlen 8"),
    (t(1, 2, 8, 300), t(1, 2, 8, 300), t(1, 2, 8, 300), "bhsd", "q: expected a head dim from 1 to 256, got 300"),
    (t(1, 2, 8, 0), t(1, 2, 8, 0), t(1, 2, 8, 0), "bhsd", "q: expected a head dim from 1 to 256, got 0"),
    (t(1, 8, 2, 16), t(1, 8, 1, 16), t(1, 8, 1, 16), "bshd", "v: expected (batch, heads, head_dim) = (1, 1, 16)"),
    # sparse tensors have no strides to read (a RuntimeError from the plan's key, naming nothing, before)
    (t(1, 2, 8, 16).cpu().to_sparse(), t(1, 2, 8, 16), t(1, 2, 8, 16), "bhsd",
     "q: expected a dense (strided) tensor, got layout torch.sparse_coo"),
    (t(1, 2, 8, 16), t(1, 2, 8, 16), t(1, 2, 8, 16).cpu().to_sparse(), "bhsd",
     "v: expected a dense (strided) tensor, got layout torch.sparse_coo"),
])
def test_bad_arguments_name_the_argument(q, k, v, layout, words):
    if layout == "bshd":  # v's head count disagrees with k's
        v = t(1, 8, 2, 16)
    with pytest.raises((ValueError, TypeError)) as info:
        flashgen.attention(q, k, v, layout=layout)
    assert words in str(info.value)


def test_a_sparse_named_tensor_is_refused_by_name():
    q = t(1, 2, 8, 16)
    bias = torch.zeros(8, 8).to_sparse()
    with pytest.raises(ValueError, match="bias: expected a dense .strided. tensor, got layout torch.sparse_coo"):
        flashgen.attention(q, q, q, score_mod="score + bias[q_idx, kv_idx]", bias=bias)


def test_compiled_kernel_checks_against_its_spec():
    kernel = flashgen.compile(AttentionSpec(head_dim=16, num_heads=4, num_kv_heads=2))
    with pytest.raises(ValueError, match=r"q: expected \(batch, heads, head_dim\) = \(1, 4, 16\)"):
        kernel(t(1, 2, 8, 16), t(1, 2, 8, 16), t(1, 2, 8, 16))
    with pytest.raises(ValueError, match="spec dtype fp16"):
        kernel(t(1, 4, 8, 16, dtype=torch.float32), t(1, 2, 8, 16), t(1, 2, 8, 16))
    assert "AttentionKernel(" in repr(kernel)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cpu = [torch.randn(1, 1, 4, 16, dtype=torch.float16) for _ in range(3)]
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):
        flashgen.attention(*cpu)


@pytest.mark.interpreter  # a kernel module imported under the interpreter stays so
def test_bf16_under_the_interpreter_is_refused():
    # Triton's interpreter computes bf16 dot products wrong (errors of 1e8 on unit inputs): refused, on
    # every path that runs a kernel, rather than returned
    from flashgen.kvcache import decode

    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    kernel = flashgen.compile(AttentionSpec(dtype="bf16", head_dim=16, num_heads=2))
    for call in (lambda: flashgen.attention(q, q, q, causal=True), lambda: kernel(q, q, q)):
        with pytest.raises(ValueError, match=r"^q: dtype torch.bfloat16 under Triton's interpreter"):
            call()
    with pytest.raises(ValueError, match=r"^k_cache: dtype torch.bfloat16 under Triton's interpreter"):
        decode(kernel, q.transpose(1, 2)[:, :1], q.transpose(1, 2), q.transpose(1, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to mix devices")
def test_mixed_devices_name_the_argument():
    q = torch.randn(1, 1, 4, 16, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="k: expected device cuda"):
        flashgen.attention(q, q.cpu(), q)


def test_compile_accepts_yaml_path_and_dict(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("head_dim: 16\nnum_heads: 2\n")
    assert flashgen.compile(path).spec == flashgen.compile({"head_dim": 16, "num_heads": 2}).spec
    assert flashgen.compile(str(path)) is flashgen.compile(str(path))  # compiled once, reused


def test_ops_build_a_kernel_from_its_id_alone():
    # the id says everything: no kernel object registers itself, a fresh id works at once
    from flashgen import KernelConfig, ops

    spec = AttentionSpec(dtype="fp32", head_dim=16, num_heads=2, causal=True, name="from-id")
    config = KernelConfig(BLOCK_M=16, BLOCK_N=16, num_stages=1)
    kernel_id = ops.kernel_id(spec, config)
    assert ops.kernel_spec(kernel_id) == (spec, config) and not hasattr(ops, "register")
    q, k, v = (torch.randn(1, 2, 9, 16, device=DEVICE) for _ in range(3))
    out, lse = torch.ops.flashgen.attn_fwd(q, k, v, torch.empty(1, dtype=torch.int64, device=DEVICE), [], kernel_id,
                                           "bhsd", 0.0, False, None, None, 0, 0)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(out, ref, atol=1e-5)
    assert flashgen.compile(spec, config).kernel_id() == kernel_id
    assert flashgen.compile(spec, config).module() is ops.kernel_module(kernel_id)  # one module per id


def test_compile_is_public_without_shadowing_the_builtin():
    import builtins

    from flashgen import api

    assert flashgen.compile is api.compile_spec and not hasattr(api, "compile")
    assert builtins.compile("1", "<x>", "eval")  # the builtin is untouched


def test_one_off_call_uses_the_stored_tuned_config(monkeypatch):
    """flashgen.attention binds the tuned configs per bucket that flashgen.load would use (issue 13: 3),
    looked up once per key, and runs the nearest bucket's kernel."""
    from flashgen import api, loader, ops
    from flashgen.config import KernelConfig

    tuned = KernelConfig(BLOCK_M=16, BLOCK_N=16, num_warps=2, num_stages=1)
    lookups, ids = [], []
    monkeypatch.setattr(api, "_BOUND", {})
    monkeypatch.setattr(loader, "lookup", lambda spec, *a, **kw: lookups.append(spec) or ({64: tuned}, "database x"))
    apply = ops.apply_attention
    monkeypatch.setattr(ops, "apply_attention", lambda *a, **kw: ids.append(kw["kernel_id"]) or apply(*a, **kw))
    q = t(1, 2, 9, 16)
    flashgen.attention(q, q, q, causal=True)
    flashgen.attention(q, q, q, causal=True)
    assert len(lookups) == 1 and ids[0] == ids[1] and '"BLOCK_M":16' in ids[0]
    kernel = next(iter(api._BOUND.values()))
    assert kernel.config_source == "database x" and kernel.bucket_configs == {64: tuned}


def test_one_off_call_falls_back_silently_when_results_cannot_be_read(monkeypatch, recwarn):
    from flashgen import api, loader

    def broken(*a, **kw):
        raise RuntimeError("database is locked")

    monkeypatch.setattr(api, "_BOUND", {})
    monkeypatch.setattr(loader, "lookup", broken)
    q = t(1, 2, 9, 16)
    out = flashgen.attention(q, q, q, causal=True)
    assert out.shape == q.shape and not recwarn.list
    assert next(iter(api._BOUND.values())).config_source == "default"


def test_a_bound_call_is_one_lookup_and_function_masks_are_not_kept(monkeypatch):
    """After its first call, an eager call is found by its raw arguments (no _call_key, no spec),
    pattern dicts too (compat's windows, the transformers integration: frozen into the key, so a
    dict changed in place is a new key); masks given as functions are not kept as keys (each
    would be a new key)."""
    from flashgen import api

    monkeypatch.setattr(api, "_BOUND", {})
    q = t(1, 2, 9, 16)
    window = {"sliding_window": {"left": 4}}
    first = flashgen.attention(q, q, q, causal=True, mask=window)
    flashgen.attention(q, q, q, causal=True)
    keys = []
    original = api._call_key
    monkeypatch.setattr(api, "_call_key", lambda *a: keys.append(1) or original(*a))
    flashgen.attention(q, q, q, causal=True)
    assert torch.equal(flashgen.attention(q, q, q, causal=True, mask={"sliding_window": {"left": 4}}), first)
    assert not keys
    window["sliding_window"]["left"] = 1  # the same dict, another pattern: bound afresh, not the old kernel
    narrow = flashgen.attention(q, q, q, causal=True, mask=window)
    assert keys == [1]
    torch.testing.assert_close(narrow, reference_attention(q, q, q, causal=True, mask=window)[0].half(), atol=2e-3, rtol=2e-3)
    before = len(api._BOUND)
    flashgen.attention(q, q, q, mask=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx)
    assert len(api._BOUND) == before


def _fast_path_calls(monkeypatch):
    """Counts of the slow path's binding (api._eager_binding) per call, with empty binding tables."""
    from flashgen import api

    monkeypatch.setattr(api, "_BOUND", {})
    monkeypatch.setattr(api, "_FAST", {})
    slow = []
    binding = api._eager_binding
    monkeypatch.setattr(api, "_eager_binding", lambda *a: slow.append(1) or binding(*a))
    return slow


def test_a_repeated_no_grad_call_is_one_lookup_and_its_plan(monkeypatch):
    """Issue 13: a no-grad call seen before runs its plan after one dict lookup on its tensors' metadata
    (no binding, spec, plan key); fresh inputs give the reference's output, and any change of metadata
    (strides, dtype, a binding argument) or a gradient to record takes the checked path again."""
    from flashgen import api

    slow = _fast_path_calls(monkeypatch)
    q, k, v = t(1, 2, 40, 16), t(1, 2, 40, 16), t(1, 2, 40, 16)
    first = flashgen.attention(q, k, v, causal=True)
    assert len(slow) == 1
    for _ in range(2):
        q, k, v = t(1, 2, 40, 16), t(1, 2, 40, 16), t(1, 2, 40, 16)
        out = flashgen.attention(q, k, v, causal=True)
        torch.testing.assert_close(out, reference_attention(q, k, v, causal=True)[0].half(), atol=2e-3, rtol=2e-3)
    assert len(slow) == 1 and out.shape == first.shape and out.is_contiguous()
    flashgen.attention(q, k, v, causal=False)  # another binding
    flashgen.attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, causal=True)  # other strides
    flashgen.attention(q.float(), k.float(), v.float(), causal=True)
    assert len(slow) == 4
    # a gradient to record: the autograd function (handed the plan once seen), whose gradients are the reference's
    q.requires_grad_()
    out = flashgen.attention(q, k, v, causal=True)
    assert len(slow) == 5 and out.grad_fn is not None
    for _ in range(2):
        q, k, v = (t(1, 2, 40, 16).requires_grad_() for _ in range(3))
        do = t(1, 2, 40, 16)
        grads = torch.autograd.grad(flashgen.attention(q, k, v, causal=True), (q, k, v), do)
        qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
        expected = torch.autograd.grad(reference_attention(qr, kr, vr, causal=True)[0], (qr, kr, vr), do.double())
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got.double(), want, atol=5e-3, rtol=5e-3)
    assert len(slow) == 5
    with torch.no_grad():  # no gradient recorded: the fast path again
        assert flashgen.attention(q, k, v, causal=True).grad_fn is None
    assert len(slow) == 5
    # the LSE too (flash-attn's compat functions ask for it): a fresh one per call; where nothing reads it, the
    # plan's one unread buffer
    out, lse = flashgen.attention(q.detach(), k, v, causal=True, return_lse=True)
    ref_out, ref_lse = reference_attention(q.detach(), k, v, causal=True)
    torch.testing.assert_close(lse, ref_lse.float(), atol=2e-3, rtol=2e-3)
    assert lse.shape == (1, 2, 40) and len(slow) == 5
    plan, *_ = api._FAST[api._fast_key(q.detach(), k, v, "bhsd", None, True, None, None, None)]
    unread = plan._unread_lse
    assert unread is not None and unread.data_ptr() not in (lse.data_ptr(), first.data_ptr())
    again = flashgen.attention(q.detach(), k, v, causal=True, return_lse=True)[1]
    assert again.data_ptr() != lse.data_ptr() and torch.equal(again, lse)
    # options the fast path does not take: each call the checked path, with its own error
    with pytest.raises(TypeError, match="return_lse"):
        flashgen.attention(q.detach(), k, v, causal=True, return_lse=1)
    with pytest.raises(ValueError, match="dropout_p"):
        flashgen.attention(q.detach(), k, v, causal=True, dropout_p=2.0)


def test_the_fast_path_keeps_a_seq_major_query_in_its_memory_order(monkeypatch):
    """A bhsd q viewing bshd memory (model code's view + transpose) runs on bshd views on the fast path
    as on the checked one: out comes back in q's memory order, with the reference's values."""
    slow = _fast_path_calls(monkeypatch)
    for _ in range(3):
        q, k, v = (t(1, 40, 3, 16).transpose(1, 2) for _ in range(3))
        out = flashgen.attention(q, k, v, causal=True)
        torch.testing.assert_close(out, reference_attention(q, k, v, causal=True)[0].half(), atol=2e-3, rtol=2e-3)
        assert out.transpose(1, 2).is_contiguous()
    assert len(slow) == 1
    for _ in range(3):  # recording a gradient: dq comes back in q's memory order too
        q, k, v = (t(1, 40, 3, 16).transpose(1, 2).requires_grad_() for _ in range(3))
        out = flashgen.attention(q, k, v, causal=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
        ref = reference_attention(qr, kr, vr, causal=True)[0]
        for got, want in zip((dq, dk, dv), torch.autograd.grad(ref, (qr, kr, vr), torch.ones_like(ref))):
            torch.testing.assert_close(got.double(), want, atol=5e-3, rtol=5e-3)
        assert out.transpose(1, 2).is_contiguous() and dq.transpose(1, 2).is_contiguous()
    assert len(slow) == 2


def test_the_fast_path_leaves_decode_shaped_calls_and_bound_launches_off_alone(monkeypatch):
    from flashgen.runtime.launch import BoundLaunch

    from flashgen import api

    slow = _fast_path_calls(monkeypatch)
    q = t(1, 2, 3, 16)  # a few queries over a cache: routed per key length, a new one per generation step
    for length in (40, 41, 40):
        k = t(1, 2, length, 16)
        flashgen.attention(q, k, k, causal=True)
    assert len(slow) == 3 and not api._FAST  # no lookup, no entry (they filled the table, one per length)
    q = t(1, 2, 40, 16)
    flashgen.attention(q, q, q)
    monkeypatch.setattr(BoundLaunch, "enabled", False)  # every call Triton's path, planned afresh
    out = flashgen.attention(q, q, q)
    assert len(slow) == 3 + 2
    torch.testing.assert_close(out, reference_attention(q, q, q)[0].half(), atol=2e-3, rtol=2e-3)


def test_torch_func_transforms_get_the_checked_paths_error():
    """torch.func's wrapper tensors have no storage: the fast path's key leaves them to the checked path,
    whose error says what is wrong (the key's data_ptr raised a storage error)."""
    q = t(1, 2, 24, 16).float()
    flashgen.attention(q, q, q)
    flashgen.attention(q, q, q)
    with pytest.raises(RuntimeError, match="functorch transforms"):
        torch.func.grad(lambda a: flashgen.attention(a, q, q).sum())(q)


def test_a_kernel_objects_repeated_call_takes_its_bucket_plan(monkeypatch):
    """flashgen.compile / flashgen.load kernels: a no-grad call seen before runs its plan directly, the plan
    of its length's bucket (each bucket's config its own kernel)."""
    from flashgen import ops
    from flashgen.config import KernelConfig

    spec = AttentionSpec(dtype="fp16", head_dim=16, num_heads=2, causal=True)
    small, large = KernelConfig(BLOCK_M=16, BLOCK_N=16, num_warps=2, num_stages=1), KernelConfig(
        BLOCK_M=32, BLOCK_N=32, num_warps=2, num_stages=1)
    kernel = flashgen.AttentionKernel(spec, bucket_configs={32: small, 128: large})
    modules = []
    module = ops.kernel_module
    monkeypatch.setattr(ops, "kernel_module", lambda kid: modules.append(kid) or module(kid))
    for seqlen in (32, 128, 32, 128):
        q, k, v = t(1, 2, seqlen, 16), t(1, 2, seqlen, 16), t(1, 2, seqlen, 16)
        torch.testing.assert_close(kernel(q, k, v), reference_attention(q, k, v, causal=True)[0].half(), atol=2e-3,
                                   rtol=2e-3)
    plans = [plan for plan, *_ in kernel._fast.values()]
    assert len(plans) == 2 and [p.launch.constexprs["BLOCK_M"] for p in plans] == [16, 32]
    assert len(modules) == 4  # the first call of each length: its run and its plan's lookup; none after


def test_flash_attn_funcs_repeated_call_takes_the_fast_path(monkeypatch):
    """flashgen.compat.flash_attn_func asks for the LSE: its repeated no-grad calls take the fast path too,
    returning flash-attn's (out, softmax_lse) with return_attn_probs."""
    from flashgen.compat import flash_attn_func

    slow = _fast_path_calls(monkeypatch)
    for _ in range(3):
        q, k, v = t(2, 40, 4, 16), t(2, 40, 2, 16), t(2, 40, 2, 16)
        out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        ref_out, ref_lse = reference_attention(q, k, v, causal=True, layout="bshd")
        torch.testing.assert_close(out, ref_out.half(), atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse, ref_lse.float(), atol=2e-3, rtol=2e-3)
    assert len(slow) == 1
    # causal, and window_size (-1, 0), are flashgen.attention's causal (bottom-right): the same spec, bitwise
    q = t(2, 24, 4, 16)
    expected = flashgen.attention(q, k, v, causal=True, layout="bshd")
    assert torch.equal(flash_attn_func(q, k, v, causal=True), expected)
    assert torch.equal(flash_attn_func(q, k, v, window_size=(-1, 0)), expected)
    assert torch.equal(flash_attn_func(q, k, v, causal=True, window_size=(-1, 5)), expected)


def test_eager_backward_is_once_differentiable():
    # The kernels have no second derivative: a gradient computed with create_graph=True is marked
    # (AttentionFunction.backward takes a once_differentiable-like wrapper when grad mode is on), so a
    # second backward through it raises instead of silently dropping the attention term.
    q, k, v = (torch.randn(1, 2, 9, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    w = torch.randn(1, 2, 9, 16, device=DEVICE, requires_grad=True)
    out = flashgen.attention(q, k, v, causal=True)
    (dq,) = torch.autograd.grad((out * w).sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="flashgen attention has no double backward"):
        dq.sum().backward()
    # dO not requiring grad (a plain sum): the gradient depends on q all the same; it came back unmarked,
    # so a gradient penalty on it added nothing, silently
    (penalized,) = torch.autograd.grad(flashgen.attention(q, k, v, causal=True).sum(), (q,), create_graph=True)
    assert penalized.requires_grad
    with pytest.raises(RuntimeError, match="flashgen attention has no double backward"):
        penalized.pow(2).sum().backward()
    # the usual backward (grad mode off inside it): plain gradients
    (dq2,) = torch.autograd.grad(flashgen.attention(q, k, v, causal=True), (q,), w.detach())
    assert not dq2.requires_grad and torch.equal(dq.detach(), dq2)


def test_a_backward_checks_out_and_lse_by_name():
    # a wrong lse crashed the process (the kernels read past it) or gave wrong gradients silently
    spec = AttentionSpec(dtype="fp32", head_dim=16, num_heads=2, backward=True)
    module = flashgen.compile(spec).module()
    q = torch.randn(1, 2, 12, 16, device=DEVICE)
    out, lse = module.forward(q, q, q)
    do = torch.randn_like(out)
    for bad, message in ((torch.empty(1, device=DEVICE), r"lse: expected a contiguous float32 tensor of shape \(1, 2, 12\)"),
                         (lse.int(), r"lse: expected a contiguous float32 tensor of shape \(1, 2, 12\)"),
                         (None, "lse: expected a torch.Tensor, got None")):
        with pytest.raises((ValueError, TypeError), match="^" + message):
            module.backward(do, q, q, q, out, bad)
    with pytest.raises(ValueError, match=r"^out: expected shape \(1, 2, 12, 16\)"):
        module.backward(do[..., :8], q, q, q, out[..., :8], lse)
    module.backward(do, q, q, q, out, lse)
    strided = torch.empty(1, 2, 24, device=DEVICE)[..., ::2]
    with pytest.raises(ValueError, match=r"^lse: expected a contiguous .* got \(1, 2, 12\) torch.float32 .* with "
                                         r"strides \(48, 24, 2\)"):
        module.forward(q, q, q, lse=strided)


def test_a_forward_refuses_an_out_whose_elements_share_memory():
    # an expand()ed out took rows several programs wrote at once: a result up to 2.08 off, silently
    module = flashgen.compile(AttentionSpec(dtype="fp32", head_dim=16, num_heads=2)).module()
    q = torch.randn(1, 2, 12, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"^out: expected a tensor whose elements do not share memory, got strides "
                                         r"\(0, 0, 0, 1\)"):
        module.forward(q, q, q, out=torch.empty(16, device=DEVICE).expand(1, 2, 12, 16))
    out = torch.empty(1, 12, 2, 16, device=DEVICE).transpose(1, 2)  # strided, not overlapping: taken
    module.forward(q, q, q, out=out)
    assert torch.allclose(out, module.forward(q, q, q)[0], atol=1e-6)


def test_a_forward_refuses_an_out_sharing_memory_with_its_inputs():
    # out inside k or v: programs read keys another program had already overwritten with its output (0.56 off,
    # silently); refused per call, also after a call of the same metadata with a separate out
    module = flashgen.compile(AttentionSpec(dtype="fp32", head_dim=16, num_heads=2)).module()
    q, k, v = (torch.randn(1, 2, 40, 16, device=DEVICE) for _ in range(3))
    expected = module.forward(q, k, v)[0]
    module.forward(q, k, v, out=torch.empty_like(q))
    for name, kw in (("k", dict(out=k)), ("v", dict(out=v)), ("q", dict(out=q)),
                     ("v", dict(lse=v.view(-1)[:80].view(1, 2, 40)))):
        with pytest.raises(ValueError, match=rf"^{next(iter(kw))}: expected a buffer apart from {name}, got one "
                                             rf"sharing its memory"):
            module.forward(q, k, v, **kw)
    assert torch.equal(module.forward(q, k, v)[0], expected)  # nothing was written


def test_packed_calls_name_what_they_refuse():
    q = torch.randn(20, 2, 16, device=DEVICE, dtype=torch.float16)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"^mask: \{'expr': '\(q_idx \+ kv_idx\) % 3 != 0'\} is not supported over "
                                         r"packed sequences"):  # it named `layout`, which the caller never gave
        flashgen.attention_varlen(q, q, q, cu, cu, 13, 13, mask="(q_idx + kv_idx) % 3 != 0")
    none = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"^cu_seqlens_q: expected a 1-d int32 tensor of batch \+ 1 offsets "
                                         r"\(batch >= 1\), got shape \(1,\) torch.int32"):
        flashgen.attention_varlen(q, q, q, none, none, 13, 13)
    # flashgen.attention takes no offsets: 'thd' there named cu_seqlens_q, which the caller cannot pass
    with pytest.raises(ValueError, match=r"^layout: 'thd' \(packed sequences\) needs their offsets: call "
                                         r"flashgen.attention_varlen"):
        flashgen.attention(q, q, q, layout="thd")
    with pytest.raises(TypeError, match=r"^q_descale: attention_varlen takes no FP8 descale factors"):
        flashgen.attention_varlen(q, q, q, cu, cu, 13, 13, q_descale=torch.ones(2, 2, device=DEVICE))


def test_packed_calls_check_their_longest_lengths():
    q = torch.randn(20, 2, 16, device=DEVICE, dtype=torch.float16)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=DEVICE)
    # 0 with tokens in the sequences: the offsets check still runs (before: uninitialized rows came back)
    with pytest.raises(ValueError, match=r"^max_seqlen_q: expected at least the longest sequence \(13 tokens"):
        flashgen.attention_varlen(q, q, q, cu, cu, 0, 13)
        flashgen.check_bounds()  # (on a GPU the check does not wait: what it recorded is raised here)
    # a bound past every token (flash-attn takes one) runs as the tokens' count: the same result, and 10**12
    # no longer launches that many empty programs
    exact = flashgen.attention_varlen(q, q, q, cu, cu, 13, 13)
    assert torch.equal(flashgen.attention_varlen(q, q, q, cu, cu, 10**12, 10**12), exact)
    module = flashgen.compile(AttentionSpec(head_dim=16, num_heads=2)).module()
    assert module._LAUNCHER.varlen_args(cu, cu, 10**12, 10**12, "thd", q, q, 0)[1:3] == (20, 20)


@pytest.mark.parametrize("scale", [1e39, 3e38, float("inf"), -1.0, 0.0])
def test_a_softmax_scale_past_float32_is_refused(scale):
    q = torch.randn(1, 2, 8, 16, device=DEVICE, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"softmax_scale'?: expected a (positive|finite) number"):
        flashgen.attention(q, q, q, softmax_scale=scale)
    module = flashgen.compile(AttentionSpec(head_dim=16, num_heads=2)).module()
    with pytest.raises(ValueError, match="^softmax_scale: expected a positive number of at most 2.359e"):
        module.forward(q, q, q, softmax_scale=scale)


@pytest.mark.parametrize("config", ["x", {"BLOCK_M": 16}, 3])
def test_a_config_that_is_not_a_kernel_config_is_refused_by_name(config):
    q = torch.randn(1, 2, 8, 16, device=DEVICE, dtype=torch.float16)
    spec = AttentionSpec(head_dim=16, num_heads=2)
    for call in (lambda: flashgen.attention(q, q, q, config=config), lambda: flashgen.compile(spec, config),
                 lambda: flashgen.compile(spec)(q, q, q, config=config)):
        with pytest.raises(TypeError, match="^config: expected a flashgen.KernelConfig"):
            call()


@pytest.mark.parametrize("window_size", [(3,), (float("inf"), 0), 5, ("a", 1), (1.5, 2), (True, 0)])
def test_a_malformed_window_size_is_refused_by_name(window_size):
    from flashgen.compat import flash_attn_func

    q = torch.randn(1, 8, 2, 16, device=DEVICE, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^window_size: expected \(left, right\), two ints"):
        flash_attn_func(q, q, q, window_size=window_size)


def test_a_window_past_every_sequence_is_unbounded():
    # flash-attn takes any int32 window; one past 2^30 was a SpecError naming the spec's field, not window_size
    from flashgen.compat import flash_attn_func

    q, k, v = (torch.randn(1, 24, 2, 16, device=DEVICE, dtype=torch.float16) for _ in range(3))
    for wide, unbounded in (((2**31 - 1, 0), (-1, 0)), ((3, 2**31 - 1), (3, -1)), ((2**31 - 1,) * 2, (-1, -1))):
        assert torch.equal(flash_attn_func(q, k, v, window_size=wide), flash_attn_func(q, k, v, window_size=unbounded))


def test_packed_compat_functions_match_their_unpacked_calls():
    # flash-attn's qkv- and kv-packed forms (missing before): the unpacked call on views, gradients into the pack
    from flashgen.compat import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                 flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                 flash_attn_varlen_qkvpacked_func)

    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(2, 24, 3, 2, 16, generator=g).to(DEVICE, torch.float16).requires_grad_()
    do = torch.randn(2, 24, 2, 16, generator=g).to(DEVICE, torch.float16)
    got = flash_attn_qkvpacked_func(qkv, causal=True, window_size=(5, 0))
    (dqkv,) = torch.autograd.grad(got, qkv, do)
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(2))
    want = flash_attn_func(q, k, v, causal=True, window_size=(5, 0))
    assert torch.equal(got, want)
    assert torch.equal(dqkv, torch.stack(torch.autograd.grad(want, (q, k, v), do), 2))
    kv = qkv.detach()[:, :, 1:, :1]  # (batch, seqlen, 2, 1 KV head, dim): MQA
    assert torch.equal(flash_attn_kvpacked_func(q, kv, softcap=5.0), flash_attn_func(q, *kv.unbind(2), softcap=5.0))
    packed = qkv.detach().reshape(48, 3, 2, 16)
    cu = torch.tensor([0, 20, 48], device=DEVICE, dtype=torch.int32)
    want_v = flash_attn_varlen_func(*packed.unbind(1), cu, cu, 28, 28, causal=True)
    assert torch.equal(flash_attn_varlen_qkvpacked_func(packed, cu, 28, causal=True), want_v)
    assert torch.equal(flash_attn_varlen_kvpacked_func(packed[:, 0], packed[:, 1:], cu, cu, 28, 28, causal=True),
                       want_v)
    with pytest.raises(ValueError, match=r"^qkv: expected 3 tensors stacked along dim 2, got shape \(2, 24, 2, 16\)"):
        flash_attn_qkvpacked_func(qkv.detach()[:, :, 0])
    with pytest.raises(TypeError, match="^kv: expected a torch.Tensor, got list"):
        flash_attn_kvpacked_func(q, [k, v])


@pytest.mark.parametrize("kw, message", [
    (dict(causal="x"), "^causal: expected True or False, got 'x'"),
    (dict(softcap="x"), "^softcap: expected a number >= 0"), (dict(softcap=True), "^softcap: expected a number >= 0"),
    (dict(softcap=-1.0), "^softcap: expected a number >= 0"),
])
def test_compat_flags_are_checked_by_name(kw, message):
    # (causal="x" ran causal; softcap="x" raised float()'s own error)
    from flashgen.compat import flash_attn_func, flash_attn_with_kvcache

    q = torch.randn(1, 8, 2, 16, device=DEVICE, dtype=torch.float16)
    kc = torch.randn(1, 16, 2, 16, device=DEVICE, dtype=torch.float16)
    seqlens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    flash_attn_with_kvcache(q[:, :1], kc, kc.clone(), cache_seqlens=seqlens, causal=True)  # a launcher cached first
    for call in (lambda: flash_attn_func(q, q, q, **kw),
                 lambda: flash_attn_with_kvcache(q[:, :1], kc, kc.clone(), cache_seqlens=seqlens, **kw)):
        with pytest.raises((TypeError, ValueError), match=message):
            call()


@pytest.mark.parametrize("num_splits", ["x", 2.7, -1, True])
def test_compat_num_splits_is_checked_by_name(num_splits):
    from flashgen.compat import flash_attn_with_kvcache

    q = torch.randn(1, 1, 2, 16, device=DEVICE, dtype=torch.float16)
    kc = torch.randn(1, 16, 2, 16, device=DEVICE, dtype=torch.float16)
    with pytest.raises(ValueError, match="^num_splits: expected an int >= 0"):
        flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=torch.tensor([5], dtype=torch.int32, device=DEVICE),
                                num_splits=num_splits)


@pytest.mark.parametrize("value", ["no", 1, 0, None, torch.tensor(True)])
def test_call_flags_must_be_bools(value):
    # a truthy string or number passed as a flag is a mistake: return_lse="no" returned the LSE,
    # deterministic=1 ran the deterministic kernels; each entry point names the flag
    from flashgen.compat import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from flashgen.kvcache import decode

    q = t(1, 2, 8, 16)
    packed = t(8, 2, 16)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    kernel = flashgen.compile(AttentionSpec(dtype="fp16", head_dim=16, num_heads=2))
    kc = t(1, 16, 2, 16)
    seqlens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    calls = {
        "return_lse": [lambda f: flashgen.attention(q, q, q, return_lse=f), lambda f: kernel(q, q, q, return_lse=f),
                       lambda f: flashgen.attention_varlen(packed, packed, packed, cu, cu, 8, 8, return_lse=f),
                       lambda f: decode(kernel, q.transpose(1, 2)[:, :1], kc, kc, seqlens, return_lse=f)],
        "deterministic": [lambda f: flashgen.attention(q, q, q, deterministic=f),
                          lambda f: kernel.varlen(packed, packed, packed, cu, cu, 8, 8, deterministic=f),
                          lambda f: kernel.backward(q, q, q, q, *kernel.module().forward(q, q, q), deterministic=f)],
        "return_attn_probs": [lambda f: flash_attn_func(q, q, q, return_attn_probs=f),
                              lambda f: flash_attn_varlen_func(packed, packed, packed, cu, cu, 8, 8,
                                                               return_attn_probs=f)],
        "return_softmax_lse": [lambda f: flash_attn_with_kvcache(q.transpose(1, 2)[:, :1], kc, kc, cache_seqlens=seqlens,
                                                                 return_softmax_lse=f)],
    }
    for name, entries in calls.items():
        for call in entries:
            with pytest.raises(TypeError, match=f"^{name}: expected True or False"):
                call(value)
            call(False)  # the same call with a bool runs


def test_compat_is_reachable_as_an_attribute_of_flashgen():
    # the README writes flashgen.compat.flash_attn_func(...) after `import flashgen`: it raised AttributeError
    import subprocess
    import sys

    code = ("import sys, flashgen; assert 'flashgen.compat' not in sys.modules; "
            "print(flashgen.compat.flash_attn_func.__name__, flashgen.integrations.__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["flash_attn_func", "flashgen.integrations"], done.stderr
    with pytest.raises(AttributeError, match="module 'flashgen' has no attribute 'nope'"):
        flashgen.nope  # noqa: B018


def test_every_public_name_resolves_and_the_kernel_running_ones_load_on_first_use():
    # flashgen's names that run kernels come from modules that import torch: `import flashgen` leaves them to
    # their first use (flashgen/__init__.py's _LAZY); each public name then resolves, to the object named
    import subprocess
    import sys

    from flashgen import api, kvcache, loader, quant, sdpa

    code = ("import sys, flashgen; assert 'torch' not in sys.modules and 'flashgen.api' not in sys.modules; "
            "print(all(getattr(flashgen, n) is not None for n in flashgen.__all__), set(flashgen.__all__) <= set(dir(flashgen)))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (the interpreter's patch imports Triton)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stdout.split() == ["True", "True"], done.stderr[-3000:]
    assert flashgen.compile is api.compile_spec and flashgen.attention is api.attention
    assert (flashgen.load, flashgen.decode, flashgen.quantize_fp8, flashgen.scaled_dot_product_attention) == (
        loader.load, kvcache.decode, quant.quantize_fp8, sdpa.scaled_dot_product_attention)


@pytest.mark.parametrize("taken, refused, field", [
    (dict(causal=True), dict(causal=1), "causal"),
    (dict(causal=True), dict(causal=1.0), "causal"),
    (dict(softmax_scale=1.0), dict(softmax_scale=True), "softmax_scale"),
    (dict(dropout_p=0.0), dict(dropout_p=False), "dropout_p"),
    (dict(mask={"sliding_window": {"left": 4, "right": 0}}), dict(mask={"sliding_window": {"left": 4.0, "right": 0}}),
     "mask.sliding_window.left"),
])
def test_a_refused_value_equal_to_a_taken_one_is_refused_every_time(taken, refused, field):
    # the call's key held the raw values, and True == 1 == 1.0: once a call with the value taken had bound
    # the key, the refused one ran (an error or not by the calls made before)
    q = torch.randn(1, 2, 8, 16, device=DEVICE, dtype=torch.float16)
    for _ in range(2):
        flashgen.attention(q, q, q, **taken)
        with pytest.raises(ValueError, match=f"spec field '{re.escape(field)}'"):
            flashgen.attention(q, q, q, **refused)
    packed = q[0].transpose(0, 1).contiguous()
    cu = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    flashgen.attention_varlen(packed, packed, packed, cu, cu, 8, 8, **taken)
    with pytest.raises(ValueError, match=f"spec field '{re.escape(field)}'"):
        flashgen.attention_varlen(packed, packed, packed, cu, cu, 8, 8, **refused)


def test_kernel_objects_and_helpers_name_bad_arguments():
    # each raised a raw AttributeError, ValueError or RuntimeError that named nothing
    q = torch.randn(1, 2, 16, 16, device=DEVICE)
    with pytest.raises(TypeError, match=r"^doc: expected a torch.Tensor, got list"):
        flashgen.attention(q, q, q, mask="doc[q_idx] == doc[kv_idx]", doc=[0] * 16)
    # the module-level dict form, passed where keyword arguments are expected: said so, with the names to pass
    doc = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match=re.escape("tensors: pass the named tensors as keyword arguments (doc=<tensor>)")):
        flashgen.attention(q, q, q, mask="doc[q_idx] == doc[kv_idx]", tensors={"doc": doc})
    kernel = flashgen.compile(AttentionSpec(dtype="fp32", head_dim=16, num_heads=2))
    with pytest.raises(TypeError, match=r"^q: expected a torch.Tensor, got list"):
        kernel(q.tolist(), q, q)
    for bad in ("abc", 1.5, True, -0.1):
        with pytest.raises(ValueError, match=r"^dropout_p: expected a probability in \[0, 1\), got "):
            kernel(q, q, q, dropout_p=bad)
    packed = torch.randn(16, 2, 16, device=DEVICE)
    cu = torch.tensor([0, 16], dtype=torch.int32, device=DEVICE)
    for bad in (16.5, 15.9, "16", True):  # int() floored 15.9 to 15 (and said "got 15"), read True as 1
        with pytest.raises(ValueError, match=r"^max_seqlen_q: expected a non-negative int, got " + re.escape(repr(bad))):
            flashgen.attention_varlen(packed, packed, packed, cu, cu, bad, 16)
    blocked = AttentionSpec(dtype="fp32", head_dim=16, num_heads=2, mask="(q_idx // 4) >= (kv_idx // 4)")
    blocks = flashgen.compile(blocked)
    for args, words in (((1, 8.5, 8), "seqlen_q: expected a non-negative int, got 8.5"),
                        ((-1, 8, 8), "batch: expected a non-negative int, got -1"),
                        ((1, 8, True), "seqlen_k: expected a non-negative int, got True")):
        with pytest.raises(ValueError, match="^" + re.escape(words)):  # an empty() TypeError, a map for batch -1
            blocks.block_map(*args, device=DEVICE)
    if not torch.cuda.is_available():  # torch's "not compiled with CUDA" assertion
        with pytest.raises(ValueError, match="^device: expected a device this torch has, got 'cuda'"):
            blocks.block_map(1, 8, 8)
    x = torch.randn(1, 4, 8, 16, device=DEVICE)
    xq, descale = flashgen.quantize_fp8(x, group=2)
    with pytest.raises(ValueError, match=r"^descale: expected shape \(1, 4\) .* got \(1, 2\)"):
        flashgen.dequantize_fp8(xq, descale)  # group= not given back
    # e4m3's rounding: half an ulp, 2^-4 of a normal value; below 2^-6 (subnormals) half a step of 2^-9, in units
    # of the slice's descale (rtol 0.07 with atol 1e-6 failed a small value that rounded to a subnormal: 1 seed in 300)
    error = (flashgen.dequantize_fp8(xq, descale, group=2) - x).abs()
    assert (error <= torch.maximum(x.abs() * 2**-4, descale.max() * 2**-10)).all()


def test_a_kernels_source_names_a_config_that_is_not_one():
    # (source(config=dict) raised AttributeError: 'dict' object has no attribute 'check_spec')
    kernel = flashgen.compile(AttentionSpec(dtype="fp32", head_dim=16, num_heads=2))
    with pytest.raises(TypeError, match="^config: expected a flashgen.KernelConfig"):
        kernel.source(config={"BLOCK_M": 16})
