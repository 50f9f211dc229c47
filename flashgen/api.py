"""The user-facing API: ``flashgen.compile(spec)`` (``compile_spec`` here, so the builtin is not
shadowed) and ``flashgen.attention(q, k, v)``."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import sys
from functools import lru_cache

import torch

from . import ops
from .codegen import render
from .config import ConfigError, KernelConfig, default_config, default_configs
from .errors import SpecError, TracedSpecError, check_flag, short_repr
from .masks import Mask, ScoreMod
from .runtime import host
from .runtime.host import nearest_bucket
from .spec import DTYPES, FP8_DTYPES, MAX_HEAD_DIM, AttentionSpec

_TORCH_DTYPES = {getattr(torch, name): dtype for dtype, name in DTYPES.items()}  # torch dtype -> spec dtype


def _constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo`` at ``import
    flashgen`` (1.4 s of its 4.4 s on a CPU host; every ``--gpus`` worker and every user program
    paid it, and eager calls never need dynamo). The decorator only marks the function, and
    dynamo reads the mark when it traces a call (tests/test_torch_compile.py checks that the
    mark is the decorator's, and that compiled calls treat these functions as constants)."""
    fn._dynamo_marked_constant = True
    return fn


_UNUSED_SEEDS: dict[torch.device, torch.Tensor] = {}  # device -> the seed tensor passed when dropout is off


def _unused_seed(device: torch.device) -> torch.Tensor:
    """The seed argument of a call without dropout: never read, so one tensor per device serves
    every call (under torch.compile a fresh one is traced into the graph instead)."""
    if torch.compiler.is_compiling():
        return torch.empty(1, device=device, dtype=torch.int64)
    seed = _UNUSED_SEEDS.get(device)
    if seed is None:
        seed = _UNUSED_SEEDS[device] = torch.empty(1, device=device, dtype=torch.int64)
    return seed


