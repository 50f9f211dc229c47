"""KernelPlan: what a template renders for one spec's mask and score modifier.

The masks package lowers a spec's mask and score modifier to expressions (``masks.lower``);
this writes them as Triton: the expressions each jit helper returns and the parameters the
named tensors are threaded through; ``dialect="gluon"`` writes the mask's for the Gluon kernels
(templates/hopper/masks.j2: ``gl`` and the _hw_ helpers). Built from the spec by ``plan_for(spec)`` (cached), never
stored on it: the spec says what to compute, the plan is how this code generator writes it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from .. import masks
from ..runtime import host
from ..expr.ir import Load, Search, reads_var, walk
from ..expr.to_triton import (GLUON, GLUON_SEARCH, TRITON, numeric_floor, runs_pointer, runs_search, tensor_params,
                              tensor_size, tensor_stride, triton_expr)

# What each IR variable is called where the template uses the expression: in a tile of
# (query rows x key columns) ...
TILE_NAMES = {"b": "off_b", "h": "off_h", "q_idx": "rows", "kv_idx": "cols", "score": "score",
              "seqlen_q": "seqlen_q", "seqlen_k": "seqlen_k"}
# ... and over the edges of a block of rows [r0, r1] or of keys [c0, c1].
BLOCK_EDGE_NAMES = {"b": "off_b", "h": "off_h", "r0": "r0", "r1": "r1", "c0": "c0", "c1": "c1",
                    "seqlen_q": "seqlen_q", "seqlen_k": "seqlen_k"}
# The templates name the expression printer's dialect: the portable kernels', the Gluon kernels', and the
# Gluon kernels' without runs tables (the forward's range kernel: hopper/masks.j2's _hw_kv_segments).
DIALECTS = {"triton": TRITON, "gluon": GLUON, "gluon_search": GLUON_SEARCH}


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
        self.integer_tensors = [t.name for t in self.tensors if t.integer]
        # whether an expression divides a tensor's elements with floor semantics (common/math.j2's _nfdiv)
        self.numeric_floors = any(numeric_floor(n) for e in (self.predicate, self.score_ir, lowered.score_derivative,
                                                             *(site.derivative for site in lowered.grad_sites))
                                  if e is not None for n in walk(e))
        # whether the modified score reads a value per key from a tensor, as an additive mask does (SDPA's float
        # attn_mask, transformers' masks): _finalize (common/tiles.j2) then counts a row whose max score is below
        # -65536 as fully masked, where a fill of -1e9 left the float32 LSE without the row's scale
        self.additive_mask = self.score_ir is not None and any(
            isinstance(n, Load) and n.tensor not in self.integer_tensors and any(reads_var(i, "kv_idx") for i in n.index)
            for n in walk(self.score_ir))
        self.same_seqlen = lowered.same_seqlen
        # which block-map dimensions the mask varies over: b read by the expression, or by a search of a sorted
        # tensor, which reads row b (a tensor it indexes without b, an (L, S) mask, is one map for the batch)
        self.mask_uses_b = self.predicate is not None and (reads_var(self.predicate, "b")
                                                           or any(isinstance(n, Search) for n in walk(self.predicate)))
        self.mask_uses_h = self.predicate is not None and reads_var(self.predicate, "h")
        # the sorted tensors (document ids) whose block ranges search a row for one of its own
        # elements: the launcher fills a runs table of each per call, and a block's range reads two
        # entries of it where the kernel would run a binary search before its first loads
        self.runs_tensors = sorted({n.tensor for seg in (*self.kv_segments, *self.q_segments) for x in seg
                                    for n in walk(x) if runs_search(n)}) if not self.block_map else []

    # -- parameters threaded through every jit function that evaluates the mask or the modifier
    @property
    def tensor_params(self) -> str:
        """``, t_doc, t_doc_s0, ..., t_doc_n0, ..., runs_doc``: every named tensor's pointer, strides and
        sizes, and its runs table where it has one."""
        return "".join(", " + p for t in self.tensors for p in tensor_params(t.name, t.rank)
                       + ([runs_pointer(t.name)] if t.name in self.runs_tensors else []))

    @property
    def sequence_checks(self) -> list[tuple[str, int, str, int, str]]:
        """[(tensor, dim, its size parameter, check id, the entries it needs)]: the named tensors' dimensions
        that kv_idx (the element's keys) or a query-key distance (seqlen_q + seqlen_k - 1 of them) indexes,
        which the decode kernel checks against each element's cache length (host.NAMED_SHORT)."""
        sizes, ranks = {t.name: t.sizes for t in self.tensors}, {t.name: t.rank for t in self.tensors}
        return [(name, d, tensor_size(name, d), check, "seqlen_q + seqlen_k - 1" if distances else "seqlen_k")
                for name, d, check, distances in host.sequence_checks(sizes, ranks)]

    @property
    def runs_checks(self) -> list[tuple[str, int]]:
        """[(tensor, check id)]: the runs tensors with the id a kernel searching them records where a row's
        values decrease (host.RUNS_ORDER)."""
        return [(name, host.runs_check_id(name)) for name in self.runs_tensors]

    @property
    def grad_params(self) -> str:
        """``, g_slopes, ...``: the gradient buffer of every tensor gradients flow into."""
        return "".join(f", g_{t.name}" for t in self.grad_tensors)

    # -- expressions
    @property
    def dialect(self):
        """The portable kernels' printer, with the tensor dims the call's checks hold to seqlen_k (or 1), which a
        kv_idx index reads unclamped (to_triton._load)."""
        return dataclasses.replace(TRITON, key_dims=frozenset((t.name, d) for t in self.tensors
                                                              for d, names in enumerate(t.sizes) if "seqlen_k" in names))

    def visible_code(self, dialect: str = "triton") -> str:
        if self.predicate is None:
            return "cols < seqlen_k"
        printer = self.dialect if dialect == "triton" else DIALECTS[dialect]
        return f"(cols < seqlen_k) & ({triton_expr(self.predicate, TILE_NAMES, dialect=printer)})"

    def score_code(self) -> str:
        code = triton_expr(self.score_ir, TILE_NAMES, dialect=self.dialect)
        if not reads_var(self.score_ir, "score"):  # a constant, or a value per (b, h) or per row: the tile's shape
            code = f"({code}) + tl.zeros_like(score)"
        return code

    def score_grad_code(self) -> str:
        return triton_expr(self.lowered.score_derivative, TILE_NAMES, dialect=self.dialect)

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

    def searches(self, direction: str) -> bool:
        """Whether a block's range in ``direction`` ("kv": a row block's keys, "q": a key block's rows)
        takes searches of a sorted tensor (document ids: lookups in its runs table, or binary searches):
        the Gluon kernels then read their blocks' ranges from a table a small kernel fills first
        (hopper/masks.j2), where each program would read them before its first loads; masks whose
        ranges read a head are left to compute them in place."""
        return (self.predicate is not None and not self.block_map and not self.mask_uses_h
                and any(seg.searches for seg in self.segments(direction)))

    def segments(self, direction: str, dialect: str = "triton") -> list[SegmentEdges]:
        """The edges of each segment of a block's visible range (see masks.tree.segments) over
        the block's first and last row (``direction`` "kv": r0, r1) or key ("q": c0, c1), with
        the searches they need (common/segments.j2 writes the assignments): a search of a sorted
        tensor's own element (document ids) is a lookup in its runs table (to_triton.runs_load)."""
        lang = DIALECTS[dialect]
        searches: dict[str, str] = {}  # search expression -> the name its result is given
        out = []
        for seg in (self.kv_segments if direction == "kv" else self.q_segments):
            new: list[tuple[str, str]] = []

            def hoist(code: str) -> str:  # each distinct search (or runs lookup) once, named in order: s0, s1, ...
                if code not in searches:
                    searches[code] = f"s{len(searches)}"
                    new.append((searches[code], code))
                return searches[code]

            edges = [triton_expr(x, BLOCK_EDGE_NAMES, hoist, lang) for x in seg]
            out.append(SegmentEdges(tuple(new), *edges))
        return out


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
