"""Streaming sinks: round trips, coverage, atomicity, and bounded memory while writing big images."""

from __future__ import annotations

import os
import sys
import zlib

import numpy as np
import pytest
import tifffile
import torch
from PIL import Image

from tilewise.memory import peak_rss_subprocess
from tilewise.patterns import coordinate_pattern
from tilewise.sinks import (
    MemmapSink,
    PNGSink,
    TensorSink,
    TIFFSink,
    first_gap,
    open_sink,
    png_chunk,
    to_hwc_uint,
)

MiB = 1024**2
H, W = 37, 61  # odd, prime-ish, not a multiple of any tile or band used below


# --------------------------------------------------------------------------------------------------
# an independent streaming PNG decoder (PNG spec: chunks, CRC, zlib, filters 0-4), used as the oracle


def _paeth(a, b, c):
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else (b if pb <= pc else c)


def _unfilter(kind, line, prev, bpp):
    if kind == 0:
        return line
    if kind == 2:
        return line + prev  # uint8 arithmetic wraps mod 256
    if kind == 1:  # Sub: running sum over pixels, per byte position within the pixel
        return np.cumsum(line.reshape(-1, bpp), axis=0, dtype=np.uint8).reshape(-1)
    out = np.zeros_like(line)
    raw, up = [int(v) for v in line], [int(v) for v in prev]
    for i in range(len(raw)):
        a = int(out[i - bpp]) if i >= bpp else 0
        c = up[i - bpp] if i >= bpp else 0
        pred = (a + up[i]) // 2 if kind == 3 else _paeth(a, up[i], c)
        out[i] = (raw[i] + pred) & 0xFF
    return out


def iter_png_rows(path):
    """Yield (y, row) with row an (W, C) array, decoding the file chunk by chunk with bounded memory."""
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        inflate, pending, prev, y = zlib.decompressobj(), bytearray(), None, 0
        while True:
            n = int.from_bytes(f.read(4), "big")
            kind, data = f.read(4), f.read(n)
            assert int.from_bytes(f.read(4), "big") == zlib.crc32(kind + data), f"bad CRC in {kind}"
            if kind == b"IHDR":
                width, height = int.from_bytes(data[:4], "big"), int.from_bytes(data[4:8], "big")
                bits, channels = data[8], {0: 1, 4: 2, 2: 3, 6: 4}[data[9]]
                assert data[10:] == b"\0\0\0"  # deflate, adaptive filters, no interlace
                bpp = channels * bits // 8
                stride = width * bpp
                prev = np.zeros(stride, np.uint8)
            elif kind == b"IDAT":
                pending += inflate.decompress(data)
                while len(pending) >= stride + 1:
                    line = np.frombuffer(bytes(pending[1:stride + 1]), np.uint8)
                    prev = _unfilter(pending[0], line, prev, bpp)
                    del pending[:stride + 1]
                    row = prev.view(">u2").astype(np.uint16) if bits == 16 else prev.copy()
                    yield y, row.reshape(width, channels)
                    y += 1
            elif kind == b"IEND":
                assert y == height and not pending and inflate.eof, (y, height, len(pending))
                return


def read_png(path):
    return np.stack([row for _, row in iter_png_rows(path)])


