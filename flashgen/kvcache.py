"""Decode over a KV cache with any spec: ``flashgen.decode(spec_or_kernel, q, k_cache, v_cache, ...)``.

(Named kvcache, not decode, so that the function ``flashgen.decode`` does not shadow its module.)

The spec's mask and score modifier apply as in prefill, with the query rows aligned to the end
of each batch element's keys (causal: query i of Sq sees key j <= seqlen_k - Sq + i, where
seqlen_k = cache_seqlens[b] + the keys appended this call). The kernels: templates/decode/
(split-KV with the query heads of a KV group packed into one tile); the host side:
flashgen/runtime/decode.py, which also states when an index outside the cache raises.

Tuned decode knobs (``flashgen tune`` of a spec with a ``tune.decode`` section, see
flashgen/decode_space.py) are read once per spec from the results database, then from the
shipped tuning_db/, and used by every call that overrides no knob; without them the call
runs the heuristic defaults.

FP8 KV cache: k_cache and v_cache in float8_e4m3fn or float8_e5m2 with float32 k_descale /
v_descale (batch, kv_heads) (flash-attn 3's names and shapes; a missing one is 1.0); q stays in
the spec's dtype (or is FP8 too, with q_descale). The kernels read half the bytes of a bf16
cache and compute attention over the dequantized cache (x_fp8 * descale). New keys and values
k, v come in the spec's dtype and are quantized on write (x / descale, saturated, rounded to
nearest even), as serving frameworks (vLLM's reshape_and_cache) do.
"""

from __future__ import annotations

import torch

from . import ops
from .api import (AttentionKernel, _call_key, _check_config, _check_dtype_heads_dims, _check_traced_call,
                  _config_values, _constant_result, _raise_refused, _refused, _spec, _thaw, _traced_config_id,
                  compile_spec)
from .config import KernelConfig
from .errors import check_flag
from .runtime import host
from .runtime.decode import CHECKS, check_knob_values
from .runtime.host import check_bounds
from .spec import DTYPES, FP8_DTYPES, AttentionSpec

__all__ = ["decode", "check_bounds", "decode_launcher", "tuned_decode", "compat_launcher", "reload_tuned"]

_LAUNCHERS: dict = {}  # kernel id -> the module's DecodeLauncher, its tuned knobs attached
_COMPAT: dict = {}  # flash_attn_with_kvcache's plain key -> its DecodeLauncher


def tuned_decode(spec: AttentionSpec, db: str | None = None):
    """(lookup, source): lookup(batch, capacity) gives the tuned decode knobs stored for the
    call's own (KV length, batch) bucket for this spec on this GPU, or None (the heuristic serves
    untuned buckets: decode_space.tuned_lookup); source says where they
    came from ('database', 'tuning_db', or 'default' with lookup None). Decode's kernels do not
    depend on whether the spec trains, so a spec tuned with either `backward` serves. Never
    raises for a database problem (the prefill loader's rule, flashgen.loader): the heuristic
    serves, with the loader's one warning where the database cannot be read (not where it does not exist)."""
    from .db import EnvInfo, MissingDatabaseError, ResultStore, default_url
    from .db.layer import shipped_best
    from .decode_space import tuned_lookup
    from .loader import unreadable

    env = EnvInfo.current()
    url = db or default_url()
    store = None
    try:  # opened once for both candidates (a locked database waited its 5 s per candidate)
        store = ResultStore(url, create=False)
    except MissingDatabaseError:
        pass  # nothing tuned here yet
    except Exception as err:  # noqa: BLE001 (locked, corrupt, another schema version...)
        unreadable(spec, url, err)
    sources = [("database", lambda s: store.matching_best(env, s))] if store is not None else []
    sources.append(("tuning_db", lambda s: shipped_best(s.key, env)))
    try:
        for where, read in sources:
            for candidate in (spec, spec.replace(backward=not spec.backward)):
                try:
                    lookup = tuned_lookup(read(candidate))
                except Exception as err:  # noqa: BLE001 (malformed or unreadable rows)
                    if where == "database":
                        unreadable(spec, url, err)
                    continue
                if lookup is not None:
                    return lookup, where
    finally:
        if store is not None:
            store.close()
    return None, "default"


def reload_tuned() -> None:
    """Forget the tuned decode knobs looked up so far: the next call of each spec reads the
    results again (a tune that stored results after a spec was first used is seen)."""
    _LAUNCHERS.clear()
    _COMPAT.clear()


