"""The expression IR that masks and score modifiers are written in.

Nodes are frozen dataclasses (hashable, comparable), so equal expressions are equal
values and lowering can be cached. The language:

* variables ``b``, ``h``, ``q_idx``, ``kv_idx`` (and ``score`` in a score modifier),
  ``seqlen_q`` and ``seqlen_k``;
* integer, float and boolean constants;
* named input tensors indexed by expressions (``doc[q_idx]``), passed at call time;
* arithmetic, comparisons, ``&``, ``|``, ``~``, and the functions in FUNCTIONS.

Semantics are FlexAttention's ``mask_mod`` / ``score_mod``: ``//`` and ``%`` floor,
``score`` is q.k * softmax_scale, tensor indices are clamped into range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

MASK_VARS = ("b", "h", "q_idx", "kv_idx")
SCORE_VARS = ("score", "b", "h", "q_idx", "kv_idx")
SIZE_VARS = ("seqlen_q", "seqlen_k")
# The arguments of the calls that take a spec's named tensors as keywords (flashgen.attention,
# attention_varlen, flashgen.decode, and a kernel's __call__, forward, backward, varlen, block_map): a
# tensor named so could never be passed (tests/test_spec.py holds this to their signatures).
CALL_ARGUMENTS = frozenset((
    "self", "q", "k", "v", "do", "out", "lse", "seed", "layout", "causal", "softmax_scale", "dropout_p",
    "return_lse", "config", "deterministic", "mask", "score_mod", "q_descale", "k_descale", "v_descale",
    "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "batch", "seqlen_q", "seqlen_k", "device",
    "spec_or_kernel", "k_cache", "v_cache", "cache_seqlens", "block_table", "cache_batch_idx", "num_splits",
    "BLOCK_N", "num_warps", "num_stages", "page_prefetch", "check", "fused_combine"))


def call_argument_clash(name: str) -> str | None:
    """Why a tensor cannot take this name (one of CALL_ARGUMENTS), or None: what expressions and patterns say."""
    if name in CALL_ARGUMENTS:
        return f"tensor {name!r} would be passed as {name}=, an argument of the calls themselves; rename it"
    return None
FUNCTIONS = {"where": 3, "abs": 1, "min": 2, "max": 2, "exp": 1, "tanh": 1}  # name -> number of arguments
# Functions only the built-in modifiers emit: softcap(score, cap) = cap * tanh(score / cap), written with
# tanh's series where score / cap is small (masks/score_mods.py: caps above SOFTCAP_SERIES_ABOVE)
INTERNAL_FUNCTIONS = {"softcap": 2}

COMPARE_OPS = frozenset({"<", "<=", ">", ">=", "==", "!="})
LOGIC_OPS = frozenset({"&", "|"})

# The deepest expression flashgen lowers. The Triton writer (to_triton.py) opens at most three
# parentheses per level and Python's parser stops at 200 nested ones; 32 levels leave room for
# the statement around the expression and for the derivative the backward writes.
MAX_DEPTH = 32
# Integer constants are 64-bit in the kernel: a literal outside this range does not compile.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


# ----------------------------------------------------------------------------- nodes
@dataclass(frozen=True)
class Const:
    value: Any  # a plain int, float or bool


@dataclass(frozen=True)
class Var:
    name: str


@dataclass(frozen=True)
class Load:
    """tensor[index...], each index clamped into the tensor's extent."""

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


# ----------------------------------------------------------------------------- constructors that simplify
def const_value(node):
    """The value of a constant node, else None."""
    return node.value if isinstance(node, Const) else None


def add(a, b):
    if const_value(a) == 0:
        return b
    if const_value(b) == 0:
        return a
    return Bin("+", a, b)


def sub(a, b):
    return a if const_value(b) == 0 else Bin("-", a, b)


def mul(a, b):
    if const_value(a) == 1:
        return b
    if const_value(b) == 1:
        return a
    if const_value(a) == 0 or const_value(b) == 0:
        return Const(0)
    return Bin("*", a, b)


