"""flashgen.attention's default training step beside cuDNN's, for Nsight Compute's hardware counters.

bf16, 16384 tokens per batch (2048 / head dim heads), bhsd. Two modes:
  time  JSON lines per case and provider: forward, fwd+bwd and backward (their difference) ms, do_bench medians
  ncu   one fwd+bwd step per case and provider between cudaProfilerStart and Stop (process-wide: the
        backward's kernels launch from autograd's device thread), for ncu --profile-from-start off
Cases: head dim, causal (0/1), sequence length, as d:c:s,...; default hd128 causal or not at 16384 and 4096.

    PYTHONPATH=. python3 benchmarks/probe_kernel_counters.py time [128:1:16384,...]
    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats python3 benchmarks/probe_kernel_counters.py ncu 128:1:16384 > counters.txt
(results/2026-11-28-h200-bwd-spills-s26.md: the Gluon dK/dV kernel's local-memory spills found this way.)
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flashgen  # noqa: E402
from flashgen.bench import sdpa_runner  # noqa: E402
from flashgen.flops import attention_flops, tflops  # noqa: E402
from flashgen.timing import time_ms  # noqa: E402

CASES = "128:1:16384,128:0:16384,128:1:4096,128:0:4096"


def case(text: str) -> tuple[int, bool, int]:
    try:
        d, causal, seqlen = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected head_dim:causal:seqlen (e.g. 128:1:16384), got {text!r}") from None
    return d, bool(causal), seqlen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("time", "ncu"))
    parser.add_argument("cases", nargs="?", default=CASES, help="head_dim:causal:seqlen,... (default %(default)s)")
    args = parser.parse_args()
    try:
        cases = [case(c) for c in args.cases.split(",")]
    except argparse.ArgumentTypeError as err:
        parser.error(f"cases: {err}")
    cudnn = sdpa_runner(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
    providers = {"flashgen": lambda q, k, v, causal: flashgen.attention(q, k, v, causal=causal), "cudnn": cudnn}
    for d, causal, seqlen in cases:
        heads, batch = 2048 // d, max(1, 16384 // seqlen)  # 16384 tokens per batch (one sequence past that)
        q, k, v = (torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        do = torch.randn_like(q)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        name = f"hd{d} S={seqlen}{' causal' if causal else ''}"
        for provider, fn in providers.items():
            def step(fn=fn):
                for t in leaves:
                    t.grad = None
                fn(*leaves, causal).backward(do)
            step()
            step()
            torch.cuda.synchronize()
            if args.mode == "time":
                fwd = time_ms(lambda fn=fn: fn(q, k, v, causal))
                full = time_ms(step)
                flops = attention_flops(batch, heads, seqlen, seqlen, d, causal=causal, mode="bwd")
                print(json.dumps({"case": name, "provider": provider, "fwd_ms": fwd, "fwd_bwd_ms": full,
                                  "bwd_ms": full - fwd, "bwd_tflops": tflops(flops, full - fwd)}), flush=True)
            else:
                torch.cuda.profiler.start()  # (process-wide: the backward runs on autograd's device thread)
                step()
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
                print("profiled", name, provider, flush=True)


if __name__ == "__main__":
    main()
