"""The host side of the rendered modules (flashgen/runtime/host.py), tested directly: its
helpers, its input checks, and what it launches. Launches are recorded, not run: each
recorder binds the call to the real kernel's parameter names, so the host and the templates
must agree on every argument."""

import math

import pytest
import torch
import triton

import flashgen
from flashgen import AttentionSpec, KernelConfig
from flashgen.codegen import render
from flashgen.runtime import host
from flashgen.runtime.host import AttentionLauncher


class Recorder:
    """Stands in for a @triton.jit kernel: kernel[grid](*args, **kwargs) records the call,
    bound to the kernel's parameter names (launch options apart)."""

    def __init__(self, kernel):
        self.names = list(kernel.arg_names)
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, num_warps=None, num_stages=None, **kwargs):
            bound = dict(zip(self.names, args))
            assert len(args) <= len(self.names) and not set(bound) & set(kwargs)
            bound.update(kwargs)
            assert set(bound) == set(self.names), (set(self.names) - set(bound), set(bound) - set(self.names))
            self.calls.append((grid, bound, {"num_warps": num_warps, "num_stages": num_stages}))

        return launch


def _launcher(spec, config, **overrides):
    """A launcher over the module's own SPEC/CONFIG/flags whose kernels record their launches."""
    module = render.build_module(spec, config)
    forward = module._attn_fwd if config.loop_order == "q_outer" else module._attn_fwd_kv_outer
    kernels = dict(forward_kernel=Recorder(forward), preprocess_kernel=Recorder(module._bwd_preprocess),
                   dkdv_kernel=Recorder(module._attn_bwd_dkdv), dq_kernel=Recorder(module._attn_bwd_dq))
    if module.BLOCK_MAP:
        kernels.update(block_map_kernel=module._block_map_kernel, map_uses_batch=module._LAUNCHER.map_uses_batch,
                       map_uses_head=module._LAUNCHER.map_uses_head)
    if hasattr(module, "dropout_keep_mask"):
        kernels.update(keep_mask_kernel=module._dropout_mask_kernel)
    kernels.update(overrides)
    return AttentionLauncher(spec=module.SPEC, config=module.CONFIG, tensor_ranks=module.TENSOR_RANKS,
                             grad_tensors=module.GRAD_TENSORS, same_seqlen=module._LAUNCHER.same_seqlen, **kernels)


SPEC = AttentionSpec(dtype="fp16", head_dim=24, head_dim_v=40, num_heads=4, num_kv_heads=2, causal=True,
                     softmax_scale=0.25, backward=True)
CONFIG = KernelConfig(BLOCK_M=32, BLOCK_N=16, num_warps=2, num_stages=1, BLOCK_M1=16, BLOCK_N1=64, BLOCK_M2=64,
                      BLOCK_N2=32, bwd_num_warps=8, bwd_num_stages=3, warp_specialize=False)


def _qkv(batch=2, sq=37, sk=53, layout="bhsd"):
    def make(h, s, d):
        shape = (batch, h, s, d) if layout == "bhsd" else (batch, s, h, d)
        return torch.randn(shape, dtype=torch.float16)

    return make(4, sq, 24), make(2, sk, 24), make(2, sk, 40)


# ---------------------------------------------------------------------------------------------- helpers
def test_bhsd_strides_in_every_layout():
    t = torch.empty(2, 3, 5, 7)
    assert host.bhsd_strides(t, "bhsd") == (105, 35, 7, 1)
    assert host.bhsd_strides(t, "bshd") == (105, 7, 35, 1)  # (B, S=3, H=5, D): heads stride 7, seq stride 35
    assert host.bhsd_strides(t[0], "thd") == (0, 7, 35, 1)  # packed: no batch stride


@pytest.mark.parametrize("head_dim,padded", [(1, 16), (16, 16), (24, 32), (80, 128), (128, 128), (256, 256)])
def test_padded_head_dim(head_dim, padded):
    assert host.padded_head_dim(head_dim) == padded


