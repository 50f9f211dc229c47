"""What checking packed offsets costs a training step (session 22), on the GPU.

A packed step of 32 attention layers (a matmul, then flashgen.attention_varlen, causal, GQA) forward
and backward, timed end to end (wall clock over 10 steps, synchronized at both ends: the host's
waits are what is measured), with each packed call's cu_seqlens check done three ways, rounds
alternating: ``device check`` (AttentionLauncher.check_offsets as it is: a one-program kernel
writes the bounds record, nothing is read back), ``host read`` (check_cu_seqlens: the offsets
copied to the host, as every call did before: a wait in every layer) and ``unchecked``:

    PYTHONPATH=. python3 benchmarks/probe_varlen_check.py [--rounds 3] [--out benchmarks/results]
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if "--dry" in sys.argv:  # before Triton decorates flashgen's kernels
    os.environ["TRITON_INTERPRET"] = "1"

import flashgen  # noqa: E402
from flashgen.runtime import host  # noqa: E402
from probes import alternating, figures, run_probe, step_wall_ms, table_head  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS, STEPS, DTYPE, DEVICE = 16, 4, 128, 32, 10, torch.bfloat16, "cuda"
CASES = [("6 sequences, 6096 tokens", [512, 1024, 300, 700, 2000, 1560]),
         ("8 sequences of 64 tokens (host-bound)", [64] * 8)]
CHECKS = {"device check": host.AttentionLauncher.check_offsets,
          "host read": lambda self, *args: host.check_cu_seqlens(*args),
          "unchecked": lambda self, *args: None}


def dry_run() -> None:
    """Shake the script out on the CPU (Triton's interpreter, fp16, 2 layers, short sequences); the
    figures mean nothing (the CPU has no device to wait for)."""
    global HEADS, KV_HEADS, HEAD_DIM, LAYERS, STEPS, DTYPE, DEVICE
    HEADS, KV_HEADS, HEAD_DIM, LAYERS, STEPS, DTYPE, DEVICE = 2, 1, 16, 2, 1, torch.float16, "cpu"
    CASES[:] = [(name, [n // 16 + 1 for n in lengths[:3]]) for name, lengths in CASES]


def packed_step(x, w, cu, longest):
    """A packed step: LAYERS layers of matmul + packed attention, forward and backward."""
    tokens = x.shape[0]

    def step():
        h = x
        for _ in range(LAYERS):
            q = (h @ w).view(tokens, HEADS, HEAD_DIM)
            kv = q[:, :KV_HEADS]
            h = flashgen.attention_varlen(q, kv, kv, cu, cu, longest, longest, causal=True).reshape(tokens, -1)
        h.float().sum().backward()

    return step


def run_case(case, args) -> dict:
    name, lengths = case
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    tokens, width = sum(lengths), HEADS * HEAD_DIM
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(tokens, width, device=DEVICE, dtype=DTYPE, generator=gen).requires_grad_()
    w = torch.randn(width, width, device=DEVICE, dtype=DTYPE, generator=gen) * width ** -0.5
    step = packed_step(x, w, cu, max(lengths))

    def measure(label):
        host.AttentionLauncher.check_offsets = CHECKS[label]
        return round(step_wall_ms(step, STEPS), 3)

    try:
        times = alternating(CHECKS, args.rounds, measure)
    finally:
        host.AttentionLauncher.check_offsets = CHECKS["device check"]
    row = {"case": name, "mode": "fwd_bwd", "layers": LAYERS, "tokens": tokens, "heads": f"{HEADS}/{KV_HEADS}",
           "head_dim": HEAD_DIM, **{f"{label.replace(' ', '_')}_ms": t for label, t in times.items()}}
    device = statistics.median(times["device check"])
    row["ratio_vs_host_read"] = round(statistics.median(times["host read"]) / device, 3)
    row["ratio_vs_unchecked"] = round(statistics.median(times["unchecked"]) / device, 3)
    return row


def markdown(rows, env) -> str:
    lines = table_head("Packed offsets' check in a training step", env,
                       f"{LAYERS} layers of matmul + flashgen.attention_varlen (causal), fwd+bwd, ms per step "
                       "(wall clock, each round's figure); ratios: median / the device check's median.",
                       ["case", "device check ms", "host read ms (before)", "unchecked ms", "ratio vs host read",
                        "ratio vs unchecked"])
    for r in rows:
        lines.append(f"| {r['case']} | {figures(r['device_check_ms'])} | {figures(r['host_read_ms'])} | "
                     f"{figures(r['unchecked_ms'])} | "
                     f"{r['ratio_vs_host_read']} | {r['ratio_vs_unchecked']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run_probe(__doc__.splitlines()[0], "varlen-check", CASES, run_case, markdown, dry_run)
