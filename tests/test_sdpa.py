"""flashgen.scaled_dot_product_attention against torch's own SDPA, by the rule of TESTING.md.

fp16: the reference is torch's SDPA on the same inputs upcast to float32, and the kernel's
own-dtype error is measured by torch's SDPA run in float16; fp32: float64 reference, relative
error (flashgen.verify.compare). Gradients use the 3x rule, the float mask's gradient included.
"""

import math
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashgen
from flashgen.verify import GRAD_MEAN_FACTOR, compare

REF_DTYPE = {torch.float16: torch.float32, torch.float32: torch.float64}


def _inputs(gen, device, dtype, q_shape, k_shape, v_shape, mask_shape=None, mask_kind=None, grad=False):
    q, k, v = (torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_(grad)
               for s in (q_shape, k_shape, v_shape))
    mask = None
    if mask_kind == "bool":
        mask = (torch.rand(mask_shape, generator=gen) > 0.3).to(device)
    elif mask_kind == "float":  # float32 masks are allowed on any query dtype, as in SDPA
        mask = torch.randn(mask_shape, generator=gen).to(device).requires_grad_(grad)
    return q, k, v, mask


def _leaves(q, k, v, mask, dtype):
    """Copies of the inputs in `dtype` that gradients can be taken for (a float mask in at least float32)."""
    leaves = [t.detach().to(dtype).requires_grad_(t.requires_grad) for t in (q, k, v)]
    if mask is not None and mask.is_floating_point():
        mask = mask.detach().to(torch.promote_types(dtype, torch.float32)).requires_grad_(mask.requires_grad)
    return leaves, mask


def _plain_attention(q, k, v, mask, is_causal=False, scale=None, enable_gqa=False):
    """SDPA's documented reference code run in the inputs' dtype: matmuls in that dtype, the
    softmax in float32 rounded back, as a plain PyTorch attention would (TESTING.md's out_pt:
    torch's own fp16 SDPA accumulates in float32, too exact to measure what fp16 costs)."""
    if enable_gqa:
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    scale = 1 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)).float() * scale
    if is_causal:
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key: 0, as torch's SDPA gives
    return probs.to(q.dtype) @ v


def _check(out, q, k, v, mask, dtype, do=None, grads=(), factor=2.0, **kw):
    """The rule of TESTING.md for the output (and, with do, for d(query, key, value, mask)):
    the reference is torch's SDPA in float32 (fp16 inputs) or float64 (fp32 inputs)."""
    ref_leaves, ref_mask = _leaves(q, k, v, mask, REF_DTYPE[dtype])
    with sdpa_kernel(SDPBackend.MATH):  # on a GPU the other backends refuse some broadcast masks
        ref = F.scaled_dot_product_attention(*ref_leaves, attn_mask=ref_mask, **kw)
    pt = None
    if dtype != torch.float32:
        pt_leaves, pt_mask = _leaves(q, k, v, mask, dtype)
        pt = _plain_attention(*pt_leaves, pt_mask, **kw)
        assert (pt.float() - ref).abs().max() < 1e-2  # the yardstick computes the same attention
    results = [compare("out", out, ref, pt, factor=factor)]
    if do is not None:
        wanted = lambda leaves, m: leaves + ([m] if m is not None and m.requires_grad else [])  # noqa: E731
        refs = torch.autograd.grad(ref, wanted(ref_leaves, ref_mask), do.to(ref.dtype))
        pts = torch.autograd.grad(pt, wanted(pt_leaves, pt_mask), do) if pt is not None else [None] * len(refs)
        for name, g, r, p in zip(("dquery", "dkey", "dvalue", "dattn_mask"), grads, refs, pts):
            results.append(compare(name, g, r, p, factor=3.0, mean_factor=GRAD_MEAN_FACTOR))
    failed = [str(r) for r in results if not r.ok]
    assert not failed, failed


