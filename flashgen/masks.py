"""Mask patterns, score modifiers and custom expressions, lowered to Triton and to PyTorch.

A spec's ``mask`` and ``score_mod`` become one small expression language:

* variables ``b``, ``h``, ``q_idx``, ``kv_idx`` (and ``score`` in a score modifier),
  ``seqlen_q`` and ``seqlen_k``;
* integer or float parameters, named in the spec and substituted as constants;
* named input tensors indexed by expressions (``doc[q_idx]``), passed at call time;
* arithmetic, comparisons, ``&``, ``|``, ``~``, and ``where``, ``abs``, ``min``, ``max``,
  ``exp``, ``tanh``.

Semantics are FlexAttention's ``mask_mod`` / ``score_mod``: ``//`` and ``%`` floor,
``score`` is q.k * softmax_scale. Tensor indices are clamped into range.

Built-in patterns are written in that language too, so the kernel and the PyTorch
reference share one definition, and each also gives the interval of keys every query
row sees, ``lo(row) <= kv < hi(row)`` (and its inverse for a key column), from which
the kernel computes each block's range inside the kernel: tiles outside it are never
loaded and tiles inside every row's interval run without mask arithmetic. A custom
expression has no such interval; it gets a block map computed on the device.

Expressions are parsed with ``ast`` and checked node by node against a whitelist;
nothing reaches ``eval`` or ``exec``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .errors import SpecError

MASK_VARS = ("b", "h", "q_idx", "kv_idx")
SCORE_VARS = ("score", "b", "h", "q_idx", "kv_idx")
SIZE_VARS = ("seqlen_q", "seqlen_k")
FUNCTIONS = {"where": 3, "abs": 1, "min": 2, "max": 2, "exp": 1, "tanh": 1}
ALIGNS = ("bottom_right", "top_left")


# ----------------------------------------------------------------------------- IR
@dataclass(frozen=True)
class Const:
    value: Any


@dataclass(frozen=True)
class Var:
    name: str


@dataclass(frozen=True)
class Load:
    tensor: str
    index: tuple


@dataclass(frozen=True)
class Bin:
    op: str
    a: Any
    b: Any


@dataclass(frozen=True)
class Not:
    a: Any


@dataclass(frozen=True)
class Neg:
    a: Any


@dataclass(frozen=True)
class Fn:
    name: str
    args: tuple


@dataclass(frozen=True)
class Search:
    """First index i of tensor[b, :] with tensor[b, i] >= value (> value if right). Sorted rows only."""

    tensor: str
    value: Any
    right: bool


_COMPARE = {"<", "<=", ">", ">=", "==", "!="}
_ARITH = {"+", "-", "*", "/", "//", "%"}
_LOGIC = {"&", "|"}


def _const_value(node):
    return node.value if isinstance(node, Const) else None


def add(a, b):
    if _const_value(a) == 0:
        return b
    if _const_value(b) == 0:
        return a
    return Bin("+", a, b)


def sub(a, b):
    return a if _const_value(b) == 0 else Bin("-", a, b)


def mul(a, b):
    if _const_value(a) == 1:
        return b
    if _const_value(b) == 1:
        return a
    if _const_value(a) == 0 or _const_value(b) == 0:
        return Const(0)
    return Bin("*", a, b)


def fmin(a, b):
    return Fn("min", (a, b))


def fmax(a, b):
    return Fn("max", (a, b))


def land(a, b):
    if _const_value(a) is True:
        return b
    if _const_value(b) is True:
        return a
    return Bin("&", a, b)


def lor(a, b):
    return Bin("|", a, b)


def substitute(node, env: Mapping[str, Any]):
    """The node with variables replaced by the nodes in env."""
    if isinstance(node, Var):
        return env.get(node.name, node)
    if isinstance(node, Const):
        return node
    if isinstance(node, Load):
        return Load(node.tensor, tuple(substitute(i, env) for i in node.index))
    if isinstance(node, Bin):
        return Bin(node.op, substitute(node.a, env), substitute(node.b, env))
    if isinstance(node, Not):
        return Not(substitute(node.a, env))
    if isinstance(node, Neg):
        return Neg(substitute(node.a, env))
    if isinstance(node, Fn):
        return Fn(node.name, tuple(substitute(a, env) for a in node.args))
    if isinstance(node, Search):
        return Search(node.tensor, substitute(node.value, env), node.right)
    raise TypeError(node)


def walk(node):
    yield node
    children = ()
    if isinstance(node, Load):
        children = node.index
    elif isinstance(node, Bin):
        children = (node.a, node.b)
    elif isinstance(node, (Not, Neg)):
        children = (node.a,)
    elif isinstance(node, Fn):
        children = node.args
    elif isinstance(node, Search):
        children = (node.value,)
    for c in children:
        yield from walk(c)


def kind(node) -> str:
    """'bool', 'int' or 'float' ('num' for a tensor element, whose dtype comes at call time)."""
    if isinstance(node, Const):
        return "bool" if isinstance(node.value, bool) else "int" if isinstance(node.value, int) else "float"
    if isinstance(node, Var):
        return "float" if node.name == "score" else "int"
    if isinstance(node, (Load,)):
        return "num"
    if isinstance(node, Search):
        return "int"
    if isinstance(node, Not):
        return "bool"
    if isinstance(node, Neg):
        return kind(node.a)
    if isinstance(node, Bin):
        if node.op in _COMPARE:
            return "bool"
        ka, kb = kind(node.a), kind(node.b)
        if node.op in _LOGIC:
            return "bool" if ka == kb == "bool" else "int"
        if node.op == "/" or "float" in (ka, kb):
            return "float"
        return "num" if "num" in (ka, kb) else "int"
    if isinstance(node, Fn):
        if node.name in ("exp", "tanh"):
            return "float"
        ks = [kind(a) for a in (node.args[1:] if node.name == "where" else node.args)]
        return "float" if "float" in ks else "num" if "num" in ks else ks[0]
    raise TypeError(node)


# ----------------------------------------------------------------------------- parsing
class _Checker:
    """ast -> IR, refusing anything outside the whitelist with the offending source."""

    def __init__(self, source: str, field: str, variables, params: Mapping[str, Any], arg_names=None):
        self.source = source
        self.field = field
        self.variables = set(variables) | set(SIZE_VARS)
        self.params = dict(params)
        self.rename = dict(arg_names or {})
        self.tensors: dict[str, int] = {}

    def fail(self, node, message):
        seg = ast.get_source_segment(self.source, node) if hasattr(node, "lineno") else None
        where = f" at column {node.col_offset + 1}" if hasattr(node, "col_offset") else ""
        raise SpecError(self.field, f"{message}{where}: `{seg}`" if seg else message, self.source)

    def name(self, node):
        name = self.rename.get(node.id, node.id)
        if name.startswith("__"):
            self.fail(node, "dunder names are not allowed")
        if name in self.variables:
            return Var(name)
        if name in self.params:
            value = self.params[name]
            return Const(value)
        if name in ("True", "False"):
            return Const(name == "True")
        hint = "variables: " + ", ".join(sorted(self.variables))
        if self.params:
            hint += "; params: " + ", ".join(sorted(self.params))
        self.fail(node, f"unknown name {name!r} ({hint}; tensors must be indexed, e.g. doc[q_idx])")

    def visit(self, node):
        if isinstance(node, ast.Expression):
            return self.visit(node.body)
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or isinstance(node.value, (int, float)):
                if isinstance(node.value, float) and not math.isfinite(node.value):
                    return Const(node.value)
                return Const(node.value)
            self.fail(node, f"only numbers and True/False are allowed as constants, not {type(node.value).__name__}")
        if isinstance(node, ast.Name):
            return self.name(node)
        if isinstance(node, ast.BinOp):
            ops = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
                   ast.BitAnd: "&", ast.BitOr: "|"}
            op = ops.get(type(node.op))
            if op is None:
                self.fail(node, f"operator {type(node.op).__name__} is not allowed")
            return Bin(op, self.visit(node.left), self.visit(node.right))
        if isinstance(node, ast.UnaryOp):
            if isinstance(node.op, ast.USub):
                return Neg(self.visit(node.operand))
            if isinstance(node.op, ast.UAdd):
                return self.visit(node.operand)
            if isinstance(node.op, ast.Invert):
                inner = self.visit(node.operand)
                if kind(inner) != "bool":
                    self.fail(node, "~ negates a condition (a comparison, & or |)")
                return Not(inner)
            self.fail(node, "`not` is not allowed (use ~ on a condition)")
        if isinstance(node, ast.Compare):
            ops = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
            out, left = None, self.visit(node.left)
            for op, comp in zip(node.ops, node.comparators):
                if type(op) not in ops:
                    self.fail(node, f"comparison {type(op).__name__} is not allowed")
                right = self.visit(comp)
                term = Bin(ops[type(op)], left, right)
                out = term if out is None else Bin("&", out, term)
                left = right
            return out
        if isinstance(node, ast.BoolOp):
            self.fail(node, "`and`/`or` are not allowed (use & and | with parentheses)")
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name):
                if isinstance(node.func, ast.Attribute):
                    self.fail(node, f"attribute access is not allowed (write {node.func.attr}(...), "
                                    "not a module function)")
                self.fail(node, "only calls of whitelisted functions are allowed")
            fname = node.func.id
            if fname not in FUNCTIONS:
                self.fail(node, f"function {fname!r} is not allowed (allowed: {', '.join(FUNCTIONS)})")
            if node.keywords or len(node.args) != FUNCTIONS[fname]:
                self.fail(node, f"{fname} takes {FUNCTIONS[fname]} positional argument(s)")
            return Fn(fname, tuple(self.visit(a) for a in node.args))
        if isinstance(node, ast.Subscript):
            if not isinstance(node.value, ast.Name):
                self.fail(node, "only named tensors can be indexed")
            tname = self.rename.get(node.value.id, node.value.id)
            if tname.startswith("__"):
                self.fail(node, "dunder names are not allowed")
            if tname in self.variables or tname in self.params or tname in FUNCTIONS:
                self.fail(node, f"{tname!r} is not a tensor")
            if not tname.isidentifier():
                self.fail(node, "bad tensor name")
            sl = node.slice
            items = sl.elts if isinstance(sl, ast.Tuple) else [sl]
            for item in items:
                if isinstance(item, (ast.Slice, ast.Starred)):
                    self.fail(node, "slices are not allowed; index with one expression per dimension")
            index = tuple(self.visit(i) for i in items)
            for i in index:
                if kind(i) not in ("int", "num"):
                    self.fail(node, "tensor indices must be integers")
            rank = self.tensors.setdefault(tname, len(index))
            if rank != len(index):
                self.fail(node, f"tensor {tname!r} is indexed with {len(index)} and {rank} indices")
            return Load(tname, index)
        if isinstance(node, ast.IfExp):
            self.fail(node, "`x if c else y` is not allowed (use where(c, x, y))")
        if isinstance(node, ast.Attribute):
            self.fail(node, "attribute access is not allowed")
        if isinstance(node, ast.Lambda):
            self.fail(node, "lambda is not allowed inside an expression")
        self.fail(node, f"{type(node).__name__} is not allowed")


def parse_expr(source: str, *, field: str, variables, params: Mapping[str, Any] | None = None,
               arg_names: Mapping[str, str] | None = None):
    """Check and lower one expression; returns (IR, {tensor name: rank})."""
    if not isinstance(source, str) or not source.strip():
        raise SpecError(field, "expected a non-empty expression string", source)
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError as err:
        raise SpecError(field, f"not a valid expression ({err.msg}, column {err.offset})", source) from None
    checker = _Checker(source.strip(), field, variables, params or {}, arg_names)
    return checker.visit(tree), checker.tensors


def function_source(fn: Callable, field: str, variables) -> tuple[str, dict, dict]:
    """The return expression of a one-line Python mask/score function, its argument renaming and constants."""
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        raise SpecError(field, "cannot read the source of this function (define it in a file)", fn) from None
    tree = ast.parse(src)
    target = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.Lambda)) and (
                not isinstance(node, ast.FunctionDef) or node.name == fn.__name__):
            target = node
            break
    if target is None:
        raise SpecError(field, "cannot find the function's definition in its source", fn)
    args = [a.arg for a in target.args.args]
    if len(args) != len(variables):
        raise SpecError(field, f"expected a function of ({', '.join(variables)}), got ({', '.join(args)})", fn)
    if isinstance(target, ast.Lambda):
        body = target.body
    else:
        stmts = [s for s in target.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        if len(stmts) != 1 or not isinstance(stmts[0], ast.Return) or stmts[0].value is None:
            raise SpecError(field, "the function body must be a single `return <expression>`", fn)
        body = stmts[0].value
    expr = ast.unparse(body)
    rename = {a: v for a, v in zip(args, variables) if a != v}
    consts = {}
    closure = inspect.getclosurevars(fn)
    for scope in (closure.globals, closure.nonlocals):
        for name, value in scope.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and name not in args:
                consts[name] = value
    return expr, rename, consts


# ----------------------------------------------------------------------------- patterns
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


R, C = Var("r"), Var("c")
SQ, SK = Var("seqlen_q"), Var("seqlen_k")
ROWS, COLS = Var("q_idx"), Var("kv_idx")


def _fdiv(a, n):
    return Bin("//", a, Const(n))


def _offset(align):
    return sub(SK, SQ) if align == "bottom_right" else Const(0)


def _causal(align):
    off = _offset(align)
    return (Bin("<=", COLS, add(ROWS, off)),
            [Interval(Const(0), add(add(R, off), Const(1)), sub(C, off), SQ)])


def _window(left, right, align):
    off = _offset(align)
    p, pred = add(ROWS, off), Const(True)
    if left >= 0:
        pred = land(pred, Bin(">=", COLS, sub(p, Const(left))))
    if right >= 0:
        pred = land(pred, Bin("<=", COLS, add(p, Const(right))))
    pr = add(R, off)
    return pred, [Interval(
        sub(pr, Const(left)) if left >= 0 else Const(0),
        add(pr, Const(right + 1)) if right >= 0 else SK,
        sub(sub(C, off), Const(right)) if right >= 0 else Const(0),
        add(sub(C, off), Const(left + 1)) if left >= 0 else SQ)]


def _chunked(size, causal, align):
    off = _offset(align)
    p = add(ROWS, off)
    pred = Bin("==", _fdiv(COLS, size), _fdiv(p, size))
    if causal:
        pred = land(pred, Bin("<=", COLS, p))
    pr = add(R, off)
    start = mul(_fdiv(pr, size), Const(size))
    cstart = mul(_fdiv(C, size), Const(size))
    return pred, [Interval(start, add(pr, Const(1)) if causal else add(start, Const(size)),
                           sub(C, off) if causal else sub(cstart, off), sub(add(cstart, Const(size)), off))]


def _prefix(prefix, align):
    off = _offset(align)
    plen = Const(prefix) if isinstance(prefix, int) else Load(prefix, (Var("b"),))
    pred = lor(Bin("<=", COLS, add(ROWS, off)), Bin("<", COLS, plen))
    return pred, [Interval(Const(0), fmax(add(add(R, off), Const(1)), plen),
                           Fn("where", (Bin("<", C, plen), Const(0), sub(C, off))), SQ)]


def _document(ids, causal):
    pred = Bin("==", Load(ids, (Var("b"), ROWS)), Load(ids, (Var("b"), COLS)))
    if causal:
        pred = land(pred, Bin("<=", COLS, ROWS))
    lo = Search(ids, Load(ids, (Var("b"), R)), False)
    hi = add(R, Const(1)) if causal else Search(ids, Load(ids, (Var("b"), R)), True)
    qlo = C if causal else Search(ids, Load(ids, (Var("b"), C)), False)
    qhi = Search(ids, Load(ids, (Var("b"), C)), True)
    return pred, [Interval(lo, hi, qlo, qhi)]


def _sink(tokens, window, align):
    off = _offset(align)
    p = add(ROWS, off)
    pred = land(Bin("<=", COLS, p), lor(Bin("<", COLS, Const(tokens)), Bin(">=", COLS, sub(p, Const(window)))))
    pr = add(R, off)
    sink = Interval(Const(0), fmin(add(pr, Const(1)), Const(tokens)),
                    Fn("where", (Bin("<", C, Const(tokens)), sub(C, off), SQ)), SQ)
    _, (band,) = _window(window, 0, align)
    return pred, [sink, band]


# ----------------------------------------------------------------------------- the mask tree
def _path(field, *keys):
    return ".".join([field, *map(str, keys)])


def _int(field, value, lo, hi=None):
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"from {lo} to {hi}"
        raise SpecError(field, f"expected an integer {rng}", value)
    return value


def _num(field, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecError(field, "expected a finite number", value)
    return value


def _tensor_name(field, value):
    if not isinstance(value, str) or not value.isidentifier() or value.startswith("__"):
        raise SpecError(field, "expected a tensor name (an identifier)", value)
    if value in MASK_VARS + SCORE_VARS + SIZE_VARS or value in FUNCTIONS:
        raise SpecError(field, "a tensor name cannot be a variable or function name", value)
    return value


def _expr_params(field, params, variables) -> dict:
    """An expression's `params:` mapping: names that are not variables, to finite numbers."""
    params = params or {}
    if not isinstance(params, Mapping):
        raise SpecError(_path(field, "params"), "expected a mapping of names to numbers", params)
    for k, v in params.items():
        if not isinstance(k, str) or not k.isidentifier() or k in tuple(variables) + SIZE_VARS:
            raise SpecError(_path(field, "params"), "expected parameter names that are not variables", k)
        _num(_path(field, "params", k), v)
    return dict(params)


