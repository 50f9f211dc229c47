"""The Hopper warp-specialized family (config family 'hopper_ws') against what users get today.

H100, bf16, 16384 tokens per batch (hidden 2048: 16 heads at hd128, 32 at hd64, 8 at hd256), head dims 64
and 128 (--head-dims: 256 too), causal or not, S = 1024, 4096, 16384. Providers, one process:
  flashgen     flashgen.attention(q, k, v, causal=...): what a user gets (the defaults / tuned DB)
  hopper_ws    the same call with the family forced (HOPPER_KNOBS below, on the default backward)
  portable     the same call with the portable family's default config at that length
  cudnn        SDPA pinned to cuDNN;  flex: FlexAttention compiled (static shapes)
  hopper_bwd   fwd+bwd only: the default config with the Gluon dK/dV kernel forced (config.hopper_bwd)
  hopper_bwd_atomic  the same with dQ added from that kernel (dq_strategy 'atomic': no dQ kernel)
  portable_bwd fwd+bwd only: the default config with the portable dK/dV kernel
Forward and fwd+bwd TFLOP/s (FLOPs over the visible pairs), ratio_vs_cudnn and ratio_vs_flex of
each flashgen provider. Every provider's output (and gradients) is checked against cuDNN's
before it is timed; a mismatch is recorded instead of a time. With --variants the family's
knob variants are timed too (forward), for the defaults and benchmarks/NOTES.md.

    python3 benchmarks/bench_hopper_ws.py [--no-flex] [--variants] [--fwd-bwd-only] [--budget SECONDS]
        [--head-dims 128,64]
    python3 benchmarks/bench_hopper_ws.py --backward [--dq separate,atomic] [--tiles all|default] [--budget SECONDS]

Writes benchmarks/results/<date>-<gpu>-hopper-ws.{json,md} (--fwd-bwd-only: -hopper-bwd-fwdbwd). --backward instead times the backward
alone per case (dK/dV kernel: the Gluon one at each tile of BACKWARD_TILES, with dQ from the separate
kernel and added from it, against the portable one, as the backward's time less that of the same plan
with its dK/dV launch skipped; cuDNN's backward as its fwd+bwd less its forward) and writes
<date>-<gpu>-hopper-bwd.{json,md}. --tag TAG appends TAG to each file name.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import flashgen  # noqa: E402
from flashgen import AttentionSpec, default_config  # noqa: E402
from flashgen.bench import environment, file_tag, flex_runner, gpu_tag, sdpa_runner  # noqa: E402
from flashgen.flops import attention_flops, tflops  # noqa: E402
from flashgen.runtime.hopper import spec_unserved  # noqa: E402
from flashgen.runtime.hopper_bwd import HopperBackward, HopperDkdv  # noqa: E402
from flashgen.runtime.launch import BackwardPlan  # noqa: E402
from flashgen.timing import time_ms  # noqa: E402

# the family's knobs when forced: BLOCK_M 128 = two consumer warpgroups
HOPPER_KNOBS = dict(family="hopper_ws", BLOCK_M=128, BLOCK_N=128, num_stages=2, hopper_regs=240)
VARIANTS = {  # name -> knobs over HOPPER_KNOBS (forward only)
    "base": {},
    "overlap": dict(hopper_overlap=True),
    "pingpong": dict(hopper_pingpong=True),
    "pingpong-s3": dict(hopper_pingpong=True, num_stages=3),
    "s3": dict(num_stages=3),
    "n64-s4": dict(BLOCK_N=64, num_stages=4),
    "m64": dict(BLOCK_M=64, num_stages=3),
}
# the Gluon dK/dV kernel's tiles timed by --backward: (BLOCK_M query rows, consumers, stages) per head dim
# (BLOCK_M query rows, consumers, stages): HopperBackward.TILES
BACKWARD_TILES = {64: [(64, 2, 2), (64, 2, 3), (128, 2, 2)], 128: [(64, 2, 2), (64, 2, 3)]}
TOLERANCE = {"fwd": 3e-2, "fwd_bwd": 8e-2}  # max |x - cuDNN's| (bf16 outputs of O(1); gradients O(1))


def providers(spec, seqlen, causal, use_flex):
    cudnn = sdpa_runner(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
    portable = default_config(spec, seqlen=seqlen, hopper_ws=False)
    forced = portable.replace(tma=False, warp_specialize=False, num_warps=4, **HOPPER_KNOBS)
    if spec.head_dim == 256:  # (128-key blocks do not fit two stages beside Q there)
        forced = forced.replace(BLOCK_N=64)
    out = {"cudnn": lambda q, k, v: cudnn(q, k, v, causal),
           "flashgen": lambda q, k, v: flashgen.attention(q, k, v, causal=causal),
           "hopper_ws": lambda q, k, v: flashgen.attention(q, k, v, causal=causal, config=forced),
           "portable": lambda q, k, v: flashgen.attention(q, k, v, causal=causal, config=portable)}
    if use_flex:
        flex = flex_runner(seqlen, causal)
        out["flex"] = lambda q, k, v: flex(q, k, v, causal)
    default = default_config(spec, seqlen=seqlen)
    if spec_unserved(spec, backward=True) is None:  # the Gluon dK/dV kernel serves the spec
        for name, knobs in (("hopper_bwd", dict(hopper_bwd=True, dq_strategy="separate")),
                            ("hopper_bwd_atomic", dict(hopper_bwd=True, dq_strategy="atomic", bwd_fused_delta=False)),
                            ("portable_bwd", dict(hopper_bwd=False, dq_strategy="separate"))):  # the backward's choice
            out[name] = lambda q, k, v, cfg=default.replace(**knobs): flashgen.attention(q, k, v, causal=causal,
                                                                                        config=cfg)
    return out, forced


def bench_case(d, causal, seqlen, use_flex, variants, modes=("fwd", "fwd_bwd")):
    heads, batch = 2048 // d, 16384 // seqlen
    spec = AttentionSpec(name="bench", dtype="bf16", head_dim=d, num_heads=heads, causal=causal, backward=True)
    q, k, v = (torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    flops = {mode: attention_flops(batch, heads, seqlen, seqlen, d, causal=causal, mode=mode)
             for mode in ("fwd", "fwd_bwd")}
    runs, forced = providers(spec, seqlen, causal, use_flex)
    rows = []
    for mode in modes:
        row = {"case": f"hd{d} S={seqlen}{' causal' if causal else ''}", "mode": mode, "head_dim": d,
               "causal": causal, "seqlen": seqlen, "batch": batch, "heads": heads}
        ref = None
        for name, fn in runs.items():
            if mode == "fwd" and name.endswith("_bwd"):  # the backward's choice: the same forward as flashgen's
                continue
            try:
                if mode == "fwd":
                    call = lambda fn=fn: fn(q, k, v)  # noqa: E731
                    got = call().float()
                else:
                    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

                    def call(fn=fn, leaves=leaves):
                        for t in leaves:
                            t.grad = None
                        fn(*leaves).backward(do)

                    call()
                    got = torch.cat([t.grad.float().flatten() for t in leaves])
                if ref is None:
                    ref = got  # cuDNN's, the first provider
                err = (got - ref).abs().max().item()
                if not err <= TOLERANCE[mode]:
                    row[name] = {"error": f"max|x - cudnn| = {err:.3g}"}
                    continue
                ms = time_ms(call)
                row[name] = {"ms": ms, "tflops": tflops(flops[mode], ms), "max_err_vs_cudnn": err}
            except Exception as exc:  # noqa: BLE001 - one failing provider must not end the run
                row[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        for name in ("flashgen", "hopper_ws", "portable", "hopper_bwd", "hopper_bwd_atomic", "portable_bwd"):
            for anchor in ("cudnn", "flex"):
                a, b = row.get(name, {}).get("tflops"), row.get(anchor, {}).get("tflops")
                if a and b:
                    row.setdefault(f"ratio_vs_{anchor}", {})[name] = round(a / b, 3)
        if mode == "fwd" and variants:
            base = forced
            for vname, knobs in VARIANTS.items():
                cfg = base.replace(**knobs)
                try:
                    fn = lambda cfg=cfg: flashgen.attention(q, k, v, causal=causal, config=cfg)  # noqa: E731
                    err = (fn().float() - ref).abs().max().item()
                    if not err <= TOLERANCE["fwd"]:
                        row.setdefault("variants", {})[vname] = f"max|x - cudnn| = {err:.3g}"
                        continue
                    row.setdefault("variants", {})[vname] = round(tflops(flops["fwd"], time_ms(fn)), 1)
                except Exception as exc:  # noqa: BLE001
                    row.setdefault("variants", {})[vname] = f"{type(exc).__name__}: {str(exc)[:120]}"
        rows.append(row)
        print(json.dumps({k: row[k] for k in row if k not in ("head_dim", "causal", "seqlen")}, default=str),
              flush=True)
    return rows


class _NoLaunch:
    """A backward plan's dK/dV launch skipped (its bound-launch interface, launching nothing)."""

    def bindable(self):
        return False

    def run(self, context, args):
        return None


