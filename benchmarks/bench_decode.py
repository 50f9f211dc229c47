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
anchors read the bf16 cache: they have no FP8-cache decode). Writes <date>-<gpu>-decode-fp8.*.

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
from flashgen.bench import environment  # noqa: E402
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


def _measure(row, name, fn, check, bytes_read, timer, graph=False):
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
    m = lambda name, fn, graph=False: _measure(row, name, fn, check, bytes_read, timer, graph)  # noqa: E731
    compat = lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)  # noqa: E731
    m("flashgen", compat)
    if fp8:  # the same cache in FP8: flashgen's FP8 path against its own check, its own bytes
        k8, v8, k_descale, v_descale, kd, vd = _fp8_cache(k_cache, v_cache)
        fp8_check = _sdpa(None if smoke else torch.nn.attention.SDPBackend.FLASH_ATTENTION)(qh, kd, vd)
        _measure(row, "flashgen_fp8", lambda: flash_attn_with_kvcache(
            q, k8, v8, cache_seqlens=seqlens, causal=True, k_descale=k_descale, v_descale=v_descale),
            fp8_check.transpose(1, 2).float(), bytes_read // k_cache.element_size(), timer)
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
            v_descale=v_descale), fp8_check, bytes_read // k_cache.element_size(), timer)
    paged = lambda: flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens,  # noqa: E731
                                            block_table=table, causal=True)
    _measure(row, "flashgen", paged, check, bytes_read, timer)
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


# --variants: knob variants of the rows closest to an anchor (issue 14's B=64 KV4096 at 0.995x
# Flex), and of the FP8 cache, each timed through flashgen.decode with explicit knobs beside the
# default in one process. FP8 rows also compare how the cache's tiles reach the tensor cores
# (FP8_PATHS; runtime/decode.py's fp16_dot and fp8_v_conversion): "bf16-cast" (the tiles cast to
# bf16, the kernel before fp16_dot), "fp16-cast" (fp16 products, V cast: Triton reads V's tile
# into the operand layout one byte per instruction) and "fp16-asm" (the default: V converted
# by _fp8_tile_to_fp16 first).
FP8_PATHS = {"bf16-cast": (False, 0), "fp16-cast": (True, 0), "fp16-asm": (True, None)}
VARIANT_CASES = {
    "bf16 B=64 KV4096": (64, 4096, False, None, [dict(BLOCK_N=128, num_warps=2), dict(BLOCK_N=64, num_stages=5),
                                                dict(BLOCK_N=128, num_stages=2)]),
    "fp8 B=8 KV8192": (8, 8192, True, None, [dict(BLOCK_N=64, num_stages=4), dict(BLOCK_N=128, num_stages=3),
                                            dict(BLOCK_N=128, num_stages=5), dict(BLOCK_N=256, num_stages=2),
                                            dict(num_splits=1), dict(num_splits=3), dict(num_splits=4),
                                            dict(num_warps=8)]),
    "fp8 B=64 KV4096": (64, 4096, True, None, [dict(BLOCK_N=128, num_stages=2), dict(BLOCK_N=128, num_stages=4),
                                              dict(BLOCK_N=64, num_stages=3), dict(BLOCK_N=64, num_stages=4),
                                              dict(BLOCK_N=256, num_stages=2), dict(num_warps=8),
                                              dict(num_splits=2)]),
    "fp8 B=1 KV131072": (1, 131072, True, None, [dict(num_splits=8), dict(num_splits=24), dict(num_splits=32),
                                                dict(BLOCK_N=64, num_stages=4), dict(BLOCK_N=128, num_stages=3),
                                                dict(BLOCK_N=256, num_stages=2)]),
    "fp8 B=8 KV8192 paged-16": (8, 8192, True, 16, [dict(BLOCK_N=64, num_stages=4), dict(BLOCK_N=128, num_stages=3),
                                                   dict(BLOCK_N=128, num_stages=5), dict(num_splits=4)]),
}


