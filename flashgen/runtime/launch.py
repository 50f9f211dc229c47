"""Bound kernel launches: Triton's launch path once per specialization, then its launcher directly.

``kernel[grid](*args, **constexprs)`` runs Triton's JITFunction.run on every call: the binder
specializes each argument (38 calls of native_specialize_impl for the forward kernel), the cache
key is computed and looked up, the launch metadata is built, and only then does the compiled
kernel's launcher run. For a small attention call that is most of the host time, and on a slow
host it is longer than the kernel itself. A ``BoundLaunch`` stands for one kernel launched with
one grid and one set of constexprs and launch options: its first call takes Triton's path and
keeps the compiled kernel it returns; every later call hands the arguments straight to that
kernel's launcher, ``CompiledKernel.run(grid0, grid1, grid2, stream, function, packed_metadata,
launch_metadata, enter_hook, exit_hook, *args)``, exactly as JITFunction.run ends (triton 3.5 to
3.9).

The caller's promise: every call of one BoundLaunch passes arguments that Triton specializes the
way it specialized the first call's (tensor dtypes and 16-byte alignment of their pointers;
integers equal to 1, divisible by 16, or past 32 bits; tensor descriptors' dtype and block
shape). The simplest way to keep it is to key BoundLaunch objects by everything those depend on:
host.py keys them by the shapes, strides, dtypes, devices and pointer alignment of every tensor of
a call and its scalar arguments, so each integer argument is the same on every call of one key.
``FLASHGEN_VERIFY_LAUNCH=1`` checks the promise: every direct launch re-runs Triton's binder and
raises if the specialization or the argument list differs from the first call's (for tests).

The normal path is taken instead (and is always correct) when bound launches are off
(``FLASHGEN_BOUND_LAUNCH=0`` or ``BoundLaunch.enabled = False``), when a Triton launch hook is
installed (the hooks read metadata only Triton's path builds), and when the kernel is not a compiled
JITFunction (the CPU interpreter, test doubles).

Every launch runs on its tensors' device, as torch's own ops do, whatever device is current: a
model spread over GPUs in one process (transformers' ``device_map="auto"``) calls its layers on
their own devices while cuda:0 stays current, and Triton launches on the current device. A
BoundLaunch is bound on its tensors' device (its first launch makes that device current), and a
call where another device is current makes that one current for its launch (``on_device``; one
comparison of device indices per launch otherwise).

Below BoundLaunch: the call plans host.py makes (CallPlan, ForwardPlan, BackwardPlan): what one
call of a metadata key allocates and launches, checked and worked out once by its first call.

Using BoundLaunch elsewhere (the decode launcher, say): build one per (kernel, grid, constexprs)
and keep it in a dict keyed by what decides the arguments' specialization, e.g.

    launch = plans.get(key)  # key: shapes, strides, dtypes, alignments, scalars of the call
    if launch is None:
        launch = plans[key] = BoundLaunch(_kernel, grid, dict(BLOCK=64, num_warps=4))
    launch(x, y, n, stride)  # the non-constexpr parameters, in signature order

This file imports nothing from flashgen: `flashgen generate` pastes it, then host.py, verbatim
into standalone modules, so its top-level names must not clash with the kernels' (which start
with an underscore or are upper case) or host.py's.
"""

import contextlib
import os
import sys

import torch
import triton

triton_knobs = triton.knobs  # knobs.runtime holds the launch hooks
triton_driver = triton.runtime.driver  # .active: the driver in use (tests may swap it)


def env_flag(name, default):
    """An on/off environment variable: unset -> default; '', '0', 'false', 'no', 'off' (any case) -> off;
    anything else -> on."""
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() not in ("", "0", "false", "no", "off")


def launch_hooks_set():
    """Whether knobs.runtime.launch_enter_hook or launch_exit_hook has a hook installed: a
    HookChain with hooks in its .calls (triton >= 3.5), or a function where a plain one is set."""
    runtime = triton_knobs.runtime
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter)) or bool(getattr(exit_, "calls", exit_))


def launch_context():
    """(current device, its current stream) for bound launches, or None when launches must take
    Triton's path now: bound launches off, or a launch hook installed."""
    if not BoundLaunch.enabled or launch_hooks_set():
        return None
    active = triton_driver.active
    device = active.get_current_device()
    return device, active.get_current_stream(device)


