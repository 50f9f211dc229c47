"""flashgen's attention as registered PyTorch custom ops, differentiable.

``flashgen::attn_fwd`` and ``flashgen::attn_bwd`` are torch.library custom ops with fake
(meta) implementations, so a model that calls them compiles under
``torch.compile(fullgraph=True)`` without a graph break, and the autograd formula is
registered on the forward op: it saves only q, k, v, out, lse (and the dropout seed) and
the backward recomputes P tile by tile.

A kernel is named in the ops by a self-describing string, ``kernel_id(spec, config)``: the
canonical JSON of its spec and config. From the id alone the ops render, compile and import
its module on first use (``kernel_module``) and keep it in one dict, so every later call is
a dictionary lookup, and an id works in any process: nothing has to register itself first.
The ops are opaque to dynamo, so building a module happens inside them, never in traced code.
"""

from __future__ import annotations

import json
import threading
from functools import lru_cache
from types import ModuleType

import torch

from . import masks
from .codegen import render
from .config import KernelConfig
from .runtime import host
from .runtime.host import nearest_bucket
from .spec import AttentionSpec


# ----------------------------------------------------------------------------- kernel ids and their modules
def kernel_id(spec: AttentionSpec, config: KernelConfig) -> str:
    """The id the custom ops take for (spec, config): canonical JSON, readable back by `kernel_module`."""
    return json.dumps({"spec": spec.to_dict(), "config": config.to_dict()}, sort_keys=True, separators=(",", ":"))


def bucketed_id(spec: AttentionSpec, configs: dict[int, KernelConfig]) -> str:
    """The id of a kernel whose config follows the call's sequence length ({bucket: config}, the
    nearest bucket's per call): what torch.compile traces, where the length is symbolic. The ops
    resolve it to a plain id on each call (``resolve``)."""
    return json.dumps({"spec": spec.to_dict(), "buckets": {str(b): c.to_dict() for b, c in sorted(configs.items())}},
                      sort_keys=True, separators=(",", ":"))


@lru_cache(maxsize=256)
def _bucket_ids(kid: str) -> dict[int, str] | None:
    """{bucket: plain id} of a bucketed id; None for a plain one."""
    data = json.loads(kid)
    if "buckets" not in data:
        return None
    spec = AttentionSpec.from_dict(data["spec"])
    return {int(b): kernel_id(spec, KernelConfig.from_dict(c)) for b, c in data["buckets"].items()}


def resolve(kernel_id: str, q, k, layout: str, max_q: int, max_k: int) -> str:
    """The plain id a call runs: the id itself, or a bucketed id's nearest bucket at the call's length."""
    table = _bucket_ids(kernel_id)
    if table is None:
        return kernel_id
    if layout == "thd":
        seqlen = max(max_q, max_k)
    else:
        seq = 2 if layout == "bhsd" else 1
        seqlen = max(q.shape[seq], k.shape[seq])
    return table[nearest_bucket(seqlen, table)]


@lru_cache(maxsize=256)
def kernel_spec(kernel_id: str) -> tuple[AttentionSpec, KernelConfig]:
    """The (spec, config) an id names (a bucketed id: its first bucket's config)."""
    table = _bucket_ids(kernel_id)
    if table is not None:
        return kernel_spec(table[min(table)])
    data = json.loads(kernel_id)
    return AttentionSpec.from_dict(data["spec"]), KernelConfig.from_dict(data["config"])


_MODULES: dict[str, ModuleType] = {}  # kernel id -> its imported Triton module
_build_lock = threading.Lock()


def kernel_module(kernel_id: str) -> ModuleType:
    """The imported Triton module of a kernel id, built (rendered, cached, imported) on first use."""
    module = _MODULES.get(kernel_id)
    if module is None:
        with _build_lock:
            module = _MODULES.get(kernel_id)
            if module is None:
                module = _MODULES[kernel_id] = render.build_module(*kernel_spec(kernel_id))
    return module


