"""The wheel ships the Jinja templates as package data, and flashgen finds them there."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_templates_and_finds_them(tmp_path):
    pytest.importorskip("setuptools")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("flashgen-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    templates = sorted(p.name for p in (ROOT / "templates").glob("*.j2"))
    assert templates and all(f"flashgen/templates/{t}" in names for t in templates)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # From the unpacked wheel (no source tree on the path), rendering works.
    code = ("import flashgen.render as r, flashgen; "
            "print(r.template_dir()); print(len(r.render(flashgen.AttentionSpec(), flashgen.KernelConfig())))")
    # The unpacked wheel first; keep other entries (dependencies) but never the source tree.
    others = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
              if p and Path(p).resolve() != ROOT]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *others]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0] == str(site / "flashgen" / "templates")
