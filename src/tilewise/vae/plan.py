"""The plan of a TiledVAE run, made before anything runs: the arithmetic behind its records
(`plan_records`).

A `Plan` lists the tile grid, the recomputation the halos cost, every staged value with its bytes and
where it lives, the per-tile working set and the estimated device peak, and what the run will dispatch
(`counts`): FLOPs, kernel launches, host<->device bytes, and the time they take on the device profile it
was made for (`devices`); fast mode is planned pass by pass (`Pass`). `make_plan` plans given tile and
staging; `settle` chooses them within a memory budget; `plan_ranks` shows what each rank of a
multi-process run will stage.
"""

from __future__ import annotations

import math

from ..locality.ops import box_area, map_box
from ..locality.program import Program, back_propagate
from .attention import query_grid
from .counts import ADJUST, Cost, Setting, sample_stats_cost, segment_cost, stats_copy, untiled_cost
from .devices import device_profile
from .estimators import sample_tiles
from .executor import Executor
from .fast import WHOLE_TILE_SLACK, fast_split, fixed_ops, low_pass, sample_fraction, split_program
from .live import together_peak
from .plan_records import Choices, Pass, Plan, Stage  # noqa: F401  (part of this module's interface)
from .ranks import RankPlan, plan_ranks  # noqa: F401  (part of this module's interface)
from .staging import TRIM_FREE

_PROFILE = object()  # make_plan(band_bytes=...) default: the device profile's row bands
# Device bytes of the small tensors a segment's peak holds that the plan does not follow one by one: the
# finite checks' sums, the statistics' per-tile parts, the affines' float64 temporaries (counted: ~2 KiB
# on the narrow test VAE; a few tens of KiB at 512 channels).
SMALL_TENSORS = 64 << 10


def make_plan(tv, shape: tuple[int, ...], kind: str = "decode", tile_size: int | None = None,
              staging: str | None = None, band_bytes=_PROFILE, untiled: bool = False,
              on_device: frozenset = frozenset(), attention: tuple[int, int] = (0, 0),
              read_ahead: bool = True) -> Plan:
    """The plan for an input of `shape` (B, C, H, W): grid, halo overhead, staged bytes, peak, and what
    it dispatches on its device profile (FLOPs, launches, transfers, estimated time).

    Fast mode with the sampled-tile estimator is planned pass by pass (`Plan.passes`): decode's exact
    latent-resolution head, the low pass, the sampled tiles (run together), the other tiles, and
    encode's exact latent-resolution tail. `band_bytes`: row bands of exact segments (default: the
    profile's; a CPU plan's BAND_BYTES). `untiled`: an exact plan whose one tile covers the latent is the
    plain untiled run (what `decode` / `encode` do; streaming to a sink runs the tile program).
    staging "device+host" (GPU plans): the values in `on_device` staged on the device, the others in
    pinned host memory (`settle.place`). A GPU plan in fast mode whose one tile covers the latent is
    the untiled run too (exact, and less work than fast mode's passes on that one tile).
    `attention` = (kv_chunk, query_rows): exact global attention with its keys and values in host
    memory, streamed kv_chunk tokens at a time, and its queries in row bands of query_rows rows
    (`vae.attention`; (0, 0): keys and values on the device, queries in the tiles). `read_ahead`: a GPU
    plan's host staging reads the next tile's inputs while a tile runs (one tile's reads more on the
    device; `copies`).
    """
    import torch

    prof = device_profile(tv)
    tile = tile_size or tv.tile_size
    st = staging or (tv.staging if tv.staging != "auto" else "device")
    bands = prof.band_bytes if band_bytes is _PROFILE else band_bytes
    p = tv.program(kind)
    shape = tuple(int(d) for d in shape)
    ref = p.input if kind == "decode" else p.output
    shapes = p.shapes(shape[-2:])
    full = _conv_work(p, shapes)
    item = torch.empty((), dtype=tv.vae.dtype).element_size()
    setting = Setting(st, prof.kind != "cpu", prof.conv_workspace, bands if tv.mode == "exact" else None,
                      prof.stats_chunk, item, shape[0], tv.query_chunk, tv.attention == "global",
                      frozenset(on_device), *attention, read_ahead)
    k = fast_split(tv, p, kind)
    # (a GPU plan in fast mode too: with one tile its estimation passes only add work, launches and bytes)
    one = untiled and (tv.mode == "exact" or prof.kind != "cpu") and max(shapes[ref]) <= tile
    if one:
        passes = [_untiled_pass(tv, p, shape, tile, setting)]
    elif k is not None:
        passes = _fast_passes(tv, kind, p, k, shape, tile, setting, full)
    else:
        fixed = fixed_ops(tv, p, kind) if tv.mode == "fast" else set()
        passes = [_pass_plan(tv, "tiled", p, shape, tile, setting, ref, fixed, full,
                             banded=tv.mode == "exact")]
    last = passes[-1]
    plan = Plan(kind, shape, last.output_shape, tile, last.grid, tv.mode, tv.attention, st,
                sum(q.segments for q in passes), sum(q.work for q in passes) - 1.0,
                [s for q in passes for s in q.stages], max(q.staged_peak for q in passes),
                max(q.working for q in passes), max(q.attention_bytes for q in passes),
                last.output_bytes, max(q.peak for q in passes))
    plan.passes = passes if k is not None and not one else []
    plan.device, plan.profile, plan.untiled = prof.kind, prof, one
    plan.band_bytes, plan.on_device = setting.band_bytes, setting.on_device
    plan.kv_chunk, plan.query_rows = attention
    plan.read_ahead = read_ahead and any(q.ahead for q in passes)
    plan.staged_estimate = any(q.name == "sampled tiles, staged" for q in passes)
    plan.segment_bytes, plan.lifetimes = last.segment_bytes, last.lifetimes
    passes[0].launches += 5  # the input's finite check (vae.checks.check_finite): a sum, isfinite's four,
    passes[0].syncs += 1  # and one read back to the host
    for name in ("flops", "launches", "syncs", "h2d", "d2h"):
        setattr(plan, name, sum(getattr(q, name) for q in passes))
    for q in passes:
        q.seconds = prof.seconds(q.flops, q.launches, q.h2d + q.d2h, item < 4) - q.hidden
    plan.seconds = sum(q.seconds for q in passes)
    plan.untiled_flops = untiled_cost(p, shapes, p.channels(), setting).flops
    if st == "disk" and prof.kind == "cpu":  # freed heap the trims leave resident
        room = TRIM_FREE if tv.memory_budget is None else tv.memory_budget - plan.peak
        plan.heap_slack = max(0, min(TRIM_FREE, room))
        plan.peak = max(q.peak + _pass_slack(q, plan.heap_slack) for q in passes)
    return plan


