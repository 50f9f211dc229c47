"""The host side of the Hopper warp-specialized dK/dV kernel (config knob 'hopper_bwd'): what it
serves, its tiles, and its launch in place of the portable dK/dV kernel.

The kernel is rendered from templates/hopper/backward.j2 into the module (only when the knob is
on); the module hands it to HopperBackward, and AttentionLauncher.backward_plan asks
``hopper_backward.serve(plan, ...)`` last: on a call it serves, the plan's dK/dV launch becomes
this kernel's; the preprocess (delta) and the dQ kernel stay the portable ones (with dq_strategy
'atomic' the kernel adds dQ itself and no dQ kernel runs). A call it
cannot serve (``call_unserved``) keeps the portable dK/dV. The spec rules are the hopper_ws
forward's (hopper.spec_unserved); the device and call rules too, plus dO's, and a call's dQ strategy
the one the kernel was rendered for (dq_strategy 'atomic': this kernel adds dQ into the plan's
float32 buffer, and the plan runs no dQ kernel).

Plain Python over torch and triton, and the Gluon shim of runtime/hopper.py. `flashgen generate`
pastes it verbatim (less the import marked below) after hopper.py into a standalone module.
"""

import triton

# (the names the kernel template imports from here are the shim's; one line each, so that the
# standalone paste drops them all)
from flashgen.runtime.hopper import HopperForward, RangeTable, bhsd_order, call_unserved, device_unserved, spec_unserved, tensor_unserved  # standalone: hopper.py precedes
from flashgen.runtime.host import BoundLaunch, Descriptors, contiguous_strides, padded_head_dim, sm_count  # standalone: hopper.py precedes (host.py before it)
from flashgen.runtime.hopper import fence_async_shared, gl, gluon, mbarrier, tma_load  # noqa: F401 standalone: hopper.py precedes
from flashgen.runtime.hopper import warpgroup_mma, warpgroup_mma_wait  # noqa: F401 standalone: hopper.py precedes
from flashgen.runtime.hopper import tma_reduce_add, tma_store_wait, warps_barrier  # noqa: F401 standalone: hopper.py precedes


