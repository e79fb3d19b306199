"""Tile-parallel transport over torch.distributed: groups, tile sharding, fused reductions, a spawner.

Every rank plans the same tiles, runs only its shard (`shard`), and the ranks combine what they computed
with one collective: the value and weight buffers of a blending accumulator are summed in one packed
all-reduce (`all_reduce_accumulator`, float64 by default, so the sum hardly depends on how the tiles were
split); exact GroupNorm moments are merged with Chan et al.'s pairwise update in rank order
(`all_merge_moments`); variable-length pieces (attention keys/values) are concatenated in rank order
(`all_gather_cat`); the halo rows a rank's next tiles read are fetched from the ranks that computed
them, each pixel once (`exchange_boxes`, also the gather of an output to rank 0). Collectives run on CPU
tensors for gloo and on the current CUDA device for NCCL.

Multi-GPU (NCCL), one process per GPU, launched by PyTorch's own launcher:

    torchrun --standalone --nproc-per-node 2 -m tilewise.cli generate --prompt grass --width 4096 ...

Each rank calls `init_from_env()` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set by torchrun; NCCL
when CUDA is available, else gloo; the CUDA device is LOCAL_RANK) and builds its denoiser and VAE with
`TiledDenoiser(..., process_group="default")` and `TiledVAE(..., process_group="default")`; every rank
then holds the same latents and image, and rank 0 alone writes the output (`TiledVAE.decode_to` streams
the other ranks' rows through rank 0; `tilewise.sharding` has the VAE's row-band plan). `tilewise
generate|decode ... --nproc N` is that line made for you: the CLI re-executes itself as
`torchrun_command(sys.argv[1:], N)`, i.e. `python -m torch.distributed.run --standalone
--nproc-per-node=N -m tilewise.cli ...` with `--nproc` removed, so one machine needs no launcher of its
own; several machines use torchrun's `--nnodes/--rdzv-endpoint` directly. torchrun stops every worker
when one exits with an error and prints that worker's traceback.

Failure: `init_process_group` gets a timeout, so a collective that a dead or diverged rank never joins
raises instead of hanging; `spawn` (tests, benchmarks) stops every rank as soon as one raises and
re-raises in the parent as `RankError` with that rank's traceback.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
Box = tuple[int, int, int, int]  # (y0, y1, x0, x1), half-open, as tilewise.geometry
BACKENDS = ("gloo", "nccl")
START_METHODS = ("spawn", "fork", "forkserver")
DEFAULT_TIMEOUT = 300.0  # seconds a collective waits for the other ranks


class RankError(RuntimeError):
    """A rank of a `spawn` run raised or died; `rank` is its index, `traceback` its formatted traceback."""

    def __init__(self, rank: int, traceback: str, message: str | None = None) -> None:
        self.rank, self.traceback = rank, traceback
        super().__init__(message or f"rank {rank} failed:\n{traceback}")


# ---- groups -------------------------------------------------------------------------------------------
def resolve_group(process_group: Any) -> Any:
    """None (single process), "default" (the initialised default group) or a ProcessGroup -> group or None."""
    if process_group is None:
        return None
    import torch.distributed as dist

    if isinstance(process_group, str):
        if process_group != "default":
            raise ValueError(f"process_group must be None, 'default' or a ProcessGroup, "
                             f"got {process_group!r}")
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("process_group='default' needs torch.distributed initialised first (torchrun "
                             "+ tilewise.distributed.init_from_env(), or tilewise.distributed.spawn)")
        return dist.group.WORLD
    if not isinstance(process_group, dist.ProcessGroup):
        raise ValueError(f"process_group must be None, 'default' or a ProcessGroup, "
                         f"got {type(process_group).__name__}")
    return process_group


def rank_world(group: Any) -> tuple[int, int]:
    """(rank, world size) of this process in `group`; (0, 1) without a group."""
    if group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def _backend(group: Any) -> str:
    import torch.distributed as dist

    return str(dist.get_backend(group)).lower()


def _comm_device(group: Any, device: Any) -> Any:
    """Where a collective's buffer must live: the current CUDA device for NCCL, the CPU for gloo."""
    import torch

    if "nccl" in _backend(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- sharding -----------------------------------------------------------------------------------------
def shard(
    items: Sequence[T],
    rank: int,
    world: int,
    key: Callable[[T], Hashable] | None = None,
    cost: Callable[[T], float] | None = None,
    strategy: str = "greedy",
) -> list[T]:
    """The items rank `rank` of `world` runs, in their given order; the shards partition `items`.

    Assignment depends only on the items (sorted by `key`), never on their order in the list:
    "greedy" is longest-processing-time first (items by decreasing `cost`, each to the least loaded rank,
    ties to the lowest rank), so equal costs give a round-robin over the sorted items and counts that
    differ by at most one; "contiguous" cuts the sorted items into `world` runs of near-equal cost (row
    bands: the fewest shard boundaries, for halo exchange).
    """
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world size must be a positive int, got {world!r}")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")
    if strategy not in ("greedy", "contiguous"):
        raise ValueError(f"strategy must be 'greedy' or 'contiguous', got {strategy!r}")
    key = key or (lambda item: item)
    cost = cost or (lambda item: 1.0)
    keys = [key(it) for it in items]
    if len(set(keys)) != len(keys):
        raise ValueError(f"shard keys must be unique, got {len(keys) - len(set(keys))} duplicates")
    costs = [float(cost(it)) for it in items]
    if any(not c >= 0 for c in costs):
        raise ValueError(f"item costs must be >= 0, got {[c for c in costs if not c >= 0][:5]}")
    order = sorted(range(len(items)), key=lambda i: keys[i])
    owner = _greedy(order, costs, world) if strategy == "greedy" else _contiguous(order, costs, world)
    return [it for i, it in enumerate(items) if owner[i] == rank]


