"""Fast mode's estimation pass for 3-D VAEs: GroupNorm statistics from a sample of the real tiles.

A stratified sample of the tiles runs the estimated part of a video program (`video.fast`) causal step by
causal step, all of them together segment by segment (the part cut before every GroupNorm whose input
the segment makes, as exact mode cuts it). Each sampled tile computes exactly the regions its output core
needs (back-propagated through the whole part, zero padding only at the video's border), so every value
it holds is the one the tiled run computes with the same statistics; a GroupNorm's statistics are merged
(Chan, float64) over the sampled tiles' cores of its input before its segment runs: per (batch, group)
over the step's frames, or per frame for a GroupNorm of each frame. Between segments each tile keeps its
own regions (not full-size values), and its causal caches per segment, as the executor's tiles do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...locality.boxes import box_area, box_empty, map_box, sub_tensor
from ...locality.ops import OpKind
from ...locality.program import Program, back_propagate, last_use, run_op, split_segments
from ...locality.program3d import VideoProgram
from ..fast.estimators import adjusted, sample_tiles
from ..run.segments import tile_grid
from ..run.stats import GroupStats
from .stores import VideoContext, folded


def norm_segments(part: Program):
    """The part cut before every GroupNorm whose input the current segment makes."""
    return split_segments(part, lambda op: op.kind is OpKind.GROUP_NORM)


def sampled(shapes, ref: str, tile: int, fraction: float) -> list:
    """The sampled tiles of a grid of `tile` pixels over value `ref`, stratified."""
    return sample_tiles(tile_grid(shapes[ref], tile), fraction)


def regions(part: Program, shapes, ref: str, tiles: list) -> list[dict]:
    """Per sampled tile, the box of every value its output core needs (through the whole part)."""
    out = part.output
    return [back_propagate(part.ops, {out: map_box(t.core, shapes[ref], shapes[out])}, shapes) for t in tiles]


@dataclass
class SampledStats:
    """The estimation pass over `part` (ops of `program` from `given` values to an output) for the
    sampled `tiles` of a grid on value `ref`: `run(given)`, given the part's inputs whole ((B, C, T, H, W)
    value -> tensor of every frame), returns (id(GroupNorm), step) -> (mean, var) for every GroupNorm of
    the part; `held_peak` is then the most bytes of regions and caches it held at once. They are held on
    `home` (the host, where the run stages there; None: where they are computed) and each unit's read to
    `device`, as the executor's staged values are."""

    program: VideoProgram  # (its causal steps, frames and shapes)
    part: Program
    ref: str
    tiles: list
    query_chunk: int = 4096
    device: Any = None  # where the units run (None: where the given values are)
    home: Any = None  # where the regions and caches are held between units (None: the device)
    # (id(GroupNorm), step) -> the low pass's (whole, over the sampled cores) statistics: each sampled
    # statistic corrected as it is made (`fast.estimators.adjusted`), before the segments after it run
    adjust: dict | None = None

    def run(self, given: dict) -> dict:
        p, x = self.program, given[self.program.input]  # (given: the program input too)
        self.shapes = p.shapes(tuple(x.shape[-2:]))
        self.chunks = p.chunks(int(x.shape[2]))
        frames = p.frames(self.chunks)
        self.needs = regions(self.part, self.shapes, self.ref, self.tiles)
        self.segs = norm_segments(self.part)
        self.device = x.device if self.device is None else torch.device(self.device)
        self.ctx = VideoContext(query_chunk=self.query_chunk, cache_device=self.home)
        self.caches: dict[tuple[int, int], dict] = {}
        self.held_peak = 0
        readers = {v: i for i, seg in enumerate(self.segs) for v in seg.inputs}
        lasts = [last_use(seg.ops, seg.outputs) for seg in self.segs]
        for k in range(len(self.chunks)):
            self.ctx.step, self.ctx.last = k, k == len(self.chunks) - 1
            held = {}
            for v, t in given.items():  # (their frames of step k, each tile's region: views)
                a = sum(frames[v][:k])
                for j, n in enumerate(self.needs):
                    if v in n:
                        y0, y1, x0, x1 = n[v]
                        held[v, j] = t[:, :, a : a + frames[v][k], y0:y1, x0:x1]
            views = set(held)
            for i, seg in enumerate(self.segs):
                self._publish(seg, k, held)
                for j in range(len(self.tiles)):
                    self._unit(i, seg, j, held, lasts[i])
                self.held_peak = max(self.held_peak, self._bytes(held, views))
                for v in [v for v, r in readers.items() if r == i]:
                    for j in range(len(self.tiles)):
                        held.pop((v, j), None)
        return dict(self.ctx.step_stats)

    def _unit(self, i: int, seg, j: int, held: dict, last: dict) -> None:
        """Segment i on sampled tile j for the running step: its regions of the segment's outputs held."""
        need = self.needs[j]
        vals = {v: (held[v, j].to(self.device, non_blocking=True), need[v]) for v in seg.inputs if v in need}
        shared = [t for t, _ in vals.values()]  # (held regions and the input: never overwritten)
        self.ctx.caches = self.caches.setdefault((i, j), {})
        for n, op in enumerate(seg.ops):
            if op.dst in need:  # (the ops the part's output needs; a tail cut at its last GroupNorm
                # leaves out what only reads past it)
                run_op(seg.ops, n, self.ctx, vals, need, self.shapes, last, keep=seg.outputs, shared=shared)
        for v in seg.outputs:
            if v in vals:
                t = vals[v][0]
                held[v, j] = t if self.home is None else t.to(self.home)

    def _publish(self, seg, k: int, held: dict) -> None:
        """The statistics of the segment's GroupNorms for step k, merged over the sampled tiles' cores."""
        for op in seg.ops:
            if op.kind is not OpKind.GROUP_NORM or (id(op), k) in self.ctx.step_stats:
                continue
            v = op.src[0]
            acc = GroupStats(op.groups)
            for j, t in enumerate(self.tiles):
                box = self.needs[j][v]
                c = map_box(t.core, self.shapes[self.ref], self.shapes[v])
                core = (max(c[0], box[0]), min(c[1], box[1]), max(c[2], box[2]), min(c[3], box[3]))
                if not box_empty(core):
                    acc.add(folded(sub_tensor(held[v, j], box, core), op.per_frame))
            stats = adjusted(acc.result(), (self.adjust or {}).get((id(op), k)))
            self.ctx.step_stats[id(op), k] = tuple(t.to(self.device) for t in stats)

    def _bytes(self, held: dict, views: set) -> int:
        """Bytes of the regions held (not the given values' views) and of every tile's caches."""
        own = sum(t.numel() * t.element_size() for key, t in held.items() if key not in views)
        caches = sum(f.numel() * f.element_size() for c in self.caches.values() for _, f in c.values())
        return own + caches


