"""Host time of flashgen's call paths on a machine with no GPU: everything a call does in Python
before and around its launches (binding the call to a kernel, checks, allocations, autograd,
Triton's launch path), with H100 default configs compiled for sm90 by tests/sm90_compile.py's driver and the
compiled kernels' launchers replaced by a no-op (so Triton's own launch path runs in full up to
the C launcher, which needs a GPU). Issue 13 case: B=1, H=16, S=128, head dim 128, causal, bf16.

Each case is timed with bound launches and call plans (the default) and without them
(FLASHGEN_BOUND_LAUNCH=0: Triton's launch path and every check on every call), in one process.
fwd+bwd takes torch.autograd.grad of q, k, v (as bench_call_path.py does): .backward() would add
into their .grad, and the CPU's bf16 adds (3 x 262k elements) would dominate, while a model's
q, k, v are activations that accumulate nothing.

    PYTHONPATH=. python3 benchmarks/call_path_host.py [--repeat 5] [--calls 300] [--profile CASE]
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import sm90_compile  # noqa: E402
from triton.compiler.compiler import CompiledKernel  # noqa: E402
from triton.runtime import driver  # noqa: E402

B, H, S, D = 1, 16, 128, 128


def keep_freed_memory():
    """Have glibc keep freed blocks instead of returning them to the OS: otherwise each step's
    fresh 0.5 MB tensors are new pages, and the few CPU-side fills a step makes (dk.zero_() for
    packed sequences, a memset on a GPU) cost page faults, not host work."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD (32 MiB: its largest value)


def mock_launches():
    """sm90 compiles on the CPU; a compiled kernel's launcher does nothing; default configs are the
    H100's (tensor descriptors, warp specialization), as a user there gets them."""
    driver.set_active(sm90_compile.Sm90Driver())
    import flashgen.config

    flashgen.config.detect_target = lambda: "h100"
    from flashgen.runtime.hopper import HopperForward

    HopperForward.device_unserved = staticmethod(lambda device: None)  # CPU tensors take the Gluon forward

    def init_handles(self):
        if self.module is None:
            self.module, self.function, self._run = "mock", 0, lambda *args: None

    CompiledKernel._init_handles = init_handles