def _greedy(order: list[int], costs: list[float], world: int) -> dict[int, int]:
    """LPT (Graham 1969): decreasing cost, each item to the rank with the least load so far."""
    load = [0.0] * world
    count = [0] * world
    owner = {}
    for i in sorted(order, key=lambda i: -costs[i]):  # stable: equal costs keep the key order
        r = min(range(world), key=lambda r: (load[r], count[r], r))
        owner[i] = r
        load[r] += costs[i]
        count[r] += 1
    return owner


def _contiguous(order: list[int], costs: list[float], world: int) -> dict[int, int]:
    """Sorted items cut into `world` consecutive runs: item j goes to the rank whose cost band holds it."""
    total = sum(costs) or float(len(order)) or 1.0
    weights = costs if sum(costs) > 0 else [1.0] * len(costs)
    owner, before = {}, 0.0
    for i in order:
        mid = before + weights[i] / 2
        owner[i] = min(world - 1, int(mid * world / total))
        before += weights[i]
    return owner


# ---- collectives --------------------------------------------------------------------------------------
def all_reduce_sum(tensors: Sequence[Any], group: Any, dtype: Any = None) -> None:
    """Sum each tensor over the ranks, in place, with one all-reduce of a packed buffer in `dtype`.

    `dtype` defaults to float64 (sums of float32 parts are then exact to ~1e-16 relative, so the result
    hardly depends on the number of ranks); pass float32 to halve the traffic.
    """
    import torch
    import torch.distributed as dist

    if group is None or not tensors:
        return
    dtype = dtype or torch.float64
    device = _comm_device(group, tensors[0].device)
    flat = torch.cat([t.detach().reshape(-1).to(device=device, dtype=dtype) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view(t.shape))
        offset += n


def all_reduce_accumulator(acc: Any, group: Any, dtype: Any = None) -> None:
    """Fused all-reduce of a blending Accumulator: value and weight buffers summed in one collective."""
    if getattr(acc, "_done", False):
        raise RuntimeError("the accumulator was already normalised by result(); reduce before result()")
    all_reduce_sum([acc.value, acc.weight], group, dtype)


def all_reduce_max(value: int, group: Any) -> int:
    """The largest of one int over the ranks (e.g. a channel count that an empty shard cannot know)."""
    import torch
    import torch.distributed as dist

    if group is None:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=_comm_device(group, None))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def all_gather_cat(tensor: Any, group: Any, dim: int = 0) -> Any:
    """Concatenate every rank's tensor along `dim` in rank order; sizes along `dim` may differ (even 0).

    The other dimensions must agree. Used for attention keys/values: each rank computes them for its
    tokens, every rank gets all of them.
    """
    import torch
    import torch.distributed as dist

    if group is None:
        return tensor
    rank, world = rank_world(group)
    device = _comm_device(group, tensor.device)
    dim = dim % tensor.ndim
    shape = torch.tensor(list(tensor.shape), dtype=torch.int64, device=device)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)
    shapes = [s.tolist() for s in shapes]
    others = [[n for d, n in enumerate(s) if d != dim] for s in shapes]
    if any(o != others[rank] for o in others):
        raise ValueError(f"all_gather_cat: shapes {shapes} differ outside dim {dim}")
    longest = max(s[dim] for s in shapes)
    padded = list(tensor.shape)
    padded[dim] = longest
    buf = torch.zeros(padded, dtype=tensor.dtype, device=device)
    buf.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
    parts = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(parts, buf, group=group)
    out = torch.cat([p.narrow(dim, 0, s[dim]) for p, s in zip(parts, shapes, strict=True)], dim=dim)
    return out.to(tensor.device)