def _untiled_pass(tv, p: Program, shape, tile: int, s: Setting) -> Pass:
    """The plain untiled run as a pass: no staging; its peak is the live values of Program.run."""
    shapes, chans = p.shapes(tuple(shape[-2:])), p.channels()
    c = untiled_cost(p, shapes, chans, s)
    out_b = shape[0] * chans[p.output] * shapes[p.output][0] * shapes[p.output][1] * s.item
    q = Pass("untiled", p.name, (1, 1), 1, 1, (shape[0], chans[p.output], *shapes[p.output]), [], 0,
             c.working, 0, 1.0, out_b, 0, c.working)
    _count(q, c)
    return q


def _count(q: Pass, c: Cost) -> None:
    q.flops, q.launches, q.syncs, q.h2d, q.d2h = c.flops, c.launches, c.syncs, c.h2d, c.d2h


def _fast_passes(tv, kind: str, p: Program, k: int, shape, tile: int, s: Setting, full: int) -> list[Pass]:
    """The passes of `run_fast`, each with what it holds from the passes before it (the sampled tiles'
    pass named "sampled tiles, staged" when they run one at a time, segment by segment)."""
    from ..geometry import TileGrid

    first, second = split_program(p, k)
    passes, held = [], 0
    exact = Setting(**{**s.__dict__, "band_bytes": device_profile(tv).band_bytes})
    if kind == "decode":
        q = _pass_plan(tv, "exact latent-resolution head", first, shape, tile, exact, first.input, set(),
                       full)
        passes.append(q)
        part, part_shape, ref, held = second, q.output_shape, second.input, q.output_bytes
    else:
        part, part_shape, ref = first, shape, first.output
    rh, rw = part.shapes(tuple(part_shape[-2:]))[ref]
    grid = TileGrid(rh, rw, (min(tile, rh), min(tile, rw)))
    sampled = {t.index for t in sample_tiles(grid, sample_fraction(tv, "tiles"))}
    if tv.fast_low:
        low, small, low_ref = low_pass(tv, kind, part, part_shape, ref)
        lo = low.shapes(tuple(small[-2:]))[low_ref]  # (the sampled cores' statistics too: probes)
        probes = [map_box(t.core, (rh, rw), lo) for t in grid if t.index in sampled]
        lp = _pass_plan(tv, "low pass", low, small, tile, exact, low_ref, set(), full, probes=probes)
        lp.peak, lp.output_bytes = lp.peak - lp.output_bytes, 0  # streamed away: statistics only
        resized = math.prod(small) * s.item if small[-2:] != part_shape[-2:] else 0
        passes.append(_held(lp, held + resized))
    fixed = {id(op) for op in part.ops if op.kind == "group_norm"}
    sp = _pass_plan(tv, "sampled tiles", part, part_shape, tile, s, ref, fixed, full, sampled, True)
    pshapes, pchans = part.shapes(tuple(part_shape[-2:])), part.channels()
    chosen = [t for t in grid if t.index in sampled]

    def copy(k: int, op) -> int:  # (a tile's statistics of a GroupNorm's input, one tile at a time)
        return stats_copy(op.src[0], map_box(chosen[k].core, (rh, rw), pshapes[op.dst]), pchans, s,
                          {op.src[0]: 1})

    if s.gpu and sp.segments == 1:  # the tiles' values op by op, summed, and the copies where made
        outs = [map_box(t.core, (rh, rw), pshapes[part.output]) for t in chosen]
        needs = [back_propagate(part.ops, {part.output: b}, pshapes) for b in outs]
        working = together_peak(part.ops, needs, outs, pshapes, pchans, s.batch * s.item, part.output, copy)
        sp.peak, sp.working = sp.peak - sp.working + working, working
    else:  # (the sum of the tiles' largest values, and the largest copy beside them)
        sp.peak += max((copy(k, op) for op in part.ops if op.kind == "group_norm"
                        for k in range(len(chosen))), default=0)
    staged = s.staging == "disk" or (s.gpu and tv.memory_budget is not None
                                     and sp.peak + held > tv.memory_budget)
    if staged:  # staged_tile_stats: cut at every GroupNorm, one tile at a time, its regions staged
        work, flops = sp.work, sp.flops  # each tile still runs on its regions back-propagated through
        sp = _pass_plan(tv, "sampled tiles" + (", staged" if s.staging != "disk" else ""), part,  # the
                        part_shape, tile, exact, ref, set(), full, sampled)  # whole part
        sp.work, sp.flops = work, flops
        sp.launches += ADJUST * len(fixed) if tv.fast_low else 0  # (its statistics: as exact mode's)
    else:  # sampled_tile_stats: every sampled tile's values at once, op by op, and their statistics
        sp.launches += sample_stats_cost(part, grid, sampled, pshapes, pchans, ref, s,
                                         bool(tv.fast_low)).launches
    sp.syncs = 0  # (no finite checks: the sampled tiles' outputs are checked with the other tiles')
    out_hw = sp.output_shape[-2:]
    kept = sum(math.prod(sp.output_shape[:2]) * box_area(map_box(t.core, (rh, rw), out_hw)) * s.item
               for t in grid if t.index in sampled)
    sp.output_bytes, sp.peak = kept, sp.peak - sp.output_bytes + kept
    passes.append(_held(sp, held))
    rest = {t.index for t in grid} - sampled
    rp = _pass_plan(tv, "other tiles", part, part_shape, tile, s, ref, fixed, full, rest, banded=False)
    passes.append(_held(rp, held + kept))
    if kind == "encode":
        q = _pass_plan(tv, "exact latent-resolution tail", second, rp.output_shape, tile, exact,
                       second.output, set(), full)
        passes.append(_held(q, rp.output_bytes))
    return passes


