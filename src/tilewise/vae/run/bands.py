"""Row bands: a tile of a local segment run as horizontal bands, convolution rows carried between bands.

A local segment whose tile holds more than `band_bytes` (three largest values; CPU plans:
`devices.BAND_BYTES`) runs each tile in row bands of reference rows (`run_bands`): each band computes
the rows of every convolution output the band before did not and carries the overlap rows over, so the
convolutions do the tile's work once while the memory is one band's. Pointwise ops, GroupNorm applies,
adds and resampling recompute the overlap (same values). Only row-local segments band: a tile-local
attention would see a band instead of its tile.
"""

from __future__ import annotations

from typing import Any

import torch

from ...geometry import Box
from ...locality.boxes import box_area, box_empty, map_box, sub_tensor
from ...locality.ops import OpKind
from ...locality.program import Segment, SegmentKind, back_propagate, run_op
from .staging import Staging


def row_local(seg: Segment) -> bool:
    """Whether a segment may run in row bands: a local one without attention (attention="tile" attends
    over the box it is given, so a band would change what it sees)."""
    return seg.kind is SegmentKind.LOCAL and all(op.kind is not OpKind.ATTENTION for op in seg.ops)


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
              needs: list[dict[str, Box]] | None = None, given: dict | None = None):
    """A segment's ops on one tile given as row bands of its output cores (top to bottom): yields
    (cores, values) per band: value -> (tensor, box). A value is dropped after its last reader (`last`,
    from last_use) unless it is one of the band's cores; the staging trims the heap after every op
    (`Staging.trim`). `needs`: each band's boxes, when not back-propagated from its
    cores (the values kept are then those named in `bands`). `given`: the inputs of one band as tensors
    of their own (batched tiles, `batches`), not read from the staging, taken out of the dict (they die
    at their last reader); the ops may overwrite them.

    Each band runs on the boxes back-propagated from its cores. A convolution computes only the rows of
    its output the band before did not and reuses the rows that band computed (carried over, cloned);
    the other ops (pointwise, GroupNorm with known statistics, add, resampling) recompute the overlap,
    same values. So the tile's convolutions do the tile's work once, halo rows included, while the
    memory is one band's boxes plus the carried rows.
    """

    needs = needs or [back_propagate(seg.ops, cores, shapes) for cores in bands]
    carry: dict[str, tuple[Any, Box]] = {}  # conv output -> (rows the next band reuses, their box)
    for j, (cores, need) in enumerate(zip(bands, needs, strict=True)):
        nxt = needs[j + 1] if j + 1 < len(needs) else {}
        if given is not None:
            vals, staged = {v: (given.pop(v), need[v]) for v in seg.inputs if v in need}, []  # (ours now)
        else:
            vals = {v: (stage.read(v, need[v]), need[v]) for v in seg.inputs if v in need}
            # views of staged memory (host / device staging, the program input) are never overwritten; a
            # box read from disk is this band's own copy, which an op may overwrite where it dies
            staged = [t for v, (t, b) in vals.items() if not stage.reads_copy(v, b)]
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
            stage.trim()
        yield cores, vals
        del vals


def run_boxes(seg: Segment, stage: Staging, ctx, need: dict[str, Box], shapes, last: dict[str, int],
              keep) -> dict[str, Any]:
    """A segment's ops, each on its `need` box, from its staged inputs: value -> (tensor, box).

    A value is dropped after its last reader (`last`, from last_use) unless it is in `keep`.
    """
    return next(run_bands(seg, stage, ctx, [keep], shapes, last, needs=[need]))[1]
