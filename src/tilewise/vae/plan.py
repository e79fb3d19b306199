"""The plan of a TiledVAE run, made before anything runs: its records and the arithmetic behind them.

A `Plan` lists the tile grid, the recomputation the halos cost, every staged value with its bytes and
where it lives, the per-tile working set and the estimated peak; fast mode is planned pass by pass
(`Pass`). `choose` picks the largest tile and the nearest staging within a memory budget; `plan_ranks`
shows what each rank of a multi-process run will stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..locality.ops import box_area, box_empty, map_box
from ..locality.program import Program, back_propagate
from .bands import BAND_BYTES, band_rows, row_local, tile_bands, working_bytes
from .estimators import sample_tiles
from .executor import Executor
from .fast import WHOLE_TILE_SLACK, fast_split, fixed_ops, low_pass, sample_fraction, split_program
from .sharding import RowBands, Rows
from .staging import STAGINGS, TRIM_FREE


@dataclass
class Stage:
    """One staged full-size value of a plan."""

    value: str
    producer: str
    shape: tuple[int, ...]
    bytes: int
    where: str


@dataclass
class Pass:
    """One run over the tiles within a plan (fast mode has several)."""

    name: str
    program: str
    grid: tuple[int, int]
    tiles: int  # tiles it runs
    segments: int
    output_shape: tuple[int, ...]
    stages: list[Stage] = field(default_factory=list)
    staged_peak: int = 0
    working: int = 0  # per-tile working set (all of its tiles' when they run together)
    attention_bytes: int = 0
    work: float = 0.0  # conv multiply-adds as a fraction of the untiled program's
    output_bytes: int = 0  # what it returns (and later passes hold)
    held: int = 0  # results of earlier passes alive during it
    peak: int = 0


@dataclass
class Plan:
    """What a tiled run will do: tiles, recomputation, staged bytes and where they live, the peak."""

    kind: str
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    tile_size: int
    grid: tuple[int, int]
    mode: str
    attention: str
    staging: str
    segments: int
    halo_overhead: float  # extra conv work (halos; fast mode: also its estimation passes) / untiled work
    stages: list[Stage] = field(default_factory=list)
    staged_peak: int = 0  # most staged bytes alive at once
    working: int = 0  # per-tile working set estimate (largest segment)
    attention_bytes: int = 0  # keys and values of a global attention, plus one query chunk's scores
    output_bytes: int = 0
    peak: int = 0  # estimated peak on the device (staged on the device + working + output + heap slack)
    passes: list[Pass] = field(default_factory=list)  # fast mode (sampled tiles): its passes, in order
    heap_slack: int = 0  # disk staging on the CPU: freed heap kept for reuse (within memory_budget)

    def __str__(self) -> str:
        from ..memory import format_bytes as fb

        rows = [
            f"TiledVAE {self.kind} plan: {self.input_shape} -> {self.output_shape}, mode={self.mode}, "
            f"attention={self.attention}",
            f"  tiles: {self.grid[0]}x{self.grid[1]} of {self.tile_size} latent px, "
            f"{self.segments} segments, "
            f"halo overhead {100 * self.halo_overhead:.1f}% extra conv work",
            f"  staging: {self.staging}, {len(self.stages)} staged values, at most {fb(self.staged_peak)} "
            f"alive at once",
        ]
        for s in self.stages[:6]:
            rows.append(f"    {s.producer:<40} {str(s.shape):<22} {fb(s.bytes):>10} on {s.where}")
        if len(self.stages) > 6:
            rows.append(f"    ... {len(self.stages) - 6} more")
        rows.append(f"  per-tile working set ~{fb(self.working)}, attention K/V + scores "
                    f"{fb(self.attention_bytes)}, output buffer {fb(self.output_bytes)}")
        for q in self.passes:
            rows.append(f"  pass {q.name}: {q.tiles} tiles, {q.segments} segments, {len(q.stages)} staged "
                        f"values (at most {fb(q.staged_peak)}), working ~{fb(q.working)}, "
                        f"{100 * q.work:.0f}% of the untiled conv work, returns {fb(q.output_bytes)}, "
                        f"holds {fb(q.held)}, peak ~{fb(q.peak)}")
        if self.heap_slack:
            rows.append(f"  heap slack {fb(self.heap_slack)} (freed memory kept for reuse, disk staging)")
        rows.append(f"  estimated device peak {fb(self.peak)}")
        return "\n".join(rows)


@dataclass
class RankPlan:
    """What one rank of an exact TiledVAE run will hold: its rows, tiles and staged bytes."""

    rank: int
    rows: Rows  # reference (latent) rows of its tile cores
    tiles: int
    staged_peak: int  # most staged bytes (its bands of full-size values plus halo rows) alive at once

    def __str__(self) -> str:
        from ..memory import format_bytes

        return (f"rank {self.rank}: latent rows [{self.rows[0]}, {self.rows[1]}), {self.tiles} tiles, "
                f"staged at most {format_bytes(self.staged_peak)}")


def plan_ranks(tv, shape: tuple[int, ...], world: int, kind: str = "decode", tile_size: int | None = None,
               dtype=None) -> list[RankPlan]:
    """Per-rank plan of an exact TiledVAE run on `world` ranks (what `Executor(group=...)` will stage)."""
    import torch

    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int (ranks), got {world!r}")
    if tv.mode != "exact":
        raise ValueError(f"per-rank plans cover exact mode; this TiledVAE has mode={tv.mode!r}")
    p = tv.program(kind)
    ref = p.input if kind == "decode" else p.output
    ex = Executor(p, tile_size or tv.tile_size, ref, attention=tv.attention, progress=False)
    shapes, chans = p.shapes(tuple(shape[-2:])), p.channels()
    segs = ex.segments()
    grid = ex._grid(shapes)
    last = ex._last_reader(segs)
    item = torch.empty((), dtype=dtype or tv.vae.dtype).element_size()
    plans = []
    for r in range(world):
        bands = RowBands.build(grid, r, world)
        bands.plan_segments(segs, shapes, grid, ref, skip={p.input})
        alive: dict[str, int] = {}
        peak = 0
        for i, seg in enumerate(segs):
            for v in seg.outputs:
                if v != p.output:
                    lo, hi = bands.stored_rows(v, shapes[v][0])
                    alive[v] = int(shape[0]) * chans[v] * (hi - lo) * shapes[v][1] * item
            peak = max(peak, sum(alive.values()))
            for v in [v for v, j in last.items() if j == i]:
                alive.pop(v, None)
        plans.append(RankPlan(r, bands.owned[r], len(bands.tiles[r]), peak))
    return plans


def choose(tv, kind: str, shape: tuple[int, ...]) -> tuple[int, str]:
    """Tile size and staging: as given, or the largest tile and nearest staging within the budget."""
    device = vae_device(tv.vae)
    default = "device" if device.type != "cpu" or tv.staging == "auto" else tv.staging
    if tv.memory_budget is None:
        return tv.tile_size, (default if tv.staging == "auto" else tv.staging)
    stagings = STAGINGS if tv.staging == "auto" else (tv.staging,)
    tiles = [s for s in (128, 96, 64, 48, 32, 24, 16, 12, 8, 4) if s <= max(tv.tile_size, 4)]
    for tile in tiles:
        for st in stagings:
            if make_plan(tv, shape, kind=kind, tile_size=tile, staging=st).peak <= tv.memory_budget:
                return tile, st
    best = make_plan(tv, shape, kind=kind, tile_size=tiles[-1], staging=stagings[-1])
    from ..memory import format_bytes

    raise ValueError(f"no plan fits memory_budget={format_bytes(tv.memory_budget)}: the smallest "
                     f"(tile {tiles[-1]}, staging {stagings[-1]}) needs ~{format_bytes(best.peak)}; "
                     f"raise the budget or use mode='fast'")


def vae_device(vae):
    """The device a VAE's parameters are on."""
    import torch

    try:
        return torch.device(vae.device)
    except AttributeError:
        return next(vae.parameters()).device


