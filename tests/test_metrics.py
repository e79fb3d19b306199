"""Metrics against closed forms: constant errors, synthetic seams, known per-tile offsets."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from PIL import Image

from tilewise.geometry import TileGrid
from tilewise.metrics import (
    as_nchw,
    boundary_masks,
    compare,
    error_heatmap,
    psnr,
    save_heatmap_png,
    seam_score,
    tone_drift,
)


@pytest.mark.parametrize("e, R", [(0.1, 2.0), (3.0, 255.0), (1e-4, 1.0)])
def test_psnr_of_constant_error(e, R):
    ref = torch.linspace(-1, 1, 3 * 8 * 9, dtype=torch.float64).reshape(1, 3, 8, 9)
    assert psnr(ref + e, ref, data_range=R) == pytest.approx(10 * math.log10(R**2 / e**2), rel=1e-9)
    assert psnr(ref - e, ref, data_range=R) == pytest.approx(20 * math.log10(R / e), rel=1e-9)


def test_psnr_identical_is_inf_and_default_range():
    ref = np.arange(12.0).reshape(3, 4)
    assert psnr(ref, ref) == math.inf
    # default range: reference max - min = 11; MSE of a +-1 alternating error is 1
    err = np.where(np.indices((3, 4)).sum(0) % 2, 1.0, -1.0)
    assert psnr(ref + err, ref) == pytest.approx(20 * math.log10(11.0), rel=1e-12)
    with pytest.raises(ValueError, match="data_range"):
        psnr(np.ones((2, 2)), np.ones((2, 2)))
    with pytest.raises(ValueError, match="-1"):
        psnr(ref, ref, data_range=-1)


def test_compare_closed_form_errors():
    ref = np.zeros((2, 3, 4, 5))
    res = ref.copy()
    res[1, 2, 3, 4] = 0.5
    res[0, 0, 0, 0] = -0.25
    c = compare(res, ref, data_range=1.0)
    assert c.max_abs == 0.5
    assert c.mean_abs == pytest.approx(0.75 / ref.size, rel=1e-12)
    assert c.psnr == pytest.approx(10 * math.log10(1.0 / ((0.25 + 0.0625) / ref.size)), rel=1e-12)
    assert c.seam_score is None and c.tone_drift is None
    with pytest.raises(ValueError, match=r"\(2, 3, 4, 5\) vs \(1, 3, 4, 5\)"):
        compare(res, ref[:1])


@pytest.mark.parametrize("layout", ["hw", "chw", "nchw"])
def test_layouts_and_types_agree(layout):
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1, 1, 12, 14, generator=g)
    res = ref + 0.1 * torch.randn(1, 1, 12, 14, generator=g)
    squeeze = {"hw": lambda t: t[0, 0], "chw": lambda t: t[0], "nchw": lambda t: t}[layout]
    boxes = [(0, 6, 0, 7), (0, 6, 7, 14), (6, 12, 0, 14)]
    a = compare(squeeze(res), squeeze(ref), boxes, data_range=2.0)
    b = compare(squeeze(res).numpy(), squeeze(ref).numpy(), boxes, data_range=2.0)
    full = compare(res, ref, boxes, data_range=2.0)
    for c in (a, b):
        for k in ("max_abs", "mean_abs", "psnr", "seam_score", "tone_drift"):
            assert getattr(c, k) == pytest.approx(getattr(full, k), rel=1e-12, abs=1e-15)
    with pytest.raises(ValueError, match="shape"):
        as_nchw(np.zeros(5))


def test_boundary_masks():
    mx, my = boundary_masks(4, 5, [(0, 2, 0, 3), (0, 2, 3, 5), (2, 4, 0, 5)])
    assert mx.shape == (4, 4) and my.shape == (3, 5)
    assert np.argwhere(mx).tolist() == [[0, 2], [1, 2]]
    assert np.argwhere(my).tolist() == [[1, c] for c in range(5)]
    with pytest.raises(ValueError, match="outside"):
        boundary_masks(4, 5, [(0, 5, 0, 5)])


def test_seam_score_of_a_step_on_a_ramp_closed_form():
    """Ramp of slope a along x plus a step s at the core boundary x = b (two tiles side by side)."""
    h, w, b, a, s = 10, 16, 7, 0.5, 2.0
    x = np.arange(w, dtype=np.float64)
    img = np.tile(a * x + s * (x >= b), (h, 1))
    boxes = [(0, h, 0, b), (0, h, b, w)]
    # seam pairs: h horizontal pairs across x = b, each (a + s)^2; no vertical boundary
    # elsewhere: h (w - 2) horizontal pairs of a^2 and (h - 1) w vertical pairs of 0
    elsewhere = a**2 * h * (w - 2) / (h * (w - 2) + (h - 1) * w)
    assert seam_score(img, boxes) == pytest.approx((a + s) ** 2 / elsewhere, rel=1e-12)
    assert seam_score(np.tile(a * x, (h, 1)), boxes) == pytest.approx(
        a**2 / elsewhere, rel=1e-12)  # same ramp, no step: the seam pairs only miss the zero dy pairs


def test_seam_score_noise_is_about_one_and_seam_raises_it():
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(3, 128, 128, generator=g)
    grid = TileGrid(128, 128, 32)
    assert 0.85 < seam_score(noise, grid) < 1.15
    shifted = noise.clone()
    for t in grid:  # offset every tile by its own constant: a visible seam at every core boundary
        y0, y1, x0, x1 = t.core
        shifted[:, y0:y1, x0:x1] += 0.5 * ((t.row + t.col) % 2)
    # across a boundary the pair difference gains +-0.5 per channel: E = 2 + 3 * 0.25 vs 2 per channel
    assert seam_score(shifted, grid) == pytest.approx((2 * 3 + 3 * 0.25) / (2 * 3), rel=0.08)


def test_seam_score_degenerate_cases():
    assert math.isnan(seam_score(np.random.rand(5, 5), [(0, 5, 0, 5)]))  # one tile: no boundary
    assert seam_score(np.ones((4, 4)), [(0, 4, 0, 2), (0, 4, 2, 4)]) == 1.0
    step = np.ones((4, 4))
    step[:, 2:] = 2
    assert seam_score(step, [(0, 4, 0, 2), (0, 4, 2, 4)]) == math.inf


def test_tone_drift_recovers_known_offsets():
    grid = TileGrid(30, 41, (10, 16))
    ref = torch.randn(2, 3, 30, 41, generator=torch.Generator().manual_seed(2))
    res = ref.clone()
    offsets = np.zeros((len(grid), 3))
    rng = np.random.default_rng(0)
    for i, t in enumerate(grid):
        y0, y1, x0, x1 = t.core
        offsets[i] = rng.normal(size=3)
        res[:, :, y0:y1, x0:x1] += torch.tensor(offsets[i], dtype=torch.float32)[:, None, None]
    drift = tone_drift(res, ref, grid)
    assert drift.per_tile.shape == (len(grid), 3)
    np.testing.assert_allclose(drift.per_tile, offsets, atol=1e-6)
    assert drift.max_abs == pytest.approx(np.abs(offsets).max(), abs=1e-6)
    c = compare(res, ref, grid, data_range=2.0)
    assert c.tone_drift == drift.max_abs and c.seam_score > c.seam_score_reference
    assert np.array_equal(c.as_dict()["tone_drift_per_tile"], drift.per_tile.tolist())


def test_error_heatmap_is_max_over_batch_and_channels():
    ref = np.zeros((2, 3, 4, 5))
    res = ref.copy()
    res[0, 1, 2, 3] = -0.7
    res[1, 2, 2, 3] = 0.4
    res[1, 0, 0, 0] = 0.2
    expected = np.zeros((4, 5))
    expected[2, 3], expected[0, 0] = 0.7, 0.2
    assert np.array_equal(error_heatmap(res, ref), expected)


def test_save_heatmap_png(tmp_path):
    hm = np.outer(np.arange(20.0), np.ones(30))
    path = save_heatmap_png(hm, tmp_path / "heat.png", grid_or_boxes=TileGrid(20, 30, 10), title="test")
    assert os.listdir(tmp_path) == ["heat.png"]
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 100 and im.size[1] > 50
    with pytest.raises(ValueError, match=r"\(2, 3, 4\)"):
        save_heatmap_png(np.zeros((2, 3, 4)), tmp_path / "bad.png")
    assert os.listdir(tmp_path) == ["heat.png"]


def test_import_metrics_and_patterns_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, tilewise.metrics, tilewise.patterns; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
