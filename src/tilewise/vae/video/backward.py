"""The plan of a backward through a 3-D VAE's tiled decode or encode (issue #30): what `video.gradient`
holds, before anything runs.

Walked from the frame-order run's layout (the one the differentiable call runs): the forward keeps the
causal caches entering every step (every tile's, `kept`); the backward reverses one step at a time,
segment by segment last to first, tile by tile (`video.reverse`). Where that holds most (the largest
over the steps and the segments reversed), it holds the step's staged values not yet freed and the
gradients of the values staged across the segment (`step_values`) and one tile's recomputed graph: the
values of the tile's boxes (an op of several kernels, a traced chain, one full-size intermediate more)
and as much again in their gradients, or an attention segment's keys and values of the step and their
gradients, or a GroupNorm's float64 band of its input (`tile_graph`); beside them the gradients of the
caches the step enters and leaves with (`carried`), the input's gradient, the output (held by the
caller) and its gradient, and the parameters' gradients (`io_bytes`). Within a memory budget the
differentiable call takes the largest tile whose forward and backward peaks both fit it: a smaller tile
shrinks the tile's graph, while the kept caches of every tile grow with its halos, so a budget under the
smallest tile's peak is refused with the figure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...locality.boxes import box_area
from ...locality.ops import OpKind
from ...locality.program import SegmentKind
from ...memory import format_bytes
from ..run.reverse import NORM_ROWS_BYTES
from ..run.segments import tile_grid
from ..settings import Job, Place, Settings
from .plan import VideoPlan, _plan, make_video_plan
from .units import IN_MEMORY, Order, layout, video_segments

TILES = (128, 96, 64, 48, 32, 24, 16, 12, 8, 4, 2, 1)  # the tiles a budgeted differentiable call tries


@dataclass(frozen=True)
class VideoBackwardPlan:
    """What a backward through a tiled 3-D VAE call holds (module docstring)."""

    tile_size: int
    steps: int  # causal steps, each recomputed once
    kept: int  # the caches the forward keeps for the backward (every step's entering caches)
    step_values: int  # at the reverse's peak: the step's staged values and their gradients alive
    tile_graph: int  # at the reverse's peak: one tile's recomputed graph and its gradients (or an
    # attention segment's keys and values of the step and their gradients)
    carried: int  # gradients of the caches a step enters and leaves with
    io_bytes: int  # the input's gradient, the output and its gradient, the parameters' gradients
    peak: int

    def __str__(self) -> str:
        fb = format_bytes
        return (f"  backward: {self.steps} causal steps recomputed last to first, each reversed tile by tile "
                f"(tile {self.tile_size} latent px)\n"
                f"    caches kept {fb(self.kept)}, the step's staged values and gradients "
                f"{fb(self.step_values)}, one tile's graph and gradients ~{fb(self.tile_graph)}, cache "
                f"gradients carried {fb(self.carried)}, input / output / parameter gradients "
                f"{fb(self.io_bytes)}; estimated backward peak {fb(self.peak)}")


def backward_plan(settings: Settings, job: Job, shape, tile: int, param_bytes: int) -> VideoBackwardPlan:
    """The backward's figures for a differentiable call on an input of `shape` (B, C, T, H, W) at `tile`
    (frame order, as `video.gradient` runs it)."""
    p, item, b = job.program, job.item, int(shape[0])
    shapes, chans = p.shapes(tuple(shape[-2:])), p.channels()
    chunks = p.chunks(int(shape[2]))
    frames = p.frames(chunks)
    segs = video_segments(p, settings.attention)
    units = layout(segs, shapes, tile_grid(shapes[job.ref], tile), job.ref)
    src_of = {op.dst: op.src[0] for op in p.ops}
    last = len(chunks) - 1
    saves = {op.dst: _saves(op) for op in p.ops}
    caches = 0
    for (i, _), (_, need) in units.items():
        if last:
            caches += b * item * sum(op.cache_elems(need[op.dst], [shapes[src_of[op.dst]]],
                                                    chans[src_of[op.dst]], last - 1)
                                     for op in segs[i].ops if hasattr(op, "cache_elems") and op.dst in need)

    def whole(v: str, k: int) -> int:  # bytes of value v in step k
        return b * chans[v] * frames[v][k] * box_area((0, *shapes[v][:1], 0, shapes[v][1])) * item

    def graph(i: int, k: int) -> int:  # the largest tile of segment i in step k, values and gradients
        if segs[i].kind is SegmentKind.ATTENTION:  # (keys, values of the step and their gradients)
            return 4 * whole(segs[i].ops[0].src[0], k)
        tiles = max((2 * sum(saves.get(v, 1) * b * chans[v] * frames[v][k] * box_area(bx) * item
                             for v, bx in need.items()) for (j, _), (_, need) in units.items() if j == i),
                    default=0)
        norms = [op.src[0] for op in segs[i].ops if op.kind is OpKind.GROUP_NORM]
        # (then its GroupNorms' statistics' gradients: float64 bands of their inputs and their float32 sums)
        band = max((min(NORM_ROWS_BYTES, whole(u, k) * 8 // item) * 3 // 2 for u in norms), default=0)
        return max(tiles, band)

    first = {}  # staged value -> the first segment reading it (freed once that one is reversed)
    for i, seg in reversed(list(enumerate(segs))):
        first.update({u: i for u in seg.inputs if u != p.input})
    values = tile_graph = 0
    for k in range(len(chunks)):
        staged, grads = {v for seg in segs for v in seg.outputs if v != p.output}, set()
        for i, seg in reversed(list(enumerate(segs))):
            grads |= {u for u in seg.inputs if u != p.input}
            held = sum(whole(v, k) for v in staged) + sum(whole(v, k) for v in grads)
            g = graph(i, k)
            if held + g > values + tile_graph:
                values, tile_graph = held, g
            grads -= set(seg.outputs)
            staged -= {v for v, j in first.items() if j == i}
    h, w = shapes[p.output]
    out = b * chans[p.output] * sum(frames[p.output]) * h * w * item
    inp = b * int(shape[1]) * int(shape[2]) * int(shape[3]) * int(shape[4]) * item
    kept, io = caches * last, inp + 2 * out + param_bytes  # (the output, held by the caller, its gradient)
    return VideoBackwardPlan(tile, len(chunks), kept, values, tile_graph, 2 * caches, io,
                             peak=kept + values + tile_graph + 2 * caches + io)


def param_bytes(params) -> int:
    """Bytes of the parameters' gradients."""
    return sum(q.numel() * q.element_size() for q in params)


