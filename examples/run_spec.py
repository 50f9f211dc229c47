"""Compile a spec and run it once on random inputs, checked against the PyTorch reference.

    python examples/run_spec.py examples/specs/gqa-causal.yaml [--seqlen 1024 --batch 2]

On a machine without a GPU it runs through Triton's interpreter at a small size (fp16 in
place of bf16, whose interpreted dot is unreliable).
"""

import argparse
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import flashgen  # noqa: E402
from flashgen.verify import check_attention  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--seqlen", type=int, default=None)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    spec = flashgen.AttentionSpec.from_yaml(args.spec)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and spec.dtype == "bf16":
        spec = spec.replace(dtype="fp16")
    seqlen = args.seqlen or (2048 if device == "cuda" else 67)
    kernel = flashgen.compile(spec)
    shape = lambda h, d: (args.batch, h, seqlen, d)  # noqa: E731
    q = torch.randn(shape(spec.num_heads, spec.head_dim), device=device, dtype=spec.torch_dtype)
    k = torch.randn(shape(spec.num_kv_heads, spec.head_dim), device=device, dtype=spec.torch_dtype)
    v = torch.randn(shape(spec.num_kv_heads, spec.head_dim_v), device=device, dtype=spec.torch_dtype)
    t0 = time.time()
    out, lse = kernel(q, k, v, return_lse=True)
    print(f"{kernel} on {device}: out {tuple(out.shape)} {out.dtype} in {time.time() - t0:.2f}s")
    for result in check_attention(out, lse, q, k, v, causal=spec.causal, softmax_scale=spec.softmax_scale):
        print(" ", result)


if __name__ == "__main__":
    main()
