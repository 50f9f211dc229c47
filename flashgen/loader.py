"""flashgen.load: the kernel bound to the best stored config per sequence-length bucket.

Lookup order: the user's database (FLASHGEN_DB or the user data dir), then the shipped
tuning_db/ layer, then the heuristic default with one warning that names the command to
tune. In the database and in tuning_db/ a result measured on this GPU model and Triton
major.minor, for the kernels this flashgen renders for its spec and config (its kernel
hash; flashgen.db.kernels), is used (flashgen.db.env): an exact match of the whole
environment first, else a near match, which the source says ("tuning_db (near match: tuned
with torch 2.11.0, ...)"). A result for kernels the templates have since changed is stale:
never used, and the fallback warning says so. A result measured against another default
than this flashgen's for its bucket and phase (flashgen.db.kernels.default_status: the
defaults move with the code) is not used either: that phase runs the bucket's default, and
one warning says so and names `flashgen tune --recheck`. A result that records no default
(stored before schema 5) is used (ARCHITECTURE.md says why).

Tuned knobs are merged onto the default of their own bucket (default_config at the bucket's
length), and buckets with no tuned result run their own default (default_configs): a tuned
result only ever replaces the default it was measured against.

The lookup never tunes, and a missing, locked, stale or corrupt database never raises: it
warns once and falls back (`flashgen db check` says what is wrong). A stored result that is
malformed (flashgen.db.rows) is skipped with one warning, and so is an unreadable tuning_db/
file: the other results still count. Warnings never show a password.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

from .api import AttentionKernel
from .config import ConfigError, KernelConfig, default_config, default_configs
from .db import (DatabaseError, EnvInfo, MissingDatabaseError, ResultRowError, ResultStore, default_url, display_url,
                 hide_password)
from .db.env import STALE, classify, pick, source_label
from .db.kernels import OTHER_DEFAULT, default_status, kernels_of, target_of
from .db.layer import shipped_rows
from .db.rows import check_best
from .spec import AttentionSpec


class FlashgenFallbackWarning(UserWarning):
    """flashgen is running a kernel with an untuned config, and says why."""


_warned: set[tuple] = set()


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _warn_once(key: tuple, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        # said at the first frame outside flashgen (the user's load, attention or decode line): the depth below
        # it differs by path (a fixed stacklevel named loader.py's own lines on some)
        level, frame = 1, sys._getframe(0)
        while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
            frame, level = frame.f_back, level + 1
        warnings.warn(message, FlashgenFallbackWarning, stacklevel=level)


def _target(spec: AttentionSpec, env: EnvInfo) -> str:
    """The target of the defaults a lookup serves and compares with: the spec's, else the
    GPU family of the environment it serves (flashgen.db.kernels.target_of)."""
    return spec.target if spec.target != "auto" else target_of(env)


def _configs(rows: dict[int, dict[str, dict]], spec: AttentionSpec, target: str
             ) -> tuple[dict[int, KernelConfig], list[str], list[str]]:
    """Per bucket: each phase's own knobs from that phase's best row, the rest from that
    bucket's default (default_config at the bucket's length, as a call without results gets);
    the rows skipped as malformed, as sentences; and the phases skipped because their result
    was measured against another default than this flashgen's for that bucket and phase
    ('S=4096 fwd'): those phases run the bucket's default."""
    out, bad, older = {}, [], []
    for bucket, phases in rows.items():
        knobs, used = {}, 0
        for phase, row in phases.items():
            if phase not in ("fwd", "bwd"):  # decode's rows: flashgen.kvcache serves them
                continue
            try:
                check_best(dict(row, bucket=bucket, phase=phase))
            except ResultRowError as err:
                bad.append(f"bucket {bucket!r} {phase!r}: {err}")
                continue
            if default_status(spec, dict(row, bucket=bucket, phase=phase), target) == OTHER_DEFAULT:
                older.append(f"S={bucket} {phase}")
                continue
            # a knob added after the row was stored (LATER_KNOBS) reads as its value before it existed:
            # a row tuned on the portable family stays portable where the default has moved on
            later = KernelConfig.LATER_KNOBS
            knobs.update({k: row["config"].get(k, later.get(k)) for k in KernelConfig.phase_knobs(phase)
                          if k in row["config"] or k in later})
            used += 1
        if not used:
            continue
        try:  # check_spec: what the kernels for this spec can take (the family, shared memory)
            out[bucket] = default_config(spec, target, seqlen=bucket).replace(**knobs).check_spec(spec)
        except ConfigError as err:  # each phase's knobs are sound alone, not together
            bad.append(f"bucket {bucket!r}: {err}")
    return out, bad, older


def _usable(rows: dict, spec: AttentionSpec, env: EnvInfo, where: str, fix: str, older: list[str],
            skipped: list[str] = ()) -> dict[int, KernelConfig]:
    """skipped: the rows the store left out as malformed already (ResultStore.all_best)."""
    configs, bad, behind = _configs(rows, spec, _target(spec, env))
    bad = [*skipped, *bad]
    if bad:
        _warn_once((spec.key, "rows", where), f"flashgen: skipping {len(bad)} malformed tuning result(s) for "
                                              f"{spec.uri} in {where} ({bad[0]}). {fix}")
    older += [f"{phase} in {where}" for phase in behind]
    return configs


