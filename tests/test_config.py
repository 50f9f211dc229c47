"""The heuristic defaults read the mask's shape and the sequence-length bucket (issue 15), and
reach every path that runs without a tuned result: flashgen.compile / flashgen.attention (per
call length), flashgen.load's fallback and the tuner's per-bucket baseline."""

import pytest
import torch

import flashgen
from flashgen import AttentionSpec, KernelConfig, default_config
from flashgen import api, ops, tuner
from flashgen.config import DEFAULT_BUCKETS, SMALL_CALL, MaskShape, default_configs, mask_shape
from flashgen.space import DeviceLimits, backward_space


def _spec(**fields):
    fields.setdefault("head_dim", 128)
    return AttentionSpec(dtype="bf16", num_heads=16, backward=True, target="h100", **fields)


WINDOW = lambda left, right=0: {"sliding_window": {"left": left, "right": right}}  # noqa: E731


@pytest.mark.parametrize("fields,shape", [
    ({}, MaskShape()),
    ({"causal": True}, MaskShape(causal=True)),
    ({"mask": WINDOW(256)}, MaskShape(257, causal=True)),
    ({"mask": WINDOW(3, 4)}, MaskShape(8)),
    ({"mask": WINDOW(-1, 0)}, MaskShape(causal=True)),  # unbounded on the left: no band
    ({"mask": {"chunked": {"size": 1024, "causal": False}}}, MaskShape(1024)),
    ({"mask": {"sink": {"tokens": 4, "window": 1024}}}, MaskShape(1029, causal=True)),
    ({"mask": {"prefix_lm": 512}}, MaskShape(causal=True)),
    ({"mask": {"document": {}}}, MaskShape(causal=True, documents=True)),
    ({"causal": True, "mask": {"chunked": 64}}, MaskShape(64, causal=True)),  # and: the narrowest band
    ({"mask": {"or": [WINDOW(2, 0), WINDOW(0, 2)]}}, MaskShape(6)),  # or: at most the sum, causal only if all are
    ({"mask": {"or": [WINDOW(2, 0), {"prefix_lm": 3}]}}, MaskShape(causal=True)),  # an unbounded part: no band
    ({"mask": "(q_idx - kv_idx) % 4 == 0"}, MaskShape(custom=True)),
])
def test_mask_shape_reads_the_pattern_parameters(fields, shape):
    assert mask_shape(_spec(**fields)) == shape


def test_defaults_per_bucket_follow_the_mask_shape_on_sm90():
    def fwd(fields, seqlen):  # the portable family's default (under the Gluon family's, where that serves)
        c = default_config(_spec(**fields), seqlen=seqlen, hopper_ws=False)
        return c.BLOCK_M, c.BLOCK_N, c.num_warps, c.tma, c.warp_specialize

    long = (128, 128, 8, True, True)  # the plain and long-causal default (hopper_knobs.md)
    # narrow bands: small query tiles (the sweep's best per band width), at every length they are narrow in
    for s in (4096, 16384):
        assert fwd({"mask": WINDOW(128)}, s) == (64, 32, 4, False, False)
        assert fwd({"mask": WINDOW(256)}, s) == fwd({"mask": {"chunked": 1024}}, s) == (64, 64, 4, True, False)
    assert fwd({"mask": WINDOW(4096)}, 16384) == long  # a wide band is a long triangle's business
    assert fwd({"mask": WINDOW(1024)}, 1024) == (64, 64, 4, True, False)  # not narrow at 1024, but short causal
    # documents: 64x64 with descriptors at every length; short causal: 64x64; plain and long causal keep
    # the old default
    assert fwd({"mask": {"document": {}}}, 4096) == fwd({"mask": {"document": {}}}, 16384) == (64, 64, 4, True, False)
    # causal hd128 at 1024: the Gluon family's persistent grid (tests/test_hopper_ws.py)
    assert default_config(_spec(causal=True), seqlen=1024).hopper_persistent
    for s in DEFAULT_BUCKETS:
        if s <= SMALL_CALL:  # host-bound calls: no descriptors
            assert fwd({}, s) == (*long[:3], False, True)
            continue
        # plain hd128 and causal hd128 at 4096+: the Gluon family (config._hopper_ws_default); so are
        # masks at 4096+ (config._hopper_ws_masked_default) but windows of up to 192 keys
        assert default_config(_spec(), seqlen=s).family == "hopper_ws"
        masked = {name: default_config(_spec(mask=mask), seqlen=s) for name, mask in (
            ("prefix", {"prefix_lm": 512}), ("documents", {"document": {}}), ("chunks", {"chunked": 1024}),
            ("window 256", WINDOW(256)), ("window 128", WINDOW(128)))}
        assert {name for name, c in masked.items() if c.family == "hopper_ws"} == (
            {"prefix", "documents", "chunks", "window 256"} if s >= 4096 else set()), s
        if s >= 4096:
            assert default_config(_spec(causal=True), seqlen=s).family == "hopper_ws"
    hd64 = default_config(_spec(head_dim=64, causal=True), seqlen=1024)
    assert (hd64.BLOCK_M, hd64.BLOCK_N, hd64.num_warps, hd64.tma) == (64, 64, 4, False)


