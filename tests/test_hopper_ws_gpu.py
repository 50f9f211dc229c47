"""The Hopper warp-specialized forward (config family hopper_ws) on an sm90 GPU: forward and
fwd+bwd (the portable backward reading its LSE) against the reference on fresh random inputs,
odd lengths, seqlen_q != seqlen_k both ways, GQA, both layouts, each of the family's techniques;
and flashgen.attention taking it where it is the default."""

import pytest
import torch

import flashgen
from flashgen import AttentionSpec, KernelConfig, default_config
from flashgen.runtime.hopper import HopperPlan
from flashgen.verify import assert_attention_close, assert_gradients_close

from .helpers import cu_seqlens, forget_plans, make_qkv, packed_plans, poisoned_outputs, sm90

pytestmark = pytest.mark.gpu

BASE = dict(family="hopper_ws", BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2)
TECHNIQUES = {"base": {}, "overlap": dict(hopper_overlap=True), "pingpong": dict(hopper_pingpong=True),
              "one consumer": dict(BLOCK_M=64, num_stages=3), "n64 s4": dict(BLOCK_N=64, num_stages=4),
              "persistent": dict(hopper_persistent=True),
              "persistent, one consumer": dict(BLOCK_M=64, num_stages=3, hopper_persistent=True),
              "persistent, overlap": dict(hopper_persistent=True, hopper_overlap=True),
              "persistent, pingpong": dict(hopper_persistent=True, hopper_pingpong=True),
              # O through shared memory and a TMA store (hopper_tma_store): tails clipped by the copy engine
              "tma store": dict(hopper_tma_store=True), "pingpong, tma store": dict(hopper_pingpong=True,
                                                                                    hopper_tma_store=True),
              "persistent, overlap, tma store": dict(hopper_persistent=True, hopper_overlap=True,
                                                     hopper_tma_store=True)}
SHAPES = [  # batch, heads, kv heads, seqlen_q, seqlen_k, head dim, layout
    (2, 8, 2, 1000, 1000, 128, "bhsd"),
    (1, 4, 4, 333, 777, 64, "bshd"),
    (2, 6, 2, 777, 301, 128, "bshd"),
    (1, 8, 1, 17, 4097, 64, "bhsd"),
]


def took_hopper_path(module) -> bool:
    return any(isinstance(plan, HopperPlan) for plan in module._LAUNCHER.plans.values())


def check_forward(dtype, shape, causal, knobs):
    batch, heads, kv_heads, sq, sk, d, layout = shape
    spec = AttentionSpec(dtype=dtype, head_dim=d, num_heads=heads, num_kv_heads=kv_heads, causal=causal)
    module = flashgen.compile(spec, KernelConfig(**{**BASE, **knobs})).module()
    q, k, v = make_qkv(batch, heads, kv_heads, sq, sk, d, dtype=spec.torch_dtype, device="cuda", layout=layout)
    out, lse = poisoned_outputs(q, heads, sq, d, layout)
    module.forward(q, k, v, layout=layout, out=out, lse=lse)
    assert took_hopper_path(module)
    # (dtype, atol) by TESTING.md's rule: 2x the same-precision reference's error + its rounding
    assert_attention_close(out, lse, q, k, v, causal=causal, layout=layout)


@sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward(dtype, shape, causal):
    check_forward(dtype, shape, causal, {})


@sm90
@pytest.mark.parametrize("technique", [t for t in TECHNIQUES if t != "base"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2]])
def test_each_technique(shape, causal, technique):
    check_forward("bf16", shape, causal, TECHNIQUES[technique])


THREE = dict(BLOCK_M=192, hopper_regs=160)  # three 64-row consumers (head dim 64)


@sm90
@pytest.mark.parametrize("knobs", [{}, dict(hopper_overlap=True), dict(BLOCK_N=64, num_stages=3),
                                   dict(hopper_persistent=True), dict(hopper_tma_store=True),
                                   dict(hopper_persistent=True, hopper_overlap=True, hopper_tma_store=True)],
                         ids=["base", "overlap", "n64 s3", "persistent", "tma store", "persistent, overlap, tma store"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3], (2, 6, 3, 1000, 1000, 64, "bhsd"), (1, 2, 2, 191, 193, 64,
                                                                                              "bshd")])
