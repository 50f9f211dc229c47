"""Candidate configs per masked case on the GPU alone: the data flashgen/config.py's mask-aware
defaults are read from (issue 15).

For each case of bench_masked_user_path.py (same inputs, same reference check on a slice), a few
forward configs are timed as forward calls and a few backward configs (tiles, warps, stages,
dq_strategy, bwd_tma, bwd_persistent, bwd_fused_delta, bwd_dq_heavy_first) as backward calls after one forward.
Named backward configs have bwd_dq_heavy_first off unless their knobs turn it on ("default" is the bucket's
default as it is; "default -hf" the same without it). Times are
CUDA-graph replays (kernels only: the host time of a call is the launch path's business, not the
config's). Beside them, the user path of today's default (eager do_bench and its graph replay) shows
where a case is bound by host work. Compiles are warmed first in parallel worker processes.

--root runs another checkout's flashgen (e.g. the main branch beside a work branch, in the same
run: an A/B of the same configs by name); --fwd/--bwd time only the configs so named.

    PYTHONPATH=. python3 benchmarks/masked_defaults_sweep.py --out DIR [--cases ...] [--seqlens ...]
        [--pairs CASE@SEQLEN ...] [--fwd NAME ...] [--bwd NAME ...] [--root CHECKOUT] [--no-user]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if "--root" in sys.argv:  # another checkout's flashgen, imported before bench_masked_user_path's own
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--root") + 1]).resolve()))

import flashgen  # noqa: E402  (first: bench_masked_user_path puts this checkout first on the path)

import bench_masked_user_path as B  # noqa: E402
from flashgen import KernelConfig, default_config  # noqa: E402
from flashgen.bench import environment, file_tag  # noqa: E402
from flashgen.flops import pairs_flops, tflops  # noqa: E402


def fwd(m, n, warps, stages, tma=False, ws=False):
    return dict(BLOCK_M=m, BLOCK_N=n, num_warps=warps, num_stages=stages, tma=tma, warp_specialize=ws)


def bwd(m1, n1, m2, n2, warps, stages, dq="separate", tma=False, persistent=0, fused_delta=False, heavy_first=False):
    knobs = dict(BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=m2, BLOCK_N2=n2, bwd_num_warps=warps, bwd_num_stages=stages,
                 dq_strategy=dq, bwd_tma=tma, bwd_persistent=persistent)
    # later knobs only when on: a checkout without them can run the others
    return dict(knobs, **({"bwd_fused_delta": True} if fused_delta else {}),
                **({"bwd_dq_heavy_first": True} if heavy_first else {}))


# Per head dim: (name, knobs). Seeded from benchmarks/results/masks/*.md (best tiles per mask) and
# the shipped tuning results (128x32 TMA forward for windows, 64x128/128x64 x 8 warps backward).
FWD = {128: [("default", {}), ("128x128 tma ws", fwd(128, 128, 8, 3, True, True)), ("128x128 tma", fwd(128, 128, 8, 3, True)),
             ("128x64 tma", fwd(128, 64, 8, 3, True)), ("128x32 tma", fwd(128, 32, 8, 3, True)),
             ("64x64", fwd(64, 64, 4, 3)), ("64x64 tma", fwd(64, 64, 4, 3, True)), ("64x32", fwd(64, 32, 4, 3))],
       64: [("128x64", fwd(128, 64, 8, 3)), ("128x64 ws", fwd(128, 64, 8, 3, False, True)),
            ("128x64 tma", fwd(128, 64, 8, 3, True)), ("128x128", fwd(128, 128, 8, 3)),
            ("64x64", fwd(64, 64, 4, 3)), ("128x32 tma", fwd(128, 32, 8, 3, True))]}
BWD = {128: [("default", {}), ("64/64 s2", bwd(64, 64, 64, 64, 4, 2)), ("64/64 s2 atomic", bwd(64, 64, 64, 64, 4, 2, "atomic")),
             ("64/64 s2 p1", bwd(64, 64, 64, 64, 4, 2, persistent=1)),
             ("64/64 s2 p2", bwd(64, 64, 64, 64, 4, 2, persistent=2)),
             ("64/64 s2 atomic p2", bwd(64, 64, 64, 64, 4, 2, "atomic", persistent=2)),
             ("64/64 s3", bwd(64, 64, 64, 64, 4, 3)), ("64/64 s2 tma", bwd(64, 64, 64, 64, 4, 2, tma=True)),
             ("32x64/64x32 s3", bwd(32, 64, 64, 32, 4, 3)),
             ("64x128/128x64 w8 s3 tma", bwd(64, 128, 128, 64, 8, 3, tma=True)),
             ("64x128/128x64 w8 s3 tma p1", bwd(64, 128, 128, 64, 8, 3, tma=True, persistent=1)),
             # delta from the dQ kernel (no preprocess pass), issue 15's second sweep
             ("64/64 s2 tma fd", bwd(64, 64, 64, 64, 4, 2, tma=True, fused_delta=True)),
             ("64/64 s3 tma fd", bwd(64, 64, 64, 64, 4, 3, tma=True, fused_delta=True)),
             ("32x64/64x32 s3 fd", bwd(32, 64, 64, 32, 4, 3, fused_delta=True)),
             ("32x64/64x32 s3 tma fd", bwd(32, 64, 64, 32, 4, 3, tma=True, fused_delta=True)),
             # issue 15's third sweep: wider tiles at 8 warps with fused delta (128 query rows per dK/dV
             # tile, 128 keys per dQ tile: the walks of short masks visit half as many tiles), and fused
             # delta where the second sweep did not try it
             ("64/64 s2 fd", bwd(64, 64, 64, 64, 4, 2, fused_delta=True)),
             ("32x64/64x32 s2 fd", bwd(32, 64, 64, 32, 4, 2, fused_delta=True)),
             ("32x64/64x64 s2 tma fd", bwd(32, 64, 64, 64, 4, 2, tma=True, fused_delta=True)),
             ("128x64/64x128 w8 s2 tma fd", bwd(128, 64, 64, 128, 8, 2, tma=True, fused_delta=True)),
             ("64x128/128x64 w8 s2 tma fd", bwd(64, 128, 128, 64, 8, 2, tma=True, fused_delta=True)),
             # issue 15's third sweep: the dQ grid heaviest block first (bwd_dq_heavy_first), the
             # default without it, and wider tiles with it
             ("default -hf", {"bwd_dq_heavy_first": False}),
             ("64/64 s2 tma fd hf", bwd(64, 64, 64, 64, 4, 2, tma=True, fused_delta=True, heavy_first=True)),
             ("32x64/64x64 s2 tma fd hf", bwd(32, 64, 64, 64, 4, 2, tma=True, fused_delta=True, heavy_first=True)),
             ("128x64/64x128 w8 s2 tma fd hf", bwd(128, 64, 64, 128, 8, 2, tma=True, fused_delta=True,
                                                   heavy_first=True)),
             ("64x128/128x64 w8 s2 tma fd hf", bwd(64, 128, 128, 64, 8, 2, tma=True, fused_delta=True,
                                                   heavy_first=True))],
       64: [("default", {}), ("64/64 s3", bwd(64, 64, 64, 64, 4, 3)), ("64/64 s3 atomic", bwd(64, 64, 64, 64, 4, 3, "atomic")),
            ("64/64 s3 p1", bwd(64, 64, 64, 64, 4, 3, persistent=1)),
            ("64/64 s3 p2", bwd(64, 64, 64, 64, 4, 3, persistent=2)),
            ("64/64 s2", bwd(64, 64, 64, 64, 4, 2)), ("64/64 s3 tma", bwd(64, 64, 64, 64, 4, 3, tma=True)),
            ("32x64/64x32 s3", bwd(32, 64, 64, 32, 4, 3)),
            ("64x128/128x64 w8 s3", bwd(64, 128, 128, 64, 8, 3)),
            ("64x128/128x64 w8 s3 tma p1", bwd(64, 128, 128, 64, 8, 3, tma=True, persistent=1)),
            ("64/64 s3 tma fd", bwd(64, 64, 64, 64, 4, 3, tma=True, fused_delta=True)),
            ("64/64 s3 fd", bwd(64, 64, 64, 64, 4, 3, fused_delta=True)),
            ("32x64/64x32 s3 fd", bwd(32, 64, 64, 32, 4, 3, fused_delta=True)),
            ("128x64/64x128 w8 s3 fd", bwd(128, 64, 64, 128, 8, 3, fused_delta=True)),
            ("64x128/128x64 w8 s3 tma fd", bwd(64, 128, 128, 64, 8, 3, tma=True, fused_delta=True)),
            ("default -hf", {"bwd_dq_heavy_first": False}),
            ("64/64 s3 hf", bwd(64, 64, 64, 64, 4, 3, heavy_first=True)),
            ("128x64/64x128 w8 s3 fd hf", bwd(128, 64, 64, 128, 8, 3, fused_delta=True, heavy_first=True))]}


SELECTED = {"fwd": None, "bwd": None}  # --fwd / --bwd: the config names to time (None: all)


def candidates(case, seqlen=None):
    base = default_config(case.spec(), seqlen=seqlen)
    out = []
    for phase, table in (("fwd", FWD), ("bwd", BWD)):
        for name, knobs in table[case.head_dim]:
            if SELECTED[phase] is None or name in SELECTED[phase]:
                if name != "default" and phase == "bwd" and hasattr(base, "bwd_dq_heavy_first"):
                    knobs = {"bwd_dq_heavy_first": False, **knobs}  # named configs say it when on
                out.append((phase, name, base.replace(**knobs)))
    return out


def _warm_config(name, seqlen, phase, config: dict):
    case = next(c for c in B.CASES if c.name == name)
    x = B.make_inputs(case, seqlen)
    module = flashgen.compile(x.spec, KernelConfig.from_dict(config)).module()
    out, lse = module.forward(x.q, x.k, x.v, tensors=x.tensors)
    if phase == "bwd":
        module.backward(x.do, x.q, x.k, x.v, out, lse, tensors=x.tensors)


def sweep_case(case, seqlen, user=True) -> dict:
    x = B.make_inputs(case, seqlen)
    ref = B.SliceReference(x)
    result = {"case": case.name, "seqlen": seqlen, "batch": x.batch, "fwd": {}, "bwd": {}, "user": {}}
    flops = {m: pairs_flops(x.pairs, case.head_dim, mode=m) for m in ("fwd", "bwd", "fwd_bwd")}
    for phase, name, cfg in candidates(case, seqlen):
        module = flashgen.compile(x.spec, cfg).module()
        try:
            if phase == "fwd":
                fn = lambda: module.forward(x.q, x.k, x.v, tensors=x.tensors)  # noqa: E731
                err = ref.check("fwd", [fn()[0]])
            else:
                out, lse = module.forward(x.q, x.k, x.v, tensors=x.tensors)
                fn = lambda: module.backward(x.do, x.q, x.k, x.v, out, lse, tensors=x.tensors)  # noqa: E731
                err = ref.check("fwd_bwd", fn()[:3])
            if err:
                result[phase][name] = {"error": err}
                continue
            ms = B.gpu_ms(fn, rep=10)
            result[phase][name] = {"ms": ms, "tflops": tflops(flops[phase], ms) if ms else None}
        except Exception as exc:  # noqa: BLE001 (reported per config)
            result[phase][name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    kernel = flashgen.compile(x.spec)  # the user path with today's default
    for mode in B.MODES if user else ():
        fn = B.step(lambda q, k, v: kernel(q, k, v, **x.tensors), x, mode)
        ms, gms = B.time_ms(fn), B.gpu_ms(fn)
        result["user"][mode] = {"eager_ms": ms, "gpu_ms": gms, "tflops": tflops(flops[mode], ms)}
    return result


def table(r) -> str:
    lines = [f"## {r['case']} S={r['seqlen']} (batch {r['batch']})"]
    for phase in ("fwd", "bwd"):
        ok = sorted(((v["ms"], k) for k, v in r[phase].items() if v.get("ms")))
        bad = [f"{k}: {v['error'][:80]}" for k, v in r[phase].items() if "error" in v]
        lines.append(f"{phase}: " + ", ".join(f"{k} {ms:.3f}" for ms, k in ok) + (f" | ERR {bad}" if bad else ""))
    u = r["user"]
    lines.append("user default: " + ", ".join(f"{m} eager {v['eager_ms']:.3f} gpu {v['gpu_ms'] or 0:.3f}"
                                              for m, v in u.items()))
    return "\n".join(lines)


def markdown(data) -> str:
    env = data["environment"]
    lines = [f"# Masked defaults sweep: GPU time per config ({env.get('gpu')}, torch {env['torch']}, "
             f"triton {env['triton']}, {env['date']})", "",
             "bf16, 16 heads, 16384 tokens per batch. ms: CUDA-graph replay of module.forward (fwd) or "
             "module.backward after one default forward (bwd), kernels only; every config checked on a slice "
             "against the dense reference first. Ranked fastest first; x: ms / the fastest. user: today's "
             "default through the eager user path (do_bench, host time included) and its graph replay.", ""]
    for r in data["results"]:
        lines.append(f"## {r['case']}, S={r['seqlen']} (batch {r['batch']})")
        for phase in ("fwd", "bwd"):
            ok = sorted((v["ms"], k) for k, v in r[phase].items() if v.get("ms"))
            cells = [f"{k} {ms:.3f} ({ms / ok[0][0]:.2f}x)" for ms, k in ok]
            cells += [f"{k}: FAILED {v['error'][:100]}" for k, v in r[phase].items() if "error" in v]
            lines.append(f"- {phase}: " + "; ".join(cells))
        lines.append("- user: " + "; ".join(f"{m} eager {v['eager_ms']:.3f} ms, graph {v['gpu_ms'] or 0:.3f} ms"
                                            for m, v in r["user"].items()))
        lines.append("")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--report", type=Path, help="print the markdown report of a sweep's JSON and exit")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/masks"))
    parser.add_argument("--cases", nargs="+", default=[c.name for c in B.CASES])
    parser.add_argument("--seqlens", type=int, nargs="+", default=None)
    parser.add_argument("--pairs", nargs="+", default=None, help="only these CASE@SEQLEN (e.g. document_4@4096)")
    parser.add_argument("--workers", type=int, default=15)
    parser.add_argument("--dry", action="store_true")
    parser.add_argument("--fwd", nargs="*", help="forward config names to time (default: all)")
    parser.add_argument("--bwd", nargs="*", help="backward config names to time (default: all)")
    parser.add_argument("--root", help="the checkout whose flashgen is timed (default: this one)")
    parser.add_argument("--no-user", action="store_true", help="skip the user-path timings of the default")
    parser.add_argument("--tag", default="", type=file_tag, help="appended to the output files' names")
    args = parser.parse_args()
    SELECTED.update(fwd=args.fwd, bwd=args.bwd)
    print(f"flashgen from {Path(flashgen.__file__).parent}", flush=True)
    if args.report:
        print(markdown(json.loads(args.report.read_text())))
        return
    if args.dry:
        B.dry_run()
    env = {**environment(), "date": time.strftime("%Y-%m-%d")}
    todo = [(c, s) for c in B.CASES if c.name in args.cases for s in c.seqlens
            if (args.seqlens is None or s in args.seqlens) and (args.pairs is None or f"{c.name}@{s}" in args.pairs)]
    todo.sort(key=lambda cs: (cs[1] != 4096, cs[1]))  # S=4096 first, then 1024, then 16384
    t0 = time.time()
    jobs = {}  # one compile per (case, phase, config); per length too where a named tensor's shape is an argument
    for c, s in todo:
        for phase, _, cfg in candidates(c, s):
            spec = c.spec()
            key = (spec.key, phase, str(cfg.to_dict()), s if spec.tensor_names else None)
            jobs.setdefault(key, (_warm_config, (c.name, s, phase, cfg.to_dict())))
    jobs = list(jobs.values())
    for line in B.warm_up(jobs, 1 if args.dry else args.workers):
        if not line.startswith("ok"):
            print("warm", line, flush=True)
    print(f"warm-up {len(jobs)} jobs {time.time() - t0:.0f}s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for case, seqlen in todo:
        t1 = time.time()
        results.append(sweep_case(case, seqlen, not args.no_user))
        print(table(results[-1]), f"({time.time() - t1:.0f}s)", flush=True)
        data = {"environment": env, "flashgen_root": str(Path(flashgen.__file__).parent.parent), "results": results}
        (args.out / f"masked-defaults-sweep{args.tag}.json").write_text(json.dumps(data, indent=1))
        (args.out / f"masked-defaults-sweep{args.tag}.md").write_text(markdown(data))


if __name__ == "__main__":
    main()
