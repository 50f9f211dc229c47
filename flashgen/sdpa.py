"""``flashgen.scaled_dot_product_attention``: torch's SDPA signature and semantics on flashgen kernels.

    from flashgen import scaled_dot_product_attention as sdpa   # instead of F.scaled_dot_product_attention

Alignment: ``is_causal=True`` here is SDPA's *top-left* causal mask (query i sees keys j <= i,
whatever the lengths), while flash-attn's names (``flashgen.attention(causal=True)``,
``flashgen.compat``) keep flash-attn's *bottom-right* alignment (j <= i + S - L). The two agree
only when L == S.

How the SDPA arguments map onto flashgen (one spec per distinct combination, compiled once):

* ``attn_mask`` bool (True = attend) becomes the mask expression ``attn_mask[b, h, q_idx, kv_idx]``
  over the tensor passed by name; a float mask becomes the score modifier ``score + attn_mask[...]``,
  so gradients flow into it when it requires grad. flashgen clamps tensor indices, so a mask
  dimension of size 1 serves every batch element, head, query or key: SDPA's broadcasting,
  without materialising the (B, H, L, S) mask.
* ``is_causal`` is the ``causal`` pattern with ``align: top_left``.
* ``scale`` is the softmax scale; a zero or negative scale (SDPA allows them, flashgen's
  softmax_scale must be positive) becomes the score modifier ``score * scale`` at scale 1.
* ``enable_gqa`` lets key/value have fewer heads than query (flashgen never copies them);
  without it, head counts broadcast as SDPA's math does (equal, or 1).
* Leading dims: any number, broadcast between query, key and value as in SDPA, flattened into
  flashgen's batch (a view unless they broadcast). A 2-d (L, E) query has one head.
* A query row whose keys are all masked outputs 0 with zero gradients, as torch's SDPA does; with a float
  mask that includes a row whose every score is below -65536 (a fill of -1e9 or float32's min, where torch's
  float32 math averages V): flashgen's LSE could not hold such a row's scale (common/tiles.j2's _finalize).
"""

from __future__ import annotations

import math
import numbers

import torch

from .api import _static_float, _static_int, attention, default_scales
from .errors import short_repr
from .runtime.host import SCALE_LIMIT
from .runtime.launch import check_tensor
from .spec import MAX_HEAD_DIM

__all__ = ["scaled_dot_product_attention"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MASK_NAME = "attn_mask"  # the named tensor the mask expressions read
_MASK_DIMS = ("b", "h", "q_idx", "kv_idx")  # what indexes each dim of a (batch, heads, L, S) attn_mask


def _type_name(x) -> str:
    """x's type as an error names it: 'int', 'numpy.bool' (whose __name__ alone reads 'bool')."""
    kind = type(x)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _check_tensors(query, key, value):
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t)
        if t.dim() < 2:
            raise ValueError(f"{name}: expected at least 2 dims (..., seq, dim), got shape {tuple(t.shape)}")
        if t.dim() != query.dim():
            raise ValueError(f"{name}: expected {query.dim()} dims as query has, got shape {tuple(t.shape)}")
        if t.dtype != query.dtype:
            raise ValueError(f"{name}: expected dtype {query.dtype} (query's), got {t.dtype}")
        if t.device != query.device:
            raise ValueError(f"{name}: expected device {query.device} (query's), got {t.device}")
    if query.dtype not in _DTYPES:
        raise ValueError(f"query: expected dtype float16, bfloat16 or float32, got {query.dtype}")
    for name, t in (("query", query), ("value", value)):
        if not 1 <= t.shape[-1] <= MAX_HEAD_DIM:
            raise ValueError(f"{name}: expected a head dim from 1 to {MAX_HEAD_DIM}, got shape {tuple(t.shape)}")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"key: expected head dim {query.shape[-1]} (query's), got shape {tuple(key.shape)}")
    if value.shape[-2] != key.shape[-2]:
        raise ValueError(f"value: expected seq len {key.shape[-2]} (key's), got shape {tuple(value.shape)}")


def _shape_of(*shapes, what):
    """torch.broadcast_shapes in plain Python: traced by torch.compile, torch's runs as a graph node whose mismatch
    fails in a fake-tensor call instead of naming the argument."""
    ndim = max(len(shape) for shape in shapes)
    out = []
    for i in range(-ndim, 0):
        size = 1
        for shape in shapes:
            n = shape[i] if len(shape) >= -i else 1
            if n != 1:
                if size != 1 and n != size:
                    raise ValueError(f"{what}: shapes {' and '.join(str(tuple(s)) for s in shapes)} do not broadcast")
                size = n
        out.append(size)
    return tuple(out)


