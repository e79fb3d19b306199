"""Samplings of a video value computed as KVAE video's and Kandinsky 6 SR's samplers compute them:

- `x.repeat_interleave(n, dim=2)`: every frame n times in a row (a `Rearrange` of the frames);
- `avg_pool3d` of windows of frames (kernel and stride (k, 1, 1); an F.pad in time before it merged:
  VidTok's downsampler): a `Rearrange` of the frames;

- with its frames in the batch (`video_batch`), `pixel_unshuffle` / `pixel_shuffle` of every frame (a
  `Rearrange` of space and channels), and a view of its channels into groups,
  (B T, C / g, g, H, W), reduced by `mean(dim=2)`: the mean of each group of channels (a `Rearrange`);
- with its positions in the batch for a computation along time, `x.permute(0, 3, 4, 1, 2).reshape(B H W,
  C, T)` (each position's frames in a row): its frames sliced (`[..., a:b]`: a value's first frame and
  the others are the first step's, `video_frames.frame_slice`; the first squeezed, `[..., 0]`, and
  back, `[..., None]`: CogVideoX's), averaged in windows of k frames (`avg_pool1d` of
  kernel = stride k: a `Rearrange` of the frames, t -> t // k), concatenated back in order (the parts
  of one split of frames: a `FrameCat`) and `.view(B, H, W, C, T').permute(0, 3, 4, 1, 2)` back to the
  video value. Any other call on such a value is refused by name, finally.
"""

from __future__ import annotations

import torch.nn.functional as F

from ..ops3d import Rearrange, fold, unfold
from ..ops3d_sync import FrameCat
from .capture import Call, Ref
from .state import Lowering, arg_of, op_name, permutation, refused
from .video_frames import frame_slice

COLUMNS = (0, 3, 4, 1, 2)  # (B, C, T, H, W) -> (B, H, W, C, T)
RESHAPES = ("reshape", "view")
SQUEEZES = ((Ellipsis, 0), (Ellipsis, None))  # (the rows' first frame squeezed, and back)


def repeat_interleave_rule(low: Lowering, i: int, call: Call) -> bool | str:
    """x.repeat_interleave(n, dim=2): every frame n times in a row (KVAE's temporal upsampler)."""
    x, n, dim = arg_of(call, 0, "input"), arg_of(call, 1, "repeats"), arg_of(call, 2, "dim")
    if not isinstance(x, Ref) or low.spatial(x.node) is None or dim not in (2, -3):
        return False
    if x.node in low.frame_refs and low.cap.values[x.node].shape[2] == 1:
        return False  # (one frame of a value n times: a repeat of it, the 2-D rules' (Cosmos' patcher))
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return f"repeat_interleave of a video value's frames by {n!r} (a number of times is placed)"
    out = low.b.emit(Rearrange, (low.spatial(x.node),), op_name(call, "repeat_interleave"),
                     fn=lambda t, ctx, n=n: t.repeat_interleave(n, dim=2),
                     frames_fn=lambda t, step, n=n: t * n,
                     label=f"frames each x{n}")
    low.set(call.outs[0], out)
    return True


def avg_pool3d_rule(low: Lowering, i: int, call: Call) -> bool | str:
    """avg_pool3d of a video value (maybe padded in time, an F.pad before it) over windows of frames only
    (kernel and stride (k, 1, 1), no padding of its own: VidTok's temporal downsampler): position by
    position, a Rearrange of the frames, t -> (t + padding - k) // s + 1."""
    x = arg_of(call, 0, "input")
    if not isinstance(x, Ref) or low.spatial(x.node) is None and x.node not in low.pads:
        return False
    src, pad, mode = low.pads.get(x.node, (x.node, (0,) * 6, "zeros"))
    k, s = _triple(arg_of(call, 1, "kernel_size")), arg_of(call, 2, "stride", None)
    s = k if s is None or s == [] else _triple(s)
    padding, ceil = _triple(arg_of(call, 3, "padding", 0)), arg_of(call, 4, "ceil_mode", False)
    pad = (*pad, 0, 0)[:6]
    if k[1:] != (1, 1) or s[1:] != (1, 1) or any(padding) or ceil or any(pad[:4]) or low.spatial(src) is None:
        return (f"avg_pool3d of a video value with kernel {k}, stride {s}, padding {padding}, an F.pad {pad} "
                "before it (placed: windows of frames, kernel and stride (k, 1, 1), padded in time only)")
    if arg_of(call, 6, "divisor_override") is not None:
        return "avg_pool3d with a divisor_override"
    front, back, mode = pad[4], pad[5], "constant" if mode == "zeros" else mode

    def fn(t, ctx, k=k, s=s, pad=pad, mode=mode):
        return F.avg_pool3d(F.pad(t, pad, mode=mode) if any(pad) else t, k, s)

    out = low.b.emit(Rearrange, (low.spatial(src),), op_name(call, "avg_pool"), fn=fn,
                     frames_fn=lambda t, step, k=k[0], s=s[0], p=front + back: (t + p - k) // s + 1,
                     label=f"mean of {k[0]} frames, stride {s[0]}")
    low.set(call.outs[0], out)
    return True


