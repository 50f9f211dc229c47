"""The autotuner: Optuna searches the knobs, every candidate is verified before it is timed.

One entry point, ``tune(spec, runner, options)``. A new study starts from the best configs of
the nearest specs already tuned on the same GPU model (warm_starts; the heuristic default
only when there are none), and the default is always measured in the final round, so the
tuner never ends worse than where flashgen.load began. For each sequence-length bucket it runs
one Optuna study for the forward and, when the spec trains, one for the backward (on the
bucket's default forward: the backward's time leaves the forward out, so the two studies are
independent). A trial checks the space's restrictions, renders,
compiles, verifies (the rule of ../shared/TESTING.md on a reduced grid) and only then
times; the runner wraps each stage, so a failure is typed by where it happened
(failures.py: restricted, compile_error, out_of_resources, wrong_result, timeout, error),
stored, never retried and never chosen. The studies live in Optuna's RDB storage inside
the results database (ResultStore.open_study), each trial's record in its user attributes,
written when the trial ends: a crashed run loses nothing, and a later or concurrent run of
the same spec in the same environment goes on with the study it finds; a config another
run already measured in that study is not measured again. Before a best config is stored it is
verified on the full grid and timed again beside the runner-up; it replaces a stored result
only when it is faster (ResultStore.set_best), and the result says which one stays. The
stored result is the fastest of that final round, in which the bucket's default is always
timed (so it is the default itself when nothing beats it), and it records which default it
beat (flashgen.db.kernels.default_kernel): flashgen.load serves it only while that is still
the default. ``recheck`` re-measures stored results against today's default.

Inputs, FLOP counts and timing come from inputs.py, flops.py and timing.py, which the
benchmarks share: the tuner imports nothing from bench.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import socket
import time
import warnings
from dataclasses import dataclass, field

import optuna
import torch

from . import masks
from .api import AttentionKernel
from .config import ConfigError, KernelConfig, default_config
from .db import EnvInfo, ResultStore, TrialRecord, config_key
from .db.kernels import default_kernel
from .decode_space import DecodeConfig, decode_phase, decode_space, phase_batch
from .failures import (CompilationFailedConfig, FailedConfig, InvalidConfig, RuntimeFailedConfig, TimedOutConfig,
                       WrongResultConfig, launching, stage)
from .flops import pairs_flops, tflops, visible_count
from .inputs import named_tensors, qkv_do
from .runtime.host import ensure_context
from .space import DeviceLimits, SearchSpace, backward_space, bucket_of, forward_space
from .spec import AttentionSpec
from .timing import time_ms, wall_ms
from .verify import check_attention, check_gradients

log = logging.getLogger("flashgen.tuner")
# No CMA-ES: every knob is categorical, which CMA-ES cannot model (Optuna falls back to its
# independent sampler on each one, with a warning per knob).
SAMPLERS = ("tpe", "random", "grid")


# ----------------------------------------------------------------------------- runners
@dataclass
class Workload:
    bucket: int
    batch: int
    seqlen: int
    tensors: tuple  # q, k, v, do
    named: dict = field(default_factory=dict)  # the tensors the spec's mask / score_mod read
    pairs: int = 0  # visible (query, key) pairs, summed over batch and heads


class Runner:
    """Runs one config through the stages of a trial; GpuRunner and InterpretRunner share this
    interface. A stage that fails gives the record its typed failure (see failures.py)."""

    device = "cpu"
    timing_label = ""
    interpret = False

    def __init__(self, verify_shapes, full_verify_shapes):
        self.verify_shapes = verify_shapes
        self.full_verify_shapes = full_verify_shapes
        self.env = EnvInfo.current(interpret=self.interpret)
        self.limits = DeviceLimits.current(interpret=self.interpret)
        # where this runner's time went: render, compile and verify (prepare) vs timing (measure)
        self.seconds = {"compile_verify": 0.0, "timing": 0.0}

    # Decode's verification shapes (batch, KV length), at the study's query length.
    decode_verify_shapes: list = []
    decode_full_verify_shapes: list = []

    # The calls a test may override (for example to inject a wrong kernel or a failing stage).
    def build(self, kernel: AttentionKernel, config):
        """Render the config's module and import it (a decode config runs in the kernel's module)."""
        return kernel.module(config if isinstance(config, KernelConfig) else None)

    def forward(self, kernel: AttentionKernel, config, q, k, v, tensors=None):
        return kernel.forward(q, k, v, config=config, **(tensors or {}))

    def backward(self, kernel: AttentionKernel, config, do, q, k, v, out, lse, tensors=None):
        return kernel.backward(do, q, k, v, out, lse, config=config, **(tensors or {}))

    def workload(self, spec: AttentionSpec, bucket: int, batch_tokens: int) -> Workload:
        seqlen = self.timing_seqlen(bucket)
        batch = max(1, batch_tokens // seqlen) if not self.interpret else 1
        gen = torch.Generator().manual_seed(random.randrange(2**31))
        named = named_tensors(spec, batch, seqlen, device=self.device)
        return Workload(bucket, batch, seqlen, qkv_do(spec, batch, seqlen, seqlen, device=self.device, generator=gen),
                        named, visible_count(spec, batch, seqlen, seqlen, named, device=self.device))

    def timing_seqlen(self, bucket: int) -> int:
        return bucket

    def decode(self, kernel: AttentionKernel, config: DecodeConfig, q, k_cache, v_cache, tensors=None):
        """One decode call over a full contiguous cache with the config's knobs: (out, lse)."""
        from .kvcache import decode

        return decode(kernel, q, k_cache, v_cache, None, return_lse=True, **config.to_dict(), **(tensors or {}))

    def decode_workload(self, spec: AttentionSpec, kv_bucket: int, batch_bucket: int, q_len: int) -> Workload:
        """The inputs a decode study times: a full cache of the bucket's length and batch (clipped
        under the interpreter)."""
        kv, batch = (min(kv_bucket, 64), min(batch_bucket, 2)) if self.interpret else (kv_bucket, batch_bucket)
        gen = torch.Generator().manual_seed(random.randrange(2**31))
        q, k, v, _ = qkv_do(spec, batch, q_len, kv, device=self.device, generator=gen)
        named = named_tensors(spec, batch, q_len, kv, device=self.device, generator=gen)
        cache = (k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())  # (batch, kv, heads, dim)
        return Workload(kv_bucket, batch, kv, (q.transpose(1, 2).contiguous(), *cache), named,
                        visible_count(spec, batch, q_len, kv, named, device=self.device))

    def trial(self, kernel, data: dict, broken: list[str], phase, work: Workload, *,
              timeout_s: float = 60.0) -> TrialRecord:
        """A sampled point from the start: the restrictions it breaks, its config, then evaluate."""
        try:
            if broken:
                raise InvalidConfig("; ".join(broken))
            with stage(InvalidConfig):
                config = _config_type(phase).from_dict(data)
        except FailedConfig as failure:
            return _failed(TrialRecord(work.bucket, phase, data, "ok"), failure)
        return self.evaluate(kernel, config, phase, work, timeout_s=timeout_s)

    def evaluate(self, kernel, config, phase, work: Workload, *, timeout_s: float = 60.0,
                 full: bool = False) -> TrialRecord:
        """Render, compile and run, verify, then time one config (the full grid with ``full``)."""
        start = time.monotonic()
        rec = self.prepare(kernel, config, phase, work, timeout_s=timeout_s, full=full)
        return self.measure(kernel, config, phase, work, rec, start=start, timeout_s=timeout_s)

    def prepare(self, kernel, config, phase, work: Workload, *, timeout_s: float = 60.0,
                full: bool = False) -> TrialRecord:
        """The stages before timing: render, compile and run, verify. A record with status
        'ok' and the verification margin, or the typed failure. Safe to run for several
        configs at once in threads (recheck compiles that way); timing is not."""
        rec = TrialRecord(work.bucket, phase, config.to_dict(), "ok")
        start = time.monotonic()
        try:
            with stage(CompilationFailedConfig):
                self.build(kernel, config)
            if phase_batch(phase) is not None:
                rec.margin = self.verify_decode(kernel, config, work, full)
            else:
                rec.margin = self.verify(kernel, config, phase, self.full_verify_shapes if full else self.verify_shapes)
            _within(start, timeout_s, "compile and verify")
        except FailedConfig as failure:  # typed: never let one config end the search
            _failed(rec, failure)
        finally:
            self.seconds["compile_verify"] += time.monotonic() - start
        return rec

    def measure(self, kernel, config, phase, work: Workload, rec: TrialRecord, *, start: float | None = None,
                timeout_s: float = 60.0) -> TrialRecord:
        """Time a config that prepare passed (rec), filling its ms and TFLOP/s; a failed rec is
        returned as it is."""
        if rec.status != "ok":
            return rec
        start = time.monotonic() if start is None else start
        timing = time.monotonic()
        try:
            decoding = phase_batch(phase) is not None
            try:
                with launching():
                    rec.ms = (self.time_decode(kernel, config, work) if decoding
                              else self.time(kernel, config, phase, work))
            finally:
                self.seconds["timing"] += time.monotonic() - timing
            spec = kernel.spec
            rec.tflops = tflops(pairs_flops(work.pairs, spec.head_dim, spec.head_dim_v,
                                            mode="fwd" if decoding else phase), rec.ms)
            _within(start, timeout_s, "the trial")
        except FailedConfig as failure:
            _failed(rec, failure)
        return rec

    def verify(self, kernel, config, phase, shapes) -> float:
        """The error rule on fresh inputs at each shape; returns the worst margin, raises
        WrongResultConfig at the first result that breaks the rule."""
        worst = 0.0
        spec = kernel.spec
        for batch, seqlen_q, seqlen_k in shapes:
            if masks.lower(spec.mask_node, spec.score_mod).same_seqlen:  # a document mask indexes one id tensor by query and key
                seqlen_k = seqlen_q
            gen = torch.Generator().manual_seed(random.randrange(2**31))
            where = f"at (batch {batch}, seqlen_q {seqlen_q}, seqlen_k {seqlen_k})"
            with stage(RuntimeFailedConfig):  # device memory taken (by checks running at once): a typed 'error'
                q, k, v, do = qkv_do(spec, batch, seqlen_q, seqlen_k, device=self.device, generator=gen)
                named = named_tensors(spec, batch, seqlen_q, seqlen_k, device=self.device, generator=gen)
            try:  # Triton compiles per specialization (a length of 1 is a constant): say which shape failed
                with launching():
                    out, lse = self.forward(kernel, config, q, k, v, named)
                    grads = self.backward(kernel, config, do, q, k, v, out, lse, named) if phase == "bwd" else None
            except FailedConfig as failure:
                raise type(failure)(f"{where}: {failure.detail}", margin=failure.margin) from failure
            rule = dict(causal=spec.causal, softmax_scale=spec.softmax_scale, mask=spec.mask,
                        score_mod=spec.score_mod, tensors=named)
            with stage(RuntimeFailedConfig):
                results = check_attention(out, lse, q, k, v, **rule)
                if grads is not None:
                    results += check_gradients(grads, q, k, v, do, **rule)
            for r in results:
                worst = max(worst, r.margin)
                if not r.ok:
                    raise WrongResultConfig(f"{where}: {r}", margin=worst)
        return worst

    def verify_decode(self, kernel, config, work: Workload, full: bool = False) -> float:
        """The error rule for decode: each verification shape's full cache against the dense
        reference (bottom-right aligned, as decode aligns it); the worst margin."""
        worst = 0.0
        spec, q_len = kernel.spec, work.tensors[0].shape[1]
        for batch, kv in self.decode_full_verify_shapes if full else self.decode_verify_shapes:
            gen = torch.Generator().manual_seed(random.randrange(2**31))
            with stage(RuntimeFailedConfig):  # device memory taken: a typed 'error', as in verify
                q, k, v, _ = qkv_do(spec, batch, q_len, kv, device=self.device, generator=gen)
                named = named_tensors(spec, batch, q_len, kv, device=self.device, generator=gen)
            q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
            with launching():
                out, lse = self.decode(kernel, config, q, k, v, named)
            with stage(RuntimeFailedConfig):
                results = check_attention(out, lse, q, k, v, causal=spec.causal, softmax_scale=spec.softmax_scale,
                                          layout="bshd", mask=spec.mask, score_mod=spec.score_mod, tensors=named)
            for r in results:
                worst = max(worst, r.margin)
                if not r.ok:
                    raise WrongResultConfig(f"decode at (batch {batch}, q_len {q_len}, KV {kv}): {r}", margin=worst)
        return worst

    def time_decode(self, kernel, config, work: Workload) -> float:
        q, k_cache, v_cache = work.tensors
        return self.clock(lambda: self.decode(kernel, config, q, k_cache, v_cache, work.named))

    def time(self, kernel, config, phase, work: Workload) -> float:
        raise NotImplementedError


