"""FP8 attention forward on the GPU (issue 17): flashgen's FP8 (e4m3, per-(batch, KV head)
descales) beside flashgen's own bf16 forward and cuDNN (FP8 where torch exposes it to SDPA, else
bf16), same process, same values.

Cases: head dims 64, 128, 256 (heads = 2048 / head dim, FlashAttention-3's setup), S = 4096 and
16384 with 16384 tokens per batch, causal and not. Every provider is what a user calls:
``flashgen.attention(q8, k8, v8, q_descale=..., ...)`` with its default config (``fp8_family``: the
default's kernel family, hopper_ws = the Gluon warp-specialized forward on sm90), the same call with
the portable family's FP8 default (``flashgen_fp8_portable``: config=default_config(..., hopper_ws=False)),
and ``flashgen.attention`` in bf16. Each output is checked before it is timed (FP8: FlashAttention-3's
rule against the dequantized inputs, as tests/test_fp8.py). TFLOP/s over visible pairs.
Last: decode with an FP8 KV cache beside the bf16 cache (bytes of cache per second).

    PYTHONPATH=. python3 benchmarks/bench_fp8.py --out benchmarks/results [--tag v2] [--no-decode]
Writes <out>/<date>-<gpu>-fp8[-<tag>].json and .md: rows with case, per-provider TFLOP/s,
ratio_vs_bf16 (flashgen FP8 over flashgen bf16) and ratio_vs_cudnn.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flashgen  # noqa: E402
from flashgen.bench import environment, file_tag, fp8_inputs  # noqa: E402
from flashgen.flops import pairs_flops, visible_pairs  # noqa: E402
from flashgen.timing import time_ms  # noqa: E402
from flashgen.verify import check_attention  # noqa: E402

TOKENS = 16384


def cudnn(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def cudnn_fp8_call(q8, k8, v8, causal):
    """cuDNN's FP8 SDPA through torch, if this torch exposes it; else None (with the reason)."""
    try:
        out = cudnn(q8, k8, v8, causal)
        return (lambda: cudnn(q8, k8, v8, causal)), out, None
    except Exception as err:  # noqa: BLE001 - recorded, the run goes on
        return None, None, f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"


def run_case(head_dim, seqlen, causal):
    heads = 2048 // head_dim
    batch = TOKENS // seqlen
    row = {"case": f"hd{head_dim} S={seqlen} B={batch} H={heads} {'causal' if causal else 'full'}", "mode": "fwd",
           "head_dim": head_dim, "seqlen": seqlen, "causal": causal}
    flops = batch * heads * pairs_flops(visible_pairs(seqlen, seqlen, causal), head_dim)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = [torch.randn(batch, heads, seqlen, head_dim, device="cuda", generator=gen) for _ in range(3)]
    q16, k16, v16 = (t.to(torch.bfloat16) for t in x)
    q8, k8, v8, (qd, kd, vd) = fp8_inputs(*x)

    def fp8_call(config=None):
        return flashgen.attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, config=config)

    spec8 = flashgen.AttentionSpec(dtype="fp8_e4m3", head_dim=head_dim, num_heads=heads, causal=causal)
    row["fp8_family"] = flashgen.default_config(spec8, seqlen=seqlen).family
    portable = flashgen.default_config(spec8, seqlen=seqlen, hopper_ws=False)

    def bf16_call():
        return flashgen.attention(q16, k16, v16, causal=causal)

    out8, lse8 = flashgen.attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                                    return_lse=True)
    # the dense references hold (B, H, S, S) scores: check two heads of the call (MHA: their KV heads)
    h = slice(0, 2)
    checks = check_attention(out8[:, h], lse8[:, h], q8[:, h], k8[:, h], v8[:, h], causal=causal,
                             descales=(qd[:, h], kd[:, h], vd[:, h]))
    row["fp8_check"] = "; ".join(str(c) for c in checks)
    if not all(c.ok for c in checks):
        row["error"] = "flashgen fp8 failed its accuracy check: not timed"
        return row
    if row["fp8_family"] != "portable":  # the portable FP8 forward on the same inputs: checked too
        out_p, lse_p = flashgen.attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                                          config=portable, return_lse=True)
        checks = check_attention(out_p[:, h], lse_p[:, h], q8[:, h], k8[:, h], v8[:, h], causal=causal,
                                 descales=(qd[:, h], kd[:, h], vd[:, h]))
        row["fp8_portable_check"] = "; ".join(str(c) for c in checks)
    providers = {"flashgen_fp8": fp8_call, "flashgen_fp8_portable": lambda: fp8_call(portable),
                 "flashgen_bf16": bf16_call,
                 "cudnn_bf16": lambda: cudnn(q16, k16, v16, causal)}
    fp8_cudnn, ref_out, why = cudnn_fp8_call(q8, k8, v8, causal)
    if fp8_cudnn is not None:
        providers["cudnn_fp8"] = fp8_cudnn
    else:
        row["cudnn_fp8"] = f"not available in this torch: {why}"
    ref16 = cudnn(q16, k16, v16, causal)
    if (bf16_call() - ref16).abs().max().item() > 0.05:
        row["error_flashgen_bf16"] = "differs from cuDNN"
    for name, fn in providers.items():
        try:
            ms = time_ms(fn)
            row[f"{name}_ms"] = round(ms, 4)
            row[f"{name}_tflops"] = round(flops / ms / 1e9, 1)
        except Exception as err:  # noqa: BLE001
            row[f"{name}_error"] = f"{type(err).__name__}: {err}"[:300]
    t8 = row.get("flashgen_fp8_ms")
    if t8:
        if row.get("flashgen_bf16_ms"):
            row["ratio_vs_bf16"] = round(row["flashgen_bf16_ms"] / t8, 3)
        anchor = "cudnn_fp8" if "cudnn_fp8_ms" in row else "cudnn_bf16"
        row["ratio_vs_cudnn"] = round(row[f"{anchor}_ms"] / t8, 3)
        row["cudnn_anchor"] = anchor
    return row


