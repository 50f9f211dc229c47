"""One H100 run (engineer W, issue 17 on issue 18's kernels): the FP8 forward's q.k product promoted to
fp32 every 128 products at head dim 256, against the same kernels without it (the promotion removed from
the rendered text), and the Gluon dK/dV launch planned once per call key against its previous launch.

    python3 benchmarks/probe_fp8_qk_promote.py warm I N  # compile share I of N of the modules (run N at once)
    python3 benchmarks/probe_fp8_qk_promote.py accuracy  # max|err| / bound of out and LSE, with and without
    python3 benchmarks/probe_fp8_qk_promote.py speed     # module.forward TFLOP/s, do_bench medians, interleaved
    python3 benchmarks/probe_fp8_qk_promote.py host      # host us of module.backward, hd128 S=4096 causal

Each variant keeps its own Triton cache directory (belt and braces: the variants' kernels differ
only inside functions the warp-specialized partitions call, so no variant may take another's binary).
Not run yet: the session that wrote it had no device time left (see benchmarks/NOTES.md).
"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flashgen  # noqa: E402
from flashgen import AttentionSpec, KernelConfig, default_config  # noqa: E402
from flashgen.codegen import cache  # noqa: E402
from flashgen.verify import check_attention  # noqa: E402

CACHE_ROOT = os.environ.get("PROBE_TRITON_CACHE", "/tmp/probe-triton")
GLUON = dict(BLOCK_M=128, num_warps=4, num_stages=2, family="hopper_ws")
SPLIT = ("    k = k_smem.index(s).reshape([BLOCK_N, HEAD_DIM])\n    lo =", "    return lo + hi\n")
UNSPLIT = ("    kt = k_smem.index(s).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))\n"
           "    return warpgroup_mma(q, kt, zero, use_acc=False, is_async=True)\n")


def without_promotion(source: str) -> str:
    """The rendered module as it was before the promotion: one q.k MMA over the whole head dim."""
    source = source.replace(", max_num_imprecise_acc=FP8_QK_PROMOTE", "")
    start = source.find(SPLIT[0])
    if start >= 0:
        end = source.index(SPLIT[1], start) + len(SPLIT[1])
        source = source[:start] + UNSPLIT + source[end:]
    return source


def spec_of(d, causal):
    return AttentionSpec(dtype="fp8_e4m3", head_dim=d, num_heads=16, causal=causal)


def module_of(spec, config, variant):
    """(module, its Triton cache dir) for one variant ('promoted': as rendered; 'plain': without)."""
    source = flashgen.compile(spec, config).source()
    if variant == "plain":
        source = without_promotion(source)
    name = f"probe_{variant}_{spec.uri}"
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]  # the same in every process
    return cache.import_path(cache.cached_source_path(name, source)), f"{CACHE_ROOT}/{variant}-{digest}"


def use_cache(directory):
    os.environ["TRITON_CACHE_DIR"] = directory
    try:
        triton.knobs.cache.dir = directory
    except AttributeError:
        pass


def inputs(batch, heads, sq, sk, d, *, outliers=False, seed=0):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_fp8 import quantized_inputs

    q, k, v, qd, kd, vd = quantized_inputs(batch, heads, heads if heads == 1 else 2, sq, sk, d, device="cuda",
                                           outliers=outliers, seed=seed)
    return q, k, v, qd, kd, vd


# ------------------------------------------------------------------ the modules
ACCURACY_SHAPES = ((2, 4, 777, 1008), (1, 1, 4096, 4096))  # test_forward's xfail shape, test_default_path's


def acc_spec(causal, heads):
    return AttentionSpec(dtype="fp8_e4m3", head_dim=256, num_heads=heads, num_kv_heads=1 if heads == 1 else 2,
                         causal=causal)


def accuracy_modules(heads):
    """(label, spec, config) whose errors are compared: the xfail cases' kernels at hd256."""
    rows = []
    for causal in (True, False):
        spec = acc_spec(causal, heads)
        rows += [(f"gluon128x128 causal={causal}", spec, KernelConfig(BLOCK_N=128, **GLUON)),
                 (f"gluon128x64 causal={causal}", spec, KernelConfig(BLOCK_N=64, **GLUON)),
                 (f"portable-default causal={causal}", spec, default_config(spec, "h100", 4096))]
    return rows


