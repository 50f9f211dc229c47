"""The persistent dK/dV grid (bwd_persistent): each program walks several key blocks in turn;
and delta computed by the dQ kernel (bwd_fused_delta): no preprocess pass, dQ before dK/dV.

Its gradients are checked against the reference (3x rule of ../shared/TESTING.md) for every
mask family, both dQ strategies, GQA, ragged and unequal lengths, packed sequences, dropout and
a score modifier with tensor gradients. Under the interpreter the launcher counts one SM, so a
program walks every key block of its (head, batch) or every other one: the loop is exercised.
"""

import random
import re

import pytest
import torch

import flashgen
from flashgen import AttentionSpec, ConfigError, KernelConfig
from flashgen.codegen import render
from flashgen.space import DeviceLimits, backward_space

from .helpers import cu_seqlens
from .test_masks import SMALL, _doc_ids, check_variant

# (id, fields, sq, sk, named tensors)
CASES = [
    ("full", {}, 45, 45, {}),
    ("causal", {"causal": True}, 37, 53, {}),
    ("causal-rows-see-nothing", {"causal": True}, 53, 20, {}),
    ("window-0", {"mask": {"sliding_window": {"left": 0, "right": 0}}}, 45, 45, {}),
    ("window-9-2", {"mask": {"sliding_window": {"left": 9, "right": 2}}}, 52, 40, {}),
    ("chunked-16", {"mask": {"chunked": 16}}, 61, 61, {}),
    ("prefix-20", {"mask": {"prefix_lm": 20}}, 45, 45, {}),
    ("sink-3-window-9", {"mask": {"sink": {"tokens": 3, "window": 9}}}, 40, 60, {}),
    ("documents", {"mask": {"document": {}}}, 49, 49,
     {"document_ids": torch.stack([_doc_ids([1, 17, 30, 1]), _doc_ids([49])])}),
    ("custom-block-map", {"mask": "(q_idx >= kv_idx) & ((q_idx - kv_idx < 8) | (kv_idx % 16 == 0))"}, 45, 45, {}),
]


@pytest.mark.parametrize("name,fields,sq,sk,tensors,persistent",
                         [(*case, (1, 3)[n % 2]) for n, case in enumerate(CASES)], ids=[c[0] for c in CASES])