def _params(field, data, allowed: dict):
    """Validate a pattern's parameter mapping against {name: default}; returns the full dict."""
    if data is None or data is True:
        data = {}
    if not isinstance(data, Mapping):
        raise SpecError(field, "expected a mapping of parameters (" + ", ".join(allowed) + ")", data)
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise SpecError(_path(field, unknown[0]), "unknown parameter (known: " + ", ".join(allowed) + ")")
    out = dict(allowed)
    out.update(data)
    missing = [k for k, v in out.items() if v is dataclasses.MISSING]
    if missing:
        raise SpecError(_path(field, missing[0]), "required parameter is missing")
    return out


_REQ = dataclasses.MISSING
# name -> (parameters with defaults, the parameter a scalar shorthand sets)
PATTERNS = {
    "causal": ({"align": "bottom_right"}, None),
    "sliding_window": ({"left": -1, "right": -1, "align": "bottom_right"}, None),
    "chunked": ({"size": _REQ, "causal": True, "align": "bottom_right"}, "size"),
    "prefix_lm": ({"prefix": _REQ, "align": "bottom_right"}, "prefix"),
    "document": ({"ids": "document_ids", "causal": True}, None),
    "sink": ({"tokens": _REQ, "window": _REQ, "align": "bottom_right"}, None),
}
SCORE_MODS = {
    "softcap": ({"cap": _REQ}, "cap"),
    "alibi": ({"slopes": "alibi_slopes", "align": "bottom_right"}, None),
    "relative_bias": ({"tensor": "rel_bias"}, "tensor"),
}


