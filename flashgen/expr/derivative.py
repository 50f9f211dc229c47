"""The symbolic derivative of a score modifier, for the backward pass.

dS (the gradient of the loss with respect to the modified score) is multiplied by
d mod / d score; a float tensor the modifier reads gets dS * d mod / d element added into
its gradient at every site it is read.
"""

from __future__ import annotations

from .ir import COMPARE_OPS, LOGIC_OPS, Bin, Const, Fn, Load, Neg, Not, Search, Var, add, const_value, mul, sub


def derivative(node, wrt):
    """d node / d wrt, where wrt is Var('score') or a Load site (IR), simplified."""
    if node == wrt:
        return Const(1.0)
    if isinstance(node, (Const, Var, Load, Search)):
        return Const(0.0)
    if isinstance(node, Neg):
        d = derivative(node.a, wrt)
        return Const(0.0) if const_value(d) == 0 else Neg(d)
    if isinstance(node, Not):
        return Const(0.0)
    if isinstance(node, Bin):
        if node.op in COMPARE_OPS or node.op in LOGIC_OPS or node.op == "//":
            return Const(0.0)  # piecewise constant
        da, db = derivative(node.a, wrt), derivative(node.b, wrt)
        if node.op == "%":  # a % b = a - (a // b) * b, a // b piecewise constant
            if const_value(db) == 0:
                return da
            return sub(da, mul(Bin("//", node.a, node.b), db))
        if node.op == "+":
            return add(da, db)
        if node.op == "-":
            return sub(da, db) if const_value(da) != 0 else (Const(0.0) if const_value(db) == 0 else Neg(db))
        if node.op == "*":
            return add(mul(da, node.b), mul(node.a, db))
        if node.op == "/":
            first = Bin("/", da, node.b) if const_value(da) != 0 else Const(0.0)
            if const_value(db) == 0:
                return first
            return sub(first, Bin("/", mul(node.a, db), mul(node.b, node.b)))
    if isinstance(node, Fn):
        a = node.args
        if node.name == "where":
            da, db = derivative(a[1], wrt), derivative(a[2], wrt)
            if const_value(da) == 0 and const_value(db) == 0:
                return Const(0.0)
            return Fn("where", (a[0], da, db))
        d0 = derivative(a[0], wrt)
        if node.name == "abs":  # 0 at 0, as torch's (a zero-initialised bias under abs learns as in torch)
            if const_value(d0) == 0:
                return Const(0.0)
            return Fn("where", (Bin(">", a[0], Const(0)), d0,
                                Fn("where", (Bin("<", a[0], Const(0)), Neg(d0), Const(0.0)))))
        if node.name == "exp":
            return mul(node, d0)
        if node.name == "tanh":
            return mul(sub(Const(1.0), mul(node, node)), d0)
        if node.name == "softcap":  # d/ds cap * tanh(s / cap) = 1 - tanh^2 (cap: a constant)
            t = Bin("/", node, a[1])
            return mul(sub(Const(1.0), mul(t, t)), d0)
        if node.name in ("min", "max"):
            d1 = derivative(a[1], wrt)
            if const_value(d0) == 0 and const_value(d1) == 0:
                return Const(0.0)
            # a tie splits the gradient in halves, as torch.minimum/maximum's does
            first, second = ("<", ">") if node.name == "min" else (">", "<")
            tie = mul(add(d0, d1), Const(0.5))
            return Fn("where", (Bin(first, a[0], a[1]), d0, Fn("where", (Bin(second, a[0], a[1]), d1, tie))))
    raise TypeError(node)
