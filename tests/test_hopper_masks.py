"""Mask patterns in the Hopper warp-specialized forward (family hopper_ws) without a GPU: which
masks it serves, the rendering (unmasked kernels untouched, the mask code in Gluon), a masked call's
launch, and the block ranges and visibility the kernel computes, run on the CPU.

Gluon kernels do not run under Triton's interpreter, so the range helpers of a rendered module
(templates/hopper/masks.j2) are run here as plain Python with `gl` replaced by torch ops: every
integer division they make has operands >= 0, where Python's and Triton's // agree. The kernel
itself is compiled for sm90 by tests/test_sm90_compile.py and run by tests/test_hopper_masks_gpu.py."""

import types

import pytest
import torch

import flashgen
from flashgen import AttentionSpec, ConfigError, KernelConfig
from flashgen.codegen.plan import plan_for
from flashgen.codegen.render import render
from flashgen.expr.ir import Bin, Fn, Load, Search, Var
from flashgen.expr.to_torch import evaluate
from flashgen.expr.to_triton import GLUON, triton_expr
from flashgen.runtime import host, hopper
from flashgen.runtime.host import runs_table
from flashgen.space import DeviceLimits, forward_space

from .helpers import make_qkv

HOPPER = dict(family="hopper_ws", BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2)
H100 = DeviceLimits("NVIDIA H100", 232448.0, hopper=True)
DOCS = {"document": {"ids": "doc"}}


@pytest.mark.parametrize("mask", [
    DOCS, {"document": {"ids": "doc", "causal": False}}, {"prefix_lm": 512}, {"prefix_lm": "plen"},
    {"sliding_window": {"left": 256, "right": 0}}, {"chunked": 1024},
    {"and": [{"chunked": 96}, {"sliding_window": {"left": 40}}]},
])
def test_served_masks_have_one_key_segment(mask):
    for causal in (False, True):
        spec = AttentionSpec(dtype="bf16", head_dim=128, mask=mask, causal=causal)
        assert hopper.spec_unserved(spec) is None and hopper.spec_unserved(spec.to_dict()) is None
        # what the kernel is written for: one key range per block of rows, no block map
        assert len(plan_for(spec).kv_segments) == 1
        KernelConfig(**HOPPER).check_spec(spec)


@pytest.mark.parametrize("fields, reason", [
    (dict(mask={"sink": {"tokens": 4, "window": 64}}), "pattern 'sink'"),
    (dict(mask={"or": [{"sliding_window": {"left": 8}}, {"prefix_lm": 4}]}), "pattern 'or'"),
    (dict(mask="q_idx >= kv_idx"), "a custom expression"),
    (dict(mask={"and": [{"chunked": 64}, {"expr": "kv_idx % 2 == 0"}]}), "a custom expression"),
    (dict(mask={"chunked": 64}, score_mod={"softcap": 30.0}), "score modifier"),
    (dict(mask={"chunked": 64}, dtype="fp8_e4m3"), "dtype 'fp8_e4m3'"),
])
def test_unserved_masks_name_the_reason(fields, reason):
    spec = AttentionSpec(**{"dtype": "bf16", "head_dim": 128, **fields})
    for form in (spec, spec.to_dict() | {"head_dim_v": spec.head_dim_v}):  # a module's SPEC dict too
        got = hopper.spec_unserved(form)
        assert got is not None and reason in got, got
    with pytest.raises(ConfigError, match="'family'.*" + reason.split("'")[0]):
        render(spec, KernelConfig(**HOPPER))