@dataclass(frozen=True)
class MaskNode:
    """One node of a mask: a built-in pattern, an and/or of nodes, or a custom expression."""

    kind: str  # a pattern name, "and", "or" or "expr"
    params: tuple = ()  # sorted (name, value) pairs
    children: tuple = ()
    expr: str | None = None  # the canonical source of a custom expression

    @property
    def param(self) -> dict:
        return dict(self.params)

    def to_dict(self):
        if self.kind in ("and", "or"):
            return {self.kind: [c.to_dict() for c in self.children]}
        if self.kind == "expr":
            out = {"expr": self.expr}
            if self.params:
                out["params"] = dict(self.params)
            return out
        return {self.kind: dict(self.params)}


def _ast_canonical(source: str) -> str:
    return ast.unparse(ast.parse(source.strip(), mode="eval"))


def parse_mask(data, field: str = "mask") -> MaskNode:
    """A MaskNode from the spec's YAML/dict form, a string expression, a Mask or a function."""
    if isinstance(data, Mask):
        return data.node
    if isinstance(data, MaskNode):
        return data
    if callable(data):
        return Mask.from_function(data).node
    if isinstance(data, str):
        data = {"expr": data}
    if not isinstance(data, Mapping) or len(data) != 1 and not ("expr" in data and set(data) <= {"expr", "params"}):
        raise SpecError(field, "expected one pattern (" + ", ".join([*PATTERNS, "and", "or", "expr"]) + ")", data)
    if "expr" in data:
        params = _expr_params(field, data.get("params"), MASK_VARS)
        node, _ = parse_expr(data["expr"], field=_path(field, "expr"), variables=MASK_VARS, params=params)
        if kind(node) != "bool":
            raise SpecError(_path(field, "expr"), "a mask expression must be a condition (comparison, &, |, ~)",
                            data["expr"])
        return MaskNode("expr", tuple(sorted(params.items())), (), _ast_canonical(data["expr"]))
    (name, value), = data.items()
    sub_field = _path(field, name)
    if name in ("and", "or"):
        if not isinstance(value, (list, tuple)) or len(value) < 1:
            raise SpecError(sub_field, "expected a list of masks", value)
        children = tuple(parse_mask(v, _path(sub_field, i)) for i, v in enumerate(value))
        return children[0] if len(children) == 1 else MaskNode(name, (), children)
    if name not in PATTERNS:
        raise SpecError(field, "unknown mask pattern (known: " + ", ".join([*PATTERNS, "and", "or", "expr"]) + ")",
                        name)
    allowed, shorthand = PATTERNS[name]
    if shorthand and not isinstance(value, (Mapping, type(None))) and value is not True:
        value = {shorthand: value}
    p = _params(sub_field, value, allowed)
    if "align" in p and p["align"] not in ALIGNS:
        raise SpecError(_path(sub_field, "align"), "expected bottom_right or top_left", p["align"])
    for key in ("causal",):
        if key in p and not isinstance(p[key], bool):
            raise SpecError(_path(sub_field, key), "expected true or false", p[key])
    if name == "sliding_window":
        _int(_path(sub_field, "left"), p["left"], -1)
        _int(_path(sub_field, "right"), p["right"], -1)
    elif name == "chunked":
        _int(_path(sub_field, "size"), p["size"], 1)
    elif name == "prefix_lm":
        if not isinstance(p["prefix"], str):
            _int(_path(sub_field, "prefix"), p["prefix"], 0)
        else:
            _tensor_name(_path(sub_field, "prefix"), p["prefix"])
    elif name == "document":
        _tensor_name(_path(sub_field, "ids"), p["ids"])
    elif name == "sink":
        _int(_path(sub_field, "tokens"), p["tokens"], 0)
        _int(_path(sub_field, "window"), p["window"], 0)
    return MaskNode(name, tuple(sorted(p.items())))