def read_tiff_box(path, box):
    """Pixels of box from a tiled TIFF, decoding only the tiles that intersect it."""
    y0, y1, x0, x1 = box
    with tifffile.TiffFile(path) as tif:
        page = tif.pages[0]
        th, tw = page.tilelength, page.tilewidth
        cols = -(-page.imagewidth // tw)
        out = np.zeros((y1 - y0, x1 - x0, page.samplesperpixel), page.dtype)
        for ty in range(y0 // th, -(-y1 // th)):
            for tx in range(x0 // tw, -(-x1 // tw)):
                index = ty * cols + tx
                tif.filehandle.seek(page.dataoffsets[index])
                segment, _, _ = page.decode(tif.filehandle.read(page.databytecounts[index]), index)
                segment = segment.reshape(th, tw, -1)
                ya, yb = max(y0, ty * th), min(y1, (ty + 1) * th)
                xa, xb = max(x0, tx * tw), min(x1, (tx + 1) * tw)
                part = segment[ya - ty * th:yb - ty * th, xa - tx * tw:xb - tx * tw]
                out[ya - y0:yb - y0, xa - x0:xb - x0] = part
        return out


def test_png_oracle_decodes_pillow_files(tmp_path):
    """The test decoder itself reproduces what Pillow encodes (Pillow picks filters, incl. Paeth)."""
    rng = np.random.default_rng(0)
    smooth = np.add.outer(np.arange(23), np.arange(31))[:, :, None] * np.array([1, 3, 5])
    for img in [(smooth % 256).astype(np.uint8), rng.integers(0, 256, (23, 31, 3), dtype=np.uint8)]:
        Image.fromarray(img).save(tmp_path / "p.png", optimize=True)
        assert np.array_equal(read_png(tmp_path / "p.png"), img)
    gray16 = (rng.integers(0, 65536, (9, 13))).astype(np.uint16)
    Image.fromarray(gray16).save(tmp_path / "g.png")
    assert np.array_equal(read_png(tmp_path / "g.png")[:, :, 0], gray16)


# --------------------------------------------------------------------------------------------------
# round trips


def _tiles(h, w, th, tw, order="row"):
    boxes = [(y, min(y + th, h), x, min(x + tw, w)) for y in range(0, h, th) for x in range(0, w, tw)]
    if order == "reverse-cols":  # tile rows in order, columns right to left
        boxes.sort(key=lambda b: (b[0], -b[2]))
    elif order == "shuffled":
        rng = np.random.default_rng(1)
        boxes = [boxes[i] for i in rng.permutation(len(boxes))]
    return boxes


def _write_boxes(sink, image, boxes):
    with sink:
        for y0, y1, x0, x1 in boxes:
            sink.write(y0, x0, image[y0:y1, x0:x1])


@pytest.mark.parametrize("channels", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", ["uint8", "uint16"])
@pytest.mark.parametrize("png_filter", ["none", "sub", "up"])
def test_png_round_trip(tmp_path, channels, dtype, png_filter):
    image = coordinate_pattern((0, H, 0, W), channels, dtype)
    path = tmp_path / "out.png"
    sink = PNGSink(path, H, W, channels, dtype, band_rows=4, png_filter=png_filter, idat_bytes=97)
    _write_boxes(sink, image, _tiles(H, W, 10, 16, "reverse-cols"))
    assert np.array_equal(read_png(path), image)
    if channels == 1 or dtype == "uint8":  # Pillow reads these modes losslessly: a second oracle
        pil = np.asarray(Image.open(path))
        assert np.array_equal(pil.reshape(image.shape).astype(dtype), image)
    assert os.listdir(tmp_path) == ["out.png"]


def test_png_full_width_bands_flush_and_chunk(tmp_path):
    image = coordinate_pattern((0, 100, 0, 9), 3, "uint8")
    sink = PNGSink(tmp_path / "b.png", 100, 9, 3, band_rows=8, compress_level=0, idat_bytes=64)
    with sink:
        for y in range(0, 100, 3):
            sink.write(y, 0, image[y:y + 3])
            assert len(sink._buffer.rows) <= 8 + 3  # never more than one band (+ the block) buffered
    assert np.array_equal(read_png(tmp_path / "b.png"), image)


def test_png_rejects_rows_already_flushed(tmp_path):
    image = coordinate_pattern((0, 20, 0, 8), 1, "uint8")
    with pytest.raises(ValueError, match="already flushed"), PNGSink(tmp_path / "x.png", 20, 8, 1,
                                                                     band_rows=4) as sink:
        sink.write(0, 0, image[:8])
        sink.write(6, 0, image[6:10])
    assert os.listdir(tmp_path) == []


def test_png_chunk_crc():
    assert png_chunk(b"IEND", b"") == bytes.fromhex("0000000049454e44ae426082")


@pytest.mark.parametrize("channels", [1, 3, 4])
@pytest.mark.parametrize("dtype", ["uint8", "uint16", "float32"])
@pytest.mark.parametrize("order", ["row", "reverse-cols"])
def test_tiff_round_trip(tmp_path, channels, dtype, order):
    image = coordinate_pattern((0, H, 0, W), channels, dtype)
    path = tmp_path / "out.tif"
    _write_boxes(TIFFSink(path, H, W, channels, dtype, tile=16), image, _tiles(H, W, 16, 16, order))
    with tifffile.TiffFile(path) as tif:
        page = tif.pages[0]
        assert tif.is_bigtiff and page.is_tiled and (page.tilelength, page.tilewidth) == (16, 16)
        back = page.asarray()
    assert np.array_equal(back.reshape(image.shape), image)
    assert np.array_equal(read_tiff_box(path, (5, 33, 17, 60)).reshape(28, 43, channels), image[5:33, 17:60])
    assert os.listdir(tmp_path) == ["out.tif"]


def test_tiff_blocks_spanning_tile_rows_and_compression(tmp_path):
    """Blocks not aligned to TIFF tiles (other tile size, out of order inside the buffered rows)."""
    image = coordinate_pattern((0, H, 0, W), 3, "uint16")
    boxes = _tiles(H, W, 20, 13, "reverse-cols")
    _write_boxes(TIFFSink(tmp_path / "z.tif", H, W, 3, "uint16", tile=(16, 32), compression="zlib"), image,
                 boxes)
    assert np.array_equal(tifffile.imread(tmp_path / "z.tif"), image)


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "float32"])
def test_memmap_round_trip_shuffled(tmp_path, dtype):
    image = coordinate_pattern((0, H, 0, W), 3, dtype)
    path = tmp_path / "out.npy"
    _write_boxes(MemmapSink(path, H, W, 3, dtype), image, _tiles(H, W, 7, 9, "shuffled"))
    back = np.load(path)
    assert back.dtype == dtype and np.array_equal(back, image)
    assert os.listdir(tmp_path) == ["out.npy"]


def test_tensor_sink_float_exact_and_quantized():
    x = torch.rand(1, 3, H, W, generator=torch.Generator().manual_seed(0)) * 2 - 1
    sink = TensorSink(None, H, W, 3, torch.float32)
    with sink:
        for y0, y1, x0, x1 in _tiles(H, W, 8, 8, "shuffled"):
            sink.write(y0, x0, x[:, :, y0:y1, x0:x1])
    assert torch.equal(sink.result(), x[0])
    q = TensorSink(None, H, W, 3, "uint8")
    with q:
        q.write(0, 0, x[0, :, :20])
        q.write(20, 0, to_hwc_uint(x[0, :, 20:], 8))  # numpy pixels from the helper
    assert q.result().dtype == torch.uint8
    expected = torch.round((x[0] + 1) * 127.5).clamp(0, 255).to(torch.uint8)
    assert torch.equal(q.result(), expected)


def test_tensor_sink_bfloat16_from_numpy():
    sink = TensorSink(None, 2, 3, 1, "bfloat16")
    with sink:
        sink.write(0, 0, np.full((2, 3), 0.5, np.float32))
    assert sink.result().dtype == torch.bfloat16 and torch.all(sink.result() == 0.5)


def test_to_hwc_uint_closed_form():
    x = torch.tensor([[-1.0, 0.0, 1.0, 0.5, -2.0, 3.0]])
    assert to_hwc_uint(x, 8)[0, :, 0].tolist() == [0, 128, 255, 191, 0, 255]
    assert to_hwc_uint(x.numpy(), 8)[0, :, 0].tolist() == [0, 128, 255, 191, 0, 255]
    assert to_hwc_uint(x, 16, value_range=(0, 1))[0, :, 0].tolist() == [0, 0, 65535, 32768, 0, 65535]
    chw = torch.linspace(0, 1, 24).reshape(1, 2, 3, 4)
    out = to_hwc_uint(chw, 8, (0, 1))
    assert out.shape == (3, 4, 2) and out.dtype == np.uint8
    assert np.array_equal(out, np.rint(chw[0].permute(1, 2, 0).numpy() * 255).astype(np.uint8))
    with pytest.raises(ValueError, match="NaN"):
        to_hwc_uint(torch.tensor([[float("nan")]]))
    with pytest.raises(ValueError, match="bits"):
        to_hwc_uint(x, 12)


@pytest.mark.parametrize("kind", ["png", "tif", "npy"])
def test_torch_images_quantized_by_file_sinks(tmp_path, kind):
    x = torch.linspace(-1, 1, 3 * 5 * 7).reshape(1, 3, 5, 7)
    path = tmp_path / f"t.{kind}"
    with open_sink(path, 5, 7, 3, bits=16) as sink:
        sink.write(0, 0, x[:, :, :, :4])
        sink.write(0, 4, x[0, :, :, 4:])
    back = {"png": read_png, "tif": tifffile.imread, "npy": np.load}[kind](path)
    assert np.array_equal(back, to_hwc_uint(x, 16))


# --------------------------------------------------------------------------------------------------
# coverage, validation and atomicity


def test_first_gap():
    assert first_gap(4, 6, [(0, 4, 0, 3), (0, 2, 3, 6), (2, 4, 3, 6)]) is None
    assert first_gap(4, 6, [(0, 4, 0, 3), (0, 2, 3, 6)]) == (2, 4, 3, 6)
    assert first_gap(4, 6, [(0, 4, 0, 6), (1, 2, 1, 2)]) is None  # overlap is fine
    assert first_gap(4, 6, []) == (0, 4, 0, 6)


FILE_SINKS = [(PNGSink, "png"), (TIFFSink, "tif"), (MemmapSink, "npy")]


@pytest.mark.parametrize("cls, suffix", FILE_SINKS)
def test_exception_mid_write_leaves_no_file(tmp_path, cls, suffix):
    image = coordinate_pattern((0, 64, 0, 40), 3, "uint8")
    path = tmp_path / f"out.{suffix}"
    with pytest.raises(RuntimeError, match="boom"), cls(path, 64, 40, 3, "uint8") as sink:
        sink.write(0, 0, image[:32])
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("cls, suffix", FILE_SINKS)
def test_incomplete_write_raises_and_keeps_old_file(tmp_path, cls, suffix):
    path = tmp_path / f"out.{suffix}"
    path.write_bytes(b"previous content")
    image = coordinate_pattern((0, 40, 0, 40), 3, "uint8")
    with pytest.raises(ValueError, match=r"never written.*40x40"), cls(path, 40, 40, 3, "uint8") as sink:
        sink.write(0, 0, image[:40, :20])
        sink.write(0, 20, image[:17, 20:])
    assert os.listdir(tmp_path) == [f"out.{suffix}"]
    assert path.read_bytes() == b"previous content"


def test_tensor_sink_gap_raises():
    sink = TensorSink(None, 4, 4, 1)
    sink.write(0, 0, torch.zeros(1, 4, 2))
    with pytest.raises(ValueError, match=r"y 0..4, x 2..4"):
        sink.result()


def test_output_permissions_follow_umask(tmp_path):
    with PNGSink(tmp_path / "p.png", 1, 1, 1) as sink:
        sink.write(0, 0, np.zeros((1, 1), np.uint8))
    umask = os.umask(0o022)
    os.umask(umask)
    assert os.stat(tmp_path / "p.png").st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize(
    "make, block, match",
    [
        (lambda p: PNGSink(p / "a.png", 4, 4, 3), np.zeros((2, 2, 3), np.float32), "to_hwc_uint"),
        (lambda p: PNGSink(p / "a.png", 4, 4, 3), np.zeros((2, 2, 1), np.uint8), "1 channels"),
        (lambda p: MemmapSink(p / "a.npy", 4, 4, 3), np.zeros((2, 5, 3), np.uint8), "x0 \\+ w <= 4"),
        (lambda p: TIFFSink(p / "a.tif", 4, 4, 3), np.zeros((2, 2, 3, 1), np.uint8), "shape"),
        (lambda p: TensorSink(None, 4, 4, 3), torch.zeros(2, 3, 2, 2), "N == 1"),
    ],
)
def test_bad_blocks_raise_with_values(tmp_path, make, block, match):
    sink = make(tmp_path)
    with pytest.raises(ValueError, match=match):
        sink.write(0, 0, block)
    sink.abort()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: PNGSink(p / "a.png", 4, 4, 5), "RGBA"),
        (lambda p: PNGSink(p / "a.png", 4, 4, 3, "float32"), "float32"),
        (lambda p: PNGSink(p / "a.png", 0, 4, 3), "height must be a positive int, got 0"),
        (lambda p: PNGSink(p / "a.png", 4, 4, 3, png_filter="paeth"), "paeth"),
        (lambda p: TIFFSink(p / "a.tif", 4, 4, 3, tile=24), "multiples of 16"),
        (lambda p: TensorSink(p / "a.pt", 4, 4, 3), "path must be None"),
        (lambda p: MemmapSink(None, 4, 4, 3), "give a path"),
        (lambda p: open_sink(p / "a.jpg", 4, 4), r"\.jpg.*\['.npy', '.png', '.tif', '.tiff'\]"),
        (lambda p: open_sink(p / "a.png", 4, 4, bits=32), "8 or 16"),
    ],
)
def test_bad_construction_raises(tmp_path, make, match):
    with pytest.raises(ValueError, match=match):
        make(tmp_path)
    assert os.listdir(tmp_path) == []


