"""A video value with axes folded into the batch for a computation row by row:

- its frames, for a GroupNorm of each frame: Mochi's MochiChunkedGroupNorm3D runs
  `x.permute(0, 2, 1, 3, 4).flatten(0, 1)` ((B T, C, H, W)), `group_norm` of each chunk of
  `split(8, dim=0)`, `cat(dim=0)` and `.unflatten(0, (B, -1)).permute(0, 2, 1, 3, 4)` back (Cosmos'
  CosmosCausalGroupNorm the same without the chunks). A GroupNorm of a (B T, C, H, W) value takes
  statistics per row (one frame of one sample) over the whole frame, so the chain is a `FrameGroupNorm`
  of the video value whatever the chunks (each normed by the same GroupNorm, rejoined in order);
- its positions, for an attention over each position's frames: Mochi's encoder runs
  `x.permute(0, 3, 4, 2, 1).flatten(0, 2)` ((B H W, T, C) tokens), diffusers' Attention of each chunk
  of positions (`x[i : i + 2**15]`), `cat`, `.unflatten(0, (B, H, W)).permute(0, 4, 3, 1, 2)` back: a
  `ColumnAttention` of the video value (its module run on each box's columns).

The permute is placed only where such a row computation follows it, or (its frames) a flatten of them
into the batch (else the other rules and the measured ones take it); the calls between are followed by
the rows of the folded value they hold (`Lowering.folds`). A value with all its frames in the batch is
a batched value (`video_batch`: the 2-D calls on it are placed frame by frame; its rows sliced or split
come back here, and it goes back to the video value through (B, T, ...) and the permute back, also from
SVD's `x[None, :].reshape(B, T, C, H, W)`). Any other call on the folded value is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch.nn.functional as F

from ..ops3d import Rearrange
from ..ops3d_sync import ColumnAttention, FrameGroupNorm
from .capture import Call, Ref
from .state import Lowering, arg_of, const_value, op_name, permutation, reaches, refused
from .video_rows import rows_rule

ALIASES = {"contiguous", "clone", "detach"}
RESHAPES = {"reshape", "view"}
CATS = {"cat", "concat", "concatenate"}


@dataclass(frozen=True)
class Fold:
    """One way of folding a video value's axes into the batch: the permute in, how many of its leading
    axes become the batch, the permute back, the row computation (a call name) and what it is."""

    into: tuple
    rows: int
    back: tuple
    row_call: str
    what: str


FOLDS: dict[tuple, Fold] = {f.into: f for f in (
    Fold((0, 2, 1, 3, 4), 2, (0, 2, 1, 3, 4), "group_norm", "its frames in the batch, for a GroupNorm of "
         "each frame (permute(0, 2, 1, 3, 4), flatten(0, 1), split / chunk along the batch, group_norm, cat, "
         "unflatten and permute back)"),
    Fold((0, 3, 4, 2, 1), 3, (0, 4, 3, 1, 2), "Attention", "its positions in the batch, for an attention "
         "over each position's frames (permute(0, 3, 4, 2, 1), flatten(0, 2), slices along the batch, "
         "Attention, cat, unflatten and permute back)"),
)}


FRAMES = FOLDS[(0, 2, 1, 3, 4)]  # (a video value's frames into the batch)


def fold_rule(low: Lowering, i: int, call: Call, dims: tuple) -> bool:
    """A permute of a video value that folds axes into the batch (`FOLDS`) for a row computation that
    reads what the next calls make of it (or, its frames, flattened into the batch); False for any other
    permute."""
    x, fold = arg_of(call, 0, "input"), FOLDS.get(dims)
    if fold is None or not isinstance(x, Ref):
        return False
    if not reaches(low, i, call.outs[0], fold.row_call) and not (fold is FRAMES and _flattens(low, i, call)):
        return False
    src, pad = x.node, low.pads.get(x.node)
    if pad is not None and fold is FRAMES and len(pad[1]) == 4:  # (an F.pad in space rides to the conv2d)
        src = pad[0]
        low.pads[call.outs[0]] = low.pads.pop(x.node)
    low.folds[call.outs[0]] = ("first", low.spatial(src), 0, 0, tuple(low.cap.values[call.outs[0]].shape),
                               fold)
    return True


def fold_call(low: Lowering, i: int, call: Call) -> None:
    """A call on a video value's folded axes (module docstring); LoweringError for any other."""
    layout, name, a, b, first, fold = next(low.folds[n] for n in call.refs() if n in low.folds)
    out = call.outs[0] if len(call.outs) == 1 else None
    vals = low.cap.values
    n = prod(first[: fold.rows])
    flat = (n, *first[fold.rows :])
    shape = tuple(vals[out].shape) if out is not None else None

    def put(node, layout, name, a, b):
        low.folds[node] = (layout, name, a, b, first, fold)

    if call.name in ALIASES and out is not None:
        put(out, layout, name, a, b)
    elif layout == "first" and call.name == "permute" and permutation(call) == fold.back:
        low.set(out, name)
    elif layout == "lead" and call.name in RESHAPES and shape == first:  # (x[None, :].reshape(B, T, ...))
        put(out, "first", name, 0, 0)
    elif layout == "first" and shape == flat and (call.name in RESHAPES or call.name == "flatten" and (
            arg_of(call, 1, "start_dim", 0), arg_of(call, 2, "end_dim", -1)) == (0, fold.rows - 1)):
        if fold is FRAMES:  # (every frame in the batch: a batched value, `video_batch`)
            batch(low, out, name, first)
            padded = next((n for n in call.refs() if n in low.pads), None)
            if padded is not None:  # (its F.pad in space, for the conv2d of every frame)
                low.pads[out] = low.pads.pop(padded)
        else:
            put(out, "batch", name, 0, n)
    elif layout == "batch" and call.name in ("split", "chunk") and arg_of(call, 2, "dim", 0) in (0, -len(
            flat)):
        at = a
        for node in call.outs:
            put(node, "batch", name, at, at + int(vals[node].shape[0]))
            at += int(vals[node].shape[0])
    elif layout == "batch" and call.name == "__getitem__" and _rows(arg_of(call, 1, "indices"), b - a):
        start, stop = _rows(arg_of(call, 1, "indices"), b - a)
        put(out, "batch", name, a + start, a + stop)
    elif layout == "batch" and call.name == fold.row_call:
        put(out, "batch", row_op(low, call, name, fold), a, b)
    elif layout == "batch" and call.name in CATS and arg_of(call, 1, "dim", 0) in (0, -len(flat)):
        parts = [low.folds.get(t.node) if isinstance(t, Ref) else None for t in arg_of(call, 0, "tensors")]
        joined = all(p is not None and p[:2] == ("batch", name) for p in parts) and all(
            p[3] == q[2] for p, q in zip(parts, parts[1:], strict=False))
        if not joined:
            raise refused(low, call, "a concatenation along the batch of rows that are not those of one "
                          "value in order (its chunks rejoined)", final=True)
        if fold is FRAMES and (parts[0][2], parts[-1][3]) == (0, n):
            batch(low, out, name, first)
        else:
            put(out, "batch", name, parts[0][2], parts[-1][3])
    elif fold is FRAMES and layout in ("first", "channels") and _channels(low, call, layout, first):
        pass  # (its frames in the channels, for a nearest interpolation of each channel: `_channels`)
    elif layout == "first" and call.name == "permute" and rows_rule(low, i, call, name, fold.into):
        pass  # (its positions in the batch for a computation along time, `video_rows`)
    elif layout == "batch" and (a, b) == (0, n) and shape == first and (
            call.name in RESHAPES or call.name == "unflatten" and arg_of(call, 1, "dim") in (0, -len(flat))):
        put(out, "first", name, 0, 0)
    else:
        raise refused(low, call, f"a call on a video value with {fold.what} other than those", final=True)