class AttentionKernel:
    """A compiled attention spec. Call it as ``kernel(q, k, v)``; it is differentiable.

    q is (batch, heads, seqlen_q, head_dim) in layout ``bhsd`` or (batch, seqlen_q,
    heads, head_dim) in layout ``bshd``; k and v likewise with the KV heads. The output
    has q's layout and head dim ``head_dim_v``, contiguous in it, but for a ``bhsd`` q that views
    (batch, seqlen_q, heads, head_dim) memory (``x.view(B, S, H, D).transpose(1, 2)``, as model code
    makes it): out and the gradient of q keep that memory's order, as SDPA's do. With
    ``return_lse=True`` the call also returns the log-sum-exp, (batch, heads, seqlen_q) float32 (not
    differentiable).
    """

    def __init__(self, spec: AttentionSpec, config: KernelConfig | None = None, *,
                 bucket_configs: dict[int, KernelConfig] | None = None):
        self.spec = spec
        self.config = config if config is not None else default_config(spec)
        # Configs per power-of-two sequence-length bucket: the tuned ones (flashgen.load), else,
        # without a given config, the defaults per bucket; a call uses the nearest bucket's.
        self.bucket_configs = dict(bucket_configs or ({} if config is not None else default_configs(spec)))
        self.config_source = "given" if config is not None else "default"
        self._ids: dict[KernelConfig, str] = {}
        self._id = self.kernel_id(self.config)
        self._bucket_ids = {b: self.kernel_id(c) for b, c in self.bucket_configs.items()}
        # under torch.compile: every bucket's config in one id, the ops picking per call (a constant to dynamo)
        self._traced_id = ops.bucketed_id(spec, self.bucket_configs) if self.bucket_configs else None
        self._length_ids: dict[int, str] = {}  # sequence length -> its nearest bucket's kernel id (a call's lookup)
        self._names = tuple(spec.tensor_names)  # the named tensors a call passes, in kernel order
        self._fp8, self._dropout_p = spec.fp8, spec.dropout_p  # read on every call
        # dense calls without options (the fast path): _fast_key(q, k, v, layout, tensors) -> _fast_entry's result
        self._fast: dict[tuple, tuple | bool] = {}
        self._plain = not self._fp8 and not self._dropout_p  # such calls can take _fast

    def config_for(self, seqlen: int) -> KernelConfig:
        """The config a call at this sequence length uses."""
        if not self.bucket_configs:
            return self.config
        return self.bucket_configs[nearest_bucket(seqlen, self.bucket_configs)]

    def module(self, config: KernelConfig | None = None):
        """The imported Triton module for a config (rendered and cached on first use)."""
        return ops.kernel_module(self.kernel_id(config))

    def kernel_id(self, config: KernelConfig | None = None) -> str:
        """The id the custom ops take for this spec with this config (self-describing: see ops.kernel_id)."""
        config = config if config is not None else self.config
        kid = self._ids.get(_check_config(config))
        if kid is None:
            kid = self._ids[config] = ops.kernel_id(self.spec, config)
        return kid

    def source(self, config: KernelConfig | None = None) -> str:
        """The generated module's source for a config, by default the kernel's own (``self.config``; a loaded
        kernel's calls take their length's bucket's: ``config_for(seqlen)``)."""
        return render.render(self.spec, _check_config(config) if config is not None else self.config)

    def forward(self, q, k, v, *, layout: str = "bhsd", config: KernelConfig | None = None,
                out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                dropout_p: float = 0.0, seed: torch.Tensor | None = None, **tensors):
        """Run the forward kernel directly (no autograd); returns (out, lse). Runs ``config``, by default the
        kernel's own (``self.config``, as module() and source() do): a loaded kernel's calls take their length's
        bucket's tuned config instead, ``config_for(seqlen)``, which this takes when passed."""
        return self.module(config).forward(q, k, v, layout=layout, out=out, lse=lse, dropout_p=dropout_p, seed=seed,
                                           tensors=tensors)

    def backward(self, do, q, k, v, out, lse, *, layout: str = "bhsd", config: KernelConfig | None = None,
                 dropout_p: float = 0.0, seed: torch.Tensor | None = None, deterministic: bool = False,
                 **tensors):
        """Run the backward kernels directly; returns (dq, dk, dv). The config as forward()'s."""
        check_flag("deterministic", deterministic)
        dq, dk, dv, _ = self.module(config).backward(do, q, k, v, out, lse, layout=layout, dropout_p=dropout_p,
                                                     seed=seed, deterministic=deterministic, tensors=tensors)
        return dq, dk, dv

    def block_map(self, batch: int, seqlen_q: int, seqlen_k: int, *, device="cuda",
                  config: KernelConfig | None = None, **tensors):
        """The block map of a custom-expression mask at the forward tiling (see the module's block_map)."""
        module = self.module(config)
        if not module.BLOCK_MAP:
            raise ValueError(f"mask: {self.spec.mask_node.to_dict() if self.spec.mask_node else None} skips blocks "
                             "inside the kernel; only custom expressions use a block map")
        for name, n in (("batch", batch), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
            if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
                raise ValueError(f"{name}: expected a non-negative int, got {n!r}")
        cfg = module.CONFIG
        device = host.concrete_device(device)  # "cuda" is the current device, where tensors say cuda:0
        named = module._tensors(tensors, device, (batch, seqlen_q, seqlen_k))  # (sizes checked as a call's are)
        return module.block_map(batch, seqlen_q, seqlen_k, cfg["BLOCK_M"], cfg["BLOCK_N"], device, named)

    def _kernel_id_for(self, config, seqlen):
        """The kernel id of a call: its config's, the nearest bucket's, or the default's."""
        if config is not None:
            if torch.compiler.is_compiling():  # (kernel_id serializes it, not traced; self._ids would be guarded)
                return _raise_refused(_traced_config_id(self._id, _config_values(_check_config(config))))
            return self.kernel_id(config)
        if self._bucket_ids:
            if torch.compiler.is_compiling():  # a symbolic length: the ops pick the bucket per call, as for
                # flashgen.attention (choosing here guarded the graph on the length: a recompile per bucket)
                return self._traced_id
            kid = self._length_ids.get(seqlen)
            if kid is None:
                if len(self._length_ids) >= 4096:  # a bound on what a long generation leaves here
                    self._length_ids.clear()
                kid = self._length_ids[seqlen] = self._bucket_ids[nearest_bucket(seqlen, self._bucket_ids)]
            return kid
        return self._id

    def _tensor_list(self, tensors):
        """The named tensors of a call in the spec's order (the names checked by the host side)."""
        if not tensors and not self._names:
            return []
        host.check_tensor_names(tensors, self._names)
        return [tensors[n] for n in self._names]

    def _seed(self, dropout_p, device):
        if dropout_p is None:
            p = self._dropout_p
        elif isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p < 1:
            raise ValueError(f"dropout_p: expected a probability in [0, 1), got {dropout_p!r}")
        else:
            p = float(dropout_p)
        if p > 0:
            return p, torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64)
        return p, _unused_seed(device)

    def __call__(self, q, k, v, *, layout: str = "bhsd", return_lse: bool = False,
                 config: KernelConfig | None = None, dropout_p: float | None = None, deterministic: bool = False,
                 q_descale=None, k_descale=None, v_descale=None, **tensors):
        """Differentiable attention. ``dropout_p`` defaults to the spec's (pass 0.0 in eval);
        ``deterministic=True`` computes dQ with the separate, bitwise-repeatable kernel.
        Tensors the spec's mask or score_mod reads are passed by name (``document_ids=ids``);
        gradients flow into float ones that require grad. FP8 specs take float32 descale factors
        per (batch, KV head) (q * q_descale is the value meant) and return bf16; no gradient."""
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
            host.check_tensors(q, k, v, layout)  # raises, naming the argument
        descales = q_descale, k_descale, v_descale
        if (self._plain and _fast_options(return_lse, deterministic, config, descales)
                and (dropout_p is None or type(dropout_p) is float and dropout_p == 0.0)):
            key = _fast_key(q, k, v, layout, tensors)
            entry = self._fast.get(key)
            if entry:
                return _fast_run(entry, q, k, v, return_lse, tensors)
            out = self._call(q, k, v, layout, return_lse, None, dropout_p, False, descales, tensors)
            if entry is None and key is not None:
                _fast_remember(self._fast, key, self, q, k, v, layout, tensors)
            return out
        return self._call(q, k, v, layout, return_lse, config, dropout_p, deterministic, descales, tensors)

    def _call_id(self, q, k, layout, config):
        """The kernel id a call runs: its config's, else its length's bucket's, else the kernel's own."""
        if config is None and not self._bucket_ids:
            return self._id
        seq = 2 if layout == "bhsd" else 1
        return self._kernel_id_for(config, max(q.shape[seq], k.shape[seq]) if q.dim() == 4 else q.shape[0])

    def _call(self, q, k, v, layout, return_lse, config, dropout_p, deterministic, descales, tensors):
        """__call__ with its arguments by position (flashgen.attention calls it so: no keyword
        arguments packed and unpacked twice per call)."""
        check_flag("return_lse", return_lse), check_flag("deterministic", deterministic)
        if isinstance(layout, str) and layout == "thd":  # (its offsets are the varlen call's arguments)
            raise ValueError("layout: 'thd' (packed sequences) needs their offsets: call flashgen.attention_varlen "
                             "(or a kernel's .varlen) with cu_seqlens_q/k and max_seqlen_q/k")
        kernel_id = self._call_id(q, k, layout, config)
        named = self._tensor_list(tensors)
        if self._fp8 or descales[0] is not None or descales[1] is not None or descales[2] is not None:
            out, lse = ops.apply_fp8_attention(q, k, v, descales, kernel_id=kernel_id, layout=layout, tensors=named,
                                               names=self._names)
            return (out, lse) if return_lse else out
        p, seed = self._seed(dropout_p, q.device)
        out, lse = ops.apply_attention(q, k, v, kernel_id=kernel_id, layout=layout, seed=seed, tensors=named,
                                       names=self._names, dropout_p=p, deterministic=deterministic)
        return (out, lse) if return_lse else out

    def varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
               return_lse: bool = False, config: KernelConfig | None = None, dropout_p: float | None = None,
               deterministic: bool = False, **tensors):
        """Differentiable attention over packed sequences: q (total_q, heads, head_dim), k and v
        (total_k, kv_heads, head_dim); sequence i is rows cu_seqlens[i]:cu_seqlens[i + 1] (int32).
        Masks apply within each sequence. LSE is (heads, total_q)."""
        check_flag("return_lse", return_lse), check_flag("deterministic", deterministic)
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
            host.check_tensors(q, k, v, "thd")  # raises, naming the argument
        max_q, max_k = _max_seqlen("max_seqlen_q", max_seqlen_q), _max_seqlen("max_seqlen_k", max_seqlen_k)
        kernel_id = self._kernel_id_for(config, max(max_q, max_k))
        named = self._tensor_list(tensors)
        p, seed = self._seed(dropout_p, q.device)
        out, lse = ops.apply_attention(q, k, v, kernel_id=kernel_id, layout="thd", seed=seed, tensors=named,
                                       names=self._names, dropout_p=p, deterministic=deterministic,
                                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                       max_seqlen_q=max_q, max_seqlen_k=max_k)
        return (out, lse) if return_lse else out

    def __repr__(self) -> str:
        return f"AttentionKernel({self.spec.uri}, {self.config})"


