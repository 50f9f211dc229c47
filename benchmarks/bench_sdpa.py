"""flashgen.scaled_dot_product_attention against torch's, as an SDPA user calls it (issue 13, item 4).

Cases (bf16, 16 heads, head dim 128): is_causal; a bool (L, S) lower-triangular mask (the causal mask a
model builds itself); a bool (B, 1, 1, S) padding mask (the last quarter of the keys padded); a float
(B, 16, L, S) additive bias. Modes: forward (no grad) and forward + backward (gradients of q, k, v).
Providers: flashgen.scaled_dot_product_attention and torch's F.scaled_dot_product_attention with its
own backend choice (the anchor, `sdpa`: what a user replaces) and, for the masked cases, its
memory-efficient backend forced (`sdpa_efficient`; flash takes no mask). Each provider's output is
checked against torch's math in float32 first. Per provider: host_us (CPU time per call, no sync
inside the loop) and gpu_ms (triton's do_bench median); ratio_vs_sdpa = sdpa's gpu_ms / flashgen's.

    PYTHONPATH=. python3 benchmarks/bench_sdpa.py [--repeat 3] [--tag s49]
Writes benchmarks/results/<date>-<gpu>-call-path-sdpa<tag>.json and .md (or under --out).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import flashgen  # noqa: E402
from bench_call_path import host_us  # noqa: E402
from flashgen.bench import environment, file_tag, gpu_tag  # noqa: E402

ANCHOR = "sdpa"
HEADS, DIM = 16, 128
# (name, batch, seqlen)
CASES = [("is_causal", 1, 128), ("is_causal", 1, 512), ("is_causal", 4, 2048),
         ("bool causal (L, S)", 1, 128), ("bool causal (L, S)", 1, 512), ("bool causal (L, S)", 4, 2048),
         ("bool padding (B, 1, 1, S)", 4, 512), ("bool padding (B, 1, 1, S)", 4, 2048),
         ("float bias (B, H, L, S)", 4, 512)]


def inputs(kind, batch, seqlen):
    """(q, k, v, keyword arguments of the call) of one case, on fresh random inputs."""
    q, k, v = (torch.randn(batch, HEADS, seqlen, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    if kind == "is_causal":
        return q, k, v, {"is_causal": True}
    if kind.startswith("bool causal"):
        return q, k, v, {"attn_mask": torch.ones(seqlen, seqlen, device="cuda", dtype=torch.bool).tril()}
    if kind.startswith("bool padding"):
        keep = torch.arange(seqlen, device="cuda") < seqlen - seqlen // 4
        return q, k, v, {"attn_mask": keep.expand(batch, 1, 1, seqlen).contiguous()}
    bias = torch.randn(batch, HEADS, seqlen, seqlen, device="cuda", dtype=torch.bfloat16)
    return q, k, v, {"attn_mask": bias}


def providers(kind):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def efficient(q, k, v, **kw):
        return F.scaled_dot_product_attention(q, k, v, **kw)
    efficient.context = lambda: sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)
    fns = {"flashgen": flashgen.scaled_dot_product_attention, ANCHOR: F.scaled_dot_product_attention}
    if kind != "is_causal":
        fns["sdpa_efficient"] = efficient
    return fns


def measure(row, name, attn, q, k, v, kw, mode):
    """One provider's check against torch's math in float32, then its host_us and gpu_ms, into row."""
    from triton.testing import do_bench

    with torch.no_grad():
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                             **{n: t.float() if n == "attn_mask" and t.is_floating_point() else t
                                                for n, t in kw.items()})
        err = (attn(q, k, v, **kw).float() - ref).abs().max().item()
    if not err < 0.05:
        raise AssertionError(f"max |out - SDPA math| = {err:.4f}")
    if mode == "forward":
        def step():
            with torch.no_grad():
                attn(q, k, v, **kw)
    else:
        do = torch.randn_like(q)

        def step():
            torch.autograd.grad(attn(q, k, v, **kw), (q, k, v), do)
    row[f"{name}_host_us"] = round(host_us(step), 1)
    row[f"{name}_gpu_ms"] = round(do_bench(step, return_mode="median"), 4)


def run_case(kind, batch, seqlen, mode, reverse):
    q, k, v, kw = inputs(kind, batch, seqlen)
    row = {"case": f"{kind} B={batch} H={HEADS} S={seqlen} hd{DIM} bf16", "mode": mode}
    fns = providers(kind)
    for name in list(fns)[::-1] if reverse else list(fns):
        try:
            with getattr(fns[name], "context", contextlib.nullcontext)():
                measure(row, name, fns[name], q, k, v, kw, mode)
        except Exception as exc:  # noqa: BLE001 - one provider's failure is recorded, the run goes on
            row.setdefault("errors", {})[name] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            traceback.print_exc()
    for name in fns:
        if name != "flashgen" and row.get(f"{name}_gpu_ms") and row.get("flashgen_gpu_ms"):
            row[f"ratio_vs_{name}"] = round(row[f"{name}_gpu_ms"] / row["flashgen_gpu_ms"], 3)
            row[f"host_ratio_vs_{name}"] = round(row[f"{name}_host_us"] / row["flashgen_host_us"], 3)
    print(json.dumps(row), flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                        help="directory for the .json and .md results")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the table this many times, providers in alternating order; the .md adds the "
                             "median ratio per row")
    parser.add_argument("--tag", default="", type=file_tag, help="file name suffix: v2 (or -v2) writes ...-v2")
    args = parser.parse_args()
    rows = [dict(run_case(kind, b, s, mode, reverse=i % 2 == 1), run=i)
            for i in range(args.repeat) for kind, b, s in CASES for mode in ("forward", "fwd+bwd")]
    env = environment()
    out = Path(args.out) / f"{datetime.date.today()}-{gpu_tag(env)}-call-path-sdpa{args.tag}"
    out.with_suffix(".json").write_text(json.dumps({"environment": env, "anchor": ANCHOR, "rows": rows}, indent=1)
                                        + "\n")
    names = ["flashgen", ANCHOR, "sdpa_efficient"]
    lines = [f"flashgen.scaled_dot_product_attention vs torch's | {env.get('gpu')} | torch {env.get('torch')} | "
             f"triton {env.get('triton')}", "",
             "| case | mode | run | " + " | ".join(f"{n} host us / gpu ms" for n in names)
             + f" | ratio_vs_{ANCHOR} | host_ratio_vs_{ANCHOR} |", "|---" * (len(names) + 5) + "|"]
    for r in rows:
        cells = [f"{r.get(f'{n}_host_us', '-')} / {r.get(f'{n}_gpu_ms', '-')}" for n in names]
        lines.append(f"| {r['case']} | {r['mode']} | {r['run']} | " + " | ".join(cells)
                     + f" | {r.get(f'ratio_vs_{ANCHOR}', '-')} | {r.get(f'host_ratio_vs_{ANCHOR}', '-')} |")
    if args.repeat > 1:
        lines += ["", f"| case | mode | median ratio_vs_{ANCHOR} (spread) |", "|---|---|---|"]
        for case, mode in dict.fromkeys((r["case"], r["mode"]) for r in rows):
            ratios = [r[f"ratio_vs_{ANCHOR}"] for r in rows
                      if (r["case"], r["mode"]) == (case, mode) and f"ratio_vs_{ANCHOR}" in r]
            if ratios:
                lines.append(f"| {case} | {mode} | {statistics.median(ratios):.3f} ({min(ratios):.3f}-"
                             f"{max(ratios):.3f}) |")
    errors = [(r["case"], r["mode"], r["errors"]) for r in rows if r.get("errors")]
    lines += [f"\nerror: {case} {mode}: {json.dumps(e)}" for case, mode, e in errors]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
