"""flashgen.attention as a model calls it (issue 13): small causal calls where host time decides.

Cases: B=1, H=16, S=128 and 512; then S=1024..16384 at 16384 tokens (B = 16384 // S); head dim
128, causal, bf16. Modes: forward (no grad), and forward + backward. Providers: flashgen.attention
(the default path: bound once, tuned config if stored, call plans and bound launches), the same
through Triton's launch path on every call (flashgen_triton_path: FLASHGEN_BOUND_LAUNCH=0), with
pointer loads instead of tensor descriptors (flashgen_no_tma) and with the one-launch short backward
forced off (flashgen_no_short: the call's default config with bwd_short=False, the portable
preprocess, dK/dV and dQ launches), SDPA flash, cuDNN, FlexAttention compiled. The SDPA providers
choose their backend once around all of their timing (sdpa_kernel entered per call costs ~14 us of
CPU on the CI machine, more than flashgen's own per-call work: the anchor of v1-v5 paid it on every
call; that form is kept as provider sdpa_flash_ctx, not the anchor). Per provider:
host_us (CPU time per call, no sync inside the loop, many calls; forward rows add
grad_fwd_host_us, the forward with autograd recording) and gpu_ms (triton's do_bench median).
Every provider's output is checked against SDPA's math before it is timed; each provider records its own error and the run goes on. Last: a torch.compile
(fullgraph=True, inductor) forward + backward of a module calling flashgen.attention.

    PYTHONPATH=. python3 benchmarks/bench_call_path.py [--seqlens 128,512] [--providers flashgen,sdpa_flash]
Writes benchmarks/results/<date>-<gpu>-call-path.json and .md (or under --out).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flashgen  # noqa: E402
from flashgen.api import spec_for  # noqa: E402
from flashgen.bench import environment, file_tag, gpu_tag  # noqa: E402
from flashgen.config import default_config  # noqa: E402
from flashgen.runtime.launch import BoundLaunch  # noqa: E402

ANCHOR = "sdpa_flash"
ANCHORS = (ANCHOR, "sdpa_flash_ctx")  # ratios are given against each one present
HEADS, DIM = 16, 128
CASES = [(1, 128), (1, 512)] + [(16384 // s, s) for s in (1024, 2048, 4096, 8192, 16384)]


def providers():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention)
    masks = {}

    def sdpa_with(backend):
        def call(q, k, v):  # run_case enters call.context() around everything it times
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        call.context = lambda: sdpa_kernel(backend)
        return call

    def sdpa_per_call(q, k, v):  # the anchor of v1-v5: the backend chosen on every call
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def flex_call(q, k, v):
        key = (q.shape[0], q.shape[2])
        if key not in masks:
            masks[key] = create_block_mask(lambda b, h, i, j: j <= i, q.shape[0], None, q.shape[2], q.shape[2])
        return flex(q, k, v, block_mask=masks[key])

    def triton_path(q, k, v):  # flashgen with every call checked and launched through JITFunction.run
        BoundLaunch.enabled = False
        try:
            return flashgen.attention(q, k, v, causal=True)
        finally:
            BoundLaunch.enabled = True

    pointers = {}

    def no_tma(q, k, v):  # flashgen's default config with pointer loads instead of tensor descriptors
        key = q.shape[1:]
        if key not in pointers:
            spec = spec_for(q, k, v, causal=True, softmax_scale=None, layout="bhsd")
            pointers[key] = default_config(spec).replace(tma=False, bwd_tma=False)
        return flashgen.attention(q, k, v, causal=True, config=pointers[key])

    portable = {}

    def no_short(q, k, v):  # the call's default config with the portable backward (three launches)
        key = q.shape[1:]
        if key not in portable:
            spec = spec_for(q, k, v, causal=True, softmax_scale=None, layout="bhsd")
            portable[key] = default_config(spec, seqlen=q.shape[2]).replace(bwd_short=False)
        return flashgen.attention(q, k, v, causal=True, config=portable[key])

    return {"flashgen": lambda q, k, v: flashgen.attention(q, k, v, causal=True),
            "flashgen_triton_path": triton_path, "flashgen_no_tma": no_tma, "flashgen_no_short": no_short,
            "sdpa_flash": sdpa_with(SDPBackend.FLASH_ATTENTION), "sdpa_flash_ctx": sdpa_per_call,
            "cudnn": sdpa_with(SDPBackend.CUDNN_ATTENTION), "flex": flex_call}


def context(fn):
    """What a provider's calls run inside (the SDPA backend, chosen once), or a no-op."""
    return getattr(fn, "context", contextlib.nullcontext)()


