"""The host side of the Hopper warp-specialized dK/dV kernel (config knob 'hopper_bwd'): what it
serves, its tiles, and its launch in place of the portable dK/dV kernel.

The kernel is rendered from templates/hopper/backward.j2 into the module (only when the knob is
on); the module hands it to HopperBackward, and AttentionLauncher.backward_plan asks
``hopper_backward.serve(plan, ...)`` last: on a call it serves, the plan's dK/dV launch becomes
this kernel's; the preprocess (delta) and the dQ kernel stay the portable ones. A call it
cannot serve (``call_unserved``) keeps the portable dK/dV. The spec rules are the hopper_ws
forward's (hopper.spec_unserved); the device and call rules too, plus dO's and no atomic dQ.

Plain Python over torch and triton, and the Gluon shim of runtime/hopper.py. `flashgen generate`
pastes it verbatim (less the import marked below) after hopper.py into a standalone module.
"""

import triton

# (the names the kernel template imports from here are the shim's; one line each, so that the
# standalone paste drops them all)
from flashgen.runtime.hopper import HopperForward, bhsd_order, bhsd_strides, call_unserved, device_unserved, spec_unserved, tensor_unserved  # standalone: hopper.py precedes
from flashgen.runtime.hopper import fence_async_shared, gl, gluon, mbarrier, tma_load  # noqa: F401 standalone: hopper.py precedes
from flashgen.runtime.hopper import warpgroup_mma, warpgroup_mma_wait  # noqa: F401 standalone: hopper.py precedes


def backward_call_unserved(q, k, v, do, layout, *, dropout_p=0.0, atomic=False, device_check=None) -> str | None:
    """Why this backward call cannot run the Gluon dK/dV kernel (then the portable one runs), or
    None: the forward's call rules (dense layout, TMA-ready q/k/v, no dropout, an sm90 device),
    dO TMA-ready too, and dQ from the separate kernel (dq_strategy 'atomic' adds dQ from dK/dV)."""
    if atomic:
        return "dq_strategy 'atomic' (served: 'separate' or deterministic: this kernel computes no dQ)"
    return (call_unserved(q, k, v, layout, dropout_p=dropout_p, device_check=device_check)
            or tensor_unserved("do", do))


class HopperBackward:
    """Launches a module's rendered Gluon dK/dV kernel (_attn_bwd_dkdv_hopper): CONSUMERS warpgroups
    of 64 keys each, (Q, dO) tiles of block_m query rows through a NUM_STAGES-deep ring that a
    one-warp producer fills. BLOCK_N = 128 keys as two consumers (FA3's sm90 choice); the query
    tile per head dim is TILES's (class data, not a tuner knob yet)."""

    CONSUMER_ROWS, RCP_LN2, PRODUCER_REGS = HopperForward.CONSUMER_ROWS, HopperForward.RCP_LN2, HopperForward.PRODUCER_REGS
    CONSUMER_REGS = 240  # 2 consumer warpgroups x 240 + the producer's 24 fill the register file
    # head dim -> (BLOCK_M query rows per ring slot, consumers, ring stages). H100 (benchmarks/
    # results/2026-11-23-h100-hopper-bwd*.md): 64-row query tiles at both head dims; at hd64, 128
    # rows hold S^T and dP^T at 64 registers each beside the LSE/delta columns and spill (2-3x slower);
    # 3 stages ran as 2 (the two consumers, not the loads, set the pace).
    TILES = {64: (64, 2, 2), 128: (64, 2, 2)}

    # hopper.device_unserved; tests/sm90_compile.py replaces it to compile for sm90 with CPU tensors
    device_unserved = staticmethod(device_unserved)

    def __init__(self, kernel, spec, config):
        self.kernel, self.spec, self.config = kernel, spec, config
        self.spec_reason = spec_unserved(spec, backward=True)

    def serve(self, plan, q, k, v, do, layout, scale, dropout_p):
        """Swap this kernel in for the portable dK/dV launch of a launch.BackwardPlan when the call is
        served; returns why not (the plan then runs as made), or None."""
        if plan.dkdv is None:  # nothing to compute (zero gradients): nothing to swap
            return "an empty call"
        reason = self.spec_reason or backward_call_unserved(q, k, v, do, layout, dropout_p=dropout_p,
                                                            atomic=plan.atomic, device_check=self.device_unserved)
        if reason is None:
            plan.dkdv = HopperDkdv(self, layout, scale, plan.dkdv)
            plan.rows = None  # the portable kernel's (Q, dO) descriptors: this kernel makes its own
        return reason

    def launch(self, q, k, v, do, lse, delta, dk, dv, layout, scale):
        """Fill dk, dv (k's and v's shapes, unit stride along dim) from q, k, v, do and the forward's
        lse and the preprocess's delta ((B, H, Sq) float32, contiguous)."""
        block_m, consumers, stages = self.TILES[self.spec["head_dim"]]
        batch, heads, seqlen_q, head_dim = bhsd_order(q.shape, layout)
        _, kv_heads, seqlen_k, _ = bhsd_order(k.shape, layout)
        dk_strides, dv_strides = bhsd_strides(dk, layout), bhsd_strides(dv, layout)
        kd, vd = (HopperForward.descriptor(t, layout, self.CONSUMER_ROWS, head_dim) for t in (k, v))
        qd, dod = (HopperForward.descriptor(t, layout, block_m, head_dim) for t in (q, do))
        grid = (triton.cdiv(seqlen_k, self.CONSUMER_ROWS * consumers), kv_heads, batch)
        self.kernel[grid](kd, vd, qd, dod, lse, delta, dk, dv, *lse.stride()[:2], *dk_strides[:3], *dv_strides[:3],
                          seqlen_q, seqlen_k, heads // kv_heads, scale * self.RCP_LN2, scale,
                          CAUSAL=bool(self.spec["causal"]), NUM_STAGES=stages, CONSUMERS=consumers,
                          PRODUCER_REGS=self.PRODUCER_REGS, CONSUMER_REGS=self.CONSUMER_REGS, num_warps=4)
        return dk, dv


class HopperDkdv:
    """A backward plan's dK/dV launch on the Gluon kernel: called as the portable BoundLaunch is
    (launch.BackwardPlan passes q, k, v, do, lse, delta, dk, dv first, then the portable kernel's
    other arguments, which this kernel does not take)."""

    def __init__(self, backward, layout, scale, portable):
        self.backward, self.layout, self.scale = backward, layout, scale
        self.portable = portable  # the portable dK/dV launch it replaces: says whether the step's launches bind

    def __call__(self, q, k, v, do, lse, delta, dk, dv, *portable_args):
        return self.backward.launch(q, k, v, do, lse, delta, dk, dv, self.layout, self.scale)

    def bindable(self):
        """launch.BackwardPlan takes launch_context() once when its dK/dV launch is bindable: this one
        goes through Triton's launch path, but the step's portable preprocess and dQ bind as the
        portable dK/dV launch would."""
        return self.portable.bindable()

    def run(self, context, args):
        return self(*args)
