"""flash-attn's functions on flashgen kernels: change one import.

    from flashgen.compat import flash_attn_func, flash_attn_varlen_func

(also flash_attn_qkvpacked_func, flash_attn_kvpacked_func, their varlen forms, and flash_attn_with_kvcache.)
Same arguments, (batch, seqlen, heads, head_dim) layout and semantics as flash-attn 2:
causal masks are aligned bottom-right; ``window_size=(left, right)`` lets query i see keys
in [i + Sk - Sq - left, i + Sk - Sq + right] (-1 = unbounded; causal sets right = 0);
``softcap`` caps scores with softcap * tanh(score / softcap); ``alibi_slopes`` (heads,) or
(batch, heads) float32 add -slope * |i + Sk - Sq - j| after the softcap; a query row that
sees no key outputs 0 and its LSE is +inf, as flash-attn reports it. Each distinct
combination of these arguments compiles one flashgen spec (cached).
"""

from __future__ import annotations

import operator

import torch

from .api import _static_float, attention, attention_varlen, spec_for
from .errors import check_flag
from .masks.pattern import MAX_EXTENT


def _window(window_size):
    """(left, right) of flash-attn's window_size: two ints, a negative one unbounded (-1)."""
    if window_size is None:
        return -1, -1
    try:
        if isinstance(window_size, (str, bytes)) or len(window_size) != 2 or any(isinstance(w, bool) for w in window_size):
            raise TypeError
        left, right = (operator.index(w) for w in window_size)
    except TypeError:
        raise ValueError(f"window_size: expected (left, right), two ints (negative: unbounded), got {window_size!r}") \
            from None
    # a side past MAX_EXTENT reaches past every sequence a kernel runs: unbounded (-1), as the same side at any
    # length past seqlen_q + seqlen_k is (flash-attn takes any int32)
    return tuple(-1 if w < 0 or w > MAX_EXTENT else w for w in (left, right))


def _num_splits(num_splits):
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0: chosen per call), got {num_splits!r}")
    return num_splits


def _check_flags(causal, softcap):
    check_flag("causal", causal)
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not 0 <= softcap < float("inf")):
        raise ValueError(f"softcap: expected a number >= 0 (0 or None: none), got {softcap!r}")


def _variant(causal, window_size, softcap, alibi_slopes):
    _check_flags(causal, softcap)
    left, right = _window(window_size)
    if causal:
        right = 0
    mask = None
    if (left, right) == (-1, 0):  # causal (bottom-right, as the window's bound): the plain causal spec, whose
        causal = True  # kernel, tuned configs and no-grad fast path flashgen.attention(causal=True) shares
    elif (left, right) != (-1, -1):
        mask = {"sliding_window": {"left": left, "right": right}}
        causal = False  # right = 0 is the causal bound
    mods = []
    if softcap:  # (a constant of the spec: under torch.compile a symbolic one is specialized)
        mods.append({"softcap": {"cap": float(_static_float(softcap))}})
    tensors = {}
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes: expected a float32 tensor (heads,) or (batch, heads), got "
                            f"{type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32 or alibi_slopes.dim() not in (1, 2):
            raise ValueError(f"alibi_slopes: expected a float32 tensor (heads,) or (batch, heads), got "
                             f"{tuple(alibi_slopes.shape)} {alibi_slopes.dtype}")
        mods.append({"alibi": {"slopes": "alibi_slopes"}})
        tensors["alibi_slopes"] = alibi_slopes
    return causal, mask, (mods or None), tensors


def _outputs(out, lse, probs, return_attn_probs):
    if not check_flag("return_attn_probs", return_attn_probs):
        return out
    lse = torch.where(lse == float("-inf"), float("inf"), lse)  # flash-attn's empty-row LSE
    return out, lse, probs


