"""The user-facing objects: ``flashgen.mask(...)``, ``flashgen.score_mod(...)``, combined with & and |.

``parse_mask`` and ``parse_score_mod`` are what a spec's ``mask`` and ``score_mod`` fields go
through: they take everything the tree and modifier parsers take, plus these objects.
"""

from __future__ import annotations

import json
from typing import Callable

from .score_mods import ScoreModNode, parse_score_mod_steps
from .tree import MaskNode, parse_mask_tree


class _Definition:
    """A node the user built in Python, shown as the call that builds it again."""

    _builder = ""  # the flashgen function its repr calls

    def __init__(self, node):
        self.node = node
        # the node as a spec field, made once (the node never changes), and as canonical JSON: a call's key,
        # which torch.compile reads as one constant string rather than tracing the node's conversion
        self._dict = node.to_dict()
        self.key = json.dumps(self._dict, sort_keys=True)

    def to_dict(self):
        return self._dict

    def __repr__(self):
        return f"flashgen.{self._builder}({self.to_dict()!r})"


class Mask(_Definition):
    """A mask built in Python: ``flashgen.mask("q_idx >= kv_idx")``, a pattern, or a function."""

    _builder = "mask"

    @classmethod
    def from_function(cls, fn: Callable) -> "Mask":
        return cls(parse_mask_tree(fn))

    def __and__(self, other):
        return Mask(MaskNode("and", (), (self.node, parse_mask(other))))

    def __or__(self, other):
        return Mask(MaskNode("or", (), (self.node, parse_mask(other))))


class ScoreMod(_Definition):
    """A score modifier built in Python: ``flashgen.score_mod("score + 0.1 * (q_idx - kv_idx)")``."""

    _builder = "score_mod"

    @classmethod
    def from_function(cls, fn: Callable) -> "ScoreMod":
        return cls(parse_score_mod_steps(fn))


def _without_objects(data):
    """data with Mask / ScoreMod objects inside lists and mappings replaced by their nodes."""
    if isinstance(data, (Mask, ScoreMod)):
        return data.node
    if isinstance(data, (list, tuple)):
        return [_without_objects(x) for x in data]
    if isinstance(data, dict):
        return {k: _without_objects(v) for k, v in data.items()}
    return data


def parse_mask(data, field: str = "mask") -> MaskNode:
    """A MaskNode from a spec's mask field: a pattern mapping, an and/or, an expression, a
    Python function, or a Mask."""
    return parse_mask_tree(_without_objects(data), field)


def parse_score_mod(data, field: str = "score_mod") -> ScoreModNode:
    """A ScoreModNode from a spec's score_mod field: a modifier, a list of them (applied in
    order), an expression, a Python function, or a ScoreMod."""
    return parse_score_mod_steps(_without_objects(data), field)


def mask(definition=None, /, **pattern) -> Mask:
    """A mask from an expression string, a Python function, or one pattern by keyword.

    ``flashgen.mask("doc[q_idx] == doc[kv_idx]")``, ``flashgen.mask(my_mask_fn)``,
    ``flashgen.mask(sliding_window={"left": 256, "right": 0})``. Combine with & and |.
    """
    if definition is not None and pattern:
        raise TypeError("mask: give an expression/function or one pattern keyword, not both")
    if definition is None:
        if len(pattern) != 1:
            raise TypeError("mask: expected one pattern keyword, e.g. mask(causal={})")
        return Mask(parse_mask(dict(pattern)))
    return Mask(parse_mask(definition))


def score_mod(definition=None, /, **modifier) -> ScoreMod:
    """A score modifier from an expression string, a Python function or one built-in by keyword."""
    if definition is None:
        return ScoreMod(parse_score_mod(dict(modifier)))
    return ScoreMod(parse_score_mod(definition))
