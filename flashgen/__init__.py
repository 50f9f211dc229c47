"""flashgen: attention specs compiled into tuned Triton kernels."""

__version__ = "0.1.0"

from .spec import AttentionSpec, SpecError, TuneSpec  # noqa: E402
from .config import KernelConfig, ConfigError, default_config  # noqa: E402
from .api import AttentionKernel, attention, attention_varlen  # noqa: E402
from .api import compile_spec as compile  # noqa: E402,A004 (flashgen.compile, public API)
from .masks import Mask, ScoreMod, mask, score_mod  # noqa: E402
from .loader import FlashgenFallbackWarning, load  # noqa: E402
from .sdpa import scaled_dot_product_attention  # noqa: E402
from .kvcache import check_bounds, decode  # noqa: E402
from .quant import dequantize_fp8, quantize_fp8  # noqa: E402

from .config import interpreting as _interpreting  # noqa: E402


def __getattr__(name):
    """flashgen.compat and flashgen.integrations without an import of their own (as the README writes
    flashgen.compat.flash_attn_func), imported on first use: `import flashgen` stays as fast."""
    if name in ("compat", "integrations"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'flashgen' has no attribute {name!r}")


if _interpreting():
    from .runtime.interpret import patch_interpreter

    patch_interpreter()

__all__ = [
    "AttentionSpec", "SpecError", "TuneSpec", "KernelConfig", "ConfigError", "default_config",
    "AttentionKernel", "attention", "attention_varlen", "compile", "mask", "score_mod", "Mask", "ScoreMod", "load", "FlashgenFallbackWarning", "__version__",
    "scaled_dot_product_attention", "decode", "check_bounds", "quantize_fp8", "dequantize_fp8",
]