def _channels(low: Lowering, call: Call, layout: str, first: tuple) -> bool:
    """KVAE's upsampler's `x.permute(0, 2, 1, 3, 4).reshape(B, T C, H, W)` (its frames in the channels),
    a nearest interpolation in space of that (each channel alike: of each frame), `view(B, T, C, H', W')`
    back: a Rearrange of space of the video value; False for another call."""
    out = call.outs[0] if len(call.outs) == 1 else None
    shape = tuple(low.cap.values[out].shape) if out is not None else ()
    _, name, _, _, _, fold = next(low.folds[n] for n in call.refs() if n in low.folds)
    b, t, c, h, w = first
    if layout == "first" and call.name in RESHAPES and shape == (b, t * c, h, w):
        low.folds[out] = ("channels", name, 0, 0, first, fold)
    elif layout == "channels" and call.name in RESHAPES and shape == first:
        low.folds[out] = ("first", name, 0, 0, first, fold)
    elif layout == "channels" and call.name == "interpolate" and len(shape) == 4 and shape[:2] == (b, t * c):
        mode = arg_of(call, 3, "mode", "nearest")
        s = shape[2] // h
        if mode != "nearest" or shape[2:] != (h * s, w * s) or arg_of(call, 7, "antialias", False):
            return False
        up = low.b.emit(Rearrange, (name,), op_name(call, "interpolate"), up=s, label=f"nearest x1,{s},{s}",
                        fn=lambda x, ctx, s=s: F.interpolate(x, scale_factor=(1, s, s), mode="nearest"))
        low.folds[out] = ("channels", up, 0, 0, (b, t, c, h * s, w * s), fold)
    else:
        return False
    return True


