"""First H100 look (run 1 of 2026-11-22; the knobs are written in today's names: hopper_regs=168
gave both consumers and the producer 168 registers then, it now means 168 for the consumers) at the Hopper warp-specialized forward (templates/hopper/forward.j2), before
it was wired into flashgen: the kernel is loaded straight from the template (it has no Jinja
beyond its comments) and launched through flashgen.runtime.hopper.HopperForward.

1. Correctness (TESTING.md's rule, flashgen.verify.check_attention) over odd lengths,
   seqlen_q != seqlen_k both ways, GQA, bshd, fp16/bf16, causal or not, each knob variant.
2. Forward timings (bf16, 16384 tokens, 16 heads x hd128 / 32 x hd64): the family's variants
   beside the portable default and cuDNN, one process; do_bench medians.

    python3 benchmarks/hopper_ws_probe.py [--budget 280]
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import flashgen  # noqa: E402
from flashgen import AttentionSpec, default_config  # noqa: E402
from flashgen.bench import sdpa_runner  # noqa: E402
from flashgen.flops import attention_flops, tflops  # noqa: E402
from flashgen.runtime.hopper import HopperForward  # noqa: E402
from flashgen.timing import time_ms  # noqa: E402
from flashgen.verify import check_attention  # noqa: E402


def load_kernel():
    src = re.sub(r"\{#.*?#\}", "", (ROOT / "templates" / "hopper" / "forward.j2").read_text(), flags=re.S)
    path = Path(tempfile.mkdtemp()) / "hopper_ws_probe_kernel.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("hopper_ws_probe_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._attn_fwd_hopper_ws


KNOBS = dict(BLOCK_M=128, BLOCK_N=128, num_stages=2, hopper_regs=240, hopper_overlap=True)  # as run on 2026-11-22


def run_ws(kernel, q, k, v, layout, causal, knobs, scale=None):
    d = q.shape[-1]
    spec = dict(dtype="bf16" if q.dtype == torch.bfloat16 else "fp16", head_dim=d, head_dim_v=d, mask=None,
                score_mod=None, dropout_p=0.0, target="auto", causal=causal)
    hf = HopperForward(kernel, spec, {})
    o = torch.full_like(q, float("nan"))
    b, h, sq = (q.shape[0], q.shape[1], q.shape[2]) if layout == "bhsd" else (q.shape[0], q.shape[2], q.shape[1])
    lse = torch.full((b, h, sq), float("nan"), device=q.device)
    return hf.launch(q, k, v, o, lse, layout, scale if scale is not None else d ** -0.5, {**HopperForward.KNOB_DEFAULTS, **knobs})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=280.0)
    args = ap.parse_args()
    t0 = time.time()
    kernel = load_kernel()
    torch.manual_seed(0)
    print("== correctness (max|out-ref| vs 2*max|pt-ref|+atol)")
    variants = {"default": KNOBS, "no-overlap": dict(KNOBS, hopper_overlap=False),
                "1-consumer": dict(KNOBS, BLOCK_M=64), "bn64-s3": dict(KNOBS, BLOCK_N=64, num_stages=3)}
    cases = [  # b, hq, hk, sq, sk, d, causal, layout, dtype
        (2, 4, 2, 333, 333, 128, True, "bhsd", torch.bfloat16),
        (2, 4, 4, 300, 517, 64, False, "bshd", torch.float16),
        (1, 8, 2, 200, 333, 128, True, "bshd", torch.bfloat16),
        (1, 2, 2, 333, 200, 64, True, "bhsd", torch.bfloat16),
        (2, 4, 1, 1024, 1024, 128, True, "bhsd", torch.float16),
        (1, 2, 2, 17, 17, 64, False, "bhsd", torch.bfloat16),
    ]
    failures = 0
    for name, knobs in variants.items():
        for (b, hq, hk, sq, sk, d, causal, layout, dtype) in cases:
            if name != "default" and sq == 17:
                continue
            shape = lambda h, s: (b, h, s, d) if layout == "bhsd" else (b, s, h, d)  # noqa: E731
            q = torch.randn(shape(hq, sq), device="cuda", dtype=dtype)
            k = torch.randn(shape(hk, sk), device="cuda", dtype=dtype)
            v = torch.randn(shape(hk, sk), device="cuda", dtype=dtype)
            try:
                out, lse = run_ws(kernel, q, k, v, layout, causal, knobs)
                torch.cuda.synchronize()
                res = check_attention(out, lse, q, k, v, causal=causal, layout=layout)
                ok = all(r.ok for r in res)
                failures += not ok
                print(f"{'ok ' if ok else 'BAD'} {name:10s} b{b} h{hq}/{hk} {sq}x{sk} hd{d} {'causal' if causal else 'full'} "
                      f"{layout} {str(dtype)[6:]}: " + "; ".join(str(r) for r in res))
            except Exception as exc:  # noqa: BLE001
                failures += 1
                print(f"ERR {name} {(b, hq, hk, sq, sk, d, causal, layout)}: {type(exc).__name__}: {str(exc)[:600]}")
    print(f"correctness failures: {failures}  ({time.time() - t0:.0f}s)")

    print("== forward TFLOP/s, bf16, 16384 tokens, hidden 2048 (do_bench median)")
    cudnn = sdpa_runner(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
    ws_variants = {"ws": KNOBS, "ws-noov": dict(KNOBS, hopper_overlap=False),
                   "ws-regs168": dict(KNOBS, hopper_regs=168), "ws-bn64s3": dict(KNOBS, BLOCK_N=64, num_stages=3),
                   "ws-1c": dict(KNOBS, BLOCK_M=64), "ws-s3": dict(KNOBS, num_stages=3)}
    print("case | cudnn | portable default | " + " | ".join(ws_variants))
    for d in (128, 64):
        for causal in (False, True):
            for seqlen in (4096, 1024, 16384):
                if time.time() - t0 > args.budget:
                    print("(budget spent: stopping)")
                    return
                heads, batch = 2048 // d, 16384 // seqlen
                q, k, v = (torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = attention_flops(batch, heads, seqlen, seqlen, d, causal=causal)
                cells = []
                ref = cudnn(q, k, v, causal)
                cells.append(tflops(flops, time_ms(lambda: cudnn(q, k, v, causal))))
                spec = AttentionSpec(name="probe", dtype="bf16", head_dim=d, num_heads=heads, causal=causal)
                mod = flashgen.compile(spec, default_config(spec, seqlen=seqlen)).module()
                cells.append(tflops(flops, time_ms(lambda: mod.forward(q, k, v))))
                only = ws_variants if seqlen == 4096 else {"ws": KNOBS}
                for name, knobs in ws_variants.items():
                    if name not in only:
                        cells.append(None)
                        continue
                    try:
                        out, _ = run_ws(kernel, q, k, v, "bhsd", causal, knobs)
                        err = (out.float() - ref.float()).abs().max().item()
                        if not err < 3e-2:
                            cells.append(f"err {err:.2g}")
                            continue
                        cells.append(tflops(flops, time_ms(lambda: run_ws(kernel, q, k, v, "bhsd", causal, knobs))))
                    except Exception as exc:  # noqa: BLE001
                        cells.append(f"{type(exc).__name__}")
                        print(f"  {name}: {type(exc).__name__}: {str(exc)[:300]}")
                fmt = lambda c: "-" if c is None else (f"{c:.0f}" if isinstance(c, float) else c)  # noqa: E731
                print(f"hd{d} S={seqlen}{' causal' if causal else ''} | " + " | ".join(fmt(c) for c in cells)
                      + f"   ({time.time() - t0:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
