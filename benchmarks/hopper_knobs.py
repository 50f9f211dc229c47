"""The Hopper knobs of the forward, measured: tile configs x {plain, TMA, TMA + warp
specialization, warp specialization alone}, beside SDPA flash/cuDNN and FlexAttention in
the same run (bench_forward's cases and checks). Prints, per case, the best TFLOP/s of each
Hopper mode and writes hopper_knobs.json / .md to --out.

    PYTHONPATH=. python3 benchmarks/hopper_knobs.py --seqlens 4096 --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_forward import bench_case  # noqa: E402

from flashgen import KernelConfig  # noqa: E402
from flashgen.bench import environment  # noqa: E402

TILES = {
    64: [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (256, 64, 8, 3), (256, 128, 16, 2)],
    128: [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3)],
}
MODES = {"plain": {}, "tma": {"tma": True}, "tma+ws": {"tma": True, "warp_specialize": True},
         "ws": {"warp_specialize": True}}


def mode_of(config: str) -> str:
    tma, ws = " tma" in config, "warp_specialize" in config
    return {(False, False): "plain", (True, False): "tma", (True, True): "tma+ws", (False, True): "ws"}[(tma, ws)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--seqlens", default="4096")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    args = ap.parse_args()
    env = environment()
    rows, lines = [], []
    for head_dim in map(int, args.head_dims.split(",")):
        sweep = [KernelConfig(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s, **knobs)
                 for (m, n, w, s) in TILES[head_dim] for knobs in MODES.values()]
        for causal in (bool(int(c)) for c in args.causal.split(",")):
            for seqlen in map(int, args.seqlens.split(",")):
                t0 = time.time()
                row = bench_case(head_dim, causal, seqlen, args.tokens, args.hidden, sweep, kv_outer=False)
                best = {}
                for r in row["sweep"]:
                    m = mode_of(r["config"])
                    if "tflops" in r and r["tflops"] > best.get(m, {}).get("tflops", 0):
                        best[m] = r
                row["best_by_mode"] = best
                rows.append(row)
                anchors = {a: (row.get(a) or {}).get("tflops") for a in ("sdpa_flash", "sdpa_cudnn", "flex")}
                line = (f"| hd{head_dim} S={seqlen}{' causal' if causal else ''} | "
                        + " | ".join(f"{anchors[a]:.0f}" if anchors[a] else "err" for a in anchors) + " | "
                        + " | ".join(f"{best[m]['tflops']:.0f} ({best[m]['config']})" if m in best else "err"
                                     for m in MODES) + " |")
                lines.append(line)
                errors = [f"{r['config']}: {r['error']}" for r in row["sweep"] if "error" in r]
                print(line, f"{time.time() - t0:.0f}s", *errors[:3], sep="\n", flush=True)
    head = (f"GPU: {env.get('gpu')} | torch {env['torch']} | triton {env['triton']} | {time.strftime('%Y-%m-%d')}\n\n"
            "| case | sdpa_flash | sdpa_cudnn | flex | " + " | ".join(MODES) + " |\n" + "|---" * (4 + len(MODES)) + "|")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hopper_knobs.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    (out / "hopper_knobs.md").write_text(head + "\n" + "\n".join(lines) + "\n")
    print(head, *lines, sep="\n")


if __name__ == "__main__":
    main()