def backward_call_unserved(q, k, v, do, layout, *, dropout_p=0.0, atomic=False, rendered_atomic=False,
                           device_check=None) -> str | None:
    """Why this backward call cannot run the Gluon dK/dV kernel (then the portable one runs), or
    None: the forward's call rules (dense layout, TMA-ready q/k/v, no dropout, an sm90 device),
    dO TMA-ready too, and the call's dQ strategy the one the kernel was rendered for (atomic: the
    kernel adds dQ itself, with dq_strategy 'atomic' in the config; separate: the dQ kernel does)."""
    if atomic != rendered_atomic:
        return (f"a call with dq_strategy {'atomic' if atomic else 'separate'!r} (or deterministic) on a kernel "
                f"rendered for dq_strategy {'atomic' if rendered_atomic else 'separate'!r}")
    reason = call_unserved(q, k, v, layout, dropout_p=dropout_p, device_check=device_check) or tensor_unserved("do", do)
    if reason is None:
        _, heads, seqlen_q, _ = bhsd_order(q.shape, layout)
        if heads * seqlen_q >= 2**31:  # its producer indexes LSE/delta rows in 32 bits
            return f"q: {heads} heads x {seqlen_q} queries, 2^31 LSE rows or more"
    return reason


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

    def __init__(self, kernel, spec, config, named_args=0, ranges=None):
        self.kernel, self.spec, self.config = kernel, spec, config
        self.ranges = ranges  # a mask's _hw_bwd_ranges (documents): each call fills its block-range table first
        self.atomic = config["dq_strategy"] == "atomic"  # rendered with dQ added from this kernel
        self.spec_reason = spec_unserved(spec, backward=True) or (
            f"dq_strategy 'atomic': triton {triton.__version__} has no TMA reduce-add"
            if self.atomic and tma_reduce_add is None else None)
        self.named_args = named_args  # a mask's named tensors' arguments (pointers, strides, sizes) it takes

    def unserved(self, q, k, v, do, layout, dropout_p, atomic):
        """Why a backward call with this dQ strategy (atomic: added from the dK/dV kernel) cannot run
        this kernel, or None."""
        return self.spec_reason or backward_call_unserved(q, k, v, do, layout, dropout_p=dropout_p, atomic=atomic,
                                                          rendered_atomic=self.atomic,
                                                          device_check=self.device_unserved) or self.short_keys(q, k, layout)

    # keys at most this fraction of the queries make a call short_keys may decline (measured at 4096 / 77; calls
    # nearer self-attention keep the kernel, as measured there)
    SHORT_KEYS = 4

    def short_keys(self, q, k, layout) -> str | None:
        """Why not, for keys a quarter of the queries or fewer (SHORT_KEYS) whose key blocks (this kernel's
        programs) leave SMs idle (cross-attention over a short context): each program walks every query block,
        and adding dQ serializes it per key block. The portable kernels (the separate dQ kernel: a program per
        query block) run them.
        H200, bf16, 4096 queries x 77 keys, 8 heads, batch 8 (64 programs), fwd+bwd TFLOP/s with this kernel
        adding dQ / the portable ones: hd40 20.6 / 28.1, hd80 46.5 / 52.8 (results/2026-11-29-h200-head-dims-
        s38-gluon-bwd.md, -s37-after.md)."""
        batch, _, seqlen_q, _ = bhsd_order(q.shape, layout)
        _, kv_heads, seqlen_k, _ = bhsd_order(k.shape, layout)
        _, consumers, _ = self.TILES[padded_head_dim(self.spec["head_dim"])]
        programs = triton.cdiv(seqlen_k, self.CONSUMER_ROWS * consumers) * kv_heads * batch
        if self.SHORT_KEYS * seqlen_k <= seqlen_q and programs < self.min_programs(q.device):
            return f"k: {seqlen_k} keys under {seqlen_q} queries in {programs} programs (fewer than the GPU's SMs)"
        return None

    # the fewest programs a call with fewer keys than queries takes this kernel with (tests set 0)
    min_programs = staticmethod(sm_count)

    def serve(self, plan, q, k, v, do, layout, scale, dropout_p):
        """Swap this kernel in for the portable dK/dV launch of a launch.BackwardPlan when the call is
        served; returns why not (the plan then runs as made), or None."""
        if plan.dkdv is None:  # nothing to compute (zero gradients): nothing to swap
            return "an empty call"
        reason = self.unserved(q, k, v, do, layout, dropout_p, plan.atomic)
        if reason is None:
            plan.rows = None  # the portable kernel's (Q, dO) descriptors: this kernel makes its own
            plan.dkdv = HopperDkdv(self, q, k, layout, scale, plan.dkdv, len(plan.dkdv_head))
        return reason