def test_persistent_backward_matches_reference(device, name, fields, sq, sk, tensors, persistent):
    # alternate the programs per SM (1: a program walks every key block of its (head, batch) under the
    # interpreter; 3: every third), the dQ strategy, dtype and GQA ratio over the cases
    n = [c[0] for c in CASES].index(name) // 2
    check_variant(device, **fields, tensors=tensors, sq=sq, sk=sk, dtype=("fp16", "fp32")[n % 2],
                  dq_strategy=("separate", "atomic")[n // 2 % 2], heads=((4, 2), (3, 1))[n % 2],
                  config=SMALL.replace(bwd_persistent=persistent))


def _recording(module):
    """Record the grids the module's dK/dV kernel is launched with."""
    launcher = module._LAUNCHER
    kernel, grids = launcher.dkdv_kernel, []

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    launcher.dkdv_kernel = Recorder()
    launcher.plans.clear()  # call plans keep the kernel they were made with
    return grids


@pytest.mark.parametrize("persistent", [1, 3])
def test_persistent_grid_walks_every_key_block(device, persistent):
    # 61 keys in 16-key blocks: 4 key blocks per (KV head, batch); 1 x 2 (KV head, batch) pairs.
    # Off: one program per key block; on: ceil(persistent * SMs / 2) programs (one SM under the
    # interpreter: 1 or 2 programs, each walking several key blocks).
    # The gradients are bitwise those of the one-program-per-block grid: the same tiles in the
    # same order per key block.
    spec = AttentionSpec(dtype="fp32", head_dim=16, num_heads=2, num_kv_heads=1, causal=True, backward=True)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    q, k, v, do = (torch.randn(2, h, 61, 16, generator=gen).to(device) for h in (2, 1, 1, 2))
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 1
    results = []
    for p in (0, persistent):
        module = render.build_module(spec, SMALL.replace(bwd_persistent=p))
        grids = _recording(module)
        out, lse = module.forward(q, k, v)
        results.append(module.backward(do, q, k, v, out, lse)[:3])
        assert grids == [(min(4, -(-p * sms // 2)) if p else 4, 1, 2)]
    assert all(torch.equal(a, b) for a, b in zip(*results))


def _packed_grads(device, config):
    """dq, dk, dv of a causal call over packed sequences (lengths 1, 40, 0, 17; fp16) with config,
    and the same with SMALL."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    lens = [1, 40, 0, 17]
    cu = cu_seqlens(lens, device)
    q, k, v = (torch.randn(sum(lens), h, 32, generator=gen).to(device, torch.float16).requires_grad_()
               for h in (4, 2, 2))
    out = flashgen.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True, config=config)
    do = torch.randn(out.shape, generator=gen).to(device, torch.float16)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref = torch.autograd.grad(flashgen.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                                        config=SMALL), (q, k, v), do)
    return grads, ref


def test_persistent_backward_over_packed_sequences(device):
    # Packed sequences: each (KV head, sequence) walks only its own sequence's key blocks.
    for g, r in zip(*_packed_grads(device, SMALL.replace(bwd_persistent=1))):
        assert torch.equal(g, r)


def test_persistent_backward_with_dropout_and_tensor_gradients(device):
    # Dropout's keep mask and the ALiBi slopes' gradient through the persistent walk.
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    spec = AttentionSpec(dtype="fp32", head_dim=16, num_heads=2, causal=True, dropout_p=0.2,
                         score_mod={"alibi": {}}, backward=True)
    q, k, v = (torch.randn(1, 2, 50, 16, generator=gen).to(device).requires_grad_() for _ in range(3))
    slopes = torch.rand(2, generator=gen).to(device).requires_grad_()
    seed = torch.tensor([random.randrange(2**62)], dtype=torch.int64, device=device)
    grads = []
    for p in (0, 2):
        module = render.build_module(spec, SMALL.replace(bwd_persistent=p))
        out, lse = module.forward(q, k, v, dropout_p=0.2, seed=seed, tensors={"alibi_slopes": slopes})
        do = torch.ones_like(out)
        dq, dk, dv, t = module.backward(do, q, k, v, out, lse, dropout_p=0.2, seed=seed,
                                        tensors={"alibi_slopes": slopes}, tensor_grads=["alibi_slopes"])
        grads.append((dq, dk, dv, t["alibi_slopes"]))
    (*persistent, slopes), (*one_walk, slopes_ref) = grads
    assert all(torch.equal(a, b) for a, b in zip(persistent, one_walk))
    # The slopes' gradient is summed by atomic adds, in whatever order a GPU's programs reach them.
    if device == "cpu":
        assert torch.equal(slopes, slopes_ref)
    else:
        torch.testing.assert_close(slopes, slopes_ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the knob itself
def test_persistent_knob_is_checked_and_left_out_of_stored_configs_when_off():
    with pytest.raises(ConfigError, match="config knob 'bwd_persistent'.*got 5"):
        KernelConfig(bwd_persistent=5)
    with pytest.raises(ConfigError, match="config knob 'bwd_persistent'"):
        KernelConfig(bwd_persistent=True)
    # Off, the knob is absent: configs stored before it keep their kernel ids and rendered text.
    assert "bwd_persistent" not in KernelConfig().to_dict()
    on = KernelConfig(bwd_persistent=2)
    assert on.to_dict()["bwd_persistent"] == 2
    assert KernelConfig.from_dict(on.to_dict()) == on
    assert KernelConfig.from_dict(KernelConfig().to_dict()).bwd_persistent == 0
    assert "persistent=2" in on.describe_backward()


def test_persistent_renders_only_behind_its_knob():
    spec = AttentionSpec(dtype="fp16", head_dim=32, num_heads=2, mask={"sliding_window": {"left": 9, "right": 0}},
                         backward=True)
    off, on = (render.render(spec, SMALL.replace(bwd_persistent=p), standalone=False) for p in (0, 1))
    assert "tl.num_programs(0) * BLOCK_N" not in off and "tl.num_programs(0) * BLOCK_N" in on
    # the forward and the dQ kernel are the same text
    for name in ("def _attn_fwd(", "def _attn_bwd_dq("):
        assert off[off.index(name):].split("\n\n\n")[0] == on[on.index(name):].split("\n\n\n")[0]


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [1, 2])
@pytest.mark.parametrize("fields", [{"mask": {"sliding_window": {"left": 256, "right": 0}}}, {"causal": True},
                                    {"mask": {"chunked": 256}}], ids=["window-256", "causal", "chunked-256"])
def test_gpu_persistent_backward_bf16(fields, persistent):
    for dq in ("separate", "atomic"):
        check_variant("cuda", **fields, sq=1500, sk=1500, dtype="bf16", heads=(8, 2), d=128, dq_strategy=dq,
                      config=KernelConfig(BLOCK_M=64, BLOCK_N=64, num_stages=3, BLOCK_M1=64, BLOCK_N1=64,
                                          bwd_persistent=persistent))


# ----------------------------------------------------------------------------- delta in the dQ kernel
@pytest.mark.parametrize("name,fields,sq,sk,tensors", CASES, ids=[c[0] for c in CASES])
def test_fused_delta_backward_matches_reference(device, name, fields, sq, sk, tensors):
    # every mask family (segments and the block map), alternating dtype and GQA ratio
    n = [c[0] for c in CASES].index(name)
    check_variant(device, **fields, tensors=tensors, sq=sq, sk=sk, dtype=("fp16", "fp32")[n % 2],
                  heads=((4, 2), (3, 1))[n % 2], config=SMALL.replace(bwd_fused_delta=True))


def _launch_order(module):
    """Record the order the module's backward kernels are launched in."""
    launcher, order = module._LAUNCHER, []
    for attr in ("preprocess_kernel", "dkdv_kernel", "dq_kernel"):
        kernel = getattr(launcher, attr)

        class Recorder:
            def __getitem__(self, grid, kernel=kernel, attr=attr):
                order.append(attr)
                return kernel[grid]

        setattr(launcher, attr, Recorder())
    launcher.plans.clear()  # call plans keep the kernels they were made with
    return order


def test_fused_delta_runs_dq_first_without_the_preprocess(device):
    # Off: preprocess, dK/dV, dQ. On: dQ (which writes delta), then dK/dV; the gradients agree
    # with the preprocess's to float32 rounding (the same sum, maybe in another order).
    spec = AttentionSpec(dtype="fp32", head_dim=16, num_heads=4, num_kv_heads=2, mask={"chunked": 8}, backward=True)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    q, k, v, do = (torch.randn(2, h, 37, 16, generator=gen).to(device) for h in (4, 2, 2, 4))
    results, orders = [], []
    for fused in (False, True):
        module = render.build_module(spec, SMALL.replace(bwd_fused_delta=fused))
        orders.append(_launch_order(module))
        out, lse = module.forward(q, k, v)
        results.append(module.backward(do, q, k, v, out, lse)[:3])
    assert orders == [["preprocess_kernel", "dkdv_kernel", "dq_kernel"], ["dq_kernel", "dkdv_kernel"]]
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # fp32: only the delta sum's order differs


def test_fused_delta_over_packed_sequences_and_dropout(device):
    # Packed sequences (delta indexed per sequence) and dropout (delta = rowsum(dO * O) all the same).
    for g, r in zip(*_packed_grads(device, SMALL.replace(bwd_fused_delta=True))):
        torch.testing.assert_close(g, r, rtol=2e-3, atol=2e-3)  # fp16 outputs of the same fp32 sums, reordered
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    spec = AttentionSpec(dtype="fp32", head_dim=16, num_heads=2, causal=True, dropout_p=0.2, backward=True)
    qd, kd, vd = (torch.randn(1, 2, 50, 16, generator=gen).to(device) for _ in range(3))
    seed = torch.tensor([random.randrange(2**62)], dtype=torch.int64, device=device)
    grads = []
    for fused in (False, True):
        module = render.build_module(spec, SMALL.replace(bwd_fused_delta=fused))
        o, lse = module.forward(qd, kd, vd, dropout_p=0.2, seed=seed)
        grads.append(module.backward(torch.ones_like(o), qd, kd, vd, o, lse, dropout_p=0.2, seed=seed)[:3])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
def test_fused_delta_knob_is_checked_and_left_out_of_stored_configs_when_off():
    with pytest.raises(ConfigError, match="config knob 'bwd_fused_delta'.*dq_strategy='atomic'"):
        KernelConfig(bwd_fused_delta=True, dq_strategy="atomic")
    with pytest.raises(ConfigError, match="config knob 'bwd_fused_delta'.*got 1"):
        KernelConfig(bwd_fused_delta=1)
    assert "bwd_fused_delta" not in KernelConfig().to_dict()
    on = KernelConfig(bwd_fused_delta=True)
    assert on.to_dict()["bwd_fused_delta"] is True and KernelConfig.from_dict(on.to_dict()) == on
    assert "fused_delta" in on.describe_backward()
    # the tuner searches it with separate dQ only
    space = backward_space(AttentionSpec(dtype="bf16", head_dim=128, num_heads=2, mask={"chunked": 64},
                                         backward=True), DeviceLimits("H100", 232448, hopper=True))
    assert space.params["bwd_fused_delta"] == (False, True)
    point = dict(BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64, bwd_num_warps=4, bwd_num_stages=2,
                 dq_strategy="separate", bwd_tma=True, bwd_persistent=0, bwd_fused_delta=True)
    assert space.violations(point) == []
    assert any("bwd_fused_delta" in v for v in space.violations(dict(point, dq_strategy="atomic")))
    # structural: a call cannot switch it (the dQ kernel's parameters differ)
    module = render.build_module(AttentionSpec(dtype="fp32", head_dim=16, num_heads=2, backward=True),
                                 SMALL.replace(bwd_fused_delta=True))
    x = torch.randn(1, 2, 8, 16)
    out, lse = module.forward(x, x, x)
    with pytest.raises(TypeError, match="bwd_fused_delta"):
        module.backward(x, x, x, x, out, lse, bwd_fused_delta=False)


def test_fused_delta_renders_only_behind_its_knob():
    spec = AttentionSpec(dtype="fp16", head_dim=32, num_heads=2, mask={"document": {}}, backward=True)
    off, on = (render.render(spec, SMALL.replace(bwd_fused_delta=f), standalone=False) for f in (False, True))
    dq = [text[text.index("def _attn_bwd_dq("):].split("\n\n\n")[0] for text in (off, on)]
    assert "tl.store(DELTA" not in dq[0] and "tl.store(DELTA" in dq[1]
    # the forward and the dK/dV kernel are the same text
    for name in ("def _attn_fwd(", "def _attn_bwd_dkdv("):
        assert off[off.index(name):].split("\n\n\n")[0] == on[on.index(name):].split("\n\n\n")[0]


def test_fused_delta_is_the_default_where_the_h100_sweep_measured_it():
    # masks/2026-11-22-h100-masked-defaults-sweep-v2-*.md: narrow bands and documents at hd128;
    # not prefix-LM (+1%), and never for full or causal attention (their kernels stay as they were).
    from flashgen import default_config

    def bwd(seqlen, head_dim=128, **fields):
        spec = AttentionSpec(dtype="bf16", head_dim=head_dim, num_heads=16, backward=True, **fields)
        return default_config(spec, "h100", seqlen)

    for seqlen in (4096, 16384):
        for mask in ({"sliding_window": {"left": 256, "right": 0}}, {"chunked": 1024}, {"document": {}}):
            assert bwd(seqlen, mask=mask).bwd_fused_delta, (mask, seqlen)
        assert not bwd(seqlen, mask={"prefix_lm": 512}).bwd_fused_delta
        assert not bwd(seqlen, causal=True).bwd_fused_delta and not bwd(seqlen).bwd_fused_delta
        assert not bwd(seqlen, head_dim=64, mask={"chunked": 1024}).bwd_fused_delta  # not measured at hd64
    assert not bwd(1024, mask={"sliding_window": {"left": 1024, "right": 0}}).bwd_fused_delta  # not narrow there
    docs = bwd(4096, mask={"document": {}})
    assert (docs.BLOCK_M1, docs.BLOCK_N1, docs.BLOCK_M2, docs.BLOCK_N2, docs.bwd_tma) == (32, 64, 64, 32, False)
    docs = bwd(16384, mask={"document": {}})
    assert (docs.BLOCK_M1, docs.BLOCK_N1, docs.BLOCK_M2, docs.BLOCK_N2, docs.bwd_tma) == (64, 64, 64, 64, True)
    assert not default_config(AttentionSpec(dtype="fp16", head_dim=32, num_heads=2, mask={"chunked": 64}),
                              "cpu").bwd_fused_delta  # the interpreter's defaults are unchanged


@pytest.mark.gpu
@pytest.mark.parametrize("fields", [{"mask": {"sliding_window": {"left": 256, "right": 0}}}, {"causal": True},
                                    {"mask": {"chunked": 256}}, {"mask": {"document": {}}}],
                         ids=["window-256", "causal", "chunked-256", "documents"])
def test_gpu_fused_delta_backward_bf16(fields):
    tensors = {"document_ids": torch.stack([_doc_ids([300, 700, 500]), _doc_ids([1500])])} \
        if "document" in fields.get("mask", {}) else {}
    for tma in (False, True):
        check_variant("cuda", **fields, tensors=tensors, sq=1500, sk=1500, dtype="bf16", heads=(8, 2), d=128,
                      config=KernelConfig(BLOCK_M=64, BLOCK_N=64, num_stages=3, BLOCK_M1=64, BLOCK_N1=64,
                                          bwd_tma=tma, bwd_fused_delta=True))


# ----------------------------------------------------------------------------- dQ blocks heaviest first
def test_dq_heavy_first_backward_matches_reference(device):
    # the dQ grid walked from its last query block, delta from the dQ kernel (as the defaults pair
    # them): every block still computed once; documents of 1, 17, 30 and 1 tokens and a ragged
    # length, so the first program runs the partial last block; GQA 4/2
    name, fields, sq, sk, tensors = next(c for c in CASES if c[0] == "documents")
    check_variant(device, **fields, tensors=tensors, sq=sq, sk=sk, dtype="fp16", heads=(4, 2),
                  config=SMALL.replace(bwd_dq_heavy_first=True, bwd_fused_delta=True))


@pytest.mark.parametrize("knob", ["bwd_dq_heavy_first", "bwd_heavy_first"])
def test_launch_orders_over_packed_sequences_are_bitwise_the_default_order(device, knob):
    # Packed sequences: the reordered grids still return early past each sequence's end, and the
    # same programs compute the same blocks in the same order of their walks (separate dQ: no
    # atomics): bitwise equal.
    for g, r in zip(*_packed_grads(device, SMALL.replace(**{knob: True}))):
        assert torch.equal(g, r)


def _order_knob(name: str) -> KernelConfig:
    """Checks a launch-order knob as a config knob (a bool, left out of stored configs when off,
    said by describe_backward) and returns a config with it on."""
    with pytest.raises(ConfigError, match=f"config knob '{name}'.*got 1"):
        KernelConfig(**{name: 1})
    assert name not in KernelConfig().to_dict()  # stored configs and kernel ids as before
    on = KernelConfig(**{name: True})
    assert KernelConfig.from_dict(on.to_dict()) == on and f" {name[4:]}" in on.describe_backward()
    return on


def test_dq_heavy_first_knob_renders_only_when_on_and_is_a_mask_default():
    from flashgen.config import default_config

    on = _order_knob("bwd_dq_heavy_first")
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=2, mask={"chunked": 256}, backward=True)
    reversed_blk = "blk = tl.num_programs(0) - 1 - tl.program_id(0)"
    dq_kernel = lambda cfg: render.render(spec, cfg).split("def _attn_bwd_dq(")[1].split("@triton.jit")[0]  # noqa: E731
    assert reversed_blk in dq_kernel(on) and reversed_blk not in dq_kernel(KernelConfig())
    # sm90 defaults: on for masks whose later query blocks see more keys; plain attention and plain
    # causal hd128 keep their kernels; causal hd64 up to 2048 tokens also fuses delta
    heavy = lambda seqlen=4096, **f: default_config(  # noqa: E731
        AttentionSpec(dtype="bf16", num_heads=2, backward=True, **{"head_dim": 128, **f}), "h100", seqlen)
    for mask in ({"chunked": 1024}, {"prefix_lm": 512}, {"document": {}},
                 {"sliding_window": {"left": 256, "right": 0}}):
        assert heavy(mask=mask).bwd_dq_heavy_first, mask
    assert not heavy().bwd_dq_heavy_first and not heavy(causal=True).bwd_dq_heavy_first
    assert not heavy(mask={"sliding_window": {"left": 256, "right": 256}}).bwd_dq_heavy_first
    short = heavy(1024, causal=True, head_dim=64)
    assert short.bwd_dq_heavy_first and short.bwd_fused_delta
    assert not heavy(4096, causal=True, head_dim=64).bwd_fused_delta
    assert not default_config(AttentionSpec(dtype="bf16", head_dim=128, num_heads=2, mask={"chunked": 1024},
                                            backward=True), "a100").bwd_dq_heavy_first


@pytest.mark.gpu
@pytest.mark.parametrize("fields", [{"mask": {"prefix_lm": 300}}, {"mask": {"chunked": 256}}],
                         ids=["prefix-300", "chunked-256"])
def test_gpu_dq_heavy_first_backward_bf16(fields):
    # the sm90 default pairing (64x64 tiles, descriptors, fused delta) at a ragged length
    check_variant("cuda", **fields, sq=1500, sk=1500, dtype="bf16", heads=(8, 2), d=128,
                  config=KernelConfig(BLOCK_M=64, BLOCK_N=64, num_stages=3, BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64,
                                      BLOCK_N2=64, bwd_tma=True, bwd_fused_delta=True, bwd_dq_heavy_first=True))


# ----------------------------------------------------------------------------- heaviest first over the grid
@pytest.mark.parametrize("name,dq_strategy", [("causal", "atomic"), ("causal-rows-see-nothing", "separate"),
                                               ("documents", "separate")])
def test_heavy_first_backward_matches_reference(device, name, dq_strategy):
    # bwd_heavy_first: both kernels' grids remapped (key block slowest, heads and batch fastest);
    # every (block, head, batch) is still computed exactly once: GQA 4/2, two batch elements, ragged
    # and unequal lengths
    _, fields, sq, sk, tensors = next(c for c in CASES if c[0] == name)
    check_variant(device, **fields, tensors=tensors, sq=sq, sk=sk, dtype="fp16", heads=(4, 2),
                  config=SMALL.replace(bwd_heavy_first=True, dq_strategy=dq_strategy))


def test_heavy_first_knob_renders_only_when_on():
    on = _order_knob("bwd_heavy_first")
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=4, num_kv_heads=2, causal=True, backward=True)
    source = render.render(spec, on)
    assert source.count("launched = tl.program_id(0) + blocks * (") == 2  # the dK/dV and dQ kernels
    assert "launched = " not in render.render(spec, KernelConfig())
    # ... and the Gluon dK/dV kernel, whose range table (documents) is read at the remapped key block
    documents = AttentionSpec(dtype="bf16", head_dim=128, num_heads=4, num_kv_heads=2, causal=True, backward=True,
                              mask={"document": {"ids": "doc"}})
    source = render.render(documents, on.replace(hopper_bwd=True))
    assert source.count("launched = ") == 3 and "launched = gl.program_id(0) + blocks * (" in source
    assert "(off_b * gl.num_programs(0) + key_block) * (2 + 2 * CONSUMERS)" in source



@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("grid", [(16, 16, 3), (100, 3, 5), (300, 2, 2), (7, 1, 1), (32, 4, 4), (1, 40, 9)])
def test_heavy_first_order_takes_every_program_once_heaviest_first_in_chunks(grid, descending):
    # the macro's statements run as Python over every launch index of grids with several chunks
    # (a partial last one included): a bijection onto (block, head, batch); within each chunk the
    # blocks go heaviest first, every group of the chunk taking a block before any takes the next
    import types

    macro = render._environment().get_template("common/launch_order.j2").module.heaviest_first
    code = str(macro("tl", "blk", "head", "batch", descending=descending))
    n0, n1, n2 = grid
    seen = []
    code = re.sub(r"\.to\(tl\.int(32|64)\)", "", code)  # Python's ints: no widening to 64 bits and back
    for launched in range(n0 * n1 * n2):
        pid = (launched % n0, launched // n0 % n1, launched // (n0 * n1))
        tl = types.SimpleNamespace(program_id=lambda i, pid=pid: pid[i], num_programs=lambda i: grid[i],
                                   maximum=max, minimum=min)
        scope = {"tl": tl}
        exec(code.strip().replace("\n    ", "\n"), scope)  # noqa: S102 - the template's own statements
        seen.append((scope["blk"], scope["head"], scope["batch"]))
    assert sorted(seen) == [(b, h, z) for b in range(n0) for h in range(n1) for z in range(n2)]
    chunk = max(256 // n0, 1)
    for start in range(0, len(seen), chunk * n0):
        blocks = [b for b, _, _ in seen[start:start + chunk * n0]]
        assert blocks == sorted(blocks, reverse=descending), grid  # heaviest first within the chunk
        groups = {(h, z) for _, h, z in seen[start:start + chunk * n0]}
        assert len(groups) == min(chunk, n1 * n2 - start // n0)  # a chunk's groups: `chunk` of them


@pytest.mark.gpu
@pytest.mark.parametrize("hopper_bwd", [False, True])
@pytest.mark.parametrize("sq,sk", [(1500, 1500), (700, 2100), (4097, 4097)])
def test_gpu_heavy_first_backward_bf16(sq, sk, hopper_bwd):
    # causal GQA 8/2 (the default's case), two batch elements: at 4097 tokens the portable dK/dV grid
    # (65 key blocks of 64, 4 groups) runs two chunks of groups, 3 and 1; the Gluon dK/dV kernel where
    # it serves
    check_variant("cuda", causal=True, tensors={}, sq=sq, sk=sk, dtype="bf16", heads=(8, 2), d=128,
                  config=KernelConfig(BLOCK_M=64, BLOCK_N=64, num_stages=3, BLOCK_M1=64, BLOCK_N1=64,
                                      bwd_tma=True, bwd_heavy_first=True, hopper_bwd=hopper_bwd))