def _max_seqlen(name, value) -> int:
    """A packed call's max_seqlen as an int: an integer (a SymInt under torch.compile); a float, a
    bool or a string is refused by name (int() floored 15.9 to 15 and read True as 1)."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    return int(value)


def _check_config(config):
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config: expected a flashgen.KernelConfig (KernelConfig(**knobs) or KernelConfig.from_dict), "
                        f"got {type(config).__name__}")
    return config


def compile_spec(spec: AttentionSpec | str, config: KernelConfig | None = None) -> AttentionKernel:
    """Compile a spec (an AttentionSpec, a YAML path or a dict) into a callable kernel
    (``flashgen.compile``)."""
    return _compiled(AttentionSpec.coerce(spec), None if config is None else _check_config(config))


@lru_cache(maxsize=256)
def _compiled(spec: AttentionSpec, config: KernelConfig | None) -> AttentionKernel:
    return AttentionKernel(spec, config)


def spec_for(q, k, v, *, causal: bool, softmax_scale: float | None, layout: str,
             dropout_p: float = 0.0, mask=None, score_mod=None) -> AttentionSpec:
    """The spec that describes a call on these tensors; errors name the argument. The tensors and
    layout are checked by the host side (host.check_tensors, the one owner of those checks);
    here only what building the spec needs: a supported dtype, heads that divide, head dims."""
    host.check_tensors(q, k, v, layout)
    head_axis = {"bhsd": 1, "bshd": 2, "thd": 1}[layout]
    num_heads, num_kv_heads = q.shape[head_axis], k.shape[head_axis]
    _check_dtype_heads_dims(q.dtype, num_heads, num_kv_heads, q.shape[-1], v.shape[-1])
    return _spec(dtype=_TORCH_DTYPES[q.dtype], head_dim=q.shape[-1], head_dim_v=v.shape[-1], num_heads=num_heads,
                 num_kv_heads=num_kv_heads, causal=causal, softmax_scale=softmax_scale, dropout_p=dropout_p, mask=mask,
                 score_mod=score_mod)


def _check_dtype_heads_dims(dtype, num_heads, num_kv_heads, head_dim, head_dim_v):
    """What building a call's spec needs of its tensors (q's dtype, heads that divide, head dims), refused by
    argument (spec_for's, and a traced call's, whose spec is built from its key)."""
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"q: expected dtype float16, bfloat16 or float32, got {dtype}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"k: expected a number of heads that divides q's {num_heads}, got {num_kv_heads}")
    for name, dim in (("q", head_dim), ("v", head_dim_v)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name}: expected a head dim from 1 to {MAX_HEAD_DIM}, got {dim}")


def _spec(*, dtype, head_dim, head_dim_v, num_heads, num_kv_heads, causal, softmax_scale, dropout_p, mask,
          score_mod) -> AttentionSpec:
    return AttentionSpec(
        name="attention",
        dtype=dtype,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        causal=causal,
        softmax_scale=softmax_scale,
        dropout_p=dropout_p,
        mask=mask,
        score_mod=score_mod,
        backward=dtype not in FP8_DTYPES,  # FP8 is forward-only
    )


# ----------------------------------------------------------------------------- the per-call fast path
# A call is bound once per plain key (dtype, head dims, heads, layout, causal, scale, dropout, mask,
# score_mod, config): the spec is built, checked and compiled, and the tuned config looked up, on the
# first call; every later call with the same key is one dict lookup. Under torch.compile the same
# key (head dims and heads specialized, batch and sequence lengths left dynamic) is resolved to a
# kernel id by a function dynamo runs once at trace time and treats as a constant.
_BOUND: dict[tuple, AttentionKernel] = {}
_PLAIN = (type(None), bool, int, float, str)
_FROZEN = object()  # ends a raw eager key whose mask and score_mod were pattern dicts, frozen by _freeze


def _static_int(n, limit: int = 1 << 12) -> int:
    """n as a Python int. Under torch.compile with dynamic shapes a size is symbolic: a binary
    search of comparisons specializes it (dynamo guards each), so heads and head dims are
    constants of the graph while batch and sequence lengths stay dynamic."""
    if not isinstance(n, torch.SymInt) and not torch.compiler.is_compiling():
        return n
    lo, hi = 0, limit
    while n > hi:  # (past the limit: widened, not capped)
        lo, hi = hi + 1, hi * 2
    while lo < hi:
        mid = (lo + hi) // 2
        if n <= mid:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _static_float(x, *likely):
    """A float argument as a constant. Under torch.compile with dynamic shapes a float read from a
    default or an attribute is symbolic (transformers' self.scaling, a softcap, a dropout rate); 0 (no
    dropout) and the values in `likely` (a call's usual ones: head_dim ** -0.5 for a scale) are
    specialized by one guard, another finite value by a binary search of comparisons over the doubles'
    bit patterns (63 guards, as _static_int's search). Anything else (inf, NaN) stays as it is: the
    call's checks name it."""
    # (a bool, a string, a tensor: left for the checks, which name them; traced, a symbolic float's type reads as
    # float, and a numpy scalar as an array, which the comparisons below take)
    if x is None or isinstance(x, bool) or not torch.compiler.is_compiling() or isinstance(x, (str, torch.Tensor)):
        return x
    if x == 0:
        return 0.0
    for value in likely:
        if x == value:
            return value
    if 0 < x < math.inf:
        return _positive_double(x)
    if -math.inf < x < 0:  # (SDPA takes any scale)
        return -_positive_double(-x)
    return x


def _positive_double(x) -> float:
    """A positive finite (symbolic) float's value, by a binary search over the doubles' bit patterns."""
    lo, hi = 0, _INF_BITS  # the doubles of bit patterns lo and hi hold x between them: _double(lo) <= x < _double(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if x < _double(mid):
            hi = mid
        else:
            lo = mid
    return _double(lo)


_INF_BITS = 0x7FF0000000000000  # float('inf')'s bit pattern; a positive double's patterns order as its values


def _double(bits: int) -> float:
    """The double of IEEE 754 bit pattern `bits` (0 <= bits <= _INF_BITS), by arithmetic dynamo folds (a
    constant-result function's value carries a source whose type guards it cannot build)."""
    exponent, mantissa = bits >> 52, bits & ((1 << 52) - 1)
    if exponent == 0x7FF:
        return math.inf
    if exponent == 0:  # subnormal
        return math.ldexp(mantissa, -1074)
    return math.ldexp((1 << 52) | mantissa, exponent - 1075)


def default_scales(head_dim: int) -> tuple[float, ...]:
    """The forms 1 / sqrt(head_dim) takes in model code (head_dim ** -0.5, 1 / math.sqrt(head_dim)),
    which can differ in the last bit: _static_float's likely values for a softmax scale; none for a
    head dim under 1 (the call's checks then refuse it by name)."""
    if head_dim < 1:
        return ()
    return head_dim ** -0.5, 1 / math.sqrt(head_dim)


def _equal_to_refused(causal, softmax_scale, dropout_p) -> bool:
    """Whether a call's causal, softmax_scale or dropout_p is a value the spec refuses that equals one it takes
    (causal 1 or 1.0 is True, a scale or dropout_p True is 1): such a call has no key, so it is checked and
    refused every time (keyed, it ran once a call with the value taken had bound that key)."""
    return type(causal) is not bool or type(softmax_scale) is bool or type(dropout_p) is bool


def _freeze(x):
    """A pattern dict or list as nested tuples, so a call key holding it is hashable (thawed by _thaw)."""
    if isinstance(x, dict):
        return ("{}", tuple((name, _freeze(x[name])) for name in sorted(x)))
    if isinstance(x, (list, tuple)):
        return ("[]", tuple(_freeze(item) for item in x))
    if isinstance(x, (bool, int, float)):  # typed: 4, 4.0 and True are one dict key, and a field takes 4 only
        return (type(x), x)
    if isinstance(x, _PLAIN):
        return x
    if isinstance(x, (Mask, ScoreMod)):  # built once, never changed: its spec field (as JSON) is its key
        return ("json", x.key)
    raise TypeError(type(x).__name__)


def _thaw(x):
    if isinstance(x, tuple):
        kind, items = x
        if isinstance(kind, type):  # a number, typed by _freeze
            return items
        if kind == "json":
            return json.loads(items)
        return {name: _thaw(value) for name, value in items} if kind == "{}" else [_thaw(item) for item in items]
    return x


def _call_key(q, k, v, layout, causal, softmax_scale, dropout_p, mask, score_mod, config):
    """The plain-valued key of a call, or None when it has none (not tensors, a wrong rank, a mask
    given as a function or Mask object): such calls take the checked path every time."""
    if layout not in ("bhsd", "bshd", "thd") or not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return None
    ndim = 3 if layout == "thd" else 4
    if q.dim() != ndim or k.dim() != ndim or v.dim() != ndim:
        return None
    if not (isinstance(causal, _PLAIN) and isinstance(softmax_scale, _PLAIN) and isinstance(dropout_p, _PLAIN)
            and (config is None or isinstance(config, KernelConfig))) or _equal_to_refused(causal, softmax_scale,
                                                                                           dropout_p):
        return None
    try:
        mask, score_mod = _freeze(mask), _freeze(score_mod)
    except TypeError:
        return None
    head_axis = 2 if layout == "bshd" else 1
    return (_TORCH_DTYPES.get(q.dtype), _static_int(q.shape[-1]), _static_int(v.shape[-1]),
            _static_int(q.shape[head_axis]), _static_int(k.shape[head_axis]), layout, causal,
            _static_float(softmax_scale, *default_scales(_static_int(q.shape[-1]))), _static_float(dropout_p), mask,
            score_mod, config)


def _tuned_kernel(spec: AttentionSpec, config: KernelConfig | None) -> AttentionKernel:
    """The kernel a one-off call binds: the given config, else the stored tuned configs for the
    spec's key per bucket (the user's database, then the shipped tuning_db/), else the default.
    Looked up once per bound key; any problem reading results falls back silently."""
    if config is not None:
        return compile_spec(spec, config)
    try:
        import warnings

        from .loader import lookup

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            configs, source = lookup(spec)
    except Exception:  # noqa: BLE001 (a call never fails for its tuning results)
        configs, source = {}, "default"
    if not configs:
        return compile_spec(spec)
    kernel = AttentionKernel(spec, bucket_configs=configs)
    kernel.config_source = source
    return kernel


def _bind(key, q, k, v, **fields) -> AttentionKernel:
    # (the spec is built from the call's own arguments: a checked path whose errors name them)
    """The kernel of a call: a dict lookup on its plain key after the first call of that key."""
    kernel = _BOUND.get(key) if key is not None else None
    if kernel is None:
        config = fields.pop("config")
        build = _untraced(_build_kernel) if "torch._dynamo" in sys.modules else _build_kernel
        kernel = build(q, k, v, config, fields)
        if key is not None:
            _BOUND[key] = kernel
    return kernel


def _build_kernel(q, k, v, config, fields) -> AttentionKernel:
    return _tuned_kernel(spec_for(q, k, v, **fields), config)


_UNTRACED: dict = {}  # fn -> its torch.compiler.disable wrapper (a dict: dynamo warns of an lru_cache it traces)


def _untraced(fn):
    """fn where dynamo never traces it (torch.compiler.disable). A call compiled without fullgraph that breaks the
    graph (bad input, an object built inside the compiled function) runs on eagerly, and dynamo traces the frames it
    enters: building a spec there, torch 2.11's dynamo failed with an internal AssertionError instead of letting
    the spec's error name the argument. Under fullgraph, where such a call fails anyway, the error says it is
    not traced."""
    wrapped = _UNTRACED.get(fn)
    if wrapped is None:
        try:
            wrapped = torch.compiler.disable(fn, reason="flashgen builds a call's spec and kernel eagerly")
        except TypeError:  # (a torch without the reason)
            wrapped = torch.compiler.disable(fn)
        _UNTRACED[fn] = wrapped
    return wrapped


def _eager_binding(q, k, v, layout, causal, softmax_scale, dropout_p, mask, score_mod, config):
    """(key, kernel) of an eager call by its raw arguments: one tuple and one dict lookup, the
    whole per-call cost of binding once the key is known (kernel None: not bound yet, or no
    raw key: under torch.compile, or arguments that are not plain values; key None then).
    The raw keys live in _BOUND beside _call_key's (their dtype is a torch.dtype, not a name)."""
    if torch.compiler.is_compiling() or _equal_to_refused(causal, softmax_scale, dropout_p):
        return None, None
    try:
        head = 2 if layout == "bshd" else 1
        key = (q.dtype, q.shape[-1], v.shape[-1], q.shape[head], k.shape[head], layout, causal, softmax_scale,
               dropout_p, mask, score_mod, config)
        try:
            return key, _BOUND.get(key)
        except TypeError:  # a pattern dict (compat's windows, the transformers integration): frozen, marked so
            key = (*key[:9], _freeze(mask), _freeze(score_mod), config, _FROZEN)
            return key, _BOUND.get(key)
    except (AttributeError, IndexError, TypeError):  # not tensors, too few dims, not a pattern
        return None, None


# ----------------------------------------------------------------------------- the fast path
# An eager call with no option but the binding arguments and named tensors (no dropout, deterministic, config
# or FP8 descales: inference, a prefill, a training step's forward, a mask over tensors), seen before with the
# same tensor metadata, runs the plan its first call made and checked (host.dense_plan), found by one dict
# lookup on that metadata: no binding, spec or plan key between the call and the launch (or, recording a
# gradient, the autograd function, handed the plan). Everything the slower path decides per call (the bucket's
# kernel, the seq-major swap, the decode route, the named tensors' checks) follows from that key. A named tensor
# that requires grad keeps the checked path in grad mode (its gradient needs a contiguous copy:
# ops._gradient_ready); the key's gradient flag counts it, so the same call without grad mode has a key of its own.
_FAST: dict[tuple, tuple | bool] = {}  # _fast_key(...) + the binding arguments -> _fast_entry's result


def _fast_options(return_lse, deterministic, config, descales) -> bool:
    """Whether a call's options allow the fast path: return_lse either flag, no deterministic backward, config
    or FP8 descales (a flag that is not a bool takes the checked path, which names it)."""
    return ((return_lse is False or return_lse is True) and deterministic is False and config is None
            and descales[0] is None and descales[1] is None and descales[2] is None)


def _fast_key(q, k, v, layout, tensors, *binding):
    """The key of a call that may take the fast path: its tensors' metadata (the named tensors' too, each with
    its name and whether it requires grad), as a plan key has it, whether
    it records a gradient, the layout and `binding` (None where it cannot: traced, bound launches off, a
    decode-shaped call, whose route follows its key length (a generation step has a new one each time),
    or not plain tensors: the checked path names the argument, or torch.func's wrappers the transform)."""
    if torch.compiler.is_compiling() or not host.BoundLaunch.enabled:
        return None
    try:
        if q.shape[2 if layout == "bhsd" else 1] <= host.AttentionLauncher.DECODE_QUERIES:
            return None
        return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
                k.device, v.device, q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15,
                q.is_cpu and host.interpreting(),
                torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                             or bool(tensors) and any(t.requires_grad for t in tensors.values())),
                layout,
                tuple((name, t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15, t.requires_grad)
                      for name, t in tensors.items()) if tensors else None, *binding)
    except (AttributeError, IndexError, RuntimeError):  # (a tensor without storage: data_ptr raises)
        return None


