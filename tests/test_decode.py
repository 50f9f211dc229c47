"""Decode over a KV cache (templates/decode/, flashgen/runtime/decode.py, flashgen.decode and
flashgen.compat.flash_attn_with_kvcache) against a dense PyTorch reference, by the rule of
../shared/TESTING.md.

Every cache slot past a batch element's length, and every page no block table uses, holds NaN:
a kernel that reads a key it should not produces NaN and fails. Outputs are poisoned with NaN
before the call, so an element the kernels never write fails too.
"""

import inspect
import random
import re

import pytest
import torch

import flashgen
from flashgen import AttentionSpec
from flashgen.compat import flash_attn_with_kvcache
from flashgen.runtime import decode as host_decode
from flashgen.verify import assert_attention_close, compare, reference_attention

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _seeded():
    seed = random.randrange(2**31)
    return seed, torch.Generator().manual_seed(seed)


class Cache:
    """A KV cache with its dense view: contiguous (B, S_max, H_kv, D), or paged (pages, page_size,
    H_kv, D) with a shuffled block table and spare pages. Unused slots hold NaN."""

    def __init__(self, gen, batch, kv_heads, d, lengths, capacity, dtype, device, page_size=None, appended=0):
        self.lengths = list(lengths)  # after the append
        self.page_size = page_size
        full = [torch.randn(n, kv_heads, d, generator=gen) for n in self.lengths]
        self.dense_k = [x.to(dtype) for x in full]
        self.dense_v = [torch.randn(n, kv_heads, d, generator=gen).to(dtype) for n in self.lengths]
        self.new_k = self.new_v = None
        if appended:  # the last `appended` keys of every element come as k, v
            self.new_k = torch.stack([x[-appended:] for x in self.dense_k]).to(device)
            self.new_v = torch.stack([x[-appended:] for x in self.dense_v]).to(device)
        stored = [n - appended for n in self.lengths]
        self.cache_seqlens = torch.tensor(stored, dtype=torch.int32, device=device)
        if page_size is None:
            self.block_table = None
            shape = (batch, capacity, kv_heads, d)
            self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
            self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
            for b, n in enumerate(stored):
                self.k_cache[b, :n], self.v_cache[b, :n] = self.dense_k[b][:n], self.dense_v[b][:n]
        else:
            per_seq = -(-capacity // page_size)
            num_pages = batch * per_seq + 3  # spare pages, never used
            order = torch.randperm(num_pages, generator=gen)[:batch * per_seq].view(batch, per_seq)
            self.block_table = order.to(torch.int32).to(device)
            shape = (num_pages, page_size, kv_heads, d)
            self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
            self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
            for b, n in enumerate(stored):
                j = torch.arange(n)
                page, slot = order[b, j // page_size], j % page_size
                self.k_cache[page, slot], self.v_cache[page, slot] = self.dense_k[b][:n], self.dense_v[b][:n]
        self.k_cache, self.v_cache = self.k_cache.to(device), self.v_cache.to(device)

    def stored(self, b, n):
        """The cache's keys and values 0..n-1 of element b, as the kernel sees them."""
        if self.block_table is None:
            return self.k_cache[b, :n], self.v_cache[b, :n]
        j = torch.arange(n, device=self.k_cache.device)
        pages = self.block_table[b].long()[j // self.page_size]
        return self.k_cache[pages, j % self.page_size], self.v_cache[pages, j % self.page_size]


def reference_decode(q, cache, *, causal=False, mask=None, score_mod=None, tensors=None, batch_tensors=()):
    """(out, lse, out_pt, lse_pt): the reference per batch element over its dense keys, in
    float32 (float64 for fp32 inputs) and in q's dtype. batch_tensors: the named tensors whose
    dim 0 is the batch (sliced per element)."""
    low = q.dtype != torch.float32
    results = {torch.float32 if low else torch.float64: [], q.dtype: []} if low else {torch.float64: []}
    for b, n in enumerate(cache.lengths):
        named = {name: (t[b:b + 1] if name in batch_tensors else t) for name, t in (tensors or {}).items()}
        k, v = cache.dense_k[b][None].to(q.device), cache.dense_v[b][None].to(q.device)
        for dtype, rows in results.items():
            rows.append(reference_attention(q[b:b + 1], k, v, causal=causal, layout="bshd", compute_dtype=dtype,
                                            mask=mask, score_mod=score_mod, tensors=named))
    joined = [(torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])) for _, rows in results.items()]
    out_ref, lse_ref = joined[0]
    out_pt, lse_pt = joined[1] if low else (None, None)
    return out_ref, lse_ref, out_pt, lse_pt


def run_decode(device, *, dtype="fp16", heads=(4, 2), d=32, batch=3, sq=1, lengths=(37, 1, 20), capacity=48,
               page_size=None, appended=0, num_splits=1, causal=True, mask=None, score_mod=None, tensors=None,
               batch_tensors=(), BLOCK_N=16, factor=2.0, **knobs):
    """Decode fresh inputs through flashgen.decode and check out and LSE against the reference."""
    seed, gen = _seeded()
    torch_dtype = DTYPES[dtype]
    spec = AttentionSpec(dtype=dtype, head_dim=d, num_heads=heads[0], num_kv_heads=heads[1], causal=causal,
                         mask=mask, score_mod=score_mod, backward=False)
    lengths = list(lengths)[:batch]
    cache = Cache(gen, batch, heads[1], d, lengths, capacity, torch_dtype, device, page_size, appended)
    q = torch.randn(batch, sq, heads[0], d, generator=gen).to(device=device, dtype=torch_dtype)
    out = torch.full((batch, sq, heads[0], d), float("nan"), dtype=torch_dtype, device=device)
    lse = torch.full((batch, heads[0], sq), float("nan"), dtype=torch.float32, device=device)
    tensors = {n: t.to(device) for n, t in (tensors or {}).items()}
    flashgen.decode(spec, q, cache.k_cache, cache.v_cache, cache.cache_seqlens, k=cache.new_k, v=cache.new_v,
                    block_table=cache.block_table, out=out, lse=lse, num_splits=num_splits, BLOCK_N=BLOCK_N,
                    **knobs, **tensors)
    out_ref, lse_ref, out_pt, lse_pt = reference_decode(q, cache, causal=causal, mask=mask, score_mod=score_mod,
                                                        tensors=tensors, batch_tensors=batch_tensors)
    what = f"{spec.uri} sq={sq} lengths={lengths} page_size={page_size} splits={num_splits} seed={seed}"
    for result in (compare("out", out, out_ref, out_pt, factor=factor),
                   compare("lse", lse, lse_ref, lse_pt, factor=factor)):
        assert result.ok, f"{what}: {result}"
    return cache, out, lse


# ----------------------------------------------------------------------------- the grid
@pytest.mark.parametrize("dtype,heads,sq,page_size,num_splits,prefetch", [
    ("fp16", (4, 2), 1, None, 1, None),  # GQA, one query row, no split
    ("fp16", (4, 1), 1, None, 3, None),  # MQA, split
    ("fp32", (4, 2), 1, 3, 1, True),  # paged, page size 3 (not a power of two): a page per key
    ("fp32", (4, 2), 2, 3, 2, False),  # the same, page numbers read in the tile's own iteration
    ("fp16", (4, 2), 5, 16, 4, True),  # several query rows (causal bottom-right), paged, split: a page per tile
    ("fp16", (4, 2), 5, 16, 3, False),
    ("fp16", (2, 2), 3, 1, 2, True),  # MHA, page size 1
    ("fp32", (8, 2), 7, None, 5, None),  # 28 packed rows: two row blocks of 16
    ("fp16", (4, 2), 2, 64, 2, True),  # a page larger than the cache's tiles
    ("fp16", (4, 2), 2, 64, 1, False),
], ids=["gqa-sq1", "mqa-split", "fp32-page3", "fp32-page3-no-prefetch", "sq5-page16-split",
        "sq5-page16-no-prefetch", "mha-page1", "fp32-two-row-blocks", "page64", "page64-no-prefetch"])
def test_decode_matches_reference(device, dtype, heads, sq, page_size, num_splits, prefetch):
    # Odd cache lengths per batch element, one of them shorter than the query rows (its first
    # rows see no key: out 0, LSE -inf). BLOCK_N 16: page sizes 16 and 64 hold whole tiles (one
    # page number per tile), 1 and 3 do not (one per key).
    lengths = (37, 3 if sq > 3 else 1, 20)
    capacity = 128 if page_size == 64 else 48
    run_decode(device, dtype=dtype, heads=heads, sq=sq, page_size=page_size, num_splits=num_splits, lengths=lengths,
               capacity=capacity, page_prefetch=prefetch)


def test_non_causal_and_more_splits_than_blocks(device):
    # Splits past the last key block see nothing: LSE -inf, weighed as nothing by the combine.
    run_decode(device, causal=False, sq=2, num_splits=8, lengths=(5, 17, 33))


def test_empty_cache_rows(device):
    # A batch element with no keys at all: every row outputs 0 with LSE -inf, split or not.
    for splits in (1, 3):
        _, out, lse = run_decode(device, lengths=(0, 9, 30), num_splits=splits)
        assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == float("-inf")).all())


@pytest.mark.parametrize("page_size", [None, 3, 16])
def test_append_crosses_pages_in_place(device, page_size):
    # 4 new keys per element written at cache_seqlens (crossing page boundaries) before attending.
    cache, _, _ = run_decode(device, sq=4, appended=4, page_size=page_size, lengths=(11, 4, 30), num_splits=2)
    for b, n in enumerate(cache.lengths):
        k, v = cache.stored(b, n)
        assert torch.equal(k.cpu(), cache.dense_k[b]) and torch.equal(v.cpu(), cache.dense_v[b])


# ----------------------------------------------------------------------------- the splits' merge
def test_fused_merge_matches_the_reference(device, monkeypatch):
    # The merge in the split kernel's last program (fused_combine, the default; the combine kernel
    # runs where a test passes fused_combine=False): 28 packed rows over two row blocks, paged (a page per key), an
    # element without keys, then MQA with more splits. COMBINE_ELEMENTS so small that the fused
    # merge takes one row per step of its loop.
    monkeypatch.setattr(host_decode, "COMBINE_ELEMENTS", 64)
    run_decode(device, dtype="fp32", heads=(8, 2), sq=7, page_size=3, num_splits=3, lengths=(37, 0, 20),
               fused_combine=True)
    run_decode(device, heads=(4, 1), sq=1, num_splits=5, lengths=(37, 1, 20), fused_combine=True)


def test_split_calls_merge_without_a_combine_launch(device):
    # fused_combine: a split call is one launch: the last of a row block's programs to take a ticket
    # merges the splits, and every ticket is 0 again when the launch ends (CUDA graphs replay it).
    spec = AttentionSpec(dtype="fp16", head_dim=16, num_heads=4, num_kv_heads=2, causal=True, backward=False)
    module = flashgen.compile(spec).module()
    combine = _Recorder()
    launcher = host_decode.DecodeLauncher(attention=module._LAUNCHER, kernel=module._attn_decode,
                                          combine_kernel=combine)
    seed, gen = _seeded()
    cache = Cache(gen, 3, 2, 16, (37, 1, 20), 48, torch.float16, device)
    q = torch.randn(3, 2, 4, 16, generator=gen).to(device=device, dtype=torch.float16)
    for _ in range(2):
        out, lse = launcher.decode(q, cache.k_cache, cache.v_cache, cache.cache_seqlens, num_splits=3, BLOCK_N=16,
                                   fused_combine=True)
        out_ref, lse_ref, out_pt, lse_pt = reference_decode(q, cache, causal=True)
        assert compare("out", out, out_ref, out_pt).ok and compare("lse", lse, lse_ref, lse_pt).ok, f"seed={seed}"
    assert not combine.launches
    launcher.decode(q, cache.k_cache, cache.v_cache, cache.cache_seqlens, num_splits=3, BLOCK_N=16,
                    fused_combine=False)
    assert len(combine.launches) == 1
    assert not any(t.any() for (where, _), t in host_decode.TICKETS.items() if where == q.device)
    with pytest.raises(ValueError, match="fused_combine: expected a bool or None .*got .yes."):
        launcher.decode(q, cache.k_cache, cache.v_cache, cache.cache_seqlens, num_splits=3, fused_combine="yes")


