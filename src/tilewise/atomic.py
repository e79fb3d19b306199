"""Atomic outputs: write under a temporary name beside the target, rename into place only when complete.

An exception (or Ctrl-C) while writing removes the temporary file, so no half-written output is left,
and an existing target is replaced only by a complete file (or, with replace=False, never). Before any
work, `check_target` refuses a target that cannot be written (missing folder, a folder, a read-only
place); errors name the target the caller gave, never the hidden temporary.

Several files that make one output (a frame sequence) are published together by `publish_all`: every
file is complete under its temporary name first, then all are renamed in one step that a signal does not
cut (`deferred_signals`: a handler that honours it, the CLI's, holds the signal until the step is done),
so an interrupt leaves either the user's old files or the complete new ones, never a mixture, and never
removes a file the user had.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from .errors import BadRequest, Interrupted, WontFit

_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def check_target(path: str | os.PathLike, what: str = "output", replace: bool = True) -> None:
    """Refuse (BadRequest; WontFit on a full disk) a target that cannot be written, before any work.

    A folder is not a file; its folder must exist and take a new file (probed by creating and removing
    a temporary one there, which also catches read-only mounts where root ignores permission bits); with
    replace=False an existing target is refused."""
    shown = os.fspath(path)
    if shown == "":
        raise BadRequest(f"{what} is an empty path: give a file name")
    p = Path(path)
    if p.is_dir():
        raise BadRequest(f"{what} {shown!r} is a folder: give a file name inside it")
    folder = p.parent
    if not folder.exists():
        raise BadRequest(f"{what} {shown!r}: folder {str(folder)!r} does not exist (create it first)")
    if not folder.is_dir():
        raise BadRequest(f"{what} {shown!r}: {str(folder)!r} is a file, not a folder")
    if p.exists() and not replace:
        raise BadRequest(f"{what} {shown!r} exists and replacing it was refused (--no-clobber); remove it or "
                         "choose another name")
    if p.exists() and not p.is_file():
        raise BadRequest(f"{what} {shown!r} exists and is not a regular file (a device, pipe or socket)")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{p.name}.", suffix=".check")
    except OSError as e:
        raise _target_error(e, shown, what) from e
    os.close(fd)
    os.unlink(probe)


def _target_error(e: OSError, shown: str, what: str) -> Exception:
    """The OSError of creating a file beside the target, told about the target."""
    folder = os.path.dirname(shown) or "."
    if e.errno == errno.EROFS:
        return BadRequest(f"{what} {shown!r}: folder {folder!r} is on a read-only file system")
    if e.errno in (errno.EACCES, errno.EPERM):
        return BadRequest(f"{what} {shown!r}: no permission to create files in folder {folder!r}")
    if e.errno in _FULL:
        return WontFit(f"{what} {shown!r}: no space left on the device of folder {folder!r}")
    return BadRequest(f"{what} {shown!r} cannot be written in folder {folder!r}: {e.strerror or e}")


def temporary_path(path: str | os.PathLike) -> str:
    """A new, empty temporary file next to ``path`` (same directory, so os.replace is atomic)."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    except OSError as e:
        raise _target_error(e, os.fspath(path), "output") from e
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


def publish(tmp: str | os.PathLike, path: str | os.PathLike, replace: bool = True) -> None:
    """Give the temporary file ordinary permissions (mkstemp makes it 0600) and rename it into place.

    replace=False never replaces an existing ``path``, even one made while the work ran (a hard link
    fails if the name exists; where the file system has no hard links, the check is not atomic)."""
    os.chmod(tmp, 0o666 & ~umask())
    if replace:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise BadRequest(f"output {os.fspath(path)!r} appeared while it was being written and replacing it "
                         "was refused (--no-clobber); the new result was discarded") from None
    except OSError:
        if os.path.exists(path):
            raise BadRequest(f"output {os.fspath(path)!r} exists and replacing it was refused "
                             "(--no-clobber)") from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


_DEFERRED: dict[str, list] = {"depth": [], "signals": []}


@contextmanager
def deferred_signals() -> Iterator[None]:
    """Inside: signal handlers that ask `defer_signal` hold their signal; the first held one is raised as
    `Interrupted` when the outermost block ends (a few renames: no output is left half-published)."""
    _DEFERRED["depth"].append(1)
    try:
        yield
    finally:
        _DEFERRED["depth"].pop()
        if not _DEFERRED["depth"] and _DEFERRED["signals"]:
            signum = _DEFERRED["signals"][0]
            _DEFERRED["signals"].clear()
            raise Interrupted(signum)


def defer_signal(signum: int) -> bool:
    """For a signal handler: inside `deferred_signals`, hold `signum` (raised when the block ends) and
    return True; outside, return False (the handler acts now)."""
    if not _DEFERRED["depth"]:
        return False
    _DEFERRED["signals"].append(int(signum))
    return True


def publish_all(pairs: Sequence[tuple[str, str | os.PathLike]], replace: bool = True) -> None:
    """Rename every (temporary, target) pair into place as one step that signals do not cut.

    replace=False publishes none of them when any target exists (one made while the work ran included):
    the targets already linked by then are new names, and are removed again."""
    with deferred_signals():
        if replace:
            for tmp, path in pairs:
                publish(tmp, path)
            return
        made: list[str | os.PathLike] = []
        try:
            for tmp, path in pairs:
                publish(tmp, path, replace=False)
                made.append(path)
        except BaseException:
            for path in made:  # (ours: publish(replace=False) never replaces an existing file)
                os.unlink(path)
            raise


def name_target(e: BaseException, path: str | os.PathLike | None) -> None:
    """An OSError raised while writing `path` (often without a file name, or with the temporary's) is
    made to name `path`, so that the message names what the user asked for."""
    if isinstance(e, OSError) and path is not None:
        if e.filename is None or ".part" in os.fspath(e.filename):
            e.filename = os.fspath(path)


@contextmanager
def atomic_path(path: str | os.PathLike, replace: bool = True) -> Iterator[str]:
    """Yield a temporary path to write; on success it becomes ``path``, on any exception it is removed."""
    tmp = temporary_path(path)
    try:
        yield tmp
        publish(tmp, path, replace=replace)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        name_target(e, path)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write a small text file (a report's JSON) under a temporary name, renamed when complete."""
    with atomic_path(path) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")