def _fast_entry(kernel, q, k, v, layout, tensors):
    """(plan, seq_major, call, names) of a call the slow path has just run (its plan cached then), or False
    where the call runs more than one plan's launch (decode-shaped, a plan that is not dense) or a named tensor
    requires grad. call: where the call records a gradient, the autograd function's call tuple, which hands it
    the plan (else None); names: the named tensors in the kernel's order (() without any)."""
    if tensors and torch.is_grad_enabled() and any(t.requires_grad for t in tensors.values()):
        return False  # (without grad mode, a learned bias in eval: the plan as it is)
    seq_major = layout == "bhsd" and ops._seq_major(q)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)  # (as in its key)
    module = ops.kernel_module(kernel._call_id(q, k, layout, None))
    names = tuple(module.TENSORS) if tensors else ()
    if seq_major:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    plan = module._LAUNCHER.dense_plan(q, k, v, "bshd" if seq_major else layout,
                                       {name: tensors[name] for name in names} if names else None)
    if plan is None:
        return False
    return plan, seq_major, (module, layout, 0.0, False, 0, 0, (plan, seq_major)) if grad else None, names


def _fast_remember(table, key, kernel, q, k, v, layout, tensors):
    if host.capturing(q.device):  # the plan a captured call made is not kept (forward_call_plan): nothing to find
        return
    if len(table) >= 4096:  # a bound on what changing shapes leave here
        table.clear()
    try:
        table[key] = _fast_entry(kernel, q, k, v, layout, tensors)
    except TypeError:  # an unhashable binding argument: such calls keep the checked path
        pass


