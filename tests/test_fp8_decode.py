"""Decode over an FP8 KV cache (issue 17): float8_e4m3fn / float8_e5m2 k_cache and v_cache with
flash-attn 3's float32 (batch, kv_heads) k_descale / v_descale, queries in fp16 here (fp32 where a
case needs the interpreter's exact dot), against the reference on the dequantized cache
(x_fp8 * descale) by the rule of ../shared/TESTING.md, and the errors of bad FP8 input.

Under the interpreter, loading FP8 and converting it up is exact (checked below); its fp32 -> FP8
cast is not, so the append kernel rounds by hand there (flashgen/runtime/decode.py,
_quantize_fp8), and the test compares the cache it writes bit for bit with torch's cast.
"""

import types

import pytest
import torch

import flashgen
from flashgen import AttentionSpec
from flashgen.compat import flash_attn_with_kvcache
from flashgen.runtime import decode as host_decode
from flashgen.verify import compare

from .test_decode import DTYPES, Cache, _seeded, reference_decode

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def quantize(x, descale, fp8):
    """x / descale in FP8, saturated, as a serving framework writes its cache (torch's cast: nearest even)."""
    limit = torch.finfo(fp8).max
    return (x.float() / descale).clamp(-limit, limit).to(fp8)


class Fp8Cache:
    """test_decode.Cache quantized to an FP8 dtype with random descales per (batch, KV head); the
    dense keys and values become the dequantized ones (what the kernels must attend over).
    Unused slots stay NaN (NaN is an FP8 value in both formats)."""

    def __init__(self, gen, fp8, batch, kv_heads, d, lengths, capacity, dtype, device, page_size=None, appended=0):
        base = Cache(gen, batch, kv_heads, d, lengths, capacity, dtype, "cpu", page_size, appended)
        self.__dict__.update(base.__dict__)
        # descales near the ones a calibration would give (amax / FP8 max), one per (element, head)
        self.k_descale = (torch.rand(batch, kv_heads, generator=gen) * 0.02 + 0.005)
        self.v_descale = (torch.rand(batch, kv_heads, generator=gen) * 0.02 + 0.005)
        k8 = torch.full(self.k_cache.shape, float("nan")).to(fp8)
        v8 = torch.full(self.v_cache.shape, float("nan")).to(fp8)
        for b, n in enumerate(self.lengths):
            kd, vd = self.k_descale[b][:, None], self.v_descale[b][:, None]
            qk, qv = quantize(self.dense_k[b], kd, fp8), quantize(self.dense_v[b], vd, fp8)
            self.dense_k[b], self.dense_v[b] = qk.float() * kd, qv.float() * vd  # what the kernel sees
            stored = n - appended
            if page_size is None:
                k8[b, :stored], v8[b, :stored] = qk[:stored], qv[:stored]
            else:
                j = torch.arange(stored)
                page, slot = self.block_table[b].long()[j // page_size], j % page_size
                k8[page, slot], v8[page, slot] = qk[:stored], qv[:stored]
        self.k_cache, self.v_cache = k8.to(device), v8.to(device)
        self.k_descale, self.v_descale = self.k_descale.to(device), self.v_descale.to(device)
        for name in ("block_table", "cache_seqlens", "new_k", "new_v"):
            t = getattr(self, name)
            setattr(self, name, t.to(device) if t is not None else None)


def run_fp8_decode(device, *, fp8="e4m3", dtype="fp16", heads=(4, 2), d=32, batch=3, sq=1, lengths=(37, 1, 20),
                   capacity=48, page_size=None, appended=0, num_splits=1, descales=True, BLOCK_N=16, head_scales=None,
                   factor=2.0, mean_factor=1.1, truncated_output=False, causal=True, **knobs):
    """flashgen.decode over a fresh FP8 cache, out and LSE checked against the dequantized reference.
    head_scales: a factor per query head that q is multiplied by (rows of very different magnitudes).
    truncated_output: out's last cast rounds toward zero (the interpreter's fp32 -> bf16), so each
    element may be off by that rounding beyond the same-precision reference's own error: the rule
    is applied to a reference whose error is the two added (interpreter_cast_reference)."""
    seed, gen = _seeded()
    torch_dtype = DTYPES[dtype]
    spec = AttentionSpec(dtype=dtype, head_dim=d, num_heads=heads[0], num_kv_heads=heads[1], causal=causal,
                         backward=False)
    lengths = list(lengths)[:batch]
    cache = Fp8Cache(gen, FP8[fp8], batch, heads[1], d, lengths, capacity, torch_dtype, device, page_size, appended)
    if not descales:  # a missing descale is 1.0: the reference sees the FP8 values as they are
        cache.dense_k = [x / cache.k_descale[b].cpu()[:, None] for b, x in enumerate(cache.dense_k)]
        cache.dense_v = [x / cache.v_descale[b].cpu()[:, None] for b, x in enumerate(cache.dense_v)]
        if appended:
            raise ValueError("appended keys are quantized with the descales: pass descales=True")
    q = torch.randn(batch, sq, heads[0], d, generator=gen)
    if head_scales is not None:
        q = q * torch.tensor(head_scales)[:, None]
    q = q.to(device=device, dtype=torch_dtype)
    out = torch.full((batch, sq, heads[0], d), float("nan"), dtype=torch_dtype, device=device)
    lse = torch.full((batch, heads[0], sq), float("nan"), dtype=torch.float32, device=device)
    scales = dict(k_descale=cache.k_descale, v_descale=cache.v_descale) if descales else {}
    flashgen.decode(spec, q, cache.k_cache, cache.v_cache, cache.cache_seqlens, k=cache.new_k, v=cache.new_v,
                    block_table=cache.block_table, out=out, lse=lse, num_splits=num_splits, BLOCK_N=BLOCK_N,
                    **scales, **knobs)
    out_ref, lse_ref, out_pt, lse_pt = reference_decode(q, cache, causal=causal)
    what = f"{fp8} {spec.uri} sq={sq} lengths={lengths} page_size={page_size} splits={num_splits} seed={seed}"
    if truncated_output:
        out_pt = interpreter_cast_reference(out_ref, out_pt)
    for result in (compare("out", out, out_ref, out_pt, factor=factor, mean_factor=mean_factor),
                   compare("lse", lse, lse_ref, lse_pt)):
        assert result.ok, f"{what}: {result}"
    return cache, out, lse


# ----------------------------------------------------------------------------- the interpreter's FP8
@pytest.mark.parametrize("fp8", sorted(FP8))
def test_interpreter_upcasts_fp8_exactly(fp8):
    # What the CPU tests rest on: every FP8 value (all 256 codes but NaN) is exact in fp16, and
    # torch's fp16 view of the codes equals their float32 values.
    codes = torch.arange(256, dtype=torch.uint8).view(FP8[fp8])
    values = codes.float()
    finite = torch.isfinite(values)
    assert torch.equal(values[finite].half().float(), values[finite])


# ----------------------------------------------------------------------------- the grid
@pytest.mark.parametrize("fp8,heads,sq,page_size,num_splits,fused", [
    ("e4m3", (4, 2), 1, None, 1, None),  # GQA, contiguous, no split
    ("e4m3", (4, 1), 1, None, 3, True),  # MQA, split, merged in the split kernel (fused_combine)
    ("e5m2", (4, 2), 2, None, 2, None),
    ("e4m3", (4, 2), 1, 1, 2, None),  # paged, page size 1
    ("e4m3", (4, 2), 3, 3, 1, None),  # page size 3: a page per key
    ("e5m2", (4, 2), 5, 16, 4, None),  # page 16: a page per tile, several query rows
    ("e4m3", (8, 2), 7, 64, 2, True),  # 28 packed rows (two row blocks), a page larger than the tiles; fused
], ids=["e4m3-gqa", "e4m3-mqa-split-fused", "e5m2-sq2-split", "e4m3-page1", "e4m3-page3", "e5m2-page16-sq5",
        "e4m3-page64-two-row-blocks-fused"])
def test_fp8_cache_matches_dequantized_reference(device, fp8, heads, sq, page_size, num_splits, fused):
    capacity = 128 if page_size == 64 else 48
    run_fp8_decode(device, fp8=fp8, heads=heads, sq=sq, page_size=page_size, num_splits=num_splits,
                   lengths=(37, 3 if sq > 3 else 1, 20), capacity=capacity, fused_combine=fused)


def interpreter_cast_reference(ref, pt):
    """pt moved away from ref by ref's own round-toward-zero bf16 cast, element by element: a
    same-precision reference whose error is pt's plus the interpreter's output rounding (which
    rounds fp32 -> bf16 toward zero: one ulp at most, half on average, where torch's cast to
    nearest gives half and a quarter)."""
    ref = ref.float()
    truncated = (ref.view(torch.int32) & ~0xFFFF).view(torch.float32)  # bf16 keeps the top 16 bits
    pt_err = pt.float() - ref
    return ref + torch.where(pt_err < 0, -1.0, 1.0) * (pt_err.abs() + (truncated - ref).abs())


def test_interpreter_cast_reference_adds_the_truncation():
    ref = torch.tensor([1.0 + 2.0 ** -9, -3.0 - 2.0 ** -8, 0.5, 7.0 + 2.0 ** -7])
    pt = ref.to(torch.bfloat16)
    got = interpreter_cast_reference(ref, pt)
    truncation = torch.tensor([2.0 ** -9, 2.0 ** -8, 0.0, 2.0 ** -7])  # toward zero: the low bits dropped
    assert torch.allclose((got - ref).abs(), (pt.float() - ref).abs() + truncation)


def test_bf16_queries_compute_in_fp16(device, fp8="e4m3"):  # e5m2: tests/test_fp8_decode_gpu.py
    # bf16 queries over an FP8 cache: both products run on fp16 operands (runtime/decode.py's
    # fp16_dot; the interpreter's bf16 tl.dot is wrong, so this fails unless they do), q scaled
    # per packed row by a power of two: a row beyond fp16's range (3e5: a plain cast overflows
    # to inf) and one at its subnormals (1e-6) keep the reference's accuracy.
    # The interpreter rounds fp32 -> bf16 toward zero (one ulp, where torch's reference rounds to
    # nearest: half an ulp, and no bias), so on the CPU the rule holds out against a reference that
    # carries that rounding too (doubled bounds failed about one fresh input in 40, seed 282803353);
    # the LSE (fp32) keeps the rule, and tests/test_fp8_decode_gpu.py checks bf16 out by the rule itself.
    run_fp8_decode(device, fp8=fp8, dtype="bf16", heads=(4, 2), head_scales=(3e5, 1.0, 1e-6, 40.0), num_splits=2,
                   lengths=(37, 1, 20), truncated_output=device == "cpu")


def test_which_tiles_convert_how():
    # fp16 products for an FP8 cache under a bf16 output only; V's asm conversion only on a GPU
    # (the interpreter runs no asm) and only where the products are fp16 (an fp32 spec casts).
    from flashgen.runtime.decode import fp8_v_conversion, fp16_dot

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    e4, e5, bf16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
    assert fp16_dot(e4, bf16) and fp16_dot(e5, bf16)
    assert not fp16_dot(bf16, bf16) and not fp16_dot(e4, torch.float16) and not fp16_dot(e4, torch.float32)
    assert fp8_v_conversion(e4, bf16, cuda) == 1 and fp8_v_conversion(e5, torch.float16, cuda) == 2
    assert fp8_v_conversion(e4, bf16, cpu) == fp8_v_conversion(e4, torch.float32, cuda) == 0
    assert fp8_v_conversion(bf16, bf16, cuda) == 0


def test_missing_descales_are_one(device):
    run_fp8_decode(device, descales=False, num_splits=2, page_size=16)


def test_fp8_queries_with_q_descale(device):
    # An FP8 q (flash-attn 3's all-FP8 call) is read in FP8 and its descale joins the softmax
    # scale: the same output as the dequantized query in the spec's dtype (fp32 here: exact).
    seed, gen = _seeded()
    spec = AttentionSpec(dtype="fp32", head_dim=32, num_heads=4, num_kv_heads=2, causal=True, backward=False)
    cache = Fp8Cache(gen, torch.float8_e4m3fn, 2, 2, 32, (29, 7), 32, torch.float32, device)
    q8 = (torch.randn(2, 1, 4, 32, generator=gen) * 40).to(torch.float8_e4m3fn).to(device)
    q_descale = (torch.rand(2, 2, generator=gen) * 0.05 + 0.01).to(device)
    scales = dict(k_descale=cache.k_descale, v_descale=cache.v_descale)
    out = flashgen.decode(spec, q8, cache.k_cache, cache.v_cache, cache.cache_seqlens, q_descale=q_descale, **scales)
    q = q8.float() * q_descale.repeat_interleave(2, dim=1)[:, None, :, None]
    expected = flashgen.decode(spec, q, cache.k_cache, cache.v_cache, cache.cache_seqlens, **scales)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=f"seed={seed}")


