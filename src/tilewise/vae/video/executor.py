"""Run a video tile program over a spatial tile grid and the model's causal steps (3-D causal VAEs).

The program is cut at its sync ops (per-frame attention) as a 2-D one is. A unit of work is one segment
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
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..locality.ops import Op, box_empty, map_box, sub_tensor
from ..locality.ops3d import StepContext
from ..locality.program import back_propagate, last_use, run_op, split_segments
from ..locality.program3d import VideoProgram

logger = logging.getLogger(__name__)

ORDERS = ("frames", "tiles")
VIDEO_STAGINGS = ("device", "host")


def nbytes(t) -> int:
    """Bytes of a tensor's elements."""
    return t.numel() * t.element_size()


def cache_bytes(caches: dict) -> int:
    """Bytes of one tile's caches (id(op) -> (box, frames))."""
    return sum(nbytes(f) for _, f in caches.values())


class _Store:
    """Staged values of the run: (value, step) -> full-size tensor, on the device or the host."""

    def __init__(self, where: str, device):
        import torch

        self.device = device
        self.home = device if where == "device" else torch.device("cpu")
        self.values: dict[tuple[str, int], Any] = {}
        self.alive = self.peak = 0

    def write(self, key, shape, dtype, box, block) -> None:
        import torch

        if key not in self.values:
            self.values[key] = torch.empty(shape, dtype=dtype, device=self.home)
            self.alive += nbytes(self.values[key])
            self.peak = max(self.peak, self.alive)
        self.values[key][..., box[0] : box[1], box[2] : box[3]].copy_(block)

    def read(self, key, box):
        t = self.values[key][..., box[0] : box[1], box[2] : box[3]]
        return t.to(self.device, non_blocking=True)

    def free(self, value: str) -> None:
        for key in [k for k in self.values if k[0] == value]:
            self.alive -= nbytes(self.values.pop(key))


