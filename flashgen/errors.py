"""The error a bad spec field raises (shared by the spec and the mask compiler), and the check of a call's flags."""

from __future__ import annotations

import dataclasses
import reprlib
import sys
from typing import Any

# A bad value is quoted, not dumped: a 1 MB string or a structure of shared sub-lists
# (which repr() would write out in full) stays a short one-line message.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 4, 120, 60, 120
_REPR.maxtuple = _REPR.maxlist = _REPR.maxdict = _REPR.maxset = 8
MAX_VALUE_REPR = 200


def short_repr(value: Any) -> str:
    # A tensor is described, not printed: traced by torch.compile it has no values, and the message is the same
    # either way. (Traced, a check's message takes plain repr: torch 2.11's dynamo does not trace reprlib.)
    if _is_tensor(value):
        text = f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    else:
        text = repr(value) if _tracing() else _REPR.repr(value)
    return text if len(text) <= MAX_VALUE_REPR else text[:MAX_VALUE_REPR - 3] + "..."


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")  # (not imported here: the spec and the CLI's errors need no torch)
    return torch is not None and isinstance(value, torch.Tensor)


def _tracing() -> bool:
    compiler = getattr(sys.modules.get("torch"), "compiler", None)  # (a process without torch traces nothing)
    return compiler is not None and compiler.is_compiling()


def check_flag(name: str, value: Any) -> bool:
    """A call's flag (return_lse, deterministic, ...): True or False. A truthy string or number is a
    mistake (return_lse="no" would return the LSE), not a choice, so it is refused by name."""
    if value is not True and value is not False:
        raise TypeError(f"{name}: expected True or False, got {short_repr(value)}")
    return value


class SpecError(ValueError):
    """A spec field has a wrong type or an impossible value."""

    def __init__(self, field_name: str, message: str, value: Any = dataclasses.MISSING, source: str | None = None):
        self.field = field_name
        self.value = value
        self.message = message
        got = "" if value is dataclasses.MISSING else f", got {short_repr(value)}"
        where = f"{source}: " if source else ""
        super().__init__(f"{where}spec field '{field_name}': {message}{got}")

    def with_source(self, source: str) -> "SpecError":
        return SpecError(self.field, self.message, self.value, source=source)


class TracedSpecError(SpecError):
    """A SpecError that a call traced by torch.compile raises: TracedSpecError(text, field), its text SpecError's
    (dynamo cannot trace SpecError's own __init__, so a traced raise of it fails on that instead of reporting the
    error; this class is built as a plain ValueError is)."""

    __init__ = ValueError.__init__
    field = property(lambda self: self.args[1])
    message = property(lambda self: self.args[0].split(": ", 1)[-1])
    value = dataclasses.MISSING

    def __str__(self):
        return self.args[0]