def _fast_run(entry, q, k, v, return_lse, tensors):
    """The output of a fast call (and its LSE): its plan's launch on the call's tensors (on bshd views for a
    seq-major q); through the autograd function where it records a gradient."""
    plan, seq_major, call, names = entry
    if call is not None:
        out, lse = ops._apply_function(q, k, v, None, None, None, call, *(tensors[name] for name in names))
        return (out, lse) if return_lse else out
    named = tensors if names else None  # (the plan reads them by name: the caller's dict as it is)
    lse = None if return_lse else plan.unread_lse()
    if seq_major:
        out, lse = plan(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, lse, None, named, None, None)
        out = out.transpose(1, 2)
    else:
        out, lse = plan(q, k, v, None, lse, None, named, None, None)
    return (out, lse) if return_lse else out


def _remember(key, kernel):
    """Bind an eager call's raw key, when all of it is plain values or frozen pattern dicts (a mask
    given as a function or Mask object is built afresh per call, as it may differ)."""
    if key is not None and all(isinstance(part, _PLAIN) for part in key[5:9 if key[-1] is _FROZEN else 11]):
        _BOUND[key] = kernel


_CONFIG_FIELDS = tuple(field.name for field in dataclasses.fields(KernelConfig))  # a traced call's config values
_REFUSED = "refused:"  # _traced_binding's answer for a call the spec refuses (its error follows)


