"""The wheel ships every package, the Jinja templates with their nested partials and the host
module, and flashgen finds and uses them there."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from flashgen.codegen import render

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_templates_and_finds_them(tmp_path):
    pytest.importorskip("setuptools")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("flashgen-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    templates = sorted(p.relative_to(ROOT / "templates").as_posix() for p in (ROOT / "templates").rglob("*.j2"))
    assert any("/" in t for t in templates), "no nested partial to check"
    missing = [t for t in templates if f"flashgen/templates/{t}" not in names]
    assert not missing, missing
    assert "flashgen/runtime/host.py" in names
    assert "flashgen_command.py" in names  # the command's entry point, beside the package
    # every package of the source tree (a folder with __init__.py) is in the wheel
    packages = sorted(p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "flashgen").rglob("__init__.py"))
    missing = [p for p in packages if f"{p}/__init__.py" not in names]
    assert not missing, f"packages missing from the wheel (add them to pyproject.toml): {missing}"
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # From the unpacked wheel (no source tree on the path), rendering and building work, and the
    # templates hash is the source tree's (it hashes relative paths and contents only).
    code = ("import flashgen, flashgen.codegen.render as r; print(r.template_dir()); print(r.templates_hash()); "
            "m = r.build_module(flashgen.AttentionSpec(name='wheel'), flashgen.KernelConfig()); "
            "print(m.__file__); print(len(r.render(flashgen.AttentionSpec(), flashgen.KernelConfig())))")
    # The unpacked wheel first; keep other entries (dependencies) but never the source tree.
    others = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
              if p and Path(p).resolve() != ROOT]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *others]), FLASHGEN_CACHE_DIR=str(tmp_path / "c"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == str(site / "flashgen" / "templates")
    assert lines[1] == render.templates_hash()
    assert Path(lines[2]).is_relative_to(tmp_path / "c")
