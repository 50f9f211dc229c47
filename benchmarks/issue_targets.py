"""The open issues' "done when" targets, checked against their benchmarks' results files.

Each job runs one issue's benchmark as its "done when" names it (one device call each: a job fits the device's
600 s per command), then checks. `check` reads the newest results files of one GPU (benchmarks/results/<date>-
<gpu>-<topic>[-<tag>].json, the benchmark's own names; --files names others) and prints, per target, what was measured and whether it is met:
the lines a closing note quotes. Every figure is read from a file a benchmark wrote; a target whose rows are
missing or failed says so (never "met").

    PYTHONPATH=. python3 benchmarks/issue_targets.py run 13-call-path      # on the GPU; then check
    python3 benchmarks/issue_targets.py check --gpu h100 [--issues 13,17] [--results DIR] [--json]

Jobs: 13-call-path (bench_call_path.py --repeat 3), 13-transformers (bench_transformers.py), 17-fp8
(bench_fp8.py), 17-decode (bench_decode.py --fp8), 18-hopper-ws (bench_hopper_ws.py, the standard table).
Not checked here (no benchmark row holds them): issue 13's "bad input names the argument" (tests), issue 17's
accuracy rule and tests (tests/test_fp8*.py), issue 18's tuner choice between families for gqa-causal
(`flashgen tune --recheck --shipped`) and its per-technique ledger (benchmarks/HOPPER_TECHNIQUES.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

JOBS = {  # job -> the benchmark command lines it runs (from the repository root)
    "13-call-path": [["benchmarks/bench_call_path.py", "--repeat", "3"]],
    "13-transformers": [["benchmarks/bench_transformers.py"]],
    "17-fp8": [["benchmarks/bench_fp8.py", "--no-decode"]],
    "17-decode": [["benchmarks/bench_decode.py", "--fp8"]],
    "18-hopper-ws": [["benchmarks/bench_hopper_ws.py", "--budget", "420"]],  # (~6-8 min with Flex: a 420 s budget fits a call)
}


@dataclass
class Result:
    """One target's reading: what was measured (text), and whether it meets the target (None: not measured)."""

    measured: str
    met: bool | None


@dataclass
class Target:
    issue: int
    topic: str  # the results file's topic: <date>-<gpu>-<topic>.json
    text: str  # the target as the issue words it
    check: Callable[[dict], Result]


def _failed(row) -> bool:
    """A row whose measurement failed: bench_call_path records "errors", the others "error"."""
    return bool(row.get("error") or row.get("errors"))


def _rows(data, **match):
    return [r for r in data["rows"] if not _failed(r) and all(r.get(k) == v for k, v in match.items())]


def _short(found, expected, what) -> Result | None:
    """A run cut short (a budget, a timeout): fewer cases than the target covers; None when all are there."""
    return None if found >= expected else Result(f"only {found} of {expected} {what} in the file", None)


def _missing(what) -> Result:
    return Result(f"no row: {what}", None)


def _median(values):
    return statistics.median(values) if values else None


# ----------------------------------------------------------------------------------------- issue 13
def _short_forward_host(data):
    rows = [r for r in _rows(data, mode="forward") if r["case"].startswith("B=1 H=16 S=128 ")]
    host = _median([r["flashgen_host_us"] for r in rows if "flashgen_host_us" in r])
    if host is None:
        return _missing("forward B=1 H=16 S=128 flashgen_host_us")
    sdpa = _median([r["sdpa_flash_host_us"] for r in rows if "sdpa_flash_host_us" in r])
    timed = _median([r["flashgen_gpu_ms"] * 1e3 for r in rows if "flashgen_gpu_ms" in r])
    return Result(f"host {host:.1f} us per call (median of {len(rows)} runs; SDPA flash {sdpa:.1f}); do_bench "
                  f"{timed:.1f} us", host <= 20.0)