def _held(q: Pass, held: int) -> Pass:
    """q with `held` bytes of earlier passes' results alive during it."""
    q.held, q.peak = held, q.peak + held
    return q


def _pass_plan(tv, name: str, p: Program, shape, tile: int, s: Setting, ref: str, fixed: set[int],
               full: int, tiles: set[int] | None = None, together: bool = False,
               banded: bool = True, probes: list | None = None) -> Pass:
    """One Executor run of p on an input of `shape`: staged values in allocation order, the staged peak,
    the per-tile working set (summed over `tiles` when they run together), conv work, what it
    dispatches (`counts.segment_cost`), the peak on the device (a GPU plan: the most any segment holds,
    its staged values on the device and its own bytes; a CPU plan: the sum of those maxima)."""
    b = shape[0]
    shapes, chans = p.shapes(tuple(shape[-2:])), p.channels()
    ex = Executor(p, tile, ref, attention=tv.attention, staging="device",
                  fixed_stats={i: None for i in fixed})
    segs = ex.segments()

    def nbytes(v):
        return b * chans[v] * shapes[v][0] * shapes[v][1] * s.item

    def where(v):
        return "device" if s.staging == "device+host" and v in s.on_device else s.staging.split("+")[-1]

    producer = {op.dst: op.name for op in p.ops}
    tracked: dict[str, set[int]] = {}  # values whose statistics an exact GroupNorm merges
    for op in p.ops:
        if op.kind == "group_norm" and id(op) not in fixed:
            tracked.setdefault(op.src[0], set()).add(op.groups)
    stages, alive, peak_staged = [], {}, 0
    last = ex._last_reader(segs)
    grid = ex._grid(shapes)
    out_b = nbytes(p.output)
    # CPU convolutions' im2col buffer: row bands of at most conv_workspace bytes (measured: a fast encode
    # at 1024 px planned at 210 MiB grew by 264 before this was counted)
    im2col = s.conv_workspace if any(op.kind == "conv" for op in p.ops) else 0
    cost, attn, held, lifetimes, gpu_peak, kept, hidden = Cost(), 0, [], {}, 0, 0, 0.0
    prof = device_profile(tv)
    made_out = next(i for i, seg in enumerate(segs) if p.output in seg.outputs)
    for i, seg in enumerate(segs):
        for v in seg.outputs:
            if v != p.output:
                stages.append(Stage(v, producer[v], (b, chans[v], *shapes[v]), nbytes(v), where(v)))
                alive[v], lifetimes[v] = nbytes(v), (i, i)
        peak_staged = max(peak_staged, sum(alive.values()))
        kv, seg_grid = 0, grid
        if seg.kind == "attention":
            kv = _keys_values_bytes(seg.ops[0], shapes, chans, s, len(grid))
            attn = max(attn, kv)
            if s.query_rows and tiles is None:
                seg_grid = query_grid(shapes[ref], s.query_rows)
        c = segment_cost(seg, seg_grid, shapes, chans, ref, p, tracked, s, tiles, together, banded,
                         probes=probes)
        cost.add(c)
        side = c.d2h_side + c.fetched - c.ahead  # (every tile's reads ahead but about the first tile's)
        hidden += prof.hidden(c.flops, c.launches, side, s.item < 4)
        out_now = out_b if i >= made_out else 0  # (the output: allocated by its own segment)
        kept += sum(b * (8 * chans[op.src[0]] + 16 * op.groups) for op in seg.ops  # statistics, affines
                    if op.kind == "group_norm" and id(op) not in fixed)  # (kept to the end of the run)
        held.append(c.working + c.ahead + kv + out_now + im2col + kept + SMALL_TENSORS)
        gpu_peak = max(gpu_peak, held[-1] + sum(n for v, n in alive.items() if where(v) == "device"))
        for v in [v for v, j in last.items() if j == i]:
            if alive.pop(v, None) is not None:
                lifetimes[v] = (lifetimes[v][0], i)
    on_device = peak_staged if (s.staging == "device" or (s.staging == "host" and not s.gpu)) else 0
    peak = gpu_peak if s.gpu else on_device + cost.working + im2col + attn + out_b
    q = Pass(name, p.name, (grid.rows, grid.cols), len(grid) if tiles is None else len(tiles),
             len(segs), (b, chans[p.output], *shapes[p.output]), stages, peak_staged, cost.working, attn,
             cost.work / full if full else 1.0, out_b, 0, peak)
    q.segment_bytes, q.lifetimes, q.hidden, q.ahead = held, lifetimes, hidden, cost.ahead
    _count(q, cost)
    return q


