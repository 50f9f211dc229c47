"""FP8 quantization for FP8 attention: ``flashgen.quantize_fp8`` and its inverse.

An FP8 attention call takes Q, K and V in FP8 with float32 *descale* factors, as
FlashAttention-3: the value a kernel uses is ``x_fp8 * descale``. One factor per (batch, KV
head) is what the kernels read (``q_descale``, ``k_descale``, ``v_descale``, each (batch,
kv_heads)); for Q that factor is shared by the query heads of one KV group.

``block`` also quantizes per block of tokens along the sequence (scales (batch, groups,
blocks)): finer scales keep more precision where a few tokens carry outliers, for storage
(an FP8 KV cache written page by page) and for checking how much the per-head scale loses;
the attention kernels read per-head factors, so pass ``block=None`` for their inputs.
"""

from __future__ import annotations

import torch

from .spec import DTYPES, FP8_DTYPES

FP8_TORCH = {name: getattr(torch, DTYPES[name]) for name in FP8_DTYPES}
_LAYOUT_DIMS = {"bhsd": (1, 2), "bshd": (2, 1)}  # (head dim, seq dim) of each layout


def _fp8_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in FP8_TORCH.values():
        return dtype
    if isinstance(dtype, str) and dtype in FP8_TORCH:
        return FP8_TORCH[dtype]
    raise ValueError(f"dtype: expected 'fp8_e4m3' or 'fp8_e5m2' (or the torch float8 dtype), got {dtype!r}")


