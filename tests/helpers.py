"""Shared test helpers: fresh random inputs, output buffers poisoned with NaN, child processes."""

import os

import torch


def make_qkv(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, head_dim_v=None, *, dtype, device,
             layout="bhsd", generator=None):
    """Fresh randn q, k, v in the given layout (bhsd or bshd)."""
    head_dim_v = head_dim_v or head_dim

    def randn(b, h, s, d):
        shape = (b, h, s, d) if layout == "bhsd" else (b, s, h, d)
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)

    return (randn(batch, heads, seqlen_q, head_dim), randn(batch, kv_heads, seqlen_k, head_dim),
            randn(batch, kv_heads, seqlen_k, head_dim_v))


def poisoned_outputs(q, heads, seqlen_q, head_dim_v, layout):
    """NaN-filled out and lse buffers, so an element the kernel never writes fails the check."""
    batch = q.shape[0]
    shape = (batch, heads, seqlen_q, head_dim_v) if layout == "bhsd" else (batch, seqlen_q, heads, head_dim_v)
    out = torch.full(shape, float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((batch, heads, seqlen_q), float("nan"), dtype=torch.float32, device=q.device)
    return out, lse


def child_pythonpath(*first) -> str:
    """PYTHONPATH for a child process: `first`, then whatever this process was given."""
    return os.pathsep.join([*map(str, first), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
