"""KernelPlan: what a template renders for one spec's mask and score modifier.

The masks package lowers a spec's mask and score modifier to expressions (``masks.lower``);
this writes them as Triton: the expressions each jit helper returns and the parameters the
named tensors are threaded through. Built from the spec by ``plan_for(spec)`` (cached), never
stored on it: the spec says what to compute, the plan is how this code generator writes it.
"""

from __future__ import annotations

from functools import lru_cache

from .. import masks
from ..expr.ir import reads_var, tensors_of
from ..expr.to_triton import ExpressionWriter, tensor_params, tensor_size, tensor_stride, triton_expr

# What each IR variable is called where the template uses the expression: in a tile of
# (query rows x key columns) ...
TILE_NAMES = {"b": "off_b", "h": "off_h", "q_idx": "rows", "kv_idx": "cols", "score": "score",
              "seqlen_q": "seqlen_q", "seqlen_k": "seqlen_k"}
# ... and over the edges of a block of rows [r0, r1] or of keys [c0, c1].
BLOCK_EDGE_NAMES = {"b": "off_b", "h": "off_h", "r0": "r0", "r1": "r1", "c0": "c0", "c1": "c1",
                    "seqlen_q": "seqlen_q", "seqlen_k": "seqlen_k"}


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
    def visible_code(self) -> str:
        if self.predicate is None:
            return "cols < seqlen_k"
        return f"(cols < seqlen_k) & ({triton_expr(self.predicate, TILE_NAMES)})"

    def score_code(self) -> str:
        return triton_expr(self.score_ir, TILE_NAMES)

    def score_grad_code(self) -> str:
        return triton_expr(self.lowered.score_derivative, TILE_NAMES)

    def tensor_grad_code(self, indent: str) -> str:
        """Statements adding dS * d(mod)/d(element) into each gradient tensor the modifier reads."""
        lines = []
        for site in self.lowered.grad_sites:
            offset = " + ".join(f"_clamp({triton_expr(i, TILE_NAMES)}, {tensor_size(site.tensor, d)}) * "
                                f"{tensor_stride(site.tensor, d)}" for d, i in enumerate(site.index))
            grad = f"tl.where(visible, ds * ({triton_expr(site.derivative, TILE_NAMES)}), 0.0)"
            if any(reads_var(i, "q_idx") or reads_var(i, "kv_idx") for i in site.index):
                # one element per (query, key): add the tile elementwise
                lines.append(f"tl.atomic_add(g_{site.tensor} + ({offset}) + zero_i, {grad}, sem=\"relaxed\")")
            else:
                # one element per tile (e.g. an ALiBi slope): reduce the tile first
                lines.append(f"tl.atomic_add(g_{site.tensor} + ({offset}), tl.sum(tl.sum({grad}, 1), 0), "
                             "sem=\"relaxed\")")
        return ("\n" + indent).join(lines) if lines else "pass"

    def segments_code(self, direction: str, indent: str) -> str:
        """Statements computing lo{i}, hi{i}, flo{i}, fhi{i} of each segment (see masks.tree.segments)."""
        segs = self.kv_segments if direction == "kv" else self.q_segments
        lines: list[str] = []
        writer = ExpressionWriter(lines, BLOCK_EDGE_NAMES)
        for i, seg in enumerate(segs):
            edges = [writer.expr(x) for x in seg]  # appends the searches they need first
            lines.append(f"lo{i}, hi{i}, flo{i}, fhi{i} = {', '.join(edges)}")
        if len(segs) == 2:
            lines.append("# the two segments in key order")
            lines.append("swap = lo1 < lo0")
            for a in ("lo", "hi", "flo", "fhi"):
                lines.append(f"{a}0, {a}1 = tl.where(swap, {a}1, {a}0), tl.where(swap, {a}0, {a}1)")
        return ("\n" + indent).join(lines)


@lru_cache(maxsize=512)
def _plan(mask, score_mod) -> KernelPlan:
    return KernelPlan(masks.lower(mask, score_mod))


def plan_for(spec) -> KernelPlan:
    """The plan for an AttentionSpec (cached per mask and score modifier)."""
    return _plan(spec.mask_node, spec.score_mod)
