"""Where a short dense training step's host time goes (issue 13's S=128/512 fwd+bwd), on the GPU host:
us per step to submit 200 steps (no synchronization inside; min and median of 5 rounds, and with the final
synchronize: probe_document_host.submit_us) of

- ``clone``: y = q.clone(), grad of y (a C++ autograd node, one copy kernel each way): the engine's floor;
- ``py_identity``: the same through a Python autograd.Function (forward clones, backward returns the
  gradient): what a Python node costs the engine beyond a C++ one;
- ``alloc_only``: bench_call_path's AllocOnly (flashgen's eager entry, no launches);
- ``sdpa_flash`` and ``flashgen``: the two steps issue 13 compares;

then a torch.profiler table (CPU and CUDA runtime events) of flashgen's and SDPA's steps: which
torch operations, runtime calls and autograd engine events the host time is spent in.

    PYTHONPATH=. python3 benchmarks/probe_step_engine.py [--seqlens 128,512] [--top 25]
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_call_path as bcp  # noqa: E402
from probe_document_host import submit_us  # noqa: E402
import flashgen  # noqa: E402


class PyIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def profile_table(step, steps, top):
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        rows.append((e.cpu_time_total / steps, e.self_cpu_time_total / steps, e.count / steps, e.key))
    rows.sort(key=lambda r: -r[0])
    lines = [f"   {'cpu total us':>12} {'self us':>8} {'calls':>6}  event"]
    lines += [f"   {t:12.1f} {s:8.1f} {c:6.1f}  {k[:90]}" for t, s, c, k in rows[:top]]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", default="128,512")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for seqlen in (int(s) for s in args.seqlens.split(",")):
        q, k, v = (torch.randn(1, 16, seqlen, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn_like(q)
        steps = {
            "clone": lambda: torch.autograd.grad(q.clone(), (q,), do),
            "py_identity": lambda: torch.autograd.grad(PyIdentity.apply(q), (q,), do),
            "alloc_only": lambda: torch.autograd.grad(bcp.AllocOnly.apply(q, k, v)[0], (q, k, v), do),
            "sdpa_flash": lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                                      (q, k, v), do),
            "flashgen": lambda: torch.autograd.grad(flashgen.attention(q, k, v, causal=True), (q, k, v), do),
        }
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for repeat in range(2):
                for name, step in steps.items():
                    print(f"S={seqlen} repeat {repeat} {name:12s} {submit_us(step, n=200)}", flush=True)
            for name in ("flashgen", "sdpa_flash", "py_identity"):
                print(f"== S={seqlen} {name}: torch.profiler, per step", flush=True)
                print(profile_table(steps[name], 50, args.top), flush=True)


if __name__ == "__main__":
    main()