def _lower(node: MaskNode):
    """(predicate IR, list of Intervals or None when only a block map can skip)."""
    p = node.param
    if node.kind == "causal":
        return _causal(p["align"])
    if node.kind == "sliding_window":
        return _window(p["left"], p["right"], p["align"])
    if node.kind == "chunked":
        return _chunked(p["size"], p["causal"], p["align"])
    if node.kind == "prefix_lm":
        return _prefix(p["prefix"], p["align"])
    if node.kind == "document":
        return _document(p["ids"], p["causal"])
    if node.kind == "sink":
        return _sink(p["tokens"], p["window"], p["align"])
    if node.kind == "expr":
        ir, _ = parse_expr(node.expr, field="mask.expr", variables=MASK_VARS, params=p)
        return ir, None
    raise AssertionError(node.kind)


MAX_SEGMENTS = 2


def _segments(node: MaskNode, direction: str):
    """Raw (lo, hi, flo, fhi) IR tuples over block edges (r0, r1) or (c0, c1); None: needs a block map."""
    if node.kind in ("and", "or"):
        parts = [_segments(c, direction) for c in node.children]
        if any(s is None for s in parts):
            return None
        if node.kind == "and":
            out = parts[0]
            for seg in parts[1:]:
                if len(out) * len(seg) > MAX_SEGMENTS:
                    seg = [_hull(seg)] if len(seg) > 1 else seg
                    out = [_hull(out)] if len(out) * len(seg) > MAX_SEGMENTS else out
                out = [tuple(f(a, b) for f, a, b in zip((fmax, fmin, fmax, fmin), s, t)) for s in out for t in seg]
            return out
        out = [s for part in parts for s in part]
        return out if len(out) <= MAX_SEGMENTS else [_hull(out)]
    _, intervals = _lower(node)
    if intervals is None:
        return None
    out = []
    for iv in intervals:
        if direction == "kv":
            e0, e1, lo, hi = Var("r0"), Var("r1"), iv.lo, iv.hi
            v = "r"
        else:
            e0, e1, lo, hi = Var("c0"), Var("c1"), iv.qlo, iv.qhi
            v = "c"
        out.append((substitute(lo, {v: e0}), substitute(hi, {v: e1}),
                    substitute(lo, {v: e1}), substitute(hi, {v: e0})))
    return out