def decode_launcher(kernel: AttentionKernel, config: KernelConfig | None = None):
    """The DecodeLauncher of a kernel's module, with the spec's tuned decode knobs attached (looked up once)."""
    return _launcher(kernel.kernel_id(config))


def _launcher(kernel_id: str):
    """The DecodeLauncher of a kernel id (ops.kernel_id): its module built on first use, as the custom ops build
    theirs, so that an id works in any process."""
    launcher = _LAUNCHERS.get(kernel_id)
    if launcher is None:
        launcher = ops.kernel_module(kernel_id)._DECODE
        launcher.tuned, launcher.tuned_source = tuned_decode(ops.kernel_spec(kernel_id)[0])
        _LAUNCHERS[kernel_id] = launcher
    return launcher


# ----------------------------------------------------------------------------- under torch.compile
# A decode call traced by torch.compile is one custom op, opaque to dynamo: its eager body (the launcher's checks,
# plans and bound launches) runs as it does outside a compiled function, on the real tensors. A call that writes
# new keys and values into the cache is `flashgen::decode_append`, which declares k_cache and v_cache mutated; a
# call that only reads the cache is `flashgen::decode`, which mutates nothing (declared mutated, the cache would be
# copied per call where the compiler cannot write it in place: aot_eager always). The kernel is named by its id
# (ops.kernel_id), resolved at trace time: a flashgen.decode kernel object's, or for flash_attn_with_kvcache the id
# of the spec its eager call builds (compat_launcher), by a function dynamo runs once and treats as a constant.
def _decode_body(q, k_cache, v_cache, k, v, cache_seqlens, seqlen, block_table, cache_batch_idx, tensors, kernel_id,
                 softmax_scale, return_lse, num_splits, BLOCK_N, num_warps, num_stages, page_prefetch, fused_combine,
                 check, q_descale, k_descale, v_descale):
    launcher = _launcher(kernel_id)
    out, lse = launcher.decode(
        q, k_cache, v_cache, cache_seqlens if cache_seqlens is not None else seqlen, k=k, v=v, block_table=block_table,
        cache_batch_idx=cache_batch_idx, softmax_scale=softmax_scale,
        tensors=dict(zip(launcher.attention.tensor_names, tensors)), return_lse=return_lse, BLOCK_N=BLOCK_N,
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages, page_prefetch=page_prefetch, check=check,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, fused_combine=fused_combine)
    return out, (lse if lse is not None else out.new_empty(0, dtype=torch.float32))


def _decode_fake(q, k_cache, v_cache, k, v, cache_seqlens, seqlen, block_table, cache_batch_idx, tensors, kernel_id,
                 softmax_scale, return_lse, num_splits, BLOCK_N, num_warps, num_stages, page_prefetch, fused_combine,
                 check, q_descale, k_descale, v_descale):
    # out (batch, seqlen_q, heads, head_dim_v) in the spec's dtype, lse (batch, heads, seqlen_q) float32 where asked
    # for (else empty), both contiguous, as the launcher allocates them
    ops._check_fake_devices(q, k, v, tensors, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                            block_table=block_table, cache_batch_idx=cache_batch_idx, q_descale=q_descale,
                            k_descale=k_descale, v_descale=v_descale)
    batch, seqlen_q, heads = q.shape[:3]
    dtype = getattr(torch, DTYPES[ops.kernel_spec(kernel_id)[0].dtype])
    out = q.new_empty((batch, seqlen_q, heads, v_cache.shape[-1]), dtype=dtype)
    return out, q.new_empty((batch, heads, seqlen_q) if return_lse else (0,), dtype=torch.float32)


# (torch.library.Library, not torch.library.custom_op: on CI's CPU host a custom_op's dispatch cost about 40 us a
# call, a Library op's about 9; these ops need none of custom_op's autograd wrapper, recording no gradient)
_LIBRARY = torch.library.Library("flashgen", "FRAGMENT")
_SCHEMA = ("(Tensor q, Tensor{k} k_cache, Tensor{v} v_cache, Tensor? k, Tensor? v, Tensor? cache_seqlens, "
           "SymInt? seqlen, Tensor? block_table, Tensor? cache_batch_idx, Tensor[] tensors, str kernel_id, "
           "float? softmax_scale, bool return_lse, int num_splits, int? BLOCK_N, int? num_warps, int? num_stages, "
           "bool? page_prefetch, bool? fused_combine, str check, Tensor? q_descale, Tensor? k_descale, "
           "Tensor? v_descale) -> (Tensor, Tensor)")