@lru_cache(maxsize=256)
def _differentiable_tensors(kernel_id: str) -> tuple[bool, ...]:
    """Per named tensor, in call order: whether gradients can flow into it (the score modifier
    reads it). A tensor only the mask reads selects pairs: it has no gradient."""
    spec, _ = kernel_spec(kernel_id)
    return tuple(t.grad for t in masks.lower(spec.mask_node, spec.score_mod).tensors)


def _grad_mask(kernel_id: str, tensors) -> int:
    """Bit i set: differentiate tensors[i] (a float tensor the score_mod reads that requires grad)."""
    if not tensors:
        return 0
    flags = _differentiable_tensors(kernel_id)
    return sum(1 << i for i, (t, ok) in enumerate(zip(tensors, flags))
               if ok and t.requires_grad and t.is_floating_point())


def _gradient_ready(tensors):
    """The named tensors, each float one that requires grad contiguous (a copy autograd differentiates
    only where it is not): the backward kernels add its gradient through its strides into a buffer of its
    own, which an expand()ed tensor (elements sharing memory) cannot have."""
    return [t.contiguous() if t.requires_grad and t.is_floating_point() else t for t in tensors]


# ----------------------------------------------------------------------------- calls into a module
def _varlen(cu_q, cu_k, max_q, max_k):
    if cu_q is None:
        return {}
    return dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)


def _named(module, tensors):
    return dict(zip(module.TENSORS, tensors)) if tensors else None


def _forward(q, k, v, seed, tensors, module, layout, dropout_p, cu_q, cu_k, max_q, max_k):
    return module.forward(q, k, v, layout=layout, dropout_p=dropout_p, seed=seed, tensors=_named(module, tensors),
                          **_varlen(cu_q, cu_k, max_q, max_k))


def _forward_as_called(q, k, v, seed, tensors, module, layout, dropout_p, cu_q, cu_k, max_q, max_k):
    """_forward, a bhsd view of (batch, seq, heads, dim) memory run as bshd (_run_seq_major) and its out returned as
    a bhsd view of bshd memory: a no-grad eager call's and the custom op's."""
    seq_major, _, (out, lse) = _run_seq_major(
        lambda q, k, v, layout: _forward(q, k, v, seed, tensors, module, layout, dropout_p, cu_q, cu_k, max_q, max_k),
        q, k, v, layout)
    return (out.transpose(1, 2) if seq_major else out), lse


def _backward_grads(do, q, k, v, out, lse, seed, tensors, module, layout, dropout_p, deterministic, wanted,
                    cu_q, cu_k, max_q, max_k, plan=None, extra=None):
    """(dq, dk, dv, [d tensor in its dtype, or None where not wanted or not differentiable]).
    plan, extra: what the forward of these tensors returned (module._LAUNCHER.training_forward)."""
    names = tuple(n for n, t, w in zip(module.TENSORS, tensors, wanted)
                  if w and t.is_floating_point() and n in module.GRAD_TENSORS) if tensors else ()
    if plan is not None:
        dq, dk, dv, grads = module._LAUNCHER.training_backward(plan, do, q, k, v, out, lse, seed,
                                                               _named(module, tensors), cu_q, cu_k,
                                                               deterministic=deterministic, tensor_grads=names,
                                                               extra=extra)
    else:
        dq, dk, dv, grads = module.backward(do, q, k, v, out, lse, layout=layout, dropout_p=dropout_p, seed=seed,
                                            deterministic=deterministic, tensors=_named(module, tensors),
                                            tensor_grads=names, **_varlen(cu_q, cu_k, max_q, max_k))
    return dq, dk, dv, [grads[n].to(t.dtype) if n in grads else None for n, t in zip(module.TENSORS, tensors)]


