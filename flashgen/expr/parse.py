"""Source text -> IR: the ast whitelist checker, expression strings and Python functions.

Expressions are parsed with ``ast`` and checked node by node against a whitelist; nothing
reaches ``eval`` or ``exec``. Every number that enters the IR (a literal, a parameter, a
constant a Python function closes over) is made a plain ``int``/``float``/``bool`` first, so
what is later written into generated source is the number, never a user object's ``repr``.
"""

from __future__ import annotations

import ast
import functools
import inspect
import math
from typing import Any, Callable, Mapping

from ..errors import SpecError
from .ir import (FUNCTIONS, INT64_MAX, INT64_MIN, MAX_DEPTH, SIZE_VARS, Bin, Const, Fn, Load, Neg, Not, Var,
                 call_argument_clash, element_hint, kind)


# ----------------------------------------------------------------------------- plain values
def plain_number(field: str, value: Any):
    """value as a plain int, float or bool (never a subclass), in the range the kernel can hold.

    Subclasses are read through the base type (``int.__int__``), which no override can change.
    """
    if isinstance(value, bool):
        return bool(value)  # bool cannot be subclassed
    if isinstance(value, int):
        value = int.__int__(value)
        if not INT64_MIN <= value <= INT64_MAX:
            raise SpecError(field, f"expected an integer from {INT64_MIN} to {INT64_MAX} (64 bits)", value)
        return value
    if isinstance(value, float):
        value = float.__float__(value)
        if not math.isfinite(value):
            raise SpecError(field, "expected a finite number", value)
        return value
    raise SpecError(field, "expected a number", value)


def plain_str(value: str) -> str:
    """A str subclass as a plain str (its text, read through ``str.__str__``)."""
    return str.__str__(value)


def _ast_depth(tree) -> int:
    """How deeply the expression nodes of a Python ast nest (iterative: any tree can be measured)."""
    deepest, stack = 0, [(tree, 0)]
    while stack:
        node, d = stack.pop()
        d += isinstance(node, ast.expr)
        deepest = max(deepest, d)
        stack.extend((c, d) for c in ast.iter_child_nodes(node))
    return deepest


# ----------------------------------------------------------------------------- the checker
_BIN_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
            ast.BitAnd: "&", ast.BitOr: "|"}
_COMPARE_OPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}


