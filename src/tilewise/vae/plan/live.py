"""Device bytes a run holds, op by op: what a plan's peak is made of (`counts` counts the rest).

`live_peak` follows `run_op` over one tile's boxes: the inputs copied in, each op's output (none where
it overwrites its dying input), its temporaries (a convolution's padded copy and the upsampled rows it
reads, attention's queries and heads, streamed attention's own, `streamed_bytes`); `untiled_peak` is
the same over the whole image for the plain untiled run. `tests/test_counting.py` compares them with the
peaks counted on real and fake runs.
"""

from __future__ import annotations

from typing import NamedTuple

from ...locality.boxes import box_area, clip_box, zero_pad
from ...locality.ops import OpKind
from ...locality.program import last_use


def untiled_peak(program, shapes, chans, unit: int) -> int:
    """Peak bytes of live values in `Program.run` (`live_peak` on the whole image; the input is the
    caller's)."""
    full = {v: (0, h, 0, w) for v, (h, w) in shapes.items()}
    last = last_use(program.ops, [program.output])
    return live_peak(program.ops, full, Sizes(shapes, chans, unit), set(), (), last, norms_in_place=False)


def streamed_bytes(op, nq: int, nk: int, c: int, stream, batch: int) -> int:
    """Device bytes streamed attention holds beside its queries (`locality.streamed_attention`): the
    float32 output, its log-sum-exp and the merged one, one chunk of keys and values, the chunk's output
    and log-sum-exp (the fused kernel holds no scores)."""
    kc, item = stream
    kc = min(kc, nk)
    return batch * (nq * c * (4 + item) + 3 * op.heads * nq * 4 + 2 * kc * c * item)


class Sizes(NamedTuple):
    """What the bytes of a box of a program's value are made of: spatial shapes, channels, and bytes per
    element times the batch."""

    shapes: dict
    chans: dict
    unit: int

    def of(self, v: str, box) -> int:
        """Bytes of value v's box."""
        return box_area(box) * self.chans[v] * self.unit


def live_peak(ops, need, sizes: Sizes, owned: set[str], keep, last, stores: int = 0,
              norms_in_place: bool = True, stream=None, profile: list | None = None) -> int:
    """Peak bytes of the values `run_op` holds running `ops` on the boxes `need`, op by op: the inputs in
    `owned` (copies read from the host or disk; other inputs are views of staged memory) until their last
    reader, each op's output (none when it overwrites its dying input, or for an upsampling its conv
    reads band by band), and its temporaries (`_op_bytes`). Values in `keep` (the band's cores) live to
    the end, when storing them holds `stores` bytes more (their statistics' float32 copy).
    `norms_in_place`: GroupNorms apply their affine over their dying input (tiles); False for the
    untiled run, whose GroupNorms are torch's own and write a new tensor. `profile` (a list) receives
    (bytes before, peak during) of every op, then the bytes held after the last."""
    ours = set(owned)  # values this run made (an op may overwrite them where they die)
    live = {v: sizes.of(v, need[v]) for v in owned if v in need}
    peak = sum(live.values())
    for i, op in enumerate(ops):
        d = op.dst
        if d not in need:
            if profile is not None:
                profile.append((sum(live.values()),) * 2)
            continue
        src = op.src[0]
        out, temp, lazy = _op_bytes(ops, i, need, sizes, last, keep, norms_in_place, stream)
        dies = last.get(src) == i and src not in keep and op.src.count(src) == 1
        if dies and src in ours and overwrites(op) and (norms_in_place or op.kind is not OpKind.GROUP_NORM):
            out = 0
        peak = max(peak, sum(live.values()) + temp + out)
        if profile is not None:
            profile.append((sum(live.values()), sum(live.values()) + temp + out))
        if out == 0 and not lazy:
            live[d] = live.pop(src)
        else:
            live[d] = out
        ours.add(d)
        for v in set(op.src):
            if last.get(v) == i and v not in keep:
                live.pop(v, None)
    if profile is not None:
        profile.append((sum(live.values()),) * 2)  # (after the last op)
    return max(peak, sum(live.values()) + stores)