@_constant_result
def _traced_binding(dtype, head_dim, head_dim_v, num_heads, num_kv_heads, layout, causal, softmax_scale, dropout_p,
                    mask, score_mod, config) -> str:
    """Under torch.compile: the kernel id of a call's key (with the call's config, else the default or tuned
    one, its buckets when it has several: the ops pick the call's nearest bucket, the length being dynamic
    here). Run once by dynamo at trace time. A call the spec refuses gets _REFUSED, the error's type and its
    message, which the traced call raises: raised here, dynamo would report an internal error of its own, even
    where it could run the call eagerly (without fullgraph), whose error names the argument."""
    key = (dtype, head_dim, head_dim_v, num_heads, num_kv_heads, layout, causal, softmax_scale, dropout_p, mask,
           score_mod, config)
    kernel = _BOUND.get(key)
    if kernel is None:
        try:
            spec = _spec(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, causal=causal, softmax_scale=softmax_scale, dropout_p=dropout_p,
                         mask=_thaw(mask), score_mod=_thaw(score_mod))
            kernel = _tuned_kernel(spec, _config_of(config))
        except (TypeError, ValueError) as err:
            return _refused(err)
        _BOUND[key] = kernel
    if kernel.bucket_configs:  # the config follows the call's (symbolic here) length: the ops pick per call
        return ops.bucketed_id(kernel.spec, kernel.bucket_configs)
    return kernel.kernel_id()