def tensors_device(args):
    """The index of the CUDA device of the first tensor among args, or None (its first tensor is not on one,
    or it has none)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.get_device() if a.is_cuda else None
    return None


def on_device(t):
    """A context that makes tensor t's CUDA device the current one where another is current (Triton launches
    on the current device, torch's ops on their tensors'), else a null context."""
    if t.is_cuda and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


class BoundLaunch:
    """``kernel[grid](*args, **constexprs)``, bound to Triton's compiled kernel after its first call.

    kernel: a @triton.jit function (anything launched as kernel[grid](...) works, on the normal
    path). grid: up to three ints. constexprs: the kernel's tl.constexpr parameters by name, and
    launch options (num_warps, num_stages, ...). Call the BoundLaunch with the kernel's other
    parameters, positionally and in signature order; it returns what the launch returned (the
    CompiledKernel on a GPU). See the module docstring for the promise its caller keeps.

    Thread safety: two threads that make the first call together both take Triton's path and bind
    the same compiled kernel; later calls only read.
    """

    __slots__ = ("kernel", "grid", "grid3", "constexprs", "compiled", "device", "tail", "specialization", "family",
                 "raw")

    enabled = env_flag("FLASHGEN_BOUND_LAUNCH", True)  # False: always Triton's path
    verify = env_flag("FLASHGEN_VERIFY_LAUNCH", False)  # True: check each direct launch against the binder
    # (kernel, constexprs, device, argument_signature) -> the CompiledKernel a BoundLaunch bound: a
    # new BoundLaunch whose first arguments have a signature seen before (a call plan for a new
    # sequence length: generation makes one per step) binds it without Triton's path.
    shared = {}
    MAX_SHARED = 1024

    def __init__(self, kernel, grid, constexprs):
        self.kernel = kernel
        self.grid = tuple(grid)
        self.grid3 = (*grid, 1, 1)[:3]  # as the launcher takes it
        self.constexprs = dict(constexprs)
        self.compiled = None  # the CompiledKernel, once bound
        self.device = None  # the device it was bound on
        self.tail = ()  # the parameters after the positional ones (constexprs, defaults), in signature order
        self.specialization = None  # Triton's specialization of the first call (kept when verifying)
        self.family = None  # (kernel, constexprs) for BoundLaunch.shared; None: not a compiled JITFunction
        self.raw = None  # RawLaunch of the bound kernel, False where its launcher has none (None: not asked yet)
        if hasattr(kernel, "device_caches"):
            try:
                self.family = (kernel, tuple(sorted(self.constexprs.items())))
                hash(self.family)
            except TypeError:  # an unhashable constexpr value: no sharing
                self.family = None

    def __call__(self, *args):
        if self.compiled is None and self.family is None:  # the interpreter, test doubles: Triton's path
            return self.launch(args)
        return self.run(launch_context(), args)

    def bindable(self):
        """Whether this launch is or can be bound (else launch_context() is not needed: Triton's path)."""
        return self.compiled is not None or self.family is not None

    def run(self, context, args):
        """Launch with `context`, launch_context()'s answer taken once for all the launches of one
        call (a call plan's two to four): the device and stream to launch on, or None for Triton's path."""
        compiled = self.compiled
        if context is not None:
            device = self.device if compiled is not None else tensors_device(args)
            if device is not None and device != context[0]:  # another device is current: launch on the tensors'
                with torch.cuda.device(device):
                    return self.run(launch_context(), args)
            if compiled is None and self.family is not None:
                compiled = self.adopt(args)
        if compiled is None or context is None:
            return self.launch(args)
        if BoundLaunch.verify:
            self.check(args, context[0])
        raw = self.raw
        if raw is None:
            raw = self.raw = RawLaunch.of(compiled, self.grid3, len(args)) or False
        if raw:
            raw(context[1], args, self.tail)
            return compiled
        grid0, grid1, grid2 = self.grid3
        compiled.run(grid0, grid1, grid2, context[1], compiled.function, compiled.packed_metadata, None, None, None,
                     *args, *self.tail)
        return compiled

    def launch(self, args):
        """Triton's own path, on the tensors' device; binds the compiled kernel it returns on the first call."""
        device = tensors_device(args)
        if device is not None and device != triton_driver.active.get_current_device():
            with torch.cuda.device(device):
                return self.launch(args)
        result = self.kernel[self.grid](*args, **self.constexprs)
        if (self.compiled is None and BoundLaunch.enabled and hasattr(result, "packed_metadata")
                and hasattr(self.kernel, "device_caches")):
            self.bind(result, args)
            key = self.shared_key(args)
            if key is not None:
                if len(BoundLaunch.shared) >= BoundLaunch.MAX_SHARED:
                    BoundLaunch.shared.clear()
                BoundLaunch.shared[key] = (result, self.tail, self.specialization)
        return result

    def adopt(self, args):
        """The compiled kernel another BoundLaunch of this kernel and constexprs bound for arguments
        Triton specializes as it would these (bound here, no Triton path), or None."""
        key = self.shared_key(args)
        found = BoundLaunch.shared.get(key) if key is not None else None
        if found is None:
            return None
        compiled, tail, specialization = found
        device = key[2]
        if BoundLaunch.verify:
            mine = self.binding(args, device)[1]
            if specialization is not None and mine != specialization:
                raise AssertionError(f"{getattr(self.kernel, '__name__', self.kernel)}: argument_signature gave two "
                                     f"launches one key that Triton specializes otherwise ({mine} vs "
                                     f"{specialization})")
            self.specialization = mine
        self.tail, self.device, self.compiled = tail, device, compiled
        return compiled

    def shared_key(self, args):
        """This launch's key in BoundLaunch.shared, or None when an argument is of a kind whose
        specialization argument_signature does not know (tensor descriptors, ...)."""
        signature = argument_signature(args)
        if signature is None or self.family is None:
            return None
        return (*self.family, triton_driver.active.get_current_device(), signature)

    def bind(self, compiled, args):
        params = self.kernel.signature.parameters
        names = list(params)[len(args):]
        self.tail = tuple(self.constexprs[name] if name in self.constexprs else params[name].default
                          for name in names)
        self.device = triton_driver.active.get_current_device()
        if BoundLaunch.verify:
            self.specialization = self.binding(args, self.device)[1]
        self.compiled = compiled

    def binding(self, args, device):
        """(every argument in signature order, Triton's specialization of them), from Triton's binder."""
        binder = self.kernel.device_caches[device][-1]
        bound, specialization, _ = binder(*args, **self.constexprs)
        return tuple(bound.values()), specialization

    def check(self, args, device):
        """Raise unless Triton would launch these arguments as bound (FLASHGEN_VERIFY_LAUNCH=1)."""
        values, specialization = self.binding(args, device)
        ours = (*args, *self.tail)
        if self.specialization is None:  # bound before verification was turned on
            self.specialization = specialization
        same_args = len(values) == len(ours) and all(a is b for a, b in zip(values, ours))
        if specialization != self.specialization or not same_args:
            raise AssertionError(f"{getattr(self.kernel, '__name__', self.kernel)}: a bound launch got arguments that "
                                 f"Triton specializes otherwise ({specialization} vs {self.specialization}) or "
                                 "orders otherwise; its caller's key misses something")


class RawLaunch:
    """A bound kernel's launch without the Python layers of Triton's launcher, where that launcher is
    triton 3.6's (the GPU image's): ``CudaLauncher.__call__`` sizes scratch buffers (none for flashgen's
    kernels: RawLaunch is not made for one that has any), then its ``launch`` turns each tensor
    descriptor argument into a CUtensorMap (``make_tensordesc_arg``: cuTensorMapEncodeTiled, ~2-3 us
    a descriptor) in a loop over every argument, and calls the compiled C launcher. A RawLaunch
    calls that C launcher itself with the same arguments, each descriptor's expansion kept by its
    base pointer: the rest of it (shape, strides, block, swizzle) is the same on every call of one
    BoundLaunch (its caller's key says so; FLASHGEN_VERIFY_LAUNCH=1 checks it). The Gluon forward's
    launch: 15-20 us -> 8.4-8.7 us on an H200 host (benchmarks/NOTES.md, session 27). Its tensors
    go as their addresses (addressed()): a small forward's 12 tensors, ~1 us of an H200 host's call
    (benchmarks/probe_launch_addresses.py). Other launchers
    (triton 3.7+, whose tensor descriptors pass otherwise) keep Triton's path: RawLaunch.of gives None."""

    __slots__ = ("launch", "grid", "middle", "slots", "metas", "make", "expanded", "pointers")
    TRITON = "3.6."  # the Triton whose launcher this mirrors (its argument order is not checked, only its shape)
    BASE_ARGS = 13  # triton 3.6's _BASE_ARGS_FORMAT "iiiKKppOOOOOO": grid, stream, function, 2 flags, 6 objects
    MAX_KEPT = 16  # expansions kept per descriptor argument (a training step's tensors cycle through a few)
    addresses = True  # tensors passed to the C launcher as their addresses (addressed())

    @classmethod
    def of(cls, compiled, grid3, positional):
        """The RawLaunch of a compiled kernel launched with `positional` arguments before its bound
        tail, or None where its launcher is not triton 3.6's."""
        launcher = getattr(compiled, "_run", None)
        if (not triton.__version__.startswith(cls.TRITON) or type(launcher).__name__ != "CudaLauncher"
                or getattr(launcher, "global_scratch_size", 1) != 0 or getattr(launcher, "profile_scratch_size", 1) != 0):
            return None
        driver = getattr(type(launcher).__call__, "__globals__", {})  # the namespace of its driver module
        if driver.get("_BASE_ARGS_FORMAT_LEN") != cls.BASE_ARGS:
            return None
        launch = getattr(launcher, "launch", None)
        code = getattr(launch, "__code__", None)
        if code is None:  # no descriptor: the C launcher itself (a builtin)
            return cls(launch, grid3, compiled, launcher, (), (), None)
        cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in launch.__closure__ or ())))
        make = launch.__globals__.get("make_tensordesc_arg")  # the function the wrapper calls
        if set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"} or make is None:
            return None
        slots = tuple(sorted(cells["tensordesc_indices"]))
        metas = tuple(cells["tensordesc_meta"] or (None,) * len(slots))
        if len(metas) != len(slots) or any(slot >= positional for slot in slots):
            return None
        return cls(cells["launcher"], grid3, compiled, launcher, slots, metas, make)

    def __init__(self, launch, grid3, compiled, launcher, slots, metas, make):
        self.launch, self.grid = launch, tuple(grid3)
        self.middle = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                       compiled.packed_metadata, None, None, None)
        self.slots, self.metas, self.make = slots, metas, make
        self.expanded = [{} for _ in slots]  # per descriptor argument: base pointer -> its expansion
        self.pointers = None  # the positions of the tensor arguments, from the first call

    def __call__(self, stream, args, tail):
        if self.addresses:
            args = self.addressed(args)
        if not self.slots:
            return self.launch(*self.grid, stream, *self.middle, *args, *tail)
        flat, start = [], 0
        for n, slot in enumerate(self.slots):
            flat += args[start:slot]
            flat += self.expansion(n, args[slot])
            start = slot + 1
        return self.launch(*self.grid, stream, *self.middle, *flat, *args[start:], *tail)

    def addressed(self, args):
        """args with each tensor given as its address. 3.6's C launcher takes an int pointer as it is; for a
        tensor it calls data_ptr() and asks the driver whether the address is device memory
        (cuPointerGetAttribute). A RawLaunch's tensors are on its device: the call's checks put them there
        (a CPU tensor never reaches a bound launch). The tensors sit where the first call's did (its caller's
        key holds every argument's kind); a call whose do not is passed as given."""
        pointers = self.pointers
        if pointers is None:
            pointers = self.pointers = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        args = list(args)
        try:
            for i in pointers:
                args[i] = args[i].data_ptr()
        except AttributeError:  # not a tensor there this time: it and those after it go as given
            pass
        return args

    def expansion(self, n, descriptor):
        """The C launcher's arguments for descriptor argument n: kept by its base pointer where they hold a
        tensor map (without one they hold the tensor itself, and cost nothing to make)."""
        meta = self.metas[n]
        if meta is None:
            return self.make(descriptor, meta)
        kept = self.expanded[n]
        ptr = descriptor.base.data_ptr()
        expansion = kept.get(ptr)
        if expansion is None or BoundLaunch.verify:
            fresh = self.make(descriptor, meta)
            if expansion is not None and list(expansion[1:]) != list(fresh[1:]):
                raise AssertionError(f"RawLaunch: descriptor argument {self.slots[n]} changed shape or strides "
                                     f"between calls of one bound launch ({expansion[1:]} vs {fresh[1:]})")
            if len(kept) >= self.MAX_KEPT:
                kept.clear()
            expansion = kept[ptr] = fresh
        return expansion