def _triple(v) -> tuple[int, int, int]:
    return tuple(int(x) for x in v) if isinstance(v, list | tuple) else (int(v),) * 3


def shuffle_batched(low: Lowering, i: int, call: Call, src: int) -> bool | str:
    """pixel_unshuffle / pixel_shuffle of a video value's frames in the batch: of every frame."""
    x = arg_of(call, 0, "input")
    if x != Ref(src) or low.spatial(src) is None:
        return False
    up = call.name == "pixel_shuffle"
    r = int(arg_of(call, 1, "upscale_factor" if up else "downscale_factor"))
    fn = F.pixel_shuffle if up else F.pixel_unshuffle
    out = low.b.emit(Rearrange, (low.spatial(src),), op_name(call, call.name), down=1 if up else r,
                     up=r if up else 1, channels=int(low.cap.values[call.outs[0]].shape[1]),
                     fn=lambda t, ctx, fn=fn, r=r: unfold(fn(fold(t), r), t.shape[0], t.shape[2]),
                     label=f"{call.name} {r} per frame")
    low.set(call.outs[0], out)
    return True


def group_view(low: Lowering, call: Call, src: int) -> bool:
    """view(B T, C / g, g, H, W) of a video value's frames in the batch: its channels in groups of g,
    remembered for the mean over each group (`group_call`); False for another shape."""
    n, c, h, w = low.cap.values[src].shape
    shape = tuple(low.cap.values[call.outs[0]].shape)
    if len(shape) != 5 or shape[0] != n or shape[3:] != (h, w) or shape[1] * shape[2] != c:
        return False
    low.groups[call.outs[0]] = (src, int(shape[2]))
    return True


def group_call(low: Lowering, i: int, call: Call) -> None:
    """mean(dim=2) of a video value's frames' channels in groups (`group_view`): each group's mean."""
    node = next(n for n in call.refs() if n in low.groups)
    src, g = low.groups[node]
    dim, keep = arg_of(call, 1, "dim"), arg_of(call, 2, "keepdim", False)
    if call.name != "mean" or dim not in (2, (2,), [2], -3) or keep or arg_of(call, 0, "input") != Ref(node):
        raise refused(low, call, "a call on a video value's frames' channels in groups other than their "
                      "mean over each group (mean(dim=2))", final=True)
    c = int(low.cap.values[src].shape[1]) // g
    out = low.b.emit(Rearrange, (low.spatial(src),), op_name(call, "mean"), channels=c,
                     fn=lambda t, ctx, c=c, g=g: t.unflatten(1, (c, g)).mean(2),
                     label=f"mean of {g} channels")
    low.set(call.outs[0], out)
    low.batched[call.outs[0]] = low.batched[src]


def columns_rule(low: Lowering, i: int, call: Call) -> bool:
    """x.permute(0, 3, 4, 1, 2) of a video value whose one reader reshapes it to (B H W, C, T): each
    position's frames a row (module docstring); False for another permute."""
    x = arg_of(call, 0, "input")
    if permutation(call) != COLUMNS or not isinstance(x, Ref) or low.spatial(x.node) is None:
        return False
    readers = [c for c in low.cap.calls[i + 1 :] if call.outs[0] in c.refs()]
    b, h, w, c, t = low.cap.values[call.outs[0]].shape
    if len(readers) != 1 or readers[0].name not in RESHAPES or len(readers[0].outs) != 1 or tuple(
            low.cap.values[readers[0].outs[0]].shape) != (b * h * w, c, t):
        return False
    if not _placed(low, i, call.outs[0]):  # (other calls on the rows: the module around them measured)
        return False
    low.columns[call.outs[0]] = (low.spatial(x.node), "permuted")
    return True


def _placed(low: Lowering, i: int, node: int) -> bool:
    """Whether every call on what the columns' calls after call i make of node, up to the permute back,
    is one `column_call` places (frame slices, avg_pool1d of whole windows, cat, reshapes)."""
    nodes = {node}
    for c in low.cap.calls[i + 1 :]:
        if not nodes & set(c.refs()):
            continue
        if c.name == "permute":
            return True
        idx = arg_of(c, 1, "indices")
        item = c.name == "__getitem__" and (_span(idx) is not None or idx in SQUEEZES)
        ok = c.name in RESHAPES or c.name in ("cat", "concat", "concatenate") or item or (
            c.name == "avg_pool1d" and _pool(c) is not None)
        if not ok:
            return False
        nodes.update(c.outs)
    return False