class ExpressionChecker:
    """ast -> IR, refusing anything outside the whitelist with the offending source."""

    def __init__(self, source: str, field: str, variables, params: Mapping[str, Any], arg_names=None):
        self.source = source
        self.field = field
        self.variables = set(variables) | set(SIZE_VARS)
        self.params = dict(params)
        self.rename = dict(arg_names or {})  # a Python function's argument names -> the variables
        self.tensors: dict[str, int] = {}

    def fail(self, node, message):
        segment = ast.get_source_segment(self.source, node) if hasattr(node, "lineno") else None
        where = f" at column {node.col_offset + 1}" if hasattr(node, "col_offset") else ""
        raise SpecError(self.field, f"{message}{where}: `{segment}`" if segment else message, self.source)

    def name(self, node):
        name = self.rename.get(node.id, node.id)
        if name.startswith("__"):
            self.fail(node, "dunder names are not allowed")
        if name in self.variables:
            return Var(name)
        if name in self.params:
            return Const(plain_number(f"{self.field} ({name})", self.params[name]))
        if name in ("True", "False"):
            return Const(name == "True")
        hint = "variables: " + ", ".join(sorted(self.variables))
        if self.params:
            hint += "; params: " + ", ".join(sorted(self.params))
        self.fail(node, f"unknown name {name!r} ({hint}; tensors must be indexed, e.g. doc[q_idx])")

    def constant(self, node):
        if isinstance(node.value, (bool, int, float)):
            if isinstance(node.value, int) and not isinstance(node.value, bool) and \
                    not INT64_MIN <= node.value <= INT64_MAX:
                self.fail(node, "integer literals must lie in [-2**63, 2**63) (64 bits)")
            if isinstance(node.value, float) and not math.isfinite(node.value):  # 1e400 reads as inf
                self.fail(node, f"number literals must be finite, got {node.value}")
            return Const(node.value)
        self.fail(node, f"only numbers and True/False are allowed as constants, not {type(node.value).__name__}")

    def binary(self, node):
        op = _BIN_OPS.get(type(node.op))
        if op is None:
            self.fail(node, f"operator {type(node.op).__name__} is not allowed")
        a, b = self.visit(node.left), self.visit(node.right)
        if op in ("/", "//", "%") and isinstance(b, Const) and b.value == 0:
            self.fail(node, f"`{op} 0` divides by zero")
        return Bin(op, a, b)

    def unary(self, node):
        if isinstance(node.op, ast.USub):
            return Neg(self.visit(node.operand))
        if isinstance(node.op, ast.UAdd):
            return self.visit(node.operand)
        if isinstance(node.op, ast.Invert):
            inner = self.visit(node.operand)
            if kind(inner) != "bool":
                self.fail(node, "~ negates a condition (a comparison, & or |)" + element_hint(inner))
            return Not(inner)
        self.fail(node, "`not` is not allowed (use ~ on a condition)")

    def compare(self, node):
        out, left = None, self.visit(node.left)
        for op, comparator in zip(node.ops, node.comparators):
            if type(op) not in _COMPARE_OPS:
                self.fail(node, f"comparison {type(op).__name__} is not allowed")
            right = self.visit(comparator)
            term = Bin(_COMPARE_OPS[type(op)], left, right)
            out = term if out is None else Bin("&", out, term)
            left = right
        return out

    def call(self, node):
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
        args = tuple(self.visit(a) for a in node.args)
        if fname == "where" and kind(args[0]) in ("int", "float"):
            self.fail(node, "where's first argument is a condition (a comparison, &, |, ~ or a tensor element), "
                            "not a number (write where(x != 0, ...))")
        if fname in ("exp", "tanh") and kind(args[0]) in ("int", "bool"):
            self.fail(node, f"{fname} takes a float, not an integer (write {fname}(x * 1.0))")
        return Fn(fname, args)

    def subscript(self, node):
        if not isinstance(node.value, ast.Name):
            self.fail(node, "only named tensors can be indexed")
        tname = self.rename.get(node.value.id, node.value.id)
        if tname.startswith("__"):
            self.fail(node, "dunder names are not allowed")
        if tname in self.variables or tname in self.params or tname in FUNCTIONS:
            self.fail(node, f"{tname!r} is not a tensor")
        if not tname.isidentifier():
            self.fail(node, "bad tensor name")
        if call_argument_clash(tname):
            self.fail(node, call_argument_clash(tname))
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
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

    def visit(self, node):
        if isinstance(node, ast.Expression):
            return self.visit(node.body)
        handler = {ast.Constant: self.constant, ast.Name: self.name, ast.BinOp: self.binary,
                   ast.UnaryOp: self.unary, ast.Compare: self.compare, ast.Call: self.call,
                   ast.Subscript: self.subscript}.get(type(node))
        if handler is not None:
            return handler(node)
        if isinstance(node, ast.BoolOp):
            self.fail(node, "`and`/`or` are not allowed (use & and | with parentheses)")
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
    source = plain_str(source).strip()
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError as err:
        raise SpecError(field, f"not a valid expression ({err.msg}, column {err.offset})", source) from None
    except (RecursionError, MemoryError):  # CPython's parser: MemoryError past its stack (20000 unary minuses)
        raise SpecError(field, f"the expression is nested too deeply (at most {MAX_DEPTH} levels)",
                        source[:80]) from None
    levels = _ast_depth(tree)
    if levels > MAX_DEPTH:  # refused before the checker recurses through it
        raise SpecError(field, f"the expression is nested too deeply ({levels} levels; at most {MAX_DEPTH} fit in "
                               "the generated kernel: combine fewer terms)", source[:80])
    checker = ExpressionChecker(source, field, variables, params or {}, arg_names)
    node = checker.visit(tree)
    return node, checker.tensors


def canonical_source(source: str) -> str:
    """The expression as ``ast.unparse`` writes it: one spelling per expression."""
    return ast.unparse(ast.parse(source.strip(), mode="eval"))


def rename_source(source: str, rename: Mapping[str, str]) -> str:
    """The expression with names replaced (a Python function's argument names -> the variables)."""
    tree = ast.parse(source, mode="eval")
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in rename:
            node.id = rename[node.id]
    return ast.unparse(tree)