def test_three_consumers(shape, causal, knobs):
    # BLOCK_M 192: tiles of three consumers, the last ones partly or wholly past seqlen_q (191, 333, 1000 rows)
    check_forward("bf16", shape, causal, dict(THREE, **knobs))


@sm90
@pytest.mark.parametrize("programs", [1, 7])
def test_three_consumers_on_a_cut_persistent_grid(monkeypatch, programs):
    from flashgen.runtime import hopper

    monkeypatch.setattr(hopper, "sm_count", lambda device: programs)
    for causal in (False, True):
        spec = AttentionSpec(dtype="bf16", head_dim=64, num_heads=4, num_kv_heads=2, causal=causal)
        knobs = {**BASE, **THREE, "hopper_persistent": True, "hopper_overlap": True, "hopper_tma_store": True}
        module = flashgen.compile(spec, KernelConfig(**knobs)).module()
        module._LAUNCHER.plans.clear()
        q, k, v = make_qkv(2, 4, 2, 1280, 1280, 64, dtype=torch.bfloat16, device="cuda")
        out, lse = poisoned_outputs(q, 4, 1280, 64, "bhsd")
        module.forward(q, k, v, out=out, lse=lse)
        assert took_hopper_path(module)
        assert_attention_close(out, lse, q, k, v, causal=causal)


HD256 = dict(BLOCK_N=64)  # head dim 256 at 16 bits: 64-key blocks, BASE's 2 stages (config.HOPPER_HD256's tile)
HD256_SHAPES = [(2, 8, 2, 1000, 1000, 256, "bhsd"), (1, 4, 4, 333, 777, 256, "bshd"),
                (2, 6, 2, 777, 301, 256, "bshd"), (1, 8, 1, 17, 4097, 256, "bhsd")]