def _hull(segs):
    lo, hi = segs[0][0], segs[0][1]
    for s in segs[1:]:
        lo, hi = fmin(lo, s[0]), fmax(hi, s[1])
    return (lo, hi, segs[0][2], segs[0][3])


def predicate(node: MaskNode):
    if node.kind in ("and", "or"):
        preds = [predicate(c) for c in node.children]
        out = preds[0]
        for p in preds[1:]:
            out = land(out, p) if node.kind == "and" else lor(out, p)
        return out
    return _lower(node)[0]


def _has_kind(node: MaskNode, kind_: str) -> bool:
    return node.kind == kind_ or any(_has_kind(c, kind_) for c in node.children)


def tensors_of(ir) -> dict[str, int]:
    out = {}
    for n in walk(ir):
        if isinstance(n, Load):
            out.setdefault(n.tensor, len(n.index))
        elif isinstance(n, Search):
            out.setdefault(n.tensor, 2)
    return out


def ranked(tensors: Mapping[str, Any] | None, *irs) -> dict:
    """The named tensors these IRs read (None entries skipped), each viewed with the rank its
    expressions index it with: missing leading dimensions broadcast, as the generated modules'
    _tensors does (document ids (S,) serve every batch element)."""
    ranks = {}
    for ir in irs:
        if ir is not None:
            ranks.update(tensors_of(ir))
    tensors = tensors or {}
    return {n: tensors[n].reshape((1,) * (r - tensors[n].dim()) + tuple(tensors[n].shape)) for n, r in ranks.items()}


def uses(ir, name: str) -> bool:
    return any(isinstance(n, Var) and n.name == name for n in walk(ir))


# ----------------------------------------------------------------------------- score modifiers
@dataclass(frozen=True)
class ScoreModNode:
    """A chain of score modifiers applied in order (softcap, alibi, relative_bias, expr)."""

    steps: tuple  # ((kind, sorted params, expr source or None), ...)

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


def parse_score_mod(data, field: str = "score_mod") -> ScoreModNode:
    if isinstance(data, ScoreMod):
        return data.node
    if isinstance(data, ScoreModNode):
        return data
    if callable(data):
        return ScoreMod.from_function(data).node
    items = data if isinstance(data, (list, tuple)) else [data]
    if not items:
        raise SpecError(field, "expected a score modifier or a non-empty list of them", data)
    steps = []
    for i, item in enumerate(items):
        f = _path(field, i) if isinstance(data, (list, tuple)) else field
        if isinstance(item, ScoreMod):
            steps.extend(item.node.steps)
            continue
        if isinstance(item, str):
            item = {"expr": item}
        if not isinstance(item, Mapping) or (len(item) != 1 and not ("expr" in item and set(item) <= {"expr", "params"})):
            raise SpecError(f, "expected one modifier (" + ", ".join([*SCORE_MODS, "expr"]) + ")", item)
        if "expr" in item:
            params = _expr_params(f, item.get("params"), SCORE_VARS)
            ir, _ = parse_expr(item["expr"], field=_path(f, "expr"), variables=SCORE_VARS, params=params)
            if kind(ir) == "bool":
                raise SpecError(_path(f, "expr"), "a score modifier must be a number, not a condition", item["expr"])
            steps.append(("expr", tuple(sorted(params.items())), _ast_canonical(item["expr"])))
            continue
        (name, value), = item.items()
        if name not in SCORE_MODS:
            raise SpecError(f, "unknown score modifier (known: " + ", ".join([*SCORE_MODS, "expr"]) + ")", name)
        allowed, shorthand = SCORE_MODS[name]
        if shorthand and not isinstance(value, (Mapping, type(None))):
            value = {shorthand: value}
        p = _params(_path(f, name), value, allowed)
        if name == "softcap":
            if _num(_path(f, name, "cap"), p["cap"]) <= 0:
                raise SpecError(_path(f, name, "cap"), "expected a positive number", p["cap"])
        elif name == "alibi":
            _tensor_name(_path(f, name, "slopes"), p["slopes"])
            if p["align"] not in ALIGNS:
                raise SpecError(_path(f, name, "align"), "expected bottom_right or top_left", p["align"])
        elif name == "relative_bias":
            _tensor_name(_path(f, name, "tensor"), p["tensor"])
        steps.append((name, tuple(sorted(p.items())), None))
    return ScoreModNode(tuple(steps))


