"""Decode's split count (and tiles) as tuner knobs: a tiny decode spec tuned end to end through
the interpreter runner, its best configs stored per (KV length, batch) bucket as phase
dec<batch>, then served by flashgen.decode and flash_attn_with_kvcache."""

import pytest
import torch

import flashgen
from flashgen import AttentionSpec, kvcache
from flashgen.db import EnvInfo, ResultStore
from flashgen.db.rows import ResultRowError, check_best
from flashgen.decode_space import DecodeConfig, decode_space, phase_batch, tuned_lookup
from flashgen.space import DeviceLimits
from flashgen.tuner import InterpretRunner, TuneOptions, tune

from flashgen.verify import compare

from .test_decode import Cache, _seeded, reference_decode

needs_interpreter = pytest.mark.interpreter  # an interpreter-runner test


def test_decode_phases_and_configs_are_checked():
    assert phase_batch("dec8") == 8 and phase_batch("dec1") == 1
    assert phase_batch("dec6") is None and phase_batch("dec08") is None and phase_batch("fwd") is None
    row = dict(bucket=4096, phase="dec8", config=DecodeConfig(num_splits=5).to_dict(), ms=0.1, tflops=1.0)
    check_best(row)
    with pytest.raises(ResultRowError, match="field 'config': decode config knob 'num_splits'"):
        check_best(dict(row, config=dict(row["config"], num_splits=0)))
    with pytest.raises(ResultRowError, match="field 'phase'"):
        check_best(dict(row, phase="dec3"))
    with pytest.raises(ResultRowError, match="decode config knob 'BLOCK_M': unknown"):
        check_best(dict(row, config=dict(row["config"], BLOCK_M=64)))


def test_decode_space_fits_shared_memory_and_holds_the_default():
    spec = AttentionSpec(dtype="bf16", head_dim=128, num_heads=32, num_kv_heads=8)
    space = decode_space(spec, DeviceLimits("small", 101376), DecodeConfig(num_splits=13))
    assert 13 in space.params["num_splits"]
    points = list(space.points())
    assert points and all(2 * p["num_stages"] * p["BLOCK_N"] * 256 <= 101376 for p in points)
    assert any(p["BLOCK_N"] == 128 for p in decode_space(spec, DeviceLimits("H100", 232448)).points())


def test_lookup_serves_only_the_calls_own_bucket():
    rows = {4096: {"dec8": {"config": DecodeConfig(num_splits=2).to_dict()},
                   "dec64": {"config": DecodeConfig(num_splits=1).to_dict()}, "fwd": {"config": {}}},
            131072: {"dec1": {"config": DecodeConfig(num_splits=16).to_dict()},
                     "dec2": {"config": {"num_splits": "bad"}}}}
    lookup = tuned_lookup(rows)
    assert lookup(8, 5000)["num_splits"] == 2 and lookup(48, 4096)["num_splits"] == 1
    assert lookup(1, 131072)["num_splits"] == 16
    # Untuned buckets get None (the heuristic): a split count tuned for 8 x 4K keys is not run at
    # 1 x 8K or 8 x 128K (the H100's native call ran B=1 x 128K keys on B=8's 2 splits: 5.5x slower).
    assert lookup(1, 8192) is None and lookup(8, 131072) is None and lookup(16, 4096) is None
    assert lookup(2, 131072) is None  # the malformed dec2 row is skipped
    assert tuned_lookup({1024: {"fwd": {"config": {}}}}) is None


class SimulatedRunner(InterpretRunner):
    """Runs every trial (verified through the interpreter) but reports a simulated time, so
    the winner is known: the bucket's target split count is fastest (the interpreter's wall
    time says nothing of a GPU)."""

    TARGET = {32: 2, 256: 3}

    def time_decode(self, kernel, config, work):
        super().time_decode(kernel, config, work)
        return 1.0 + abs(config.num_splits - self.TARGET[work.bucket])


@needs_interpreter
def test_tuned_split_counts_are_stored_per_bucket_and_served(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'results.sqlite'}"
    monkeypatch.setenv("FLASHGEN_DB", url)
    spec = AttentionSpec(name="tiny-decode", dtype="fp16", head_dim=16, num_heads=4, num_kv_heads=2, causal=True,
                         backward=False, tune={"trials": 6, "decode": {"kv_lengths": [40, 300], "batches": [2]}})
    store = ResultStore(url)
    results = tune(spec, SimulatedRunner(), store, TuneOptions(phases=("decode",), sampler="grid"))
    assert [(r.bucket, r.phase) for r in results] == [(32, "dec2"), (256, "dec2")]
    best = store.best_configs(EnvInfo.current(interpret=True), spec)
    assert {b: rows["dec2"]["config"]["num_splits"] for b, rows in best.items()} == {32: 2, 256: 3}
    assert "fwd" not in best[32]  # decode only: prefill was not tuned

    kvcache.reload_tuned()
    seed, gen = _seeded()
    for capacity, splits in ((40, 2), (300, 3)):
        cache = Cache(gen, 2, 2, 16, (capacity - 3, 5), capacity, torch.float16, "cpu")
        q = torch.randn(2, 1, 4, 16, generator=gen).half()
        out = flashgen.decode(spec, q, cache.k_cache, cache.v_cache, cache.cache_seqlens)
        launcher = kvcache.decode_launcher(flashgen.compile(spec))
        assert launcher.tuned_source == "database"
        plan = next(call.plan for call in launcher.calls.values() if call.capacity == capacity)
        assert plan["tuned"] and plan["splits"] == splits, plan
        out_ref, _, out_pt, _ = reference_decode(q, cache, causal=True)
        assert compare("out", out, out_ref, out_pt).ok, f"seed={seed}"
    # a call that sets a knob itself runs what it asks for
    flashgen.decode(spec, q, cache.k_cache, cache.v_cache, cache.cache_seqlens, num_splits=1)
    assert any(not call.plan["tuned"] and call.plan["splits"] == 1 for call in launcher.calls.values())
    kvcache.reload_tuned()


def test_an_unreadable_database_falls_back_with_the_loaders_one_warning(tmp_path):
    # the decode lookup fell back in silence where flashgen.load warns (and opened the database once per
    # candidate spec: a locked one waited its 5 s twice)
    import warnings

    from flashgen import loader

    spec = AttentionSpec(name="tiny-decode-broken", dtype="fp16", head_dim=16, num_heads=4, num_kv_heads=2,
                         causal=True, backward=False)
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"not a database" * 100)
    loader._warned.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert kvcache.tuned_decode(spec, f"sqlite:///{garbage}") == (None, "default")
            assert kvcache.tuned_decode(spec, f"sqlite:///{tmp_path / 'none.sqlite'}") == (None, "default")
        said = [str(w.message) for w in caught if issubclass(w.category, flashgen.FlashgenFallbackWarning)]
        assert len(said) == 1 and f"cannot read tuning results from sqlite:///{garbage}" in said[0], said
        assert "flashgen db check" in said[0]
    finally:
        loader._warned.clear()
