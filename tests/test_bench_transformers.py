"""benchmarks/bench_transformers.py on the CPU (--tiny --device cpu): every part runs or records
its error, and the JSON rows and the table have the fields the GPU run is read by."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_transformers", ROOT / "benchmarks" / "bench_transformers.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

MODES = ["prefill", "train_step", "generate", "generate (through flashgen.attention)", "generate (static cache)",
         "compile_train_step"]


@pytest.mark.slow
@pytest.mark.interpreter
def test_tiny_cpu_run_writes_every_row(tmp_path):
    assert bench.main(["--tiny", "--device", "cpu", "--out", str(tmp_path), "--warmup", "0", "--steps", "1",
                       "--seqlen", "12", "--prompt", "4", "--new-tokens", "2"]) == 0
    (path,) = tmp_path.glob("*-cpu-call-path-transformers-tiny.json")
    result = json.loads(path.read_text())
    assert result["environment"]["transformers"] and result["config"]["layers"] == 2
    rows = {row["mode"]: row for row in result["rows"]}
    assert list(rows) == MODES
    for mode in MODES[:5]:  # these run both ways on the CPU
        row = rows[mode]
        assert "error" not in row, row
        assert row["flashgen_ms"] > 0 and row["sdpa_ms"] > 0
        assert row["ratio_vs_sdpa"] == round(row["sdpa_ms"] / row["flashgen_ms"], 3)
    assert rows["prefill"]["max_abs_logit_diff_vs_sdpa"] < 1e-4
    assert rows["generate"]["same_tokens_fraction"] == rows["generate (static cache)"]["same_tokens_fraction"] == 1.0
    compiled = rows["compile_train_step"]  # compiles, or says why not
    assert compiled["sdpa_ms"] > 0 and (compiled["flashgen_ms"] or compiled["error"]["flashgen"])
    table = path.with_suffix(".md").read_text()
    assert "| case | mode | flashgen ms | sdpa ms | ratio vs sdpa | notes |" in table and table.count("| llama-") == 6


def test_a_failing_part_is_recorded_and_the_run_goes_on():
    def measure(impl):
        if impl == "flashgen":
            raise RuntimeError("out of memory, say")
        return 2.0

    rows = []
    row = bench.run_mode(rows, "case", "train_step", measure)
    assert rows == [row] and row["sdpa_ms"] == 2.0 and row["flashgen_ms"] is None and row["ratio_vs_sdpa"] is None
    assert row["error"] == {"flashgen": "RuntimeError: out of memory, say"}
    assert "RuntimeError: out of memory, say" in bench.markdown({"environment": {"torch": "t", "triton": "t",
                                                                         "transformers": "t", "flashgen": "f"},
                                                                 "rows": rows})


def test_alternating_rounds_swap_the_order_and_keep_every_ratio():
    calls, times = [], {"sdpa": iter([9.0, 10.0, 12.0, 11.0, 10.0]), "flashgen": iter([9.0, 8.0, 12.0, 10.0, 11.0])}

    def once(impl):
        calls.append(impl)
        return next(times[impl])

    rows = []
    row = bench.run_alternating(rows, "case", "generate", once, 4)
    assert calls == ["sdpa", "flashgen"] + ["sdpa", "flashgen", "flashgen", "sdpa"] * 2  # untimed first runs
    assert rows == [row] and (row["sdpa_ms"], row["flashgen_ms"]) == (10.5, 10.5)  # medians of the timed runs
    assert row["ratio_vs_sdpa"] == 1.0  # (the medians'), beside each round's own
    assert row["ratio_per_round"] == [1.25, 1.0, 1.1, 0.909] and row["ratio_per_round_median"] == 1.05

    def failing(impl):
        if impl == "flashgen" and calls.count("flashgen") > 2:
            raise RuntimeError("out of memory, say")
        calls.append(impl)
        return 1.0

    calls.clear()
    row = bench.run_alternating(rows, "case", "generate", failing, 4)
    assert row["error"] == {"flashgen": "RuntimeError: out of memory, say"} and row["ratio_vs_sdpa"] is None
    assert row["flashgen_ms"] is None and row["sdpa_ms"] is None and "ratio_per_round" not in row and len(rows) == 2
    with pytest.raises(SystemExit):  # no round: refused by name
        bench.parse_args(["--generate-runs", "0"])


def test_gpu_names_become_short_file_names():
    assert bench.gpu_slug({"gpu": "NVIDIA H100 80GB HBM3"}, "cuda") == "h100"
    assert bench.gpu_slug({"gpu": "NVIDIA H200"}, "cuda") == "h200"
    assert bench.gpu_slug({"gpu": "Some New GPU"}, "cuda") == "some-new-gpu"
    assert bench.gpu_slug({}, "cpu") == "cpu"


def test_tag_names_files_with_or_without_its_dash():
    # every benchmark's --tag goes through flashgen.bench.file_tag: `--tag v2` and `--tag=-v2` name the same files
    # (argparse reads `--tag -v2` as an option, so the bare form is the one a user types)
    from flashgen.bench import file_tag

    assert bench.parse_args(["--tag", "v2"]).tag == bench.parse_args(["--tag=-v2"]).tag == "-v2"
    assert bench.parse_args([]).tag == "" and file_tag("") == ""
    benchmarks = sorted((ROOT / "benchmarks").glob("*.py"))
    tagged = [p.name for p in benchmarks if '"--tag"' in p.read_text()]
    assert tagged and all("type=file_tag" in (ROOT / "benchmarks" / name).read_text() for name in tagged), tagged


def test_a_cpu_run_in_a_compiled_process_is_refused(monkeypatch):
    # --device cpu needs the interpreter from the process's start: one that imported Triton compiled (a GPU
    # machine's test process) is refused by name, not switched to the interpreter half way (which left every
    # kernel module imported afterwards interpreted beside compiled helpers)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SystemExit, match="--device cpu: set TRITON_INTERPRET=1"):
        bench.benchmark(bench.parse_args(["--tiny", "--device", "cpu"]))
    assert bench.os.environ["TRITON_INTERPRET"] == "0"


def test_gemma3_model_and_its_flags():
    import torch
    import transformers

    args = bench.parse_args(["--tiny", "--device", "cpu", "--model", "gemma3", "--head-dim", "16", "--sliding-window",
                             "5", "--layers", "6"])
    model = bench.build_model(args, torch, transformers)
    assert isinstance(model, transformers.Gemma3ForCausalLM)
    assert (model.config.head_dim, model.config.sliding_window, model.config.query_pre_attn_scalar) == (16, 5, 16)
    assert model.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]  # Gemma 3's five to one
    with pytest.raises(SystemExit):  # gemma3's flags on the Llama: an argparse error naming them
        bench.parse_args(["--sliding-window", "5"])