def _short_fwd_bwd(seqlen):
    def check(data):
        rows = [r for r in data["rows"] if r.get("mode") == "fwd+bwd" and r["case"].startswith(f"B=1 H=16 S={seqlen} ")]
        if any(_failed(r) for r in rows):
            return Result(f"{sum(map(_failed, rows))} of {len(rows)} runs failed", False)
        ratio = _median([r["flashgen_ratio_vs_sdpa_flash"] for r in rows if "flashgen_ratio_vs_sdpa_flash" in r])
        if ratio is None:
            return _missing(f"fwd+bwd B=1 H=16 S={seqlen} flashgen_ratio_vs_sdpa_flash")
        return Result(f"{1 / ratio:.2f}x SDPA flash's time (ratio {ratio:.3f}, median of {len(rows)} runs)",
                      ratio >= 1 / 1.3)
    return check


def _long_calls(data):
    ratios = {}
    for r in data["rows"]:
        seqlen = int(r["case"].split("S=")[1].split()[0]) if "S=" in r.get("case", "") else 0
        if seqlen >= 1024:
            ratios.setdefault(r.get("mode"), []).append(r.get("flashgen_ratio_vs_sdpa_flash"))
    if not ratios:
        return _missing("S=1024..16384")
    if any(v is None for vals in ratios.values() for v in vals):
        return Result("a row without flashgen_ratio_vs_sdpa_flash (failed)", False)
    text = "; ".join(f"{mode} {min(v):.2f}-{max(v):.2f}x SDPA flash" for mode, v in sorted(ratios.items()))
    # "unchanged or better" is against the table before the issue's work, which no results file here holds
    return Result(text + " (compare with the issue's before-table by hand)", None)


def _compile_check(data):
    check = data.get("compile_check")
    if not check or "ok" not in check or check.get("skipped"):
        return _missing("compile_check (skipped or not run)")
    return Result(f"ok={check.get('ok')}, max diff vs eager {check.get('max_diff_vs_eager')}", bool(check.get("ok")))


def _transformers(mode, label):
    def check(data):
        rows = _rows(data, mode=mode)
        if not rows:
            return _missing(mode)
        ratio = rows[0]["ratio_vs_sdpa"]
        rounds = rows[0].get("ratio_per_round")  # (generate: alternating rounds, whose spread the total hides)
        spread = (f"; per round {min(rounds):.3f}-{max(rounds):.3f}, median {statistics.median(rounds):.3f}"
                  if rounds else "")
        return Result(f"{label} {ratio:.3f}x SDPA ({rows[0]['flashgen_ms']} vs {rows[0]['sdpa_ms']} ms{spread})",
                      ratio >= 1.0)
    return check


def _compiled_model(data):
    rows = _rows(data, mode="compile_train_step")
    if not rows:
        return _missing("compile_train_step (the whole model, fullgraph=True)")
    return Result(f"compiled ({rows[0].get('backend')}, fullgraph): {rows[0]['ratio_vs_sdpa']:.3f}x SDPA's compiled "
                  "step", True)


# ----------------------------------------------------------------------------------------- issue 17
def _fp8_vs_bf16(data):
    rows = [r for r in _rows(data, mode="fwd") if r.get("head_dim") == 128]
    if not rows:
        return _missing("hd128 fwd")
    low = min(rows, key=lambda r: r["ratio_vs_bf16"])
    text = ", ".join(f"{r['case']} {r['ratio_vs_bf16']:.2f}" for r in rows)
    if low["ratio_vs_bf16"] < 1.5:  # (a miss is one whichever cases are missing)
        return Result(f"{text} (lowest: {low['case']})", False)
    return _short(len(rows), 4, "hd128 cases") or Result(text, True)


def _fp8_vs_cudnn(data):
    rows = _rows(data, mode="fwd")
    fp8 = [r for r in rows if r.get("cudnn_anchor") == "cudnn_fp8"]
    if not fp8:
        bf16 = [r["ratio_vs_cudnn"] for r in rows if "ratio_vs_cudnn" in r]
        return Result("torch exposes no FP8 cuDNN SDPA here: beside cuDNN bf16 "
                      + (f"{min(bf16):.2f}-{max(bf16):.2f}x" if bf16 else "(no rows)"), None)
    low = min(r["ratio_vs_cudnn"] for r in fp8)
    return Result(f"lowest {low:.2f}x cuDNN FP8 over {len(fp8)} rows", low >= 0.85)


