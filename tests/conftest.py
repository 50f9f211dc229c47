"""Test setup: the Triton interpreter on machines without a GPU, a private kernel cache,
and the ``gpu`` marker, whose tests skip cleanly where no CUDA device is present."""

import atexit
import collections
import os
import shutil
import tempfile

import pytest
import torch

HAS_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
if not HAS_GPU:
    # Must be set before any rendered kernel module is imported (@triton.jit reads it).
    os.environ["TRITON_INTERPRET"] = "1"


def _private_dir(prefix):
    """A temporary directory of this process's own, removed when it exits (pytest-xdist's workers inherit the
    controller's, and make none; a run left its 37 MB kernel cache and an empty directory per worker in /tmp
    before)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


if "FLASHGEN_CACHE_DIR" not in os.environ:
    os.environ["FLASHGEN_CACHE_DIR"] = _private_dir("flashgen-test-cache-")
# A results database of the run's own: calls that look up tuned configs (flashgen.attention, load, show) read
# the user's database otherwise, so the configs a test gets would depend on what this machine has tuned.
if "FLASHGEN_DB" not in os.environ:
    os.environ["FLASHGEN_DB"] = f"sqlite:///{_private_dir('flashgen-test-db-')}/tuning.sqlite"


def pytest_collection_modifyitems(config, items):
    # A process runs Triton's kernels either compiled or interpreted (@triton.jit chooses at import),
    # so the tests that pass CPU tensors to kernels run where the interpreter is on, and the GPU
    # tests where it is off; a GPU machine runs the others with `TRITON_INTERPRET=1 python3 -m pytest`.
    if HAS_GPU:
        marker, reason = "interpreter", ("runs CPU tensors through Triton's interpreter (on a GPU machine: "
                                         "`TRITON_INTERPRET=1 python3 -m pytest`)")
    elif torch.cuda.is_available():  # a GPU machine with TRITON_INTERPRET set
        marker, reason = "gpu", "a compiled GPU test: run it without TRITON_INTERPRET"
    else:
        marker, reason = "gpu", "needs a CUDA GPU (run with `python3 -m pytest -m gpu` on one)"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)
    # The longest single test first: pytest-xdist hands each worker the collection's items in order, so a
    # four-minute test collected late ran alone at the end of the run while the other worker sat idle
    # (CI, 2 cores: it started at 93%). The sort is stable: every other test keeps its place.
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in RUN_FIRST)


RUN_FIRST = ("tests/test_sm90_compile.py",)  # (its child process compiles 75 kernels for sm90: ~4 minutes)


_RECENT = collections.deque(maxlen=6)  # this worker's last tests, for a fault's message


@pytest.fixture(autouse=True)
def _faults_fail_the_test_that_launched_them(request):
    """On a GPU, wait for each test's kernels at its end: a fault they raise (an illegal memory access) then fails
    the test that launched them, in its teardown, not whichever later test of the same pytest-xdist worker syncs
    first (the full GPU suite met one now and then at the first line of test_packed_rows_past_2_31_elements
    [max_seqlen past it], which passes alone, and every later test of that worker failed after it). The error
    names the tests this worker ran before, whose kernels or leftovers it may come from."""
    _RECENT.append(request.node.nodeid)
    yield
    if HAS_GPU and torch.cuda.is_initialized():
        try:
            torch.cuda.synchronize()
        except RuntimeError as err:
            raise RuntimeError(f"{err}\nthis worker's tests up to this one: {list(_RECENT)}") from None


@pytest.fixture
def device():
    """Where the kernels run: the GPU if there is one, else the CPU through the interpreter."""
    return "cuda" if HAS_GPU else "cpu"


@pytest.fixture(scope="session")
def postgres_url():
    """An empty-able PostgreSQL database of this pytest-xdist worker's own, on the server that
    FLASHGEN_TEST_POSTGRES_URL names (.ci/run starts one where it can); None without one. The store
    tests drop every table around each case, so two workers sharing one database dropped each
    other's tables mid-test (test_db's concurrent writers deadlocked under `-n 2`)."""
    base = os.environ.get("FLASHGEN_TEST_POSTGRES_URL")
    worker_id = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...; unset without workers
    if not base or not worker_id:
        return base
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    url = make_url(base)
    name = f"{url.database}_{worker_id}"
    engine = create_engine(base, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            if not conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": name}).scalar():
                conn.execute(text(f'CREATE DATABASE "{name}"'))
    finally:
        engine.dispose()
    return url.set(database=name).render_as_string(hide_password=False)
