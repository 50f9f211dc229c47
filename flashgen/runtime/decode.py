"""The host side of decode: attention of a few query rows over a KV cache (split-KV, pack_gqa).

Plain Python over torch and triton, like host.py: the modules flashgen builds import it, the
standalone module `flashgen generate` writes pastes it verbatim after host.py (whose names it
uses: the import below is dropped there). A rendered module builds one DecodeLauncher beside
its AttentionLauncher and exposes its decode().

Bounds. A cache_seqlens, block_table or cache_batch_idx entry that points outside the cache is
an error naming the argument, never an out-of-bounds read or write, and costs an eager call no
synchronisation:
- The kernels clamp every index they read from those tensors, and the append kernel does not
  write a new key whose slot lies outside the cache. The first out-of-range index a kernel
  meets is written to the device's bounds record (BoundsRecord: a few int64 words of pinned
  host memory the GPU writes directly; nothing is written while the indices are in range).
- check="async" (the default): a call first reads the record (a host memory read: no device
  work, no wait). When it holds an error the call synchronises the device, clears the record
  and raises ValueError naming the argument, the position and the value. On a GPU an error is
  thus raised by the first decode call (or check_bounds()) after the kernels that met it have
  run: in a serving loop, the next step. The outputs of the call that met it are meaningless
  (computed from clamped indices). On the CPU (Triton's interpreter) the kernels have run
  when the launch returns, so the call itself raises.
- check="sync" (debugging): the call waits for its own kernels and raises at once.
- check_bounds(device): an explicit sync point: waits for the device, raises what is recorded.
- While a CUDA graph is captured or torch.compile traces, the host reads nothing; a graph's
  replays write the same record, so the next eager call or check_bounds() raises.

CUDA graphs: a decode step makes no host decision from tensor contents. The number of splits,
the grid and every buffer come from shapes (the cache's capacity, never cache_seqlens); the
kernel reads cache_seqlens on the device. A split call may merge its splits in the split kernel
(fused_combine): the last program of each row block to finish merges them, found by a ticket
counter (split_tickets, one per device and stream) that every launch leaves at 0, so graph
replays need no reset. Such a call's partial results go to its stream's one buffer (split_parts:
launches on a stream run in order); while a graph is captured, to a buffer of the graph's own.

Host time: everything a call derives from its arguments' shapes, strides, dtypes and devices
(input checks, the launch plan, the kernels' scalar arguments) is computed once per such
signature (DecodeLauncher.calls); a repeated call builds one key, allocates its outputs and
launches (read(layout="bhsd") takes a model's (B, H, S, D) tensors without transposed views).
The launches skip Triton's argument binder after a kernel's first launch: each
DecodeCall keeps the BoundLaunch objects (flashgen/runtime/launch.py) of its append, split-KV and
combine launches per alignment of its tensors' pointers (what Triton specializes on besides the
metadata the call key holds). A contiguous cache read without appending (a model's own cache,
one key longer every generation step) is keyed without its length: its length, strides and
capacity are launch arguments, the plan is kept per key-block class (DecodeLauncher.length_free),
and an int or absent cache_seqlens is a row of a table, not a new tensor (seqlens_arg).

FP8 (float8_e4m3fn or float8_e5m2): the cache, and optionally q, may be FP8 with float32
descales (batch, KV heads), flash-attn 3's q_descale / k_descale / v_descale (a missing one is
1.0). The decode kernel loads FP8 tiles and converts them in registers, to fp16 where the output
is bf16 (fp16_dot: one instruction per pair of elements, exact) and V before its layout change
(fp8_v_conversion); the output has the spec's dtype. On sm90 the calls DecodeLauncher.fp8_gluon
takes run a Gluon kernel instead (templates/decode/fp8_cache.j2: the cache's bytes read in pairs and
split into fp16 operands in registers, V never written back to shared memory), with its own plan. New keys and values (k, v) always come in the spec's dtype, as a model produces
them; with an FP8 cache the append kernel quantizes them on write, x / descale rounded to
nearest even and saturated to the FP8 range (what vLLM's reshape_and_cache does with its
k_scale / v_scale). FP8 needs sm89+ on a GPU.
"""

import torch
import triton
import triton.language as tl  # the same module as the kernels' tl in a standalone module

from flashgen.runtime.host import AttentionLauncher, bounds_error, bounds_record, check_bounds, device_sync_forbidden  # standalone: host.py precedes
from flashgen.runtime.host import check_device, check_interpretable, check_softmax_scale, padded_head_dim, sm_count  # standalone: host.py precedes
from flashgen.runtime.launch import BoundLaunch, allocator, argument_signature, capturing, check_data, check_outputs_apart, check_tensor, launch_context, overlapping  # standalone: host.py precedes

MAX_PAGE_SIZE = 256
MAX_SPLITS = 128  # FA3's cap
# A split grid of 16-bit 32 x 2 tiles (21 KB of shared memory, 86 registers on sm90: five fit an
# SM) takes the split count that fills this many programs per SM in one wave (B=8: 8 splits, 512
# programs, as B=64's unsplit grid). Only a paged cache of 16..63-key pages takes it (decode_knobs).
SPLIT_PROGRAMS_PER_SM = 4
# A grid that fills the SMs takes small tiles (several programs per SM) only with at least this many
# programs per SM: B=64 x 8 KV heads (3.9 per SM) gains from them, B=16 and B=32 (1 and 2 per SM) ran
# their 32 x 2 programs alone on an SM, starved of loads in flight (H200 B=16 x 8K keys: 349.0 us
# against 137.0 at 128 x 3, cuDNN 134.0; B=32 x 4K 202.3 vs 138.5, cuDNN 135.7).
SMALL_TILE_PROGRAMS_PER_SM = 3
# GPUs whose memory reads faster than the H100's (3.35 TB/s): the H200's HBM3e (4.8 TB/s) needs more
# of a program's bytes in flight to reach it (decode_knobs). Matched in the device's name (GH200
# boards, 4-4.9 TB/s, match too: unmeasured).
FAST_MEMORY_GPUS = ("H200",)
# Whether a split call merges its splits in the split kernel's last program per row block (one
# launch per step) rather than in a combine kernel, unless told (decode_knobs' fused_combine). H100,
# bf16, 32/8 heads, hd128, us (benchmarks/results/2026-11-23-h100-decode-v6.md and -variants-v6.json,
# cuDNN in the same rounds): B=8 x 8K keys 103.9 (cuDNN 107.1; the combine kernel's 106.9 in v5),
# B=1 x 128K 187.8 vs 191.6, paged-16 B=8 109.8 vs 111.8.
FUSED_COMBINE = True
# The fused merge takes up to this many fp32 partial-output elements (rows x splits x head dim)
# per step of its loop over the row block's rows: 64 registers per thread at 4 warps.
COMBINE_ELEMENTS = 8192
MAX_PACKED_ROWS = 64  # the tile's M: (query positions x heads of a group) above this take several row blocks
CHECKS = ("async", "sync")
FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper convert FP8 in hardware


