"""A tile's tokens at the positions they have in the whole latent: token indices, and position modules.

A transformer numbers its tokens in raster order over the patchified grid ([frames,] rows, columns). A
tile's tokens are a box of that grid: `token_index` gives their indices in the untiled sequence, and
every per-token positional value of the untiled call (rotary tables, sinusoidal or learned position
embeddings, position ids) taken at those indices is what the tile's tokens get with
`positions="global"`.

Where the model's forward takes the positions as an argument (Flux's `img_ids`, CogVideoX's
`image_rotary_emb`, LTX-Video's `video_coords`), the adapter passes the tile's rows of the untiled
value: no hook. Where the model computes them inside from the latent's shape, the submodule that does
(`ModuleSource`: `rope`, `pos_embed`, ...) gets, for one tile call only, a forward hook (PyTorch's public
hook API; `forward` is not replaced) that returns the untiled call's positions at the tile's tokens:

- "table": the module's output is positions only (a rotary table computed from the input's shape):
  the module's own forward on a stand-in of the whole latent's shape (an expanded zero, no memory),
  taken at the tile's tokens;
- "additive": the module's output is per-token features plus a position term (a patch embedding that
  adds a sinusoidal or learned table): `output - module(0 of the tile) + module(0 of the whole)[tile]`,
  which swaps the tile's position term for the whole latent's at its tokens exactly when the features
  are per token (a patch convolution, a per-token norm).

Where the model's own method makes the positions (HiDream's `patchify`: tokens, mask, grid sizes, position
ids, which forward computes only when they are not given), `MethodSource` names it: the adapter calls it on
the tiles and on a zero latent of the whole's shape and passes its outputs to forward, the tiles' position
ids the whole's at their tokens (`method_inputs`). No hook, and no method replaced.

The untiled output is computed once per denoiser call (cached on the call's layout) and taken per tile.
A hook changes what the module returns to any caller while it is registered, so one TiledDenoiser call
runs at a time on one model (as one diffusers pipeline call does). Outputs whose token axis is not found
stop with an error naming the module and `positions="tile"`.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from .transformer import hooked

KINDS = ("table", "additive")


def token_index(box, sides: tuple[int, ...], patch: tuple[int, ...], device=None) -> torch.Tensor:
    """Raster indices, in the patchified grid of the whole latent (`sides` in latent pixels, `patch` per
    axis), of the tokens of a box (y0, y1, x0, x1) or (t0, t1, y0, y1, x0, x1) in latent pixels."""
    k = len(box) // 2
    n = [-(-s // p) for s, p in zip(sides[-k:], patch[-k:], strict=True)]
    axes = [torch.arange(box[2 * i] // p, -(-box[2 * i + 1] // p), device=device)
            for i, p in enumerate(patch[-k:])]
    idx = axes[0]
    for a, size in zip(axes[1:], n[1:], strict=True):
        idx = (idx[:, None] * size + a[None, :]).flatten()
    return idx


def origin_box(box) -> tuple[int, ...]:
    """The box moved to the latent's origin (its tokens numbered as a tile's own, from 0)."""
    return tuple(c - box[i - i % 2] for i, c in enumerate(box))


def take_tokens(value: Any, idx: torch.Tensor, axis: int, n_whole: int, name: str) -> Any:
    """The entries of a per-token value (tensor, or tuple / list of them) at tokens `idx` along `axis`."""
    if isinstance(value, (tuple, list)):
        return type(value)(take_tokens(v, idx, axis, n_whole, name) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    if value.ndim <= axis or value.shape[axis] != n_whole:
        raise ValueError(f"{name}: expected {n_whole} image tokens along axis {axis}, got shape "
                         f"{tuple(value.shape)}")
    return value.index_select(axis, idx.to(value.device))


def select(full: Any, local: Any, idx: torch.Tensor, n_whole: int, where: str) -> Any:
    """The untiled output `full` at the tile's tokens, shaped as the tile's own output `local`.

    Each tensor's token axis is the one where `full` has the whole latent's n_whole tokens (plus as many
    other tokens, e.g. text, as `local` has beyond the tile's) and `local` the tile's; those other tokens
    are `local`'s (they sit before or after the image's, `where`). A tensor equal in shape to its local
    one with no token axis (a sequence length) is the local one."""
    if isinstance(full, (tuple, list)):
        return type(full)(select(f, loc, idx, n_whole, where) for f, loc in zip(full, local, strict=True))
    if not isinstance(full, torch.Tensor):
        return local
    n = len(idx)
    for d in range(full.ndim):
        extra = full.shape[d] - n_whole
        if extra < 0 or local.shape[d] - n != extra:
            continue
        if any(a != b for i, (a, b) in enumerate(zip(full.shape, local.shape, strict=True)) if i != d):
            continue
        if extra == 0:
            return full.index_select(d, idx.to(full.device))
        lo = 0 if where == "after" else extra
        image = full.narrow(d, lo, n_whole).index_select(d, idx.to(full.device))
        others = local.narrow(d, n if where == "after" else 0, extra)
        return torch.cat([image, others] if where == "after" else [others, image], dim=d)
    if full.shape == local.shape:
        return local
    raise RuntimeError(f"a position output of shape {tuple(full.shape)} for {n_whole} tokens has no token "
                       f"axis matching the tile's {tuple(local.shape)} for {n}")


@dataclass(frozen=True)
class ModuleSource:
    """A submodule that computes positions from the latent's shape (see the module docstring).

    `module`: its attribute path on the model; `kind`: "table" or "additive"; `arg`: which of its call's
    arguments is the latent (in the model's sample layout, or its tokens for a token layout), by index or
    name (None: none is); `sizes`: its arguments that are the post-patch ([frames,] height, width) sizes,
    by name (LTX-Video's rope); `others`: where non-image tokens of its output sit ("after" or "before");
    `grids` and `mask`: for a joint sequence (`adapters.joint`), its arguments that are the sequence's image
    token grids and its image-token mask, the target last in both (for the whole: the whole target's)."""

    module: str
    kind: str = "table"
    arg: int | str | None = 0
    sizes: tuple[str, ...] = ()
    others: str = "after"
    optional: bool = False  # a model of the family may have none (Cosmos without its learned embedding)
    unless: str | None = None  # its argument that, when given, carries the positions already (then no hook)
    take: Any = None  # (full, local, idx) -> the tile's output, where `select` cannot read it (Lumina 2)
    grids: str | None = None  # its argument listing a joint sequence's image token grids, the target's last
    mask: str | None = None  # its argument marking a joint sequence's image tokens, the target's last

    def find(self, model) -> torch.nn.Module | None:
        """The submodule (None for an optional one the model lacks); a ValueError naming the path when a
        required one is missing."""
        m = model
        for part in self.module.split("."):
            m = getattr(m, part, None)
            if m is None:
                if self.optional:
                    return None
                raise ValueError(f"positions='global': {type(model).__name__} has no {self.module} module; "
                                 "use positions='tile'")
        return m


@dataclass
class Geometry:
    """What a position hook needs of one tile call: the whole latent's sides in the module's layout, the
    tile's, which axes are the latent's sides, its post-patch sizes and the tile's token indices."""

    whole: tuple[int, ...]  # the module-layout sample shape of the untiled call, batch of the tile call
    axes: tuple[int, ...]  # axes of that shape that are the latent's ([frames,] rows, columns) / its tokens
    sizes: tuple[int, ...]  # post-patch sizes of the whole latent ([frames,] rows, columns)
    idx: torch.Tensor
    n_whole: int


def _bound(module, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    sig = inspect.signature(module.forward)
    return sig.bind(*args, **kwargs)


def _with(module, args: tuple, kwargs: dict, src: ModuleSource, value_of, zero_others: bool = False):
    """The module call's arguments with the latent argument (and the sizes) replaced by `value_of`; with
    `zero_others`, every other tensor argument by zeros of batch 1 (an additive source's `module(0)`)."""
    bound = _bound(module, args, kwargs)
    names = list(bound.arguments)
    key = names[src.arg] if isinstance(src.arg, int) else src.arg
    joint = tuple(a for a in (src.grids, src.mask) if a is not None)
    for name in ((key,) if key is not None else ()) + src.sizes + joint:
        if name not in bound.arguments:
            raise RuntimeError(f"positions='global': {type(module).__name__} was called without {name}")
        bound.arguments[name] = value_of(name, bound.arguments[name])
    if zero_others:
        for name, v in bound.arguments.items():
            if name != key and isinstance(v, torch.Tensor):
                bound.arguments[name] = v.new_zeros((1, *v.shape[1:]))
    return bound.args, bound.kwargs


def _stand_in(geo: Geometry, like: torch.Tensor, zeros: bool) -> torch.Tensor:
    """A tensor of the whole latent's shape in `like`'s layout: an expanded zero, or real zeros (batch 1)."""
    shape = list(like.shape)
    for a in geo.axes:
        shape[a] = geo.whole[a]
    if zeros:
        shape[0] = 1
        return like.new_zeros(shape)
    return like.new_zeros(()).expand(shape)


def module_hook(model, src: ModuleSource, geo: Geometry, cache: dict):
    """The hook that gives one tile call the untiled positions at its tokens (see the module docstring)."""
    module = src.find(model)

    def whole_args(args, kwargs, zeros: bool):
        sizes = dict(zip(src.sizes, geo.sizes, strict=True)) if src.sizes else {}

        def value(name, v):
            if name in sizes:
                return sizes[name]
            if name == src.grids:  # the target's grid, last, of the whole's size
                return [*v[:-1], (*v[-1][: len(v[-1]) - len(geo.sizes)], *geo.sizes)]
            if name == src.mask:  # the target's tokens, last: the whole's count of them
                return torch.cat([v[: len(v) - len(geo.idx)], v.new_ones(geo.n_whole)])
            return _stand_in(geo, v, zeros)

        return _with(module, args, kwargs, src, value, zero_others=zeros)

    def hook(mod, args, kwargs, output):
        if src.unless is not None and _bound(mod, args, kwargs).arguments.get(src.unless) is not None:
            return output  # positions passed explicitly (the adapter gave the tile's)
        a, k = whole_args(args, kwargs, zeros=src.kind == "additive")
        key = (src.module, *(tuple(v.shape) for v in (*a, *k.values()) if isinstance(v, torch.Tensor)))
        if key not in cache:
            cache[key] = mod.forward(*a, **k)  # its own forward: no hook re-entry
        full = cache[key]
        if src.take is not None:
            return src.take(full, output, geo.idx)
        if src.kind == "table":
            return select(full, output, geo.idx, geo.n_whole, src.others)
        def zero(name, v):
            return v if name in src.sizes else v.new_zeros((1, *v.shape[1:]))

        a, k = _with(module, args, kwargs, src, zero, zero_others=True)
        local0 = mod.forward(*a, **k)
        return output - local0 + select(full, local0, geo.idx, geo.n_whole, src.others)

    return hooked(module, hook, with_kwargs=True)


def module_hooks(model, sources: tuple[ModuleSource, ...], geo: Geometry, cache: dict):
    """Every source's hook for one tile call (see `module_hook`)."""
    stack = contextlib.ExitStack()
    for src in sources:
        if src.find(model) is not None:
            stack.enter_context(module_hook(model, src, geo, cache))
    return stack


@dataclass(frozen=True)
class MethodSource:
    """A method of the model that makes forward's inputs from the latent, positions among them, and that
    forward calls only when they are not given (HiDream's `patchify`: tokens padded to `max_seq`, their
    mask, grid sizes and position ids).

    With positions="global" the adapter calls the method on the tiles and on a zero latent of the whole's
    shape (batch 1), and passes its outputs to forward by name, the positions of each tile's tokens (the
    first along axis 1, any padding after) replaced by the whole's at those tokens. `returns`: the forward
    arguments its outputs are, in order; `positions`: the one holding positions; `mask`: a token mask it
    leaves None when every token is valid, passed as ones (HiDream multiplies its keys by it)."""

    method: str
    returns: tuple[str, ...]
    positions: str
    mask: str | None = None


def method_inputs(model, src: MethodSource, sample, geos: list[Geometry], cache: dict) -> dict[str, Any]:
    """Forward's inputs from the model's own method on the tiles' `sample` (tile after tile, `geos` one per
    tile), with the untiled call's positions at each tile's tokens (see `MethodSource`)."""
    make = getattr(model, src.method)
    out = dict(zip(src.returns, make(sample), strict=True))
    whole = geos[0].whole[1:]
    key = (src.method, whole)
    if key not in cache:
        cache[key] = dict(zip(src.returns, make(sample.new_zeros((1, *whole))), strict=True))[src.positions]
    full, pos = cache[key], out[src.positions].clone()
    rows = pos.shape[0] // len(geos)
    for i, geo in enumerate(geos):
        pos[i * rows : (i + 1) * rows, : len(geo.idx)] = full[:, geo.idx.to(full.device)]
    out[src.positions] = pos
    if src.mask is not None and out[src.mask] is None:
        out[src.mask] = sample.new_ones(pos.shape[:2])
    return out