@_constant_result
def _traced_tensor_names(*key) -> str:
    """Under torch.compile: the named tensors a call's spec reads, in call order, comma-joined."""
    _traced_binding(*key)
    return ",".join(_BOUND[key].spec.tensor_names)


def _config_values(config):
    """Under torch.compile, a call's config as the tuple of its values (None: none), what the constant-result
    functions take: dynamo guards the values, where it would guard a KernelConfig's identity (a config made per
    call, equal to the last, would recompile), and torch 2.11's cannot pass a frozen dataclass at all."""
    if config is None:
        return None
    return tuple(value if isinstance(value, (bool, str)) else _static_int(value, 1 << 16)  # (symbolic: dynamic=True)
                 for value in (getattr(config, name) for name in _CONFIG_FIELDS))


def _config_of(values):
    """The KernelConfig of _config_values' tuple (None: none), rebuilt inside a constant-result function."""
    return None if values is None else KernelConfig(**dict(zip(_CONFIG_FIELDS, values)))


def _refused(err: Exception) -> str:
    """A constant-result function's answer for a call refused by err: _REFUSED, its kind and its text."""
    if isinstance(err, SpecError):
        return f"{_REFUSED}SpecError:{err.field}:{err}"
    kind = next(name for name, cls in _REFUSALS.items() if isinstance(err, cls))
    return f"{_REFUSED}{kind}:{err}"


def _raise_refused(answer: str) -> str:
    """answer (a kernel id), unless it is _refused's: then its error, raised in the traced code."""
    if answer.startswith(_REFUSED):
        kind, message = answer[len(_REFUSED):].split(":", 1)
        if kind == "SpecError":
            field, message = message.split(":", 1)
            raise TracedSpecError(message, field)
        raise _REFUSALS.get(kind, ValueError)(message)
    return answer


# the kinds of refusal a traced call raises as they were (the most derived first; a SpecError as a TracedSpecError)
_REFUSALS = {cls.__name__: cls for cls in (ConfigError, TypeError, ValueError)}


@_constant_result
def _traced_config_id(kernel_id: str, config: tuple) -> str:
    """Under torch.compile: the id of kernel_id's spec with the config of these values (a kernel object's call
    given a config it has not run: ops.kernel_id serializes it, which dynamo cannot trace)."""
    spec, _ = ops.kernel_spec(kernel_id)
    try:
        return ops.kernel_id(spec, _config_of(config))
    except (TypeError, ValueError) as err:
        return _refused(err)


def _check_traced_call(q, k, v, layout, causal, softmax_scale, dropout_p, config):
    """Under torch.compile, a call without a key (_call_key): the tensors, layout and scalars the spec would refuse,
    each error naming its argument, raised in the traced code (the eager path that says so builds a spec, which
    is not traced: _bind runs it untraced)."""
    host.check_tensors(q, k, v, layout)
    if causal is not True and causal is not False:
        raise TracedSpecError(f"spec field 'causal': expected true or false, got {short_repr(causal)}", "causal")
    for name, value in (("softmax_scale", softmax_scale), ("dropout_p", dropout_p)):
        if isinstance(value, (bool, torch.Tensor)):
            raise TracedSpecError(f"spec field '{name}': expected a number, got {short_repr(value)}", name)
    if config is not None:
        _check_config(config)


