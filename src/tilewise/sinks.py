"""Streaming sinks: write an image block by block without holding it whole.

Every sink shares one signature head, ``Sink(path, height, width, channels, dtype)``, and one contract:

- use it as a context manager; ``write(y0, x0, block)`` puts a block whose top-left pixel is (y0, x0);
- blocks are either **numpy pixels**: ``(h, w, C)`` arrays (``(h, w)`` when C == 1) already in the
  sink's dtype (a float sink casts any numeric array), or **torch images**: ``(C, h, w)`` or
  ``(1, C, h, w)`` tensors; float tensors are mapped from ``value_range`` (default ``(-1, 1)``, the
  range of a diffusers VAE decode) to the integer range of a uint8/uint16 sink by round-and-clamp, and
  copied as they are into a float sink. :func:`to_hwc_uint` does the same conversion by hand;
- ``close()`` checks that the writes covered every pixel (``ValueError`` naming the first gap
  otherwise), finishes the file under a temporary name in the destination's directory and renames it
  into place (``os.replace``, atomic on POSIX); an exception inside the ``with`` block, or a failed
  ``close()``, removes the temporary file, so a half-written image never appears under ``path``.

File sinks and what they hold in memory:

- :class:`TensorSink`: a preallocated ``(C, H, W)`` torch tensor (``path`` must be None), ``result()``.
- :class:`MemmapSink`: an ``(H, W, C)`` ``.npy`` file through ``numpy.lib.format.open_memmap``; blocks
  in any order.
- :class:`PNGSink`: 8/16-bit gray, gray+alpha, RGB or RGBA. The PNG stream (signature, IHDR, IDAT
  chunks from one running ``zlib.compressobj``, IEND, CRC-32 per chunk) is written by this module, so
  rows go to disk as soon as they are complete. The sink buffers rows from the first incomplete row
  to the lowest row written so far: full-width bands in order are flushed every ``band_rows`` rows
  (default 64); blocks from a row-major tile writer are held one tile row at a time. Rows above the
  buffer are already compressed, so a later write to them raises ``ValueError``.
- :class:`TIFFSink`: a tiled BigTIFF via tifffile (``TiffWriter.write`` fed an iterator of
  ``(th, tw, C)`` tiles by a writer thread). It buffers whole tile rows (``tile[0]`` rows high) from the
  first incomplete one to the lowest row written, and hands each complete tile row to the writer.

``open_sink(path, ...)`` picks the sink by the path's suffix.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from .atomic import publish, temporary_path

logger = logging.getLogger(__name__)

Box = tuple[int, int, int, int]

INT_BITS = {"uint8": 8, "uint16": 16}
FLOAT_DTYPES = ("float16", "float32", "float64")
SUFFIXES = {".png": "PNGSink", ".tif": "TIFFSink", ".tiff": "TIFFSink", ".npy": "MemmapSink"}


# --------------------------------------------------------------------------------------------------
# conversion


def _is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _channels_first_3d(x: Any, what: str) -> Any:
    """(C, h, w) view of a (h, w), (C, h, w) or (1, C, h, w) image."""
    if x.ndim == 4:
        if x.shape[0] != 1:
            raise ValueError(f"{what}: a (N, C, H, W) block must have N == 1, got shape {tuple(x.shape)}")
        return x[0]
    if x.ndim == 3:
        return x
    if x.ndim == 2:
        return x[None]
    raise ValueError(f"{what}: expected (H, W), (C, H, W) or (1, C, H, W), got shape {tuple(x.shape)}")


def _quantize_numpy(x: np.ndarray, bits: int, value_range: tuple[float, float]) -> np.ndarray:
    """round((x - lo) / (hi - lo) * (2^bits - 1)), clamped, as uint8/uint16."""
    lo, hi = value_range
    if not np.isfinite(x).all():
        raise ValueError("image block contains NaN or inf; cannot convert it to integer pixels")
    top = (1 << bits) - 1
    q = np.rint((np.asarray(x, np.float64) - lo) * (top / (hi - lo)))
    return np.clip(q, 0, top).astype(np.uint8 if bits == 8 else np.uint16)


def _quantize_torch(x: Any, bits: int, value_range: tuple[float, float]) -> Any:
    """Torch version of :func:`_quantize_numpy`, computed on the tensor's device; returns int32."""
    import torch

    lo, hi = value_range
    if not bool(torch.isfinite(x).all()):
        raise ValueError("image block contains NaN or inf; cannot convert it to integer pixels")
    top = (1 << bits) - 1
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    q = torch.round((x.to(dtype) - lo) * (top / (hi - lo)))
    return q.clamp_(0, top).to(torch.int32)


