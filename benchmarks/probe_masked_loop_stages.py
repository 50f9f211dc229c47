"""The backward's boundary-block loops without software pipelining (issues 15, 18), on the GPU.

A program of the dK/dV or dQ kernel walks its whole blocks in one loop and its boundary blocks
(a causal diagonal, a window's edges, a document's start) in a second one, each pipelined with
the config's stages. The boundary loop runs one or two blocks per program: its pipeline's
prologue and drain may cost more than the overlap gives. aff8400 (a third loop per program for
documents) measured 0.89-0.92x at 16384 tokens though its loop's work was cheaper: the loops'
fixed cost matters. This renders each case's default kernels as they are and with the boundary
loops at ``num_stages=1`` (``masked_s1``), and times the backward (and the forward where its
boundary loop is the portable one) replayed from a CUDA graph, rounds alternating the order:

    PYTHONPATH=. python3 benchmarks/probe_masked_loop_stages.py [--rounds 3] [--out benchmarks/results]

Each variant's outputs and gradients are checked equal to the default's (the same blocks in the
same order: bit for bit).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if "--dry" in sys.argv:  # before Triton decorates flashgen's kernels
    os.environ["TRITON_INTERPRET"] = "1"

from flashgen import AttentionSpec  # noqa: E402
from flashgen.codegen import render  # noqa: E402
from flashgen.codegen.cache import cached_source_path, import_path  # noqa: E402
from flashgen.config import default_config  # noqa: E402
from flashgen.inputs import named_tensors  # noqa: E402
from flashgen.timing import wall_ms  # noqa: E402
from probes import graph_ms, interleaved_ms, max_abs_diff, run_probe, table_head  # noqa: E402

TOKENS, HEADS, DTYPE, DEVICE = 16384, 16, "bf16", "cuda"
# (name, spec fields, seqlen, documents)
CASES = [
    ("causal_hd128", dict(head_dim=128, causal=True), 1024, 0),
    ("causal_hd64", dict(head_dim=64, causal=True), 1024, 0),
    ("causal_hd128", dict(head_dim=128, causal=True), 4096, 0),
    ("document_16", dict(head_dim=128, mask={"document": {}}), 16384, 16),
    ("document_4", dict(head_dim=128, mask={"document": {}}), 4096, 4),
    ("sliding_window_1024", dict(head_dim=128, mask={"sliding_window": {"left": 1024, "right": 0}}), 4096, 0),
    ("prefix_lm_512", dict(head_dim=128, mask={"prefix_lm": 512}), 4096, 0),
]
# The boundary loops' text in the backward (dkdv.j2, dq.j2) and the portable forwards (q_outer.j2 without
# staged id reads, kv_outer.j2): the whole-block loops are the same functions, called with MASKED False.
LOOPS = {
    "        for j in range(lo, hi + (hi2 - lo2), BLOCK_M):\n":
        "        for j in tl.range(lo, hi + (hi2 - lo2), BLOCK_M, num_stages=1 if MASKED else None):\n",
    "        for j in range(lo, hi + (hi2 - lo2), BLOCK_N):\n":
        "        for j in tl.range(lo, hi + (hi2 - lo2), BLOCK_N, num_stages=1 if MASKED else None):\n",
}


def build(spec: AttentionSpec, seqlen: int, variant: str):
    cfg = default_config(spec, seqlen=seqlen)
    source = render.render(spec, cfg, standalone=False)
    if variant == "masked_s1":
        assert any(old in source for old in LOOPS), "the loops' text moved"
        for old, new in LOOPS.items():
            source = source.replace(old, new)
    return import_path(cached_source_path(f"{spec.uri}-{variant}", source)), cfg


def dry_run() -> None:
    """Shake the script out on the CPU (Triton's interpreter, fp16, 2 heads, 1/32 of the lengths);
    the figures mean nothing."""
    global TOKENS, HEADS, DTYPE, DEVICE, graph_ms
    TOKENS, HEADS, DTYPE, DEVICE = 512, 2, "fp16", "cpu"
    CASES[:] = [(n, dict(f, head_dim=32), s // 32, d) for n, f, s, d in CASES[:1] + CASES[3:4]]

    graph_ms = wall_ms


def run_case(case, args) -> dict:
    (name, fields, seqlen, documents), rounds = case, args.rounds
    batch = max(1, TOKENS // seqlen)
    spec = AttentionSpec(name=name, dtype=DTYPE, num_heads=HEADS, backward=True, **fields)
    gen = torch.Generator(device=DEVICE).manual_seed(seqlen)
    q, k, v, do = (torch.randn(batch, HEADS, seqlen, spec.head_dim, device=DEVICE, generator=gen).to(spec.torch_dtype)
                   for _ in range(4))
    tensors = named_tensors(spec, batch, seqlen, documents=documents or 4, device=DEVICE)
    calls = {}
    for label in ("default", "masked_s1"):
        module, cfg = build(spec, seqlen, label)
        out, lse = module.forward(q, k, v, tensors=tensors)
        calls[label] = (lambda m=module: m.forward(q, k, v, tensors=tensors),
                        lambda m=module, o=out, s=lse: m.backward(do, q, k, v, o, s, tensors=tensors), cfg)
    results = {label: (fwd()[0], bwd()[:3]) for label, (fwd, bwd, _) in calls.items()}
    diff = max_abs_diff((results["default"][0], *results["default"][1]),
                        (results["masked_s1"][0], *results["masked_s1"][1]))
    times = interleaved_ms(calls, rounds, graph_ms)
    cfg = calls["default"][2]
    row = {"case": name, "seqlen": seqlen, "batch": batch, "head_dim": spec.head_dim, "max_diff": diff,
           "config": str(cfg), "backward": cfg.describe_backward()}
    for label in calls:
        fwd, bwd = times[label]["fwd"], times[label]["bwd"]
        row[label] = {"fwd_ms": statistics.median(fwd), "bwd_ms": statistics.median(bwd),
                      "bwd_spread": [min(bwd), max(bwd)]}
    row["fwd_ratio"] = row["default"]["fwd_ms"] / row["masked_s1"]["fwd_ms"]
    row["bwd_ratio"] = row["default"]["bwd_ms"] / row["masked_s1"]["bwd_ms"]
    return row


def markdown(rows, env) -> str:
    lines = table_head(
        "Boundary-block loops unpipelined (num_stages=1) vs the default", env,
        "bf16, 16 heads, 16384 tokens per batch, each case's default config; GPU ms per call replayed from a CUDA "
        "graph (median of the rounds); ratio = default / masked_s1 (above 1: unpipelined is faster). The Gluon "
        "kernels (hopper_ws forward, hopper_bwd dK/dV) are not touched.",
        ["case", "S", "fwd default / masked_s1", "fwd ratio", "bwd default / masked_s1", "bwd ratio", "max diff",
         "backward"])
    for r in rows:
        d, m = r["default"], r["masked_s1"]
        lines.append(f"| {r['case']} | {r['seqlen']} | {d['fwd_ms']:.3f} / {m['fwd_ms']:.3f} | "
                     f"{r['fwd_ratio']:.3f} | {d['bwd_ms']:.3f} / {m['bwd_ms']:.3f} | {r['bwd_ratio']:.3f} | "
                     f"{r['max_diff']:.2g} | "
                     f"{r['backward']} |")
    return "\n".join(lines) + "\n"




if __name__ == "__main__":
    run_probe(__doc__.split("\n")[0], "masked-loop-stages", CASES, run_case, markdown, dry_run)
