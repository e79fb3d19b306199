"""The rules of 2-D layers on spatial values (of video values too, where the video rules leave them):
conv2d (an F.pad of zeros, replicate or reflect before it merged), group_norm, nearest interpolation by an
integer factor, pixel (un)shuffles (`rules` tries them with the others)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..ops import Conv, GroupNorm, Resample
from ..ops3d import Rearrange
from .capture import Call, Ref
from .state import Lowering, arg_of, const_value, op_name


def _conv(low: Lowering, i: int, call: Call) -> bool:
    x, w = arg_of(call, 0, "input"), arg_of(call, 1, "weight")
    if not isinstance(x, Ref) or not isinstance(w, Ref) or low.spatial(w.node) is not None:
        return False
    bias = arg_of(call, 2, "bias")
    stride = pair(arg_of(call, 3, "stride", 1))
    padding = arg_of(call, 4, "padding", 0)
    dilation = pair(arg_of(call, 5, "dilation", 1))
    groups = int(arg_of(call, 6, "groups", 1))
    weight = const_value(low, w)
    if isinstance(padding, str):
        if padding == "valid":
            padding = (0, 0)
        else:  # "same": stride 1, the total padding split as torch does (the extra on the bottom / right)
            total = [d * (k - 1) for d, k in zip(dilation, weight.shape[-2:], strict=True)]
            pad = (total[0] // 2, total[0] - total[0] // 2, total[1] // 2, total[1] - total[1] // 2)
            padding = None
    if padding is not None:
        ph, pw = pair(padding)
        pad = (ph, ph, pw, pw)
    src, mode = x.node, "zeros"
    if src in low.pads:  # an F.pad right before: the conv pads (asymmetrically, maybe not zeros) itself
        src, (left, right, top, bottom), mode = low.pads.pop(src)
        if mode != "zeros" and any(pad):
            return "an F.pad of another mode before a zero-padded convolution"
        pad = (pad[0] + top, pad[1] + bottom, pad[2] + left, pad[3] + right)
    name = low.spatial(src)
    if name is None:
        return False
    out = low.b.emit(Conv, (name,), call.where, weight=weight, bias=const_value(low, bias), stride=stride,
                     dilation=dilation, padding=pad, groups=groups, padding_mode=mode)
    low.set(call.outs[0], out)
    return True


def _pad(low: Lowering, i: int, call: Call) -> bool | str:
    """F.pad of zeros, or replicate / reflect (a Conv2d's padding_mode): merged into the conv reading it
    (of a video value: space and time, (left, right, top, bottom, front, back))."""
    x, pad = arg_of(call, 0, "input"), tuple(arg_of(call, 1, "pad"))
    mode, value = arg_of(call, 2, "mode", "constant"), arg_of(call, 3, "value", None)
    sides = 6 if low.cap.values[x.node].ndim == 5 else 4
    if low.spatial(x.node) is None or x.node in low.framed or len(pad) not in (4, sides) \
            or any(p < 0 for p in pad):
        return False
    if mode == "constant" and (value or 0) != 0:
        return f"F.pad with the value {value} (only zeros, replicate or reflect pad like a convolution)"
    if mode not in ("constant", "zeros", "replicate", "reflect"):
        return f"F.pad mode {mode!r} reads the opposite border (not a local padding)"
    low.pads[call.outs[0]] = (x.node, pad, "zeros" if mode in ("constant", "zeros") else mode)
    return True


def _group_norm(low: Lowering, i: int, call: Call) -> bool:
    x = arg_of(call, 0, "input")
    name = low.spatial(x.node) if isinstance(x, Ref) else None
    if name is None:
        return False
    weight, bias = const_value(low, arg_of(call, 2, "weight")), const_value(low, arg_of(call, 3, "bias"))
    out = low.b.emit(GroupNorm, (name,), call.where, groups=int(arg_of(call, 1, "num_groups")),
                     eps=float(arg_of(call, 4, "eps", 1e-5)), weight=weight, bias=bias)
    low.set(call.outs[0], out)
    return True


def _interpolate(low: Lowering, i: int, call: Call) -> bool:
    x = arg_of(call, 0, "input")
    name = low.spatial(x.node) if isinstance(x, Ref) else None
    mode = arg_of(call, 3, "mode", "nearest")
    # (nearest-exact picks floor((i + 1/2) / s) = floor(i / s): nearest, at the integer factors placed)
    if name is None or x.node in low.framed or mode not in ("nearest", "nearest-exact") \
            or arg_of(call, 7, "antialias", False):
        return False
    src, dst = low.cap.values[x.node].shape[-2:], low.cap.values[call.outs[0]].shape[-2:]
    if dst[0] % src[0] or dst[1] % src[1] or dst[0] // src[0] != dst[1] // src[1]:
        return False
    scale = dst[0] // src[0]
    factor = arg_of(call, 2, "scale_factor")
    if factor is not None and float(pair(factor)[0]) != scale:
        return False
    # (a `size`, e.g. SpatialNorm's f.shape[-2:], is taken as the integer ratio it has to the input on the
    # example, whose sides are uncommon: a size fixed whatever the input would not come out an exact ratio)
    out = low.b.emit(Resample, (name,), call.where, scale=scale)
    low.set(call.outs[0], out)
    return True


def _shuffle(low: Lowering, i: int, call: Call) -> bool:
    x = arg_of(call, 0, "input")
    name = low.spatial(x.node) if isinstance(x, Ref) and x.node not in low.framed else None
    if name is None:
        return False
    r = int(arg_of(call, 1, "upscale_factor" if call.name == "pixel_shuffle" else "downscale_factor"))
    up = call.name == "pixel_shuffle"
    fn = torch.nn.functional.pixel_shuffle if up else torch.nn.functional.pixel_unshuffle
    out = low.b.emit(Rearrange, (name,), op_name(call, call.name), fn=lambda t, ctx, fn=fn, r=r: fn(t, r),
                     down=1 if up else r, up=r if up else 1,
                     channels=int(low.cap.values[call.outs[0]].shape[1]), label=f"{call.name} {r}")
    low.set(call.outs[0], out)
    return True


LAYER_RULES: dict[str, Callable] = {
    "conv2d": _conv, "pad": _pad, "group_norm": _group_norm, "interpolate": _interpolate,
    "pixel_shuffle": _shuffle, "pixel_unshuffle": _shuffle,
}


def pair(v) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, list | tuple) else (int(v), int(v))