def _check_range(value_range: Any) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value_range)
    except (TypeError, ValueError):
        raise ValueError(f"value_range must be a (low, high) pair, got {value_range!r}") from None
    if not hi > lo:
        raise ValueError(f"value_range must have high > low, got {value_range!r}")
    return lo, hi


def to_hwc_uint(x: Any, bits: int = 8, value_range: tuple[float, float] = (-1.0, 1.0)) -> np.ndarray:
    """Float image, channels first ((H, W), (C, H, W) or (1, C, H, W)), -> (H, W, C) uint8/uint16 pixels."""
    if bits not in (8, 16):
        raise ValueError(f"bits must be 8 or 16, got {bits!r}")
    lo_hi = _check_range(value_range)
    x = _channels_first_3d(x, "to_hwc_uint")
    if _is_torch(x):
        q = _quantize_torch(x.detach(), bits, lo_hi).cpu().numpy()
        q = q.astype(np.uint8 if bits == 8 else np.uint16)
    else:
        q = _quantize_numpy(np.asarray(x), bits, lo_hi)
    return np.ascontiguousarray(q.transpose(1, 2, 0))


# --------------------------------------------------------------------------------------------------
# coverage


def first_gap(height: int, width: int, boxes: list[Box]) -> Box | None:
    """First box of the image not covered by ``boxes`` (coordinate-compressed union), or None."""
    if not boxes:
        return (0, height, 0, width)
    ys = np.unique(np.array([0, height] + [v for b in boxes for v in b[:2]]))
    xs = np.unique(np.array([0, width] + [v for b in boxes for v in b[2:]]))
    covered = np.zeros((len(ys) - 1, len(xs) - 1), dtype=bool)
    for y0, y1, x0, x1 in boxes:
        i0, i1 = np.searchsorted(ys, (y0, y1))
        j0, j1 = np.searchsorted(xs, (x0, x1))
        covered[i0:i1, j0:j1] = True
    holes = np.argwhere(~covered)
    if len(holes) == 0:
        return None
    i, j = holes[0]
    return int(ys[i]), int(ys[i + 1]), int(xs[j]), int(xs[j + 1])


