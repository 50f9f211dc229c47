"""The flashgen command line: one group, verbs named for what the user wants.

Errors are handled once, in the group (``_Cli.invoke``): a bad spec, results file, config
knob, path or database ends the command with one line, ``Error: ...``, that names what is
wrong (never a password), and exit code 2 for bad input or 1 for everything else. A
Python traceback from a verb means a bug in flashgen.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import click
from sqlalchemy.exc import SQLAlchemyError

from . import __version__
from .config import HOPPER_THREE_REGS, LOOP_ORDERS, ConfigError, KernelConfig, default_config, detect_target
from .config import interpreting as _interpreting
from .codegen.cache import write_atomic
from .db import DatabaseError, MissingDatabaseError, ResultRowError, default_url, display_url, hide_password
from .db.layer import ResultFileError
from .spec import MAX_SEQLEN, MAX_TRIALS, TARGETS, AttentionSpec, SpecError, YamlFileError

EXIT_FAILURE, EXIT_BAD_INPUT = 1, 2
_INPUT_ERRORS = (SpecError, ConfigError, ResultFileError, ResultRowError, YamlFileError)
_DB_URL = "flashgen.db_url"  # ctx.meta key: the database this command uses, whose password no message shows
_DB_GIVEN = "flashgen.db_given"  # ctx.meta key: whether --db named it (else $FLASHGEN_DB or the default)


class _BadInput(click.ClickException):
    exit_code = EXIT_BAD_INPUT


class _Cli(click.Group):
    """The flashgen group: turns flashgen's, the database's and the file system's errors into
    one-line click errors, for every verb at once."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # (click said "Aborted!" and exited 1; `tune` says what it kept itself)
            click.echo("interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except Exception as err:  # (_said picks the user's errors; Optuna's by name: optuna is not imported here)
            said = _said(ctx, err)
            if said is None:
                raise
            raise said from None


def _said(ctx, err: BaseException) -> click.ClickException | None:
    """The one-line click error for one of flashgen's, the database's or the file system's
    errors; None for an error that is not the user's to read in one line (a bug, a broken pipe)."""
    if isinstance(err, _INPUT_ERRORS):
        return _BadInput(_one_line(ctx, str(err)))
    if isinstance(err, DatabaseError):
        return click.ClickException(_one_line(ctx, _env_prefix(ctx, err.url) + str(err)))
    if _storage_error(err):  # Optuna's wrapper of the database's error (a lock held past the timeout)
        cause = _database_cause(err)
        return None if cause is None else _said(ctx, cause)
    if isinstance(err, SQLAlchemyError):  # raised outside ResultStore
        url = _db_url(ctx)
        return click.ClickException(_one_line(ctx, _env_prefix(ctx, url) + str(DatabaseError.from_exception(url, err))))
    if isinstance(err, OSError) and err.errno != errno.EPIPE:  # EPIPE: stdout closed by `| head`, click's own
        where = f"{err.filename}: " if err.filename else ""
        return click.ClickException(_one_line(ctx, f"{where}{err.strerror or err}"))
    return None


def _storage_error(err: BaseException) -> bool:
    """Optuna's StorageInternalError, by name: importing optuna would cost every CLI start ~0.3 s."""
    kind = type(err)
    return kind.__name__ == "StorageInternalError" and kind.__module__.startswith("optuna")


def _database_cause(err: BaseException) -> SQLAlchemyError | None:
    """The database's error under Optuna's StorageInternalError (its __cause__ or __context__ chain), if any."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, SQLAlchemyError):
            return err
        err = err.__cause__ or err.__context__
    return None


def _db_url(ctx) -> str:
    return ctx.meta.get(_DB_URL) or default_url()


def _from_env(ctx, url: str) -> bool:
    """Whether the database `url` is the one $FLASHGEN_DB names and no --db named it (not a scratch database of the
    command's own)."""
    env = os.environ.get("FLASHGEN_DB")
    return bool(env) and not ctx.meta.get(_DB_GIVEN) and url in (env, display_url(env))


def _env_prefix(ctx, url: str) -> str:
    return "$FLASHGEN_DB: " if _from_env(ctx, url) else ""


def _one_line(ctx, message: str) -> str:
    for url in {_db_url(ctx), os.environ.get("FLASHGEN_DB") or ""}:
        message = hide_password(message, url)
    return re.sub(r"\s*\n\s*", " ", message).strip()


SQLITE_HEADER = b"SQLite format 3\x00"


def _write_file(path: str | Path, text: str | bytes) -> None:
    """Write a file the user named (atomically); a failure names that file. Never over an SQLite database
    (a results database named by mistake: its tuned configs and trials would be gone)."""
    try:
        # a symlink: the file it names is written (the link stays); a device or a pipe (/dev/null, /dev/stdout, a
        # fifo): written through, not replaced by a regular file (as root, os.replace swapped /dev/null for one)
        target = Path(os.path.realpath(path)) if Path(path).is_symlink() else Path(path)
        if target.exists() and not target.is_file() and not target.is_dir():
            with open(target, "wb" if isinstance(text, bytes) else "w") as f:
                f.write(text)
            return
        if target.is_file():
            with open(target, "rb") as f:
                database = f.read(len(SQLITE_HEADER)) == SQLITE_HEADER
            if database:
                raise click.ClickException(f"cannot write {path}: it is an SQLite database (a results database?), "
                                           "which writing would replace; name another file")
        write_atomic(target, text)
    except OSError as err:
        if err.errno == errno.EPIPE:
            raise
        if isinstance(err, FileExistsError):  # from mkdir: a file where a directory must be
            raise click.ClickException(f"cannot write {path}: {err.filename} is not a directory") from None
        other = ""
        if err.filename and str(err.filename) != str(path):
            # write_atomic's temporary file beside it (mkstemp makes its path absolute): the user never named it;
            # the folder is what refused, unless the replace of the target itself failed (filename2)
            name, whole = Path(os.path.abspath(err.filename)), Path(os.path.abspath(target))
            if name.parent != whole.parent or not name.name.startswith(f".{target.name}."):
                other = f" ({err.filename})"
            elif err.filename2 is None or Path(os.path.abspath(err.filename2)) != whole:
                other = f" (the folder {whole.parent})"
        raise click.ClickException(f"cannot write {path}: {err.strerror or err}{other}") from None


def _remember_db(ctx, param, value):
    if value is not None and not value.strip():  # (it chose the default database, silently)
        raise click.BadParameter("expected a database URL, got an empty one", param=param)
    ctx.meta[_DB_URL] = value or default_url()
    ctx.meta[_DB_GIVEN] = value is not None
    return value


def _db_option(f):
    return click.option("--db", "db_url", default=None, callback=_remember_db,
                        help="SQLAlchemy URL of the results database (default: $FLASHGEN_DB, else tuning.sqlite "
                             "in the user data directory).")(f)


def _rerun_interpreted():
    """Run this command again with TRITON_INTERPRET=1 from the start: Triton decides at import
    which functions of its own library run interpreted, and `import flashgen` imported it."""
    if "--interpret" not in sys.argv:  # called in-process (click's test runner): cannot re-run
        raise click.UsageError("--interpret: set TRITON_INTERPRET=1 before Python imports flashgen")
    sys.stdout.flush(), sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "flashgen", *sys.argv[1:]],
              dict(os.environ, TRITON_INTERPRET="1"))


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="flashgen")
def main():
    """flashgen: compile attention specs into tuned Triton kernels.

    Exit codes: 0 done, 1 failed (database, file system, nothing passed verification),
    2 bad input (a spec, an option, a results file), 130 interrupted (Ctrl-C).
    """