def _heads(query, key, value, enable_gqa):
    """(leading dims, query heads, KV heads), SDPA's rules: with enable_gqa the KV head counts
    divide the query's; without it every leading dim, heads included, broadcasts."""
    if query.dim() == 2:
        return (), 1, 1
    if not enable_gqa:
        lead = _shape_of(query.shape[:-2], key.shape[:-2], value.shape[:-2], what="query, key, value")
        return lead[:-1], lead[-1], lead[-1]
    lead = _shape_of(query.shape[:-3], key.shape[:-3], value.shape[:-3], what="query, key, value")
    hq, hk, hv = query.shape[-3], key.shape[-3], value.shape[-3]
    for name, h in (("key", hk), ("value", hv)):
        if h == 0 or hq % h:
            raise ValueError(f"{name}: with enable_gqa its number of heads must divide query's {hq}, got {h}")
    kv_heads = max(hk, hv)  # their least common multiple (math.lcm, written so torch.compile traces it)
    while kv_heads % hk or kv_heads % hv:
        kv_heads += max(hk, hv)
    return lead, hq, kv_heads


_CHECKED = {}  # the inputs' metadata and enable_gqa -> _heads' answer, for inputs _check_tensors passed
_MASKS = {}  # the mask's and the call's metadata -> _mask_plan's answer, for masks _check_mask passed
_MAX_CHECKED = 256


def _once_per_metadata(table, metadata, work, *args):
    """work(*args) (checks, then what they let through), once per metadata(*args) kept in `table`, then a
    dictionary hit; every time while torch.compile traces, or where metadata raises AttributeError (an argument
    that is not a tensor: the checks name it)."""
    if torch.compiler.is_compiling():
        return work(*args)
    try:
        meta = metadata(*args)
    except (AttributeError, RuntimeError):  # (a nested tensor's shape raises RuntimeError)
        return work(*args)
    found = table.get(meta)
    if found is None:
        found = work(*args)
        if len(table) >= _MAX_CHECKED:
            table.clear()
        table[meta] = found
    return found


def _inputs_metadata(query, key, value, enable_gqa):
    return (query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype, query.device, key.device,
            value.device, query.layout, key.layout, value.layout, enable_gqa)


def _checked_inputs_heads(query, key, value, enable_gqa):
    _check_tensors(query, key, value)
    return _heads(query, key, value, enable_gqa)


def _checked_heads(query, key, value, enable_gqa):
    """_check_tensors, then _heads' (leading dims, query heads, KV heads): once per inputs' metadata (their shapes,
    dtypes and devices are all that either reads), then a dictionary hit (CI CPU: ~8 of an is_causal call's 24 us)."""
    return _once_per_metadata(_CHECKED, _inputs_metadata, _checked_inputs_heads, query, key, value, enable_gqa)


