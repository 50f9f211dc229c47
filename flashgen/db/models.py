"""The results database schema (SQLAlchemy ORM).

One row per environment (GPU + software), per spec and per best choice (the config chosen
for one spec, environment, sequence-length bucket and phase). Natural keys are unique
constraints, so every write is an upsert. The trials themselves live in Optuna's RDB
storage in the same database (one study per spec, environment, bucket and phase; each
trial's flashgen record in its user attributes). Schema changes: flashgen.db.migrate.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import JSON, DateTime, Float, ForeignKey, Integer, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

SCHEMA_VERSION = 5  # flashgen_meta.schema_version; migrate.REVISIONS maps it to Alembic's


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class Base(DeclarativeBase):
    pass


class Meta(Base):
    __tablename__ = "flashgen_meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(256))


class Environment(Base):
    """Where a result was measured (flashgen.db.env says which environments a result serves)."""

    __tablename__ = "environments"
    __table_args__ = (UniqueConstraint("gpu", "capability", "sm_count", "memory_gib", "torch", "triton", "cuda",
                                       "flashgen", "templates", name="uq_environment"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    gpu: Mapped[str] = mapped_column(String(128))
    capability: Mapped[str] = mapped_column(String(16))
    sm_count: Mapped[int] = mapped_column(Integer)
    memory_gib: Mapped[float] = mapped_column(Float)
    torch: Mapped[str] = mapped_column(String(64))
    triton: Mapped[str] = mapped_column(String(64))
    cuda: Mapped[str] = mapped_column(String(32))
    flashgen: Mapped[str] = mapped_column(String(32))
    templates: Mapped[str] = mapped_column(String(32))  # hash of the Jinja templates


class SpecRow(Base):
    __tablename__ = "specs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(32), unique=True)
    uri: Mapped[str] = mapped_column(String(256))
    canonical: Mapped[dict] = mapped_column(JSON)


class Best(Base):
    """The chosen config for (environment, spec, bucket, phase)."""

    __tablename__ = "best_configs"
    __table_args__ = (UniqueConstraint("environment_id", "spec_id", "bucket", "phase", name="uq_best"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    environment_id: Mapped[int] = mapped_column(ForeignKey("environments.id"))
    spec_id: Mapped[int] = mapped_column(ForeignKey("specs.id"))
    bucket: Mapped[int] = mapped_column(Integer)
    phase: Mapped[str] = mapped_column(String(8))
    config: Mapped[dict] = mapped_column(JSON)
    ms: Mapped[float] = mapped_column(Float)
    tflops: Mapped[float] = mapped_column(Float)
    default_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The hash of the kernels this phase timed (flashgen.codegen.render.kernel_hash): the
    # result serves while flashgen renders the same ones. None: stored before schema 4 and not
    # filled by its migration; such a result is judged by its environment's templates hash.
    kernel: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # Which default this result was measured against in its round (flashgen.db.kernels
    # .default_kernel: the default config's kernels and phase knobs for this bucket): a result
    # whose default has changed since is not served. None: unknown (stored before schema 5).
    default_kernel: Mapped[str | None] = mapped_column(String(32), nullable=True)
    created: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=_now)


class Claim(Base):
    """Which trial is measuring a config of a study, so that workers sharing the study never
    measure one config twice (ResultStore.claim)."""

    __tablename__ = "trial_claims"
    study: Mapped[str] = mapped_column(String(512), primary_key=True)
    config_key: Mapped[str] = mapped_column(String(32), primary_key=True)
    trial_id: Mapped[int] = mapped_column(Integer)  # Optuna's trial id
