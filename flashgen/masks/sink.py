"""sink: causal attention to the first `tokens` keys (attention sinks, StreamingLLM) and to a
window of the last `window` keys before the diagonal. Two key segments per row."""

from __future__ import annotations

from ..expr.ir import Bin, Const, Fn, add, fmin, land, lor, sub
from .pattern import (COLS, REQUIRED, ROWS, SQ, C, Interval, Pattern, R, check_align, check_int, diagonal_offset,
                      path)
from . import sliding_window

PARAMS = {"tokens": REQUIRED, "window": REQUIRED, "align": "bottom_right"}


def check(field: str, p: dict) -> dict:
    return {"tokens": check_int(path(field, "tokens"), p["tokens"], 0),
            "window": check_int(path(field, "window"), p["window"], 0),
            "align": check_align(path(field, "align"), p["align"])}


def predicate(p: dict):
    diagonal = add(ROWS, diagonal_offset(p["align"]))
    return land(Bin("<=", COLS, diagonal),
                lor(Bin("<", COLS, Const(p["tokens"])), Bin(">=", COLS, sub(diagonal, Const(p["window"])))))


def intervals(p: dict) -> list[Interval]:
    tokens, off = p["tokens"], diagonal_offset(p["align"])
    sinks = Interval(Const(0), fmin(add(add(R, off), Const(1)), Const(tokens)),
                     Fn("where", (Bin("<", C, Const(tokens)), sub(C, off), SQ)), SQ)
    band, = sliding_window.intervals({"left": p["window"], "right": 0, "align": p["align"]})
    return [sinks, band]


PATTERN = Pattern("sink", PARAMS, None, check, predicate, intervals)