def _probs(q, k, v, causal, softmax_scale, dropout_p, mask, mods, tensors, layout):
    from .verify import reference_attention

    spec = spec_for(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout, dropout_p=dropout_p,
                    mask=mask, score_mod=mods)
    with torch.no_grad():
        return reference_attention(q, k, k.new_zeros(k.shape[:-1] + (1,)), causal=spec.causal,
                                   softmax_scale=spec.softmax_scale, layout=layout, mask=spec.mask,
                                   score_mod=spec.score_mod, tensors=tensors, return_probs=True)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, q_descale=None, k_descale=None,
                    v_descale=None):
    """flash_attn_func: q (batch, seqlen_q, heads, head_dim), k and v (batch, seqlen_k, kv_heads, head_dim).
    FP8 q, k, v take FlashAttention-3's q/k/v_descale (float32, (batch, kv_heads)); out is bf16.

    With return_attn_probs, returns (out, softmax_lse (batch, heads, seqlen_q), probabilities);
    the probabilities (batch, heads, seqlen_q, seqlen_k) are computed densely, for testing, and
    exclude dropout (None under torch.compile)."""
    causal, mask, mods, tensors = _variant(causal, window_size, softcap, alibi_slopes)
    descales = {name: d for name, d in (("q_descale", q_descale), ("k_descale", k_descale),
                                        ("v_descale", v_descale)) if d is not None}
    out, lse = attention(q, k, v, causal=causal, softmax_scale=softmax_scale, layout="bshd", return_lse=True,
                         dropout_p=dropout_p, deterministic=deterministic, mask=mask, score_mod=mods, **descales,
                         **tensors)
    probs = None
    if check_flag("return_attn_probs", return_attn_probs) and not torch.compiler.is_compiling():
        # (a test aid built from a spec on the host, which a traced call cannot build: None there, as varlen's is;
        # the call's LSE, what return_attn_probs is asked for in models, is the kernel's either way)
        probs = _probs(q, k, v, causal, softmax_scale, dropout_p, mask, mods, tensors, "bshd")
    return _outputs(out, lse, probs, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash_attn_varlen_func: q (total_q, heads, head_dim), k and v (total_k, kv_heads, head_dim),
    cu_seqlens_q/k int32 (batch + 1). With return_attn_probs, returns (out, softmax_lse
    (heads, total_q), None): packed sequences have no dense probability tensor."""
    if block_table is not None:
        raise ValueError("block_table: paged KV caches are not supported by flashgen.compat")
    causal, mask, mods, tensors = _variant(causal, window_size, softcap, alibi_slopes)
    out, lse = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                softmax_scale=softmax_scale, dropout_p=dropout_p, return_lse=True,
                                deterministic=deterministic, mask=mask, score_mod=mods, **tensors)
    return _outputs(out, lse, None, return_attn_probs)


def _unpacked(name, packed, dim, count):
    """packed's `count` tensors along `dim` (views: flash-attn's packed layouts, its gradient the stacked one's)."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(packed).__name__}")
    if packed.dim() <= dim or packed.shape[dim] != count:
        raise ValueError(f"{name}: expected {count} tensors stacked along dim {dim}, got shape {tuple(packed.shape)}")
    return packed.unbind(dim)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_qkvpacked_func: qkv (batch, seqlen, 3, heads, head_dim); flash_attn_func of its three."""
    return flash_attn_func(*_unpacked("qkv", qkv, 2, 3), dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_kvpacked_func: q (batch, seqlen_q, heads, head_dim), kv (batch, seqlen_k, 2, kv_heads, head_dim)."""
    return flash_attn_func(q, *_unpacked("kv", kv, 2, 2), dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn_varlen_qkvpacked_func: qkv (total, 3, heads, head_dim), one cu_seqlens and max_seqlen for both."""
    return flash_attn_varlen_func(*_unpacked("qkv", qkv, 1, 3), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_varlen_kvpacked_func: q (total_q, heads, head_dim), kv (total_k, 2, kv_heads, head_dim)."""
    return flash_attn_varlen_func(q, *_unpacked("kv", kv, 1, 2), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *, q_descale=None,
                            k_descale=None, v_descale=None, check="async"):
    """flash_attn_with_kvcache: q (batch, seqlen_q, heads, head_dim) over a KV cache.

    k_cache, v_cache: (batch_cache, seqlen_cache, kv_heads, head_dim), or paged (num_blocks,
    page_block_size, kv_heads, head_dim) with block_table (batch, max_num_blocks_per_seq) int32.
    cache_seqlens: int or (batch,) int32, the keys already in the cache. k, v (batch, seqlen_new,
    kv_heads, head_dim): written into the cache in place at cache_seqlens, then attended (each
    element attends to cache_seqlens + seqlen_new keys). cache_batch_idx (batch,) int32: the cache
    rows of a contiguous cache. num_splits: 0 the tuned count or a heuristic, 1 no split, n that
    many. Returns out, and (out, softmax_lse (batch, heads, seqlen_q)) with return_softmax_lse.
    Rotary embedding and cache_leftpad are not supported (apply rotary to q and k before the call).

    FP8 cache (flash-attn 3's names and shapes): k_cache and v_cache in float8_e4m3fn or
    float8_e5m2 with k_descale, v_descale float32 (batch, kv_heads) (1.0 where not given), q in
    bf16 or fp16 (the output's dtype), or q in FP8 too with q_descale (the output then bf16). The
    cache holds x / descale; attention runs over x_fp8 * descale. New k, v come in q's dtype (bf16
    or fp16) and are quantized into the cache on write with k_descale / v_descale, as vLLM writes
    its FP8 cache; FP8 k, v are refused. Needs sm89+ (Ada, Hopper).

    An index of cache_seqlens, block_table or cache_batch_idx outside the cache is never read or
    written and raises ValueError naming the argument: without waiting for the GPU, at the next
    call after the kernels met it (the outputs of that call are meaningless), or at once with
    check="sync" (flashgen's addition, for debugging; see flashgen.kvcache.decode). The first call
    with a new combination of dtypes, head counts, head dims and causal/window/softcap/ALiBi
    builds and compiles its spec; later ones find it with one dict lookup. Under torch.compile the
    call is one custom op (fullgraph, any batch size and cache length; the cache written in place)."""
    from .kvcache import compat_launcher, traced_compat_id, traced_decode

    if rotary_cos is not None or rotary_sin is not None:
        raise ValueError("rotary_cos: in-kernel rotary embedding is not supported by flashgen.compat; apply it to "
                         "q and k before the call")
    if cache_leftpad is not None:
        raise ValueError("cache_leftpad: left-padded caches are not supported by flashgen.compat")
    _check_flags(causal, softcap)  # (before the launcher's key, which reads them as bool and float)
    check_flag("return_softmax_lse", return_softmax_lse)
    if torch.compiler.is_compiling():  # one custom op (flashgen/kvcache.py)
        causal, mask, mods, tensors = _variant(causal, window_size, softcap, alibi_slopes)
        kernel_id = traced_compat_id(q, k_cache, v_cache, causal, softmax_scale, mask, mods)
        out, lse = traced_decode(kernel_id, q, k_cache, v_cache, cache_seqlens, k=k, v=v, block_table=block_table,
                                 cache_batch_idx=cache_batch_idx, names=tuple(tensors), tensors=tensors,
                                 softmax_scale=softmax_scale, return_lse=return_softmax_lse,
                                 num_splits=_num_splits(num_splits), check=check, q_descale=q_descale,
                                 k_descale=k_descale, v_descale=v_descale)
    else:
        launcher = compat_launcher(q, k_cache, v_cache, causal, window_size, softcap, alibi_slopes, softmax_scale)
        tensors = {"alibi_slopes": alibi_slopes} if alibi_slopes is not None else None
        out, lse = launcher.decode(q, k_cache, v_cache, cache_seqlens, k=k, v=v, block_table=block_table,
                                   cache_batch_idx=cache_batch_idx, tensors=tensors, return_lse=return_softmax_lse,
                                   num_splits=_num_splits(num_splits), check=check, q_descale=q_descale,
                                   k_descale=k_descale, v_descale=v_descale)
    if not return_softmax_lse:
        return out
    return out, torch.where(lse == float("-inf"), float("inf"), lse)  # flash-attn's empty-row LSE
