"""Pixel conversion: numpy (h, w, C) pixels and torch (C, h, w) images, float ranges to uint8/uint16.

torch is imported inside `quantize_torch`: `import tilewise.sinks` imports no torch (~2 s; tests/test_sinks.py
checks it).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

INT_BITS = {"uint8": 8, "uint16": 16}
FLOAT_DTYPES = ("float16", "float32", "float64")


def is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def channels_first_3d(x: Any, what: str) -> Any:
    """(C, h, w) view of a (h, w), (C, h, w) or (1, C, h, w) image."""
    if x.ndim == 4:
        if x.shape[0] != 1:
            raise ValueError(f"{what}: a (N, C, H, W) block must have N == 1, got shape {tuple(x.shape)}")
        return x[0]
    if x.ndim == 3:
        return x
    if x.ndim == 2:
        return x[None]
    raise ValueError(f"{what}: expected (H, W), (C, H, W) or (1, C, H, W), got shape {tuple(x.shape)}")


def _quantize_numpy(x: np.ndarray, bits: int, value_range: tuple[float, float]) -> np.ndarray:
    """round((x - lo) / (hi - lo) * (2^bits - 1)), clamped, as uint8/uint16."""
    lo, hi = value_range
    if not np.isfinite(x).all():
        raise ValueError("image block contains NaN or inf; cannot convert it to integer pixels")
    top = (1 << bits) - 1
    q = np.rint((np.asarray(x, np.float64) - lo) * (top / (hi - lo)))
    return np.clip(q, 0, top).astype(np.uint8 if bits == 8 else np.uint16)


def quantize_torch(x: Any, bits: int, value_range: tuple[float, float]) -> Any:
    """Torch version of :func:`_quantize_numpy`, computed on the tensor's device; returns int32."""
    import torch

    lo, hi = value_range
    if not bool(torch.isfinite(x).all()):
        raise ValueError("image block contains NaN or inf; cannot convert it to integer pixels")
    top = (1 << bits) - 1
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    q = torch.round((x.to(dtype) - lo) * (top / (hi - lo)))
    return q.clamp_(0, top).to(torch.int32)


def check_range(value_range: Any) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value_range)
    except (TypeError, ValueError):
        raise ValueError(f"value_range must be a (low, high) pair, got {value_range!r}") from None
    if not hi > lo:
        raise ValueError(f"value_range must have high > low, got {value_range!r}")
    return lo, hi


def to_hwc_uint(x: Any, bits: int = 8, value_range: tuple[float, float] = (-1.0, 1.0)) -> np.ndarray:
    """Float image, channels first ((H, W), (C, H, W) or (1, C, H, W)), -> (H, W, C) uint8/uint16 pixels."""
    if bits not in (8, 16):
        raise ValueError(f"bits must be 8 or 16, got {bits!r}")
    lo_hi = check_range(value_range)
    x = channels_first_3d(x, "to_hwc_uint")
    if is_torch(x):
        q = quantize_torch(x.detach(), bits, lo_hi).cpu().numpy()
        q = q.astype(np.uint8 if bits == 8 else np.uint16)
    else:
        q = _quantize_numpy(np.asarray(x), bits, lo_hi)
    return np.ascontiguousarray(q.transpose(1, 2, 0))
