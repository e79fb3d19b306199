"""Crop, pad and resize for the three image kinds a bucket assignment accepts.

Kinds and layouts (sizes are always given here as (height, width)):

- ``PIL.Image.Image``: any mode PIL can crop, paste and resize;
- ``numpy.ndarray``: ``(H, W)`` or ``(H, W, C)`` (channels last, HWC);
- ``torch.Tensor``: ``(..., H, W)``, typically ``(N, C, H, W)`` or ``(C, H, W)`` (channels first).

Crop and pad never resample, so they are exact for every kind. Resizing uses PIL's own filters for PIL
images and ``torch.nn.functional.interpolate`` (``antialias=True``) for arrays and tensors, computed in
float32 and cast back (integer dtypes are rounded and clipped to their range).

PIL, numpy and torch (~2 s) are imported inside the functions that use them, so that `import tilewise.buckets`
imports none of them.
"""

from __future__ import annotations

from typing import Any

RESAMPLE = ("bilinear", "bicubic")


def _is_pil(image: Any) -> bool:
    """True for a PIL image, without importing PIL unless the object comes from it."""
    return type(image).__module__.startswith("PIL.")


def _is_numpy(image: Any) -> bool:
    """True for a numpy array."""
    return type(image).__module__ == "numpy" and hasattr(image, "ndim")


def _is_torch(image: Any) -> bool:
    """True for a torch tensor."""
    return type(image).__module__.startswith("torch") and hasattr(image, "ndim")


def kind(image: Any) -> str:
    """Name the image kind ('pil', 'numpy', 'torch'), or raise ValueError listing the accepted ones."""
    if _is_pil(image):
        return "pil"
    if _is_numpy(image):
        if image.ndim not in (2, 3):
            raise ValueError(f"numpy images must be (H, W) or (H, W, C), got shape {tuple(image.shape)}")
        return "numpy"
    if _is_torch(image):
        if image.ndim < 2:
            raise ValueError(f"torch images must be (..., H, W), got shape {tuple(image.shape)}")
        return "torch"
    raise ValueError(
        f"unsupported image type {type(image).__name__}: expected a PIL image, a numpy (H, W[, C]) array "
        "or a torch (..., C, H, W) tensor"
    )


def size(image: Any) -> tuple[int, int]:
    """(height, width) of an image of any accepted kind."""
    k = kind(image)
    if k == "pil":
        return image.size[1], image.size[0]
    if k == "numpy":
        return int(image.shape[0]), int(image.shape[1])
    return int(image.shape[-2]), int(image.shape[-1])


def crop(image: Any, box: tuple[int, int, int, int]) -> Any:
    """Cut the half-open box (y0, y1, x0, x1) out of the image; exact (no resampling)."""
    y0, y1, x0, x1 = box
    k = kind(image)
    if k == "pil":
        return image.crop((x0, y0, x1, y1))
    if k == "numpy":
        return image[y0:y1, x0:x1].copy()
    return image[..., y0:y1, x0:x1].clone()


def pad(image: Any, amounts: tuple[int, int, int, int], fill: float = 0) -> Any:
    """Pad by (top, bottom, left, right) pixels with a constant fill; exact (no resampling)."""
    top, bottom, left, right = amounts
    k = kind(image)
    h, w = size(image)
    if k == "pil":
        from PIL import Image

        bands = len(image.getbands())
        value = fill if bands == 1 or isinstance(fill, tuple) else (fill,) * bands
        canvas = Image.new(image.mode, (w + left + right, h + top + bottom), value)
        canvas.paste(image, (left, top))
        return canvas
    if k == "numpy":
        import numpy as np

        out = np.full((h + top + bottom, w + left + right) + image.shape[2:], fill, dtype=image.dtype)
        out[top : top + h, left : left + w] = image
        return out
    out = image.new_full(tuple(image.shape[:-2]) + (h + top + bottom, w + left + right), fill)
    out[..., top : top + h, left : left + w] = image
    return out


def resize(image: Any, hw: tuple[int, int], resample: str = "bicubic") -> Any:
    """Resample to (height, width) with an antialiased bilinear or bicubic filter."""
    if resample not in RESAMPLE:
        raise ValueError(f"resample must be one of {RESAMPLE}, got {resample!r}")
    if size(image) == tuple(hw):
        return crop(image, (0, hw[0], 0, hw[1]))
    k = kind(image)
    if k == "pil":
        from PIL import Image

        method = Image.Resampling.BICUBIC if resample == "bicubic" else Image.Resampling.BILINEAR
        return image.resize((hw[1], hw[0]), method)
    if k == "numpy":
        return _resize_numpy(image, hw, resample)
    return _resize_torch(image, hw, resample)


def _resize_torch(image: Any, hw: tuple[int, int], resample: str) -> Any:
    """Antialiased interpolate over the last two dims, in float32, cast back to the input dtype."""
    import torch
    import torch.nn.functional as F

    lead = tuple(image.shape[:-2])
    x = image.reshape(-1, 1, image.shape[-2], image.shape[-1]).to(torch.float32)
    y = F.interpolate(x, size=tuple(hw), mode=resample, align_corners=False, antialias=True)
    y = y.reshape(lead + tuple(hw))
    if image.dtype.is_floating_point:
        return y.to(image.dtype)
    info = torch.iinfo(image.dtype)
    return y.round().clamp(info.min, info.max).to(image.dtype)


def _resize_numpy(image: Any, hw: tuple[int, int], resample: str) -> Any:
    """Resize an HWC array through the torch path (channels moved first and back)."""
    import numpy as np
    import torch

    x = torch.from_numpy(np.ascontiguousarray(image, dtype=np.float32))
    x = x.unsqueeze(-1) if image.ndim == 2 else x
    y = _resize_torch(x.permute(2, 0, 1), hw, resample).permute(1, 2, 0).numpy()
    y = y[..., 0] if image.ndim == 2 else y
    if np.issubdtype(image.dtype, np.floating):
        return y.astype(image.dtype)
    info = np.iinfo(image.dtype)
    return np.clip(np.rint(y), info.min, info.max).astype(image.dtype)
