"""ResultStore: the tuning results in any SQLAlchemy database (SQLite by default).

One database holds everything: Optuna's RDB storage keeps the studies and their trials
(one study per spec, environment, bucket and phase; each trial's flashgen record, a
TrialRecord, in its user attributes), and flashgen's own tables keep what Optuna does not:
environments, specs and the best config per spec, environment, bucket and phase. Any
SQLAlchemy URL serves (SQLite by default; PostgreSQL for many hosts). Schema changes go
through flashgen.db.migrate (Alembic), run by ``flashgen db upgrade``.

Thread and process safety: one ResultStore may be shared by threads (SQLAlchemy's engine
pools connections; every method opens its own short session). Several processes may
write to one SQLite file at once: the file is in WAL mode with a busy timeout, every
write is one short transaction, and every insert is an upsert on the row's natural key,
so a duplicate write is a no-op rather than an error. Processes that create the tables of
one fresh database at once all succeed (the loser of the race finds the tables made). All
access goes through ``_session()``, which commits, or rolls back and re-raises; for an
SQLite file it first checks that the file it opened is still there, so a database deleted
or replaced while in use is an error, never a write into a file nobody will read.

A best config is replaced only by a faster one measured in the same environment
(``set_best`` says whether it stored), so a shorter re-tune never overwrites a better result,
or by any new one when the stored one is stale: timed on kernels this flashgen no longer
renders for it (flashgen.db.kernels; each best config stores its kernel hash), or measured
against another default than the new one (each best config records its default's hash), or
by a recheck, which timed the stored config and today's default in one round.

A database at another schema version is refused with the command that upgrades it. Every
failure to open, read or write the database is a DatabaseError whose one-line message names
the database without its password (flashgen.db.urls).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import platformdirs
from sqlalchemy import Text, create_engine, event, inspect, select, type_coerce, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from ..spec import AttentionSpec
from .env import MODEL_FIELDS, STALE, EnvInfo, classify, pick
from .kernels import current_kernel, default_kernel as default_kernel_of, kernels_of, target_of
from . import migrate
from .models import SCHEMA_VERSION, Base, Best, Claim, Environment, Meta, SpecRow
from .rows import ResultRowError, check_best, check_canonical, check_environment, check_row
from .urls import display_url, engine_options, expanded_url, hide_password, sqlite_file


class DatabaseError(RuntimeError):
    """The results database cannot be opened, read or written. The message is one line and
    names the database without its password."""

    def __init__(self, url: str, problem: str):
        self.url = display_url(url)
        self.problem = hide_password(problem, url)
        super().__init__(f"database {self.url}: {self.problem}")

    @classmethod
    def from_exception(cls, url: str, err: BaseException) -> "DatabaseError":
        return cls(url, _describe(err))


class MissingDatabaseError(DatabaseError):
    """An SQLite database file that does not exist was opened for reading."""


class SchemaVersionError(DatabaseError):
    """The database was written by another flashgen schema version (``found``), or holds no
    flashgen schema at all (``found`` is None)."""

    def __init__(self, url: str, problem: str, found: int | None = None):
        super().__init__(url, problem)
        self.found = found


def _file_id(path: Path | None) -> tuple[int, int] | None:
    """(device, inode) of a file; None when there is no file (deleted, or not SQLite)."""
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _describe(err: BaseException) -> str:
    """What went wrong, in one line, from an error of SQLAlchemy, its driver or the file system."""
    if isinstance(err, DBAPIError) and err.orig is not None:
        text = str(err.orig)
    elif isinstance(err, NoSuchModuleError):
        text = f"unknown kind of database ({err})"
    elif isinstance(err, ImportError):
        text = f"its driver is not installed ({err})"
    elif isinstance(err, FileExistsError):  # from mkdir: a file where a directory must be
        text = f"{err.filename} is not a directory"
    elif isinstance(err, OSError):
        text = f"{err.strerror or err}" + (f": {err.filename}" if err.filename else "")
    elif isinstance(err, ArgumentError) and "Could not parse" in str(err):  # a path, or a typo in the scheme
        text = "not a database URL (expected one such as sqlite:///path/to/tuning.sqlite or postgresql://host/db)"
    elif isinstance(err, (ValueError, SQLAlchemyError)) and not isinstance(err, DBAPIError):
        text = f"{err}"
    else:
        text = f"{type(err).__name__}: {err}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def default_url() -> str:
    """$FLASHGEN_DB, else tuning.sqlite in the user data directory (results are not a cache:
    they cost GPU hours). A database left in the user cache directory by an older flashgen is
    used while the data directory holds none."""
    url = os.environ.get("FLASHGEN_DB")
    if url:
        return url
    path = Path(platformdirs.user_data_dir("flashgen")) / "tuning.sqlite"
    old = Path(platformdirs.user_cache_dir("flashgen")) / "tuning.sqlite"
    if not path.exists() and old.exists():
        path = old
    return f"sqlite:///{path}"


def config_key(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


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


def _sqlite_pragmas(engine: Engine, wal: bool = True) -> None:
    """busy_timeout, and with ``wal`` (a store that writes) WAL mode, a setting the file keeps: a store
    opened only to read (create=False: show, export, flashgen.load) leaves the file as it is (it
    switched a foreign database's journal mode, and wrote a header into an empty file)."""
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        cur = dbapi_conn.cursor()
        # first: switching to WAL waits for other writers too. A reader (flashgen.load at a program's start)
        # waits 5 s, not 30, for a lock a WAL database rarely has (a migration, a foreign file), then falls back
        cur.execute(f"PRAGMA busy_timeout={30000 if wal else 5000}")
        if wal:
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()


def _foreign(path: Path) -> bool:
    """Whether an SQLite file holds tables but not flashgen's (another program's database, a mistaken --db): read
    through a read-only connection of its own, before a writing store's WAL switch and schema lock touch it."""
    import sqlite3

    if not path.is_file() or path.stat().st_size == 0:
        return False
    try:
        conn = sqlite3.connect(f"file:{quote(str(path.absolute()))}?mode=ro", uri=True, timeout=5)
        try:
            names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            conn.close()
    except sqlite3.Error:  # not a database, or locked: the store's own open says what is wrong
        return False
    return bool(names) and Meta.__tablename__ not in names


def _unwritable(path: Path) -> bool:
    """Whether this user cannot write the SQLite file or its folder (a read-only mount, a results database
    baked into a container image): a reader cannot make the WAL's -shm and -wal files there."""
    return not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK | os.X_OK))


