"""tuning_db/: tuned results shipped with flashgen, read-only, below the user's database.

``flashgen export`` writes one YAML file per GPU (sorted, one result per entry, so it
diffs well); flashgen reads every file there and uses an entry only when its environment
(GPU, torch, triton, CUDA, flashgen and templates) is exactly the current one.
``flashgen import`` loads such a file into a database.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from .models import SCHEMA_VERSION


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


def export_rows(rows: list[dict], path: Path, gpu: str) -> int:
    entries = sorted((r for r in rows if r["environment"]["gpu"] == gpu),
                     key=lambda r: (r["spec_uri"], r["bucket"], r["phase"]))
    doc = {"schema": SCHEMA_VERSION, "gpu": gpu, "results": [
        {"spec": r["spec_uri"], "spec_key": r["spec_key"], "bucket": r["bucket"], "phase": r["phase"],
         "config": r["config"], "ms": _sig(r["ms"]), "tflops": _sig(r["tflops"]), "default_ms": _sig(r["default_ms"]),
         "environment": r["environment"], "canonical": r["spec"]} for r in entries]}
    header = (f"# flashgen tuning results for {gpu}: written by `flashgen export`, loaded read-only\n"
              f"# below each user's database. Regenerate rather than edit.\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.dump(doc, Dumper=_PlainDumper, sort_keys=False, width=120))
    return len(entries)


def _sig(x: float | None) -> float | None:
    """Six significant digits: enough for any timing, short enough to diff well."""
    return None if x is None else float(f"{x:.6g}")


def read_file(path: Path) -> list[dict]:
    """Rows of one exported file, in the store's row format."""
    doc = yaml.safe_load(Path(path).read_text()) or {}
    if doc.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema {doc.get('schema')!r}, this flashgen reads {SCHEMA_VERSION}")
    return [dict(environment=e["environment"], spec_key=e["spec_key"], spec_uri=e["spec"], spec=e["canonical"],
                 bucket=e["bucket"], phase=e["phase"], config=e["config"], ms=e["ms"], tflops=e["tflops"],
                 default_ms=e.get("default_ms")) for e in doc.get("results", [])]


def shipped_best(spec_key: str, env: dict) -> dict[int, dict[str, dict]]:
    """{bucket: {phase: row}} from tuning_db/ for this spec in exactly this environment."""
    out: dict[int, dict[str, dict]] = {}
    for path in sorted(layer_dir().glob("*.yaml")):
        for row in read_file(path):
            if row["spec_key"] == spec_key and row["environment"] == env:
                out.setdefault(row["bucket"], {})[row["phase"]] = row
    return out
