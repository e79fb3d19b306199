"""Box arithmetic of tile programs: boxes (y0, y1, x0, x1) clipped, padded, united, scaled between
resolutions, and sliced out of the tensors that cover them (an upsampled box sliced without being made)."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F

from ..geometry import Box


def clip_box(box: Box, shape: tuple[int, int]) -> Box:
    """Intersect a box with the image [0, H) x [0, W)."""
    y0, y1, x0, x1 = box
    h, w = shape
    return max(y0, 0), min(y1, h), max(x0, 0), min(x1, w)


def zero_pad(need: Box, inner: Box) -> tuple[tuple[int, int, int, int], bool]:
    """The zero padding (left, right, top, bottom) a conv reading `need` adds around the part `inner` of
    it that lies in the image, and whether the conv can add it itself (the same on both sides of each
    axis, as for the untiled call or a tile spanning the image's width and height): then no padded copy
    is made (one kernel and one tile-sized buffer fewer)."""
    pad = (inner[2] - need[2], need[3] - inner[3], inner[0] - need[0], need[1] - inner[1])
    return pad, pad[0] == pad[1] and pad[2] == pad[3]


def union_box(a: Box | None, b: Box) -> Box:
    """Bounding box of two boxes."""
    if a is None:
        return b
    return min(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), max(a[3], b[3])


def box_empty(box: Box) -> bool:
    """True when the box holds no pixel."""
    return box[1] <= box[0] or box[3] <= box[2]


def box_area(box: Box) -> int:
    """Pixels in a box (0 when empty)."""
    return max(0, box[1] - box[0]) * max(0, box[3] - box[2])


def map_box(box: Box, ref: tuple[int, int], shape: tuple[int, int]) -> Box:
    """Map a box on the reference grid to a value of another resolution (floor of the scaled edges)."""
    y0, y1, x0, x1 = box
    return y0 * shape[0] // ref[0], y1 * shape[0] // ref[0], x0 * shape[1] // ref[1], x1 * shape[1] // ref[1]


class BoxIndex:
    """Boxes, indexed to find those meeting a box without a pass over all of them: grouped by their rows,
    the groups sorted by first row, each group's boxes by first column (the sampled cores a pass probes
    are a grid's: a band of them meets a tile)."""

    def __init__(self, boxes):
        groups: dict[tuple[int, int], list] = {}
        for b in boxes:
            groups.setdefault(b[:2], []).append(b)
        self.rows = sorted(groups)
        self.starts = [r[0] for r in self.rows]
        self.tall = max((r[1] - r[0] for r in self.rows), default=0)
        self.cols = {r: sorted(bs, key=lambda b: b[2]) for r, bs in groups.items()}
        self.col_starts = {r: [b[2] for b in bs] for r, bs in self.cols.items()}
        self.wide = {r: max(b[3] - b[2] for b in bs) for r, bs in self.cols.items()}

    def meeting(self, box: Box) -> list[Box]:
        """The intersections with `box` of the boxes that meet it (each box's, duplicates too), in no
        particular order."""
        y0, y1, x0, x1 = box
        got = []
        # (a box of rows [a, b) with b - a <= tall meets rows [y0, y1) only if y0 - tall < a < y1)
        for r in self.rows[bisect_left(self.starts, y0 - self.tall + 1):bisect_left(self.starts, y1)]:
            if r[1] <= y0 or r[0] >= r[1]:
                continue
            bs, starts = self.cols[r], self.col_starts[r]
            for b in bs[bisect_left(starts, x0 - self.wide[r] + 1):bisect_left(starts, x1)]:
                if b[3] > x0 and b[2] < b[3]:
                    got.append((max(b[0], y0), min(b[1], y1), max(b[2], x0), min(b[3], x1)))
        return got


def sub_tensor(t, have: Box, want: Box):
    """Slice the `want` box out of tensor `t` that covers box `have` (want must lie inside have)."""
    if want[0] < have[0] or want[1] > have[1] or want[2] < have[2] or want[3] > have[3]:
        raise AssertionError(f"box {want} is not inside the computed box {have}")
    if isinstance(t, Upsampled):
        return t.crop(have, want)
    return t[..., want[0] - have[0] : want[1] - have[0], want[2] - have[2] : want[3] - have[2]]


@dataclass
class Upsampled:
    """A nearest-upsampled box not materialised: `crop` computes just the part a reader asks for.

    Used when a Resample's only reader is the convolution right after it (diffusers' Upsample2D): the
    convolution reads its input in row bands, so only a band of the upsampled value ever exists
    (at 1024 px the upsampled tile is ~70 MiB; the band a few MiB). Values are those of Resample.run.
    """

    source: Any  # tensor covering box `src_box` of the resample's input
    src_box: Box
    scale: int

    def crop(self, have: Box, want: Box):
        s = self.scale
        need = (want[0] // s, (want[1] - 1) // s + 1, want[2] // s, (want[3] - 1) // s + 1)
        x = sub_tensor(self.source, self.src_box, need)
        x = F.interpolate(x, scale_factor=float(s), mode="nearest")
        return sub_tensor(x, (need[0] * s, need[1] * s, need[2] * s, need[3] * s), want)
