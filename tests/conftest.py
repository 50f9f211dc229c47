"""Test setup: the Triton interpreter on machines without a GPU, a private kernel cache,
and the ``gpu`` marker, whose tests skip cleanly where no CUDA device is present."""

import os
import tempfile

import pytest
import torch

HAS_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
if not HAS_GPU:
    # Must be set before any rendered kernel module is imported (@triton.jit reads it).
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("FLASHGEN_CACHE_DIR", tempfile.mkdtemp(prefix="flashgen-test-cache-"))


def _patch_language_once_per_launch() -> None:
    """Triton's interpreter re-patches triton.language (inspect.getmembers over four modules) on
    every call of a jit function from a running kernel, though the launch patched them already and
    restores them when it ends; flashgen's kernels call many small helpers, so the CPU suite spent
    a third of its interpreter time there (tests/test_backward.py's slowest case: 13.8 s, 8.4 with
    this). Within a launch, a function whose module's globals were patched already is not patched
    again; one from another module (triton.language.standard's zeros, reading tl.core) still is,
    as Triton does it. Only where the interpreter's internals are the ones this knows."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is None or not hasattr(interpreter, "GridExecutor"):
        return
    launches = []  # per running launch: the ids of the globals whose language modules are patched

    class Patched:
        def restore(self):
            pass

    def once_per_launch(fn):
        key = id(fn.__globals__)
        if launches:  # a call from inside a kernel
            if key in launches[-1]:
                return Patched()
            launches[-1].add(key)
            return patch_lang(fn)
        scope = patch_lang(fn)  # a launch: GridExecutor restores its scope when the grid has run
        launches.append({key})
        restore = scope.restore

        def restore_and_end():
            launches.pop()
            restore()

        scope.restore = restore_and_end
        return scope

    interpreter._patch_lang = once_per_launch


if not HAS_GPU:
    _patch_language_once_per_launch()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with `python3 -m pytest -m gpu` on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """Where the kernels run: the GPU if there is one, else the CPU through the interpreter."""
    return "cuda" if HAS_GPU else "cpu"
