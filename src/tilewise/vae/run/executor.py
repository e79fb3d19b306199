"""Run a tile program over a tile grid, segment by segment: the tile interpreter of exact (and fast) mode.

The program is cut at every sync op whose input is produced in the current segment. Each segment runs
per tile (serpentine order) on exactly the region it needs, read from the staged full-size inputs
(`staging`), and writes the tile's core of its outputs into the next staged values, while the exact
per-(batch, group) statistics of every value a later GroupNorm normalises are merged over the tile
cores (`stats`). A global attention op is a segment of its own: keys and values of all tokens first,
then the queries of each tile in chunks. GroupNorms given fixed statistics (fast mode) are pointwise
and cut nothing, so a run of them executes tile by tile end to end. Big tiles of local segments run in
row bands (`bands`); with a process group each rank runs a band of tile rows (`sharding`).
(A little over 400 lines: the segment loop and the per-tile step it calls are one piece of control
flow; what could leave it, staging, statistics, bands and sharding, already has.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..locality.ops import Box, Op, RunContext, box_area, box_empty, map_box, sub_tensor
from ..locality.program import Program, Segment, back_propagate, last_use, split_segments
from .attention import keys_values, query_grid
from .bands import BAND_BYTES, band_rows, row_local, run_bands, tile_bands
from .sharding import RowBands, exchange_rows, gather_rows, merge_group_stats, stream_rows
from .staging import TRIM_FREE, Staging
from .stats import GroupStats

logger = logging.getLogger(__name__)


class NonFiniteError(FloatingPointError):
    """A NaN or inf appeared in a stage's output (`producer`: the op that made it; `dtype`: its dtype)."""

    def __init__(self, producer: str, dtype):
        why = ("in float16 this is the known SD-VAE overflow: run the VAE in float32 (vae.to(torch.float32)) "
               "or use an fp16-fixed VAE" if str(dtype) == "torch.float16" else
               "not an fp16 overflow: check the input and the VAE's weights for NaN or inf values")
        super().__init__(f"NaN or inf in the output of {producer!r} (dtype {dtype}); {why}")
        self.producer, self.dtype = producer, dtype