def test_split_tickets_are_made_once_and_not_while_captured(monkeypatch):
    # One zeroed buffer per device and stream, grown by doubling; while a graph is captured the call
    # gets zeros of its own, which the graph makes at each replay and keeps alive, even where the
    # stream has a buffer (a graph holding that one would replay into it after it is grown or dropped).
    cpu = torch.device("cpu")
    monkeypatch.setattr(host_decode, "TICKETS", {})
    monkeypatch.setattr(host_decode, "device_sync_forbidden", lambda device: True)
    assert host_decode.split_tickets(cpu, 10).tolist() == [0] * 10 and not host_decode.TICKETS
    monkeypatch.setattr(host_decode, "device_sync_forbidden", lambda device: False)
    made = host_decode.split_tickets(cpu, 10)
    assert made.numel() == 1024 and host_decode.split_tickets(cpu, 1024) is made
    monkeypatch.setattr(host_decode, "device_sync_forbidden", lambda device: True)
    assert host_decode.split_tickets(cpu, 10) is not made
    monkeypatch.setattr(host_decode, "device_sync_forbidden", lambda device: False)
    assert host_decode.split_tickets(cpu, 1500).numel() == 2048 and host_decode.TICKETS[cpu, 0].numel() == 2048


def test_split_tickets_are_kept_per_stream(monkeypatch):
    # Launches on two streams may run at once: each stream counts on its own buffer, and a call
    # that moves to another stream takes that stream's (on the CPU every call is on stream 0:
    # the stream is given by hand here).
    cpu = torch.device("cpu")
    monkeypatch.setattr(host_decode, "TICKETS", {})
    monkeypatch.setattr(host_decode, "device_sync_forbidden", lambda device: False)
    one, two = host_decode.split_tickets(cpu, 10, stream=11), host_decode.split_tickets(cpu, 10, stream=22)
    assert one is not two and host_decode.split_tickets(cpu, 10, stream=11) is one
    for stream in range(host_decode.MAX_TICKET_STREAMS):  # a program making streams without end
        host_decode.split_tickets(cpu, 10, stream=100 + stream)
    assert len(host_decode.TICKETS) == host_decode.MAX_TICKET_STREAMS and (cpu, 11) not in host_decode.TICKETS


def test_split_partials_are_one_buffer_per_stream_and_fresh_while_captured(device, monkeypatch):
    # Fused split calls write their partial results into their stream's one buffer (split_parts: launches on a
    # stream run in order, each merging its own), grown for a larger call and kept by each call per stream; calls
    # of two plans interleaved, fused and with a combine launch, stay exact; while a graph is captured a call gets
    # a buffer of its own, and so does every call with a combine launch (another thread's launches on the stream
    # may come between its split and combine launches).
    spec = AttentionSpec(dtype="fp16", head_dim=16, num_heads=4, num_kv_heads=2, causal=True, backward=False)
    launcher = flashgen.kvcache.decode_launcher(flashgen.compile(spec))
    monkeypatch.setattr(host_decode, "PARTS", {})
    seed, gen = _seeded()
    small = Cache(gen, 3, 2, 16, (37, 1, 20), 48, torch.float16, device)
    large = Cache(gen, 5, 2, 16, (60, 9, 33, 2, 47), 64, torch.float16, device)
    queries = {id(c): torch.randn(c.k_cache.shape[0], 2, 4, 16, generator=gen).to(device=device, dtype=torch.float16)
               for c in (small, large)}
    for cache, fused in ((small, True), (large, False), (small, True), (large, True), (small, False)):
        q = queries[id(cache)]
        out, lse = launcher.decode(q, cache.k_cache, cache.v_cache, cache.cache_seqlens, num_splits=3, BLOCK_N=16,
                                   fused_combine=fused)
        out_ref, lse_ref, out_pt, lse_pt = reference_decode(q, cache, causal=True)
        assert compare("out", out, out_ref, out_pt).ok and compare("lse", lse, lse_ref, lse_pt).ok, f"seed={seed}"
    (where, _), parts = next(iter(host_decode.PARTS.items()))
    assert len(host_decode.PARTS) == 1 and where.type == torch.device(device).type
    assert parts.numel() >= 5 * 2 * 4 * 3 * (16 + 1)  # the large call's: rows x splits x (head dim + LSE)
    cpu = torch.device("cpu")
    call = host_decode.DecodeCall(plan={"fused": True, "grid": (3, 1, 4)}, device=cpu, part_numel=100,
                                  new_part=lambda: torch.empty(100), split_buffers=None)
    tickets, part = launcher.split_buffers(call, True, 5)  # captured: the graph's own
    assert part.numel() == 100 and (cpu, 5) not in host_decode.PARTS and call.split_buffers is None
    tickets, part = launcher.split_buffers(call, False, 5)
    assert host_decode.PARTS[cpu, 5] is part and tickets is host_decode.TICKETS[cpu, 5]
    assert launcher.split_buffers(call, False, 5)[1] is part and launcher.split_buffers(call, False, 7)[1] is not part
    combined = host_decode.DecodeCall(plan={"fused": False, "grid": (3, 1, 4)}, device=cpu, part_numel=100,
                                      new_part=lambda: torch.empty(100), split_buffers=None)
    tickets, part = launcher.split_buffers(combined, False, 5)
    assert tickets is None and part is not host_decode.PARTS[cpu, 5]
    assert launcher.split_buffers(combined, False, 5)[1] is not part


@pytest.mark.interpreter
def test_a_fused_decode_call_takes_its_current_streams_tickets(monkeypatch):
    # Each call of one cached call plan asks which stream is current and launches with that
    # stream's tickets (the plan keeps its first stream's only while that stream is current).
    spec = AttentionSpec(dtype="fp16", head_dim=16, num_heads=4, num_kv_heads=2, causal=True, backward=False)
    module = flashgen.compile(spec).module()
    launcher = host_decode.DecodeLauncher(attention=module._LAUNCHER, kernel=module._attn_decode,
                                          combine_kernel=_Recorder())
    seed, gen = _seeded()
    cache = Cache(gen, 3, 2, 16, (37, 1, 20), 48, torch.float16, "cpu")
    q = torch.randn(3, 2, 4, 16, generator=gen).to(dtype=torch.float16)
    monkeypatch.setattr(host_decode, "TICKETS", {})
    streams, made = iter([5, 5, 7, 5]), []
    monkeypatch.setattr(host_decode, "current_stream", lambda device: next(streams))
    original = host_decode.split_tickets
    monkeypatch.setattr(host_decode, "split_tickets",
                        lambda device, count, stream=None: made.append(stream) or original(device, count, stream))
    out_ref, lse_ref, out_pt, lse_pt = reference_decode(q, cache, causal=True)
    for _ in range(4):
        out, lse = launcher.decode(q, cache.k_cache, cache.v_cache, cache.cache_seqlens, num_splits=3, BLOCK_N=16,
                                   fused_combine=True)
        assert compare("out", out, out_ref, out_pt).ok and compare("lse", lse, lse_ref, lse_pt).ok, f"seed={seed}"
    assert made == [5, 7, 5]  # stream 5's made once and kept by the plan; 7's; 5's again (found, not made)
    assert set(host_decode.TICKETS) == {(q.device, 5), (q.device, 7)}
    assert not any(t.any() for t in host_decode.TICKETS.values())


# ----------------------------------------------------------------------------- masks and score modifiers
@pytest.mark.parametrize("name,kw", [
    ("window", dict(mask={"sliding_window": {"left": 6, "right": 0}}, causal=False)),
    ("window-0", dict(mask={"sliding_window": {"left": 0, "right": 0}}, causal=False)),
    ("sinks", dict(mask={"sink": {"tokens": 2, "window": 5}}, causal=False)),
    ("softcap", dict(score_mod={"softcap": 3.0}, factor=3.0)),
    ("softcap-large", dict(score_mod=[{"expr": "score * 60.0"}, {"softcap": 100.0}], factor=3.0, dtype="fp32")),
    ("alibi", dict(score_mod={"alibi": {}}, batch_tensors=("alibi_slopes",))),
    ("custom-expr", dict(mask="(kv_idx % 3 != 1) | (kv_idx + 4 >= seqlen_k)", score_mod="score + bias[h]",
                         causal=True)),
], ids=lambda x: x if isinstance(x, str) else "")
def test_masks_and_score_mods(device, name, kw):
    kw = dict(kw)
    if name == "alibi":
        kw["tensors"] = {"alibi_slopes": torch.rand(3, 4)}
    if name == "custom-expr":
        kw["tensors"] = {"bias": torch.randn(4)}
    run_decode(device, sq=3, page_size=3, num_splits=2, lengths=(37, 2, 20), **kw)


def test_document_masks_and_dropout_are_refused(device):
    q = torch.zeros(1, 1, 2, 16, dtype=torch.float16, device=device)
    cache = torch.zeros(1, 8, 1, 16, dtype=torch.float16, device=device)
    doc = AttentionSpec(dtype="fp16", head_dim=16, num_heads=2, num_kv_heads=1, mask={"document": {}})
    with pytest.raises(ValueError, match="mask: a document mask"):
        flashgen.decode(doc, q, cache, cache, 4, document_ids=torch.zeros(8, dtype=torch.int32, device=device))
    drop = AttentionSpec(dtype="fp16", head_dim=16, num_heads=2, num_kv_heads=1, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_p"):
        flashgen.decode(drop, q, cache, cache, 4)


# ----------------------------------------------------------------------------- flash-attn's interface
def test_flash_attn_with_kvcache(device):
    seed, gen = _seeded()
    # fp32: a paged cache, a window, softcap and ALiBi, the LSE with flash-attn's +inf for empty rows
    cache = Cache(gen, 2, 2, 32, (13, 0), 24, torch.float32, device, page_size=5, appended=0)
    q = torch.randn(2, 2, 4, 32, generator=gen).to(device)
    slopes = torch.rand(4, generator=gen).to(device)
    out, lse = flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=cache.cache_seqlens,
                                       block_table=cache.block_table, causal=True, window_size=(4, 0), softcap=5.0,
                                       alibi_slopes=slopes, num_splits=2, return_softmax_lse=True)
    kw = dict(mask={"sliding_window": {"left": 4, "right": 0}}, score_mod=[{"softcap": {"cap": 5.0}},
                                                                          {"alibi": {"slopes": "alibi_slopes"}}],
              tensors={"alibi_slopes": slopes})
    out_ref, lse_ref, _, _ = reference_decode(q, cache, **kw)
    assert compare("out", out, out_ref, None).ok, f"seed={seed}"
    assert torch.isinf(lse[1]).all() and (lse[1] > 0).all()  # flash-attn's empty-row LSE
    assert compare("lse", lse[0], lse_ref[0], None).ok, f"seed={seed}"


def test_flash_attn_with_kvcache_appends_and_batch_index(device):
    seed, gen = _seeded()
    batch, d = 2, 32  # 1024 outputs: TESTING.md's mean rule on 128 is a noisy ratio
    k_cache = torch.randn(3, 20, 2, d, generator=gen).to(device=device, dtype=torch.float16)
    v_cache = torch.randn(3, 20, 2, d, generator=gen).to(device=device, dtype=torch.float16)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    q = torch.randn(batch, 2, 8, d, generator=gen).to(device=device, dtype=torch.float16)
    k = torch.randn(batch, 2, 2, d, generator=gen).to(device=device, dtype=torch.float16)
    v = torch.randn(batch, 2, 2, d, generator=gen).to(device=device, dtype=torch.float16)
    idx = torch.tensor([2, 0], dtype=torch.int32, device=device)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=7, cache_batch_idx=idx, causal=True)
    for b, row in enumerate(idx.tolist()):
        assert torch.equal(k_cache[row, 7:9], k[b]) and torch.equal(v_cache[row, 7:9], v[b])
        assert torch.equal(k_cache[row, :7], before_k[row, :7])
    assert torch.equal(k_cache[1], before_k[1])  # the row no element uses is untouched
    keys = torch.stack([k_cache[r, :9] for r in idx.tolist()])
    vals = torch.stack([v_cache[r, :9] for r in idx.tolist()])
    ref, _ = reference_attention(q, keys, vals, causal=True, layout="bshd")
    pt, _ = reference_attention(q, keys, vals, causal=True, layout="bshd", compute_dtype=torch.float16)
    assert compare("out", out, ref, pt).ok, f"seed={seed}"


