"""The results database and the loading fallbacks: round trips, schema versions, concurrent
writers, corrupt or missing files, and the shipped tuning_db layer."""

import multiprocessing as mp
import os
import re
import sqlite3
import time
import warnings
from pathlib import Path

import pytest

import flashgen
from flashgen import AttentionSpec
from flashgen.db import EnvInfo, ResultStore, SchemaVersionError, TrialRecord
from flashgen.db import layer as layer_mod
from flashgen.db.kernels import target_of
from flashgen.config import KernelConfig, default_config
from flashgen.loader import lookup

from .helpers import drop_all_tables
from .test_render import edited_templates  # noqa: F401 (a fixture)

SPEC = AttentionSpec(name="dbspec", dtype="fp16", head_dim=32, num_heads=2, causal=True)
CFG = dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1, loop_order="q_outer")


def env():
    return EnvInfo.current(interpret=True)


def _record(store, rec: TrialRecord, spec=SPEC, where=None):
    """One finished trial with its record, as the tuner leaves it in the study."""
    import dataclasses

    import optuna

    study = store.open_study(spec, where or env(), rec.bucket, rec.phase)
    with warnings.catch_warnings():  # Optuna: heartbeats are meant for Study.optimize (the tuner's way)
        warnings.simplefilter("ignore", UserWarning)
        trial = study.ask()
    trial.set_user_attr("record", dataclasses.asdict(rec))
    if rec.status == "ok":
        study.tell(trial, rec.ms)
    else:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path, postgres_url):
    """The same storage tests against every backend. PostgreSQL runs where
    FLASHGEN_TEST_POSTGRES_URL names a server (.ci/run starts one when it can): a database of this
    worker's own (conftest.postgres_url)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'results.sqlite'}"
        return
    pg = postgres_url
    if not pg:
        pytest.skip("FLASHGEN_TEST_POSTGRES_URL is not set: no PostgreSQL server to test against")
    drop_all_tables(pg)
    yield pg
    drop_all_tables(pg)


def test_the_interpreter_is_the_environment_wherever_it_runs(monkeypatch):
    # Under TRITON_INTERPRET a GPU machine's kernels run interpreted: lookups serve (and tunes store)
    # the interpreter's results, not the GPU's (load found none after `tune --interpret` there).
    import types

    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132, total_memory=2**37)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: gpu)
    assert EnvInfo.current().gpu == EnvInfo.current(interpret=True).gpu == "triton-interpreter"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert EnvInfo.current().gpu == "NVIDIA H200"


def test_round_trip_and_upsert(url):
    store = ResultStore(url)
    _record(store, TrialRecord(64, "fwd", CFG, "ok", ms=2.0, tflops=1.0, margin=0.2))
    _record(store, TrialRecord(64, "fwd", CFG, "ok", ms=1.5, tflops=1.3, margin=0.1))  # same config: the latest
    _record(store, TrialRecord(64, "fwd", dict(CFG, BLOCK_M=32), "compile_error", error="boom"))
    _record(store, TrialRecord(64, "bwd", CFG, "ok", ms=3.0))
    _record(store, TrialRecord(64, "fwd", CFG, "ok", ms=9.0), where=EnvInfo(**{**env().as_dict(), "gpu": "other"}))
    trials = store.trials(env(), SPEC, phase="fwd")
    assert [(t.status, t.ms) for t in trials] == [("ok", 1.5), ("compile_error", None)]
    assert [t.ms for t in store.trials(env(), SPEC)] == [1.5, None, 3.0]
    store.set_best(env(), SPEC, 64, "fwd", CFG, 1.5, 1.3, default_ms=2.0)
    store.set_best(env(), SPEC, 64, "fwd", CFG, 1.4, 1.4, default_ms=2.0)
    assert store.best_configs(env(), SPEC) == {64: {"fwd": dict(config=CFG, ms=1.4, tflops=1.4, default_ms=2.0)}}
    assert store.check() == []
    store.close()


def test_a_recheck_replaces_only_the_row_it_read(url):
    # a recheck times the stored config and the default in one round and stores the winner whatever its time (a
    # stored time from another round says nothing against it), but only over the row it read: a faster row a
    # concurrent tune stored meanwhile was never compared and stays (before, the recheck overwrote it)
    from flashgen.db.kernels import current_kernel

    store = ResultStore(url)
    slow, other = dict(CFG, BLOCK_N=16), dict(CFG, BLOCK_M=32)
    store.set_best(env(), SPEC, 64, "fwd", CFG, 1.0, 1.0)
    read = (1.0, current_kernel(SPEC, CFG, "fwd"))
    assert store.set_best(env(), SPEC, 64, "fwd", slow, 3.0, 0.3, rechecked=True, read=read) is None
    assert store.best_configs(env(), SPEC)[64]["fwd"]["ms"] == 3.0
    store.set_best(env(), SPEC, 64, "fwd", other, 0.5, 2.0)  # the concurrent tune's
    kept = store.set_best(env(), SPEC, 64, "fwd", slow, 3.0, 0.3, rechecked=True,
                          read=(3.0, current_kernel(SPEC, slow, "fwd")))
    assert kept["config"] == other and kept["ms"] == 0.5
    # a recheck that read no row: a row stored meanwhile is replaced only by a lower time
    assert store.set_best(env(), SPEC, 128, "fwd", CFG, 1.0, 1.0) is None
    assert store.set_best(env(), SPEC, 128, "fwd", slow, 3.0, 0.3, rechecked=True, read=None)["ms"] == 1.0
    store.close()


def test_a_tilde_in_an_sqlite_url_is_the_home_directory_for_sqlite_too(tmp_path, monkeypatch):
    # flashgen's checks (the file exists, its lock, replaced under it) expanded ~ while SQLite opened a folder
    # named ~ in the working directory: writes went there and reads found no results, or the open failed
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    store = ResultStore("sqlite:///~/t.sqlite")
    store.set_best(env(), SPEC, 64, "fwd", CFG, 1.0, 1.0)
    store.close()
    assert (home / "t.sqlite").exists() and not (work / "~").exists()
    reader = ResultStore("sqlite:///~/t.sqlite", create=False)
    assert reader.best_configs(env(), SPEC)[64]["fwd"]["ms"] == 1.0
    reader.close()


def test_other_schema_version_is_refused_with_the_upgrade_command(url):
    from sqlalchemy import text

    store = ResultStore(url)
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE flashgen_meta SET value = '99' WHERE key = 'schema_version'"))
    store.close()
    with pytest.raises(SchemaVersionError, match=r"schema version 99, .*a newer flashgen wrote it: upgrade flashgen"):
        ResultStore(url)


def test_a_refused_database_leaves_no_connection_open(tmp_path, monkeypatch):
    # a store whose constructor raised has no close(): it closes what it opened (PostgreSQL's connections
    # would otherwise stay open until garbage collection)
    from sqlalchemy import text
    from sqlalchemy.engine import Engine

    url = f"sqlite:///{tmp_path / 'other.sqlite'}"
    store = ResultStore(url)
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE flashgen_meta SET value = '99' WHERE key = 'schema_version'"))
    store.close()
    disposed = []
    real = Engine.dispose
    monkeypatch.setattr(Engine, "dispose", lambda self, *a, **kw: (disposed.append(self), real(self, *a, **kw)))
    with pytest.raises(SchemaVersionError):
        ResultStore(url)
    assert len(disposed) == 1 and disposed[0].url.database.endswith("other.sqlite")


def _writer(url, worker, n):
    store = ResultStore(url)
    for i in range(n):  # one study, written by every process at once
        _record(store, TrialRecord(64, "fwd", dict(CFG, worker=worker, i=i), "ok", ms=1.0 + i))


def _run_all(procs, seconds=120):
    """Start the processes together; each must end well."""
    for p in procs:
        p.start()
    for p in procs:
        p.join(seconds)
        assert p.exitcode == 0


def _processes():
    """The start method of the processes these tests run at once on one database: forked by a server that
    imported flashgen's store and Optuna once (spawn imported torch afresh in every process, about 5 s of
    CPU apiece), and started apart from this process's threads, as spawned ones are."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["flashgen.db.store", "optuna"])
    return ctx


def _four_writers(url, target, n):
    """Four processes running target(url, worker, n) at once on one database."""
    ResultStore(url).close()
    ctx = _processes()
    _run_all([ctx.Process(target=target, args=(url, w, n)) for w in range(4)])


def test_concurrent_processes_lose_nothing(url):
    _four_writers(url, _writer, 10)
    store = ResultStore(url)
    assert len(store.trials(env(), SPEC)) == 40
    store.close()


def _asker(url, ready, n):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.load_study(study_name="queue", storage=ResultStore(url).optuna_storage())
    ready.wait(120)
    for _ in range(n):  # what study.optimize does per trial: take the next enqueued one, then tell it
        trial = study.ask()
        study.tell(trial, float(trial.suggest_int("x", 0, 10**6)))


def test_concurrent_workers_never_take_one_enqueued_trial_twice(url):
    # `tune --gpus` workers share a study: on SQLite two could both take one enqueued trial (Optuna's
    # SELECT ... FOR UPDATE is a plain read there), and the second to tell it failed with "Cannot tell
    # a COMPLETE trial" (a CI failure of test_tune_many_specs_over_two_workers)
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    store = ResultStore(url)
    study = optuna.create_study(study_name="queue", storage=store.optuna_storage())
    for x in range(160):
        study.enqueue_trial({"x": x}, skip_if_exists=False)
    store.close()
    ctx = _processes()
    ready = ctx.Barrier(5)  # the four start asking together, once each has loaded the study
    procs = [ctx.Process(target=_asker, args=(url, ready, 40)) for _ in range(4)]
    for p in procs:
        p.start()
    ready.wait(120)
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 4
    store = ResultStore(url)
    trials = optuna.load_study(study_name="queue", storage=store.optuna_storage()).trials
    store.close()
    assert sorted(t.params["x"] for t in trials) == list(range(160))  # each enqueued trial taken once