def test_tma_ready_needs_aligned_base_and_strides():
    t = torch.empty(2, 4, 64, 64, dtype=torch.float16)
    assert host.tma_ready(t)
    assert not host.tma_ready(t[..., 1:])  # base off by 2 bytes
    assert not host.tma_ready(t.transpose(-1, -2))  # last dim not contiguous
    assert not host.tma_ready(torch.empty(2, 4, 64, 12, dtype=torch.float16))  # row stride 24 bytes


def test_index_lists_order_whole_then_partial_blocks():
    tile_classes = torch.tensor([[[2, 0, 1, 2], [0, 0, 0, 1]]], dtype=torch.int8)  # (1, 2 rows, 4 blocks)
    counts, lists = host.index_lists(tile_classes)
    assert counts.tolist() == [[[2, 1], [0, 1]]]
    assert lists[0, 0, 0, :2].tolist() == [0, 3] and lists[0, 0, 1, :1].tolist() == [2]
    assert lists[0, 1, 1, :1].tolist() == [3]


def sorted_lists(tile_classes):
    """index_lists' answer in torch: per row, stable argsorts putting the whole (then the partial) blocks first."""
    lists = [torch.argsort((tile_classes != c).to(torch.int8), dim=-1, stable=True).to(torch.int32) for c in (2, 1)]
    counts = torch.stack([(tile_classes == 2).sum(-1), (tile_classes == 1).sum(-1)], dim=-1).to(torch.int32)
    return counts, torch.stack(lists, dim=-2)


@pytest.mark.parametrize("shape", [(1, 1, 3, 5), (2, 3, 7, 1), (1, 2, 2, 1100), (1, 1, 1, 0), (3, 1, 0, 4)])
@pytest.mark.parametrize("transposed", [False, True])
def test_index_lists_is_the_stable_argsort_on_random_classes(shape, transposed):
    # block_lists_fill against the torch form it replaced: every index, not only the listed ones (rows past 1024
    # tiles take two chunks; the transposed view is the key blocks' direction, columns 1 apart by nk)
    classes = torch.randint(0, 3, shape, dtype=torch.int8)
    if transposed:
        classes = classes.transpose(-1, -2)
    counts, lists = host.index_lists(classes)
    want_counts, want_lists = sorted_lists(classes)
    assert torch.equal(counts, want_counts) and torch.equal(lists, want_lists)


@pytest.mark.parametrize("cu_q,cu_k,max_q,max_k,message", [
    ([1, 5, 12], [0, 5, 12], 7, 7, "cu_seqlens_q: expected the first offset to be 0, got 1"),
    ([0, 5, 40], [0, 5, 12], 35, 7, "cu_seqlens_q: expected offsets within the 12 tokens of q, got last offset 40"),
    ([0, 5, 12], [0, -3, 12], 7, 15, "cu_seqlens_k: expected nondecreasing offsets, got 0 then -3 at index 0"),
    ([0, 9, 4, 12], [0, 4, 8, 12], 9, 4, "cu_seqlens_q: expected nondecreasing offsets, got 9 then 4 at index 1"),
    ([0, 5, 12], [0, 5, 12], 6, 7, "max_seqlen_q: expected at least the longest sequence (7 tokens, "
                                   "cu_seqlens_q[2] - cu_seqlens_q[1]), got 6"),
    ([0, 5, 12], [0, 2, 12], 7, 9, "max_seqlen_k: expected at least the longest sequence (10 tokens"),
])
def test_check_cu_seqlens_names_the_argument_and_value(cu_q, cu_k, max_q, max_k, message):
    as_offsets = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError) as info:
        host.check_cu_seqlens(as_offsets(cu_q), as_offsets(cu_k), 12, 12, max_q, max_k)
    assert message in str(info.value)


def test_check_cu_seqlens_accepts_padding_and_empty_sequences():
    cu = torch.tensor([0, 0, 5, 5, 9], dtype=torch.int32)
    host.check_cu_seqlens(cu, cu, 12, 9, 5, 5)  # trailing tokens past the last offset are padding