@pytest.mark.parametrize("mask", [
    DOCS, {"prefix_lm": "plen"}, {"sliding_window": {"left": 256, "right": 0}}, {"chunked": {"size": 96, "causal": False}},
    {"and": [{"chunked": 96}, {"sliding_window": {"left": 40}}]},
])
def test_the_gluon_backward_serves_the_forwards_masks(mask):
    # the dK/dV kernel walks, per key block, the query rows that see it: one segment for these masks too
    for causal in (False, True):
        spec = AttentionSpec(dtype="bf16", head_dim=128, mask=mask, causal=causal, backward=True)
        assert hopper.spec_unserved(spec, backward=True) is None and len(plan_for(spec).q_segments) == 1
        KernelConfig(hopper_bwd=True).check_spec(spec)
    # a default only where measured faster: prefix-LM at hd128 from 4096 tokens, documents from 16384
    # (tests/test_hopper_bwd.py)
    assert flashgen.default_config(spec, "h100", 16384).hopper_bwd is ("prefix_lm" in mask or mask is DOCS)
    sink = AttentionSpec(dtype="bf16", head_dim=128, mask={"sink": {"tokens": 4, "window": 64}}, backward=True)
    with pytest.raises(ConfigError, match="'hopper_bwd'.*pattern 'sink'"):
        KernelConfig(hopper_bwd=True).check_spec(sink)


def test_gluon_dialect_writes_no_triton_names():
    # Gluon functions cannot call tl or common/math.j2's @triton.jit helpers
    node = Bin("&", Bin("==", Load("doc", (Var("b"), Var("q_idx"))), Search("doc", Var("kv_idx"), True)),
               Fn("max", (Bin("//", Var("q_idx"), Var("kv_idx")), Var("kv_idx"))))
    names = {"b": "off_b", "q_idx": "rows", "kv_idx": "cols"}
    text = triton_expr(node, names, dialect=GLUON)
    assert "tl." not in text and "_clamp(" not in text.replace("_hw_clamp(", "")
    assert all(name in text for name in ("gl.load(", "_hw_search(", "_hw_clamp(", "_hw_fdiv(", "gl.maximum("))
    assert triton_expr(node, names).count("tl.") == text.count("gl.")  # the same expression


def _gluon_source(mask, **fields):
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=8, num_kv_heads=2, mask=mask, **fields)
    source = render(spec, KernelConfig(**HOPPER), standalone=False)
    return source[source.index("# Hopper warp-specialized forward"):]


def test_masked_render_keeps_the_unmasked_kernel_text():
    # the mask branches render only for a spec with a mask pattern: the causal kernel (whose hash
    # keys shipped tuning_db rows) has none of them, and a masked kernel has no Triton call
    causal = _gluon_source(None, causal=True)
    assert not any(word in causal for word in ("first_block", "_hw_visible", "n_start", "n_full_lo"))
    masked = _gluon_source(DOCS, causal=True)
    assert "tl." not in masked and "@triton.jit" not in masked
    assert "def _hw_visible(rows, cols, off_b, off_h, seqlen_q, seqlen_k, t_doc," in masked
    assert "(first_block + j) * BLOCK_N" in masked
    # the forward's kernels read no runs table of the ids: its range kernel searches them (a forward fills none)
    assert "_hw_search(t_doc + " in masked and "runs_doc + " not in masked


