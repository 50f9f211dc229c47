"""Head dim 256 with masks: the Gluon forward (family hopper_ws, the unmasked hd256 default's knobs and three
neighbours) against the call's default config, forward only (the backward is the same portable kernel).

bf16, 8 heads, 16384 tokens per batch; windows (Gemma 3's 1024 among them), causal, softcap (Gemma 2's, which
the Gluon family does not serve: those rows say so). Each variant's output is checked against the default's
(max abs difference) before it is timed; forward ms are do_bench medians over 3 interleaved rounds (the
median round); `ratio_vs_default_<variant>` = default ms / variant ms.

    PYTHONPATH=. python3 benchmarks/probe_hd256_masks.py [--out benchmarks/results] [--tag TAG] [--dry]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if "--dry" in sys.argv:  # before Triton decorates flashgen's kernels
    os.environ["TRITON_INTERPRET"] = "1"

import flashgen  # noqa: E402
from flashgen import AttentionSpec, default_config  # noqa: E402
from flashgen.bench import environment, file_tag, gpu_tag  # noqa: E402
from flashgen.config import HOPPER_HD256  # noqa: E402

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


def run_case(name, seqlen, fields, dry):
    device, dtype = ("cpu", torch.float16) if dry else ("cuda", torch.bfloat16)
    batch, heads = (1, 2) if dry else (max(1, 16384 // seqlen), 8)
    spec = AttentionSpec(dtype="fp16" if dry else "bf16", head_dim=256, num_heads=heads, backward=True, **fields)
    base = default_config(spec, seqlen=seqlen)
    q, k, v = (torch.randn(batch, heads, seqlen, 256, device=device, dtype=dtype) for _ in range(3))
    calls = {"default": flashgen.compile(spec, base)}
    ref = calls["default"](q, k, v).float()
    row = {"case": f"{name} S={seqlen}", "mode": "fwd", "default_config": str(base)}
    for variant, knobs in VARIANTS.items():
        try:
            kernel = flashgen.compile(spec, base.replace(**dict(HOPPER_HD256, tma=False, warp_specialize=False,
                                                                **knobs)))
            row[f"{variant}_max_err"] = err = round((kernel(q, k, v).float() - ref).abs().max().item(), 4)
            if not err <= 3e-2:
                raise AssertionError(f"max |out - default's| = {err}")
            calls[variant] = kernel
        except Exception as exc:  # noqa: BLE001 - a variant the spec refuses is named in the row
            row[variant] = f"{type(exc).__name__}: {str(exc)[:150]}"
    if dry:
        return row
    from triton.testing import do_bench

    rounds = {name: [] for name in calls}
    for r in range(3):
        for name, kernel in (list(calls.items()) if r % 2 == 0 else list(calls.items())[::-1]):
            rounds[name].append(do_bench(lambda kernel=kernel: kernel(q, k, v), rep=60, return_mode="median"))
    for name, times in rounds.items():
        row[f"{name}_ms"] = round(sorted(times)[1], 4)
    for name in calls:
        if name != "default":
            row[f"ratio_vs_default_{name}"] = round(row["default_ms"] / row[f"{name}_ms"], 3)
    return row


def markdown(rows, env) -> str:
    lines = [f"# hd256 masked forward: Gluon variants vs the default ({env.get('gpu')}, torch {env.get('torch')}, "
             f"triton {env.get('triton')}, {env.get('date')})", "",
             "bf16, 8 heads, 16384 tokens per batch; forward ms (do_bench median of 3 interleaved rounds); "
             "(x): the default's ms over the variant's; refused: a ConfigError (the family does not serve the "
             "spec), error: another failure (in the JSON). po = HOPPER_HD256 (persistent + overlap), p = persistent, "
             "one = one program per tile, one_o = one-tile + overlap.", "",
             "| case | default | default ms | " + " | ".join(VARIANTS) + " |", "|---" * (len(VARIANTS) + 3) + "|"]
    for row in rows:
        cells = [f"{row[f'{v}_ms']:.3f} ({row[f'ratio_vs_default_{v}']:.2f})" if f"{v}_ms" in row
                 else ("refused" if str(row.get(v, "")).startswith("ConfigError") else "error" if v in row else "-")
                 for v in VARIANTS]
        lines.append(f"| {row['case']} | {row['default_config']} | {row.get('default_ms', '-')} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tag", default="", type=file_tag)
    parser.add_argument("--dry", action="store_true", help="shake the script out on the CPU: one small window case")
    args = parser.parse_args()
    cases = [("window 32", 128, dict(mask=WINDOW(32)))] if args.dry else CASES
    env = {**environment(), "date": time.strftime("%Y-%m-%d")}
    rows = []
    for name, seqlen, fields in cases:
        rows.append(run_case(name, seqlen, fields, args.dry))
        print(json.dumps(rows[-1]), flush=True)
    stem = args.out / f"{env['date']}-{gpu_tag(env)}-hd256-masks{args.tag}"
    args.out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    stem.with_suffix(".md").write_text(markdown(rows, env))
    print(markdown(rows, env))


if __name__ == "__main__":
    main()