@dataclass
class VideoExecutor:
    """Runs a video program over a tile grid on a reference value (the latent) and the causal steps."""

    program: VideoProgram
    tile_size: int
    ref: str  # the value whose pixels tile_size counts (decoder input / encoder output latent)
    attention: str = "global"
    staging: str = "device"
    order: str = "frames"
    device: Any = "cpu"
    query_chunk: int = 4096
    progress: bool = True
    cache_peak: int = 0  # most cache bytes held at once in the last run (every tile's)
    staged_peak: int = 0  # most staged bytes held at once in the last run

    def __post_init__(self):
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        if self.staging not in VIDEO_STAGINGS:
            raise ValueError(f"staging for a video VAE must be one of {VIDEO_STAGINGS}, got {self.staging!r}")

    def is_global(self, op: Op) -> bool:
        """Barrier ops: attention when global (these families have no GroupNorm)."""
        return self.attention == "global" if op.kind == "attention" else op.sync

    def segments(self):
        return split_segments(self.program, self.is_global)

    def grid(self, shapes):
        from ..geometry import TileGrid

        h, w = shapes[self.ref]
        return TileGrid(h, w, (min(self.tile_size, h), min(self.tile_size, w)), order="serpentine")

    def layout(self, shapes, segs, grid) -> dict[tuple[int, int], tuple[dict, dict]]:
        """(segment, tile) -> (cores of the segment's outputs in the tile, boxes every value needs)."""
        ref = shapes[self.ref]
        out = {}
        for i, seg in enumerate(segs):
            for tile in grid:
                cores = {v: map_box(tile.core, ref, shapes[v]) for v in seg.outputs}
                cores = {v: b for v, b in cores.items() if not box_empty(b)}
                if cores:
                    out[i, tile.index] = cores, back_propagate(seg.ops, cores, shapes)
        return out

    def run(self, x, emit: Callable | None = None):
        """Run on x (B, C, T, H, W); returns the output, or streams emit(frame0, box, block) of its cores."""
        import torch

        p = self.program
        self._shapes = p.shapes(tuple(x.shape[-2:]))
        self._chunks = p.chunks(x.shape[2])
        self._frames = p.frames(self._chunks)
        self._chans = p.channels()
        segs = self.segments()
        grid = self.grid(self._shapes)
        self._layout = self.layout(self._shapes, segs, grid)
        self._lasts = [last_use(seg.ops, seg.outputs) for seg in segs]
        t_out = self._frames[p.output]
        self._offsets = [sum(t_out[:k]) for k in range(len(t_out))]
        self._x, self._emit, self._out = x, emit, None
        if emit is None:
            h, w = self._shapes[p.output]
            self._out = torch.empty((x.shape[0], self._chans[p.output], sum(t_out), h, w), dtype=x.dtype,
                                    device=self.device)
        self._store = _Store(self.staging, torch.device(self.device))
        # host staging keeps the frame-major run's caches (every tile's) on the host; a tile-major run
        # holds one tile's caches, on the device
        cache_home = torch.device("cpu") if self.staging == "host" and self.order == "frames" else None
        self._ctx = StepContext(query_chunk=self.query_chunk, cache_device=cache_home)
        self._caches: dict[tuple[int, int], dict] = {}
        self._cache_alive, self.cache_peak = 0, 0
        readers = {}
        for i, seg in enumerate(segs):
            for v in seg.inputs:
                readers[v] = i
        from tqdm.auto import tqdm

        bar = tqdm(total=len(self._layout) * len(self._chunks), desc="tiles x steps", unit="unit",
                   disable=not self.progress, leave=False)
        steps = range(len(self._chunks))
        try:
            if self.order == "frames":
                for k in steps:
                    for i, seg in enumerate(segs):
                        self._segment_step(i, seg, grid, k, bar)
                        self._free(readers, i, k)
            else:
                for i, seg in enumerate(segs):
                    if seg.kind == "attention":
                        for k in steps:
                            self._segment_step(i, seg, grid, k, bar)
                    else:
                        for tile in grid:
                            for k in steps:
                                self._unit(i, seg, tile.index, k)
                                bar.update(1)
                            self._drop_caches(i, tile.index)
                    self._free(readers, i, None)
        finally:
            bar.close()
            self.staged_peak = self._store.peak
        return self._out

    def _segment_step(self, i, seg, grid, k, bar) -> None:
        """Segment i on every tile for step k (keys and values of the step's frames first for attention)."""
        self._ctx.kv.clear()
        if seg.kind == "attention":
            self._prepare_attention(seg, k)
        for tile in grid:
            self._unit(i, seg, tile.index, k)
            bar.update(1)
        if k == len(self._chunks) - 1:
            for tile in grid:
                self._drop_caches(i, tile.index)

    def _free(self, readers: dict[str, int], i: int, k: int | None) -> None:
        """Drop the staged values segment i read last (of step k, or of every step)."""
        for v, j in readers.items():
            if j == i and v != self.program.input:
                if k is None:
                    self._store.free(v)
                else:
                    t = self._store.values.pop((v, k), None)
                    if t is not None:
                        self._store.alive -= nbytes(t)

    def _drop_caches(self, i: int, tile: int) -> None:
        caches = self._caches.pop((i, tile), None)
        if caches:
            self._cache_alive -= cache_bytes(caches)

    def _read(self, v: str, k: int, box):
        """Box of staged value v in step k (the program input: the step's frames of x)."""
        if v == self.program.input:
            a, b = self._chunks[k]
            t = self._x[:, :, a:b, box[0] : box[1], box[2] : box[3]]
            return t.to(self.device, non_blocking=True)
        return self._store.read((v, k), box)

    def _prepare_attention(self, seg, k: int) -> None:
        """Keys and values of every token of each frame of step k, in row bands of the staged input."""
        import torch

        op = seg.ops[0]
        n = op.src[0]
        h, w = self._shapes[n]
        band = max(1, min(h, self.query_chunk // max(w, 1)))
        ks, vs = [], []
        for y0 in range(0, h, band):
            kk, vv = op.keys_values(self._read(n, k, (y0, min(h, y0 + band), 0, w)))
            ks.append(kk)
            vs.append(vv)
        self._ctx.kv[id(op)] = (torch.cat(ks, dim=2), torch.cat(vs, dim=2))

    def _unit(self, i: int, seg, tile: int, k: int) -> None:
        """Segment i on one tile for step k: read, run the ops with the tile's caches, store the cores."""
        hit = self._layout.get((i, tile))
        if hit is None:
            return
        cores, need = hit
        ctx = self._ctx
        ctx.step, ctx.last = k, k == len(self._chunks) - 1
        ctx.caches = self._caches.setdefault((i, tile), {})
        before = cache_bytes(ctx.caches)
        vals, shared = {}, []
        for v in seg.inputs:
            t = self._read(v, k, need[v])
            vals[v] = (t, need[v])
            shared.append(t)
        last = self._lasts[i]
        for j in range(len(seg.ops)):
            run_op(seg.ops, j, ctx, vals, need, self._shapes, last, keep=seg.outputs, shared=shared)
        self._cache_alive += cache_bytes(ctx.caches) - before
        self.cache_peak = max(self.cache_peak, self._cache_alive)
        p = self.program
        for v, core in cores.items():
            block = sub_tensor(vals[v][0], vals[v][1], core)
            if v != p.output:
                shape = (self._x.shape[0], self._chans[v], self._frames[v][k], *self._shapes[v])
                self._store.write((v, k), shape, block.dtype, core, block)
            elif self._emit is not None:
                self._emit(self._offsets[k], core, block)
            else:
                t0 = self._offsets[k]
                self._out[:, :, t0 : t0 + block.shape[2], core[0] : core[1], core[2] : core[3]].copy_(block)