def score_ir(node: ScoreModNode):
    """The modified score as IR over Var('score')."""
    s = Var("score")
    for kind_, params, expr in node.steps:
        p = dict(params)
        if kind_ == "softcap":
            s = mul(Const(float(p["cap"])), Fn("tanh", (Bin("/", s, Const(float(p["cap"]))),)))
        elif kind_ == "alibi":
            # flash-attn: -slope * |i + seqlen_k - seqlen_q - j| (bottom-right aligned)
            dist = Fn("abs", (sub(add(ROWS, _offset(p["align"])), COLS),))
            s = sub(s, mul(Load(p["slopes"], (Var("b"), Var("h"))), dist))
        elif kind_ == "relative_bias":
            # bias[h, q_idx - kv_idx + seqlen_k - 1]: one value per head and distance
            s = add(s, Load(p["tensor"], (Var("h"), add(sub(ROWS, COLS), sub(SK, Const(1))))))
        else:
            ir, _ = parse_expr(expr, field="score_mod.expr", variables=SCORE_VARS, params=dict(params))
            s = substitute(ir, {"score": s})
    return s


def derivative(node, wrt):
    """d node / d wrt, where wrt is Var('score') or a Load site (IR), simplified."""
    if node == wrt:
        return Const(1.0)
    if isinstance(node, (Const, Var, Load, Search)):
        return Const(0.0)
    if isinstance(node, Neg):
        d = derivative(node.a, wrt)
        return Const(0.0) if _const_value(d) == 0 else Neg(d)
    if isinstance(node, Not):
        return Const(0.0)
    if isinstance(node, Bin):
        if node.op in _COMPARE or node.op in _LOGIC or node.op in ("//", "%"):
            return Const(0.0)
        da, db = derivative(node.a, wrt), derivative(node.b, wrt)
        if node.op == "+":
            return add(da, db)
        if node.op == "-":
            return sub(da, db) if _const_value(da) != 0 else (Const(0.0) if _const_value(db) == 0 else Neg(db))
        if node.op == "*":
            return add(mul(da, node.b), mul(node.a, db))
        if node.op == "/":
            first = Bin("/", da, node.b) if _const_value(da) != 0 else Const(0.0)
            if _const_value(db) == 0:
                return first
            return sub(first, Bin("/", mul(node.a, db), mul(node.b, node.b)))
    if isinstance(node, Fn):
        a = node.args
        if node.name == "where":
            da, db = derivative(a[1], wrt), derivative(a[2], wrt)
            if _const_value(da) == 0 and _const_value(db) == 0:
                return Const(0.0)
            return Fn("where", (a[0], da, db))
        d0 = derivative(a[0], wrt)
        if node.name == "abs":
            return Const(0.0) if _const_value(d0) == 0 else Fn("where", (Bin(">=", a[0], Const(0)), d0, Neg(d0)))
        if node.name == "exp":
            return mul(node, d0)
        if node.name == "tanh":
            return mul(sub(Const(1.0), mul(node, node)), d0)
        if node.name in ("min", "max"):
            d1 = derivative(a[1], wrt)
            if _const_value(d0) == 0 and _const_value(d1) == 0:
                return Const(0.0)
            cmp = "<=" if node.name == "min" else ">="
            return Fn("where", (Bin(cmp, a[0], a[1]), d0, d1))
    raise TypeError(node)


# ----------------------------------------------------------------------------- user-facing objects
class Mask:
    """A mask built in Python: ``flashgen.mask("q_idx >= kv_idx")``, a pattern, or a function."""

    def __init__(self, node: MaskNode):
        self.node = node

    @classmethod
    def from_function(cls, fn: Callable) -> "Mask":
        ir, source, params = _function_expr(fn, "mask", MASK_VARS)
        if kind(ir) != "bool":
            raise SpecError("mask", "a mask function must return a condition", source)
        return cls(MaskNode("expr", params, (), source))

    def __and__(self, other):
        return Mask(MaskNode("and", (), (self.node, _as_mask(other).node)))

    def __or__(self, other):
        return Mask(MaskNode("or", (), (self.node, _as_mask(other).node)))

    def to_dict(self):
        return self.node.to_dict()

    def __repr__(self):
        return f"flashgen.mask({self.to_dict()!r})"


class ScoreMod:
    """A score modifier built in Python: ``flashgen.score_mod("score + 0.1 * (q_idx - kv_idx)")``."""

    def __init__(self, node: ScoreModNode):
        self.node = node

    @classmethod
    def from_function(cls, fn: Callable) -> "ScoreMod":
        _, source, params = _function_expr(fn, "score_mod", SCORE_VARS)
        return cls(ScoreModNode((("expr", params, source),)))

    def to_dict(self):
        return self.node.to_dict()

    def __repr__(self):
        return f"flashgen.score_mod({self.to_dict()!r})"