def test_h200_causal_hd64_at_1024_2048_tokens_takes_hd128s_gluon_knobs():
    # config._hopper_ws_default's last paragraph (H200 runs only): hd64 causal in the 2048 bucket, and head dims
    # padded to 64 causal in the 1024 and 2048 buckets, take hd128's Gluon knobs; the H100 keeps the portable
    # forward there, and every other bucket's and spec's forward is the same on both
    gluon = ("hopper_ws", 128, 128, True, True, True)
    for fields, buckets in (({"head_dim": 64}, (2048,)), ({"head_dim": 64, "num_kv_heads": 4}, (2048,)),
                            ({"head_dim": 40}, (1024, 2048)), ({"head_dim": 56, "num_kv_heads": 8}, (1024, 2048)),
                            ({"head_dim": 64, "causal": False}, ()), ({"head_dim": 128}, ())):
        spec = _spec(**{"causal": True, **fields})
        for s in DEFAULT_BUCKETS:
            h200, h100 = default_config(spec, "h200", seqlen=s), default_config(spec, "h100", seqlen=s)
            if s in buckets:
                assert (h200.family, h200.BLOCK_M, h200.BLOCK_N, h200.hopper_persistent, h200.hopper_overlap,
                        h200.hopper_tma_store) == gluon, (fields, s)
                assert h100.family == "portable", (fields, s)
                assert h200.replace(**{k: getattr(h100, k) for k in FORWARD_KNOBS}) == h100  # the backward's the same
            else:  # (hd128's backward has an H200 rule of its own: config._hopper_bwd_default)
                assert all(getattr(h200, k) == getattr(h100, k) for k in FORWARD_KNOBS), (fields, s)


FORWARD_KNOBS = ("family", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "tma", "warp_specialize", "hopper_regs",
                 "hopper_overlap", "hopper_pingpong", "hopper_persistent", "hopper_tma_store")