def test_flash_attn_with_kvcache_refuses_rotary_and_leftpad(device):
    q = torch.zeros(1, 1, 2, 16, dtype=torch.float16, device=device)
    cache = torch.zeros(1, 8, 1, 16, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="rotary_cos"):
        flash_attn_with_kvcache(q, cache, cache, rotary_cos=torch.zeros(8, 8), rotary_sin=torch.zeros(8, 8))
    with pytest.raises(ValueError, match="cache_leftpad"):
        flash_attn_with_kvcache(q, cache, cache, cache_leftpad=torch.zeros(1, dtype=torch.int32))


# ----------------------------------------------------------------------------- bounds
def _paged_inputs(device, page_size=4):
    q = torch.zeros(2, 1, 2, 16, dtype=torch.float16, device=device)
    cache = torch.zeros(6, page_size, 1, 16, dtype=torch.float16, device=device)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32, device=device)
    return q, cache, table


def _checked(*args, **kwargs):
    """flash_attn_with_kvcache, then check_bounds(): a GPU's kernels record what they met and the
    call returns (the next call or check_bounds() raises); the CPU's call raises itself."""
    out = flash_attn_with_kvcache(*args, **kwargs)
    flashgen.check_bounds()
    return out


def test_appending_into_an_expanded_cache_is_refused(device):
    # rows of an expanded cache share memory: each element's new keys would overwrite the others'
    spec = AttentionSpec(dtype="fp16", head_dim=16, num_heads=2, num_kv_heads=1, causal=True, backward=False)
    q = torch.randn(2, 1, 2, 16).to(device=device, dtype=torch.float16)
    one = torch.randn(1, 12, 1, 16).to(device=device, dtype=torch.float16)
    shared, new = one.expand(2, -1, -1, -1), torch.zeros(2, 1, 1, 16, dtype=torch.float16, device=device)
    lengths = torch.tensor([3, 5], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"^k_cache: new keys and values are written into the cache, whose elements "
                                         r"share memory"):
        flashgen.decode(spec, q, shared, shared.clone(), lengths, k=new, v=new)
    flashgen.decode(spec, q, shared, shared, lengths)  # read only: allowed
    own = shared.clone()
    flashgen.decode(spec, q, own, own.clone(), lengths, k=new, v=new)


def test_bad_block_table_and_cache_seqlens_are_errors(device):
    q, cache, table = _paged_inputs(device)
    bad = table.clone()
    bad[1, 1] = 6
    with pytest.raises(ValueError, match=r"block_table: .*\[0, 6\).* got 6 at \[1, 1\]"):
        _checked(q, cache, cache, cache_seqlens=torch.tensor([3, 7], dtype=torch.int32,
                                                                            device=device), block_table=bad)
    # an entry past the sequence's length is never read: no error
    _checked(q, cache, cache, cache_seqlens=torch.tensor([3, 4], dtype=torch.int32, device=device),
                            block_table=bad)
    bad[0, 0] = -1
    with pytest.raises(ValueError, match="block_table: .* got -1 at \\[0, 0\\]"):
        _checked(q, cache, cache, cache_seqlens=1, block_table=bad)
    with pytest.raises(ValueError, match="cache_seqlens: .*capacity 12, got 13 at index 1"):
        _checked(q, cache, cache, cache_seqlens=torch.tensor([3, 13], dtype=torch.int32,
                                                                            device=device), block_table=table)
    new = torch.zeros(2, 2, 1, 16, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="cache_seqlens: .*capacity 12, got 11 \\+ 2 appended at index 0"):
        _checked(q, cache, cache, new, new, cache_seqlens=torch.tensor([11, 3], dtype=torch.int32,
                                                                                      device=device), block_table=table)
    with pytest.raises(ValueError, match="cache_seqlens: expected lengths >= 0, got -2 at index 0"):
        _checked(q, cache, cache, cache_seqlens=torch.tensor([-2, 3], dtype=torch.int32,
                                                                            device=device), block_table=table)
    with pytest.raises(ValueError, match="page_size: .*got 300"):
        big = torch.zeros(1, 300, 1, 16, dtype=torch.float16, device=device)
        _checked(q, big, big, cache_seqlens=1, block_table=table[:, :1])
    with pytest.raises(ValueError, match="block_table: expected a 2-d int32"):
        _checked(q, cache, cache, cache_seqlens=1, block_table=table.long())
    with pytest.raises(ValueError, match="cache_seqlens: expected an int or an int32 tensor"):
        _checked(q, cache, cache, cache_seqlens=torch.tensor([1, 2], device=device), block_table=table)
    with pytest.raises(ValueError, match="cache_batch_idx: expected indices in \\[0, 6\\)"):
        _checked(q, cache, cache, cache_seqlens=1, cache_batch_idx=torch.tensor(
            [0, 6], dtype=torch.int32, device=device))


@pytest.fixture
def deferred():
    """The CPU's bounds record made to behave as a GPU's: a call does not raise what its own
    kernels recorded (they run asynchronously there), the next call or check_bounds() does."""
    record = host_decode.bounds_record(torch.device("cpu"))
    record.immediate = False
    yield record
    record.immediate = True
    record.words[:] = 0


def _guarded(shape, dtype=torch.float16):
    """A cache of `shape` in the middle of a NaN guard one row (page) deep on either side,
    filled with random numbers: a read outside it gives NaN, a write outside it overwrites NaN."""
    whole = torch.full((shape[0] + 2, *shape[1:]), float("nan"), dtype=dtype)
    cache = whole[1:-1]
    cache.normal_()
    return whole, cache


def _guard_intact(whole):
    return bool(whole[0].isnan().all() and whole[-1].isnan().all())


@pytest.mark.parametrize("case", ["page-below", "page-above", "length-over", "length-negative", "row-above",
                                  "append-over"])
@pytest.mark.interpreter
def test_out_of_range_indices_are_never_read_or_written(case, deferred):
    # Each bad index points one page (row, slot) past the cache, into a NaN guard: a read there
    # would make the output NaN, a write would overwrite the guard. The call returns finite
    # outputs, the guard is intact, and the next call raises naming the argument.
    q = torch.randn(2, 1, 4, 16, dtype=torch.float16)
    paged = case.startswith("page") or case == "append-over"
    shape = (6, 4, 2, 16) if paged else (3, 8, 2, 16)
    whole_k, k_cache = _guarded(shape)
    whole_v, v_cache = _guarded(shape)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    seqlens = torch.tensor([5, 12 if paged else 8], dtype=torch.int32)
    good = dict(block_table=table.clone()) if paged else dict(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32))
    kw = {name: t.clone() for name, t in good.items()}
    table = kw.get("block_table")
    new = {}
    if case == "page-below":
        table[1, 0] = -1
    elif case == "page-above":
        table[1, 2] = 6
    elif case == "length-over":
        seqlens[1] = 9
    elif case == "length-negative":
        seqlens[0] = -3
    elif case == "row-above":
        kw["cache_batch_idx"][1] = 3
    else:  # 12 + 2 appended keys past the capacity of 12: element 1's keys are not written
        new = dict(k=torch.ones(2, 2, 2, 16, dtype=torch.float16), v=torch.ones(2, 2, 2, 16, dtype=torch.float16))
    before = (k_cache.clone(), v_cache.clone())
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=2,
                                       return_softmax_lse=True, **new, **kw)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert _guard_intact(whole_k) and _guard_intact(whole_v)
    if new:  # element 0's keys landed at 5, 6 of page 1; element 1 (12 + 2 > 12) wrote nothing
        assert torch.equal(k_cache[1, 1:3], new["k"][0]) and torch.equal(k_cache[3:6], before[0][3:6])
    argument = {"page-below": "block_table", "page-above": "block_table", "row-above": "cache_batch_idx"}.get(
        case, "cache_seqlens")
    with pytest.raises(ValueError, match=f"^{argument}: "):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=4, **good)  # a good call reports the bad one
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=4, **good)  # the record was cleared


@pytest.mark.interpreter
def test_bounds_errors_name_the_position_and_value(deferred):
    # The record keeps where the first bad index was and its value, for the message of a later call.
    q, cache, table = _paged_inputs("cpu")
    bad = table.clone()
    bad[1, 1] = 9
    flash_attn_with_kvcache(q, cache, cache, cache_seqlens=torch.tensor([3, 7], dtype=torch.int32), block_table=bad)
    with pytest.raises(ValueError, match=r"block_table: expected page indices in \[0, 6\) .*got 9 at \[1, 1\]"):
        host_decode.check_bounds("cpu")  # the explicit sync point
    new = torch.zeros(2, 2, 1, 16, dtype=torch.float16)
    flash_attn_with_kvcache(q, cache, cache, new, new, cache_seqlens=torch.tensor([11, 3], dtype=torch.int32),
                            block_table=table)
    with pytest.raises(ValueError, match="cache_seqlens: .*capacity 12, got 11 \\+ 2 appended at index 0"):
        host_decode.check_bounds("cpu")
    host_decode.check_bounds("cpu")  # nothing left: no error


def test_check_sync_raises_in_the_call_itself(deferred, device):
    q, cache, table = _paged_inputs(device)
    seqlens = torch.tensor([3, 13], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="cache_seqlens: .*capacity 12, got 13 at index 1"):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=seqlens, block_table=table, check="sync")
    with pytest.raises(ValueError, match="check: expected one of"):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=3, block_table=table, check="later")


