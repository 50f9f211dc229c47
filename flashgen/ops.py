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


def _varlen(cu_q, cu_k, max_q, max_k):
    if cu_q is None:
        return {}
    return dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)


def _named(module, tensors):
    return dict(zip(module.TENSORS, tensors))


def _forward(q, k, v, seed, tensors, kernel_id, layout, dropout_p, cu_q, cu_k, max_q, max_k):
    module = _lookup(kernel_id)
    return module.forward(q, k, v, layout=layout, dropout_p=dropout_p, seed=seed, tensors=_named(module, tensors),
                          **_varlen(cu_q, cu_k, max_q, max_k))


def _backward_grads(do, q, k, v, out, lse, seed, tensors, kernel_id, layout, dropout_p, deterministic, wanted,
                    cu_q, cu_k, max_q, max_k):
    """(dq, dk, dv, [d tensor in its dtype, or None where not wanted or not a float tensor])."""
    module = _lookup(kernel_id)
    names = [n for n, t, w in zip(module.TENSORS, tensors, wanted) if w and t.is_floating_point()]
    dq, dk, dv, grads = module.backward(do, q, k, v, out, lse, layout=layout, dropout_p=dropout_p, seed=seed,
                                        deterministic=deterministic, tensors=_named(module, tensors),
                                        tensor_grads=names, **_varlen(cu_q, cu_k, max_q, max_k))
    return dq, dk, dv, [grads[n].to(t.dtype) if n in grads else None for n, t in zip(module.TENSORS, tensors)]


@torch.library.custom_op("flashgen::attn_fwd", mutates_args=())
def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seed: torch.Tensor, tensors: list[torch.Tensor],
             kernel_id: str, layout: str, dropout_p: float, deterministic: bool, cu_q: torch.Tensor | None,
             cu_k: torch.Tensor | None, max_q: int, max_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, seed, tensors, kernel_id, layout, dropout_p, cu_q, cu_k, max_q, max_k)


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, seed, tensors, kernel_id, layout, dropout_p, deterministic, cu_q, cu_k, max_q, max_k):
    if layout == "thd":
        return q.new_empty((q.shape[0], q.shape[1], v.shape[2])), q.new_empty((q.shape[1], q.shape[0]),
                                                                               dtype=torch.float32)
    if layout == "bhsd":
        batch, heads, seqlen_q = q.shape[0], q.shape[1], q.shape[2]
        out_shape = (batch, heads, seqlen_q, v.shape[3])
    else:
        batch, seqlen_q, heads = q.shape[0], q.shape[1], q.shape[2]
        out_shape = (batch, seqlen_q, heads, v.shape[3])
    return q.new_empty(out_shape), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("flashgen::attn_bwd", mutates_args=())
def attn_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, seed: torch.Tensor, tensors: list[torch.Tensor], kernel_id: str, layout: str,
             dropout_p: float, deterministic: bool, grad_mask: int, cu_q: torch.Tensor | None,
             cu_k: torch.Tensor | None, max_q: int, max_k: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """grad_mask: bit i set = differentiate tensors[i] (a float tensor the score_mod reads)."""
    dq, dk, dv, grads = _backward_grads(do, q, k, v, out, lse, seed, tensors, kernel_id, layout, dropout_p,
                                        deterministic, [bool(grad_mask >> i & 1) for i in range(len(tensors))],
                                        cu_q, cu_k, max_q, max_k)
    return dq, dk, dv, [t.new_empty(0) if g is None else g for g, t in zip(grads, tensors)]


@attn_bwd.register_fake
def _attn_bwd_fake(do, q, k, v, out, lse, seed, tensors, kernel_id, layout, dropout_p, deterministic, grad_mask,
                   cu_q, cu_k, max_q, max_k):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            [torch.empty_like(t) if grad_mask >> i & 1 else t.new_empty(0) for i, t in enumerate(tensors)])


def _setup_context(ctx, inputs, output):
    q, k, v, seed, tensors, kernel_id, layout, dropout_p, deterministic, cu_q, cu_k, max_q, max_k = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seed, cu_q, cu_k, *tensors)
    ctx.grad_mask = sum(1 << i for i, t in enumerate(tensors) if t.requires_grad and t.is_floating_point())
    ctx.args = (kernel_id, layout, dropout_p, deterministic)
    ctx.maxes = (max_q, max_k)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, seed, cu_q, cu_k, *tensors = ctx.saved_tensors
    kernel_id, layout, dropout_p, deterministic = ctx.args
    dq, dk, dv, dts = attn_bwd(dout, q, k, v, out, lse, seed, tensors, kernel_id, layout, dropout_p, deterministic,
                               ctx.grad_mask, cu_q, cu_k, *ctx.maxes)
    tensor_grads = [g if ctx.grad_mask >> i & 1 else None for i, g in enumerate(dts)]
    return dq, dk, dv, None, tensor_grads, None, None, None, None, None, None, None, None


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


class AttentionFunction(torch.autograd.Function):
    """The same forward and backward for eager calls, without the custom op's dispatch: that
    path flattens every argument through pytree and costs ~0.3 ms of CPU per training step,
    which dominates attention calls of under a millisecond (a sliding window, short documents).
    Under torch.compile the custom ops above are used instead (api.AttentionKernel picks)."""

    @staticmethod
    def forward(ctx, q, k, v, seed, kernel_id, layout, dropout_p, deterministic, cu_q, cu_k, max_q, max_k,
                *tensors):
        out, lse = _forward(q, k, v, seed, tensors, kernel_id, layout, dropout_p, cu_q, cu_k, max_q, max_k)
        ctx.save_for_backward(q, k, v, out, lse, seed, cu_q, cu_k, *tensors)
        ctx.args = (kernel_id, layout, dropout_p, deterministic, max_q, max_k)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, seed, cu_q, cu_k, *tensors = ctx.saved_tensors
        kernel_id, layout, dropout_p, deterministic, max_q, max_k = ctx.args
        dq, dk, dv, tensor_grads = _backward_grads(dout, q, k, v, out, lse, seed, tensors, kernel_id, layout,
                                                   dropout_p, deterministic, ctx.needs_input_grad[12:], cu_q, cu_k,
                                                   max_q, max_k)
        return (dq, dk, dv, *([None] * 9), *tensor_grads)


def attention(q, k, v, seed, tensors, kernel_id, layout, dropout_p, deterministic, cu_q=None, cu_k=None,
              max_q=0, max_k=0):
    """(out, lse): the custom op while torch.compile traces, the autograd.Function in eager mode."""
    if torch.compiler.is_compiling():
        return attn_fwd(q, k, v, seed, list(tensors), kernel_id, layout, dropout_p, deterministic, cu_q, cu_k,
                        max_q, max_k)
    return AttentionFunction.apply(q, k, v, seed, kernel_id, layout, dropout_p, deterministic, cu_q, cu_k, max_q,
                                   max_k, *tensors)
