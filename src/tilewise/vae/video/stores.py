"""What a video run holds besides its tiles' values: the staged values of every step (`Store`: on the
device, in host memory or in disk files, `run.staging.DiskValue` laid out (B, T, H, W, C)), the executor's
step context with each GroupNorm's merged statistics (`VideoContext`), and byte counts."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

from ...locality.ops3d import StepContext
from ..run.staging import TRIM_FREE, DiskValue, rows_per_write, trim_heap
from ..settings import Place


def nbytes(t) -> int:
    """Bytes of a tensor's elements."""
    return t.numel() * t.element_size()


def cache_bytes(caches: dict) -> int:
    """Bytes of one tile's caches (id(op) -> (box, frames))."""
    return sum(nbytes(f) for _, f in caches.values())


def write_bytes(core_bytes: int, rows: int) -> int:
    """Bytes of the channels-last copy `DiskValue.write` makes of a core of `core_bytes` in `rows` rows."""
    row = core_bytes // max(1, rows)
    return min(core_bytes, rows_per_write(row) * row)


class Store:
    """Staged values of the run: (value, step) -> full-size tensor, on the device or the host, or (staging
    "disk") a `DiskValue` file in `directory` (None: the system's temporary folder), removed when freed
    and at `close`."""

    def __init__(self, where: Place, device, zeroed: bool = False, directory: str | None = None):
        self.device = device
        self.disk = where is Place.DISK
        if self.disk and zeroed:
            raise ValueError("disk staging of a video VAE runs in one process: its staged files cannot be "
                             "summed over a process group; use staging='device' or 'host' with it")
        self.home = device if where is Place.DEVICE else torch.device("cpu")
        self.values: dict[tuple[str, int], Any] = {}
        self.alive = self.peak = 0
        self.zeroed = zeroed  # (a rank writes its tiles' cores; the ranks' values are then summed)
        self.dir = tempfile.TemporaryDirectory(prefix="tilewise-stage-", dir=directory) if self.disk else None

    def make(self, key, shape, dtype) -> Any:
        """The tensor (or file) of `key`, allocated on first use (zeros where ranks sum their parts)."""
        if key not in self.values:
            if self.disk:
                name = f"{key[0].replace('/', '_')}-{key[1]}.bin"
                self.values[key] = DiskValue(os.path.join(self.dir.name, name), shape, dtype)
            else:
                new = torch.zeros if self.zeroed else torch.empty
                self.values[key] = new(shape, dtype=dtype, device=self.home)
            self.alive += _bytes(self.values[key])
            self.peak = max(self.peak, self.alive)
        return self.values[key]

    def write(self, key, shape, dtype, box, block) -> None:
        t = self.make(key, shape, dtype)
        if self.disk:
            t.write(*box, block)
        else:
            t[..., box[0] : box[1], box[2] : box[3]].copy_(block)

    def read(self, key, box):
        """The box of a staged value, on the device (from disk: a new tensor)."""
        t = self.values[key]
        t = t.read(*box) if self.disk else t[..., box[0] : box[1], box[2] : box[3]]
        return t.to(self.device, non_blocking=True)

    def views(self, key, t) -> bool:
        """Whether `t`, read of `key`, views its staged tensor (a disk read never does)."""
        whole = self.values.get(key)
        return whole is None or not self.disk and t.untyped_storage()._cdata == whole.untyped_storage()._cdata

    def free(self, value: str) -> None:
        for key in [k for k in self.values if k[0] == value]:
            self._release(self.values.pop(key))

    def drop(self, value: str, step: int) -> None:
        """Free one step's tensor of a value (if it was staged)."""
        t = self.values.pop((value, step), None)
        if t is not None:
            self._release(t)

    def _release(self, t) -> None:
        self.alive -= _bytes(t)
        if isinstance(t, DiskValue):
            t.close()

    def trim(self) -> None:
        """Disk staging (the memory-bounded one) returns freed heap to the OS past `TRIM_FREE` of it."""
        if self.disk:
            trim_heap(TRIM_FREE)

    def close(self) -> None:
        """Free every staged value (and remove the staging folder); a second call does nothing."""
        for key in list(self.values):
            self._release(self.values.pop(key))
        if self.dir is not None:
            self.dir.cleanup()
            self.dir = None


def _bytes(t) -> int:
    return t.nbytes() if isinstance(t, DiskValue) else nbytes(t)


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