def test_captured_calls_record_for_the_next_eager_call(device, monkeypatch):
    # Under CUDA-graph capture or torch.compile the host reads nothing: the kernel clamps (lengths
    # to the capacity, pages into the pool) and records; the next eager call raises.
    monkeypatch.setattr(host_decode, "device_sync_forbidden", lambda device: True)
    q, cache, table = _paged_inputs(device)
    cache.normal_()
    bad = table.clone()
    bad[1] = torch.tensor([-5, 100, 4], dtype=torch.int32)
    seqlens = torch.tensor([1000, 12], dtype=torch.int32, device=device)
    out, lse = flash_attn_with_kvcache(q, cache, cache, cache_seqlens=seqlens, block_table=bad, num_splits=2,
                                       return_softmax_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    monkeypatch.undo()
    with pytest.raises(ValueError, match="^(cache_seqlens|block_table): "):
        flash_attn_with_kvcache(q[:1], cache, cache, cache_seqlens=12, block_table=table[:1])
    # element 0 was read whole (its length clamped to the capacity, 12)
    good = flash_attn_with_kvcache(q[:1], cache, cache, cache_seqlens=12, block_table=table[:1])
    assert torch.equal(out[:1], good)


# ----------------------------------------------------------------------------- the split heuristic
def test_num_splits_heuristic():
    # The grid fills the SMs: no split (B=64, 8 KV heads on 132 SMs).
    assert host_decode.num_splits_heuristic(64 * 8, 132, 64) == 1
    # One sequence, 8 KV heads: the most splits that keep one wave, each program on its own SM
    # (16 x 8 = 128 programs on 132 SMs; FA3's 85% rule would pick 15).
    assert host_decode.num_splits_heuristic(8, 132, 2048) == 16
    # B=8: 64 blocks, two splits fill 128 of 132 SMs.
    assert host_decode.num_splits_heuristic(64, 132, 128) == 2
    # 70 blocks: one wave of 70 fills half the SMs, so FA3's wave-efficiency rule decides (5 splits, 2.65 waves).
    assert host_decode.num_splits_heuristic(70, 132, 128) == 5
    # Never more splits than key blocks.
    assert host_decode.num_splits_heuristic(8, 132, 3) == 3
    # The default reads shapes only (the cache's capacity), never cache_seqlens.
    knobs = host_decode.decode_knobs(128, 4, 1, 8, 131072, torch.device("cpu"))
    assert knobs["num_splits"] == 1  # the interpreter counts as one SM: no split


CUDA0 = torch.device("cuda", 0)  # a device the knob tests name: nothing runs on it


def _sm90_knobs(monkeypatch, fast=False):
    """decode_knobs for 32 / 8 heads at head dim 128 on 132 SMs with an H100's shared memory (fast: an
    H200's memory): knobs(batch=8, kv=8192, rows=4, **kw) -> the dict, picked(...) -> (BLOCK_N,
    num_stages, num_splits, num_warps)."""
    monkeypatch.setattr(host_decode, "sm_count", lambda device: 132)
    monkeypatch.setattr(host_decode, "smem_limit", lambda device: 232448)
    monkeypatch.setattr(host_decode, "fast_memory", lambda device: fast)
    knobs = lambda batch=8, kv=8192, rows=4, **kw: (  # noqa: E731
        host_decode.decode_knobs(128, rows, batch, 8, kv, CUDA0, **kw))
    picked = lambda **kw: tuple(knobs(**kw)[n] for n in ("BLOCK_N", "num_stages", "num_splits", "num_warps"))  # noqa
    return knobs, picked


def test_default_tiles_follow_the_page_size_and_the_grid(monkeypatch):
    # A page number per key (page size below 64): 128-key tiles, else 64; three stages where they
    # fit in shared memory, else two, else smaller tiles. A grid that fills the SMs with one query
    # row per head (B=64: 512 programs on 132 SMs) takes 32-key tiles and two stages (several
    # programs per SM: H100 360.5 vs 363.6 us at 128 x 3); with more packed rows, 128 x 3.
    # Small tiles only where the grid holds at least three programs per SM: B=16 and B=32 (one and
    # two per SM) take 128 x 3 (H200 B=16: 137.0 vs 349.0 us at 32 x 2).
    knobs, picked = _sm90_knobs(monkeypatch)
    assert picked() == (64, 3, 2, 4)
    assert knobs(page_size=1)["BLOCK_N"] == 128 and knobs(page_size=256)["BLOCK_N"] == 64
    assert picked(batch=64) == (32, 2, 1, 4)
    assert picked(batch=16) == (128, 3, 1, 4) and picked(batch=32) == (128, 3, 1, 4)
    assert picked(batch=50) == (32, 2, 1, 4) and picked(batch=49) == (128, 3, 1, 4)  # 400 / 392 programs
    assert picked(batch=64, rows=64) == (128, 3, 1, 4)  # 64 packed rows (16 query positions x 4 heads)
    assert picked(batch=64, BLOCK_N=64) == (64, 3, 1, 4)  # a given tile keeps three stages
    fp32 = knobs(batch=64, element_size=4)  # two 128-key stages do not fit: 64-key tiles, three stages
    assert (fp32["BLOCK_N"], fp32["num_stages"]) == (64, 3)
    monkeypatch.setattr(host_decode, "smem_limit", lambda device: 101376)  # an sm86's
    fp32 = knobs(batch=64, element_size=4)
    assert (fp32["BLOCK_N"], fp32["num_stages"]) == (32, 2)
    assert knobs(page_prefetch=False)["page_prefetch"] is False and knobs()["page_prefetch"] is True
    for bad, words in ((dict(num_warps=3), "num_warps: expected one of 1, 2, 4, 8, 16, got 3"),
                       (dict(num_warps=True), "num_warps: expected an int >= 1, got True"),
                       (dict(page_prefetch="no"), "page_prefetch: expected a bool or None"),
                       (dict(page_prefetch=1), "page_prefetch: expected a bool or None")):
        with pytest.raises(ValueError, match=re.escape(words)):
            knobs(**bad)


def test_split_grid_of_16_key_pages_fills_four_small_programs_per_sm(monkeypatch):
    # A grid that does not fill the SMs (B=8: 64 programs on 132 SMs) over a 16-bit cache in
    # pages of 16..63 keys: 32 x 2 tiles and the split count that fills four programs per SM in
    # one wave (8 x 64 = 512 programs; H100 page 16: 111.8 vs 114.2 us at 2 x 128 x 3). Page 1,
    # page 256, the contiguous cache and B=1 keep their tiles (the same rule ran them slower:
    # B=8 contiguous 108.0 vs 106.8, B=1 128K 196.1 vs 191.1, page 1 115.6 vs 114.2).
    _, picked = _sm90_knobs(monkeypatch)
    assert picked(page_size=16) == (32, 2, 8, 4) and picked(page_size=32) == (32, 2, 8, 4)
    assert picked(page_size=1) == (128, 3, 2, 4) and picked(page_size=256) == (64, 3, 2, 4)
    assert picked() == (64, 3, 2, 4) and picked(batch=1, kv=131072) == (64, 3, 16, 4)
    assert picked(batch=1, kv=131072, page_size=16) == (32, 2, 66, 4)  # 8 x 66 = 528 programs
    assert picked(page_size=16, rows=64) == (128, 3, 2, 4)  # 64 packed rows (16 query positions): as before
    assert picked(page_size=16, BLOCK_N=128) == (128, 3, 2, 4)  # a given tile: one program per SM's splits
    assert picked(page_size=16, element_size=1) == (128, 3, 4, 4)  # FP8 keeps its own rule


def test_fp8_cache_defaults_fill_two_programs_per_sm(monkeypatch):
    # An FP8 cache (1 byte per element) on a grid that does not fill the SMs: 128-key tiles, three
    # stages (106 KB on an H100: two programs fit an SM) and the split count that fills two
    # programs per SM in one wave (H100: B=1 128K keys 32 splits 120.1 us vs 16 x 4 stages 127.0;
    # paged-16 B=8 4 splits 72.1 vs 2 splits 82.7). Where the grid fills: 64 x 3, 2 warps (four
    # per SM: 207.6 vs 211.8 at 128 x 3). Where two 3-stage programs do not fit (an sm89's 99 KB):
    # two stages, one program per SM, bf16's split count.
    knobs, picked = _sm90_knobs(monkeypatch)
    assert picked(element_size=1) == (128, 3, 4, 4) and picked(element_size=2) == (64, 3, 2, 4)
    assert picked(element_size=1, page_size=16) == (128, 3, 4, 4)
    assert picked(element_size=1, batch=1, kv=131072) == (128, 3, 33, 4)  # 8 x 33 = 264 programs, 2 per SM
    assert picked(element_size=2, batch=1, kv=131072)[2] == 16
    assert picked(element_size=1, batch=64, kv=4096) == (64, 3, 1, 2)
    assert picked(element_size=1, batch=16) == (128, 3, 1, 4)  # one program per SM (H200: 121.6 vs 156.4 us)
    assert host_decode.fp8_slots_per_sm(106496, CUDA0) == 2 and host_decode.fp8_slots_per_sm(139264, CUDA0) == 1
    monkeypatch.setattr(host_decode, "smem_limit", lambda device: 101376)  # an sm89's: 2 x 128 keys fit, 3 do not
    assert picked(element_size=1) == (128, 2, 2, 4)


def test_faster_memory_takes_more_bytes_in_flight(monkeypatch):
    # An H200 (fast_memory): 128 x 2 tiles where the grid is crowded at head dim 128 (B=64: 254.6 vs
    # 267.2 us at 32 x 2; MHA B=16 x 4K 255.5 vs 311.3 at 64 x 2), 64 x 2 at head dim 64; four stages
    # on a 16-bit contiguous cache's split grid (B=8: 77.6 vs 79.9), 128-key tiles there at head dim
    # 64 (49.3 vs 54.7), three stages on its 16..63-key pages (82.1 vs 87.2); 64 x 3 where the grid holds
    # one to three programs per SM (two fit an SM: B=20 98.0 vs 118.0 at 128 x 3, B=24 108.1 vs 119.8), but
    # 128 x 3 at one or fewer (B=16 135.6 vs 139.6). FP8, other pages, packed rows and given knobs keep theirs,
    # but for a paged cache's crowded grid, which takes the contiguous one's tiles.
    _, picked = _sm90_knobs(monkeypatch, fast=True)
    assert picked(batch=16) == (128, 3, 1, 4) and picked(batch=17) == (64, 3, 1, 4)  # 128 / 136 programs
    assert picked(batch=24, kv=4096) == (64, 3, 1, 4) and picked(batch=49, kv=2048) == (64, 3, 1, 4)  # 392
    assert picked(batch=50, kv=2048) == (128, 2, 1, 4)  # 400 programs: crowded
    mha = host_decode.decode_knobs(128, 1, 6, 32, 4096, CUDA0)  # 192 programs of one query row each
    assert (mha["BLOCK_N"], mha["num_stages"]) == (64, 3)
    for kw in (dict(page_size=256), dict(element_size=1), dict(element_size=4), dict(rows=64), dict(BLOCK_N=128)):
        assert picked(batch=24, kv=4096, **kw) == _sm90_knobs(monkeypatch)[1](batch=24, kv=4096, **kw), kw
    monkeypatch.setattr(host_decode, "fast_memory", lambda device: True)
    assert picked(batch=64, kv=4096) == (128, 2, 1, 4) and picked(batch=128, kv=2048) == (128, 2, 1, 4)
    hd = lambda d, batch, kv=8192, rows=4, **kw: tuple(  # noqa: E731
        host_decode.decode_knobs(d, rows, batch, 8, kv, CUDA0, **kw)[n]
        for n in ("BLOCK_N", "num_stages", "num_splits"))
    assert hd(64, 64, 4096) == (64, 2, 1) and hd(64, 8) == (128, 4, 2) and hd(64, 1, 65536) == (128, 4, 16)
    assert hd(64, 8, rows=32) == (64, 3, 2) and hd(64, 8, page_size=16) == (32, 3, 8)  # packed rows, pages: as before
    assert hd(64, 8, page_size=256) == (64, 3, 2) and hd(64, 8, element_size=4) == (64, 3, 2)
    assert hd(256, 8) == (32, 3, 2) and hd(256, 64, 4096) == (32, 3, 1)  # head dim 256: as on an H100
    assert hd(64, 24, 4096) == (128, 3, 1) and hd(256, 24, 4096) == (32, 3, 1)  # the two-per-SM rule: hd128's
    # a paged crowded grid the same (session 46: B=64 x 4K pages of 16 258.5 vs 312.9 at 32 x 2, 256 242.8 vs 263.2)
    assert picked(batch=64, kv=4096, page_size=16) == (128, 2, 1, 4) == picked(batch=64, kv=4096, page_size=256)
    assert hd(64, 64, 4096, rows=1, page_size=16) == (64, 2, 1)
    assert picked(batch=64, kv=4096, element_size=4) == (64, 3, 1, 4)  # fp32: the H100's
    assert picked(num_splits=1) == (64, 4, 1, 4)  # a grid that does not fill, unsplit as told: 4 stages too
    assert picked(batch=16) == (128, 3, 1, 4)
    assert picked() == (64, 4, 2, 4) and picked(batch=1, kv=131072) == (64, 4, 16, 4)
    assert picked(page_size=16) == (32, 3, 8, 4)
    assert picked(page_size=1) == (128, 3, 2, 4) and picked(page_size=256) == (64, 3, 2, 4)
    assert picked(rows=64) == (64, 3, 2, 4)  # 64 packed rows (16 query positions): as on an H100
    assert picked(BLOCK_N=64) == (64, 3, 2, 4) and picked(num_stages=2) == (64, 2, 2, 4)
    assert picked(element_size=1) == (128, 3, 4, 4) and picked(element_size=1, batch=64, kv=4096) == (64, 3, 1, 2)
    monkeypatch.setattr(host_decode, "smem_limit", lambda device: 101376)  # 128 x 2 and 4 stages do not fit
    assert picked(batch=64, kv=4096) == (64, 2, 1, 4) and picked() == (64, 2, 2, 4)


def test_fast_memory_reads_the_device_name(monkeypatch):
    class Props:
        def __init__(self, name):
            self.name = name
    for name, fast in (("NVIDIA H200", True), ("NVIDIA H200 NVL", True), ("NVIDIA H100 80GB HBM3", False)):
        monkeypatch.setattr(host_decode, "FAST_MEMORY", {})
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, name=name: Props(name))
        assert host_decode.fast_memory(CUDA0) is fast
    assert host_decode.fast_memory(torch.device("cpu")) is False


