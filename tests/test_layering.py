"""Data flows one way: the tuner and the pieces it shares with the benchmarks import nothing
from the benchmark, anchor and report code (flashgen/bench.py) or from what comes after them."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "flashgen"


def flashgen_imports(module: str) -> set[str]:
    """The flashgen modules a module imports anywhere in it (functions included), by first name."""
    path = PACKAGE / f"{module}.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from . import x / from .x import y
                found.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
            elif node.level == 0 and (node.module or "").startswith("flashgen."):
                found.add(node.module.split(".")[1])
            elif node.level == 0 and node.module == "flashgen":
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("flashgen."))
    return found


@pytest.mark.parametrize("module, after", [
    ("tuner", {"bench", "cli"}),
    ("inputs", {"bench", "tuner", "cli", "db"}),
    ("flops", {"bench", "tuner", "cli", "db"}),
    ("timing", {"bench", "tuner", "cli", "db"}),
    ("failures", {"bench", "tuner", "cli", "db"}),
    ("verify", {"inputs", "flops", "timing", "bench", "tuner", "cli", "db"}),
])
def test_module_imports_nothing_after_it(module, after):
    assert flashgen_imports(module) & after == set()


def test_only_the_cli_imports_the_benchmarks():
    importers = {p.stem for p in PACKAGE.glob("*.py") if "bench" in flashgen_imports(p.stem)}
    assert importers <= {"cli"}


def test_the_import_parser_sees_imports():
    # the parser itself: it finds the imports these rules are about
    assert {"inputs", "flops", "timing", "failures", "verify", "db"} <= flashgen_imports("tuner")
    assert "bench" in flashgen_imports("cli")
