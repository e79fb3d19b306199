"""A latents .safetensors checked before decoding: readable header, the tensor, its shape, dtype, values.

torch is imported inside `_check_values`: `import tilewise.sources`, which the CLI's input checks run, imports
no torch (~2 s).
"""

from __future__ import annotations

import math
import os
from typing import Any

from safetensors import safe_open

from ..errors import BadInputFile
from ..limits import check_memory
from .files import check_file

_FLOATS = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
_ITEMSIZE = {**_FLOATS, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1, "I16": 2, "U16": 2,
             "I32": 4, "U32": 4, "I64": 8, "U64": 8}


def check_latents(path: str | os.PathLike, key: str = "latents", channels: int | None = None,
                  video: bool = False) -> tuple:
    """The shape of tensor `key` of a .safetensors file, its header, dtype and shape checked (no data
    read); BadInputFile naming the file otherwise. video=True: one video's latents, (C, T, h, w) or
    (1, C, T, h, w), as the 3-D VAEs decode them."""
    return _read(path, key, channels, load=False, video=video)[0]


def read_latents(path: str | os.PathLike, key: str = "latents", channels: int | None = None,
                 video: bool = False) -> Any:
    """The (1, C, h, w) float tensor `key` of a .safetensors file ((1, C, T, h, w) with video=True);
    BadInputFile naming the file when it is not a safetensors file, lacks the tensor, has another shape or
    dtype, or holds NaN / inf values."""
    z = _read(path, key, channels, load=True, video=video)[1]
    if z.ndim == (4 if video else 3):
        z = z[None]
    _check_values(z, os.fspath(path), key)
    return z


def _read(path: str | os.PathLike, key: str, channels: int | None, load: bool, video: bool) -> tuple:
    p = check_file(path, "latents file")
    shown = os.fspath(path)
    try:
        with safe_open(str(p), "pt") as f:
            keys = sorted(f.keys())
            if key not in keys:
                raise BadInputFile(f"{shown!r} has no {key!r} tensor (it holds {keys or 'no tensors'}); "
                                   f"tilewise decode reads the latents from a tensor named {key!r}")
            part = f.get_slice(key)
            shape, dtype = tuple(part.get_shape()), part.get_dtype()
            _check_layout(shown, key, shape, dtype, channels, video)
            if not load:
                return shape, None
            check_memory(math.prod(shape) * (_ITEMSIZE.get(dtype, 8) + 4), f"latents {key!r} of {shown!r}")
            return shape, f.get_tensor(key)
    except BadInputFile:
        raise
    except Exception as e:  # safetensors' own errors (SafetensorError, OSError) name neither file nor fix
        if type(e).__name__ in ("OutOfMemoryError", "WontFit") or isinstance(e, MemoryError):
            raise
        raise BadInputFile(f"{shown!r} is not a readable .safetensors file (truncated or corrupt?): "
                           f"{str(e).strip() or type(e).__name__}") from e


def _check_layout(shown: str, key: str, shape: tuple[int, ...], dtype: str, channels: int | None,
                  video: bool) -> None:
    if dtype not in _FLOATS:
        raise BadInputFile(f"{key!r} in {shown!r} is of dtype {dtype}; latents are floats (F16, BF16, F32, "
                           "F64)")
    rank = 4 if video else 3
    if len(shape) not in (rank, rank + 1) or (len(shape) == rank + 1 and shape[0] != 1):
        expected = ("one video's latents, (C, T, h, w) or (1, C, T, h, w) (T = 1 for an image)" if video
                    else "one latent, (C, h, w) or (1, C, h, w)")
        raise BadInputFile(f"{key!r} in {shown!r} has shape {list(shape)}; expected {expected}")
    if min(shape) < 1:
        raise BadInputFile(f"{key!r} in {shown!r} is empty: shape {list(shape)}")
    c = shape[-rank]
    if channels is not None and c != channels:
        # (a pipeline's frames-first (B, F, C, h, w) latents: CogVideoX's, SVD's; files hold (B, C, T, h, w))
        hint = (" (frames first, as CogVideoX's and SVD's pipelines hold them? the file holds (1, C, T, h, "
                "w): save latents.permute(0, 2, 1, 3, 4))" if video and shape[-3] == channels else "")
        raise BadInputFile(f"{key!r} in {shown!r} has {c} channels (shape {list(shape)}) but the model's "
                           f"VAE decodes {channels}-channel latents{hint}")


def _check_values(z: Any, shown: str, key: str) -> None:
    import torch

    bad = ~torch.isfinite(z)
    if bool(bad.any()):
        nan, inf = int(torch.isnan(z).sum()), int(torch.isinf(z).sum())
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise BadInputFile(f"{key!r} in {shown!r} holds {nan} NaN and {inf} inf values (the first at index "
                           f"{first}); the file's latents are broken, not the VAE")
