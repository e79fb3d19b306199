"""Closed vocabularies: string enums validated once where a value enters and dispatched on after.

A `Vocabulary` member is a `str` (so it compares equal to its value, prints as it, and goes into JSON and
f-strings as the word the user wrote), but only the listed words exist: `Mode.parse("exact")` is
`Mode.EXACT`, `Mode.parse("exakt")` a ValueError naming the valid words, and code below the check
dispatches on members (`mode is Mode.FAST`), never on free text.
"""

from __future__ import annotations

from enum import Enum


class Vocabulary(str, Enum):
    """A str enum whose members print and format as their value (Python 3.10 and 3.11 alike)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, value, name: str | None = None):
        """The member for `value` (a member or its word); ValueError naming `name` and the valid words."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            words = tuple(m.value for m in cls)
            raise ValueError(f"{name or cls.__name__} must be one of {words}, got {value!r}") from None

    @classmethod
    def words(cls) -> tuple[str, ...]:
        """The valid words, in order."""
        return tuple(m.value for m in cls)
