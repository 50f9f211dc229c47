"""`flashgen bench` on a real GPU: every anchor runs and is checked against flashgen's output."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashgen.cli import main

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent


def test_bench_cli_on_gpu(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: b\ndtype: bf16\nhead_dim: 64\nnum_heads: 8\nnum_kv_heads: 2\ncausal: true\n"
                    "backward: true\n")
    result = CliRunner().invoke(main, ["bench", "--spec", str(spec), "--seqlens", "1024", "--tokens", "8192",
                                       "--out", str(tmp_path / "out"), "--db", f"sqlite:///{tmp_path / 'x.sqlite'}"])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    modes = {r["mode"]: r for r in doc["rows"]}
    assert set(modes) == {"fwd", "fwd_bwd"}
    for row in modes.values():
        assert row["flashgen"]["tflops"] > 10
        assert "tflops" in row["sdpa_flash"] and "tflops" in row["flex"], row  # GQA anchors ran and agreed
