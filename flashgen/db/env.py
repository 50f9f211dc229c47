"""Where a result was measured (EnvInfo), and whether it serves the machine asking.

A stored result records its whole environment, but only part of it decides how fast a
kernel runs: the GPU model (name, compute capability, SM count), the kernels that were timed
and the Triton release that compiles them (major.minor: code generation changes between
minor releases, not between patch releases). The kernels are named by the result's kernel
hash (flashgen.codegen.render.kernel_hash: the source of the kernels its phase times, for
its spec and config), compared with the hash of what this flashgen renders for the same
spec and config; a result stored before kernel hashes (``kernel`` None) is compared by the
templates hash of its environment instead, as it always was. torch, CUDA, the flashgen
version, the GPU's reported memory, Triton's patch release and (for a result with a kernel
hash) the templates hash do not change the compiled kernel, so they only rank results:

- ``exact``: every field equal; always preferred.
- ``near``: the same GPU model, kernels and Triton major.minor, anything else different
  (another torch or CUDA build, triton 3.6.1 for a result tuned with 3.6.0). Used, and
  labelled as such wherever flashgen says where a config came from.
- ``stale``: measured on this GPU model and Triton major.minor, but for kernels this
  flashgen no longer renders (the templates changed what the spec's kernels are): never
  used, and said (``flashgen show``, ``flashgen tune``, the fallback warning of ``load``).
- otherwise (None) the result is for another machine: never used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

EXACT, NEAR, STALE = "exact", "near", "stale"
MODEL_FIELDS = ("gpu", "capability", "sm_count")  # the GPU model; plus Triton's major.minor: the machine
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
        from ..config import interpreting

        # Under TRITON_INTERPRET the kernels run interpreted whatever GPU the machine has: its results
        # are the interpreter's (as `flashgen tune --interpret` stores them), as detect_target's 'cpu'.
        if interpret or interpreting() or not torch.cuda.is_available():
            gpu, cap, sms, mem, cuda = "triton-interpreter", "cpu", 0, 0.0, "none"
        else:
            props = torch.cuda.get_device_properties(0)
            gpu, cap, sms = props.name, f"{props.major}.{props.minor}", props.multi_processor_count
            mem, cuda = round(props.total_memory / 2**30, 1), str(torch.version.cuda)
        return cls(gpu=gpu, capability=cap, sm_count=sms, memory_gib=mem, torch=torch.__version__.split("+")[0],
                   triton=triton.__version__, cuda=cuda, flashgen=__version__, templates=templates_hash())

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def match(self, stored: Mapping, kernel: str | None = None, current: str | None = None) -> str | None:
        """EXACT, NEAR, STALE or None: whether a result measured in ``stored`` (an environment
        as a mapping) serves this environment. ``kernel``: the result's kernel hash (None for a
        result stored before kernel hashes); ``current``: the hash of the kernels this flashgen
        renders for the result's spec, config and phase (None where it cannot tell). Without
        both, the templates hash decides whether the kernels are the same."""
        if not self.same_machine(stored):
            return None
        by_kernel = kernel is not None and current is not None
        if (kernel != current) if by_kernel else (stored.get("templates") != self.templates):
            return STALE
        compared = [f for f in self.__dataclass_fields__ if not (by_kernel and f == "templates")]
        return EXACT if all(stored.get(f) == getattr(self, f) for f in compared) else NEAR

    def same_machine(self, stored: Mapping) -> bool:
        """The same GPU model and Triton major.minor: what a result needs before its kernels count."""
        return all(stored.get(f) == getattr(self, f) for f in MODEL_FIELDS) and \
            triton_minor(stored.get("triton")) == triton_minor(self.triton)

    def rank(self, stored: Mapping, match: str) -> tuple[int, ...]:
        """Sort key among the results that match (``match``, what ``match`` said of ``stored``):
        exact first, then the near match that shares the most of Triton's patch release, torch,
        CUDA, flashgen and memory (in that order)."""
        return (match != EXACT,) + tuple(stored.get(f) != getattr(self, f) for f in RANK_FIELDS)

    def differences(self, stored: Mapping) -> str:
        """What a near match was measured with, where it differs from here: 'torch 2.11.0, triton 3.6.0'."""
        return ", ".join(f"{f} {stored.get(f)}" for f in RANK_FIELDS if stored.get(f) != getattr(self, f))


def triton_minor(version) -> str | None:
    """'3.6' for '3.6.1' (or '3.6.0+git1234'); None for what is not a version."""
    if not isinstance(version, str):
        return None
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 else None


def pick(here: EnvInfo, rows: Iterable[dict], current: Callable[[dict], str | None] | None = None
         ) -> dict[int, dict[str, dict]]:
    """{bucket: {phase: row}}: per bucket and phase, the row (each with an 'environment'
    mapping and maybe a 'kernel' hash) that serves ``here`` best; rows for other machines and
    stale rows are left out. ``current(row)``: the hash of the kernels this flashgen renders
    for the row (flashgen.db.kernels.current_kernel), asked only of rows with a kernel hash on
    this GPU model. Each chosen row gains 'match' (EXACT or NEAR). Among equals, the faster."""
    out: dict[int, dict[str, dict]] = {}
    ranks: dict[tuple, tuple] = {}
    for row in rows:
        match = classify(here, row, current)
        if match not in (EXACT, NEAR):
            continue
        key, rank = (row["bucket"], row["phase"]), here.rank(row["environment"], match) + (_ms(row),)
        if key not in ranks or rank < ranks[key]:
            ranks[key] = rank
            out.setdefault(row["bucket"], {})[row["phase"]] = dict(row, match=match)
    return out


def classify(here: EnvInfo, row: Mapping, current: Callable[[dict], str | None] | None = None) -> str | None:
    """What ``here.match`` says of one stored row (see pick for ``current``)."""
    env, kernel = row["environment"], row.get("kernel")
    if kernel is None or current is None or not here.same_machine(env):
        return here.match(env)
    return here.match(env, kernel, current(row))


def _ms(row: Mapping) -> float:
    ms = row.get("ms")
    return ms if isinstance(ms, (int, float)) and not isinstance(ms, bool) else float("inf")


def source_label(where: str, here: EnvInfo, rows: dict[int, dict[str, dict]]) -> str:
    """'tuning_db' for exact matches; 'tuning_db (near match: tuned with torch 2.11.0, ...)'
    when any row used is a near match."""
    near = [r for phases in rows.values() for r in phases.values() if r.get("match") == NEAR]
    if not near:
        return where
    measured = sorted({here.differences(r["environment"]) for r in near})
    return f"{where} (near match: tuned with {'; '.join(measured)})"