@main.command()
@click.option("--spec", "spec_path", required=True, type=click.Path(dir_okay=False),
              help="The attention spec (YAML).")
@click.option("-o", "--output", default="-", type=click.Path(dir_okay=False, allow_dash=True),
              help="Where to write the module ('-' for standard output).")
@click.option("--loop-order", type=click.Choice(LOOP_ORDERS), help="Override the config's loop order.")
@click.option("--block-m", type=int, help="Override BLOCK_M.")
@click.option("--block-n", type=int, help="Override BLOCK_N.")
@click.option("--num-warps", type=int, help="Override num_warps.")
@click.option("--num-stages", type=int, help="Override num_stages.")
@click.option("--tma/--no-tma", default=None, help="Override tma (Hopper tensor descriptors).")
@click.option("--warp-specialize/--no-warp-specialize", default=None,
              help="Override warp_specialize (needs num_warps >= 8; off by default below that).")
@click.option("--target", type=click.Choice(TARGETS, case_sensitive=False),
              help="GPU to pick the default config for (default: the spec's target, "
                   "or this machine's GPU when it is 'auto').")
@click.option("--tuned", is_flag=True,
              help="Start from the tuned config that flashgen.load would use on this machine (the database, "
                   "then tuning_db/); the overrides above still apply.")
@click.option("--seqlen", type=click.IntRange(1),
              help="With --tuned: the sequence length whose bucket's config to write (default: the longest "
                   "tuned bucket).")
@_db_option
def generate(spec_path, output, loop_order, block_m, block_n, num_warps, num_stages, tma, warp_specialize, target,
             tuned, seqlen, db_url):
    """Write the rendered Triton module for a spec as a standalone file.

    The file imports only torch and triton; call its forward(q, k, v) directly.
    """
    spec = AttentionSpec.from_yaml(spec_path)
    if seqlen is not None and not tuned:
        raise click.UsageError("--seqlen picks a tuned bucket: pass --tuned with it")
    if target is not None and tuned:  # (the tuned config is this machine's: --target was ignored)
        raise click.UsageError("--target picks the default config for a GPU; --tuned writes this machine's tuned "
                               "one: pass one of them")
    if not output.strip():
        raise click.BadParameter("expected a file path or '-', got an empty one", param_hint="'-o' / '--output'")
    if output != "-" and Path(output).resolve() == Path(spec_path).resolve():
        raise click.BadParameter(f"{output} is the spec file: writing the module there would replace the spec",
                                 param_hint="'-o' / '--output'")
    if target is not None and target.lower() == "auto":
        target = detect_target()  # this machine's GPU, whatever the spec names
    # (the portable family's knobs asked for: its default, where the target's would be the Gluon family's)
    portable = loop_order is not None or tma is not None or warp_specialize is not None
    config = (_tuned_config(spec, spec_path, db_url, seqlen) if tuned else
              default_config(spec, target=target, hopper_ws=not portable))
    if warp_specialize is None and num_warps is not None and num_warps < 8:
        warp_specialize = False  # the default's warp specialization needs 8 warps
    changes = {"loop_order": loop_order, "BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps,
               "num_stages": num_stages, "tma": tma, "warp_specialize": warp_specialize}
    if block_m is not None and config.family == "hopper_ws" and (block_m == 192) != (config.BLOCK_M == 192):
        # three consumers take their own register budget (config.HOPPER_THREE_REGS); one or two the default's
        changes["hopper_regs"] = HOPPER_THREE_REGS if block_m == 192 else KernelConfig.hopper_regs
    config = config.replace(**{k: v for k, v in changes.items() if v is not None})
    from .codegen.render import render

    source = render(spec, config)
    if output == "-":
        sys.stdout.write(source)
    else:
        _write_file(output, source)
        click.echo(f"wrote {output}: {spec.uri} with {config}", err=True)


def _tuned_config(spec, spec_path, db_url, seqlen) -> KernelConfig:
    """The stored config flashgen.load would run for this sequence length (or the longest
    tuned bucket); an error that names the command to tune when nothing is stored."""
    import warnings

    from .loader import tuned
    from .runtime.host import nearest_bucket

    with warnings.catch_warnings(record=True) as caught:  # the fallback warnings: here a missing result is an error
        warnings.simplefilter("always")
        configs, source = tuned(spec, db_url, spec_path=spec_path)
    for w in caught:  # results left out (malformed, stale) are said, as show, export and flashgen.load say them
        if str(w.message).startswith("flashgen: skipping") or "; not used." in str(w.message):
            click.echo(str(w.message).removeprefix("flashgen: "), err=True)
    if not configs:
        unread = [str(w.message).removeprefix("flashgen: ").replace("; falling back", "") for w in caught
                  if "cannot read" in str(w.message)]
        url = db_url or default_url()
        source = " ($FLASHGEN_DB)" if _from_env(click.get_current_context(), url) else ""
        raise click.ClickException(f"no tuned config for {spec.uri} on this machine in {display_url(url)}{source} "
                                   "or tuning_db: "
                                   + (unread[0] if unread else f"tune it with `flashgen tune --spec {spec_path}`"))
    bucket = nearest_bucket(seqlen, configs) if seqlen else max(configs)
    click.echo(f"tuned config for S={bucket} from {source}", err=True)
    return configs[bucket]


def _finite(_ctx, param, value):
    """A float option that must be a number (FloatRange lets nan through: its comparisons are all false)."""
    if value is not None and value != value:
        raise click.BadParameter(f"expected a number of seconds, got {value}", param=param)
    return value


def _seqlens(_ctx, _param, value):
    if value is None:
        return None
    try:
        lengths = [int(x) for x in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not lengths or min(lengths) < 1:
        raise click.BadParameter(f"expected positive lengths, got {value!r}")
    if max(lengths) > MAX_SEQLEN:
        raise click.BadParameter(f"expected lengths of at most {MAX_SEQLEN}, got {value!r}")
    return lengths


def _worker_option(_ctx, _param, value):
    """--worker RUN:N -> (RUN, N)."""
    if value is None:
        return None
    run, _, number = value.rpartition(":")
    if not run or not number.isdigit() or len(value) > 26:
        raise click.BadParameter(f"expected RUN:N (at most 26 characters), got {value!r}")
    return run, int(number)


SAMPLERS = ("tpe", "random", "grid")  # flashgen.tuner.SAMPLERS, named here so --help imports no torch
EXIT_INTERRUPTED = 130  # the shell's code for a process ended by Ctrl-C
EXIT_TERMINATED = 143  # the shell's code for a process ended by SIGTERM


@main.command()
@click.argument("spec_args", metavar="[SPEC]...", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--spec", "spec_opts", multiple=True, type=click.Path(dir_okay=False),
              help="A spec (YAML); may be repeated, or the specs given as arguments.")
@click.option("--trials", type=click.IntRange(1, MAX_TRIALS), help="Trials per study (default: the spec's tune.trials).")
@click.option("--seqlens", callback=_seqlens,
              help="Comma-separated sequence lengths to tune (default: the spec's tune.seqlens).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(0, min_open=True), default=120.0, show_default=True,
              callback=_finite, help="Seconds one trial may take before it counts as a timeout.")
@click.option("--sampler", type=click.Choice(SAMPLERS), default="tpe", show_default=True)
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True,
              help="Seed of the sampler (--gpus N: worker i takes seed + i).")