SPEED_CASES = [(d, s, c) for d in (128, 256) for s in (4096, 16384) for c in (False, True)]


def speed_modules():
    rows = []
    for d, s, causal in SPEED_CASES:
        spec = spec_of(d, causal)
        rows.append((f"default hd{d} S={s} causal={causal}", spec, default_config(spec, "h100", s), s))
        if d == 256:
            rows.append((f"gluon128x64 hd{d} S={s} causal={causal}", spec, KernelConfig(BLOCK_N=64, **GLUON), s))
    return rows


def variants(d):
    return ("promoted", "plain") if d == 256 else ("promoted",)  # hd128: the same text either way


def bench_inputs(d, s):
    batch = max(1, 16384 // s)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_fp8 import quantized_inputs

    # 16 query and 16 KV heads, as spec_of's (inputs() makes the accuracy cases' GQA 4/2)
    q, k, v, qd, kd, vd = quantized_inputs(batch, 16, 16, s, s, d, device="cuda", seed=3)
    v = v.transpose(2, 3).contiguous().transpose(2, 3)  # seq-contiguous: what the FP8 wgmma reads, no copy
    return q, k, v, dict(q_descale=qd, k_descale=kd, v_descale=vd)


def warm(share, shares):
    jobs = [(spec, config, variant, shape) for shape in ACCURACY_SHAPES
            for _, spec, config in accuracy_modules(shape[1]) if spec.causal or shape[1] > 1
            for variant in variants(256)]
    jobs += [(spec, config, variant, s) for _, spec, config, s in speed_modules()
             for variant in variants(spec.head_dim)]
    for i, (spec, config, variant, s) in enumerate(jobs):
        if i % shares != share:
            continue
        module, directory = module_of(spec, config, variant)
        use_cache(directory)
        t0 = time.time()
        if isinstance(s, tuple):  # an accuracy shape
            q, k, v, qd, kd, vd = inputs(*s, 256)
            module.forward(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
        else:
            q, k, v, kw = bench_inputs(spec.head_dim, s)
            module.forward(q, k, v, **kw)
        torch.cuda.synchronize()
        print(f"warm {variant} {spec.uri} {config.family} {config.BLOCK_M}x{config.BLOCK_N} S={s}: "
              f"{time.time() - t0:.1f} s", flush=True)


def accuracy():
    print("| kernel | case | variant | out max err/bound | lse max err/bound | out passes | lse passes |")
    print("|---|---|---|---|---|---|---|")
    cases = [("777x1008 GQA 4/2", (2, 4, 777, 1008), False, 0), ("777x1008 outliers", (2, 4, 777, 1008), True, 0),
             ("4096 1 head seed 1", (1, 1, 4096, 4096), False, 1)]
    for case, (b, h, sq, sk), outliers, seed in cases:
        for label, spec, config in accuracy_modules(h):
            if not spec.causal and case != "777x1008 outliers":
                continue  # non-causal: the outlier case only (the excess was causal)
            q, k, v, qd, kd, vd = inputs(b, h, sq, sk, 256, outliers=outliers, seed=seed)
            for variant in variants(256):
                module, directory = module_of(spec, config, variant)
                use_cache(directory)
                out, lse = module.forward(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
                o, l_ = check_attention(out, lse, q, k, v, causal=spec.causal, descales=(qd, kd, vd))
                print(f"| {label} | {case} | {variant} | {o.margin:.3f} | {l_.margin:.3f} | {o.ok} | {l_.ok} |",
                      flush=True)


def speed(rounds=3):
    from triton.testing import do_bench

    print("| case | config | variant | TFLOP/s (median of rounds) | ms per round |")
    print("|---|---|---|---|---|")
    only = sys.argv[2] if len(sys.argv) > 2 else ""  # a substring of the rows' labels to time
    for label, spec, config, s in speed_modules():
        if only not in label:
            continue
        d = spec.head_dim
        q, k, v, kw = bench_inputs(d, s)
        flops = 4 * q.shape[0] * 16 * s * s * d * (0.5 if spec.causal else 1.0)
        mods = {variant: module_of(spec, config, variant) for variant in variants(d)}
        times = {variant: [] for variant in mods}
        for _ in range(rounds):
            for variant, (module, directory) in mods.items():
                use_cache(directory)
                times[variant].append(do_bench(lambda: module.forward(q, k, v, **kw), warmup=10, rep=60))
        for variant, ms in times.items():
            med = statistics.median(ms)
            print(f"| {label} | {config.family} {config.BLOCK_M}x{config.BLOCK_N} s{config.num_stages} | {variant} | "
                  f"{flops / med / 1e9:.0f} | {', '.join(f'{t:.3f}' for t in ms)} |", flush=True)


def host():
    """module.backward's host time (a sync before each call, perf_counter around the call alone) and
    its GPU time, with the previous HopperDkdv (Triton's launch path, four descriptors per call)."""
    from triton.testing import do_bench

    from flashgen.runtime import hopper_bwd
    from flashgen.runtime.hopper import HopperForward
    from flashgen.runtime.launch import BackwardPlan

    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=16, causal=True, backward=True)
    config = default_config(spec, "h100", 4096)
    module = flashgen.compile(spec, config).module()
    q, k, v = (torch.randn(1, 16, 4096, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    out, lse = module.forward(q, k, v)
    do = torch.randn_like(out)
    module.backward(do, q, k, v, out, lse)
    (plan,) = [p for p in module._LAUNCHER.plans.values() if isinstance(p, BackwardPlan)]
    served = isinstance(plan.dkdv, hopper_bwd.HopperDkdv)
    backward = module._LAUNCHER.hopper_backward
    new_run = hopper_bwd.HopperDkdv.run

    def old_run(self, context, args):  # the previous launch (commit a85ecf4's HopperBackward.launch)
        q, k, v, do, lse, delta, dk, dv = args[:8]
        block_m, consumers, stages = backward.TILES[128]
        batch, heads, seqlen_q, head_dim = q.shape
        kv_heads, seqlen_k = k.shape[1], k.shape[2]
        kd, vd = (HopperForward.descriptor(t, "bhsd", backward.CONSUMER_ROWS, head_dim) for t in (k, v))
        qd, dod = (HopperForward.descriptor(t, "bhsd", block_m, head_dim) for t in (q, do))
        scale = 128 ** -0.5
        backward.kernel[(triton.cdiv(seqlen_k, 64 * consumers), kv_heads, batch)](
            kd, vd, qd, dod, lse, delta, dk, dv, *lse.stride()[:2], *dk.stride()[:3], *dv.stride()[:3], seqlen_q,
            seqlen_k, heads // kv_heads, scale * backward.RCP_LN2, scale, CAUSAL=True, NUM_STAGES=stages,
            CONSUMERS=consumers, PRODUCER_REGS=backward.PRODUCER_REGS, CONSUMER_REGS=backward.CONSUMER_REGS,
            num_warps=4)
        return dk, dv

    results, grads = {}, {}
    for _ in range(3):
        for name, run in (("before", old_run), ("after", new_run)):
            hopper_bwd.HopperDkdv.run = run
            grads[name] = module.backward(do, q, k, v, out, lse)
            host_us = []
            for _ in range(40):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                module.backward(do, q, k, v, out, lse)
                host_us.append((time.perf_counter() - t0) * 1e6)
            gpu_ms = do_bench(lambda: module.backward(do, q, k, v, out, lse), warmup=5, rep=40)
            results.setdefault(name, []).append((statistics.median(host_us), gpu_ms))
    hopper_bwd.HopperDkdv.run = new_run
    same = all(torch.equal(a, b) for a, b in zip(grads["before"][:3], grads["after"][:3]))
    print(f"hopper_bwd served: {served}; dq, dk, dv bitwise equal before/after: {same}")
    for name, rows in results.items():
        print(f"module.backward {name}: host us (median of 40, per round) "
              f"{', '.join(f'{h:.1f}' for h, _ in rows)}; GPU ms {', '.join(f'{g:.3f}' for _, g in rows)}")


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "warm":
        warm(int(sys.argv[2]), int(sys.argv[3]))
    else:
        {"accuracy": accuracy, "speed": speed, "host": host}[what]()
