"""hd128 bf16 forward: custom expressions over a 1-d tensor indexed by q_idx and by kv_idx (documents), whose
_reads_pair_tiles answer gives 128x64 (session 49's rule for (L, S) tiles) where 128x128 may fit. Default
against 128x128 at 3 and 2 stages, 2 interleaved rounds, do_bench median ms, no grad.

    PYTHONPATH=. python3 benchmarks/probe_document_pair_tiles.py OUT.json
(session 51: results/2026-11-30-h200-masks-s51-document-tiles.md)
"""
import json, sys
import torch
from triton.testing import do_bench
import flashgen
from flashgen.api import spec_for
from flashgen.config import default_config

H, D = 16, 128
VARIANTS = {"128x128x8x3 ws tma": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, warp_specialize=True, tma=True),
            "128x128x8x2 ws tma": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2, warp_specialize=True, tma=True)}
CASES = [("docs", "doc[q_idx] == doc[kv_idx]", 8192, 4), ("docs causal", "(doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)", 8192, 4),
         ("docs", "doc[q_idx] == doc[kv_idx]", 4096, 2), ("docs causal", "(doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)", 16384, 8)]
rows = []
for name, expr, seqlen, ndocs in CASES:
    g = torch.Generator(device="cuda").manual_seed(seqlen)
    q, k, v = (torch.randn(1, H, seqlen, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    doc = (torch.arange(seqlen, device="cuda") * ndocs // seqlen).to(torch.int32)
    t = {"doc": doc}
    spec = spec_for(q, k, v, causal=False, softmax_scale=None, layout="bhsd", mask=expr)
    base = default_config(spec, None, seqlen)
    allowed = doc[:, None] == doc[None, :]
    if "causal" in name:
        allowed &= torch.ones(seqlen, seqlen, device="cuda", dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=allowed)
    fns = {"default %dx%dx%dx%d" % (base.BLOCK_M, base.BLOCK_N, base.num_warps, base.num_stages):
           lambda: flashgen.attention(q, k, v, mask=expr, **t)}
    for vname, over in VARIANTS.items():
        fns[vname] = lambda cfg=base.replace(**over): flashgen.attention(q, k, v, mask=expr, config=cfg, **t)
    row = {"case": f"{name} ({ndocs}) B=1 H=16 S={seqlen} hd128 bf16"}
    for vname, fn in fns.items():
        try:
            with torch.no_grad():
                row[vname] = {"err": round((fn().float() - ref).abs().max().item(), 4), "ms": []}
        except Exception as exc:
            row[vname] = {"error": str(exc)[:150]}
    for r in range(2):
        for vname, fn in (list(fns.items()) if r == 0 else list(fns.items())[::-1]):
            if "ms" in row[vname]:
                with torch.no_grad():
                    row[vname]["ms"].append(round(do_bench(fn, return_mode="median"), 4))
    print(json.dumps(row), flush=True)
    rows.append(row)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
