"""The host side of the Hopper warp-specialized forward (config family 'hopper_ws'): what it
serves, the Gluon names its kernel uses (one shim over triton 3.6 and 3.9), and its launch.

The kernel itself is rendered from templates/hopper/forward.j2 into the module, beside the
portable Q-outer forward; the module hands it to HopperForward, and AttentionLauncher.forward
asks ``hopper_forward.plan(...)`` first: a call the family cannot serve (see ``call_unserved``)
runs the portable forward instead. What a *spec* needs for the family is ``spec_unserved``: the
config check (config.KernelConfig.check_spec), the tuner's space and the defaults all ask it.

Mask patterns whose key range is one segment (mask_unserved: documents, prefix-LM, windows, chunks,
and-ed) take the same kernel with the mask hooks of templates/hopper/masks.j2; their named tensors
(document ids, prefix lengths) follow the scalars in the launch, as in the portable forward's.

FP8 e4m3 specs (forward only) take the same kernel with FP8 operands: V is read seq-contiguous
through transposed_descriptor (the launcher's FP8 path already makes that copy of V), the (batch, KV
head) descales are the launch's last arguments; a call whose V^T strides the copy engine cannot take
(seqlen_k not a multiple of 16) runs the portable FP8 forward.

Plain Python over torch and triton; imports only host.py's names. `flashgen generate` pastes it
into a standalone hopper_ws module after host.py (dropping that import line), so it has no
__future__ import and its top-level names clash neither with host.py's nor with the kernels'
(underscored or upper case).
"""

import torch
import triton

from .host import SEQ_DIMS, BoundLaunch, Descriptors, ForwardPlan, bhsd_order, bhsd_strides, bounds_record, contiguous_strides, empty_runs_table, nearest_bucket, padded_head_dim, PADDED_ROW_MULTIPLE, reads_padding, sm_count  # standalone: host.py precedes

# ---------------------------------------------------------------------------- the 3.6 / 3.9 shim
# Gluon is experimental: triton 3.6 (the GPU image) and 3.9 (CI) name a few things differently.
# Every difference the kernel meets is settled here, so the template reads the same on both.
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    # 3.9 renamed tma.async_copy_global_to_shared to tma.async_load (the old name warns), and
    # async_copy_shared_to_global to async_store
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    tma_store_wait = tma.store_wait  # wait until at most n of this thread's TMA stores still read shared memory
    # the FP8-cache decode (templates/decode/fp8_cache.j2): cp.async copies and mma.sync (sm80+ ops); 3.9
    # renamed async_copy.async_copy_global_to_shared to async_load. Without them (None) that kernel is
    # defined but never served (DecodeLauncher.fp8_gluon), and the rest of the family stands.
    try:
        from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
        async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    except (ImportError, AttributeError):
        async_copy = async_load = mma_v2 = None
    # the copy engine adding a shared-memory tile into global memory (cp.reduce.async.bulk.tensor .add):
    # 3.9's tma.async_atomic_add; 3.6 builds the op but names it nowhere in Python; None without either
    # (then the Gluon dK/dV kernels that add dQ serve no call: hopper_bwd.HopperBackward)
    tma_reduce_add = getattr(tma, "async_atomic_add", None)
    if tma_reduce_add is None:
        try:
            from triton._C.libtriton import gluon_ir as triton_gluon_ir
            from triton._C.libtriton import ir as triton_ir
            from triton.experimental.gluon.language._core import builtin as gluon_builtin
        except ImportError:
            triton_gluon_ir = None
        if triton_gluon_ir is not None and hasattr(triton_gluon_ir.GluonOpBuilder, "create_async_tma_reduce"):
            @gluon_builtin
            def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
                """global[tensor_desc's box at coord] += the shared-memory tile src, by the copy engine;
                waited as a TMA store (tma_store_wait)."""
                coord = _semantic._convert_to_ir_values(coord, require_i64=False)
                _semantic.builder.create_async_tma_reduce(triton_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle,
                                                          coord, src.handle)
    # a barrier of the calling partition's warps: gl.thread_barrier in 3.6, gl.barrier in 3.9
    warps_barrier = getattr(gl, "thread_barrier", None) or getattr(gl, "barrier", None)
    gluon_available = True
