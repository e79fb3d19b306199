"""Classes of translated tiles: tiles of a segment whose boxes are one another's translates, counted once
per class (`counts.segment_cost`)."""

from __future__ import annotations

from ..run.batches import axis_class, period_and_reach


class Translations:
    """Tiles whose boxes are one another's translates cost the same: a segment's tile is counted once per
    class of its boxes (`reps`: the boxes of its first tile) and the count reused for the others (the
    interior tiles of a grid are one class; a plan's search counts tens of thousands of tiles otherwise).

    A tile's count reads its boxes only through their sides, their clipping at the value's borders and
    the integer divisions of the ops' factors. So two tiles count alike when every value's box has the
    same sides, the same origin modulo `period` (a multiple of every op's factor) and the same distances
    to the borders up to `reach` (past it no op's input box reaches the border). Boxes are products of
    a row interval and a column interval, and every op maps rows to rows and columns to columns, so the
    class is a pair: what the tile's rows give (its bands, every value's rows) and what its columns give,
    each learned once per interval (`by_axis`; the regions of fast mode's staged sampled tiles too, which
    are back-propagated from their cores; without it, from each tile's own boxes: after a tile where a
    value's box is empty; a pass's probes are counted from each tile's own cores, beside its class).
    With split values (a device+host staging's, `key`) the class also says how many of each box's rows
    are on the device: one object serves every split of the segment's values, and a split's class is
    counted on the boxes of its first tile under that split (`rep`): the same boxes under another split
    have other rows on the device (SDXL decode at 4096 px within 1,686 MiB: a class of all-host boxes
    counted on boxes a later split held on the device, 0.39 GiB of reads left out of the plan)."""

    def __init__(self, seg, shapes):
        self.shapes, self.by_axis, self.outputs = shapes, True, set(seg.outputs)
        self.reps: dict[tuple, tuple[list, list]] = {}  # class -> its first tile's (bands, needs)
        self.rows, self.cols, self.ids = {}, {}, {}  # interval -> its axis class; axis class -> its id
        self.keys: dict[tuple, tuple[int, int]] = {}  # core -> class, of the tiles seen
        self.made: dict[tuple, tuple[list, list]] = {}  # core or rows -> the boxes of a tile there
        self.split: dict[tuple, tuple] = {}  # (core or rows, split) -> its split values' device rows
        self.split_reps: dict[tuple, tuple[list, list]] = {}  # (class, split) -> its first tile's boxes
        self.known: dict[tuple, list] = {}  # (tiles, split) -> their classes
        self.period, self.reach = period_and_reach(seg.ops, shapes)

    def classes(self, tiles, boxes, split: tuple = ()) -> list[tuple]:
        """The class of each of `tiles` (`key`; `boxes(tile)`: its bands and the boxes they need), once per
        tiles and split."""
        seen = (tuple(t.index for t in tiles), split)
        if seen not in self.known:
            self.known[seen] = [self.key(t, lambda t=t: boxes(t), split) for t in tiles]
        return self.known[seen]

    def key(self, tile, boxes, split: tuple = ()) -> tuple:
        """The class of a tile: known from its core, or its rows and columns, else from its boxes
        (`boxes()`: its bands and the boxes they need); with `split` ((value, its first rows on the
        device), sorted), with the device rows of each split value's boxes."""
        core = tile.core
        got = self.keys.get(core)
        if got is None and self.by_axis:
            y, x = self.rows.get(core[:2]), self.cols.get(core[2:])
            got = None if y is None or x is None or (y, x) not in self.reps else (y, x)
        if got is None:
            got = self._remember(core, *boxes())
        self.keys[core] = got
        if not split:
            return got
        where = core[:2] if self.by_axis and core[:2] in self.made else core
        # (with `by_axis` every tile of these rows has the same rows in its boxes)
        if (where, split) not in self.split:
            self.split[where, split] = _device_rows(*self._made(where, boxes), dict(split))
        key = (*got, self.split[where, split])
        if (key, split) not in self.split_reps:  # (its boxes under this split: their device rows are the
            self.split_reps[key, split] = self._made(core, boxes)  # class's)
        return key

    def rep(self, key, split: tuple = ()) -> tuple[list, list]:
        """The bands and boxes a class of tiles (`key`, classed with `split`) is counted on: its first
        tile's, under that split."""
        return self.split_reps[key, split] if split else self.reps[key]

    def _made(self, where, boxes) -> tuple[list, list]:
        if where not in self.made:
            self.made[where] = boxes()
        return self.made[where]

    def _remember(self, core, bands, needs) -> tuple[int, int]:
        """The class of a tile from its boxes, which become its class's `reps` if it is the first."""
        if self.by_axis and any(set(c) != self.outputs for c in bands):
            self.by_axis = False  # (an empty box: rows and columns no longer say which values a band has)
        if self.by_axis:
            if core[:2] not in self.rows:  # (the boxes of its rows, for a split's device rows)
                self.made[core[:2]] = (bands, needs)
            key = self.rows.setdefault(core[:2], self._id(self._axis(bands, needs, 0))), \
                self.cols.setdefault(core[2:], self._id(self._axis(bands, needs, 2)))
        else:
            key = (self._id(self._axis(bands, needs, 0)), self._id(self._axis(bands, needs, 2)))
        self.reps.setdefault(key, (bands, needs))
        return key

    def _id(self, axis_class: tuple) -> int:
        return self.ids.setdefault(axis_class, len(self.ids))

    def _axis(self, bands, needs, a: int) -> tuple:
        """The class of a tile's boxes along one axis (a = 0: rows, 2: columns; `batches.axis_class`)."""
        return axis_class(bands, needs, self.shapes, self.period, self.reach, a)


def _device_rows(bands, needs, split: dict[str, int]) -> tuple:
    """How many rows of each split value's box are on the device, band by band and box by box."""
    return tuple(tuple((v, max(0, min(b[1], split[v]) - b[0])) for v, b in d.items() if v in split)
                 for d in (*bands, *needs))
