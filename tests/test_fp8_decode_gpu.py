"""Decode over an FP8 KV cache on the GPU (issue 17): tests/test_fp8_decode.py's checks at real
sizes with bf16 queries, the GPU's own fp32 -> FP8 conversion in the append (bit for bit torch's
cast), FP8 queries through flash_attn_with_kvcache, and a CUDA-graph replay.
Run with `python3 -m pytest -m gpu tests/test_fp8_decode_gpu.py`."""

import pytest
import torch

from flashgen.compat import flash_attn_with_kvcache
from flashgen.verify import compare

from .test_decode import _seeded, reference_decode
from .test_fp8_decode import Fp8Cache, quantize, run_fp8_decode

pytestmark = pytest.mark.gpu

# (fp8, (heads, kv heads), head dim, query rows, page size, num_splits; 0: the heuristic)
GRID = [
    ("e4m3", (32, 8), 128, 1, None, 0), ("e4m3", (32, 8), 128, 1, 1, 0), ("e4m3", (32, 8), 128, 1, 16, 7),
    ("e4m3", (32, 8), 128, 4, 256, 0), ("e5m2", (32, 8), 128, 1, None, 7), ("e5m2", (8, 1), 64, 16, 16, 0),
    ("e4m3", (8, 1), 64, 1, None, 1), ("e4m3", (6, 6), 80, 4, 16, 0),
]


@pytest.mark.parametrize("fp8,heads,d,sq,page_size,num_splits", GRID,
                         ids=[f"{f}-h{h[0]}x{h[1]}-d{d}-sq{sq}-page{p}-splits{n}" for f, h, d, sq, p, n in GRID])
def test_fp8_decode_grid(fp8, heads, d, sq, page_size, num_splits):
    run_fp8_decode("cuda", fp8=fp8, dtype="bf16", heads=heads, d=d, sq=sq, page_size=page_size,
                   num_splits=num_splits, batch=3, lengths=(4097, 3, 1531), capacity=4352, BLOCK_N=None)


@pytest.mark.parametrize("batch,page_size", [(64, None), (16, None), (1, None), (2, 16)],
                         ids=["crowded", "fills", "one-seq", "paged16"])
def test_fp8_default_knobs_gpu(batch, page_size):
    # The FP8 defaults at both ends: a grid crowded with programs (64-key tiles, 2 warps), one that fills
    # the SMs one program each (128 x 3), and one split two programs per SM (128 x 3; one sequence: ~33
    # splits over 8 KV heads).
    base = (4097, 3, 1531, 4000, 1, 2048, 700, 4096, 17, 3000, 1024, 63, 2500, 129, 4095, 2)
    lengths = tuple(max(1, n - 5 * i) for i in range(4) for n in base)
    run_fp8_decode("cuda", fp8="e4m3", dtype="bf16", heads=(32, 8), d=128, sq=1, page_size=page_size,
                   num_splits=0, batch=batch, lengths=lengths, capacity=4352, BLOCK_N=None)


