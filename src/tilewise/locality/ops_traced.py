"""The primitive ops a traced lowering needs beyond the hand lowerings': elementwise functions of two
values (`Combine`), channel concatenation (`Cat`), channel slices (`Slice`), a module run on each box's
neighbourhood (`Local`) and a module run whole (`Whole`). Like every op (`ops`) they know the box of each
source an output box reads and compute any box.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import torch

from .boxes import clip_box, sub_tensor
from .ops import Op, OpKind

EVERYWHERE = 1 << 40  # (a box beyond any image: clipped to the whole of it)


@dataclass
class Combine(Op):
    """fn(a, b) of two values of one shape, position by position (x * y, x - y, ...; `Add` is x + y)."""

    fn: Callable | None = None
    label: str = ""
    kind = OpKind.COMBINE

    def run(self, ctx, inputs, have, box, shapes):
        return self.fn(sub_tensor(inputs[0], have[0], box), sub_tensor(inputs[1], have[1], box))

    def describe(self):
        return self.label or "combine"


@dataclass
class Cat(Op):
    """Sources concatenated along channels (torch.cat(..., dim=1))."""

    kind = OpKind.CAT

    def out_channels(self, channels):
        return sum(channels)

    def run(self, ctx, inputs, have, box, shapes):
        return torch.cat([sub_tensor(t, h, box) for t, h in zip(inputs, have, strict=True)], dim=1)

    def describe(self):
        return f"cat {len(self.src)} along channels"


@dataclass
class Slice(Op):
    """Channels [start, stop) of its source (chunk, split, x[:, a:b])."""

    start: int = 0
    stop: int = 0
    kind = OpKind.SLICE

    def out_channels(self, channels):
        return self.stop - self.start

    def run(self, ctx, inputs, have, box, shapes):
        return sub_tensor(inputs[0], have[0], box)[:, self.start : self.stop]

    def describe(self):
        return f"channels {self.start}:{self.stop}"


@dataclass
class Local(Op):
    """A module whose output block reads only a neighbourhood of its input block (its locality measured
    by the lowering: `traced`), run on each box's neighbourhood cut out of its input: aligned to its
    blocks of `down` input pixels and reaching `halo` input pixels further (a multiple of `down`), clipped
    at the image, where the module pads as it does on the whole. Output side = input side // down * up."""

    fn: Callable | None = None  # the module on a crop of its input
    down: int = 1
    up: int = 1
    halo: int = 0
    channels: int = 0
    calls: int = 0  # the torch calls it makes (its kernel launches, as a plan counts them)
    label: str = ""
    frames_fn: Callable | None = None  # a video value's: (frames, step) -> frames made; None keeps them
    kind = OpKind.MODULE

    def out_shape(self, shapes):
        h, w = shapes[0]
        return h // self.down * self.up, w // self.down * self.up

    def frames(self, ts, step):
        return ts[0] if self.frames_fn is None else self.frames_fn(ts[0], step)

    def out_channels(self, channels):
        return self.channels

    def _reads(self, a: int, b: int) -> tuple[int, int]:
        """The input rows (or columns) output rows [a, b) read: their blocks, widened by the halo."""
        d, u, r = self.down, self.up, self.halo
        first, end = a * d // u, _ceil(b * d, u)  # (the input pixels of rows [a, b))
        return first // d * d - r, _ceil(end, d) * d + r

    def input_boxes(self, box):
        (a, b), (c, e) = self._reads(box[0], box[1]), self._reads(box[2], box[3])
        return [(a, b, c, e)]

    def run(self, ctx, inputs, have, box, shapes):
        need = clip_box(self.input_boxes(box)[0], shapes[0])
        y = self.fn(sub_tensor(inputs[0], have[0], need))
        d, u = self.down, self.up
        top, left = need[0] // d * u, need[2] // d * u
        return sub_tensor(y, (top, top + y.shape[-2], left, left + y.shape[-1]), box)

    def describe(self):
        scale = f", /{self.down}" if self.down > 1 else f", x{self.up}" if self.up > 1 else ""
        return f"{self.label} (halo {self.halo}{scale})"


@dataclass
class Whole(Op):
    """A module whose output at one position reads every position, and which is none of the known global
    ops (diffusers' Attention): run untiled on the whole of its inputs, once (`prepare`), its tiles cut
    out of that output. Exact; its own memory is the whole input and output, not a tile's. `scale`:
    output side over the first input's."""

    fn: Callable | None = None  # (whole inputs...) -> whole output
    scale: Fraction = Fraction(1)
    channels: int = 0
    calls: int = 0  # the torch calls it makes (its kernel launches, as a plan counts them)
    label: str = ""
    sync = True
    kind = OpKind.WHOLE

    def out_shape(self, shapes):
        h, w = shapes[0]
        return int(h * self.scale), int(w * self.scale)

    def out_channels(self, channels):
        return self.channels

    def input_boxes(self, box):
        return [(-EVERYWHERE, EVERYWHERE, -EVERYWHERE, EVERYWHERE) for _ in self.src]

    def prepare(self, inputs):
        """The whole output from the whole inputs."""
        return self.fn(*inputs)

    def run(self, ctx, inputs, have, box, shapes):
        whole = ctx.kv.get(id(self))
        if whole is None:  # (the untiled run: its inputs are whole)
            whole = self.prepare([sub_tensor(t, h, h) for t, h in zip(inputs, have, strict=True)])
        return whole[..., box[0] : box[1], box[2] : box[3]]

    def describe(self):
        return f"{self.label} run whole"


def _ceil(a: int, b: int) -> int:
    return -(-a // b)
