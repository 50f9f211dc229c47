"""Mask patterns in the Hopper warp-specialized forward (family hopper_ws) on an sm90 GPU: the
forward against the reference (../shared/TESTING.md's rule, outputs poisoned with NaN first) on
fresh random inputs, bf16 and fp16: documents of random lengths (some shorter than a consumer's
64 rows, one spanning several tiles), causal and not; prefix-LM (a number, per-batch lengths);
sliding windows (causal, two-sided); chunks; GQA; lengths that are not a multiple of the tile,
seqlen_q != seqlen_k; each of the family's knobs; rows that see no key; the portable backward on
its LSE; and bitwise-equal repeated runs."""

import pytest
import torch

import flashgen
from flashgen import AttentionSpec, KernelConfig, default_config
from flashgen.config import HOPPER_HD256
from flashgen.runtime.hopper import HopperPlan
from flashgen.verify import assert_attention_close, assert_gradients_close

from .helpers import make_qkv, poisoned_outputs
from .test_hopper_bwd_gpu import short_keys_served  # noqa: F401 (autouse: the Gluon dK/dV on these small calls too)
from .test_hopper_ws_gpu import BASE, sm90, took_hopper_path  # the unmasked family's: base config, skip, plan check

pytestmark = pytest.mark.gpu

KNOBS = {"base": {}, "pingpong": dict(hopper_pingpong=True), "overlap": dict(hopper_overlap=True),
         "one consumer": dict(BLOCK_M=64, num_stages=3), "n64 s3": dict(BLOCK_N=64, num_stages=3),
         "tma store": dict(hopper_tma_store=True), "persistent": dict(hopper_persistent=True),
         "persistent, one consumer": dict(BLOCK_M=64, num_stages=3, hopper_persistent=True),
         "persistent, pingpong": dict(hopper_persistent=True, hopper_pingpong=True),
         "persistent, overlap, tma store": dict(hopper_persistent=True, hopper_overlap=True, hopper_tma_store=True)}
PERSISTENT = KNOBS["persistent, overlap, tma store"]  # the unmasked hd128 default's knobs
MASKS = {  # name -> (mask, spec causal, seqlen_q == seqlen_k needed)
    "documents": ({"document": {"ids": "doc"}}, False, True),
    "documents non-causal": ({"document": {"ids": "doc", "causal": False}}, False, True),
    "prefix-LM 100": ({"prefix_lm": 100}, False, False),
    "prefix-LM lengths": ({"prefix_lm": "plen"}, False, False),
    "window 100": ({"sliding_window": {"left": 100, "right": 0}}, False, False),
    "window 70/30": ({"sliding_window": {"left": 70, "right": 30}}, False, False),
    "chunks 200": ({"chunked": 200}, False, False),
    "chunks 96 non-causal": ({"chunked": {"size": 96, "causal": False}}, False, False),
    "chunks and window, causal": ({"and": [{"chunked": 300}, {"sliding_window": {"left": 150}}]}, True, False),
}
SHAPES = [  # batch, heads, kv heads, seqlen_q, seqlen_k, head dim, layout
    (2, 8, 2, 1000, 1000, 128, "bhsd"),
    (1, 4, 4, 777, 777, 64, "bshd"),
    (2, 6, 2, 333, 777, 128, "bhsd"),
    (1, 8, 1, 901, 300, 64, "bhsd"),
]


