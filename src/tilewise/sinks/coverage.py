"""Coverage of an image by written blocks: the first gap of a box list, a row buffer for in-order files."""

from __future__ import annotations

import numpy as np

from ..geometry import Box


def first_gap(height: int, width: int, boxes: list[Box]) -> Box | None:
    """First box of the image not covered by ``boxes`` (coordinate-compressed union), or None."""
    if not boxes:
        return (0, height, 0, width)
    ys = np.unique(np.array([0, height] + [v for b in boxes for v in b[:2]]))
    xs = np.unique(np.array([0, width] + [v for b in boxes for v in b[2:]]))
    covered = np.zeros((len(ys) - 1, len(xs) - 1), dtype=bool)
    for y0, y1, x0, x1 in boxes:
        i0, i1 = np.searchsorted(ys, (y0, y1))
        j0, j1 = np.searchsorted(xs, (x0, x1))
        covered[i0:i1, j0:j1] = True
    holes = np.argwhere(~covered)
    if len(holes) == 0:
        return None
    i, j = holes[0]
    return int(ys[i]), int(ys[i + 1]), int(xs[j]), int(xs[j + 1])


class RowBuffer:
    """Rows [start, start + n) of an image with a per-pixel written mask; pops complete leading rows."""

    def __init__(self, height: int, width: int, channels: int, dtype: np.dtype, granule: int):
        self.height, self.width, self.channels, self.dtype = height, width, channels, dtype
        self.granule = granule
        self.start = 0
        self.rows = np.zeros((0, width, channels), dtype)
        self.mask = np.zeros((0, width), bool)
        self.complete = 0  # leading rows of the buffer known to be fully written

    def put(self, y0: int, x0: int, block: np.ndarray) -> None:
        h, w = block.shape[:2]
        if y0 < self.start:
            raise ValueError(f"rows {y0}..{y0 + h} are already flushed (rows < {self.start} are written "
                             f"out); write rows top to bottom: full-width bands or tile rows in order")
        self._grow(y0 + h - self.start)
        r0 = y0 - self.start
        self.rows[r0:r0 + h, x0:x0 + w] = block
        self.mask[r0:r0 + h, x0:x0 + w] = True
        if r0 <= self.complete < r0 + h:
            while self.complete < len(self.mask) and self.mask[self.complete].all():
                self.complete += 1

    def _grow(self, n: int) -> None:
        if n <= len(self.rows):
            return
        n = min(-(-n // self.granule) * self.granule, self.height - self.start)
        rows = np.zeros((n, self.width, self.channels), self.dtype)
        mask = np.zeros((n, self.width), bool)
        rows[:len(self.rows)], mask[:len(self.mask)] = self.rows, self.mask
        self.rows, self.mask = rows, mask

    def pop(self, min_rows: int) -> np.ndarray | None:
        """The complete leading rows, in multiples of ``granule`` and >= ``min_rows`` (fewer at the end)."""
        k = self.complete
        at_end = self.start + k == self.height
        if not at_end:
            k = (k // self.granule) * self.granule
            if k < max(min_rows, 1):
                return None
        if k == 0:
            return None
        out = self.rows[:k]
        self.rows, self.mask = self.rows[k:].copy(), self.mask[k:].copy()
        self.start += k
        self.complete -= k
        return out

    def gap(self) -> Box | None:
        """First unwritten row span (as a box), or None when every row was popped."""
        if self.start == self.height:
            return None
        if len(self.mask) == 0 or self.complete == len(self.mask):
            return (self.start + self.complete, self.height, 0, self.width)
        row = self.start + self.complete
        missing = np.flatnonzero(~self.mask[self.complete])
        return (row, row + 1, int(missing[0]), int(missing[-1]) + 1)
