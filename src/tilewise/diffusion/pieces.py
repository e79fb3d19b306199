"""Where a tiled denoiser call reads and writes: the pieces of each fusion method on a latent grid.

A piece is one model call's spatial unit: the box it reads and the box of the fused output it
contributes to. Overlapping windows (MultiDiffusion, Mixture of Diffusers) read and write the same box;
halo tiles read their core plus a halo and keep the core; SpotDiffusion's shifted non-overlapping
partition places its cut edge cells on full tiles inside the image (no wrap-around).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from ..geometry import Box, TileGrid, axis_windows


@dataclass(frozen=True)
class Piece:
    """One model call's spatial unit: the box it reads and the box of the output it contributes to."""

    index: int
    read: Box
    out: Box

    @property
    def crop(self) -> tuple[slice, ...]:
        """Slices cutting `out` from a prediction computed on `read` (axes: [frames,] rows, columns)."""
        r, o = self.read, self.out
        return tuple(slice(o[i] - r[i], o[i + 1] - r[i]) for i in range(0, len(o), 2))

    @property
    def spatial(self) -> Box:
        """The read box's rows and columns (y0, y1, x0, x1), without a video's frames."""
        return self.read[-4:]


def spot_offset(seed: int, timestep: Any, tile: tuple[int, int]) -> tuple[int, int]:
    """SpotDiffusion shift (dy, dx) in [0, tile): a pure function of the seed and the timestep value."""
    t = float(timestep.flatten()[0]) if isinstance(timestep, torch.Tensor) else float(timestep)
    rng = random.Random(f"tilewise-spot:{seed}:{round(t * 1000)}")
    return rng.randrange(tile[0]), rng.randrange(tile[1])


def _shifted_axis(length: int, tile: int, shift: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """SpotDiffusion partition of one axis: (window, core) pairs, cores cut at shift + k * tile."""
    if length <= tile:
        return [((0, length), (0, length))]
    bounds = sorted({0, length, *range(shift, length, tile)})
    pairs = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        start = min(a, length - tile) if b - a < tile and a > 0 else a
        pairs.append(((start, start + tile), (a, b)))
    return pairs


def _grow_aligned(read: Box, shape: tuple[int, int], align: int) -> Box:
    """Grow a read box inside the image until its sides are multiples of `align` (when the image allows)."""
    out = list(read)
    for axis, n in enumerate(shape):
        lo, hi = out[2 * axis], out[2 * axis + 1]
        need = -(hi - lo) % align
        grow_hi = min(need, n - hi)
        lo, hi = max(0, lo - (need - grow_hi)), hi + grow_hi
        out[2 * axis], out[2 * axis + 1] = lo, hi
    return out[0], out[1], out[2], out[3]


def plan_pieces(method: str, height: int, width: int, tile_size: tuple[int, int], overlap: tuple[int, int],
                halo: tuple[int, int] | None, align: int, order: str, seed: int,
                timestep: Any = 0) -> list[Piece]:
    """The pieces of one call of `method` on a height x width latent (spot: shifted by the timestep)."""
    tile = (min(tile_size[0], height), min(tile_size[1], width))
    if method == "spot":
        dy, dx = spot_offset(seed, timestep, tile_size)
        ys, xs = _shifted_axis(height, tile[0], dy), _shifted_axis(width, tile[1], dx)
        return [Piece(i, (wy[0], wy[1], wx[0], wx[1]), (cy[0], cy[1], cx[0], cx[1]))
                for i, ((wy, cy), (wx, cx)) in enumerate((y, x) for y in ys for x in xs)]
    # a side the tile does not fit is one window, and has no overlap
    overlap = tuple(0 if method == "halo" or t >= n else o
                    for t, o, n in zip(tile_size, overlap, (height, width), strict=True))
    grid = TileGrid(height, width, tile, overlap=overlap, halo=(halo if method == "halo" else 0) or 0,
                    order=order)
    if method == "halo":
        return [Piece(t.index, _grow_aligned(t.read, (height, width), align), t.core) for t in grid]
    return [Piece(t.index, t.window, t.window) for t in grid]


def frame_windows(frames: int, window: int | None, overlap: int) -> list[tuple[int, int]]:
    """Overlapping windows over a clip's latent frames: the whole clip for `window` None (or >= frames)."""
    if window is None or window >= frames:
        return [(0, frames)]
    return axis_windows(frames, window, overlap, 1, "shift")


def video_pieces(pieces: list[Piece], frames: int, window: int | None, overlap: int) -> list[Piece]:
    """Pieces over (frames, rows, columns): every frame window times every spatial piece, boxes of six
    coordinates (t0, t1, y0, y1, x0, x1); frame windows outermost."""
    out = []
    for t0, t1 in frame_windows(frames, window, overlap):
        out += [Piece(len(out) + i, (t0, t1, *p.read), (t0, t1, *p.out)) for i, p in enumerate(pieces)]
    return out