def _keys_values_bytes(op, shapes, chans, s: Setting, tiles: int) -> int:
    """Device bytes of a global attention's keys and values: their stores and one band of them being
    made (`attention.keys_values`), only that band when they are streamed from host memory; a CPU plan
    adds one query chunk's scores (its fused kernel holds them)."""
    src = op.src[0]
    h, w = shapes[src]
    tokens, unit = h * w, s.batch * s.item * chans[src]
    band = max(1, min(h, (s.kv_chunk or s.query_chunk) // max(w, 1))) * w
    if band < tokens or s.kv_chunk:
        made = 2 * min(band, tokens) * unit
    else:  # (one band, on a GPU plan: K and V are the stores; its input read from the host, its tokens)
        made = (1 + s.off(src)) * tokens * unit if s.gpu else 0
    if s.kv_chunk and s.gpu:
        return made
    scores = 0 if s.gpu else s.batch * op.heads * min(s.query_chunk, -(-tokens // tiles)) * tokens * 4
    return 2 * tokens * unit + made + scores


def _pass_slack(q: Pass, slack: int) -> int:
    """Freed heap a pass keeps with disk staging: fast mode's other tiles (run whole) at most
    WHOLE_TILE_SLACK, every other pass the plan's slack."""
    return min(slack, WHOLE_TILE_SLACK) if q.name == "other tiles" else slack


def _conv_work(p: Program, shapes) -> int:
    """Multiply-adds of p's convolutions run untiled (per batch item)."""
    return sum(op.weight.shape[1] * op.weight.shape[0] * op.kernel[0] * op.kernel[1] * shapes[op.dst][0]
               * shapes[op.dst][1] for op in p.ops if op.kind == "conv")
