"""The rules of video values ((B, C, T, H, W) tensors, a 3-D VAE's): each call on them placed as an op
of a video program (`ops3d`) by what it is.

- `conv3d`: `CausalConv3d`, its padding merged from what feeds it: its own zero padding, an `F.pad`
  (zeros; replicate: the border repeated in space, the first frame in time; reflect in space), and a
  concatenation of
  its input's first frame repeated in front and last frame behind (LTX-Video's causal padding);
- a slice of frames (`x[:, :, a:b]`), frames repeated (`x.repeat(1, 1, n, 1, 1)`) and frames of one
  value concatenated along time: a `Rearrange` of the frames, whose frame count the op knows;
- `group_norm` of a video value: refused with what it reduces over (groups x frames x space: a sync
  over the whole video, which the video executor does not run), and so is a concatenation along time of
  frames of different values (a cache a chunked causal loop carries from call to call): no measurement
  of the module around them places them either.

These frame rearrangements are ops of one-step programs (every frame in one step: LTX-Video); a value's
frames are then whole in every op. A rule returns False where a call is not one it places (the 2-D rules
are tried next: channels, arithmetic, ...), or a string saying why it refuses it.
"""

from __future__ import annotations

import torch

from ..ops3d import CausalConv3d, Rearrange
from .capture import Call, Ref
from .state import Lowering, arg_of, const_value, op_name, refused


def _conv3d(low: Lowering, i: int, call: Call) -> bool | str:
    x, w = arg_of(call, 0, "input"), arg_of(call, 1, "weight")
    if not isinstance(x, Ref) or not isinstance(w, Ref) or low.spatial(w.node) is not None:
        return False
    stride, dilation = _triple(arg_of(call, 3, "stride", 1)), _triple(arg_of(call, 5, "dilation", 1))
    padding = arg_of(call, 4, "padding", 0)
    if isinstance(padding, str):
        if padding != "valid":
            return f"conv3d padding={padding!r} (only explicit or 'valid' padding is placed)"
        padding = 0
    if dilation[1:] != (1, 1):
        return f"conv3d with spatial dilation {dilation[1:]} (video programs dilate in time only)"
    pt, ph, pw = _triple(padding)
    pad = _Padding([ph, ph, pw, pw], [pt, "zeros"], [pt, "zeros"], "zeros")
    src = x.node
    while src in low.pads or src in low.tpads:
        why = pad.merge_pad(*low.pads.pop(src)) if src in low.pads else pad.merge_frames(low.tpads[src])
        if isinstance(why, str):
            return why
        src = why
    name = low.spatial(src)
    if name is None:
        return False
    (front, fill), (back, fill_end) = pad.front, pad.back
    out = low.b.emit(CausalConv3d, (name,), call.where, weight=const_value(low, w),
                     bias=const_value(low, arg_of(call, 2, "bias")), stride=stride[1:], stride_t=stride[0],
                     dilation_t=dilation[0], padding=tuple(pad.space), pad_t=front, pad_end=back, fill=fill,
                     fill_end=fill_end, groups=int(arg_of(call, 6, "groups", 1)), padding_mode=pad.mode)
    low.set(call.outs[0], out)
    return True


class _Padding:
    """A 3-D convolution's padding as it is merged from what feeds it: space (top, bottom, left, right)
    and its mode; frames in front and behind with what they repeat ("zeros", "first", "last")."""

    def __init__(self, space, front, back, mode):
        self.space, self.front, self.back, self.mode = space, front, back, mode

    def _time(self, side: list, n: int, fill: str) -> str | None:
        if n and side[0] and side[1] != fill:
            return f"a convolution padded in time with both {side[1]} and {fill}"
        if n:
            side[0], side[1] = side[0] + n, fill
        return None

    def merge_pad(self, src: int, pad: tuple, mode: str):
        """An F.pad (left, right, top, bottom[, front, back]) before the convolution: its source node."""
        left, right, top, bottom, *time = pad
        if mode not in ("zeros", "replicate", "reflect") or mode == "reflect" and any(time):
            return f"an F.pad of mode {mode!r} before a 3-D convolution (in time: zeros or replicate)"
        spatial = any((left, right, top, bottom))
        if spatial and mode != self.mode and any(self.space):
            return f"an F.pad of mode {mode!r} before a convolution padding itself with zeros"
        self.space = [a + b for a, b in zip(self.space, (top, bottom, left, right), strict=True)]
        if spatial:
            self.mode = mode
        front, back = time or (0, 0)
        why = self._time(self.front, front, "zeros" if mode == "zeros" else "first")
        return why or self._time(self.back, back, "zeros" if mode == "zeros" else "last") or src

    def merge_frames(self, tpad: tuple):
        """The first frame repeated in front and the last behind (a concatenation): its source node."""
        src, front, back = tpad
        return self._time(self.front, front, "first") or self._time(self.back, back, "last") or src