# ----------------------------------------------------------------------------- the custom ops
@torch.library.custom_op("flashgen::attn_fwd", mutates_args=())
def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seed: torch.Tensor, tensors: list[torch.Tensor],
             kernel_id: str, layout: str, dropout_p: float, deterministic: bool, cu_q: torch.Tensor | None,
             cu_k: torch.Tensor | None, max_q: int, max_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # as an eager call runs: out a bhsd view of bshd memory for seq-major views (the caller's
    # out.transpose(1, 2).view(...) works compiled as in eager)
    return _forward_as_called(q, k, v, seed, tensors, kernel_module(resolve(kernel_id, q, k, layout, max_q, max_k)),
                              layout, dropout_p, cu_q, cu_k, max_q, max_k)


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, seed, tensors, kernel_id, layout, dropout_p, deterministic, cu_q, cu_k, max_q, max_k):
    _check_fake_devices(q, k, v, tensors, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    if layout == "thd":
        return q.new_empty((q.shape[0], q.shape[1], v.shape[2])), q.new_empty((q.shape[1], q.shape[0]),
                                                                               dtype=torch.float32)
    if layout == "bhsd":
        batch, heads, seqlen_q = q.shape[0], q.shape[1], q.shape[2]
        out_shape = (batch, heads, seqlen_q, v.shape[3])
        if _seq_major(q):  # attn_fwd's out: a bhsd view of bshd memory
            return (q.new_empty((batch, seqlen_q, heads, v.shape[3])).transpose(1, 2),
                    q.new_empty((batch, heads, seqlen_q), dtype=torch.float32))
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
    module = kernel_module(resolve(kernel_id, q, k, layout, max_q, max_k))
    dq, dk, dv, grads = _backward_grads(do, q, k, v, out, lse, seed, tensors, module, layout,
                                        dropout_p, deterministic,
                                        [bool(grad_mask >> i & 1) for i in range(len(tensors))], cu_q, cu_k, max_q,
                                        max_k)
    return dq, dk, dv, [t.new_empty(0) if g is None else g for g, t in zip(grads, tensors)]


@attn_bwd.register_fake
def _attn_bwd_fake(do, q, k, v, out, lse, seed, tensors, kernel_id, layout, dropout_p, deterministic, grad_mask,
                   cu_q, cu_k, max_q, max_k):
    # dq, dk, dv contiguous in q's, k's and v's shapes, as the backward allocates them (empty_like kept a
    # transposed view's strides: inductor's stride asserts failed on model code's q.view(B, L, H, D).transpose(1, 2))
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            [torch.empty_like(t) if grad_mask >> i & 1 else t.new_empty(0) for i, t in enumerate(tensors)])