class _RowBuffer:
    """Rows [start, start + n) of an image with a per-pixel written mask; pops complete leading rows."""

    def __init__(self, height: int, width: int, channels: int, dtype: np.dtype, granule: int):
        self.height, self.width, self.channels, self.dtype = height, width, channels, dtype
        self.granule = granule
        self.start = 0
        self.rows = np.zeros((0, width, channels), dtype)
        self.mask = np.zeros((0, width), bool)
        self.complete = 0  # leading rows of the buffer known to be fully written

    def put(self, y0: int, x0: int, block: np.ndarray) -> None:
        h, w = block.shape[:2]
        if y0 < self.start:
            raise ValueError(f"rows {y0}..{y0 + h} are already flushed (rows < {self.start} are written "
                             f"out); write rows top to bottom: full-width bands or tile rows in order")
        self._grow(y0 + h - self.start)
        r0 = y0 - self.start
        self.rows[r0:r0 + h, x0:x0 + w] = block
        self.mask[r0:r0 + h, x0:x0 + w] = True
        if r0 <= self.complete < r0 + h:
            while self.complete < len(self.mask) and self.mask[self.complete].all():
                self.complete += 1

    def _grow(self, n: int) -> None:
        if n <= len(self.rows):
            return
        n = min(-(-n // self.granule) * self.granule, self.height - self.start)
        rows = np.zeros((n, self.width, self.channels), self.dtype)
        mask = np.zeros((n, self.width), bool)
        rows[:len(self.rows)], mask[:len(self.mask)] = self.rows, self.mask
        self.rows, self.mask = rows, mask

    def pop(self, min_rows: int) -> np.ndarray | None:
        """The complete leading rows, in multiples of ``granule`` and >= ``min_rows`` (fewer at the end)."""
        k = self.complete
        at_end = self.start + k == self.height
        if not at_end:
            k = (k // self.granule) * self.granule
            if k < max(min_rows, 1):
                return None
        if k == 0:
            return None
        out = self.rows[:k]
        self.rows, self.mask = self.rows[k:].copy(), self.mask[k:].copy()
        self.start += k
        self.complete -= k
        return out

    def gap(self) -> Box | None:
        """First unwritten row span (as a box), or None when every row was popped."""
        if self.start == self.height:
            return None
        if len(self.mask) == 0 or self.complete == len(self.mask):
            return (self.start + self.complete, self.height, 0, self.width)
        row = self.start + self.complete
        missing = np.flatnonzero(~self.mask[self.complete])
        return (row, row + 1, int(missing[0]), int(missing[-1]) + 1)


# --------------------------------------------------------------------------------------------------
# sinks


class Sink:
    """Base of all sinks: ``Sink(path, height, width, channels, dtype)``, ``write(y0, x0, block)``."""

    dtypes: tuple[str, ...] = ("uint8", "uint16", *FLOAT_DTYPES)
    needs_path = True

    def __init__(self, path: str | os.PathLike | None, height: int, width: int, channels: int = 3,
                 dtype: Any = "uint8", *, value_range: tuple[float, float] = (-1.0, 1.0)):
        for name, v in (("height", height), ("width", width), ("channels", channels)):
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r} "
                                 f"(image {height!r}x{width!r}x{channels!r})")
        self.height, self.width, self.channels = int(height), int(width), int(channels)
        self.dtype = self._dtype_name(dtype)
        self.value_range = _check_range(value_range)
        if self.needs_path and path is None:
            raise ValueError(f"{type(self).__name__} writes a file: give a path")
        if not self.needs_path and path is not None:
            raise ValueError(f"{type(self).__name__} holds the image in memory: path must be None, "
                             f"got {path!r}")
        self.path = None if path is None else os.fspath(path)
        self.closed = False
        self._tmp: str | None = None

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
            self.abort()
        else:
            self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.path!r}, {self.height}, {self.width}, {self.channels}, "
                f"{self.dtype!r})")

    # -- writing -----------------------------------------------------------------------------------

    def write(self, y0: int, x0: int, block: Any) -> None:
        """Write ``block`` with its top-left pixel at (y0, x0); see the module docstring for layouts."""
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
        if _is_torch(block):
            chw = self._torch_chw(block)
            return np.ascontiguousarray(chw.cpu().numpy().transpose(1, 2, 0), dtype=self.dtype)
        return self._numpy_hwc(block, self.dtype)

    def _torch_chw(self, block: Any) -> Any:
        """(C, h, w) tensor of a torch image; floats quantized from value_range for an integer sink."""
        chw = _channels_first_3d(block.detach(), f"{type(self).__name__}.write")
        self._check_channels(chw.shape[0], tuple(block.shape))
        if chw.is_floating_point() and self.dtype in INT_BITS:
            return _quantize_torch(chw, INT_BITS[self.dtype], self.value_range)
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
        try:
            gap = self._gap()
            if gap is not None:
                raise ValueError(f"{self!r}: pixels (y {gap[0]}..{gap[1]}, x {gap[2]}..{gap[3]}) were never "
                                 f"written; writes must cover the whole {self.height}x{self.width} image")
            self._finish()
            if self._tmp is not None:
                publish(self._tmp, self.path)
                self._tmp = None
                logger.debug("wrote %s", self.path)
        except BaseException:
            self.abort()
            raise
        self.closed = True

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

        if _is_torch(block):
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
        except BaseException:
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


# --------------------------------------------------------------------------------------------------
# PNG

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_COLOR_TYPE = {1: 0, 2: 4, 3: 2, 4: 6}  # channels -> gray, gray+alpha, RGB, RGBA
PNG_FILTERS = {"none": 0, "sub": 1, "up": 2}


def png_chunk(kind: bytes, data: bytes) -> bytes:
    """One PNG chunk: length, type, data, CRC-32 of type + data (PNG spec section 5.3)."""
    crc = zlib.crc32(data, zlib.crc32(kind)) & 0xFFFFFFFF
    return len(data).to_bytes(4, "big") + kind + data + crc.to_bytes(4, "big")