def _config_type(phase: str):
    return DecodeConfig if phase_batch(phase) is not None else KernelConfig


def _within(start: float, timeout_s: float, what: str) -> None:
    elapsed = time.monotonic() - start
    if elapsed > timeout_s:
        raise TimedOutConfig(f"{what} took {elapsed:.0f}s, over {timeout_s:g}s")


def _failed(rec: TrialRecord, failure: FailedConfig) -> TrialRecord:
    rec.status, rec.error = failure.status, failure.detail
    if failure.margin is not None:
        rec.margin = failure.margin
    return rec


class GpuRunner(Runner):
    device = "cuda"
    timing_label = "GPU time: median of CUDA-event timed runs after warm-up, L2 flushed"
    clock = staticmethod(time_ms)
    decode_verify_shapes = [(3, 1531), (1, 4097)]
    decode_full_verify_shapes = [(2, 1), (3, 1531), (1, 4097), (2, 8193)]

    def __init__(self):
        super().__init__(verify_shapes=[(2, 257, 257), (1, 129, 300)],
                         full_verify_shapes=[(2, 1, 1), (2, 257, 257), (1, 129, 300), (1, 300, 129),
                                             (2, 1023, 1023), (1, 17, 2049)])

    def time(self, kernel, config, phase, work: Workload) -> float:
        q, k, v, do = work.tensors
        named = work.named
        if phase == "fwd":
            return time_ms(lambda: self.forward(kernel, config, q, k, v, named))
        out, lse = self.forward(kernel, config, q, k, v, named)
        return time_ms(lambda: self.backward(kernel, config, do, q, k, v, out, lse, named))


