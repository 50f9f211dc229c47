"""How long a GPU call takes: the one timing rule of the tuner and the benchmarks.

The median of triton.testing.do_bench: CUDA events around each run, after warm-up, with
the L2 cache flushed between runs, so a kernel never times against inputs left in cache.
"""

from __future__ import annotations

import time


def time_ms(fn, *, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of fn() on the current CUDA device."""
    import triton.testing  # the CUDA driver is touched only when something is timed

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def wall_ms(fn) -> float:
    """Host wall-clock milliseconds of one fn() call. The interpreter runner's 'time': it
    measures the CPU running Triton's interpreter, not any GPU."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3
