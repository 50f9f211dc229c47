"""The mask tree: built-in patterns and custom expressions combined with and / or.

``parse_mask_tree`` reads the spec's form (a pattern mapping, ``{and: [...]}``, ``{or: [...]}``,
an expression string or mapping, a Python function) into a ``MaskNode``; ``predicate``
lowers a tree to one IR condition, and ``segments`` to the key (or query) ranges a block of
rows (or keys) sees, when every leaf has an interval.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..errors import SpecError
from ..expr.ir import Const, Var, fmax, fmin, land, lor, substitute
from . import expression
from .pattern import SK, SQ, check_align, check_bool, path, read_params, typed
from .registry import PATTERNS

KINDS = (*PATTERNS, "and", "or", "expr")
# A block's keys are at most this many segments (a sink and its window); an and/or that would
# give more is widened to the hull of its segments (exact: the predicate still masks).
MAX_SEGMENTS = 2


@dataclass(frozen=True, eq=False)
class MaskNode:
    """One node of a mask: a built-in pattern, an and/or of nodes, or a custom expression."""

    kind: str  # a pattern name, "and", "or" or "expr"
    params: tuple = ()  # sorted (name, plain value) pairs
    children: tuple = ()
    expr: str | None = None  # the canonical source of a custom expression

    def _identity(self):
        return self.kind, typed(self.params), self.children, self.expr

    def __eq__(self, other):  # (a parameter's type counts: pattern.typed)
        return type(other) is MaskNode and self._identity() == other._identity()

    def __hash__(self):
        return hash(self._identity())

    @property
    def param(self) -> dict:
        return dict(self.params)

    def to_dict(self):
        if self.kind in ("and", "or"):
            return {self.kind: [c.to_dict() for c in self.children]}
        if self.kind == "expr":
            out = {"expr": self.expr}
            if self.params:
                out["params"] = dict(self.params)
            return out
        return {self.kind: dict(self.params)}


def parse_mask_tree(data, field: str = "mask") -> MaskNode:
    """A MaskNode from the spec's YAML/dict form, an expression string or a Python function."""
    if isinstance(data, MaskNode):
        return data
    if callable(data):
        params, source = expression.from_function(data, field)
        return MaskNode("expr", params, (), source)
    if isinstance(data, str):
        data = {"expr": data}
    if not isinstance(data, Mapping) or len(data) != 1 and not ("expr" in data and set(data) <= {"expr", "params"}):
        raise SpecError(field, "expected one pattern (" + ", ".join(KINDS) + ")", data)
    if "expr" in data:
        params, source = expression.check(field, data)
        return MaskNode("expr", params, (), source)
    (name, value), = data.items()
    if name in ("and", "or"):
        sub_field = path(field, name)
        if not isinstance(value, (list, tuple)) or len(value) < 1:
            raise SpecError(sub_field, "expected a list of masks", value)
        children = tuple(parse_mask_tree(v, path(sub_field, i)) for i, v in enumerate(value))
        return children[0] if len(children) == 1 else MaskNode("and" if name == "and" else "or", (), children)
    pattern = PATTERNS.get(name) if isinstance(name, str) else None
    if pattern is None:
        raise SpecError(field, "unknown mask pattern (known: " + ", ".join(KINDS) + ")", name)
    sub_field = path(field, pattern.name)
    p = read_params(sub_field, value, pattern.params, pattern.shorthand)
    # the checks every pattern shares come first, then the pattern's own
    if "align" in p:
        check_align(path(sub_field, "align"), p["align"])
    if "causal" in p:
        check_bool(path(sub_field, "causal"), p["causal"])
    return MaskNode(pattern.name, tuple(sorted(pattern.check(sub_field, p).items())))


# At most this many patterns written out (an and/or may hold one node many times: `m = m & m` doubles it): each
# writes at least one term of the kernel's mask, of which expr.to_triton's MAX_TERMS fit
MAX_PATTERNS = 4096


def check_written_size(node: MaskNode, field: str = "mask") -> None:
    """Refuse a mask tree of more than MAX_PATTERNS patterns written out, counted without writing it out (a
    tree of 40 doublings holds 2**40), before anything walks it."""
    counts: dict[int, int] = {}

    def patterns(n):
        count = counts.get(id(n))
        if count is None:
            count = counts[id(n)] = sum(map(patterns, n.children)) if n.kind in ("and", "or") else 1
        return count

    total = patterns(node)
    if total > MAX_PATTERNS:
        raise SpecError(field, f"the mask is {total} patterns long written out; at most {MAX_PATTERNS} fit in the "
                               "generated kernel")


