"""flashgen as a Hugging Face transformers attention implementation.

    from flashgen.integrations.transformers import register
    name = register()                                  # "fg_attention"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)
    model.set_attn_implementation(name)                # or switch a model you have

``register()`` adds one function to transformers' ``AttentionInterface`` and one to its
``AttentionMaskInterface`` under the returned name (transformers treats any name containing
"flash" as one of its flash-attn packages, so the default is "fg_attention").

What each call does, following transformers' own flash-attention path (``_flash_attention_forward``):

* Causal attention is flashgen's ``causal`` aligned bottom-right, which is what a KV cache
  needs: the L new queries are the last L of the S keys (prefill, decode, chunked prefill).
* Padded batches go through ``flashgen.attention_varlen``: the mask interface hands the
  attention the 2-d (batch, keys) padding mask (or None when nothing is padded) with its packing
  (kept tokens, cu_seqlens, longest row) worked out once per forward, and each layer packs the
  real tokens with it, runs varlen, and scatters the output back (padded query rows are 0). No
  (B, H, L, S) mask is built. A window over a row with padding between its tokens (a right-padded
  prompt, then generated tokens) runs unpacked instead, the padding a mask over keys, so that the
  window counts positions as transformers' does (packed, those tokens are closer than they are).
  Queries are the last L keys' rows (left padding, as transformers assumes), except one query per
  row in decode. ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` kwargs (padding-free training) and packed ``position_ids`` (batch 1,
  positions restarting: a document at every step that is not +1) also take the varlen path, with a
  KV cache present too, as transformers' flash-attention path (its SDPA path splits documents only
  without a cache).
* ``sliding_window`` (the key q - sliding_window < kv <= q) is the ``sliding_window`` pattern
  with left = sliding_window - 1; ``softcap`` the ``softcap`` score modifier; ``scaling`` the
  softmax scale; ``dropout`` flashgen's fused dropout; GQA is native (K/V never repeated).
* ``s_aux``, learnable sinks as gpt-oss uses them: one logit per head that joins every row's
  softmax and carries no value (softmax over [scores, sink], sink column dropped). flashgen has
  no sink-logit feature; it is expressed exactly as one zero key and value prepended to every
  sequence, scored by the modifier ``where(kv_idx == 0, s_aux[h], score)``. The shift by one
  key keeps bottom-right alignment, the ``sink`` mask pattern keeps that key visible beside a
  window, and gradients reach q, k, v and s_aux through flashgen's own backward.
  (Rescaling by sigmoid(lse - sink) is exact in the forward too, but flashgen's LSE carries
  no gradient, so training would lose the normaliser's share of dQ, dK and dsink.) Cost: K and
  V are copied once per call with the extra row.
* A 4-d mask (a custom mask passed to the model) runs as ``flashgen.scaled_dot_product_attention``
  with that mask, as transformers' SDPA path would.
* Static KV caches (``cache_implementation="static"``): the keys are the cache's slots, the first
  ones filled. The mask hook returns an int8 (batch, slots) mask (token, padding, unfilled), of the
  same shape at every step (transformers compiles the steps on a GPU, and a mask that grew would
  make a new graph per step). Untraced, a layer runs only the filled slots, as a dynamic cache's
  keys (the decode kernel, packing); traced, the mask masks the rest, and the causal bound of
  several new queries (and a window's) is taken from the filled count (``_filled_bounds``).

Not supported, refused with an error: paged attention (continuous batching) and ``position_bias``.
Mask overlays a model adds to the causal mask through ``or_mask_function``/``and_mask_function``
(image tokens seeing each other) are not applied, as in transformers' flash-attention path.
"""

from __future__ import annotations

import operator
import warnings

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .. import attention, attention_varlen, scaled_dot_product_attention
from ..api import _static_float
from ..errors import short_repr
from ..kvcache import compat_launcher

__all__ = ["DEFAULT_NAME", "register", "attention_forward", "padding_mask"]

DEFAULT_NAME = "fg_attention"
SINKS = "s_aux"  # the named tensor the sink score modifier reads


