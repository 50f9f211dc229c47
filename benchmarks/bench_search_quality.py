"""Issue 16's search-quality figure, measured: the tuner's own search on the GPU, many seeds.

For the forward of gqa-causal and mha-hd64 at the 4096 bucket (the specs of the exhaustive
H100 sweeps in results/tuning/sweep_*_fwd4096.json), each seed runs `flashgen tune`'s study code
(flashgen.tuner.tune: sampler, verification, timing, final round) in a fresh temporary store,
with no hand-set default enqueued (TuneOptions.enqueue_default=False, `--no-default`), warm-
started as a new user's tune is: from the nearest specs tuned on this GPU in tuning_db/, the
spec's own rows left out (flashgen.db.neighbours skips its key). Trials per study: a quarter of
the sweep's valid points (22 and 27). Optionally the same from scratch (no warm start, no
default) as a contrast.

Then, in the same process, one timing method (flashgen.timing.time_ms: do_bench's median)
re-times the sweep's best configs, today's default, the shipped row and every distinct config
the seeds chose, in interleaved rounds; each seed's gap = chosen / fastest re-timed - 1, for
what the search alone found (BucketResult.found) and for what the tune stores (the default
keeps its seat in the final round).

Compiles dominate a cold run, so the valid points of each space are first compiled (and
verified on the full grid) in --jobs processes sharing Triton's cache; the seeds then find
every kernel compiled. The search is not changed by that: only its wall time is.

    python3 benchmarks/bench_search_quality.py --out results/x.json            # on the GPU
    python3 benchmarks/bench_search_quality.py --smoke --out /tmp/sq.json      # CPU, interpreter
    python3 benchmarks/bench_search_quality.py --simulate                      # CPU: the seeds' distinct configs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SWEEPS = {"gqa-causal": "sweep_gqa_fwd4096.json", "mha-hd64": "sweep_mha_fwd4096.json"}
SWEPT_KNOBS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "loop_order")  # what the sweeps varied
WITHIN = 0.02
# The seeds' stores: fresh SQLite files on a tmpfs where there is one (each Optuna trial commits
# several times; on a disk every commit waits for its fsync, ~6 ms here).
SCRATCH = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def load_sweep(name: str) -> dict:
    return json.loads((ROOT / "benchmarks/results/tuning" / SWEEPS[name]).read_text())


def sweep_ranked(doc: dict) -> list[dict]:
    """The sweep's ok records, fastest first."""
    return sorted((r for r in doc["records"] if r["status"] == "ok"), key=lambda r: r["ms"])


def bench_spec(name: str, doc: dict, smoke: bool):
    """The swept spec, tuning only the sweep's bucket (its key is unchanged: tune: is not in it).
    Under the interpreter bf16 is refused, so the smoke run takes fp16 (another key: plumbing only)."""
    from flashgen import AttentionSpec

    spec = AttentionSpec.from_yaml(ROOT / "examples/specs" / f"{name}.yaml")
    spec = spec.replace(tune=dict(spec.tune.to_dict(), seqlens=[doc["bucket"]]))
    return spec.replace(dtype="fp16") if smoke and spec.dtype == "bf16" else spec


@contextlib.contextmanager
def no_warm_starts(enabled: bool):
    """The from-scratch contrast: the tuner's warm_starts finds nothing (its only caller is
    _tune_phase, through the module global)."""
    import flashgen.tuner as tuner

    real = tuner.warm_starts
    if enabled:
        tuner.warm_starts = lambda *args, **kwargs: []
    try:
        yield
    finally:
        tuner.warm_starts = real


# ----------------------------------------------------------------------------- precompile
_WORKER: dict = {}


def _worker_init(smoke: bool):
    from flashgen.tuner import GpuRunner, InterpretRunner

    _WORKER["runner"] = InterpretRunner() if smoke else GpuRunner()
    _WORKER["works"] = {}


def _worker_kernel(spec_dict: dict, bucket: int, data: dict):
    """In a worker process: the runner, the spec's workload (made once per spec) and the
    point's kernel and config."""
    from flashgen import AttentionSpec
    from flashgen.api import AttentionKernel
    from flashgen.config import KernelConfig

    runner = _WORKER["runner"]
    spec = AttentionSpec.from_dict(spec_dict)
    work = _WORKER["works"].get(spec.key)
    if work is None:
        work = _WORKER["works"][spec.key] = runner.workload(spec, bucket, spec.tune.batch_tokens)
    config = KernelConfig.from_dict(data)
    return runner, work, AttentionKernel(spec, config), config


def _run_at_timing_shape(runner, kernel, config, work) -> None:
    """One forward at the workload's shape, so its timing later finds that specialization compiled."""
    import torch

    q, k, v, _ = work.tensors
    runner.forward(kernel, config, q, k, v, work.named)
    if runner.device == "cuda":
        torch.cuda.synchronize()


