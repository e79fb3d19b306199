"""What a video run holds besides its tiles' values: the staged values of every step (`Store`: on the
device, in host memory or in disk files, `DiskFrames`), the executor's step context with each GroupNorm's
merged statistics (`VideoContext`), and byte counts."""

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


class DiskFrames(DiskValue):
    """One staged (B, C, T, H, W) value of a step in a file, frame-major and channels-last: (B, T, H, W, C),
    so a tile's box is one contiguous run per (sample, frame, row); read and written with positional I/O
    as `DiskValue` (the data in the page cache, nothing of it mapped into this process)."""

    def nbytes(self) -> int:
        b, c, t, h, w = self.shape
        return b * c * t * h * w * self.itemsize

    def _runs(self, y0: int, y1: int, x0: int, x1: int):
        """(sample, frame, row of the box, byte offset) of each row run of a box."""
        b, c, t, h, w = self.shape
        for i in range(b):
            for f in range(t):
                for y in range(y0, y1):
                    yield i, f, y - y0, (((i * t + f) * h + y) * w + x0) * c * self.itemsize

    def read(self, y0: int, y1: int, x0: int, x1: int):
        """The box as a new (B, C, T, h, w) tensor in channels-last (3-D) memory."""
        b, c, t = self.shape[:3]
        out = torch.empty((b, t, y1 - y0, x1 - x0, c), dtype=self.dtype)
        raw = out.view(torch.uint8).numpy()
        want = (x1 - x0) * c * self.itemsize
        for i, f, r, off in self._runs(y0, y1, x0, x1):
            if want and os.preadv(self.fd, [raw[i, f, r]], off) != want:
                raise OSError(f"short read from the staging file {self.path}")
        return out.permute(0, 4, 1, 2, 3)

    def write(self, y0: int, y1: int, x0: int, x1: int, value) -> None:
        """Write a (B, C, T, h, w) tensor into the box, a few rows at a time (`rows_per_write`)."""
        b, c, t = self.shape[:3]
        want = (x1 - x0) * c * self.itemsize
        step = rows_per_write(b * t * want)
        for r0 in range(0, y1 - y0, step):
            part = value[..., r0 : r0 + step, :].detach().to("cpu", self.dtype)
            raw = part.permute(0, 2, 3, 4, 1).contiguous().view(torch.uint8).numpy()
            for i, f, r, off in self._runs(y0 + r0, y0 + r0 + part.shape[3], x0, x1):
                if want and os.pwritev(self.fd, [raw[i, f, r]], off) != want:
                    raise OSError(f"short write to the staging file {self.path} (disk full?)")


def write_bytes(core_bytes: int, rows: int) -> int:
    """Bytes of the channels-last copy `DiskFrames.write` makes of a core of `core_bytes` in `rows` rows."""
    row = core_bytes // max(1, rows)
    return min(core_bytes, rows_per_write(row) * row)


class Store:
    """Staged values of the run: (value, step) -> full-size tensor, on the device or the host, or (staging
    "disk") a `DiskFrames` file in `directory` (None: the system's temporary folder), removed when freed
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
                self.values[key] = DiskFrames(os.path.join(self.dir.name, name), shape, dtype)
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
        if isinstance(t, DiskFrames):
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
    return t.nbytes() if isinstance(t, DiskFrames) else nbytes(t)


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
