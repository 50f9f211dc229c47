"""What the document predicate costs in the boundary blocks (issue 15), on the GPU.

Causal documents' backward runs 2-8% slower than plain causal on the same work (the H100, default
configs; results/2026-11-26-h100-document-edges.md). Testing ``kv <= q`` alone in a loop of its own
(aff8400) lost more to the extra loop than it saved. This bounds what any cheaper predicate can
gain: the documents' kernels rendered with causal's predicate in place of theirs (exact on these
block-aligned documents, where a boundary block lies in one document: the ids agree on every pair
it holds), the segments' lookups (the ids' runs table since 2026-11-27; binary searches before) and
everything else unchanged:

- per case: forward and backward GPU time (each call replayed from a CUDA graph; median ms), for
  ``predicate`` (today's kernels), ``causal_predicate`` (the ids' test left out) and ``causal``
  (the causal spec at the document length, the same configs);
- each variant checked against the other on the same inputs first (outputs and gradients equal
  to bf16 rounding: the two compute the same pairs);
- rounds alternate the variants' order.

--gluon runs every variant's backward on the Gluon dK/dV kernel (hopper_bwd; its masks since
2026-11-27), where documents ran 0.85-0.94x the portable default while causal gains: variant
``masked_causal`` (causal written as the pattern prefix_lm 0, the mask path's arithmetic ranges and
predicate, no ids and no searches, on the causal inputs) separates what the mask path costs from
what the documents' searches and ids cost. Variant ``arithmetic``: the documents' kernels with
causal's predicate and each block's range computed from the (known, constant) document length, so
no id and no table is read: what the range lookups cost beside the predicate.

    PYTHONPATH=. python3 benchmarks/probe_document_predicate.py [--rounds 3] [--gluon] \
        [--variants masked_causal arithmetic]
"""

from __future__ import annotations

import os
import re
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
from flashgen.codegen.plan import KernelPlan  # noqa: E402
from flashgen.config import default_config  # noqa: E402
from flashgen.flops import pairs_flops, tflops, visible_count  # noqa: E402
from flashgen.inputs import named_tensors  # noqa: E402
from flashgen.timing import wall_ms  # noqa: E402
from probes import graph_ms, interleaved_ms, max_abs_diff, run_probe, table_head  # noqa: E402

TOKENS, HEADS, HEAD_DIM, DTYPE, DEVICE = 16384, 16, 128, "bf16", "cuda"
CASES = [("document_4", 4096, 4), ("document_16", 4096, 16), ("document_4", 16384, 4), ("document_16", 16384, 16)]


GLUON_FORWARD = dict(family="hopper_ws", BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3, tma=False,
                     warp_specialize=False)  # prefix-LM's Gluon default (config._hopper_ws_default)


def config(spec: AttentionSpec, seqlen: int, gluon: bool = False, gluon_forward: bool = False):
    """The documents' default config at seqlen (gluon: with the Gluon dK/dV kernel; gluon_forward:
    the Gluon forward at 128x128, 3 stages)."""
    cfg = default_config(spec, seqlen=seqlen)
    cfg = cfg.replace(**GLUON_FORWARD) if gluon_forward else cfg
    return cfg.replace(hopper_bwd=True) if gluon else cfg


def arithmetic_segments(source: str, doc_len: int) -> str:
    """source with the documents' segment lookups (runs table) replaced by arithmetic on a known, constant
    document length (exact only for documents of doc_len tokens each, block-aligned): no id is
    read to find a block's range."""
    kv, q = source.split("def _q_segments", 1)
    kv_head, kv_body = kv.split("def _kv_segments", 1)
    searches = {  # the searches' results: kv (first key of r0's / r1's document), q (one past c1's / c0's)
        "kv": (f"r0 // {doc_len} * {doc_len}", f"r1 // {doc_len} * {doc_len}"),
        "q": (f"(c1 // {doc_len} + 1) * {doc_len}", f"(c0 // {doc_len} + 1) * {doc_len}")}

    def replace(body, axis):
        first, second = searches[axis]
        body, n0 = re.subn(r"^    s0 = .*$", f"    s0 = {first}", body, count=1, flags=re.M)
        body, n1 = re.subn(r"^    s1 = .*$", f"    s1 = {second}", body, count=1, flags=re.M)
        assert n0 == n1 == 1, "the segments' lookups moved"
        return body

    return kv_head + "def _kv_segments" + replace(kv_body, "kv") + "def _q_segments" + replace(q, "q")


