"""The Gluon dK/dV kernel (config knob hopper_bwd) without a GPU: its knob, what it serves, its
rendering beside the portable backward (and its host side in standalone modules), the swap of
the backward plan's dK/dV launch where a call is served and the portable dK/dV elsewhere, and the
tuner's space. The kernel is compiled for sm90 by tests/test_sm90_compile.py and run by
tests/test_hopper_bwd_gpu.py."""

import ast

import pytest
import torch

import flashgen
from flashgen import AttentionSpec, ConfigError, KernelConfig, default_config
from flashgen.codegen.render import render
from flashgen.runtime import hopper_bwd
from flashgen.runtime.launch import BackwardPlan
from flashgen.space import DeviceLimits, backward_space
from flashgen.verify import assert_gradients_close

from .helpers import make_qkv

H100 = DeviceLimits("NVIDIA H100", 232448.0, hopper=True)
SERVED = AttentionSpec(dtype="fp16", head_dim=64, num_heads=2, num_kv_heads=1, causal=True, backward=True)


def test_knob_is_a_later_knob():
    assert "hopper_bwd" not in KernelConfig().to_dict()  # stored ids and goldens stay as they were
    on = KernelConfig(hopper_bwd=True)
    assert on.to_dict()["hopper_bwd"] is True and KernelConfig.from_dict(on.to_dict()) == on
    assert "hopper_bwd" in KernelConfig.phase_knobs("bwd") and "hopper_bwd" in on.structural()
    assert "hopper_bwd" in on.describe_backward()


@pytest.mark.parametrize("knobs, words", [
    (dict(hopper_bwd="yes"), "'hopper_bwd': expected true or false, got 'yes'"),
])
def test_bad_knobs_are_config_errors(knobs, words):
    with pytest.raises(ConfigError, match=words):
        KernelConfig(**knobs)


@pytest.mark.interpreter
def test_a_call_whose_dq_strategy_differs_from_the_kernels_runs_the_portable_dkdv(monkeypatch):
    # The kernel adds dQ only where it was rendered to (dq_strategy 'atomic' in the config): a separate-dQ
    # kernel called with dq_strategy 'atomic', and an atomic one called deterministic, run the portable dK/dV.
    q, k, v = make_qkv(1, 2, 1, 20, 20, 64, dtype=torch.float16, device="cpu", layout="bshd")
    for cfg, call in ((KernelConfig(hopper_bwd=True), dict(dq_strategy="atomic")),
                      (KernelConfig(hopper_bwd=True, dq_strategy="atomic"), dict(deterministic=True))):
        module = flashgen.compile(SERVED, cfg).module()
        module._LAUNCHER.plans.clear()  # (a plan of another test's call on this module)
        monkeypatch.setattr(module._LAUNCHER.hopper_backward, "device_unserved", lambda device: None)
        out, lse = module.forward(q, k, v, layout="bshd", softmax_scale=0.5)
        do = torch.randn_like(out)
        grads = module.backward(do, q, k, v, out, lse, layout="bshd", softmax_scale=0.5, **call)[:3]
        (plan,) = backward_plans(module)
        assert plan.atomic == ("dq_strategy" in call) and not isinstance(plan.dkdv, hopper_bwd.HopperDkdv)
        assert_gradients_close(grads, q, k, v, do, causal=True, layout="bshd", softmax_scale=0.5)


@pytest.mark.interpreter
def test_a_call_the_atomic_kernel_cannot_serve_takes_the_separate_dq(monkeypatch):
    # dq_strategy 'atomic' in a hopper_bwd config is that kernel's (the defaults add dQ there): a call it
    # cannot serve (here: not on an sm90 device; packed varlen too) runs the portable kernels with the
    # separate dQ kernel, not the portable atomic adds; a call that asks for atomic dQ itself still gets them
    module = flashgen.compile(SERVED, KernelConfig(hopper_bwd=True, dq_strategy="atomic",
                                                   bwd_fused_delta=False)).module()
    q, k, v = make_qkv(1, 2, 1, 20, 20, 64, dtype=torch.float16, device="cpu", layout="bshd")
    for call, atomic in ((dict(), False), (dict(dq_strategy="atomic"), True)):
        module._LAUNCHER.plans.clear()
        out, lse = module.forward(q, k, v, layout="bshd", softmax_scale=0.5)
        do = torch.randn_like(out)
        grads = module.backward(do, q, k, v, out, lse, layout="bshd", softmax_scale=0.5, **call)[:3]
        (plan,) = backward_plans(module)
        assert plan.atomic is atomic and (plan.dq is None) is atomic
        assert not isinstance(plan.dkdv, hopper_bwd.HopperDkdv)
        assert_gradients_close(grads, q, k, v, do, causal=True, layout="bshd", softmax_scale=0.5)