def argument_signature(args):
    """What Triton may specialize a launch on, of each argument, or None for an argument of another
    kind: a tensor's dtype and 16-byte alignment; an int's being 1, its divisibility by 16 and its
    width (i32, i64, u64); a bool's or None's value; a float's type (floats are not specialized).
    A superset of the binder's specialization (triton 3.5 to 3.9), so equal signatures get one
    compiled kernel; FLASHGEN_VERIFY_LAUNCH checks it on every launch of a BoundLaunch that used it.
    (Dispatch on the exact type first: this runs once per new call plan, over ~40 arguments.)"""
    signature = []
    append = signature.append
    for a in args:
        kind = type(a)
        if kind is int:  # 1, or (divisible by 16, fits i32, needs u64)
            append(1 if a == 1 else (a & 15 == 0, -2147483648 <= a <= 2147483647, a >= 9223372036854775808))
        elif kind is torch.Tensor or isinstance(a, torch.Tensor):
            append((a.dtype, a.data_ptr() & 15 == 0))
        elif a is None:
            append(None)
        elif kind is bool:  # (bool, value): True must not equal an int's 1
            append((bool, a))
        elif kind is float:
            append(float)
        else:
            return None
    return tuple(signature)


def contiguous_strides(shape):
    """The strides torch.empty(shape) has."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def allocator(shape, dtype, device):
    """A function that allocates an uninitialized contiguous tensor of this shape, dtype and device:
    torch.empty_like of a 0-d tensor expanded to the shape (one argument to parse: ~4 us of the H100
    host per call against ~10 us for torch.empty(shape, dtype=, device=); bench_call_path --diagnose).
    empty_like gives an overlapping input (a zero stride over a dim of 2 or more elements) contiguous
    strides; of one element or none it would keep the zero strides, so those take torch.empty."""
    if torch.Size(shape).numel() > 1:
        base = TEMPLATE_BASES.get((dtype, device))
        if base is None:
            if capturing(device):  # (kept, it would hold a graph's memory; allocators made now are the graph's)
                return lambda: torch.empty(shape, dtype=dtype, device=device)
            base = TEMPLATE_BASES[(dtype, device)] = torch.empty((), dtype=dtype, device=device)
        template = base.expand(shape)
        return lambda: torch.empty_like(template)
    return lambda: torch.empty(shape, dtype=dtype, device=device)


TEMPLATE_BASES = {}  # (dtype, device) -> the 0-d tensor allocator() expands (never read or written)


def overlapping(t):
    """Whether two elements of t may share memory (a zero stride over a dim of 2 or more elements,
    or strides that interleave): sorted by stride, each stride must pass the reach of the ones below."""
    reach = 0
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def shares_memory(a, b) -> bool:
    """Whether tensors a and b may share memory: their byte ranges on one device intersect. Interleaved views
    of one buffer whose elements differ read as sharing too (a caller's out= there is refused, not guessed)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    start_a, start_b = a.data_ptr(), b.data_ptr()
    end_a = start_a + element_span(a.shape, a.stride()) * a.element_size()
    end_b = start_b + element_span(b.shape, b.stride()) * b.element_size()
    return start_a < end_b and start_b < end_a


def element_span(shape, stride) -> int:
    """The elements from a view's first to its last, its strides over its shape (one past the last's offset)."""
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride))


