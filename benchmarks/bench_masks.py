"""Masked and modified attention on the GPU: flashgen beside FlexAttention, same inputs, one process.

Cases (bf16, head dim 128, 16 heads, 16384 tokens per batch, S = 4096 and 16384): causal (the
baseline), sliding window 256, prefix-LM 512, 4 packed documents (causal within each), sink 4 +
window 1024, chunked 1024, softcap 50 (causal), ALiBi (causal). TFLOP/s count only the visible
(query, key) pairs (FlashAttention's convention, 3.5x for fwd+bwd). The forward takes the best
of a few tile configs (each checked against FlexAttention's output first); fwd+bwd runs that
forward with the default backward. Also: the cost of a custom expression's block map against
one attention call. Writes JSON and markdown to --out.

    PYTHONPATH=. python3 benchmarks/bench_masks.py --out benchmarks/results/masks
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flashgen  # noqa: E402
from flashgen import AttentionSpec, KernelConfig, default_config  # noqa: E402
from flashgen.bench import environment, flex_mods  # noqa: E402
from flashgen.flops import pairs_flops, tflops, visible_count  # noqa: E402
from flashgen.inputs import named_tensors  # noqa: E402
from flashgen.timing import time_ms  # noqa: E402

CASES = {
    "causal": dict(causal=True),
    "sliding_window_256": dict(mask={"sliding_window": {"left": 256, "right": 0}}),
    "prefix_lm_512": dict(mask={"prefix_lm": 512}),
    "document_4": dict(mask={"document": {}}),
    "sink_4_window_1024": dict(mask={"sink": {"tokens": 4, "window": 1024}}),
    "chunked_1024": dict(mask={"chunked": 1024}),
    "softcap_50": dict(causal=True, score_mod={"softcap": 50.0}),
    "alibi": dict(causal=True, score_mod={"alibi": {}}),
}
# (BLOCK_M, BLOCK_N, warps, stages, tma, warp_specialize)
FWD_SWEEP = [(128, 64, 8, 3, False, False), (64, 64, 4, 3, False, False), (128, 128, 8, 3, False, False),
             (64, 64, 4, 3, True, False), (128, 64, 8, 3, True, False), (128, 128, 8, 3, True, False),
             (128, 128, 8, 3, True, True)]


def run_case(name, fields, seqlen, tokens, heads, head_dim, modes):
    batch = max(1, tokens // seqlen)
    spec = AttentionSpec(name=name, dtype="bf16", head_dim=head_dim, num_heads=heads, backward=True, **fields)
    q, k, v, do = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    tensors = named_tensors(spec, batch, seqlen)
    pairs = visible_count(spec, batch, seqlen, seqlen, tensors)
    row = {"case": name, "seqlen": seqlen, "batch": batch, "visible_fraction": pairs / (batch * heads * seqlen ** 2)}
    flex = flex_mods(spec, q, k, tensors)
    ref = flex(q, k, v).float()
    base = default_config(spec)
    fwd = {}
    for bm, bn, w, s, tma, ws in FWD_SWEEP:
        cfg = base.replace(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, tma=tma, warp_specialize=ws)
        try:
            kernel = flashgen.compile(spec, cfg)
            err = (kernel(q, k, v, **tensors).float() - ref).abs().max().item()
            if not err < 3e-2:
                fwd[str(cfg)] = {"error": f"max|out - flex| = {err:.3g}"}
                continue
            fwd[str(cfg)] = {"ms": time_ms(lambda: kernel(q, k, v, **tensors)), "max_err": err, "config": cfg}
        except Exception as exc:  # report and go on
            fwd[str(cfg)] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    ok = {key: r for key, r in fwd.items() if "ms" in r}
    best_key = min(ok, key=lambda key: ok[key]["ms"])
    best = ok[best_key].pop("config")
    for r in ok.values():
        r.pop("config", None)
    row["flashgen_configs"] = fwd
    flops = pairs_flops(pairs, head_dim)
    if "fwd" in modes:
        row["fwd"] = {"flashgen": {"ms": ok[best_key]["ms"], "tflops": tflops(flops, ok[best_key]["ms"]),
                                   "config": best_key},
                      "flex": {"ms": (ms := time_ms(lambda: flex(q, k, v))), "tflops": tflops(flops, ms)}}
    if "fwd_bwd" in modes:
        kernel = flashgen.compile(spec, best)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        ours = lambda: torch.autograd.grad(kernel(*leaves, **tensors), leaves, do)  # noqa: E731
        theirs = lambda: torch.autograd.grad(flex(*leaves), leaves, do)  # noqa: E731
        errs = [(a.float() - b.float()).abs().max().item() for a, b in zip(ours(), theirs())]
        row["fwd_bwd"] = {"flashgen": {"ms": (ms := time_ms(ours)), "tflops": tflops(3.5 * flops, ms),
                                       "max_grad_err_vs_flex": max(errs)},
                          "flex": {"ms": (ms2 := time_ms(theirs)), "tflops": tflops(3.5 * flops, ms2)}}
    return row


def block_map_cost(seqlen, tokens, heads, head_dim):
    """A custom expression's block map, built from scratch, against one forward call that uses it."""
    batch = max(1, tokens // seqlen)
    spec = AttentionSpec(name="custom", dtype="bf16", head_dim=head_dim, num_heads=heads,
                         mask={"expr": "(q_idx >= kv_idx) & ((q_idx - kv_idx < window) | (kv_idx % stride == 0))",
                               "params": {"window": 256, "stride": 64}})
    kernel = flashgen.compile(spec)
    module = kernel.module()
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cfg = module.CONFIG

    def build():
        module._BLOCK_MAPS.clear()
        return module.block_map(batch, seqlen, seqlen, cfg["BLOCK_M"], cfg["BLOCK_N"], q.device, {})

    build_ms = time_ms(build)
    kernel(q, k, v)
    call_ms = time_ms(lambda: kernel(q, k, v))  # map cached: the attention alone
    pairs = visible_count(spec, batch, seqlen, seqlen)
    return {"seqlen": seqlen, "batch": batch, "block_map_ms": build_ms, "attention_ms": call_ms,
            "ratio": build_ms / call_ms, "attention_tflops": tflops(pairs_flops(pairs, head_dim), call_ms)}


def markdown(rows, costs, env):
    lines = [f"# Masked variants: flashgen vs FlexAttention ({env.get('gpu')}, torch {env['torch']}, "
             f"triton {env['triton']}, {env['date']})", "",
             "bf16, head dim 128, 16 heads, 16384 tokens per batch; TFLOP/s over the visible area only.", "",
             "| case | S | visible | fwd flashgen | fwd Flex | fwd ratio | fwd+bwd flashgen | fwd+bwd Flex | "
             "fwd+bwd ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f, b = r.get("fwd", {}), r.get("fwd_bwd", {})
        cell = lambda d, key: f"{d[key]['tflops']:.0f}" if key in d else "-"  # noqa: E731
        ratio = lambda d: f"{d['flashgen']['tflops'] / d['flex']['tflops']:.2f}" if d else "-"  # noqa: E731
        lines.append(f"| {r['case']} | {r['seqlen']} | {r['visible_fraction']:.3f} | {cell(f, 'flashgen')} | "
                     f"{cell(f, 'flex')} | {ratio(f)} | {cell(b, 'flashgen')} | {cell(b, 'flex')} | {ratio(b)} |")
    lines += ["", "Block map of a custom expression (built from scratch on the GPU) vs one forward call:", "",
              "| S | block map ms | attention ms | ratio |", "|---|---|---|---|"]
    for c in costs:
        lines.append(f"| {c['seqlen']} | {c['block_map_ms']:.3f} | {c['attention_ms']:.3f} | {c['ratio']:.3f} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/masks"))
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--cases", nargs="+", default=list(CASES))
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd_bwd"])
    args = parser.parse_args()
    env = {**environment(), "date": time.strftime("%Y-%m-%d")}
    args.out.mkdir(parents=True, exist_ok=True)
    costs = [block_map_cost(s, 16384, 16, 128) for s in args.seqlens]
    print(costs, flush=True)
    rows = []

    def save():  # after every case: a run cut short keeps what it measured
        (args.out / "masks.json").write_text(json.dumps({"environment": env, "rows": rows, "block_map": costs}, indent=1,
                                                        default=str))
        (args.out / "masks.md").write_text(markdown([r for r in rows if "error" not in r], costs, env))

    for seqlen in args.seqlens:
        for name in args.cases:
            t0 = time.time()
            try:
                rows.append(run_case(name, CASES[name], seqlen, 16384, 16, 128, args.modes))
            except Exception as exc:
                rows.append({"case": name, "seqlen": seqlen, "visible_fraction": 0.0,
                             "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            r = rows[-1]
            print(name, seqlen, {m: {k: round(v["tflops"]) for k, v in r[m].items()} for m in ("fwd", "fwd_bwd")
                                 if m in r}, r.get("error", ""), f"{time.time() - t0:.0f}s", flush=True)
            save()
    print(markdown([r for r in rows if "error" not in r], costs, env))


if __name__ == "__main__":
    main()