class InterpretRunner(Runner):
    """The whole tuning path on the CPU through Triton's interpreter, at tiny shapes.
    Its 'times' are interpreter wall times: not a measurement of any GPU."""

    device = "cpu"
    timing_label = "INTERPRETER WALL TIME - not a timing of any GPU"
    interpret = True
    clock = staticmethod(wall_ms)
    decode_verify_shapes = [(2, 37)]
    decode_full_verify_shapes = [(2, 1), (2, 37), (1, 70)]

    def __init__(self):
        from .config import interpreting

        if not interpreting():
            # @triton.jit picks interpreted or compiled when a kernel module is imported, so
            # the mode cannot change inside a process that already runs compiled kernels.
            raise RuntimeError("InterpretRunner needs TRITON_INTERPRET=1 set before flashgen's kernels are "
                               "imported (`flashgen tune --interpret` sets it)")
        super().__init__(verify_shapes=[(1, 19, 19), (1, 9, 23)],
                         full_verify_shapes=[(2, 1, 1), (1, 19, 19), (1, 9, 23), (1, 23, 9), (2, 40, 40)])

    def timing_seqlen(self, bucket: int) -> int:
        return min(bucket, 32)

    def time(self, kernel, config, phase, work: Workload) -> float:
        q, k, v, do = work.tensors

        def run():
            out, lse = self.forward(kernel, config, q, k, v, work.named)
            if phase == "bwd":
                self.backward(kernel, config, do, q, k, v, out, lse, work.named)

        return wall_ms(run)


