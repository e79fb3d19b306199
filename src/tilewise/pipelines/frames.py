"""Reading a video (or an image as one frame) for an encode: what the video sinks write, read back.

- a frame pattern with a {} field (``"frames/f{:04d}.png"``): frames 0, 1, ... until the first missing;
- a ``.npy``: (T, H, W, C) frames, or one (H, W, C) image;
- a ``.tif`` / ``.tiff``: one page per frame (a multi-page stack), or one page: an image;
- any other image file (PNG, JPEG, ...): one frame, converted to RGB.

uint8 / uint16 pixels map to [-1, 1]; float pixels are taken as they are, in [-1, 1] (what the float32
sinks write of a decode).

numpy, tifffile, PIL and torch are imported inside the functions that use them, so that `import
tilewise.pipelines` imports no torch, diffusers or numpy: the CLI's commands import it before they check their
arguments, and a bad argument fails before ~4 s of torch and diffusers imports.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import BadInputFile, BadRequest
from ..limits import check_memory


def _frames_of(path: str):
    """(T, H, W, C) numpy frames of `path` (memory-mapped for a .npy)."""
    import numpy as np

    if "{" in path:
        paths = []
        while os.path.exists(path.format(len(paths))):
            paths.append(path.format(len(paths)))
        if not paths:
            raise BadRequest(f"no frames match {path!r}: its first frame {path.format(0)!r} does not exist")
        return np.stack([_frames_of(p)[0] for p in paths])
    if not os.path.exists(path):
        raise BadRequest(f"{path!r} does not exist: give an image, a frame pattern such as "
                         f"'frames/f{{:04d}}.png', a .npy or a .tif stack")
    suffix = Path(path).suffix.lower()
    if suffix == ".npy":
        a = np.load(path, mmap_mode="r")
        return a[None] if a.ndim == 3 else a
    if suffix in (".tif", ".tiff"):
        import tifffile

        with tifffile.TiffFile(path) as tif:
            pages = [page.asarray() for page in tif.pages]
        return np.stack([p[..., None] if p.ndim == 2 else p for p in pages])
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))[None]


def load_video(path: str | os.PathLike, multiple: int = 8, channels: int = 3):
    """A video (or one image) as a (1, C, T, H, W) float tensor in [-1, 1]; sides multiples of `multiple`."""
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
    if a.dtype == np.uint8:  # (np.array: a writable copy, also of a read-only memmap)
        x = torch.from_numpy(np.array(a, dtype=np.float32)) / 127.5 - 1
    elif a.dtype == np.uint16:
        x = torch.from_numpy(np.array(a, dtype=np.float32)) / 32767.5 - 1
    elif np.issubdtype(a.dtype, np.floating):
        x = torch.from_numpy(np.array(a, dtype=np.float32))
    else:
        raise BadInputFile(f"{path!r} holds {a.dtype} pixels: use uint8, uint16 or float frames in [-1, 1]")
    return x.permute(3, 0, 1, 2)[None]
