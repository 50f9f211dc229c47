"""Which kernels a stored result was timed on, and whether this flashgen still renders them.

Each best config is stored with the hash of the kernels its phase times
(flashgen.codegen.render.kernel_hash of its spec, config and phase). Looking a result up
compares that hash with the hash of what this flashgen renders for the same spec and
config (flashgen.db.env): equal, the result serves, whatever changed in the templates
around those kernels; different, it is stale. A lookup renders only the configs stored for
the spec it looks up, each once per process (kernel_hash is cached).

Each result also records which default it was measured against (default_kernel): the
heuristic default moves when the code changes, and a result that beat an older default may
lose to today's, so a lookup compares that too (default_status).
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from typing import Callable, Mapping

from ..config import KernelConfig
from ..spec import AttentionSpec


def current_kernel(spec: AttentionSpec | Mapping, config: Mapping, phase: str) -> str | None:
    """The kernel hash this flashgen renders for a result's spec (an AttentionSpec, or the
    spec's canonical mapping as stored), config (a mapping of knobs) and phase; None where it
    cannot tell: a phase no kernel hash covers, or a spec or config this flashgen cannot build
    (such a result is then judged by its templates hash, and a malformed one is reported where
    it is used)."""
    from ..codegen.render import TIMED_KERNELS, kernel_hash

    if phase not in TIMED_KERNELS or not isinstance(config, Mapping):
        return None
    try:
        if not isinstance(spec, AttentionSpec):
            spec = _spec(json.dumps(spec, sort_keys=True))
        return kernel_hash(spec, KernelConfig.from_dict(dict(config)), phase)
    except (TypeError, ValueError):  # ConfigError and SpecError are ValueErrors
        return None


# What default_status says of a stored result's recorded default (its 'default_kernel').
SAME_DEFAULT, OTHER_DEFAULT, UNKNOWN_DEFAULT = "same", "older", "unknown"


def default_kernel(spec: AttentionSpec | Mapping, bucket: int, phase: str, target: str | None = None) -> str | None:
    """Which default a result of (spec, bucket, phase) is measured against: a hash of the
    kernel hash of the heuristic default at that bucket (flashgen.config.default_config) and
    of that default's knobs for the phase. The knobs are part of it because kernel_hash
    leaves the config out (tiles and warps are constexpr arguments, not kernel text): a default
    that moved from 128x128 to 64x32 tiles keeps its kernel hash. None for a phase no kernel
    hash covers (decode) or a spec this flashgen cannot build. ``target``: the GPU family the
    default is chosen for when the spec names none (default: this machine's, 'cpu' under the
    interpreter; target_of an EnvInfo). Cached per process."""
    from ..config import detect_target

    if phase not in ("fwd", "bwd"):
        return None
    try:
        if not isinstance(spec, AttentionSpec):
            spec = _spec(json.dumps(spec, sort_keys=True))
        target = spec.target if spec.target != "auto" else (target or detect_target())
        return _default_kernel(spec, bucket, phase, target)
    except (TypeError, ValueError):
        return None


@lru_cache(maxsize=1024)
def _default_kernel(spec: AttentionSpec, bucket: int, phase: str, target: str) -> str:
    from ..codegen.render import kernel_hash
    from ..config import default_config

    config = default_config(spec, target=target, seqlen=bucket)
    knobs = {k: v for k, v in config.to_dict().items() if k in KernelConfig.phase_knobs(phase)}
    text = kernel_hash(spec, config, phase) + json.dumps(knobs, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def target_of(env) -> str:
    """The default_config target of the machine an EnvInfo describes ('cpu' for the
    interpreter), as flashgen.config.detect_target names the GPU it runs on: the defaults a
    lookup compares with are those of the machine it serves."""
    from ..config import _ARCH

    if env.capability == "cpu":
        return "cpu"
    name = env.gpu.lower().replace(" ", "")
    for target in _ARCH:
        if target in name:
            return target
    return {"9.0": "h100", "8.0": "a100", "8.6": "a10g", "8.9": "l40s"}.get(env.capability, "a100")


def default_status(spec: AttentionSpec | Mapping, row: Mapping, target: str | None = None) -> str | None:
    """SAME_DEFAULT when a stored row (bucket, phase, default_kernel) was measured against
    this flashgen's default for its bucket and phase, OTHER_DEFAULT when against another (an
    older flashgen's: the row is not served), UNKNOWN_DEFAULT when it records none (stored
    before schema 5: served, see ARCHITECTURE.md); None for a row no default covers (decode)."""
    now = default_kernel(spec, row.get("bucket"), row.get("phase"), target)
    if now is None:
        return None
    recorded = row.get("default_kernel")
    if recorded is None:
        return UNKNOWN_DEFAULT
    return SAME_DEFAULT if recorded == now else OTHER_DEFAULT


def row_kernel(row: Mapping) -> str | None:
    """current_kernel of a stored row (the store's row format: spec, config, phase)."""
    return current_kernel(row.get("spec"), row.get("config"), row.get("phase"))


def kernels_of(spec: AttentionSpec) -> Callable[[Mapping], str | None]:
    """current_kernel of a stored row of this spec (rows already selected by its key)."""
    return lambda row: current_kernel(spec, row.get("config"), row.get("phase"))


@lru_cache(maxsize=256)
def _spec(canonical_json: str) -> AttentionSpec:
    """An AttentionSpec from its canonical mapping (the softmax scale is stored as text)."""
    fields = json.loads(canonical_json)
    if not isinstance(fields, dict):
        raise ValueError("not a spec's canonical mapping")
    if isinstance(fields.get("softmax_scale"), str):
        fields["softmax_scale"] = float(fields["softmax_scale"])
    return AttentionSpec.from_dict(fields)


def fill_kernel_hashes(conn) -> int:
    """Give each best config without a kernel hash whose environment has this flashgen's
    templates hash the hash of the kernels this flashgen renders for it: it was timed on
    them (schema 4's migration). Returns how many it filled; the others stay None."""
    from sqlalchemy import text

    from ..codegen.render import templates_hash

    rows = conn.execute(text(
        "SELECT b.id, b.phase, b.config, s.canonical FROM best_configs b "
        "JOIN environments e ON b.environment_id = e.id JOIN specs s ON b.spec_id = s.id "
        "WHERE b.kernel IS NULL AND e.templates = :templates"), {"templates": templates_hash()}).all()
    filled = 0
    for id_, phase, config, canonical in rows:
        kernel = current_kernel(_decoded(canonical), _decoded(config), phase)
        if kernel is not None:
            conn.execute(text("UPDATE best_configs SET kernel = :kernel WHERE id = :id"), {"kernel": kernel, "id": id_})
            filled += 1
    return filled


def _decoded(value):
    """A JSON column read through plain SQL: text on SQLite, already decoded elsewhere."""
    if isinstance(value, (str, bytes)):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return value
