"""A causal convolution that loops over its input's windows of frames (Magvit's EasyAnimateCausalConv3d:
`F.pad` in time, then `conv3d(x[:, :, i : i + k])` for i = 0, s, 2 s, ... while a window fits, the outputs
concatenated along time): the frame slices of the padded value are remembered (no op), each conv3d of
one is remembered as a window of its convolution, and their concatenation, once it is every window of
one convolution in order (the same weight, bias, space stride, padding and groups, starts k s, as many as
fit), becomes that convolution over the whole value with stride s in time (`video._conv3d` places it,
its padding merged from what feeds it). The loop follows the example's frame count; the convolution it
computes follows any count, as the loop would.

An alias (`to`, `contiguous`) of a padded value, and an `F.pad` of a padded video value (Magvit's
downsampler pads in space, its convolution in time), stay paddings the convolution merges.
"""

from __future__ import annotations

from .capture import Call, Ref
from .state import Lowering, arg_of
from .video_writes import as_fronted

CATS = ("cat", "concat", "concatenate")
ALIASES = ("to", "contiguous", "clone", "detach", "float")


def window_item(low: Lowering, call: Call, x: Ref, sl) -> bool | str:
    """x[:, :, a:b] of a padded video value (an F.pad the convolution reading it merges): remembered."""
    if not isinstance(sl, slice) or sl.step not in (None, 1):
        return f"frames of a padded value indexed by {sl!r} (only a slice of frames is placed)"
    low.windows[call.outs[0]] = (x.node, sl.start, sl.stop)
    return True


def pad_alias(low: Lowering, i: int, call: Call) -> bool:
    """An alias of a padded video value (its dtype and shape kept): the same padding."""
    x = arg_of(call, 0, "input")
    if call.name not in ALIASES or not isinstance(x, Ref) or x.node not in low.pads or len(call.outs) != 1:
        return False
    t_in, t_out = low.cap.values[x.node], low.cap.values[call.outs[0]]
    if t_in.dtype != t_out.dtype or t_in.shape != t_out.shape:
        return False
    low.pads[call.outs[0]] = low.pads[x.node]
    return True


def pad_of_pad(low: Lowering, i: int, call: Call) -> bool | str:
    """F.pad of a padded video value (or of one with a causal cache in front, `video_caches`): a padding of
    that padding (merged by the convolution, last first)."""
    x, pad = arg_of(call, 0, "input"), tuple(arg_of(call, 1, "pad"))
    if not isinstance(x, Ref) or x.node not in low.pads and x.node not in low.caches or \
            low.cap.values[x.node].ndim != 5:
        return False
    mode, value = arg_of(call, 2, "mode", "constant"), arg_of(call, 3, "value", None)
    if len(pad) not in (4, 6) or any(p < 0 for p in pad) or mode == "constant" and (value or 0) != 0:
        return f"F.pad {pad} mode {mode!r} of a padded video value (zeros, replicate or reflect pad it)"
    if mode not in ("constant", "zeros", "replicate", "reflect"):
        return f"F.pad mode {mode!r} reads the opposite border (not a local padding)"
    low.pads[call.outs[0]] = (x.node, pad, "zeros" if mode in ("constant", "zeros") else mode)
    return True


def window_conv(low: Lowering, i: int, call: Call) -> bool | str:
    """conv3d of a window of frames a:b (of a padded value, or a slice of a video value, both ends given):
    remembered where its one reader is a concatenation along time (`windows_cat`); False for a slice of
    a video value read otherwise (a convolution of those frames, placed as one)."""
    x = arg_of(call, 0, "input")
    if not isinstance(x, Ref):
        return False
    if x.node in low.windows:
        src, a, b = low.windows[x.node]
    else:
        ref = low.frame_refs.get(x.node)
        if ref is None or ref[3] != 1 or not all(isinstance(e, int) and e >= 0 for e in ref[1:3]):
            return False
        src, a, b = ref[:3]
    readers = [c for c in low.cap.calls[i + 1 :] if call.outs[0] in c.refs()]
    written = len(readers) == 1 and readers[0].name == "__setitem__" and \
        arg_of(readers[0], 2, "") == Ref(call.outs[0])  # (into a buffer's frames, `video_writes`)
    if not written and (len(readers) != 1 or readers[0].name not in CATS
                        or arg_of(readers[0], 1, "dim", 0) not in (2, -3)):
        if x.node not in low.windows:
            return False
        return ("a 3-D convolution of a window of frames read other than concatenated along time with the "
                "other windows (only a causal convolution's loop over every window of its input is placed)")
    low.window_convs[call.outs[0]] = (call, src, a, b)
    return True


