"""flashgen: attention specs compiled into tuned Triton kernels."""

__version__ = "0.1.0"

from typing import TYPE_CHECKING as _TYPE_CHECKING  # noqa: E402

from .spec import AttentionSpec, SpecError, TuneSpec  # noqa: E402
from .config import KernelConfig, ConfigError, default_config  # noqa: E402
from .masks import Mask, ScoreMod, mask, score_mod  # noqa: E402

from .config import interpreting as _interpreting  # noqa: E402

# The names that run kernels, from modules that import torch and Triton (seconds): imported on first use, so that
# `import flashgen`, reading a spec and the command line's help and input errors start without them.
_LAZY = {
    "AttentionKernel": "api", "attention": "api", "attention_varlen": "api", "compile": "api",
    "FlashgenFallbackWarning": "loader", "load": "loader", "scaled_dot_product_attention": "sdpa",
    "check_bounds": "kvcache", "decode": "kvcache", "dequantize_fp8": "quant", "quantize_fp8": "quant",
}
_RENAMED = {"compile": "compile_spec"}  # flashgen.compile is api.compile_spec

if _TYPE_CHECKING:  # what type checkers and editors read; at run time __getattr__ imports these on first use
    from .api import AttentionKernel, attention, attention_varlen  # noqa: F401
    from .api import compile_spec as compile  # noqa: F401,A004
    from .kvcache import check_bounds, decode  # noqa: F401
    from .loader import FlashgenFallbackWarning, load  # noqa: F401
    from .quant import dequantize_fp8, quantize_fp8  # noqa: F401
    from .sdpa import scaled_dot_product_attention  # noqa: F401


def __getattr__(name):
    """The kernel-running names of _LAZY, and flashgen's submodules (flashgen.compat, flashgen.api, ...)
    without an import of their own (as the README writes flashgen.compat.flash_attn_func), each imported
    on first use."""
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), _RENAMED.get(name, name))
        globals()[name] = value  # later lookups find it without this hook
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":  # a submodule that failed to import something of its own
                raise
    raise AttributeError(f"module 'flashgen' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


if _interpreting():
    from .runtime.interpret import patch_interpreter

    patch_interpreter()

__all__ = [
    "AttentionSpec", "SpecError", "TuneSpec", "KernelConfig", "ConfigError", "default_config",
    "AttentionKernel", "attention", "attention_varlen", "compile", "mask", "score_mod", "Mask", "ScoreMod", "load", "FlashgenFallbackWarning", "__version__",
    "scaled_dot_product_attention", "decode", "check_bounds", "quantize_fp8", "dequantize_fp8",
]