def test_a_masked_call_passes_its_named_tensors(monkeypatch):
    # the kernel takes the mask's tensors (ids, their strides and sizes) after the scalars, as the
    # portable forward does (documents: and in their runs table's place a dummy, as neither kernel reads
    # one, so none is filled), then the block-range table a small kernel fills first over (tiles, batch);
    # nothing runs here (the plans are made on the host, their launches recorded)
    spec = AttentionSpec(dtype="fp16", head_dim=64, num_heads=4, num_kv_heads=2, mask=DOCS)
    module = flashgen.compile(spec, KernelConfig(**HOPPER)).module()
    assert module._LAUNCHER.hopper_forward.ranges is module._hw_fwd_ranges
    monkeypatch.setattr(module._LAUNCHER.hopper_forward, "device_unserved", lambda device: None)
    monkeypatch.setattr(module._LAUNCHER, "interpreting", lambda: True)  # CPU tensors on a GPU machine too
    launched = []
    monkeypatch.setattr(hopper, "BoundLaunch", lambda kernel, grid, constexprs: lambda *args: launched.append(
        (kernel, grid, constexprs, args)))
    class Descriptor:  # (the plan copies its first descriptors' fields onto later calls' tensors)
        def __init__(self, t, layout, rows, cols):
            self.base = t

    monkeypatch.setattr(module._LAUNCHER.hopper_forward, "descriptor", Descriptor)
    monkeypatch.setattr(host, "runs_table", lambda *a: pytest.fail("a runs table filled for the Gluon forward"))
    q, k, v = make_qkv(2, 4, 2, 45, 45, 64, dtype=torch.float16, device="cpu")
    doc = torch.tensor([0] * 20 + [1] * 25, dtype=torch.int32)
    module.forward(q, k, v, tensors={"doc": doc})
    (ranges, grid, constexprs, (table, *ranges_args)), (kernel, _, _, args) = launched
    assert ranges is module._hw_fwd_ranges and kernel is module._attn_fwd_hopper_ws
    assert grid == (1, 2) and constexprs == dict(BLOCK_M=128, BLOCK_N=128, CONSUMERS=2, FILL_RUNS=False, num_warps=4)
    assert table.dtype == torch.int32 and table.shape == (2 * 1 * (2 + 4 * 2),)  # (batch, tiles) x 10
    (_, _, _, out, lse, *_, qk_scale, t_doc, s0, s1, n0, n1, runs, passed) = args
    # (the range kernel's second argument: the bounds record, where it writes ids that decrease)
    assert passed is table and ranges_args[0] is host.bounds_record(doc.device).tensor
    assert ranges_args[1:3] == [45, 45] and ranges_args[3] is t_doc
    assert out.shape == q.shape and out.dtype == torch.float16 and out.is_contiguous()  # the plan allocates them
    assert lse.shape == (2, 4, 45) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert qk_scale == pytest.approx(64 ** -0.5 * 1.4426950408889634)
    assert t_doc.data_ptr() == doc.data_ptr() and (s0, s1, n0, n1) == (0, 1, 1, 45)  # (size 1: stride 0)
    assert runs is module._LAUNCHER.unused_arg(torch.int32, doc.device)  # the dummy (one element, never read)
    # a training step's forward: the range kernel's FILL_RUNS launch fills the runs table the backward reads
    # (allocated here, int32 (2, rows, n)), in place of host.runs_table's launch
    launched.clear()
    seed = module._LAUNCHER.unused_arg(torch.int64, doc.device)
    _, _, _, extra = module._LAUNCHER.training_forward(q, k, v, "bhsd", 0.0, seed, {"doc": doc}, None, None, None, None)
    (_, _, constexprs, (table, *ranges_args)), (_, _, _, args) = launched
    assert constexprs["FILL_RUNS"] is True and len(ranges_args) == 3 + len(extra) and args[-1] is table
    assert all(a is b is c for a, b, c in zip(ranges_args[3:], extra, args[-7:-1]))
    runs = extra[-1]
    assert runs.shape == (2, 1, 45) and runs.dtype == torch.int32 and runs is not module._LAUNCHER.unused_arg(
        torch.int32, doc.device)


def test_space_offers_the_family_for_served_masks_only():
    served = forward_space(AttentionSpec(dtype="bf16", head_dim=128, num_heads=16, mask=DOCS), H100)
    assert "hopper_ws" in served.params["family"]
    assert any(p["family"] == "hopper_ws" for p in served.points())
    sink = AttentionSpec(dtype="bf16", head_dim=128, mask={"sink": {"tokens": 4, "window": 64}})
    assert "family" not in forward_space(sink, H100).params


