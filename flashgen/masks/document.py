"""document: packed documents; a query sees keys of its own document (causally by default).
`ids` names an int tensor (batch, seqlen) or (seqlen,) of nondecreasing document ids."""

from __future__ import annotations

from ..expr.ir import Bin, Const, Load, Search, Var, add, land
from .pattern import COLS, ROWS, C, Interval, Pattern, R, check_bool, check_tensor_name, path

PARAMS = {"ids": "document_ids", "causal": True}


def check(field: str, p: dict) -> dict:
    return {"ids": check_tensor_name(path(field, "ids"), p["ids"]),
            "causal": check_bool(path(field, "causal"), p["causal"])}


def predicate(p: dict):
    ids = p["ids"]
    pred = Bin("==", Load(ids, (Var("b"), ROWS)), Load(ids, (Var("b"), COLS)))
    if p["causal"]:
        pred = land(pred, Bin("<=", COLS, ROWS))
    return pred


def intervals(p: dict) -> list[Interval]:
    # a document's first and one-past-last position, found by binary search in the sorted ids
    ids, causal = p["ids"], p["causal"]
    row_doc, col_doc = Load(ids, (Var("b"), R)), Load(ids, (Var("b"), C))
    lo = Search(ids, row_doc, False)
    hi = add(R, Const(1)) if causal else Search(ids, row_doc, True)
    qlo = C if causal else Search(ids, col_doc, False)
    qhi = Search(ids, col_doc, True)
    return [Interval(lo, hi, qlo, qhi)]


PATTERN = Pattern("document", PARAMS, None, check, predicate, intervals)
