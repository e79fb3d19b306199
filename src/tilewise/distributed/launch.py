"""Starting ranks: join a torchrun launch (`init_from_env`), relaunch under torchrun, `spawn` local ranks."""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from .groups import BACKENDS, DEFAULT_TIMEOUT

START_METHODS = ("spawn", "fork", "forkserver")


class RankError(RuntimeError):
    """A rank of a `spawn` run raised or died; `rank` is its index, `traceback` its formatted traceback."""

    def __init__(self, rank: int, traceback: str, message: str | None = None) -> None:
        self.rank, self.traceback = rank, traceback
        super().__init__(message or f"rank {rank} failed:\n{traceback}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free now (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_from_env(backend: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> tuple[int, int]:
    """init_process_group for a torchrun-launched process (env:// rendezvous); returns (rank, world)."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(f"init_from_env needs torchrun's environment; missing {missing} "
                         "(launch with `torchrun --nproc-per-node N ...`)")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        # shut the group down before the interpreter does: a gloo group left to the C++ destructors at
        # exit sometimes aborted the rank ("terminate called without an active exception", SIGABRT)
        # after its work was done, failing the whole torchrun launch
        atexit.register(_destroy_group)
    return dist.get_rank(), dist.get_world_size()


def _destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def torchrun_command(argv: Sequence[str], nproc: int, module: str = "tilewise.cli") -> list[str]:
    """The argv that relaunches `python -m module argv` on `nproc` local ranks with torchrun (no --nproc;
    through `tilewise.distributed.torchrun`, which ends on a signal without torchrun's traceback)."""
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        rest.append(a)
    return [sys.executable, "-m", "tilewise.distributed.torchrun", "--standalone",
            f"--nproc-per-node={nproc}", "-m", module, *rest]


def _write_failure(results: str, rank: int) -> None:
    """Record when and how this rank failed (read by `_first_failure`)."""
    path = os.path.join(results, f"rank{rank}.failed")
    with open(path + ".tmp", "w") as f:
        f.write(f"{time.time()!r}\n{traceback.format_exc()}")
    os.replace(path + ".tmp", path)


def _first_failure(results: str) -> tuple[int, str] | None:
    """(rank, traceback) of the earliest recorded failure, or None."""
    found = []
    for name in os.listdir(results):
        if name.endswith(".failed"):
            with open(os.path.join(results, name)) as f:
                stamp, _, trace = f.read().partition("\n")
            found.append((float(stamp), int(name[len("rank"):-len(".failed")]), trace))
    return min(found)[1:] if found else None


def _worker(rank, fn, world, backend, init_method, timeout, threads, results, args) -> None:
    """One rank of `spawn`: join the group, run fn(rank, world, *args), store its result atomically."""
    if threads is not None:
        torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        result = fn(rank, world, *args)
    except BaseException:
        # when one rank fails, its peers fail next in their collectives; the parent reports the rank
        # that failed first (the cause), so each failure leaves its time and traceback here
        _write_failure(results, rank)
        raise
    path = os.path.join(results, f"rank{rank}.pt")
    torch.save(result, path + ".tmp")
    os.replace(path + ".tmp", path)
    dist.barrier()
    dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    backend: str = "gloo",
    init_method: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    limit: float | None = None,
    start_method: str = "spawn",
    threads: int | None = None,
) -> list[Any]:
    """Run fn(rank, world, *args) on `nprocs` new processes in one process group; their results by rank.

    Built on torch.multiprocessing. Each rank joins the group through `init_method` (default
    tcp://127.0.0.1 on a free port) with `timeout` seconds per collective; the first rank that raises or
    dies stops the others (SIGTERM, then SIGKILL) and its traceback is re-raised here as `RankError`;
    a run longer than `limit` seconds is stopped with TimeoutError. `fn` must be importable by name
    ("spawn") and its result made of tensors, numbers, strings, lists and dicts (saved with torch.save,
    loaded with weights_only=True). `start_method="fork"` skips re-importing modules in the children
    (fast in tests); it runs each rank with `threads` (default 1) intra-op threads, since OpenMP thread
    pools do not survive a fork.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
    if not timeout > 0 or (limit is not None and not limit > 0):
        raise ValueError(f"timeout and limit must be > 0 seconds, got timeout={timeout}, limit={limit}")
    if start_method == "fork" and threads is None:
        threads = 1
    init_method = init_method or f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="tilewise-spawn-") as results:
        worker_args = (fn, nprocs, backend, init_method, timeout, threads, results, tuple(args))
        ctx = mp.start_processes(_worker, args=worker_args, nprocs=nprocs, join=False,
                                 start_method=start_method)
        _join(ctx, limit, results)
        out = []
        for r in range(nprocs):
            out.append(torch.load(os.path.join(results, f"rank{r}.pt"), weights_only=True))
        return out


def _join(ctx: Any, limit: float | None, results: str) -> None:
    """Join all ranks; the first failure kills the rest and is re-raised with its rank and traceback."""
    deadline = None if limit is None else time.monotonic() + limit
    try:
        while not ctx.join(timeout=0.2, grace_period=1.0):
            if deadline is not None and time.monotonic() > deadline:
                alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                _kill(ctx)
                raise TimeoutError(f"spawn: ranks {alive} still running after limit={limit} s; all stopped")
    except ProcessRaisedException as e:
        _kill(ctx)
        first = _first_failure(results)  # the cause, not a peer that failed in a collective after it
        raise RankError(*(first or (e.error_index, _trace(e.msg)))) from None
    except ProcessExitedException as e:
        raise RankError(e.error_index, "", f"rank {e.error_index} died: {e.msg}") from None
    except BaseException:
        _kill(ctx)
        raise


def _trace(msg: str) -> str:
    """The child's traceback out of torch.multiprocessing's message."""
    head = "terminated with the following error:\n"
    return msg.split(head, 1)[1] if head in msg else msg


def _kill(ctx: Any) -> None:
    for p in ctx.processes:
        if p.is_alive():
            p.terminate()
    for p in ctx.processes:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join()
