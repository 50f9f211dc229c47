"""Row offsets past 2^31 elements (host.wide_rows, the kernels' WIDE_ROWS): which calls take the
64-bit offsets, and that the kernels compiled with them compute what the 32-bit ones do, bitwise, on
every portable path (both forward loop orders, packed sequences, the separate and atomic dQ, the
one-launch backward, the persistent dK/dV grid with the fused delta). The calls that need them hold
gigabytes: tests/test_large_offsets_gpu.py."""

import random

import pytest
import torch

from flashgen import AttentionSpec
from flashgen.codegen import render
from flashgen.runtime import host
from flashgen.runtime.launch import contiguous_strides

from .test_masks import SMALL


def strided(*shape):
    return shape, contiguous_strides(shape)


@pytest.mark.parametrize("layout, shape, wide", [
    ("bshd", (1, 2**20, 16, 128), True),  # 2^20 rows of 2048 elements: the last row starts at 2^31 - 2048
    ("bshd", (1, 2**20 - 1, 16, 128), False),
    ("bhsd", (1, 16, 2**20, 128), False),  # rows of 128 elements
    ("bhsd", (1, 16, 2**24, 128), True),
    ("thd", (2**19, 32, 128), True),  # 512K packed tokens of 32 x 128
    ("thd", (2**19 - 1, 32, 128), False),
])
def test_which_calls_take_64_bit_rows(layout, shape, wide):
    assert host.wide_rows(layout, strided(*shape)) is wide
    assert host.wide_rows(layout, strided(2, 2, 2, 2) if layout != "thd" else strided(2, 2, 2), strided(*shape)) is wide


def test_a_view_with_a_long_row_stride_takes_64_bit_rows():
    # 2^17 rows of a view into (heads 128 x 128): its row stride is its parent's
    shape, strides = (1, 2**17, 8, 128), (2**31, 2**14, 128, 1)
    assert host.wide_rows("bshd", (shape, strides)) and not host.wide_rows("bshd", strided(*shape))


CASES = {  # name: (spec fields, config knobs, layout)
    "q_outer causal gqa": (dict(causal=True, num_heads=4, num_kv_heads=2), {}, "bhsd"),
    "kv_outer": (dict(), dict(loop_order="kv_outer"), "bshd"),
    "packed causal": (dict(causal=True, num_heads=2, num_kv_heads=1), {}, "thd"),
    "atomic dQ window": (dict(mask={"sliding_window": {"left": 9, "right": 3}}), dict(dq_strategy="atomic"), "bshd"),
    "one-launch backward": (dict(causal=True, num_heads=4, num_kv_heads=2), dict(bwd_short=True), "bhsd"),
    "persistent dK/dV, fused delta": (dict(causal=True), dict(bwd_persistent=2, bwd_fused_delta=True), "bshd"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_64_bit_rows_compute_the_same(device, monkeypatch, name):
    fields, knobs, layout = CASES[name]
    fields = dict(dict(num_heads=2, num_kv_heads=2), **fields)
    spec = AttentionSpec(dtype="fp16", head_dim=32, backward=True, **fields)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    h, hk = spec.num_heads, spec.num_kv_heads
    kw = {}
    if layout == "thd":  # sequences of 29 and 40 tokens
        cu = torch.tensor([0, 29, 69], dtype=torch.int32, device=device)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=40, max_seqlen_k=40)
        shapes = ((69, h, 32), (69, hk, 32), (69, hk, 32))
    else:
        shapes = [(2, x, 37, 32) if layout == "bhsd" else (2, 37, x, 32) for x in (h, hk, hk)]
    q, k, v = (torch.randn(s, generator=gen).to(device=device, dtype=torch.float16) for s in shapes)
    do = torch.randn(q.shape, generator=gen).to(device=device, dtype=torch.float16)
    results, flags = [], []
    for wide in (False, True):
        monkeypatch.setattr(host, "wide_rows", lambda layout, *tensors, wide=wide: wide)
        module = render.build_module(spec, SMALL.replace(**knobs))
        module._LAUNCHER.plans.clear()  # plans made before the patch keep their flag
        out, lse = module.forward(q, k, v, layout=layout, **kw)
        grads = module.backward(do, q, k, v, out, lse, layout=layout, **kw)[:3]
        results.append((out, lse, *grads))
        flags.append({name: launch.constexprs["WIDE_ROWS"] for plan in module._LAUNCHER.plans.values()
                      for name, launch in vars(plan).items() if hasattr(launch, "constexprs")
                      and "WIDE_ROWS" in launch.constexprs})
    assert flags[0] and set(flags[0].values()) == {False} and set(flags[1].values()) == {True}, flags
    for a, b, what in zip(*results, ("out", "lse", "dq", "dk", "dv")):
        assert torch.equal(a, b), f"{name}: {what} differs with 64-bit rows"


@pytest.mark.parametrize("stride, refused", [(16909321, True), (16909320, False), (1, False)])
def test_a_head_dim_spanning_2_31_elements_is_refused_by_name(stride, refused):
    # the head dim's offsets stay 32-bit: 127 x 16909321 is the first to reach 2^31 (the seq-contiguous
    # V of a 16.9M-key sequence)
    t = torch.empty_strided((1, 1, 4, 128), (0, 0, 1, stride), device="meta")
    if refused:
        with pytest.raises(ValueError, match=rf"^v: head-dim stride {stride} spans 2\^31 elements over head dim 128"):
            host.check_head_span("v", t)
    else:
        host.check_head_span("v", t)


def test_a_do_spanning_2_31_elements_is_copied_not_refused():
    # autograd chooses dO's strides: the launcher copies one whose head dim spans 2^31 elements
    wide = torch.empty_strided((1, 1, 4, 128), (0, 0, 1, 16909321), device="meta")
    assert host.head_contiguous(wide).stride() == (512, 512, 128, 1)
    narrow = torch.empty(1, 1, 4, 128, device="meta")
    assert host.head_contiguous(narrow) is narrow
