"""Fast mode's passes, planned (`fast_passes`): decode's exact latent-resolution head, the low pass, each
piece's sampled tiles and other tiles (`fast.run.run_fast`), encode's exact latent-resolution tail, and
the choices a GPU plan makes among them: the pieces (`fast.split.piece_cuts`) and the low pass's tile.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

from ...locality.boxes import box_area, map_box
from ...locality.ops import OpKind
from ...locality.program import Program, back_propagate
from ..fast.estimators import sample_tiles
from ..fast.split import piece_cuts, piece_grid, recomputed_in, split_program
from ..run.batches import axis_class, period_and_reach
from ..run.options import Choices
from ..run.segments import tile_grid
from ..settings import Estimator, Job, Kind, Place, Settings
from .counts import sample_stats_cost
from .fast_programs import low_pass_once, pieces_once, split_once
from .live import Sizes, together_peak
from .memo import recall
from .op_costs import ADJUST, Setting, stats_copy
from .passes import PassSpec, pass_plan
from .records import Pass, PassKind

# The least fraction of the tiles a GPU plan samples where the default sample's statistics would cross the
# link: four photographs at 512 px, embedded VAE, max abs error of fast decode against untiled (mean over
# the photos) 0.060 with the default half of the tiles, 0.068 with a quarter, 0.23 with 1/16 (BENCHMARKS.md
# #31).
FEWEST = 0.25
HEAD_TILES = (512, 256, 192, 128)  # the tiles a GPU plan tries for decode's head, beside the run's


def fast_passes(job: Job, settings: Settings, k: int, shape, tile: int, s: Setting, full: int,
                ask: Choices) -> tuple[list[Pass], dict]:
    """The passes of `run_fast` for a program cut at k, each with what it holds from the passes before
    it, and the choices made (`Choices` fields: fast_cuts, low_tile, fast_most, head_tile).

    `ask.fast_cuts` None: a GPU plan takes the pieces (`fast.split.piece_cuts`) of least estimated time
    among those within the memory budget (the fewest device bytes when none is), a CPU plan none; and,
    where the default sample's sampled tiles would be staged across the link (or not fit), fewer sampled
    tiles (`sample_caps`) while that is faster: their statistics from what fits on the device. Given cuts
    come with their `fast_most` and `head_tile`. A GPU plan's low pass runs in one tile where that fits
    the budget (its halos cost launches, not FLOPs), its decode head in the tile of least time that fits.
    `ask.recompute` (`settle._recomputed`'s choice among `staged_cuts`): the staged values the exact pass
    and the staged sampled tiles recompute, each pass its own (`recomputed_in`); `ask.low_recompute`: the
    low pass's."""
    first, second = split_once(job.program, k)
    recomputed, s = s.run.recompute, s.with_run(recompute=())  # (each pass its own: `recomputed_in`)
    exact = s.with_run(band_bytes=job.profile.band_bytes)
    head, held, head_tile = [], 0, 0
    if job.kind is Kind.DECODE:
        head_tile = ask.head_tile if ask.fast_cuts is not None else 0
        own = exact.with_run(recompute=recomputed_in(first, recomputed))  # (its own recomputed values)
        q, head_tile = _head_pass(job, settings, first, shape, tile, own, full, head_tile)
        head.append(q)
        part, part_shape, ref, held = second, q.output_shape, second.input, q.output_bytes
    else:
        part, part_shape, ref = first, shape, first.output
    # (the pieces' passes planned before in this search, by any plan of the same program, tile and setting:
    # a recomputation tried re-plans only the passes whose recomputed values it changes)
    pairs = recall(("fast piece pairs", id(job.program), k, tile, s, full, settings, job.profile,
                    tuple(part_shape), held), dict, job.program)
    fp = _FastPlan(job, settings, part, part_shape, ref, tile, s, exact, full, held, ask.fast_most,
                   recomputed, ask.low_recompute, pairs)
    cuts = ask.fast_cuts
    best = None
    for cap in [ask.fast_most] if cuts is not None else fp.sample_caps():
        got = replace(fp, most=cap).estimated_passes(cuts)
        if best is None or got[0] < best[0]:
            best = got
        if not got[0][0] and not _crosses(got[3], s):
            break  # (the most tiles sampled that fit, their statistics on the device)
    _, cuts, low_tile, got, cap = best
    passes = head + got
    if job.kind is Kind.ENCODE:
        rp = got[-1]
        spec = PassSpec(PassKind.TAIL, second, rp.output_shape, tile, second.output)
        q = pass_plan(spec, exact.with_run(recompute=recomputed_in(second, recomputed)), job.profile, full)
        passes.append(q.with_held(rp.output_bytes))
    return passes, dict(fast_cuts=tuple(cuts), low_tile=low_tile, fast_most=cap, head_tile=head_tile)


def _head_pass(job: Job, settings: Settings, first: Program, shape, tile: int, exact: Setting, full: int,
               head_tile: int) -> tuple[Pass, int]:
    """Decode's exact latent-resolution head and its tile (0: `tile`): given, or on a GPU plan the
    tile of least estimated time among `tile` and the bigger HEAD_TILES whose pass fits the budget."""
    def planned(t: int) -> Pass:
        return pass_plan(PassSpec(PassKind.HEAD, first, shape, t or tile, first.input), exact, job.profile,
                         full)

    if head_tile or not exact.gpu:
        return planned(head_tile), head_tile
    side = max(first.shapes(tuple(shape[-2:]))[first.input])
    budget = settings.memory_budget
    best = (planned(0), 0)
    for t in sorted({min(side, t) for t in HEAD_TILES if t > tile}):
        q = planned(t)
        if (budget is None or q.peak <= budget) and _timed(q, job, exact) < _timed(best[0], job, exact):
            best = (q, t)
    return best


def _timed(q: Pass, job: Job, s: Setting) -> float:
    return q.timed(job.profile, s.item < 4).seconds


def _crosses(passes: list[Pass], s: Setting) -> bool:
    """Whether fast mode's sampled tiles are staged across the link (a GPU plan staging off the device)."""
    return any(q.kind is PassKind.SAMPLED_STAGED and q.h2d + q.d2h for q in passes) and s.gpu


@dataclass(frozen=True)
class _FastPlan:
    """The estimated part of one fast-mode plan: its program and input shape, the reference value and tile,
    the settings of its passes (`s`; `exact`: the exact passes', in row bands) and what it holds before
    it runs (`held`: decode's head output)."""

    job: Job
    settings: Settings
    part: Program
    part_shape: tuple
    ref: str
    tile: int
    s: Setting
    exact: Setting
    full: int
    held: int
    most: int = 0  # at most this many rows and columns of sampled tiles (0: no cap)
    recomputed: tuple[str, ...] = ()  # the plan's recomputed values (each staged piece takes its own)
    low_recomputed: tuple[str, ...] = ()  # the low pass's
    memo: dict = field(default_factory=dict, compare=False, repr=False)  # piece_pair's, shared by caps

    def sampled(self, grid) -> set[int]:
        return {t.index for t in sample_tiles(grid, self.settings.fast.fraction(Estimator.TILES), self.most)}

    def sample_caps(self) -> list[int]:
        """The caps on the sampled rows and columns a GPU plan tries: the default sample (0) first, then
        one row and column fewer each time while at least FEWEST of the tiles are sampled (none with
        `fast_sample` given, or on a CPU plan)."""
        if not self.s.gpu or self.settings.fast.sample is not None:
            return [0]
        grid = tile_grid(self.part.shapes(tuple(self.part_shape[-2:]))[self.ref], self.tile)
        fraction = self.settings.fast.fraction(Estimator.TILES)
        chosen = sample_tiles(grid, fraction)
        k = max(len({t.row for t in chosen}), len({t.col for t in chosen}))
        least = FEWEST * grid.rows * grid.cols
        return [0, *(c for c in range(k - 1, 0, -1) if len(sample_tiles(grid, fraction, c)) >= least)]

    def estimated_passes(self, cuts: tuple[int, ...] | None) -> tuple:
        """((not fits, estimated seconds or peak), cuts, low pass tile, passes, cap) of this sample: the
        low pass and the pieces' passes, of the cuts given or the best of `cut_options`."""
        passes, low_tile = [], 0
        if self.settings.fast.low:
            lp, low_tile = self.low_pass_plan()
            passes.append(lp)
        best = None
        for c in [cuts] if cuts is not None else self.cut_options():
            got = self.piece_passes(c)
            peak = max(q.peak for q in passes + got)
            fits = self.settings.memory_budget is None or peak <= self.settings.memory_budget
            seconds = sum(q.timed(self.job.profile, self.s.item < 4).seconds for q in passes + got)
            key = (not fits, seconds if fits else peak)
            if best is None or key < best[0]:
                best = (key, c, got)
        key, c, got = best
        return key, c, low_tile, passes + got, self.most

    def cut_options(self) -> list[tuple]:
        """The pieces a GPU plan tries: every subset of the cuts (all or none beyond three), each cut where
        the tile scales to its piece's reference exactly."""
        if not self.s.gpu:
            return [()]
        shapes = self.part.shapes(tuple(self.part_shape[-2:]))
        found = []
        for c in piece_cuts(self.job.program, self.job.kind, self.settings.mode, self.settings.fast):
            # (the value between two pieces is the later piece's reference in decode, the earlier one's in
            # encode: at a higher resolution than the part's, by the factor the tile scales)
            v = split_program(self.part, c)[0].output
            r = shapes[v][0] // shapes[self.ref][0]
            if shapes[v] == (r * shapes[self.ref][0], r * shapes[self.ref][1]):
                found.append(c)
        if len(found) > 3:
            return [(), tuple(found)]
        return [tuple(x for i, x in enumerate(found) if m >> i & 1) for m in range(1 << len(found))]

    def low_pass_plan(self) -> tuple[Pass, int]:
        """The low pass (statistics only; the sampled cores' too, as probes) and its tile: a GPU plan's one
        tile over its whole input where that fits the budget, else `tile` (0)."""
        rh, rw = self.part.shapes(tuple(self.part_shape[-2:]))[self.ref]
        grid = tile_grid((rh, rw), self.tile)  # (as the run)
        sampled = self.sampled(grid)
        low, small, low_ref = low_pass_once(self.job.kind, self.part, self.part_shape, self.ref,
                                            self.settings.fast.low, self.job.factor)
        lo = low.shapes(tuple(small[-2:]))[low_ref]  # (the sampled cores' statistics too: probes)
        probes = tuple(map_box(t.core, (rh, rw), lo) for t in grid if t.index in sampled)
        resized = math.prod(small) * self.exact.item if small[-2:] != self.part_shape[-2:] else 0

        def planned(t: int) -> Pass:  # (its output is thrown away: only its statistics are wanted)
            spec = PassSpec(PassKind.LOW, low, small, t or self.tile, low_ref, probes=probes, streamed=True)
            own = self.exact.with_run(recompute=self.low_recomputed)
            return pass_plan(spec, own, self.job.profile, self.full).with_held(self.held + resized)

        budget = self.settings.memory_budget
        if self.exact.gpu and max(lo) > self.tile:
            whole = planned(max(lo))
            if budget is None or whole.peak <= budget:
                return whole, max(lo)
        return planned(0), 0

    def piece_passes(self, cuts: tuple[int, ...]) -> list[Pass]:
        """Each piece's sampled tiles' and other tiles' passes, the value between pieces held whole; the
        sampled tiles staged in every piece when they do not fit at once in one."""
        pieces = pieces_once(self.part, cuts)
        shapes = self.part.shapes(tuple(self.part_shape[-2:]))
        staged = None
        while True:
            out, h, x_shape, used = [], self.held, self.part_shape, False
            for j, piece in enumerate(pieces):
                pref, ptile = piece_grid(piece, shapes, self.ref, self.tile, self.job.kind)
                tag = (j + 1, len(pieces)) if len(pieces) > 1 else None
                sp, rp, was = self.piece_pair(PieceRef(piece, x_shape, pref, ptile, tag), h, staged)
                out += [sp, rp]
                used |= was
                h, x_shape = rp.output_bytes, rp.output_shape
            if staged is not None or not used or len(pieces) == 1:
                return out
            staged = True  # (one flag for the run: every piece's sampled tiles staged)

    def piece_pair(self, pc: PieceRef, held: int, staged: bool | None) -> tuple[Pass, Pass, bool]:
        """The sampled tiles' and the other tiles' passes over (a piece of) the part, holding `held` (its
        input); staged None: staged when the sampled tiles do not fit at once. A piece planned before
        with the same sample, held bytes and staging (under other cuts or caps, or staged at first) is
        not planned again (`memo`)."""
        grid = tile_grid(pc.hw, pc.tile)  # (as the run)
        sampled = frozenset(self.sampled(grid))
        key = (pc.program.input, pc.program.output, sampled, held, recomputed_in(pc.program, self.recomputed))
        got = self.memo.get((*key, staged))
        if got is None:
            got = self._piece_pair(pc, grid, sampled, held, staged)
            self.memo[(*key, staged)] = self.memo[(*key, got[2])] = got  # (staged None: as decided)
        sp, rp, staged = got
        if sp.piece != pc.piece:  # (the same piece among other pieces)
            sp, rp = (q.replace(program=pc.program.name, piece=pc.piece) for q in (sp, rp))
        return sp, rp, staged and self.s.run.staging is not Place.DISK

    def _piece_pair(self, pc: PieceRef, grid, sampled: frozenset, held: int, staged: bool | None) -> tuple:
        """`piece_pair`, planned: (sampled tiles' pass, other tiles' pass, whether the first is staged)."""
        s, part = self.s, pc.program
        fixed = frozenset(id(op) for op in part.ops if op.kind is OpKind.GROUP_NORM)
        regions = _Regions(pc, grid)  # (the sampled tiles' boxes, for their peak together or staged)
        spec = PassSpec(PassKind.SAMPLED, part, pc.shape, pc.tile, pc.ref, fixed, sampled, together=True,
                        piece=pc.piece)
        sp = pass_plan(spec, s, self.job.profile, self.full)
        if not staged:  # (staged, the pass below keeps only this one's work and FLOPs)
            sp = self._with_copies(sp, pc, regions, sampled)
        if staged is None:
            budget = self.settings.memory_budget
            staged = s.run.staging is Place.DISK or (s.gpu and budget is not None and sp.peak + held > budget)
        if staged:  # staged_tile_stats: cut at every GroupNorm, one tile at a time, its regions staged
            sp = self._staged(sp, pc, regions, sampled, len(fixed))
        else:  # sampled_tile_stats: every sampled tile's values at once, op by op, and their statistics
            stats = sample_stats_cost(part, grid, sampled, pc.shapes, part.channels(), pc.ref, s,
                                      bool(self.settings.fast.low))
            sp = sp.replace(launches=sp.launches + stats.launches, h2d=sp.h2d + stats.h2d)
        out_hw = sp.output_shape[-2:]
        kept = sum(math.prod(sp.output_shape[:2]) * box_area(map_box(t.core, pc.hw, out_hw)) * s.item
                   for t in grid if t.index in sampled)
        # (no finite checks: the sampled tiles' outputs are checked with the other tiles')
        sp = sp.replace(syncs=0, output_bytes=kept, peak=sp.peak - sp.output_bytes + kept)
        rest = frozenset(t.index for t in grid) - sampled
        rp = pass_plan(PassSpec(PassKind.OTHER, part, pc.shape, pc.tile, pc.ref, fixed, rest, banded=False,
                                piece=pc.piece), s, self.job.profile, self.full)
        return sp.with_held(held), rp.with_held(held + kept), staged

    def _with_copies(self, sp: Pass, pc: PieceRef, regions: _Regions, sampled) -> Pass:
        """The sampled tiles' pass with the copies their statistics take: on a GPU plan of one segment the
        tiles' values op by op, summed, and the copies where made; else the sum of the tiles' largest
        values and the largest copy beside them."""
        s, part = self.s, pc.program
        chans = part.channels()
        chosen = [t for t in regions.grid if t.index in sampled]

        def copy(k: int, op) -> int:  # (a tile's statistics of a GroupNorm's input, one tile at a time)
            return stats_copy(op.src[0], map_box(chosen[k].core, pc.hw, pc.shapes[op.dst]), chans, s,
                              {op.src[0]: 1})

        if s.gpu and sp.segments == 1:
            outs = [map_box(t.core, pc.hw, pc.shapes[part.output]) for t in chosen]
            working = together_peak(part.ops, lambda k: regions[chosen[k].index], outs,
                                    Sizes(pc.shapes, chans, s.batch * s.item), part.output, copy,
                                    [regions.tile_class(t.index) for t in chosen])
            return sp.replace(peak=sp.peak - sp.working + working, working=working)
        return sp.replace(peak=sp.peak + max((copy(k, op) for op in part.ops if op.kind is OpKind.GROUP_NORM
                                              for k in range(len(chosen))), default=0))

    def _staged(self, sp: Pass, pc: PieceRef, regions: _Regions, sampled, norms: int) -> Pass:
        """The sampled tiles' pass as `staged_tile_stats` runs it: each tile still runs on its regions
        back-propagated through the whole part (the together pass's work and FLOPs), no finite checks,
        no reads ahead; its statistics as exact mode's (and the low pass's correction). The piece's values
        in `recomputed` are remade by their readers (`recomputed_in`): the work and FLOPs its segments then
        count on the tiles' regions (without recomputation, the same as the together pass's: 766 staged
        passes of the narrow and the SD-width decoder compared)."""
        values = recomputed_in(pc.program, self.recomputed)
        unchecked = self.exact.with_run(check_finite=False, read_ahead=False, recompute=values)
        kind = PassKind.SAMPLED_STAGED if self.s.run.staging is not Place.DISK else PassKind.SAMPLED
        spec = PassSpec(kind, pc.program, pc.shape, pc.tile, pc.ref, tiles=sampled, regions=regions,
                        piece=pc.piece)
        staged = pass_plan(spec, unchecked, self.job.profile, self.full)
        work, flops = (staged.work, staged.flops) if values else (sp.work, sp.flops)
        extra = ADJUST * norms if self.settings.fast.low else 0
        return staged.replace(work=work, flops=flops, launches=staged.launches + extra)


@dataclass(frozen=True)
class PieceRef:
    """(A piece of) the estimated part as a pass runs it: its program on an input of `shape`, the
    reference value and tile in that value's pixels, its place among the pieces (None: one piece)."""

    program: Program
    shape: tuple
    ref: str
    tile: int
    piece: tuple[int, int] | None

    @functools.cached_property
    def shapes(self) -> dict:  # (computed once: the planner reads it for every tile and op)
        return self.program.shapes(tuple(self.shape[-2:]))

    @property
    def hw(self) -> tuple[int, int]:
        return self.shapes[self.ref]


class _Regions(dict):
    """Tile index -> the boxes of every value of a piece back-propagated from the tile's output core (a
    sampled tile's regions), each back-propagated when first read: a count reads one tile of each class
    (`translations.Translations`, `tile_class`)."""

    def __init__(self, pc: PieceRef, grid):
        super().__init__()
        self.pc, self.grid = pc, grid
        self.period, self.reach = period_and_reach(pc.program.ops, pc.shapes)
        self.rows: dict[tuple[int, int], tuple] = {}
        self.cols: dict[tuple[int, int], tuple] = {}

    def tile_class(self, index: int) -> tuple:
        """The class of a tile's regions: their rows' and columns' `batches.axis_class`, each learned from
        the first tile with the same core rows or columns (boxes map rows to rows, columns to columns)."""
        core, shapes = self.grid[index].core, self.pc.shapes
        if core[:2] not in self.rows:
            self.rows[core[:2]] = axis_class([], [self[index]], shapes, self.period, self.reach, 0)
        if core[2:] not in self.cols:
            self.cols[core[2:]] = axis_class([], [self[index]], shapes, self.period, self.reach, 2)
        return self.rows[core[:2]], self.cols[core[2:]]

    def __missing__(self, index: int) -> dict:
        part, pc = self.pc.program, self.pc
        core = map_box(self.grid[index].core, pc.hw, pc.shapes[part.output])
        self[index] = got = back_propagate(part.ops, {part.output: core}, pc.shapes)
        return got