def register(name: str = DEFAULT_NAME) -> str:
    """Make flashgen selectable as ``attn_implementation=name`` in transformers; returns name."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name: expected an identifier-like string such as {DEFAULT_NAME!r}, got {name!r}")
    if "flash" in name:
        raise ValueError(f"name: transformers treats names containing 'flash' as its flash-attn packages; "
                         f"choose another (e.g. {DEFAULT_NAME!r}), got {name!r}")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    return name


def padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                 **kwargs):
    """transformers' mask hook: the (batch, kv_length) bool padding mask the attention unpads
    with, or None when no token is padded (causal and windows are the kernel's own patterns); a static
    cache's filled, unpadded slots (_static_keep)."""
    # (a bidirectional mask, create_bidirectional_mask's: an encoder's, or cross-attention's over the encoder's
    # tokens, whose kv_length is theirs, not a cache's)
    bidirectional = "allow_is_bidirectional_skip" in kwargs
    # a static cache: StaticLayer's offset is a tensor, a sliding static layer's slots outnumber its filled ones (and
    # so does a call without a cache whose mask is longer than its tokens: attention_forward names the mask)
    if not bidirectional and (isinstance(q_offset, torch.Tensor) or kv_length > q_offset + q_length):
        return _static_keep(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, kwargs.get("device"))
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]  # sliding-window layers keep the last keys
    if torch.compiler.is_compiling():  # no value read while traced: the layers mask densely (_traced_masks)
        return attention_mask
    if bool(attention_mask.all()):
        return None
    # the packing every layer of this forward unpads with, worked out once (nonzero and the longest row are
    # two waits for the device): carried by this view, which the hook made and only the layers see; a mask
    # the layers get otherwise (copied) is packed by each layer
    attention_mask._flashgen_packing = _packing(attention_mask.bool())
    return attention_mask


UNFILLED = 2  # a static cache's slot past the filled ones in _static_keep's mask (1: a token, 0: padding)


def _static_keep(batch, q_length, kv_length, q_offset, kv_offset, attention_mask, device):
    """A static cache's mask (cache_implementation="static": keys are the cache's kv_length slots, the first
    q_offset + q_length of them filled, the queries the last q_length filled ones): (batch, kv_length) int8, 1
    where a token is, 0 where the 2-d padding mask has padding (over positions from kv_offset on, as transformers
    reads it: a sliding layer's rolled slots), UNFILLED past the filled slots. Its shape is the cache's, fixed for every
    step (a compiled step's mask input keeps one shape); made of tensor ops only (no wait for the device: the
    filled count is read by the first layer that needs it, _static_filled), so it traces. (transformers hands the
    hook its own mask again as bool, UNFILLED as True: the filled count masks it.)"""
    end = q_offset + q_length
    if attention_mask is not None:
        pad = attention_mask.bool()
        if pad.shape[1] != kv_length:  # (of that length: this hook's own mask, back from the model as bool)
            pad = pad[:, kv_offset:kv_offset + kv_length]
        keep = torch.nn.functional.pad(pad, (0, kv_length - pad.shape[1]), value=False)
    else:
        keep = torch.ones(batch, kv_length, dtype=torch.bool,
                          device=end.device if isinstance(end, torch.Tensor) else device)
    filled = (torch.arange(kv_length, device=keep.device) < end)[None]
    return torch.where(filled, keep.to(torch.int8), UNFILLED)


def _static_filled(slots):
    """(filled count, the filled slots' bool padding mask carrying its packing, or None where nothing is padded) of
    _static_keep's mask, untraced: worked out once per mask (kept on it: every layer of a forward gets the same mask;
    a copy works them out again). Two waits for the device, and the packing's."""
    found = getattr(slots, "_flashgen_static", None)
    if found is None:
        count, padded = torch.stack([(slots[0] != UNFILLED).sum(), (slots == 0).any()]).tolist()
        padding = None
        if padded:
            padding = slots[:, :count] == 1
            padding._flashgen_packing = _packing(padding)
        found = slots._flashgen_static = (count, padding)
    return found


KEEP, DOCUMENTS = "fg_keep", "fg_documents"  # the named tensors of _traced_masks


