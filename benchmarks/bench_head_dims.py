"""flashgen.attention at the head dims and shapes models use beyond the standard table's 64 and 128:
32 (small ViTs), 80 (CLIP ViT-H, diffusion UNets), 96 (Phi-3), 160 (diffusion UNets' deepest level), 192
and 256 (Gemma), and diffusion's cross-attention (4096 image tokens over 77 text tokens), beside SDPA's
FlashAttention-2 and cuDNN backends on the same inputs.

Every provider's output (and gradients, fwd_bwd) is compared with SDPA flash's before it is timed; a
mismatch is recorded instead of a time. Timings are triton's do_bench medians, the median over --rounds
rounds in alternating provider order. FLOPs count visible pairs only (FlashAttention's convention).

    PYTHONPATH=. python3 benchmarks/bench_head_dims.py [--head-dims 80,96] [--rounds 2] [--dry]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from probes import alternating, max_abs_diff, run_probe, table_head  # noqa: E402

HEAD_DIMS = (32, 64, 80, 96, 128, 160, 192, 256)
SEQLENS = (1024, 4096)
TOKENS = 16384  # per call: batch = TOKENS // seqlen_q
HEADS = 16
PROVIDERS = ("flashgen", "sdpa_flash", "cudnn")
MODES = ("fwd", "fwd_bwd")
# diffusion UNets' cross-attention: 64 x 64 latents over CLIP's 77 text tokens, 8 heads, batch 8
# (classifier-free guidance doubles a batch of 4)
CROSS = [dict(head_dim=d, causal=False, seqlen_q=4096, seqlen_k=77, heads=8, batch=8) for d in (40, 80, 160)]


def cases(args):
    dims = [int(d) for d in args.head_dims.split(",")] if args.head_dims else HEAD_DIMS
    if args.cross_only:  # cross-attention at the given head dims (any of them)
        return [dict(CROSS[0], head_dim=d) for d in dims]
    out = [dict(head_dim=d, causal=c, seqlen_q=s, seqlen_k=s, heads=HEADS, batch=TOKENS // s)
           for d in dims for s in SEQLENS for c in (False, True)]
    if not args.no_cross:
        out += [c for c in CROSS if not args.head_dims or c["head_dim"] in dims]
    return out


def run_case(case, args):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    import flashgen
    from flashgen.flops import attention_flops, tflops
    from flashgen.timing import time_ms

    d, causal, sq, sk, h, b = (case[k] for k in ("head_dim", "causal", "seqlen_q", "seqlen_k", "heads", "batch"))
    gen = torch.Generator(device="cuda").manual_seed(sq * 1000 + d)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for s in (sq, sk, sk))
    do = torch.randn(b, h, sq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def sdpa(backend):
        def run(q_, k_, v_):
            with sdpa_kernel(backend):
                # SDPA's causal is top-left; at seqlen_q == seqlen_k it is flashgen's causal too
                return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal)
        return run

    attn = {"flashgen": lambda q_, k_, v_: flashgen.attention(q_, k_, v_, causal=causal),
            "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION), "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}
    label = f"hd{d} S={sq}" + (f"x{sk}" if sk != sq else "") + (" causal" if causal else "")
    rows = []
    for mode in MODES:
        flops = attention_flops(b, h, sq, sk, d, causal=causal, mode=mode)
        steps, results, ref, first = {}, {}, None, None
        for name in PROVIDERS:
            fn = attn[name]
            step = ((lambda fn=fn: (fn(q, k, v),)) if mode == "fwd" else
                    (lambda fn=fn: torch.autograd.grad(fn(*leaves), leaves, do)))
            try:
                out = step()
            except Exception as exc:  # an anchor that cannot run this shape is reported, not fatal
                results[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
                continue
            if ref is None:
                ref, first = out, name
            elif (err := max_abs_diff(out, ref)) > 0.1:
                results[name] = {"error": f"max |{name} - {first}| = {err:.3g}"}
                continue
            steps[name] = step
        times = alternating(steps, args.rounds, lambda name: time_ms(steps[name]))
        for name, ms in times.items():
            med = statistics.median(ms)
            results[name] = {"ms": round(med, 4), "tflops": round(tflops(flops, med), 1), "rounds_ms": ms}
        row = {"case": label, "mode": mode, **case, **results}
        for anchor in ("sdpa_flash", "cudnn"):
            if "ms" in results.get("flashgen", {}) and "ms" in results.get(anchor, {}):
                row[f"ratio_vs_{anchor}"] = round(results[anchor]["ms"] / results["flashgen"]["ms"], 3)
        rows.append(row)
    return rows


def markdown(rows, env):
    lines = table_head("flashgen.attention's default at other head dims and cross-attention", env,
                       "bf16, bhsd, 16 heads and 16384 tokens per call (cross-attention: 8 heads, batch 8); "
                       "TFLOP/s over visible pairs, do_bench median; ratio = anchor ms / flashgen ms.",
                       ["case", "mode", "flashgen", "sdpa_flash", "cudnn", "vs sdpa_flash", "vs cudnn"])
    for row in rows:
        cell = (lambda p: str(row[p]["tflops"]) if "tflops" in row.get(p, {}) else
                row.get(p, {}).get("error", "-")[:40])
        lines.append(f"| {row['case']} | {row['mode']} | {cell('flashgen')} | {cell('sdpa_flash')} | "
                     f"{cell('cudnn')} | {row.get('ratio_vs_sdpa_flash', '-')} | {row.get('ratio_vs_cudnn', '-')} |")
    return "\n".join(lines) + "\n"


def dry_run():
    """Print the cases and exit: no GPU needed."""
    import argparse

    for case in cases(argparse.Namespace(head_dims=None, no_cross=False, cross_only=False)):
        print(case)
    raise SystemExit(0)


def add_arguments(parser):
    parser.add_argument("--head-dims", default=None, help="comma-separated head dims (default: all)")
    parser.add_argument("--no-cross", action="store_true", help="leave out the cross-attention cases")
    parser.add_argument("--cross-only", action="store_true",
                        help="only cross-attention (4096 x 77 keys, 8 heads, batch 8), at each of --head-dims")


if __name__ == "__main__":
    run_probe(__doc__.splitlines()[0], "head-dims", cases, run_case, markdown, dry_run, add_arguments)
