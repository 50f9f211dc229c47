"""The expression package on its own: parsing, lowering to Triton text, evaluation in
PyTorch and the symbolic derivative (checked against autograd). No kernel runs here."""

import dataclasses

import pytest
import torch

from flashgen import SpecError
from flashgen.expr.derivative import derivative
from flashgen.expr.ir import MASK_VARS, SCORE_VARS, Const, Load, Var, depth, kind, reads_var, tensors_of, walk
from flashgen.expr.parse import parse_expr
from flashgen.expr.to_torch import evaluate, tensors_at_rank
from flashgen.expr.to_triton import GLUON, TRITON, tensor_params, triton_expr, triton_literal

TILE = {"b": "off_b", "h": "off_h", "q_idx": "rows", "kv_idx": "cols", "score": "score",
        "seqlen_q": "seqlen_q", "seqlen_k": "seqlen_k"}


def test_parse_builds_ir_and_reports_tensor_ranks():
    node, tensors = parse_expr("(doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx - w)", field="mask.expr",
                               variables=MASK_VARS, params={"w": 3})
    assert kind(node) == "bool" and tensors == {"doc": 2} and tensors_of(node) == {"doc": 2}
    assert reads_var(node, "b") and not reads_var(node, "h") and Const(3) in list(walk(node))
    assert depth(Var("q_idx")) == 1 and depth(node) == 4  # & -> == -> doc[...] -> q_idx


def test_triton_text_of_each_construct():
    node, _ = parse_expr("where(q_idx // 3 > kv_idx % 2, abs(score) / 2, -tanh(score)) + t[h, kv_idx] + q_idx / 4",
                         field="score_mod.expr", variables=SCORE_VARS)
    text = triton_expr(node, TILE)
    for piece in ("_fdiv(rows, 3)", "_fmod(cols, 2)", "tl.abs(score)", "-(_tanh(score))",
                  "tl.load(t_t + _clamp(off_h, t_t_n0) * t_t_s0 + _clamp(cols, t_t_n1) * t_t_s1)",
                  "((rows) * 1.0 / (4))", "tl.where("):
        assert piece in text, piece
    # a dim the call's checks hold to seqlen_k (the plan's dialect.key_dims): kv_idx read unclamped, masked past it
    keyed = triton_expr(node, TILE, dialect=dataclasses.replace(TRITON, key_dims=frozenset({("t", 1)})))
    assert ("tl.load(t_t + _clamp(off_h, t_t_n0) * t_t_s0 + cols * t_t_s1, mask=((cols < t_t_n1) | "
            "(cols * 0 + t_t_n1 == 1)), other=0)") in keyed
    assert tensor_params("t", 2) == ["t_t", "t_t_s0", "t_t_s1", "t_t_n0", "t_t_n1"]
    assert [triton_literal(x) for x in (True, 7, 0.1, float("inf"), -float("inf"))] == [
        "True", "7", "0.1", 'float("inf")', 'float("-inf")']
    # integers past int32: an int64 tensor for the portable kernels (the interpreter casts a plain literal
    # to the other operand's int32), the plain literal for the Gluon ones (never interpreted)
    node, _ = parse_expr("kv_idx <= q_idx + 3000000000 + 2147483647 - 2147483648", field="mask.expr",
                         variables=MASK_VARS)
    assert triton_expr(node, TILE) == ("(cols <= (((rows + tl.cast(3000000000, tl.int64)) + 2147483647) - "
                                       "tl.cast(2147483648, tl.int64)))")
    assert triton_expr(node, TILE, dialect=GLUON) == "(cols <= (((rows + 3000000000) + 2147483647) - 2147483648))"