@pytest.mark.parametrize("fp8", sorted(FP8))
@pytest.mark.parametrize("page_size", [None, 3])
def test_append_quantizes_on_write(device, fp8, page_size):
    # New keys and values come in q's dtype and are written as x / descale in FP8, bit for bit
    # torch's cast (nearest even), saturated past the FP8 range, subnormals included; then attended.
    cache, _, _ = run_fp8_decode(device, fp8=fp8, appended=3, page_size=page_size, lengths=(9, 4, 20), capacity=24)
    dtype = FP8[fp8]
    gen = torch.Generator().manual_seed(17)
    # magnitudes from 1e-6 (subnormal in FP8 after the descale) to 6e4 (past the FP8 range: saturates)
    k = torch.randn(3, 1, 2, 32, generator=gen) * 10 ** (torch.rand(3, 1, 2, 32, generator=gen) * 9 - 6)
    k[..., 0], k[..., 1] = 60000.0, -0.0
    k = k.half().to(device)
    v = -k
    q = torch.zeros(3, 1, 4, 32, dtype=torch.float16, device=device)
    lengths = cache.cache_seqlens + 3
    spec = AttentionSpec(dtype="fp16", head_dim=32, num_heads=4, num_kv_heads=2, causal=True, backward=False)
    flashgen.decode(spec, q, cache.k_cache, cache.v_cache, lengths, k=k, v=v, block_table=cache.block_table,
                    k_descale=cache.k_descale, v_descale=cache.v_descale)
    for b in range(3):
        n = int(lengths[b]) + 1
        if page_size is None:
            got_k, got_v = cache.k_cache[b, n - 1], cache.v_cache[b, n - 1]
        else:
            page = cache.block_table[b, (n - 1) // page_size].long()
            got_k, got_v = cache.k_cache[page, (n - 1) % page_size], cache.v_cache[page, (n - 1) % page_size]
        want_k = quantize(k[b, 0], cache.k_descale[b][:, None], dtype)
        want_v = quantize(v[b, 0], cache.v_descale[b][:, None], dtype)
        assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8)), f"element {b}"
        assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8)), f"element {b}"