def make_plan(tv, shape: tuple[int, ...], kind: str = "decode", tile_size: int | None = None,
              staging: str | None = None) -> Plan:
    """The plan for an input of `shape` (B, C, H, W): grid, halo overhead, staged bytes, peak.

    Fast mode with the sampled-tile estimator is planned pass by pass (`Plan.passes`): decode's exact
    latent-resolution head, the low pass, the sampled tiles (run together), the other tiles, and
    encode's exact latent-resolution tail.
    """
    if tile_size is None and staging is None and tv.memory_budget is not None:
        tile_size, staging = choose(tv, kind, tuple(shape))
    tile = tile_size or tv.tile_size
    st = staging or (tv.staging if tv.staging != "auto" else "device")
    p = tv.program(kind)
    shape = tuple(int(d) for d in shape)
    ref = p.input if kind == "decode" else p.output
    full = _conv_work(p, p.shapes(shape[-2:]))
    k = fast_split(tv, p, kind)
    if k is not None:
        passes = _fast_passes(tv, kind, p, k, shape, tile, st, full)
    else:
        fixed = fixed_ops(tv, p, kind) if tv.mode == "fast" else set()
        passes = [_pass_plan(tv, "tiled", p, shape, tile, st, ref, fixed, full, banded=tv.mode == "exact")]
    last = passes[-1]
    plan = Plan(kind, shape, last.output_shape, tile, last.grid, tv.mode, tv.attention, st,
                sum(q.segments for q in passes), sum(q.work for q in passes) - 1.0,
                [s for q in passes for s in q.stages], max(q.staged_peak for q in passes),
                max(q.working for q in passes), max(q.attention_bytes for q in passes),
                last.output_bytes, max(q.peak for q in passes))
    plan.passes = passes if k is not None else []
    if st == "disk" and vae_device(tv.vae).type == "cpu":  # freed heap the trims leave resident
        room = TRIM_FREE if tv.memory_budget is None else tv.memory_budget - plan.peak
        plan.heap_slack = max(0, min(TRIM_FREE, room))
        plan.peak = max(q.peak + _pass_slack(q, plan.heap_slack) for q in passes)
    return plan


