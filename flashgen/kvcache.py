"""Decode over a KV cache with any spec: ``flashgen.decode(spec_or_kernel, q, k_cache, v_cache, ...)``.

(Named kvcache, not decode, so that the function ``flashgen.decode`` does not shadow its module.)

The spec's mask and score modifier apply as in prefill, with the query rows aligned to the end
of each batch element's keys (causal: query i of Sq sees key j <= seqlen_k - Sq + i, where
seqlen_k = cache_seqlens[b] + the keys appended this call). The kernels: templates/decode/
(split-KV with the query heads of a KV group packed into one tile); the host side:
flashgen/runtime/decode.py.
"""

from __future__ import annotations

import torch

from .api import AttentionKernel, compile_spec
from .config import KernelConfig
from .spec import AttentionSpec


def decode(spec_or_kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens=None, *,
           k: torch.Tensor | None = None, v: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
           cache_batch_idx: torch.Tensor | None = None, softmax_scale: float | None = None,
           return_lse: bool = False, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
           num_splits: int = 0, BLOCK_N: int | None = None, num_warps: int | None = None,
           num_stages: int | None = None, config: KernelConfig | None = None, **tensors):
    """Attention of q (batch, seqlen_q, heads, head_dim) over a KV cache, with a spec's mask and score_mod.

    spec_or_kernel: an AttentionKernel (flashgen.compile) or anything flashgen.compile takes (an
    AttentionSpec, a YAML path, a dict). k_cache, v_cache: (batch, S_max, kv_heads, head_dim), or
    paged (num_pages, page_size, kv_heads, head_dim) with block_table (batch, max_pages_per_seq)
    int32 (any page order, page_size 1..256). cache_seqlens: (batch,) int32 keys in the cache
    per element (an int: the same for all; None: the whole cache). k, v (batch, seqlen_new,
    kv_heads, head_dim): new keys and values written into the cache in place at cache_seqlens
    first, then attended. num_splits 0 picks the split count from the shapes (never from
    cache_seqlens: a call is CUDA-graph capturable). The tensors the spec's mask or score_mod
    reads are passed by name. out, lse: buffers to write into. Returns out (batch, seqlen_q,
    heads, head_dim_v) in q's dtype, and with return_lse the log-sum-exp (batch, heads, seqlen_q) float32 (-inf where a row sees no key).
    """
    kernel = spec_or_kernel if isinstance(spec_or_kernel, AttentionKernel) else compile_spec(
        AttentionSpec.coerce(spec_or_kernel))
    module = kernel.module(config)
    out, lse = module.decode(q, k_cache, v_cache, cache_seqlens, k=k, v=v, block_table=block_table,
                             cache_batch_idx=cache_batch_idx, softmax_scale=softmax_scale, tensors=tensors, out=out,
                             lse=lse, BLOCK_N=BLOCK_N, num_splits=num_splits, num_warps=num_warps,
                             num_stages=num_stages)
    return (out, lse) if return_lse else out