def check_outputs_apart(outputs, inputs):
    """Refuse an output buffer (name, tensor or None) that shares memory with an input the kernels read
    (name, tensor or None): other programs would read what one has already written."""
    written = []
    for out_name, out in outputs:
        if not isinstance(out, torch.Tensor):  # None: allocated; not a tensor: the call's checks name it
            continue
        for name, t in inputs:
            if isinstance(t, torch.Tensor) and shares_memory(out, t):
                raise ValueError(f"{out_name}: expected a buffer apart from {name}, got one sharing its memory "
                                 f"(the kernels read {name} while they write {out_name}; pass a separate tensor)")
        for name, t in written:  # (out and lse over one memory: each store overwrote the other's)
            if shares_memory(out, t):
                raise ValueError(f"{out_name}: expected a buffer apart from {name}, got one sharing its memory "
                                 f"(the kernels write both; pass a separate tensor)")
        written.append((out_name, out))


def gradient_buffer(shape, stride, device):
    """float32 zeros with these strides, over the memory they span: the buffer of a named tensor's
    gradient, which the kernels add into through the tensor's own strides (a transposed or sliced
    tensor's lands at each element's place). Never for an overlapping tensor (its elements' sums
    would show at every element that shares the memory)."""
    if stride == contiguous_strides(shape):
        return torch.zeros(shape, dtype=torch.float32, device=device)
    return torch.zeros(element_span(shape, stride), dtype=torch.float32, device=device).as_strided(shape, stride)