def _check_grouping(heads: int, group, block) -> None:
    """group: a positive divisor of the heads; block: a positive number of tokens or None."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 1 or heads % group:
        raise ValueError(f"group: expected a positive divisor of the {heads} heads, got {group!r}")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise ValueError(f"block: expected a positive number of tokens or None, got {block!r}")


def quantize_fp8(x: torch.Tensor, *, layout: str = "bhsd", dtype="fp8_e4m3", group: int = 1,
                 block: int | None = None, seq_contiguous: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in FP8, float32 descale factors) with x ~= x_fp8 * descale.

    x: (batch, heads, seq, dim) for layout 'bhsd', (batch, seq, heads, dim) for 'bshd'.
    group: heads that share one factor (a query tensor's GQA group, so its factors line up
    with the KV heads: pass num_heads // num_kv_heads). Factors: (batch, heads // group), or
    with ``block`` (batch, heads // group, ceil(seq / block)), one per block of tokens. Each
    factor maps its slice's largest magnitude to the FP8 type's largest finite value; an all-zero
    slice gets factor 1; x must be finite (ValueError; checking it reads the factors back to the
    host). ``seq_contiguous``: store the result with its sequence dim contiguous (same shape): the
    layout the FP8 kernels read V in, so a V quantized once this way is not copied on every call
    (quantize V, or a V cache, with it).
    """
    fp8 = _fp8_dtype(dtype)
    if layout not in _LAYOUT_DIMS:
        raise ValueError(f"layout: expected 'bhsd' or 'bshd', got {layout!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point() or x.is_meta:
        raise ValueError(f"x: expected a 4-d float tensor with data in layout {layout!r}, got "
                         + (f"shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}" if isinstance(x, torch.Tensor)
                            else type(x).__name__))
    if not isinstance(seq_contiguous, bool):
        raise ValueError(f"seq_contiguous: expected a bool, got {seq_contiguous!r}")
    head_dim, seq_dim = _LAYOUT_DIMS[layout]
    heads, seqlen = x.shape[head_dim], x.shape[seq_dim]
    _check_grouping(heads, group, block)
    xb = x.float().movedim(head_dim, 1).movedim(seq_dim if seq_dim > head_dim else seq_dim + 1, 2)  # bhsd
    batch = xb.shape[0]
    nblocks = 1 if block is None else -(-seqlen // block)
    if x.numel() == 0:  # nothing to scale: factors of 1 (a 0-size slice has no largest magnitude)
        ones = torch.ones((batch, heads // group, nblocks), dtype=torch.float32, device=x.device)
        return x.to(fp8), (ones[..., 0] if block is None else ones).contiguous()
    size = seqlen if block is None else min(block, seqlen)  # a block past the sequence: one block of all of it
    padded = torch.nn.functional.pad(xb, (0, 0, 0, nblocks * size - seqlen))
    tiles = padded.reshape(batch, heads // group, group, nblocks, size, xb.shape[-1])
    amax = tiles.abs().amax(dim=(2, 4, 5))  # (batch, groups, blocks)
    # an inf would give its slice an infinite factor (every value 0 or NaN): refused by name, reading the factors
    # back to the host (not while a CUDA graph is captured or torch.compile traces, where nothing is read back)
    if (not torch.compiler.is_compiling() and not (amax.is_cuda and torch.cuda.is_current_stream_capturing())
            and not bool(torch.isfinite(amax).all())):
        raise ValueError(f"x: holds inf or NaN, or values past float32's range (a factor maps a slice's largest "
                         f"magnitude onto {fp8}'s largest finite value, so every value must be finite)")
    # (at least float32's smallest normal: a slice of subnormal values gave amax / max = 0, so every value
    # saturated and a zero became 0 / 0 = NaN; such values now round to FP8 zeros, finite)
    descale = torch.where(amax > 0, (amax / torch.finfo(fp8).max).clamp(min=torch.finfo(torch.float32).tiny),
                          torch.ones_like(amax))
    scaled = tiles / descale[:, :, None, :, None, None]
    xq = scaled.reshape(padded.shape)[:, :, :seqlen].to(fp8)
    xq = xq.movedim(2, seq_dim if seq_dim > head_dim else seq_dim + 1).movedim(1, head_dim)
    xq = xq.movedim(seq_dim, -1).contiguous().movedim(-1, seq_dim) if seq_contiguous else xq.contiguous()
    return xq, (descale[..., 0] if block is None else descale).contiguous()


def dequantize_fp8(xq: torch.Tensor, descale: torch.Tensor, *, layout: str = "bhsd", group: int = 1,
                   block: int | None = None) -> torch.Tensor:
    """The float32 values quantize_fp8's (xq, descale) stand for: xq * descale, broadcast back."""
    if layout not in _LAYOUT_DIMS:
        raise ValueError(f"layout: expected 'bhsd' or 'bshd', got {layout!r}")
    head_dim, seq_dim = _LAYOUT_DIMS[layout]
    if not isinstance(xq, torch.Tensor) or xq.dim() != 4:
        raise ValueError(f"xq: expected a 4-d tensor in layout {layout!r}, got "
                         f"{tuple(xq.shape) if isinstance(xq, torch.Tensor) else type(xq).__name__}")
    heads, seqlen = xq.shape[head_dim], xq.shape[seq_dim]
    _check_grouping(heads, group, block)
    want = (xq.shape[0], heads // group) + (() if block is None else (-(-seqlen // block),))
    if not isinstance(descale, torch.Tensor) or tuple(descale.shape) != want:
        raise ValueError(f"descale: expected shape {want} (batch, heads // group{', blocks' if block else ''}: the "
                         f"group= and block= quantize_fp8 took), got "
                         f"{tuple(descale.shape) if isinstance(descale, torch.Tensor) else type(descale).__name__}")
    x = xq.float().movedim(head_dim, 1).movedim(seq_dim if seq_dim > head_dim else seq_dim + 1, 2)
    scale = descale if block is not None else descale[..., None]
    scale = scale.repeat_interleave(group, dim=1)
    if block is not None:
        scale = scale.repeat_interleave(min(block, x.shape[2]), dim=2)[:, :, :x.shape[2]]
    else:
        scale = scale.expand(-1, -1, x.shape[2])
    x = x * scale[..., None]
    return x.movedim(2, seq_dim if seq_dim > head_dim else seq_dim + 1).movedim(1, head_dim)
