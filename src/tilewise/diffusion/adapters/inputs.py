"""Inputs cut per tile (`adapters.grid`): crops of spatial inputs, a tile's tokens, frames, axis ranges.

Each is built by `GridAdapter.parse` around the call's value, bound to the rows of one model call when the
fusion core selects them (`take_rows`), and cut for the tiles of that call (`for_tiles(layout, boxes)`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..residuals import crop_map
from ..rows import take_rows
from .positions import origin_box, take_tokens


class PerTile:
    """An input cut per tile (a crop of a spatial input, the tile's tokens of a per-token one), bound to the
    rows of one model call when the fusion core selects them (`take_rows`)."""

    def __init__(self, value: Any, name: str, rows=None, repeats: int = 1) -> None:
        self.value, self.name, self.rows, self.repeats = value, name, rows, repeats

    def take_rows(self, rows, n_rows: int, repeats: int) -> PerTile:
        return type(self)(self.value, self.name, (rows, n_rows), repeats)

    def _selected(self, value, repeats: int = 1):
        """The value at the call's rows (a tensor whose leading dim is the batch), `repeats` times."""
        if self.rows is None or not isinstance(value, torch.Tensor):
            return value
        rows, n_rows = self.rows
        return take_rows(value, rows, n_rows, repeats)

    def for_tiles(self, lay, boxes, positions: str = "global") -> Any:
        """The input for a call on `boxes` (one tile after another, each with the call's rows)."""
        raise NotImplementedError


class Spatial(PerTile):
    """An input on the latent's grid (model layout, any channels, the latent's size times a factor)."""

    def for_tiles(self, lay, boxes, positions: str = "global") -> Any:
        v = self._selected(self.value)
        if self.name in lay.spec.resampled:  # resized to the latent as the model resizes it to its grid
            p = lay.spec.patch(lay.config)[-1] if lay.config is not None else 1
            size = tuple(-(-s // p) for s in lay.sides[-2:])
            v = torch.nn.functional.interpolate(v.float(), size=size, mode="bilinear", align_corners=True)
            v = v.to(self.value.dtype)
        grid = lay.canonical(v, self.name)
        parts = []
        for box in boxes:
            part = grid[:, :, box[0] : box[1]] if len(box) == 6 and grid.ndim == 5 else grid
            parts.append(crop_map(part, box[-4:], lay.sides[-2:]))
        return lay.to_model(torch.cat(parts))


class Tokens(PerTile):
    """An input with one entry per image token along `axis` (batched: a batch dim comes first); `axis` a
    function (value, token indices, tokens of the whole) -> the tiles' value, where the value holds more."""

    def __init__(self, value, name, rows=None, repeats=1, axis: int = 0, batched: bool = False):
        super().__init__(value, name, rows, repeats)
        self.axis, self.batched = axis, batched

    def take_rows(self, rows, n_rows, repeats):
        return Tokens(self.value, self.name, (rows, n_rows) if self.batched else None, repeats, self.axis,
                      self.batched)

    def for_tiles(self, lay, boxes, positions: str = "global") -> Any:
        v = self._selected(self.value)
        picks = [lay.tile_tokens(origin_box(b) if positions == "tile" else b) for b in boxes]
        if not self.batched:
            if len({tuple(p.tolist()) for p in picks}) > 1:
                raise RuntimeError(f"{self.name}: tiles at different places share no positions in one call")
            return self._take(v, picks[0], lay.n_tokens)
        return torch.cat([self._take(v, p, lay.n_tokens) for p in picks])

    def _take(self, v, idx, n: int):
        """The entries at tokens `idx`: along the token axis, or by the family's own function of the value
        (a value of tables and per-token indices: Allegro's image_rotary_emb)."""
        if callable(self.axis):
            return self.axis(v, idx, n)
        return take_tokens(v, idx, self.axis, n, self.name)


class AxisPositions(PerTile):
    """Per-axis positions (one 1-D tensor per grid axis, in patches): a tile's are its ranges of them."""

    def take_rows(self, rows, n_rows, repeats):
        return self

    def for_tiles(self, lay, boxes, positions: str = "global") -> Any:
        picks = {origin_box(b) if positions == "tile" else tuple(b) for b in boxes}
        if len(picks) > 1:
            raise RuntimeError(f"{self.name}: tiles at different places share no positions in one call")
        box = picks.pop()[-2 * len(self.value):]
        return type(self.value)(p[box[2 * i] // a : -(-box[2 * i + 1] // a)]
                                for i, (p, a) in enumerate(zip(self.value, lay.patch, strict=True)))


class Frames(PerTile):
    """An input with one entry per latent frame along `axis` (per-frame timesteps): the frame window's."""

    def __init__(self, value, name, rows=None, repeats=1, axis: int = 1):
        super().__init__(value, name, rows, repeats)
        self.axis = axis

    def take_rows(self, rows, n_rows, repeats):
        return Frames(self.value, self.name, (rows, n_rows), repeats, self.axis)

    def for_tiles(self, lay, boxes, positions: str = "global") -> Any:
        v = self.value
        if not isinstance(v, torch.Tensor) or v.ndim <= self.axis or len(lay.sides) != 3 \
                or v.shape[self.axis] != lay.sides[0]:
            return self._selected(v, len(boxes))  # not per frame here: as any per-row value
        v = self._selected(v)
        return torch.cat([v.narrow(self.axis, b[0], b[1] - b[0]) for b in boxes])



class RowsAt(PerTile):
    """A per-row input whose batch axis is `axis`, not the first (HiDream's Llama embeddings, one per layer
    ahead of the batch: (layers, B, tokens, D)): the call's rows of it, for every tile."""

    def __init__(self, value, name, rows=None, repeats=1, axis: int = 1):
        super().__init__(value, name, rows, repeats)
        self.axis = axis

    def take_rows(self, rows, n_rows, repeats):
        return RowsAt(self.value, self.name, (rows, n_rows), repeats, self.axis)

    def for_tiles(self, lay, boxes, positions: str = "global") -> Any:
        v = self.value
        if self.rows is None or not isinstance(v, torch.Tensor):
            return v
        rows, n_rows = self.rows
        if v.shape[self.axis] != n_rows:
            raise ValueError(f"{self.name}: expected the batch ({n_rows} rows) along axis {self.axis}, got "
                             f"shape {tuple(v.shape)}")
        return take_rows(v.movedim(self.axis, 0), rows, n_rows, len(boxes)).movedim(0, self.axis)
