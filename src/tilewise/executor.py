"""Run a tile program over a tile grid, segment by segment, with staging on device, host or disk.

Exact mode: the program is cut at every sync op whose input is produced in the current segment. Each
segment runs per tile (serpentine order) on exactly the region it needs, read from the staged
full-size inputs, and writes the tile's core of its outputs into the next staged tensors, while the
exact per-(batch, group) statistics of every value a later GroupNorm normalises are merged over the
tile cores (float64, Chan et al. pairwise update). A global attention op is a segment of its own: keys
and values of all tokens first, then the queries of each tile in chunks. GroupNorms given fixed
statistics (fast mode) are pointwise and cut nothing, so a run of them executes tile by tile end to end.
A local segment whose tile holds more than `BAND_BYTES` runs the tile in row bands (`run_bands`): each
band computes the rows of every convolution output the band before did not and carries the overlap
rows over, so the convolutions do the tile's work once while the memory is one band's.
Fast-mode statistics come from `sampled_tile_stats` (a stratified subset of the real tiles, run op by op
together; their outputs are kept and the tiled pass skips them). Disk staging stores channels-last
files read and written with positional I/O (one contiguous run per row of a tile's box), so staged data
lives in the kernel's page cache and never in this process's resident memory.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .locality.program import (
    Box,
    Op,
    Program,
    RunContext,
    Segment,
    back_propagate,
    box_empty,
    last_use,
    run_op,
    split_segments,
    sub_tensor,
)

logger = logging.getLogger(__name__)

STAGINGS = ("device", "host", "disk")


class NonFiniteError(FloatingPointError):
    """A NaN or inf appeared in a stage's output."""


def map_box(box: Box, ref: tuple[int, int], shape: tuple[int, int]) -> Box:
    """Map a box on the reference grid to a value of another resolution (floor of the scaled edges)."""
    y0, y1, x0, x1 = box
    return y0 * shape[0] // ref[0], y1 * shape[0] // ref[0], x0 * shape[1] // ref[1], x1 * shape[1] // ref[1]


def _trim_heap(min_free: int = 0) -> None:
    """Return freed heap memory to the OS (glibc malloc_trim): tile-sized buffers otherwise stay resident.

    With min_free, only when the heap holds at least that many free bytes (glibc mallinfo2): freed
    pages that are reused soon cost a page fault each after a trim, so the per-op trims of disk staging
    act only once fragmentation has grown."""
    global _LIBC, _MALLINFO2
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
        try:
            _MALLINFO2 = _LIBC.mallinfo2
            _MALLINFO2.restype = _mallinfo2_struct()
        except AttributeError:  # not glibc >= 2.33: trim unconditionally
            _MALLINFO2 = None
    if not _LIBC:
        return
    if min_free and _MALLINFO2 is not None and _MALLINFO2().fordblks < min_free:
        return
    _LIBC.malloc_trim(0)


def _mallinfo2_struct():
    import ctypes

    names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
             "keepcost")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in names]

    return MallInfo2


# Disk staging (the memory-bounded staging) returns freed heap to the OS once this much of it is free, checked
# after every op and tile: the default heap slack (TiledVAE lowers it to fit a memory_budget). Freed pages
# that stay resident are reused without a page fault; trimming earlier bounds the resident set tighter but
# re-faults them. Measured in-process at 1024 px (SD-architecture VAE, CPU, fast mode, disk staging), time /
# peak RSS growth: decode 96 MiB 158 s / 259 MiB, 192 MiB 155 s / 321, 288 MiB 148 s / 409, never
# 145 s / 556; encode (disk reads overwritten in place) 128 MiB 79 s / 265, 192 MiB 76 s / 354, 256 MiB
# 71 s / 431.
TRIM_FREE = 192 << 20

# Local segments whose tile holds more than this (three largest values) run in row bands of about this much.
# Measured in-process at 1024 px, 32-latent tiles, disk staging: exact decode 121 s / 180 MiB peak growth
# with whole tiles, 115 s / 175 MiB in bands; fast decode's sampled-tile pass peak 325 -> 254 MiB.
BAND_BYTES = 32 << 20


_LIBC = None
_MALLINFO2 = None


class GroupStats:
    """Exact per-(batch, group) mean and variance merged over disjoint tiles (Chan et al. 1979)."""

    def __init__(self, groups: int):
        self.groups = groups
        self.n = 0
        self.mean = None
        self.m2 = None

    def add(self, x) -> None:
        """Merge the statistics of tile x (B, C, h, w): shifted two-pass moments, then the Chan update."""
        nb = x[0].numel() // self.groups
        if nb == 0:
            return
        mb, m2b = _moments(x.detach(), self.groups)
        if self.mean is None:
            self.n, self.mean, self.m2 = nb, mb, m2b
            return
        n = self.n + nb
        delta = mb - self.mean
        self.mean = self.mean + delta * (nb / n)
        self.m2 = self.m2 + m2b + delta.square() * (self.n * nb / n)
        self.n = n

    def result(self):
        """(mean, biased variance) as float64 (B, groups) tensors, as torch's GroupNorm uses."""
        return self.mean, self.m2 / self.n


