"""A video value with its frames folded into the batch for a 2-D computation of each frame: Stable Video
Diffusion's temporal decoder runs on (B T, C, H, W) values (`decode(z, num_frames)`), each frame a row of
its 2-D layers (conv2d, GroupNorms of each frame, nearest upsampling, an Attention over each frame's
tokens), and unfolds them into (B, C, T, H, W) for the layers that mix frames (`x[None, :].reshape(B,
T, C, H, W).permute(0, 2, 1, 3, 4)`, and back `.permute(0, 2, 1, 3, 4).reshape(B T, C, H, W)`).

Such a value (`Lowering.batched`, made where `video_fold` flattens a video value's frames into the
batch) is carried by the program as the video value, and each call on it placed as the video op that
computes the same on every frame: conv2d a `FrameConv` (an F.pad before it merged), group_norm a
`FrameGroupNorm`, nearest interpolation by an integer factor a `Rearrange` of space, diffusers' Attention
a `FrameGroupNorm` (its norm) and a `StepAttention` over each frame's own tokens, pixel (un)shuffles
and means over groups of channels (`video_pools`); elementwise functions,
sums and channel slices / concatenations by the 2-D rules (`two_d`: a replayed call that reads other
tensors runs with the frames folded back around it, `frames.carry`). Its rows sliced or split (chunks of
frames) and its reshapes back to (B, T, ...) or x[None, :] go to `video_fold`. Any other call on it is
refused by name, unless the module around it is measured (`measured.opaque`: run with the frames folded
back around it, `frames.carry`; VidTok's LayerNorms over the channels through a permute, position by
position).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F

from ..ops3d import FrameConv, Rearrange
from ..ops3d_sync import FrameGroupNorm, StepAttention
from ..units import check_attention
from .capture import Call, Ref
from .layers import pair
from .state import Lowering, arg_of, const_value, is_attention, op_name, refused
from .video_fold import FRAMES, RESHAPES, row_op
from .video_pools import group_view, shuffle_batched

# calls the 2-D rules place on a batched value as they are (position by position, or along channels)
TWO_D = {"pad", "cat", "concat", "concatenate", "chunk", "split", "__getitem__", "repeat_interleave",
         "repeat"}


def batch_call(low: Lowering, i: int, call: Call, two_d: Callable, elementwise: set[str]) -> None:
    """Place a call on a batched value (module docstring); `two_d(low, i, call)` is the 2-D rules' placing
    of a call, tried for the calls of `TWO_D` and `elementwise`. LoweringError for any other call."""
    src = next(n for n in call.refs() if n in low.batched)
    rule = RULES.get(call.name) or (_attention if call.module is not None and is_attention(call.module)
                                    else None)
    placed = rule(low, i, call, src) if rule is not None else False
    if placed is False and (call.name in TWO_D or call.name in elementwise) and call.module is None:
        placed = two_d(low, i, call)
    if placed is not True:
        raise refused(low, call, (placed or "no rule places it") + " (on a video value's frames folded "
                      "into the batch: placed are conv2d, group_norm, nearest interpolation, diffusers' "
                      "Attention, elementwise functions, channel slices and concatenations, rows of the "
                      "batch and the reshapes back to (B, T, ...))")
    for n in call.outs:  # (what the 2-D rules made of it: its frames are still in the batch)
        made = low.spatial(n) is not None or n in low.pads
        if made and n not in low.folds and low.cap.values[n].ndim == 4:
            low.batched[n] = low.batched[src]


def _first(low: Lowering, src: int) -> tuple:
    """The (B, T, C, H, W) shape of a batched value's frames unfolded."""
    return (*low.batched[src], *low.cap.values[src].shape[1:])


def _conv(low: Lowering, i: int, call: Call, src: int) -> bool | str:
    """conv2d of every frame: a FrameConv (an F.pad of the batched value before it merged)."""
    x, w = arg_of(call, 0, "input"), arg_of(call, 1, "weight")
    if not isinstance(x, Ref) or not isinstance(w, Ref) or w.node in low.batched or low.spatial(w.node):
        return "a convolution with a weight computed from the input"
    stride, dilation = pair(arg_of(call, 3, "stride", 1)), pair(arg_of(call, 5, "dilation", 1))
    padding, weight = arg_of(call, 4, "padding", 0), const_value(low, w)
    if dilation != (1, 1):
        return f"conv2d with dilation {dilation} of a video value's frames (FrameConv does not dilate)"
    if isinstance(padding, str):
        if padding != "valid":
            return f"conv2d padding={padding!r} of a video value's frames (explicit or 'valid' is placed)"
        padding = 0
    ph, pw = pair(padding)
    pad, node, mode = (ph, ph, pw, pw), x.node, "zeros"
    if node in low.pads:  # (an F.pad right before: the convolution pads itself, maybe not with zeros)
        node, (left, right, top, bottom), mode = low.pads.pop(node)
        if mode != "zeros" and any(pad):
            return "an F.pad of another mode before a zero-padded convolution"
        pad = (pad[0] + top, pad[1] + bottom, pad[2] + left, pad[3] + right)
    name = low.spatial(node)
    if name is None:
        return False
    bias = const_value(low, arg_of(call, 2, "bias"))
    out = low.b.emit(FrameConv, (name,), call.where, weight=weight, bias=bias, stride=stride, padding=pad,
                     groups=int(arg_of(call, 6, "groups", 1)), padding_mode=mode)
    low.set(call.outs[0], out)
    return True


