"""What one tuning result must hold, checked where results enter flashgen (``import``, the
shipped tuning_db/ files), where they are used (``flashgen.load``) and by ``flashgen db check``.

A result that passed these checks cannot make a kernel call fail: its bucket is a power of
two (the call picks the nearest bucket in log scale), its phase is known, its config builds
a KernelConfig, and its timings are finite numbers.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

from ..config import ConfigError, KernelConfig
from ..errors import short_repr
from ..spec import canonical_key

PHASES = ("fwd", "bwd")
MAX_BUCKET = 1 << 30
ENVIRONMENT_FIELDS = {"gpu": str, "capability": str, "sm_count": int, "memory_gib": (int, float), "torch": str,
                      "triton": str, "cuda": str, "flashgen": str, "templates": str}
KERNEL_HASH = re.compile(r"[0-9a-f]{16}")  # flashgen.codegen.render.kernel_hash, flashgen.db.kernels.default_kernel
MAX_TEXT = 256  # the longest spec uri / environment string the schema stores
MIN_MS = 1e-4  # the shortest time a result may hold: 0.1 us, below any kernel launch


class ResultRowError(ValueError):
    """A tuning result has a malformed field."""

    def __init__(self, field: str, message: str, value: Any = dataclasses.MISSING):
        self.field, self.message, self.value = field, message, value
        got = "" if value is dataclasses.MISSING else f", got {short_repr(value)}"
        super().__init__(f"field '{field}': {message}{got}")


def _number(field: str, value: Any, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ResultRowError(field, "expected a finite number", value)
    if value < 0 or (positive and value == 0):
        raise ResultRowError(field, "expected a positive number" if positive else "expected a number >= 0", value)


def _text(field: str, value: Any) -> None:
    if not isinstance(value, str) or not value or len(value) > MAX_TEXT or not value.isprintable():
        raise ResultRowError(field, f"expected a non-empty printable string of at most {MAX_TEXT} characters",
                             value)


def check_bucket(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BUCKET \
            or value & (value - 1):
        raise ResultRowError("bucket", f"expected a power of two from 1 to {MAX_BUCKET}", value)
    return value


def check_config(value: Any, field: str = "config", config_type=KernelConfig):
    """A config of config_type (KernelConfig, or decode's DecodeConfig), built from a mapping."""
    if not isinstance(value, Mapping):
        raise ResultRowError(field, "expected a mapping of kernel knobs", value)
    try:
        return config_type.from_dict(dict(value))
    except ConfigError as err:
        raise ResultRowError(field, str(err)) from None
    except TypeError as err:  # a key that is not a string
        raise ResultRowError(field, f"not a mapping of knob names ({err})", value) from None


def check_best(row: Mapping) -> None:
    """A best-config row: bucket, phase, config, ms, tflops and default_ms. A decode row's phase
    is 'dec<batch bucket>' and its config holds decode knobs (flashgen.decode_space)."""
    from ..decode_space import DecodeConfig, phase_batch

    check_bucket(row.get("bucket"))
    decode = phase_batch(row.get("phase")) is not None
    if row.get("phase") not in PHASES and not decode:
        raise ResultRowError("phase", "expected one of " + ", ".join(PHASES) + " or dec<batch bucket> ('dec8')",
                             row.get("phase"))
    check_config(row.get("config"), config_type=DecodeConfig if decode else KernelConfig)
    _number("ms", row.get("ms"), positive=True)
    if row["ms"] < MIN_MS:  # (no launch completes this fast: such a time would beat every real one of its bucket)
        raise ResultRowError("ms", f"expected a time of at least {MIN_MS} ms", row["ms"])
    _number("tflops", row.get("tflops"), positive=False)
    if row.get("default_ms") is not None:
        _number("default_ms", row["default_ms"], positive=True)


def check_row(row: Mapping) -> None:
    """A whole exported row: the best config, its environment, its spec, its kernel hash and its
    default's (both optional)."""
    check_best(row)
    check_environment(row.get("environment"))
    for field, what in (("kernel", "the kernels' hash"), ("default_kernel", "the default's kernel hash")):
        value = row.get(field)
        if value is not None and not (isinstance(value, str) and KERNEL_HASH.fullmatch(value)):
            raise ResultRowError(field, f"expected {what} (16 hex digits) or nothing", value)
    _text("spec_key", row.get("spec_key"))
    _text("spec", row.get("spec_uri"))
    check_canonical(row.get("spec"))
    key = canonical_key(row["spec"])
    if row["spec_key"] != key:  # an edited canonical (or key): the row would serve, or name, another spec
        raise ResultRowError("spec_key", f"expected the key of the row's canonical spec, {key}", row["spec_key"])


def check_environment(env: Any, prefix: str = "environment.") -> None:
    """An environment mapping: every field of ENVIRONMENT_FIELDS, each of its type (fields named with
    `prefix`: a row's 'environment.gpu', a database environment's own 'gpu')."""
    if not isinstance(env, Mapping) or set(env) != set(ENVIRONMENT_FIELDS):
        raise ResultRowError("environment", "expected a mapping with keys " + ", ".join(ENVIRONMENT_FIELDS), env)
    for name, kind in ENVIRONMENT_FIELDS.items():
        value = env[name]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ResultRowError(f"{prefix}{name}", f"expected {'a string' if kind is str else 'a number'}", value)
        if kind is str:
            _text(f"{prefix}{name}", value)
        elif not math.isfinite(value) or value < 0:  # sm_count, memory_gib (0 under the interpreter)
            raise ResultRowError(f"{prefix}{name}", "expected a finite number >= 0", value)


def check_canonical(value: Any) -> None:
    """A spec's canonical form: a mapping."""
    if not isinstance(value, Mapping):
        raise ResultRowError("canonical", "expected the spec's canonical mapping", value)
