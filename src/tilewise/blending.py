"""Blending: weight windows and an accumulator that fuses weighted tiles into preallocated buffers.

Windows are strictly positive, so any tiling that covers the image normalises without holes; a constant
image blended from any tiling stays constant. The accumulator never keeps tiles: it adds each one into a
value buffer and a weight buffer and divides once at the end.
"""

from __future__ import annotations

import math

import torch

from .geometry import Box, box_slices

WINDOWS = ("uniform", "gaussian", "cosine", "linear")


def _axis(n: int, kind: str, var: float, ramp: int | None) -> torch.Tensor:
    t = torch.arange(n, dtype=torch.float64)
    if kind == "uniform":
        return torch.ones(n, dtype=torch.float64)
    if kind == "gaussian":
        # Mixture of Diffusers (Jiménez 2023) tile weight, centred symmetrically at (n - 1) / 2
        return torch.exp(-(((t - (n - 1) / 2) / n) ** 2) / (2 * var))
    if kind == "cosine":
        # Hann window sampled at pixel centres: positive at both ends
        return 0.5 - 0.5 * torch.cos(2 * math.pi * (t + 0.5) / n)
    # linear feather: rises 1/ramp per pixel from each edge, flat 1 inside
    r = ramp if ramp is not None else max(1, n // 4)
    return torch.minimum(torch.ones_like(t), torch.minimum(t + 1, n - t) / r)


def weight_window(
    kind: str,
    size: int | tuple[int, int],
    *,
    var: float = 0.01,
    ramp: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """An (h, w) separable blending window: uniform (MultiDiffusion), gaussian, cosine or linear feather.

    `var` is the Gaussian variance in units of the tile side (Mixture of Diffusers uses 0.01); `ramp` is the
    feather width in pixels of the linear window (default a quarter of the side).
    """
    if kind not in WINDOWS:
        raise ValueError(f"window kind must be one of {WINDOWS}, got {kind!r}")
    h, w = (size, size) if isinstance(size, int) else size
    if h <= 0 or w <= 0:
        raise ValueError(f"window size must be positive, got {(h, w)}")
    if var <= 0:
        raise ValueError(f"gaussian variance must be > 0, got var={var}")
    if ramp is not None and ramp <= 0:
        raise ValueError(f"linear feather ramp must be a positive number of pixels, got ramp={ramp}")
    dtype = dtype or torch.float32
    win = torch.outer(_axis(h, kind, var, ramp), _axis(w, kind, var, ramp))
    return win.to(device=device, dtype=dtype)


class Accumulator:
    """Weighted tile sum in preallocated value and weight buffers, normalised once (MultiDiffusion eq. 5)."""

    def __init__(
        self,
        shape: tuple[int, ...],
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        weight_shape: tuple[int, ...] | None = None,
    ) -> None:
        if len(shape) < 2 or any(s <= 0 for s in shape):
            raise ValueError(f"accumulator shape must be (..., H, W) with positive sides, got {tuple(shape)}")
        self.shape = tuple(shape)
        weight_shape = tuple(weight_shape) if weight_shape is not None else self.shape[-2:]
        if weight_shape[-2:] != self.shape[-2:]:
            raise ValueError(f"weight_shape {weight_shape} must end with the image size {self.shape[-2:]}")
        self.value = torch.zeros(self.shape, device=device, dtype=dtype)
        self.weight = torch.zeros(weight_shape, device=device, dtype=dtype)
        self._done = False

    def add(self, values: torch.Tensor, box: Box, weight: torch.Tensor | None = None) -> None:
        """Add `values` (..., h, w) with `weight` (broadcastable to values) into the box (y0, y1, x0, x1);
        a box of 2k coordinates ((t0, t1, y0, y1, x0, x1)) adds over the last k axes."""
        if self._done:
            raise RuntimeError("Accumulator.result() was already taken; create a new accumulator")
        k = len(box) // 2
        sides = self.shape[-k:]
        if not all(0 <= box[2 * i] < box[2 * i + 1] <= n for i, n in enumerate(sides)):
            raise ValueError(f"box {box} is empty or outside the {'x'.join(map(str, sides))} accumulator")
        if tuple(values.shape[-k:]) != tuple(box[2 * i + 1] - box[2 * i] for i in range(k)):
            raise ValueError(f"values of spatial size {tuple(values.shape[-k:])} do not fit box {box}")
        sl = (..., *box_slices(box))
        if weight is None:
            self.value[sl] += values.to(self.value.dtype)
            self.weight[sl] += 1
            return
        weight = weight.to(device=self.value.device, dtype=self.value.dtype)
        self.value[sl] += values.to(self.value.dtype) * weight
        self.weight[sl] += weight

    def uncovered(self) -> torch.Tensor:
        """Boolean mask of pixels with zero total weight (over the weight buffer's shape)."""
        return self.weight <= 0

    def result(self) -> torch.Tensor:
        """value / weight, in place; raises ValueError if any pixel has zero total weight."""
        if not self._done:
            holes = self.uncovered()
            if bool(holes.any()):
                idx = holes.nonzero()[0].tolist()
                raise ValueError(
                    f"{int(holes.sum())} output pixels have zero total weight (first at index {idx}); "
                    "every output pixel needs a tile with positive weight"
                )
            self.value.div_(self.weight)
            self._done = True
        return self.value
