"""FP8-cache decode: the Gluon kernel's tiles, warps, stages and splits against its plan's (issue 17's decode
bytes/s; benchmarks/NOTES.md, session 66). Each variant runs in a child process of its own (the plan's tile is
class data, patched at the child's start), in interleaved rounds; each child times the bench_decode FP8 rows
(32 / 8 heads, hd128, one query, e4m3 with descales) by do_bench and with a clean L2, after checking the output
against SDPA on the dequantized cache; the default's child also times the bf16 cache. H200 only so far.

    PYTHONPATH=. python3 benchmarks/probe_decode_fp8_tiles.py --rounds 2 [--only default,256x4w] > rows.json
"""
import json
import os
import subprocess
import sys

VARIANTS = {  # name: (BLOCK_N, num_warps, STAGES or None (the plan's), split multiplier); None: the plan
    "default": None,
    "128x8w": (128, 8, None, 1),
    "256x8w": (256, 8, 2, 1),
    "64x4w": (64, 4, None, 1),
    "128x8w_s4": (128, 8, 4, 1),
    "128x4w_split2": (128, 4, None, 2),
    "256x4w": (256, 4, 2, 1),
}
CASES = [(8, 8192, None), (64, 4096, None), (1, 131072, None), (8, 8192, 16)]


def child():
    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from flashgen.runtime.decode import DecodeLauncher
    from flashgen.compat import flash_attn_with_kvcache
    from flashgen.timing import time_ms
    from bench_decode import clean_ms, _fp8_cache, _paged

    name = os.environ["VARIANT"]
    v = VARIANTS[name]
    mult = 1
    if v is not None:
        block_n, warps, stages, mult = v
        DecodeLauncher.FP8_TILE = dict(BLOCK_N=block_n, num_warps=warps)
        orig = DecodeLauncher.plan

        def plan(self, *a, **kw):
            p = orig(self, *a, **kw)
            if p["gluon"] and stages:
                p = dict(p, STAGES=stages, num_stages=stages)
            return p
        DecodeLauncher.plan = plan
    rows = []
    for batch, kv, page in CASES:
        gen = torch.Generator().manual_seed(0)
        randn = lambda *s: torch.randn(*s, generator=gen).to(device="cuda", dtype=torch.bfloat16)  # noqa: E731
        q = randn(batch, 1, 32, 128)
        kc, vc = randn(batch, kv, 8, 128), randn(batch, kv, 8, 128)
        seqlens = torch.full((batch,), kv, dtype=torch.int32, device="cuda")
        k8, v8, kd, vd, kdq, vdq = _fp8_cache(kc, vc)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), kdq, vdq, enable_gqa=True).transpose(1, 2).float()
        table = None
        if page:
            per = -(-kv // page)
            table = torch.randperm(batch * per, generator=torch.Generator().manual_seed(1)).view(batch, per)
            table = table.to(torch.int32).cuda()
            k8, v8 = _paged(k8, table, page), _paged(v8, table, page)
        splits = 0
        if mult > 1:
            from flashgen.runtime.decode import num_splits_heuristic, MAX_SPLITS
            s = num_splits_heuristic(batch * 8, 132, -(-kv // 128)) or 1
            splits = min(s * mult, MAX_SPLITS)
        fn = lambda: flash_attn_with_kvcache(q, k8, v8, cache_seqlens=seqlens, block_table=table,  # noqa: E731
                                             causal=True, k_descale=kd, v_descale=vd, num_splits=splits)
        row = {"case": f"B={batch} KV={kv}" + (f" paged-{page}" if page else ""), "variant": name}
        try:
            out = fn()
            row["err"] = (out.float() - ref).abs().max().item()
            row["us"] = time_ms(fn) * 1e3
            row["us_clean"] = clean_ms(fn) * 1e3
            if name == "default":  # the bf16 cache's path, same process
                fb = lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True)  # noqa: E731
                row["bf16_us"] = time_ms(fb) * 1e3
                row["bf16_us_clean"] = clean_ms(fb) * 1e3
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
    print(json.dumps(rows))


def main():
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 2
    names = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else list(VARIANTS)
    allrows = []
    for r in range(rounds):
        for name in names:
            p = subprocess.run([sys.executable, __file__, "--child"], env=dict(os.environ, VARIANT=name),
                               capture_output=True, text=True, timeout=300)
            try:
                rows = json.loads(p.stdout.strip().splitlines()[-1])
            except Exception:
                rows = [{"variant": name, "error": (p.stderr or p.stdout)[-800:]}]
            for row in rows:
                row["round"] = r
                print(json.dumps(row), file=sys.stderr, flush=True)
            allrows += rows
    print(json.dumps(allrows, indent=1))


if __name__ == "__main__":
    child() if "--child" in sys.argv else main()
