"""The Gluon decode over an FP8 cache (templates/decode/fp8_cache.j2, DecodeLauncher.fp8_kernel, issue 17's
decode bytes/s). The CPU checks what renders it and how a call is routed to it (the interpreter runs no
Gluon: its kernel compiles for sm90 in tests/sm90_compile.py); the GPU checks every path it serves against
the reference on fresh random inputs, and that the calls it must leave run _attn_decode."""

import pytest
import torch

import flashgen
from flashgen import AttentionSpec
from flashgen.compat import flash_attn_with_kvcache
from flashgen.verify import compare

from .helpers import sm90
from .test_decode import _seeded, reference_decode
from .test_fp8_decode import Fp8Cache, run_fp8_decode


def decoder(heads=(32, 8), d=128, causal=True, dtype="bf16", **fields):
    spec = AttentionSpec(dtype=dtype, head_dim=d, num_heads=heads[0], num_kv_heads=heads[1], causal=causal,
                         backward=False, **fields)
    return flashgen.compile(spec).module()._DECODE


def compat_decoder(q, cache):
    """The DecodeLauncher flash_attn_with_kvcache(q, cache, cache, causal=True) runs on."""
    from flashgen import kvcache
    return kvcache.compat_launcher(q, cache, cache, True, (-1, -1), 0.0, None, None)


def launched(dec):
    """The split-KV kernels the launcher's calls bound since its calls were last cleared."""
    return {bound[1].kernel.fn.__name__ for call in dec.calls.values() for bound in call.bound.values()}


# ----------------------------------------------------------------------------- CPU: what renders it, the plan
@pytest.mark.parametrize("fields,rendered", [
    (dict(), True), (dict(d=64, causal=False), True), (dict(heads=(8, 1), d=64), True),
    (dict(d=80), False), (dict(d=256), False), (dict(mask={"sliding_window": {"left": 64}}), False),
    (dict(score_mod={"softcap": 30.0}), False), (dict(head_dim_v=64), False),
], ids=["hd128-causal", "hd64", "mqa", "hd80", "hd256", "window", "softcap", "head_dim_v"])
def test_renders_for_the_specs_it_serves(fields, rendered):
    dec = decoder(**fields)
    assert (dec.fp8_kernel is not None) == rendered
    module = dec.fp8_kernel.fn.__globals__ if rendered else None
    assert module is None or module["_DECODE"] is dec  # its module's launcher holds it


def test_the_cpu_and_the_interpreter_never_take_it():
    dec = decoder()
    q = torch.zeros(2, 1, 32, 128, dtype=torch.bfloat16)
    cache = torch.zeros(2, 256, 8, 128).to(torch.float8_e4m3fn)
    assert not dec.fp8_gluon(q, cache, cache, {})  # a CPU tensor (Triton's interpreter)


def test_plan_takes_its_tiles_splits_and_ring(monkeypatch):
    # 128-key tiles on 4 warps, a ring of 3 stages (2 where the grid crowds the SMs: B=64 x 8 KV heads on 132
    # SMs, 512 programs), and the splits that give each program an SM (B=1 x 8 KV heads: 16; B=8: 2), half
    # _attn_decode's FP8 count, over pages of any size; a split count the call names is kept.
    from flashgen.runtime import decode as host_decode
    monkeypatch.setattr(host_decode, "sm_count", lambda device: 132)
    dec = decoder()
    cpu = torch.device("cpu")
    one = dec.plan(1, 1, 131072, cpu, {}, None, 1, fp8_gluon=True)
    assert (one["gluon"], one["BLOCK_N"], one["num_warps"], one["STAGES"], one["BLOCK_M"]) == (True, 128, 4, 3, 16)
    assert one["splits"] == 16 and one["grid"] == (16, 1, 8) and one["fused"]
    assert dec.plan(1, 1, 131072, cpu, {}, None, 1)["splits"] == 33  # _attn_decode's: two per SM
    assert dec.plan(8, 1, 8192, cpu, {}, None, 1, fp8_gluon=True)["splits"] == 2
    assert dec.plan(8, 1, 8192, cpu, {}, 256, 1, fp8_gluon=True)["splits"] == 2  # a page per tile or more
    assert dec.plan(8, 1, 8192, cpu, {}, 16, 1, fp8_gluon=True)["splits"] == 2  # 16-key pages: the same
    assert dec.plan(8, 1, 8192, cpu, {}, 16, 1)["splits"] == 4  # _attn_decode's over them: two per SM
    assert dec.plan(1, 1, 131072, cpu, {"num_splits": 5}, None, 1, fp8_gluon=True)["splits"] == 5
    crowded = dec.plan(64, 1, 4096, cpu, {}, None, 1, fp8_gluon=True)
    assert (crowded["splits"], crowded["BLOCK_N"], crowded["STAGES"]) == (1, 128, 2)
    assert not dec.plan(64, 1, 4096, cpu, {}, None, 1)["gluon"]