except ImportError as err:  # no Gluon: the module still imports; the family is never served
    gluon_available = False
    gluon_missing = f"triton {triton.__version__} has no Gluon ({err})"

    class _Absent:
        """Stands in for gluon/gl so that the kernel's definition (decorator, annotations) imports."""

        @staticmethod
        def constexpr(value=None):
            return value

        @staticmethod
        def jit(fn):
            return None

    gluon = gl = _Absent()
    fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = tma_load = warps_barrier = None
    tma_store = tma_store_wait = tma_reduce_add = async_copy = async_load = mma_v2 = None
    GluonTensorDescriptor = None

gluon_dtypes = ({"torch.float16": gl.float16, "torch.bfloat16": gl.bfloat16, "torch.float8_e4m3fn": gl.float8e4nv,
                 "torch.float32": gl.float32}
                if gluon_available else {})
# The forward's head dims. hd256: a consumer's 64 x 256 float32 O beside its S and P of 64-key blocks
# fits its 240 registers (128 + 32 + 16 a thread at 16 bits; ptxas for sm90: no local memory on the
# one-tile grid under triton 3.6 and 3.8, 48 bytes of stack on the persistent overlapped one under 3.6, 8
# under 3.8, which still measured fastest); FP8's 64 or 128-key blocks too (triton 3.6 and 3.9: no local
# memory). 16-bit hd256 K/V tiles of 64 keys take 2 stages beside Q (192 KiB; config.hopper_ws_smem
# refuses more).
served_head_dims = (64, 128, 256)
# A 16-bit head dim between them, unmasked, runs on the next one's tiles (padded_head_dim; host.reads_padding: a
# multiple of 8, 16-byte rows): the copy engine zero-fills Q, K and V past the head dim, and O's store leaves those
# columns out, as the portable kernels' BLOCK_D does (the Gluon dK/dV likewise: Q, K, V and dO zero-filled, dK and
# dV stored without those columns, dQ's adds dropped past them by the copy engine). FP8 keeps the exact head dims (its V^T tiles and hd256's
# promoted q.k are written for them); mask patterns at padded head dims are neither measured nor tested there.
backward_head_dims = (64, 128)  # the Gluon dK/dV's (hopper_bwd): hd256 is not written
served_dtypes = ("fp16", "bf16", "fp8_e4m3")
# FP8 (e4m3; e5m2 keeps the portable forward): forward only, so the Gluon dK/dV (hopper_bwd) refuses it
forward_only_dtypes = ("fp8_e4m3",)
served_layouts = ("bhsd", "bshd")  # and packed 'thd' (varlen) where the module has a packed kernel (call_unserved)


def spec_unserved(spec, *, backward=False) -> str | None:
    """Why the hopper_ws family cannot serve this spec (an AttentionSpec or a module's SPEC
    dict), or None when it can. Served: fp16/bf16 (and fp8_e4m3 for the forward: backward=False),
    head_dim == head_dim_v in served_head_dims or, unmasked 16-bit, padded to one (head_dim_unserved;
    backward=True: backward_head_dims), bottom-right causal
    or not, a mask of the built-in patterns mask_unserved takes (fp16/bf16), no score modifier, no dropout,
    an sm90 target or 'auto'. backward=True: the Gluon dK/dV kernel's rule (hopper_bwd: fp16/bf16; the same masks,
    whose row range per key block is one segment too: an and of intervals is one)."""
    get = spec.get if isinstance(spec, dict) else (lambda name: getattr(spec, name))
    if get("dtype") not in served_dtypes:
        return f"dtype {get('dtype')!r} (served: {', '.join(served_dtypes)})"
    if backward and get("dtype") in forward_only_dtypes:
        return f"dtype {get('dtype')!r} (forward only; the Gluon dK/dV serves fp16, bf16)"
    if reason := head_dim_unserved(get("head_dim"), get("head_dim_v"), get("dtype"), get("mask") is not None, backward):
        return reason
    if get("mask") is not None and get("dtype") in forward_only_dtypes:
        return f"a mask pattern with dtype {get('dtype')!r} (served with fp16, bf16)"
    if get("mask") is not None and (reason := mask_unserved(get("mask"))):
        return reason
    if get("score_mod") is not None:
        return "a score modifier (served: none)"
    if get("dropout_p"):
        return f"dropout_p {get('dropout_p')} (served: 0)"
    if get("target") not in ("auto", "h100", "h200"):
        return f"target {get('target')!r} (served: an sm90 GPU, h100/h200, or auto)"
    return None