def test_quantize_by_hand_rounds_like_torch():
    # The interpreter's rounding (_quantize_fp8 BY_HAND) against torch's cast on values that
    # carry into the exponent, ties, subnormals and the saturation bound, for both formats.
    for fp8 in FP8.values():
        drop, min_normal, magic, limit = host_decode.fp8_rounding(fp8)
        x = torch.cat([torch.linspace(-limit * 1.1, limit * 1.1, 4001), torch.linspace(-4 * min_normal,
                       4 * min_normal, 4001), torch.tensor([7.96, 3.75, 0.0, -0.0, 2 ** -10, 1.0625, 1.1875])])
        y = x.clamp(-limit, limit)
        a = y.abs()
        bits = a.view(torch.int32)
        bits = (bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)) & (-(1 << drop))
        a = torch.where(a < min_normal, (a + magic) - magic, bits.view(torch.float32))
        by_hand = torch.where(y.view(torch.int32) < 0, -a, a)
        assert torch.equal(by_hand.to(fp8).view(torch.uint8), y.to(fp8).view(torch.uint8)), fp8
        assert torch.equal(by_hand.view(torch.int32), y.to(fp8).float().view(torch.int32)), fp8  # exact before the cast


def test_flash_attn_with_kvcache_fp8(device):
    # flash-attn 3's names: k_descale, v_descale (batch, kv_heads); paged, appending.
    seed, gen = _seeded()
    cache = Fp8Cache(gen, torch.float8_e4m3fn, 3, 2, 32, (37, 2, 20), 48, torch.float16, device, page_size=16,
                     appended=2)
    q = torch.randn(3, 2, 4, 32, generator=gen).to(device=device, dtype=torch.float16)
    out, lse = flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache, k=cache.new_k, v=cache.new_v,
                                       cache_seqlens=cache.cache_seqlens, block_table=cache.block_table, causal=True,
                                       k_descale=cache.k_descale, v_descale=cache.v_descale, num_splits=2,
                                       return_softmax_lse=True)
    out_ref, lse_ref, out_pt, lse_pt = reference_decode(q, cache, causal=True)
    assert compare("out", out, out_ref, out_pt).ok, f"seed={seed}"
    assert compare("lse", lse, lse_ref, lse_pt).ok, f"seed={seed}"


