"""Decode under torch.compile against eager: flash_attn_with_kvcache in a step of 8 layers.

Each layer appends one token to its own bf16 cache and attends it (hd128, 32 query / 8 KV heads, causal),
the layer's output the next one's query. The same step eager and compiled (inductor, fullgraph=True,
dynamic=True), on the same inputs in one process: GPU time per step (triton's do_bench median), host time
per step (200 steps queued without a sync), the memory one step allocates past what it holds, and whether
the compiled step's outputs and caches equal eager's (the same kernels run: they must, to the bit). Results:
benchmarks/results/<date>-<gpu>-decode-compile.json and .md (rows: case, mode, eager/compiled timings,
ratio_vs_eager = eager time / compiled time). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = ((8, 8192), (64, 4096), (1, 131072))  # (batch, cache length)
LAYERS = 8


def run_case(batch, capacity, layers):
    import torch
    from triton.testing import do_bench

    from flashgen import compat

    def fresh(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    q, k_new, v_new = fresh(batch, 1, 32, 128), fresh(batch, 1, 8, 128), fresh(batch, 1, 8, 128)
    caches = [[fresh(batch, capacity, 8, 128), fresh(batch, capacity, 8, 128)] for _ in range(layers)]
    lengths = torch.randint(capacity // 2, capacity - 1, (batch,), device="cuda", dtype=torch.int32)

    def step(q, caches, k_new, v_new, lengths):
        x = q
        for k_cache, v_cache in caches:
            x = compat.flash_attn_with_kvcache(x, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=True)
        return x

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    start = [[c.clone() for c in pair] for pair in caches]
    got = compiled(q, caches, k_new, v_new, lengths)
    got_caches = [[c.clone() for c in pair] for pair in caches]
    for pair, saved in zip(caches, start):
        for c, s in zip(pair, saved):
            c.copy_(s)
    want = step(q, caches, k_new, v_new, lengths)
    equal = torch.equal(got, want) and all(torch.equal(a, b) for p, r in zip(got_caches, caches) for a, b in zip(p, r))
    del start, got_caches
    row = {"case": f"B={batch} KV {capacity}, {layers} layers", "mode": "decode step (append + attend)",
           "compiled_equals_eager": equal}
    for name, fn in (("eager", step), ("compiled", compiled)):
        fn(q, caches, k_new, v_new, lengths)
        torch.cuda.synchronize()
        row[f"{name}_us"] = round(do_bench(lambda: fn(q, caches, k_new, v_new, lengths), warmup=50, rep=300) * 1e3, 1)
        begin = time.perf_counter()
        for _ in range(200):
            fn(q, caches, k_new, v_new, lengths)
        row[f"{name}_host_us"] = round((time.perf_counter() - begin) / 200 * 1e6, 1)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
        fn(q, caches, k_new, v_new, lengths)
        torch.cuda.synchronize()
        row[f"{name}_step_alloc_mib"] = round((torch.cuda.max_memory_allocated() - held) / 2**20, 2)
    row["ratio_vs_eager"] = round(row["eager_us"] / row["compiled_us"], 3)
    return row


def markdown(rows, env):
    lines = [f"GPU: {env.get('gpu')} | torch {env['torch']} | triton {env['triton']}. {__doc__.splitlines()[0]}",
             "", "| case | eager us | compiled us | ratio_vs_eager | eager host us | compiled host us | "
             "step alloc MiB (eager / compiled) | equal |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['eager_us']} | {r['compiled_us']} | {r['ratio_vs_eager']} | "
                     f"{r['eager_host_us']} | {r['compiled_host_us']} | {r['eager_step_alloc_mib']} / "
                     f"{r['compiled_step_alloc_mib']} | {r['compiled_equals_eager']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    from flashgen.bench import environment, file_tag, gpu_tag

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="folder for the JSON and table")
    p.add_argument("--layers", type=int, default=LAYERS, help="decode calls per step")
    p.add_argument("--tag", type=file_tag, default="", help="file name suffix")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_decode_compile: needs a CUDA GPU")
    env = environment()
    env["date"] = datetime.date.today().isoformat()
    rows = []
    for batch, capacity in CASES:
        rows.append(run_case(batch, capacity, args.layers))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    stem = args.out / f"{env['date']}-{gpu_tag(env)}-decode-compile{args.tag}"
    args.out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(rows, env))
    print(markdown(rows, env))


if __name__ == "__main__":
    main()