@click.option("--no-default", "no_default", is_flag=True,
              help="Never start a study from the heuristic default: from the nearest tuned specs on this GPU when "
                   "there are any (always so), else from the sampler alone. The default is still timed in the "
                   "final round (a stored result beats it).")
@_db_option
@click.option("--gpus", type=click.IntRange(1), default=1, show_default=True,
              help="Worker processes, one per local GPU (CUDA_VISIBLE_DEVICES set for each), sharing the studies "
                   "through the database. Other hosts join by running `flashgen tune` on the same --db.")
@click.option("--heartbeat", "heartbeat_s", type=click.IntRange(1), default=30, show_default=True,
              help="Seconds between a running trial's heartbeats: a trial silent for 3x this (its worker killed) "
                   "is failed and run again by a live worker.")
@click.option("--resume", is_flag=True, hidden=True,
              help="Accepted for old scripts: a study found for the spec always goes on.")
@click.option("--worker", "worker", hidden=True, callback=_worker_option,
              help="RUN:N, set by --gpus for its worker processes: worker N of run RUN (one final round per study).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write search history and importances (PNG).")
@click.option("--interpret", is_flag=True, help="Run through Triton's CPU interpreter at tiny shapes (NOT a timing).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the results as JSON (one object; a list of them for several specs).")
@click.option("--recheck", is_flag=True,
              help="Tune nothing: time each stored best config of the specs on this GPU (stale ones too, with "
                   "today's kernels) beside today's default for its bucket and phase, keep the faster, and record "
                   "the default it was compared with.")
@click.option("--shipped", is_flag=True,
              help="With --recheck: recheck the shipped tuning_db/ file of this GPU (every spec in it, or the "
                   "specs named) and rewrite that file.")
@click.option("--jobs", type=click.IntRange(1), default=None,
              help="With --recheck: configs compiled and verified at once, in threads (default: 1).")
@click.pass_context
def tune(ctx, spec_args, spec_opts, trials, seqlens, timeout_s, sampler, seed, no_default, db_url, gpus, heartbeat_s,
         resume, worker, plot_path, interpret, as_json, recheck, shipped, jobs):
    """Tune specs on this machine's GPUs and store the best config per sequence-length bucket.

    One Optuna study per spec, bucket and phase, kept in the database: a study that an
    earlier, interrupted or concurrent run left (on this host or another one using the same
    --db) goes on, its finished trials counted and not run again, and every worker claims a
    config before measuring it, so none is measured twice. A stored result is replaced only
    by a faster one.

    With --recheck nothing is tuned: the stored results are timed against today's defaults
    (--shipped: this GPU's tuning_db/ file, rewritten).
    """
    import dataclasses
    import json

    paths = list(spec_args) + list(spec_opts)
    if (shipped or jobs) and not recheck:
        raise click.UsageError(f"{'--shipped' if shipped else '--jobs'} goes with a recheck: pass --recheck with it")
    if recheck and (gpus > 1 or plot_path or trials or seqlens):
        used = [o for o, v in (("--gpus", gpus > 1), ("--plot", plot_path), ("--trials", trials),
                               ("--seqlens", seqlens)) if v]
        raise click.UsageError(f"--recheck times the stored configs in one process: leave out {', '.join(used)}")
    if not paths and not shipped:
        raise click.UsageError("no spec: name one or more spec files (`flashgen tune examples/specs/*.yaml`)")
    if plot_path and gpus > 1:
        raise click.UsageError("--plot draws one process's search: leave it out with --gpus above 1")
    # a missing matplotlib, a format it cannot write or a folder it cannot write in: said now, not after the tune
    plot = (plot_path, _plot_format(plot_path)) if plot_path else None
    if interpret and not _interpreting():
        _rerun_interpreted()
    # Under TRITON_INTERPRET the kernels run interpreted whatever the machine: the interpreter's runner, space
    # and environment (a GPU runner's space and timings would be stored as the interpreter's results).
    interpret = interpret or _interpreting()
    specs = []
    for path in paths:
        spec = AttentionSpec.from_yaml(path)
        if seqlens:
            spec = spec.replace(tune=dataclasses.replace(spec.tune, seqlens=tuple(seqlens)))
        if interpret and spec.dtype == "bf16":
            raise click.UsageError(f"{path}: spec field 'dtype': the interpreter's bf16 dot is unreliable, "
                                   "got 'bf16'; tune an fp16 or fp32 spec with --interpret")
        specs.append(spec)
    import torch

    from .db import ResultStore

    # --gpus: NVML's count, which starts no CUDA here, so that the workers can be forked (is_available starts it)
    if not interpret and (torch.cuda.device_count() == 0 if gpus > 1 else not torch.cuda.is_available()):
        raise click.UsageError("no CUDA GPU here: tune on a GPU, or pass --interpret to exercise the whole "
                               "path through Triton's interpreter (not a timing)")
    if not interpret and gpus > torch.cuda.device_count():
        raise click.UsageError(f"--gpus {gpus}: this machine has {torch.cuda.device_count()} visible GPU(s)")
    if interpret and gpus > (os.cpu_count() or 1):  # (each worker a process interpreting kernels: 1000 forked 262
        # workers in 15 s and did not finish)
        raise click.UsageError(f"--gpus {gpus}: with --interpret each worker is a CPU process; this machine has "
                               f"{os.cpu_count() or 1} CPU(s)")
    url = db_url or default_url()
    from .db.urls import in_memory

    if in_memory(url):
        raise click.BadParameter(f"{url}: an in-memory SQLite database keeps nothing once the tune exits (and "
                                 "--gpus workers would each get their own); give a file, sqlite:///path",
                                 param_hint="'--db'")
    if recheck:
        _recheck(specs, url, shipped, interpret, timeout_s, as_json, jobs)
        return
    store = ResultStore(url, heartbeat_s=heartbeat_s)  # opened for writing before any trial runs
    if gpus > 1:
        forwarded = dict(trials=trials, seqlens=",".join(map(str, seqlens)) if seqlens else None, timeout=timeout_s,
                         sampler=sampler, db=url, heartbeat=heartbeat_s, no_default=no_default)
        docs = _run_workers(ctx, store, paths, specs, forwarded, seed, gpus, interpret)
        if as_json:
            click.echo(json.dumps(dict(db=store.display_url, workers=docs), indent=1))
        else:
            _print_stored(store, specs, interpret)
        return
    docs = []
    for spec in specs:
        docs.append(_tune_spec(ctx, spec, store, trials, timeout_s, sampler, seed, plot, interpret, as_json,
                               worker, no_default=no_default))
    if as_json:
        click.echo(json.dumps(docs[0] if len(docs) == 1 else docs, indent=1))
    failed = [doc["spec"] for doc in docs if _nothing_stored(doc)]
    if failed:
        raise click.ClickException("no config passed verification for " + ", ".join(failed) + ": nothing stored for it")