def _function_expr(fn: Callable, field: str, variables):
    """(IR, canonical source in the standard variable names, sorted constants it uses) of a
    one-return Python mask or score function."""
    expr, rename, consts = function_source(fn, field, variables)
    ir, _ = parse_expr(expr, field=field, variables=variables, params=consts, arg_names=rename)
    canon = _rename_source(expr, rename)
    used = tuple(sorted((k, v) for k, v in consts.items() if _mentions(canon, k)))
    return ir, _ast_canonical(canon), used


def _mentions(source, name):
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(ast.parse(source, mode="eval")))


def _rename_source(expr: str, rename: Mapping[str, str]) -> str:
    tree = ast.parse(expr, mode="eval")
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and n.id in rename:
            n.id = rename[n.id]
    return ast.unparse(tree)


def _as_mask(x) -> Mask:
    return x if isinstance(x, Mask) else Mask(parse_mask(x))


def mask(definition=None, /, **pattern) -> Mask:
    """A mask from an expression string, a Python function, or one pattern by keyword.

    ``flashgen.mask("doc[q_idx] == doc[kv_idx]")``, ``flashgen.mask(my_mask_fn)``,
    ``flashgen.mask(sliding_window={"left": 256, "right": 0})``. Combine with & and |.
    """
    if definition is not None and pattern:
        raise TypeError("mask: give an expression/function or one pattern keyword, not both")
    if definition is None:
        if len(pattern) != 1:
            raise TypeError("mask: expected one pattern keyword, e.g. mask(causal={})")
        return Mask(parse_mask(dict(pattern)))
    return Mask(parse_mask(definition))


def score_mod(definition=None, /, **modifier) -> ScoreMod:
    """A score modifier from an expression string, a Python function or one built-in by keyword."""
    if definition is None:
        return ScoreMod(parse_score_mod(dict(modifier)))
    return ScoreMod(parse_score_mod(definition))


# ----------------------------------------------------------------------------- the plan a template renders
@dataclass(frozen=True)
class TensorArg:
    name: str
    rank: int
    grad: bool  # a float tensor read by the score modifier: gradients flow into it

    @property
    def params(self) -> list[str]:
        return [f"t_{self.name}"] + [f"t_{self.name}_s{i}" for i in range(self.rank)] + \
            [f"t_{self.name}_n{i}" for i in range(self.rank)]


class Plan:
    """Everything the template needs to render one mask + score modifier."""

    def __init__(self, mask_node: MaskNode | None, score_node: ScoreModNode | None):
        self.mask = mask_node
        self.score = score_node
        self.pred = predicate(mask_node) if mask_node is not None else None
        self.score_ir = score_ir(score_node) if score_node is not None else None
        self.kv_segments = _segments(mask_node, "kv") if mask_node is not None else [
            (Const(0), SK, Const(0), SK)]
        self.q_segments = _segments(mask_node, "q") if mask_node is not None else [
            (Const(0), SQ, Const(0), SQ)]
        self.block_map = self.kv_segments is None
        mask_tensors = tensors_of(self.pred) if self.pred is not None else {}
        score_tensors = tensors_of(self.score_ir) if self.score_ir is not None else {}
        for name, rank in score_tensors.items():
            if mask_tensors.get(name, rank) != rank:
                raise SpecError("score_mod", f"tensor {name!r} is indexed with {rank} indices here and "
                                f"{mask_tensors[name]} in the mask")
        names = sorted(set(mask_tensors) | set(score_tensors))
        self.tensors = [TensorArg(n, mask_tensors.get(n, score_tensors.get(n)), n in score_tensors) for n in names]
        self.same_seqlen = mask_node is not None and _has_kind(mask_node, "document")
        self.mask_uses_b = self.pred is not None and (uses(self.pred, "b") or bool(mask_tensors))
        self.mask_uses_h = self.pred is not None and uses(self.pred, "h")

    # names threaded through every jit function that evaluates the mask or the modifier
    @property
    def targs(self) -> str:
        return "".join(", " + p for t in self.tensors for p in t.params)

    @property
    def grad_tensors(self) -> list[TensorArg]:
        return [t for t in self.tensors if t.grad]

    @property
    def gargs(self) -> str:
        return "".join(f", g_{t.name}" for t in self.grad_tensors)

    # -- code
    def visible_code(self) -> str:
        body = "cols < seqlen_k" if self.pred is None else f"(cols < seqlen_k) & ({_cg(self.pred, _TILE)})"
        return body

    def score_code(self) -> str:
        return _cg(self.score_ir, _TILE)

    def score_grad_code(self) -> str:
        return _cg(derivative(self.score_ir, Var("score")), _TILE)

    def tensor_grad_sites(self):
        """[(tensor, index IR tuple, derivative code)] for every load of a grad tensor in the modifier."""
        out = []
        seen = set()
        for n in walk(self.score_ir):
            if isinstance(n, Load) and n in seen:
                continue
            if isinstance(n, Load) and any(t.name == n.tensor for t in self.grad_tensors):
                seen.add(n)
                out.append((n.tensor, n.index, _cg(derivative(self.score_ir, n), _TILE)))
        return out

    def tensor_grad_code(self, indent: str) -> str:
        lines = []
        for tname, index, dcode in self.tensor_grad_sites():
            offs = " + ".join(f"_clamp({_cg(i, _TILE)}, t_{tname}_n{d}) * t_{tname}_s{d}" for d, i in enumerate(index))
            grad = f"tl.where(visible, ds * ({dcode}), 0.0)"
            if any(uses(i, "q_idx") or uses(i, "kv_idx") for i in index):
                # one element per (query, key): add the tile elementwise
                lines.append(f"tl.atomic_add(g_{tname} + ({offs}) + zero_i, {grad}, sem=\"relaxed\")")
            else:
                # one element per tile (e.g. an ALiBi slope): reduce the tile first
                lines.append(f"tl.atomic_add(g_{tname} + ({offs}), tl.sum(tl.sum({grad}, 1), 0), sem=\"relaxed\")")
        return ("\n" + indent).join(lines) if lines else "pass"

    def segments_code(self, direction: str, indent: str) -> str:
        segs = self.kv_segments if direction == "kv" else self.q_segments
        lines = []
        cg = _Emitter(lines, _SCALAR)
        names = []
        for i, seg in enumerate(segs):
            vals = [cg.expr(x) for x in seg]
            lines.append(f"lo{i}, hi{i}, flo{i}, fhi{i} = {', '.join(vals)}")
            names.append(i)
        if len(segs) == 2:
            lines.append("# the two segments in key order")
            lines.append("swap = lo1 < lo0")
            for a in ("lo", "hi", "flo", "fhi"):
                lines.append(f"{a}0, {a}1 = tl.where(swap, {a}1, {a}0), tl.where(swap, {a}0, {a}1)")
        return ("\n" + indent).join(lines)


