"""Decode on the GPU (issue 14): flashgen's KV-cache kernels beside SDPA (flash, cuDNN) and FlexAttention.

The issue's table: bf16, 32 query heads over 8 KV heads, head dim 128, (batch, q_len, KV
length) = (8, 1, 8192), (64, 1, 4096), (1, 1, 131072), (8, 16, 8192), causal aligned
bottom-right (query i of q_len sees keys j <= KV - q_len + i). flashgen runs its default knobs
through flashgen.compat.flash_attn_with_kvcache ("flashgen") and through flashgen.decode with a
spec ("flashgen_native"); the anchors run on the same cache, viewed (batch, heads, KV, dim):
SDPA flash and cuDNN (bottom-right causal through torch.nn.attention.bias.causal_lower_right),
FlexAttention compiled (its flex_decoding path for short queries, a bottom-right causal block
mask). Then a paged cache (page sizes 1, 16, 256; a shuffled block table) at B=8, KV 8192,
against the contiguous one. Every output is checked against SDPA's (or the dense reference)
before it is timed; each provider's failure is recorded, not fatal.

"flashgen" is what a user calling flash_attn_with_kvcache gets, eager: no host synchronisation
(the kernels record an out-of-range index in pinned host memory, read by the next call), and
after the first call of a shape the launches skip Triton's argument binder.
"flashgen_graph" is the same call captured in a CUDA graph and replayed, as a serving loop may
run decode: no host work at all between steps.

Rows: {case, mode, <provider>: {us, TBps} | {error}, ratio_vs_<anchor>: anchor us / flashgen us,
graph_ratio_vs_<anchor>: the same for flashgen_graph}.
TBps = the cache bytes the call must read (K and V of every batch element) / time. Writes
<date>-<gpu>-decode.json and .md into --out.

--fp8 (issue 17): the FP8 KV cache. Rows B=8 KV8192, B=64 KV4096, B=1 KV131072 and paged-16
(B=8 KV8192): "flashgen" is the bf16 cache as above, "flashgen_fp8" the same keys and values
quantized to float8_e4m3fn (flashgen.quantize_fp8: per (batch, KV head) descales, flash-attn 3's
k_descale / v_descale) through flash_attn_with_kvcache with bf16 queries, checked against SDPA
on the dequantized cache. TBps counts each provider's own cache bytes (FP8: 1 byte per element),
ratio_vs_bf16 = flashgen (bf16 cache) us / flashgen_fp8 us, tbps_ratio_vs_bf16 = FP8 TB/s / bf16
TB/s (the issue's "Done when": >= 1), ratio_vs_<anchor> = anchor us / flashgen_fp8 us (the
anchors, SDPA flash and cuDNN, read the bf16 cache: they have no FP8-cache decode; Flex is in
the bf16 table). Both flashgen columns are also timed by clean_ms (L2 emptied by a read, not
do_bench's write: see --ceiling), tbps_ratio_vs_bf16_clean_l2. Writes <date>-<gpu>-decode-fp8.*.

--ceiling: load-only kernels over the rows' caches (bf16, e4m3): what reading them can reach.

    PYTHONPATH=. python3 benchmarks/bench_decode.py --out benchmarks/results/
    PYTHONPATH=. python3 benchmarks/bench_decode.py --fp8 --out benchmarks/results/
    PYTHONPATH=. TRITON_INTERPRET=1 python3 benchmarks/bench_decode.py --smoke --out /tmp/x   # CPU, tiny
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flashgen  # noqa: E402
from flashgen import AttentionSpec  # noqa: E402
from flashgen.bench import environment, file_tag, gpu_tag  # noqa: E402
from flashgen.compat import flash_attn_with_kvcache  # noqa: E402
from flashgen.timing import time_ms, wall_ms  # noqa: E402

# (batch, q_len, KV length)
CASES = [(8, 1, 8192), (64, 1, 4096), (1, 1, 131072), (8, 16, 8192)]
PAGED = {"batch": 8, "q_len": 1, "kv": 8192, "page_sizes": (1, 16, 256)}
FP8_CASES = [(8, 1, 8192), (64, 1, 4096), (1, 1, 131072)]
FP8_PAGED = {"batch": 8, "q_len": 1, "kv": 8192, "page_sizes": (16,)}
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
ANCHORS = ("sdpa_flash", "sdpa_cudnn", "flex")
# The smoke run: the same code on the CPU interpreter at toy sizes (fp16: the interpreter's bf16 dot is wrong).
SMOKE_CASES = [(2, 1, 40), (1, 3, 33)]
SMOKE_PAGED = {"batch": 2, "q_len": 1, "kv": 40, "page_sizes": (1, 16)}
SMOKE_FP8_CASES = [(2, 1, 40)]
SMOKE_FP8_PAGED = {"batch": 2, "q_len": 1, "kv": 40, "page_sizes": (16,)}
SMOKE_HEADS = (4, 2, 16)
TOLERANCE = 3e-2  # max |out - check| for bf16/fp16 outputs of O(1)


def _sdpa(backend):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    def run(q, k, v):
        # q (B, H, Sq, D), k/v (B, H_kv, S, D) views of the cache
        mask = causal_lower_right(q.shape[2], k.shape[2]) if q.shape[2] > 1 else None
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return run


def _flex(q_len, kv):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    offset = kv - q_len
    mask = create_block_mask(lambda b, h, q, k: k <= q + offset, None, None, q_len, kv)
    return lambda q, k, v: compiled(q, k, v, block_mask=mask, enable_gqa=True)


def _graphed(fn):
    """fn captured in a CUDA graph and replayed, as a serving loop may run decode."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return lambda: (graph.replay(), out)[1]


