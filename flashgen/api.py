"""The user-facing API: ``flashgen.compile(spec)`` and ``flashgen.attention(q, k, v)``."""

from __future__ import annotations

from functools import lru_cache

import torch

from . import ops, render
from .config import KernelConfig, default_config
from .space import nearest_bucket
from .spec import MAX_HEAD_DIM, AttentionSpec

_TORCH_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
LAYOUTS = ("bhsd", "bshd")


class AttentionKernel:
    """A compiled attention spec. Call it as ``kernel(q, k, v)``; it is differentiable.

    q is (batch, heads, seqlen_q, head_dim) in layout ``bhsd`` or (batch, seqlen_q,
    heads, head_dim) in layout ``bshd``; k and v likewise with the KV heads. The output
    has q's layout and head dim ``head_dim_v``; with ``return_lse=True`` the call also
    returns the log-sum-exp, (batch, heads, seqlen_q) float32 (not differentiable).
    """

    def __init__(self, spec: AttentionSpec, config: KernelConfig | None = None, *,
                 bucket_configs: dict[int, KernelConfig] | None = None):
        self.spec = spec
        self.config = config if config is not None else default_config(spec)
        # Tuned configs per power-of-two sequence-length bucket (flashgen.load); a call uses
        # the nearest bucket's, or self.config when there are none.
        self.bucket_configs = dict(bucket_configs or {})
        self.config_source = "given" if config is not None else "default"
        self._modules: dict[KernelConfig, object] = {}
        self._ids: dict[KernelConfig, str] = {}
        self._id = self.kernel_id(self.config)
        self._bucket_ids = {b: self.kernel_id(c) for b, c in self.bucket_configs.items()}

    def config_for(self, seqlen: int) -> KernelConfig:
        """The config a call at this sequence length uses."""
        if not self.bucket_configs:
            return self.config
        return self.bucket_configs[nearest_bucket(seqlen, self.bucket_configs)]

    def module(self, config: KernelConfig | None = None):
        """The imported Triton module for a config (rendered and cached on first use)."""
        config = config if config is not None else self.config
        module = self._modules.get(config)
        if module is None:
            module = self._modules[config] = render.load(self.spec, config)
        return module

    def kernel_id(self, config: KernelConfig) -> str:
        """The id under which the custom ops find this kernel with this config."""
        kid = self._ids.get(config)
        if kid is None:
            kid = self._ids[config] = ops.register(self, config)
        return kid

    def source(self, config: KernelConfig | None = None) -> str:
        return render.render(self.spec, config if config is not None else self.config)

    def forward(self, q, k, v, *, layout: str = "bhsd", config: KernelConfig | None = None,
                out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                dropout_p: float = 0.0, seed: torch.Tensor | None = None):
        """Run the forward kernel directly (no autograd); returns (out, lse)."""
        return self.module(config).forward(q, k, v, layout=layout, out=out, lse=lse, dropout_p=dropout_p, seed=seed)

    def backward(self, do, q, k, v, out, lse, *, layout: str = "bhsd", config: KernelConfig | None = None,
                 dropout_p: float = 0.0, seed: torch.Tensor | None = None, deterministic: bool = False):
        """Run the backward kernels directly; returns (dq, dk, dv)."""
        return self.module(config).backward(do, q, k, v, out, lse, layout=layout, dropout_p=dropout_p, seed=seed,
                                            deterministic=deterministic)

    def __call__(self, q, k, v, *, layout: str = "bhsd", return_lse: bool = False,
                 config: KernelConfig | None = None, dropout_p: float | None = None, deterministic: bool = False):
        """Differentiable attention. ``dropout_p`` defaults to the spec's (pass 0.0 in eval);
        ``deterministic=True`` computes dQ with the separate, bitwise-repeatable kernel."""
        if config is not None:
            kernel_id = self.kernel_id(config)
        elif self._bucket_ids:
            seqlen = max(q.shape[2 if layout == "bhsd" else 1], k.shape[2 if layout == "bhsd" else 1])
            kernel_id = self._bucket_ids[nearest_bucket(seqlen, self._bucket_ids)]
        else:
            kernel_id = self._id
        p = self.spec.dropout_p if dropout_p is None else float(dropout_p)
        if p > 0:
            seed = torch.randint(0, 2**62, (1,), device=q.device, dtype=torch.int64)
        else:
            seed = torch.empty(1, device=q.device, dtype=torch.int64)
        out, lse = ops.attn_fwd(q, k, v, seed, kernel_id, layout, p, deterministic)
        return (out, lse) if return_lse else out

    def __repr__(self) -> str:
        return f"AttentionKernel({self.spec.uri}, {self.config})"


def compile(spec: AttentionSpec | str, config: KernelConfig | None = None) -> AttentionKernel:  # noqa: A001
    """Compile a spec (an AttentionSpec, a YAML path or a dict) into a callable kernel."""
    return _compiled(AttentionSpec.coerce(spec), config)


@lru_cache(maxsize=256)
def _compiled(spec: AttentionSpec, config: KernelConfig | None) -> AttentionKernel:
    return AttentionKernel(spec, config)


def spec_for(q, k, v, *, causal: bool, softmax_scale: float | None, layout: str,
             dropout_p: float = 0.0) -> AttentionSpec:
    """The spec that describes a call on these tensors; errors name the argument."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-d tensor in layout {layout!r}, got shape {tuple(t.shape)}")
    if q.dtype not in _TORCH_DTYPES:
        raise ValueError(f"q: expected dtype float16, bfloat16 or float32, got {q.dtype}")
    head_axis = 1 if layout == "bhsd" else 2
    num_heads, num_kv_heads = q.shape[head_axis], k.shape[head_axis]
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"k: expected a number of heads that divides q's {num_heads}, got {num_kv_heads}")
    for name, t in (("q", q), ("v", v)):
        if not 1 <= t.shape[3] <= MAX_HEAD_DIM:
            raise ValueError(f"{name}: expected a head dim from 1 to {MAX_HEAD_DIM}, got {t.shape[3]}")
    return AttentionSpec(
        name="attention",
        dtype=_TORCH_DTYPES[q.dtype],
        head_dim=q.shape[3],
        head_dim_v=v.shape[3],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        causal=causal,
        softmax_scale=softmax_scale,
        dropout_p=dropout_p,
        backward=True,
    )


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, layout: str = "bhsd",
              return_lse: bool = False, config: KernelConfig | None = None, dropout_p: float = 0.0,
              deterministic: bool = False):
    """One-off attention: softmax(q k^T * softmax_scale) v, differentiable.

    Shapes as in AttentionKernel. ``causal`` masks bottom-right aligned (flash-attn's
    convention): query i sees key j iff j <= i + seqlen_k - seqlen_q. ``dropout_p`` drops
    attention probabilities (fused, Philox; the backward regenerates the same mask).
    """
    spec = spec_for(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout, dropout_p=dropout_p)
    return compile(spec, config)(q, k, v, layout=layout, return_lse=return_lse, deterministic=deterministic)