@pytest.fixture
def fresh_warnings():
    from flashgen import loader

    loader._warned.clear()
    yield
    loader._warned.clear()


def test_missing_database_falls_back_to_default_with_one_warning(tmp_path, fresh_warnings):
    url = f"sqlite:///{tmp_path / 'none.sqlite'}"
    with pytest.warns(flashgen.FlashgenFallbackWarning, match="flashgen tune --spec"):
        kernel = flashgen.load(SPEC, db=url)
    assert kernel.config_source == "default" and not (tmp_path / "none.sqlite").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flashgen.load(SPEC, db=url)  # said once, not again


def test_fallback_warnings_point_at_the_callers_line(tmp_path, fresh_warnings):
    # (a fixed stacklevel named loader.py's own lines on some paths: the default's and an unreadable database's)
    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"this is not a database" * 100)
    for url in (f"sqlite:///{tmp_path / 'none.sqlite'}", f"sqlite:///{corrupt}"):
        with pytest.warns(flashgen.FlashgenFallbackWarning) as record:
            flashgen.load(SPEC, db=url)
        assert {w.filename for w in record} == {__file__}, [(w.filename, w.lineno) for w in record]


def test_a_symlink_loop_is_unreadable_not_missing(tmp_path, fresh_warnings):
    # (it read as missing: only the "no tuned config" warning, not the database's own)
    loop = tmp_path / "loop.sqlite"
    loop.symlink_to(loop)
    with pytest.warns(flashgen.FlashgenFallbackWarning, match="cannot read tuning results from .*loop.sqlite"):
        configs, source = lookup(SPEC, f"sqlite:///{loop}")
    assert source == "default" and configs == {}


def test_corrupt_database_never_raises(tmp_path, fresh_warnings):
    path = tmp_path / "corrupt.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.warns(flashgen.FlashgenFallbackWarning) as record:
        configs, source = lookup(SPEC, f"sqlite:///{path}")
    assert source == "default" and configs == {}
    assert any("flashgen db check" in str(w.message) for w in record)
    other = tmp_path / "other.sqlite"  # a second broken database for the same spec is said too
    other.write_bytes(b"not one either" * 100)
    with pytest.warns(flashgen.FlashgenFallbackWarning, match="other.sqlite"):
        lookup(SPEC, f"sqlite:///{other}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lookup(SPEC, f"sqlite:///{path}")  # each said once
    from click.testing import CliRunner

    from flashgen.cli import main

    result = CliRunner().invoke(main, ["db", "check", "--db", f"sqlite:///{path}"])
    assert result.exit_code == 1 and "cannot be opened" in result.output


def test_locked_database_never_raises(tmp_path, fresh_warnings):
    path = tmp_path / "locked.sqlite"
    store = ResultStore(f"sqlite:///{path}")
    store.set_best(env(), SPEC, 64, "fwd", CFG, 1.0, 1.0)
    store.close()
    conn = sqlite3.connect(path, timeout=0)
    conn.execute("PRAGMA locking_mode=EXCLUSIVE")
    conn.execute("BEGIN EXCLUSIVE")
    try:
        import flashgen.db.store as store_mod

        original = store_mod._sqlite_pragmas

        def short_timeout(engine):  # 30 s busy timeout in production; 0.2 s here
            from sqlalchemy import event

            @event.listens_for(engine, "connect")
            def _c(dbapi_conn, _):
                dbapi_conn.execute("PRAGMA busy_timeout=200")

        store_mod._sqlite_pragmas = short_timeout
        with pytest.warns(flashgen.FlashgenFallbackWarning, match="cannot read tuning results"):
            _, source = lookup(SPEC, f"sqlite:///{path}")
        assert source == "default"
    finally:
        store_mod._sqlite_pragmas = original
        conn.rollback()
        conn.close()


def test_a_malformed_shipped_entry_costs_only_itself(tmp_path, monkeypatch, fresh_warnings):
    # one bad entry made flashgen.load skip the whole file: every good entry of that GPU lost with it
    import yaml

    src = ResultStore(f"sqlite:///{tmp_path / 'src.sqlite'}")
    src.set_best(env(), SPEC, 1024, "fwd", dict(CFG, BLOCK_M=32), 1.0, 1.0)
    layer = tmp_path / "tuning_db"
    layer_mod.export_rows(src.all_best(), layer / "interp.yaml", env().gpu)
    doc = yaml.safe_load((layer / "interp.yaml").read_text())
    doc["results"].insert(0, dict(doc["results"][0], ms=-1.0, bucket=4096))  # a negative time: malformed
    (layer / "interp.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(layer_mod.ResultFileError, match="results entry 0"):
        layer_mod.read_file(layer / "interp.yaml")  # (import and recheck stay strict)
    monkeypatch.setattr(layer_mod, "layer_dir", lambda: layer)
    here = env()
    monkeypatch.setattr(EnvInfo, "current", classmethod(lambda cls, interpret=False: here))
    with pytest.warns(flashgen.FlashgenFallbackWarning, match="skipping 1 malformed entry of the shipped .*entry 0"):
        configs, source = lookup(SPEC, f"sqlite:///{tmp_path / 'empty.sqlite'}")
    assert source == "tuning_db" and configs[1024].BLOCK_M == 32


def test_shipped_layer_is_read_below_the_user_database(tmp_path, monkeypatch, fresh_warnings):
    src = ResultStore(f"sqlite:///{tmp_path / 'src.sqlite'}")
    src.set_best(env(), SPEC, 1024, "fwd", dict(CFG, BLOCK_M=32), 1.0, 1.0)
    layer = tmp_path / "tuning_db"
    layer_mod.export_rows(src.all_best(), layer / "interp.yaml", env().gpu)
    kernel = layer_mod.read_file(layer / "interp.yaml")[0]["kernel"]  # the file carries the kernels' hash
    assert kernel is not None and kernel == src.all_best()[0]["kernel"]
    monkeypatch.setattr(layer_mod, "layer_dir", lambda: layer)
    here = env()
    monkeypatch.setattr(EnvInfo, "current", classmethod(lambda cls, interpret=False: here))
    configs, source = lookup(SPEC, f"sqlite:///{tmp_path / 'empty.sqlite'}")
    assert source == "tuning_db" and configs[1024].BLOCK_M == 32
    user = ResultStore(f"sqlite:///{tmp_path / 'user.sqlite'}")
    user.set_best(env(), SPEC, 1024, "fwd", dict(CFG, BLOCK_M=64), 1.0, 1.0)
    configs, source = lookup(SPEC, user.url)
    assert source.startswith("database") and configs[1024].BLOCK_M == 64  # the user's own wins


def test_lookup_is_fast(tmp_path, monkeypatch, fresh_warnings):
    import time

    here = env()
    monkeypatch.setattr(EnvInfo, "current", classmethod(lambda cls, interpret=False: here))
    store = ResultStore(f"sqlite:///{tmp_path / 'fast.sqlite'}")
    store.set_best(env(), SPEC, 1024, "fwd", CFG, 1.0, 1.0)
    lookup(SPEC, store.url)  # first call imports what it needs
    times = []
    for _ in range(5):  # the fastest of five: a loaded CI machine stalls single calls for 0.5 s
        start = time.perf_counter()
        configs, source = lookup(SPEC, store.url)
        times.append(time.perf_counter() - start)
    assert source.startswith("database") and min(times) < 0.05, times


def test_each_phase_contributes_only_its_own_knobs(tmp_path, monkeypatch, fresh_warnings):
    # The bwd row carries the whole config it was tuned with, forward knobs included. A later
    # forward-only re-tune must win for the forward knobs; the bwd row supplies only its own.
    here = env()
    monkeypatch.setattr(EnvInfo, "current", classmethod(lambda cls, interpret=False: here))
    store = ResultStore(f"sqlite:///{tmp_path / 'phases.sqlite'}")
    stale_fwd = dict(CFG, BLOCK_M=16)
    store.set_best(here, SPEC, 1024, "bwd", dict(stale_fwd, BLOCK_M1=32, dq_strategy="atomic"), 1.0, 1.0)
    store.set_best(here, SPEC, 1024, "fwd", dict(CFG, BLOCK_M=64, loop_order="kv_outer"), 1.0, 1.0)
    configs, source = lookup(SPEC, store.url)
    cfg = configs[1024]
    assert source.startswith("database")
    assert (cfg.BLOCK_M, cfg.loop_order) == (64, "kv_outer")  # from the fwd row, not the bwd row's copy
    assert (cfg.BLOCK_M1, cfg.dq_strategy) == (32, "atomic")  # from the bwd row


# ----------------------------------------------------------------------------- passwords
SECRET_URLS = [
    "postgresql+psycopg://admin:S3cretPw@127.0.0.1:1/db",  # a server that is not there
    "postgresql://admin:S3cretPw@127.0.0.1:abc/db",  # a port SQLAlchemy cannot parse
    "nosuchdb://admin:S3cretPw@127.0.0.1/db",  # a kind of database SQLAlchemy does not know
    "postgresql+psycopg://admin:S3cretPw%40x%2Fy@127.0.0.1:1/db",  # %-encoded '@' and '/'
]


@pytest.mark.parametrize("url", SECRET_URLS, ids=["unreachable", "bad-port", "unknown-dialect", "encoded"])
def test_passwords_are_never_shown(url, fresh_warnings):
    from flashgen.db import DatabaseError

    with pytest.warns(flashgen.FlashgenFallbackWarning) as record:
        flashgen.load(SPEC, db=url)
    messages = [str(w.message) for w in record]
    assert any("cannot read tuning results from" in m and "admin:***@" in m for m in messages), messages
    with pytest.raises(DatabaseError) as info:
        ResultStore(url, create=False)
    shown = " ".join(messages + [str(info.value), repr(info.value), info.value.url])
    assert "S3cret" not in shown and "admin:***@" in shown


def test_a_server_that_never_answers_is_an_error_not_a_hang(monkeypatch, fresh_warnings):
    # a PostgreSQL URL whose server accepts the connection and never answers: a connect timeout
    # (urls.engine_options), then the store's error and load's fallback, instead of every call waiting
    import socket
    import time

    from flashgen.db import DatabaseError, urls

    pytest.importorskip("psycopg")
    monkeypatch.setattr(urls, "CONNECT_TIMEOUT_S", 2)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)  # the kernel accepts the connections; nothing ever answers them
        url = f"postgresql+psycopg://u:S3cret@127.0.0.1:{server.getsockname()[1]}/x"
        start = time.monotonic()
        with pytest.raises(DatabaseError, match="cannot be opened"):
            ResultStore(url, create=False)
        with pytest.warns(flashgen.FlashgenFallbackWarning, match="cannot read tuning results"):
            flashgen.load(SPEC, db=url)
        assert time.monotonic() - start < 20
    assert urls.engine_options(url) == {"connect_args": {"connect_timeout": 2}}
    assert urls.engine_options(url + "?connect_timeout=60") == {}  # the URL's own setting stands
    assert urls.engine_options("sqlite:///x.sqlite") == {}


def test_display_url_and_repr(tmp_path):
    from flashgen.db import display_url, hide_password

    assert display_url("postgresql://admin:S3cret@host/db") == "postgresql://admin:***@host/db"
    assert display_url("postgresql://admin:p@ss@host:x/db") == "postgresql://admin:***@host:x/db"
    assert hide_password("boom at postgresql://a:S3cret@h/db (S3cret)", "postgresql://a:S3cret@h/db") \
        == "boom at postgresql://a:***@h/db (***)"
    # a short or common password is hidden where it stands alone, not inside other words (the message was
    # "databas*** postgr***sql://u:***@...: cannot b*** op***n***d", its asterisks spelling the password out)
    url = "postgresql://u:e@127.0.0.1:1/flashgen"
    assert hide_password(f"database {url}: cannot be opened: password=e refused", url) \
        == "database postgresql://u:***@127.0.0.1:1/flashgen: cannot be opened: password=*** refused"
    url = f"sqlite:///file:{tmp_path / 'r.sqlite'}?mode=rwc&uri=true"  # shown as given: no password
    assert display_url(url) == url and repr(ResultStore(url)) == f"ResultStore({url!r})"


# ----------------------------------------------------------------------------- malformed results
def _exported(tmp_path, name="good.yaml", bucket=1024, block_m=32):
    src = ResultStore(f"sqlite:///{tmp_path / ('src-' + name + '.sqlite')}")
    src.set_best(env(), SPEC, bucket, "fwd", dict(CFG, BLOCK_M=block_m), 1.0, 1.0)
    path = tmp_path / "layer" / name
    layer_mod.export_rows(src.all_best(), path, env().gpu)
    return path


BAD_ENTRIES = {  # what a careless edit (or a hostile file) writes -> the field the error names
    "bucket-0": (("bucket",), 0, "bucket"),
    "bucket-negative": (("bucket",), -1024, "bucket"),
    "bucket-string": (("bucket",), "1024", "bucket"),
    "bucket-not-pow2": (("bucket",), 1000, "bucket"),
    "bucket-bool": (("bucket",), True, "bucket"),
    "knob-string": (("config", "BLOCK_M"), "32", "config"),
    "knob-value": (("config", "num_warps"), 3, "config"),
    "knob-unknown": (("config", "BLOCK_Q"), 32, "config"),
    "config-list": (("config",), [32, 32], "config"),
    "phase": (("phase",), "forward", "phase"),
    "ms-string": (("ms",), "fast", "ms"),
    "ms-nan": (("ms",), float("nan"), "ms"),
    "tflops-none": (("tflops",), None, "tflops"),
    "env-field": (("environment", "sm_count"), "many", "environment.sm_count"),
    # (accepted before session 52's review: a negative count, a GPU name that printed over two lines in `show`,
    # a time that beat every real result of its bucket)
    "env-negative": (("environment", "sm_count"), -1, "environment.sm_count"),
    "env-newline": (("environment", "gpu"), "NVIDIA H100\nfake", "environment.gpu"),
    "ms-tiny": (("ms",), 1e-300, "ms"),
}


def _spoil(path, keys, value):
    import yaml

    doc = yaml.safe_load(path.read_text())
    target = doc["results"][0]
    for key in keys[:-1]:
        target = target[key]
    target[keys[-1]] = value
    path.write_text(yaml.safe_dump(doc))


def test_unknown_fields_in_a_results_file_are_refused(tmp_path):
    import yaml

    path = _exported(tmp_path)
    doc = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump(dict(doc, foo=1)))
    with pytest.raises(layer_mod.ResultFileError, match="unknown field 'foo'"):
        layer_mod.read_file(path)
    doc["results"][0]["speed"] = "fast"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(layer_mod.ResultFileError, match="results entry 0: unknown field 'speed'"):
        layer_mod.read_file(path)


