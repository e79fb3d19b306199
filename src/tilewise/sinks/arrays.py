"""Sinks that take blocks in any order: `TensorSink` (a torch tensor in memory), `MemmapSink` (.npy).

torch is imported inside the methods that make tensors: `import tilewise.sinks` imports no torch (~2 s;
tests/test_sinks.py checks it).
"""

from __future__ import annotations

import errno
import os
from typing import Any

import numpy as np

from ..atomic import name_target, temporary_path
from ..geometry import Box
from .base import Sink
from .coverage import first_gap
from .pixels import is_torch


class _BoxCoverageSink(Sink):
    """A sink that accepts blocks in any order and checks coverage from the list of written boxes."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._boxes: list[Box] = []

    def _gap(self) -> Box | None:
        return first_gap(self.height, self.width, self._boxes)


class TensorSink(_BoxCoverageSink):
    """In-memory sink: a preallocated (C, H, W) torch tensor on ``device``; ``result()`` returns it."""

    dtypes = ("uint8", "float16", "bfloat16", "float32", "float64")
    needs_path = False

    def __init__(self, path: None, height: int, width: int, channels: int = 3, dtype: Any = "float32", *,
                 value_range: tuple[float, float] = (-1.0, 1.0), device: Any = None):
        super().__init__(path, height, width, channels, dtype, value_range=value_range)
        import torch

        self._torch_dtype = getattr(torch, self.dtype)
        try:
            device = torch.device("cpu" if device is None else device)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"device must be a torch device (e.g. 'cpu', 'cuda:0'), got {device!r}") \
                from None
        self.tensor = torch.zeros((self.channels, self.height, self.width), dtype=self._torch_dtype,
                                  device=device)

    def _dtype_name(self, dtype: Any) -> str:
        name = str(dtype).removeprefix("torch.")
        if name not in self.dtypes:
            name = super()._dtype_name(dtype)
        return name

    def write(self, y0: int, x0: int, block: Any) -> None:
        """Write a torch image (copied on the sink's device) or numpy pixels at (y0, x0)."""
        if self.closed:
            raise ValueError(f"{self!r} is closed")
        import torch

        if is_torch(block):
            chw = self._torch_chw(block)
        else:  # numpy has no bfloat16: such blocks go through float32
            pixels = self._numpy_hwc(block, "float32" if self.dtype == "bfloat16" else self.dtype)
            chw = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1)
        self._check_box(y0, x0, chw.shape[1:])
        h, w = chw.shape[1:]
        self.tensor[:, y0:y0 + h, x0:x0 + w] = chw.to(self.tensor.device, self._torch_dtype)
        self._boxes.append((int(y0), int(y0 + h), int(x0), int(x0 + w)))

    def result(self) -> Any:
        """The (C, H, W) tensor; closes the sink first (which checks every pixel was written)."""
        self.close()
        return self.tensor


class MemmapSink(_BoxCoverageSink):
    """A ``.npy`` file of shape (H, W, C) written through a numpy memmap; blocks in any order."""

    def __init__(self, path: str | os.PathLike, height: int, width: int, channels: int = 3,
                 dtype: Any = "uint8", *, value_range: tuple[float, float] = (-1.0, 1.0)):
        super().__init__(path, height, width, channels, dtype, value_range=value_range)
        self._tmp = temporary_path(self.path)
        try:
            self._array = np.lib.format.open_memmap(self._tmp, mode="w+", dtype=self.dtype,
                                                    shape=(self.height, self.width, self.channels))
            allocate(self._tmp)
        except BaseException as e:
            name_target(e, self.path)
            self.abort()
            raise

    def _put(self, y0: int, x0: int, pixels: np.ndarray) -> None:
        h, w = pixels.shape[:2]
        self._array[y0:y0 + h, x0:x0 + w] = pixels
        self._boxes.append((y0, y0 + h, x0, x0 + w))

    def _finish(self) -> None:
        self._array.flush()
        self._release()

    def _discard(self) -> None:
        self._release()

    def _release(self) -> None:
        array = getattr(self, "_array", None)
        if array is not None:
            mm = getattr(array, "_mmap", None)
            self._array = None
            del array
            if mm is not None:
                mm.close()


def allocate(path: str) -> None:
    """Reserve a memmapped file's blocks on disk now: a mapped page the disk has no room for is a SIGBUS
    (a bus error, no clean-up) when written, where posix_fallocate fails with ENOSPC at once."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDWR)
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without it: writes are on trust
            return
        e.filename = path
        raise
    finally:
        os.close(fd)
