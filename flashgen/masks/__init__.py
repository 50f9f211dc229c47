"""Mask patterns, score modifiers and custom expressions, lowered to the expression IR.

One file per built-in pattern (causal, sliding_window, chunked, prefix_lm, document, sink;
expression.py for custom expressions), each with its parameters, check, predicate and key
interval; tree.py combines them with and/or; score_mods.py holds the score modifiers;
lowering.py lowers a mask and a score modifier together; api.py has the user-facing
``flashgen.mask`` and ``flashgen.score_mod``. Data flows one way: expr <- masks <- codegen.
"""

from .api import Mask, ScoreMod, mask, parse_mask, parse_score_mod, score_mod
from .lowering import Lowered, NamedTensor, lower
from .score_mods import ScoreModNode, score_ir
from .tree import MaskNode, predicate

__all__ = ["Mask", "ScoreMod", "mask", "score_mod", "parse_mask", "parse_score_mod", "MaskNode", "ScoreModNode",
           "predicate", "score_ir", "lower", "Lowered", "NamedTensor"]
