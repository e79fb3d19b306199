"""A joint sequence with the target latent last (Qwen-Image 2.1): text and condition images kept, the target
cut per tile.

Qwen-Image 2.1 runs one sequence: the vision-language encoder's tokens (text, and slots it reserved for
condition images, which the condition images' latent tokens fill), then the target latent's tokens, with
block-causal attention: a token sees the tokens before it and its own image block, so nothing before the
target sees the target. A tile's call is the same sequence with the target's tokens replaced by the tile's:
every token before them computes what it computes in the untiled call, and the tile's tokens see all of
them. What a `Joint` entry declares, for such a forward:

- `grids`: the argument listing, per sample, the (frames, rows, columns) token grids of the sequence's
  images, the target's last (`img_shapes`): per tile, the last is the tile's;
- `slots`: arguments with one entry per k target tokens at the end of their last axis (`img_mask`: one
  vision-language slot per 2 x 2 target tokens): per tile, the tile's n / k;
- the sample's tokens before the target's (the condition images' latents): kept for every tile;
- the output: the whole sequence (text and condition tokens first) or, with the model's prefix cache in
  its "cached" mode, the target's tokens only. The prediction is the tile's tokens, last; what comes
  before them is the same for every tile (nothing there sees the target) and is kept from a call on all
  rows, to return the output as the untiled call would.

Positions come from the model's rotary module on the whole sequence (`ModuleSource(grids=, mask=)`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .inputs import PerTile


@dataclass(frozen=True)
class Joint:
    """A joint sequence's table entry (see the module docstring)."""

    grids: str
    slots: dict[str, int] = field(default_factory=dict)


class Prefix(PerTile):
    """The sample's tokens before the target's (a joint sequence's condition images), for every tile."""

    def for_tiles(self, lay, boxes, positions: str = "global") -> Any:
        return self._selected(self.value, len(boxes))


class Grids(PerTile):
    """Per sample, the sequence's image token grids, the target's last: per tile, the tile's last."""

    def for_tiles(self, lay, boxes, positions: str = "global") -> Any:
        n = (len(self.rows[0]) if self.rows is not None else len(self.value)) * len(boxes)
        first = self.value[0]
        post = tile_post(lay, boxes[0])
        last = (*first[-1][: len(first[-1]) - len(post)], *post)
        return [[*first[:-1], last] for _ in range(n)]


class Slots(PerTile):
    """One entry per `k` target tokens at the end of the last axis: the tile's n / k of them."""

    def __init__(self, value, name, rows=None, repeats=1, k: int = 1):
        super().__init__(value, name, rows, repeats)
        self.k = k

    def take_rows(self, rows, n_rows, repeats):
        return Slots(self.value, self.name, (rows, n_rows), repeats, self.k)

    def for_tiles(self, lay, boxes, positions: str = "global") -> Any:
        v = self._selected(self.value, len(boxes))
        n = math.prod(tile_post(lay, boxes[0]))
        if n % self.k or lay.n_tokens % self.k:
            raise ValueError(f"{self.name}: a tile of {n} target tokens is not a whole number of slots of "
                             f"{self.k} tokens; use tile sides that make it one")
        cut = v.shape[-1] - lay.n_tokens // self.k
        return torch.cat([v[..., :cut], v[..., cut : cut + n // self.k]], dim=-1)


def tile_post(lay, box) -> tuple[int, ...]:
    """A tile's token grid (post-patch sizes)."""
    k = len(box) // 2
    return tuple(-(-box[2 * i + 1] // p) - box[2 * i] // p for i, p in enumerate(lay.patch[-k:]))


def split(joint: Joint, sample: str, given: dict, x, name: str):
    """(the target's tokens, its post-patch grid, the inputs cut per tile) of a joint sequence's call."""
    grids = given.get(joint.grids)
    if not isinstance(grids, (list, tuple)) or not grids or not isinstance(grids[0], (list, tuple)):
        raise ValueError(f"{name}: TiledDenoiser needs {joint.grids} (per sample, the token grids of the "
                         f"sequence's images, the target's last), got {grids!r}")
    first = [tuple(int(v) for v in g) for g in grids[0]]
    if any([tuple(int(v) for v in g) for g in other] != first for other in grids[1:]):
        raise ValueError(f"{name}: samples of one batch have different {joint.grids} {grids}; the model "
                         "reads one layout for the batch (its first)")
    n = math.prod(first[-1])
    if x.shape[1] < n:
        raise ValueError(f"{name}: {x.shape[1]} tokens in {sample}, fewer than the target's {first[-1]}")
    cond = {sample: Prefix(x[:, : x.shape[1] - n], sample), joint.grids: Grids([first] * len(grids),
                                                                                joint.grids)}
    for arg, k in joint.slots.items():
        if given.get(arg) is None:
            raise TypeError(f"TiledDenoiser.forward() for {name} needs {arg}")
        cond[arg] = Slots(given[arg], arg, k=k)
    return x[:, x.shape[1] - n :], first[-1], cond


def target(lay, out, n: int, rows: int, batch: int):
    """The tiles' tokens of a joint sequence's output (the last n); what precedes them kept on the layout
    from a call on all rows (the same for every tile), for the output the untiled call returns."""
    p = out.shape[1] - n
    if lay.prefix_out is None and rows == batch:
        lay.prefix_out = out[:rows, :p]
    return out[:, p:]


def with_prefix(lay, tokens):
    """The fused target's tokens after the kept ones, as the untiled call's output."""
    if lay.prefix_out is None:
        raise RuntimeError("no call on all rows kept the joint sequence's tokens before the target")
    return torch.cat([lay.prefix_out.to(tokens.dtype), tokens], dim=1)