def check_tensor(name, t, what="a torch.Tensor"):
    """Refuse, naming it, an argument that is not a dense torch.Tensor: not a tensor (TypeError), or a sparse or
    nested one, whose strides and data pointer the launches read and these tensors have not (ValueError)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected {what}, got {type(t).__name__}")
    if t.is_nested or t.layout != torch.strided:
        raise ValueError(f"{name}: expected a dense (strided) tensor, got "
                         f"{'a nested tensor' if t.is_nested else f'layout {t.layout}'}")


def check_data(name, t):
    """Refuse a meta tensor (a shape without memory), naming it: the kernels and the bounds checks read memory."""
    if t.device.type == "meta":
        raise ValueError(f"{name}: expected a tensor with data, got a meta tensor")


def capturing(device) -> bool:
    """Whether a CUDA graph is being captured on `device`'s current stream. A buffer a captured launch reads or
    writes must then be the graph's own (allocated during capture: its memory pool keeps it for the replays),
    not one a plan or launcher keeps and may drop (a plan evicted from a full table, a table grown), whose
    memory replays would then read or write after it was freed. torch answers for the current device; a call
    on another device's tensors (launched there) asks for its own where the current one captures. (A capture
    on `device` while another device is current is not seen: torch.cuda.graph makes its stream's device
    current, and a call inside it would have to change the device back.) Also True while inductor's CUDA graph
    trees warm a graph up (graph_tree_warmup): what a call makes then is the graph pool's too."""
    if device.type != "cuda":
        return False
    if not torch.cuda.is_current_stream_capturing():
        return graph_tree_warmup(device)
    if device.index is None or device.index == torch.cuda.current_device():
        return True
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def graph_tree_warmup(device) -> bool:
    """Whether inductor's CUDA graph trees (torch.compile's mode="reduce-overhead", transformers' compiled
    generation) run a compiled graph uncaptured on `device` now: its first calls (warmup) run eagerly on the
    trees' own stream with every allocation in the graphs' memory pool, and a tensor that outlives the call
    there, but for the graph's outputs, fails the trees' check ("Detected ... tensor(s) in the cudagraph pool
    not tracked as outputs"), so such a call keeps nothing either (as a captured one). Reads the trees' state
    without creating any (their accessors make per-thread state, and assert in a thread torch did not start)."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None or device.type != "cuda":  # (never imported: no graph tree in this process)
        return False
    try:
        containers = getattr(trees.local, "tree_manager_containers", None)
        if containers is None:  # (this thread's trees are in torch's thread state, if anywhere)
            if not torch._C._is_key_in_tls("tree_manager_containers"):
                return False
            containers = torch._C._get_obj_in_tls("tree_manager_containers")
        index = device.index if device.index is not None else torch.cuda.current_device()
        manager = getattr(containers.get(index), "tree_manager", None)
        return manager is not None and torch.cuda.current_stream(index) == manager.stream
    except Exception:  # noqa: BLE001 - another torch's internals, or no CUDA: no tree found
        return False


def tensor_key(t):
    """What a call plan depends on of a tensor argument (None: not given): all but its contents."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15