def decode_rows():
    """Decode with an FP8 KV cache beside the bf16 cache: bytes of cache per second."""
    rows = []
    for batch, kv in ((8, 8192), (1, 131072)):
        row = {"case": f"decode B={batch} KV={kv} 32/8 heads hd128", "mode": "decode"}
        try:
            q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
            kc = torch.randn(batch, kv, 8, 128, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn(batch, kv, 8, 128, device="cuda", dtype=torch.bfloat16)
            seqlens = torch.full((batch,), kv, device="cuda", dtype=torch.int32)
            from flashgen.compat import flash_attn_with_kvcache
            k8, kd = flashgen.quantize_fp8(kc, layout="bshd")
            v8, vd = flashgen.quantize_fp8(vc, layout="bshd")
            for name, (k_, v_, extra) in {"bf16_cache": (kc, vc, {}),
                                          "fp8_cache": (k8, v8, dict(k_descale=kd, v_descale=vd))}.items():
                ms = time_ms(lambda: flash_attn_with_kvcache(q, k_, v_, cache_seqlens=seqlens, causal=True, **extra))
                nbytes = 2 * batch * kv * 8 * 128 * k_.element_size()
                row[f"{name}_us"] = round(ms * 1e3, 1)
                row[f"{name}_TBps"] = round(nbytes / ms / 1e9, 3)
            row["ratio_bandwidth_fp8_vs_bf16"] = round(row["fp8_cache_TBps"] / row["bf16_cache_TBps"], 3)
        except Exception as err:  # noqa: BLE001
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--quick", action="store_true", help="hd128, S=4096 only")
    parser.add_argument("--tag", default="", type=file_tag,
                        help="file name suffix: --tag v2 writes <date>-<gpu>-fp8-v2.json")
    parser.add_argument("--no-decode", action="store_true", help="leave out the FP8 KV-cache decode rows")
    args = parser.parse_args()
    cases = [(d, s, c) for d in (64, 128, 256) for s in (4096, 16384) for c in (False, True)]
    if args.quick:
        cases = [(128, 4096, False), (128, 4096, True)]
    rows = []
    for case in cases:
        try:
            row = run_case(*case)
        except Exception as err:  # noqa: BLE001
            row = {"case": str(case), "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-800:]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    for row in ([] if args.no_decode else decode_rows()):
        print(json.dumps(row), flush=True)
        rows.append(row)
    env = environment()
    gpu = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).split("-")
    gpu = next((p for p in gpu if re.fullmatch(r"[a-z]\d+", p)), "gpu")
    date = datetime.date.today().isoformat()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = args.tag
    (out / f"{date}-{gpu}-fp8{tag}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    cols = ["flashgen_fp8", "flashgen_fp8_portable", "flashgen_bf16", "cudnn_fp8", "cudnn_bf16"]
    lines = [f"FP8 forward | {env}", "", "| case | fp8 family | " + " | ".join(f"{c} TFLOP/s" for c in cols)
             + " | ratio_vs_bf16 | ratio_vs_cudnn (anchor) |", "|---" * (len(cols) + 4) + "|"]
    for r in rows:
        if r.get("mode") != "fwd":
            continue
        cells = [str(r.get(f"{c}_tflops", "-")) for c in cols]
        lines.append(f"| {r['case']} | {r.get('fp8_family', '-')} | " + " | ".join(cells)
                     + f" | {r.get('ratio_vs_bf16', '-')} | {r.get('ratio_vs_cudnn', '-')} ({r.get('cudnn_anchor', '-')}) |")
    lines += ["", "| decode | bf16 cache us (TB/s) | fp8 cache us (TB/s) | bandwidth ratio |", "|---|---|---|---|"]
    for r in rows:
        if r.get("mode") == "decode":
            lines.append(f"| {r['case']} | {r.get('bf16_cache_us', '-')} ({r.get('bf16_cache_TBps', '-')}) | "
                         f"{r.get('fp8_cache_us', '-')} ({r.get('fp8_cache_TBps', '-')}) | "
                         f"{r.get('ratio_bandwidth_fp8_vs_bf16', r.get('error', '-'))} |")
    (out / f"{date}-{gpu}-fp8{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
