"""flashgen's attention as registered PyTorch custom ops, differentiable.

``flashgen::attn_fwd`` and ``flashgen::attn_bwd`` are torch.library custom ops with fake
(meta) implementations, so a model that calls them compiles under
``torch.compile(fullgraph=True)`` without a graph break, and the autograd formula is
registered on the forward op: it saves only q, k, v, out, lse (and the dropout seed) and
the backward recomputes P tile by tile.

A compiled kernel is named in the ops by a string id (its spec key and config); the
registry below maps ids to kernels. The ops are opaque to dynamo, so rendering and
importing the Triton module happen inside them, never in traced code.
"""

from __future__ import annotations

import hashlib
import json
import threading

import torch

from .config import KernelConfig

_REGISTRY: dict[str, tuple[object, KernelConfig]] = {}
_lock = threading.Lock()


def register(kernel, config: KernelConfig) -> str:
    """The op-level id of (kernel, config); registers it on first use."""
    digest = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode()).hexdigest()[:12]
    kernel_id = f"{kernel.spec.uri}/{kernel.spec.key}/{digest}"
    with _lock:
        _REGISTRY.setdefault(kernel_id, (kernel, config))
    return kernel_id


def _lookup(kernel_id: str):
    try:
        kernel, config = _REGISTRY[kernel_id]
    except KeyError:
        raise RuntimeError(f"flashgen kernel {kernel_id!r} is not registered in this process "
                           "(compile its spec with flashgen.compile first)") from None
    return kernel.module(config)


@torch.library.custom_op("flashgen::attn_fwd", mutates_args=())
def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seed: torch.Tensor, kernel_id: str,
             layout: str, dropout_p: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _lookup(kernel_id).forward(q, k, v, layout=layout, dropout_p=dropout_p, seed=seed)


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, seed, kernel_id, layout, dropout_p, deterministic):
    if layout == "bhsd":
        batch, heads, seqlen_q = q.shape[0], q.shape[1], q.shape[2]
        out_shape = (batch, heads, seqlen_q, v.shape[3])
    else:
        batch, seqlen_q, heads = q.shape[0], q.shape[1], q.shape[2]
        out_shape = (batch, seqlen_q, heads, v.shape[3])
    return q.new_empty(out_shape), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("flashgen::attn_bwd", mutates_args=())
def attn_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, seed: torch.Tensor, kernel_id: str, layout: str, dropout_p: float,
             deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _lookup(kernel_id).backward(do, q, k, v, out, lse, layout=layout, dropout_p=dropout_p, seed=seed,
                                       deterministic=deterministic)


@attn_bwd.register_fake
def _attn_bwd_fake(do, q, k, v, out, lse, seed, kernel_id, layout, dropout_p, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, seed, kernel_id, layout, dropout_p, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seed)
    ctx.kernel_id, ctx.layout, ctx.dropout_p, ctx.deterministic = kernel_id, layout, dropout_p, deterministic
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, seed = ctx.saved_tensors
    dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, seed, ctx.kernel_id, ctx.layout, ctx.dropout_p,
                          ctx.deterministic)
    return dq, dk, dv, None, None, None, None, None


attn_fwd.register_autograd(_backward, setup_context=_setup_context)
