"""prefix_lm: every query sees the first `prefix` keys, and causally after them. `prefix` is a
number, or the name of an int tensor of per-batch prefix lengths."""

from __future__ import annotations

from ..expr.ir import Bin, Const, Fn, Load, Var, add, fmax, lor, sub
from .pattern import (COLS, REQUIRED, ROWS, SQ, C, Interval, Pattern, R, check_align, check_int, check_tensor_name,
                      diagonal_offset, path)

PARAMS = {"prefix": REQUIRED, "align": "bottom_right"}


def check(field: str, p: dict) -> dict:
    if isinstance(p["prefix"], str):
        prefix = check_tensor_name(path(field, "prefix"), p["prefix"])
    else:
        prefix = check_int(path(field, "prefix"), p["prefix"], 0)
    return {"prefix": prefix, "align": check_align(path(field, "align"), p["align"])}


def _prefix_length(prefix):
    return Const(prefix) if isinstance(prefix, int) else Load(prefix, (Var("b"),))


def predicate(p: dict):
    off = diagonal_offset(p["align"])
    return lor(Bin("<=", COLS, add(ROWS, off)), Bin("<", COLS, _prefix_length(p["prefix"])))


def intervals(p: dict) -> list[Interval]:
    off, length = diagonal_offset(p["align"]), _prefix_length(p["prefix"])
    return [Interval(Const(0), fmax(add(add(R, off), Const(1)), length),
                     Fn("where", (Bin("<", C, length), Const(0), sub(C, off))), SQ)]


PATTERN = Pattern("prefix_lm", PARAMS, "prefix", check, predicate, intervals,
                  integer_tensors=lambda p: (p["prefix"],) if isinstance(p["prefix"], str) else ())
