"""The built-in mask patterns by name, in the order error messages list them."""

from __future__ import annotations

from . import causal, chunked, document, prefix_lm, sink, sliding_window
from .pattern import Pattern

PATTERNS: dict[str, Pattern] = {p.name: p for p in (causal.PATTERN, sliding_window.PATTERN, chunked.PATTERN,
                                                     prefix_lm.PATTERN, document.PATTERN, sink.PATTERN)}