def _fast_passes(tv, kind: str, p: Program, k: int, shape, tile: int, st: str, full: int) -> list[Pass]:
    """The passes of `_fast_tiles`, each with what it holds from the passes before it."""
    from ..geometry import TileGrid
    from ..memory import dtype_itemsize

    first, second = split_program(p, k)
    passes, held = [], 0
    if kind == "decode":
        q = _pass_plan(tv, "exact latent-resolution head", first, shape, tile, st, first.input, set(),
                            full)
        passes.append(q)
        part, part_shape, ref, held = second, q.output_shape, second.input, q.output_bytes
    else:
        part, part_shape, ref = first, shape, first.output
    item = dtype_itemsize(tv.vae.dtype)
    if tv.fast_low:
        low, small, low_ref = low_pass(tv, kind, part, part_shape, ref)
        lp = _pass_plan(tv, "low pass", low, small, tile, st, low_ref, set(), full)
        lp.peak, lp.output_bytes = lp.peak - lp.output_bytes, 0  # streamed away: statistics only
        resized = math.prod(small) * item if small[-2:] != part_shape[-2:] else 0
        passes.append(_held(lp, held + resized))
    rh, rw = part.shapes(tuple(part_shape[-2:]))[ref]
    grid = TileGrid(rh, rw, (min(tile, rh), min(tile, rw)))
    sampled = {t.index for t in sample_tiles(grid, sample_fraction(tv, "tiles"))}
    fixed = {id(op) for op in part.ops if op.kind == "group_norm"}
    sp = _pass_plan(tv, "sampled tiles", part, part_shape, tile, st, ref, fixed, full, sampled, True)
    if st == "disk":  # staged_tile_stats: cut at every GroupNorm, one tile at a time, staged on disk
        work = sp.work  # each tile still runs on its regions back-propagated through the whole part
        sp = _pass_plan(tv, "sampled tiles", part, part_shape, tile, st, ref, set(), full, sampled)
        sp.work = work
    # (else sampled_tile_stats: every sampled tile's values at once, op by op)
    out_hw = sp.output_shape[-2:]
    kept = sum(math.prod(sp.output_shape[:2]) * box_area(map_box(t.core, (rh, rw), out_hw)) * item
               for t in grid if t.index in sampled)
    sp.output_bytes, sp.peak = kept, sp.peak - sp.output_bytes + kept
    passes.append(_held(sp, held))
    rest = {t.index for t in grid} - sampled
    rp = _pass_plan(tv, "other tiles", part, part_shape, tile, st, ref, fixed, full, rest, banded=False)
    passes.append(_held(rp, held + kept))
    if kind == "encode":
        q = _pass_plan(tv, "exact latent-resolution tail", second, rp.output_shape, tile, st,
                            second.output, set(), full)
        passes.append(_held(q, rp.output_bytes))
    return passes


def _held(q: Pass, held: int) -> Pass:
    """q with `held` bytes of earlier passes' results alive during it."""
    q.held, q.peak = held, q.peak + held
    return q