def _frames_item(low: Lowering, i: int, call: Call) -> bool | str:
    """x[:, :, a:b] (frames a to b of a video value): a Rearrange of its frames."""
    x, idx = arg_of(call, 0, "input"), arg_of(call, 1, "indices")
    if not isinstance(x, Ref) or low.spatial(x.node) is None or not isinstance(idx, tuple) or len(idx) < 3:
        return False
    if idx[:2] != (slice(None), slice(None)) or any(s not in (slice(None), Ellipsis) for s in idx[3:]):
        return False
    sl = idx[2]
    if not isinstance(sl, slice) or sl.step not in (None, 1):
        return f"frames indexed by {sl!r} (only a slice of frames is placed)"
    a, b = sl.start, sl.stop
    low.frame_refs[call.outs[0]] = (x.node, a, b, 1)
    out = low.b.emit(Rearrange, (low.spatial(x.node),), op_name(call, "frames"),
                     fn=lambda t, ctx, a=a, b=b: t[:, :, a:b], frames_fn=lambda t, step, a=a, b=b:
                     len(range(t)[a:b]), label=f"frames {_span(a, b)}")
    low.set(call.outs[0], out)
    return True


def _repeat(low: Lowering, i: int, call: Call) -> bool | str:
    """x.repeat(1, 1, n, 1, 1): every frame n times over (a frame slice's repeats are remembered)."""
    x = arg_of(call, 0, "input")
    reps = call.args[1:] if len(call.args) > 2 else arg_of(call, 1, "repeats")
    if not isinstance(x, Ref) or low.spatial(x.node) is None:
        return False
    reps = tuple(reps) if isinstance(reps, list | tuple) else (reps,)
    if len(reps) != 5 or reps[0] != 1 or any(r != 1 for r in reps[3:]) or reps[1] != 1 and reps[2] != 1:
        return False if reps[2:] == (1, 1, 1) else f"repeat {reps} of a video value"
    n = int(reps[2])
    if x.node in low.frame_refs:
        src, a, b, r = low.frame_refs[x.node]
        low.frame_refs[call.outs[0]] = (src, a, b, r * n)
    if reps[1] != 1:
        return False  # (channels repeated: position by position, the 2-D rules)
    out = low.b.emit(Rearrange, (low.spatial(x.node),), op_name(call, "repeat"),
                     fn=lambda t, ctx, n=n: t.repeat(1, 1, n, 1, 1), frames_fn=lambda t, step, n=n: t * n,
                     label=f"frames x{n}")
    low.set(call.outs[0], out)
    return True


def _frames_cat(low: Lowering, i: int, call: Call) -> bool | str:
    """Frames of one video value concatenated along time (its first frame repeated in front, its last
    behind, ...): one Rearrange of that value; remembered as a padding where it is one (`tpads`)."""
    tensors, dim = arg_of(call, 0, "tensors"), arg_of(call, 1, "dim", 0)
    if dim not in (2, -3) or not all(isinstance(t, Ref) for t in tensors):
        return False
    parts, src = [], None
    for t in tensors:
        ref = low.frame_refs.get(t.node, (t.node, None, None, 1) if low.spatial(t.node) else None)
        if ref is None:
            return "a concatenation along time of a value that is not a video value"
        if src not in (None, ref[0]):
            raise refused(low, call, "a concatenation along time of frames of different values (a causal "
                          "cache carried over from an earlier call of a chunked loop, as CogVideoX's and "
                          "Mochi's conv_cache; the traced lowering reads no such cache yet)", final=True)
        src = ref[0]
        parts.append(ref[1:])
    low.tpads.update(_as_padding(parts, src, call.outs[0]))

    def fn(t, ctx, parts=tuple(parts)):
        return torch.cat([t[:, :, a:b].repeat(1, 1, r, 1, 1) for a, b, r in parts], dim=2)

    def frames_fn(t, step, parts=tuple(parts)):
        return sum(len(range(t)[a:b]) * r for a, b, r in parts)

    label = " + ".join(f"frames {_span(a, b)}" + (f" x{r}" if r > 1 else "") for a, b, r in parts)
    out = low.b.emit(Rearrange, (low.spatial(src),), op_name(call, "frames"), fn=fn, frames_fn=frames_fn,
                     label=label)
    low.set(call.outs[0], out)
    return True


def _as_padding(parts: list, src: int, out: int) -> dict:
    """{out: (src, front, back)} where the parts are src's first frame repeated, src, its last frame
    repeated (each optional but src), else {}."""
    whole = [k for k, p in enumerate(parts) if p == (None, None, 1)]
    if len(whole) != 1:
        return {}
    k = whole[0]
    before, after = parts[:k], parts[k + 1 :]
    if not all(p[:2] in ((None, 1), (0, 1)) for p in before) or not all(p[:2] == (-1, None) for p in after):
        return {}
    return {out: (src, sum(p[2] for p in before), sum(p[2] for p in after))}


def _group_norm(low: Lowering, i: int, call: Call) -> str:
    raise refused(low, call, "a GroupNorm of a video value: its statistics are over groups x frames x "
                  "space, a sync over the whole video, which the video executor does not run", final=True)


def _span(a, b) -> str:
    return f"{'' if a is None else a}:{'' if b is None else b}"


def _triple(v) -> tuple[int, int, int]:
    return tuple(int(x) for x in v) if isinstance(v, list | tuple) else (int(v),) * 3


VIDEO_RULES = {"conv3d": _conv3d, "__getitem__": _frames_item, "repeat": _repeat, "cat": _frames_cat,
               "concatenate": _frames_cat, "concat": _frames_cat, "group_norm": _group_norm}
