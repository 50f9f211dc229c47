"""ResultStore: the tuning results in any SQLAlchemy database (SQLite by default).

Thread and process safety: one ResultStore may be shared by threads (SQLAlchemy's engine
pools connections; every method opens its own short session). Several processes may
write to one SQLite file at once: the file is in WAL mode with a busy timeout, every
write is one short transaction, and every insert is an upsert on the row's natural key,
so a duplicate write is a no-op rather than an error. All access goes through
``_session()``, which commits, or rolls back and re-raises.

A database at another schema version is refused with the command that upgrades it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs
from sqlalchemy import create_engine, event, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from ..config import KernelConfig
from ..spec import AttentionSpec
from .models import SCHEMA_VERSION, Base, Best, Environment, Meta, SpecRow, Trial


class SchemaVersionError(RuntimeError):
    """The database was written by another flashgen schema version."""


def default_url() -> str:
    url = os.environ.get("FLASHGEN_DB")
    if url:
        return url
    path = Path(platformdirs.user_cache_dir("flashgen")) / "tuning.sqlite"
    return f"sqlite:///{path}"


def config_key(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class EnvInfo:
    """The environment a result belongs to; every field must match for a result to be used."""

    gpu: str
    capability: str
    sm_count: int
    memory_gib: float
    torch: str
    triton: str
    cuda: str
    flashgen: str
    templates: str

    @classmethod
    def current(cls, interpret: bool = False) -> "EnvInfo":
        import torch
        import triton

        from .. import __version__
        from ..codegen.render import templates_hash

        if interpret or not torch.cuda.is_available():
            gpu, cap, sms, mem, cuda = "triton-interpreter", "cpu", 0, 0.0, "none"
        else:
            props = torch.cuda.get_device_properties(0)
            gpu, cap, sms = props.name, f"{props.major}.{props.minor}", props.multi_processor_count
            mem, cuda = round(props.total_memory / 2**30, 1), str(torch.version.cuda)
        return cls(gpu=gpu, capability=cap, sm_count=sms, memory_gib=mem, torch=torch.__version__.split("+")[0],
                   triton=triton.__version__, cuda=cuda, flashgen=__version__, templates=templates_hash())

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class TrialRecord:
    bucket: int
    phase: str
    config: dict
    status: str
    ms: float | None = None
    tflops: float | None = None
    margin: float | None = None
    error: str | None = None


def _sqlite_pragmas(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()


class ResultStore:
    def __init__(self, url: str | None = None, *, create: bool = True):
        self.url = url or default_url()
        if self.url.startswith("sqlite:///") and create:
            Path(self.url[len("sqlite:///"):]).expanduser().parent.mkdir(parents=True, exist_ok=True)
        self.engine = create_engine(self.url, future=True)
        if self.engine.dialect.name == "sqlite":
            _sqlite_pragmas(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._check_schema(create)

    # ------------------------------------------------------------------ plumbing
    @contextlib.contextmanager
    def _session(self):
        session: Session = self._sessions()
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    def _upsert(self, session: Session, model, values: dict, keys: tuple[str, ...], update: tuple[str, ...] = ()):
        dialect = self.engine.dialect.name
        if dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert
        elif dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            raise NotImplementedError(f"upserts on {dialect!r}: use SQLite or PostgreSQL")
        stmt = insert(model).values(**values)
        if update:
            stmt = stmt.on_conflict_do_update(index_elements=list(keys), set_={k: values[k] for k in update})
        else:
            stmt = stmt.on_conflict_do_nothing(index_elements=list(keys))
        session.execute(stmt)

    def _check_schema(self, create: bool) -> None:
        if create:
            Base.metadata.create_all(self.engine)
        with self._session() as s:
            row = s.get(Meta, "schema_version")
            if row is None:
                if not create:
                    raise SchemaVersionError(f"{self.url} is not a flashgen database (no schema version)")
                self._upsert(s, Meta, {"key": "schema_version", "value": str(SCHEMA_VERSION)}, ("key",))
            elif row.value != str(SCHEMA_VERSION):
                raise SchemaVersionError(
                    f"{self.url} is at flashgen schema version {row.value}, this flashgen reads version "
                    f"{SCHEMA_VERSION}: run `flashgen db upgrade --db {self.url}`")

    def _env_id(self, s: Session, env: EnvInfo, create: bool = True) -> int | None:
        if create:
            self._upsert(s, Environment, env.as_dict(), tuple(env.as_dict()))
        q = select(Environment.id).filter_by(**env.as_dict())
        return s.execute(q).scalar_one_or_none()

    def _spec_id(self, s: Session, spec: AttentionSpec, create: bool = True) -> int | None:
        if create:
            self._upsert(s, SpecRow, {"key": spec.key, "uri": spec.uri, "canonical": spec.canonical()}, ("key",))
        return s.execute(select(SpecRow.id).filter_by(key=spec.key)).scalar_one_or_none()

    # ------------------------------------------------------------------ writes
    def record_trial(self, env: EnvInfo, spec: AttentionSpec, trial: TrialRecord) -> None:
        with self._session() as s:
            values = dict(environment_id=self._env_id(s, env), spec_id=self._spec_id(s, spec), bucket=trial.bucket,
                          phase=trial.phase, config_key=config_key(trial.config), config=trial.config,
                          status=trial.status, ms=trial.ms, tflops=trial.tflops, margin=trial.margin,
                          error=trial.error)
            self._upsert(s, Trial, values, ("environment_id", "spec_id", "bucket", "phase", "config_key"),
                         update=("status", "ms", "tflops", "margin", "error", "config"))

    def set_best(self, env: EnvInfo, spec: AttentionSpec, bucket: int, phase: str, config: dict, ms: float,
                 tflops: float, default_ms: float | None = None) -> None:
        with self._session() as s:
            values = dict(environment_id=self._env_id(s, env), spec_id=self._spec_id(s, spec), bucket=bucket,
                          phase=phase, config=config, ms=ms, tflops=tflops, default_ms=default_ms)
            self._upsert(s, Best, values, ("environment_id", "spec_id", "bucket", "phase"),
                         update=("config", "ms", "tflops", "default_ms"))

    # ------------------------------------------------------------------ reads
    def trials(self, env: EnvInfo, spec: AttentionSpec, bucket: int | None = None,
               phase: str | None = None) -> list[TrialRecord]:
        with self._session() as s:
            env_id, spec_id = self._env_id(s, env, create=False), self._spec_id(s, spec, create=False)
            if env_id is None or spec_id is None:
                return []
            q = select(Trial).filter_by(environment_id=env_id, spec_id=spec_id)
            if bucket is not None:
                q = q.filter_by(bucket=bucket)
            if phase is not None:
                q = q.filter_by(phase=phase)
            return [TrialRecord(t.bucket, t.phase, t.config, t.status, t.ms, t.tflops, t.margin, t.error)
                    for t in s.execute(q.order_by(Trial.id)).scalars()]

    def best_configs(self, env: EnvInfo, spec: AttentionSpec) -> dict[int, dict[str, dict]]:
        """{bucket: {phase: best row as a dict}} for this exact environment and spec."""
        with self._session() as s:
            env_id, spec_id = self._env_id(s, env, create=False), self._spec_id(s, spec, create=False)
            if env_id is None or spec_id is None:
                return {}
            out: dict[int, dict[str, dict]] = {}
            for b in s.execute(select(Best).filter_by(environment_id=env_id, spec_id=spec_id)).scalars():
                out.setdefault(b.bucket, {})[b.phase] = dict(config=b.config, ms=b.ms, tflops=b.tflops,
                                                              default_ms=b.default_ms)
            return out

    def all_best(self) -> list[dict]:
        """Every best config with its environment and spec, for `flashgen show` and export."""
        with self._session() as s:
            q = (select(Best, Environment, SpecRow).join(Environment, Best.environment_id == Environment.id)
                 .join(SpecRow, Best.spec_id == SpecRow.id).order_by(SpecRow.uri, Best.bucket, Best.phase))
            return [dict(environment={c: getattr(e, c) for c in EnvInfo.__dataclass_fields__},
                         spec_key=sp.key, spec_uri=sp.uri, spec=sp.canonical, bucket=b.bucket, phase=b.phase,
                         config=b.config, ms=b.ms, tflops=b.tflops, default_ms=b.default_ms)
                    for b, e, sp in s.execute(q)]

    def import_rows(self, rows: list[dict]) -> int:
        """Load exported best configs (see flashgen.db.layer) into this database."""
        for row in rows:
            env = EnvInfo(**row["environment"])
            spec = _SpecShim(row["spec_key"], row["spec_uri"], row["spec"])
            self.set_best(env, spec, row["bucket"], row["phase"], row["config"], row["ms"], row["tflops"],
                          row.get("default_ms"))
        return len(rows)

    def check(self) -> list[str]:
        """Problems found, as sentences; empty when the database is sound."""
        problems = []
        with self._session() as s:
            if self.engine.dialect.name == "sqlite":
                result = s.connection().exec_driver_sql("PRAGMA integrity_check").scalar()
                if result != "ok":
                    problems.append(f"SQLite integrity check: {result}")
            for b in s.execute(select(Best)).scalars():
                try:
                    KernelConfig.from_dict(b.config)
                except Exception as err:  # a config this flashgen cannot run
                    problems.append(f"best config {b.id} is invalid: {err}")
        return problems


@dataclass(frozen=True)
class _SpecShim:
    """What the store needs of a spec (key, uri, canonical) when importing rows."""

    key: str
    uri: str
    _canonical: dict

    def canonical(self) -> dict:
        return self._canonical
