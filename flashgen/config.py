"""KernelConfig: the knobs the tuner searches, and the heuristic default.

Only ``loop_order`` changes the rendered source (it is *structural*); every other
knob is a ``tl.constexpr`` or a launch option of the same kernel.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .spec import AttentionSpec

LOOP_ORDERS = ("q_outer", "kv_outer")
_BLOCKS = (16, 32, 64, 128, 256)
_WARPS = (1, 2, 4, 8, 16)

# GPU families by target name; used for the heuristic defaults.
_ARCH = {
    "h100": "sm90", "h200": "sm90",
    "a100": "sm80", "a10g": "sm86", "rtx3090": "sm86",
    "l40s": "sm89", "l4": "sm89", "rtx4090": "sm89",
    "cpu": "interpret",
}


class ConfigError(ValueError):
    """A kernel config knob has an impossible value."""


@dataclass(frozen=True)
class KernelConfig:
    BLOCK_M: int = 64
    BLOCK_N: int = 64
    num_warps: int = 4
    num_stages: int = 2
    loop_order: str = "q_outer"

    STRUCTURAL = ("loop_order",)

    def __post_init__(self):
        for name in ("BLOCK_M", "BLOCK_N"):
            value = getattr(self, name)
            if isinstance(value, bool) or value not in _BLOCKS:
                raise ConfigError(f"config knob '{name}': expected one of {_BLOCKS}, got {value!r}")
        if isinstance(self.num_warps, bool) or self.num_warps not in _WARPS:
            raise ConfigError(f"config knob 'num_warps': expected one of {_WARPS}, got {self.num_warps!r}")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ConfigError(f"config knob 'num_stages': expected an integer from 1 to 8, got {self.num_stages!r}")
        if self.loop_order not in LOOP_ORDERS:
            raise ConfigError(f"config knob 'loop_order': expected one of {LOOP_ORDERS}, got {self.loop_order!r}")

    @classmethod
    def from_dict(cls, data: dict) -> "KernelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"config knob '{unknown[0]}': unknown (known: {', '.join(sorted(known))})")
        return cls(**data)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def structural(self) -> dict:
        return {k: getattr(self, k) for k in self.STRUCTURAL}

    def replace(self, **changes) -> "KernelConfig":
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        return (f"BLOCK_M={self.BLOCK_M} BLOCK_N={self.BLOCK_N} warps={self.num_warps} "
                f"stages={self.num_stages} {self.loop_order}")


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def detect_target() -> str:
    """The target name of the current device: 'cpu' under the interpreter."""
    if interpreting():
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    for target in _ARCH:
        if target in name.replace(" ", ""):
            return target
    major, minor = torch.cuda.get_device_capability()
    return {(9, 0): "h100", (8, 0): "a100", (8, 6): "a10g", (8, 9): "l40s"}.get((major, minor), "a100")


def default_config(spec: AttentionSpec, target: str | None = None) -> KernelConfig:
    """A sound untuned config for (head dim, dtype, GPU family)."""
    target = target or (spec.target if spec.target != "auto" else detect_target())
    arch = _ARCH.get(target, "sm80")
    d = max(spec.head_dim, spec.head_dim_v)
    if arch == "interpret":
        # The interpreter runs each program in numpy: fewer, larger tiles are faster.
        return KernelConfig(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
    if spec.dtype == "fp32":
        if d <= 64:
            return KernelConfig(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
        return KernelConfig(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1 if d > 128 else 2)
    if arch == "sm90":
        # From the H100 sweep in benchmarks/results (bf16, 16k tokens, triton 3.6).
        if d <= 64:
            return KernelConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
        if d <= 128 and spec.causal:
            return KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
        if d <= 128:
            return KernelConfig(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
        return KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
    if d <= 64:
        return KernelConfig(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    if d <= 128:
        return KernelConfig(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=2)
    return KernelConfig(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1)
