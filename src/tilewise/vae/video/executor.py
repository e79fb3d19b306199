"""Run a video tile program over a spatial tile grid and the model's causal steps (3-D causal VAEs).

The program is cut at its sync ops (per-frame attention, attention over the step's tokens, GroupNorms
of video values) as a 2-D one is. A unit of work is one segment
on one tile for one causal step: the ops run on exactly the boxes the tile's cores need (back-propagated
from the segment's outputs), every temporal op reading the frames before the step from the cache of
its box (`StepContext`), and the cores of the outputs go to the staged values of that step (or the
output). Two orders run the same units:

- "frames": step by step, the model's own order; within a step segment by segment, tile by tile. One
  step's values are staged; every tile's caches live through the run (on the device, or the host with
  staging="host"). Frames come out complete, step after step: any sink can take them.
- "tiles": segment by segment; within a segment tile by tile, each tile through every step (attention
  segments go step by step: their keys are a whole frame's). One tile's caches live at a time; the
  segments' staged values hold every step. Output blocks come out tile by tile (random-access sinks).

An attention segment computes the keys and values of every token of each frame of the step first, then
the queries tile by tile (global, exact), or each tile's own tokens (attention="tile", approximate).
A GroupNorm of a video value (`ops3d_sync.VideoGroupNorm`, HunyuanVideo's) starts a segment: the tile
cores of its input, as the segment before stores them, add their moments to the step's statistics
(`run.stats.GroupStats`: float64, Chan's merge), which are complete before its segment runs and applied
per tile there (the same statistics for every tile). These reduce over every frame of a step, so they
run only in one-step programs (`check_steps`: a program of several steps with one is refused by name);
a GroupNorm of each frame (`FrameGroupNorm`, Mochi's) merges each frame's moments apart, and runs in a
program of several steps too.
A step recomputed for gradients (`reverse`) runs without autograd as the forward does, its statistics
merged the same way; its tiles' backward takes them as leaves.

With a process group (frame order only) each rank runs the tiles of its band of tile rows
(`sharding.RowBands`, as a 2-D run) and keeps those tiles' causal caches; after each segment of a step,
the step's staged outputs, which every rank wrote only at its tiles' cores (zeros elsewhere), are summed
over the ranks in their own dtype (disjoint cores: the sum is exact), so every rank reads any halo and
any attention key from the whole value; each GroupNorm's moments of the step are merged over the ranks
(`sharding.merge_group_stats`) before its segment. The output frames of each step are summed the same
way: every rank returns the whole output; `emit` (rank 0's sink) gets each step's frames whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from ...distributed import all_reduce_sum, rank_world
from ...locality.boxes import sub_tensor
from ...locality.ops import OpKind
from ...locality.program import SegmentKind, last_use, run_op
from ...locality.program3d import VideoProgram
from ..run.segments import tile_grid
from ..run.sharding import RowBands, merge_group_stats
from ..run.stats import GroupStats
from ..settings import Attention, Place
from .probes import Probes
from .stores import Store, VideoContext, cache_bytes, folded
from .units import VIDEO_STAGINGS, Order, check_steps, layout, video_segments

logger = logging.getLogger(__name__)



@dataclass
class VideoResult:
    """What one video run made: its output (None when streamed), the most cache bytes held at once (every
    tile's), the most staged bytes held at once, every GroupNorm's statistics it merged ((id(op), step)
    -> (mean, var), float64) and those over the probed boxes (`VideoExecutor.probes`)."""

    output: Any
    cache_peak: int
    staged_peak: int
    stats: dict = field(default_factory=dict)
    probe_stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class VideoExecutor:
    """A video program run over a tile grid on a reference value (the latent) and the causal steps."""

    program: VideoProgram
    tile_size: int
    ref: str  # the value whose pixels tile_size counts (decoder input / encoder output latent)
    attention: Attention = Attention.GLOBAL
    staging: Place = Place.DEVICE
    order: Order = Order.FRAMES
    device: Any = "cpu"
    query_chunk: int = 4096
    progress: bool = True
    group: Any = None  # a torch.distributed group: each rank runs its band of tile rows
    stage_dir: str | None = None  # disk staging's folder (None: the system's temporary folder)
    # (id(GroupNorm), step) -> (mean, var) given for these GroupNorms (a run's `stats`, or an estimate):
    # applied as an affine per channel (and frame), they cut no segment and nothing before them is staged
    fixed_stats: dict | None = None
    # (reference shape, boxes in its pixels): every GroupNorm input's moments over them too (`probes`)
    probes: tuple | None = None

    def __post_init__(self):
        put = object.__setattr__
        put(self, "order", Order.parse(self.order, "order"))
        if self.group is not None and self.order is not Order.FRAMES:
            raise ValueError("a process group runs order='frames' (each step's values are summed over the "
                             "ranks before the next step reads them); got order='tiles'")
        if self.staging not in VIDEO_STAGINGS:
            raise ValueError(f"staging for a video VAE must be one of {VIDEO_STAGINGS}, got {self.staging!r}")
        put(self, "staging", Place(self.staging))
        if self.group is not None and self.staging is Place.DISK:
            raise ValueError("a process group sums each step's staged values over the ranks in memory: "
                             "staging='disk' runs in one process; use staging='device' or 'host' with it")
        put(self, "attention", Attention.parse(self.attention, "attention"))
        check_steps(self.program)

    def run(self, x, emit: Callable | None = None) -> VideoResult:
        """Run on x (B, C, T, H, W): the output, or its cores streamed to emit(frame0, box, block)."""
        return _VideoRun(self, x, emit).go()


class _VideoRun:
    """The state of one `VideoExecutor.run`: shapes, frames and steps, the layout, staging and caches."""

    def __init__(self, ex: VideoExecutor, x, emit):
        p = self.program = ex.program
        self.ex, self.x, self.emit = ex, x, emit
        self.shapes, self.chans = p.shapes(tuple(x.shape[-2:])), p.channels()
        self.chunks = p.chunks(x.shape[2])
        self.frames = p.frames(self.chunks)
        fixed = ex.fixed_stats or {}
        self.fixed = {i for i, _ in fixed}
        self.segs = video_segments(p, ex.attention, self.fixed)
        self.grid = tile_grid(self.shapes[ex.ref], ex.tile_size)
        self.layout = layout(self.segs, self.shapes, self.grid, ex.ref)
        rank, world = rank_world(ex.group)
        self.mine = RowBands.build(self.grid, rank, world).tiles[rank] if ex.group is not None else None
        self.lasts = [last_use(seg.ops, seg.outputs) for seg in self.segs]
        t_out = self.frames[p.output]
        self.offsets = [sum(t_out[:k]) for k in range(len(t_out))]
        self.out = self.sink = None
        if emit is None:
            h, w = self.shapes[p.output]
            new = torch.zeros if ex.group is not None else torch.empty
            self.out = new((x.shape[0], self.chans[p.output], sum(t_out), h, w), dtype=x.dtype,
                           device=ex.device)
        elif ex.group is not None:  # one step's output frames, summed over the ranks, then emitted whole
            self.emit, self.sink = self._collect, emit
        self.store = Store(ex.staging, torch.device(ex.device), zeroed=ex.group is not None,
                           directory=ex.stage_dir)
        self.step_out = Store(Place.DEVICE, torch.device(ex.device), zeroed=True)
        # host staging keeps the frame-major run's caches (every tile's) on the host; a tile-major run
        # holds one tile's caches, on the device
        on_host = ex.staging is Place.HOST and ex.order is Order.FRAMES
        home = torch.device("cpu") if on_host else None
        self.ctx = VideoContext(query_chunk=ex.query_chunk, cache_device=home, step_stats=dict(fixed))
        # GroupNorm statistics: (value, groups, per frame, step) -> moments merged over the tile cores of
        # the step (per frame: each frame's apart, `FrameGroupNorm`)
        # (GroupNorms with given statistics merge nothing)
        self.norms = {i: [op for op in seg.ops if op.kind is OpKind.GROUP_NORM and id(op) not in self.fixed]
                      for i, seg in enumerate(self.segs)}
        self.tracked = {(op.src[0], op.groups, op.per_frame) for ops in self.norms.values() for op in ops}
        self.moments: dict[tuple[str, int, bool, int], GroupStats] = {}
        self.probes = None if ex.probes is None else Probes(*ex.probes, self.shapes)
        self.merged: set[tuple[str, int, bool, int]] = set()
        self.caches: dict[tuple[int, int], dict] = {}
        self.cache_alive = self.cache_peak = 0
        self.readers = {v: i for i, seg in enumerate(self.segs) for v in seg.inputs}

    def go(self) -> VideoResult:
        bar = tqdm(total=len(self.layout) * len(self.chunks), desc="tiles x steps", unit="unit",
                   disable=not self.ex.progress, leave=False)
        steps = range(len(self.chunks))
        try:
            if self.ex.order is Order.FRAMES:
                for k in steps:
                    self.step(k, bar)
            else:
                for i, seg in enumerate(self.segs):
                    self._segment_tiles(i, seg, bar)
                    self._free(i, None)
        finally:
            bar.close()
            self.store.close()  # (disk staging: every file removed, also after an error)
        if self.out is not None and self.ex.group is not None:
            all_reduce_sum([self.out], self.ex.group, self.out.dtype)
        probed = {} if self.probes is None else self.probes.stats(
            [op for ops in self.norms.values() for op in ops], len(self.chunks))
        return VideoResult(self.out, self.cache_peak, self.store.peak, self._stats(), probed)

    def _stats(self) -> dict:
        """(id(op), step) -> (mean, var) of every GroupNorm the run merged statistics for."""
        return {(id(op), k): self.moments[key].result() for ops in self.norms.values() for op in ops
                for k in range(len(self.chunks))
                if (key := (op.src[0], op.groups, op.per_frame, k)) in self.moments}

    def step(self, k: int, bar) -> None:
        """Causal step k on every tile, segment by segment (frame order), its staged values freed."""
        for i, seg in enumerate(self.segs):
            self._segment_step(i, seg, k, bar)
            self._free(i, k)

    def _segment_tiles(self, i: int, seg, bar) -> None:
        """Tile-major: segment i tile by tile, each through every step (attention: step by step)."""
        steps = range(len(self.chunks))
        for k in steps:
            self._publish(i, k)
        if seg.kind is SegmentKind.ATTENTION:
            for k in steps:
                self._segment_step(i, seg, k, bar)
            return
        for tile in self.grid:
            for k in steps:
                self._unit(i, seg, tile.index, k)
                bar.update(1)
            self._drop_caches(i, tile.index)

    def _segment_step(self, i: int, seg, k: int, bar) -> None:
        """Segment i on every tile for step k (keys and values of the step's frames first for attention)."""
        self.ctx.kv.clear()
        self._publish(i, k)
        if seg.kind is SegmentKind.ATTENTION:
            self._prepare_attention(seg, k)
        for tile in self.grid:
            self._unit(i, seg, tile.index, k)
            bar.update(1)
        self.ctx.kv.clear()  # (the keys and values die with their segment's step)
        if self.ex.group is not None:
            self._sum_over_ranks(seg, k)
        if k == len(self.chunks) - 1:
            for tile in self.grid:
                self._drop_caches(i, tile.index)

    def _publish(self, i: int, k: int) -> None:
        """The statistics of segment i's GroupNorms for step k, merged over every tile core of the step
        (and over the ranks: Chan's merge in float64)."""
        for op in self.norms[i]:
            key = (op.src[0], op.groups, op.per_frame, k)
            if key not in self.merged:
                acc = self.moments.setdefault(key, GroupStats(op.groups))
                if op.src[0] == self.program.input:  # (every rank holds all of it)
                    a, b = self.chunks[k]
                    acc.add(folded(self.x[:, :, a:b], op.per_frame))
                    if self.probes is not None:
                        h, w = self.shapes[op.src[0]]
                        self.probes.add(key, (0, h, 0, w), self.x[:, :, a:b])
                elif self.ex.group is not None:
                    rows = self.frames[op.src[0]][k] if op.per_frame else 1
                    merge_group_stats(acc, self.ex.group, self.x.shape[0] * rows)
                    if self.probes is not None:
                        self.probes.merge(key, self.ex.group, self.x.shape[0] * rows)
                self.merged.add(key)
            self.ctx.step_stats[id(op), k] = self.moments[key].result()

    def _sum_over_ranks(self, seg, k: int) -> None:
        """The step's staged outputs of a segment (and output frames, when streamed) whole on every rank:
        each rank's tile cores, zeros elsewhere, summed in their own dtype."""
        parts = []
        for v in seg.outputs:
            if v != self.program.output:
                parts.append(self.store.make((v, k), self._step_shape(v, k), self.x.dtype))
        for t in parts:
            all_reduce_sum([t], self.ex.group, t.dtype)
        out = self.program.output
        if out in seg.outputs and self.out is None:
            t0 = self.offsets[k]
            block = self.step_out.make(("out", t0), self._step_shape(out, k), self.x.dtype)
            all_reduce_sum([block], self.ex.group, block.dtype)
            h, w = self.shapes[out]
            self.sink(t0, (0, h, 0, w), block)
            self.step_out.drop("out", t0)

    def _step_shape(self, v: str, k: int) -> tuple[int, ...]:
        """(B, C, frames, H, W) of value v in step k."""
        return (self.x.shape[0], self.chans[v], self.frames[v][k], *self.shapes[v])

    def _collect(self, t0: int, box, block) -> None:
        """An output core of the step starting at frame t0, kept until the ranks' parts are summed."""
        k = self.offsets.index(t0)
        self.step_out.write(("out", t0), self._step_shape(self.program.output, k), block.dtype, box, block)

    def _free(self, i: int, k: int | None) -> None:
        """Drop the staged values segment i read last (of step k, or of every step)."""
        for v, j in self.readers.items():
            if j == i and v != self.program.input:
                if k is None:
                    self.store.free(v)
                else:
                    self.store.drop(v, k)

    def _drop_caches(self, i: int, tile: int) -> None:
        caches = self.caches.pop((i, tile), None)
        if caches:
            self.cache_alive -= cache_bytes(caches)

    def _read(self, v: str, k: int, box):
        """Box of staged value v in step k (the program input: the step's frames of x)."""
        if v == self.program.input:
            a, b = self.chunks[k]
            t = self.x[:, :, a:b, box[0] : box[1], box[2] : box[3]]
            return t.to(self.ex.device, non_blocking=True)
        return self.store.read((v, k), box)

    def _staged_view(self, v: str, k: int, t) -> bool:
        """Whether t, read of value v in step k, views the staged tensor (or x) rather than copying it."""
        if v != self.program.input:
            return self.store.views((v, k), t)
        return t.untyped_storage()._cdata == self.x.untyped_storage()._cdata

    def _prepare_attention(self, seg, k: int) -> None:
        """Keys and values of every token of each frame of step k, in row bands of the staged input."""
        op = seg.ops[0]
        n = op.src[0]
        h, w = self.shapes[n]
        band = max(1, min(h, self.ex.query_chunk // max(w, 1)))
        ks, vs = [], []
        for y0 in range(0, h, band):
            kk, vv = op.keys_values(self._read(n, k, (y0, min(h, y0 + band), 0, w)))
            ks.append(kk)
            vs.append(vv)
        self.ctx.kv[id(op)] = (torch.cat(ks, dim=2), torch.cat(vs, dim=2))

    def _unit(self, i: int, seg, tile: int, k: int) -> None:
        """Segment i on one tile for step k: read, run the ops with the tile's caches, store the cores."""
        hit = self.layout.get((i, tile))
        if hit is None or (self.mine is not None and tile not in self.mine):
            return
        cores, need = hit
        ctx = self.ctx
        ctx.step, ctx.last = k, k == len(self.chunks) - 1
        ctx.caches = self.caches.setdefault((i, tile), {})
        before = cache_bytes(ctx.caches)
        vals, shared = {}, []
        for v in seg.inputs:
            t = self._read(v, k, need[v])
            vals[v] = (t, need[v])
            if self._staged_view(v, k, t):  # (a copy, from the host, is ours: freed at its last reader)
                shared.append(t)
        for j in range(len(seg.ops)):
            run_op(seg.ops, j, ctx, vals, need, self.shapes, self.lasts[i], keep=seg.outputs, shared=shared)
        self.cache_alive += cache_bytes(ctx.caches) - before
        self.cache_peak = max(self.cache_peak, self.cache_alive)
        for v, core in cores.items():
            self._store_core(v, k, core, sub_tensor(vals[v][0], vals[v][1], core))
        vals.clear()
        self.store.trim()

    def _store_core(self, v: str, k: int, core, block) -> None:
        """A core of value v for step k: staged, emitted (the output, streamed) or into the output."""
        for g, per_frame in {(g, f) for u, g, f in self.tracked if u == v}:
            key = (v, g, per_frame, k)
            if key not in self.moments:
                self.moments[key] = GroupStats(g)
            self.moments[key].add(folded(block, per_frame))
            if self.probes is not None:
                self.probes.add(key, core, block)
        if v != self.program.output:
            self.store.write((v, k), self._step_shape(v, k), block.dtype, core, block)
        elif self.emit is not None:
            self.emit(self.offsets[k], core, block)
        else:
            t0 = self.offsets[k]
            self.out[:, :, t0 : t0 + block.shape[2], core[0] : core[1], core[2] : core[3]].copy_(block)