def test_unaligned_caches_bind_the_triton_kernel_without_its_ring():
    dec = decoder()
    call = type("Call", (), {})()
    call.plan = dict(gluon=True, grid=(3, 1, 8), split=True, fused=True, combine_grid=(24, 1, 1))
    call.kernel_constexprs = dict(BLOCK_M=16, BLOCK_N=128, STAGES=3, num_warps=4)
    call.append_args = None
    _, kernel, _ = dec.bind(call, aligned=True)
    assert kernel.kernel is dec.fp8_kernel and kernel.constexprs["STAGES"] == 3
    _, kernel, _ = dec.bind(call, aligned=False)
    assert kernel.kernel is dec.kernel and "STAGES" not in kernel.constexprs
    buffer = torch.zeros(16 * 1024 + 8, dtype=torch.uint8)
    assert buffer.data_ptr() % 64 == 0  # (torch's CPU allocator aligns to 64 bytes)
    aligned = buffer[:16 * 1024].view(torch.float8_e4m3fn).view(1, 16, 8, 128)
    shifted = buffer[8:].view(torch.float8_e4m3fn).view(1, 16, 8, 128)
    assert dec.fp8_aligned(aligned, aligned)
    assert not dec.fp8_aligned(aligned, shifted) and not dec.fp8_aligned(shifted, aligned)
    odd_rows = torch.zeros(1, 16, 8, 136).to(torch.float8_e4m3fn)[..., :128]  # 136-byte key rows
    assert not dec.fp8_aligned(odd_rows, odd_rows)


# ----------------------------------------------------------------------------- GPU: every path against the reference
# (fp8, spec dtype (queries and output), (heads, kv heads), head dim, query rows, page size, appended keys, causal)
GRID = [
    ("e4m3", "bf16", (32, 8), 128, 1, None, 0, True), ("e4m3", "bf16", (32, 8), 128, 4, None, 0, True),
    ("e5m2", "bf16", (32, 8), 128, 1, 256, 0, True), ("e4m3", "bf16", (32, 8), 128, 2, 16, 0, True),
    ("e4m3", "bf16", (8, 1), 64, 2, 1, 0, True), ("e5m2", "bf16", (16, 16), 64, 1, None, 0, False),
    ("e4m3", "bf16", (32, 8), 64, 3, 64, 3, True), ("e4m3", "fp16", (32, 8), 128, 3, None, 2, False),
    # pages that neither divide a 128-key tile nor are a multiple of it (a key's slot from its own index), and pages
    # of a whole tile (one block table entry per tile)
    ("e4m3", "bf16", (32, 8), 128, 1, 48, 0, True), ("e5m2", "bf16", (16, 4), 64, 2, 128, 1, False),
]


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("fp8,dtype,heads,d,sq,page_size,appended,causal", GRID,
                         ids=[f"{f}-{t}-h{h[0]}x{h[1]}-d{d}-sq{sq}-page{p}-append{a}-{'causal' if c else 'full'}"
                              for f, t, h, d, sq, p, a, c in GRID])
def test_gluon_decode_grid_gpu(fp8, dtype, heads, d, sq, page_size, appended, causal):
    dec = decoder(heads, d, causal, dtype)
    dec.calls.clear()
    # lengths past one tile and a split, of one key, and of none (a sequence of 0 keys: O = 0, LSE = -inf)
    run_fp8_decode("cuda", fp8=fp8, dtype=dtype, heads=heads, d=d, sq=sq, page_size=page_size, appended=appended,
                   num_splits=0, batch=4, lengths=(4097 + appended, 1 + appended, 1531, appended), capacity=4352,
                   BLOCK_N=None, causal=causal)
    assert launched(dec) == {"_attn_decode_fp8"}


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("batch,length", [(1, 131072), (8, 8192), (64, 4096)], ids=["splits", "fused", "crowded"])
def test_gluon_decode_default_grids_gpu(batch, length):
    # The benchmark's shapes (bench_decode --fp8): one long sequence over many splits merged in the kernel, a
    # few sequences split, and a crowded unsplit grid (2 stages); ragged lengths.
    dec = decoder()
    dec.calls.clear()
    gen_lengths = [max(1, length - 977 * i) for i in range(batch)]
    run_fp8_decode("cuda", fp8="e4m3", dtype="bf16", heads=(32, 8), d=128, sq=1, num_splits=0, batch=batch,
                   lengths=gen_lengths, capacity=length, BLOCK_N=None)
    assert launched(dec) == {"_attn_decode_fp8"}