def fmin(a, b):
    return Fn("min", (a, b))


def fmax(a, b):
    return Fn("max", (a, b))


def land(a, b):
    if const_value(a) is True:
        return b
    if const_value(b) is True:
        return a
    return Bin("&", a, b)


def lor(a, b):
    return Bin("|", a, b)


# ----------------------------------------------------------------------------- traversal
def children(node) -> tuple:
    if isinstance(node, Load):
        return node.index
    if isinstance(node, Bin):
        return (node.a, node.b)
    if isinstance(node, (Not, Neg)):
        return (node.a,)
    if isinstance(node, Fn):
        return node.args
    if isinstance(node, Search):
        return (node.value,)
    return ()


def walk(node) -> Iterator:
    """Every node, parents before children, left to right."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(reversed(children(n)))


def fold(node, combine):
    """combine(n, [results of n's children]) for every node, bottom-up, without recursion.

    Expressions can share subexpressions (a derivative reuses the node it differentiates), so
    each distinct node object is combined once: the cost follows the nodes that exist, not the
    (possibly exponentially longer) expression they write out."""
    done: dict[int, Any] = {}
    stack = [node]
    while stack:
        n = stack[-1]
        if id(n) in done:
            stack.pop()
            continue
        pending = [c for c in children(n) if id(c) not in done]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        done[id(n)] = combine(n, [done[id(c)] for c in children(n)])
    return done[id(node)]


def depth(node) -> int:
    """How deeply the expression nests (a leaf is 1)."""
    return fold(node, lambda n, below: 1 + max(below, default=0))


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


def reads_var(node, name: str) -> bool:
    """Whether the expression reads variable `name`."""
    return any(isinstance(n, Var) and n.name == name for n in walk(node))


def tensors_of(node) -> dict[str, int]:
    """{tensor name: rank} of every tensor the expression reads."""
    out = {}
    for n in walk(node):
        if isinstance(n, Load):
            out.setdefault(n.tensor, len(n.index))
        elif isinstance(n, Search):
            out.setdefault(n.tensor, 2)
    return out


def element_hint(node) -> str:
    """What a condition's place holds where it holds a named tensor's element (itself, or an operand of & | ~
    that is one): FlexAttention's mask_mod may return a bool tensor's element as it is, but here the element is a
    number whatever its dtype, which comes only with the call. "" elsewhere (arithmetic such as q_idx + off[b])."""
    if isinstance(node, Load):
        return f"; a named tensor's element is a number, even a bool tensor's: compare it ({node.tensor}[...] != 0)"
    if isinstance(node, Not):
        return element_hint(node.a)
    if isinstance(node, Bin) and node.op in LOGIC_OPS:
        return element_hint(node.a) or element_hint(node.b)
    return ""


def kind(node) -> str:
    """'bool', 'int' or 'float' ('num' for a tensor element, whose dtype comes at call time)."""
    if isinstance(node, Const):
        return "bool" if isinstance(node.value, bool) else "int" if isinstance(node.value, int) else "float"
    if isinstance(node, Var):
        return "float" if node.name == "score" else "int"
    if isinstance(node, Load):
        return "num"
    if isinstance(node, Search):
        return "int"
    if isinstance(node, Not):
        return "bool"
    if isinstance(node, Neg):
        return "int" if kind(node.a) == "bool" else kind(node.a)  # -True is -1, as in Python
    if isinstance(node, Bin):
        if node.op in COMPARE_OPS:
            return "bool"
        ka, kb = kind(node.a), kind(node.b)
        if node.op in LOGIC_OPS:
            return "bool" if ka == kb == "bool" else "int"
        if node.op == "/" or "float" in (ka, kb):
            return "float"
        return "num" if "num" in (ka, kb) else "int"
    if isinstance(node, Fn):
        if node.name in ("exp", "tanh", "softcap"):
            return "float"
        ks = [kind(a) for a in (node.args[1:] if node.name == "where" else node.args)]
        return "float" if "float" in ks else "num" if "num" in ks else ks[0]
    raise TypeError(node)
