"""The forward kernel on a real GPU: real sizes, every dtype (bf16 included), both loop
orders, both layouts, GQA, odd head dims, the default configs, and determinism."""

import random

import pytest
import torch

import flashgen
from flashgen import AttentionSpec, KernelConfig, default_config
from flashgen.verify import assert_attention_close

from .helpers import make_qkv, poisoned_outputs
from .test_forward import run_and_check

pytestmark = pytest.mark.gpu

DTYPES = ["fp16", "bf16", "fp32"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(1024, 1024), (2047, 2047), (513, 1900), (1900, 513), (1, 4096)])
@pytest.mark.parametrize("head_dims", [(64, 64), (128, 128), (40, 40), (80, 80), (160, 160), (256, 256)])
def test_q_outer_real_sizes(dtype, causal, seqlens, head_dims):
    spec = AttentionSpec(dtype=dtype, head_dim=head_dims[0], num_heads=8, num_kv_heads=2, causal=causal)
    # the portable Q-outer kernel's default tiles, descriptors and warp specialization (padded head dims read
    # through descriptors on sm90)
    cfg = default_config(spec, None, seqlens[0], hopper_ws=False)
    run_and_check("cuda", loop_order="q_outer", causal=causal, dtype=dtype, seqlens=seqlens, head_dims=head_dims,
                  heads=(8, 2), layout="bshd" if seqlens[0] % 2 else "bhsd", blocks=(cfg.BLOCK_M, cfg.BLOCK_N),
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, tma=cfg.tma,
                  warp_specialize=cfg.warp_specialize)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens,head_dims,heads", [((1000, 1000), (64, 64), (8, 8)),
                                                     ((777, 301), (96, 96), (8, 1)),
                                                     ((301, 777), (40, 40), (6, 2))])
def test_kv_outer_real_sizes(dtype, causal, seqlens, head_dims, heads):
    run_and_check("cuda", loop_order="kv_outer", causal=causal, dtype=dtype, seqlens=seqlens, head_dims=head_dims,
                  heads=heads, layout="bhsd", blocks=(64, 64) if dtype != "fp32" else (32, 32),
                  num_warps=4, num_stages=2)


@pytest.mark.parametrize("blocks,warps,stages", [((128, 128), 8, 3), ((64, 32), 4, 2), ((128, 64), 4, 4),
                                                 ((32, 16), 2, 1)])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_knobs(blocks, warps, stages, dtype):
    run_and_check("cuda", loop_order="q_outer", causal=True, dtype=dtype, seqlens=(1111, 1111),
                  head_dims=(64, 64), heads=(4, 4), layout="bhsd", blocks=blocks, num_warps=warps,
                  num_stages=stages)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tma,warp_specialize", [(True, False), (True, True), (False, True)])
@pytest.mark.parametrize("causal,seqlens,head_dims,layout,tiles", [
    (False, (1000, 1000), (64, 64), "bhsd", ((128, 64), 8, 3)),
    (True, (2047, 2047), (128, 128), "bshd", ((128, 128), 8, 2)),
    (True, (513, 1900), (80, 80), "bshd", ((64, 64), 8, 3)),
    (False, (1900, 513), (256, 256), "bhsd", ((64, 32), 8, 2)),
    (True, (1111, 1111), (64, 64), "bhsd", ((256, 64), 8, 3)),
])
def test_hopper_knobs_real_sizes(dtype, tma, warp_specialize, causal, seqlens, head_dims, layout, tiles):
    (block_m, block_n), warps, stages = tiles
    if dtype == "fp32" and (block_m > 64 or head_dims[0] > 128):
        pytest.skip("fp32 tiles this large exceed shared memory")
    run_and_check("cuda", loop_order="q_outer", causal=causal, dtype=dtype, seqlens=seqlens, head_dims=head_dims,
                  heads=(8, 2), layout=layout, blocks=(block_m, block_n), num_warps=warps, num_stages=stages,
                  tma=tma, warp_specialize=warp_specialize)


@pytest.mark.parametrize("loop_order", ["q_outer", "kv_outer"])
def test_forward_is_deterministic(loop_order):
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=8, num_kv_heads=2, causal=True)
    kernel = flashgen.compile(spec, default_config(spec, hopper_ws=False).replace(loop_order=loop_order))
    q, k, v = make_qkv(2, 8, 2, 1537, 1537, 128, dtype=torch.bfloat16, device="cuda")
    out0, lse0 = kernel(q, k, v, return_lse=True)
    for _ in range(3):
        out, lse = poisoned_outputs(q, 8, 1537, 128, "bhsd")
        kernel.forward(q, k, v, out=out, lse=lse)
        assert torch.equal(out, out0) and torch.equal(lse, lse0)


def test_more_than_2_31_elements_and_65535_batch_heads():
    # q holds more than 2^31 elements (32-bit offsets would overflow) and batch * heads is
    # above 65535 (the limit of a CUDA grid's second axis).
    seed = random.randrange(2**31)
    batch, heads, seqlen, d = 1100, 64, 264, 128
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, 8, seqlen, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(batch, 8, seqlen, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    assert q.numel() > 2**31 and batch * heads > 65535
    out, lse = flashgen.attention(q, k, v, causal=True, return_lse=True)
    last = slice(batch - 2, batch)  # the elements farthest from the base pointer
    try:
        assert_attention_close(out[last], lse[last], q[last], k[last], v[last], causal=True)
    except AssertionError as err:
        raise AssertionError(f"seed {seed}: {err}") from None