# ----------------------------------------------------------------------------- tuning
@dataclass
class TuneOptions:
    trials: int | None = None  # per study; default: the spec's tune.trials
    timeout_s: float = 120.0  # per trial
    sampler: str = "tpe"
    seed: int = 0
    phases: tuple[str, ...] | None = None  # default: fwd, plus bwd when the spec trains
    progress: object = None  # callable(event dict) for the CLI's progress bar
    # callable() -> bool: a Ctrl-C arrived. Python drops a KeyboardInterrupt raised inside a
    # weakref callback or __del__, so the tuner also asks before each trial.
    interrupted: object = None
    # (run id, worker number) of a `--gpus` worker: the workers of one run share each study's
    # trials, and its final round runs once, by the last worker to leave the study (see _runs_final_round).
    worker: tuple[str, int] | None = None
    # Enqueue the bucket's heuristic default as the first trial of a new study that has no warm
    # start (`flashgen tune --no-default`: False, the search starts from the sampler alone, as on
    # a GPU or a kind of spec nobody has tuned and set a default for). The final round times the
    # default either way: it is what flashgen.load runs untuned.
    enqueue_default: bool = True


@dataclass
class BucketResult:
    bucket: int
    phase: str
    best: TrialRecord | None
    default: TrialRecord | None
    trials: int
    failures: dict[str, int]
    importances: dict[str, float] = field(default_factory=dict)
    study_name: str = ""
    resumed: int = 0  # trials this run found finished in the study, from an earlier or concurrent run
    kept: dict | None = None  # the faster stored result that this run's best did not replace
    warm_starts: int = 0  # configs of the nearest tuned specs this study started from
    final_elsewhere: bool = False  # another worker of this run has the final round (best and default None here)
    seconds: dict = field(default_factory=dict)  # wall seconds: 'trials' (this worker's), 'final' (its round)
    # The fastest of the final round among the configs the search found (its two best trials),
    # the default left out unless the search sampled it: what the search alone would store
    # (benchmarks/bench_search_quality.py measures it). best is this or the default.
    found: TrialRecord | None = None

    @property
    def speedup(self) -> float | None:
        if self.best and self.default and self.default.ms and self.best.ms:
            return self.default.ms / self.best.ms
        return None


def make_sampler(name: str, seed: int, space: SearchSpace):
    if name == "tpe":
        with warnings.catch_warnings():  # multivariate TPE is marked experimental, and is the better model here
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(seed=seed, multivariate=True)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        return optuna.samplers.GridSampler({k: list(v) for k, v in space.params.items()}, seed=seed)
    raise ValueError(f"sampler: expected one of {SAMPLERS}, got {name!r}")


def warm_starts(spec: AttentionSpec, env: EnvInfo, store: ResultStore, bucket: int, phase: str,
                space: SearchSpace, k: int = 3) -> list[dict]:
    """The first points of a new study: the best configs of the k nearest specs tuned on this
    GPU model (flashgen.db.neighbours), from the database and the shipped tuning_db/, that lie
    in this space and break none of its restrictions."""
    from .db.layer import ResultFileError, layer_dir, read_file
    from .db.neighbours import warm_starts as nearest

    rows = store.all_best(where={f: getattr(env, f) for f in ("gpu", "capability", "sm_count")})
    for path in sorted(layer_dir().glob("*.yaml")):
        try:
            rows += read_file(path)
        except ResultFileError as err:  # flashgen.load says so; here a missing hint costs nothing
            log.info("no warm start from %s", err)
    points = nearest(spec.key, spec.canonical(), env, bucket, phase, rows, space.params, k=len(rows))
    fits = [p for p in points if all(p[n] in c for n, c in space.params.items()) and not space.violations(p)]
    return fits[:k]


def candidate(space, base: KernelConfig, point: dict, default_point: dict) -> tuple[dict, list[str]]:
    """The config dict of a sampled point and the restrictions it breaks. Restrictions are
    checked before a KernelConfig is built (some restricted points are not valid configs).
    The default is always measured: it is what flashgen.load runs untuned, so it is the
    baseline whatever the resource estimates say of it."""
    data = {**base.to_dict(), **point}
    return data, ([] if point == default_point else space.violations(point))


def tune(spec: AttentionSpec, runner: Runner, store: ResultStore, options: TuneOptions | None = None
         ) -> list[BucketResult]:
    """Tune every bucket of the spec; store every trial and the best config per bucket and phase."""
    options = options or TuneOptions()
    # Optuna's warnings are about failed trials, with their tracebacks: a config's failure is
    # a typed record here, and an interrupt or a database error reaches the caller whole.
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    phases = options.phases or (("fwd", "bwd") if spec.backward else ("fwd",)) + \
        (("decode",) if spec.tune.decode else ())
    buckets = sorted({bucket_of(s) for s in spec.tune.seqlens})
    results = []
    for bucket in buckets if {"fwd", "bwd"} & set(phases) else ():
        work = runner.workload(spec, bucket, spec.tune.batch_tokens)
        # Both phases start from the bucket's default. The backward's time leaves the forward out
        # (GpuRunner.time), and flashgen.load takes each phase's own knobs from its own row, so
        # the backward study need not wait for the forward's final round: the studies are
        # independent, and `--gpus` workers take them in any order.
        default = default_config(spec, target=_target(runner), seqlen=bucket)
        for phase in (p for p in phases if p in ("fwd", "bwd")):
            _stop_if_interrupted(options)
            results.append(_tune_phase(spec, runner, store, options, bucket, phase, default, work))
    if "decode" in phases:
        results += tune_decode(spec, runner, store, options)
    return results


