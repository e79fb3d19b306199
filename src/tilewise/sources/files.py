"""Input files checked before any work: there, a file (not a folder), readable, not empty."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import BadInputFile, BadRequest


def check_file(path: str | os.PathLike, what: str = "input file") -> Path:
    """`path` as a Path once it is an existing, readable, non-empty regular file; BadRequest when it is not
    there, BadInputFile when it is a folder, unreadable or empty. `what` names it in messages."""
    shown = os.fspath(path)
    p = Path(path)
    if shown == "":
        raise BadRequest(f"{what} is an empty path: give a file")
    if not p.exists():
        hint = "" if p.parent.is_dir() else f" (its folder {str(p.parent)!r} does not exist either)"
        raise BadRequest(f"{what} {shown!r} does not exist{hint}")
    if p.is_dir():
        raise BadInputFile(f"{what} {shown!r} is a folder, not a file")
    if not p.is_file():
        raise BadInputFile(f"{what} {shown!r} is not a regular file (a device, pipe or socket)")
    try:
        with open(p, "rb") as f:
            first = f.read(1)
    except OSError as e:
        raise BadInputFile(f"{what} {shown!r} cannot be read: {e.strerror or e}") from e
    if not first:
        raise BadInputFile(f"{what} {shown!r} is empty (0 bytes)")
    return p