def _nothing_stored(doc: dict) -> bool:
    """Whether a spec's tune (one _tune_spec result) stored nothing: no config passed, and it was
    not that another `--gpus` worker ran every final round (and chose its configs)."""
    return (not any(r["config"] for r in doc["results"])
            and not all(r["final_elsewhere"] for r in doc["results"]))


def _tune_spec(ctx, spec, store, trials, timeout_s, sampler, seed, plot, interpret, as_json,
               worker=None, no_default: bool = False) -> dict:
    """Tune one spec in this process; print its table (unless as_json) and return its results,
    with where the time went (wall-clock stamps, seconds per study, compile+verify vs timing)."""
    from tqdm.auto import tqdm

    from .tuner import GpuRunner, InterpretRunner, TuneOptions, tune as run_tune

    started_at = time.time()
    runner = InterpretRunner() if interpret else GpuRunner()
    runner_ready_at = time.time()  # the first spec's includes CUDA's initialization
    stale = store.stale_best(runner.env, spec)
    if stale:
        click.echo(f"{spec.uri}: {len(stale)} stored result(s) on {runner.env.gpu} are stale (timed on kernels the "
                   "templates have changed since): not used; this tune stores new ones", err=True)
    phases = 2 if spec.backward else 1
    total = (trials or spec.tune.trials) * (phases * len({b for b in _buckets(spec)}) + len(_decode_buckets(spec)))
    history: dict[str, list] = {}
    bar = tqdm(total=total, desc=f"tune {spec.uri}", unit="trial", disable=as_json, dynamic_ncols=True)
    state = {"failures": 0}

    def progress(event):
        rec, study = event["record"], event["study"]
        if rec.status == "restricted":  # rejected before compiling: no trial spent
            return
        history.setdefault(study.study_name, []).append(rec)
        state["failures"] += rec.status != "ok"
        ok = [r for r in history[study.study_name] if r.status == "ok"]
        best = min(ok, key=lambda r: r.ms) if ok else None
        bar.set_postfix_str(f"S={event['bucket']} {event['phase']} best={best.ms:.3f}ms "
                            f"{best.tflops:.0f}TFLOP/s fail={state['failures']}" if best else
                            f"S={event['bucket']} {event['phase']} fail={state['failures']}")
        bar.update(1)

    interrupted = threading.Event()

    def on_interrupt(signum, frame):
        interrupted.set()
        raise KeyboardInterrupt

    def unraisable(info, default=sys.unraisablehook):
        # A KeyboardInterrupt (or _exit_on_term's SystemExit) raised inside a weakref callback or __del__ is dropped
        # by Python ("Exception ignored in ..."): quietly, since the tuner stops before its next trial.
        if not issubclass(info.exc_type, (KeyboardInterrupt, SystemExit)):
            default(info)

    def stopped():  # a Ctrl-C, or a SIGTERM to a `--gpus` command (_exit_on_term): the tuner asks before each trial
        return interrupted.is_set() or _TERMINATED.is_set()

    options = TuneOptions(trials=trials, timeout_s=timeout_s, sampler=sampler, seed=seed, progress=progress,
                          interrupted=stopped, worker=worker, enqueue_default=not no_default)
    started = time.time()
    previous, previous_hook = signal.signal(signal.SIGINT, on_interrupt), sys.unraisablehook
    sys.unraisablehook = unraisable
    try:
        try:
            results = run_tune(spec, runner, store, options)
        except Exception as err:
            # A Ctrl-C raised inside a library can come out as that library's own error (Optuna's tell,
            # interrupted in its commit, raised UnboundLocalError from it): still the interrupt.
            if not stopped():
                raise
            raise KeyboardInterrupt from err
    except (KeyboardInterrupt, SystemExit) as err:
        bar.close()
        # a trial's heartbeat thread the Ctrl-C (or SIGTERM: _exit_on_term) left running would keep the process alive
        store.stop_heartbeats()
        if isinstance(err, SystemExit):
            raise
        if _TERMINATED.is_set():  # the tuner stopped for a SIGTERM whose SystemExit Python dropped
            raise SystemExit(EXIT_TERMINATED) from None
        click.echo(f"interrupted: the finished trials are kept in {store.display_url}; run the same command again "
                   "to go on from them", err=True)
        ctx.exit(EXIT_INTERRUPTED)
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook
    bar.close()
    wall = time.time() - started
    rows = [dict(bucket=r.bucket, phase=r.phase, trials=r.trials, resumed=r.resumed, failures=r.failures,
                 config=r.best.config if r.best else None, ms=r.best.ms if r.best else None,
                 tflops=r.best.tflops if r.best else None, speedup_over_default=r.speedup,
                 importances=r.importances, kept=r.kept, warm_starts=r.warm_starts,
                 final_elsewhere=r.final_elsewhere, seconds=r.seconds) for r in results]
    if not as_json:
        _print_tune_table(spec, runner, rows, store.display_url, wall)
    if plot:  # (path, format)
        _plot(*plot, history, results)
        click.echo(f"wrote {plot[0]}", err=True)  # (stdout may be --json's document)
    return dict(spec=spec.uri, db=store.display_url, timing=runner.timing_label, wall_s=wall,
                environment=runner.env.as_dict(), results=rows, started_at=started_at,
                runner_ready_at=runner_ready_at, ended_at=time.time(), seconds=dict(runner.seconds))


