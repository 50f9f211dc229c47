"""What every built-in mask pattern is made of, and the checks their parameters share.

A pattern (one file each, beside this one) holds its parameters with defaults, a check
of their values, its predicate (which query/key pairs are visible, as IR over ``q_idx``,
``kv_idx``, ...) and its key interval: the keys ``lo(r) <= kv < hi(r)`` that query row ``r``
sees and the rows ``qlo(c) <= r < qhi(c)`` that see key ``c``, from which a kernel computes
each block's range: tiles outside it are never loaded, tiles inside every row's interval run
without mask arithmetic. A pattern without an interval (a custom expression) gets a block map.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..errors import SpecError
from ..expr.ir import FUNCTIONS, MASK_VARS, SCORE_VARS, SIZE_VARS, Const, Var, call_argument_clash, sub
from ..expr.parse import plain_number, plain_str

ALIGNS = ("bottom_right", "top_left")
REQUIRED = object()  # a parameter without a default
# Positions are int32 in the kernel: a size up to 2**30 keeps `i + size + 1` inside int32 for
# any sequence shorter than 2**30 tokens (and is larger than every sequence a kernel runs).
MAX_EXTENT = 2**30

# The variables intervals are written over: a query row r, a key column c.
R, C = Var("r"), Var("c")
SQ, SK = Var("seqlen_q"), Var("seqlen_k")
ROWS, COLS = Var("q_idx"), Var("kv_idx")


@dataclass(frozen=True)
class Interval:
    """Keys lo(r) <= kv < hi(r) for query row r, and rows qlo(c) <= r < qhi(c) for key c.

    All four are non-decreasing, so a block of rows [r0, r1] sees keys in [lo(r0), hi(r1))
    and every row sees all of [lo(r1), hi(r0)); likewise for a block of keys.
    """

    lo: Any
    hi: Any
    qlo: Any
    qhi: Any


@dataclass(frozen=True)
class Pattern:
    """A built-in mask pattern."""

    name: str
    params: Mapping[str, Any]  # name -> default (REQUIRED: none)
    shorthand: str | None  # the parameter a bare value sets (`chunked: 7` is `chunked: {size: 7}`)
    check: Callable[[str, dict], dict]  # (field, params with defaults) -> plain params; SpecError when bad
    predicate: Callable[[dict], Any]  # params -> IR of the visible (q_idx, kv_idx) pairs
    intervals: Callable[[dict], list]  # params -> [Interval]: one per segment of keys a row sees
    # params -> the tensors whose values the key ranges compute with (a prefix length): integer or bool at a call
    integer_tensors: Callable[[dict], tuple] = lambda params: ()


def typed(params) -> tuple:
    """(name, value) pairs with each value's type beside it: MaskNode's and ScoreModNode's equality and hash. Python
    holds 3 == 3.0 (and one hash), yet an expression's parameter computes in integers or in floats by its type
    (kv_idx * 16777217 is exact, kv_idx * 16777217.0 rounds in float32): nodes equal without the types shared one
    cached kernel (a review's catch: the second spec's outputs 1.2 off)."""
    return tuple((name, type(value), value) for name, value in params)


def diagonal_offset(align: str):
    """The key index of query row 0's diagonal: seqlen_k - seqlen_q bottom-right aligned
    (flash-attn's causal convention), 0 top-left aligned."""
    return sub(SK, SQ) if align == "bottom_right" else Const(0)


# ----------------------------------------------------------------------------- parameter checks
def path(field, *keys) -> str:
    return ".".join([field, *map(str, keys)])


def check_int(field: str, value, lo: int, hi: int = MAX_EXTENT) -> int:
    """value as a plain int in [lo, hi]."""
    plain = plain_number(field, value) if isinstance(value, int) and not isinstance(value, bool) else None
    if plain is None or not lo <= plain <= hi:  # compared as a plain int: a subclass's __le__ could lie
        raise SpecError(field, f"expected an integer from {lo} to {hi}", value)
    return plain


def check_positive_number(field: str, value) -> float | int:
    """value as a plain finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(field, "expected a finite number", value)
    value = plain_number(field, value)
    if value <= 0:
        raise SpecError(field, "expected a positive number", value)
    return value


def check_bool(field: str, value) -> bool:
    if not isinstance(value, bool):
        raise SpecError(field, "expected true or false", value)
    return value


def check_align(field: str, value) -> str:
    for align in ALIGNS:
        if isinstance(value, str) and value == align:
            return align  # our own string, not the caller's object
    raise SpecError(field, "expected bottom_right or top_left", value)


def check_tensor_name(field: str, value) -> str:
    if not isinstance(value, str) or not value.isidentifier() or value.startswith("__"):
        raise SpecError(field, "expected a tensor name (an identifier)", value)
    if not value.isascii():  # Python folds some letters (NFKC): 'ｄoc' and 'doc' would be one kernel parameter
        raise SpecError(field, "expected a tensor name of ASCII letters, digits and underscores", value)
    value = plain_str(value)
    if value in MASK_VARS + SCORE_VARS + SIZE_VARS or value in FUNCTIONS:
        raise SpecError(field, "a tensor name cannot be a variable or function name", value)
    if call_argument_clash(value):
        raise SpecError(field, call_argument_clash(value), value)
    return value


def read_params(field: str, data, allowed: Mapping[str, Any], shorthand: str | None = None) -> dict:
    """A pattern's or modifier's parameter mapping with defaults filled in, keyed by our own names.

    ``None`` or ``True`` take every default; a bare value sets the shorthand parameter."""
    if shorthand and not isinstance(data, (Mapping, type(None))) and data is not True:
        data = {shorthand: data}
    if data is None or data is True:
        data = {}
    if not isinstance(data, Mapping):
        raise SpecError(field, "expected a mapping of parameters (" + ", ".join(allowed) + ")", data)
    unknown = sorted((k for k in data if k not in allowed), key=str)
    if unknown:
        raise SpecError(path(field, unknown[0]), "unknown parameter (known: " + ", ".join(allowed) + ")")
    out = {name: data.get(name, default) for name, default in allowed.items()}
    missing = [k for k, v in out.items() if v is REQUIRED]
    if missing:
        raise SpecError(path(field, missing[0]), "required parameter is missing")
    return out
