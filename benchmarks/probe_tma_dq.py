"""dQ accumulated by the dK/dV kernel through the copy engine's bulk reduce-add (dq_strategy
'atomic' with bwd_tma: one `desc.atomic_add` of a float32 tile per step) against the default
backward (a separate dQ kernel that recomputes S and dP: 7 MMAs per pair instead of 5).

H100/H200, bf16, 16384 tokens (hidden 2048: 16 heads at hd128, 32 at hd64), head dims 64 and 128,
causal or not, S = 1024, 4096, 16384. For each case: cuDNN's fwd+bwd (the anchor and the
reference every variant's gradients are checked against before it is timed), flashgen's default
config (what users get), and the default's forward with backward variants (VARIANTS). fwd+bwd
TFLOP/s over visible pairs (do_bench median); the backward alone as fwd+bwd less the default's
forward. Configs compile in threads before anything is timed.

    python3 benchmarks/probe_tma_dq.py [--cases hd128] [--budget SECONDS] [--tag TAG]

Writes benchmarks/results/<date>-<gpu>-tma-dq<TAG>.{json,md}.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import flashgen  # noqa: E402
from flashgen import AttentionSpec, default_config  # noqa: E402
from flashgen.bench import environment, sdpa_runner  # noqa: E402
from flashgen.flops import attention_flops, tflops  # noqa: E402
from flashgen.timing import time_ms  # noqa: E402

CASES = [(d, causal, s) for d in (128, 64) for causal in (False, True) for s in (16384, 4096, 1024)]
# backward variants over the default config: (BLOCK_M1 query rows, BLOCK_N1 keys, warps, stages)
TILES = {128: [(64, 64, 4, 2), (32, 64, 4, 2), (64, 64, 8, 2), (64, 128, 8, 2), (32, 128, 4, 1)],
         64: [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 8, 2), (32, 64, 4, 2), (128, 128, 8, 2)]}
TOLERANCE = 8e-2  # max |grad - cuDNN's| over dq, dk, dv (bf16, gradients O(1))


def variants(spec, seqlen):
    default = default_config(spec, seqlen=seqlen)
    out = {"default": default}
    for m1, n1, w, s in TILES[spec.head_dim]:
        knobs = dict(BLOCK_M1=m1, BLOCK_N1=n1, bwd_num_warps=w, bwd_num_stages=s, hopper_bwd=False,
                     bwd_short=False, bwd_fused_delta=False, bwd_persistent=0)
        out[f"tma_dq {m1}x{n1} w{w} s{s}"] = default.replace(dq_strategy="atomic", bwd_tma=True, **knobs)
    m1, n1, w, s = TILES[spec.head_dim][0]
    out[f"ptr_dq {m1}x{n1} w{w} s{s}"] = default.replace(
        dq_strategy="atomic", bwd_tma=False, BLOCK_M1=m1, BLOCK_N1=n1, bwd_num_warps=w, bwd_num_stages=s,
        hopper_bwd=False, bwd_short=False, bwd_fused_delta=False, bwd_persistent=0)
    return out


def step(fn, leaves, do):
    for t in leaves:
        t.grad = None
    fn(*leaves).backward(do)


def bench_case(d, causal, seqlen, deadline):
    heads, batch = 2048 // d, 16384 // seqlen
    spec = AttentionSpec(name="probe", dtype="bf16", head_dim=d, num_heads=heads, causal=causal, backward=True)
    gen = torch.Generator(device="cuda").manual_seed(seqlen + d + causal)
    q, k, v, do = (torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(4))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    cudnn = sdpa_runner(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
    runs = {"cudnn": lambda q, k, v: cudnn(q, k, v, causal)}
    for name, cfg in variants(spec, seqlen).items():
        runs[name] = lambda q, k, v, cfg=cfg: flashgen.attention(q, k, v, causal=causal, config=cfg)
    # compile every variant's kernels at once (threads: Triton's passes and ptxas leave the GIL)
    def warm(fn):
        mine = [t.detach().clone().requires_grad_() for t in leaves]
        step(fn, mine, do)
        torch.cuda.synchronize()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        errors = dict(zip(runs, pool.map(lambda fn: _try(warm, fn), runs.values())))
    flops = attention_flops(batch, heads, seqlen, seqlen, d, causal=causal, mode="fwd_bwd")
    fwd_ms = time_ms(lambda: flashgen.attention(q, k, v, causal=causal))
    row = {"case": f"hd{d} S={seqlen}{' causal' if causal else ''}", "mode": "fwd_bwd", "head_dim": d,
           "causal": causal, "seqlen": seqlen, "batch": batch, "heads": heads, "default_fwd_ms": round(fwd_ms, 4),
           "default_config": str(default_config(spec, seqlen=seqlen))}
    ref = None
    for name, fn in runs.items():
        if errors[name]:
            row[name] = {"error": errors[name]}
            continue
        if time.time() > deadline:
            row[name] = {"error": "budget spent"}
            continue
        step(fn, leaves, do)
        got = torch.cat([t.grad.float().flatten() for t in leaves])
        if ref is None:
            ref = got
        err = (got - ref).abs().max().item()
        if not err <= TOLERANCE:
            row[name] = {"error": f"max|grad - cudnn| = {err:.3g}"}
            continue
        ms = time_ms(lambda fn=fn: step(fn, leaves, do))
        row[name] = {"ms": round(ms, 4), "tflops": round(tflops(flops, ms), 1), "bwd_ms": round(ms - fwd_ms, 4),
                     "max_err_vs_cudnn": round(err, 4)}
    base = row.get("default", {}).get("ms")
    for name in runs:
        ms = row[name].get("ms") if isinstance(row[name], dict) else None
        if ms and base:
            row[name]["ratio_vs_default"] = round(base / ms, 3)
        if ms and row["cudnn"].get("ms"):
            row[name]["ratio_vs_cudnn"] = round(row["cudnn"]["ms"] / ms, 3)
    return row


def _try(fn, arg):
    try:
        fn(arg)
        return None
    except Exception as err:  # noqa: BLE001 - recorded per variant
        return f"{type(err).__name__}: {str(err)[:300]}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", default=[], help="case-name words to keep (e.g. hd128 causal)")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds; later variants are skipped")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    args = parser.parse_args()
    deadline = time.time() + args.budget
    rows = []
    for d, causal, seqlen in CASES:
        name = f"hd{d} S={seqlen}{' causal' if causal else ''}"
        if args.cases and not all(w in name for w in args.cases):
            continue
        if time.time() > deadline:
            break
        row = bench_case(d, causal, seqlen, deadline)
        rows.append(row)
        cells = [f"{k}: {v['tflops']} ({v.get('ratio_vs_default', '-')})" if "tflops" in v else f"{k}: {v['error'][:60]}"
                 for k, v in row.items() if isinstance(v, dict)]
        print(row["case"], "|", " | ".join(cells), flush=True)
    env = environment()
    gpu = "h200" if "H200" in env.get("gpu", "") else "h100"
    date = datetime.date.today().isoformat()
    out = Path(args.out) / f"{date}-{gpu}-tma-dq{args.tag}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(dict(environment=env, rows=rows), indent=1) + "\n")
    names = [k for k in rows[0] if isinstance(rows[0][k], dict)] if rows else []
    lines = [f"GPU: {env.get('gpu')} | torch {env['torch']} | triton {env['triton']}. bf16, 16384 tokens, hidden "
             "2048. fwd+bwd TFLOP/s (ratio to the default config); gradients checked against cuDNN first.", "",
             "| case | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for row in rows:
        cells = [f"{row[n]['tflops']} ({row[n].get('ratio_vs_default', '-')})" if "tflops" in row[n]
                 else row[n]["error"][:40] for n in names]
        lines.append(f"| {row['case']} | " + " | ".join(cells) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}.json/.md")


if __name__ == "__main__":
    main()