def _recheck(specs, url, shipped, interpret, timeout_s, as_json, jobs) -> None:
    """`flashgen tune --recheck`: flashgen.tuner.recheck per spec, in the database, or (with
    --shipped) in a scratch database loaded from this GPU's tuning_db/ file, which is then
    rewritten with export's writer."""
    import json
    import tempfile

    from .db import ResultStore
    from .db.kernels import _spec
    from .db.layer import export_text, gpu_slug, layer_dir, read_file
    from .tuner import GpuRunner, InterpretRunner, TuneOptions, recheck

    runner = InterpretRunner() if interpret else GpuRunner()
    options = TuneOptions(timeout_s=timeout_s)
    docs = []

    def run(store, spec):
        if not as_json:
            click.echo(f"recheck {spec.uri} on {runner.env.gpu} ({runner.timing_label})", err=True)
        skipped = []
        results = recheck(spec, runner, store, options, jobs=jobs, skipped=skipped)
        _say_skipped(skipped, store.display_url, f" of {spec.uri}")  # (a recheck left them out silently)
        doc = dict(spec=spec.uri, results=[_recheck_row(r) for r in results])
        docs.append(doc)
        if not as_json:
            _print_recheck(doc)
        return results

    if not shipped:
        store = ResultStore(url, create=False)  # (a misspelled --db is said, not made empty and found to hold nothing)
        for spec in specs:
            run(store, spec)
    else:
        path = layer_dir() / f"{gpu_slug(runner.env.gpu)}.yaml"
        if not path.exists():
            raise click.ClickException(f"no shipped tuning results for {runner.env.gpu}: {path} does not exist")
        rows = read_file(path)
        here = [r for r in rows if runner.env.same_machine(r["environment"])]
        named = {s.key for s in specs}
        found = {r["spec_key"]: r["spec"] for r in here if not named or r["spec_key"] in named}
        missing = sorted(s.uri for s in specs if s.key not in found)
        if missing:
            raise click.ClickException(f"{path} holds no result for {', '.join(missing)} on {runner.env.gpu}")
        with tempfile.TemporaryDirectory() as tmp:
            store = ResultStore(f"sqlite:///{Path(tmp) / 'recheck.sqlite'}")
            store.import_rows(rows)
            replaced = set()
            for key, canonical in found.items():
                spec = next((s for s in specs if s.key == key), None) or \
                    _spec(json.dumps(canonical, sort_keys=True))
                replaced |= {(key, r.bucket, r.phase) for r in run(store, spec) if r.kept != "nothing"}
            now = runner.env.as_dict()
            # a rechecked bucket and phase keeps only the row measured now (other environments'
            # rows of this machine would compete with it in flashgen.load's ranking)
            out = [r for r in store.all_best() if r["environment"] == now
                   or (r["spec_key"], r["bucket"], r["phase"]) not in replaced
                   or not runner.env.same_machine(r["environment"])]
            text, n = export_text(out, runner.env.gpu)
            store.close()
        _write_file(path, text)
        if not as_json:
            click.echo(f"wrote {n} results for {runner.env.gpu} to {path}")
    if as_json:
        click.echo(json.dumps(docs[0] if len(docs) == 1 else docs, indent=1))


def _recheck_row(r) -> dict:
    def ms(rec):
        return rec.ms if rec is not None and rec.status == "ok" else None

    def failed(rec):
        return None if rec is None or rec.status == "ok" else f"{rec.status}: {rec.error}"

    return dict(bucket=r.bucket, phase=r.phase, was=r.why, stored_ms_before=r.stored_ms, stored_ms=ms(r.stored),
                default_ms=ms(r.default), kept=r.kept, stored_failure=failed(r.stored),
                default_failure=failed(r.default))


def _print_recheck(doc: dict) -> None:
    if not doc["results"]:
        click.echo(f"{doc['spec']}: no stored result on this GPU to recheck")
        return
    click.echo(f"{doc['spec']}")
    click.echo(f"{'bucket':>7} {'phase':5} {'was':15} {'stored ms':>10} {'now ms':>9} {'default ms':>10}  kept")
    for r in doc["results"]:
        def cell(x, width):
            return f"{x:>{width}.4f}" if x is not None else f"{'-':>{width}}"

        note = "".join(f"  ({w})" for w in (r["stored_failure"], r["default_failure"]) if w)
        click.echo(f"{r['bucket']:>7} {r['phase']:5} {r['was']:15} {cell(r['stored_ms_before'], 10)} "
                   f"{cell(r['stored_ms'], 9)} {cell(r['default_ms'], 10)}  {r['kept']}{note}")


def worker_order(specs: list, worker: int) -> list:
    """The specs in the order worker ``worker`` takes them: starting at spec ``worker`` (so the
    workers begin on different specs, then help with the rest through the shared studies)."""
    start = worker % len(specs)
    return specs[start:] + specs[:start]


def worker_commands(paths, forwarded: dict, seed: int, gpus: int, interpret: bool, environ=None, run: str = "run"):
    """(command, environment) of each `--gpus` worker: worker i sees one GPU (the i-th of
    CUDA_VISIBLE_DEVICES, or GPU i), starts at spec i (so the workers begin on different
    specs, then help with the rest through the shared studies), samples with seed + i and is
    worker i of ``run`` (each study's final round runs once per run)."""
    environ = dict(os.environ if environ is None else environ)
    visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()] or \
        [str(i) for i in range(gpus)]
    out = []
    for i in range(gpus):
        order = worker_order(paths, i)
        cmd = [sys.executable, "-m", "flashgen", "tune", *order, "--gpus", "1", "--seed", str((seed + i) % 2**32),
               "--json", "--worker", f"{run}:{i}"]
        for name, value in forwarded.items():
            if value is True:  # a flag
                cmd.append(f"--{name.replace('_', '-')}")
            elif value is not None and value is not False:
                cmd += [f"--{name}", str(value)]
        if interpret:
            cmd.append("--interpret")
        out.append((cmd, dict(environ, CUDA_VISIBLE_DEVICES=visible[i % len(visible)])))
    return out


_TERMINATED = threading.Event()  # set by _exit_on_term: a SIGTERM reached a `--gpus` command


def _exit_on_term(signum, frame):
    """SIGTERM as SystemExit(143), so that `_run_workers` ends the workers before the command exits. Python drops an
    exception raised inside a weakref callback or __del__ (the interpreter's and SQLAlchemy's run often): the event
    stops the tuner before its next trial all the same (_tune_spec), with this SystemExit."""
    _TERMINATED.set()
    raise SystemExit(EXIT_TERMINATED)


