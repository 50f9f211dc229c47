"""The persistent dK/dV grid (bwd_persistent): each program walks several key blocks in turn.

Its gradients are checked against the reference (3x rule of ../shared/TESTING.md) for every
mask family, both dQ strategies, GQA, ragged and unequal lengths, packed sequences, dropout and
a score modifier with tensor gradients. Under the interpreter the launcher counts one SM, so a
program walks every key block of its (head, batch) or every other one: the loop is exercised.
"""

import random

import pytest
import torch

import flashgen
from flashgen import AttentionSpec, ConfigError, KernelConfig
from flashgen.codegen import render

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


@pytest.mark.parametrize("persistent", [1, 3])
@pytest.mark.parametrize("name,fields,sq,sk,tensors", CASES, ids=[c[0] for c in CASES])
def test_persistent_backward_matches_reference(device, name, fields, sq, sk, tensors, persistent):
    # alternate the dQ strategy, dtype and GQA ratio over the cases
    n = [c[0] for c in CASES].index(name) + persistent
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


def test_persistent_backward_over_packed_sequences(device):
    # Packed sequences: each (KV head, sequence) walks only its own sequence's key blocks.
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    lens = [1, 40, 0, 17]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(sum(lens), h, 32, generator=gen).to(device, torch.float16).requires_grad_()
               for h in (4, 2, 2))
    cfg = SMALL.replace(bwd_persistent=1)
    out = flashgen.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True, config=cfg)
    do = torch.randn(out.shape, generator=gen).to(device, torch.float16)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref = torch.autograd.grad(flashgen.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                                        config=SMALL), (q, k, v), do)
    for g, r in zip(grads, ref):
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
    assert all(torch.equal(a, b) for a, b in zip(*grads))


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
