"""Packed sequences (flashgen.attention_varlen, layout 'thd') on the user path: the default, which on an sm90 GPU
runs the Gluon forward's persistent packed kernel for sequences of one length on a persistent config and the
one-tile packed kernel for the rest (but where HopperForward.packed_declines sends them to the portable forward), against the
portable forward's default on the same call ("portable": what packed calls ran before), and the same tokens as a dense bhsd batch through
flashgen.attention, SDPA's FlashAttention-2 and cuDNN. bf16, 16 heads, 16384 tokens per call: equal-length
sequences (the dense anchors' batch), and "mixed" rows of sequences of random lengths between a quarter of S and S
(no dense anchor: the default against the portable forward, FLOPs counted per sequence). do_bench medians of
--rounds interleaved rounds; every output is compared with the reference's before it is timed (SDPA flash's;
the portable forward's in mixed rows).

    PYTHONPATH=. python3 benchmarks/bench_packed.py [--head-dims 64,96,128] [--seqlens 1024,4096] [--variants]
        [--rounds 3] [--dry]
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from probes import checked_timings, figures, run_probe, table_head, variant_cells  # noqa: E402

HEAD_DIMS = (64, 96, 128)
TOKENS, HEADS = 16384, 16
VARIANTS = ("default", "portable", "dense_default", "sdpa_flash", "cudnn")
ANCHORS = ("portable", "dense_default", "sdpa_flash", "cudnn")


# --variants: the Gluon packed kernel on the default's knobs ("packed_kernel"), on the one-tile grid where the
# default is persistent ("one_tile"), with O by pointers only where the default stores by TMA ("o_by_pointers")
# and on other consumer counts (each the default config with these knobs),
# whatever HopperForward.packed_declines says (research: which a packed call should take)
GLUON_VARIANTS = {"two_consumers": dict(BLOCK_M=128, hopper_regs=240),
                  "one_consumer": dict(BLOCK_M=64, num_stages=3, hopper_regs=240)}


def cases(args):
    dims = [int(d) for d in args.head_dims.split(",")] if args.head_dims else HEAD_DIMS
    lengths = [int(n) for n in args.seqlens.split(",")] if args.seqlens else (1024, 4096)
    return [dict(head_dim=d, causal=c, seqlen=s, mixed=m) for d in dims for s in lengths for m in (False, True)
            for c in (False, True)]


def mixed_lengths(seqlen: int, seed: int) -> list[int]:
    """Random sequence lengths in [seqlen / 4, seqlen] adding up to TOKENS (the last one cut to fit)."""
    rng, lengths = random.Random(seed), []
    while sum(lengths) < TOKENS:
        lengths.append(min(rng.randint(seqlen // 4, seqlen), TOKENS - sum(lengths)))
    return lengths


def forced_packed(module, packed, cu, longest):
    """A call of the module's packed kernel whatever HopperForward.packed_declines says
    (--variants: what a declined call would have run), into its own out buffer (a plan of its own, not the default
    call's)."""
    import torch

    from flashgen.runtime.hopper import HopperForward, HopperPlan

    out = torch.empty_like(packed[0])

    def run():
        forced = {"PACKED_THREE_MEAN": 0, "PACKED_CAUSAL_MEAN": 0, "PACKED_CAUSAL_MEAN_HD64": 0}
        saved = {name: getattr(HopperForward, name) for name in forced}
        for name, value in forced.items():
            setattr(HopperForward, name, value)
        try:
            module.forward(*packed, layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                           max_seqlen_k=longest, out=out)
        finally:
            for name, value in saved.items():
                setattr(HopperForward, name, value)
        assert any(isinstance(plan, HopperPlan) and plan.packed for plan in module._LAUNCHER.plans.values())
        return out
    return run


def run_case(case, args):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashgen
    from flashgen import AttentionSpec, default_config
    from flashgen.config import DEFAULT_BUCKETS
    from flashgen.flops import attention_flops
    from flashgen.runtime.host import nearest_bucket

    if args.persistent_mixed:  # (the static walk over sequences of unequal length)
        from flashgen.runtime.hopper import HopperForward

        HopperForward.equal_lengths = staticmethod(lambda varlen, total_q, total_k: True)
    d, causal, s, mixed = (case[k] for k in ("head_dim", "causal", "seqlen", "mixed"))
    lengths = mixed_lengths(s, s * 1000 + d) if mixed else [s] * (TOKENS // s)
    gen = torch.Generator(device="cuda").manual_seed(s * 1000 + d)
    packed = [torch.randn(TOKENS, HEADS, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    longest = max(lengths)
    spec = AttentionSpec(dtype="bf16", head_dim=d, num_heads=HEADS, causal=causal)
    bucket = nearest_bucket(longest, DEFAULT_BUCKETS)  # the config a call of this longest sequence gets
    portable = default_config(spec, None, bucket, hopper_ws=False)

    def varlen(config=None):
        return lambda: flashgen.attention_varlen(*packed, cu, cu, longest, longest, causal=causal, config=config)

    calls = {"default": varlen(), "portable": varlen(portable)}
    timed = {}  # the dense calls as a user makes them (their outputs converted to the packed layout to be checked)
    default = default_config(spec, None, bucket)
    if args.variants and default.family == "hopper_ws":
        configs = {"packed_kernel": default, **{name: default.replace(**knobs) for name, knobs in GLUON_VARIANTS.items()
                                                if knobs.get("BLOCK_M", 0) != default.BLOCK_M}}
        if default.hopper_persistent:  # the default's knobs on the one-tile grid
            configs["one_tile"] = default.replace(hopper_persistent=False)
        if default.hopper_tma_store:  # O by pointers only (the packed kernels' store before session 41)
            configs["o_by_pointers"] = default.replace(hopper_tma_store=False)
        calls.update({name: forced_packed(flashgen.compile(spec, config).module(), packed, cu, longest)
                      for name, config in configs.items()})
    if not mixed:  # the same tokens as a dense batch of equal-length sequences
        b = TOKENS // s
        q, k, v = (t.reshape(b, s, HEADS, d).transpose(1, 2).contiguous() for t in packed)

        def sdpa(backend):
            def run():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return run

        timed.update(dense_default=lambda: flashgen.attention(q, k, v, causal=causal),
                     sdpa_flash=sdpa(SDPBackend.FLASH_ATTENTION), cudnn=sdpa(SDPBackend.CUDNN_ATTENTION))
        calls.update({name: (lambda fn: lambda: fn().transpose(1, 2).reshape(TOKENS, HEADS, d))(fn)
                      for name, fn in timed.items()})
    row = {"case": f"hd{d} S={s}" + (" mixed" if mixed else "") + (" causal" if causal else ""), "mode": "fwd",
           **case, "sequences": len(lengths), "longest": longest, "default_config": str(default),
           "portable_config": str(portable)}
    flops = sum(attention_flops(1, HEADS, n, n, d, causal=causal) for n in lengths)
    checked_timings(row, calls, flops, args.rounds, ANCHORS, reference="portable" if mixed else "sdpa_flash",
                    timed=timed)
    return row


def markdown(rows, env):
    variants = [*VARIANTS, *(v for v in ("packed_kernel", "one_tile", "o_by_pointers", *GLUON_VARIANTS)
                             if any(v in row for row in rows))]
    lines = table_head("Packed sequences (attention_varlen) on the user path", env,
                       f"bf16 forward, {HEADS} heads, {TOKENS} tokens per call, TFLOP/s over visible pairs (do_bench "
                       "medians of interleaved rounds); default = flashgen.attention_varlen's default; portable = "
                       "the portable forward's default on the same call; dense_default, sdpa_flash, cudnn: the same "
                       "tokens as a dense batch; ratios: anchor ms / default ms.",
                       ["case", *variants, *(f"vs {a}" for a in ANCHORS), "default ms rounds"])
    for row in rows:
        ratios = [str(row.get(f"ratio_vs_{a}", "-")) for a in ANCHORS]
        lines.append(f"| {row['case']} | " + " | ".join(variant_cells(row, variants) + ratios) +
                     f" | {figures(row.get('default', {}).get('rounds_ms', []))} |")
    return "\n".join(lines) + "\n"


def dry_run():
    """Print the cases and exit: no GPU needed."""
    import argparse

    for case in cases(argparse.Namespace(head_dims=None, seqlens=None)):
        print(case, len(mixed_lengths(case["seqlen"], 0)) if case["mixed"] else "")
    raise SystemExit(0)


def add_arguments(parser):
    parser.add_argument("--head-dims", default=None, help="comma-separated head dims (default: 64,96,128)")
    parser.add_argument("--seqlens", default=None, help="comma-separated sequence lengths S (default: 1024,4096)")
    parser.add_argument("--variants", action="store_true",
                        help="also time the Gluon packed kernel on other consumer counts (GLUON_VARIANTS)")
    parser.add_argument("--persistent-mixed", action="store_true",
                        help="research: read every packed call as sequences of one length, so that a persistent "
                             "default runs the persistent packed kernel on mixed lengths too")


if __name__ == "__main__":
    run_probe(__doc__.splitlines()[0], "packed", cases, run_case, markdown, dry_run, add_arguments)