# ---------------------------------------------------------------------------------------------- checks
@pytest.mark.interpreter
def test_check_inputs_names_what_is_wrong(monkeypatch):
    launcher = _launcher(SPEC, CONFIG)
    q, k, v = _qkv()
    assert launcher.check_inputs(q, k, v, "bhsd") == (2, 1)
    cases = [
        (dict(layout="hsbd"), "layout: expected 'bhsd', 'bshd' or 'thd'"),
        (dict(q=q.float()), "q: expected dtype torch.float16 (spec dtype fp16), got torch.float32"),
        (dict(k=k[:, :1]), "k: expected (batch, heads, head_dim) = (2, 2, 24)"),
        (dict(v=v[:, :, :5]), "v: expected seqlen 53 (the seqlen of k), got 5"),
        (dict(q=q.to("meta")), "q: expected a tensor with data, got a meta tensor"),
        (dict(v=v.to("meta")), "v: expected a tensor with data, got a meta tensor"),
        (dict(k=k[0]), "k: expected a 4-d tensor in layout 'bhsd'"),
    ]
    for change, message in cases:
        args = dict(q=q, k=k, v=v, layout="bhsd") | change
        with pytest.raises(ValueError) as info:
            launcher.check_inputs(**args)
        assert message in str(info.value), (change, str(info.value))
    monkeypatch.setattr(launcher, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):
        launcher.check_inputs(q, k, v, "bhsd")


DOC_SPEC = AttentionSpec(dtype="fp16", head_dim=16, num_heads=2, mask={"document": {"ids": "doc"}},
                         score_mod={"alibi": {"slopes": "slopes"}})


def test_named_tensors_are_checked_and_given_their_rank():
    launcher = _launcher(DOC_SPEC, KernelConfig(BLOCK_M=16, BLOCK_N=16))
    assert launcher.tensor_ranks == {"doc": 2, "slopes": 2} and launcher.grad_tensors == ["slopes"]
    ids, slopes = torch.zeros(30, dtype=torch.int32), torch.ones(2)
    named = launcher.named_tensors({"doc": ids, "slopes": slopes}, torch.device("cpu"))
    # missing leading dimensions broadcast: ids (S,) serve every batch element, slopes (H,) every one too
    assert named["doc"].shape == (1, 30) and named["slopes"].shape == (1, 2)
    args = launcher.tensor_args(named)
    # strides, then sizes; a dim of size 1 (broadcast) has stride 0 (to_triton._load reads kv_idx unclamped)
    assert args[0] is named["doc"] and args[1:5] == [0, 1, 1, 30] and args[5] is named["slopes"]
    assert args[6:] == [0, 1, 1, 2]
    cases = [
        ({"doc": ids}, TypeError, "slopes: this spec's mask or score_mod reads tensor 'slopes'"),
        ({"doc": ids, "slopes": slopes, "bogus": ids}, TypeError, "bogus: not a tensor of this spec"),
        ({"doc": ids, "slopes": [1.0, 2.0]}, TypeError, "slopes: expected a torch.Tensor, got list"),
        ({"doc": ids, "slopes": slopes.to(torch.complex64)}, ValueError,
         "slopes: expected a real (integer, float or bool) tensor, got dtype torch.complex64"),
        ({"doc": ids.to("meta"), "slopes": slopes}, ValueError, "doc: expected a tensor with data, got a meta tensor"),
        ({"doc": ids[None, None], "slopes": slopes}, ValueError, "doc: expected a non-empty tensor of at most 2"),
        ({"doc": ids[:0], "slopes": slopes}, ValueError, "doc: expected a non-empty tensor"),
    ]
    for tensors, error, message in cases:
        with pytest.raises(error) as info:
            launcher.named_tensors(tensors, torch.device("cpu"))
        assert message in str(info.value), (tensors.keys(), str(info.value))