def _moments(x, groups: int, chunk: int = 1 << 20):
    """Per-(batch, group) mean and sum of squared deviations of x (B, C, h, w) as float64, in two passes:
    per-channel cascade sums of x, then of (x - m)^2 shifted by the float32 group mean m, a band of rows
    at a time through one buffer in x's memory layout (NCHW or channels-last, read without a copy).

    torch.var_mean's Welford reduction is scalar on CPU (~10x slower than these vectorised sums) and a
    whole-tile temporary costs page faults; the shift keeps float32 sums accurate (no E[x^2] - E[x]^2).
    """
    import torch

    b, c, h, w = x.shape
    cg = c // groups
    n = cg * h * w
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    m = x.sum((2, 3), dtype=acc).view(b, groups, cg).sum(-1) / n  # (B, G)
    mc = m.repeat_interleave(cg, dim=1).view(b, c, 1, 1)
    rows = max(1, min(h, chunk // max(b * c * w * 4, 1)))
    fmt = torch.channels_last if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(
        memory_format=torch.channels_last) else torch.contiguous_format
    buf = torch.empty((b, c, rows, w), dtype=acc, device=x.device, memory_format=fmt)
    s1 = s2 = 0
    for y in range(0, h, rows):
        xs = x[:, :, y : y + rows]
        d = torch.sub(xs, mc, out=buf[:, :, : xs.shape[2]])
        s1 = s1 + d.sum((2, 3)).to(torch.float64)
        s2 = s2 + d.square_().sum((2, 3)).to(torch.float64)
    s1, s2 = s1.view(b, groups, cg).sum(-1), s2.view(b, groups, cg).sum(-1)
    return m.to(torch.float64) + s1 / n, s2 - s1.square() / n


class DiskValue:
    """One staged value in a file, channels-last: (B, rows, W, C), so a box is one contiguous run per row.

    Read and written with positional I/O (os.preadv / os.pwritev): the data lives in the page cache, the
    kernel writes it back when it likes, and nothing of it is mapped into this process (a mapped file's
    touched pages count as resident and, on current kernels, come in folios much larger than a tile's
    row run: a 64 MiB tile box mapped ~230 MiB of resident pages).
    """

    _CHUNK = 8 << 20  # bytes of a write's channels-last copy at a time

    def __init__(self, path: str, shape: tuple[int, ...], dtype):
        import torch

        self.path, self.shape, self.dtype = path, tuple(shape), dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self.fd, math.prod(shape) * self.itemsize)  # sparse: unwritten parts read as zeros

    def _runs(self, y0: int, y1: int, x0: int, x1: int):
        """(batch, row, byte offset) of each row run of a box."""
        b, c, h, w = self.shape
        for i in range(b):
            for y in range(y0, y1):
                yield i, y - y0, ((i * h + y) * w + x0) * c * self.itemsize

    def read(self, y0: int, y1: int, x0: int, x1: int):
        """The box as a new (B, C, h, w) tensor in channels-last memory."""
        import torch

        b, c = self.shape[:2]
        out = torch.empty((b, y1 - y0, x1 - x0, c), dtype=self.dtype)
        raw = out.view(torch.uint8).numpy()
        want = (x1 - x0) * c * self.itemsize
        for i, r, off in self._runs(y0, y1, x0, x1):
            if want and os.preadv(self.fd, [raw[i, r]], off) != want:
                raise OSError(f"short read from the staging file {self.path}")
        return out.permute(0, 3, 1, 2)

    def write(self, y0: int, y1: int, x0: int, x1: int, value) -> None:
        """Write a (B, C, h, w) tensor into the box."""
        import torch

        b, c = self.shape[:2]
        want = (x1 - x0) * c * self.itemsize
        step = max(1, self._CHUNK // max(1, b * want))
        for r0 in range(0, y1 - y0, step):
            part = value[:, :, r0 : r0 + step].detach().to("cpu", self.dtype)
            raw = part.permute(0, 2, 3, 1).contiguous().view(torch.uint8).numpy()
            for i, r, off in self._runs(y0 + r0, y0 + r0 + part.shape[2], x0, x1):
                if want and os.pwritev(self.fd, [raw[i, r]], off) != want:
                    raise OSError(f"short write to the staging file {self.path} (disk full?)")

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)


class Staging:
    """Full-size tensors between segments, held on the device, in host memory or in disk files."""

    def __init__(self, where: str, device, directory: str | None = None):
        if where not in STAGINGS:
            raise ValueError(f"staging must be one of {STAGINGS}, got {where!r}")
        self.where, self.device = where, device
        self.dir = None
        if where == "disk":
            self.dir = tempfile.TemporaryDirectory(prefix="tilewise-stage-", dir=directory)
        self.tensors: dict[str, Any] = {}  # value -> tensor (device / host) or DiskValue
        self.offsets: dict[str, int] = {}  # first stored row of values held as a band of rows
        self.sizes: dict[str, int] = {}  # bytes of each allocated staged tensor
        self.peak = 0  # most allocated staged bytes alive at once

    def alloc(self, name: str, shape: tuple[int, ...], dtype, rows: tuple[int, int] | None = None) -> None:
        """Allocate a staged tensor; with `rows` = (lo, hi) only those rows of the value (a rank's band)."""
        import torch

        if rows is not None:
            self.offsets[name] = rows[0]
            shape = (*shape[:-2], rows[1] - rows[0], shape[-1])
        size = torch.empty((), dtype=dtype).element_size()
        self.sizes[name] = size * math.prod(shape)
        self.peak = max(self.peak, sum(self.sizes.values()))
        if self.where == "device":
            self.tensors[name] = torch.empty(shape, dtype=dtype, device=self.device)
        elif self.where == "host" or len(shape) != 4:
            pin = torch.device(self.device).type == "cuda"
            self.tensors[name] = torch.empty(shape, dtype=dtype, pin_memory=pin)
        else:
            path = os.path.join(self.dir.name, f"{name.replace('/', '_')}.bin")
            self.tensors[name] = DiskValue(path, shape, dtype)

    def put(self, name: str, tensor) -> None:
        """Stage an existing full tensor (the program input) without copying."""
        self.tensors[name] = tensor

    def info(self, name: str) -> tuple[tuple[int, ...], Any, Any]:
        """(stored shape, dtype, device) of a staged value."""
        t = self.tensors[name]
        if isinstance(t, DiskValue):
            import torch

            return t.shape, t.dtype, torch.device("cpu")
        return tuple(t.shape), t.dtype, t.device

    def read(self, name: str, box: Box):
        """The box of a staged tensor, on the device (from disk: a new tensor in channels-last memory)."""
        y0, y1, x0, x1 = box
        off = self.offsets.get(name, 0)
        t = self.tensors[name]
        if isinstance(t, DiskValue):
            return t.read(y0 - off, y1 - off, x0, x1).to(self.device, non_blocking=True)
        return t[..., y0 - off : y1 - off, x0:x1].to(self.device, non_blocking=True)

    def reads_copy(self, name: str) -> bool:
        """Whether read(name, ...) returns a new tensor of its own (disk), not a view of staged memory."""
        return isinstance(self.tensors.get(name), DiskValue)

    def write(self, name: str, box: Box, value) -> None:
        """Write value into the box of a staged tensor."""
        y0, y1, x0, x1 = box
        off = self.offsets.get(name, 0)
        t = self.tensors[name]
        if isinstance(t, DiskValue):
            t.write(y0 - off, y1 - off, x0, x1, value)
        else:
            t[..., y0 - off : y1 - off, x0:x1].copy_(value, non_blocking=True)

    def free(self, name: str) -> None:
        """Drop a staged tensor (and its file)."""
        t = self.tensors.pop(name, None)
        self.offsets.pop(name, None)
        self.sizes.pop(name, None)
        if isinstance(t, DiskValue):
            t.close()

    def close(self) -> None:
        """Free everything."""
        for name in list(self.tensors):
            self.free(name)
        if self.dir is not None:
            self.dir.cleanup()


@dataclass
class ExecContext(RunContext):
    """RunContext of the executor: GroupNorm statistics are looked up, never computed on a tile."""

    def group_stats(self, op, x, box, shape):
        stats = self.stats.get(id(op))
        if stats is None:
            raise AssertionError(f"statistics of {op.name} are not ready: a segment cut is missing")
        return stats


@dataclass
class Executor:
    """Runs a program over a tile grid on a reference value (the latent), segment by segment."""

    program: Program
    tile_size: int
    ref: str  # the value whose pixels tile_size counts (decoder input / encoder output latent)
    attention: str = "global"
    staging: str = "device"
    device: Any = "cpu"
    fixed_stats: dict[int, Any] = field(default_factory=dict)  # id(GroupNorm op) -> (mean, var)
    query_chunk: int = 4096
    progress: bool = True
    check_finite: bool = True
    stage_dir: str | None = None
    conv_workspace: int = 32 << 20  # convs on bigger tiles run in row bands (bounds CPU im2col buffers)
    done: dict[int, Any] = field(default_factory=dict)  # tile index -> its output core, computed already
    probes: list[Box] = field(default_factory=list)  # reference-grid boxes whose own statistics are kept
    probe_stats: dict[tuple[str, int], Any] = field(default_factory=dict)  # (value, groups) -> GroupStats
    last_stats: dict[int, Any] = field(default_factory=dict)  # id(GroupNorm) -> (mean, var) of the last run
    group: Any = None  # torch.distributed group: tile rows sharded over its ranks (tilewise.sharding)
    staged_peak: int = 0  # most staged bytes this process held at once in the last run
    heap_slack: int = TRIM_FREE  # disk staging: freed heap kept resident for reuse (bytes, at most)
    band_bytes: int | None = BAND_BYTES  # local segments stream bigger tiles in row bands (run_bands)

    _bands = None  # RowBands of the current run with a process group
    _out_lo = 0  # first output row held by this process
    _batch = 1

    def is_global(self, op: Op) -> bool:
        """Barrier ops: GroupNorms without fixed statistics, and attention when global."""
        if op.kind == "group_norm":
            return id(op) not in self.fixed_stats
        if op.kind == "attention":
            return self.attention == "global"
        return op.sync

    def segments(self) -> list[Segment]:
        """The program cut at its barriers."""
        return split_segments(self.program, self.is_global)

    def run(self, x, emit: Callable | None = None):
        """Run on x (B, C, H, W); returns the output tensor, or streams its tile cores to emit(box, value)."""

        shapes = self.program.shapes(tuple(x.shape[-2:]))
        self._shapes = shapes
        chans = self.program.channels()
        segs = self.segments()
        ctx = ExecContext(stats=dict(self.fixed_stats), query_chunk=self.query_chunk,
                          conv_workspace=self.conv_workspace)
        trackers = self._trackers(segs)
        self._band_cache, self._unit = {}, x.shape[0] * x.element_size()
        stage = Staging(self.staging, self.device, self.stage_dir)
        self._bands, self._batch = self._shard(segs, shapes), x.shape[0]
        out, out_v = None, self.program.output
        try:
            stage.put(self.program.input, x)
            self._finish_stats(ctx, trackers, self.program.input, x)
            last = self._last_reader(segs)
            bar = self._bar(len(segs) * len(self._my_tiles(shapes)))
            for i, seg in enumerate(segs):
                for v in seg.outputs:
                    full = (x.shape[0], chans[v], *shapes[v])
                    if v == out_v:
                        if emit is None or self._bands is not None:
                            out = self._alloc_output(full, x)
                    else:
                        rows = None if self._bands is None else self._bands.stored_rows(v, shapes[v][0])
                        stage.alloc(v, full, x.dtype, rows)
                self._exchange(i, seg, stage, shapes)
                if seg.kind == "attention":
                    self._prepare_attention(seg, stage, shapes, ctx)
                self._run_segment(seg, stage, shapes, ctx, trackers, out, emit, bar)
                for v in seg.outputs:
                    if v in trackers:
                        self._finish_stats(ctx, trackers, v, None)
                ctx.kv.clear()
                for v in [v for v, j in last.items() if j == i]:
                    stage.free(v)
            bar.close()
        finally:
            self.staged_peak = stage.peak
            stage.close()
        self.last_stats = ctx.stats
        return self._assemble(out, emit, shapes[out_v][0])

    # -- sharding over ranks (tilewise.sharding) ----------------------------------------------------

    def _shard(self, segs, shapes):
        """Row bands of this run when a process group is set (else None: every tile is ours)."""
        if self.group is None:
            return None
        from .distributed import rank_world
        from .sharding import RowBands

        if self.probes:
            raise ValueError("probes (fast-mode low pass) run on one process, not with a process group")
        rank, world = rank_world(self.group)
        grid = self._grid(shapes)
        bands = RowBands.build(grid, rank, world)
        bands.plan_segments(segs, shapes, grid, self.ref, skip={self.program.input})
        return bands

    def _my_tiles(self, shapes) -> list:
        """The grid's tiles this process runs, in visit order."""
        grid = self._grid(shapes)
        if self._bands is None:
            return list(grid)
        mine = self._bands.tiles[self._bands.rank]
        return [t for t in grid if t.index in mine]

    def _alloc_output(self, full, x):
        """The output tensor, or this rank's band of output rows (offset kept in self._out_lo)."""
        import torch

        self._out_lo = 0
        if self._bands is not None:
            lo, hi = self._bands.owned_rows(full[-2])
            self._out_lo, full = lo, (*full[:-2], hi - lo, full[-1])
        return torch.empty(full, dtype=x.dtype, device=x.device)

    def _exchange(self, i: int, seg, stage: Staging, shapes) -> None:
        """Bring the halo rows segment i reads from the ranks that computed them."""
        if self._bands is None:
            return
        from .sharding import exchange_rows

        for v in seg.inputs:
            if v == self.program.input:
                continue
            plan = self._bands.transfers(i, v, shapes[v][0])
            if plan:
                exchange_rows(stage, v, plan, self._bands.rank, self.group)

    def _assemble(self, out, emit, rows: int):
        """Single process: the output as is. Ranks: gathered on every rank, or streamed through rank 0."""
        if self._bands is None:
            return out
        from .sharding import gather_rows, stream_rows

        mine = self._bands.owned_rows(rows)
        if emit is None:
            return gather_rows(out, mine, rows, self.group)
        stream_rows(out, mine, self._bands, rows, emit, self.group)
        return None

    # -- pieces ----------------------------------------------------------------------------------

    def _grid(self, shapes):
        from .geometry import TileGrid

        h, w = shapes[self.ref]
        return TileGrid(h, w, (min(self.tile_size, h), min(self.tile_size, w)), order="serpentine")

    def _bar(self, total: int):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="tiles", unit="tile", disable=not self.progress, leave=False)

    def _trackers(self, segs: list[Segment]) -> dict[str, dict[int, GroupStats]]:
        """Values whose statistics a later exact GroupNorm needs: value -> groups -> accumulator."""
        out: dict[str, dict[int, GroupStats]] = {}
        for seg in segs:
            for op in seg.ops:
                if op.kind == "group_norm" and id(op) not in self.fixed_stats:
                    out.setdefault(op.src[0], {})[op.groups] = GroupStats(op.groups)
        return out

    def _finish_stats(self, ctx, trackers, value: str, full) -> None:
        """Publish the merged statistics of value to every exact GroupNorm reading it."""
        if value not in trackers:
            return
        for g, acc in trackers[value].items():
            if full is not None:
                acc.add(full)  # the program input: every rank holds all of it
            elif self._bands is not None:
                from .sharding import merge_group_stats

                merge_group_stats(acc, self.group, self._batch)
            for op in self.program.ops:
                if op.kind == "group_norm" and op.src[0] == value and op.groups == g:
                    if id(op) not in self.fixed_stats:
                        ctx.stats[id(op)] = acc.result()

    def _last_reader(self, segs: list[Segment]) -> dict[str, int]:
        """Index of the last segment reading each staged value."""
        last: dict[str, int] = {}
        for i, seg in enumerate(segs):
            for v in seg.inputs:
                last[v] = i
        last.pop(self.program.input, None)
        return last

    def _prepare_attention(self, seg: Segment, stage: Staging, shapes, ctx) -> None:
        """Keys and values of every token, computed band by band from the staged normalised input."""
        import torch

        op = seg.ops[0]
        n_name = op.src[0]
        h, w = shapes[n_name]
        lo, hi = (0, h) if self._bands is None else self._bands.owned_rows(h)
        band = max(1, min(h, self.query_chunk // max(w, 1)))
        ks, vs = [], []
        for y0 in range(lo, hi, band):
            k, v = op.keys_values(stage.read(n_name, (y0, min(hi, y0 + band), 0, w)))
            ks.append(k)
            vs.append(v)
        if not ks:  # a rank without rows: no tokens, the right shapes
            k, v = op.keys_values(stage.read(n_name, (lo, lo, 0, w)))
            ks, vs = [k], [v]
        k, v = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
        if self._bands is not None:  # every rank's tokens, in rank order = row-major token order
            from .distributed import all_gather_cat

            k, v = all_gather_cat(k, self.group, dim=2), all_gather_cat(v, self.group, dim=2)
        ctx.kv[id(op)] = (k, v)

    def _run_segment(self, seg, stage, shapes, ctx, trackers, out, emit, bar) -> None:
        """Every tile of the grid: read the needed regions, run the ops, write the cores."""
        ref = shapes[self.ref]
        last = last_use(seg.ops, seg.outputs)
        for tile in self._my_tiles(shapes):
            cores = {v: map_box(tile.core, ref, shapes[v]) for v in seg.outputs}
            cores = {v: b for v, b in cores.items() if not box_empty(b)}
            if cores and tile.index in self.done and list(cores) == [self.program.output]:
                vals = {self.program.output: (self.done[tile.index], cores[self.program.output])}
                for v, core in cores.items():
                    self._store(v, core, vals, stage, trackers, out, emit, seg)
            elif cores:
                for part, vals in self._run_tile(seg, stage, shapes, ctx, tile.core, last):
                    for v, core in part.items():
                        self._store(v, core, vals, stage, trackers, out, emit, seg)
            vals = None  # this tile's values die now, not while the next tile runs
            if stage.where == "disk":  # the memory-bounded staging: at most heap_slack of freed heap stays
                _trim_heap(self.heap_slack)  # (never trimmed otherwise: re-faulting cost ~7% of a decode)
            bar.update(1)

    def _run_tile(self, seg, stage, shapes, ctx, core: Box, last):
        """The segment's ops on one tile (reference box `core`), each on the box it needs (back-propagated
        from the cores of the segment's outputs): yields (cores, values) per row band of the tile."""
        return run_bands(seg, stage, ctx, self._tile_bands(seg, core, shapes), shapes, last,
                         slack=self.heap_slack)

    def _tile_bands(self, seg, core: Box, shapes) -> list[dict[str, Box]]:
        """The cores of the segment's outputs in one tile, cut in row bands (row-local segments whose tiles
        hold more than band_bytes; one band otherwise). Band cores of a value partition its tile core."""
        key = id(seg)
        if key not in self._band_cache:
            rows = None
            if row_local(seg) and self.band_bytes:
                tile = max(self._grid(shapes), key=lambda t: box_area(t.core))
                cores = {v: map_box(tile.core, shapes[self.ref], shapes[v]) for v in seg.outputs}
                need = back_propagate(seg.ops, cores, shapes)
                rows = band_rows(need, self.program.channels(), self._unit, tile.core, self.band_bytes)
            self._band_cache[key] = rows
        return tile_bands(core, seg.outputs, shapes, self.ref, self._band_cache[key])

    def _store(self, v, core, vals, stage, trackers, out, emit, seg) -> None:
        """Write the core of value v to its staged tensor (or the output), merging its statistics."""
        t, have = vals[v]
        c = sub_tensor(t, have, core)
        if self.check_finite and not _all_finite(c):
            producer = next((op.name for op in seg.ops if op.dst == v), v)
            raise NonFiniteError(
                f"NaN or inf in the output of {producer!r} (dtype {c.dtype}); in float16 this is the known "
                "SD-VAE overflow: run the VAE in float32 (vae.to(torch.float32)) or use an fp16-fixed VAE")
        for acc in trackers.get(v, {}).values():
            acc.add(c)
        for pb in self.probes if v in trackers else ():
            b = map_box(pb, self._shapes[self.ref], self._shapes[v])
            b = (max(b[0], core[0]), min(b[1], core[1]), max(b[2], core[2]), min(b[3], core[3]))
            if not box_empty(b):
                for g in trackers[v]:
                    self.probe_stats.setdefault((v, g), GroupStats(g)).add(sub_tensor(t, have, b))
        if v == self.program.output:
            if emit is not None and (self._bands is None or self._bands.rank == 0):
                emit(core, c)
            else:
                y0, y1, x0, x1 = core
                out[..., y0 - self._out_lo : y1 - self._out_lo, x0:x1] = c
        else:
            stage.write(v, core, c)


def _all_finite(c) -> bool:
    """True when c has no NaN or inf: a finite sum proves it (one vectorised pass), else check each value."""
    import torch

    s = c.sum(dtype=torch.float32) if c.dtype in (torch.float16, torch.bfloat16) else c.sum()
    return bool(s.isfinite()) or bool(c.isfinite().all())


def row_local(seg: Segment) -> bool:
    """Whether a segment may run in row bands: a local one without attention (attention="tile" attends
    over the box it is given, so a band would change what it sees)."""
    return seg.kind == "local" and all(op.kind != "attention" for op in seg.ops)


def box_area(box: Box) -> int:
    return max(0, box[1] - box[0]) * max(0, box[3] - box[2])


def working_bytes(need: dict[str, Box], chans: dict[str, int], unit: int) -> int:
    """Working-set estimate of ops run on the boxes `need`: its three largest values (unit: bytes per
    element times batch)."""
    sizes = sorted((box_area(b) * chans[v] * unit for v, b in need.items()), reverse=True)
    return sum(sizes[:3])


def band_rows(need: dict[str, Box], chans: dict[str, int], unit: int, core: Box,
              band_bytes: int | None) -> int | None:
    """Reference rows per band of the tile `core` so that a band holds about band_bytes (None: the
    tile's boxes `need` hold no more than that, or no band size is set)."""
    total = working_bytes(need, chans, unit)
    if not band_bytes or total <= band_bytes:
        return None
    return max(1, (core[1] - core[0]) * band_bytes // total)


def tile_bands(core: Box, outputs, shapes, ref: str, band: int | None) -> list[dict[str, Box]]:
    """Per band of `band` rows of the reference box `core` (top to bottom; None: the whole box), the
    non-empty boxes of `outputs` it maps to."""
    y0, y1, x0, x1 = core
    step = y1 - y0 if band is None else max(1, band)
    bands = []
    for a in range(y0, y1, max(step, 1)):
        part = (a, min(a + step, y1), x0, x1)
        cores = {v: map_box(part, shapes[ref], shapes[v]) for v in outputs}
        cores = {v: b for v, b in cores.items() if not box_empty(b)}
        if cores:
            bands.append(cores)
    return bands


def run_bands(seg: Segment, stage: Staging, ctx, bands: list, shapes, last: dict[str, int],
              slack: int = TRIM_FREE, needs: list[dict[str, Box]] | None = None):
    """A segment's ops on one tile given as row bands of its output cores (top to bottom): yields
    (cores, values) per band: value -> (tensor, box). A value is dropped after its last reader (`last`,
    from last_use) unless it is one of the band's cores; with disk staging the heap is trimmed after an
    op once `slack` bytes of it are free. `needs`: each band's boxes, when not back-propagated from its
    cores (the values kept are then those named in `bands`).

    Each band runs on the boxes back-propagated from its cores. A convolution computes only the rows of
    its output the band before did not and reuses the rows that band computed (carried over, cloned);
    the other ops (pointwise, GroupNorm with known statistics, add, resampling) recompute the overlap,
    same values. So the tile's convolutions do the tile's work once, halo rows included, while the
    memory is one band's boxes plus the carried rows.
    """
    import torch

    needs = needs or [back_propagate(seg.ops, cores, shapes) for cores in bands]
    carry: dict[str, tuple[Any, Box]] = {}  # conv output -> (rows the next band reuses, their box)
    trim = stage.where == "disk"
    for j, (cores, need) in enumerate(zip(bands, needs, strict=True)):
        nxt = needs[j + 1] if j + 1 < len(needs) else {}
        vals = {v: (stage.read(v, need[v]), need[v]) for v in seg.inputs if v in need}
        # views of staged memory (host / device staging, the program input) are never overwritten; a box
        # read from disk is this band's own copy, which an op may overwrite where it dies
        staged = [t for v, (t, _) in vals.items() if not stage.reads_copy(v)]
        for i, op in enumerate(seg.ops):
            d = op.dst
            if d not in need:
                continue
            box = need[d]
            c = carry.pop(d, None)
            if c is not None and (c[1][0] != box[0] or c[1][2:] != box[2:]):
                c = None  # (columns differ: a band without some output; recompute)
            if c is None:
                run_op(seg.ops, i, ctx, vals, need, shapes, last, keep=cores, shared=staged)
            elif c[1][1] >= box[1]:  # every row carried
                vals[d] = (sub_tensor(c[0], c[1], box), box)
                for s in set(op.src):
                    if last.get(s) == i and s not in cores:
                        del vals[s]
            else:
                run_op(seg.ops, i, ctx, vals, {d: (c[1][1], *box[1:])}, shapes, last, keep=cores,
                       shared=staged)
                vals[d] = (torch.cat([c[0], vals[d][0]], dim=-2), box)
            if op.kind == "conv" and not op._pointwise() and d in nxt and nxt[d][0] < box[1] \
                    and nxt[d][2:] == box[2:]:  # (a 1x1 convolution runs on its whole input box anyway)
                keep_box = (nxt[d][0], box[1], box[2], box[3])
                carry[d] = (sub_tensor(*vals[d], keep_box).clone(), keep_box)
            if trim:
                _trim_heap(slack)
        yield cores, vals
        del vals


def run_boxes(seg: Segment, stage: Staging, ctx, need: dict[str, Box], shapes, last: dict[str, int],
              keep, slack: int = TRIM_FREE) -> dict[str, Any]:
    """A segment's ops, each on its `need` box, from its staged inputs: value -> (tensor, box).

    A value is dropped after its last reader (`last`, from last_use) unless it is in `keep`. With disk
    staging the heap is trimmed after an op once `slack` bytes of it are free.
    """
    return next(run_bands(seg, stage, ctx, [keep], shapes, last, slack, needs=[need]))[1]


@dataclass
class _PooledContext(RunContext):
    """Estimation pass over a batch of k crops: GroupNorm statistics pooled over the crop interiors."""

    k: int = 1
    interiors: list[Box] = field(default_factory=list)  # per crop, in crop-local reference pixels
    crop: tuple[int, int] = (1, 1)
    record: dict[int, Any] = field(default_factory=dict)

    def group_stats(self, op, x, box, shape):
        b = x.shape[0] // self.k
        acc = GroupStats(op.groups)
        for i, inner in enumerate(self.interiors):
            acc.add(sub_tensor(x[i * b : (i + 1) * b], box, map_box(inner, self.crop, shape)))
        mean, var = acc.result()
        self.record[id(op)] = (mean, var)
        return mean.repeat(self.k, 1), var.repeat(self.k, 1)


def _crop_starts(n: int, c: int, k: int) -> list[int]:
    """k crops of size c spread over n pixels: stratified centres (i + 1/2) n / k."""
    return sorted({min(max(0, round((i + 0.5) * n / k - c / 2)), n - c) for i in range(k)})


def estimate_stats(program: Program, x, ref: str, crop: int, fixed: set[int], sample: float = 0.25,
                   min_per_axis: int = 2):
    """Fast-mode GroupNorm statistics from stratified crops of the real input, pooled over crop interiors.

    Crops of `crop` reference pixels are cut at stratified positions (at least `min_per_axis` per axis
    where they fit) covering about `sample` of the area, run as one batch in which every GroupNorm
    uses statistics pooled over all crops, excluding a quarter-crop margin on sides that are not the
    image border (where the crop's zero padding distorts values).
    Returns id(op) -> (mean, var) for the GroupNorm ops in `fixed`.
    """
    import torch

    shapes = program.shapes(tuple(x.shape[-2:]))
    rh, rw = shapes[ref]
    ch, cw = min(rh, crop), min(rw, crop)
    ky = max(min(min_per_axis, -(-rh // ch)), round(rh / ch * sample**0.5), 1)
    kx = max(min(min_per_axis, -(-rw // cw)), round(rw / cw * sample**0.5), 1)
    boxes = [(y, y + ch, x0, x0 + cw) for y in _crop_starts(rh, ch, ky) for x0 in _crop_starts(rw, cw, kx)]
    my, mx = ch // 4, cw // 4
    interiors = [(0 if b[0] == 0 else my, ch - (0 if b[1] == rh else my),
                  0 if b[2] == 0 else mx, cw - (0 if b[3] == rw else mx)) for b in boxes]
    ins = [map_box(b, (rh, rw), shapes[program.input]) for b in boxes]
    batch = torch.cat([x[..., b[0] : b[1], b[2] : b[3]] for b in ins])
    upto = max(i for i, op in enumerate(program.ops) if id(op) in fixed)
    head = Program(ops=program.ops[: upto + 1], input=program.input, output=program.ops[upto].dst,
                   in_channels=program.in_channels, name=program.name)
    ctx = _PooledContext(k=len(boxes), interiors=interiors, crop=(ch, cw))
    head.run(batch, ctx)
    logger.info("fast mode: statistics of %d GroupNorms from %d crops of %dx%d",
                len(fixed), len(boxes), ch, cw)
    return {i: s for i, s in ctx.record.items() if i in fixed}


def sample_tiles(grid, fraction: float) -> list:
    """Stratified subset of a tile grid: about `fraction` of the rows times the columns, evenly spread."""
    ky = max(1, min(grid.rows, round(grid.rows * fraction**0.5)))
    kx = max(1, min(grid.cols, round(grid.cols * fraction**0.5)))
    rows = {int((i + 0.5) * grid.rows / ky) for i in range(ky)}
    cols = {int((i + 0.5) * grid.cols / kx) for i in range(kx)}
    return [t for t in grid.tiles if t.row in rows and t.col in cols]


def sampled_tile_stats(program: Program, x, ref: str, tiles: list, fixed: set[int], query_chunk: int = 4096,
                       conv_workspace: int = 32 << 20, adjust: dict[int, Any] | None = None):
    """Fast-mode statistics from a sample of the real tiles, run layer-synchronously (no crop padding).

    Each sampled tile runs on exactly the regions its core needs (back-propagated through the whole
    program, zero padding only at the image border), so every value it computes is the one the tiled
    run computes with the same statistics. All sampled tiles advance op by op together; at each
    GroupNorm in `fixed` the statistics are merged (Chan) over the regions the sampled tiles hold, then
    applied. Returns (id(op) -> (mean, var), tile index -> output core): the sampled tiles' outputs are
    final, so the tiled pass skips them. Memory: the sampled tiles' working sets at once.
    """
    shapes = program.shapes(tuple(x.shape[-2:]))
    out_v = program.output
    needs = [back_propagate(program.ops, {out_v: map_box(t.core, shapes[ref], shapes[out_v])}, shapes)
             for t in tiles]
    vals = []
    for need in needs:
        y0, y1, x0, x1 = need[program.input]
        vals.append({program.input: (x[..., y0:y1, x0:x1], need[program.input])})
    ctx = RunContext(query_chunk=query_chunk, conv_workspace=conv_workspace)
    last = last_use(program.ops, [out_v])
    for i, op in enumerate(program.ops):
        if op.kind == "group_norm" and id(op) in fixed:
            acc = GroupStats(op.groups)
            for t, need, v in zip(tiles, needs, vals, strict=True):
                core = map_box(t.core, shapes[ref], shapes[op.dst])
                if op.dst in need and not box_empty(core):
                    acc.add(sub_tensor(*v[op.src[0]], core))
            ctx.stats[id(op)] = _adjusted(acc.result(), (adjust or {}).get(id(op)))
        for need, v in zip(needs, vals, strict=True):
            if op.dst in need:
                run_op(program.ops, i, ctx, v, need, shapes, last, shared=[x])
    done = {t.index: v[out_v][0] for t, v in zip(tiles, vals, strict=True)}
    logger.info("fast mode: statistics of %d GroupNorms from %d of the tiles", len(fixed), len(tiles))
    return {i: s for i, s in ctx.stats.items() if i in fixed}, done


def staged_tile_stats(program: Program, x, ref: str, tiles: list, fixed: set[int], staging: str = "disk",
                      device: Any = "cpu", stage_dir: str | None = None, query_chunk: int = 4096,
                      conv_workspace: int = 32 << 20, adjust: dict[int, Any] | None = None,
                      heap_slack: int = TRIM_FREE, band_bytes: int | None = BAND_BYTES):
    """`sampled_tile_stats` segment by segment with the sampled tiles' values staged between GroupNorms.

    Same values and statistics; memory is one tile's working set at a time (plus the staged regions, which
    disk staging releases after each tile) instead of every sampled tile's values at once. The program is
    cut before every GroupNorm in `fixed` whose input the current segment makes; each sampled tile runs a
    segment on its own back-propagated regions (core plus the halo of everything after it) and writes
    them to full-size staged tensors of which only those regions are ever touched. A GroupNorm's
    statistics are merged over the sampled cores read back from staging before its segment runs.
    """
    import torch

    shapes = program.shapes(tuple(x.shape[-2:]))
    chans = program.channels()
    out_v = program.output
    needs = [back_propagate(program.ops, {out_v: map_box(t.core, shapes[ref], shapes[out_v])}, shapes)
             for t in tiles]
    segs = split_segments(program, lambda op: op.kind == "group_norm" and id(op) in fixed)
    ctx = RunContext(query_chunk=query_chunk, conv_workspace=conv_workspace)
    readers: dict[str, set[int]] = {}  # value -> group counts of the fixed GroupNorms reading it
    for op in program.ops:
        if op.kind == "group_norm" and id(op) in fixed:
            readers.setdefault(op.src[0], set()).add(op.groups)
    accs: dict[tuple[str, int], GroupStats] = {}  # merged as the tiles write (no read back from staging)
    stage = Staging(staging, device, stage_dir)
    last = {}
    for i, seg in enumerate(segs):
        for v in seg.inputs:
            last[v] = i
    done = {}
    try:
        stage.put(program.input, x)
        for i, seg in enumerate(segs):
            for op in seg.ops:
                if op.kind == "group_norm" and id(op) in fixed and id(op) not in ctx.stats:
                    acc = accs.get((op.src[0], op.groups))
                    if acc is None:  # (the part's input: staged as given)
                        acc = _staged_group_stats(op, stage, tiles, needs, shapes, ref)
                    ctx.stats[id(op)] = _adjusted(acc.result(), (adjust or {}).get(id(op)))
            for v in seg.outputs:
                if v != out_v:
                    stage.alloc(v, (x.shape[0], chans[v], *shapes[v]), x.dtype)
            ops_last = last_use(seg.ops, seg.outputs)
            made = {v for op in seg.ops for v in (op.dst, *op.src)}
            unit = x.shape[0] * x.element_size()
            for t, need in zip(tiles, needs, strict=True):
                seg_need = {v: need[v] for v in made if v in need}
                boxes, bneeds = _tile_band_needs(program, t.core, ref, seg_need, need, shapes, chans, unit,
                                                 band_bytes if row_local(seg) else None)
                outs = []
                run = run_bands(seg, stage, ctx, [seg.outputs] * len(boxes), shapes, ops_last, heap_slack,
                                bneeds)
                for box, bneed, (_, vals) in zip(boxes, bneeds, run, strict=True):
                    for v in seg.outputs:
                        if v == out_v:
                            outs.append(vals[v][0])
                        elif v in vals:
                            stage.write(v, bneed[v], vals[v][0])
                            core = map_box(box, shapes[ref], shapes[v])
                            for g in readers.get(v, ()) if not box_empty(core) else ():
                                accs.setdefault((v, g), GroupStats(g)).add(sub_tensor(*vals[v], core))
                    del vals
                if outs:
                    done[t.index] = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
                _trim_heap(heap_slack)
            for v in [v for v, j in last.items() if j == i and v != program.input]:
                stage.free(v)
    finally:
        stage.close()
    logger.info("fast mode: statistics of %d GroupNorms from %d of the tiles (staged on %s)", len(fixed),
                len(tiles), staging)
    return {i: s for i, s in ctx.stats.items() if i in fixed}, done


def _tile_band_needs(program: Program, core: Box, ref: str, seg_need: dict[str, Box], need: dict[str, Box],
                     shapes, chans, unit: int, band_bytes: int | None) -> tuple[list[Box], list[dict]]:
    """A sampled tile's reference core cut in row bands for one segment (whose boxes are `seg_need`), and
    each band's boxes back-propagated through the whole program (one band: the tile's `need`)."""
    rows = band_rows(seg_need, chans, unit, core, band_bytes)
    if rows is None:
        return [core], [need]
    y0, y1, x0, x1 = core
    boxes = [(a, min(a + rows, y1), x0, x1) for a in range(y0, y1, rows)]
    out = program.output
    return boxes, [back_propagate(program.ops, {out: map_box(b, shapes[ref], shapes[out])}, shapes)
                   for b in boxes]


def _staged_group_stats(op, stage: Staging, tiles, needs, shapes, ref: str) -> GroupStats:
    """Statistics of a GroupNorm's input over the sampled tiles' cores, read back from staging."""
    acc = GroupStats(op.groups)
    src = op.src[0]
    for t, need in zip(tiles, needs, strict=True):
        core = map_box(t.core, shapes[ref], shapes[op.dst])
        if op.dst in need and not box_empty(core):
            acc.add(stage.read(src, core))
    return acc


def _adjusted(sample, low):
    """Difference / ratio estimator: sample statistics moved by (global - sample) of a cheap full pass.

    low = ((mean, var) over the whole image, (mean, var) over the sampled regions) of the low-resolution
    pass: mean = m_s + (M_low - m_low), var = v_s * V_low / v_low.
    """
    if low is None:
        return sample
    (mg, vg), (ms, vs) = low
    return sample[0] + (mg - ms), sample[1] * vg / vs.clamp_min(1e-12)