@dataclass
class ExecContext(RunContext):
    """RunContext of the executor: GroupNorm statistics are looked up, never computed on a tile; their
    per-channel affine is computed once per GroupNorm (not per tile: a GPU launches each kernel)."""

    affines: dict[int, Any] = field(default_factory=dict)  # id(op) -> (stats, (a, s))

    def group_stats(self, op, x, box, shape):
        stats = self.stats.get(id(op))
        if stats is None:
            raise AssertionError(f"statistics of {op.name} are not ready: a segment cut is missing")
        return stats

    def group_affine(self, op, x, box, shape):
        stats = self.group_stats(op, x, box, shape)
        kept = self.affines.get(id(op))
        if kept is None or kept[0] is not stats or kept[1][0].device != x.device:
            kept = self.affines[id(op)] = (stats, op.affine(stats, x))
        return kept[1]


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
    check_emitted: bool = True  # each emitted core checked before it leaves for the sink, one host sync
    # a core (False, a sink that discards them: with the segment's other checks, one sync a segment)
    stage_dir: str | None = None
    conv_workspace: int = 32 << 20  # convs on bigger tiles run in row bands (bounds CPU im2col buffers)
    stats_chunk: int = 1 << 20  # bytes of one pass of GroupNorm moments (0: one Welford pass, GPU plans)
    done: dict[int, Any] = field(default_factory=dict)  # tile index -> its output core, computed already
    probes: list[Box] = field(default_factory=list)  # reference-grid boxes whose own statistics are kept
    probe_stats: dict[tuple[str, int], Any] = field(default_factory=dict)  # (value, groups) -> GroupStats
    last_stats: dict[int, Any] = field(default_factory=dict)  # id(GroupNorm) -> (mean, var) of the last run
    group: Any = None  # torch.distributed group: tile rows sharded over its ranks (tilewise.sharding)
    staged_peak: int = 0  # most staged bytes this process held at once in the last run
    heap_slack: int = TRIM_FREE  # disk staging: freed heap kept resident for reuse (bytes, at most)
    band_bytes: int | None = BAND_BYTES  # local segments stream bigger tiles in row bands (run_bands)
    on_device: frozenset = frozenset()  # values staged on the device whatever `staging` says
    kv_chunk: int = 0  # global attention: keys / values in host memory, streamed this many tokens at a time
    query_rows: int = 0  # global attention: queries in row bands of this many reference rows (0: the tiles)
    read_ahead: bool = True  # host staging: the next tile's inputs read while a tile runs (where it can)

    _bands = None  # RowBands of the current run with a process group
    _checks = None  # FiniteChecks of the current segment
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
                          kv_chunk=self.kv_chunk, conv_workspace=self.conv_workspace)
        trackers = self._trackers(segs)
        self._band_cache, self._unit = {}, x.shape[0] * x.element_size()
        stage = Staging(self.staging, self.device, self.stage_dir, self.heap_slack, self.on_device)
        self._bands, self._batch = self._shard(segs, shapes), x.shape[0]
        out, out_v = None, self.program.output
        try:
            stage.put(self.program.input, x)
            self._finish_stats(ctx, trackers, self.program.input, x)
            last = self._last_reader(segs)
            bar = self._bar(sum(len(self._seg_tiles(seg, shapes)) for seg in segs))
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
                self._checks = FiniteChecks(self.check_finite)
                self._run_segment(seg, stage, shapes, ctx, trackers, out, emit, bar)
                for v in seg.outputs:
                    if v in trackers:
                        self._finish_stats(ctx, trackers, v, None)
                        for acc in trackers[v].values():  # (the merged mean and var: one sum)
                            self._checks.add(_producer(seg, v), acc.stacked, dtype=x.dtype)
                self._checks.finish()
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
        from ..distributed import rank_world

        if self.probes:
            raise ValueError("probes (fast-mode low pass) run on one process, not with a process group")
        rank, world = rank_world(self.group)
        grid = self._grid(shapes)
        bands = RowBands.build(grid, rank, world)
        bands.plan_segments(segs, shapes, grid, self.ref, skip={self.program.input})
        return bands

    def _seg_tiles(self, seg, shapes) -> list:
        """The tiles a segment runs: the grid's, or an attention segment's query bands (`query_rows`)."""
        if seg.kind == "attention" and self.query_rows and self._bands is None:
            return list(query_grid(shapes[self.ref], self.query_rows))
        return self._my_tiles(shapes)

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
        mine = self._bands.owned_rows(rows)
        if emit is None:
            return gather_rows(out, mine, rows, self.group)
        stream_rows(out, mine, self._bands, rows, emit, self.group)
        return None

    # -- pieces ----------------------------------------------------------------------------------

    def _grid(self, shapes):
        from ..geometry import TileGrid

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
                    out.setdefault(op.src[0], {})[op.groups] = GroupStats(op.groups, self.stats_chunk)
        return out

    def _finish_stats(self, ctx, trackers, value: str, full) -> None:
        """Publish the merged statistics of value to every exact GroupNorm reading it."""
        if value not in trackers:
            return
        for g, acc in trackers[value].items():
            if full is not None:
                acc.add(full)  # the program input: every rank holds all of it
            elif self._bands is not None:
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
        """Keys and values of every token (`attention.keys_values`), on the device or, streamed, in host
        memory."""
        op = seg.ops[0]
        n_name = op.src[0]
        h, w = shapes[n_name]
        rows = (0, h) if self._bands is None else self._bands.owned_rows(h)
        chunk = self.kv_chunk or self.query_chunk  # (streamed: made a key chunk at a time)
        ctx.kv[id(op)] = keys_values(op, lambda box: stage.read(n_name, box), h, w, rows, chunk, self.device,
                                     self.kv_chunk > 0, self.group)

    def _run_segment(self, seg, stage, shapes, ctx, trackers, out, emit, bar) -> None:
        """Every tile of the grid: read the needed regions, run the ops, write the cores."""
        ref = shapes[self.ref]
        last = last_use(seg.ops, seg.outputs)
        tiles = self._seg_tiles(seg, shapes)
        ahead = [v for v in seg.inputs if self.read_ahead and stage.prefetches(v)]  # (read a tile ahead)
        for k, tile in enumerate(tiles):
            if ahead and k + 1 < len(tiles):
                self._prefetch(seg, tiles[k + 1], shapes, stage, ahead)
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
            stage.trim()  # disk staging: at most heap_slack of freed heap stays resident
            bar.update(1)
        stage.drop_fetched()

    def _prefetch(self, seg, tile, shapes, stage: Staging, values) -> None:
        """Start reading the host-staged inputs of a tile's first band (it runs next: the copies overlap
        this tile's compute; `copies`)."""
        ref = shapes[self.ref]
        cores = {v: map_box(tile.core, ref, shapes[v]) for v in seg.outputs}
        if tile.index in self.done or all(box_empty(b) for b in cores.values()):
            return
        bands = self._tile_bands(seg, tile.core, shapes)
        if bands:
            need = back_propagate(seg.ops, bands[0], shapes)
            for v in values:
                if v in need:
                    stage.prefetch(v, need[v])

    def _run_tile(self, seg, stage, shapes, ctx, core: Box, last):
        """The segment's ops on one tile (reference box `core`), each on the box it needs (back-propagated
        from the cores of the segment's outputs): yields (cores, values) per row band of the tile."""
        return run_bands(seg, stage, ctx, self._tile_bands(seg, core, shapes), shapes, last)

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
        if v == self.program.output and emit is not None and self.check_emitted:
            self._checks.now(_producer(seg, v), c)  # before it leaves for the sink
        elif v not in trackers:  # (a value whose statistics are merged is checked through them)
            self._checks.add(_producer(seg, v), c)
        for acc in trackers.get(v, {}).values():
            acc.add(c)
        for pb in self.probes if v in trackers else ():
            b = map_box(pb, self._shapes[self.ref], self._shapes[v])
            b = (max(b[0], core[0]), min(b[1], core[1]), max(b[2], core[2]), min(b[3], core[3]))
            if not box_empty(b):
                for g in trackers[v]:
                    self.probe_stats.setdefault((v, g), GroupStats(g, self.stats_chunk)).add(
                        sub_tensor(t, have, b))
        if v == self.program.output:
            if emit is not None and (self._bands is None or self._bands.rank == 0):
                emit(core, c)
            else:
                y0, y1, x0, x1 = core
                out[..., y0 - self._out_lo : y1 - self._out_lo, x0:x1] = c
        else:
            stage.write(v, core, c)


