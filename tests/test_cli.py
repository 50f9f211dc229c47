"""The command line: help, generate, and a generated module used standalone."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from click.testing import CliRunner

from flashgen.cli import main

from .helpers import child_pythonpath

ROOT = Path(__file__).resolve().parent.parent
ON_GPU = os.environ.get("TRITON_INTERPRET", "0") in ("", "0")  # conftest sets it where there is no GPU


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
    spec = str(ROOT / "examples/specs/gqa-causal.yaml")  # hd128: the H100 default uses TMA + warp specialization
    out = tmp_path / "k.py"
    result = CliRunner().invoke(main, ["generate", "--spec", spec, "--target", "h100", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "'tma': True" in out.read_text() and "'warp_specialize': True" in out.read_text()
    result = CliRunner().invoke(main, ["generate", "--spec", spec, "--target", "h100", "--num-warps", "4",
                                       "--no-tma", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "'tma': False" in out.read_text() and "'warp_specialize': False" in out.read_text()
    result = CliRunner().invoke(main, ["generate", "--spec", spec, "--target", "h100", "--num-warps", "4",
                                       "--warp-specialize"])
    assert result.exit_code != 0 and "warp_specialize': needs num_warps >= 8, got num_warps=4" in result.output


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
