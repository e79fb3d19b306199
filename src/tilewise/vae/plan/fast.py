"""Fast mode's passes, planned (`fast_passes`): decode's exact latent-resolution head, the low pass, each
piece's sampled tiles and other tiles (`fast.run_fast`), encode's exact latent-resolution tail, and the
choices a GPU plan makes among them: the pieces (`fast.piece_cuts`) and the low pass's tile.
"""

from __future__ import annotations

import math

from ..locality.ops import box_area, map_box
from ..locality.program import Program, back_propagate
from .counts import ADJUST, Setting, sample_stats_cost, stats_copy
from .devices import device_profile
from .estimators import sample_tiles
from .fast import low_pass, piece_cuts, piece_grid, sample_fraction, split_pieces, split_program, tile_grid
from .live import together_peak
from .plan_pass import pass_plan, pass_seconds, with_held
from .plan_records import Pass


def fast_passes(tv, kind: str, p: Program, k: int, shape, tile: int, s: Setting, full: int,
                 cuts: tuple[int, ...] | None = None) -> tuple[list[Pass], tuple[int, ...], int]:
    """The passes of `run_fast`, each with what it holds from the passes before it (the sampled tiles'
    pass named "sampled tiles, staged" when they run one at a time, segment by segment), the pieces'
    cuts and the low pass's tile (0: `tile`).

    `cuts` None: a GPU plan takes the pieces (`fast.piece_cuts`) of least estimated time among those
    within the memory budget (the fewest device bytes when none is), a CPU plan none. A GPU plan's low
    pass runs in one tile where that fits the budget (its halos cost launches, not FLOPs)."""
    first, second = split_program(p, k)
    passes, held = [], 0
    exact = Setting(**{**s.__dict__, "band_bytes": device_profile(tv).band_bytes})
    if kind == "decode":
        q = pass_plan(tv, "exact latent-resolution head", first, shape, tile, exact, first.input, set(),
                      full)
        passes.append(q)
        part, part_shape, ref, held = second, q.output_shape, second.input, q.output_bytes
    else:
        part, part_shape, ref = first, shape, first.output
    shapes = part.shapes(tuple(part_shape[-2:]))
    low_tile = 0
    if tv.fast_low:
        lp, low_tile = _low_pass_plan(tv, kind, part, part_shape, ref, tile, exact, full, held)
        passes.append(lp)
    options = [cuts] if cuts is not None else _cut_options(tv, kind, p, part, shapes, ref, s)
    best = None
    for c in options:
        got = _piece_passes(tv, part, part_shape, ref, tile, s, exact, full, held, c, kind)
        peak = max(q.peak for q in got)
        fits = tv.memory_budget is None or peak <= tv.memory_budget
        seconds = sum(pass_seconds(device_profile(tv), q, s.item < 4) for q in got)
        key = (not fits, seconds if fits else peak)
        if best is None or key < best[0]:
            best = (key, c, got)
    _, cuts, got = best
    passes += got
    if kind == "encode":
        rp = got[-1]
        q = pass_plan(tv, "exact latent-resolution tail", second, rp.output_shape, tile, exact,
                      second.output, set(), full)
        passes.append(with_held(q, rp.output_bytes))
    return passes, tuple(cuts), low_tile


def _cut_options(tv, kind: str, p: Program, part: Program, shapes, ref: str, s: Setting) -> list[tuple]:
    """The pieces a GPU plan tries: every subset of the cuts (all or none beyond three), each cut where
    the tile scales to its piece's reference exactly."""
    if not s.gpu:
        return [()]
    found = []
    for c in piece_cuts(tv, p, kind):  # (the value between two pieces is the later piece's reference
        v = split_program(part, c)[0].output  # in decode, the earlier one's in encode: at a higher
        r = shapes[v][0] // shapes[ref][0]  # resolution than the part's, by the factor the tile scales)
        if shapes[v] == (r * shapes[ref][0], r * shapes[ref][1]):
            found.append(c)
    if len(found) > 3:
        return [(), tuple(found)]
    return [tuple(x for i, x in enumerate(found) if m >> i & 1) for m in range(1 << len(found))]