def test_short_keys_under_more_queries_leave_the_kernel_where_its_programs_would_not_fill_the_gpu(monkeypatch):
    # cross-attention over a short context (4096 latents x 77 text tokens, 8 heads, batch 8): 64 programs of 128
    # keys, each walking all 64 query blocks, on 132 SMs
    module = flashgen.compile(SERVED, KernelConfig(hopper_bwd=True, dq_strategy="atomic",
                                                   bwd_fused_delta=False)).module()
    backward = module._LAUNCHER.hopper_backward
    monkeypatch.setattr(backward, "min_programs", lambda device: 132)

    def reason(batch, seqlen_q, seqlen_k, heads=8, kv_heads=8):
        q = torch.empty(batch, heads, seqlen_q, 64, device="meta")
        return backward.short_keys(q, torch.empty(batch, kv_heads, seqlen_k, 64, device="meta"), "bhsd")

    assert reason(8, 4096, 77) == "k: 77 keys under 4096 queries in 64 programs (fewer than the GPU's SMs)"
    assert reason(8, 4096, 4096) is None  # self-attention: as measured
    assert reason(1, 77, 4096) is None  # more keys than queries: the programs' walks are short
    assert reason(17, 4096, 77) is None  # 136 programs
    assert reason(1, 4096, 1025) is None and reason(1, 4096, 1024) is not None  # keys a quarter of the queries
    assert "in 32 programs" in reason(8, 4096, 77, kv_heads=4)  # GQA: a program per KV head


def test_without_the_tma_reduce_the_atomic_kernel_serves_nothing(monkeypatch):
    # a triton whose Gluon can add no shared-memory tile into global memory (runtime/hopper.py's
    # tma_reduce_add is None): the kernels that add dQ refuse every call; the separate-dQ one is unaffected
    monkeypatch.setattr(hopper_bwd, "tma_reduce_add", None)
    module = flashgen.compile(SERVED, KernelConfig(hopper_bwd=True, dq_strategy="atomic")).module()
    atomic = hopper_bwd.HopperBackward(module._LAUNCHER.hopper_backward.kernel, module.SPEC, module.CONFIG)
    assert "has no TMA reduce-add" in atomic.spec_reason
    separate = flashgen.compile(SERVED, KernelConfig(hopper_bwd=True)).module()
    assert hopper_bwd.HopperBackward(None, separate.SPEC, separate.CONFIG).spec_reason is None


def test_unserved_spec_is_a_config_error_naming_the_knob():
    spec = AttentionSpec(dtype="bf16", head_dim=100)  # (a padded head dim it serves is a multiple of 8, up to 128)
    with pytest.raises(ConfigError, match="'hopper_bwd'.*head_dim 100"):
        render(spec, KernelConfig(hopper_bwd=True))
    render(spec, KernelConfig())  # off: any spec


def test_render_adds_the_kernel_beside_the_portable_backward():
    on, off = (render(SERVED, KernelConfig(hopper_bwd=flag), standalone=False) for flag in (True, False))
    for name in ("def _attn_bwd_dkdv(", "def _attn_bwd_dq(", "def _bwd_preprocess("):
        assert name in on and name in off
    assert "def _attn_bwd_dkdv_hopper(" in on and "_LAUNCHER.hopper_backward = HopperBackward(" in on
    assert "_attn_bwd_dkdv_hopper" not in off and "hopper_backward" not in off


@pytest.mark.parametrize("family", ["portable", "hopper_ws", "atomic dQ"])
def test_standalone_module_carries_the_host_side_once(family):
    config = {"portable": KernelConfig(hopper_bwd=True), "atomic dQ": KernelConfig(hopper_bwd=True, dq_strategy="atomic"),
              "hopper_ws": KernelConfig(BLOCK_M=128, BLOCK_N=128, family="hopper_ws", hopper_bwd=True)}[family]
    source = render(SERVED, config)
    ast.parse(source)
    assert not any(line.lstrip().startswith(("from flashgen", "import flashgen")) for line in source.splitlines())
    assert source.count("def spec_unserved(") == 1  # hopper.py pasted once, whichever kernel came first
    assert source.count("def backward_call_unserved(") == 1