def _pass_plan(tv, name: str, p: Program, shape, tile: int, st: str, ref: str, fixed: set[int],
               full: int, tiles: set[int] | None = None, together: bool = False,
               banded: bool = True) -> Pass:
    """One Executor run of p on an input of `shape`: staged values in allocation order, the staged peak,
    the per-tile working set (summed over `tiles` when they run together), conv work, the peak."""
    import torch

    b, device = shape[0], vae_device(tv.vae)
    shapes, chans = p.shapes(tuple(shape[-2:])), p.channels()
    ex = Executor(p, tile, ref, attention=tv.attention, staging=st, device=device,
                  fixed_stats={i: None for i in fixed})
    segs = ex.segments()
    item = torch.empty((), dtype=tv.vae.dtype).element_size()

    def nbytes(v):
        return b * chans[v] * shapes[v][0] * shapes[v][1] * item

    producer = {op.dst: op.name for op in p.ops}
    stages, alive, peak_staged = [], {}, 0
    last = ex._last_reader(segs)
    grid = ex._grid(shapes)
    done, working, attn = 0, 0, 0
    for i, seg in enumerate(segs):
        for v in seg.outputs:
            if v != p.output:
                stages.append(Stage(v, producer[v], (b, chans[v], *shapes[v]), nbytes(v), st))
                alive[v] = nbytes(v)
        peak_staged = max(peak_staged, sum(alive.values()))
        if seg.kind == "attention":
            op, src = seg.ops[0], seg.ops[0].src[0]
            tokens = shapes[src][0] * shapes[src][1]
            per_tile = -(-tokens // len(grid))
            scores = b * op.heads * min(tv.query_chunk, per_tile) * tokens * 4
            attn = max(attn, 2 * nbytes(src) + scores)
        d, wk = _segment_cost(seg, grid, shapes, chans, ref, b * item, tiles, together, banded)
        done, working = done + d, max(working, wk)
        for v in [v for v, j in last.items() if j == i]:
            alive.pop(v, None)
    out_b = nbytes(p.output)
    on_device = peak_staged if (st == "device" or (st == "host" and device.type == "cpu")) else 0
    # CPU convolutions' im2col buffer: row bands of at most conv_workspace bytes (measured: a fast encode
    # at 1024 px planned at 210 MiB grew by 264 before this was counted)
    im2col = ex.conv_workspace if device.type == "cpu" and any(op.kind == "conv" for op in p.ops) else 0
    return Pass(name, p.name, (grid.rows, grid.cols), len(grid) if tiles is None else len(tiles),
                len(segs), (b, chans[p.output], *shapes[p.output]), stages, peak_staged, working, attn,
                done / full if full else 1.0, out_b, 0, on_device + working + im2col + attn + out_b)


def _segment_cost(seg, grid, shapes, chans, ref, unit: int, tiles: set[int] | None = None,
                  together: bool = False, banded: bool = True) -> tuple[int, int]:
    """(conv work done over the tiles, per-tile working bytes: the largest, or the sum when together).

    With `banded` a local segment whose tiles hold more than BAND_BYTES runs in row bands (as
    Executor does): its working set is the largest band's, the work stays the tile's."""
    convs = [op for op in seg.ops if op.kind == "conv"]
    cost = {id(op): op.weight.shape[1] * op.weight.shape[0] * op.kernel[0] * op.kernel[1] for op in convs}
    rows = None
    if banded and not together and row_local(seg):
        big = max(grid, key=lambda t: box_area(t.core))
        cores = {v: map_box(big.core, shapes[ref], shapes[v]) for v in seg.outputs}
        rows = band_rows(back_propagate(seg.ops, cores, shapes), chans, unit, big.core, BAND_BYTES)
    done, working = 0, 0
    for tile in grid:
        if tiles is not None and tile.index not in tiles:
            continue
        cores = {v: map_box(tile.core, shapes[ref], shapes[v]) for v in seg.outputs}
        cores = {v: c for v, c in cores.items() if not box_empty(c)}
        need = back_propagate(seg.ops, cores, shapes)
        done += sum(cost[id(op)] * box_area(need[op.dst]) for op in convs if op.dst in need)
        wk = working_bytes(need, chans, unit)
        if rows is not None:
            wk = max(working_bytes(back_propagate(seg.ops, b, shapes), chans, unit)
                     for b in tile_bands(tile.core, seg.outputs, shapes, ref, rows)[:2])
        working = working + wk if together else max(working, wk)
    return done, working


def _pass_slack(q: Pass, slack: int) -> int:
    """Freed heap a pass keeps with disk staging: fast mode's other tiles (run whole) at most
    WHOLE_TILE_SLACK, every other pass the plan's slack."""
    return min(slack, WHOLE_TILE_SLACK) if q.name == "other tiles" else slack


def _conv_work(p: Program, shapes) -> int:
    """Multiply-adds of p's convolutions run untiled (per batch item)."""
    return sum(op.weight.shape[1] * op.weight.shape[0] * op.kernel[0] * op.kernel[1] * shapes[op.dst][0]
               * shapes[op.dst][1] for op in p.ops if op.kind == "conv")