def cases():
    import flashgen
    from flashgen.compat import flash_attn_func

    q, k, v = (torch.randn(B, H, S, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, S, D, dtype=torch.bfloat16)
    qs, ks, vs = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))  # bshd
    packed = [t.detach().transpose(1, 2).reshape(B * S, H, D).requires_grad_() for t in (q, k, v)]  # thd
    do_packed = do.transpose(1, 2).reshape(B * S, H, D)
    cu = torch.tensor([0, S // 2, S], dtype=torch.int32)

    def forward():
        with torch.no_grad():
            flashgen.attention(q, k, v, causal=True)

    def forward_grad():
        flashgen.attention(q, k, v, causal=True)

    def fwd_bwd():
        torch.autograd.grad(flashgen.attention(q, k, v, causal=True), (q, k, v), do)

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_call_path import AllocOnly  # an autograd.Function that allocates what flashgen's does

    def autograd_floor():
        torch.autograd.grad(AllocOnly.apply(q, k, v)[0], (q, k, v), do)

    # The same step with the one-launch short backward forced off (the H100 default's other knobs): the
    # preprocess, dK/dV and dQ launches and the delta buffer it saves, in this process beside the default.
    from flashgen.api import spec_for
    from flashgen.config import default_config

    portable = default_config(spec_for(q, k, v, causal=True, softmax_scale=None, layout="bhsd"), "h100",
                              S).replace(bwd_short=False)

    def fwd_bwd_portable():
        torch.autograd.grad(flashgen.attention(q, k, v, causal=True, config=portable), (q, k, v), do)

    def varlen_forward():
        with torch.no_grad():
            flashgen.attention_varlen(*packed, cu, cu, S // 2, S // 2, causal=True)

    def varlen_fwd_bwd():
        torch.autograd.grad(flashgen.attention_varlen(*packed, cu, cu, S // 2, S // 2, causal=True), packed, do_packed)

    def compat_forward():
        with torch.no_grad():
            flash_attn_func(qs, ks, vs, causal=True)

    keep = torch.ones(S, S, dtype=torch.bool).tril()  # SDPA's bool mask (L, S), broadcast over batch and heads

    def sdpa_forward():
        with torch.no_grad():
            flashgen.scaled_dot_product_attention(q, k, v, is_causal=True)

    def sdpa_fwd_bwd():
        torch.autograd.grad(flashgen.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do)

    def sdpa_mask_forward():
        with torch.no_grad():
            flashgen.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    def sdpa_mask_fwd_bwd():
        torch.autograd.grad(flashgen.scaled_dot_product_attention(q, k, v, attn_mask=keep), (q, k, v), do)

    # the same mask, its block map made on every call (a plan made with TensorBlockMap's small-call map off; a copy
    # one byte off 16-byte alignment keys a plan of its own, its host work the same)
    from flashgen.runtime.host import TensorBlockMap

    keep_by_column = torch.empty(S * S + 1, dtype=torch.bool)[1:].view(S, S).copy_(keep)

    def per_call_map(step):
        def call():
            limit, TensorBlockMap.STATIC_PAIRS = TensorBlockMap.STATIC_PAIRS, 0  # (read when a plan is made)
            try:
                step()
            finally:
                TensorBlockMap.STATIC_PAIRS = limit
        return call

    def sdpa_mask_forward_map():
        with torch.no_grad():
            flashgen.scaled_dot_product_attention(q, k, v, attn_mask=keep_by_column)

    def sdpa_mask_fwd_bwd_map():
        torch.autograd.grad(flashgen.scaled_dot_product_attention(q, k, v, attn_mask=keep_by_column), (q, k, v), do)

    bias = torch.randn(B, H, S, S, dtype=torch.bfloat16)  # SDPA's float mask (B, H, L, S), added to the scores

    def sdpa_bias_forward():
        with torch.no_grad():
            flashgen.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    # A document mask's kernel object (what flashgen.load serves) with its document ids, two documents per row
    doc_kernel = flashgen.compile(flashgen.AttentionSpec(dtype="bf16", head_dim=D, num_heads=H, backward=True,
                                                         mask={"document": {"causal": True}}))
    doc_ids = torch.tensor([[0] * (S // 2) + [1] * (S - S // 2)] * B, dtype=torch.int32)

    def document_forward():
        with torch.no_grad():
            doc_kernel(q, k, v, document_ids=doc_ids)

    def document_fwd_bwd():
        torch.autograd.grad(doc_kernel(q, k, v, document_ids=doc_ids), (q, k, v), do)

    # A generation step as transformers makes it: one query per row over a (B, S, H_kv, D) view of its
    # (B, H_kv, S, D) cache, S one longer each step, so each call's metadata is new: its plans are
    # forgotten before every call (compiled kernels stay shared by specialization).
    from flashgen import ops
    from flashgen.runtime import host

    q1 = torch.randn(4, 1, 16, D, dtype=torch.bfloat16)
    caches = [torch.randn(4, 4, 129 + i, D, dtype=torch.bfloat16).transpose(1, 2) for i in range(32)]
    steps = itertools.count()

    def forget_plans():
        """Forget each module's call plans of exact metadata (a new length's), not the length-free
        plans of decode-shaped calls or their routes to the decode kernel (AttentionLauncher.decode_call):
        those a generation loop keeps."""
        for module in ops._MODULES.values():
            plans = module._LAUNCHER.plans
            for key in [key for key in plans if key is None or key[0] not in ("decode", host.DECODER)]:
                del plans[key]

    def generation_step():
        forget_plans()
        cache = caches[next(steps) % len(caches)]
        with torch.no_grad():
            flashgen.attention(q1, cache, cache, causal=True, layout="bshd")

    # The same over caches of 4097..4160 keys: past AttentionLauncher.DECODER_KEYS, on the split-KV
    # decode kernel (before session 16, the prefill kernel's Gluon plans, one per length).
    long_storage = torch.randn(4 * 4 * 4160 * D, dtype=torch.bfloat16)
    long_caches = [long_storage[:4 * 4 * n * D].view(4, 4, n, D).transpose(1, 2) for n in range(4097, 4161)]

    def long_generation_step():
        forget_plans()
        cache = long_caches[next(steps) % len(long_caches)]
        with torch.no_grad():
            flashgen.attention(q1, cache, cache, causal=True, layout="bshd")

    # The same step through the transformers integration (flashgen.integrations.transformers), on each
    # of its routes: through flashgen.attention and to the split-KV decode kernel (decode_calls, the default).
    # query (B, H, 1, D), key/value (B, H_kv, S, D) as DynamicCache's torch.cat makes them (contiguous,
    # strides depending on S; views of one buffer here). Each call is a new length. Prefill route: S
    # cycles through 129..512 (a 128-token prompt and its generation; longer caches give the prefill
    # kernel tensor descriptors, which keep Triton's launch path) and its plans are forgotten before
    # every call, as in the row above. Decode route: nothing is forgotten by hand, S cycles through
    # 4096 lengths from 129, more than DecodeLauncher.MAX_CALLS, so no call finds state its length left.
    from flashgen.integrations import transformers as fg_tf
    from flashgen.runtime.decode import DecodeLauncher

    cycle = max(4096, 2 * DecodeLauncher.MAX_CALLS)
    storage = torch.randn(4 * 4 * (129 + cycle) * D, dtype=torch.bfloat16)
    query = torch.randn(4, 16, 1, D, dtype=torch.bfloat16)
    layer = type("Layer", (), {"is_causal": True})()

    def transformers_step(decode):
        lengths = itertools.cycle(range(129, 129 + cycle) if decode else range(129, 513))

        def step():
            seqlen = next(lengths)
            cache = storage[:4 * 4 * seqlen * D].view(4, 4, seqlen, D)
            if not decode:
                forget_plans()
            fg_tf.decode_calls = decode
            try:
                with torch.no_grad():
                    fg_tf.attention_forward(layer, query, cache, cache, None, scaling=D ** -0.5)
            finally:
                fg_tf.decode_calls = False
        return step

    # A Llama layer's training call through the integration (bench_transformers' model: 16 / 4 heads, causal, no
    # mask), B=1 x 2048 tokens: the query a (B, H, L, D) view of (B, L, H, D) memory (its projection's transpose),
    # keys and values contiguous (B, H_kv, L, D) (DynamicCache's torch.cat), the backward by autograd.grad.
    tq = torch.randn(1, 2048, 16, D, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    tk, tv = (torch.randn(1, 4, 2048, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    tdo = torch.randn(1, 2048, 16, D, dtype=torch.bfloat16)

    def transformers_train_step():
        out, _ = fg_tf.attention_forward(layer, tq, tk, tv, None, scaling=D ** -0.5)
        torch.autograd.grad(out, (tq, tk, tv), tdo)

    # The Hopper warp-specialized forward (family hopper_ws), where it is the H100 default at hd128:
    # causal from 4096 tokens, full attention from 1024 (B=1, H=16, bf16, no grad).
    long_inputs = {seqlen: [torch.randn(1, H, seqlen, D, dtype=torch.bfloat16) for _ in range(3)]
                   for seqlen in (1024, 4096)}

    def hopper_forward(seqlen, causal):
        def call():
            with torch.no_grad():
                flashgen.attention(*long_inputs[seqlen], causal=causal)
        return call

    return {"forward (no grad)": forward, "forward (grad)": forward_grad, "fwd+bwd": fwd_bwd,
            "fwd+bwd autograd floor (allocating autograd.Function, no kernels)": autograd_floor,
            "fwd+bwd, bwd_short off (portable backward)": fwd_bwd_portable,
            "varlen forward": varlen_forward, "varlen fwd+bwd": varlen_fwd_bwd, "compat forward": compat_forward,
            "SDPA-shaped forward (is_causal)": sdpa_forward, "SDPA-shaped fwd+bwd (is_causal)": sdpa_fwd_bwd,
            "SDPA-shaped forward (bool mask)": sdpa_mask_forward,
            "SDPA-shaped fwd+bwd (bool mask)": sdpa_mask_fwd_bwd,
            "SDPA-shaped forward (bool mask, block map per call)": per_call_map(sdpa_mask_forward_map),
            "SDPA-shaped fwd+bwd (bool mask, block map per call)": per_call_map(sdpa_mask_fwd_bwd_map),
            "SDPA-shaped forward (float mask (B, H, L, S))": sdpa_bias_forward,
            "document mask forward (kernel object, document_ids)": document_forward,
            "document mask fwd+bwd (kernel object, document_ids)": document_fwd_bwd,
            "generation step (B=4, 16/4 heads, new length)": generation_step,
            "generation step over 4097+ keys": long_generation_step,
            "transformers generation step, prefill kernel": transformers_step(False),
            "transformers generation step, decode kernel (decode_calls)": transformers_step(True),
            "transformers training call (B=1 x 2048, 16/4 heads, fwd+bwd)": transformers_train_step,
            "hopper_ws forward S=1024 (full)": hopper_forward(1024, False),
            "hopper_ws forward S=4096 (causal)": hopper_forward(4096, True)}


def per_call_us(call, calls, repeat, clock=time.perf_counter):
    call()
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        for _ in range(calls):
            call()
        best = min(best, (clock() - t0) / calls * 1e6)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--profile", help="cProfile this case (bound launches on) instead of timing")
    parser.add_argument("--sort", default="tottime", help="the profile's order: tottime, cumulative, ...")
    parser.add_argument("--rows", type=int, default=25, help="the profile's rows printed")
    parser.add_argument("--cases", help="time only the cases whose name contains this text")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by this process's CPU time (time.process_time), not the wall clock: on a "
                             "shared machine other processes' load then moves the figures less")
    parser.add_argument("--decode-queries", type=int, default=None,
                        help="AttentionLauncher.DECODE_QUERIES (0: no length-free plans, each new length plans afresh)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a CPU-side fill is a GPU memset there; no OpenMP barriers on a busy machine
    keep_freed_memory()
    mock_launches()
    from flashgen.runtime import host
    from flashgen.runtime.launch import BoundLaunch

    host.AttentionLauncher.interpreting = lambda self: True  # accept CPU tensors: nothing is launched
    if args.decode_queries is not None:
        host.AttentionLauncher.DECODE_QUERIES = args.decode_queries
    table = cases()
    if args.profile:
        call = table[args.profile]
        call()
        profile = cProfile.Profile()
        profile.runcall(lambda: [call() for _ in range(args.calls)])
        pstats.Stats(profile).sort_stats(args.sort).print_stats(args.rows)
        return
    clock = "CPU time" if args.cpu_time else "wall clock"
    print(f"flashgen host us per call, B={B} H={H} S={S} hd{D} causal bf16 (least of {args.repeat} x {args.calls}, "
          f"{clock})")
    print("| case | bound launches | Triton's path (FLASHGEN_BOUND_LAUNCH=0) |\n|---|---|---|")
    for name, call in table.items():
        if args.cases and args.cases not in name:
            continue
        times = []
        for enabled in (True, False):
            BoundLaunch.enabled = enabled
            times.append(per_call_us(call, args.calls, args.repeat,
                                     time.process_time if args.cpu_time else time.perf_counter))
        BoundLaunch.enabled = True
        print(f"| {name} | {times[0]:.1f} | {times[1]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
