"""Residuals per tile: ControlNet outputs computed later, tile by tile, and residual maps cropped per tile.

A `TiledControlNet` (`tilewise.diffusion.controlnet`) records each call the pipeline makes and returns
`Deferred` leaves in place of its residual tensors. Pipelines do arithmetic on those (guess mode:
`torch.zeros_like` and `torch.cat` along the batch; MultiControlNet: `+`; scales: `*`): the leaves define
`__torch_function__`, so these torch calls build an expression instead of computing it; any other torch
call is refused in one line. Residual tensors computed before tiling (T2I-Adapter features, a ControlNet
the user ran untiled) are `Fixed` leaves, cropped per tile at their own resolution.

When the denoiser's adapter calls the model on a batch of tiles, `evaluate(cond, tiles)` runs each
recorded ControlNet call once on those tiles (only the rows the expressions need, each tile's crop of
the latent and of the control image) and computes every expression from the results, so the down and
mid residuals of one tile come from one ControlNet call and the ControlNet's cost stays one tile's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..geometry import Box


class Residual:
    """A residual tensor not computed yet: an expression over ControlNet outputs and fixed maps."""

    batch: int = 0  # rows (the leading dim of the tensor it stands for)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        op = _OPS.get(func)
        if op is None:
            name = getattr(func, "__name__", repr(func))
            raise TypeError(f"{name}() on a deferred ControlNet residual: TiledControlNet's outputs are "
                            "computed per tile by the TiledDenoiser they are passed to, and take only "
                            "torch.cat along the batch, torch.zeros_like, + and * by a number; wrap the "
                            "denoiser too (pipe.unet = tw.TiledDenoiser(pipe.unet, ...)) or run the "
                            "ControlNet untiled")
        return op(*args, **(kwargs or {}))

    def __add__(self, other):
        return Add(self, as_residual(other))

    __radd__ = __iadd__ = __add__

    def __mul__(self, other):
        return Scale(self, _number(other))

    __rmul__ = __mul__

    def take_rows(self, rows, n_rows: int, repeats: int) -> Selected:
        """Bound to the rows of one model call (see `tilewise.diffusion.rows`)."""
        if self.batch != n_rows:
            raise ValueError(f"a residual has {self.batch} rows but the denoiser's sample {n_rows}: the "
                             "ControlNet / adapter must be called with the denoiser's batch (or its half)")
        return Selected(self, [int(r) for r in rows], repeats)

    # evaluation: the rows of each recorded call it needs, then its value (tiles, len(rows), ...)
    def needs(self, rows: list[int], need: dict) -> None:
        raise NotImplementedError

    def value(self, rows: list[int], tiles: Tiles) -> torch.Tensor:
        raise NotImplementedError


def _number(s):
    if isinstance(s, (int, float)) or (isinstance(s, torch.Tensor) and s.numel() == 1):
        return s
    raise TypeError(f"a deferred ControlNet residual can be multiplied by a number only, got "
                    f"{type(s).__name__}")


def as_residual(value) -> Residual:
    """A residual expression for `value`: itself, or a fixed map for a tensor."""
    if isinstance(value, Residual):
        return value
    if isinstance(value, torch.Tensor) and value.ndim >= 2:
        return Fixed(value)
    shape = f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""
    raise TypeError(f"a residual must be a (batch, ...) tensor of 2 or more dims or a TiledControlNet "
                    f"output, got {type(value).__name__}{shape}")


def residual_args(value, name: str):
    """A residual argument (a tensor, a deferred residual, or a list / tuple of them) as residual leaves."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return type(value)(residual_args(v, name) for v in value)
    try:
        return as_residual(value)
    except TypeError as e:
        raise TypeError(f"{name}: {e}") from None


class Deferred(Residual):
    """Output `path` (indices into the ControlNet's return value) of one recorded ControlNet call."""

    def __init__(self, call: ControlCall, path: tuple[int, ...]) -> None:
        self.call, self.path, self.batch = call, path, call.batch

    def needs(self, rows, need):
        need.setdefault(self.call, set()).update(rows)

    def value(self, rows, tiles):
        return tiles.output(self.call, self.path, rows)


