"""Where a new study starts: the best configs of the nearest specs already tuned on this GPU.

A spec nobody has tuned still resembles one somebody has: the same GPU, the same kind of
mask, a head dim one power of two away. Their best configs are the warm start of its
search (enqueued as the study's first trials), instead of a hand-set default.

Nearness, most important first: the same dtype and mask kind (full, causal, sliding window,
document...), then the head dim (in powers of two), then the GQA ratio, then the sequence-
length bucket. Results come from the user's database and the shipped tuning_db/, on the same
GPU model (name, capability, SMs); the templates and Triton versions may differ (a config
is a hint here, and the search measures it again).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping

from ..config import ConfigError, KernelConfig
from .env import EnvInfo


def mask_kind(canonical: Mapping) -> str:
    """'full', 'causal' or the mask's own kind ('sliding_window', 'document', 'or', ...)."""
    mask = canonical.get("mask")
    if isinstance(mask, Mapping) and mask:
        return str(next(iter(mask)))
    return "causal" if canonical.get("causal") else "full"


def _distance(target: Mapping, other: Mapping, bucket: int, other_bucket: int) -> tuple:
    def log2(x) -> float:
        return math.log2(max(1, int(x or 1)))

    def ratio(c) -> float:
        return (c.get("num_heads") or 1) / max(1, c.get("num_kv_heads") or c.get("num_heads") or 1)

    return (other.get("dtype") != target.get("dtype"), mask_kind(other) != mask_kind(target),
            abs(log2(other.get("head_dim")) - log2(target.get("head_dim"))),
            abs(math.log2(ratio(other)) - math.log2(ratio(target))), abs(log2(other_bucket) - log2(bucket)))


def warm_starts(spec_key: str, canonical: Mapping, here: EnvInfo, bucket: int, phase: str, rows: Iterable[dict],
                knobs: Iterable[str], k: int = 3) -> list[dict]:
    """The ``knobs`` of the best configs of the ``k`` nearest other specs (rows in the store's
    row format: spec_key, spec, environment, bucket, phase, config) tuned on this GPU model,
    nearest first, without repeats."""
    if phase in ("fwd", "bwd"):  # decode's knobs are all its own
        knobs = [n for n in knobs if n in KernelConfig.phase_knobs(phase)] or list(knobs)
    knobs = list(knobs)
    ranked = sorted(
        (r for r in rows if r["phase"] == phase and r["spec_key"] != spec_key
         and all(r["environment"].get(f) == getattr(here, f) for f in ("gpu", "capability", "sm_count"))),
        key=lambda r: (_distance(canonical, r["spec"], bucket, r["bucket"]), r["ms"]))
    points: list[dict] = []
    for row in ranked:
        config = _knobs_of(row) if phase in ("fwd", "bwd") else row["config"]
        point = {n: config[n] for n in knobs if n in config}
        if len(point) == len(knobs) and point not in points:
            points.append(point)
        if len(points) == k:
            break
    return points


def _knobs_of(row: Mapping) -> dict:
    """Every knob of a stored prefill config, as KernelConfig reads it: to_dict() leaves out a
    LATER_KNOB at its off value (family 'portable', hopper_regs 240, ...), and a row stored before
    a knob existed has none. Taken as written, such a row broke the point's knob count on every GPU
    whose space has that knob: on the H100 (family, hopper_*) no shipped row warm-started a study.
    A row KernelConfig refuses gives no point."""
    try:
        return dataclasses.asdict(KernelConfig.from_dict(dict(row["config"])))
    except (ConfigError, TypeError, ValueError):
        return {}