@pytest.mark.parametrize("case", list(BAD_ENTRIES))
def test_malformed_entries_are_refused_on_import(tmp_path, case):
    from click.testing import CliRunner

    from flashgen.cli import main

    keys, value, field = BAD_ENTRIES[case]
    path = _exported(tmp_path)
    _spoil(path, keys, value)
    with pytest.raises(layer_mod.ResultFileError) as info:
        layer_mod.read_file(path)
    assert f"results entry 0 ({SPEC.uri}): field '{field}'" in str(info.value) and str(path) in str(info.value)
    target = tmp_path / "target.sqlite"
    result = CliRunner().invoke(main, ["import", str(path), "--db", f"sqlite:///{target}"])
    assert result.exit_code == 2 and f"field '{field}'" in result.output and not target.exists()


def test_import_rows_checks_every_row_before_writing(tmp_path):
    from flashgen.db import ResultRowError

    rows = layer_mod.read_file(_exported(tmp_path))
    store = ResultStore(f"sqlite:///{tmp_path / 'direct.sqlite'}")
    with pytest.raises(ResultRowError, match=r"field '1.bucket'"):
        store.import_rows([rows[0], dict(rows[0], bucket=0)])
    assert store.all_best() == []  # not even the good first row


def test_an_import_of_stale_results_replaces_no_usable_row(tmp_path):
    # An old export's rows (kernels this flashgen no longer renders), however fast, replaced the database's usable
    # rows, and the loader then served neither (a review's catch). They are kept out; where nothing is stored they
    # land (the loader judges them stale there).
    from flashgen.db.kernels import current_kernel

    store = ResultStore(f"sqlite:///{tmp_path / 'here.sqlite'}")
    store.set_best(env(), SPEC, 64, "fwd", CFG, 1.0, 1.0)
    (row,) = store.all_best()
    assert row["kernel"] == current_kernel(SPEC, CFG, "fwd")
    old = dict(row, kernel="0123456789abcdef", ms=0.5)
    assert store.import_rows([old]) == 0
    (kept,) = store.all_best()
    assert kept["ms"] == 1.0 and kept["kernel"] == row["kernel"]
    assert store.import_rows([dict(row, ms=0.5)]) == 1  # a faster current one still replaces it
    other = ResultStore(f"sqlite:///{tmp_path / 'empty.sqlite'}")
    assert other.import_rows([old]) == 1


def test_one_bad_shipped_file_is_skipped_alone_and_said_once(tmp_path, monkeypatch, fresh_warnings):
    good = _exported(tmp_path, "a-good.yaml", bucket=1024, block_m=32)
    bad = _exported(tmp_path, "b-bad.yaml", bucket=2048, block_m=64)
    _spoil(bad, ("bucket",), 0)
    (good.parent / "c-latin1.yaml").write_bytes("gpu: caf\u00e9\n".encode("latin-1"))
    monkeypatch.setattr(layer_mod, "layer_dir", lambda: good.parent)
    here = env()
    monkeypatch.setattr(EnvInfo, "current", classmethod(lambda cls, interpret=False: here))
    empty = f"sqlite:///{tmp_path / 'none.sqlite'}"
    with pytest.warns(flashgen.FlashgenFallbackWarning) as record:
        kernel = flashgen.load(SPEC, db=empty)
    assert kernel.config_source == "tuning_db" and kernel.bucket_configs[1024].BLOCK_M == 32
    assert 2048 not in kernel.bucket_configs or kernel.bucket_configs[2048] == default_config(SPEC, target_of(here), seqlen=2048)
    assert kernel.config_for(1000).BLOCK_M == 32
    messages = [str(w.message) for w in record]
    assert len(messages) == 2, messages
    assert any(str(bad) in m and "field 'bucket'" in m for m in messages)
    assert any("c-latin1.yaml" in m and "not UTF-8" in m for m in messages)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flashgen.load(SPEC.replace(name="other"), db=empty)  # said once, not per spec or per call


def _spoil_db(path, sql):
    conn = sqlite3.connect(path)
    conn.execute(sql)
    conn.commit()
    conn.close()


def test_malformed_rows_in_the_database_are_skipped_and_reported(tmp_path, monkeypatch, fresh_warnings):
    from click.testing import CliRunner

    from flashgen.cli import main

    here = env()
    monkeypatch.setattr(EnvInfo, "current", classmethod(lambda cls, interpret=False: here))
    path = tmp_path / "spoiled.sqlite"
    store = ResultStore(f"sqlite:///{path}")
    for bucket in (64, 128, 256, 512):
        store.set_best(here, SPEC, bucket, "fwd", dict(CFG, BLOCK_M=64), 1.0, 1.0)
    store.close()
    _spoil_db(path, "UPDATE best_configs SET bucket = 0 WHERE bucket = 64")
    _spoil_db(path, "UPDATE best_configs SET bucket = 'big' WHERE bucket = 128")
    _spoil_db(path, """UPDATE best_configs SET config = '{"BLOCK_M": "64"}' WHERE bucket = 256""")
    with pytest.warns(flashgen.FlashgenFallbackWarning, match="skipping 3 malformed tuning result"):
        kernel = flashgen.load(SPEC, db=f"sqlite:///{path}")
    assert kernel.bucket_configs[512].BLOCK_M == 64 and kernel.config_for(500).BLOCK_M == 64  # calls still work
    assert kernel.bucket_configs[256] == default_config(SPEC, target_of(here), seqlen=256)  # the skipped row's bucket: its default
    result = CliRunner().invoke(main, ["db", "check", "--db", f"sqlite:///{path}"])
    assert result.exit_code == 1, result.output
    assert "bucket 0 'fwd') is invalid: field 'bucket'" in result.output
    assert "bucket 'big' 'fwd') is invalid: field 'bucket'" in result.output
    assert "config knob 'BLOCK_M'" in result.output
    _spoil_db(path, "UPDATE best_configs SET config = 'not json' WHERE bucket = 512")
    result = CliRunner().invoke(main, ["db", "check", "--db", f"sqlite:///{path}"])
    assert result.exit_code == 1 and "field 'config': not JSON" in result.output


