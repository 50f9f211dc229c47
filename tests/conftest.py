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


def _interpreter_descriptor_reduce():
    """Triton's interpreter (3.6 to 3.9) has no tensor-descriptor reduce (`desc.atomic_add`, the
    copy engine's bulk reduce-add that the backward's TMA atomic dQ uses): give it one, an
    element-wise add into the tile's in-bounds elements (programs run one at a time there, so this
    is exact), so the CPU tests run that kernel path; the GPU tests run the hardware's."""
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    def create_descriptor_reduce(self, kind, desc, value, indices):
        if kind != ir.DESCRIPTOR_REDUCE_KIND.ADD:
            raise NotImplementedError(f"descriptor reduce {kind} (only ADD is emulated)")
        ptrs, mask = desc.materialize_pointers(indices)
        op = ir.ATOMIC_OP.FADD if value.dtype.scalar.is_floating() else ir.ATOMIC_OP.ADD
        return self.create_atomic_rmw(op, ptrs, value, mask, ir.MEM_SEMANTIC.RELAXED, ir.MEM_SYNC_SCOPE.GPU)

    if not hasattr(interpreter.InterpreterBuilder, "create_descriptor_reduce"):
        interpreter.InterpreterBuilder.create_descriptor_reduce = create_descriptor_reduce


if not HAS_GPU:
    _interpreter_descriptor_reduce()


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
