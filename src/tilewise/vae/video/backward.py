"""The plan of a backward through a 3-D VAE's tiled decode or encode (issue #30): what `video.gradient`
holds, before anything runs.

Walked from the frame-order run's layout (the one the differentiable call runs): the forward keeps the
causal caches entering every step (every tile's, `kept`); the backward recomputes one step at a time with
autograd, and that step's graph holds every value the step computes on every tile (each unit's boxes
over the step's frames; an op of several kernels, a traced chain, one full-size intermediate more), about
as much again in their gradients (`step_graph`); beside it the gradients of the caches carried to the
step before (`carried`), the input's gradient, the output's gradient and the parameters' gradients
(`io_bytes`). Within a memory budget the differentiable call takes the largest tile whose forward and
backward peaks both fit it. Tiles bound the forward, not this backward: the step's graph is every tile's
(smaller tiles only add halo), so a budget below one step's graph is refused with the figure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...locality.boxes import box_area
from ...memory import format_bytes
from ..run.executor import tile_grid
from ..settings import Job, Place, Settings
from .executor import VIDEO_STAGINGS, Order, layout, video_segments
from .plan import VideoPlan, _plan, make_video_plan

TILES = (128, 96, 64, 48, 32, 24, 16, 12, 8, 4, 2, 1)  # the tiles a budgeted differentiable call tries


@dataclass(frozen=True)
class VideoBackwardPlan:
    """What a backward through a tiled 3-D VAE call holds (module docstring)."""

    tile_size: int
    steps: int  # causal steps, each recomputed once
    kept: int  # the caches the forward keeps for the backward (every step's entering caches)
    step_graph: int  # the largest step's recomputed graph (every tile's values) and their gradients
    carried: int  # gradients of one step's caches, carried to the step before
    io_bytes: int  # the input's and the output's gradients, the parameters' gradients
    peak: int

    def __str__(self) -> str:
        fb = format_bytes
        return (f"  backward: {self.steps} causal steps recomputed last to first (tile {self.tile_size} "
                f"latent px), each with autograd over all its tiles\n"
                f"    caches kept {fb(self.kept)}, one step's graph and gradients ~{fb(self.step_graph)}, "
                f"cache gradients carried {fb(self.carried)}, input / output / parameter gradients "
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
    graph, caches = [0] * len(chunks), 0
    for (i, _), (_, need) in units.items():
        for k in range(len(chunks)):
            graph[k] += sum(saves.get(v, 1) * b * chans[v] * frames[v][k] * box_area(bx) * item
                            for v, bx in need.items())
        if last:
            caches += b * item * sum(op.cache_elems(need[op.dst], [shapes[src_of[op.dst]]],
                                                    chans[src_of[op.dst]], last - 1)
                                     for op in segs[i].ops if hasattr(op, "cache_elems") and op.dst in need)
    h, w = shapes[p.output]
    out = b * chans[p.output] * sum(frames[p.output]) * h * w * item
    inp = b * int(shape[1]) * int(shape[2]) * int(shape[3]) * int(shape[4]) * item
    kept, step_graph, io = caches * last, 2 * max(graph), inp + out + param_bytes  # (x2: the gradients)
    return VideoBackwardPlan(tile, len(chunks), kept, step_graph, caches, io,
                             peak=kept + step_graph + caches + io)


def param_bytes(params) -> int:
    """Bytes of the parameters' gradients."""
    return sum(q.numel() * q.element_size() for q in params)


def _saves(op) -> int:
    """Full-size tensors of an op's output size that autograd keeps for it: its output, and one more for
    an op of several kernels (a traced chain: a norm's normalised values beside its output, ...)."""
    return 2 if max(getattr(op, "kernels", 1), getattr(op, "calls", 1)) > 1 else 1


def choose_backward(settings: Settings, job: Job, shape, param_bytes: int) -> tuple[int, Place]:
    """(tile, staging) of a differentiable call: as the settings give them, else within the memory budget
    the largest tile (and "device" before "host") whose forward peak and backward peak both fit it."""
    budget = settings.memory_budget
    stagings = (tuple(Place(s) for s in VIDEO_STAGINGS) if settings.staging is None else (settings.staging,))
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
