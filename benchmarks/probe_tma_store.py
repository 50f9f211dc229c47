"""The Gluon forward writing O by a TMA store (config knob hopper_tma_store) against register stores, on
each case's default config with the knob off and on: flashgen.attention with config=..., three interleaved
rounds, outputs checked (FP8: FlashAttention-3's rule on two heads), TFLOP/s over visible pairs.

    PYTHONPATH=. python3 benchmarks/probe_tma_store.py
"""
import torch

import flashgen
from flashgen import AttentionSpec
from flashgen.bench import fp8_inputs
from flashgen.flops import pairs_flops, visible_pairs
from flashgen.timing import time_ms
from flashgen.verify import check_attention
CASES = [("fp8", 128, 4096, True), ("fp8", 128, 16384, True), ("fp8", 128, 4096, False), ("fp8", 128, 16384, False),
         ("bf16", 128, 1024, False), ("bf16", 128, 1024, True), ("bf16", 128, 4096, True), ("bf16", 128, 16384, True),
         ("bf16", 64, 1024, False), ("bf16", 128, 4096, False)]
gen = torch.Generator(device="cuda").manual_seed(11)
for dtype, d, S, causal in CASES:
    H, B = 2048 // d, 16384 // S
    spec = AttentionSpec(dtype="fp8_e4m3" if dtype == "fp8" else "bf16", head_dim=d, num_heads=H, causal=causal)
    cfg = flashgen.default_config(spec, seqlen=S)
    if cfg.family != "hopper_ws":
        print(dtype, d, S, causal, "default is", cfg.family, flush=True)
        continue
    x = [torch.randn(B, H, S, d, device="cuda", generator=gen) for _ in range(3)]
    if dtype == "fp8":
        q, k, v, (qd, kd, vd) = fp8_inputs(*x)
        kw, ds = dict(q_descale=qd, k_descale=kd, v_descale=vd), dict(descales=(qd[:, :2], kd[:, :2], vd[:, :2]))
    else:
        q, k, v = (t.to(torch.bfloat16) for t in x)
        kw, ds = {}, {}
    flops = B * H * pairs_flops(visible_pairs(S, S, causal), d)
    res = {"off": [], "on": []}
    for rnd in range(3):
        for name, c in (("off", cfg.replace(hopper_tma_store=False)), ("on", cfg.replace(hopper_tma_store=True))):
            if rnd == 0:
                out, lse = flashgen.attention(q, k, v, causal=causal, config=c, return_lse=True, **kw)
                ok = all(r.ok for r in check_attention(out[:, :2], lse[:, :2], q[:, :2], k[:, :2], v[:, :2],
                                                       causal=causal, **ds))
                if not ok:
                    res[name].append("WRONG")
            res[name].append(round(flops / time_ms(lambda: flashgen.attention(q, k, v, causal=causal, config=c, **kw))
                                   / 1e9, 1))
    on = [t for t in res["on"] if t != "WRONG"]; off = [t for t in res["off"] if t != "WRONG"]
    print(dtype, f"hd{d}", f"S={S}", "causal" if causal else "plain", str(cfg.replace(hopper_tma_store=False)), res,
          f"on/off {sum(on) / sum(off):.3f}", flush=True)
