"""Per-row conditioning: the rows one tiled model call needs, repeated for its tiles.

A per-row value is a tensor whose leading dim is the batch, or an object that selects its own rows
(`take_rows(rows, n_rows, repeats)`: deferred ControlNet residuals, `tilewise.diffusion.residuals`);
dicts, lists and tuples are walked; anything else goes to every tile unchanged.
"""

from __future__ import annotations

from typing import Any

import torch


def take_rows(value: Any, rows, n_rows: int, repeats: int) -> Any:
    """Per-row conditioning (leading dim == n_rows) restricted to `rows` and repeated for `repeats` tiles."""
    if isinstance(value, torch.Tensor):
        if value.ndim >= 1 and value.shape[0] == n_rows:
            part = value.index_select(0, rows.to(value.device))
            return part.repeat(repeats, *([1] * (part.ndim - 1)))
        return value
    if hasattr(value, "take_rows"):
        return value.take_rows(rows, n_rows, repeats)
    if isinstance(value, dict):
        return {k: take_rows(v, rows, n_rows, repeats) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(take_rows(v, rows, n_rows, repeats) for v in value)
    return value
