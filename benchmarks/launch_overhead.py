"""Host time of one kernel call before the launch itself, on a machine with no GPU: Triton's
binder (argument specialization), flashgen's checks, allocations and tensor descriptors. Uses
tests/sm90_compile.py's sm90 driver, whose launches compile once and then return at once.

    PYTHONPATH=. python3 benchmarks/launch_overhead.py
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


def main():
    driver.set_active(sm90_compile.Sm90Driver())
    jit.JITFunction.run = sm90_compile._compile_only(jit.JITFunction.run)
    import flashgen
    from flashgen import AttentionSpec, KernelConfig

    cases = [("sliding window 256, pointer loads", dict(mask={"sliding_window": {"left": 256}}),
              KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)),
             ("causal, tensor descriptors", dict(causal=True),
              KernelConfig(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, tma=True, warp_specialize=True,
                           bwd_tma=True))]
    for name, fields, config in cases:
        spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=16, backward=True, **fields)
        module = flashgen.compile(spec, config).module()
        module._LAUNCHER.interpreting = lambda: True  # accept CPU tensors: nothing is launched
        q = torch.randn(1, 16, 1024, 128, dtype=torch.bfloat16)
        out, lse = module.forward(q, q, q)
        for phase, call in (("forward", lambda: module.forward(q, q, q)),
                            ("backward", lambda: module.backward(q, q, q, q, out, lse))):
            call()
            n, t0 = 300, time.perf_counter()
            for _ in range(n):
                call()
            print(f"{name}, {phase}: {(time.perf_counter() - t0) / n * 1e6:.0f} us per call", flush=True)


if __name__ == "__main__":
    main()