def test_torch_evaluation_clamps_indices_and_broadcasts_ranks():
    node, _ = parse_expr("t[q_idx + 10] > 0", field="mask.expr", variables=MASK_VARS)
    t = torch.tensor([-1, 1, -1])
    out = evaluate(node, {"q_idx": torch.arange(3)}, {"t": t})
    assert out.tolist() == [False, False, False]  # every index clamps to the last element
    node, _ = parse_expr("d[b, q_idx] == 0", field="mask.expr", variables=MASK_VARS)
    assert tensors_at_rank({"d": torch.zeros(5)}, node)["d"].shape == (1, 5)


@pytest.mark.parametrize("source", [
    "tanh(score / 3.0) * 3.0 + exp(-abs(score)) - min(score, 1.0) / (1.0 + score * score)",
    "where(score > 0.5, score * score, max(score, -0.25)) - score / (2.0 + q_idx)",
    "score % 0.7 + 5.0 % (score + 3.5) - (score // 0.3) * score",  # floor-signed; d(a % b)/db = -(a // b)
])
def test_derivative_matches_autograd(source):
    # float64 so the symbolic and the autograd derivative agree to rounding
    node, _ = parse_expr(source, field="score_mod.expr", variables=SCORE_VARS)
    score = torch.linspace(-3, 3, 96, dtype=torch.float64).requires_grad_()  # not 0: abs has a kink
    env = {"score": score, "q_idx": torch.arange(96), "kv_idx": 0, "b": 0, "h": 0}
    (auto,) = torch.autograd.grad(evaluate(node, env, {}).sum(), score)
    symbolic = evaluate(derivative(node, Var("score")), {**env, "score": score.detach()}, {})
    assert torch.allclose(torch.as_tensor(symbolic, dtype=torch.float64).broadcast_to(auto.shape), auto)


def test_conditions_count_as_python_integers_in_arithmetic():
    # -True is -1 and True + True 2, as in Python (torch refuses -bool; Triton's 1-bit integers wrapped)
    env = {"q_idx": torch.arange(4)[:, None], "kv_idx": torch.arange(4)[None, :], "b": 0, "h": 0, "score": 0.0}
    for source, want in (("-(q_idx >= kv_idx)", -(env["q_idx"] >= env["kv_idx"]).long()),
                         ("(q_idx >= kv_idx) - (kv_idx > 1)", (env["q_idx"] >= env["kv_idx"]).long()
                          - (env["kv_idx"] > 1).long()),
                         ("(q_idx >= kv_idx) + (kv_idx >= q_idx)", 1 + (env["q_idx"] == env["kv_idx"]).long())):
        node, _ = parse_expr(source, field="m.expr", variables=MASK_VARS)
        assert kind(node) == "int"
        assert torch.equal(torch.as_tensor(evaluate(node, env, {})), want), source
        assert ".to(tl.int32)" in triton_expr(node, {"q_idx": "rows", "kv_idx": "cols"})


def test_derivative_for_a_tensor_element():
    node, _ = parse_expr("score - s[h] * abs(q_idx - kv_idx)", field="score_mod.expr", variables=SCORE_VARS)
    site = next(n for n in walk(node) if isinstance(n, Load))
    assert evaluate(derivative(node, site), {"q_idx": 2, "kv_idx": 7, "h": 0, "score": 0.0}, {}) == -5


@pytest.mark.parametrize("source,words", [
    ("q_idx.real > 0", "attribute access"),
    ("[q_idx][0] > 0", "only named tensors can be indexed"),
    ("q_idx ** 2 > 0", "operator Pow"),
    ("f(q_idx) > 0", "function 'f' is not allowed"),
    ("q_idx < 1e400", "number literals must be finite, got inf"),  # (1e400 reads as inf: all-NaN outputs)
    ("q_idx / 0 > 1", "`/ 0` divides by zero"),  # (Triton's constant folding raised ZeroDivisionError)
    ("where(q_idx - kv_idx, q_idx, 0) > 1", "where's first argument is a condition"),
])
def test_parse_refuses_with_the_field(source, words):
    with pytest.raises(SpecError, match="spec field 'm.expr'") as info:
        parse_expr(source, field="m.expr", variables=MASK_VARS)
    assert words in str(info.value)
