"""causal: query i sees keys j <= i + offset (offset = seqlen_k - seqlen_q bottom-right aligned,
as flash-attn; 0 top-left aligned)."""

from __future__ import annotations

from ..expr.ir import Bin, Const, add, sub
from .pattern import COLS, ROWS, SQ, C, Interval, Pattern, R, check_align, diagonal_offset, path

PARAMS = {"align": "bottom_right"}


def check(field: str, p: dict) -> dict:
    return {"align": check_align(path(field, "align"), p["align"])}


def predicate(p: dict):
    return Bin("<=", COLS, add(ROWS, diagonal_offset(p["align"])))


def intervals(p: dict) -> list[Interval]:
    off = diagonal_offset(p["align"])
    return [Interval(Const(0), add(add(R, off), Const(1)), sub(C, off), SQ)]


PATTERN = Pattern("causal", PARAMS, None, check, predicate, intervals)