def _group_norm(low: Lowering, i: int, call: Call, src: int) -> bool | str:
    """group_norm of (B T, C, H, W): statistics of each frame, a FrameGroupNorm of the video value."""
    x = arg_of(call, 0, "input")
    if not isinstance(x, Ref) or low.spatial(x.node) is None:
        return False
    low.set(call.outs[0], row_op(low, call, low.spatial(x.node), FRAMES))
    return True


def _interpolate(low: Lowering, i: int, call: Call, src: int) -> bool | str:
    """Nearest interpolation of every frame by an integer factor (Upsample2D): a Rearrange of space."""
    x, mode = arg_of(call, 0, "input"), arg_of(call, 3, "mode", "nearest")
    if mode not in ("nearest", "nearest-exact") or arg_of(call, 7, "antialias", False):
        return f"interpolate mode={mode!r} of a video value's frames (nearest by an integer factor is placed)"
    (h, w), (h2, w2) = low.cap.values[x.node].shape[-2:], low.cap.values[call.outs[0]].shape[-2:]
    if h2 % h or w2 % w or h2 // h != w2 // w:
        return (f"interpolate of a video value's frames from {h}x{w} to {h2}x{w2} (one integer factor is "
                "placed)")
    s = h2 // h
    out = low.b.emit(Rearrange, (low.spatial(x.node),), op_name(call, "interpolate"), up=s,
                     label=f"nearest x{s}",
                     fn=lambda t, ctx, s=s: F.interpolate(t, scale_factor=(1, s, s), mode="nearest"))
    low.set(call.outs[0], out)
    return True


def _attention(low: Lowering, i: int, call: Call, src: int) -> bool | str:
    """diffusers Attention of (B T, C, H, W): over each frame's tokens, its GroupNorm of each frame."""
    a, x = call.module, arg_of(call, 0, "hidden_states")
    if type(a).__name__ != "Attention" or x != Ref(src) or len(call.refs()) != 1:
        return f"a {type(a).__name__} call with other inputs than one video value's frames"
    why = check_attention(a)
    if why:
        return why
    name = n = low.spatial(src)
    if a.group_norm is not None:
        g = a.group_norm
        n = low.b.emit(FrameGroupNorm, (name,), f"{call.where}.group_norm", groups=g.num_groups, eps=g.eps,
                       weight=g.weight if g.affine else None, bias=g.bias if g.affine else None)
    out = low.b.emit(StepAttention, (n, name), call.where, heads=a.heads, to_q=a.to_q, to_k=a.to_k,
                     to_v=a.to_v, to_out=a.to_out, residual=bool(a.residual_connection),
                     rescale=float(a.rescale_output_factor), causal=False, own_frame=True)
    low.set(call.outs[0], out)
    return True


def _rows(low: Lowering, i: int, call: Call, src: int) -> bool | str:
    """split / chunk along the batch (chunks of frames, `video_fold` follows them); False along others."""
    if arg_of(call, 2, "dim", 0) not in (0, -4):
        return False
    at = 0
    for node in call.outs:
        k = int(low.cap.values[node].shape[0])
        low.folds[node] = ("batch", low.spatial(src), at, at + k, _first(low, src), FRAMES)
        at += k
    return True


def _item(low: Lowering, i: int, call: Call, src: int) -> bool | str:
    """x[None, :] (SVD's way back to (B, T, ...)) or rows x[a:b]: followed by `video_fold`; False for a
    channel slice (the 2-D rules)."""
    idx = arg_of(call, 1, "indices")
    idx = idx if isinstance(idx, tuple) else (idx,)
    if idx and idx[0] is None and all(s == slice(None) for s in idx[1:]):
        low.folds[call.outs[0]] = ("lead", low.spatial(src), 0, 0, _first(low, src), FRAMES)
        return True
    rest = all(s in (slice(None), Ellipsis) for s in idx[1:])
    if isinstance(idx[0], slice) and idx[0] != slice(None) and rest:
        r = range(int(low.cap.values[src].shape[0]))[idx[0]]
        if r.step != 1:
            return f"rows {idx[0]!r} of a video value's frames in the batch (a step-1 slice is placed)"
        end = r.start + len(r)
        low.folds[call.outs[0]] = ("batch", low.spatial(src), r.start, end, _first(low, src), FRAMES)
        return True
    return False


def _reshape(low: Lowering, i: int, call: Call, src: int) -> bool | str:
    """(B T, C, H, W) back to (B, T, C, H, W) (view / reshape / unflatten): `video_fold`'s first layout."""
    first = _first(low, src)
    if call.name in RESHAPES | {"unflatten"} and tuple(low.cap.values[call.outs[0]].shape) == first:
        low.folds[call.outs[0]] = ("first", low.spatial(src), 0, 0, first, FRAMES)
        return True
    if call.name in RESHAPES and group_view(low, call, src):  # (its channels in groups, `video_pools`)
        return True
    shape = tuple(low.cap.values[call.outs[0]].shape)
    return f"{call.name} of a video value's frames in the batch to {shape}"


RULES: dict[str, Callable] = {"conv2d": _conv, "group_norm": _group_norm, "interpolate": _interpolate,
                              "split": _rows, "chunk": _rows, "__getitem__": _item, "reshape": _reshape,
                              "view": _reshape, "unflatten": _reshape, "flatten": _reshape,
                              "pixel_unshuffle": shuffle_batched, "pixel_shuffle": shuffle_batched}
