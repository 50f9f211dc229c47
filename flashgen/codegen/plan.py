"""KernelPlan: what a template renders for one spec's mask and score modifier.

The masks package lowers a spec's mask and score modifier to expressions (``masks.lower``);
this writes them as Triton: the expressions each jit helper returns and the parameters the
named tensors are threaded through; ``dialect="gluon"`` writes the mask's for the Gluon kernels
(templates/hopper/masks.j2: ``gl`` and the _hw_ helpers). Built from the spec by ``plan_for(spec)`` (cached), never
stored on it: the spec says what to compute, the plan is how this code generator writes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .. import masks
from ..expr.ir import Load, Search, Var, reads_var, tensors_of, walk
from ..expr.to_triton import GLUON, TRITON, tensor_params, tensor_pointer, tensor_size, tensor_stride, triton_expr

# What each IR variable is called where the template uses the expression: in a tile of
# (query rows x key columns) ...
TILE_NAMES = {"b": "off_b", "h": "off_h", "q_idx": "rows", "kv_idx": "cols", "score": "score",
              "seqlen_q": "seqlen_q", "seqlen_k": "seqlen_k"}
# ... and over the edges of a block of rows [r0, r1] or of keys [c0, c1].
BLOCK_EDGE_NAMES = {"b": "off_b", "h": "off_h", "r0": "r0", "r1": "r1", "c0": "c0", "c1": "c1",
                    "seqlen_q": "seqlen_q", "seqlen_k": "seqlen_k"}
# A block's first and last edge, in order: r0 <= r1, c0 <= c1.
EDGE_ORDER = {"r0": 0, "r1": 1, "c0": 0, "c1": 1}
# The templates name the expression printer's dialect: the portable kernels' and the Gluon kernels'.
DIALECTS = {"triton": TRITON, "gluon": GLUON}


class KernelPlan:
    """Everything the template needs to render one mask + score modifier."""

    def __init__(self, lowered: masks.Lowered):
        self.lowered = lowered
        self.mask = lowered.mask  # MaskNode or None
        self.score_mod = lowered.score_mod  # ScoreModNode or None
        self.predicate = lowered.predicate
        self.score_ir = lowered.score
        self.kv_segments = lowered.kv_segments
        self.q_segments = lowered.q_segments
        self.block_map = lowered.block_map
        self.tensors = list(lowered.tensors)
        self.grad_tensors = list(lowered.grad_tensors)
        self.same_seqlen = lowered.same_seqlen
        # which block-map dimensions the mask varies over (a tensor is read per batch element)
        self.mask_uses_b = self.predicate is not None and (reads_var(self.predicate, "b")
                                                           or bool(tensors_of(self.predicate)))
        self.mask_uses_h = self.predicate is not None and reads_var(self.predicate, "h")

    # -- parameters threaded through every jit function that evaluates the mask or the modifier
    @property
    def tensor_params(self) -> str:
        """``, t_doc, t_doc_s0, ..., t_doc_n0, ...``: every named tensor's pointer, strides and sizes."""
        return "".join(", " + p for t in self.tensors for p in tensor_params(t.name, t.rank))

    @property
    def grad_params(self) -> str:
        """``, g_slopes, ...``: the gradient buffer of every tensor gradients flow into."""
        return "".join(f", g_{t.name}" for t in self.grad_tensors)

    # -- expressions
    def visible_code(self, dialect: str = "triton") -> str:
        if self.predicate is None:
            return "cols < seqlen_k"
        return f"(cols < seqlen_k) & ({triton_expr(self.predicate, TILE_NAMES, dialect=DIALECTS[dialect])})"

    def score_code(self) -> str:
        return triton_expr(self.score_ir, TILE_NAMES)

    def score_grad_code(self) -> str:
        return triton_expr(self.lowered.score_derivative, TILE_NAMES)

    def tensor_grad_adds(self) -> list[TensorGradAdd]:
        """What dS * d(mod)/d(element) adds into each gradient tensor the modifier reads, one
        record per place it reads one (common/mask.j2 writes the atomic adds)."""
        adds = []
        for site in self.lowered.grad_sites:
            offset = " + ".join(f"_clamp({triton_expr(i, TILE_NAMES)}, {tensor_size(site.tensor, d)}) * "
                                f"{tensor_stride(site.tensor, d)}" for d, i in enumerate(site.index))
            per_pair = any(reads_var(i, "q_idx") or reads_var(i, "kv_idx") for i in site.index)
            adds.append(TensorGradAdd(site.tensor, offset, triton_expr(site.derivative, TILE_NAMES), per_pair))
        return adds

    @property
    def masked_loads_columns(self) -> bool:
        """Whether the visibility predicate reads a named tensor per key column (document ids):
        a load in the forward's boundary-block loop that Triton's pipeliner stages through shared
        memory beside the K/V buffers (q_outer.j2 gives that loop fewer stages)."""
        return self.predicate is not None and any(
            isinstance(n, Load) and any(reads_var(i, "kv_idx") for i in n.index) for n in walk(self.predicate))

    @property
    def near_searches(self) -> bool:
        """Whether some segment edge is a _search_near (segments.j2 renders it only then)."""
        return any(code.startswith("_search_near(") for d in ("kv", "q") if not self.block_map
                   for seg in self.segments(d) for _, code in seg.searches)

    def searches(self, direction: str) -> bool:
        """Whether a block's range in ``direction`` ("kv": a row block's keys, "q": a key block's rows)
        takes binary searches (document ids): the Gluon kernels then read their blocks' ranges from a
        table a small kernel fills first (hopper/masks.j2), where each program's searches would run
        before its first loads; masks whose ranges read a head are left to compute them in place."""
        return (self.predicate is not None and not self.block_map and not self.mask_uses_h
                and any(seg.searches for seg in self.segments(direction)))

    def segments(self, direction: str, dialect: str = "triton") -> list[SegmentEdges]:
        """The edges of each segment of a block's visible range (see masks.tree.segments) over
        the block's first and last row (``direction`` "kv": r0, r1) or key ("q": c0, c1), with
        the binary searches they need (common/segments.j2 writes the assignments)."""
        lang = DIALECTS[dialect]
        searches: dict[str, str] = {}  # search expression -> the name its result is given
        edge_searches = {}  # search expression -> its Search node, where its value is the row at a block edge
        out = []
        for seg in (self.kv_segments if direction == "kv" else self.q_segments):
            for node in (n for x in seg for n in walk(x) if _edge_search(n)):
                edge_searches[triton_expr(node, BLOCK_EDGE_NAMES, dialect=lang)] = node
            new: list[tuple[str, str]] = []

            def hoist(code: str) -> str:  # each distinct search once, named in order: s0, s1, ...
                if code not in searches:
                    searches[code] = f"s{len(searches)}"
                    new.append((searches[code], _near_search(code, edge_searches, searches, lang) or code))
                return searches[code]

            edges = [triton_expr(x, BLOCK_EDGE_NAMES, hoist, lang) for x in seg]
            out.append(SegmentEdges(tuple(new), *edges))
        return out


