"""The host side of a rendered attention module: input checks, launch arguments, launches.

Plain Python over torch and triton. A rendered module holds the @triton.jit kernels and what
differs per spec (SPEC, CONFIG, the named tensors, a few flags); it builds one
AttentionLauncher from them and exposes the launcher's methods as its forward, backward,
block_map and dropout_keep_mask. The modules flashgen builds import this file; the module
`flashgen generate` writes includes it verbatim, so that file needs only torch and triton.
This file therefore imports nothing from flashgen, and its top-level names must not clash
with the kernels' (which all start with an underscore or are upper case): its own small
kernels (cu_seqlens_check, runs_table_fill) do not start with one.

Layouts: q, k, v, out and dO are 'bhsd' (batch, heads, seq, dim), 'bshd' (batch, seq, heads,
dim) or packed 'thd' (total tokens, heads, dim) with cu_seqlens offsets; every kernel takes
(batch, head, seq, dim) strides, so any strides work and nothing is copied.

Per call: forward() and backward() check a call and work out its launches once per metadata key
(shapes, strides, dtypes, devices, pointer alignment, scalars; see plan_key) into a call plan
(launch.py); a later call with the same key only allocates its outputs and launches, through
bound launches that skip Triton's binder.
"""

import os
import threading
import zlib

import torch
import triton
import triton.language as tl  # the same module as the kernels' tl in a standalone module

from .launch import BackwardPlan, BoundLaunch, ForwardPlan, argument_signature, capturing, check_data, check_outputs_apart, check_tensor, contiguous_strides, env_flag, on_device, overlapping, tensor_key  # standalone: launch.py precedes

try:  # tensor descriptors (the Hopper copy engine, TMA), triton >= 3.3
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

LAYOUTS = ("bhsd", "bshd", "thd")
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
                "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SEQ_DIMS = {"bhsd": 2, "bshd": 1, "thd": 0}  # the sequence dim of q, k, v in each layout
# The kernels read the spec's constants as tl.constexpr module globals; Triton keys its disk
# cache by their values from 3.5 on (before, two specs with the same kernel text could share
# one compiled binary).
MIN_TRITON = (3, 5)


def interpreting():
    """Whether Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_interpretable(name, dtype):
    """Refuse bf16 products under Triton's interpreter, whose bf16 dot products are wrong (errors of 1e8 on
    unit inputs, triton 3.9): a silent wrong result otherwise. name, dtype: the tensor that makes them bf16."""
    if dtype == torch.bfloat16 and interpreting():
        raise ValueError(f"{name}: dtype torch.bfloat16 under Triton's interpreter (TRITON_INTERPRET=1), whose bf16 "
                         "dot products are wrong; on the CPU use an fp16 or fp32 spec and tensors, or run on a GPU")


def nearest_bucket(seqlen: int, buckets) -> int:
    """The bucket nearest to seqlen in log scale (the smaller on a tie): a kernel's bucket configs, and a declined
    Gluon call's fallback knobs (hopper.HopperForward), are picked by it. Integer comparisons only, so
    torch.compile traces it with a symbolic length (each comparison a guard)."""
    ordered = sorted(buckets)
    s = seqlen if seqlen > 1 else 1
    nearest = ordered[0]
    for lo, hi in zip(ordered, ordered[1:]):
        if s * s > lo * hi:  # past the geometric mean of lo and hi: nearer to hi
            nearest = hi
    return nearest


def padded_head_dim(head_dim):
    """The tile width for a head dim: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(head_dim))


PADDED_ROW_MULTIPLE = 8  # a padded head dim's 16-bit rows are 16-byte multiples: the copy engine can read them


def reads_padding(head_dim) -> bool:
    """A head dim narrower than its tiles (40, 80, 96, 160, ...) whose 16-bit rows the copy engine can read
    (a multiple of PADDED_ROW_MULTIPLE): tensor descriptors zero-fill the tiles' columns past it."""
    return head_dim % PADDED_ROW_MULTIPLE == 0 and padded_head_dim(head_dim) != head_dim


def bhsd_strides(t, layout):
    """(batch, head, seq, dim) strides whatever the memory layout; packed 'thd' has no batch stride."""
    return bhsd_order(t.stride(), layout)


def bhsd_order(s, layout):
    """Strides (or sizes) in layout order -> (batch, head, seq, dim) order ('thd': batch 0)."""
    if layout == "thd":
        return (0, s[1], s[0], s[2])
    return (s[0], s[1], s[2], s[3]) if layout == "bhsd" else (s[0], s[2], s[1], s[3])


def wide_rows(layout, *shapes_and_strides):
    """Whether the kernels must take row offsets in 64 bits (their WIDE_ROWS): a row index times its
    row stride reaches 2^31 elements in one of these tensors, each given as (shape, strides) in the
    layout's order (a sequence of 1M tokens of 16 x 128 heads; 512K packed tokens of 32 x 128).
    Below that the products stay 32-bit: the 64-bit ones cost registers (hd64's 64 x 64 forward
    128 -> 153, one program per SM fewer) and 6% of its time."""
    dim = SEQ_DIMS[layout]
    return any(shape[dim] * strides[dim] >= 2**31 for shape, strides in shapes_and_strides)


def head_span_wide(t):
    """Whether t's head dim spans 2^31 elements, past the kernels' 32-bit head-dim offsets (its index
    times its stride): a head-dim stride of 16.9M at head dim 128, a view whose head dim is not its
    last in memory, such as the seq-contiguous V of a single 16.9M-token sequence."""
    return (t.shape[-1] - 1) * t.stride(-1) >= 2**31


def check_head_span(name, t):
    """Refuse a tensor whose head dim spans 2^31 elements (head_span_wide), naming it."""
    if head_span_wide(t):
        raise ValueError(f"{name}: head-dim stride {t.stride(-1)} spans 2^31 elements over head dim {t.shape[-1]} "
                         f"(the kernels index the head dim in 32 bits); pass {name}.contiguous()")


SCALE_LIMIT = 3.4028234663852886e38 / 1.4426950408889634  # the largest scale whose base-2 form fits float32


def check_softmax_scale(scale):
    """A call's softmax_scale (None: the spec's) as a float, refused unless positive and small enough for the
    kernels' float32 scale in base 2 (scale x log2(e)): a larger one turns every score infinite."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= SCALE_LIMIT:
        raise ValueError(f"softmax_scale: expected a positive number of at most {SCALE_LIMIT:.4g}, got {scale!r}")
    return float(scale)


def head_contiguous(t):
    """t, or a contiguous copy of it where its head dim spans 2^31 elements (check_head_span refuses
    such a tensor): for dO, whose strides autograd chooses, not the caller."""
    return t.contiguous() if head_span_wide(t) else t


def tma_strides_ok(strides, element_size):
    """Whether the copy engine can walk these strides: 16-byte multiples, a contiguous last dim."""
    return (TensorDescriptor is not None and strides[-1] == 1
            and all(s > 0 and s * element_size % 16 == 0 for s in strides[:-1]))


def tma_ready(t):
    """Whether the copy engine can read t: a 16-byte aligned base and strides, a contiguous last dim."""
    return tma_strides_ok(t.stride(), t.element_size()) and t.data_ptr() % 16 == 0


SM_COUNTS = {}


def sm_count(device):
    """The device's multiprocessors (a property query, no synchronisation); the interpreter counts as one."""
    if device.type != "cuda":
        return 1
    if device not in SM_COUNTS:
        SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return SM_COUNTS[device]


def tensor_descriptor(t, layout, rows, cols):
    """A (batch, heads, seq, dim) descriptor of t, one (1, 1, rows, cols) tile per load."""
    return TensorDescriptor(t, list(bhsd_order(t.shape, layout)), list(bhsd_strides(t, layout)), [1, 1, rows, cols])


def transposed_descriptor(t, layout, rows, cols):
    """A (batch, heads, dim, seq) descriptor of a tensor stored seq-contiguous (FP8's V), one
    (1, 1, cols, rows) tile per load: the kernel reads a (rows, cols) tile transposed."""
    b, h, s, d = bhsd_order(t.shape, layout)
    sb, sh, ss, sd = bhsd_strides(t, layout)
    return TensorDescriptor(t, [b, h, d, s], [sb, sh, sd, ss], [1, 1, cols, rows])


def tma_ready_transposed(t, layout):
    """tma_ready for a tensor read through transposed_descriptor (its seq dim contiguous)."""
    sb, sh, ss, sd = bhsd_strides(t, layout)
    return tma_strides_ok((sb, sh, sd, ss), t.element_size()) and t.data_ptr() % 16 == 0


def seq_contiguous(t, seq_dim):
    """t with its sequence dim contiguous in memory (the layout FP8 MMAs read V in): t itself
    when it is already so, else one copy."""
    if t.stride(seq_dim) == 1:
        return t
    return t.movedim(seq_dim, -1).contiguous().movedim(-1, seq_dim)


_THREAD = threading.local()  # per thread: the CUDA devices whose context it has made current


def ensure_context(device):
    """Make the device's primary CUDA context current in this thread, once per thread and device.
    A fresh thread has none until it makes a CUDA runtime call, and torch's caching allocator can
    serve it memory without one; Triton's launcher then fills tensor descriptors (a driver call)
    before it makes a context current: "Failed to create tensor map descriptor: invalid device
    context" from a serving or data-loading thread. A stream query is a runtime call that does not
    wait."""
    ready = getattr(_THREAD, "devices", None)
    if ready is None:
        ready = _THREAD.devices = set()
    if device.index not in ready and device.type == "cuda":
        torch.cuda.current_stream(device).query()
        ready.add(device.index)


class Descriptors:
    """The tensor descriptors of a call's first len(blocks) tensors, tiled by `blocks` ((rows, cols) each):
    built and checked on the first call of a call plan, then copied onto each later call's
    tensors. Those have the first call's shapes, strides, dtype and alignment (the plan's key
    says so), so the checks TensorDescriptor makes when built hold for the copies and are not
    made again: they cost more than the launch itself."""

    def __init__(self, layout, blocks, makers=None):
        self.layout, self.blocks = layout, blocks
        self.makers = makers or [tensor_descriptor] * len(blocks)  # transposed_descriptor for FP8's V
        self.templates = None  # [(class, fields without the base)] of the first call's descriptors

    def __call__(self, *tensors):
        ensure_context(tensors[0].device)
        if self.templates is None:
            made = [make(t, self.layout, *block) for make, t, block in zip(self.makers, tensors, self.blocks)]
            self.templates = [(type(d), {**d.__dict__, "base": None}) for d in made]
            return made
        made = []
        for (cls, fields), t in zip(self.templates, tensors):
            descriptor = object.__new__(cls)
            descriptor.__dict__ = fields.copy()
            descriptor.base = t
            made.append(descriptor)
        return made


@triton.jit
def block_lists_fill(CLASSES, COUNTS, BLOCKS, n, m, stride_bh, stride_row, stride_col, BLOCK: tl.constexpr):
    # Program (row, bh): row `row` of an (n, m) view of tile classes (0 nothing visible, 1 partly, 2 wholly)
    # -> COUNTS[bh, row] = (whole, partial) and BLOCKS[bh, row, 0] the row's columns, the whole ones first then
    # the others, BLOCKS[bh, row, 1] the partial ones first then the others, each part ascending (two stable
    # argsorts' order). Two passes over the row: the counts, then each column's place.
    row = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    src = CLASSES + bh * stride_bh + row.to(tl.int64) * stride_row
    n_whole = tl.zeros([], tl.int32)
    n_partial = tl.zeros([], tl.int32)
    for start in range(0, m, BLOCK):
        j = start + tl.arange(0, BLOCK)
        cls = tl.load(src + j * stride_col, mask=j < m, other=0)
        n_whole += tl.sum((cls == 2).to(tl.int32), 0)
        n_partial += tl.sum((cls == 1).to(tl.int32), 0)
    dst = BLOCKS + (bh * n + row) * 2 * m
    seen_whole = tl.zeros([], tl.int32)
    seen_partial = tl.zeros([], tl.int32)
    for start in range(0, m, BLOCK):
        j = start + tl.arange(0, BLOCK)
        inside = j < m
        cls = tl.load(src + j * stride_col, mask=inside, other=0)
        whole = (cls == 2).to(tl.int32)
        partial = (cls == 1).to(tl.int32)
        whole_before = seen_whole + tl.cumsum(whole, 0) - whole  # (the others before j: j - whole_before)
        partial_before = seen_partial + tl.cumsum(partial, 0) - partial
        tl.store(dst + tl.where(whole == 1, whole_before, n_whole + j - whole_before), j, mask=inside)
        tl.store(dst + m + tl.where(partial == 1, partial_before, n_partial + j - partial_before), j, mask=inside)
        seen_whole += tl.sum(whole, 0)
        seen_partial += tl.sum(partial, 0)
    tl.store(COUNTS + (bh * n + row) * 2, n_whole)
    tl.store(COUNTS + (bh * n + row) * 2 + 1, n_partial)