def _read_only_url(path: Path) -> str:
    """An SQLite URL that opens the file read-only and immutable: no -shm or -wal files, no locks. Used where
    this user cannot write (_unwritable); a writer with other rights changing the file meanwhile is not seen
    consistently (SQLite may then report the file malformed: the reader's error and load's fallback)."""
    return f"sqlite:///file:{quote(str(path.absolute()))}?mode=ro&immutable=1&uri=true"


HEARTBEAT_S = 30  # see ResultStore._heartbeat
_OPEN_ERRORS = (SQLAlchemyError, OSError, ImportError, ValueError)  # bad URL, no driver, no file, no server


def _current_default(spec, bucket, phase, env) -> str | None:
    """This flashgen's default_kernel for (spec, bucket, phase) on env's GPU family (None: none)."""
    return default_kernel_of(spec if isinstance(spec, AttentionSpec) else spec.canonical(), bucket, phase,
                             target_of(env))


class ResultStore:
    """``url`` is kept as given (it opens the database); ``display_url`` hides its password and
    is what every message shows. ``create=False`` opens an existing flashgen database only."""

    def __init__(self, url: str | None = None, *, create: bool = True, heartbeat_s: int = HEARTBEAT_S):
        self.url = expanded_url(url or default_url())
        self.heartbeat_s = heartbeat_s
        self.writes = create  # opened to write (tune, import), or only to read (show, export, flashgen.load)
        self.display_url = display_url(self.url)
        path = sqlite_file(self.url)
        # (a symlink whose target is missing or loops exists to no stat: it is not missing but unreadable, and its
        # open says so below)
        if path is not None and not create and not path.exists() and not path.is_symlink():
            raise MissingDatabaseError(self.url, "does not exist (the first `flashgen tune` creates it)")
        if path is not None and create and _foreign(path):  # refused before its journal mode is switched
            raise SchemaVersionError(self.url, "is not a flashgen database (no flashgen_meta table)")
        try:
            if path is not None and create:
                path.parent.mkdir(parents=True, exist_ok=True)
            opened = _read_only_url(path) if path is not None and not create and _unwritable(path) else self.url
            # a read-only file's write-ahead log (a writer killed before its checkpoint): the immutable open cannot
            # apply it, so the results last written there are not seen (flashgen.load says so)
            wal = None if path is None else path.with_name(path.name + "-wal")
            self.unread_wal = opened != self.url and wal.is_file() and wal.stat().st_size > 0
            self.engine = create_engine(opened, future=True, **engine_options(opened))
            if self.engine.dialect.name == "sqlite":
                _sqlite_pragmas(self.engine, wal=create)
            self._sessions = sessionmaker(self.engine, expire_on_commit=False)
            self._file, self._file_id = path, None
            self._optuna = None
            self._check_schema(create)
            self._file_id = _file_id(path)
        except BaseException as err:
            self.close()  # the connections opened so far: the caller never gets this store to close
            if isinstance(err, _OPEN_ERRORS):
                raise DatabaseError(self.url, f"cannot be opened{' for writing' if create else ''}: "
                                              f"{_describe(err)}") from None
            if type(err) is DatabaseError:
                raise DatabaseError(self.url, f"cannot be opened{' for writing' if create else ''}: "
                                              f"{err.problem}") from None
            raise

    def __repr__(self) -> str:
        return f"ResultStore({self.display_url!r})"

    def close(self) -> None:
        """Close the pooled connections, flashgen's and Optuna's (the store opens new ones if used again);
        also those of a constructor that raised part way, before it had made both."""
        for engine in (getattr(self, "engine", None), getattr(getattr(self, "_optuna", None), "engine", None)):
            if engine is not None:
                engine.dispose()

    # ------------------------------------------------------------------ plumbing
    @contextlib.contextmanager
    def _session(self):
        session: Session = self._sessions()
        try:
            yield session
            self._check_file()
            session.commit()
        except SQLAlchemyError as err:
            session.rollback()
            raise DatabaseError.from_exception(self.url, err) from None
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    def _upsert(self, session: Session, model, values: dict, keys: tuple[str, ...], update: tuple[str, ...] = (),
                only_if_lower: str | None = None, or_where=None):
        dialect = self.engine.dialect.name
        if dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert
        elif dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            raise DatabaseError(self.url, f"flashgen writes to SQLite or PostgreSQL, not {dialect}")
        stmt = insert(model).values(**values)
        if update:
            where = None if only_if_lower is None else \
                getattr(model, only_if_lower) > getattr(stmt.excluded, only_if_lower)
            if where is not None and or_where is not None:
                where = where | or_where
            stmt = stmt.on_conflict_do_update(index_elements=list(keys), set_={k: values[k] for k in update},
                                              where=where)
        else:
            stmt = stmt.on_conflict_do_nothing(index_elements=list(keys))
        session.execute(stmt)

    def _check_file(self) -> None:
        """An SQLite file deleted or replaced since it was opened: SQLite would go on writing
        into the unlinked file, and the results would be lost without a word."""
        if self._file_id is not None and _file_id(self._file) != self._file_id:
            raise DatabaseError(self.url, "was deleted or replaced while in use: the results written since are "
                                          "lost (run the command again to store them)")

    def ensure_present(self) -> None:
        """DatabaseError when the SQLite file this store opened is gone or replaced (the tuner
        asks after every trial, whose record Optuna writes through its own connection)."""
        self._check_file()

    def _check_schema(self, create: bool) -> None:
        if create:
            with migrate.schema_lock(self.engine, self.url):
                with self.engine.begin() as conn:
                    fresh = not migrate.has_tables(conn)
                    if fresh:  # made at the newest schema, flashgen's tables and then Optuna's
                        migrate.create(conn, Base.metadata)
                        conn.execute(Meta.__table__.insert().values(key="schema_version",
                                                                    value=str(SCHEMA_VERSION)))
                if fresh:
                    self._optuna = _rdb(self.url, self.engine.dialect.name, writes=True, **self._heartbeat())
        if not inspect(self.engine).has_table(Meta.__tablename__):
            raise SchemaVersionError(self.url, "is not a flashgen database (no flashgen_meta table)")
        with self._session() as s:
            row = s.get(Meta, "schema_version")
            if row is None:
                raise SchemaVersionError(self.url, "is not a flashgen database (no schema version)")
            if row.value != str(SCHEMA_VERSION):
                found = int(row.value) if row.value.isdigit() else -1
                fix = ("a newer flashgen wrote it: upgrade flashgen" if found > SCHEMA_VERSION else
                       f"run `flashgen db upgrade --db {self.display_url}`" if found >= 0 else
                       "not a version any flashgen writes: run `flashgen db check`, or tune into a new database")
                raise SchemaVersionError(
                    self.url, f"is at flashgen schema version {row.value}, this flashgen reads version "
                              f"{SCHEMA_VERSION}: {fix}", found)
            if create:  # a write even when the row is there: a read-only database fails now, not after tuning
                self._upsert(s, Meta, {"key": "schema_version", "value": str(SCHEMA_VERSION)}, ("key",),
                             update=("value",))

    # ------------------------------------------------------------------ Optuna's storage
    def optuna_storage(self):
        """Optuna's RDB storage on this database (its tables made, under the schema lock, on
        first use); the one store of studies and trials."""
        if self._optuna is None:
            try:
                with migrate.schema_lock(self.engine, self.url):
                    self._optuna = _rdb(self.url, self.engine.dialect.name, writes=self.writes, **self._heartbeat())
            except (SQLAlchemyError, RuntimeError) as err:  # RuntimeError: Optuna's schema is another version
                raise DatabaseError(self.url, f"cannot open Optuna's tables: {_describe(err)}") from None
        return self._optuna

    @staticmethod
    def stop_heartbeats(timeout_s: float = 5.0) -> int:
        """Stop the heartbeat threads of trials a Ctrl-C cut short, before the process exits; returns
        how many were running. Optuna starts a trial's heartbeat thread (not a daemon) in a
        with-statement's __enter__ and stops it in its __exit__; a KeyboardInterrupt landing in
        __enter__ after the thread started (no __exit__ then), or in __exit__ before the stop event is
        set, leaves it recording a heartbeat every heartbeat_s, and the interpreter's exit waits for it
        forever (an interrupted `flashgen tune` that printed its message and never exited, under CI's
        load). A Ctrl-C inside the thread's start() (its wait for the new thread to run) leaves one
        started but not yet alive: it is stopped too, once it runs."""
        import threading

        from optuna.storages._heartbeat import HeartbeatThread

        record = HeartbeatThread._record_heartbeat
        # (enumerate() lists a thread from its start(), before it is alive; one that ran is left out: Thread
        # drops its _target and _args when run() ends, which may be meanwhile)
        beating = []
        for thread in threading.enumerate():
            try:
                if thread._target is record:  # (_args: trial_id, heartbeat, and the stop event its loop waits on)
                    beating.append((thread, thread._args[2]))
            except AttributeError:
                pass
        for _, stop in beating:
            stop.set()
        for thread, _ in beating:
            # a thread whose start() the Ctrl-C cut short before it began never runs: nothing to join
            if thread._started.wait(timeout_s):
                thread.join(timeout_s)
        return len(beating)

    def _heartbeat(self) -> dict:
        """A running trial writes a heartbeat every heartbeat_s; one silent for 3x that (its
        worker killed) is failed by the next trial any worker starts, and retried once more
        with the same config (RetryFailedTrialCallback)."""
        import warnings

        import optuna.storages as storages

        callback = getattr(storages, "RetryHeartbeatStaleTrialCallback", None)  # optuna >= 4.9
        name = "heartbeat_stale_trial_callback" if callback else "failed_trial_callback"
        with warnings.catch_warnings():  # heartbeats are 'experimental' in Optuna, and what flashgen needs
            warnings.simplefilter("ignore", optuna_experimental_warning())
            retry = (callback or storages.RetryFailedTrialCallback)(max_retry=2)
        return {"heartbeat_interval": self.heartbeat_s, "grace_period": 3 * self.heartbeat_s, name: retry}

    def claim(self, study: str, key: str, trial_id: int, retake=None) -> bool:
        """Whether trial ``trial_id`` may measure config ``key`` of ``study``: True for the first
        trial to claim it (one insert: the database picks one winner among concurrent workers),
        and for a trial taking over the claim of a trial that failed (its worker died or was
        interrupted) or that ``retake(holder's FrozenTrial)`` says is to be measured again (a
        timeout under a shorter limit); False while another trial holds it or has measured it."""
        from optuna.trial import TrialState

        with self._session() as s:
            self._upsert(s, Claim, dict(study=study, config_key=key, trial_id=trial_id), ("study", "config_key"))
            holder = s.execute(select(Claim.trial_id).filter_by(study=study, config_key=key)).scalar_one()
        if holder == trial_id:
            return True
        held = self.optuna_storage().get_trial(holder)
        if held.state != TrialState.FAIL and not (retake is not None and held.state.is_finished() and retake(held)):
            return False
        with self._session() as s:  # compare-and-set: of two trials taking over, one wins
            taken = s.execute(update(Claim).filter_by(study=study, config_key=key, trial_id=holder)
                              .values(trial_id=trial_id))
            return taken.rowcount == 1

    def claim_once(self, study: str, key: str, holder: int) -> bool:
        """Whether ``holder`` (a worker's number in one run) is the one to do ``key`` of ``study``
        (a run's final round, keyed by the run): the first to ask wins (one insert), later askers
        and the winner asking again get False and True. No takeover: a holder that dies leaves
        the work to the next run of the command."""
        with self._session() as s:
            self._upsert(s, Claim, dict(study=study, config_key=key, trial_id=holder), ("study", "config_key"))
            return s.execute(select(Claim.trial_id).filter_by(study=study, config_key=key)).scalar_one() == holder

    def study_name(self, spec, env: EnvInfo, bucket: int, phase: str) -> str:
        return f"{spec.uri}-{spec.key}-{config_key(env.as_dict())[:8]}-s{bucket}-{phase}"

    def open_study(self, spec, env: EnvInfo, bucket: int, phase: str, sampler=None):
        """The Optuna study of (spec, environment, bucket, phase): the one another run left
        (interrupted, finished or running now) or a new one. Its user attributes say whose it
        is, for ``trials``."""
        import optuna

        storage = self.optuna_storage()
        name = self.study_name(spec, env, bucket, phase)
        study = optuna.create_study(study_name=name, storage=storage, direction="minimize", load_if_exists=True,
                                    sampler=sampler)
        attrs = dict(spec_key=spec.key, spec_uri=spec.uri, environment=env.as_dict(), bucket=bucket, phase=phase)
        if any(study.user_attrs.get(k) != v for k, v in attrs.items()):
            for k, v in attrs.items():
                study.set_user_attr(k, v)
        return study

    def missing_tables(self) -> list[str]:
        """The tables this database lacks, flashgen's and Optuna's (``flashgen db upgrade``
        creates them)."""
        from optuna.storages._rdb.models import BaseModel

        try:
            present = set(inspect(self.engine).get_table_names())
        except SQLAlchemyError as err:
            raise DatabaseError.from_exception(self.url, err) from None
        return sorted((set(Base.metadata.tables) | set(BaseModel.metadata.tables)) - present)

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
    def set_best(self, env: EnvInfo, spec: AttentionSpec, bucket: int, phase: str, config: dict, ms: float,
                 tflops: float, default_ms: float | None = None, default_kernel: str | None = None, *,
                 rechecked: bool = False, read: tuple | None = None) -> dict | None:
        """Store a best config, with the hash of the kernels it was timed on and the default
        it was measured against (``default_kernel``, flashgen.db.kernels.default_kernel),
        unless the environment already holds a faster one for this spec, bucket and phase
        that is not stale and was measured against the same default (or an unrecorded one).
        ``rechecked``: the stored config and the default were both timed in this round
        (``flashgen tune --recheck``), so this row replaces what is stored whatever its time, as
        long as that is still what the recheck read: ``read``, the (ms, kernel) of this
        environment's row when it began (None: it had none). A row another writer stored
        meanwhile (a concurrent tune) was not timed in the round: it is replaced only by a lower
        time, as any row is.
        Returns None when stored, else the faster stored row (config, ms, tflops, default_ms),
        which stays."""
        check_best(dict(bucket=bucket, phase=phase, config=config, ms=ms, tflops=tflops, default_ms=default_ms))
        kernel = current_kernel(spec, config, phase)
        with self._session() as s:
            return self._set_best(s, env, spec, bucket, phase, config, ms, tflops, default_ms, kernel,
                                  default_kernel, unless_changed=read if rechecked else False)

    def _set_best(self, s: Session, env: EnvInfo, spec, bucket, phase, config, ms, tflops, default_ms,
                  kernel: str | None, default_kernel: str | None = None, unless_changed=False) -> dict | None:
        """set_best's write in session s. unless_changed: False (replace only by the rules below), or
        the (ms, kernel) a recheck read of this row (None: no row then), which it replaces while unchanged."""
        values = dict(environment_id=self._env_id(s, env), spec_id=self._spec_id(s, spec), bucket=bucket,
                      phase=phase, config=config, ms=ms, tflops=tflops, default_ms=default_ms, kernel=kernel,
                      default_kernel=default_kernel)
        natural = {k: values[k] for k in ("environment_id", "spec_id", "bucket", "phase")}
        stored = s.execute(select(Best.config, Best.kernel).filter_by(**natural)).one_or_none()
        stale = None
        canonical = spec if isinstance(spec, AttentionSpec) else spec.canonical()
        if stored is not None and stored.kernel is not None:
            now = current_kernel(canonical, stored.config, phase)
            stale = stored.kernel if now is not None and now != stored.kernel else None
        if stored is not None and stale is None and kernel is not None:
            # a result whose kernels this flashgen no longer renders (an old export's) replaces no row it can serve,
            # however fast: the loader would then serve neither (a review's catch: an import wiped usable rows)
            now = current_kernel(canonical, config, phase)
            if now is not None and now != kernel:
                kept = s.execute(select(Best).filter_by(**natural)).scalar_one()
                return dict(config=kept.config, ms=kept.ms, tflops=kept.tflops, default_ms=kept.default_ms)
        # One statement, so concurrent writers cannot interleave a read and a write: the row is
        # replaced where the new time is lower, where it still holds the stale result read above,
        # or, where this row was measured against this flashgen's own default, where the stored one
        # was measured against another (timed in another round against an older baseline, so its
        # time says nothing against this one's; a row with no recorded default keeps its time's
        # claim: `flashgen tune --recheck` re-measures those). A row measured against an older
        # default (an import of an old export) replaces nothing by that rule.
        replace = [] if stale is None else [Best.kernel == stale]
        if unless_changed:  # a recheck's round: the row it read, still as it read it
            read_ms, read_kernel = unless_changed
            replace.append((Best.ms == read_ms) & (Best.kernel.is_(None) if read_kernel is None
                                                   else Best.kernel == read_kernel))
        if default_kernel is not None and default_kernel == _current_default(spec, bucket, phase, env):
            replace.append(Best.default_kernel.is_not(None) & (Best.default_kernel != default_kernel))
        or_where = None
        for clause in replace:
            or_where = clause if or_where is None else or_where | clause
        self._upsert(s, Best, values, tuple(natural),
                     update=("config", "ms", "tflops", "default_ms", "kernel", "default_kernel"),
                     only_if_lower="ms", or_where=or_where)
        kept = s.execute(select(Best).filter_by(**natural)).scalar_one()
        if kept.ms == ms and kept.config == config:
            return None
        return dict(config=kept.config, ms=kept.ms, tflops=kept.tflops, default_ms=kept.default_ms)

    # ------------------------------------------------------------------ reads
    def trials(self, env: EnvInfo, spec: AttentionSpec, bucket: int | None = None,
               phase: str | None = None) -> list[TrialRecord]:
        """The finished trials' records of this spec in this environment, from Optuna's
        studies, in the order they were run (one per config: a config measured twice, by
        concurrent workers, is listed once, with its latest record)."""
        storage = self.optuna_storage()
        found: dict[tuple, TrialRecord] = {}
        try:
            studies = sorted(storage.get_all_studies(), key=lambda st: st._study_id)
            for study in studies:
                attrs = study.user_attrs
                if attrs.get("spec_key") != spec.key or attrs.get("environment") != env.as_dict() or \
                        (bucket is not None and attrs.get("bucket") != bucket) or \
                        (phase is not None and attrs.get("phase") != phase):
                    continue
                for t in storage.get_all_trials(study._study_id, deepcopy=False):
                    record = t.user_attrs.get("record")
                    if t.state.is_finished() and record:
                        key = (study._study_id, config_key(record["config"]))
                        found.pop(key, None)
                        found[key] = TrialRecord(**record)
        except SQLAlchemyError as err:
            raise DatabaseError.from_exception(self.url, err) from None
        return list(found.values())

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

    def matching_best(self, here: EnvInfo, spec: AttentionSpec, skipped: list[str] | None = None
                      ) -> dict[int, dict[str, dict]]:
        """{bucket: {phase: row}}: the best configs that serve ``here`` (flashgen.db.env: an
        exact match preferred, else the nearest near match; never a stale one), each row with
        its 'match'. Malformed rows are left out (said in ``skipped``, as all_best)."""
        return pick(here, self._on_machine(here, spec, skipped), kernels_of(spec))

    def stale_best(self, here: EnvInfo, spec: AttentionSpec) -> list[dict]:
        """The best configs of this spec measured on this machine for kernels this flashgen no
        longer renders (flashgen.db.env STALE): never used; a new tune replaces them."""
        return [r for r in self._on_machine(here, spec) if classify(here, r, kernels_of(spec)) == STALE]

    def _on_machine(self, here: EnvInfo, spec: AttentionSpec, skipped: list[str] | None = None) -> list[dict]:
        """The spec's best configs measured on this GPU model (any software)."""
        return self.all_best(spec_key=spec.key, where={f: getattr(here, f) for f in MODEL_FIELDS}, skipped=skipped)

    def all_best(self, *, spec_key: str | None = None, where: dict | None = None,
                 skipped: list[str] | None = None) -> list[dict]:
        """Every best config with its environment and spec, for `flashgen show` and export
        (only one spec's, or only environments with the ``where`` field values, when given).
        A malformed row (a field edited by hand, JSON that does not parse) is left out, and said
        in ``skipped`` where given: `flashgen db check` lists them all."""
        env_fields = list(EnvInfo.__dataclass_fields__)
        with self._session() as s:
            # the JSON columns as stored text: one that does not parse is this row's problem, not a crash
            q = (select(Best.id, *(getattr(Environment, c) for c in env_fields), SpecRow.key, SpecRow.uri,
                        type_coerce(SpecRow.canonical, Text), Best.bucket, Best.phase, type_coerce(Best.config, Text),
                        Best.ms, Best.tflops, Best.default_ms, Best.kernel, Best.default_kernel)
                 .join(Environment, Best.environment_id == Environment.id).join(SpecRow, Best.spec_id == SpecRow.id))
            if spec_key is not None:
                q = q.where(SpecRow.key == spec_key)
            for name, value in (where or {}).items():
                q = q.where(getattr(Environment, name) == value)
            q = q.order_by(SpecRow.uri, Best.bucket, Best.phase, Best.id)
            rows = []
            for id_, *values in s.execute(q):
                env, (key, uri, canonical, bucket, phase, config, ms, tflops, default_ms, kernel, default_kernel) = \
                    dict(zip(env_fields, values)), values[len(env_fields):]
                try:
                    row = dict(environment=env, spec_key=key, spec_uri=uri, spec=_json(canonical, "spec"),
                               bucket=bucket, phase=phase, config=_json(config, "config"), ms=ms, tflops=tflops,
                               default_ms=default_ms, kernel=kernel, default_kernel=default_kernel)
                    check_row(row)
                except ResultRowError as err:
                    if skipped is not None:
                        skipped.append(f"best config {id_} ({uri} bucket {bucket!r} {phase!r}) is invalid: {err}")
                    continue
                rows.append(row)
            return rows

    def import_rows(self, rows: list[dict]) -> int:
        """Load exported best configs (see flashgen.db.layer) into this database: every row is
        checked first (ResultRowError names the first bad one), then all are written in one
        transaction, each only where the database holds no faster result for its environment.
        Returns how many were stored."""
        for i, row in enumerate(rows):
            try:
                check_row(row)
            except ResultRowError as err:
                raise ResultRowError(f"{i}.{err.field}", err.message, err.value) from None
        stored = 0
        with self._session() as s:
            for row in rows:
                env = EnvInfo(**row["environment"])
                spec = _SpecShim(row["spec_key"], row["spec_uri"], row["spec"])
                stored += self._set_best(s, env, spec, row["bucket"], row["phase"], row["config"], row["ms"],
                                         row["tflops"], row.get("default_ms"), row.get("kernel"),
                                         row.get("default_kernel")) is None
        return stored

    def check(self) -> list[str]:
        """Problems found, as sentences; empty when the database is sound."""
        problems = []
        inspector = inspect(self.engine)
        present = set(inspector.get_table_names())
        for name, table in Base.metadata.tables.items():  # a table or column gone: reads fail with "no such ..."
            if name not in present:
                problems.append(f"table {name!r} is missing (`flashgen db upgrade` makes it)")
                continue
            lacking = sorted({c.name for c in table.columns} - {c["name"] for c in inspector.get_columns(name)})
            if lacking:
                problems.append(f"table {name!r} lacks column(s) {', '.join(lacking)}")
        if problems:
            return problems  # the checks below read those columns
        with self._session() as s:
            if self.engine.dialect.name == "sqlite":
                result = s.connection().exec_driver_sql("PRAGMA integrity_check").scalar()
                if result != "ok":
                    problems.append(f"SQLite integrity check: {result}")
            for id_, uri, canonical in s.execute(select(SpecRow.id, SpecRow.uri, type_coerce(SpecRow.canonical, Text))):
                try:
                    check_canonical(_json(canonical, "canonical"))
                except ResultRowError as err:
                    problems.append(f"spec {id_} ({uri}) is invalid: {err}")
            env_fields = list(EnvInfo.__dataclass_fields__)
            for id_, *values in s.execute(select(Environment.id, *(getattr(Environment, c) for c in env_fields))):
                try:
                    check_environment(dict(zip(env_fields, values)), prefix="")
                except ResultRowError as err:
                    problems.append(f"environment {id_} is invalid: {err}")
            # The config as stored text: a column that is not JSON is a problem to report, not a crash.
            q = (select(Best.id, SpecRow.uri, Best.bucket, Best.phase, type_coerce(Best.config, Text), Best.ms,
                        Best.tflops, Best.default_ms).outerjoin(SpecRow, Best.spec_id == SpecRow.id).order_by(Best.id))
            for id_, uri, bucket, phase, config, ms, tflops, default_ms in s.execute(q):
                try:
                    check_best(dict(bucket=bucket, phase=phase, config=_json(config, "config"), ms=ms, tflops=tflops,
                                    default_ms=default_ms))
                except ResultRowError as err:  # a result flashgen.load skips
                    problems.append(f"best config {id_} ({uri} bucket {bucket!r} {phase!r}) is invalid: {err}")
        return problems


