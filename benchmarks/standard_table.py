"""The standard table from bench_forward.py and bench_backward.py runs: one markdown table of
TFLOP/s and ratios per case (forward and fwd+bwd side by side, targets counted) and a PNG plot.
Runs may be split (say one per head dim); each row keeps the anchors of its own run.

    python3 benchmarks/standard_table.py --forward a.json b.json --backward c.json d.json --out table
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ANCHORS = ("sdpa_flash", "sdpa_cudnn", "flex")
TARGETS = {"fwd": (("sdpa_flash", 1.4), ("flex", 1.10)), "fwd_bwd": (("flex", 1.05),)}


def _rows(paths):
    rows, env = {}, None
    for path in paths:
        data = json.loads(Path(path).read_text())
        env = env or data["environment"]
        for r in data["rows"]:
            rows[(r["head_dim"], r["causal"], r["seqlen"])] = r
    return rows, env


def _tf(row, name):
    return (row.get(name) or {}).get("tflops")


def markdown(fwd, bwd, env, sources) -> str:
    head = ["case"] + [f"{mode} {name}" for mode in ("fwd", "fwd+bwd") for name in (*ANCHORS, "flashgen",
                                                                                     "/ flash", "/ cuDNN", "/ Flex")]
    lines = [f"GPU: {env.get('gpu')} | torch {env['torch']} | triton {env['triton']}. bf16, 16384 tokens per batch, "
             f"hidden 2048; flashgen = best of the run's sweep. Sources: {', '.join(sources)}.", "",
             "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    met = {f"{mode} >= {x}x {a}": 0 for mode, ts in TARGETS.items() for a, x in ts}
    for key in sorted(fwd):
        cells = [f"hd{key[0]} S={key[2]}{' causal' if key[1] else ''}"]
        for mode, row in (("fwd", fwd[key]), ("fwd_bwd", bwd.get(key, {}))):
            best = _tf(row, "flashgen_best")
            cells += [f"{_tf(row, a):.0f}" if _tf(row, a) else "-" for a in ANCHORS]
            cells.append(f"{best:.0f}" if best else "-")
            cells += [f"{best / _tf(row, a):.2f}" if best and _tf(row, a) else "-" for a in ANCHORS]
            for anchor, x in TARGETS[mode]:
                met[f"{mode} >= {x}x {anchor}"] += bool(best and _tf(row, anchor) and best / _tf(row, anchor) >= x)
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Targets met (of " + str(len(fwd)) + "): " + "; ".join(f"{k}: {v}" for k, v in met.items()) + "."]
    return "\n".join(lines) + "\n"


def plot(path, fwd, bwd, env) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(fwd)
    labels = [f"hd{h}{' c' if c else ''}\n{s}" for h, c, s in keys]
    fig, axes = plt.subplots(2, 1, figsize=(14, 8))
    for ax, (mode, rows) in zip(axes, (("forward", fwd), ("forward + backward", bwd))):
        for i, name in enumerate(("flashgen_best", *ANCHORS)):
            ys = [_tf(rows.get(k, {}), name) or 0 for k in keys]
            ax.bar([j + i * 0.2 for j in range(len(keys))], ys, width=0.2,
                   label={"flashgen_best": "flashgen"}.get(name, name))
        ax.set_xticks([j + 0.3 for j in range(len(keys))], labels, fontsize=8)
        ax.set(title=f"{mode}, bf16, {env.get('gpu')}, triton {env['triton']}", ylabel="TFLOP/s")
        ax.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forward", nargs="+", required=True)
    ap.add_argument("--backward", nargs="+", required=True)
    ap.add_argument("--out", required=True, help="Path prefix: writes OUT.md and OUT.png")
    args = ap.parse_args()
    fwd, env = _rows(args.forward)
    bwd, _ = _rows(args.backward)
    table = markdown(fwd, bwd, env, [Path(p).name for p in args.forward + args.backward])
    Path(args.out + ".md").write_text(table)
    plot(args.out + ".png", fwd, bwd, env)
    print(table)


if __name__ == "__main__":
    main()
