"""The short-keys forward (templates/prefill/short_kv.j2): calls whose keys fit one tile under many more
queries (cross-attention over a short context) load K and V once per program and walk several query tiles.

Checked against the reference by ../shared/TESTING.md's rule on fresh inputs (the seed printed on failure):
on the CPU through Triton's interpreter in fp16, on a GPU in bf16, at small sizes with the rule's query
floor lowered and, on the GPU, at diffusion's real size under the default rule. The calls it must leave to
the other forwards are checked to run there.
"""

import random

import pytest
import torch

import flashgen
from flashgen import AttentionSpec, KernelConfig
from flashgen.codegen.render import render, timed_source
from flashgen.runtime.host import AttentionLauncher
from flashgen.verify import assert_attention_close, assert_gradients_close

from .helpers import forget_plans, make_qkv, poisoned_outputs

SHORT = "_attn_fwd_short_kv"


@pytest.fixture
def small_rule(monkeypatch):
    """The rule's query floor lowered, so that interpreter-sized calls are taken (the other conditions stand);
    plans made under it are forgotten after the test."""
    monkeypatch.setattr(AttentionLauncher, "SHORT_KV_QUERIES", 64)
    forget_plans()
    yield
    forget_plans()


@pytest.fixture
def routes(monkeypatch):
    """short_kv_knobs' answers (None: not taken), in call order."""
    answers = []
    original = AttentionLauncher.short_kv_knobs

    def spy(self, *args):
        answers.append(original(self, *args))
        return answers[-1]
    monkeypatch.setattr(AttentionLauncher, "short_kv_knobs", spy)
    return answers


def forward_kernels(kernel):
    """The names of the kernels the compiled module's forward plans launch."""
    plans = kernel.module()._LAUNCHER.plans.values()
    return {plan.launch.kernel.__name__ for plan in plans if getattr(plan, "launch", None) is not None
            and hasattr(plan, "new_out")}


def dtype_for(device):
    return (torch.bfloat16, "bf16") if device == "cuda" else (torch.float16, "fp16")