class HopperDkdv:
    """A backward plan's dK/dV launch on the Gluon kernel, worked out once per launch.BackwardPlan
    (whose key fixes the shapes, strides, dtypes and alignment of q, k, v, dO and the LSE): the grid,
    the scalars and the constexprs here; the four Gluon descriptors (K, V in one consumer's 64 keys,
    Q, dO in the ring's query rows; a fifth, of the float32 dQ buffer, where it adds dQ) built on the
    plan's first call and copied onto each later call's tensors (host.Descriptors); the launch through
    a BoundLaunch, as HopperPlan does for the forward.
    Called as the portable BoundLaunch it replaces: q, k, v, do, lse, delta, dk, dv first, then that
    kernel's other arguments, of which this one takes the float32 dQ buffer (dq_strategy 'atomic')
    and a mask's named tensors (launch.BackwardPlan passes dq_acc, seed, cu_q, cu_k, Q and dO, the
    plan's dkdv_head (head_args of them), then the named tensors' arguments)."""

    def __init__(self, backward, q, k, layout, scale, portable, head_args=0):
        self.portable = portable  # the portable dK/dV launch it replaces
        named_start = 6 + head_args  # in the arguments after dv
        self.named = slice(named_start, named_start + backward.named_args)
        # (a padded head dim, 40 or 80 or 96: its padded width's tiles, the copy engine zero-filling past it)
        block_m, consumers, stages = backward.TILES[padded_head_dim(backward.spec["head_dim"])]
        batch, heads, seqlen_q, _ = bhsd_order(q.shape, layout)
        head_dim = padded_head_dim(q.shape[-1])
        _, kv_heads, seqlen_k, _ = bhsd_order(k.shape, layout)
        keys, rows = (backward.CONSUMER_ROWS, head_dim), (block_m, head_dim)
        self.descriptors = Descriptors(layout, (keys, keys, rows, rows), [HopperForward.descriptor] * 4)
        # dk, dv: the plan's contiguous allocations in k's shape (gradient_buffers; v's is the same where
        # the kernel serves); lse and delta: contiguous (batch, heads, seqlen_q) float32, as the
        # portable kernels read them
        grad_strides = bhsd_order(contiguous_strides(k.shape), layout)[:3]
        self.args = (heads * seqlen_q, seqlen_q, *grad_strides, *grad_strides, seqlen_q, seqlen_k, heads // kv_heads,
                     scale * backward.RCP_LN2, scale)
        # dq_strategy 'atomic': a descriptor of the plan's float32 dQ buffer (in q's shape) follows, one
        # consumer's share of a query block's columns per tile (at most 64: the tile the consumer stages; past a
        # padded head dim, columns the copy engine's reduce drops)
        dq_cols = min(64, head_dim // consumers)
        self.dq_descriptor = (Descriptors(layout, ((block_m, dq_cols),), [HopperForward.descriptor])
                              if backward.atomic else None)
        key_blocks = triton.cdiv(seqlen_k, backward.CONSUMER_ROWS * consumers)
        self.launch = BoundLaunch(backward.kernel, (key_blocks, kv_heads, batch), dict(
            CAUSAL=bool(backward.spec["causal"]), NUM_STAGES=stages, CONSUMERS=consumers,
            PRODUCER_REGS=backward.PRODUCER_REGS, CONSUMER_REGS=backward.CONSUMER_REGS, num_warps=4))
        # a mask's block-range table: first and end query block per key block, then two per consumer
        self.ranges = None if backward.ranges is None else RangeTable(
            backward.ranges, key_blocks, batch, 2 + 2 * consumers, (seqlen_q, seqlen_k), q.device,
            dict(BLOCK_M=block_m, CONSUMERS=consumers))

    def __call__(self, q, k, v, do, lse, delta, dk, dv, *portable_args):
        return self.launch(*self.descriptors(k, v, q, do), lse, delta, dk, dv, *self.args,
                           *self.tail_args(portable_args))

    def tail_args(self, portable_args, context=None):
        """What this kernel takes of the portable dK/dV's arguments after dv: a descriptor of the float32
        dQ buffer (the first of them) where the kernel adds dQ, then a mask's named tensors (and its
        block-range table, filled here first: launched with `context`, as run's launch)."""
        dq = () if self.dq_descriptor is None else tuple(self.dq_descriptor(portable_args[0]))
        named = portable_args[self.named]
        if self.ranges is not None:
            named = self.ranges.fill(named, context)
        return (*dq, *named)

    def bindable(self):
        """launch.BackwardPlan takes launch_context() once for the step's launches when its dK/dV
        launch is bindable: this one, or the portable preprocess and dQ beside it."""
        return self.launch.bindable() or self.portable.bindable()

    def run(self, context, args):
        q, k, v, do, lse, delta, dk, dv = args[:8]
        return self.launch.run(context, (*self.descriptors(k, v, q, do), lse, delta, dk, dv, *self.args,
                                         *self.tail_args(args[8:], context)))
