"""The backward's launch order (config knob bwd_heavy_first) on causal calls with few, long dK/dV programs.

A dK/dV program owns one key block of one (KV head, batch) and walks every query block of every query
head of its group that sees it: with causal attention the first key blocks walk the most, and with
GQA a group holds several heads, so a grid of a few hundred programs has a handful of very long ones.
The default order (program_id(0), the block, fastest) starts the last groups' longest programs last;
bwd_heavy_first takes blocks heaviest first in chunks of (head, batch) groups of about 256 programs
(the sm90 default for causal GQA at hd128 from 2048 tokens).

Cases: causal hd128 bf16, bshd, GQA (Llama's 16 / 4 heads at 1024-4096 tokens, 32 / 8) and without
(16 heads, 16384 tokens per batch). Variants per case: the call's default backward with the knob off
and on, the Gluon dK/dV kernel (hopper_bwd) off and on, and cuDNN (SDPA on K/V expanded to every
head). Each variant's output and gradients are checked against SDPA's math (max abs error) and against
the default order's (bitwise, where the dQ is not added by atomics); GPU ms are do_bench medians of
the fwd and fwd+bwd calls (host time included: these calls are 0.1-8 ms of GPU time), over
interleaved rounds.

    PYTHONPATH=. python3 benchmarks/probe_heavy_first.py [--rounds 3] [--tag TAG]
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if "--dry" in sys.argv:  # before Triton decorates flashgen's kernels
    os.environ["TRITON_INTERPRET"] = "1"

import flashgen  # noqa: E402
from flashgen import AttentionSpec  # noqa: E402
from flashgen.timing import wall_ms  # noqa: E402
from probes import bshd_inputs, expanded_sdpa, run_probe, table_head  # noqa: E402

DTYPE, DEVICE, HEAD_DIM = torch.bfloat16, "cuda", 128
# (batch, seqlen, heads, KV heads)
CASES = [(4, 2048, 16, 4), (8, 1024, 16, 4), (2, 4096, 16, 4), (4, 2048, 32, 8), (16, 1024, 16, 16),
         (4, 4096, 16, 16), (1, 16384, 16, 16)]
VARIANTS = {"default": {}, "order off": dict(bwd_heavy_first=False), "heavy first": dict(bwd_heavy_first=True),
            "portable, order off": dict(hopper_bwd=False, bwd_heavy_first=False),
            "portable, heavy first": dict(hopper_bwd=False, bwd_heavy_first=True),
            "hopper_bwd, order off": dict(hopper_bwd=True, bwd_heavy_first=False),
            "hopper_bwd, heavy first": dict(hopper_bwd=True, bwd_heavy_first=True)}


def timer(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, rep=60, return_mode="median"))


def dry_run() -> None:
    """Shake the script out on the CPU (Triton's interpreter, fp16, head dim 32, two small cases);
    the figures mean nothing."""
    global DTYPE, DEVICE, HEAD_DIM, timer
    DTYPE, DEVICE, HEAD_DIM = torch.float16, "cpu", 32
    CASES[:] = [(2, 64, 4, 2), (1, 96, 2, 2)]
    for name in [n for n in VARIANTS if "hopper_bwd" in n]:  # no Gluon under the interpreter
        del VARIANTS[name]
    timer = wall_ms


def run_case(case, args) -> dict:
    batch, seqlen, heads, kv_heads = case
    spec = AttentionSpec(dtype="fp16" if DTYPE == torch.float16 else "bf16", head_dim=HEAD_DIM, num_heads=heads,
                         num_kv_heads=kv_heads, causal=True)
    base = flashgen.default_config(spec, seqlen=seqlen)
    q, k, v, do = bshd_inputs(batch, seqlen, heads, kv_heads, HEAD_DIM, DTYPE, DEVICE)
    ref, ref_grads, _ = expanded_sdpa(q, k, v, do, True, torch.float32)
    row = {"case": f"B={batch} S={seqlen} H={heads}/{kv_heads} hd{HEAD_DIM} causal", "mode": "fwd_bwd",
           "default_config": base.describe_backward()}
    calls, first_grads = {}, None
    for name, knobs in VARIANTS.items():
        config = base.replace(**knobs)
        kernel = flashgen.compile(spec, config)
        out = kernel(q, k, v, layout="bshd")
        grads = torch.autograd.grad(out, (q, k, v), do)
        row[f"{name}_max_err"] = max((out.float() - ref).abs().max().item(),
                                     *((g.float() - r).abs().max().item() for g, r in zip(grads, ref_grads)))
        first_grads = first_grads or grads
        row[f"{name}_bitwise_default"] = all(torch.equal(a, b) for a, b in zip(grads, first_grads))
        row[f"{name}_config"] = config.describe_backward()
        calls[name] = (lambda kernel=kernel: kernel(q, k, v, layout="bshd"),
                       lambda kernel=kernel: torch.autograd.grad(kernel(q, k, v, layout="bshd"), (q, k, v), do))
    if DEVICE == "cuda":
        calls["cudnn"] = expanded_sdpa(q, k, v, do, True, DTYPE, SDPBackend.CUDNN_ATTENTION)[2]
    times = {name: ([], []) for name in calls}
    order = list(calls)
    for r in range(args.rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            times[name][0].append(timer(calls[name][0]))
            times[name][1].append(timer(calls[name][1]))
    for name, (fwd, fwd_bwd) in times.items():
        row[f"{name}_fwd_ms"] = round(statistics.median(fwd), 4)
        row[f"{name}_fwd_bwd_ms"] = round(statistics.median(fwd_bwd), 4)
        row[f"{name}_bwd_ms"] = round(row[f"{name}_fwd_bwd_ms"] - row[f"{name}_fwd_ms"], 4)
        row[f"{name}_bwd_spread"] = [round(b - f, 4) for f, b in zip(fwd, fwd_bwd)]
    row["ratio_order_off_vs_heavy_first"] = round(row["order off_bwd_ms"] / row["heavy first_bwd_ms"], 3)
    for name in calls:
        if "cudnn" in calls:
            row[f"{name}_bwd_ratio_vs_cudnn"] = round(row["cudnn_bwd_ms"] / row[f"{name}_bwd_ms"], 3)
    return row


def markdown(rows, env) -> str:
    names = [n for n in (*VARIANTS, "cudnn") if rows and f"{n}_bwd_ms" in rows[0]]
    lines = table_head("The backward's launch order (bwd_heavy_first) on causal calls", env,
                       "bf16, hd128, causal, bshd; backward ms = fwd+bwd - fwd (do_bench medians, host time "
                       "included) per variant; the call's default backward config in the second column "
                       "(its bwd_heavy_first is the default's: on for GQA from 2048 tokens).",
                       ["case", "default config", *names, "order off / heavy first", "errors max",
                        "bitwise the default's"])
    for row in rows:
        errors = max(row[f"{n}_max_err"] for n in VARIANTS if f"{n}_max_err" in row)
        bitwise = ", ".join(n for n in VARIANTS if row.get(f"{n}_bitwise_default"))
        lines.append(f"| {row['case']} | {row['default_config']} | "
                     + " | ".join(f"{row[f'{n}_bwd_ms']:.3f}" for n in names)
                     + f" | {row['ratio_order_off_vs_heavy_first']:.3f} | {errors:.4f} | {bitwise} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run_probe(__doc__.split("\n")[0], "heavy-first", CASES, run_case, markdown, dry_run)
