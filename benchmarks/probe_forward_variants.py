"""Forward config variants of the default beside cuDNN, in one process: per case, the default config and
named knob sets over the Gluon family's 128 x 128 tile, timed through flashgen.attention(config=...) in
interleaved rounds (outputs checked against a float reference on two heads first; FP8 by FlashAttention-3's
rule), TFLOP/s over the visible pairs, 16384 tokens per batch, hidden 2048. A case `fp8-hd128:4096:causal`
runs e4m3 inputs (per-head descales) and times flashgen's bf16 default (bf16_default) beside them; cuDNN
runs bf16 there (torch exposes no FP8 SDPA).

    PYTHONPATH=. python3 benchmarks/probe_forward_variants.py [--rounds 3] [--cases hd64:1024:causal,...]
        [--variants persistent_tma,...] [--out benchmarks/results/<date>-<gpu>-forward-variants]
"""
from __future__ import annotations

import argparse
import datetime
import json

import torch
from torch.nn.attention import SDPBackend

import flashgen
from flashgen import AttentionSpec
from flashgen.bench import environment, fp8_inputs, sdpa_runner
from flashgen.config import ConfigError, HOPPER_DEFAULT_TILE
from flashgen.flops import pairs_flops, visible_pairs
from flashgen.timing import time_ms
from flashgen.verify import check_attention

VARIANTS = {  # name -> knobs over HOPPER_DEFAULT_TILE
    "tile": {},
    "tile_tma": dict(hopper_tma_store=True),
    "overlap": dict(hopper_overlap=True),
    "persistent_overlap": dict(hopper_persistent=True, hopper_overlap=True),
    "persistent": dict(hopper_persistent=True),
    "persistent_tma": dict(hopper_persistent=True, hopper_tma_store=True),
    "persistent_tma_s3": dict(hopper_persistent=True, hopper_tma_store=True, num_stages=3),
    "persistent_overlap_tma": dict(hopper_persistent=True, hopper_overlap=True, hopper_tma_store=True),
    "overlap_tma": dict(hopper_overlap=True, hopper_tma_store=True),
    "pingpong_tma": dict(hopper_pingpong=True, hopper_tma_store=True),
    # 64-key blocks (finer causal diagonals, more steps per walk); one 64-row consumer
    "n64_persistent_tma": dict(BLOCK_N=64, num_stages=4, hopper_persistent=True, hopper_tma_store=True),
    "n64_persistent_overlap_tma": dict(BLOCK_N=64, num_stages=4, hopper_persistent=True, hopper_overlap=True,
                                       hopper_tma_store=True),
    "m64_persistent_tma": dict(BLOCK_M=64, num_stages=3, hopper_persistent=True, hopper_tma_store=True),
    # three 64-row consumers (BLOCK_M 192, FA3's hd64 tiles; 160 registers each): head dim 64 only
    "m192": dict(BLOCK_M=192, hopper_regs=160),
    "m192_tma": dict(BLOCK_M=192, hopper_regs=160, hopper_tma_store=True),
    "m192_s3_tma": dict(BLOCK_M=192, hopper_regs=160, num_stages=3, hopper_tma_store=True),
    "m192_overlap_tma": dict(BLOCK_M=192, hopper_regs=160, hopper_overlap=True, hopper_tma_store=True),
    "m192_persistent_tma": dict(BLOCK_M=192, hopper_regs=160, hopper_persistent=True, hopper_tma_store=True),
    "m192_persistent_overlap_tma": dict(BLOCK_M=192, hopper_regs=160, hopper_persistent=True, hopper_overlap=True,
                                        hopper_tma_store=True),
    "m192_n64_persistent_tma": dict(BLOCK_M=192, BLOCK_N=64, num_stages=4, hopper_regs=160, hopper_persistent=True,
                                    hopper_tma_store=True),
    # head dim 256 at 16 bits: 64-key blocks (128-key ones do not fit two stages beside Q)
    "n64": dict(BLOCK_N=64),
    "n64_overlap": dict(BLOCK_N=64, hopper_overlap=True),
    "n64_persistent": dict(BLOCK_N=64, hopper_persistent=True),
    "n64_persistent_overlap": dict(BLOCK_N=64, hopper_persistent=True, hopper_overlap=True),
    # FP8 only (256-key blocks)
    "n256_tma": dict(BLOCK_N=256, hopper_tma_store=True),
    "n256_persistent_tma": dict(BLOCK_N=256, hopper_persistent=True, hopper_tma_store=True),
    "n256_persistent_overlap_tma": dict(BLOCK_N=256, hopper_persistent=True, hopper_overlap=True,
                                        hopper_tma_store=True),
}
# the knobs a default may carry that a variant starts without
PLAIN = dict(tma=False, warp_specialize=False, hopper_regs=240, hopper_overlap=False, hopper_pingpong=False,
             hopper_persistent=False, hopper_tma_store=False)