class CallPlan:
    """What one call of a metadata key runs, worked out and checked by its first call
    (AttentionLauncher.forward_plan/backward_plan); what every call of the key shares."""

    def __init__(self, launcher, layout, device, *, seed, offsets):
        self.launcher, self.layout, self.device = launcher, layout, device
        self.seed = seed  # the seed tensor the kernels get when dropout is off (never read), else None
        self.offsets = offsets  # packed sequences: (total_q, total_k, max_seqlen_q, max_seqlen_k)
        self.no_offsets = launcher.unused_arg(torch.int32, device)  # never read by dense calls
        self.named = bool(launcher.tensor_names)
        self.dense = seed is not None and offsets is None  # no dropout, no packed sequences
        self.plain = self.dense and not self.named  # nothing per call but the launch

    def seed_arg(self, seed):
        return seed if self.seed is None else self.seed

    @staticmethod
    def with_maps(maps, tail, extra):
        """A kernel's arguments after the named tensors': tail, after the block map made for this call by
        maps (host.TensorBlockMap, a mask over the tensors whose kernel arguments are extra) where given."""
        return tail if maps is None else (*maps(extra), *tail)

    def tensor_extra(self, tensors, runs=None):
        """The kernel arguments of the named tensors a call passes (a mask's document ids, ...); runs: how
        their runs tables are made (host.AttentionLauncher.tensor_args; None: filled for this call)."""
        return self.launcher.tensor_args(self.launcher.tensor_views(tensors), runs) if self.named else ()

    def offset_args(self, cu_seqlens_q, cu_seqlens_k, checked=False):
        """The kernels' cu_seqlens arguments; packed offsets are checked on every call (checked:
        by the forward of the same step, on these very tensors)."""
        if self.offsets is None:
            return self.no_offsets, self.no_offsets
        if not checked:
            self.launcher.check_offsets(cu_seqlens_q, cu_seqlens_k, *self.offsets)
        return cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()