class FiniteChecks:
    """NaN / inf checks of one segment's stored values with one host synchronisation per segment.

    Each stored core adds one reduction kept on the device (a float64 sum: finite values cannot overflow
    it); values whose GroupNorm statistics are merged add those instead (a NaN or inf makes them
    non-finite), which costs no pass over the values. `finish` reads them back together and raises
    NonFiniteError naming the first producer whose values were not finite."""

    def __init__(self, enabled: bool = True):
        self.enabled, self.sums, self.names = enabled, [], []

    def add(self, producer: str, *values, dtype=None) -> None:
        """Check values made by `producer` (of `dtype`, when they are its statistics) at `finish`."""
        if self.enabled:
            import torch

            for t in values:
                self.sums.append(t.sum(dtype=torch.float64))
                self.names.append((producer, dtype or t.dtype))

    def now(self, producer: str, value) -> None:
        """Check at once (a value about to leave for a sink)."""
        if self.enabled and not _all_finite(value):
            raise NonFiniteError(producer, value.dtype)

    def finish(self) -> None:
        if not self.sums:
            return
        import torch

        sums, names = self.sums, self.names
        self.sums, self.names = [], []
        if bool(torch.stack(sums).sum().isfinite()):
            return
        producer, dtype = next(n for n, t in zip(names, sums, strict=True) if not bool(t.isfinite()))
        raise NonFiniteError(producer, dtype)


def check_output(y, program):
    """y, after checking it has no NaN or inf (the untiled path's one check, raised as NonFiniteError)."""
    FiniteChecks().now(f"{program.name} (untiled)", y)
    return y


def _producer(seg, v: str) -> str:
    """The name of the op of seg that makes value v (v itself when none does)."""
    return next((op.name for op in seg.ops if op.dst == v), v)


def _all_finite(c) -> bool:
    """True when c has no NaN or inf: a finite sum proves it (one vectorised pass), else check each value."""
    import torch

    s = c.sum(dtype=torch.float32) if c.dtype in (torch.float16, torch.bfloat16) else c.sum()
    return bool(s.isfinite()) or bool(c.isfinite().all())
