"""Masked fwd+bwd at small shapes, hd128 bf16, 16 heads: the default (bwd_short: one backward launch walking every
tile) against the same config with bwd_short=False (preprocess, dK/dV and dQ over the all-partial map), same
process, 3 interleaved rounds; do_bench median ms of forward + autograd.grad (host-bound), and the GPU time of the
step replayed from a CUDA graph.

    PYTHONPATH=. python3 benchmarks/probe_masked_short_backward.py OUT.json [--more]
(session 51: results/2026-11-30-h200-call-path-s51-short-ab.md)
"""
import json, sys
import torch
from triton.testing import do_bench
import flashgen
from flashgen.api import spec_for
from flashgen.config import default_config

H, D = 16, 128
CASES = [("bool causal (L, S)", 1, 128), ("bool causal (L, S)", 1, 512), ("bool padding (B, 1, 1, S)", 4, 512),
         ("float bias (L, S)", 4, 512), ("custom strided", 2, 256)]
# --more (session 52): where the one launch stops paying, by (batch x heads x queries x keys): dense causal (no block
# map) beside the masks, and larger batches at short lengths
MORE = [("is_causal", 1, 128), ("is_causal", 1, 512), ("is_causal", 4, 512), ("is_causal", 8, 256),
        ("bool causal (L, S)", 1, 256), ("bool causal (L, S)", 8, 128), ("bool causal (L, S)", 4, 256)]


def inputs(kind, batch, seqlen):
    g = torch.Generator(device="cuda").manual_seed(seqlen + batch)
    q, k, v = (torch.randn(batch, H, seqlen, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    if kind.startswith("bool causal"):
        return q, k, v, dict(mask="m[q_idx, kv_idx] != 0", m=torch.ones(seqlen, seqlen, device="cuda", dtype=torch.bool).tril())
    if kind.startswith("bool padding"):
        m = (torch.arange(seqlen, device="cuda") < seqlen - seqlen // 4).expand(batch, seqlen).contiguous()
        return q, k, v, dict(mask="m[b, kv_idx] != 0", m=m)
    if kind == "is_causal":
        return q, k, v, dict(causal=True)
    if kind.startswith("float bias"):
        return q, k, v, dict(score_mod="score + m[q_idx, kv_idx]",
                             m=torch.randn(seqlen, seqlen, device="cuda", generator=g))
    return q, k, v, dict(mask="(q_idx >= kv_idx) & ((q_idx - kv_idx) % 3 != 1)")


rows = []
for kind, batch, seqlen in MORE if "--more" in sys.argv else CASES:
    q, k, v, kw = inputs(kind, batch, seqlen)
    spec = spec_for(q, k, v, causal=kw.get("causal", False), softmax_scale=None, layout="bhsd", mask=kw.get("mask"),
                    score_mod=kw.get("score_mod"))
    base = default_config(spec, None, seqlen)
    do = torch.randn(batch, H, seqlen, D, device="cuda", dtype=torch.bfloat16)
    cfgs = {"short (default)": base, "three launches": base.replace(bwd_short=False)}
    row = {"case": f"{kind} B={batch} H={H} S={seqlen} hd{D} bf16", "default_bwd_short": base.bwd_short,
           "pairs": batch * H * seqlen * seqlen}
    steps, grads = {}, {}
    for name, cfg in cfgs.items():
        def step(cfg=cfg):
            out = flashgen.attention(q, k, v, config=cfg, **kw)
            return torch.autograd.grad(out, (q, k, v), do)
        steps[name] = step
        grads[name] = step()
        row[name] = {"ms": [], "graph_ms": []}
    row["max_grad_diff"] = max((a - b).abs().max().item() for a, b in zip(*grads.values()))
    for r in range(3):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            row[name]["ms"].append(round(do_bench(steps[name], return_mode="median"), 4))
    for name, step in steps.items():
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            row[name]["graph_ms"].append(round(do_bench(graph.replay, return_mode="median"), 4))
        except Exception as exc:
            row[name]["graph_error"] = str(exc)[:200]
    print(json.dumps(row), flush=True)
    rows.append(row)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
