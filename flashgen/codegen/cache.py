"""The kernel cache: rendered modules written by content, and imported from there.

Files live in ``$FLASHGEN_CACHE_DIR`` (else the platform's user cache dir), under
``v<version>/kernels/<name>-<hash of the source>.py``, written atomically and only when the
content differs; a broken entry is rewritten, never raised. Where an entry cannot be written
(the directory is read-only, or the entry's name is taken by a directory), the module is
written into a private temporary directory instead, with one warning that says why.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from types import ModuleType

import platformdirs

from .. import __version__


class KernelCacheWarning(UserWarning):
    """The kernel cache cannot be written where it should be; a temporary directory serves instead."""


def cache_dir() -> Path:
    root = os.environ.get("FLASHGEN_CACHE_DIR") or platformdirs.user_cache_dir("flashgen")
    return Path(root) / f"v{__version__}" / "kernels"


def _new_file_mode(path: Path) -> int:
    """The mode path keeps when it exists, else the one open() gives a new file (0o666 less the
    umask, read from /proc where there is one: setting it to read it would race other threads)."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        pass
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o644


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write text (or bytes) to path so that readers see the old file or the whole new one, with the mode a
    plain write would leave (mkstemp's 0600 made `generate -o` and `export` files private)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = _new_file_mode(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            if hasattr(os, "fchmod"):  # (not on Windows before Python 3.13)
                os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_fallback_lock = threading.Lock()
_fallback: Path | None = None
_warned: set[str] = set()


def _fallback_dir(path: Path, err: OSError) -> Path:
    """The private temporary directory that stands in for the cache (made once per process),
    and one warning per cache directory naming where writing failed and why."""
    global _fallback
    with _fallback_lock:
        if _fallback is None:
            _fallback = Path(tempfile.mkdtemp(prefix="flashgen-kernels-"))
            atexit.register(shutil.rmtree, _fallback, ignore_errors=True)  # nothing left in the temp dir
        where = str(path.parent)
        if where not in _warned:
            _warned.add(where)
            setting = ("FLASHGEN_CACHE_DIR=" + os.environ["FLASHGEN_CACHE_DIR"]) if os.environ.get(
                "FLASHGEN_CACHE_DIR") else "the user cache dir"
            reason = ("is a directory" if path.is_dir() else
                      f"cannot be written ({err.strerror or type(err).__name__})")
            warnings.warn(f"flashgen: the kernel cache entry {path} ({setting}) {reason}; writing kernels to "
                          f"{_fallback} instead", KernelCacheWarning, stacklevel=4)
        return _fallback


def _holds(path: Path, source: str) -> bool:
    try:
        return path.read_text() == source
    except (OSError, UnicodeDecodeError):
        return False  # missing, broken, or not a file: (re)write it


def cached_source_path(name: str, source: str) -> Path:
    """A file holding the source, in the content-addressed cache (written only when the
    content differs), or in the temporary stand-in where the cache cannot be written."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    path = cache_dir() / f"{name}-{digest}.py"
    if _holds(path, source):
        return path
    try:
        write_atomic(path, source)
        return path
    except OSError as err:
        path = _fallback_dir(path, err) / path.name
    if not _holds(path, source):
        write_atomic(path, source)
    return path


_import_lock = threading.Lock()


def import_path(path: Path) -> ModuleType:
    """Import a rendered module from its file (once per file name: the name holds the content hash)."""
    name = "flashgen_kernels." + path.stem.replace("-", "_").replace(".", "_")
    with _import_lock:
        module = sys.modules.get(name)
        if module is not None:
            return module
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # Triton's @jit needs the real file for its source
        sys.modules[name] = module
        return module