def _setup_context(ctx, inputs, output):
    q, k, v, seed, tensors, kernel_id, layout, dropout_p, deterministic, cu_q, cu_k, max_q, max_k = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seed, cu_q, cu_k, *tensors)
    ctx.grad_mask = _grad_mask(kernel_id, tensors)
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
    Under torch.compile the custom ops above are used instead (apply_attention picks). The
    non-tensor arguments travel as one tuple (the module first; last, the plan api's fast path found, or
    None): autograd.Function.apply pays per argument. Eager calls enter through _apply_function
    (Function.apply's C++ half directly).

    A dense call without dropout saves q, k, v, out, lse and its named tensors only: its seed is the
    unused one (the plan passes its own) and it has no offsets, so there is nothing else to keep
    for the backward (each saved tensor costs a pack and an unpack per step)."""

    @staticmethod
    def forward(ctx, q, k, v, seed, cu_q, cu_k, call, *tensors):
        module, layout, dropout_p, deterministic, max_q, max_k, planned = call
        varlen = cu_q is not None
        if planned is not None:  # api's fast path: (the plan of these tensors' metadata, seq_major), found by it
            plan, ctx.seq_major = planned
            if ctx.seq_major:
                q, k, v, layout = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), "bshd"
            out, lse, ctx.extra = plan.training_call(q, k, v, seed, _named(module, tensors), None, None)
            ctx.plan = plan
        else:
            # the launcher's training entry: the backward reuses this call's plan (no second key or check)
            def run(q, k, v, layout):
                return module._LAUNCHER.training_forward(q, k, v, layout, dropout_p, seed, _named(module, tensors),
                                                         cu_q, cu_k, max_q if varlen else None,
                                                         max_k if varlen else None)

            ctx.seq_major, (q, k, v, layout), (out, lse, ctx.plan, ctx.extra) = _run_seq_major(run, q, k, v, layout)
        call = (module, layout, dropout_p, deterministic, max_q, max_k)  # the layout it ran
        ctx.dense = not (varlen or dropout_p)  # the plan passes its own (unused) seed and no offsets
        if ctx.dense:
            ctx.save_for_backward(q, k, v, out, lse, *tensors)
        else:
            ctx.save_for_backward(q, k, v, out, lse, seed, cu_q, cu_k, *tensors)
        ctx.call = call
        ctx.mark_non_differentiable(lse)
        # lse takes no gradient: without this autograd would hand the backward a zero-filled dlse, an
        # allocation and a fill launch per step (~40-70 us of an H200 host's ~280 us short step)
        ctx.set_materialize_grads(False)
        # (a seq-major call's out: a view of the bshd buffer, detached so that autograd treats it as the
        # function's own output, not a view made inside it, which it would refuse to let the caller modify)
        return (out.transpose(1, 2).detach() if ctx.seq_major else out), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:  # out reached no loss (unmaterialized: None, not zeros): no gradient flows
            return (None,) * len(ctx.needs_input_grad)
        # The kernels are not differentiable: under create_graph (grad mode on here) the gradients are
        # marked as such (an error if a second backward reaches them), as once_differentiable does; the
        # usual backward runs in no-grad mode and skips that wrapper's context manager and checks.
        if torch.is_grad_enabled():
            return _once_differentiable_backward(ctx, dout, dlse)
        return AttentionFunction.gradients(ctx, dout, dlse)

    @staticmethod
    def gradients(ctx, dout, dlse):
        if ctx.seq_major:  # the forward ran the bshd views of its inputs: their gradients, as bhsd views
            dq, dk, dv, *rest = AttentionFunction.bshd_gradients(ctx, dout.transpose(1, 2), dlse)
            return (dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), *rest)
        return AttentionFunction.bshd_gradients(ctx, dout, dlse)

    @staticmethod
    def bshd_gradients(ctx, dout, dlse):
        """gradients() in the layout the forward ran (bshd where it took bhsd views of bshd memory)."""
        saved = ctx.saved_tensors
        module, layout, dropout_p, deterministic, max_q, max_k = ctx.call
        if ctx.dense:  # no dropout or offsets: the plan passes its own seed
            (q, k, v, out, lse, *tensors), seed, cu_q, cu_k = saved, None, None, None
            if not tensors:  # nor named tensors: straight to the plan's backward
                dq, dk, dv, _ = module._LAUNCHER.training_backward(ctx.plan, dout, q, k, v, out, lse, None, None,
                                                                   None, None, deterministic=deterministic)
                return dq, dk, dv, None, None, None, None
        else:
            q, k, v, out, lse, seed, cu_q, cu_k, *tensors = saved
        dq, dk, dv, tensor_grads = _backward_grads(dout, q, k, v, out, lse, seed, tensors, module, layout,
                                                   dropout_p, deterministic, ctx.needs_input_grad[7:], cu_q, cu_k,
                                                   max_q, max_k, ctx.plan, ctx.extra)
        return (dq, dk, dv, None, None, None, None, *tensor_grads)


def _once_differentiable_backward(ctx, dout, dlse):
    """gradients() under create_graph: computed without a graph and marked so that differentiating
    them raises (the kernels have no double backward). As torch's once_differentiable, but marked
    also where dO does not require grad (`grad(out.sum(), q, create_graph=True)`): the gradients
    still depend on q, k and v, and unmarked they came back as constants, so a gradient penalty
    on them added nothing, silently."""
    with torch.no_grad():
        grads = AttentionFunction.gradients(ctx, dout, dlse)
    marked = [None if g is None else g.detach().requires_grad_() for g in grads]
    error = torch._C._functions.DelayedError(
        b"flashgen attention has no double backward: its gradients (create_graph=True) cannot be differentiated "
        b"again; compute such a penalty with torch.nn.functional.scaled_dot_product_attention's math backend",
        len(marked))
    return error(*marked)
# Function.apply's C++ half (what its Python classmethod calls last): the classmethod also binds
# default arguments (only with a setup_context, which this Function has not), checks for functorch
# transforms and unwraps dead functorch wrappers among the arguments, ~2 us of a ~50 us step on the
# CI CPU (benchmarks/call_path_host.py). _apply_function does the last two itself, for q, k, v and
# the named tensors (the other arguments are flashgen's own), and leaves transforms to apply.
# These are torch internals: where a torch lacks one, every call goes through the public apply.
def _function_entry(function, torch_c):
    """(C++ apply, transforms-active check, unwrap_if_dead) for `function`, or None where this
    torch has not all three."""
    try:
        return (super(torch.autograd.Function, function).apply, torch_c._are_functorch_transforms_active,
                torch_c._functorch.unwrap_if_dead)
    except AttributeError:
        return None


_ENTRY = _function_entry(AttentionFunction, torch._C)


def _run_seq_major(run, q, k, v, layout):
    """(seq_major, (q, k, v, layout) as run, run(q, k, v, layout)): a bhsd call whose q views (batch, seq,
    heads, dim) memory (_seq_major) runs on the bshd views of q, k and v, else as given; a call refused
    that way is run as given, so that its error names the caller's own layout and shapes."""
    if layout == "bhsd" and _seq_major(q):
        views = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), "bshd")
        try:
            return True, views, run(*views)
        except (ValueError, TypeError):
            pass
    return False, (q, k, v, layout), run(q, k, v, layout)