def _saves(op) -> int:
    """Full-size tensors of an op's output size that autograd keeps for it: its output, and one more for
    an op of several kernels (a traced chain: a norm's normalised values beside its output, ...)."""
    return 2 if max(getattr(op, "kernels", 1), getattr(op, "calls", 1)) > 1 else 1


def choose_backward(settings: Settings, job: Job, shape, param_bytes: int) -> tuple[int, Place]:
    """(tile, staging) of a differentiable call: as the settings give them, else within the memory budget
    the largest tile (and "device" before "host") whose forward peak and backward peak both fit it (the
    smallest need of all is in the refusal)."""
    budget = settings.memory_budget
    stagings = IN_MEMORY if settings.staging is None else (settings.staging,)
    if budget is None:
        return settings.tile_size, stagings[0]
    best = None
    for tile in (t for t in TILES if t <= max(settings.tile_size, 1)):
        for st in stagings:
            fwd = _plan(settings, job, shape, tile, st, Order.FRAMES, False)
            back = backward_plan(settings, job, shape, tile, param_bytes)
            need = max(fwd.peak, back.peak)
            if need <= budget:
                return tile, st
            best = (need, tile, st) if best is None or need < best[0] else best
    raise ValueError(f"no differentiable {job.kind} of {tuple(shape)} fits memory_budget="
                     f"{format_bytes(budget)}: the smallest (tile {best[1]}, staging {best[2]}) needs "
                     f"~{format_bytes(best[0])} (forward or backward); raise the budget or shorten the clip")


def plan(settings: Settings, job: Job, shape, vae, tile_size: int | None = None,
         staging: str | None = None) -> VideoPlan:
    """The plan of a differentiable call: the frame-order forward's, with its `backward`; the tile and
    staging as given, else as the call would take them (`choose_backward`)."""
    pb = param_bytes(q for q in vae.parameters() if q.requires_grad)
    if tile_size is None and staging is None and settings.memory_budget is not None:
        tile_size, place = choose_backward(settings, job, shape, pb)
        staging = place.value
    fwd = make_video_plan(settings, job, shape, tile_size, staging, order=Order.FRAMES)
    return replace(fwd, backward=backward_plan(settings, job, shape, fwd.tile_size, pb))
