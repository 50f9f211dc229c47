"""KernelConfig: the knobs the tuner searches, and the heuristic defaults.

``loop_order``, ``bwd_persistent``, ``bwd_fused_delta``, ``bwd_dq_heavy_first``, ``bwd_heavy_first``, ``bwd_short``
and ``family`` change the rendered source (they are *structural*); every other knob is a ``tl.constexpr`` or a launch
option of the same kernel.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from .spec import AttentionSpec

LOOP_ORDERS = ("q_outer", "kv_outer")
FAMILIES = ("portable", "hopper_ws")  # hopper_ws: the Gluon warp-specialized sm90 forward (templates/hopper/)
HOPPER_BLOCK_M = (64, 128, 192)  # hopper_ws: 64 query rows per consumer warpgroup, one to three consumers
HOPPER_THREE_REGS = 160  # three consumers' registers per thread at most: 3 x 128 x 160 + 128 x 24 of the SM's 65536
HOPPER_BLOCK_N = (64, 128, 256)  # 256: FP8 only (check_spec): 64 x 256 S beside bf16 P and O overflows 240 registers
HOPPER_STAGES = (2, 3, 4)
# the hopper_ws defaults' starting point (_hopper_ws_default, _hopper_ws_fp8_default): two 64-row consumers
HOPPER_DEFAULT_TILE = dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2, family="hopper_ws")
# ... with the persistent grid, FA3's overlap and O by a TMA store: the hd128 default, and prefix-LM masks'
HOPPER_ALL_THREE = dict(HOPPER_DEFAULT_TILE, hopper_persistent=True, hopper_overlap=True, hopper_tma_store=True)
# head dim 256 at 16 bits: 64-key blocks (128-key ones do not fit two stages beside Q), no TMA store (no room)
HOPPER_HD256 = dict(HOPPER_DEFAULT_TILE, BLOCK_N=64, hopper_persistent=True, hopper_overlap=True)
HOPPER_REGS = (160, 168, 200, 216, 232, 240)  # consumer registers per thread (setmaxnreg); the producer keeps 24
DQ_STRATEGIES = ("separate", "atomic")
_BLOCKS = (16, 32, 64, 128, 256)
_WARPS = (1, 2, 4, 8, 16)
HOPPER_SMEM = 232448  # shared memory per block on sm90 (opt-in), bytes: where the hopper_ws family runs
HOPPER_SMEM_RESERVE = 1024  # the Gluon forward's mbarriers and alignment beside its tiles (440-504 bytes measured)
PERSISTENT = (0, 1, 2, 3, 4, 8)  # bwd_persistent: dK/dV programs per SM (0: one per key block)

# GPU families by target name; used for the heuristic defaults.
_ARCH = {
    "h100": "sm90", "h200": "sm90",
    "a100": "sm80", "a10g": "sm86", "rtx3090": "sm86",
    "l40s": "sm89", "l4": "sm89", "rtx4090": "sm89",
    "cpu": "interpret",
}


class ConfigError(ValueError):
    """A kernel config knob has an impossible value."""


def hopper_ws_smem(spec: AttentionSpec, block_m: int, block_n: int, num_stages: int, tma_store: bool) -> int:
    """Bytes of shared memory the Gluon forward (family hopper_ws) takes: its Q tile and num_stages K and V
    tiles, the 16-bit O tiles a TMA store leaves from (P stays in registers), and a reserve for its mbarriers
    (templates/hopper/forward.j2 allocates these; hd128 bf16 128 x 128 x 3 stages with the TMA store asked
    triton 3.6 for 262648 bytes, 504 beside the tiles' 262144; 2 stages compiled by triton 3.9 to 197048, 440
    beside 196608). Tile sums are multiples of 4096 bytes, so the reserve refuses nothing that fits."""
    from .runtime.host import padded_head_dim  # the BLOCK_D render.py gives the kernels

    bd, bdv = padded_head_dim(spec.head_dim), padded_head_dim(spec.head_dim_v)
    ring = spec.torch_dtype.itemsize * (block_m * bd + num_stages * block_n * (bd + bdv))
    return ring + tma_store * 2 * block_m * bdv + HOPPER_SMEM_RESERVE


def _int(value) -> bool:
    """A knob's value is an int (not a bool, not a float equal to one: 16.0 would reach the kernels)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class KernelConfig:
    # forward
    BLOCK_M: int = 64
    BLOCK_N: int = 64
    num_warps: int = 4
    num_stages: int = 2
    loop_order: str = "q_outer"
    # Hopper (sm90+), Q-outer forward: tiles through tensor descriptors (the TMA copy engine),
    # and the whole-block loop split into producer/consumer warps (tl.range warp_specialize).
    tma: bool = False
    warp_specialize: bool = False
    # backward: the dK/dV kernel's tiles (M1 query rows x N1 keys), the dQ kernel's (M2 x N2)
    BLOCK_M1: int = 32
    BLOCK_N1: int = 64
    BLOCK_M2: int = 64
    BLOCK_N2: int = 32
    bwd_num_warps: int = 4
    bwd_num_stages: int = 2
    dq_strategy: str = "separate"  # or "atomic": dQ added from the dK/dV kernel
    bwd_tma: bool = False  # Q/dO tiles (dK/dV kernel) and K/V tiles (dQ kernel) through tensor descriptors
    # dK/dV grid: 0 = a program per key block; n = about n programs per SM in all, each walking
    # key blocks p, p + P, ... in turn (for short walks: narrow bands, short sequences).
    bwd_persistent: int = 0
    # delta = rowsum(dO * O) computed by the dQ kernel from the rows it loads anyway, the dQ
    # kernel run before dK/dV: no preprocess pass re-reading O and dO, one launch fewer
    # (separate dQ only: the atomic strategy has no dQ kernel).
    bwd_fused_delta: bool = False
    # dK/dV from the Gluon warp-specialized sm90 kernel (templates/hopper/backward.j2: a producer warp
    # feeding (Q, dO) tiles by TMA and their LSE and delta rows to two consumer warpgroups of 64 keys
    # each; runtime/hopper_bwd.py), where it serves the call; preprocess and dQ stay portable. Rendered
    # only when on. With dq_strategy 'atomic' in the config it adds dQ itself (FA3's five MMAs per pair:
    # dS^T through shared memory, each consumer's float32 dQ tile added by the copy engine's bulk
    # reduce; the sm90 defaults where measured faster: _hopper_bwd_default). A call whose dQ strategy
    # differs from the config's (a call's dq_strategy, deterministic=True) runs the portable dK/dV, as
    # where the call is not served; such a call with the config's atomic dQ takes the separate dQ kernel.
    hopper_bwd: bool = False
    # dQ programs in reverse query-block order: with a causal-like mask the last query blocks see
    # the most keys, so they start first and the kernel's tail is made of short programs (the
    # Q-outer forward does the same).
    bwd_dq_heavy_first: bool = False
    # The backward's programs launched heaviest first over the whole grid (FA3's longest-first
    # schedule): the dK/dV kernel's key blocks in ascending order and the dQ kernel's query blocks
    # in descending order, each block's (head, batch) programs together. The default order runs
    # every block of one (head, batch) before the next, so with causal walks the last heads' longest
    # programs start last and run alone at the end (few, long programs: GQA, short sequences). The
    # dQ order supersedes bwd_dq_heavy_first's per-head one; a persistent dK/dV grid (bwd_persistent)
    # and the one-launch backward (bwd_short) keep their own.
    bwd_heavy_first: bool = False
    # The whole backward in one launch (templates/backward/short.j2): program i of (batch, KV head)
    # computes dK/dV of key block i (delta recomputed from each O/dO tile it loads) and then dQ of
    # query block i for every query head of the group, both on the BLOCK_M1 x BLOCK_N1 tiling: no
    # preprocess, no delta buffer, no second launch, no atomics. For short calls, whose backward is
    # host time (four launches and allocations); causal programs get equal work (n - i key-block
    # walk + i + 1 query-block walk). Needs dq_strategy 'separate'. Where it serves a call the other
    # backward knobs (M2/N2, bwd_tma, bwd_persistent, bwd_fused_delta, hopper_bwd) are unused; they
    # apply where it does not: a call's atomic dQ. A custom expression's kernel reads the block map in both
    # directions (made once per shape, or per call for a mask over named tensors, as the other kernels').
    bwd_short: bool = False

    # The forward's kernel family: "portable" (the Triton templates above) or "hopper_ws" (Gluon,
    # sm90: a TMA producer warp and BLOCK_M/64 consumer warpgroups; flashgen/runtime/hopper.py).
    # hopper_ws reads BLOCK_M (64 x consumers), BLOCK_N, num_stages (its K/V ring) and these two:
    family: str = "portable"
    hopper_regs: int = 240  # registers per consumer thread (gl.warp_specialize worker_num_regs)
    hopper_overlap: bool = False  # FA3's overlap: S_j issued beside P_{j-1} V_{j-1}, the softmax under P V
    hopper_pingpong: bool = False  # two consumers take turns at the tensor cores (FA3's ping-pong)
    # one program per SM walking work units of query tiles (a causal unit pairs a heavy tile with a
    # light one): the set-up is paid once per SM and the next tile's loads overlap this one's end
    hopper_persistent: bool = False
    # O leaves through shared memory and a TMA store (FA3's epilogue): the consumer writes its O tile to
    # shared memory and goes on while the copy engine stores it, where register stores cost a short walk
    # up to a sixth of its time (benchmarks/NOTES.md, session 18)
    hopper_tma_store: bool = False

    STRUCTURAL = ("loop_order", "bwd_persistent", "bwd_fused_delta", "family", "hopper_bwd", "bwd_dq_heavy_first",
                  "bwd_heavy_first", "bwd_short", "hopper_persistent")
    BACKWARD = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "bwd_num_warps", "bwd_num_stages", "dq_strategy",
                "bwd_tma", "bwd_persistent", "bwd_fused_delta", "hopper_bwd", "bwd_dq_heavy_first", "bwd_heavy_first",
                "bwd_short")
    # Knobs added after results were stored, with the value that renders the kernels as before
    # they existed: to_dict() leaves them out at that value, so the configs stored, shipped and
    # hashed before them keep their kernel ids and their rendered text byte for byte, and
    # from_dict() reads a missing one as that value.
    LATER_KNOBS = {"bwd_persistent": 0, "bwd_fused_delta": False, "family": "portable", "hopper_regs": 240,
                   "hopper_overlap": False, "hopper_pingpong": False, "hopper_bwd": False,
                   "bwd_dq_heavy_first": False, "bwd_heavy_first": False, "bwd_short": False,
                   "hopper_persistent": False, "hopper_tma_store": False}

    @classmethod
    def phase_knobs(cls, phase: str) -> tuple[str, ...]:
        """The knobs one phase owns: 'bwd' the backward's, 'fwd' every other."""
        if phase == "bwd":
            return cls.BACKWARD
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in cls.BACKWARD)

    def __post_init__(self):
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"):
            value = getattr(self, name)
            if name == "BLOCK_M" and _int(value) and value == 192 and self.family == "hopper_ws":
                continue  # three 64-row consumers (the family's check below)
            if not _int(value) or value not in _BLOCKS:
                raise ConfigError(f"config knob '{name}': expected one of {_BLOCKS}, got {value!r}")
        for name in ("num_warps", "bwd_num_warps"):
            value = getattr(self, name)
            if not _int(value) or value not in _WARPS:
                raise ConfigError(f"config knob '{name}': expected one of {_WARPS}, got {value!r}")
        for name in ("num_stages", "bwd_num_stages"):
            value = getattr(self, name)
            if not _int(value) or not 1 <= value <= 8:
                raise ConfigError(f"config knob '{name}': expected an integer from 1 to 8, got {value!r}")
        for name in ("tma", "warp_specialize", "bwd_tma", "bwd_fused_delta", "hopper_bwd", "bwd_dq_heavy_first",
                     "bwd_heavy_first", "hopper_overlap", "hopper_pingpong", "bwd_short", "hopper_persistent",
                     "hopper_tma_store"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"config knob '{name}': expected true or false, got {getattr(self, name)!r}")
        if self.warp_specialize and self.num_warps < 8:
            # triton 3.6 fails to split a 4-warp program into producer and consumer groups
            raise ConfigError(f"config knob 'warp_specialize': needs num_warps >= 8, got num_warps={self.num_warps}")
        if self.loop_order not in LOOP_ORDERS:
            raise ConfigError(f"config knob 'loop_order': expected one of {LOOP_ORDERS}, got {self.loop_order!r}")
        if self.dq_strategy not in DQ_STRATEGIES:
            raise ConfigError(f"config knob 'dq_strategy': expected one of {DQ_STRATEGIES}, got {self.dq_strategy!r}")
        if self.bwd_fused_delta and self.dq_strategy != "separate":
            raise ConfigError(f"config knob 'bwd_fused_delta': needs dq_strategy='separate' (the dQ kernel computes "
                              f"delta), got dq_strategy={self.dq_strategy!r}")
        if self.bwd_short and self.dq_strategy != "separate":
            raise ConfigError(f"config knob 'bwd_short': the one-launch backward computes dQ separately (no atomics), "
                              f"got dq_strategy={self.dq_strategy!r}")
        if self.family not in FAMILIES:
            raise ConfigError(f"config knob 'family': expected one of {FAMILIES}, got {self.family!r}")
        if self.family == "hopper_ws" and (self.BLOCK_M == 192) != (self.hopper_regs == HOPPER_THREE_REGS):
            raise ConfigError(f"config knobs 'BLOCK_M', 'hopper_regs': three consumers (BLOCK_M=192) take "
                              f"{HOPPER_THREE_REGS} registers each (the SM's 65536 over 512 threads) and one or two "
                              f"take more, got BLOCK_M={self.BLOCK_M} hopper_regs={self.hopper_regs}")
        if self.BLOCK_M == 192 and self.BLOCK_N == 256:
            raise ConfigError("config knobs 'BLOCK_M', 'BLOCK_N': three consumers (BLOCK_M=192) take 64- or 128-key "
                              "blocks (a 64 x 256 S alone fills their registers), got BLOCK_N=256")
        if self.hopper_pingpong and (self.BLOCK_M != 128 or self.hopper_overlap):
            raise ConfigError(f"config knob 'hopper_pingpong': needs two consumers (BLOCK_M=128) and no "
                              f"hopper_overlap, got BLOCK_M={self.BLOCK_M} hopper_overlap={self.hopper_overlap}")
        for name in ("hopper_persistent", "hopper_tma_store"):
            if getattr(self, name) and self.family != "hopper_ws":
                raise ConfigError(f"config knob '{name}': needs family 'hopper_ws', got {self.family!r}")
        if not _int(self.hopper_regs) or self.hopper_regs not in HOPPER_REGS:
            raise ConfigError(f"config knob 'hopper_regs': expected one of {HOPPER_REGS}, got {self.hopper_regs!r}")
        if self.family == "hopper_ws":
            for name, allowed in (("BLOCK_M", HOPPER_BLOCK_M), ("BLOCK_N", HOPPER_BLOCK_N),
                                  ("num_stages", HOPPER_STAGES)):
                if getattr(self, name) not in allowed:
                    raise ConfigError(f"config knob '{name}': family 'hopper_ws' takes one of {allowed}, "
                                      f"got {getattr(self, name)!r}")
            if self.loop_order != "q_outer":
                raise ConfigError(f"config knob 'family': 'hopper_ws' replaces the q_outer forward, got "
                                  f"loop_order={self.loop_order!r}")
        if not _int(self.bwd_persistent) or self.bwd_persistent not in PERSISTENT:
            raise ConfigError(f"config knob 'bwd_persistent': expected one of {PERSISTENT} (0 = off), "
                              f"got {self.bwd_persistent!r}")

    @classmethod
    def from_dict(cls, data: dict) -> "KernelConfig":
        if not isinstance(data, Mapping):
            raise ConfigError(f"config: expected a mapping of knob names to values, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known, key=str)
        if unknown:
            raise ConfigError(f"config knob '{unknown[0]}': unknown (known: {', '.join(sorted(known))})")
        return cls(**data)

    def to_dict(self) -> dict:
        """Every knob, less the LATER_KNOBS at their off value."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k not in self.LATER_KNOBS or v != self.LATER_KNOBS[k]}

    def structural(self) -> dict:
        return {k: getattr(self, k) for k in self.STRUCTURAL}

    def replace(self, **changes) -> "KernelConfig":
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        hopper = "".join(f" {name}" for name in ("tma", "warp_specialize") if getattr(self, name))
        if self.family != "portable":
            hopper += (f" {self.family} regs={self.hopper_regs}{' overlap' if self.hopper_overlap else ''}"
                       f"{' pingpong' if self.hopper_pingpong else ''}{' persistent' if self.hopper_persistent else ''}"
                       f"{' tma_store' if self.hopper_tma_store else ''}")
        return (f"BLOCK_M={self.BLOCK_M} BLOCK_N={self.BLOCK_N} warps={self.num_warps} "
                f"stages={self.num_stages} {self.loop_order}{hopper}")

    def check_spec(self, spec: AttentionSpec) -> "KernelConfig":
        """This config for this spec: a ConfigError where the family (or the Gluon backward) cannot
        serve the spec."""
        from .runtime.hopper import spec_unserved

        if self.family == "hopper_ws" and (reason := spec_unserved(spec)):
            raise ConfigError(f"config knob 'family': 'hopper_ws' cannot serve spec {spec.uri!r}: {reason}")
        if self.family == "hopper_ws" and self.BLOCK_M == 192 and spec.fp8:
            raise ConfigError(f"config knob 'BLOCK_M': family 'hopper_ws' takes three consumers (192) for fp16/bf16 "
                              f"(not measured or tested on FP8), got dtype {spec.dtype!r}")
        if self.family == "hopper_ws" and self.BLOCK_M == 192 and max(spec.head_dim, spec.head_dim_v) > 64:
            raise ConfigError(f"config knob 'BLOCK_M': family 'hopper_ws' takes three consumers (192) at head dims up "
                              f"to 64 only (their S and O accumulators fit {HOPPER_THREE_REGS} registers there), got head "
                              f"dim {max(spec.head_dim, spec.head_dim_v)}")
        if self.family == "hopper_ws" and self.BLOCK_N == 256 and not spec.fp8:
            raise ConfigError(f"config knob 'BLOCK_N': family 'hopper_ws' takes 256-key blocks for FP8 specs only "
                              f"(P in FP8 takes a quarter of the registers), got 256 for dtype {spec.dtype!r}")
        if self.family == "hopper_ws" and (need := hopper_ws_smem(spec, self.BLOCK_M, self.BLOCK_N, self.num_stages,
                                                                  self.hopper_tma_store)) > HOPPER_SMEM:
            raise ConfigError(f"config knobs 'BLOCK_M', 'BLOCK_N', 'num_stages', 'hopper_tma_store': family "
                              f"'hopper_ws' with "
                              f"BLOCK_M={self.BLOCK_M} BLOCK_N={self.BLOCK_N} num_stages={self.num_stages} "
                              f"hopper_tma_store={self.hopper_tma_store} needs {need} bytes of shared memory at head "
                              f"dim {spec.head_dim} ({spec.dtype}), more than an sm90 block's {HOPPER_SMEM}")
        if self.hopper_bwd and (reason := spec_unserved(spec, backward=True)):
            raise ConfigError(f"config knob 'hopper_bwd': the Gluon dK/dV kernel cannot serve spec {spec.uri!r}: "
                              f"{reason}")
        return self

    def describe_backward(self) -> str:
        return (f"M1={self.BLOCK_M1} N1={self.BLOCK_N1} M2={self.BLOCK_M2} N2={self.BLOCK_N2} "
                f"warps={self.bwd_num_warps} stages={self.bwd_num_stages} dq={self.dq_strategy}"
                f"{' tma' if self.bwd_tma else ''}"
                f"{f' persistent={self.bwd_persistent}' if self.bwd_persistent else ''}"
                f"{' fused_delta' if self.bwd_fused_delta else ''}{' hopper_bwd' if self.hopper_bwd else ''}"
                f"{' dq_heavy_first' if self.bwd_dq_heavy_first else ''}"
                f"{' heavy_first' if self.bwd_heavy_first else ''}"
                f"{' short' if self.bwd_short else ''}")


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


# ----------------------------------------------------------------------------- the heuristic defaults
# The sequence-length buckets the defaults are given for (powers of two, as flashgen.load's tuned
# buckets); a call uses the nearest one (host.nearest_bucket). The largest serves torch.compile,
# which binds one config for every length.
DEFAULT_BUCKETS = (256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)  # 256: calls of up to 512 tokens
SMALL_CALL = 512  # up to this length a call is host-bound: no tensor descriptors (their setup costs more host time)
DEFAULT_SEQLEN = 4096  # what default_config(spec) means without a length: the typical bucket


@dataclass(frozen=True)
class MaskShape:
    """What the defaults read from a spec's mask, from its pattern parameters alone (no tensors).

    band: the most keys one query row can see where a constant bounds it (a window's width, a
    chunk, sink tokens + window), else None (it grows with the sequence). causal: no row sees
    keys past its diagonal. documents: the visible ranges come from a tensor at run time
    (document ids); their length is unknown until a call. custom: a custom expression.
    """

    band: int | None = None
    causal: bool = False
    documents: bool = False
    custom: bool = False

    def narrow(self, seqlen: int) -> bool:
        """A band at most half the sequence: a query block walks a few key blocks, not a triangle."""
        return self.band is not None and 2 * self.band <= seqlen


def mask_shape(spec: AttentionSpec) -> MaskShape:
    """The MaskShape of the spec's whole mask (causal and mask: and-ed)."""
    return _node_shape(spec.mask_node)


def _node_shape(node) -> MaskShape:
    if node is None:
        return MaskShape()
    p = node.param
    if node.kind in ("and", "or"):
        kids = [_node_shape(c) for c in node.children]
        bands = [k.band for k in kids if k.band is not None]
        if node.kind == "and":  # the narrowest band bounds what a row sees; any causal child makes it causal
            band, causal = (min(bands) if bands else None), any(k.causal for k in kids)
        else:  # a union sees at most the sum of its bands
            band, causal = (sum(bands) if len(bands) == len(kids) else None), all(k.causal for k in kids)
        return MaskShape(band, causal, any(k.documents for k in kids), any(k.custom for k in kids))
    if node.kind == "causal":
        return MaskShape(causal=True)
    if node.kind == "sliding_window":
        bounded = p["left"] >= 0 and p["right"] >= 0
        return MaskShape(p["left"] + p["right"] + 1 if bounded else None, causal=p["right"] == 0)
    if node.kind == "chunked":
        return MaskShape(p["size"], causal=p["causal"])
    if node.kind == "sink":
        return MaskShape(p["tokens"] + p["window"] + 1, causal=True)
    if node.kind == "prefix_lm":  # the prefix block, then causal
        return MaskShape(causal=True)
    if node.kind == "document":
        return MaskShape(causal=p["causal"], documents=True)
    return MaskShape(custom=True)


def default_config(spec: AttentionSpec, target: str | None = None, seqlen: int | None = None, *,
                   hopper_ws: bool = True) -> KernelConfig:
    """A sound untuned config for (head dim, dtype, GPU family, mask shape, sequence length),
    forward and backward. seqlen: the call's length (None: DEFAULT_SEQLEN). hopper_ws=False: the
    portable family's default forward even where the Gluon family is the default (benchmarks)."""
    target = target or (spec.target if spec.target != "auto" else detect_target())
    arch = _ARCH.get(target, "sm80")
    d = max(spec.head_dim, spec.head_dim_v)
    seqlen = DEFAULT_SEQLEN if seqlen is None else seqlen
    shape = mask_shape(spec)
    forward = _forward_defaults(spec, arch, d, shape, seqlen, hopper_ws, target)
    backward = _backward_defaults(spec, arch, d, shape, seqlen)
    if arch == "sm90":
        backward.update(_hopper_bwd_default(spec, d, shape, seqlen, target))
    if arch == "sm90" and _padded_16_bit(spec):
        # A head dim under its tiles' width: the portable kernels read Q, K and V (and the backward's dO) through
        # descriptors, whose copy engine zero-fills the padding, instead of loads masked along the head dim (no
        # 16-byte copies: the pipeline starves); host-bound calls go without them below. H200, bf16, 16 heads,
        # 16384 tokens, forward TFLOP/s with / without (benchmarks/probe_padded_head_dims.py,
        # results/2026-11-29-h200-padded-head-dims-s37.md): hd40 S=1024 causal 127.7 / 69.9, S=1024 220.8 / 83.7,
        # S=4096 253.1 / 99.8; hd160 and hd192 within 5% either way (those, and hd40 but causal up to 2048
        # tokens off an H200, take the Gluon family there); 80-128 had them. The backward: hd40 causal fwd+bwd, its forward
        # on them already, 121 TFLOP/s at S=4096 without (0.88x SDPA's FlashAttention-2;
        # results/2026-11-29-h200-head-dims-s37-after.md), 189 with (-s37-hd40.md)
        if forward.get("family", "portable") == "portable":
            forward["tma"] = True
        backward["bwd_tma"] = True
    if seqlen <= SMALL_CALL:
        # A call this short is host-bound: building tensor descriptors costs more host time than the
        # copy engine saves (H100, B=1 H=16 S=128 hd128 causal: forward 68 vs 41 us of host per call,
        # do_bench 0.020 vs 0.013 ms; benchmarks/results/2026-11-22-h100-call-path.md).
        forward["tma"] = False
        backward["bwd_tma"] = False
        if arch == "sm90" and _short_backward_default(spec, d):
            backward.update(bwd_short=True, bwd_fused_delta=False)
    return KernelConfig(**forward, **backward)


def _short_backward_default(spec: AttentionSpec, d: int) -> bool:
    """The one-launch backward (bwd_short) for calls of up to SMALL_CALL tokens, whose fwd+bwd step is
    host time: one backward launch instead of three or four, no delta buffer. H100, B=1 H=16 hd128
    causal bf16, eager fwd+bwd: benchmarks/results/2026-11-23-h100-call-path-v4.md. The half-precision
    64x64 tiles only (fp32 and hd > 128 keep their own tiles); custom expressions too (their short kernel reads the
    block map in both directions: H200, masked fwd+bwd at 128-512 tokens, measured on a first form that walked
    every tile, benchmarks/results/2026-11-30-h200-call-path-s51-short-ab.md)."""
    return spec.dtype in ("fp16", "bf16") and d <= 128


def default_configs(spec: AttentionSpec, target: str | None = None) -> dict[int, KernelConfig]:
    """{bucket: the default config at that length} over DEFAULT_BUCKETS: what a kernel without
    tuned results runs, per call length (the nearest bucket's)."""
    return {bucket: default_config(spec, target, bucket) for bucket in DEFAULT_BUCKETS}


def _padded_16_bit(spec: AttentionSpec) -> bool:
    """An unmasked 16-bit spec whose head dims are narrower than their tiles (host.reads_padding: 40, 80, 96, 160,
    ...; masks at them were not measured and keep their shapes' rules)."""
    from .runtime.host import reads_padding

    return (spec.dtype in ("fp16", "bf16") and spec.mask is None
            and any(reads_padding(x) for x in (spec.head_dim, spec.head_dim_v)))


def _forward_defaults(spec: AttentionSpec, arch: str, d: int, shape: MaskShape, seqlen: int, hopper_ws: bool,
                      target: str) -> dict:
    def cfg(m, n, warps, stages, tma=False):
        return dict(BLOCK_M=m, BLOCK_N=n, num_warps=warps, num_stages=stages, tma=tma)

    if arch == "interpret":
        # The interpreter runs each program in numpy: fewer, larger tiles are faster.
        return cfg(32, 32, 4, 1)
    if spec.dtype == "fp32":
        if d <= 64:
            return cfg(64, 32, 4, 2)
        return cfg(32, 32, 4, 1 if d > 128 else 2)
    if arch == "sm90" and hopper_ws and (hopper := _hopper_ws_default(spec, d, shape, seqlen, target)) is not None:
        return hopper
    if arch == "sm90":
        # From the H100 sweeps (bf16, 16 heads, 16k tokens, triton 3.6): hopper_knobs.md for the
        # TMA / warp-specialization runs; masks/2026-11-22-h100-masked-defaults-sweep.md for the
        # mask shapes and short sequences (GPU time alone, per case the best of 6-7 tiles).
        if d <= 64:
            if shape.narrow(seqlen) or (shape.causal and seqlen <= 2048):
                return cfg(64, 64, 4, 3)  # causal hd64 S=1024: 0.120 ms vs 0.129 for 128x64
            return dict(cfg(128, 64, 8, 3), warp_specialize=not spec.causal)
        if d <= 128:
            if shape.narrow(seqlen) and shape.band <= 2048:
                # a band of a few key blocks: small query tiles waste less of the band's edges.
                # window 128: 64x32 0.116 ms vs 0.169 for 128x128 (S=4096); window 256, 1024,
                # chunks of 1024: 64x64 with descriptors 0.143 / 0.297 / 0.193 (vs 0.200 / 0.328 / 0.228)
                return cfg(64, 32, 4, 3) if shape.band <= 192 else cfg(64, 64, 4, 3, tma=True)
            if shape.documents:
                # document lengths are known only at run time. 64x64 with descriptors, once its
                # boundary loop reads the ids at 2 stages (prefill/q_outer.j2: two programs per SM,
                # not one), is the fastest or tied at every length measured (H100, CUDA-graph us,
                # benchmarks/probe_document_tiles.py, results/masks/2026-11-23-h100-document-tiles.md):
                # 4 documents at S=4096 220 vs 246 for 64x32 and 245 for 128x128; 16 at S=16384 224
                # vs 247 / 247; 16 at S=4096 (256 tokens each) 123 vs 121 / 158; the same causal work
                # unmasked takes 208.
                return cfg(64, 64, 4, 3, tma=True)
            if shape.causal and seqlen <= 2048:
                return cfg(64, 64, 4, 3, tma=True)  # causal S=1024: 0.186 ms vs 0.221 for 128x128
            if _reads_pair_tiles(spec):
                # a (BLOCK_M, BLOCK_N) tile of a tensor per block (SDPA's attn_mask, a bias), staged beside K and V:
                # 128 x 128 at 3 stages asks 256 KiB of shared memory (the H200 has 227; OutOfResources on every
                # call, session 49), 128 x 64 160 KiB
                return dict(cfg(128, 64, 8, 3, tma=True), warp_specialize=True)
            return dict(cfg(128, 128, 8, 3, tma=True), warp_specialize=True)
        if spec.fp8:
            # FP8 hd256 (H100, 16k tokens, triton 3.6): 128x64 with descriptors and warp
            # specialization 0.89-0.90 PFLOP/s vs 0.71-0.77 for 64x64 (benchmarks/NOTES.md)
            return dict(cfg(128, 64, 8, 3, tma=True), warp_specialize=True)
        return cfg(64, 64, 4, 2)
    if d <= 64:
        return cfg(128, 64, 4, 3)
    if d <= 128:
        return cfg(128, 32, 4, 2)
    return cfg(64, 32, 4, 1)


def _reads_pair_tiles(spec: AttentionSpec) -> bool:
    """Whether the mask or score_mod reads a named tensor by query and key position (SDPA's attn_mask, an (L, S)
    bias): each block of keys then loads a (BLOCK_M, BLOCK_N) tile of it."""
    from . import masks

    return any(any("seqlen_q" in names for names in t.sizes) and any("seqlen_k" in names for names in t.sizes)
               for t in masks.lower(spec.mask_node, spec.score_mod).tensors)


def _hopper_ws_default(spec: AttentionSpec, d: int, shape: MaskShape, seqlen: int, target: str) -> dict | None:
    """The Gluon warp-specialized forward (family hopper_ws) where the H100 (hd256, padded head dims and the
    H200's own rules: the H200) measured it faster than the portable default, else None. Today's rule (the
    paragraphs from the TMA store's on): hd128 from 1024 tokens, causal or not: the persistent grid, FA3's
    overlap and the TMA store together; hd64 (plain from 1024
    tokens, causal from 4096): three 64-row consumers with the TMA store, on the persistent grid but for
    plain calls from 8192 tokens (one program per tile); hd256 from 1024 tokens: 64-key blocks, persistent, the
    overlap; the rest (under 1024 tokens, hd64 causal up to 2048) portable, but on an H200 hd64 causal at 2048
    tokens and head dims padded to 64 causal at 1024-2048 take hd128's knobs (the last paragraph). What the
    paragraphs before them measured led there. H100 bf16, 16384 tokens, forward TFLOP/s hopper_ws / portable
    (benchmarks/results/2026-11-22-h100-hopper-ws-variants.md): hd128 S=1024 473/457 (ping-pong),
    S=4096 591/545 (ping-pong), S=16384 617-634/534; causal S=4096 513/476 and S=16384 586/545 (3
    stages); hd64 S=4096 439-446/429, S=16384 461/440, causal S=16384 435/423. Not taken: hd128 causal
    S=1024 (331 vs 354), hd64 S=1024 (347 vs 381; causal 236 vs 301), hd64 causal S=4096 (381 vs 372
    for 3 stages, within the run-to-run spread). Buckets between two measured wins (2048, 8192) and
    past the longest (32768+) follow them; fp16 runs the same instructions as bf16.

    The persistent grid (hopper_persistent, one program per SM walking work units; 128 x 128, 2
    stages) where it beat every one-tile variant of the family and the default in one run
    (benchmarks/results/2026-11-26-h100-hopper-persistent-run2.md, forward TFLOP/s persistent / best
    one-tile / the default then): hd128 S=1024 518 / 463 / 472, S=4096 582 / 568 / 564; hd128 causal
    S=1024 365 / 330 / 351 (portable), S=4096 515 / 500 / 489; hd64 causal S=4096 392 / 370 / 369
    (portable). It loses on long walks (hd128 S=16384 541 vs 623, hd64 S=16384 376 vs 465) and at hd64
    S=1024 and 4096 (376 / 374 portable, 415 / 432): those keep their defaults, and 8192 follows 16384.

    FA3's intra-warpgroup overlap (hopper_overlap: S_j and P_{j-1} V_{j-1} issued back to back, block
    j's softmax under P_{j-1} V_{j-1}) where it gained in two runs or by 3%+ in one (benchmarks/results/
    2026-11-26-h100-hopper-persistent-overlap{,-causal,-hd64}.md, forward TFLOP/s with / without, the
    default then in brackets): hd128 causal S=4096 on the persistent grid 525 / 512 and 528 (504), S=16384
    594 / 570 and 595 (567-573); hd128 S=16384 one-tile 629 / 611 (610); hd64 causal S=16384 one-tile 432 /
    405 (414). It lost at hd128 S=1024 (482 / 493 persistent), hd128 S=16384 persistent (547 / 613), hd64
    S=1024-16384 plain (-1 to -9%) and on FP8 (the wider tiles spill): those keep their defaults.

    Since O leaves by a TMA store (hopper_tma_store, session 18), all three together (persistent grid,
    overlap, TMA store) win where each alone did not: benchmarks/probe_forward_variants.py, H100, three
    interleaved rounds per case, forward TFLOP/s persistent+overlap+TMA store / the default before it
    (results/2026-11-27-h100-forward-variants{,-2,-3}.md, one run each): hd128 S=1024 557 / 501, causal
    408 / 400, causal S=2048 506 / 490, S=4096 610 / 575, S=8192 616 / 595 and causal 590 / 570, S=16384
    648 / 609 and causal 613 / 587: hd128 takes them from 1024 tokens. hd64 S=1024 391 / 382 and 390 /
    377, S=2048 407 / 397 (the portable default); hd64 long walks take the TMA store on the one-tile grid:
    S=16384 458 / 443, causal 437 / 421 and 447 / 428 (overlap), causal S=8192 417 / 397 (portable).
    Not taken (within 2% or lost): hd64 S=4096 plain (tile 433 either way; all three 414), causal S=1024
    (portable 293, persistent + TMA store 294), causal S=4096 (persistent 389, all three 380).

    hd64 since three 64-row consumers (BLOCK_M 192, FA3's hd64 tiles, 160 registers each; session 20,
    probe_forward_variants.py, H100, two runs, results/2026-11-27-h100-forward-variants-m192{,-2}.md,
    forward TFLOP/s mean of 3 rounds, the best three-consumer variant / the default before it): plain
    S=1024 persistent + TMA store 397 / 386 and 392 / 386, S=2048 445 / 408, S=4096 468 / 430; plain
    S=8192 one tile + TMA store 494 / 423, S=16384 515 / 463 and 501 / 446 (persistent 491, 500); causal
    S=4096 persistent + TMA store 408 / 389, S=8192 444 / 413, S=16384 476 / 440 and 477 / 427. The
    overlap lost with three consumers (-5 to -15%), and so did 64-key blocks; causal S=1024 lost every
    three-consumer variant (213-253 against the portable 290): causal calls up to 2048 tokens stay portable.

    hd256 (16-bit) since the family serves it (session 35): 64-key blocks, 2 stages (Q and two K/V stages take
    192 KiB; no TMA store beside them), on the persistent grid with the overlap (HOPPER_HD256), from 1024
    tokens, causal or not. H200 (the only GPU lent; not measured on an H100), bf16, 8 heads, 16384 tokens,
    benchmarks/probe_forward_variants.py, 3 interleaved rounds, forward TFLOP/s (means) HOPPER_HD256 / the portable
    64 x 64 default / cuDNN (results/2026-11-29-h200-forward-variants-hd256.md): S=1024 500 / 291 / 584,
    causal 386 / 227 / 444; S=4096 610 / 372 / 634, causal 556 / 311 / 553; S=16384 641 / 347 / 653, causal
    626 / 342 / 585. The one-tile grid, with or without the overlap, and the persistent one without it were
    slower at every length (e.g. S=16384 plain 607-634).

    Head dims between 64, 128 and 256 (16-bit, multiples of 8: 40, 80, 96, 160, 192, ...) since the family pads
    them (session 37): each takes its padded width's rule and knobs. H200, bf16, 16 heads, 16384 tokens, forward
    TFLOP/s over the head dim's own FLOPs, the Gluon family / the portable default then / cuDNN (benchmarks/
    probe_padded_head_dims.py, results/2026-11-29-h200-padded-head-dims-s37.md, 2 interleaved rounds): hd40 S=1024
    243 / 84 / 256, S=4096 307 / 100 / 281, causal 244 / 86 / 252; hd80 S=1024 368 / 294 / 374, causal 271 / 225 /
    279, S=4096 410 / 362 / 401, causal 382 / 298 / 354; hd96 S=1024 421 / 350 / 436, causal 319 / 268 / 329,
    S=4096 474 / 403 / 472, causal 434 / 355 / 407; hd160 S=1024 368 / 193 / 484, causal 294 / 155 / 374, S=4096
    424 / 236 / 532, causal 398 / 202 / 474; hd192 S=1024 431 / 241 / 558, causal 343 / 191 / 451, S=4096 503 /
    303 / 636, causal 466 / 258 / 569; diffusion's cross-attention (4096 x 77 keys, 8 heads, batch 8) hd80 91 / 61,
    hd160 100 / 58. hd40 causal at 1024 keeps the portable forward (hd64's rule), on descriptors (_padded_16_bit), but
    on an H200 (the last paragraph).

    hd64 causal at 2048 tokens (the bucket: calls of about 1450-2900) on an H200 (target "h200"): hd128's knobs (two
    consumers, 128 x 128, persistent, overlap, TMA store). H200, bf16, 32 heads, 16384 tokens, forward TFLOP/s, two
    runs (session 45): 3 interleaved rounds of flashgen.attention(config=...) (results/2026-11-30-h200-hd64-causal-
    s45-tiles.md) 362 / 363 / 362 against the portable 64 x 64 default's 343 / 339 / 338 (cuDNN 386), every other
    portable tile (64-128 x 32-128, 4-8 warps, 2-4 stages, descriptors, warp specialization) 194-343, the Gluon
    128 x 64 persistent + TMA store 322; then the default as users get it, HEAD against this rule in alternating
    processes (-hopper-ws-s45-ab.md, whose tree also held a tail skip for 192-row tiles that these 128-row tiles do
    not reach) 343.1 -> 361.2 (1.053x; 0.892 -> 0.939x cuDNN); on this code (-hopper-ws-s45-ab-hd40.md) 16 heads
    1.043x, hd40 (padded to 64) 1.416x (0.64 -> 0.91x cuDNN). GQA, fp16, hd48-56: checked for correctness (GQA,
    fp16), not timed. At 1024 tokens nothing beat hd64's portable
    default (Gluon 292 against 294; cuDNN 336): hd64 stays there, but head dims padded to 64 take the knobs from 1024
    (hd40, 16 heads: 165.7 against the portable forward on descriptors' 128.1, 3 rounds; cuDNN 194.5;
    -hd40-causal-s45.md). The H100 (not measured at causal 1024-2048 with these knobs) keeps the portable forward
    up to 2048."""
    from .runtime.host import padded_head_dim
    from .runtime.hopper import spec_unserved

    if spec_unserved(spec) is not None:
        return None
    if spec.mask is not None:
        return _hopper_ws_masked_default(spec, d, shape, seqlen)
    if shape.narrow(seqlen):
        return None
    if spec.fp8:
        return _hopper_ws_fp8_default(spec, d, shape, seqlen)
    width = padded_head_dim(d)  # (40, 80, 96, 160, ...) run their padded width's tiles
    padded, d = width != d, width
    if d == 128 and seqlen >= 1024:
        return dict(HOPPER_ALL_THREE)  # calls of up to 512 tokens: not measured
    if d == 256 and seqlen >= 1024:
        return dict(HOPPER_HD256)
    if d == 64 and shape.causal and target == "h200" and 1024 <= seqlen <= 2048 and (seqlen > 1024 or padded):
        return dict(HOPPER_ALL_THREE)  # (the last paragraph)
    if d != 64 or seqlen < 1024 or (shape.causal and seqlen <= 2048):
        return None
    three = dict(HOPPER_DEFAULT_TILE, BLOCK_M=192, hopper_regs=HOPPER_THREE_REGS, hopper_tma_store=True)
    return three if seqlen >= 8192 and not shape.causal else dict(three, hopper_persistent=True)


def _hopper_ws_masked_default(spec: AttentionSpec, d: int, shape: MaskShape, seqlen: int) -> dict | None:
    """The Gluon forward for a spec with a mask pattern where the H100 measured it faster than the
    portable default on the user path, else None (benchmarks/results/2026-11-23-h100-hopper-masks.md;
    bf16 hd128, 16 heads, 16384 tokens, eager do_bench ms, two runs): prefix-LM 512 forward S=4096
    0.541 / 0.600 and 0.542 / 0.586 (Gluon 128x128 3 stages / portable default), S=16384 2.010 /
    2.071 and 1.917 / 2.055; fwd+bwd (run 2) 2.550 / 2.574 and 8.747 / 9.673 (graph replay 2.545 /
    2.612, 8.740 / 9.015). So causal-shaped masks without a band or documents (prefix-LM; the
    shape plain causal has, where the family is the default at 4096+) at 4096+ tokens.
    Not taken: causal documents at S=16384 (4 documents forward 0.576 / 0.598 and 0.561 / 0.587, 16
    documents 0.248 / 0.246 and 0.254 / 0.248: the lengths are known only at run time, and the
    family wins on long ones only; fwd+bwd 2.526 / 2.554 and 0.927 / 0.923), documents at S=4096
    (4: 0.91-0.96x, 16: 0.72-0.81x), chunks of 1024 (0.84-0.90x), window 256 (0.76-0.88x): bands and
    short documents give each tile a few key blocks, where the partitions' set-up is not paid
    back, as for plain causal S=1024. Unmeasured (hd64, under 4096 tokens) keeps the portable one.

    The persistent grid on masks (session 20: each tile's key range from the pattern, tiles paired heavy
    with light where the mask is causal-shaped) turned those losses into wins: bench_masked_user_path.py
    --hopper, H100, bf16 hd128, 16 heads, 16384 tokens per batch, forward GPU ms (CUDA-graph replay) against
    the default then (results/2026-11-27-h100-hopper-masks-s20{,-2,-3}.md, one run each; two runs where two
    numbers are given):
    - prefix-LM 512, the unmasked hd128 default's knobs (persistent + overlap + TMA store, 128 x 128, 2
      stages): S=4096 0.511, 0.518 / 0.567, 0.572; S=16384 1.825, 1.835 / 1.927, 1.921.
    - documents, 128 x 64 tiles (finer diagonals and document edges than 128 x 128), 4 stages, persistent +
      overlap + TMA store / without the overlap / 128 x 128 persistent + TMA store / the portable 64 x 64
      default: 4 documents @4096 0.190 / 0.193 / 0.198 / 0.214; @16384 0.575 / 0.601 / 0.570 / 0.637;
      16 @4096 (256 tokens each) 0.120 / 0.113 / 0.139 / 0.122; 16 @16384 0.189 / 0.197 / 0.198 / 0.216;
      64 @4096 0.105 / 0.106 / 0.112 / 0.106; 64 @16384 0.121 / 0.114 / 0.135 / 0.123. Document lengths
      are known only at run time: the 128 x 64 tiles are the ones no length measured made slower than the
      portable default, and with the overlap the fastest in sum (1.20 vs 1.22 ms over the six).
    - bands (chunks, windows) of 193-2048 keys, 128 x 64, 4 stages, persistent + TMA store: chunks of 1024
      0.186 / 0.207 (S=4096), 0.187 / 0.208 (S=16384; with the overlap 0.179 and 0.187); window 256 0.132 /
      0.147 and 0.133 / 0.151; window 1024 0.305 / 0.309 and 0.341 / 0.341. Windows up to 192 keys (the
      portable 64 x 32 tiles) not measured: they keep it.
    Calls under 4096 tokens and hd64 keep the portable defaults (not measured).

    hd256 (16-bit), windows: the unmasked hd256 default's knobs (HOPPER_HD256: 128 x 64, 2 stages, persistent +
    overlap), H200, bf16, 8 heads, 16384 tokens per batch, forward ms do_bench medians of 3 interleaved rounds,
    Gluon / the portable 64 x 64 default (benchmarks/probe_hd256_masks.py, results/2026-11-29-h200-hd256-masks-
    s36-before.md; -s36.md the same cases on this default): window 1024 S=4096 0.279 / 0.413, S=8192 0.295 /
    0.423, window 512 S=16384 0.191 / 0.281 (1.43-1.48x; one program per tile with the overlap within 3% of it
    either way). Taken for the bands hd128's rule takes (193-2048 keys) at 4096+ tokens: windows as measured,
    chunks and a prefix-LM under a window (the same band shape) unmeasured; documents (with a band or not) and
    prefix-LM alone at hd256 are not measured and keep the portable forward, and score modifiers (Gemma 2's
    softcap) are not served by the family."""
    if d == 256 and seqlen >= 4096 and not shape.documents and shape.narrow(seqlen) and 192 < shape.band <= 2048:
        return dict(HOPPER_HD256)
    if d != 128 or seqlen < 4096:
        return None
    narrow_tile = dict(HOPPER_DEFAULT_TILE, BLOCK_N=64, num_stages=4, hopper_persistent=True, hopper_tma_store=True)
    if shape.documents:
        return dict(narrow_tile, hopper_overlap=True)
    if shape.narrow(seqlen):
        return narrow_tile if 192 < shape.band <= 2048 else None
    if shape.causal and shape.band is None:
        return dict(HOPPER_ALL_THREE)
    return None


def _hopper_ws_fp8_default(spec: AttentionSpec, d: int, shape: MaskShape, seqlen: int) -> dict | None:
    """The Gluon forward on FP8 e4m3 (family hopper_ws) where the H100 measured it faster than the
    portable FP8 forward, else None. H100, 16384 tokens, module.forward TFLOP/s, Gluon / portable FP8
    default, one run (benchmarks/results/2026-11-23-h100-fp8-hopper-ws-probe.md): hd128 S=16384
    937 (128x256) / 748, causal 889 (128x256) / 752; S=4096 846 (128x256) / 707, causal 662 (128x128,
    3 stages) / 605; hd256 S=16384 1098 (128x128) / 925; hd64 S=16384 551 (128x128) / 501, causal
    508 / 478. Not taken: hd64 under 16384 tokens and every case under 4096 (not measured); ping-pong
    lost everywhere (851 vs 884 at hd128, 482 vs 551 at hd64). FA3's FP8 tiles are 128 x 224 (hd128),
    128 x 128 (hd256), 192 x 160 (hd64); Gluon's tiles are powers of two. The 8192 bucket follows its
    neighbours' wins.
    hd256: 128 x 64 at 4096+ tokens, causal or not. Its q.k products sum 256 terms, which the FP8
    tensor cores accumulate unpromoted past FlashAttention-3's accuracy bound (LSE 1.02-1.08x it), so
    FP8 hd256 adds partial sums in fp32 every 128 products (FP8_QK_PROMOTE): in the Gluon kernel as two
    MMAs, which at 128 x 128 need a second accumulator and spill, and in the portable kernel through
    max_num_imprecise_acc, which serializes its MMAs. H100, the lead's run, promoted (plain) TFLOP/s,
    module.forward: Gluon 128 x 64 S=4096 863 (868), causal 768 (770), S=16384 948 (954), causal 872
    (891); Gluon 128 x 128 S=16384 764 (1104); portable 128 x 64 S=4096 700 (897), causal 617 (745),
    S=16384 causal 738 (901).
    The persistent grid (hopper_persistent; benchmarks/results/2026-11-26-h100-fp8-persistent.md, H100,
    flashgen.attention TFLOP/s, persistent / the one-tile default, one run): as in bf16 it wins where
    walks are short or causal and loses on long plain ones: hd128 S=4096 891 (128x256) / 850, causal
    691 (128x128) / 661; hd64 causal S=4096 469 / 433, S=16384 543 / 522; hd256 causal S=4096 809 / 720,
    S=16384 920 (3 stages) / 838; lost: hd128 S=16384 823 / 915, causal 831 / 852, hd64 S=16384 518 /
    557, hd256 S=16384 870 / 916; hd256 S=4096 872 / 854 (+2%, within a run's noise: not taken). hd64
    S=4096 plain: the one-tile 128 x 128, 511 against the portable FP8 default's 487.
    hd128 causal since FP8's one-compare causal mask (benchmarks/results/2026-11-27-h100-fp8-causal-mask-
    probe.md, H100, flashgen.attention TFLOP/s, two runs): 128 x 256 persistent S=4096 760 / 756 (128 x
    128 persistent 724 / 717), S=16384 912 / 911 (one-tile 128 x 256 873 / 875); S=8192 (.scratch knob
    run, two rounds) 833 / 826 against the one-tile 128 x 128, 3 stages default before it, 728 / 714.
    Also tried at 4096 and 8192 causal, none faster: 3 stages, 232 registers (within 2%), ping-pong
    (-18%), overlap (-26%).
    hd128 with O by a TMA store (hopper_tma_store; session 18, .scratch run, H100, 3 rounds, TMA store /
    register stores): causal S=4096 1.064, S=16384 1.022; plain S=4096 1.032, S=16384 1.021."""
    tile = dict(HOPPER_DEFAULT_TILE)
    if d == 128 and seqlen >= 4096:
        tile.update(BLOCK_N=256, hopper_tma_store=True)
        if shape.causal or seqlen <= 4096:  # (plain 8192+ keeps the one-tile grid: long walks, as bf16's)
            return dict(tile, hopper_persistent=True)
        return tile
    if d == 256 and seqlen >= 4096:
        if shape.causal:
            return dict(tile, BLOCK_N=64, hopper_persistent=True, num_stages=3 if seqlen >= 16384 else 2)
        return dict(tile, BLOCK_N=64)
    if d == 64 and seqlen >= 4096:
        return dict(tile, hopper_persistent=True) if shape.causal else tile
    return None


def _hopper_bwd_default(spec: AttentionSpec, d: int, shape: MaskShape, seqlen: int, target: str) -> dict:
    """The backward knobs of the Gluon dK/dV kernel (hopper_bwd) where the H100 measured it faster
    than the portable backward, else {} (bf16, 16 heads x hd128 or 32 x hd64, 16384 tokens). The kernel
    as of 2026-11-27: LSE and delta rows through shared memory (the producer loads them), dQ added by the
    copy engine (dq_strategy 'atomic').
    - Whole backward ms, atomic / separate dQ / portable, cuDNN's in brackets (benchmarks/results/
      2026-11-27-h100-hopper-bwd-smem-stats{,-1024}.md): hd128 S=16384 10.86 / 12.03 / 12.67 (10.45),
      causal 5.96 / 6.16 / 6.78 (5.20); S=4096 2.95 / 3.19 / 3.33 (2.75), causal 1.81 / 1.83 / 1.92 (1.55);
      S=1024 0.951 / 0.966 / 1.005 (0.819), causal 0.734 / 0.645 / 0.644. hd64 S=16384 13.17 / 13.98 /
      14.85 (11.98), causal 7.01 / 7.07 / 7.75 (6.29); S=4096 3.52 / 3.60 / 3.92 (3.27), causal 2.08 /
      2.06 / 2.16 (1.95); S=1024 1.141 / 1.070 / 1.081, causal 0.810 / 0.678 / 0.658. So: dQ added from
      it at hd128 and hd64 from 4096 tokens, and at hd128 without causality from 1024; the portable
      kernels below (S=1024's float32 buffer, its zeros and its copy into dQ, weigh more there). (A call
      takes its nearest bucket's, in log scale: from about 2900 tokens for 4096, and from 513 at hd128
      without causality, measured at 1024 only; the 2048 bucket, unmeasured, keeps the portable kernels
      but at hd128 without causality.) Since session 26 (the last paragraphs): hd128 causal from 2048 and hd64
      without causality from 1024 too.
    - Not with GQA: gqa-causal's recheck (32 query / 8 KV heads, tuning_db's spec) read the atomic kernel
      (before its LSE rows moved to shared memory) at 4.149 / 14.326 ms at 4096 / 16384 tokens against the
      stored 3.665 / 13.012; its KV head's programs walk every query head of the group. Causal GQA at
      hd128 from 4096 tokens takes it with the separate dQ kernel (1-4% ahead of the portable backward
      in 2026-11-23's runs, before the shared-memory LSE rows). Since session 26: GQA without causality at
      hd128 adds dQ from 1024 tokens (the last paragraphs).
    - Masks (fwd+bwd GPU ms over the default's, benchmarks/results/2026-11-27-h100-hopper-masks-hb-smem-
      stats.md): prefix-LM 512 at hd128 1.052x (4096 tokens) and 1.061x (16384) adding dQ, against the
      shipped tuned results; windows, documents and chunks 0.75-0.94x adding dQ and 0.91-1.04x with the
      separate dQ kernel (document_4 at 16384 tokens the one above 1.0): they keep the portable kernels,
      but documents from 16384 tokens, with the separate dQ kernel (two more runs, -hopper-masks-doc-hb-
      run{1,2}.md: 4 documents 1.020x / 1.029x, 16 documents 0.991x / 0.995x; long documents walk
      causal-like ranges, short ones few blocks). Prefix-LM with GQA takes the separate dQ kernel from
      8192 tokens, as measured before.
    - Since the adding kernel's spills went (session 26: K's descriptors for the dQ MMAs made in the loop, not
      hoisted and reloaded from local memory each step; hd128 stack frame 136 -> 64 bytes under triton 3.6),
      measured on an H200 (no H100 lent that session; backward ms, the default then / Gluon with the separate
      dQ / adding dQ / cuDNN, benchmarks/probe_bwd_defaults.py, medians of 3 interleaved rounds; run 1:
      results/2026-11-28-h200-bwd-defaults-s26-run1.md, run 2: -s26.md, where the default already added dQ):
      16 heads causal S=2048 1.087 / 1.062 / 0.959 / 0.855 (run 2: 1.088 portable, 0.941-0.950 adding, 0.927):
      hd128 causal adds dQ from 2048 tokens. Causal S=1024 read 0.655 / 0.665 / 0.617 / 0.556 (run 2: 0.651 /
      0.635 / 0.601-0.612 / 0.552), but the H100's 0.734 adding vs 0.644 portable before the change (above) is
      more than the change gained at 4096 (1.12x): left portable until an H100 measures it. GQA without
      causality (-s26-gqa.md, one run): 16 / 4 heads B=8 S=1024 0.487 / 0.454 / 0.403 / 0.412, B=4 S=2048
      0.887 / 0.843 / 0.722 / 0.727: adding dQ from 1024 tokens. Not taken: causal GQA, where it read faster
      from 4096 tokens on the H200 (32 / 8 heads S=16384 12.55 / 12.74 / 11.48 / 10.46, run 2 11.39-11.68
      adding / 12.51 separate; S=4096 3.418 / 3.441 / 3.351, run 2 3.20-3.36 / 3.42) and at 2048 by less than
      the runs' spread (16 / 4 heads B=4 0.508 / 0.494 / 0.484, run 2 0.478-0.489 adding / 0.466 separate), but
      tuning_db's gqa-causal rows were measured on an H100 against today's choice: an H100 recheck decides
      (flashgen tune --recheck --shipped); at 1024 tokens three runs disagreed (16 / 4 heads B=8: 0.354 /
      0.337 / 0.399, 0.609 / 0.521 / 0.690, 0.446 / 0.523 / 0.589; 32 / 8 heads B=4 0.611 / 0.610 / 0.727).
      Session 27 (results/2026-11-28-h200-bwd-defaults-s27-llama.md, H200, 3 rounds): causal GQA at 2048
      tokens (Llama's 16 / 4 heads, the 2048 bucket: no shipped row) takes the Gluon kernel with the separate
      dQ kernel, 3-5% ahead of the portable one in each of three runs (B=4 0.496 / 0.470 / 0.480 portable /
      separate / adding, cuDNN 0.452; B=8 0.986 / 0.940 / 0.952, cuDNN 0.886; session 26's above).
    - hd64 without causality at 1024-2048 tokens: the Gluon kernel with the separate dQ kernel, which read
      faster than the portable backward in two runs on two GPUs (fwd+bwd TFLOP/s over cuDNN's, bench_hopper_ws,
      S=1024, 32 heads: H100 0.91 vs 0.89, results/2026-11-27-h100-hopper-ws-s21-smem.md; H200 0.913 vs 0.878,
      results/2026-11-28-h200-hopper-bwd-fwdbwd-s26.md; adding dQ 0.886). Causal hd64 S=1024 keeps the portable
      one (H200 0.973 vs 0.959, within a run's spread; H100 whole backward 0.678 vs 0.658).
    - On an H200 (target "h200"), hd128 causal adds dQ from 1024 tokens: session 33's run (results/
      2026-11-29-h200-bwd-defaults-s33-1024.md, 3 interleaved rounds) read B=16 S=1024 16 heads 0.643 portable /
      0.657 separate / 0.596 adding (cuDNN 0.546), the third H200 run to put adding dQ 7-9% ahead there
      (session 26's two above). The H100 keeps the portable kernels at 1024 until it measures the kernel
      without its spills (its 0.734 was before them; the H200's memory, 4.8 TB/s against 3.35, takes the
      float32 dQ adds' traffic better)."""
    from .runtime.host import padded_head_dim
    from .runtime.hopper import spec_unserved

    if spec_unserved(spec, backward=True) is not None:
        return {}
    # A padded head dim (40, 80, 96, ...) takes its padded width's rule, as its forward does: the kernel runs that
    # width's tiles. H200, bf16, backward ms portable / Gluon with the separate dQ kernel / adding dQ (cuDNN), 2
    # interleaved rounds (results/2026-11-29-h200-bwd-defaults-s38-hd{96,40,80}.md): hd96 16 heads S=1024 causal
    # 0.615 / 0.613 / 0.554 (0.501), S=1024 0.977 / 0.929 / 0.809 (0.759), S=4096 causal 1.887 / 1.800 / 1.498
    # (1.442), S=4096 3.402 / 3.163 / 2.627 (2.542), GQA 16 / 4 causal S=2048 0.595 / 0.576 / 0.584; hd80 S=4096
    # causal 1.823 / 1.749 / 1.455, S=1024 0.950 / 0.892 / 0.766; hd40 S=4096 causal 1.225 / 1.196 / 1.119, S=4096
    # 2.255 / 2.100 / 1.980, S=1024 0.651 / 0.657 / 0.622, S=1024 causal 0.406 / 0.422 / 0.425 (hd64's rule keeps
    # the portable kernels there), GQA causal S=2048 0.431 / 0.380 / 0.635 (hd64's rule: portable).
    d = padded_head_dim(d)
    atomic = dict(hopper_bwd=True, dq_strategy="atomic", bwd_fused_delta=False)
    gqa = spec.num_kv_heads < spec.num_heads
    if spec.mask is not None:
        if d != 128:
            return {}
        if spec.mask.kind == "document":  # causal documents (measured); bidirectional ones keep the portable
            return dict(hopper_bwd=True) if shape.causal and not gqa and seqlen >= 16384 else {}
        if spec.mask.kind != "prefix_lm":
            return {}
        if gqa:
            return dict(hopper_bwd=True) if seqlen >= 8192 else {}
        return atomic if seqlen >= 4096 else {}
    if gqa:
        if d == 128 and not shape.causal and seqlen >= 1024:
            return atomic
        return dict(hopper_bwd=True) if d == 128 and shape.causal and seqlen >= 2048 else {}
    if seqlen >= 4096 or (d == 128 and seqlen >= (2048 if shape.causal and target != "h200" else 1024)):
        return atomic
    if d == 64 and not shape.causal and seqlen >= 1024:
        return dict(hopper_bwd=True)  # with the separate dQ kernel (the paragraph above)
    return {}


def _backward_defaults(spec: AttentionSpec, arch: str, d: int, shape: MaskShape, seqlen: int) -> dict:
    def cfg(m1, n1, m2, n2, warps, stages):
        return dict(BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=m2, BLOCK_N2=n2, bwd_num_warps=warps, bwd_num_stages=stages)

    if arch == "interpret":
        return cfg(32, 32, 32, 32, 4, 1)
    if spec.dtype == "fp32" or (d > 128 and arch != "sm90"):
        return cfg(16, 32, 32, 16, 4, 1)
    if d > 128:  # (on sm90: the other families returned above)
        # Head dim 256 (and 129-255, padded to it), 16-bit: dK/dV over 64 x 64 tiles with 8 warps (a 64 x 256
        # fp32 dK and dV take 128 registers a thread; 4 warps spill) and 2 stages (3 pass sm90's shared
        # memory: 263168 bytes); dQ over 128-query x 32-key tiles; tensor descriptors. H200, bf16, 16384
        # tokens, 8 heads (benchmarks/probe_bwd_defaults.py --head-dim 256, results/2026-11-29-h200-bwd-
        # defaults-hd256-s36{,-b,-c}.md, 3 interleaved rounds), backward ms this / 16 x 32 tiles, 4 warps, 1
        # stage (the default before) / cuDNN / SDPA flash: S=1024 causal 0.969 / 2.659 / 0.714 / 1.143,
        # S=1024 1.466 / 4.996 / 1.139 / 1.727, S=4096 5.168 / 19.509 / 3.652 / 5.586, GQA 8 / 4 causal
        # S=4096 2.851 / 10.129 / 2.005 / 3.177, causal S=16384 10.193 / 38.305 / 7.031 / 10.841: 0.69-0.78x
        # cuDNN, 1.06-1.18x SDPA flash (FlashAttention-2), 2.7-3.8x the old default. 64 x 64 dQ tiles 0.53-0.61x
        # cuDNN; without descriptors 0.65-0.72x; the delta fused into dQ within +-2%.
        return dict(cfg(64, 64, 128, 32, 8, 2), bwd_tma=True)
    if arch == "sm90":
        # Masks whose last query blocks see the most keys (causal-like: documents, chunks, prefix-LM,
        # causal windows): the dQ kernel starts those first (bwd_dq_heavy_first), so its tail is short
        # programs. Same-run A/B (masks/2026-11-23-h100-masked-defaults-sweep-k.md, backward ms with /
        # without): prefix-LM@4096 1.833 / 1.908 (timed after the run without it: above that sweep's
        # drift, which read the same config up to 2-9% slower later in the run); documents@16384 1.853 /
        # 1.896, window 1024 0.872 / 0.883, chunks and 16 documents within +-1%: no loss seen. Plain causal
        # attention keeps its kernels (and the tuned results stored for them).
        heavy_first = dict(bwd_dq_heavy_first=True) if spec.mask is not None and shape.causal else {}
        # 64x64 tiles everywhere (backward sweeps of 2026-11-22-h100-backward-hopper*.md); 3 stages
        # at hd 64. Tensor descriptors: full attention and, at hd128, every mask shape of the
        # masked-defaults sweep (0-14% less GPU time: windows of 128 to 1024, documents, chunks,
        # prefix-LM, causal S=1024). The portable kernel's atomic dQ (1.4-2.1x slower) and the
        # persistent dK/dV grid (bwd_persistent, 1.1-1.5x slower) lost in every case of that sweep:
        # tuner knobs only (the Gluon kernel's atomic dQ: _hopper_bwd_default).
        if d > 64 and (shape.narrow(seqlen) or shape.documents):
            # Short walks per block: delta from the dQ kernel (bwd_fused_delta) saves the preprocess
            # pass, 3-9% of the backward (masks/2026-11-22-h100-masked-defaults-sweep-v2-*.md: windows
            # 256/1024 0.432/0.882 vs 0.461/0.949 ms, chunks 0.624 vs 0.655, prefix-LM +1%: not there).
            # Documents up to 4096 tokens: 32x64 dK/dV and 64x32 dQ tiles, no descriptors (4 / 16
            # documents 0.670 / 0.362 vs 0.675 / 0.380 for 64x64 with them); longer: 64x64 (4 documents
            # at 16384: 1.886 vs 2.050).
            if shape.documents and seqlen <= 4096:
                return dict(cfg(32, 64, 64, 32, 4, 3), bwd_tma=False, bwd_fused_delta=True, **heavy_first)
            return dict(cfg(64, 64, 64, 64, 4, 2), bwd_tma=True, bwd_fused_delta=True, **heavy_first)
        if d <= 64 and shape == MaskShape(causal=True) and seqlen <= 2048:
            # causal hd64, short: the preprocess pass is a larger share of a short backward. Same run:
            # 0.347 ms (fused delta, heavy first) / 0.343 (fused delta) / 0.353 (heavy first, preprocess);
            # 0.365 for the old default in the first sweep; user path fwd+bwd GPU 0.486 vs 0.503 ms
            return dict(cfg(64, 64, 64, 64, 4, 3), bwd_tma=False, bwd_fused_delta=True, bwd_dq_heavy_first=True)
        if shape == MaskShape(causal=True) and d == 128 and spec.num_kv_heads < spec.num_heads and seqlen >= 2048:
            # Causal GQA: a (KV head, batch) group's dK/dV programs walk every query head of the group,
            # few and long, and the default order left the last groups' longest to run alone at the end:
            # the whole backward heaviest first in chunks of about 256 programs (bwd_heavy_first;
            # benchmarks/results/2026-11-27-h100-heavy-first.md, backward ms order off / heavy first, H100,
            # 3 interleaved rounds): 16 / 4 heads B=4 S=2048 (Llama's layers) 0.607 / 0.518, B=2 S=4096
            # 1.143 / 0.959, 32 / 8 heads B=4 S=2048 1.095 / 1.031; gqa-causal's recheck (32 / 8, 16384
            # tokens) 3.711 / 3.583 at 4096 and 13.22 / 12.91 at 16384. At 1024 tokens the runs disagreed
            # (0.454 / 0.497, 0.457 / 0.319) and without GQA it moved -3% to +6% (16 heads, 16384 tokens):
            # left off there. (Calls bucketed to 2048 take it: from about 1450 tokens.)
            heavy_first = dict(bwd_heavy_first=True)
        return dict(cfg(64, 64, 64, 64, 4, 3 if d <= 64 else 2), bwd_tma=spec.mask_node is None or d > 64,
                    **heavy_first)
    return cfg(32, 64, 64, 32, 4, 2)
