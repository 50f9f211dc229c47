"""The tuner through the interpreter runner: spaces and restrictions, typed failures, an
injected wrong kernel never chosen, crash safety and resume, and the CLI end to end."""

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jinja2
import pytest
import torch
import triton
from click.testing import CliRunner
from triton.runtime.errors import OutOfResources

import flashgen
from flashgen import AttentionSpec, KernelConfig
from flashgen.cli import main
from flashgen.config import ConfigError
from flashgen.db import EnvInfo, ResultStore, config_key
from flashgen.failures import STATUSES
from flashgen.flops import pairs_flops, tflops, visible_count
from flashgen.inputs import named_tensors
from flashgen.runtime.host import nearest_bucket
from flashgen.space import DeviceLimits, backward_space, bucket_of, forward_space
import flashgen.tuner
from flashgen.tuner import InterpretRunner, TuneOptions, candidate, tune

from .helpers import child_pythonpath, drop_all_tables

ROOT = Path(__file__).resolve().parent.parent
# Tests that tune through the interpreter runner need a process whose kernels are interpreted
# (conftest sets TRITON_INTERPRET where there is no GPU); on a GPU the GpuRunner is exercised by
# `flashgen tune` itself (benchmarks/results/tuning).
needs_interpreter = pytest.mark.interpreter  # an interpreter-runner test
SPEC = AttentionSpec(name="tiny", dtype="fp32", head_dim=16, num_heads=2, num_kv_heads=1, causal=True,
                     backward=True, tune={"seqlens": [64], "trials": 5})


@pytest.fixture
def store(tmp_path):
    return ResultStore(f"sqlite:///{tmp_path / 'results.sqlite'}")


# ------------------------------------------------------------------------------ spaces
def test_space_restrictions_reject_before_compiling():
    h100 = DeviceLimits("H100", 232448)
    spec = AttentionSpec(dtype="bf16", head_dim=128)
    space = forward_space(spec, h100)
    big = dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=4, loop_order="q_outer")
    assert any("registers" in v for v in space.violations(big))  # 128x128 fp32 acc on 4 warps
    assert any("smem" in v for v in space.violations(big))
    ok = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, loop_order="q_outer")
    assert space.violations(ok) == []
    assert space.violations(dict(ok, loop_order="kv_outer")) == ["loop_order == 'q_outer' or num_stages <= 2"]
    points = list(space.points())
    assert ok in points and big not in points and len(points) < space.size()
    small_gpu = forward_space(spec, DeviceLimits("small", 101376))
    assert len(list(small_gpu.points())) < len(points)  # the device's shared memory limit bites
    bwd = backward_space(spec.replace(head_dim=256), h100)
    assert any("registers" in v for v in bwd.violations(dict(BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64,
                                                             bwd_num_warps=4, bwd_num_stages=3,
                                                             dq_strategy="separate")))


def test_hopper_knobs_only_where_they_apply():
    spec = AttentionSpec(dtype="bf16", head_dim=64)
    h100 = DeviceLimits("H100", 232448, hopper=True)
    points = list(forward_space(spec, h100).points())
    assert {(p["tma"], p["warp_specialize"]) for p in points} == {(False, False), (True, False), (False, True),
                                                                  (True, True)}
    assert all(p["num_warps"] >= 8 for p in points if p["warp_specialize"])
    assert all(p["loop_order"] == "q_outer" for p in points if p["tma"] or p["warp_specialize"])
    assert {p["bwd_tma"] for p in backward_space(spec, h100).points()} == {False, True}
    a100 = DeviceLimits("A100", 166912)
    assert "tma" not in forward_space(spec, a100).params and "bwd_tma" not in backward_space(spec, a100).params
    with pytest.raises(ConfigError, match="warp_specialize.*num_warps >= 8, got num_warps=4"):
        KernelConfig(num_warps=4, warp_specialize=True)
    # the tuner checks the restrictions before it builds a config: TPE may sample that point
    space, base = forward_space(spec, h100), KernelConfig()
    point = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, loop_order="q_outer", tma=False,
                 warp_specialize=True)
    data, broken = candidate(space, base, point, default_point={})
    assert broken == ["not warp_specialize or num_warps >= 8"] and data["warp_specialize"] is True
    with pytest.raises(ConfigError, match="config knob 'tma': expected true or false, got 1"):
        KernelConfig(tma=1)


def test_buckets():
    assert [bucket_of(s) for s in (1, 1000, 1024, 1500, 3000, 16384)] == [1, 1024, 1024, 2048, 4096, 16384]
    assert nearest_bucket(3000, [1024, 4096, 16384]) == 4096
    assert nearest_bucket(1800, [1024, 4096]) == 1024  # nearer in log scale


# ------------------------------------------------------------------------------ typed failures
JIT_INFO = dict(key="key", repr="_attn_fwd[num_warps=4]", fn=None, compile={}, is_manual_warmup=False,
                already_compiled=False)


def triton_compiles(then_fails: BaseException | None, *, finishes: bool):
    """What Triton's JIT does on a first launch: its pre-compile hook, the compile, its
    post-compile hook (when the compile finishes), then the launch."""
    runtime = triton.knobs.runtime
    assert runtime.jit_cache_hook is not None, "the runner does not watch Triton's compiles"
    runtime.jit_cache_hook(**JIT_INFO)
    if finishes:
        runtime.jit_post_compile_hook(**JIT_INFO)
    if then_fails is not None:
        raise then_fails


class FaultRunner(InterpretRunner):
    """Raises `error` in one stage of a trial: build (render and import the module), compile
    (inside Triton's JIT compile), run (after a finished compile) or time."""

    def __init__(self, where: str, error: BaseException):
        super().__init__()
        self.where, self.error = where, error

    def build(self, kernel, config):
        if self.where == "build":
            raise self.error
        return super().build(kernel, config)

    def forward(self, kernel, config, q, k, v, tensors=None):
        if self.where in ("compile", "run"):
            triton_compiles(self.error, finishes=self.where == "run")
        return super().forward(kernel, config, q, k, v, tensors)

    def time(self, kernel, config, phase, work):
        if self.where == "time":
            raise self.error
        return super().time(kernel, config, phase, work)


SAME_TEXT = "out of resource: shared memory"  # what the old classifier read; the stage decides now


@needs_interpreter
@pytest.mark.parametrize("where, error, status", [
    ("build", jinja2.UndefinedError("'plan' is undefined"), "compile_error"),
    ("compile", RuntimeError(SAME_TEXT), "compile_error"),
    ("run", RuntimeError(SAME_TEXT), "error"),
    ("run", OutOfResources(233472, 232448, "shared memory"), "out_of_resources"),
    ("time", RuntimeError(SAME_TEXT), "error"),
    ("time", OutOfResources(1024, 1024, "threads"), "out_of_resources"),
])
def test_failures_are_typed_by_the_stage_they_happen_in(where, error, status):
    runner = FaultRunner(where, error)
    spec = SPEC.replace(backward=False)
    kernel = flashgen.AttentionKernel(spec, KernelConfig(BLOCK_M=16, BLOCK_N=16))
    rec = runner.evaluate(kernel, kernel.config, "fwd", runner.workload(spec, 16, 16))
    # a failure while kernels run says at which verification shape, and one while Triton compiles which kernel
    where = {"compile": "at (batch 1, seqlen_q 19, seqlen_k 19): compiling _attn_fwd: ",
             "run": "at (batch 1, seqlen_q 19, seqlen_k 19): "}.get(where, "")
    assert (rec.status, rec.error) == (status, f"{where}{type(error).__name__}: {error}")
    assert rec.status in STATUSES and rec.ms is None
    # the runner gives Triton's hooks back as it found them
    assert triton.knobs.runtime.jit_cache_hook is None and triton.knobs.runtime.jit_post_compile_hook is None


@needs_interpreter
def test_verification_inputs_that_do_not_fit_are_a_typed_failure(monkeypatch):
    # The final round checks configs side by side: device memory taken by the others, when a check
    # draws its inputs, is the config's 'error' (run again alone by prepare_all), not a crashed tune.
    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    runner = InterpretRunner()
    spec = SPEC.replace(backward=False)
    kernel = flashgen.AttentionKernel(spec, KernelConfig(BLOCK_M=16, BLOCK_N=16))
    work = runner.workload(spec, 16, 16)
    monkeypatch.setattr(flashgen.tuner, "qkv_do", no_memory)
    rec = runner.prepare(kernel, kernel.config, "fwd", work, full=True)
    assert rec.status == "error" and "out of memory" in rec.error, rec


