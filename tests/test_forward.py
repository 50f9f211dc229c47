"""The forward kernel against the dense reference, by the rule in ../shared/TESTING.md.

On a machine without a GPU this runs through Triton's interpreter (fp16 and fp32: the
interpreter's bf16 dot is wrong); on a GPU the same grid runs on the device.
Every check draws fresh inputs from a new seed, printed on failure.
"""

import random

import pytest
import torch

import flashgen
from flashgen import KernelConfig
from flashgen.verify import assert_attention_close

from .helpers import half_fractions, make_qkv, poisoned_outputs

# (seqlen_q, seqlen_k): not multiples of any block, unequal both ways, single rows.
SEQLENS = [(1, 1), (17, 17), (113, 113), (33, 70), (70, 33), (1, 57), (57, 1), (97, 130)]
HEAD_DIMS = [(16, 16), (40, 40), (64, 64), (96, 96), (80, 48)]  # (head_dim, head_dim_v)
HEADS = [(4, 4), (8, 2), (8, 1)]  # (query heads, KV heads): MHA, GQA 4:1, MQA
LAYOUTS = ["bhsd", "bshd"]
BLOCKS = [(16, 16), (32, 64), (64, 32), (16, 32)]


def _cases():
    # Every sequence-length pair with half of (loop order x causal x dtype) (helpers.half_fractions:
    # every two of them meet in all four combinations); the other axes rotate through the cases, so
    # each value of each axis meets both loop orders, both masks and both dtypes.
    cases = []
    for n, (m, seqlens, loop_order, causal, dtype) in enumerate(
            half_fractions([["q_outer", "kv_outer"], [False, True], ["fp16", "fp32"]], SEQLENS)):
        hd, heads, layout, blocks = (HEAD_DIMS[n % len(HEAD_DIMS)], HEADS[n % len(HEADS)], LAYOUTS[(n + m) % 2],
                                     BLOCKS[(n // 2 + m) % len(BLOCKS)])
        cases.append(pytest.param(
            loop_order, causal, dtype, seqlens, hd, heads, layout, blocks,
            id=f"{loop_order}-{'causal' if causal else 'full'}-{dtype}-sq{seqlens[0]}-sk{seqlens[1]}"
               f"-d{hd[0]}-h{heads[0]}kv{heads[1]}-{layout}-b{blocks[0]}x{blocks[1]}"))
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


# ----------------------------------------------------------------------------- hostile inputs
def _guarded(rows, *shape, dtype, device, pad=64):
    """A (rows, *shape) tensor inside a NaN-filled buffer with `pad` rows on either side: a kernel
    that reads past it reads NaN, one that writes past it changes the guard rows."""
    buf = torch.full((rows + 2 * pad, *shape), float("nan"), dtype=dtype, device=device)
    return buf, buf[pad:pad + rows]


def _varlen_inputs(device, total_q=12, total_k=12, heads=(4, 2), d=16, gen=None):
    q_buf, q = _guarded(total_q, heads[0], d, dtype=torch.float16, device=device)
    k_buf, k = _guarded(total_k, heads[1], d, dtype=torch.float16, device=device)
    v_buf, v = _guarded(total_k, heads[1], d, dtype=torch.float16, device=device)
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, generator=gen))
    return q, k, v


@pytest.mark.parametrize("cu_q,cu_k,max_q,max_k,message", [
    ([0, 5, 40], [0, 5, 12], 35, 7, "cu_seqlens_q: expected offsets within the 12 tokens of q, got last offset 40"),
    ([0, 5, 12], [0, -3, 12], 7, 15, "cu_seqlens_k: expected nondecreasing offsets, got 0 then -3"),
    ([0, 9, 4, 12], [0, 4, 8, 12], 9, 4, "cu_seqlens_q: expected nondecreasing offsets, got 9 then 4 at index 1"),
    ([2, 5, 12], [0, 5, 12], 7, 7, "cu_seqlens_q: expected the first offset to be 0, got 2"),
    ([0, 5, 12], [0, 5, 12], 7, 3, "max_seqlen_k: expected at least the longest sequence (7 tokens"),
], ids=["past-the-end", "negative", "non-monotone", "first-not-0", "max-seqlen-too-small"])
def test_varlen_refuses_offsets_outside_the_tensors(device, cu_q, cu_k, max_q, max_k, message):
    # Today's kernels read and write past q/out with these ("double free or corruption").
    q, k, v = _varlen_inputs(device)
    offsets = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    with pytest.raises(ValueError) as info:
        flashgen.attention_varlen(q, k, v, offsets(cu_q), offsets(cu_k), max_q, max_k, causal=True,
                                  config=KernelConfig(BLOCK_M=16, BLOCK_N=16, num_stages=1))
        flashgen.check_bounds()  # a GPU checks the offsets in a kernel: the call returns, this raises
    assert message in str(info.value)


@pytest.mark.parametrize("loop_order", ["q_outer", "kv_outer"])
def test_varlen_kernels_clamp_offsets_the_host_cannot_read(device, monkeypatch, loop_order):
    # Under CUDA graph capture or torch.compile the host does not read cu_seqlens (a device->host
    # copy): the kernels clamp each sequence into the tensors. Guard rows around every input and
    # output show any access past them: NaN read into the result, or a guard row overwritten.
    from flashgen.verify import reference_varlen

    gen = torch.Generator().manual_seed(0)
    module = flashgen.compile(flashgen.AttentionSpec(dtype="fp16", head_dim=16, num_heads=4, num_kv_heads=2,
                                                     causal=True, backward=True),
                              KernelConfig(BLOCK_M=16, BLOCK_N=16, num_stages=1, loop_order=loop_order, BLOCK_M1=16,
                                           BLOCK_N1=16, BLOCK_M2=16, BLOCK_N2=16, bwd_num_stages=1)).module()
    q, k, v = _varlen_inputs(device, gen=gen)
    cu_good = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    cu_past_end = torch.tensor([0, 5, 40], dtype=torch.int32, device=device)
    cu_negative = torch.tensor([0, -3, 12], dtype=torch.int32, device=device)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for cu_q, cu_k, keys_seen in ((cu_past_end, cu_good, [0, 5, 12]), (cu_good, cu_negative, [0, 0, 12])):
        out_buf, out = _guarded(12, 4, 16, dtype=torch.float16, device=device)
        lse_buf = torch.full((4 * 12 + 128,), float("nan"), device=device)
        lse = lse_buf[64:64 + 48].view(4, 12)
        module.forward(q, k, v, layout="thd", out=out, lse=lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                       max_seqlen_q=35, max_seqlen_k=35)
        assert out_buf[:64].isnan().all() and out_buf[76:].isnan().all(), "a write past out"
        assert lse_buf[:64].isnan().all() and lse_buf[112:].isnan().all(), "a write past lse"
        # what the kernels computed: the sequences clamped into range
        clamped = torch.tensor(keys_seen, dtype=torch.int32)
        ref, _ = reference_varlen(q.float().cpu(), k.float().cpu(), v.float().cpu(), cu_good.cpu(), clamped,
                                  causal=True)
        assert not out.isnan().any() and (out.float().cpu() - ref).abs().max() < 2e-2
        dq, dk, dv, _ = module.backward(torch.ones_like(out), q, k, v, out, lse, layout="thd", cu_seqlens_q=cu_q,
                                        cu_seqlens_k=cu_k, max_seqlen_q=35, max_seqlen_k=35)
        assert not any(g.isnan().any() for g in (dq, dk, dv)), "a read past q, k, v or dO"


def test_complex_and_meta_tensors_are_refused_by_name(device):
    q, k, v = (torch.randn(1, 2, 9, 16).to(device, torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match="slopes: expected a real"):
        flashgen.attention(q, k, v, score_mod={"alibi": {"slopes": "slopes"}},
                           slopes=torch.ones(2, dtype=torch.complex64, device=device))
    meta = [t.to("meta") for t in (q, k, v)]
    with pytest.raises(ValueError, match="q: expected a tensor with data, got a meta tensor"):
        flashgen.compile(flashgen.AttentionSpec(dtype="fp16", head_dim=16, num_heads=2)).forward(*meta)