def mentions(source: str, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(ast.parse(source, mode="eval")))


def expression_params(field: str, params, variables) -> dict:
    """An expression's ``params:`` mapping: names that are not variables, to plain finite numbers."""
    params = params or {}
    if not isinstance(params, Mapping):
        raise SpecError(f"{field}.params", "expected a mapping of names to numbers", params)
    out = {}
    for name, value in params.items():
        if not isinstance(name, str) or not name.isidentifier() or name in tuple(variables) + SIZE_VARS:
            raise SpecError(f"{field}.params", "expected parameter names that are not variables", name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(f"{field}.params.{name}", "expected a finite number", value)
        out[plain_str(name)] = plain_number(f"{field}.params.{name}", value)
    return out


# ----------------------------------------------------------------------------- Python functions
def _positional(node) -> list[str]:
    return [a.arg for a in node.args.posonlyargs + node.args.args]


def _inside(span, node) -> bool:
    line, end_line, col, end_col = span
    return (node.lineno, node.col_offset) <= (line, col) and (end_line, end_col) <= (node.end_lineno,
                                                                                     node.end_col_offset)


@functools.lru_cache(maxsize=256)
def _definition(code) -> ast.Lambda | ast.FunctionDef:
    """The ast of the lambda or def that compiled to `code`.

    Several lambdas can share a line (``mask(lambda ...: a) | mask(lambda ...: b)``, ``f, g =
    (lambda ...), (lambda ...)``), so the source line alone does not say which one a function
    is. The code object does: each instruction carries the line and column span it was
    compiled from (``co_positions``), and exactly one candidate's body contains them all.
    """
    try:
        lines, _ = inspect.findsource(code)
        module = ast.parse("".join(lines))
    except (OSError, TypeError, SyntaxError, ValueError):
        raise OSError("cannot read the source of this function (define it in a file)") from None
    spans = [p for p in code.co_positions() if None not in p and (p[0], p[2]) != (p[1], p[3])]
    if code.co_name == "<lambda>":
        candidates = [n for n in ast.walk(module) if isinstance(n, ast.Lambda) and n.lineno == code.co_firstlineno]
        bodies = [(n, n.body) for n in candidates]
    else:
        candidates = [n for n in ast.walk(module) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.name == code.co_name
                      and code.co_firstlineno in (n.lineno, *(d.lineno for d in n.decorator_list))]
        bodies = [(n, n) for n in candidates]
    args = list(code.co_varnames[:code.co_argcount])
    matches = [n for n, body in bodies if all(_inside(s, body) for s in spans) and _positional(n) == args
               and set(code.co_freevars) <= {m.id for m in ast.walk(body) if isinstance(m, ast.Name)}]
    where = f"line {code.co_firstlineno} of {code.co_filename}"
    if not candidates:
        raise OSError(f"cannot find the function's definition at {where} (was the file changed since?)")
    if len(matches) != 1:
        raise OSError(f"cannot tell which of the {len(candidates)} functions at {where} this is; "
                      "define it with def or on a line of its own")
    return matches[0]


def read_function(fn: Callable, field: str, variables) -> tuple[str, dict, dict]:
    """(the return expression's source, {argument name: variable}, {closure constant: plain number})
    of a one-expression Python mask or score function (a lambda, or a def whose body is one return)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        raise SpecError(field, "expected a Python function (a lambda or def)", fn)
    try:
        target = _definition(code)
    except OSError as err:
        raise SpecError(field, str(err), fn) from None
    args = _positional(target)
    if len(args) != len(variables) or target.args.vararg or target.args.kwonlyargs or target.args.kwarg:
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
                consts[name] = plain_number(f"{field} ({name})", value)
    return expr, rename, consts


def function_expression(fn: Callable, field: str, variables):
    """(IR, canonical source in the standard variable names, sorted (name, value) constants it
    uses) of a one-expression Python mask or score function."""
    expr, rename, consts = read_function(fn, field, variables)
    node, _ = parse_expr(expr, field=field, variables=variables, params=consts, arg_names=rename)
    source = rename_source(expr, rename)
    used = tuple(sorted((k, v) for k, v in consts.items() if mentions(source, k)))
    return node, canonical_source(source), used
