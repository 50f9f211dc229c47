"""Head dims between the Gluon forward's 64, 128 and 256 (40, 80, 96, 160, 192: CLIP, diffusion UNets, Phi-3)
on the family at their padded width's default knobs, against the portable default's tiles with loads masked along
the head dim and with tensor descriptors (whose copy engine zero-fills the padding), cuDNN and SDPA's
FlashAttention-2. Forward, bf16, bhsd, 16 heads, 16384 tokens per call; cross-attention rows are diffusion's
(4096 latents over 77 text tokens, 8 heads, batch 8). do_bench medians of --rounds interleaved rounds; each
output is compared with SDPA flash's before it is timed.

    PYTHONPATH=. python3 benchmarks/probe_padded_head_dims.py [--head-dims 80,96] [--rounds 3] [--dry]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from probes import checked_timings, figures, run_probe, table_head, variant_cells  # noqa: E402

HEAD_DIMS = (40, 80, 96, 160, 192)
VARIANTS = ("default", "portable", "portable_tma", "cudnn", "sdpa_flash")


def cases(args):
    dims = [int(d) for d in args.head_dims.split(",")] if args.head_dims else HEAD_DIMS
    out = [dict(head_dim=d, causal=c, seqlen_q=s, seqlen_k=s, heads=16, batch=16384 // s)
           for d in dims for s in (1024, 4096) for c in (False, True)]
    return out + [dict(head_dim=d, causal=False, seqlen_q=4096, seqlen_k=77, heads=8, batch=8)
                  for d in dims if d in (40, 80, 160)]


def run_case(case, args):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashgen
    from flashgen import AttentionSpec, default_config
    from flashgen.flops import attention_flops

    d, causal, sq, sk, h, b = (case[k] for k in ("head_dim", "causal", "seqlen_q", "seqlen_k", "heads", "batch"))
    gen = torch.Generator(device="cuda").manual_seed(sq * 1000 + d)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for s in (sq, sk, sk))
    spec = AttentionSpec(dtype="bf16", head_dim=d, num_heads=h, causal=causal)
    default = default_config(spec, None, sq)
    portable = default_config(spec, None, sq, hopper_ws=False)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    # (the portable default at these head dims reads through descriptors since this probe's first run: both
    # settings are timed, "portable" with loads masked along the head dim as the default had them)
    calls = {"default": lambda: flashgen.attention(q, k, v, causal=causal),
             "portable": lambda: flashgen.attention(q, k, v, causal=causal, config=portable.replace(tma=False)),
             "portable_tma": lambda: flashgen.attention(q, k, v, causal=causal, config=portable.replace(tma=True)),
             "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION)}
    row = {"case": f"hd{d} S={sq}" + (f"x{sk}" if sk != sq else "") + (" causal" if causal else ""), "mode": "fwd",
           **case, "default_config": str(default), "portable_config": str(portable)}
    checked_timings(row, calls, attention_flops(b, h, sq, sk, d, causal=causal), args.rounds,
                    ("cudnn", "sdpa_flash", "portable"))
    return row


def markdown(rows, env):
    lines = table_head("Padded head dims on the Gluon forward", env,
                       "bf16 forward, TFLOP/s over visible pairs (do_bench medians of interleaved rounds); default = "
                       "flashgen.attention's default (the Gluon family at its padded width's knobs where served); "
                       "ratios: anchor ms / default ms.",
                       ["case", *VARIANTS, "vs cudnn", "vs sdpa_flash", "vs portable", "default ms rounds"])
    for row in rows:
        cells = variant_cells(row, VARIANTS)
        lines.append(f"| {row['case']} | " + " | ".join(cells) + f" | {row.get('ratio_vs_cudnn', '-')} | "
                     f"{row.get('ratio_vs_sdpa_flash', '-')} | {row.get('ratio_vs_portable', '-')} | "
                     f"{figures(row.get('default', {}).get('rounds_ms', []))} |")
    return "\n".join(lines) + "\n"


def dry_run():
    """Print the cases and exit: no GPU needed."""
    import argparse

    for case in cases(argparse.Namespace(head_dims=None)):
        print(case)
    raise SystemExit(0)


def add_arguments(parser):
    parser.add_argument("--head-dims", default=None, help="comma-separated head dims (default: 40,80,96,160,192)")


if __name__ == "__main__":
    run_probe(__doc__.splitlines()[0], "padded-head-dims", cases, run_case, markdown, dry_run, add_arguments)
