"""Compile generated kernels for an H100 (sm90) on a machine with no GPU.

Run by tests/test_sm90_compile.py in a child process: it replaces Triton's active driver
with one that reports an sm90 target and turns every launch into a compile-only warmup,
so Triton's whole pipeline (frontend, TTGIR passes, ptxas) runs on the CPU. This catches
what the interpreter cannot: code that runs in Python but does not lower (a static branch
that returns early, a descriptor used as a pointer, an unsupported layout).

Also checks that the spec's constants, read by the kernels as tl.constexpr module globals,
key the compiled binary: two modules whose kernels have the same text but another HEAD_DIM
must not share one (Triton's disk cache is shared between them).

Prints one line per case and phase; exits 0 when all compiled, 1 on a compile error or a
shared binary, and 3 when this Triton's internals are not the ones this script drives.
"""

from __future__ import annotations

import re
import sys
import time

import torch
import triton

try:
    import triton.runtime.jit as jit
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime import driver
except ImportError as err:  # another Triton layout
    print(f"unsupported triton {triton.__version__}: {err}")
    sys.exit(3)


class Sm90Driver:
    """The CUDA driver's helpers, with device 0 reporting compute capability 9.0."""

    def __init__(self):
        self._cuda = CudaDriver.__new__(CudaDriver)  # no libcuda: only its pure helpers are used

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_device_interface(self):
        return torch.cuda

    def get_active_torch_device(self):
        return torch.device("cpu")

    def __getattr__(self, name):
        return getattr(self._cuda, name)


CASE = [""]  # the case being compiled
COMPILED = []
BINARIES = {}  # (case, kernel name) -> the compiled binary's hash
SHARED = {}  # (case, kernel name) -> the compiled kernel's shared memory, bytes
PTX = {}  # (case, kernel name) -> the Gluon kernels' PTX (the wgmma pipelining and spill checks)


def _compile_only(run):
    def compile_run(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        BINARIES[(CASE[0], self.__name__)] = kernel.hash
        SHARED[(CASE[0], self.__name__)] = kernel.metadata.shared
        if self.__name__ in ("_attn_fwd_hopper_ws", "_attn_fwd_hopper_ws_packed", "_attn_fwd_hopper_ws_packed_persistent",
                             "_attn_bwd_dkdv_hopper", "_attn_decode_fp8"):
            PTX[(CASE[0], self.__name__)] = kernel.asm["ptx"]
        COMPILED.append(f"{self.__name__}: {kernel.metadata.num_warps} warps, {kernel.metadata.shared} B smem, "
                        f"{len(kernel.asm['cubin'])} B cubin")
        return kernel
    return compile_run


def ptxas_notes(ptx: str) -> list[str]:
    """The lines Triton's own ptxas prints for this PTX with -v (Triton runs it without: its notes and
    its register and stack figures are asked for here)."""
    import os
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        proc = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True)
    return (proc.stdout + proc.stderr).splitlines()


def serialized_wgmma(ptx: str) -> str | None:
    """ptxas's C7514 note for this PTX ("wgmma.mma_async instructions are serialized due to non wgmma
    instructions reading accumulator registers ..."), or None: every MMA of the kernel then waits for the
    one before (the overlapped forward measured 18-27% slower than the plain one while it had it)."""
    return next((line.strip() for line in ptxas_notes(ptx) if "C7514" in line), None)


