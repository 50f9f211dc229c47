"""flashgen's patches of Triton's CPU interpreter (flashgen/runtime/interpret.py): triton.language is
patched once per launch and module, not on every call of a jit helper, and kernels compute the same;
a computed scalar indexes as in Triton 3.9 (Triton 3.6's int() of its array fails on NumPy 2.4); integer
ops are not computed twice for overflow checks whose assert is dropped; dtype lookups are kept."""

import pytest
import torch
import triton
import triton.language as tl

import flashgen  # noqa: F401 (installs the patch under the interpreter)
from flashgen.runtime.interpret import (index_scalars_as_newer_triton, numpy_dtypes_once, patch_language_once_per_launch,
                                        skip_discarded_overflow_checks)

pytestmark = pytest.mark.interpreter  # the interpreter's patches


@triton.jit
def _twice(x):
    return x * 2.0


@triton.jit
def _count_to(OUT, n, STEP: tl.constexpr):
    total = 0
    for i in range(0, tl.minimum(n, 100), STEP):  # a computed scalar bound: the interpreter indexes it
        total += i
    tl.store(OUT, total)


@triton.jit
def _helpers_in_a_loop(X, OUT, N: tl.constexpr, CALLS: tl.constexpr):
    offs = tl.arange(0, N)
    acc = tl.zeros([N], dtype=tl.float32)  # a helper from another module (triton.language.standard)
    for _ in range(CALLS):
        acc += _twice(tl.load(X + offs))
    tl.store(OUT + offs, acc)


def test_language_is_patched_once_per_launch_and_module(monkeypatch):
    from triton.runtime import interpreter

    assert patch_language_once_per_launch()  # installed at import (and installing again is a no-op)
    assert interpreter._patch_lang.once_per_launch
    scans = []
    builtin = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: (scans.append(a[0]), builtin(*a))[1])
    x = torch.randn(16)
    for calls in (1, 12):
        out = torch.empty(16)
        scans.clear()
        _helpers_in_a_loop[(2,)](x, out, N=16, CALLS=calls)
        torch.testing.assert_close(out, 2 * calls * x)
        # the launch's modules (tl, tl.tensor, tl.math, descriptors) and those of helpers from other
        # modules (tl.zeros: tl.core) once per launch: 7 and 10 scans here. Triton's interpreter alone
        # scans them again on every helper call: 21 and 112.
        assert len(scans) <= 12, (calls, len(scans))


def test_scalar_arguments_index_as_in_newer_triton():
    # Triton 3.6's interpreter took int() of a computed scalar's one-element 1-d array, which NumPy
    # 2.4 refuses: kernels looping up to a clamped length failed there. Triton 3.9 squeezes first.
    import numpy as np
    from triton.runtime import interpreter

    assert interpreter._patch_lang_tensor.squeezes_scalars  # installed at import
    assert index_scalars_as_newer_triton()  # and installing again is a no-op

    class Scalar:
        pass

    scope = interpreter._LangPatchScope()
    interpreter._patch_lang_tensor(Scalar, scope)
    try:
        one = Scalar()
        one.handle = type("Handle", (), {"data": np.array([7], dtype=np.int32)})()
        assert list(range(0, one, 3)) == [0, 3, 6]
    finally:
        scope.restore()
    assert not hasattr(Scalar, "__index__")  # restored with the launch's other patches
    out = torch.zeros(1, dtype=torch.int32)
    _count_to[(1,)](out, 10, STEP=3)
    assert out.item() == 0 + 3 + 6 + 9


@triton.jit
def _int_arithmetic(X, OUT, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    tl.store(OUT + offs, (x + 3) * x - 5)


def test_overflow_checks_whose_assert_is_dropped_are_not_computed(monkeypatch):
    # without debug, semantic.device_assert drops the sanitizer's assert: its int64 copies of each int32 add,
    # sub and mul were computed for nothing (40% of a backward test's interpreted time)
    from triton.language import semantic
    from triton.runtime import interpreter

    assert skip_discarded_overflow_checks()  # installed at import (and installing again is a no-op)
    assert not interpreter.interpreter_builder.options.sanitize_overflow
    assert not interpreter.interpreter_builder.options.debug  # (with debug, the checks would stay)
    x = torch.arange(-8, 8, dtype=torch.int32)
    out = torch.empty_like(x)
    _int_arithmetic[(1,)](x, out, N=16)
    assert torch.equal(out, (x + 3) * x - 5)
    casts = []
    cast = semantic.TritonSemantic.cast
    monkeypatch.setattr(semantic.TritonSemantic, "cast", lambda self, v, t, *a, **k: (casts.append(t), cast(
        self, v, t, *a, **k))[1])
    _int_arithmetic[(1,)](x, out, N=16)
    assert not [t for t in casts if t == tl.int64]  # no int64 copy of the operands


def test_numpy_dtypes_are_looked_up_once():
    import numpy as np
    from triton.runtime import interpreter

    assert numpy_dtypes_once() and interpreter._get_np_dtype.once
    get = interpreter._get_np_dtype
    assert get(tl.float16) == np.float16 and get(tl.bfloat16) == np.uint16 and get(tl.int1) == np.bool_
    assert get(tl.block_type(tl.float32, [4, 8])) == np.float32
    assert get(tl.pointer_type(tl.float16)) == np.uint64
    assert get(tl.block_type(tl.pointer_type(tl.int8), [16])) == np.uint64