def batch(low: Lowering, node: int, name: str, first: tuple) -> None:
    """Node: video value `name` with its frames in the batch ((B, T) = first[:2]), a batched value."""
    low.set(node, name)
    low.batched[node] = (int(first[0]), int(first[1]))


def row_op(low: Lowering, call: Call, x: str, fold: Fold) -> str:
    """The op of video value x for this row computation (one op for every chunk computed alike): a
    FrameGroupNorm for a group_norm of its frames, a ColumnAttention for an Attention of its positions."""
    if fold.row_call == "group_norm":
        weight, bias = const_value(low, arg_of(call, 2, "weight")), const_value(low, arg_of(call, 3, "bias"))
        groups, eps = int(arg_of(call, 1, "num_groups")), float(arg_of(call, 4, "eps", 1e-5))
        key = (x, groups, eps, id(weight), id(bias))
        if key not in low.row_ops:
            low.row_ops[key] = low.b.emit(FrameGroupNorm, (x,), call.where, groups=groups, eps=eps,
                                              weight=weight, bias=bias)
        return low.row_ops[key]
    a = call.module
    why = _column_attention(a, call)
    if why:
        raise refused(low, call, why, final=True)
    key = (x, id(a))
    if key not in low.row_ops:
        low.row_ops[key] = low.b.emit(ColumnAttention, (x,), call.where, module=a)
    return low.row_ops[key]


def _column_attention(a, call: Call) -> str:
    """Why an Attention over each position's frames is not one a ColumnAttention runs as it is (other
    inputs, a mask, norms over its tokens, a processor not known to attend within each sequence), or ""."""
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0, MochiVaeAttnProcessor2_0

    known = (AttnProcessor, AttnProcessor2_0, MochiVaeAttnProcessor2_0)
    if type(a).__name__ != "Attention" or type(a.processor) not in known:
        return (f"an Attention over each position's frames with processor {type(a.processor).__name__} "
                f"(placed: {', '.join(p.__name__ for p in known)})")
    if len(call.args) > 1 or any(v is not None for v in call.kwargs.values()):
        return "an Attention over each position's frames with other inputs (cross attention or a mask)"
    if a.group_norm is not None or a.spatial_norm is not None:
        return "an Attention over each position's frames with a GroupNorm or spatial norm of its tokens"
    return ""


def _rows(idx, n: int) -> tuple[int, int] | None:
    """(start, stop) of x[a:b] (or x[a:b, ...]) along the batch, a step-1 slice; None for another index."""
    rest = isinstance(idx, tuple) and idx and all(s in (slice(None), Ellipsis) for s in idx[1:])
    sl = idx[0] if rest else idx
    if not isinstance(sl, slice) or sl.step not in (None, 1):
        return None
    r = range(n)[sl]
    return r.start, r.start + len(r)


def _flattens(low: Lowering, i: int, call: Call) -> bool:
    """Whether the one call reading a permute's output (B, T, C, H, W) flattens it to (B T, C, H, W)."""
    node = call.outs[0]
    readers = [c for c in low.cap.calls[i + 1 :] if node in c.refs()]
    if len(readers) != 1 or readers[0].name not in RESHAPES | {"flatten"} or len(readers[0].outs) != 1:
        return False
    shape, made = tuple(low.cap.values[node].shape), tuple(low.cap.values[readers[0].outs[0]].shape)
    b, t, c, h, w = shape  # (into the batch, or into the channels: `_channels`)
    return made == (b * t, c, h, w) or made == (b, t * c, h, w) and readers[0].name in RESHAPES