def host_us(fn, calls=200):
    """CPU time per call: no sync inside the loop (the GPU queue absorbs the launches)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def graph_ms(step):
    """The step's GPU time alone: a CUDA graph of repeated steps, replayed (median ms per step); None
    when the step cannot be captured."""
    from triton.testing import do_bench_cudagraph

    try:
        return round(float(do_bench_cudagraph(step, rep=25, return_mode="median")), 4)
    except Exception:  # noqa: BLE001 - a provider that cannot be captured has no graph time
        return None


def run_case(batch, seqlen, mode, fns, graph=False, reverse=False):
    """One (case, mode) row: every provider checked and timed in turn (in reverse order when `reverse`:
    repeats alternate it, so a drift of the host's speed within a row does not favour one provider)."""
    q, k, v = (torch.randn(batch, HEADS, seqlen, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    row = {"case": f"B={batch} H={HEADS} S={seqlen} hd{DIM} causal bf16", "mode": mode}
    for name in list(fns)[::-1] if reverse else list(fns):
        try:
            with context(fns[name]):
                measure(row, name, fns[name], (q, k, v), do, ref, mode, graph)
        except Exception as exc:  # noqa: BLE001 - one provider's failure is recorded, the run goes on
            row.setdefault("errors", {})[name] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            traceback.print_exc()
    for anchor in ANCHORS:
        base = row.get(f"{anchor}_gpu_ms")
        for name in fns:
            if base and row.get(f"{name}_gpu_ms") and name not in ANCHORS:  # anchor time / flashgen time
                row[f"{name}_ratio_vs_{anchor}"] = round(base / row[f"{name}_gpu_ms"], 3)
                row[f"{name}_host_ratio_vs_{anchor}"] = round(row[f"{anchor}_host_us"] / row[f"{name}_host_us"], 3)
    print(json.dumps(row), flush=True)
    return row


def measure(row, name, attn, qkv, do, ref, mode, graph):
    """One provider's check against SDPA's math, then its host_us and gpu_ms (and graph_ms), into row."""
    from triton.testing import do_bench

    err = (attn(*qkv).float() - ref).abs().max().item()
    if not err < 0.05:
        raise AssertionError(f"max |out - SDPA math| = {err:.4f}")
    if mode == "forward":
        def step():
            with torch.no_grad():
                attn(*qkv)
        # the forward of a training step: autograd records it (no backward here)
        row[f"{name}_grad_fwd_host_us"] = round(host_us(lambda: attn(*qkv)), 1)
    else:
        def step():
            torch.autograd.grad(attn(*qkv), qkv, do)
    row[f"{name}_host_us"] = round(host_us(step), 1)
    row[f"{name}_gpu_ms"] = round(do_bench(step, return_mode="median"), 4)
    if graph and name in ("flashgen", ANCHOR):  # what eager pays beyond its kernels
        row[f"{name}_graph_ms"] = graph_ms(step)


def compile_check():
    """torch.compile(fullgraph=True) with inductor of a module calling flashgen.attention, fwd + bwd."""
    try:
        class Attn(torch.nn.Module):
            def forward(self, q, k, v):
                return flashgen.attention(q, k, v, causal=True)

        model = torch.compile(Attn(), fullgraph=True, dynamic=True)
        q, k, v = (torch.randn(2, HEADS, 256, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        out = model(q, k, v)
        out.sum().backward()
        diff = (out - flashgen.attention(q, k, v, causal=True)).abs().max().item()
        return {"ok": diff == 0.0, "max_diff_vs_eager": diff}
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": "".join(traceback.format_exception_only(type(exc), exc)).strip()}


class AllocOnly(torch.autograd.Function):
    """The autograd floor: an autograd.Function that launches nothing, out/lse and dq/dk/dv allocated,
    entered and left as flashgen's eager path is (its backward without once_differentiable's wrapper,
    which flashgen takes only under create_graph; v1-v6's floor had it). benchmarks/call_path_host.py
    times it too."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # as flashgen's: no zero-filled dlse
        return out, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def diagnose(seqlen=128):
    """Where a fwd+bwd step's host time goes at B=1, S=seqlen: host us per call (no sync) of the
    autograd floor (a Python autograd.Function that only allocates), SDPA flash (its backend chosen
    once; and chosen per call, as v1-v5's anchor, and that choice alone), flashgen, flashgen's forward
    and backward module calls alone on the main thread (no autograd), and the allocations a step
    makes (three gradients by torch.empty with keywords, by empty_like, as views of one tensor)."""
    from torch.nn.attention import sdpa_kernel, SDPBackend

    q, k, v = (torch.randn(1, HEADS, seqlen, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    fns = providers()
    sdpa, sdpa_per_call = fns["sdpa_flash"], fns["sdpa_flash_ctx"]

    def choose_flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            pass
    # the module a call of this length runs (its bucket's default; compile(spec).module() alone would be the
    # DEFAULT_SEQLEN bucket's: descriptors and the Gluon dK/dV at hd128 causal, not what S <= 512 runs)
    kernel = flashgen.compile(spec_for(q, k, v, causal=True, softmax_scale=None, layout="bhsd"))
    module = kernel.module(kernel.config_for(seqlen))
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out, lse = module.forward(qd, kd, vd)
    launcher = module._LAUNCHER  # the training entries autograd's Function calls, here on the main thread
    t_out, t_lse, t_plan, _ = launcher.training_forward(qd, kd, vd, "bhsd", 0.0, None, None, None, None, None, None)
    rows = {
        "autograd floor: allocating Function, fwd+bwd": lambda: torch.autograd.grad(AllocOnly.apply(q, k, v)[0],
                                                                                   (q, k, v), do),
        "sdpa_flash fwd+bwd": lambda: torch.autograd.grad(sdpa(q, k, v), (q, k, v), do),
        "sdpa_flash fwd+bwd, sdpa_kernel per call": lambda: torch.autograd.grad(sdpa_per_call(q, k, v), (q, k, v), do),
        "sdpa_kernel enter/exit alone": choose_flash,
        "flashgen fwd+bwd": lambda: torch.autograd.grad(flashgen.attention(q, k, v, causal=True), (q, k, v), do),
        "flashgen module.forward alone": lambda: module.forward(qd, kd, vd),
        "flashgen module.backward alone": lambda: module.backward(do, qd, kd, vd, out, lse),
        # the step's halves: what the forward costs with autograd recording it, and the backward's host work
        # without autograd's engine (step - forward - training_backward: the engine, its thread, grad's wrapper)
        "flashgen forward recorded by autograd": lambda: flashgen.attention(q, k, v, causal=True),
        "flashgen training_backward alone": lambda: launcher.training_backward(t_plan, do, qd, kd, vd, t_out, t_lse,
                                                                               None, None, None, None),
        "autograd floor: forward alone": lambda: AllocOnly.apply(q, k, v),
        "3 x torch.empty(shape, dtype=, device=)": lambda: [torch.empty(q.shape, dtype=q.dtype, device=q.device)
                                                             for _ in range(3)],
        "3 x torch.empty_like(q)": lambda: [torch.empty_like(qd) for _ in range(3)],
        "torch.empty((3, *shape), ...).unbind(0)": lambda: torch.empty((3, *q.shape), dtype=q.dtype,
                                                                        device=q.device).unbind(0),
    }
    result = {}
    for name, fn in rows.items():
        with context(sdpa) if name == "sdpa_flash fwd+bwd" else contextlib.nullcontext():
            result[name] = round(host_us(fn), 1)
    # launches that took Triton's path (not bound) in 10 more flashgen fwd+bwd steps: expected 0
    original, slow = BoundLaunch.launch, []
    BoundLaunch.launch = lambda self, args: slow.append(self.kernel.__name__) or original(self, args)
    try:
        for _ in range(10):
            rows["flashgen fwd+bwd"]()
    finally:
        BoundLaunch.launch = original
    result["triton-path launches in 10 fwd+bwd steps"] = sorted(set(slow)) or 0
    result.update(pointer_ints(module, qd, kd, vd))
    print(json.dumps({"diagnose": f"S={seqlen}", **result}), flush=True)
    return result


def pointer_ints(module, q, k, v):
    """The dense forward's bound launch alone (host us, no sync), with its tensor arguments passed as
    tensors (Triton's C launcher calls data_ptr() and cuPointerGetAttribute on each: 12 here) and as
    their data_ptr() ints (which it takes as they are); and whether the two give bitwise equal out
    and lse. A probe for the next cut, not what flashgen does."""
    from flashgen.runtime.launch import launch_context

    plan = module._LAUNCHER.forward_call_plan(q, k, v, "bhsd", None, None, None, 0.0, None, None, None, None, None,
                                              None)
    if not plan.direct:
        return {"pointer ints probe": "not a direct plan"}

    def args(out, lse):
        return (q, k, v, out, lse, plan.seed, plan.no_offsets, plan.no_offsets, q, k, v, out, *plan.head, *plan.tail)

    try:
        outs = [(torch.empty_like(q), torch.empty(plan.lse_shape, device=q.device)) for _ in range(2)]
        tensors = args(*outs[0])
        ints = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args(*outs[1]))
        plan.launch.run(launch_context(), tensors)
        plan.launch.run(launch_context(), ints)
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(*outs))
        return {"forward launch alone, tensor args": round(host_us(lambda: plan.launch.run(launch_context(), tensors)), 1),
                "forward launch alone, pointer ints": round(host_us(lambda: plan.launch.run(launch_context(), ints)), 1),
                "pointer ints bitwise equal": same,
                "launch_context() alone": round(host_us(launch_context), 2)}
    except Exception as exc:  # noqa: BLE001 - a probe
        return {"pointer ints probe": "".join(traceback.format_exception_only(type(exc), exc)).strip()}


def kernel_profile(step, steps, top=8, width=60):
    """us of GPU time per step(), by kernel (torch.profiler's CUDA activity): the `top` largest (names cut
    to `width` characters), 'total' (all kernels) and 'wall' (host clock, synchronized)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps * 1e6
    times = {}
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if device_us:
            times[event.key[:width]] = round(device_us / steps, 1)
    largest = dict(sorted(times.items(), key=lambda kv: -kv[1])[:top])
    return {**largest, "total": round(sum(times.values()), 1), "wall": round(wall, 1)}


def kernel_times(seqlen, steps=20):
    """GPU time per fwd+bwd step at B=1, S=seqlen, by kernel (kernel_profile), for flashgen (and with
    its portable backward) and SDPA flash: whether a step whose do_bench time exceeds its host time is
    held back by a kernel, or by the host. {provider: {kernel: us per step, 'total': us, 'wall': us}}."""
    q, k, v = (torch.randn(1, HEADS, seqlen, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    fns = providers()
    result = {}
    for name in ("flashgen", "flashgen_no_short", "sdpa_flash"):
        def step(attn=fns[name]):
            torch.autograd.grad(attn(q, k, v), (q, k, v), do)
        with context(fns[name]):
            for _ in range(3):
                step()
            result[name] = kernel_profile(step, steps)
    print(json.dumps({"kernels": f"S={seqlen}", **result}), flush=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", default=",".join(str(s) for _, s in CASES),
                        help="comma-separated sequence lengths among the cases")
    parser.add_argument("--providers", default="all", help="comma-separated providers, or all")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                        help="directory for the .json and .md results")
    parser.add_argument("--diagnose", action="store_true", help="also time the host-time breakdown (diagnose())")
    parser.add_argument("--no-compile-check", action="store_true", help="leave out the torch.compile check")
    parser.add_argument("--repeat", type=int, default=1,
                        help="time the rows of S <= 512 this many times (host noise moves them between runs); "
                             "the table adds the median ratio")
    parser.add_argument("--graph", action="store_true",
                        help="also flashgen's and the anchor's fwd+bwd replayed from a CUDA graph (graph_ms)")
    parser.add_argument("--tag", default="", type=file_tag, help="file name suffix: v2 (or -v2) writes ...-v2")
    parser.add_argument("--kernels", action="store_true",
                        help="also the GPU time per fwd+bwd step by kernel at S <= 512 (kernel_times())")
    args = parser.parse_args()
    fns = providers()
    if args.providers != "all":
        fns = {name: fns[name] for name in args.providers.split(",")}
    seqlens = {int(s) for s in args.seqlens.split(",")}
    rows = [dict(run_case(b, s, mode, fns, graph=args.graph and mode == "fwd+bwd", reverse=i % 2 == 1), run=i)
            for b, s in CASES if s in seqlens for i in range(args.repeat if s <= 512 else 1)
            for mode in ("forward", "fwd+bwd")]
    env = environment()
    result = {"environment": env, "anchor": ANCHOR, "rows": rows,
              "compile_check": {"skipped": True} if args.no_compile_check else compile_check()}
    if args.diagnose:
        result["diagnose"] = {seqlen: diagnose(seqlen) for seqlen in sorted(seqlens) if seqlen <= 512}
    if args.kernels:
        result["kernels"] = {seqlen: kernel_times(seqlen) for seqlen in sorted(seqlens) if seqlen <= 512}
    out = Path(args.out) / f"{datetime.date.today()}-{gpu_tag(env)}-call-path{args.tag}"
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    names = list(fns)
    lines = ["| case | mode | " + " | ".join(f"{n} host us / gpu ms" for n in names)
             + f" | ratio_vs_{ANCHOR} ({ANCHOR} time / flashgen's) |",
             "|---" * (len(names) + 3) + "|"]
    for r in rows:
        cells = [f"{r.get(f'{n}_host_us', '-')} / {r.get(f'{n}_gpu_ms', '-')}" for n in names]
        lines.append(f"| {r['case']} | {r['mode']} | " + " | ".join(cells)
                     + f" | {r.get(f'flashgen_ratio_vs_{ANCHOR}', '-')} |")
    for name, anchor in ((n, a) for a in ANCHORS for n in names if n.startswith("flashgen")):
        ratio = f"{name}_ratio_vs_{anchor}"
        for case, mode in dict.fromkeys((r["case"], r["mode"]) for r in rows):
            ratios = [r[ratio] for r in rows if (r["case"], r["mode"]) == (case, mode) and ratio in r]
            if len(ratios) > 1:
                lines.append(f"\n{case} {mode}: {name} ratio_vs_{anchor} median {statistics.median(ratios):.3f} "
                             f"(spread {min(ratios):.3f}-{max(ratios):.3f}) of {len(ratios)} runs "
                             f"({', '.join(map(str, ratios))})")
    for r in rows:
        if r.get("flashgen_graph_ms") is not None:
            lines.append(f"\n{r['case']} {r['mode']} from a CUDA graph (gpu ms): flashgen {r['flashgen_graph_ms']}, "
                         f"{ANCHOR} {r.get(f'{ANCHOR}_graph_ms')}")
    lines.append(f"\ncompile check (inductor, fullgraph): {json.dumps(result['compile_check'])}")
    for seqlen, times in result.get("diagnose", {}).items():
        lines.append(f"\nhost us per call at S={seqlen}: " + "; ".join(f"{n} {t}" for n, t in times.items()))
    for seqlen, per in result.get("kernels", {}).items():
        for name, times in per.items():
            lines.append(f"\nGPU us per fwd+bwd step at S={seqlen}, {name}: "
                         + "; ".join(f"{n} {t}" for n, t in times.items()))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