# flash-attn's causal mask, the spec's `causal: true` (spec.AttentionSpec.mask_node)
CAUSAL = MaskNode("causal", (("align", "bottom_right"),))


def split_causal(node: MaskNode) -> tuple[bool, MaskNode | None]:
    """(whether node requires CAUSAL, node without it): CAUSAL alone, or among the conjuncts of a top-level and,
    nested ands included (`causal & a & b` is and(and(causal, a), b)). A spec stores such a mask as
    `causal: true` and the rest, so that either spelling gets one key, one kernel and the unmasked causal path's
    defaults. CAUSAL is taken out where it stands and an and left with one child becomes that child, so the rest
    keeps the nesting the other spelling writes (`causal: true` with `a & b`); a mask without CAUSAL among its
    conjuncts comes back as it is."""
    if node == CAUSAL:
        return True, None
    if node.kind != "and":
        return False, node
    found, kept = False, []
    for child in node.children:
        causal, rest = split_causal(child)
        found = found or causal
        if rest is not None:
            kept.append(rest)
    if not found:
        return False, node
    return True, (None if not kept else kept[0] if len(kept) == 1 else MaskNode("and", (), tuple(kept)))


def _leaf_predicate(node: MaskNode):
    if node.kind == "expr":
        return expression.predicate(node.param, node.expr)
    return PATTERNS[node.kind].predicate(node.param)


def predicate(node: MaskNode):
    """The whole tree as one IR condition on (b, h, q_idx, kv_idx)."""
    if node.kind in ("and", "or"):
        preds = [predicate(c) for c in node.children]
        out = preds[0]
        for p in preds[1:]:
            out = land(out, p) if node.kind == "and" else lor(out, p)
        return out
    return _leaf_predicate(node)


def segments(node: MaskNode, direction: str):
    """Per block, the ranges it sees, as (lo, hi, flo, fhi) IR tuples over its edges.

    direction "kv": a block of query rows [r0, r1] sees keys [lo, hi), and every one of its
    rows sees all of [flo, fhi); direction "q": a block of keys [c0, c1] likewise in query
    rows. None when some leaf (a custom expression) has no interval: it needs a block map."""
    if node.kind in ("and", "or"):
        parts = [segments(c, direction) for c in node.children]
        if any(s is None for s in parts):
            return None
        if node.kind == "and":
            out = parts[0]
            for seg in parts[1:]:
                if len(out) * len(seg) > MAX_SEGMENTS:
                    seg = [hull(seg)] if len(seg) > 1 else seg
                    out = [hull(out)] if len(out) * len(seg) > MAX_SEGMENTS else out
                out = [tuple(f(a, b) for f, a, b in zip((fmax, fmin, fmax, fmin), s, t)) for s in out for t in seg]
            return out
        out = [s for part in parts for s in part]
        return out if len(out) <= MAX_SEGMENTS else [hull(out)]
    if node.kind == "expr":
        return None
    out = []
    for iv in PATTERNS[node.kind].intervals(node.param):
        if direction == "kv":
            first, last, lo, hi, v = Var("r0"), Var("r1"), iv.lo, iv.hi, "r"
        else:
            first, last, lo, hi, v = Var("c0"), Var("c1"), iv.qlo, iv.qhi, "c"
        # the block sees [lo(first), hi(last)); all its members see [lo(last), hi(first))
        out.append((substitute(lo, {v: first}), substitute(hi, {v: last}),
                    substitute(lo, {v: last}), substitute(hi, {v: first})))
    return out


def full_segments(direction: str):
    """The one segment of an unmasked kernel: every key (or query row)."""
    n = SK if direction == "kv" else SQ
    return [(Const(0), n, Const(0), n)]


def hull(segs):
    """One segment covering all of segs (its fully-seen range: the first one's)."""
    lo, hi = segs[0][0], segs[0][1]
    for s in segs[1:]:
        lo, hi = fmin(lo, s[0]), fmax(hi, s[1])
    return (lo, hi, segs[0][2], segs[0][3])


def contains_kind(node: MaskNode, kind: str) -> bool:
    return node.kind == kind or any(contains_kind(c, kind) for c in node.children)


def integer_tensors(node: MaskNode) -> set:
    """The tensors the mask's patterns compute key ranges with (Pattern.integer_tensors)."""
    own = set(PATTERNS[node.kind].integer_tensors(node.param)) if node.kind in PATTERNS else set()
    return own.union(*(integer_tensors(c) for c in node.children))