def merge_moments(parts: Sequence[tuple[Any, Any, Any]]) -> tuple[Any, Any, Any]:
    """Chan et al. (1979) pairwise merge of (count, mean, M2) triples, left to right; empty parts skipped."""
    n, mean, m2 = parts[0]
    for nb, mb, m2b in parts[1:]:
        nb = float(nb)
        if nb == 0:
            continue
        if n == 0:
            n, mean, m2 = nb, mb, m2b
            continue
        total = n + nb
        delta = mb - mean
        mean = mean + delta * (nb / total)
        m2 = m2 + m2b + delta.square() * (n * nb / total)
        n = total
    return n, mean, m2


def all_merge_moments(count: float, mean: Any, m2: Any, group: Any) -> tuple[float, Any, Any]:
    """Exact global (count, mean, M2) from every rank's local ones: all-gather, Chan merge in rank order.

    `mean` and `m2` are float64 tensors of one shape (e.g. (batch, groups) for GroupNorm), zeros with
    count 0 on a rank that saw no pixels. Merging about each part's own mean is exact, unlike summing
    per-shard variances (wrong by the spread of the shard means). Every rank gets the same result.
    """
    import torch
    import torch.distributed as dist

    if group is None:
        return count, mean, m2
    _, world = rank_world(group)
    device = _comm_device(group, mean.device)
    packed = torch.cat([torch.tensor([float(count)], dtype=torch.float64, device=device),
                        mean.detach().reshape(-1).to(device, torch.float64),
                        m2.detach().reshape(-1).to(device, torch.float64)])
    parts = [torch.empty_like(packed) for _ in range(world)]
    dist.all_gather(parts, packed, group=group)
    k = mean.numel()
    triples = [(float(p[0]), p[1 : 1 + k].view(mean.shape), p[1 + k :].view(mean.shape)) for p in parts]
    n, mu, M2 = merge_moments(triples)
    return n, mu.to(mean.device), M2.to(mean.device)


def _intersect(a: Box, b: Box) -> Box | None:
    y0, y1, x0, x1 = max(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3])
    return (y0, y1, x0, x1) if y0 < y1 and x0 < x1 else None


def exchange_plan(owned: Sequence[Sequence[Box]],
                  needed: Sequence[Sequence[Box]]) -> list[tuple[int, int, Box]]:
    """(src, dst, box) transfers that bring every needed pixel once from the rank that owns it.

    `owned[r]`: the boxes whose pixels rank r holds (disjoint across ranks: tile cores); `needed[r]`: the
    boxes rank r must read (cores plus halos; they may overlap). Deterministic, the same on every rank.
    """
    plan = []
    for dst, boxes in enumerate(needed):
        for src, mine in enumerate(owned):
            if src == dst:
                continue
            for ob in mine:
                cuts = [c for c in (_intersect(ob, nb) for nb in boxes) if c is not None]
                plan += [(src, dst, c) for c in _disjoint_union(cuts)]
    return plan


