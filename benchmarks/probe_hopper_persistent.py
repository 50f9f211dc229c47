"""The Gluon forward's persistent grid (config knob hopper_persistent) against the one-tile grid.

H100/H200, bf16, 16384 tokens (hidden 2048: 16 heads at hd128, 32 at hd64), head dims 64 and
128, causal or not, S = 1024, 4096, 16384 (issue 18's standard table), forward only. Providers,
one process: cudnn (SDPA pinned to cuDNN: the anchor, and the reference every output is checked
against before it is timed), flashgen (flashgen.attention with its defaults: what users get), and
the family forced at 128 x 128 tiles with each VARIANTS entry, one-tile and persistent. TFLOP/s
over visible pairs (do_bench median), ratio_vs_cudnn.

    python3 benchmarks/probe_hopper_persistent.py [--cases hd128] [--variants NAME ...] [--budget SECONDS] [--tag TAG]

Writes benchmarks/results/<date>-<gpu>-hopper-persistent<TAG>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import flashgen  # noqa: E402
from flashgen import AttentionSpec, KernelConfig  # noqa: E402
from flashgen.bench import environment, file_tag, sdpa_runner  # noqa: E402
from flashgen.flops import attention_flops, tflops  # noqa: E402
from flashgen.timing import time_ms  # noqa: E402

CASES = [(d, causal, s) for d in (128, 64) for causal in (False, True) for s in (1024, 4096, 16384)]
FAMILY = dict(family="hopper_ws", BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2)
VARIANTS = {  # name -> knobs over FAMILY
    "ws": {}, "ws s3": dict(num_stages=3), "ws pingpong": dict(hopper_pingpong=True),
    "persistent": dict(hopper_persistent=True), "persistent s3": dict(hopper_persistent=True, num_stages=3),
    # FA3's intra-warpgroup overlap (hopper_overlap: S_j and P_{j-1} V_{j-1} issued back to back)
    "ws overlap": dict(hopper_overlap=True), "ws s3 overlap": dict(num_stages=3, hopper_overlap=True),
    "persistent overlap": dict(hopper_persistent=True, hopper_overlap=True),
    "persistent s3 overlap": dict(hopper_persistent=True, num_stages=3, hopper_overlap=True),
    # FA3's ping-pong on the persistent grid (turns counted on across tiles)
    "persistent pingpong": dict(hopper_persistent=True, hopper_pingpong=True),
    "persistent s3 pingpong": dict(hopper_persistent=True, num_stages=3, hopper_pingpong=True),
}
TOLERANCE = 3e-2  # max |out - cuDNN's| (bf16 outputs of O(1))


def bench_case(d, causal, seqlen, deadline, variants):
    heads, batch = 2048 // d, 16384 // seqlen
    gen = torch.Generator(device="cuda").manual_seed(seqlen * 7 + d + causal)
    q, k, v = (torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    cudnn = sdpa_runner(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
    runs = {"cudnn": lambda: cudnn(q, k, v, causal), "flashgen": lambda: flashgen.attention(q, k, v, causal=causal)}
    for name in variants:
        config = KernelConfig(**{**FAMILY, **VARIANTS[name]})
        runs[name] = lambda config=config: flashgen.attention(q, k, v, causal=causal, config=config)

    def first_call(fn):
        try:
            fn()
            torch.cuda.synchronize()
            return None
        except Exception as err:  # noqa: BLE001 - recorded per provider
            return f"{type(err).__name__}: {str(err)[:200]}"

    # one at a time: a fresh thread has no current CUDA context, and Triton's launcher fills a tensor
    # descriptor before it makes one current ("Failed to create tensor map descriptor: invalid device
    # context": run 1 of this probe, which compiled in threads)
    errors = {name: first_call(fn) for name, fn in runs.items()}
    flops = attention_flops(batch, heads, seqlen, seqlen, d, causal=causal, mode="fwd")
    row = {"case": f"hd{d} S={seqlen}{' causal' if causal else ''}", "mode": "fwd", "head_dim": d, "causal": causal,
           "seqlen": seqlen, "batch": batch, "heads": heads}
    ref = runs["cudnn"]().float()
    for name, fn in runs.items():
        if errors[name] or time.time() > deadline:
            row[name] = {"error": errors[name] or "budget spent"}
            continue
        err = (fn().float() - ref).abs().max().item()
        if not err <= TOLERANCE:
            row[name] = {"error": f"max|out - cudnn| = {err:.3g}"}
            continue
        ms = time_ms(fn)
        row[name] = {"ms": round(ms, 4), "tflops": round(tflops(flops, ms), 1)}
    anchor = row["cudnn"].get("ms")
    for name in runs:
        if "ms" in row[name] and anchor:
            row[name]["ratio_vs_cudnn"] = round(anchor / row[name]["ms"], 3)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", default=[], help="case-name words to keep (e.g. hd128 causal)")
    parser.add_argument("--budget", type=float, default=400.0, help="seconds; later cases are skipped")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS), metavar="NAME",
                        help=f"variants to time (default: all of {', '.join(VARIANTS)})")
    parser.add_argument("--tag", default="", type=file_tag)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    args = parser.parse_args()
    deadline = time.time() + args.budget
    env = environment()
    gpu = "h200" if "H200" in env.get("gpu", "") else "h100"
    out = Path(args.out) / f"{datetime.date.today().isoformat()}-{gpu}-hopper-persistent{args.tag}"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for d, causal, seqlen in CASES:
        name = f"hd{d} S={seqlen}{' causal' if causal else ''}"
        if (args.cases and not all(w in name for w in args.cases)) or time.time() > deadline:
            continue
        rows.append(bench_case(d, causal, seqlen, deadline, args.variants))
        print(name, "|", " | ".join(f"{k}: {v.get('tflops', v.get('error', '')[:50])} ({v.get('ratio_vs_cudnn', '-')})"
                                    for k, v in rows[-1].items() if isinstance(v, dict)), flush=True)
        names = [k for k in rows[0] if isinstance(rows[0][k], dict)]
        lines = [f"GPU: {env.get('gpu')} | torch {env['torch']} | triton {env['triton']}. bf16, 16384 tokens, hidden "
                 "2048, forward TFLOP/s (ratio_vs_cudnn); outputs checked against cuDNN first. Variants: the Gluon "
                 f"family forced at {json.dumps(FAMILY)} plus each one's knobs.", "",
                 "| case | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for row in rows:
            lines.append(f"| {row['case']} | " + " | ".join(
                f"{row[n]['tflops']} ({row[n]['ratio_vs_cudnn']})" if "tflops" in row[n] else row[n]["error"][:40]
                for n in names) + " |")
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")  # after each case: a cut run keeps its rows
        out.with_suffix(".json").write_text(json.dumps(dict(environment=env, variants={n: VARIANTS[n] for n in args.variants},
                                                            rows=rows),
                                                       indent=1) + "\n")
    print(f"wrote {out}.json/.md")


if __name__ == "__main__":
    main()
