"""--nproc: join torchrun's process group, or relaunch this command under torchrun on N local ranks."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import typer

logger = logging.getLogger("tilewise.cli")


LAUNCHED = "TILEWISE_RANK_OF_LAUNCH"  # set in the ranks of a --nproc launch: the launcher reports for them


def join_ranks(nproc: int) -> tuple[object, int]:
    """(process group, rank): under torchrun join its group; with --nproc > 1 relaunch under torchrun.

    The relaunch runs `python -m tilewise.distributed.torchrun --standalone --nproc-per-node N -m
    tilewise.cli ARGS` (ARGS without --nproc) and exits with its status: torchrun stops every rank when
    one fails. Its ranks and torchrun keep their temporary files (torchelastic_*, staging) in a folder
    of their own, removed when the launch ends however it ends; a signal reaches every rank, and the
    launcher alone says so.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        from ..distributed import init_from_env  # (lazy: tilewise.distributed imports torch, ~2 s)

        rank, _ = init_from_env()
        return "default", rank
    if nproc > 1:
        _launch(nproc)
    return None, 0


def _launch(nproc: int) -> None:
    """Run this command on `nproc` ranks under torchrun and end with its status (typer.Exit(0) or
    RankFailure); an interrupt is passed on and re-raised once the ranks have stopped."""
    from ..distributed import torchrun_command  # (lazy: as init_from_env above)

    cmd = torchrun_command(sys.argv[1:], nproc)
    logger.info("launching %d ranks: %s", nproc, " ".join(cmd))
    scratch = tempfile.mkdtemp(prefix="tilewise-ranks-")
    env = dict(os.environ, TMPDIR=scratch, **{LAUNCHED: "1"})
    try:
        launch = subprocess.Popen(cmd, env=env)
        try:
            code = launch.wait()
        except BaseException as e:  # interrupted: torchrun passes the signal on and waits for its ranks
            launch.send_signal(getattr(e, "signum", signal.SIGINT))
            try:
                launch.wait(timeout=60)
            except subprocess.TimeoutExpired:
                launch.kill()
                launch.wait()
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if code:
        raise RankFailure(f"{nproc} ranks under torchrun: exit status {code} (the failing rank's "
                          "error is printed above)", code)
    raise typer.Exit(0)


class RankFailure(RuntimeError):
    """A torchrun launch whose ranks failed (their errors were printed by the ranks themselves)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code