def _low_pass_plan(tv, kind: str, part: Program, part_shape, ref: str, tile: int, exact: Setting,
                   full: int, held: int) -> tuple[Pass, int]:
    """The low pass (statistics only; the sampled cores' too, as probes) and its tile: a GPU plan's one
    tile over its whole input where that fits the budget, else `tile` (0)."""
    rh, rw = part.shapes(tuple(part_shape[-2:]))[ref]
    grid = tile_grid((rh, rw), tile)  # (as the run)
    sampled = {t.index for t in sample_tiles(grid, sample_fraction(tv, "tiles"))}
    low, small, low_ref = low_pass(tv, kind, part, part_shape, ref)
    lo = low.shapes(tuple(small[-2:]))[low_ref]  # (the sampled cores' statistics too: probes)
    probes = [map_box(t.core, (rh, rw), lo) for t in grid if t.index in sampled]
    resized = math.prod(small) * exact.item if small[-2:] != part_shape[-2:] else 0

    def planned(t: int) -> Pass:
        lp = pass_plan(tv, "low pass", low, small, t or tile, exact, low_ref, set(), full, probes=probes,
                       streamed=True)  # (its output is thrown away: only its statistics are wanted)
        return with_held(lp, held + resized)

    if exact.gpu and max(lo) > tile:
        whole = planned(max(lo))
        if tv.memory_budget is None or whole.peak <= tv.memory_budget:
            return whole, max(lo)
    return planned(0), 0


def _piece_passes(tv, part: Program, part_shape, ref: str, tile: int, s: Setting, exact: Setting,
                  full: int, held: int, cuts: tuple[int, ...], kind: str) -> list[Pass]:
    """Each piece's sampled tiles' and other tiles' passes, the value between pieces held whole; the
    sampled tiles staged in every piece when they do not fit at once in one."""
    pieces = split_pieces(part, cuts)
    shapes = part.shapes(tuple(part_shape[-2:]))
    staged = None
    while True:
        out, h, x_shape, used = [], held, part_shape, False
        for j, piece in enumerate(pieces):
            pref, ptile = piece_grid(piece, shapes, ref, tile, kind)
            tag = f" (piece {j + 1} of {len(pieces)})" if len(pieces) > 1 else ""
            sp, rp, was = _piece_pair(tv, piece, x_shape, pref, ptile, s, exact, full, h, staged, tag)
            out += [sp, rp]
            used |= was
            h, x_shape = rp.output_bytes, rp.output_shape
        if staged is not None or not used or len(pieces) == 1:
            return out
        staged = True  # (one flag for the run: every piece's sampled tiles staged)


def _piece_pair(tv, part: Program, part_shape, ref: str, tile: int, s: Setting, exact: Setting, full: int,
                held: int, staged: bool | None, tag: str) -> tuple[Pass, Pass, bool]:
    """The sampled tiles' and the other tiles' passes over (a piece of) the part, holding `held` (its
    input); staged None: staged when the sampled tiles do not fit at once."""
    rh, rw = part.shapes(tuple(part_shape[-2:]))[ref]
    grid = tile_grid((rh, rw), tile)  # (as the run)
    sampled = {t.index for t in sample_tiles(grid, sample_fraction(tv, "tiles"))}
    fixed = {id(op) for op in part.ops if op.kind == "group_norm"}
    sp = pass_plan(tv, "sampled tiles", part, part_shape, tile, s, ref, fixed, full, sampled, True)
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
    if staged is None:
        staged = s.staging == "disk" or (s.gpu and tv.memory_budget is not None
                                         and sp.peak + held > tv.memory_budget)
    if staged:  # staged_tile_stats: cut at every GroupNorm, one tile at a time, its regions staged
        work, flops = sp.work, sp.flops  # each tile still runs on its regions back-propagated through
        regions = {t.index: back_propagate(part.ops, {part.output: map_box(t.core, (rh, rw),
                                                                            pshapes[part.output])}, pshapes)
                   for t in chosen}  # the whole part
        unchecked = Setting(**{**exact.__dict__, "checks": False, "read_ahead": False})  # (no reads ahead)
        sp = pass_plan(tv, "sampled tiles" + (", staged" if s.staging != "disk" else "") + tag, part,
                       part_shape, tile, unchecked, ref, set(), full, sampled, regions=regions)
        sp.work, sp.flops = work, flops
        sp.launches += ADJUST * len(fixed) if tv.fast_low else 0  # (its statistics: as exact mode's)
    else:  # sampled_tile_stats: every sampled tile's values at once, op by op, and their statistics
        sp.name += tag
        sp.launches += sample_stats_cost(part, grid, sampled, pshapes, pchans, ref, s,
                                         bool(tv.fast_low)).launches
    sp.syncs = 0  # (no finite checks: the sampled tiles' outputs are checked with the other tiles')
    out_hw = sp.output_shape[-2:]
    kept = sum(math.prod(sp.output_shape[:2]) * box_area(map_box(t.core, (rh, rw), out_hw)) * s.item
               for t in chosen)
    sp.output_bytes, sp.peak = kept, sp.peak - sp.output_bytes + kept
    rest = {t.index for t in grid} - sampled
    rp = pass_plan(tv, "other tiles" + tag, part, part_shape, tile, s, ref, fixed, full, rest, banded=False)
    return with_held(sp, held), with_held(rp, held + kept), staged and s.staging != "disk"