def _precompile(task):
    """Compile and verify one config on the full grid, then run it once at the timing shape:
    every specialization the tuner's trial and final round will launch is then in Triton's cache."""
    spec_dict, bucket, data, deadline = task
    if time.time() > deadline:
        return "skipped", 0.0
    start = time.time()
    try:
        runner, work, kernel, config = _worker_kernel(spec_dict, bucket, data)
        rec = runner.prepare(kernel, config, "fwd", work, full=True)
        if rec.status == "ok":
            _run_at_timing_shape(runner, kernel, config, work)
        return rec.status, time.time() - start
    except Exception as err:  # noqa: BLE001 - the tuner types it again when a seed reaches it
        return f"error: {type(err).__name__}", time.time() - start


def precompile(specs: dict, points: dict, jobs: int, seconds: float, smoke: bool) -> dict:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    deadline = time.time() + seconds
    tasks = [(specs[n].to_dict(), specs[n].tune.seqlens[0], p, deadline) for n in specs for p in points[n]]
    owners = [n for n in specs for _ in points[n]]
    out = {n: {"points": len(points[n]), "statuses": {}, "cpu_s": 0.0} for n in specs}
    start = time.time()
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                             initargs=(smoke,)) as pool:
        for owner, (status, s) in zip(owners, pool.map(_precompile, tasks)):
            out[owner]["statuses"][status] = out[owner]["statuses"].get(status, 0) + 1
            out[owner]["cpu_s"] += s
    for n in specs:
        out[n]["wall_s"] = round(time.time() - start, 1)
        out[n]["cpu_s"] = round(out[n]["cpu_s"], 1)
    return out