def test_backward_defaults():
    # hd128: tensor descriptors for every mask shape; hd64 masked keeps pointer loads; the persistent
    # dK/dV grid is no default (it lost every case of the sweep), and atomic dQ only in the Gluon dK/dV
    # kernel, unmasked at hd128 from 1024 tokens (causal from 2048; on an H200 from 1024 too)
    # (config._hopper_bwd_default)
    for target in ("h100", "h200"):
        for fields in ({}, {"causal": True}, {"mask": WINDOW(256)}, {"mask": {"document": {}}}):
            for s in DEFAULT_BUCKETS:
                c = default_config(_spec(**fields), target, seqlen=s)
                if "document" in fields.get("mask", {}) and s <= 4096:
                    continue  # 32x64 dK/dV tiles there (tests/test_banded_backward.py: the fused-delta defaults)
                assert (c.BLOCK_M1, c.BLOCK_N1, c.bwd_num_stages, c.bwd_tma) == (64, 64, 2, s > SMALL_CALL)
                causal_from = 2048 if target == "h100" else 1024
                gluon_atomic = "mask" not in fields and s >= (causal_from if "causal" in fields else 1024)
                assert c.bwd_persistent == 0 and c.dq_strategy == ("atomic" if gluon_atomic else "separate")
                documents = "document" in fields.get("mask", {}) and s >= 16384  # with the separate dQ kernel
                assert c.hopper_bwd == (gluon_atomic or documents), (target, fields, s)
    # the H200's rule is hd128's, without GQA or a mask: hd64 and GQA keep the H100's choice
    for fields in ({"head_dim": 64, "causal": True}, {"num_kv_heads": 4, "causal": True}):
        assert default_config(_spec(**fields), "h200", seqlen=1024) == default_config(_spec(**fields), "h100",
                                                                                       seqlen=1024)
    assert not default_config(_spec(head_dim=64, causal=True)).bwd_tma
    assert default_config(_spec(head_dim=64)).bwd_tma


def test_head_dim_256_backward_defaults():
    # sm90, 16-bit, head dims past 128 (padded to 256): dK/dV 64 x 64 on 8 warps, dQ 128 x 32, 2 stages,
    # descriptors past the short calls (H200: results/2026-11-29-h200-bwd-defaults-hd256-s36*.md, 2.7-3.8x the
    # 16 x 32 tiles); fp32 and other GPU families keep those 16 x 32 tiles (not measured there)
    for target in ("h100", "h200"):
        for fields in ({}, {"causal": True}, {"num_kv_heads": 2, "causal": True}, {"mask": WINDOW(256)},
                       {"dtype": "fp16"}, {"head_dim": 192}, {"head_dim": 160, "causal": True}):
            for s in DEFAULT_BUCKETS:
                c = default_config(_spec(head_dim=256).replace(**fields), target, seqlen=s)
                assert (c.BLOCK_M1, c.BLOCK_N1, c.BLOCK_M2, c.BLOCK_N2, c.bwd_num_warps, c.bwd_num_stages) == \
                    (64, 64, 128, 32, 8, 2), (target, fields, s)
                assert c.bwd_tma == (s > SMALL_CALL) and not c.hopper_bwd and not c.bwd_short, (target, fields, s)
    for fields in ({"dtype": "fp32", "target": "h100"}, {"target": "a100"}, {"target": "l40s"}):
        c = default_config(_spec(head_dim=256).replace(**fields), seqlen=4096)
        assert (c.BLOCK_M1, c.BLOCK_N1, c.BLOCK_M2, c.BLOCK_N2, c.bwd_num_warps, c.bwd_num_stages) == \
            (16, 32, 32, 16, 4, 1), fields
    # the tuner's space holds the default and refuses its neighbours past sm90's shared memory (dK/dV at 3
    # stages: 264192 bytes compiled; adding dQ at 2 stages: 263168), not the adding kernel at 1 stage (132096)
    space = backward_space(_spec(head_dim=256, causal=True), DeviceLimits("H100", 232448, hopper=True))
    point = {k: v for k, v in default_config(_spec(head_dim=256), "h100", seqlen=4096).to_dict().items()
             if k in space.params}
    assert space.violations(point) == []
    for bad in (dict(bwd_num_stages=3), dict(dq_strategy="atomic")):
        assert any(v.startswith("smem") for v in space.violations(dict(point, **bad))), bad
    assert space.violations(dict(point, dq_strategy="atomic", bwd_num_stages=1)) == []


def test_defaults_elsewhere_do_not_read_the_mask():
    # fp32, other GPU families and the interpreter have no mask measurements: one config per spec
    for fields in ({"dtype": "fp32"}, {"target": "a100"}, {"target": "cpu"}):
        spec = _spec(mask=WINDOW(128)).replace(**fields)
        plain = _spec().replace(**fields)
        assert len(set(default_configs(spec).values())) == 1
        assert default_configs(spec)[4096] == default_configs(plain)[4096]


