"""Run a tile program over a tile grid, segment by segment: the tile interpreter of exact (and fast) mode.

The program is cut at every sync op whose input is produced in the current segment (`cut`). Each segment
runs per tile (serpentine order, `tile_grid`) on exactly the region it needs, read from the staged
full-size inputs (`staging`), and writes the tile's core of its outputs into the next staged values,
while the exact per-(batch, group) statistics of every value a later GroupNorm normalises are merged over
the tile cores (`stats`). A global attention op is a segment of its own: keys and values of all tokens
first, then the queries of each tile in chunks. GroupNorms given fixed statistics (fast mode) are
pointwise and cut nothing, so a run of them executes tile by tile end to end. Big tiles of local segments
run in row bands (`bands`); with a process group each rank runs a band of tile rows (`sharding`); with
`tile_batch` > 1, a local segment's same-shape tiles run stacked, as one batch (`batches`).

`Executor` is what to run and how (`RunOptions`); each call of `run` keeps its own state in a `_TileRun`
and returns a `RunResult`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from ...distributed import rank_world
from ...geometry import Box
from ...locality.boxes import box_area, box_empty, map_box, sub_tensor
from ...locality.ops import OpKind
from ...locality.program import (
    Program,
    Segment,
    SegmentKind,
    back_propagate,
    last_use,
)
from .attention import keys_values, query_grid
from .bands import band_rows, row_local, run_bands, tile_bands
from .batches import batch_groups, batchable, period_and_reach, run_group, tile_class
from .context import ExecContext, RunResult
from .finite import FiniteChecks, NonFiniteError, all_finite, check_output
from .options import RunOptions
from .segments import cut, last_readers, tile_grid
from .sharding import RowBands, exchange_rows, gather_rows, merge_group_stats, stream_rows
from .staging import Staging
from .stats import GroupStats

logger = logging.getLogger(__name__)

__all__ = ["ExecContext", "Executor", "FiniteChecks", "NonFiniteError", "RunResult", "all_finite",
           "check_output"]


@dataclass(frozen=True, eq=False)
class Executor:
    """A program run over a tile grid on a reference value (the latent), segment by segment."""

    program: Program
    tile_size: int
    ref: str  # the value whose pixels tile_size counts (decoder input / encoder output latent)
    options: RunOptions = field(default_factory=RunOptions)
    device: Any = "cpu"
    group: Any = None  # torch.distributed group: tile rows sharded over its ranks (`sharding`)
    fixed_stats: dict = field(default_factory=dict)  # id(GroupNorm op) -> (mean, var): fast mode's
    done: dict = field(default_factory=dict)  # tile index -> its output core, computed already (fast
    # mode's sampled tiles)
    probes: tuple = ()  # reference boxes whose own statistics are kept (fast mode's low pass)

    def segments(self) -> list[Segment]:
        """The program cut at its barriers (`cut`)."""
        return cut(self.program, self.fixed_stats, self.options.attention, self.options.recompute)

    def run(self, x, emit: Callable | None = None) -> RunResult:
        """Run on x (B, C, H, W): the output, or its tile cores streamed to emit(box, value)."""
        return _TileRun(self, x, emit).go()


class _TileRun:
    """The state of one `Executor.run`: the values' shapes, the staging, the statistics being merged,
    this rank's row bands and the segment's finite checks."""

    def __init__(self, ex: Executor, x, emit):
        p = ex.program
        self.ex, self.o, self.x, self.emit = ex, ex.options, x, emit
        self.done, self.probes = ex.done, ex.probes
        self.shapes, self.chans = p.shapes(tuple(x.shape[-2:])), p.channels()
        self.segs = ex.segments()
        self.grid = tile_grid(self.shapes[ex.ref], ex.tile_size)
        self.ctx = ExecContext(stats=dict(ex.fixed_stats), query_chunk=self.o.query_chunk,
                               kv_chunk=self.o.kv_chunk, conv_workspace=self.o.conv_workspace)
        self.trackers = self._trackers()
        self.band_cache: dict[int, int | None] = {}
        self.unit, self.batch = x.shape[0] * x.element_size(), x.shape[0]
        self.bands = self._shard()
        self.probe_stats: dict[tuple[str, int], GroupStats] = {}
        self.out, self.out_lo, self.checks = None, 0, FiniteChecks(self.o.check_finite)
        self.batched = 0

    def go(self) -> RunResult:
        p, o = self.ex.program, self.o
        stage = Staging(o.staging.home, self.ex.device, o.stage_dir, o.heap_slack, o.on_device, o.device_rows)
        try:
            stage.put(p.input, self.x)
            self._finish_stats(p.input, self.x)
            last = last_readers(self.segs, p.input)
            bar = tqdm(total=sum(len(self._seg_tiles(seg)) for seg in self.segs), desc="tiles", unit="tile",
                       disable=not o.progress, leave=False)
            for i, seg in enumerate(self.segs):
                self._segment(i, seg, stage, bar)
                for v in [v for v, j in last.items() if j == i and not o.keep_staged]:
                    stage.free(v)
            bar.close()
        except BaseException:
            stage.close()
            raise
        peak = stage.peak
        kept = stage if o.keep_staged else None
        if kept is None:
            stage.close()
        else:
            stage.lane.finish()  # (every copy into the kept values made)
        return RunResult(self._assemble(), peak, self.ctx.stats, self.probe_stats, kept, self.batched)

    def _segment(self, i: int, seg: Segment, stage: Staging, bar) -> None:
        """Segment i over every tile: its outputs allocated, its halo rows fetched, its tiles run, its
        statistics merged and its values checked."""
        for v in seg.outputs:
            full = (self.batch, self.chans[v], *self.shapes[v])
            if v in seg.measured:
                continue  # (its statistics only: its readers recompute it)
            if v == self.ex.program.output:
                if self.emit is None or self.bands is not None:
                    self.out = self._alloc_output(full)
            else:
                rows = None if self.bands is None else self.bands.stored_rows(v, self.shapes[v][0])
                stage.alloc(v, full, self.x.dtype, rows)
        self._exchange(i, seg, stage)
        if seg.kind is SegmentKind.ATTENTION:
            self._prepare_attention(seg, stage)
        elif seg.kind is SegmentKind.WHOLE:
            self._prepare_whole(seg, stage)
        self.checks = FiniteChecks(self.o.check_finite)
        self._run_segment(seg, stage, bar)
        for v in seg.outputs:
            if v in self.trackers:
                self._finish_stats(v, None)
                for acc in self.trackers[v].values():  # (the merged mean and var: one sum)
                    self.checks.add(_producer(seg, v), acc.stacked, dtype=self.x.dtype)
        self.checks.finish()
        self.ctx.kv.clear()

    # -- sharding over ranks (`sharding`) -----------------------------------------------------------

    def _shard(self) -> RowBands | None:
        """Row bands of this run when a process group is set (else None: every tile is ours)."""
        if self.ex.group is None:
            return None
        if self.o.recompute:
            raise ValueError(f"recomputed values {self.o.recompute} run on one process, not with a process "
                             "group")
        if self.probes:
            raise ValueError("probes (fast-mode low pass) run on one process, not with a process group")
        rank, world = rank_world(self.ex.group)
        bands = RowBands.build(self.grid, rank, world)
        bands.plan_segments(self.segs, self.shapes, self.grid, self.ex.ref, skip={self.ex.program.input})
        return bands

    def _seg_tiles(self, seg: Segment) -> list:
        """The tiles a segment runs: the grid's, or an attention segment's query bands (`query_rows`)."""
        if seg.kind is SegmentKind.ATTENTION and self.o.query_rows and self.bands is None:
            return list(query_grid(self.shapes[self.ex.ref], self.o.query_rows))
        if self.bands is None:
            return list(self.grid)
        mine = self.bands.tiles[self.bands.rank]
        return [t for t in self.grid if t.index in mine]

    def _alloc_output(self, full):
        """The output tensor, or this rank's band of output rows (its first row kept in out_lo)."""
        self.out_lo = 0
        if self.bands is not None:
            lo, hi = self.bands.owned_rows(full[-2])
            self.out_lo, full = lo, (*full[:-2], hi - lo, full[-1])
        return torch.empty(full, dtype=self.x.dtype, device=self.x.device)

    def _exchange(self, i: int, seg: Segment, stage: Staging) -> None:
        """Bring the halo rows segment i reads from the ranks that computed them."""
        if self.bands is None:
            return
        for v in seg.inputs:
            if v == self.ex.program.input:
                continue
            plan = self.bands.transfers(i, v, self.shapes[v][0])
            if plan:
                exchange_rows(stage, v, plan, self.bands.rank, self.ex.group)

    def _assemble(self):
        """Single process: the output as is. Ranks: gathered on every rank, or streamed through rank 0."""
        rows = self.shapes[self.ex.program.output][0]
        if self.bands is None:
            return self.out
        mine = self.bands.owned_rows(rows)
        if self.emit is None:
            return gather_rows(self.out, mine, rows, self.ex.group)
        stream_rows(self.out, mine, self.bands, rows, self.emit, self.ex.group)
        return None

    # -- statistics ---------------------------------------------------------------------------------

    def _trackers(self) -> dict[str, dict[int, GroupStats]]:
        """Values whose statistics a later exact GroupNorm needs: value -> groups -> accumulator."""
        out: dict[str, dict[int, GroupStats]] = {}
        for seg in self.segs:
            for op in seg.ops:
                if op.kind is OpKind.GROUP_NORM and id(op) not in self.ex.fixed_stats:
                    out.setdefault(op.src[0], {})[op.groups] = GroupStats(op.groups, self.o.stats_chunk)
        return out

    def _finish_stats(self, value: str, full) -> None:
        """Publish the merged statistics of value to every exact GroupNorm reading it."""
        if value not in self.trackers:
            return
        for g, acc in self.trackers[value].items():
            if full is not None:
                acc.add(full)  # the program input: every rank holds all of it
            elif self.bands is not None:
                merge_group_stats(acc, self.ex.group, self.batch)
            for op in self.ex.program.ops:
                if op.kind is OpKind.GROUP_NORM and op.src[0] == value and op.groups == g:
                    if id(op) not in self.ex.fixed_stats:
                        self.ctx.stats[id(op)] = acc.result()

    # -- tiles --------------------------------------------------------------------------------------

    def _prepare_attention(self, seg: Segment, stage: Staging) -> None:
        """Keys and values of every token (`attention.keys_values`), on the device or, streamed, in host
        memory."""
        op = seg.ops[0]
        n_name = op.src[0]
        h, w = self.shapes[n_name]
        rows = (0, h) if self.bands is None else self.bands.owned_rows(h)
        chunk = self.o.kv_chunk or self.o.query_chunk  # (streamed: made a key chunk at a time)
        self.ctx.kv[id(op)] = keys_values(op, lambda box: stage.read(n_name, box), h, w, rows, chunk,
                                          self.ex.device, self.o.kv_chunk > 0, self.ex.group)

    def _prepare_whole(self, seg: Segment, stage: Staging) -> None:
        """A module run whole (`ops_traced.Whole`): its output from its whole inputs, once."""
        op = seg.ops[0]
        if self.bands is not None:
            raise ValueError(f"{op.name} ({op.label}) runs on the whole image: not with a process group")
        inputs = [stage.read(v, (0, self.shapes[v][0], 0, self.shapes[v][1])) for v in op.src]
        self.ctx.kv[id(op)] = op.prepare(inputs)

    def _run_segment(self, seg: Segment, stage: Staging, bar) -> None:
        """Every tile of the grid: read the needed regions, run the ops, write the cores."""
        ref, out_v = self.shapes[self.ex.ref], self.ex.program.output
        last = last_use(seg.ops, seg.outputs)
        tiles = self._seg_tiles(seg)
        if self._batched(seg):
            self._run_batched(seg, stage, bar, tiles, last)
            return
        ahead = [v for v in seg.inputs if self.o.read_ahead and stage.prefetches(v)]  # (read a tile ahead)
        for k, tile in enumerate(tiles):
            if ahead and k + 1 < len(tiles):
                self._prefetch(seg, tiles[k + 1], stage, ahead)
            cores = {v: map_box(tile.core, ref, self.shapes[v]) for v in seg.outputs}
            cores = {v: b for v, b in cores.items() if not box_empty(b)}
            if cores and tile.index in self.done and list(cores) == [out_v]:
                vals = {out_v: (self.done[tile.index], cores[out_v])}
                for v, core in cores.items():
                    self._store(v, core, vals, stage, seg)
            elif cores:
                for part, vals in run_bands(seg, stage, self.ctx, self._tile_bands(seg, tile.core),
                                            self.shapes, last):
                    for v, core in part.items():
                        self._store(v, core, vals, stage, seg)
            vals = None  # this tile's values die now, not while the next tile runs
            stage.trim()  # disk staging: at most heap_slack of freed heap stays resident
            bar.update(1)
        stage.drop_fetched()

    def _batched(self, seg: Segment) -> bool:
        """Whether seg's tiles run `tile_batch` at a time: a batchable segment in whole tiles, one process."""
        if self.o.tile_batch == 1 or self.bands is not None or not batchable(seg):
            return False
        self._tile_bands(seg, self.grid.tiles[0].core)  # (its row bands decided: a banded segment does not)
        return self.band_cache[id(seg)] is None

    def _run_batched(self, seg: Segment, stage: Staging, bar, tiles, last) -> None:
        """`_run_segment` with the tiles of one class run as one batch, up to tile_batch (`batches`), a
        tile row at a time when the segment makes the output; no reads ahead."""
        shapes, ref, out_v = self.shapes, self.shapes[self.ex.ref], self.ex.program.output
        period, reach = period_and_reach(seg.ops, shapes)
        by_row, pending = out_v in seg.outputs, []

        def flush():
            for group in batch_groups(pending, self.o.tile_batch, by_row):
                for cores, vals in run_group(seg, stage, self.ctx, group, shapes, last, self.batch):
                    for v, core in cores.items():
                        self._store(v, core, vals, stage, seg)
                vals = None  # (the batch's values die now)
                stage.trim()
                bar.update(len(group))
                self.batched += len(group) if len(group) > 1 else 0
            pending.clear()

        for k, tile in enumerate(tiles):
            if by_row and k and tile.row != tiles[k - 1].row:
                flush()
            cores = {v: map_box(tile.core, ref, shapes[v]) for v in seg.outputs}
            cores = {v: b for v, b in cores.items() if not box_empty(b)}
            if cores and tile.index in self.done and list(cores) == [out_v]:
                self._store(out_v, cores[out_v], {out_v: (self.done[tile.index], cores[out_v])}, stage, seg)
            elif cores:
                need = back_propagate(seg.ops, cores, shapes)
                pending.append((tile, tile_class([cores], [need], shapes, period, reach), cores, need))
                continue
            bar.update(1)
        flush()

    def _prefetch(self, seg: Segment, tile, stage: Staging, values) -> None:
        """Start reading the host-staged inputs of a tile's first band (it runs next: the copies overlap
        this tile's compute; `copies`)."""
        ref = self.shapes[self.ex.ref]
        cores = {v: map_box(tile.core, ref, self.shapes[v]) for v in seg.outputs}
        if tile.index in self.done or all(box_empty(b) for b in cores.values()):
            return
        bands = self._tile_bands(seg, tile.core)
        if bands:
            need = back_propagate(seg.ops, bands[0], self.shapes)
            for v in values:
                if v in need:
                    stage.prefetch(v, need[v])

    def _tile_bands(self, seg: Segment, core: Box) -> list[dict[str, Box]]:
        """The cores of the segment's outputs in one tile, cut in row bands (row-local segments whose tiles
        hold more than band_bytes; one band otherwise). Band cores of a value partition its tile core."""
        key = id(seg)
        if key not in self.band_cache:
            rows = None
            if row_local(seg) and self.o.band_bytes:
                tile = max(self.grid, key=lambda t: box_area(t.core))
                cores = {v: map_box(tile.core, self.shapes[self.ex.ref], self.shapes[v]) for v in seg.outputs}
                need = back_propagate(seg.ops, cores, self.shapes)
                rows = band_rows(need, self.chans, self.unit, tile.core, self.o.band_bytes)
            self.band_cache[key] = rows
        return tile_bands(core, seg.outputs, self.shapes, self.ex.ref, self.band_cache[key])

    def _store(self, v: str, core: Box, vals, stage: Staging, seg: Segment) -> None:
        """Write the core of value v to its staged tensor (or the output), merging its statistics."""
        t, have = vals[v]
        c = sub_tensor(t, have, core)
        out_v = self.ex.program.output
        if v == out_v and self.emit is not None and self.o.check_emitted:
            self.checks.now(_producer(seg, v), c)  # before it leaves for the sink
        elif v not in self.trackers:  # (a value whose statistics are merged is checked through them)
            self.checks.add(_producer(seg, v), c)
        for acc in self.trackers.get(v, {}).values():
            acc.add(c)
        if v in self.trackers:
            self._probe(v, core, t, have)
        if v in seg.measured:
            return  # (measured, not stored: its readers recompute it)
        if v != out_v:
            stage.write(v, core, c)
        elif self.emit is not None and (self.bands is None or self.bands.rank == 0):
            self.emit(core, c)
        else:
            y0, y1, x0, x1 = core
            self.out[..., y0 - self.out_lo : y1 - self.out_lo, x0:x1] = c

    def _probe(self, v: str, core: Box, t, have: Box) -> None:
        """Add the part of each probe box inside this core to the probes' own statistics of v."""
        for pb in self.probes:
            b = map_box(pb, self.shapes[self.ex.ref], self.shapes[v])
            b = (max(b[0], core[0]), min(b[1], core[1]), max(b[2], core[2]), min(b[3], core[3]))
            if not box_empty(b):
                for g in self.trackers[v]:
                    self.probe_stats.setdefault((v, g), GroupStats(g, self.o.stats_chunk)).add(
                        sub_tensor(t, have, b))


def _producer(seg: Segment, v: str) -> str:
    """The name of the op of seg that makes value v (v itself when none does)."""
    return next((op.name for op in seg.ops if op.dst == v), v)
