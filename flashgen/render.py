"""Render (spec, config) into a Triton module, cache it by content, import it.

Rendering is pure: the same spec and config give byte-identical source. Rendered
files are written atomically into a content-addressed cache directory
(``FLASHGEN_CACHE_DIR``, else the platform's user cache dir) and imported from there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import jinja2
import platformdirs

from . import __version__
from .codegen.plan import plan_for
from .config import KernelConfig
from .spec import AttentionSpec

TEMPLATE = "attention.py.j2"


def template_dir() -> Path:
    """Where the Jinja templates are: inside the wheel (flashgen/templates) or,
    from a source tree or an editable install, the repository's templates/."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "templates", here.parent / "templates"):
        if (candidate / TEMPLATE).is_file():
            return candidate
    raise FileNotFoundError(f"flashgen templates not found next to {here}; the installation is incomplete")


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def templates_hash() -> str:
    """A hash of every template's text: results tuned with other templates are stale."""
    h = hashlib.sha256()
    for path in sorted(template_dir().glob("*.j2")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _literal(data: dict) -> str:
    """A dict as Python source, one key a line, in the dict's order."""
    lines = "".join(f"    {key!r}: {value!r},\n" for key, value in data.items())
    return "{\n" + lines + "}"


def render(spec: AttentionSpec, config: KernelConfig, template: str = TEMPLATE) -> str:
    """The Triton module source for this spec and config."""
    spec_dict = spec.to_dict()
    spec_dict["softmax_scale"] = spec.scale
    spec_dict.pop("tune")
    return _environment().get_template(template).render(
        version=__version__,
        template=template,
        spec=spec,
        plan=plan_for(spec),
        config=config,
        dropout=spec.dropout_p > 0,
        spec_literal=_literal(spec_dict),
        config_literal=_literal(config.to_dict()),
    )


def cache_dir() -> Path:
    root = os.environ.get("FLASHGEN_CACHE_DIR") or platformdirs.user_cache_dir("flashgen")
    return Path(root) / f"v{__version__}" / "kernels"


def write_atomic(path: Path, text: str) -> None:
    """Write text to path so that readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cached_source_path(spec: AttentionSpec, source: str) -> Path:
    """Write the source into the content-addressed cache (only when the content differs)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    path = cache_dir() / f"{spec.uri}-{digest}.py"
    try:
        if path.read_text() == source:
            return path
    except (OSError, UnicodeDecodeError):
        pass  # missing or broken: (re)write it
    write_atomic(path, source)
    return path


_import_lock = threading.Lock()


def import_path(path: Path) -> ModuleType:
    """Import a rendered module from its file (once per path)."""
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


def load(spec: AttentionSpec, config: KernelConfig, template: str = TEMPLATE) -> ModuleType:
    """Render, cache and import the module for (spec, config)."""
    return import_path(cached_source_path(spec, render(spec, config, template)))
