"""Device bytes one unit of a video run holds (one segment on one tile for one causal step), op by op.

As `plan.live.live_peak` does for 2-D programs: the values alive from their op to their last reader,
each op's output (none where it overwrites its dying input), and what the op makes while it runs
(`_during`): a causal convolution's frame-concatenated, end-padded and zero-padded copies and its new
cache, a per-frame convolution's folded copy, the temporal resamplers' concatenations and convolution
outputs, attention's queries, per-chunk outputs and projections, and a traced op's (`Pointwise`,
`Rearrange`, `Local`) own intermediates, measured by running it on a small random input of its value
(`traced_temps`: the most bytes its calls hold at once beside its output, over its input's).
"""

from __future__ import annotations

import weakref

import torch

from ...locality.boxes import box_area, clip_box
from ...locality.ops import OpKind
from ...locality.ops3d_sync import StepAttention
from ..plan.live import overwrites
from .stores import nbytes

TRACED = (OpKind.POINTWISE, OpKind.REARRANGE, OpKind.MODULE)
# (id(op), frames) -> (weakref to op, its ratios): what an op holds depends on its input's frame count
# (an op that splits off the first frame holds a view of the rest, ...), so each count is measured
_measured: dict[tuple[int, int], tuple] = {}


class FrameSizes:
    """Bytes of a box of a program's value in one causal step: its area x channels x the step's frames x
    the batch's bytes per element."""

    def __init__(self, shapes, chans, frames, k: int, unit: int):
        self.shapes, self.chans, self.frames, self.k, self.unit = shapes, chans, frames, k, unit

    def of(self, v: str, box, frames: int | None = None) -> int:
        t = self.frames[v][self.k] if frames is None else frames
        return box_area(box) * self.chans[v] * t * self.unit


def unit_peak(ops, need, sizes: FrameSizes, owned: set[str], keep, last, step: int, like=None,
              stores: int = 0) -> int:
    """Peak bytes `run_op` holds running `ops` on the boxes `need` for causal step `step`: the inputs in
    `owned` (copies: staging="host") until their last reader, each op's output and what it makes while
    it runs; the values in `keep` (the segment's outputs) to the end, when storing them holds `stores`
    bytes more. `like`: a tensor of the program's device and dtype (for `traced_temps`)."""
    ours = set(owned)
    live = {v: sizes.of(v, need[v]) for v in owned if v in need}
    peak = sum(live.values())
    for i, op in enumerate(ops):
        d = op.dst
        if d not in need:
            continue
        src = op.src[0]
        out, during = _op_bytes(op, need, sizes, step, like)
        dies = last.get(src) == i and src not in keep and op.src.count(src) == 1
        over = dies and src in ours and overwrites(op)
        out = 0 if over else out  # (an empty output too: a first frame's part after the first step)
        peak = max(peak, sum(live.values()) + during + out)
        live[d] = live.pop(src) if over else out
        ours.add(d)
        for v in set(op.src):
            if last.get(v) == i and v not in keep:
                live.pop(v, None)
    return max(peak, sum(live.values()) + stores)


def _chain(parts: list[int], out: int) -> int:
    """Most bytes alive at once making copies `parts` one from the other (each freed once the next is
    made), then the output from the last."""
    seq = [p for p in parts if p] + [out]
    return max([seq[0]] + [a + b for a, b in zip(seq, seq[1:], strict=False)])