def test_default_split_count_follows_the_capacity(device, monkeypatch):
    # With 64 SMs and a long cache the default splits; the result matches the unsplit one. (8 heads of 32:
    # with 2 of 16, the mean-error rule over 32 outputs failed about one seed in a few hundred, 3.34e-5
    # against a bound of 3.32e-5.)
    monkeypatch.setattr(host_decode, "sm_count", lambda device: 64)
    seed, gen = _seeded()
    cache = Cache(gen, 1, 2, 32, (70,), 96, torch.float16, device)
    q = torch.randn(1, 1, 8, 32, generator=gen).to(device=device, dtype=torch.float16)
    spec = AttentionSpec(dtype="fp16", head_dim=32, num_heads=8, num_kv_heads=2, causal=True)
    assert host_decode.decode_knobs(32, 4, 1, 2, 96, torch.device(device), BLOCK_N=16)["num_splits"] > 1
    out = flashgen.decode(spec, q, cache.k_cache, cache.v_cache, cache.cache_seqlens, BLOCK_N=16)
    out_ref, _, out_pt, _ = reference_decode(q, cache, causal=True)
    assert compare("out", out, out_ref, out_pt).ok, f"seed={seed}"


def test_standalone_module_decodes(device, tmp_path):
    # `flashgen generate` writes one file with both host sides pasted in: its decode runs without flashgen.
    import importlib.util

    from flashgen.codegen import render
    from flashgen.config import KernelConfig

    # 1024 outputs: TESTING.md's mean rule on 64 failed a correct kernel about 1 in 400 fresh inputs
    spec = AttentionSpec(dtype="fp16", head_dim=32, num_heads=8, num_kv_heads=2, causal=True, backward=False)
    path = tmp_path / "standalone_decode.py"
    path.write_text(render.render(spec, KernelConfig(BLOCK_M=16, BLOCK_N=16)))
    module_spec = importlib.util.spec_from_file_location("standalone_decode", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    assert module.DecodeLauncher.__module__ == "standalone_decode"
    seed, gen = _seeded()
    cache = Cache(gen, 4, 2, 32, (9, 30, 1, 17), 32, torch.float16, device, page_size=4)
    q = torch.randn(4, 1, 8, 32, generator=gen).to(device=device, dtype=torch.float16)
    out, lse = module.decode(q, cache.k_cache, cache.v_cache, cache.cache_seqlens, block_table=cache.block_table,
                             num_splits=2, BLOCK_N=16)
    out_ref, lse_ref, out_pt, lse_pt = reference_decode(q, cache, causal=True)
    assert compare("out", out, out_ref, out_pt).ok and compare("lse", lse, lse_ref, lse_pt).ok, f"seed={seed}"


def test_bench_decode_smoke(tmp_path):
    # benchmarks/bench_decode.py --smoke: the table at toy sizes on the CPU, every provider
    # recorded (timed or with its error), flashgen checked against SDPA before it is timed.
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_decode.py"
    module_spec = importlib.util.spec_from_file_location("bench_decode", path)
    bench = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(bench)
    rows = bench.main(["--smoke", "--out", str(tmp_path)])
    assert [(r["case"], r["mode"]) for r in rows] == [
        ("B=2 q_len=1 KV=40", "contiguous"), ("B=1 q_len=3 KV=33", "contiguous"),
        ("B=2 q_len=1 KV=40", "paged-1"), ("B=2 q_len=1 KV=40", "paged-16")]
    for r in rows:
        assert "us" in r["flashgen"] and r["flashgen"]["max_err"] < bench.TOLERANCE, r
        assert r["flashgen"]["TBps"] > 0
    assert rows[0]["ratio_vs_sdpa_math"] == rows[0]["sdpa_math"]["us"] / rows[0]["flashgen"]["us"]
    assert rows[2]["ratio_vs_flashgen_contiguous"] > 0
    written = json.loads(next(tmp_path.glob("*-decode-smoke.json")).read_text())
    assert written["rows"] == json.loads(json.dumps(rows))
    assert "| B=2 q_len=1 KV=40 | paged-16 |" in next(tmp_path.glob("*.md")).read_text()


def test_bench_decode_fused_combine_flag(tmp_path, monkeypatch):
    # --fused-combine: the table's split calls merge in the split kernel (the module default set
    # before anything runs), and the results' environment says so.
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_decode.py"
    module_spec = importlib.util.spec_from_file_location("bench_decode", path)
    bench = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(bench)
    monkeypatch.setattr(host_decode, "FUSED_COMBINE", False)
    monkeypatch.setattr(bench, "table_rows", lambda rows, *a: rows.append({"case": "-", "mode": "-"}))
    bench.main(["--smoke", "--fused-combine", "--out", str(tmp_path)])
    assert host_decode.FUSED_COMBINE is True
    assert '"decode_fused_combine": true' in next(tmp_path.glob("*-decode-smoke.json")).read_text()


@pytest.mark.interpreter
def test_bench_decode_ceiling_reads_every_word(tmp_path):
    # bench_decode.py --ceiling's load-only kernels at toy sizes: each checks, before it is timed,
    # that its programs read every word of K and V once (one head per program over two splits,
    # and whole rows of 8 heads).
    import importlib.util
    from pathlib import Path

    from flashgen.timing import wall_ms

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_decode.py"
    module_spec = importlib.util.spec_from_file_location("bench_decode_ceiling", path)
    bench = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(bench)
    rows = bench.ceiling(wall_ms, "cpu", cases=[(2, 32, "bf16", 1, 16, 1, 2), (1, 32, "e4m3", 8, 16, 1, 2)],
                         clean_timer=wall_ms)
    assert [r["case"] for r in rows] == ["B=2 KV=32 bf16, 1 head(s) x 2 split(s) per program, 16 x 1",
                                         "B=1 KV=32 e4m3, 8 head(s) x 2 split(s) per program, 16 x 1"]
    assert all(r["TBps"] > 0 and r["TBps_clean"] > 0 for r in rows)


class _Recorder:
    """Stands in for a @triton.jit kernel: records each launch's grid and non-tensor arguments."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            scalars = [a for a in args if not isinstance(a, torch.Tensor)]
            self.launches.append((grid, scalars, kwargs))
        return launch


@pytest.mark.interpreter
def test_decode_host_side_is_capturable(monkeypatch):
    # Where the host may not read the device (CUDA graph capture, torch.compile), a decode step
    # (append included, paged) reads no tensor on the host, and what it launches (grids, sizes,
    # knobs) depends on shapes only: two steps with other cache_seqlens launch the same.
    host_decode.bounds_record(torch.device("cpu"))  # made once per device (its host view is a numpy array)
    monkeypatch.setattr(host_decode, "device_sync_forbidden", lambda device: True)
    spec = AttentionSpec(dtype="fp16", head_dim=16, num_heads=4, num_kv_heads=2, causal=True, backward=False)
    module = flashgen.compile(spec).module()
    kernel, combine = _Recorder(), _Recorder()
    launcher = host_decode.DecodeLauncher(attention=module._LAUNCHER, kernel=kernel, combine_kernel=combine)
    q = torch.zeros(2, 2, 4, 16, dtype=torch.float16)
    cache = torch.zeros(7, 4, 2, 16, dtype=torch.float16)
    new = torch.ones(2, 2, 2, 16, dtype=torch.float16)
    table = torch.tensor([[3, 1, 5], [0, 6, 2]], dtype=torch.int32)

    def no_sync(*args, **kwargs):
        raise AssertionError("a decode step read a tensor on the host")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    for fused in (False, True):  # a combine kernel, or the merge in the split kernel's last programs
        for lengths in ([3, 9], [0, 10]):
            launcher.decode(q, cache, cache, torch.tensor(lengths, dtype=torch.int32), k=new, v=new,
                            block_table=table, num_splits=3, fused_combine=fused)
    monkeypatch.undo()
    assert len(kernel.launches) == 4 and len(combine.launches) == 2
    assert kernel.launches[0] == kernel.launches[1] and combine.launches[0] == combine.launches[1]
    assert kernel.launches[2] == kernel.launches[3] and kernel.launches[2][2]["FUSED"]
    # the appends landed at each step's lengths, crossing pages: element 0 at 3, 4 (page 3 slot 3, page 1 slot 0)
    assert torch.equal(cache[3, 3], new[0, 0, :, :]) and torch.equal(cache[1, 0], new[0, 1])


# ----------------------------------------------------------------------------- the eager host path
def _recording_launcher():
    spec = AttentionSpec(dtype="fp16", head_dim=16, num_heads=4, num_kv_heads=2, causal=True, backward=False)
    module = flashgen.compile(spec).module()
    kernel, combine = _Recorder(), _Recorder()
    return host_decode.DecodeLauncher(attention=module._LAUNCHER, kernel=kernel, combine_kernel=combine)


@pytest.mark.interpreter
def test_repeated_calls_check_and_plan_once_and_read_no_tensor(monkeypatch):
    # An eager step reads no tensor on the host (no synchronisation), and a call with the same
    # shapes, strides, dtypes and knobs as an earlier one is neither checked nor planned again.
    launcher = _recording_launcher()
    q = torch.zeros(2, 1, 4, 16, dtype=torch.float16)
    cache = torch.zeros(7, 4, 2, 16, dtype=torch.float16)
    table = torch.tensor([[3, 1, 5], [0, 6, 2]], dtype=torch.int32)
    prepared = []
    prepare = launcher.prepare
    host_decode.bounds_record(q.device)  # made once per device (its host view is a numpy array)

    def no_sync(*args, **kwargs):
        raise AssertionError("an eager decode step read a tensor on the host")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    monkeypatch.setattr(launcher, "prepare", lambda *a, **kw: prepared.append(a) or prepare(*a, **kw))
    for lengths in ([3, 9], [0, 10], [12, 1]):
        launcher.decode(q, cache, cache, torch.tensor(lengths, dtype=torch.int32), block_table=table, num_splits=2)
    launcher.decode(q, cache, cache, torch.tensor([1, 1], dtype=torch.int32), block_table=table, num_splits=3)
    monkeypatch.undo()
    assert len(prepared) == 2 and len(launcher.kernel.launches) == 4
    assert launcher.kernel.launches[0] == launcher.kernel.launches[2]
    # every grid has three sizes: the bound launch passes them to the compiled launcher as such
    launcher.append_kernel = _Recorder()
    new = torch.ones(2, 1, 2, 16, dtype=torch.float16)
    launcher.decode(q, cache, cache, torch.tensor([1, 1], dtype=torch.int32), k=new, v=new, block_table=table,
                    num_splits=2, fused_combine=False)
    kernels = (launcher.kernel, launcher.combine_kernel, launcher.append_kernel)
    assert all(kernel.launches for kernel in kernels)
    assert all(len(grid) == 3 for kernel in kernels for grid, _, _ in kernel.launches)
    # a bad second call with the same shapes as a good one is still checked
    with pytest.raises(ValueError, match="k_cache: expected dtype"):
        launcher.decode(q, cache.float(), cache, torch.tensor([3, 9], dtype=torch.int32), block_table=table)


class _Compiled:
    """Stands in for a CompiledKernel: records the launches made through its launcher."""

    packed_metadata, function = "metadata", "function"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class _Jit:
    """Stands in for a compiled JITFunction (what BoundLaunch binds): Triton's path recorded."""

    def __init__(self, real):
        self.calls, self.compiled = [], _Compiled()
        self.signature, self.device_caches = inspect.signature(getattr(real, "fn", real)), {0: ()}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return self.compiled
        return launch


def _bound_launcher(monkeypatch):
    """(launcher, kernel, combine): a DecodeLauncher whose split-KV and combine kernels are _Jit
    stand-ins, launched through BoundLaunch on a fake device 0 (stream 7)."""
    from flashgen.runtime import launch

    driver = type("Driver", (), {"get_current_device": lambda self: 0,
                                 "get_current_stream": lambda self, device: 7})()
    monkeypatch.setattr(launch, "triton_driver", type("Config", (), {"active": driver})())
    monkeypatch.setattr(launch.BoundLaunch, "verify", False)  # the stand-ins have no binder to compare with
    spec = AttentionSpec(dtype="fp16", head_dim=16, num_heads=4, num_kv_heads=2, causal=True, backward=False)
    module = flashgen.compile(spec).module()
    kernel, combine = _Jit(module._attn_decode), _Jit(module._decode_combine)
    launcher = host_decode.DecodeLauncher(attention=module._LAUNCHER, kernel=kernel, combine_kernel=combine)
    return launcher, kernel, combine


@pytest.mark.interpreter
def test_launches_are_bound_after_the_first(monkeypatch):
    # Decode launches through flashgen.runtime.launch's BoundLaunch: the first call of a signature
    # (and of a pointer alignment) takes Triton's path; later ones call the compiled kernel's
    # launcher with the grid, the stream, the arguments and the constexprs in signature order.
    launcher, kernel, combine = _bound_launcher(monkeypatch)
    launcher.append_kernel = append = _Jit(host_decode._decode_append)
    q = torch.zeros(2, 1, 4, 16, dtype=torch.float16)
    cache = torch.zeros(2, 8, 2, 16, dtype=torch.float16)
    new = torch.ones(2, 1, 2, 16, dtype=torch.float16)
    for _ in range(3):
        launcher.decode(q, cache, cache, torch.tensor([3, 4], dtype=torch.int32), k=new, v=new, num_splits=2,
                        fused_combine=False)
    for jit in (kernel, combine, append):
        assert len(jit.calls) == 1 and len(jit.compiled.runs) == 2
        grid, args, constexprs = jit.calls[0]
        run = jit.compiled.runs[0]
        assert run[:9] == (*grid, *(1,) * (3 - len(grid)), 7, "function", "metadata", None, None, None)
        names = list(jit.signature.parameters)[len(args):]
        assert len(run) == 9 + len(args) + len(names) and list(constexprs) == names + ["num_warps", "num_stages"]
        assert run[9 + len(args):] == tuple(constexprs[n] for n in names)
    # a q whose pointer is not 16-byte aligned: Triton specializes otherwise, so its path again
    unaligned = torch.zeros(2 * 64 + 1, dtype=torch.float16)[1:].view(2, 1, 4, 16)
    launcher.decode(unaligned, cache, cache, torch.tensor([3, 4], dtype=torch.int32), num_splits=2,
                    fused_combine=False)
    assert len(kernel.calls) == 2 and len(append.calls) == 1


# ----------------------------------------------------------------------------- a model's cache, one key longer per step
def _growing_caches(gen, batch, kv_heads, d, lengths, device):
    """(k, v) per length as transformers' DynamicCache holds them: (B, H_kv, S, D) tensors made
    afresh each step (torch.cat), passed as (B, S, H_kv, D) views (head stride S * D)."""
    return [tuple(torch.randn(batch, kv_heads, n, d, generator=gen).to(device=device, dtype=torch.float16)
                  .transpose(1, 2) for _ in range(2)) for n in lengths]


def test_new_cache_lengths_are_neither_checked_nor_planned_again(device, monkeypatch):
    # A contiguous cache read without appending is keyed without its length: a step one key longer
    # runs no check and no plan, unless its length changes the plan (here: 64 SMs, so the split
    # count follows the key blocks, 16 keys each, up to 32 splits). Each step stays exact.
    monkeypatch.setattr(host_decode, "sm_count", lambda device: 64)
    prepared = []
    prepare = host_decode.DecodeLauncher.prepare
    monkeypatch.setattr(host_decode.DecodeLauncher, "prepare",
                        lambda self, *a, **kw: prepared.append(a[1].shape[1]) or prepare(self, *a, **kw))
    seed, gen = _seeded()
    spec = AttentionSpec(dtype="fp16", head_dim=16, num_heads=6, num_kv_heads=2, causal=True, backward=False)
    from flashgen.kvcache import decode_launcher

    launcher = decode_launcher(flashgen.compile(spec))  # the process-wide launcher: no plan of an earlier test's
    monkeypatch.setattr(launcher, "calls", {})
    monkeypatch.setattr(launcher, "reads", {})
    lengths = (5, 6, 16, 17, 31, 32, 33, 47, 48, 49)
    for n, (k, v) in zip(lengths, _growing_caches(gen, 2, 2, 16, lengths, device)):
        q = torch.randn(2, 1, 6, 16, generator=gen).to(device=device, dtype=torch.float16)
        out = flashgen.decode(spec, q, k, v, BLOCK_N=16)
        ref = [reference_attention(q, k, v, causal=True, layout="bshd", compute_dtype=t)[0]
               for t in (torch.float32, torch.float16)]
        assert compare("out", out, *ref).ok, f"seed={seed}, length {n}"
    # one plan per key-block count (1, 2, 3, 4 blocks), not per length
    assert prepared == [5, 17, 33, 49], prepared


@pytest.mark.interpreter
def test_new_cache_lengths_launch_their_own_strides_and_lengths(monkeypatch):
    # Keyed without the length, each step still passes its own cache strides and length to the
    # kernel (and its length as cache_seqlens when none is given), and a length Triton specializes
    # otherwise (divisible by 16 or not) takes Triton's path once before its launches are bound.
    launcher, kernel, combine = _bound_launcher(monkeypatch)
    q = torch.zeros(2, 1, 4, 16, dtype=torch.float16)
    lengths = (16, 32, 17, 18, 48, 19)
    caches = _growing_caches(torch.Generator().manual_seed(0), 2, 2, 16, lengths, "cpu")
    fills = []
    full = torch.full
    monkeypatch.setattr(torch, "full", lambda *a, **kw: fills.append(a) or full(*a, **kw))
    for k, v in caches:
        launcher.decode(q, k, v, num_splits=1)
    assert [len(args) for _, args, _ in kernel.calls] == [len(kernel.calls[0][1])] * 2  # lengths 16 and 17
    runs = [args[9:] for args in kernel.compiled.runs] + [args for _, args, _ in kernel.calls]
    assert len(runs) == len(lengths) and not fills  # the lengths are rows of one table, not new tensors
    by_length = {}
    for args in runs:
        by_length.setdefault(int(args[1].shape[1]), []).append(args)
    for (k, v) in caches:
        for args in by_length[k.shape[1]]:
            assert args[1] is k and args[2] is v
            assert args[14 + 4:14 + 12] == (*k.stride(), *v.stride()) and args[14 + 22] == k.shape[1]
            assert torch.equal(args[6], torch.full((2,), k.shape[1], dtype=torch.int32))
    # caches of two lengths are not one cache: the length-free key does not hide that
    with pytest.raises(ValueError, match="v_cache: expected leading dims"):
        launcher.decode(q, caches[0][0], caches[1][1], num_splits=1)
    # an int cache_seqlens is a table row too; one outside the table still reaches the kernel
    launcher.decode(q, caches[0][0], caches[0][1], 9, num_splits=1)
    assert torch.equal(kernel.compiled.runs[-1][9 + 6], torch.full((2,), 9, dtype=torch.int32))
    assert launcher.seqlens_arg(-3, 2, 16, torch.device("cpu")).tolist() == [-3, -3]
    # while a CUDA graph is captured a new table would be filled only by replays: none is made
    fresh = _bound_launcher(monkeypatch)[0]
    monkeypatch.setattr(host_decode, "device_sync_forbidden", lambda device: True)
    assert fresh.seqlens_arg(5, 2, 16, torch.device("cpu")).tolist() == [5, 5] and not fresh.lengths


# ----------------------------------------------------------------------------- flashgen.attention's decode-shaped calls
@pytest.mark.parametrize("layout,sq,kw", [
    ("bshd", 3, dict(causal=True)),  # GQA, several queries aligned bottom-right
    ("bhsd", 1, dict(causal=True)),
    ("bshd", 2, dict(causal=False, mask={"sliding_window": {"left": 6, "right": 0}})),
    ("bshd", 1, dict(causal=True, score_mod={"softcap": 3.0})),
], ids=["bshd-sq3", "bhsd-sq1", "window", "softcap"])
def test_attention_of_a_few_queries_over_many_keys_runs_the_decode_kernel(device, monkeypatch, layout, sq, kw):
    # Over more than DECODER_KEYS keys (lowered to 8 here), an inference call of flashgen.attention with a
    # few queries runs on the split-KV decode kernel (DecodeLauncher.read), checked and planned once for
    # every length; out and lse against the reference. Up to 8 keys, with fewer keys than queries, or with
    # a gradient to compute, the prefill kernel runs.
    from flashgen.runtime.decode import DecodeLauncher
    from flashgen.runtime.host import AttentionLauncher

    monkeypatch.setattr(AttentionLauncher, "DECODER_KEYS", 8)
    reads, read = [], DecodeLauncher.read
    seq = 1 if layout == "bshd" else 2
    # (the call's own read: a bhsd read's first call of a length class reads its bshd views once more)
    monkeypatch.setattr(DecodeLauncher, "read", lambda self, q, *a, **k: k.get("layout", "bshd") == layout and
                        reads.append(q.shape[seq]) or read(self, q, *a, **k))
    seed, gen = _seeded()

    def inputs(seqlen_q, seqlen_k):
        shape = lambda heads, n: (2, n, heads, 32) if layout == "bshd" else (2, heads, n, 32)  # noqa: E731
        return [torch.randn(*shape(h, n), generator=gen).to(device=device, dtype=torch.float16)
                for h, n in ((4, seqlen_q), (2, seqlen_k), (2, seqlen_k))]

    for seqlen_k in (41, 20, 40, 8):  # a new length each call; 8 keys take the prefill kernel
        q, k, v = inputs(sq, seqlen_k)
        with torch.no_grad():
            out, lse = flashgen.attention(q, k, v, layout=layout, return_lse=True, **kw)
        assert out.shape == q.shape and out.stride() == torch.empty_like(q).stride(), f"seed={seed}"
        assert lse.shape == (2, 4, sq), f"seed={seed}"
        assert_attention_close(out, lse, q, k, v, layout=layout, **kw)
    assert reads == [sq] * 3, reads
    q, k, v = inputs(sq + 3, sq + 2)  # more queries than keys: the prefill kernel
    with torch.no_grad():
        assert_attention_close(*flashgen.attention(q, k, v, layout=layout, return_lse=True, **kw), q, k, v,
                               layout=layout, **kw)
    q, k, v = (t.requires_grad_() for t in inputs(sq, 30))  # a gradient: the autograd path
    flashgen.attention(q, k, v, layout=layout, **kw).sum().backward()
    assert reads == [sq] * 3 and q.grad is not None and q.shape[seq] == sq
    with torch.no_grad(), pytest.raises(ValueError, match="^k: expected dtype"):  # errors name flashgen.attention's
        flashgen.attention(q, k.to(torch.float32), v, layout=layout, **kw)  # arguments, not the cache's


def _read_and_decode(device, lengths, misaligned, capacity=80):
    """DecodeLauncher.read() and decode() of the same calls (a cache one length after another, as a
    model's growing cache): (read's (out, lse), decode's) per length. misaligned: q and the caches
    start 2 bytes past a 16-byte boundary (Triton specializes pointers on their alignment)."""
    seed, gen = _seeded()
    spec = AttentionSpec(dtype="fp16", head_dim=32, num_heads=4, num_kv_heads=2, causal=True, backward=False)
    launcher = flashgen.kvcache.decode_launcher(flashgen.compile(spec))
    skip = 1 if misaligned else 0
    flat = lambda n: torch.randn(n + skip, generator=gen).to(device=device, dtype=torch.float16)[skip:]  # noqa: E731
    q = flat(2 * 2 * 4 * 32).view(2, 2, 4, 32)
    k_all, v_all = (flat(2 * 2 * capacity * 32).view(2, 2, capacity, 32) for _ in range(2))  # (B, H_kv, S, D)
    pairs = []
    for n in lengths:
        k, v = k_all[:, :, :n].transpose(1, 2), v_all[:, :, :n].transpose(1, 2)  # (B, S, H_kv, D) views
        pairs.append((launcher.read(q, k, v, 0.3, return_lse=True),
                      launcher.decode(q, k, v, None, softmax_scale=0.3, return_lse=True)))
    return pairs, f"seed={seed}"


@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
def test_read_launches_as_decode_does(device, misaligned):
    # read()'s own launch path (launch_read) against decode()'s on the same calls: bitwise equal, for
    # lengths in and across length classes, before and after the short key is known.
    pairs, what = _read_and_decode(device, (37, 38, 64, 65, 20, 80, 37), misaligned)
    for n, ((out, lse), (out_d, lse_d)) in zip((37, 38, 64, 65, 20, 80, 37), pairs):
        assert torch.equal(out, out_d) and torch.equal(lse, lse_d), f"{what} length {n}"


@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_read_takes_bhsd_tensors_as_their_bshd_views(device, misaligned, seqlen_q):
    # read(layout="bhsd") of tensors in transformers' order (q (B, H, Sq, D), caches (B, H_kv, S, D) slices of a
    # longer buffer) launches as read() of their bshd views: bitwise equal, for lengths in and across length
    # classes, before and after its short key is known (fails when launch_read passes the bhsd strides unpermuted).
    from flashgen.runtime.decode import DecodeLauncher

    seed, gen = _seeded()
    spec = AttentionSpec(dtype="fp16", head_dim=32, num_heads=4, num_kv_heads=2, causal=True, backward=False)
    launcher = flashgen.kvcache.decode_launcher(flashgen.compile(spec))
    skip = 1 if misaligned else 0
    flat = lambda n: torch.randn(n + skip, generator=gen).to(device=device, dtype=torch.float16)[skip:]  # noqa: E731
    q = flat(2 * 4 * seqlen_q * 32).view(2, 4, seqlen_q, 32)
    k_all, v_all = (flat(2 * 2 * 80 * 32).view(2, 2, 80, 32) for _ in range(2))
    for n in (37, 38, 64, 65, 20, 80, 37):
        k, v = k_all[:, :, :n], v_all[:, :, :n]
        out, lse = launcher.read(q, k, v, 0.3, return_lse=True, layout="bhsd")
        out_v, lse_v = launcher.read(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.3, return_lse=True)
        assert out.shape == (2, seqlen_q, 4, 32) and torch.equal(out, out_v) and torch.equal(lse, lse_v), \
            f"seed={seed} length {n}"
    # one short key for every length (the launcher is shared: other tests' keys hold other shapes)
    assert sum(key[:3] == (2, q.shape, q.stride()) for key in launcher.reads) == 1
    with pytest.raises(ValueError, match="^layout: expected 'bshd' or 'bhsd', got 'bsdh'"):
        launcher.read(q, k, v, 0.3, layout="bsdh")
    with pytest.raises(ValueError, match="^k_cache: expected dtype"):  # the views' checks name the argument
        launcher.read(q, k.float(), v, 0.3, layout="bhsd")
    assert DecodeLauncher.read_key(q, None, v, 0.3, False, 2) is None


@pytest.mark.parametrize("batch, seqlen_q", [(2, 0), (0, 1)])
def test_a_decode_with_no_queries_returns_an_empty_output(device, batch, seqlen_q):
    # (the split heuristic divided by its zero rows: ZeroDivisionError)
    from flashgen.compat import flash_attn_with_kvcache

    k_cache = torch.randn(batch, 32, 1, 16).to(device=device, dtype=torch.float16)
    q = torch.randn(batch, seqlen_q, 2, 16).to(device=device, dtype=torch.float16)
    out = flash_attn_with_kvcache(q, k_cache, k_cache.clone(),
                                  cache_seqlens=torch.full((batch,), 5, dtype=torch.int32, device=device))
    assert out.shape == (batch, seqlen_q, 2, 16)


@pytest.mark.parametrize("shape, message", [((3,), r"expected size 2 \(the query heads\)"),
                                            ((3, 2), r"expected size 2 \(the batch\)")])
def test_decode_refuses_named_tensors_of_another_batch_or_head_count(device, shape, message):
    # (the kernels clamp each index: 3 slopes for 2 heads were read as the first 2, silently)
    from flashgen.compat import flash_attn_with_kvcache

    q = torch.randn(2, 1, 2, 16).to(device=device, dtype=torch.float16)
    k_cache = torch.randn(2, 16, 2, 16).to(device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="^alibi_slopes: " + message):
        flash_attn_with_kvcache(q, k_cache, k_cache.clone(), alibi_slopes=torch.rand(shape, device=device),
                                cache_seqlens=torch.tensor([5, 7], dtype=torch.int32, device=device))


@pytest.mark.parametrize("expr", ["score + bias[kv_idx]", "score + bias[h, kv_idx]",
                                  "score + bias[kv_idx] + bias[q_idx]"])
def test_decode_records_named_tensors_shorter_than_the_keys(device, expr):
    # kv_idx indexes these dimensions: a tensor must cover each element's keys, which the host cannot see
    # (the lengths live on the device), so the kernel records one shorter than an element's keys. Before,
    # its reads were clamped (a 10-entry bias over 20 keys repeated its last entry, silently).
    spec, gen, q, k_cache, v_cache, lengths = _named_tensor_case(expr, 0, 1, device)
    heads = (2,) if "h," in expr else ()
    for size in (20, 32, 1):  # the longest element's keys, the capacity, and broadcast
        bias = torch.randn(*heads, size, generator=gen).to(device)
        out = flashgen.decode(spec, q, k_cache, v_cache, lengths, bias=bias, check="sync")
        _check_rows(out, q, k_cache, v_cache, (12, 20), expr, {"bias": bias})
    short = torch.randn(*heads, 19).to(device)
    with pytest.raises(ValueError, match=r"^bias: expected at least 20 entries in dim -1 \(kv_idx indexes it: batch "
                                         r"element 1 has 20 keys\), got 19"):
        flashgen.decode(spec, q, k_cache, v_cache, lengths, bias=short, check="sync")
    flashgen.decode(spec, q, k_cache, v_cache, lengths, bias=bias, check="sync")  # the record was cleared


def test_decode_records_a_relative_bias_table_shorter_than_its_distances(device):
    # relative_bias reads entry q_idx - kv_idx + seqlen_k - 1 of its head's row: seqlen_q + seqlen_k - 1 entries,
    # per element's keys, which the host cannot see; before, a short table was read clamped on decode calls
    spec, gen, q, k_cache, v_cache, lengths = _named_tensor_case({"relative_bias": "rb"}, 3, 2, device)
    for size in (21, 33):  # the longest element's distances (2 rows over 20 keys), the capacity's
        rb = torch.randn(2, size, generator=gen).to(device)
        out = flashgen.decode(spec, q, k_cache, v_cache, lengths, rb=rb, check="sync")
        _check_rows(out, q, k_cache, v_cache, (12, 20), {"relative_bias": "rb"}, {"rb": rb})
    with pytest.raises(ValueError, match=r"^rb: expected at least 21 entries in dim -1 \(one per distance, seqlen_q "
                                         r"\+ seqlen_k - 1 for batch element 1\), got 20"):
        flashgen.decode(spec, q, k_cache, v_cache, lengths, rb=torch.randn(2, 20).to(device), check="sync")


def test_decode_records_a_dimension_both_b_and_kv_idx_index(device):
    # 2 entries pass the batch's rule on the host (2 elements); kv_idx reads past them were clamped, silently:
    # the kernel records the dimension against the keys as for kv_idx alone
    expr = "score + bias[kv_idx] * bias[b]"
    spec, gen, q, k_cache, v_cache, lengths = _named_tensor_case(expr, 2, 1, device)
    with pytest.raises(ValueError, match=r"^bias: expected at least (12|20) entries in dim -1 \(kv_idx indexes it: "
                                         r"batch element [01] has (12|20) keys\), got 2"):
        flashgen.decode(spec, q, k_cache, v_cache, lengths, bias=torch.randn(2).to(device), check="sync")
    with pytest.raises(ValueError, match=r"^bias: expected size 2 \(the batch\) or 1 in dim 0"):  # the host's rule
        flashgen.decode(spec, q, k_cache, v_cache, lengths, bias=torch.randn(20).to(device), check="sync")
    bias = torch.randn(1, generator=gen).to(device)  # broadcast: both rules hold
    out = flashgen.decode(spec, q, k_cache, v_cache, lengths, bias=bias, check="sync")
    _check_rows(out, q, k_cache, v_cache, (12, 20), expr, {"bias": bias})


def test_decode_checks_named_tensors_of_query_rows_on_the_host(device):
    # q_idx is a query's row (0 .. seqlen_q - 1; the mask aligns it to the cache): 3 entries serve 3 query
    # rows over 20 keys (the kernel compares only kv_idx's dimensions with the keys), 2 are refused by name
    spec, gen, q, k_cache, v_cache, lengths = _named_tensor_case("score + bias[q_idx]", 1, 3, device)
    for size in (3, 1):
        bias = torch.randn(size, generator=gen).to(device)
        out = flashgen.decode(spec, q, k_cache, v_cache, lengths, bias=bias, check="sync")
        _check_rows(out, q, k_cache, v_cache, (12, 20), "score + bias[q_idx]", {"bias": bias})
    with pytest.raises(ValueError, match=r"^bias: expected size at least 3 \(seqlen_q 3\) or 1 in dim 0"):
        flashgen.decode(spec, q, k_cache, v_cache, lengths, bias=torch.randn(2).to(device), check="sync")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_rows_below_the_score_floor_count_as_masked(device, num_splits):
    # As the prefill kernels (test_sdpa): a row whose every key an additive bias puts below -65536 gives 0 and LSE
    # -inf, split or not; a row with keys above it is the reference, whichever splits hold its masked keys.
    spec, gen, q, k_cache, v_cache, lengths = _named_tensor_case("score + bias[b, kv_idx]", 4, 1, device)
    bias = torch.randn(2, 20, generator=gen).to(device)
    bias[0] = -1e9  # element 0: every key
    bias[1, :11] = -1e9  # element 1: its first 11 keys
    v_cache[0, 3] = float("inf")  # in a row masked whole: 0 all the same (the merge's 0 * inf gave NaN once)
    out, lse = flashgen.decode(spec, q, k_cache, v_cache, lengths, bias=bias, num_splits=num_splits, BLOCK_N=16,
                               return_lse=True, check="sync")
    assert not out[0].any() and (lse[0] == float("-inf")).all()
    ref = reference_attention(q[1:], k_cache[1:, :20], v_cache[1:, :20], causal=True, layout="bshd",
                              compute_dtype=torch.float32, score_mod="score + bias[b, kv_idx]",
                              tensors={"bias": bias[1:]})[0]
    assert (out[1:].float() - ref).abs().max().item() < 2e-3


def test_decode_splits_below_the_score_floor_weigh_in_where_the_row_is_above_it(device):
    # The floor judges a row by its max over all its keys, split or not, as prefill does. Split-KV decode applied it
    # per split: a split wholly below -65536 in a row whose other keys are above it was dropped (here 35% of row 1's
    # weight). Queries of 0, so each score is its bias; BLOCK_N 16 over 20 keys: 2 splits, keys 0-15 and 16-19.
    spec, gen, q, k_cache, v_cache, _ = _named_tensor_case("score + bias[b, kv_idx]", 5, 1, device)
    q.zero_()
    lengths = torch.tensor([20, 20], dtype=torch.int32, device=device)
    bias = torch.empty(2, 20).to(device)
    bias[0] = -65536.5  # every key just below the floor: masked, though its LSE (-65533.5) is above it
    bias[1, :16], bias[1, 16:] = -65537.0, -65535.0  # split 0 wholly below the floor, split 1 above it
    ref = reference_attention(q[1:], k_cache[1:, :20], v_cache[1:, :20], causal=True, layout="bshd",
                              compute_dtype=torch.float32, score_mod="score + bias[b, kv_idx]",
                              tensors={"bias": bias[1:]})[0]
    # (the scores' float32 rounding near 2^16 in log2 units, 2^-7, moves each weight by up to 0.5%)
    dropped = v_cache[1, 16:20].float().mean(0)  # split 0 left out: the mean of keys 16-19's values
    assert (dropped - ref[0, 0]).abs().max().item() > 0.1  # (so the check below tells the two apart)
    for num_splits in (1, 2):
        out, lse = flashgen.decode(spec, q, k_cache, v_cache, lengths, bias=bias, num_splits=num_splits, BLOCK_N=16,
                                   return_lse=True, check="sync")
        assert not out[0].any() and (lse[0] == float("-inf")).all(), f"num_splits={num_splits}"
        assert (out[1:].float() - ref).abs().max().item() < 2e-2, f"num_splits={num_splits}"


def test_an_append_only_call_checks_its_targets(device):
    # No query rows: no decode kernel runs, and it is that kernel which records what the append skips; a bad target
    # was dropped silently (a review's catch). Checked on the host before the append now; a good call still writes.
    spec = AttentionSpec(dtype="fp32", head_dim=16, num_heads=4, num_kv_heads=2, backward=False)
    q0 = torch.randn(2, 0, 4, 16).to(device)
    k_new, v_new = (torch.randn(2, 3, 2, 16).to(device) for _ in range(2))
    kc, vc = (torch.zeros(2, 5, 2, 16).to(device) for _ in range(2))
    with pytest.raises(ValueError, match=r"^cache_seqlens: expected lengths \+ 3 appended within the cache's capacity "
                                         r"5, got 4 \+ 3 appended at index 0$"):
        flashgen.decode(spec, q0, kc, vc, 4, k=k_new, v=v_new)
    assert not kc.any()
    pages = torch.zeros(6, 4, 2, 16).to(device)
    table = torch.tensor([[0, 1], [2, 99]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"^block_table: expected page indices in \[0, 6\) \(the pages of k_cache\), "
                                         r"got 99 at \[1, 1\]$"):
        flashgen.decode(spec, q0, pages, pages.clone(), torch.tensor([1, 3], dtype=torch.int32, device=device),
                        k=k_new, v=v_new, block_table=table)
    with pytest.raises(ValueError, match=r"^cache_batch_idx: expected indices in \[0, 2\) \(the batch of k_cache\), "
                                         r"got 7 at index 1$"):
        flashgen.decode(spec, q0, kc, vc, 0, k=k_new, v=v_new,
                        cache_batch_idx=torch.tensor([0, 7], dtype=torch.int32, device=device))
    flashgen.decode(spec, q0, kc, vc, 2, k=k_new, v=v_new)
    assert torch.equal(kc[:, 2:5], k_new) and torch.equal(vc[:, 2:5], v_new) and not kc[:, :2].any()


def test_out_and_lse_over_one_memory_are_refused(device):
    # out and lse sharing memory: each kernel's stores overwrote the other's, silently (a review's catch)
    spec = AttentionSpec(dtype="fp32", head_dim=16, num_heads=4, num_kv_heads=2, causal=True, backward=False)
    q = torch.randn(2, 3, 4, 16).to(device)
    kc, vc = (torch.randn(2, 12, 2, 16).to(device) for _ in range(2))
    buf = torch.empty(2 * 3 * 4 * 16, device=device)
    with pytest.raises(ValueError, match=r"^lse: expected a buffer apart from out, got one sharing its memory"):
        flashgen.decode(spec, q, kc, vc, torch.tensor([6, 12], dtype=torch.int32, device=device),
                        out=buf.view(2, 3, 4, 16), lse=buf[:24].view(2, 4, 3))
    kernel = flashgen.compile(spec.replace(causal=False))
    q, k = torch.randn(1, 4, 40, 16).to(device), torch.randn(1, 2, 40, 16).to(device)
    buf = torch.empty(q.numel(), device=device)
    with pytest.raises(ValueError, match=r"^lse: expected a buffer apart from out"):
        kernel.forward(q, k, k, out=buf.view(1, 4, 40, 16), lse=buf[:160].view(1, 4, 40))


def test_decode_refuses_meta_tensors_by_name():
    # (the bounds record read the device's memory: a raw numpy TypeError)
    spec = AttentionSpec(dtype="fp32", head_dim=16, num_heads=4, num_kv_heads=2, backward=False)
    q, kc = torch.empty(2, 1, 4, 16, device="meta"), torch.empty(2, 8, 2, 16, device="meta")
    with pytest.raises(ValueError, match="^q: expected a tensor with data, got a meta tensor$"):
        flashgen.decode(spec, q, kc, kc, torch.empty(2, dtype=torch.int32, device="meta"))


def _named_tensor_case(expr, seed, seqlen_q, device):
    """A causal fp16 decode spec with score modifier expr (2 query heads over 1 KV head, hd16), and a call's
    inputs: seqlen_q new rows of 2 elements over a 32-slot cache holding 12 and 20 keys."""
    spec = AttentionSpec(dtype="fp16", head_dim=16, num_heads=2, num_kv_heads=1, causal=True, score_mod=expr,
                         backward=False)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seqlen_q, 2, 16, generator=gen).to(device=device, dtype=torch.float16)
    k_cache, v_cache = (torch.randn(2, 32, 1, 16, generator=gen).to(device=device, dtype=torch.float16)
                        for _ in range(2))
    return spec, gen, q, k_cache, v_cache, torch.tensor([12, 20], dtype=torch.int32, device=device)


def _check_rows(out, q, k_cache, v_cache, lengths, expr, tensors):
    """Each element's decode rows against the reference over its keys (causal, bottom-right)."""
    ref = torch.cat([reference_attention(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], causal=True,
                                         layout="bshd", compute_dtype=torch.float32, score_mod=expr,
                                         tensors=tensors)[0] for b, n in enumerate(lengths)])
    assert (out.float() - ref).abs().max().item() < 2e-3


