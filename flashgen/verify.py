"""The reference attention and the error rule of ../shared/TESTING.md.

The same check gates the test suite and the tuner: no config is timed, stored or
chosen before ``check_attention`` passes on fresh random inputs.

The rule, for fp16/bf16 (after flash-attn's own tests)::

    max|out - ref| <= F * max|out_pt - ref| + atol,  atol = 2 * max|(ref + 0.3 - 0.3) - ref|
    mean|out - ref| <= 1.1 * mean|out_pt - ref| + 1e-7

with ``ref`` computed in float32 from the same inputs, ``out_pt`` the same reference
in the kernel's dtype, F = 2 (3 for gradients), and atol at least 1e-5 (see compare). dQ's and dK's
``max|out_pt - ref|`` is floored by the other's relative error (check_gradients). For fp32 the reference is
float64 and the relative error ||out - ref|| / ||ref|| must stay below 1e-5 (gradients: or 3x a float32
reference's, where the inputs make fp32 itself ill-conditioned); a gradient into a named tensor
(a bias table, ALiBi slopes), whose few elements each sum many pairs' dS that largely cancel, is
held per element to 1e-5 of the size of the dS terms it summed (check_gradients).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import masks
from .expr.to_torch import evaluate, tensors_at_rank
from .spec import DTYPES, FP8_DTYPES

FP32_RTOL = 1e-5
# TESTING.md's "3x for gradients" loosens the max rule; the mean rule's 1.1x is loosened to
# 3x for gradients too. The backward's delta = rowsum(dO * O) uses the stored low-precision O,
# as FlashAttention's does; where a row sees one or two keys (sliding window 1, documents of
# length 2) dP - delta cancels and that rounding moves the mean error to ~1.7x the
# kernel-dtype reference's with the max error well inside its bound; a different fp32
# summation order (atomic dQ) moves it by more than 10% too.
GRAD_MEAN_FACTOR = 3.0
# FP8 (FlashAttention-3's rule): the max error at most 2x the same-precision reference's (FP8
# inputs, FP8 P, bf16 output); the mean at most 2x too: the kernels round P after the running
# max of each key block, the reference after the row's final max, and on inputs with outlier
# channels that alone moves the mean error by 1.2-1.4x (measured on the interpreter).
FP8_MEAN_FACTOR = 2.0
FP8_P_SCALE = 256.0  # the FP8 kernels' P_SCALE: P * 256 is rounded to FP8
_FP8_TORCH = tuple(getattr(torch, DTYPES[name]) for name in FP8_DTYPES)  # the torch dtypes of FP8 specs
ATOL_FLOOR = 1e-5


def reference_attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
                        layout: str = "bhsd", compute_dtype: torch.dtype = torch.float32,
                        dropout_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                        mask=None, score_mod=None, tensors=None, return_probs: bool = False,
                        p_dtype: torch.dtype | None = None, qk=None, pv=None, score_hook=None,
                        probs_hook=None):
    """Dense attention in plain PyTorch, computed in ``compute_dtype``.

    Matmuls run in compute_dtype; the softmax in float32 (float64 for float64) and is
    rounded back to compute_dtype, as a plain PyTorch attention in that dtype would.
    Returns (out in q's layout, lse (B, H, Sq) in float32 or float64). With a
    ``dropout_mask`` (B, H, Sq, Sk) of kept entries, P is multiplied by mask / (1 - p).
    ``mask`` and ``score_mod`` (anything a spec accepts) are evaluated densely with torch ops
    from the same definitions the kernels are generated from; ``tensors`` maps their names.
    Differentiable: gradients of the reference are the reference gradients (tensors included).
    With ``return_probs`` it returns the (B, H, Sq, Sk) softmax probabilities instead.
    ``p_dtype`` (an FP8 dtype): P is taken as the FP8 kernels take it, exp(s - rowmax) scaled
    by 256, rounded to p_dtype, multiplied by V and divided by 256 and the unrounded row sum.
    ``qk`` (B, H, Sq, Sk): the products q k^T when computed elsewhere (FP8 tensor cores);
    ``pv(p8)``: the product of the rounded P with V likewise.
    ``score_hook(scores)``: called with the scores after the score modifier, before any mask
    (check_gradients reads the per-pair dS through it); ``probs_hook(probs)`` with the probabilities
    before dropout (and dP through them).
    """
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    soft_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    scores = (q @ k.transpose(-1, -2) if qk is None else qk).to(soft_dtype) * scale
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    env = _index_env(q.shape[0], q.shape[1], seqlen_q, seqlen_k, q.device)
    pred = masks.predicate(masks.parse_mask(mask)) if mask is not None else None
    smod = masks.score_ir(masks.parse_score_mod(score_mod)) if score_mod is not None else None
    named = tensors_at_rank(tensors, pred, smod)
    if smod is not None:
        named_c = {n: (t.to(soft_dtype) if t.is_floating_point() else t) for n, t in named.items()}
        modified = torch.as_tensor(evaluate(smod, {**env, "score": scores}, named_c), device=q.device)
        # (a modifier that reads no score, a constant or a value per (b, h), is the scores' shape as the kernels': a
        # view, no copy)
        scores = modified.broadcast_to(scores.shape).to(soft_dtype)
    if score_hook is not None:
        score_hook(scores)
    if causal:
        i = torch.arange(seqlen_q, device=q.device)[:, None]
        j = torch.arange(seqlen_k, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + (seqlen_k - seqlen_q), float("-inf"))
    if pred is not None:
        visible = evaluate(pred, env, named)
        scores = scores.masked_fill(~torch.as_tensor(visible, device=q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # Rows with every key masked: probabilities 0, output 0, lse -inf.
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    if return_probs:
        return probs
    if probs_hook is not None:
        probs_hook(probs)
    if dropout_mask is not None:
        probs = probs * dropout_mask.to(probs.dtype) / (1.0 - dropout_p)
    if p_dtype is not None:
        rowmax = scores.amax(dim=-1, keepdim=True)
        p = torch.exp(scores - torch.where(torch.isinf(rowmax), 0.0, rowmax))
        total = p.sum(-1, keepdim=True)
        p8 = (p * FP8_P_SCALE).to(p_dtype)
        out = (p8.to(compute_dtype) @ v if pv is None else pv(p8)) / (FP8_P_SCALE * torch.where(total == 0, 1.0, total))
        return (out.transpose(1, 2) if layout == "bshd" else out), lse
    out = probs.to(compute_dtype) @ v
    if layout == "bshd":
        out = out.transpose(1, 2)
    return out, lse


def _index_env(batch, heads, seqlen_q, seqlen_k, device):
    ar = lambda n: torch.arange(n, device=device)  # noqa: E731
    return {"b": ar(batch)[:, None, None, None], "h": ar(heads)[None, :, None, None],
            "q_idx": ar(seqlen_q)[None, None, :, None], "kv_idx": ar(seqlen_k)[None, None, None, :],
            "seqlen_q": seqlen_q, "seqlen_k": seqlen_k}


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs):
    """The reference over packed sequences (total, H, D): each sequence on its own.
    Returns (out (total_q, H, Dv), lse (H, total_q))."""
    outs, lses = [], []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        o, l = reference_attention(q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]], v[None, ck[i]:ck[i + 1]],
                                   layout="bshd", **kwargs)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs, 0), torch.cat(lses, -1)


@dataclasses.dataclass
class CheckResult:
    name: str
    ok: bool
    max_err: float
    bound: float
    detail: str = ""

    @property
    def margin(self) -> float:
        """max error / allowed error: below 1 passes; the tuner stores it."""
        return self.max_err / self.bound if self.bound > 0 else (0.0 if self.max_err == 0 else math.inf)

    def __str__(self) -> str:
        state = "ok" if self.ok else "FAILED"
        return f"{self.name}: {state} max|err|={self.max_err:.3g} bound={self.bound:.3g} {self.detail}".rstrip()


def compare(name: str, out: torch.Tensor, ref: torch.Tensor, pt: torch.Tensor | None, *,
            factor: float = 2.0, mean_factor: float = 1.1, pt_floor: float = 0.0, max_floor: float = 0.0,
            summed: torch.Tensor | None = None, fp32_pt: torch.Tensor | None = None) -> CheckResult:
    """Apply the error rule to one tensor. ``pt`` is the kernel-dtype reference (None for fp32);
    ``pt_floor`` is a lower bound on its error from a steadier estimate, ``max_floor`` one on its largest
    error only (see check_gradients).
    ``summed`` (fp32 only): per element, the size of the terms ``ref`` sums before they cancel
    (see check_gradients); each element's error is taken relative to it (or to |ref|, if larger).
    ``fp32_pt`` (fp32 only): the reference computed in float32, whose relative error times ``factor`` floors
    FP32_RTOL, the low-precision rule's yardstick (inputs that make fp32 itself ill-conditioned: scores scaled
    60x before a softcap moved a correct backward's dK to 1.25e-5 on 1 of 21 fresh seeds)."""
    out, ref = out.detach(), ref.detach()
    pt = pt.detach() if pt is not None else None
    finite_ref = torch.isfinite(ref)
    # Entries the reference says are infinite (LSE of an empty row) must match exactly.
    if not torch.equal(torch.isinf(out), ~finite_ref) or torch.isnan(out).any():
        bad = int((torch.isnan(out) | (torch.isinf(out) != ~finite_ref)).sum())
        return CheckResult(name, False, math.inf, 0.0, f"{bad} NaN/Inf entries disagree with the reference")
    o, r = out.double()[finite_ref], ref.double()[finite_ref]
    if o.numel() == 0:
        return CheckResult(name, True, 0.0, 0.0)
    err = (o - r).abs()
    if pt is None:  # fp32: relative Frobenius error against float64
        # per element, against what it summed (an element that summed nothing: 0), before the zero-reference rule: a
        # bias over size-1 dims adds one constant to every score, so its gradient sums every dS to exactly 0 in
        # float64, and a correct fp32 kernel's sum of those terms was 3.3e-5 (CI, test_masks' (1, 1) bias)
        if summed is not None:
            size = torch.maximum(summed.double()[finite_ref].abs(), r.abs())
            rel = float(torch.where(size > 0, err / size, torch.where(err > 0, math.inf, 0.0)).max())
            return CheckResult(name, rel <= FP32_RTOL, rel, FP32_RTOL,
                               "(per element, relative to its summed |terms|, fp32 vs float64)")
        if float(r.norm()) == 0.0:  # e.g. dq with a single visible key: exactly 0 in the reference
            max_err = float(err.max())
            return CheckResult(name, max_err <= ATOL_FLOOR, max_err, ATOL_FLOOR, "(absolute, zero reference)")
        rel = float(err.norm() / r.norm())
        bound = FP32_RTOL
        if fp32_pt is not None:
            floor = factor * float((fp32_pt.detach().double()[finite_ref] - r).norm() / r.norm())
            bound = max(bound, floor) if math.isfinite(floor) else bound  # (a non-finite float32 reference: no floor)
        return CheckResult(name, rel <= bound, rel, bound, "(relative, fp32 vs float64)")
    p = pt.double()[finite_ref]
    pt_err = (p - r).abs()
    r32 = r.float()
    # The rule's atol, floored: where the reference is exactly 0 by cancellation (a row with
    # one visible key has dq = 0), the kernel's fp32 accumulation still leaves 1e-7 to 1e-6.
    atol = max(2 * float(((r32 + 0.3 - 0.3) - r32).abs().max()), ATOL_FLOOR)
    bound = factor * max(float(pt_err.max()), pt_floor, max_floor) + atol
    # When the kernel-dtype reference is exact (every pt error 0), the mean rule has no scale
    # left: hold the mean to the same absolute floor as the max.
    mean_bound = (mean_factor * max(float(pt_err.mean()), pt_floor)
                  + (1e-7 if float(pt_err.max()) > 0 else ATOL_FLOOR))
    max_err, mean_err = float(err.max()), float(err.mean())
    ok = max_err <= bound and mean_err <= mean_bound
    return CheckResult(name, ok, max_err, bound, f"mean|err|={mean_err:.3g} mean bound={mean_bound:.3g}")


def dequantized(x, descale, layout="bhsd"):
    """FP8 x (bhsd or bshd) times its (batch, kv heads) descale (None: 1), in float32; query heads
    take the factor of their KV group."""
    if descale is None:
        return x.float()
    d = _per_head(descale.expand(x.shape[0], -1), x.shape[1 if layout == "bhsd" else 2], torch.float32)
    return x.float() * (d if layout == "bhsd" else d.transpose(1, 2))


def fp8_matmul(a, b):
    """a @ b^T for FP8 (B, H, M, K) a and (B, H', N, K) b (H a multiple of H': GQA) on the tensor
    cores (torch._scaled_mm, float32 out), as an FP8 kernel multiplies: Hopper accumulates FP8
    products with fewer bits than float32, which an exact reference would not show.

    _scaled_mm multiplies no two e5m2 matrices: for an e5m2 pair each (batch, head) slice of b goes
    to e4m3 times a power of two (its largest value to [128, 256), the factor undone by _scaled_mm's
    scale): exact for every element of at least 2^-14 of the slice's largest (e4m3's 3 mantissa bits
    hold e5m2's 2); smaller ones round by at most 2^-17 of it, far below e5m2's own rounding (2^-3)."""
    group = a.shape[1] // b.shape[1]
    pad = lambda n: -n % 16  # noqa: E731 (_scaled_mm takes multiples of 16)
    m, n, kk = a.shape[2], b.shape[2], a.shape[3]
    a = torch.nn.functional.pad(a.view(torch.uint8), (0, pad(kk), 0, pad(m))).view(a.dtype)
    b = torch.nn.functional.pad(b.view(torch.uint8), (0, pad(kk), 0, pad(n))).view(b.dtype)
    one = torch.ones((), device=a.device)
    out = torch.empty(a.shape[0], a.shape[1], m, n, device=a.device)
    e5m2_pair = a.dtype == b.dtype == torch.float8_e5m2
    for i in range(a.shape[0]):
        # b's slices as _scaled_mm takes them, once per KV head (a GQA group's query heads share one)
        slices = [_e4m3_scaled(b[i, j]) if e5m2_pair else (b[i, j], one) for j in range(b.shape[1])]
        for h in range(a.shape[1]):
            b_slice, b_scale = slices[h // group]
            prod = torch._scaled_mm(a[i, h].contiguous(), b_slice.contiguous().t(), one, b_scale,
                                    out_dtype=torch.float32)
            out[i, h] = prod[:m, :n]
    return out


def _e4m3_scaled(x):
    """(e4m3 y, float32 scale) with y * scale == x for an e5m2 x but for its values under 2^-14 of its
    largest (see fp8_matmul): y = x * 2^e, its largest in [128, 256)."""
    largest = x.float().abs().max()
    if largest == 0:
        return x.float().to(torch.float8_e4m3fn), torch.ones((), device=x.device)
    e = 7 - torch.floor(torch.log2(largest))  # largest * 2^e in [2^7, 2^8), under e4m3's 448
    return (x.float() * torch.exp2(e)).to(torch.float8_e4m3fn), torch.exp2(-e).float()


def _per_head(descale, heads, like):
    """(B, H_kv) factors as (B, H, 1, 1) for H query heads."""
    return descale.float().repeat_interleave(heads // descale.shape[-1], dim=1)[:, :, None, None].to(like)


def check_attention(out, lse, q, k, v, *, causal: bool, softmax_scale: float | None = None,
                    layout: str = "bhsd", factor: float = 2.0, mask=None, score_mod=None,
                    tensors=None, descales=(None, None, None)) -> list[CheckResult]:
    """Check a kernel's (out, lse) against the reference; returns one result per tensor.

    FP8 inputs (FlashAttention-3's rule): the reference runs in float32 on the dequantized
    inputs (``descales``: q, k, v factors per (batch, KV head)), the same-precision one takes P
    in FP8 as the kernels do and rounds its output to the kernel's bf16."""
    low_precision = q.dtype in (torch.float16, torch.bfloat16)
    kw = dict(causal=causal, softmax_scale=softmax_scale, layout=layout, mask=mask, score_mod=score_mod,
              tensors=tensors)
    if q.dtype in _FP8_TORCH:
        fp8, raw = v.dtype, (q, k, v)
        q, k, v = (dequantized(t, d, layout) for t, d in zip((q, k, v), descales))
        # float64: with outlier channels the scores reach the hundreds, where a float32
        # reference's own rounding is no longer small beside the kernel's error
        out_ref, lse_ref = reference_attention(q.double(), k.double(), v.double(), compute_dtype=torch.float64,
                                               **kw)
        products = {}
        if q.is_cuda:  # the same precision includes the FP8 tensor cores' accumulation
            q8, k8, v8 = (t.transpose(1, 2) if layout == "bshd" else t for t in raw)
            ones = torch.ones(q8.shape[0], k8.shape[1], device=q.device)
            qd, kd, vd = (ones if d is None else d for d in descales)
            heads = q8.shape[1]
            products["qk"] = fp8_matmul(q8, k8) * _per_head(qd * kd, heads, torch.float32)
            v8t = v8.transpose(-1, -2).contiguous()
            products["pv"] = lambda p8: fp8_matmul(p8, v8t) * _per_head(vd, heads, torch.float32)
        out_pt, lse_pt = reference_attention(q, k, v, compute_dtype=torch.float32, p_dtype=fp8, **products, **kw)
        out_pt = out_pt.to(out.dtype)
        # The LSE takes no FP8 rounding of P: its error is the q.k accumulation's (the tensor cores'
        # order differs from cuBLAS's), held to 3x as gradients are, floored at float32 noise.
        return [compare("out", out, out_ref, out_pt, factor=factor, mean_factor=FP8_MEAN_FACTOR),
                compare("lse", lse, lse_ref, lse_pt, factor=max(factor, 3.0), mean_factor=FP8_MEAN_FACTOR,
                        pt_floor=ATOL_FLOOR)]
    elif low_precision:
        out_ref, lse_ref = reference_attention(q, k, v, compute_dtype=torch.float32, **kw)
        out_pt, lse_pt = reference_attention(q, k, v, compute_dtype=q.dtype, **kw)
    else:
        out_ref, lse_ref = reference_attention(q, k, v, compute_dtype=torch.float64, **kw)
        out_pt = lse_pt = None
    results = [compare("out", out, out_ref, out_pt, factor=factor)]
    if lse is not None:
        results.append(compare("lse", lse, lse_ref, lse_pt, factor=factor))
    return results


def _raise_failures(results: list[CheckResult]) -> list[CheckResult]:
    failed = [r for r in results if not r.ok]
    if failed:
        raise AssertionError("; ".join(str(r) for r in failed))
    return results


def assert_attention_close(out, lse, q, k, v, **kw) -> list[CheckResult]:
    return _raise_failures(check_attention(out, lse, q, k, v, **kw))


def check_gradients(grads, q, k, v, do, *, causal: bool, softmax_scale: float | None = None,
                    layout: str = "bhsd", dropout_mask=None, dropout_p: float = 0.0,
                    factor: float = 3.0, mask=None, score_mod=None, tensors=None,
                    grad_tensors=()) -> list[CheckResult]:
    """Check (dq, dk, dv, *d tensors named in grad_tensors) against the reference's gradients
    for the same dO (3x rule)."""
    kw = dict(causal=causal, softmax_scale=softmax_scale, layout=layout, dropout_mask=dropout_mask,
              dropout_p=dropout_p, mask=mask, score_mod=score_mod)
    low_precision = q.dtype in (torch.float16, torch.bfloat16)

    def ref_grads(dtype, with_sums=False, out_low=None):
        """(the reference's gradients in dtype, sums, its output): with ``with_sums`` (float64) and named tensors
        to differentiate, sums holds each one's gradient taken over the size of each pair's dS terms
        (else None). For an fp32 kernel, each element of a tensor gradient sums dS times the score's
        derivative over many pairs, and a row's dS sums to 0, so a bias table's entry for all far
        keys is mostly cancellation (a correct kernel's error relative to that small sum reached the
        fp32 bound on about 1 in 100+ fresh inputs). Its fp32 error scales with the size of what it
        summed. A pair's dS = P (dP - delta) cancels too: a table entry one pair reaches (the
        farthest key of a 9-token causal row) was off by 1.9e-5 of its |dS| in a correct kernel
        (the float32 reference's own: 6.8e-6), so each pair counts P (|dP| + |delta|). The score's
        derivative keeps its sign: where it changes sign over the pairs, the sum can still cancel,
        and compare takes |ref| when that is larger.
        With ``out_low`` (the kernel-dtype reference's output) and named tensors, sums holds instead
        each one's gradient shift when delta = rowsum(dO O) reads out_low, as a FlashAttention
        backward reads the stored output: dS moves by -P (delta' - delta), and a sum of dS weighted
        by |i - j| (an ALiBi slope) amplifies it. A correct fp16 kernel's slope error was that shift
        to 3e-5 (its own output's rounding), which autograd's softmax backward (delta from P and
        dP) does not have; with the reference's own error alone as the yardstick, a correct kernel
        failed 1 of 400 fresh seeds (1.03x the bound; the worst of those 400 with this floor: 0.62x)."""
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        named = dict(tensors or {})
        extra = []
        for name in grad_tensors:
            named[name] = named[name].detach().to(torch.float64 if dtype == torch.float64 else torch.float32)
            extra.append(named[name].requires_grad_())
        # the scores after the score modifier (their gradient: dS) and the probabilities (dP), for the sums
        scores, probs = [], []
        hooks = (dict(score_hook=scores.append, probs_hook=probs.append)
                 if (with_sums or out_low is not None) and extra else {})
        out, _ = reference_attention(*leaves, compute_dtype=dtype, tensors=named, **hooks, **kw)
        inputs = leaves + extra + scores + probs
        # (a modifier that reads no score leaves q and k out of the graph: their gradient is 0)
        grads = torch.autograd.grad(out, inputs, do.to(dtype), retain_graph=bool(scores), allow_unused=True)
        grads = tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs))
        if not scores:
            return grads, None, out.detach()
        p, dp = probs[0].detach(), grads[-1]
        if out_low is None:
            delta = (p * dp).sum(-1, keepdim=True)
            terms = p * (dp.abs() + delta.abs())
        else:
            moved = (do.to(dtype) * (out_low.to(dtype) - out.detach())).sum(-1)  # delta' - delta per row
            terms = -p * (moved.transpose(1, 2) if layout == "bshd" else moved)[..., None]
        return grads[:-2], torch.autograd.grad(scores, extra, terms, allow_unused=True), out.detach()

    names = ("dq", "dk", "dv", *(f"d{n}" for n in grad_tensors))
    sums = None
    shifts = [None] * len(grad_tensors)
    if low_precision:
        low, _, out_low = ref_grads(q.dtype)  # tensor grads stay float32, with the kernel dtype's matmul error in them
        refs, moved, _ = ref_grads(torch.float32, out_low=out_low)
        shifts = list(moved or shifts)
        pts = [g.to(q.dtype) for g in low[:3]] + list(low[3:])
    else:
        refs, sums, _ = ref_grads(torch.float64, with_sums=True)
        pts = [None] * len(names)
        fp32_pts = list(ref_grads(torch.float32)[0][:3])
    summed = [None] * 3 + list(sums or [None] * len(grad_tensors))
    # A tensor gradient (an ALiBi slope, a bias table) sums dS over many (query, key) pairs into
    # few elements: its mean error is its max error, so it is held to the max rule's factor. Its
    # own kernel-dtype reference error is a max over those few sums, too noisy a yardstick alone
    # (with 2 slopes a correct kernel failed ~15% of fresh inputs): it is floored by dK's relative
    # error (the same dS, summed over many elements) times the gradient's magnitude.
    #
    # dQ = dS K and dK = dS^T Q carry the same rounding of dS: each one's largest error is held to at least
    # the other's relative error in the kernel-dtype reference times its own magnitude. Alone, the largest of
    # a few hundred errors is a noisy yardstick: a correct kernel failed dK at 17x17 tokens on a seed CI met
    # (max|err| 1.26x the bound; 0.48x with this floor, the worst of 120 fresh seeds 0.49x), and the tuner's
    # gate rejected a correct default on dQ once in 356 checks. The mean rule keeps each one's own yardstick.
    scale = [float(r.abs().max()) for r in refs]
    rel = [float((pt.float() - r).abs().max()) / s if low_precision and s > 0 else 0.0
           for pt, r, s in zip(pts[:2], refs[:2], scale[:2])]
    max_floor = [rel[1] * scale[0], rel[0] * scale[1]] + [0.0] * (len(names) - 2)
    floor = rel[1] if len(names) > 3 else 0.0
    # a tensor gradient's yardstick is also floored by its shift from delta read off the
    # kernel-dtype output (see ref_grads)
    floors = [0.0] * 3 + [max(floor * scale[3 + i], float(s.abs().max()) if s is not None else 0.0)
                          for i, s in enumerate(shifts)]
    return [compare(name, g, r, pt, factor=factor, mean_factor=GRAD_MEAN_FACTOR if i < 3 else factor,
                    pt_floor=floors[i], max_floor=max_floor[i], summed=summed[i],
                    fp32_pt=None if low_precision or i >= 3 else fp32_pts[i])
            for i, (name, g, r, pt) in enumerate(zip(names, grads, refs, pts))]


def assert_gradients_close(grads, q, k, v, do, **kw) -> list[CheckResult]:
    return _raise_failures(check_gradients(grads, q, k, v, do, **kw))