def test_masked_defaults_take_the_family_where_it_measured_faster():
    # H100 user path (config._hopper_ws_masked_default; benchmarks/results/2026-11-27-h100-hopper-masks-s20*.md):
    # from 4096 tokens at hd128, prefix-LM the unmasked default's knobs (persistent grid, overlap, TMA store on
    # 128x128 tiles, 2 stages); documents 128x64 tiles, 4 stages, the same three; bands of 193-2048 keys the
    # 128x64 tiles on the persistent grid with the TMA store, no overlap. Windows of up to 192 keys, hd64 and
    # calls under 4096 tokens (unmeasured) keep the portable default
    def config(mask, seqlen, d=128, target="h100"):
        return flashgen.default_config(AttentionSpec(dtype="bf16", head_dim=d, num_heads=16, mask=mask), target,
                                       seqlen)

    def knobs(got):
        return (got.family, got.BLOCK_M, got.BLOCK_N, got.num_stages, got.hopper_persistent, got.hopper_overlap,
                got.hopper_tma_store, got.hopper_pingpong)

    for mask, seqlen in (({"prefix_lm": 512}, 4096), ({"prefix_lm": "plen"}, 8192), ({"prefix_lm": 512}, 16384)):
        got = config(mask, seqlen)
        assert knobs(got) == ("hopper_ws", 128, 128, 2, True, True, True, False), (mask, seqlen)
        assert got.hopper_bwd and got.dq_strategy == "atomic"  # the Gluon dK/dV adding dQ: prefix-LM from 4096
    for seqlen in (4096, 8192, 16384):
        for mask in (DOCS, {"document": {"ids": "doc", "causal": False}}):
            assert knobs(config(mask, seqlen)) == ("hopper_ws", 128, 64, 4, True, True, True, False), (mask, seqlen)
        for mask in ({"chunked": 1024}, {"sliding_window": {"left": 256, "right": 0}},
                     {"sliding_window": {"left": 1024, "right": 0}}):
            assert knobs(config(mask, seqlen)) == ("hopper_ws", 128, 64, 4, True, False, True, False), (mask, seqlen)
    for mask, seqlen in ((DOCS, 2048), ({"prefix_lm": 512}, 1024), ({"chunked": 1024}, 2048),
                         ({"sliding_window": {"left": 128, "right": 0}}, 16384)):
        assert config(mask, seqlen).family == "portable", (mask, seqlen)
    for mask in ({"prefix_lm": 512}, DOCS, {"chunked": 1024}):
        assert config(mask, 16384, d=64).family == "portable"
        assert config(mask, 16384, target="a100").family == "portable"
    # hd256 (an H200: results/2026-11-29-h200-hd256-masks-s36-before.md): windows and chunks of 193-2048 keys from
    # 4096 tokens on the unmasked hd256 default's knobs (64-key blocks, 2 stages, persistent + overlap); other
    # hd256 masks, narrower or wider bands and shorter calls keep the portable forward
    for target in ("h100", "h200"):
        for seqlen in (4096, 8192, 16384):
            for mask in ({"sliding_window": {"left": 1024, "right": 0}}, {"sliding_window": {"left": 256, "right": 0}},
                         {"chunked": 1024}):
                got = config(mask, seqlen, d=256, target=target)
                assert knobs(got) == ("hopper_ws", 128, 64, 2, True, True, False, False), (mask, seqlen)
        for mask, seqlen in (({"sliding_window": {"left": 1024, "right": 0}}, 2048), (DOCS, 16384),
                             ({"prefix_lm": 512}, 16384), ({"sliding_window": {"left": 128, "right": 0}}, 16384),
                             ({"and": [DOCS, {"sliding_window": {"left": 1024, "right": 0}}]}, 8192),
                             ({"sliding_window": {"left": 4096, "right": 0}}, 8192)):
            assert config(mask, seqlen, d=256, target=target).family == "portable", (mask, seqlen)


# --------------------------------------------------------------- the range helpers, run on the CPU
def _t(x):
    return torch.as_tensor(x)


class _Pointer:
    """A named tensor's pointer in the shim: its elements (flat) and an element offset (an int or a tensor)."""

    def __init__(self, flat, offset=0):
        self.flat, self.offset = flat, offset

    def __add__(self, other):
        return _Pointer(self.flat, self.offset + other)

    __radd__ = __add__


def _load(pointer, mask=None, other=0):
    offset = _t(pointer.offset)
    if mask is None:
        return pointer.flat[offset]
    mask = _t(mask)
    return torch.where(mask, pointer.flat[torch.where(mask, offset, 0)], other)