def unreadable(spec: AttentionSpec, url: str, err: Exception) -> None:
    """Warn once (per spec and database) that the database at url could not be read (err), naming the check
    command: a lookup falls back (tuned() here, kvcache.tuned_decode)."""
    shown = display_url(url)
    reason = err.problem if isinstance(err, DatabaseError) else f"{type(err).__name__}: {err}"
    reason = hide_password(reason.strip().splitlines()[0][:300] if reason.strip() else type(err).__name__, url)
    # keyed by the database too: a second broken one for the same spec is said as well
    _warn_once((spec.key, "db", shown), f"flashgen: cannot read tuning results from {shown} ({reason}); "
                                        f"falling back. {check_command(shown)}")


def check_command(shown: str) -> str:
    """What a warning about the database shown (display_url) says to run."""
    return f"Run `flashgen db check --db {shown}`."


def recheck_command(spec: AttentionSpec, spec_path: str | None) -> str:
    return f"flashgen tune --recheck --spec {spec_path or 'spec.yaml'}"


def tuned(spec: AttentionSpec, db: str | None = None, *, spec_path: str | None = None, env: EnvInfo | None = None
          ) -> tuple[dict[int, KernelConfig], str]:
    """({bucket: config} for the tuned buckets only, where they came from). Never raises for a
    database problem."""
    env = env or EnvInfo.current()
    url = db or default_url()
    shown = display_url(url)
    check = check_command(shown)
    stale, older = [], []  # where results for this machine were found stale; phases measured against an older default
    configs, source = {}, "default"
    try:
        store = ResultStore(url, create=False)
        if store.unread_wal:
            _warn_once(("wal", shown), f"flashgen: {shown} is read-only beside a write-ahead log (-wal) of results "
                                       "not yet written into it (a tune stopped before its checkpoint): those are "
                                       "not seen. Open the database once where it is writable (`flashgen db check "
                                       f"--db {shown}` does), then copy it.")
        skipped = []
        rows = store.matching_best(env, spec, skipped)
        configs = _usable(rows, spec, env, shown, check, older, skipped)
        if configs:
            source = source_label(f"database {shown}", env, rows)
        elif store.stale_best(env, spec):
            stale.append(f"database {shown}")
    except MissingDatabaseError:
        pass  # nothing tuned here yet: not worth a warning
    except Exception as err:  # missing tables, locked, corrupt, another schema version, no driver...
        unreadable(spec, url, err)

    def skip_file(path, err):
        _warn_once(("layer", str(path)), f"flashgen: skipping the shipped tuning results file {path}: "
                                         f"{err.problem}. The other files still count.")

    def skip_entries(path, problems):
        _warn_once(("layer entries", str(path)), f"flashgen: skipping {len(problems)} malformed entr"
                                                 f"{'y' if len(problems) == 1 else 'ies'} of the shipped tuning results "
                                                 f"file {path} (the first: {problems[0]}). Its other entries still count.")

    if not configs:
        try:
            shipped = shipped_rows(spec.key, on_bad_file=skip_file, on_bad_entries=skip_entries)
            rows = pick(env, shipped, kernels_of(spec))
            configs = _usable(rows, spec, env, "tuning_db", "Regenerate the file with `flashgen export`.", older)
            if configs:
                source = source_label("tuning_db", env, rows)
            elif any(classify(env, row, kernels_of(spec)) == STALE for row in shipped):
                stale.append("tuning_db")
        except Exception as err:  # noqa: BLE001 (a load never fails for its results)
            _warn_once((spec.key, "layer"), f"flashgen: cannot read the shipped tuning_db ({err}); falling back.")
    behind = (f"the tuned config(s) {', '.join(older)} were measured against an older default (this flashgen's "
              f"default for them has changed since, and may be faster)")
    if configs:
        if older:
            _warn_once((spec.key, "older"), f"flashgen: {behind}; not used. "
                                            f"Re-check them with `{recheck_command(spec, spec_path)}`.")
        return configs, source
    if older:
        why, fix = behind, f"Re-check them with `{recheck_command(spec, spec_path)}`"
    elif stale:
        why = (f"the tuned configs for {spec.uri} on {env.gpu} in {' and '.join(stale)} are stale (timed on kernels "
               f"this flashgen renders differently)")
        fix = f"Tune it with `flashgen tune --spec {spec_path or 'spec.yaml'}`"
    else:
        why = f"no tuned config for {spec.uri} on {env.gpu}"
        fix = f"Tune it with `flashgen tune --spec {spec_path or 'spec.yaml'}`"
    _warn_once((spec.key, "default"), f"flashgen: {why}; using the heuristic default. {fix}.")
    return {}, "default"


def lookup(spec: AttentionSpec, db: str | None = None, *, spec_path: str | None = None
           ) -> tuple[dict[int, KernelConfig], str]:
    """({bucket: config}, where they came from): the tuned buckets' configs (tuned) over the
    default's per bucket (flashgen.config.default_configs), so a length nearest an untuned
    bucket runs that bucket's default, not a tuned config measured at another length; ({},
    'default') when nothing tuned serves. Never raises for a database problem."""
    env = EnvInfo.current()
    configs, source = tuned(spec, db, spec_path=spec_path, env=env)
    if not configs:
        return {}, source
    return {**default_configs(spec, _target(spec, env)), **configs}, source


def load(spec: AttentionSpec | str | Path, *, db: str | None = None) -> AttentionKernel:
    """The tuned kernel for a spec (an AttentionSpec, a YAML path or a dict of fields)."""
    if db is not None and (not isinstance(db, str) or not db.strip()):
        raise ValueError(f"db: expected a database URL (or None: $FLASHGEN_DB, else the user's database), got {db!r}")
    path = str(spec) if isinstance(spec, (str, Path)) else None
    spec = AttentionSpec.coerce(spec)
    configs, source = lookup(spec, db, spec_path=path)
    kernel = AttentionKernel(spec, bucket_configs=configs)
    kernel.config_source = source
    return kernel