@pytest.mark.parametrize("page_size", [None, 16])
def test_fp8_fused_merge_gpu(page_size):
    # The splits merged in the split kernel's last program (fused_combine) over an FP8 cache.
    run_fp8_decode("cuda", fp8="e4m3", dtype="bf16", heads=(32, 8), d=128, sq=1, page_size=page_size, num_splits=0,
                   batch=3, lengths=(4097, 3, 1531), capacity=4352, BLOCK_N=None, fused_combine=True)


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
def test_fp8_rows_beyond_fp16_range_gpu(fp8):
    # bf16 queries take the fp16 products (q scaled per row by a power of two) and V's asm
    # conversion: a row at 3e5 (a plain fp16 cast overflows) and one at 1e-6 stay within the rule.
    run_fp8_decode("cuda", fp8=fp8, dtype="bf16", heads=(32, 8), d=128, sq=1, batch=3, lengths=(4097, 1, 1531),
                   capacity=4352, BLOCK_N=None, num_splits=0, head_scales=(3e5, 1e-6, 40.0, 1.0) * 8)


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
def test_fp8_append_gpu(fp8):
    # The GPU's conversion in the append kernel: bit for bit torch's (saturated, nearest even).
    cache, _, _ = run_fp8_decode("cuda", fp8=fp8, dtype="bf16", heads=(32, 8), d=128, sq=3, appended=3,
                                 page_size=16, lengths=(1000, 17, 3), capacity=1024, num_splits=0, BLOCK_N=None)
    dtype = cache.k_cache.dtype
    for b, n in enumerate(cache.lengths):
        j = torch.arange(n - 3, n, device="cuda")
        pages = cache.block_table[b].long()[j // 16]
        want_k = quantize(cache.new_k[b], cache.k_descale[b][:, None], dtype)
        want_v = quantize(cache.new_v[b], cache.v_descale[b][:, None], dtype)
        assert torch.equal(cache.k_cache[pages, j % 16].view(torch.uint8), want_k.view(torch.uint8))
        assert torch.equal(cache.v_cache[pages, j % 16].view(torch.uint8), want_v.view(torch.uint8))


def test_fp8_queries_compat_gpu():
    # flash-attn 3's all-FP8 call: q in FP8 with q_descale, bf16 out, over the dequantized inputs.
    seed, gen = _seeded()
    cache = Fp8Cache(gen, torch.float8_e4m3fn, 4, 8, 128, (4097, 3, 1531, 800), 4352, torch.bfloat16, "cuda")
    q = torch.randn(4, 2, 32, 128, generator=gen)
    q8, q_descale = quantize(q, 0.01, torch.float8_e4m3fn).cuda(), torch.full((4, 8), 0.01, device="cuda")
    out = flash_attn_with_kvcache(q8, cache.k_cache, cache.v_cache, cache_seqlens=cache.cache_seqlens, causal=True,
                                  q_descale=q_descale, k_descale=cache.k_descale, v_descale=cache.v_descale)
    assert out.dtype == torch.bfloat16
    q_deq = (q8.float() * 0.01).to(torch.bfloat16)  # exact: FP8 x 2^-k-ish scale, rounded once in both
    out_ref, _, out_pt, _ = reference_decode(q_deq, cache, causal=True)
    result = compare("out", out, out_ref, out_pt)
    assert result.ok, f"seed={seed}: {result}"


@pytest.mark.parametrize("page_size,lengths,again", [(16, (600, 300), (450, 17)), (None, (8000, 300), (7000, 150))],
                         ids=["paged16", "contiguous-splits"])
def test_fp8_cuda_graph_replay(page_size, lengths, again):
    # Captured once with an FP8 cache, replayed with new cache_seqlens (within the stored keys: the slots past
    # them hold NaN): the eager call's result bit for bit.
    # Contiguous: 8K keys split over the SMs and merged by the split kernel's last program, whose tickets must
    # be back at 0 for each replay. On sm90 both run the Gluon FP8-cache kernel (asserted).
    from flashgen import kvcache

    seed, gen = _seeded()
    cache = Fp8Cache(gen, torch.float8_e4m3fn, 2, 8, 128, lengths, 8192, torch.bfloat16, "cuda",
                     page_size=page_size)
    q = torch.randn(2, 1, 32, 128, generator=gen).to("cuda", torch.bfloat16)
    launcher = kvcache.compat_launcher(q, cache.k_cache, cache.v_cache, True, (-1, -1), 0.0, None, None)
    launcher.calls.clear()
    seqlens = cache.cache_seqlens.clone()
    step = lambda: flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=seqlens,  # noqa: E731
                                           block_table=cache.block_table, causal=True, k_descale=cache.k_descale,
                                           v_descale=cache.v_descale)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for step_lengths in (again, lengths):
        seqlens.copy_(torch.tensor(step_lengths, dtype=torch.int32))
        graph.replay()
        eager = flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=seqlens,
                                        block_table=cache.block_table, causal=True, k_descale=cache.k_descale,
                                        v_descale=cache.v_descale)
        assert torch.equal(out, eager) and not out.isnan().any(), f"seed={seed} lengths={step_lengths}"
    if torch.cuda.get_device_capability()[0] == 9:
        bound = {bound[1].kernel.fn.__name__ for call in launcher.calls.values() for bound in call.bound.values()}
        assert bound == {"_attn_decode_fp8"}