def _op_bytes(ops, i: int, need, sizes: Sizes, last, keep, norms_in_place: bool, stream):
    """(output bytes, temporaries' bytes, whether it is an upsampling read lazily) of ops[i] on its box:
    a conv's zero-padded input copy and the upsampled rows it reads, attention's queries and heads
    (`stream`: streamed attention's, `streamed_bytes`), torch's GroupNorm's statistics."""
    op = ops[i]
    d, src, temp = op.dst, op.src[0], 0
    lazy = op.kind is OpKind.RESAMPLE and lazy_output(ops, i, last, keep)
    out = sizes.of(src, need[src]) if lazy else sizes.of(d, need[d])  # (a lazy upsampling holds its source)
    if op.kind is OpKind.CONV and pointwise_conv(op) and not lazy_input(ops, i, last, keep):
        out = sizes.of(d, need[src])  # run on its whole input box
    elif op.kind is OpKind.CONV:
        want = op.input_boxes(need[d])[0]
        inner = clip_box(want, sizes.shapes[src])
        copied = not op.pads_itself(want, inner) and any(zero_pad(want, inner)[0])
        padded = sizes.of(src, want) if copied else 0  # the padded copy
        if lazy_input(ops, i, last, keep):  # the upsampled rows, materialised, die once padded
            ups = sizes.of(src, upsampled_box(ops[i - 1], inner))
            temp = padded + max(0, ups - (out if padded else 0)) if padded else ups
        else:
            temp = padded
    elif op.kind is OpKind.ATTENTION and stream is not None:  # queries, then the online softmax's own
        h, w = sizes.shapes[src]
        batch = sizes.unit // stream[1]
        temp = sizes.of(d, need[d]) + streamed_bytes(op, box_area(need[d]), h * w, sizes.chans[src], stream,
                                                     batch)
    elif op.kind is OpKind.ATTENTION:
        temp = 3 * sizes.of(d, need[d])  # queries, attention output, heads back
    elif op.kind is OpKind.GROUP_NORM and not norms_in_place:
        temp = 2 * op.groups * sizes.unit  # torch's GroupNorm: its mean and rstd beside the output
    return out, temp, lazy


def overwrites(op) -> bool:
    """Whether op runs in place on its dying input (`Op.run_in_place`)."""
    if op.kind is OpKind.POINTWISE:
        return op.fn_ is not None
    return op.kind in (OpKind.GROUP_NORM, OpKind.ADD)


def lazy_output(ops, i: int, last, keep) -> bool:
    """Whether resample ops[i] is never materialised (read only by the conv right after it)."""
    op, nxt = ops[i], ops[i + 1] if i + 1 < len(ops) else None
    return (nxt is not None and nxt.kind is OpKind.CONV and nxt.src == (op.dst,) and last.get(op.dst) == i + 1
            and op.dst not in keep)


def lazy_input(ops, i: int, last, keep) -> bool:
    """Whether conv ops[i] reads an upsampling that was never materialised (it upsamples each band)."""
    return i > 0 and ops[i - 1].kind is OpKind.RESAMPLE and lazy_output(ops, i - 1, last, keep)


def upsampled_box(op, box):
    """The box of a resample's output that `Upsampled.crop` materialises for `box`: widened to whole
    source pixels (an interior tile's conv reads an odd box of rows at 2x: one row more above and below
    is upsampled, then cropped)."""
    s = op.scale
    return box[0] // s * s, ((box[1] - 1) // s + 1) * s, box[2] // s * s, ((box[3] - 1) // s + 1) * s


def pointwise_conv(op) -> bool:
    """Whether a convolution is 1x1 with no padding (`ConvOp._pointwise`)."""
    return op._pointwise()


def together_peak(ops, need, cores, sizes: Sizes, out: str, copies, classes) -> int:
    """Peak bytes of tiles run op by op together (fast mode's sampled tiles, `estimators.
    sampled_tile_stats`), each on its boxes `need(t)`, its output core `cores[t]` kept; tiles of one of
    `classes` (a key a tile: boxes that are translates, clipped alike) hold alike, followed once. Each op
    runs tile after tile: while tile t runs op i, the tiles before it hold what they hold after op i,
    those after it what they hold before it. Before a GroupNorm, the statistics of its input are taken
    tile after tile, each through a copy (`copies(t, op)`: bytes) while every tile holds its values."""
    last = last_use(ops, [out])
    profiles, known = [], {}
    for t, key in enumerate(classes):
        if key not in known:
            known[key] = prof = []
            live_peak(ops, need(t), sizes, set(), {out: cores[t]}, last, profile=prof)
        profiles.append(known[key])
    peak = 0
    for i, op in enumerate(ops):
        before = [p[i][0] for p in profiles]
        if op.kind is OpKind.GROUP_NORM:
            peak = max(peak, sum(before) + max(copies(t, op) for t in range(len(cores))))
        done, waiting = 0, sum(before)  # (bytes of the tiles past op i, and of those before it)
        for p in profiles:
            waiting -= p[i][0]
            peak = max(peak, done + p[i][1] + waiting)
            done += p[i + 1][0]
    return peak