def head_dim_unserved(head_dim: int, head_dim_v: int, dtype: str, masked: bool, backward: bool = False) -> str | None:
    """Why the family cannot serve these head dims, or None: equal, and one of served_head_dims (the Gluon dK/dV:
    backward_head_dims), or unmasked fp16/bf16 whose padded width is one of them (reads_padding)."""
    served = backward_head_dims if backward else served_head_dims
    if head_dim == head_dim_v and head_dim in served:
        return None
    if (dtype in ("fp16", "bf16") and not masked and head_dim == head_dim_v
            and reads_padding(head_dim) and padded_head_dim(head_dim) in served):
        return None
    return (f"head_dim {head_dim}/head_dim_v {head_dim_v} (served: equal, one of {served}; unmasked fp16/bf16 also "
            f"multiples of {PADDED_ROW_MULTIPLE} padded to one)")


# The mask patterns the forward serves: those whose key range is one segment (runtime of one block's
# visible keys: a sink's two segments, an `or`'s and a custom expression's block map are not written).
served_patterns = ("causal", "sliding_window", "chunked", "prefix_lm", "document")


def mask_unserved(mask) -> str | None:
    """Why the forward cannot serve this mask (a MaskNode or its dict form, as a module's SPEC holds
    it), or None: built-in patterns of served_patterns, alone or and-ed (one key segment per row)."""
    data = mask.to_dict() if hasattr(mask, "to_dict") else mask
    (kind, value), = data.items() if len(data) == 1 else (("expr", None),)
    if kind == "and":
        return next((reason for child in value if (reason := mask_unserved(child))), None)
    if kind not in served_patterns:
        what = "a custom expression" if kind == "expr" else f"pattern {kind!r}"
        return f"mask: {what} (served: {', '.join(served_patterns)}, alone or and-ed)"
    return None


def device_unserved(device) -> str | None:
    """Why calls on this torch device cannot run the family (no Gluon, not CUDA sm90), or None."""
    if not gluon_available:
        return gluon_missing
    if device.type != "cuda":
        return f"device {device} (served: a CUDA sm90 GPU)"
    import torch

    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]} (served: 9.0)"
    return None


def call_unserved(q, k, v, layout, *, dropout_p=0.0, out=None, device_check=None, packed=False) -> str | None:
    """Why this call cannot run the family (then the portable forward runs), or None.

    The kernel reads Q/K/V through (batch, heads, seq, dim) tensor descriptors and writes O through
    pointers or (hopper_tma_store) a descriptor of out, so it needs: a dense layout (bhsd or bshd), or packed
    sequences (layout 'thd', varlen) where the module has a packed kernel (packed: unmasked fp16/bf16 forwards), a
    contiguous last dim and 16-byte strides and base pointers (the copy engine's rules), no dropout. An FP8 V is read
    seq-contiguous (through a (batch, heads, dim, seq) descriptor): its seq dim contiguous and its other strides
    16-byte multiples (a seq-contiguous copy of V has them when seqlen_k is a multiple of 16)."""
    layouts = served_layouts + (("thd",) if packed else ())
    if layout not in layouts:
        return f"layout {layout!r} (served: {', '.join(layouts)})"
    if dropout_p:
        return f"dropout_p {dropout_p} (served: 0)"
    reason = (device_check or device_unserved)(q.device)
    if reason:
        return reason
    fp8_v = v.dtype == torch.float8_e4m3fn
    for name, t in (("q", q), ("k", k), ("v", v.movedim(SEQ_DIMS[layout], -1) if fp8_v else v)):
        if reason := tensor_unserved(name, t):
            return reason + (" (FP8: V is read seq-contiguous)" if name == "v" and fp8_v else "")
    if out is not None and out.stride(-1) != 1:
        return f"out: strides {tuple(out.stride())} (served: a contiguous last dim)"
    return None