def build(spec: AttentionSpec, seqlen: int, variant: str = "predicate", gluon: bool = False,
          gluon_forward: bool = False, doc_len: int = 0):
    """The default config's module for spec at seqlen: as rendered (predicate), with causal's
    predicate (causal_predicate), with causal's predicate and the segments computed from the known
    document length doc_len (arithmetic: no id read at all). (The search<N> variants of 2026-11-26
    widened the segments' binary searches, which the runs tables replaced on 2026-11-27.)"""
    cfg = config(spec, seqlen, gluon, gluon_forward)
    saved = KernelPlan.visible_code
    if variant in ("causal_predicate", "arithmetic"):
        KernelPlan.visible_code = lambda self, dialect="triton": "(cols < seqlen_k) & (cols <= rows)"
    try:
        source = render.render(spec, cfg, standalone=False)
    finally:
        KernelPlan.visible_code = saved
    if variant == "arithmetic":
        source = arithmetic_segments(source, doc_len)
    return import_path(cached_source_path(f"{spec.uri}-{variant}", source)), cfg


def dry_run() -> None:
    """Shake the script out on the CPU (Triton's interpreter, fp16, 2 heads, hd32, 1/32 of the
    lengths); the figures mean nothing."""
    global TOKENS, HEADS, HEAD_DIM, DTYPE, DEVICE, graph_ms
    TOKENS, HEADS, HEAD_DIM, DTYPE, DEVICE = 512, 2, 32, "fp16", "cpu"
    CASES[:] = [(n, s // 32, d) for n, s, d in CASES[:2]]

    graph_ms = wall_ms


def run_case(case, args) -> dict:
    (name, seqlen, documents), rounds, more = case, args.rounds, args.variants
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
    gluon, gluon_forward = getattr(args, "gluon", False), getattr(args, "gluon_forward", False)
    for label in ("predicate", "causal_predicate", *(m for m in more if m != "masked_causal")):
        module, cfg = build(spec, seqlen, label, gluon, gluon_forward, doc_len)
        variants[label] = (module, (q, k, v, do), tensors, cfg)
    # the causal kernels at the documents' configs (the same tiles), on the documents' length
    cfg = config(spec, seqlen, gluon, gluon_forward)
    variants["causal"] = (render.build_module(causal, cfg), tuple(split), {}, cfg)
    if "masked_causal" in more:  # causal through the mask path: prefix_lm 0
        masked = AttentionSpec(name="masked_causal", dtype=DTYPE, head_dim=HEAD_DIM, num_heads=HEADS, backward=True,
                               mask={"prefix_lm": 0})
        variants["masked_causal"] = (render.build_module(masked, cfg), tuple(split), {}, cfg)

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
    (o1, _), (o2, _) = results["predicate"][0](), results["causal_predicate"][0]()
    g1, g2 = results["predicate"][1](), results["causal_predicate"][1]()
    checks["out_max_diff"] = max_abs_diff((o1,), (o2,))
    checks["grad_max_diff"] = max_abs_diff(g1[:3], g2[:3])
    for label in more:  # the same blocks and pairs as today's kernels: equal bit for bit (masked_causal: as causal)
        base = results["causal"] if label == "masked_causal" else results["predicate"]
        (o0, _), g0 = base[0](), base[1]()
        (o3, _), g3 = results[label][0](), results[label][1]()
        checks[f"{label}_max_diff"] = max_abs_diff((o0, *g0[:3]), (o3, *g3[:3]))
    times = interleaved_ms(results, rounds, graph_ms)
    fwd_flops, bwd_flops = pairs_flops(pairs, HEAD_DIM, mode="fwd"), pairs_flops(pairs, HEAD_DIM, mode="fwd_bwd")
    row = {"case": name, "seqlen": seqlen, "batch": batch, "document_tokens": doc_len, "checks": checks,
           "variants": list(more), "config": str(variants["predicate"][3]),
           "backward": variants["predicate"][3].describe_backward()}
    for label in variants:
        f, b = statistics.median(times[label]["fwd"]), statistics.median(times[label]["bwd"])
        row[label] = {"fwd_ms": f, "bwd_ms": b, "fwd_bwd_ms": f + b, "fwd_tflops": tflops(fwd_flops, f),
                      "fwd_bwd_tflops": tflops(bwd_flops, f + b), "spread_bwd": [min(times[label]["bwd"]),
                                                                               max(times[label]["bwd"])]}
    row["bwd_ratio_causal_predicate_vs_predicate"] = row["predicate"]["bwd_ms"] / row["causal_predicate"]["bwd_ms"]
    row["fwd_ratio_causal_predicate_vs_predicate"] = row["predicate"]["fwd_ms"] / row["causal_predicate"]["fwd_ms"]
    row["bwd_ratio_causal_vs_predicate"] = row["predicate"]["bwd_ms"] / row["causal"]["bwd_ms"]
    return row


def markdown(rows, env) -> str:
    lines = table_head(
        "Documents' predicate: its cost in the boundary blocks", env,
        "bf16, hd128, 16 heads, 16384 tokens per batch, default configs (or, where the configs below say "
        "hopper_ws / hopper_bwd, the Gluon kernels: --gluon-forward, --gluon); GPU ms per call replayed from a CUDA "
        "graph (median of the rounds). predicate = today's kernels, causal pred. = the same kernels with causal's "
        "predicate (no ids read in boundary blocks; exact on these documents), causal = plain causal on each "
        "document as its own sequence (same configs). Ratios: time / the other's. Configs: "
        + "; ".join(sorted({f"{r['config']} | {r['backward']}" for r in rows})) + ".",
        ["case", "S", "doc tokens", "fwd predicate / causal pred. / causal", "bwd predicate / causal pred. / causal",
         "bwd predicate / causal pred.", "bwd predicate / causal", "max diff out, grads"])
    for r in rows:
        e, p, c = r["predicate"], r["causal_predicate"], r["causal"]
        lines.append(f"| {r['case']} | {r['seqlen']} | {r['document_tokens']} | {e['fwd_ms']:.3f} / "
                     f"{p['fwd_ms']:.3f} / {c['fwd_ms']:.3f} | {e['bwd_ms']:.3f} / {p['bwd_ms']:.3f} / "
                     f"{c['bwd_ms']:.3f} | {r['bwd_ratio_causal_predicate_vs_predicate']:.3f} | "
                     f"{r['bwd_ratio_causal_vs_predicate']:.3f} | "
                     f"{r['checks']['out_max_diff']:.2g}, {r['checks']['grad_max_diff']:.2g} |")
    more = rows[0].get("variants", []) if rows else []
    if more:
        lines += ["", "Other variants of the documents' kernels (arithmetic: the segments from the known document "
                  "length and causal's predicate, no id read; masked_causal: causal as the pattern prefix_lm 0, "
                  "on causal's inputs, its max diff against causal's), GPU ms and today's / theirs:", "",
                  "| case | S | variant | fwd ms | bwd ms | fwd ratio | bwd ratio | max diff vs today's |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            for label in more:
                x, p = r[label], r["predicate"]
                lines.append(f"| {r['case']} | {r['seqlen']} | {label} | {x['fwd_ms']:.3f} | {x['bwd_ms']:.3f} | "
                             f"{p['fwd_ms'] / x['fwd_ms']:.3f} | {p['bwd_ms'] / x['bwd_ms']:.3f} | "
                             f"{r['checks'][label + '_max_diff']:.2g} |")
    return "\n".join(lines) + "\n"




def add_arguments(parser) -> None:
    parser.add_argument("--variants", nargs="*", default=[],
                        help="also time these (arithmetic: no id read; masked_causal: causal through the mask path)")
    parser.add_argument("--gluon", action="store_true", help="every variant's dK/dV on the Gluon kernel (hopper_bwd)")
    parser.add_argument("--gluon-forward", action="store_true", help="every variant's forward on the Gluon kernel "
                                                                     "(family hopper_ws, 128x128, 3 stages)")


if __name__ == "__main__":
    run_probe(__doc__.split("\n")[0], "document-predicate", CASES, run_case, markdown, dry_run, add_arguments)
