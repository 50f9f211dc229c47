"""Host time of one eager decode call, on a machine with no GPU: flashgen's checks, planning,
allocations and Triton's binder, with the launch mocked (tests/sm90_compile.py's sm90 driver:
the kernels compile once for an H100, then each launch returns at once). Run with --profile
for cProfile's top entries of one case.

    PYTHONPATH=. python3 benchmarks/decode_host.py [--profile CASE]

The shapes are bench_decode.py's (bf16, 32 q heads / 8 KV heads, head dim 128), with a smaller
cache (the host path depends on shapes, not on the cache's contents).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import sm90_compile  # noqa: E402
import triton.runtime.jit as jit  # noqa: E402
from triton.runtime import driver  # noqa: E402


def cases():
    import flashgen
    from flashgen import AttentionSpec
    from flashgen.compat import flash_attn_with_kvcache

    heads, kv_heads, dim, kv, dtype = 32, 8, 128, 8192, torch.bfloat16
    spec = AttentionSpec(dtype="bf16", head_dim=dim, num_heads=heads, num_kv_heads=kv_heads, causal=True)
    kernel = flashgen.compile(spec)
    out = {}
    for batch, q_len in ((8, 1), (64, 1), (8, 16)):
        q = torch.randn(batch, q_len, heads, dim, dtype=dtype)
        k_cache = torch.empty(batch, kv, kv_heads, dim, dtype=dtype)
        seqlens = torch.full((batch,), kv, dtype=torch.int32)
        name = f"B={batch} q{q_len} KV{kv}"
        out[f"{name} compat"] = (lambda q=q, c=k_cache, s=seqlens: flash_attn_with_kvcache(
            q, c, c, cache_seqlens=s, causal=True))
        out[f"{name} native"] = lambda q=q, c=k_cache, s=seqlens: flashgen.decode(kernel, q, c, c, s)
    batch, q = 8, torch.randn(8, 1, heads, dim, dtype=dtype)
    seqlens = torch.full((batch,), kv, dtype=torch.int32)
    for page in (1, 16, 256):
        per_seq = kv // page
        table = torch.randperm(batch * per_seq).view(batch, per_seq).to(torch.int32)
        pages = torch.empty(batch * per_seq, page, kv_heads, dim, dtype=dtype)
        out[f"paged-{page} compat"] = (lambda p=pages, t=table: flash_attn_with_kvcache(
            q, p, p, cache_seqlens=seqlens, block_table=t, causal=True))
    # an FP8 cache with flash-attn 3's descales (issue 17)
    fp8 = torch.empty(batch, kv, kv_heads, dim, dtype=torch.float8_e4m3fn)
    scale = torch.ones(batch, kv_heads)
    out["B=8 q1 KV8192 fp8 compat"] = lambda: flash_attn_with_kvcache(q, fp8, fp8, cache_seqlens=seqlens, causal=True,
                                                                       k_descale=scale, v_descale=scale)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="a case name: print cProfile's top entries for it")
    parser.add_argument("-n", type=int, default=200, help="calls per repeat")
    parser.add_argument("--repeat", type=int, default=5, help="repeats per case (the least is printed)")
    args = parser.parse_args(argv)
    driver.set_active(sm90_compile.Sm90Driver())
    jit.JITFunction.run = sm90_compile._compile_only(jit.JITFunction.run)
    # The bound launches (flashgen/runtime/launch.py's BoundLaunch) call the compiled kernel's
    # launcher: here a no-op, so what is timed is flashgen's host work up to the launcher's call.
    from triton.compiler.compiler import CompiledKernel
    CompiledKernel.run = property(lambda self: (lambda *args: None))
    import flashgen.runtime.host as host
    host.interpreting = lambda: True  # accept CPU tensors: nothing is launched
    for name, call in cases().items():
        if args.profile and args.profile != name:
            continue
        call()
        call()
        if args.profile:
            profile = cProfile.Profile()
            profile.runcall(lambda: [call() for _ in range(args.n)])
            pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
            continue
        best = float("inf")
        for _ in range(args.repeat):  # the least of a few repeats: the machine may be shared
            t0 = time.perf_counter()
            for _ in range(args.n):
                call()
            best = min(best, (time.perf_counter() - t0) / args.n)
        print(f"{name}: {best * 1e6:.0f} us per call", flush=True)


if __name__ == "__main__":
    main()
