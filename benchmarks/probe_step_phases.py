"""Host time of a masked fwd+bwd step by phase, on the GPU host: perf_counter around the launcher's
phases (training_forward, the Gluon plan, the range and runs tables, BoundLaunch runs, the backward
plan, torch.autograd.grad as a whole), summed over 100 steps of bench_masked_user_path's inputs and
default call. Nothing synchronizes inside the steps: where the host is slower than the GPU these are
host times; where it is faster, the phase that waits for a full launch queue shows the GPU's time.

    PYTHONPATH=. python3 benchmarks/probe_step_phases.py document_16@4096 sliding_window_256@4096
"""

import collections
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_masked_user_path as bm  # noqa: E402
import flashgen  # noqa: E402
from flashgen.runtime import hopper, host, launch  # noqa: E402

SECONDS = collections.defaultdict(float)  # phase -> seconds in it
CALLS = collections.Counter()  # phase -> calls


def timed(owner, name):
    """Replace owner.name by a wrapper adding its time to SECONDS[owner.name]."""
    fn = getattr(owner, name)
    label = f"{getattr(owner, '__name__', owner)}.{name}"

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SECONDS[label] += time.perf_counter() - t0
            CALLS[label] += 1

    setattr(owner, name, wrapper)


PHASES = [(host, "runs_table"), (host.AttentionLauncher, "training_forward"),
          (host.AttentionLauncher, "training_backward"), (hopper.HopperPlan, "__call__"),
          (hopper.RangeTable, "fill"), (launch.BackwardPlan, "__call__"), (launch.BackwardPlan, "gradient_buffers"),
          (launch.BackwardPlan, "named_args"), (launch.BoundLaunch, "run"), (launch.BoundLaunch, "__call__"),
          (torch.autograd, "grad")]


def main():
    for owner, name in PHASES:
        timed(owner, name)
    steps = 100
    for arg in sys.argv[1:]:
        name, seqlen = arg.split("@")
        x = bm.make_inputs(next(c for c in bm.CASES if c.name == name), int(seqlen))
        kernel = flashgen.compile(x.spec)
        step = bm.step(lambda q, k, v: kernel(q, k, v, **x.tensors), x, "fwd_bwd")
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        SECONDS.clear(), CALLS.clear()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"== {arg}: step submit {(t1 - t0) / steps * 1e6:.1f} us, synced "
              f"{(time.perf_counter() - t0) / steps * 1e6:.1f}")
        for label, seconds in sorted(SECONDS.items(), key=lambda kv: -kv[1]):
            print(f"   {label:40s} {seconds / steps * 1e6:8.1f} us/step  ({CALLS[label] / steps:.0f} calls)")


if __name__ == "__main__":
    main()
