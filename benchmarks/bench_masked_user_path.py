"""What a user gets for masked attention and short causal sequences, beside FlexAttention (issue 15).

Per case (bf16, 16 heads, 16384 tokens per batch, TFLOP/s over visible pairs, flashgen.flops):
- ``default``: the untuned call, ``flashgen.compile(spec)(q, k, v)``: the kernel flashgen.attention
  binds when no tuned result matches (the per-bucket defaults of flashgen.config.default_configs);
- ``load``: ``flashgen.load(spec)``, the shipped tuning_db/ (only where it has the spec: else the
  row says so and is not timed again);
- ``flex``: FlexAttention compiled (static shapes) with the same mask_mod and block mask
  (flashgen.bench.flex_mods), in the same process, on the same inputs.

Each provider's output (fwd) or gradients (fwd_bwd) are checked against the dense reference on a
slice (batch 0, heads 0-1; ../shared/TESTING.md's rule) before it is timed. Times are triton's
do_bench medians of the eager call, host time included, as a training step pays it; ``gpu_ms``
beside them is the same call replayed from a CUDA graph (kernels only), so a row whose eager time
is far above its GPU time is bound by host work, not by the kernels.

Compiles (flashgen's kernels and Flex's) are warmed first in parallel worker processes that fill
the on-disk caches (Triton's, inductor's); the timed process then loads them.

- ``example:<spec>`` rows: ``flashgen.load`` of every example spec with tuned results against its
  default, at each bucket it is tuned for (run_example).
- ``--hopper``: the Gluon warp-specialized forward (family hopper_ws) on the masked cases, each
  variant of HOPPER_VARIANTS given as the config (the default's backward kept) beside the default
  and Flex, same process, same inputs (run_hopper_case; <date>-<gpu>-hopper-masks.{json,md}).

    PYTHONPATH=. python3 benchmarks/bench_masked_user_path.py [--quick] [--out benchmarks/results]
        [--gpu-name h200] [--examples NAME ...] [--hopper [VARIANT ...]]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if "--dry" in sys.argv:  # before flashgen's kernels are decorated: Triton reads it then (dry_run sets it too late)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import flashgen  # noqa: E402
from flashgen import AttentionSpec  # noqa: E402
from flashgen.bench import environment, file_tag, flex_mods, gpu_tag  # noqa: E402
from flashgen.flops import pairs_flops, tflops, visible_count  # noqa: E402
from flashgen.inputs import named_tensors  # noqa: E402
from flashgen.timing import time_ms, wall_ms  # noqa: E402
from flashgen.verify import GRAD_MEAN_FACTOR, compare, reference_attention  # noqa: E402

TOKENS, HEADS, DTYPE = 16384, 16, "bf16"
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") else "cpu"
MODES = ("fwd", "fwd_bwd")
EXAMPLE_SHORTEN = 1  # the example specs' buckets are divided by this (dry runs)
TARGETS = {"fwd": 1.2, "fwd_bwd": 1.1}  # issue 15: x Flex with the default config; causal S=1024: fwd_bwd 1.05


@dataclass(frozen=True)
class Case:
    name: str
    fields: dict = field(hash=False)  # AttentionSpec fields beyond dtype, heads, head dim
    seqlens: tuple = (4096, 16384)
    head_dim: int = 128
    documents: int = 4  # document masks: equal documents per sequence

    def spec(self) -> AttentionSpec:
        return AttentionSpec(name=self.name, dtype=DTYPE, head_dim=self.head_dim, num_heads=HEADS, backward=True,
                             **self.fields)

    def target(self, mode: str) -> float:
        return 1.05 if self.name.startswith("causal") and mode == "fwd_bwd" else TARGETS[mode]


CASES = [
    Case("sliding_window_128", {"mask": {"sliding_window": {"left": 128, "right": 0}}}),
    Case("sliding_window_256", {"mask": {"sliding_window": {"left": 256, "right": 0}}}),
    Case("sliding_window_1024", {"mask": {"sliding_window": {"left": 1024, "right": 0}}}),
    Case("document_4", {"mask": {"document": {}}}, documents=4),
    Case("document_16", {"mask": {"document": {}}}, documents=16),
    Case("chunked_1024", {"mask": {"chunked": 1024}}),
    Case("prefix_lm_512", {"mask": {"prefix_lm": 512}}),
    Case("causal_hd64", {"causal": True}, (1024,), head_dim=64),
    Case("causal_hd128", {"causal": True}, (1024,), head_dim=128),
]
# timed only when named (--cases): packed short documents at a long length, where the Gluon kernels' fixed
# costs weigh most
EXTRA_CASES = [Case("document_64", {"mask": {"document": {}}}, (16384,), documents=64)]
QUICK = {("sliding_window_256", 4096), ("document_4", 4096), ("chunked_1024", 4096), ("prefix_lm_512", 16384),
         ("causal_hd64", 1024), ("causal_hd128", 1024)}


def dry_run() -> None:
    """Shake the script out on the CPU (Triton's interpreter): fp16 (the interpreter's bf16 dot is
    wrong), 2 heads, sequences 1/32 as long. The figures mean nothing."""
    global TOKENS, HEADS, DTYPE, EXAMPLE_SHORTEN, time_ms, gpu_ms
    os.environ["TRITON_INTERPRET"] = "1"
    TOKENS, HEADS, DTYPE, EXAMPLE_SHORTEN = 256, 2, "fp16", 32
    for cases in (CASES, EXTRA_CASES):
        cases[:] = [dataclasses.replace(c, seqlens=tuple(s // 32 for s in c.seqlens)) for c in cases]
    time_ms = wall_ms
    gpu_ms = lambda fn, rep=0: wall_ms(fn)  # noqa: E731


# ----------------------------------------------------------------------------- inputs and the reference
@dataclass
class Inputs:
    spec: AttentionSpec
    batch: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    tensors: dict
    pairs: int


def make_inputs(case: Case, seqlen: int, seed: int = 0) -> Inputs:
    return spec_inputs(case.spec(), seqlen, case.documents, seed)


def spec_inputs(spec: AttentionSpec, seqlen: int, documents: int = 4, seed: int = 0) -> Inputs:
    """TOKENS per batch of a spec's shapes (its query and KV heads, head dims, dtype)."""
    batch = max(1, TOKENS // seqlen)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    dtype = spec.torch_dtype

    def randn(heads, dim):
        return torch.randn(batch, heads, seqlen, dim, device=DEVICE, generator=gen).to(dtype)

    q, k = randn(spec.num_heads, spec.head_dim), randn(spec.num_kv_heads, spec.head_dim)
    v, do = randn(spec.num_kv_heads, spec.head_dim_v), randn(spec.num_heads, spec.head_dim_v)
    tensors = named_tensors(spec, batch, seqlen, documents=documents, device=DEVICE)
    return Inputs(spec, batch, q, k, v, do, tensors,
                  visible_count(spec, batch, seqlen, seqlen, tensors, device=DEVICE))


class SliceReference:
    """The dense reference for batch 0, heads 0-1 (float32, and in bf16 for the error rule), and
    the rule applied to a provider's outputs or gradients on that slice."""

    def __init__(self, x: Inputs):
        self.x = x
        self.kw = dict(causal=x.spec.causal, mask=x.spec.mask, score_mod=x.spec.score_mod,
                       tensors={n: t[:1] for n, t in x.tensors.items()})
        # two heads; with GQA the query heads of the first KV head (its dK/dV sums over them)
        group = x.q.shape[1] // x.k.shape[1]
        self.heads, kv_heads = (2, 2) if group == 1 else (group, 1)
        leaves = [t[:1, :n].detach() for t, n in ((x.q, self.heads), (x.k, kv_heads), (x.v, kv_heads))]
        self.do = x.do[:1, :self.heads]
        self.ref = self._run(leaves, torch.float32)
        self.pt = self._run(leaves, x.spec.torch_dtype)

    def _run(self, leaves, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in leaves]
        out, _ = reference_attention(*leaves, compute_dtype=dtype, **self.kw)
        grads = torch.autograd.grad(out, leaves, self.do.to(dtype))
        return [out.detach(), *grads]

    def check(self, mode: str, results) -> str | None:
        """None if the results (out, or dq, dk, dv) pass on the slice, else what failed."""
        names, offset, factor, mean = (("out",), 0, 2.0, 1.1) if mode == "fwd" else \
            (("dq", "dk", "dv"), 1, 3.0, GRAD_MEAN_FACTOR)
        failed = []
        for i, (name, got) in enumerate(zip(names, results)):
            want = self.ref[offset + i]
            r = compare(name, got[:1, :want.shape[1]], want, self.pt[offset + i],
                        factor=factor, mean_factor=mean)
            if not r.ok:
                failed.append(str(r))
        return "; ".join(failed) or None


def step(attn, x: Inputs, mode: str):
    """One call as a user makes it: the forward, or forward and backward through autograd."""
    if mode == "fwd":
        return lambda: (attn(x.q, x.k, x.v),)
    leaves = [t.detach().requires_grad_() for t in (x.q, x.k, x.v)]
    return lambda: torch.autograd.grad(attn(*leaves), leaves, x.do)


def gpu_ms(fn, rep: int = 25) -> float | None:
    """The call's kernels alone: a CUDA graph of repeated calls (about rep ms), replayed (median ms per call)."""
    try:
        import triton.testing

        return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
    except Exception:  # noqa: BLE001 (a call that cannot be captured has no GPU-only time)
        return None


def providers(x: Inputs, with_load: bool = True):
    """(source, callable(q, k, v), description): the default, load where it has the spec, Flex."""
    out = []
    default = flashgen.compile(x.spec)
    out.append(("default", lambda q, k, v: default(q, k, v, **x.tensors), str(default.config_for(x.q.shape[2]))))
    if with_load:
        loaded = _loaded(x.spec)
        if loaded.config_source != "default":
            cfg = loaded.config_for(x.q.shape[2])
            out.append(("load", lambda q, k, v: loaded(q, k, v, **x.tensors),
                        f"{cfg} | {cfg.describe_backward()} ({loaded.config_source})"))
        else:
            out.append(("load", None, "no tuned result for this spec: load serves the default"))
    flex = flex_mods(x.spec, x.q, x.k, x.tensors)
    out.append(("flex", flex, "FlexAttention, compiled, block mask"))
    return out


# ----------------------------------------------------------------------------- parallel compile warm-up
def _warm(job) -> str:
    """A worker: run one (case, seqlen) or one callable job once, so its compiles land in the caches."""
    fn, args = job
    t0 = time.time()
    try:
        fn(*args)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return f"ok {args} {time.time() - t0:.0f}s"
    except Exception as exc:  # noqa: BLE001 (reported; the timed process meets the error itself)
        return f"FAILED {args}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def _run_providers_once(name: str, seqlen: int, provs, modes) -> None:
    """Run each of the case's providers (provs(inputs): (source, callable or None, ...)) once per mode."""
    x = make_inputs(next(c for c in CASES + EXTRA_CASES if c.name == name), seqlen)
    for _, attn, *_ in provs(x):
        if attn is not None:
            for mode in modes:
                step(attn, x, mode)()


def _warm_case(name: str, seqlen: int) -> None:
    _run_providers_once(name, seqlen, providers, MODES)


def warm_then_ready(args, jobs) -> None:
    """Warm the compiles of the jobs (said line by line), then make the output folder."""
    t0 = time.time()
    for line in warm_up(jobs, 1 if args.dry else args.workers):
        print("warm", line, flush=True)
    print(f"warm-up {time.time() - t0:.0f}s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)


def warm_up(jobs, workers: int) -> list[str]:
    """Run jobs [(picklable fn, args)] in `workers` processes (spawned: each its own CUDA context)."""
    if workers <= 1 or not jobs:
        return [_warm(job) for job in jobs]
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # the workers are the parallelism
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        return list(pool.imap_unordered(_warm, jobs))


# ----------------------------------------------------------------------------- one case
def measure(attn, x: Inputs, mode: str, ref: SliceReference, flops: float, what: str) -> dict:
    """One provider in one mode: checked on the slice, then timed (eager and graph replay)."""
    if attn is None:
        return {"config": what}
    fn = step(attn, x, mode)
    try:
        err = ref.check(mode, fn())
        if err:
            return {"config": what, "error": f"wrong result: {err}"}
        ms = time_ms(fn)
        return {"config": what, "ms": ms, "tflops": tflops(flops, ms), "gpu_ms": gpu_ms(fn)}
    except Exception as exc:  # noqa: BLE001 (a provider that cannot run the case is reported)
        return {"config": what, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def measured_modes(x: Inputs, provs, modes):
    """Per mode: (mode, {source: measure(...)}) of each provider (source, callable, description, ...),
    checked on a slice of the reference first."""
    ref = SliceReference(x)
    for mode in modes:
        flops = pairs_flops(x.pairs, x.spec.head_dim, mode=mode)
        yield mode, {source: measure(attn, x, mode, ref, flops, what) for source, attn, what, *_ in provs}


def run_case(case: Case, seqlen: int, modes=MODES, with_load: bool = True) -> list[dict]:
    x = make_inputs(case, seqlen)
    rows = []
    for mode, measured in measured_modes(x, providers(x, with_load), modes):
        flex = measured.get("flex", {})
        for source in ("default", "load"):
            ours = measured.get(source)
            if ours is None:
                continue
            row = {"case": case.name, "seqlen": seqlen, "batch": x.batch, "head_dim": case.head_dim, "mode": mode,
                   "source": source, "visible_fraction": x.pairs / (x.batch * x.spec.num_heads * seqlen ** 2),
                   "config": ours["config"], "target": case.target(mode)}
            if "ms" not in ours and "error" not in ours:
                row["same_as"] = "default"
            row["tflops"] = {"flashgen": ours.get("tflops"), "flex": flex.get("tflops")}
            row["ms"] = {"flashgen": ours.get("ms"), "flex": flex.get("ms")}
            row["gpu_ms"] = {"flashgen": ours.get("gpu_ms"), "flex": flex.get("gpu_ms")}
            errors = {p: m["error"] for p, m in (("flashgen", ours), ("flex", flex)) if "error" in m}
            if errors:
                row["errors"] = errors
            if ours.get("tflops") and flex.get("tflops"):
                row["ratio_vs_flex"] = ours["tflops"] / flex["tflops"]
                if ours.get("gpu_ms") and flex.get("gpu_ms"):
                    row["gpu_ratio_vs_flex"] = flex["gpu_ms"] / ours["gpu_ms"]
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------- the Gluon kernels on masks
HOPPER_CASES = ("document_4", "document_16", "prefix_lm_512", "sliding_window_256", "sliding_window_1024",
                "chunked_1024", "document_64")
_GLUON = dict(family="hopper_ws", BLOCK_M=128, num_warps=4, tma=False, warp_specialize=False)
HOPPER_VARIANTS = {  # name -> knobs over the default config: hw_* the Gluon forward (the default's backward
    # kept), hb_* the Gluon dK/dV kernel (the default's forward kept), dQ separate or added from it
    "hw_n128_s2": dict(_GLUON, BLOCK_N=128, num_stages=2),
    "hw_n128_s3": dict(_GLUON, BLOCK_N=128, num_stages=3),
    "hw_pingpong": dict(_GLUON, BLOCK_N=128, num_stages=2, hopper_pingpong=True),
    "hw_n64_s3": dict(_GLUON, BLOCK_N=64, num_stages=3),
    # FA3's intra-warpgroup overlap (hopper_overlap; no longer serialized by ptxas, 2026-11-26)
    "hw_overlap_s2": dict(_GLUON, BLOCK_N=128, num_stages=2, hopper_overlap=True),
    "hw_overlap_s3": dict(_GLUON, BLOCK_N=128, num_stages=3, hopper_overlap=True),
    "hb_separate": dict(hopper_bwd=True),
    "hb_atomic": dict(hopper_bwd=True, dq_strategy="atomic", bwd_fused_delta=False),
    "hw_hb": dict(_GLUON, BLOCK_N=128, num_stages=3, hopper_bwd=True),  # both Gluon kernels
    # the persistent grid on masks (each tile's key range from the pattern), with the TMA store and FA3's
    # overlap (hw_all3: the unmasked hd128 default's knobs), and the overlap + TMA store on the one-tile grid
    "hw_persistent": dict(_GLUON, BLOCK_N=128, num_stages=2, hopper_persistent=True, hopper_tma_store=True),
    "hw_all3": dict(_GLUON, BLOCK_N=128, num_stages=2, hopper_persistent=True, hopper_overlap=True,
                    hopper_tma_store=True),
    "hw_overlap_tma": dict(_GLUON, BLOCK_N=128, num_stages=2, hopper_overlap=True, hopper_tma_store=True),
    "hw_persistent_s3": dict(_GLUON, BLOCK_N=128, num_stages=3, hopper_persistent=True),
    "hw_persistent_n64": dict(_GLUON, BLOCK_N=64, num_stages=4, hopper_persistent=True, hopper_tma_store=True),
    "hw_persistent_n64_s3": dict(_GLUON, BLOCK_N=64, num_stages=3, hopper_persistent=True, hopper_tma_store=True),
    "hw_all3_n64": dict(_GLUON, BLOCK_N=64, num_stages=4, hopper_persistent=True, hopper_overlap=True,
                        hopper_tma_store=True),
    "heavy_first": dict(bwd_heavy_first=True),  # the default's kernels, the backward launched heaviest first
}


def hopper_providers(x: Inputs, variants):
    """(source, callable, description, kernel or None): the default, the portable family's default
    where the default is the Gluon forward ("portable", what users got before), each Gluon
    variant, Flex."""
    seqlen = x.q.shape[2]
    default = flashgen.compile(x.spec)
    base = default.config_for(seqlen)
    out = [("default", lambda q, k, v: default(q, k, v, **x.tensors), str(base), default)]
    if base.family == "hopper_ws":
        before = flashgen.compile(x.spec, flashgen.default_config(x.spec, seqlen=seqlen, hopper_ws=False))
        out.append(("portable", lambda q, k, v: before(q, k, v, **x.tensors), str(before.config_for(seqlen)), before))
    for name in variants:
        cfg = base.replace(**HOPPER_VARIANTS[name])
        kernel = flashgen.compile(x.spec, cfg)
        out.append((name, lambda q, k, v, kernel=kernel: kernel(q, k, v, **x.tensors), str(cfg), kernel))
    out.append(("flex", flex_mods(x.spec, x.q, x.k, x.tensors), "FlexAttention, compiled, block mask", None))
    return out


def _gluon_path(kernel, seqlen) -> str | None:
    """Which Gluon kernels the kernel's calls ran: 'fwd' (a HopperPlan among its call plans), 'dkdv' (a
    backward plan's HopperDkdv), both ('fwd+dkdv') or neither ('')."""
    if kernel is None:
        return None
    from flashgen.runtime.hopper import HopperPlan
    from flashgen.runtime.hopper_bwd import HopperDkdv

    plans = list(kernel.module(kernel.config_for(seqlen))._LAUNCHER.plans.values())
    # (a training step's backward plans hang off its forward's plan)
    backward = plans + [b for p in plans for b in getattr(p, "backward_plans", {}).values()]
    ran = [name for name, took in (("fwd", any(isinstance(p, HopperPlan) for p in plans)),
                                   ("dkdv", any(isinstance(getattr(p, "dkdv", None), HopperDkdv) for p in backward)))
           if took]
    return "+".join(ran)


def run_hopper_case(case: Case, seqlen: int, modes=("fwd",), variants=tuple(HOPPER_VARIANTS)) -> list[dict]:
    x = make_inputs(case, seqlen)
    rows = []
    provs = hopper_providers(x, variants)
    for mode, measured in measured_modes(x, provs, modes):
        flex, default = measured["flex"], measured["default"]
        for source, _, _, kernel in provs:
            got = measured[source]
            row = {"case": case.name, "seqlen": seqlen, "batch": x.batch, "head_dim": case.head_dim, "mode": mode,
                   "source": source, "config": got["config"], "gluon_forward": _gluon_path(kernel, seqlen),
                   "tflops": got.get("tflops"), "ms": got.get("ms"), "gpu_ms": got.get("gpu_ms")}
            if "error" in got:
                row["error"] = got["error"]
            for name, other in (("flex", flex), ("default", default)):
                if got.get("tflops") and other.get("tflops"):
                    row[f"ratio_vs_{name}"] = got["tflops"] / other["tflops"]
            rows.append(row)
    return rows


def _warm_hopper(name: str, seqlen: int, modes, variants) -> None:
    _run_providers_once(name, seqlen, lambda x: hopper_providers(x, variants), modes)


def hopper_markdown(rows, env) -> str:
    lines = [title("Masked attention on the Gluon warp-specialized kernels vs today's default and FlexAttention", env),
             "", f"{DTYPE}, {HEADS} heads, {TOKENS} tokens per batch, hd128; TFLOP/s over visible pairs; eager do_bench"
             " "
             "medians of the user call (flashgen.compile(spec, config)(q, k, v, **tensors); host time included); "
             "gpu ms = CUDA-graph replay. default = today's default config; hw_* = the Gluon forward with the default's "
             "backward; hb_* = the Gluon dK/dV kernel (dQ separate or added from it) with the default's forward. "
             "Every row was checked on a slice before it was timed.", "",
             "| case | S | mode | source | TFLOP/s | x default | x Flex | gpu ms | Gluon path | config |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    cell = lambda v, f="{:.0f}": f.format(v) if v else "-"  # noqa: E731
    for r in rows:
        note = r["config"] + (f" ERROR: {r['error'][:160]}" if r.get("error") else "")
        lines.append(f"| {r['case']} | {r['seqlen']} | {r['mode']} | {r['source']} | {cell(r['tflops'])} | "
                     f"{cell(r.get('ratio_vs_default'), '{:.3f}')} | {cell(r.get('ratio_vs_flex'), '{:.3f}')} | "
                     f"{cell(r['gpu_ms'], '{:.3f}')} | {r['gluon_forward']} | {note} |")
    return "\n".join(lines) + "\n"


def hopper_main(args, env, gpu) -> None:
    """--hopper: run_hopper_case over HOPPER_CASES (or --cases) at each length, compiles warmed first."""
    variants = args.hopper or list(HOPPER_VARIANTS)
    default = [c.name for c in CASES]  # (EXTRA_CASES run only when named)
    names = [c for c in args.cases if c in HOPPER_CASES] if args.cases != default else [c for c in HOPPER_CASES
                                                                                        if c in default]
    todo = [(c, s) for c in CASES + EXTRA_CASES if c.name in names for s in (args.seqlens or c.seqlens)]
    warm_then_ready(args, [(_warm_hopper, (c.name, s, tuple(args.modes), tuple(variants))) for c, s in todo])
    stem = args.out / f"{env['date']}-{gpu}-hopper-masks{args.tag}"
    rows = []
    for case, seqlen in todo:
        new = run_hopper_case(case, seqlen, tuple(args.modes), variants)
        rows += new
        for r in new:
            print(f"{r['case']} {r['seqlen']} {r['mode']} {r['source']}: {r['tflops']} x default "
                  f"{r.get('ratio_vs_default')} x flex {r.get('ratio_vs_flex')} gluon {r['gluon_forward']} "
                  f"{r.get('error', '')}", flush=True)
        stem.with_suffix(".json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))  # a cut run keeps
        stem.with_suffix(".md").write_text(hopper_markdown(rows, env))
    print(hopper_markdown(rows, env))


# ----------------------------------------------------------------------------- the example specs' tuned results
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "specs"


def _loaded(spec):
    """flashgen.load(spec) (a spec or a YAML path), its fallback warnings silenced (the rows say it)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flashgen.load(spec)


def example_modes(spec: AttentionSpec) -> tuple:
    return MODES if spec.backward else ("fwd",)


def same_phases(a, b, mode: str) -> bool:
    """The two configs run the same kernels with the same knobs in this mode (fwd: the forward's
    knobs; fwd_bwd: every knob)."""
    phases = ("fwd",) if mode == "fwd" else ("fwd", "bwd")
    return all(getattr(a, k) == getattr(b, k) for p in phases for k in flashgen.KernelConfig.phase_knobs(p))


def run_example(path: Path, modes=MODES) -> list[dict]:
    """flashgen.load(path) against its default (flashgen.compile of the same spec) at every bucket the
    spec is tuned for (tune.seqlens), as written (its heads, KV heads, dtype), same process, same
    inputs; checked on a slice first. Where load serves the default's config for a mode (nothing
    tuned there, or the stored result was measured against another default), the row says so and is
    not timed twice. issue 15: load >= 1.0x default at every bucket."""
    spec = AttentionSpec.from_yaml(path)
    loaded, default = _loaded(path), flashgen.compile(spec)
    rows = []
    for seqlen in (s // EXAMPLE_SHORTEN for s in spec.tune.seqlens):
        x = spec_inputs(spec, seqlen)
        ref = SliceReference(x)
        ours, base = loaded.config_for(seqlen), default.config_for(seqlen)
        for mode in (m for m in example_modes(spec) if m in modes):
            row = {"case": f"example:{path.stem}", "seqlen": seqlen, "batch": x.batch, "head_dim": spec.head_dim,
                   "mode": mode, "source": "load", "spec": spec.uri, "config_source": loaded.config_source,
                   "config": f"{ours} | {ours.describe_backward()}", "default_config": f"{base} | "
                   f"{base.describe_backward()}", "target": 1.0}
            if loaded.config_source == "default" or same_phases(ours, base, mode):
                rows.append(dict(row, same_as="default"))
                continue
            flops = pairs_flops(x.pairs, spec.head_dim, mode=mode)
            got = {src: measure(lambda q, k, v, kernel=kernel: kernel(q, k, v, **x.tensors), x, mode, ref, flops, "")
                   for src, kernel in (("default", default), ("load", loaded))}
            row["tflops"] = {"flashgen": got["load"].get("tflops"), "default": got["default"].get("tflops")}
            row["ms"] = {"flashgen": got["load"].get("ms"), "default": got["default"].get("ms")}
            row["gpu_ms"] = {"flashgen": got["load"].get("gpu_ms"), "default": got["default"].get("gpu_ms")}
            errors = {p: m["error"] for p, m in (("load", got["load"]), ("default", got["default"])) if "error" in m}
            if errors:
                row["errors"] = errors
            elif row["tflops"]["flashgen"] and row["tflops"]["default"]:
                row["ratio_vs_default"] = row["tflops"]["flashgen"] / row["tflops"]["default"]
                if row["gpu_ms"]["flashgen"] and row["gpu_ms"]["default"]:
                    row["gpu_ratio_vs_default"] = row["gpu_ms"]["default"] / row["gpu_ms"]["flashgen"]
            rows.append(row)
    return rows


def example_paths(names=None) -> list[Path]:
    """The example specs flashgen.load has tuned results for (names: only these file stems)."""
    paths = [p for p in sorted(EXAMPLES.glob("*.yaml")) if names is None or p.stem in names]
    return [p for p in paths if _loaded(p).config_source != "default"]


def _warm_example(path: str) -> None:
    spec = AttentionSpec.from_yaml(path)
    kernels = (_loaded(Path(path)), flashgen.compile(spec))
    for seqlen in (s // EXAMPLE_SHORTEN for s in spec.tune.seqlens):
        x = spec_inputs(spec, seqlen)
        for kernel in kernels:
            for mode in example_modes(spec):
                step(lambda q, k, v, kernel=kernel: kernel(q, k, v, **x.tensors), x, mode)()


def example_markdown(rows) -> list[str]:
    lines = ["", "## flashgen.load of the example specs vs their default (same run, same inputs)", "",
             "Each example spec with tuned results, as written (its heads, KV heads, dtype), at every bucket it "
             "is tuned for; TFLOP/s eager (do_bench, host included); gpu = graph replay. Target: load >= 1.0x "
             "default (issue 15). 'same as default': load serves the default's knobs for that mode.", "",
             "| spec | S | mode | load | default | ratio | gpu ms load / default | gpu ratio | load config |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("same_as"):
            lines.append(f"| {r['case'][8:]} | {r['seqlen']} | {r['mode']} | - | - | same as default | - | - | "
                         f"{r['config']} ({r['config_source']}) |")
            continue
        t, g, ratio = r.get("tflops", {}), r.get("gpu_ms", {}), r.get("ratio_vs_default")
        cell = lambda v, f="{:.0f}": f.format(v) if v else "-"  # noqa: E731
        mark = "" if ratio is None else (" ok" if ratio >= 1.0 else " FAIL")
        note = r["config"] + ("".join(f" ERROR {p}: {e[:120]}" for p, e in r.get("errors", {}).items()))
        lines.append(f"| {r['case'][8:]} | {r['seqlen']} | {r['mode']} | {cell(t.get('flashgen'))} | "
                     f"{cell(t.get('default'))} | {cell(ratio, '{:.3f}')}{mark} | {cell(g.get('flashgen'), '{:.3f}')}"
                     f" / {cell(g.get('default'), '{:.3f}')} | {cell(r.get('gpu_ratio_vs_default'), '{:.3f}')} | "
                     f"{note} |")
    return lines


def title(what: str, env) -> str:
    """A results file's first line: what, on which GPU and versions, when."""
    return f"# {what} ({env.get('gpu')}, torch {env['torch']}, triton {env['triton']}, {env['date']})"


def markdown(rows, env) -> str:
    lines = [title("What a user gets: masked attention and short causal, flashgen vs FlexAttention", env), "",
             f"{DTYPE}, {HEADS} heads, {TOKENS} tokens per batch; TFLOP/s over visible pairs; eager do_bench medians "
             "(host time included); gpu = the same call replayed from a CUDA graph. default = untuned "
             "(flashgen.compile / flashgen.attention without a tuned result); load = flashgen.load (shipped "
             "tuning_db). Target: x Flex (issue 15).", "",
             "| case | S | mode | source | flashgen | Flex | ratio | target | gpu ms flashgen / Flex | gpu ratio | "
             "config |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    examples = [r for r in rows if r["case"].startswith("example:")]
    for r in (r for r in rows if not r["case"].startswith("example:")):
        t, g = r["tflops"], r["gpu_ms"]
        cell = lambda v, f="{:.0f}": f.format(v) if v else "-"  # noqa: E731
        ratio = r.get("ratio_vs_flex")
        mark = "" if ratio is None else (" ok" if ratio >= r["target"] else " MISS")
        note = "same as default" if r.get("same_as") else r["config"]
        if r.get("errors"):
            note += " ERRORS: " + "; ".join(f"{p}: {e[:120]}" for p, e in r["errors"].items())
        lines.append(f"| {r['case']} | {r['seqlen']} | {r['mode']} | {r['source']} | {cell(t['flashgen'])} | "
                     f"{cell(t['flex'])} | {cell(ratio, '{:.2f}')}{mark} | {r['target']} | "
                     f"{cell(g['flashgen'], '{:.3f}')} / {cell(g['flex'], '{:.3f}')} | "
                     f"{cell(r.get('gpu_ratio_vs_flex'), '{:.2f}')} | {note} |")
    if examples:
        lines += example_markdown(examples)
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--quick", action="store_true", help="a subset: " + ", ".join(f"{c}@{s}" for c, s in
                                                                                          sorted(QUICK)))
    parser.add_argument("--cases", nargs="+", default=[c.name for c in CASES])
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--workers", type=int, default=max(1, min(15, (os.cpu_count() or 2) - 1)))
    parser.add_argument("--no-load", action="store_true", help="time the default only")
    parser.add_argument("--dry", action="store_true", help=dry_run.__doc__.split(":")[0])
    parser.add_argument("--examples", nargs="*", default=None,
                        help="example specs (file stems) whose flashgen.load is timed against the default "
                             "(default: every one with tuned results; none: --examples with no name)")
    parser.add_argument("--gpu-name", help="the GPU's name in the output files' names (default: the device's, "
                                           "e.g. h100, h200)")
    parser.add_argument("--hopper", nargs="*", default=None, choices=list(HOPPER_VARIANTS),
                        help="time the Gluon kernels' variants (default: all) on the masked cases instead")
    parser.add_argument("--seqlens", nargs="+", type=int, help="--hopper: these lengths (default: the cases')")
    parser.add_argument("--tag", default="", type=file_tag, help="appended to the output files' names")
    args = parser.parse_args()
    if args.dry:
        dry_run()
    env = {**environment(), "date": time.strftime("%Y-%m-%d")}
    gpu = args.gpu_name or gpu_tag(env)
    if args.hopper is not None:
        return hopper_main(args, env, gpu)
    todo = [(c, s) for c in CASES + EXTRA_CASES if c.name in args.cases for s in c.seqlens
            if not args.quick or (c.name, s) in QUICK]
    todo.sort(key=lambda cs: cs[1] > 4096)  # the longest last: a run cut short keeps the most cases
    examples = [] if args.no_load else example_paths(args.examples)
    # the example specs between the short cases and the 16384-token ones
    todo = [t for t in todo if t[1] <= 4096] + examples + [t for t in todo if t[1] > 4096]
    warm_then_ready(args, [(_warm_example, (str(t),)) if isinstance(t, Path) else (_warm_case, (t[0].name, t[1]))
                           for t in todo])
    stem = args.out / f"{env['date']}-{gpu}-masked-user-path{args.tag}"
    rows = []
    for item in todo:
        t1 = time.time()
        new = run_example(item, args.modes) if isinstance(item, Path) else \
            run_case(item[0], item[1], args.modes, not args.no_load)
        rows += new
        for r in new:
            ratio = r.get("ratio_vs_flex", r.get("ratio_vs_default", 0))
            print(f"{r['case']} {r['seqlen']} {r['mode']} {r['source']}: {r.get('tflops', r.get('same_as'))} "
                  f"ratio {ratio:.2f} gpu {r.get('gpu_ms')} {r.get('errors', '')}", flush=True)
        print(f"  {time.time() - t1:.0f}s", flush=True)
        stem.with_suffix(".json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))  # a cut run keeps
        stem.with_suffix(".md").write_text(markdown(rows, env))
    print(markdown(rows, env))


if __name__ == "__main__":
    main()