# (query, key, value, attn_mask shape or None, mask kind, SDPA keywords): odd lengths, L != S
# both ways, GQA, masks broadcast along every dim and in full.
CASES = [
    ((2, 4, 17, 16), (2, 4, 23, 16), (2, 4, 23, 16), None, None, {}),
    ((2, 4, 23, 40), (2, 4, 17, 40), (2, 4, 17, 24), None, None, {"scale": 0.3}),
    ((2, 4, 17, 16), (2, 4, 23, 16), (2, 4, 23, 16), None, None, {"is_causal": True}),
    ((2, 4, 23, 16), (2, 4, 17, 16), (2, 4, 17, 16), None, None, {"is_causal": True}),
    ((2, 8, 9, 32), (2, 2, 33, 32), (2, 2, 33, 32), None, None, {"enable_gqa": True, "is_causal": True}),
    ((2, 4, 19, 16), (2, 4, 19, 16), (2, 4, 19, 16), None, None, {"is_causal": True}),  # L == S: the plain causal spec
    ((1, 8, 13, 16), (1, 1, 13, 16), (1, 1, 13, 16), None, None, {"enable_gqa": True}),
    ((2, 4, 17, 16), (2, 4, 23, 16), (2, 4, 23, 16), (17, 23), "bool", {}),
    ((2, 4, 17, 16), (2, 4, 23, 16), (2, 4, 23, 16), (2, 1, 1, 23), "bool", {}),
    ((2, 8, 23, 16), (2, 2, 17, 16), (2, 2, 17, 16), (1, 8, 23, 17), "bool", {"enable_gqa": True}),
    ((2, 4, 17, 16), (2, 4, 23, 16), (2, 4, 23, 16), (2, 4, 17, 23), "float", {}),
    ((2, 4, 23, 16), (2, 4, 17, 16), (2, 4, 17, 16), (1, 17), "float", {}),
    ((2, 4, 17, 16), (2, 4, 23, 16), (2, 4, 23, 16), (4, 17, 1), "float", {"scale": 0.5}),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("qs, ks, vs, ms, kind, kw", CASES)
def test_forward_matches_torch_sdpa(device, dtype, qs, ks, vs, ms, kind, kw):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((qs, ks, ms, kind)).encode()))
    q, k, v, mask = _inputs(gen, device, dtype, qs, ks, vs, ms, kind)
    out = flashgen.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    assert out.shape == (*qs[:-1], vs[-1]) and out.dtype == dtype
    _check(out, q, k, v, mask, dtype, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("qs, ks, vs, ms, kind, kw", [CASES[i] for i in (3, 4, 5, 9, 10, 11)])
def test_gradients_match_torch_sdpa(device, dtype, qs, ks, vs, ms, kind, kw):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((qs, ks, ms, kind, "grad")).encode()))
    q, k, v, mask = _inputs(gen, device, dtype, qs, ks, vs, ms, kind, grad=True)
    out = flashgen.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    do = torch.randn(out.shape, generator=gen).to(device=device, dtype=dtype)
    leaves = (q, k, v) + ((mask,) if kind == "float" else ())
    grads = torch.autograd.grad(out, leaves, do)
    assert kind != "float" or grads[3].shape == mask.shape  # summed over the broadcast dims
    _check(out, q, k, v, mask, dtype, do=do, grads=grads, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen", [300, 2100])
@pytest.mark.parametrize("ms, kind", [("LS", "bool"), ("B11S", "bool"), ("BHLS", "float")])
def test_gpu_masks_at_head_dim_128_on_their_defaults(seqlen, ms, kind):
    # attn_mask read per block as a (BLOCK_M, BLOCK_N) tile: the default 128 x 128 forward at 3 stages asked 256 KiB
    # of shared memory, past an H100's or H200's 227 (OutOfResources on every such call until session 49)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((seqlen, ms, kind)).encode()))
    mask_shape = {"LS": (seqlen, seqlen), "B11S": (2, 1, 1, seqlen), "BHLS": (2, 4, seqlen, seqlen)}[ms]
    q, k, v, mask = _inputs(gen, "cuda", torch.float16, *[(2, 4, seqlen, 128)] * 3, mask_shape, kind, grad=True)
    out = flashgen.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    do = torch.randn(out.shape, generator=gen).to(device="cuda", dtype=torch.float16)
    grads = torch.autograd.grad(out, (q, k, v) + ((mask,) if kind == "float" else ()), do)
    _check(out, q, k, v, mask, torch.float16, do=do, grads=grads)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_is_causal_with_attn_mask_allows_what_both_allow(device, kind):
    # torch's SDPA (2.13) takes both and combines them (flashgen refused the pair); the reference is
    # the one mask that holds both, so it runs on any torch
    gen = torch.Generator().manual_seed(zlib.crc32(f"causal and {kind}".encode()))
    q, k, v, mask = _inputs(gen, device, torch.float32, (2, 4, 17, 16), (2, 4, 23, 16), (2, 4, 23, 16), (4, 17, 23),
                            kind, grad=True)
    out = flashgen.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    tril = torch.ones(17, 23, dtype=torch.bool, device=device).tril()  # top-left, as SDPA's is_causal
    both = mask & tril if kind == "bool" else mask.masked_fill(~tril, float("-inf"))
    do = torch.randn(out.shape, generator=gen).to(device)
    leaves = (q, k, v) + ((mask,) if kind == "float" else ())
    grads = torch.autograd.grad(out, leaves, do)
    if kind == "float":  # the mask's gradient against the reference's, into the same leaf
        ref_mask = mask.detach().double().requires_grad_()
        ref = F.scaled_dot_product_attention(*(t.detach().double() for t in (q, k, v)),
                                             attn_mask=ref_mask.masked_fill(~tril, float("-inf")))
        (want,) = torch.autograd.grad(ref, ref_mask, do.double())
        assert compare("dattn_mask", grads[3], want, None, factor=3.0, mean_factor=GRAD_MEAN_FACTOR).ok
    _check(out, q, k, v, both.detach() if kind == "float" else both, torch.float32, do=do, grads=grads[:3])


@pytest.mark.parametrize("qs, ks, vs, ms, kind, kw", [
    ((2, 3, 2, 9, 16), (2, 3, 2, 11, 16), (2, 3, 2, 11, 16), (3, 1, 9, 11), "bool", {}),  # 5-d, mask per middle dim
    ((2, 3, 2, 9, 16), (1, 3, 2, 11, 16), (2, 1, 2, 11, 16), None, None, {}),  # leading dims broadcast
    ((2, 3, 2, 9, 16), (2, 3, 2, 11, 16), (2, 3, 2, 11, 16), (9, 11), "float", {}),  # 5-d, one mask for all
    ((4, 9, 16), (4, 11, 16), (4, 11, 8), (9, 11), "float", {}),  # 3-d (N, L, E)
    ((4, 9, 16), (1, 11, 16), (4, 11, 16), (4, 9, 11), "bool", {}),  # 3-d, key's N broadcast, a mask per N
    ((3, 9, 16), (3, 11, 16), (3, 11, 16), None, None, {"is_causal": True}),
    ((9, 16), (11, 16), (11, 16), None, None, {"is_causal": True}),  # 2-d (L, E)
    ((2, 4, 9, 16), (2, 1, 11, 16), (2, 1, 11, 16), None, None, {}),  # one KV head broadcast without GQA
    ((2, 4, 9, 16), (2, 2, 11, 16), (2, 1, 11, 16), None, None, {"enable_gqa": True}),  # key/value head counts differ
    ((2, 4, 9, 16), (2, 4, 11, 16), (2, 4, 11, 16), None, None, {"scale": -0.7}),  # SDPA allows any scale
    ((2, 4, 9, 16), (2, 4, 11, 16), (2, 4, 11, 16), None, None, {"scale": 0.0}),
])
def test_sdpa_shapes_and_scales(device, qs, ks, vs, ms, kind, kw):
    gen = torch.Generator().manual_seed(7)
    q, k, v, mask = _inputs(gen, device, torch.float32, qs, ks, vs, ms, kind)
    out = flashgen.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    assert out.shape == ref.shape
    _check(out, q, k, v, mask, torch.float32, **kw)


def test_float_mask_in_query_dtype(device):
    gen = torch.Generator().manual_seed(11)
    q, k, v, _ = _inputs(gen, device, torch.float16, (2, 4, 17, 16), (2, 2, 23, 16), (2, 2, 23, 16), grad=True)
    mask = torch.randn(2, 1, 17, 23, generator=gen).to(device=device, dtype=torch.float16).requires_grad_()
    out = flashgen.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    do = torch.randn(out.shape, generator=gen).to(device=device, dtype=torch.float16)
    grads = torch.autograd.grad(out, (q, k, v, mask), do)
    assert grads[3].dtype == torch.float16 and grads[3].shape == mask.shape
    _check(out, q, k, v, mask, torch.float16, do=do, grads=grads, enable_gqa=True)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_rows_with_every_key_masked_are_zero_as_in_torch(device, kind):
    gen = torch.Generator().manual_seed(3)
    q, k, v, _ = _inputs(gen, device, torch.float32, (1, 2, 5, 16), (1, 2, 7, 16), (1, 2, 7, 16), grad=True)
    mask = torch.ones(5, 7, dtype=torch.bool, device=device)
    mask[2] = False
    if kind == "float":
        mask = torch.zeros(5, 7, device=device).masked_fill(~mask, float("-inf")).requires_grad_()
    out = flashgen.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2])) and torch.equal(ref[:, :, 2], out[:, :, 2])
    leaves = (q, k, v) + ((mask,) if kind == "float" else ())
    grads = torch.autograd.grad(out.sum(), leaves)
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][:, :, 2], torch.zeros_like(grads[0][:, :, 2]))
    _check(out, q, k, v, mask, torch.float32)