def _compiled_call(key, q, k, v, layout, return_lse, deterministic, tensors, cu=None, descales=(None,) * 3):
    """A call being traced by torch.compile: the custom op with the id resolved at trace time. What the op's
    fake cannot check (the named tensors' names, the longest lengths' type) is checked here, as eagerly; the
    rest, the op checks when it runs."""
    check_flag("return_lse", return_lse), check_flag("deterministic", deterministic)
    _check_dtype_heads_dims(q.dtype, *key[3:5], *key[1:3])
    key = (*key[:-1], _config_values(key[-1]))
    kernel_id = _raise_refused(_traced_binding(*key))
    names = _traced_tensor_names(*key)
    names = names.split(",") if names else []
    host.check_tensor_names(tensors, names)
    named = [tensors[name] for name in names]
    ops.check_traced_tensors(q, k, v, layout, names, named, cu, descales)
    if cu is not None:
        for name, m in (("max_seqlen_q", cu[2]), ("max_seqlen_k", cu[3])):
            # (as _max_seqlen, whose int() would specialize a traced length; dynamo reads a numpy integer as an
            # array, which the op cannot take: traced, a Python int it must be)
            if isinstance(m, bool) or not isinstance(m, (int, torch.SymInt)):
                raise ValueError(f"{name}: expected a non-negative int (traced by torch.compile: a Python int), got "
                                 f"a {type(m).__name__}")
    if key[0] in FP8_DTYPES or any(d is not None for d in descales):
        out, lse = ops.attn_fwd_fp8(q, k, v, *descales, named, kernel_id, layout)
        return (out, lse) if return_lse else out
    p = float(key[8])
    seed = torch.randint(0, 2**62, (1,), device=q.device, dtype=torch.int64) if p > 0 else _unused_seed(q.device)
    cu_q, cu_k, max_q, max_k = cu if cu is not None else (None, None, 0, 0)
    out, lse = ops.attn_fwd(q, k, v, seed, named, kernel_id, layout, p, deterministic, cu_q, cu_k, max_q, max_k)
    return (out, lse) if return_lse else out


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, layout: str = "bhsd",
              return_lse: bool = False, config: KernelConfig | None = None, dropout_p: float = 0.0,
              deterministic: bool = False, mask=None, score_mod=None, q_descale=None, k_descale=None,
              v_descale=None, **tensors):
    """One-off attention: softmax(score_mod(q k^T * softmax_scale) masked) v, differentiable.

    Shapes as in AttentionKernel. ``causal`` masks bottom-right aligned (flash-attn's
    convention): query i sees key j iff j <= i + seqlen_k - seqlen_q. ``mask`` and
    ``score_mod`` take anything a spec does (a pattern dict, an expression string,
    flashgen.mask(...), a Python function); the tensors they read are passed by name.
    ``dropout_p`` drops attention probabilities (fused, Philox; the backward regenerates the same mask).
    Without ``config``, the stored tuned config for the spec is used when there is one.
    FP8 (q, k, v in torch.float8_e4m3fn or float8_e5m2): ``q_descale``, ``k_descale``,
    ``v_descale`` are float32 factors per (batch, KV head), as FlashAttention-3's (q * q_descale
    is the value meant; None: 1; see flashgen.quantize_fp8); the output is bf16; forward only.
    Calls without a gradient of up to 16 queries over more than 512 keys (a generation step over a KV
    cache) run on the split-KV decode kernel (flashgen.decode's), which reads K/V once per KV group and
    splits the keys over the SMs, for a spec it serves (no dropout, document ids or named tensors).
    """
    descales = q_descale, k_descale, v_descale
    fast = entry = None
    # (mask and score_mod plain values: not a pattern dict, a function or an object)
    if (_fast_options(return_lse, deterministic, config, descales) and type(dropout_p) is float
            and dropout_p == 0.0 and not _equal_to_refused(causal, softmax_scale, dropout_p)
            and type(mask) in _PLAIN and type(score_mod) in _PLAIN):
        fast = _fast_key(q, k, v, layout, tensors, causal, softmax_scale, mask, score_mod)
        try:
            entry = _FAST.get(fast)
        except TypeError:  # an unhashable argument: the checked path names it
            entry = fast = None
        if entry:
            return _fast_run(entry, q, k, v, return_lse, tensors)
    eager_key, kernel = _eager_binding(q, k, v, layout, causal, softmax_scale, dropout_p, mask, score_mod, config)
    if kernel is None:
        key = _call_key(q, k, v, layout, causal, softmax_scale, dropout_p, mask, score_mod, config)
        if torch.compiler.is_compiling():
            if key is not None:
                return _compiled_call(key, q, k, v, layout, return_lse, deterministic, tensors, descales=descales)
            _check_traced_call(q, k, v, layout, causal, softmax_scale, dropout_p, config)
        kernel = _bind(key, q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout, dropout_p=dropout_p,
                       mask=mask, score_mod=score_mod, config=config)
        _remember(eager_key, kernel)
    # the bound kernel's config follows the call's length (its buckets), as the kernel's own __call__
    out = kernel._call(q, k, v, layout, return_lse, None, None, deterministic, descales, tensors)
    if fast is not None and entry is None and kernel._plain:
        _fast_remember(_FAST, fast, kernel, q, k, v, layout, tensors)
    return out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = False, softmax_scale: float | None = None, dropout_p: float = 0.0,
                     return_lse: bool = False, config: KernelConfig | None = None, deterministic: bool = False,
                     mask=None, score_mod=None, **tensors):
    """Attention over packed variable-length sequences, as flash_attn_varlen_func.

    q: (total_q, heads, head_dim), k/v: (total_k, kv_heads, head_dim); cu_seqlens_q/k: int32
    (batch + 1) offsets. Causal alignment and masks apply within each sequence. Returns out
    (total_q, heads, head_dim_v) (and LSE (heads, total_q) with return_lse). Tokens after
    cu_seqlens_q[-1] belong to no sequence: their rows of out, LSE and dq are not written (as
    flash-attn's), so slice them off before anything reads them."""
    for name in ("q_descale", "k_descale", "v_descale"):
        if name in tensors:  # (else: "not a tensor of this spec")
            raise TypeError(f"{name}: attention_varlen takes no FP8 descale factors (FP8 runs through "
                            "flashgen.attention on dense layouts)")
    eager_key, kernel = _eager_binding(q, k, v, "thd", causal, softmax_scale, dropout_p, mask, score_mod, config)
    if kernel is None:
        key = _call_key(q, k, v, "thd", causal, softmax_scale, dropout_p, mask, score_mod, config)
        if torch.compiler.is_compiling():
            if key is not None:
                return _compiled_call(key, q, k, v, "thd", return_lse, deterministic, tensors,
                                      (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
            _check_traced_call(q, k, v, "thd", causal, softmax_scale, dropout_p, config)
        kernel = _bind(key, q, k, v, causal=causal, softmax_scale=softmax_scale, layout="thd", dropout_p=dropout_p,
                       mask=mask, score_mod=score_mod, config=config)
        _remember(eager_key, kernel)
    return kernel.varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_lse=return_lse,
                         deterministic=deterministic, **tensors)
