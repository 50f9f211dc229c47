"""Inputs for a spec: randn q, k, v and dO, and the named tensors its mask and score modifier read.

A named tensor is made from what the spec says it is, never from its name: the pattern or
modifier parameter that names it decides its contents, a custom expression the way it is
read. The tuner verifies and times configs on these inputs, and the benchmarks time on them.

=======================  ==============================================================
read as                  made as
=======================  ==============================================================
document ``ids``         int32 (batch, seqlen), nondecreasing along each row: ``documents``
                         equal documents, or random cuts per row with a generator
prefix_lm ``prefix``     int32 (batch,) lengths in [0, seqlen_k]: seqlen_k // 2, or random
alibi ``slopes``         float32 (heads,), positive: 2^(-8 i / heads), i = 1..heads (flash-attn's)
relative_bias ``tensor`` float32 randn (heads, seqlen_q + seqlen_k - 1): every distance indexed
custom expression        its rank and the extent its indices reach (over b, h, q_idx, kv_idx in
                         range); int32 in [0, seqlen] where a mask reads it, else float32 randn
=======================  ==============================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import masks
from .expr.ir import Bin, Const, Fn, Load, Neg, Not, Search, Var, walk


def qkv_do(spec, batch: int, seqlen_q: int, seqlen_k: int, *, device, generator=None) -> tuple:
    """Fresh randn q, k, v and dO in layout bhsd and the spec's dtype (drawn in float32)."""
    def randn(heads, seqlen, dim):
        return torch.randn((batch, heads, seqlen, dim), generator=generator).to(device=device, dtype=spec.torch_dtype)

    return (randn(spec.num_heads, seqlen_q, spec.head_dim), randn(spec.num_kv_heads, seqlen_k, spec.head_dim),
            randn(spec.num_kv_heads, seqlen_k, spec.head_dim_v), randn(spec.num_heads, seqlen_q, spec.head_dim_v))


@dataclass(frozen=True)
class CallShape:
    """The call the named tensors are made for."""

    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    device: object
    generator: torch.Generator | None = None
    documents: int = 4

    @property
    def seqlen(self) -> int:
        return max(self.seqlen_q, self.seqlen_k)


def document_ids(s: CallShape) -> torch.Tensor:
    """(batch, seqlen) int32 ids, nondecreasing along each row (read by query and key index)."""
    if s.generator is None:
        row = torch.arange(s.seqlen) * s.documents // s.seqlen
        return row.to(torch.int32).repeat(s.batch, 1).to(s.device)
    # Random cuts per row: documents of any length from 1 up, different in every batch element.
    starts = torch.rand((s.batch, s.seqlen), generator=s.generator) < min(1.0, s.documents / s.seqlen)
    starts[:, 0] = False
    return starts.cumsum(1).to(torch.int32).to(s.device)