@pytest.mark.parametrize("spoil, words", [
    ("UPDATE best_configs SET ms = 'fast' WHERE bucket = 64", "field 'ms'"),
    ("UPDATE best_configs SET config = 'not json' WHERE bucket = 64", "field 'config': not JSON"),
    ("UPDATE specs SET canonical = 'not json'", "field 'canonical': not JSON"),
    ("UPDATE environments SET sm_count = 'x'", "field 'sm_count'"),
])
def test_show_and_export_skip_a_malformed_row_and_db_check_names_it(tmp_path, monkeypatch, spoil, words):
    # show and export raised mid-table (TypeError, JSONDecodeError, "Unknown format code"), export wrote rows
    # import refused, and db check said "ok" of a spec or environment edited by hand
    from click.testing import CliRunner

    from flashgen.cli import main

    here = env()
    monkeypatch.setattr(EnvInfo, "current", classmethod(lambda cls, interpret=False: here))
    path = tmp_path / "spoiled.sqlite"
    store = ResultStore(f"sqlite:///{path}")
    for bucket in (64, 128):
        store.set_best(here, SPEC, bucket, "fwd", dict(CFG, BLOCK_M=64), 1.0, 1.0)
    store.close()
    _spoil_db(path, spoil)
    url = f"sqlite:///{path}"
    readable = "best_configs" in spoil  # one of the two rows: else both (their spec's or environment's)
    for args in (["show"], ["export", "-o", str(tmp_path / "out.yaml")]):
        result = CliRunner().invoke(main, [*args, "--db", url])
        # export with nothing readable left: an error, no empty file
        assert result.exit_code == (0 if readable or args == ["show"] else 1), result.output
        assert "Traceback" not in result.output and "malformed result(s)" in result.output
        assert "flashgen db check" in result.output
    if readable:
        rows = layer_mod.read_file(tmp_path / "out.yaml")  # what export wrote, import takes
        assert [r["bucket"] for r in rows] == [128]
    else:
        assert "its 2 results are all malformed" in result.output and not (tmp_path / "out.yaml").exists()
    result = CliRunner().invoke(main, ["db", "check", "--db", url])
    assert result.exit_code == 1 and words in result.output, result.output


def test_db_check_names_a_column_gone(tmp_path):
    from click.testing import CliRunner

    from flashgen.cli import main

    path = tmp_path / "column.sqlite"
    ResultStore(f"sqlite:///{path}").close()
    _spoil_db(path, "ALTER TABLE best_configs DROP COLUMN tflops")
    result = CliRunner().invoke(main, ["db", "check", "--db", f"sqlite:///{path}"])
    assert result.exit_code == 1 and "table 'best_configs' lacks column(s) tflops" in result.output, result.output


def test_a_stored_config_the_spec_cannot_take_is_skipped(tmp_path, monkeypatch, fresh_warnings):
    # sound knobs that this spec's kernels cannot take (check_spec: the Gluon forward's shared memory at hd128)
    # are skipped like a malformed row, not raised from the first call
    here = env()
    monkeypatch.setattr(EnvInfo, "current", classmethod(lambda cls, interpret=False: here))
    spec = AttentionSpec(name="dbspec-hd128", dtype="bf16", head_dim=128, num_heads=2)
    store = ResultStore(f"sqlite:///{tmp_path / 'db.sqlite'}")
    hopper = dict(CFG, BLOCK_M=128, BLOCK_N=128, num_stages=3, family="hopper_ws")
    store.set_best(here, spec, 1024, "fwd", dict(hopper, hopper_tma_store=True), 1.0, 1.0)
    store.set_best(here, spec, 4096, "fwd", hopper, 1.0, 1.0)
    store.close()
    with pytest.warns(flashgen.FlashgenFallbackWarning, match="skipping 1 malformed.*1024.*shared memory"):
        kernel = flashgen.load(spec, db=f"sqlite:///{tmp_path / 'db.sqlite'}")
    assert kernel.bucket_configs[1024] == default_config(spec, target_of(here), seqlen=1024)
    assert kernel.bucket_configs[4096].num_stages == 3 and kernel.bucket_configs[4096].family == "hopper_ws"


def test_set_best_refuses_a_malformed_result(tmp_path):
    from flashgen.db import ResultRowError

    store = ResultStore(f"sqlite:///{tmp_path / 'strict.sqlite'}")
    with pytest.raises(ResultRowError, match="field 'bucket'"):
        store.set_best(env(), SPEC, 0, "fwd", CFG, 1.0, 1.0)
    with pytest.raises(ResultRowError, match="field 'phase'"):
        store.set_best(env(), SPEC, 64, "both", CFG, 1.0, 1.0)


def test_db_upgrade_creates_missing_tables_and_refuses_other_versions(tmp_path):
    from click.testing import CliRunner
    from sqlalchemy import text

    from flashgen.cli import main

    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    store = ResultStore(url)
    store.optuna_storage()  # Optuna's tables are made on first use
    with store.engine.begin() as conn:
        conn.execute(text("DROP TABLE best_configs"))
        conn.execute(text("DROP TABLE trial_heartbeats"))
    assert store.missing_tables() == ["best_configs", "trial_heartbeats"]
    result = CliRunner().invoke(main, ["db", "upgrade", "--db", url])
    assert result.exit_code == 0 and "at schema version 5" in result.output
    assert store.missing_tables() == []
    for version, words in (("99", "newer than this flashgen's 5"), ("0", "no migration from schema version 0"),
                           ("abc", "is at flashgen schema version abc")):  # (it said "from schema version -1")
        with store.engine.begin() as conn:
            conn.execute(text(f"UPDATE flashgen_meta SET value = '{version}' WHERE key = 'schema_version'"))
        result = CliRunner().invoke(main, ["db", "upgrade", "--db", url])
        assert result.exit_code == 1 and words in result.output, result.output
    store.close()


# ------------------------------------------------------------------------------ environments
# The shipped tuning_db/ was measured in the triton 3.6 GPU image; the README's install on an
# H100 brings other torch and CUDA builds and maybe another Triton patch release.
H100 = dict(gpu="NVIDIA H100 80GB HBM3", capability="9.0", sm_count=132, memory_gib=79.2)
IMAGE = dict(torch="2.11.0", triton="3.6.0", cuda="13.0")
README_INSTALL = dict(torch="2.13.0", triton="3.6.1", cuda="12.8", memory_gib=79.1)


def _h100(**changes):
    from flashgen import __version__
    from flashgen.codegen.render import templates_hash

    return EnvInfo(**{**H100, **IMAGE, "flashgen": __version__, "templates": templates_hash(), **changes})


def _as_machine(monkeypatch, here):
    monkeypatch.setattr(EnvInfo, "current", classmethod(lambda cls, interpret=False: here))


@pytest.mark.parametrize("machine, source", [
    (dict(), "tuning_db"),  # the triton 3.6 image: exact
    (README_INSTALL, "tuning_db (near match: tuned with triton 3.6.0, torch 2.11.0, cuda 13.0, memory_gib 79.2)"),
    (dict(torch="2.11.1", cuda="13.0"), "tuning_db"),  # torch is not what the shipped file says: near
    (dict(triton="3.7.0"), "default"),  # another Triton minor compiles other code
    (dict(gpu="NVIDIA H100 PCIe", sm_count=114), "default"),  # another GPU model
    (dict(templates="0" * 16), "tuning_db"),  # other templates, the same kernels: the entries' kernel hashes decide
])
def test_shipped_tuning_db_serves_h100_users(machine, source, monkeypatch, fresh_warnings, tmp_path):
    spec = AttentionSpec.from_yaml(os.path.join(os.path.dirname(__file__), "..", "examples", "specs",
                                                "gqa-causal.yaml"))
    here = _h100(**machine)
    _as_machine(monkeypatch, here)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        configs, got = lookup(spec, f"sqlite:///{tmp_path / 'none.sqlite'}")
    if machine.get("torch") == "2.11.1":  # a near match whose label names only what differs
        assert got == "tuning_db (near match: tuned with torch 2.11.0)"
    else:
        assert got == source
    assert bool(configs) == (source != "default")
    if configs:
        shipped = layer_mod.shipped_best(spec.key, here)
        assert configs[4096].BLOCK_M == shipped[4096]["fwd"]["config"]["BLOCK_M"]
        assert configs[4096].BLOCK_M1 == shipped[4096]["bwd"]["config"]["BLOCK_M1"]
        assert not caught
    else:
        assert any("no tuned config" in str(w.message) for w in caught)


def test_template_edits_keep_the_shipped_results_until_the_kernels_change(edited_templates, monkeypatch,
                                                                          fresh_warnings, tmp_path):
    # tuning_db/ entries store the hash of the kernels they timed: an edit that leaves them alone
    # keeps serving H100 users; one that changes them is stale, and the fallback says so.
    spec = AttentionSpec.from_yaml(os.path.join(os.path.dirname(__file__), "..", "examples", "specs",
                                                "gqa-causal.yaml"))
    _as_machine(monkeypatch, _h100())
    none = f"sqlite:///{tmp_path / 'none.sqlite'}"
    edited_templates("common/tiles.j2", "# K^T as (BLOCK_D, BLOCK_N) and V as (BLOCK_N, BLOCK_DV); padding reads as 0.",
                     "# the K^T and V tiles\n")
    edited_templates("decode/combine.j2", "@triton.jit", "# another decode note\n@triton.jit")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        configs, source = lookup(spec, none)
    assert source == "tuning_db" and {1024, 4096, 16384} <= set(configs)
    # code both phases run (each loads K/V tiles)
    edited_templates("common/tiles.j2", "    return k, v\n", "    k, v = k, v\n    return k, v\n")
    with pytest.warns(flashgen.FlashgenFallbackWarning, match=r"in tuning_db are stale .*flashgen tune --spec"):
        configs, source = lookup(spec, none)
    assert (configs, source) == ({}, "default")