@sm90
@pytest.mark.gpu
def test_gluon_decode_cache_batch_idx_and_lse_gpu():
    # cache_batch_idx picks rows of a larger cache (one twice), through flash_attn_with_kvcache with return_lse
    seed, gen = _seeded()
    cache = Fp8Cache(gen, torch.float8_e4m3fn, 5, 8, 128, (300, 4097, 17, 2000, 1), 4352, torch.bfloat16, "cuda")
    rows = [3, 0, 4, 3]
    q = torch.randn(4, 1, 32, 128, generator=gen).to("cuda", torch.bfloat16)
    dec = compat_decoder(q, cache.k_cache)
    dec.calls.clear()
    index = torch.tensor(rows, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=cache.cache_seqlens[index],
                                       cache_batch_idx=index, causal=True, k_descale=cache.k_descale[index],
                                       v_descale=cache.v_descale[index], return_softmax_lse=True)
    picked = type("Picked", (), {})()
    picked.lengths = [cache.lengths[r] for r in rows]
    picked.dense_k, picked.dense_v = [cache.dense_k[r] for r in rows], [cache.dense_v[r] for r in rows]
    out_ref, lse_ref, out_pt, lse_pt = reference_decode(q, picked, causal=True)
    for result in (compare("out", out, out_ref, out_pt), compare("lse", lse, lse_ref, lse_pt)):
        assert result.ok, f"seed={seed}: {result}"
    assert launched(dec) == {"_attn_decode_fp8"}