def tune_decode(spec: AttentionSpec, runner: Runner, store: ResultStore, options: TuneOptions
                ) -> list[BucketResult]:
    """Decode's studies (the spec's tune.decode, flashgen/decode_space.py): one per KV-length
    bucket and batch bucket, stored as phase dec<batch>, each starting from the heuristic's
    choice at the bucket's shape (flashgen/runtime/decode.py) and measured as prefill's are."""
    from .decode_space import buckets
    from .runtime.decode import decode_knobs

    if spec.tune.decode is None:
        raise ValueError("tune.decode: this spec names no decode shapes to tune")
    if masks.lower(spec.mask_node, spec.score_mod).same_seqlen:
        raise ValueError("tune.decode: a document mask indexes one id tensor by query and key; decode does not "
                         "run it")
    q_len, results = spec.tune.decode.q_len, []
    for kv, batch in buckets(spec.tune.decode.kv_lengths, spec.tune.decode.batches):
        work = runner.decode_workload(spec, kv, batch, q_len)
        knobs = decode_knobs(spec.head_dim, q_len * spec.gqa_group, work.batch, spec.num_kv_heads, work.seqlen,
                             torch.device(runner.device, 0) if runner.device == "cuda" else torch.device("cpu"),
                             element_size=4 if spec.dtype == "fp32" else 2)
        default = DecodeConfig.from_dict({n: knobs[n] for n in DecodeConfig.__dataclass_fields__})
        results.append(_tune_phase(spec, runner, store, options, kv, decode_phase(bucket_of(batch)), default, work,
                                   decode_space(spec, runner.limits, default)))
    return results


def _target(runner: Runner) -> str | None:
    """The default_config target of a runner's machine: 'cpu' under the interpreter, else
    the spec's or this GPU's (None)."""
    return "cpu" if runner.interpret else None


def _tune_phase(spec, runner, store, options, bucket, phase, base, work, space: SearchSpace | None = None
                ) -> BucketResult:
    if space is None:
        space = forward_space(spec, runner.limits) if phase == "fwd" else backward_space(spec, runner.limits)
    kernel = AttentionKernel(spec, base if isinstance(base, KernelConfig) else None)
    started = time.monotonic()
    # A seed of its own per study, so the buckets do not replay one sequence of suggestions.
    seed = (options.seed * 1_000_003 + bucket * 2 + (phase == "bwd")) % 2**32  # numpy's seeds are 32-bit
    study = store.open_study(spec, runner.env, bucket, phase, make_sampler(options.sampler, seed, space))
    name = study.study_name
    default_point = {n: getattr(base, n) for n in space.params}
    starts = []
    if not study.trials:  # a new study starts from the nearest tuned specs, else from the default
        starts = warm_starts(spec, runner.env, store, bucket, phase, space)
        for point in starts or ([default_point] if options.enqueue_default else []):
            study.enqueue_trial(point)
    failures: dict[str, int] = {}

    def retried(t) -> bool:
        """A trial that timed out under a shorter limit than this run's (a run with a mistaken --timeout): its
        config is measured again, and it spends none of this run's budget (before, every later run took its
        timeout as final)."""
        limit = t.user_attrs.get("timeout_s")
        return (t.user_attrs.get("record", {}).get("status") == "timeout" and limit is not None
                and limit < options.timeout_s)

    def measured() -> dict[str, TrialRecord]:
        """The records of the configs this study has finished, this run's and other runs' (less the retried)."""
        return {_trial_key(t.user_attrs["record"]["config"]): TrialRecord(**t.user_attrs["record"])
                for t in study.get_trials(deepcopy=False)
                if t.state.is_finished() and "record" in t.user_attrs and not retried(t)}

    def objective(trial: optuna.Trial) -> float:
        _record_heartbeat(study, trial)  # first: before the suggestions' writes, which wait for the lock too
        _stop_if_interrupted(options)
        point = {n: trial.suggest_categorical(n, list(c)) for n, c in space.params.items()}
        data, broken = candidate(space, base, point, default_point)
        key = _trial_key(data)
        rec = measured().get(key)
        if rec is not None:  # measured before, by this run or another: told again, not run again
            trial.set_user_attr("reused", True)
        elif broken or store.claim(name, key, trial._trial_id, retake=retried):
            if not broken:  # who measures it: where to look when a worker dies mid-trial
                trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
                trial.set_user_attr("timeout_s", options.timeout_s)  # the limit a timeout was under (retried)
            rec = runner.trial(kernel, data, broken, phase, work, timeout_s=options.timeout_s)
        else:  # another worker is measuring this config now
            trial.set_user_attr("claimed_elsewhere", True)
            raise optuna.TrialPruned("another worker is measuring this config")
        trial.set_user_attr("record", dataclasses.asdict(rec))
        store.ensure_present()  # Optuna wrote through its own connection: a vanished file is an error now
        if options.progress:
            options.progress(dict(bucket=bucket, phase=phase, record=rec, study=study))
        if rec.status != "ok":
            failures[rec.status] = failures.get(rec.status, 0) + 1
            raise optuna.TrialPruned(f"{rec.status}: {rec.error}")
        return rec.ms

    # The budget counts evaluated configs: restricted points cost no compile and no budget
    # (bounded at 20 suggestions per evaluation, for spaces that are mostly restricted).
    budget = options.trials or spec.tune.trials

    def evaluated() -> int:
        # (a trial told a config's earlier record, "reused", evaluated nothing: two workers sharing a study suggest
        # each other's configs, and counting those stopped a budget of 3 at 2 configs measured)
        return sum(1 for t in study.get_trials(deepcopy=False) if t.state.is_finished()
                   and t.user_attrs.get("record", {}).get("status") not in (None, "restricted")
                   and not t.user_attrs.get("final") and not t.user_attrs.get("reused") and not retried(t))

    def retries_waiting() -> bool:
        """A dead worker's trial, failed by its heartbeat, is enqueued again: it runs even when
        the budget is spent (it was part of the budget)."""
        return bool(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)))

    def exhausted() -> bool:
        """Every point of the space has a record (measured or restricted): more trials would only repeat
        them (a budget above the space's size ran on, each repeat counted and each rescanning the study)."""
        return len(measured()) >= space.size()

    def stop_when_spent(study_, _trial):
        if (evaluated() >= budget or exhausted()) and not retries_waiting():
            study_.stop()

    with warnings.catch_warnings():  # a trial of a dead worker: failed now, and enqueued again
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    resumed = evaluated()
    if (resumed < budget and not exhausted()) or retries_waiting():
        study.optimize(objective, n_trials=20 * budget, callbacks=[stop_when_spent], catch=())
    seconds = {"trials": time.monotonic() - started, "final": 0.0}
    if options.worker is not None and not _runs_final_round(study, store, options.worker):
        return BucketResult(bucket, phase, None, None, len(study.trials), failures, {}, name, resumed, None,
                            len(starts), final_elsewhere=True, seconds=seconds)
    _stop_if_interrupted(options)
    final_start, before = time.monotonic(), dict(runner.seconds)
    best, default, found = _final_choice(runner, kernel, study, space, phase, work, options, base, failures)
    # the final round's own compile+verify and timing seconds (its serial part when workers share the study)
    seconds.update({f"final_{k}": round(runner.seconds[k] - before[k], 3) for k in before})
    importances = {}
    completed = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if len(completed) >= 3:
        try:
            importances = optuna.importance.get_param_importances(study)
        except (RuntimeError, ValueError) as err:  # e.g. every completed trial took the same time
            log.info("no parameter importances for %s: %s", name, err)
    kept = None
    if best is not None:
        # The default this round measured (its phase's knobs are the bucket's default): which
        # default the result beat, so that flashgen.load can tell when the default has moved.
        against = default_kernel(spec, bucket, phase, _target(runner)) if default.status == "ok" else None
        kept = store.set_best(runner.env, spec, bucket, phase, best.config, best.ms, best.tflops,
                              default.ms if default.status == "ok" else None, against)
    seconds["final"] = time.monotonic() - final_start
    return BucketResult(bucket, phase, best, default, len(study.trials), failures, importances, name, resumed, kept,
                        len(starts), seconds=seconds, found=found)


