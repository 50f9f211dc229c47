"""Benchmarks: flashgen beside the anchors (PyTorch SDPA's backends, FlexAttention), and reports.

Every anchor runs on the same randn inputs as flashgen and its output is compared with
flashgen's before it is timed. Inputs, FLOPs and timing are those the tuner uses
(inputs.py, flops.py, timing.py): TFLOP/s count visible (query, key) pairs only; times are
medians of CUDA-event runs after warm-up with L2 flushed.
"""

from __future__ import annotations

import platform

import torch

from . import masks
from .expr.ir import reads_var, tensors_of
from .expr.to_torch import evaluate, tensors_at_rank
from .flops import pairs_flops, tflops, visible_count
from .inputs import named_tensors
from .quant import quantize_fp8
from .timing import time_ms


def environment() -> dict:
    """GPU and library versions, recorded beside every benchmark result."""
    import triton

    from . import __version__

    env = {
        "flashgen": __version__, "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sm_count=props.multi_processor_count,
                   capability=f"{props.major}.{props.minor}", memory_gib=round(props.total_memory / 2**30, 1),
                   cuda=torch.version.cuda)
    return env


def fp8_inputs(q, k, v):
    """q, k, v in e4m3 as the FP8 forward takes them (quantize_fp8: a descale per (batch, KV head); V
    seq-contiguous, the layout the FP8 MMA reads, made once): (q8, k8, v8, (q_descale, k_descale, v_descale))."""
    (q8, q_descale), (k8, k_descale) = (quantize_fp8(t) for t in (q, k))
    v8, v_descale = quantize_fp8(v, seq_contiguous=True)
    return q8, k8, v8, (q_descale, k_descale, v_descale)


def file_tag(tag: str) -> str:
    """A results file's name suffix from a benchmark's --tag (its argparse type): 'v2' and '-v2' both give
    '-v2' (argparse takes `--tag v2`; `--tag=-v2` names the same files)."""
    return "" if not tag else tag if tag.startswith("-") else f"-{tag}"


def gpu_tag(env: dict) -> str:
    """The GPU's short name for results' file names (<date>-<gpu>-<topic>): 'h100', 'h200', 'cpu'."""
    return str(env.get("gpu") or "cpu").lower().replace("nvidia ", "").split()[0]