def _fp8_decode(data):
    rows = [r for r in data["rows"] if "tbps_ratio_vs_bf16" in r]
    if not rows:
        return _missing("tbps_ratio_vs_bf16")
    failed = [f"{r['case']} {r.get('mode', '')}" for r in rows if r["tbps_ratio_vs_bf16"] is None or _failed(r)]
    if failed:
        return Result(f"failed: {', '.join(failed)}", False)
    text = ", ".join(f"{r['case']} {r.get('mode', '')} {r['tbps_ratio_vs_bf16']:.2f}" for r in rows)
    if min(r["tbps_ratio_vs_bf16"] for r in rows) < 1.0:
        return Result(text, False)
    return _short(len(rows), 4, "decode cases") or Result(text, True)


# ----------------------------------------------------------------------------------------- issue 18
def _vs_cudnn(mode, floor):
    def check(data):
        rows = _rows(data, mode=mode)
        ratios = [(r["case"], (r.get("ratio_vs_cudnn") or {}).get("flashgen")) for r in rows]
        if not ratios:
            return _missing(mode)
        if any(v is None for _, v in ratios) or any(_failed(r) for r in data["rows"] if r.get("mode") == mode):
            return Result("a case without flashgen's ratio_vs_cudnn (failed)", False)
        below = [f"{case} {v:.3f}" for case, v in ratios if v < floor]
        values = [v for _, v in ratios]
        text = (f"{min(values):.3f}-{max(values):.3f}x cuDNN over {len(ratios)} cases"
                + (f"; below {floor}: {', '.join(below)}" if below else ""))
        if below:
            return Result(text, False)
        return _short(len(ratios), 12, "cases of the standard table") or Result(text, True)
    return check


def _hd128_peak(data):
    rows = [r for r in _rows(data, mode="fwd", head_dim=128, seqlen=16384) if not r.get("causal")]
    if not rows or "tflops" not in rows[0].get("flashgen", {}):
        return _missing("fwd hd128 S=16384 non-causal")
    tflops = rows[0]["flashgen"]["tflops"]
    return Result(f"{tflops:.0f} TFLOP/s", tflops >= 620)


TARGETS = [
    Target(13, "call-path", "forward B=1 H=16 S=128 hd128 causal <= 20 us per call", _short_forward_host),
    Target(13, "call-path", "fwd+bwd <= 1.3x SDPA flash's time at S=128", _short_fwd_bwd(128)),
    Target(13, "call-path", "fwd+bwd <= 1.3x SDPA flash's time at S=512", _short_fwd_bwd(512)),
    Target(13, "call-path", "S=1024..16384 unchanged or better", _long_calls),
    Target(13, "call-path", "torch.compile(fullgraph=True) forward and backward (inductor)", _compile_check),
    Target(13, "call-path-transformers", "Llama training step >= 1.0x SDPA", _transformers("train_step", "train step")),
    Target(13, "call-path-transformers", "Llama greedy generation >= 1.0x SDPA", _transformers("generate", "generate")),
    Target(13, "call-path-transformers", "the whole model compiles with fullgraph=True", _compiled_model),
    Target(17, "fp8", "FP8 forward >= 1.5x flashgen's own bf16 at hd128 (S 4096, 16384, causal and not)",
           _fp8_vs_bf16),
    Target(17, "fp8", "FP8 forward >= 0.85x cuDNN's FP8 SDPA where torch exposes it", _fp8_vs_cudnn),
    Target(17, "decode-fp8", "FP8-cache decode bytes/s >= the bf16 cache's", _fp8_decode),
    Target(18, "hopper-ws", "forward >= 0.95x cuDNN on every case of the standard table", _vs_cudnn("fwd", 0.95)),
    Target(18, "hopper-ws", "forward >= 620 TFLOP/s at hd128 S=16384 non-causal", _hd128_peak),
    Target(18, "hopper-ws", "fwd+bwd >= 0.90x cuDNN on the same cases", _vs_cudnn("fwd_bwd", 0.90)),
]


def topic_of(path: Path, gpu: str) -> str | None:
    """The topic of a results file named <date>-<gpu>-<topic>[-<tag>].json, the tag one word of letters and digits
    (a session's run: -s60), or None: other benchmarks' files share a topic's first words (call-path-sdpa-s52,
    fp8-keys-permuted-s52) and their rows are not the topic's."""
    match = re.fullmatch(rf"\d{{4}}-\d\d-\d\d-{re.escape(gpu)}-(.+)\.json", path.name)
    if match is None:
        return None
    topics, name = {t.topic for t in TARGETS}, match.group(1)
    if name in topics:  # untagged (first: call-path-transformers is not call-path tagged -transformers)
        return name
    topic, _, tag = name.rpartition("-")
    return topic if topic in topics and re.fullmatch(r"[A-Za-z0-9]+", tag) else None