def _traced_masks(mask, attention_mask, position_ids, batch, seqlen_q, seqlen_k, sinks, tensors):
    """Under torch.compile, a layer's mask with its padding and packed positions as dense masks over named
    tensors: unpadding (nonzero) and the positions' test read values, which fullgraph cannot trace. A
    (batch, keys) padding mask (its shape checked by the caller) masks the padded keys, as SDPA's 4-d mask
    does; packed positions (batch 1, positions restarting) become document ids, a query seeing its own
    document's keys (a single run of positions is one document). sinks: the keys have the sink's row in
    front (_with_sink_rows)."""
    extra = []
    if attention_mask is not None:
        keep = attention_mask.bool()
        tensors[KEEP] = torch.nn.functional.pad(keep, (1, 0), value=True) if sinks else keep
        extra.append({"expr": f"{KEEP}[b, kv_idx] != 0"})
    elif position_ids is not None and batch == 1 and seqlen_q == seqlen_k > 1 and not sinks:
        pos = position_ids.reshape(1, -1)
        tensors[DOCUMENTS] = torch.cumsum(_run_starts(pos[0]).to(torch.int32), dim=0, dtype=torch.int32)[None]
        extra.append({"document": {"ids": DOCUMENTS, "causal": False}})  # (the layer's causal flag still holds)
    if not extra:
        return mask
    if mask is None:
        return extra[0]
    return {"and": [mask, *extra]}


DIAG = "fg_diag"  # _filled_bounds' named tensor


def _filled_bounds(slots, is_causal, sliding_window, sinks, seqlen_q, tensors):
    """(causal, mask) of a traced call over a static cache (_static_keep's slots): the queries are the last seqlen_q
    filled slots, not the last slots, so bottom-right alignment would let several queries see unfilled slots'
    neighbours, and a window would count from the last slot (a row's padding, masked too, does not say where the
    filled slots end): the causal bound (and a window's) is kv_idx - q_idx against each row's own diagonal, a named
    tensor. sinks: the keys have the sink's in front (_with_sink_rows), seen by every query."""
    tensors[DIAG] = (slots != UNFILLED).sum(dim=1, dtype=torch.int32) - seqlen_q  # filled count, less the queries
    window = _window(sliding_window)
    kv = "kv_idx - 1" if sinks else "kv_idx"
    bounds = [{"expr": f"{kv} - q_idx <= {DIAG}[b] + {0 if is_causal or window is None else window}"}]
    if window is not None:
        bounds.append({"expr": f"q_idx - ({kv}) <= {window} - {DIAG}[b]"})
    mask = bounds[0] if len(bounds) == 1 else {"and": bounds}
    return False, {"or": [{"expr": "kv_idx < 1"}, mask]} if sinks else mask


def _window(sliding_window):
    """The keys before the query a sliding_window layer sees (None: no window), the argument checked."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window: expected a positive int or None, got {sliding_window!r}")
    return sliding_window - 1  # transformers' window holds the query and window - 1 keys before it


def _variant(is_causal, sliding_window, softcap, s_aux, tensors):
    """(causal, mask, score_mod) for one layer's options; a sink adds its tensor to `tensors`."""
    window = _window(sliding_window)
    # (a softcap is a constant of the spec: under torch.compile a symbolic one is specialized)
    mods = [{"softcap": _static_float(_number("softcap", softcap, float))}] if softcap is not None else []
    causal, mask = is_causal, None
    if s_aux is None:
        if window is not None:
            mask = {"sliding_window": {"left": window, "right": 0 if is_causal else window}}
            causal = False  # the window's right = 0 is the causal bound
        return causal, mask, mods or None
    if not isinstance(s_aux, torch.Tensor) or s_aux.dim() != 1:
        raise ValueError(f"s_aux: expected a (heads,) tensor of sink logits, got {s_aux!r:.80}")
    tensors[SINKS] = s_aux
    mods.append(f"where(kv_idx == 0, {SINKS}[h], score)")
    if window is not None and is_causal:
        mask, causal = {"sink": {"tokens": 1, "window": window}}, False  # causal, and the sink or the window
    elif window is not None:
        # (a pattern dict, not flashgen.mask objects: built per call, those would be parsed while traced)
        mask = {"or": [{"expr": "kv_idx < 1"}, {"sliding_window": {"left": window, "right": window}}]}
    return causal, mask, mods


def _with_sink_rows(k, v, cu_seqlens=None):
    """k, v with one zero row before each sequence (the sink's key and value) and its cu_seqlens."""
    if cu_seqlens is None:  # (B, S, H, D): one zero key at the front of every batch row
        return tuple(torch.cat([t.new_zeros(t.shape[0], 1, *t.shape[2:]), t], dim=1) for t in (k, v)) + (None,)
    tokens = torch.arange(k.shape[0], device=k.device)
    seq = torch.searchsorted(cu_seqlens[1:].long(), tokens, right=True)  # the sequence of each token
    dest = tokens + seq + 1
    rows = k.shape[0] + cu_seqlens.numel() - 1
    out = [t.new_zeros(rows, *t.shape[1:]).index_copy(0, dest, t) for t in (k, v)]
    return out[0], out[1], cu_seqlens + torch.arange(cu_seqlens.numel(), device=k.device, dtype=cu_seqlens.dtype)


