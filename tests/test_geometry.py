"""TileGrid: cores partition the image, windows cover it with the requested overlap, reads hold the halo."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tilewise.geometry import TileGrid, axis_windows, box_slices, scale_box


def _check_grid(g: TileGrid) -> None:
    H, W = g.shape
    owner = np.zeros((H, W), dtype=np.int64)
    cover = np.zeros((H, W), dtype=np.int64)
    for t in g:
        owner[box_slices(t.core)] += 1
        y0, y1, x0, x1 = t.window
        cover[max(y0, 0) : min(y1, H), max(x0, 0) : min(x1, W)] += 1
        # read = window grown by halo (clipped under edge="shift")
        hy, hx = g.halo
        want = (y0 - hy, y1 + hy, x0 - hx, x1 + hx)
        if g.edge == "shift":
            want = (max(want[0], 0), min(want[1], H), max(want[2], 0), min(want[3], W))
            assert t.pad == (0, 0, 0, 0)
            assert t.window[1] - t.window[0] <= g.tile_size[0] and t.window[3] - t.window[2] <= g.tile_size[1]
            assert 0 <= y0 and y1 <= H and 0 <= x0 and x1 <= W
        else:
            assert t.pad == (max(0, -want[0]), max(0, want[1] - H), max(0, -want[2]), max(0, want[3] - W))
        assert t.read == want
        # crop takes the core out of an array laid over the read box
        cy0, cy1, cx0, cx1 = t.crop
        assert (cy0 + t.read[0], cy1 + t.read[0], cx0 + t.read[2], cx1 + t.read[2]) == t.core
        # core origins on the alignment grid (the image end may be unaligned)
        assert t.core[0] % g.align[0] == 0 and t.core[2] % g.align[1] == 0
        assert t.window[0] % g.align[0] == 0 and t.window[2] % g.align[1] == 0
    assert (owner == 1).all(), "cores must partition the image"
    assert (cover >= 1).all(), "windows must cover the image"
    assert sorted(t.index for t in g) == list(range(len(g)))
    assert sorted((t.row, t.col) for t in g) == [(r, c) for r in range(g.rows) for c in range(g.cols)]


def _check_overlap(g: TileGrid) -> None:
    rows = sorted({(t.row, t.window[0], t.window[1]) for t in g})
    cols = sorted({(t.col, t.window[2], t.window[3]) for t in g})
    for spans, o in ((rows, g.overlap[0]), (cols, g.overlap[1])):
        for (_, _, e0), (_, s1, _) in zip(spans, spans[1:]):
            assert e0 - s1 >= o, f"neighbours overlap by {e0 - s1} < {o}"


sizes = st.integers(1, 300)


@st.composite
def grids(draw):
    align = draw(st.sampled_from([1, 2, 4, 8]))
    th, tw = (align * draw(st.integers(1, 12)) for _ in range(2))
    oy, ox = align * draw(st.integers(0, th // align - 1)), align * draw(st.integers(0, tw // align - 1))
    return dict(
        height=draw(sizes),
        width=draw(sizes),
        tile_size=(th, tw),
        overlap=(oy, ox),
        halo=draw(st.integers(0, 9)),
        align=align,
        edge=draw(st.sampled_from(["shift", "pad"])),
        order=draw(st.sampled_from(["row", "serpentine", "chess"])),
    )


@settings(max_examples=300, deadline=None)
@given(grids())
def test_grid_properties(kw):
    g = TileGrid(**kw)
    _check_grid(g)
    _check_overlap(g)


@pytest.mark.parametrize(
    "h,w,tile",
    [(1, 4096, 64), (4096, 1, 64), (1, 1, 8), (7, 5, 64), (97, 131, 16), (127, 61, 32), (64, 64, 64)],
)
def test_awkward_sizes(h, w, tile):
    for edge in ("shift", "pad"):
        g = TileGrid(h, w, tile, overlap=tile // 4, halo=3, edge=edge)
        _check_grid(g)
        _check_overlap(g)


def test_smaller_than_one_tile_is_one_tile():
    g = TileGrid(10, 20, 64)
    assert len(g) == 1
    t = g[0]
    assert t.window == t.core == t.read == (0, 10, 0, 20)
    gp = TileGrid(10, 20, 64, edge="pad")
    assert gp[0].window == (0, 64, 0, 64) and gp[0].core == (0, 10, 0, 20) and gp[0].pad == (0, 54, 0, 44)


def test_last_columns_are_covered_on_a_non_stride_width():
    # the panorama bug: W=125 latent columns, window 64, stride 8 -> (125-64)//8+1 views end at column 120
    g = TileGrid(64, 125, 64, overlap=56)
    covered = np.zeros(125, dtype=bool)
    for t in g:
        covered[t.window[2] : t.window[3]] = True
    assert covered.all() and max(t.window[3] for t in g) == 125


def test_orders():
    rows = [(t.row, t.col) for t in TileGrid(30, 40, 10, order="row")]
    assert rows == [(r, c) for r in range(3) for c in range(4)]
    snake = [(t.row, t.col) for t in TileGrid(30, 40, 10, order="serpentine")]
    assert snake[:8] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 3), (1, 2), (1, 1), (1, 0)]
    # serpentine: consecutive tiles are always neighbours (less staging traffic)
    assert all(abs(a[0] - b[0]) + abs(a[1] - b[1]) == 1 for a, b in zip(snake, snake[1:]))
    chess = [(t.row, t.col) for t in TileGrid(30, 40, 10, order="chess")]
    first = chess[: len(chess) // 2]
    assert all((r + c) % 2 == 0 for r, c in first) and all((r + c) % 2 == 1 for r, c in chess[6:])


def test_axis_windows_exact_values():
    assert axis_windows(100, 32, 8, 8, "shift") == [(0, 32), (24, 56), (48, 80), (72, 100)]
    assert axis_windows(100, 32, 8, 8, "pad") == [(0, 32), (24, 56), (48, 80), (72, 104)]
    assert axis_windows(20, 32, 8, 8, "shift") == [(0, 20)]


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(height=0, width=10, tile_size=8), "height and width must be positive"),
        (dict(height=10, width=-3, tile_size=8), "width=-3"),
        (dict(height=10, width=10, tile_size=0), "tile_size must be positive"),
        (dict(height=10, width=10, tile_size=8, overlap=8), "overlap 8 must be smaller than the tile 8"),
        (dict(height=10, width=10, tile_size=8, overlap=-1), "overlap must be >= 0"),
        (dict(height=10, width=10, tile_size=30, align=8), "not a multiple of align 8; use 24 or 32"),
        (dict(height=10, width=10, tile_size=32, overlap=5, align=8), "overlap 5 .* use 8"),
        (dict(height=10, width=10, tile_size=8, halo=-2), "halo must be >= 0"),
        (dict(height=10, width=10, tile_size=8, order="zigzag"), "order must be one of"),
        (dict(height=10, width=10, tile_size=8, edge="wrap"), "edge must be one of"),
        (dict(height=10, width=10, tile_size=8, pad_mode="mirror"), "pad_mode must be one of"),
        (dict(height=10, width=10, tile_size=(8, 8, 8)), "tile_size must be an int or an"),
    ],
)
def test_bad_requests_name_the_values(kw, match):
    with pytest.raises(ValueError, match=match):
        TileGrid(**kw)


def test_scale_box():
    assert scale_box((1, 3, 2, 5), 8) == (8, 24, 16, 40)
    assert scale_box((8, 24, 16, 40), 1 / 8) == (1, 3, 2, 5)
    with pytest.raises(ValueError, match="not on the integer grid"):
        scale_box((1, 3, 2, 5), 0.5)


def test_overhead_counts_halo_reads():
    g = TileGrid(64, 64, 32, halo=2)
    # 4 tiles, each read 34x34 (clipped on the image edge side)
    assert g.read_area() == 4 * 34 * 34
    assert g.overhead() == pytest.approx(4 * 34 * 34 / 4096 - 1)


def test_draw_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    g = TileGrid(40, 90, 16, overlap=4, halo=2, order="serpentine")
    out = tmp_path / "grid.png"
    g.draw(str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
