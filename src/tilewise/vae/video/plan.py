"""The plan of a tiled 3-D VAE run, before anything runs: tiles, causal steps, caches, staged values, peak.

Counted from the program and the tile layout exactly as `VideoExecutor` will run them: the cache bytes
and staged bytes are what the executor then holds (tests compare them), the convolution multiply-adds
are exact, the working set is what one unit (a segment on a tile for a step) holds op by op (`live`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...locality.boxes import box_area
from ...locality.ops import OpKind
from ...locality.ops3d_sync import StepAttention
from ...locality.program import SegmentKind, last_use
from ...memory import format_bytes
from ..run.segments import tile_grid
from ..settings import Job, Kind, Mode, Place, Settings
from .fast import FastSplit, estimation_bytes, fast_note, fast_split, low_pass
from .live import FrameSizes, unit_peak
from .stores import write_bytes
from .units import IN_MEMORY, VIDEO_STAGINGS, Order, layout, video_segments


@dataclass
class VideoPlan:
    """What a tiled run of a 3-D VAE will do and hold."""

    kind: str
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    tile_size: int
    grid: tuple[int, int]
    order: str
    staging: str
    mode: str
    attention: str
    steps: list[tuple[int, int]]  # input frames [a, b) of every causal step
    step_frames: list[int]  # output frames of every step
    segments: int
    sync_ops: int
    macs: int  # convolution multiply-adds of the tiled run (every tile, every step)
    macs_untiled: int  # ... of the untiled run
    cache_bytes: int  # caches held at once: every tile's ("frames"), one tile's ("tiles")
    cache_per_tile: int  # the largest tile's caches (over all its segments)
    staged_peak: int  # staged values held at once
    working: int  # most bytes one segment on one tile for one step holds, op by op (`live.unit_peak`)
    attention_bytes: int  # keys, values and one query chunk's scores of the largest frame step
    output_bytes: int  # the returned output (0 when it streams to a sink)
    peak: int  # estimated device peak
    host_bytes: int = 0  # what staging="host" keeps in host memory (caches and staged values)
    disk_bytes: int = 0  # what staging="disk" keeps in files (the staged values; not in `peak`)
    stats_bytes: int = 0  # every GroupNorm's merged statistics of every step (float64 mean, var)
    dropped: int = 0  # input frames after the last complete step, which the model does not encode
    estimate_peak: int = 0  # fast mode: the estimated device peak of its estimation pass (in `peak`)
    notes: list[str] = field(default_factory=list)
    backward: object = None  # a differentiable call's backward (`video.backward.VideoBackwardPlan`)

    @property
    def halo_overhead(self) -> float:
        """Extra convolution work of the tiles over the untiled run (0.25: 25 % more)."""
        return self.macs / self.macs_untiled - 1.0 if self.macs_untiled else 0.0

    def __str__(self) -> str:
        fb = format_bytes
        chunks = ", ".join(f"{a}..{b - 1}" if b - a > 1 else f"{a}" for a, b in self.steps[:4])
        more = f", ... ({len(self.steps)} steps)" if len(self.steps) > 4 else ""
        rows = [
            f"TiledVAE {self.kind} plan (3-D causal VAE): {self.input_shape} -> {self.output_shape}, "
            f"mode={self.mode}, attention={self.attention}, order={self.order}, staging={self.staging}",
            f"  tiles: {self.grid[0]}x{self.grid[1]} of {self.tile_size} latent px, {self.segments} segments "
            f"({self.sync_ops} sync ops), halo overhead {100 * self.halo_overhead:.1f}% extra conv work "
            f"({self.macs / 1e9:.3g} G multiply-adds)",
            f"  causal steps: {len(self.steps)}, input frames {chunks}{more}; output frames per step "
            f"{self.step_frames[:4]}{' ...' if len(self.step_frames) > 4 else ''}",
            f"  caches: {fb(self.cache_bytes)} held at once ({fb(self.cache_per_tile)} for the largest tile)",
            f"  staged values: at most {fb(self.staged_peak)}; per-unit working set ~{fb(self.working)}; "
            f"attention K/V + scores {fb(self.attention_bytes)}; output {fb(self.output_bytes)}",
        ]
        if self.estimate_peak:
            rows.append(f"  fast mode's estimation pass: ~{fb(self.estimate_peak)} device peak")
        if self.stats_bytes:
            rows.append(f"  GroupNorm statistics (merged over each step's tiles, float64): "
                        f"{fb(self.stats_bytes)}")
        if self.host_bytes:
            rows.append(f"  in host memory (staging=host): {fb(self.host_bytes)}")
        if self.disk_bytes:
            rows.append(f"  in disk files (staging=disk, not in the peak): {fb(self.disk_bytes)}")
        rows += [f"  note: {n}" for n in self.notes]
        rows.append(f"  estimated device peak {fb(self.peak)}")
        if self.backward is not None:
            rows.append(str(self.backward))
        return "\n".join(rows)


def _conv_macs(op, frames: int, area: int) -> int:
    return int(op.weight.numel()) * frames * area if op.kind in (OpKind.CONV3D, OpKind.FRAME_CONV) else 0


def count(p, shape, tile: int, ref: str, attention, staging: Place, order: Order, item: int,
          query_chunk: int = 4096, to_sink: bool = False, cpu: bool = False, fixed=frozenset()) -> dict:
    """The figures of a VideoPlan for program p on an input of `shape` (B, C, T, H, W). `cpu`: a CPU plan,
    whose host memory is the device's (what staging="host" keeps counts in its peak); `fixed`: ids of the
    GroupNorms whose statistics are given (fast mode's: they cut no segment)."""
    b = int(shape[0])
    shapes, chans = p.shapes(tuple(shape[-2:])), p.channels()
    chunks = p.chunks(int(shape[2]))
    frames = p.frames(chunks)
    segs = video_segments(p, attention, fixed)
    grid = tile_grid(shapes[ref], tile)
    units = layout(segs, shapes, grid, ref)
    per_unit, macs, working = _units(p, segs, units, shapes, chans, chunks, frames, staging, b, item)
    # (an op from a step on, `ops_steps`, computes nothing before it)
    macs_untiled = sum(_conv_macs(op, sum(frames[op.dst][getattr(op, "since", 0):]),
                                  shapes[op.dst][0] * shapes[op.dst][1]) * b for op in p.ops)
    tiles_of: dict[int, int] = {}
    for (_, t), n in per_unit.items():
        tiles_of[t] = tiles_of.get(t, 0) + n
    caches = sum(per_unit.values()) if order is Order.FRAMES else max(per_unit.values(), default=0)
    staged = _staged_peak(p, segs, shapes, chans, frames, b * item, order)
    attn = _attention_bytes(segs, shapes, chans, frames, len(grid), b, item, query_chunk)
    # every GroupNorm's merged statistics, per step: float64 (mean, var) per (batch, group) (of each frame:
    # per (batch, frame, group)), kept by the run
    stats = sum(2 * b * op.groups * 8 * (sum(frames[op.src[0]]) if op.per_frame else len(chunks))
                for op in p.ops if op.kind is OpKind.GROUP_NORM)
    h, w = shapes[p.output]
    out_shape = (b, chans[p.output], sum(frames[p.output]), h, w)
    out_bytes = 0 if to_sink else b * chans[p.output] * sum(frames[p.output]) * h * w * item
    # (a tile-major run keeps its one tile's caches on the device)
    cached_on_host = staging is Place.HOST and order is Order.FRAMES
    host = (caches if cached_on_host else 0) + (staged if staging is Place.HOST else 0)
    # (disk staging keeps the staged values in files: neither host nor device memory)
    resident = (0 if cached_on_host else caches) + (0 if staging in (Place.HOST, Place.DISK) else staged)
    reads = max(per_unit.values(), default=0) if cached_on_host else 0  # a tile's caches come to the device
    if cpu:  # (host memory is the CPU's own: what host staging keeps is held all the same)
        resident += host
    return dict(grid=(grid.rows, grid.cols), steps=chunks, step_frames=frames[p.output], segments=len(segs),
                sync_ops=sum(op.sync for op in p.ops), macs=macs, macs_untiled=macs_untiled,
                cache_bytes=caches, cache_per_tile=max(tiles_of.values(), default=0), staged_peak=staged,
                working=working, attention_bytes=attn, output_bytes=out_bytes, output_shape=out_shape,
                host_bytes=host, disk_bytes=staged if staging is Place.DISK else 0,
                peak=resident + working + attn + out_bytes + reads + stats,
                stats_bytes=stats,
                dropped=int(shape[2]) - chunks[-1][1])


def _units(p, segs, units, shapes, chans, chunks, frames, staging: Place, b: int, item: int
           ) -> tuple[dict, int, int]:
    """Per (segment, tile): the bytes of its causal caches; the MACs of every unit over every step; the
    largest working set of one unit at one step (`b` samples of `item` bytes an element)."""
    last = len(chunks) - 1
    src_of = {op.dst: op.src[0] for op in p.ops}
    per_unit, macs, working = {}, 0, 0
    lasts = [last_use(seg.ops, seg.outputs) for seg in segs]
    like = next((w for op in p.ops if isinstance(w := getattr(op, "weight", None), torch.Tensor)), None)
    tracked = {op.src[0] for op in p.ops if op.kind is OpKind.GROUP_NORM}
    seen: dict[tuple, int] = {}
    for (i, t), (cores, need) in units.items():
        # (reads from host memory or disk are copies: the unit's own until their last reader)
        owned = set(segs[i].inputs) if staging in (Place.HOST, Place.DISK) else set()
        elems = sum(op.cache_elems(need[op.dst], [shapes[src_of[op.dst]]], chans[src_of[op.dst]], last - 1)
                    for op in segs[i].ops if hasattr(op, "cache_elems") and op.dst in need) if last else 0
        per_unit[i, t] = elems * b * item
        for k in range(len(chunks)):
            macs += sum(_conv_macs(op, frames[op.dst][k], box_area(need[op.dst])) * b
                        for op in segs[i].ops if op.dst in need and getattr(op, "since", 0) <= k)
            # (tiles of one shape as far from the borders, in steps of as many frames, hold the same)
            key = (i, min(k, 2), k == last, tuple(frames[v][k] for v in need),
                   tuple(_shape_at(bx, shapes[v]) for v, bx in need.items()),
                   tuple(_shape_at(c, shapes[v]) for v, c in cores.items()))
            if key not in seen:
                sizes = FrameSizes(shapes, chans, frames, k, b * item)
                stats = max((sizes.of(v, c) for v, c in cores.items() if v in tracked), default=0)
                if staging is Place.DISK:  # (a core's channels-last copy, a few rows at a time, to its file)
                    stats = max([stats] + [write_bytes(sizes.of(v, c), c[1] - c[0]) for v, c in cores.items()
                                           if v != p.output])
                seen[key] = unit_peak(segs[i].ops, need, sizes, owned, segs[i].outputs, lasts[i], k, like,
                                      stats)
            working = max(working, seen[key])
    return per_unit, macs, working


def _attention_bytes(segs, shapes, chans, frames, tiles: int, b: int, item: int, query_chunk: int) -> int:
    """The largest attention segment's keys and values plus one query chunk's scores (float32)."""
    attn = 0
    for seg in segs:
        if seg.kind is SegmentKind.ATTENTION:
            n = seg.ops[0].src[0]
            tokens = shapes[n][0] * shapes[n][1]
            per_tile = -(-tokens // tiles)
            t = max(frames[n])
            kv = 2 * b * t * tokens * chans[n] * item
            op = seg.ops[0]
            # (per-frame attention: a query chunk of each frame scores its frame's tokens; over the step's
            # tokens: a query chunk of one frame at a time scores the tokens of every frame up to its own)
            rows = op.heads if isinstance(op, StepAttention) else t  # (score rows of one query chunk)
            keys = t * tokens if isinstance(op, StepAttention) and not op.own_frame else tokens
            attn = max(attn, kv + b * rows * min(query_chunk, per_tile) * keys * 4)
    return attn


def _shape_at(box, shape) -> tuple:
    """A box's sides and its distances to the image's borders, up to 64 px (what its ops' padding sees)."""
    y0, y1, x0, x1 = box
    h, w = shape
    return y1 - y0, x1 - x0, min(y0, 64), min(h - y1, 64), min(x0, 64), min(w - x1, 64)


def _staged_peak(p, segs, shapes, chans, frames, unit: int, order: str) -> int:
    """Most staged bytes alive at once, as the executor allocates (at a segment's first write) and frees
    (after the segment that reads a value last) them."""
    readers: dict[str, int] = {}
    for i, seg in enumerate(segs):
        for v in seg.inputs:
            readers[v] = i
    steps = range(len(next(iter(frames.values()))))

    def size(v, ks):
        return sum(unit * chans[v] * frames[v][k] * shapes[v][0] * shapes[v][1] for k in ks)

    peak = 0
    for ks in ([[k] for k in steps] if order is Order.FRAMES else [list(steps)]):
        alive: dict[str, int] = {}
        for i, seg in enumerate(segs):
            for v in seg.outputs:
                if v != p.output and v in readers:
                    alive[v] = size(v, ks)
            peak = max(peak, sum(alive.values()))
            for v in [v for v, j in readers.items() if j == i]:
                alive.pop(v, None)
    return peak


def make_video_plan(settings: Settings, job: Job, shape, tile_size: int | None = None, staging=None,
                    order=None, to_sink: bool = False, sequential: bool = False) -> VideoPlan:
    """The plan of a 3-D VAE's job for an input of `shape` (B, C, T, H, W).

    Tile size, staging and order as given, else chosen: within the memory budget the largest tile, and
    of the orders the smaller peak ("frames" only when the sink needs its frames in order: `sequential`)."""
    tile, st, order = choose_video(settings, job, shape, tile_size, staging, order, to_sink, sequential)
    return _plan(settings, job, shape, tile, st, order, to_sink)


def _plan(settings: Settings, job: Job, shape, tile: int, st: Place, order: Order,
          to_sink: bool) -> VideoPlan:
    p = job.program
    shape = tuple(int(d) for d in shape)
    figures = dict(attention=settings.attention, staging=st, order=order, item=job.item,
                   query_chunk=settings.query_chunk, cpu=not job.gpu)
    one = not to_sink and settings.process_group is None and max(p.shapes(shape[-2:])[job.ref]) <= tile
    split = None if one else fast_split(settings, job, shape)
    fast = isinstance(split, FastSplit)
    f = count(p, shape, tile, job.ref, to_sink=to_sink, fixed=split.fixed if fast else frozenset(), **figures)
    notes, est = [], 0
    if settings.mode is Mode.FAST:
        notes.append(fast_note(split, p, one))
    if fast:  # (the estimation pass: the sampled tiles' regions beside one unit's working set, held on
        # the host where the run stages there; a decode's head run exact first, its output held)
        held = estimation_bytes(settings, job, split, shape, tile)
        on_host = st is not Place.DEVICE and job.gpu  # (a CPU plan's host memory is its device's)
        est = f["working"] + (0 if on_host else held)
        if on_host:
            f["host_bytes"] = max(f["host_bytes"], held)
        if job.kind is Kind.DECODE:
            head = count(split.head, shape, tile, split.head.input, **figures)
            est = max(est, head["peak"])
        if settings.fast.low > 1:  # (the low pass, run exact before the sampled tiles)
            small, low_shape, ref = low_pass(job, shape, settings.fast.low)
            est = max(est, count(small, low_shape, tile, ref, to_sink=True, **figures)["peak"])
        f["peak"] = max(f["peak"], est)
    if f["dropped"]:
        notes.append(f"the model encodes 1 + {p.every} k frames: the last {f['dropped']} input frames are "
                     f"not encoded (as {job.model}.encode does)")
    mode = Mode.FAST if fast else Mode.EXACT
    return VideoPlan(job.kind, shape, f.pop("output_shape"), tile, f.pop("grid"), order, st, mode,
                     settings.attention, f.pop("steps"), f.pop("step_frames"), notes=notes, estimate_peak=est,
                     **f)


def choose_video(settings: Settings, job: Job, shape, tile_size=None, staging=None, order=None, to_sink=False,
                 sequential=False) -> tuple[int, Place, Order]:
    """(tile, staging, order): as given, else the largest tile within the memory budget and, of the
    allowed orders and stagings, the first ("device" before "host") with the smaller peak. "auto" staging
    goes to disk only where no in-memory plan of any tile fits the budget (never without one), and not
    with a process group (its ranks sum the staged values in memory)."""
    if settings.staging is not None and settings.staging not in VIDEO_STAGINGS:
        raise ValueError(f"staging={settings.staging_word!r} is not available for a 3-D VAE: use 'auto' or "
                         f"one of {VIDEO_STAGINGS}")
    order = None if order is None else Order.parse(order, "order")
    if order is Order.TILES and settings.process_group is not None:
        raise ValueError("a process group runs order='frames' (each step's values are summed over the ranks "
                         "before the next step reads them); drop order='tiles'")
    sequential = sequential or settings.process_group is not None
    if order is Order.TILES and sequential:
        raise ValueError("this sink takes frames in order: order='tiles' would hold every frame open; "
                         "use order='frames' or a .npy stack")
    orders = (order,) if order else ((Order.FRAMES,) if sequential else tuple(Order))
    asked = Place(staging) if staging else settings.staging
    passes = [(asked,)] if asked else [IN_MEMORY]
    budget = settings.memory_budget
    if asked is None and budget is not None and settings.process_group is None:
        passes.append((Place.DISK,))  # (tried after every tile in memory)
    tiles = [tile_size or settings.tile_size]
    if tile_size is None and budget is not None:
        tiles = [s for s in (128, 96, 64, 48, 32, 24, 16, 12, 8, 4) if s <= max(settings.tile_size, 4)]
    best = None
    for stagings in passes:
        for tile in tiles:
            for st in stagings:
                q = min((_plan(settings, job, shape, tile, st, o, to_sink) for o in orders),
                        key=lambda q: q.peak)
                if budget is None or q.peak <= budget:
                    return tile, st, q.order
                best = q if best is None or q.peak < best.peak else best
    raise ValueError(f"no plan fits memory_budget={format_bytes(budget)}: the smallest (tile "
                     f"{best.tile_size}, staging {best.staging}, order {best.order}) needs "
                     f"~{format_bytes(best.peak)}; raise the budget or stream to a sink (decode_to)")