def list_block(m):
    """block_lists_fill's BLOCK for rows of m tiles."""
    return min(1024, max(16, triton.next_power_of_2(m)))


def index_lists(tile_classes):
    """Block-map tile classes (.., n, m) -> counts (.., n, 2) [whole, partial] and block indices
    (.., n, 2, m): per row, the whole blocks' indices, then the partial ones', each ascending (each
    followed by the row's other indices). One launch of block_lists_fill (the same in torch, stable
    argsorts, sums and stacks, was 17 launches: on a GPU host, their host time every call of a mask
    over tensors)."""
    *lead, n, m = tile_classes.shape
    flat = tile_classes.unsqueeze(0).flatten(0, -3)  # (a view: the leading dims are one another's multiples)
    counts = torch.empty((flat.shape[0], n, 2), dtype=torch.int32, device=flat.device)
    lists = torch.empty((flat.shape[0], n, 2, m), dtype=torch.int32, device=flat.device)
    if counts.numel():
        with on_device(flat):
            block_lists_fill[(n, flat.shape[0])](flat, counts, lists, n, m, *flat.stride(), BLOCK=list_block(m))
    return counts.view(*lead, n, 2), lists.view(*lead, n, 2, m)


class TensorBlockMap:
    """The block map of a mask over named tensors at one call plan's shape and tiling, in one direction
    (rows: per query block, its key blocks, as Q-outer walks read it; else per key block, its query
    blocks). Made again on every call, the tensors' contents being the call's, by two bound launches:
    the mask's tile classifier and block_lists_fill. Called with the named tensors' kernel arguments
    (AttentionLauncher.tensor_args), it returns the walking kernel's map arguments (map_args).

    A call of at most STATIC_PAIRS (query, key) pairs over its batch and heads walks every tile as a partial
    one (the mask evaluated on each) from one map made with its plan: no classifier, list fill or allocations
    per call, whose host time such a call is bound by (H200, B=1 H=16 S=128 hd128, a bool (L, S) mask: 110-215
    us of host per forward against torch's whole call's 40-70, session 49), for at most the tiles a map would
    have skipped (2^24 pairs at hd128: ~8.6 GFLOP, tens of us). Not for a plan made while a CUDA graph is
    captured (its fills would run at replay only): that one makes the map per call."""

    STATIC_PAIRS = 2**24

    def __init__(self, launcher, batch, seqlen_q, seqlen_k, block_m, block_n, device, rows):
        nb, nh, nq, nk = launcher.map_grid(batch, seqlen_q, seqlen_k, block_m, block_n)
        self.launcher, self.batch, self.device = launcher, batch, device
        self.classes_shape, self.sizes = (nb * nh, nq, nk), (seqlen_q, seqlen_k, nb, nh)
        self.n, self.m = (nq, nk) if rows else (nk, nq)
        self.counts_shape, self.lists_shape = (nb, nh, self.n, 2), (nb, nh, self.n, 2, self.m)
        self.fill_args = (self.n, self.m, nq * nk, *((nk, 1) if rows else (1, nk)))
        self.static = self.classify = self.fill = None
        if batch * launcher.num_heads * seqlen_q * seqlen_k <= self.STATIC_PAIRS and not device_sync_forbidden(device):
            self.static = launcher.map_args(*all_partial_map(self.n, self.m, device), batch)
        else:  # (the launches a map made per call takes)
            self.classify = BoundLaunch(launcher.block_map_kernel, (nq, nk, nb * nh),
                                        dict(BLOCK_M=block_m, BLOCK_N=block_n))
            self.fill = BoundLaunch(block_lists_fill, (self.n, nb * nh), dict(BLOCK=list_block(self.m)))

    def __call__(self, tensor_args):
        if self.static is not None:
            return self.static
        classes = torch.empty(self.classes_shape, dtype=torch.int8, device=self.device)
        counts = torch.empty(self.counts_shape, dtype=torch.int32, device=self.device)
        lists = torch.empty(self.lists_shape, dtype=torch.int32, device=self.device)
        if classes.numel():
            self.classify(classes, *self.sizes, *tensor_args)
        if counts.numel():
            self.fill(classes, counts, lists, *self.fill_args)
        return self.launcher.map_args(counts, lists, self.batch)


ALL_PARTIAL = {}  # (rows, columns, device) -> all_partial_map's (counts, lists), never freed


def all_partial_map(n, m, device):
    """(counts, lists) of a block map of n rows of m tiles each, every tile partial (none whole: each walked with
    the mask): one per shape and device, kept for good (small calls only, at most STATIC_PAIRS pairs), so that a
    CUDA graph that captured a plan's launch still reads it after the plan is evicted and freed. One made while a
    graph is captured (or a graph tree warms up) is the graph's own, not kept: filled by its replays only, it
    would be read unfilled by an eager call, and kept, it would hold the graph's memory."""
    key = (n, m, device)
    found = ALL_PARTIAL.get(key)
    if found is None:
        counts = torch.zeros((1, 1, n, 2), dtype=torch.int32, device=device)
        counts[..., 1] = m
        found = (counts, torch.arange(m, dtype=torch.int32, device=device).expand(1, 1, n, 2, m).contiguous())
        if not capturing(device):
            ALL_PARTIAL[key] = found
    return found


DECODER = "decoder"  # AttentionLauncher.plans[(DECODER, decode key)]: whether its calls may run on the decode kernel


def device_sync_forbidden(device):
    """True while reading a tensor on `device` from the host would break the caller: a CUDA
    graph being captured (a device->host copy is illegal there) or torch.compile tracing."""
    return capturing(device) or torch.compiler.is_compiling()


# ----------------------------------------------------------------------------- bounds
RECORD_WORDS = 5  # kind (0: nothing recorded), batch element, column, value, limit
# kinds 1-4 and 9: the decode kernels' (templates/decode/split_kv.j2); 5-8: packed offsets (cu_seqlens_check)
OFFSETS_FIRST, OFFSETS_ORDER, OFFSETS_TOTAL, OFFSETS_LONGEST = 5, 6, 7, 8
NAMED_SHORT = 9  # a named tensor shorter than the cache keys kv_idx indexes it by (column: its sequence_check_id)
# 10: document ids that decrease along a row (runs_table_fill, the Gluon range kernel: hopper/masks.j2
# _hw_runs_order), words [kind, runs_check_id << 32 | row, column, value, the value before it]
RUNS_ORDER = 10
SEQUENCE_CHECKS = {}  # sequence_check_id -> (tensor name, dimension, rank of its view, whether distances index it)
RUNS_CHECKS = {}  # runs_check_id -> tensor name


def sequence_check_id(name, dim, rank, distances=False):
    """The id a decode kernel records (NAMED_SHORT) for dimension `dim` of the named tensor `name` (its
    view has `rank` dimensions) where kv_idx (or, distances, a query-key distance) indexes it: a 31-bit
    hash of them, so the kernel's text can carry it, registered here so that raise_recorded can name the
    tensor and its rule."""
    check = zlib.crc32(f"{name}/{dim}/{rank}{'/distances' if distances else ''}".encode()) & 0x7FFFFFFF
    SEQUENCE_CHECKS[check] = (name, dim, rank, distances)
    return check


def runs_check_id(name):
    """The id the kernels that search the tensor `name` (document ids) record (RUNS_ORDER) where its values
    decrease along a row: a 31-bit hash of the name, registered here so that raise_recorded can name it."""
    check = zlib.crc32(f"runs/{name}".encode()) & 0x7FFFFFFF
    RUNS_CHECKS[check] = name
    return check


def runs_order_error(name, row, column, value, before, where=""):
    return ValueError(f"{name}: expected document ids nondecreasing along each row, got {before} then {value} at "
                      f"column {column} of row {row}{where}")


def sequence_checks(tensor_sizes, tensor_ranks):
    """[(name, dim, id, distances)]: the dimensions of the named tensors that kv_idx indexes (alone or beside
    other indices), or (distances) a query-key distance (relative_bias's table: seqlen_q + seqlen_k - 1
    entries), which a decode kernel checks against each element's cache length (the host cannot: the
    lengths live on the device; the others' rules, the host checks), ids registered."""
    checks = []
    for name, sizes in tensor_sizes.items():
        for d, names in enumerate(sizes):
            if "seqlen_k" in names or "distances" in names:
                distances = "distances" in names
                checks.append((name, d, sequence_check_id(name, d, tensor_ranks[name], distances), distances))
    return checks


class BoundsRecord:
    """Where a device's kernels write the first out-of-range index they meet: the decode kernels
    (cache_seqlens, block_table, cache_batch_idx: decode.py's docstring), the check of packed
    offsets (cu_seqlens: AttentionLauncher.check_offsets) and the searches of document ids that
    decrease along a row (AttentionLauncher.check_runs). Words [kind, batch element (for
    offsets: 0 for cu_seqlens_q, 1 for cu_seqlens_k), column (or the keys appended; for offsets
    the index), value, limit], kind 0 while nothing is recorded. On a GPU the words live in pinned host memory
    that the kernels write directly (mapped, so reading them needs no copy and no wait); on
    the CPU in an ordinary tensor."""

    def __init__(self, device):
        self.device = device
        if device.type == "cuda":
            self.tensor = torch.zeros(RECORD_WORDS, dtype=torch.int64, pin_memory=True)
        else:
            self.tensor = torch.zeros(RECORD_WORDS, dtype=torch.int64, device=device)
        self.words = self.tensor.numpy()  # the host's view: reads are memory reads
        # Whether a call raises what its own kernels recorded before it returns: on the CPU they
        # have run by then; a GPU's have not (only check="sync" waits for them).
        self.immediate = device.type != "cuda"

    def raise_recorded(self):
        """Wait for the device, then raise the recorded error (clearing the record); no-op when empty."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if not self.words[0]:
            return
        kind, b, j, value, limit = (int(w) for w in self.words)
        # the details first, the kind last: while the kind is set no kernel can record (its compare-and-swap
        # from 0 fails), so a kernel's record made once it is cleared keeps all its words
        self.words[1:] = 0
        self.words[0] = 0
        source = "a decode kernel" if kind < OFFSETS_FIRST or kind == NAMED_SHORT else \
            "the search of a call's document ids" if kind == RUNS_ORDER else "the check of a packed call's offsets"
        where = f" (met by {source} on {self.device}; that call's outputs are meaningless)" \
            if self.device.type == "cuda" else ""
        raise bounds_error(kind, b, j, value, limit, where)


def bounds_error(kind, b, j, value, limit, where=""):
    """The ValueError of a BoundsRecord's words (see BoundsRecord), `where` appended to its message: the record's
    error, and an append-only decode call's (decode.check_append_targets)."""
    if kind == RUNS_ORDER:
        return runs_order_error(RUNS_CHECKS.get(b >> 32, "document ids"), b & 0xFFFFFFFF, j, value, limit, where)
    if kind == 1:
        return ValueError(f"cache_seqlens: expected lengths >= 0, got {value} at index {b}{where}")
    if kind == 2:
        added = f" + {j} appended" if j else ""
        return ValueError(f"cache_seqlens: expected lengths{added} within the cache's capacity {limit}, got "
                          f"{value}{added} at index {b}{where}")
    if kind == 3:
        return ValueError(f"block_table: expected page indices in [0, {limit}) (the pages of k_cache), got "
                          f"{value} at [{b}, {j}]{where}")
    if kind == 4:
        return ValueError(f"cache_batch_idx: expected indices in [0, {limit}) (the batch of k_cache), got {value} "
                          f"at index {b}{where}")
    if kind == NAMED_SHORT:
        name, dim, rank, distances = SEQUENCE_CHECKS.get(j, ("a named tensor", 0, 0, False))
        rule = f"one per distance, seqlen_q + seqlen_k - 1 for batch element {b}" if distances else \
            f"kv_idx indexes it: batch element {b} has {value} keys"
        return ValueError(f"{name}: expected at least {value} entries in dim {dim - rank} ({rule}), got "
                          f"{limit}{where}")
    name = ("cu_seqlens_q", "cu_seqlens_k")[b]
    if kind == OFFSETS_FIRST:
        return ValueError(f"{name}: expected the first offset to be 0, got {value}{where}")
    if kind == OFFSETS_ORDER:
        return ValueError(f"{name}: expected nondecreasing offsets, got {limit} then {value} at index {j}{where}")
    if kind == OFFSETS_TOTAL:
        return ValueError(f"{name}: expected offsets within the {limit} tokens of {'qk'[b]}, got last offset "
                          f"{value}{where}")
    return ValueError(f"{('max_seqlen_q', 'max_seqlen_k')[b]}: expected at least the longest sequence ({value} "
                     f"tokens, {name}[{j + 1}] - {name}[{j}]), got {limit}{where}")