def space_points(spec, runner, base, first: list[dict]) -> list[dict]:
    """Every valid point of the spec's forward space as a config dict, the likely ones first."""
    from flashgen.space import forward_space

    space = forward_space(spec, runner.limits)
    full = [{**base.to_dict(), **p} for p in first] + [{**base.to_dict(), **p} for p in space.points()]
    seen, out = set(), []
    for d in full:
        key = json.dumps(d, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


# ----------------------------------------------------------------------------- the seeds
def locked_runner(smoke: bool, lock_path: str):
    """The tuner's runner, holding an inter-process lock around everything that runs on the
    device (workload, compile + verify, timing): several seeds run at once, their Optuna work
    (sampling, storage) overlapping, while the device runs one seed's kernels at a time, so no
    timing shares the GPU with another seed's kernels."""
    import fcntl

    import torch

    from flashgen.tuner import GpuRunner, InterpretRunner

    base = InterpretRunner if smoke else GpuRunner

    class Locked(base):
        waited_s = 0.0

        @contextlib.contextmanager
        def exclusive(self):
            start = time.monotonic()
            with open(lock_path, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                Locked.waited_s += time.monotonic() - start
                try:
                    yield
                    if self.device == "cuda":
                        torch.cuda.synchronize()
                finally:
                    fcntl.flock(f, fcntl.LOCK_UN)

        def workload(self, *args, **kwargs):
            with self.exclusive():
                return super().workload(*args, **kwargs)

        def prepare(self, *args, **kwargs):
            with self.exclusive():
                return super().prepare(*args, **kwargs)

        def measure(self, *args, **kwargs):
            with self.exclusive():
                return super().measure(*args, **kwargs)

    return Locked()


def _seed_init(smoke: bool, lock_path: str, specs: dict, tmp: str):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    _WORKER.update(runner=locked_runner(smoke, lock_path), specs=specs, tmp=Path(tmp))


def _seed_task(task):
    from flashgen import AttentionSpec

    name, start, seed, n_trials, deadline = task
    if time.time() > deadline:
        return None
    runner = _WORKER["runner"]
    waited = runner.waited_s
    out = one_search(AttentionSpec.from_dict(_WORKER["specs"][name]), runner, n_trials, seed, start == "warm",
                     _WORKER["tmp"])
    out.update(spec=name, start=start, lock_wait_s=round(runner.waited_s - waited, 2), pid=os.getpid())
    return out


def run_seeds(specs: dict, trials: dict, args, deadline: float, saved=lambda seeds: None) -> list[dict]:
    """Every (spec, start, seed) in --seed-procs processes; warm seeds first, interleaved over the
    specs, then the from-scratch ones; a seed not started by the deadline is left out."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    tasks = [(n, start, seed, trials[n], deadline) for start, count in (("warm", args.seeds),
                                                                         ("scratch", args.scratch_seeds))
             for seed in range(count) for n in specs]
    out = []
    with tempfile.TemporaryDirectory(dir=SCRATCH) as tmp, \
            ProcessPoolExecutor(args.seed_procs, mp_context=multiprocessing.get_context("spawn"),
                                initializer=_seed_init,
                                initargs=(args.smoke, f"{tmp}/device.lock", {n: s.to_dict() for n, s in specs.items()},
                                          tmp)) as pool:
        for s in pool.map(_seed_task, tasks):
            if s is None:
                continue
            out.append(s)
            print(f"{s['spec']} {s['start']} seed {s['seed']}: {s['trials']} trials ({s['measured']} measured) "
                  f"{s['wall_s']:.1f}s (device wait {s['lock_wait_s']:.1f}s) found {s['found_ms']} "
                  f"stored {s['stored_ms']}", flush=True)
            saved(out)
    return out


def one_search(spec, runner, n_trials: int, seed: int, warm: bool, tmp: Path) -> dict:
    """One `flashgen tune --no-default` of the spec's forward in a fresh store: what it stores,
    what the search alone found, its trials and wall time."""
    from flashgen.db import ResultStore
    from flashgen.tuner import TuneOptions, tune

    store = ResultStore(f"sqlite:///{tmp / '{}-{}-{}.sqlite'.format(spec.name, 'warm' if warm else 'scratch', seed)}")
    before, start = dict(runner.seconds), time.monotonic()
    with no_warm_starts(not warm):
        (res,) = tune(spec, runner, store, TuneOptions(trials=n_trials, seed=seed, phases=("fwd",),
                                                        enqueue_default=False))
    wall = time.monotonic() - start
    study = store.open_study(spec, runner.env, res.bucket, "fwd")
    records = [t.user_attrs for t in study.trials if "record" in t.user_attrs and not t.user_attrs.get("final")]
    evaluated = [a for a in records if a["record"]["status"] != "restricted"]
    store.close()
    return dict(seed=seed, warm_starts=res.warm_starts, wall_s=round(wall, 2),
                compile_verify_s=round(runner.seconds["compile_verify"] - before["compile_verify"], 2),
                timing_s=round(runner.seconds["timing"] - before["timing"], 2),
                trials=len(evaluated), measured=sum(1 for a in evaluated if not a.get("reused")),
                suggestions=len(study.trials), failures=res.failures,
                found=res.found.config if res.found else None, found_ms=res.found.ms if res.found else None,
                stored=res.best.config if res.best else None, stored_ms=res.best.ms if res.best else None,
                default_ms=res.default.ms if res.default else None)


# ----------------------------------------------------------------------------- re-timing
def retime(spec, runner, base, labelled: dict, repeats: int) -> dict:
    """Each config (label -> config dict): verified once, then timed in `repeats` interleaved
    rounds; the median of its rounds (ms)."""
    from flashgen.api import AttentionKernel
    from flashgen.config import KernelConfig

    work = runner.workload(spec, spec.tune.seqlens[0], spec.tune.batch_tokens)
    kernel = AttentionKernel(spec, base)
    configs = {label: KernelConfig.from_dict(d) for label, d in labelled.items()}
    ready = {}
    for label, config in configs.items():
        rec = runner.prepare(kernel, config, "fwd", work)
        ready[label] = rec
    rounds = {label: [] for label in configs}
    for _ in range(repeats):
        for label, config in configs.items():
            if ready[label].status != "ok":
                continue
            rec = runner.measure(kernel, config, "fwd", work, _copy(ready[label]))
            if rec.status == "ok":
                rounds[label].append(rec.ms)
    return {label: dict(config=labelled[label], status=ready[label].status,
                        ms=statistics.median(ms) if ms else None, rounds=[round(x, 5) for x in ms])
            for label, ms in rounds.items()}


def _copy(rec):
    import dataclasses

    return dataclasses.replace(rec)


def key_of(data: dict) -> str:
    from flashgen.db import config_key

    return config_key(data)


def forward_key(data: dict) -> str:
    """A config's forward knobs only (its backward knobs come from the bucket's default and
    do not change the forward's kernel): the replay's table key."""
    from flashgen.config import KernelConfig

    config = KernelConfig.from_dict(dict(data))
    return json.dumps({k: getattr(config, k) for k in KernelConfig.phase_knobs("fwd")}, sort_keys=True, default=str)


def summarize(name, doc, seeds: list[dict], timed: dict, n_trials: int, start: str) -> dict:
    """Per seed gap = chosen / fastest re-timed - 1, for what the search found and what the tune stored."""
    by_key = {key_of(t["config"]): t["ms"] for t in timed.values() if t["ms"] is not None}
    best = min(by_key.values())
    sweep_best = timed.get("sweep#1", {}).get("ms")
    out = dict(spec=name, bucket=doc["bucket"], phase="fwd", start=start, trials=n_trials,
               sweep_points=len(doc["records"]), sweep_ok=len(sweep_ranked(doc)), seeds=len(seeds),
               best_retimed_ms=best, best_retimed=min(timed, key=lambda k: timed[k]["ms"] or 1e9),
               sweep_best_retimed_ms=sweep_best)
    for what in ("found", "stored"):
        ms = [by_key.get(key_of(s[what])) if s[what] else None for s in seeds]
        gaps = [m / best - 1 if m else float("inf") for m in ms]
        out[f"{what}_median_gap"] = statistics.median(gaps) if gaps else None
        out[f"{what}_worst_gap"] = max(gaps) if gaps else None
        out[f"{what}_within_2pct"] = sum(g <= WITHIN for g in gaps)
        if sweep_best:
            out[f"{what}_median_gap_vs_sweep_best"] = statistics.median(
                [m / sweep_best - 1 if m else float("inf") for m in ms]) if ms else None
        for s, g in zip(seeds, gaps):
            s[f"{what}_gap"] = g
    out["trials_median"] = statistics.median(s["trials"] for s in seeds) if seeds else None
    out["measured_median"] = statistics.median(s["measured"] for s in seeds) if seeds else None
    out["wall_s_median"] = statistics.median(s["wall_s"] for s in seeds) if seeds else None
    out["distinct_found"] = len({key_of(s["found"]) for s in seeds if s["found"]})
    out["per_seed"] = seeds
    return out


# ----------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specs", default="gqa-causal,mha-hd64")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--scratch-seeds", type=int, default=20, help="from-scratch contrast seeds, time allowing")
    ap.add_argument("--fraction", type=float, default=0.25, help="trials per study / the sweep's valid points")
    ap.add_argument("--top", type=int, default=5, help="the sweep's fastest configs re-timed")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds of the re-timing")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2), help="precompile processes")
    ap.add_argument("--seed-procs", type=int, default=4, help="seeds run at once (the device locked per kernel run)")
    ap.add_argument("--precompile-s", type=float, default=130.0, help="cap of the precompile stage (0: none)")
    ap.add_argument("--budget-s", type=float, default=490.0, help="no new seed past this (then re-time)")
    ap.add_argument("--reserve-s", type=float, default=85.0, help="kept for the re-timing")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny: checks the script, measures nothing")
    ap.add_argument("--simulate", action="store_true",
                    help="CPU: the tuner's search over the H100 space with modelled times, to count distinct configs")
    ap.add_argument("--sweep", action="store_true",
                    help="GPU: time every valid point of today's space (the replay's table), one file per spec")
    ap.add_argument("--sweep-dir", type=Path, default=ROOT / "benchmarks/results/tuning")
    ap.add_argument("--replay", nargs="+", type=Path, default=None,
                    help="CPU: the tuner's search over these sweep files, --seeds seeds each")
    ap.add_argument("--noise", choices=("measured", "none", "both"), default="measured",
                    help="replay: each trial's time drawn around the sweep's (the sweep's repeat spread), exact, or both")
    args = ap.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.simulate:
        return simulate(args)
    if args.sweep:
        return sweep(args)
    if args.replay:
        return replay(args)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.seeds, args.scratch_seeds, args.top, args.repeats = min(args.seeds, 2), min(args.scratch_seeds, 1), 2, 2
        args.jobs, args.seed_procs = min(args.jobs, 2), min(args.seed_procs, 2)
    started = time.time()
    import optuna

    from flashgen.bench import environment
    from flashgen.config import KernelConfig, default_config
    from flashgen.db import ResultStore
    from flashgen.db.layer import layer_dir, read_file
    from flashgen.space import forward_space
    from flashgen.tuner import GpuRunner, InterpretRunner, warm_starts

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    runner = InterpretRunner() if args.smoke else GpuRunner()
    target = "cpu" if args.smoke else None
    names = [n for n in args.specs.split(",") if n]
    docs = {n: load_sweep(n) for n in names}
    specs = {n: bench_spec(n, docs[n], args.smoke) for n in names}
    trials = {n: 3 if args.smoke else max(1, round(len(sweep_ranked(docs[n])) * args.fraction)) for n in names}
    bases = {n: default_config(specs[n], target=target, seqlen=docs[n]["bucket"]) for n in names}
    shipped = {n: [r for path in sorted(layer_dir().glob("*.yaml")) for r in read_file(path)
                   if r["spec_key"] == specs[n].key and r["bucket"] == docs[n]["bucket"] and r["phase"] == "fwd"
                   and r["environment"].get("gpu") == runner.env.gpu] for n in names}
    def on_base(n, stored: dict) -> dict:  # a stored config's forward knobs on the bucket's default, as load merges it
        config = KernelConfig.from_dict(dict(stored))  # knobs it leaves out at their off value (the sweep: tma...)
        return bases[n].replace(**{k: getattr(config, k) for k in KernelConfig.phase_knobs("fwd")}).to_dict()

    sweep_top = {n: [on_base(n, r["config"]) for r in sweep_ranked(docs[n])[:args.top]] for n in names}
    result = dict(what=__doc__.split("\n\n")[0], command=" ".join([sys.argv[0], *(argv or sys.argv[1:])]),
                  environment=environment(), timing_label=runner.timing_label,
                  settings=dict(bucket={n: docs[n]["bucket"] for n in names}, trials=trials, seeds=args.seeds,
                                fraction=args.fraction, top=args.top, repeats=args.repeats, jobs=args.jobs,
                                smoke=args.smoke),
                  warm_starts={}, precompile={}, rows=[], retimed={})
    for n in names:  # what each seed's study starts from (its store is empty: tuning_db/ only)
        with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
            space_store = ResultStore(f"sqlite:///{d}/ws.sqlite")
            result["warm_starts"][n] = warm_starts(specs[n], runner.env, space_store, docs[n]["bucket"], "fwd",
                                                   forward_space(specs[n], runner.limits))
            space_store.close()

    def save():
        result["wall_s"] = round(time.time() - started, 1)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1, default=str))
            args.out.with_suffix(".md").write_text(report(result))

    if args.precompile_s > 0:
        first = {n: [*result["warm_starts"][n], {k: getattr(bases[n], k) for k in SWEPT_KNOBS}] for n in names}
        points = {n: space_points(specs[n], runner, bases[n], first[n]) for n in names}
        if args.smoke:
            points = {n: p[:3] for n, p in points.items()}
        result["precompile"] = precompile(specs, points, args.jobs, args.precompile_s, args.smoke)
        print("precompile", json.dumps(result["precompile"]), flush=True)
        save()

    deadline = started + args.budget_s - args.reserve_s
    seeds = run_seeds(specs, trials, args, deadline, lambda done: (result.update(partial_seeds=done), save()))
    runs = {(n, start): [s for s in seeds if (s["spec"], s["start"]) == (n, start)]
            for start in ("warm", "scratch") for n in names}
    result["seconds_to_seeds_end"] = round(time.time() - started, 1)
    for n in names:
        labelled = {f"sweep#{i + 1}": d for i, d in enumerate(sweep_top[n])}
        labelled["default"] = bases[n].to_dict()
        for i, row in enumerate(shipped[n]):
            labelled[f"shipped#{i + 1}"] = on_base(n, row["config"])
        known = {key_of(d) for d in labelled.values()}
        for (m, start), seeds in runs.items():
            for s in seeds if m == n else ():
                for what in ("found", "stored"):
                    if s[what] and key_of(s[what]) not in known:
                        known.add(key_of(s[what]))
                        labelled[f"{start}-s{s['seed']}-{what}"] = s[what]
        timed = retime(specs[n], runner, bases[n], labelled, args.repeats)
        result["retimed"][n] = timed
        for start in ("warm", "scratch"):
            if runs[(n, start)]:
                result["rows"].append(summarize(n, docs[n], runs[(n, start)], timed, trials[n], start))
        save()
    result.pop("partial_seeds", None)
    save()
    print(report(result))
    return result


def report(result: dict) -> str:
    env = result["environment"]
    lines = [f"# Search quality of `flashgen tune --no-default` ({env.get('gpu', 'CPU interpreter')}, "
             f"torch {env['torch']}, triton {env['triton']})", "", result["what"], "",
             f"Command: `{result['command']}`; {result.get('timing_label', '')}; wall {result.get('wall_s')} s.", ""]
    if result.get("precompile"):
        lines += ["Precompile (full-grid verify + timing shape, --jobs processes): " + "; ".join(
            f"{n} {p['points']} points {p['statuses']} {p['wall_s']} s" for n, p in result["precompile"].items()), ""]
    for n, ws in result.get("warm_starts", {}).items():
        lines.append(f"Warm starts of {n}: " + "; ".join(json.dumps(p, sort_keys=True) for p in ws))
    lines += ["", "| spec | start | trials | seeds | found: median gap | worst | within 2% | stored: median | "
              "within 2% | vs sweep best (found) | measured/seed | wall s/seed |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['spec']} | {r['start']} | {r['trials']} of {r['sweep_ok']} | {r['seeds']} | "
                     f"{r['found_median_gap']:.1%} | {r['found_worst_gap']:.1%} | {r['found_within_2pct']}/{r['seeds']} | "
                     f"{r['stored_median_gap']:.1%} | {r['stored_within_2pct']}/{r['seeds']} | "
                     f"{r.get('found_median_gap_vs_sweep_best', float('nan')):.1%} | {r['measured_median']} | "
                     f"{r['wall_s_median']} |")
    for n, timed in result.get("retimed", {}).items():
        lines += ["", f"Re-timed ({n}, median of interleaved rounds, ms):", "",
                  "| config | ms | BLOCK_M x BLOCK_N, warps, stages, order, tma, ws, family |", "|---|---|---|"]
        for label, t in sorted(timed.items(), key=lambda kv: kv[1]["ms"] or 1e9):
            c = t["config"]
            lines.append(f"| {label} | {t['ms'] if t['ms'] is None else round(t['ms'], 4)} | {c['BLOCK_M']}x{c['BLOCK_N']}, "
                         f"{c['num_warps']}, {c['num_stages']}, {c['loop_order']}, {c.get('tma')}, "
                         f"{c.get('warp_specialize')}, {c.get('family', 'portable')} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- today's exhaustive sweep (GPU)
def _sweep_point(task):
    """One point of the space, checked as the tuner checks it: verified as a trial verifies
    (prepare) and on the full grid (the final round's check), then run once at the timing shape
    so its timing finds it compiled. Returns (trial status, full-grid status, error, seconds)."""
    spec_dict, bucket, data = task
    start = time.time()
    try:
        runner, work, kernel, config = _worker_kernel(spec_dict, bucket, data)
        trial = runner.prepare(kernel, config, "fwd", work)
        full = runner.prepare(kernel, config, "fwd", work, full=True) if trial.status == "ok" else trial
        if trial.status == "ok":
            _run_at_timing_shape(runner, kernel, config, work)
        return trial.status, full.status, trial.error or full.error, time.time() - start
    except Exception as err:  # noqa: BLE001 - recorded as the point's status
        return "error", "error", f"{type(err).__name__}: {err}"[:300], time.time() - start


def sweep(args):
    """Every valid point of each spec's forward space at its bucket: checked in --jobs processes,
    then timed one at a time in this process (one do_bench median each), the fastest --top again
    in --repeats interleaved rounds. Writes one sweep file per spec (the replay's table)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import optuna

    from flashgen.api import AttentionKernel
    from flashgen.bench import environment
    from flashgen.config import KernelConfig, default_config
    from flashgen.db import TrialRecord
    from flashgen.tuner import GpuRunner, InterpretRunner

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    runner, started = InterpretRunner() if args.smoke else GpuRunner(), time.time()
    for n in [n for n in args.specs.split(",") if n]:
        doc = load_sweep(n)
        spec = bench_spec(n, doc, args.smoke)
        bucket = 64 if args.smoke else doc["bucket"]
        if args.smoke:
            spec = spec.replace(tune=dict(spec.tune.to_dict(), seqlens=[bucket], batch_tokens=128))
        base = default_config(spec, target="cpu" if args.smoke else None, seqlen=bucket)
        points = space_points(spec, runner, base, [])[:4 if args.smoke else None]
        out = dict(what="Exhaustive sweep of today's forward space (issue 16's search-quality table)",
                   command=" ".join([sys.argv[0], *(args.argv or [])]), environment=environment(),
                   timing_label=runner.timing_label, spec=spec.to_dict(), spec_key=spec.key, bucket=bucket,
                   phase="fwd", default=base.to_dict(), records=[])
        gpu = runner.env.gpu.split()[1].lower() if len(runner.env.gpu.split()) > 1 else "cpu"
        path = args.sweep_dir / f"{time.strftime('%Y-%m-%d')}-{gpu}-sweep-{n}-fwd{bucket}.json"
        t0 = time.time()
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                                 initargs=(args.smoke,)) as pool:
            checked = list(pool.map(_sweep_point, [(spec.to_dict(), bucket, p) for p in points]))
        out["check_wall_s"] = round(time.time() - t0, 1)
        print(f"{n}: {len(points)} points checked in {out['check_wall_s']} s", flush=True)
        work = runner.workload(spec, bucket, spec.tune.batch_tokens)
        kernel = AttentionKernel(spec, base)
        t0 = time.time()
        for data, (status, status_full, error, seconds) in zip(points, checked):
            config = KernelConfig.from_dict(data)
            rec = dict(config=config.to_dict(), status=status, status_full=status_full, error=error,
                       check_s=round(seconds, 2), ms=None, rounds=[])
            if status == "ok":
                timed = runner.measure(kernel, config, "fwd", work, TrialRecord(bucket, "fwd", config.to_dict(), "ok"))
                rec["status"], rec["error"] = timed.status, timed.error
                if timed.status == "ok":
                    rec["rounds"] = [timed.ms]
            out["records"].append(rec)
        ranked = sorted((r for r in out["records"] if r["rounds"]), key=lambda r: r["rounds"][0])[:args.top]
        for _ in range(args.repeats):  # the fastest again, interleaved: the table's best is not one noisy reading
            for r in ranked:
                config = KernelConfig.from_dict(r["config"])
                timed = runner.measure(kernel, config, "fwd", work, TrialRecord(bucket, "fwd", r["config"], "ok"))
                if timed.status == "ok":
                    r["rounds"].append(timed.ms)
        for r in out["records"]:
            r["ms"] = statistics.median(r["rounds"]) if r["rounds"] else None
        out["timing_wall_s"] = round(time.time() - t0, 1)
        ok = sorted((r for r in out["records"] if r["ms"] is not None), key=lambda r: r["ms"])
        spread = [statistics.pstdev(r["rounds"]) / statistics.mean(r["rounds"]) for r in ranked if len(r["rounds"]) > 1]
        out["summary"] = dict(points=len(points), timed=len(ok), best_ms=ok[0]["ms"] if ok else None,
                              best=ok[0]["config"] if ok else None,
                              statuses={s: sum(r["status"] == s for r in out["records"]) for s in
                                        sorted({r["status"] for r in out["records"]})},
                              full_failures=sum(r["status"] == "ok" and r["status_full"] != "ok"
                                                for r in out["records"]),
                              repeat_rel_stdev_median=statistics.median(spread) if spread else None)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1, default=str))
        print(n, json.dumps(out["summary"]), f"timing {out['timing_wall_s']} s -> {path}", flush=True)
        if time.time() - started > args.budget_s:
            print("budget spent: the remaining specs are left out", flush=True)
            break


# ----------------------------------------------------------------------------- the replay (CPU)
def replay(args):
    """The tuner's own search (flashgen.tuner.tune: sampler, warm starts from tuning_db/, trial
    verification, final round on the full grid; `--no-default`) run on the CPU against a GPU
    sweep's table: a trial's status and time are the sweep's for that point (optionally with
    the sweep's measured repeat noise). Gap = chosen point's sweep time / the sweep's best - 1."""
    import random as random_module

    import optuna

    from flashgen import AttentionSpec
    from flashgen.db import EnvInfo, ResultStore, TrialRecord
    from flashgen.space import DeviceLimits
    from flashgen.tuner import GpuRunner, TuneOptions, Workload, tune

    optuna.logging.set_verbosity(optuna.logging.ERROR)

    class ReplayRunner(GpuRunner):
        """A GpuRunner whose kernels are the sweep's records: nothing is compiled or run."""

        def __init__(self, doc, noise: float, seed: int):
            super().__init__()
            env = doc["environment"]
            self.table = {forward_key(r["config"]): r for r in doc["records"]}
            self.env = EnvInfo(gpu=env["gpu"], capability=env["capability"], sm_count=env["sm_count"],
                               memory_gib=env["memory_gib"], torch=env["torch"], triton=env["triton"],
                               cuda=env.get("cuda"), flashgen="", templates="")
            self.limits = DeviceLimits(env["gpu"], 232448.0, hopper=env["capability"] == "9.0")
            self.noise, self.rng, self.missing = noise, random_module.Random(seed), set()  # configs not in the sweep

        def workload(self, spec, bucket, batch_tokens):
            return Workload(bucket, 1, bucket, (), {}, 1)

        def prepare(self, kernel, config, phase, work, *, timeout_s=60.0, full=False):
            """The sweep's check of the point (the trial's grid, or the full grid); the tuner's
            final round calls it from threads."""
            d = config.to_dict()
            r = self.table.get(forward_key(d))
            if r is None:  # not a point of the swept space (its status is unknown): counted, never chosen
                self.missing.add(forward_key(d))  # a set: the final round checks a failure again alone
                return TrialRecord(work.bucket, phase, d, "error", error="not in the sweep")
            status = r["status_full"] if full and r["status"] == "ok" else r["status"]
            if status != "ok" or r["ms"] is None:
                return TrialRecord(work.bucket, phase, d, status if status != "ok" else "error", error=r["error"])
            return TrialRecord(work.bucket, phase, d, "ok", tflops=1.0)

        def measure(self, kernel, config, phase, work, rec, *, start=None, timeout_s=60.0):
            """The sweep's time of a checked point, with the noise drawn (one at a time, as timing is)."""
            if rec.status == "ok":
                ms = self.table[forward_key(rec.config)]["ms"]
                rec.ms = ms * (1.0 + self.rng.gauss(0.0, self.noise)) if self.noise else ms
            return rec

    result = dict(what=replay.__doc__.split("\n\n")[0].replace("\n", " "),
                  command=" ".join([sys.argv[0], *(args.argv or [])]), rows=[])
    for path in args.replay:
        doc = json.loads(Path(path).read_text())
        spec = AttentionSpec.from_dict(doc["spec"])
        timed = {forward_key(r["config"]): r["ms"] for r in doc["records"] if r["ms"] is not None and r["status_full"] == "ok"}
        best = min(timed.values())
        valid = sum(r["status"] == "ok" for r in doc["records"])
        n_trials = max(1, int(valid * args.fraction))  # at most the fraction
        noise = doc["summary"]["repeat_rel_stdev_median"] or 0.0
        for start, count in (("warm", args.seeds), ("scratch", args.scratch_seeds)):
            if count == 0:  # --scratch-seeds 0: the warm-started seeds only
                continue
            for sigma in {"measured": (noise,), "none": (0.0,), "both": (0.0, noise)}[args.noise]:
                gaps, trials, missing = [], [], 0
                with tempfile.TemporaryDirectory(dir=SCRATCH) as tmp, no_warm_starts(start == "scratch"):
                    for seed in range(count):
                        runner = ReplayRunner(doc, sigma, seed)
                        store = ResultStore(f"sqlite:///{tmp}/{start}-{sigma}-{seed}.sqlite")
                        (res,) = tune(spec, runner, store, TuneOptions(trials=n_trials, seed=seed, phases=("fwd",),
                                                                        enqueue_default=False))
                        study = store.open_study(spec, runner.env, res.bucket, "fwd")
                        trials.append(sum(1 for t in study.trials if "record" in t.user_attrs
                                          and not t.user_attrs.get("final")
                                          and t.user_attrs["record"]["status"] != "restricted"))
                        store.close()
                        found = timed.get(forward_key(res.found.config)) if res.found else None
                        gaps.append(found / best - 1 if found else float("inf"))
                        missing += len(runner.missing)
                row = dict(spec=doc["spec"]["name"], sweep=str(path), bucket=doc["bucket"], start=start,
                           noise=round(sigma, 4), seeds=count, valid_points=valid, trials=n_trials,
                           trials_fraction=round(n_trials / valid, 3), trials_run_median=statistics.median(trials),
                           best_ms=best, median_gap=statistics.median(gaps), worst_gap=max(gaps),
                           within_2pct=sum(g <= WITHIN for g in gaps), gaps=[round(g, 5) for g in gaps],
                           missing_points=missing)
                result["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "gaps"}), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str))
        lines = ["# Search quality: the tuner's search replayed on today's exhaustive H100 sweeps", "",
                 result["what"], "", f"Command: `{result['command']}`", "",
                 "| spec | start | noise | seeds | trials (of valid points) | median gap | worst | within 2% |",
                 "|---|---|---|---|---|---|---|---|"]
        for r in result["rows"]:
            lines.append(f"| {r['spec']} | {r['start']} | {r['noise']:.2%} | {r['seeds']} | {r['trials']} of "
                         f"{r['valid_points']} ({r['trials_fraction']:.0%}) | {r['median_gap']:.2%} | "
                         f"{r['worst_gap']:.2%} | {r['within_2pct']}/{r['seeds']} |")
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return result


# ----------------------------------------------------------------------------- CPU estimate
def simulate(args):
    """The tuner's real study code over the H100 forward space, with times modelled from the
    sweep (a swept point's time; tma, warp_specialize and the Gluon family as factors) and no
    kernel run: how many distinct configs 20 seeds reach (each a compile on the GPU), and how
    many trials. The model's gaps are not a measurement."""
    import optuna

    from flashgen.db import EnvInfo, ResultStore, TrialRecord
    from flashgen.space import DeviceLimits
    from flashgen.tuner import GpuRunner, TuneOptions, Workload, tune

    optuna.logging.set_verbosity(optuna.logging.ERROR)

    class SimRunner(GpuRunner):
        def __init__(self, table):
            super().__init__()
            self.table = table
            self.env = EnvInfo(gpu="NVIDIA H100 80GB HBM3", capability="9.0", sm_count=132, memory_gib=79.2,
                               torch="2.11.0", triton="3.6.0", cuda="13.0", flashgen="", templates="")
            self.limits = DeviceLimits("NVIDIA H100 80GB HBM3", 232448.0, hopper=True)
            self.evaluated = set()

        def workload(self, spec, bucket, batch_tokens):
            return Workload(bucket, 1, bucket, (), {}, 1)

        def prepare(self, kernel, config, phase, work, *, timeout_s=60.0, full=False):
            d = config.to_dict()
            self.evaluated.add(json.dumps(d, sort_keys=True))
            return TrialRecord(work.bucket, phase, d, "ok", tflops=1.0)

        def measure(self, kernel, config, phase, work, rec, *, start=None, timeout_s=60.0):
            d = rec.config
            ms = self.table.get(tuple(d[k] for k in SWEPT_KNOBS), 10.0)
            ms *= (0.97 if d.get("tma") else 1.0) * (0.98 if d.get("warp_specialize") else 1.0)
            if d.get("family") == "hopper_ws":
                ms *= 0.9 if (d["BLOCK_M"], d["BLOCK_N"]) == (128, 128) else 1.1
            rec.ms = ms
            return rec

    for n in args.specs.split(","):
        doc = load_sweep(n)
        spec = bench_spec(n, doc, False)
        runner = SimRunner({tuple(r["config"][k] for k in SWEPT_KNOBS): r["ms"] for r in sweep_ranked(doc)})
        n_trials = max(1, round(len(sweep_ranked(doc)) * args.fraction))
        per_seed = []
        with tempfile.TemporaryDirectory(dir=SCRATCH) as tmp:
            for seed in range(args.seeds):
                store = ResultStore(f"sqlite:///{tmp}/{seed}.sqlite")
                before = len(runner.evaluated)
                (res,) = tune(spec, runner, store, TuneOptions(trials=n_trials, seed=seed, phases=("fwd",),
                                                                enqueue_default=False))
                per_seed.append((len(runner.evaluated) - before, res.warm_starts, res.found.ms if res.found else None))
                store.close()
        print(json.dumps(dict(spec=n, trials=n_trials, seeds=args.seeds, distinct_configs=len(runner.evaluated),
                              new_configs_per_seed=[p[0] for p in per_seed], warm_starts=per_seed[0][1])))


if __name__ == "__main__":
    main()
