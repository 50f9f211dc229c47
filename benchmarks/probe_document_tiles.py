"""Causal documents against plain causal attention on the same visible work (issue 15): the forward of
16 causal sequences of 1024 tokens, written as plain causal (B=16), as one document per sequence
(B=16), 4 documents of 1024 (B=4, S=4096), 16 of 1024 (B=1, S=16384) and 16 of 256 (B=4, S=4096),
per forward tile config; then fwd+bwd for the default and two forward tiles. bf16, 16 heads, hd128,
GPU time of CUDA-graph replays (triton.testing.do_bench_cudagraph, us).

    python3 benchmarks/probe_document_tiles.py fwd
    python3 benchmarks/probe_document_tiles.py bwd

Run 2026-11-23 on the H100 before and after the forward's boundary loop read document ids at 2
stages (results/masks/2026-11-23-h100-document-tiles.md).
"""

from __future__ import annotations

import sys

import torch
from triton.testing import do_bench_cudagraph

import flashgen
from flashgen.config import default_config
from flashgen.spec import AttentionSpec

H, D = 16, 128
CASES = [("causal", 16, 1024, 0), ("doc1", 16, 1024, 1), ("doc4", 4, 4096, 4), ("doc16", 1, 16384, 16),
         ("doc16s", 4, 4096, 16)]  # (name, batch, seqlen, documents per sequence; 0: plain causal)
FWD = {"A 64x32": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3, tma=False),
       "B 64x64t": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, tma=True),
       "C 64x64": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, tma=False),
       "D 128x64t": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, tma=True),
       "E 128x128t": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, tma=True)}


def spec(documents: bool) -> AttentionSpec:
    fields = {"mask": {"document": {}}} if documents else {"causal": True}
    return AttentionSpec(name="probe", dtype="bf16", head_dim=D, num_heads=H, backward=True, **fields)


def main(which: str) -> None:
    torch.manual_seed(0)
    for name, batch, seqlen, docs in CASES:
        sp = spec(docs > 0)
        q, k, v = (torch.randn(batch, H, seqlen, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        tensors = {"document_ids": (torch.arange(seqlen, device="cuda", dtype=torch.int32) // (seqlen // docs))
                   .expand(batch, seqlen).contiguous()} if docs else {}
        base = default_config(sp, seqlen=seqlen, hopper_ws=False)
        if which == "fwd":
            for cname, knobs in FWD.items():
                kernel = flashgen.compile(sp, base.replace(**knobs))
                us = 1000 * do_bench_cudagraph(lambda: kernel(q, k, v, **tensors), rep=200)
                print(f"{name:7s} B={batch} S={seqlen} {cname:11s} fwd {us:8.1f} us", flush=True)
            continue
        for cname, knobs in [("default", {})] + [(c, FWD[c]) for c in ("A 64x32", "B 64x64t")]:
            kernel = flashgen.compile(sp, base.replace(**knobs))
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            do = torch.randn_like(q)

            def step():
                torch.autograd.grad(kernel(qq, kk, vv, **tensors), (qq, kk, vv), do)

            step()
            us = 1000 * do_bench_cudagraph(step, rep=200)
            print(f"{name:7s} B={batch} S={seqlen} {cname:11s} fwd+bwd {us:8.1f} us  {base.replace(**knobs)}",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fwd")
