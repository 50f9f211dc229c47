"""Forward + backward attention on the GPU: flashgen beside SDPA (flash, cuDNN) and
FlexAttention, FLOPs = 3.5x the forward's (masked work not counted), bf16, 16384 tokens
per batch, hidden 2048. flashgen runs its default config and a sweep of backward knobs
(the forward keeps its default). Gradients are checked against SDPA flash's before timing.
Also records the peak memory of one fwd+bwd at S = 16384 beside SDPA flash.

    PYTHONPATH=. python3 benchmarks/bench_backward.py --out results/
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

import flashgen  # noqa: E402
from flashgen import AttentionSpec, default_config  # noqa: E402
from flashgen.bench import environment, flex_runner as _flex, sdpa_runner as _sdpa  # noqa: E402
from flashgen.flops import attention_flops, tflops  # noqa: E402
from flashgen.timing import time_ms  # noqa: E402

BWD_SWEEP = [  # the front runners of the wider sweeps in results/2026-11-22-h100-backward*.md
    dict(BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64, bwd_num_warps=4, bwd_num_stages=2, bwd_tma=False),
    dict(BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64, bwd_num_warps=4, bwd_num_stages=3, bwd_tma=False),
    dict(BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64, bwd_num_warps=8, bwd_num_stages=2, bwd_tma=False),
    # tensor descriptors (TMA) for the streamed tiles
    dict(BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64, bwd_num_warps=4, bwd_num_stages=2, bwd_tma=True),
    dict(BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64, bwd_num_warps=4, bwd_num_stages=3, bwd_tma=True),
    dict(BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64, bwd_num_warps=8, bwd_num_stages=2, bwd_tma=True),
    dict(BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64, bwd_num_warps=8, bwd_num_stages=3, bwd_tma=True),
]


def bench_case(head_dim, causal, seqlen, tokens, hidden):
    heads, batch = hidden // head_dim, max(1, tokens // seqlen)
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16)
    flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal=causal, mode="fwd_bwd")
    row = {"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "batch": batch, "heads": heads}
    backends = torch.nn.attention.SDPBackend
    ref = torch.autograd.grad(_sdpa(backends.FLASH_ATTENTION)(q, k, v, causal), (q, k, v), do)

    def measure(name, attn):
        def step():
            return torch.autograd.grad(attn(q, k, v, causal), (q, k, v), do)
        try:
            grads = step()
            err = max((g.float() - r.float()).abs().max().item() for g, r in zip(grads, ref))
            if not err < 0.1:
                return {"error": f"max|grad - sdpa_flash grad| = {err:.3g}"}
            ms = time_ms(step)
            return {"ms": ms, "tflops": tflops(flops, ms), "max_err": err}
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}

    row["sdpa_flash"] = measure("sdpa_flash", _sdpa(backends.FLASH_ATTENTION))
    row["sdpa_cudnn"] = measure("sdpa_cudnn", _sdpa(backends.CUDNN_ATTENTION))
    row["flex"] = measure("flex", _flex(seqlen, causal))
    spec = AttentionSpec(name="bench", dtype="bf16", head_dim=head_dim, num_heads=heads, causal=causal, backward=True)
    default = default_config(spec)
    kernel = flashgen.compile(spec)
    row["flashgen_default"] = measure("default", lambda q, k, v, c: kernel(q, k, v))
    row["flashgen_default"]["config"] = default.describe_backward()
    best = row["flashgen_default"] if "tflops" in row["flashgen_default"] else None
    row["sweep"] = []
    for knobs in BWD_SWEEP:
        cfg = default.replace(**knobs)
        r = measure(str(cfg), lambda q, k, v, c, cfg=cfg: kernel(q, k, v, config=cfg))
        r["config"] = cfg.describe_backward()
        row["sweep"].append(r)
        if "tflops" in r and (best is None or r["tflops"] > best["tflops"]):
            best = r
    row["flashgen_best"] = best
    return row


def peak_memory(seqlen=16384, head_dim=128, heads=16):
    """Peak bytes of one fwd+bwd beyond the inputs, flashgen vs SDPA flash, batch 1."""
    q, k, v = (torch.randn(1, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    spec = AttentionSpec(name="mem", dtype="bf16", head_dim=head_dim, num_heads=heads, causal=True, backward=True)
    kernel = flashgen.compile(spec)
    runs = {"flashgen": lambda: kernel(q, k, v),
            "sdpa_flash": lambda: _sdpa(torch.nn.attention.SDPBackend.FLASH_ATTENTION)(q, k, v, True)}
    out = {"seqlen": seqlen, "head_dim": head_dim, "heads": heads}
    for name, fn in runs.items():
        torch.autograd.grad(fn(), (q, k, v), do)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.autograd.grad(fn(), (q, k, v), do)
        torch.cuda.synchronize()
        out[name + "_peak_bytes"] = torch.cuda.max_memory_allocated() - base
    out["inputs_bytes"] = 4 * q.numel() * q.element_size()
    return out


def markdown(rows, memory, env):
    cols = ["sdpa_flash", "sdpa_cudnn", "flex", "flashgen_default", "flashgen_best"]
    lines = [f"fwd+bwd, bf16, TFLOP/s (3.5x forward FLOPs). GPU: {env.get('gpu')} | torch {env['torch']} | "
             f"triton {env['triton']} | flashgen {env['flashgen']} | {time.strftime('%Y-%m-%d')}", "",
             "| case | " + " | ".join(cols) + " | best / flash | best / cudnn | best / flex | best bwd config |",
             "|---" * (len(cols) + 5) + "|"]
    tf = lambda r, c: (r.get(c) or {}).get("tflops")  # noqa: E731
    for r in rows:
        best = tf(r, "flashgen_best")
        ratio = lambda c: f"{best / tf(r, c):.2f}" if best and tf(r, c) else "-"  # noqa: E731
        lines.append(f"| hd{r['head_dim']} S={r['seqlen']}{' causal' if r['causal'] else ''} | "
                     + " | ".join(f"{tf(r, c):.0f}" if tf(r, c) else "err" for c in cols)
                     + f" | {ratio('sdpa_flash')} | {ratio('sdpa_cudnn')} | {ratio('flex')} | "
                       f"{(r.get('flashgen_best') or {}).get('config', '-')} |")
    if memory:
        lines += ["", f"Peak memory of one fwd+bwd beyond the inputs, causal, batch 1, {memory['heads']} heads, "
                      f"hd{memory['head_dim']}, S={memory['seqlen']}: flashgen "
                      f"{memory['flashgen_peak_bytes'] / 2**20:.0f} MiB, SDPA flash "
                      f"{memory['sdpa_flash_peak_bytes'] / 2**20:.0f} MiB (q, k, v, dO: "
                      f"{memory['inputs_bytes'] / 2**20:.0f} MiB)."]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    args = ap.parse_args()
    env = environment()
    rows = []
    for head_dim in map(int, args.head_dims.split(",")):
        for causal in (False, True):
            for seqlen in map(int, args.seqlens.split(",")):
                t0 = time.time()
                rows.append(bench_case(head_dim, causal, seqlen, args.tokens, args.hidden))
                print(f"hd{head_dim} causal={causal} S={seqlen}: {time.time() - t0:.0f}s", flush=True)
    memory = peak_memory()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "backward.json").write_text(json.dumps({"environment": env, "rows": rows, "memory": memory}, indent=1))
    table = markdown(rows, memory, env)
    (out / "backward.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