class _Fp8Path:
    """Within the block, decode calls convert an FP8 cache by one of FP8_PATHS (the launcher's
    prepared calls are dropped on entry and exit: the path is a constexpr of their kernels)."""

    def __init__(self, launcher, path):
        self.launcher, (self.dot, self.v) = launcher, FP8_PATHS[path]

    def __enter__(self):
        import flashgen.runtime.decode as rd
        self.saved = rd.fp16_dot, rd.fp8_v_conversion
        if self.v is not None:
            dot, conv = self.dot, self.v
            rd.fp16_dot = lambda cache_dtype, out_dtype: dot and self.saved[0](cache_dtype, out_dtype)
            rd.fp8_v_conversion = lambda cache_dtype, out_dtype, device: conv
        self.launcher.calls.clear()

    def __exit__(self, *exc):
        import flashgen.runtime.decode as rd
        rd.fp16_dot, rd.fp8_v_conversion = self.saved
        self.launcher.calls.clear()


def variants(timer, device="cuda"):
    """Rows {case, path, knobs, flashgen: {us, TBps}} for VARIANT_CASES (default knobs first; FP8
    rows under each of FP8_PATHS at the default knobs, the knob variants under the default path),
    plus cuDNN on the bf16 rows."""
    from flashgen.kvcache import decode_launcher

    rows = []
    spec = AttentionSpec(name="decode", dtype="bf16", head_dim=HEAD_DIM, num_heads=HEADS, num_kv_heads=KV_HEADS,
                         causal=True, backward=False)
    kernel = flashgen.compile(spec)
    launcher = decode_launcher(kernel)
    for name, (batch, kv, fp8, page, knob_sets) in VARIANT_CASES.items():
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
        runs = [("fp16-asm" if fp8 else "-", {})]
        if fp8:
            runs += [("bf16-cast", {}), ("fp16-cast", {})]
        runs += [("fp16-asm" if fp8 else "-", knobs) for knobs in knob_sets]
        for path, knobs in runs:
            row = {"case": name, "path": path, "knobs": knobs or "default"}
            with _Fp8Path(launcher, path if fp8 else "fp16-asm"):
                _measure(row, "flashgen", lambda: flashgen.decode(kernel, q, k_cache, v_cache, seqlens, **extra,
                                                                  **knobs), check, nbytes, timer)
            rows.append(row)
            _print_variant(row)
        if not fp8:
            backends = torch.nn.attention.SDPBackend
            row = {"case": name, "path": "-", "knobs": "anchors"}
            _measure(row, "sdpa_cudnn", lambda: _sdpa(backends.CUDNN_ATTENTION)(qh, kh, vh).transpose(1, 2), check,
                     nbytes, timer)
            rows.append(row)
            _print_variant(row)
    return rows


def _print_variant(r):  # as measured: a run cut short still shows what it timed
    cells = "  ".join(f"{p} {r[p]['us']:.1f} us ({r[p]['TBps']:.2f} TB/s)" if "us" in r[p] else
                      f"{p} {r[p]['error']}" for p in ("flashgen", "sdpa_cudnn", "flex") if p in r)
    print(f"{r['case']:<24} {r['path']:<10} {str(r['knobs']):<34} {cells}", flush=True)


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
        return f"{x['us']:.1f} ({x['TBps']:.2f})" if "us" in x else "err"

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
    ap.add_argument("--variants", action="store_true", help="knob variants of B=64 KV4096 and the FP8 cache (GPU)")
    ap.add_argument("--conversion", action="store_true", help="FP8 conversion kernels alone (GPU)")
    ap.add_argument("--skip-table", action="store_true", help="only --conversion / --variants")
    ap.add_argument("--tag", default="", help="appended to the results' file names (2026-11-23-h100-decode-fp8-v2)")
    args = ap.parse_args(argv)
    env = environment()
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
    gpu = env.get("gpu", "cpu").lower().replace("nvidia ", "").split()[0] if env.get("gpu") else "cpu"
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
                    f"{'-smoke' if args.smoke else ''}{'-' + args.tag if args.tag else ''}")
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
    if args.variants:  # after the table, in the same process
        found = variants(time_ms)
        (out / f"{time.strftime('%Y-%m-%d')}-{gpu}-decode-variants.json").write_text(
            json.dumps({"environment": env, "rows": found}, indent=1))
    return rows


if __name__ == "__main__":
    main()
