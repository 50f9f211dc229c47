"""The Gluon forward's causal tiles on FP8 and bf16: flashgen.attention's default beside the hopper_ws
variants a causal default could take (128x128 and, for FP8, 128x256 key blocks; persistent, one-tile,
overlapped), at hd128, 16 heads, 16384 tokens per batch, S = 4096 and 16384.

Made for the FP8 one-compare causal mask (templates/hopper/forward.j2: a masked block compares each
score's column with its row's last visible column): run once per tree, alternating, to compare the
mask forms (benchmarks/results/2026-11-27-h100-fp8-causal-mask-probe.md). Every output is checked
before it is timed (FP8: FlashAttention-3's rule on two heads, against the dequantized inputs).
TFLOP/s over visible pairs (time_ms median, L2 flushed).

    PYTHONPATH=. python3 benchmarks/probe_causal_mask.py [--out DIR] [--tag TAG]

Writes DIR/<date>-<gpu>-causal-mask<TAG>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flashgen  # noqa: E402
from flashgen import AttentionSpec, KernelConfig  # noqa: E402
from flashgen.bench import environment, file_tag, fp8_inputs  # noqa: E402
from flashgen.flops import pairs_flops, visible_pairs  # noqa: E402
from flashgen.timing import time_ms  # noqa: E402
from flashgen.verify import check_attention  # noqa: E402

HEAD_DIM, HEADS, TOKENS = 128, 16, 16384
BASE = dict(family="hopper_ws", BLOCK_M=128, num_warps=4, num_stages=2)
VARIANTS = {"default": None, "128x128 pers": dict(BLOCK_N=128, hopper_persistent=True),
            "128x256 pers": dict(BLOCK_N=256, hopper_persistent=True), "128x256 one": dict(BLOCK_N=256),
            "128x128 pers overlap": dict(BLOCK_N=128, hopper_persistent=True, hopper_overlap=True)}


def case(dtype: str, seqlen: int, gen) -> dict:
    batch = TOKENS // seqlen
    x = [torch.randn(batch, HEADS, seqlen, HEAD_DIM, device="cuda", generator=gen) for _ in range(3)]
    descales = None
    if dtype == "fp8":
        q, k, v, descales = fp8_inputs(*x)
    else:
        q, k, v = (t.to(torch.bfloat16) for t in x)
    kw = dict(zip(("q_descale", "k_descale", "v_descale"), descales)) if descales else {}
    spec = AttentionSpec(dtype="fp8_e4m3" if dtype == "fp8" else "bf16", head_dim=HEAD_DIM, num_heads=HEADS,
                         causal=True)
    row = dict(case=f"{dtype} S={seqlen} causal", mode="fwd", default=str(flashgen.default_config(spec,
                                                                                                   seqlen=seqlen)))
    flops = batch * HEADS * pairs_flops(visible_pairs(seqlen, seqlen, True), HEAD_DIM)
    h = slice(0, 2)
    for name, knobs in VARIANTS.items():
        if knobs is not None and knobs["BLOCK_N"] == 256 and dtype != "fp8":
            continue  # 256-key blocks are FP8's only (config.check_spec)
        config = KernelConfig(**BASE, **knobs) if knobs else None
        out, lse = flashgen.attention(q, k, v, causal=True, config=config, return_lse=True, **kw)
        checks = check_attention(out[:, h], lse[:, h], q[:, h], k[:, h], v[:, h], causal=True,
                                 **({"descales": tuple(d[:, h] for d in descales)} if descales else {}))
        if not all(c.ok for c in checks):
            row[f"{name}_error"] = "; ".join(map(str, checks))[:300]
            continue
        ms = time_ms(lambda: flashgen.attention(q, k, v, causal=True, config=config, **kw))
        row[f"{name}_tflops"] = round(flops / ms / 1e9, 1)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="", type=file_tag)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(3)
    rows = []
    for dtype in ("fp8", "bf16"):
        for seqlen in (4096, 16384):
            rows.append(case(dtype, seqlen, gen))
            print(rows[-1], flush=True)
    env = environment()
    gpu = "h200" if "H200" in env["gpu"] else "h100"
    path = Path(args.out) / f"{datetime.date.today()}-{gpu}-causal-mask{args.tag}.json"
    path.write_text(json.dumps(dict(environment=env, rows=rows), indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