CASES = "hd64:1024:plain,hd64:1024:causal,hd64:4096:plain,hd64:4096:causal,hd64:16384:causal,hd128:4096:plain"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    cudnn = sdpa_runner(SDPBackend.CUDNN_ATTENTION)
    gen = torch.Generator(device="cuda").manual_seed(7)
    rows = []
    for case in args.cases.split(","):
        hd, seq, kind = case.split(":")
        fp8 = hd.startswith("fp8-")
        d, S, causal = int(hd.removeprefix("fp8-")[2:]), int(seq), kind == "causal"
        H, B = 2048 // d, max(1, 16384 // S)
        spec = AttentionSpec(dtype="fp8_e4m3" if fp8 else "bf16", head_dim=d, num_heads=H, causal=causal)
        default = flashgen.default_config(spec, seqlen=S)
        configs = {"default": default}
        for name in args.variants.split(","):
            try:
                knobs = {**HOPPER_DEFAULT_TILE, **PLAIN, **VARIANTS[name]}
                configs[name] = default.replace(**knobs).check_spec(spec)
            except ConfigError as err:
                print(case, name, "not a config:", err, flush=True)
        x = [torch.randn(B, H, S, d, device="cuda", generator=gen) for _ in range(3)]
        q16, k16, v16 = (t.to(torch.bfloat16) for t in x)
        q, k, v, kw, descales = q16, k16, v16, {}, {}
        if fp8:
            q, k, v, (qd, kd, vd) = fp8_inputs(*x)
            kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
            descales = dict(descales=(qd[:, :2], kd[:, :2], vd[:, :2]))
        flops = B * H * pairs_flops(visible_pairs(S, S, causal), d)
        times = {name: [] for name in [*configs, *(["bf16_default"] if fp8 else []), "cudnn"]}
        for name, cfg in configs.items():
            out, lse = flashgen.attention(q, k, v, causal=causal, config=cfg, return_lse=True, **kw)
            if not all(r.ok for r in check_attention(out[:, :2], lse[:, :2], q[:, :2], k[:, :2], v[:, :2],
                                                     causal=causal, **descales)):
                times[name] = None
        for _ in range(args.rounds):
            for name, cfg in configs.items():
                if times[name] is not None:
                    times[name].append(time_ms(lambda: flashgen.attention(q, k, v, causal=causal, config=cfg, **kw)))
            if fp8:
                times["bf16_default"].append(time_ms(lambda: flashgen.attention(q16, k16, v16, causal=causal)))
            times["cudnn"].append(time_ms(lambda: cudnn(q16, k16, v16, causal)))
        row = {"case": case, "mode": "fwd", "default": str(default)}
        for name, ts in times.items():
            row[f"{name}_tflops"] = None if ts is None else [round(flops / t / 1e9, 1) for t in ts]
            if ts is not None and name != "cudnn":
                row[f"ratio_vs_cudnn_{name}"] = round(sum(times["cudnn"]) / sum(ts), 3)
            if ts is not None and fp8 and name not in ("cudnn", "bf16_default"):
                row[f"ratio_vs_bf16_{name}"] = round(sum(times["bf16_default"]) / sum(ts), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        env = dict(environment(), date=datetime.date.today().isoformat())
        with open(args.out + ".json", "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(table(env, rows))


def table(env: dict, rows: list[dict]) -> str:
    """The markdown table of a run: one line per (case, variant)."""
    lines = [f"{env}", "", "TFLOP/s per round (16384 tokens, hidden 2048); ratio = the anchor's summed time / the "
             "variant's: cuDNN's bf16, and for FP8 cases (fp8-...) flashgen's bf16 default (bf16_default).", "",
             "| case | variant | TFLOP/s | ratio_vs_cudnn | ratio_vs_bf16 |", "|---|---|---|---|---|"]
    for row in rows:
        for key, val in row.items():
            if key.endswith("_tflops"):
                name = key[:-len("_tflops")]
                lines.append(f"| {row['case']} | {name} | {val} | {row.get(f'ratio_vs_cudnn_{name}', '-')} | "
                             f"{row.get(f'ratio_vs_bf16_{name}', '-')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