RECORDS = {}  # device -> its BoundsRecord


def bounds_record(device):
    record = RECORDS.get(device)
    if record is None:
        record = RECORDS[device] = BoundsRecord(device)
    return record


def check_bounds(device=None):
    """An explicit sync point for the bounds rule: wait for the device's kernels and raise the
    ValueError naming the argument if one met an index outside the cache, packed offsets
    (cu_seqlens) that break their rules, or document ids that decrease along a row (the CUDA
    graphs replayed since included). device: one
    device; default every device whose kernels have a record (those flashgen's decode and packed
    calls ran on), the current CUDA device first."""
    if device is None:
        current = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        for d in sorted(RECORDS, key=lambda d: d != current):
            RECORDS[d].raise_recorded()
        return
    bounds_record(concrete_device(device)).raise_recorded()


def concrete_device(device):
    """torch.device(device), a CUDA device without an index as the current one ("cuda" -> cuda:0 there):
    what the tensors made on it report as their device."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected a torch.device or a device string such as 'cuda:0', got {device!r}") \
            from None
    if device.type == "cuda" and not torch.cuda.is_available():  # (torch's "not compiled with CUDA" assertion)
        raise ValueError(f"device: expected a device this torch has, got {str(device)!r}: it sees no CUDA device "
                         "(under Triton's interpreter, tensors and devices are 'cpu')")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@triton.jit
def record_rule(REC, KIND: tl.constexpr, which, i, value, limit):
    # The first broken rule a launch meets claims the bounds record (word 0 := its kind), then writes its words
    # (the packed offsets' check, the runs table's: BoundsRecord).
    zero = tl.zeros([], tl.int64)
    if tl.atomic_cas(REC, zero, zero + KIND) == 0:
        tl.store(REC + 1, zero + which)
        tl.store(REC + 2, zero + i)
        tl.store(REC + 3, zero + value)
        tl.store(REC + 4, zero + limit)


@triton.jit
def cu_seqlens_rules(CU, REC, which, count, total, longest, BLOCK: tl.constexpr):
    # One offsets vector (count + 1 entries): first 0, nondecreasing, no sequence over `longest`
    # (max_seqlen), last within the `total` tokens; the first rule broken goes to the record (kinds
    # 5-8: OFFSETS_FIRST, _ORDER, _TOTAL, _LONGEST, written as numbers: a kernel reads no plain global).
    # One pass over the offsets; the rules recorded in check_cu_seqlens's order, so that both name the
    # same rule first.
    first = tl.load(CU)
    down, down_lo, down_hi = count, first, first  # the first offset below its predecessor, that pair
    most, at = tl.load(CU + 1) - first, tl.zeros([], tl.int32)  # the longest sequence, and its index
    for start in range(0, count, BLOCK):
        i = start + tl.arange(0, BLOCK)
        ok = i < count
        lo = tl.load(CU + i, mask=ok, other=0)
        hi = tl.load(CU + i + 1, mask=ok, other=0)
        block_down = tl.min(tl.where(ok & (hi < lo), i, count))
        if (down == count) & (block_down < count):
            down = block_down
            down_lo = tl.sum(tl.where(i == block_down, lo, 0))
            down_hi = tl.sum(tl.where(i == block_down, hi, 0))
        length = tl.where(ok, hi - lo, most)
        block_most = tl.max(length)
        if block_most > most:
            at = tl.min(tl.where(length == block_most, i, count))
            most = block_most
    if first != 0:
        record_rule(REC, 5, which, 0, first, 0)
    if down < count:
        record_rule(REC, 6, which, down, down_hi, down_lo)
    last = tl.load(CU + count)
    if last > total:
        record_rule(REC, 7, which, count, last, total)
    if most > longest:
        record_rule(REC, 8, which, at, most, longest)


@triton.jit
def cu_seqlens_check(CU_Q, CU_K, REC, count, total_q, total_k, max_seqlen_q, max_seqlen_k, BLOCK: tl.constexpr):
    # check_cu_seqlens's rules on the device, no wait: the host reads the record on later calls.
    cu_seqlens_rules(CU_Q, REC, 0, count, total_q, max_seqlen_q, BLOCK)
    cu_seqlens_rules(CU_K, REC, 1, count, total_k, max_seqlen_k, BLOCK)


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k):
    """Packed-sequence offsets that stay inside q and k: first 0, nondecreasing, last <= the
    tokens there are, no sequence longer than its max_seqlen. One device->host copy."""
    offsets = torch.cat([cu_seqlens_q, cu_seqlens_k]).cpu().to(torch.int64)
    n = cu_seqlens_q.numel()
    for name, cu, total, tensor, max_name, max_len in (
            ("cu_seqlens_q", offsets[:n], total_q, "q", "max_seqlen_q", max_seqlen_q),
            ("cu_seqlens_k", offsets[n:], total_k, "k", "max_seqlen_k", max_seqlen_k)):
        if cu[0] != 0:
            raise ValueError(f"{name}: expected the first offset to be 0, got {cu[0].item()}")
        lengths = cu[1:] - cu[:-1]
        if (lengths < 0).any():
            i = int((lengths < 0).nonzero()[0])
            raise ValueError(f"{name}: expected nondecreasing offsets, got {cu[i].item()} then {cu[i + 1].item()} "
                             f"at index {i}")
        if cu[-1] > total:
            raise ValueError(f"{name}: expected offsets within the {total} tokens of {tensor}, got last offset "
                             f"{cu[-1].item()}")
        longest = int(lengths.max())
        if longest > max_len:
            i = int(lengths.argmax())
            raise ValueError(f"{max_name}: expected at least the longest sequence ({longest} tokens, "
                             f"{name}[{i + 1}] - {name}[{i}]), got {max_len}")


def check_device(name, t, device):
    """Tensor t of a call on q's device (its kernels launch on one device)."""
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of q), got {t.device}")


def check_offsets(name, cu, device):
    """A varlen call's cu_seqlens_q or cu_seqlens_k: a 1-d int32 tensor of at least two offsets, with data, on the
    device of q (their values: the call plan checks them on every call)."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2 or cu.dtype != torch.int32:
        what = f"shape {tuple(cu.shape)} {cu.dtype}" if isinstance(cu, torch.Tensor) else f"a {type(cu).__name__}"
        raise ValueError(f"{name}: expected a 1-d int32 tensor of batch + 1 offsets (batch >= 1), got {what}")
    check_data(name, cu)
    if cu.device != device:
        raise ValueError(f"{name}: expected device {device}, got {cu.device}")


def check_descale(name, d, device, shape):
    """An FP8 call's q_descale, k_descale or v_descale given: a float tensor on q's device (broadcast to
    shape, (batch, kv_heads), next)."""
    if not isinstance(d, torch.Tensor) or not d.is_floating_point() or d.device != device:
        raise ValueError(f"{name}: expected a float tensor on {device} broadcastable to (batch, kv_heads) = {shape}, "
                         f"got {getattr(d, 'dtype', type(d).__name__)} {tuple(getattr(d, 'shape', ()))}")


def check_tensors(q, k, v, layout):
    """q, k, v are tensors with data of the rank the layout has. The one place these are checked:
    the launcher checks them against its spec next; flashgen.api calls this before it reads
    the shapes that build a spec."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected 'bhsd', 'bshd' or 'thd' (varlen), got {layout!r}")
    ndim = 3 if layout == "thd" else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        check_data(name, t)
        if t.dim() != ndim:
            raise ValueError(f"{name}: expected a {ndim}-d tensor in layout {layout!r}, got shape {tuple(t.shape)}")


@triton.jit
def runs_table_fill(T, OUT, REC, n, stride_row, stride_col, steps, check, BLOCK: tl.constexpr):
    # Program (block, row): for BLOCK elements x of row `row` of T, OUT[0, row, x] = the first index of
    # the row not below T[row, x] and OUT[1, row, x] = the first above it: torch.searchsorted's left and
    # right binary searches over the whole row (`steps` halvings: n.bit_length()), the same midpoints,
    # so the same answers on any row (a run's bounds on a nondecreasing one). The first x of the block
    # whose value is below the one before it goes to the bounds record REC (RUNS_ORDER; check: the
    # tensor's runs_check_id): the searches, and the document ranges read from them, assume none.
    # (runs_table passes rows whose (n - 1) * stride_col stays below 2^31: the column offsets are 32-bit)
    row = tl.program_id(1).to(tl.int64)
    x = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = x < n
    base = T + row * stride_row
    value = tl.load(base + x * stride_col, mask=ok, other=0)
    after = ok & (x > 0)
    before = tl.load(base + (x - 1) * stride_col, mask=after, other=0)
    down = tl.min(tl.where(after & (value < before), x, n))
    if down < n:
        at = x == down
        record_rule(REC, 10, (tl.cast(check, tl.int64) << 32) | row, down,
                    tl.sum(tl.where(at, value.to(tl.int64), 0)), tl.sum(tl.where(at, before.to(tl.int64), 0)))
    lo = tl.zeros([BLOCK], tl.int32)
    hi = lo + n
    lo2 = lo
    hi2 = hi
    for _ in range(steps):
        mid = lo + ((hi - lo) >> 1)
        go = ok & (lo < hi)
        below = tl.load(base + mid * stride_col, mask=go, other=0) < value
        lo = tl.where(go & below, mid + 1, lo)
        hi = tl.where(go & ~below, mid, hi)
        mid2 = lo2 + ((hi2 - lo2) >> 1)
        go2 = ok & (lo2 < hi2)
        not_above = tl.load(base + mid2 * stride_col, mask=go2, other=0) <= value
        lo2 = tl.where(go2 & not_above, mid2 + 1, lo2)
        hi2 = tl.where(go2 & ~not_above, mid2, hi2)
    out = OUT + row * n + x
    tl.store(out, lo, mask=ok)
    tl.store(out + tl.num_programs(1).to(tl.int64) * n, lo2, mask=ok)


RUNS_LAUNCHES = {}  # (the ids' metadata) -> BoundLaunch of runs_table_fill
RUNS_BLOCK = 256


def empty_runs_table(t, check=0):
    """runs_table(t)'s int32 (2, rows, n) table, allocated for a kernel to fill (the Gluon forward's range
    kernel in a training step: hopper/masks.j2 _hw_runs_fill)."""
    return torch.empty((2, *t.shape), dtype=torch.int32, device=t.device)


def runs_table(t, check=0):
    """The runs table of a (rows, n) tensor of nondecreasing rows (document ids): int32 (2, rows, n),
    [0, b, x] the first index of row b holding t[b, x] and [1, b, x] the first past it, i.e. a
    binary search of each element in its own row (searchsorted left and right), made once per call
    so that the kernels read a block's range instead of searching for it (to_triton.runs_load).
    On a GPU one launch of runs_table_fill (the two searchsorted calls and the copy to contiguous
    rows were three launches: 23-26 us of an H200 host's 87 us per documents forward), which
    records a row that decreases in the device's bounds record (check: the tensor's runs_check_id)."""
    rows = t.to(torch.uint8) if t.dtype == torch.bool else t
    if (rows.shape[1] - 1) * abs(rows.stride(1)) >= 2**31:  # a view whose column offsets pass 32 bits
        rows = rows.contiguous()
    table = empty_runs_table(rows)
    if rows.device.type != "cuda":
        rows = rows.contiguous()
        torch.searchsorted(rows, rows, out_int32=True, out=table[0])
        torch.searchsorted(rows, rows, right=True, out_int32=True, out=table[1])
        return table
    count, n = rows.shape
    key = (rows.device, rows.dtype, count, n, rows.stride(), rows.data_ptr() & 15, check)  # (check: Triton
    # specializes an int argument divisible by 16, so each tensor name's id keys its own launch)
    launch = RUNS_LAUNCHES.get(key)
    if launch is None:
        if len(RUNS_LAUNCHES) >= 64:
            RUNS_LAUNCHES.clear()
        launch = RUNS_LAUNCHES[key] = BoundLaunch(runs_table_fill, (triton.cdiv(n, RUNS_BLOCK), count),
                                                  dict(BLOCK=RUNS_BLOCK, num_warps=4))
    launch(rows, table, bounds_record(rows.device).tensor, n, rows.stride(0), rows.stride(1), n.bit_length(), check)
    return table


# how check_tensor_sizes names a size rule (a named tensor's dimension relative_bias indexes: one entry per distance)
SIZE_RULES = {"distances": "seqlen_q + seqlen_k - 1 ="}


