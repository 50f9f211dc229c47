"""Timing and FLOP counting, shared by the benchmark scripts and the tuner.

FLOPs follow the FlashAttention papers: 2 * (head_dim + head_dim_v) multiply-adds per
visible (query, key) pair per head; masked-out pairs are not counted. Times are the
median of triton.testing.do_bench (CUDA events, after warm-up, L2 flushed between runs)
on randn inputs, never zeros.
"""

from __future__ import annotations

import math
import platform

import torch


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """Number of (query, key) pairs that are not masked (bottom-right causal alignment)."""
    if not causal:
        return seqlen_q * seqlen_k
    offset = seqlen_k - seqlen_q
    # Row i sees clamp(i + offset + 1, 0, seqlen_k) keys: none before row `first`,
    # a growing count up to row `full`, every key from there on.
    first = min(seqlen_q, max(0, -offset))
    full = min(seqlen_q, max(first, seqlen_k - offset - 1))
    growing = (first + offset + 1 + full + offset) * (full - first) // 2
    return growing + (seqlen_q - full) * seqlen_k


def pairs_flops(pairs: int, head_dim: int, head_dim_v: int | None = None, *, mode: str = "fwd") -> float:
    """FLOPs of attention over `pairs` visible (query, key) pairs, summed over batch and heads:
    Q K^T and P V in the forward; mode fwd, bwd (2.5x fwd) or fwd_bwd (3.5x)."""
    head_dim_v = head_dim_v or head_dim
    return 2.0 * pairs * (head_dim + head_dim_v) * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    head_dim_v: int | None = None, *, causal: bool = False, mode: str = "fwd") -> float:
    """FLOPs of plain or causal attention, masked work not counted (see pairs_flops)."""
    return pairs_flops(batch * heads * visible_pairs(seqlen_q, seqlen_k, causal), head_dim, head_dim_v, mode=mode)


def visible_count(spec, batch: int, seqlen_q: int, seqlen_k: int, tensors=None, *, device="cuda",
                  rows_per_chunk: int = 1024) -> int:
    """Visible (query, key) pairs summed over batch and heads for any spec's mask, counted by
    evaluating the mask densely in row chunks (the same definition the kernels are generated from)."""
    from . import masks
    from .expr.ir import reads_var, tensors_of
    from .expr.to_torch import evaluate, tensors_at_rank

    node = spec.mask_node
    if node is None:
        return batch * spec.num_heads * seqlen_q * seqlen_k
    pred = masks.predicate(node)
    uses_b = reads_var(pred, "b") or bool(tensors_of(pred))
    uses_h = reads_var(pred, "h")
    named = {n: t.to(device) for n, t in tensors_at_rank(tensors, pred).items()}
    total = 0
    for b in range(batch if uses_b else 1):
        for h in range(spec.num_heads if uses_h else 1):
            for r0 in range(0, seqlen_q, rows_per_chunk):
                rows = torch.arange(r0, min(seqlen_q, r0 + rows_per_chunk), device=device)[:, None]
                env = {"b": torch.tensor(b, device=device), "h": torch.tensor(h, device=device), "q_idx": rows,
                       "kv_idx": torch.arange(seqlen_k, device=device)[None, :], "seqlen_q": seqlen_q,
                       "seqlen_k": seqlen_k}
                vis = torch.as_tensor(evaluate(pred, env, named), device=device)
                total += int(vis.expand(rows.shape[0], seqlen_k).sum())
    return total * (1 if uses_b else batch) * (1 if uses_h else spec.num_heads)


def time_ms(fn, *, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of fn() on the current CUDA device."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12 if ms > 0 and math.isfinite(ms) else 0.0


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

    from . import masks
    from .expr.ir import reads_var, tensors_of
    from .expr.to_torch import evaluate, tensors_at_rank

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


def bench_tensors(spec, batch: int, seqlen: int, *, documents: int = 4, device="cuda") -> dict:
    """Inputs for the tensors a spec reads, for benchmarks: document ids of `documents` equal
    documents, ALiBi slopes 2^(-8 i / heads) (flash-attn's), a randn bias table, prefix seqlen // 2."""
    out = {}
    for name in spec.tensor_names:
        if name in ("document_ids", "doc", "docs"):
            out[name] = (torch.arange(seqlen, device=device) * documents // seqlen).to(torch.int32)
        elif name == "alibi_slopes":
            h = spec.num_heads
            out[name] = torch.tensor([2 ** (-8 * (i + 1) / h) for i in range(h)], device=device)
        elif name == "rel_bias":
            out[name] = torch.randn(spec.num_heads, 2 * seqlen - 1, device=device)
        elif name.startswith("prefix"):
            out[name] = torch.full((batch,), seqlen // 2, dtype=torch.int32, device=device)
        else:
            raise ValueError(f"{name}: no benchmark input for this tensor; time it from your own script")
    return out


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
        tensors = bench_tensors(spec, batch, seqlen)
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
