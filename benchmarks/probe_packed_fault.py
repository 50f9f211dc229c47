"""Reproduces the one-tile packed Gluon forward's fault (sessions 61-63): a kernel variant run in --procs processes
at once on one GPU for --seconds each, every call's output compared whole with torch's SDPA over the same tokens as
a dense batch. Each process prints a line per call that faulted (the CUDA error ends it) or left sequences wrong
(NaN, or more than 0.05 off), then its count of calls.

The fault's cause (session 63): the kernel's warp_specialize partitions took the sequence's bounds and O's pointer
from the default partition's registers, which Triton passes through a shared buffer, and Triton had placed that
buffer over the ping-pong turns' mbarriers, unused without ping-pong but initialized: plain stores over an
initialized mbarrier are undefined in PTX. Under other processes' load the kernel raised illegal memory accesses
(3 of 3 processes); with the partitions reading the bounds themselves, or with those barriers left uninitialized,
none did (results/2026-12-03-h200-packed-fault-s63.md). A tree of c1f164a or before shows it again.

Variants (bf16, --sequences sequences of 1000 tokens, 32/8 heads, hd128, non-causal; the H200 default config's knobs
at 1024 tokens: two consumers, overlap, TMA store):
  one_tile               the one-tile packed kernel (max_seqlen 1024: lengths that may differ)
  one_tile_no_tma_store  the same without the TMA store
  dense_one_tile         the same tokens as a dense (sequences, 1000) bshd batch on the dense one-tile kernel
  persistent             the persistent packed kernel (max_seqlen 1000: sequences of one length)
  default                what attention_varlen runs with max_seqlen 1024 as shipped (since session 63 the one_tile
                         call itself; sessions 61-62 the portable forward)
  fp8_one_tile           the same tokens in FP8 e4m3 (descales 1) as a dense batch on the FP8 default at 16384 plain
                         tokens, the one-tile FP8 kernel (128 x 256 tiles, TMA store), whose partitions take the
                         descales through shared memory too; compared with SDPA on the dequantized inputs

    PYTHONPATH=. python3 benchmarks/probe_packed_fault.py one_tile dense_one_tile [--procs 3] [--seconds 30]

Needs an sm90 GPU and, at 540 sequences, about 11 GB of its memory per process for q, k, v and out, and a few GB
more for the reference's chunks (estimated, not measured); nothing is written but the printed lines. Exits 1 when
a process met a fault or wrong sequences (an out-of-memory error is reported as such, not as a fault), else 0.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("one_tile", "one_tile_no_tma_store", "dense_one_tile", "persistent", "default", "fp8_one_tile")
LENGTH, HEADS, KV_HEADS, HEAD_DIM = 1000, 32, 8, 128


def config_for(variant, q, k, v):
    """The call's config= (None: the default)."""
    import torch

    from flashgen.api import spec_for
    from flashgen.config import default_config

    base = default_config(spec_for(q, k, v, causal=False, softmax_scale=None, layout="thd"), None, 1024)
    if variant == "fp8_one_tile":  # (FP8's default at 16384 plain tokens: the one-tile grid)
        fp8 = [t.view(-1, LENGTH, *t.shape[1:]).to(torch.float8_e4m3fn) for t in (q, k, v)]
        config = default_config(spec_for(*fp8, causal=False, softmax_scale=None, layout="bshd"), None, 16384)
        assert not config.hopper_persistent and config.family == "hopper_ws", config
        return config
    return {"one_tile": None, "one_tile_no_tma_store": base.replace(hopper_tma_store=False),
            "dense_one_tile": base.replace(hopper_persistent=False), "persistent": None, "default": None}[variant]


