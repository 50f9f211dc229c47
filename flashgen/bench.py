"""Timing and FLOP counting, shared by the benchmark scripts and the tuner.

FLOPs follow the FlashAttention papers: 2 * (head_dim + head_dim_v) multiply-adds per
visible (query, key) pair per head; masked-out pairs are not counted. Times are the
median of triton.testing.do_bench (CUDA events, after warm-up, L2 flushed between runs)
on randn inputs, never zeros.
"""

from __future__ import annotations

import math
import platform

import torch


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """Number of (query, key) pairs that are not masked (bottom-right causal alignment)."""
    if not causal:
        return seqlen_q * seqlen_k
    offset = seqlen_k - seqlen_q
    # Row i sees clamp(i + offset + 1, 0, seqlen_k) keys: none before row `first`,
    # a growing count up to row `full`, every key from there on.
    first = min(seqlen_q, max(0, -offset))
    full = min(seqlen_q, max(first, seqlen_k - offset - 1))
    growing = (first + offset + 1 + full + offset) * (full - first) // 2
    return growing + (seqlen_q - full) * seqlen_k


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    head_dim_v: int | None = None, *, causal: bool = False, mode: str = "fwd") -> float:
    """FLOPs of attention, masked work not counted. mode: fwd, bwd (2.5x fwd) or fwd_bwd (3.5x)."""
    head_dim_v = head_dim_v or head_dim
    fwd = 2.0 * batch * heads * visible_pairs(seqlen_q, seqlen_k, causal) * (head_dim + head_dim_v)
    return fwd * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]


def time_ms(fn, *, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of fn() on the current CUDA device."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12 if ms > 0 and math.isfinite(ms) else 0.0


def environment() -> dict:
    """GPU and library versions, recorded beside every benchmark result."""
    import triton

    from . import __version__

    env = {
        "flashgen": __version__, "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sm_count=props.multi_processor_count,
                   capability=f"{props.major}.{props.minor}", memory_gib=round(props.total_memory / 2**30, 1),
                   cuda=torch.version.cuda)
    return env