def test_default_configs_cover_the_buckets():
    spec = _spec(mask={"document": {}})
    configs = default_configs(spec)
    assert tuple(configs) == DEFAULT_BUCKETS
    assert all(configs[b] == default_config(spec, seqlen=b) for b in DEFAULT_BUCKETS)
    assert default_config(spec) == configs[4096]  # without a length: the typical bucket


# ----------------------------------------------------------------------------- where the defaults are used
def test_compiled_kernel_runs_the_default_of_each_call_length():
    spec = _spec(mask={"document": {}})
    kernel = flashgen.compile(spec)
    assert kernel.bucket_configs == default_configs(spec) and kernel.config_source == "default"
    for seqlen, bucket in ((100, 256), (600, 1024), (3000, 4096), (5000, 4096), (12000, 16384), (10**6, 65536)):
        assert kernel.config_for(seqlen) == default_config(spec, seqlen=bucket)
        assert ops.kernel_spec(kernel._kernel_id_for(None, seqlen))[1] == default_config(spec, seqlen=bucket)
    # a given config is used at every length
    given = KernelConfig(BLOCK_M=32)
    kernel = flashgen.compile(spec, given)
    assert kernel.bucket_configs == {} and kernel.config_for(3000) == given


def test_one_off_call_without_tuned_results_binds_the_bucket_defaults(monkeypatch):
    monkeypatch.setattr("flashgen.loader.lookup", lambda spec: ({}, "default"))
    spec = _spec(mask=WINDOW(128))
    kernel = api._tuned_kernel(spec, None)
    assert kernel.bucket_configs == default_configs(spec)
    assert kernel.config_for(16384).BLOCK_N == 32


def test_load_without_tuned_results_falls_back_to_the_bucket_defaults(tmp_path):
    spec = _spec(mask=WINDOW(128), name="not-tuned-anywhere")
    with pytest.warns(UserWarning, match="no tuned config"):
        kernel = flashgen.load(spec, db=f"sqlite:///{tmp_path / 'none.sqlite'}")
    assert kernel.config_source == "default" and kernel.bucket_configs == default_configs(spec)


def test_tuner_starts_each_bucket_from_that_buckets_default(monkeypatch, tmp_path):
    seen = []

    def phase(spec, runner, store, options, bucket, phase, base, work):
        seen.append((bucket, phase, base))
        return tuner.BucketResult(bucket, phase, None, None, 0, {})

    class Runner:
        interpret = False

        def workload(self, spec, bucket, tokens):
            return None

    monkeypatch.setattr(tuner, "_tune_phase", phase)
    spec = _spec(mask={"document": {}}, tune={"seqlens": [2048, 16384]})
    tuner.tune(spec, Runner(), store=None)
    assert [(b, p) for b, p, _ in seen] == [(2048, "fwd"), (2048, "bwd"), (16384, "fwd"), (16384, "bwd")]
    assert all(base == default_config(spec, seqlen=b) for b, _, base in seen)
    assert seen[0][2] != seen[2][2]


def test_tuner_space_has_the_persistent_grid_within_one_sms_resources():
    h100 = DeviceLimits("H100", 232448, hopper=True)
    space = backward_space(_spec(), h100)
    assert space.params["bwd_persistent"] == (0, 1, 2)
    point = dict(BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64, bwd_num_warps=4, bwd_num_stages=2,
                 dq_strategy="separate", bwd_tma=True)
    assert space.violations(dict(point, bwd_persistent=2)) == []
    # two 8-warp programs of 64x128 dK/dV tiles need ~2 x 8 x 32 x 255 registers: more than an SM has
    big = dict(point, BLOCK_N1=128, BLOCK_M2=128, bwd_num_warps=8, bwd_num_stages=3)
    assert space.violations(dict(big, bwd_persistent=1)) == []
    assert any("bwd_persistent" in v for v in space.violations(dict(big, bwd_persistent=2)))
    assert {p["bwd_persistent"] for p in space.points()} == {0, 1, 2}


