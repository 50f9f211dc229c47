"""Where the time of one attention step goes: the kernels called directly vs the differentiable
call, as GPU time (do_bench) and as CPU time per call (50 calls, no sync), for a sliding
window (sub-millisecond kernels) and causal attention.

    PYTHONPATH=. python3 benchmarks/call_overhead.py
"""
import sys, time, torch
sys.path.insert(0, ".")
import flashgen
from flashgen import AttentionSpec
from flashgen.timing import time_ms
for name, S, f in [("sw256", 16384, dict(mask={"sliding_window": {"left": 256, "right": 0}})), ("causal", 4096, dict(causal=True))]:
    B = 16384 // S
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=16, backward=True, **f)
    kern = flashgen.compile(spec); mod = kern.module()
    q, k, v, do = (torch.randn(B, 16, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = mod.forward(q, k, v)
    def direct():
        o, l = mod.forward(q, k, v); return mod.backward(do, q, k, v, o, l)
    def auto():
        return torch.autograd.grad(kern(*leaves), leaves, do)
    r = {"fwd_direct": time_ms(lambda: mod.forward(q, k, v)), "fwd_op": time_ms(lambda: kern(q, k, v)),
         "bwd_direct": time_ms(lambda: mod.backward(do, q, k, v, out, lse)),
         "fwdbwd_direct": time_ms(direct), "fwdbwd_autograd": time_ms(auto)}
    for label, fn in [("cpu_fwd_direct", lambda: mod.forward(q, k, v)), ("cpu_fwd_op", lambda: kern(q, k, v)),
                      ("cpu_bwd_direct", lambda: mod.backward(do, q, k, v, out, lse)), ("cpu_fwdbwd_autograd", auto)]:
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(50): fn()
        r[label] = (time.perf_counter() - t0) / 50 * 1e3
        torch.cuda.synchronize()
    print(name, S, {k: round(v, 3) for k, v in r.items()}, flush=True)
