"""Reading a video (or an image as one frame) for an encode: what the video sinks write, read back.

- a frame pattern with a {} field (``"frames/f{:04d}.png"``): frames 0, 1, ... until the first missing;
  a later frame after the missing one (a gap), frames of different sizes or depths are refused;
- a ``.npy``: (T, H, W, C) frames, or one (H, W, C) image;
- a ``.tif`` / ``.tiff``: one page per frame (a multi-page stack) of one size, or one page: an image;
- any other image file (PNG, JPEG, ...): one frame; image frames are read at their depth
  (`tilewise.sources.read_image`: 8- or 16-bit, grey replicated to RGB, alpha not used).

uint8 / uint16 pixels map to [-1, 1]; float pixels are taken as they are and must lie in [-1, 1] (what the
float32 sinks write of a decode, which may overshoot either end by a little: up to `OVERSHOOT`, taken with
a warning); values further outside, NaN or inf are refused naming the file. Every refusal
is a `BadInputFile` (or `BadRequest` for a path that is not there) naming the file; `check_video` makes
the checks that need no pixels (names, gaps, headers, sizes) before a model is loaded.

numpy, tifffile, PIL and torch are imported inside the functions that use them, so that `import
tilewise.pipelines` imports no torch, diffusers or numpy: the CLI's commands import it before they check their
arguments, and a bad argument fails before ~4 s of torch and diffusers imports.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from ..errors import BadInputFile, BadRequest
from ..limits import check_memory

logger = logging.getLogger(__name__)


def frame_files(pattern: str) -> list[str]:
    """The files of a frame pattern: frames 0, 1, ... up to the first missing one; BadRequest when the
    first is not there, BadInputFile when a later frame is (a gap in the sequence)."""
    try:
        first = pattern.format(0)
    except (IndexError, KeyError, ValueError) as e:
        raise BadRequest(f"{pattern!r} is not a frame pattern with one {{}} field ({e}); e.g. "
                         "'frames/f{:04d}.png'") from None
    if not os.path.exists(first):
        raise BadRequest(f"no frames match {pattern!r}: its first frame {first!r} does not exist")
    paths = []
    while os.path.exists(pattern.format(len(paths))):
        paths.append(pattern.format(len(paths)))
    later = _later_frame(pattern, len(paths))
    if later is not None:
        raise BadInputFile(f"frame pattern {pattern!r} has a gap: frames 0..{len(paths) - 1} are there, "
                           f"{pattern.format(len(paths))!r} is missing, but {later!r} exists; number the "
                           "frames without gaps (or move the later ones away)")
    return paths


def _later_frame(pattern: str, missing: int) -> str | None:
    """A file of the pattern's folder that is the pattern's frame t for some t > missing, or None (the
    numbers in the folder's file names are tried: names are finite, frame numbers are not)."""
    folder = os.path.dirname(pattern.format(missing)) or "."
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    for name in sorted(names):
        for digits in set(re.findall(r"\d+", name)):
            t = int(digits)
            if t > missing and os.path.basename(pattern.format(t)) == name:
                return os.path.join(os.path.dirname(pattern.format(t)), name)
    return None


def check_video(path: str | os.PathLike) -> tuple[int, int, int]:
    """(frames, height, width) of a video to encode, from names and headers only (no pixels decoded):
    the checks of `load_video` that can come before a model loads."""
    from ..sources import check_image  # (lazy: numpy, see the module docstring)
    from ..sources.files import check_file

    path = os.fspath(path)
    if "{" in path:
        paths = frame_files(path)
        sizes = [check_image(p, "frame") for p in paths]
        _same_size(paths, [(h, w) for w, h in sizes])
        return len(paths), sizes[0][1], sizes[0][0]
    if not os.path.exists(path):
        raise BadRequest(f"{path!r} does not exist: give an image, a frame pattern such as "
                         f"'frames/f{{:04d}}.png', a .npy or a .tif stack")
    check_file(path, "video")
    suffix = Path(path).suffix.lower()
    if suffix == ".npy":
        a = _npy(path)
        return (1, *a.shape[:2]) if a.ndim == 3 else (a.shape[0], *a.shape[1:3])
    if suffix in (".tif", ".tiff"):
        shapes = _tiff_pages(path, headers=True)
        return len(shapes), shapes[0][0], shapes[0][1]
    w, h = check_image(path)
    return 1, h, w


def _same_size(paths: list[str], sizes: list[tuple[int, ...]]) -> None:
    """Refuse frames whose (height, width, ...) differ from the first frame's, naming the first that does."""
    for p, s in zip(paths, sizes, strict=True):
        if s[:2] != sizes[0][:2]:
            raise BadInputFile(f"frame {p!r} is {s[1]}x{s[0]} but frame {paths[0]!r} is "
                               f"{sizes[0][1]}x{sizes[0][0]}: every frame of a video has one size")


def _npy(path: str):
    """A .npy memory-mapped (header read, nothing else); BadInputFile when it is not one."""
    import numpy as np

    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise BadInputFile(f"{path!r} is not a readable .npy file (truncated or corrupt?): {e}") from None


def _tiff_pages(path: str, headers: bool = False):
    """A TIFF stack's pages: their (H, W, ...) shapes (headers) or their (H, W, C) arrays; one size."""
    import tifffile

    try:
        with tifffile.TiffFile(path) as tif:
            pages = [tuple(page.shape) if headers else page.asarray() for page in tif.pages]
    except (tifffile.TiffFileError, OSError, ValueError, KeyError, IndexError) as e:
        raise BadInputFile(f"{path!r} is not a TIFF tilewise can read (corrupt or truncated?): {e}") from None
    if not pages:
        raise BadInputFile(f"{path!r} is a TIFF with no pages (corrupt or truncated?)")
    shapes = pages if headers else [p.shape for p in pages]
    names = [f"{path} page {i}" for i in range(len(shapes))]
    _same_size(names, shapes)
    return pages if headers else [p[..., None] if p.ndim == 2 else p for p in pages]


def _frames_of(path: str):
    """(T, H, W, C) numpy frames of `path` (memory-mapped for a .npy)."""
    import numpy as np

    from ..sources import read_image

    if "{" in path:
        paths = frame_files(path)
        pictures = [read_image(p, "frame") for p in paths]
        _same_size(paths, [pic.pixels.shape for pic in pictures])
        bits = {pic.bits for pic in pictures}
        if len(bits) > 1:
            odd = next(p for p, pic in zip(paths, pictures, strict=True) if pic.bits != pictures[0].bits)
            raise BadInputFile(f"frame {odd!r} has another depth than frame {paths[0]!r} ({sorted(bits)} "
                               "bits): every frame of a video has one")
        return np.stack([pic.pixels for pic in pictures])
    check_video(path)
    suffix = Path(path).suffix.lower()
    if suffix == ".npy":
        a = _npy(path)
        return a[None] if a.ndim == 3 else a
    if suffix in (".tif", ".tiff"):
        return np.stack(_tiff_pages(path))
    return read_image(path).pixels[None]


def load_video(path: str | os.PathLike, multiple: int = 8, channels: int = 3, scale: str = "max"):
    """A video (or one image) as a (1, C, T, H, W) float tensor in [-1, 1]; sides multiples of `multiple`.
    Integer pixels p: p / (max / 2) - 1 (`scale` "max", VideoProcessor's), or p / 2^(bits - 1) - 1
    ("levels": Kandinsky 6 SR's pipeline, `video_latents.pixel_scale`); float frames as they are."""
    if scale not in ("max", "levels"):
        raise ValueError(f"scale must be 'max' or 'levels', got {scale!r}")
    import numpy as np
    import torch

    path = os.fspath(path)
    a = _frames_of(path)
    if a.ndim != 4 or a.shape[3] != channels:
        raise BadInputFile(f"{path!r} holds frames of shape {a.shape[1:]}; the VAE encodes (H, W, "
                           f"{channels}) frames")
    t, h, w, _ = a.shape
    if h % multiple or w % multiple:
        raise BadInputFile(f"{path!r} is {w}x{h}; both sides must be multiples of {multiple} to encode "
                           f"(crop to {w - w % multiple or multiple}x{h - h % multiple or multiple} or pad)")
    check_memory(2 * a.size * 4, f"video {path!r} ({t} frames of {w}x{h}) as float32")
    if a.dtype in (np.uint8, np.uint16):  # (np.array: a writable copy, also of a read-only memmap)
        bits = 8 if a.dtype == np.uint8 else 16
        half = ((1 << bits) - 1) / 2 if scale == "max" else float(1 << (bits - 1))
        x = torch.from_numpy(np.array(a, dtype=np.float32)) / half - 1
    elif np.issubdtype(a.dtype, np.floating):
        x = torch.from_numpy(np.array(a, dtype=np.float32))
        _check_float_range(x, path)
    else:
        raise BadInputFile(f"{path!r} holds {a.dtype} pixels: use uint8, uint16 or float frames in [-1, 1]")
    return x.permute(3, 0, 1, 2)[None]


OVERSHOOT = 0.25  # how far outside [-1, 1] a float frame may reach: a VAE decode's float output does


def _check_float_range(x, path: str) -> None:
    """Float frames lie in [-1, 1] (the VAE's range), finite; a decode's overshoot (up to OVERSHOOT past
    either end) is taken as it is with a warning; anything else is a BadInputFile with what was found."""
    import torch

    finite = torch.isfinite(x)
    if not bool(finite.all()):
        raise BadInputFile(f"{path!r} holds {int((~finite).sum())} NaN or inf pixel values; float frames "
                           "are finite values in [-1, 1]")
    lo, hi = float(x.min()), float(x.max())
    if lo >= -1 and hi <= 1:
        return
    if lo < -1 - OVERSHOOT or hi > 1 + OVERSHOOT:
        raise BadInputFile(f"{path!r} holds float pixels in [{lo:.4g}, {hi:.4g}]; float frames are read as "
                           f"they are and must lie in [-1, 1] (a decode's float output may pass either end "
                           f"by up to {OVERSHOOT}): rescale them, or store uint8 / uint16 pixels")
    logger.warning("%s holds float pixels in [%.4g, %.4g], past [-1, 1] by at most %g (a decode's "
                   "overshoot): taken as they are", path, lo, hi, OVERSHOOT)