def random_documents(batch, seqlen, generator):
    """(batch, seqlen) sorted ids of random lengths per row: a few short ones (1 to 40 tokens, under a
    consumer's 64 rows), one long (over two 128-row tiles) and the rest drawn at random."""
    rows = []
    for _ in range(batch):
        lengths = [int(x) for x in torch.randint(1, 41, (3,), generator=generator)] + [min(300, seqlen // 2)]
        while sum(lengths) < seqlen:
            lengths.append(int(torch.randint(1, 200, (1,), generator=generator)))
        lengths = [lengths[i] for i in torch.randperm(len(lengths), generator=generator).tolist()]
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seqlen]
        rows.append(ids)
    return torch.stack(rows).to(torch.int32)


def named_inputs(mask, batch, seqlen_q, generator):
    tensors = {}
    if "doc" in str(mask):
        tensors["doc"] = random_documents(batch, seqlen_q, generator).cuda()
    if "plen" in str(mask):  # one batch element's prefix past its whole sequence, one of 0
        tensors["plen"] = torch.tensor([0, seqlen_q + 5][:batch] if batch > 1 else [37], dtype=torch.int32).cuda()
    return tensors


def check_forward(dtype, shape, mask_name, knobs, *, seed=0):
    batch, heads, kv_heads, sq, sk, d, layout = shape
    mask, causal, same = MASKS[mask_name]
    if same:
        sk = sq
    spec = AttentionSpec(dtype=dtype, head_dim=d, num_heads=heads, num_kv_heads=kv_heads, mask=mask, causal=causal)
    module = flashgen.compile(spec, KernelConfig(**{**BASE, **knobs})).module()
    gen = torch.Generator().manual_seed(seed)
    q, k, v = make_qkv(batch, heads, kv_heads, sq, sk, d, dtype=spec.torch_dtype, device="cuda", layout=layout,
                       generator=gen)
    tensors = named_inputs(mask, batch, sq, gen)
    out, lse = poisoned_outputs(q, heads, sq, d, layout)
    module.forward(q, k, v, layout=layout, out=out, lse=lse, tensors=tensors)
    assert took_hopper_path(module), "not the Gluon forward"
    # TESTING.md: 2x the same-precision reference's error + its rounding; rows that see no key: 0, -inf
    assert_attention_close(out, lse, q, k, v, causal=causal, layout=layout, mask=mask, tensors=tensors)
    return module, (q, k, v, tensors, layout)


@sm90
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("dtype, shape", [("bf16", SHAPES[0]), ("bf16", SHAPES[2]), ("bf16", SHAPES[3]),
                                          ("fp16", SHAPES[1])])
def test_forward(dtype, shape, mask_name):
    check_forward(dtype, shape, mask_name, {})


@sm90
@pytest.mark.parametrize("knob", [k for k in KNOBS if k != "base"])
@pytest.mark.parametrize("mask_name, shape", [("documents", SHAPES[0]), ("window 70/30", SHAPES[3]),
                                              ("prefix-LM lengths", SHAPES[2])])
def test_each_knob(mask_name, shape, knob):
    check_forward("bf16", shape, mask_name, KNOBS[knob], seed=1)


@sm90
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("dtype, shape", [("bf16", SHAPES[0]), ("bf16", SHAPES[3]), ("fp16", SHAPES[1])])
def test_persistent_grid(dtype, shape, mask_name):
    # the persistent grid walks every tile of every mask: each tile's key blocks from the pattern, tiles
    # paired heavy with light where the mask is causal-shaped
    check_forward(dtype, shape, mask_name, PERSISTENT, seed=4)


@sm90
@pytest.mark.parametrize("programs", [1, 7])
@pytest.mark.parametrize("mask_name", ["documents", "prefix-LM lengths", "window 70/30", "chunks 96 non-causal"])
def test_persistent_programs_walk_many_tiles(monkeypatch, mask_name, programs):
    # the grid cut to `programs` programs: each walks many tiles of different key ranges (documents': the
    # block-range table per tile), so the ring positions and Q's phases run on across tiles whose ranges
    # differ (a wrong phase hangs or reads a stale block); then two runs bitwise equal
    from flashgen.runtime import hopper

    monkeypatch.setattr(hopper, "sm_count", lambda device: programs)
    mask, causal, _ = MASKS[mask_name]
    for knobs in (PERSISTENT, KNOBS["persistent, pingpong"]):
        module, (q, k, v, tensors, layout) = check_forward("bf16", SHAPES[0], mask_name, knobs, seed=5)
        module._LAUNCHER.plans.clear()  # (a plan made before the patch fixed its grid's size)
        out, lse = poisoned_outputs(q, q.shape[1], q.shape[2], q.shape[3], layout)
        module.forward(q, k, v, layout=layout, out=out, lse=lse, tensors=tensors)
        grid = next(p for p in module._LAUNCHER.plans.values() if isinstance(p, HopperPlan)).launch.grid
        assert grid == (programs,)
        assert_attention_close(out, lse, q, k, v, causal=causal, layout=layout, mask=mask, tensors=tensors)
        again = module.forward(q, k, v, layout=layout, tensors=tensors)
        assert torch.equal(again[0], out) and torch.equal(again[1], lse)


@sm90
def test_ids_changed_in_place_or_under_a_cuda_graph_get_their_own_ranges():
    # the runs and range tables are made from the ids' memory on every call: an in-place write between
    # calls, and a CUDA graph replayed over new ids, read the ids they are given
    module, (q, k, v, tensors, layout) = check_forward("bf16", SHAPES[0], "documents", PERSISTENT, seed=6)
    ids = tensors["doc"]
    other = random_documents(ids.shape[0], ids.shape[1], torch.Generator().manual_seed(7)).cuda()
    kw = dict(causal=False, layout=layout, mask=MASKS["documents"][0])
    before = ids.clone()
    ids.copy_(other)
    out, lse = module.forward(q, k, v, layout=layout, tensors=tensors)
    assert_attention_close(out, lse, q, k, v, tensors={"doc": other}, **kw)
    ids.copy_(before)
    module.forward(q, k, v, layout=layout, tensors=tensors)  # (warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = module.forward(q, k, v, layout=layout, tensors=tensors)
    for want in (other, before):
        ids.copy_(want)
        graph.replay()
        assert_attention_close(out, lse, q, k, v, tensors={"doc": want.clone()}, **kw)


@sm90
def test_rows_that_see_no_key():
    # bottom-right causal with seqlen_k < seqlen_q: the first 601 rows see nothing (O = 0, LSE = -inf,
    # checked by the rule), whole tiles and half tiles of them
    check_forward("bf16", SHAPES[3], "window 100", {})
    check_forward("bf16", SHAPES[3], "chunks 200", dict(BLOCK_M=64, num_stages=3))


@sm90
def test_repeated_runs_are_bitwise_equal():
    module, (q, k, v, tensors, layout) = check_forward("bf16", SHAPES[0], "documents", {})
    first = module.forward(q, k, v, layout=layout, tensors=tensors)
    for _ in range(3):
        again = module.forward(q, k, v, layout=layout, tensors=tensors)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@sm90
@pytest.mark.parametrize("mask_name", ["documents", "prefix-LM 100", "window 70/30"])
def test_forward_backward(mask_name):
    # the portable backward on the Gluon forward's O and LSE: module.backward, and autograd through
    # flashgen.attention with the same config
    batch, heads, kv_heads, sq, sk, d, layout = SHAPES[0]
    mask, causal, _ = MASKS[mask_name]
    spec = AttentionSpec(dtype="bf16", head_dim=d, num_heads=heads, num_kv_heads=kv_heads, mask=mask, causal=causal,
                         backward=True)
    config = default_config(spec, "h100", sq).replace(tma=False, warp_specialize=False, **BASE)
    module = flashgen.compile(spec, config).module()
    gen = torch.Generator().manual_seed(2)
    q, k, v = make_qkv(batch, heads, kv_heads, sq, sk, d, dtype=torch.bfloat16, device="cuda", generator=gen)
    tensors = named_inputs(mask, batch, sq, gen)
    out, lse = module.forward(q, k, v, tensors=tensors)
    assert took_hopper_path(module), "not the Gluon forward"
    do = torch.randn(q.shape, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    dq, dk, dv, _ = module.backward(do, q, k, v, out, lse, tensors=tensors)
    # gradients: 3x (TESTING.md)
    kw = dict(causal=causal, layout=layout, mask=mask, tensors=tensors)
    assert_gradients_close((dq, dk, dv), q, k, v, do, **kw)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flashgen.attention(*leaves, mask=mask, causal=causal, layout=layout, config=config, **tensors).backward(do)
    assert_gradients_close(tuple(t.grad for t in leaves), q, k, v, do, **kw)


HD256_SHAPES = [(2, 8, 2, 1000, 1000, 256, "bhsd"), (1, 4, 4, 777, 777, 256, "bshd"), (2, 6, 2, 333, 777, 256, "bhsd")]


@sm90
@pytest.mark.parametrize("mask_name", ["window 100", "window 70/30", "chunks 200", "documents"])
@pytest.mark.parametrize("dtype, shape", [("bf16", HD256_SHAPES[0]), ("fp16", HD256_SHAPES[1]),
                                          ("bf16", HD256_SHAPES[2])])
def test_head_dim_256_masks_on_its_knobs(dtype, shape, mask_name):
    # hd256's knobs (config.HOPPER_HD256: 64-key blocks, 2 stages, persistent + overlap), the default for
    # windows of 193-2048 keys from 4096 tokens, over windows and the masks it is not the default for
    check_forward(dtype, shape, mask_name, HOPPER_HD256, seed=5)


@sm90
@pytest.mark.parametrize("left", [300, 1024])
def test_head_dim_256_window_training_step_on_its_default(left):
    # what flashgen.attention runs for a window at hd256 from 4096 tokens: the Gluon forward, the portable
    # backward (dK/dV 64 x 64 on 8 warps, dQ 128 x 32) on its O and LSE; GQA, bshd, 4100 tokens
    mask = {"sliding_window": {"left": left, "right": 0}}
    spec = AttentionSpec(dtype="bf16", head_dim=256, num_heads=4, num_kv_heads=2, mask=mask, backward=True)
    config = flashgen.compile(spec).config_for(4100)  # what a call of this length gets (its bucket's default)
    assert config.family == "hopper_ws" and config.BLOCK_N == 64, config
    gen = torch.Generator().manual_seed(6)
    q, k, v = make_qkv(1, 4, 2, 4100, 4100, 256, dtype=torch.bfloat16, device="cuda", layout="bshd", generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flashgen.attention(*leaves, mask=mask, layout="bshd")
    do = torch.randn(out.shape, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    out.backward(do)
    kw = dict(causal=False, layout="bshd", mask=mask)
    module = flashgen.compile(spec, config).module()
    _, lse = module.forward(q, k, v, layout="bshd")  # the LSE of that config's forward (flashgen.attention's: none)
    assert took_hopper_path(module), "not the Gluon forward"
    assert_attention_close(out.detach(), lse, q, k, v, **kw)
    assert_gradients_close(tuple(t.grad for t in leaves), q, k, v, do, **kw)


def documents_step(seed, **knobs):
    """(mask, config, module, generator, (q, k, v)): SHAPES[0]'s documents spec with a backward, on the Gluon
    forward's persistent grid (the H100's default config with BASE, PERSISTENT and the knobs), fresh inputs."""
    batch, heads, kv_heads, sq, _, d, _ = SHAPES[0]
    mask = MASKS["documents"][0]
    spec = AttentionSpec(dtype="bf16", head_dim=d, num_heads=heads, num_kv_heads=kv_heads, mask=mask, backward=True)
    config = default_config(spec, "h100", sq).replace(**BASE, **PERSISTENT, **knobs)
    gen = torch.Generator().manual_seed(seed)
    qkv = make_qkv(batch, heads, kv_heads, sq, sq, d, dtype=torch.bfloat16, device="cuda", generator=gen)
    return mask, config, flashgen.compile(spec, config).module(), gen, qkv


@sm90
@pytest.mark.parametrize("ids_kind", ["int32", "int64", "shared by the batch", "strided, longer than the sequence"])
def test_a_training_forward_fills_the_runs_table(ids_kind):
    # a training step's Gluon forward: its range kernel fills the ids' runs table the backward's kernels
    # read (FILL_RUNS), in place of host.runs_table's launch; the same table, and the step's gradients
    from flashgen.runtime import host

    batch, _, _, sq, _, _, layout = SHAPES[0]
    mask, config, module, gen, (q, k, v) = documents_step(11, tma=False, warp_specialize=False)
    ids = random_documents(batch, sq + 300, gen).cuda()
    ids = {"int32": ids[:, :sq], "int64": ids[:, :sq].long(), "shared by the batch": ids[:1, :sq],
           "strided, longer than the sequence": ids.t().contiguous().t()}[ids_kind]
    calls = []
    original = host.runs_table
    host.runs_table = lambda t, check: calls.append(t) or original(t, check)
    try:
        _, _, plan, extra = module._LAUNCHER.training_forward(q, k, v, layout, 0.0, None, {"doc": ids}, None, None,
                                                              None, None)
    finally:
        host.runs_table = original
    assert isinstance(plan, HopperPlan) and not calls  # the range kernel's table, no runs_table launch
    assert torch.equal(extra[-1], original(ids))
    tensors = {"doc": ids}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    do = torch.randn(q.shape, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    module_out = flashgen.attention(*leaves, mask=mask, layout=layout, config=config, **tensors)
    module_out.backward(do)
    assert_gradients_close(tuple(t.grad for t in leaves), q, k, v, do, causal=False, layout=layout, mask=mask,
                           tensors=tensors)


@sm90
@pytest.mark.parametrize("phase", ["forward", "training step", "backward"])
def test_the_range_kernels_record_ids_that_decrease(phase):
    # the Gluon kernels' range kernels search the ids themselves (no runs table launch): a row that
    # decreases goes to the bounds record there, which the next documents call raises, naming the tensor;
    # sorted ids record nothing (forward: _hw_fwd_ranges; a training step's: its FILL_RUNS launch; an
    # explicit backward of other ids than its forward's: the launch that makes its runs table)
    batch, _, _, sq, _, _, _ = SHAPES[0]
    mask, config, module, gen, (q, k, v) = documents_step(12, bwd_short=False, hopper_bwd=True)
    good = random_documents(batch, sq, gen).cuda()
    bad = good.clone()
    bad[1, 700] = bad[1, 699] - 1  # row 1 decreases at column 700 (and rises again after it)
    before, value = int(bad[1, 699]), int(bad[1, 700])
    do = torch.randn(q.shape, generator=gen).to(device="cuda", dtype=torch.bfloat16)

    def run(ids):
        if phase == "forward":
            return module.forward(q, k, v, tensors={"doc": ids})
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if phase == "training step":
            return flashgen.attention(*leaves, mask=mask, config=config, doc=ids).backward(do)
        out, lse = module.forward(q, k, v, tensors={"doc": good})  # checked ids: the backward's are the bad ones
        return module.backward(do, q, k, v, out, lse, tensors={"doc": ids})

    run(good)
    flashgen.check_bounds()  # nothing recorded
    run(bad)
    message = (rf"doc: expected document ids nondecreasing along each row, got {before} then {value} at "
               rf"column 700 of row 1 \(met by the search of a call's document ids on cuda")
    with pytest.raises(ValueError, match=message):
        flashgen.check_bounds()
    assert took_hopper_path(module), "not the Gluon forward"
    if phase == "backward":
        from .test_hopper_bwd_gpu import took_gluon_dkdv

        assert took_gluon_dkdv(module), "not the Gluon dK/dV kernel"
    run(good)
    flashgen.check_bounds()


@sm90
@pytest.mark.parametrize("dq_strategy", ["separate", "atomic"])
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("dtype, shape", [("bf16", SHAPES[0]), ("bf16", SHAPES[2]), ("bf16", SHAPES[3]),
                                          ("fp16", SHAPES[1])])
def test_gluon_backward(dtype, shape, mask_name, dq_strategy):
    # the Gluon dK/dV kernel (hopper_bwd) on the pattern's query rows per key block, the pattern's
    # predicate on the boundary blocks; dQ from the portable kernel or added from this one
    from .test_hopper_bwd_gpu import took_gluon_dkdv

    batch, heads, kv_heads, sq, sk, d, layout = shape
    mask, causal, same = MASKS[mask_name]
    if same:
        sk = sq
    spec = AttentionSpec(dtype=dtype, head_dim=d, num_heads=heads, num_kv_heads=kv_heads, mask=mask, causal=causal,
                         backward=True)
    atomic = dict(dq_strategy="atomic", bwd_fused_delta=False) if dq_strategy == "atomic" else {}
    config = default_config(spec, "h100", sq).replace(bwd_short=False, hopper_bwd=True, **atomic)
    module = flashgen.compile(spec, config).module()
    gen = torch.Generator().manual_seed(3)
    q, k, v = make_qkv(batch, heads, kv_heads, sq, sk, d, dtype=spec.torch_dtype, device="cuda", layout=layout,
                       generator=gen)
    tensors = named_inputs(mask, batch, sq, gen)
    out, lse = module.forward(q, k, v, layout=layout, tensors=tensors)
    do = torch.randn(out.shape, generator=gen).to(device="cuda", dtype=out.dtype)
    grads = module.backward(do, q, k, v, out, lse, layout=layout, tensors=tensors)[:3]
    assert took_gluon_dkdv(module, atomic=bool(atomic)), "not the Gluon dK/dV kernel"
    # gradients: 3x the same-precision reference's error + its rounding (TESTING.md)
    kw = dict(causal=causal, layout=layout, mask=mask, tensors=tensors)
    assert_gradients_close(grads, q, k, v, do, **kw)
    if shape is SHAPES[0]:  # flashgen.attention's autograd on the same config
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        flashgen.attention(*leaves, mask=mask, causal=causal, layout=layout, config=config, **tensors).backward(do)
        assert_gradients_close(tuple(t.grad for t in leaves), q, k, v, do, **kw)