def test_open_sink_picks_by_suffix(tmp_path):
    for name, cls in [("a.png", PNGSink), ("a.TIF", TIFFSink), ("a.tiff", TIFFSink), ("a.npy", MemmapSink)]:
        sink = open_sink(tmp_path / name, 2, 2, 1, bits=16)
        assert type(sink) is cls and sink.dtype == "uint16"
        sink.abort()
    assert os.listdir(tmp_path) == []


def test_import_sinks_does_not_import_torch():
    import subprocess

    code = "import sys, tilewise.sinks; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------------------------------
# big images, band by band, in a subprocess whose peak resident memory is measured

_SETUP = """
import numpy, tifffile
from tilewise.sinks import open_sink
from tilewise.patterns import coordinate_pattern
"""
_WRITE = """
with open_sink(path, side, side, 3, bits=8, **options) as sink:
    for y in range(0, side, band):
        sink.write(y, 0, coordinate_pattern((y, min(y + band, side), 0, side), 3, 'uint8'))
result = sink.path
"""


def _write_in_subprocess(path, side, band, **options):
    code = f"path, side, band, options = {str(path)!r}, {side}, {band}, {options!r}\n{_WRITE}"
    return peak_rss_subprocess(code=code, setup=_SETUP, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _check_png_streamed(path, side, sample_rows=None):
    """Decode row by row; compare the rows in sample_rows (all rows when None) with the pattern."""
    for y, row in iter_png_rows(path):
        if sample_rows is None or y in sample_rows:
            assert np.array_equal(row, coordinate_pattern((y, y + 1, 0, side), 3, "uint8")[0]), y


def _sample_boxes(side, rng, n=12, size=300):
    corners = [(0, size, 0, size), (side - size, side, side - size, side),
               (side // 2 - 7, side // 2 + 9, 0, side)]
    starts = rng.integers(0, side - size, (n, 2))
    return corners + [(int(y), int(y) + size, int(x), int(x) + size) for y, x in starts]


def _big_image_case(tmp_path, side, band, png_options, tif_options, limit, every_row=False):
    rng = np.random.default_rng(side)
    image_bytes = side * side * 3
    png = _write_in_subprocess(tmp_path / "big.png", side, band, **png_options)
    tif = _write_in_subprocess(tmp_path / "big.tif", side, band, **tif_options)
    for run in (png, tif):
        assert run.peak_bytes < limit, f"peak RSS {run.peak_bytes / MiB:.0f} MiB"
        # what writing added on top of the imports stays far below the image itself
        assert run.growth_bytes < min(image_bytes / 4, 160 * MiB), f"growth {run.growth_bytes / MiB:.1f} MiB"
        print(f"{side}x{side}: peak {run.peak_bytes / MiB:.1f} MiB, growth {run.growth_bytes / MiB:.1f} MiB, "
              f"{run.wall_s:.2f} s")
    assert sorted(os.listdir(tmp_path)) == ["big.png", "big.tif"]
    sample_rows = {0, side - 1} | {int(v) for v in rng.integers(0, side, 64)}
    _check_png_streamed(tmp_path / "big.png", side, None if every_row else sample_rows)
    for box in _sample_boxes(side, rng):
        expected = coordinate_pattern(box, 3, "uint8")
        assert np.array_equal(read_tiff_box(tmp_path / "big.tif", box), expected), box
    return png, tif


def test_big_image_band_by_band_bounded_memory_fast(tmp_path):
    """The issue's memory test at 4096 x 4096 (48 MiB image): both files exact, writer peak < 300 MiB."""
    side = 4096
    png, tif = _big_image_case(tmp_path, side, 16, {"band_rows": 64, "compress_level": 1},
                               {"tile": 128}, 300 * MiB, every_row=True)
    assert np.array_equal(tifffile.imread(tmp_path / "big.tif"), coordinate_pattern((0, side, 0, side), 3,
                                                                                     "uint8"))


@pytest.mark.slow
def test_big_image_16k_band_by_band_bounded_memory(tmp_path):
    """The issue's test: 16384 x 16384 RGB (768 MiB of pixels) as PNG and TIFF, writer peak RSS < 300 MiB."""
    png, tif = _big_image_case(tmp_path, 16384, 16, {"band_rows": 64, "compress_level": 1}, {"tile": 256},
                               300 * MiB)
    print(f"16k PNG: peak {png.peak_bytes / MiB:.0f} MiB, {png.wall_s:.1f} s; "
          f"TIFF: peak {tif.peak_bytes / MiB:.0f} MiB, {tif.wall_s:.1f} s")


def test_tiff_writer_errors_surface_with_their_type(tmp_path):
    image = coordinate_pattern((0, 32, 0, 32), 3, "uint8")
    with pytest.raises(ValueError, match="(?i)bogus"), TIFFSink(tmp_path / "e.tif", 32, 32, 3,
                                                                compression="bogus") as sink:
        sink.write(0, 0, image[:16])
        sink.write(16, 0, image[16:])
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tensor_sink_on_cuda_takes_cpu_and_cuda_blocks():
    x = torch.rand(3, 9, 10, generator=torch.Generator().manual_seed(0))
    sink = TensorSink(None, 9, 10, 3, "float32", device="cuda")
    with sink:
        sink.write(0, 0, x[:, :5].cuda())
        sink.write(5, 0, x[:, 5:].permute(1, 2, 0).numpy())
    assert sink.result().device.type == "cuda" and torch.equal(sink.result().cpu(), x)


def test_integer_torch_blocks_need_the_sink_dtype(tmp_path):
    pixels = torch.arange(2 * 3 * 4, dtype=torch.uint8).reshape(2, 3, 4)  # (C, h, w) pixel values
    with PNGSink(tmp_path / "i.png", 3, 4, 2) as sink:
        sink.write(0, 0, pixels)
    assert np.array_equal(read_png(tmp_path / "i.png"), pixels.permute(1, 2, 0).numpy())
    with pytest.raises(ValueError, match="torch.int64"), TensorSink(None, 3, 4, 2, "uint8") as sink:
        sink.write(0, 0, pixels.long())
