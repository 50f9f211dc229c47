"""A spec's mask and score modifier lowered together to expressions, and checked as a pair.

``lower(mask, score_mod)`` is what both the kernel generator and the reference start from:
the predicate, the key/query segments (or None: a block map), the modified score and its
derivatives, and the named tensors a call passes. It refuses, naming the field, what would
only fail later: a tensor indexed with different ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..errors import SpecError
from ..expr.derivative import derivative
from ..expr.ir import Load, Var, tensors_of, walk
from .score_mods import ScoreModNode, score_ir
from .tree import MaskNode, contains_kind, full_segments, predicate, segments


@dataclass(frozen=True)
class NamedTensor:
    """A tensor the mask or score modifier reads, passed to a call by name."""

    name: str
    rank: int  # how many indices the expressions use
    grad: bool  # read by the score modifier: gradients flow into it when it is a float tensor


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


def _check_tensors(mask_tensors: dict, score_tensors: dict) -> None:
    for name, rank in score_tensors.items():
        if mask_tensors.get(name, rank) != rank:
            raise SpecError("score_mod", f"tensor {name!r} is indexed with {rank} indices here and "
                            f"{mask_tensors[name]} in the mask")


@lru_cache(maxsize=512)
def lower(mask: MaskNode | None, score_mod: ScoreModNode | None) -> Lowered:
    """The mask and score modifier as expressions; SpecError naming the field when they cannot be generated."""
    pred = predicate(mask) if mask is not None else None
    score = score_ir(score_mod) if score_mod is not None else None
    if mask is not None:
        kv_segments, q_segments = segments(mask, "kv"), segments(mask, "q")
    else:
        kv_segments, q_segments = full_segments("kv"), full_segments("q")
    mask_tensors = tensors_of(pred) if pred is not None else {}
    score_tensors = tensors_of(score) if score is not None else {}
    _check_tensors(mask_tensors, score_tensors)
    tensors = tuple(NamedTensor(n, mask_tensors.get(n, score_tensors.get(n)), n in score_tensors)
                    for n in sorted(set(mask_tensors) | set(score_tensors)))
    score_derivative, grad_sites = None, ()
    if score is not None:
        score_derivative = derivative(score, Var("score"))
        grad_sites = _grad_sites(score, set(score_tensors))
    return Lowered(mask, score_mod, pred, score, score_derivative, grad_sites, kv_segments, q_segments, tensors,
                   mask is not None and contains_kind(mask, "document"))