@sm90
@pytest.mark.parametrize("knobs", [{}, dict(hopper_overlap=True), dict(hopper_persistent=True),
                                   dict(hopper_persistent=True, hopper_overlap=True), dict(hopper_pingpong=True),
                                   dict(BLOCK_M=64, num_stages=3),
                                   dict(BLOCK_M=64, hopper_persistent=True, hopper_tma_store=True)],
                         ids=["base", "overlap", "persistent", "persistent, overlap", "pingpong", "one consumer s3",
                              "one consumer, persistent, tma store"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", HD256_SHAPES)
def test_head_dim_256(shape, causal, knobs):
    check_forward("bf16", shape, causal, dict(HD256, **knobs))


@sm90
@pytest.mark.parametrize("causal", [False, True])
def test_head_dim_256_fp16(causal):
    check_forward("fp16", HD256_SHAPES[0], causal, dict(HD256, hopper_persistent=True, hopper_overlap=True))


@sm90
@pytest.mark.parametrize("causal", [False, True])
def test_head_dim_256_training_step_on_its_default(causal):
    # the kernel object's training step at 1024+ tokens: the family's hd256 default forward (HOPPER_HD256),
    # the portable backward (the Gluon dK/dV serves head dims 64 and 128) reading its O and LSE
    spec = AttentionSpec(dtype="bf16", head_dim=256, num_heads=8, num_kv_heads=2, causal=causal, backward=True)
    config = default_config(spec, None, 1024)
    assert config.family == "hopper_ws" and config.BLOCK_N == 64 and not config.hopper_bwd, config
    kernel = flashgen.compile(spec)
    q, k, v = make_qkv(2, 8, 2, 1024, 1100, 256, dtype=torch.bfloat16, device="cuda")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = kernel(*leaves)
    assert took_hopper_path(kernel.module(config))
    do = torch.randn_like(out)
    out.backward(do)
    assert_attention_close(out.detach(), None, q, k, v, causal=causal)
    assert_gradients_close(tuple(t.grad for t in leaves), q, k, v, do, causal=causal)


@sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_forward_backward(shape, causal):
    batch, heads, kv_heads, sq, sk, d, layout = shape
    spec = AttentionSpec(dtype="bf16", head_dim=d, num_heads=heads, num_kv_heads=kv_heads, causal=causal,
                         backward=True)
    config = default_config(spec, "h100", sq).replace(tma=False, warp_specialize=False, **BASE)
    module = flashgen.compile(spec, config).module()
    q, k, v = make_qkv(batch, heads, kv_heads, sq, sk, d, dtype=torch.bfloat16, device="cuda", layout=layout)
    out, lse = module.forward(q, k, v, layout=layout)
    assert took_hopper_path(module)
    do = torch.randn_like(out)
    dq, dk, dv, _ = module.backward(do, q, k, v, out, lse, layout=layout)
    # gradients: 3x (TESTING.md), the portable backward on the family's O and LSE
    assert_gradients_close((dq, dk, dv), q, k, v, do, causal=causal, layout=layout)
    # and through flashgen.attention (the autograd op): the same forward, the same gradients
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flashgen.attention(*leaves, causal=causal, layout=layout, config=config).backward(do)
    assert_gradients_close(tuple(t.grad for t in leaves), q, k, v, do, causal=causal, layout=layout)


@sm90
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", [1024, 4096, 16384])
def test_default_takes_the_family_where_it_is_the_default(head_dim, causal, seqlen):
    # two heads: the float32 reference of one 16384-token call fits beside the kernel's tensors
    spec = AttentionSpec(dtype="bf16", head_dim=head_dim, num_heads=2, causal=causal)
    config = default_config(spec, None, seqlen)  # this GPU's (an H200's backward differs from the H100's)
    if config.family != "hopper_ws":
        pytest.skip(f"the default at hd{head_dim} S={seqlen} causal={causal} is the portable family")
    kernel = flashgen.compile(spec)
    assert kernel.config_for(seqlen) == config  # the config a call of this length gets
    q, k, v = make_qkv(1, 2, 2, seqlen, seqlen, head_dim, dtype=torch.bfloat16, device="cuda")
    out, lse = kernel.forward(q, k, v, config=config)
    assert took_hopper_path(kernel.module(config))
    assert_attention_close(out, lse, q, k, v, causal=causal)


# Head dims between 64, 128 and 256 on their padded width's tiles: each with the knobs of its padded width's
# default (three consumers and the TMA store at 40; persistent + overlap + TMA store at 80-112; hd256's 64-key
# blocks at 160, 192) and one other O store (the pointer store's column mask, or the TMA store's clipping)
PADDED = [(40, dict(BLOCK_M=192, hopper_regs=160, hopper_tma_store=True, hopper_persistent=True)), (40, {}),
          (72, dict(hopper_tma_store=True)), (80, dict(hopper_persistent=True, hopper_overlap=True,
                                                      hopper_tma_store=True)), (96, {}),
          (96, dict(hopper_persistent=True, hopper_overlap=True, hopper_tma_store=True)),
          (112, dict(hopper_pingpong=True)), (160, dict(HD256, hopper_persistent=True, hopper_overlap=True)),
          (192, HD256), (192, dict(HD256, BLOCK_M=64, hopper_persistent=True, hopper_tma_store=True))]
PADDED_SHAPES = [(2, 6, 2, 777, 301, "bshd"), (1, 4, 4, 333, 777, "bhsd"), (1, 8, 1, 17, 1025, "bhsd")]


@sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", PADDED_SHAPES)
@pytest.mark.parametrize("head_dim,knobs", PADDED, ids=[f"hd{d}-{'-'.join(k) or 'base'}" for d, k in PADDED])
def test_padded_head_dims(head_dim, knobs, shape, causal):
    batch, heads, kv_heads, sq, sk, layout = shape
    check_forward("bf16", (batch, heads, kv_heads, sq, sk, head_dim, layout), causal, knobs)


@sm90
@pytest.mark.parametrize("tma_store", [False, True])
@pytest.mark.parametrize("head_dim", [40, 96, 160])
def test_a_padded_head_dim_writes_only_its_own_columns(head_dim, tma_store):
    # out a view of the first head_dim columns of a wider buffer: the padding's columns are computed (zeros of
    # V's padding) but neither store may write them over what follows O's columns in memory
    # (hd160 on 256-wide tiles takes the TMA store's O tiles beside one consumer only: shared memory)
    knobs = dict(HD256, BLOCK_M=64 if tma_store else 128) if head_dim > 128 else {}
    spec = AttentionSpec(dtype="bf16", head_dim=head_dim, num_heads=4, num_kv_heads=2, causal=True)
    module = flashgen.compile(spec, KernelConfig(**{**BASE, **knobs, "hopper_persistent": True,
                                                    "hopper_tma_store": tma_store})).module()
    q, k, v = make_qkv(2, 4, 2, 300, 300, head_dim, dtype=torch.bfloat16, device="cuda")
    wide = torch.full((2, 4, 300, head_dim + 64), 7.0, dtype=torch.bfloat16, device="cuda")
    out = wide[..., :head_dim]
    out_, lse = module.forward(q, k, v, out=out)
    assert took_hopper_path(module) and out_.data_ptr() == out.data_ptr()
    assert bool((wide[..., head_dim:] == 7.0).all())
    assert_attention_close(out, lse, q, k, v, causal=True)


@sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [40, 96, 160])
def test_padded_head_dims_train_on_their_default(head_dim, causal):
    # flashgen.attention at 4096 tokens: the family's forward at the padded width's default knobs, the backward
    # reading its O and LSE: the Gluon dK/dV at 40 and 96 where its width's rule takes it (GQA hd128: adding dQ
    # without causality, with the separate dQ kernel causal; hd64 GQA: the portable kernels), portable at 160
    spec = AttentionSpec(dtype="bf16", head_dim=head_dim, num_heads=4, num_kv_heads=2, causal=causal)
    config = default_config(spec, None, 4096)
    assert config.family == "hopper_ws" and config.hopper_bwd == (head_dim == 96), config
    q, k, v = make_qkv(1, 4, 2, 4096, 4096, head_dim, dtype=torch.bfloat16, device="cuda", layout="bshd")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flashgen.attention(*leaves, causal=causal, layout="bshd")
    do = torch.randn_like(out)
    out.backward(do)
    assert_attention_close(out.detach(), None, q, k, v, causal=causal, layout="bshd")
    assert_gradients_close(tuple(t.grad for t in leaves), q, k, v, do, causal=causal, layout="bshd")


@sm90
@pytest.mark.parametrize("knob", ["", "hopper_overlap", "hopper_pingpong", "hopper_tma_store",
                                  "hopper_overlap+hopper_tma_store"])  # the last: the hd128 and hd64 defaults
@pytest.mark.parametrize("programs", [1, 7, 1000])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], (3, 4, 4, 1280, 1280, 64, "bhsd")])
def test_persistent_programs_walk_many_units(monkeypatch, shape, causal, programs, knob):
    # hopper_persistent with the grid cut to `programs` programs: each walks many work units, so the
    # K/V ring's positions and Q's phases run on across tiles (a wrong phase hangs or reads a stale
    # tile); 1000: more programs than units. The output against the reference; two runs bitwise equal.
    from flashgen.runtime import hopper

    monkeypatch.setattr(hopper, "sm_count", lambda device: programs)
    batch, heads, kv_heads, sq, sk, d, layout = shape
    spec = AttentionSpec(dtype="bf16", head_dim=d, num_heads=heads, num_kv_heads=kv_heads, causal=causal)
    knobs = {name: True for name in knob.split("+") if name}
    module = flashgen.compile(spec, KernelConfig(**BASE, hopper_persistent=True, **knobs)).module()
    module._LAUNCHER.plans.clear()  # plans made by another case fixed their grid with its program count
    q, k, v = make_qkv(batch, heads, kv_heads, sq, sk, d, dtype=torch.bfloat16, device="cuda", layout=layout)
    out, lse = poisoned_outputs(q, heads, sq, d, layout)
    module.forward(q, k, v, layout=layout, out=out, lse=lse)
    assert took_hopper_path(module)
    assert_attention_close(out, lse, q, k, v, causal=causal, layout=layout)
    again, lse_again = module.forward(q, k, v, layout=layout)
    assert torch.equal(again, out) and torch.equal(lse_again, lse)