def _trial_key(config: dict) -> str:
    """A config's key among a study's trials: of its KernelConfig's to_dict (as records store it: knobs at their
    off value dropped), so that a suggestion equal to a measured config finds it (keyed on the suggestion's own
    dict, with every knob, a repeated backward point was never found and a second worker was told another
    measured it). A config KernelConfig refuses keys on its dict as given."""
    try:
        return config_key(KernelConfig.from_dict(config).to_dict())
    except (ConfigError, TypeError, ValueError):
        return config_key(config)


def _record_heartbeat(study, trial) -> None:
    """Write this trial's first heartbeat now, before its knobs are suggested and it claims a config.
    Optuna's heartbeat thread writes it when it gets the database's write lock, and a trial with no
    heartbeat is never stale: a worker killed before that write (seen in the CI: another worker held
    SQLite's lock) left its trial running for good, its config claimed, and no worker of the run took
    the final round. (A kill between study.ask() creating the trial and this write still leaves one.)"""
    from optuna.storages._heartbeat import is_heartbeat_enabled

    if is_heartbeat_enabled(study._storage):
        study._storage.record_heartbeat(trial._trial_id)


def _runs_final_round(study, store: ResultStore, worker: tuple[str, int]) -> bool:
    """Whether this `--gpus` worker runs the study's final round for its run: it is the last to
    leave the study (no trial of it is running: a worker still measuring one will run the round
    and see that trial's result) and the first of the run to claim the round. Before, every
    worker ran every study's final round (the full-grid check and timing of three configs) and
    two workers did each round twice (issue 16's 2-GPU throughput)."""
    run, number = worker
    with warnings.catch_warnings():  # a dead worker's trial is not running any more
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    if study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        return False
    return store.claim_once(study.study_name, f"final:{run}", number)


def _stop_if_interrupted(options) -> None:
    """Raise KeyboardInterrupt when a Ctrl-C arrived that Python dropped (options.interrupted):
    asked before each trial, each final-round check and each study."""
    if options.interrupted and options.interrupted():
        raise KeyboardInterrupt


# What several configs compiled and checked at once can cause one another: a timeout (their
# compiles share the host's cores), a runtime error (device memory). A failure of another kind
# (wrong_result above all: a kernel wrong on some inputs must never pass on a second draw) stands.
_SHARED_FAILURES = ("timeout", "error")


