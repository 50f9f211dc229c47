"""Documents' boundary blocks with one bound instead of the predicate (issue 15), on the GPU.

A causal document mask's diagonal blocks used to evaluate the whole predicate (two id loads and a
compare per pair); with KernelPlan.edge_mask they test ``kv <= q`` alone, as causal's do. This
times each document case's default kernels both ways in one process (the old kernels rendered by
turning edge_mask off), beside plain causal on the same work (one document per sequence), so the
step from documents to causal is read before and after:

- per case: forward and backward GPU time (each call replayed from a CUDA graph; median ms), for
  ``edges`` (today's kernels), ``predicate`` (before) and ``causal`` (the causal spec at the
  document length, the same configs);
- each variant checked against the other on the same inputs first (outputs and gradients equal
  to bf16 rounding: the two compute the same pairs);
- rounds alternate the variants' order.

    PYTHONPATH=. python3 benchmarks/probe_document_edges.py [--rounds 3] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
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
from flashgen.bench import environment  # noqa: E402
from flashgen.codegen import render  # noqa: E402
from flashgen.codegen.plan import KernelPlan  # noqa: E402
from flashgen.config import default_config  # noqa: E402
from flashgen.flops import pairs_flops, tflops, visible_count  # noqa: E402
from flashgen.inputs import named_tensors  # noqa: E402

TOKENS, HEADS, HEAD_DIM, DTYPE, DEVICE = 16384, 16, 128, "bf16", "cuda"
CASES = [("document_4", 4096, 4), ("document_16", 4096, 16), ("document_4", 16384, 4), ("document_16", 16384, 16)]


def build(spec: AttentionSpec, seqlen: int, edges: bool):
    """The default config's module for spec at seqlen, rendered with or without the one-bound loops."""
    cfg = default_config(spec, seqlen=seqlen)
    if edges:
        return render.build_module(spec, cfg), cfg
    saved = KernelPlan.edge_mask
    KernelPlan.edge_mask = lambda self, axis: None
    try:
        return render.build_module(spec, cfg), cfg
    finally:
        KernelPlan.edge_mask = saved


def graph_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median"))


