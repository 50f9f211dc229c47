"""A call the Gluon forward declines (packed sequences: flashgen.attention_varlen) runs the portable forward.
Session 37 changed the tiles it runs on without a GPU to time them: 64 x 64 past 128-wide tiles, 8 warps at
128 x 128, the family's three consumers' 192 rows as 64. This probe times that fallback ("default") against
the tiles it ran before (the family's own: "family_tiles") and the portable default's ("portable"), beside the
same tokens as a dense bhsd batch through flashgen.attention (the Gluon forward), SDPA's FlashAttention-2 and
cuDNN. bf16, 16 heads, 16384 tokens per call in equal-length sequences; do_bench medians of --rounds
interleaved rounds; every output is compared with SDPA flash's before it is timed.

    PYTHONPATH=. python3 benchmarks/probe_declined_fallback.py [--head-dims 64,128] [--rounds 3] [--dry]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from probes import checked_timings, figures, run_probe, table_head, variant_cells  # noqa: E402

HEAD_DIMS = (64, 128, 256, 96, 192)
VARIANTS = ("default", "family_tiles", "portable", "dense_default", "sdpa_flash", "cudnn")


def cases(args):
    dims = [int(d) for d in args.head_dims.split(",")] if args.head_dims else HEAD_DIMS
    return [dict(head_dim=d, causal=c, seqlen=s, heads=16, batch=16384 // s)
            for d in dims for s in (1024, 4096) for c in (False, True)]


def run_case(case, args):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashgen
    from flashgen import AttentionSpec, KernelConfig, default_config
    from flashgen.flops import attention_flops

    d, causal, s, h, b = (case[k] for k in ("head_dim", "causal", "seqlen", "heads", "batch"))
    gen = torch.Generator(device="cuda").manual_seed(s * 1000 + d)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    packed = [t.transpose(1, 2).reshape(b * s, h, d).contiguous() for t in (q, k, v)]
    cu = torch.arange(0, b * s + 1, s, device="cuda", dtype=torch.int32)
    spec = AttentionSpec(dtype="bf16", head_dim=d, num_heads=h, causal=causal)
    default = default_config(spec, None, s)
    portable = default_config(spec, None, s, hopper_ws=False)
    # before session 37: the portable forward on the family's tiles, its 192 rows (three consumers) as 64
    family = KernelConfig(BLOCK_M=default.BLOCK_M if default.BLOCK_M in (64, 128) else 64, BLOCK_N=default.BLOCK_N,
                          num_warps=default.num_warps, num_stages=default.num_stages)

    def varlen(config=None):
        return lambda: flashgen.attention_varlen(*packed, cu, cu, s, s, causal=causal, config=config)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    def as_bhsd(fn):  # a packed output read as the dense batch's, to compare
        return lambda: fn().reshape(b, s, h, d).transpose(1, 2)

    calls = {"default": as_bhsd(varlen()), "family_tiles": as_bhsd(varlen(family)),
             "portable": as_bhsd(varlen(portable)), "dense_default": lambda: flashgen.attention(q, k, v, causal=causal),
             "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION), "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}
    row = {"case": f"hd{d} S={s}" + (" causal" if causal else ""), "mode": "fwd", **case,
           "default_config": str(default), "family_tiles_config": str(family), "portable_config": str(portable)}
    checked_timings(row, calls, attention_flops(b, h, s, s, d, causal=causal), args.rounds,
                    ("family_tiles", "portable", "dense_default", "sdpa_flash", "cudnn"))
    return row


def markdown(rows, env):
    anchors = ("family_tiles", "portable", "sdpa_flash", "cudnn")
    lines = table_head("A declined Gluon call's portable fallback (packed sequences)", env,
                       "bf16 forward, TFLOP/s over visible pairs (do_bench medians of interleaved rounds); default = "
                       "flashgen.attention_varlen's default; ratios: anchor ms / default ms.",
                       ["case", *VARIANTS, *(f"vs {a}" for a in anchors), "default ms rounds"])
    for row in rows:
        cells = variant_cells(row, VARIANTS)
        ratios = [str(row.get(f"ratio_vs_{a}", "-")) for a in anchors]
        lines.append(f"| {row['case']} | " + " | ".join(cells + ratios) +
                     f" | {figures(row.get('default', {}).get('rounds_ms', []))} |")
    return "\n".join(lines) + "\n"


def dry_run():
    """Print the cases and exit: no GPU needed."""
    import argparse

    for case in cases(argparse.Namespace(head_dims=None)):
        print(case)
    raise SystemExit(0)


def add_arguments(parser):
    parser.add_argument("--head-dims", default=None, help="comma-separated head dims (default: 64,128,256,96,192)")


if __name__ == "__main__":
    run_probe(__doc__.splitlines()[0], "declined-fallback", cases, run_case, markdown, dry_run, add_arguments)