def _stored_row(kernel, **environment):
    """One best config of SPEC at S=1024 fwd in this (interpreter) environment, as exported."""
    return dict(environment=dict(env().as_dict(), **environment), spec_key=SPEC.key, spec_uri=SPEC.uri,
                spec=SPEC.canonical(), bucket=1024, phase="fwd", config=dict(CFG, BLOCK_M=16), ms=0.5, tflops=1.0,
                default_ms=None, kernel=kernel)


@pytest.mark.parametrize("row", [
    _stored_row("0123456789abcdef"),  # timed on kernels this flashgen renders differently
    _stored_row(None, templates="0" * 16),  # from before kernel hashes, with other templates: as always
], ids=["kernel-hash", "no-kernel-hash"])
def test_a_stale_result_is_said_never_used_and_replaced(row, tmp_path, monkeypatch, fresh_warnings):
    from click.testing import CliRunner

    from flashgen.cli import main
    from flashgen.codegen.render import kernel_hash
    from flashgen.config import KernelConfig

    here = env()
    monkeypatch.setattr(EnvInfo, "current", classmethod(lambda cls, interpret=False: here))
    monkeypatch.setattr(layer_mod, "layer_dir", lambda: tmp_path / "no-layer")
    store = ResultStore(f"sqlite:///{tmp_path / 'stale.sqlite'}")
    assert store.import_rows([row]) == 1
    assert [r["config"]["BLOCK_M"] for r in store.stale_best(here, SPEC)] == [16]
    with pytest.warns(flashgen.FlashgenFallbackWarning, match=f"in database {store.url} are stale"):
        assert lookup(SPEC, store.url) == ({}, "default")
    shown = CliRunner().invoke(main, ["show", "--db", store.url], catch_exceptions=False)
    assert shown.output.rstrip().endswith("stale here (timed on kernels the templates have changed since; not used: "
                                          "re-tune)"), shown.output
    # a new result replaces a stale one in its environment even when slower, then counts as usual
    fresh = dict(CFG, BLOCK_M=32)
    assert store.set_best(env(), SPEC, 1024, "fwd", fresh, 2.0, 1.0) is None
    assert store.set_best(env(), SPEC, 1024, "fwd", dict(CFG, BLOCK_M=64), 3.0, 1.0)["ms"] == 2.0
    configs, source = lookup(SPEC, store.url)
    assert configs[1024].BLOCK_M == 32 and source == f"database {store.url}"
    kernels = {r["config"]["BLOCK_M"]: r["kernel"] for r in store.all_best()}
    assert kernels[32] == kernel_hash(SPEC, KernelConfig.from_dict(fresh), "fwd")
    # replaced where it was measured; a stale row of other templates stays in its own environment, unused
    assert [r["environment"]["templates"] for r in store.stale_best(here, SPEC)] == ([] if row["kernel"] else
                                                                                     ["0" * 16])