class Fixed(Residual):
    """A residual map computed before tiling: each tile gets its crop, at the map's own resolution."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.batch = tensor, int(tensor.shape[0])

    def needs(self, rows, need):
        pass

    def value(self, rows, tiles):
        part = self.tensor.index_select(0, torch.tensor(rows, device=self.tensor.device))
        return torch.stack([tiles.crop(part, box) for box in tiles.boxes])


class Zeros(Residual):
    """torch.zeros_like of a residual (guess mode's unconditional half)."""

    def __init__(self, like: Residual) -> None:
        self.like, self.batch = like, like.batch

    def needs(self, rows, need):
        self.like.needs(rows[:1], need)  # one row tells the shape

    def value(self, rows, tiles):
        v = self.like.value(rows[:1], tiles)
        return v.new_zeros((v.shape[0], len(rows), *v.shape[2:]))


class Cat(Residual):
    """torch.cat of residuals along the batch."""

    def __init__(self, parts: list[Residual]) -> None:
        self.parts, self.batch = parts, sum(p.batch for p in parts)

    def _split(self, rows):
        """(part, positions in `rows`, the part's own rows) for every part `rows` falls in."""
        out, start = [], 0
        for p in self.parts:
            pos = [i for i, r in enumerate(rows) if start <= r < start + p.batch]
            out.append((p, pos, [rows[i] - start for i in pos]))
            start += p.batch
        return [o for o in out if o[1]]

    def needs(self, rows, need):
        for part, _, local in self._split(rows):
            part.needs(local, need)

    def value(self, rows, tiles):
        pieces = [(pos, part.value(local, tiles)) for part, pos, local in self._split(rows)]
        first = pieces[0][1]
        out = first.new_empty((first.shape[0], len(rows), *first.shape[2:]))
        for pos, v in pieces:
            out[:, pos] = v
        return out


class Add(Residual):
    """a + b (MultiControlNet's sum); a batch of 1 broadcasts."""

    def __init__(self, a: Residual, b: Residual) -> None:
        if a.batch != b.batch and 1 not in (a.batch, b.batch):
            raise ValueError(f"cannot add residuals of {a.batch} and {b.batch} rows")
        self.a, self.b, self.batch = a, b, max(a.batch, b.batch)

    def _rows(self, node, rows):
        return [0] * len(rows) if node.batch == 1 else rows

    def needs(self, rows, need):
        self.a.needs(self._rows(self.a, rows), need)
        self.b.needs(self._rows(self.b, rows), need)

    def value(self, rows, tiles):
        return self.a.value(self._rows(self.a, rows), tiles) + self.b.value(self._rows(self.b, rows), tiles)


class Scale(Residual):
    """a * s for a number s."""

    def __init__(self, a: Residual, s) -> None:
        self.a, self.s, self.batch = a, s, a.batch

    def needs(self, rows, need):
        self.a.needs(rows, need)

    def value(self, rows, tiles):
        return self.a.value(rows, tiles) * self.s


def _cat(tensors, dim=0, *, out=None):
    if dim != 0 or out is not None:
        raise TypeError(f"torch.cat of deferred ControlNet residuals: only along the batch (dim 0), got "
                        f"dim={dim}; a model that concatenates them is not tiled: wrap the denoiser too "
                        "(pipe.unet = tw.TiledDenoiser(pipe.unet, ...))")
    return Cat([as_residual(t) for t in tensors])


def _zeros_like(x, *, dtype=None, **kwargs):
    if dtype is not None:
        raise TypeError("torch.zeros_like of a deferred ControlNet residual takes no dtype")
    return Zeros(as_residual(x))


def _add(a, b, *, alpha=1):
    b = as_residual(b)
    return Add(as_residual(a), b if alpha == 1 else Scale(b, alpha))


def _mul(a, b):
    if isinstance(a, Residual):
        return Scale(a, _number(b))
    return Scale(as_residual(b), _number(a))


_OPS: dict[Callable, Callable] = {
    torch.cat: _cat, torch.concat: _cat, torch.zeros_like: _zeros_like,
    torch.add: _add, torch.Tensor.add: _add, torch.Tensor.__add__: _add, torch.Tensor.__iadd__: _add,
    torch.Tensor.__radd__: lambda a, b: _add(b, a),
    torch.mul: _mul, torch.Tensor.mul: _mul, torch.Tensor.__mul__: _mul, torch.Tensor.__rmul__: _mul,
}


@dataclass
class Selected:
    """A residual bound to the rows of one model call, repeated for `repeats` tiles."""

    node: Residual
    rows: list[int]
    repeats: int

    def one_tile(self) -> Selected:
        """The same rows for a call on one of the tiles."""
        return Selected(self.node, self.rows, 1)


class ControlCall:
    """One call of a wrapped ControlNet as the pipeline made it (arguments by name), run later per tile by
    its family (`tilewise.diffusion.adapters.controlnets`): `family.run(module, args, tiles, rows)`."""

    def __init__(self, module, family, args: dict[str, Any]) -> None:
        self.module, self.family, self.args = module, family, args
        self.batch = family.batch(args)

    def run(self, tiles: Tiles, rows: list[int]):
        return self.family.run(self.module, self.args, tiles, rows)


@dataclass
class Tiles:
    """The tiles of one model call as residuals need them: read boxes on the (H, W) latent grid, how a
    fixed residual is cropped (`crop(tensor, box)`), the denoiser's positions and per-tile conditioning
    (`condition(kwargs, boxes, rows)`, e.g. SDXL's crop micro-conditioning) for the ControlNet's call."""

    boxes: list[Box]
    hw: tuple[int, int]
    crop: Callable[[torch.Tensor, Box], torch.Tensor]
    positions: str = "global"
    condition: Callable[[dict, list[Box], int], None] | None = None
    runs: dict = field(default_factory=dict)

    def output(self, call: ControlCall, path: tuple[int, ...], rows: list[int]) -> torch.Tensor:
        """(tiles, len(rows), ...) of output `path` of `call` (run on these tiles by `evaluate`)."""
        ran, out = self.runs[call]
        for i in path:
            out = out[i]
        n = len(self.boxes)
        return out.reshape(n, len(ran), *out.shape[1:])[:, [ran.index(r) for r in rows]]


def _selected(value, found: list) -> None:
    if isinstance(value, Selected):
        found.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _selected(v, found)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _selected(v, found)


def _replace(value, tiles: Tiles):
    if isinstance(value, Selected):
        n = len(tiles.boxes)
        if value.repeats != n:
            raise ValueError(f"a residual bound for {value.repeats} tiles is used in a call on {n}")
        return value.node.value(value.rows, tiles).flatten(0, 1)
    if isinstance(value, dict):
        return {k: _replace(v, tiles) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_replace(v, tiles) for v in value)
    return value


def evaluate(cond: dict[str, Any], tiles: Tiles) -> dict[str, Any]:
    """`cond` with every bound residual computed for `tiles` (each recorded ControlNet call run once)."""
    found: list[Selected] = []
    _selected(cond, found)
    if not found:
        return cond
    need: dict[ControlCall, set[int]] = {}
    for s in found:
        s.node.needs(s.rows, need)
    for call, rows in need.items():
        ran = sorted(rows)
        tiles.runs[call] = (ran, call.run(tiles, ran))
    return _replace(cond, tiles)


def crop_map(t: torch.Tensor, box: Box, hw: tuple[int, int]) -> torch.Tensor:
    """The part of a (..., h, w) map over the H x W latent under a latent box, at the map's resolution: a
    control image f times the latent's size (box x f, exact), or a residual 2^k times smaller: as many rows
    and columns as the tile's own features there have (ceil(side / 2^k), what a stride-2 convolution makes
    of the tile), from the cell holding the box's first pixel (moved inward at the map's end). A box that
    starts off the 2^k grid (an odd tile start) gets the cells its pixels fall in: the nearest the map
    holds, not the tile's own features, which an untiled ControlNet never computed."""
    y0, y1, x0, x1 = box
    (fy, uy), (fx, ux) = _factor(hw[0], t.shape[-2], t.shape), _factor(hw[1], t.shape[-1], t.shape)
    ys = slice(y0 * fy, y1 * fy) if uy else _down(y0, y1, fy, t.shape[-2])
    xs = slice(x0 * fx, x1 * fx) if ux else _down(x0, x1, fx, t.shape[-1])
    return t[..., ys, xs]


def _down(a: int, b: int, f: int, m: int) -> slice:
    """ceil((b - a) / f) cells of a map of m cells, from a // f, kept inside the map."""
    n = -(-(b - a) // f)
    start = min(a // f, m - n)
    return slice(start, start + n)


def _factor(n: int, m: int, shape) -> tuple[int, bool]:
    """(factor, up): m == n * factor (up) or m == ceil(n / factor) for a power of two (down)."""
    if m >= n and m % n == 0:
        return m // n, True
    for k in range(1, 8):
        if -(-n // 2**k) == m:
            return 2**k, False
    raise ValueError(f"a spatial input of shape {tuple(shape)} does not match the {n}-pixel latent side: it "
                     "must be the latent's size times an integer or divided by a power of two")
