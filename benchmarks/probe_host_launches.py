"""GPU host: wall us per step of flashgen.attention's small training step (B=1 H=16 S=128 hd128 causal bf16) with
parts of its two kernel launches taken out, beside torch's SDPA, in interleaved rounds (session 59,
benchmarks/NOTES.md): the whole step; both launches a no-op (flashgen's Python and allocations alone); Triton's C
launcher called with an empty grid (its argument handling, no cuLaunchKernelEx); the backward's or the forward's
launch alone a no-op. The no-op rows compute nothing: host time only.

    PYTHONPATH=. python3 benchmarks/probe_host_launches.py
"""
import statistics
import threading
import time

import torch
import triton

import flashgen
from flashgen.runtime import launch as L

if not torch.cuda.is_available():
    raise SystemExit("this probe times a GPU host: it needs a CUDA GPU")
B, H, D, S = 1, 16, 128, 128
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(3))
do = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16, generator=g)
F = torch.nn.functional
orig = L.RawLaunch.__call__
MAIN = threading.main_thread()

def noop(self, stream, args, tail): return None
def empty_grid(self, stream, args, tail):
    args = self.addressed(args)
    return self.launch(0, 1, 1, stream, *self.middle, *args, *tail)
def bwd_noop(self, stream, args, tail):
    if threading.current_thread() is MAIN: return orig(self, stream, args, tail)
def fwd_noop(self, stream, args, tail):
    if threading.current_thread() is not MAIN: return orig(self, stream, args, tail)

def fg(): return torch.autograd.grad(flashgen.attention(q, k, v, causal=True), (q, k, v), do)
def fgf(): return flashgen.attention(q, k, v, causal=True)
variants = {
    "torch sdpa fwd+bwd": (None, lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do)),
    "flashgen fwd+bwd": (orig, fg),
    "flashgen fwd+bwd, launches no-op": (noop, fg),
    "flashgen fwd+bwd, C launcher with grid 0": (empty_grid, fg),
    "flashgen fwd+bwd, backward launch no-op": (bwd_noop, fg),
    "flashgen fwd+bwd, forward launch no-op": (fwd_noop, fg),
    "torch sdpa fwd": (None, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    "flashgen fwd": (orig, fgf),
    "flashgen fwd, launch no-op": (noop, fgf),
    "flashgen fwd, C launcher with grid 0": (empty_grid, fgf),
}
for _ in range(3):  # (the first calls bind the launches through Triton's own path)
    fg()
raw_calls = []
L.RawLaunch.__call__ = lambda self, stream, args, tail: (raw_calls.append(1), orig(self, stream, args, tail))[1]
fg()
torch.cuda.synchronize()
L.RawLaunch.__call__ = orig
if len(raw_calls) != 2:  # (RawLaunch mirrors triton 3.6's launcher; other Tritons launch through their own)
    raise SystemExit(f"a step made {len(raw_calls)} RawLaunch calls, not 2 (triton {triton.__version__}): this probe "
                     "takes RawLaunch's launches apart, which only triton 3.6's launcher has")
res = {name: [] for name in variants}
for name, (patch, fn) in variants.items():
    for _ in range(30): fn()
torch.cuda.synchronize()
for r in range(9):
    for name, (patch, fn) in variants.items():
        L.RawLaunch.__call__ = patch or orig
        for _ in range(20): fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(200): fn()
        torch.cuda.synchronize()
        res[name].append((time.perf_counter() - t) / 200 * 1e6)
L.RawLaunch.__call__ = orig
for name, xs in res.items():
    xs.sort()
    print(f"{name}: min {xs[0]:.1f} q25 {xs[2]:.1f} median {xs[4]:.1f} q75 {xs[6]:.1f} us/step")