def _store(pointer, value, mask=None):
    offset = _t(pointer.offset)
    if mask is None:
        pointer.flat[offset] = _t(value).to(pointer.flat.dtype)
        return
    mask = _t(mask)
    pointer.flat[offset[mask]] = _t(value)[mask].to(pointer.flat.dtype)


def _atomic_cas(pointer, compare, value):
    old = pointer.flat[_t(pointer.offset)].clone()
    if old == compare:
        pointer.flat[_t(pointer.offset)] = _t(value)
    return old


SHIM_GL = types.SimpleNamespace(maximum=lambda a, b: torch.maximum(_t(a), _t(b)),
                                minimum=lambda a, b: torch.minimum(_t(a), _t(b)),
                                where=lambda c, a, b: torch.where(_t(c), _t(a), _t(b)), abs=lambda a: torch.abs(_t(a)),
                                # _hw_search's (document ids)
                                load=_load, arange=lambda lo, hi, layout=None: torch.arange(lo, hi),
                                BlockedLayout=lambda *args: None, to_tensor=_t, sum=lambda x, axis: torch.sum(x, axis),
                                int32=torch.int32, int64=torch.int64,
                                # _hw_runs_fill's
                                store=_store, zeros=lambda shape, dtype, layout=None: torch.zeros(shape, dtype=dtype),
                                # _hw_runs_order's
                                min=lambda x, axis: torch.amin(x, axis), atomic_cas=_atomic_cas)
RANGE_HELPERS = ("_hw_clamp", "_hw_fdiv", "_hw_search", "_hw_kv_segments", "_hw_blocks", "_hw_key_blocks",
                 "_hw_consumer_blocks", "_hw_visible")


def _helpers_on_cpu(module, names=RANGE_HELPERS):
    """The module's range helpers as Python functions over torch values (`gl` replaced)."""
    scope = {"gl": SHIM_GL, "_HW_ROWS": 64}
    for name in names:
        fn = getattr(module, name).fn
        scope[name] = types.FunctionType(fn.__code__, scope, name)
    return types.SimpleNamespace(**{name: scope[name] for name in names})


@pytest.mark.parametrize("mask, causal", [
    ({"sliding_window": {"left": 70, "right": 0}}, False),
    ({"sliding_window": {"left": 9, "right": 30, "align": "top_left"}}, False),
    ({"chunked": {"size": 100, "causal": False}}, False),
    ({"chunked": 150}, False),
    ({"prefix_lm": 90}, False),
    ({"and": [{"chunked": 96}, {"sliding_window": {"left": 40}}]}, True),
])
@pytest.mark.parametrize("seqlen_q, seqlen_k, block_m, block_n", [(300, 300, 128, 128), (129, 333, 64, 64),
                                                                  (333, 75, 128, 64)])
def test_block_ranges_hold_exactly_what_each_consumer_sees(mask, causal, seqlen_q, seqlen_k, block_m, block_n):
    spec = AttentionSpec(dtype="fp16", head_dim=64, mask=mask, causal=causal)
    module = flashgen.compile(spec, KernelConfig(**dict(HOPPER, BLOCK_M=block_m, BLOCK_N=block_n))).module()
    _check_block_ranges(spec, _helpers_on_cpu(module), seqlen_q, seqlen_k, block_m, block_n)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seqlen, block_m, block_n", [(300, 128, 128), (333, 128, 64), (129, 64, 64)])
