"""Property-based tests (hypothesis): flashgen against the PyTorch reference, or a clean error.

Random mask expressions from the grammar (comparisons and arithmetic of b, h, q_idx, kv_idx;
& | ~; where, abs, min, max; // and % by nonzero constants; small integer literals), random
shapes (odd lengths 1..70, GQA ratios, head dims that are not powers of two, fp16 and fp32
on the interpreter), random tile configs, and random ``cu_seqlens`` for
``flashgen.attention_varlen``, valid and invalid. Each case must match the reference under
the rule of ../shared/TESTING.md (NaN-poisoned outputs, so an unwritten element fails), or be
refused with a ValueError / TypeError / SpecError that names the argument: never a crash,
never a silent wrong result.

The reference mask is NOT flashgen's: every generated expression carries its own PyTorch
evaluation (floor ``//`` and ``%``, FlexAttention's semantics), and the reference reads the
resulting dense mask as a tensor, so a parser or lowering bug cannot agree with itself.

Bounded for CI: fixed examples (``derandomize``, no example database), ``deadline=None``
(interpreter calls vary with the shared CPU), and ``max_examples`` so that the file runs in
about a minute on two shared cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import flashgen
from flashgen import AttentionSpec, KernelConfig
from flashgen.errors import SpecError
from flashgen.verify import check_attention, check_gradients, compare, reference_varlen

from .helpers import child_pythonpath, poisoned_outputs

ROOT = Path(__file__).resolve().parent.parent
# No shrinking: every example costs interpreter seconds (a failing one would shrink for minutes);
# each assertion message carries the whole case instead.
CI = dict(derandomize=True, database=None, deadline=None, print_blob=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CLEAN_ERRORS = (ValueError, TypeError, SpecError)  # SpecError is a ValueError; named for the reader


# ----------------------------------------------------------------------------- the grammar
@dataclass(frozen=True)
class Expr:
    """A mask (sub)expression: its source for flashgen, and its own PyTorch evaluation."""

    src: str
    ev: Callable[[dict], torch.Tensor]

    def __repr__(self) -> str:
        return f"Expr({self.src!r})"


VARIABLES = [Expr(name, lambda env, name=name: env[name]) for name in ("b", "h", "q_idx", "kv_idx")]
# The relative position, as masks use it most: negative half the time, so // and % meet negative numbers.
RELATIVE = Expr("(q_idx - kv_idx)", lambda env: env["q_idx"] - env["kv_idx"])
literals = st.integers(-8, 8).map(lambda n: Expr(f"({n})" if n < 0 else str(n), lambda env, n=n: torch.tensor(n)))
divisors = st.integers(-8, 8).filter(lambda n: n != 0)


def _binary(op: str, fn):
    return lambda a, b: Expr(f"({a.src} {op} {b.src})", lambda env: fn(a.ev(env), b.ev(env)))


def _call(name: str, fn):
    return lambda *args: Expr(f"{name}({', '.join(a.src for a in args)})", lambda env: fn(*(a.ev(env) for a in args)))


def _by_constant(op: str, fn):
    return lambda a, n: Expr(f"({a.src} {op} {f'({n})' if n < 0 else n})", lambda env: fn(a.ev(env), n))


ARITH = [_binary("+", torch.add), _binary("-", torch.sub), _binary("*", torch.mul),
         _call("min", torch.minimum), _call("max", torch.maximum)]
COMPARE = [_binary(op, fn) for op, fn in (("<", torch.lt), ("<=", torch.le), (">", torch.gt), (">=", torch.ge),
                                          ("==", torch.eq), ("!=", torch.ne))]
LOGIC = [_binary("&", torch.logical_and), _binary("|", torch.logical_or)]
floor_div = _by_constant("//", lambda a, n: torch.div(a, n, rounding_mode="floor"))
floor_mod = _by_constant("%", torch.remainder)  # Python's %: the sign of the divisor
absolute = _call("abs", torch.abs)
invert = lambda c: Expr(f"(~{c.src})", lambda env: torch.logical_not(c.ev(env)))  # noqa: E731
where = _call("where", torch.where)


def _either(ops, a, b):
    """One of the binary ops applied to an a and a b."""
    return st.builds(lambda f, x, y: f(x, y), st.sampled_from(ops), a, b)


def integers(depth: int):
    """Integer expressions of at most `depth` levels (leaves: a variable, the relative position or a literal)."""
    leaf = st.one_of(st.sampled_from(VARIABLES), st.just(RELATIVE), literals)
    if depth == 0:
        return leaf
    sub = integers(depth - 1)
    return st.one_of(
        leaf,
        _either(ARITH, sub, sub),
        st.builds(floor_div, sub, divisors),
        st.builds(floor_mod, sub, divisors),
        st.builds(absolute, sub),
        st.builds(where, comparisons(depth - 1), sub, sub),
    )


def comparisons(depth: int):
    return _either(COMPARE, integers(depth), integers(depth))


def conditions(depth: int):
    """Conditions (a mask): comparisons of integer expressions, combined `depth` levels deep."""
    if depth == 0:
        return comparisons(2)
    sub = conditions(depth - 1)
    return st.one_of(comparisons(2), comparisons(2), _either(LOGIC, sub, sub), st.builds(invert, sub),
                     st.builds(where, sub, sub, sub))


MASKS = conditions(2)
HEAD_DIMS = [8, 12, 16, 24, 40, 72]  # mostly not powers of two
lengths = st.integers(1, 70)


@st.composite
def heads(draw):
    kv = draw(st.sampled_from([1, 2]))
    return kv * draw(st.sampled_from([1, 2, 4])), kv  # GQA ratios 1, 2, 4 (MQA with kv = 1)


configs = st.builds(KernelConfig, BLOCK_M=st.sampled_from([16, 32]), BLOCK_N=st.sampled_from([16, 32]),
                    num_warps=st.just(4), num_stages=st.just(1), loop_order=st.sampled_from(["q_outer", "kv_outer"]),
                    bwd_short=st.booleans())  # (the one-launch backward: a custom mask's reads its block map both ways)
dtypes = st.sampled_from([torch.float16, torch.float32])  # bf16 tl.dot is wrong on the interpreter


def _randn(seed: int, *shape, dtype):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


# ----------------------------------------------------------------------------- dense attention
@settings(max_examples=30, **CI)
@given(mask=MASKS, batch=st.integers(1, 2), nheads=heads(), seqlen_q=lengths, seqlen_k=lengths,
       head_dim=st.sampled_from(HEAD_DIMS), causal=st.booleans(), dtype=dtypes, config=configs,
       backward=st.sampled_from([False, False, True]), seed=st.integers(0, 2**31 - 1))
@pytest.mark.interpreter
def test_random_masks_match_the_reference(mask, batch, nheads, seqlen_q, seqlen_k, head_dim, causal, dtype, config,
                                          backward, seed):
    (num_heads, num_kv_heads) = nheads
    q = _randn(seed, batch, num_heads, seqlen_q, head_dim, dtype=dtype)
    k = _randn(seed + 1, batch, num_kv_heads, seqlen_k, head_dim, dtype=dtype)
    v = _randn(seed + 2, batch, num_kv_heads, seqlen_k, head_dim, dtype=dtype)
    spec = AttentionSpec(name="prop", dtype={torch.float16: "fp16", torch.float32: "fp32"}[dtype], head_dim=head_dim,
                         num_heads=num_heads, num_kv_heads=num_kv_heads, causal=causal, mask=mask.src,
                         backward=backward)
    kernel = flashgen.compile(spec, config)
    out, lse = poisoned_outputs(q, num_heads, seqlen_q, head_dim, "bhsd")
    kernel.forward(q, k, v, out=out, lse=lse)

    ar = torch.arange
    env = {"b": ar(batch)[:, None, None, None], "h": ar(num_heads)[None, :, None, None],
           "q_idx": ar(seqlen_q)[None, None, :, None], "kv_idx": ar(seqlen_k)[None, None, None, :]}
    allowed = torch.as_tensor(mask.ev(env)).expand(batch, num_heads, seqlen_q, seqlen_k).to(torch.int32)
    rule = dict(causal=causal, mask="allowed[b, h, q_idx, kv_idx] != 0", tensors={"allowed": allowed})
    results = check_attention(out, lse, q, k, v, **rule)
    if backward:
        do = _randn(seed + 3, *out.shape, dtype=dtype)
        results += check_gradients(kernel.backward(do, q, k, v, out, lse), q, k, v, do, **rule)
    assert all(r.ok for r in results), (mask.src, [str(r) for r in results])


BREAKS = {  # how one argument is broken -> (the argument the error must name, the change)
    "k dtype": ("k", lambda a: dict(a, k=a["k"].double())),
    "v dtype": ("v", lambda a: dict(a, v=a["v"].half() if a["v"].dtype == torch.float32 else a["v"].float())),
    "v seqlen": ("v", lambda a: dict(a, v=torch.cat([a["v"], a["v"][:, :, :1]], 2))),
    "k batch": ("k", lambda a: dict(a, k=torch.cat([a["k"], a["k"]], 0))),
    "k head dim": ("k", lambda a: dict(a, k=torch.cat([a["k"], a["k"][..., :1]], -1))),
    "k heads": ("k", lambda a: dict(a, k=torch.cat([a["k"]] * 3, 1), v=torch.cat([a["v"]] * 3, 1))),
    "v heads": ("v", lambda a: dict(a, v=torch.cat([a["v"], a["v"]], 1))),
    "q rank": ("q", lambda a: dict(a, q=a["q"][0])),
    "q integer": ("q", lambda a: dict(a, q=a["q"].long())),
    "q head dim": ("q", lambda a: dict(a, q=a["q"].new_zeros(*a["q"].shape[:3], 257))),
    "layout": ("layout", lambda a: dict(a, layout="bsdh")),
    "softmax_scale": ("softmax_scale", lambda a: dict(a, softmax_scale=-0.5)),
    "dropout_p": ("dropout_p", lambda a: dict(a, dropout_p=1.0)),
    "mask": ("mask", lambda a: dict(a, mask=a["mask"] + " +")),
    "tensor": ("lengths", lambda a: dict(a, lengths=a["q"])),
}


@settings(max_examples=30, **CI)
@given(mask=MASKS, nheads=heads(), seqlen=lengths, head_dim=st.sampled_from(HEAD_DIMS), dtype=dtypes,
       broken=st.sampled_from(sorted(BREAKS)))
@pytest.mark.interpreter
def test_bad_arguments_are_refused_cleanly(mask, nheads, seqlen, head_dim, dtype, broken):
    num_heads, num_kv_heads = nheads
    args = dict(q=torch.randn(2, num_heads, seqlen, head_dim).to(dtype),
                k=torch.randn(2, num_kv_heads, seqlen, head_dim).to(dtype),
                v=torch.randn(2, num_kv_heads, seqlen, head_dim).to(dtype), mask=mask.src)
    name, change = BREAKS[broken]
    with pytest.raises(CLEAN_ERRORS) as err:
        flashgen.attention(**change(args))
    assert name in str(err.value), (broken, str(err.value))


# ----------------------------------------------------------------------------- packed sequences
VARLEN_MASKS = st.one_of(
    st.none(),
    st.builds(lambda left, right: {"sliding_window": {"left": left, "right": right}}, st.integers(-1, 9),
              st.integers(-1, 9)),
    st.builds(lambda size: {"chunked": size}, st.integers(1, 20)),
    st.builds(lambda prefix: {"prefix_lm": prefix}, st.integers(0, 30)),
)


@st.composite
def packed(draw, min_len: int = 0):
    """(lengths_q, lengths_k) of 1 to 4 sequences, each at least min_len long (empty ones allowed by default)."""
    n = draw(st.integers(1, 4))
    seq = st.lists(st.integers(min_len, 40), min_size=n, max_size=n)
    return draw(seq), draw(seq)


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


@settings(max_examples=20, **CI)
@given(lens=packed(), nheads=heads(), head_dim=st.sampled_from(HEAD_DIMS), causal=st.booleans(), mask=VARLEN_MASKS,
       dtype=dtypes, config=configs, seed=st.integers(0, 2**31 - 1))
@pytest.mark.interpreter
def test_random_cu_seqlens_match_the_reference(lens, nheads, head_dim, causal, mask, dtype, config, seed):
    (lens_q, lens_k), (num_heads, num_kv_heads) = lens, nheads
    q = _randn(seed, sum(lens_q), num_heads, head_dim, dtype=dtype)
    k = _randn(seed + 1, sum(lens_k), num_kv_heads, head_dim, dtype=dtype)
    v = _randn(seed + 2, sum(lens_k), num_kv_heads, head_dim, dtype=dtype)
    cu_q, cu_k = _offsets(lens_q), _offsets(lens_k)
    out, lse = flashgen.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, mask=mask,
                                         config=config, return_lse=True)
    low = dtype == torch.float16
    ref, ref_lse = reference_varlen(q, k, v, cu_q, cu_k, causal=causal, mask=mask,
                                    compute_dtype=torch.float32 if low else torch.float64)
    pt, pt_lse = (reference_varlen(q, k, v, cu_q, cu_k, causal=causal, mask=mask, compute_dtype=dtype) if low
                  else (None, None))
    results = [compare("out", out, ref, pt), compare("lse", lse, ref_lse, pt_lse)]
    assert all(r.ok for r in results), (lens, mask, [str(r) for r in results])


# Invalid offsets: each case breaks one argument of a valid call, which the error must name.
INVALID = {
    "past the total": "cu_seqlens_{side}",  # the last offset beyond the packed tokens
    "negative": "cu_seqlens_{side}",
    "decreasing": "cu_seqlens_{side}",
    "max_seqlen too small": "max_seqlen_{side}",
}


@st.composite
def invalid_varlen(draw):
    lens_q, lens_k = draw(packed(min_len=1))
    side, how = draw(st.sampled_from(["q", "k"])), draw(st.sampled_from(sorted(INVALID)))
    lens = lens_q if side == "q" else lens_k
    cu, max_len = _offsets(lens).tolist(), max(lens)
    if how == "past the total":
        cu[-1] += draw(st.integers(1, 30))
    elif how == "negative":
        cu[draw(st.integers(1, len(lens)))] = -draw(st.integers(1, 10))
    elif how == "decreasing":  # swap two neighbours: every offset stays in range
        i = draw(st.integers(0, len(lens) - 1))
        cu[i], cu[i + 1] = cu[i + 1], cu[i]
    else:
        max_len -= draw(st.integers(1, max_len))
    return {"lens_q": lens_q, "lens_k": lens_k, "side": side, "how": how, "name": INVALID[how].format(side=side),
            "cu": cu, "max": max_len}


CHILD = textwrap.dedent("""
    import json, sys, torch, flashgen
    from flashgen.errors import SpecError
    for case in json.loads(sys.argv[1]):
        print("start", json.dumps(case), flush=True)
        cu = {s: [0] + torch.tensor(case["lens_" + s]).cumsum(0).tolist() for s in "qk"}
        most = {s: max(case["lens_" + s]) for s in "qk"}
        cu[case["side"]], most[case["side"]] = case["cu"], case["max"]
        q = torch.randn(sum(case["lens_q"]), 2, 16)
        k, v = (torch.randn(sum(case["lens_k"]), 2, 16) for _ in range(2))
        try:
            flashgen.attention_varlen(q, k, v, torch.tensor(cu["q"], dtype=torch.int32),
                                      torch.tensor(cu["k"], dtype=torch.int32), most["q"], most["k"])
            print("result", json.dumps({"refused": None}), flush=True)
        except (ValueError, TypeError, SpecError) as err:
            print("result", json.dumps({"refused": type(err).__name__, "message": str(err)}), flush=True)
""")


@settings(max_examples=2, **CI)  # each example is one child process
@given(cases=st.lists(invalid_varlen(), min_size=6, max_size=6))
def test_invalid_cu_seqlens_are_refused_naming_the_argument(cases):
    # A child process: an out-of-range offset corrupts memory under the interpreter today.
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=child_pythonpath(ROOT))
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)], capture_output=True, text=True, env=env,
                          timeout=300)
    lines = proc.stdout.splitlines()
    started = [json.loads(line[6:]) for line in lines if line.startswith("start ")]
    results = [json.loads(line[7:]) for line in lines if line.startswith("result ")]
    assert proc.returncode == 0, f"crashed ({proc.returncode}) on {started[-1] if started else None}"
    for case, result in zip(cases, results):
        assert result["refused"], f"accepted without an error: {case}"
        assert case["name"] in result["message"], (case, result["message"])