def _packing(keep):
    """(indices of kept tokens, int32 cu_seqlens, max length, whether each row's kept tokens are one run) of a
    (batch, seq) bool mask. A row with padding between its tokens (a right-padded prompt, then generated tokens)
    packs tokens that are further apart in positions than in the pack: a sliding window then needs positions."""
    lengths = keep.sum(dim=1, dtype=torch.int32)
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    seq = keep.shape[1]
    first, last = keep.int().argmax(1), seq - 1 - keep.flip(1).int().argmax(1)
    gaps = ((last - first + 1) != lengths) & (lengths > 0)
    longest, gapped = torch.stack([lengths.max(), gaps.any().to(lengths.dtype)]).tolist()  # (one wait)
    return keep.flatten().nonzero().squeeze(1), cu, longest, not gapped


def _run_starts(pos):
    """Where each run of positions (each step +1) starts in a 1-d position_ids: its first token and every
    token whose position is not the one before's + 1 (transformers' find_packed_sequence_indices; a packed
    row may begin with the tail of a document, at no minimum)."""
    return torch.cat([torch.ones_like(pos[:1], dtype=torch.bool), pos[1:] != pos[:-1] + 1])


def _packed_positions(position_ids, batch, seqlen):
    """cu_seqlens of sequences packed into one row (positions restart), or None, as transformers
    detects them (batch 1, more than one token, positions not one increasing run)."""
    if position_ids is None or batch != 1 or seqlen == 1:
        return None
    starts = _run_starts(position_ids.reshape(-1)).nonzero().squeeze(1)
    if starts.numel() == 1:
        return None
    cu = torch.cat([starts, starts.new_tensor([seqlen])]).to(torch.int32)
    longest = int(cu.diff().max())  # (one wait for the device)
    return cu, cu, longest, longest


def _number(name, value, kind):
    """transformers' scalar argument `name` as a float, or an int (kind int: an integer, a 2.7 is not
    truncated), from a Python number or a one-element tensor; else a TypeError naming it."""
    try:
        if isinstance(value, bool) or isinstance(value, torch.Tensor) and value.dtype == torch.bool:
            raise TypeError
        if kind is int and torch.compiler.is_compiling() and not isinstance(value, (float, torch.Tensor)):
            return value  # traced: kept symbolic (index() would specialize it, a recompile per new max_length_q/k)
        return float(value) if kind is float else operator.index(value)
    except (TypeError, ValueError, RuntimeError):  # (RuntimeError: a tensor of several elements)
        raise TypeError(f"{name}: expected {'a number' if kind is float else 'an integer'}, got "
                        f"{short_repr(value)}") from None


_warned = []  # output_attentions' warning, once per process

PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")  # padding-free training's


