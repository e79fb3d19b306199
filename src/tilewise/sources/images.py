"""Input images read at their depth: 8- and 16-bit, grey or colour, PNG / TIFF / anything Pillow opens.

What `read_image` does with each kind (the README's "Input images"):
- 8-bit images (PNG, JPEG, WebP, palette, ...) through Pillow, converted to RGB;
- 16-bit PNGs through `png16` (Pillow would drop their low byte, or clip 16-bit grey to white);
- TIFFs through tifffile, 8- or 16-bit unsigned, 1-4 samples, contiguous or planar;
- grey is replicated to R, G, B;
- alpha is kept apart (`Picture.alpha`) and not used: the colour channels are taken as stored, and a
  warning says so when some pixel is not opaque (unless the caller uses it: an RGBA VAE's encode,
  `Picture.tensor(alpha=True)`);
- float, 32-bit integer, CMYK-TIFF and other kinds are refused with `BadInputFile` naming what was found.
The image's size is read from its header first, and an image whose pixels would not fit in memory is
refused (`WontFit`) before it is decoded.

torch (~2 s), tifffile (~30 ms) and PIL (~15 ms) are imported inside the functions that read that kind:
`import tilewise.sources`, which the CLI's input checks run, needs numpy only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import BadInputFile
from ..limits import check_memory
from .files import check_file
from .png16 import CHANNELS, png_header, read_png16

logger = logging.getLogger(__name__)

_TIFF_MAGIC = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")
_PIL_RGB = ("1", "L", "P", "RGB", "CMYK", "YCbCr", "LAB", "HSV")
_PIL_ALPHA = ("LA", "La", "PA", "RGBA", "RGBa")
_PIL_16 = ("I;16", "I;16B", "I;16L", "I;16N")


@dataclass
class Picture:
    """An image as read: RGB pixels at their depth, the alpha channel apart, and what the file held."""

    pixels: np.ndarray  # (H, W, 3) uint8 or uint16
    bits: int  # 8 or 16
    alpha: np.ndarray | None  # (H, W), same dtype, or None
    kind: str  # e.g. "16-bit grey PNG"

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])

    def tensor(self, value_range: tuple[float, float] = (-1.0, 1.0), alpha: bool = False) -> Any:
        """(1, 3, H, W) float32 tensor with 0 -> value_range[0] and the top level -> value_range[1];
        with `alpha` (1, 4, H, W), the alpha channel last (opaque where the file has none)."""
        import torch

        lo, hi = value_range
        top = (1 << self.bits) - 1
        half = top / (hi - lo)
        pixels = self.pixels
        if alpha:
            a = self.alpha if self.alpha is not None else np.full(pixels.shape[:2], top, pixels.dtype)
            pixels = np.concatenate([pixels, a[..., None]], axis=2)
        x = torch.from_numpy(pixels.astype(np.float32)).permute(2, 0, 1)[None]
        return x / half + lo


def read_image(path: str | os.PathLike, what: str = "image", alpha: bool = False) -> Picture:
    """An input image at its depth (see the module docstring); BadInputFile naming `path` otherwise.
    `alpha`: the caller uses the alpha channel (`Picture.tensor(alpha=True)`): no warning about it."""
    p, shown, head, png = _open(path, what)
    if png is not None and png[2] == 16:
        _check_room(png[0], png[1], CHANNELS.get(png[3], 4), 2, shown)
        arr = read_png16(str(p))
        kind = {1: "grey", 2: "grey+alpha", 3: "RGB", 4: "RGBA"}[arr.shape[2]]
        return _picture(arr, 16, f"16-bit {kind} PNG", shown, alpha)
    if head[:4] in _TIFF_MAGIC:
        return _read_tiff(str(p), shown, alpha)
    return _read_pillow(str(p), shown, alpha)


def _open(path: str | os.PathLike, what: str) -> tuple[Any, str, bytes, tuple | None]:
    """(checked path, the path as given, its first 64 bytes, its PNG header or None)."""
    p = check_file(path, what)
    with open(p, "rb") as f:
        head = f.read(64)
    return p, os.fspath(path), head, png_header(head)


def _check_room(w: int, h: int, channels: int, itemsize: int, shown: str) -> None:
    """Refuse an image whose pixels and their float32 copy cannot fit (checked from the header)."""
    need = w * h * (channels * itemsize + 3 * 4)
    check_memory(need, f"image {shown!r} ({w}x{h}) with its float copy",
                 hint="crop or shrink it first")


def _picture(arr: np.ndarray, bits: int, kind: str, shown: str, used: bool = False) -> Picture:
    """Picture from (H, W, C) integer samples, C = 1 grey, 2 grey+alpha, 3 RGB, 4 RGBA (`used`: the
    caller uses the alpha)."""
    c = arr.shape[2]
    colour = arr[..., :3] if c >= 3 else np.repeat(arr[..., :1], 3, axis=2)
    alpha = arr[..., c - 1] if c in (2, 4) else None
    if alpha is not None and not used and int(alpha.min()) < (1 << bits) - 1:
        logger.warning("%s has transparent pixels: its alpha is not used, the colour channels are taken as "
                       "stored", shown)
    return Picture(np.ascontiguousarray(colour), bits, alpha, kind)


def _read_tiff(path: str, shown: str, alpha: bool = False) -> Picture:
    import tifffile

    try:
        with tifffile.TiffFile(path) as tif:
            series = tif.series[0]
            shape, axes, dtype = tuple(series.shape), series.axes, np.dtype(series.dtype)
            if dtype not in (np.uint8, np.uint16):
                raise BadInputFile(f"{shown!r} is a TIFF of {dtype} samples; tilewise reads 8- or 16-bit "
                                   "unsigned images (float and 32-bit TIFFs have no agreed range)")
            layouts = {"YX": (0, 1), "YXS": (0, 1), "SYX": (1, 2)}
            if axes not in layouts:
                raise BadInputFile(f"{shown!r} is a TIFF of shape {shape} (axes {axes}); tilewise reads one "
                                   "2D image (axes YX, YXS or SYX)")
            h, w = shape[layouts[axes][0]], shape[layouts[axes][1]]
            _check_room(w, h, 1 if axes == "YX" else shape[2 if axes == "YXS" else 0], dtype.itemsize, shown)
            arr = series.asarray()
    except BadInputFile:
        raise
    except (tifffile.TiffFileError, OSError, ValueError, KeyError, IndexError) as e:
        raise BadInputFile(f"{shown!r} is not a TIFF tilewise can read (corrupt or truncated?): {e}") from e
    arr = arr[:, :, None] if axes == "YX" else (np.moveaxis(arr, 0, 2) if axes == "SYX" else arr)
    if arr.shape[2] not in (1, 2, 3, 4):
        raise BadInputFile(f"{shown!r} is a TIFF with {arr.shape[2]} samples per pixel; tilewise reads 1 "
                           "(grey), 2 (grey+alpha), 3 (RGB) or 4 (RGBA)")
    bits = 8 * dtype.itemsize
    return _picture(arr, bits, f"{bits}-bit TIFF", shown, alpha)


@contextmanager
def _pillow(path: str, shown: str) -> Iterator[Any]:
    """A lazily opened Pillow image; Pillow's errors as BadInputFile naming the file. Pillow's
    decompression-bomb limit is lifted: the size is checked against memory instead."""
    from PIL import Image, UnidentifiedImageError

    old = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        with Image.open(path) as im:
            yield im
    except UnidentifiedImageError as e:
        raise BadInputFile(f"{shown!r} is not an image file tilewise can read (Pillow and tifffile do not "
                           "recognise it)") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        if isinstance(e, BadInputFile):
            raise
        raise BadInputFile(f"{shown!r} is truncated or corrupt: {e}") from e
    finally:
        Image.MAX_IMAGE_PIXELS = old


def check_image(path: str | os.PathLike, what: str = "image") -> tuple[int, int]:
    """(width, height) of an input image from its header (nothing decoded); BadInputFile otherwise."""
    p, shown, head, png = _open(path, what)
    if png is not None and png[2] == 16:
        return png[0], png[1]
    if head[:4] in _TIFF_MAGIC:
        import tifffile

        try:
            with tifffile.TiffFile(str(p)) as tif:
                page = tif.pages.first
                return int(page.imagewidth), int(page.imagelength)
        except (tifffile.TiffFileError, OSError, ValueError, KeyError, IndexError) as e:
            raise BadInputFile(f"{shown!r} is not a TIFF tilewise can read (corrupt or truncated?): "
                               f"{e}") from e
    with _pillow(str(p), shown) as im:
        return im.size


def _read_pillow(path: str, shown: str, alpha: bool = False) -> Picture:
    with _pillow(path, shown) as im:
        mode, fmt = im.mode, im.format or "image"
        _check_room(im.width, im.height, 4, 1 if mode not in _PIL_16 + ("I",) else 4, shown)
        im.load()
        arr = _pillow_array(im, mode, fmt, shown)
    bits = 16 if arr.dtype == np.uint16 else 8
    return _picture(arr, bits, f"{bits}-bit {mode} {fmt}", shown, alpha)


def _pillow_array(im: Any, mode: str, fmt: str, shown: str) -> np.ndarray:
    """(H, W, C) samples of an open Pillow image, at its depth."""
    if mode in _PIL_16:
        return np.asarray(im).astype(np.uint16)[:, :, None]
    if mode == "I":  # 32-bit integer: 16-bit data as some formats deliver it, else refused
        a = np.asarray(im)
        if a.size and (int(a.min()) < 0 or int(a.max()) > 65535):
            raise BadInputFile(f"{shown!r} is a 32-bit integer {fmt} with values in [{a.min()}, {a.max()}]; "
                               "tilewise reads 8- or 16-bit images")
        return a.astype(np.uint16)[:, :, None]
    if mode in _PIL_ALPHA or (mode == "P" and "transparency" in im.info):
        return np.asarray(im.convert("RGBA"))
    if mode in _PIL_RGB:
        return np.asarray(im.convert("RGB"))
    raise BadInputFile(f"{shown!r} is a {fmt} of mode {mode!r} (e.g. float samples); tilewise reads 8- or "
                       "16-bit grey, RGB and RGBA images")
