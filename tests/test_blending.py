"""Weight windows and the accumulator: constants stay constant, overlapping tiles reassemble the image."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tilewise.blending import Accumulator, weight_window
from tilewise.geometry import TileGrid, box_slices

KINDS = ["uniform", "gaussian", "cosine", "linear"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [(1, 1), (1, 7), (8, 8), (9, 14)])
def test_windows_are_positive_and_symmetric(kind, size):
    w = weight_window(kind, size, dtype=torch.float64)
    assert w.shape == size and (w > 0).all()
    assert torch.allclose(w, w.flip(0)) and torch.allclose(w, w.flip(1))


def test_gaussian_centre_is_symmetric_in_both_axes():
    # the copied-between-projects bug centres y at H/2; ours is ((h-1)/2, (w-1)/2) on both axes
    w = weight_window("gaussian", (8, 6), var=0.01, dtype=torch.float64)
    assert torch.equal(w[3], w[4]) and torch.equal(w[:, 2], w[:, 3])
    assert w.argmax().item() in {3 * 6 + 2, 3 * 6 + 3, 4 * 6 + 2, 4 * 6 + 3}
    # closed form at a corner: exp(-((0 - 3.5)/8)^2 / 0.02) * exp(-((0 - 2.5)/6)^2 / 0.02)
    corner = torch.exp(torch.tensor(-((3.5 / 8) ** 2) / 0.02 - (2.5 / 6) ** 2 / 0.02, dtype=torch.float64))
    assert w[0, 0].item() == pytest.approx(corner.item(), rel=1e-12)


def test_linear_feather_closed_form():
    w = weight_window("linear", (8, 8), ramp=3, dtype=torch.float64)[4]
    assert w.tolist() == pytest.approx([1 / 3, 2 / 3, 1, 1, 1, 1, 2 / 3, 1 / 3])


@settings(max_examples=60, deadline=None)
@given(
    h=st.integers(1, 70),
    w=st.integers(1, 70),
    tile=st.integers(2, 24),
    frac=st.floats(0, 0.9),
    kind=st.sampled_from(KINDS),
    edge=st.sampled_from(["shift", "pad"]),
)
@example(h=50, w=48, tile=22, frac=0.875, kind="linear", edge="shift")
def test_constant_and_image_recovered_from_any_tiling(h, w, tile, frac, kind, edge):
    overlap = min(int(tile * frac), tile - 1)
    g = TileGrid(h, w, tile, overlap=overlap, edge=edge)
    image = torch.rand(2, h, w, generator=torch.Generator().manual_seed(h * 1000 + w))
    const = Accumulator((2, h, w))
    back = Accumulator((2, h, w))
    for t in g:
        y0, y1, x0, x1 = t.window
        box = (y0, min(y1, h), x0, min(x1, w))
        win = weight_window(kind, (y1 - y0, x1 - x0))[: box[1] - y0, : box[3] - x0]
        const.add(torch.full((2, box[1] - y0, box[3] - x0), 0.7), box, win)
        back.add(image[(..., *box_slices(box))], box, win)
    # float32 sums of up to ~(1 / (1 - frac))^2 = 64 weighted windows per pixel: a few ulps each
    # (h=50, w=48, tile=22, frac=0.875, linear, shift measured 1.01e-6 on [0, 1) values)
    assert (const.result() - 0.7).abs().max().item() <= 4e-6
    assert (back.result() - image).abs().max().item() <= 4e-6


def test_zero_weight_pixels_are_reported():
    acc = Accumulator((1, 4, 4))
    acc.add(torch.ones(1, 4, 2), (0, 4, 0, 2))
    with pytest.raises(ValueError, match="8 output pixels have zero total weight"):
        acc.result()


def test_accumulator_rejects_mismatched_boxes():
    acc = Accumulator((3, 4, 4))
    with pytest.raises(ValueError, match="do not fit box"):
        acc.add(torch.ones(3, 2, 2), (0, 3, 0, 2))
    with pytest.raises(ValueError, match="outside the 4x4"):
        acc.add(torch.ones(3, 2, 2), (3, 5, 0, 2))
    with pytest.raises(ValueError, match="must be one of"):
        weight_window("hann", 4)


def test_accumulator_does_not_modify_inputs():
    acc = Accumulator((1, 2, 2))
    v = torch.ones(1, 2, 2)
    wt = torch.full((2, 2), 2.0)
    acc.add(v, (0, 2, 0, 2), wt)
    assert torch.equal(v, torch.ones(1, 2, 2)) and torch.equal(wt, torch.full((2, 2), 2.0))
    assert torch.equal(acc.result(), torch.ones(1, 2, 2))