def tensor_unserved(name, t) -> str | None:
    """Why the copy engine cannot read t through a Gluon descriptor (named `name`), or None: a
    contiguous last dim and 16-byte strides and base pointer are needed."""
    if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in t.stride()[:-1]):
        return f"{name}: strides {tuple(t.stride())} (served: a contiguous last dim, 16-byte strides and base)"
    return None


class RangeTable:
    """A mask's block-range table (documents): the Gluon kernels read each program's block ranges from
    it instead of searching the ids themselves. `entries` int32 per (block, batch element) of the
    range kernel's grid (`blocks`, batch), filled on every call before the kernel that reads it."""

    def __init__(self, kernel, blocks, batch, entries, seqlens, device, constexprs, forward=False):
        # forward: the forward's range kernel (hopper/masks.j2 _hw_fwd_ranges), whose FILL_RUNS launch (a training
        # step's) also fills the ids' runs tables among the named tensors' arguments, and which takes the bounds
        # record first, where it records ids that decrease (no runs table's launch does, for a forward)
        def launch(**fill):
            return BoundLaunch(kernel, (blocks, batch), dict(constexprs, num_warps=4, **fill))

        self.launches = [launch(FILL_RUNS=False), launch(FILL_RUNS=True)] if forward else [launch()]
        self.shape, self.seqlens, self.device = (batch * blocks * entries,), seqlens, device
        self.head = (bounds_record(device).tensor,) if forward else ()

    def fill(self, named, context=None, fill_runs=False):
        """The named tensors' arguments with this call's table, filled, after them (launched with
        `context`, launch_context()'s answer, where the caller took it once for its launches); fill_runs:
        their runs tables are filled too (empty_runs_table's, a training step's)."""
        table = torch.empty(self.shape, dtype=torch.int32, device=self.device)
        args = (table, *self.head, *self.seqlens, *named)
        launch = self.launches[fill_runs]
        if context is None:
            launch(*args)
        else:
            launch.run(context, args)
        return (*named, table)


