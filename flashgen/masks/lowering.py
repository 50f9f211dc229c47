"""A spec's mask and score modifier lowered together to expressions, and checked as a pair.

``lower(mask, score_mod)`` is what both the kernel generator and the reference start from:
the predicate, the key/query segments (or None: a block map), the modified score and its
derivatives, and the named tensors a call passes. It refuses, naming the field, what would
only fail later: a tensor indexed with different ranks, tensor names whose kernel parameters
collide, expressions nested deeper than the generated source can hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..errors import SpecError
from ..expr.derivative import derivative
from ..expr.ir import MAX_DEPTH, Load, Var, depth, tensors_of, walk
from ..expr.to_triton import MAX_TERMS, tensor_params, written_terms
from .score_mods import RELATIVE_DISTANCE, ScoreModNode, score_ir
from .tree import MaskNode, contains_kind, full_segments, integer_tensors, predicate, segments


@dataclass(frozen=True)
class NamedTensor:
    """A tensor the mask or score modifier reads, passed to a call by name."""

    name: str
    rank: int  # how many indices the expressions use
    grad: bool  # read by the score modifier: gradients flow into it when it is a float tensor
    # per dimension, the call sizes it must have (or 1, broadcast): "batch", "heads", "seqlen_q", "seqlen_k",
    # where every index of that dimension is the plain b, h, q_idx or kv_idx, "distances" (seqlen_q + seqlen_k - 1)
    # where it is relative_bias's q_idx - kv_idx + seqlen_k - 1; () where one is another expression (its indices
    # are clamped into the tensor: no size is implied)
    sizes: tuple = ()
    # a built-in pattern's key ranges compute with its values, or an expression indexes a tensor with them: a call
    # passes an integer or bool tensor
    integer: bool = False


SIZE_OF_VAR = {"b": "batch", "h": "heads", "q_idx": "seqlen_q", "kv_idx": "seqlen_k"}


def _index_sizes(exprs, rank: dict) -> dict:
    """{tensor: per dimension, the sorted call sizes its plain-variable indices imply, or () (see NamedTensor)}."""
    found: dict = {}
    for expr in exprs:
        for n in walk(expr):
            if isinstance(n, Load):
                dims = found.setdefault(n.tensor, [set() for _ in range(rank[n.tensor])])
                for d, index in enumerate(n.index):
                    if dims[d] is None:
                        continue
                    if isinstance(index, Var) and index.name in SIZE_OF_VAR:
                        dims[d].add(SIZE_OF_VAR[index.name])
                    elif index == RELATIVE_DISTANCE:
                        dims[d].add("distances")
                    else:
                        dims[d] = None
    return {name: tuple(tuple(sorted(d)) if d else () for d in dims) for name, dims in found.items()}


# the kinds of size a dimension's plain-variable indices imply
SIZE_KIND = {"batch": "the batch", "heads": "the heads", "seqlen_q": "positions", "seqlen_k": "positions",
             "distances": "positions"}


def _check_roles(pred, score, ranks: dict) -> None:
    """Refuse a tensor that the mask and the score modifier index by different kinds (the batch, the heads,
    positions) in one dimension: read in two roles, as a pattern's document ids [b, position] and ALiBi's slopes
    [b, h], which only a broadcast (size-1) dimension would fit. (Within one of them, such a dimension takes
    both sizes' rules at the call: AttentionLauncher.check_tensor_sizes.)"""
    if pred is None or score is None:
        return
    in_mask, in_score = _index_sizes([pred], ranks), _index_sizes([score], ranks)
    for name in sorted(in_mask.keys() & in_score.keys()):
        for d, (a, b) in enumerate(zip(in_mask[name], in_score[name])):
            mask_kinds, score_kinds = {SIZE_KIND[s] for s in a}, {SIZE_KIND[s] for s in b}
            # (one side's kinds within the other's: that side's own mixing, which it may do alone)
            if mask_kinds and score_kinds and not (mask_kinds <= score_kinds or score_kinds <= mask_kinds):
                raise SpecError("score_mod", f"tensor {name!r} is indexed by {' and '.join(sorted(score_kinds))} in "
                                f"its dimension {d} here and by {' and '.join(sorted(mask_kinds))} in the mask (one "
                                "tensor in two roles); give each role its own tensor name")


def _index_tensors(exprs) -> set:
    """The tensors whose values index another tensor (m[p[q_idx]]: p): a call passes integer or bool ones."""
    return {inner.tensor for expr in exprs for n in walk(expr) if isinstance(n, Load) for index in n.index
            for inner in walk(index) if isinstance(inner, Load)}


@dataclass(frozen=True)
class GradSite:
    """One place the score modifier reads a gradient tensor, and d(modified score)/d(that element)."""

    tensor: str
    index: tuple  # IR per dimension
    derivative: Any  # IR


@dataclass(frozen=True)
class Lowered:
    """A mask and a score modifier as expressions (IR)."""

    mask: MaskNode | None
    score_mod: ScoreModNode | None
    predicate: Any  # which (q_idx, kv_idx) pairs are visible; None: every pair
    score: Any  # the modified score over Var("score"); None: the score itself
    score_derivative: Any  # d score / d Var("score"); None without a modifier
    grad_sites: tuple[GradSite, ...]
    kv_segments: list | None  # see tree.segments; None: the kernel needs a block map
    q_segments: list | None
    tensors: tuple[NamedTensor, ...]  # sorted by name
    same_seqlen: bool  # a document mask indexes one id tensor by query and by key

    @property
    def block_map(self) -> bool:
        return self.kv_segments is None

    @property
    def grad_tensors(self) -> tuple[NamedTensor, ...]:
        return tuple(t for t in self.tensors if t.grad)


def _grad_sites(score, grad_names) -> tuple[GradSite, ...]:
    sites, seen = [], set()
    for n in walk(score):
        if isinstance(n, Load) and n.tensor in grad_names and n not in seen:
            seen.add(n)
            sites.append(GradSite(n.tensor, n.index, derivative(score, n)))
    return tuple(sites)


def check_size(field: str, node, what: str) -> None:
    """Refuse an expression nested deeper than MAX_DEPTH or written out with more than MAX_TERMS nodes."""
    levels = depth(node)
    if levels > MAX_DEPTH:
        raise SpecError(field, f"{what} is nested too deeply ({levels} levels; at most {MAX_DEPTH} fit in the "
                               "generated kernel: combine fewer terms)")
    terms = written_terms(node)
    if terms > MAX_TERMS:
        raise SpecError(field, f"{what} is {terms} terms long written out; at most {MAX_TERMS} fit in the "
                               "generated kernel (nest fewer functions)")


def _check_tensors(mask_tensors: dict, score_tensors: dict) -> None:
    for name, rank in score_tensors.items():
        if mask_tensors.get(name, rank) != rank:
            raise SpecError("score_mod", f"tensor {name!r} is indexed with {rank} indices here and "
                            f"{mask_tensors[name]} in the mask")
    ranks = {**mask_tensors, **score_tensors}
    owner: dict[str, str] = {}
    for name in sorted(ranks):
        for param in tensor_params(name, ranks[name]):
            other = owner.setdefault(param, name)
            if other != name:
                field = "mask" if name in mask_tensors else "score_mod"
                raise SpecError(field, f"tensor names {other!r} and {name!r} collide: the kernel would receive "
                                f"both as parameter {param!r}; rename one", name)


@lru_cache(maxsize=512)
def lower(mask: MaskNode | None, score_mod: ScoreModNode | None) -> Lowered:
    """The mask and score modifier as expressions; SpecError naming the field when they cannot be generated."""
    pred = predicate(mask) if mask is not None else None
    score = score_ir(score_mod) if score_mod is not None else None
    # depth first: the steps below recurse through the expressions
    if pred is not None:
        check_size("mask", pred, "the mask")
    if score is not None:
        check_size("score_mod", score, "the score modifier")
    if mask is not None:
        kv_segments, q_segments = segments(mask, "kv"), segments(mask, "q")
        for edge in [e for seg in (kv_segments or []) + (q_segments or []) for e in seg]:
            check_size("mask", edge, "the mask's key ranges")
    else:
        kv_segments, q_segments = full_segments("kv"), full_segments("q")
    mask_tensors = tensors_of(pred) if pred is not None else {}
    score_tensors = tensors_of(score) if score is not None else {}
    _check_tensors(mask_tensors, score_tensors)
    ranks = {**mask_tensors, **score_tensors}
    _check_roles(pred, score, ranks)
    sizes = _index_sizes([e for e in (pred, score) if e is not None], ranks)
    integer = (integer_tensors(mask) if mask is not None else set()) | _index_tensors([e for e in (pred, score)
                                                                                      if e is not None])
    tensors = tuple(NamedTensor(n, ranks[n], n in score_tensors, sizes.get(n, ()), n in integer)
                    for n in sorted(ranks))
    score_derivative, grad_sites = None, ()
    if score is not None:
        score_derivative = derivative(score, Var("score"))
        check_size("score_mod", score_derivative, "the score modifier's derivative (for the backward)")
        grad_sites = _grad_sites(score, set(score_tensors))
        for site in grad_sites:
            check_size("score_mod", site.derivative, f"the derivative for tensor {site.tensor!r}")
    return Lowered(mask, score_mod, pred, score, score_derivative, grad_sites, kv_segments, q_segments, tensors,
                   mask is not None and contains_kind(mask, "document"))
