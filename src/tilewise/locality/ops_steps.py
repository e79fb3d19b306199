"""Step-dependent ops of a video program: an op that a causal loop's first call computes otherwise than
its later calls, read from the traces of those calls (`trace.calls`).

- `from_step(op, k)`: an op the calls before call k do not compute (Wan's temporal upsampler's time
  convolution and frame interleave, which its first call skips, its "Rep" cache marker; the temporal
  downsampler's stride-2 convolution): before step k it passes its first input on as it is; a causal
  convolution among them that its later call reads a cache into (`CausalConv3d.cached`) keeps the frames
  it would have read there (the downsampler's first call caches its input), one that its later call
  pads with zeros keeps nothing (the upsampler's second call: zeros in front);
- `first_step(op, first)`: an op the first call computes as `first` (a measured op of that call: Wan
  2.2's DupUp3D shortcut, which drops its first frames there) and the later calls as `op`.

Each keeps the class of the op it wraps (a subclass made once per class: the planners' and executors'
dispatch on kinds and classes sees the op itself), its geometry (halos, segments) that of the later
calls' op.
"""

from __future__ import annotations

import torch

from .boxes import clip_box, sub_tensor

_CLASSES: dict[tuple[type, type], type] = {}


def _subclass(mixin: type, cls: type) -> type:
    key = (mixin, cls)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"{cls.__name__}{mixin.__name__}", (mixin, cls), {})
    return _CLASSES[key]


def _wrapped(mixin: type, op, **attrs):
    new = object.__new__(_subclass(mixin, type(op)))
    new.__dict__.update(op.__dict__)
    new.__dict__.update(attrs)
    return new


def from_step(op, since: int):
    """op, passing its first input on in the steps before `since` (module docstring)."""
    return _wrapped(FromStep, op, since=since)


def first_step(op, first):
    """op, computed as `first` in step 0 (module docstring)."""
    return _wrapped(FirstStep, op, first=first)


def _step(ctx) -> int | None:
    """The causal step a run context runs (None: a run outside the steps, a measurement's)."""
    return getattr(ctx, "step", None) if ctx is not None else None


class FromStep:
    """An op computed from step `since` on; before it its first input passes (module docstring)."""

    since: int = 1

    def off(self, ctx) -> bool:
        step = _step(ctx)
        return step is not None and step < self.since

    def frames(self, ts, step):
        if step < self.since:
            return ts[0]
        own = getattr(super(), "frames", None)
        return own(ts, step) if own is not None else ts[0]

    def cache_elems(self, box, shapes, channels: int, step: int) -> int:
        own = getattr(super(), "cache_elems", None)  # (an op that keeps no cache: none)
        if own is None or step < self.since and not getattr(self, "cached", 0):
            return 0
        return own(box, shapes, channels, step)

    def _pass(self, ctx, inputs, have, box, shapes):
        """Its first input over `box`; a causal convolution read with a cache later keeps what it reads."""
        if getattr(self, "cached", 0) and getattr(self, "pad_t", 0):
            inner = clip_box(self.input_boxes(box)[0], shapes[0])
            x = sub_tensor(inputs[0], have[0], inner)
            prev = ctx.cached(self, inner, x.device)
            if prev is None:
                prev = x.new_zeros((*x.shape[:2], self.pad_t, *x.shape[3:]))
            ctx.keep(self, inner, torch.cat([prev, x], dim=2)[:, :, -self.pad_t:])
        return sub_tensor(inputs[0], have[0], box)

    def run(self, ctx, inputs, have, box, shapes):
        if self.off(ctx):
            return self._pass(ctx, inputs, have, box, shapes)
        return super().run(ctx, inputs, have, box, shapes)

    def run_in_place(self, ctx, inputs, have, box, shapes):
        if self.off(ctx):
            return self._pass(ctx, inputs, have, box, shapes)
        return super().run_in_place(ctx, inputs, have, box, shapes)

    def describe(self):
        return f"{super().describe()} (from step {self.since})"


class FirstStep:
    """An op computed as `first` in step 0 and as itself after (module docstring)."""

    first = None

    def frames(self, ts, step):
        if step == 0:
            fn = getattr(self.first, "frames", None)
            return fn(ts, step) if fn is not None else ts[0]
        own = getattr(super(), "frames", None)
        return own(ts, step) if own is not None else ts[0]

    def run(self, ctx, inputs, have, box, shapes):
        if _step(ctx) == 0:
            return self.first.run(ctx, inputs, have, box, shapes)
        return super().run(ctx, inputs, have, box, shapes)

    def run_in_place(self, ctx, inputs, have, box, shapes):
        if _step(ctx) == 0:
            return self.first.run_in_place(ctx, inputs, have, box, shapes)
        return super().run_in_place(ctx, inputs, have, box, shapes)

    def describe(self):
        first = self.first.describe()
        return super().describe() if first == super().describe() else f"{super().describe()} ({first} first)"
