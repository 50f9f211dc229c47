"""The host side of decode: attention of a few query rows over a KV cache (split-KV, pack_gqa).

Plain Python over torch and triton, like host.py: the modules flashgen builds import it, the
standalone module `flashgen generate` writes pastes it verbatim after host.py (whose names it
uses: the import below is dropped there). A rendered module builds one DecodeLauncher beside
its AttentionLauncher and exposes its decode().

CUDA graphs: a decode step makes no host decision from tensor contents. The number of splits,
the grid and every buffer come from shapes (the cache's capacity, never cache_seqlens); the
kernel reads cache_seqlens on the device. The one host read (the bounds check of
cache_seqlens, block_table and cache_batch_idx: one small device reduction, one copy) is skipped
while a graph is captured or torch.compile traces; the kernel then clamps every index, so
nothing is read out of bounds. In eager mode that copy is waited for after the kernels are
queued (PendingBoundsCheck), so the stream is never drained between steps; a call that appends
keys waits before writing the cache. Launch plans (split count, grids, knobs) are cached per shape.
"""

import torch
import triton
import triton.language as tl  # the same module as the kernels' tl in a standalone module

from flashgen.runtime.host import AttentionLauncher, device_sync_forbidden  # standalone: host.py precedes
from flashgen.runtime.host import padded_head_dim  # standalone: host.py precedes

MAX_PAGE_SIZE = 256
MAX_SPLITS = 128  # FA3's cap
MAX_PACKED_ROWS = 64  # the tile's M: (query positions x heads of a group) above this take several row blocks


def num_splits_heuristic(total_mblocks, num_sms, num_n_blocks, max_splits=MAX_SPLITS):
    """FA3's rule (hopper/heuristics.h): no split when the grid already nearly fills the SMs;
    else the fewest splits whose wave efficiency (programs / SMs over whole waves) is within
    85% of the best, never more than the key blocks, the SMs or max_splits."""
    if total_mblocks >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    efficiency = []
    for splits in range(1, max_splits + 1):
        waves = total_mblocks * splits / num_sms
        efficiency.append(waves / -(-waves // 1))
    best = max(efficiency, default=0.0)
    for splits, eff in enumerate(efficiency, start=1):
        if eff >= 0.85 * best:
            return splits
    return 1


SM_COUNTS = {}


def sm_count(device):
    """The device's multiprocessors (a property query, no synchronisation); the interpreter counts as one."""
    if device.type != "cuda":
        return 1
    if device not in SM_COUNTS:
        SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return SM_COUNTS[device]


def decode_knobs(head_dim, packed_rows, batch, num_kv_heads, capacity, device, *, BLOCK_N=None, num_splits=0,
                 num_warps=None, num_stages=None):
    """(BLOCK_M, BLOCK_N, num_splits, num_warps, num_stages) for a decode call, from shapes only."""
    block_m = min(max(16, triton.next_power_of_2(packed_rows)), MAX_PACKED_ROWS)
    block_n = BLOCK_N or (64 if head_dim <= 128 else 32)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"BLOCK_N: expected a power of two >= 16, got {block_n!r}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0: the heuristic), got {num_splits!r}")
    if num_splits == 0:
        total_mblocks = batch * num_kv_heads * triton.cdiv(packed_rows, block_m)
        num_splits = num_splits_heuristic(total_mblocks, sm_count(device), triton.cdiv(capacity, block_n))
    # Memory-bound: a third stage keeps another K/V tile in flight (shared memory: 3 x 2 tiles of
    # 64 x 128 x 2 bytes = 96 KiB at head dim 128; two stages above that).
    return block_m, block_n, num_splits, num_warps or 4, num_stages or (3 if head_dim <= 128 else 2)


@triton.jit
def _decode_bounds(seqlens, table, batch_idx, flags, table_stride, width, seqlen_add, capacity, page_size, num_pages,
                   cache_batch, PAGED: tl.constexpr, BATCH_INDEX: tl.constexpr, BLOCK: tl.constexpr):
    """One program per batch element b writes flags[b, 0:4] (see bounds_flags)."""
    b = tl.program_id(0)
    length = tl.load(seqlens + b).to(tl.int64) + seqlen_add
    tl.store(flags + b * 4, (length < 0).to(tl.int32))
    tl.store(flags + b * 4 + 1, (length > capacity).to(tl.int32))
    if PAGED:
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            used = (cols < width) & (cols.to(tl.int64) * page_size < length)
            entry = tl.load(table + b * table_stride + cols, mask=used, other=0)
            bad = tl.maximum(bad, ((entry < 0) | (entry >= num_pages)).to(tl.int32))
        tl.store(flags + b * 4 + 2, tl.max(bad, 0))
    if BATCH_INDEX:
        row = tl.load(batch_idx + b)
        tl.store(flags + b * 4 + 3, ((row < 0) | (row >= cache_batch)).to(tl.int32))


def bounds_flags(cache_seqlens, seqlen_add, capacity, block_table, page_size, num_pages, cache_batch_idx,
                 cache_batch):
    """A small (batch, 4) int32 tensor on the device, nonzero where a bound is broken: [length
    < 0, length (+ the keys appended) > capacity, a block_table entry the length uses outside
    [0, num_pages), cache_batch_idx outside [0, cache_batch)]. One kernel launch (not one torch
    op per comparison), whatever the block table's size; no host read: see raise_bounds."""
    batch = cache_seqlens.shape[0]
    flags = torch.zeros((batch, 4), dtype=torch.int32, device=cache_seqlens.device)
    if batch:
        width = block_table.shape[1] if block_table is not None else 1
        _decode_bounds[(batch,)](
            cache_seqlens, block_table if block_table is not None else cache_seqlens,
            cache_batch_idx if cache_batch_idx is not None else cache_seqlens, flags,
            block_table.stride(0) if block_table is not None else 0, width, seqlen_add, capacity, page_size, num_pages,
            cache_batch, PAGED=block_table is not None, BATCH_INDEX=cache_batch_idx is not None,
            BLOCK=min(256, max(16, triton.next_power_of_2(width))))
    return flags


def raise_bounds(flags, cache_seqlens, seqlen_add, capacity, block_table, page_size, num_pages, cache_batch_idx,
                 cache_batch):
    """The error naming the argument whose bound bounds_flags found broken (flags: its rows read on the host)."""
    flags = [any(column) for column in zip(*flags)] or [False] * 4  # rows (batch, 4) -> one flag per bound
    if not any(flags):
        return
    lengths = cache_seqlens.to(torch.int64) + seqlen_add
    added = f" + {seqlen_add} appended" if seqlen_add else ""
    if flags[0]:
        i = int(lengths.argmin())
        raise ValueError(f"cache_seqlens: expected lengths >= 0, got {cache_seqlens[i].item()} at index {i}")
    if flags[1]:
        i = int(lengths.argmax())
        raise ValueError(f"cache_seqlens: expected lengths{added} within the cache's capacity {capacity}, got "
                         f"{cache_seqlens[i].item()}{added} at index {i}")
    if block_table is not None:
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * page_size < lengths[:, None]
        bad = used & ((block_table < 0) | (block_table >= num_pages))
        b, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"block_table: expected page indices in [0, {num_pages}) (the pages of k_cache), got "
                         f"{block_table[b, j].item()} at [{b}, {j}]")
    i = int(((cache_batch_idx < 0) | (cache_batch_idx >= cache_batch)).nonzero()[0])
    raise ValueError(f"cache_batch_idx: expected indices in [0, {cache_batch}) (the batch of k_cache), got "
                     f"{cache_batch_idx[i].item()} at index {i}")


