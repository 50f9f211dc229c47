"""Render (spec, config) into a Triton module's source, and build (render, cache, import) it.

Rendering is pure: the same spec and config give byte-identical source. templates/ holds an
entry template (attention.py.j2) that includes one partial per kernel family and per shared
piece; the host side is plain Python (flashgen/runtime/host.py and decode.py), imported by the modules
flashgen builds and pasted verbatim into standalone ones (what `flashgen generate` writes).
"""

from __future__ import annotations

import ast
import hashlib
import io
import tokenize
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import jinja2

from .. import __version__
from ..config import DEFAULT_BUCKETS, KernelConfig, default_config, mask_shape
from ..expr.to_triton import triton_literal
from ..runtime import decode, hopper, hopper_bwd, host, interpret, launch
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
HOPPER_IMPORT_MARK = "standalone: hopper.py precedes"


def _pasted(path: str, mark: str) -> str:
    lines = Path(path).read_text().splitlines(keepends=True)
    return "".join(line for line in lines if mark not in line)


def host_source() -> str:
    """The host side's source, as pasted into standalone modules: launch.py, then host.py."""
    return Path(launch.__file__).read_text() + "\n\n" + _pasted(host.__file__, LAUNCH_IMPORT_MARK)


def hopper_source() -> str:
    """The Hopper family's host side (runtime/hopper.py), pasted into standalone hopper_ws modules."""
    return _pasted(hopper.__file__, HOST_IMPORT_MARK)


def interpret_source() -> str:
    """The interpreter's patches (runtime/interpret.py), pasted into standalone modules."""
    return Path(interpret.__file__).read_text()


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


# Kernel families whose configs the tuner stores: a tuned result's environment names the
# templates hash of these. Decode (templates/decode/) is not tuned yet, so it is left out.
TUNED_FAMILIES_SKIP = ("decode/",)


