"""How a failure ends the command: signals become `Interrupted`, every exception one line and its exit code.

Why the signal handlers: typer (0.29, which vendors click) catches KeyboardInterrupt inside the app and
turns it into `Exit(130)`, which `app(standalone_mode=False)` *returns* instead of raising, so a handler
around the app never saw Ctrl-C and the process exited 0; SIGTERM had no handler at all, so Python died
without running any `finally` (the `.part` file and the disk-staging folder stayed). Here SIGINT,
SIGTERM and SIGHUP raise `tilewise.errors.Interrupted`, a BaseException typer does not catch: every
`with` and `finally` on the way out runs (sinks abort, staging folders are removed), and the command
exits 128 + the signal's number (130, 143, 129). Further signals during that clean-up are ignored. While
the files of one output are renamed into place (`atomic.publish_all`), a signal waits until they are.
The exit codes of every other failure: `tilewise.errors` (the table is in the README).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import typer.exceptions

from ..atomic import defer_signal
from ..errors import BadRequest, Interrupted, TilewiseError, WontFit

SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))
_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


@contextmanager
def signals_raise() -> Iterator[None]:
    """While inside: SIGINT / SIGTERM / SIGHUP raise Interrupted once (later ones are ignored)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread (e.g. a test runner's worker)
        return
    fired = []

    def handler(signum, frame):
        if fired:
            return  # cleaning up after the first one: let it finish
        fired.append(signum)
        if defer_signal(signum):
            return  # renaming the files of one output into place: raised once they all are
        raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def exit_code(e: BaseException) -> int:
    """The exit status for an exception that ended a command (see `tilewise.errors`)."""
    if isinstance(e, Interrupted):
        return e.exit_code
    if isinstance(e, KeyboardInterrupt):
        return 128 + signal.SIGINT
    if isinstance(e, typer.exceptions.Exit):
        return e.exit_code
    if isinstance(e, typer.TyperException):  # usage errors (2) of the vendored click
        return int(getattr(e, "exit_code", 2))
    if isinstance(e, TilewiseError):
        return e.exit_code
    if _out_of_memory(e) or _disk_full(e):
        return WontFit.exit_code
    code = getattr(e, "code", None)  # a --nproc launch whose ranks failed: their status
    if type(e).__name__ == "RankFailure" and isinstance(code, int) and code > 0:
        return code
    if isinstance(e, ValueError):
        return BadRequest.exit_code
    return 1


def message(e: BaseException, argv: list[str]) -> str:
    """One line that says what failed, naming the user's value; no traceback."""
    if isinstance(e, Interrupted | KeyboardInterrupt):
        name = e.name if isinstance(e, Interrupted) else "SIGINT"
        return f"interrupted ({name}): stopped; no partial output was left"
    if isinstance(e, typer.exceptions.Abort):
        return "aborted"
    if isinstance(e, typer.TyperException):
        return f"error: {_usage(e, argv)}"
    text = _one_line(str(e))
    if _out_of_memory(e):
        return (f"error: out of memory: {text or type(e).__name__} (try a smaller --tile or --vae-tile, a "
                "--budget, --staging disk, or a smaller size)")
    if _disk_full(e):
        where = getattr(e, "filename", None)
        return f"error: no space left on the device while writing {where!r}" if where else f"error: {text}"
    if isinstance(e, TilewiseError | ValueError) and text:
        return f"error: {text}"
    if isinstance(e, OSError):
        return f"error: {text}"
    if type(e).__name__ == "RankFailure":
        return f"error: {text}"
    return (f"error: internal error, {type(e).__name__}: {text or '(no message)'} (run with --debug for the "
            "traceback)")


def report(e: BaseException, argv: list[str], debug: bool) -> int:
    """Print the failure (its traceback too with --debug) to stderr; return the exit status."""
    code = exit_code(e)
    if isinstance(e, typer.exceptions.Exit):
        return code
    if type(e).__name__ == "NoArgsIsHelpError":  # `tilewise` alone: the help, as a usage error
        e.show()
        return code
    if debug and not isinstance(e, typer.TyperException):
        traceback.print_exception(e)
    if isinstance(e, Interrupted | KeyboardInterrupt) and os.environ.get("TILEWISE_RANK_OF_LAUNCH"):
        return code  # a rank of a --nproc launch: the launcher says it once
    typer.echo(message(e, argv), err=True)
    return code


def _usage(e: Exception, argv: list[str]) -> str:
    """A usage error of the vendored click as one line, with the value given on the command line."""
    text = _one_line(e.format_message() if hasattr(e, "format_message") else str(e))
    param = getattr(e, "param", None)
    ctx = getattr(e, "ctx", None)
    names = list(getattr(param, "opts", []) or [])
    value = _given(names, argv)
    if value is not None and repr(value) not in text:
        text = f"{text} (got {value!r})"
    if ctx is not None and getattr(ctx, "command_path", None):
        text += f"; see '{ctx.command_path} --help'"
    return text


def _given(names: list[str], argv: list[str]) -> str | None:
    """The value that followed one of the option names on the command line (last one wins)."""
    found = None
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                found = argv[i + 1]
            elif a.startswith(n + "="):
                found = a[len(n) + 1:]
    return found


def _one_line(text: str) -> str:
    """Several lines joined by '; ' (exceptions from libraries sometimes span lines)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    joined = "; ".join(lines)
    return joined if len(joined) <= 600 else joined[:597] + "..."


# what torch's allocators say when an allocation fails without raising torch.OutOfMemoryError (the CPU
# allocator raises a plain RuntimeError: "DefaultCPUAllocator: can't allocate memory: you tried to ...")
_OOM_TEXTS = ("can't allocate memory", "not enough memory", "out of memory")


def _out_of_memory(e: BaseException) -> bool:
    if isinstance(e, MemoryError):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(e, getattr(torch, "OutOfMemoryError", ())):
        return True
    return type(e) is RuntimeError and any(t in str(e) for t in _OOM_TEXTS)


def _disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in _FULL:
        return True
    text = str(e)
    return "No space left on device" in text or "os error 28" in text