# Packed sequences (layout 'thd') on the family's packed kernel: (query lengths, key lengths) per sequence, with a
# sequence of one query, one of none, lengths off the tiles, keys longer and shorter than the queries, a
# sequence without keys (O = 0, LSE = -inf)
PACKED = [([1000, 1, 0, 333, 130], None), ([300, 77, 513, 64, 200], [300, 1024, 5, 64, 0])]
# sequences of one length (the persistent packed kernel's calls where the module is persistent: their tensors hold
# no tokens past the last sequence; 512: whole tiles only, a causal program's two tiles both by the TMA store), and
# unequal ones a padded buffer's tail makes read as one length (3 x 300
# tokens: the persistent kernel skips the shorter sequence's last tile)
PACKED_EQUAL = [([300, 300, 300], None), ([300, 300], [513, 513]), ([512, 512, 512], None)]
PACKED_READ_EQUAL = [([300, 200, 300], None)]
PACKED_KNOBS = {"base": {}, "overlap": dict(hopper_overlap=True), "pingpong": dict(hopper_pingpong=True),
                "one consumer": dict(BLOCK_M=64, num_stages=3), "n64 s4": dict(BLOCK_N=64, num_stages=4),
                # O by the TMA store where a 64-row tile lies wholly in its sequence, by pointers where it reaches
                # past it (the sequences' last rows)
                "tma store": dict(hopper_tma_store=True),
                "pingpong, tma store": dict(hopper_pingpong=True, hopper_tma_store=True),
                "one consumer, tma store": dict(BLOCK_M=64, num_stages=3, hopper_tma_store=True),
                # the persistent grid (a packed call's units: the longest sequence's tiles for every sequence, those
                # past a sequence's end skipped); the defaults' knobs: three consumers are hd64's
                "persistent": dict(hopper_persistent=True),
                "persistent, pingpong": dict(hopper_persistent=True, hopper_pingpong=True),
                "persistent, pingpong, tma store": dict(hopper_persistent=True, hopper_pingpong=True,
                                                        hopper_tma_store=True),
                "persistent, one consumer": dict(BLOCK_M=64, num_stages=3, hopper_persistent=True),
                "persistent, overlap, tma store": dict(hopper_persistent=True, hopper_overlap=True,
                                                       hopper_tma_store=True),
                "three consumers": dict(BLOCK_M=192, hopper_regs=160, hopper_tma_store=True),
                "persistent, three consumers": dict(BLOCK_M=192, hopper_regs=160, hopper_persistent=True,
                                                    hopper_tma_store=True)}


