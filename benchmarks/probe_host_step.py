"""GPU host: wall us per step of small fwd+bwd calls (torch SDPA, flashgen SDPA-shaped and flashgen.attention, a Python
autograd.Function that launches nothing) and a cProfile of flashgen's SDPA-shaped step (session 52:
results/2026-12-01-h200-call-path-s52-host.md).

    PYTHONPATH=. python3 benchmarks/probe_host_step.py
"""
import cProfile, pstats, sys, time, io
import torch
import torch.nn.functional as F
import flashgen

B, H, D = 1, 16, 128
def make(S):
    g = torch.Generator(device="cuda").manual_seed(S)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(3))
    do = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, do

class Floor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q)
    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

def steps(S):
    q, k, v, do = make(S)
    return {
        "torch sdpa (flash)": lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do),
        "flashgen sdpa": lambda: torch.autograd.grad(flashgen.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do),
        "flashgen.attention": lambda: torch.autograd.grad(flashgen.attention(q, k, v, causal=True), (q, k, v), do),
        "floor (Function, empty_like)": lambda: torch.autograd.grad(Floor.apply(q, k, v), (q, k, v), do),
        "fwd only flashgen sdpa (grad)": lambda: flashgen.scaled_dot_product_attention(q, k, v, is_causal=True),
        "fwd only torch sdpa (grad)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }

def wall(fn, n=300):
    for _ in range(20): fn()
    torch.cuda.synchronize()
    best = []
    for r in range(5):
        t = time.perf_counter()
        for _ in range(n): fn()
        torch.cuda.synchronize()
        best.append((time.perf_counter() - t) / n * 1e6)
    return min(best), sorted(best)[2]

for S in (128, 512):
    fns = steps(S)
    for name, fn in fns.items():
        lo, med = wall(fn)
        print(f"S={S} {name}: min {lo:.1f} us/step, median {med:.1f}", flush=True)
fn = steps(512)["flashgen sdpa"]
for _ in range(50): fn()
pr = cProfile.Profile(); pr.enable()
for _ in range(300): fn()
torch.cuda.synchronize(); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); print(s.getvalue()[:9000])
