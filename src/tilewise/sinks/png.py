"""`PNGSink`: a PNG stream written by hand (signature, IHDR, IDAT from one running zlib stream, IEND)."""

from __future__ import annotations

import os
import zlib
from typing import Any

import numpy as np

from ..atomic import temporary_path
from ..geometry import Box
from .base import Sink
from .coverage import RowBuffer
from .pixels import INT_BITS

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
        if isinstance(idat_bytes, bool) or not isinstance(idat_bytes, int) or idat_bytes < 1:
            raise ValueError(f"idat_bytes (the most bytes per IDAT chunk) must be an int >= 1, got "
                             f"{idat_bytes!r}")
        self.band_rows, self.png_filter, self.idat_bytes = band_rows, png_filter, idat_bytes
        self._buffer = RowBuffer(self.height, self.width, self.channels, np.dtype(self.dtype), 1)
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
            try:
                f.close()
            except OSError:  # a close that failed to flush (a full disk) fails again: the file is dropped
                pass