# ----------------------------------------------------------------------------- bad input
def _inputs(device, fp8=torch.float8_e4m3fn):
    q = torch.zeros(2, 1, 4, 16, dtype=torch.float16, device=device)
    cache = torch.zeros(2, 8, 2, 16, dtype=fp8, device=device)
    return q, cache, torch.ones(2, 2, device=device)


SPEC16 = AttentionSpec(dtype="fp16", head_dim=16, num_heads=4, num_kv_heads=2, causal=True, backward=False)


@pytest.mark.parametrize("name,value,match", [
    ("k_descale", torch.ones(2, 4), r"k_descale: expected a float32 tensor of shape \(batch, kv_heads\) = \(2, 2\)"),
    ("v_descale", torch.ones(2, 2, dtype=torch.float16), "v_descale: expected a float32 tensor"),
    ("k_descale", torch.ones(2), "k_descale: expected a float32 tensor"),
    ("v_descale", 1.0, "v_descale: expected a float32 tensor"),
    ("k_descale", torch.ones(2, 2, device="meta"), "k_descale: expected .* on {device}, got .* on meta"),
], ids=["shape", "dtype", "rank", "not-a-tensor", "device"])
def test_bad_descales_are_errors(device, name, value, match):
    q, cache, _ = _inputs(device)
    if isinstance(value, torch.Tensor) and value.device.type != "meta":
        value = value.to(device)
    match = match.format(device=q.device)  # the tensors' own device: cpu, or cuda:0
    with pytest.raises(ValueError, match=match):
        flashgen.decode(SPEC16, q, cache, cache, 3, **{name: value})


