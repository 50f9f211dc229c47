"""Backward configs on masked cases with little work per key block (sliding window, chunked, short
documents): time module.backward directly over a grid of BLOCK_M1/N1, warps, stages and dq strategy.

    PYTHONPATH=. python3 benchmarks/bwd_config_sweep.py [case ...]
"""
import sys, time, torch, itertools
sys.path.insert(0, ".")
import flashgen
from flashgen import AttentionSpec, default_config
from flashgen.flops import tflops, visible_count
from flashgen.inputs import named_tensors
from flashgen.timing import time_ms
cases = [("sw256", 16384, dict(mask={"sliding_window": {"left": 256, "right": 0}})),
         ("chunk1024", 16384, dict(mask={"chunked": 1024})),
         ("doc4", 4096, dict(mask={"document": {}})),
         ("causal", 4096, dict(causal=True))]
grid = [(m1, n1, w, s, dq, tma) for (m1, n1) in [(64, 64), (32, 64), (64, 128)]
        for w, s in [(4, 2), (8, 2), (4, 3)] for dq in ["separate", "atomic"] for tma in (False, True)]
only = sys.argv[1:]  # case names to run (default: all)
for name, S, f in cases:
    if only and name not in only:
        continue
    B = 16384 // S
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=16, backward=True, **f)
    q, k, v, do = (torch.randn(B, 16, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    t = named_tensors(spec, B, S)
    pairs = visible_count(spec, B, S, S, t)
    base = default_config(spec)
    mod = flashgen.compile(spec, base).module()
    out, lse = mod.forward(q, k, v, tensors=t)
    fwd_ms = time_ms(lambda: mod.forward(q, k, v, tensors=t))
    res = []
    for m1, n1, w, s, dq, tma in grid:
        kn = dict(BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=n1 if dq == "separate" else m1, BLOCK_N2=m1, bwd_num_warps=w,
                  bwd_num_stages=s, dq_strategy=dq, bwd_tma=tma)
        try:
            ms = time_ms(lambda: mod.backward(do, q, k, v, out, lse, tensors=t, **kn))
            res.append((ms, kn))
        except Exception as e:
            pass
    res.sort(key=lambda r: r[0])
    dflt = [r for r in res if r[1]["BLOCK_M1"] == base.BLOCK_M1 and r[1]["BLOCK_N1"] == base.BLOCK_N1 and r[1]["bwd_num_warps"] == base.bwd_num_warps and r[1]["bwd_num_stages"] == base.bwd_num_stages and r[1]["dq_strategy"] == base.dq_strategy and r[1]["bwd_tma"] == base.bwd_tma]
    f2 = 4.0 * pairs * 128
    print(name, S, "fwd", round(fwd_ms, 3), "ms", round(tflops(f2, fwd_ms)), "bwd default", [round(r[0], 3) for r in dflt], "best", [(round(r[0], 3), round(tflops(2.5 * f2, r[0])), r[1]) for r in res[:3]], flush=True)
