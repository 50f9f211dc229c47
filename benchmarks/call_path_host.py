"""Host time of one ``flashgen.attention`` call on a machine with no GPU: everything a call
does in Python before and around the launch (binding the call to a kernel, checks, allocations,
Triton's binder), with launches compiled once by tests/sm90_compile.py's sm90 driver and then
returning at once, as benchmarks/launch_overhead.py does. Issue 13 case: B=1, H=16, S=128,
head dim 128, causal, bf16; forward, and forward + backward through autograd.

    PYTHONPATH=. python3 benchmarks/call_path_host.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import sm90_compile  # noqa: E402
import triton.runtime.jit as jit  # noqa: E402
from triton.runtime import driver  # noqa: E402


def per_call_us(call, n=300):
    call()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    driver.set_active(sm90_compile.Sm90Driver())
    jit.JITFunction.run = sm90_compile._compile_only(jit.JITFunction.run)
    import flashgen
    from flashgen.runtime import host

    host.AttentionLauncher.interpreting = lambda self: True  # accept CPU tensors: nothing is launched
    q, k, v = (torch.randn(1, 16, 128, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(1, 16, 128, 128, dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            flashgen.attention(q, k, v, causal=True)

    def fwd_bwd():
        flashgen.attention(q, k, v, causal=True).backward(do)

    for name, call in (("forward", forward), ("fwd+bwd", fwd_bwd)):
        print(f"flashgen.attention B=1 H=16 S=128 hd128 causal bf16, {name}: {per_call_us(call):.0f} us per call",
              flush=True)


if __name__ == "__main__":
    main()