class PNGSink(Sink):
    """PNG (8/16-bit; gray, gray+alpha, RGB, RGBA) streamed as IDAT chunks of one running zlib stream."""

    dtypes = ("uint8", "uint16")

    def __init__(self, path: str | os.PathLike, height: int, width: int, channels: int = 3,
                 dtype: Any = "uint8", *, value_range: tuple[float, float] = (-1.0, 1.0), band_rows: int = 64,
                 compress_level: int = 6, png_filter: str = "up", idat_bytes: int = 1 << 20):
        super().__init__(path, height, width, channels, dtype, value_range=value_range)
        if self.channels not in _PNG_COLOR_TYPE:
            raise ValueError(f"PNG holds 1 (gray), 2 (gray+alpha), 3 (RGB) or 4 (RGBA) channels, "
                             f"got {channels}")
        if max(self.height, self.width) > 2**31 - 1:
            raise ValueError(f"PNG sides are at most 2**31 - 1, got {self.height}x{self.width}")
        if png_filter not in PNG_FILTERS:
            raise ValueError(f"png_filter must be one of {sorted(PNG_FILTERS)}, got {png_filter!r}")
        if not (isinstance(band_rows, int) and band_rows >= 1):
            raise ValueError(f"band_rows must be an int >= 1, got {band_rows!r}")
        if compress_level not in range(-1, 10):
            raise ValueError(f"compress_level must be -1 (zlib default) or 0..9, got {compress_level!r}")
        self.band_rows, self.png_filter, self.idat_bytes = band_rows, png_filter, idat_bytes
        self._buffer = _RowBuffer(self.height, self.width, self.channels, np.dtype(self.dtype), 1)
        self._zip = zlib.compressobj(compress_level)
        self._pending = bytearray()
        self._prev: np.ndarray | None = None  # previous scanline's bytes, for the "up" filter
        self._tmp = temporary_path(self.path)
        try:
            self._file = open(self._tmp, "wb")  # noqa: SIM115 - closed in _finish/_discard
            self._file.write(_PNG_SIGNATURE + png_chunk(b"IHDR", self._ihdr()))
        except BaseException:
            self.abort()
            raise

    def _ihdr(self) -> bytes:
        bits = INT_BITS[self.dtype]
        return (self.width.to_bytes(4, "big") + self.height.to_bytes(4, "big")
                + bytes([bits, _PNG_COLOR_TYPE[self.channels], 0, 0, 0]))

    def _put(self, y0: int, x0: int, pixels: np.ndarray) -> None:
        self._buffer.put(y0, x0, pixels)
        band = self._buffer.pop(self.band_rows)
        if band is not None:
            self._emit(band)

    def _scanlines(self, band: np.ndarray) -> np.ndarray:
        """Filtered scanlines (filter byte + bytes) of a band: PNG filter types 0 (none), 1 (sub), 2 (up)."""
        raw = band.astype(">u2") if self.dtype == "uint16" else band
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(len(band), -1)
        kind = PNG_FILTERS[self.png_filter]
        if kind == 1:
            bpp = self.channels * (2 if self.dtype == "uint16" else 1)
            filtered = raw.copy()
            filtered[:, bpp:] -= raw[:, :-bpp]
        elif kind == 2:
            prev = np.zeros_like(raw[:1]) if self._prev is None else self._prev
            filtered = raw.copy()
            filtered[0] -= prev[0]
            filtered[1:] -= raw[:-1]
            self._prev = raw[-1:].copy()
        else:
            filtered = raw
        lines = np.empty((len(raw), raw.shape[1] + 1), np.uint8)
        lines[:, 0], lines[:, 1:] = kind, filtered
        return lines

    def _emit(self, band: np.ndarray) -> None:
        self._pending += self._zip.compress(self._scanlines(band).data)
        self._flush_idat(self.idat_bytes)

    def _flush_idat(self, at_least: int) -> None:
        while len(self._pending) >= max(at_least, 1):
            n = min(len(self._pending), self.idat_bytes)
            self._file.write(png_chunk(b"IDAT", bytes(self._pending[:n])))
            del self._pending[:n]

    def _gap(self) -> Box | None:
        return self._buffer.gap()

    def _finish(self) -> None:
        self._pending += self._zip.flush()
        self._flush_idat(0)
        self._file.write(png_chunk(b"IEND", b""))
        self._file.close()

    def _discard(self) -> None:
        f = getattr(self, "_file", None)
        if f is not None:
            f.close()


# --------------------------------------------------------------------------------------------------
# TIFF

_ABORT = object()


class _Aborted(Exception):
    """Raised inside the TIFF writer thread's tile iterator when the sink is aborted."""


