"""Error metrics for tiled outputs: max/mean abs error, PSNR, seam score, tone drift, error heatmaps.

Inputs are torch tensors or numpy arrays shaped (H, W), (C, H, W) or (N, C, H, W); they are compared in
float64 on the CPU. ``grid_or_boxes`` is a :class:`tilewise.geometry.TileGrid` (its tiles' cores), an
iterable of tiles, or of ``(y0, y1, x0, x1)`` core boxes.

- **seam score**: the mean squared difference between neighbouring pixels that lie on opposite sides of
  a tile-core boundary, divided by the same mean over all other neighbouring pairs (horizontal and
  vertical pairs, summed over channels, averaged over the batch). About 1 when tiling left no trace;
  well above 1 when the boundaries show. NaN when the tiling has no interior boundary.
- **tone drift**: per tile, the mean of (result - reference) over its core, per channel; a tile-wise
  colour or brightness shift such as statistics estimated per tile produce.

matplotlib (~0.3-0.5 s) is imported inside the functions that draw, so that `import tilewise.metrics` needs
numpy only.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .atomic import atomic_path
from .geometry import Box
from .patterns import core_boxes

logger = logging.getLogger(__name__)


def as_nchw(x: Any, name: str = "image") -> np.ndarray:
    """float64 numpy (N, C, H, W) view of a tensor or array shaped (H, W), (C, H, W) or (N, C, H, W)."""
    if hasattr(x, "detach"):  # torch tensor, without importing torch here
        x = x.detach().cpu().double().numpy()
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 2:
        return x[None, None]
    if x.ndim == 3:
        return x[None]
    if x.ndim == 4:
        return x
    raise ValueError(f"{name} must be shaped (H, W), (C, H, W) or (N, C, H, W), got shape {x.shape}")


def _pair(result: Any, reference: Any) -> tuple[np.ndarray, np.ndarray]:
    r, f = as_nchw(result, "result"), as_nchw(reference, "reference")
    if r.shape != f.shape:
        raise ValueError(f"result and reference shapes differ: {r.shape} vs {f.shape} (as N, C, H, W)")
    return r, f


def _data_range(reference: np.ndarray, data_range: float | None) -> float:
    if data_range is None:
        data_range = float(reference.max() - reference.min())
        if data_range == 0:
            raise ValueError("reference is constant, so its value range is 0: pass data_range explicitly "
                             "(e.g. 2.0 for images in [-1, 1], 255 for uint8)")
    if not data_range > 0:
        raise ValueError(f"data_range must be > 0, got {data_range!r}")
    return float(data_range)


def psnr(result: Any, reference: Any, data_range: float | None = None) -> float:
    """Peak signal-to-noise ratio 10 log10(R^2 / MSE) in dB; R = data_range (default: reference max - min)."""
    r, f = _pair(result, reference)
    return _psnr(r, f, _data_range(f, data_range))


def _psnr(r: np.ndarray, f: np.ndarray, data_range: float) -> float:
    mse = float(np.mean((r - f) ** 2))
    return math.inf if mse == 0 else 10.0 * math.log10(data_range**2 / mse)


def boundary_masks(height: int, width: int, boxes: list[Box]) -> tuple[np.ndarray, np.ndarray]:
    """Masks over horizontal pairs (H, W-1) and vertical pairs (H-1, W) that straddle a core boundary."""
    mx = np.zeros((height, max(width - 1, 0)), bool)
    my = np.zeros((max(height - 1, 0), width), bool)
    for y0, y1, x0, x1 in boxes:
        if not (0 <= y0 < y1 <= height and 0 <= x0 < x1 <= width):
            raise ValueError(f"core box {(y0, y1, x0, x1)} is outside the {height}x{width} image")
        if x0 > 0:
            mx[y0:y1, x0 - 1] = True  # pair (x0 - 1, x0): left neighbour in another core
        if y0 > 0:
            my[y0 - 1, x0:x1] = True
    return mx, my


def _gradient_energy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Squared neighbour differences summed over channels, averaged over the batch: (H, W-1), (H-1, W)."""
    ex = (np.diff(x, axis=3) ** 2).sum(axis=1).mean(axis=0)
    ey = (np.diff(x, axis=2) ** 2).sum(axis=1).mean(axis=0)
    return ex, ey


def seam_score(image: Any, grid_or_boxes: Any) -> float:
    """Mean gradient energy across tile-core boundaries / mean elsewhere (~1: no seam; NaN: no boundary)."""
    x = as_nchw(image)
    mx, my = boundary_masks(x.shape[2], x.shape[3], core_boxes(grid_or_boxes))
    ex, ey = _gradient_energy(x)
    on = np.concatenate([ex[mx], ey[my]])
    off = np.concatenate([ex[~mx], ey[~my]])
    if on.size == 0 or off.size == 0:
        return math.nan
    num, den = float(on.mean()), float(off.mean())
    if den == 0:
        return 1.0 if num == 0 else math.inf
    return num / den


