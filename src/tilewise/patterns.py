"""Deterministic test inputs for tiling (seed 000): lines and checkerboards crossing tile boundaries,
awkward sizes (1xN, Nx1, primes, odd, smaller than a tile), seeded white and structured latents, and a
per-pixel coordinate pattern for checking streamed outputs.

Image patterns are torch tensors (N, C, H, W) in ``value_range`` (default (-1, 1), the VAE's image range).
``grid_or_boxes`` is a :class:`tilewise.geometry.TileGrid` (its tiles' cores are used), an iterable of
tiles, or an iterable of ``(y0, y1, x0, x1)`` core boxes.

torch (~2 s) is imported inside the functions that build tensors: `import tilewise.patterns` needs numpy only
(tests/test_metrics.py checks it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from .geometry import Box


def core_boxes(grid_or_boxes: Any) -> list[Box]:
    """The core boxes of a TileGrid / iterable of tiles, or the boxes themselves."""
    boxes = []
    for item in grid_or_boxes:
        box = getattr(item, "core", item)
        try:
            y0, y1, x0, x1 = (int(v) for v in box)
        except (TypeError, ValueError):
            raise ValueError(f"expected tiles with a .core or (y0, y1, x0, x1) boxes, got {item!r}") from None
        if y1 <= y0 or x1 <= x0:
            raise ValueError(f"box {box!r} is empty: need y0 < y1 and x0 < x1")
        boxes.append((y0, y1, x0, x1))
    if not boxes:
        raise ValueError(f"no tiles or boxes in {grid_or_boxes!r}")
    return boxes


def boundary_positions(boxes: Iterable[Box]) -> tuple[list[int], list[int]]:
    """Interior core-boundary rows and columns: every y0 > 0 and x0 > 0 of the cores, sorted."""
    boxes = list(boxes)
    return sorted({b[0] for b in boxes if b[0] > 0}), sorted({b[2] for b in boxes if b[2] > 0})


def _check_hw(height: int, width: int) -> None:
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (height, width)):
        raise ValueError(f"height and width must be positive ints, got {height!r} and {width!r}")


def _image(mask: np.ndarray, channels: int, batch: int, value_range: tuple[float, float]) -> Any:
    """(batch, channels, H, W) float32 tensor: value_range[1] where mask, value_range[0] elsewhere."""
    import torch

    lo, hi = value_range
    img = torch.from_numpy(np.where(mask, hi, lo).astype(np.float32))
    return img.expand(batch, channels, *mask.shape).contiguous()


def boundary_lines(height: int, width: int, grid_or_boxes: Any = None, *, period: int = 16,
                   thickness: int = 1, channels: int = 3, batch: int = 1,
                   value_range: tuple[float, float] = (-1.0, 1.0)) -> Any:
    """Bright lines on dark: on every core boundary (``thickness`` px each side), or every ``period``.

    With a grid each line straddles a core boundary: rows y0 - thickness .. y0 + thickness - 1 for every
    interior core edge y0 (same for columns), so both tiles on either side see the step.
    """
    _check_hw(height, width)
    if thickness < 1 or period < 1:
        raise ValueError(f"thickness and period must be >= 1, got {thickness!r} and {period!r}")
    if grid_or_boxes is not None:
        rows, cols = boundary_positions(core_boxes(grid_or_boxes))
    else:
        rows, cols = list(range(period, height, period)), list(range(period, width, period))
    on_y, on_x = np.zeros(height, bool), np.zeros(width, bool)
    for y in rows:
        on_y[max(0, y - thickness):y + thickness] = True
    for x in cols:
        on_x[max(0, x - thickness):x + thickness] = True
    return _image(on_y[:, None] | on_x[None, :], channels, batch, value_range)


def checkerboard(height: int, width: int, cell: int | tuple[int, int] = 7, *,
                 offset: tuple[int, int] = (0, 0), channels: int = 3, batch: int = 1,
                 value_range: tuple[float, float] = (-1.0, 1.0)) -> Any:
    """Checkerboard of ``cell``-sized squares shifted by ``offset``; odd cells cross tile edges everywhere."""
    _check_hw(height, width)
    cy, cx = (cell, cell) if isinstance(cell, int) else cell
    if cy < 1 or cx < 1:
        raise ValueError(f"cell sides must be >= 1, got {cell!r}")
    y = (np.arange(height) + offset[0]) // cy
    x = (np.arange(width) + offset[1]) // cx
    return _image((y[:, None] + x[None, :]) % 2 == 0, channels, batch, value_range)


def tile_checkerboard(height: int, width: int, grid_or_boxes: Any, *, channels: int = 3, batch: int = 1,
                      value_range: tuple[float, float] = (-1.0, 1.0)) -> Any:
    """Each tile core filled bright or dark by the parity of its (row, col): a step on every core edge."""
    _check_hw(height, width)
    boxes = core_boxes(grid_or_boxes)
    rows, cols = boundary_positions(boxes)
    mask = np.zeros((height, width), bool)
    for y0, y1, x0, x1 in boxes:
        parity = (np.searchsorted(rows, y0, side="right") + np.searchsorted(cols, x0, side="right")) % 2
        mask[y0:y1, x0:x1] = parity == 0
    return _image(mask, channels, batch, value_range)


def coordinate_pattern(box: Box, channels: int = 3, dtype: Any = "uint8") -> np.ndarray:
    """(h, w, C) pixels of box: (3y + 5x + 85c + (x*y >> 5)) mod 2^bits, computable for any crop.

    uint8/uint16 get the formula modulo 2^8 / 2^16; float dtypes get the uint16 value / 65535.
    """
    y0, y1, x0, x1 = box
    y = np.arange(y0, y1, dtype=np.uint32)[:, None, None]
    x = np.arange(x0, x1, dtype=np.uint32)[None, :, None]
    c = np.arange(channels, dtype=np.uint32)[None, None, :]
    v = y * np.uint32(3) + x * np.uint32(5) + c * np.uint32(85) + ((x * y) >> np.uint32(5))
    dtype = np.dtype(dtype)
    if dtype == np.uint8:
        return (v & np.uint32(0xFF)).astype(np.uint8)
    v = (v & np.uint32(0xFFFF)).astype(np.uint16)
    if dtype == np.uint16:
        return v
    if dtype.kind == "f":
        return (v / np.float32(65535)).astype(dtype)
    raise ValueError(f"coordinate_pattern supports uint8, uint16 and float dtypes, got {dtype}")


# --------------------------------------------------------------------------------------------------
# latents


def _generator(seed: int) -> Any:
    import torch

    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    return torch.Generator("cpu").manual_seed(seed)


def _check_shape(shape: Any) -> tuple[int, ...]:
    shape = tuple(shape)
    if len(shape) < 2 or not all(isinstance(d, int) and d >= 1 for d in shape):
        raise ValueError(f"latent shape must be (..., H, W) with positive ints, got {shape!r}")
    return shape


def white_latent(shape: tuple[int, ...], seed: int = 0) -> Any:
    """Seeded standard normal latent: torch.randn(shape) from a CPU generator seeded with ``seed``."""
    import torch

    return torch.randn(_check_shape(shape), generator=_generator(seed))


def structured_latent(shape: tuple[int, ...], seed: int = 0) -> Any:
    """0.5 randn + 2 * (4x4 randn grid, bilinearly upsampled) + horizontal ramp -2..2 (issue 3's benchmark).

    Draw order from one CPU generator seeded with ``seed``: the full-size randn first, then the
    (..., 4, 4) grid; upsampling is ``F.interpolate(mode="bilinear", align_corners=False)``; the ramp is
    ``torch.linspace(-2, 2, W)`` along the width. Tile means differ, as with real image content.
    """
    import torch
    import torch.nn.functional as F

    shape = _check_shape(shape)
    g = _generator(seed)
    *lead, h, w = shape
    noise = torch.randn(shape, generator=g)
    coarse = torch.randn((*lead, 4, 4), generator=g)
    up = F.interpolate(coarse.reshape(-1, 1, 4, 4), size=(h, w), mode="bilinear", align_corners=False)
    ramp = torch.linspace(-2.0, 2.0, w)
    return 0.5 * noise + 2.0 * up.reshape(shape) + ramp


# --------------------------------------------------------------------------------------------------
# sizes


def _primes_near(n: int, count: int) -> list[int]:
    out, k = [], max(2, n)
    while len(out) < count:
        if all(k % p for p in range(2, math.isqrt(k) + 1)):
            out.append(k)
        k += 1
    return out


def awkward_sizes(tile: int = 16, long: int | None = None) -> list[tuple[int, int]]:
    """(H, W) sizes that break naive tilers, relative to a ``tile`` side.

    1x1; 1xN and Nx1 strips (N = ``long``, default 8 * tile + 1); smaller than one tile; one pixel more
    than a tile; primes just above 2 and 3 tiles; odd sizes not divisible by the tile; extreme aspect
    (2 x long - 1); an exact multiple of the tile as the easy control.
    """
    if not (isinstance(tile, int) and tile >= 2):
        raise ValueError(f"tile must be an int >= 2, got {tile!r}")
    long = 8 * tile + 1 if long is None else long
    if not (isinstance(long, int) and long > tile):
        raise ValueError(f"long must be an int > tile ({tile}), got {long!r}")
    p2, p3 = _primes_near(2 * tile + 1, 1)[0], _primes_near(3 * tile + 1, 1)[0]
    sizes = [
        (1, 1),
        (1, long),
        (long, 1),
        (tile - 1, max(1, tile // 2 - 1)),  # smaller than one tile
        (tile + 1, tile + 1),  # one pixel past a tile: a sliver tile
        (p2, p3),  # primes
        (3 * tile + 3, 2 * tile + 5),  # odd, not divisible
        (2, long - 1),  # extreme aspect
        (2 * tile, 3 * tile),  # divisible control
    ]
    return list(dict.fromkeys(sizes))