FLUSH = {}  # device -> the buffer clean_ms reads between runs


def clean_ms(fn, rep=100):
    """Median milliseconds of fn() (CUDA events) with L2 emptied of fn's data by *reading* a
    256 MB buffer before each run. do_bench (time_ms) empties it by writing 256 MB: the L2's
    dirty lines (up to its 50 MB on an H100) are then written back to HBM while the timed kernel
    reads, a fixed cost (~15-20 us on an H100, see --ceiling) that weighs twice as much on an FP8
    cache's run (half the bytes, half the time) as on a bf16 one's. Reported beside time_ms. It also
    varies from one do_bench call to the next: the H200's FP8 B=8 x 8K row read 52 or 70 us by time_ms,
    42.1-42.6 by this (benchmarks/NOTES.md, session 45)."""
    device = torch.cuda.current_device()
    buf = FLUSH.get(device)
    if buf is None:
        buf = FLUSH[device] = torch.ones(64 << 20, dtype=torch.int32, device="cuda")
    for _ in range(10):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rep)]
    for start, end in events:
        buf.sum()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return float(torch.tensor([s.elapsed_time(e) for s, e in events]).median())


def _measure(row, name, fn, check, bytes_read, timer, graph=False, clean=False):
    if graph:
        try:
            fn = _graphed(fn)
        except Exception as exc:
            row[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
            return
    try:
        out = fn()
        err = (out.float() - check).abs().max().item()
        if not err < TOLERANCE:
            row[name] = {"error": f"max|out - check| = {err:.3g}"}
            return
        us = timer(fn) * 1e3
        row[name] = {"us": us, "TBps": bytes_read / (us * 1e-6) / 1e12, "max_err": err}
        if clean:
            us = clean_ms(fn) * 1e3
            row[name].update(us_clean=us, TBps_clean=bytes_read / (us * 1e-6) / 1e12)
    except Exception as exc:  # one failing provider must not end the run
        row[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}


def _ratios(row, flashgen_key, anchors, prefix=""):
    ours = (row.get(flashgen_key) or {}).get("us")
    timed = {a: row[a]["us"] for a in anchors if "us" in (row.get(a) or {})}
    for a in anchors:
        row[f"{prefix}ratio_vs_{a}"] = timed[a] / ours if ours and a in timed else None
    if timed and ours:
        row[f"{prefix}ratio_vs_fastest"] = min(timed.values()) / ours


def _fp8_cache(k_cache, v_cache):
    """The bf16 cache in float8_e4m3fn with per (batch, KV head) descales, and SDPA's check on its dequantized values."""
    k8, k_descale = flashgen.quantize_fp8(k_cache, layout="bshd")
    v8, v_descale = flashgen.quantize_fp8(v_cache, layout="bshd")
    deq = lambda x, d: (x.float() * d[:, None, :, None]).to(k_cache.dtype).transpose(1, 2)  # noqa: E731
    return k8, v8, k_descale, v_descale, deq(k8, k_descale), deq(v8, v_descale)


def _fp8_ratios(row):
    bf16, fp8 = (row.get("flashgen") or {}), (row.get("flashgen_fp8") or {})
    row["ratio_vs_bf16"] = bf16["us"] / fp8["us"] if "us" in bf16 and "us" in fp8 else None
    row["tbps_ratio_vs_bf16"] = fp8["TBps"] / bf16["TBps"] if "us" in bf16 and "us" in fp8 else None
    row["tbps_ratio_vs_bf16_clean_l2"] = fp8["TBps_clean"] / bf16["TBps_clean"] \
        if "TBps_clean" in bf16 and "TBps_clean" in fp8 else None


def bench_case(batch, q_len, kv, *, heads, kv_heads, head_dim, dtype, device, smoke, timer, fp8=False):
    gen = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    q = randn(batch, q_len, heads, head_dim)
    k_cache, v_cache = randn(batch, kv, kv_heads, head_dim), randn(batch, kv, kv_heads, head_dim)
    seqlens = torch.full((batch,), kv, dtype=torch.int32, device=device)
    bytes_read = 2 * batch * kv * kv_heads * head_dim * k_cache.element_size()
    row = {"case": f"B={batch} q_len={q_len} KV={kv}", "mode": "contiguous", "batch": batch, "q_len": q_len,
           "kv": kv}
    qh, kh, vh = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    check = _sdpa(None if smoke else torch.nn.attention.SDPBackend.FLASH_ATTENTION)(qh, kh, vh).transpose(1, 2)
    check = check.float()
    spec = AttentionSpec(name="decode", dtype={torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype],
                         head_dim=head_dim, num_heads=heads, num_kv_heads=kv_heads, causal=True, backward=False)
    kernel = flashgen.compile(spec)
    clean = fp8 and not smoke  # the FP8 table also times with a read flush (clean_ms)
    m = lambda name, fn, graph=False: _measure(row, name, fn, check, bytes_read, timer, graph, clean)  # noqa: E731
    compat = lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)  # noqa: E731
    m("flashgen", compat)
    if fp8:  # the same cache in FP8: flashgen's FP8 path against its own check, its own bytes
        k8, v8, k_descale, v_descale, kd, vd = _fp8_cache(k_cache, v_cache)
        fp8_check = _sdpa(None if smoke else torch.nn.attention.SDPBackend.FLASH_ATTENTION)(qh, kd, vd)
        _measure(row, "flashgen_fp8", lambda: flash_attn_with_kvcache(
            q, k8, v8, cache_seqlens=seqlens, causal=True, k_descale=k_descale, v_descale=v_descale),
            fp8_check.transpose(1, 2).float(), bytes_read // k_cache.element_size(), timer, clean=clean)
        _fp8_ratios(row)
    else:
        m("flashgen_native", lambda: flashgen.decode(kernel, q, k_cache, v_cache, seqlens))
    if not smoke and not fp8:
        m("flashgen_graph", compat, graph=True)
    if smoke:
        m("sdpa_math", lambda: _sdpa(None)(qh, kh, vh).transpose(1, 2))
    else:
        backends = torch.nn.attention.SDPBackend
        m("sdpa_flash", lambda: _sdpa(backends.FLASH_ATTENTION)(qh, kh, vh).transpose(1, 2))
        m("sdpa_cudnn", lambda: _sdpa(backends.CUDNN_ATTENTION)(qh, kh, vh).transpose(1, 2))
        try:
            if not fp8:  # the FP8 table's anchors are SDPA's (Flex, compiled per case, is in the bf16 table)
                flex = _flex(q_len, kv)
                m("flex", lambda: flex(qh, kh, vh).transpose(1, 2))
        except Exception as exc:
            row["flex"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    _ratios(row, "flashgen_fp8" if fp8 else "flashgen", ("sdpa_math",) if smoke else ANCHORS)
    if not smoke and not fp8:
        _ratios(row, "flashgen_graph", ANCHORS, prefix="graph_")
    return row, (q, k_cache, v_cache, seqlens, check, bytes_read)


def _paged(cache, table, page_size):
    """A contiguous cache (batch, kv, heads, dim) in pages (pages, page_size, heads, dim) at the block table's pages."""
    batch, kv = cache.shape[:2]
    pages = torch.zeros((table.numel(), page_size, *cache.shape[2:]), dtype=torch.float32, device=cache.device)
    j = torch.arange(kv, device=cache.device)
    for b in range(batch):
        pages[table[b, j // page_size].long(), j % page_size] = cache[b].float()
    return pages.to(cache.dtype)


def bench_paged(page_size, contiguous_row, inputs, *, timer, smoke, fp8=False):
    """The contiguous case's inputs in a paged cache (shuffled pages) against the contiguous call."""
    q, k_cache, v_cache, seqlens, check, bytes_read = inputs
    batch, kv = k_cache.shape[:2]
    per_seq = -(-kv // page_size)
    gen = torch.Generator().manual_seed(1)
    table = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq).to(torch.int32).to(q.device)
    k_pages, v_pages = _paged(k_cache, table, page_size), _paged(v_cache, table, page_size)
    row = {"case": contiguous_row["case"], "mode": f"paged-{page_size}", "page_size": page_size}
    if fp8:
        k8, v8, k_descale, v_descale, kd, vd = _fp8_cache(k_cache, v_cache)
        k8, v8 = _paged(k8, table, page_size), _paged(v8, table, page_size)
        fp8_check = _sdpa(None if smoke else torch.nn.attention.SDPBackend.FLASH_ATTENTION)(
            q.transpose(1, 2), kd, vd).transpose(1, 2).float()
        _measure(row, "flashgen_fp8", lambda: flash_attn_with_kvcache(
            q, k8, v8, cache_seqlens=seqlens, block_table=table, causal=True, k_descale=k_descale,
            v_descale=v_descale), fp8_check, bytes_read // k_cache.element_size(), timer, clean=fp8 and not smoke)
    paged = lambda: flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens,  # noqa: E731
                                            block_table=table, causal=True)
    _measure(row, "flashgen", paged, check, bytes_read, timer, clean=fp8 and not smoke)
    if fp8:
        _fp8_ratios(row)
        return row
    if not smoke:
        _measure(row, "flashgen_graph", paged, check, bytes_read, timer, graph=True)
        contiguous, ours = (contiguous_row.get("flashgen_graph") or {}).get("us"), row["flashgen_graph"].get("us")
        row["graph_ratio_vs_flashgen_contiguous"] = contiguous / ours if contiguous and ours else None
    row["flashgen_contiguous"] = contiguous_row.get("flashgen")
    contiguous_us = (contiguous_row.get("flashgen") or {}).get("us")
    paged_us = (row.get("flashgen") or {}).get("us")
    row["ratio_vs_flashgen_contiguous"] = contiguous_us / paged_us if contiguous_us and paged_us else None
    return row


# --variants: the default knobs beside explicit ones through flashgen.decode, in one process, for
# the split rows (issue 14's B=8 KV8192 and B=1 KV131072, B=8 paged-16). Each case's variants run
# REPEATS rounds, interleaved (every variant once per round, cuDNN last), so a drift of the clock or
# the host shows in every variant alike. The default merges a split call's splits in the split
# kernel's last program (fused_combine, one launch per step; v6 measured it against the combine
# kernel, then the default); the variant is that combine kernel. The tile and split variants of
# v3 / v4 are in results/2026-11-23-h100-decode-variants-v3*, -v4.
VARIANT_CASES = {  # the defaults (first) against the knobs they replaced and their neighbours
    "bf16 B=8 KV8192": (8, 8192, False, None, [dict(fused_combine=False)]),
    "bf16 B=1 KV131072": (1, 131072, False, None, [dict(fused_combine=False)]),
    "bf16 B=8 KV8192 paged-16": (8, 8192, False, 16, [dict(fused_combine=False)]),
}
REPEATS = 3


def variants(timer, device="cuda", rows=None, cases=None, repeats=REPEATS):
    """Rows {case, knobs, repeat, flashgen: {us, TBps}} for VARIANT_CASES (the default knobs first,
    with the plan they resolve to), plus cuDNN on the contiguous bf16 rows; repeats rounds per
    case, interleaved. Then one summary row per variant: {case, knobs, median_us, ratio_vs_default}."""
    from flashgen.kvcache import decode_launcher

    rows = [] if rows is None else rows  # appended as measured: a run stopped by timeout keeps them
    spec = AttentionSpec(name="decode", dtype="bf16", head_dim=HEAD_DIM, num_heads=HEADS, num_kv_heads=KV_HEADS,
                         causal=True, backward=False)
    kernel = flashgen.compile(spec)
    launcher = decode_launcher(kernel)
    for name, (batch, kv, fp8, page, knob_sets) in (cases or VARIANT_CASES).items():
        gen = torch.Generator().manual_seed(0)
        randn = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)  # noqa
        q, k_cache, v_cache = (randn(batch, 1, HEADS, HEAD_DIM), randn(batch, kv, KV_HEADS, HEAD_DIM),
                               randn(batch, kv, KV_HEADS, HEAD_DIM))
        seqlens = torch.full((batch,), kv, dtype=torch.int32, device=device)
        qh, kh, vh = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        extra = {}
        if fp8:
            k_cache, v_cache, kd, vd, kh, vh = _fp8_cache(k_cache, v_cache)
            extra = dict(k_descale=kd, v_descale=vd)
        if page:
            table = torch.randperm(batch * (kv // page), generator=gen).view(batch, -1).to(torch.int32).to(device)
            k_cache, v_cache = _paged(k_cache, table, page), _paged(v_cache, table, page)
            extra["block_table"] = table
        check = _sdpa(torch.nn.attention.SDPBackend.FLASH_ATTENTION)(qh, kh, vh).transpose(1, 2).float()
        nbytes = 2 * batch * kv * KV_HEADS * HEAD_DIM * k_cache.element_size()
        gluon = launcher.fp8_gluon(q, k_cache, v_cache, {})  # (the plan an FP8 cache runs on sm90)
        plan = {n: launcher.plan(batch, 1, kv, q.device, {}, page, k_cache.element_size(), gluon)[n]
                for n in ("num_splits", "BLOCK_N", "num_stages", "num_warps", "fused_combine", "gluon")}
        timed = {}  # knobs -> its times
        for repeat in range(repeats):
            for knobs in [{}, *knob_sets]:
                row = {"case": name, "path": "-", "knobs": knobs or "default", "repeat": repeat}
                if not knobs:
                    row["plan"] = plan
                _measure(row, "flashgen", lambda: flashgen.decode(kernel, q, k_cache, v_cache, seqlens, **extra,
                                                                  **knobs), check, nbytes, timer)
                rows.append(row)
                timed.setdefault(str(knobs or "default"), []).append(row["flashgen"].get("us"))
                _print_variant(row)
            if not fp8 and not page:
                row = {"case": name, "path": "-", "knobs": "anchors", "repeat": repeat}
                _measure(row, "sdpa_cudnn", lambda: _sdpa(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)(
                    qh, kh, vh).transpose(1, 2), check, nbytes, timer)
                rows.append(row)
                timed.setdefault("cudnn", []).append(row["sdpa_cudnn"].get("us"))
                _print_variant(row)
        medians = {k: sorted(v)[len(v) // 2] for k, v in timed.items() if None not in v}
        for knobs, us in medians.items():
            base = medians.get("default")
            rows.append({"case": name, "knobs": knobs, "summary": True, "median_us": us, "TBps": nbytes / us / 1e6,
                         "ratio_vs_default": base / us if base else None})
            print(f"{name:<26} {knobs:<72} median {us:.1f} us ({nbytes / us / 1e6:.2f} TB/s)"
                  + (f", default / this {base / us:.3f}" if base else ""), flush=True)
        del q, k_cache, v_cache, qh, kh, vh, check, extra
    return rows


def _print_variant(r):  # as measured: a run cut short still shows what it timed
    cells = "  ".join(f"{p} {r[p]['us']:.1f} us ({r[p]['TBps']:.2f} TB/s)" if "us" in r[p] else
                      f"{p} {r[p]['error']}" for p in ("flashgen", "sdpa_cudnn", "flex") if p in r)
    print(f"{r['case']:<24} {str(r.get('plan', r['knobs'])):<72} {cells}", flush=True)


def conversion(timer, device="cuda"):
    """--conversion: what converting an FP8 cache costs alone. Kernels that read the B=64 KV4096
    cache (K and V: 268 MB in e4m3) and write it back converted (to bf16, to fp16, or copied as
    it is), beside a bf16 cache copied; rows {case, us, TBps (bytes read + written / time)}."""
    import triton
    import triton.language as tl

    @triton.jit
    def convert(X, Y, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.load(X + offs).to(Y.dtype.element_ty))

    n = 2 * 64 * 4096 * KV_HEADS * HEAD_DIM
    x8 = (torch.randn(n, device=device) * 8).to(torch.float8_e4m3fn)
    x16 = x8.to(torch.bfloat16)
    rows = []
    for name, src, dtype in (("e4m3 -> bf16", x8, torch.bfloat16), ("e4m3 -> fp16", x8, torch.float16),
                             ("e4m3 copy", x8, torch.float8_e4m3fn), ("bf16 copy", x16, torch.bfloat16)):
        out = torch.empty(n, dtype=dtype, device=device)
        fn = lambda: convert[(n // 4096,)](src, out, BLOCK=4096)  # noqa: E731
        fn()
        ok = torch.equal(out.float(), src.float())
        us = timer(fn) * 1e3
        nbytes = n * (src.element_size() + out.element_size())
        rows.append({"case": name, "us": us, "TBps": nbytes / (us * 1e-6) / 1e12, "exact": ok})
    return rows


CEILING_CASES = [  # (batch, KV length, cache dtype, KV heads per program, keys per tile, stages, splits)
    (64, 4096, "bf16", 1, 128, 3, 1), (64, 4096, "bf16", 1, 32, 2, 1), (64, 4096, "bf16", 8, 16, 3, 8),
    (64, 4096, "e4m3", 1, 128, 3, 1), (64, 4096, "e4m3", 1, 64, 3, 1), (64, 4096, "e4m3", 8, 32, 3, 8),
    (8, 8192, "bf16", 1, 64, 3, 2), (8, 8192, "e4m3", 1, 128, 3, 4),
    (1, 131072, "bf16", 1, 64, 3, 16), (1, 131072, "e4m3", 1, 128, 3, 32),
]


def ceiling(timer, device="cuda", cases=None, clean_timer=None):
    """--ceiling: how fast a decode row's cache (8 KV heads, head dim 128) can be read at all, in
    bf16 and in e4m3. A kernel that only loads K and V tiles (as int32 words, xor-folded so no
    conversion or product costs an instruction) with decode's grid: a program per (batch element,
    group of HEADS KV heads, split), BLOCK_N keys per tile; HEADS 1 reads what the decode kernel
    reads (one head's row: 256 bytes in bf16, 128 in e4m3, 2 or 1 KB apart), 8 whole rows. Plus a
    flat read of the B=64 cache's bytes. Each checked to read every word once (a sum), then timed
    by timer and clean_timer (default clean_ms). Rows {case, us, TBps, us_clean, TBps_clean}."""
    import triton
    import triton.language as tl

    @triton.jit
    def load_tiles(K, V, OUT, seqlen, stride_b, stride_n, groups, splits, WORDS: tl.constexpr,
                   BLOCK_N: tl.constexpr):
        pid = tl.program_id(0)
        split = pid % splits
        g = (pid // splits) % groups
        b = (pid // splits // groups).to(tl.int64)
        per = seqlen // splits
        offs_n = tl.arange(0, BLOCK_N)
        offs_w = tl.arange(0, WORDS)
        base = b * stride_b + g * WORDS + offs_w[None, :]
        acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.int32)
        for n in range(split * per, split * per + per, BLOCK_N):
            rows = (n + offs_n).to(tl.int64)[:, None] * stride_n
            acc += tl.load(K + base + rows) + tl.load(V + base + rows)  # int32, wrapping: the check's sum
        tl.store(OUT + pid, tl.sum(tl.sum(acc, 1), 0))

    @triton.jit
    def load_flat(X, OUT, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(OUT + tl.program_id(0), tl.sum(tl.load(X + offs), 0))

    def check(out, *inputs):  # every word read once: the programs' wrapped sums add up to the inputs' (mod 2^32)
        if (out.long().sum() - sum(x.long().sum() for x in inputs)).item() % (1 << 32):
            raise RuntimeError("ceiling: the load-only kernel did not read every word of the cache once")

    clean_timer = clean_timer or clean_ms
    rows = []
    for batch, kv, dtype, heads, block_n, stages, splits in cases or CEILING_CASES:
        elem = 2 if dtype == "bf16" else 1
        words_per_row = KV_HEADS * HEAD_DIM * elem // 4
        # words of 16 bits' range: the toy cases' int32 sums stay in range (Triton 3.6's interpreter raises where
        # one wraps); the large ones' may wrap on the GPU, which the check's sum mod 2^32 allows
        k = torch.randint(-2**15, 2**15, (batch, kv, words_per_row), dtype=torch.int32, device=device)
        v = torch.randint_like(k, -2**15, 2**15)
        groups = KV_HEADS // heads
        out = torch.empty(batch * groups * splits, dtype=torch.int32, device=device)
        fn = lambda: load_tiles[(out.numel(),)](k, v, out, kv, k.stride(0), k.stride(1), groups, splits,  # noqa
                                                 WORDS=words_per_row // groups, BLOCK_N=block_n, num_warps=4,
                                                 num_stages=stages)
        fn()
        check(out, k, v)
        us, us_clean = timer(fn) * 1e3, clean_timer(fn) * 1e3
        nbytes = 2 * k.numel() * 4
        rows.append({"case": f"B={batch} KV={kv} {dtype}, {heads} head(s) x {splits} split(s) per program, "
                             f"{block_n} x {stages}", "us": us,
                     "TBps": nbytes / (us * 1e-6) / 1e12, "us_clean": us_clean,
                     "TBps_clean": nbytes / (us_clean * 1e-6) / 1e12})
        _print_ceiling(rows[-1])
        if heads == 1 and block_n == 128 and batch == 64:
            flat = torch.cat([k.view(-1), v.view(-1)])
            fout = torch.empty(flat.numel() // 4096, dtype=torch.int32, device=device)
            ffn = lambda: load_flat[(fout.numel(),)](flat, fout, BLOCK=4096)  # noqa: E731
            ffn()
            check(fout, flat)
            us, us_clean = timer(ffn) * 1e3, clean_timer(ffn) * 1e3
            rows.append({"case": f"B={batch} KV={kv} {dtype} flat", "us": us, "TBps": nbytes / (us * 1e-6) / 1e12, "us_clean": us_clean,
                         "TBps_clean": nbytes / (us_clean * 1e-6) / 1e12})
            _print_ceiling(rows[-1])
            del flat, fout
        del k, v
    return rows


def _print_ceiling(r):
    print(f"ceiling {r['case']:<62} {r['us']:.1f} us ({r['TBps']:.2f} TB/s); clean L2 {r['us_clean']:.1f} us "
          f"({r['TBps_clean']:.2f} TB/s)", flush=True)


def markdown(rows, env):
    providers = ["flashgen", "flashgen_fp8", "flashgen_native", "flashgen_graph", *ANCHORS, "sdpa_math"]
    providers = [p for p in providers if any(p in r for r in rows)]
    ratios = sorted({key for r in rows for key in r if key.startswith(("ratio_vs_", "tbps_ratio_vs_"))})
    lines = [f"GPU: {env.get('gpu', 'none (CPU interpreter)')} | torch {env['torch']} | triton {env['triton']} | "
             f"flashgen {env['flashgen']} | {time.strftime('%Y-%m-%d')}", "",
             "Each cell: microseconds (cache TB/s). Ratios: anchor time / flashgen time (> 1: flashgen faster)"
             + ("; with an FP8 cache: anchor (bf16 cache) / flashgen_fp8, ratio_vs_bf16 = flashgen (bf16 cache) / "
                "flashgen_fp8, tbps_ratio_vs_bf16 = FP8 cache TB/s (1 byte per element) / bf16 cache TB/s."
                if any("flashgen_fp8" in r for r in rows) else "."), "",
             "| case | mode | " + " | ".join(providers) + " | " + " | ".join(ratios) + " |",
             "|---" * (2 + len(providers) + len(ratios)) + "|"]

    def cell(x):
        if not x:
            return "-"
        if "us" not in x:
            return "err"
        clean = f"; clean L2 {x['us_clean']:.1f} ({x['TBps_clean']:.2f})" if "us_clean" in x else ""
        return f"{x['us']:.1f} ({x['TBps']:.2f}{clean})"

    for r in rows:
        vals = [cell(r.get(p)) for p in providers]
        rs = [f"{r[k]:.2f}" if r.get(k) else "-" for k in ratios]
        lines.append(f"| {r['case']} | {r['mode']} | " + " | ".join(vals) + " | " + " | ".join(rs) + " |")
    errors = [f"- {r['case']} {r['mode']} {p}: {r[p]['error']}" for r in rows for p in providers
              if isinstance(r.get(p), dict) and "error" in r[p]]
    if errors:
        lines += ["", "Errors:", *errors]
    return "\n".join(lines) + "\n"


def table_rows(rows, cases, paged, kw, smoke):
    """The table's rows, appended to rows as measured: each case, then the paged modes at the paged case's inputs."""
    paged_inputs = None
    for batch, q_len, kv in cases:
        t0 = time.time()
        row, inputs = bench_case(batch, q_len, kv, **kw)
        rows.append(row)
        if (batch, q_len, kv) == (paged["batch"], paged["q_len"], paged["kv"]):
            paged_inputs = (row, inputs)
        print(f"{row['case']}: {time.time() - t0:.0f}s", flush=True)
    if paged_inputs is None:
        row, inputs = bench_case(paged["batch"], paged["q_len"], paged["kv"], **kw)
        rows.append(row)
        paged_inputs = (row, inputs)
    for page_size in paged["page_sizes"]:
        rows.append(bench_paged(page_size, *paged_inputs, timer=kw["timer"], smoke=smoke, fp8=kw["fp8"]))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU interpreter (TRITON_INTERPRET=1)")
    ap.add_argument("--fp8", action="store_true", help="the FP8 KV cache against the bf16 one (issue 17)")
    ap.add_argument("--variants", action="store_true",
                    help="knob variants of the split rows: B=8 KV8192, B=1 KV131072, B=8 paged (GPU)")
    ap.add_argument("--conversion", action="store_true", help="FP8 conversion kernels alone (GPU)")
    ap.add_argument("--ceiling", action="store_true", help="load-only kernels over the B=64 cache, bf16 and e4m3 (GPU)")
    ap.add_argument("--skip-table", action="store_true", help="only --conversion / --ceiling / --variants")
    ap.add_argument("--fused-combine", action="store_true",
                    help="the table with split calls merged in the split kernel (decode.FUSED_COMBINE = True)")
    ap.add_argument("--tag", default="", type=file_tag,
                    help="file name suffix: v2 writes 2026-11-23-h100-decode-fp8-v2")
    args = ap.parse_args(argv)
    from flashgen.runtime import decode as host_decode
    if args.fused_combine:
        host_decode.FUSED_COMBINE = True
    env = dict(environment(), decode_fused_combine=host_decode.FUSED_COMBINE)
    if args.smoke and args.fp8:
        cases, paged, (heads, kv_heads, head_dim) = SMOKE_FP8_CASES, SMOKE_FP8_PAGED, SMOKE_HEADS
        dtype, device, timer = torch.float16, "cuda" if torch.cuda.is_available() else "cpu", wall_ms
    elif args.fp8:
        cases, paged, (heads, kv_heads, head_dim) = FP8_CASES, FP8_PAGED, (HEADS, KV_HEADS, HEAD_DIM)
        dtype, device, timer = torch.bfloat16, "cuda", time_ms
    elif args.smoke:
        cases, paged, (heads, kv_heads, head_dim) = SMOKE_CASES, SMOKE_PAGED, SMOKE_HEADS
        dtype, device, timer = torch.float16, "cuda" if torch.cuda.is_available() else "cpu", wall_ms
    else:
        cases, paged, (heads, kv_heads, head_dim) = CASES, PAGED, (HEADS, KV_HEADS, HEAD_DIM)
        dtype, device, timer = torch.bfloat16, "cuda", time_ms
    kw = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=device, smoke=args.smoke,
              timer=timer, fp8=args.fp8)
    gpu = gpu_tag(env)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    if not args.skip_table:
        # a run stopped by `timeout` (SIGTERM) still writes the rows it measured
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
        try:
            table_rows(rows, cases, paged, kw, args.smoke)
        finally:
            signal.signal(signal.SIGTERM, previous)
            stem = (f"{time.strftime('%Y-%m-%d')}-{gpu}-decode{'-fp8' if args.fp8 else ''}"
                    f"{'-smoke' if args.smoke else ''}{args.tag}")
            (out / f"{stem}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
            table = markdown(rows, env)
            (out / f"{stem}.md").write_text(table)
            print(table, flush=True)
    if args.conversion:
        found = conversion(time_ms)
        for r in found:
            print(f"conversion {r['case']:<14} {r['us']:.1f} us ({r['TBps']:.2f} TB/s read+written) exact={r['exact']}",
                  flush=True)
        (out / f"{time.strftime('%Y-%m-%d')}-{gpu}-decode-conversion.json").write_text(
            json.dumps({"environment": env, "rows": found}, indent=1))
    if args.ceiling:
        found = ceiling(time_ms)
        (out / f"{time.strftime('%Y-%m-%d')}-{gpu}-decode-ceiling{args.tag}.json").write_text(
            json.dumps({"environment": env, "rows": found}, indent=1))
    if args.variants:  # after the table, in the same process; written even when stopped by `timeout`
        found = []
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
        try:
            variants(time_ms, rows=found)
        finally:
            signal.signal(signal.SIGTERM, previous)
            (out / f"{time.strftime('%Y-%m-%d')}-{gpu}-decode-variants{args.tag}.json"
             ).write_text(json.dumps({"environment": env, "rows": found}, indent=1))
    return rows


if __name__ == "__main__":
    main()
