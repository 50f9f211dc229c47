"""The forward kernel against the dense reference, by the rule in ../shared/TESTING.md.

On a machine without a GPU this runs through Triton's interpreter (fp16 and fp32: the
interpreter's bf16 dot is wrong); on a GPU the same grid runs on the device.
Every check draws fresh inputs from a new seed, printed on failure.
"""

import itertools
import random

import pytest
import torch

import flashgen
from flashgen import KernelConfig
from flashgen.verify import assert_attention_close

from .helpers import make_qkv, poisoned_outputs

# (seqlen_q, seqlen_k): not multiples of any block, unequal both ways, single rows.
SEQLENS = [(1, 1), (17, 17), (113, 113), (33, 70), (70, 33), (1, 57), (57, 1), (97, 130)]
HEAD_DIMS = [(16, 16), (40, 40), (64, 64), (96, 96), (80, 48)]  # (head_dim, head_dim_v)
HEADS = [(4, 4), (8, 2), (8, 1)]  # (query heads, KV heads): MHA, GQA 4:1, MQA
LAYOUTS = ["bhsd", "bshd"]
BLOCKS = [(16, 16), (32, 64), (64, 32), (16, 32)]


def _cases():
    # Loop order x causal x dtype x seqlens in full; the other axes rotate through the cases,
    # so each value of each axis meets both loop orders, both masks and both dtypes.
    cases = []
    for n, (loop_order, causal, dtype, seqlens) in enumerate(
            itertools.product(["q_outer", "kv_outer"], [False, True], ["fp16", "fp32"], SEQLENS)):
        cases.append(pytest.param(
            loop_order, causal, dtype, seqlens, HEAD_DIMS[n % len(HEAD_DIMS)], HEADS[n % len(HEADS)],
            LAYOUTS[(n // 2) % 2], BLOCKS[n % len(BLOCKS)],
            id=f"{loop_order}-{'causal' if causal else 'full'}-{dtype}-sq{seqlens[0]}-sk{seqlens[1]}"
               f"-d{HEAD_DIMS[n % len(HEAD_DIMS)][0]}-h{HEADS[n % len(HEADS)][0]}kv{HEADS[n % len(HEADS)][1]}"
               f"-{LAYOUTS[(n // 2) % 2]}-b{BLOCKS[n % len(BLOCKS)][0]}x{BLOCKS[n % len(BLOCKS)][1]}"))
    return cases


def run_and_check(device, *, loop_order, causal, dtype, seqlens, head_dims, heads, layout, blocks, batch=2,
                  softmax_scale=None, num_warps=4, num_stages=1, **hopper):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    (seqlen_q, seqlen_k), (d, dv), (h, hk) = seqlens, head_dims, heads
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    q, k, v = make_qkv(batch, h, hk, seqlen_q, seqlen_k, d, dv, dtype=torch_dtype, device=device,
                       layout=layout, generator=gen)
    spec = flashgen.AttentionSpec(dtype=dtype, head_dim=d, head_dim_v=dv, num_heads=h, num_kv_heads=hk,
                                  causal=causal, softmax_scale=softmax_scale)
    config = KernelConfig(BLOCK_M=blocks[0], BLOCK_N=blocks[1], num_warps=num_warps, num_stages=num_stages,
                          loop_order=loop_order, **hopper)
    out, lse = poisoned_outputs(q, h, seqlen_q, dv, layout)
    flashgen.compile(spec, config).forward(q, k, v, layout=layout, out=out, lse=lse)
    try:
        assert_attention_close(out, lse, q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout)
    except AssertionError as err:
        raise AssertionError(f"seed {seed}: {err}") from None
    return out, lse


@pytest.mark.parametrize("loop_order,causal,dtype,seqlens,head_dims,heads,layout,blocks", _cases())
def test_forward_matches_reference(device, loop_order, causal, dtype, seqlens, head_dims, heads, layout, blocks):
    run_and_check(device, loop_order=loop_order, causal=causal, dtype=dtype, seqlens=seqlens,
                  head_dims=head_dims, heads=heads, layout=layout, blocks=blocks)


@pytest.mark.parametrize("tma,warp_specialize", [(True, False), (True, True), (False, True)])
@pytest.mark.parametrize("causal,seqlens,head_dims,heads,layout", [
    (False, (45, 45), (64, 64), (4, 2), "bhsd"),
    (True, (37, 70), (40, 40), (4, 1), "bshd"),   # ragged tiles, GQA, padded head dim
    (True, (70, 37), (36, 36), (2, 2), "bhsd"),   # 72-byte rows: no descriptor, pointer loads
])
def test_hopper_knobs(device, tma, warp_specialize, causal, seqlens, head_dims, heads, layout):
    # Tensor descriptors clip the ragged last tiles (zero-filled loads, clipped stores) and
    # fall back to pointer loads where the strides are not 16-byte aligned.
    run_and_check(device, loop_order="q_outer", causal=causal, dtype="fp16", seqlens=seqlens, head_dims=head_dims,
                  heads=heads, layout=layout, blocks=(16, 32), num_warps=8 if warp_specialize else 4, tma=tma,
                  warp_specialize=warp_specialize)


@pytest.mark.parametrize("loop_order", ["q_outer", "kv_outer"])
def test_batches_differ_and_scale_is_used(device, loop_order):
    # batch > 1 with different contents per batch element, and a non-default softmax scale.
    out, _ = run_and_check(device, loop_order=loop_order, causal=True, dtype="fp32", seqlens=(45, 45),
                           head_dims=(32, 32), heads=(2, 2), layout="bhsd", blocks=(16, 16), batch=3,
                           softmax_scale=0.3)
    assert not torch.allclose(out[0], out[1])


@pytest.mark.parametrize("loop_order", ["q_outer", "kv_outer"])
def test_rows_that_see_no_key(device, loop_order):
    # Causal with seqlen_q > seqlen_k, bottom-right aligned: the first seqlen_q - seqlen_k
    # rows see nothing; they must give exactly 0 and LSE -inf, with no NaN.
    out, lse = run_and_check(device, loop_order=loop_order, causal=True, dtype="fp16", seqlens=(40, 9),
                             head_dims=(16, 16), heads=(2, 1), layout="bhsd", blocks=(16, 16))
    assert torch.all(out[:, :, :31] == 0)
    assert torch.all(lse[:, :, :31] == float("-inf"))
    assert torch.all(torch.isfinite(lse[:, :, 31:]))


def test_empty_key_sequence(device):
    q, k, v = make_qkv(1, 2, 2, 5, 0, 16, dtype=torch.float32, device=device)
    out, lse = flashgen.attention(q, k, v, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def test_non_contiguous_strides(device):
    # q, k, v as slices of a larger packed tensor (arbitrary strides, inner dim contiguous).
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    qkv = torch.randn(2, 37, 3, 4, 48, generator=gen).to(device=device, dtype=torch.float16)
    q, k, v = qkv.unbind(2)  # each (B, S, H, D) with stride over the packed axis
    assert not q.is_contiguous()
    out, lse = flashgen.attention(q, k, v, causal=True, layout="bshd", return_lse=True,
                                  config=KernelConfig(BLOCK_M=16, BLOCK_N=16, num_stages=1))
    assert_attention_close(out, lse, q, k, v, causal=True, layout="bshd")


def test_default_config_runs(device):
    q, k, v = make_qkv(1, 2, 2, 50, 50, 64, dtype=torch.float16, device=device)
    out, lse = flashgen.attention(q, k, v, causal=True, return_lse=True)
    assert_attention_close(out, lse, q, k, v, causal=True)