def test_causal_alignment_top_left_here_bottom_right_in_flash_attn_names(device):
    gen = torch.Generator().manual_seed(5)
    q, k, v, _ = _inputs(gen, device, torch.float32, (1, 2, 9, 16), (1, 2, 21, 16), (1, 2, 21, 16))
    top_left = flashgen.scaled_dot_product_attention(q, k, v, is_causal=True)
    bottom_right = flashgen.attention(q, k, v, causal=True)
    i, j = torch.arange(9, device=device)[:, None], torch.arange(21, device=device)[None, :]
    _check(top_left, q, k, v, j <= i, torch.float32)  # SDPA's is_causal: j <= i
    _check(bottom_right, q, k, v, j <= i + 21 - 9, torch.float32)  # flash-attn's causal: j <= i + S - L
    assert (top_left - bottom_right).abs().max() > 0.1


def test_dropout_keeps_one_minus_p_and_rescales(device):
    # Uniform attention (q = 0) over 64 keys of ones: without dropout every output is 1; with
    # dropout each is (kept keys) / (64 * (1 - p)), whose mean over 2 * 2 * 64 rows is 1 +- ~0.01.
    p = 0.25
    q = torch.zeros(2, 2, 64, 16, device=device)
    v = torch.ones(2, 2, 64, 16, device=device)
    out = flashgen.scaled_dot_product_attention(q, torch.randn(2, 2, 64, 16, device=device), v, dropout_p=p)
    rows = out[..., 0]
    assert torch.equal(out, rows[..., None].expand_as(out))  # one keep mask per row, shared by the dims
    assert abs(rows.mean().item() - 1.0) < 0.05
    kept = rows * 64 * (1 - p)
    assert torch.allclose(kept, kept.round(), atol=1e-4) and kept.std() > 0  # whole keys kept, rows differ
    assert torch.equal(flashgen.scaled_dot_product_attention(q, q, v, dropout_p=1.0), torch.zeros_like(out))