def test_kvcache_spec_errors_name_the_caches():
    # flash_attn_with_kvcache built its spec from the caches and said "k: expected a number of heads ..."
    from flashgen.compat import flash_attn_with_kvcache

    q = torch.randn(2, 1, 4, 16, dtype=torch.float16)
    cache = torch.randn(2, 32, 3, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^k_cache: expected a number of heads that divides q's 4, got 3"):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=torch.tensor([5, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^v_cache: expected a head dim from 1 to"):
        flash_attn_with_kvcache(q, cache[:, :, :2], torch.randn(2, 32, 2, 0, dtype=torch.float16),
                                cache_seqlens=torch.tensor([5, 7], dtype=torch.int32))


def test_strided_lengths_and_batch_indices_are_refused_by_name(device):
    # the kernels read element b of cache_seqlens and cache_batch_idx at b: a strided view would read another
    # element's length (and append its new keys at the wrong position)
    q = torch.randn(2, 1, 2, 16).to(device=device, dtype=torch.float16)
    cache = torch.randn(2, 32, 2, 16).to(device=device, dtype=torch.float16)
    lengths = torch.tensor([5, 0, 9, 0], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"^cache_seqlens: expected a contiguous tensor \(stride 1\), got stride 2"):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lengths[::2])
    rows = torch.tensor([1, 0, 0, 0], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"^cache_batch_idx: expected a contiguous tensor \(stride 1\), got stride 2"):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lengths[::2].contiguous(), cache_batch_idx=rows[::2])
    one = flash_attn_with_kvcache(q[:1], cache[:1], cache[:1], cache_seqlens=lengths[::2][:1])  # batch 1: any stride
    assert torch.equal(one, flash_attn_with_kvcache(q[:1], cache[:1], cache[:1], cache_seqlens=lengths[:1].clone()))


