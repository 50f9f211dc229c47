"""The Gluon FP8 forward on the persistent grid (config knob hopper_persistent) against its one-tile
variants and the FP8 default (issue 17's forward rows, on issue 18's persistent schedule).

H100/H200, FP8 e4m3 with per-(batch, KV head) descales, 16384 tokens per batch, heads = 2048 / head
dim (bench_fp8.py's cases): head dims 64, 128, 256, S = 4096 and 16384, causal or not. Providers, one
process: bf16 (flashgen.attention in bf16 with its default: issue 17's ratio_vs_bf16 denominator),
fp8 default (flashgen.attention with its default config: what users get), and the Gluon family forced
with each variant of the head dim, one-tile and persistent. Every FP8 output is checked on two heads
against FlashAttention-3's rule (the dequantized inputs) before it is timed. TFLOP/s over visible
pairs (do_bench median, L2 flushed).

    python3 benchmarks/probe_fp8_persistent.py [--head-dims 128] [--budget SECONDS] [--tag TAG]

Writes benchmarks/results/<date>-<gpu>-fp8-persistent<TAG>.{json,md}.
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
from flashgen import KernelConfig  # noqa: E402
from flashgen.bench import environment, file_tag, fp8_inputs  # noqa: E402
from flashgen.flops import pairs_flops, visible_pairs  # noqa: E402
from flashgen.timing import time_ms  # noqa: E402
from flashgen.verify import check_attention  # noqa: E402

TOKENS = 16384
FAMILY = dict(family="hopper_ws", BLOCK_M=128, num_warps=4)
VARIANTS = {  # head dim -> name -> knobs over FAMILY (the one-tile FP8 defaults' tiles and their persistent twins)
    64: {"128x128 s2": dict(BLOCK_N=128, num_stages=2), "128x128 s2 persistent": dict(BLOCK_N=128, num_stages=2,
                                                                                     hopper_persistent=True),
         "128x128 s3 persistent": dict(BLOCK_N=128, num_stages=3, hopper_persistent=True),
         "128x128 s2 persistent overlap": dict(BLOCK_N=128, num_stages=2, hopper_persistent=True, hopper_overlap=True)},
    128: {"128x256 s2": dict(BLOCK_N=256, num_stages=2), "128x128 s3": dict(BLOCK_N=128, num_stages=3),
          "128x256 s2 persistent": dict(BLOCK_N=256, num_stages=2, hopper_persistent=True),
          "128x128 s2 persistent": dict(BLOCK_N=128, num_stages=2, hopper_persistent=True),
          "128x128 s3 persistent": dict(BLOCK_N=128, num_stages=3, hopper_persistent=True),
          # FA3's intra-warpgroup overlap (hopper_overlap)
          "128x256 s2 overlap": dict(BLOCK_N=256, num_stages=2, hopper_overlap=True),
          "128x128 s2 persistent overlap": dict(BLOCK_N=128, num_stages=2, hopper_persistent=True, hopper_overlap=True),
          "128x256 s2 persistent overlap": dict(BLOCK_N=256, num_stages=2, hopper_persistent=True,
                                                hopper_overlap=True)},
    256: {"128x64 s2": dict(BLOCK_N=64, num_stages=2), "128x64 s2 persistent": dict(BLOCK_N=64, num_stages=2,
                                                                                   hopper_persistent=True),
          "128x64 s3 persistent": dict(BLOCK_N=64, num_stages=3, hopper_persistent=True),
          "128x64 s2 persistent overlap": dict(BLOCK_N=64, num_stages=2, hopper_persistent=True, hopper_overlap=True)},
}


def bench_case(d, causal, seqlen, deadline, variants=None):
    heads, batch = 2048 // d, TOKENS // seqlen
    row = dict(case=f"hd{d} S={seqlen} B={batch} H={heads} {'causal' if causal else 'full'}", mode="fwd",
               head_dim=d, seqlen=seqlen, causal=causal)
    flops = batch * heads * pairs_flops(visible_pairs(seqlen, seqlen, causal), d)
    gen = torch.Generator(device="cuda").manual_seed(seqlen * 7 + d + causal)
    x = [torch.randn(batch, heads, seqlen, d, device="cuda", generator=gen) for _ in range(3)]
    q16, k16, v16 = (t.to(torch.bfloat16) for t in x)
    q8, k8, v8, (qd, kd, vd) = fp8_inputs(*x)
    del x

    def fp8(config=None, return_lse=False):
        return flashgen.attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, config=config,
                                  return_lse=return_lse)

    runs = {"bf16": lambda: flashgen.attention(q16, k16, v16, causal=causal), "fp8 default": fp8}
    for name, knobs in VARIANTS[d].items():
        if variants and name not in variants:
            continue
        config = KernelConfig(**{**FAMILY, **knobs})
        runs[name] = lambda config=config: fp8(config)
    h = slice(0, 2)
    for name, fn in runs.items():
        if time.time() > deadline:
            row[f"{name}_error"] = "budget spent"
            continue
        try:
            if name != "bf16":
                config = None if name == "fp8 default" else KernelConfig(**{**FAMILY, **VARIANTS[d][name]})
                out, lse = fp8(config, return_lse=True)
                checks = check_attention(out[:, h], lse[:, h], q8[:, h], k8[:, h], v8[:, h], causal=causal,
                                         descales=(qd[:, h], kd[:, h], vd[:, h]))
                if not all(c.ok for c in checks):
                    row[f"{name}_error"] = "failed FlashAttention-3's rule: " + "; ".join(map(str, checks))[:300]
                    continue
                del out, lse
            ms = time_ms(fn)
            row[f"{name}_ms"], row[f"{name}_tflops"] = round(ms, 4), round(flops / ms / 1e9, 1)
        except Exception as err:  # noqa: BLE001 - recorded per provider
            row[f"{name}_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    if row.get("bf16_ms"):
        for name in runs:
            if name != "bf16" and row.get(f"{name}_ms"):
                row[f"{name}_ratio_vs_bf16"] = round(row["bf16_ms"] / row[f"{name}_ms"], 3)
    spec8 = flashgen.AttentionSpec(dtype="fp8_e4m3", head_dim=d, num_heads=heads, causal=causal)
    row["fp8_default_config"] = str(flashgen.default_config(spec8, seqlen=seqlen))
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dims", default="128,64,256")
    parser.add_argument("--seqlens", default="4096,16384")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds; cases past it are left out")
    parser.add_argument("--variants", nargs="*", default=[], metavar="NAME",
                        help="variant names to time (default: every one of the head dim's)")
    parser.add_argument("--tag", default="", type=file_tag)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    args = parser.parse_args()
    deadline = time.time() + args.budget
    rows = []
    for d in map(int, args.head_dims.split(",")):
        for causal in (False, True):
            for seqlen in map(int, args.seqlens.split(",")):
                rows.append(bench_case(d, causal, seqlen, deadline, args.variants))
                print(json.dumps(rows[-1]), flush=True)
                torch.cuda.empty_cache()
    env = environment()
    date = datetime.date.today().isoformat()
    slug = "h200" if "H200" in env["gpu"] else "h100" if "H100" in env["gpu"] else "gpu"
    out = Path(args.out) / f"{date}-{slug}-fp8-persistent{args.tag}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(dict(environment=env, rows=rows), indent=1) + "\n")
    names = ["bf16", "fp8 default"] + sorted({n for d in VARIANTS.values() for n in d})
    lines = [f"# FP8 forward, the persistent grid ({env['gpu']}, torch {env['torch']}, triton {env['triton']}, {date})",
             "", "TFLOP/s (ratio to flashgen's bf16 default in brackets); '-' not run or failed (see the JSON).", "",
             "| case | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for r in rows:
        cells = []
        for n in names:
            t = r.get(f"{n}_tflops")
            ratio = r.get(f"{n}_ratio_vs_bf16")
            cells.append("-" if t is None else f"{t:.0f}" + (f" ({ratio:.2f})" if ratio else ""))
        lines.append(f"| {r['case']} | " + " | ".join(cells) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
