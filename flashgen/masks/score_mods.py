"""Score modifiers: softcap, alibi, relative_bias and custom expressions, applied in order to
``score = q.k * softmax_scale`` before the softmax.

``parse_score_mod_steps`` reads the spec's form (one modifier, a list of them, an expression
string, a Python function of (score, b, h, q_idx, kv_idx)) into a ``ScoreModNode``, and
``score_ir`` lowers the chain to one IR expression over ``Var("score")``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..errors import SpecError
from ..expr.ir import SCORE_VARS, Bin, Const, Fn, Load, Var, add, kind, mul, sub, substitute
from ..expr.parse import canonical_source, expression_params, function_expression, parse_expr
from .pattern import (COLS, REQUIRED, ROWS, SK, check_align, check_positive_number, check_tensor_name,
                      diagonal_offset, path, read_params, typed)

# name -> (parameters with defaults, the parameter a bare value sets)
MODIFIERS = {
    "softcap": ({"cap": REQUIRED}, "cap"),
    "alibi": ({"slopes": "alibi_slopes", "align": "bottom_right"}, None),
    "relative_bias": ({"tensor": "rel_bias"}, "tensor"),
}
KINDS = (*MODIFIERS, "expr")
# relative_bias's index: q_idx - kv_idx + seqlen_k - 1, one per distance, 0 to seqlen_q + seqlen_k - 2
RELATIVE_DISTANCE = add(sub(ROWS, COLS), sub(SK, Const(1)))


@dataclass(frozen=True, eq=False)
class ScoreModNode:
    """A chain of score modifiers applied in order (softcap, alibi, relative_bias, expr)."""

    steps: tuple  # ((kind, sorted (name, plain value) params, expression source or None), ...)

    def _identity(self):
        return tuple((kind_, typed(params), expr) for kind_, params, expr in self.steps)

    def __eq__(self, other):  # (a parameter's type counts: pattern.typed)
        return type(other) is ScoreModNode and self._identity() == other._identity()

    def __hash__(self):
        return hash(self._identity())

    def to_dict(self):
        out = []
        for kind_, params, expr in self.steps:
            if kind_ == "expr":
                d = {"expr": expr}
                if params:
                    d["params"] = dict(params)
                out.append(d)
            else:
                out.append({kind_: dict(params)})
        return out[0] if len(out) == 1 else out


def _check_modifier(field: str, name: str, p: dict) -> dict:
    if name == "softcap":
        # (a float whatever it was written as: cap 30 and 30.0 are one kernel, and one spec key for tuned results)
        return {"cap": float(check_positive_number(path(field, "cap"), p["cap"]))}
    if name == "alibi":
        return {"slopes": check_tensor_name(path(field, "slopes"), p["slopes"]),
                "align": check_align(path(field, "align"), p["align"])}
    return {"tensor": check_tensor_name(path(field, "tensor"), p["tensor"])}


def _step(item, field: str) -> tuple:
    """One (kind, params, source) step from its spec form."""
    if callable(item):
        _, source, params = function_expression(item, field, SCORE_VARS)
        return ("expr", params, source)
    if isinstance(item, str):
        item = {"expr": item}
    if not isinstance(item, Mapping) or (len(item) != 1 and not ("expr" in item and set(item) <= {"expr", "params"})):
        raise SpecError(field, "expected one modifier (" + ", ".join(KINDS) + ")", item)
    if "expr" in item:
        params = expression_params(field, item.get("params"), SCORE_VARS)
        node, _ = parse_expr(item["expr"], field=path(field, "expr"), variables=SCORE_VARS, params=params)
        if kind(node) == "bool":
            raise SpecError(path(field, "expr"), "a score modifier must be a number, not a condition", item["expr"])
        return ("expr", tuple(sorted(params.items())), canonical_source(item["expr"]))
    (name, value), = item.items()
    if not isinstance(name, str) or name not in MODIFIERS:
        raise SpecError(field, "unknown score modifier (known: " + ", ".join(KINDS) + ")", name)
    name = next(n for n in MODIFIERS if n == name)  # our own string
    allowed, shorthand = MODIFIERS[name]
    p = read_params(path(field, name), value, allowed, shorthand)
    return (name, tuple(sorted(_check_modifier(path(field, name), name, p).items())), None)


def parse_score_mod_steps(data, field: str = "score_mod") -> ScoreModNode:
    """A ScoreModNode from one modifier or a non-empty list of them (applied in order)."""
    if isinstance(data, ScoreModNode):
        return data
    items = data if isinstance(data, (list, tuple)) else [data]
    if not items:
        raise SpecError(field, "expected a score modifier or a non-empty list of them", data)
    steps = []
    for i, item in enumerate(items):
        if isinstance(item, ScoreModNode):
            steps.extend(item.steps)
        else:
            steps.append(_step(item, path(field, i) if isinstance(data, (list, tuple)) else field))
    return ScoreModNode(tuple(steps))


# Caps above this take tanh's odd series where |score / cap| < 1/8: the kernels' tanh, 1 - 2 / (e^2x + 1),
# cancels to about 6e-8 of 1 there, which cap * tanh multiplies by the cap (1e3: 5e-5 off in fp32, 1e6:
# 0.06, from 1e8 every score 0). Under it (Gemma 2's 50, Grok's 30) that error stays below 4e-6, and the
# kernels keep the shorter text.
SOFTCAP_SERIES_ABOVE = 64.0


def _softcap(s, cap: float):
    if cap <= SOFTCAP_SERIES_ABOVE:
        return mul(Const(cap), Fn("tanh", (Bin("/", s, Const(cap)),)))
    return Fn("softcap", (s, Const(cap)))  # the score evaluated once (common/math.j2 _softcap)


def score_ir(node: ScoreModNode):
    """The modified score as IR over Var('score')."""
    s = Var("score")
    for kind_, params, expr in node.steps:
        p = dict(params)
        if kind_ == "softcap":
            s = _softcap(s, float(p["cap"]))
        elif kind_ == "alibi":
            # flash-attn: -slope * |i + seqlen_k - seqlen_q - j| (bottom-right aligned)
            dist = Fn("abs", (sub(add(ROWS, diagonal_offset(p["align"])), COLS),))
            s = sub(s, mul(Load(p["slopes"], (Var("b"), Var("h"))), dist))
        elif kind_ == "relative_bias":
            # bias[h, q_idx - kv_idx + seqlen_k - 1]: one value per head and distance
            s = add(s, Load(p["tensor"], (Var("h"), RELATIVE_DISTANCE)))
        else:
            ir, _ = parse_expr(expr, field="score_mod.expr", variables=SCORE_VARS, params=p)
            s = substitute(ir, {"score": s})
    return s
