"""flashgen's patch of Triton's CPU interpreter (flashgen/runtime/interpret.py): triton.language is
patched once per launch and module, not on every call of a jit helper; kernels compute the same."""

import pytest
import torch
import triton
import triton.language as tl

import flashgen  # noqa: F401 (installs the patch under the interpreter)
from flashgen.config import interpreting
from flashgen.runtime.interpret import patch_language_once_per_launch

pytestmark = pytest.mark.skipif(not interpreting(), reason="the interpreter's patch (CPU runs only)")


@triton.jit
def _twice(x):
    return x * 2.0


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