class HopperForward:
    """Launches a module's rendered Gluon forward (_attn_fwd_hopper_ws): BLOCK_M // 64 consumer
    warpgroups of 64 query rows each, K/V through a num_stages-deep ring of BLOCK_N-key slots
    that a one-warp producer fills; hopper_regs registers per consumer thread, PRODUCER_REGS for
    the producer; hopper_overlap runs each block's softmax under the previous block's P V (FA3's order);
    hopper_pingpong has the two consumers take turns at the tensor cores (one's softmax under the
    other's MMAs); hopper_persistent launches one program per SM, each walking work units of query
    tiles (the kernel's comment says which); hopper_tma_store writes O through shared memory and a
    TMA store (an O descriptor, whose copy engine rules the call's out must meet)."""

    CONSUMER_ROWS = 64
    RCP_LN2 = 1.4426950408889634  # = 1 / ln 2: exp(x) = exp2(x * RCP_LN2)
    PRODUCER_REGS = 24  # the producer warp only issues TMA copies: FA3 gives its warpgroup 24-32 registers
    # knobs of the family a module's CONFIG leaves out at their default (config.KernelConfig.LATER_KNOBS)
    KNOB_DEFAULTS = {"hopper_regs": 240, "hopper_overlap": False, "hopper_pingpong": False, "hopper_persistent": False,
                     "hopper_tma_store": False}

    def __init__(self, kernel, spec, config, ranges=None, paired=None, packed=None, packed_persistent=None,
                 fallback=None):
        self.kernel = kernel
        # packed sequences' kernel (_attn_fwd_hopper_ws_packed: one sequence's tile per program), None where the
        # module has none (masks, FP8, hd160-256: their packed calls take the portable forward); with the persistent
        # knob, its persistent kernel too (_attn_fwd_hopper_ws_packed_persistent: sequences of equal length)
        self.packed, self.packed_persistent = packed, packed_persistent
        self.spec, self.config = spec, config
        # {bucket: the portable forward's knobs} for the calls plan() declines (render._portable_fallback)
        self.fallback = fallback or {}
        self.spec_reason = spec_unserved(spec)
        self.ranges = ranges  # a mask's _hw_fwd_ranges (documents): each call fills its block-range table first
        # the persistent grid's work units pair query tile k with tile tiles_m - 1 - k (heavy with light) where
        # later tiles see more keys: causal specs, and (the renderer's word, paired) causal-shaped masks
        self.paired = bool(spec["causal"]) if paired is None else paired

    @staticmethod
    def device_unserved(device):
        """device_unserved (tests/sm90_compile.py replaces it to compile for sm90 with CPU tensors)."""
        return device_unserved(device)

    @staticmethod
    def descriptor(t, layout, rows, cols):
        """A (batch, heads, seq, dim) Gluon descriptor of t, one (1, 1, rows, cols = the head dim's padded width)
        tile per load: the copy engine zero-fills past the sequence and past the head dim, so no tile reads another
        head's rows or columns. Packed 'thd': (1, heads, tokens, dim), every sequence's tokens in one (the packed
        kernel's tiles start at their sequence's first token; zero-filled past the last token only, and O's TMA
        store clipped there: the packed kernels store by it only the tiles wholly in their sequence)."""
        block = [1, 1, rows, cols]
        smem = gl.NVMMASharedLayout.get_default_for(block, gluon_dtypes[str(t.dtype)])
        shape, strides = list(bhsd_order(t.shape, layout)), list(bhsd_strides(t, layout))
        if layout == "thd":  # one batch element, whose stride (never stepped) is the tensor's span
            shape[0], strides[0] = 1, t.shape[0] * t.stride(0)
        return GluonTensorDescriptor(t, shape, strides, block, smem)

    @staticmethod
    def transposed_descriptor(t, layout, rows, cols):
        """A (batch, heads, dim, seq) Gluon descriptor of a seq-contiguous t (FP8's V), one (1, 1, cols =
        head dim, rows) tile per load: the kernel's K-major B operand of P V."""
        block = [1, 1, cols, rows]
        smem = gl.NVMMASharedLayout.get_default_for(block, gluon_dtypes[str(t.dtype)])
        b, h, s, d = bhsd_order(t.shape, layout)
        sb, sh, ss, sd = bhsd_strides(t, layout)
        return GluonTensorDescriptor(t, [b, h, d, s], [sb, sh, sd, ss], block, smem)

    # Packed calls the portable forward serves faster, by their sequences' mean length (a tile's rows past its
    # sequence's end are a larger share of the work the shorter the sequences; the host's mean, q's tokens over
    # the sequences, counts a padded buffer's tokens past the last sequence too: cu_seqlens stay on the device).
    # H200, bf16, 16 heads, 16384 tokens, packed kernel / portable default
    # (benchmarks/results/2026-11-29-h200-packed-s39{,-variants,-rule}.md; "mixed": lengths between S/4 and S):
    # - three consumers' 192-row tiles (hd64) under PACKED_THREE_MEAN tokens: S=1024 0.90x, mixed 1024 0.85x, mixed
    #   2048 (1280 on average) 0.97x; taken from it: S=2048 1.08x, S=4096 1.12x, mixed 4096 1.08x;
    # - causal calls under PACKED_CAUSAL_MEAN tokens: hd128 mixed 1024 (640 on average) 0.92x, hd96 1.02x; taken from
    #   it: S=1024 1.04-1.13x, mixed 2048 1.04-1.15x.
    # Those runs were before the packed kernel zeroed V's rows past a sequence (_hw_pv_packed); after it (hd96, hd128:
    # -s39-tail-zeroing.md) the calls taken read 1.04-1.36x, but hd128 S=1024 causal 0.99x (its thresholds unmoved).
    # With the zeroing at a consumer's last block only and the persistent packed kernel for sequences of one length
    # (-s40-persistent-equal.md): the calls taken 1.01-1.40x; the declined ones' packed kernel still 0.80-0.99x (hd64
    # S=1024: equal lengths persistent 0.98x, mixed 0.80x; hd128 mixed 1024 causal 0.89x, hd96 0.99x). With O by
    # the TMA store where a tile lies in its sequence (-s41-tma-store.md): taken 1.02-1.53x; declined 0.83-1.02x
    # (hd64 S=1024 1.01x, mixed 0.83x; hd128 mixed 1024 causal 0.96x, hd96 1.02x: within a run's noise, unmoved).
    # - causal calls at head dim 64 itself under PACKED_CAUSAL_MEAN_HD64 tokens (measured on 128-row tiles, the H200's
    #   2048-bucket default since session 45; 192-row tiles are declined under PACKED_THREE_MEAN already): mixed 2048
    #   (1280 on average) 0.765x; taken: S=2048 1.012x. Head dims padded to 64 keep PACKED_CAUSAL_MEAN, their portable
    #   forward being slow: hd40 causal mixed 2048 2.17x, S=2048 2.86x (-s46.md).
    PACKED_THREE_MEAN = 2048
    PACKED_CAUSAL_MEAN = 1024
    PACKED_CAUSAL_MEAN_HD64 = 2048

    @staticmethod
    def equal_lengths(varlen, total_q: int, total_k: int) -> bool:
        """Whether a packed call's sequences all have the longest lengths (its tokens are sequences x longest), the
        calls the persistent packed kernel takes where the module is persistent. Its static walk of work units gave
        sequences of unequal length (between S/4 and S) 0.68-0.92x the one-tile grid, whose programs the GPU
        schedules as SMs free up; equal ones 0.99-1.10x (H200, bf16, 16 heads, 16384 tokens, hd64-128, S = 1024
        and 4096: benchmarks/results/2026-11-30-h200-packed-s40-persistent.md, its one_tile column). A padded
        buffer's tail can make unequal lengths read as equal: the call is right either way."""
        sequences, longest_q, longest_k = varlen
        return total_q == sequences * longest_q and total_k == sequences * longest_k

    def packed_declines(self, cfg, varlen, total_q: int) -> bool:
        """Whether a packed call (varlen: its sequences and longest lengths; total_q: its query tokens) runs faster
        on the portable forward than on the packed kernel with these knobs."""
        sequences = varlen[0]
        if cfg["BLOCK_M"] == 192 and total_q < self.PACKED_THREE_MEAN * sequences:
            return True
        mean = self.PACKED_CAUSAL_MEAN_HD64 if self.spec["head_dim"] == 64 else self.PACKED_CAUSAL_MEAN
        return bool(self.spec["causal"]) and total_q < mean * sequences

    def fallback_knobs(self, seqlen: int) -> dict:
        """The portable forward's knobs for a declined call of this length (the longer of its query and key
        lengths): the nearest bucket's, as a kernel's bucket configs are picked (host.nearest_bucket)."""
        return self.fallback[nearest_bucket(seqlen, self.fallback)] if self.fallback else {}

    def plan(self, base, q, k, v, layout, out, scale, dropout_p, cfg, *, varlen=None):
        """A plan for this call (called like launch.ForwardPlan, whose allocation it keeps), or None
        when the family cannot serve it (then the portable forward runs). varlen: packed sequences' (batch,
        max_seqlen_q, max_seqlen_k), host.AttentionLauncher.varlen_args' (the longest sequences size the grid)."""
        if self.spec_reason or call_unserved(q, k, v, layout, dropout_p=dropout_p, out=out,
                                             device_check=self.device_unserved, packed=self.packed is not None):
            return None
        cfg = {**self.KNOB_DEFAULTS, **cfg}
        if varlen is not None:  # the packed kernels (with the TMA store, a tile reaching past its sequence by pointers)
            if self.packed_declines(cfg, varlen, q.shape[0]):
                return None
            cfg["hopper_persistent"] = cfg["hopper_persistent"] and self.equal_lengths(varlen, q.shape[0], k.shape[0])
        if cfg["hopper_tma_store"] and out is not None and tensor_unserved("out", out):
            return None  # the caller's out cannot take a TMA store (fresh outputs always can)
        return HopperPlan(self, base, q, k, layout, out, scale, cfg, varlen)