def test_knobs_and_seed():
    launcher = _launcher(SPEC, CONFIG)
    assert launcher.knobs({"BLOCK_M": 64})["BLOCK_M"] == 64 and launcher.knobs({})["BLOCK_M"] == 32
    for bad in ({"BLOCK_K": 16}, {"loop_order": "kv_outer"}):
        with pytest.raises(TypeError, match="unexpected knob"):
            launcher.knobs(bad)
    assert launcher.seed_arg(None, 0.0, torch.device("cpu")).dtype == torch.int64
    with pytest.raises(ValueError, match="dropout_p: this module was generated without dropout"):
        launcher.seed_arg(torch.zeros(1, dtype=torch.int64), 0.1, torch.device("cpu"))
    dropout = _launcher(SPEC.replace(dropout_p=0.2), CONFIG)
    seed = torch.zeros(1, dtype=torch.int64)
    assert dropout.seed_arg(seed, 0.2, torch.device("cpu")) is seed
    with pytest.raises(ValueError, match="seed: expected a one-element int64 tensor"):
        dropout.seed_arg(seed.int(), 0.2, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"dropout_p: expected a probability in \[0, 1\), got 1.5"):
        dropout.seed_arg(seed, 1.5, torch.device("cpu"))


@pytest.mark.interpreter
def test_varlen_offsets_are_checked_unless_the_host_cannot_read_them(monkeypatch):
    launcher = _launcher(SPEC, CONFIG)
    q, k = torch.empty(12, 4, 24, dtype=torch.float16), torch.empty(12, 2, 24, dtype=torch.float16)
    good, bad = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 5, 40], dtype=torch.int32)
    assert launcher.varlen_args(good, good, 7, 7, "thd", q, k, 0) == (2, 7, 7, 12, 12)
    launcher.check_offsets(good, good, 12, 12, 7, 7)
    with pytest.raises(ValueError, match="cu_seqlens_k: expected offsets within the 12 tokens of k, got last offset 40"):
        launcher.check_offsets(good, bad, 12, 12, 7, 35)
    # A planned call checks the offsets' values on every call, not only on its first.
    kw = dict(layout="thd", cu_seqlens_q=good, max_seqlen_q=7, max_seqlen_k=35)
    launcher.forward(q, k, k.new_empty(12, 2, 40), cu_seqlens_k=torch.tensor([0, 5, 12], dtype=torch.int32), **kw)
    with pytest.raises(ValueError, match="cu_seqlens_k: expected offsets within the 12 tokens of k"):
        launcher.forward(q, k, k.new_empty(12, 2, 40), cu_seqlens_k=bad, **kw)
    # Under torch.compile (or CUDA graph capture) the offsets are not read: the kernels clamp them.
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    launcher.check_offsets(good, bad, 12, 12, 7, 35)
    dense = launcher.varlen_args(None, None, None, None, "bhsd", *_qkv()[:2], 2)
    assert dense == (2, 37, 53, 0, 0)  # dense: the totals are not used (0: no extra specialization)


@pytest.mark.parametrize("offsets_q, offsets_k, maxes, message", [
    ([0, 5, 12], [0, 5, 12], (7, 7), None),
    ([0, 5, 12], [2, 5, 12], (7, 7), "cu_seqlens_k: expected the first offset to be 0, got 2"),
    ([0, 5, 3, 12], [0, 5, 6, 12], (9, 9), "cu_seqlens_q: expected nondecreasing offsets, got 5 then 3 at index 1"),
    ([0, 5, 12], [0, 5, 40], (7, 35), "cu_seqlens_k: expected offsets within the 12 tokens of k, got last offset 40"),
    ([0, 5, 12], [0, 5, 12], (6, 7), "max_seqlen_q: expected at least the longest sequence (7 tokens, cu_seqlens_q[2] "
                                     "- cu_seqlens_q[1]), got 6"),
    # the longest of two too long (5 tokens at index 2, 14 at index 20: the loop's second step)
    ([0, 1, 2, 7, *range(8, 25), 38], list(range(0, 22)), (3, 3),
     "max_seqlen_q: expected at least the longest sequence (14 tokens, cu_seqlens_q[21] - cu_seqlens_q[20]), got 3"),
    # past the first step of the check's loop (BLOCK 16): the rule broken at index 37
    ([0] + list(range(1, 38)) + [36, 40], list(range(0, 40)), (3, 3),
     "cu_seqlens_q: expected nondecreasing offsets, got 37 then 36 at index 37"),
])
@pytest.mark.interpreter
def test_the_device_check_of_packed_offsets(offsets_q, offsets_k, maxes, message):
    # What a GPU runs instead of reading the offsets (AttentionLauncher.check_offsets): the first broken
    # rule in the bounds record, raised by the next call that reads it (here at once, the interpreter
    # having run the kernel); the host check (the CPU's) says the same.
    offsets_k = offsets_k + [offsets_k[-1]] * (len(offsets_q) - len(offsets_k))
    cu_q, cu_k = (torch.tensor(x, dtype=torch.int32) for x in (offsets_q, offsets_k))
    record = host.BoundsRecord(torch.device("cpu"))
    host.cu_seqlens_check[(1,)](cu_q, cu_k, record.tensor, len(offsets_q) - 1, 12 if len(offsets_q) < 10 else 40,
                                 12 if len(offsets_q) < 10 else 40, *maxes, BLOCK=16)
    if message is None:
        assert not record.words.any()
        record.raise_recorded()
        return
    with pytest.raises(ValueError) as info:
        record.raise_recorded()
    assert str(info.value) == message
    assert not record.words.any()  # cleared