def dry_run() -> None:
    """Shake the script out on the CPU (Triton's interpreter, fp16, 2 heads, hd32, 1/32 of the
    lengths); the figures mean nothing."""
    global TOKENS, HEADS, HEAD_DIM, DTYPE, DEVICE, graph_ms
    TOKENS, HEADS, HEAD_DIM, DTYPE, DEVICE = 512, 2, 32, "fp16", "cpu"
    CASES[:] = [(n, s // 32, d) for n, s, d in CASES[:2]]

    def graph_ms(fn):  # noqa: F811 (the CPU's wall time)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def run_case(name: str, seqlen: int, documents: int, rounds: int) -> dict:
    batch = max(1, TOKENS // seqlen)
    doc_len = seqlen // documents
    spec = AttentionSpec(name=name, dtype=DTYPE, head_dim=HEAD_DIM, num_heads=HEADS, backward=True,
                         mask={"document": {}})
    gen = torch.Generator(device=DEVICE).manual_seed(seqlen + documents)

    def randn(b, s):
        return torch.randn(b, HEADS, s, HEAD_DIM, device=DEVICE, generator=gen).to(spec.torch_dtype)

    q, k, v, do = (randn(batch, seqlen) for _ in range(4))
    tensors = named_tensors(spec, batch, seqlen, documents=documents, device=DEVICE)
    pairs = visible_count(spec, batch, seqlen, seqlen, tensors, device=DEVICE)
    # causal on the same work: each document as a sequence of its own
    causal = AttentionSpec(name="causal", dtype=DTYPE, head_dim=HEAD_DIM, num_heads=HEADS, backward=True,
                           causal=True)
    split = [t.reshape(batch, HEADS, documents, doc_len, HEAD_DIM).transpose(1, 2).reshape(
        batch * documents, HEADS, doc_len, HEAD_DIM).contiguous() for t in (q, k, v, do)]
    variants = {}
    for label, (module, cfg) in (("edges", build(spec, seqlen, True)), ("predicate", build(spec, seqlen, False))):
        variants[label] = (module, (q, k, v, do), tensors, cfg)
    # the causal kernels at the documents' configs (the same tiles), on the documents' length
    cmod = render.build_module(causal, default_config(spec, seqlen=seqlen))
    variants["causal"] = (cmod, tuple(split), {}, default_config(spec, seqlen=seqlen))

    def calls(label):
        module, (qq, kk, vv, dd), tt, _ = variants[label]
        out, lse = module.forward(qq, kk, vv, tensors=tt)

        def fwd():
            return module.forward(qq, kk, vv, tensors=tt)

        def bwd():
            return module.backward(dd, qq, kk, vv, out, lse, tensors=tt)

        return fwd, bwd, out, lse

    checks = {}
    results = {label: calls(label) for label in variants}
    (o1, _), (o2, _) = results["edges"][0](), results["predicate"][0]()
    g1, g2 = results["edges"][1](), results["predicate"][1]()
    checks["out_max_diff"] = float((o1.float() - o2.float()).abs().max())
    checks["grad_max_diff"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(g1[:3], g2[:3]))
    times = {label: {"fwd": [], "bwd": []} for label in variants}
    order = list(variants)
    for r in range(rounds):
        for label in (order if r % 2 == 0 else order[::-1]):
            fwd, bwd, _, _ = results[label]
            times[label]["fwd"].append(graph_ms(fwd))
            times[label]["bwd"].append(graph_ms(bwd))
    fwd_flops, bwd_flops = pairs_flops(pairs, HEAD_DIM, mode="fwd"), pairs_flops(pairs, HEAD_DIM, mode="fwd_bwd")
    row = {"case": name, "seqlen": seqlen, "batch": batch, "document_tokens": doc_len, "checks": checks,
           "config": str(variants["edges"][3]), "backward": variants["edges"][3].describe_backward()}
    for label in variants:
        f, b = statistics.median(times[label]["fwd"]), statistics.median(times[label]["bwd"])
        row[label] = {"fwd_ms": f, "bwd_ms": b, "fwd_bwd_ms": f + b, "fwd_tflops": tflops(fwd_flops, f),
                      "fwd_bwd_tflops": tflops(bwd_flops, f + b), "spread_bwd": [min(times[label]["bwd"]),
                                                                               max(times[label]["bwd"])]}
    row["bwd_ratio_edges_vs_predicate"] = row["predicate"]["bwd_ms"] / row["edges"]["bwd_ms"]
    row["fwd_ratio_edges_vs_predicate"] = row["predicate"]["fwd_ms"] / row["edges"]["fwd_ms"]
    row["bwd_ratio_causal_vs_edges"] = row["edges"]["bwd_ms"] / row["causal"]["bwd_ms"]
    return row


def markdown(rows, env) -> str:
    lines = [f"# Documents' boundary blocks: one bound vs the predicate ({env.get('gpu')}, torch {env.get('torch')}, "
             f"triton {env.get('triton')}, {env.get('date')})", "",
             "bf16, hd128, 16 heads, 16384 tokens per batch, default configs; GPU ms per call replayed from a CUDA "
             "graph (median of the rounds). edges = today's kernels, predicate = before (every boundary block "
             "evaluates the ids), causal = plain causal on each document as its own sequence (same configs).", "",
             "| case | S | doc tokens | fwd edges / predicate / causal | bwd edges / predicate / causal | "
             "bwd predicate/edges | bwd edges/causal | max diff out, grads |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e, p, c = r["edges"], r["predicate"], r["causal"]
        lines.append(f"| {r['case']} | {r['seqlen']} | {r['document_tokens']} | {e['fwd_ms']:.3f} / {p['fwd_ms']:.3f} / "
                     f"{c['fwd_ms']:.3f} | {e['bwd_ms']:.3f} / {p['bwd_ms']:.3f} / {c['bwd_ms']:.3f} | "
                     f"{r['bwd_ratio_edges_vs_predicate']:.3f} | {r['bwd_ratio_causal_vs_edges']:.3f} | "
                     f"{r['checks']['out_max_diff']:.2g}, {r['checks']['grad_max_diff']:.2g} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tag", default="")
    parser.add_argument("--dry", action="store_true", help=dry_run.__doc__.split(":")[0])
    args = parser.parse_args()
    if args.dry:
        dry_run()
    env = {**environment(), "date": time.strftime("%Y-%m-%d")}
    gpu = env.get("gpu", "cpu").lower().replace("nvidia ", "").split()[0]
    stem = args.out / f"{env['date']}-{gpu}-document-edges{args.tag}"
    rows = []
    for name, seqlen, documents in CASES:
        t0 = time.time()
        rows.append(run_case(name, seqlen, documents, args.rounds))
        print(json.dumps(rows[-1]), f"{time.time() - t0:.0f}s", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
        stem.with_suffix(".md").write_text(markdown(rows, env))
    print(markdown(rows, env))


if __name__ == "__main__":
    main()
