"""Triton's CPU interpreter, made to patch triton.language once per launch.

The interpreter re-patches triton.language (inspect.getmembers over four modules) on every call of
a jit function from a running kernel, though the launch patched those modules already and restores
them when it ends. flashgen's kernels call many small helpers, so a third of their interpreted time
went there (tests/test_backward.py's slowest case: 13.8 s, 8.4 with this; the CPU suite 1011 -> 788
s). Within a launch, a function whose module globals were patched already is not patched again; one
from another module (triton.language.standard's zeros, reading tl.core) still is, as Triton does it.
Applied at import under TRITON_INTERPRET (flashgen/__init__.py), only where the interpreter's
internals are the ones this knows; Triton's own behaviour otherwise.

Also: Triton 3.6's interpreter reads a scalar as a Python int by int() of its one-element 1-d array,
which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"), so every
`range(0, seqlen_k, BLOCK_N)` over a kernel argument failed there; Triton 3.9 squeezes it first.
`index_scalars_as_newer_triton` makes 3.6 do the same.

And: the interpreter's options ask for integer-overflow sanitizing but not debug, so every 32-bit integer add,
sub and mul of a kernel was computed a second time in 64 bits and compared with the type's bounds for a
device_assert that semantic.device_assert drops without debug (as compiled kernels drop it). Nothing read
those results: `skip_discarded_overflow_checks` turns the sanitizing off where debug is off (tests/test_backward.py's
slowest case: 40 % of its interpreted time). `numpy_dtypes_once` keeps the interpreter's Triton-to-NumPy dtype
table instead of building it (twenty NumPy dtypes) on every lookup, a hundred thousand per test.

Standalone modules (`flashgen generate`) carry this file verbatim and call `patch_interpreter` where
they run interpreted, as `import flashgen` does.
"""


def patch_interpreter() -> None:
    """Both patches below, where Triton's interpreter runs the kernels (each a no-op where it is not the
    interpreter it knows)."""
    patch_language_once_per_launch()
    index_scalars_as_newer_triton()
    skip_discarded_overflow_checks()
    numpy_dtypes_once()


def skip_discarded_overflow_checks() -> bool:
    """Turn the interpreter's integer-overflow sanitizing off where its debug is off (the checks' assert is
    dropped then: their arithmetic was computed and thrown away); False where this Triton's interpreter has no
    such options."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not hasattr(options, "__dict__") or not hasattr(options, "sanitize_overflow") or getattr(options, "debug", True):
        return False
    if options.sanitize_overflow:  # (InterpreterOptions: a frozen dataclass, made again with the one field changed)
        builder.options = type(options)(**dict(vars(options), sanitize_overflow=False))
    return True


def patch_language_once_per_launch() -> bool:
    """Install the wrapper (once); False where this Triton's interpreter is not the one it knows."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is None or not hasattr(interpreter, "GridExecutor"):
        return False
    if getattr(patch_lang, "once_per_launch", False):
        return True
    launches: list[set] = []  # per running launch: the ids of the globals whose language modules are patched

    class Patched:
        def restore(self):
            pass

    def once_per_launch(fn):
        key = id(fn.__globals__)
        if launches:  # a call from inside a kernel
            if key in launches[-1]:
                return Patched()
            launches[-1].add(key)
            return patch_lang(fn)
        scope = patch_lang(fn)  # a launch: GridExecutor restores its scope when the grid has run
        launches.append({key})
        restore = scope.restore

        def restore_and_end():
            launches.pop()
            restore()

        scope.restore = restore_and_end
        return scope

    once_per_launch.once_per_launch = True
    interpreter._patch_lang = once_per_launch
    return True


def index_scalars_as_newer_triton() -> bool:
    """Make the interpreter's tensor.__index__ squeeze the scalar's array before int() (Triton
    3.9's form), once; False where this Triton's interpreter has no _patch_lang_tensor to wrap."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None:
        return False
    if getattr(patch_tensor, "squeezes_scalars", False):
        return True

    def squeezing(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))  # restored with the rest

    squeezing.squeezes_scalars = True
    interpreter._patch_lang_tensor = squeezing
    return True


def numpy_dtypes_once() -> bool:
    """Make the interpreter's _get_np_dtype look each Triton dtype up once (its answer for a dtype never
    changes: a pointer, or a block of them, is uint64; a block is its element's); False where it has none."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    lookup = getattr(interpreter, "_get_np_dtype", None)
    tl = getattr(interpreter, "tl", None)
    if lookup is None or tl is None:
        return False
    if getattr(lookup, "once", False):
        return True
    known, block, pointer = {}, tl.block_type, tl.pointer_type

    def once(tt_dtype):
        if isinstance(tt_dtype, block):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, pointer):
            return lookup(tt_dtype)
        found = known.get(tt_dtype)
        if found is None:
            found = known[tt_dtype] = lookup(tt_dtype)
        return found

    once.once = True
    interpreter._get_np_dtype = once
    return True
