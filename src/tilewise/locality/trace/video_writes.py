"""Video frames written into a buffer, and a padded value's first frame repeated in front of it.

- `torch.empty` (or `empty_like` of a video value) filled by writes of frame ranges
  (`buf[:, :, a:b] = v`, `buf[...] = v`; `capture` records a write from the input as a call making the
  buffer anew): no op until every frame is written, then the concatenation along time of the written
  values in frame order (`trace.video._frames_cat`: of a convolution's windows, that convolution). A
  read of a buffer written in part is refused.
- `x[:, :, :1].expand(..., n, ...)` of a padded video value x (its first frame n times), concatenated
  along time in front of frames 0:b of x: frames 0 : n + b of x padded in time with its first frame
  repeated n times (a replicate padding the convolution reading it merges, `video._conv3d`).

KVAE's cached causal convolution computes so: its first frame's padding and the first frames through
one conv3d, the other frames through another, both written into one buffer: one causal convolution
over the padded value (`video_windows.windows_cat`)."""

from __future__ import annotations

import torch

from .capture import Call, Ref
from .state import Lowering, arg_of

EMPTY = ("empty", "empty_like", "new_empty")


def empty_rule(low: Lowering, i: int, call: Call) -> bool:
    """empty_like / new_empty of a video value: a buffer of frames not written yet (no op)."""
    if call.name not in EMPTY or len(call.outs) != 1 or low.cap.values[call.outs[0]].ndim != 5:
        return False
    low.writes[call.outs[0]] = []
    return True


def write_rule(low: Lowering, i: int, call: Call, cat) -> bool | str:
    """buf[:, :, a:b] = v of a buffer of video frames: remembered; once every frame is written, the
    concatenation of the written values in frame order (`cat(low, i, call)` places it)."""
    buf, idx, v = (arg_of(call, k, "") for k in range(3))
    if not isinstance(buf, Ref) or not isinstance(v, Ref):
        return "a write of a value that is not a video value (a number, a constant) into video frames"
    pieces = low.writes.get(buf.node)
    if pieces is None:
        made = low.cap.producer.get(buf.node)
        if made is None or low.cap.calls[made].name not in EMPTY or buf.node in low.tainted:
            return "a write into a value the forward computed (only a buffer torch.empty made is placed)"
        pieces = []
    t = low.cap.values[buf.node]
    span = _frames(idx, t.ndim)
    if span is None:
        return f"a write of index {idx!r} into video frames (only a range of frames, [:, :, a:b], is placed)"
    r = range(int(t.shape[2]))[span]
    written = low.cap.values[v.node]
    if tuple(written.shape) != (*t.shape[:2], len(r), *t.shape[3:]):
        return f"a write of shape {tuple(written.shape)} into frames {r.start}:{r.stop} of {tuple(t.shape)}"
    pieces = sorted([*pieces, (r.start, r.stop, v.node)])
    if any(a[1] > b[0] for a, b in zip(pieces, pieces[1:], strict=False)):
        return "writes of overlapping frames into one buffer"
    if [(a, b) for a, b, _ in pieces] != _cover(pieces, int(t.shape[2])):
        low.writes[call.outs[0]] = pieces
        return True
    if len(pieces) == 1 and low.spatial(v.node) is not None:  # (one write of every frame: the value)
        low.set(call.outs[0], low.spatial(v.node))
        return True
    joined = Call(func=torch.cat, args=([Ref(n) for _, _, n in pieces], 2), kwargs={"written": True},
                  outs=list(call.outs), structure="tensor", where=call.where)  # (one window may show the
    # stride: the convolution's own, `video_windows.windows_cat`)
    return cat(low, i, joined)


def _frames(idx, ndim: int) -> slice | None:
    """The frames an index of a (B, C, T, H, W) value writes ([...] or [:, :, a:b]), or None."""
    whole = slice(None)
    if idx is Ellipsis or idx == (Ellipsis,):
        return whole
    if not isinstance(idx, tuple) or len(idx) < 3 or idx[:2] != (whole, whole):
        return None
    if any(s not in (whole, Ellipsis) for s in idx[3:]) or not isinstance(idx[2], slice):
        return None
    return idx[2] if idx[2].step in (None, 1) else None


def _cover(pieces: list, frames: int) -> list[tuple[int, int]]:
    """The ranges pieces would be, written end to end from frame 0 to `frames`."""
    out, a = [], 0
    for start, stop, _ in pieces:
        out.append((a, a + stop - start))
        a += stop - start
    return out if a == frames else []


def front_rule(low: Lowering, i: int, call: Call) -> bool | str:
    """x[:, :, :1].expand(B, C, n, H, W) of a padded video value x: its first frame n times (no op;
    `front_cat` places it)."""
    x = arg_of(call, 0, "input")
    if not isinstance(x, Ref) or x.node not in low.windows:
        return False
    src, a, b = low.windows[x.node]
    t_in, t_out = low.cap.values[x.node], low.cap.values[call.outs[0]]
    if range(int(low.cap.values[src].shape[2]))[a:b] != range(1) or t_in.shape[:2] != t_out.shape[:2] or \
            t_in.shape[3:] != t_out.shape[3:]:
        return "an expand of frames of a padded value other than its first frame repeated in time"
    low.fronts[call.outs[0]] = (src, int(t_out.shape[2]))
    return True


def front_cat(low: Lowering, call: Call, tensors) -> bool | str | None:
    """[x's first frame n times, frames 0:b of x] concatenated along time (x a padded video value):
    frames 0 : n + b of x padded in front with its first frame n times; None where it is no such cat."""
    if not tensors or not isinstance(tensors[0], Ref) or tensors[0].node not in low.fronts:
        return None
    src, n = low.fronts[tensors[0].node]
    rest = [low.windows.get(t.node) if isinstance(t, Ref) else None for t in tensors[1:]]
    frames = int(low.cap.values[src].shape[2])
    spans = [range(frames)[w[1] : w[2]] if w is not None and w[0] == src else None for w in rest]
    if len(spans) > 1 or spans and (spans[0] is None or spans[0].start != 0):
        return ("a concatenation along time of a padded value's first frame repeated with other than its "
                "first frames")
    padded = fronted(low, src, n)
    low.windows[call.outs[0]] = (padded, 0, n + (len(spans[0]) if spans else 0))
    return True


def fronted(low: Lowering, src: int, n: int) -> int:
    """The node of padded video value src with its first frame n times in front (a replicate padding in
    time; made once per (src, n): a value no call made, its frames n more)."""
    key = (src, n)
    if key not in low.fronted:
        t = low.cap.values[src]
        node = max(low.cap.values) + 1
        low.cap.values[node] = torch.empty((*t.shape[:2], t.shape[2] + n, *t.shape[3:]), dtype=t.dtype,
                                           device="meta")
        low.pads[node] = (src, (0, 0, 0, 0, n, 0), "replicate")
        low.fronted[key] = node
    return low.fronted[key]


def as_fronted(low: Lowering, window: tuple) -> tuple:
    """A window (src, a, b) of a padded value as a window of that value with its first frame in front,
    where a front of it was made (`fronted`): the same frames."""
    src, a, b = window
    fronts = [(n, node) for (s, n), node in low.fronted.items() if s == src]
    if len(fronts) != 1:
        return window
    n, node = fronts[0]
    r = range(int(low.cap.values[src].shape[2]))[a:b]
    return node, r.start + n, r.stop + n