# ----------------------------------------------------------------------------- on the GPU: every new default is exact
@pytest.mark.gpu
@pytest.mark.parametrize("fields,seqlen,head_dim", [
    ({"mask": WINDOW(128)}, 4096, 128),  # 64x32 forward
    ({"mask": WINDOW(256)}, 16384, 128),  # 64x64 with tensor descriptors, TMA backward
    ({"mask": {"document": {}}}, 4096, 128),
    ({"mask": {"document": {}}}, 16384, 128),  # 64x64 with descriptors, its boundary loop at 2 stages
    ({"causal": True}, 1024, 128),
    ({"causal": True}, 1024, 64),
    ({"causal": True}, 2048, 64),  # on an H200 hd128's Gluon knobs (config._hopper_ws_default), else portable
    ({"causal": True}, 1024, 40),  # the same, padded to 64
], ids=["window-128", "window-256", "documents-4096", "documents-16384", "causal-1024", "causal-1024-hd64",
        "causal-2048-hd64", "causal-1024-hd40"])
def test_gpu_bucket_defaults_match_reference_bf16(fields, seqlen, head_dim):
    from .test_masks import _doc_ids, check_variant

    spec = AttentionSpec(dtype="bf16", head_dim=head_dim, num_heads=8, num_kv_heads=2, backward=True, **fields)
    tensors = {"document_ids": torch.stack([_doc_ids([100, 700, 1, 699]), _doc_ids([1500])])} \
        if "mask" in fields and "document" in fields["mask"] else {}
    config = default_config(spec, seqlen=seqlen)
    check_variant("cuda", **fields, tensors=tensors, sq=1500, sk=1500, dtype="bf16", heads=(8, 2), d=head_dim,
                  config=config, dq_strategy=config.dq_strategy, loop_order=config.loop_order)


@pytest.mark.parametrize("knobs", [dict(BLOCK_N=16.0), dict(num_warps=4.0), dict(bwd_persistent=1.0),
                                   dict(num_stages=2.0), dict(hopper_regs=240.0)])
def test_a_float_knob_equal_to_an_allowed_int_is_refused(knobs):
    # 16.0 == 16 passed the membership test, then reached the kernels as a float
    name = next(iter(knobs))
    with pytest.raises(ValueError, match=f"^config knob '{name}': expected"):
        KernelConfig(**knobs)


@pytest.mark.parametrize("data", [None, [1], "BLOCK_M"], ids=["none", "list", "str"])
def test_a_config_that_is_not_a_mapping_is_refused_by_name(data):
    from flashgen.config import ConfigError
    with pytest.raises(ConfigError, match="^config: expected a mapping of knob names to values, got "):
        KernelConfig.from_dict(data)


@pytest.mark.parametrize("variant", [{"mask": {"expr": "attn_mask[b, h, q_idx, kv_idx] != 0"}},
                                     {"score_mod": {"expr": "score + bias[q_idx, kv_idx]"}}], ids=["bool mask", "bias"])
@pytest.mark.parametrize("seqlen", [128, 2048, 16384])
def test_sm90_tiles_of_a_tensor_read_by_query_and_key_leave_shared_memory(variant, seqlen):
    # each block loads a (BLOCK_M, BLOCK_N) tile of the tensor beside K and V, staged: 128 x 128 at 3 stages asked
    # 256 KiB of shared memory at hd128 (tests/test_sdpa.py's GPU test; the sm90 compile measured 128 x 64 at 160)
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=16, backward=True, **variant)
    cfg = default_config(spec, "h100", seqlen)
    assert cfg.BLOCK_M * cfg.BLOCK_N * cfg.num_stages <= 128 * 64 * 3
    plain = default_config(AttentionSpec(dtype="bf16", head_dim=128, num_heads=16, backward=True), "h100", seqlen)
    assert plain.family == "hopper_ws" or plain.BLOCK_N == 128  # (an unmasked spec keeps its own)
