"""tuning_db/: tuned results shipped with flashgen, read-only, below the user's database.

``flashgen export`` writes one YAML file per GPU (sorted, one result per entry, so it
diffs well); flashgen reads every file there and uses an entry whose environment serves the
current one (flashgen.db.env: the same GPU model and Triton major.minor, and the kernels
this flashgen renders for the entry's spec and config, named by the entry's ``kernel`` hash;
an entry without one, from an older flashgen, needs the same templates hash; an exact
match preferred, a near match used and labelled). ``default_kernel`` names the default the
entry was measured against (flashgen.db.kernels.default_kernel); flashgen.load never serves an
entry whose recorded default is no longer this flashgen's default for its bucket and phase.
``flashgen import`` loads such a file into a database.

Every entry is checked (flashgen.db.rows) when a file is read: a file with a malformed
entry is refused whole, naming the entry, and while loading kernels an unreadable file is
skipped on its own (the other files still count).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import yaml

from ..spec import YamlFileError, read_yaml
from .env import EnvInfo, pick
from .kernels import row_kernel
from .rows import ResultRowError, check_row

FILE_FORMAT = 1  # the files' own format version, apart from the database schema
MAX_FILE_BYTES = 64 << 20
MAX_FILE_VALUES = 5_000_000  # values after alias expansion; an entry holds about 50


class ResultFileError(ValueError):
    """A tuning results file cannot be read or holds a malformed entry (one line, naming the file)."""

    def __init__(self, path, problem: str):
        self.path, self.problem = str(path), problem
        super().__init__(f"{path}: {problem}")


def layer_dir() -> Path:
    """tuning_db/ inside the wheel (flashgen/tuning_db) or at the top of a source tree."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "tuning_db", here.parent / "tuning_db"):
        if candidate.is_dir():
            return candidate
    return here.parent / "tuning_db"


def gpu_slug(gpu: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "unknown"


class _PlainDumper(yaml.SafeDumper):
    """Writes repeated values out in full (no &anchors / *aliases): each entry reads alone."""

    def ignore_aliases(self, data):
        return True


def export_text(rows: list[dict], gpu: str) -> tuple[str, int]:
    """(the file's text, the number of results) for one GPU's rows."""
    entries = sorted((r for r in rows if r["environment"]["gpu"] == gpu),
                     key=lambda r: (r["spec_uri"], r["bucket"], r["phase"]))
    doc = {"schema": FILE_FORMAT, "gpu": gpu, "results": [
        {"spec": r["spec_uri"], "spec_key": r["spec_key"], "bucket": r["bucket"], "phase": r["phase"],
         "config": r["config"], "ms": _sig(r["ms"]), "tflops": _sig(r["tflops"]), "default_ms": _sig(r["default_ms"]),
         "kernel": r.get("kernel"), "default_kernel": r.get("default_kernel"), "environment": r["environment"], "canonical": r["spec"]} for r in entries]}
    header = (f"# flashgen tuning results for {gpu}: written by `flashgen export`, loaded read-only\n"
              f"# below each user's database. Regenerate rather than edit.\n")
    return header + yaml.dump(doc, Dumper=_PlainDumper, sort_keys=False, width=120), len(entries)


def export_rows(rows: list[dict], path: Path, gpu: str) -> int:
    text, n = export_text(rows, gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return n


def _sig(x: float | None) -> float | None:
    """Six significant digits: enough for any timing, short enough to diff well."""
    return None if x is None else float(f"{x:.6g}")


_ENTRY_KEYS = ("spec", "spec_key", "bucket", "phase", "config", "ms", "tflops", "environment", "canonical")
_OPTIONAL_KEYS = ("default_ms", "kernel", "default_kernel")


def read_file(path: Path, skipped: list[str] | None = None) -> list[dict]:
    """Rows of one exported file, in the store's row format; ResultFileError when the file or
    any entry in it is malformed, or, given a list `skipped`, a malformed entry is left out and
    said there (what a reader of the shipped layer wants: one bad entry costs only itself)."""
    try:
        doc = read_yaml(path, max_bytes=MAX_FILE_BYTES, max_values=MAX_FILE_VALUES)
    except YamlFileError as err:
        raise ResultFileError(path, err.problem) from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ResultFileError(path, "expected a mapping with keys schema, gpu, results")
    unknown = sorted(set(doc) - {"schema", "gpu", "results"}, key=str)
    if unknown:
        raise ResultFileError(path, f"unknown field {unknown[0]!r} (a file has schema, gpu, results)")
    if doc.get("schema") != FILE_FORMAT:
        raise ResultFileError(path, f"schema {doc.get('schema')!r}, this flashgen reads {FILE_FORMAT}")
    entries = doc.get("results") or []
    if not isinstance(entries, list):
        raise ResultFileError(path, "field 'results': expected a list of entries")
    rows = []
    for i, e in enumerate(entries):
        where = f"results entry {i}"
        problem = row = None
        if not isinstance(e, dict) or any(k not in e for k in _ENTRY_KEYS):
            problem = f"{where}: expected a mapping with keys {', '.join(_ENTRY_KEYS)}"
        elif unknown := sorted(set(e) - set(_ENTRY_KEYS) - set(_OPTIONAL_KEYS), key=str):
            problem = f"{where}: unknown field {unknown[0]!r}"
        else:
            row = dict(environment=e["environment"], spec_key=e["spec_key"], spec_uri=e["spec"], spec=e["canonical"],
                       bucket=e["bucket"], phase=e["phase"], config=e["config"], ms=e["ms"], tflops=e["tflops"],
                       default_ms=e.get("default_ms"), kernel=e.get("kernel"),
                       default_kernel=e.get("default_kernel"))
            try:
                check_row(row)
            except ResultRowError as err:
                problem = f"{where} ({e.get('spec')}): {err}"
        if problem is None:
            rows.append(row)
        elif skipped is not None:
            skipped.append(problem)
        else:
            raise ResultFileError(path, problem)
    return rows


def shipped_rows(spec_key: str, on_bad_file: Callable[[Path, ResultFileError], None] | None = None,
                 on_bad_entries: Callable[[Path, list[str]], None] | None = None) -> list[dict]:
    """Every row of tuning_db/ for this spec, from every file that can be read (a file that
    cannot is skipped, and passed to on_bad_file; a malformed entry is skipped alone, and a
    file's list of them passed to on_bad_entries)."""
    rows = []
    for path in sorted(layer_dir().glob("*.yaml")):
        skipped = []
        try:
            rows += [row for row in read_file(path, skipped) if row["spec_key"] == spec_key]
        except ResultFileError as err:
            if on_bad_file is not None:
                on_bad_file(path, err)
        if skipped and on_bad_entries is not None:
            on_bad_entries(path, skipped)
    return rows


def shipped_best(spec_key: str, here: EnvInfo,
                 on_bad_file: Callable[[Path, ResultFileError], None] | None = None,
                 current: Callable[[dict], str | None] | None = None) -> dict[int, dict[str, dict]]:
    """{bucket: {phase: row}} from tuning_db/ for this spec: per bucket and phase the row that
    serves ``here`` (an exact match preferred, else the nearest near match; flashgen.db.env),
    each with its 'match'. ``current(row)``: the hash of the kernels this flashgen renders for
    a row (default: flashgen.db.kernels.row_kernel, from the row's canonical spec)."""
    return pick(here, shipped_rows(spec_key, on_bad_file), current or row_kernel)