def test_backward_call_unserved():
    q, k, v = make_qkv(1, 4, 2, 40, 40, 64, dtype=torch.float16, device="cpu")
    do = torch.randn_like(q)
    ok = lambda device: None  # noqa: E731 - as if on an sm90 GPU
    assert hopper_bwd.backward_call_unserved(q, k, v, do, "bhsd", device_check=ok) is None
    assert "atomic" in hopper_bwd.backward_call_unserved(q, k, v, do, "bhsd", atomic=True, device_check=ok)
    assert hopper_bwd.backward_call_unserved(q, k, v, do, "bhsd", rendered_atomic=True, device_check=ok).startswith(
        "a call with dq_strategy 'separate'")
    assert hopper_bwd.backward_call_unserved(q, k, v, do, "bhsd", atomic=True, rendered_atomic=True,
                                             device_check=ok) is None
    assert "layout 'thd'" in hopper_bwd.backward_call_unserved(q[0], k[0], v[0], do[0], "thd", device_check=ok)
    assert "dropout_p" in hopper_bwd.backward_call_unserved(q, k, v, do, "bhsd", dropout_p=0.1, device_check=ok)
    odd = do.transpose(2, 3).contiguous().transpose(2, 3)  # dim not contiguous
    assert "do: strides" in hopper_bwd.backward_call_unserved(q, k, v, odd, "bhsd", device_check=ok)
    assert "device cpu" in hopper_bwd.backward_call_unserved(q, k, v, do, "bhsd")  # the real check, on the CPU
    # 2^31 LSE rows per batch element (its producer indexes them in 32 bits): the portable kernels, whose
    # row offsets widen (meta tensors: only their shapes are read)
    big = torch.empty(1, 2**17, 2**14, 64, dtype=torch.float16, device="meta")
    kv = torch.empty(1, 2**17, 1, 64, dtype=torch.float16, device="meta")
    assert "2^31 LSE rows" in hopper_bwd.backward_call_unserved(big, kv, kv, big, "bshd", device_check=ok)
    assert hopper_bwd.backward_call_unserved(big[:, :-1], kv[:, :-1], kv[:, :-1], big[:, :-1], "bshd",
                                             device_check=ok) is None


def backward_plans(module):
    return [p for p in module._LAUNCHER.plans.values() if isinstance(p, BackwardPlan)]


@pytest.mark.interpreter
def test_cpu_calls_run_the_portable_dkdv():
    module = flashgen.compile(SERVED, KernelConfig(BLOCK_M=32, BLOCK_N=32, num_stages=1, BLOCK_M1=32, BLOCK_N1=32,
                                                   BLOCK_M2=32, BLOCK_N2=32, bwd_num_stages=1,
                                                   hopper_bwd=True)).module()
    q, k, v = make_qkv(1, 2, 1, 45, 45, 64, dtype=torch.float16, device="cpu")
    out, lse = module.forward(q, k, v)
    do = torch.randn_like(out)
    grads = module.backward(do, q, k, v, out, lse)[:3]
    (plan,) = backward_plans(module)
    assert not isinstance(plan.dkdv, hopper_bwd.HopperDkdv)  # not an sm90 device: the portable kernel
    # (fp16, 3x the same-precision reference's error: TESTING.md)
    assert_gradients_close(grads, q, k, v, do, causal=True)


