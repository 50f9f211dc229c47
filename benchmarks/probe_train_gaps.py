"""Where a transformers training step's GPU waits for the host: flashgen beside transformers' SDPA.

bench_transformers' Llama (8 layers, hidden 2048, 16 / 4 heads, batch 4 x 2048, bf16) trains a few steps
under torch.profiler (CPU and CUDA activity) with each attention implementation. From the trace:

* the GPU's idle time per step (between the end of one kernel, copy or memset and the start of the next),
  each gap charged to the host code that launched the work ending it: the autograd node on the engine's
  thread (backward), else the outermost operator or record_function on the main thread (``attention``
  around each layer's attention call, ``optimizer``, ``loss``, ``forward``);
* the host time of each attention call (its ``attention`` range) and of each attention backward node;
* the wall clock per step, unprofiled, in alternating rounds, and the host's submit time (until the step's
  Python returns, before the final synchronize).

    PYTHONPATH=. python3 benchmarks/probe_train_gaps.py [--steps 3] [--rounds 2] [--tag=-s27]

Writes <date>-<gpu>-train-gaps<tag>.{json,md} under --out.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def parse_args(argv=None):
    from flashgen.bench import file_tag

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="profiled steps per implementation")
    p.add_argument("--rounds", type=int, default=2, help="unprofiled timing rounds, alternating")
    p.add_argument("--timed-steps", type=int, default=10, help="steps per timing round")
    p.add_argument("--min-gap-us", type=float, default=1.0, help="idle stretches shorter than this are not gaps")
    p.add_argument("--trace-dir", type=Path, default=None, help="keep the chrome traces here")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--tag", default="", type=file_tag)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=2048)
    return p.parse_args(argv)


def stacks(events):
    """{tid: sorted [(ts, end, name)]} of the host's operator and annotation ranges."""
    out = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            out[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
    for ranges in out.values():
        ranges.sort()
    return out


def enclosing(ranges, t):
    """The ranges holding time t, outermost first (ranges sorted by start)."""
    i = bisect.bisect_right(ranges, (t, float("inf"), ""))
    return sorted((r for r in ranges[max(0, i - 400):i] if r[0] <= t <= r[1]), key=lambda r: (r[0], -r[1]))


def charge(names) -> str:
    """The label a gap is charged to, from the host ranges around its launch (outermost first)."""
    for name in names:
        if name.startswith("autograd::engine::evaluate_function: "):
            return "bwd: " + name.split(": ", 1)[1]
    for name in names:
        if name in ("attention", "optimizer", "loss", "forward", "backward_call"):
            inner = [n for n in names if n.startswith("aten::")][:1]
            return name + (f" ({inner[0]})" if name != "attention" and inner else "")
    return names[0] if names else "(no host range)"


def analyse(trace: dict, steps: int, min_gap: float) -> dict:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    host = stacks(events)
    gaps, busy, end = collections.Counter(), 0.0, None
    first = gpu[0]["ts"] if gpu else 0.0
    for e in gpu:
        start, stop = e["ts"], e["ts"] + e.get("dur", 0)
        if end is not None and start - end >= min_gap:
            launch = launches.get(e.get("args", {}).get("correlation"))
            names = [r[2] for r in enclosing(host.get(launch["tid"], []), launch["ts"])] if launch else []
            gaps[charge(names)] += start - end
        busy += max(0.0, stop - max(start, end or start))
        end = stop if end is None else max(end, stop)
    per_step = lambda x: round(x / steps, 1)  # noqa: E731
    attn = [r for ranges in host.values() for r in ranges if r[2] == "attention"]
    nodes = collections.defaultdict(list)
    for ranges in host.values():
        for ts, stop, name in ranges:
            if name.startswith("autograd::engine::evaluate_function: ") and "ttention" in name:
                nodes[name.split(": ", 1)[1]].append(stop - ts)
    return {"gpu_span_us": per_step((end or first) - first), "gpu_busy_us": per_step(busy),
            "gpu_idle_us": per_step(sum(gaps.values())),
            "idle_by_launcher_us": {k: per_step(v) for k, v in gaps.most_common(25)},
            "attention_calls": len(attn) // steps,
            "attention_host_us_median": round(statistics.median([r[1] - r[0] for r in attn]), 1) if attn else None,
            "attention_backward_host_us_median": {k: round(statistics.median(v), 1) for k, v in nodes.items()}}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import transformers
    from torch.profiler import ProfilerActivity, profile, record_function

    import bench_transformers as bt
    from flashgen.bench import environment, gpu_tag
    from flashgen.integrations.transformers import register
    from probes import alternating

    names = {"flashgen": register(), "sdpa": "sdpa"}
    interface = transformers.AttentionInterface._global_mapping
    for name in names.values():  # each layer's attention call in a named host range
        def wrapped(*a, _fn=interface[name], **kw):
            with record_function("attention"):
                return _fn(*a, **kw)
        interface[name] = wrapped
    model_args = bt.parse_args(["--layers", str(args.layers), "--batch", str(args.batch), "--seqlen", str(args.seqlen)])
    model = bt.build_model(model_args, torch, transformers)
    ids = torch.randint(0, model_args.vocab, (args.batch, args.seqlen), generator=torch.Generator().manual_seed(1))
    ids = ids.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    submit = {}

    def step():
        with record_function("forward"):
            out = model(ids, labels=ids)
        with record_function("backward_call"):
            out.loss.backward()
        with record_function("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    def timed(impl):
        model.set_attn_implementation(names[impl])
        model.train(True)
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        start, host = time.perf_counter(), []
        for _ in range(args.timed_steps):
            t = time.perf_counter()
            step()
            host.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        submit.setdefault(impl, []).append(round(statistics.median(host) * 1e3, 2))
        return round((time.perf_counter() - start) / args.timed_steps * 1e3, 2)

    wall = alternating(names, args.rounds, timed)
    result = {"environment": environment(), "config": vars(args) | {"out": str(args.out), "trace_dir": str(args.trace_dir)},
              "rows": []}
    for impl in names:
        model.set_attn_implementation(names[impl])
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        folder = args.trace_dir or Path(tempfile.mkdtemp())
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"trace-{impl}.json"
        prof.export_chrome_trace(str(path))
        row = {"case": f"llama-{args.layers}L-b{args.batch}x{args.seqlen}", "mode": "train_step", "impl": impl,
               "wall_ms_rounds": wall[impl], "host_submit_ms_rounds": submit[impl],
               **analyse(json.loads(path.read_text()), args.steps, args.min_gap_us)}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    fg, sd = (statistics.median(wall[i]) for i in names)
    result["ratio_vs_sdpa"] = round(sd / fg, 3)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{time.strftime('%Y-%m-%d')}-{gpu_tag(result['environment'])}-train-gaps{args.tag}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"Training-step GPU idle by launcher | {result['environment'].get('gpu')} | ratio_vs_sdpa (wall) "
             f"{result['ratio_vs_sdpa']}", ""]
    for row in result["rows"]:
        lines += [f"## {row['impl']}: wall ms {row['wall_ms_rounds']}, host submit ms {row['host_submit_ms_rounds']}, "
                  f"GPU busy {row['gpu_busy_us']} us / idle {row['gpu_idle_us']} us per profiled step, "
                  f"attention host us {row['attention_host_us_median']} x {row['attention_calls']}, "
                  f"backward nodes {row['attention_backward_host_us_median']}", "",
                  "| launcher | idle us per step |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in row["idle_by_launcher_us"].items()] + [""]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