def backward_case(d, causal, seqlen, strategies=("separate", "atomic"), every_tile=True):
    """--backward: one case's backward alone, per dK/dV kernel (see the module docstring)."""
    heads, batch = 2048 // d, 16384 // seqlen
    spec = AttentionSpec(name="bench", dtype="bf16", head_dim=d, num_heads=heads, causal=causal, backward=True)
    q, k, v = (torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    flops = attention_flops(batch, heads, seqlen, seqlen, d, causal=causal, mode="bwd")
    cudnn = sdpa_runner(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def cudnn_step():
        for t in leaves:
            t.grad = None
        cudnn(*leaves, causal).backward(do)

    cudnn_step()
    ref = [t.grad.float() for t in leaves]
    row = {"case": f"hd{d} S={seqlen}{' causal' if causal else ''}", "mode": "bwd", "batch": batch, "heads": heads}
    cudnn_ms = time_ms(cudnn_step) - time_ms(lambda: cudnn(q, k, v, causal))
    row["cudnn"] = {"ms": cudnn_ms, "tflops": tflops(flops, cudnn_ms)}
    default = default_config(spec, seqlen=seqlen)
    shipped = HopperBackward.TILES[d]
    kernels = [("portable", False, None, "separate")] + [
        (f"gluon m{m} c{c} s{st}{' atomic dQ' if dq == 'atomic' else ''}", True, (m, c, st), dq)
        for m, c, st in (BACKWARD_TILES[d] if every_tile else [shipped]) for dq in strategies]
    for name, flag, tiles, dq in kernels:
        try:
            HopperBackward.TILES[d] = tiles or shipped
            # (the strategy named: a default may add dQ from the dK/dV kernel, config._hopper_bwd_default)
            atomic = dict(dq_strategy="atomic", bwd_fused_delta=False) if dq == "atomic" else dict(dq_strategy="separate")
            module = flashgen.compile(spec, default.replace(hopper_bwd=flag, **atomic)).module()
            module._LAUNCHER.plans.clear()  # (the plans of this module's earlier cases)
            out, lse = module.forward(q, k, v)
            call = lambda: module.backward(do, q, k, v, out, lse)  # noqa: E731
            grads = call()[:3]
            err = max((g.float() - r).abs().max().item() for g, r in zip(grads, ref))
            (plan,) = [p for p in module._LAUNCHER.plans.values() if isinstance(p, BackwardPlan)]
            if isinstance(plan.dkdv, HopperDkdv) != flag:
                row[name] = {"error": "the plan did not take the requested dK/dV kernel"}
                continue
            if not err <= TOLERANCE["fwd_bwd"]:
                row[name] = {"error": f"max|grad - cudnn| = {err:.3g}"}
                continue
            ms = time_ms(call)
            dkdv, plan.dkdv = plan.dkdv, _NoLaunch()  # the same backward without its dK/dV launch
            rest_ms = time_ms(call)
            plan.dkdv = dkdv
            row[name] = {"ms": ms, "tflops": tflops(flops, ms), "dkdv_ms": ms - rest_ms, "max_err_vs_cudnn": err}
        except Exception as exc:  # noqa: BLE001 - one failing kernel must not end the run
            row[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    HopperBackward.TILES[d] = shipped
    print(json.dumps(row, default=str), flush=True)
    return [row]


def backward_markdown(rows, env):
    names = [n for n in rows[0] if n not in ("case", "mode", "batch", "heads")] if rows else []
    lines = [f"GPU: {env.get('gpu')} | torch {env['torch']} | triton {env['triton']}. bf16, 16384 tokens, hidden "
             "2048. Backward alone: ms (TFLOP/s) of the whole backward per dK/dV kernel and, after '/', the dK/dV "
             "launch's share (the backward less the same plan without it); cuDNN: fwd+bwd less fwd.", "",
             "| case | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for r in rows:
        cells = []
        for n in names:
            c = r.get(n, {})
            if "ms" not in c:
                cells.append(str(c.get("error", "-"))[:60])
            else:
                cells.append(f"{c['ms']:.3f} ({c['tflops']:.0f})" + (f" / {c['dkdv_ms']:.3f}" if "dkdv_ms" in c else ""))
        lines.append(f"| {r['case']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown(rows, env):
    names = ("flashgen", "hopper_ws", "portable", "hopper_bwd", "hopper_bwd_atomic", "portable_bwd", "cudnn", "flex")
    lines = [f"GPU: {env.get('gpu')} | torch {env['torch']} | triton {env['triton']}. bf16, 16384 tokens, hidden "
             f"2048. TFLOP/s over visible pairs (do_bench median); ratios of each flashgen provider to cuDNN / Flex.",
             "", "| case | mode | " + " | ".join(names) + " | flashgen/cuDNN | hopper_ws/cuDNN | hopper_bwd/cuDNN "
             "| hopper_bwd_atomic/cuDNN | flashgen/Flex | hopper_ws/Flex | hopper_bwd/Flex | hopper_bwd_atomic/Flex |",
             "|---" * (len(names) + 10) + "|"]
    for r in rows:
        tf = [f"{r[n]['tflops']:.0f}" if "tflops" in r.get(n, {}) else ("err" if n in r else "-") for n in names]
        ratio = [f"{r.get(f'ratio_vs_{a}', {}).get(n, float('nan')):.2f}" for a in ("cudnn", "flex")
                 for n in ("flashgen", "hopper_ws", "hopper_bwd", "hopper_bwd_atomic")]
        lines.append(f"| {r['case']} | {r['mode']} | " + " | ".join(tf) + " | " + " | ".join(ratio) + " |")
    var = [r for r in rows if r.get("variants")]
    if var:
        lines += ["", "Forward variants of the family (TFLOP/s; knobs over " + json.dumps(HOPPER_KNOBS) + "):", "",
                  "| case | " + " | ".join(VARIANTS) + " |", "|---" * (len(VARIANTS) + 1) + "|"]
        for r in var:
            lines.append(f"| {r['case']} | " + " | ".join(str(r['variants'].get(v, '-')) for v in VARIANTS) + " |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--variants", action="store_true", help="also time the family's knob variants (forward)")
    ap.add_argument("--budget", type=float, default=1e9, help="stop starting cases after this many seconds")
    ap.add_argument("--seqlens", default="4096,16384,1024", help="comma-separated sequence lengths, in order")
    ap.add_argument("--head-dims", default="128,64", help="comma-separated head dims (of 64, 128, 256)")
    ap.add_argument("--backward", action="store_true", help="time the backward alone per dK/dV kernel instead")
    ap.add_argument("--fwd-bwd-only", action="store_true", help="time fwd+bwd rows only (no forward rows)")
    ap.add_argument("--dq", default="separate,atomic", help="--backward: the Gluon kernel's dQ strategies to time")
    ap.add_argument("--tiles", choices=("all", "default"), default="all",
                    help="--backward: the Gluon kernel at every tile of BACKWARD_TILES, or its shipped ones")
    ap.add_argument("--tag", default="", type=file_tag, help="appended to the results' file names")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    env = environment()
    rows, t0 = [], time.time()
    order = [int(x) for x in args.seqlens.split(",")]
    render = backward_markdown if args.backward else markdown
    dims = [int(x) for x in args.head_dims.split(",")]
    if args.backward and set(dims) - set(BACKWARD_TILES):
        ap.error(f"--backward times the Gluon dK/dV kernel, which serves head dims {sorted(BACKWARD_TILES)}, "
                 f"got --head-dims {args.head_dims}")
    cases = [(d, causal, s) for d in dims for causal in (False, True) for s in order]
    for d, causal, seqlen in sorted(cases, key=lambda c: order.index(c[2])):
        if time.time() - t0 > args.budget:
            print(f"budget spent: stopped before hd{d} S={seqlen} causal={causal}")
            break
        if args.backward:
            rows += backward_case(d, causal, seqlen, tuple(args.dq.split(",")), args.tiles == "all")
        else:
            rows += bench_case(d, causal, seqlen, not args.no_flex, args.variants,
                               ("fwd_bwd",) if args.fwd_bwd_only else ("fwd", "fwd_bwd"))
        name = "hopper-bwd" if args.backward else "hopper-bwd-fwdbwd" if args.fwd_bwd_only else "hopper-ws"
        write(Path(args.out), env, rows, name + args.tag, render)  # after each case: a run cut short keeps what it measured
    print(render(rows, env))


def write(out, env, rows, name, render):
    stem = out / f"{datetime.date.today().isoformat()}-{gpu_tag(env)}-{name}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"environment": env, "knobs": HOPPER_KNOBS,
                                                     "backward_tiles": BACKWARD_TILES, "rows": rows},
                                                    indent=1, default=str))
    stem.with_suffix(".md").write_text(render(rows, env))


if __name__ == "__main__":
    main()