class HopperPlan:
    """One forward call's plan on the hopper_ws family, called as launch.ForwardPlan is: what a call
    of its metadata key launches, worked out once (the grid, the scalars, the constexprs; the Gluon
    descriptors' templates on the first call, copied onto each later call's tensors, as
    host.Descriptors does for the portable forward), launched through a BoundLaunch (Triton's launch
    path once, then the compiled kernel's launcher)."""

    def __init__(self, forward, base, q, k, layout, out, scale, cfg, varlen=None):
        self.forward, self.base, self.layout, self.scale, self.cfg = forward, base, layout, scale, cfg
        # (tiles of the padded head dim: the copy engine zero-fills the columns past q's, and O's store leaves them)
        block_n, head_dim = cfg["BLOCK_N"], padded_head_dim(q.shape[-1])
        batch, heads, seqlen_q, _ = bhsd_order(q.shape, layout)
        _, kv_heads, seqlen_k, _ = bhsd_order(k.shape, layout)
        o_strides = bhsd_order(contiguous_strides(base.o_shape) if out is None else out.stride(), layout)
        lse_strides = contiguous_strides(base.lse_shape)
        self.packed = varlen is not None  # packed sequences: the module's packed kernel, the sequences' offsets
        if self.packed:  # (sequences, the longest's lengths); LSE (heads, tokens), no batch stride
            batch, seqlen_q, seqlen_k = varlen
            lse_strides = (0, q.shape[0])
        # Q in one consumer's rows per load; K and V in BLOCK_N-key slots of the ring
        fp8 = forward.spec["dtype"] in forward_only_dtypes  # V^T tiles of the seq-contiguous V
        v_descriptor = forward.transposed_descriptor if fp8 else forward.descriptor
        blocks = ((forward.CONSUMER_ROWS, head_dim), (block_n, head_dim), (block_n, head_dim))
        makers = [forward.descriptor, forward.descriptor, v_descriptor]
        if cfg["hopper_tma_store"]:  # and O's, one consumer's rows per store
            blocks, makers = (*blocks, (forward.CONSUMER_ROWS, head_dim)), [*makers, forward.descriptor]
        self.descriptors = Descriptors(layout, blocks, makers)
        self.args = (*o_strides[:3], *lse_strides[:2], seqlen_q, seqlen_k, heads // kv_heads, scale * forward.RCP_LN2)
        tiles_m = triton.cdiv(seqlen_q, cfg["BLOCK_M"])
        grid = (tiles_m, heads, batch)
        if cfg["hopper_persistent"]:  # work units (a paired unit: two tiles, one heavy, one light), one program per SM
            units = batch * heads * ((tiles_m + 1) // 2 if forward.paired else tiles_m)
            grid = (max(1, min(units, sm_count(q.device))),)
            self.args += (heads, tiles_m, units)
        if self.packed:  # the strides, then (the call's offsets, then) the totals and the longest lengths (a packed
            # call's units are the longest sequence's tiles for every sequence: the kernel skips those past its end)
            self.args, self.packed_args = self.args[:5], (q.shape[0], k.shape[0], *self.args[5:])
        consumers = cfg["BLOCK_M"] // forward.CONSUMER_ROWS
        kernel = forward.kernel
        if self.packed:
            kernel = forward.packed_persistent if cfg["hopper_persistent"] else forward.packed
        self.launch = BoundLaunch(kernel, grid, dict(
            # (CAUSAL: the unmasked kernel's causal mask, and on the persistent grid its tile pairing; a masked
            # kernel's mask holds causality, so there it only pairs the tiles)
            CAUSAL=forward.paired if cfg["hopper_persistent"] else bool(forward.spec["causal"]),
            NUM_STAGES=cfg["num_stages"],
            CONSUMERS=consumers, PRODUCER_REGS=forward.PRODUCER_REGS,
            CONSUMER_REGS=cfg["hopper_regs"], OVERLAP=cfg["hopper_overlap"], PINGPONG=cfg["hopper_pingpong"],
            num_warps=4))
        # a mask's block-range table: first and end block per tile, then four ranges per consumer
        self.ranges = None if forward.ranges is None else RangeTable(
            forward.ranges, tiles_m, batch, 2 + 4 * consumers, (seqlen_q, seqlen_k), q.device,
            dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=block_n, CONSUMERS=consumers), forward=True)

    def __getattr__(self, name):
        """The rest of the call's plan (offsets, softmax_scale, dropout_p, backward_plans: what
        AttentionLauncher.training_backward reads) is the portable ForwardPlan's it was made from."""
        if name == "base":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)

    def training_call(self, q, k, v, seed, tensors, cu_seqlens_q, cu_seqlens_k):
        """launch.ForwardPlan.training_call: with a block-range table, the range kernel fills the runs tables
        the step's backward reads (one launch fewer than host.runs_table's), but for bool ids (their runs are
        searched as uint8 there)."""
        base, launcher = self.base, self.base.launcher
        if self.ranges is None or not tensors or any(
                tensors[name].dtype == torch.bool for name in launcher.runs_tensors):
            return ForwardPlan.training_call(self, q, k, v, seed, tensors, cu_seqlens_q, cu_seqlens_k)
        extra = base.tensor_extra(tensors, empty_runs_table)
        out, lse = self(q, k, v, None, None, seed, tensors, cu_seqlens_q, cu_seqlens_k, extra=extra, fill_runs=True)
        return out, lse, extra

    def __call__(self, q, k, v, out, lse, seed, tensors, cu_seqlens_q, cu_seqlens_k, fp8_args=(), extra=None,
                 fill_runs=False):
        """Fill out (q's layout) and lse ((B, H, Sq) float32) for one call; allocated when None. extra: the
        named tensors' arguments, the portable plan's tensor_extra(tensors), where the caller made them
        (fill_runs: with runs tables for the range kernel to fill, training_call's)."""
        base = self.base
        if out is None:
            out = base.new_out()
        if lse is None:
            lse = base.new_lse()
        # a mask's named tensors (document ids, ...) after the scalars, as the portable forward takes them
        # (and its block-range table, filled first); FP8: the descales and their strides last. With a range
        # table neither kernel reads the ids' runs tables (its range kernel searches the ids: hopper/masks.j2),
        # so a dummy stands in for them unless the caller made them (a training step's, for its backward)
        if extra is None:
            extra = base.tensor_extra(tensors, None if self.ranges is None else base.launcher.unused_runs)
        named = extra if self.ranges is None else self.ranges.fill(extra, fill_runs=fill_runs)
        # (the descriptors of the first len(blocks) tensors: out's only with the TMA store)
        if self.packed:  # the offsets checked on every call, as the portable forward's (ForwardPlan.offset_args)
            self.launch(*self.descriptors(q, k, v, out), out, lse, *self.args,
                        *base.offset_args(cu_seqlens_q, cu_seqlens_k), *self.packed_args)
            return out, lse
        self.launch(*self.descriptors(q, k, v, out), out, lse, *self.args, *named, *fp8_args)
        return out, lse