def wrong_sequences(out, dense, sequences, chunk=64):
    """(indices, max |diff| of each) of the sequences whose output is more than 0.05 off torch's SDPA, or not
    finite; compared `chunk` sequences at a time (float32 copies of the whole output took 9 GB each)."""
    import torch

    diffs = []
    for start in range(0, sequences, chunk):
        part = [t[start:start + chunk].transpose(1, 2) for t in dense]
        ref = torch.nn.functional.scaled_dot_product_attention(*part, enable_gqa=True).transpose(1, 2)
        got = out.view(sequences, LENGTH, HEADS, HEAD_DIM)[start:start + chunk]
        diffs.append((got.float() - ref.float()).abs().amax(dim=(1, 2, 3)))
    diff = torch.cat(diffs)
    wrong = ((diff > 0.05) | ~torch.isfinite(diff)).nonzero().flatten()
    return wrong, diff[wrong]


def child(variant: str, sequences: int, seconds: float, tag: str) -> int:
    import torch

    import flashgen

    longest = LENGTH if variant == "persistent" else 1024
    total = sequences * LENGTH
    calls = wrong_calls = 0
    fp8 = None
    start = None  # (from the first call's end: its compile is not in --seconds)
    while start is None or time.time() - start < seconds:
        gen = torch.Generator(device="cuda").manual_seed(1000 * int(tag) + calls)
        q = torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(total, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        cu = torch.arange(0, total + 1, LENGTH, device="cuda", dtype=torch.int32)
        if calls == 0:
            config = config_for(variant, q, k, v)
        # out's memory NaN before the call (the allocator hands this block back): a row nothing wrote shows
        torch.full((total * HEADS * HEAD_DIM,), float("nan"), device="cuda", dtype=torch.bfloat16)  # (freed at once)
        dense = [t.view(sequences, LENGTH, -1, HEAD_DIM) for t in (q, k, v)]
        try:
            if variant == "fp8_one_tile":  # (the reference: SDPA on the dequantized inputs)
                fp8 = [t.to(torch.float8_e4m3fn) for t in dense]
                dense = [t.to(torch.bfloat16) for t in fp8]
                out = flashgen.attention(*fp8, layout="bshd", config=config)
            elif variant == "dense_one_tile":
                out = flashgen.attention(*dense, layout="bshd", config=config)
            else:
                out = flashgen.attention_varlen(q, k, v, cu, cu, longest, longest, config=config)
            torch.cuda.synchronize()
        except torch.OutOfMemoryError as err:  # (not the fault: fewer --procs or --sequences)
            print(f"[{variant} {tag}] call {calls}: out of memory: {str(err).splitlines()[0][:160]}", flush=True)
            return 2
        except Exception as err:  # noqa: BLE001 - the fault is what this probe looks for
            print(f"[{variant} {tag}] call {calls}: FAULT: {str(err).splitlines()[0][:160]}", flush=True)
            return 1
        wrong, diffs = wrong_sequences(out, dense, sequences)
        if len(wrong):
            wrong_calls += 1
            print(f"[{variant} {tag}] call {calls}: {len(wrong)} wrong sequences {wrong[:6].tolist()}, max |diff| "
                  f"{diffs[:6].tolist()}", flush=True)
        out = q = k = v = dense = fp8 = None  # (the next call's buffers take their memory, as the first call's did)
        calls += 1
        start = start or time.time()
    print(f"[{variant} {tag}] {calls} calls, {wrong_calls} with wrong sequences, no fault", flush=True)
    return 1 if wrong_calls else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="+", choices=VARIANTS)
    p.add_argument("--procs", type=int, default=3, help="processes per variant, at once")
    p.add_argument("--seconds", type=float, default=30.0, help="each process's time (calls start until then)")
    p.add_argument("--sequences", type=int, default=540, help="sequences of 1000 tokens per call")
    p.add_argument("--child", nargs=2, metavar=("VARIANT", "TAG"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child[0], args.sequences, args.seconds, args.child[1])
    failed = False
    for variant in args.variants:
        procs = [subprocess.Popen([sys.executable, __file__, variant, "--sequences", str(args.sequences),
                                   "--seconds", str(args.seconds), "--child", variant, str(i)])
                 for i in range(args.procs)]
        codes = [proc.wait() for proc in procs]  # (all of them, before the next variant starts)
        failed |= any(codes)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