def _run_workers(ctx, store, paths, specs, forwarded, seed, gpus, interpret) -> list[dict]:
    """Run the workers, wait for all, return their results; a failed worker is an error that
    names it (its own messages went to stderr as it ran). Worker 0 is this process, on the first
    GPU it sees, in the specs' order. The others are forked from it where that is safe (Linux,
    CUDA not started here): they start with torch, Triton and flashgen imported, their runners
    ready in 0.1-0.2 s instead of the 5-9 s a new process took to import them while its GPU
    idled (issue 16's 2-GPU throughput); elsewhere each is a new `flashgen tune --worker` process."""
    import json

    started = time.time()
    run = f"{os.getpid()}-{int(started)}"  # this run's id: its workers' final-round claims
    commands = worker_commands(paths, forwarded, seed, gpus, interpret, run=run)
    _TERMINATED.clear()  # (an earlier run's in this process: neither this one nor its forks may inherit it)
    fork = _can_fork(interpret)
    if fork:
        sys.stdout.flush(), sys.stderr.flush()
        store.close()  # no pooled connection crosses the fork (this process opens new ones)
    else:
        import subprocess
    procs, own, outputs = [], [], []
    # A SIGTERM to the command ends its workers too: by default it killed this process alone, and a forked worker,
    # re-parented, went on writing trials (a review's catch). Installed before any worker starts, so that one
    # arriving meanwhile finds each started worker in procs; held (blocked) while workers are forked, so that no
    # child runs this process's handler (each sets the default and takes the signal again: _ForkedWorker).
    previous_term = signal.signal(signal.SIGTERM, _exit_on_term)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}) if fork else None
    try:
        for i, (cmd, env) in enumerate(commands[1:], start=1):
            gpu = env["CUDA_VISIBLE_DEVICES"]
            procs.append((_ForkedWorker(ctx, worker_order(specs, i), forwarded, seed + i, (run, i), interpret, gpu,
                                        held) if fork else
                          subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True), gpu))
        if fork:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)  # (a SIGTERM held meanwhile arrives now)
            held = None
        for spec in specs:  # worker 0: commands[0]'s order and seed
            own.append(_tune_spec(ctx, spec, store, forwarded["trials"], forwarded["timeout"], forwarded["sampler"],
                                  seed, None, interpret, True, (run, 0), no_default=forwarded.get("no_default", False)))
        outputs = [p.communicate()[0] for p, _ in procs]
    except KeyboardInterrupt:  # the workers had it too (one process group): they keep what they finished
        for p, _ in procs:
            p.wait()
        click.echo(f"interrupted: the finished trials are kept in {store.display_url}; run the same command again "
                   "to go on from them", err=True)
        ctx.exit(EXIT_INTERRUPTED)
    except BaseException as err:  # worker 0 interrupted (its ctx.exit; the others had the Ctrl-C too), failed or
        # terminated (_exit_on_term's SystemExit). Every worker is told before any is waited for, and a second
        # SIGTERM meanwhile is ignored: raised in the wait, it left the workers after the first one running.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if not isinstance(err, click.exceptions.Exit):
            for p, _ in procs:
                if p.poll() is None:
                    p.terminate()  # failed or terminated: the others end with it
        for p, _ in procs:
            p.wait()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        if held is not None:  # (a fork that failed)
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        _TERMINATED.clear()  # (a later tune in this process, without --gpus, reads it too)
    failed = [f"worker {i} (CUDA_VISIBLE_DEVICES={gpu}) exited with {p.returncode}"
              for i, (p, gpu) in enumerate(procs, start=1) if p.returncode]
    failed += [f"worker 0: no config passed verification for {doc['spec']}" for doc in own if _nothing_stored(doc)]
    if failed:
        # (a dead worker's trial stays running until its heartbeat lapses, and a study with one running skips its
        # final round: the next run fails it, runs it again and stores the study's result)
        again = (f"; the finished trials are kept in {store.display_url}: run the same command again to go on from "
                 "them (a dead worker's studies store their results then)") if any(p.returncode for p, _ in procs) \
            else ""
        raise click.ClickException("; ".join(failed) + again)
    docs = [dict(worker=0, pid=os.getpid(), cuda_visible_devices=commands[0][1]["CUDA_VISIBLE_DEVICES"],
                 started_at=started, specs=own)]
    for i, ((p, gpu), text) in enumerate(zip(procs, outputs), start=1):
        result = json.loads(text)
        docs.append(dict(worker=i, pid=p.pid, cuda_visible_devices=gpu, started_at=started,
                         specs=result if isinstance(result, list) else [result]))
    click.echo(f"{gpus} workers finished in {time.time() - started:.0f}s", err=True)
    return docs


def _can_fork(interpret: bool) -> bool:
    """Whether `--gpus` may fork its workers from this process: on Linux, with no CUDA context
    here (a forked child cannot use one its parent started; the GPU count came from NVML)."""
    if not sys.platform.startswith("linux") or os.environ.get("FLASHGEN_WORKER_PROCESSES") == "spawn":
        return False
    if interpret:
        return True
    import torch

    nvml = getattr(torch.cuda, "_device_count_nvml", None)  # the count that left CUDA unstarted
    return not torch.cuda.is_initialized() and nvml is not None and nvml() > 0


class _ForkedWorker:
    """A `--gpus` worker forked from the command's process, with the interface of the
    subprocess.Popen it replaces (pid, poll, wait, terminate, communicate, returncode): it
    tunes ``specs`` on its GPU as worker ``worker`` and sends their results (JSON) back through
    a pipe; its messages go to the command's stderr as they come."""

    def __init__(self, ctx, specs, forwarded, seed, worker, interpret, visible, mask=None):
        # mask: the signal mask to restore in the child (the command holds SIGTERM while it forks)
        read, write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: SIGTERM's default action, then never returns
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.close(read)
            _forked_worker_main(ctx, specs, forwarded, seed, worker, interpret, visible, write)
        os.close(write)
        self._read, self.returncode = read, None

    def _reap(self, flags: int = 0):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, flags)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self):
        return self._reap(os.WNOHANG)

    def wait(self):
        if self._read is not None:  # results nobody will read: a child writing them ends (a broken pipe)
            os.close(self._read)
            self._read = None
        return self._reap()

    def terminate(self):
        if self.returncode is None:
            os.kill(self.pid, signal.SIGTERM)

    def communicate(self):
        with os.fdopen(self._read, "rb") as pipe:
            self._read = None
            data = pipe.read()
        self.wait()
        return data.decode(), None


def _forked_worker_main(ctx, specs, forwarded, seed, worker, interpret, visible, write) -> None:
    """The body of a forked `--gpus` worker: as `flashgen tune --worker` would run, with errors
    said in one line (a bug with its traceback), then the process ends (os._exit: nothing of the
    parent's, its atexit handlers or buffered output, runs twice)."""
    import json

    from .db import ResultStore

    code = EXIT_FAILURE
    try:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible  # before this process starts CUDA
        store = ResultStore(forwarded["db"], heartbeat_s=forwarded["heartbeat"])
        docs = [_tune_spec(ctx, spec, store, forwarded["trials"], forwarded["timeout"], forwarded["sampler"], seed,
                           None, interpret, True, worker, no_default=forwarded.get("no_default", False))
                for spec in specs]
        code = 0
        with os.fdopen(write, "wb") as pipe:
            pipe.write(json.dumps(docs).encode())
    except BrokenPipeError:  # the command stopped reading (interrupted, or another worker failed): results are stored
        pass
    except click.exceptions.Exit as done:  # interrupted (_tune_spec said so)
        code = done.exit_code
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except BaseException as err:  # noqa: BLE001 - the worker's last word, whatever ended it
        said = err if isinstance(err, click.ClickException) else _said(ctx, err)
        if said is not None:
            said.show()
            code = said.exit_code
        else:
            import traceback

            traceback.print_exc()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


def _print_stored(store, specs, interpret) -> None:
    """The best configs the workers left in the database, per spec."""
    from .db import EnvInfo

    from .tuner import GpuRunner, InterpretRunner

    here = EnvInfo.current(interpret=interpret)
    label = (InterpretRunner if interpret else GpuRunner).timing_label  # as the one-worker table says it
    for spec in specs:
        click.echo(f"\n{spec.uri} on {here.gpu} ({label}); results in {store.display_url}")
        click.echo(f"{'bucket':>7} {'phase':5} {'ms':>9} {'TFLOP/s':>8} {'vs default':>10}  config")
        for bucket, phases in sorted(store.best_configs(here, spec).items()):
            for phase, row in sorted(phases.items()):
                knobs = _knob_text(row["config"], phase)
                speed = f"{row['default_ms'] / row['ms']:.2f}x" if row.get("default_ms") and row["ms"] else "-"
                click.echo(f"{bucket:>7} {phase:5} {row['ms']:>9.4f} {row['tflops']:>8.1f} {speed:>10}  {knobs}")


