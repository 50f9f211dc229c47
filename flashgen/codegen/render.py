"""Render (spec, config) into a Triton module's source, and build (render, cache, import) it.

Rendering is pure: the same spec and config give byte-identical source. templates/ holds an
entry template (attention.py.j2) that includes one partial per kernel family and per shared
piece; the host side is plain Python (flashgen/runtime/host.py and decode.py), imported by the modules
flashgen builds and pasted verbatim into standalone ones (what `flashgen generate` writes).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import jinja2

from .. import __version__
from ..config import KernelConfig
from ..expr.to_triton import triton_literal
from ..runtime import decode, host, launch
from ..spec import AttentionSpec
from .cache import cached_source_path, import_path
from .plan import plan_for

TEMPLATE = "attention.py.j2"


def template_dir() -> Path:
    """Where the Jinja templates are: inside the wheel (flashgen/templates) or,
    from a source tree or an editable install, the repository's templates/."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "templates", package.parent / "templates"):
        if (candidate / TEMPLATE).is_file():
            return candidate
    raise FileNotFoundError(f"flashgen templates not found next to {package}; the installation is incomplete")


# The lines of host.py that import launch.py's names and of decode.py that import host.py's: a
# standalone module has pasted the imported file just before, so it drops them.
LAUNCH_IMPORT_MARK = "# standalone: launch.py precedes"
HOST_IMPORT_MARK = "# standalone: host.py precedes"


def _pasted(path: str, mark: str) -> str:
    lines = Path(path).read_text().splitlines(keepends=True)
    return "".join(line for line in lines if mark not in line)


def host_source() -> str:
    """The host side's source, as pasted into standalone modules: launch.py, then host.py."""
    return Path(launch.__file__).read_text() + "\n\n" + _pasted(host.__file__, LAUNCH_IMPORT_MARK)


def decode_source() -> str:
    """The decode host module's source, as pasted into standalone modules (after host.py)."""
    return _pasted(decode.__file__, HOST_IMPORT_MARK)


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


# Kernel families whose configs the tuner stores: a tuned result names the templates hash
# of these. Decode (templates/decode/) is not tuned yet, so its kernels do not stale them.
TUNED_FAMILIES_SKIP = ("decode/",)


def templates_hash() -> str:
    """A hash of the templates the tuned kernels are rendered from (every partial of the prefill
    and backward families and of common/): results tuned with other ones are stale.

    Host code (runtime/) is left out on purpose: the tuner times the kernels' GPU time, which the
    templates and the config decide; a change of launch code that alters what a kernel computes
    or how it is gridded must show in a template or in the config."""
    h = hashlib.sha256()
    root = template_dir()
    for path in sorted(root.rglob("*.j2"), key=lambda p: p.relative_to(root).as_posix()):
        name = path.relative_to(root).as_posix()
        if name.startswith(TUNED_FAMILIES_SKIP):
            continue
        h.update(name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _value_source(value) -> str:
    """A plain value (None, bool, int, float, str, or a list or dict of them) as Python source.

    Written from the base types (``int.__repr__``, ``str.__repr__``), never through the value's
    own __repr__: what lands in the generated module is data, whatever object was passed in.
    """
    if value is None or isinstance(value, bool):
        return str(bool(value)) if value is not None else "None"
    if isinstance(value, (int, float)):
        return triton_literal(value)
    if isinstance(value, str):
        return str.__repr__(value)
    if isinstance(value, list):
        return "[" + ", ".join(_value_source(v) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + "".join(_value_source(v) + ", " for v in value)[:-2] + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_value_source(k)}: {_value_source(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write a {type(value).__name__} into a generated module")


def _literal(data: dict) -> str:
    """A dict as Python source, one key a line, in the dict's order."""
    lines = "".join(f"    {_value_source(key)}: {_value_source(value)},\n" for key, value in data.items())
    return "{\n" + lines + "}"


def spec_constants(spec: AttentionSpec) -> dict:
    """The values the kernels read as module-level constexpr globals."""
    return {
        "head_dim": spec.head_dim,
        "head_dim_v": spec.head_dim_v,
        "block_d": host.padded_head_dim(spec.head_dim),
        "block_dv": host.padded_head_dim(spec.head_dim_v),
        "gqa_group": spec.gqa_group,
        "dot_precision": "ieee" if spec.dtype == "fp32" else "tf32",
    }


def render(spec: AttentionSpec, config: KernelConfig, template: str = TEMPLATE, *, standalone: bool = True) -> str:
    """The Triton module source for this spec and config. standalone: the host side pasted in,
    so the module needs only torch and triton; otherwise it imports flashgen.runtime.host."""
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
        constants=spec_constants(spec),
        spec_literal=_literal(spec_dict),
        config_literal=_literal(config.to_dict()),
        standalone=standalone,
        host_source=host_source().rstrip("\n") if standalone else "",
        decode_source=decode_source().rstrip("\n") if standalone else "",
    )


def build_module(spec: AttentionSpec, config: KernelConfig, template: str = TEMPLATE) -> ModuleType:
    """Render, cache and import the module for (spec, config); it imports the host side."""
    return import_path(cached_source_path(spec.uri, render(spec, config, template, standalone=False)))