def t(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


def test_a_numpy_scale_is_taken_as_sdpa_takes_it(device):
    import numpy as np
    q = torch.randn(1, 2, 8, 16).to(device=device, dtype=torch.float16)
    assert torch.equal(flashgen.scaled_dot_product_attention(q, q, q, scale=np.float32(0.5)),
                       flashgen.scaled_dot_product_attention(q, q, q, scale=0.5))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("scale", [1e300, -1e300])  # (the interpreter's NumPy says so as it overflows)
def test_a_scale_past_float32_gives_what_torch_gives(scale):
    # a positive one past the kernels' limit was refused as 'softmax_scale' (a name the caller never used)
    # where a negative one ran: both multiply the scores now, overflowing to NaN rows as torch's do
    q, k, v = (torch.randn(2, 4, 6, 16) for _ in range(3))
    got = flashgen.scaled_dot_product_attention(q, k, v, scale=scale)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    assert torch.equal(got.isnan(), want.isnan()) and torch.allclose(got.nan_to_num(), want.nan_to_num(), atol=1e-5)


@pytest.mark.parametrize("args, kw, words", [
    ((t(1, 2, 4, 8), t(1, 2, 4, 8), [1]), {}, "value: expected a torch.Tensor"),
    ((t(4), t(4), t(4)), {}, "query: expected at least 2 dims"),
    ((t(1, 2, 4, 8), t(2, 4, 8), t(2, 4, 8)), {}, "key: expected 4 dims"),
    ((t(1, 2, 4, 8), t(1, 2, 4, 8, dtype=torch.float16), t(1, 2, 4, 8)), {}, "key: expected dtype torch.float32"),
    ((t(1, 2, 4, 8, dtype=torch.float64),) * 3, {}, "query: expected dtype float16, bfloat16 or float32"),
    ((t(1, 2, 4, 8), t(1, 2, 4, 4), t(1, 2, 4, 8)), {}, "key: expected head dim 8"),
    ((t(1, 2, 4, 0),) * 3, {}, "query: expected a head dim from 1 to 256, got shape (1, 2, 4, 0)"),
    ((t(1, 2, 4, 8), t(1, 2, 4, 8), t(1, 2, 4, 300)), {}, "value: expected a head dim from 1 to 256"),
    ((t(1, 2, 4, 8), t(1, 2, 5, 8), t(1, 2, 4, 8)), {}, "value: expected seq len 5"),
    ((t(1, 4, 4, 8), t(1, 2, 4, 8), t(1, 2, 4, 8)), {}, "query, key, value: shapes"),
    ((t(1, 4, 4, 8), t(1, 3, 4, 8), t(1, 3, 4, 8)), {"enable_gqa": True}, "key: with enable_gqa its number of heads"),
    ((t(1, 2, 4, 8),) * 3, {"attn_mask": t(3, 4)}, "attn_mask: expected a shape broadcastable to (1, 2, 4, 4)"),
    ((t(1, 2, 4, 8),) * 3, {"attn_mask": t(2, 1, 2, 4, 4)}, "attn_mask: expected a shape broadcastable"),
    ((t(1, 2, 4, 8),) * 3, {"attn_mask": torch.ones(4, 4, dtype=torch.int32)}, "attn_mask: expected dtype bool"),
    ((t(1, 2, 4, 8, dtype=torch.float16),) * 3, {"attn_mask": t(4, 4, dtype=torch.bfloat16)},
     "attn_mask: expected dtype bool, float32 or query's torch.float16"),
    ((t(1, 2, 4, 8),) * 3, {"attn_mask": [[True]]}, "attn_mask: expected a torch.Tensor or None"),
    ((t(1, 2, 4, 8),) * 3, {"is_causal": 1}, "is_causal: expected a bool"),
    ((t(1, 2, 4, 8),) * 3, {"enable_gqa": "yes"}, "enable_gqa: expected a bool"),
    ((t(1, 2, 4, 8),) * 3, {"enable_gqa": np.bool_(False)}, "enable_gqa: expected a bool, got numpy.bool"),
    # sparse and nested tensors: no strides to read (a RuntimeError that named nothing, before)
    ((t(1, 2, 4, 8),) * 3, {"attn_mask": torch.ones(4, 4).to_sparse()},
     "attn_mask: expected a dense (strided) tensor, got layout torch.sparse_coo"),
    ((t(1, 2, 4, 8),) * 3, {"attn_mask": torch.ones(4, 4).to_sparse_csr()},
     "attn_mask: expected a dense (strided) tensor, got layout torch.sparse_csr"),
    ((t(1, 2, 4, 8),) * 3, {"attn_mask": torch.nested.nested_tensor([torch.ones(4, 4)])},
     "attn_mask: expected a dense (strided) tensor, got a nested tensor"),
    ((torch.randn(1, 2, 4, 8).to_sparse(), t(1, 2, 4, 8), t(1, 2, 4, 8)), {},
     "query: expected a dense (strided) tensor, got layout torch.sparse_coo"),
    ((t(1, 2, 4, 8),) * 3, {"dropout_p": 1.5}, "dropout_p: expected a probability in [0, 1], got 1.5"),
    ((t(1, 2, 4, 8),) * 3, {"dropout_p": -0.1}, "dropout_p: expected a probability"),
    ((t(1, 2, 4, 8),) * 3, {"scale": math.inf}, "scale: expected a finite Python number or None, got inf"),
    ((t(1, 2, 4, 8),) * 3, {"scale": "0.1"}, "scale: expected a finite Python number"),
    ((t(1, 2, 4, 8),) * 3, {"scale": torch.tensor(0.3)}, "scale: expected a finite Python number or None, got a tensor of shape ()"),
    # a call with no query rows or no keys checks attn_mask too (torch's SDPA does; it was taken unread)
    ((t(1, 2, 0, 8), t(1, 2, 4, 8), t(1, 2, 4, 8)), {"attn_mask": "garbage"}, "attn_mask: expected a torch.Tensor"),
    ((t(1, 2, 4, 8), t(1, 2, 0, 8), t(1, 2, 0, 8)), {"attn_mask": t(3, 5)}, "attn_mask: expected a shape broadcastable"),
])
def test_bad_arguments_name_the_argument(args, kw, words):
    with pytest.raises((TypeError, ValueError)) as info:
        flashgen.scaled_dot_product_attention(*args, **kw)
    assert words in str(info.value)


def test_checks_kept_per_metadata_still_refuse_other_inputs():
    # _checked_heads keeps the checks' answer per inputs' metadata: a call that differs in any of it is checked
    q = torch.randn(1, 2, 4, 8, dtype=torch.float16)
    flashgen.scaled_dot_product_attention(q, q, q)
    for args, words in (((q, q, q.float()), "value: expected dtype torch.float16"),
                        ((q, q, q[..., :3, :]), "value: expected seq len 4"),
                        ((q.to_sparse(), q, q), "query: expected a dense"),
                        ((q, q[:, :1].expand(1, 3, 4, 8), q), "do not broadcast")):
        with pytest.raises(ValueError, match=words):
            flashgen.scaled_dot_product_attention(*args)


@pytest.mark.parametrize("fill, dtype", [(-1e9, torch.float32), (torch.finfo(torch.float32).min, torch.float32),
                                         (float("-inf"), torch.float32), (-2e4, torch.float32),
                                         (torch.finfo(torch.float16).min, torch.float16)])
@pytest.mark.parametrize("keys", [16, 37])
def test_rows_masked_by_huge_fills_match_torch(device, fill, dtype, keys):
    # Rows wholly masked (row 3) or partly (row 5) by fill. A partly masked row, and -2e4 or float16's min over a
    # whole row, keep their scores as torch's float32 math does. A row wholly below -65536 (-1e9, float32's min,
    # -inf) counts as masked: 0 and no gradient, where torch's math averages V at -1e9 (its float32 rounding) and
    # gives NaN at -inf. (Before, -1e9 gave gradients from a float32 LSE that had lost the row's scale: 2^64 off.)
    g = torch.Generator().manual_seed(zlib.crc32(repr((fill, dtype, keys)).encode()))
    q, k, v = (torch.randn(1, 2, n, 16, generator=g).to(device=device, dtype=dtype).requires_grad_()
               for n in (8, keys, keys))
    mask = torch.randn(8, keys, generator=g).to(device=device, dtype=dtype)
    mask[3] = fill
    mask[5, :6] = fill
    mask.requires_grad_()
    do = torch.randn(1, 2, 8, 16, generator=g).to(device=device, dtype=dtype)
    got = flashgen.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grads = torch.autograd.grad(got, (q, k, v, mask), do)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v, mask)]
    masked = fill < -65536
    if masked:  # the reference: row 3 given every key (any finite fill), its output 0 and its gradient none
        ref_in[3].data[3] = 0.0
        do = do.clone()
        do[:, :, 3] = 0.0
    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(*ref_in[:3], attn_mask=ref_in[3])
    want_grads = torch.autograd.grad(want, ref_in, do.float())
    if masked:
        want = want.detach().clone()
        want[:, :, 3] = 0.0
        want_grads[3][3] = 0.0
    tol = 2e-3 if dtype == torch.float32 else 2e-2
    assert (got.float() - want).abs().max().item() < tol
    for name, a, b in zip(("dq", "dk", "dv", "d(attn_mask)"), grads, want_grads):
        assert (a.float() - b).abs().max().item() < tol * max(1.0, b.abs().max().item()), name