@pytest.mark.interpreter
def test_tune_says_a_stored_result_is_stale_and_replaces_it(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from flashgen.cli import main

    path = tmp_path / "spec.yaml"
    path.write_text("name: stale\ndtype: fp32\nhead_dim: 16\nnum_heads: 2\ncausal: true\n"
                    "tune: {seqlens: [16], trials: 1}\n")
    spec = AttentionSpec.from_yaml(path)
    store = ResultStore(f"sqlite:///{tmp_path / 'tune.sqlite'}")
    store.import_rows([dict(_stored_row("0123456789abcdef"), spec_key=spec.key, spec_uri=spec.uri,
                            spec=spec.canonical(), bucket=16)])
    result = CliRunner().invoke(main, ["tune", str(path), "--interpret", "--db", store.url])
    assert result.exit_code == 0, result.output
    assert f"{spec.uri}: 1 stored result(s) on triton-interpreter are stale" in result.stderr
    assert not store.stale_best(env(), spec) and list(store.best_configs(env(), spec)) == [16]


def test_a_result_without_kernel_hash_serves_with_the_same_templates(tmp_path, monkeypatch, fresh_warnings):
    here = env()
    monkeypatch.setattr(EnvInfo, "current", classmethod(lambda cls, interpret=False: here))
    store = ResultStore(f"sqlite:///{tmp_path / 'old.sqlite'}")
    store.import_rows([_stored_row(None)])
    configs, source = lookup(SPEC, store.url)
    assert configs[1024].BLOCK_M == 16 and source == f"database {store.url}"


def _downgraded_then_upgraded(store, version: int, column: str, default_db: bool = False):
    """Take a database back to schema ``version`` (which lacks best_configs.``column``), check it
    is refused, upgrade it with `flashgen db upgrade` (default_db: without --db, the database
    FLASHGEN_DB names); the store reopened."""
    from alembic import command
    from click.testing import CliRunner
    from sqlalchemy import inspect

    from flashgen.cli import main
    from flashgen.db import SCHEMA_VERSION, migrate

    url = store.url
    with store.engine.begin() as conn:
        command.downgrade(migrate._config(conn), migrate.REVISIONS[version])
    assert column not in {c["name"] for c in inspect(store.engine).get_columns("best_configs")}
    store.close()
    with pytest.raises(SchemaVersionError, match=rf"schema version {version}, .*flashgen db upgrade --db "):
        ResultStore(url)
    if default_db:  # (before, an upgrade without --db passed None to the migration: a traceback)
        result = CliRunner().invoke(main, ["db", "upgrade"], env={"FLASHGEN_DB": url})
    else:
        result = CliRunner().invoke(main, ["db", "upgrade", "--db", url])
    assert result.exit_code == 0, result.output
    assert f"upgraded from schema version {version} to {SCHEMA_VERSION}" in result.output, result.output
    return ResultStore(url)


def test_db_upgrade_from_schema_3_fills_the_kernel_hashes_it_can_tell(url):
    from flashgen.codegen.render import kernel_hash
    from flashgen.config import KernelConfig

    store = ResultStore(url)
    store.set_best(env(), SPEC, 64, "fwd", CFG, 1.0, 1.0)  # measured with this flashgen's templates
    store.set_best(EnvInfo(**dict(env().as_dict(), templates="0" * 16)), SPEC, 64, "fwd", CFG, 1.0, 1.0)
    store = _downgraded_then_upgraded(store, 3, "kernel")
    kernels = {r["environment"]["templates"]: r["kernel"] for r in store.all_best()}
    assert kernels == {env().templates: kernel_hash(SPEC, KernelConfig.from_dict(CFG), "fwd"), "0" * 16: None}
    store.close()


def test_exact_match_preferred_then_the_nearest(tmp_path, monkeypatch, fresh_warnings):
    here = _h100(**README_INSTALL)
    _as_machine(monkeypatch, here)
    store = ResultStore(f"sqlite:///{tmp_path / 'envs.sqlite'}")
    far = _h100()  # triton 3.6.0, torch 2.11.0: near
    nearer = _h100(triton="3.6.1")  # same Triton patch release: nearer
    store.set_best(far, SPEC, 1024, "fwd", dict(CFG, BLOCK_M=16), 1.0, 1.0)
    store.set_best(nearer, SPEC, 1024, "fwd", dict(CFG, BLOCK_M=32), 1.0, 1.0)
    store.set_best(_h100(triton="3.7.0"), SPEC, 1024, "fwd", dict(CFG, BLOCK_M=128), 1.0, 1.0)  # no match
    configs, source = lookup(SPEC, store.url)
    assert configs[1024].BLOCK_M == 32
    assert source == f"database {store.url} (near match: tuned with torch 2.11.0, cuda 13.0, memory_gib 79.2)"
    store.set_best(here, SPEC, 1024, "fwd", dict(CFG, BLOCK_M=64), 1.0, 1.0)
    configs, source = lookup(SPEC, store.url)
    assert configs[1024].BLOCK_M == 64 and source == f"database {store.url}"  # exact: no label
    assert {r["match"] for r in store.matching_best(here, SPEC)[1024].values()} == {"exact"}


@pytest.mark.parametrize("version, minor", [("3.6.1", "3.6"), ("3.6.0+git1a2b", "3.6"), ("3.10.0", "3.10"),
                                            ("3", None), (None, None)])
def test_triton_minor(version, minor):
    from flashgen.db.env import triton_minor

    assert triton_minor(version) == minor


# ------------------------------------------------------------------------------ results you can trust
def test_a_slower_result_never_replaces_a_faster_one(url):
    store = ResultStore(url)
    assert store.set_best(env(), SPEC, 64, "fwd", CFG, 2.0, 1.0, default_ms=3.0) is None
    slower = dict(CFG, BLOCK_M=32)
    kept = store.set_best(env(), SPEC, 64, "fwd", slower, 2.5, 0.8, default_ms=3.0)
    assert kept == dict(config=CFG, ms=2.0, tflops=1.0, default_ms=3.0)
    assert store.best_configs(env(), SPEC)[64]["fwd"]["config"] == CFG
    faster = dict(CFG, BLOCK_N=16)
    assert store.set_best(env(), SPEC, 64, "fwd", faster, 1.5, 1.3) is None
    assert store.best_configs(env(), SPEC)[64]["fwd"]["ms"] == 1.5
    # another environment is another result: its slower time does not compete
    other = EnvInfo(**{**env().as_dict(), "torch": "0.0.0"})
    assert store.set_best(other, SPEC, 64, "fwd", slower, 9.0, 0.1) is None
    # import follows the same rule, and counts only what it stored
    rows = [dict(r, ms=r["ms"] * 2) for r in store.all_best()] + \
        [dict(r, ms=r["ms"] / 2, bucket=128) for r in store.all_best()]
    assert store.import_rows(rows) == 2
    assert store.best_configs(env(), SPEC)[64]["fwd"]["ms"] == 1.5


def _best_writer(url, worker, n):
    store = ResultStore(url)
    for i in range(n):
        store.set_best(env(), SPEC, 64, "fwd", dict(CFG, BLOCK_M=(16, 32, 64, 128)[worker]), 10.0 - worker - i / n,
                       1.0)


def test_concurrent_best_writers_keep_the_fastest(url):
    _four_writers(url, _best_writer, 20)
    best = ResultStore(url).best_configs(env(), SPEC)[64]["fwd"]
    assert best["config"]["BLOCK_M"] == 128 and best["ms"] == pytest.approx(10.0 - 3 - 19 / 20)


def _opener(url, barrier, errors):
    barrier.wait()
    try:
        ResultStore(url).close()
    except Exception as err:  # noqa: BLE001 (reported to the test)
        errors.put(str(err))


def test_processes_creating_one_fresh_database_at_once_all_succeed(tmp_path):
    # Before: "table flashgen_meta already exists" in about half of such races.
    ctx = mp.get_context("fork")
    errors = ctx.Queue()
    for attempt in range(8):
        url = f"sqlite:///{tmp_path / f'fresh{attempt}.sqlite'}"
        barrier = ctx.Barrier(3)
        _run_all([ctx.Process(target=_opener, args=(url, barrier, errors)) for _ in range(3)], 60)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert found == []


def test_a_database_deleted_while_in_use_is_an_error(tmp_path):
    path = tmp_path / "gone.sqlite"
    store = ResultStore(f"sqlite:///{path}")
    store.set_best(env(), SPEC, 64, "fwd", CFG, 1.0, 1.0)
    path.unlink()
    with pytest.raises(flashgen.db.DatabaseError, match="was deleted or replaced while in use"):
        store.set_best(env(), SPEC, 128, "fwd", CFG, 1.0, 1.0)
    ResultStore(f"sqlite:///{path}")  # a new database there
    with pytest.raises(flashgen.db.DatabaseError, match="was deleted or replaced while in use"):
        store.ensure_present()


def test_default_database_lives_in_the_user_data_dir(tmp_path, monkeypatch):
    import platformdirs

    from flashgen.db import default_url

    monkeypatch.delenv("FLASHGEN_DB", raising=False)
    monkeypatch.setattr(platformdirs, "user_data_dir", lambda app: str(tmp_path / "data" / app))
    monkeypatch.setattr(platformdirs, "user_cache_dir", lambda app: str(tmp_path / "cache" / app))
    new, old = tmp_path / "data" / "flashgen" / "tuning.sqlite", tmp_path / "cache" / "flashgen" / "tuning.sqlite"
    assert default_url() == f"sqlite:///{new}"
    ResultStore(f"sqlite:///{old}").close()  # an older flashgen's database
    assert default_url() == f"sqlite:///{old}"  # read where it is while the data dir has none
    ResultStore(f"sqlite:///{new}").close()
    assert default_url() == f"sqlite:///{new}"
    monkeypatch.setenv("FLASHGEN_DB", "sqlite:///elsewhere.sqlite")
    assert default_url() == "sqlite:///elsewhere.sqlite"


# ------------------------------------------------------------------------------ migrations
# The tables of schema 1 as flashgen 0.1.0 made them in SQLite (its `.schema`, verbatim).
SCHEMA_1_SQLITE = """
CREATE TABLE flashgen_meta ("key" VARCHAR(64) NOT NULL, value VARCHAR(256) NOT NULL, PRIMARY KEY ("key"));
CREATE TABLE environments (id INTEGER NOT NULL, gpu VARCHAR(128) NOT NULL, capability VARCHAR(16) NOT NULL,
    sm_count INTEGER NOT NULL, memory_gib FLOAT NOT NULL, torch VARCHAR(64) NOT NULL, triton VARCHAR(64) NOT NULL,
    cuda VARCHAR(32) NOT NULL, flashgen VARCHAR(32) NOT NULL, templates VARCHAR(32) NOT NULL, PRIMARY KEY (id),
    CONSTRAINT uq_environment UNIQUE (gpu, capability, sm_count, memory_gib, torch, triton, cuda, flashgen, templates));
CREATE TABLE specs (id INTEGER NOT NULL, "key" VARCHAR(32) NOT NULL, uri VARCHAR(256) NOT NULL,
    canonical JSON NOT NULL, PRIMARY KEY (id), UNIQUE ("key"));
CREATE TABLE trials (id INTEGER NOT NULL, environment_id INTEGER NOT NULL, spec_id INTEGER NOT NULL,
    bucket INTEGER NOT NULL, phase VARCHAR(8) NOT NULL, config_key VARCHAR(32) NOT NULL, config JSON NOT NULL,
    status VARCHAR(24) NOT NULL, ms FLOAT, tflops FLOAT, margin FLOAT, error TEXT, created DATETIME NOT NULL,
    PRIMARY KEY (id), CONSTRAINT uq_trial UNIQUE (environment_id, spec_id, bucket, phase, config_key),
    FOREIGN KEY(environment_id) REFERENCES environments (id), FOREIGN KEY(spec_id) REFERENCES specs (id));
CREATE TABLE best_configs (id INTEGER NOT NULL, environment_id INTEGER NOT NULL, spec_id INTEGER NOT NULL,
    bucket INTEGER NOT NULL, phase VARCHAR(8) NOT NULL, config JSON NOT NULL, ms FLOAT NOT NULL,
    tflops FLOAT NOT NULL, default_ms FLOAT, created DATETIME NOT NULL, PRIMARY KEY (id),
    CONSTRAINT uq_best UNIQUE (environment_id, spec_id, bucket, phase),
    FOREIGN KEY(environment_id) REFERENCES environments (id), FOREIGN KEY(spec_id) REFERENCES specs (id));
INSERT INTO flashgen_meta VALUES ('schema_version', '1');
"""


def _schema_1(url, with_trials: bool):
    """A database as flashgen 0.1.0 left it: SQLite from its own DDL, other databases through
    migration 0001; one environment, spec and best config, and (with_trials) one trial."""
    import json

    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.begin() as conn:
        if engine.dialect.name == "sqlite":
            for statement in SCHEMA_1_SQLITE.split(";"):
                if statement.strip():
                    conn.exec_driver_sql(statement)
        else:
            from alembic import command

            from flashgen.db import migrate

            command.upgrade(migrate._config(conn), "0001")
            conn.execute(text(f"DROP TABLE {migrate.VERSION_TABLE}"))  # 0.1.0 had no Alembic
        e = env().as_dict()
        conn.execute(text("INSERT INTO environments (id, gpu, capability, sm_count, memory_gib, torch, triton, cuda, "
                          "flashgen, templates) VALUES (1, :gpu, :capability, :sm_count, :memory_gib, :torch, "
                          ":triton, :cuda, :flashgen, :templates)"), e)
        conn.execute(text("INSERT INTO specs (id, key, uri, canonical) VALUES (1, :key, :uri, :canonical)"),
                     dict(key=SPEC.key, uri=SPEC.uri, canonical=json.dumps(SPEC.canonical())))
        conn.execute(text("INSERT INTO best_configs (environment_id, spec_id, bucket, phase, config, ms, tflops, "
                          "default_ms, created) VALUES (1, 1, 64, 'fwd', :config, 1.5, 2.0, 3.0, :now)"),
                     dict(config=json.dumps(CFG), now="2026-11-01 00:00:00"))
        if with_trials:
            conn.execute(text("INSERT INTO trials (environment_id, spec_id, bucket, phase, config_key, config, "
                              "status, ms, created) VALUES (1, 1, 64, 'fwd', 'k', :config, 'ok', 1.5, :now)"),
                         dict(config=json.dumps(CFG), now="2026-11-01 00:00:00"))
    engine.dispose()


@pytest.mark.parametrize("with_trials", [True, False])
def test_db_upgrade_migrates_schema_1(url, with_trials):
    from click.testing import CliRunner
    from sqlalchemy import inspect, text

    from flashgen.cli import main
    from flashgen.db import migrate

    _schema_1(url, with_trials)
    with pytest.raises(SchemaVersionError, match=r"schema version 1, .*flashgen db upgrade --db "):
        ResultStore(url)
    result = CliRunner().invoke(main, ["db", "upgrade", "--db", url])
    assert result.exit_code == 0 and "upgraded from schema version 1 to 5" in result.output, result.output
    store = ResultStore(url)
    assert store.best_configs(env(), SPEC) == {64: {"fwd": dict(config=CFG, ms=1.5, tflops=2.0, default_ms=3.0)}}
    assert store.missing_tables() == []  # Optuna's tables too
    tables = set(inspect(store.engine).get_table_names())
    assert ("flashgen_trials_v1" in tables) == with_trials  # kept where it held anything
    with store.engine.connect() as conn:
        assert migrate.current_revision(conn) == migrate.HEAD
        if with_trials:
            assert conn.execute(text("SELECT COUNT(*) FROM flashgen_trials_v1")).scalar() == 1
    _record(store, TrialRecord(64, "fwd", CFG, "ok", ms=1.0))  # Optuna's trials table is now Optuna's
    assert [t.ms for t in store.trials(env(), SPEC)] == [1.0]
    store.close()
    result = CliRunner().invoke(main, ["db", "upgrade", "--db", url])  # twice: nothing to do
    assert result.exit_code == 0 and "at schema version 5" in result.output


def test_warm_starts_rank_the_nearest_specs_on_this_gpu():
    from flashgen.db.neighbours import mask_kind, warm_starts

    here = _h100()

    def row(spec, cfg, gpu=here, bucket=4096, ms=1.0):
        return dict(spec_key=spec.key, spec=spec.canonical(), environment=gpu.as_dict(), bucket=bucket, phase="fwd",
                    config=dict(CFG, **cfg), ms=ms)

    target = AttentionSpec(name="t", dtype="bf16", head_dim=128, num_heads=32, num_kv_heads=8, causal=True)
    rows = [row(target, dict(BLOCK_M=256)),  # the spec itself: never its own warm start
            row(target.replace(head_dim=64), dict(BLOCK_M=64)),
            row(target.replace(head_dim=256), dict(BLOCK_M=32), ms=0.5),
            row(target.replace(causal=False), dict(BLOCK_M=128)),  # another mask kind: after any head dim
            row(target.replace(head_dim=64), dict(BLOCK_M=16), gpu=_h100(gpu="NVIDIA A100", sm_count=108)),
            row(target.replace(dtype="fp16"), dict(BLOCK_M=16))]  # another dtype: last
    knobs = ("BLOCK_M", "BLOCK_N")
    points = warm_starts(target.key, target.canonical(), here, 4096, "fwd", rows, knobs, k=5)
    assert [p["BLOCK_M"] for p in points] == [32, 64, 128, 16]  # ties on distance: the faster first
    assert mask_kind(target.canonical()) == "causal"
    assert mask_kind(target.replace(causal=False, mask={"document": {}}).canonical()) == "document"


# ------------------------------------------------------------------------------ which default a result beat
def _default_of(bucket=1024, phase="fwd"):
    from flashgen.db.kernels import default_kernel

    return default_kernel(SPEC, bucket, phase, "cpu")


def test_db_upgrade_from_schema_4_keeps_every_result_with_an_unknown_default(url, fresh_warnings, monkeypatch):
    _as_machine(monkeypatch, env())
    store = ResultStore(url)
    store.set_best(env(), SPEC, 1024, "fwd", dict(CFG, BLOCK_M=16), 1.0, 1.0, 2.0)
    store = _downgraded_then_upgraded(store, 4, "default_kernel", default_db=True)
    (row,) = store.all_best()
    assert row["default_kernel"] is None and row["ms"] == 1.0 and row["default_ms"] == 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unknown default is served, quietly
        configs, source = lookup(SPEC, store.url)
    assert configs[1024].BLOCK_M == 16 and source == f"database {store.url}"
    store.close()


def test_default_kernel_names_the_default_config_not_only_its_kernels():
    from flashgen.codegen.render import kernel_hash
    from flashgen.db.kernels import default_kernel

    h100 = AttentionSpec.from_yaml(os.path.join(os.path.dirname(__file__), "..", "examples", "specs",
                                                "sliding-window.yaml"))
    short = default_config(h100, "h100", 1024)
    # tiles are constexpr arguments: two defaults can render the same kernels...
    assert kernel_hash(h100, short, "fwd") == kernel_hash(h100, short.replace(BLOCK_M=128, BLOCK_N=128), "fwd")
    # ...and still be different defaults
    assert default_kernel(h100, 4096, "fwd", "h100") != default_kernel(h100, 4096, "fwd", "a100")
    assert default_kernel(h100, 4096, "fwd", "h100") == default_kernel(h100, 4096, "fwd", "h100")
    assert default_kernel(h100, 4096, "dec8", "h100") is None


@pytest.mark.parametrize("recorded, served", [("same", True), ("other", False), (None, True)])
def test_a_result_is_served_only_while_its_default_is_the_current_one(recorded, served, tmp_path, monkeypatch,
                                                                       fresh_warnings):
    from click.testing import CliRunner

    from flashgen.cli import main

    here = env()
    _as_machine(monkeypatch, here)
    store = ResultStore(f"sqlite:///{tmp_path / 'defaults.sqlite'}")
    against = {"same": _default_of(), "other": "0123456789abcdef", None: None}[recorded]
    store.set_best(here, SPEC, 1024, "fwd", dict(CFG, BLOCK_M=16), 1.0, 1.0, 2.0, against)
    store.set_best(here, SPEC, 1024, "bwd", dict(CFG, BLOCK_M1=16), 1.0, 1.0, 2.0, _default_of(phase="bwd"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        configs, source = lookup(SPEC, store.url, spec_path="dbspec.yaml")
    messages = [str(w.message) for w in caught if issubclass(w.category, flashgen.FlashgenFallbackWarning)]
    assert configs[1024].BLOCK_M1 == 16 and source == f"database {store.url}"  # the bwd row serves in any case
    if served:
        assert configs[1024].BLOCK_M == 16 and not messages
    else:  # that phase runs the bucket's default, and one warning says why and what to run
        assert configs[1024].BLOCK_M == default_config(SPEC, "cpu", 1024).BLOCK_M != 16
        (message,) = messages
        assert "S=1024 fwd" in message and "measured against an older default" in message
        assert "flashgen tune --recheck --spec dbspec.yaml" in message
    shown = CliRunner().invoke(main, ["show", "--db", store.url])
    assert shown.exit_code == 0, shown.output
    line = next(ln for ln in shown.output.splitlines() if "S=1024 fwd" in ln)
    words = {"same": "measured against this flashgen's default", "other": "measured against an older default",
             None: "default it beat is unknown"}[recorded]
    assert words in line, line
    if recorded == "other":
        assert "not used" in line and "flashgen tune --recheck" in line


def test_every_phase_against_an_older_default_falls_back_with_the_reason(tmp_path, monkeypatch, fresh_warnings):
    here = env()
    _as_machine(monkeypatch, here)
    store = ResultStore(f"sqlite:///{tmp_path / 'older.sqlite'}")
    store.set_best(here, SPEC, 1024, "fwd", dict(CFG, BLOCK_M=16), 1.0, 1.0, 2.0, "0123456789abcdef")
    with pytest.warns(flashgen.FlashgenFallbackWarning, match=r"older default.*using the heuristic default.*"
                                                              r"flashgen tune --recheck"):
        kernel = flashgen.load(SPEC, db=store.url)
    assert kernel.config_source == "default"


def test_untuned_buckets_run_their_own_default_and_tuned_knobs_merge_onto_their_bucket(tmp_path, monkeypatch,
                                                                                      fresh_warnings):
    from flashgen.config import DEFAULT_BUCKETS, default_configs

    here = env()
    _as_machine(monkeypatch, here)
    spec = AttentionSpec(name="band", dtype="fp16", head_dim=128, num_heads=2, target="h100",
                         mask={"sliding_window": {"left": 1023, "right": 0}})
    assert default_config(spec, seqlen=256) != default_config(spec)  # the defaults differ per bucket
    store = ResultStore(f"sqlite:///{tmp_path / 'buckets.sqlite'}")
    row = default_config(spec).replace(BLOCK_M1=32)
    store.set_best(here, spec, 256, "bwd", row.to_dict(), 1.0, 1.0)
    configs, _ = lookup(spec, store.url)
    # the row's own (bwd) knobs, the rest from its own bucket's default (no tensor descriptors at 256)
    assert configs[256] == default_config(spec, seqlen=256).replace(
        **{k: getattr(row, k) for k in KernelConfig.BACKWARD})
    assert configs[256].BLOCK_M1 == 32 and configs[256].bwd_tma
    assert not configs[256].tma and configs[256].family == "portable"
    assert default_config(spec).family == "hopper_ws"  # (tensor descriptors at 4096: the Gluon forward's)
    assert {b: configs[b] for b in DEFAULT_BUCKETS if b != 256} == \
        {b: c for b, c in default_configs(spec).items() if b != 256}
    assert flashgen.load(spec, db=store.url).config_for(16384) == default_config(spec, seqlen=16384)


def test_default_kernel_round_trips_through_tuning_db_files(tmp_path):
    src = ResultStore(f"sqlite:///{tmp_path / 'src.sqlite'}")
    src.set_best(env(), SPEC, 1024, "fwd", CFG, 1.0, 1.0, 2.0, _default_of())
    src.set_best(env(), SPEC, 2048, "fwd", CFG, 1.0, 1.0, 2.0)
    path = tmp_path / "layer" / "interp.yaml"
    layer_mod.export_rows(src.all_best(), path, env().gpu)
    assert f"default_kernel: {_default_of()}" in path.read_text()
    rows = layer_mod.read_file(path)
    assert {r["bucket"]: r["default_kernel"] for r in rows} == {1024: _default_of(), 2048: None}
    other = ResultStore(f"sqlite:///{tmp_path / 'other.sqlite'}")
    assert other.import_rows(rows) == 2
    assert {r["bucket"]: r["default_kernel"] for r in other.all_best()} == {1024: _default_of(), 2048: None}
    _spoil(path, ("default_kernel",), "not-a-hash")
    with pytest.raises(layer_mod.ResultFileError, match="field 'default_kernel'"):
        layer_mod.read_file(path)


def test_a_tune_against_the_current_default_replaces_a_result_against_an_older_one(tmp_path):
    store = ResultStore(f"sqlite:///{tmp_path / 'replace.sqlite'}")
    store.set_best(env(), SPEC, 1024, "fwd", dict(CFG, BLOCK_M=16), 0.5, 1.0, 2.0, "0123456789abcdef")
    # slower, but measured against today's default: the old time says nothing against it
    assert store.set_best(env(), SPEC, 1024, "fwd", dict(CFG, BLOCK_M=64), 0.9, 1.0, 1.0, _default_of()) is None
    # a slower result against the same default never replaces the better one
    kept = store.set_best(env(), SPEC, 1024, "fwd", dict(CFG, BLOCK_M=32), 0.95, 1.0, 1.0, _default_of())
    assert kept is not None and kept["config"]["BLOCK_M"] == 64
    (row,) = store.all_best()
    assert (row["config"]["BLOCK_M"], row["default_kernel"]) == (64, _default_of())
    # slower and measured against an older default (an old export imported): it replaced the current row,
    # which flashgen.load then set aside for its default
    older = dict(store.all_best()[0], config=dict(CFG, BLOCK_M=16), ms=999.0, default_ms=999.0,
                 default_kernel="0123456789abcdef")
    assert store.import_rows([older]) == 0
    (row,) = store.all_best()
    assert (row["config"]["BLOCK_M"], row["ms"], row["default_kernel"]) == (64, 0.9, _default_of())


def _a_running_trial(tmp_path):
    """A store whose trials beat every 30 s, and a trial asked of one of its studies."""
    store = ResultStore(f"sqlite:///{tmp_path / 'results.sqlite'}", heartbeat_s=30)
    study = store.open_study(SPEC, env(), 1024, "fwd")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return store, study.ask()


def test_stop_heartbeats_ends_a_trial_heartbeat_a_ctrl_c_left_running(tmp_path):
    # Optuna's heartbeat thread (not a daemon) of a trial whose end a Ctrl-C skipped: the interrupted
    # tune's exit would wait for it forever; stop_heartbeats stops it (and finds none the second time)
    from optuna.storages._heartbeat import HeartbeatThread

    store, trial = _a_running_trial(tmp_path)
    beat = HeartbeatThread(trial._trial_id, store.optuna_storage())
    beat.start()  # ... and never stopped: the Ctrl-C came inside the heartbeat's __enter__
    assert beat._thread.is_alive()
    assert ResultStore.stop_heartbeats() == 1
    assert not beat._thread.is_alive()
    assert ResultStore.stop_heartbeats() == 0


def test_stop_heartbeats_ends_a_heartbeat_whose_start_a_ctrl_c_cut_short(tmp_path):
    # A Ctrl-C inside Thread.start() (its wait for the new thread to start, long under CI's load) left a heartbeat
    # thread that was not yet alive when stop_heartbeats looked: it then beat forever, and the interrupted tune
    # printed its message and never exited (CI). Here its start is slow, and stop_heartbeats runs meanwhile.
    import threading

    from optuna.storages._heartbeat import HeartbeatThread

    store, trial = _a_running_trial(tmp_path)
    stop = threading.Event()
    thread = threading.Thread(target=HeartbeatThread._record_heartbeat, args=(trial._trial_id, store.optuna_storage(), stop))
    bootstrap = thread._bootstrap_inner

    def slow_start():
        time.sleep(1.0)
        bootstrap()

    thread._bootstrap_inner = slow_start
    starter = threading.Thread(target=thread.start, daemon=True)  # the main thread's start(), cut short
    starter.start()
    deadline = time.time() + 5
    while thread not in threading.enumerate() and time.time() < deadline:
        time.sleep(0.01)
    try:
        assert not thread.is_alive()  # started, not yet running: what the Ctrl-C left
        assert ResultStore.stop_heartbeats() == 1
        assert not thread.is_alive()
    finally:
        stop.set()  # (a failed check leaves no thread that would hold pytest's exit)
        starter.join(5)


def test_stop_heartbeats_passes_over_a_heartbeat_that_ends_while_it_looks(monkeypatch):
    # a thread whose run() ended between reading its _target and its _args (Thread deletes both): an AttributeError
    # on the interrupt path, a traceback where the tune's one line was due (a review's catch)
    import threading
    import types

    from optuna.storages._heartbeat import HeartbeatThread

    ending = types.SimpleNamespace(_target=HeartbeatThread._record_heartbeat)  # _args already gone
    monkeypatch.setattr(threading, "enumerate", lambda: [ending])
    assert ResultStore.stop_heartbeats() == 0


def test_reading_leaves_a_databases_file_as_it_is(tmp_path, fresh_warnings):
    # show / flashgen.load opened every SQLite file with journal_mode=WAL: a foreign database was switched
    # for good, and an empty file got a header
    import sqlite3
    import warnings

    foreign = tmp_path / "app.sqlite"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE t (x)")
    empty = tmp_path / "empty.sqlite"
    empty.touch()
    for path in (foreign, empty):
        with warnings.catch_warnings():  # no results there: the default, said once per spec
            warnings.simplefilter("ignore", flashgen.FlashgenFallbackWarning)
            assert flashgen.load(SPEC, db=f"sqlite:///{path}").config_source == "default"
    with sqlite3.connect(foreign) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert empty.stat().st_size == 0


def test_a_writer_refuses_a_foreign_database_before_touching_it(tmp_path):
    # `flashgen tune --db` at another program's SQLite file switched it to WAL for good and left a .lock beside it,
    # then refused it
    import sqlite3

    foreign = tmp_path / "app.sqlite"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE t (x)")
    with pytest.raises(SchemaVersionError, match="is not a flashgen database"):
        ResultStore(f"sqlite:///{foreign}")
    with sqlite3.connect(foreign) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.sqlite"]
    empty = tmp_path / "empty.sqlite"  # an empty file is a new database: made there
    empty.touch()
    ResultStore(f"sqlite:///{empty}").close()


def test_a_reader_waits_5_s_for_a_lock_a_writer_30(tmp_path):
    # flashgen.load at a program's start waited 30 s on a locked database before it fell back
    url = f"sqlite:///{tmp_path / 'timeout.sqlite'}"
    for create, want in ((True, 30000), (False, 5000)):
        store = ResultStore(url, create=create)
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == want
        store.close()


def test_load_names_a_bad_db_or_spec_path(tmp_path):
    # load(spec, db=5) raised a TypeError from the URL parser, db="" silently read the default database, a spec
    # path "" read "." ("Is a directory") and one with a NUL byte a bare ValueError
    from flashgen.spec import SpecError

    for db in (5, "", "  "):
        with pytest.raises(ValueError, match=rf"db: expected a database URL .*got {re.escape(repr(db))}"):
            flashgen.load(SPEC, db=db)
    with pytest.raises(ValueError, match="spec: expected a YAML file's path, got ''"):
        flashgen.load("")
    with pytest.raises(SpecError, match="cannot read spec file: embedded null byte"):
        flashgen.load(str(tmp_path / "a\0b.yaml"))
    os.mkfifo(tmp_path / "pipe.yaml")  # opening it would wait for a writer
    with pytest.raises(SpecError, match="a named pipe or socket, not a file"):
        flashgen.load(tmp_path / "pipe.yaml")


def test_a_database_this_user_cannot_write_is_read(tmp_path, monkeypatch, fresh_warnings):
    # a results database on a read-only mount or baked into an image (here: os.access says the folder cannot be
    # written): readers open it read-only and immutable, so no -shm/-wal files are needed; it raised "unable to
    # open database file" and flashgen.load fell back to the defaults
    from flashgen.db import store as store_mod

    here = env()
    monkeypatch.setattr(EnvInfo, "current", classmethod(lambda cls, interpret=False: here))
    monkeypatch.setattr(layer_mod, "layer_dir", lambda: tmp_path / "no-layer")
    folder = tmp_path / "baked"
    folder.mkdir()
    db = folder / "r.sqlite"
    store = ResultStore(f"sqlite:///{db}")
    assert store.set_best(here, SPEC, 1024, "fwd", dict(CFG, BLOCK_M=32), 2.0, 1.0) is None
    store.close()
    for side in ("-wal", "-shm"):
        (folder / f"r.sqlite{side}").unlink(missing_ok=True)
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    access = os.access
    monkeypatch.setattr(store_mod.os, "access", lambda p, mode: access(p, mode) and Path(p) not in (db, folder))
    assert store_mod._unwritable(db)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        configs, source = lookup(SPEC, f"sqlite:///{db}")
    assert configs[1024].BLOCK_M == 32 and source == f"database sqlite:///{db}"
    reader = ResultStore(f"sqlite:///{db}", create=False)
    assert [r["config"]["BLOCK_M"] for r in reader.all_best()] == [32] and reader.url == f"sqlite:///{db}"
    reader.close()
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before  # nothing written, no side files


def test_a_row_whose_canonical_spec_was_edited_is_malformed(tmp_path):
    # an exported row's canonical spec edited (a dtype holding code, a huge head count) while its key stayed:
    # `import` and `db check` took it, and a recheck failed on it without naming the entry
    from flashgen.db import ResultRowError
    from flashgen.db.rows import check_row

    row = _stored_row(None)
    check_row(row)
    for edit in (dict(dtype='fp16"); import os; ("'), dict(num_heads=10**30)):
        bad = dict(row, spec=dict(row["spec"], **edit))
        with pytest.raises(ResultRowError, match=rf"spec_key.*expected the key of the row's canonical spec"):
            check_row(bad)
        with pytest.raises(ResultRowError):
            ResultStore(f"sqlite:///{tmp_path / 'edited.sqlite'}").import_rows([bad])


def test_a_read_only_database_beside_an_unapplied_write_ahead_log_is_said(tmp_path, monkeypatch, fresh_warnings):
    # a database copied into a read-only place after a tune was killed before its checkpoint: the immutable
    # read-only open cannot apply the -wal file beside it, and served the older results in silence
    import warnings

    from flashgen.db import store as store_module

    url = f"sqlite:///{tmp_path / 'wal.sqlite'}"
    writer = ResultStore(url)
    writer.set_best(env(), SPEC, 64, "fwd", CFG, 1.0, 1.0)
    with writer.engine.connect() as conn:  # the schema and this row into the database file
        conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    writer.set_best(env(), SPEC, 128, "fwd", CFG, 1.0, 1.0)  # still open: this row sits in the write-ahead log
    assert (tmp_path / "wal.sqlite-wal").stat().st_size > 0
    _as_machine(monkeypatch, env())
    monkeypatch.setattr(store_module, "_unwritable", lambda path: True)  # (root can write anywhere: as if mounted ro)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lookup(SPEC, url)
    said = [str(w.message) for w in caught if issubclass(w.category, flashgen.FlashgenFallbackWarning)]
    assert any("is read-only beside a write-ahead log" in m for m in said), said
    writer.close()
    monkeypatch.undo()
    with warnings.catch_warnings(record=True) as caught:  # writable: the log is applied, nothing to say
        warnings.simplefilter("always")
        configs, _ = lookup(SPEC, url)
    assert not [w for w in caught if "write-ahead" in str(w.message)] and configs[128].BLOCK_M == CFG["BLOCK_M"]