class ForwardPlan(CallPlan):
    """A forward call: out and lse allocated, one launch (none when there is nothing to compute)."""

    def __init__(self, launcher, layout, q, o_shape, lse_shape, *, seed, offsets):
        super().__init__(launcher, layout, q.device, seed=seed, offsets=offsets)
        self.dtype, self.o_shape, self.lse_shape = launcher.out_dtype, o_shape, lse_shape
        self.new_out, self.new_lse = allocator(o_shape, self.dtype, self.device), allocator(lse_shape, torch.float32,
                                                                                           self.device)
        self.zero_fill = False  # packed sequences without keys: out 0, lse -inf
        self.launch = None  # a BoundLaunch of the forward kernel
        self.head = self.tail = ()  # the kernel's arguments before and after the named tensors'
        self.maps = None  # a mask over named tensors: the TensorBlockMap whose arguments precede tail
        self.descriptors = None  # Q-outer with TMA: Descriptors of q, k, v, out
        self.buffers = None  # KV-outer: the (rows, BLOCK_DV) shape of its float32 accumulator
        self.softmax_scale = self.dropout_p = None  # the call's scalars (set by forward_plan)
        self.backward_plans = {}  # (dO's tensor_key, deterministic, tensor_grads) -> BackwardPlan of this forward
        self.direct = False  # plain, one pointer-load launch of the Q-outer kernel (set by forward_plan)
        self._unread_lse = None  # unread_lse()'s buffer

    def unread_lse(self):
        """The LSE buffer of calls whose LSE nothing reads (no gradient recorded, return_lse off: api's fast
        path): one per plan, which each such call's kernel writes, so such a call allocates its output only;
        while a CUDA graph is captured, one of the graph's own (capturing)."""
        if capturing(self.device):
            return self.new_lse()
        if self._unread_lse is None:
            self._unread_lse = self.new_lse()
        return self._unread_lse

    def training_call(self, q, k, v, seed, tensors, cu_seqlens_q, cu_seqlens_k):
        """(out, lse, extra) of a training step's forward (host.AttentionLauncher.training_forward): extra, the
        named tensors' arguments it launched with (None without named tensors), runs tables of document ids
        among them, which the step's backward reuses."""
        extra = self.tensor_extra(tensors) if tensors else None
        out, lse = self(q, k, v, None, None, seed, tensors, cu_seqlens_q, cu_seqlens_k, extra=extra)
        return out, lse, extra

    def __call__(self, q, k, v, out, lse, seed, tensors, cu_seqlens_q, cu_seqlens_k, fp8_args=(), *, head=None,
                 launch=None, extra=None):
        """head, launch: the kernel's leading scalars and the bound launch for this call in place of the
        plan's (a decode-shaped call of another key length: AttentionLauncher.decode_call); extra: the
        named tensors' arguments, tensor_extra(tensors), where the caller made them."""
        if out is None:
            out = self.new_out()
        if lse is None:
            lse = self.new_lse()
        if self.direct:  # the commonest call: nothing to prepare but the arguments
            no_offsets = self.no_offsets
            (launch or self.launch)(q, k, v, out, lse, self.seed, no_offsets, no_offsets, q, k, v, out,
                                    *(self.head if head is None else head), *self.tail)
            return out, lse
        if self.launch is None:
            if self.zero_fill:  # packed sequences without queries or keys (their offsets checked all the same)
                self.offset_args(cu_seqlens_q, cu_seqlens_k)
                out.zero_(), lse.fill_(float("-inf"))
            return out, lse
        cu_q, cu_k = self.offset_args(cu_seqlens_q, cu_seqlens_k)
        seed = self.seed_arg(seed)
        if extra is None:
            extra = self.tensor_extra(tensors)
        if self.buffers is not None:  # KV-outer: O, m and l round-trip through memory
            rows, block_dv = self.buffers
            acc = torch.zeros((rows, block_dv), dtype=torch.float32, device=self.device)
            m = torch.full((rows,), float("-inf"), dtype=torch.float32, device=self.device)
            l = torch.zeros((rows,), dtype=torch.float32, device=self.device)  # noqa: E741
            self.launch(q, k, v, out, lse, seed, cu_q, cu_k, acc, m, l, *self.head, *extra,
                        *self.with_maps(self.maps, self.tail, extra))
        else:
            tiles = (q, k, v, out) if self.descriptors is None else self.descriptors(q, k, v, out)
            (launch or self.launch)(q, k, v, out, lse, seed, cu_q, cu_k, *tiles, *(self.head if head is None else head),
                                    *extra, *self.with_maps(self.maps, self.tail, extra), *fp8_args)
        return out, lse


