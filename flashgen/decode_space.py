"""Decode's knobs: the split count and tiles a decode call runs with, as declared data, and the
buckets tuned decode configs are stored under.

A decode config: num_splits (how many programs share one (batch element, KV head)'s keys),
BLOCK_N (keys per tile), num_warps, num_stages, page_prefetch (a paged cache's next page
numbers read one tile ahead). The heuristic default (flashgen/runtime/decode.py,
decode_knobs) splits only when the grid does not fill the SMs (FA3's rule).

Buckets: a decode call's knobs depend on its shapes only, never on cache_seqlens (CUDA graphs):
the KV length is the cache's capacity, bucketed in powers of two like prefill's sequence
lengths, and the batch, in powers of two too. In the results database a decode result is a
best-config row whose bucket is the KV-length bucket and whose phase is ``dec<batch bucket>``
("dec8": batches near 8), so decode needs no schema change and shares prefill's studies,
environments, import/export and tuning_db/ files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from .config import ConfigError
from .runtime.host import padded_head_dim
from .space import DeviceLimits, Restriction, SearchSpace, bucket_of
from .spec import AttentionSpec

PHASE_PREFIX = "dec"
MAX_BATCH_BUCKET = 1 << 16
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # the split counts searched on a GPU


def decode_phase(batch_bucket: int) -> str:
    """The phase name of a batch bucket: 'dec8'."""
    return f"{PHASE_PREFIX}{batch_bucket}"


def phase_batch(phase) -> int | None:
    """The batch bucket of a decode phase ('dec8' -> 8); None for any other phase."""
    if not isinstance(phase, str) or not phase.startswith(PHASE_PREFIX) or not phase[3:].isdigit():
        return None
    batch = int(phase[3:])
    return batch if 1 <= batch <= MAX_BATCH_BUCKET and not batch & (batch - 1) and phase[3] != "0" else None


@dataclass(frozen=True)
class DecodeConfig:
    """One point of the decode space; from_dict checks every knob and names the bad one."""

    num_splits: int = 1  # programs sharing one (batch element, KV head)'s keys, merged by the combine kernel
    BLOCK_N: int = 64  # keys per tile
    num_warps: int = 4
    num_stages: int = 3  # K/V tiles in flight
    page_prefetch: bool = True  # a paged tile's page numbers read one tile ahead

    @classmethod
    def from_dict(cls, data: Mapping) -> "DecodeConfig":
        unknown = sorted(set(data) - set(cls.__dataclass_fields__), key=str)
        if unknown:
            raise ConfigError(f"decode config knob {unknown[0]!r}: unknown (known: "
                              + ", ".join(cls.__dataclass_fields__) + ")")
        return cls(**dict(data))

    def __post_init__(self):
        checks = {"num_splits": range(1, 129), "BLOCK_N": (16, 32, 64, 128, 256), "num_warps": (1, 2, 4, 8, 16),
                  "num_stages": range(1, 7)}
        for name, allowed in checks.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value not in allowed:
                shown = f"an int from {allowed.start} to {allowed.stop - 1}" if isinstance(allowed, range) else \
                    f"one of {allowed}"
                raise ConfigError(f"decode config knob '{name}': expected {shown}, got {value!r}")
        if not isinstance(self.page_prefetch, bool):
            raise ConfigError(f"decode config knob 'page_prefetch': expected a bool, got {self.page_prefetch!r}")

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    def replace(self, **changes) -> "DecodeConfig":
        return DecodeConfig.from_dict({**self.to_dict(), **changes})


def decode_space(spec: AttentionSpec, device: DeviceLimits, default: DecodeConfig | None = None) -> SearchSpace:
    """The decode knobs the tuner searches, with the restriction that the K/V tiles in flight
    fit; the default's values are added to the choices (the tuner always measures it)."""
    elem = 4 if spec.dtype == "fp32" else 2
    dims = padded_head_dim(spec.head_dim) + padded_head_dim(spec.head_dim_v)
    if device.interpret:
        params = dict(num_splits=(1, 2, 3), BLOCK_N=(16, 32), num_warps=(4,), num_stages=(1,), page_prefetch=(True,))
    else:
        params = dict(num_splits=SPLITS, BLOCK_N=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3, 4),
                      page_prefetch=(True, False))
    if default is not None:
        params = {n: tuple(sorted(set(c) | {getattr(default, n)})) for n, c in params.items()}
    return SearchSpace("decode", params, [
        Restriction(f"smem = {elem}*num_stages*BLOCK_N*{dims} <= {device.smem_bytes:g}",
                    lambda p: elem * p["num_stages"] * p["BLOCK_N"] * dims <= device.smem_bytes),
    ])


def buckets(kv_lengths, batches) -> list[tuple[int, int]]:
    """The (KV-length bucket, batch bucket) pairs a spec's tune.decode names."""
    return sorted({(bucket_of(kv), bucket_of(b)) for kv in kv_lengths for b in batches})


def tuned_lookup(rows: Mapping):
    """From best rows {bucket: {phase: row}} (flashgen.db: matching_best, shipped_best), a
    function (batch, capacity) -> the decode knobs stored for the call's own (KV-length bucket,
    batch bucket) (bucket_of each, as the tuner files them), else None: an untuned bucket runs
    the heuristic defaults, as prefill's untuned buckets run theirs. (Before, the nearest stored
    bucket served every call: a split count tuned for B=8 x 8K keys (2 splits of 8 KV heads, 128
    programs) ran B=1 x 128K keys on 16 programs, 1050 us on the H100 against the heuristic's 190.)
    None when rows hold no valid decode result."""
    table = {}
    for bucket, phases in rows.items():
        for phase, row in phases.items():
            batch = phase_batch(phase)
            if batch is None:
                continue
            try:
                table[(bucket, batch)] = DecodeConfig.from_dict(row["config"]).to_dict()
            except (ConfigError, TypeError, KeyError, AttributeError):
                continue  # a malformed row: `flashgen db check` reports it
    if not table:
        return None

    def lookup(batch: int, capacity: int):
        return table.get((bucket_of(capacity), bucket_of(batch)))

    return lookup