def _buckets(spec):
    from .space import bucket_of

    return sorted({bucket_of(s) for s in spec.tune.seqlens})


def _decode_buckets(spec):
    from .decode_space import buckets

    decode = spec.tune.decode
    return buckets(decode.kv_lengths, decode.batches) if decode else []


def _knob_text(config, phase) -> str:
    """A phase's own knobs of a stored config (a decode phase's are all of it)."""
    from .decode_space import phase_batch

    own = config if phase_batch(phase) is not None else KernelConfig.phase_knobs(phase)
    return " ".join(f"{k}={v}" for k, v in config.items() if k in own)


def _print_tune_table(spec, runner, rows, url, wall):
    click.echo(f"\n{spec.uri} on {runner.env.gpu} ({runner.timing_label}); results in {url}; {wall:.0f}s")
    for r in rows:
        if r["resumed"]:
            click.echo(f"S={r['bucket']} {r['phase']}: went on from {r['resumed']} trials of an earlier run")
        elif r["warm_starts"]:
            click.echo(f"S={r['bucket']} {r['phase']}: started from the best configs of {r['warm_starts']} "
                       "nearest tuned specs")
    click.echo(f"{'bucket':>7} {'phase':5} {'ms':>9} {'TFLOP/s':>8} {'vs default':>10}  config / importances")
    for r in rows:
        if r["config"] is None:
            why = "final round run by another worker" if r["final_elsewhere"] else f"no config passed ({r['failures']})"
            click.echo(f"{r['bucket']:>7} {r['phase']:5} {'-':>9} {'-':>8} {'-':>10}  {why}")
            continue
        speed = f"{r['speedup_over_default']:.2f}x" if r["speedup_over_default"] else "-"
        knobs = _knob_text(r["config"], r["phase"])
        click.echo(f"{r['bucket']:>7} {r['phase']:5} {r['ms']:>9.4f} {r['tflops']:>8.1f} {speed:>10}  {knobs}")
        if r["kept"]:
            click.echo(f"{'':>44}kept the stored config: {r['kept']['ms']:.4f} ms is faster than this run's")
        if r["importances"]:
            imp = ", ".join(f"{k} {v:.2f}" for k, v in list(r["importances"].items())[:4])
            click.echo(f"{'':>44}importance: {imp}")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.UsageError("--plot needs matplotlib: pip install 'flashgen[plot]'") from None
    return plt


def _plot_format(path) -> str:
    """The image format --plot's file name asks for (its suffix; PNG without one), checked before a tune:
    one matplotlib writes, in a folder that exists (or can be made) and can be written."""
    plt = _pyplot()
    fmt = Path(path).suffix[1:].lower() or "png"
    fig = plt.figure()
    supported = fig.canvas.get_supported_filetypes()
    plt.close(fig)
    if fmt not in supported:
        raise click.BadParameter(f"expected a file name ending in one of {', '.join('.' + f for f in sorted(supported))}"
                                 f", got {path}", param_hint="'--plot'")
    folder = Path(path).absolute().parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise click.BadParameter(f"cannot write {path}: {folder} is not a folder this user can write in",
                                 param_hint="'--plot'")
    return fmt


def _plot(path, fmt, history, results):
    import io

    plt = _pyplot()
    fig, axes = plt.subplots(len(results), 2, figsize=(12, 3.2 * len(results)), squeeze=False)
    for (ax_h, ax_i), r in zip(axes, results):
        recs = history.get(r.study_name, [])
        xs = [i for i, rec in enumerate(recs) if rec.status == "ok"]
        ys = [recs[i].ms for i in xs]
        ax_h.scatter(xs, ys, s=12, label="trial")
        best, line = float("inf"), []
        for y in ys:
            best = min(best, y)
            line.append(best)
        ax_h.step(xs, line, where="post", color="C1", label="best so far")
        ax_h.set(title=f"S={r.bucket} {r.phase}: search history", xlabel="trial", ylabel="ms")
        ax_h.legend()
        names, vals = list(r.importances), list(r.importances.values())
        ax_i.barh(names, vals)
        ax_i.set(title="parameter importance (fANOVA)")
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, dpi=100, format=fmt)
    plt.close(fig)
    _write_file(path, image.getvalue())


@main.command()
@click.option("--spec", "spec_path", required=True, type=click.Path(dir_okay=False), help="The spec (YAML).")
@click.option("--seqlens", callback=_seqlens, help="Comma-separated sequence lengths (default: the spec's tune.seqlens).")
@click.option("--tokens", type=click.IntRange(1), default=16384, show_default=True,
              help="Tokens per batch: batch = tokens // seqlen.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Write bench.json, bench.md and bench.png.")
@_db_option
def bench(spec_path, seqlens, tokens, out_dir, db_url):
    """Time the spec's tuned kernel beside SDPA (flash, cuDNN, efficient) and FlexAttention."""
    import json

    import torch

    if not torch.cuda.is_available():
        raise click.UsageError("flashgen bench times kernels on a CUDA GPU, and there is none here")
    from .bench import bench_spec, environment, report_markdown, report_plot
    from .loader import load

    spec = AttentionSpec.from_yaml(spec_path)
    lengths = seqlens or list(spec.tune.seqlens)
    kernel = load(spec, db=db_url)
    modes = ("fwd", "fwd_bwd") if spec.backward else ("fwd",)
    rows = bench_spec(kernel, lengths, tokens=tokens, modes=modes)
    env = environment()
    table = report_markdown(spec.uri, rows, env)
    click.echo(f"configs from: {kernel.config_source}\n{table}")
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        _write_file(out / "bench.json", json.dumps(dict(spec=spec.uri, environment=env, rows=rows,
                                                        config_source=kernel.config_source), indent=1))
        _write_file(out / "bench.md", table)
        try:
            report_plot(out / "bench.png", spec.uri, rows)
        except ImportError:
            click.echo("no bench.png: install matplotlib (pip install 'flashgen[plot]')")
        click.echo(f"wrote {out}/bench.json, bench.md, bench.png")


@main.command()
@_db_option
@click.option("--json", "as_json", is_flag=True,
              help="Print the rows as a JSON list (each with its environment, spec, config, times, source and match).")
