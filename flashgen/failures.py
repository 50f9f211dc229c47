"""Typed trial failures, after Kernel Tuner's InvalidConfig / CompilationFailedConfig / RuntimeFailedConfig.

A trial runs in stages: restriction check, config validation, render and import, compile,
launch, run, verify, time. Each stage turns what it raises into the failure of that stage,
so a failure's type says WHERE the config failed, never what its message looked like. The
tuner stores every failure, never retries it and never chooses it. ``status`` is the string
the results database stores; the strings are those of the first schema, so stored results
stay readable.

Triton compiles a kernel on its first launch, so "compile" and "run" happen inside one call.
``launching()`` tells them apart by watching Triton's JIT hooks (``jit_cache_hook`` is called
before a compile, ``jit_post_compile_hook`` after): what fails between the two failed to
compile. It sets those process-wide hooks while any thread is inside it (chaining any already
set), and each thread sees its own compiles: the tuner verifies configs in threads side by side.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager


class FailedConfig(Exception):
    """A config that failed a stage of its trial. ``margin`` is the verifier's, where it got that far."""

    status = "error"

    def __init_subclass__(cls, *, status: str, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.status = status

    def __init__(self, detail: str, *, margin: float | None = None):
        super().__init__(detail)
        self.detail = detail
        self.margin = margin

    @classmethod
    def caused_by(cls, err: BaseException) -> "FailedConfig":
        return cls(f"{type(err).__name__}: {str(err)[:2000]}")


class InvalidConfig(FailedConfig, status="restricted"):
    """Breaks a restriction of the search space, or is no valid config: never rendered or compiled."""


class CompilationFailedConfig(FailedConfig, status="compile_error"):
    """Rendering or importing its module failed, or Triton's compiler did."""


class RuntimeFailedConfig(FailedConfig, status="error"):
    """Compiled, then failed while it ran (or while its output was checked)."""


class OutOfResourcesConfig(RuntimeFailedConfig, status="out_of_resources"):
    """Compiled, but Triton refused the launch: more shared memory, tensor memory or threads than the device has."""


class WrongResultConfig(FailedConfig, status="wrong_result"):
    """Ran, and its output broke the error rule of ../shared/TESTING.md."""


class TimedOutConfig(FailedConfig, status="timeout"):
    """Took longer than the trial's time limit."""


FAILURES = (InvalidConfig, CompilationFailedConfig, RuntimeFailedConfig, OutOfResourcesConfig, WrongResultConfig,
            TimedOutConfig)
STATUSES = ("ok", *(f.status for f in FAILURES))


@contextmanager
def stage(failure: type[FailedConfig]):
    """One stage of a trial: an exception raised in it becomes `failure` (a FailedConfig passes through)."""
    try:
        yield
    except FailedConfig:
        raise
    except Exception as err:
        raise failure.caused_by(err) from err


@contextmanager
def launching():
    """Running kernels, which Triton compiles on their first launch: an exception raised while
    Triton's JIT compiles is a compile failure (as are Triton's compiler errors), Triton's
    OutOfResources (raised when a compiled binary is loaded for launch) is out of resources,
    anything else a runtime failure."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources, PTXASError

    watch = _CompileWatch()
    try:
        with watch:
            yield
    except FailedConfig:
        raise
    except Exception as err:
        if watch.compiling or isinstance(err, (CompilationError, PTXASError)):
            failure = CompilationFailedConfig.caused_by(err)
            crash = _ptxas_signal(err) if isinstance(err, PTXASError) else None
            if crash:  # not the config's resources or code: ptxas itself died on this kernel
                failure.detail = f"ptxas crashed ({crash}, a ptxas bug) on this kernel; {failure.detail}"
            if watch.compiling and watch.kernel:
                failure.detail = f"compiling {watch.kernel}: {failure.detail}"
            failure.args = (failure.detail,)
            raise failure from err
        if isinstance(err, OutOfResources):
            raise OutOfResourcesConfig.caused_by(err) from err
        raise RuntimeFailedConfig.caused_by(err) from err


def _ptxas_signal(err) -> str | None:
    """The signal that killed ptxas ('SIGSEGV'), from Triton's PTXASError ('error code -11' in
    triton 3.6, '`ptxas` raised SIGSEGV' in later ones); None when ptxas exited on its own."""
    import re
    import signal

    text = str(err)
    found = re.search(r"error code -(\d+)", text)
    if found:
        try:
            return signal.Signals(int(found.group(1))).name
        except ValueError:
            return f"signal {found.group(1)}"
    found = re.search(r"raised (SIG[A-Z]+)", text)
    return found.group(1) if found else None


class _CompileWatch:
    """Knows whether Triton's JIT is compiling in this thread, and which kernel, from its pre- and
    post-compile hooks. The hooks are Triton's process-wide knobs: they are installed once while
    any watch is open (the hooks found there are called on, and put back when the last closes),
    and report to the innermost open watch of the thread that compiles. Watches open in several
    threads at once (the tuner's final round and recheck verify configs side by side) neither
    see each other's compiles nor leave a closed watch's hooks installed."""

    _lock = threading.Lock()
    _open = 0  # watches open, all threads
    _previous = (None, None)  # the hooks found when the first opened
    _threads = threading.local()  # .watch: this thread's innermost open watch

    def __init__(self):
        self.compiling = False
        self.kernel = None  # the name of the kernel being compiled (or last compiled)
        self._outer = None
        self._runtime = None

    @staticmethod
    def _before(**info):
        watch = getattr(_CompileWatch._threads, "watch", None)
        if watch is not None:
            watch.compiling = True
            watch.kernel = str(info.get("repr") or "").split("[")[0] or None
        # A true result from the hook would tell Triton to skip the compile: pass on the earlier hook's.
        before = _CompileWatch._previous[0]
        return before(**info) if before else None

    @staticmethod
    def _after(**info):
        watch = getattr(_CompileWatch._threads, "watch", None)
        if watch is not None:
            watch.compiling = False
        after = _CompileWatch._previous[1]
        return after(**info) if after else None

    def __enter__(self):
        import triton

        self._runtime = getattr(getattr(triton, "knobs", None), "runtime", None)  # triton >= 3.4
        if self._runtime is not None:
            with _CompileWatch._lock:
                if _CompileWatch._open == 0:
                    _CompileWatch._previous = (self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook)
                    self._runtime.jit_cache_hook = _CompileWatch._before
                    self._runtime.jit_post_compile_hook = _CompileWatch._after
                _CompileWatch._open += 1
        self._outer = getattr(_CompileWatch._threads, "watch", None)
        _CompileWatch._threads.watch = self
        return self

    def __exit__(self, *exc):
        _CompileWatch._threads.watch = self._outer
        if self._runtime is not None:
            with _CompileWatch._lock:
                _CompileWatch._open -= 1
                if _CompileWatch._open == 0:
                    self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook = _CompileWatch._previous
                    _CompileWatch._previous = (None, None)
        return False
