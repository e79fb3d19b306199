"""Test patterns: checked pixel by pixel against brute-force definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tilewise.geometry import TileGrid
from tilewise.patterns import (
    awkward_sizes,
    boundary_lines,
    boundary_positions,
    checkerboard,
    coordinate_pattern,
    core_boxes,
    structured_latent,
    tile_checkerboard,
    white_latent,
)


def _is_prime(n):
    return n >= 2 and all(n % p for p in range(2, math.isqrt(n) + 1))


@pytest.mark.parametrize("h, w, tile, thickness", [(20, 30, 8, 1), (37, 23, (10, 7), 2), (5, 64, 16, 1)])
def test_boundary_lines_straddle_every_core_edge(h, w, tile, thickness):
    grid = TileGrid(h, w, tile)
    img = boundary_lines(h, w, grid, thickness=thickness, channels=2, batch=3)
    assert img.shape == (3, 2, h, w) and img.dtype == torch.float32
    rows = {t.core[0] for t in grid if t.core[0] > 0}
    cols = {t.core[2] for t in grid if t.core[2] > 0}
    for y in range(h):
        for x in range(w):
            on = any(b - thickness <= y < b + thickness for b in rows) or any(
                b - thickness <= x < b + thickness for b in cols)
            assert img[0, 0, y, x] == (1.0 if on else -1.0), (y, x)
    assert torch.equal(img[2, 1], img[0, 0])


def test_boundary_lines_periodic_and_range():
    img = boundary_lines(9, 7, period=3, value_range=(0.0, 1.0), channels=1)[0, 0]
    expected = np.zeros((9, 7))
    expected[[2, 3, 5, 6], :] = 1  # lines straddle rows 3 and 6 (thickness 1 each side)
    expected[:, [2, 3, 5, 6]] = 1
    assert np.array_equal(img.numpy(), expected)


@pytest.mark.parametrize("cell, offset", [(7, (0, 0)), ((3, 5), (1, 2)), (1, (0, 0))])
def test_checkerboard_closed_form(cell, offset):
    h, w = 19, 23
    cy, cx = (cell, cell) if isinstance(cell, int) else cell
    img = checkerboard(h, w, cell, offset=offset, channels=1)[0, 0]
    for y in range(h):
        for x in range(w):
            even = ((y + offset[0]) // cy + (x + offset[1]) // cx) % 2 == 0
            assert img[y, x] == (1.0 if even else -1.0)


def test_tile_checkerboard_steps_on_every_core_edge():
    grid = TileGrid(29, 41, (8, 11))
    img = tile_checkerboard(29, 41, grid, channels=1)[0, 0]
    owner = np.zeros((29, 41), int)
    for t in grid:
        y0, y1, x0, x1 = t.core
        owner[y0:y1, x0:x1] = t.index
        assert img[y0:y1, x0:x1].unique().numel() == 1  # constant inside a core
    differs_x = (img[:, 1:] != img[:, :-1]).numpy()
    differs_y = (img[1:] != img[:-1]).numpy()
    assert np.array_equal(differs_x, owner[:, 1:] != owner[:, :-1])
    assert np.array_equal(differs_y, owner[1:] != owner[:-1])


def test_core_boxes_accepts_grid_tiles_and_boxes():
    grid = TileGrid(10, 12, 5)
    boxes = [t.core for t in grid]
    assert core_boxes(grid) == boxes == core_boxes(list(grid)) == core_boxes(boxes)
    rows, cols = sorted({b[0] for b in boxes} - {0}), sorted({b[2] for b in boxes} - {0})
    assert boundary_positions(boxes) == (rows, cols)
    assert boundary_positions([(0, 5, 0, 4), (0, 5, 4, 12), (5, 10, 0, 12)]) == ([5], [4])
    with pytest.raises(ValueError, match="empty"):
        core_boxes([(0, 0, 0, 5)])
    with pytest.raises(ValueError, match="no tiles"):
        core_boxes([])


def _pattern_brute(y, x, c, bits):
    return (3 * y + 5 * x + 85 * c + ((x * y) % 2**32 >> 5)) % 2**bits


@pytest.mark.parametrize("dtype, bits", [("uint8", 8), ("uint16", 16)])
def test_coordinate_pattern_per_pixel_and_crops(dtype, bits):
    full = coordinate_pattern((0, 40, 0, 50), 3, dtype)
    assert full.shape == (40, 50, 3) and full.dtype == dtype
    crop = coordinate_pattern((13, 29, 7, 44), 3, dtype)
    assert np.array_equal(crop, full[13:29, 7:44])
    rng = np.random.default_rng(0)
    for y, x in rng.integers(0, 70000, size=(50, 2)):
        y, x = int(y), int(x)
        px = coordinate_pattern((y, y + 1, x, x + 1), 3, dtype)[0, 0]
        assert [int(v) for v in px] == [_pattern_brute(y, x, c, bits) for c in range(3)]


def test_coordinate_pattern_float_and_bad_dtype():
    f = coordinate_pattern((0, 4, 0, 4), 1, "float32")
    assert np.array_equal(f, coordinate_pattern((0, 4, 0, 4), 1, "uint16") / np.float32(65535))
    with pytest.raises(ValueError, match="int8"):
        coordinate_pattern((0, 1, 0, 1), 1, "int8")


def test_white_latent_is_seeded_randn():
    z = white_latent((2, 4, 5, 7), seed=3)
    assert torch.equal(z, torch.randn((2, 4, 5, 7), generator=torch.Generator().manual_seed(3)))
    assert not torch.equal(z, white_latent((2, 4, 5, 7), seed=4))


@pytest.mark.parametrize("shape", [(1, 4, 16, 24), (2, 3, 1, 9), (1, 1, 7, 1), (4, 5)])
def test_structured_latent_definition(shape):
    z = structured_latent(shape, seed=11)
    g = torch.Generator().manual_seed(11)
    noise = torch.randn(shape, generator=g)
    coarse = torch.randn((*shape[:-2], 4, 4), generator=g)
    up = F.interpolate(coarse.reshape(-1, 1, 4, 4), size=shape[-2:], mode="bilinear", align_corners=False)
    ramp = torch.linspace(-2, 2, shape[-1])
    torch.testing.assert_close(z, 0.5 * noise + 2 * up.reshape(shape) + ramp, rtol=0, atol=0)
    assert torch.equal(z, structured_latent(shape, seed=11))


def test_structured_latent_tile_means_differ():
    z = structured_latent((1, 4, 64, 64), seed=0)
    left, right = z[..., :16].mean(), z[..., -16:].mean()
    # the ramp alone puts 2 * (1.5 - 1/63 * ...) ~ 3 between the outer quarters; the coarse grid shifts it
    assert right - left > 1.5
    assert z.std() > 1.0


def test_awkward_sizes_cover_the_seed_cases():
    tile = 16
    sizes = awkward_sizes(tile)
    assert len(sizes) == len(set(sizes))
    assert (1, 1) in sizes and (1, 8 * tile + 1) in sizes and (8 * tile + 1, 1) in sizes
    assert any(h < tile and w < tile for h, w in sizes)
    assert any(_is_prime(h) and _is_prime(w) and h > tile and w > tile for h, w in sizes)
    assert any(h % 2 and w % 2 and h % tile and w % tile for h, w in sizes if h > 1 and w > 1)
    assert any(max(h, w) / min(h, w) > 50 for h, w in sizes)
    for h, w in awkward_sizes(8, 4096):
        grid = TileGrid(h, w, 8)  # builds (and asserts the partition) for every size
        assert sum((t.core[1] - t.core[0]) * (t.core[3] - t.core[2]) for t in grid) == h * w
    with pytest.raises(ValueError, match="tile"):
        awkward_sizes(1)
    with pytest.raises(ValueError, match="long"):
        awkward_sizes(16, 10)


@pytest.mark.parametrize("call", [lambda: checkerboard(0, 5), lambda: boundary_lines(3, 2.5),
                                  lambda: white_latent((3,), 0), lambda: white_latent((2, 2), 1.5)])
def test_patterns_reject_bad_input(call):
    with pytest.raises(ValueError):
        call()