def show(db_url, as_json):
    """List the tuned configs stored in the database, and the shipped ones measured on this machine.

    Each says whether it serves this machine: an exact match of the environment, or a near
    match (same GPU model, kernels and Triton major.minor; other torch, CUDA or Triton
    patch release), which flashgen.load uses when no exact match exists; or stale (timed on
    kernels the templates have changed since: not used, re-tune).
    """
    import json

    from .db import EnvInfo
    from .db.env import classify
    from .db.kernels import row_kernel, target_of
    from .db.layer import ResultFileError, layer_dir, read_file

    here = EnvInfo.current()
    try:
        stored, _ = _readable_rows(db_url)
    except MissingDatabaseError as err:
        if db_url is not None or os.environ.get("FLASHGEN_DB"):  # a database named by the user: a typo, say
            raise
        # a fresh install: the shipped results still serve this machine
        click.echo(f"no results database yet ({err.url}: the first `flashgen tune` makes it); "
                   f"the shipped ones:", err=True)
        stored = []
    rows = [dict(r, source="database", match=classify(here, r, row_kernel)) for r in stored]
    for path in sorted(layer_dir().glob("*.yaml")):
        try:
            shipped = read_file(path)
        except ResultFileError as err:
            click.echo(f"skipping {err}", err=True)
            continue
        rows += [dict(r, source="tuning_db", match=classify(here, r, row_kernel)) for r in shipped
                 if here.same_machine(r["environment"])]
    if as_json:
        click.echo(json.dumps(rows, indent=1, default=str))
        return
    if not rows:
        click.echo("no tuned configs stored")
        return
    for r in rows:
        speed = f"{r['default_ms'] / r['ms']:.2f}x" if r["default_ms"] else "-"
        env = r["environment"]
        served = {"exact": "exact match here", "near": f"near match here (tuned with {here.differences(env)})",
                  "stale": "stale here (timed on kernels the templates have changed since; not used: re-tune)",
                  None: "not for this machine"}[r["match"]]
        if r["match"] in ("exact", "near"):
            served += _default_note(r, target_of(here))
        click.echo(f"{r['source']}: {r['spec_uri']}  S={r['bucket']} {r['phase']}  {r['ms']:.4f} ms  "
                   f"{r['tflops']:.1f} TFLOP/s  {speed} vs default  on {env['gpu']} (triton {env['triton']}): "
                   f"{served}")


def _readable_rows(db_url) -> tuple[list[dict], int]:
    """The database's best configs, the malformed ones left out and said on stderr (they raised mid-table),
    and how many were left out."""
    from .db import ResultStore

    store, skipped = ResultStore(db_url, create=False), []
    rows = store.all_best(skipped=skipped)
    _say_skipped(skipped, store.display_url)
    return rows, len(skipped)


def _say_skipped(skipped: list[str], shown_url: str, of: str = "") -> None:
    """Say on stderr that malformed stored results were left out (show, export, tune --recheck): how many,
    the first, and the command that names them all."""
    if skipped:
        click.echo(f"skipping {len(skipped)} malformed result(s){of} in {shown_url} ({skipped[0]}); run "
                   f"`flashgen db check --db {shown_url}`", err=True)


def _default_note(row: dict, target: str) -> str:
    """What `flashgen show` says of the default a served-looking row was measured against."""
    from .db.kernels import OTHER_DEFAULT, SAME_DEFAULT, UNKNOWN_DEFAULT, default_status

    recheck = "`flashgen tune --recheck --spec <its spec file>`"
    return {SAME_DEFAULT: "; measured against this flashgen's default",
            OTHER_DEFAULT: f"; measured against an older default: not used (this bucket runs today's default); "
                           f"re-check with {recheck}",
            UNKNOWN_DEFAULT: f"; the default it beat is unknown (stored before flashgen recorded it): used; "
                             f"re-check with {recheck}",
            None: ""}[default_status(row["spec"], row, target)]


@main.command("export")
@_db_option
@click.option("--gpu", help="Export this GPU's results (default: this machine's GPU).")
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Default: <gpu>.yaml in the working directory (copy it into a source tree's tuning_db/ to ship it).")
def export_cmd(db_url, gpu, output):
    """Write a GPU's best configs to a file in the format of the shipped tuning_db/ layer."""
    from .db import EnvInfo
    from .db.layer import export_text, gpu_slug

    for name, value in (("--gpu", gpu), ("-o", output)):  # (empty: they meant this machine and <gpu>.yaml, silently)
        if value is not None and not value.strip():
            raise click.BadParameter(f"expected a {'GPU name' if name == '--gpu' else 'file name'}, got an empty one",
                                     param_hint=f"'{name}'")
    gpu = gpu or EnvInfo.current().gpu
    path = Path(output) if output else Path.cwd() / f"{gpu_slug(gpu)}.yaml"
    rows, skipped = _readable_rows(db_url)
    text, n = export_text(rows, gpu)
    if not n:  # results of other GPUs only (a mistyped --gpu), or none: it wrote an empty file
        gpus = ", ".join(sorted({repr(r["environment"]["gpu"]) for r in rows}))
        there = (f"its GPUs are {gpus}" if rows else f"its {skipped} results are all malformed" if skipped else
                 "it holds none (`flashgen tune` stores them)")
        raise click.ClickException(f"no results for GPU {gpu!r} in {display_url(db_url or default_url())}: {there}")
    _write_file(path, text)
    click.echo(f"wrote {n} results for {gpu} to {path}")


@main.command("import")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@_db_option
def import_cmd(path, db_url):
    """Load an exported tuning_db file into a database (every entry is checked first)."""
    from .db import ResultStore
    from .db.layer import read_file

    rows = read_file(Path(path))
    n = ResultStore(db_url).import_rows(rows)
    kept = (f" (kept {len(rows) - n} results the database held: faster, measured against this flashgen's "
            "default, or of kernels this flashgen still renders where the file's it no longer does)") \
        if n < len(rows) else ""
    click.echo(f"imported {n} results from {path}{kept}")


@main.group()
def db():
    """Inspect or upgrade the results database."""


@db.command("check")
@_db_option
@click.pass_context
def db_check(ctx, db_url):
    """Report what is wrong with the database, malformed results included (exit 1 when anything is)."""
    from .db import ResultStore

    store = ResultStore(db_url, create=False)
    problems = store.check()
    for p in problems:
        click.echo(f"{store.display_url}: {p}")
    if problems:
        ctx.exit(EXIT_FAILURE)
    click.echo(f"{store.display_url}: ok")


@db.command("upgrade")
@_db_option
def db_upgrade(db_url):
    """Bring a database to this flashgen's schema (Alembic migrations), and Optuna's tables to
    the installed Optuna's."""
    from .db import SCHEMA_VERSION, ResultStore, SchemaVersionError
    from .db.migrate import REVISIONS
    from .db.store import default_url, upgrade_database

    db_url = db_url or default_url()  # (the migration opens the URL itself: not the store's default)
    try:
        store = ResultStore(db_url, create=False)
    except SchemaVersionError as err:
        if err.found is None:
            raise
        if err.found < 0:  # not a number: the error quotes the stored value (this said "from schema version -1")
            raise click.ClickException(_one_line(click.get_current_context(), str(err))) from None
        if err.found > SCHEMA_VERSION:
            raise click.ClickException(f"{err.url} is at schema version {err.found}, newer than this flashgen's "
                                       f"{SCHEMA_VERSION}: upgrade flashgen instead") from None
        if err.found not in REVISIONS:
            raise click.ClickException(f"no migration from schema version {err.found} to {SCHEMA_VERSION} "
                                       "exists") from None
        upgrade_database(db_url, err.found)
        store = ResultStore(db_url, create=False)
        click.echo(f"{store.display_url}: upgraded from schema version {err.found} to {SCHEMA_VERSION}")
        return
    if store.missing_tables():
        upgrade_database(store.url, SCHEMA_VERSION)
    click.echo(f"{store.display_url}: at schema version {SCHEMA_VERSION}")


if __name__ == "__main__":
    main()