def windows_cat(low: Lowering, call: Call, tensors) -> Call | str | None:
    """The concatenation along time of every window's convolution of one value, in order: the conv3d
    call over the whole value that computes it, or why it is not one (None: it is no concatenation of
    windows). Windows of one frame each (Magvit's loop): stride in time their starts' step; windows of
    several (KVAE's first frames and the others, `video_writes`): the convolution's own stride, each
    window starting where the one before stopped reading."""
    found = [low.window_convs.get(t.node) if isinstance(t, Ref) else None for t in tensors]
    if not found or all(f is None for f in found):
        return None
    if any(f is None for f in found):
        return "a concatenation along time of a convolution's windows with other values"
    if len({f[1] for f in found}) > 1:  # (windows of a value and of it with its first frame in front)
        found = [(f[0], *as_fronted(low, f[1:])) for f in found]
    convs, srcs = [f[0] for f in found], {f[1] for f in found}
    if len(srcs) != 1 or len({_key(c) for c in convs}) != 1:
        return "a concatenation along time of windows of different values or different convolutions"
    src = srcs.pop()
    frames = int(low.cap.values[src].shape[2])
    spans = [(range(frames)[f[2] : f[3]]) for f in found]
    conv = convs[0]
    weight, dilation = arg_of(conv, 1, "weight"), _triple(arg_of(conv, 5, "dilation", 1))
    k = (int(low.cap.values[weight.node].shape[2]) - 1) * dilation[0] + 1
    outs = [int(low.cap.values[t.node].shape[2]) for t in tensors]
    if len(spans) < 2 and not call.kwargs.get("written"):  # (a loop: its stride shows in two windows)
        return "a convolution's loop over one window of frames (it does not show its stride)"
    if all(o == 1 for o in outs) and all(len(s) == k for s in spans) and len(spans) > 1:
        stride_t = _one_frame_stride(spans, frames, k)
    else:
        stride_t = _tiled_stride(spans, outs, frames, k, _triple(arg_of(conv, 3, "stride", 1))[0])
    if isinstance(stride_t, str):
        return stride_t
    stride = (stride_t, *_triple(arg_of(conv, 3, "stride", 1))[1:])
    args = (Ref(src), weight, arg_of(conv, 2, "bias"), stride, arg_of(conv, 4, "padding", 0), dilation,
            arg_of(conv, 6, "groups", 1))
    return Call(func=conv.func, args=args, kwargs={}, outs=list(call.outs), structure="tensor",
                where=conv.where)


def _one_frame_stride(spans: list[range], frames: int, k: int) -> int | str:
    """The stride in time of windows of k frames (one output each): their starts' step, where they are
    every window of the value in order; else why not."""
    starts = [s.start for s in spans]
    stride_t = starts[1] - starts[0]
    if stride_t < 1 or starts != list(range(0, frames - k + 1, stride_t)):
        return (f"a convolution's windows from frames {starts} of {frames} (every window of its input in "
                "order, one stride apart, is placed)")
    return stride_t


def _tiled_stride(spans: list[range], outs: list[int], frames: int, k: int, s: int) -> int | str:
    """The stride s of windows of a convolution of stride s in time (extent k) whose outputs together
    are its outputs over the whole value: each window starting s frames a output past the one before,
    the first at frame 0, as many outputs as fit; else why not."""
    start, why = 0, ""
    for span, o in zip(spans, outs, strict=True):
        if span.start != start or o != (len(span) - k) // s + 1:
            why = f"windows of frames {[(r.start, r.stop) for r in spans]} giving {outs} frames"
        start += s * o
    if why or sum(outs) != (frames - k) // s + 1:
        return (f"a convolution's {why or 'windows'} (of stride {s} over {frames} frames: windows end to end "
                "from frame 0 that give every output are placed)")
    return s


def _key(c: Call) -> tuple:
    """What the windows' convolutions must share: weight and bias (by node), stride in space, padding,
    dilation and groups."""
    w, bias = arg_of(c, 1, "weight"), arg_of(c, 2, "bias")
    return (w.node if isinstance(w, Ref) else id(w), bias.node if isinstance(bias, Ref) else bias,
            _triple(arg_of(c, 3, "stride", 1)), str(arg_of(c, 4, "padding", 0)),
            _triple(arg_of(c, 5, "dilation", 1)), arg_of(c, 6, "groups", 1))


def _triple(v) -> tuple[int, int, int]:
    return tuple(int(x) for x in v) if isinstance(v, list | tuple) else (int(v),) * 3