def test_compile_watches_in_threads_see_their_own_compiles_and_give_the_hooks_back():
    # The tuner verifies configs side by side in threads, each inside launching(): a compile in one
    # thread is that thread's (another thread's runtime failure stays a runtime failure), an earlier
    # hook is still called, and Triton's hooks are the ones found once every watch has closed (before,
    # the watch that closed first put back hooks the other had replaced, and a closed watch's stayed).
    import threading

    from flashgen.failures import CompilationFailedConfig, RuntimeFailedConfig, launching

    runtime, called = triton.knobs.runtime, []
    found = (lambda **info: called.append("before"), None)
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = found
    opened, compiled = threading.Barrier(2, timeout=10), threading.Barrier(2, timeout=10)
    outcome = {}

    def thread(name, compiles):
        try:
            with launching():
                opened.wait()  # both watches open
                if compiles:  # the pre-compile hook, then a compile error: no post-compile hook
                    runtime.jit_cache_hook(**JIT_INFO)
                compiled.wait()  # the other thread's compile has begun
                if not compiles:
                    opened.wait()  # the compiling thread's watch closes first
                raise RuntimeError("failed")
        except (CompilationFailedConfig, RuntimeFailedConfig) as failure:
            outcome[name] = type(failure).__name__
        finally:
            if compiles:
                opened.wait()

    try:
        threads = [threading.Thread(target=thread, args=("compiles", True)),
                   threading.Thread(target=thread, args=("runs", False))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert outcome == {"compiles": "CompilationFailedConfig", "runs": "RuntimeFailedConfig"}
        assert called == ["before"]
        assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == found
    finally:
        runtime.jit_cache_hook = runtime.jit_post_compile_hook = None


@needs_interpreter
@needs_interpreter
@pytest.mark.parametrize("message, crash", [
    ("`ptxas` failed with error code -11\n`ptxas` stderr:\n\nRepro command: ptxas x.ptx", "SIGSEGV"),  # triton 3.6
    ("`ptxas` raised SIGSEGV\n`ptxas` stderr:\n", "SIGSEGV"),  # later tritons
    ("`ptxas` failed with error code 255\n", None),  # ptxas refused the code: no crash
])
def test_a_ptxas_crash_is_a_compile_error_that_says_so(message, crash):
    from triton.runtime.errors import PTXASError

    runner = FaultRunner("compile", PTXASError(message))
    spec = SPEC.replace(backward=False)
    kernel = flashgen.AttentionKernel(spec, KernelConfig(BLOCK_M=16, BLOCK_N=16))
    rec = runner.evaluate(kernel, kernel.config, "fwd", runner.workload(spec, 16, 16), full=True)
    assert rec.status == "compile_error"
    head = "at (batch 2, seqlen_q 1, seqlen_k 1): compiling _attn_fwd: "  # the full grid's first shape
    said = f"ptxas crashed ({crash}, a ptxas bug) on this kernel; " if crash else ""
    assert rec.error == f"{head}{said}PTXASError: PTXAS error: {message}"[:len(rec.error)]


@pytest.mark.interpreter
def test_restricted_invalid_and_timed_out_trials():
    runner = InterpretRunner()
    spec = SPEC.replace(backward=False)
    kernel = flashgen.AttentionKernel(spec, KernelConfig(BLOCK_M=16, BLOCK_N=16))
    work = runner.workload(spec, 16, 16)
    data = kernel.config.to_dict()
    rec = runner.trial(kernel, data, ["BLOCK_N <= 8"], "fwd", work)  # breaks a restriction: never built
    assert (rec.status, rec.error, rec.config) == ("restricted", "BLOCK_N <= 8", data)
    rec = runner.trial(kernel, dict(data, BLOCK_M=24), [], "fwd", work)  # no valid config
    assert rec.status == "restricted" and "config knob 'BLOCK_M'" in rec.error
    rec = runner.trial(kernel, data, [], "fwd", work, timeout_s=0.0)
    assert rec.status == "timeout" and rec.error.startswith("compile and verify took") and rec.margin < 1
    rec = runner.trial(kernel, data, [], "fwd", work)
    assert rec.status == "ok" and rec.ms > 0 and rec.error is None


def test_stored_status_strings_are_unchanged():
    # The database keeps these strings; results written before the typed failures stay readable.
    assert set(STATUSES) == {"ok", "restricted", "compile_error", "out_of_resources", "wrong_result", "timeout",
                             "error"}


# ------------------------------------------------------------------------------ tuning
class WrongRunner(InterpretRunner):
    """Injects an incorrect kernel: every config with BLOCK_M=16 returns a perturbed output."""

    def forward(self, kernel, config, q, k, v, tensors=None):
        out, lse = super().forward(kernel, config, q, k, v, tensors)
        if config.BLOCK_M == 16:
            out = out * 1.01
        return out, lse


@needs_interpreter
def test_tuner_verifies_masked_specs_with_their_tensors(store):
    # The candidates are checked against the masked reference with the spec's named tensors
    # (document ids, ALiBi slopes), and TFLOP/s count the visible area only.
    spec = AttentionSpec(name="docs", dtype="fp32", head_dim=16, num_heads=2, backward=True,
                         mask={"document": {"ids": "document_ids", "causal": True}},
                         score_mod={"alibi": {}}, tune={"seqlens": [32], "trials": 2})
    results = tune(spec, InterpretRunner(), store, TuneOptions(trials=2))
    assert [(r.phase, r.best is not None) for r in results] == [("fwd", True), ("bwd", True)]
    trials = store.trials(EnvInfo.current(interpret=True), spec)
    assert trials and all(t.status == "ok" for t in trials), [t.error for t in trials if t.status != "ok"]
    pairs = visible_count(spec, 1, 32, 32, named_tensors(spec, 1, 32, device="cpu"), device="cpu")
    assert pairs < 32 * 32 * 2 / 2  # causal within 4 documents: well under half the square
    for t in trials:
        assert t.tflops == pytest.approx(tflops(pairs_flops(pairs, 16, mode=t.phase), t.ms))


@needs_interpreter
def test_tuner_never_picks_an_incorrect_config(store):
    spec = SPEC.replace(backward=False)
    results = tune(spec, WrongRunner(), store, TuneOptions(trials=8, sampler="grid"))  # the whole grid
    (result,) = results
    assert result.best is not None and result.best.config["BLOCK_M"] != 16
    trials = store.trials(EnvInfo.current(interpret=True), spec, phase="fwd")
    wrong = [t for t in trials if t.config["BLOCK_M"] == 16]
    assert wrong and all(t.status == "wrong_result" and "out: FAILED" in t.error for t in wrong)
    assert all(t.status == "ok" and t.margin < 1 for t in trials if t.config["BLOCK_M"] != 16)
    best = store.best_configs(EnvInfo.current(interpret=True), spec)
    assert best[64]["fwd"]["config"]["BLOCK_M"] == 32


@needs_interpreter
def test_tune_forward_and_backward_then_load(store, tmp_path):
    results = tune(SPEC, InterpretRunner(), store, TuneOptions(trials=4))
    assert [(r.bucket, r.phase) for r in results] == [(64, "fwd"), (64, "bwd")]
    assert all(r.best is not None and r.default is not None for r in results)
    with _no_warning():
        kernel = flashgen.load(SPEC, db=store.url)
    assert kernel.config_source.startswith("database")
    cfg = kernel.config_for(64)
    fwd, bwd = results[0].best.config, results[1].best.config
    assert cfg.BLOCK_M == fwd["BLOCK_M"] and cfg.loop_order == fwd["loop_order"]
    assert cfg.dq_strategy == bwd["dq_strategy"] and cfg.BLOCK_N1 == bwd["BLOCK_N1"]
    q, k, v = (torch.randn(1, h, 40, 16, requires_grad=True) for h in (2, 1, 1))
    out = kernel(q, k, v)
    out.sum().backward()
    from flashgen.verify import assert_attention_close

    assert_attention_close(out, None, q.detach(), k.detach(), v.detach(), causal=True)


class _no_warning:
    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("error", flashgen.FlashgenFallbackWarning)

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


@needs_interpreter
def test_other_environment_is_a_miss(store):
    tune(SPEC.replace(backward=False), InterpretRunner(), store, TuneOptions(trials=2))
    here = EnvInfo.current(interpret=True)
    for change in (dict(triton="0.0.1"), dict(templates="0" * 16), dict(gpu="Other GPU")):
        other = EnvInfo(**{**here.as_dict(), **change})
        assert store.best_configs(other, SPEC.replace(backward=False)) == {}
    assert store.best_configs(here, SPEC.replace(backward=False))


# ------------------------------------------------------------------------------ crash safety
def _tune_cmd(tmp_path, db, *extra, trials=40, url=None, seqlens="64"):
    """A `flashgen tune --interpret` command line for a tiny forward-only spec, and its env."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(textwrap.dedent(f"""\
        name: resumable
        dtype: fp32
        head_dim: 16
        num_heads: 2
        causal: true
        tune: {{seqlens: [{seqlens}], trials: {trials}}}
        """))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=child_pythonpath(ROOT))
    cmd = [sys.executable, "-m", "flashgen", "tune", "--spec", str(spec), "--interpret", "--db",
           url or f"sqlite:///{db}", "--json", *extra]
    return cmd, env, AttentionSpec.from_yaml(spec)


def _wait_for_trials(db, spec, n, proc, seconds=120):
    here = EnvInfo.current(interpret=True)
    deadline = time.time() + seconds
    done = []
    while time.time() < deadline and len(done) < n and proc.poll() is None:
        time.sleep(0.5)
        if db.exists():
            done = ResultStore(f"sqlite:///{db}", create=False).trials(here, spec) if _has_schema(db) else []
    return done


@needs_interpreter
def test_killed_tune_loses_no_trial_and_the_next_run_goes_on(tmp_path):
    db = tmp_path / "r.sqlite"
    cmd, env, parsed = _tune_cmd(tmp_path, db)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    done = _wait_for_trials(db, parsed, 3, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(done) >= 3, "the tuner wrote no trial in two minutes"
    here = EnvInfo.current(interpret=True)
    kept = ResultStore(f"sqlite:///{db}").trials(here, parsed)
    assert len(kept) >= len(done)  # nothing written before the kill was lost
    assert not list(tmp_path.glob("*journal*"))  # the studies live in the database
    # No --resume: going on is the default, and the earlier trials are not run again.
    result = CliRunner().invoke(main, cmd[3:] + ["--trials", str(len(kept) + 2)], env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    import json

    (row,) = json.loads(result.output)["results"]
    assert row["resumed"] >= len(kept) - 1  # the default is measured again in the final round, not as a trial
    after = ResultStore(f"sqlite:///{db}").trials(here, parsed)
    assert len(after) >= len(kept) and {tuple(sorted(t.config.items())) for t in kept} <= \
        {tuple(sorted(t.config.items())) for t in after}


@needs_interpreter
def test_ctrl_c_says_how_to_resume_in_one_line(tmp_path):
    db = tmp_path / "i.sqlite"
    cmd, env, parsed = _tune_cmd(tmp_path, db, seqlens="16, 32, 64, 128")  # four studies: still running at ^C
    env["PYTHONFAULTHANDLER"] = "1"  # a SIGABRT prints every thread's stack
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = _wait_for_trials(db, parsed, 2, proc)
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # what holds it, for the next failure to say (a CI run hung here once)
        proc.send_signal(signal.SIGABRT)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"the interrupted tune did not exit in 120 s; its threads:\n{err[-6000:]}")
    assert len(done) >= 2, "the tuner wrote no trial in two minutes"
    assert proc.returncode == 130, (out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "run the same command again" in lines[0] and str(db) in lines[0], err


@needs_interpreter
def test_ctrl_c_that_a_library_turns_into_its_own_error_is_still_an_interrupt(tmp_path, monkeypatch):
    # Optuna's tell, interrupted inside its commit, raised UnboundLocalError from the KeyboardInterrupt:
    # the tune printed that traceback; it is the interrupt, said in one line
    import flashgen.tuner as tuner

    def tune_hit_by_ctrl_c(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)  # the command's own handler raises KeyboardInterrupt here
            time.sleep(5)
        except KeyboardInterrupt:
            raise UnboundLocalError("cannot access local variable 'updated_state'") from None
        raise AssertionError("no Ctrl-C arrived")

    monkeypatch.setattr(tuner, "tune", tune_hit_by_ctrl_c)
    cmd, _, _ = _tune_cmd(tmp_path, tmp_path / "i.sqlite")
    result = CliRunner().invoke(main, cmd[3:])
    assert result.exit_code == 130, result.output
    assert "run the same command again" in result.output and "Traceback" not in result.output
    assert not isinstance(result.exception, UnboundLocalError)


@needs_interpreter
def test_two_tunes_on_one_fresh_database_both_finish(tmp_path):
    # Before: one of them crashed ("table flashgen_meta already exists", or a journal deleted
    # under the other's feet). Now they share the study: both finish, every trial is stored.
    db = tmp_path / "shared.sqlite"
    cmd, env, parsed = _tune_cmd(tmp_path, db, "--trials", "3", "--seqlens", "32", trials=5)
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    import json

    for out, _ in outs:
        assert [r["bucket"] for r in json.loads(out)["results"]] == [32]  # --seqlens, not the spec's 64
    here = EnvInfo.current(interpret=True)
    store = ResultStore(f"sqlite:///{db}", create=False)
    assert len(store.trials(here, parsed, bucket=32)) >= 3 and list(store.best_configs(here, parsed)) == [32]


@needs_interpreter
def test_a_config_told_its_earlier_record_spends_no_budget(store, monkeypatch):
    # two workers sharing a study suggest each other's configs: one measured before is told its record again
    # ("reused"), not measured, and must not count toward the budget (it did: two tunes sharing a fresh study
    # with a budget of 3 stopped at 2 configs measured). Here the sampler repeats the enqueued default once.
    import optuna

    class Repeats(optuna.samplers.RandomSampler):
        def sample_independent(self, study, trial, name, distribution):
            if trial.number == 1:  # the default's knobs again
                return study.trials[0].params[name]
            return super().sample_independent(study, trial, name, distribution)

    monkeypatch.setattr(flashgen.tuner, "make_sampler", lambda name, seed, space: Repeats(seed=seed))
    spec = SPEC.replace(backward=False)
    tune(spec, InterpretRunner(), store, TuneOptions(trials=2))
    measured = {config_key(r.config) for r in store.trials(EnvInfo.current(interpret=True), spec, bucket=64)
                if r.status == "ok"}
    assert len(measured) == 2


@needs_interpreter
def test_a_worse_retune_keeps_the_better_result(store):
    spec = SPEC.replace(backward=False)
    here = EnvInfo.current(interpret=True)
    better = dict(KernelConfig(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1).to_dict())
    store.set_best(here, spec, 64, "fwd", better, 1e-4, 1e6)  # faster than any interpreter run (rows.MIN_MS)
    (result,) = tune(spec, InterpretRunner(), store, TuneOptions(trials=2))
    assert result.best is not None and result.kept == dict(config=better, ms=1e-4, tflops=1e6, default_ms=None)
    assert store.best_configs(here, spec)[64]["fwd"]["config"] == better


@needs_interpreter
def test_a_database_deleted_during_a_tune_is_an_error_not_stored(tmp_path, monkeypatch):
    db = tmp_path / "vanishing.sqlite"

    class DeletingRunner(InterpretRunner):
        calls = 0

        def build(self, kernel, config):
            DeletingRunner.calls += 1
            if DeletingRunner.calls == 2 and db.exists():
                db.unlink()
            return super().build(kernel, config)

    monkeypatch.setattr(flashgen.tuner, "InterpretRunner", DeletingRunner)
    result = CliRunner().invoke(main, ["tune", "--spec", str(ROOT / "examples" / "specs" / "small-causal.yaml"),
                                       "--interpret", "--db", f"sqlite:///{db}", "--trials", "3", "--seqlens", "32"])
    assert result.exit_code == 1, result.output
    assert "was deleted or replaced while in use" in result.output and "results in" not in result.output
    assert "Traceback" not in result.output


def _has_schema(db):
    import sqlite3

    try:
        with sqlite3.connect(db) as conn:
            return conn.execute("SELECT 1 FROM flashgen_meta").fetchone() is not None
    except sqlite3.Error:
        return False


# ------------------------------------------------------------------------------ CLI
@needs_interpreter
def test_cli_tune_interpret_then_new_process_loads_result(tmp_path):
    db = f"sqlite:///{tmp_path / 'cli.sqlite'}"
    spec = ROOT / "examples" / "specs" / "small-causal.yaml"
    result = CliRunner().invoke(main, ["tune", "--spec", str(spec), "--interpret", "--db", db, "--trials", "3"])
    assert result.exit_code == 0, result.output
    assert "INTERPRETER WALL TIME - not a timing" in result.output
    assert "importance" in result.output
    shown = CliRunner().invoke(main, ["show", "--db", db])
    assert "small-causal" in shown.output and "S=64 fwd" in shown.output and "S=64 bwd" in shown.output
    # A new process loads the stored result without tuning, quietly, and computes right.
    code = textwrap.dedent(f"""
        import time, warnings, torch, flashgen
        from flashgen.verify import assert_attention_close
        warnings.simplefilter("error")
        t0 = time.perf_counter()
        kernel = flashgen.load({str(spec)!r}, db={db!r})
        print("lookup_ms", (time.perf_counter() - t0) * 1e3)
        assert kernel.config_source.startswith("database"), kernel.config_source
        q = torch.randn(1, 2, 50, 32, dtype=torch.float16); k = torch.randn(1, 1, 50, 32, dtype=torch.float16)
        v = torch.randn(1, 1, 50, 32, dtype=torch.float16)
        out, lse = kernel(q, k, v, return_lse=True)
        assert_attention_close(out, lse, q, k, v, causal=True)
        print("loaded ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=child_pythonpath(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded ok" in proc.stdout


@pytest.mark.interpreter
def test_cli_tune_refuses_bf16_under_interpreter(tmp_path):
    result = CliRunner().invoke(main, ["tune", "--spec", str(ROOT / "examples/specs/gqa-causal.yaml"),
                                       "--interpret", "--db", f"sqlite:///{tmp_path / 'x.sqlite'}"])
    assert result.exit_code == 2 and "spec field 'dtype'" in result.output and "'bf16'" in result.output


@needs_interpreter
def test_export_import_round_trip(tmp_path, store):
    tune(SPEC.replace(backward=False), InterpretRunner(), store, TuneOptions(trials=2))
    out = tmp_path / "layer" / "interp.yaml"
    result = CliRunner().invoke(main, ["export", "--db", store.url, "--gpu", "triton-interpreter", "-o", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert text.startswith("# flashgen tuning results") and "BLOCK_M:" in text
    other = f"sqlite:///{tmp_path / 'other.sqlite'}"
    result = CliRunner().invoke(main, ["import", str(out), "--db", other])
    assert result.exit_code == 0 and "imported 1" in result.output
    here = EnvInfo.current(interpret=True)
    (imported,) = ResultStore(other).best_configs(here, SPEC.replace(backward=False))[64].values()
    (original,) = store.best_configs(here, SPEC.replace(backward=False))[64].values()
    assert imported["config"] == original["config"]
    for key in ("ms", "tflops", "default_ms"):
        assert imported[key] == pytest.approx(original[key], rel=1e-5)


def test_interpret_runner_refuses_a_compiled_process(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        InterpretRunner()


@pytest.fixture(params=["sqlite", "postgresql"])
def shared_url(request, tmp_path, postgres_url):
    """One database for several workers: an SQLite file, or this pytest worker's database on the
    PostgreSQL server CI starts (conftest.postgres_url)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'workers.sqlite'}"
    pg = postgres_url
    if not pg:
        pytest.skip("FLASHGEN_TEST_POSTGRES_URL is not set: no PostgreSQL server to test against")
    drop_all_tables(pg)
    return pg


@needs_interpreter
def test_three_workers_share_one_study_and_a_killed_worker_loses_only_its_trial(tmp_path, shared_url):
    import optuna

    cmd, env, parsed = _tune_cmd(tmp_path, None, "--trials", "9", "--seqlens", "32", "--heartbeat", "1",
                                 url=shared_url)
    workers = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(3)]
    here = EnvInfo.current(interpret=True)
    store = None
    killed = None
    deadline = time.time() + 120
    while killed is None and time.time() < deadline and all(w.poll() is None for w in workers):
        time.sleep(0.2)
        try:
            store = store or ResultStore(shared_url, create=False)
            (study,) = [s for s in store.optuna_storage().get_all_studies() if s.user_attrs.get("bucket") == 32]
        except Exception:  # noqa: BLE001 (not made yet)
            continue
        # a store opened to read: its SQLite reads take no lock (a tune's take the write lock, which a
        # stopped worker may hold)
        reader = store.optuna_storage()
        for t in reader.get_all_trials(study._study_id):
            if t.state == optuna.trial.TrialState.RUNNING and "worker" in t.user_attrs and "record" not in t.user_attrs:
                pid = int(t.user_attrs["worker"].split(":")[1])
                victim = next(w for w in workers if w.pid == pid)
                # stopped, then looked at again: killed only while that trial is still unmeasured (a kill
                # landing just after its record was written lost nothing, and the test failed)
                unmeasured = False
                victim.send_signal(signal.SIGSTOP)
                try:
                    t = reader.get_trial(t._trial_id)
                    unmeasured = t.state == optuna.trial.TrialState.RUNNING and "record" not in t.user_attrs
                finally:
                    victim.send_signal(signal.SIGKILL if unmeasured else signal.SIGCONT)  # killed mid-trial
                killed = t._trial_id if unmeasured else None
                break
    assert killed is not None, "no worker was seen measuring a trial"
    for w in workers:
        out, err = w.communicate(timeout=180)
        assert w.returncode == (-signal.SIGKILL if w is victim else 0), err[-2000:]
    time.sleep(3.5)  # past the heartbeat's grace period: a later worker fails the dead trial and retries it
    late = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)  # the budget is spent
    assert late.returncode == 0, late.stderr[-2000:]
    storage = ResultStore(shared_url, create=False).optuna_storage()
    trials = storage.get_all_trials(study._study_id)
    dead = next(t for t in trials if t._trial_id == killed)
    assert dead.state == optuna.trial.TrialState.FAIL and "record" not in dead.user_attrs
    (retry,) = [t for t in trials if t.system_attrs.get("failed_trial") == dead.number]
    assert retry.params == dead.params and retry.state.is_finished()
    # Its config measured again by a live worker: by the retry, or by a trial that drew that config
    # between the dead trial's failing and the retry's start and took its claim over (the retry was
    # then told "claimed elsewhere"; the CI saw that order on PostgreSQL).
    again = [t for t in trials if t.params == dead.params and t._trial_id != killed and "record" in t.user_attrs
             and not t.user_attrs.get("reused") and not t.user_attrs.get("final")]
    assert len(again) == 1 and again[0].user_attrs["record"]["status"] != "restricted"
    assert again[0] is retry or retry.user_attrs.get("claimed_elsewhere") or retry.user_attrs.get("reused")
    # Only the killed trial lost its work: every other trial finished, and none is left running.
    assert all(t.state.is_finished() for t in trials)
    lost = [t for t in trials if "record" not in t.user_attrs and not t.user_attrs.get("claimed_elsewhere")]
    assert [t._trial_id for t in lost] == [killed]
    # Every config measured once: the rest were told the stored record again, or skipped while
    # claimed (restricted points are rejected before anything runs, by whichever worker draws them).
    measured = [tuple(sorted(t.params.items())) for t in trials
                if "record" in t.user_attrs and t.user_attrs["record"]["status"] != "restricted"
                and not t.user_attrs.get("reused") and not t.user_attrs.get("final")]
    assert len(measured) == len(set(measured)) >= 3
    assert list(ResultStore(shared_url, create=False).best_configs(here, parsed)) == [32]


@needs_interpreter
def test_a_trial_has_its_heartbeat_before_it_measures_anything(store, monkeypatch):
    # Optuna's heartbeat thread writes when it gets the write lock: a worker killed before that
    # write left a trial that was never stale (running for good, its config claimed). The CI saw it
    # in the test above; here the thread never writes at all.
    import contextlib

    import optuna.study._optimize as optimize
    from sqlalchemy import text

    monkeypatch.setattr(optimize, "get_heartbeat_thread", lambda *a, **k: contextlib.nullcontext())
    unbeaten = []

    class Runner(InterpretRunner):
        def trial(self, *args, **kwargs):
            with store.engine.connect() as conn:
                unbeaten.extend(conn.execute(text(
                    "SELECT trial_id FROM trials WHERE state = 'RUNNING' "
                    "AND trial_id NOT IN (SELECT trial_id FROM trial_heartbeats)")).scalars())
            return super().trial(*args, **kwargs)

    (result,) = tune(SPEC.replace(backward=False), Runner(), store, TuneOptions(trials=2))
    assert result.trials >= 2 and unbeaten == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked workers are Linux's")
def test_a_forked_worker_that_fails_says_why_in_one_line_and_exits_nonzero(tmp_path, capfd):
    # the child of `tune --gpus`: a database it cannot open is said as `flashgen tune` would say it
    # (no traceback), its exit code is the command's, and it sends no results
    import click

    from flashgen.cli import EXIT_FAILURE, _ForkedWorker

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    forwarded = dict(trials=1, timeout=60.0, sampler="tpe", db=f"sqlite:///{blocker / 'tune.sqlite'}", heartbeat=30)
    with click.Context(main) as ctx:
        worker = _ForkedWorker(ctx, [SPEC], forwarded, 1, ("run", 1), True, "1")
        out, _ = worker.communicate()
    assert worker.returncode == EXIT_FAILURE and out == ""
    err = capfd.readouterr().err
    assert "Error: " in err and "cannot be opened" in err and "Traceback" not in err


def test_worker_commands_one_gpu_each_starting_on_different_specs():
    from flashgen.cli import worker_commands

    forwarded = dict(trials=4, seqlens="1024,4096", timeout=60.0, sampler="tpe", db="sqlite:///x.sqlite",
                     heartbeat=30)
    cmds = worker_commands(["a.yaml", "b.yaml", "c.yaml"], forwarded, 7, 2, False,
                           environ={"CUDA_VISIBLE_DEVICES": "3,5", "PATH": "/bin"})
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in cmds] == ["3", "5"]
    assert all(env["PATH"] == "/bin" for _, env in cmds)
    for i, (cmd, _) in enumerate(cmds):
        args = cmd[cmd.index("tune") + 1:]
        assert args[:3] == (["a.yaml", "b.yaml", "c.yaml"], ["b.yaml", "c.yaml", "a.yaml"])[i]
        assert args[args.index("--seed") + 1] == str(7 + i) and args[args.index("--gpus") + 1] == "1"
        assert args[args.index("--db") + 1] == "sqlite:///x.sqlite" and args[args.index("--trials") + 1] == "4"
        assert "--interpret" not in args
        assert args[args.index("--worker") + 1] == f"run:{i}"  # worker i of this run
    (_, env), = worker_commands(["a.yaml"], {}, 0, 1, True, environ={})
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    # a flag is forwarded as a flag, and only when it is set
    for flag in (True, False):
        (cmd, _), = worker_commands(["a.yaml"], dict(forwarded, no_default=flag), 0, 1, False, environ={})
        assert ("--no-default" in cmd) == flag and "True" not in cmd and "False" not in cmd


@needs_interpreter
@pytest.mark.parametrize("processes", ["fork", "spawn"])
def test_tune_many_specs_over_two_workers(tmp_path, processes):
    # fork: worker 1 forked from the command's process (Linux), spawn: a new `flashgen tune --worker`
    import json

    import optuna

    paths = []
    for name, head_dim in (("first", 16), ("second", 32)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"name: {name}\ndtype: fp32\nhead_dim: {head_dim}\nnum_heads: 2\ncausal: true\n"
                        f"tune: {{seqlens: [32], trials: 3}}\n")
        paths.append(str(path))
    url = f"sqlite:///{tmp_path / 'many.sqlite'}"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=child_pythonpath(ROOT), FLASHGEN_WORKER_PROCESSES=processes)
    proc = subprocess.run([sys.executable, "-m", "flashgen", "tune", *paths, "--interpret", "--gpus", "2",
                           "--db", url, "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert [w["cuda_visible_devices"] for w in doc["workers"]] == ["0", "1"]
    assert [[s["spec"].split("_")[0] for s in w["specs"]] for w in doc["workers"]] == \
        [["first", "second"], ["second", "first"]]
    # each study's final round ran once in the run, by one of the two workers (before, by both)
    finals = {}
    for w in doc["workers"]:
        for s in w["specs"]:
            assert w["started_at"] <= s["started_at"] <= s["runner_ready_at"] <= s["ended_at"]
            assert set(s["seconds"]) == {"compile_verify", "timing"}
            for r in s["results"]:
                finals.setdefault((s["spec"], r["bucket"], r["phase"]), []).append(r["final_elsewhere"])
                assert (r["config"] is None) == r["final_elsewhere"] and r["seconds"]["trials"] > 0
    assert len(finals) == 2 and all(sorted(v) == [False, True] for v in finals.values())
    if processes == "fork":  # imports inherited: worker 1's runner is ready at once (a new process takes seconds)
        assert doc["workers"][1]["specs"][0]["runner_ready_at"] - doc["workers"][1]["started_at"] < 2.0
    store = ResultStore(url, create=False)
    here = EnvInfo.current(interpret=True)
    workers = set()
    for path in paths:
        spec = AttentionSpec.from_yaml(path)
        assert list(store.best_configs(here, spec)) == [32]
        study = store.open_study(spec, here, 32, "fwd")
        measured = [t.user_attrs["worker"] for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
                    if "worker" in t.user_attrs]
        assert len(measured) == len({config_key(t.user_attrs["record"]["config"]) for t in study.trials
                                     if "worker" in t.user_attrs})  # no config measured twice
        workers |= set(measured)
    # measured by this run's two processes (worker 0 is the command's own process: worker 1, which
    # starts a process first, may find the tiny studies done under a loaded CI machine)
    assert workers and {w.split(":")[1] for w in workers} <= {str(w["pid"]) for w in doc["workers"]}


@needs_interpreter
def test_a_new_study_starts_from_the_nearest_tuned_specs(store, tmp_path):
    # A spec tuned before (head dim 16) and an unrelated one (a sliding window) are in the
    # database; a new causal spec with head dim 32 starts from the causal one's best config,
    # not from the heuristic default.
    here = EnvInfo.current(interpret=True)
    near = SPEC.replace(name="near", backward=False)
    far = near.replace(name="far", causal=False, mask={"sliding_window": {"left": 8}})
    near_best = KernelConfig(BLOCK_M=16, BLOCK_N=16, num_stages=1, loop_order="kv_outer").to_dict()
    store.set_best(here, near, 64, "fwd", near_best, 1.0, 1.0)
    store.set_best(here, far, 64, "fwd", KernelConfig(BLOCK_M=16, BLOCK_N=32, num_stages=1).to_dict(), 0.5, 1.0)
    new = near.replace(name="new", head_dim=32)
    (result,) = tune(new, InterpretRunner(), store, TuneOptions(trials=2))
    assert result.warm_starts == 2
    study = store.open_study(new, here, 64, "fwd")
    first = study.trials[0].params
    assert (first["BLOCK_M"], first["BLOCK_N"], first["loop_order"]) == (16, 16, "kv_outer")  # the nearest first
    assert (study.trials[1].params["BLOCK_N"], study.trials[1].params["loop_order"]) == (32, "q_outer")
    assert result.default is not None and result.default.status == "ok"  # still measured, in the final round
    # nothing tuned on this GPU for its kind: the default starts the search
    (alone,) = tune(SPEC.replace(name="alone", dtype="fp16", backward=False), InterpretRunner(),
                    ResultStore(f"sqlite:///{tmp_path / 'alone.sqlite'}"), TuneOptions(trials=1))
    assert alone.warm_starts == 0


# ------------------------------------------------------------------------------ the recheck's ptxas crash
@needs_interpreter
def test_one_key_backward_reads_dq_tiles_through_pointers():
    """The full verification grid's (2, 1, 1) shape: Triton makes seqlen_k == 1 a constant, and
    on the H100 (triton 3.6, ptxas 12.8) ptxas crashed (SIGSEGV) compiling the dQ kernel with
    descriptors so specialized (the recheck of 2026-11-23: today's default backward of gqa-causal
    and prefix-lm, bwd_tma, 64x64, 2 stages); calls at other lengths compile. With one key the dQ
    kernel reads K/V through pointers; dK/dV keeps its descriptors."""
    from flashgen.runtime.launch import BackwardPlan
    from flashgen.verify import assert_gradients_close

    spec = AttentionSpec(dtype="fp16", head_dim=16, num_heads=2, causal=True, backward=True)
    module = flashgen.compile(spec, KernelConfig(BLOCK_M=16, BLOCK_N=16, num_stages=1, tma=True, bwd_tma=True,
                                                 BLOCK_M1=16, BLOCK_N1=16, BLOCK_M2=16, BLOCK_N2=16)).module()
    launcher = module._LAUNCHER
    for seqlen_q, seqlen_k, dq_tma in ((1, 1, False), (17, 1, False), (3, 2, True)):
        launcher.plans.clear()
        gen = torch.Generator().manual_seed(seqlen_q)
        q, k, v, do = (torch.randn(2, 2, s, 16, generator=gen).half() for s in (seqlen_q, seqlen_k, seqlen_k, seqlen_q))
        out, lse = module.forward(q, k, v)
        grads = module.backward(do, q, k, v, out, lse)[:3]
        assert_gradients_close(grads, q, k, v, do, causal=True)  # (fp16, 3x rule of TESTING.md)
        (plan,) = [p for p in launcher.plans.values() if isinstance(p, BackwardPlan)]
        assert plan.dkdv.constexprs["TMA"] and plan.rows is not None
        assert plan.dq.constexprs["TMA"] == dq_tma and (plan.tiles is not None) == dq_tma


def test_a_study_s_final_round_runs_once_per_run_by_the_last_worker_to_leave(store):
    import optuna

    from flashgen.tuner import _runs_final_round

    here = EnvInfo.current(interpret=True)
    study = store.open_study(SPEC, here, 64, "fwd")
    running = study.ask()  # another worker is still measuring a config: it will run the round
    assert not _runs_final_round(study, store, ("a", 0))
    study.tell(running, 1.0)
    assert _runs_final_round(study, store, ("a", 1))  # the last to leave claims it
    assert not _runs_final_round(study, store, ("a", 0))  # a worker of the run arriving later
    assert _runs_final_round(study, store, ("a", 1))  # asking again: still its round
    assert _runs_final_round(study, store, ("b", 0))  # a later run has its own final round
    assert study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))[0].value == 1.0


@needs_interpreter
def test_the_backward_study_starts_from_the_bucket_default_not_the_forward_s_best(store, monkeypatch):
    # The backward's time leaves the forward out, so its study need not wait for the forward's
    # final round: `--gpus` workers can take the two studies of a bucket at once.
    from flashgen.config import default_config
    from flashgen.db import TrialRecord
    from flashgen.tuner import BucketResult

    default = default_config(SPEC, target="cpu", seqlen=64)
    bases = {}

    def study(spec, runner, store, options, bucket, phase, base, work, space=None):  # a forward best != default
        bases[phase] = base
        best = TrialRecord(bucket, phase, base.replace(BLOCK_M=16 if base.BLOCK_M != 16 else 32).to_dict(), "ok",
                           ms=1.0)
        return BucketResult(bucket, phase, best, None, 1, {})

    monkeypatch.setattr(flashgen.tuner, "_tune_phase", study)
    assert [r.phase for r in tune(SPEC, InterpretRunner(), store, TuneOptions(trials=1))] == ["fwd", "bwd"]
    assert bases == {"fwd": default, "bwd": default}


# ------------------------------------------------------------------------------ never slower than the default
class ClockRunner(InterpretRunner):
    """The interpreter runner with its timing mocked: ms(config, phase) is the 'time' of a config
    (everything else, verification included, runs for real)."""

    def __init__(self, ms):
        super().__init__()
        self.ms = ms

    def time(self, kernel, config, phase, work):
        return self.ms(config, phase)


def _default_of(spec, bucket=64, phase="fwd"):
    from flashgen.db.kernels import default_kernel

    return default_kernel(spec, bucket, phase, "cpu")


@needs_interpreter
@pytest.mark.parametrize("default_wins", [True, False])
def test_the_tuner_stores_only_what_beat_the_default_in_its_final_round(store, default_wins):
    from flashgen.config import default_config

    spec = SPEC.replace(backward=False)
    default = default_config(spec, target="cpu", seqlen=64)
    fast = 16 if default.BLOCK_M != 16 else 32

    def ms(config, phase):
        if config == default:
            return 1.0
        return 2.0 if default_wins or config.BLOCK_M != fast else 0.5

    (result,) = tune(spec, ClockRunner(ms), store, TuneOptions(trials=8, sampler="grid"))
    (row,) = store.all_best()
    assert row["default_ms"] == 1.0 and row["default_kernel"] == _default_of(spec)  # which default it beat
    if default_wins:
        assert KernelConfig.from_dict(row["config"]) == default and row["ms"] == 1.0
    else:
        assert row["config"]["BLOCK_M"] == fast and row["ms"] == 0.5 and result.speedup == 2.0


@needs_interpreter
def test_a_budget_past_the_space_stops_when_every_point_is_measured(store):
    # --trials 100000 on a space of a few points ran on for thousands of repeated suggestions (each counted
    # as a trial, each rescanning the study): the study stops once every point has a record
    spec = SPEC.replace(backward=False)
    space = forward_space(spec, InterpretRunner().limits)
    (result,) = tune(spec, ClockRunner(lambda config, phase: 1.0 + config.BLOCK_M / 1000), store,
                     TuneOptions(trials=100_000))
    assert space.size() <= result.trials <= 2 * space.size() + 4, (result.trials, space.size())
    assert result.best is not None


def test_warm_starts_read_stored_configs_as_kernelconfig_does():
    # A stored config leaves out its LATER_KNOBS at their off value (family 'portable', ...): on the
    # H100, whose forward space has those knobs, no shipped row warm-started a study before.
    from flashgen.db.neighbours import warm_starts

    here = EnvInfo(gpu="NVIDIA H100 80GB HBM3", capability="9.0", sm_count=132, memory_gib=79.2, torch="2.11.0",
                   triton="3.6.0", cuda="13.0", flashgen="", templates="")
    target = AttentionSpec(name="t", dtype="fp16", head_dim=64, num_heads=2, causal=True)  # hopper_ws serves it
    space = forward_space(target, DeviceLimits("NVIDIA H100 80GB HBM3", 232448.0, hopper=True))
    assert {"family", "hopper_regs", "hopper_overlap"} <= set(space.params)
    portable = KernelConfig(BLOCK_M=64, BLOCK_N=32, num_stages=3, tma=True).to_dict()
    gluon = KernelConfig(BLOCK_M=128, BLOCK_N=128, num_stages=2, family="hopper_ws").to_dict()
    assert "family" not in portable and "hopper_regs" not in gluon
    near = target.replace(name="near", head_dim=128)
    rows = [dict(spec_key=near.key, spec=near.canonical(), environment=here.as_dict(), bucket=64, phase="fwd",
                 config=c, ms=ms) for c, ms in ((portable, 1.0), (gluon, 2.0), ({"BLOCK_M": 48}, 0.5))]
    points = warm_starts(target.key, target.canonical(), here, 64, "fwd", rows, space.params)
    assert [(p["BLOCK_M"], p["family"], p["hopper_regs"]) for p in points] == \
        [(64, "portable", 240), (128, "hopper_ws", 240)]  # a row KernelConfig refuses gives none
    assert not any(space.violations(p) for p in points)


@needs_interpreter
def test_no_default_starts_from_the_sampler_and_the_final_round_still_times_the_default(store):
    # `flashgen tune --no-default` on a spec with nothing tuned near it: no trial is enqueued (the
    # search starts from the sampler alone, as on a GPU nobody has set defaults for); the final
    # round times the default anyway, so the stored result still beats it, and `found` is what
    # the search alone would have stored.
    from flashgen.config import default_config

    spec = SPEC.replace(name="nodefault", backward=False)
    default = default_config(spec, target="cpu", seqlen=64)

    def ms(config, phase):  # the default is the fastest config
        return 1.0 if config == default else 2.0

    (result,) = tune(spec, ClockRunner(ms), store, TuneOptions(trials=2, sampler="random", seed=2,
                                                               enqueue_default=False))
    study = store.open_study(spec, EnvInfo.current(interpret=True), 64, "fwd")
    assert result.warm_starts == 0 and not [t for t in study.trials if "fixed_params" in t.system_attrs]
    assert KernelConfig.from_dict(result.best.config) == default and result.default.ms == 1.0
    searched = {config_key(t.user_attrs["record"]["config"]) for t in study.trials
                if t.user_attrs.get("record", {}).get("status") == "ok" and not t.user_attrs.get("final")}
    # this seed's two random points are not the default: the search alone stores a slower one
    assert config_key(default.to_dict()) not in searched
    assert config_key(result.found.config) in searched and result.found.ms == 2.0


@needs_interpreter
def test_recheck_keeps_the_faster_of_the_stored_config_and_todays_default(store):
    from flashgen.config import default_config
    from flashgen.tuner import recheck

    here = EnvInfo.current(interpret=True)
    default = default_config(SPEC, target="cpu", seqlen=64)
    stored = default.replace(BLOCK_M=16)
    store.set_best(here, SPEC, 64, "fwd", stored.to_dict(), 0.1, 1.0)  # no recorded default: unknown
    times = {"stored": 0.5}

    def ms(config, phase):
        return times["stored"] if config.BLOCK_M == 16 else 1.0

    (result,) = recheck(SPEC, ClockRunner(ms), store)
    assert (result.why, result.kept, result.stored.ms, result.default.ms) == ("unknown default", "stored", 0.5, 1.0)
    (row,) = store.all_best()
    assert (row["config"]["BLOCK_M"], row["ms"], row["default_ms"], row["default_kernel"]) == \
        (16, 0.5, 1.0, _default_of(SPEC))
    times["stored"] = 2.0  # today's default is faster now: it replaces the stored config
    (result,) = recheck(SPEC, ClockRunner(ms), store)
    assert (result.why, result.kept, result.stored_ms) == ("same default", "default", 0.5)
    (row,) = store.all_best()
    assert KernelConfig.from_dict(row["config"]) == default and (row["ms"], row["default_ms"]) == (1.0, 1.0)


def test_recheck_says_which_malformed_rows_it_left_out(store, tmp_path):
    # a stored row whose config is not JSON: show and export said they skipped it, a recheck left it out silently
    import sqlite3

    from flashgen.config import default_config
    from flashgen.tuner import recheck

    here = EnvInfo.current(interpret=True)
    stored = default_config(SPEC, target="cpu", seqlen=64).replace(BLOCK_M=16)
    for bucket in (64, 128):
        store.set_best(here, SPEC, bucket, "fwd", stored.to_dict(), 0.1, 1.0)
    store.close()
    with sqlite3.connect(tmp_path / "results.sqlite") as conn:
        conn.execute("UPDATE best_configs SET config = 'not json' WHERE bucket = 128")
    skipped = []
    results = recheck(SPEC, ClockRunner(lambda config, phase: 1.0), store, skipped=skipped)
    assert [r.bucket for r in results] == [64]
    assert len(skipped) == 1 and "config" in skipped[0] and "not JSON" in skipped[0], skipped


@needs_interpreter
def test_recheck_retimes_a_stale_result_with_todays_kernels(store):
    from flashgen.codegen.render import kernel_hash
    from flashgen.config import default_config
    from flashgen.tuner import recheck

    here = EnvInfo.current(interpret=True)
    spec = SPEC.replace(backward=False)
    bwd = default_config(spec, target="cpu", seqlen=64).replace(BLOCK_M1=16)
    row = dict(environment=here.as_dict(), spec_key=spec.key, spec_uri=spec.uri, spec=spec.canonical(), bucket=64,
               phase="bwd", config=bwd.to_dict(), ms=0.1, tflops=1.0, default_ms=None, kernel="0123456789abcdef",
               default_kernel=None)
    assert store.import_rows([row]) == 1
    assert store.stale_best(here, spec)  # timed on kernels flashgen no longer renders
    (result,) = recheck(spec, ClockRunner(lambda c, p: 0.5 if c.BLOCK_M1 == 16 else 1.0), store)
    assert (result.why, result.kept) == ("stale", "stored")
    (stored,) = store.all_best()
    assert stored["kernel"] == kernel_hash(spec, bwd, "bwd") and stored["ms"] == 0.5  # still wins, today's hash
    assert not store.stale_best(here, spec)


@needs_interpreter
def test_cli_recheck_prints_its_table_and_refreshes_the_shipped_file(tmp_path, monkeypatch):
    from flashgen.config import default_config
    from flashgen.db import layer as layer_mod

    spec_path = ROOT / "examples" / "specs" / "small-causal.yaml"
    spec = AttentionSpec.from_yaml(spec_path)
    here = EnvInfo.current(interpret=True)
    old_env = EnvInfo(**dict(here.as_dict(), torch="2.0.0"))  # a near match: rechecked and replaced
    src = ResultStore(f"sqlite:///{tmp_path / 'src.sqlite'}")
    slow = default_config(spec, target="cpu", seqlen=64).replace(BLOCK_M=16)
    src.set_best(old_env, spec, 64, "fwd", slow.to_dict(), 0.001, 1.0)
    layer = tmp_path / "tuning_db"
    layer_mod.export_rows(src.all_best(), layer / f"{layer_mod.gpu_slug(here.gpu)}.yaml", here.gpu)
    monkeypatch.setattr(layer_mod, "layer_dir", lambda: layer)
    result = CliRunner().invoke(main, ["tune", "--recheck", "--shipped", "--interpret"])
    assert result.exit_code == 0, result.output
    assert "bucket phase" in result.output and "unknown default" in result.output
    assert "wrote 1 results" in result.output
    (row,) = layer_mod.read_file(layer / f"{layer_mod.gpu_slug(here.gpu)}.yaml")
    assert row["environment"] == here.as_dict() and row["default_kernel"] == _default_of(spec)
    # the user's database: the same command without --shipped
    db = f"sqlite:///{tmp_path / 'user.sqlite'}"
    ResultStore(db).set_best(here, spec, 64, "fwd", slow.to_dict(), 0.001, 1.0)
    result = CliRunner().invoke(main, ["tune", "--recheck", "--interpret", "--db", db, "--json", str(spec_path)])
    assert result.exit_code == 0, result.output
    import json

    (line,) = json.loads(result.output)["results"]
    assert line["kept"] in ("stored", "default") and line["default_ms"] > 0 and line["stored_ms_before"] == 0.001


@pytest.mark.parametrize("args, code, words", [
    (["--shipped"], 2, "pass --recheck with it"),
    (["--jobs", "2", "x.yaml"], 2, "--jobs goes with a recheck"),
    (["--recheck", "--gpus", "2", "x.yaml"], 2, "leave out --gpus"),
    (["--recheck", "--trials", "3", "x.yaml"], 2, "leave out --trials"),
    (["--recheck"], 2, "no spec"),
    (["--recheck", "missing.yaml"], 2, "missing.yaml"),
    (["--seqlens", "2000000", "x.yaml"], 2, "'--seqlens': expected lengths of at most 1048576"),
])
def test_cli_recheck_bad_input_is_one_line(args, code, words, tmp_path):
    result = CliRunner().invoke(main, ["tune", *args, "--db", f"sqlite:///{tmp_path / 'x.sqlite'}"])
    assert result.exit_code == code and words in result.output, result.output
    assert "Traceback" not in result.output


@needs_interpreter
def test_cli_recheck_of_a_database_that_does_not_exist_says_so(tmp_path):
    # a misspelled --db: said, not made (empty) and reported as holding no result
    missing = tmp_path / "nope.sqlite"
    result = CliRunner().invoke(main, ["tune", "--recheck", "--interpret", str(ROOT / "examples/specs/mha-hd64.yaml"),
                                       "--db", f"sqlite:///{missing}"])
    assert result.exit_code == 1 and "does not exist" in result.output and "Traceback" not in result.output, \
        result.output
    assert not missing.exists()


@needs_interpreter
def test_cli_recheck_shipped_without_a_file_for_this_gpu_is_one_line(tmp_path, monkeypatch):
    from flashgen.db import layer as layer_mod

    monkeypatch.setattr(layer_mod, "layer_dir", lambda: tmp_path / "empty")
    result = CliRunner().invoke(main, ["tune", "--recheck", "--shipped", "--interpret"])
    assert result.exit_code == 1 and "no shipped tuning results for" in result.output, result.output
    assert "Traceback" not in result.output


def test_final_round_failure_of_a_config_at_a_later_knobs_old_value_is_recorded():
    # CI saw a tune crash with KeyError('bwd_persistent'): a finalist failing the full grid was
    # recorded from its to_dict(), which leaves out a LATER_KNOB at its old value (bwd_persistent 0).
    import optuna
    from flashgen.db import TrialRecord

    space = backward_space(AttentionSpec(dtype="fp16", head_dim=32, causal=True, backward=True),
                           DeviceLimits("interp", float("inf"), interpret=True))
    base = KernelConfig(BLOCK_M1=16, BLOCK_N1=16, BLOCK_M2=16, BLOCK_N2=16, bwd_num_warps=4, bwd_num_stages=1)
    assert base.bwd_persistent == 0 and "bwd_persistent" not in base.to_dict()

    class Runner:
        interpret, seconds = True, {"compile_verify": 0.0}

        def prepare(self, kernel, config, phase, work, timeout_s, full):
            return TrialRecord(32, phase, config.to_dict(), "timeout", error="full grid too slow")

        def measure(self, kernel, config, phase, work, rec, timeout_s):
            return rec

    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    best, default, found = flashgen.tuner._final_choice(Runner(), None, study, space, "bwd", None,
                                                        TuneOptions(), base)
    assert best is None and found is None and default.status == "timeout"
    (failed,) = study.trials
    assert failed.state == optuna.trial.TrialState.FAIL and failed.user_attrs["final"]
    assert failed.params["bwd_persistent"] == 0 and failed.params["BLOCK_M1"] == 16


def test_the_final_round_checks_the_two_fastest_distinct_configs_side_by_side():
    # A config measured before is told to the study again (a second COMPLETE trial, 'reused'): the
    # final round takes the two fastest distinct configs, not one config twice. Their full-grid
    # checks and the default's run in three threads at once (the barrier passes only so), then each
    # is timed alone; a timeout among threads is run again alone before it counts, a wrong result not.
    import threading

    import optuna
    from flashgen.db import TrialRecord

    spec = AttentionSpec(dtype="fp16", head_dim=32, causal=True)
    space = forward_space(spec, DeviceLimits("gpu", float("inf")))
    base = KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
    fast, second = base.replace(BLOCK_N=32), base.replace(BLOCK_M=32)
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    dists = {n: optuna.distributions.CategoricalDistribution(list(c)) for n, c in space.params.items()}
    for config, ms in ((fast, 1.0), (fast, 1.01), (second, 1.5), (base.replace(num_warps=8), 2.0)):
        study.add_trial(optuna.trial.create_trial(
            params={n: getattr(config, n) for n in space.params}, distributions=dists, value=ms,
            user_attrs={"record": dataclasses.asdict(TrialRecord(64, "fwd", config.to_dict(), "ok", ms=ms))}))
    together = threading.Barrier(3, timeout=10)
    prepared, timed = [], []

    class Runner:
        interpret, device, seconds = False, "cpu", {"compile_verify": 0.0}

        def prepare(self, kernel, config, phase, work, timeout_s, full):
            assert full
            alone = len(prepared) >= 3
            prepared.append(config)
            if not alone:
                together.wait()
                self.seconds["compile_verify"] += 100.0  # a thread's own clock: not what the run adds
                if config == second:
                    return TrialRecord(64, phase, config.to_dict(), "timeout", error="slowed by the others")
                if config == base:  # never drawn again: a kernel wrong on some inputs must not pass on a second
                    return TrialRecord(64, phase, config.to_dict(), "wrong_result", error="dq: FAILED")
            return TrialRecord(64, phase, config.to_dict(), "ok")

        def measure(self, kernel, config, phase, work, rec, timeout_s):
            if rec.status != "ok":  # as Runner.measure: a failed check is not timed
                return rec
            timed.append(config)
            return dataclasses.replace(rec, ms={fast: 1.2, second: 0.9, base: 1.4}[config])

    runner, failures = Runner(), {}
    best, default, found = flashgen.tuner._final_choice(runner, None, study, space, "fwd", None, TuneOptions(), base,
                                                        failures)
    assert sorted(map(str, prepared[:3])) == sorted(map(str, (fast, second, base))) and prepared[3:] == [second]
    assert timed == [fast, second] and runner.seconds["compile_verify"] < 100
    assert best.ms == 0.9 and found.ms == 0.9 and default.status == "wrong_result"
    assert failures == {"final wrong_result": 1}  # a round where nothing passed says why (the CLI prints it)


@needs_interpreter
def test_a_run_with_a_longer_timeout_measures_again_what_timed_out_under_a_shorter_one(store):
    # a run with a mistaken --timeout (0.5 s here) timed every config out; a later run with the usual limit took
    # those timeouts as final: it resumed them as its budget, ran no trial and stored the default
    spec = SPEC.replace(backward=False)

    class Slow(ClockRunner):  # every config takes "1 s": over a 0.5 s limit, under 120 s
        def trial(self, kernel, data, broken, phase, work, *, timeout_s=60.0):
            rec = super().trial(kernel, data, broken, phase, work, timeout_s=timeout_s)
            if rec.status == "ok" and timeout_s < 1.0:
                return dataclasses.replace(rec, status="timeout", ms=None, error=f"the trial took 1s, over {timeout_s}s")
            return rec

    def ms(config, phase):
        return 2.0 if config.BLOCK_M == 16 else 1.0

    (first,) = tune(spec, Slow(ms), store, TuneOptions(trials=3, sampler="grid", timeout_s=0.5))
    assert first.failures.get("timeout") == 3
    (second,) = tune(spec, Slow(ms), store, TuneOptions(trials=3, sampler="grid", timeout_s=120.0))
    assert second.resumed == 0 and not second.failures  # the timeouts were measured again, and spent no budget
    study = store.open_study(spec, Slow(ms).env, 64, "fwd")
    records = [t.user_attrs["record"] for t in study.get_trials() if "record" in t.user_attrs]
    assert sum(r["status"] == "ok" for r in records) >= 3
    (third,) = tune(spec, Slow(ms), store, TuneOptions(trials=3, sampler="grid", timeout_s=120.0))
    assert third.resumed == 3  # what the second run measured is resumed as before


def test_a_suggestion_finds_the_measured_record_of_its_config():
    # records store KernelConfig.to_dict (knobs at their off value dropped) and suggestions are whole dicts: keyed
    # each on its own, a repeated backward point was never "reused" (and a second worker was told another one
    # measured it)
    import dataclasses

    from flashgen.tuner import _trial_key

    config = flashgen.default_config(AttentionSpec(head_dim=32, num_heads=2, causal=True), "h100", 4096)
    whole = dataclasses.asdict(config)
    assert whole != config.to_dict()  # (some knob sits at its off value and is dropped)
    assert _trial_key(whole) == _trial_key(config.to_dict())
    assert _trial_key(whole) != _trial_key(config.replace(BLOCK_N1=16 if config.BLOCK_N1 != 16 else 32).to_dict())
    assert _trial_key({"BLOCK_M": "x"}) == _trial_key({"BLOCK_M": "x"})  # (refused configs: keyed as given)


def test_a_config_that_failed_a_final_round_is_never_chosen_by_a_later_one():
    # Verification draws fresh inputs: a config that failed the full grid in one run's final round passed the next
    # run's draw and was stored (a review's catch). Its 'final' failed trial keeps it out of every later round.
    import optuna

    from flashgen import tuner
    from flashgen.db import TrialRecord
    from flashgen.space import DeviceLimits, forward_space

    spec = AttentionSpec(dtype="fp16", head_dim=32, causal=True)
    space = forward_space(spec, DeviceLimits("gpu", float("inf")))
    base = KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
    flaky = base.replace(BLOCK_N=32)
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    dists = {n: optuna.distributions.CategoricalDistribution(list(c)) for n, c in space.params.items()}
    study.add_trial(optuna.trial.create_trial(
        params={n: getattr(flaky, n) for n in space.params}, distributions=dists, value=1.0,
        user_attrs={"record": dataclasses.asdict(TrialRecord(64, "fwd", flaky.to_dict(), "ok", ms=1.0))}))
    draws = []

    class Runner:
        interpret, device, seconds = True, "cpu", {"compile_verify": 0.0}

        def prepare(self, kernel, config, phase, work, timeout_s, full):
            draws.append(config)
            wrong = config == flaky and draws.count(flaky) == 1  # wrong on the first draw only
            return TrialRecord(64, phase, config.to_dict(), "wrong_result" if wrong else "ok")

        def measure(self, kernel, config, phase, work, rec, timeout_s):
            return rec if rec.status != "ok" else dataclasses.replace(rec, ms=1.0 if config == flaky else 2.0)

    for _ in range(2):
        best, _, _ = tuner._final_choice(Runner(), None, study, space, "fwd", None, tuner.TuneOptions(), base, {})
        assert best.config == base.to_dict()
    assert draws.count(flaky) == 1  # the second round did not even verify it again


@pytest.mark.skipif(sys.platform != "linux", reason="forked workers: Linux")
def test_a_sigterm_ends_the_commands_forked_workers_too(tmp_path):
    # By default a SIGTERM killed the command's process alone: its forked worker, re-parented, went on writing
    # trials (a review's catch). The command now ends its workers and exits 143.
    spec = tmp_path / "long.yaml"
    spec.write_text("name: long\ndtype: fp32\nhead_dim: 16\nnum_heads: 2\ncausal: true\nbackward: true\n"
                    "tune: {seqlens: [64, 128, 256], trials: 100}\n")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=child_pythonpath(ROOT), FLASHGEN_WORKER_PROCESSES="fork",
               FLASHGEN_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-m", "flashgen", "tune", str(spec), "--interpret", "--gpus", "2",
                             "--db", f"sqlite:///{tmp_path / 't.sqlite'}"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    children = []
    try:
        deadline = time.monotonic() + 120
        while not children and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            children = [int(pid) for pid in found]
        assert children, "no forked worker seen"
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        alive = [pid for pid in children if _alive(pid)]
        assert not alive, f"workers {alive} outlived the command"
    finally:  # nothing of a failed run is left running (CI's machine)
        for pid in (proc.pid, *children):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@needs_interpreter
def test_a_sigterm_whose_exit_python_dropped_still_ends_the_tune(tmp_path, monkeypatch):
    # _exit_on_term's SystemExit raised inside a weakref callback or __del__ is dropped by Python: the command went
    # on tuning (a CI run's SIGTERM test waited 60 s). Its event stops the tuner before the next trial, exit 143.
    import flashgen.cli as cli
    import flashgen.tuner as tuner

    asked = []

    def tune_after_a_dropped_sigterm(spec, runner, store, options):
        cli._TERMINATED.set()  # what the handler did before its SystemExit was dropped
        asked.append(options.interrupted())
        tuner._stop_if_interrupted(options)  # as before each trial
        raise AssertionError("the tuner went on")

    monkeypatch.setattr(tuner, "tune", tune_after_a_dropped_sigterm)
    stopped = []
    monkeypatch.setattr(ResultStore, "stop_heartbeats", staticmethod(lambda: stopped.append(1) or 0))
    cmd, _, _ = _tune_cmd(tmp_path, tmp_path / "i.sqlite")
    try:
        result = CliRunner().invoke(main, cmd[3:])
    finally:
        cli._TERMINATED.clear()
    assert asked == [True] and result.exit_code == 143, result.output
    assert "Traceback" not in result.output and stopped == [1]

    # the SystemExit itself, raised in a trial: the heartbeat threads it may have left running are stopped too
    # (Optuna's are not daemons: a SIGTERM landing as one started kept the command from ever exiting)
    def tune_hit_by_sigterm(*args, **kwargs):
        cli._exit_on_term(signal.SIGTERM, None)

    monkeypatch.setattr(tuner, "tune", tune_hit_by_sigterm)
    try:
        result = CliRunner().invoke(main, cmd[3:])
    finally:
        cli._TERMINATED.clear()
    assert result.exit_code == 143 and stopped == [1, 1], result.output