def _seq_major(q):
    """Whether a bhsd-shaped q is a transpose(1, 2) view of (batch, seq, heads, dim) memory (its seq
    stride past its heads'), with more than one head and one row: transformers' q.view(B, L, H,
    D).transpose(1, 2), and most model code's. Such a call runs as bshd on the transposed views of q,
    k and v (whatever the order of k's and v's memory: transformers' KV cache hands them over
    contiguous), so out and dq come back as bhsd views of bshd memory, q's order, as SDPA's do: the
    caller's out.transpose(1, 2).reshape(...) is then a view, and its autograd graph holds no
    transposes; dk and dv are bhsd views of bshd memory too, as when the caller transposed k and v."""
    try:
        _, heads, seq, _ = q.shape
        _, head_stride, seq_stride, _ = q.stride()
        return seq_stride > head_stride and heads > 1 and seq > 1
    except (ValueError, TypeError, AttributeError):  # not a 4-d tensor: the checks that follow name it
        return False


def _apply_function(q, k, v, seed, cu_q, cu_k, call, *tensors):
    """AttentionFunction.apply(...), the eager path's entry."""
    if _ENTRY is None or _ENTRY[1]():
        return AttentionFunction.apply(q, k, v, seed, cu_q, cu_k, call, *tensors)
    c_apply, _, unwrap = _ENTRY
    if tensors:
        tensors = [unwrap(t) for t in tensors]
    return c_apply(unwrap(q), unwrap(k), unwrap(v), seed, cu_q, cu_k, call, *tensors)


# ----------------------------------------------------------------------------- FP8 (forward only)
@torch.library.custom_op("flashgen::attn_fwd_fp8", mutates_args=())
def attn_fwd_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: torch.Tensor | None,
                 k_descale: torch.Tensor | None, v_descale: torch.Tensor | None, tensors: list[torch.Tensor],
                 kernel_id: str, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_fp8(q, k, v, (q_descale, k_descale, v_descale), tensors,
                        kernel_module(resolve(kernel_id, q, k, layout, 0, 0)), layout)


def _forward_fp8(q, k, v, descales, tensors, module, layout):
    q_descale, k_descale, v_descale = descales
    return module.forward(q, k, v, layout=layout, tensors=_named(module, tensors), q_descale=q_descale,
                          k_descale=k_descale, v_descale=v_descale)