class PendingBoundsCheck:
    """bounds_flags copied to the host without blocking, read after the kernels are queued:
    the host waits for the small reduction only, while the GPU already has the decode kernels
    (which clamp every index) to run, so eager calls do not drain the stream between steps.
    On the CPU (the interpreter) the kernels have already run: nothing is waited for."""

    def __init__(self, bounds):
        self.bounds = bounds
        flags = bounds_flags(*bounds)
        if flags.device.type == "cuda":
            self.host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self.host.copy_(flags, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(flags.device))
        else:
            self.host, self.event = flags, None

    def result(self):
        """Raise the error naming the argument if a bound is broken."""
        if self.event is not None:
            self.event.synchronize()
        raise_bounds(self.host.tolist(), *self.bounds)


def append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, capacity):
    """Write the new keys/values k, v (B, S_new, kv heads, dim) into the cache in place at
    positions cache_seqlens[b] + i (crossing pages through block_table). Device-side indices
    only, clamped into the cache (checked on the host where it may read)."""
    batch, seqlen_new = k.shape[:2]
    pos = cache_seqlens.to(torch.int64)[:, None] + torch.arange(seqlen_new, device=k.device)[None, :]
    pos = pos.clamp(0, capacity - 1)
    if block_table is not None:
        page_size, num_pages = k_cache.shape[1], k_cache.shape[0]
        page = block_table.to(torch.int64).gather(1, pos // page_size).clamp(0, num_pages - 1)
        index = (page, pos % page_size)
    else:
        rows = torch.arange(batch, device=k.device) if cache_batch_idx is None else cache_batch_idx.to(torch.int64)
        index = (rows.clamp(0, k_cache.shape[0] - 1)[:, None].expand(batch, seqlen_new), pos)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)


