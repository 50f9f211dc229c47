"""Which dK/dV kernel (and tiles) the backward's default should take at head dim 128 (or --head-dim), per case.

Variants of the call's default config (flashgen.default_config at that length; each keeps the default's other
backward knobs: its launch order, fused delta), each the whole backward:
  default    the default as it stands
  portable   the portable dK/dV kernel, with the separate dQ kernel
  separate   the Gluon warp-specialized dK/dV kernel (hopper_bwd), with the separate dQ kernel
  atomic     the Gluon kernel adding dQ itself by the copy engine (dq_strategy 'atomic')
  cudnn      SDPA pinned to cuDNN (K/V expanded to every query head for GQA)
  sdpa_flash SDPA pinned to its FlashAttention-2 kernels (the same expansion)
Cases: causal and not, 16 heads at 1024-4096 tokens (16384 per batch), and causal GQA (Llama's 16 / 4 heads,
32 / 8 as tuning_db's gqa-causal spec), bf16, bshd. Every variant's gradients are checked against cuDNN's
(max abs error in the row); backward ms = fwd+bwd - fwd (do_bench medians, host time included) over
interleaved rounds. An anchor that refuses a case (a head dim its kernels lack) is left out of that row.

    PYTHONPATH=. python3 benchmarks/probe_bwd_defaults.py [--rounds 3] [--tag TAG] [--dry] [--head-dim 128]
        [--cases B:S:H:KV:CAUSAL,...] [--variant NAME='{"knob": value}' ...] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if "--dry" in sys.argv:  # before Triton decorates flashgen's kernels
    os.environ["TRITON_INTERPRET"] = "1"

import flashgen  # noqa: E402
from flashgen import AttentionSpec  # noqa: E402
from flashgen.timing import wall_ms  # noqa: E402
from probes import bshd_inputs, expanded_sdpa, max_abs_diff, run_probe, table_head  # noqa: E402

DTYPE, DEVICE, HEAD_DIM = torch.bfloat16, "cuda", 128
# (batch, seqlen, heads, KV heads, causal)
CASES = [(16, 1024, 16, 16, True), (8, 2048, 16, 16, True), (4, 4096, 16, 16, True), (16, 1024, 16, 16, False),
         (8, 2048, 16, 16, False), (4, 2048, 16, 4, True), (8, 1024, 16, 4, True), (2, 4096, 16, 4, True),
         (4, 2048, 32, 8, True), (4, 4096, 32, 8, True), (1, 16384, 32, 8, True)]
VARIANTS = {"default": {}, "portable": dict(hopper_bwd=False, dq_strategy="separate"),
            "separate": dict(hopper_bwd=True, dq_strategy="separate"),
            "atomic": dict(hopper_bwd=True, dq_strategy="atomic", bwd_fused_delta=False)}


def timer(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, rep=60, return_mode="median"))


def dry_run() -> None:
    """Shake the script out on the CPU (Triton's interpreter, fp16, head dim 32, two small cases, the
    portable kernels only); the figures mean nothing."""
    global DTYPE, DEVICE, HEAD_DIM, timer
    DTYPE, DEVICE, HEAD_DIM = torch.float16, "cpu", 32
    CASES[:] = [(2, 64, 4, 2, True), (1, 96, 2, 2, False)]
    for name in ("separate", "atomic"):  # no Gluon under the interpreter
        del VARIANTS[name]
    timer = wall_ms


def run_case(case, args) -> dict:
    batch, seqlen, heads, kv_heads, causal = case
    spec = AttentionSpec(dtype="fp16" if DTYPE == torch.float16 else "bf16", head_dim=HEAD_DIM, num_heads=heads,
                         num_kv_heads=kv_heads, causal=causal)
    base = flashgen.default_config(spec, seqlen=seqlen)
    q, k, v, do = bshd_inputs(batch, seqlen, heads, kv_heads, HEAD_DIM, DTYPE, DEVICE)
    # the reference: float32 math on the CPU; on the GPU the first SDPA anchor that runs the case (cuDNN, then
    # FlashAttention-2), which the variants are timed beside
    anchors, ref_grads = {}, None
    if DEVICE == "cpu":
        _, ref_grads, _ = expanded_sdpa(q, k, v, do, causal, torch.float32)
    else:
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
            try:
                _, grads, anchors[name] = expanded_sdpa(q, k, v, do, causal, DTYPE, backend)
            except RuntimeError as err:  # this backend does not take the case: left out of the row
                print(f"  {name} refused {batch}:{seqlen}:{heads}:{kv_heads}:{int(causal)}: {str(err)[:120]}")
                continue
            ref_grads = ref_grads or grads
        if ref_grads is None:
            raise SystemExit(f"no SDPA anchor runs case {case}: nothing to check the variants against")
    row = {"case": f"B={batch} S={seqlen} H={heads}/{kv_heads} hd{HEAD_DIM}{' causal' if causal else ''}",
           "mode": "bwd", "default_config": base.describe_backward()}
    calls = {}
    for name, knobs in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        try:
            kernel = flashgen.compile(spec, base.replace(**knobs))
            grads = torch.autograd.grad(kernel(q, k, v, layout="bshd"), (q, k, v), do)
        except Exception as err:  # a variant this GPU cannot run (shared memory, registers): named in the row
            row[f"{name}_error"] = f"{type(err).__name__}: {str(err)[:200]}"
            print(f"  {name}: {row[f'{name}_error']}")
            continue
        row[f"{name}_max_err"] = round(max_abs_diff(grads, ref_grads), 4)
        calls[name] = (lambda kernel=kernel: kernel(q, k, v, layout="bshd"),
                       lambda kernel=kernel: torch.autograd.grad(kernel(q, k, v, layout="bshd"), (q, k, v), do))
    calls.update(anchors)
    times = {name: [] for name in calls}
    order = list(calls)
    for r in range(args.rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            times[name].append(timer(calls[name][1]) - timer(calls[name][0]))
    for name, bwd in times.items():
        row[name] = {"bwd_ms": round(statistics.median(bwd), 4), "rounds": [round(b, 4) for b in bwd]}
    for anchor in anchors:
        for name in calls:
            if name not in anchors:
                row[f"ratio_vs_{anchor}_{name}"] = round(row[anchor]["bwd_ms"] / row[name]["bwd_ms"], 3)
    return row


def add_arguments(parser) -> None:
    parser.add_argument("--cases", type=parse_cases, help="batch:seqlen:heads:kv_heads:causal(0/1),... instead of "
                                                          "the built-in cases")
    parser.add_argument("--variant", action="append", default=[], type=parse_variant,
                        help="NAME={json knobs}: another variant of the default config (repeatable)")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM, help="the cases' head dim (default 128)")
    parser.add_argument("--only", type=lambda text: text.split(","), default=None,
                        help="NAME,...: run only these variants (the built-in ones and --variant's)")


def parse_cases(text: str) -> list[tuple]:
    try:
        return [(*(int(x) for x in c.split(":")[:4]), bool(int(c.split(":")[4]))) for c in text.split(",")]
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"expected batch:seqlen:heads:kv_heads:causal,..., got {text!r}") from None


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, knobs = text.partition("=")
    try:
        value = json.loads(knobs)
    except json.JSONDecodeError:
        value = None
    if not name or not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected NAME={{json knobs}}, got {text!r}")
    return name, value


def markdown(rows, env) -> str:
    names = [n for n in (*VARIANTS, "cudnn", "sdpa_flash") if any(n in row for row in rows)]
    lines = table_head(f"The backward's dK/dV kernel per case (hd{HEAD_DIM})", env,
                       "bf16, bshd; backward ms = fwd+bwd - fwd (do_bench medians over interleaved rounds, host time "
                       "included) of the call's default config and of it with each dK/dV kernel; '(x)': cuDNN's time "
                       "over the variant's (SDPA flash's where cuDNN refused the case).",
                       ["case", "default config", *names, "errors max"])
    for row in rows:
        anchor = "cudnn" if "cudnn" in row else "sdpa_flash"

        def cell(n):
            if n not in row:
                return "-"
            ratio = row.get(f"ratio_vs_{anchor}_{n}")
            return f"{row[n]['bwd_ms']:.3f}" + (f" ({ratio:.3f})" if ratio is not None else "")

        errors = max((row[f"{n}_max_err"] for n in VARIANTS if f"{n}_max_err" in row), default=float("nan"))
        lines.append(f"| {row['case']} | {row['default_config']} | " + " | ".join(map(cell, names))
                     + f" | {errors:.4f} |")
    return "\n".join(lines) + "\n"


def chosen(args) -> list[tuple]:
    """The cases to run, once the arguments are parsed (and the variants they add)."""
    global HEAD_DIM
    VARIANTS.update(args.variant)
    if not args.dry:  # (--dry's head dim is its own)
        HEAD_DIM = args.head_dim
    return args.cases or CASES


if __name__ == "__main__":
    run_probe(__doc__.split("\n")[0], "bwd-defaults", chosen, run_case, markdown, dry_run, add_arguments)
