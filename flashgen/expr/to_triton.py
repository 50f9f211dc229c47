"""IR -> Triton expression text. Only expressions: statements and loops live in the templates.

``triton_expr(node, names)`` writes one expression, with ``names`` mapping each IR variable
to the Triton name it has where the expression is used (``q_idx`` is ``rows`` in a tile).
A named tensor ``doc`` reaches a kernel as the parameters ``t_doc`` (its pointer),
``t_doc_s0, ...`` (strides) and ``t_doc_n0, ...`` (sizes): ``tensor_params`` lists them.
Numbers are written by formatting the plain value, never by a user object's ``repr``.
``dialect=GLUON`` writes the same expression for a Gluon kernel (templates/hopper/), which can
call neither ``tl`` nor common/math.j2's @triton.jit helpers: ``gl`` and their gluon.jit ports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

from .ir import COMPARE_OPS, LOGIC_OPS, Bin, Const, Fn, Load, Neg, Not, Search, Var, fold, kind

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

# The most IR nodes one generated expression may write out. Shared subexpressions are written
# each time they occur (a nested modifier's derivative repeats what it differentiates, a float
# `%` writes its operands twice), so the text can grow exponentially with the nesting.
MAX_TERMS = 4096

TRITON_FUNCTIONS = {"abs": "tl.abs", "min": "tl.minimum", "max": "tl.maximum", "exp": "tl.exp", "tanh": "_tanh",
                    "where": "tl.where", "softcap": "_softcap"}


@dataclass(frozen=True)
class Dialect:
    """The names an expression is written with: the language module (``tl``) and the prefix of the
    jit helpers it calls (``_`` for common/math.j2's _clamp, _fdiv, _fmod, _tanh, _search); ``runs``:
    whether a search of a sorted tensor's own element reads the tensor's runs table (runs_load), or
    is a binary search of the row like any other (a kernel the launcher passes no table)."""

    lang: str
    helper: str
    runs: bool = True
    # (tensor, dim) pairs held to at least seqlen_k (or 1) by the call's checks, that a kv_idx index reads unclamped
    # (_load); the plan gives them (KernelPlan.dialect), none by default
    key_dims: frozenset = frozenset()

    def function(self, name: str) -> str:
        """An IR function's name in this dialect (TRITON_FUNCTIONS written for it)."""
        triton = TRITON_FUNCTIONS[name]
        return self.lang + triton[2:] if triton.startswith("tl.") else self.helper + triton[1:]


TRITON = Dialect("tl", "_")
GLUON = Dialect("gl", "_hw_")  # templates/hopper/masks.j2 holds the _hw_ helpers
GLUON_SEARCH = Dialect("gl", "_hw_", runs=False)  # the Gluon forward's range kernel: it searches the ids itself


def tensor_pointer(tensor: str) -> str:
    return f"t_{tensor}"


def tensor_stride(tensor: str, dim: int) -> str:
    return f"t_{tensor}_s{dim}"


def tensor_size(tensor: str, dim: int) -> str:
    return f"t_{tensor}_n{dim}"


def runs_pointer(tensor: str) -> str:
    """The parameter of a sorted tensor's runs table (see runs_load)."""
    return f"runs_{tensor}"


def tensor_params(tensor: str, rank: int) -> list[str]:
    """The kernel parameters one named tensor is passed as: pointer, strides, sizes."""
    return ([tensor_pointer(tensor)] + [tensor_stride(tensor, d) for d in range(rank)]
            + [tensor_size(tensor, d) for d in range(rank)])


def triton_literal(value) -> str:
    """A plain bool, int or float as Triton source."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        if math.isnan(value):
            raise ValueError("NaN has no literal")
        if math.isinf(value):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        return float.__repr__(value)
    raise TypeError(f"not a number: {type(value).__name__}")


def _floor_in_float(node: Bin) -> bool:
    """A // or % with a float side: written with tl.floor instead of the integer helpers."""
    return kind(node) == "float" or "float" in (kind(node.a), kind(node.b))


def numeric_floor(node) -> bool:
    """A // or % of integers where a side is a named tensor's element (kind "num", its dtype the call's): written
    with common/math.j2's _nfdiv/_nfmod, which pick the float or the integer form at compile time."""
    return (isinstance(node, Bin) and node.op in ("//", "%") and not _floor_in_float(node)
            and "num" in (kind(node.a), kind(node.b)))


def written_terms(node) -> int:
    """How many IR nodes `triton_expr(node)` writes out (without hoisting)."""
    def count(n, below):
        twice = isinstance(n, Bin) and n.op == "%" and _floor_in_float(n)  # a - b * floor(a / b)
        return 1 + (2 if twice else 1) * sum(below)

    return fold(node, count)


def _load(node: Load, names, hoist, dialect: Dialect) -> str:
    """A tensor load: the element offset, sum of clamp(index_d) * stride_d. In the portable kernels, an index that
    is kv_idx itself (a tile's key columns: never negative, one apart along the tile's rows) into a dim the call's
    checks hold to seqlen_k or 1 (dialect.key_dims) is read unclamped and masked past the tensor's extent
    instead, so that a row of a tile is one vectorized load (a clamp hides the columns' contiguity from Triton,
    and each element became a load of its own: an (S, S) bf16 bias at B=4 H=16 S=2048 hd128 took 1.76 ms per
    forward on an H200, cuDNN's whole forward 0.25; session 49). What the clamp gave there is kept: a column past
    the tensor is a padding key, whose score the bounds mask drops, and a dim of size 1 (broadcast) has stride 0
    in the kernels' arguments (host.AttentionLauncher.tensor_args) and is never masked (Triton makes a size of 1
    a constant: its mask folds away). A dim also indexed otherwise (t[kv_idx] and t[0]) has no size rule and
    keeps the clamp."""
    t = node.tensor
    terms, masks = [], []
    for d, i in enumerate(node.index):
        index = triton_expr(i, names, hoist, dialect)
        if (t, d) in dialect.key_dims and isinstance(i, Var) and i.name == "kv_idx":
            terms.append(f"{index} * {tensor_stride(t, d)}")
            # (the size compared as a tile: Triton's interpreter takes (n == 1) of a plain int for no mask dtype)
            masks.append(f"(({index} < {tensor_size(t, d)}) | ({index} * 0 + {tensor_size(t, d)} == 1))")
        else:
            terms.append(f"{dialect.helper}clamp({index}, {tensor_size(t, d)}) * {tensor_stride(t, d)}")
    pointer = f"{tensor_pointer(t)} + {' + '.join(terms)}"
    if masks:
        return f"{dialect.lang}.load({pointer}, mask={' & '.join(masks)}, other=0)"
    return f"{dialect.lang}.load({pointer})"


def runs_search(node) -> bool:
    """Whether `node` searches a rank-2 tensor's row for one of the row's own elements,
    Search(T, T[b, x]): a lookup in T's runs table (runs_load)."""
    return (isinstance(node, Search) and isinstance(node.value, Load) and node.value.tensor == node.tensor
            and len(node.value.index) == 2)


def runs_load(node: Search, names, hoist, dialect: Dialect) -> str:
    """Search(T, T[b, x]) read from T's runs table, an int32 (2, n0, n1) tensor the launcher fills per
    call (host.runs_table): [0, b, x] the first index of row b holding T[b, x], [1, b, x] the
    first past it; the search's result in a nondecreasing row (both clamp b and x as the search does)."""
    t = node.tensor
    b, x = (f"{dialect.helper}clamp({triton_expr(i, names, hoist, dialect)}, {tensor_size(t, d)})"
            for d, i in enumerate(node.value.index))
    side = f"{tensor_size(t, 0)} + " if node.right else ""
    return f"{dialect.lang}.load({runs_pointer(t)} + ({side}{b}) * {tensor_size(t, 1)} + {x})"


def triton_expr(node, names: Mapping[str, str], hoist: Callable[[str], str] | None = None,
                dialect: Dialect = TRITON) -> str:
    """Triton source for an IR node. `hoist(code) -> name`, when given, turns each binary
    search into a statement of its own and the expression refers to its result by name. A
    search of a tensor's own element is read from the tensor's runs table (runs_load; the plan
    threads the table of every tensor it searches so: KernelPlan.runs_tensors), in a dialect with runs."""
    lang, helper = dialect.lang, dialect.helper

    def write(x):
        return triton_expr(x, names, hoist, dialect)

    def number(x):
        """x as an operand of arithmetic: a condition as an int32 0 or 1 (Python's True + True is 2 and -True -1;
        Triton's 1-bit integers wrap)."""
        if kind(x) != "bool":
            return write(x)
        return str(int(x.value)) if isinstance(x, Const) else f"({write(x)}).to({lang}.int32)"

    if isinstance(node, Const):
        value = node.value
        if lang == "tl" and type(value) is int and not INT32_MIN <= value <= INT32_MAX:
            # a 64-bit tensor: Triton (compiled and interpreted) casts a plain literal to the other operand's
            # int32 and fails. (The Gluon kernels serve built-in patterns only, whose extents stay within 2^30.)
            return f"tl.cast({triton_literal(value)}, tl.int64)"
        return triton_literal(value)
    if isinstance(node, Var):
        return names[node.name]
    if isinstance(node, Load):
        return _load(node, names, hoist, dialect)
    if isinstance(node, Search):
        t = node.tensor
        if dialect.runs and runs_search(node):
            code = runs_load(node, names, hoist, dialect)
            return hoist(code) if hoist else code
        code = (f"{helper}search({tensor_pointer(t)} + {helper}clamp({names['b']}, {tensor_size(t, 0)}) * "
                f"{tensor_stride(t, 0)}, {tensor_stride(t, 1)}, {tensor_size(t, 1)}, "
                f"{write(node.value)}, RIGHT={node.right})")
        return hoist(code) if hoist else code
    if isinstance(node, Not):
        return f"~({write(node.a)})"
    if isinstance(node, Neg):
        return f"-({number(node.a)})"
    if isinstance(node, Bin):
        arithmetic = node.op not in COMPARE_OPS and node.op not in LOGIC_OPS
        a, b = (number(node.a), number(node.b)) if arithmetic else (write(node.a), write(node.b))
        if node.op in ("//", "%"):
            if _floor_in_float(node):
                quotient = f"{lang}.floor(({a}) / ({b}))"
                return quotient if node.op == "//" else f"(({a}) - ({b}) * {quotient})"
            # floor semantics for either sign; with a tensor element (its dtype the call's) a helper that picks
            # the float or the integer form once the kernel's dtypes are known
            num = "n" if lang == "tl" and numeric_floor(node) else ""
            return f"{helper}{num}{'fdiv' if node.op == '//' else 'fmod'}({a}, {b})"
        if node.op == "/" and kind(node.a) == "int" and kind(node.b) == "int":
            return f"(({a}) * 1.0 / ({b}))"  # true division of integers
        return f"({a} {node.op} {b})"
    if isinstance(node, Fn):
        args = [write(x) for x in node.args]
        if node.name == "where" and kind(node.args[0]) == "num":  # a tensor element: nonzero, whatever its dtype
            args[0] = f"(({args[0]}) != 0)"
        return f"{dialect.function(node.name)}({', '.join(args)})"
    raise TypeError(node)

