"""`TIFFSink`: a tiled BigTIFF through tifffile, fed complete tile rows by a writer thread.

tifffile (~30 ms after numpy) is imported by the writer that uses it, so that only TIFF outputs pay for it.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import shutil
import threading
from typing import Any

import numpy as np

from ..atomic import temporary_path
from ..geometry import Box
from .base import Sink
from .coverage import RowBuffer

logger = logging.getLogger(__name__)

_ABORT = object()


class _Aborted(Exception):
    """Raised inside the TIFF writer thread's tile iterator when the sink is aborted."""


def _check_compression(compression: Any) -> None:
    """None, or a compression tifffile writes here (zlib, and those its codecs provide): tried on one
    16 x 16 tile in memory, so that a codec that is not installed is refused now, not by the writer."""
    if compression is None:
        return
    import io

    import tifffile

    try:
        tifffile.imwrite(io.BytesIO(), np.zeros((16, 16), np.uint8), tile=(16, 16), compression=compression)
    except Exception as e:  # tifffile's refusals: ValueError, KeyError, a missing codec module
        why = f"{type(e).__name__}: {e}"
        raise ValueError(f"compression={compression!r} cannot be written here ({why}); use None or 'zlib' "
                         "(others, e.g. 'lzw', 'zstd', need the imagecodecs package)") from None


class TIFFSink(Sink):
    """Tiled BigTIFF through tifffile, fed one complete tile row at a time by a writer thread."""

    def __init__(self, path: str | os.PathLike, height: int, width: int, channels: int = 3,
                 dtype: Any = "uint8", *, value_range: tuple[float, float] = (-1.0, 1.0),
                 tile: int | tuple[int, int] = 256, compression: str | None = None, queue_bands: int = 1):
        super().__init__(path, height, width, channels, dtype, value_range=value_range)
        th, tw = (tile, tile) if isinstance(tile, int) else tuple(tile)
        if not all(isinstance(t, int) and t >= 16 and t % 16 == 0 for t in (th, tw)):
            raise ValueError(f"TIFF tile sides must be positive multiples of 16, got {tile!r}")
        _check_compression(compression)
        if isinstance(queue_bands, bool) or not isinstance(queue_bands, int) or queue_bands < 1:
            raise ValueError(f"queue_bands (tile rows handed to the writer ahead) must be an int >= 1, got "
                             f"{queue_bands!r}")
        self.tile, self.compression = (th, tw), compression
        self._buffer = RowBuffer(self.height, self.width, self.channels, np.dtype(self.dtype), th)
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
            logger.debug("TIFF writer for %s failed: %r", self.path, self._error)
            err = self._error
            if isinstance(err, OSError) and err.errno is None and "requested and" in str(err):
                if shutil.disk_usage(os.path.dirname(os.path.abspath(self._tmp))).free < 1 << 20:
                    text = f"No space left on device (tifffile: {err})"
                    raise OSError(errno.ENOSPC, text, self.path) from err
            raise err

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
