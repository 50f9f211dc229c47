"""flashgen.load: the kernel bound to the best stored config per sequence-length bucket.

Lookup order: the user's database (FLASHGEN_DB or the user cache dir), then the shipped
tuning_db/ layer, then the heuristic default with one warning that names the command to
tune. The lookup never tunes, and a missing, locked, stale or corrupt database never
raises: it warns once and falls back (`flashgen db check` says what is wrong).
"""

from __future__ import annotations

import warnings
from pathlib import Path

from .api import AttentionKernel
from .config import KernelConfig, default_config
from .db import EnvInfo, ResultStore, default_url
from .db.layer import shipped_best
from .spec import AttentionSpec


class FlashgenFallbackWarning(UserWarning):
    """flashgen is running a kernel with an untuned config, and says why."""


_warned: set[tuple[str, str]] = set()


def _warn_once(spec: AttentionSpec, what: str, message: str) -> None:
    if (spec.key, what) not in _warned:
        _warned.add((spec.key, what))
        warnings.warn(message, FlashgenFallbackWarning, stacklevel=3)


def _configs(rows: dict[int, dict[str, dict]], base: KernelConfig) -> dict[int, KernelConfig]:
    """Per bucket: each phase's own knobs from that phase's best row, the rest from base."""
    out = {}
    for bucket, phases in rows.items():
        knobs = {}
        for phase, row in phases.items():
            knobs.update({k: row["config"][k] for k in KernelConfig.phase_knobs(phase) if k in row["config"]})
        out[bucket] = base.replace(**knobs)
    return out


def lookup(spec: AttentionSpec, db: str | None = None, *, spec_path: str | None = None
           ) -> tuple[dict[int, KernelConfig], str]:
    """({bucket: config}, where they came from). Never raises for a database problem."""
    base = default_config(spec)
    env = EnvInfo.current()
    url = db or default_url()
    try:
        if not (url.startswith("sqlite:///") and not Path(url[len("sqlite:///"):]).expanduser().exists()):
            rows = ResultStore(url, create=False).best_configs(env, spec)
            if rows:
                return _configs(rows, base), f"database {url}"
    except Exception as err:  # missing tables, locked, corrupt, another schema version, no driver...
        _warn_once(spec, "db", f"flashgen: cannot read tuning results from {url} ({type(err).__name__}: "
                               f"{str(err).splitlines()[0][:300]}); falling back. Run `flashgen db check --db {url}`.")
    try:
        rows = shipped_best(spec.key, env.as_dict())
        if rows:
            return _configs(rows, base), "tuning_db"
    except Exception as err:
        _warn_once(spec, "layer", f"flashgen: cannot read the shipped tuning_db ({err}); falling back.")
    where = spec_path or "spec.yaml"
    _warn_once(spec, "default", f"flashgen: no tuned config for {spec.uri} on {env.gpu}; using the heuristic "
                                f"default. Tune it with `flashgen tune --spec {where}`.")
    return {}, "default"


def load(spec: AttentionSpec | str | Path, *, db: str | None = None) -> AttentionKernel:
    """The tuned kernel for a spec (an AttentionSpec, a YAML path or a dict of fields)."""
    path = str(spec) if isinstance(spec, (str, Path)) else None
    spec = AttentionSpec.coerce(spec)
    configs, source = lookup(spec, db, spec_path=path)
    kernel = AttentionKernel(spec, bucket_configs=configs)
    kernel.config_source = source
    return kernel