def _json(text, field: str):
    """A JSON column's stored text, decoded (ResultRowError naming the field where it is not JSON)."""
    try:
        return json.loads(text) if isinstance(text, (str, bytes)) else text
    except ValueError:
        raise ResultRowError(field, "not JSON") from None


def optuna_experimental_warning():
    from optuna.exceptions import ExperimentalWarning

    return ExperimentalWarning


def _rdb(url: str, dialect: str, *, writes: bool, **kwargs):
    import warnings

    from optuna.storages import RDBStorage

    engine_kwargs = {"connect_args": {"timeout": 30}} if dialect == "sqlite" else {"pool_pre_ping": True,
                                                                                   **engine_options(url)}
    with warnings.catch_warnings():  # heartbeat_interval is marked experimental
        warnings.simplefilter("ignore", optuna_experimental_warning())
        storage = RDBStorage(url, engine_kwargs=engine_kwargs, **kwargs)
    if dialect == "sqlite" and writes:  # a reader's transactions stay deferred: they wait for no writer
        _begin_immediate(storage.engine)
    return storage


def _begin_immediate(engine: Engine) -> None:
    """Every transaction on ``engine`` takes SQLite's write lock when it begins (SQLAlchemy's recipe for
    pysqlite). Optuna reads a trial's state and then writes it in one transaction, relying on SELECT ...
    FOR UPDATE, which SQLite ignores; and pysqlite begins a transaction only at the first write, so the
    read ran outside it. Two `--gpus` workers then both saw an enqueued trial WAITING and both took it:
    the second to finish failed with "Cannot tell a COMPLETE trial" (two processes popping 200 enqueued
    trials took 5 twice). The connections RDBStorage opened before these hooks are dropped."""
    @event.listens_for(engine, "connect")
    def _no_implicit_begin(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # pysqlite emits no BEGIN of its own

    @event.listens_for(engine, "begin")
    def _immediate(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()


def upgrade_database(url: str, found: int) -> None:
    """``flashgen db upgrade``: migrate a flashgen database at schema ``found`` (Alembic,
    flashgen.db.migrate), make any of flashgen's tables it lacks, then bring Optuna's tables
    to the installed Optuna (made where missing)."""
    url = expanded_url(url)
    try:
        engine = create_engine(url, future=True, **engine_options(url))
        if engine.dialect.name == "sqlite":
            _sqlite_pragmas(engine)
        with migrate.schema_lock(engine, url):
            with engine.begin() as conn:
                migrate.upgrade(conn, found)
                Base.metadata.create_all(conn)
            _rdb(url, engine.dialect.name, writes=True, skip_compatibility_check=True).upgrade()
        engine.dispose()
    except _OPEN_ERRORS as err:
        raise DatabaseError(url, f"cannot be upgraded: {_describe(err)}") from None


@dataclass(frozen=True)
class _SpecShim:
    """What the store needs of a spec (key, uri, canonical) when importing rows."""

    key: str
    uri: str
    _canonical: dict

    def canonical(self) -> dict:
        return self._canonical