class BackwardPlan(CallPlan):
    """A backward call: dq, dk, dv allocated; the preprocess, dK/dV and dQ launches (none when there
    is nothing to compute: zero gradients)."""

    def __init__(self, launcher, layout, q, k, v, lse, *, seed, offsets, grads, scratch=None):
        super().__init__(launcher, layout, q.device, seed=seed, offsets=offsets)
        self.dtype, self.shapes, self.lse_shape = q.dtype, (q.shape, k.shape, v.shape), lse.shape
        self.grads = grads  # {name: (shape, strides)} of the named tensors differentiated (gradient_buffer's)
        # {name: (shape, strides)} of the float tensors the score_mod reads that a call differentiating others does
        # not: the kernels add dS * d(mod)/d(tensor) into every one's buffer then, so these get a scratch buffer
        self.scratch = scratch or {}
        self.plain = self.plain and not grads
        self.new_dq, self.new_dk, self.new_dv = (allocator(shape, self.dtype, self.device)
                                                 for shape in (q.shape, k.shape, v.shape))
        self.new_delta = allocator(lse.shape, torch.float32, self.device)
        self.preprocess = self.dkdv = self.dq = None  # BoundLaunch of each kernel (dq: None when atomic)
        self.preprocess_args = self.dkdv_head = self.dkdv_tail = self.dq_head = self.dq_tail = ()
        self.dkdv_maps = self.dq_maps = None  # a mask over named tensors: each kernel's TensorBlockMap
        self.atomic = False  # dQ accumulated by the dK/dV kernel into a float32 buffer
        self.rows = self.tiles = None  # with TMA: Descriptors of (q, do) for dK/dV and of (k, v) for dQ
        self.fused_delta = None  # bwd_fused_delta: out's strides; the dQ kernel computes delta and runs first
        self.short = None  # bwd_short: a BoundLaunch of the one-launch backward (no other launch then)
        self.short_head = self.short_tail = ()
        self.short_maps = None  # its block maps made per call (a mask over named tensors): extra -> map arguments

    def __call__(self, do, q, k, v, out, lse, seed, tensors, cu_seqlens_q, cu_seqlens_k, offsets_checked=False,
                 extra=None):
        """extra: the named tensors' arguments its forward launched with (AttentionLauncher.training_forward),
        else made here."""
        if self.plain and self.short is not None:  # dense, no dropout, no named tensors: one launch
            dq, dk, dv = self.gradient_buffers()
            no_offsets = self.no_offsets
            self.short(q, k, v, out, do, lse, dk, dv, dq, self.seed, no_offsets, no_offsets, *self.short_head,
                       *self.short_tail)
            return dq, dk, dv, {}
        device, q_shape = self.device, self.shapes[0]
        grads = {name: gradient_buffer(*layout, device) for name, layout in self.grads.items()} if self.grads else None
        dq, dk, dv = self.gradient_buffers()
        if self.dkdv is None:
            self.offset_args(cu_seqlens_q, cu_seqlens_k, offsets_checked)
            dq.zero_(), dk.zero_(), dv.zero_()
            return self.result(dq, dk, dv, grads, tensors)
        cu_q, cu_k = self.offset_args(cu_seqlens_q, cu_seqlens_k, offsets_checked)
        seed = self.seed_arg(seed)
        if self.layout == "thd":
            dk.zero_(), dv.zero_()  # keys no query block reaches keep 0
        extra, grad_args = self.named_args(tensors, grads, extra)
        if self.short is not None:
            self.short(q, k, v, out, do, lse, dk, dv, dq, seed, cu_q, cu_k, *self.short_head, *extra, *grad_args,
                       *self.with_maps(self.short_maps, self.short_tail, extra))
            return self.result(dq, dk, dv, grads, tensors)
        delta = self.new_delta()
        context = launch_context() if self.dkdv.bindable() else None  # once for the step's three launches
        if self.fused_delta is None:
            self.preprocess.run(context, (out, do, delta, *self.preprocess_args))
        dq_acc = torch.zeros(q_shape, dtype=torch.float32, device=device) if self.atomic else dq
        if self.fused_delta is not None:  # delta from the dQ kernel, before dK/dV reads it
            tiles = (k, v) if self.tiles is None else self.tiles(k, v)
            self.dq.run(context, (q, k, v, do, lse, delta, dq, seed, cu_q, cu_k, *tiles, *self.dq_head, *extra,
                                  *self.with_maps(self.dq_maps, self.dq_tail, extra), out, *self.fused_delta))
        rows = (q, do) if self.rows is None else self.rows(q, do)
        self.dkdv.run(context, (q, k, v, do, lse, delta, dk, dv, dq_acc, seed, cu_q, cu_k, *rows, *self.dkdv_head,
                                *extra, *grad_args, *self.with_maps(self.dkdv_maps, self.dkdv_tail, extra)))
        if self.atomic:
            dq.copy_(dq_acc)
        elif self.fused_delta is None:
            tiles = (k, v) if self.tiles is None else self.tiles(k, v)
            self.dq.run(context, (q, k, v, do, lse, delta, dq, seed, cu_q, cu_k, *tiles, *self.dq_head, *extra,
                                  *self.with_maps(self.dq_maps, self.dq_tail, extra)))
        return self.result(dq, dk, dv, grads, tensors)

    def gradient_buffers(self):
        """Uninitialized contiguous dq, dk, dv, each its own allocation (three torch.empty_like of
        templates: 12.4 us of the H100 host, against 17.2 / 12.8 for the views of one (3, ...)
        allocation this used before and 30.2 for three torch.empty(shape, dtype=, device=);
        bench_call_path --diagnose, S=128 / 512)."""
        return self.new_dq(), self.new_dk(), self.new_dv()

    def named_args(self, tensors, grads, extra=None):
        """The kernels' arguments for the named tensors (extra where given), and for the gradient buffers
        of the float ones: where no gradient is wanted (grads None), the tensor itself (never written:
        TENSOR_GRADS off); where some are, a scratch buffer for each of the others (the kernels write
        every float tensor's buffer)."""
        if not self.named:
            return (), ()
        grad_tensors = self.launcher.grad_tensors
        if extra is not None and not grad_tensors:  # (a mask's tensors only: the forward's arguments serve)
            return extra, []
        named = self.launcher.tensor_views(tensors)
        if grads and self.scratch:
            grads = {**{name: gradient_buffer(*layout, self.device) for name, layout in self.scratch.items()},
                     **grads}
        return (self.launcher.tensor_args(named) if extra is None else extra,
                [(grads or {}).get(name, named[name]) for name in grad_tensors])

    @staticmethod
    def result(dq, dk, dv, grads, tensors):
        """(dq, dk, dv, {name: gradient in the named tensor's own shape})."""
        return dq, dk, dv, {name: g.reshape(tensors[name].shape) for name, g in grads.items()} if grads else {}
