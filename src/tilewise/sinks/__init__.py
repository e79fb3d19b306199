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

``open_sink(path, ...)`` picks the sink by the path's suffix (``sink_for`` makes the same checks before any
work); ``replace=False`` makes ``close()`` refuse to replace an existing file. An error while writing (a
full disk) removes the temporary file and names ``path``; a ``.npy`` file's blocks are allocated on disk
when it is opened, so a full disk is an error then, not a bus error while writing.

One file per job: `pixels` (conversion), `coverage` (gaps, the row buffer), `base` (`Sink`), `arrays`
(`TensorSink`, `MemmapSink`), `png`, `tiff`; this package's face re-exports them and has `open_sink`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..atomic import check_target
from ..errors import BadRequest
from ..geometry import Box
from .arrays import MemmapSink, TensorSink
from .base import Sink
from .coverage import first_gap
from .pixels import FLOAT_DTYPES, INT_BITS, to_hwc_uint
from .png import PNG_FILTERS, PNGSink, png_chunk
from .tiff import TIFFSink

__all__ = ["FLOAT_DTYPES", "INT_BITS", "PNG_FILTERS", "SUFFIXES", "Box", "MemmapSink", "PNGSink", "Sink",
           "TIFFSink", "TensorSink", "first_gap", "open_sink", "png_chunk", "sink_for", "to_hwc_uint"]

SUFFIXES = {".png": "PNGSink", ".tif": "TIFFSink", ".tiff": "TIFFSink", ".npy": "MemmapSink"}


def sink_for(path: str | os.PathLike, bits: int = 8) -> tuple[type[Sink], str]:
    """(sink class, pixel dtype) for ``path``'s suffix and ``bits``: the checks of `open_sink`, made before
    any work (BadRequest naming the path, or the bits, and what is valid)."""
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIXES:
        raise BadRequest(f"cannot choose a sink for {os.fspath(path)!r}: suffix {suffix!r} is not one of "
                         f"{sorted(SUFFIXES)}")
    dtypes = {8: "uint8", 16: "uint16", 32: "float32"}
    if bits not in dtypes or (suffix == ".png" and bits == 32):
        valid = "8 or 16" if suffix == ".png" else "8, 16 or 32 (float32)"
        raise BadRequest(f"bits={bits!r} is not valid for {suffix}: use {valid}")
    return globals()[SUFFIXES[suffix]], dtypes[bits]


def open_sink(path: str | os.PathLike, height: int, width: int, channels: int = 3, bits: int = 8,
              replace: bool = True, **options: Any) -> Sink:
    """The sink for ``path``'s suffix (.png, .tif/.tiff, .npy) storing ``bits``-bit pixels (32: float32).

    replace=False: closing refuses to replace an existing file (no-clobber)."""
    cls, dtype = sink_for(path, bits)
    if not isinstance(replace, bool):
        raise ValueError(f"replace must be True or False, got {replace!r}")
    if not replace:
        check_target(path, replace=False)
    sink = cls(path, height, width, channels, dtype, **options)
    sink.replace = replace
    return sink