@dataclass(frozen=True)
class ToneDrift:
    """Per-tile mean offset (result - reference) over each core: ``per_tile`` is (tiles, C)."""

    max_abs: float
    per_tile: np.ndarray


def tone_drift(result: Any, reference: Any, grid_or_boxes: Any) -> ToneDrift:
    """Per-tile, per-channel mean of (result - reference) over each tile core, and its largest magnitude."""
    r, f = _pair(result, reference)
    boxes = core_boxes(grid_or_boxes)
    d = r - f
    per_tile = np.stack([d[:, :, y0:y1, x0:x1].mean(axis=(0, 2, 3)) for y0, y1, x0, x1 in boxes])
    return ToneDrift(float(np.abs(per_tile).max()), per_tile)


@dataclass(frozen=True)
class Comparison:
    """Errors of a result against its reference; seam/tone fields are None when no tiling was given."""

    max_abs: float
    mean_abs: float
    psnr: float
    data_range: float
    seam_score: float | None = None
    seam_score_reference: float | None = None
    tone_drift: float | None = None
    tone_drift_per_tile: np.ndarray | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """Plain-number dict (per-tile drift as a nested list) for JSON reports."""
        out = asdict(self)
        if self.tone_drift_per_tile is not None:
            out["tone_drift_per_tile"] = self.tone_drift_per_tile.tolist()
        return out


def compare(result: Any, reference: Any, tiles: Any = None, data_range: float | None = None) -> Comparison:
    """max |e|, mean |e|, PSNR; with ``tiles`` also the seam score (of both) and the per-tile tone drift."""
    r, f = _pair(result, reference)
    R = _data_range(f, data_range)
    err = np.abs(r - f)
    out = dict(max_abs=float(err.max()), mean_abs=float(err.mean()), psnr=_psnr(r, f, R), data_range=R)
    if tiles is not None:
        drift = tone_drift(r, f, tiles)
        out.update(seam_score=seam_score(r, tiles), seam_score_reference=seam_score(f, tiles),
                   tone_drift=drift.max_abs, tone_drift_per_tile=drift.per_tile)
    return Comparison(**out)


def error_heatmap(result: Any, reference: Any) -> np.ndarray:
    """(H, W) float64 map of |result - reference|, the maximum over batch and channels."""
    r, f = _pair(result, reference)
    return np.abs(r - f).max(axis=(0, 1))


def save_heatmap_png(heatmap: Any, path: str | os.PathLike, *, grid_or_boxes: Any = None,
                     title: str | None = None, vmax: float | None = None, cmap: str = "magma",
                     dpi: int = 100) -> str:
    """Render an (H, W) error map with a colorbar (and core boundaries if given) to a PNG, atomically."""
    from matplotlib.figure import Figure  # the object API: no pyplot state, no backend switch

    hm = np.asarray(heatmap, dtype=np.float64)
    if hm.ndim != 2:
        raise ValueError(f"heatmap must be (H, W), got shape {hm.shape}; see error_heatmap()")
    h, w = hm.shape
    fig = Figure(figsize=(min(12, 2 + 8 * w / max(h, w)), min(12, 1 + 8 * h / max(h, w))))
    ax = fig.add_subplot()
    im = ax.imshow(hm, cmap=cmap, vmin=0, vmax=vmax, interpolation="nearest")
    fig.colorbar(im, ax=ax, label="|result - reference|")
    if grid_or_boxes is not None:
        _draw_boundaries(ax, core_boxes(grid_or_boxes))
    ax.set_title(title or f"max {hm.max():.3g}, mean {hm.mean():.3g}")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi, bbox_inches="tight")
    return os.fspath(path)


def _draw_boundaries(ax: Any, boxes: list[Box]) -> None:
    """Core boundary segments as thin cyan lines on pixel edges (pixel centres are integers)."""
    from matplotlib.collections import LineCollection

    segments = [[(x0 - 0.5, y0 - 0.5), (x0 - 0.5, y1 - 0.5)] for y0, y1, x0, x1 in boxes if x0 > 0]
    segments += [[(x0 - 0.5, y0 - 0.5), (x1 - 0.5, y0 - 0.5)] for y0, y1, x0, x1 in boxes if y0 > 0]
    ax.add_collection(LineCollection(segments, colors="cyan", linewidths=0.5))
