"""How much work an attention call is: visible (query, key) pairs and their FLOPs.

FLOPs follow the FlashAttention papers: 2 * (head_dim + head_dim_v) multiply-adds per
visible (query, key) pair per head; masked-out pairs are not counted. The backward is
2.5x the forward, forward + backward 3.5x. The tuner and the benchmarks count the same way.
"""

from __future__ import annotations

import math

import torch

from . import masks
from .expr.ir import reads_var, tensors_of
from .expr.to_torch import evaluate, tensors_at_rank

MODE_FACTORS = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


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


def pairs_flops(pairs: int, head_dim: int, head_dim_v: int | None = None, *, mode: str = "fwd") -> float:
    """FLOPs of attention over `pairs` visible (query, key) pairs, summed over batch and heads:
    Q K^T and P V in the forward; mode fwd, bwd (2.5x fwd) or fwd_bwd (3.5x)."""
    head_dim_v = head_dim_v or head_dim
    return 2.0 * pairs * (head_dim + head_dim_v) * MODE_FACTORS[mode]


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    head_dim_v: int | None = None, *, causal: bool = False, mode: str = "fwd") -> float:
    """FLOPs of plain or causal attention, masked work not counted (see pairs_flops)."""
    return pairs_flops(batch * heads * visible_pairs(seqlen_q, seqlen_k, causal), head_dim, head_dim_v, mode=mode)


def visible_count(spec, batch: int, seqlen_q: int, seqlen_k: int, tensors=None, *, device="cuda",
                  rows_per_chunk: int = 1024) -> int:
    """Visible (query, key) pairs summed over batch and heads for any spec's mask, counted by
    evaluating the mask densely in row chunks (the same definition the kernels are generated from)."""
    node = spec.mask_node
    if node is None:
        return batch * spec.num_heads * seqlen_q * seqlen_k
    pred = masks.predicate(node)
    uses_b = reads_var(pred, "b") or bool(tensors_of(pred))
    uses_h = reads_var(pred, "h")
    named = {n: t.to(device) for n, t in tensors_at_rank(tensors, pred).items()}
    total = 0
    for b in range(batch if uses_b else 1):
        for h in range(spec.num_heads if uses_h else 1):
            for r0 in range(0, seqlen_q, rows_per_chunk):
                rows = torch.arange(r0, min(seqlen_q, r0 + rows_per_chunk), device=device)[:, None]
                env = {"b": torch.tensor(b, device=device), "h": torch.tensor(h, device=device), "q_idx": rows,
                       "kv_idx": torch.arange(seqlen_k, device=device)[None, :], "seqlen_q": seqlen_q,
                       "seqlen_k": seqlen_k}
                vis = torch.as_tensor(evaluate(pred, env, named), device=device)
                total += int(vis.expand(rows.shape[0], seqlen_k).sum())
    return total * (1 if uses_b else batch) * (1 if uses_h else spec.num_heads)


def tflops(flops: float, ms: float) -> float:
    """The rate of `flops` done in `ms` milliseconds, in TFLOP/s (0 for a time that is not one)."""
    return flops / (ms * 1e-3) / 1e12 if ms > 0 and math.isfinite(ms) else 0.0
