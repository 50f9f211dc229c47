"""Head dim 256 with masks: the Gluon forward (family hopper_ws, the unmasked hd256 default's knobs and three
neighbours) against the call's default config, forward only (the backward is the same portable kernel).

bf16, 8 heads, 16384 tokens per batch; windows (Gemma 3's 1024 among them), causal, softcap (Gemma 2's, which
the Gluon family does not serve: those rows say so). Each variant's output is checked against the default's
(max abs difference) before it is timed; forward ms are do_bench medians over interleaved rounds (the
median round); `ratio_vs_default_<variant>` = default ms / variant ms.

    PYTHONPATH=. python3 benchmarks/probe_hd256_masks.py [--rounds 3] [--out benchmarks/results] [--tag TAG] [--dry]
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if "--dry" in sys.argv:  # before Triton decorates flashgen's kernels
    os.environ["TRITON_INTERPRET"] = "1"

import flashgen  # noqa: E402
from flashgen import AttentionSpec, default_config  # noqa: E402
from flashgen.config import HOPPER_HD256  # noqa: E402
from probes import alternating, max_abs_diff, run_probe, table_head  # noqa: E402

DTYPE, DEVICE, BATCH_TOKENS, HEADS = torch.bfloat16, "cuda", 16384, 8
WINDOW = lambda left: {"sliding_window": {"left": left, "right": 0}}  # noqa: E731
SOFTCAP = {"softcap": {"cap": 50.0}}
CASES = [("window 1024", 8192, dict(mask=WINDOW(1024))),
         ("window 4096 + softcap", 8192, dict(mask=WINDOW(4096), score_mod=SOFTCAP)),
         ("causal + softcap", 8192, dict(causal=True, score_mod=SOFTCAP)),
         ("window 1024", 4096, dict(mask=WINDOW(1024))),
         ("causal", 2048, dict(causal=True)),
         ("window 512", 16384, dict(mask=WINDOW(512)))]
VARIANTS = {"po": {}, "p": dict(hopper_overlap=False), "one": dict(hopper_persistent=False, hopper_overlap=False),
            "one_o": dict(hopper_persistent=False)}  # over HOPPER_HD256: persistent + overlap


def timer(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, rep=60, return_mode="median"))


def dry_run() -> None:
    """Shake the script out on the CPU (Triton's interpreter, fp16, one small window case); nothing is timed."""
    global DTYPE, DEVICE, BATCH_TOKENS, HEADS
    DTYPE, DEVICE, BATCH_TOKENS, HEADS = torch.float16, "cpu", 128, 2
    CASES[:] = [("window 32", 128, dict(mask=WINDOW(32)))]


def run_case(case, args) -> dict:
    name, seqlen, fields = case
    batch = max(1, BATCH_TOKENS // seqlen)
    spec = AttentionSpec(dtype="fp16" if DTYPE == torch.float16 else "bf16", head_dim=256, num_heads=HEADS,
                         backward=True, **fields)
    base = default_config(spec, seqlen=seqlen)
    q, k, v = (torch.randn(batch, HEADS, seqlen, 256, device=DEVICE, dtype=DTYPE) for _ in range(3))
    calls = {"default": flashgen.compile(spec, base)}
    ref = calls["default"](q, k, v)
    row = {"case": f"{name} S={seqlen}", "mode": "fwd", "default_config": str(base)}
    for variant, knobs in VARIANTS.items():
        try:
            kernel = flashgen.compile(spec, base.replace(**dict(HOPPER_HD256, tma=False, warp_specialize=False,
                                                                **knobs)))
            row[f"{variant}_max_err"] = err = round(max_abs_diff([kernel(q, k, v)], [ref]), 4)
            if not err <= 3e-2:
                raise AssertionError(f"max |out - default's| = {err}")
            calls[variant] = kernel
        except Exception as exc:  # noqa: BLE001 - a variant the spec refuses is named in the row
            row[variant] = f"{type(exc).__name__}: {str(exc)[:150]}"
    if DEVICE == "cpu":
        return row
    rounds = alternating(calls, args.rounds, lambda name: timer(lambda: calls[name](q, k, v)))
    for name, times in rounds.items():
        row[f"{name}_ms"] = round(statistics.median(times), 4)
    for name in calls:
        if name != "default":
            row[f"ratio_vs_default_{name}"] = round(row["default_ms"] / row[f"{name}_ms"], 3)
    return row


def markdown(rows, env) -> str:
    lines = table_head("hd256 masked forward: Gluon variants vs the default", env,
                       "bf16, 8 heads, 16384 tokens per batch; forward ms (do_bench median of interleaved rounds); "
                       "(x): the default's ms over the variant's; refused: a ConfigError (the family does not serve "
                       "the spec), error: another failure (in the JSON). po = HOPPER_HD256 (persistent + overlap), "
                       "p = persistent, one = one program per tile, one_o = one-tile + overlap.",
                       ["case", "default", "default ms", *VARIANTS])
    for row in rows:
        cells = [f"{row[f'{v}_ms']:.3f} ({row[f'ratio_vs_default_{v}']:.2f})" if f"{v}_ms" in row
                 else ("refused" if str(row.get(v, "")).startswith("ConfigError") else "error" if v in row else "-")
                 for v in VARIANTS]
        lines.append(f"| {row['case']} | {row['default_config']} | {row.get('default_ms', '-')} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run_probe(__doc__.split("\n")[0], "hd256-masks", CASES, run_case, markdown, dry_run)