@pytest.mark.parametrize("length", [2**31, -2**40])
def test_an_int_length_past_int32_is_refused_by_name(device, length):
    q = torch.randn(2, 1, 2, 16).to(device=device, dtype=torch.float16)
    cache = torch.randn(2, 32, 2, 16).to(device=device, dtype=torch.float16)
    flash_attn_with_kvcache(q, cache, cache, cache_seqlens=7)  # its key (an int length) first: checked per call too
    for _ in range(2):
        with pytest.raises(ValueError, match=rf"^cache_seqlens: expected a length in int32's range, got {length}$"):
            flash_attn_with_kvcache(q, cache, cache, cache_seqlens=length)


def test_an_out_sharing_memory_with_the_inputs_or_itself_is_refused(device):
    spec = AttentionSpec(dtype="fp16", head_dim=16, num_heads=2, num_kv_heads=2, causal=True, backward=False)
    q = torch.randn(2, 1, 2, 16).to(device=device, dtype=torch.float16)
    cache = torch.randn(2, 32, 2, 16).to(device=device, dtype=torch.float16)
    lengths = torch.tensor([5, 9], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"^out: expected a tensor whose elements do not share memory"):
        flashgen.decode(spec, q, cache, cache.clone(), lengths, out=torch.empty_like(q[:1]).expand(2, -1, -1, -1))
    good = flashgen.decode(spec, q, cache, cache.clone(), lengths, out=torch.empty_like(q))[0]
    # out inside k_cache, with the same metadata as the call above (its key: checked per call)
    inside = cache.view(-1)[:q.numel()].view(q.shape)
    for name, kw in (("k_cache", dict(out=inside)), ("q", dict(out=q))):
        with pytest.raises(ValueError, match=rf"^out: expected a buffer apart from {name}, got one sharing its memory"):
            flashgen.decode(spec, q, cache, cache.clone(), lengths, **kw)
    assert torch.equal(flashgen.decode(spec, q, cache, cache.clone(), lengths)[0], good)