def test_check_bounds_without_a_device_checks_every_record(monkeypatch):
    # Records of two devices (a CPU one and a stand-in for a second): check_bounds() raises what either holds.
    monkeypatch.setattr(host, "RECORDS", {})
    records = [host.bounds_record(torch.device("cpu")), host.BoundsRecord(torch.device("cpu"))]
    host.RECORDS["second device"] = records[1]
    for record in records:
        record.words[:] = [host.OFFSETS_FIRST, 1, 0, 3, 0]
        with pytest.raises(ValueError, match="^cu_seqlens_k: expected the first offset to be 0, got 3$"):
            host.check_bounds()
        host.check_bounds()  # cleared


def test_a_record_is_cleared_kind_last():
    # a kernel claims the record by a compare-and-swap of its kind (word 0) from 0, then writes the other
    # words: the host clears those first and the kind last, so no record made once the kind is 0 is wiped
    writes = []

    class Words(list):
        def __setitem__(self, index, value):
            writes.append(index)
            super().__setitem__(index, [value] * len(self[index]) if isinstance(index, slice) else value)

    record = host.BoundsRecord(torch.device("cpu"))
    record.words = Words([host.OFFSETS_FIRST, 1, 0, 3, 0])
    with pytest.raises(ValueError, match="^cu_seqlens_k: expected the first offset to be 0"):
        record.raise_recorded()
    assert writes[-1] == 0 and list(record.words) == [0] * 5


# ---------------------------------------------------------------------------------------------- launches
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.interpreter
def test_forward_launch_q_outer(layout):
    launcher = _launcher(SPEC, CONFIG)
    q, k, v = _qkv(layout=layout)
    out, lse = launcher.forward(q, k, v, layout=layout)
    assert out.shape == ((2, 4, 37, 40) if layout == "bhsd" else (2, 37, 4, 40)) and lse.shape == (2, 4, 37)
    ((grid, args, options),) = launcher.forward_kernel.calls
    assert grid == (triton.cdiv(37, 32), 4, 2) and options == {"num_warps": 2, "num_stages": 1}
    assert (args["BLOCK_M"], args["BLOCK_N"], args["VARLEN"], args["TMA"], args["DROPOUT"]) == (32, 16, False, False,
                                                                                              False)
    assert args["sm_scale"] == 0.25 and math.isclose(args["qk_scale"], 0.25 / math.log(2), rel_tol=1e-15)
    assert (args["seqlen_q"], args["seqlen_k"], args["num_heads"]) == (37, 53, 4)
    strides = host.bhsd_strides(q, layout)
    assert (args["stride_qb"], args["stride_qh"], args["stride_qm"], args["stride_qd"]) == strides
    assert (args["stride_lb"], args["stride_lh"]) == (4 * 37, 37)
    assert args["Q"] is q and args["QD"] is q and args["O"] is out and args["LSE"] is lse


