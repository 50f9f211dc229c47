"""Decode on the GPU: the CPU grid of tests/test_decode.py at real sizes in bf16 (and fp16),
the default knobs (split heuristic, BLOCK_N) included, CUDA-graph capture and replay with new
cache_seqlens, and bitwise-repeatable outputs. Run with `python3 -m pytest -m gpu tests/test_decode_gpu.py`."""

import pytest
import torch

import flashgen
from flashgen import AttentionSpec
from flashgen.compat import flash_attn_with_kvcache
from flashgen.runtime import decode as host_decode
from flashgen.verify import compare

from .test_decode import Cache, _read_and_decode, _seeded, reference_decode, run_decode

pytestmark = pytest.mark.gpu


# (dtype, (heads, kv heads), head dim, query rows, page size, num_splits): every value of each
# dimension at least once, in bf16 mostly (0 splits: the heuristic, which splits here).
GRID = [
    ("bf16", (32, 8), 128, 1, None, 0), ("bf16", (32, 8), 128, 1, 1, 0), ("bf16", (32, 8), 128, 1, 16, 0),
    ("bf16", (32, 8), 128, 1, 256, 0), ("bf16", (32, 8), 128, 16, None, 1), ("bf16", (32, 8), 128, 16, 16, 7),
    ("bf16", (32, 8), 128, 4, 256, 7), ("bf16", (8, 1), 64, 1, None, 7), ("bf16", (8, 1), 64, 4, 1, 1),
    ("bf16", (8, 1), 64, 16, 256, 0), ("bf16", (6, 6), 80, 1, 16, 1), ("bf16", (6, 6), 80, 4, None, 0),
    ("bf16", (6, 6), 80, 16, 1, 7), ("fp16", (32, 8), 128, 1, 16, 0), ("fp16", (8, 1), 64, 16, None, 7),
    ("fp16", (6, 6), 80, 4, 256, 1),
]


@pytest.mark.parametrize("dtype,heads,d,sq,page_size,num_splits", GRID,
                         ids=[f"{t}-h{h[0]}x{h[1]}-d{d}-sq{sq}-page{p}-splits{n}" for t, h, d, sq, p, n in GRID])
def test_decode_grid(dtype, heads, d, sq, page_size, num_splits):
    run_decode("cuda", dtype=dtype, heads=heads, d=d, sq=sq, page_size=page_size, num_splits=num_splits, batch=3,
               lengths=(4097, 3, 1531), capacity=4352, BLOCK_N=None)


# Split rows merged by the combine kernel and in the split kernel's last program (fused_combine):
# contiguous at the heuristic's split count, paged-16 with 16 query rows, MQA hd64, 128 splits.
SEPARATE = [((32, 8), 128, 1, None, 0), ((32, 8), 128, 16, 16, 7), ((8, 1), 64, 4, None, 7),
            ((32, 8), 128, 1, None, 128)]


@pytest.mark.parametrize("heads,d,sq,page_size,num_splits", SEPARATE,
                         ids=[f"h{h[0]}x{h[1]}-d{d}-sq{sq}-page{p}-splits{n}" for h, d, sq, p, n in SEPARATE])
@pytest.mark.parametrize("fused", [False, True], ids=["combine-kernel", "in-split-kernel"])
def test_both_merges_gpu(heads, d, sq, page_size, num_splits, fused):
    run_decode("cuda", dtype="bf16", heads=heads, d=d, sq=sq, page_size=page_size, num_splits=num_splits, batch=3,
               lengths=(4097, 3, 1531), capacity=4352, BLOCK_N=None, fused_combine=fused)


def test_fused_merge_is_repeatable_under_contention_gpu():
    # 128 splits of one sequence (8 KV heads: 1024 programs racing for 8 tickets), 20 launches:
    # every one bitwise equal to the first (the merge reads the splits in one order whoever
    # merges), right by the rule, and the tickets 0 after each.
    seed, gen = _seeded()
    cache = Cache(gen, 1, 8, 128, (16381,), 16384, torch.bfloat16, "cuda")
    q = torch.randn(1, 1, 32, 128, generator=gen).to("cuda", torch.bfloat16)
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=32, num_kv_heads=8, causal=True)
    run = lambda: flashgen.decode(spec, q, cache.k_cache, cache.v_cache, cache.cache_seqlens,  # noqa: E731
                                  num_splits=128, BLOCK_N=32, return_lse=True, fused_combine=True)
    first = run()
    for _ in range(20):
        again = run()
        assert all(torch.equal(a, b) for a, b in zip(first, again)), f"seed={seed}"
    assert not any(t.any() for t in host_decode.TICKETS.values())
    out_ref, lse_ref, out_pt, lse_pt = reference_decode(q, cache, causal=True)
    assert compare("out", first[0], out_ref, out_pt).ok and compare("lse", first[1], lse_ref, lse_pt).ok, \
        f"seed={seed}"