@attn_fwd_fp8.register_fake
def _attn_fwd_fp8_fake(q, k, v, q_descale, k_descale, v_descale, tensors, kernel_id, layout):
    _check_fake_devices(q, k, v, tensors, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    out, lse = _attn_fwd_fake(q, k, v, None, tensors, kernel_id, layout, 0.0, False, None, None, 0, 0)
    return out.to(torch.bfloat16), lse


def check_traced_tensors(q, k, v, layout, names, tensors, cu=None, descales=(None, None, None)):
    """Under torch.compile, before the op: every tensor of the call has data and is on q's device, each error
    naming its argument as the eager checks do (names: the named tensors'). Traced, the op's fake is also its
    Meta kernel: given a meta tensor among real ones, the dispatcher ran that, and the call returned memory nothing
    had written. (Each traced frame that calls the op checks: without fullgraph, dynamo traces a frame on its own.)"""
    host.check_tensors(q, k, v, layout)
    if cu is not None:
        for name, offsets in (("cu_seqlens_q", cu[0]), ("cu_seqlens_k", cu[1])):
            host.check_offsets(name, offsets, q.device)
    for name, t in (("k", k), ("v", v), *zip(names, tensors)):
        if isinstance(t, torch.Tensor):  # (a named value that is not a tensor: the op's own check names it)
            host.check_data(name, t)
            host.check_device(name, t, q.device)
    shape = (q.shape[0], k.shape[2 if layout == "bshd" else 1])  # (FP8 calls are dense)
    for name, d in zip(("q_descale", "k_descale", "v_descale"), descales):
        if d is not None:
            host.check_descale(name, d, q.device, shape)


def _check_fake_devices(q, k, v, tensors, **more):
    """The op's fake, which is also its Meta kernel: a meta tensor among real ones (the dispatcher runs this
    kernel for them) is refused, not answered with unwritten memory. Traced calls are checked by name before
    (check_traced_tensors); this catches the op called directly. more: name=tensor or None."""
    if q.device.type != "meta":
        for name, t in (("k", k), ("v", v), *((f"tensors[{i}]", t) for i, t in enumerate(tensors)), *more.items()):
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                raise ValueError(f"{name}: expected a tensor with data, got a meta tensor")


def apply_fp8_attention(q, k, v, descales, *, kernel_id: str, layout: str, tensors=(), names=()):
    """(out, lse) of an FP8 call (forward only: FP8 inputs carry no gradient here)."""
    if torch.compiler.is_compiling():
        check_traced_tensors(q, k, v, layout, names, tensors, None, descales)
        return attn_fwd_fp8(q, k, v, *descales, list(tensors), kernel_id, layout)
    if torch.is_grad_enabled():
        for name, t in (("q", q), ("k", k), ("v", v)):
            if getattr(t, "requires_grad", False):
                raise ValueError(f"{name}: FP8 attention is forward-only; it cannot differentiate a tensor that "
                                 "requires grad (use bf16 or fp16 for training)")
    return _forward_fp8(q, k, v, descales, tensors, kernel_module(kernel_id), layout)


def apply_attention(q, k, v, *, kernel_id: str, layout: str, seed: torch.Tensor, tensors=(), names=(),
                    dropout_p: float = 0.0, deterministic: bool = False, cu_seqlens_q=None, cu_seqlens_k=None,
                    max_seqlen_q: int = 0, max_seqlen_k: int = 0):
    """(out, lse) of one differentiable call: the custom op while torch.compile traces; in eager
    mode the autograd.Function when a gradient can flow (grad mode on and an input requires
    grad), else the module's forward alone. `tensors` are the spec's named tensors in its order."""
    if tensors and torch.is_grad_enabled():
        tensors = _gradient_ready(tensors)
    if torch.compiler.is_compiling():
        check_traced_tensors(q, k, v, layout, names, tensors,
                             None if cu_seqlens_q is None and cu_seqlens_k is None else (cu_seqlens_q, cu_seqlens_k))
        return attn_fwd(q, k, v, seed, list(tensors), kernel_id, layout, dropout_p, deterministic, cu_seqlens_q,
                        cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    module = kernel_module(kernel_id)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (tensors and any(t.requires_grad for t in tensors))):
        return _apply_function(q, k, v, seed, cu_seqlens_q, cu_seqlens_k,
                               (module, layout, dropout_p, deterministic, max_seqlen_q, max_seqlen_k, None), *tensors)
    return _forward_as_called(q, k, v, seed, tensors, module, layout, dropout_p, cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q, max_seqlen_k)