def newest(results: Path, gpu: str, topic: str) -> Path | None:
    """The results file of `topic` for `gpu` with the latest date in its name, <date>-<gpu>-<topic>[-<tag>].json;
    of one date, the untagged one (what a benchmark writes by default), else the last tag by name."""
    found = [p for p in results.glob(f"*-{gpu}-{topic}*.json") if topic_of(p, gpu) == topic]
    return max(found, key=lambda p: (p.name[:10], p.name.endswith(f"-{topic}.json"), p.name), default=None)


def check(results: Path, gpu: str, issues: set[int], files=()) -> list[dict]:
    """Every target of `issues` read from the newest results file of its topic for `gpu`, or from the one of
    `files` of that topic (a tagged run's)."""
    chosen = {}
    for path in map(Path, files):
        topic = topic_of(path, gpu)
        if topic is None:
            raise SystemExit(f"--files: {path.name} is not named <date>-{gpu}-<topic>[-tag].json with a topic of "
                             f"{', '.join(sorted({t.topic for t in TARGETS}))}")
        chosen[topic] = path
    out = []
    for target in (t for t in TARGETS if t.issue in issues):
        path = chosen.get(target.topic) or newest(results, gpu, target.topic)
        if path is None:
            result = Result(f"no {gpu} results file for {target.topic}", None)
        else:
            try:
                result = target.check(json.loads(path.read_text()))
            except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as err:
                result = Result(f"unreadable: {type(err).__name__}: {err}", None)
        out.append({"issue": target.issue, "target": target.text, "measured": result.measured,
                    "met": result.met, "file": path.name if path else None})
    return out


def table(readings: list[dict]) -> str:
    lines = ["| issue | target | measured | met | file |", "|---|---|---|---|---|"]
    for r in readings:
        met = {True: "yes", False: "**no**", None: "not measured"}[r["met"]]
        lines.append(f"| {r['issue']} | {r['target']} | {r['measured']} | {met} | {r['file'] or '-'} |")
    return "\n".join(lines)


def gpu_name() -> str:
    """The results files' GPU tag for this machine's first GPU (flashgen.bench's naming)."""
    import torch

    from flashgen.bench import environment, gpu_tag

    if not torch.cuda.is_available():
        raise SystemExit("run: needs a CUDA GPU (use `check --gpu NAME` to read results elsewhere)")
    return gpu_tag(environment())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job's benchmark on this GPU, then check its issue")
    run.add_argument("job", choices=sorted(JOBS))
    chk = sub.add_parser("check", help="check the newest results files of one GPU")
    chk.add_argument("--gpu", required=True, help="the results files' GPU tag (h100, h200, ...)")
    chk.add_argument("--issues", default="13,17,18", help="comma-separated issue numbers")
    chk.add_argument("--files", nargs="*", default=(), type=Path,
                     help="results files to read instead of each topic's newest one (newest date, untagged first)")
    for p in (run, chk):
        p.add_argument("--results", type=Path, default=RESULTS, help="the results folder")
        p.add_argument("--json", action="store_true", help="print the readings as JSON")
    args = parser.parse_args(argv)
    if args.command == "run":
        gpu = gpu_name()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        for line in JOBS[args.job]:
            extra = ["--out", str(args.results)]
            print("$", " ".join(["python3", *line, *extra]), flush=True)
            subprocess.run([sys.executable, *line, *extra], cwd=ROOT, env=env, check=True)
        issues = {int(args.job.split("-")[0])}
    else:
        gpu = args.gpu
        try:
            issues = {int(n) for n in args.issues.split(",")}
        except ValueError:
            parser.error(f"--issues: expected comma-separated issue numbers, got {args.issues!r}")
    readings = check(args.results, gpu, issues, getattr(args, "files", ()))
    print(json.dumps(readings, indent=1) if args.json else table(readings))


if __name__ == "__main__":
    main()