_TILE = {"b": "off_b", "h": "off_h", "q_idx": "rows", "kv_idx": "cols", "score": "score",
         "seqlen_q": "seqlen_q", "seqlen_k": "seqlen_k"}
_SCALAR = {"b": "off_b", "h": "off_h", "r0": "r0", "r1": "r1", "c0": "c0", "c1": "c1",
           "seqlen_q": "seqlen_q", "seqlen_k": "seqlen_k"}
_TL_FN = {"abs": "tl.abs", "min": "tl.minimum", "max": "tl.maximum", "exp": "tl.exp", "tanh": "_tanh",
          "where": "tl.where"}


def _literal(value) -> str:
    if isinstance(value, bool):
        return repr(value)
    if isinstance(value, float):
        if math.isinf(value):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        return repr(value)
    return repr(value)


def _cg(node, env, emit=None) -> str:
    """Triton source for an IR node; `emit` hoists searches into statements."""
    if isinstance(node, Const):
        return _literal(node.value)
    if isinstance(node, Var):
        return env[node.name]
    if isinstance(node, Load):
        offs = " + ".join(f"_clamp({_cg(i, env, emit)}, t_{node.tensor}_n{d}) * t_{node.tensor}_s{d}"
                          for d, i in enumerate(node.index))
        return f"tl.load(t_{node.tensor} + {offs})"
    if isinstance(node, Search):
        code = (f"_search(t_{node.tensor} + _clamp(off_b, t_{node.tensor}_n0) * t_{node.tensor}_s0, "
                f"t_{node.tensor}_s1, t_{node.tensor}_n1, "
                f"{_cg(node.value, env, emit)}, RIGHT={node.right})")
        return emit(code) if emit else code
    if isinstance(node, Not):
        return f"~({_cg(node.a, env, emit)})"
    if isinstance(node, Neg):
        return f"-({_cg(node.a, env, emit)})"
    if isinstance(node, Bin):
        a, b = _cg(node.a, env, emit), _cg(node.b, env, emit)
        if node.op in ("//", "%"):
            if kind(node) == "float" or "float" in (kind(node.a), kind(node.b)):
                q = f"tl.floor(({a}) / ({b}))"
                return q if node.op == "//" else f"(({a}) - ({b}) * {q})"
            return f"{'_fdiv' if node.op == '//' else '_fmod'}({a}, {b})"
        if node.op == "/" and kind(node.a) == "int" and kind(node.b) == "int":
            return f"(({a}) * 1.0 / ({b}))"
        return f"({a} {node.op} {b})"
    if isinstance(node, Fn):
        return f"{_TL_FN[node.name]}({', '.join(_cg(x, env, emit) for x in node.args)})"
    raise TypeError(node)


class _Emitter:
    def __init__(self, lines, env):
        self.lines, self.env, self.memo = lines, env, {}

    def emit(self, code):
        name = self.memo.get(code)
        if name is None:
            name = self.memo[code] = f"s{len(self.memo)}"
            self.lines.append(f"{name} = {code}")
        return name

    def expr(self, node):
        return _cg(node, self.env, self.emit)


# ----------------------------------------------------------------------------- PyTorch evaluation
def evaluate(node, env: Mapping[str, Any], tensors: Mapping[str, Any]):
    """Evaluate IR with torch ops (dense reference, FlexAttention mods). Tensor indices clamp."""
    import torch

    def ev(n):
        if isinstance(n, Const):
            return n.value
        if isinstance(n, Var):
            return env[n.name]
        if isinstance(n, Load):
            t = tensors[n.tensor]
            idx = []
            for d, i in enumerate(n.index):
                i = ev(i)
                i = torch.as_tensor(i, device=t.device)
                idx.append(i.clamp(0, t.shape[d] - 1).long())
            return t[tuple(idx)]
        if isinstance(n, Not):
            return ~ev(n.a)
        if isinstance(n, Neg):
            return -ev(n.a)
        if isinstance(n, Bin):
            a, b = ev(n.a), ev(n.b)
            ops = {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b,
                   "//": lambda: a // b, "%": lambda: a % b, "&": lambda: a & b, "|": lambda: a | b,
                   "<": lambda: a < b, "<=": lambda: a <= b, ">": lambda: a > b, ">=": lambda: a >= b,
                   "==": lambda: a == b, "!=": lambda: a != b}
            return ops[n.op]()
        if isinstance(n, Fn):
            args = [ev(a) for a in n.args]
            t = lambda x: torch.as_tensor(x) if not isinstance(x, torch.Tensor) else x  # noqa: E731
            if n.name == "where":
                return torch.where(t(args[0]), args[1], args[2])
            if n.name == "abs":
                return torch.abs(t(args[0]))
            if n.name == "min":
                return torch.minimum(t(args[0]), t(args[1]))
            if n.name == "max":
                return torch.maximum(t(args[0]), t(args[1]))
            if n.name == "exp":
                return torch.exp(t(args[0]))
            if n.name == "tanh":
                return torch.tanh(t(args[0]))
        raise TypeError(n)

    return ev(node)