def held_bytes(program: VideoProgram, part: Program, shape, ref: str, tiles: list, item: int) -> int:
    """The most bytes of regions and caches `SampledStats` holds at a segment's end over the steps, for a
    program input of `shape` (counted from the program: what its run measures as `held_peak`)."""
    b = int(shape[0])
    shapes, chans = program.shapes(tuple(shape[-2:])), program.channels()
    chunks = program.chunks(int(shape[2]))
    frames = program.frames(chunks)
    needs = regions(part, shapes, ref, tiles)
    segs = norm_segments(part)
    readers = {v: i for i, seg in enumerate(segs) for v in seg.inputs}
    src = {op.dst: op.src[0] for op in part.ops}
    caches = sum(op.cache_elems(n[op.dst], [shapes[src[op.dst]]], chans[src[op.dst]], len(chunks) - 2)
                 for seg in segs for op in seg.ops if hasattr(op, "cache_elems")
                 for n in needs if op.dst in n) * b * item if len(chunks) > 1 else 0
    peak = 0
    for k in range(len(chunks)):
        alive: set[str] = set()
        for i, seg in enumerate(segs):
            alive |= set(seg.outputs)
            peak = max(peak, sum(b * chans[v] * frames[v][k] * box_area(n[v]) * item
                                 for v in alive for n in needs if v in n))
            alive -= {v for v, r in readers.items() if r == i}
    return peak + caches
