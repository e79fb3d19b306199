"""Atomic outputs: write under a temporary name beside the target, rename into place only when complete.

An exception (or Ctrl-C) while writing removes the temporary file, so no half-written output is left.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def temporary_path(path: str | os.PathLike) -> str:
    """A new, empty temporary file next to ``path`` (same directory, so os.replace is atomic)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    os.close(fd)
    return tmp


def umask() -> int:
    """The process umask, read without changing it (Linux /proc; 0o022 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def publish(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Give the temporary file ordinary permissions (mkstemp makes it 0600) and rename it into place."""
    os.chmod(tmp, 0o666 & ~umask())
    os.replace(tmp, path)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path to write; on success it becomes ``path``, on any exception it is removed."""
    tmp = temporary_path(path)
    try:
        yield tmp
        publish(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
