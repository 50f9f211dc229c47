"""Host time of a documents call on the GPU host: microseconds per call to submit 100 calls (no
synchronization inside; the GPU's own time is below the host's at these sizes, so this is the host's
Python and launches) and with a final synchronize, for the forward, the fwd+bwd step and the runs
table alone; with --profile, a cProfile of each. bench_masked_user_path's inputs and its default
call (flashgen.compile(spec)(q, k, v, document_ids=...)), bf16, 16 heads, hd128, 16384 tokens.

    PYTHONPATH=. python3 benchmarks/probe_document_host.py TAG [--profile]

Run it in two trees one after the other (alternating, twice) to compare them: the host's speed moves
by a third between runs (benchmarks/NOTES.md).
"""

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_masked_user_path as bm  # noqa: E402
import flashgen  # noqa: E402
from flashgen.runtime import host  # noqa: E402


def submit_us(fn, n=100, rounds=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        times.append(((t1 - t0) / n * 1e6, (time.perf_counter() - t0) / n * 1e6))
    submit = sorted(t[0] for t in times)
    synced = sorted(t[1] for t in times)
    return f"submit min {submit[0]:.1f} med {submit[rounds // 2]:.1f} | with sync med {synced[rounds // 2]:.1f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tag", help="printed before each row (the tree's name)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    for name, seqlen in (("document_16", 4096), ("document_4", 4096)):
        case = next(c for c in bm.CASES if c.name == name)
        x = bm.make_inputs(case, seqlen)
        kernel = flashgen.compile(x.spec)

        def forward():
            with torch.no_grad():
                kernel(x.q, x.k, x.v, **x.tensors)

        step = bm.step(lambda q, k, v: kernel(q, k, v, **x.tensors), x, "fwd_bwd")
        ids = next(iter(x.tensors.values()))
        print(args.tag, name, seqlen, "fwd:", submit_us(forward), flush=True)
        print(args.tag, name, seqlen, "fwd+bwd:", submit_us(step, n=50), flush=True)
        print(args.tag, name, seqlen, "runs_table alone:", submit_us(lambda: host.runs_table(ids)), flush=True)
        if args.profile:
            for what, fn, calls in (("forward calls", forward, 200), ("fwd+bwd steps", step, 100)):
                profile = cProfile.Profile()
                profile.runcall(lambda: [fn() for _ in range(calls)])
                torch.cuda.synchronize()
                print(args.tag, name, seqlen, f"cProfile of {calls} {what}")
                pstats.Stats(profile).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