def _disjoint_union(rects: Sequence[Box]) -> list[Box]:
    """Disjoint boxes covering the union of `rects` (coordinate compression, row runs merged downwards)."""
    if len(rects) <= 1:
        return list(rects)
    ys = sorted({v for r in rects for v in r[:2]})
    xs = sorted({v for r in rects for v in r[2:]})
    out: list[list[int]] = []
    open_runs: dict[tuple[int, int], list[int]] = {}
    for y0, y1 in zip(ys, ys[1:], strict=False):
        cover = [any(r[0] <= y0 and y1 <= r[1] and r[2] <= x0 and x1 <= r[3] for r in rects)
                 for x0, x1 in zip(xs, xs[1:], strict=False)]
        runs, i = [], 0
        while i < len(cover):
            if cover[i]:
                j = i
                while j + 1 < len(cover) and cover[j + 1]:
                    j += 1
                runs.append((xs[i], xs[j + 1]))
                i = j + 1
            else:
                i += 1
        nxt = {}
        for run in runs:
            box = open_runs.get(run)
            if box is not None and box[1] == y0:
                box[1] = y1  # the same run continues: extend the box downwards
            else:
                box = [y0, y1, run[0], run[1]]
                out.append(box)
            nxt[run] = box
        open_runs = nxt
    return [(b[0], b[1], b[2], b[3]) for b in out]


def exchange_boxes(tensor: Any, owned: Sequence[Box], needed: Sequence[Box], group: Any) -> int:
    """Fill the `needed` boxes of a full-size (..., H, W) tensor, in place, from the ranks owning them.

    Halo exchange between tile-parallel segments (and, with needed = [whole image] on rank 0 only, the
    gather of an output): box lists are all-gathered, then each intersection goes point to point, in
    the same order on every rank. Returns the number of elements this rank received.
    """
    import torch
    import torch.distributed as dist

    if group is None:
        return 0
    rank, world = rank_world(group)
    lists: list[Any] = [None] * world
    dist.all_gather_object(lists, ([tuple(b) for b in owned], [tuple(b) for b in needed]), group=group)
    plan = exchange_plan([o for o, _ in lists], [n for _, n in lists])
    device = _comm_device(group, tensor.device)
    received, pending = 0, []
    for tag, (src, dst, box) in enumerate(plan):
        sl = (..., slice(box[0], box[1]), slice(box[2], box[3]))
        if src == rank:
            buf = tensor[sl].contiguous().to(device)
            pending.append((dist.isend(buf, dst=_global(group, dst), group=group, tag=tag), buf, None))
        elif dst == rank:
            buf = torch.empty(tensor[sl].shape, dtype=tensor.dtype, device=device)
            pending.append((dist.irecv(buf, src=_global(group, src), group=group, tag=tag), buf, sl))
    for work, buf, sl in pending:
        work.wait()
        if sl is not None:  # a receive (sends keep their buffer alive until here)
            tensor[sl] = buf.to(tensor.device)
            received += buf.numel()
    return received


def _global(group: Any, rank: int) -> int:
    import torch.distributed as dist

    return rank if group is dist.group.WORLD else dist.get_global_rank(group, rank)


def broadcast(value: Any, group: Any, src: int = 0) -> Any:
    """Rank `src`'s tensor (in place, returned) or picklable object, on every rank."""
    import torch
    import torch.distributed as dist

    if group is None:
        return value
    src_global = _global(group, src)
    if isinstance(value, torch.Tensor):
        device = _comm_device(group, value.device)
        buf = value.to(device)
        dist.broadcast(buf, src=src_global, group=group)
        if buf is not value:
            value.copy_(buf)
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src_global, group=group)
    return box[0]


def barrier(group: Any, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Wait for every rank; gloo names the ranks that did not arrive within `timeout` seconds."""
    import torch.distributed as dist

    if group is None:
        return
    if "gloo" in _backend(group):
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout))
    else:
        dist.barrier(group=group)  # NCCL: bounded by the timeout given to init_process_group


# ---- launching ----------------------------------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free now (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_from_env(backend: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> tuple[int, int]:
    """init_process_group for a torchrun-launched process (env:// rendezvous); returns (rank, world)."""
    import torch
    import torch.distributed as dist

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
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def torchrun_command(argv: Sequence[str], nproc: int, module: str = "tilewise.cli") -> list[str]:
    """The argv that relaunches `python -m module argv` on `nproc` local ranks with torchrun (no --nproc)."""
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
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", module, *rest]


def _write_failure(results: str, rank: int) -> None:
    """Record when and how this rank failed (read by `_first_failure`)."""
    import traceback

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
    import torch
    import torch.distributed as dist

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
    import torch
    import torch.multiprocessing as mp

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
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

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
