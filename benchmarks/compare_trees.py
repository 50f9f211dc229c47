"""The same spec's kernels from two source trees, timed on one GPU in one run.

A refactor of the templates must not change what the kernels cost: this script imports
flashgen from each tree in its own child process (alternating, several rounds), times the
spec's forward and fwd+bwd with each tree's default config and with one explicit config
shared by both, and reports the median per tree and the ratio new / old.

    PYTHONPATH=. python3 benchmarks/compare_trees.py --old .old --new . \
        --spec examples/specs/gqa-causal.yaml --out benchmarks/results/refactor.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path

CHILD = r"""
import json, sys, torch, triton
import flashgen
from flashgen import AttentionSpec, KernelConfig
spec = AttentionSpec.coerce(sys.argv[1])
configs = json.loads(sys.argv[2])
tokens = int(sys.argv[3])
rows = []
for seqlen in spec.tune.seqlens:
    batch = max(1, tokens // seqlen)
    gen = torch.Generator(device="cuda").manual_seed(seqlen)
    def randn(h, d):
        return torch.randn(batch, h, seqlen, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k, v = randn(spec.num_heads, spec.head_dim), randn(spec.num_kv_heads, spec.head_dim), \
        randn(spec.num_kv_heads, spec.head_dim_v)
    do = randn(spec.num_heads, spec.head_dim_v)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=spec.causal, enable_gqa=True)
    for label, cfg in configs.items():
        kernel = flashgen.compile(spec, None if cfg is None else KernelConfig(**cfg))
        out = kernel(q, k, v)
        err = (out.float() - ref.float()).abs().max().item()
        assert err < 3e-2, (label, seqlen, err)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        def fwd():
            return kernel(q, k, v)
        def fwd_bwd():
            return torch.autograd.grad(kernel(*leaves), leaves, do)
        for mode, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
            ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
            rows.append(dict(config=label, seqlen=seqlen, batch=batch, mode=mode, ms=ms))
print("JSON" + json.dumps(rows))
"""


def flops(spec, batch, seqlen, mode):
    # visible pairs only (causal: S(S+1)/2), 4 * d per pair forward, 2.5x that for fwd+bwd
    pairs = seqlen * (seqlen + 1) / 2 if spec["causal"] else seqlen * seqlen
    fwd = 2 * pairs * (spec["head_dim"] + spec["head_dim_v"]) * batch * spec["num_heads"]
    return fwd * (3.5 if mode == "fwd_bwd" else 1.0)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="the tree before the change (holds flashgen/, templates/)")
    parser.add_argument("--new", required=True)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--config", action="append", default=[],
                        help="LABEL=JSON: an explicit config run by both trees (besides each tree's default)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    configs = {"default": None}
    for item in args.config:
        label, cfg = item.split("=", 1)
        configs[label] = json.loads(cfg)
    spec_path = str(Path(args.spec).resolve())
    times: dict[tuple, dict[str, list[float]]] = {}
    meta = {}
    for rnd in range(args.rounds):
        for tree in ("old", "new"):
            root = str(Path(getattr(args, tree)).resolve())
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
                       FLASHGEN_CACHE_DIR=f"/tmp/flashgen-compare-{tree}")
            proc = subprocess.run([sys.executable, "-c", CHILD, spec_path, json.dumps(configs), str(args.tokens)],
                                  env=env, cwd=root, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{tree} tree failed:\n{proc.stderr[-4000:]}")
            rows = json.loads(proc.stdout.split("JSON", 1)[1])
            for r in rows:
                key = (r["config"], r["seqlen"], r["mode"])
                times.setdefault(key, {"old": [], "new": []})[tree].append(r["ms"])
                meta[key] = r["batch"]
            print(f"round {rnd} {tree}: {len(rows)} rows", flush=True)
    import torch
    import triton
    import yaml

    spec = yaml.safe_load(Path(spec_path).read_text())
    spec.setdefault("head_dim_v", spec["head_dim"])
    spec.setdefault("num_kv_heads", spec["num_heads"])
    spec.setdefault("causal", False)
    out_rows = []
    for (label, seqlen, mode), t in times.items():
        old, new = statistics.median(t["old"]), statistics.median(t["new"])
        f = flops(spec, meta[(label, seqlen, mode)], seqlen, mode)
        out_rows.append(dict(case=f"{spec['name']} S={seqlen} config={label}", mode=mode, seqlen=seqlen,
                             config=label, old_ms=old, new_ms=new, old_tflops=f / old / 1e9,
                             new_tflops=f / new / 1e9, ratio_vs_old=old / new, old_all=t["old"], new_all=t["new"]))
    result = dict(environment=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                   triton=triton.__version__, date=str(date.today())),
                  spec=args.spec, rounds=args.rounds, rows=out_rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    lines = ["| case | mode | old TFLOP/s | new TFLOP/s | new/old speed |", "|---|---|---|---|---|"]
    for r in out_rows:
        lines.append(f"| {r['case']} | {r['mode']} | {r['old_tflops']:.0f} | {r['new_tflops']:.0f} | "
                     f"{r['ratio_vs_old']:.3f} |")
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