def _decode_op(name, mutable):
    _LIBRARY.define(name + _SCHEMA.format(k="(a!)" if mutable else "", v="(b!)" if mutable else ""))
    for key in ("CPU", "CUDA"):
        _LIBRARY.impl(name, _decode_body, key)
    torch.library.register_fake(f"flashgen::{name}", _decode_fake, lib=_LIBRARY)
    return getattr(torch.ops.flashgen, name).default


decode_read_op = _decode_op("decode", False)
decode_append_op = _decode_op("decode_append", True)


@_constant_result
def _traced_compat_id(dtype, head_dim, head_dim_v, num_heads, num_kv_heads, layout, causal, softmax_scale, dropout_p,
                      mask, score_mod, config) -> str:
    """Under torch.compile: the kernel id of flash_attn_with_kvcache's call key (api._call_key's), the one its eager
    call builds (compat_launcher: the spec of its arguments with the default config). Run once by dynamo at trace
    time; a call the spec refuses gets api._refused's answer, raised in the traced code."""
    try:
        return compile_spec(_spec(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, num_heads=num_heads,
                                  num_kv_heads=num_kv_heads, causal=causal, softmax_scale=softmax_scale,
                                  dropout_p=dropout_p, mask=_thaw(mask), score_mod=_thaw(score_mod))).kernel_id()
    except (TypeError, ValueError) as err:
        return _refused(err)


def traced_compat_id(q, k_cache, v_cache, causal, softmax_scale, mask, score_mod) -> str:
    """The kernel id of a flash_attn_with_kvcache call being traced (its arguments checked as compat_launcher's
    are; an FP8 q's spec computes in bf16)."""
    if isinstance(q, torch.Tensor) and q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q = q.new_empty(q.shape, dtype=torch.bfloat16)  # (as compat_launcher's)
    key = _call_key(q, k_cache, v_cache, "bshd", causal, softmax_scale, 0.0, mask, score_mod, None)
    try:
        if key is None:
            _check_traced_call(q, k_cache, v_cache, "bshd", causal, softmax_scale, 0.0, None)
            # (what _call_key refuses beyond that check's: a scale that is not a plain number, numpy's)
            raise TypeError(f"softmax_scale: under torch.compile, expected a Python float or None, got "
                            f"{type(softmax_scale).__name__}")
        _check_dtype_heads_dims(q.dtype, *key[3:5], *key[1:3])
    except (TypeError, ValueError) as err:
        _raise_for_caches(err)
    return _raise_refused(_traced_compat_id(*key))


def _raise_for_caches(err: Exception):
    """Raise err, an error about a call's k or v named as flash_attn_with_kvcache names them: k_cache, v_cache."""
    message = str(err)
    for given, name in (("k: ", "k_cache: "), ("v: ", "v_cache: ")):
        if message.startswith(given):
            raise type(err)(name + message[len(given):]) from None
    raise err


def traced_decode(kernel_id, q, k_cache, v_cache, cache_seqlens, *, k, v, block_table, cache_batch_idx, names,
                  tensors, softmax_scale, return_lse, out=None, lse=None, num_splits=0, BLOCK_N=None, num_warps=None,
                  num_stages=None, page_prefetch=None, fused_combine=None, check="async", q_descale=None,
                  k_descale=None, v_descale=None):
    """A decode call being traced: its arguments checked as far as a trace can (each error naming its argument; the
    op's body checks the rest when it runs), then the custom op, without autograd (decode is forward-only: eager's
    output requires no grad either). Returns (out, lse) (lse empty unless asked for)."""
    check_flag("return_lse", return_lse)
    for name, buffer in (("out", out), ("lse", lse)):
        if buffer is not None:  # (the op returns its own: a buffer's checks and writes would be the trace's)
            raise ValueError(f"{name}: buffers to write into are not supported under torch.compile; the call "
                             f"returns a fresh {name}")
    if check not in CHECKS:
        raise ValueError(f"check: expected one of {CHECKS}, got {check!r}")
    if softmax_scale is not None and not isinstance(softmax_scale, torch.SymFloat):
        host.check_softmax_scale(softmax_scale)
    check_knob_values(BLOCK_N, num_splits, num_warps, num_stages, page_prefetch, fused_combine)
    host.check_tensor_names(tensors, names)
    given = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v), ("block_table", block_table),
             ("cache_batch_idx", cache_batch_idx), ("q_descale", q_descale), ("k_descale", k_descale),
             ("v_descale", v_descale), *((n, tensors[n]) for n in names))
    for name, t in given:
        if t is not None:
            host.check_tensor(name, t)
            host.check_data(name, t)
    for name, t in given[:5]:  # (the fake reads their shapes)
        if t is not None and t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-d tensor, got shape {tuple(t.shape)}")
    for name, t in given[1:]:
        if t is not None:
            host.check_device(name, t, q.device)
    if (k is None) != (v is None):
        raise ValueError(f"{'v' if k is not None else 'k'}: expected k and v together (new keys and values), got "
                         f"only {'k' if k is not None else 'v'}")
    seqlen = None
    if isinstance(cache_seqlens, torch.Tensor):
        host.check_tensor("cache_seqlens", cache_seqlens)
        host.check_device("cache_seqlens", cache_seqlens, q.device)
    elif cache_seqlens is not None:
        if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.SymInt)):
            raise TypeError(f"cache_seqlens: expected an int32 tensor (batch,), an int or None, got "
                            f"{type(cache_seqlens).__name__}")
        seqlen, cache_seqlens = cache_seqlens, None
    op = decode_append_op if k is not None else decode_read_op
    with torch.no_grad():
        return op(q, k_cache, v_cache, k, v, cache_seqlens, seqlen, block_table, cache_batch_idx,
                  [tensors[n] for n in names], kernel_id, softmax_scale, return_lse, num_splits, BLOCK_N, num_warps,
                  num_stages, page_prefetch, fused_combine, check, q_descale, k_descale, v_descale)