def templates_hash() -> str:
    """A hash of the templates the tuned kernels are rendered from (every partial of the prefill
    and backward families and of common/), recorded in each result's environment. A result
    is matched on its kernel_hash; only one stored without (before schema 4) is matched on
    this, and is stale when it differs.

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


# What each tuned phase times, as the rendered module hands it to its launcher
# (runtime/host.py AttentionLauncher): the arguments that name the phase's kernels.
TIMED_KERNELS = {  # the launcher's keyword arguments, and the Gluon kernels handed to it after (_LAUNCHER.hopper_*)
    "fwd": ("forward_kernel", "block_map_kernel", "hopper_forward"),
    "bwd": ("preprocess_kernel", "dkdv_kernel", "dq_kernel", "short_kernel", "block_map_kernel", "hopper_backward"),
}
LAUNCHER = "_LAUNCHER"  # the module global holding the AttentionLauncher
# Kernels handed to a Gluon family's launcher that no tuned result times: packed sequences' forward (the tuner
# times dense calls; a packed call runs the config the dense calls were tuned for)
UNTIMED_KERNELS = ("packed", "packed_persistent")


def timed_source(source: str, phase: str) -> str:
    """The part of a rendered module that decides the GPU time of ``phase`` ("fwd" or "bwd"):
    the @triton.jit functions its kernels reach (them, the helpers they call, and so on), the
    module constants those read (HEAD_DIM, ...) and the launcher's literal settings
    (same_seqlen, ...), without comments or blank lines, in name order.

    Left out: the header, SPEC and CONFIG (the config is stored beside its result), the host
    code, the kernels of other phases, decode and test-only kernels. So a template change
    that leaves these kernels' code alone (a comment, another family, a moved function) does
    not change it. Plain text throughout (ast only finds where things are), so it is the same
    under every Python and Triton version."""
    if phase not in TIMED_KERNELS:
        raise ValueError(f"phase: expected one of {', '.join(TIMED_KERNELS)}, got {phase!r}")
    tree = ast.parse(source)
    lines = source.splitlines()
    jit, constants, attached = {}, {}, {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list):
            jit[node.name] = node
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            constants[node.targets[0].id] = node
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Attribute)
              and isinstance(node.targets[0].value, ast.Name) and node.targets[0].value.id == LAUNCHER
              and isinstance(node.value, ast.Call) and node.value.args and isinstance(node.value.args[0], ast.Name)):
            # _LAUNCHER.hopper_forward = HopperForward(kernel, ..., ranges=kernel2): the kernels it launches
            attached[node.targets[0].attr] = [node.value.args[0]] + [kw.value for kw in node.value.keywords
                                                                     if isinstance(kw.value, ast.Name)
                                                                     and kw.arg not in UNTIMED_KERNELS]
    launcher = constants[LAUNCHER].value
    settings = [f"{kw.arg}={ast.literal_eval(kw.value)!r}" for kw in sorted(launcher.keywords, key=lambda kw: kw.arg)
                if isinstance(kw.value, ast.Constant)]
    kernels = {**{kw.arg: [kw.value] for kw in launcher.keywords}, **attached}  # name -> the kernels it launches
    todo = [n.id for name in TIMED_KERNELS[phase] for n in kernels.get(name, ())]
    reached: dict[str, ast.stmt] = {}
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached[name] = jit.get(name) or constants[name]
        todo += [n.id for n in ast.walk(reached[name]) if isinstance(n, ast.Name) and n.id != name
                 and (n.id in jit or n.id in constants)]
    pieces = ["\n".join(settings)]
    for name in sorted(reached):
        node = reached[name]
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        pieces.append(_without_comments(lines[first - 1:node.end_lineno]))
    return "\n".join(pieces) + "\n"


def _is_jit(decorator) -> bool:
    """``@triton.jit`` or ``@triton.jit(...)``."""
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "jit"


def _without_comments(lines: list[str]) -> str:
    """Source lines with comments, trailing spaces and blank lines taken out."""
    cuts: dict[int, int] = {}
    for token in tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline):
        if token.type == tokenize.COMMENT:
            cuts[token.start[0] - 1] = token.start[1]
    kept = (line[:cuts.get(i, len(line))].rstrip() for i, line in enumerate(lines))
    return "\n".join(line for line in kept if line)


@lru_cache(maxsize=256)
def kernel_hash(spec: AttentionSpec, config: KernelConfig, phase: str) -> str:
    """A hash of the kernels that ``phase`` times for (spec, config) (see timed_source). A
    tuned result stores it: the result serves as long as this flashgen renders the same
    kernels for its spec and config, whatever else changed in the templates. Cached: a
    lookup renders each stored config of the spec once per process."""
    source = timed_source(render(spec, config, standalone=False), phase)
    return hashlib.sha256(source.encode()).hexdigest()[:16]


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
    config.check_spec(spec)  # a kernel family that cannot serve the spec is a ConfigError
    spec_dict = spec.to_dict()
    spec_dict["softmax_scale"] = spec.scale
    spec_dict.pop("tune")
    return _environment().get_template(template).render(
        version=__version__,
        template=template,
        spec=spec,
        plan=plan_for(spec),
        mask_causal=mask_shape(spec).causal,
        config=config,
        dropout=spec.dropout_p > 0,
        constants=spec_constants(spec),
        spec_literal=_literal(spec_dict),
        config_literal=_literal(config.to_dict()),
        standalone=standalone,
        host_source=host_source().rstrip("\n") if standalone else "",
        decode_source=decode_source().rstrip("\n") if standalone else "",
        interpret_source=interpret_source().rstrip("\n") if standalone else "",
        hopper_source=hopper_source().rstrip("\n") if standalone and (config.family == "hopper_ws"
                                                                     or config.hopper_bwd) else "",
        hopper_bwd_source=_pasted(hopper_bwd.__file__, HOPPER_IMPORT_MARK).rstrip("\n")
        if standalone and config.hopper_bwd else "",
        portable_fallback=_portable_fallback(spec) if config.family == "hopper_ws" else {},
    )


# The portable forward's knobs a call the Gluon forward declines (masked, FP8 or hd160-256 packed sequences,
# packed calls HopperForward.packed_declines, strides the copy engine cannot read) runs on: the portable default
# of its length, not the family's tiles (H200, bf16, packed calls of 16384 tokens: the family's tiles ran at
# 0.36-0.55x of these at head dims 96-256; session 37's stand-in tiles at 0.75-0.84x at hd64, 0.82-0.98x at 96
# and 128; benchmarks/results/2026-11-29-h200-declined-fallback-s38.md).
FALLBACK_KNOBS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "warp_specialize", "tma")


def _portable_fallback(spec: AttentionSpec) -> dict[int, str]:
    """{bucket: the portable default's FALLBACK_KNOBS at that length, a literal} for HopperForward's fallback,
    for an sm90 target (the family's: 'auto' renders the H100's, whose forward defaults the H200 shares). Not part
    of the kernel hash (timed_source): the tuner times dense calls, which the family serves."""
    target = "h100" if spec.target == "auto" else spec.target
    return {bucket: _value_source({knob: getattr(default_config(spec, target, bucket, hopper_ws=False), knob)
                                   for knob in FALLBACK_KNOBS}) for bucket in DEFAULT_BUCKETS}


def build_module(spec: AttentionSpec, config: KernelConfig, template: str = TEMPLATE) -> ModuleType:
    """Render, cache and import the module for (spec, config); it imports the host side."""
    return import_path(cached_source_path(spec.uri, render(spec, config, template, standalone=False)))
