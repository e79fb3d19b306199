"""What one pass of a plan will dispatch, counted from its tile boxes before anything runs.

Per tile and segment the executor runs each op on the box back-propagated from the tile's cores (in
row bands where the plan bands them, convolution rows carried from band to band), stores each core
(into a staged value or the output), checks it for NaN / inf and adds it to the statistics of the
GroupNorms that read it. `segment_cost` walks the same boxes and counts:

- conv work (multiply-adds over the boxes, halos included) and FLOPs as torch.utils.flop_counter counts
  them (2 a multiply-add; attention's projections and its two matmuls);
- kernel launches: the operators each step dispatches (`LAUNCHES` and the functions below; views and
  allocations are no launches), and per segment the statistics' merge, their affine and the one finite
  check that reads back to the host;
- host<->device bytes: staged boxes read onto the device, cores written back (host or disk staging of a
  GPU plan; on a CPU plan host and device are one memory);
- the working set: the three largest values a tile (or a band of it) holds on a CPU plan, the values
  it holds op by op on a GPU plan (`live`);
- batched tiles (`run.batches`, `tile_batch` > 1): the tiles of one class in the executor's groups, each
  group's ops once on n times the batch (a cat per stacked input, n times the working set), its cores
  stored tile by tile.

What one op costs on its box, the kernel constants, `Cost`, `Setting` and the untiled run's reference
cost are in `op_costs`. `benchmarks/counting.py` counts the same on a real (or fake) run;
`tests/test_counting.py` compares.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from ...locality.boxes import BoxIndex, box_area, box_empty, map_box
from ...locality.ops import OpKind
from ...locality.program import back_propagate, last_use
from ..run.attention import projects_into
from ..run.bands import band_rows, row_local, tile_bands, working_bytes
from ..run.batches import batch_groups, batchable
from ..settings import Place
from .keys import memo_key
from .live import Sizes, live_peak, pointwise_conv
from .memo import recall
from .memo import table as memo_table
from .op_costs import (
    ADJUST,
    AFFINE,
    CHECK,
    KEYS_VALUES,
    KV_STORE,
    MERGE,
    PROJECT_INTO,
    Cost,
    Setting,
    moments,
    op_cost,
    stats_copy,
    streamed,
)
from .translations import Translations


@dataclass(frozen=True)
class Scope:
    """What a pass's count is over: its program, its values' spatial shapes and channels, the reference
    value its tiles count, the values whose statistics an exact GroupNorm merges (value -> group counts),
    and how it runs."""

    program: Any
    shapes: dict
    chans: dict
    ref: str
    tracked: dict[str, set[int]]
    s: Setting


def segment_cost(seg, grid, scope: Scope, tiles: set[int] | None = None, together: bool = False,
                 banded: bool = True, fixed: set[int] = frozenset(), probes: list | None = None,
                 regions: dict[int, dict] | None = None) -> Cost:
    """What one segment dispatches over the tiles of `grid` (those in `tiles`; all when None), one tile
    at a time, or `together` (working sets summed), in row bands where `banded` and the setting band;
    `probes` (reference boxes: fast mode's low pass) add the statistics of their part of each core.
    `regions` (tile index -> boxes of every value, read for the tiles it counts): tiles of one band that
    run on those boxes, not the segment's own back-propagation, and store their outputs' boxes (fast
    mode's staged sampled tiles, whose boxes are back-propagated through the whole part from their cores:
    `estimators.staged_tile_stats`; their rows are the cores' rows' as the segment's own are). Inside
    `remembered()`, a count made before for the same segment, grid and setting is reused."""
    table = memo_table()
    key = None if table is None or regions is not None else \
        memo_key(seg, grid, scope, tiles, together, banded, fixed, probes)
    if key is not None and key in table:
        return replace(table[key][0])
    cost = _segment_cost(seg, grid, scope, tiles, together, banded, fixed, probes, regions)
    if key is not None:
        table[key] = (replace(cost), seg.ops, scope.program)  # (their ids stay theirs while remembered)
    return cost


def _segment_cost(seg, grid, scope: Scope, tiles, together, banded, fixed, probes, regions) -> Cost:
    """`segment_cost`, counted."""
    shapes, chans, ref, tracked, s = scope.shapes, scope.chans, scope.ref, scope.tracked, scope.s
    unit = s.batch * s.item
    rows = None
    if banded and not together and s.run.band_bytes and row_local(seg):
        big = max(grid, key=lambda t: box_area(t.core))
        cores = {v: map_box(big.core, shapes[ref], shapes[v]) for v in seg.outputs}
        rows = band_rows(back_propagate(seg.ops, cores, shapes), chans, unit, big.core, s.run.band_bytes)
    last = last_use(seg.ops, seg.outputs)
    batch = s.run.tile_batch if s.run.tile_batch > 1 and rows is None and not together and regions is None \
        and batchable(seg) else 1
    if batch > 1:  # (the executor reads no tile ahead in a batched segment)
        scope = replace(scope, s=s.with_run(read_ahead=False))
    cost, parts, probed, ran, memo = Cost(), 0, {}, 0, {}
    like = _translations(seg, grid, scope, rows, regions)
    split = tuple(sorted((v, r) for v, r in s.run.split if s.gpu and (v in seg.inputs or v in seg.outputs)))
    same = None if memo_table() is None or regions is not None else \
        [memo_key(seg, grid, scope, tiles, together, banded, fixed, probes, False, p) for p in (True, False)]
    chosen = [t for t in grid if tiles is None or t.index in tiles]
    classes = like.classes(chosen, lambda t: _tile_boxes(seg, t, scope, rows, regions), split)
    items = list(zip(chosen, classes, strict=True))
    boxes = _ProbeBoxes(probes, scope, seg.outputs) if probes else None
    for tile in chosen if boxes is not None else ():
        for cores in tile_bands(tile.core, seg.outputs, shapes, ref, rows):
            cost.launches += boxes.adds(cores, probed)  # (the tile's own cores)
    for key in dict.fromkeys(key for _, key in items):  # (each class of tiles counted once)
        n = len(like.rep(key, split)[0])
        memo[key] = (n, _class_cost(seg, like, key, split, scope, last, fixed, same) if n else None)
    for key, times in Counter(key for _, key in items).items():
        n, tile_cost = memo[key]
        if n:
            parts, ran = parts + n * times, ran + times
            if batch == 1:
                cost.add(tile_cost, together, times)
    if batch > 1:  # (each class's groups of one size counted once, times its groups)
        groups = batch_groups(items, batch, scope.program.output in seg.outputs)
        for (key, k), times in Counter((g[0][1], len(g)) for g in groups).items():
            if memo[key][0]:
                one = memo[key][1] if k == 1 else \
                    _class_cost(seg, like, key, split, scope, last, fixed, same, k)
                cost.add(one, together, times)
    if ran == 1:  # (one tile: there is no next tile to read ahead)
        cost.ahead = cost.fetched = 0
    cost.add(_segment_once(seg, scope, parts))
    for v, n in probed.items():  # (each probed value's merge, once per group count)
        cost.launches += len(tracked[v]) * merge_launches(n, s)
        cost.h2d += len(tracked[v]) * merge_bytes(n, s)
    return cost


class _ProbeBoxes:
    """The probes of a pass (reference boxes: fast mode's low pass) mapped to each tracked output once,
    and the executor's probe statistics for one band's cores: a GroupStats.add for each probe box meeting
    a tracked core, per group count."""

    def __init__(self, probes, scope: Scope, outputs):
        self.scope = scope
        self.mapped = {v: BoxIndex([map_box(pb, scope.shapes[scope.ref], scope.shapes[v]) for pb in probes])
                       for v in scope.tracked if v in outputs}  # (a band's cores are its outputs')

    def adds(self, cores, probed: dict) -> int:
        """Kernels of one band's probe statistics; `probed` (value -> adds) is updated."""
        chans, tracked, s = self.scope.chans, self.scope.tracked, self.scope.s
        launches = 0
        for v, core in cores.items():
            if v not in self.mapped or box_empty(core):
                continue
            for b in self.mapped[v].meeting(core):  # (each probe's part of the core)
                probed[v] = probed.get(v, 0) + 1
                launches += len(tracked[v]) * moments(b, chans[v], s)
        return launches


def merge_launches(parts: int, s: Setting) -> int:
    """Kernels of GroupStats merging `parts` tiles' moments when read (`stats.GroupStats._merge`)."""
    widen = s.run.stats_chunk == 0 and s.item < 8  # (torch.var_mean's float32 moments)
    return MERGE + widen if parts > 1 else 1 + widen  # (one part: stacked only)


def merge_bytes(parts: int, s: Setting) -> int:
    """Host->device bytes of GroupStats merging `parts` tiles' moments: the merge's float64 weights."""
    return 8 * parts if s.gpu and parts > 1 else 0


def sample_stats_cost(part, grid, sampled: set[int], shapes, chans, ref: str, s: Setting,
                      adjusted: bool) -> Cost:
    """What fast mode's sampled tiles add for their statistics when they run together
    (`estimators.sampled_tile_stats`): per GroupNorm, a GroupStats.add per sampled tile meeting it,
    the merge and, with a low pass, the difference / ratio correction (`adjusted`)."""
    cost = Cost()
    for op in part.ops:
        if op.kind is not OpKind.GROUP_NORM:
            continue
        v, n = op.src[0], 0
        for t in grid:
            core = map_box(t.core, shapes[ref], shapes[op.dst])
            if t.index in sampled and core[0] < core[1] and core[2] < core[3]:
                cost.launches += moments(core, chans[v], s)
                n += 1
        cost.launches += merge_launches(n, s) + ADJUST * adjusted
        cost.h2d += merge_bytes(n, s)
    return cost


def _tile_boxes(seg, tile, scope: Scope, rows, regions):
    """A tile's row bands (each its cores) and the boxes each band needs: back-propagated from the cores,
    or those of `regions` (segment_cost's docstring)."""
    shapes = scope.shapes
    bands = tile_bands(tile.core, seg.outputs, shapes, scope.ref, rows)
    if regions is not None and len(bands) == 1:  # (the seg's values' boxes, its outputs' stored)
        made = {v for op in seg.ops for v in (op.dst, *op.src)}
        own = {v: b for v, b in regions[tile.index].items() if v in made}
        return [{v: own[v] for v in bands[0] if v in own}], [own]
    return bands, [back_propagate(seg.ops, cores, shapes) for cores in bands]


def _translations(seg, grid, scope: Scope, rows, regions) -> Translations:
    """The classes of a segment's tiles over `grid` (its boxes: in `rows` bands, or `regions`), made once
    inside `remembered()`: each staging, split, batch or chunk a plan tries counts the same classes again."""
    table = memo_table()
    if table is None:
        return Translations(seg, scope.shapes)
    values = sorted({v for op in seg.ops for v in (op.dst, *op.src)} | set(seg.inputs) | {scope.ref})
    key = ("classes", tuple(id(op) for op in seg.ops), tuple(seg.inputs), tuple(seg.outputs),
           tuple((v, scope.shapes[v]) for v in values), scope.ref, tuple(t.core for t in grid), rows,
           None if regions is None else id(regions))
    if key not in table:
        table[key] = (Translations(seg, scope.shapes), seg.ops, regions)  # (their ids stay theirs)
    return table[key][0]


def _class_cost(seg, like: Translations, key, split, scope: Scope, last, fixed, same, n: int = 1) -> Cost:
    """`_tile_cost` of a class of tiles (`like.rep(key, split)`), n at a time, once per class and `same`
    (the segment's memo keys: but its split values' device rows, which the class holds; and its ops'
    count once per class of its tiles' boxes and the key without its values' places)."""
    bands, needs = like.rep(key, split)

    def ops():
        return _ops_cost(seg, bands, needs, scope, last, fixed, n)

    def count():
        got = None if same is None else recall(("ops", id(like), key[:2], n, same[1]), ops, like)
        return _tile_cost(seg, bands, needs, scope, last, fixed, n, got)

    return count() if same is None else recall(("class", id(like), key, n, same[0]), count, like)


def _tile_cost(seg, bands, needs, scope: Scope, last, fixed, n: int = 1, ops: Cost | None = None) -> Cost:
    """One tile of a segment, band by band (each band's cores and the boxes they need), as `run_bands`
    runs it (and the executor stores it); n > 1: n tiles of its class run as one batch (`batches.
    run_group`: one band, each input's boxes stacked, the ops once on n times the batch, the cores stored
    tile by tile). `ops`: what its ops dispatch (`_ops_cost`), where counted before."""
    shapes, chans, program, tracked, s = scope.shapes, scope.chans, scope.program, scope.tracked, scope.s
    unit = s.batch * s.item
    cost = ops if ops is not None else _ops_cost(seg, bands, needs, scope, last, fixed, n)
    cost = replace(cost)  # (the ops' own count may be remembered)
    owned = {v for v in seg.inputs if s.run.staging is Place.DISK or s.off(v)}  # reads that copy
    if s.gpu and s.run.read_ahead and s.run.staging is not Place.DISK:  # host-staged first-band boxes
        # read a tile ahead (a split value's: the box's host rows)
        cost.ahead = cost.fetched = sum(s.host_area(v, needs[0][v]) * chans[v] * unit
                                        for v in owned - {program.input} if v in needs[0])
    for cores, need in zip(bands, needs, strict=True):
        ins = [v for v in seg.inputs if v in need]
        copies = {v for v in owned if v not in s.run.device_rows or (v in need and s.host_area(v, need[v]))}
        # (a split value's box in its device rows: a view)
        if s.gpu:  # the values the ops hold, op by op (a CPU plan keeps its three-largest estimate)
            stores = max((stats_copy(v, c, chans, s, tracked) for v, c in cores.items()), default=0)
            mine = copies - {program.input} if n == 1 else set(ins)  # (stacked: copies of their own)
            held = live_peak(seg.ops, need, Sizes(shapes, chans, n * unit), mine, cores, last, stores,
                             stream=streamed(s))
            if n > 1:  # stacking: every stacked input, and the tiles' reads of one that copies
                size = {v: box_area(need[v]) * chans[v] * n * unit for v in ins}
                copied = [size[v] for v in ins if v in copies and v != program.input]
                held = max(held, sum(size.values()) + max(copied, default=0))
        else:
            held = working_bytes(need, chans, n * unit)
        band = Cost(working=held, launches=len(ins) if n > 1 else 0)  # (a cat a stacked input)
        for v in ins:
            if s.off(v) and v != program.input:  # (the input is staged as given)
                band.h2d += s.host_area(v, need[v]) * chans[v] * n * unit
                band.launches += n * s.joins(v, need[v])  # (a split value's rows joined: a cat)
        for v, core in cores.items():
            band.add(_store_cost(v, core, scope, v in seg.measured), times=n)
        cost.add(band)
    return cost


def _ops_cost(seg, bands, needs, scope: Scope, last, fixed, n: int = 1) -> Cost:
    """What a tile's ops dispatch band by band, convolution rows carried from band to band (`_tile_cost`
    without its reads, stores and working set: nothing here reads where values are staged)."""
    shapes, chans, s = scope.shapes, scope.chans, scope.s
    sn = s if n == 1 else replace(s, batch=n * s.batch)  # (what the ops run on)
    cost = Cost()
    carried: dict[str, tuple] = {}  # conv output -> box of the rows the next band reuses
    for j, (cores, need) in enumerate(zip(bands, needs, strict=True)):
        nxt = needs[j + 1] if j + 1 < len(needs) else {}
        for i, op in enumerate(seg.ops):
            d = op.dst
            if d not in need:
                continue
            box, c = need[d], carried.pop(d, None)
            if c is not None and (c[0] != box[0] or c[2:] != box[2:]):
                c = None
            if c is None:
                cost.add(op_cost(seg.ops, i, box, need, shapes, chans, sn, last, cores, fixed))
            elif c[1] < box[1]:  # rows past the carried ones, then joined to them
                cost.add(op_cost(seg.ops, i, (c[1], *box[1:]), need, shapes, chans, sn, last, cores, fixed))
                cost.launches += 1
            if op.kind is OpKind.CONV and not pointwise_conv(op) and d in nxt and nxt[d][0] < box[1] \
                    and nxt[d][2:] == box[2:]:
                carried[d] = (nxt[d][0], box[1], box[2], box[3])
                cost.launches += 1  # (the carried rows are cloned)
    return cost


def _store_cost(v: str, core, scope: Scope, measured: bool = False) -> Cost:
    """The executor's store of one core: its finite check or statistics, then its write (none when it is
    `measured` only: recomputed by its readers)."""
    chans, program, tracked, s = scope.chans, scope.program, scope.tracked, scope.s
    unit = s.batch * s.item
    n = box_area(core) * chans[v] * unit
    cost = Cost()
    if measured:
        pass
    elif v == program.output:
        cost.launches += 1  # into the output tensor (decode_to: to the sink)
    elif s.off(v):  # (a split value: its device rows copied on the device, the others across)
        across = s.host_area(v, core) * chans[v] * unit
        cost.d2h += across
        cost.d2h_side += across
        cost.launches += across < n
    elif s.run.staging is Place.DISK:
        cost.launches += max(1, -(-n // (8 << 20)))  # channels-last copies of the file's rows
    else:
        cost.launches += 1
    if v not in tracked and s.run.check_finite:
        cost.launches += 1  # a sum for the finite check
    for _ in tracked.get(v, ()):
        cost.launches += moments(core, chans[v], s)
    return cost


def _segment_once(seg, scope: Scope, parts: int) -> Cost:
    """What a segment dispatches once, not per tile: attention's keys and values, the statistics'
    merge and affine, the finite check."""
    shapes, chans, tracked, s = scope.shapes, scope.chans, scope.tracked, scope.s
    unit = s.batch * s.item
    cost = Cost()
    for op in seg.ops:
        if op.kind is OpKind.ATTENTION and s.global_attention:
            src = op.src[0]
            h, w = shapes[src]
            c = chans[src]
            bands = -(-h // max(1, min(h, (s.run.kv_chunk or s.run.query_chunk) // max(w, 1))))
            if bands == 1 and not s.run.kv_chunk:  # (its keys and values are the store)
                cost.launches += KEYS_VALUES
            elif s.run.kv_chunk and s.gpu:  # (into host memory: copies, not kernels)
                cost.launches += KEYS_VALUES * bands
            else:  # into a store on the device: one addmm a projection, or a copy after it
                into = projects_into(op, s.batch)
                cost.launches += (PROJECT_INTO if into else KEYS_VALUES + KV_STORE) * bands
            cost.flops += s.batch * 2 * 2 * h * w * c * c
            if s.off(src):  # (read whole: a split value's host rows)
                cost.h2d += s.host_area(src, (0, h, 0, w)) * c * unit
            if s.run.kv_chunk and s.gpu:  # (into host memory: copies, not kernels)
                cost.d2h += 2 * h * w * c * unit
        if op.kind is OpKind.GROUP_NORM and id(op) not in seg.again:  # (an affine once per run)
            cost.launches += AFFINE
        if op.kind is OpKind.WHOLE:  # (the module run once on the whole; its FLOPs are not counted)
            cost.launches += op.calls
    sums = any(v not in tracked for v in seg.outputs)
    merge = merge_launches(parts, s)
    for v in seg.outputs:
        for _ in tracked.get(v, ()):
            cost.launches += merge + s.run.check_finite  # and one sum of both into the finite check
            cost.h2d += merge_bytes(parts, s)
            sums = True
    if sums and s.run.check_finite:
        cost.launches += CHECK
        cost.syncs += 1
    return cost