def prefix_lengths(s: CallShape) -> torch.Tensor:
    """(batch,) int32 prefix lengths in [0, seqlen_k]."""
    if s.generator is None:
        return torch.full((s.batch,), s.seqlen // 2, dtype=torch.int32, device=s.device)
    return torch.randint(0, s.seqlen_k + 1, (s.batch,), generator=s.generator, dtype=torch.int32).to(s.device)


def alibi_slopes(s: CallShape) -> torch.Tensor:
    """(heads,) positive float32 slopes, flash-attn's geometric sequence."""
    return torch.tensor([2 ** (-8 * (i + 1) / s.heads) for i in range(s.heads)], device=s.device)


def bias_table(s: CallShape) -> torch.Tensor:
    """(heads, seqlen_q + seqlen_k - 1) float32 randn: one value per head and distance."""
    return torch.randn((s.heads, s.seqlen_q + s.seqlen_k - 1), generator=s.generator).to(s.device)


# (node kind, the parameter that names a tensor) -> how that tensor is made
PATTERN_TENSORS = {("document", "ids"): document_ids, ("prefix_lm", "prefix"): prefix_lengths}
MODIFIER_TENSORS = {("alibi", "slopes"): alibi_slopes, ("relative_bias", "tensor"): bias_table}


def named_tensors(spec, batch: int, seqlen_q: int, seqlen_k: int | None = None, *, device="cuda",
                  generator: torch.Generator | None = None, documents: int = 4) -> dict:
    """The tensors a spec's mask and score modifier read, by name, for a call of this shape.
    With a generator every random choice is drawn from it (fresh inputs for verification);
    without, the benchmarks' fixed layout (equal documents, half-length prefixes)."""
    s = CallShape(batch, spec.num_heads, seqlen_q, seqlen_q if seqlen_k is None else seqlen_k, device, generator,
              documents)
    makers, custom = {}, []  # name -> maker; (IR, read by a mask) of custom expressions
    for node in _mask_leaves(spec.mask_node):
        if node.kind == "expr":
            custom.append((masks.predicate(node), True))
        for param, value in node.params:
            if (node.kind, param) in PATTERN_TENSORS and isinstance(value, str):  # prefix_lm's may be a number
                makers.setdefault(value, PATTERN_TENSORS[node.kind, param])
    for kind, params, expr in spec.score_mod.steps if spec.score_mod is not None else ():
        if kind == "expr":
            custom.append((masks.score_ir(masks.ScoreModNode(((kind, params, expr),))), False))
        for param, value in params:
            if (kind, param) in MODIFIER_TENSORS:
                makers.setdefault(value, MODIFIER_TENSORS[kind, param])
    out = {}
    for name in spec.tensor_names:
        maker = makers.get(name)
        out[name] = maker(s) if maker is not None else _custom_tensor(name, custom, s)
    return out


def _mask_leaves(node):
    if node is None:
        return
    if node.kind in ("and", "or"):
        for child in node.children:
            yield from _mask_leaves(child)
    else:
        yield node


def _custom_tensor(name: str, custom, s: CallShape) -> torch.Tensor:
    """A tensor only custom expressions read: each dimension as long as its indices reach;
    int32 positions where a mask reads it (masks compare positions), float32 randn otherwise."""
    sites = [(n, is_mask) for ir, is_mask in custom for n in walk(ir) if isinstance(n, Load) and n.tensor == name]
    env = {"b": (0, s.batch - 1), "h": (0, s.heads - 1), "q_idx": (0, s.seqlen_q - 1),
           "kv_idx": (0, s.seqlen_k - 1), "seqlen_q": (s.seqlen_q,) * 2, "seqlen_k": (s.seqlen_k,) * 2}
    shape = [1] * len(sites[0][0].index)  # the spec checked that every read uses one rank
    for n, _ in sites:
        for d, i in enumerate(n.index):
            _, hi = _bounds(i, env, s)
            shape[d] = max(shape[d], int(hi) + 1 if math.isfinite(hi) else s.seqlen)
    if any(is_mask for _, is_mask in sites):
        return torch.randint(0, s.seqlen + 1, shape, generator=s.generator, dtype=torch.int32).to(s.device)
    return torch.randn(shape, generator=s.generator).to(s.device)


def _bounds(node, env, s: CallShape) -> tuple[float, float]:
    """Interval [lo, hi] an integer index expression takes over the variables' ranges
    (floats and unknowns widen to infinity)."""
    inf = (-math.inf, math.inf)
    if isinstance(node, Const):
        v = float(node.value)
        return (v, v)
    if isinstance(node, Var):
        return env.get(node.name, inf)
    if isinstance(node, (Load, Search)):  # another tensor's value or a position: within the sequence
        return (0, s.seqlen)
    if isinstance(node, Not) or isinstance(node, Bin) and node.op in ("<", "<=", ">", ">=", "==", "!="):
        return (0, 1)
    if isinstance(node, Neg):
        lo, hi = _bounds(node.a, env, s)
        return (-hi, -lo)
    if isinstance(node, Fn) and node.name in ("abs", "min", "max", "where"):
        args = [_bounds(a, env, s) for a in node.args]
        if node.name == "abs":
            (lo, hi), = args
            return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
        if node.name == "where":  # either branch
            return (min(args[1][0], args[2][0]), max(args[1][1], args[2][1]))
        pick = min if node.name == "min" else max
        return (pick(a[0] for a in args), pick(a[1] for a in args))
    if isinstance(node, Bin) and node.op in ("+", "-", "*", "//", "%", "&", "|"):
        (alo, ahi), (blo, bhi) = _bounds(node.a, env, s), _bounds(node.b, env, s)
        if node.op == "+":
            return (alo + blo, ahi + bhi)
        if node.op == "-":
            return (alo - bhi, ahi - blo)
        if node.op == "*":
            products = [x * y for x in (alo, ahi) for y in (blo, bhi) if not (math.isinf(x) or math.isinf(y))]
            return (min(products), max(products)) if len(products) == 4 else inf
        if node.op == "//" and blo == bhi and blo != 0:
            ends = (alo // blo, ahi // blo) if math.isfinite(alo) and math.isfinite(ahi) else inf
            return (min(ends), max(ends))
        if node.op == "%" and blo == bhi and blo != 0:
            return (0, blo - 1) if blo > 0 else (blo + 1, 0)
        if node.op in ("&", "|") and min(alo, blo) >= 0:  # bitwise on non-negative ints
            return (0, 2 ** max(1, math.ceil(math.log2(max(ahi, bhi) + 1))) - 1)
    return inf
