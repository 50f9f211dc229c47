"""What the one-question probes (probe_document_predicate.py, probe_masked_loop_stages.py,
probe_varlen_check.py, probe_padded_training.py) share: GPU time of a call replayed from a CUDA graph,
a training step's wall-clock time, rounds in alternating order, and the run: parse the common
arguments, take each case in turn, keep every finished row in <date>-<gpu>-<topic><tag>.{json,md}
(a run cut short keeps them)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable

from flashgen.bench import environment, file_tag, gpu_tag


def graph_ms(fn) -> float:
    """fn's kernels alone: a CUDA graph of repeated calls replayed, median ms per call."""
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median"))


def interleaved_ms(calls: dict, rounds: int, timer=graph_ms) -> dict:
    """{label: {"fwd": [ms per round], "bwd": [...]}} of calls {label: (fwd, bwd, ...)}, each round
    timing every label's forward then backward, the labels' order reversed every other round."""
    times = {label: {"fwd": [], "bwd": []} for label in calls}
    order = list(calls)
    for r in range(rounds):
        for label in (order if r % 2 == 0 else order[::-1]):
            fwd, bwd = calls[label][:2]
            times[label]["fwd"].append(timer(fwd))
            times[label]["bwd"].append(timer(bwd))
    return times


def step_wall_ms(step: Callable, steps: int, warmup: int = 2) -> float:
    """ms per step() by the wall clock: `warmup` calls, then `steps` timed with the GPU (if any)
    synchronized at both ends, so the host's own waits for the device are in the figure."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) / steps * 1e3


def alternating(labels, rounds: int, measure: Callable) -> dict:
    """{label: [measure(label) per round]}, the labels' order reversed every other round."""
    labels = list(labels)
    times = {label: [] for label in labels}
    for r in range(rounds):
        for label in (labels if r % 2 == 0 else labels[::-1]):
            times[label].append(measure(label))
    return times


def figures(values) -> str:
    """A results table's cell holding each round's figure: 'a / b / c'."""
    return " / ".join(map(str, values))


def max_abs_diff(a, b) -> float:
    """The largest |x - y| over paired tensors (outputs, gradients) of two variants."""
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


def bshd_inputs(batch: int, seqlen: int, heads: int, kv_heads: int, head_dim: int, dtype, device):
    """q, k, v (bshd, requiring gradients) and dO of one call, seeded by the sequence length."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seqlen)

    def randn(h):
        return torch.randn(batch, seqlen, h, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_()

    q, k, v = randn(heads), randn(kv_heads), randn(kv_heads)
    return q, k, v, torch.randn_like(q)


def expanded_sdpa(q, k, v, do, causal: bool, dtype, backend=None):
    """PyTorch SDPA on bshd q, k, v with K and V expanded to every query head (bhsd leaves in `dtype`, under
    the SDPBackend `backend` if given): its output and (dq, dk, dv) in bshd, dk and dv summed back over each
    KV head's group, and its (forward, fwd+bwd) calls for timing beside a GQA call's."""
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    heads, kv_heads = q.shape[2], k.shape[2]
    group = heads // kv_heads
    leaves = [t.detach().transpose(1, 2).to(dtype) for t in (q, k, v)]
    leaves = [leaves[0]] + [t.repeat_interleave(group, 1) for t in leaves[1:]]
    leaves = [t.contiguous().requires_grad_() for t in leaves]
    dot = do.transpose(1, 2).to(dtype).contiguous()

    def forward():
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            return F.scaled_dot_product_attention(*leaves, is_causal=causal)

    out = forward()
    grads = torch.autograd.grad(out, leaves, dot)
    grads = (grads[0].transpose(1, 2), *(g.unflatten(1, (kv_heads, group)).sum(2).transpose(1, 2) for g in grads[1:]))
    return out.transpose(1, 2), grads, (forward, lambda: torch.autograd.grad(forward(), leaves, dot))


def checked_timings(row: dict, calls: dict, flops: float, rounds: int, anchors, reference: str = "sdpa_flash",
                    tolerance: float = 0.05, timed: dict | None = None) -> dict:
    """Fill row[name] for each call {name: fn returning an output}: its max |difference| from calls[reference]'s
    output (a call that raises, or is off by more than `tolerance`, gets an "error" instead and is not timed), then
    ms, TFLOP/s and each round's ms (triton do_bench medians, `rounds` rounds in alternating order), and
    ratio_vs_<anchor> = anchor ms / "default" ms for each of `anchors` timed. timed: {name: the call timed} where
    it is not the checked one (a checked call that converts its output to the reference's layout, which the timed
    call must not pay for). Returns row."""
    import statistics

    from flashgen.flops import tflops
    from flashgen.timing import time_ms

    expected = calls[reference]().float()
    ok = {}
    for name, fn in calls.items():
        try:
            err = float((fn().float() - expected).abs().max())
        except Exception as exc:  # a variant that cannot run this case is reported, not fatal
            row[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
            continue
        if err > tolerance:
            row[name] = {"error": f"max |{name} - {reference}| = {err:.3g}"}
            continue
        ok[name] = (timed or {}).get(name, fn)
        row[name] = {f"max_err_vs_{reference}": err}
    for name, ms in alternating(ok, rounds, lambda name: time_ms(ok[name])).items():
        med = statistics.median(ms)
        row[name].update(ms=round(med, 4), tflops=round(tflops(flops, med), 1), rounds_ms=[round(x, 4) for x in ms])
    for anchor in anchors:
        if "ms" in row.get("default", {}) and "ms" in row.get(anchor, {}):
            row[f"ratio_vs_{anchor}"] = round(row[anchor]["ms"] / row["default"]["ms"], 3)
    return row


def variant_cells(row: dict, variants) -> list[str]:
    """A results table's cells for checked_timings' variants: TFLOP/s, or the start of the error."""
    return [str(row[v]["tflops"]) if "tflops" in row.get(v, {}) else row.get(v, {}).get("error", "-")[:30]
            for v in variants]


def table_head(title: str, env: dict, note: str, columns: list[str]) -> list[str]:
    """A results file's first lines: its title with the machine, a note, a markdown table's header."""
    return [f"# {title} ({env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, {env.get('date')})",
            "", note, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def run_probe(description: str, topic: str, cases: list | Callable, run_case: Callable, markdown: Callable,
              dry_run: Callable, add_arguments: Callable | None = None):
    """The probe's command line: --rounds, --out, --tag, --dry and the probe's own (add_arguments);
    run_case(case, args) -> a row, or a list of rows, for each case (after --dry has shortened them;
    cases(args) where the probe's arguments choose them), markdown(rows, env)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tag", default="", type=file_tag)
    parser.add_argument("--dry", action="store_true", help=dry_run.__doc__.split(":")[0])
    if add_arguments:
        add_arguments(parser)
    args = parser.parse_args()
    if args.dry:
        dry_run()
    env = {**environment(), "date": time.strftime("%Y-%m-%d")}
    gpu = gpu_tag(env)
    stem = args.out / f"{env['date']}-{gpu}-{topic}{args.tag}"
    rows = []
    for case in (cases(args) if callable(cases) else cases):
        t0 = time.time()
        result = run_case(case, args)  # a row, or a list of rows (one per mode)
        rows.extend(result if isinstance(result, list) else [result])
        print(json.dumps(result), f"{time.time() - t0:.0f}s", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
        stem.with_suffix(".md").write_text(markdown(rows, env))
    print(markdown(rows, env))
    return args
