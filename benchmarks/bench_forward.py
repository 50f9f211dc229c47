"""Forward attention on the GPU: flashgen beside SDPA (flash, cuDNN) and FlexAttention.

The standard table: bf16, 16384 tokens per batch, hidden 2048 (heads = 2048 / head dim),
head dims 64 and 128, causal and not, S = 1024, 4096, 16384. For each case flashgen runs
its default config, a small sweep of knobs (the best is reported as "flashgen best"),
and the FlashAttention-1 loop order. Every output is checked against SDPA's before it
is timed. Writes JSON and a markdown table to --out.

    PYTHONPATH=. python3 benchmarks/bench_forward.py --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flashgen  # noqa: E402
from flashgen import AttentionSpec, KernelConfig, default_config  # noqa: E402
from flashgen.bench import environment, flex_runner, sdpa_runner as sdpa  # noqa: E402
from flashgen.flops import attention_flops, tflops  # noqa: E402
from flashgen.timing import time_ms  # noqa: E402

SWEEP = [
    KernelConfig(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
    KernelConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    KernelConfig(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    # the Hopper knobs (benchmarks/hopper_knobs.py): tensor descriptors, warp specialization
    KernelConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, warp_specialize=True),
    KernelConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4, warp_specialize=True),
    KernelConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, tma=True),
    KernelConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4, tma=True, warp_specialize=True),
    KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, tma=True),
    KernelConfig(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, tma=True),
    KernelConfig(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, tma=True, warp_specialize=True),
]


def bench_case(head_dim, causal, seqlen, tokens, hidden, sweep, kv_outer):
    heads, batch = hidden // head_dim, max(1, tokens // seqlen)
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal=causal)
    spec = AttentionSpec(name="bench", dtype="bf16", head_dim=head_dim, num_heads=heads, causal=causal)
    row = {"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "batch": batch, "heads": heads}
    reference = sdpa(torch.nn.attention.SDPBackend.FLASH_ATTENTION)(q, k, v, causal).float()

    def measure(name, fn):
        try:
            out = fn()
            err = (out.float() - reference).abs().max().item()
            if not err < 3e-2:
                row[name] = {"error": f"max|out - sdpa_flash| = {err:.3g}"}
                return
            ms = time_ms(fn)
            row[name] = {"ms": ms, "tflops": tflops(flops, ms), "max_err": err}
        except Exception as exc:  # report and go on: one failing anchor must not end the run
            row[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}

    backends = torch.nn.attention.SDPBackend
    measure("sdpa_flash", lambda: sdpa(backends.FLASH_ATTENTION)(q, k, v, causal))
    measure("sdpa_cudnn", lambda: sdpa(backends.CUDNN_ATTENTION)(q, k, v, causal))
    flex = flex_runner(seqlen, causal)
    measure("flex", lambda: flex(q, k, v, causal))

    default = default_config(spec)
    measure("flashgen_default", lambda: flashgen.compile(spec, default)(q, k, v))
    row["flashgen_default"]["config"] = str(default)
    best = row["flashgen_default"] if "tflops" in row["flashgen_default"] else None
    for cfg in sweep:
        key = f"sweep:{cfg}"
        measure(key, lambda cfg=cfg: flashgen.compile(spec, cfg)(q, k, v))
        r = row.pop(key)
        r["config"] = str(cfg)
        row.setdefault("sweep", []).append(r)
        if "tflops" in r and (best is None or r["tflops"] > best["tflops"]):
            best = r
    row["flashgen_best"] = best
    if kv_outer:
        cfg = default_config(spec, hopper_ws=False).replace(loop_order="kv_outer", BLOCK_M=64, BLOCK_N=64,
                                                            num_warps=4, num_stages=2, tma=False, warp_specialize=False)
        measure("flashgen_kv_outer", lambda: flashgen.compile(spec, cfg)(q, k, v))
    return row


def markdown(rows, env):
    cols = ["sdpa_flash", "sdpa_cudnn", "flex", "flashgen_default", "flashgen_best"]
    lines = [f"GPU: {env.get('gpu')} | torch {env['torch']} | triton {env['triton']} | "
             f"flashgen {env['flashgen']} | {time.strftime('%Y-%m-%d')}", "",
             "| case | " + " | ".join(cols) + " | kv_outer (FA1) | best / flash | best / cudnn | best / flex | best config |",
             "|---" * (len(cols) + 6) + "|"]

    def tf(r, name):
        x = r.get(name) or {}
        return x.get("tflops")

    for r in rows:
        case = f"hd{r['head_dim']} S={r['seqlen']}{' causal' if r['causal'] else ''}"
        vals = [tf(r, c) for c in cols]
        best = tf(r, "flashgen_best")
        ratio = lambda a: f"{best / tf(r, a):.2f}" if best and tf(r, a) else "-"  # noqa: E731
        kv = tf(r, "flashgen_kv_outer")
        lines.append(f"| {case} | " + " | ".join(f"{v:.0f}" if v else "err" for v in vals)
                     + f" | {f'{kv:.0f}' if kv else '-'} | {ratio('sdpa_flash')} | {ratio('sdpa_cudnn')} | "
                       f"{ratio('flex')} | {(r.get('flashgen_best') or {}).get('config', '-')} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    env = environment()
    rows = []
    for head_dim in map(int, args.head_dims.split(",")):
        for causal in (False, True):
            for seqlen in map(int, args.seqlens.split(",")):
                t0 = time.time()
                rows.append(bench_case(head_dim, causal, seqlen, args.tokens, args.hidden,
                                       [] if args.no_sweep else SWEEP, kv_outer=seqlen == 4096))
                print(f"hd{head_dim} causal={causal} S={seqlen}: {time.time() - t0:.0f}s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "forward.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    table = markdown(rows, env)
    (out / "forward.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