def _edge_search(node) -> bool:
    """A search of the tensor's own element at one edge of the block: Search(T, T[b, edge])."""
    return (isinstance(node, Search) and isinstance(node.value, Load) and node.value.tensor == node.tensor
            and len(node.value.index) == 2 and isinstance(node.value.index[1], Var)
            and node.value.index[1].name in EDGE_ORDER)


def _near_search(code: str, edge_searches: dict, searches: dict, lang=TRITON) -> str | None:
    """The search `code` narrowed by one already made at the block's other edge, or None.

    In a sorted row, with positions x <= y: the searches of T[x] and T[y] agree when the two
    elements are equal; else the first index >= T[y] and the first index > T[x] both lie in
    (x, y], within the block. So of a block's two searches (the same tensor, side and batch)
    one goes over the row and the other only compares two elements (or, across a boundary,
    searches the block's span): segments.j2's _search_near."""
    node = edge_searches.get(code)
    if node is None:
        return None
    batch, edge = node.value.index
    for known_code, name in searches.items():
        known = edge_searches.get(known_code)
        if known is None or known == node or (known.tensor, known.right, known.value.index[0]) != (
                node.tensor, node.right, batch):
            continue
        other = known.value.index[1]
        # the later edge's first index >= its element; the earlier edge's first index > its element
        if EDGE_ORDER[edge.name] - EDGE_ORDER[other.name] != (-1 if node.right else 1):
            continue
        t, size, h = node.tensor, tensor_size(node.tensor, 1), lang.helper
        first, last = sorted((edge.name, other.name), key=EDGE_ORDER.get)
        base = (f"{tensor_pointer(t)} + {h}clamp({triton_expr(batch, BLOCK_EDGE_NAMES, dialect=lang)}, "
                f"{tensor_size(t, 0)}) * {tensor_stride(t, 0)}")
        value, known_value = (triton_expr(x.value, BLOCK_EDGE_NAMES, dialect=lang) for x in (node, known))
        return (f"{h}search_near({base}, {tensor_stride(t, 1)}, {value}, {known_value}, {name}, "
                f"{h}clamp({first}, {size}) + 1, "
                f"{h}clamp({last}, {size}) + 1, RIGHT={node.right})")
    return None


@dataclass(frozen=True)
class SegmentEdges:
    """One segment as Triton expressions: keys (rows) [lo, hi) are seen by some row (key) of
    the block, [full_lo, full_hi) by every one; ``searches`` are the (name, expression) pairs
    of the binary searches these edges refer to by name that no earlier segment computed."""

    searches: tuple[tuple[str, str], ...]
    lo: str
    hi: str
    full_lo: str
    full_hi: str


@dataclass(frozen=True)
class TensorGradAdd:
    """dL/d(element) += dS * ``derivative`` at the clamped element ``offset`` of gradient
    buffer ``g_<tensor>``: one element per (query, key) pair when ``per_pair``, else one per
    tile (e.g. an ALiBi slope: the tile's sum is added once)."""

    tensor: str
    offset: str
    derivative: str
    per_pair: bool


@lru_cache(maxsize=512)
def _plan(mask, score_mod) -> KernelPlan:
    return KernelPlan(masks.lower(mask, score_mod))


def plan_for(spec) -> KernelPlan:
    """The plan for an AttentionSpec (cached per mask and score modifier)."""
    return _plan(spec.mask_node, spec.score_mod)