def test_document_block_ranges_search_the_ids_themselves(causal, seqlen, block_m, block_n):
    # documents (ranges from the table _hw_fwd_ranges fills): the range helpers search the ids themselves
    # and read no runs table (None is passed for it: reading it would raise); random documents, some
    # shorter than a block, per batch element
    spec = AttentionSpec(dtype="fp16", head_dim=64, mask={"document": {"ids": "doc", "causal": causal}})
    module = flashgen.compile(spec, KernelConfig(**dict(HOPPER, BLOCK_M=block_m, BLOCK_N=block_n))).module()
    assert module._LAUNCHER.hopper_forward.ranges is module._hw_fwd_ranges
    gen = torch.Generator().manual_seed(seqlen + block_n + causal)
    ids = torch.stack([torch.sort(torch.randint(0, n, (seqlen,), generator=gen)).values for n in (3, 40)])
    ids = ids.to(torch.int32)
    params = (_Pointer(ids.flatten()), *ids.stride(), *ids.shape, None)
    for b in range(ids.shape[0]):
        _check_block_ranges(spec, _helpers_on_cpu(module), seqlen, seqlen, block_m, block_n, b, params, {"doc": ids})


@pytest.mark.parametrize("ids", [
    torch.tensor([[0] * 20 + [1] * 25 + [2] * 300, [0] * 200 + [4] * 145]),  # sorted rows, 3 chunks of 128
    torch.tensor([[3, 1, 2, 2, 0, 7, 7, 7, 1]]),  # an unsorted row: searchsorted's answers all the same
    torch.tensor([[0] * 130 + [1] * 130]).expand(1, 260),  # one row for the batch (rows=1 < batch)
    torch.tensor([[0, 0, 1, 1, 1, 2], [5, 6, 6, 6, 7, 7]]).t().contiguous().t(),  # column-major (strided rows)
    torch.tensor([[True] * 5 + [False] * 4]),
], ids=["sorted", "unsorted", "shared row", "strided", "bool"])
def test_the_range_kernel_fills_the_runs_table_as_runs_table(ids):
    # a training step's forward: _hw_fwd_ranges' FILL_RUNS programs fill the ids' runs table the backward's
    # kernels read (_hw_runs_fill), where host.runs_table's launch filled it: the same table, the work
    # spread over programs (tile, b) in 128-element chunks
    module = flashgen.compile(AttentionSpec(dtype="fp16", head_dim=64, mask=DOCS), KernelConfig(**HOPPER)).module()
    fill = _helpers_on_cpu(module, ("_hw_runs_fill",))._hw_runs_fill
    table = torch.full((2, *ids.shape), -1, dtype=torch.int32)
    storage = ids.as_strided((ids.untyped_storage().nbytes() // ids.element_size(),), (1,), 0)  # the pointer's
    tiles, batch = 2, 2
    for b in range(batch):
        for tile in range(tiles):
            fill(_Pointer(storage), *ids.stride(), *ids.shape, _Pointer(table.view(-1)), _t(b), tile * 128,
                 tiles * 128)
    assert torch.equal(table, runs_table(ids)), ids


@pytest.mark.parametrize("ids, decreases", [
    (torch.tensor([[0] * 20 + [1] * 25 + [2] * 300, [0] * 200 + [4] * 145]), False),
    (torch.tensor([[0] * 20 + [1] * 290 + [0] + [1] * 34, [5] * 345]), True),  # a decrease at column 310
    (torch.tensor([[-7, -7, -3, -3, 2**40, 2**40]]), False),  # negative and past 32 bits
    (torch.tensor([[3, 1, 2, 2, 0, 7, 7, 7, 1]]), True),
    (torch.tensor([[0] * 130 + [1] * 130]).expand(1, 260), False),  # one row for the batch (rows=1 < batch)
    (torch.tensor([[0, 0, 1, 1, 0, 2], [5, 6, 6, 6, 7, 7]]).t().contiguous().t(), True),  # column-major rows
    (torch.tensor([[0, 0, 255, 255, 254]], dtype=torch.uint8), True),  # unsigned: 255 then 254
    (torch.tensor([[False] * 4 + [True] * 5]), False),
    (torch.tensor([[True] * 5 + [False] * 4]), True),
], ids=["sorted", "decrease in the second chunk", "wide", "unsorted", "shared row", "strided", "uint8", "bool",
        "bool, decreasing"])
def test_the_range_kernel_records_ids_that_decrease(ids, decreases):
    # every forward's range kernel (_hw_fwd_ranges) checks the ids its programs (tile, b) cover in 128-element
    # chunks (_hw_runs_order): a decrease claims the bounds record with its tensor's id, row, column and the
    # pair of values; sorted rows leave it empty
    from flashgen.runtime.host import RUNS_ORDER, runs_check_id

    module = flashgen.compile(AttentionSpec(dtype="fp16", head_dim=64, mask=DOCS), KernelConfig(**HOPPER)).module()
    order = _helpers_on_cpu(module, ("_hw_runs_order",))._hw_runs_order
    record = torch.zeros(5, dtype=torch.int64)
    storage = ids.as_strided((ids.untyped_storage().nbytes() // ids.element_size(),), (1,), 0)  # the pointer's
    tiles, batch, check = 2, 2, runs_check_id("doc")
    for b in range(batch):
        for tile in range(tiles):
            order(_Pointer(storage), *ids.stride(), *ids.shape, _Pointer(record), check, _t(b), tile * 128,
                  tiles * 128)
    kind, where, column, value, before = record.tolist()
    if not decreases:
        assert kind == 0, record
        return
    row, rows = where & 0xFFFFFFFF, ids.to(torch.int64)
    assert (kind, where >> 32) == (RUNS_ORDER, check) and 0 < column < ids.shape[1], record
    assert (value, before) == (rows[row, column].item(), rows[row, column - 1].item()) and value < before


def _check_block_ranges(spec, hw, seqlen_q, seqlen_k, block_m, block_n, b=0, params=(), tensors=None):
    """The range helpers hw (_helpers_on_cpu) of batch element b (params: the named tensors' arguments)
    against the spec's visibility, evaluated by the reference (tensors: the named tensors)."""
    rows, cols = torch.arange(seqlen_q)[:, None], torch.arange(seqlen_k)[None, :]
    env = {"b": b, "h": 0, "q_idx": rows, "kv_idx": cols, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k}
    visible = torch.as_tensor(evaluate(plan_for(spec).predicate, env, tensors or {})).broadcast_to(seqlen_q, seqlen_k)
    # the kernel's elementwise predicate (boundary blocks) is the reference's
    assert torch.equal(hw._hw_visible(rows, cols, b, 0, seqlen_q, seqlen_k, *params), visible)
    n_key_blocks = -(-seqlen_k // block_n)
    block_of = torch.arange(seqlen_k) // block_n
    for start_m in range(0, seqlen_q, block_m):
        first, _, _, end = (int(x) for x in hw._hw_key_blocks(start_m, min(start_m + block_m, seqlen_q) - 1, b, 0,
                                                               seqlen_q, seqlen_k, block_n, *params))
        n_blocks = end - first
        tile = visible[start_m:start_m + block_m].any(0)
        seen = set(block_of[tile].tolist())
        # the producer loads the blocks some row of the tile sees, and no block past them
        assert seen <= set(range(first, end)) and 0 <= first <= end and (first == end or end <= n_key_blocks)
        assert not seen or (first in seen and end - 1 in seen)
        for row0 in range(start_m, start_m + block_m, 64):
            start, full_lo, full_hi, stop = (int(x) for x in hw._hw_consumer_blocks(
                row0, first, n_blocks, b, 0, seqlen_q, seqlen_k, block_n, *params))
            own = visible[row0:row0 + 64]  # its rows before seqlen_q
            assert 0 <= start <= stop <= n_blocks and (row0 < seqlen_q or start == stop)
            assert set(block_of[own.any(0)].tolist()) <= set(range(first + start, first + stop))
            # whole blocks (no mask arithmetic; ping-pong runs every position): every row sees every key
            for j in range(max(full_lo, 0), min(full_hi, n_blocks)):
                keys = slice((first + j) * block_n, (first + j + 1) * block_n)
                assert (first + j + 1) * block_n <= seqlen_k and bool(own[:, keys].all()), (row0, j)


@pytest.mark.parametrize("mask, causal", [
    ({"sliding_window": {"left": 70, "right": 0}}, False),
    ({"sliding_window": {"left": 9, "right": 30, "align": "top_left"}}, False),
    ({"chunked": {"size": 100, "causal": False}}, False),
    ({"prefix_lm": 90}, True),
    ({"and": [{"chunked": 96}, {"sliding_window": {"left": 40}}]}, True),
])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(300, 300), (129, 333), (333, 75)])
def test_query_block_ranges_hold_exactly_what_each_key_block_is_seen_by(mask, causal, seqlen_q, seqlen_k):
    # the Gluon dK/dV kernel (hopper_bwd): a program of 128 keys walks the query blocks [first, end), each
    # of its consumers (64 keys) runs [full_lo, full_hi) without mask arithmetic
    spec = AttentionSpec(dtype="fp16", head_dim=64, mask=mask, causal=causal, backward=True)
    module = flashgen.compile(spec, KernelConfig(hopper_bwd=True)).module()
    names = ("_hw_clamp", "_hw_fdiv", "_hw_q_segments", "_hw_blocks", "_hw_query_blocks")
    hw = _helpers_on_cpu(module, names)
    rows, cols = torch.arange(seqlen_q)[:, None], torch.arange(seqlen_k)[None, :]
    env = {"b": 0, "h": 0, "q_idx": rows, "kv_idx": cols, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k}
    visible = torch.as_tensor(evaluate(plan_for(spec).predicate, env, {})).broadcast_to(seqlen_q, seqlen_k)
    for block_m in (64, 128):
        block_of = torch.arange(seqlen_q) // block_m
        for start_n in range(0, seqlen_k, 128):
            first, _, _, end = (int(x) for x in hw._hw_query_blocks(start_n, min(start_n + 128, seqlen_k) - 1, 0, 0,
                                                                     seqlen_q, seqlen_k, block_m))
            seen = set(block_of[visible[:, start_n:start_n + 128].any(1)].tolist())
            assert seen <= set(range(first, end)) and 0 <= first <= end <= -(-seqlen_q // block_m)
            assert not seen or (first in seen and end - 1 in seen)
            for key0 in range(start_n, min(start_n + 128, seqlen_k), 64):
                _, full_lo, full_hi, _ = (int(x) for x in hw._hw_query_blocks(
                    key0, min(key0 + 64, seqlen_k) - 1, 0, 0, seqlen_q, seqlen_k, block_m))
                if key0 + 64 > seqlen_k:  # the kernel's rule: a consumer reaching past seqlen_k masks every block
                    full_hi = full_lo
                for blk in range(full_lo, full_hi):
                    tile = visible[blk * block_m:(blk + 1) * block_m, key0:key0 + 64]
                    assert (blk + 1) * block_m <= seqlen_q and bool(tile.all()), (key0, blk)


def test_a_standalone_masked_module_imports_and_falls_back(tmp_path, device):
    # `flashgen generate` files need only torch and triton: the masked Gluon kernel and hopper.py's
    # mask rule come pasted in; on the CPU the call runs the portable forward, with the same tensors
    # (on an sm90 GPU the Gluon forward itself)
    from flashgen.verify import assert_attention_close

    from .test_hopper_ws import standalone_module

    spec = AttentionSpec(dtype="fp16", head_dim=64, num_heads=4, num_kv_heads=2, mask=DOCS)
    module = standalone_module(spec, KernelConfig(**dict(HOPPER, BLOCK_M=64, BLOCK_N=64)),
                               tmp_path / "standalone_hopper_masks.py")
    assert module._LAUNCHER.hopper_forward.spec_reason is None and hasattr(module, "_hw_visible")
    q, k, v = make_qkv(1, 4, 2, 40, 40, 64, dtype=torch.float16, device=device)
    doc = torch.tensor([[0] * 7 + [1] * 30 + [2] * 3], dtype=torch.int32, device=device)
    out, lse = module.forward(q, k, v, tensors={"doc": doc})
    assert_attention_close(out, lse, q, k, v, causal=False, mask=DOCS, tensors={"doc": doc})
