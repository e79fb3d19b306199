"""`python -m tilewise.distributed.torchrun ARGS`: torchrun (torch.distributed.run) that ends quietly on a
signal: SIGINT / SIGTERM / SIGHUP stop its ranks (torchrun passes the signal on, the ranks clean up) and
this process exits 128 + the signal's number, without the traceback of torchrun's SignalException; a rank
that fails (it prints its own one-line error) makes the launch exit with that rank's status, without the
ChildFailedError traceback and table. What
`tilewise ... --nproc N` launches (`launch.torchrun_command`). torchrun's own warnings (its "death signal"
and OMP_NUM_THREADS notices) are not shown unless LOGLEVEL asks for them; its errors are."""

from __future__ import annotations

import logging
import os
import sys

from torch.distributed import run
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError


def _quiet() -> None:
    """torchrun's elastic loggers at ERROR (their levels are set one by one when they are made)."""
    if "LOGLEVEL" in os.environ:
        return
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name == "torch.distributed.run":
            logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with `argv`; its exit status, 128 + signum when a signal stopped it."""
    _quiet()
    try:
        run.main(argv)
    except SignalException as e:
        return 128 + int(e.sigval)
    except ChildFailedError as e:  # a rank failed: it printed its error; its status is the launch's
        code = e.get_first_failure()[1].exitcode
        return code if code > 0 else 128 - code if code < 0 else 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
