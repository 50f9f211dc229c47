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
