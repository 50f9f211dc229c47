"""Which kernels a stored result was timed on, and whether this flashgen still renders them.

Each best config is stored with the hash of the kernels its phase times
(flashgen.codegen.render.kernel_hash of its spec, config and phase). Looking a result up
compares that hash with the hash of what this flashgen renders for the same spec and
config (flashgen.db.env): equal, the result serves, whatever changed in the templates
around those kernels; different, it is stale. A lookup renders only the configs stored for
the spec it looks up, each once per process (kernel_hash is cached).
"""

from __future__ import annotations

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
