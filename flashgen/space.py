"""The search space: knob -> choices, plus restrictions checked before anything compiles.

Spaces are declared data (after Kernel Tuner). A restriction is a readable expression
and the predicate that checks it; a point that breaks one is never compiled or timed.
The resource estimates are deliberately simple: they reject what cannot fit (shared
memory beyond the device's limit, accumulators that would need more than 255 registers
per thread) and leave the close calls to the measurement.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .config import (HOPPER_BLOCK_M, HOPPER_BLOCK_N, HOPPER_SMEM, HOPPER_SMEM_RESERVE, HOPPER_STAGES, HOPPER_THREE_REGS,
                     hopper_ws_smem, mask_shape)
from .runtime.hopper import spec_unserved
from .runtime.host import padded_head_dim
from .spec import AttentionSpec

SMEM_LIMITS = {"sm90": HOPPER_SMEM, "sm80": 166912, "sm86": 101376, "sm89": 101376}  # bytes per block (opt-in)
REGISTERS_PER_SM = 65536  # 32-bit registers per SM, sm80 to sm90


@dataclass(frozen=True)
class Restriction:
    text: str
    check: Callable[[dict], bool]


@dataclass(frozen=True)
class DeviceLimits:
    name: str
    smem_bytes: float  # per thread block; inf under the interpreter
    interpret: bool = False
    hopper: bool = False  # sm90+: tensor descriptors (TMA) and warp specialization are knobs

    @classmethod
    def current(cls, interpret: bool = False) -> "DeviceLimits":
        import torch

        if interpret or not torch.cuda.is_available():
            return cls("triton-interpreter", math.inf, interpret=True)
        props = torch.cuda.get_device_properties(0)
        smem = getattr(props, "shared_memory_per_block_optin", None)
        if not smem:
            smem = SMEM_LIMITS.get(f"sm{props.major}{props.minor}", 101376)
        return cls(props.name, float(smem), hopper=props.major >= 9)


@dataclass
class SearchSpace:
    phase: str  # fwd | bwd
    params: dict[str, tuple]
    restrictions: list[Restriction] = field(default_factory=list)

    def violations(self, point: dict) -> list[str]:
        return [r.text for r in self.restrictions if not r.check(point)]

    def size(self) -> int:
        return math.prod(len(c) for c in self.params.values())

    def points(self) -> Iterator[dict]:
        """Every valid point, in a fixed order (for exhaustive sweeps and grid search)."""
        names = list(self.params)
        for values in itertools.product(*(self.params[n] for n in names)):
            point = dict(zip(names, values))
            if not self.violations(point):
                yield point


def forward_space(spec: AttentionSpec, device: DeviceLimits) -> SearchSpace:
    elem = spec.torch_dtype.itemsize  # bytes per element: 4 fp32, 2 fp16/bf16, 1 FP8
    bd, bdv = padded_head_dim(spec.head_dim), padded_head_dim(spec.head_dim_v)
    if device.interpret:
        params = dict(BLOCK_M=(16, 32), BLOCK_N=(16, 32), num_warps=(4,), num_stages=(1,),
                      loop_order=("q_outer", "kv_outer"))
    else:
        params = dict(BLOCK_M=(32, 64, 128), BLOCK_N=(32, 64, 128), num_warps=(4, 8), num_stages=(1, 2, 3, 4),
                      loop_order=("q_outer", "kv_outer"))
    if device.hopper:
        params.update(tma=(False, True), warp_specialize=(False, True))
    # The Gluon warp-specialized forward (config family hopper_ws), where it serves the spec: its
    # own knobs vary only with it (no duplicate points), on its sound tiles (config.HOPPER_*).
    hopper_ws = device.hopper and not device.interpret and spec_unserved(spec) is None
    if hopper_ws:
        params.update(family=("portable", "hopper_ws"), hopper_regs=(232, 240), hopper_overlap=(False, True),
                      hopper_pingpong=(False, True), hopper_tma_store=(False, True), hopper_persistent=(False, True))
    # three 64-row consumers (BLOCK_M 192, FA3's hd64 tiles) at their register budget
    three = hopper_ws and not spec.fp8 and max(spec.head_dim, spec.head_dim_v) <= 64
    if three:
        params.update(BLOCK_M=(*params["BLOCK_M"], 192), hopper_regs=(HOPPER_THREE_REGS, 232, 240))
    if spec.fp8:  # the FP8 forward is the Q-outer kernel's; 256-key tiles pay there (hd128: 0.79 vs 0.72 PFLOP/s)
        params.update(loop_order=("q_outer",))
        if not device.interpret:
            params.update(BLOCK_N=(32, 64, 128, 256))

    def smem(p):  # Q tile + num_stages buffers of K and V tiles + P staged for the second dot
        return elem * (p["BLOCK_M"] * bd + p["num_stages"] * p["BLOCK_N"] * (bd + bdv) + p["BLOCK_M"] * p["BLOCK_N"])

    def regs(p):  # fp32 accumulator + S/P tile + Q tile, per thread
        words = p["BLOCK_M"] * bdv + p["BLOCK_M"] * p["BLOCK_N"] + p["BLOCK_M"] * bd * elem / 4
        return words / (32 * p["num_warps"])

    def hopper(p):  # hopper_ws: Q tiles + the K/V ring (P stays in registers)
        return p.get("family", "portable") == "hopper_ws"

    restrictions = []
    if hopper_ws:
        restrictions = [
            Restriction(f"family == 'portable' or (BLOCK_M in {HOPPER_BLOCK_M} and BLOCK_N in {HOPPER_BLOCK_N} and "
                        f"num_stages in {HOPPER_STAGES} and loop_order == 'q_outer' and not (tma or warp_specialize) "
                        f"and num_warps == 4)",
                        lambda p: not hopper(p) or (p["BLOCK_M"] in HOPPER_BLOCK_M and p["BLOCK_N"] in HOPPER_BLOCK_N
                                                    and p["num_stages"] in HOPPER_STAGES and p["num_warps"] == 4
                                                    and p["loop_order"] == "q_outer"
                                                    and not (p.get("tma") or p.get("warp_specialize")))),
            Restriction("family == 'hopper_ws' or (hopper_regs == 240 and not (hopper_overlap or hopper_pingpong "
                        "or hopper_persistent or hopper_tma_store))",
                        lambda p: hopper(p) or (p.get("hopper_regs", 240) == 240
                                                and not (p.get("hopper_overlap") or p.get("hopper_pingpong")
                                                         or p.get("hopper_persistent") or p.get("hopper_tma_store")))),
            Restriction(f"(BLOCK_M == 192) == (hopper_regs == {HOPPER_THREE_REGS}) and (BLOCK_M != 192 or family == "
                        f"'hopper_ws')",
                        lambda p: (p["BLOCK_M"] == 192) == (p.get("hopper_regs") == HOPPER_THREE_REGS)
                        and (p["BLOCK_M"] != 192 or hopper(p))),
            Restriction("not hopper_pingpong or (BLOCK_M == 128 and not hopper_overlap)",
                        lambda p: not p.get("hopper_pingpong")
                        or (p["BLOCK_M"] == 128 and not p.get("hopper_overlap"))),
            # (+ the O tiles a TMA store leaves from: 16-bit outputs, FP8's too; config.hopper_ws_smem, which
            # KernelConfig.check_spec applies to any config)
            Restriction(f"family == 'portable' or {elem}*(BLOCK_M*{bd} + num_stages*BLOCK_N*{bd + bdv}) "
                        f"+ hopper_tma_store*2*BLOCK_M*{bdv} + {HOPPER_SMEM_RESERVE} <= {device.smem_bytes:g}",
                        lambda p: not hopper(p) or device.smem_bytes >= hopper_ws_smem(
                            spec, p["BLOCK_M"], p["BLOCK_N"], p["num_stages"], bool(p.get("hopper_tma_store")))),
        ]
    return SearchSpace("fwd", params, restrictions + [
        Restriction(f"smem = {elem}*(BLOCK_M*{bd} + num_stages*BLOCK_N*{bd + bdv} + BLOCK_M*BLOCK_N) "
                    f"<= {device.smem_bytes:g}", lambda p: hopper(p) or smem(p) <= device.smem_bytes),
        Restriction(f"registers = (BLOCK_M*{bdv} + BLOCK_M*BLOCK_N + BLOCK_M*{bd}*{elem}/4) / (32*num_warps) <= 255",
                    lambda p: device.interpret or hopper(p) or regs(p) <= 255),
        # FA1's order keeps one program per (head, batch): the K/V tile is its whole working set.
        Restriction("loop_order == 'q_outer' or num_stages <= 2",
                    lambda p: p["loop_order"] == "q_outer" or p["num_stages"] <= 2),
        # The Hopper knobs belong to the Q-outer kernel; triton 3.6 splits 8-warp programs only.
        Restriction("loop_order == 'q_outer' or not (tma or warp_specialize)",
                    lambda p: p["loop_order"] == "q_outer" or not (p.get("tma") or p.get("warp_specialize"))),
        Restriction("not warp_specialize or num_warps >= 8",
                    lambda p: not p.get("warp_specialize") or p["num_warps"] >= 8),
    ])


def backward_space(spec: AttentionSpec, device: DeviceLimits) -> SearchSpace:
    elem = spec.torch_dtype.itemsize  # bytes per element: 4 fp32, 2 fp16/bf16, 1 FP8
    bd, bdv = padded_head_dim(spec.head_dim), padded_head_dim(spec.head_dim_v)
    if device.interpret:
        params = dict(BLOCK_M1=(16, 32), BLOCK_N1=(16, 32), BLOCK_M2=(16, 32), BLOCK_N2=(16, 32),
                      bwd_num_warps=(4,), bwd_num_stages=(1,), dq_strategy=("separate", "atomic"),
                      bwd_persistent=(0, 1), bwd_fused_delta=(False, True))
    else:
        params = dict(BLOCK_M1=(32, 64), BLOCK_N1=(32, 64, 128), BLOCK_M2=(32, 64, 128), BLOCK_N2=(32, 64),
                      bwd_num_warps=(4, 8), bwd_num_stages=(1, 2, 3), dq_strategy=("separate", "atomic"),
                      bwd_persistent=(0, 1, 2), bwd_fused_delta=(False, True))
    if device.hopper:
        params.update(bwd_tma=(False, True))
    # The launch order: heaviest first over the grid (causal-like masks: few, long programs at the start).
    if mask_shape(spec).causal:
        params.update(bwd_heavy_first=(False, True))
    # The one-launch backward (bwd_short; a custom expression's reads the block map both ways).
    params.update(bwd_short=(False, True))
    # The Gluon warp-specialized dK/dV kernel (hopper_bwd), where it serves the spec: it has its own
    # tiles (runtime/hopper_bwd.py), so with it on the portable dK/dV's tile knobs stay at one point.
    hopper_bwd = device.hopper and not device.interpret and spec_unserved(spec, backward=True) is None
    if hopper_bwd:
        params.update(hopper_bwd=(False, True))

    # Per thread: the fp32 accumulators and the two fp32 score tiles (P and dS). The dot
    # operands (K, V, Q, dO tiles) are read from shared memory and not counted. Calibrated on
    # the H100 sweep: (64, 64, 4 warps) at hd128 = 192 runs at full speed; (32 x 128) at hd128
    # = 320 spills and runs at half speed.
    def dkdv_regs(p):  # dK, dV accumulators + P^T and dS^T
        n, m = p["BLOCK_N1"], p["BLOCK_M1"]
        return (n * (bd + bdv) + 2 * n * m) / (32 * p["bwd_num_warps"])

    def dq_regs(p):  # dQ accumulator + P and dS
        m, n = p["BLOCK_M2"], p["BLOCK_N2"]
        return (m * bd + 2 * m * n) / (32 * p["bwd_num_warps"])

    def smem(p):  # the larger kernel's: its resident tiles and num_stages streamed ones
        # dK/dV: K and V resident, Q^T and dO streamed (adding dQ: a dQ tile per stage more); dQ: Q and dO
        # resident, K and V streamed. sm90, hd256, 8 warps (compiled through tests/sm90_compile.py's driver):
        # dK/dV 64 x 64 at 2 stages 197632 bytes, at 3 264192, adding dQ 263168 (past 232448; at 1 stage 132096),
        # dQ 128 x 32 at 2 stages 196640: this estimate plus at most 2 KiB
        stages = p["bwd_num_stages"]
        dkdv = elem * (p["BLOCK_N1"] + stages * p["BLOCK_M1"]) * (bd + bdv)
        if p["dq_strategy"] == "atomic":
            return dkdv + elem * stages * p["BLOCK_M1"] * bd
        return max(dkdv, elem * (p["BLOCK_M2"] + stages * p["BLOCK_N2"]) * (bd + bdv))

    def resident(p):  # persistent dK/dV programs one SM must hold at once: registers (estimate + 64) and smem
        n = p.get("bwd_persistent", 0)
        regs = n * p["bwd_num_warps"] * 32 * min(255, dkdv_regs(p) + 64)
        return n == 0 or device.interpret or (regs <= REGISTERS_PER_SM and n * smem(p) <= device.smem_bytes)

    # bwd_short's dQ is separate. (It reads only the M1 x N1 tiles and warps/stages: points differing in the
    # other backward knobs time the same kernel. Not restricted to one of them: a sampler would then
    # find a valid bwd_short point about once in a few hundred suggestions.)
    restrictions = [Restriction("not bwd_short or dq_strategy == 'separate'",
                                lambda p: not p.get("bwd_short") or p["dq_strategy"] == "separate")]
    if "bwd_heavy_first" in params:
        # the one-launch kernel keeps its own order (causal programs of equal work): no second point
        restrictions.append(Restriction("not (bwd_short and bwd_heavy_first)",
                                        lambda p: not (p.get("bwd_short") and p.get("bwd_heavy_first"))))
    if hopper_bwd:
        # with dq_strategy 'atomic' the Gluon kernel adds dQ itself (no dQ kernel): both are offered
        restrictions += [
            Restriction("not hopper_bwd or (BLOCK_M1 == 64 and BLOCK_N1 == 64 and bwd_persistent == 0)",
                        lambda p: not p.get("hopper_bwd") or (p["BLOCK_M1"] == 64 and p["BLOCK_N1"] == 64
                                                              and not p.get("bwd_persistent"))),
        ]
    return SearchSpace("bwd", params, restrictions + [
        Restriction("dK/dV kernel registers <= 255", lambda p: device.interpret or dkdv_regs(p) <= 255),
        Restriction("dQ kernel registers <= 255", lambda p: device.interpret or dq_regs(p) <= 255),
        Restriction(f"smem = {elem}*max((BLOCK_N1 + bwd_num_stages*BLOCK_M1)*{bd + bdv} (+ bwd_num_stages*BLOCK_M1*"
                    f"{bd} adding dQ), (BLOCK_M2 + bwd_num_stages*BLOCK_N2)*{bd + bdv}) <= {device.smem_bytes:g}",
                    lambda p: smem(p) <= device.smem_bytes),
        # delta from the dQ kernel: there is one only with separate dQ.
        Restriction("not bwd_fused_delta or dq_strategy == 'separate'",
                    lambda p: not p.get("bwd_fused_delta") or p["dq_strategy"] == "separate"),
        # A persistent grid pays only if its programs all run at once: n per SM must fit together.
        Restriction(f"bwd_persistent == 0 or bwd_persistent programs fit one SM (registers <= {REGISTERS_PER_SM}, "
                    f"smem <= {device.smem_bytes:g})", resident),
    ])


def bucket_of(seqlen: int) -> int:
    """The power-of-two sequence-length bucket a length belongs to (nearest in log scale)."""
    return 1 << max(0, round(math.log2(max(1, seqlen))))