def overwritten_mbarriers(ptx: str) -> set[int]:
    """The shared-memory offsets a kernel both initializes as an mbarrier and writes with plain stores. Triton hands
    the values a warp_specialize partition takes from the default partition's registers (a loaded value: an FP8
    descale, a packed sequence's bounds) through a shared buffer, which it may place over barriers that no partition
    uses (the one-tile kernels' ping-pong turns without ping-pong): memory reused so without mbarrier.inval is
    undefined in PTX, and the one-tile packed kernel, whose partitions took its O pointer that way, raised illegal
    memory accesses and left rows unwritten on a GPU shared with other processes (benchmarks/NOTES.md, sessions
    61-63). Addresses whose offset is a constant: global_smem[+N], or a register that global_smem plus constants
    reached (mov.b32 / add.s32 / cvta chains Triton emits), [+N]; a store covers its vector's whole width. Stores
    at thread-dependent addresses (the tiles' own) are not followed."""
    offsets = {}  # register -> its constant offset from global_smem
    for line in ptx.splitlines():
        if m := re.match(r"\s*mov\.b32\s+(%r\d+),\s*global_smem;", line):
            offsets[m.group(1)] = 0
        elif (m := re.match(r"\s*add\.s32\s+(%r\d+),\s*(%r\d+),\s*(-?\d+);", line)) and m.group(2) in offsets:
            offsets[m.group(1)] = offsets[m.group(2)] + int(m.group(3))

    def offset(address: str) -> int | None:
        m = re.fullmatch(r"\s*(global_smem|%r\d+)\s*(?:\+\s*(-?\d+))?\s*", address)
        if not m:
            return None
        base = 0 if m.group(1) == "global_smem" else offsets.get(m.group(1))
        return None if base is None else base + int(m.group(2) or 0)

    barriers, stores = set(), []
    for line in ptx.splitlines():
        if m := re.search(r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[([^\]]+)\]", line):
            if (at := offset(m.group(1))) is not None:
                barriers.add(at)
        elif m := re.search(r"\bst\.shared(?:::cta)?(?:\.v(\d))?\.[busf](8|16|32|64)\s+\[([^\]]+)\]", line):
            if (at := offset(m.group(3))) is not None:
                stores.append((at, int(m.group(1) or 1) * int(m.group(2)) // 8))
    return {b for b in barriers for at, width in stores if at < b + 8 and b < at + width}


def stack_bytes(ptx: str) -> int | None:
    """The kernel's stack frame in bytes as ptxas -v reports it (spilled registers live there)."""
    found = [re.search(r"(\d+) bytes stack frame", line) for line in ptxas_notes(ptx)]
    return next((int(m.group(1)) for m in found if m), None)


# The Gluon dK/dV kernel adding dQ (case "hopper_bwd atomic dQ gqa causal hd128"): its stack frame at most this
# many bytes per Triton minor. While the dQ MMAs' K descriptors were hoisted out of its loop, ptxas spilled them
# and every step reloaded them from local memory the L1 could not hold (H200: the backward 1.03-1.13x slower;
# benchmarks/results/2026-11-28-h200-bwd-spills-s26.md): 136 bytes under triton 3.6, 40 under 3.9; 88 / 24 since,
# 80 under 3.7 and 72 under 3.8. A minor without an entry takes the nearest earlier one's bound; 3.9 and later LATER's.
ADDING_DKDV_STACK = {(3, 6): 96, (3, 8): 80}
ADDING_DKDV_STACK_LATER = 32


def adding_dkdv_stack_bound(minor: tuple[int, int]) -> int:
    """The adding dK/dV kernel's stack bound under triton `minor` (major, minor)."""
    if minor >= (3, 9):
        return ADDING_DKDV_STACK_LATER
    earlier = [bound for known, bound in sorted(ADDING_DKDV_STACK.items()) if known <= minor]
    return earlier[-1] if earlier else max(ADDING_DKDV_STACK.values())


def training_step(launcher, q, k, tensors):
    """What flashgen's autograd function runs: training_forward, then training_backward on its plan
    (through Triton's launch path: this driver compiles, it has no launcher to bind)."""
    from flashgen.runtime.launch import BoundLaunch

    BoundLaunch.enabled = False
    out, lse, plan, extra = launcher.training_forward(q, k, k, "bhsd", 0.0, None, tensors, None, None, None, None)
    return launcher.training_backward(plan, out, q, k, k, out, lse, None, tensors, None, None, extra=extra)


def decode_fp8_cases(flashgen, AttentionSpec):
    """The Gluon FP8-cache decode kernel (templates/decode/fp8_cache.j2) through decode()'s launch path:
    hd128 causal GQA over an e4m3 cache of 16-key pages with two query rows (per-key pages, the tightest
    registers), and hd64 over a contiguous e5m2 cache through cache_batch_idx, split and merged in the
    kernel. Returns (name, run, kernel) per case; the PTX of each is kept in PTX (its spills are checked)."""
    from flashgen.runtime.launch import BoundLaunch

    cases = []
    for name, d, causal, paged, sq in (("decode fp8 gluon hd128 causal paged-16, 2 rows", 128, True, True, 2),
                                       ("decode fp8 gluon hd64 e5m2 cache_batch_idx, split", 64, False, False, 1)):
        spec = AttentionSpec(dtype="bf16", head_dim=d, num_heads=32, num_kv_heads=8, causal=causal, backward=False)
        module = flashgen.compile(spec).module()
        module._LAUNCHER.interpreting = lambda: True  # accept CPU tensors: nothing is launched
        decoder = module._DECODE
        decoder.fp8_gluon = lambda q, k_cache, v_cache, knobs: True  # (an sm90 GPU's rule)
        batch, keys = (2, 4096) if paged else (1, 8192)
        q = torch.randn(batch, sq, 32, d).to(torch.bfloat16)
        cache = torch.randn(batch, keys, 8, d).to(torch.float8_e4m3fn if paged else torch.float8_e5m2)
        descale = torch.ones(batch, 8)
        kw = dict(cache_seqlens=torch.full((batch,), keys, dtype=torch.int32), k_descale=descale, v_descale=descale)
        if paged:
            cache = cache.reshape(batch * keys // 16, 16, 8, d)
            kw["block_table"] = torch.arange(batch * keys // 16, dtype=torch.int32).view(batch, -1)
        else:  # 3 splits (a knob: the rule above takes it here), merged by the last program
            kw.update(cache_batch_idx=torch.arange(batch, dtype=torch.int32), num_splits=3)

        def run(decoder=decoder, q=q, cache=cache, kw=kw):
            BoundLaunch.enabled = False
            decoder.decode(q, cache, cache, **kw)
        cases.append((name, run, module._attn_decode_fp8))
    return cases


def main(only=()) -> int:
    driver.set_active(Sm90Driver())
    jit.JITFunction.run = _compile_only(jit.JITFunction.run)

    import flashgen
    from flashgen import AttentionSpec, KernelConfig
    from flashgen.runtime.hopper import HopperForward

    # the packed cases' 300-token sequences take the packed kernel (HopperForward.packed_declines would send
    # them to the portable forward), unequal lengths the one-tile one
    HopperForward.PACKED_THREE_MEAN = HopperForward.PACKED_CAUSAL_MEAN = HopperForward.PACKED_CAUSAL_MEAN_HD64 = 0

    DOCUMENT_TILES = KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, tma=True)
    hopper = KernelConfig(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, tma=True, warp_specialize=True,
                          bwd_tma=True)
    cases = [
        # (the backward launched heaviest first: bwd_heavy_first, the sm90 default for causal GQA)
        ("gqa causal, TMA + warp specialization", dict(head_dim=128, num_heads=8, num_kv_heads=2, causal=True),
         hopper.replace(bwd_heavy_first=True)),
        ("hd64, pointer loads", dict(head_dim=64, num_heads=4), KernelConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8,
                                                                            num_stages=3, dq_strategy="atomic")),
        # the same kernel text as hd64's: only the HEAD_DIM/BLOCK_D globals differ
        ("hd128, pointer loads", dict(head_dim=128, num_heads=4), KernelConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8,
                                                                              num_stages=3, dq_strategy="atomic")),
        ("sliding window + softcap, TMA", dict(head_dim=64, num_heads=4, mask={"sliding_window": {"left": 256}},
                                               score_mod={"softcap": 30.0}), hopper),
        ("custom expression (block map), TMA", dict(head_dim=64, num_heads=4, causal=True,
                                                    mask={"expr": "(q_idx - kv_idx) % 64 == 0"}), hopper),
        # the one-launch backward of a custom mask and a bias over a tensor (SDPA's attn_mask): two block maps
        ("custom mask and bias, one-launch backward", dict(head_dim=128, num_heads=8, num_kv_heads=2,
                                                           mask={"expr": "(q_idx >= kv_idx) & (kv_idx % 3 != 1)"},
                                                           score_mod="score + bias[q_idx, kv_idx]"),
         KernelConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, tma=True, warp_specialize=True, BLOCK_M1=64,
                      BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64, bwd_short=True)),
        # // and % of a float tensor's elements by an integer: _nfdiv's static branch on the kernel's dtypes
        ("floor division of a float tensor's elements", dict(head_dim=64, num_heads=4, score_mod=(
            "score + bias[q_idx, kv_idx] // 2 + (q_idx - kv_idx) % (bias[q_idx, kv_idx] + 3.0)")),
         KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)),
        # documents' default forward tiles beside plain causal's: the boundary loop's staged id reads
        # must not take shared memory past the unmasked kernel's (main() compares them)
        ("causal, 64x64 TMA", dict(head_dim=128, num_heads=4, causal=True, forward_only=True), DOCUMENT_TILES),
        ("causal documents, 64x64 TMA", dict(head_dim=128, num_heads=4, mask={"document": {"ids": "doc"}},
                                             forward_only=True), DOCUMENT_TILES),
        ("documents, FA1 loop order", dict(head_dim=96, num_heads=4, mask={"document": {"ids": "doc"}}),
         KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, loop_order="kv_outer")),
        # bwd_persistent: the dK/dV kernel's loop over key blocks, with tensor descriptors and atomic dQ
        ("sliding window, persistent dK/dV", dict(head_dim=128, num_heads=4, mask={"sliding_window": {"left": 256}}),
         KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, BLOCK_M1=64, BLOCK_N1=64, bwd_num_stages=2,
                      dq_strategy="atomic", bwd_tma=True, bwd_persistent=2)),
        ("packed sequences, causal, dropout", dict(head_dim=64, num_heads=4, num_kv_heads=2, causal=True,
                                                   dropout_p=0.1, varlen=True),
         KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)),
        # the Gluon warp-specialized forward (family hopper_ws): two consumer warpgroups, causal GQA;
        # one consumer with the pipelined Q K^T, hd64; the consumers' ping-pong (the backward is the
        # portable one)
        ("hopper_ws gqa causal, 2 consumers", dict(head_dim=128, num_heads=8, num_kv_heads=2, causal=True),
         hopper.replace(num_stages=2, family="hopper_ws")),
        ("hopper_ws hd64, 1 consumer, overlap", dict(head_dim=64, num_heads=4),
         KernelConfig(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3, family="hopper_ws", hopper_overlap=True,
                      hopper_regs=232)),
        # hd256 at 16 bits: 64-key blocks (a consumer's O, S and P in its 240 registers; 2 stages beside Q);
        # the backward at hd256's sm90 default (dK/dV 64 x 64 on 8 warps, dQ 128 x 32, descriptors)
        ("hopper_ws hd256 causal, 64-key blocks", dict(head_dim=256, num_heads=4, causal=True),
         KernelConfig(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2, family="hopper_ws", BLOCK_M1=64,
                      BLOCK_N1=64, BLOCK_M2=128, BLOCK_N2=32, bwd_num_warps=8, bwd_num_stages=2, bwd_tma=True)),
        ("hopper_ws persistent gqa hd256, overlap", dict(head_dim=256, num_heads=8, num_kv_heads=2, forward_only=True),
         KernelConfig(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2, family="hopper_ws", hopper_persistent=True,
                      hopper_overlap=True)),
        # head dims between the family's 64, 128 and 256 on their padded width's tiles: O's pointer store masked
        # past the head dim (hd96, hd128's default knobs but the TMA store); three consumers and the TMA store (hd40)
        ("hopper_ws persistent hd96 (padded), overlap", dict(head_dim=96, num_heads=4, causal=True, forward_only=True),
         KernelConfig(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2, family="hopper_ws", hopper_persistent=True,
                      hopper_overlap=True)),
        ("hopper_ws persistent hd40 (padded), 3 consumers, TMA store", dict(head_dim=40, num_heads=4, forward_only=True),
         KernelConfig(BLOCK_M=192, BLOCK_N=128, num_warps=4, num_stages=2, family="hopper_ws", hopper_regs=160,
                      hopper_persistent=True, hopper_tma_store=True)),
        # packed sequences on the Gluon forward (O by the module's TMA store where a tile lies in its sequence, by
        # pointers past it; sequences of one length: the persistent packed kernel where the module is persistent,
        # else the one-tile one): hd128's
        # default knobs (persistent, overlap, TMA store) on GQA causal sequences of one length and on unequal ones,
        # hd64's three consumers on unequal ones, and the one-tile kernel's ping-pong
        ("hopper_ws packed sequences gqa causal, overlap", dict(head_dim=128, num_heads=8, num_kv_heads=2, causal=True,
                                                               varlen=True, forward_only=True),
         KernelConfig(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2, family="hopper_ws", hopper_persistent=True,
                      hopper_overlap=True, hopper_tma_store=True)),
        ("hopper_ws packed sequences, unequal lengths, overlap", dict(head_dim=128, num_heads=4, varlen="unequal",
                                                                      forward_only=True),
         KernelConfig(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2, family="hopper_ws", hopper_persistent=True,
                      hopper_overlap=True, hopper_tma_store=True)),
        ("hopper_ws packed sequences hd64, 3 consumers, unequal lengths", dict(head_dim=64, num_heads=4,
                                                                               varlen="unequal", forward_only=True),
         KernelConfig(BLOCK_M=192, BLOCK_N=128, num_warps=4, num_stages=2, family="hopper_ws", hopper_regs=160,
                      hopper_persistent=True, hopper_tma_store=True)),
        ("hopper_ws packed sequences causal, one tile, ping-pong", dict(head_dim=128, num_heads=4, causal=True,
                                                                         varlen=True, forward_only=True),
         KernelConfig(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2, family="hopper_ws", hopper_pingpong=True)),
        ("hopper_ws hd128, ping-pong", dict(head_dim=128, num_heads=4),
         KernelConfig(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2, family="hopper_ws", hopper_pingpong=True)),
        # the persistent grid (hopper_persistent): one program per SM walking work units, causal GQA on two
        # consumers (a unit pairs a heavy and a light tile), hd64 on one
        ("hopper_ws persistent gqa causal, 2 consumers", dict(head_dim=128, num_heads=8, num_kv_heads=2, causal=True),
         KernelConfig(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2, family="hopper_ws", hopper_persistent=True)),
        ("hopper_ws persistent hd64, 1 consumer", dict(head_dim=64, num_heads=4),
         KernelConfig(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3, family="hopper_ws", hopper_persistent=True)),
        # (with FA3's overlap and the TMA store: the hd128 default from 1024 tokens, and on an H200 hd64 causal's at
        # 2048 and head dims padded to 64 causal's at 1024-2048)
        ("hopper_ws persistent causal hd128, overlap, TMA store", dict(head_dim=128, num_heads=4, causal=True,
                                                                       forward_only=True),
         KernelConfig(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2, family="hopper_ws", hopper_persistent=True,
                      hopper_overlap=True, hopper_tma_store=True)),
        ("hopper_ws persistent gqa hd128, ping-pong", dict(head_dim=128, num_heads=8, num_kv_heads=2, forward_only=True),
         KernelConfig(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2, family="hopper_ws", hopper_persistent=True,
                      hopper_pingpong=True)),
        # O through shared memory and a TMA store (hopper_tma_store): the persistent grid's (a tile's store
        # waited before the next tile writes o_smem) on FP8's causal default and a one-tile masked kernel
        ("hopper_ws fp8 e4m3 persistent causal hd128, TMA store", dict(dtype="fp8_e4m3", head_dim=128, num_heads=4,
                                                                     causal=True, seqlen=304),
         KernelConfig(BLOCK_M=128, BLOCK_N=256, num_warps=4, num_stages=2, family="hopper_ws", hopper_persistent=True,
                      hopper_tma_store=True)),
        # FP8's default at 8192+ plain tokens (one tile per program): its partitions take the descales it loads
        # through a shared buffer, which must not lie over an initialized mbarrier (the "mbarriers" check below)
        ("hopper_ws fp8 e4m3 one-tile hd128, TMA store", dict(dtype="fp8_e4m3", head_dim=128, num_heads=4,
                                                             seqlen=304),
         KernelConfig(BLOCK_M=128, BLOCK_N=256, num_warps=4, num_stages=2, family="hopper_ws",
                      hopper_tma_store=True)),
        ("hopper_ws masked window hd64, 1 consumer, TMA store", dict(head_dim=64, num_heads=4, forward_only=True,
                                                                     mask={"sliding_window": {"left": 100}}),
         KernelConfig(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2, family="hopper_ws", hopper_tma_store=True)),
        # the Gluon forward with a mask pattern (templates/hopper/masks.j2; forward only: the backward is
        # the portable one, compiled above): causal documents (binary searches, a named tensor) on two
        # consumers; prefix-LM with per-batch lengths under ping-pong; chunks and-ed with a window
        # (floor division) on one consumer with the pipelined Q K^T
        ("hopper_ws masked documents gqa, 2 consumers", dict(head_dim=128, num_heads=8, num_kv_heads=2,
                                                             mask={"document": {"ids": "doc"}}, forward_only=True),
         KernelConfig(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2, family="hopper_ws")),
        ("hopper_ws masked prefix-LM lengths, ping-pong", dict(head_dim=128, num_heads=4, mask={"prefix_lm": "plen"},
                                                               forward_only=True),
         KernelConfig(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2, family="hopper_ws", hopper_pingpong=True)),
        ("hopper_ws masked chunks and window hd64, 1 consumer, overlap",
         dict(head_dim=64, num_heads=4, mask={"and": [{"chunked": 96}, {"sliding_window": {"left": 40}}]},
              forward_only=True),
         KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, family="hopper_ws", hopper_overlap=True)),
        # ... and on the persistent grid (each tile's key blocks from the pattern; causal-shaped masks pair a
        # heavy tile with a light one): documents GQA with the overlap and the TMA store (the block-range
        # table per tile), prefix-LM lengths under ping-pong, a two-sided window on one consumer
        ("hopper_ws persistent masked documents gqa, overlap, TMA store",  # (and a training step: the range
         # kernel's FILL_RUNS launch fills the runs table the portable backward reads)
         dict(head_dim=128, num_heads=8, num_kv_heads=2, mask={"document": {"ids": "doc"}}, no_backward=True),
         KernelConfig(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2, family="hopper_ws", hopper_persistent=True,
                      hopper_overlap=True, hopper_tma_store=True)),
        ("hopper_ws persistent masked prefix-LM lengths, ping-pong",
         dict(head_dim=128, num_heads=4, mask={"prefix_lm": "plen"}, forward_only=True),
         KernelConfig(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2, family="hopper_ws", hopper_persistent=True,
                      hopper_pingpong=True)),
        ("hopper_ws persistent masked window hd64, 1 consumer",
         dict(head_dim=64, num_heads=4, mask={"sliding_window": {"left": 40, "right": 30}}, forward_only=True),
         KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, family="hopper_ws", hopper_persistent=True)),
        # three 64-row consumers (BLOCK_M 192, FA3's hd64 tiles; 160 registers each): causal GQA on one program
        # per tile, and on the persistent grid with the overlap and the TMA store (forward and training step)
        ("hopper_ws hd64 causal gqa, 3 consumers", dict(head_dim=64, num_heads=8, num_kv_heads=2, causal=True,
                                                        forward_only=True),
         KernelConfig(BLOCK_M=192, BLOCK_N=128, num_warps=4, num_stages=2, family="hopper_ws", hopper_regs=160)),
        ("hopper_ws persistent hd64, 3 consumers, overlap, TMA store", dict(head_dim=64, num_heads=4),
         KernelConfig(BLOCK_M=192, BLOCK_N=128, num_warps=4, num_stages=2, family="hopper_ws", hopper_regs=160,
                      hopper_persistent=True, hopper_overlap=True, hopper_tma_store=True)),
        # the Gluon dK/dV kernel (hopper_bwd): causal GQA hd128 (64-row query tiles) under the Gluon
        # forward; hd64 (128-row query tiles) under the portable forward
        ("hopper_bwd gqa causal hd128", dict(head_dim=128, num_heads=8, num_kv_heads=2, causal=True),
         hopper.replace(num_stages=2, family="hopper_ws", hopper_bwd=True)),
        ("hopper_bwd hd64", dict(head_dim=64, num_heads=4), KernelConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8,
                                                                        num_stages=3, hopper_bwd=True)),
        # ... with dQ added from it (dq_strategy 'atomic': both consumers' dS^T through shared memory, read
        # back transposed into registers as the dQ MMAs' A operands; K's 64-column panels as B)
        ("hopper_bwd atomic dQ gqa causal hd128", dict(head_dim=128, num_heads=8, num_kv_heads=2, causal=True),
         hopper.replace(num_stages=2, family="hopper_ws", hopper_bwd=True, dq_strategy="atomic")),
        # ... at padded head dims (their padded width's tiles, dK/dV's stores masked past the head dim): hd96
        # adding dQ under the Gluon forward (dQ's tiles past the head dim dropped by the copy engine's reduce),
        # hd40 with the separate dQ kernel under the portable forward
        ("hopper_bwd atomic dQ hd96 (padded) causal", dict(head_dim=96, num_heads=4, causal=True),
         hopper.replace(num_stages=2, family="hopper_ws", hopper_bwd=True, dq_strategy="atomic")),
        ("hopper_bwd hd40 (padded)", dict(head_dim=40, num_heads=4), KernelConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8,
                                                                                 num_stages=3, hopper_bwd=True)),
        # ... with a mask pattern (its row range per key block, _hw_visible on the S^T registers): causal
        # documents GQA (launched heaviest first) under the portable forward (masks.j2 rendered for the
        # backward alone), prefix-LM lengths under the Gluon forward (masks.j2 once for both), a window
        # hd64 adding dQ itself (the backward alone: the forwards and autograd's path are the unmasked
        # cases' and the masked forwards')
        ("hopper_bwd masked documents gqa hd128", dict(head_dim=128, num_heads=8, num_kv_heads=2, causal=True,
                                                       mask={"document": {"ids": "doc"}}, backward_only=True),
         KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, hopper_bwd=True, bwd_heavy_first=True)),
        ("hopper_bwd masked prefix-LM lengths hd128", dict(head_dim=128, num_heads=4, mask={"prefix_lm": "plen"},
                                                           backward_only=True),
         hopper.replace(num_stages=2, family="hopper_ws", hopper_bwd=True)),
        ("hopper_bwd masked window hd64, atomic dQ", dict(head_dim=64, num_heads=4, mask={"sliding_window": {"left": 100}},
                                                          backward_only=True),
         KernelConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, hopper_bwd=True, dq_strategy="atomic",
                      bwd_fused_delta=False)),
        # the Gluon forward on FP8 e4m3 (V read seq-contiguous through a transposed descriptor; 304 keys: a
        # multiple of 16, the copy engine's stride rule for that V), causal GQA hd128 with 256-key blocks
        # (hd64 ping-pong and hd256 128x64/128x128 were compiled once by hand, triton 3.6 and 3.9, and ran on
        # the H100: tests/test_hopper_fp8_gpu.py)
        ("hopper_ws fp8 e4m3 gqa causal hd128", dict(dtype="fp8_e4m3", head_dim=128, num_heads=8, num_kv_heads=2,
                                                      causal=True, seqlen=304),
         hopper.replace(BLOCK_N=256, num_stages=2, family="hopper_ws")),
        # ... and on the persistent grid (per tile descales, V^T tiles), causal GQA: a unit's two tiles may
        # read two KV heads' descales
        ("hopper_ws fp8 e4m3 persistent gqa causal hd128", dict(dtype="fp8_e4m3", head_dim=128, num_heads=8,
                                                                 num_kv_heads=2, causal=True, seqlen=304),
         hopper.replace(BLOCK_N=256, num_stages=2, family="hopper_ws", hopper_persistent=True)),
        # FP8 at head dim 256: the q.k product adds into fp32 every 128 products: the Gluon forward's two
        # slices (128 x 64 tiles: no local memory; at 128 x 128 the second accumulator spills) and the
        # portable forward's tl.dot max_num_imprecise_acc (its hd256 default tiles)
        ("hopper_ws fp8 e4m3 causal hd256, promoted q.k", dict(dtype="fp8_e4m3", head_dim=256, num_heads=2,
                                                                causal=True, seqlen=304),
         hopper.replace(BLOCK_N=64, num_stages=2, family="hopper_ws")),
        # (the portable FP8 forward, forward only: V read seq-contiguous, a transposed descriptor with TMA)
        ("fp8 e4m3 gqa causal hd256, promoted q.k, TMA + warp specialization",
         dict(dtype="fp8_e4m3", head_dim=256, num_heads=4, num_kv_heads=2, causal=True),
         KernelConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, tma=True, warp_specialize=True)),
        ("fp8 e5m2 sliding window + softcap, pointer loads",
         dict(dtype="fp8_e5m2", head_dim=64, num_heads=4, mask={"sliding_window": {"left": 256}},
              score_mod={"softcap": 30.0}), KernelConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)),
    ]
    if only:  # compile only the cases whose name holds one of these words (by hand: python tests/sm90_compile.py hopper_bwd)
        cases = [case for case in cases if any(word in case[0] for word in only)]
    failed = 0
    for name, fields, config in cases:
        CASE[0] = name
        varlen = fields.pop("varlen", False)
        forward_only = fields.pop("forward_only", False)
        backward_only = fields.pop("backward_only", False)  # (a kernel compiled elsewhere in its other phases)
        no_backward = fields.pop("no_backward", False)  # the forward and autograd's training step only
        dtype = fields.pop("dtype", "bf16")
        seqlen = fields.pop("seqlen", 300)
        spec = AttentionSpec(dtype=dtype, backward=dtype == "bf16", **fields)
        module = flashgen.compile(spec, config).module()
        module._LAUNCHER.interpreting = lambda: True  # accept CPU tensors: nothing is launched
        for family in ("hopper_forward", "hopper_backward"):  # and take the Gluon kernels
            if getattr(module._LAUNCHER, family, None) is not None:
                getattr(module._LAUNCHER, family).device_unserved = lambda device: None
        h, hk, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q = torch.randn(2, h, seqlen, d).to(spec.torch_dtype)
        k = torch.randn(2, hk, seqlen, d).to(spec.torch_dtype)
        tensors = {name: t for name, t in (("doc", torch.zeros(2, 300, dtype=torch.int32)),
                                           ("plen", torch.full((2,), 70, dtype=torch.int32)),
                                           ("bias", torch.zeros(300, 300))) if name in module.TENSORS}
        kw = dict(tensors=tensors)
        if varlen:  # packed (tokens, heads, dim): two sequences of 300 ("unequal": of 300 and 250, 50 tokens after)
            q, k = q.transpose(1, 2).reshape(600, h, d), k.transpose(1, 2).reshape(600, hk, d)
            unequal = varlen == "unequal"
            cu = torch.tensor([0, 300, 550 if unequal else 600], dtype=torch.int32)
            longest = 320 if unequal else 300  # (600 tokens = 2 x 300 would read as one length)
            kw.update(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
            if spec.dropout_p:
                kw.update(dropout_p=spec.dropout_p, seed=torch.zeros(1, dtype=torch.int64))
        if spec.fp8:
            kw.update(k_descale=torch.ones(2, hk))
        lse = torch.zeros(h, 600) if varlen else torch.zeros(2, h, 300)
        phases = (("forward", lambda: module.forward(q, k, k, **kw)),
                  ("backward", lambda: module.backward(q, q, k, k, q, lse, **kw)))
        if config.family == "hopper_ws" or config.hopper_bwd:  # autograd's path: the backward reads the forward's plan
            phases += (("training step", lambda: training_step(module._LAUNCHER, q, k, tensors)),)
        if no_backward:
            phases = (phases[0], *phases[2:])
        for phase, run in phases[:1] if spec.fp8 or forward_only else phases[1:2] if backward_only else phases:
            COMPILED.clear()
            start = time.perf_counter()
            try:
                run()
            except Exception as err:  # noqa: BLE001 - report every case, then fail
                failed += 1
                print(f"FAILED {name} {phase}: {type(err).__name__}: {str(err)[:4000]}")
                continue
            print(f"ok {name} {phase}: " + "; ".join(COMPILED) + f" ({time.perf_counter() - start:.1f} s)")
    if not only or any(word in "decode fp8 gluon" for word in only):
        for name, run, kernel in decode_fp8_cases(flashgen, AttentionSpec):
            CASE[0] = name
            COMPILED.clear()
            start = time.perf_counter()
            try:
                run()
                stack = stack_bytes(PTX[(name, "_attn_decode_fp8")])
                if stack:  # its O (2 x 16 x 64 float32 a warp at hd128), S, pages and copies in 255 registers
                    raise AssertionError(f"{stack} bytes of stack: spilled registers")
            except Exception as err:  # noqa: BLE001 - report every case, then fail
                failed += 1
                print(f"FAILED {name}: {type(err).__name__}: {str(err)[:4000]}")
                continue
            print(f"ok {name}: " + "; ".join(COMPILED) + f" ({time.perf_counter() - start:.1f} s)")
    # no Gluon kernel writes plain values over an initialized mbarrier (overwritten_mbarriers)
    gluon = {key: ptx for key, ptx in PTX.items() if key[1].startswith(("_attn_fwd_hopper_ws", "_attn_bwd_dkdv_hopper"))}
    clobbered = {f"{case}: {kernel}": sorted(offsets) for (case, kernel), ptx in gluon.items()
                 if (offsets := overwritten_mbarriers(ptx))}
    if clobbered or (not gluon and not only):
        failed += 1
        print(f"FAILED mbarriers: plain stores over initialized mbarriers at {clobbered or 'no Gluon kernel compiled'}")
    elif gluon:
        print(f"ok mbarriers: no plain store over an initialized mbarrier in {len(gluon)} Gluon kernels")
    # FA3's overlap keeps its MMAs asynchronous only if ptxas does not serialize them (C7514)
    overlapped = {case: ptx for (case, kernel), ptx in PTX.items()
                  if "overlap" in case and kernel.startswith("_attn_fwd_hopper_ws")}
    notes = {case: note for case, ptx in overlapped.items() if (note := serialized_wgmma(ptx))}
    if notes or (not overlapped and not only):
        failed += 1
        print(f"FAILED wgmma pipelining: {notes or 'no overlapped Gluon forward compiled'}")
    elif overlapped:
        print(f"ok wgmma pipelining: no serialized wgmma in {len(overlapped)} overlapped Gluon forwards")
    adding = PTX.get(("hopper_bwd atomic dQ gqa causal hd128", "_attn_bwd_dkdv_hopper"))
    if adding is not None:
        minor = tuple(int(x) for x in triton.__version__.split(".")[:2])
        bound = adding_dkdv_stack_bound(minor)
        stack = stack_bytes(adding)
        if stack is None or stack > bound:
            failed += 1
            print(f"FAILED the adding dK/dV kernel's spills: {stack} bytes of stack (at most {bound} under triton "
                  f"{triton.__version__}: see ADDING_DKDV_STACK)")
        else:
            print(f"ok the adding dK/dV kernel's spills: {stack} bytes of stack (at most {bound})")
    elif not only:
        failed += 1
        print("FAILED the adding dK/dV kernel's spills: its case did not compile")
    if only:
        return 1 if failed else 0
    shared = [kernel for (case, kernel), digest in BINARIES.items()
              if case == "hd64, pointer loads" and BINARIES.get(("hd128, pointer loads", kernel)) == digest]
    # two 64x64 programs per SM (228 KB, 1 KB of it reserved per program): the documents' forward must
    # fit as the causal one does (before its boundary loop took 2 stages: 115768 B, one program per SM)
    causal, documents = (SHARED.get((case, "_attn_fwd")) for case in ("causal, 64x64 TMA",
                                                                       "causal documents, 64x64 TMA"))
    if causal is None or documents is None or documents > causal or 2 * (documents + 1024) > 228 * 1024:
        failed += 1
        print(f"FAILED documents' shared memory: {documents} B (causal: {causal} B)")
    else:
        print(f"ok documents' shared memory: {documents} B, two programs per SM (causal: {causal} B)")
    if shared or not BINARIES:
        failed += 1
        print(f"FAILED constexpr globals: hd64 and hd128 share the binaries of {shared}")
    else:
        print("ok constexpr globals: hd64 and hd128 compile to different binaries")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
