"""flashgen's schema changes: Alembic migrations (flashgen/db/migrations/versions), run by
``flashgen db upgrade``, and the lock under which a database is created or upgraded.

flashgen's tables (environments, specs, best_configs, flashgen_meta) share the database with
Optuna's RDB storage (studies, trials, ...), which migrates its own tables with its own
Alembic history. flashgen's revision is kept in ``flashgen_alembic_version`` so the two never
meet; ``flashgen_meta.schema_version`` still says the schema number older flashgens check.

A fresh database is made at the newest schema at once (create_all, then stamped with the
newest revision), the usual Alembic recipe. Creating or upgrading holds a lock for the whole
database, so processes that open one fresh database at the same moment queue rather than
race: a file lock beside an SQLite file (``<file>.lock``), an advisory lock on PostgreSQL.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
from pathlib import Path

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, Engine

from .urls import sqlite_file

VERSION_TABLE = "flashgen_alembic_version"
SCRIPTS = Path(__file__).resolve().parent / "migrations"
# flashgen_meta.schema_version -> the Alembic revision that schema is
REVISIONS = {1: "0001", 2: "0002", 3: "0003", 4: "0004", 5: "0005"}
HEAD = REVISIONS[max(REVISIONS)]
_PG_LOCK = int.from_bytes(hashlib.sha256(b"flashgen schema").digest()[:4], "big")  # an advisory lock id


def _config(connection: Connection):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPTS))
    cfg.attributes["connection"] = connection
    return cfg


def current_revision(connection: Connection) -> str | None:
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE}).get_current_revision()


@contextlib.contextmanager
def schema_lock(engine: Engine, url: str):
    """Held while a database's tables are created or upgraded, flashgen's and Optuna's (see
    the module): other processes wait here. The caller opens its own connection inside."""
    path = sqlite_file(url)
    if path is not None:
        with open(path.with_name(path.name + ".lock"), "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
            yield
    elif engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _PG_LOCK})
            conn.commit()
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _PG_LOCK})
                conn.commit()
    else:
        yield


def create(conn: Connection, metadata) -> None:
    """Make a fresh database's flashgen tables at the newest schema (under schema_lock)."""
    from alembic import command

    metadata.create_all(conn)
    command.stamp(_config(conn), HEAD)


def upgrade(conn: Connection, found: int) -> None:
    """Bring a database at schema ``found`` to the newest (under schema_lock)."""
    from alembic import command

    if current_revision(conn) is None:  # written before flashgen used Alembic
        command.stamp(_config(conn), REVISIONS[found])
    command.upgrade(_config(conn), HEAD)


def has_tables(conn: Connection) -> bool:
    return bool(inspect(conn).get_table_names())