def test_rows_below_the_score_floor_count_as_masked(device):
    # The documented departure: a row whose every score is below -65536 after an additive mask (a fill of -2e5,
    # which torch's float32 math still resolves) gives 0, as a row with no visible key; a row with one key above the
    # floor is torch's. Outside additive masks (a softcap, ALiBi's slopes) nothing is floored (test_render).
    g = torch.Generator().manual_seed(53)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g).to(device) for n in (4, 24, 24))
    mask = torch.randn(4, 24, generator=g).to(device) - 2e5
    mask[1, 5] = -65000.0
    out, lse = flashgen.attention(q, k, v, score_mod="score + bias[q_idx, kv_idx]", bias=mask, return_lse=True)
    assert not out[:, :, [0, 2, 3]].any() and (lse[:, :, [0, 2, 3]] == float("-inf")).all()
    want = F.scaled_dot_product_attention(q[:, :, 1:2], k, v, attn_mask=mask[1:2])
    torch.testing.assert_close(out[:, :, 1:2], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flashgen.scaled_dot_product_attention(q, k, v, attn_mask=mask), out)


@pytest.mark.parametrize("lq, lk", [(0, 8), (8, 0)])
def test_zero_length_calls_return_what_torch_does(device, lq, lk):
    # (a 0-size length made the 4-d flattening's reshape(-1, ...) undetermined: a reshape error)
    q = torch.randn(1, 2, lq, 16).to(device=device, dtype=torch.float16)
    k = torch.randn(1, 2, lk, 16).to(device=device, dtype=torch.float16)
    out = flashgen.scaled_dot_product_attention(q, k, k)
    assert out.shape == (1, 2, lq, 16)
    assert not out.isnan().any() and (lk or not out.any())  # no keys: rows of 0 (torch: NaN)


