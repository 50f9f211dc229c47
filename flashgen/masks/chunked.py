"""chunked: keys and queries are cut into chunks of `size` positions; a query sees keys of its
own chunk (and only those up to its diagonal when causal), as Llama 4's chunked attention."""

from __future__ import annotations

from ..expr.ir import Bin, Const, add, land, mul, sub
from .pattern import (COLS, REQUIRED, ROWS, C, Interval, Pattern, R, check_align, check_bool, check_int,
                      diagonal_offset, path)

PARAMS = {"size": REQUIRED, "causal": True, "align": "bottom_right"}


def check(field: str, p: dict) -> dict:
    return {"size": check_int(path(field, "size"), p["size"], 1),
            "causal": check_bool(path(field, "causal"), p["causal"]),
            "align": check_align(path(field, "align"), p["align"])}


def _chunk(position, size):
    return Bin("//", position, Const(size))


def predicate(p: dict):
    diagonal = add(ROWS, diagonal_offset(p["align"]))
    pred = Bin("==", _chunk(COLS, p["size"]), _chunk(diagonal, p["size"]))
    if p["causal"]:
        pred = land(pred, Bin("<=", COLS, diagonal))
    return pred


def intervals(p: dict) -> list[Interval]:
    size, off = p["size"], diagonal_offset(p["align"])
    diagonal = add(R, off)
    start = mul(_chunk(diagonal, size), Const(size))  # the row's chunk starts here
    key_chunk_start = mul(_chunk(C, size), Const(size))
    return [Interval(start, add(diagonal, Const(1)) if p["causal"] else add(start, Const(size)),
                     sub(C, off) if p["causal"] else sub(key_chunk_start, off),
                     sub(add(key_chunk_start, Const(size)), off))]


PATTERN = Pattern("chunked", PARAMS, "size", check, predicate, intervals)