def _as_bhsd(t, lead, heads):
    """t as (batch, heads, seq, dim): leading dims broadcast and flattened; KV heads repeated
    only where key and value have different counts (enable_gqa allows it, flashgen shares one)."""
    if t.dim() == 2:
        return t[None, None]
    if t.dim() == 4 and len(lead) == 1 and t.shape[0] == lead[0] and t.shape[1] == heads:
        return t  # (batch, heads, seq, dim) already, the common call: no views to make (~3 us each)
    if t.shape[-3] != heads and t.shape[-3] != 1:
        t = t.repeat_interleave(heads // t.shape[-3], dim=-3)  # enable_gqa, key and value differ
    t = t.expand(*lead, heads, *t.shape[-2:])
    return t.reshape(math.prod(lead), *t.shape[-3:])  # (not -1: a 0-size dim leaves it undetermined)


def _check_mask(attn_mask, query, target):
    """Refuse an attn_mask that is not a bool or float tensor on query's device broadcastable to the (batch, heads,
    L, S) call (also where L or S is 0: torch's SDPA refuses it there too)."""
    check_tensor("attn_mask", attn_mask, "a torch.Tensor or None")
    if attn_mask.dtype != torch.bool and attn_mask.dtype not in (query.dtype, torch.float32):
        raise ValueError(f"attn_mask: expected dtype bool, float32 or query's {query.dtype}, got {attn_mask.dtype}")
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask: expected device {query.device} (query's), got {attn_mask.device}")
    # (each of its dims 1 or the call's; in plain Python, as _shape_of, so that a traced mismatch names it)
    fits = attn_mask.dim() <= len(target) and all(m == 1 or m == t for m, t in zip(attn_mask.shape[::-1], target[::-1]))
    if not fits:
        raise ValueError(f"attn_mask: expected a shape broadcastable to {target} (query's batch, heads, "
                         f"L and key's S), got {tuple(attn_mask.shape)}")


def _mask_metadata(attn_mask, query, target):
    return attn_mask.shape, attn_mask.dtype, attn_mask.layout, attn_mask.device, query.dtype, query.device, target


def _checked_mask_plan(attn_mask, query, target):
    _check_mask(attn_mask, query, target)
    return _mask_plan(tuple(attn_mask.shape), attn_mask.dtype == torch.bool, target)


def _checked_mask(attn_mask, query, target):
    """_check_mask, then _mask_plan's answer: once per (mask, call) metadata, then a dictionary hit (CI CPU: the
    check and the mask's views took ~12 of a bool-mask call's 50 us)."""
    return _once_per_metadata(_MASKS, _mask_metadata, _checked_mask_plan, attn_mask, query, target)


def _kept_dims(shape):
    """The dims of a (batch, heads, L, S) mask shape that the mask's expressions index: those not of size 1 (the
    key dim where all are)."""
    return [d for d in range(4) if shape[d] != 1] or [3]


def _mask_plan(shape, is_bool, target):
    """(dims, mask, score_mod) of a mask of this shape (checked: _check_mask) over the (batch, heads, L, S) call
    `target`. The expressions index the mask by the dims it does not broadcast along only (an (L, S) mask is
    attn_mask[q_idx, kv_idx]): a mask shared by the batch or the heads has one block map for them all, not one per
    (batch, head), and fewer index terms per element. H200, B=4 H=16 S=2048 hd128, a bool (L, S) mask indexed by all
    four: its block map took 1071 us per call (.scratch/mask_probe.py, session 49). dims: the mask's own dims of
    size 1 that the expressions do not index (squeezed off per call; () for the common (L, S) and (B, H, L, S)
    masks: the mask itself is passed), or None where the call has several leading dims to flatten (_flat_mask)."""
    flat = len(target) > 4 or len(shape) == 0  # several leading dims, or a 0-d mask (not `not shape`: torch 2.11's
    # dynamo cannot trace `not` of a tuple)
    if flat:  # the (batch, heads, L, S) shape _flat_mask makes
        m = (1,) * (len(target) - len(shape)) + shape
        lead = math.prod(target[:-3]) if any(d != 1 for d in m[:-3]) else 1
        padded = (1,) * (4 - len(m)) + m if len(m) <= 4 else (lead, *m[-3:])
    else:
        padded = (1,) * (4 - len(shape)) + shape
    kept = _kept_dims(padded)
    dims = None if flat else tuple(d - (4 - len(shape)) for d in range(4 - len(shape), 4) if d not in kept)
    index = f"{MASK_NAME}[{', '.join(_MASK_DIMS[d] for d in kept)}]"
    if is_bool:
        return dims, f"{index} != 0", ()
    return dims, None, (f"score + {index}",)


def _mask_view(attn_mask, dims, target):
    """The tensor _mask_plan's expressions read: attn_mask less its dims `dims`, or flattened (_flat_mask)."""
    if dims is None:
        return _flat_mask(attn_mask, target)
    return attn_mask.squeeze(dims) if dims else attn_mask


def _flat_mask(attn_mask, target):
    """attn_mask over a call of several leading dims (or a 0-d one) as (batch, heads, L, S) with the dims it
    broadcasts along dropped, as _mask_plan indexes it (its leading dims flattened as query's were: a copy only
    where they broadcast)."""
    m = attn_mask.reshape((1,) * (len(target) - attn_mask.dim()) + tuple(attn_mask.shape))
    if len(target) > 4:
        if any(d != 1 for d in m.shape[:-3]):
            m = m.expand(*target[:-3], *m.shape[-3:])
        m = m.reshape(-1, *m.shape[-3:])
    m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))  # (batch, heads, L, S), each 1 or the call's
    kept = _kept_dims(m.shape)
    return m[tuple(slice(None) if d in kept else 0 for d in range(4))]  # (a view: the broadcast dims dropped)