def prepare_all(runner, items, prepare, jobs: int, options=None) -> list[TrialRecord]:
    """prepare(item) -> TrialRecord (Runner.prepare: compile, run and verify) for every item, in
    ``jobs`` threads (1 under the interpreter, whose kernels run in Python). Triton's compiler and
    ptxas leave the GIL, so configs compile side by side (4 sm90 forwards compiled on the CI's 2
    cores: 5.9 s one at a time, 3.3 s in 2 threads). The threads run on the caller's CUDA device
    (torch's current device is per thread). A timeout or runtime error among threads is confirmed
    alone before it counts (_SHARED_FAILURES). The runner's compile_verify clock gains the wall
    time, not the threads' sum. ``options.interrupted`` is asked before each config run alone and
    before the threads start; a Ctrl-C during them waits for the checks running (threads cannot be
    stopped) and starts no more."""
    items = list(items)
    jobs = 1 if runner.interpret else max(1, min(jobs, len(items)))

    def alone(item):
        if options is not None:
            _stop_if_interrupted(options)
        return prepare(item)

    if jobs == 1:
        return [alone(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor

    device = torch.cuda.current_device() if runner.device == "cuda" and torch.cuda.is_available() else None

    def threaded(item):
        if device is not None:
            # set_device to the device a new thread already names makes no context current there: the
            # backward's first cuBLAS call then printed "no current CUDA context" in the user's terminal
            torch.cuda.set_device(device)
            ensure_context(torch.device("cuda", device))
        return prepare(item)

    if options is not None:
        _stop_if_interrupted(options)
    before, start = runner.seconds["compile_verify"], time.monotonic()
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        out = list(pool.map(threaded, items))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        runner.seconds["compile_verify"] = before + time.monotonic() - start
    return [alone(item) if rec.status in _SHARED_FAILURES else rec for item, rec in zip(items, out)]


def _final_choice(runner, kernel, study, space, phase, work, options, base: KernelConfig, failures=None):
    """Verify the two fastest configs and the default on the full grid (compiled side by side in
    threads: the final round is the part of a study that `--gpus` workers cannot share), time them
    again in one round, keep the fastest. Each config's compile and check, and its timing, is held
    to options.timeout_s on its own (the checks run at once). Returns (best, default, found) records from that round
    (found: the fastest of the search's own two, the default left out unless it is one of them). A
    config that fails the full grid is added to the study as a failed trial (marked 'final', so it
    spends no budget), and is then never chosen, in this run or a later one; and counted in ``failures``
    (the bucket's {status: count}) as 'final <status>', so a round in which no config passed says why."""
    completed = sorted((t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE),
                       key=lambda t: t.value)
    # the configs an earlier final round saw fail the full grid (its 'final' trials): verification draws fresh
    # inputs, and a kernel wrong on some passed a later run's draw and was stored (a review's catch)
    refused = [_config_type(phase).from_dict(t.user_attrs["record"]["config"]) for t in study.trials
               if t.state == optuna.trial.TrialState.FAIL and t.user_attrs.get("final")]
    searched = []  # the two fastest distinct configs (a config measured before is told again: a second trial)
    for t in completed:
        config = _config_type(phase).from_dict(t.user_attrs["record"]["config"])
        if config not in searched and config not in refused:
            searched.append(config)
        if len(searched) == 2:
            break
    candidates = searched + ([base] if base not in searched else [])
    # decode's configs share one module (its kernels' first compiles would meet in Triton's JIT): one at a time
    jobs = len(candidates) if phase_batch(phase) is None else 1
    prepared = prepare_all(runner, candidates, lambda config: runner.prepare(
        kernel, config, phase, work, timeout_s=options.timeout_s, full=True), jobs, options)
    finalists, default, found = [], None, []
    for config, rec in zip(candidates, prepared):
        _stop_if_interrupted(options)
        rec = runner.measure(kernel, config, phase, work, rec, timeout_s=options.timeout_s)
        if config == base:
            default = rec
        if rec.status != "ok":  # passed the reduced grid, failed the full one: record, never choose
            if failures is not None:
                failures[f"final {rec.status}"] = failures.get(f"final {rec.status}", 0) + 1
            # from the config, not rec.config: to_dict() leaves out a LATER_KNOB at its old value
            # (bwd_persistent 0), which a KeyError here turned into a crashed tune
            params = {n: getattr(config, n) for n in space.params}
            dists = {n: optuna.distributions.CategoricalDistribution(list(c)) for n, c in space.params.items()}
            study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL, params=params,
                                                      distributions=dists,
                                                      user_attrs={"record": dataclasses.asdict(rec), "final": True}))
            continue
        finalists.append(rec)
        if config in searched:
            found.append(rec)
    best = min(finalists, key=lambda r: r.ms) if finalists else None
    return best, default, min(found, key=lambda r: r.ms) if found else None


# ----------------------------------------------------------------------------- recheck
@dataclass
class RecheckResult:
    """One bucket and phase of ``recheck``: the stored result(s), re-timed beside the current
    default in one round, and which of the two stays."""

    bucket: int
    phase: str
    stored_ms: float  # the stored result's time, as it was stored (another round, maybe other kernels)
    why: str  # what was stored: measured against this default ('same default'), an older one, an unknown one; or 'stale'
    stored: TrialRecord | None  # the stored config, with today's kernels, re-verified and timed now
    default: TrialRecord | None  # today's default for the bucket and phase, timed in the same round
    kept: str  # 'stored', 'default', or 'nothing' (neither passed verification: the stored row stays)


RECHECK_ROUNDS = 2  # timed rounds, alternating the configs; each config keeps its lowest median