@sm90
@pytest.mark.gpu
def test_the_interpreter_never_takes_it_gpu(monkeypatch):
    dec = decoder()
    q = torch.zeros(2, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    cache = torch.zeros(2, 256, 8, 128, device="cuda").to(torch.float8_e4m3fn)
    assert dec.fp8_gluon(q, cache, cache, {})
    monkeypatch.setattr(dec.attention, "interpreting", lambda: True)
    assert not dec.fp8_gluon(q, cache, cache, {})
    assert not dec.fp8_gluon(q, cache.to(torch.bfloat16), cache.to(torch.bfloat16), {})  # a 16-bit cache


@sm90
@pytest.mark.gpu
def test_gluon_decode_leaves_what_it_does_not_serve_gpu():
    # Knobs naming _attn_decode's tiles, an unaligned cache and more than 16 packed rows run _attn_decode; a
    # split count or merge named by the call stays on the Gluon kernel.
    dec = decoder()
    for kw, kernel in ((dict(BLOCK_N=64), "_attn_decode"), (dict(num_warps=8), "_attn_decode"),
                       (dict(num_splits=3), "_attn_decode_fp8"), (dict(num_splits=2, fused_combine=False),
                                                                 "_attn_decode_fp8")):
        dec.calls.clear()
        run_fp8_decode("cuda", fp8="e4m3", dtype="bf16", heads=(32, 8), d=128, sq=1, batch=2, lengths=(1000, 77),
                       capacity=1024, **{"num_splits": 0, "BLOCK_N": None, **kw})
        assert launched(dec) == {kernel}, kw
    dec.calls.clear()
    run_fp8_decode("cuda", fp8="e4m3", dtype="bf16", heads=(32, 8), d=128, sq=5, batch=2, lengths=(1000, 77),
                   capacity=1024, num_splits=0, BLOCK_N=None)  # 20 packed rows
    assert launched(dec) == {"_attn_decode"}
    # an FP8 cache 8 bytes past a 16-byte boundary: the same plan on _attn_decode
    seed, gen = _seeded()
    cache = Fp8Cache(gen, torch.float8_e4m3fn, 2, 8, 128, (1000, 77), 1024, torch.bfloat16, "cuda")
    shifted = []
    for t in (cache.k_cache, cache.v_cache):
        raw = torch.empty(t.numel() + 8, dtype=torch.uint8, device="cuda")
        view = raw[8:].view(torch.float8_e4m3fn).view(t.shape)
        view.copy_(t)
        shifted.append(view)
    q = torch.randn(2, 1, 32, 128, generator=gen).to("cuda", torch.bfloat16)
    dec = compat_decoder(q, cache.k_cache)
    dec.calls.clear()
    out = flash_attn_with_kvcache(q, *shifted, cache_seqlens=cache.cache_seqlens, causal=True,
                                  k_descale=cache.k_descale, v_descale=cache.v_descale)
    out_ref, _, out_pt, _ = reference_decode(q, cache, causal=True)
    result = compare("out", out, out_ref, out_pt)
    assert result.ok, f"seed={seed}: {result}"
    assert launched(dec) == {"_attn_decode"}
    # and the same call on the aligned cache takes the Gluon kernel, with the same result up to rounding
    aligned = flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=cache.cache_seqlens,
                                      causal=True, k_descale=cache.k_descale, v_descale=cache.v_descale)
    assert compare("out", aligned, out_ref, out_pt).ok
    assert "_attn_decode_fp8" in launched(dec)


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("page_size,column", [(16, 5), (48, 3), (256, 1)])
def test_gluon_decode_bounds_gpu(page_size, column):
    # Indices out of range are clamped and named as _attn_decode's are: a block table entry past the pool (check
    # "sync": the call raises; the pages a tile reads per key, per tile, and of another size), a length past the
    # capacity (the next call raises), then a good call is right.
    from flashgen import kvcache

    seed, gen = _seeded()
    cache = Fp8Cache(gen, torch.float8_e4m3fn, 2, 8, 128, (1000, 300), 1024, torch.bfloat16, "cuda",
                     page_size=page_size)
    q = torch.randn(2, 1, 32, 128, generator=gen).to("cuda", torch.bfloat16)
    dec = compat_decoder(q, cache.k_cache)
    kw = dict(causal=True, k_descale=cache.k_descale, v_descale=cache.v_descale)
    dec.calls.clear()
    good = flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=cache.cache_seqlens,
                                   block_table=cache.block_table, **kw)
    pool = cache.k_cache.shape[0]
    table = cache.block_table.clone()
    table[1, column] = pool + 7
    with pytest.raises(ValueError, match=rf"block_table: .*\[0, {pool}\).* got {pool + 7} at \[1, {column}\]"):
        flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=cache.cache_seqlens, block_table=table,
                                check="sync", **kw)
    capacity = cache.block_table.shape[1] * page_size
    lengths = torch.tensor([capacity + 1, 300], dtype=torch.int32, device="cuda")
    flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=lengths, block_table=cache.block_table,
                            **kw)
    with pytest.raises(ValueError, match=f"cache_seqlens: .*capacity {capacity}, got {capacity + 1} at index 0"):
        kvcache.check_bounds()
    out = flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=cache.cache_seqlens,
                                  block_table=cache.block_table, **kw)
    assert torch.equal(out, good), f"seed={seed}"
    # an entry past a sequence's keys is neither read nor named, also by a split with no keys whose first key lies in
    # its column (8 splits of 128 keys: batch 1's 300 keys fill splits 0-2; over 256-key pages split 5 starts at 640)
    past = cache.block_table.clone()
    past[1, -(-300 // page_size)] = pool + 7
    split8 = dict(kw, cache_seqlens=cache.cache_seqlens, num_splits=8)
    eight = flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache, block_table=cache.block_table, **split8)
    assert torch.equal(flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache, block_table=past, check="sync",
                                               **split8), eight), f"seed={seed}"
    assert launched(dec) == {"_attn_decode_fp8"}
    # a contiguous cache: a negative length, then a cache_batch_idx row past the cache (both with check "sync")
    flat = Fp8Cache(gen, torch.float8_e4m3fn, 3, 8, 128, (1000, 300, 50), 1024, torch.bfloat16, "cuda")
    kw = dict(causal=True, k_descale=flat.k_descale[:2], v_descale=flat.v_descale[:2], check="sync")
    dec = compat_decoder(q, flat.k_cache)
    dec.calls.clear()
    with pytest.raises(ValueError, match="cache_seqlens: .*-3"):
        flash_attn_with_kvcache(q, flat.k_cache[:2], flat.v_cache[:2], cache_seqlens=torch.tensor(
            [-3, 300], dtype=torch.int32, device="cuda"), **kw)
    with pytest.raises(ValueError, match="cache_batch_idx: .*got 5"):
        flash_attn_with_kvcache(q, flat.k_cache, flat.v_cache, cache_seqlens=flat.cache_seqlens[:2],
                                cache_batch_idx=torch.tensor([0, 5], dtype=torch.int32, device="cuda"), **kw)
    assert launched(dec) == {"_attn_decode_fp8"}
    kvcache.check_bounds()  # nothing left recorded
