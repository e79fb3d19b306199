"""16-bit PNGs read at their depth (Pillow reads 16-bit colour PNGs as 8-bit RGB/RGBA, dropping a byte).

PNG spec sections 5 (chunks, CRC-32), 9 (filters) and 11.2.2 (IHDR). Filters none, sub and up (the one
tilewise's PNGSink writes) are undone per row with numpy; average and Paeth depend on the pixel to the
left, and are undone byte by byte in Python (seconds per megapixel). Interlaced (Adam7) files are refused.
"""

from __future__ import annotations

import zlib

import numpy as np

from ..errors import BadInputFile

SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}  # colour type -> samples per pixel (3, palette, is never 16-bit)


def png_header(data: bytes) -> tuple[int, int, int, int, int] | None:
    """(width, height, bit depth, colour type, interlace) from a PNG's first 33 bytes; None if not a PNG."""
    if len(data) < 33 or not data.startswith(SIGNATURE) or data[12:16] != b"IHDR":
        return None
    return (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big"), data[24], data[25],
            data[28])


def read_png16(path: str) -> np.ndarray:
    """A 16-bit PNG as (H, W, C) uint16; BadInputFile naming `path` when it is truncated or corrupt."""
    with open(path, "rb") as f:
        data = f.read()
    head = png_header(data)
    if head is None:
        raise BadInputFile(f"{path!r} is not a PNG file (no PNG signature and IHDR)")
    w, h, depth, colour, interlace = head
    if depth != 16 or colour not in CHANNELS:
        raise BadInputFile(f"{path!r}: read_png16 reads 16-bit grey/RGB(A) PNGs, this one has bit depth "
                           f"{depth}, colour type {colour}")
    if interlace:
        raise BadInputFile(f"{path!r} is an interlaced (Adam7) 16-bit PNG, which tilewise does not read: "
                           "save it without interlacing, or as a 16-bit TIFF")
    idat = _idat(data, path)
    c = CHANNELS[colour]
    stride = w * c * 2
    try:
        raw = zlib.decompress(idat)
    except zlib.error as e:
        raise BadInputFile(f"{path!r} is a corrupt PNG: its image data does not decompress ({e})") from e
    if len(raw) < h * (stride + 1):
        raise BadInputFile(f"{path!r} is truncated: {len(raw)} of {h * (stride + 1)} bytes of image data")
    rows = np.frombuffer(raw, np.uint8, h * (stride + 1)).reshape(h, stride + 1)
    out = np.empty((h, stride), np.uint8)
    prior = np.zeros(stride, np.uint8)
    bpp = c * 2
    for y in range(h):
        kind, line = rows[y, 0], rows[y, 1:]
        out[y] = _unfilter(kind, line, prior, bpp, path, y)
        prior = out[y]
    return out.view(">u2").reshape(h, w, c).astype(np.uint16)


def _idat(data: bytes, path: str) -> bytes:
    """The concatenated IDAT data, every chunk's CRC checked, IEND required."""
    pos, parts = len(SIGNATURE), []
    while True:
        if pos + 8 > len(data):
            raise BadInputFile(f"{path!r} is truncated: it ends before its IEND chunk")
        n = int.from_bytes(data[pos:pos + 4], "big")
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        crc = data[pos + 8 + n:pos + 12 + n]
        if len(body) < n or len(crc) < 4:
            raise BadInputFile(f"{path!r} is truncated: its {kind.decode('latin-1')} chunk is cut short")
        if zlib.crc32(body, zlib.crc32(kind)) & 0xFFFFFFFF != int.from_bytes(crc, "big"):
            raise BadInputFile(f"{path!r} is corrupt: the CRC of its {kind.decode('latin-1')} chunk at byte "
                               f"{pos} does not match")
        if kind == b"IDAT":
            parts.append(body)
        elif kind == b"IEND":
            return b"".join(parts)
        pos += 12 + n


def _unfilter(kind: int, line: np.ndarray, prior: np.ndarray, bpp: int, path: str, y: int) -> np.ndarray:
    """One scanline's bytes with its filter undone (PNG spec section 9.2)."""
    if kind == 0:
        return line
    if kind == 1:  # sub: running sum per byte position of the pixel, mod 256
        return np.cumsum(line.reshape(-1, bpp), axis=0, dtype=np.uint8).reshape(-1)
    if kind == 2:  # up
        return line + prior
    if kind not in (3, 4):
        raise BadInputFile(f"{path!r} is corrupt: row {y} has filter type {kind} (valid: 0..4)")
    cur, up = [int(v) for v in line], [int(v) for v in prior]
    for i in range(len(cur)):
        a = cur[i - bpp] if i >= bpp else 0
        b = up[i]
        if kind == 3:  # average
            cur[i] = (cur[i] + (a + b) // 2) & 0xFF
            continue
        c = up[i - bpp] if i >= bpp else 0  # Paeth predictor
        p = a + b - c
        pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
        cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
    return np.array(cur, np.uint8)