def _empty_result(out_shape, *inputs):
    """A call with nothing to compute: zeros of its (empty) output shape, differentiable as SDPA's is (each input
    that requires a gradient gets one of its shape, zeros)."""
    out = inputs[0].new_zeros(out_shape)
    for t in inputs:
        if t is not None and t.requires_grad:
            out = out + t.sum() * 0
    return out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention on a flashgen kernel: same arguments,
    shapes, broadcasting and results, differentiable (into a float ``attn_mask`` too).

    query (..., Hq, L, E), key (..., H, S, E), value (..., H, S, Ev) -> (..., Hq, L, Ev).
    ``is_causal`` is aligned top-left, as in SDPA (query i sees keys j <= i);
    ``flashgen.attention(causal=True)`` and ``flashgen.compat`` keep flash-attn's bottom-right
    alignment (j <= i + S - L). ``attn_mask``: bool (True = attend) or float added to the
    scores (float32 or query's dtype), broadcastable to (..., Hq, L, S); with ``is_causal`` too,
    a pair must pass both (as torch 2.13's SDPA combines them).
    ``dropout_p`` drops attention probabilities whenever it is > 0, as SDPA does (pass 0.0 in
    eval). dtypes: float16, bfloat16, float32.
    """
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa: expected a bool, got {_type_name(enable_gqa)}")
    lead, heads, kv_heads = _checked_heads(query, key, value, enable_gqa)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal: expected a bool, got {_type_name(is_causal)}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1], got {short_repr(dropout_p)}")
    if scale is not None and torch.compiler.is_compiling():  # a symbolic scale: its usual values, specialized
        scale = _static_float(scale, *default_scales(_static_int(query.shape[-1])))
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)  # (numpy's too, as SDPA)
                              or not math.isfinite(scale)):
        raise ValueError(f"scale: expected a finite Python number or None, got {short_repr(scale)}")
    seqlen_q, seqlen_k = query.shape[-2], key.shape[-2]
    out_shape = (*lead, heads, seqlen_q, value.shape[-1]) if query.dim() > 2 else (seqlen_q, value.shape[-1])
    if attn_mask is not None:
        mask_plan = _checked_mask(attn_mask, query, (*lead, heads, seqlen_q, seqlen_k))
    if heads == 0 or 0 in lead:  # an empty batch, or no heads: SDPA's empty result (no kernel, no named tensor)
        return _empty_result(out_shape, query, key, value, attn_mask)
    if not enable_gqa and query.dim() == key.dim() == value.dim() == 3:
        # (N, L, E): N sequences of one head, a batch (a head count is a constant of the kernel: N as heads compiled
        # a kernel per N, and under torch.compile a recompile)
        lead, heads, kv_heads = (heads,), 1, 1
        query, key, value = query[:, None], key[:, None], value[:, None]
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask[:, None]
        if attn_mask is not None:  # (its plan over the call as it now is)
            mask_plan = _checked_mask(attn_mask, query, (*lead, heads, seqlen_q, seqlen_k))
    q = _as_bhsd(query, lead, heads)
    k, v = _as_bhsd(key, lead, kv_heads), _as_bhsd(value, lead, kv_heads)

    mask, mods, tensors = None, [], {}
    if attn_mask is not None and seqlen_q and seqlen_k:
        dims, mask, mods = mask_plan
        mods, tensors = list(mods), {MASK_NAME: _mask_view(attn_mask, dims, (*lead, heads, seqlen_q, seqlen_k))}
    causal = False
    if is_causal and mask is None and seqlen_q == seqlen_k:
        # top-left is bottom-right where L == S: flashgen's plain causal spec (its kernel, tuned configs and the
        # per-call fast path; the top-left pattern is a mask spec of its own: host time 40 -> 24 us per call)
        causal = True
    elif is_causal:  # with attn_mask too, as torch's SDPA combines them: both must allow a pair
        top_left = {"causal": {"align": "top_left"}}
        mask = top_left if mask is None else {"and": [top_left, mask]}
    softmax_scale = None if scale is None else float(scale)
    # a scale the kernels' own cannot hold (not positive, or past float32's range once times log2(e)) multiplies
    # the scores instead, as torch's does (a huge one overflows to NaN rows there too)
    if softmax_scale is not None and not 0 < softmax_scale <= SCALE_LIMIT:
        mods.insert(0, {"expr": "score * s", "params": {"s": softmax_scale}})
        softmax_scale = 1.0
    p = float(dropout_p)
    # (one modifier as its string: a plain value, which api's fast path can key, where a list is not)
    score_mod = mods[0] if len(mods) == 1 and isinstance(mods[0], str) else mods or None
    out = attention(q, k, v, causal=causal, softmax_scale=softmax_scale, dropout_p=0.0 if p == 1.0 else p, mask=mask,
                    score_mod=score_mod, **tensors)
    if p == 1.0:  # every probability dropped: SDPA returns zeros (and zero gradients)
        out = out * 0.0
    if not torch.compiler.is_compiling() and out.shape == out_shape:
        # (B, H, L, Ev) already, the common call: a reshape to the same shape is still a view, one more node for
        # autograd's backward to walk (CI CPU, B=1 H=16 S=128 is_causal fwd+bwd, call_path_host: 89 -> 83 us)
        return out
    return out.reshape(out_shape)