@pytest.mark.parametrize("qs, ms", [((0, 5, 16), (0, 5, 6)), ((0, 2, 5, 16), (0, 2, 5, 6)), ((2, 0, 5, 16), (2, 1, 5, 6)),
                                    ((0, 2, 5, 16), None)], ids=["3-d N=0", "batch 0", "no heads", "batch 0 no mask"])
def test_empty_batches_and_no_heads_return_what_torch_does(device, qs, ms):
    # (an empty batch with a per-element mask was refused: the mask, a named tensor, had no elements)
    q, k, v = (torch.randn(*qs[:-2], n, 16).to(device).requires_grad_() for n in (5, 6, 6))
    mask = None if ms is None else (torch.rand(ms) < 0.5).to(device)
    out = flashgen.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.shape == torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).shape
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert [g.shape for g in grads] == [t.shape for t in (q, k, v)]


def test_sdpa_3d_inputs_of_any_n_share_one_kernel(device, monkeypatch):
    # (N, L, E) read N as the head count, a constant of the kernel: a spec and a kernel per N (and under
    # torch.compile a recompile per N); N is now a batch of single-head sequences
    from flashgen import api

    gen = torch.Generator().manual_seed(3)
    qkv = [torch.randn(3, 9, 16, generator=gen).to(device) for _ in range(3)]
    flashgen.scaled_dot_product_attention(*qkv)
    built = []
    original = api.spec_for
    monkeypatch.setattr(api, "spec_for", lambda *a, **kw: built.append(1) or original(*a, **kw))
    qkv = [torch.randn(5, 9, 16, generator=gen).to(device) for _ in range(3)]
    out = flashgen.scaled_dot_product_attention(*qkv)
    assert not built
    torch.testing.assert_close(out, F.scaled_dot_product_attention(*qkv), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ms", [(23, 29), (2, 1, 1, 29), (2, 4, 23, 29)], ids=str)
def test_a_mask_seen_before_takes_the_fast_path_with_each_calls_contents(device, monkeypatch, ms):
    # A masked call of metadata seen before runs its plan after one lookup (api's fast path with the named tensor's
    # metadata in its key): no binding, plan key or mask check. Each call's mask and inputs give torch's answer,
    # forward and gradients (bool masks: every tile partial, whole or empty in turn); a float mask that requires
    # grad keeps the checked path (its gradient needs ops._gradient_ready's copy), and its gradient is torch's.
    from flashgen import api, sdpa

    monkeypatch.setattr(api, "_FAST", {})
    monkeypatch.setattr(api, "_BOUND", {})
    monkeypatch.setattr(sdpa, "_MASKS", {})
    slow = []
    binding = api._eager_binding
    monkeypatch.setattr(api, "_eager_binding", lambda *a: slow.append(1) or binding(*a))
    gen = torch.Generator().manual_seed(zlib.crc32(repr(ms).encode()))
    rows, cols = torch.arange(23)[:, None], torch.arange(29)[None, :]
    structured = (rows >= cols) if ms[-2] == 23 else (cols < 17)  # causal, or keys past 17 padding
    contents = [torch.rand(ms, generator=gen) < 0.5, structured.expand(ms), torch.ones(ms, dtype=torch.bool)]
    for step, keep in enumerate(contents * 2):
        grad = step >= len(contents)
        q, k, v, _ = _inputs(gen, device, torch.float16, (2, 4, 23, 16), (2, 4, 29, 16), (2, 4, 29, 16), grad=grad)
        keep = keep.clone().to(device)
        out = flashgen.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        if grad:
            do = torch.randn(out.shape, generator=gen).to(device=device, dtype=torch.float16)
            _check(out, q, k, v, keep, torch.float16, do=do, grads=torch.autograd.grad(out, (q, k, v), do))
        else:
            _check(out, q, k, v, keep, torch.float16)
    assert len(slow) == 2, "a masked call seen before took the checked path"  # the first no-grad and grad calls
    for step in range(2):  # a float mask without a gradient: the fast path after its first call
        q, k, v, bias = _inputs(gen, device, torch.float16, (2, 4, 23, 16), (2, 4, 29, 16), (2, 4, 29, 16), ms,
                                "float")
        _check(flashgen.scaled_dot_product_attention(q, k, v, attn_mask=bias), q, k, v, bias, torch.float16)
    assert len(slow) == 3
    for step in range(2):
        q, k, v, bias = _inputs(gen, device, torch.float16, (2, 4, 23, 16), (2, 4, 29, 16), (2, 4, 29, 16), ms,
                                "float", grad=True)
        out = flashgen.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        do = torch.randn(out.shape, generator=gen).to(device=device, dtype=torch.float16)
        _check(out, q, k, v, bias, torch.float16, do=do, grads=torch.autograd.grad(out, (q, k, v, bias), do))
    assert len(slow) == 5
    for step in range(2):  # the same float mask (a learned bias) in eval, without grad mode: the fast path
        q, k, v, bias = _inputs(gen, device, torch.float16, (2, 4, 23, 16), (2, 4, 29, 16), (2, 4, 29, 16), ms,
                                "float", grad=True)
        with torch.no_grad():
            out = flashgen.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        assert out.grad_fn is None
        _check(out, q, k, v, bias.detach(), torch.float16)
    assert len(slow) == 6
    with pytest.raises(ValueError, match="attn_mask: expected a shape broadcastable"):
        flashgen.scaled_dot_product_attention(q, k, v, attn_mask=keep[..., :5])
