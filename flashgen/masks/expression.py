"""expr: a custom mask expression (``doc[q_idx] == doc[kv_idx]``) or a Python function of
(b, h, q_idx, kv_idx). It has no key interval: kernels skip blocks with a block map computed
on the device from the predicate."""

from __future__ import annotations

from typing import Callable, Mapping

from ..errors import SpecError
from ..expr.ir import MASK_VARS, element_hint, kind
from ..expr.parse import canonical_source, expression_params, function_expression, parse_expr
from .pattern import path

CONDITION = "a mask expression must be a condition (comparison, &, |, ~)"


def check(field: str, data: Mapping) -> tuple[tuple, str]:
    """(sorted params, canonical source) of an ``{expr: ..., params: {...}}`` mapping."""
    params = expression_params(field, data.get("params"), MASK_VARS)
    node, _ = parse_expr(data["expr"], field=path(field, "expr"), variables=MASK_VARS, params=params)
    if kind(node) != "bool":
        raise SpecError(path(field, "expr"), CONDITION + element_hint(node), data["expr"])
    return tuple(sorted(params.items())), canonical_source(data["expr"])


def from_function(fn: Callable, field: str) -> tuple[tuple, str]:
    """(sorted params, canonical source) of a Python mask function."""
    node, source, params = function_expression(fn, field, MASK_VARS)
    if kind(node) != "bool":
        raise SpecError(field, "a mask function must return a condition" + element_hint(node), source)
    return params, source


def predicate(params: dict, source: str):
    return parse_expr(source, field="mask.expr", variables=MASK_VARS, params=params)[0]
