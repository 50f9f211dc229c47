"""Host time of one module call (forward, backward) on a machine with no GPU: flashgen's call
plans and bound launches, and (FLASHGEN_BOUND_LAUNCH=0) Triton's binder with flashgen's checks,
allocations and tensor descriptors on every call. Kernels compile for sm90 on the CPU and their
launchers do nothing (benchmarks/call_path_host.py's mock).

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

sys.path.insert(0, str(ROOT / "benchmarks"))

from call_path_host import keep_freed_memory, mock_launches  # noqa: E402


def main():
    keep_freed_memory()
    mock_launches()
    import flashgen
    from flashgen import AttentionSpec, KernelConfig
    from flashgen.runtime.launch import BoundLaunch

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
            times = []
            for enabled in (True, False):
                BoundLaunch.enabled = enabled
                call()
                n, t0 = 300, time.perf_counter()
                for _ in range(n):
                    call()
                times.append((time.perf_counter() - t0) / n * 1e6)
            BoundLaunch.enabled = True
            print(f"{name}, {phase}: {times[0]:.0f} us per call (Triton's path and every check: {times[1]:.0f})",
                  flush=True)


if __name__ == "__main__":
    main()