def decode(spec_or_kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens=None, *,
           k: torch.Tensor | None = None, v: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
           cache_batch_idx: torch.Tensor | None = None, softmax_scale: float | None = None,
           return_lse: bool = False, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
           num_splits: int = 0, BLOCK_N: int | None = None, num_warps: int | None = None,
           num_stages: int | None = None, page_prefetch: bool | None = None, check: str = "async",
           fused_combine: bool | None = None, config: KernelConfig | None = None, q_descale: torch.Tensor | None = None,
           k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None, **tensors):
    """Attention of q (batch, seqlen_q, heads, head_dim) over a KV cache, with a spec's mask and score_mod.

    spec_or_kernel: an AttentionKernel (flashgen.compile) or anything flashgen.compile takes (an
    AttentionSpec, a YAML path, a dict). k_cache, v_cache: (batch, S_max, kv_heads, head_dim), or
    paged (num_pages, page_size, kv_heads, head_dim) with block_table (batch, max_pages_per_seq)
    int32 (any page order, page_size 1..256). cache_seqlens: (batch,) int32 keys in the cache
    per element (an int: the same for all; None: the whole cache). k, v (batch, seqlen_new,
    kv_heads, head_dim): new keys and values written into the cache in place at cache_seqlens
    first, then attended. num_splits 0 picks the split count from the shapes (never from
    cache_seqlens: a call is CUDA-graph capturable): the tuned one where the spec was tuned for
    decode, else FA3's heuristic. fused_combine: a split call's merge in the split kernel (True) or
    a combine kernel (False); None: the default (flashgen/runtime/decode.py). The tensors the
    spec's mask or score_mod reads are passed by name. out, lse: buffers to write into. Returns out (batch, seqlen_q, heads, head_dim_v) in
    the spec's dtype, and with return_lse the log-sum-exp (batch, heads, seqlen_q) float32 (-inf where
    a row sees no key).

    Bounds: an index of cache_seqlens, block_table or cache_batch_idx outside the cache is never
    read or written; it raises ValueError naming the argument. check="async" (default): on a GPU
    without waiting, at the next decode call (or flashgen.kvcache.check_bounds()) after the
    kernels met it, the outputs of the call that met it being meaningless; check="sync": at once,
    waiting for the call's kernels (see flashgen/runtime/decode.py).

    FP8 (see the module docstring): k_cache and v_cache (one dtype) may be float8_e4m3fn or
    float8_e5m2, q too; q_descale, k_descale, v_descale: float32 (batch, kv_heads), each only for
    an FP8 tensor (else ValueError naming it); k, v stay in the spec's dtype. Needs sm89+ on a GPU.

    Under torch.compile (fullgraph too) the call is one custom op; spec_or_kernel must then be a kernel
    object built outside the compiled function.
    """
    if torch.compiler.is_compiling():
        if not isinstance(spec_or_kernel, AttentionKernel):  # (building a spec and its module is not traced)
            raise TypeError(f"spec_or_kernel: under torch.compile, expected a kernel object built outside the compiled "
                            f"function (flashgen.compile(spec) or flashgen.load(spec)), got "
                            f"{type(spec_or_kernel).__name__}")
        if spec_or_kernel.spec.dtype in FP8_DTYPES:
            raise ValueError(f"spec_or_kernel: decode computes in the spec's dtype, bf16, fp16 or fp32, got "
                             f"{spec_or_kernel.spec.dtype!r}; pass the FP8 cache (and q) with descales to a bf16 spec")
        kernel_id = spec_or_kernel._id if config is None else _raise_refused(
            _traced_config_id(spec_or_kernel._id, _config_values(_check_config(config))))
        out, lse = traced_decode(kernel_id, q, k_cache, v_cache, cache_seqlens, k=k, v=v, block_table=block_table,
                                 cache_batch_idx=cache_batch_idx, names=spec_or_kernel._names, tensors=tensors,
                                 softmax_scale=softmax_scale, return_lse=return_lse, out=out, lse=lse,
                                 num_splits=num_splits, BLOCK_N=BLOCK_N, num_warps=num_warps, num_stages=num_stages,
                                 page_prefetch=page_prefetch, fused_combine=fused_combine, check=check,
                                 q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        return (out, lse) if return_lse else out
    check_flag("return_lse", return_lse)
    kernel = spec_or_kernel if isinstance(spec_or_kernel, AttentionKernel) else compile_spec(
        AttentionSpec.coerce(spec_or_kernel))
    if kernel.spec.dtype in FP8_DTYPES:
        raise ValueError(f"spec_or_kernel: decode computes in the spec's dtype, bf16, fp16 or fp32, got "
                         f"{kernel.spec.dtype!r}; pass the FP8 cache (and q) with descales to a bf16 spec")
    out, lse = decode_launcher(kernel, config).decode(
        q, k_cache, v_cache, cache_seqlens, k=k, v=v, block_table=block_table, cache_batch_idx=cache_batch_idx,
        softmax_scale=softmax_scale, tensors=tensors, out=out, lse=lse, return_lse=return_lse, BLOCK_N=BLOCK_N,
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages, page_prefetch=page_prefetch, check=check,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, fused_combine=fused_combine)
    return (out, lse) if return_lse else out


def compat_launcher(q, k_cache, v_cache, causal, window_size, softcap, alibi_slopes, softmax_scale,
                    layout="bshd"):
    """The DecodeLauncher of a flash_attn_with_kvcache call: the spec its arguments describe is
    built, checked and compiled once per plain key (dtypes, heads, head dims, causal, window,
    softcap, ALiBi's rank, scale), then found with one dict lookup. An FP8 q (flash-attn 3's
    all-FP8 call) computes and outputs in bf16, as flash-attn 3 does; an FP8 cache does not
    change the spec (its kernels read any cache dtype). layout "bhsd": q and the caches with their
    heads in dim 1 (the launcher is the same: a spec has no layout)."""
    heads = 2 if layout == "bshd" else 1
    try:
        # (scalars with their types: True, 1 and 1.0 are one dict key, and the spec refuses what its twin passed)
        key = (q.dtype, q.shape[heads], q.shape[3], k_cache.shape[heads], k_cache.shape[3], v_cache.shape[3],
               (type(causal), causal), None if window_size is None else tuple((type(w), w) for w in window_size),
               (type(softcap), softcap), None if alibi_slopes is None else (alibi_slopes.dtype, alibi_slopes.dim()),
               (type(softmax_scale), softmax_scale))
        launcher = _COMPAT.get(key)
    except (AttributeError, IndexError, TypeError, ValueError):  # the slow path names the argument
        key = launcher = None
    if launcher is None:
        from .api import spec_for
        from .compat import _variant

        causal, mask, mods, _ = _variant(causal, window_size, softcap, alibi_slopes)
        if isinstance(q, torch.Tensor) and q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            q = q.new_empty(q.shape, dtype=torch.bfloat16)  # the spec's dtype: bf16, flash-attn 3's output
        try:
            spec = spec_for(q, k_cache, v_cache, causal=causal, softmax_scale=softmax_scale, layout=layout, mask=mask,
                            score_mod=mods)
        except (TypeError, ValueError) as err:  # spec_for names its k and v: here they are the caches
            _raise_for_caches(err)
        launcher = decode_launcher(compile_spec(spec))
        if key is not None:
            if len(_COMPAT) >= 256:
                _COMPAT.clear()
            _COMPAT[key] = launcher
    return launcher
