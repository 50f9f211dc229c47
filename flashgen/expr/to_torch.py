"""IR evaluated with PyTorch ops: the dense reference and FlexAttention's mods share it.

Tensor indices are clamped into range, as the kernels clamp them.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .ir import Bin, Const, Fn, Load, Neg, Not, Var, tensors_of


def _floats(a, b):
    return any(isinstance(x, torch.Tensor) and x.is_floating_point() for x in (a, b))


def _floor_divide(a, b):
    """a // b; of floats through torch.div, whose derivative is 0 (floor_divide has none)."""
    return torch.div(a, b, rounding_mode="floor") if _floats(a, b) else a // b


def _remainder(a, b):
    """a % b, floor-signed; of floats as the kernels compute it, a - (a // b) * b, which autograd
    differentiates in b too (torch.remainder has no derivative in its divisor)."""
    return a - torch.div(a, b, rounding_mode="floor") * b if _floats(a, b) else a % b


_BINARY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b,
           "//": _floor_divide, "%": _remainder, "&": lambda a, b: a & b, "|": lambda a, b: a | b,
           "<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, ">=": lambda a, b: a >= b,
           "==": lambda a, b: a == b, "!=": lambda a, b: a != b}
_ARITHMETIC = frozenset({"+", "-", "*", "/", "//", "%"})
_FUNCTIONS = {"abs": torch.abs, "min": torch.minimum, "max": torch.maximum, "exp": torch.exp, "tanh": torch.tanh,
              "softcap": lambda score, cap: cap * torch.tanh(score / cap)}


def _number(x):
    """x as an operand of arithmetic: a condition as an integer (Python's True + True is 2 and -True -1; torch
    refuses -bool and bool - bool, and its bool + bool is a logical or)."""
    if isinstance(x, bool):
        return int(x)
    return x.long() if isinstance(x, torch.Tensor) and x.dtype == torch.bool else x


def _as_tensor(x):
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def evaluate(node, env: Mapping[str, Any], tensors: Mapping[str, Any]):
    """The value of `node` with variables from `env` and named tensors from `tensors`."""

    def ev(n):
        if isinstance(n, Const):
            return n.value
        if isinstance(n, Var):
            return env[n.name]
        if isinstance(n, Load):
            t = tensors[n.tensor]
            idx = []
            for d, i in enumerate(n.index):
                i = torch.as_tensor(ev(i), device=t.device)
                idx.append(i.clamp(0, t.shape[d] - 1).long())
            return t[tuple(idx)]
        if isinstance(n, Not):
            return ~ev(n.a)
        if isinstance(n, Neg):
            return -_number(ev(n.a))
        if isinstance(n, Bin):
            if n.op in _ARITHMETIC:
                return _BINARY[n.op](_number(ev(n.a)), _number(ev(n.b)))
            return _BINARY[n.op](ev(n.a), ev(n.b))
        if isinstance(n, Fn):
            args = [ev(a) for a in n.args]
            if n.name == "where":  # (a tensor element's condition: nonzero, as the kernels read it)
                return torch.where(_as_tensor(args[0]) != 0, args[1], args[2])
            return _FUNCTIONS[n.name](*map(_as_tensor, args))
        raise TypeError(n)

    return ev(node)


def tensors_at_rank(tensors: Mapping[str, Any] | None, *nodes) -> dict:
    """The named tensors these expressions read (None entries skipped), each viewed with the
    rank its expressions index it with: missing leading dimensions broadcast, as the generated
    modules' _tensors does (document ids (S,) serve every batch element)."""
    ranks = {}
    for node in nodes:
        if node is not None:
            ranks.update(tensors_of(node))
    tensors = tensors or {}
    return {n: tensors[n].reshape((1,) * (r - tensors[n].dim()) + tuple(tensors[n].shape)) for n, r in ranks.items()}