def recheck(spec: AttentionSpec, runner: Runner, store: ResultStore, options: TuneOptions | None = None, *,
            jobs: int | None = None, progress=None, skipped: list[str] | None = None) -> list[RecheckResult]:
    """Re-measure the spec's stored best configs on this machine (fwd and bwd, every bucket
    and environment of this GPU model and Triton minor, stale ones included) against the
    current default of their bucket and phase, and keep the faster.

    Each stored config is rebuilt on today's default for its bucket (its phase's knobs, as
    flashgen.load merges it), rendered with today's templates, verified on the full grid, and
    timed with the tuner's harness beside the default in the same rounds (alternating, each
    keeping its lowest median). The faster one is stored in this environment with the
    default it was compared with (set_best(..., rechecked=True)): a stored config that no
    longer beats today's default gives way to it, one that still wins stays with today's
    kernel hash. Compilation and verification run first, for every config at once in
    ``jobs`` threads (Triton compiles outside the GIL; under the interpreter one at a time);
    the timing runs one config at a time. ``progress(result)`` is called per bucket and phase.
    ``skipped``: where given, the malformed stored rows left out are said there (`flashgen db check`'s words).
    """
    from .db.env import MODEL_FIELDS, STALE, classify
    from .db.kernels import OTHER_DEFAULT, SAME_DEFAULT, default_status, kernels_of

    options = options or TuneOptions()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    env, target = runner.env, _target(runner)
    skipped = [] if skipped is None else skipped
    rows = [r for r in store.all_best(spec_key=spec.key, where={f: getattr(env, f) for f in MODEL_FIELDS},
                                      skipped=skipped)
            if env.same_machine(r["environment"]) and r["phase"] in ("fwd", "bwd")]
    groups: dict[tuple[int, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["bucket"], row["phase"]), []).append(row)
    plan = []  # (bucket, phase, default, candidates, fastest stored row, why, this environment's (ms, kernel))
    for (bucket, phase), group in sorted(groups.items()):
        default = default_config(spec, target=target, seqlen=bucket)
        candidates = []
        for row in group:
            try:
                stored = KernelConfig.from_dict(dict(row["config"]))
                config = default.replace(**{k: getattr(stored, k) for k in KernelConfig.phase_knobs(phase)})
            except (ConfigError, TypeError) as err:  # a malformed row: nothing to re-time
                skipped.append(f"{spec.uri} S={bucket} {phase}: {err}")
                continue
            if config != default and config not in candidates:
                candidates.append(config)
        first = min(group, key=lambda r: r["ms"])
        # this environment's row as read now: the round's result replaces it while it is unchanged (set_best)
        own = next(((r["ms"], r["kernel"]) for r in group if r["environment"] == env.as_dict()), None)
        status = default_status(spec, first, target)
        why = "stale" if classify(env, first, kernels_of(spec)) == STALE else \
            {SAME_DEFAULT: "same default", OTHER_DEFAULT: "older default"}.get(status, "unknown default")
        plan.append((bucket, phase, default, candidates, first, why, own))
    if not plan:
        return []
    kernel = AttentionKernel(spec, default_config(spec, target=target))
    works = {bucket: runner.workload(spec, bucket, spec.tune.batch_tokens) for bucket in {p[0] for p in plan}}
    # Verification does not depend on the bucket: each (phase, config) is compiled and verified once.
    todo = {(phase, config): bucket for bucket, phase, default, candidates, *_ in plan
            for config in [default, *candidates]}

    def prepare(item):
        phase, config = item
        return runner.prepare(kernel, config, phase, works[todo[item]], timeout_s=options.timeout_s, full=True)

    # one at a time unless asked. (The ptxas crash (SIGSEGV) of the H100 recheck of 2026-11-23, with 8
    # threads and alone alike, was not the threads: the full grid's one-key shape, see runtime/host.py.)
    prepared = dict(zip(todo, prepare_all(runner, todo, prepare, jobs or 1)))
    results = []
    for bucket, phase, default, candidates, first, why, own in plan:
        checked = {c: dataclasses.replace(prepared[(phase, c)], bucket=bucket) for c in [default, *candidates]}
        configs = [c for c, rec in checked.items() if rec.status == "ok"]
        timed = {c: dataclasses.replace(checked[c]) for c in configs}
        for _ in range(RECHECK_ROUNDS):
            for config in configs:
                rec = runner.measure(kernel, config, phase, works[bucket], dataclasses.replace(checked[config]),
                                     timeout_s=options.timeout_s)
                if rec.status != "ok":
                    timed[config] = rec
                elif timed[config].status == "ok" and (timed[config].ms is None or rec.ms < timed[config].ms):
                    timed[config] = rec
        default_rec = timed.get(default) or checked[default]
        if candidates:
            ok = [timed[c] for c in candidates if c in timed and timed[c].status == "ok"]
            stored = min(ok, key=lambda r: r.ms) if ok else (timed.get(candidates[0]) or checked[candidates[0]])
        else:  # the stored config is today's default itself
            stored = default_rec
        default_ok = default_rec.status == "ok"
        if stored.status == "ok" and (not default_ok or stored.ms < default_rec.ms):
            winner, kept = stored, "stored"  # strictly faster: a tie goes to the default
        elif default_ok:
            winner, kept = default_rec, "default" if candidates else "stored"
        else:
            winner, kept = None, "nothing"
        if winner is not None:
            against = default_kernel(spec, bucket, phase, target) if default_ok else None
            store.set_best(env, spec, bucket, phase, winner.config, winner.ms, winner.tflops,
                           default_rec.ms if default_ok else None, against, rechecked=True, read=own)
        result = RecheckResult(bucket, phase, first["ms"], why, stored, default_rec, kept)
        results.append(result)
        if progress:
            progress(result)
    return results


def exhaustive(spec, runner, bucket: int, phase: str = "fwd", base: KernelConfig | None = None):
    """Measure every valid point of the space (for judging the search); returns records."""
    base = base or default_config(spec, target="cpu" if runner.interpret else None)
    space = forward_space(spec, runner.limits) if phase == "fwd" else backward_space(spec, runner.limits)
    kernel = AttentionKernel(spec, base)
    work = runner.workload(spec, bucket, spec.tune.batch_tokens)
    return [runner.evaluate(kernel, base.replace(**p), phase, work) for p in space.points()]


__all__ = ["GpuRunner", "InterpretRunner", "Runner", "TuneOptions", "BucketResult", "RecheckResult", "tune",
           "recheck", "exhaustive", "SAMPLERS"]