class DecodeLauncher:
    """Checks a decode call's inputs and launches the split-KV and combine kernels.

    attention: the module's AttentionLauncher (the spec, the named tensors). kernel: _attn_decode;
    combine_kernel: _decode_combine.
    """

    MAX_PLANS = 1024  # shapes x knob overrides a launcher remembers (cleared past this)

    def __init__(self, *, attention, kernel, combine_kernel):
        self.attention = attention
        self.spec = attention.spec
        self.kernel, self.combine_kernel = kernel, combine_kernel
        self.plans = {}  # see plan()

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
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise ValueError(f"{name}: expected a 4-d tensor, got shape {tuple(t.shape)}")
            if t.dtype != att.dtype:
                raise ValueError(f"{name}: expected dtype {att.dtype} (spec dtype {spec['dtype']}), got {t.dtype}")
            if t.device != q.device:
                raise ValueError(f"{name}: expected device {q.device} (the device of q), got {t.device}")
        if q.device.type == "cpu" and not self.attention.interpreting():
            raise ValueError(f"q: expected a CUDA tensor, got device {q.device} (set TRITON_INTERPRET=1 to run on "
                             "the CPU)")
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
        if block_table is not None:
            if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.dtype != torch.int32:
                raise ValueError(f"block_table: expected a 2-d int32 tensor (batch, max_blocks_per_seq), got "
                                 f"{getattr(block_table, 'shape', block_table)!r} {getattr(block_table, 'dtype', '')}")
            if block_table.shape[0] != batch or block_table.shape[1] == 0 or block_table.device != q.device:
                raise ValueError(f"block_table: expected shape ({batch}, >= 1) on {q.device}, got "
                                 f"{tuple(block_table.shape)} on {block_table.device}")
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
        elif k_cache.shape[0] != batch:
            raise ValueError(f"k_cache: expected batch {batch} (that of q) in dim 0, got {k_cache.shape[0]} "
                             "(pass cache_batch_idx to index a larger cache)")
        return batch, seqlen_q

    def seqlens_arg(self, cache_seqlens, batch, capacity, device):
        """cache_seqlens as an int32 (batch,) tensor: given, from an int, or the whole cache when None."""
        if cache_seqlens is None or isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
            n = capacity if cache_seqlens is None else cache_seqlens
            return torch.full((batch,), n, dtype=torch.int32, device=device)
        if (not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32
                or tuple(cache_seqlens.shape) != (batch,) or cache_seqlens.device != device):
            raise ValueError(f"cache_seqlens: expected an int or an int32 tensor of shape ({batch},) on {device}, "
                             f"got {getattr(cache_seqlens, 'shape', cache_seqlens)!r} "
                             f"{getattr(cache_seqlens, 'dtype', type(cache_seqlens).__name__)}")
        return cache_seqlens

    def plan(self, batch, seqlen_q, capacity, device, BLOCK_N, num_splits, num_warps, num_stages):
        """The launch plan of a decode call (knobs, split count, grids), from shapes only: computed
        once per shape and knob overrides, then a dict lookup."""
        key = (batch, seqlen_q, capacity, device, BLOCK_N, num_splits, num_warps, num_stages)
        plan = self.plans.get(key)
        if plan is not None:
            return plan
        spec = self.spec
        group = spec["num_heads"] // spec["num_kv_heads"]
        block_m, block_n, splits, warps, stages = decode_knobs(
            spec["head_dim"], seqlen_q * group, batch, spec["num_kv_heads"], capacity, device, BLOCK_N=BLOCK_N,
            num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)
        plan = {"BLOCK_M": block_m, "BLOCK_N": block_n, "splits": splits, "split": splits > 1, "num_warps": warps,
                "num_stages": stages, "block_dv": padded_head_dim(spec["head_dim_v"]),
                "grid": (splits, triton.cdiv(seqlen_q * group, block_m), batch * spec["num_kv_heads"]),
                "combine_grid": (batch * seqlen_q * spec["num_heads"],),
                "BLOCK_S": max(2, triton.next_power_of_2(splits))}
        if len(self.plans) >= self.MAX_PLANS:
            self.plans.clear()
        self.plans[key] = plan
        return plan

    def decode(self, q, k_cache, v_cache, cache_seqlens=None, *, k=None, v=None, block_table=None,
               cache_batch_idx=None, softmax_scale=None, tensors=None, out=None, lse=None, BLOCK_N=None, num_splits=0,
               num_warps=None, num_stages=None):
        """Attention of q (B, Sq, H, D) over a KV cache; returns (out (B, Sq, H, Dv), lse (B, H, Sq) float32).

        k_cache, v_cache: (B, S_max, H_kv, D) or, with block_table (B, max_blocks) int32, paged
        (num_pages, page_size, H_kv, D). Batch element b attends to keys [0, cache_seqlens[b] +
        S_new): new keys k, v (B, S_new, H_kv, D), if given, are first written into the cache in
        place at cache_seqlens[b]. cache_batch_idx (B,) int32 picks the cache rows of a
        contiguous cache. num_splits 0 picks the split count from shapes (FA3's heuristic).
        out, lse: buffers to write into (else allocated). Bad cache_seqlens, block_table or
        cache_batch_idx raise ValueError naming the argument; without appended keys the check is
        read after the (clamping) kernels are queued, so given out/lse may then hold garbage."""
        batch, seqlen_q = self.check_inputs(q, k_cache, v_cache, k, v, block_table, cache_batch_idx)
        spec = self.spec
        paged = block_table is not None
        page_size = k_cache.shape[1] if paged else 1
        capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
        cache_seqlens = self.seqlens_arg(cache_seqlens, batch, capacity, q.device)
        seqlen_add = 0 if k is None else k.shape[1]
        named = self.attention.named_tensors(tensors, q.device)
        pending = None
        if not device_sync_forbidden(q.device):  # else the kernel and append_kv clamp every index
            pending = PendingBoundsCheck((cache_seqlens, seqlen_add, capacity, block_table, page_size,
                                          k_cache.shape[0], cache_batch_idx, k_cache.shape[0]))
        if k is not None:
            if pending is not None:  # the cache is written in place: check before touching it
                pending.result()
                pending = None
            append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, capacity)
        num_heads = spec["num_heads"]
        dv = spec["head_dim_v"]
        if out is None:
            out = torch.empty((batch, seqlen_q, num_heads, dv), dtype=q.dtype, device=q.device)
        elif tuple(out.shape) != (batch, seqlen_q, num_heads, dv) or out.dtype != q.dtype:
            raise ValueError(f"out: expected shape {(batch, seqlen_q, num_heads, dv)} and dtype {q.dtype}, got "
                             f"{tuple(out.shape)} {out.dtype}")
        if lse is None:
            lse = torch.empty((batch, num_heads, seqlen_q), dtype=torch.float32, device=q.device)
        elif tuple(lse.shape) != (batch, num_heads, seqlen_q) or lse.dtype != torch.float32 or not lse.is_contiguous():
            raise ValueError(f"lse: expected a contiguous float32 tensor of shape {(batch, num_heads, seqlen_q)}")
        if batch * seqlen_q == 0:
            if pending is not None:
                pending.result()
            return out, lse
        plan = self.plan(batch, seqlen_q, capacity, q.device, BLOCK_N, num_splits, num_warps, num_stages)
        splits, block_dv = plan["splits"], plan["block_dv"]
        scale = spec["softmax_scale"] if softmax_scale is None else softmax_scale
        if plan["split"]:
            o_part = torch.empty((batch, seqlen_q, num_heads, splits, block_dv), dtype=torch.float32, device=q.device)
            lse_part = torch.empty((batch, seqlen_q, num_heads, splits), dtype=torch.float32, device=q.device)
        else:
            o_part = lse_part = lse  # never read
        if paged:
            bt, bt_stride = block_table, block_table.stride(0)
        else:
            bt, bt_stride = cache_seqlens, 0  # never read
        cbi = cache_batch_idx if cache_batch_idx is not None else cache_seqlens  # read only when given
        self.kernel[plan["grid"]](
            q, k_cache, v_cache, out, lse, o_part, lse_part, cache_seqlens, bt, cbi,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), *lse.stride()[:2],
            bt_stride, k_cache.shape[0], spec["num_kv_heads"], k_cache.shape[0], capacity, seqlen_q, seqlen_add,
            splits, scale, scale * AttentionLauncher.RCP_LN2, *self.attention.tensor_args(named),
            BLOCK_M=plan["BLOCK_M"], BLOCK_N=plan["BLOCK_N"], PAGED=paged, PAGE_SIZE=page_size,
            BATCH_INDEX=cache_batch_idx is not None, SPLIT=plan["split"], num_warps=plan["num_warps"],
            num_stages=plan["num_stages"])
        if plan["split"]:
            self.combine_kernel[plan["combine_grid"]](
                out, lse, o_part, lse_part, *out.stride(), *lse.stride()[:2], seqlen_q, num_heads, splits,
                BLOCK_S=plan["BLOCK_S"])
        if pending is not None:  # the kernels are queued (and clamp): now wait for the small check only
            pending.result()
        return out, lse