def _decode_qkv(seqlen_k, queries=3):
    """A generation step as transformers makes it: q (2, queries, 4, 24) bshd; k, v bshd views of
    (2, 2, seqlen_k, d) caches, whose batch and head strides follow from seqlen_k."""
    q = torch.randn(2, queries, 4, 24, dtype=torch.float16)
    k, v = (torch.randn(2, 2, seqlen_k, d, dtype=torch.float16).transpose(1, 2) for d in (24, 40))
    return q, k, v


@pytest.mark.interpreter
def test_decode_shaped_calls_of_new_lengths_share_one_plan(monkeypatch):
    """Each length's launch gets exactly the arguments a plan made afresh for it gets (strides and
    seqlen_k spliced in), and forward_plan runs once for all the lengths."""
    launcher, fresh = _launcher(SPEC, CONFIG), _launcher(SPEC, CONFIG)
    made = []
    plan = launcher.forward_plan
    monkeypatch.setattr(launcher, "forward_plan", lambda *a, **kw: made.append(1) or plan(*a, **kw))
    for seqlen_k in (53, 54, 64, 1, 200):
        q, k, v = _decode_qkv(seqlen_k)
        out, lse = launcher.forward(q, k, v, layout="bshd")
        fresh.plans.clear()
        fresh.forward(q, k, v, layout="bshd")
        (grid, args, options), (grid_f, args_f, options_f) = launcher.forward_kernel.calls[-1], \
            fresh.forward_kernel.calls[-1]
        assert (grid, options) == (grid_f, options_f) and args.keys() == args_f.keys()
        for name, value in args.items():
            if isinstance(value, torch.Tensor):  # the call's own tensors, or outputs of one shape
                assert (value.shape, value.stride()) == (args_f[name].shape, args_f[name].stride()), name
                assert name not in ("Q", "K", "V") or value is args_f[name], name
            else:
                assert value == args_f[name], (name, seqlen_k)
        assert args["seqlen_k"] == seqlen_k and args["stride_kh"] == seqlen_k * 24 and out.shape == (2, 3, 4, 40)
    assert made == [1]
    launcher.forward(*_decode_qkv(53, queries=17), layout="bshd")  # more queries than a decode step: exact plans
    assert made == [1, 1]
    with pytest.raises(ValueError, match="v: expected seqlen 53"):
        launcher.forward(*_decode_qkv(53)[:2], _decode_qkv(54)[2], layout="bshd")


@pytest.mark.interpreter
def test_decode_shaped_plans_stay_exact_where_a_plan_fixes_the_length(monkeypatch):
    """Tensor descriptors are built for one shape: such a plan is not reused at another length."""
    launcher = _launcher(SPEC, CONFIG.replace(tma=True))
    monkeypatch.setattr(host, "tma_ready", lambda t: True)
    monkeypatch.setattr(host, "TensorDescriptor", type("Descriptor", (), {"__init__": lambda self, *a: None}))
    made = []
    plan = launcher.forward_plan
    monkeypatch.setattr(launcher, "forward_plan", lambda *a, **kw: made.append(1) or plan(*a, **kw))
    for seqlen_k in (53, 54):
        launcher.forward(*_decode_qkv(seqlen_k), layout="bshd")
    assert made == [1, 1] and launcher.forward_kernel.calls[-1][1]["TMA"]


@pytest.mark.interpreter
def test_forward_launch_kv_outer_carries_o_m_l_in_buffers():
    launcher = _launcher(SPEC, CONFIG.replace(loop_order="kv_outer"))
    launcher.forward(*_qkv())
    ((grid, args, _),) = launcher.forward_kernel.calls
    assert grid == (4, 2)
    assert args["ACC"].shape == (4 * 2 * 37, 64) and args["ACC"].dtype == torch.float32  # BLOCK_DV = 64 for 40
    assert args["M"].isneginf().all() and (args["L"] == 0).all()


