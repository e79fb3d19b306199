"""What a video run holds besides its tiles' values: the staged values of every step (`Store`), the
executor's step context with each GroupNorm's merged statistics (`VideoContext`), and byte counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...locality.ops3d import StepContext
from ..settings import Place


def nbytes(t) -> int:
    """Bytes of a tensor's elements."""
    return t.numel() * t.element_size()


def cache_bytes(caches: dict) -> int:
    """Bytes of one tile's caches (id(op) -> (box, frames))."""
    return sum(nbytes(f) for _, f in caches.values())


class Store:
    """Staged values of the run: (value, step) -> full-size tensor, on the device or the host."""

    def __init__(self, where: Place, device, zeroed: bool = False):
        self.device = device
        self.home = device if where is Place.DEVICE else torch.device("cpu")
        self.values: dict[tuple[str, int], Any] = {}
        self.alive = self.peak = 0
        self.zeroed = zeroed  # (a rank writes its tiles' cores; the ranks' values are then summed)

    def make(self, key, shape, dtype) -> Any:
        """The tensor of `key`, allocated on first use (zeros where ranks sum their parts)."""
        if key not in self.values:
            new = torch.zeros if self.zeroed else torch.empty
            self.values[key] = new(shape, dtype=dtype, device=self.home)
            self.alive += nbytes(self.values[key])
            self.peak = max(self.peak, self.alive)
        return self.values[key]

    def write(self, key, shape, dtype, box, block) -> None:
        self.make(key, shape, dtype)[..., box[0] : box[1], box[2] : box[3]].copy_(block)

    def read(self, key, box):
        t = self.values[key][..., box[0] : box[1], box[2] : box[3]]
        return t.to(self.device, non_blocking=True)

    def free(self, value: str) -> None:
        for key in [k for k in self.values if k[0] == value]:
            self.alive -= nbytes(self.values.pop(key))

    def drop(self, value: str, step: int) -> None:
        """Free one step's tensor of a value (if it was staged)."""
        t = self.values.pop((value, step), None)
        if t is not None:
            self.alive -= nbytes(t)


@dataclass
class VideoContext(StepContext):
    """StepContext of the executor: each GroupNorm's statistics of the step running, merged over every
    tile before its segment (`stats`: (id(op), step) -> (mean, var)), never computed on a tile; its
    per-channel affine computed once per GroupNorm and step."""

    step_stats: dict = field(default_factory=dict)
    affines: dict = field(default_factory=dict)  # (id(op), step) -> (a, s)

    def group_stats(self, op, x, box, shape):
        stats = self.step_stats.get((id(op), self.step))
        if stats is None:
            raise AssertionError(f"statistics of {op.name} for step {self.step} are not ready: a segment "
                                 "cut is missing")
        return stats

    def group_affine(self, op, x, box, shape):
        key = (id(op), self.step)
        kept = self.affines.get(key)
        if kept is None or kept[0].device != x.device:
            kept = self.affines[key] = op.affine(self.group_stats(op, x, box, shape), x)
        return kept


def folded(x, per_frame: bool = False):
    """(B, C, t, h, w) -> (B, C, t h, w): the positions a GroupNorm of the step reduces over, as GroupStats
    reads a (B, C, H, W) value; `per_frame` (a GroupNorm of each frame): (B t, C, h, w)."""
    return x.transpose(1, 2).flatten(0, 1) if per_frame else x.flatten(2, 3)
