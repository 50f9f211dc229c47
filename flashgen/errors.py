"""The error a bad spec field raises (shared by the spec and the mask compiler)."""

from __future__ import annotations

import dataclasses
from typing import Any


class SpecError(ValueError):
    """A spec field has a wrong type or an impossible value."""

    def __init__(self, field_name: str, message: str, value: Any = dataclasses.MISSING, source: str | None = None):
        self.field = field_name
        self.value = value
        self.message = message
        got = "" if value is dataclasses.MISSING else f", got {value!r}"
        where = f"{source}: " if source else ""
        super().__init__(f"{where}spec field '{field_name}': {message}{got}")

    def with_source(self, source: str) -> "SpecError":
        return SpecError(self.field, self.message, self.value, source=source)
