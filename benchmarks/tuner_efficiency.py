"""How good is the search? An exhaustive sweep of a spec's space on the GPU, then Optuna
replayed over the recorded results (a simulation runner: no GPU needed for the replay).

    # on the GPU: measure every valid point of one bucket and phase
    PYTHONPATH=. python3 benchmarks/tuner_efficiency.py sweep --spec examples/specs/gqa-causal.yaml \
        --bucket 4096 --phase fwd --out sweep.json
    # anywhere: replay the tuner's sampler for a quarter of the sweep's trials, many seeds,
    # started as `flashgen tune` starts a study: from the nearest tuned specs (tuning_db/) on the
    # sweep's GPU, the swept spec itself left out, no hand-set default
    PYTHONPATH=. python3 benchmarks/tuner_efficiency.py replay sweep.json --fraction 0.25 --seeds 20 --warm-start
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def sweep(args):
    from flashgen import AttentionSpec
    from flashgen.bench import environment
    from flashgen.tuner import GpuRunner, InterpretRunner, exhaustive

    spec = AttentionSpec.from_yaml(args.spec)
    runner = InterpretRunner() if args.interpret else GpuRunner()
    records = exhaustive(spec, runner, args.bucket, args.phase)
    doc = dict(spec=spec.to_dict(), bucket=args.bucket, phase=args.phase, environment=environment(),
               records=[dataclasses.asdict(r) for r in records])
    Path(args.out).write_text(json.dumps(doc, indent=1))
    ok = [r for r in records if r.status == "ok"]
    print(f"{len(records)} points, {len(ok)} ok; best {min(r.ms for r in ok):.4f} ms")


def replay(args):
    import optuna

    from flashgen import AttentionSpec, default_config
    from flashgen.db import config_key
    from flashgen.space import DeviceLimits, SearchSpace, backward_space, forward_space
    from flashgen.tuner import make_sampler

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    doc = json.loads(Path(args.sweep).read_text())
    spec = AttentionSpec.from_dict(doc["spec"])
    # The space the sweep enumerated: each knob's choices as the sweep measured them.
    knobs = list((forward_space if doc["phase"] == "fwd" else backward_space)(spec, DeviceLimits("x", 0.0)).params)
    choices = {k: tuple(sorted({r["config"][k] for r in doc["records"]}, key=str)) for k in knobs}
    space = SearchSpace(doc["phase"], choices)
    measured = {}
    for r in doc["records"]:
        point = {k: r["config"][k] for k in knobs}
        measured[config_key(point)] = r["ms"] if r["status"] == "ok" else None
    best_ms = min(v for v in measured.values() if v is not None)
    starts = _warm_starts(doc, spec, knobs, choices) if args.warm_start else []
    n_trials = max(1, round(len(measured) * args.fraction))
    found = []
    for seed in range(args.seeds):
        def objective(trial):
            point = {n: trial.suggest_categorical(n, list(c)) for n, c in space.params.items()}
            ms = measured.get(config_key(point))
            if ms is None:  # restricted or failed in the sweep: the tuner prunes it too
                raise optuna.TrialPruned()
            return ms

        study = optuna.create_study(direction="minimize", sampler=make_sampler(args.sampler, seed, space))
        if args.start_from_default:  # as `flashgen tune` did: the heuristic default is trial 0
            default = default_config(spec, target=args.target)
            study.enqueue_trial({k: getattr(default, k) for k in knobs})
        for point in starts:
            study.enqueue_trial(point)
        study.optimize(objective, n_trials=n_trials)
        done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        found.append(min(t.value for t in done) if done else float("inf"))
    gaps = [f / best_ms - 1 for f in found]
    within = sum(g <= 0.02 for g in gaps)
    print(json.dumps(dict(
        spec=spec.uri, bucket=doc["bucket"], phase=doc["phase"], sampler=args.sampler,
        start_from_default=args.start_from_default, warm_starts=starts, sweep_points=len(measured),
        sweep_ok=sum(v is not None for v in measured.values()), sweep_best_ms=best_ms, trials=n_trials,
        seeds=args.seeds, median_gap=statistics.median(gaps), worst_gap=max(gaps),
        seeds_within_2pct=within), indent=1))


def _warm_starts(doc, spec, knobs, choices) -> list[dict]:
    """What `flashgen tune` enqueues first for this spec on the sweep's GPU, from tuning_db/
    with the swept spec's own results left out; only points the sweep measured."""
    from flashgen.db import EnvInfo
    from flashgen.db.layer import layer_dir, read_file
    from flashgen.db.neighbours import warm_starts

    gpu = doc["environment"]
    here = EnvInfo(gpu=gpu["gpu"], capability=gpu["capability"], sm_count=gpu["sm_count"],
                   memory_gib=gpu["memory_gib"], torch="", triton=gpu["triton"], cuda=gpu["cuda"], flashgen="",
                   templates="")
    rows = [row for path in sorted(layer_dir().glob("*.yaml")) for row in read_file(path)]
    points = warm_starts(spec.key, spec.canonical(), here, doc["bucket"], doc["phase"], rows, knobs, k=len(rows))
    return [p for p in points if all(p[k] in choices[k] for k in knobs)][:3]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sweep")
    s.add_argument("--spec", required=True)
    s.add_argument("--bucket", type=int, required=True)
    s.add_argument("--phase", choices=("fwd", "bwd"), default="fwd")
    s.add_argument("--out", required=True)
    s.add_argument("--interpret", action="store_true", help="through the interpreter (to try the script)")
    r = sub.add_parser("replay")
    r.add_argument("sweep")
    r.add_argument("--fraction", type=float, default=0.25)
    r.add_argument("--seeds", type=int, default=20)
    r.add_argument("--sampler", default="tpe")
    r.add_argument("--start-from-default", action="store_true", help="enqueue the heuristic default first")
    r.add_argument("--target", default="h100", help="GPU whose heuristic default is enqueued")
    r.add_argument("--warm-start", action="store_true",
                   help="enqueue the best configs of the nearest tuned specs first (as `flashgen tune` does)")
    args = ap.parse_args()
    (sweep if args.cmd == "sweep" else replay)(args)


if __name__ == "__main__":
    main()