# ----------------------------------------------------------------------------- knobs
def num_splits_heuristic(total_mblocks, num_sms, num_n_blocks, max_splits=MAX_SPLITS):
    """How many programs share one (batch element, KV head, row block)'s keys. None when the
    grid already nearly fills the SMs (FA3's rule). Else, when some split count keeps the grid
    within one wave and fills at least 85% of the SMs, the largest such count: each program then
    has an SM to itself, which a memory-bound program needs to keep enough loads in flight (H100,
    B=1, 8 KV heads, 128K keys: 16 splits ran 190.8 us, FA3's choice of 15 194.2 us, 32 197.1 us).
    Otherwise FA3's rule (hopper/heuristics.h): the fewest splits whose wave efficiency
    (programs / SMs over whole waves) is within 85% of the best. Never more than the key blocks,
    the SMs or max_splits."""
    if total_mblocks >= 0.8 * num_sms or total_mblocks == 0:  # (no rows: nothing to split)
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    one_wave = min(num_sms // max(total_mblocks, 1), max_splits)
    if one_wave >= 1 and total_mblocks * one_wave >= 0.85 * num_sms:
        return one_wave
    efficiency = []
    for splits in range(1, max_splits + 1):
        waves = total_mblocks * splits / num_sms
        efficiency.append(waves / -(-waves // 1))
    best = max(efficiency, default=0.0)
    for splits, eff in enumerate(efficiency, start=1):
        if eff >= 0.85 * best:
            return splits
    return 1


SMEM_LIMITS = {}
FAST_MEMORY = {}


def fast_memory(device):
    """Whether the device is one of FAST_MEMORY_GPUS (a property query, cached; never the interpreter)."""
    if device.type != "cuda":
        return False
    if device not in FAST_MEMORY:
        name = torch.cuda.get_device_properties(device).name.upper()
        FAST_MEMORY[device] = any(gpu in name for gpu in FAST_MEMORY_GPUS)
    return FAST_MEMORY[device]


def smem_limit(device):
    """Shared memory one program may use on the device (bytes); unbounded under the interpreter."""
    if device.type != "cuda":
        return float("inf")
    if device not in SMEM_LIMITS:
        props = torch.cuda.get_device_properties(device)
        SMEM_LIMITS[device] = getattr(props, "shared_memory_per_block_optin", 0) or 101376
    return SMEM_LIMITS[device]


def fp8_slots_per_sm(staged, device):
    """How many split programs of an FP8 cache's decode share one SM (the split heuristic's
    slots): two where two programs' tiles in flight (staged bytes) fit the shared memory (an
    H100's 128-key, 3-stage e4m3 tile takes 106 KB), else one. The FP8 tile's loop issues
    conversions and products for half the bytes of a bf16 tile: one program per SM (4 warps)
    leaves the SM's memory pipe idle between them, two keep it busy."""
    return 2 if 2 * staged <= smem_limit(device) else 1


def check_knob_values(BLOCK_N, num_splits, num_warps, num_stages, page_prefetch, fused_combine):
    """A decode call's knobs, each refused by name unless of its kind (what they are worth: decode_knobs)."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0: the tuned count or a heuristic), got {num_splits!r}")
    if fused_combine is not None and not isinstance(fused_combine, bool):
        raise ValueError(f"fused_combine: expected a bool or None (None: the default), got {fused_combine!r}")
    for name, value in (("num_warps", num_warps), ("num_stages", num_stages)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):  # Triton's: a power of two
        raise ValueError(f"num_warps: expected one of 1, 2, 4, 8, 16, got {num_warps!r}")
    if page_prefetch is not None and not isinstance(page_prefetch, bool):
        raise ValueError(f"page_prefetch: expected a bool or None (None: the default), got {page_prefetch!r}")
    if BLOCK_N is not None and (isinstance(BLOCK_N, bool) or not isinstance(BLOCK_N, int) or BLOCK_N < 16
                                or BLOCK_N & (BLOCK_N - 1)):
        raise ValueError(f"BLOCK_N: expected a power of two >= 16, got {BLOCK_N!r}")


def decode_knobs(head_dim, packed_rows, batch, num_kv_heads, capacity, device, *, BLOCK_N=None, num_splits=0,
                 num_warps=None, num_stages=None, page_prefetch=None, fused_combine=None, page_size=None,
                 element_size=2):
    """The knobs of a decode call, from shapes only: {BLOCK_M, BLOCK_N, num_splits, num_warps,
    num_stages, page_prefetch, fused_combine}, the given ones checked and the others' defaults filled in.

    The defaults (H100, bf16, head dim 128, 32 q / 8 KV heads, in us):
    - BLOCK_N 128 where each key's page is looked up (page_size < 64: fewer, larger tiles
      amortise the per-key page arithmetic; B=8, 8K keys, page 1: 115.5 vs 126.2 at 64), else 64;
      32 above head dim 128. Split grids of 16..63-key pages: 32 (below).
    - Where the grid crowds the SMs unsplit (at least SMALL_TILE_PROGRAMS_PER_SM programs each) and
      a tile holds one query row per head (BLOCK_M 16, head dim <= 128): small tiles, several
      programs per SM, so the grid runs in fewer, fuller waves. A 16-bit cache: 32-key tiles, 2
      stages (21 KB of shared memory, ~80 registers: up to 6 programs per SM; B=64, 4K keys, 512
      programs: 358.2 / 357.7 / 358.0 vs 363.5 / 363.6 at 128 x 3, one program per SM in 3.9
      waves; cuDNN 363.1, Flex 361.9). An FP8 cache: 64-key
      tiles, 3 stages, 2 warps (55 KB: 4 per SM; 207.7 vs 210.8 at 128 x 3 x 4 warps). Other
      grids that fill: 128 x 3 (B=64: 363.7 vs 384.5 at 64 x 3).
    - Where the grid does not fill the SMs (split), a 16-bit cache in pages of 16..63 keys, one
      query row per head: 32 x 2 tiles and the split count that fills SPLIT_PROGRAMS_PER_SM (4)
      programs per SM (B=8, 8K keys, page 16: 8 splits 111.8 vs 114.2 at 2 splits x 128 x 3).
      Nowhere else (v4 run, 3 interleaved repeats each, medians): the same rule ran B=8 contiguous
      108.0 vs 106.8 at 2 x 64 x 3 (cuDNN 106.6; 10 splits 108.1, 32 x 3 110.1, 2 warps 107.6),
      B=1 128K 196.1 (66 splits) vs 191.1 at 16 x 64 x 3 (128 splits 220.2; cuDNN 192.5), page 1
      115.6 vs 114.2 at 2 x 128 x 3. More programs per SM do not raise a split grid's bytes/s (B=8
      reads 2.48-2.51 TB/s whatever the tiles, cuDNN 2.52): its bound is not loads in flight.
    - num_stages 3 (another K/V tile in flight), 2 where three do not fit in shared memory.
    - Small tiles need several programs per SM: B=16 and B=32 with 8 KV heads fill the SMs with
      one or two programs each, which take 128 x 3 tiles (H200: B=16 x 8K keys 135.3 vs 350.9 at
      32 x 2, cuDNN 134.0; B=32 x 4K 138.4 vs 203.4, cuDNN 135.6; FP8 B=16 121.6 vs 156.4 at
      64 x 3 x 2 warps, B=32 95.1 vs 101.3). On the H100 only B=64 was measured (small tiles won).
    - A GPU with faster memory (fast_memory: the H200's HBM3e; H200, bf16, us, 3 interleaved rounds,
      benchmarks/results/2026-11-29-h200-decode-variants-s32*): more bytes in flight per program (the
      rules below: one query row per head, 16-bit caches; FP8 and fp32 keep the H100's). A contiguous
      cache's crowded grid: 128 x 2 at head dim 128 (one program per SM; the 32 x 2 rule's several did
      not keep enough bytes in flight): B=64 x 4K keys 254.6 vs 267.2 at 32 x 2 (64 x 2 255.9), cuDNN
      256.0; MHA (32 KV heads) B=16 x 4K 255.5 vs 311.3 at 64 x 2, cuDNN 256.2, B=16 x 2K 136.0 vs
      163.6, B=32 x 2K 255.3 vs 263.7, B=64 x 1K 254.8 vs 268.2; GQA B=128 x 2K 255.9 vs 256.1 at 64 x
      2, B=64 x 16K 963.5 vs 972.7, but B=64 x 1K 78.3 vs 76.8. At head dim 64, 64 x 2 (B=64 x 4K: 142.7
      vs 167.2 at 128 x 2; cuDNN 136.4). A paged cache's crowded grid the same (session 46, B=64 x 4K,
      clean L2, 128 x 2 vs 32 x 2: pages of 16 258.5 vs 312.9, 64 259.8 vs 263.7, 256 242.8 vs 263.2;
      contiguous 241.1; 64 x 3 265.5 / 277.9 / 279.1; results/2026-11-30-h200-decode-bf16-s46-paged-tiles.md;
      1.01-1.33x over 7 crowded shapes, -paged-crowded.md; pages of 1, 32 and 128 unmeasured). A
      grid that does not fill the SMs (split by default; also with num_splits=1 given), contiguous
      cache: 4 stages where they fit (B=8 x 8K 77.6 / 78.6 vs 79.9 / 79.5; B=1 x 128K 135.7 / 137.8 vs
      140.0 / 140.1, two runs) and 128-key tiles at head dim 64 (B=8 x 8K 49.3 vs 54.7 at 64 x 4, B=4 x
      8K 31.6 vs 34.0, B=1 x 64K 49.4 vs 54.7, cuDNN 31.4 / 49.5 in the last two); in pages of 16..63
      keys: 3 stages (paged-16 B=8: 82.1 vs 87.2). A contiguous cache's grid of more than one program per SM
      but fewer than SMALL_TILE_PROGRAMS_PER_SM, at head dim > 64: 64 x 3 (106 KB: two programs fit an
      SM, where 128 x 3 leaves one and the grid's second wave part-empty; session 33, results/2026-11-29-
      h200-decode-variants-s33{,-b}.md, 3 rounds, us, 64 x 3 vs 128 x 3, cuDNN): GQA B=20 x 4K 98.0 vs
      118.0 (94.3), B=24 x 4K 108.1 / 108.4 vs 119.8 / 119.3 (113.0), B=32 x 4K 136.7 vs 138.8 (136.1),
      B=32 x 1K 46.7 / 46.5 vs 49.4 / 49.6 (46.1), B=40 x 2K 98.6 vs 101.8 (101.3), B=48 x 2K 108.5 vs
      111.1 (111.3); MHA B=6 x 4K 108.0 vs 119.1 (110.6), B=8 x 2K 76.8 vs 79.6 (75.6). At one program
      per SM or fewer 128 x 3 stays (B=16 x 8K 135.6 vs 139.6 at 64 x 3); 128 x 2 ties 64 x 3 below two
      programs per SM and loses above (B=40 110.4, B=48 115.4).
    - An FP8 cache (element_size 1) where the grid does not fill the SMs (_attn_decode's; on sm90 the
      Gluon kernel's plan overrides it, DecodeLauncher.plan): 128-key tiles, 3 stages
      (106 KB: two programs fit an SM), and the split count that fills two programs per SM in one
      wave (fp8_slots_per_sm). Before, 4 stages (139 KB) left one program per SM: B=1, 128K keys,
      16 splits 127.0 -> 32 splits 120.1 (33, the rule's count: 120.4); paged-16 B=8, 2 splits
      82.7 -> 4 splits 72.1 (= the contiguous cache); B=8 8K keys 72.4 / 72.7 -> 73.1 / 73.2 (0.7%
      slower: the one row the rule does not help).
    - page_prefetch: a paged tile's page numbers read one tile ahead, so no K/V load waits on
      a block table read; without it Triton's pipeliner does not multi-buffer the K/V loads
      (page 256, BLOCK_N 64: 108.7 vs 126.6; contiguous 107.7).
    - fused_combine (a split call): the split kernel's last program of each row block merges the
      splits (one launch per step, as cuDNN's decode) instead of a combine kernel after it.
      Default FUSED_COMBINE."""
    block_m = min(max(16, triton.next_power_of_2(packed_rows)), MAX_PACKED_ROWS)
    check_knob_values(BLOCK_N, num_splits, num_warps, num_stages, page_prefetch, fused_combine)
    total_mblocks = batch * num_kv_heads * triton.cdiv(packed_rows, block_m)
    fills = total_mblocks >= 0.8 * sm_count(device)
    fp8_split = element_size == 1 and not fills
    one_row = block_m == 16 and head_dim <= 128  # one query row per head
    crowded = total_mblocks >= SMALL_TILE_PROGRAMS_PER_SM * sm_count(device)
    small = crowded and one_row and element_size <= 2  # small tiles, many per SM
    split_small = not fills and one_row and element_size == 2 and BLOCK_N is None and page_size is not None \
        and 16 <= page_size < 64  # small tiles, and the splits that fill several per SM
    # the faster memory's rules (fast_memory) take 16-bit caches with one query row per head; most, unpaged ones
    fast = fast_memory(device) and one_row and element_size == 2
    fast_contiguous = fast and page_size is None
    # the faster memory's grids of one to three programs per SM at head dim > 64: tiles two programs fit an SM
    two_per_sm = fast_contiguous and head_dim > 64 and sm_count(device) < total_mblocks and not crowded
    def staged_bytes(block_n, stages):  # K and V tiles in flight, and room for the rest
        return stages * block_n * 2 * padded_head_dim(head_dim) * element_size + 8192

    block_n = BLOCK_N
    if block_n is None:
        if small or split_small:
            block_n = 64 if element_size == 1 else (128 if head_dim > 64 else 64) if fast and small else 32
        else:
            block_n = 32 if head_dim > 128 else 128 if ((page_size is not None and page_size < 64) or fills
                                                        or fp8_split or (fast_contiguous and head_dim <= 64)) \
                and not two_per_sm else 64
        while block_n > 16 and staged_bytes(block_n, 2) > smem_limit(device):
            block_n //= 2
    if isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"BLOCK_N: expected a power of two >= 16, got {block_n!r}")
    if num_stages is None:
        most = 2 if (small or split_small) and element_size == 2 and BLOCK_N is None else 3
        if fast and BLOCK_N is None and not fills:  # split by default (above)
            most = 3 if split_small else 4 if page_size is None else most
        num_stages = next((n for n in range(most, 2, -1) if staged_bytes(block_n, n) <= smem_limit(device)), 2)
    if num_warps is None:
        num_warps = 2 if small and element_size == 1 and BLOCK_N is None else 4
    if num_splits == 0:
        per_sm = fp8_slots_per_sm(staged_bytes(block_n, num_stages), device) if fp8_split else \
            SPLIT_PROGRAMS_PER_SM if split_small else 1
        slots = sm_count(device) * per_sm
        num_splits = num_splits_heuristic(total_mblocks, slots, triton.cdiv(capacity, block_n))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_splits": min(num_splits, MAX_SPLITS),
            "num_warps": num_warps, "num_stages": num_stages,
            "page_prefetch": True if page_prefetch is None else page_prefetch,
            "fused_combine": FUSED_COMBINE if fused_combine is None else fused_combine}


def fp16_dot(cache_dtype, out_dtype):
    """Whether the decode kernel takes its products on fp16 operands (q scaled per row by a power
    of two, the cache's tiles converted to fp16, P in fp16) rather than in the output's dtype: for
    an FP8 cache with a bf16 output. FP8 converts to fp16 in one instruction per pair, exactly;
    to bf16 it takes a second, quarter-rate conversion per element, which bounded the kernel
    (H100, us, bf16 products -> fp16: B=8 x 8K keys 96.1 -> 72.4, B=64 x 4K 247.8 -> 208.5, B=1 x
    128K 175.2 -> 123.2; benchmarks/NOTES.md, 2026-11-23)."""
    return cache_dtype in FP8_TYPES and out_dtype == torch.bfloat16


def fp8_v_conversion(cache_dtype, out_dtype, device):
    """How the decode kernel converts an FP8 cache's V tiles to fp16 (its V_CVT): 0 by a cast
    (not FP8, not computed in fp16, or Triton's interpreter, which runs no asm), 1 e4m3 and 2 e5m2
    by the asm of _fp8_tile_to_fp16, which keeps the conversion before the operand's layout change
    (sm90: the FP8 B=64 loop took 1342 SASS instructions per warp and 128-key tile with a bf16 cast,
    939 with an fp16 one, 615 with the asm; the bf16 cache's takes 552 for twice the bytes. H100 us,
    asm vs fp16 cast: paged-16 B=8 86.2 vs 96.6, B=8 72.8 vs 72.4, B=64 212.5 vs 208.5: its extra
    fp16 V tile of shared memory leaves two programs per SM where the cast fits three)."""
    if device.type != "cuda" or cache_dtype not in FP8_TYPES or not (
            fp16_dot(cache_dtype, out_dtype) or out_dtype == torch.float16):
        return 0
    return 1 if cache_dtype == torch.float8_e4m3fn else 2


# ----------------------------------------------------------------------------- appending to the cache
def fp8_rounding(dtype):
    """The constants _quantize_fp8 rounds float32 to an FP8 dtype with: (mantissa bits float32
    drops, smallest normal, the fp32 magic number whose add and subtract rounds a subnormal to the
    FP8 spacing, largest finite value)."""
    info = torch.finfo(dtype)
    mantissa = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype]
    min_normal = info.smallest_normal
    return 23 - mantissa, min_normal, min_normal * 2.0 ** (23 - mantissa), info.max


@triton.jit
def _quantize_fp8(x, descale, dtype: tl.constexpr, BY_HAND: tl.constexpr, DROP: tl.constexpr,
                  MIN_NORMAL: tl.constexpr, MAGIC: tl.constexpr, FP8_MAX: tl.constexpr):
    # x / descale in FP8: saturated to +-FP8_MAX, rounded to nearest even. BY_HAND (the
    # interpreter, whose fp32 -> fp8 cast is wrong where rounding carries into the exponent and
    # truncates subnormals): normals drop DROP mantissa bits with half-to-even, subnormals round
    # by an fp32 add of MAGIC; the value is then exact in FP8 and the cast keeps it.
    y = tl.minimum(tl.maximum(x.to(tl.float32) / descale, -FP8_MAX), FP8_MAX)
    if BY_HAND:
        a = tl.abs(y)
        bits = a.to(tl.int32, bitcast=True)
        bits = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & (-(1 << DROP))
        a = tl.where(a < MIN_NORMAL, (a + MAGIC) - MAGIC, bits.to(tl.float32, bitcast=True))
        # the sign bit set on the cast magnitude: -0.0 stays -0.0 (Triton 3.6's interpreter casts
        # -0.0 to +0)
        sign = tl.where(y.to(tl.int32, bitcast=True) < 0, -128, 0).to(tl.int8)
        out = (a.to(dtype).to(tl.int8, bitcast=True) | sign).to(dtype, bitcast=True)
    else:
        out = y.to(dtype)
    return out


@triton.jit
def _decode_append(K_CACHE, V_CACHE, K, V, SEQLENS, BT, CACHE_BATCH, K_DESCALE, V_DESCALE,
                   stride_cb, stride_cn, stride_ch, stride_cd, stride_wb, stride_wn, stride_wh, stride_wd,
                   stride_kb, stride_kn, stride_kh, stride_kd, stride_vb, stride_vn, stride_vh, stride_vd,
                   stride_btb, stride_ksb, stride_ksh, stride_vsb, stride_vsh, seqlen_new, num_kv_heads, capacity,
                   num_pages, cache_batch,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, BATCH_INDEX: tl.constexpr,
                   QUANTIZE: tl.constexpr, BY_HAND: tl.constexpr, DROP: tl.constexpr, MIN_NORMAL: tl.constexpr,
                   MAGIC: tl.constexpr, FP8_MAX: tl.constexpr):
    # One new key per program (batch element b, position i): K[b, i] and V[b, i], every KV head,
    # written at slot SEQLENS[b] + i of the element's cache (page BT[b, slot // PAGE_SIZE] when
    # paged; row CACHE_BATCH[b] with BATCH_INDEX). Nothing is written where the length, the page
    # or the row is out of range (the decode kernel that follows records which). QUANTIZE (an FP8
    # cache): each head's key and value are stored as x / descale[b, head] in FP8.
    b = (tl.program_id(0) // seqlen_new).to(tl.int64)
    i = tl.program_id(0) % seqlen_new
    length = tl.load(SEQLENS + b)
    pos = length + i
    ok = (length >= 0) & (length + seqlen_new <= capacity)
    if PAGED:
        entry = tl.load(BT + b * stride_btb + pos // PAGE_SIZE, mask=ok, other=0)
        ok = ok & (entry >= 0) & (entry < num_pages)
        row = entry.to(tl.int64)
        slot = (pos % PAGE_SIZE).to(tl.int64)
    else:
        row = b
        if BATCH_INDEX:
            row = tl.load(CACHE_BATCH + b).to(tl.int64)
            ok = ok & (row >= 0) & (row < cache_batch)
        slot = pos.to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    offs_dv = tl.arange(0, BLOCK_DV)[None, :]
    heads = tl.where(ok, num_kv_heads, 0)  # the heads to write: none where the slot is out of range
    k_mask = (offs_h < heads) & (offs_d < HEAD_DIM)
    v_mask = (offs_h < heads) & (offs_dv < HEAD_DIM_V)
    k = tl.load(K + b * stride_kb + i * stride_kn + offs_h * stride_kh + offs_d * stride_kd, mask=k_mask)
    v = tl.load(V + b * stride_vb + i * stride_vn + offs_h * stride_vh + offs_dv * stride_vd, mask=v_mask)
    if QUANTIZE:
        kd = tl.load(K_DESCALE + b * stride_ksb + offs_h * stride_ksh, mask=offs_h < heads, other=1.0)
        vd = tl.load(V_DESCALE + b * stride_vsb + offs_h * stride_vsh, mask=offs_h < heads, other=1.0)
        k = _quantize_fp8(k, kd, K_CACHE.dtype.element_ty, BY_HAND, DROP, MIN_NORMAL, MAGIC, FP8_MAX)
        v = _quantize_fp8(v, vd, V_CACHE.dtype.element_ty, BY_HAND, DROP, MIN_NORMAL, MAGIC, FP8_MAX)
    tl.store(K_CACHE + row * stride_cb + slot * stride_cn + offs_h * stride_ch + offs_d * stride_cd, k, mask=k_mask)
    tl.store(V_CACHE + row * stride_wb + slot * stride_wn + offs_h * stride_wh + offs_dv * stride_wd, v, mask=v_mask)


# ----------------------------------------------------------------------------- split launches' buffers
TICKETS = {}  # (device, stream handle) -> its int32 tickets, all 0 between launches
MAX_TICKET_STREAMS = 64  # buffers kept (4 KiB and up each); a program making streams without end drops the oldest


def current_stream(device) -> int:
    """The handle of the current stream on `device` (0 off CUDA): Triton's launches go to it, and
    the fused merge's tickets are kept per stream."""
    if device.type != "cuda":
        return 0
    return triton.runtime.driver.active.get_current_stream(
        device.index if device.index is not None else torch.cuda.current_device())


PARTS = {}  # (device, stream handle) -> the float32 buffer of partial results fused split launches on it share


def _stream_buffer(table, device, stream, numel, make, least=0):
    """table's buffer of at least numel elements for launches on (device, stream): made by make(size)
    (size numel, at least `least`, or twice the one it replaces), MAX_TICKET_STREAMS kept (the oldest
    dropped for a new stream)."""
    key = (device, stream)
    buffer = table.get(key)
    if buffer is None or buffer.numel() < numel:
        if buffer is None and len(table) >= MAX_TICKET_STREAMS:
            del table[next(iter(table))]
        size = max(numel, least, 2 * buffer.numel() if buffer is not None else 0)
        buffer = table[key] = make(size)
    return buffer


def split_parts(device, numel, stream):
    """At least numel float32 elements on the device for the partial results (each split's output rows and
    LSE) of fused split launches on `stream`: one buffer per stream, which its launches share (they run in
    stream order, and each merges its own partials before it ends), grown as needed; an allocation fewer
    per call (~3 us of an H200 host)."""
    return _stream_buffer(PARTS, device, stream, numel, lambda size: torch.empty(size, dtype=torch.float32,
                                                                                 device=device))


def split_tickets(device, count, stream=None):
    """At least count int32 zeros on the device for launches on `stream` (current_stream(device)
    when None): the tickets a fused split launch counts its finished programs with (one per row
    block; the last program resets its row block's to 0, so they are 0 again when the launch
    ends). One buffer per device and stream, made with zeros once and grown by doubling (a grown
    one replaces it; calls keep the one they had: it stays 0). Launches on one stream run one
    after another and never share a ticket at once; launches on two streams may run at the same
    time, so each stream counts on its own buffer (one buffer per device let two streams' decode
    steps take each other's tickets and merge splits too early).
    While a CUDA graph is captured (or torch.compile traces) the call gets zeros of its own, made
    by the graph (a memset node) at each replay and kept alive by the graph's memory pool: a graph
    that took a stream's buffer would replay into freed memory once that buffer was grown or
    dropped."""
    if device_sync_forbidden(device):
        return torch.zeros(count, dtype=torch.int32, device=device)
    return _stream_buffer(TICKETS, device, current_stream(device) if stream is None else stream, count,
                          lambda size: torch.zeros(size, dtype=torch.int32, device=device), least=1024)


# ----------------------------------------------------------------------------- launching
def _meta(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _meta_without_length(t, seq_dim=1):
    """_meta of a contiguous cache (batch, S, H_kv, D) less what may depend on its length S: the
    size of dim 1 and the strides of dims 0 to 2 (plain launch arguments of the decode kernel;
    a (B, S, H_kv, D) view of transformers' (B, H_kv, S, D) cache has a head stride of S * D).
    The last stride stays: the checks require 1. seq_dim 2: of a (B, H_kv, S, D) cache, the same
    values as of its (B, S, H_kv, D) view."""
    shape = t.shape
    return shape[0], shape[3 - seq_dim], shape[3], t.stride(3), t.dtype, t.device


def _call_key(free, q, k_cache, v_cache, cache_seqlens, k, v, block_table, cache_batch_idx, named, out, lse,
              return_lse, softmax_scale, BLOCK_N, num_splits, num_warps, num_stages, page_prefetch, check, q_descale,
              k_descale, v_descale, fused_combine):
    """DecodeLauncher.calls' key of a call: everything it derives its checks and plan from (free:
    a length-free call, its caches keyed without their length)."""
    caches = (_meta_without_length(k_cache), _meta_without_length(v_cache)) if free else \
        (_meta(k_cache), _meta(v_cache))
    return (free, _meta(q), *caches, _meta(k), _meta(v), _meta(block_table), _meta(cache_batch_idx),
            _meta(cache_seqlens) if isinstance(cache_seqlens, torch.Tensor) else type(cache_seqlens),
            tuple((n, _meta(t)) for n, t in named.items()) if named else None, _meta(out), _meta(lse),
            bool(return_lse), *map(_typed, (softmax_scale, BLOCK_N, num_splits, num_warps, num_stages, page_prefetch,
                                            check)), _meta(q_descale), _meta(k_descale), _meta(v_descale),
            _typed(fused_combine))


def _typed(value):
    """A scalar argument in a call key with its type: True, 1 and 1.0 are one dict key, and a check refuses what
    its twin passed (a scale True, num_splits 2.0), so each is keyed, and checked, apart."""
    return type(value), value


class DecodeCall:
    """What a decode call derives from its arguments' shapes, strides, dtypes and devices: its
    checks passed, its launch plan and the kernels' scalar arguments (DecodeLauncher.prepare)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def check_append_targets(seqlens, appended, capacity, block_table, cache_batch_idx, cache_dims):
    """The targets of an append-only call (no query rows: no decode kernel runs, and it is that kernel which records
    what the append skips out of range), checked on the host before the append, with one wait for the device:
    each element's length and its appended keys within the capacity, the pages they land on (block_table) and
    the cache rows (cache_batch_idx) within the cache. cache_dims: k_cache's (pages, page size) or (rows, capacity)."""
    lengths = seqlens.tolist()
    for b, n in enumerate(lengths):
        if n < 0:
            raise bounds_error(1, b, 0, n, capacity)
        if n + appended > capacity:
            raise bounds_error(2, b, appended, n, capacity)
    if block_table is not None:
        table, page = block_table.tolist(), cache_dims[1]
        for b, n in enumerate(lengths):
            for j in range(n // page, (n + appended - 1) // page + 1):
                if not 0 <= table[b][j] < cache_dims[0]:
                    raise bounds_error(3, b, j, table[b][j], cache_dims[0])
    elif cache_batch_idx is not None:
        for b, row in enumerate(cache_batch_idx.tolist()):
            if not 0 <= row < cache_dims[0]:
                raise bounds_error(4, b, 0, row, cache_dims[0])


class DecodeLauncher:
    """Checks a decode call's inputs and launches the append, split-KV and combine kernels.

    attention: the module's AttentionLauncher (the spec, the named tensors). kernel: _attn_decode;
    combine_kernel: _decode_combine. tuned: None, or a function (batch, capacity) -> the tuned
    knobs {num_splits, BLOCK_N, num_warps, num_stages} for that bucket, or None (set by
    flashgen.kvcache from the results database; used when a call overrides no knob and does not run
    the Gluon FP8-cache kernel, fp8_kernel: they are _attn_decode's).
    """

    MAX_CALLS = 1024  # call signatures a launcher remembers (cleared past this)

    def __init__(self, *, attention, kernel, combine_kernel):
        self.attention = attention
        attention.decoder = self  # its calls of a few queries over more keys run here (AttentionLauncher.decode_call)
        self.spec = attention.spec
        self.kernel, self.combine_kernel, self.append_kernel = kernel, combine_kernel, _decode_append
        # _attn_decode_fp8 (templates/decode/fp8_cache.j2), set by the module where it renders; the calls
        # fp8_gluon() takes run it in place of _attn_decode, with the same arguments
        self.fp8_kernel = None
        self.tuned = None
        self.calls = {}  # call key -> DecodeCall
        self.reads = {}  # read()'s short key -> the length-free DecodeCall entry of self.calls it stands for
        self.lengths = {}  # (batch, device) -> the table of int cache_seqlens (seqlens_arg)
        self.ones = {}  # (batch, kv heads, device) -> the descale of 1.0 a call without one reads

    # ------------------------------------------------------------------ checks (once per call signature)
    def check_inputs(self, q, k_cache, v_cache, k, v, block_table, cache_batch_idx):
        spec, att = self.spec, self.attention
        if spec["dropout_p"] > 0:
            raise ValueError(f"dropout_p: decode runs without dropout; this spec has dropout_p={spec['dropout_p']}")
        if att.same_seqlen:
            raise ValueError("mask: a document mask indexes one id tensor by query and key position; decode's "
                             "query rows are not key positions")
        tensors = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
        tensors += [(name, t) for name, t in (("k", k), ("v", v)) if t is not None]
        for name, t in tensors:
            check_tensor(name, t)
            check_data(name, t)  # (its bounds record reads the device's memory: a raw numpy error)
            if t.dim() != 4:
                raise ValueError(f"{name}: expected a 4-d tensor, got shape {tuple(t.shape)}")
            if name == "v_cache" and t.dtype != k_cache.dtype:
                raise ValueError(f"v_cache: expected dtype {k_cache.dtype} (that of k_cache), got {t.dtype}")
            if t.dtype != att.dtype and not (name in ("q", "k_cache", "v_cache") and t.dtype in FP8_TYPES):
                fp8 = " or float8_e4m3fn / float8_e5m2" if name in ("q", "k_cache") else \
                    " (new keys and values come in the spec's dtype; an FP8 cache quantizes them on write)" \
                    if name in ("k", "v") else ""
                raise ValueError(f"{name}: expected dtype {att.dtype} (spec dtype {spec['dtype']}){fp8}, got {t.dtype}")
            check_device(name, t, q.device)
        if q.device.type == "cpu" and not self.attention.interpreting():
            raise ValueError(f"q: expected a CUDA tensor, got device {q.device} (set TRITON_INTERPRET=1 to run on "
                             "the CPU)")
        if not fp16_dot(k_cache.dtype, att.dtype):  # (an FP8 cache's bf16 products run on fp16 operands)
            check_interpretable("k_cache", k_cache.dtype)
        if (k is None) != (v is None):
            raise ValueError("k: new keys and values come together; pass both k and v or neither")
        batch, seqlen_q = q.shape[:2]
        expected = {"q": (spec["num_heads"], spec["head_dim"]), "k_cache": (spec["num_kv_heads"], spec["head_dim"]),
                    "v_cache": (spec["num_kv_heads"], spec["head_dim_v"]),
                    "k": (spec["num_kv_heads"], spec["head_dim"]), "v": (spec["num_kv_heads"], spec["head_dim_v"])}
        for name, t in tensors:
            if tuple(t.shape[2:]) != expected[name]:
                raise ValueError(f"{name}: expected (heads, head_dim) = {expected[name]} in dims 2, 3, got "
                                 f"{tuple(t.shape[2:])} from shape {tuple(t.shape)}")
        if k_cache.shape[:2] != v_cache.shape[:2]:
            raise ValueError(f"v_cache: expected leading dims {tuple(k_cache.shape[:2])} (those of k_cache), "
                             f"got {tuple(v_cache.shape[:2])}")
        if k is not None and (k.shape[0] != batch or v.shape[:2] != k.shape[:2]):
            raise ValueError(f"k: expected (batch, seqlen_new) = ({batch}, n) for k and v, got "
                             f"{tuple(k.shape[:2])} and {tuple(v.shape[:2])}")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name}: expected a contiguous last dim (stride 1), got strides {t.stride()}")
            if k is not None and overlapping(t):
                raise ValueError(f"{name}: new keys and values are written into the cache, whose elements share "
                                 f"memory (an expanded tensor, or strides that interleave): got shape "
                                 f"{tuple(t.shape)}, strides {t.stride()}")
        if batch and k_cache.shape[0] == 0:
            raise ValueError(f"k_cache: expected at least one {'page' if block_table is not None else 'row'} in "
                             f"dim 0, got shape {tuple(k_cache.shape)}")
        if block_table is not None:
            if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.dtype != torch.int32:
                raise ValueError(f"block_table: expected a 2-d int32 tensor (batch, max_blocks_per_seq), got "
                                 f"{getattr(block_table, 'shape', block_table)!r} {getattr(block_table, 'dtype', '')}")
            if block_table.shape[0] != batch or block_table.shape[1] == 0 or block_table.device != q.device:
                raise ValueError(f"block_table: expected shape ({batch}, >= 1) on {q.device}, got "
                                 f"{tuple(block_table.shape)} on {block_table.device}")
            if block_table.stride(1) != 1:
                raise ValueError(f"block_table: expected a contiguous last dim (stride 1), got strides "
                                 f"{block_table.stride()}")
            page_size = k_cache.shape[1]
            if not 1 <= page_size <= MAX_PAGE_SIZE:
                raise ValueError(f"page_size: expected k_cache's dim 1 (the page size) in [1, {MAX_PAGE_SIZE}], "
                                 f"got {page_size}")
            if cache_batch_idx is not None:
                raise ValueError("cache_batch_idx: not supported with a paged cache (block_table indexes it)")
        elif cache_batch_idx is not None:
            if (not isinstance(cache_batch_idx, torch.Tensor) or cache_batch_idx.dtype != torch.int32
                    or tuple(cache_batch_idx.shape) != (batch,) or cache_batch_idx.device != q.device):
                raise ValueError(f"cache_batch_idx: expected an int32 tensor of shape ({batch},) on {q.device}, got "
                                 f"{getattr(cache_batch_idx, 'shape', cache_batch_idx)!r}")
            if batch > 1 and cache_batch_idx.stride(0) != 1:  # the kernels read element b at b
                raise ValueError(f"cache_batch_idx: expected a contiguous tensor (stride 1), got stride "
                                 f"{cache_batch_idx.stride(0)}")
        elif k_cache.shape[0] != batch:
            raise ValueError(f"k_cache: expected batch {batch} (that of q) in dim 0, got {k_cache.shape[0]} "
                             "(pass cache_batch_idx to index a larger cache)")
        return batch, seqlen_q

    def check_fp8(self, q, k_cache, descales, batch):
        """The FP8 inputs' descales (name -> tensor or None), each given only for an FP8 tensor,
        float32 (batch, kv heads) on q's device; FP8 on a GPU needs sm89+. Returns whether the
        kernels read descales (anything in FP8)."""
        fp8 = {"q_descale": q.dtype in FP8_TYPES, "k_descale": k_cache.dtype in FP8_TYPES,
               "v_descale": k_cache.dtype in FP8_TYPES}
        shape = (batch, self.spec["num_kv_heads"])
        for name, d in descales.items():
            if d is None:
                continue
            owner = "q" if name == "q_descale" else name[0] + "_cache"
            if not fp8[name]:
                raise ValueError(f"{name}: descales apply to an FP8 {owner}; {owner} is "
                                 f"{(q if owner == 'q' else k_cache).dtype} (pass {name}=None)")
            if (not isinstance(d, torch.Tensor) or d.dtype != torch.float32 or tuple(d.shape) != shape
                    or d.device != q.device):
                raise ValueError(f"{name}: expected a float32 tensor of shape (batch, kv_heads) = {shape} on "
                                 f"{q.device}, got {tuple(getattr(d, 'shape', ()))} "
                                 f"{getattr(d, 'dtype', type(d).__name__)} on {getattr(d, 'device', None)}")
        if not any(fp8.values()):
            return False
        if q.device.type == "cuda" and torch.cuda.get_device_capability(q.device) < FP8_MIN_CAPABILITY:
            name = "k_cache" if fp8["k_descale"] else "q"
            raise ValueError(f"{name}: FP8 ({k_cache.dtype if name == 'k_cache' else q.dtype}) needs a GPU of "
                             f"compute capability 8.9 or later; {q.device} is "
                             f"{'.'.join(map(str, torch.cuda.get_device_capability(q.device)))}")
        return True

    def descale_arg(self, descale, batch, device):
        """A descale as the kernels read it: given, or 1.0 for every (batch, KV head) (made once)."""
        if descale is not None:
            return descale
        key = (batch, self.spec["num_kv_heads"], device)
        if capturing(device):  # the graph's own (a kept one may be dropped, or, made now, be filled only by replays)
            return torch.ones(key[:2], dtype=torch.float32, device=device)
        t = self.ones.get(key)
        if t is None:
            if len(self.ones) >= 64:
                self.ones.clear()
            t = self.ones[key] = torch.ones(key[:2], dtype=torch.float32, device=device)
        return t

    @staticmethod
    def check_seqlens(cache_seqlens, batch, device):
        if cache_seqlens is None or isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
            return  # (an int's range: seqlens_arg, on every call)
        if (not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32
                or tuple(cache_seqlens.shape) != (batch,) or cache_seqlens.device != device):
            raise ValueError(f"cache_seqlens: expected an int or an int32 tensor of shape ({batch},) on {device}, "
                             f"got {getattr(cache_seqlens, 'shape', cache_seqlens)!r} "
                             f"{getattr(cache_seqlens, 'dtype', type(cache_seqlens).__name__)}")
        if batch > 1 and cache_seqlens.stride(0) != 1:  # the kernels read element b at b
            raise ValueError(f"cache_seqlens: expected a contiguous tensor (stride 1), got stride "
                             f"{cache_seqlens.stride(0)}")

    MAX_TABLE_LENGTH = 1 << 20  # lengths above this (or below 0) get a tensor of their own

    def seqlens_arg(self, cache_seqlens, batch, capacity, device):
        """cache_seqlens as an int32 (batch,) tensor: given, or from an int, or the whole cache
        when None. An int n is row n of a table whose row n holds n in every column (one table
        per batch size and device, grown by doubling): a generation step's new length is a view,
        not a new tensor and a fill (rows are 16 bytes apart, so every view is aligned alike). While a CUDA
        graph is captured (or torch.compile traces), a tensor of the graph's own: a view of a table would be
        read by every replay after the table was grown or dropped, its memory freed."""
        if isinstance(cache_seqlens, torch.Tensor):
            return cache_seqlens
        n = capacity if cache_seqlens is None else cache_seqlens
        if not 0 <= n <= self.MAX_TABLE_LENGTH:  # a negative length still reaches the kernel, which records it
            if not -2**31 <= n < 2**31:  # (checked per call: a plan's key holds an int length's type only)
                raise ValueError(f"cache_seqlens: expected a length in int32's range, got {n}")
            return torch.full((batch,), n, dtype=torch.int32, device=device)
        if device_sync_forbidden(device):
            return torch.full((batch,), n, dtype=torch.int32, device=device)
        key = (batch, device)
        table = self.lengths.get(key)
        if table is None or table.shape[0] <= n:
            rows = max(1024, triton.next_power_of_2(n + 1))
            width = -(-max(batch, 1) // 4) * 4
            table = torch.arange(rows, dtype=torch.int32, device=device)[:, None].expand(rows, width).contiguous()
            if len(self.lengths) >= 64:
                self.lengths.clear()
            self.lengths[key] = table
        return table.as_strided((batch,), (1,), n * table.shape[1])

    # The Gluon FP8-cache kernel's tiles: 128 keys (32 KB of K and V per stage at head dim 128), 4 warps,
    # each a quarter of a tile's keys; a ring of 3 stages, 2 where the grid crowds the SMs
    # (SMALL_TILE_PROGRAMS_PER_SM); split by num_splits_heuristic, one program per SM (fewer splits
    # than _attn_decode's two per SM: the merge reads fewer partials), contiguous or paged. H200, hd128,
    # 32 / 8 heads, one query, us (benchmarks/NOTES.md, session 44): B=1 x 128K 16 splits 82.6-83.1, 33
    # 89.2-90.2, 48 106.2; B=2 x 64K 8 82.1-82.7, 16 86.9-87.6; B=4 x 32K 4 81.4-82.0, 8 86.8-87.4; B=8 x
    # 8K 2 51.1-51.6, 4 54.5-55.7; B=32 x 4K 1 81.8, 2 90.8; B=64 x 4K 128 x 2 143.7, 128 x 3 146.2, 64 x 4
    # 174.0 (prototype). Pages smaller than a tile took two per SM until the kernel's block table reads
    # stopped stalling its loop (session 46, clean L2: paged-16 B=8 x 8K 2 splits 43.8 against 4 47.8,
    # B=1 x 128K 16 76.4 against 33 83.4, B=4 x 32K 4 75.5 against 8 79.3;
    # results/2026-11-30-h200-decode-fp8-s46-paged-ab-splits.md).
    FP8_TILE = dict(BLOCK_N=128, num_warps=4)
    TILE_KNOBS = ("BLOCK_N", "num_warps", "num_stages", "page_prefetch")  # knobs that name _attn_decode's tiles

    def fp8_gluon(self, q, k_cache, v_cache, knobs):
        """Whether a call runs _attn_decode_fp8: rendered for this spec (head dim 64 or 128, no mask
        pattern or score modifier), an FP8 cache with fp16/bf16 queries on an sm90 GPU (not the
        interpreter), at most 16 packed rows (query positions x heads of a group), and no knob of
        _attn_decode's tiles named by the call, at any value (TILE_KNOBS name that kernel's tiles;
        num_splits and fused_combine apply to either). Caches its copies cannot reach (fp8_aligned)
        run _attn_decode on the same plan. (check_inputs has required the caches' dim stride 1.)"""
        if (self.fp8_kernel is None or k_cache.dtype not in FP8_TYPES
                or q.dtype not in (torch.float16, torch.bfloat16)):
            return False
        if (self.attention.interpreting() or q.device.type != "cuda"
                or torch.cuda.get_device_capability(q.device)[0] != 9):
            return False
        if q.shape[1] * (self.spec["num_heads"] // self.spec["num_kv_heads"]) > 16:
            return False
        return all(knobs.get(name) is None for name in self.TILE_KNOBS)

    @staticmethod
    def fp8_aligned(k_cache, v_cache):
        """Whether _attn_decode_fp8's 16-byte copies reach every row of these caches: their bases and
        strides 16-byte multiples. Decided per bound launch (bind): the launches are kept per the
        pointers' 16-byte alignment and the length-free calls' strides' divisibility by 16, so a call
        keyed with them binds the kernel this says, and the rest of its plan serves _attn_decode."""
        return all(t.data_ptr() & 15 == 0 and all(st & 15 == 0 for st in t.stride()[:3]) for t in (k_cache, v_cache))

    def plan(self, batch, seqlen_q, capacity, device, knobs, page_size=None, element_size=None, fp8_gluon=False):
        """The launch plan of a decode call (knobs, split count, grids), from shapes only: the
        tuned knobs of the (batch, capacity) bucket where the call overrides none, else the
        heuristic defaults with the call's overrides (knobs: {name: value or None}). page_size:
        a paged cache's, None for a contiguous one. element_size: the cache's bytes per element
        (default the spec dtype's). fp8_gluon: the call runs _attn_decode_fp8 (fp8_gluon()): its
        tiles (FP8_TILE), its split count (unless the call names one) and its ring's STAGES."""
        spec = self.spec
        group = spec["num_heads"] // spec["num_kv_heads"]
        tuned = None
        untouched = knobs.get("num_splits", 0) == 0 and all(v is None for n, v in knobs.items() if n != "num_splits")
        if self.tuned is not None and untouched and not fp8_gluon:  # (tuned for _attn_decode)
            tuned = self.tuned(batch, capacity)
        chosen = decode_knobs(spec["head_dim"], seqlen_q * group, batch, spec["num_kv_heads"], capacity, device,
                              page_size=page_size,
                              element_size=element_size or self.attention.dtype.itemsize, **(tuned or knobs))
        splits = chosen["num_splits"]
        if fp8_gluon:
            mblocks = triton.cdiv(seqlen_q * group, chosen["BLOCK_M"]) * batch * spec["num_kv_heads"]
            if not knobs.get("num_splits"):  # one program per SM where splits can fill them (FA3's rule)
                splits = min(num_splits_heuristic(mblocks, sm_count(device),
                                                  triton.cdiv(capacity, self.FP8_TILE["BLOCK_N"])), MAX_SPLITS)
            stages = 2 if splits * mblocks >= SMALL_TILE_PROGRAMS_PER_SM * sm_count(device) else 3
            chosen = dict(chosen, **self.FP8_TILE, num_splits=splits, num_stages=stages, STAGES=stages)
        block_dv, block_s = padded_head_dim(spec["head_dim_v"]), max(2, triton.next_power_of_2(splits))
        # the fused merge's rows per step: the row block's (a power of two), as many as COMBINE_ELEMENTS allow
        budget = 1 << max(0, (COMBINE_ELEMENTS // (block_s * block_dv)).bit_length() - 1)
        return dict(chosen, splits=splits, split=splits > 1, tuned=bool(tuned), gluon=fp8_gluon, block_dv=block_dv,
                    fused=splits > 1 and chosen["fused_combine"],
                    grid=(splits, triton.cdiv(seqlen_q * group, chosen["BLOCK_M"]), batch * spec["num_kv_heads"]),
                    combine_grid=(batch * seqlen_q * spec["num_heads"], 1, 1), BLOCK_S=block_s,
                    combine_rows=min(triton.next_power_of_2(min(seqlen_q * group, chosen["BLOCK_M"])), budget))

    def prepare(self, q, k_cache, v_cache, cache_seqlens, k, v, block_table, cache_batch_idx, softmax_scale, out,
                lse, return_lse, knobs, check, descales):
        """Every check of a call, and what its launches need that shapes decide (a DecodeCall).
        descales: {q_descale, k_descale, v_descale: tensor or None}."""
        if check not in CHECKS:
            raise ValueError(f"check: expected one of {CHECKS}, got {check!r}")
        batch, seqlen_q = self.check_inputs(q, k_cache, v_cache, k, v, block_table, cache_batch_idx)
        self.check_seqlens(cache_seqlens, batch, q.device)
        descale = self.check_fp8(q, k_cache, descales, batch)
        spec = self.spec
        num_heads, dv = spec["num_heads"], spec["head_dim_v"]
        out_dtype = self.attention.dtype
        out_shape, lse_shape = (batch, seqlen_q, num_heads, dv), (batch, num_heads, seqlen_q)
        if out is not None and (not isinstance(out, torch.Tensor) or tuple(out.shape) != out_shape
                                or out.dtype != out_dtype or out.device != q.device):
            raise ValueError(f"out: expected a {out_dtype} tensor of shape {out_shape} on {q.device}, got "
                             f"{tuple(getattr(out, 'shape', ()))} {getattr(out, 'dtype', type(out).__name__)}")
        if out is not None and overlapping(out):  # rows written by several programs at once
            raise ValueError(f"out: expected a tensor whose elements do not share memory, got strides "
                             f"{tuple(out.stride())} over shape {tuple(out.shape)} (an expand()ed tensor)")
        if lse is not None and (not isinstance(lse, torch.Tensor) or tuple(lse.shape) != lse_shape
                                or lse.dtype != torch.float32 or not lse.is_contiguous() or lse.device != q.device):
            raise ValueError(f"lse: expected a contiguous float32 tensor of shape {lse_shape} on {q.device}")
        paged = block_table is not None
        page_size = k_cache.shape[1] if paged else 1
        capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
        seqlen_add = 0 if k is None else k.shape[1]
        plan = self.plan(batch, seqlen_q, capacity, q.device, knobs, page_size if paged else None,
                         k_cache.dtype.itemsize, self.fp8_gluon(q, k_cache, v_cache, knobs))
        scale = spec["softmax_scale"] if softmax_scale is None else check_softmax_scale(softmax_scale)
        out_strides = out.stride() if out is not None else (seqlen_q * num_heads * dv, num_heads * dv, dv, 1)
        write_lse = lse is not None or bool(return_lse)
        rows = batch * seqlen_q * num_heads
        # a split call's partial outputs, their LSEs and their max scores (the score floor's, decode/combine.j2)
        part_numel = rows * plan["splits"] * (plan["block_dv"] + 2) if plan["split"] else 0
        ones = self.descale_arg(None, batch, q.device) if descale else None
        descale_strides = [(d if d is not None else ones).stride() if descale else (0, 0)
                           for d in descales.values()]
        # the kernel's scalars: (*q strides, *k_cache strides, *v_cache strides, *middle, capacity, *end)
        bt_stride = block_table.stride(0) if paged else 0
        scalar_parts = (q.stride(), (*out_strides, num_heads * seqlen_q, seqlen_q, bt_stride, k_cache.shape[0],
                                     spec["num_kv_heads"], k_cache.shape[0]),
                        (seqlen_q, seqlen_add, plan["splits"], *(x for st in descale_strides for x in st), scale,
                         scale * AttentionLauncher.RCP_LN2))
        kernel_scalars = (*scalar_parts[0], *k_cache.stride(), *v_cache.stride(), *scalar_parts[1], capacity,
                          *scalar_parts[2])
        kernel_constexprs = dict(BLOCK_M=plan["BLOCK_M"], BLOCK_N=plan["BLOCK_N"], PAGED=paged, PAGE_SIZE=page_size,
                                 BATCH_INDEX=cache_batch_idx is not None, SPLIT=plan["split"], WRITE_LSE=write_lse,
                                 PREFETCH=paged and plan["page_prefetch"], DESCALE=descale,
                                 FP16_DOT=fp16_dot(k_cache.dtype, out_dtype),
                                 V_CVT=fp8_v_conversion(k_cache.dtype, out_dtype, q.device), FUSED=plan["fused"],
                                 BLOCK_S=plan["BLOCK_S"], COMBINE_ROWS=plan["combine_rows"],
                                 num_warps=plan["num_warps"], num_stages=plan["num_stages"])
        if plan["gluon"]:
            kernel_constexprs["STAGES"] = plan["STAGES"]
        combine_args = (*out_strides, num_heads * seqlen_q, seqlen_q, seqlen_q, num_heads, plan["splits"])
        combine_constexprs = dict(BLOCK_S=plan["BLOCK_S"], WRITE_LSE=write_lse, num_warps=4, num_stages=1)
        append_args = append_constexprs = None
        if k is not None:
            quantize = k_cache.dtype in FP8_TYPES
            append_args = (*k_cache.stride(), *v_cache.stride(), *k.stride(), *v.stride(),
                           block_table.stride(0) if paged else 0, *descale_strides[1], *descale_strides[2],
                           seqlen_add, spec["num_kv_heads"], capacity, k_cache.shape[0], k_cache.shape[0])
            drop, min_normal, magic, fp8_max = fp8_rounding(k_cache.dtype) if quantize else (0, 0.0, 0.0, 0.0)
            append_constexprs = dict(
                HEAD_DIM=spec["head_dim"], HEAD_DIM_V=dv, BLOCK_H=triton.next_power_of_2(spec["num_kv_heads"]),
                BLOCK_D=padded_head_dim(spec["head_dim"]), BLOCK_DV=plan["block_dv"], PAGED=paged,
                PAGE_SIZE=page_size, BATCH_INDEX=cache_batch_idx is not None, QUANTIZE=quantize,
                BY_HAND=quantize and self.attention.interpreting(), DROP=drop, MIN_NORMAL=min_normal, MAGIC=magic,
                FP8_MAX=fp8_max, num_warps=4, num_stages=1)
        return DecodeCall(batch=batch, seqlen_q=seqlen_q, capacity=capacity, plan=plan, out_shape=out_shape,
                          new_out=allocator(out_shape, out_dtype, q.device),
                          new_lse=allocator(lse_shape, torch.float32, q.device),
                          new_part=allocator((part_numel,), torch.float32, q.device),
                          out_dtype=out_dtype, lse_shape=lse_shape, write_lse=write_lse, part_numel=part_numel,
                          kernel_scalars=kernel_scalars, scalar_parts=scalar_parts, kernel_constexprs=kernel_constexprs,
                          combine_args=combine_args, combine_constexprs=combine_constexprs, append_args=append_args,
                          append_constexprs=append_constexprs, append_grid=(batch * seqlen_add, 1, 1),
                          descale=descale, record=bounds_record(q.device), device=q.device, check=check, bound={},
                          lengths={},
                          variants=None, split_buffers=None)

    def bind(self, call, aligned=True):
        """The BoundLaunch objects of a call's (append, split-KV, combine) kernels; None where it has none.
        aligned: fp8_aligned() of the call's caches (a Gluon plan runs _attn_decode where they are not)."""
        append = BoundLaunch(self.append_kernel, call.append_grid, call.append_constexprs) \
            if call.append_args is not None and call.append_grid[0] else None
        combine = BoundLaunch(self.combine_kernel, call.plan["combine_grid"], call.combine_constexprs) \
            if call.plan["split"] and not call.plan["fused"] else None
        if call.plan["gluon"] and aligned:
            return append, BoundLaunch(self.fp8_kernel, call.plan["grid"], call.kernel_constexprs), combine
        constexprs = {n: v for n, v in call.kernel_constexprs.items() if n != "STAGES"}
        return append, BoundLaunch(self.kernel, call.plan["grid"], constexprs), combine

    def bind_key(self, call, key, k_cache, v_cache):
        """bind() for a launch key a call meets first (launch(), launch_read(): the key holds the
        pointers' 16-byte alignment, and a length-free call's strides' divisibility by 16, which
        decide fp8_aligned), kept in call.bound."""
        aligned = not call.plan["gluon"] or self.fp8_aligned(k_cache, v_cache)
        launches = call.bound[key] = self.bind(call, aligned)
        return launches

    # ------------------------------------------------------------------ calls keyed without the cache's length
    @staticmethod
    def length_class(plan, capacity):
        """What a plan depends on of the cache's length: its key blocks, up to where the split
        count stops depending on them (decode_knobs: untuned, the length only caps the splits)."""
        return min(-(-capacity // plan["BLOCK_N"]), MAX_SPLITS)

    def length_free(self, entry, capacity):
        """The DecodeCall of a length-free key (a contiguous cache, no keys appended, untuned) for
        a cache of this length, or None when no call of its length class was prepared yet (then
        prepare() runs every check for it). Everything else a call derives is the same at every
        length: its checks read no length (k_cache and v_cache lengths are compared by the key's
        caller), and the lengths, the caches' strides and capacity are plain launch arguments
        (decode() passes them, keying bound launches by how Triton specializes them)."""
        return entry.variants.get(self.length_class(entry.plan, capacity))

    def read(self, q, k_cache, v_cache, softmax_scale=None, return_lse=False, layout="bshd"):
        """(out (B, Sq, H, Dv), lse (B, H, Sq) or None): decode(q, k_cache, v_cache,
        softmax_scale=softmax_scale, return_lse=return_lse), the attention of q over every key of a
        contiguous cache (B, S, H_kv, D), nothing appended: a model's own cache at each generation
        step (the transformers integration's decode calls, flashgen.attention's calls of a few
        queries). The same checks, plans and kernels as decode(); a call after the first of its
        length class is found by a short key (q's metadata, the caches' less their length, the
        scale, return_lse) and launched, without decode()'s key of every argument.
        layout "bhsd": q (B, H, Sq, D) and the caches (B, H_kv, S, D), transformers' own order, read
        as their (B, Sq, H, D) views would be without making the views (three transposes: ~7 us of
        an H200 host per call); out is (B, Sq, H, Dv) either way."""
        if layout not in ("bshd", "bhsd"):
            raise ValueError(f"layout: expected 'bshd' or 'bhsd', got {layout!r}")
        seq = 1 if layout == "bshd" else 2  # the caches' length dim
        return_lse = bool(return_lse)
        key = self.read_key(q, k_cache, v_cache, softmax_scale, return_lse, seq)
        entry = self.reads.get(key) if key is not None else None
        plain = type(k_cache) is torch.Tensor and type(v_cache) is torch.Tensor and self.tuned is None  # as free
        call = None
        if entry is not None and plain and k_cache.shape[seq] == v_cache.shape[seq]:
            call = self.length_free(entry, k_cache.shape[seq])
        if call is None and seq == 2:  # the views' read (its checks name the argument), remembered by this key
            views = [t.transpose(1, 2) if isinstance(t, torch.Tensor) and t.dim() == 4 else t
                     for t in (q, k_cache, v_cache)]
            result = self.read(*views, softmax_scale, return_lse)
            entry = self.reads.get(self.read_key(*views, softmax_scale, return_lse, 1))
            if key is not None and entry is not None:
                self.reads[key] = entry
            return result
        if call is None:  # decode() checks and plans this length class, keyed without the length
            result = self.decode(q, k_cache, v_cache, softmax_scale=softmax_scale, return_lse=return_lse)
            if key is not None and plain and not self.attention.tensor_names:
                entry = self.calls.get(_call_key(True, q, k_cache, v_cache, None, None, None, None, None, None, None,
                                                 None, return_lse, softmax_scale, None, 0, None, None, None, "async",
                                                 None, None, None, None))
                if entry is not None:
                    if len(self.reads) >= self.MAX_CALLS:
                        self.reads.clear()
                    self.reads[key] = entry
            return result
        return self.launch_read(call, q, k_cache, v_cache, seq)

    @staticmethod
    def read_key(q, k_cache, v_cache, softmax_scale, return_lse, seq):
        """read()'s short key of a call whose caches hold their length in dim `seq`, or None where the
        arguments are not 4-d tensors (decode() names them)."""
        try:
            return (seq, q.shape, q.stride(), q.dtype, q.device, _meta_without_length(k_cache, seq),
                    _meta_without_length(v_cache, seq), _typed(softmax_scale), return_lse)
        except (AttributeError, IndexError, TypeError):
            return None

    @staticmethod
    def split_buffers(call, captured, stream=None):
        """(tickets, partials) of a split call: its fused merge's tickets and the buffer of its partial
        results. A fused call (one launch, which merges its own partials) takes its stream's
        (split_tickets, split_parts), kept on the call as (stream, tickets, partials); while captured or
        traced, the graph's own (zeroed tickets, a fresh buffer). A call with a combine launch (no tickets:
        None) gets a buffer of its own: another host thread's launches on the stream may come between its
        two. stream: the current stream's handle on the call's device where the caller has it."""
        if not call.plan["fused"]:
            return None, call.new_part()
        count = call.plan["grid"][1] * call.plan["grid"][2]
        if captured:
            return split_tickets(call.device, count), call.new_part()
        if stream is None:
            stream = current_stream(call.device)
        kept = call.split_buffers
        if kept is None or kept[0] != stream:
            kept = call.split_buffers = (stream, split_tickets(call.device, count, stream),
                                         split_parts(call.device, call.part_numel, stream))
        return kept[1], kept[2]

    def launch_read(self, call, q, k_cache, v_cache, seq=1):
        """launch() of a read() call (a length-free call: no append, cache_seqlens, named tensors,
        descales or buffers given), with only what such a call needs: the pointers that can be
        misaligned are q's and the caches' (launch() keys the bound launches with the same bits,
        the rest being this call's own aligned allocations), the lengths' row is kept per length,
        the launch context is asked once. seq: the caches' length dim (2: bhsd tensors, their
        strides passed as their bshd views' would be)."""
        record, captured = call.record, device_sync_forbidden(call.device)
        if record.words[0] and not captured:  # an earlier call met an index out of range
            record.raise_recorded()
        capacity = k_cache.shape[seq]
        seqlens = None if captured else call.lengths.get(capacity)  # (captured: not a kept row of seqlens_arg's table)
        if seqlens is None:
            seqlens = self.seqlens_arg(None, call.batch, capacity, call.device)
            if not captured:  # captured, a tensor of the graph's own
                if len(call.lengths) >= self.MAX_CALLS:
                    call.lengths.clear()
                call.lengths[capacity] = seqlens
        k_strides, v_strides = k_cache.stride(), v_cache.stride()
        if seq == 2:
            k_strides = (k_strides[0], k_strides[2], k_strides[1], k_strides[3])
            v_strides = (v_strides[0], v_strides[2], v_strides[1], v_strides[3])
        head, middle, end = call.scalar_parts
        align = ((q.data_ptr() & 15 and 1) | (k_cache.data_ptr() & 15 and 2) | (v_cache.data_ptr() & 15 and 4),
                 argument_signature((*k_strides[:3], *v_strides[:3], capacity)))
        _, kernel, combine = call.bound.get(align) or self.bind_key(call, align, k_cache, v_cache)
        out = call.new_out()
        lse = call.new_lse() if call.write_lse else None
        if call.batch * call.seqlen_q == 0:
            return out, lse
        lse_arg = lse if lse is not None else out  # never written without WRITE_LSE
        context = launch_context() if kernel.bindable() else None  # (device index, stream) or None: Triton's path
        tickets, part = seqlens, out  # (never read by a call without splits)
        if call.part_numel:
            stream = context[1] if context is not None and context[0] == call.device.index else None
            tickets, part = self.split_buffers(call, captured, stream)
            tickets = seqlens if tickets is None else tickets  # (read only by a fused merge)
        kernel.run(context, (q, k_cache, v_cache, out, lse_arg, part, seqlens, seqlens, seqlens, record.tensor,
                             seqlens, seqlens, seqlens, tickets, *head, *k_strides, *v_strides, *middle, capacity,
                             *end))
        if combine is not None:
            combine.run(context, (out, lse_arg, part, *call.combine_args))
        if record.immediate and not captured:
            record.raise_recorded()
        return out, lse

    # ------------------------------------------------------------------ the call
    def decode(self, q, k_cache, v_cache, cache_seqlens=None, *, k=None, v=None, block_table=None,
               cache_batch_idx=None, softmax_scale=None, tensors=None, out=None, lse=None, return_lse=True,
               BLOCK_N=None, num_splits=0, num_warps=None, num_stages=None, page_prefetch=None, check="async",
               q_descale=None, k_descale=None, v_descale=None, fused_combine=None):
        """Attention of q (B, Sq, H, D) over a KV cache; returns (out (B, Sq, H, Dv), lse (B, H, Sq)
        float32, or None when neither lse nor return_lse asks for it).

        k_cache, v_cache: (B, S_max, H_kv, D) or, with block_table (B, max_blocks) int32, paged
        (num_pages, page_size, H_kv, D). Batch element b attends to keys [0, cache_seqlens[b] +
        S_new): new keys k, v (B, S_new, H_kv, D), if given, are first written into the cache in
        place at cache_seqlens[b]. cache_batch_idx (B,) int32 picks the cache rows of a
        contiguous cache. num_splits 0 picks the split count from shapes (FA3's heuristic, or
        the tuned one). out, lse: buffers to write into (else allocated). check: "async" or
        "sync", when an index out of the cache raises (see the module docstring). FP8: k_cache
        and v_cache (and q) may be float8 with q/k/v_descale float32 (B, H_kv), 1.0 where not
        given; out keeps the spec's dtype; k, v stay in it and are quantized on write. fused_combine:
        a split call's merge in the split kernel (True) or in a combine kernel (False); None: the
        default (decode_knobs)."""
        named = tensors or {}
        # A contiguous cache read without appending (a model's own cache, one key longer each step)
        # is keyed without its length: a new length re-runs no check and no plan (see length_free).
        free = (k is None and block_table is None and self.tuned is None and type(k_cache) is torch.Tensor
                and type(v_cache) is torch.Tensor and k_cache.dim() == 4 and v_cache.dim() == 4
                and k_cache.shape[1] == v_cache.shape[1])
        try:
            key = _call_key(free, q, k_cache, v_cache, cache_seqlens, k, v, block_table, cache_batch_idx, named,
                            out, lse, return_lse, softmax_scale, BLOCK_N, num_splits, num_warps, num_stages,
                            page_prefetch, check, q_descale, k_descale, v_descale, fused_combine)
        except (AttributeError, TypeError):  # not tensors: prepare() says which argument
            key = None
        call = self.calls.get(key) if key is not None else None
        if call is not None and free:
            call = self.length_free(call, k_cache.shape[1])
        if call is None:
            knobs = {"BLOCK_N": BLOCK_N, "num_splits": num_splits, "num_warps": num_warps, "num_stages": num_stages,
                     "page_prefetch": page_prefetch, "fused_combine": fused_combine}
            call = self.prepare(q, k_cache, v_cache, cache_seqlens, k, v, block_table, cache_batch_idx,
                                softmax_scale, out, lse, return_lse, knobs, check,
                                {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale})
            # batch, heads and q_idx's query rows (keyed); kv_idx's keys: the kernel (host.sequence_checks)
            named = self.attention.named_tensors(named, q.device, (q.shape[0], q.shape[1], None))
            if key is not None:
                entry = self.calls.get(key)
                if entry is None:
                    if len(self.calls) >= self.MAX_CALLS:
                        self.calls.clear()
                    entry = self.calls[key] = call
                    entry.variants = {} if free else None
                if free:
                    if len(entry.variants) >= self.MAX_CALLS:
                        entry.variants.clear()
                    entry.variants[self.length_class(call.plan, k_cache.shape[1])] = call
        elif named:
            named = self.attention.named_tensors(named, q.device)
        if out is not None or lse is not None:  # per call: a call's key holds only the buffers' alignment
            check_outputs_apart((("out", out), ("lse", lse)), (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                                                               ("k", k), ("v", v)))
        return self.launch(call, free, q, k_cache, v_cache, cache_seqlens, k, v, block_table, cache_batch_idx,
                           named, out, lse, q_descale, k_descale, v_descale)

    def launch(self, call, free, q, k_cache, v_cache, cache_seqlens, k, v, block_table, cache_batch_idx, named, out,
               lse, q_descale, k_descale, v_descale):
        """Allocate and launch a prepared call (decode()'s and read()'s last part): free, a call of a
        length-free key (the cache's length, strides and capacity are this call's)."""
        record = call.record
        watch = not device_sync_forbidden(call.device)
        if watch and record.words[0]:  # an earlier call met an index out of range
            record.raise_recorded()
        capacity = k_cache.shape[1] if free else call.capacity
        seqlens = self.seqlens_arg(cache_seqlens, call.batch, capacity, call.device)
        if out is None:
            out = call.new_out()
        if lse is None and call.write_lse:
            lse = call.new_lse()
        if call.descale:
            q_descale, k_descale, v_descale = (self.descale_arg(d, call.batch, call.device)
                                               for d in (q_descale, k_descale, v_descale))
        else:
            q_descale = k_descale = v_descale = seqlens  # never read
        user = (q, k_cache, v_cache, seqlens, block_table, cache_batch_idx, k, v, out, lse, q_descale, k_descale,
                v_descale, *(named[n] for n in self.attention.tensor_names))
        align = 0
        for i, t in enumerate(user):
            if t is not None and t.data_ptr() & 15:
                align |= 1 << i
        scalars = call.kernel_scalars
        if free:  # this length's cache strides and capacity, and how Triton specializes them
            k_strides, v_strides = k_cache.stride(), v_cache.stride()
            head, middle, end = call.scalar_parts
            scalars = (*head, *k_strides, *v_strides, *middle, capacity, *end)
            align = (align, argument_signature((*k_strides[:3], *v_strides[:3], capacity)))
        append, kernel, combine = call.bound.get(align) or self.bind_key(call, align, k_cache, v_cache)
        bt = block_table if block_table is not None else seqlens  # never read
        cbi = cache_batch_idx if cache_batch_idx is not None else seqlens  # read only when given
        if append is not None:
            if call.batch and not call.seqlen_q:  # no decode kernel follows to record what the append skips
                check_append_targets(seqlens, k.shape[1], capacity, block_table, cache_batch_idx, k_cache.shape[:2])
            append(k_cache, v_cache, k, v, seqlens, bt, cbi, k_descale, v_descale, *call.append_args)
        if call.batch * call.seqlen_q == 0:
            return out, lse
        lse_arg = lse if lse is not None else out  # never written without WRITE_LSE
        tickets, part = seqlens, out  # (never read by a call without splits)
        if call.part_numel:
            tickets, part = self.split_buffers(call, not watch)
            tickets = seqlens if tickets is None else tickets  # (read only by a fused merge)
        kernel(q, k_cache, v_cache, out, lse_arg, part, seqlens, bt, cbi, record.tensor, q_descale, k_descale,
               v_descale, tickets, *scalars, *self.attention.tensor_args(named))
        if combine is not None:
            combine(out, lse_arg, part, *call.combine_args)
        if watch and (call.check == "sync" or record.immediate):
            record.raise_recorded()
        return out, lse