def test_descales_of_tensors_not_in_fp8_are_errors(device):
    q, cache, ones = _inputs(device)
    half = cache.half()
    with pytest.raises(ValueError, match="k_descale: descales apply to an FP8 k_cache; k_cache is torch.float16"):
        flashgen.decode(SPEC16, q, half, half, 3, k_descale=ones)
    with pytest.raises(ValueError, match="v_descale: descales apply to an FP8 v_cache"):
        flash_attn_with_kvcache(q, half, half, cache_seqlens=3, v_descale=ones)
    with pytest.raises(ValueError, match="q_descale: descales apply to an FP8 q; q is torch.float16"):
        flashgen.decode(SPEC16, q, cache, cache, 3, q_descale=ones)


def test_mixed_and_foreign_cache_dtypes_are_errors():
    q, cache, _ = _inputs("cpu")
    with pytest.raises(ValueError, match="v_cache: expected dtype torch.float8_e4m3fn \\(that of k_cache\\), got "
                                         "torch.float8_e5m2"):
        flashgen.decode(SPEC16, q, cache, cache.to(torch.float8_e5m2), 3)
    with pytest.raises(ValueError, match="v_cache: expected dtype torch.float8_e4m3fn"):
        flashgen.decode(SPEC16, q, cache, cache.half(), 3)
    with pytest.raises(ValueError, match="k_cache: expected dtype torch.float16 .* or float8_e4m3fn / float8_e5m2, "
                                         "got torch.bfloat16"):
        flashgen.decode(SPEC16, q, cache.bfloat16(), cache.bfloat16(), 3)