def _offsets(name, value):
    """transformers' packed-sequence offsets `name` as int32 (flashgen's offsets), from an integer tensor; a
    float one (whose values .to(int32) would truncate) is refused naming it."""
    if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor of sequence offsets, got {short_repr(value)}")
    return value.to(torch.int32)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, s_aux=None, is_causal=None, **kwargs):
    """transformers' attention-function signature: query (B, H, L, D), key/value (B, H_kv, S, D)
    -> ((B, L, H, Dv) output, None). See the module docstring for what each argument does."""
    for arg in ("cache", "position_bias"):
        if kwargs.get(arg) is not None:
            raise NotImplementedError(f"{arg}: not supported by flashgen's transformers attention "
                                      "(paged caches and position biases need a dense mask)")
    if kwargs.get("output_attentions") and not _warned:  # as transformers' SDPA and flash-attention paths
        _warned.append(1)
        warnings.warn("output_attentions: flashgen's transformers attention returns no attention weights "
                      "(the kernels never form them); set the model's attention to 'eager' for them", stacklevel=2)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    dropout = _number("dropout", dropout, float)
    if attention_mask is not None and attention_mask.dtype == torch.int8 and not torch.compiler.is_compiling():
        # a static cache (_static_keep): its filled slots are the keys, as a dynamic cache's
        _check_padding_mask(attention_mask, query.shape[0], key.shape[2])
        filled, attention_mask = _static_filled(attention_mask)
        key, value = key[:, :, :filled], value[:, :, :filled]
    if (attention_mask is None and s_aux is None and kwargs.get("cu_seq_lens_q") is None
            and _decode_shaped(query, key, value, is_causal, dropout)):  # a generation step: checked first
        return _decode(query, key, value, _window(sliding_window), softcap, scaling), None
    if attention_mask is not None and attention_mask.dim() == 4:  # a model-specific or user mask
        if sliding_window is not None or softcap is not None or s_aux is not None:
            raise NotImplementedError("attention_mask: a 4-d mask cannot be combined with sliding_window, "
                                      "softcap or s_aux here; pass the 2-d padding mask")
        out = scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                           scale=scaling, enable_gqa=True)
        return out.transpose(1, 2), None
    tensors = {}
    causal, mask, score_mod = _variant(bool(is_causal), sliding_window, softcap, s_aux, tensors)
    batch, seqlen_q, seqlen_k = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask is not None:
        _check_padding_mask(attention_mask, batch, seqlen_k)
    if torch.compiler.is_compiling() and kwargs.get("cu_seq_lens_q") is None:
        if attention_mask is not None and attention_mask.dtype == torch.int8:  # a static cache's (_static_keep)
            window = sliding_window is not None
            if seqlen_q < seqlen_k and (is_causal or window) and (seqlen_q > 1 or window):
                causal, mask = _filled_bounds(attention_mask, is_causal, sliding_window, s_aux is not None, seqlen_q,
                                              tensors)
            attention_mask = attention_mask == 1
        mask = _traced_masks(mask, attention_mask, kwargs.get("position_ids"), batch, seqlen_q, seqlen_k,
                             s_aux is not None, tensors)
        attention_mask = None
    kw = dict(causal=causal, mask=mask, score_mod=score_mod, softmax_scale=scaling, dropout_p=dropout, **tensors)
    if (attention_mask is None and s_aux is None and kwargs.get("cu_seq_lens_q") is None
            and (batch != 1 or seqlen_q != seqlen_k or kwargs.get("position_ids") is None)
            and not torch.compiler.is_compiling()):
        # the commonest call (training, prefill): the (B, H, L, D) tensors as they are; flashgen runs a query
        # viewing (B, L, H, D) memory as bshd and returns out in that order, so out.transpose(1, 2) is
        # contiguous and no transpose enters the autograd graph (with them, this call's backward took 90-145 us
        # more host time than flashgen.attention's on bshd tensors on an H200 host: benchmarks/NOTES.md,
        # session 27). (Under torch.compile the transposes below are free.)
        return attention(query, key, value, layout="bhsd", **kw).transpose(1, 2), None
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, L, H, D) views: flashgen's bshd

    packing = None
    if attention_mask is not None:  # the mask hook's packing (padding_mask), else this layer's
        packing = getattr(attention_mask, "_flashgen_packing", None) or _packing(attention_mask.bool())
    if packing is not None and mask is not None and not packing[3]:
        # a window (or a sink's window) over rows with padding between their tokens: positions, not the pack's
        # indices, bound it, so the padding masks keys in place (as under torch.compile) and nothing is packed
        kw.update(mask=_traced_masks(mask, attention_mask, None, batch, seqlen_q, seqlen_k, s_aux is not None, tensors),
                  **tensors)
        if s_aux is not None:
            k, v, _ = _with_sink_rows(k, v)
        return attention(q, k, v, layout="bshd", **kw), None
    if packing is not None:  # padded batch: pack the real tokens, run varlen, scatter back
        idx_k, cu_k, max_k, _ = packing
        if not causal and mask is None:  # bidirectional, no positional mask: every query is real
            # (cross-attention's queries are another sequence, the decoder's, which the encoder's padding says
            # nothing of; an encoder's padded query rows attend the real keys, as with SDPA's mask)
            idx_q = None
            cu_q = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * seqlen_q
            max_q = seqlen_q
        elif seqlen_q == seqlen_k:
            idx_q, cu_q, max_q = idx_k, cu_k, max_k
        elif seqlen_q == 1:  # decode: every row's one new token
            idx_q = torch.arange(batch, device=q.device)
            cu_q, max_q = torch.arange(batch + 1, device=q.device, dtype=torch.int32), 1
        else:  # the new tokens are the last seqlen_q keys (left padding)
            idx_q, cu_q, max_q, _ = _packing(attention_mask[:, -seqlen_q:].bool())
        flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
        q_p = flat(q) if idx_q is None else flat(q).index_select(0, idx_q)
        out = _varlen(q_p, flat(k).index_select(0, idx_k), flat(v).index_select(0, idx_k), cu_q, cu_k, max_q, max_k,
                      s_aux, kw)
        if idx_q is not None:
            out = out.new_zeros(batch * seqlen_q, *out.shape[1:]).index_copy(0, idx_q, out)
        return out.view(batch, seqlen_q, *out.shape[1:]), None

    packed = None
    given = [n for n in PACKED_KWARGS if kwargs.get(n) is not None]
    if given and len(given) < len(PACKED_KWARGS):  # one without the others would run dense, each row seeing all
        raise ValueError(f"{', '.join(n for n in PACKED_KWARGS if n not in given)}: expected with "
                         f"{', '.join(given)} (padding-free calls pass all four)")
    if given:
        packed = (_offsets("cu_seq_lens_q", kwargs["cu_seq_lens_q"]), _offsets("cu_seq_lens_k", kwargs["cu_seq_lens_k"]),
                  _number("max_length_q", kwargs["max_length_q"], int), _number("max_length_k", kwargs["max_length_k"], int))
    elif seqlen_q == seqlen_k and not torch.compiler.is_compiling():  # (traced: _traced_masks' document ids)
        packed = _packed_positions(kwargs.get("position_ids"), batch, seqlen_q)
    if packed is not None:  # padding-free: sequences concatenated along the token axis
        flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
        out = _varlen(flat(q), flat(k), flat(v), *packed, s_aux, kw)
        return out.view(batch, seqlen_q, *out.shape[1:]), None

    if s_aux is not None:
        k, v, _ = _with_sink_rows(k, v)
    return attention(q, k, v, layout="bshd", **kw), None