def test_fused_merges_on_two_streams_at_once_gpu():
    # Two streams decode at the same time with the one call plan (same shapes, other contents),
    # 128 splits each, 30 launches queued on each: each stream counts on its own tickets, so every
    # launch is bitwise its stream's first and right by the rule (one buffer per device let the two
    # streams' programs take each other's tickets and merge a row block's splits too early).
    seed, gen = _seeded()
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=32, num_kv_heads=8, causal=True)
    caches = [Cache(gen, 1, 8, 128, (16381,), 16384, torch.bfloat16, "cuda") for _ in range(2)]
    qs = [torch.randn(1, 1, 32, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(2)]
    run = lambda i: flashgen.decode(spec, qs[i], caches[i].k_cache, caches[i].v_cache,  # noqa: E731
                                    caches[i].cache_seqlens, num_splits=128, BLOCK_N=32, fused_combine=True)
    firsts = [run(0), run(1)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    outs = [[], []]
    for _ in range(30):  # interleaved: both streams' queues hold launches at once
        for i, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                outs[i].append(run(i))
    torch.cuda.synchronize()
    for i in range(2):
        assert all(torch.equal(o, firsts[i]) for o in outs[i]), f"stream {i}, seed={seed}"
        out_ref, _, out_pt, _ = reference_decode(qs[i], caches[i], causal=True)
        assert compare("out", firsts[i], out_ref, out_pt).ok, f"seed={seed}"
    assert {key[1] for key in host_decode.TICKETS if key[0] == qs[0].device} >= \
        {s.cuda_stream for s in streams}
    assert not any(t.any() for t in host_decode.TICKETS.values())


@pytest.mark.parametrize("name,kw", [
    ("window", dict(mask={"sliding_window": {"left": 511, "right": 0}}, causal=False)),
    ("sinks", dict(mask={"sink": {"tokens": 4, "window": 700}}, causal=False)),
    ("softcap", dict(score_mod={"softcap": 30.0}, factor=3.0)),
    ("alibi", dict(score_mod={"alibi": {}}, batch_tensors=("alibi_slopes",))),
    ("custom-expr", dict(mask="(kv_idx % 3 != 1) | (kv_idx + 4 >= seqlen_k)", causal=True)),
], ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("page_size", [None, 16])
def test_decode_masks_gpu(name, kw, page_size):
    kw = dict(kw)
    if name == "alibi":
        kw["tensors"] = {"alibi_slopes": torch.rand(3, 32)}
    run_decode("cuda", dtype="bf16", heads=(32, 8), d=128, sq=4, page_size=page_size, num_splits=0, batch=3,
               lengths=(2049, 5, 3001), capacity=3072, BLOCK_N=None, **kw)


@pytest.mark.parametrize("batch", [64, 16], ids=["crowded", "one-per-sm"])
def test_decode_grid_that_fills_the_sms_gpu(batch):
    # 64 elements x 8 KV heads, one query row: at least three programs per SM, so the defaults take
    # the crowded grid's 2-stage tiles (32 keys, or 128 on a GPU with faster memory); 16 elements:
    # one program per SM, 128 x 3. Odd lengths per element, some one past a tile edge.
    from flashgen.runtime.decode import SMALL_TILE_PROGRAMS_PER_SM, decode_knobs, sm_count
    device = torch.device("cuda", torch.cuda.current_device())
    base = (1025, 3, 531, 1024, 33, 1, 700, 999, 64, 65, 1000, 2, 513, 31, 1023, 400)
    lengths = tuple(max(1, n - 7 * i) for i in range(batch // len(base)) for n in base)
    if decode_knobs(128, 4, batch, 8, 1040, device)["num_splits"] != 1:
        pytest.skip(f"this GPU's grid of {batch * 8} programs does not fill its SMs")
    if (batch * 8 >= SMALL_TILE_PROGRAMS_PER_SM * sm_count(device)) != (batch == 64):
        pytest.skip(f"a grid of {batch * 8} programs is not what this case stands for on {sm_count(device)} SMs")
    run_decode("cuda", dtype="bf16", heads=(32, 8), d=128, sq=1, batch=batch, lengths=lengths, capacity=1040,
               num_splits=0, BLOCK_N=None)


def test_decode_appends_gpu():
    run_decode("cuda", dtype="bf16", heads=(32, 8), d=128, sq=3, appended=3, page_size=16, lengths=(1000, 17, 3),
               capacity=1024, num_splits=0, BLOCK_N=None)


def test_cuda_graph_capture_and_replay():
    # A decode step is captured once and replayed with new cache_seqlens (and new k, v appended):
    # no host synchronisation, no host decision from tensor contents.
    seed, gen = _seeded()
    batch, heads, kv_heads, d, page = 4, 32, 8, 128, 16
    cache = Cache(gen, batch, kv_heads, d, (300, 1, 77, 512), 1024, torch.bfloat16, "cuda", page_size=page)
    k_cache, v_cache = cache.k_cache.nan_to_num(0.0), cache.v_cache.nan_to_num(0.0)
    q = torch.randn(batch, 1, heads, d, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(batch, 1, kv_heads, d, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(batch, 1, kv_heads, d, generator=gen).to("cuda", torch.bfloat16)
    seqlens = cache.cache_seqlens.clone()
    step = lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,  # noqa: E731
                                           block_table=cache.block_table, causal=True)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for lengths in ([301, 2, 78, 513], [5, 900, 1000, 12]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        eager_k, eager_v = k_cache.clone(), v_cache.clone()
        expected = flash_attn_with_kvcache(q, eager_k, eager_v, k, v, cache_seqlens=seqlens,
                                           block_table=cache.block_table, causal=True)
        assert torch.equal(out, expected), f"lengths={lengths} seed={seed}"
    assert not any(t.any() for t in host_decode.TICKETS.values())  # the split merges left their tickets at 0


def test_cuda_graph_replays_the_fused_merge():
    # The merge in the split kernel, captured once and replayed with new lengths and appends: its
    # tickets are 0 after every launch, so each replay merges as an eager call does.
    seed, gen = _seeded()
    cache = Cache(gen, 4, 8, 128, (300, 1, 77, 512), 1024, torch.bfloat16, "cuda", page_size=16)
    k_cache, v_cache = cache.k_cache.nan_to_num(0.0), cache.v_cache.nan_to_num(0.0)
    q, k, v = (torch.randn(4, 1, h, 128, generator=gen).to("cuda", torch.bfloat16) for h in (32, 8, 8))
    seqlens = cache.cache_seqlens.clone()
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=32, num_kv_heads=8, causal=True)
    step = lambda kc, vc: flashgen.decode(spec, q, kc, vc, seqlens, k=k, v=v,  # noqa: E731
                                          block_table=cache.block_table, fused_combine=True)
    step(k_cache, v_cache)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(k_cache, v_cache)
    for lengths in ([301, 2, 78, 513], [5, 900, 1000, 12], [5, 900, 1000, 12]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        expected = step(k_cache.clone(), v_cache.clone())
        assert torch.equal(out, expected), f"lengths={lengths} seed={seed}"
    assert not any(t.any() for t in host_decode.TICKETS.values())


def test_decode_is_deterministic():
    seed, gen = _seeded()
    cache = Cache(gen, 2, 8, 128, (8191, 100), 8192, torch.bfloat16, "cuda", page_size=16)
    q = torch.randn(2, 1, 32, 128, generator=gen).to("cuda", torch.bfloat16)
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=32, num_kv_heads=8, causal=True)
    first = flashgen.decode(spec, q, cache.k_cache, cache.v_cache, cache.cache_seqlens, block_table=cache.block_table,
                            return_lse=True)
    for _ in range(3):
        again = flashgen.decode(spec, q, cache.k_cache, cache.v_cache, cache.cache_seqlens,
                                block_table=cache.block_table, return_lse=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    out_ref, lse_ref, out_pt, lse_pt = reference_decode(q, cache, causal=True)
    assert compare("out", first[0], out_ref, out_pt).ok, f"seed={seed}"


def test_bounds_errors_without_waiting_and_with_check_sync():
    # The kernels write the first out-of-range index to pinned host memory: the next call raises
    # naming it (without waiting for the GPU before), check="sync" raises in the call itself, and
    # a good call after either is right (launched through the bound launcher: the same shapes).
    from flashgen import kvcache

    q = torch.randn(2, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
    pages = torch.randn(8, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
    table = torch.arange(8, dtype=torch.int32, device="cuda").view(2, 4)
    seqlens = torch.tensor([64, 40], dtype=torch.int32, device="cuda")
    good = flash_attn_with_kvcache(q, pages, pages, cache_seqlens=seqlens, block_table=table)
    bad = table.clone()
    bad[1, 2] = 8
    flash_attn_with_kvcache(q, pages, pages, cache_seqlens=seqlens, block_table=bad)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"block_table: .*\[0, 8\).* got 8 at \[1, 2\]"):
        flash_attn_with_kvcache(q, pages, pages, cache_seqlens=seqlens, block_table=table)
    with pytest.raises(ValueError, match="cache_seqlens: .*capacity 64, got 65 at index 1"):
        flash_attn_with_kvcache(q, pages, pages, cache_seqlens=torch.tensor(
            [64, 65], dtype=torch.int32, device="cuda"), block_table=table, check="sync")
    kvcache.check_bounds()  # nothing left recorded
    out = flash_attn_with_kvcache(q, pages, pages, cache_seqlens=seqlens, block_table=table)
    assert torch.equal(out, good)
    launcher = kvcache.compat_launcher(q, pages, pages, False, (-1, -1), 0.0, None, None)
    bound = [kernel.compiled for call in launcher.calls.values() for _, kernel, _ in call.bound.values()]
    assert bound and all(bound), "the repeated calls did not launch through the compiled launcher"
    contiguous = pages.view(2, 64, 2, 128)
    torch.testing.assert_close(out, flash_attn_with_kvcache(q, contiguous, contiguous, cache_seqlens=seqlens),
                               atol=2e-2, rtol=0)


def test_graph_replays_record_bounds_for_the_next_eager_call():
    from flashgen import kvcache

    q = torch.randn(2, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
    pages = torch.randn(8, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
    table = torch.arange(8, dtype=torch.int32, device="cuda").view(2, 4)
    seqlens = torch.tensor([64, 40], dtype=torch.int32, device="cuda")
    step = lambda: flash_attn_with_kvcache(q, pages, pages, cache_seqlens=seqlens, block_table=table)  # noqa: E731
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    seqlens[1] = 70  # past the capacity of 64: the replay clamps and records
    graph.replay()
    with pytest.raises(ValueError, match="cache_seqlens: .*capacity 64, got 70 at index 1"):
        kvcache.check_bounds()


@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
def test_read_launches_as_decode_does_gpu(misaligned):
    # DecodeLauncher.read()'s launch path against decode()'s on a GPU, where the launches are bound
    # (keyed by pointer alignment and how Triton specializes the lengths): bitwise equal, split calls
    # (2 elements x 2 KV heads: the heuristic splits) merged in the split kernel included.
    lengths = (1000, 1001, 4097, 4096, 33, 1024, 1000)
    pairs, what = _read_and_decode("cuda", lengths, misaligned, capacity=4100)
    for n, ((out, lse), (out_d, lse_d)) in zip(lengths, pairs):
        assert torch.equal(out, out_d) and torch.equal(lse, lse_d), f"{what} length {n}"


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_attention_of_one_query_on_the_decode_kernel_compiles_gpu(layout, monkeypatch):
    # flashgen.attention's inference calls of a few queries over more than DECODER_KEYS keys run on the
    # decode kernel inside the custom op too: torch.compile(fullgraph=True) with inductor gives eager's
    # output bitwise (the op's declared output strides are the decode route's), at two cache lengths.
    from flashgen.runtime.decode import DecodeLauncher

    seed, gen = _seeded()
    shape = (lambda h, n: (2, h, n, 64)) if layout == "bhsd" else (lambda h, n: (2, n, h, 64))
    fn = lambda q, k, v: flashgen.attention(q, k, v, causal=True, layout=layout)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    reads, read = [], DecodeLauncher.read
    # (the call's own reads: a bhsd read's first call of a length class reads its bshd views once more)
    monkeypatch.setattr(DecodeLauncher, "read", lambda self, q, *a, **kw: kw.get("layout", "bshd") == layout
                        and reads.append(1) or read(self, q, *a, **kw))
    for n in (1000, 1333):
        q, k, v = (torch.randn(*shape(h, s), generator=gen).to("cuda", torch.bfloat16)
                   for h, s in ((8, 1), (2, n), (2, n)))
        with torch.no_grad():
            want, got = fn(q, k, v), compiled(q, k, v)
        assert torch.equal(want, got), f"seed={seed} keys {n}"
    assert len(reads) == 4, reads