def test_new_keys_in_the_wrong_dtype_are_errors():
    # New keys come in the spec's dtype (quantized on write): FP8 new keys into an FP8 cache, and
    # into an fp16 cache, are refused naming k (resp. v).
    q, cache, ones = _inputs("cpu")
    new8 = torch.zeros(2, 1, 2, 16, dtype=torch.float8_e4m3fn)
    new16 = new8.half()
    with pytest.raises(ValueError, match="k: expected dtype torch.float16 .*quantizes them on write.*got "
                                         "torch.float8_e4m3fn"):
        flashgen.decode(SPEC16, q, cache, cache, 3, k=new8, v=new8, k_descale=ones, v_descale=ones)
    with pytest.raises(ValueError, match="v: expected dtype torch.float16"):
        flashgen.decode(SPEC16, q, cache.half(), cache.half(), 3, k=new16, v=new8)
    with pytest.raises(ValueError, match="k: expected dtype torch.float16"):
        flash_attn_with_kvcache(q, cache.half(), cache.half(), k=new8, v=new8, cache_seqlens=3)


def test_fp8_needs_sm89(monkeypatch):
    # On a GPU older than Ada the FP8 cache is refused naming k_cache (q when only q is FP8).
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    launcher = flashgen.compile(SPEC16).module()._DECODE
    gpu = torch.device("cuda", 0)
    q = types.SimpleNamespace(dtype=torch.float16, device=gpu)
    with pytest.raises(ValueError, match="k_cache: FP8 .* needs a GPU of compute capability 8.9 or later; cuda:0 "
                                         "is 8.0"):
        launcher.check_fp8(q, types.SimpleNamespace(dtype=torch.float8_e5m2), {}, 2)
    q.dtype = torch.float8_e4m3fn
    with pytest.raises(ValueError, match="q: FP8"):
        launcher.check_fp8(q, types.SimpleNamespace(dtype=torch.float16), {}, 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert launcher.check_fp8(q, types.SimpleNamespace(dtype=torch.float16), {}, 2) is True


def test_bench_decode_fp8_smoke(tmp_path):
    # benchmarks/bench_decode.py --fp8 --smoke: the FP8 rows at toy sizes on the CPU, the FP8 cache
    # checked against SDPA on its dequantized values before it is timed, its bytes at 1 per element.
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_decode.py"
    module_spec = importlib.util.spec_from_file_location("bench_decode_fp8", path)
    bench = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(bench)
    rows = bench.main(["--smoke", "--fp8", "--out", str(tmp_path)])
    assert [(r["case"], r["mode"]) for r in rows] == [("B=2 q_len=1 KV=40", "contiguous"),
                                                     ("B=2 q_len=1 KV=40", "paged-16")]
    for r in rows:
        bf16, fp8 = r["flashgen"], r["flashgen_fp8"]
        assert fp8["max_err"] < bench.TOLERANCE, r
        assert r["ratio_vs_bf16"] == bf16["us"] / fp8["us"]
        # half the bytes: TB/s per microsecond is half the bf16 cache's
        assert fp8["TBps"] * fp8["us"] == pytest.approx(bf16["TBps"] * bf16["us"] / 2)
    assert rows[0]["ratio_vs_sdpa_math"] == rows[0]["sdpa_math"]["us"] / rows[0]["flashgen_fp8"]["us"]
    written = json.loads(next(tmp_path.glob("*-decode-fp8-smoke.json")).read_text())
    assert written["rows"] == json.loads(json.dumps(rows))


def test_fp8_specs_are_refused():
    # FP8 is a cache (and query) format here; the spec names the dtype decode computes and outputs in.
    spec = AttentionSpec(dtype="fp8_e4m3", head_dim=16, num_heads=4, num_kv_heads=2, causal=True, backward=False)
    q, cache, _ = _inputs("cpu")
    with pytest.raises(ValueError, match="spec_or_kernel: decode computes in the spec's dtype.*got 'fp8_e4m3'"):
        flashgen.decode(spec, q.to(torch.float8_e4m3fn), cache, cache, 3)