@pytest.fixture
def packed_served(monkeypatch):
    """The packed kernel for every packed call these tests make (HopperForward.packed_declines sends short causal
    sequences and three consumers' short calls to the portable forward); the plans made under it are forgotten
    after the test."""
    from flashgen.runtime.hopper import HopperForward

    monkeypatch.setattr(HopperForward, "PACKED_THREE_MEAN", 0)
    monkeypatch.setattr(HopperForward, "PACKED_CAUSAL_MEAN", 0)
    monkeypatch.setattr(HopperForward, "PACKED_CAUSAL_MEAN_HD64", 0)
    yield
    forget_plans()  # (plans made here are not what these modules' calls get without the fixture)


def packed_call(module, lengths, heads, kv_heads, d, dtype, causal, poisoned=()):
    """A packed call through the module's forward on fresh random inputs into NaN-filled outputs; each sequence
    checked against the reference. K and V run on past the last sequence with NaN (a padded buffer's
    uninitialized tail): the last sequence's key blocks read them, which must not reach its output. Q runs on with
    finite rows, whose results are computed and must not be stored: out's and the LSE's rows past the last
    sequence stay NaN. Sequences of one length (PACKED_EQUAL) have no tail, those of PACKED_READ_EQUAL the tail that
    makes them read as one length: both take the persistent packed kernel where the module is persistent. poisoned: sequences whose first value row is inf, read by the sequence before
    them through its last key block (their own outputs are not checked)."""
    lq, lk = lengths[0], lengths[1] or lengths[0]
    rows = len(lq) * max(lq) - sum(lq) if lengths in PACKED_EQUAL + PACKED_READ_EQUAL else 70
    tail = torch.full((rows, kv_heads, d), float("nan"), device="cuda", dtype=dtype)
    q = torch.randn(sum(lq) + rows, heads, d, device="cuda", dtype=dtype)
    k, v = (torch.cat([torch.randn(sum(lk), kv_heads, d, device="cuda", dtype=dtype), tail]) for _ in range(2))
    cu_q, cu_k = cu_seqlens(lq, "cuda"), cu_seqlens(lk, "cuda")
    for i in poisoned:
        v[int(cu_k[i])] = float("inf")
    out = torch.full_like(q, float("nan"))
    lse = torch.full((heads, q.shape[0]), float("nan"), device="cuda")
    _, plans = packed_plans(lambda: module.forward(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                   max_seqlen_q=max(lq), max_seqlen_k=max(lk), out=out, lse=lse))
    persistent = bool(module.CONFIG.get("hopper_persistent")) and lengths in PACKED_EQUAL + PACKED_READ_EQUAL
    assert [plan.cfg["hopper_persistent"] for plan in plans] == [persistent]  # the packed kernel's, on its grid
    assert bool(out[sum(lq):].isnan().all()) and bool(lse[:, sum(lq):].isnan().all())
    for i in range(len(lq)):
        rows, keys = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        if lq[i] == 0 or i in poisoned:
            continue
        if lk[i] == 0:  # no key: O = 0, LSE = -inf
            assert bool((out[rows] == 0).all()) and bool((lse[:, rows] == float("-inf")).all()), i
            continue
        seq = [t.transpose(0, 1)[None] for t in (q[rows], k[keys], v[keys])]
        assert_attention_close(out[rows].transpose(0, 1)[None], lse[:, rows][None], *seq, causal=causal)


@sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", PACKED + PACKED_EQUAL + PACKED_READ_EQUAL,
                         ids=["keys-as-queries", "keys-differ", "equal", "equal-keys-differ", "equal-whole-tiles",
                              "read-equal"])
@pytest.mark.parametrize("knobs", PACKED_KNOBS.values(), ids=PACKED_KNOBS.keys())
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_packed_sequences(packed_served, head_dim, knobs, lengths, causal):
    if knobs.get("BLOCK_M") == 192 and head_dim != 64:
        pytest.skip("three consumers are head dim 64's")
    spec = AttentionSpec(dtype="bf16", head_dim=head_dim, num_heads=8, num_kv_heads=2, causal=causal)
    module = flashgen.compile(spec, KernelConfig(**{**BASE, **knobs})).module()
    packed_call(module, lengths, 8, 2, head_dim, torch.bfloat16, causal)


@sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("knobs", ["base", "overlap", "pingpong", "n64 s4", "tma store", "persistent, pingpong",
                                   "persistent, overlap, tma store", "persistent, three consumers"])
@pytest.mark.parametrize("lengths, poisoned", [(PACKED[0], (1, 4)), (PACKED_EQUAL[0], (1,))], ids=["mixed", "equal"])
def test_an_inf_in_the_next_sequences_values_stays_there(packed_served, lengths, poisoned, knobs, causal):
    # the sequences of 1000, 333 and 300 keys end inside a key block that reads the next sequence's first value row
    # (inf); sequences of one length take the persistent packed kernel where the module is persistent (three
    # consumers: hd64's)
    d = 64 if PACKED_KNOBS[knobs].get("BLOCK_M") == 192 else 128
    spec = AttentionSpec(dtype="bf16", head_dim=d, num_heads=8, num_kv_heads=2, causal=causal)
    module = flashgen.compile(spec, KernelConfig(**{**BASE, **PACKED_KNOBS[knobs]})).module()
    packed_call(module, lengths, 8, 2, d, torch.bfloat16, causal, poisoned=poisoned)


