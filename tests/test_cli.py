"""The command line: help, generate, a generated module used standalone, and one clean error line
for every user error (bad specs, paths, options and databases) from every verb."""

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashgen.cli import main

from .helpers import child_pythonpath

ROOT = Path(__file__).resolve().parent.parent
ON_GPU = os.environ.get("TRITON_INTERPRET", "0") in ("", "0")  # conftest sets it where there is no GPU
# In-process tunes run on what this process runs: --interpret where the interpreter is on (it cannot
# be switched on inside a process that imported Triton compiled), the GPU where there is one.
INTERPRET = [] if ON_GPU else ["--interpret"]


def test_help_lists_the_verbs():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    assert "generate" in result.output


def test_generate_bad_spec_names_field(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("head_dim: 0\n")
    result = CliRunner().invoke(main, ["generate", "--spec", str(spec)])
    assert result.exit_code == 2
    assert "spec field 'head_dim'" in result.output and "got 0" in result.output


def test_generate_bad_knob(tmp_path):
    result = CliRunner().invoke(main, ["generate", "--spec", str(ROOT / "examples/specs/mha-hd64.yaml"),
                                       "--block-m", "48"])
    assert result.exit_code == 2 and "BLOCK_M" in result.output


def test_generate_hopper_knobs(tmp_path):
    spec = str(ROOT / "examples/specs/gqa-causal.yaml")  # hd128 causal: the H100 default is the Gluon family
    out = tmp_path / "k.py"
    result = CliRunner().invoke(main, ["generate", "--spec", spec, "--target", "h100", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "'family': 'hopper_ws'" in out.read_text()
    result = CliRunner().invoke(main, ["generate", "--spec", spec, "--target", "h100", "--num-warps", "4",
                                       "--no-tma", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "'tma': False" in out.read_text() and "'warp_specialize': False" in out.read_text()
    result = CliRunner().invoke(main, ["generate", "--spec", spec, "--target", "h100", "--num-warps", "4",
                                       "--warp-specialize"])
    assert result.exit_code != 0 and "warp_specialize': needs num_warps >= 8, got num_warps=4" in result.output


def test_generate_block_m_override_takes_its_register_budget(tmp_path):
    # hd64's H100 default is three consumers (BLOCK_M 192, 160 registers each): --block-m 128 gives two
    # consumers the default's registers, and --block-m 192 back gives three theirs
    spec = str(ROOT / "examples/specs/mha-hd64.yaml")
    out = tmp_path / "k.py"
    for block_m, regs in ((None, 160), ("128", None), ("64", None)):
        args = ["generate", "--spec", spec, "--target", "h100", "-o", str(out)] + (["--block-m", block_m] if block_m
                                                                                  else [])
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        text = out.read_text()
        config = text[text.index("CONFIG = {"):].split("}", 1)[0]
        assert f"'BLOCK_M': {block_m or 192}" in config and "'family': 'hopper_ws'" in config
        assert (f"'hopper_regs': {regs}" in config) if regs else "'hopper_regs'" not in config  # (240: left out)
    gqa = str(ROOT / "examples/specs/gqa-causal.yaml")  # hd128: three consumers do not fit its accumulators
    result = CliRunner().invoke(main, ["generate", "--spec", gqa, "--target", "h100", "--block-m", "192"])
    assert result.exit_code == 2 and "'BLOCK_M'" in result.output and "head dims up to 64 only" in result.output


def test_generated_module_runs_with_only_torch_and_triton(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(textwrap.dedent("""\
        name: standalone
        dtype: fp32
        head_dim: 24
        num_heads: 4
        num_kv_heads: 2
        causal: true
        """))
    out = tmp_path / "my_attention.py"
    result = CliRunner().invoke(main, ["generate", "--spec", str(spec), "-o", str(out), "--target", "cpu",
                                       "--loop-order", "kv_outer", "--block-m", "16", "--block-n", "16"])
    assert result.exit_code == 0, result.output
    assert "CONFIG = {" in out.read_text() and "'loop_order': 'kv_outer'" in out.read_text()
    # A fresh interpreter where importing flashgen fails: the file must not need it.
    script = textwrap.dedent(f"""
        import importlib.util, math, sys
        sys.modules["flashgen"] = None
        import torch
        spec = importlib.util.spec_from_file_location("my_attention", {str(out)!r})
        mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
        dev = {"cuda" if ON_GPU else "cpu"!r}
        q = torch.randn(2, 4, 19, 24, device=dev); k = torch.randn(2, 2, 23, 24, device=dev)
        v = torch.randn(2, 2, 23, 24, device=dev)
        o, lse = mod.forward(q, k, v)
        kk, vv = k.repeat_interleave(2, 1).double(), v.repeat_interleave(2, 1).double()
        s = q.double() @ kk.transpose(-1, -2) / math.sqrt(24)
        s = s.masked_fill(torch.ones(19, 23, dtype=torch.bool, device=dev).triu(23 - 19 + 1), float("-inf"))
        ref = torch.softmax(s, -1) @ vv
        err = ((o.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-5, err
        print("standalone ok", err)
    """)
    # Where there is a GPU the module runs compiled; elsewhere through the interpreter.
    env = dict(os.environ, TRITON_INTERPRET="0" if ON_GPU else "1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "standalone ok" in proc.stdout


def test_console_script_entry_point():
    # `python -m flashgen` works like the installed `flashgen` script.
    proc = subprocess.run([sys.executable, "-m", "flashgen", "--version"], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=child_pythonpath(ROOT)))
    assert proc.returncode == 0 and "flashgen" in proc.stdout


def test_help_and_a_bad_spec_answer_without_importing_torch(tmp_path):
    # torch and Triton take seconds to import (4 s of every command's start on a CPU host): `import flashgen`,
    # reading a spec, the help and the answer to a spec's mistake need neither (a kernel's first use imports them)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ndtype: bf16\nhead_dim: 64\nnum_heads: 3\nnum_kv_heads: 2\n")
    code = textwrap.dedent(f"""
        import sys
        from click.testing import CliRunner
        import flashgen
        from flashgen.cli import main
        flashgen.AttentionSpec.from_yaml({str(SMALL_SPEC)!r})
        runs = [CliRunner().invoke(main, args) for args in (["--help"], ["tune", "--help"],
                                                             ["tune", "--spec", {str(bad)!r}])]
        print(*(r.exit_code for r in runs), "'num_kv_heads'" in runs[2].output,
              [m for m in ("torch", "triton") if m in sys.modules])
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (the interpreter's patch imports Triton)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env=dict(env, PYTHONPATH=child_pythonpath(ROOT)))
    assert proc.stdout.split() == ["0", "0", "2", "True", "[]"], proc.stderr[-3000:]


def test_bench_needs_a_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(main, ["bench", "--spec", str(ROOT / "examples/specs/mha-hd64.yaml")])
    assert result.exit_code == 2 and "CUDA GPU" in result.output


def test_bench_report_counts_and_ratios():
    from flashgen.bench import report_markdown

    rows = [{"seqlen": 1024, "mode": "fwd", "flashgen": {"tflops": 400.0}, "sdpa_flash": {"tflops": 300.0},
             "sdpa_cudnn": {"error": "no"}, "sdpa_efficient": {"tflops": 200.0}, "flex": {"tflops": 380.0}}]
    table = report_markdown("x", rows, {"gpu": "G", "torch": "t", "triton": "tr", "flashgen": "f"})
    assert "| 1024 | fwd | 400 | 300 | - | 200 | 380 | 1.33 | - | 2.00 | 1.05 |" in table


# ----------------------------------------------------------------------------- user errors: one line, no traceback
SECRET = "S3cretPw"
SMALL_SPEC = ROOT / "examples/specs/small-causal.yaml"  # fp16: `tune --interpret` takes it


def _one_error(result, code: int, *words: str) -> str:
    """The result failed with `code` and said why in one `Error:` line, without a traceback."""
    assert isinstance(result.exception, SystemExit), f"unhandled {result.exception!r}\n{result.output}"
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output and SECRET not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.output
    if "Usage:" not in result.output:  # click's own usage errors add the usage above the error
        assert result.output.strip() == errors[0], result.output
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def sound_database(tmp_path_factory):
    """A flashgen database holding one result, and that result exported to a file."""
    from flashgen import AttentionSpec
    from flashgen.db import EnvInfo, ResultStore
    from flashgen.db.layer import export_rows

    root = tmp_path_factory.mktemp("sound")
    store = ResultStore(f"sqlite:///{root / 'sound.sqlite'}")
    here = EnvInfo.current(interpret=True)
    store.set_best(here, AttentionSpec.from_yaml(SMALL_SPEC), 64, "fwd",
                   dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1), 1.0, 1.0)
    export_rows(store.all_best(), root / "results.yaml", here.gpu)
    store.close()
    return root


def _database(fault: str, tmp_path, sound: Path) -> str:
    if fault == "missing":
        return f"sqlite:///{tmp_path / 'missing.sqlite'}"
    if fault == "corrupt":
        (tmp_path / "corrupt.sqlite").write_bytes(bytes(range(256)) * 40)
        return f"sqlite:///{tmp_path / 'corrupt.sqlite'}"
    if fault == "read-only":  # SQLite's own read-only mode: file modes do not stop root
        return f"sqlite:///file:{sound / 'sound.sqlite'}?mode=ro&uri=true"
    if fault == "unreachable":
        return f"postgresql+psycopg://u:{SECRET}@127.0.0.1:1/x"
    if fault == "bad-path":  # under a regular file
        (tmp_path / "a-file").write_text("x")
        return f"sqlite:///{tmp_path / 'a-file' / 'x.sqlite'}"
    raise AssertionError(fault)


VERBS = {
    "tune": lambda tmp, sound: ["tune", "--spec", str(SMALL_SPEC), *INTERPRET, "--trials", "1"],
    "show": lambda tmp, sound: ["show"],
    "export": lambda tmp, sound: ["export", "--gpu", "triton-interpreter", "-o", str(tmp / "out.yaml")],
    "import": lambda tmp, sound: ["import", str(sound / "results.yaml")],
    "db-check": lambda tmp, sound: ["db", "check"],
    "db-upgrade": lambda tmp, sound: ["db", "upgrade"],
    "bench": lambda tmp, sound: ["bench", "--spec", str(SMALL_SPEC)],
}
FAULTS = ("missing", "corrupt", "read-only", "unreachable", "bad-path")
# What each verb does with each database: None when it succeeds (reading a read-only
# database, importing into a new one), else the exit code and words of its one error line.
EXPECTED = {
    **{(verb, "missing"): (1, "does not exist") for verb in ("show", "export", "db-check", "db-upgrade")},
    **{(verb, "bad-path"): (1, "does not exist") for verb in ("show", "export", "db-check", "db-upgrade")},
    **{(verb, "read-only"): None for verb in ("show", "export", "db-check", "db-upgrade")},
    **{(verb, "corrupt"): (1, "cannot be opened", "file is not a database") for verb in VERBS},
    **{(verb, "unreachable"): (1, "cannot be opened", "u:***@127.0.0.1") for verb in VERBS},
    ("tune", "read-only"): (1, "cannot be opened for writing", "readonly database"),
    ("import", "read-only"): (1, "cannot be opened for writing", "readonly database"),
    ("tune", "bad-path"): (1, "is not a directory"),
    ("import", "bad-path"): (1, "is not a directory"),
    ("import", "missing"): None,  # importing creates the database
    **{("bench", fault): (2, "CUDA GPU") for fault in FAULTS},  # no GPU here: refused before the database
}


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_against_every_database_fault(verb, fault, tmp_path, sound_database, monkeypatch):
    import torch

    if (verb, fault) == ("tune", "missing"):
        pytest.skip("tune creates a missing database and tunes into it (test_tuner runs that)")
    if verb != "tune":  # tune meets the database before any trial, on a GPU (compiled) or the interpreter
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # bench: the same cell on a GPU machine
    db = _database(fault, tmp_path, sound_database)
    result = CliRunner().invoke(main, [*VERBS[verb](tmp_path, sound_database), "--db", db])
    expected = EXPECTED[verb, fault]
    if expected is None:
        assert result.exit_code == 0, result.output
        assert SECRET not in result.output and "Traceback" not in result.output
    else:
        _one_error(result, *expected)


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _fifo(path: Path) -> str:
    os.mkfifo(path)  # (opening it for reading would wait for a writer: a hang, before the check)
    return str(path)


BAD_PATHS = {  # verb arguments -> exit code and words of the one error line
    "spec-missing": (lambda t: ["generate", "--spec", str(t / "nope.yaml")], 2, "cannot read spec file"),
    "spec-directory": (lambda t: ["generate", "--spec", str(t)], 2, "is a directory"),
    "spec-list": (lambda t: ["generate", "--spec", _write(t / "l.yaml", b"- 1\n- 2\n")], 2,
                  "expected a mapping of fields"),
    "spec-latin1": (lambda t: ["generate", "--spec", _write(t / "l1.yaml", b"name: caf\xe9\n")], 2, "not UTF-8"),
    "spec-alias-bomb": (lambda t: ["generate", "--spec", _write(t / "b.yaml", (
        "mask:\n  and:\n  - &l1 {and: [{causal: true}, {causal: true}]}\n"
        + "".join(f"  - &l{i} {{and: [*l{i - 1}, *l{i - 1}]}}\n" for i in range(2, 26))).encode())], 2,
        "expands to more than"),
    "spec-duplicate-key": (lambda t: ["generate", "--spec", _write(t / "d.yaml", b"name: a\nname: b\n")], 2,
                           "duplicate key 'name'"),
    "output-under-a-file": (lambda t: ["generate", "--spec", str(SMALL_SPEC), "-o",
                                       str(Path(_write(t / "f", b"x")) / "k.py")], 1, "cannot write",
                            "is not a directory"),
    "target": (lambda t: ["generate", "--spec", str(SMALL_SPEC), "--target", "tpu"], 2, "'tpu' is not one of"),
    "tune-spec-missing": (lambda t: ["tune", "--spec", str(t / "nope.yaml"), *INTERPRET], 2, "nope.yaml"),
    "bench-seqlens": (lambda t: ["bench", "--spec", str(SMALL_SPEC), "--seqlens", "1,a"], 2, "comma-separated"),
    # (said once: read_yaml's own error was caught as a NUL byte's, "cannot read: <path>: cannot read: a named ...")
    "spec-fifo": (lambda t: ["generate", "--spec", _fifo(t / "s.yaml")], 2,
                  "cannot read spec file: a named pipe or socket, not a file"),
    "output-over-a-database": (lambda t: ["generate", "--spec", str(SMALL_SPEC), "-o",
                                          _write(t / "tuning.sqlite", b"SQLite format 3\x00" + bytes(100))], 1,
                               "is an SQLite database", "name another file"),
    "tune-trials": (lambda t: ["tune", "--spec", str(SMALL_SPEC), *INTERPRET, "--trials", "100001"], 2,
                    "100001 is not in the range"),
    "import-missing": (lambda t: ["import", str(t / "nope.yaml")], 2, "does not exist"),
    "export-empty-output": (lambda t: ["export", "-o", ""], 2, "'-o'", "got an empty one"),
    "export-empty-gpu": (lambda t: ["export", "--gpu", " "], 2, "'--gpu'", "got an empty one"),
    # each --interpret worker is a CPU process: --gpus 1000 forked hundreds and never finished
    "interpret-workers": (lambda t: ["tune", "--spec", str(SMALL_SPEC), *INTERPRET, "--gpus", "100000"], 2,
                          "--gpus 100000: with --interpret each worker is a CPU process"),
    "import-latin1": (lambda t: ["import", _write(t / "r.yaml", b"gpu: caf\xe9\n"), "--db",
                                 f"sqlite:///{t / 'x.sqlite'}"], 2, "not UTF-8"),
}


@pytest.mark.parametrize("case", BAD_PATHS)
def test_bad_paths_and_options_give_one_line(case, tmp_path):
    args, code, *words = BAD_PATHS[case]
    _one_error(CliRunner().invoke(main, args(tmp_path)), code, *words)


@pytest.mark.parametrize("url, words", [
    ("bogus://x", ["unknown kind of database"]),
    ("/no/such/dir/tuning.sqlite", ["not a database URL", "sqlite:///path/to/tuning.sqlite"]),
])
def test_a_bad_database_from_the_environment_is_named_as_its(monkeypatch, url, words):
    # the URL came from $FLASHGEN_DB, which the error did not say (the user had given no --db)
    monkeypatch.setenv("FLASHGEN_DB", url)
    line = _one_error(CliRunner().invoke(main, ["show"]), 1, f"$FLASHGEN_DB: database {url}: cannot be opened", *words)
    # with --db the option names it, even as the same URL: the variable is not blamed
    assert "$FLASHGEN_DB" not in _one_error(CliRunner().invoke(main, ["show", "--db", url]), 1, *words), line
    # generate --tuned reads it through the loader, whose reason it quotes
    tuned = ["generate", "--spec", str(SMALL_SPEC), "--tuned", "-o", "-"]
    _one_error(CliRunner().invoke(main, tuned), 1, f"on this machine in {url} ($FLASHGEN_DB) or tuning_db", *words)
    # (the loader says an unreadable database's reason once per process: this second read in the process has none)
    assert "$FLASHGEN_DB" not in _one_error(CliRunner().invoke(main, [*tuned, "--db", url]), 1, "no tuned config")


def test_another_database_failing_is_not_blamed_on_the_environment(monkeypatch):
    # a database the command opens of its own (recheck --shipped's scratch one) is not $FLASHGEN_DB's
    from flashgen import cli
    from flashgen.db import DatabaseError

    monkeypatch.setenv("FLASHGEN_DB", "sqlite:////somewhere/tuning.sqlite")
    ctx = cli.main.make_context("flashgen", ["show"])
    said = cli._said(ctx, DatabaseError("sqlite:////tmp/scratch/recheck.sqlite", "cannot be opened: locked"))
    assert said.message == "database sqlite:////tmp/scratch/recheck.sqlite: cannot be opened: locked"
    said = cli._said(ctx, DatabaseError("sqlite:////somewhere/tuning.sqlite", "cannot be opened: locked"))
    assert said.message.startswith("$FLASHGEN_DB: database sqlite:////somewhere/tuning.sqlite")


def test_export_onto_an_unwritable_path(tmp_path, sound_database):
    (tmp_path / "f").write_text("x")
    result = CliRunner().invoke(main, ["export", "--gpu", "triton-interpreter", "-o", str(tmp_path / "f" / "o.yaml"),
                                       "--db", f"sqlite:///{sound_database / 'sound.sqlite'}"])
    _one_error(result, 1, "cannot write", "is not a directory")


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_an_unwritable_folder_is_named_not_the_temporary_file(monkeypatch, tmp_path, relative):
    # the error named the temporary file write_atomic makes beside the output ("(<dir>/.k.py.abc123.tmp)");
    # mkstemp makes that path absolute, so a relative -o needs its folder made absolute to be recognized
    import os

    from flashgen.codegen import cache

    def refused(dir, prefix, suffix):
        raise PermissionError(13, "Permission denied", os.path.join(os.path.abspath(dir), f"{prefix}x1y2z3{suffix}"))

    monkeypatch.setattr(cache.tempfile, "mkstemp", refused)
    monkeypatch.chdir(tmp_path)
    out = "k.py" if relative else str(tmp_path / "k.py")
    line = _one_error(CliRunner().invoke(main, ["generate", "--spec", str(SMALL_SPEC), "--target", "cpu", "-o", out]),
                      1, f"cannot write {out}: Permission denied (the folder {tmp_path})")
    assert ".tmp" not in line


def test_a_refused_replace_of_the_output_blames_neither_folder_nor_temporary_file(monkeypatch, tmp_path):
    # os.replace's error names the temporary file first and the output second: the output is what refused
    from flashgen.codegen import cache

    def refused(src, dst):
        raise PermissionError(1, "Operation not permitted", str(src), None, str(dst))  # (as os.replace sets them)

    monkeypatch.setattr(cache.os, "replace", refused)
    out = tmp_path / "k.py"
    line = _one_error(CliRunner().invoke(main, ["generate", "--spec", str(SMALL_SPEC), "--target", "cpu", "-o",
                                                str(out)]), 1)
    assert line == f"Error: cannot write {out}: Operation not permitted", line


def test_output_through_a_link_or_onto_a_device_keeps_them(tmp_path):
    # -o replaced what it named with a regular file (os.replace of a temporary): a symlink lost its link, and as
    # root /dev/null became a file of Triton source. The link's file is written, a device or pipe written through.
    real = tmp_path / "real.py"
    real.write_text("old")
    (tmp_path / "link.py").symlink_to(real)
    result = CliRunner().invoke(main, ["generate", "--spec", str(SMALL_SPEC), "--target", "cpu",
                                       "-o", str(tmp_path / "link.py")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "link.py").is_symlink() and "def _attn_fwd" in real.read_text()
    device = tmp_path / "null"
    try:
        os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    except (PermissionError, OSError):
        pytest.skip("no permission to make a device node here (the link case ran)")
    result = CliRunner().invoke(main, ["generate", "--spec", str(SMALL_SPEC), "--target", "cpu", "-o", str(device)])
    assert result.exit_code == 0, result.output
    assert stat.S_ISCHR(os.stat(device).st_mode)


def test_a_database_lock_under_optuna_is_one_line(monkeypatch, tmp_path):
    # a lock held past SQLite's timeout mid-tune reached the user as Optuna's StorageInternalError traceback
    import optuna
    from sqlalchemy.exc import OperationalError

    from flashgen.codegen import render

    def locked(*args, **kwargs):
        try:
            raise OperationalError("COMMIT", {}, Exception("database is locked"))
        except OperationalError as err:
            raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from err

    monkeypatch.setattr(render, "render", locked)  # (generate imports it when it runs)
    result = CliRunner().invoke(main, ["generate", "--spec", str(SMALL_SPEC), "--target", "cpu",
                                       "-o", str(tmp_path / "k.py")])
    _one_error(result, 1, "database is locked")


def test_export_never_replaces_the_database(tmp_path, sound_database):
    # `export -o` naming the results database itself: refused, the database intact (it was overwritten by
    # YAML, every stored config and trial gone)
    db = sound_database / "sound.sqlite"
    before = db.read_bytes()
    result = CliRunner().invoke(main, ["export", "--gpu", "triton-interpreter", "-o", str(db), "--db",
                                       f"sqlite:///{db}"])
    _one_error(result, 1, "is an SQLite database")
    assert db.read_bytes() == before


def test_plot_file_is_checked_before_any_tuning(tmp_path, monkeypatch):
    # --plot's format (its suffix) and folder are checked before the tune, not after it
    from flashgen import cli

    class Figure:
        canvas = type("Canvas", (), {"get_supported_filetypes": lambda self: {"png": "PNG", "svg": "SVG"}})()

    monkeypatch.setattr(cli, "_pyplot", lambda: type("Plt", (), {"figure": Figure, "close": lambda fig: None}))
    assert cli._plot_format(tmp_path / "p.SVG") == "svg" and cli._plot_format(tmp_path / "new" / "p") == "png"
    db = tmp_path / "never.sqlite"
    (tmp_path / "ro").mkdir(mode=0o555)
    for plot, words in ((tmp_path / "p.xyz", "expected a file name ending in one of .png, .svg, got"),
                        (tmp_path / "ro" / "p.png", "is not a folder this user can write in")):
        if os.access(tmp_path / "ro", os.W_OK) and "ro" in str(plot):
            continue  # (root writes anywhere)
        result = CliRunner().invoke(main, ["tune", "--spec", str(SMALL_SPEC), *INTERPRET, "--db", f"sqlite:///{db}",
                                           "--plot", str(plot)])
        _one_error(result, 2, words)
        assert not db.exists()  # refused before the database was opened


def test_target_is_case_insensitive_and_auto_detects(tmp_path):
    for target in ("AUTO", "H100"):
        result = CliRunner().invoke(main, ["generate", "--spec", str(SMALL_SPEC), "--target", target,
                                           "-o", str(tmp_path / "k.py")])
        assert result.exit_code == 0, result.output


@pytest.mark.parametrize("args,code", [
    (["show", "--db", "postgresql+psycopg://u:pw@127.0.0.1:1/x"], 1),
    (["generate", "--spec", "{latin1}"], 2),
], ids=["unreachable-db", "latin1-spec"])
def test_no_traceback_reaches_stderr(args, code, tmp_path):
    latin1 = _write(tmp_path / "latin1.yaml", b"name: caf\xe9\n")
    args = [a.replace("{latin1}", latin1) for a in args]
    proc = subprocess.run([sys.executable, "-m", "flashgen", *args], capture_output=True, text=True, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=child_pythonpath(ROOT)))
    assert proc.returncode == code and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("Error: "), proc.stderr
    assert ":pw@" not in proc.stderr


def test_show_says_which_results_serve_this_machine(tmp_path, monkeypatch):
    # A database holding an exact and a near match for this (simulated) H100, and one result
    # from another Triton minor; tuning_db/ entries that serve the machine are listed too.
    from flashgen import AttentionSpec, __version__
    from flashgen.db import EnvInfo, ResultStore
    from flashgen.db import layer as layer_mod
    from flashgen.codegen.render import templates_hash

    h100 = dict(gpu="NVIDIA H100 80GB HBM3", capability="9.0", sm_count=132, memory_gib=79.2, torch="2.13.0",
                triton="3.6.1", cuda="12.8", flashgen=__version__, templates=templates_hash())
    here = EnvInfo(**h100)
    monkeypatch.setattr(EnvInfo, "current", classmethod(lambda cls, interpret=False: here))
    spec = AttentionSpec.from_yaml(SMALL_SPEC)
    store = ResultStore(f"sqlite:///{tmp_path / 'show.sqlite'}")
    cfg = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    store.set_best(here, spec, 64, "fwd", cfg, 1.0, 1.0)
    store.set_best(EnvInfo(**dict(h100, torch="2.11.0", triton="3.6.0")), spec, 128, "fwd", cfg, 1.0, 1.0)
    store.set_best(EnvInfo(**dict(h100, triton="3.7.0")), spec, 256, "fwd", cfg, 1.0, 1.0)
    monkeypatch.setattr(layer_mod, "layer_dir", lambda: tmp_path / "no-layer")
    result = CliRunner().invoke(main, ["show", "--db", store.url], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 3, result.output
    assert "S=64 fwd" in lines[0] and "exact match here;" in lines[0]
    assert "S=128 fwd" in lines[1] and "near match here (tuned with triton 3.6.0, torch 2.11.0);" in lines[1]
    assert "S=256 fwd" in lines[2] and lines[2].endswith("not for this machine")
    layer = tmp_path / "layer"
    layer_mod.export_rows(store.all_best(), layer / "h100.yaml", here.gpu)
    monkeypatch.setattr(layer_mod, "layer_dir", lambda: layer)
    result = CliRunner().invoke(main, ["show", "--db", store.url, "--json"], catch_exceptions=False)
    import json

    rows = [(r["source"], r["bucket"], r["match"]) for r in json.loads(result.output)]
    assert rows == [("database", 64, "exact"), ("database", 128, "near"), ("database", 256, None),
                    ("tuning_db", 64, "exact"), ("tuning_db", 128, "near")]  # shipped: only what serves here


def test_plot_needs_matplotlib_before_any_tuning(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    db = tmp_path / "never.sqlite"
    result = CliRunner().invoke(main, ["tune", "--spec", str(SMALL_SPEC), "--interpret", "--db", f"sqlite:///{db}",
                                       "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 2 and "--plot needs matplotlib" in result.output, result.output
    assert not db.exists()  # refused before the database was opened, let alone a trial run


def test_cmaes_is_not_offered(tmp_path):
    from flashgen import cli, tuner

    assert cli.SAMPLERS == tuner.SAMPLERS and "cmaes" not in cli.SAMPLERS
    result = CliRunner().invoke(main, ["tune", "--spec", str(SMALL_SPEC), "--interpret", "--sampler", "cmaes"])
    assert result.exit_code == 2 and "'cmaes' is not one of" in result.output


def test_the_workers_summary_says_how_it_was_timed(tmp_path, monkeypatch, capsys):
    # `tune --gpus N`'s table: it left out the interpreter's label, the column header and the vs-default column
    from flashgen import AttentionSpec
    from flashgen.cli import _print_stored
    from flashgen.db import EnvInfo, ResultStore

    here = EnvInfo.current(interpret=True)
    monkeypatch.setattr(EnvInfo, "current", classmethod(lambda cls, interpret=False: here))
    store = ResultStore(f"sqlite:///{tmp_path / 'workers.sqlite'}")
    spec = AttentionSpec.from_yaml(SMALL_SPEC)
    store.set_best(here, spec, 64, "fwd", dict(BLOCK_M=16, BLOCK_N=64, num_warps=2, num_stages=1), 1.0, 1.0, 1.5)
    _print_stored(store, [spec], interpret=True)
    lines = capsys.readouterr().out.strip().splitlines()
    assert "(INTERPRETER WALL TIME - not a timing of any GPU)" in lines[0]
    assert lines[1].split()[:6] == ["bucket", "phase", "ms", "TFLOP/s", "vs", "default"]
    assert lines[2].split()[:5] == ["64", "fwd", "1.0000", "1.0", "1.50x"]


def test_generate_tuned_writes_the_stored_config(tmp_path, monkeypatch):
    from flashgen import AttentionSpec
    from flashgen.db import EnvInfo, ResultStore
    from flashgen.db import layer as layer_mod

    here = EnvInfo.current(interpret=True)  # what this process's lookup sees, GPU or not
    monkeypatch.setattr(EnvInfo, "current", classmethod(lambda cls, interpret=False: here))
    monkeypatch.setattr(layer_mod, "layer_dir", lambda: tmp_path / "no-layer")
    store = ResultStore(f"sqlite:///{tmp_path / 'gen.sqlite'}")
    spec = AttentionSpec.from_yaml(SMALL_SPEC)
    store.set_best(here, spec, 64, "fwd", dict(BLOCK_M=16, BLOCK_N=64, num_warps=2, num_stages=1), 1.0, 1.0)
    store.set_best(here, spec, 1024, "fwd", dict(BLOCK_M=128, BLOCK_N=16, num_warps=8, num_stages=3), 1.0, 1.0)
    out = tmp_path / "tuned.py"
    args = ["generate", "--spec", str(SMALL_SPEC), "--tuned", "--db", store.url, "-o", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "'BLOCK_M': 128," in out.read_text() and "'num_warps': 8," in out.read_text()  # the longest bucket
    result = CliRunner().invoke(main, args + ["--seqlen", "50", "--num-stages", "2"])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert "'BLOCK_N': 64," in text and "'num_warps': 2," in text and "'num_stages': 2," in text
    assert "tuned config for S=64 from database" in result.output
    # a malformed stored row is left out and said (it was silent here, said by show, export and flashgen.load)
    import sqlite3

    with sqlite3.connect(tmp_path / "gen.sqlite") as connection:
        connection.execute("UPDATE best_configs SET config = '{\"BLOCK_M\": 48}' WHERE bucket = 1024")
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0 and "skipping 1 malformed tuning result(s)" in result.output, result.output
    assert "'BLOCK_M': 16," in out.read_text()  # the row left
    empty = ["generate", "--spec", str(SMALL_SPEC), "--tuned", "--db", f"sqlite:///{tmp_path / 'none.sqlite'}"]
    _one_error(CliRunner().invoke(main, empty), 1, "no tuned config", "flashgen tune --spec")
    # a database that cannot be read: its reason, not "tune it" (which hid it)
    broken = ["generate", "--spec", str(SMALL_SPEC), "--tuned", "--db", "notaurl"]
    _one_error(CliRunner().invoke(main, broken), 1, "no tuned config", "cannot read tuning results from notaurl",
               "not a database URL")
    _one_error(CliRunner().invoke(main, ["generate", "--spec", str(SMALL_SPEC), "--seqlen", "64"]), 2, "--tuned")


def test_export_writes_to_the_working_directory_by_default(tmp_path, sound_database, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["export", "--db", f"sqlite:///{sound_database / 'sound.sqlite'}", "--gpu",
                                       "triton-interpreter"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "triton-interpreter.yaml").read_text().startswith("# flashgen tuning results")


def test_readme_main_job_runs_in_a_fresh_process(tmp_path):
    # README's main job, as a new user types it: no TRITON_INTERPRET in the environment, so the
    # command itself must switch Triton to its interpreter before Triton is imported (setting it
    # after `import flashgen` left Triton's own library functions compiled: every trial failed).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=child_pythonpath(ROOT), FLASHGEN_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "flashgen", "tune", "--spec", str(SMALL_SPEC), "--interpret",
                           "--trials", "1", "--seqlens", "64", "--db", f"sqlite:///{tmp_path / 'r.sqlite'}"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no config passed" not in proc.stdout and "1.00x" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.interpreter  # tunes in-process with --interpret
def test_tune_no_default_reaches_the_tuner(tmp_path, monkeypatch):
    # `flashgen tune --no-default`: the studies start without the heuristic default enqueued
    import flashgen.tuner

    seen = []
    monkeypatch.setattr(flashgen.tuner, "tune", lambda spec, runner, store, options: seen.append(options) or [])
    url = f"sqlite:///{tmp_path / 'r.sqlite'}"
    for extra, enqueued in (([], True), (["--no-default"], False)):
        result = CliRunner().invoke(main, ["tune", str(ROOT / "examples/specs/mha-hd64.yaml"), "--interpret", "--json",
                                           "--db", url, *extra])
        assert result.exit_code == 0, result.output
        assert seen.pop().enqueue_default is enqueued


def test_tune_refuses_a_nan_timeout():
    # click's FloatRange lets nan through (every comparison with it is false)
    result = CliRunner().invoke(main, ["tune", "--spec", str(ROOT / "examples/specs/small-causal.yaml"), "--interpret",
                                       "--timeout", "nan"])
    assert result.exit_code == 2 and "expected a number of seconds, got nan" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
def test_tune_refuses_an_in_memory_database(url):
    # it tuned, said the results were stored, and they were gone when it exited
    result = CliRunner().invoke(main, ["tune", "--spec", str(SMALL_SPEC), *INTERPRET, "--db", url])
    _one_error(result, 2, "'--db'", "in-memory SQLite database keeps nothing")


@pytest.mark.interpreter
def test_tune_under_triton_interpret_is_an_interpreter_tune(tmp_path):
    # TRITON_INTERPRET=1 without --interpret: the kernels run interpreted whatever the machine, so the tune is
    # the interpreter's (its runner, space and labelled times), stored as the interpreter's results
    spec = tmp_path / "tiny.yaml"
    spec.write_text("name: tiny\ndtype: fp32\nhead_dim: 16\nnum_heads: 1\ntune: {seqlens: [16], trials: 1}\n")
    result = CliRunner().invoke(main, ["tune", "--spec", str(spec), "--db", f"sqlite:///{tmp_path / 'i.sqlite'}"])
    assert result.exit_code == 0, result.output
    assert "INTERPRETER WALL TIME" in result.output and "triton-interpreter" in result.output, result.output


def test_tune_draws_its_search_in_the_plot_format_asked(tmp_path):
    pytest.importorskip("matplotlib")
    spec = tmp_path / "tiny.yaml"
    spec.write_text("name: tiny\ndtype: fp32\nhead_dim: 16\nnum_heads: 1\ntune: {seqlens: [16], trials: 1}\n")
    plot = tmp_path / "plots" / "search.svg"  # a folder made for it, and the format its suffix names
    result = CliRunner().invoke(main, ["tune", "--spec", str(spec), *INTERPRET, "--plot", str(plot),
                                       "--db", f"sqlite:///{tmp_path / 'plot.sqlite'}"])
    assert result.exit_code == 0, result.output
    assert f"wrote {plot}" in result.output
    svg = plot.read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg and "search history" in svg


def test_tune_takes_any_seed_its_option_allows(tmp_path):
    # a seed of 4295 or more overflowed numpy's 32-bit seed in the sampler: a traceback
    spec = tmp_path / "tiny.yaml"
    spec.write_text("name: tiny\ndtype: fp32\nhead_dim: 16\nnum_heads: 1\ntune: {seqlens: [16], trials: 1}\n")
    db = ["--db", f"sqlite:///{tmp_path / 'seed.sqlite'}"]
    result = CliRunner().invoke(main, ["tune", "--spec", str(spec), *INTERPRET, "--seed", str(2**32 - 1), *db])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    _one_error(CliRunner().invoke(main, ["tune", "--spec", str(spec), *INTERPRET, "--seed", "-1", *db]), 2,
               "'--seed'", "-1 is not in the range 0<=x<=4294967295")


def test_generate_refuses_to_write_over_its_spec_and_target_with_tuned(tmp_path):
    # -o naming the spec replaced it with Python source; --target beside --tuned was ignored silently
    spec = tmp_path / "spec.yaml"
    spec.write_text(SMALL_SPEC.read_text())
    _one_error(CliRunner().invoke(main, ["generate", "--spec", str(spec), "-o", str(spec)]), 2, "is the spec file")
    assert spec.read_text() == SMALL_SPEC.read_text()
    _one_error(CliRunner().invoke(main, ["generate", "--spec", str(spec), "--tuned", "--target", "h100"]), 2,
               "--target picks the default config")


def test_empty_db_and_output_are_refused_by_name():
    # --db '' used the default database silently; -o '' said "cannot write : Device or resource busy"
    _one_error(CliRunner().invoke(main, ["show", "--db", ""]), 2, "'--db'", "got an empty one")
    _one_error(CliRunner().invoke(main, ["generate", "--spec", str(SMALL_SPEC), "-o", ""]), 2, "'--output'",
               "got an empty one")


def test_show_on_a_fresh_install_lists_the_shipped_results(tmp_path, monkeypatch):
    # no database yet at the default place: a note, then what tuning_db/ serves here (it was an error that hid
    # them); a database the user names that does not exist stays an error
    from flashgen.db import store as store_mod

    monkeypatch.delenv("FLASHGEN_DB", raising=False)
    monkeypatch.setattr(store_mod, "default_url", lambda: f"sqlite:///{tmp_path / 'fresh.sqlite'}")
    monkeypatch.setattr("flashgen.cli.default_url", lambda: f"sqlite:///{tmp_path / 'fresh.sqlite'}")
    result = CliRunner().invoke(main, ["show"])
    assert result.exit_code == 0, result.output
    assert "no results database yet" in result.output and "flashgen tune" in result.output
    assert not (tmp_path / "fresh.sqlite").exists()
    _one_error(CliRunner().invoke(main, ["show", "--db", f"sqlite:///{tmp_path / 'typo.sqlite'}"]), 1,
               "does not exist")


def test_export_of_a_gpu_without_results_names_the_gpus_there(tmp_path, sound_database):
    from flashgen.db import ResultStore

    result = CliRunner().invoke(main, ["export", "--gpu", "../../x", "-o", str(tmp_path / "x.yaml"), "--db",
                                       f"sqlite:///{sound_database / 'sound.sqlite'}"])
    _one_error(result, 1, "no results for GPU '../../x'", "its GPUs are")
    assert not (tmp_path / "x.yaml").exists()
    empty = f"sqlite:///{tmp_path / 'empty.sqlite'}"  # a database with no results at all: no empty file either
    ResultStore(empty).close()
    result = CliRunner().invoke(main, ["export", "--gpu", "H100", "-o", str(tmp_path / "x.yaml"), "--db", empty])
    _one_error(result, 1, "no results for GPU 'H100'", "it holds none")
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.parametrize("knob", [["--loop-order", "kv_outer"], ["--tma"], ["--no-tma"]])
@pytest.mark.parametrize("head_dim", [96, 128])
def test_generate_with_portable_knobs_starts_from_the_portable_default_on_hopper(tmp_path, knob, head_dim):
    # on an H100 the default forward at these head dims is the Gluon family, whose config takes no loop order or
    # descriptors knob: asked for one, generate writes the portable family's default with it
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: phi\ndtype: bf16\nhead_dim: {head_dim}\nnum_heads: 8\ncausal: true\n")
    out = tmp_path / "phi.py"
    result = CliRunner().invoke(main, ["generate", "--spec", str(spec), "-o", str(out), "--target", "h100", *knob])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert "'family': 'hopper_ws'" not in text and "CONFIG = {" in text
    plain = CliRunner().invoke(main, ["generate", "--spec", str(spec), "-o", str(tmp_path / "g.py"), "--target",
                                      "h100"])
    assert plain.exit_code == 0 and "'family': 'hopper_ws'" in (tmp_path / "g.py").read_text()


def test_ctrl_c_while_the_command_imports_flashgen_exits_130_in_one_line(monkeypatch, capsys):
    # the command's entry point imports the CLI inside main: a Ctrl-C there is the CLI's
    # one line, not Python's traceback of the import; otherwise main is the CLI's
    import builtins

    import flashgen_command

    assert '\nflashgen = "flashgen_command:main"' in (ROOT / "pyproject.toml").read_text()  # (no tomllib in 3.10)
    real_import = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name == "flashgen.cli":
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    assert flashgen_command.main() == 130
    assert capsys.readouterr().err == "interrupted\n"
    monkeypatch.setattr(builtins, "__import__", real_import)
    monkeypatch.setattr(sys, "argv", ["flashgen", "--help"])
    with pytest.raises(SystemExit) as done:
        flashgen_command.main()
    assert done.value.code == 0 and "tune" in capsys.readouterr().out


def test_ctrl_c_in_any_verb_exits_130_in_one_line(tmp_path, monkeypatch):
    # click's own answer was "Aborted!" and exit 1 (a tune interrupted while it loaded its spec, any other verb)
    import flashgen.cli as cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.AttentionSpec, "from_yaml", interrupted)
    result = CliRunner().invoke(main, ["generate", "--spec", str(ROOT / "examples/specs/mha-hd64.yaml")])
    assert result.exit_code == 130, result.output
    assert result.output.strip() == "interrupted"
