"""`Sink`, the base of every sink: the signature head, write checks and conversion, atomic close/abort."""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from ..atomic import check_target, name_target, publish
from ..geometry import Box
from .pixels import FLOAT_DTYPES, INT_BITS, channels_first_3d, check_range, is_torch, quantize_torch

logger = logging.getLogger(__name__)


class Sink:
    """Base of all sinks: ``Sink(path, height, width, channels, dtype)``, ``write(y0, x0, block)``."""

    dtypes: tuple[str, ...] = ("uint8", "uint16", *FLOAT_DTYPES)
    needs_path = True
    replace = True  # False: close() refuses to replace an existing file at path (no-clobber)

    def __init__(self, path: str | os.PathLike | None, height: int, width: int, channels: int = 3,
                 dtype: Any = "uint8", *, value_range: tuple[float, float] = (-1.0, 1.0)):
        for name, v in (("height", height), ("width", width), ("channels", channels)):
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r} "
                                 f"(image {height!r}x{width!r}x{channels!r})")
        self.height, self.width, self.channels = int(height), int(width), int(channels)
        self.dtype = self._dtype_name(dtype)
        self.value_range = check_range(value_range)
        if self.needs_path and path is None:
            raise ValueError(f"{type(self).__name__} writes a file: give a path")
        if not self.needs_path and path is not None:
            raise ValueError(f"{type(self).__name__} holds the image in memory: path must be None, "
                             f"got {path!r}")
        self.path = None if path is None else os.fspath(path)
        self.closed = False
        self._tmp: str | None = None
        if self.path is not None:
            check_target(self.path)  # (a folder, a missing folder, a read-only place: refused before writing)

    def _dtype_name(self, dtype: Any) -> str:
        name = str(dtype).removeprefix("torch.")
        try:
            name = np.dtype(dtype if isinstance(dtype, type) else name).name
        except TypeError:
            pass
        if name not in self.dtypes:
            raise ValueError(f"{type(self).__name__} does not support dtype {dtype!r}; valid: {self.dtypes}")
        return name

    @property
    def shape(self) -> tuple[int, int, int]:
        """(height, width, channels)."""
        return self.height, self.width, self.channels

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            name_target(exc, self.path)
            self.abort()
        else:
            self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.path!r}, {self.height}, {self.width}, {self.channels}, "
                f"{self.dtype!r})")

    # -- writing -----------------------------------------------------------------------------------

    def write(self, y0: int, x0: int, block: Any) -> None:
        """Write ``block`` with its top-left pixel at (y0, x0); layouts: the `tilewise.sinks` docstring."""
        if self.closed:
            raise ValueError(f"{self!r} is closed")
        pixels = self._pixels(block)
        self._check_box(y0, x0, pixels.shape[:2])
        self._put(int(y0), int(x0), pixels)

    def _check_box(self, y0: Any, x0: Any, hw: tuple[int, int]) -> None:
        h, w = int(hw[0]), int(hw[1])
        ok = all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in (y0, x0))
        if not ok or y0 < 0 or x0 < 0 or y0 + h > self.height or x0 + w > self.width or h == 0 or w == 0:
            raise ValueError(f"block of {h}x{w} at (y0={y0!r}, x0={x0!r}) does not fit inside the "
                             f"{self.height}x{self.width} image (needs 0 <= y0, y0 + h <= {self.height}, "
                             f"0 <= x0, x0 + w <= {self.width}, h, w >= 1)")

    def _pixels(self, block: Any) -> np.ndarray:
        """(h, w, C) numpy pixels in the sink's dtype from a numpy block or a torch image."""
        if is_torch(block):
            chw = self._torch_chw(block)
            return np.ascontiguousarray(chw.cpu().numpy().transpose(1, 2, 0), dtype=self.dtype)
        return self._numpy_hwc(block, self.dtype)

    def _torch_chw(self, block: Any) -> Any:
        """(C, h, w) tensor of a torch image; floats quantized from value_range for an integer sink."""
        chw = channels_first_3d(block.detach(), f"{type(self).__name__}.write")
        self._check_channels(chw.shape[0], tuple(block.shape))
        if chw.is_floating_point() and self.dtype in INT_BITS:
            return quantize_torch(chw, INT_BITS[self.dtype], self.value_range)
        if self.dtype in INT_BITS and str(chw.dtype) != f"torch.{self.dtype}":
            raise ValueError(f"integer tensor of dtype {chw.dtype} cannot go into a {self.dtype} sink "
                             f"without rescaling; pass floats in value_range={self.value_range}")
        return chw

    def _numpy_hwc(self, block: Any, dtype: str) -> np.ndarray:
        """(h, w, C) pixels of a numpy block: same dtype for integer sinks, any number cast for floats."""
        block = np.asarray(block)
        if block.ndim == 2:
            block = block[:, :, None]
        if block.ndim != 3:
            raise ValueError(f"numpy blocks are (h, w, C) pixels (or (h, w) for one channel), got shape "
                             f"{block.shape}")
        self._check_channels(block.shape[2], block.shape)
        if dtype in INT_BITS and block.dtype != dtype:
            raise ValueError(f"numpy block has dtype {block.dtype} but the sink stores {dtype} pixels; "
                             f"convert float images with to_hwc_uint(x, bits={INT_BITS[dtype]}, "
                             f"value_range=...) or pass a torch tensor")
        if dtype not in INT_BITS and not np.issubdtype(block.dtype, np.number):
            raise ValueError(f"numpy block of dtype {block.dtype} cannot go into a {self.dtype} sink")
        return block.astype(dtype, copy=False)

    def _check_channels(self, c: int, shape: tuple[int, ...]) -> None:
        if c != self.channels:
            raise ValueError(f"block of shape {shape} has {c} channels, the sink has {self.channels}")

    def _put(self, y0: int, x0: int, pixels: np.ndarray) -> None:
        raise NotImplementedError

    # -- finishing ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Check coverage, finish the file and rename it into place; on any error remove it instead."""
        if self.closed:
            return
        tmp = self.complete()
        if tmp is None:
            return
        try:
            publish(tmp, self.path, replace=self.replace)
        except BaseException as e:
            name_target(e, self.path)
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        logger.debug("wrote %s", self.path)

    def complete(self) -> str | None:
        """Check coverage and finish the file under its temporary name, without renaming it: the temporary
        path (None for an in-memory sink), now the caller's to publish (`atomic.publish_all`, as a frame
        sequence does with all its frames at once) or remove. On any error the file is removed."""
        if self.closed:
            raise ValueError(f"{self!r} is closed")
        try:
            gap = self._gap()
            if gap is not None:
                raise ValueError(f"{self!r}: pixels (y {gap[0]}..{gap[1]}, x {gap[2]}..{gap[3]}) were never "
                                 f"written; writes must cover the whole {self.height}x{self.width} image")
            self._finish()
        except BaseException as e:
            name_target(e, self.path)
            self.abort()
            raise
        self.closed = True
        tmp, self._tmp = self._tmp, None
        return tmp

    def abort(self) -> None:
        """Discard everything written; no file is left at ``path`` nor under the temporary name."""
        if self.closed:
            return
        self.closed = True
        try:
            self._discard()
        finally:
            if self._tmp is not None and os.path.exists(self._tmp):
                os.unlink(self._tmp)
            self._tmp = None

    def _gap(self) -> Box | None:
        raise NotImplementedError

    def _finish(self) -> None:
        pass

    def _discard(self) -> None:
        pass
