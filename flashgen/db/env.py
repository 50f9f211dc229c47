"""Where a result was measured (EnvInfo), and whether it serves the machine asking.

A stored result records its whole environment, but only part of it decides how fast a
kernel runs: the GPU model (name, compute capability, SM count), the kernel's source (the
templates hash) and the Triton release that compiles it (major.minor: code generation
changes between minor releases, not between patch releases). torch, CUDA, the flashgen
version, the GPU's reported memory and Triton's patch release do not change the compiled
kernel, so they only rank results:

- ``exact``: every field equal; always preferred.
- ``near``: the same GPU model, templates hash and Triton major.minor, anything else
  different (another torch or CUDA build, triton 3.6.1 for a result tuned with 3.6.0).
  Used, and labelled as such wherever flashgen says where a config came from.
- otherwise the result is for another machine or other kernels: never used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

EXACT, NEAR = "exact", "near"
SPEED_FIELDS = ("gpu", "capability", "sm_count", "templates")  # plus Triton's major.minor
RANK_FIELDS = ("triton", "torch", "cuda", "flashgen", "memory_gib")  # among near matches, most equal first


@dataclass(frozen=True)
class EnvInfo:
    """The environment a result was measured in (see the module's docstring for which fields
    must match for the result to be used)."""

    gpu: str
    capability: str
    sm_count: int
    memory_gib: float
    torch: str
    triton: str
    cuda: str
    flashgen: str
    templates: str

    @classmethod
    def current(cls, interpret: bool = False) -> "EnvInfo":
        import torch
        import triton

        from .. import __version__
        from ..codegen.render import templates_hash

        if interpret or not torch.cuda.is_available():
            gpu, cap, sms, mem, cuda = "triton-interpreter", "cpu", 0, 0.0, "none"
        else:
            props = torch.cuda.get_device_properties(0)
            gpu, cap, sms = props.name, f"{props.major}.{props.minor}", props.multi_processor_count
            mem, cuda = round(props.total_memory / 2**30, 1), str(torch.version.cuda)
        return cls(gpu=gpu, capability=cap, sm_count=sms, memory_gib=mem, torch=torch.__version__.split("+")[0],
                   triton=triton.__version__, cuda=cuda, flashgen=__version__, templates=templates_hash())

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def match(self, stored: Mapping) -> str | None:
        """EXACT, NEAR or None: whether a result measured in ``stored`` (an environment as a
        mapping) serves this environment."""
        if all(stored.get(f) == getattr(self, f) for f in self.__dataclass_fields__):
            return EXACT
        if all(stored.get(f) == getattr(self, f) for f in SPEED_FIELDS) and \
                triton_minor(stored.get("triton")) == triton_minor(self.triton):
            return NEAR
        return None

    def rank(self, stored: Mapping) -> tuple[int, ...]:
        """Sort key among the results that match: exact first, then the near match that shares
        the most of Triton's patch release, torch, CUDA, flashgen and memory (in that order)."""
        return (self.match(stored) != EXACT,) + tuple(stored.get(f) != getattr(self, f) for f in RANK_FIELDS)

    def differences(self, stored: Mapping) -> str:
        """What a near match was measured with, where it differs from here: 'torch 2.11.0, triton 3.6.0'."""
        return ", ".join(f"{f} {stored.get(f)}" for f in RANK_FIELDS if stored.get(f) != getattr(self, f))


def triton_minor(version) -> str | None:
    """'3.6' for '3.6.1' (or '3.6.0+git1234'); None for what is not a version."""
    if not isinstance(version, str):
        return None
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 else None


def pick(here: EnvInfo, rows: Iterable[dict]) -> dict[int, dict[str, dict]]:
    """{bucket: {phase: row}}: per bucket and phase, the row (each with an 'environment'
    mapping) that serves ``here`` best; rows for other machines are left out. Each chosen row
    gains 'match' (EXACT or NEAR). Ties keep the earlier row."""
    out: dict[int, dict[str, dict]] = {}
    ranks: dict[tuple, tuple] = {}
    for row in rows:
        if here.match(row["environment"]) is None:
            continue
        key, rank = (row["bucket"], row["phase"]), here.rank(row["environment"])
        if key not in ranks or rank < ranks[key]:
            ranks[key] = rank
            out.setdefault(row["bucket"], {})[row["phase"]] = dict(row, match=here.match(row["environment"]))
    return out


def source_label(where: str, here: EnvInfo, rows: dict[int, dict[str, dict]]) -> str:
    """'tuning_db' for exact matches; 'tuning_db (near match: tuned with torch 2.11.0, ...)'
    when any row used is a near match."""
    near = [r for phases in rows.values() for r in phases.values() if r.get("match") == NEAR]
    if not near:
        return where
    measured = sorted({here.differences(r["environment"]) for r in near})
    return f"{where} (near match: tuned with {'; '.join(measured)})"