@pytest.mark.parametrize("taken,refused,field", [
    (dict(softmax_scale=1.0), dict(softmax_scale=True), "softmax_scale"),
    (dict(window_size=(2, 0)), dict(window_size=(2.0, 0)), "window_size"),
    (dict(window_size=(1, 0)), dict(window_size=(True, 0)), "window_size")])
def test_kvcache_refuses_a_value_equal_to_a_taken_one_every_time(device, taken, refused, field):
    # True == 1 and 2.0 == 2 as dict keys: the compat launcher's key types its scalars, so a refused value never
    # finds the launcher its taken twin made
    q = torch.randn(2, 1, 2, 16).to(device=device, dtype=torch.float16)
    cache = torch.randn(2, 32, 2, 16).to(device=device, dtype=torch.float16)
    flash_attn_with_kvcache(q, cache, cache, cache_seqlens=7, causal=True, **taken)
    for _ in range(2):
        with pytest.raises((TypeError, ValueError), match=field):
            flash_attn_with_kvcache(q, cache, cache, cache_seqlens=7, causal=True, **refused)


def test_lengths_and_descales_are_the_graphs_own_while_captured(monkeypatch):
    # An int cache_seqlens is a view of a table kept per batch size, and a missing descale a kept tensor of
    # ones: while a graph is captured each is a tensor of the graph's own instead (a replay would read the kept
    # one after a longer length grew the table, or 64 batch sizes dropped it: freed memory; a table or ones made
    # during capture would be filled only by replays, and kept, read by eager calls unfilled).
    spec = AttentionSpec(dtype="fp16", head_dim=16, num_heads=4, num_kv_heads=2, causal=True, backward=False)
    launcher = flashgen.kvcache.decode_launcher(flashgen.compile(spec))
    cpu = torch.device("cpu")
    monkeypatch.setattr(launcher, "lengths", {})
    monkeypatch.setattr(launcher, "ones", {})
    kept = launcher.seqlens_arg(7, 3, 48, cpu)
    assert kept.tolist() == [7] * 3 and kept._base is launcher.lengths[3, cpu]
    ones = launcher.descale_arg(None, 3, cpu)
    assert launcher.descale_arg(None, 3, cpu) is ones
    monkeypatch.setattr(host_decode, "device_sync_forbidden", lambda device: True)
    monkeypatch.setattr(host_decode, "capturing", lambda device: True)
    for n in (7, 5000):
        captured = launcher.seqlens_arg(n, 3, 48, cpu)
        assert captured.tolist() == [n] * 3 and captured._base is None
    assert list(launcher.lengths) == [(3, cpu)] and launcher.lengths[3, cpu].shape[0] == 1024  # not grown
    captured_ones = launcher.descale_arg(None, 3, cpu)
    assert captured_ones is not ones and captured_ones.tolist() == [[1.0, 1.0]] * 3
    assert launcher.descale_arg(None, 5, cpu) is not None and list(launcher.ones) == [(3, 2, cpu)]