def _op_bytes(op, need, sizes: FrameSizes, step: int, like) -> tuple[int, int]:
    """(output bytes, temporaries' bytes while it runs) of op on its box for step `step`."""
    d, src, kind = op.dst, op.src[0], op.kind
    out = sizes.of(d, need[d])
    t = sizes.frames[src][sizes.k]
    if kind is OpKind.CONV3D:
        want = op.input_boxes(need[d])[0]
        inner = clip_box(want, sizes.shapes[src])
        last = sizes.k == len(sizes.frames[src]) - 1  # (the last step keeps no cache)
        cached = 0 if last else sizes.of(src, inner, op.pad_t)  # (the new cache, cloned, beside the old)
        cat = sizes.of(src, inner, t + op.pad_t) if op.pad_t else 0
        zeros = cached if op.pad_t and step == 0 and op.fill != "first" else 0
        end = sizes.of(src, inner, t + op.pad_t + op.pad_end) if op.pad_end else 0
        pad = sizes.of(src, want, t + op.pad_t + op.pad_end) if want != inner else 0
        first = [zeros + cat] if cat else []
        return out, (cached if op.pad_t else 0) + _chain([*first, end, pad], out) - out
    if kind is OpKind.FRAME_CONV:
        want = op.input_boxes(need[d])[0]
        inner = clip_box(want, sizes.shapes[src])
        fold = sizes.of(src, inner) if t > 1 else 0
        pad = sizes.of(src, want) if want != inner else 0
        return out, _chain([fold, pad], out) - out
    if kind is OpKind.UPSAMPLE:  # (the module upsamples the whole input box; the output views it)
        box = op.input_boxes(need[d])[0]
        return out, (sizes.of(src, box) if t > 1 else 0) + max(0, sizes.of(src, box) * op.scale ** 2 - out)
    if kind is OpKind.TIME_UP:  # (zeros in front at step 1, the concatenation, its cache, the conv's 2C)
        if step == 0:
            return out, 0
        n, two = sizes.of(src, need[src]), sizes.of(src, need[src], 2)
        return out, (two if step == 1 else 0) + sizes.of(src, need[src], t + 2) + two + 2 * n
    if kind is OpKind.TIME_DOWN:
        keep = sizes.of(src, need[src], 1)
        return out, keep + (sizes.of(src, need[src], t + 1) if step else 0)
    if kind is OpKind.ATTENTION:  # queries, the query chunks' outputs and their concatenation, tokens back,
        n = sizes.of(src, need[d])  # the projection (and StepAttention's stacked frames)
        return out, (6 if isinstance(op, StepAttention) else 5) * n
    if kind in TRACED and getattr(op, "fn", None) is not None:
        box = op.input_boxes(need[d])[0] if kind is not OpKind.POINTWISE else need[d]
        box = clip_box(box, sizes.shapes[src])
        temps, held = traced_temps(op, sizes.chans[src], t, like)
        u = int(getattr(op, "up", 1))  # (an upsampling runs on its whole input box; the output views it)
        if u > 1:
            out = sizes.of(d, (box[0] * u, box[1] * u, box[2] * u, box[3] * u))
        return int(out * held + 0.5), int(temps * sizes.of(src, box) + 0.5)
    return out, 0


def traced_temps(op, channels: int, frames: int, like=None) -> tuple[float, float]:
    """(the most bytes a traced op's calls hold at once beside its output, over its input's; the bytes
    its output holds over its elements' (a view of a larger copy: frames sliced off)): measured once per
    op and frame count t (new tensor storages, birth to release), running it on a random
    (1, C, t, 8 d, 8 d) input (d: its downsampling) of like's device and dtype."""
    hit = _measured.get((id(op), frames))
    if hit is not None and hit[0]() is op:
        return hit[1]
    d = max(1, int(getattr(op, "down", 1)))
    g = torch.Generator().manual_seed(0)
    x = torch.randn((1, channels, frames, 8 * d, 8 * d), generator=g)
    if like is not None:
        x = x.to(like.device, like.dtype)
    box = (0, 8 * d, 0, 8 * d)
    y_box = box if op.kind is OpKind.POINTWISE else (0, op.out_shape([box[1::2]])[0], 0,
                                                    op.out_shape([box[1::2]])[1])
    try:
        with torch.no_grad():
            y, peak = _live_peak(lambda: op.run(None, [x], [box], y_box, [(8 * d, 8 * d)]))
        own = y.untyped_storage().nbytes()
        ratio = (max(0, peak - own) / (x.numel() * x.element_size()), max(1.0, own / max(1, nbytes(y))))
    except Exception:  # (an op that reads its call's values, ...: every call's output held)
        ratio = (float(getattr(op, "kernels", 0) or getattr(op, "calls", 0) or 1), 1.0)
    _measured[id(op), frames] = (weakref.ref(op), ratio)
    return ratio


def _live_peak(fn):
    from ...memory import measure_live_peak

    return measure_live_peak(fn)