class RecordingKernel:
    """Stands in for the Gluon dK/dV kernel: records kernel[grid](*args, **constexprs) and writes what a
    kernel would (dk = 1, dv = 2)."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.launches.append((grid, args, constexprs))
            args[6].fill_(1.0), args[7].fill_(2.0)
        return launch


class RecordingRanges(RecordingKernel):
    """Stands in for a block-range kernel: records its launches, writes nothing."""

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.launches.append((grid, args, constexprs))


@pytest.mark.interpreter
def test_a_served_call_swaps_the_dkdv_launch_planned_once(monkeypatch):
    module = flashgen.compile(SERVED, KernelConfig(hopper_bwd=True)).module()
    module._LAUNCHER.plans.clear()  # (a plan of another test's call on this module)
    hopper = module._LAUNCHER.hopper_backward
    kernel = RecordingKernel()
    made = []  # the Gluon descriptors built (the plan's first call), not copied (later calls)
    descriptor = hopper_bwd.HopperForward.descriptor
    monkeypatch.setattr(hopper_bwd.HopperForward, "descriptor",
                        staticmethod(lambda t, *a: made.append(t.shape) or descriptor(t, *a)))
    monkeypatch.setattr(hopper, "kernel", kernel)
    monkeypatch.setattr(hopper, "device_unserved", lambda device: None)
    monkeypatch.setattr(module._LAUNCHER, "interpreting", lambda: True)
    results = []
    for _ in range(2):  # the second call: the same plan, its descriptors copied onto the new tensors
        q, k, v = make_qkv(1, 2, 1, 20, 20, 64, dtype=torch.float16, device="cpu", layout="bshd")
        out, lse = module.forward(q, k, v, layout="bshd", softmax_scale=0.5)
        do = torch.randn_like(out)
        results.append((q, k, v, do, lse, module.backward(do, q, k, v, out, lse, layout="bshd", softmax_scale=0.5,
                                                          dq_strategy="separate")))
    (plan,) = backward_plans(module)
    assert isinstance(plan.dkdv, hopper_bwd.HopperDkdv) and plan.rows is None
    assert made == [(1, 20, 1, 64), (1, 20, 1, 64), (1, 20, 2, 64), (1, 20, 2, 64)]  # k, v, q, do: once
    assert len(kernel.launches) == 2
    for (grid, args, constexprs), (q, k, v, do, lse, (_, dk, dv, _)) in zip(kernel.launches, results):
        assert grid == (1, 1, 1)  # 20 keys: one program of two 64-key consumers, per KV head and batch
        assert [d.base for d in args[:4]] == [k, v, q, do] and args[4] is lse and args[5].shape == (1, 2, 20)
        assert args[6] is dk and args[7] is dv
        # lse/delta strides (batch, head), dk and dv strides (batch, head, seq) in bshd, sizes, scales
        assert args[8:] == (40, 20, 1280, 64, 64, 1280, 64, 64, 20, 20, 2, 0.5 * hopper.RCP_LN2, 0.5)
        assert constexprs == dict(CAUSAL=True, NUM_STAGES=2, CONSUMERS=2, PRODUCER_REGS=24, CONSUMER_REGS=240,
                                  num_warps=4)
        assert bool((dk == 1).all()) and bool((dv == 2).all())  # the Gluon launch's dk, dv are what backward returns


@pytest.mark.interpreter
def test_an_atomic_kernel_gets_the_float32_dq_buffer_and_no_dq_launch(monkeypatch):
    # dq_strategy 'atomic' in the config: the rendered kernel adds dQ (its extra argument: a descriptor of
    # the plan's float32 buffer in q's shape, one consumer's share of a query block's columns per tile);
    # the plan runs no dQ kernel and copies the buffer into dq
    module = flashgen.compile(SERVED, KernelConfig(hopper_bwd=True, dq_strategy="atomic")).module()
    module._LAUNCHER.plans.clear()  # (a plan of another test's call on this module)
    hopper = module._LAUNCHER.hopper_backward
    kernel = RecordingKernel()
    monkeypatch.setattr(hopper, "kernel", kernel)
    monkeypatch.setattr(hopper, "device_unserved", lambda device: None)
    monkeypatch.setattr(module._LAUNCHER, "interpreting", lambda: True)
    q, k, v = make_qkv(1, 2, 1, 20, 20, 64, dtype=torch.float16, device="cpu", layout="bshd")
    out, lse = module.forward(q, k, v, layout="bshd", softmax_scale=0.5)
    dq, dk, dv, _ = module.backward(torch.randn_like(out), q, k, v, out, lse, layout="bshd", softmax_scale=0.5)
    (plan,) = backward_plans(module)
    assert isinstance(plan.dkdv, hopper_bwd.HopperDkdv) and plan.atomic and plan.dq is None
    ((grid, args, constexprs),) = kernel.launches
    assert len(args) == 22
    buffer = args[21].base
    assert buffer.dtype == torch.float32 and buffer.shape == q.shape and buffer.is_contiguous()
    # (batch, head, seq, dim) over the bshd buffer; 64 query rows x 32 of hd64's columns per consumer
    assert list(args[21].shape) == [1, 2, 20, 64] and list(args[21].strides) == [2560, 64, 128, 1]
    assert list(args[21].block_shape) == [1, 1, 64, 32]
    assert bool((dq == 0).all()) and bool((dk == 1).all())  # the recorded kernel added nothing to the zeroed buffer


@pytest.mark.interpreter
def test_a_masked_call_passes_its_named_tensors(monkeypatch):
    # a mask's tensors (document ids, their strides and sizes, and the ids' runs table) follow the scalars
    # (and the atomic dQ buffer's), taken from the portable dK/dV launch's arguments, whose place in them
    # the plan says
    spec = AttentionSpec(dtype="fp16", head_dim=64, num_heads=2, num_kv_heads=1, causal=True, backward=True,
                         mask={"document": {"ids": "doc"}})
    doc = torch.tensor([[0] * 7 + [1] * 13], dtype=torch.int32)
    for knobs, tail in ((dict(dq_strategy="separate"), 13), (dict(dq_strategy="atomic", bwd_fused_delta=False), 14)):
        module = flashgen.compile(spec, KernelConfig(hopper_bwd=True, **knobs)).module()
        module._LAUNCHER.plans.clear()
        hopper = module._LAUNCHER.hopper_backward
        assert hopper.named_args == 6
        kernel, ranges = RecordingKernel(), RecordingRanges()
        assert hopper.ranges is module._hw_bwd_ranges  # documents' rows come from a table a small kernel fills
        monkeypatch.setattr(hopper, "kernel", kernel)
        monkeypatch.setattr(hopper, "ranges", ranges)
        monkeypatch.setattr(hopper, "device_unserved", lambda device: None)
        monkeypatch.setattr(module._LAUNCHER, "interpreting", lambda: True)
        q, k, v = make_qkv(1, 2, 1, 20, 20, 64, dtype=torch.float16, device="cpu", layout="bshd")
        out, lse = module.forward(q, k, v, layout="bshd", softmax_scale=0.5, tensors={"doc": doc})
        module.backward(torch.randn_like(out), q, k, v, out, lse, layout="bshd", softmax_scale=0.5,
                        tensors={"doc": doc})
        ((_, args, _),) = kernel.launches
        ((grid, (table, *ranges_args), constexprs),) = ranges.launches  # (key blocks, batch): 6 ints each
        assert grid == (1, 1) and constexprs == dict(BLOCK_M=64, CONSUMERS=2, num_warps=4)
        assert table.dtype == torch.int32 and table.shape == (6,) and args[-1] is table
        assert ranges_args[:2] == [20, 20] and ranges_args[2] is args[-7] and ranges_args[-1] is args[-2]
        assert args[:8][6].shape == k.shape and len(args) == 8 + tail + 6 + 1
        t_doc, s0, s1, n0, n1, runs = args[-7:-1]
        assert t_doc.data_ptr() == doc.data_ptr() and (s0, s1, n0, n1) == (0, 1, 1, 20), args[-6:]  # (size 1: stride 0)
        assert runs.tolist() == [[[0] * 7 + [7] * 13], [[7] * 7 + [20] * 13]]  # this call's runs of the ids
        assert args[19:21] == (0.5 * hopper.RCP_LN2, 0.5)  # the scalars; then the atomic buffer's descriptor
        assert tail == 13 or (args[21].base.dtype == torch.float32 and list(args[21].strides) == [2560, 64, 128, 1])


def test_space_offers_the_kernel_only_where_it_serves():
    space = backward_space(SERVED, H100)
    assert space.params["hopper_bwd"] == (False, True)
    on = [p for p in space.points() if p["hopper_bwd"]]
    # the portable dK/dV's own knobs stay put; dQ from the separate kernel or added from this one
    assert on and all((p["BLOCK_M1"], p["BLOCK_N1"], p["bwd_persistent"]) == (64, 64, 0) for p in on)
    assert {p["dq_strategy"] for p in on} == {"separate", "atomic"}
    assert backward_space(AttentionSpec(dtype="bf16", head_dim=96), H100).params["hopper_bwd"] == (False, True)
    for head_dim in (100, 192):  # rows the copy engine cannot read; a width it has no tiles for
        assert "hopper_bwd" not in backward_space(AttentionSpec(dtype="bf16", head_dim=head_dim), H100).params
    assert "hopper_bwd" not in backward_space(SERVED, DeviceLimits("NVIDIA A100", 166912.0)).params


@pytest.mark.parametrize("fields, target, seqlen, on", [
    # the cases it measured faster, adding dQ itself by the copy engine (config._hopper_bwd_default)
    (dict(head_dim=128, num_heads=16, causal=True), "h100", 16384, "atomic"),
    (dict(head_dim=128, num_heads=16, causal=True), "h100", 4096, "atomic"),
    (dict(head_dim=128, num_heads=16, causal=True), "h100", 2048, "atomic"),  # since its spills went
    (dict(head_dim=128, num_heads=16, causal=True), "h100", 1024, False),  # S=1024 slower on the H100
    (dict(head_dim=128, num_heads=16), "h100", 16384, "atomic"),
    (dict(head_dim=128, num_heads=16), "h100", 1024, "atomic"),
    (dict(head_dim=128, num_heads=16), "h100", 256, False),
    (dict(head_dim=64, num_heads=32, causal=True), "h100", 16384, "atomic"),
    (dict(head_dim=64, num_heads=32, causal=True), "h100", 4096, "atomic"),
    (dict(head_dim=64, num_heads=32, causal=True), "h100", 2048, False),
    (dict(head_dim=64, num_heads=32), "h100", 4096, "atomic"),
    (dict(head_dim=64, num_heads=32), "h100", 1024, True),  # with the separate dQ kernel
    (dict(head_dim=64, num_heads=32), "h100", 256, False),
    (dict(head_dim=128, num_heads=16, causal=True), "a100", 16384, False),  # not sm90
    # GQA: causal hd128 from 2048 tokens with the separate dQ kernel, hd128 without causality adding dQ from
    # 1024; nothing else
    (dict(head_dim=128, num_heads=16, num_kv_heads=4, causal=True), "h200", 4096, True),
    (dict(head_dim=128, num_heads=16, num_kv_heads=4, causal=True), "h100", 2048, True),
    (dict(head_dim=128, num_heads=16, num_kv_heads=4, causal=True), "h100", 1024, False),
    (dict(head_dim=128, num_heads=16, num_kv_heads=4), "h100", 16384, "atomic"),
    (dict(head_dim=128, num_heads=16, num_kv_heads=4), "h100", 1024, "atomic"),
    (dict(head_dim=128, num_heads=16, num_kv_heads=4), "h100", 256, False),
    (dict(head_dim=64, num_heads=32, num_kv_heads=8, causal=True), "h100", 16384, False),
    # masks: served (tests/test_hopper_masks_gpu.py), a default only where measured faster
    (dict(head_dim=128, num_heads=16, mask={"sliding_window": {"left": 128}}), "h100", 16384, False),
    (dict(head_dim=128, num_heads=16, causal=True, mask={"document": {"ids": "doc"}}), "h100", 16384, True),
    (dict(head_dim=128, num_heads=16, causal=True, mask={"document": {"ids": "doc"}}), "h100", 8192, False),
    (dict(head_dim=128, num_heads=16, num_kv_heads=4, causal=True, mask={"document": {"ids": "doc"}}), "h100",
     16384, False),
    (dict(head_dim=128, num_heads=16, mask={"prefix_lm": 512}), "h100", 16384, "atomic"),  # measured faster
    (dict(head_dim=128, num_heads=16, mask={"prefix_lm": 512}), "h100", 4096, "atomic"),
    (dict(head_dim=128, num_heads=16, mask={"prefix_lm": 512}), "h100", 2048, False),
    (dict(head_dim=128, num_heads=16, num_kv_heads=4, mask={"prefix_lm": 512}), "h100", 8192, True),
    (dict(head_dim=128, num_heads=16, num_kv_heads=4, mask={"prefix_lm": 512}), "h100", 4096, False),
    (dict(head_dim=64, num_heads=32, mask={"prefix_lm": 512}), "h100", 16384, False),  # unmeasured
])
def test_sm90_default_takes_the_kernel_where_it_measured_faster(fields, target, seqlen, on):
    config = default_config(AttentionSpec(dtype="bf16", backward=True, **fields), target, seqlen)
    assert config.hopper_bwd is bool(on)
    assert config.dq_strategy == ("atomic" if on == "atomic" else "separate")
