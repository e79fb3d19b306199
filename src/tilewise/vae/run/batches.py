"""Batched tiles: a segment's tiles whose boxes are one another's translates run as one batch.

Tiles of one class (`tile_class`: every value's box of the same sides, the same origin modulo `period`,
the same distances to the borders up to `reach`) run the segment's ops alike: the same shapes, the same
zero padding, the same resampling phase. Up to `tile_batch` of them (`batch_groups`) have their input
boxes stacked along the batch axis (tile-major: tile i holds rows i B .. (i + 1) B - 1), the ops run once
on the first tile's boxes, and each tile's part of the results is stored as its own (statistics per tile
core and per sample, as unbatched). Only local segments of batch-agnostic ops batch (`batchable`): a
global attention's queries run tile by tile. The plan counts the same groups (`plan.counts`).
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from ...locality.ops import OpKind
from ...locality.program import Segment, SegmentKind
from .bands import run_bands

# ops that compute each batch item alike from its own input (GroupNorm with given statistics: the affine
# of each sample, `locality.affine.apply_affine`; attention in a local segment: tile-local, its own keys)
BATCH_AGNOSTIC = frozenset({OpKind.CONV, OpKind.RESAMPLE, OpKind.POINTWISE, OpKind.ADD, OpKind.GROUP_NORM,
                            OpKind.ATTENTION})


def batchable(seg: Segment) -> bool:
    """Whether a segment's tiles may run batched: a local segment of batch-agnostic ops."""
    return seg.kind is SegmentKind.LOCAL and all(op.kind in BATCH_AGNOSTIC for op in seg.ops)


def period_and_reach(ops, shapes) -> tuple[int, int]:
    """A multiple of every op's resampling factor (num and den of its output side over its input's) and
    a distance to the border (in any value's pixels) beyond which no op's input box is clipped."""
    period, radius, big = 1, 0, 1 << 20
    for op in ops:
        if not op.src:
            continue
        out = op.out_shape([(big, big)] * len(op.src))[0]
        f = Fraction(out, big).limit_denominator(64)
        period = math.lcm(period, f.numerator, f.denominator)
    for op in ops:
        if not op.src:
            continue
        out = op.out_shape([(big, big)] * len(op.src))[0]
        c = (out // 2) // period * period  # (a point far from every border, on the period)
        for a, b in ((ib[0], ib[1]) for ib in op.input_boxes((c, c + 1, c, c + 1))):
            centre = c * big // out
            radius = max(radius, centre - a, b - (c + 1) * big // out)
    return period, (radius + 2) * period


def axis_class(bands, needs, shapes, period: int, reach: int, a: int) -> tuple:
    """The class of a tile's boxes along one axis (a = 0: rows, 2: columns): per band and per value, the
    box's side, its origin modulo `period` and its distances to the value's borders up to `reach`."""
    side = a // 2
    return len(bands), tuple(tuple((v, b[a + 1] - b[a], b[a] % period, min(b[a], reach),
                                    min(shapes[v][side] - b[a + 1], reach)) for v, b in d.items())
                             for d in (*bands, *needs))


def tile_class(bands, needs, shapes, period: int, reach: int) -> tuple:
    """The class of a tile: its rows' and its columns' (`axis_class`); tiles of one class batch."""
    return (axis_class(bands, needs, shapes, period, reach, 0),
            axis_class(bands, needs, shapes, period, reach, 2))


def batch_groups(items: list, size: int, by_row: bool) -> list[list]:
    """Items (tile, class, ...) in run order cut into groups of at most `size` of one class (and one tile
    row when `by_row`: a segment that emits the output keeps its rows in order), in the order of each
    group's first tile."""
    groups: list[list] = []
    open_: dict = {}
    for item in items:
        key = (item[0].row if by_row else 0, item[1])
        group = open_.get(key)
        if group is None or len(group) >= size:
            group = open_[key] = []
            groups.append(group)
        group.append(item)
    return groups


def stack(parts: list):
    """Tiles' boxes of one value stacked along the batch axis, tile-major (one tile: itself)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def shifted(box, frm, to):
    """`box` moved by the offset from box `frm`'s origin to box `to`'s (the same box of another tile)."""
    dy, dx = to[0] - frm[0], to[2] - frm[2]
    return box[0] + dy, box[1] + dy, box[2] + dx, box[3] + dx


def run_group(seg: Segment, stage, ctx, group: list, shapes, last: dict[str, int], batch: int):
    """One group of `batch_groups` (items (tile, class, cores, boxes)) run as one batch: yields each tile's
    (cores, values) as `run_bands` does for one tile (its part of the batch, on its own boxes)."""
    _, _, cores0, need0 = group[0]
    if len(group) == 1:
        yield from run_bands(seg, stage, ctx, [cores0], shapes, last, needs=[need0])
        return
    given = {v: stack([stage.read(v, item[3][v]) for item in group]) for v in seg.inputs if v in need0}
    vals = next(run_bands(seg, stage, ctx, [cores0], shapes, last, needs=[need0], given=given))[1]
    for i, (_, _, cores, need) in enumerate(group):
        yield cores, {v: (vals[v][0][i * batch : (i + 1) * batch], shifted(vals[v][1], need0[v], need[v]))
                      for v in cores}