@pytest.mark.interpreter
def test_forward_launch_packed_sequences_pass_the_totals():
    launcher = _launcher(SPEC, CONFIG)
    q, k, v = torch.randn(12, 4, 24).half(), torch.randn(20, 2, 24).half(), torch.randn(20, 2, 40).half()
    cu_q, cu_k = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 15, 20], dtype=torch.int32)
    out, lse = launcher.forward(q, k, v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7,
                                max_seqlen_k=15)
    assert out.shape == (12, 4, 40) and lse.shape == (4, 12)
    ((grid, args, _),) = launcher.forward_kernel.calls
    assert grid == (1, 4, 2) and args["VARLEN"] and args["CU_Q"] is not None
    assert (args["seqlen_q"], args["seqlen_k"], args["total_q"], args["total_k"]) == (7, 15, 12, 20)
    assert (args["stride_qb"], args["stride_lb"], args["stride_lh"]) == (0, 0, 12)


@pytest.mark.parametrize("dq_strategy", ["separate", "atomic"])
@pytest.mark.interpreter
def test_backward_launches(dq_strategy):
    launcher = _launcher(SPEC, CONFIG.replace(dq_strategy=dq_strategy))
    q, k, v = _qkv()
    out, lse = torch.randn(2, 4, 37, 40).half(), torch.randn(2, 4, 37)
    dq, dk, dv, grads = launcher.backward(out, q, k, v, out, lse)
    assert (dq.shape, dk.shape, dv.shape, grads) == (q.shape, k.shape, v.shape, {})
    ((grid, args, options),) = launcher.preprocess_kernel.calls
    assert grid == (1, 4, 2) and args["BLOCK_M"] == 64 and options == {"num_warps": None, "num_stages": None}
    ((grid, args, options),) = launcher.dkdv_kernel.calls
    assert grid == (triton.cdiv(53, 64), 2, 2) and (args["BLOCK_M"], args["BLOCK_N"]) == (16, 64)
    assert options == {"num_warps": 8, "num_stages": 3} and args["ATOMIC_DQ"] == (dq_strategy == "atomic")
    assert args["sm_scale"] == 0.25 and math.isclose(args["qk_scale"], 0.25 / math.log(2), rel_tol=1e-15)
    if dq_strategy == "atomic":
        assert not launcher.dq_kernel.calls and args["DQ"].dtype == torch.float32
    else:
        ((grid, args, _),) = launcher.dq_kernel.calls
        assert grid == (1, 4, 2) and (args["BLOCK_M"], args["BLOCK_N"]) == (64, 32) and args["DQ"] is dq
    # deterministic=True always runs the separate dQ kernel
    launcher.backward(out, q, k, v, out, lse, deterministic=True)
    assert not launcher.dkdv_kernel.calls[-1][1]["ATOMIC_DQ"]


@pytest.mark.interpreter
def test_block_map_launch_args_and_cache():
    spec = AttentionSpec(dtype="fp16", head_dim=16, num_heads=2, mask="(q_idx - kv_idx) % 4 == 0")
    launcher = _launcher(spec, KernelConfig(BLOCK_M=16, BLOCK_N=16))
    q, k, v = (torch.randn(1, 2, 40, 16).half() for _ in range(3))
    launcher.forward(q, k, v)
    ((grid, args, _),) = launcher.forward_kernel.calls
    counts, lists = launcher.block_maps[(1, 1, 40, 40, 16, 16, "cpu")][:2]
    assert args["MAP_COUNTS"].shape == (1, 2, 3, 2) and torch.equal(args["MAP_COUNTS"][0, 1], counts[0, 0])
    assert (args["blocks_sblk"], args["blocks_skind"]) == (lists.stride(2), lists.stride(3))
    with pytest.raises(ValueError, match=r"^mask: .* is not supported over packed sequences"):
        launcher.forward(*(t[0].transpose(0, 1) for t in (q, k, v)), layout="thd", cu_seqlens_q=torch.tensor([0, 40], dtype=torch.int32),
                         cu_seqlens_k=torch.tensor([0, 40], dtype=torch.int32), max_seqlen_q=40, max_seqlen_k=40)


@pytest.mark.parametrize("device", ["x", 5.5])
def test_check_bounds_names_a_bad_device(device):
    with pytest.raises(ValueError, match=r"^device: expected a torch.device or a device string"):
        flashgen.check_bounds(device)