# ----------------------------------------------------------------------------- anchors
def sdpa_runner(backend):
    """PyTorch SDPA pinned to one backend (FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION)."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return run


def flex_runner(seqlen, causal):
    """FlexAttention compiled for one shape. A fresh, static-shape compile per case: after a few
    shapes dynamo would otherwise recompile with dynamic shapes (slower) or fall back to eager."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, seqlen, seqlen) if causal else None
    return lambda q, k, v, causal_: compiled(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def flex_mods(spec, q, k, tensors=None):
    """FlexAttention (compiled, static shapes) with the spec's mask as mask_mod and its score
    modifier as score_mod, both evaluated from the same definitions as flashgen's kernels."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    node = spec.mask_node
    pred = masks.predicate(node) if node is not None else None
    smod = masks.score_ir(spec.score_mod) if spec.score_mod is not None else None
    named = tensors_at_rank(tensors, pred, smod)
    sizes = {"seqlen_q": seqlen_q, "seqlen_k": seqlen_k}
    block_mask = score_mod = None
    if pred is not None:
        def mask_mod(b, h, q_idx, kv_idx):
            return evaluate(pred, {"b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx, **sizes}, named)
        uses_b = reads_var(pred, "b") or bool(tensors_of(pred))
        block_mask = create_block_mask(mask_mod, q.shape[0] if uses_b else None,
                                       q.shape[1] if reads_var(pred, "h") else None, seqlen_q, seqlen_k,
                                       device=q.device)
    if smod is not None:
        def score_mod(score, b, h, q_idx, kv_idx):
            env = {"score": score, "b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx, **sizes}
            return evaluate(smod, env, named)
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q_, k_, v_: compiled(q_, k_, v_, block_mask=block_mask, score_mod=score_mod,
                                       scale=spec.scale, enable_gqa=q_.shape[1] != k_.shape[1])


def bench_spec(kernel, seqlens, *, tokens: int = 16384, modes=("fwd", "fwd_bwd")) -> list[dict]:
    """Time a kernel (flashgen.load / compile) beside SDPA's flash, cuDNN and efficient backends and
    FlexAttention on the same randn inputs, (batch, heads, S, D) with batch = tokens // S.
    Every anchor's output is compared with flashgen's before it is timed."""
    from torch.nn.attention import SDPBackend

    spec = kernel.spec
    plain = spec.mask is None and spec.score_mod is None  # SDPA can run only plain and causal attention
    anchors = {"sdpa_flash": lambda s, q, k, t: sdpa_runner(SDPBackend.FLASH_ATTENTION),
               "sdpa_cudnn": lambda s, q, k, t: sdpa_runner(SDPBackend.CUDNN_ATTENTION),
               "sdpa_efficient": lambda s, q, k, t: sdpa_runner(SDPBackend.EFFICIENT_ATTENTION)} if plain else {}
    anchors["flex"] = ((lambda s, q, k, t: flex_runner(s, spec.causal)) if plain else
                       (lambda s, q, k, t: (lambda f: lambda q_, k_, v_, c: f(q_, k_, v_))(flex_mods(spec, q, k, t))))
    rows = []
    for seqlen in seqlens:
        batch = max(1, tokens // seqlen)
        shape = lambda h, d: (batch, h, seqlen, d)  # noqa: E731
        q = torch.randn(shape(spec.num_heads, spec.head_dim), device="cuda", dtype=spec.torch_dtype)
        k = torch.randn(shape(spec.num_kv_heads, spec.head_dim), device="cuda", dtype=spec.torch_dtype)
        v = torch.randn(shape(spec.num_kv_heads, spec.head_dim_v), device="cuda", dtype=spec.torch_dtype)
        do = torch.randn(shape(spec.num_heads, spec.head_dim_v), device="cuda", dtype=spec.torch_dtype)
        tensors = named_tensors(spec, batch, seqlen)
        pairs = visible_count(spec, batch, seqlen, seqlen, tensors)
        for mode in modes:
            flops = pairs_flops(pairs, spec.head_dim, spec.head_dim_v, mode=mode)
            row = {"seqlen": seqlen, "batch": batch, "mode": mode, "config": str(kernel.config_for(seqlen)),
                   "visible_fraction": pairs / (batch * spec.num_heads * seqlen * seqlen)}
            ref = None
            for name, make in [("flashgen", None), *anchors.items()]:
                try:
                    attn = ((lambda q_, k_, v_, c: kernel(q_, k_, v_, **tensors)) if make is None
                            else make(seqlen, q, k, tensors))
                    step = _step(attn, q, k, v, do, spec.causal, mode)
                    out = step()
                    if ref is None:
                        ref = out
                    else:
                        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(out, ref))
                        if not err < 0.1:
                            row[name] = {"error": f"max|{name} - flashgen| = {err:.3g}"}
                            continue
                    ms = time_ms(step)
                    row[name] = {"ms": ms, "tflops": tflops(flops, ms)}
                except Exception as exc:  # an anchor that cannot run this case is reported, not fatal
                    row[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            rows.append(row)
    return rows


def _step(attn, q, k, v, do, causal, mode):
    if mode == "fwd":
        return lambda: (attn(q, k, v, causal),)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    return lambda: torch.autograd.grad(attn(*leaves, causal), leaves, do)


ANCHORS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex")


def report_markdown(spec_uri: str, rows: list[dict], env: dict) -> str:
    tf = lambda r, c: (r.get(c) or {}).get("tflops")  # noqa: E731
    lines = [f"{spec_uri} | {env.get('gpu')} | torch {env['torch']} | triton {env['triton']} | flashgen "
             f"{env['flashgen']}", "", "TFLOP/s (masked work not counted; fwd+bwd = 3.5x fwd FLOPs)", "",
             "| S | mode | flashgen | " + " | ".join(ANCHORS) + " | " + " | ".join(f"vs {a}" for a in ANCHORS) + " |",
             "|---" * (3 + 2 * len(ANCHORS)) + "|"]
    for r in rows:
        ours = tf(r, "flashgen")
        cells = [f"{tf(r, a):.0f}" if tf(r, a) else "-" for a in ANCHORS]
        ratios = [f"{ours / tf(r, a):.2f}" if ours and tf(r, a) else "-" for a in ANCHORS]
        lines.append(f"| {r['seqlen']} | {r['mode']} | {f'{ours:.0f}' if ours else 'err'} | " + " | ".join(cells)
                     + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines) + "\n"


def report_plot(path, spec_uri: str, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["mode"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        sub = [r for r in rows if r["mode"] == mode]
        xs = [str(r["seqlen"]) for r in sub]
        for i, name in enumerate(("flashgen", *ANCHORS)):
            ys = [(r.get(name) or {}).get("tflops") or 0 for r in sub]
            ax.bar([j + i * 0.15 for j in range(len(xs))], ys, width=0.15, label=name)
        ax.set_xticks([j + 0.3 for j in range(len(xs))], xs)
        ax.set(title=f"{spec_uri}: {mode}", xlabel="sequence length", ylabel="TFLOP/s")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