def check_tensor_names(tensors, names):
    """The named tensors a call passes are exactly the spec's `names`, each a tensor (the one place
    this is checked: the launcher and flashgen.api's call path both use it)."""
    unknown = sorted(set(tensors) - set(names))
    if unknown == ["tensors"] and isinstance(tensors["tensors"], dict):  # flashgen.attention(..., tensors={...})
        raise TypeError(f"tensors: pass the named tensors as keyword arguments "
                        f"({', '.join(f'{n}=<tensor>' for n in names) or 'this spec reads none'}), not as a dict")
    if unknown:
        raise TypeError(f"{unknown[0]}: not a tensor of this spec (its tensors: {list(names) or 'none'})")
    for name in names:
        if name not in tensors:
            raise TypeError(f"{name}: this spec's mask or score_mod reads tensor {name!r}; pass {name}=<tensor>")
        check_tensor(name, tensors[name])


class AttentionLauncher:
    """Checks a call's inputs and launches one rendered module's kernels.

    spec, config: the module's SPEC and CONFIG dicts. The kernels: forward_kernel (the Q-outer
    _attn_fwd or the KV-outer _attn_fwd_kv_outer, as config['loop_order'] says), the three
    backward kernels, short_kernel (config bwd_short: the whole backward in one launch) where the
    module has it, and block_map_kernel (custom masks: the tile classifier) and
    keep_mask_kernel (dropout: the keep mask, for tests) where the module has them.
    tensor_ranks: {name: rank} of the named tensors a call passes, in kernel-argument order;
    grad_tensors: the float ones gradients flow into; integer_tensors: those a pattern's key ranges
    compute with (a prefix length), refused in a float dtype. map_uses_batch/map_uses_head: whether the
    block map differs per batch element/head. same_seqlen: the mask indexes one tensor by
    query and key (document ids), so seqlen_q must equal seqlen_k.
    """

    RCP_LN2 = 1.4426950408889634  # = 1 / ln 2: exp(x) = exp2(x * RCP_LN2), folded into qk_scale

    # The short-keys forward (templates/prefill/short_kv.j2), where the module has it (unmasked, non-causal 16-bit
    # specs): set by the module after the launcher is made. short_kv_knobs says which calls it takes.
    short_kv_kernel = None
    SHORT_KV_KEYS = 128  # keys in one tile at most
    SHORT_KV_QUERIES = 1024  # queries at least, and SHORT_KV_RATIO per key
    SHORT_KV_RATIO = 4
    SHORT_KV_HEAD_DIM = 64  # head dims at most, powers of two only: measured faster there (below)
    SHORT_KV_TILE = dict(BLOCK_M=64, STAGES=2, num_warps=4)
    SHORT_KV_TILES = 4  # query tiles per program at most; fewer where the grid would leave SMs idle

    def __init__(self, *, spec, config, forward_kernel, preprocess_kernel, dkdv_kernel, dq_kernel,
                 tensor_ranks=None, grad_tensors=(), runs_tensors=(), integer_tensors=(), block_map_kernel=None,
                 map_uses_batch=False, map_uses_head=False, keep_mask_kernel=None, same_seqlen=False, short_kernel=None,
                 tensor_sizes=None):
        version = tuple(int(part) for part in triton.__version__.split(".")[:2])
        if version < MIN_TRITON:
            raise ImportError(f"triton: this module needs triton >= {'.'.join(map(str, MIN_TRITON))}, "
                              f"found {triton.__version__}")
        self.spec, self.config = spec, config
        self.dtype = TORCH_DTYPES[spec["dtype"]]
        # FP8 Q/K/V (forward only) write a bf16 output, as FlashAttention-3
        self.fp8 = spec["dtype"].startswith("fp8")
        self.out_dtype = torch.bfloat16 if self.fp8 else self.dtype
        if self.fp8 and config["loop_order"] != "q_outer":
            raise ValueError(f"loop_order: FP8 attention runs the q_outer forward, got {config['loop_order']!r}")
        self.num_heads, self.num_kv_heads = spec["num_heads"], spec["num_kv_heads"]
        self.block_dv = padded_head_dim(spec["head_dim_v"])
        self.block_d = padded_head_dim(spec["head_dim"])
        self.forward_kernel = forward_kernel
        self.preprocess_kernel, self.dkdv_kernel, self.dq_kernel = preprocess_kernel, dkdv_kernel, dq_kernel
        self.short_kernel = short_kernel
        self.tensor_ranks = dict(tensor_ranks or {})
        self.tensor_names = list(self.tensor_ranks)
        # {name: per dimension, the call sizes its plain b/h/q_idx/kv_idx indices imply} (masks.lowering.NamedTensor)
        self.tensor_sizes = {name: sizes for name, sizes in (tensor_sizes or {}).items() if any(sizes)}
        sequence_checks(self.tensor_sizes, self.tensor_ranks)  # registered: decode's records name them
        self.grad_tensors = list(grad_tensors)
        self.runs_tensors = frozenset(runs_tensors)
        self.runs_checks = {name: runs_check_id(name) for name in self.runs_tensors}  # registered: records name them
        self.integer_tensors = frozenset(integer_tensors)
        self.block_map_kernel = block_map_kernel
        self.map_uses_batch, self.map_uses_head = map_uses_batch, map_uses_head
        self.block_maps = {}  # (batch, heads, seqlens, tiling, device) -> block map, for masks that read no tensor
        self.keep_mask_kernel = keep_mask_kernel
        self.dropout = spec["dropout_p"] > 0
        self.same_seqlen = same_seqlen
        self.unused = {}  # (dtype, device) -> a one-element tensor for arguments a call never reads
        self.plans = {}  # call metadata -> ForwardPlan / BackwardPlan (see plan_key)
        self.decoder = None  # the module's DecodeLauncher, which sets itself here (decode_call)
        self.offset_checks = {}  # (device, signature, alignments) -> the packed offsets' check launch

    def unused_arg(self, dtype, device):
        """A one-element tensor for a kernel argument this call never reads (the seed without
        dropout, cu_seqlens of a dense batch): allocated once per device, not per call."""
        t = self.unused.get((dtype, device))
        if t is None:
            t = torch.empty(1, dtype=dtype, device=device)
            if not capturing(device):  # (kept, it would hold a graph's memory)
                self.unused[(dtype, device)] = t
        return t

    def interpreting(self):
        """Whether CPU tensors are accepted (tests that only compile replace this)."""
        return interpreting()

    # ------------------------------------------------------------------ input checks
    def check_inputs(self, q, k, v, layout):
        """(seq dim, head dim) of the layout, after checking q, k, v against the spec."""
        check_tensors(q, k, v, layout)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dtype != self.dtype:
                raise ValueError(f"{name}: expected dtype {self.dtype} (spec dtype {self.spec['dtype']}), got {t.dtype}")
            check_device(name, t, q.device)
        if q.device.type == "cpu" and not self.interpreting():
            raise ValueError(f"q: expected a CUDA tensor, got device {q.device} (set TRITON_INTERPRET=1 to run on the CPU)")
        check_interpretable("q", q.dtype)
        seq_dim, head_dim = {"bhsd": (2, 1), "bshd": (1, 2), "thd": (0, 1)}[layout]
        batch = () if layout == "thd" else (q.shape[0],)
        what = "(heads, head_dim)" if layout == "thd" else "(batch, heads, head_dim)"
        expected = {
            "q": (*batch, self.num_heads, self.spec["head_dim"]),
            "k": (*batch, self.num_kv_heads, self.spec["head_dim"]),
            "v": (*batch, self.num_kv_heads, self.spec["head_dim_v"]),
        }
        for name, t in (("q", q), ("k", k), ("v", v)):
            got = (*(t.shape[0],) * len(batch), t.shape[head_dim], t.shape[-1])
            if got != expected[name]:
                raise ValueError(f"{name}: expected {what} = {expected[name]} in layout {layout!r}, "
                                 f"got {got} from shape {tuple(t.shape)}")
        if k.shape[seq_dim] != v.shape[seq_dim]:
            raise ValueError(f"v: expected seqlen {k.shape[seq_dim]} (the seqlen of k), got {v.shape[seq_dim]}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_head_span(name, t)
        return seq_dim, head_dim

    def check_tensor_sizes(self, tensors, named, batch, seqlen_q, seqlen_k):
        """Refuse a named tensor too small for the indices the expressions give it (the kernels clamp each
        index into its tensor, so a short one would repeat its last element): a dimension indexed by b or h
        holds the batch or the query heads (or is 1: broadcast), one indexed by q_idx or kv_idx at least
        the sequence's length (packed sequences: the longest); one indexed by several, each of their rules.
        tensors: as passed; named: their views.
        A length given as None is not checked (decode's seqlen_k: the cache's lengths live on the device,
        so its kernel checks the dimensions kv_idx or a distance indexes, sequence_checks)."""
        calls = {"batch": batch, "heads": self.num_heads, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k,
                 "distances": None if seqlen_k is None else seqlen_q + seqlen_k - 1}
        for name, sizes in self.tensor_sizes.items():
            view, given = named[name], tensors[name]
            skipped = view.dim() - given.dim()  # leading dims the view added (broadcast)
            for d, names in enumerate(sizes):
                size = view.shape[d]
                if size == 1:
                    continue
                # every index of the dimension must be in range: one b or h takes the count exactly, q_idx
                # and kv_idx at least the length (a dimension several index takes each rule)
                exact = [n for n in names if n in ("batch", "heads")]
                longest = [n for n in names if n in ("seqlen_q", "seqlen_k", "distances") and calls[n] is not None]
                need = max((calls[n] for n in longest), default=0)
                if any(size != calls[n] for n in exact) or size < need:
                    rules = [f"{calls[n]} (the {'batch' if n == 'batch' else 'query heads'})" for n in exact]
                    if longest:
                        rules.append(f"at least {need} ({', '.join(SIZE_RULES.get(n, n) + f' {calls[n]}' for n in longest)})")
                    raise ValueError(f"{name}: expected size {' and '.join(rules)} or 1 in dim {d - skipped}, "
                                     f"got shape {tuple(given.shape)}")

    def named_tensors(self, tensors, device, lengths=None):
        """The named tensors, each viewed with the rank the expressions index it with
        (missing leading dimensions broadcast: document ids (S,) serve every batch element).
        lengths: the call's (batch, seqlen_q, seqlen_k), whose rules check_tensor_sizes applies to them."""
        tensors = dict(tensors or {})
        check_tensor_names(tensors, self.tensor_names)
        out = {}
        for name, rank in self.tensor_ranks.items():
            t = tensors[name]
            check_data(name, t)
            if t.is_complex():
                raise ValueError(f"{name}: expected a real (integer, float or bool) tensor, got dtype {t.dtype}")
            if name in self.integer_tensors and t.is_floating_point():
                raise ValueError(f"{name}: expected an integer or bool tensor (the mask's key ranges count tokens "
                                 f"with its values, or an expression indexes a tensor with them), got dtype {t.dtype}")
            check_device(name, t, device)
            if t.dim() > rank or t.numel() == 0:
                raise ValueError(f"{name}: expected a non-empty tensor of at most {rank} dimensions (indexed with "
                                 f"{rank}), got shape {tuple(t.shape)}")
            out[name] = t
        views = self.tensor_views(out)
        if lengths is not None:
            self.check_tensor_sizes(tensors, views, *lengths)
        return views

    def tensor_views(self, tensors):
        """The named tensors viewed with the rank the expressions index them with."""
        views = {}
        for name, rank in self.tensor_ranks.items():
            t = tensors[name]
            views[name] = t if t.dim() == rank else t.reshape((1,) * (rank - t.dim()) + tuple(t.shape))
        return views

    def tensor_args(self, tensors, runs=None):
        """The kernels' arguments for the named tensors: each tensor, its strides, its shape (and its
        runs table where the kernels read one: runs(t); None: runs_table, the table filled for this call;
        empty_runs_table for a kernel that fills it, unused_runs for kernels that read none)."""
        runs = runs or runs_table
        args = []
        for name in self.tensor_names:
            t = tensors[name]
            # a dim of size 1 broadcasts: stride 0 (a load whose index is kv_idx reads it unclamped: to_triton._load)
            args += [t, *(0 if n == 1 else s for n, s in zip(t.shape, t.stride())), *t.shape]
            if name in self.runs_tensors:
                self.check_runs(name, t)
                args.append(runs(t, self.runs_checks[name]))
        return args

    def unused_runs(self, t, check=0):
        """A runs table's dummy (one element, never read): tensor_args' runs for kernels that read none."""
        return self.unused_arg(torch.int32, t.device)

    def knobs(self, overrides):
        """CONFIG with a call's knob overrides (loop_order, bwd_fused_delta and bwd_short are structural:
        they change the kernels' text and cannot change here)."""
        cfg = dict(self.config)
        for name, value in overrides.items():
            if name not in cfg or name in ("loop_order", "bwd_fused_delta", "bwd_short"):
                raise TypeError(f"unexpected knob {name!r}")
            cfg[name] = value
        if cfg["BLOCK_M"] == 192 and (self.config["BLOCK_M"] != 192 or cfg.get("hopper_regs", 240) > 160):
            # three consumers: their partitions are rendered only into a module built with BLOCK_M 192, and
            # three warpgroups fit the SM's registers at 160 each
            raise ValueError(f"BLOCK_M: 192 (three consumers) needs a module built with BLOCK_M=192 and hopper_regs "
                             f"<= 160, got a module built with BLOCK_M={self.config['BLOCK_M']} and hopper_regs="
                             f"{cfg.get('hopper_regs', 240)}")
        return cfg

    @staticmethod
    def launch_knobs(cfg, block_m, block_n, num_warps, num_stages):
        """The tile sizes and launch options of one kernel, from the knobs of its phase."""
        return dict(BLOCK_M=cfg[block_m], BLOCK_N=cfg[block_n], num_warps=cfg[num_warps], num_stages=cfg[num_stages])

    def seed_arg(self, seed, dropout_p, device):
        """The seed tensor the kernels read (a dummy when dropout is off)."""
        if not dropout_p:
            return self.unused_arg(torch.int64, device)  # never read
        if not self.dropout:
            raise ValueError(f"dropout_p: this module was generated without dropout (spec dropout_p 0), "
                             f"got {dropout_p!r}")
        if seed is None or seed.dtype != torch.int64 or seed.numel() != 1:
            raise ValueError("seed: expected a one-element int64 tensor when dropout_p > 0")
        if not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"dropout_p: expected a probability in [0, 1), got {dropout_p!r}")
        return seed

    def plan_seed(self, seed, dropout_p, device):
        """The seed argument a call plan passes on every call: the unused one without dropout; None
        with dropout (each call's own seed, whose metadata is checked here)."""
        checked = self.seed_arg(seed, dropout_p, device)
        return None if dropout_p else checked

    OFFSET_CHECK_BLOCK = 1024  # offsets per step of the check's loop
    # FLASHGEN_SYNC_CHECKS=1 (debugging): packed offsets read on the host on a GPU too, so the bad call raises
    SYNC_CHECKS = env_flag("FLASHGEN_SYNC_CHECKS", False)

    def check_offsets(self, cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k):
        """Check packed-sequence offsets (every call: their values differ per call); the kernels clamp
        them into range whatever they hold (_seq_bounds), so a bad offset never reads or writes
        outside q, k, v or out. On the CPU the host checks them (check_cu_seqlens): the call raises.
        On a GPU reading them would wait for the device, every layer of a training step (a packed
        step of 32 layers: 1.23x faster without it, H100, benchmarks/probe_varlen_check.py): a
        one-program kernel checks them instead and writes the first broken rule to the device's
        bounds record, which each packed or decode call reads first, without a wait. So the error
        naming the argument is raised by the first such call made after the check kernel has run
        (with the host ahead of the GPU, as in training, that can be layers or steps later: the
        bad call's outputs, and what was computed from them, are meaningless), or at once by
        check_bounds(), which waits. Under CUDA-graph capture the check is captured with the call
        and nothing is read; under torch.compile tracing nothing runs. SYNC_CHECKS (the environment's
        FLASHGEN_SYNC_CHECKS=1): the host check on a GPU too, a wait per call, for debugging."""
        if torch.compiler.is_compiling():
            return
        device = cu_seqlens_q.device
        captured = capturing(device)
        if device.type != "cuda" or (self.SYNC_CHECKS and not captured):
            check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k)
            return
        record = bounds_record(device)
        if record.words[0] and not captured:
            record.raise_recorded()  # an earlier call's offsets (or a decode call's indices)
        cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()  # keyed by what is launched
        scalars = (cu_q.numel() - 1, total_q, total_k, max_seqlen_q, max_seqlen_k)
        key = (device, argument_signature(scalars), cu_q.data_ptr() & 15, cu_k.data_ptr() & 15)
        launch = self.offset_checks.get(key)
        if launch is None:
            if len(self.offset_checks) >= self.MAX_PLANS:
                self.offset_checks.clear()
            launch = self.offset_checks[key] = BoundLaunch(cu_seqlens_check, (1,), dict(
                BLOCK=self.OFFSET_CHECK_BLOCK, num_warps=4))
        launch(cu_q, cu_k, record.tensor, *scalars)

    def check_runs(self, name, t):
        """Check that the (rows, n) tensor `name`, searched by the kernels (document ids), is nondecreasing along
        each row: the key ranges of a row whose ids decrease would be wrong. On the CPU the host checks them: the
        call raises, naming the first decrease. On a GPU (as check_offsets) the kernels that search them record
        a decrease (the first one of whichever program claims the record: runs_table_fill, the Gluon forward's
        range kernel), which each such call reads first, without a wait:
        a later call raises, or check_bounds() at once; SYNC_CHECKS, the host's check on a GPU too."""
        device = t.device
        if device.type == "cuda" and not self.SYNC_CHECKS:
            record = bounds_record(device)
            if record.words[0] and not device_sync_forbidden(device):
                record.raise_recorded()  # an earlier call's ids (or packed offsets, a decode call's indices)
            return
        if device_sync_forbidden(device):
            return
        rows = t.to(torch.uint8) if t.dtype == torch.bool else t
        down = (rows[:, 1:] < rows[:, :-1]).nonzero()
        if len(down):
            b, j = (int(i) for i in down[0])
            raise runs_order_error(name, b, j + 1, rows[b, j + 1].item(), rows[b, j].item())

    def varlen_args(self, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, layout, q, k, seq_dim):
        """(batch, seqlen_q, seqlen_k, total_q, total_k): the packed sequences' bounds (totals: the
        tokens of q and k, which the kernels clamp offsets into), or the dense shape. The offsets'
        values are checked by the call plan, on every call."""
        if layout != "thd":
            if cu_seqlens_q is not None or cu_seqlens_k is not None:
                raise ValueError("cu_seqlens_q: packed sequences need layout 'thd' (total_tokens, heads, head_dim)")
            return q.shape[0], q.shape[seq_dim], k.shape[seq_dim], 0, 0
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            check_offsets(name, cu, q.device)
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(f"cu_seqlens_k: expected {cu_seqlens_q.numel()} offsets (as cu_seqlens_q), "
                             f"got {cu_seqlens_k.numel()}")
        for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if isinstance(m, bool) or not isinstance(m, int) or m < 0:
                raise ValueError(f"{name}: expected a non-negative int, got {m!r}")
        if self.block_map_kernel is not None or self.same_seqlen:
            raise ValueError(f"mask: {self.spec['mask']!r} is not supported over packed sequences (layout 'thd', "
                             "attention_varlen): block maps and document masks are per dense batch; use a dense batch")
        # no sequence is longer than all the tokens: a larger bound (flash-attn takes one) sizes the grid as these
        # (10**12 launched that many empty programs); the offsets are checked against the bound as given
        return cu_seqlens_q.numel() - 1, min(max_seqlen_q, q.shape[0]), min(max_seqlen_k, k.shape[0]), q.shape[0], \
            k.shape[0]

    # ------------------------------------------------------------------ block map (custom masks)
    def block_map(self, batch, seqlen_q, seqlen_k, block_m, block_n, device, tensors=None):
        """The mask's block map at this tiling: (per query block: counts, key blocks; per key block:
        counts, query blocks). Computed on the device by evaluating the mask on every tile; cached
        per shape when the mask reads no tensor (a call plan's map of a mask over tensors:
        TensorBlockMap)."""
        nb, nh, nq, nk = self.map_grid(batch, seqlen_q, seqlen_k, block_m, block_n)
        key = (nb, nh, seqlen_q, seqlen_k, block_m, block_n, str(device))
        if not self.tensor_names and key in self.block_maps:
            return self.block_maps[key]
        tile_classes = torch.empty((nb * nh, nq, nk), dtype=torch.int8, device=device)
        with on_device(tile_classes):
            self.block_map_kernel[(nq, nk, nb * nh)](tile_classes, seqlen_q, seqlen_k, nb, nh,
                                                     *self.tensor_args(tensors), BLOCK_M=block_m, BLOCK_N=block_n)
        tile_classes = tile_classes.view(nb, nh, nq, nk)
        result = (*index_lists(tile_classes), *index_lists(tile_classes.transpose(-1, -2)))
        if not self.tensor_names and not device_sync_forbidden(device):  # (captured: filled only by replays)
            self.block_maps[key] = result
        return result

    def map_grid(self, batch, seqlen_q, seqlen_k, block_m, block_n):
        """(batch elements, heads, query blocks, key blocks) of a block map at this tiling: one map for the batch
        or the heads where the mask reads neither."""
        return (batch if self.map_uses_batch else 1, self.num_heads if self.map_uses_head else 1,
                triton.cdiv(seqlen_q, block_m), triton.cdiv(seqlen_k, block_n))

    def map_args(self, counts, lists, batch):
        """The kernels' block-map arguments: counts and lists broadcast to (batch, heads), and their strides."""
        counts = counts.expand(batch, self.num_heads, *counts.shape[2:])
        lists = lists.expand(batch, self.num_heads, *lists.shape[2:])
        return [counts, lists, counts.stride(0), counts.stride(1), counts.stride(2),
                lists.stride(0), lists.stride(1), lists.stride(2), lists.stride(3)]

    # ------------------------------------------------------------------ call plans
    # A call's checks and launch arguments depend only on its tensors' metadata (shapes, strides,
    # dtypes, devices, pointer alignment) and its scalar arguments, never on tensor contents
    # (bar packed-sequence offsets, checked on every call). The first call of a metadata key
    # checks everything and makes a plan; later calls of that key run the plan: allocate the
    # outputs and launch through bound launches (launch.py), with nothing checked again.
    MAX_PLANS = 512  # plans kept per module (a packed-sequence loop makes one per length); then forgotten

    def plan_key(self, scalars, call_tensors, tensors, knobs):
        """The key of a call's plan: its scalars and every tensor's metadata. None (a plan made
        afresh for that call alone) when bound launches are off, or when an argument is not a tensor
        (the checks name it). (A mask's block map over tensors is the one thing a plan may make again
        on every call: TensorBlockMap.)"""
        if not BoundLaunch.enabled:
            return None
        try:
            return (scalars, *map(tensor_key, call_tensors),
                    tuple((name, tensor_key(t)) for name, t in tensors.items()) if tensors else None,
                    tuple(knobs.items()) if knobs else None,
                    call_tensors[0].is_cpu and self.interpreting())
        except (AttributeError, RuntimeError):  # (not tensors, or without strides: the checks name them)
            return None

    def dense_key(self, q, k, v, layout, softmax_scale, tensors=None):
        """plan_key of the commonest calls (a training step's forward, a plain eager forward, a mask's
        with its named tensors): dense q, k, v and the named tensors, nothing else (no out/lse buffers,
        dropout, knobs, offsets or FP8 descales; its seed is never read then). One flat tuple of the
        tensors' metadata, as tensor_key has it, instead of plan_key's nine tensor_key calls and nested
        tuples: ~1.5 us less per call on the CI CPU (~3 with a named tensor). None where plan_key gives None."""
        if not BoundLaunch.enabled:
            return None
        try:
            key = ("dense", layout, softmax_scale, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(),
                   q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, q.data_ptr() & 15, k.data_ptr() & 15,
                   v.data_ptr() & 15, q.is_cpu and self.interpreting())
            if tensors:
                for name, t in tensors.items():
                    key += (name, t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)
            return key
        except (AttributeError, RuntimeError):  # (not tensors, or without strides: the checks name them)
            return None

    def cached_plan(self, key):
        try:
            return self.plans.get(key)
        except TypeError:  # an unhashable knob value: planned afresh each call
            return None

    def remember(self, key, plan, device=None):
        """Keep plan for its key; not one made while a CUDA graph is captured on device (its block maps, unread
        LSE, ... are the graph's, filled by replays only)."""
        if key is None or (device is not None and capturing(device)):
            return
        if len(self.plans) >= self.MAX_PLANS:
            self.plans.clear()
        try:
            self.plans[key] = plan
        except TypeError:
            pass

    # ------------------------------------------------------------------ FP8
    def descale_args(self, descales, batch, device):
        """FP8: the q, k, v descale tensors as contiguous float32 (batch, kv_heads) tensors (1 where
        None) and their two strides; each given one must broadcast to (batch, kv_heads)."""
        shape = (batch, self.num_kv_heads)
        out = []
        for name, d in descales:
            if d is None:
                d = self.unused.get(("ones", shape, device))
                if d is None:
                    d = torch.ones(shape, dtype=torch.float32, device=device)
                    if not capturing(device):  # (captured: filled only by replays, and eager calls would read it)
                        self.unused[("ones", shape, device)] = d
            else:
                check_descale(name, d, device, shape)
                try:
                    d = torch.broadcast_to(d, shape)
                except RuntimeError:
                    raise ValueError(f"{name}: expected a shape broadcastable to (batch, kv_heads) = {shape}, "
                                     f"got {tuple(d.shape)}") from None
                d = d.to(torch.float32).contiguous()
            out.append(d)
        return (*out, shape[1], 1)

    def fp8_inputs(self, q, k, v, layout, cu_seqlens_q, descales):
        """FP8 calls: V seq-contiguous (the operand layout of the FP8 MMA; a copy when it is not) and
        the descale arguments. Other specs: refuse descales."""
        if not self.fp8:
            for name, d in descales:
                if d is not None:
                    raise ValueError(f"{name}: descale factors are for FP8 specs; this spec's dtype is "
                                     f"{self.spec['dtype']}")
            return v, ()
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or q.dim() != (3 if layout == "thd" else 4):
            self.check_inputs(q, k, v, layout)  # raises, naming the argument
        if layout == "thd":
            if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1:
                raise ValueError("cu_seqlens_q: expected a 1-d int32 tensor of batch + 1 offsets")
            batch = cu_seqlens_q.numel() - 1
        else:
            batch = q.shape[0]
        return seq_contiguous(v, SEQ_DIMS[layout]), self.descale_args(descales, batch, q.device)

    # ------------------------------------------------------------------ forward
    def forward(self, q, k, v, *, layout="bhsd", out=None, lse=None, softmax_scale=None, dropout_p=0.0, seed=None,
                tensors=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                q_descale=None, k_descale=None, v_descale=None, **knobs):
        """Attention forward. q: (B, H, Sq, D) for layout 'bhsd', (B, Sq, H, D) for 'bshd', or packed
        (total_q, H, D) for 'thd' with cu_seqlens_q/k and max_seqlen_q/k; k, v likewise with the KV
        heads. Returns (out, lse): out in q's layout with head dim head_dim_v, lse (B, H, Sq) float32
        (natural log; (H, total_q) for 'thd'). ``tensors`` maps the names in TENSORS to tensors.
        Knobs override CONFIG. With dropout_p > 0, seed is a one-element int64 tensor; pass the same
        one to backward(). FP8 specs: q, k, v in the spec's FP8 dtype; q/k/v_descale float32 factors
        broadcastable to (batch, kv_heads) (None: 1): the values are q * q_descale, ...; out is bf16."""
        v, fp8_args = self.fp8_inputs(q, k, v, layout, cu_seqlens_q, (("q_descale", q_descale),
                                                                      ("k_descale", k_descale),
                                                                      ("v_descale", v_descale)))
        if out is None and lse is None and not (fp8_args or knobs or tensors or dropout_p or cu_seqlens_q is not None):
            decode = self.decode_call(q, k, v, layout, softmax_scale, seed)
            if decode is not None:
                return decode
        if out is not None or lse is not None:  # per call: a plan's key holds only the buffers' alignment
            check_outputs_apart((("out", out), ("lse", lse)), (("q", q), ("k", k), ("v", v)))
        plan = self.forward_call_plan(q, k, v, layout, out, lse, softmax_scale, dropout_p, seed, tensors, cu_seqlens_q,
                                      cu_seqlens_k, max_seqlen_q, max_seqlen_k, fp8_args, knobs)
        return plan(q, k, v, out, lse, seed, tensors, cu_seqlens_q, cu_seqlens_k, fp8_args)

    # ------------------------------------------------------------------ decode-shaped calls, any key length
    # A generation step (a few new queries over a KV cache one longer each step) has new metadata on
    # every call: k and v have a new length and, as views of transformers' (B, H_kv, S, D) cache,
    # batch and head strides that follow from it. Their plan differs from the last step's only in
    # those ints and seqlen_k, so it is kept per key *without* them: a new length costs a
    # dictionary hit and the ints spliced into the kernel's arguments, not forward_plan's checks.
    DECODE_QUERIES = 16  # calls of up to this many queries are planned without their key length
    # Such calls over more keys than this run on the split-KV decode kernel (decodes()); up to it, on the
    # prefill kernel's length-free plan, whose launch takes less host time (CI CPU, B=4, 16 / 4 heads,
    # hd128, one query, launches mocked: 34-45 vs 57 us per call), the GPU's work being microseconds.
    DECODER_KEYS = 512

    def decode_key(self, q, k, v, layout, softmax_scale):
        """The length-free key of a dense call of at most DECODE_QUERIES queries (None: not one):
        the call's plan key less k's and v's sequence length and their batch and head strides."""
        seq_dim = SEQ_DIMS.get(layout)
        try:
            if seq_dim is None or not BoundLaunch.enabled or q.shape[seq_dim] > self.DECODE_QUERIES:
                return None
            return ("decode", layout, softmax_scale, tensor_key(q), *(
                (t.shape[:seq_dim] + t.shape[seq_dim + 1:], t.stride(seq_dim), t.stride(-1), t.dtype, t.device,
                 t.data_ptr() & 15) for t in (k, v)), q.is_cpu and self.interpreting())
        except (AttributeError, IndexError, TypeError, RuntimeError):  # not tensors, too few dims, no strides (sparse
            return None  # tensors): the checks name them

    def decodes(self, q, k, v, layout):
        """Whether the calls of a decode key (decode_call) run on the split-KV decode kernel (the
        module's DecodeLauncher.read()) rather than the prefill kernel: a spec the decode kernel
        serves (no dropout, document ids, named tensors or FP8; its mask and score_mod code are the
        prefill kernel's, causal aligned bottom-right), K and V with a contiguous last dim (the
        decode kernel's cache layout), one query in the bhsd layout (whose (B, 1, H, Dv) output is
        also contiguous as (B, H, 1, Dv)); CPU tensors without the interpreter are check_inputs'
        error. The decode kernel reads K/V once per KV group and splits long caches over the SMs;
        the prefill kernel runs one program per (query block, head) over every key, and its plans of
        4096 keys and more (tensor descriptors, the Gluon family) are not length-free: a new plan per
        generation step."""
        return ((layout == "bshd" or layout == "bhsd" and q.shape[2] == 1) and k.stride(-1) == 1 and v.stride(-1) == 1
                and not (self.dropout or self.same_seqlen or self.tensor_names or self.fp8))

    def decode_call(self, q, k, v, layout, softmax_scale, seed):
        """(out, lse) of a decode-shaped call, or None when the call is not one, or its plan cannot
        take another length (tensor descriptors, which are built for one shape; the KV-outer order;
        the hopper_ws family; a mask with a block map): then the exact plan runs. Over more than
        DECODER_KEYS keys, the split-KV decode kernel where it serves the call (decodes()); else the
        prefill kernel's length-free plan."""
        key = self.decode_key(q, k, v, layout, softmax_scale)
        if key is None:
            return None
        seq_dim = SEQ_DIMS[layout]
        seqlen_k = k.shape[seq_dim]
        if seqlen_k == 0 or v.shape[seq_dim] != seqlen_k:
            return None  # nothing to launch, or an error the checks name
        if seqlen_k > self.DECODER_KEYS and q.shape[seq_dim] <= seqlen_k:  # not rows that see no key
            routed = self.plans.get((DECODER, key))
            if routed is None:
                routed = self.decoder is not None and self.decodes(q, k, v, layout)
                if routed:  # errors name q, k and v, not the decode kernel's cache arguments
                    self.check_inputs(q, k, v, layout)
                self.remember((DECODER, key), routed)
        else:
            routed = False
        if routed:
            if layout == "bshd":
                return self.decoder.read(q, k, v, softmax_scale, return_lse=True)
            out, lse = self.decoder.read(q, k, v, softmax_scale, return_lse=True, layout="bhsd")
            batch, _, heads, dv = out.shape  # one query: (B, 1, H, Dv) holds (B, H, 1, Dv) with the same strides
            return out.view(batch, heads, 1, dv), lse
        decode = self.plans.get(key)
        if decode is False:
            return None
        kb, kh, ks, kd = bhsd_strides(k, layout)
        vb, vh, vs, vd = bhsd_strides(v, layout)
        if wide_rows(layout, (k.shape, k.stride()), (v.shape, v.stride())):  # the exact plan, made for them
            return None
        signature = argument_signature((kb, kh, vb, vh, seqlen_k))  # how Triton specializes these ints
        if decode is None:
            plan = self.forward_call_plan(q, k, v, layout, None, None, softmax_scale, 0.0, seed, None, None, None, None,
                                          None)
            decode = False
            if (type(plan) is ForwardPlan and plan.launch is not None and plan.descriptors is None
                    and plan.buffers is None and self.block_map_kernel is None and not self.same_seqlen):
                decode = (plan, {signature: plan.launch})
            self.remember(key, decode, q.device)
        if decode is False:
            return None
        plan, launches = decode
        launch = launches.get(signature)  # one binary per answer of the signature
        if launch is None:
            base = plan.launch
            launch = launches[signature] = BoundLaunch(base.kernel, base.grid, base.constexprs)
        head = plan.head
        head = (*head[:4], kb, kh, ks, kd, vb, vh, vs, vd, *head[12:20], seqlen_k, *head[21:])
        return plan(q, k, v, None, None, seed, None, None, None, head=head, launch=launch)

    def dense_plan(self, q, k, v, layout, tensors=None):
        """The plan forward(q, k, v, layout=layout, tensors=tensors) ran for a dense call with nothing else (no
        buffers, dropout, knobs, offsets or descales; CallPlan.dense), when that call is one plan's launch (not
        decode-shaped: decode_call's route varies with the key length); None otherwise, or not run yet. Its
        caller (api's fast path) keeps it per call key and runs it as plan(q, k, v, None, ..., tensors, ...),
        or, recording a gradient, hands it to the autograd function (plan.training_call). tensors: the named
        tensors in the kernel's order, as the call passed them."""
        if self.fp8 or (not tensors and self.decode_key(q, k, v, layout, None) is not None):
            return None
        plan = self.cached_plan(self.dense_key(q, k, v, layout, None, tensors))
        return plan if plan is not None and plan.dense and plan.named == bool(tensors) else None

    def forward_call_plan(self, q, k, v, layout, out, lse, softmax_scale, dropout_p, seed, tensors, cu_seqlens_q,
                          cu_seqlens_k, max_seqlen_q, max_seqlen_k, fp8_args=(), knobs=None):
        """The ForwardPlan of a call: the cached one of its metadata key, else made (and checked) now."""
        if (out is None and lse is None and not (dropout_p or knobs or fp8_args)
                and cu_seqlens_q is None and cu_seqlens_k is None):
            key = self.dense_key(q, k, v, layout, softmax_scale, tensors)
        else:
            key = self.plan_key(("fwd", layout, softmax_scale, dropout_p, max_seqlen_q, max_seqlen_k),
                                (q, k, v, out, lse, seed, cu_seqlens_q, cu_seqlens_k, *fp8_args[:3]), tensors, knobs)
        knobs = knobs or {}
        plan = self.cached_plan(key)
        if plan is None:
            plan = self.forward_plan(q, k, v, layout, out, lse, softmax_scale, dropout_p, seed, tensors, cu_seqlens_q,
                                     cu_seqlens_k, max_seqlen_q, max_seqlen_k, knobs)
            self.remember(key, plan, q.device)
        return plan

    # ------------------------------------------------------------------ training (autograd) calls
    # An autograd step runs one forward and one backward over the same q, k, v, out, lse, seed,
    # named tensors and offsets: the backward's plan hangs off the forward's (keyed by dO's
    # metadata and the gradient options), so the backward neither keys nor checks those again,
    # and packed offsets, checked by the forward, are not read back a second time (autograd's
    # saved-tensor version check refuses them if they were changed in place since).
    def training_forward(self, q, k, v, layout, dropout_p, seed, tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k):
        """(out, lse, plan, extra) of a forward whose backward is training_backward(plan, ..., extra=extra):
        the forward() call without out/lse buffers, knobs or FP8 descales. extra: the named tensors'
        kernel arguments this forward launched with (None without named tensors), runs tables of
        document ids among them: the backward reuses them rather than searching the ids again (autograd
        refuses the backward if a saved named tensor was changed in place since)."""
        if self.fp8:
            raise ValueError(f"dtype: FP8 attention ({self.spec['dtype']}) is forward-only; gradients need "
                             "fp16 or bf16 inputs")
        plan = self.forward_call_plan(q, k, v, layout, None, None, None, dropout_p, seed, tensors, cu_seqlens_q,
                                      cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        out, lse, extra = plan.training_call(q, k, v, seed, tensors, cu_seqlens_q, cu_seqlens_k)
        return out, lse, plan, extra

    def training_backward(self, plan, do, q, k, v, out, lse, seed, tensors, cu_seqlens_q, cu_seqlens_k, *,
                          deterministic=False, tensor_grads=(), extra=None):
        """backward() of a training_forward() call: the same (dq, dk, dv, {name: grad}). q ... cu_seqlens_k
        are that call's tensors and outputs, unchanged; plan and extra are what it returned."""
        do = head_contiguous(do)
        key = (tensor_key(do), bool(deterministic), tuple(tensor_grads))
        bplan = plan.backward_plans.get(key)
        if bplan is None:
            offsets = plan.offsets or (None,) * 4
            bplan = self.backward_plan(do, q, k, v, out, lse, plan.layout, plan.softmax_scale, plan.dropout_p, seed,
                                       deterministic, tensors, tuple(tensor_grads), cu_seqlens_q, cu_seqlens_k,
                                       offsets[2], offsets[3], {})
            if not capturing(q.device):  # (as forward_call_plan)
                plan.backward_plans[key] = bplan
        return bplan(do, q, k, v, out, lse, seed, tensors, cu_seqlens_q, cu_seqlens_k, offsets_checked=True,
                     extra=extra)

    def check_outputs(self, layout, q, batch, seqlen_q, out, lse):
        """(out's shape, lse's shape) of a call, after checking the out and lse given (None: allocated)."""
        num_heads, dv = self.num_heads, self.spec["head_dim_v"]
        o_shape = {"bhsd": (batch, num_heads, seqlen_q, dv), "bshd": (batch, seqlen_q, num_heads, dv),
                   "thd": (q.shape[0], num_heads, dv)}[layout]
        lse_shape = (num_heads, q.shape[0]) if layout == "thd" else (batch, num_heads, seqlen_q)
        for name, t in (("out", out), ("lse", lse)):
            if t is not None:
                check_tensor(name, t)
        if out is not None:
            if tuple(out.shape) != o_shape or out.dtype != self.out_dtype or out.device != q.device:
                raise ValueError(f"out: expected shape {o_shape}, dtype {self.out_dtype} and device {q.device}, got "
                                 f"{tuple(out.shape)} {out.dtype} {out.device}")
            check_head_span("out", out)
            if overlapping(out):  # rows written by several programs at once
                raise ValueError(f"out: expected a tensor whose elements do not share memory, got strides "
                                 f"{tuple(out.stride())} over shape {tuple(out.shape)} (an expand()ed tensor)")
        if lse is not None and (tuple(lse.shape) != lse_shape or lse.dtype != torch.float32 or not lse.is_contiguous()
                                or lse.device != q.device):
            raise ValueError(f"lse: expected a contiguous float32 tensor of shape {lse_shape} on {q.device}, got "
                             f"{tuple(lse.shape)} {lse.dtype} {lse.device}"
                             + (f" with strides {tuple(lse.stride())}" if tuple(lse.shape) == lse_shape else ""))
        return o_shape, lse_shape

    def forward_plan(self, q, k, v, layout, out, lse, softmax_scale, dropout_p, seed, tensors, cu_seqlens_q,
                     cu_seqlens_k, max_seqlen_q, max_seqlen_k, knobs):
        """Check a forward call and work out its launch: a ForwardPlan."""
        seq_dim, _ = self.check_inputs(q, k, v, layout)
        check_softmax_scale(softmax_scale)
        cfg = self.knobs(knobs)
        batch, seqlen_q, seqlen_k, total_q, total_k = self.varlen_args(
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, layout, q, k, seq_dim)
        if self.same_seqlen and seqlen_q != seqlen_k:
            raise ValueError(f"k: a document mask needs seqlen_k == seqlen_q ({seqlen_q}), got {seqlen_k}")
        named = self.named_tensors(tensors, q.device, (batch, seqlen_q, seqlen_k))
        num_heads = self.num_heads
        o_shape, lse_shape = self.check_outputs(layout, q, batch, seqlen_q, out, lse)
        plan = ForwardPlan(self, layout, q, o_shape, lse_shape, seed=self.plan_seed(seed, dropout_p, q.device),
                           offsets=(total_q, total_k, max_seqlen_q, max_seqlen_k) if layout == "thd" else None)
        plan.softmax_scale, plan.dropout_p = softmax_scale, dropout_p  # what training_backward plans with
        if layout == "thd" and (seqlen_q == 0 or seqlen_k == 0):
            plan.zero_fill = True  # (its calls still check the offsets: a longer sequence than max_seqlen raises)
            return plan
        if batch * num_heads * seqlen_q == 0:
            return plan
        scale = self.spec["softmax_scale"] if softmax_scale is None else softmax_scale
        launch = self.launch_knobs(cfg, "BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
        lse_strides = (0, q.shape[0]) if layout == "thd" else (num_heads * seqlen_q, seqlen_q)
        o_strides = contiguous_strides(o_shape) if out is None else out.stride()
        strides = (*bhsd_strides(q, layout), *bhsd_strides(k, layout), *bhsd_strides(v, layout),
                   *bhsd_order(o_strides, layout), *lse_strides)
        qk_scale = scale * self.RCP_LN2  # exp(x * scale) = exp2(x * qk_scale)
        plan.head = (*strides, num_heads, seqlen_q, seqlen_k, scale, qk_scale, float(dropout_p))
        maps = []
        if self.block_map_kernel is not None and self.tensor_names:  # made on every call
            plan.maps = TensorBlockMap(self, batch, seqlen_q, seqlen_k, cfg["BLOCK_M"], cfg["BLOCK_N"], q.device,
                                       rows=cfg["loop_order"] == "q_outer")
        elif self.block_map_kernel is not None:
            rows_cnt, rows_idx, cols_cnt, cols_idx = self.block_map(batch, seqlen_q, seqlen_k, cfg["BLOCK_M"],
                                                                    cfg["BLOCK_N"], q.device)
            if cfg["loop_order"] == "q_outer":
                maps = self.map_args(rows_cnt, rows_idx, batch)
            else:
                maps = self.map_args(cols_cnt, cols_idx, batch)
        plan.tail = (*maps, total_q, total_k)
        short = None if knobs else self.short_kv_knobs(cfg, layout, dropout_p, batch, seqlen_q, seqlen_k, q.device)
        if short is not None:  # keys that fit one tile: the short-keys forward, with the same arguments and its tiles
            grid, tiles = short
            plan.tail = (*plan.tail, tiles)
            plan.launch = BoundLaunch(self.short_kv_kernel, grid, dict(self.SHORT_KV_TILE,
                                                                       BLOCK_N=max(16, triton.next_power_of_2(seqlen_k))))
            plan.direct = plan.plain
            return plan
        hopper = getattr(self, "hopper_forward", None)  # config family hopper_ws: runtime/hopper.py
        if hopper is not None and cfg.get("family") == "hopper_ws":
            served = hopper.plan(plan, q, k, v, layout, out, scale, dropout_p, cfg,
                                 varlen=(batch, seqlen_q, seqlen_k) if layout == "thd" else None)
            if served is not None:  # else the portable forward below
                return served
            # the portable forward on its own default's knobs for this length, the longer side's as a kernel's
            # bucket is picked (the family's tiles are its consumers' and a producer's: 0.36-0.55x as fast there);
            # sm90's knobs, so off sm90 without descriptors or warp specialization
            cfg = {**cfg, **hopper.fallback_knobs(max(seqlen_q, seqlen_k))}
            if hopper.device_unserved(q.device):
                cfg.update(tma=False, warp_specialize=False)
            if cfg["BLOCK_M"] & (cfg["BLOCK_M"] - 1):  # (a module without the table: three consumers' 192 rows)
                cfg["BLOCK_M"] = 64
            launch = self.launch_knobs(cfg, "BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
        flags = dict(VARLEN=layout == "thd", DROPOUT=bool(dropout_p), WIDE_ROWS=wide_rows(
            layout, *((t.shape, t.stride()) for t in (q, k, v)), (o_shape, o_strides)))
        if cfg["loop_order"] == "q_outer":
            grid = (triton.cdiv(seqlen_q, cfg["BLOCK_M"]), num_heads, batch)
            out_size = torch.empty((), dtype=self.out_dtype).element_size()
            out_ready = tma_ready(out) if out is not None else tma_strides_ok(o_strides, out_size)
            v_ready = tma_ready_transposed(v, layout) if self.fp8 else tma_ready(v)
            tma = cfg["tma"] and layout != "thd" and tma_ready(q) and tma_ready(k) and v_ready and out_ready
            if tma:
                v_descriptor = transposed_descriptor if self.fp8 else tensor_descriptor  # FP8: V seq-contiguous
                plan.descriptors = Descriptors(layout, ((launch["BLOCK_M"], self.block_d),
                                                        (launch["BLOCK_N"], self.block_d),
                                                        (launch["BLOCK_N"], self.block_dv),
                                                        (launch["BLOCK_M"], self.block_dv)),
                                               [tensor_descriptor, tensor_descriptor, v_descriptor, tensor_descriptor])
            plan.launch = BoundLaunch(self.forward_kernel, grid, dict(
                flags, TMA=tma, WARP_SPECIALIZE=cfg["warp_specialize"], **launch))
            plan.direct = plan.plain and not tma and not self.fp8
        else:
            rows = q.shape[0] if layout == "thd" else batch * seqlen_q
            plan.buffers = (num_heads * rows, self.block_dv)
            # the float32 accumulator's rows: a sequence's row index times BLOCK_DV, 64-bit from 2^31 elements
            flags["WIDE_ROWS"] = flags["WIDE_ROWS"] or seqlen_q * self.block_dv >= 2**31
            plan.launch = BoundLaunch(self.forward_kernel, (num_heads, batch), dict(flags, **launch))
        return plan

    def short_kv_knobs(self, cfg, layout, dropout_p, batch, seqlen_q, seqlen_k, device):
        """(grid, query tiles per program) of a call the short-keys forward takes, else None: a dense call of
        the Q-outer loop order without dropout whose keys fit one tile (at most SHORT_KV_KEYS, at least one)
        under many more queries (at least SHORT_KV_QUERIES, and SHORT_KV_RATIO per key), at head dims that
        are powers of two up to SHORT_KV_HEAD_DIM. Each program loads K and V once and walks up to
        SHORT_KV_TILES query tiles; fewer where that would leave the grid under two programs per SM. Its tiles
        are its own: the module's config (the tuner times self-attention) is the other forwards'; a call that
        names knobs (module.forward(..., BLOCK_M=...)) runs the forward they name.
        H200, bf16, 8 heads, us, this kernel / the forward before it (cuDNN, FlashAttention-2), 3 interleaved
        rounds (benchmarks/NOTES.md, session 43): batch 8, 4096 queries x 77 keys, hd64 42.9 / 66.4 (cuDNN
        41-50, FA2 60.4); batch 2 16.2 / 23.4 (16.6, 20.4); 1024 x 77 15.7 / 23.8 (FA2 23.7); 4096 x 16 26.5 /
        58.9 (41.2, 60.0); 4096 x 128 37.6 / 45.8 (39.1, 57.4); hd32 (10 heads, batch 4) 24.7 / 28.0. Not
        taken: hd40 (padded to 64; 65.7-69.8 / 65.8, cuDNN 43.6) and hd128 (71.4 / 73.6, cuDNN 54.1)."""
        if (self.short_kv_kernel is None or layout == "thd" or dropout_p or cfg["loop_order"] != "q_outer"
                or not 0 < seqlen_k <= self.SHORT_KV_KEYS
                # (a decode-shaped call's plan serves every key length (decode_call): never one of this kernel's)
                or seqlen_q < max(self.SHORT_KV_QUERIES, self.SHORT_KV_RATIO * seqlen_k, self.DECODE_QUERIES + 1)
                or self.spec["head_dim"] != self.block_d or self.spec["head_dim_v"] != self.block_dv
                or max(self.block_d, self.block_dv) > self.SHORT_KV_HEAD_DIM):
            return None
        tiles_m = triton.cdiv(seqlen_q, self.SHORT_KV_TILE["BLOCK_M"])
        heads = batch * self.num_heads
        tiles = max(1, min(self.SHORT_KV_TILES, tiles_m * heads // (2 * sm_count(device))))
        return (triton.cdiv(tiles_m, tiles), self.num_heads, batch), tiles

    # ------------------------------------------------------------------ backward
    def backward(self, do, q, k, v, out, lse, *, layout="bhsd", softmax_scale=None, dropout_p=0.0, seed=None,
                 deterministic=False, tensors=None, tensor_grads=(), cu_seqlens_q=None, cu_seqlens_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, **knobs):
        """Gradients (dq, dk, dv, {name: d tensor}) of forward() given dO, in the inputs' layout
        (not for FP8 specs: they are forward-only).

        tensor_grads names the GRAD_TENSORS to differentiate (float32 results, in each tensor's shape).
        dq_strategy 'separate' (or deterministic=True) runs a Q-outer dQ kernel; 'atomic' adds
        dQ from the dK/dV kernel into a float32 buffer (one pass fewer, not bitwise repeatable)."""
        if self.fp8:
            raise ValueError(f"dtype: FP8 attention ({self.spec['dtype']}) is forward-only; gradients need "
                             "fp16 or bf16 inputs")
        if isinstance(do, torch.Tensor):
            do = head_contiguous(do)
        key = self.plan_key(("bwd", layout, softmax_scale, dropout_p, bool(deterministic), tuple(tensor_grads),
                             max_seqlen_q, max_seqlen_k),
                            (q, k, v, do, out, lse, seed, cu_seqlens_q, cu_seqlens_k), tensors, knobs)
        plan = self.cached_plan(key)
        if plan is None:
            plan = self.backward_plan(do, q, k, v, out, lse, layout, softmax_scale, dropout_p, seed, deterministic,
                                      tensors, tensor_grads, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      knobs)
            self.remember(key, plan, q.device)
        return plan(do, q, k, v, out, lse, seed, tensors, cu_seqlens_q, cu_seqlens_k)

    def backward_plan(self, do, q, k, v, out, lse, layout, softmax_scale, dropout_p, seed, deterministic, tensors,
                      tensor_grads, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, knobs):
        """Check a backward call and work out its launches: a BackwardPlan."""
        seq_dim, _ = self.check_inputs(q, k, v, layout)
        check_softmax_scale(softmax_scale)
        cfg = self.knobs(knobs)
        batch, seqlen_q, seqlen_k, total_q, total_k = self.varlen_args(
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, layout, q, k, seq_dim)
        for name, t in (("out", out), ("lse", lse), ("do", do)):
            if t is None:  # the forward's outputs and dO: all needed
                raise TypeError(f"{name}: expected a torch.Tensor, got None")
        self.check_outputs(layout, q, batch, seqlen_q, out, lse)
        check_tensor("do", do)
        if do.shape != out.shape or do.dtype != out.dtype or do.device != out.device:
            raise ValueError(f"do: expected shape {tuple(out.shape)} and dtype {out.dtype} (those of out), "
                             f"got {tuple(do.shape)} {do.dtype}")
        check_head_span("do", do)
        named = self.named_tensors(tensors, q.device, (batch, seqlen_q, seqlen_k))
        for name in tensor_grads:
            if name not in self.grad_tensors:
                raise ValueError(f"tensor_grads: {name!r} is not a float tensor read by the score_mod "
                                 f"({self.grad_tensors})")
            if overlapping(named[name]):  # its elements' gradients would add up in the memory they share
                raise ValueError(f"{name}: expected a tensor whose elements do not share memory to differentiate, "
                                 f"got strides {tuple(tensors[name].stride())} over shape "
                                 f"{tuple(tensors[name].shape)} (an expand()ed tensor: pass it unexpanded, size-1 "
                                 "dims broadcast, or .contiguous())")
        num_heads, num_kv_heads = self.num_heads, self.num_kv_heads
        plan = BackwardPlan(self, layout, q, k, v, lse, seed=self.plan_seed(seed, dropout_p, q.device),
                            offsets=(total_q, total_k, max_seqlen_q, max_seqlen_k) if layout == "thd" else None,
                            grads={name: (named[name].shape, named[name].stride()) for name in tensor_grads},
                            scratch={name: (named[name].shape, named[name].stride()) for name in self.grad_tensors
                                     if tensor_grads and name not in tensor_grads})
        if batch * num_heads * seqlen_q == 0 or seqlen_k == 0:
            return plan
        scale = self.spec["softmax_scale"] if softmax_scale is None else softmax_scale
        qk_scale = scale * self.RCP_LN2
        pre = self.launch_knobs(cfg, "BLOCK_M2", "BLOCK_N2", "bwd_num_warps", "bwd_num_stages")
        pre_batch, pre_seq = (1, q.shape[0]) if layout == "thd" else (batch, seqlen_q)
        plan.preprocess = BoundLaunch(self.preprocess_kernel, (triton.cdiv(pre_seq, pre["BLOCK_M"]), num_heads,
                                                               pre_batch), dict(BLOCK_M=pre["BLOCK_M"]))
        plan.preprocess_args = (*bhsd_strides(out, layout), *bhsd_strides(do, layout), num_heads, pre_seq)
        atomic = cfg["dq_strategy"] == "atomic" and not deterministic
        hopper = getattr(self, "hopper_backward", None)  # config knob hopper_bwd: runtime/hopper_bwd.py
        if (atomic and "dq_strategy" not in knobs and cfg.get("hopper_bwd") and hopper is not None
                and hopper.unserved(q, k, v, do, layout, dropout_p, True) is not None):
            # the config's atomic dQ is the Gluon kernel's (its defaults add dQ there): a call that kernel
            # cannot serve (packed varlen, unaligned strides, another device) takes the portable kernels
            # with the separate dQ kernel, the portable atomic adds being 1.4-2.1x slower
            atomic = False
        plan.atomic = atomic
        # (dq, dk, dv and dQ's float32 buffer: contiguous in q's, k's and v's shapes)
        wide = wide_rows(layout, *((t.shape, t.stride()) for t in (q, k, v, out, do)),
                         *((t.shape, contiguous_strides(t.shape)) for t in (q, k, v)))
        if self.short_kernel is not None and not atomic:  # bwd_short: one launch does it all
            return self.short_plan(plan, q, k, v, out, do, layout, cfg, batch, seqlen_q, seqlen_k, total_q, total_k,
                                   scale, dropout_p, tensor_grads, wide)
        # dQ target: the float32 accumulation buffer (atomic) or dq itself (written once); dq,
        # dk, dv and the buffer are allocated contiguous.
        dq_strides, dk_strides, dv_strides = (bhsd_order(contiguous_strides(t.shape), layout) for t in (q, k, v))
        qkv_strides = (*bhsd_strides(q, layout), *bhsd_strides(k, layout), *bhsd_strides(v, layout),
                       *bhsd_strides(do, layout))
        lse_strides = (0, q.shape[0]) if layout == "thd" else (num_heads * seqlen_q, seqlen_q)
        sizes = (num_heads, seqlen_q, seqlen_k, qk_scale, scale, float(dropout_p))
        launch = self.launch_knobs(cfg, "BLOCK_M1", "BLOCK_N1", "bwd_num_warps", "bwd_num_stages")
        maps = []
        if self.block_map_kernel is not None and self.tensor_names:  # made on every call
            plan.dkdv_maps = TensorBlockMap(self, batch, seqlen_q, seqlen_k, cfg["BLOCK_M1"], cfg["BLOCK_N1"], q.device,
                                            rows=False)
        elif self.block_map_kernel is not None:
            maps = self.map_args(*self.block_map(batch, seqlen_q, seqlen_k, cfg["BLOCK_M1"], cfg["BLOCK_N1"],
                                                 q.device)[2:], batch)
        tma = cfg["bwd_tma"] and layout != "thd" and all(tma_ready(t) for t in (q, k, v, do))
        if tma:
            plan.rows = Descriptors(layout, ((launch["BLOCK_M"], self.block_d), (launch["BLOCK_M"], self.block_dv)))
        kv_programs = triton.cdiv(seqlen_k, cfg["BLOCK_N1"])
        if cfg.get("bwd_persistent"):  # about bwd_persistent programs per SM, each walking several key blocks
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
            kv_programs = min(kv_programs, triton.cdiv(cfg["bwd_persistent"] * sms, num_kv_heads * batch))
        dkdv_grid = (kv_programs, num_kv_heads, batch)
        plan.dkdv = BoundLaunch(self.dkdv_kernel, dkdv_grid, dict(
            VARLEN=layout == "thd", ATOMIC_DQ=atomic, DROPOUT=bool(dropout_p), TENSOR_GRADS=bool(tensor_grads),
            TMA=tma, WIDE_ROWS=wide, **launch))
        plan.dkdv_head = (*qkv_strides, *dk_strides, *dv_strides, *dq_strides, *lse_strides, *sizes)
        plan.dkdv_tail = (*maps, total_q, total_k)
        if not atomic:
            launch = self.launch_knobs(cfg, "BLOCK_M2", "BLOCK_N2", "bwd_num_warps", "bwd_num_stages")
            if self.block_map_kernel is not None and self.tensor_names:
                maps, plan.dq_maps = [], TensorBlockMap(self, batch, seqlen_q, seqlen_k, cfg["BLOCK_M2"],
                                                        cfg["BLOCK_N2"], q.device, rows=True)
            elif self.block_map_kernel is not None:
                maps = self.map_args(*self.block_map(batch, seqlen_q, seqlen_k, cfg["BLOCK_M2"], cfg["BLOCK_N2"],
                                                     q.device)[:2], batch)
            # One key: Triton makes seqlen_k == 1 a constant, and ptxas 12.8 (triton 3.6, sm_90a) dies
            # (SIGSEGV) on the dQ kernel with descriptors so specialized; one key block needs no TMA.
            dq_tma = tma and seqlen_k != 1
            if dq_tma:
                plan.tiles = Descriptors(layout, ((launch["BLOCK_N"], self.block_d),
                                                  (launch["BLOCK_N"], self.block_dv)))
            plan.dq = BoundLaunch(self.dq_kernel, (triton.cdiv(seqlen_q, cfg["BLOCK_M2"]), num_heads, batch), dict(
                VARLEN=layout == "thd", DROPOUT=bool(dropout_p), TMA=dq_tma, WIDE_ROWS=wide, **launch))
            plan.dq_head = (*qkv_strides, *dq_strides, *lse_strides, *sizes)
            plan.dq_tail = (*maps, total_q, total_k)
            if cfg.get("bwd_fused_delta"):
                plan.fused_delta = bhsd_strides(out, layout)
        if hopper is not None and cfg.get("hopper_bwd"):
            hopper.serve(plan, q, k, v, do, layout, scale, dropout_p)  # its dK/dV kernel where it serves the call
        return plan

    def short_plan(self, plan, q, k, v, out, do, layout, cfg, batch, seqlen_q, seqlen_k, total_q, total_k, scale,
                   dropout_p, tensor_grads, wide):
        """plan (a BackwardPlan) with its one launch of the bwd_short kernel: program i of each (batch,
        KV head) computes dK/dV of key block i and dQ of query block i, on the dK/dV tiling (BLOCK_M1 x
        BLOCK_N1); pointer loads (the kernel has no descriptors): the other backward knobs are unused. A
        custom expression's kernel reads the mask's block map in both directions at that tiling."""
        launch = self.launch_knobs(cfg, "BLOCK_M1", "BLOCK_N1", "bwd_num_warps", "bwd_num_stages")
        blocks = max(triton.cdiv(seqlen_k, launch["BLOCK_N"]), triton.cdiv(seqlen_q, launch["BLOCK_M"]))
        plan.short = BoundLaunch(self.short_kernel, (blocks, self.num_kv_heads, batch), dict(
            VARLEN=layout == "thd", DROPOUT=bool(dropout_p), TENSOR_GRADS=bool(tensor_grads), WIDE_ROWS=wide,
            **launch))
        grad_strides = (bhsd_order(contiguous_strides(t.shape), layout) for t in (k, v, q))  # dk, dv, dq
        lse_strides = (0, q.shape[0]) if layout == "thd" else (self.num_heads * seqlen_q, seqlen_q)
        plan.short_head = (*bhsd_strides(q, layout), *bhsd_strides(k, layout), *bhsd_strides(v, layout),
                           *bhsd_strides(out, layout), *bhsd_strides(do, layout), *(s for t in grad_strides for s in t),
                           *lse_strides, self.num_heads, seqlen_q, seqlen_k, scale * self.RCP_LN2, scale,
                           float(dropout_p))
        kept_maps = ()
        if self.block_map_kernel is not None and self.tensor_names:  # two maps, made per call (TensorBlockMap)
            by_key, by_query = (TensorBlockMap(self, batch, seqlen_q, seqlen_k, launch["BLOCK_M"], launch["BLOCK_N"],
                                               q.device, rows=rows) for rows in (False, True))
            plan.short_maps = lambda extra: (*by_key(extra), *by_query(extra))
        elif self.block_map_kernel is not None:  # per key block its query blocks, per query block its key blocks
            maps = self.block_map(batch, seqlen_q, seqlen_k, launch["BLOCK_M"], launch["BLOCK_N"], q.device)
            kept_maps = (*self.map_args(*maps[2:], batch), *self.map_args(*maps[:2], batch))
        plan.short_tail = (*kept_maps, total_q, total_k)
        plan.dkdv = plan.short  # there is work to launch (BackwardPlan: no dkdv = zero gradients)
        return plan

    # ------------------------------------------------------------------ dropout (tests)
    def dropout_keep_mask(self, batch, seqlen_q, seqlen_k, seed, dropout_p):
        """For tests only: the (B, H, Sq, Sk) bool keep mask that forward/backward use for this seed."""
        keep = torch.empty((batch, self.num_heads, seqlen_q, seqlen_k), dtype=torch.int8, device=seed.device)
        grid = (triton.cdiv(seqlen_q, 32), triton.cdiv(seqlen_k, 32), batch * self.num_heads)
        with on_device(keep):
            self.keep_mask_kernel[grid](keep, seed, seqlen_q, seqlen_k, float(dropout_p), BLOCK_M=32, BLOCK_N=32)
        return keep.bool()