class TIFFSink(Sink):
    """Tiled BigTIFF through tifffile, fed one complete tile row at a time by a writer thread."""

    def __init__(self, path: str | os.PathLike, height: int, width: int, channels: int = 3,
                 dtype: Any = "uint8", *, value_range: tuple[float, float] = (-1.0, 1.0),
                 tile: int | tuple[int, int] = 256, compression: str | None = None, queue_bands: int = 1):
        super().__init__(path, height, width, channels, dtype, value_range=value_range)
        th, tw = (tile, tile) if isinstance(tile, int) else tuple(tile)
        if not all(isinstance(t, int) and t >= 16 and t % 16 == 0 for t in (th, tw)):
            raise ValueError(f"TIFF tile sides must be positive multiples of 16, got {tile!r}")
        self.tile, self.compression = (th, tw), compression
        self._buffer = _RowBuffer(self.height, self.width, self.channels, np.dtype(self.dtype), th)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_bands))
        self._error: BaseException | None = None
        self._tmp = temporary_path(self.path)
        self._thread = threading.Thread(target=self._run, name="tilewise-tiff-writer", daemon=True)
        self._thread.start()

    def _tiles(self) -> Any:
        th, tw = self.tile
        for _ in range(-(-self.height // th)):
            band = self._queue.get()
            if band is _ABORT:
                raise _Aborted
            if self.channels == 1:
                band = band[:, :, 0]
            for x in range(0, self.width, tw):
                yield band[:, x:x + tw]

    def _run(self) -> None:
        try:
            import tifffile

            photometric = "rgb" if self.channels in (3, 4) else "minisblack"
            extrasamples = ("unassalpha",) if self.channels in (2, 4) else None
            gray = self.channels == 1  # stored as (H, W): tifffile has no contig layout for one sample
            shape = (self.height, self.width) if gray else (self.height, self.width, self.channels)
            with tifffile.TiffWriter(self._tmp, bigtiff=True) as tif:
                tif.write(self._tiles(), shape=shape, dtype=self.dtype, tile=self.tile,
                          photometric=photometric, planarconfig=None if gray else "contig",
                          extrasamples=extrasamples, compression=self.compression, metadata=None)
        except BaseException as err:  # handed to the caller's thread in _check_writer
            self._error = err

    def _check_writer(self) -> None:
        """Re-raise, in the caller's thread, whatever stopped the writer thread (its type unchanged)."""
        if self._error is not None and not isinstance(self._error, _Aborted):
            logger.error("TIFF writer for %s failed: %r", self.path, self._error)
            raise self._error

    def _send(self, band: Any) -> None:
        while True:
            self._check_writer()
            if not self._thread.is_alive():
                raise RuntimeError(f"TIFF writer for {self.path} stopped before all tile rows were written")
            try:
                self._queue.put(band, timeout=0.1)
                return
            except queue.Full:
                continue

    def _put(self, y0: int, x0: int, pixels: np.ndarray) -> None:
        self._buffer.put(y0, x0, pixels)
        band = self._buffer.pop(self.tile[0])
        while band is not None:
            th = self.tile[0]
            for r in range(0, len(band), th):
                self._send(band[r:r + th])
            band = self._buffer.pop(self.tile[0])

    def _gap(self) -> Box | None:
        return self._buffer.gap()

    def _finish(self) -> None:
        self._thread.join()
        self._check_writer()

    def _discard(self) -> None:
        while self._thread.is_alive():
            try:
                self._queue.put_nowait(_ABORT)
            except queue.Full:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    pass
                continue
            self._thread.join(timeout=1.0)


# --------------------------------------------------------------------------------------------------


def open_sink(path: str | os.PathLike, height: int, width: int, channels: int = 3, bits: int = 8,
              **options: Any) -> Sink:
    """The sink for ``path``'s suffix (.png, .tif/.tiff, .npy) storing ``bits``-bit pixels (32: float32)."""
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(f"cannot choose a sink for {os.fspath(path)!r}: suffix {suffix!r} is not one of "
                         f"{sorted(SUFFIXES)}")
    dtypes = {8: "uint8", 16: "uint16", 32: "float32"}
    if bits not in dtypes or (suffix == ".png" and bits == 32):
        valid = "8 or 16" if suffix == ".png" else "8, 16 or 32 (float32)"
        raise ValueError(f"bits={bits!r} is not valid for {suffix}: use {valid}")
    cls = globals()[SUFFIXES[suffix]]
    return cls(path, height, width, channels, dtypes[bits], **options)
