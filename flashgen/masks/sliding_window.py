"""sliding_window: query i sees keys in [p - left, p + right], p = i + offset its diagonal;
-1 leaves a side unbounded (flash-attn's window_size)."""

from __future__ import annotations

from ..expr.ir import Bin, Const, add, land, sub
from .pattern import COLS, ROWS, SK, SQ, C, Interval, Pattern, R, check_align, check_int, diagonal_offset, path

PARAMS = {"left": -1, "right": -1, "align": "bottom_right"}


def check(field: str, p: dict) -> dict:
    return {"left": check_int(path(field, "left"), p["left"], -1),
            "right": check_int(path(field, "right"), p["right"], -1),
            "align": check_align(path(field, "align"), p["align"])}


def predicate(p: dict):
    left, right = p["left"], p["right"]
    diagonal, pred = add(ROWS, diagonal_offset(p["align"])), Const(True)
    if left >= 0:
        pred = land(pred, Bin(">=", COLS, sub(diagonal, Const(left))))
    if right >= 0:
        pred = land(pred, Bin("<=", COLS, add(diagonal, Const(right))))
    return pred


def intervals(p: dict) -> list[Interval]:
    left, right = p["left"], p["right"]
    off = diagonal_offset(p["align"])
    diagonal = add(R, off)
    return [Interval(
        sub(diagonal, Const(left)) if left >= 0 else Const(0),
        add(diagonal, Const(right + 1)) if right >= 0 else SK,
        sub(sub(C, off), Const(right)) if right >= 0 else Const(0),
        add(sub(C, off), Const(left + 1)) if left >= 0 else SQ)]


PATTERN = Pattern("sliding_window", PARAMS, None, check, predicate, intervals)