def column_call(low: Lowering, i: int, call: Call) -> None:
    """A call on a video value's columns (module docstring); LoweringError for any other."""

    nodes = [n for n in call.refs() if n in low.columns]
    name, layout = low.columns[nodes[0]]
    out = call.outs[0] if len(call.outs) == 1 else None
    vals = low.cap.values
    if layout == "permuted" and call.name in RESHAPES:
        low.columns[out] = (name, "rows")
    elif layout == "rows" and call.name == "__getitem__" and _span(arg_of(call, 1, "indices")) is not None:
        a, b = _span(arg_of(call, 1, "indices"))
        fn, frames_fn = frame_slice(a, b)
        made = low.b.emit(Rearrange, (name,), op_name(call, "frames"), fn=fn, frames_fn=frames_fn,
                          label=f"frames {'' if a is None else a}:{'' if b is None else b}")
        low.columns[out] = (made, "rows")
        if (a, b) in ((None, 1), (0, 1), (1, None)):
            low.frame_parts[out] = (nodes[0], 0 if b == 1 else 1, 2)
    elif layout == "rows" and call.name == "__getitem__" and arg_of(call, 1, "indices") == (Ellipsis, 0):
        fn, frames_fn = frame_slice(None, 1)  # (the first frame, squeezed: CogVideoX's downsampler's)
        made = low.b.emit(Rearrange, (name,), op_name(call, "frames"), fn=fn, frames_fn=frames_fn,
                          label="frames :1")
        low.columns[out] = (made, "squeezed")
        low.frame_parts[out] = (nodes[0], 0, 2)
    elif layout == "squeezed" and call.name == "__getitem__" and arg_of(call, 1, "indices") == (Ellipsis,
                                                                                                 None):
        low.columns[out] = (name, "rows")
        low.frame_parts[out] = low.frame_parts[nodes[0]]
    elif layout == "rows" and call.name == "avg_pool1d" and _pool(call) is not None:
        k = _pool(call)
        made = low.b.emit(Rearrange, (name,), op_name(call, "avg_pool"),
                          frames_fn=lambda t, step, k=k: t // k,
                          fn=lambda t, ctx, k=k: _mean_frames(t, k),
                          label=f"mean of {k} frames")
        low.columns[out] = (made, "rows")
        if nodes[0] in low.frame_parts:
            low.frame_parts[out] = low.frame_parts[nodes[0]]
    elif layout == "rows" and call.name in ("cat", "concat", "concatenate") and _parts(low, call):
        srcs = tuple(low.columns[t.node][0] for t in arg_of(call, 0, "tensors"))
        low.columns[out] = (low.b.emit(FrameCat, srcs, op_name(call, "frames")), "rows")
    elif layout == "rows" and call.name in RESHAPES and vals[out].ndim == 5 and vals[out].shape[3:] == vals[
            nodes[0]].shape[1:]:
        low.columns[out] = (name, "unpermuted")
    elif layout == "unpermuted" and call.name == "permute" and permutation(call) == (0, 3, 4, 1, 2):
        low.set(out, name)
    else:
        raise refused(low, call, "a call on a video value's positions in the batch (each position's frames "
                      "a row) other than frame slices, avg_pool1d of whole windows, their concatenation "
                      "back and the view and permute back", final=True)


def _span(idx) -> tuple | None:
    """(a, b) of x[..., a:b] (the last axis: frames), or None."""
    if idx == (Ellipsis, 0):
        return None
    if not isinstance(idx, tuple) or len(idx) != 2 or idx[0] is not Ellipsis or not isinstance(idx[1], slice):
        return None
    sl = idx[1]
    return (sl.start, sl.stop) if sl.step in (None, 1) else None


def _pool(call: Call) -> int | None:
    """k of avg_pool1d(x, k, k) (no padding, floor): windows of k frames; None for another pooling."""
    k, s = arg_of(call, 1, "kernel_size"), arg_of(call, 2, "stride", None)
    pad, ceil = arg_of(call, 3, "padding", 0), arg_of(call, 4, "ceil_mode", False)
    k = k[0] if isinstance(k, list | tuple) else k
    s = k if s is None or s == [] else s[0] if isinstance(s, list | tuple) else s
    return int(k) if s == k and pad in (0, (0,), [0]) and not ceil else None


def _parts(low: Lowering, call: Call) -> bool:
    """Whether a concatenation along the rows' frames joins a split of one value's frames in order."""
    tensors, dim = arg_of(call, 0, "tensors"), arg_of(call, 1, "dim", 0)
    if dim not in (-1, 2) or not all(isinstance(t, Ref) and t.node in low.columns for t in tensors):
        return False
    parts = [low.frame_parts.get(t.node) for t in tensors]
    return all(p is not None for p in parts) and len({p[0] for p in parts}) == 1 and [
        p[1] for p in parts] == list(range(len(parts)))



def _mean_frames(t, k: int):
    """The mean of each window of k frames of a (B, C, T, H, W) value (none where fewer than k)."""
    return F.avg_pool3d(t, (k, 1, 1)) if t.shape[2] >= k else t[:, :, :0]