@sm90
@pytest.mark.parametrize("bad", [[0, 100, 50, 300], [0, 100, 101, 9000], [5, 100, 101, 300], [0, 1, 2, 300]])
@pytest.mark.parametrize("which", ["q", "k"])
@pytest.mark.parametrize("grid", ["one tile", "persistent"])
@pytest.mark.parametrize("store", ["pointers", "tma"])
def test_bad_offsets_on_the_packed_kernel_stay_inside_the_tensors(packed_served, bad, which, grid, store):
    # offsets out of order, past the tokens, not from 0, or longer than max_seqlen: the kernel clamps them as the
    # portable one does (no fault, nothing written past out's rows), and the bounds record names the argument. Three
    # sequences of 100 of the 300 tokens read as one length: a persistent module takes its persistent packed kernel.
    # With the TMA store, a sequence's first 64 rows leave by it, the rest by pointers
    spec = AttentionSpec(dtype="bf16", head_dim=64, num_heads=4, num_kv_heads=2, causal=grid == "persistent")
    module = flashgen.compile(spec, KernelConfig(**BASE, hopper_persistent=grid == "persistent",
                                                 hopper_tma_store=store == "tma")).module()
    q = torch.randn(300, 4, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(300, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    good, bad = cu_seqlens([100, 100, 100], "cuda"), torch.tensor(bad, device="cuda", dtype=torch.int32)
    cu_q, cu_k = (bad, good) if which == "q" else (good, bad)
    buffer = torch.full((300 + 64, 4, 64), 7.0, device="cuda", dtype=torch.bfloat16)
    _, plans = packed_plans(lambda: module.forward(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                   max_seqlen_q=100, max_seqlen_k=100, out=buffer[:300]))
    assert [plan.cfg["hopper_persistent"] for plan in plans] == [grid == "persistent"]
    torch.cuda.synchronize()  # no fault
    assert bool((buffer[300:] == 7.0).all())
    with pytest.raises(ValueError, match=f"^(cu_seqlens_{which}|max_seqlen_{which}): "):
        flashgen.check_bounds()
    flashgen.check_bounds()  # the record was cleared


@sm90
@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences_fp16_and_a_training_step_on_the_default(packed_served, causal):
    # fp16 through the module; then flashgen.attention_varlen on its default (the family's, at 2048 tokens) with
    # autograd: the portable backward reads the packed kernel's LSE
    spec = AttentionSpec(dtype="fp16", head_dim=128, num_heads=4, num_kv_heads=4, causal=causal)
    module = flashgen.compile(spec, KernelConfig(**BASE)).module()
    packed_call(module, PACKED[1], 4, 4, 128, torch.float16, causal)
    lengths = [2048, 700, 1]
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=4, num_kv_heads=2, causal=causal)
    assert default_config(spec, None, 2048).family == "hopper_ws"
    q = torch.randn(sum(lengths), 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lengths), 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = cu_seqlens(lengths, "cuda")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, plans = packed_plans(lambda: flashgen.attention_varlen(*leaves, cu, cu, 2048, 2048, causal=causal))
    assert len(plans) == 1
    do = torch.randn_like(out)
    out.backward(do)
    for i in range(len(lengths)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        seq = [t[rows].transpose(0, 1)[None] for t in (q, k, v)]
        assert_attention_close(out.detach()[rows].transpose(0, 1)[None], None, *seq, causal=causal)
        grads = tuple(t.grad[rows].transpose(0, 1)[None] for t in leaves)
        assert_gradients_close(grads, *seq, do[rows].transpose(0, 1)[None], causal=causal)