DECODE_MAX_QUERIES = 16  # the decode kernel packs a KV group's query rows into one tile; longer: prefill
# Route decode-shaped calls to flashgen's split-KV decode kernel (True, the default) or to
# flashgen.attention (False: the prefill kernel's length-free plan up to 512 keys, then the same decode
# kernel through more host layers). A generation step is host time (its kernels take microseconds), and
# this route's is the least: DecodeLauncher.read() finds the step's plan by a short key without the
# cache's length and launches it (launch_read) on the tensors as given. Host us per call: benchmarks/NOTES.md
# (sessions 16 and 30).
decode_calls = True


def _decode_shaped(query, key, value, is_causal, dropout):
    """A generation step (with decode_calls on): a few causal queries (the newest tokens) against more
    cached keys, nothing padded, no dropout, no gradient, not traced (the decode kernels are forward-only;
    traced, the length tests below would guard the graph: a compiled model's steps take flashgen.attention)."""
    if torch.compiler.is_compiling():  # first: the length comparisons below would guard a compiled graph on them
        return False
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    return (decode_calls and is_causal and not dropout and seqlen_q <= DECODE_MAX_QUERIES and seqlen_k > seqlen_q
            and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)))


def _decode(query, key, value, window, softcap, scaling):
    """(B, L, H, D) attention of the L newest queries (query (B, H, L, D)) over the whole cache (key,
    value (B, H_kv, S, D), transformers' cache), by flashgen's split-KV decode kernel: causal
    bottom-right, window (_window's keys before the query, or None) as flash-attn's (window, 0). The
    tensors are read in their own order (no transposed views: ~7 us of an H200 host per call)."""
    window_size = None if window is None else (window, 0)
    launcher = compat_launcher(query, key, value, True, window_size, softcap, None, scaling, layout="bhsd")
    return launcher.read(query, key, value, scaling, layout="bhsd")[0]


def _check_padding_mask(attention_mask, batch, seqlen_k):
    if attention_mask.shape != (batch, seqlen_k):
        raise ValueError(f"attention_mask: expected a (batch, keys) = {(batch, seqlen_k)} padding mask, "
                         f"got {tuple(attention_mask.shape)}")


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, s_aux, kw):
    if s_aux is not None:
        k, v, cu_k = _with_sink_rows(k, v, cu_k)
        max_k += 1
    return attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
