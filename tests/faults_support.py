"""What the fault catalogues share (no tests here): the command run in process, and the three things every
case asserts: the exit code of its kind, one `error:` line naming the value (no traceback), and what is
left on disk (nothing new, the user's files unchanged)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tilewise.cli import main

OK, BAD_REQUEST, BAD_INPUT, WONT_FIT, MODEL = 0, 2, 3, 4, 5


def listing(folder: Path) -> list[tuple[str, int, bytes]]:
    """Every path under `folder` with its size and first bytes (-1 and b"" for a folder)."""
    out = []
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                out.append((p.relative_to(folder).as_posix(), p.stat().st_size, f.read(64)))
        else:
            out.append((p.relative_to(folder).as_posix(), -1, b""))
    return out


def run(argv: list[str], capsys) -> tuple[int, list[str], str]:
    """`tilewise argv` in this process: (exit code, its `error:` lines, all of stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    code = exit_info.value.code
    return (0 if code is None else code), [ln for ln in err.splitlines() if ln.startswith("error:")], err


def refused(argv: list[str], code: int, needles: list[str], capsys, *folders: Path) -> str:
    """Run `argv`; assert it exits `code` with one error line holding every needle, no traceback, and that
    `folders` hold exactly what they held before (no output, no temporary, the user's files unchanged).
    Returns the error line."""
    before = [listing(f) for f in folders]
    got, errors, err = run(argv, capsys)
    assert got == code, err
    assert len(errors) == 1, err
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    for f, b in zip(folders, before, strict=True):
        assert listing(f) == b, f"{f}: an output or temporary was left, or a file was changed"
    return errors[0]


@pytest.fixture
def quiet_diffusers():
    """diffusers binds its log handler to the stderr of the test that first imported it (closed by now,
    so its warnings print a 'Logging error' traceback): its warnings are not what these tests check."""
    from diffusers.utils import logging as dlog

    level = dlog.get_verbosity()
    dlog.set_verbosity_error()
    yield
    dlog.set_verbosity(level)
