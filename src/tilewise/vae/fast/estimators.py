"""Fast mode's statistics estimators: GroupNorm statistics from part of the input instead of all of it.

- `estimate_stats`: the seed's estimator, generalised: stratified crops of the real input run as one
  batch, statistics pooled over the crop interiors (the crops' own zero padding distorts their margins).
- `sampled_tile_stats` / `staged_tile_stats`: a stratified sample of the real tiles run on exactly the
  regions the tiled run computes (no crop padding), together op by op or segment by segment staged;
  their outputs are final, so the tiled pass skips them.
- `adjusted`: the difference / ratio correction of sample statistics by a cheap low-resolution pass.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ...geometry import Box
from ...locality.boxes import box_empty, map_box, sub_tensor
from ...locality.ops import OpKind, RunContext
from ...locality.program import Program, back_propagate, last_use, recompute, run_op, split_segments
from ..run.bands import band_rows, row_local, run_bands
from ..run.executor import ExecContext
from ..run.options import RunOptions
from ..run.staging import Staging
from ..run.stats import GroupStats

logger = logging.getLogger(__name__)

DEFAULT = RunOptions()  # the estimators' options when none are given: a CPU run's
ON_DISK = RunOptions(staging="disk")  # ... staged on disk


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


def sample_tiles(grid, fraction: float, most: int = 0) -> list:
    """Stratified subset of a tile grid: about `fraction` of the rows times the columns, evenly spread
    (at most `most` rows and columns of them; 0: no cap)."""
    ky = max(1, min(grid.rows, round(grid.rows * fraction**0.5), most or grid.rows))
    kx = max(1, min(grid.cols, round(grid.cols * fraction**0.5), most or grid.cols))
    rows = {int((i + 0.5) * grid.rows / ky) for i in range(ky)}
    cols = {int((i + 0.5) * grid.cols / kx) for i in range(kx)}
    return [t for t in grid.tiles if t.row in rows and t.col in cols]


def sampled_tile_stats(program: Program, x, ref: str, tiles: list, fixed: set[int],
                       options: RunOptions = DEFAULT, adjust: dict[int, Any] | None = None):
    """Fast-mode statistics from a sample of the real tiles, run layer-synchronously (no crop padding).

    Each sampled tile runs on exactly the regions its core needs (back-propagated through the whole
    program, zero padding only at the image border), so every value it computes is the one the tiled
    run computes with the same statistics. All sampled tiles advance op by op together; at each
    GroupNorm in `fixed` the statistics are merged (Chan) over the regions the sampled tiles hold, then
    applied. Returns (id(op) -> (mean, var), tile index -> output core): the sampled tiles' outputs are
    final, so the tiled pass skips them. Memory: the sampled tiles' working sets at once. `options`:
    the pass's query_chunk, conv_workspace and stats_chunk; `adjust`: the low pass's (`adjusted`).
    """
    shapes = program.shapes(tuple(x.shape[-2:]))
    out_v = program.output
    needs = [back_propagate(program.ops, {out_v: map_box(t.core, shapes[ref], shapes[out_v])}, shapes)
             for t in tiles]
    vals = []
    for need in needs:
        y0, y1, x0, x1 = need[program.input]
        vals.append({program.input: (x[..., y0:y1, x0:x1], need[program.input])})
    ctx = ExecContext(query_chunk=options.query_chunk, conv_workspace=options.conv_workspace)  # (one
    last = last_use(program.ops, [out_v])  # affine a GroupNorm)
    for i, op in enumerate(program.ops):
        if op.kind is OpKind.GROUP_NORM and id(op) in fixed:
            acc = GroupStats(op.groups, options.stats_chunk)
            for t, need, v in zip(tiles, needs, vals, strict=True):
                core = map_box(t.core, shapes[ref], shapes[op.dst])
                if op.dst in need and not box_empty(core):
                    acc.add(sub_tensor(*v[op.src[0]], core))
            ctx.stats[id(op)] = adjusted(acc.result(), (adjust or {}).get(id(op)))
        for need, v in zip(needs, vals, strict=True):
            if op.dst in need:
                run_op(program.ops, i, ctx, v, need, shapes, last, shared=[x])
    done = {t.index: v[out_v][0] for t, v in zip(tiles, vals, strict=True)}
    logger.info("fast mode: statistics of %d GroupNorms from %d of the tiles", len(fixed), len(tiles))
    return {i: s for i, s in ctx.stats.items() if i in fixed}, done


def staged_tile_stats(program: Program, x, ref: str, tiles: list, fixed: set[int],
                      options: RunOptions = ON_DISK, adjust: dict[int, Any] | None = None):
    """`sampled_tile_stats` segment by segment with the sampled tiles' values staged between GroupNorms.

    Same values and statistics; memory is one tile's working set at a time (plus the staged regions, which
    disk staging releases after each tile) instead of every sampled tile's values at once. The program is
    cut before every GroupNorm in `fixed` whose input the current segment makes; each sampled tile runs a
    segment on its own back-propagated regions (core plus the halo of everything after it) and writes
    them to full-size staged tensors of which only those regions are ever touched. A GroupNorm's
    statistics are merged over the sampled cores read back from staging before its segment runs.
    `options`: the staging (its place, folder, heap slack), row bands and the executor's chunks, and the
    values recomputed instead of staged (`options.recompute`, `locality.program.recompute`: measured by
    the segment making them, remade from staged leaves by each segment reading them; the same values).
    """
    shapes = program.shapes(tuple(x.shape[-2:]))
    out_v = program.output
    needs = [back_propagate(program.ops, {out_v: map_box(t.core, shapes[ref], shapes[out_v])}, shapes)
             for t in tiles]
    segs = split_segments(program, lambda op: op.kind is OpKind.GROUP_NORM and id(op) in fixed)
    if options.recompute:  # (measured by their makers, remade by their readers from staged leaves)
        segs = recompute(segs, options.recompute, program.input)
    run = _StagedRun(program, x, ref, tiles, needs, shapes, options, fixed)
    stage = Staging(options.staging.home, x.device, options.stage_dir, options.heap_slack)
    last = {v: i for i, seg in enumerate(segs) for v in seg.inputs}
    try:
        stage.put(program.input, x)
        for i, seg in enumerate(segs):
            run.segment_stats(seg, stage, adjust)
            for v in seg.outputs:
                if v != out_v and v not in seg.measured:
                    stage.alloc(v, (x.shape[0], run.chans[v], *shapes[v]), x.dtype)
            for t, need in zip(tiles, needs, strict=True):
                run.tile(seg, t, need, stage)
                stage.trim()
            for v in [v for v, j in last.items() if j == i and v != program.input]:
                stage.free(v)
    finally:
        stage.close()
    logger.info("fast mode: statistics of %d GroupNorms from %d of the tiles (staged on %s)", len(fixed),
                len(tiles), options.staging)
    return {i: s for i, s in run.ctx.stats.items() if i in fixed}, run.done


class _StagedRun:
    """The state of one `staged_tile_stats`: the statistics merged as the tiles write (no read back from
    staging) and the sampled tiles' outputs."""

    def __init__(self, program: Program, x, ref: str, tiles: list, needs: list, shapes, options: RunOptions,
                 fixed: set[int]):
        self.program, self.ref, self.tiles, self.needs, self.shapes = program, ref, tiles, needs, shapes
        self.options, self.chans, self.unit = options, program.channels(), x.shape[0] * x.element_size()
        self.fixed = fixed
        self.ctx = ExecContext(query_chunk=options.query_chunk, conv_workspace=options.conv_workspace)
        self.readers: dict[str, set[int]] = {}  # value -> group counts of the fixed GroupNorms reading it
        for op in program.ops:
            if op.kind is OpKind.GROUP_NORM and id(op) in fixed:
                self.readers.setdefault(op.src[0], set()).add(op.groups)
        self.accs: dict[tuple[str, int], GroupStats] = {}
        self.done: dict[int, Any] = {}

    def segment_stats(self, seg, stage: Staging, adjust) -> None:
        """The statistics of the segment's fixed GroupNorms: merged as earlier segments' tiles wrote their
        inputs, or (the part's input) read back from staging; corrected by the low pass's `adjust`."""
        for op in seg.ops:
            if op.kind is OpKind.GROUP_NORM and id(op) in self.fixed and id(op) not in self.ctx.stats:
                acc = self.accs.get((op.src[0], op.groups))
                if acc is None:  # (the part's input: staged as given)
                    acc = _staged_group_stats(op, stage, self.tiles, self.needs, self.shapes, self.ref,
                                              self.options.stats_chunk)
                self.ctx.stats[id(op)] = adjusted(acc.result(), (adjust or {}).get(id(op)))

    def tile(self, seg, t, need, stage: Staging) -> None:
        """One sampled tile through one segment, band by band: its regions written to staging, the cores
        of the values fixed GroupNorms read added to their statistics, its output core kept."""
        made = {v for op in seg.ops for v in (op.dst, *op.src)}
        seg_need = {v: need[v] for v in made if v in need}
        band = self.options.band_bytes if row_local(seg) else None
        boxes, bneeds = _tile_band_needs(self.program, t.core, self.ref, seg_need, need, self.shapes,
                                         self.chans, self.unit, band)
        outs, out_v = [], self.program.output
        run = run_bands(seg, stage, self.ctx, [seg.outputs] * len(boxes), self.shapes,
                        last_use(seg.ops, seg.outputs), bneeds)
        for box, bneed, (_, vals) in zip(boxes, bneeds, run, strict=True):
            for v in seg.outputs:
                if v == out_v:
                    outs.append(vals[v][0])
                elif v in vals:
                    if v not in seg.measured:  # (recomputed by its readers: its statistics only)
                        stage.write(v, bneed[v], vals[v][0])
                    core = map_box(box, self.shapes[self.ref], self.shapes[v])
                    for g in self.readers.get(v, ()) if not box_empty(core) else ():
                        self.accs.setdefault((v, g), GroupStats(g, self.options.stats_chunk)).add(
                            sub_tensor(*vals[v], core))
            del vals
        if outs:
            self.done[t.index] = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


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


def _staged_group_stats(op, stage: Staging, tiles, needs, shapes, ref: str, chunk: int) -> GroupStats:
    """Statistics of a GroupNorm's input over the sampled tiles' cores, read back from staging."""
    acc = GroupStats(op.groups, chunk)
    src = op.src[0]
    for t, need in zip(tiles, needs, strict=True):
        core = map_box(t.core, shapes[ref], shapes[op.dst])
        if op.dst in need and not box_empty(core):
            acc.add(stage.read(src, core))
    return acc


def adjusted(sample, low):
    """Difference / ratio estimator: sample statistics moved by (global - sample) of a cheap full pass.

    low = ((mean, var) over the whole image, (mean, var) over the sampled regions) of the low-resolution
    pass: mean = m_s + (M_low - m_low), var = v_s * V_low / v_low.
    """
    if low is None:
        return sample
    (mg, vg), (ms, vs) = low
    return sample[0] + (mg - ms), sample[1] * vg / vs.clamp_min(1e-12)