def run_call(device, seqlens, head_dims, heads, layout, *, spec_kw=None, config=None, batch=2, **call_kw):
    """One forward through a compiled kernel on fresh inputs, checked; returns the kernels its plans launch."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    (seqlen_q, seqlen_k), (d, dv), (h, hk) = seqlens, head_dims, heads
    torch_dtype, dtype = dtype_for(device)
    q, k, v = make_qkv(batch, h, hk, seqlen_q, seqlen_k, d, dv, dtype=torch_dtype, device=device, layout=layout,
                       generator=gen)
    spec = AttentionSpec(dtype=dtype, head_dim=d, head_dim_v=dv, num_heads=h, num_kv_heads=hk, **(spec_kw or {}))
    kernel = flashgen.compile(spec, config)
    kernel.module()._LAUNCHER.plans.clear()  # (so the plans read below are this call's)
    out, lse = poisoned_outputs(q, h, seqlen_q, dv, layout)
    kernel.forward(q, k, v, layout=layout, out=out, lse=lse, **call_kw)
    try:
        assert_attention_close(out, lse, q, k, v, causal=spec.causal, mask=spec.mask, score_mod=spec.score_mod,
                               layout=layout)
    except AssertionError as err:
        raise AssertionError(f"seed {seed}: {err}") from None
    # the same call again: its plan's bound launch (on a GPU the compiled kernel's launcher, not Triton's path)
    again, lse_again = poisoned_outputs(q, h, seqlen_q, dv, layout)
    kernel.forward(q, k, v, layout=layout, out=again, lse=lse_again, **call_kw)
    assert torch.equal(again, out) and torch.equal(lse_again, lse), f"seed {seed}: a second call differs"
    return forward_kernels(kernel)


@pytest.mark.parametrize("seqlens,head_dims,heads,layout", [
    ((400, 77), (64, 64), (4, 4), "bhsd"),  # diffusion's 77 text tokens
    ((257, 1), (32, 32), (8, 2), "bshd"),  # one key; GQA
    ((130, 16), (16, 16), (8, 1), "bhsd"),  # MQA; a query tile and a partial one
    ((520, 128), (32, 64), (4, 2), "bshd"),  # a full 128-key tile; head_dim_v != head_dim
    ((200, 17), (16, 16), (2, 2), "bhsd"),  # 17 keys in a 32-key tile
])
def test_short_keys_match_the_reference(device, small_rule, seqlens, head_dims, heads, layout):
    assert SHORT in run_call(device, seqlens, head_dims, heads, layout)


@pytest.mark.parametrize("case,seqlens,head_dims,kw", [
    ("129 keys: more than a tile", (600, 129), (64, 64), {}),
    ("fewer than 4 queries per key", (300, 77), (64, 64), {}),
    ("head dim 128", (400, 77), (128, 128), {}),
    ("a padded head dim (40: 64 wide)", (400, 77), (40, 40), {}),
    ("a padded head_dim_v", (400, 77), (32, 48), {}),
    ("causal", (400, 77), (64, 64), dict(spec_kw=dict(causal=True))),
    ("a sliding window", (400, 77), (64, 64), dict(spec_kw=dict(mask={"sliding_window": {"left": 300}}))),
    ("a score modifier", (400, 77), (64, 64), dict(spec_kw=dict(score_mod={"softcap": 20.0}))),
    ("FA1's loop order", (400, 77), (64, 64), dict(config=KernelConfig(loop_order="kv_outer"))),
])
def test_other_calls_keep_their_forward(device, small_rule, case, seqlens, head_dims, kw):
    kernels = run_call(device, seqlens, head_dims, (4, 2), "bhsd", **kw)
    assert kernels and SHORT not in kernels, case


def test_dropout_packed_and_knob_calls_keep_their_forward(device, small_rule, routes):
    torch_dtype, dtype = dtype_for(device)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    q, k, v = make_qkv(1, 4, 4, 400, 77, 32, dtype=torch_dtype, device=device, generator=gen)
    flashgen.attention(q, k, v, dropout_p=0.1)
    assert routes[-1] is None  # dropout: the Q-outer forward, which draws the keep mask
    flashgen.attention(q, k, v)
    assert routes[-1] is not None  # the same call without dropout takes it
    cu_q = torch.tensor([0, 400], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 77], dtype=torch.int32, device=device)
    flashgen.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu_q, cu_k, 400, 77)
    assert routes[-1] is None  # packed sequences
    taken = len(routes)
    kernel = flashgen.compile(AttentionSpec(dtype=dtype, head_dim=32, num_heads=4))
    kernel.module()._LAUNCHER.forward(q, k, v, BLOCK_M=32, BLOCK_N=32)  # knobs named by the call: their forward
    assert len(routes) == taken  # (not asked)


def test_gradients_through_the_short_forward(device, small_rule, routes):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    torch_dtype, _ = dtype_for(device)
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 4, 2, 300, 50, 32, dtype=torch_dtype, device=device,
                                                     layout="bshd", generator=gen))
    do = torch.randn(q.shape, generator=gen).to(device=device, dtype=torch_dtype)
    out = flashgen.attention(q, k, v, layout="bshd")
    assert routes and routes[-1] is not None  # the step's forward took the short-keys kernel
    grads = torch.autograd.grad(out, (q, k, v), do)
    try:
        assert_attention_close(out.detach(), None, q.detach(), k.detach(), v.detach(), causal=False, layout="bshd")
        assert_gradients_close(grads, q.detach(), k.detach(), v.detach(), do, causal=False, layout="bshd")
    except AssertionError as err:
        raise AssertionError(f"seed {seed}: {err}") from None


def test_the_kernel_is_rendered_for_unmasked_non_causal_16_bit_specs_and_is_not_timed():
    def source(**kw):
        return render(AttentionSpec(**{"dtype": "bf16", "head_dim": 64, "num_heads": 8, **kw}), KernelConfig(),
                      standalone=False)
    plain = source()
    assert f"def {SHORT}(" in plain and f"_LAUNCHER.short_kv_kernel = {SHORT}" in plain
    for kw in (dict(causal=True), dict(dtype="fp32"), dict(mask={"sliding_window": {"left": 64}}),
               dict(score_mod={"softcap": 30.0}), dict(dtype="fp8_e4m3", backward=False)):
        assert SHORT not in source(**kw), kw
    # the tuner times dense self-attention, which never takes it: not part of the forward's kernel hash
    assert SHORT not in timed_source(plain, "fwd")
    # a standalone module (flashgen generate) carries it and the host code that routes to it
    standalone = render(AttentionSpec(dtype="bf16", head_dim=64, num_heads=8), KernelConfig())
    assert f"_LAUNCHER.short_kv_kernel = {SHORT}" in standalone and "def short_kv_knobs(" in standalone


def test_the_grid_keeps_two_programs_per_sm(monkeypatch):
    launcher = flashgen.compile(AttentionSpec(dtype="fp16", head_dim=64, num_heads=8)).module()._LAUNCHER
    monkeypatch.setattr("flashgen.runtime.host.sm_count", lambda device: 132)
    cfg = {"loop_order": "q_outer"}
    # diffusion's call: 8 x 8 heads x 64 query tiles, 4 per program (1024 programs)
    assert launcher.short_kv_knobs(cfg, "bhsd", 0.0, 8, 4096, 77, None) == ((16, 8, 8), 4)
    # a batch of one: one tile per program (512 programs), not 4 (128 programs on 132 SMs)
    assert launcher.short_kv_knobs(cfg, "bhsd", 0.0, 1, 4096, 77, None) == ((64, 8, 1), 1)
    assert launcher.short_kv_knobs(cfg, "bhsd", 0.0, 8, 1024, 77, None) is not None  # SHORT_KV_QUERIES
    assert launcher.short_kv_knobs(cfg, "bhsd", 0.0, 8, 1023, 77, None) is None
    assert launcher.short_kv_knobs(cfg, "bhsd", 0.0, 8, 4096, 128, None) is not None  # SHORT_KV_KEYS
    assert launcher.short_kv_knobs(cfg, "bhsd", 0.0, 8, 4096, 129, None) is None
    assert launcher.short_kv_knobs(cfg, "bhsd", 0.0, 8, 4096, 0, None) is None  # no keys: the forward above
    monkeypatch.setattr(AttentionLauncher, "SHORT_KV_QUERIES", 1)
    assert launcher.short_kv_knobs(cfg, "bhsd", 0.0, 8, 400, 100, None) is not None  # SHORT_KV_RATIO per key
    assert launcher.short_kv_knobs(cfg, "bhsd", 0.0, 8, 399, 100, None) is None
    assert launcher.short_kv_knobs(cfg, "bhsd", 0.0, 8, 17, 1, None) is not None  # past DECODE_QUERIES only
    assert launcher.short_kv_knobs(cfg, "bhsd", 0.0, 8, 16, 1, None) is None


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [32, 64])
def test_cross_attention_on_its_default(head_dim):
    # 4000 queries over 77 keys, 8 heads, batch 4, the default rule: the short-keys forward, checked; 63 query
    # tiles (the last half full) in programs of 4 (the last of 3)
    assert SHORT in run_call("cuda", (4000, 77), (head_dim, head_dim), (8, 8), "bhsd", batch=4)


@pytest.mark.gpu
def test_a_bhsd_view_of_bshd_memory_on_its_default():
    # transformers' query layout (a projection's view): the call runs as bshd, on the short-keys forward
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    q, k, v = make_qkv(2, 8, 8, 4096, 77, 64, dtype=torch.bfloat16, device="cuda", layout="bshd", generator=gen)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    forget_plans()
    out, lse = flashgen.attention(q, k, v, return_lse=True)
    assert_attention_close(out, lse, q, k, v, causal=False)
    kernels = {p.launch.kernel.__name__ for m in flashgen.ops._MODULES.values() for p in m._LAUNCHER.plans.values()
               if getattr(p, "launch", None) is not None and hasattr(p, "new_out")}
    assert SHORT in kernels


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [40, 128])
def test_other_head_dims_keep_the_default_forward(head_dim):
    kernels = run_call("cuda", (4096, 77), (head_dim, head_dim), (8, 8), "bhsd", batch=2)
    assert kernels and SHORT not in kernels
