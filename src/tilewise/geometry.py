"""Tile geometry: split an H x W region into tiles with overlap (blending) or halo (exact tiling).

Boxes are half-open `(y0, y1, x0, x1)` tuples in image coordinates. Every tile has
- `window`: its extent (`tile_size`, or the whole side when the image is smaller); neighbours overlap by
  at least `overlap`;
- `core`: the output pixels it owns; the cores of a grid partition the image (asserted when built);
- `read`: the window grown by `halo`, the input a tile reads (clipped to the image when `edge="shift"`);
- `pad`: (top, bottom, left, right) pixels beyond the image that `read` needs (only with `edge="pad"`);
- `crop`: the core relative to the read box's origin, to cut the owned part out of a tile's output.

Pure Python: no torch import, so planning and drawing a grid costs nothing. `plots`, `limits` and
`memory` are imported inside the two functions that use them (`draw`; the check of a grid too big for
memory): at module level they would double this module's import time (logging, subprocess, pathlib),
and `limits.host_memory_available` is looked up when the check runs (tests patch it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .errors import WontFit

Box = tuple[int, int, int, int]  # (y0, y1, x0, x1), half-open: rows y0..y1-1, columns x0..x1-1
Pair = tuple[int, int]

EDGES = ("shift", "pad")
ORDERS = ("row", "serpentine", "chess")
PAD_MODES = ("constant", "reflect", "replicate", "circular")


def box_slices(box: Box) -> tuple[slice, ...]:
    """(slice(y0, y1), slice(x0, x1)) for indexing the last two axes: `x[..., *box_slices(b)]`; a box of
    2k coordinates ((t0, t1, y0, y1, x0, x1): a video's frames and pixels) indexes the last k axes."""
    return tuple(slice(box[i], box[i + 1]) for i in range(0, len(box), 2))


def box_area(box: Box) -> int:
    """Number of pixels in a box (0 when empty)."""
    y0, y1, x0, x1 = box
    return max(0, y1 - y0) * max(0, x1 - x0)


def scale_box(box: Box, factor: int | float) -> Box:
    """A box scaled by a resampling factor (e.g. latent -> pixels with factor 8); must land on integers."""
    scaled = [c * factor for c in box]
    if any(abs(c - round(c)) > 1e-9 for c in scaled):
        raise ValueError(f"box {box} scaled by {factor} is {tuple(scaled)}, not on the integer grid")
    y0, y1, x0, x1 = (int(round(c)) for c in scaled)
    return y0, y1, x0, x1


def as_pair(value: int | Sequence[int], name: str) -> Pair:
    """An int or an (h, w) pair of ints as (h, w); ValueError naming `name` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int or an (h, w) pair, got {value!r}")
    if isinstance(value, int):
        return value, value
    try:
        h, w = value
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an int or an (h, w) pair, got {value!r}") from None
    if not (isinstance(h, int) and isinstance(w, int)):
        raise ValueError(f"{name} must hold ints, got {value!r}")
    return h, w


def _align_down(v: int, a: int) -> int:
    return (v // a) * a


def _align_up(v: int, a: int) -> int:
    return -(-v // a) * a


def _suggest(v: int, a: int) -> str:
    lo, hi = _align_down(v, a), _align_up(v, a)
    return " or ".join(str(s) for s in dict.fromkeys(s for s in (lo, hi) if s > 0))


def axis_windows(length: int, tile: int, overlap: int, align: int, edge: str) -> list[tuple[int, int]]:
    """Window starts/ends along one axis: fewest windows of size <= `tile` covering `length`.

    Starts are multiples of `align`, consecutive windows overlap by at least `overlap`. With edge="shift"
    the last window is moved inward to end at `length`; with edge="pad" windows keep their size and the
    last one may end beyond `length`.
    """
    stride = tile - overlap
    if length <= tile:
        return [(0, tile if edge == "pad" else length)]
    n = math.ceil((length - tile) / stride) + 1
    starts = [i * stride for i in range(n)]
    if edge == "shift":
        # aligned start, window ends exactly at the image edge (size <= tile)
        starts[-1] = _align_up(length - tile, align)
        return [(s, min(s + tile, length)) for s in starts]
    return [(s, s + tile) for s in starts]


def axis_cores(windows: list[tuple[int, int]], length: int, align: int) -> list[tuple[int, int]]:
    """Partition [0, length) among windows: each boundary at the aligned midpoint of an overlap."""
    bounds = [0]
    for (_, prev_end), (start, _) in zip(windows, windows[1:], strict=False):
        mid = _align_down((start + min(prev_end, length)) // 2, align)
        bounds.append(min(max(mid, start, bounds[-1]), length))
    bounds.append(length)
    return list(zip(bounds, bounds[1:], strict=False))


@dataclass(frozen=True)
class Tile:
    """One tile of a grid: where it sits, what it owns, what it reads."""

    index: int
    row: int
    col: int
    window: Box
    core: Box
    read: Box
    pad: tuple[int, int, int, int]

    @property
    def crop(self) -> Box:
        """The core relative to the read box's origin."""
        ry, rx = self.read[0], self.read[2]
        y0, y1, x0, x1 = self.core
        return y0 - ry, y1 - ry, x0 - rx, x1 - rx

    @property
    def window_in_read(self) -> Box:
        """The window relative to the read box's origin."""
        ry, rx = self.read[0], self.read[2]
        y0, y1, x0, x1 = self.window
        return y0 - ry, y1 - ry, x0 - rx, x1 - rx

    @property
    def shape(self) -> Pair:
        """(h, w) of the window."""
        return self.window[1] - self.window[0], self.window[3] - self.window[2]

    @property
    def read_shape(self) -> Pair:
        """(h, w) of the read box, padding included."""
        t, b, l, r = self.pad
        return self.read[1] - self.read[0] + t + b, self.read[3] - self.read[2] + l + r


def _visit(rows: int, cols: int, order: str) -> list[Pair]:
    cells = [(r, c) for r in range(rows) for c in range(cols)]
    if order == "serpentine":
        return [(r, c if r % 2 == 0 else cols - 1 - c) for r in range(rows) for c in range(cols)]
    if order == "chess":
        return [rc for rc in cells if sum(rc) % 2 == 0] + [rc for rc in cells if sum(rc) % 2 == 1]
    return cells


class TileGrid:
    """A grid of tiles over an H x W image: windows with overlap, cores that partition, reads with halo."""

    def __init__(
        self,
        height: int,
        width: int,
        tile_size: int | Sequence[int],
        overlap: int | Sequence[int] = 0,
        halo: int | Sequence[int] = 0,
        align: int | Sequence[int] = 1,
        edge: str = "shift",
        pad_mode: str = "constant",
        order: str = "row",
    ) -> None:
        self.height, self.width = _validate_size(height, width)
        self.tile_size = as_pair(tile_size, "tile_size")
        self.overlap = as_pair(overlap, "overlap")
        self.halo = as_pair(halo, "halo")
        self.align = as_pair(align, "align")
        self.edge, self.pad_mode, self.order = edge, pad_mode, order
        self._validate()
        per_axis = [
            (self.height, self.tile_size[0], self.overlap[0], self.align[0]),
            (self.width, self.tile_size[1], self.overlap[1], self.align[1]),
        ]
        windows = [axis_windows(n, t, o, a, edge) for n, t, o, a in per_axis]
        _check_fits(self, len(windows[0]) * len(windows[1]))
        cores = [axis_cores(w, n, a) for w, (n, _, _, a) in zip(windows, per_axis, strict=True)]
        self.rows, self.cols = len(windows[0]), len(windows[1])
        self.tiles = [
            self._tile(i, r, c, windows[0][r], windows[1][c], cores[0][r], cores[1][c])
            for i, (r, c) in enumerate(_visit(self.rows, self.cols, order))
        ]
        self._check_partition()

    def _validate(self) -> None:
        th, tw = self.tile_size
        for name, (a, b) in (("tile_size", self.tile_size), ("align", self.align)):
            if a <= 0 or b <= 0:
                raise ValueError(f"{name} must be positive, got {(a, b)}")
        for name, (a, b) in (("overlap", self.overlap), ("halo", self.halo)):
            if a < 0 or b < 0:
                raise ValueError(f"{name} must be >= 0, got {(a, b)}")
        for axis, t, o in (("height", th, self.overlap[0]), ("width", tw, self.overlap[1])):
            if o >= t:
                raise ValueError(
                    f"overlap {o} must be smaller than the tile {t} along {axis}; valid: 0..{t - 1}"
                )
        for axis, t, o, a in zip(("height", "width"), self.tile_size, self.overlap, self.align, strict=True):
            if t % a:
                raise ValueError(
                    f"tile_size {t} along {axis} is not a multiple of align {a}; use {_suggest(t, a)}"
                )
            if o % a:
                raise ValueError(
                    f"overlap {o} along {axis} is not a multiple of align {a}; use {_suggest(o, a) or 0}"
                )
        if self.edge not in EDGES:
            raise ValueError(f"edge must be one of {EDGES}, got {self.edge!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        if self.pad_mode not in PAD_MODES:
            raise ValueError(f"pad_mode must be one of {PAD_MODES}, got {self.pad_mode!r}")

    def _tile(self, i: int, r: int, c: int, wy: Pair, wx: Pair, cy: Pair, cx: Pair) -> Tile:
        hy, hx = self.halo
        read = (wy[0] - hy, wy[1] + hy, wx[0] - hx, wx[1] + hx)
        if self.edge == "shift":
            read = (max(read[0], 0), min(read[1], self.height), max(read[2], 0), min(read[3], self.width))
            pad = (0, 0, 0, 0)
        else:
            pad = (
                max(0, -read[0]),
                max(0, read[1] - self.height),
                max(0, -read[2]),
                max(0, read[3] - self.width),
            )
        return Tile(i, r, c, (wy[0], wy[1], wx[0], wx[1]), (cy[0], cy[1], cx[0], cx[1]), read, pad)

    def _check_partition(self) -> None:
        """Assert that the cores cover every pixel exactly once and lie inside their windows and reads."""
        area = 0
        for t in self.tiles:
            area += box_area(t.core)
            y0, y1, x0, x1 = t.core
            if not (0 <= y0 <= y1 <= self.height and 0 <= x0 <= x1 <= self.width):
                raise AssertionError(
                    f"core {t.core} of tile {t.index} leaves the {self.height}x{self.width} image"
                )
            if box_area(t.core) and not _contains(t.window, t.core):
                raise AssertionError(f"core {t.core} of tile {t.index} is not inside its window {t.window}")
            if not _contains(t.read, t.window if self.edge == "pad" else _clip(t.window, self.shape)):
                raise AssertionError(
                    f"read {t.read} of tile {t.index} does not contain its window {t.window}"
                )
        if area != self.height * self.width:
            raise AssertionError(f"cores cover {area} pixels, image has {self.height * self.width}")
        # separable construction: rows x cols of per-axis partitions; check both axes are contiguous
        for axis, length in ((0, self.height), (1, self.width)):
            spans = sorted({(t.core[2 * axis], t.core[2 * axis + 1]) for t in self.tiles})
            edge = 0
            for a, b in spans:
                if a != edge:
                    raise AssertionError(f"cores along axis {axis} leave a gap or overlap at {edge}..{a}")
                edge = b
            if edge != length:
                raise AssertionError(f"cores along axis {axis} end at {edge}, image side is {length}")

    @property
    def shape(self) -> Pair:
        """(height, width) of the image."""
        return self.height, self.width

    def __len__(self) -> int:
        return len(self.tiles)

    def __iter__(self) -> Iterator[Tile]:
        return iter(self.tiles)

    def __getitem__(self, i: int) -> Tile:
        return self.tiles[i]

    def read_area(self) -> int:
        """Pixels read over all tiles (halo and overlap counted as often as they are read)."""
        return sum(t.read_shape[0] * t.read_shape[1] for t in self.tiles)

    def overhead(self) -> float:
        """Extra positions computed relative to the image: read_area / (H * W) - 1."""
        return self.read_area() / (self.height * self.width) - 1.0

    def coverage(self) -> list[list[int]]:
        """How many windows cover each pixel (H x W nested lists; for tests and pictures)."""
        cover = [[0] * self.width for _ in range(self.height)]
        for t in self.tiles:
            y0, y1, x0, x1 = _clip(t.window, self.shape)
            for y in range(y0, y1):
                row = cover[y]
                for x in range(x0, x1):
                    row[x] += 1
        return cover

    def describe(self) -> str:
        """A one-paragraph summary: counts, sizes, halo overhead."""
        return (
            f"TileGrid {self.height}x{self.width}: {self.rows}x{self.cols} = {len(self)} tiles of "
            f"{self.tile_size[0]}x{self.tile_size[1]}, overlap {self.overlap}, halo {self.halo}, "
            f"align {self.align}, edge={self.edge}, order={self.order}; "
            f"{self.read_area()} positions read ({self.overhead():+.1%} vs the image)"
        )

    def __repr__(self) -> str:
        return (
            f"TileGrid(height={self.height}, width={self.width}, tile_size={self.tile_size}, "
            f"overlap={self.overlap}, halo={self.halo}, align={self.align}, edge={self.edge!r}, "
            f"order={self.order!r}) -> {self.rows}x{self.cols} tiles"
        )

    def draw(self, path: str | None = None, image=None, scale: float = 1.0, owner=None):
        """Picture of the grid: cores (solid; by rank with `owner`), windows (dashed), reads (dotted)."""
        from .plots import draw_grid

        return draw_grid(self, path=path, image=image, scale=scale, owner=owner)


# bytes one Tile holds as Python objects (measured with tracemalloc: ~590 per tile on CPython 3.11)
TILE_BYTES = 600


def _check_fits(grid: TileGrid, count: int) -> None:
    """Refuse a grid whose tile objects cannot fit in memory (WontFit: the figure, a tile that fits)."""
    need = count * TILE_BYTES
    if need < 64 << 20:  # ~110k tiles: never worth reading /proc/meminfo for
        return
    from .limits import host_memory_available

    room = host_memory_available()
    if need <= room:
        return
    from .memory import format_bytes

    fits = max(1, room // (2 * TILE_BYTES))  # half the room: the work around the grid needs memory too
    side = math.ceil(math.sqrt(grid.height * grid.width / fits)) + max(grid.overlap)
    raise WontFit(f"TileGrid({grid.height}, {grid.width}, tile_size={grid.tile_size}) would hold {count} "
                  f"tiles, ~{format_bytes(need)} as Python objects, but {format_bytes(room)} of memory is "
                  f"available; a tile_size of at least {side} fits (or plan a smaller region)")


def _validate_size(height: int, width: int) -> Pair:
    if not (isinstance(height, int) and isinstance(width, int)) or height <= 0 or width <= 0:
        raise ValueError(f"height and width must be positive ints, got height={height!r}, width={width!r}")
    return height, width


def _contains(outer: Box, inner: Box) -> bool:
    return outer[0] <= inner[0] and inner[1] <= outer[1] and outer[2] <= inner[2] and inner[3] <= outer[3]


def _clip(box: Box, shape: Pair) -> Box:
    return max(box[0], 0), min(box[1], shape[0]), max(box[2], 0), min(box[3], shape[1])
